"""External programs as jobs: grain.py, upstream Grain 0.17.1, HyperQueue, Dask and Parsl
side by side on the work users give them (a program per molecule), not on no-op functions.

    python bench/bench_programs.py --setup        # once: the venvs under bench/.venvs/
    python bench/bench_programs.py [--rounds 9] [--systems NAME ...] [--quick]
                                   [--n1 2000] [--n2 200] [--n3 500]

Workloads, each with 2 task slots of one core in every system:
  W1  N1 x /bin/true: the scheduler's cost per program, as tasks/s.
  W2  N2 x `sleep 0.05`: how well it keeps both slots busy, as makespan / ideal, where
      ideal = N2 * 0.05 s / 2.
  W3  N3 x `python3 -c "print(sum(range(K)))"`, each K its own, stdout captured and
      returned to the caller: wall seconds. python3 is the grainpy venv's (--python3 to
      choose another): a plain interpreter, whose start-up no site-wide .pth slows.
Every result is checked: W1 and W2 exit codes 0, W3 each output equal to its sum. A run
with a wrong result counts as failed.

Systems (--systems, default all; one whose venv is missing or broken is reported as
skipped, with the reason):
  floor         no scheduler: 2 threads, each calling subprocess.run in a loop
  grain-local   grain.py, run(main, local=Cores(2)), jobs @ Cores(1) calling
                grain.run_program (pinned to the job's core)
  grain-worker  grain.py, a mission that is its own head with no local cores, and one
                `grain.py worker` process offering 2 cores; jobs as grain-local's
  grain-trio    grain.py as grain-local, its jobs calling trio.run_process (no pin)
  grain-local-1core, grain-worker-1core
                grain-local and grain-worker with the programs' machine made one core
                (the last): the mission, or the worker process, and its programs run on
                it, and the worker's head runs on another core (the first), as a head on
                a node of its own would. Where the two share cores (grain-worker), the
                head's work a job is CPU that in-process running never spends; here it
                is not, and what remains is the worker process's own cost a job. Needs 2
                cores or more
  upstream      grain-scheduler 0.17.1, run(main, local=Cores(2)), jobs @ Cores(1)
                calling trio.run_process (no pin)
  hyperqueue    HyperQueue's Python API: LocalCluster (server and worker in-process)
                with one worker of 2 cpus, one job of programs asking 1 cpu each; W3's
                stdout through the files it writes. Its client's wait_for_jobs answers
                on whole seconds (a job of one /bin/true takes 1.0 s): up to a second
                more on each time, which weighs on the --quick sizes
  dask          distributed LocalCluster, 2 worker processes x 1 thread, a function
                calling subprocess.run per task
  parsl         HighThroughputExecutor, one local block of 2 workers, a bash_app per
                task; W3's stdout through the files it writes

Each measurement is a fresh process under the system's venv (so one does not warm the
next): it starts the system, runs 4 x /bin/true as warm-up (so all slots are up), then
times the workload from the first submission to the last result in hand. Within a round
each workload runs on every system in turn, the order rotated each round, so that a slow
minute of a shared machine falls on all alike; the table gives the medians of the rounds.
Progress goes to stderr, the table to stdout."""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENVS = os.path.join(HERE, ".venvs")
SLOTS = 2
SLEEP_S = 0.05
WARM_UP = 4

# system: (venv, the import that must work there, what the table calls it)
SYSTEMS = {
    "floor": ("grainpy", "import subprocess", "bare threads, no scheduler (the floor)"),
    "grain-local": ("grainpy", "import trio, dill",
                    "grain.py, run_program, in-process worker"),
    "grain-worker": ("grainpy", "import trio, dill",
                     "grain.py, run_program, one worker process"),
    "grain-trio": ("grainpy", "import trio, dill",
                   "a grain.py job calling trio.run_process (no pin)"),
    "grain-local-1core": ("grainpy", "import trio, dill",
                          "grain.py, run_program, in-process worker, on one core"),
    "grain-worker-1core": ("grainpy", "import trio, dill",
                           "grain.py, run_program, one worker process on one core, "
                           "its head on another"),
    "upstream": ("upstream", "import grain.delayed, importlib.metadata as m; "
                 "assert m.version('grain-scheduler') == '0.17.1'",
                 "upstream 0.17.1 (trio.run_process, no pin)"),
    "hyperqueue": ("hyperqueue", "import hyperqueue.cluster",
                   "HyperQueue {version} (Python API, LocalCluster)"),
    "dask": ("dask", "import dask.distributed",
             "Dask distributed {version} LocalCluster"),
    "parsl": ("parsl", "import parsl.executors", "Parsl {version} HTEX, bash_app"),
}
PACKAGE = {"hyperqueue": "hyperqueue", "dask": "distributed", "parsl": "parsl"}
WORKLOADS = ("W1", "W2", "W3")


