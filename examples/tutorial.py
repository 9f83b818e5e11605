"""Three delayed jobs without resources, run at once in the mission (the first program of
upstream Grain's tutorial).

    python examples/tutorial.py

Expected: the three `add` jobs overlap, `elevated_sum([1, 2, 3]) = 9`, about 0.3 s."""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.delayed import delayed, run
from grain import GVAR


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
        s_ += add(x)
    s = await s_
    print(f"elevated_sum({l}) = {s}")
    return s


if __name__ == "__main__":
    run([partial(elevated_sum, [1, 2, 3])], config_file=False)
