"""Remote throughput and latency: one worker process joining through an Edge file on
loopback. Warms up with 200 jobs, then runs N no-op Cores(1) jobs through the delayed API
and prints tasks/s; then times single jobs on the idle worker (submit to result).

    python bench/bench_remote.py [N] [WORKERS] [CORES]

Each worker offers CORES cores (default 8, like bench_local.py; on a smaller machine the
ids past the real ones are virtual: --oversubscribe). With CORES=2 on a 2-core machine
only two jobs are ever in flight, and the figure measures round trips, not the protocol.

The last line is the throughput in tasks/s."""
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import grain  # noqa: E402
from grain.delayed import delayed, each  # noqa: E402
from grain.resource import Cores  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
CORES = int(sys.argv[3]) if len(sys.argv) > 3 else 8   # per worker, as bench_local's 8


@delayed
async def noop():
    pass


async def mission(edge):
    async with grain.GrainExecutor(listen=f"edge://{edge}") as exer:
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "..", "grain.py"),
                                   "worker", "--url", f"edge://{edge}", "--name", f"w{i}",
                                   "--res", '{"Cores": {"N": %d}}' % CORES, "--oversubscribe"])
                 for i in range(WORKERS)]
        await exer.wait_for_workers(WORKERS)
        job = noop @ Cores(1)
        await each([job() for _ in range(200)])           # warm-up
        t0 = time.perf_counter()
        await each([job() for _ in range(N)])
        dt = time.perf_counter() - t0
        latencies = []
        for _ in range(200):
            t = time.perf_counter()
            await job()
            latencies.append(time.perf_counter() - t)
    for p in procs:
        p.wait(10)
    return dt, latencies


if __name__ == "__main__":
    import trio

    logging.getLogger("grain").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        dt, lat = trio.run(mission, os.path.join(d, "edge"))
    lat.sort()
    print(f"remote: {N} jobs through {WORKERS} worker process(es) of {CORES} cores "
          f"in {dt:.3f} s")
    print(f"latency submit-to-result on an idle worker: median "
          f"{statistics.median(lat) * 1e3:.3f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.3f} ms")
    print(f"{N / dt:.0f} tasks/s")
