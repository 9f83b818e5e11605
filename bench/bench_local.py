"""Local throughput: N no-op Cores(1) jobs through the delayed API on an in-process worker
of 8 cores, after 200 warm-up jobs. Prints tasks/s on the last line.

    python bench/bench_local.py [--impl grainpy|upstream|dask] [N] [--results]

--results (grain.py): the mission keeps a results store (a new one, in a temporary directory).

Dask: a LocalCluster in this process (processes=False) with one worker of 8 threads and 8
"cores" of resources, the same no-op as a plain function, resources={"cores": 1}."""
import os
import tempfile
import time

from _peers import noop_sync, parse_impl

IMPL, ARGS = parse_impl()
RESULTS = "--results" in ARGS
if RESULTS:
    ARGS.remove("--results")
N = int(ARGS[0]) if ARGS else 20_000


def grain_like():
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def noop():
        pass

    async def main():
        # (noop @ Cores(1))() each time: upstream's @ sets the request for one call only
        await each([(noop @ Cores(1))() for _ in range(200)])
        t0 = time.perf_counter()
        await each([(noop @ Cores(1))() for _ in range(N)])
        return time.perf_counter() - t0

    if IMPL == "grainpy":
        with tempfile.TemporaryDirectory() as d:
            store = {"results": os.path.join(d, "results.db")} if RESULTS else {}
            return run(main, local=Cores(8), config_file=False, **store)
    box = []  # upstream's run() returns nothing

    async def upstream_main():
        box.append(await main())

    run(upstream_main, local=Cores(8), config_file=False)
    return box[0]


def dask():
    from _peers import dask_cluster
    cluster, client = dask_cluster(1, 8, processes=False)
    with cluster, client:
        client.gather(client.map(noop_sync, range(200), resources={"cores": 1}, pure=False))
        t0 = time.perf_counter()
        client.gather(client.map(noop_sync, range(N), resources={"cores": 1}, pure=False))
        return time.perf_counter() - t0


if __name__ == "__main__":
    dt = dask() if IMPL == "dask" else grain_like()
    print(f"local throughput ({IMPL}{', results store' if RESULTS else ''}): {N} jobs in "
          f"{dt:.3f} s")
    print(f"{N / dt:.0f} tasks/s")
