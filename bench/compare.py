"""Run the benchmarks for grain.py, upstream Grain 0.17.1 and Dask side by side, and print
a markdown table of the medians.

    bash bench/setup.sh                 # once: the three virtualenvs under bench/.venvs/
    python bench/compare.py [--rounds 5] [--only NAME ...] [--no-dask]
    python bench/compare.py --vs REF|DIR|BASELINE [--rounds 5] [--only NAME ...]

--vs compares this checkout's grain.py with another's, running each benchmark from its own
checkout, alternating; it needs only the grainpy venv (or runs under this Python). REF is
a commit (checked out for the run in a temporary git worktree beside this one, removed
after), DIR a checkout, BASELINE the commit bench/BASELINE names: the fixed reference
every change to the per-job path is measured against (moved forward only when a change
is faster), not the start of one's own work.

Each figure is measured in rounds, and within a round every implementation runs once in
turn (grain.py, upstream, Dask, then again), so that a slow minute of a shared machine
falls on all of them alike; the table gives the median of the rounds. Ratios are grain.py
divided by upstream (with --vs: by the other checkout, and "paired", the median of each
round's own ratio). Progress goes to stderr, the table to stdout."""
import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
VENVS = os.path.join(HERE, ".venvs")
ALL = ("grainpy", "upstream", "dask")
NAMES = {"grainpy": "grain.py", "upstream": "upstream 0.17.1", "dask": "Dask"}

# name, script and arguments, implementations, [(figure, regex on the last line, unit,
# higher is better)]
BENCHMARKS = [
    ("local", ["bench_local.py"], ALL,
     [("local throughput, 20,000 jobs, 8-core in-process worker", r"^(\S+) tasks/s",
       "tasks/s", True)]),
    ("remote1", ["bench_remote.py", "--workers", "1"], ALL,
     [("remote throughput, 1 worker process", r"^(\S+) tasks/s", "tasks/s", True)]),
    ("remote4", ["bench_remote.py", "--workers", "4"], ALL,
     [("remote throughput, 4 worker processes", r"^(\S+) tasks/s", "tasks/s", True)]),
    ("latency", ["bench_remote.py", "--latency"], ALL,
     [("latency p50, idle remote worker", r"^p50 (\S+) ms", "ms", False),
      ("latency p99, idle remote worker", r"p99 (\S+) ms", "ms", False)]),
    ("memory", ["bench_memory.py"], ALL,
     [("memory per queued job, 100,000 queued", r"^(\S+) bytes/job", "bytes", False)]),
    ("startup", ["bench_startup.py"], ALL,
     [("start-up: version command, median of 10", r"^version (\S+) ms", "ms", False),
      ("start-up: import the API, median of 10", r"import (\S+) ms", "ms", False)]),
    ("scale", ["bench_scale.py"], ("grainpy", "upstream"),
     [("100 workers joining one head: time until all registered", r"^join (\S+) s",
       "s", False),
      ("head RSS with 100 workers", r"rss (\S+) MB", "MB", False),
      ("remote throughput, 16 worker processes", r"tput16 (\S+) tasks/s", "tasks/s",
       True)]),
    ("delayed", ["bench_delayed.py"], ("grainpy", "upstream"),
     [("300 delayed calls, no resource, awaited one by one", r"^serial0 (\S+)", "ms", False),
      ("300 delayed calls, no resource, awaited together", r"parallel0 (\S+)", "ms", False),
      ("300 delayed calls with Memory(0), one by one", r"serialx (\S+)", "ms", False),
      ("300 delayed calls with Memory(0), together", r"parallelx (\S+)", "ms", False)]),
    ("quality", ["bench_quality.py"], ALL,
     [("scheduling quality: makespan / lower bound, 2,000 mixed jobs on 2×8 cores",
       r"^(\S+) x lower bound", "×", False)]),
]


def run_one(impl, args, bench_dir=HERE):
    """The last line of one benchmark run; ``impl`` "vs" is grain.py in ``bench_dir``."""
    python = os.path.join(VENVS, "grainpy" if impl == "vs" else impl, "bin", "python")
    if not os.path.exists(python):
        if impl not in ("grainpy", "vs"):
            sys.exit(f"compare.py: {python} is missing; run `bash bench/setup.sh` first")
        python = sys.executable
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as for a user: bytecode caches are kept
    cp = subprocess.run([python, os.path.join(bench_dir, args[0]), "--impl",
                         "grainpy" if impl == "vs" else impl, *args[1:]],
                        cwd=bench_dir, env=env, capture_output=True, text=True, timeout=1800)
    lines = cp.stdout.strip().splitlines()
    if cp.returncode != 0 or not lines:
        tail = (cp.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {impl} {' '.join(args)}: failed (exit {cp.returncode}): {tail}",
              file=sys.stderr)
        return None
    return lines[-1]


