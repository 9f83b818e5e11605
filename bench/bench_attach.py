"""Time from run() to the first job started, through a head daemon: once when run() must
start the daemon (a worker already waits on the Edge file for a head to call it), then
when the daemon is already running (median of ROUNDS missions).

    python bench/bench_attach.py [ROUNDS]

The last line gives both figures in milliseconds."""
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GRAIN = os.path.join(HERE, "..", "grain.py")
sys.path.insert(0, os.path.join(HERE, ".."))

from grain.delayed import delayed, run  # noqa: E402
from grain.resource import Cores  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10


@delayed
async def started_at():
    return time.time()


async def main():
    return await (started_at @ Cores(1))()


def first_job_after_run(address):
    t0 = time.time()
    started = run(main, config_file=False, address=address)
    return (started - t0) * 1000


def bench():
    logging.getLogger("grain").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        address = f"edge://{tmp}/edge"
        os.chdir(tmp)  # where the daemon's log goes (head.log_file is relative)
        worker = subprocess.Popen([sys.executable, GRAIN, "worker", "--url", address,
                                   "--res", '{"Cores": {"N": 1}}'],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(f"{tmp}/edge"):  # the worker waits for a head to call
                time.sleep(0.01)
            time.sleep(0.2)
            spawn = first_job_after_run(address)
            attached = [first_job_after_run(address) for _ in range(ROUNDS)]
        finally:
            subprocess.run([sys.executable, GRAIN, "stop", "-a", address],
                           capture_output=True)
            worker.wait(15)
    print(f"run() to first job started: {spawn:.0f} ms starting the head daemon; "
          f"{statistics.median(attached):.1f} ms with it running (median of {ROUNDS})")


if __name__ == "__main__":
    bench()
