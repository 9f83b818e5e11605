"""Scheduling quality: a fixed, seeded mix of 2,000 jobs asking 1-8 cores and sleeping
0.01-0.2 s, all submitted at once to two worker processes of 8 cores. The makespan (first
submission to last result) divided by the lower bound max(total core-seconds / 16, longest
job). Prints that ratio on the last line.

    python bench/bench_quality.py [--impl grainpy|upstream|dask] [JOBS]

Dask: LocalCluster(processes=True), two workers of 8 threads and 8 "cores" of resources,
time.sleep in the task."""
import os
import random
import tempfile
import time

import _peers
from _peers import parse_impl

IMPL, ARGS = parse_impl()
JOBS = int(ARGS[0]) if ARGS else 2_000
rng = random.Random(20261122)
MIX = [(rng.randint(1, 8), rng.uniform(0.01, 0.2)) for _ in range(JOBS)]
BOUND = max(sum(c * d for c, d in MIX) / 16, max(d for _, d in MIX))


async def sleep_for(d):
    import trio
    await trio.sleep(d)


def sleep_sync(d):
    time.sleep(d)


def grainpy():
    import trio
    import grain
    from grain.resource import Cores

    async def mission(edge):
        procs = []
        try:
            async with grain.GrainExecutor(listen=f"edge://{edge}") as exer:
                procs += [_peers.grainpy_worker(edge, 8, f"w{i}") for i in range(2)]
                await exer.wait_for_workers(2)
                t0 = time.perf_counter()
                jobs = [exer.submit(Cores(c), sleep_for, d) for c, d in MIX]
                for job in jobs:
                    await job
                return time.perf_counter() - t0
        finally:
            _peers.stop(procs)

    with tempfile.TemporaryDirectory() as d:
        return trio.run(mission, os.path.join(d, "edge"))


def upstream():
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    port = _peers.free_port()
    box, procs = [], []
    job = delayed(sleep_for)

    async def main():
        procs.extend(_peers.upstream_worker(port, 8) for _ in range(2))
        await _peers.upstream_wait_for_workers(2)
        t0 = time.perf_counter()
        await each([(job @ Cores(c))(d) for c, d in MIX])
        box.append(time.perf_counter() - t0)

    try:
        run(main, config_file=_peers.upstream_config(port))
    finally:
        _peers.stop(procs)
    return box[0]


def dask():
    cluster, client = _peers.dask_cluster(2, 8, processes=True)
    with cluster, client:
        client.wait_for_workers(2)
        t0 = time.perf_counter()
        client.gather([client.submit(sleep_sync, d, resources={"cores": c}, pure=False)
                       for c, d in MIX])
        return time.perf_counter() - t0


if __name__ == "__main__":
    makespan = {"grainpy": grainpy, "upstream": upstream, "dask": dask}[IMPL]()
    print(f"scheduling quality ({IMPL}): {JOBS} jobs, makespan {makespan:.2f} s, "
          f"lower bound {BOUND:.2f} s")
    print(f"{makespan / BOUND:.3f} x lower bound")
