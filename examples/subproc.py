"""A CPU-bound sync function run in the subprocess pool: each call runs in a pool process,
pinned to the core its job was given, and prints that allocation from the child. As in
upstream Grain's documentation, ``f`` reads ``GVAR`` without importing it (the pool process
binds it, as upstream's does).

    python examples/subproc.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grain.subproc import subprocify, subprocess_pool_scope
from grain.resource import Cores
from grain.delayed import delayed, run


@delayed
@subprocify
def f(x):
    """a synchronous, computationally intensive function"""
    print(f"Running in a subprocess with {GVAR.res}")
    return x**2


async def main():
    async with subprocess_pool_scope():
        assert await (f @ Cores(1))(1) == 1
        assert await (f @ Cores(1))(2) == 4


if __name__ == "__main__":
    # Run with CPU cores 0, 1
    run(main, config_file=False, rpw=Cores([0, 1]))
