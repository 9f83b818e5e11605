"""Jobs that each need one core, on a local worker holding cores 0 and 1: the third job
waits for a free core (the second program of upstream Grain's tutorial).

    python examples/tutorial_resources.py

Expected: job 3 starts only when job 1 gives its core back; about 0.4 s in all."""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, run
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


async def elevated_sum(l):
    s_ = 0
    for x in l:
        s_ += (add @ Cores(1))(x)
    s = await s_
    print(f"elevated_sum({l}) = {s}")
    return s


if __name__ == "__main__":
    run([partial(elevated_sum, [1, 2, 3])], local=Cores([0, 1]), config_file=False)
