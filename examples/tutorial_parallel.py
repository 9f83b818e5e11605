"""Three delayed "branch" functions in parallel, each summing three one-core "leaf"
jobs, on a local worker with cores 0 and 1 (the third program of upstream Grain's
tutorial).

    python examples/tutorial_parallel.py

Expected: sums 9, 18 and 27, in that order (the leaves start in the order their branches
asked for them); about 2.5 s in all."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, each, run
from grain import GVAR
from grain.resource import Cores


@delayed
async def add(x):
    # import inside the function because a tasklet should not have global reference
    import trio
    print(f"start adding to {x} with resource {GVAR.res}")
    await trio.sleep(x / 10)  # simulate lengthy calculation
    print(f"done adding to {x}")
    return x + 1


@delayed
async def elevated_sum(l):
    s_ = 0
    for x in l:
        s_ += (add @ Cores(1))(x)
    s = await s_
    print(f"elevated_sum({l}) = {s}")
    return s


async def main():
    data = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    jobs = [elevated_sum(d) for d in data]
    return [await j for j in jobs]
    # the two lines above can be simplified with helper `each`:
    # return await each(elevated_sum(d) for d in data)


if __name__ == "__main__":
    print(run(main, local=Cores([0, 1]), config_file=False))
