"""What a results store costs: bench_local.py and bench_remote.py without and
with --results, alternating, for R rounds; then the head's own per-job work for the store,
timed alone (keying a job, recording its result, handing it to the writer process), and
the writer's work (inserting and committing the rows).

    python bench/bench_store.py [--rounds 5] [N]

Prints, for each benchmark, the median tasks/s both ways, the median of the rounds' ratios,
and the overhead per job (1/with - 1/without, of the medians) in microseconds; the last
line is the head's path alone and the writer process's work: "store X us/job on the
head's path ...; Y us/job in the writer process"."""
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tasks_per_s(script, n, results):
    argv = [sys.executable, os.path.join(HERE, script), str(n)] + (["--results"] if results
                                                                  else [])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"^(\S+) tasks/s", out.strip().splitlines()[-1]).group(1))


def head_path(n=50_000):
    """Microseconds per job of MissionResults.known + record + handing the rows to the
    writer process (pickling them), all on the head's event loop; and of the writer's
    own work (inserting and committing them), in its process."""
    sys.path.insert(0, ROOT)
    import grain
    from grain.resource import Cores

    async def compute(i):
        return i

    with tempfile.TemporaryDirectory() as d:
        results = grain.MissionResults(os.path.join(d, "results.db"))
        results.store.open()
        jobs = [grain.Job(i, Cores(1), compute, (i,), {}) for i in range(n)]
        for job in jobs:
            job.duration = 0.001
        t0 = time.perf_counter()
        for job in jobs:
            results.known(job)
            results.record(job, job.id, None, None)
        rows = results.store.take()
        pickle.dumps(rows, protocol=4)
        head = time.perf_counter() - t0
        t0 = time.perf_counter()
        results.store.write(rows)  # what the writer process does with them
        writer = time.perf_counter() - t0
        results.store.close()
    return head / n * 1e6, writer / n * 1e6


if __name__ == "__main__":
    args = sys.argv[1:]
    rounds = 5
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    n = int(args[0]) if args else 20_000
    for script in ("bench_local.py", "bench_remote.py"):
        without, with_ = [], []
        for r in range(rounds):
            without.append(tasks_per_s(script, n, False))
            with_.append(tasks_per_s(script, n, True))
            print(f"  {script} round {r + 1}: {without[-1]:.0f} / {with_[-1]:.0f} tasks/s",
                  file=sys.stderr)
        a, b = statistics.median(without), statistics.median(with_)
        # (the ratio within each round, then their median: a machine whose speed drifts
        # between rounds moves both runs of a round alike)
        ratio = statistics.median(w / o for o, w in zip(without, with_))
        print(f"{script}: {a:.0f} tasks/s without a store, {b:.0f} with; with / without "
              f"{ratio:.0%}; {(1 / b - 1 / a) * 1e6:.1f} us per job")
    head, writer = head_path()
    print(f"store {head:.1f} us/job on the head's path (key, record, hand to the writer); "
          f"{writer:.1f} us/job in the writer process (insert, commit)")