def programs(workload, n, python3):
    """``(argvs, expected stdouts or None)`` of a workload of ``n`` programs."""
    if workload == "W1":
        return [["/bin/true"]] * n, None
    if workload == "W2":
        return [[shutil.which("sleep"), str(SLEEP_S)]] * n, None
    ks = [1000 + i for i in range(n)]
    return ([[python3, "-c", f"print(sum(range({k})))"] for k in ks],
            [f"{sum(range(k))}\n" for k in ks])


###############################################################################
# One measurement: runs in the system's venv, prints one JSON line

def run_argv(argv, capture):
    """One program, run as a plain function would: ``(exit code, stdout or None)``."""
    done = subprocess.run(argv, stdout=subprocess.PIPE if capture else None)
    return done.returncode, done.stdout.decode() if capture else None


def floor(batches, capture):
    """SLOTS threads taking the next program from a shared list, no scheduler at all."""
    out = []
    for argvs in batches:
        results = [None] * len(argvs)
        todo, lock = iter(range(len(argvs))), threading.Lock()

        def loop():
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = run_argv(argvs[i], capture)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=loop) for _ in range(SLOTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.append((time.perf_counter() - t0, results))
    return out


async def with_run_program(argv, capture):
    """A grain job's body: the program through grain.run_program, pinned to the job's
    core."""
    import grain
    done = await grain.run_program(argv, stdout=subprocess.PIPE if capture else None,
                                   check=False)
    return done.returncode, done.stdout.decode() if capture else None


async def with_trio(argv, capture):
    """A grain job's body: the program through trio.run_process, not pinned."""
    import trio
    done = await trio.run_process(argv, capture_stdout=capture, check=False)
    return done.returncode, done.stdout.decode() if capture else None


async def grain_batches(program, batches, capture):
    from grain.delayed import each
    from grain.resource import Cores
    out = []
    for argvs in batches:
        t0 = time.perf_counter()
        # (program @ Cores(1))(...) each time: upstream's @ binds the request for one call
        results = await each([(program @ Cores(1))(argv, capture) for argv in argvs])
        out.append((time.perf_counter() - t0, [tuple(r) for r in results]))
    return out


def grain_local(batches, capture, body=with_run_program):
    from grain.delayed import delayed, run
    from grain.resource import Cores
    program = delayed(body)

    async def main():
        return await grain_batches(program, batches, capture)

    return run(main, local=Cores(SLOTS), config_file=False)


def grain_trio(batches, capture):
    return grain_local(batches, capture, body=with_trio)


def grain_local_1core(batches, capture):
    """grain_local, its process (so its programs) on the last core alone."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    return grain_local(batches, capture)


def grain_worker(batches, capture, cores=None):
    """Its own head with no local cores, listening on an Edge file; one `grain.py worker`
    process (this HOME, so the same key) offering SLOTS cores. ``cores``: ``(the head's,
    the worker's)`` sets of cores (the worker then offers SLOTS virtual ones)."""
    import _peers
    from grain.delayed import delayed, run
    from grain.resource import ZERO
    program = delayed(with_run_program)
    edge = os.path.join(os.getcwd(), "edge")
    procs = []

    async def main():
        if cores is None:
            procs.append(_peers.grainpy_worker(edge, SLOTS, "w0"))
        else:  # (a child's cores are those of the thread that started it)
            os.sched_setaffinity(0, cores[1])
            procs.append(_peers.grainpy_worker(edge, SLOTS, "w0", "--oversubscribe"))
            os.sched_setaffinity(0, cores[0])
        return await grain_batches(program, batches, capture)  # (warm-up waits for it)

    try:
        return run(main, local=ZERO, address=f"edge://{edge}", config_file=False)
    finally:
        _peers.stop(procs)


def grain_worker_1core(batches, capture):
    """grain_worker, its worker process (so its programs) on the last core alone and its
    head on the first."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    return grain_worker(batches, capture, cores=({min(allowed)}, {max(allowed)}))


def upstream(batches, capture):
    from grain.delayed import delayed, run
    from grain.resource import Cores
    program = delayed(with_trio)
    box = []  # upstream's run() returns nothing

    async def main():
        box.append(await grain_batches(program, batches, capture))

    run(main, local=Cores(SLOTS), config_file=False)
    return box[0]


def hyperqueue(batches, capture):
    """One job of programs per batch; W3's stdout from the file HyperQueue writes for each
    task, read back before the clock stops. HyperQueue names the tasks that failed, not
    their exit codes: a failed one is counted as exit 1."""
    from hyperqueue import Job
    from hyperqueue.cluster import LocalCluster, WorkerConfig
    from hyperqueue.ffi.protocol import ResourceRequest
    out = []
    with LocalCluster(server_dir=os.path.abspath("hq")) as cluster:
        cluster.start_worker(WorkerConfig(cores=SLOTS))
        client = cluster.client()
        for b, argvs in enumerate(batches):
            t0 = time.perf_counter()
            job, paths = Job(default_workdir=os.getcwd()), []
            for i, argv in enumerate(argvs):
                paths.append(os.path.abspath(f"hq-{b}-{i}.out") if capture else None)
                job.program(argv, stdout=paths[-1], stderr=None,
                            resources=ResourceRequest(cpus=1))
            submitted = client.submit(job)
            client.wait_for_jobs([submitted], raise_on_error=False)
            failed = client.get_failed_tasks(submitted)
            codes = [1 if i in failed else 0 for i in range(len(paths))]
            out.append((time.perf_counter() - t0, _with_outputs(codes, paths, capture)))
    return out


def _with_outputs(codes, paths, capture):
    """[(exit code, what the program wrote to its file, or None)] of a batch (the systems
    that write a program's stdout to a file of their own, not back to the caller)."""
    results = []
    for code, path in zip(codes, paths):
        if capture:
            with open(path) as f:
                results.append((code, f.read()))
        else:
            results.append((code, None))
    return results


def dask(batches, capture):
    import _peers
    cluster, client = _peers.dask_cluster(SLOTS, 1, processes=True)
    out = []
    with cluster, client:
        client.wait_for_workers(SLOTS)
        for argvs in batches:
            t0 = time.perf_counter()
            futures = client.map(run_argv, argvs, [capture] * len(argvs),
                                 resources={"cores": 1}, pure=False)
            results = client.gather(futures)
            out.append((time.perf_counter() - t0, [tuple(r) for r in results]))
    return out


def parsl(batches, capture):
    """A bash_app per program; its exit code from the app's future (a failed one raises
    BashExitFailure), W3's stdout from the file Parsl writes for it."""
    import parsl as p
    from parsl.app.app import bash_app
    from parsl.app.errors import BashExitFailure
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    @bash_app
    def program(command, stdout=None):
        return command

    config = Config(
        executors=[HighThroughputExecutor(
            label="htex", max_workers_per_node=SLOTS, cores_per_worker=1,
            address="127.0.0.1", worker_logdir_root=os.path.abspath("workers"),
            provider=LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1))],
        run_dir=os.path.abspath("runinfo"), strategy="none")
    out = []
    with p.load(config):
        for b, argvs in enumerate(batches):
            t0 = time.perf_counter()
            paths = [os.path.abspath(f"parsl-{b}-{i}.out") if capture else None
                     for i in range(len(argvs))]
            futures = [program(shlex.join(argv), stdout=path)
                       for argv, path in zip(argvs, paths)]
            codes = []
            for future in futures:
                try:
                    codes.append(future.result())
                except BashExitFailure as e:
                    codes.append(e.exitcode)
            out.append((time.perf_counter() - t0, _with_outputs(codes, paths, capture)))
    return out


RUNNERS = {"floor": floor, "grain-local": grain_local, "grain-worker": grain_worker,
           "grain-trio": grain_trio, "grain-local-1core": grain_local_1core,
           "grain-worker-1core": grain_worker_1core, "upstream": upstream,
           "hyperqueue": hyperqueue, "dask": dask, "parsl": parsl}


def check(results, expected, n):
    """Why ``results`` are wrong, or None: every exit code 0, every stdout as expected."""
    if len(results) != n:
        return f"{len(results)} results for {n} programs"
    bad = [(i, r) for i, r in enumerate(results)
           if r[0] != 0 or (expected is not None and r[1] != expected[i])]
    if bad:
        i, (code, stdout) = bad[0]
        want = f", expected {expected[i]!r}" if expected is not None else ""
        return (f"{len(bad)} of {n} wrong; the first, #{i}: exit {code}, stdout "
                f"{stdout!r}{want}")
    return None


def measure(system, workload, n, python3):
    """Child: time ``n`` programs of ``workload`` on ``system`` after the warm-up; print
    ``{"seconds": ...}`` as the last line, or exit non-zero saying what was wrong."""
    if system.startswith("grain-"):
        sys.path.insert(0, ROOT)  # this repository's grain.py as `grain`
    sys.path.insert(0, HERE)      # _peers
    import logging
    logging.getLogger("grain").setLevel(logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("parsl").setLevel(logging.WARNING)
    argvs, expected = programs(workload, n, python3)
    warm = [["/bin/true"]] * WARM_UP
    (_, warm_results), (seconds, results) = RUNNERS[system]([warm, argvs],
                                                          capture=expected is not None)
    for what, rs, want, k in (("warm-up", warm_results, None, WARM_UP),
                              (workload, results, expected, n)):
        wrong = check(rs, want, k)
        if wrong:
            sys.exit(f"{system} {what}: {wrong}")
    print(json.dumps({"seconds": seconds, "checked": n}))


###############################################################################
# The rounds, in the calling process

def venv_python(system):
    venv = SYSTEMS[system][0]
    python = os.path.join(VENVS, venv, "bin", "python")
    if os.path.exists(python):
        return python
    return sys.executable if venv == "grainpy" else None  # (as compare.py: this Python)


def availability(system):
    """``(python, None)``, or ``(None, why it is skipped)``."""
    venv, probe, _ = SYSTEMS[system]
    python = venv_python(system)
    if system.endswith("-1core") and len(os.sched_getaffinity(0)) < 2:
        return None, "needs 2 cores or more (the head's and the worker's)"
    if python is None:
        return None, (f"bench/.venvs/{venv} is missing: run "
                      "`python bench/bench_programs.py --setup`")
    cp = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                        timeout=120)
    if cp.returncode != 0:
        last = (cp.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} cannot `{probe}`: {last}"
    return python, None


def label(system, python):
    text = SYSTEMS[system][2]
    if "{version}" in text:
        cp = subprocess.run([python, "-c", "import importlib.metadata as m; "
                             f"print(m.version({PACKAGE[system]!r}))"],
                            capture_output=True, text=True)
        text = text.format(version=cp.stdout.strip() or "?")
    return text


def run_child(system, python, workload, n, python3):
    """``(seconds, None)`` of one measurement in a fresh process, or ``(None, why)``. The
    child runs in a process group of its own, ended whole after it: nothing it started
    (a cluster's workers) lingers into the next measurement."""
    with tempfile.TemporaryDirectory(prefix=f"bench-programs-{system}-") as home:
        env = dict(os.environ, HOME=home,  # a key, a config, a server dir of its own
                   PATH=os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""))
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as for a user: bytecode caches kept
        child = subprocess.Popen([python, os.path.abspath(__file__), "--child", system,
                                  workload, str(n), python3],
                                 cwd=home, env=env, text=True, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            stdout, stderr = child.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "timed out after 1800 s"
        finally:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"exit {child.returncode}: {tail}"
    return json.loads(lines[-1])["seconds"], None


def figure(workload, n, seconds):
    """W1: tasks/s; W2: makespan / ideal; W3: wall seconds."""
    if workload == "W1":
        return n / seconds
    if workload == "W2":
        return seconds / (n * SLEEP_S / SLOTS)
    return seconds


def fmt(workload, v):
    if v is None:
        return "—"
    return {"W1": f"{v:,.0f}", "W2": f"{v:.3f}", "W3": f"{v:.1f}"}[workload]


def done_when(med):
    """The targets, each ``(what, True | False | None)`` (None: a figure is missing)."""
    def ratio(system, workload, other):
        a = med.get((system, workload))
        b = 1.0 if other == "ideal" else med.get((other, workload))
        return a / b if a is not None and b else None

    def holds(value, test):
        return None if value is None else test(value)

    local, worker = "grain-local", "grain-worker"
    return [
        ("W1 in-process >= 1.2x HyperQueue's",
         holds(ratio(local, "W1", "hyperqueue"), lambda r: r >= 1.2)),
        ("W1 in-process >= upstream's", holds(ratio(local, "W1", "upstream"),
                                              lambda r: r >= 1.0)),
        ("W1 in-process >= 0.5x floor", holds(ratio(local, "W1", "floor"),
                                              lambda r: r >= 0.5)),
        ("W1 worker process >= 0.9x in-process", holds(ratio(worker, "W1", local),
                                                       lambda r: r >= 0.9)),
        ("W1 worker process >= 0.9x in-process, on one core with its head apart",
         holds(ratio(worker + "-1core", "W1", local + "-1core"), lambda r: r >= 0.9)),
        ("W2 in-process <= 1.10x ideal", holds(ratio(local, "W2", "ideal"),
                                               lambda r: r <= 1.10)),
        ("W2 worker process <= 1.10x ideal", holds(ratio(worker, "W2", "ideal"),
                                                   lambda r: r <= 1.10)),
        ("W3 in-process no slower than upstream", holds(ratio(local, "W3", "upstream"),
                                                        lambda r: r <= 1.0)),
        ("W3 worker process no slower than upstream",
         holds(ratio(worker, "W3", "upstream"), lambda r: r <= 1.0)),
    ]


def setup():
    cp = subprocess.run(["bash", os.path.join(HERE, "setup.sh"),
                         *dict.fromkeys(v[0] for v in SYSTEMS.values())])
    return cp.returncode


def main():
    if sys.argv[1:2] == ["--child"]:
        system, workload, n, python3 = sys.argv[2:6]
        return measure(system, workload, int(n), python3)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true",
                    help="make the venvs under bench/.venvs/ (bench/setup.sh), then exit")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: N1/N2/N3 200/40/50")
    ap.add_argument("--n1", type=int, help="W1's programs (default 2000)")
    ap.add_argument("--n2", type=int, help="W2's programs (default 200)")
    ap.add_argument("--n3", type=int, help="W3's programs (default 500)")
    ap.add_argument("--python3", help="W3's interpreter (default: the grainpy venv's)")
    opts = ap.parse_args()
    if opts.setup:
        return setup()
    sizes = dict(zip(WORKLOADS, (200, 40, 50) if opts.quick else (2000, 200, 500)))
    for w, n in zip(WORKLOADS, (opts.n1, opts.n2, opts.n3)):
        if n:
            sizes[w] = n
    python3 = opts.python3 or os.path.join(VENVS, "grainpy", "bin", "python3")
    if not os.path.exists(python3):
        python3 = sys.executable

    systems, skipped = {}, {}
    for s in opts.systems:
        python, why = availability(s)
        if python:
            systems[s] = python
        else:
            skipped[s] = why
            print(f"{s}: skipped: {why}", file=sys.stderr)
    values = {(s, w): [] for s in systems for w in WORKLOADS}
    failures = {}
    order = list(systems)
    for r in range(opts.rounds):
        turn = order[r % len(order):] + order[:r % len(order)] if order else []
        for w in WORKLOADS:
            for s in turn:
                seconds, why = run_child(s, systems[s], w, sizes[w], python3)
                if seconds is None:
                    failures[(s, w)] = why
                    shown = f"failed: {why}"
                else:
                    values[(s, w)].append(figure(w, sizes[w], seconds))
                    shown = f"{fmt(w, values[(s, w)][-1])} ({seconds:.2f} s)"
                print(f"[round {r + 1}/{opts.rounds}] {w} {s}: {shown}", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in values.items() if v}
    n1, n2, n3 = (sizes[w] for w in WORKLOADS)
    print(f"{datetime.date.today()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, `python bench/bench_programs.py "
          f"{' '.join(sys.argv[1:])}`: medians of {opts.rounds} round(s), systems "
          f"alternating within each round, {SLOTS} task slots of one core in each; every "
          "result checked.\n")
    print(f"| system | W1: {n1:,} × /bin/true, tasks/s | W1 / in-process on the same cores | "
          f"W2: {n2:,} × `sleep {SLEEP_S}`, makespan / ideal | "
          f"W3: {n3:,} × `python3 -c` printing a sum, stdout returned, wall s |")
    print("|---|---:|---:|---:|---:|")
    for s in opts.systems:
        if s in skipped:
            print(f"| {s}: skipped ({skipped[s]}) | — | — | — | — |")
            continue
        cells = [fmt(w, med.get((s, w))) for w in WORKLOADS]
        local = "grain-local-1core" if s.endswith("-1core") else "grain-local"
        base, mine = med.get((local, "W1")), med.get((s, "W1"))
        ratio = f"{mine / base:.2f}" if base and mine else "—"
        print(f"| {label(s, systems[s])} | {cells[0]} | {ratio} | {cells[1]} | "
              f"{cells[2]} |")
    if failures:
        print("\nFailed runs (not counted; the last reason of each):")
        for (s, w), why in failures.items():
            print(f"- {s} {w}: {why}")
    print("\nDone when:")
    for what, ok in done_when(med):
        verdict = {True: "met", False: "not met", None: "— (a figure is missing)"}[ok]
        print(f"- {what}: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