def measure(name, args, runs, figures, rounds):
    """``{(figure, impl): [value per round]}``, the ``runs`` ((impl, bench dir), ...) taking
    turns within each round."""
    values = {(f[0], impl): [] for f in figures for impl, _ in runs}
    for r in range(rounds):
        for impl, where in runs:
            line = run_one(impl, args, where)
            print(f"[{name} round {r + 1}/{rounds}] {impl}: {line}", file=sys.stderr)
            for label, regex, _, _ in figures:
                m = re.search(regex, line or "")
                if m and m.group(1) != "-":
                    values[(label, impl)].append(float(m.group(1)))
    return values


def fmt(v, unit):
    if v is None:
        return "—"
    if unit in ("tasks/s", "bytes", "MB"):
        return f"{v:,.0f} {unit}"
    if unit == "×":
        return f"{v:.3f}"
    return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", choices=[b[0] for b in BENCHMARKS])
    ap.add_argument("--no-dask", action="store_true")
    ap.add_argument("--vs", metavar="REF", help="compare with the grain.py of commit REF, "
                    "of checkout REF (a directory), or of bench/BASELINE's commit (BASELINE)")
    opts = ap.parse_args()
    if opts.vs and os.path.isdir(opts.vs):
        return compare_checkouts(opts, opts.vs)
    if opts.vs:
        return compare_commit(opts)
    rows = []
    for name, args, impls, figures in BENCHMARKS:
        if opts.only and name not in opts.only:
            continue
        impls = [i for i in impls if not (opts.no_dask and i == "dask")]
        values = measure(name, args, [(i, HERE) for i in impls], figures, opts.rounds)
        for label, _, unit, _higher in figures:
            med = {i: statistics.median(values[(label, i)]) if values.get((label, i)) else None
                   for i in ALL}
            ratio = (f"{med['grainpy'] / med['upstream']:.2f}"
                     if med["grainpy"] and med["upstream"] else "—")
            rows.append((label, *(fmt(med[i], unit) for i in ALL), ratio))
    cores = os.cpu_count()
    print(f"{datetime.date.today()}, {cores} cores, Python {platform.python_version()}, "
          f"`python bench/compare.py --rounds {opts.rounds}`: medians of {opts.rounds} "
          "rounds, implementations alternating within each round.\n")
    print("| figure | grain.py | upstream 0.17.1 | Dask | grain.py / upstream |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def compare_commit(opts):
    """--vs REF: that commit checked out beside this one for the run."""
    ref = opts.vs
    if ref == "BASELINE":
        with open(os.path.join(HERE, "BASELINE")) as f:
            ref = f.read().split()[0]
    where = tempfile.mkdtemp(prefix="grain-vs-")
    git = ["git", "-C", os.path.dirname(HERE)]
    cp = subprocess.run(git + ["worktree", "add", "--detach", where, ref],
                        capture_output=True, text=True)
    if cp.returncode != 0:
        sys.exit(f"compare.py: --vs {opts.vs}: cannot check out {ref}: {cp.stderr.strip()}")
    try:
        return compare_checkouts(opts, where, ref)
    finally:
        subprocess.run(git + ["worktree", "remove", "--force", where], capture_output=True)


def compare_checkouts(opts, checkout, called=None):
    """This grain.py against the one in ``checkout`` (``called`` so in the table),
    alternating within each round."""
    other, called = os.path.join(os.path.abspath(checkout), "bench"), called or checkout
    rows = []
    for name, args, _, figures in BENCHMARKS:
        if opts.only and name not in opts.only:
            continue
        values = measure(name, args, [("grainpy", HERE), ("vs", other)], figures,
                         opts.rounds)
        for label, _, unit, _ in figures:
            this, vs = (statistics.median(values[(label, i)]) if values[(label, i)] else None
                        for i in ("grainpy", "vs"))
            pairs = [a / b for a, b in zip(values[(label, "grainpy")], values[(label, "vs")])
                     if b]
            rows.append((label, fmt(this, unit), fmt(vs, unit),
                         f"{this / vs:.2f}" if this and vs else "—",
                         f"{statistics.median(pairs):.2f}" if pairs else "—",
                         " / ".join(f"{v:g}" for v in values[(label, "grainpy")]),
                         " / ".join(f"{v:g}" for v in values[(label, "vs")])))
    print(f"{datetime.date.today()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, `python bench/compare.py --vs {opts.vs} --rounds "
          f"{opts.rounds}`: medians, the two alternating within each round. \"Paired\" is "
          "the median of the rounds' own ratios: each round's two runs share the machine's "
          "moment, so on a noisy machine it is the steadier figure.\n")
    print(f"| figure | this checkout | {called} | ratio | paired | rounds (this) | "
          f"rounds ({called}) |")
    print("|---|---:|---:|---:|---:|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
