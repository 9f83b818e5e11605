"""Remote throughput and latency, through worker processes on loopback.

    python bench/bench_remote.py [--impl grainpy|upstream|dask] [N] [--workers W]
                                 [--cores C] [--latency] [--results] [--url URL]
                                 [--tls CERT,KEY]

Starts W worker processes of C cores (default 1 and 8, as bench_local.py's worker; ids past
the machine's real cores are virtual), waits until all have joined, runs 200 warm-up jobs,
then N no-op Cores(1) jobs through the delayed API: the last line is tasks/s. With
--latency, instead times 200 single jobs one after the other on the idle worker(s) (submit
to result): the last line is "p50 X ms p99 Y ms". With --results (grain.py), the mission
keeps a results store (a new one, in the temporary directory). With --tls (grain.py),
head and workers speak TLS with that certificate and key (see the README's Security).

grainpy: the head listens on an Edge file (or at --url, e.g. tcp://127.0.0.1:0 or a
bridge://); workers are `grain.py worker --url edge://...` (or that URL).
upstream: its pure-Python head on tcp://127.0.0.1 ([head.gnaw] enabled = false); workers
are `python -m grain.worker --url ... --res ...`. Dask: LocalCluster(processes=True) with
W workers of C threads and C "cores" of resources."""
import os
import statistics
import tempfile
import time

import _peers
from _peers import noop_sync, parse_impl

IMPL, ARGS = parse_impl()


def option(name, default):
    if name in ARGS:
        i = ARGS.index(name)
        value = ARGS[i + 1]
        del ARGS[i:i + 2]
        return int(value)
    return default


WORKERS = option("--workers", 1)
CORES = option("--cores", 8)
LATENCY = "--latency" in ARGS
if LATENCY:
    ARGS.remove("--latency")
RESULTS = "--results" in ARGS
if RESULTS:
    ARGS.remove("--results")
URL = None
if "--url" in ARGS:
    URL = ARGS.pop(ARGS.index("--url") + 1)
    ARGS.remove("--url")
TLS = ()
if "--tls" in ARGS:
    TLS = tuple(ARGS.pop(ARGS.index("--tls") + 1).split(","))
    ARGS.remove("--tls")
N = int(ARGS[0]) if ARGS else 20_000


async def measure(each, one):
    """Warm up, then time N jobs (or 200 single ones); ``one()`` gives one job to await."""
    await each([one() for _ in range(200)])
    if LATENCY:
        times = []
        for _ in range(200):
            t = time.perf_counter()
            await one()
            times.append(time.perf_counter() - t)
        return times
    t0 = time.perf_counter()
    await each([one() for _ in range(N)])
    return time.perf_counter() - t0


def grainpy():
    import trio
    import grain
    from grain.delayed import delayed, each
    from grain.resource import Cores

    @delayed
    async def noop():
        pass

    async def mission(edge):
        procs = []
        store = os.path.join(os.path.dirname(edge), "results.db") if RESULTS else None
        try:
            key = grain.load_auth_key(None, *TLS)
            async with grain.GrainExecutor(listen=URL or f"edge://{edge}", key=key,
                                           results=store) as exer:
                url = exer.urls.get("tcp", URL) if URL else edge
                tls = ("--tls-cert", TLS[0], "--tls-key", TLS[1]) if TLS else ()
                procs += [_peers.grainpy_worker(url, CORES, f"w{i}", *tls)
                          for i in range(WORKERS)]
                await exer.wait_for_workers(WORKERS)
                return await measure(each, lambda: (noop @ Cores(1))())
        finally:  # the head has told its workers to leave as it closed
            _peers.stop(procs)

    with tempfile.TemporaryDirectory() as d:
        return trio.run(mission, os.path.join(d, "edge"))


def upstream():
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def noop():
        pass

    port = _peers.free_port()
    box, procs = [], []

    async def main():
        procs.extend(_peers.upstream_worker(port, CORES) for _ in range(WORKERS))
        await _peers.upstream_wait_for_workers(WORKERS)
        box.append(await measure(each, lambda: (noop @ Cores(1))()))

    try:
        run(main, config_file=_peers.upstream_config(port))
    finally:
        _peers.stop(procs)
    return box[0]


def dask():
    cluster, client = _peers.dask_cluster(WORKERS, CORES, processes=True)
    with cluster, client:
        client.wait_for_workers(WORKERS)

        def submit():
            return client.submit(noop_sync, resources={"cores": 1}, pure=False)

        client.gather([submit() for _ in range(200)])
        if LATENCY:
            times = []
            for _ in range(200):
                t = time.perf_counter()
                submit().result()
                times.append(time.perf_counter() - t)
            return times
        t0 = time.perf_counter()
        client.gather([submit() for _ in range(N)])
        return time.perf_counter() - t0


if __name__ == "__main__":
    out = {"grainpy": grainpy, "upstream": upstream, "dask": dask}[IMPL]()
    if LATENCY:
        out.sort()
        p50, p99 = statistics.median(out) * 1e3, out[int(len(out) * 0.99)] * 1e3
        print(f"latency ({IMPL}): 200 single jobs on {WORKERS} idle worker(s)")
        print(f"p50 {p50:.3f} ms p99 {p99:.3f} ms")
    else:
        print(f"remote throughput ({IMPL}): {N} jobs through {WORKERS} worker process(es) "
              f"of {CORES} cores in {out:.3f} s")
        print(f"{N / out:.0f} tasks/s")
