"""Delayed calls with and without resources, as upstream's own bench/test_delayed.py
times them: 300 @delayed no-op calls (each awaits trio.sleep(0)), awaited one by one
("serial") and all at once ("parallel"), with no resource and with Memory(0), in a run()
whose local worker offers Memory(0). Medians of 30 repetitions of each, in ms per 300
calls; the last line is "serial0 A parallel0 B serialx C parallelx D" (ms).

    python bench/bench_delayed.py [--impl grainpy|upstream] [--calls 300] [--reps 30]

A call with no resource runs in the mission at once (in the order of the calls); one
with a resource goes through the queue to the local worker."""
import statistics
import time

from _peers import parse_impl

IMPL, ARGS = parse_impl()
CALLS = int(ARGS[ARGS.index("--calls") + 1]) if "--calls" in ARGS else 300
REPS = int(ARGS[ARGS.index("--reps") + 1]) if "--reps" in ARGS else 30


def main():
    import trio
    from grain.delayed import delayed, each, run
    from grain.resource import Memory

    @delayed
    async def nop():
        await trio.sleep(0)

    async def serial0():
        for _ in range(CALLS):
            await nop()

    async def parallel0():
        await each([nop() for _ in range(CALLS)])

    async def serialx():
        for _ in range(CALLS):
            await (nop @ Memory(0))()

    async def parallelx():
        await each([(nop @ Memory(0))() for _ in range(CALLS)])

    medians = {}

    async def measure():
        for case in (serial0, parallel0, serialx, parallelx):
            times = []
            for _ in range(REPS):
                t = time.perf_counter()
                await case()
                times.append(time.perf_counter() - t)
            medians[case.__name__] = statistics.median(times) * 1e3

    run(measure, config_file=False, local=Memory(0))
    print(f"delayed calls ({IMPL}), {CALLS} a case, median of {REPS}: " + ", ".join(
        f"{name} {ms:.2f} ms" for name, ms in medians.items()))
    print(" ".join(f"{name} {ms:.2f}" for name, ms in medians.items()))


if __name__ == "__main__":
    main()
