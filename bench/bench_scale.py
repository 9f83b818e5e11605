"""Scale: W (default 100) worker processes join one head at once; the time from starting
them until all have registered, and the head's RSS then. Then, with a new head, the
throughput of N no-op Cores(1) jobs through 16 workers of 8 cores.

    python bench/bench_scale.py [--impl grainpy|upstream] [W]

grainpy: one Edge file, workers `grain.py worker` of 1 core each; the head runs in this
process. upstream: its pure-Python head on tcp://127.0.0.1, `python -m grain.worker`.
(Dask is not run: a hundred Dask worker processes need several GB and minutes here.)
The last line is "join X s rss Y MB tput16 Z tasks/s"."""
import os
import subprocess
import sys
import tempfile
import time

import _peers
from _peers import parse_impl, rss_bytes

IMPL, ARGS = parse_impl()
W = int(ARGS[0]) if ARGS else 100
N = 20_000


def grainpy():
    import trio
    import grain

    async def joins(edge):
        procs = []
        try:
            async with grain.GrainExecutor(listen=f"edge://{edge}") as exer:
                t0 = time.perf_counter()
                procs += [_peers.grainpy_worker(edge, 1, f"w{i}") for i in range(W)]
                await exer.wait_for_workers(W)
                return time.perf_counter() - t0, rss_bytes()
        finally:
            _peers.stop(procs, timeout=30)

    with tempfile.TemporaryDirectory() as d:
        return trio.run(joins, os.path.join(d, "edge"))


def upstream():
    from grain.delayed import run
    port = _peers.free_port()
    box, procs = [], []

    async def main():
        t0 = time.perf_counter()
        procs.extend(_peers.upstream_worker(port, 1) for _ in range(W))
        await _peers.upstream_wait_for_workers(W, timeout=600)
        box.append((time.perf_counter() - t0, rss_bytes()))

    try:
        run(main, config_file=_peers.upstream_config(port))
    finally:
        _peers.stop(procs, timeout=30)
    return box[0]


def throughput16():
    out = subprocess.run([sys.executable, os.path.join(_peers.HERE, "bench_remote.py"),
                          "--impl", IMPL, "--workers", "16", str(N)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1].split()[0])


if __name__ == "__main__":
    join_s, rss = grainpy() if IMPL == "grainpy" else upstream()
    tput = throughput16()
    print(f"scale ({IMPL}): {W} workers registered in {join_s:.2f} s; head RSS "
          f"{rss / 1e6:.0f} MB; {N} jobs through 16 workers: {tput:.0f} tasks/s")
    print(f"join {join_s:.2f} s rss {rss / 1e6:.0f} MB tput16 {tput:.0f} tasks/s")
