"""A job per external program, the usual shape of a grain mission: each job runs a
program (here `sh`, present everywhere) with run_program, which pins it to the job's cores,
gives it the job's allocation in its environment (OMP_NUM_THREADS, and
CUDA_VISIBLE_DEVICES for a job with Gpus) and stops it with the job.

    python examples/programs.py

Expected: four lines such as "3 squared is 9 (2 thread(s))", then [1, 4, 9, 16]."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, each, run
from grain.resource import Cores


@delayed
async def square(x):
    from grain import run_program
    # a program writes its answer; a failing one would raise ProgramError with its stderr
    done = await run_program(["sh", "-c", 'echo "$(($1 * $1)) $OMP_NUM_THREADS"', "sh",
                              str(x)], stdout=subprocess.PIPE)
    value, threads = done.stdout.decode().split()
    print(f"{x} squared is {value} ({threads} thread(s))")
    return int(value)


async def main():
    return await each((square @ Cores(2))(x) for x in range(1, 5))


if __name__ == "__main__":
    print(run(main, local=Cores(4), config_file=False))
