"""Local throughput: N no-op Cores(1) jobs through the delayed API on an in-process worker
of 8 cores. Prints tasks/s on the last line.

    python bench/bench_local.py [N]
"""
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, each, run  # noqa: E402
from grain.resource import Cores  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000


@delayed
async def noop():
    pass


async def main():
    job = noop @ Cores(1)
    t0 = time.perf_counter()
    await each([job() for _ in range(N)])
    return time.perf_counter() - t0


if __name__ == "__main__":
    logging.getLogger("grain").setLevel(logging.WARNING)
    best = None
    for _ in range(3):
        dt = run(main, local=Cores(8), config_file=False)
        best = dt if best is None else min(best, dt)
    print(f"local throughput: {N} jobs, best of 3: {best:.3f} s")
    print(f"{N / best:.0f} tasks/s")
