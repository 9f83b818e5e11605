"""The model check of the head, longer than the test suite plays it: seeded sequences of
workers joining, dropping, falling silent, leaving and coming back, the fates of the
runs they are sent, and a mission killed and run again (with a results store or without),
played against a real executor on trio's virtual clock (see
test_the_head_keeps_its_promises_over_seeded_sequences_of_events in test_grain.py, where
the sequences, the scripted workers and the promises checked are described).

    python bench/bench_model.py [--sequences 100000] [--first-seed 10000] [--processes N]
    python bench/bench_model.py --replay SEED

The suite plays seeds 0 to 9,999; this goes on from --first-seed, in N processes (default:
one a core), and prints the sequences played, those that failed (each with its seed, what
was violated, and the smallest script that still fails) and the time a sequence took.
"""
import argparse
import logging
import multiprocessing
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The suite's model (one description of it). Imported here, before the pool forks: the test
# module gives the run a HOME of its own, which its processes share and this one removes.
import test_grain as model  # noqa: E402

signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the pool ends its processes so, at its end)

# The warnings of the faults the model plays are not printed (the model still hears them).
logging.getLogger("grain").propagate = False


def play(seeds):
    """Play ``seeds``: [(seed, violations, smallest failing script)] of those that fail."""
    failed = []
    for seed in seeds:
        found = model._play(model.model_script(seed), seed).violations
        if found:
            failed.append((seed, found, model._smallest_failing(model.model_script(seed), seed)))
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=100_000)
    parser.add_argument("--first-seed", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--replay", type=int, metavar="SEED")
    args = parser.parse_args()
    if args.replay is not None:
        failed = play([args.replay])
        print(f"seed {args.replay}: " + ("passes" if not failed else
                                         f"{failed[0][1]}\nsmallest failing: {failed[0][2]}"))
        return 1 if failed else 0
    seeds = range(args.first_seed, args.first_seed + args.sequences)
    chunks = [seeds[i:i + 500] for i in range(0, len(seeds), 500)]
    start = time.perf_counter()
    with multiprocessing.Pool(args.processes) as pool:
        failed = [f for part in pool.imap_unordered(play, chunks) for f in part]
    took = time.perf_counter() - start
    for seed, violations, script in sorted(failed):
        print(f"seed {seed}: {violations}\n  smallest failing: {script}")
    print(f"{len(seeds)} sequences (seeds {seeds[0]}-{seeds[-1]}), {len(failed)} failed, "
          f"{took:.0f} s in {args.processes} process(es): "
          f"{took * args.processes / len(seeds) * 1000:.1f} ms a sequence")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
