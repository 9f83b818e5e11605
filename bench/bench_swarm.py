"""Swarm: W simulated remote workers (default 16, then 1,000) against one real head, for
both kinds of head: a mission's own (GrainExecutor listening on tcp://127.0.0.1) and the
head daemon (`grain.py head`) with a mission attached to it.

    python bench/bench_swarm.py [--workers 16,1000] [--jobs N] [--cores C] [--rounds R]
                                [--only own|daemon|floor] [--floor] [--profile]

The workers are simulated, all in one process (trio), one task each: each has its own
TCP connection, passes the real handshake, speaks sealed frames (grain.connect,
grain.open_channel), registers as a worker of 8 cores (--cores) and answers every "run"
at once with a successful "done" (a pickled None), running nothing. So the head is
measured, not the workers. The head runs in a process of its own: for "own", a mission
(a child of this script) with GrainExecutor(listen="tcp://127.0.0.1:0"); for "daemon",
`python grain.py head -a tcp://127.0.0.1:PORT --no-config` and a mission (a child of
this script) attached to it (MissionSetup(attach=...), as run() attaches). Both use a
key in a temporary HOME: the user's own daemon and key are never touched.

For each W and kind it measures:
  registered  from the first worker's connect until the head has all W (a worker knows
              it is in the head's scheduler when the head's "head" message comes: the
              head sends it as it adds the worker; the own head's count agrees);
  rss         the head process's VmRSS with W registered (/proc/PID/status);
  tasks/s     N no-op Cores(1) jobs (default 100,000; after 200 to warm up) through the W
              workers, submitted at once and all awaited (the rate of the steady state:
              in a shorter run the start, 8 jobs for each worker in one go, weighs more,
              and with 1,000 workers 20,000 jobs gave the own head 0.88-0.95 of its
              16-worker rate where 100,000 give 0.83);
  cpu/job     user+sys CPU of the head process during those N jobs (/proc/PID/stat),
              over N, in microseconds (the own head's includes submitting the jobs; for
              the daemon, the mission's CPU a job is shown beside it);
  ls          wall time of `python grain.py ls` and `ls --json` against that head with W
              workers (the median of 3; a Python start included).
Each configuration (kind, W) runs in a process of its own (in one process the second ran
slower than the first), R rounds of them alternating (--rounds, default 1); each figure
is the median of its rounds. Progress goes to stderr; a line per configuration, then one
summary line, to stdout.
With --floor, a third kind runs first: the floor, what trio alone costs a remote job at
each W. Its head is a process that does a job's input and output and nothing else: for
each job it writes a 64-byte frame to a connection with a free core (8 at first, each
connection's in one write, as the head starts a worker's jobs) and reads it back, and it
sends as many new ones as came back in one write. Its workers echo what they read. No
pickling, sealing, scheduling or futures: the head's CPU a job there is the least a trio
head can spend, the rate's fall from 16 to 1,000 connections trio's own.
With --profile, the head is run under cProfile (the own head's during the N jobs, the
daemon's whole life) and its 25 costliest functions go to stderr.

Targets (the last line shows which are met): registered <= 10 s and rss <= 200 MB for
1,000 workers; the 1,000-worker rate within 10 % of the 16-worker one; <= 20 us of head
CPU a job; ls <= 1 s. The machine's second core runs the simulated workers: their CPU
a job is shown too, to tell who limits the rate."""
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _peers
from _peers import parse_impl

IMPL, ARGS = parse_impl()
if IMPL != "grainpy":
    sys.exit("bench_swarm.py speaks grain.py's own wire protocol: --impl grainpy only")

import trio  # noqa: E402  (after parse_impl: grain.py is importable as grain from here)
import grain  # noqa: E402


def option(name, default, convert=str):
    if name in ARGS:
        i = ARGS.index(name)
        value = ARGS[i + 1]
        del ARGS[i:i + 2]
        return convert(value)
    return default


def flag(name):
    if name in ARGS:
        ARGS.remove(name)
        return True
    return False


ROLE = option("--role", None)        # (internal: a child of this script)
WORKERS = option("--workers", [16, 1000], lambda v: [int(x) for x in v.split(",") if x])
N = option("--jobs", 100_000, int)
ROUNDS = option("--rounds", 1, int)
ONLY = option("--only", None)
PROFILE = flag("--profile")
FLOOR = flag("--floor")
FLOOR_FRAME = 64   # bytes of a floor job, both ways
CORES = option("--cores", 8, int)  # of each simulated worker
WARMUP = 200       # jobs before the timed N
LS_RUNS = 3
if ONLY not in (None, "own", "daemon", "floor"):
    sys.exit(f"--only takes own, daemon or floor, got {ONLY!r}")
FLOOR = FLOOR or ONLY == "floor"
if ARGS and ROLE is None:
    sys.exit(f"unexpected arguments {ARGS}; see the usage in {__file__}")


def progress(*what):
    print(f"[{time.strftime('%H:%M:%S')}]", *what, file=sys.stderr, flush=True)


def raise_fd_limit(n):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def vm_rss(pid):
    """VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return _peers.rss_bytes(pid)


def cpu_seconds(pid="self"):
    """user + sys CPU of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_profile(path, title):
    import pstats
    import io
    out = io.StringIO()
    pstats.Stats(path, stream=out).sort_stats("tottime").print_stats(25)
    progress(f"profile of {title} (by own time):\n{out.getvalue()}")


###############################################################################
# Children: the missions (the own head; a mission attached to the daemon)

async def noop():
    pass


def say(**what):
    """To the driver, on stdout: one JSON line."""
    print(json.dumps(what), flush=True)


async def hear():
    """A line from the driver ("go"), on stdin."""
    return (await trio.to_thread.run_sync(sys.stdin.readline)).strip()


async def run_jobs(exer, n):
    jobs = [exer.submit(grain.Cores(1), noop) for _ in range(n)]
    for job in jobs:  # (the later ones are mostly done when their turn comes)
        await job


async def own_mission(workers, n, key_path):
    """A mission that is its own head: W simulated workers join it, then it runs N jobs."""
    key = grain.load_auth_key(key_path)
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0", key=key,
                                   progress=False) as exer:
        say(url=exer.urls["tcp"], pid=os.getpid())
        await exer.wait_for_workers(workers)
        say(registered=time.monotonic(),
            workers=sum(1 for w in exer.workers if w.channel is not None))
        await hear()  # (the driver has read our RSS and timed ls)
        await run_jobs(exer, WARMUP)
        profiler = None
        if PROFILE:
            import cProfile
            profiler = cProfile.Profile()
        say(start=True)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        if profiler:
            profiler.enable()
        await run_jobs(exer, n)
        if profiler:
            profiler.disable()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        say(wall=wall, cpu=cpu, rss_after=vm_rss(os.getpid()))
        if profiler:
            path = os.path.join(os.path.dirname(key_path), "own.prof")
            profiler.dump_stats(path)
            print_profile(path, f"the own head (pid {os.getpid()}) during {n} jobs")
        await hear()  # then goodbye: FIN to the workers


async def daemon_mission(url, n, key_path):
    """A mission attached to the head daemon at ``url`` (as run() attaches, by a stream
    from ``attach``); it runs the warm-up, then N jobs when told."""
    key = grain.load_auth_key(key_path)
    setup = grain.MissionSetup(
        attach=lambda: grain.connect(url, key),
        info={"name": "bench_swarm", "pid": os.getpid(), "host": grain.hostname()})
    async with grain.GrainExecutor(key=key, mission=setup, progress=False) as exer:
        await run_jobs(exer, WARMUP)
        say(ready=True)
        await hear()
        t0 = time.perf_counter()
        await run_jobs(exer, n)
        say(wall=time.perf_counter() - t0)


async def floor_head(workers, n):
    """The floor (see the module): W connections, N jobs of bare I/O, timed when told."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    conns, joined, go = [], trio.Event(), trio.Event()
    left = n  # jobs not sent yet
    finished = trio.Event()
    done = 0

    async def serve(stream):
        nonlocal left, done
        conns.append(stream)
        if len(conns) == workers:
            joined.set()
        await go.wait()
        first = min(CORES, left)
        left -= first
        pending = first * FLOOR_FRAME  # bytes of jobs out
        await stream.send_all(b"j" * pending)
        while pending:
            data = await stream.receive_some(65536)
            if not data:
                return
            pending -= len(data)
            back = len(data) // FLOOR_FRAME  # (the echo comes back whole: 64 divides it)
            done += back
            more = min(back, left)
            left -= more
            if more:
                pending += more * FLOOR_FRAME
                await stream.send_all(b"j" * (more * FLOOR_FRAME))
        if done == n:
            finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        say(url=f"127.0.0.1:{listeners[0].socket.getsockname()[1]}", pid=os.getpid())
        await joined.wait()
        say(registered=time.monotonic(), workers=len(conns))
        await hear()
        say(start=True)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        go.set()
        await finished.wait()
        say(wall=time.perf_counter() - t0, cpu=cpu_seconds() - cpu0,
            rss_after=vm_rss(os.getpid()))
        nursery.cancel_scope.cancel()


###############################################################################
# The simulated workers

DONE_VALUE = grain.dumps_job_value(None, "the result")   # what a worker sends for None


class Swarm:
    """W simulated workers, one task and one connection each."""

    def __init__(self, url, key, workers):
        self.url, self.key, self.n = url, key, workers
        self.started = None       # monotonic time of the first connect
        self.registered = 0       # workers the head has told who it is ("head")
        self.last_registered = None
        self.all_registered = trio.Event()
        self.runs = []            # jobs each worker ran
        self.connected = 0
        self.retries = 0
        self.failed = []
        self.gone = 0
        self.all_gone = trio.Event()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self.started = time.monotonic()
            for i in range(self.n):
                nursery.start_soon(self.worker, i)
            task_status.started()

    async def worker(self, i):
        try:
            stream = None
            for attempt in range(5):
                try:
                    stream = await grain.connect(self.url, self.key)
                    break
                except (grain.GrainError, OSError, trio.BrokenResourceError) as e:
                    self.retries += 1
                    why = e
                    await trio.sleep(0.1 * (attempt + 1))
            if stream is None:
                self.failed.append(f"sim{i}: {why}")
                return
            self.connected += 1
            try:
                await self.serve(i, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                self.failed.append(f"sim{i}: lost the head ({e!r})")
        finally:
            self.gone += 1
            if self.gone == self.n:
                self.all_gone.set()

    async def serve(self, i, stream):
        hello = {"name": f"sim{i:04d}", "pid": os.getpid(), "host": grain.hostname(),
                 "job_id": None, "sworker": None,
                 "res": grain.Cores(list(range(CORES))) & grain.Memory(16)}
        async with grain.open_channel(stream, self.url) as channel:
            channel.send(("register", hello))
            runs = 0
            try:
                while True:
                    if channel.flush_due:  # (as dispatch_all: a batch's results in one write)
                        await channel.flush()
                    msg = await channel.receive()
                    if msg is None:
                        return
                    what = msg[0]
                    if what == "run":  # (jid, digest, payload, alloc, T): done at once
                        channel.send(("done", msg[1], True, DONE_VALUE, 0.0))
                        runs += 1
                    elif what == "head":  # sent as the head adds us to its scheduler
                        self.registered += 1
                        if self.registered == self.n:
                            self.last_registered = time.monotonic()
                            self.all_registered.set()
                    elif what == "fin":  # nothing runs here: leave now
                        return
                    elif what in ("drain", "leave"):
                        channel.send(("leaving", "asked to quit"))
                        return
                    # "fn" (nothing is run: not kept), "ping", "cancel" (done already)
            finally:
                self.runs.append(runs)


async def echo_worker(address, connected):
    """A floor's worker: what it reads, it writes back."""
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    connected()
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            while data := await stream.receive_some(65536):
                await stream.send_all(data)


###############################################################################
# The driver

class Lines:
    """JSON lines from a child's stdout."""

    def __init__(self, stream):
        self.stream, self.buf = stream, b""

    async def next(self):
        while b"\n" not in self.buf:
            data = await self.stream.receive_some(65536)
            if not data:
                raise RuntimeError("the child exited early (see its stderr above)")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def child_argv(role, *more):
    return [sys.executable, os.path.abspath(__file__), "--role", role, "--jobs", str(N),
            "--cores", str(CORES), *(["--profile"] if PROFILE else []), *more]


def child_env(home):
    env = dict(os.environ, HOME=home)
    env.pop("GRAIN_CONFIG", None)
    return env


async def time_ls(url, key_path, home, as_json):
    argv = [sys.executable, _peers.GRAIN_PY, "ls", "-a", url, "--key", key_path]
    argv += ["--json"] if as_json else []
    times = []
    for _ in range(LS_RUNS):
        t0 = time.perf_counter()
        out = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                     check=False, cwd=home, env=child_env(home))
        times.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise RuntimeError(f"`grain.py ls{' --json' if as_json else ''}` failed: "
                               f"{out.stderr.decode()[-500:]}")
    if as_json:
        count = len(json.loads(out.stdout)["workers"])
    else:
        count = sum(1 for line in out.stdout.decode().splitlines() if line.startswith("sim"))
    return statistics.median(times), count


async def ls_figures(url, key_path, home, workers):
    ls, seen = await time_ls(url, key_path, home, False)
    ls_json, seen_json = await time_ls(url, key_path, home, True)
    if seen != workers or seen_json != workers:
        progress(f"  warning: ls shows {seen} workers, ls --json {seen_json}, not {workers}")
    return ls, ls_json


async def swarm_joins(nursery, url, key, workers):
    """Start W simulated workers; once all registered, the Swarm."""
    swarm = Swarm(url, key, workers)
    await nursery.start(swarm.run)
    with trio.move_on_after(120):
        await swarm.all_registered.wait()
    if not swarm.all_registered.is_set():
        raise RuntimeError(f"only {swarm.registered} of {workers} simulated workers "
                           f"registered within 120 s; {len(swarm.failed)} could not connect: "
                           f"{swarm.failed[:3]}")
    return swarm


async def bench_own(workers, home, key_path, key):
    fig = {"kind": "own", "W": workers}
    async with trio.open_nursery() as nursery:
        proc = await trio.lowlevel.open_process(
            child_argv("own", "--workers", str(workers), key_path), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=home, env=child_env(home))
        try:
            lines = Lines(proc.stdout)
            hello = await lines.next()
            url, pid = hello["url"], hello["pid"]
            progress(f"own head pid {pid} at {url}; {workers} simulated workers join")
            swarm = await swarm_joins(nursery, url, key, workers)
            head_view = await lines.next()
            fig["registered"] = swarm.last_registered - swarm.started
            fig["registered_head"] = head_view["registered"] - swarm.started
            fig["rss"] = vm_rss(pid)
            progress(f"  registered in {fig['registered']:.2f} s (the head counts "
                     f"{head_view['workers']} at {fig['registered_head']:.2f} s; "
                     f"{swarm.retries} connect retries); head RSS {fig['rss'] / 1e6:.0f} MB")
            fig["ls"], fig["ls_json"] = await ls_figures(url, key_path, home, workers)
            progress(f"  ls {fig['ls']:.2f} s, ls --json {fig['ls_json']:.2f} s")
            await proc.stdin.send_all(b"go\n")
            await lines.next()  # start
            sim0 = cpu_seconds()
            done = await lines.next()
            sim = cpu_seconds() - sim0
            fig.update(rate=N / done["wall"], cpu_us=done["cpu"] / N * 1e6,
                       sim_us=sim / N * 1e6, wall=done["wall"], rss_after=done["rss_after"])
            progress(f"  {N} jobs in {done['wall']:.2f} s: {fig['rate']:,.0f} tasks/s; head "
                     f"CPU {fig['cpu_us']:.1f} us/job; simulated workers' CPU "
                     f"{fig['sim_us']:.1f} us/job; head RSS after "
                     f"{done['rss_after'] / 1e6:.0f} MB")
            await proc.stdin.send_all(b"bye\n")
            with trio.move_on_after(60):
                await swarm.all_gone.wait()
                await proc.wait()
            check_swarm(swarm, workers)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        nursery.cancel_scope.cancel()
    return fig


async def bench_floor(workers, home, key_path, key):
    fig = {"kind": "floor", "W": workers}
    async with trio.open_nursery() as nursery:
        proc = await trio.lowlevel.open_process(
            child_argv("floor", "--workers", str(workers)), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=home, env=child_env(home))
        try:
            lines = Lines(proc.stdout)
            hello = await lines.next()
            progress(f"floor head pid {hello['pid']} at {hello['url']}; {workers} echoing "
                     "workers join")
            t0, joined = time.monotonic(), []
            for _ in range(workers):
                nursery.start_soon(echo_worker, hello["url"], lambda: joined.append(1))
            await lines.next()
            fig["registered"], fig["rss"] = time.monotonic() - t0, vm_rss(hello["pid"])
            await proc.stdin.send_all(b"go\n")
            await lines.next()  # start
            sim0 = cpu_seconds()
            done = await lines.next()
            fig.update(rate=N / done["wall"], cpu_us=done["cpu"] / N * 1e6,
                       sim_us=(cpu_seconds() - sim0) / N * 1e6, wall=done["wall"])
            progress(f"  {N} jobs in {done['wall']:.2f} s: {fig['rate']:,.0f} tasks/s; head "
                     f"CPU {fig['cpu_us']:.1f} us/job; echoing workers' CPU "
                     f"{fig['sim_us']:.1f} us/job")
            await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        nursery.cancel_scope.cancel()
    return fig


async def bench_daemon(workers, home, key_path, key):
    fig = {"kind": "daemon", "W": workers}
    port = _peers.free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [_peers.GRAIN_PY, "head", "-a", url, "--no-config", "--key", key_path,
            "--idle-quit", "1h"]
    if PROFILE:
        prof = os.path.join(home, "daemon.prof")
        argv = ["-c", "import cProfile, sys; sys.path.insert(0, %r); import grain; "
                "cProfile.run('grain.main(sys.argv[1:])', %r)" % (_peers.ROOT, prof),
                *argv[1:]]
    async with trio.open_nursery() as nursery:
        log_path = os.path.join(home, f"daemon-{port}.log")
        log_file = open(log_path, "wb")  # (its log: a line a worker)
        daemon = await trio.lowlevel.open_process(
            [sys.executable, *argv], cwd=home, env=child_env(home), stdin=subprocess.DEVNULL,
            stdout=log_file, stderr=log_file)
        log_file.close()
        mission = None
        try:
            with trio.fail_after(30):
                while await grain.cli_request(url, key, "stats") is None:
                    if daemon.poll() is not None:
                        raise RuntimeError(f"the head daemon exited ({daemon.returncode}): "
                                           f"{grain.log_tail(log_path)}")
                    await trio.sleep(0.05)
            progress(f"head daemon pid {daemon.pid} at {url}; {workers} simulated workers "
                     "join")
            swarm = await swarm_joins(nursery, url, key, workers)
            fig["registered"] = swarm.last_registered - swarm.started
            fig["rss"] = vm_rss(daemon.pid)
            counted = len((await grain.cli_request(url, key, "stats"))["workers"])
            progress(f"  registered in {fig['registered']:.2f} s (the head counts {counted}; "
                     f"{swarm.retries} connect retries); head RSS {fig['rss'] / 1e6:.0f} MB")
            fig["ls"], fig["ls_json"] = await ls_figures(url, key_path, home, workers)
            progress(f"  ls {fig['ls']:.2f} s, ls --json {fig['ls_json']:.2f} s")
            mission = await trio.lowlevel.open_process(
                child_argv("mission", url, key_path), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, cwd=home, env=child_env(home))
            lines = Lines(mission.stdout)
            await lines.next()  # attached, warmed up
            cpu0, sim0 = cpu_seconds(daemon.pid), cpu_seconds()
            mission0 = cpu_seconds(mission.pid)
            await mission.stdin.send_all(b"go\n")
            done = await lines.next()
            cpu, sim = cpu_seconds(daemon.pid) - cpu0, cpu_seconds() - sim0
            fig.update(rate=N / done["wall"], cpu_us=cpu / N * 1e6, sim_us=sim / N * 1e6,
                       mission_us=(cpu_seconds(mission.pid) - mission0) / N * 1e6,
                       wall=done["wall"], rss_after=vm_rss(daemon.pid))
            progress(f"  {N} jobs in {done['wall']:.2f} s: {fig['rate']:,.0f} tasks/s; head "
                     f"CPU {fig['cpu_us']:.1f} us/job; simulated workers' CPU "
                     f"{fig['sim_us']:.1f} us/job; the mission's {fig['mission_us']:.1f} "
                     f"us/job; head RSS after {fig['rss_after'] / 1e6:.0f} MB")
            with trio.move_on_after(30):
                await mission.wait()
            daemon.send_signal(signal.SIGTERM)  # FIN to its workers
            with trio.move_on_after(60):
                await swarm.all_gone.wait()
                await daemon.wait()
            check_swarm(swarm, workers)
        finally:
            for p in (mission, daemon):
                if p is not None and p.returncode is None:
                    p.kill()
                if p is not None:
                    await p.wait()
        nursery.cancel_scope.cancel()
    if PROFILE:
        print_profile(prof, f"the head daemon (pid {daemon.pid}), its whole life")
    return fig


def spread(swarm):
    """Where the jobs ran: on how many of the workers, and the most on one."""
    runs = swarm.runs
    return (f"jobs ran on {sum(1 for r in runs if r)} of {len(runs)} workers (at most "
            f"{max(runs, default=0)} on one)")


def check_swarm(swarm, workers):
    progress(f"  {spread(swarm)}")
    if swarm.gone != workers:
        progress(f"  warning: {workers - swarm.gone} simulated workers did not leave")
    if swarm.failed:
        progress(f"  warning: {len(swarm.failed)} simulated workers failed, e.g. "
                 f"{swarm.failed[0]}")


def line(fig):
    ls = "" if fig["kind"] == "floor" else (
        f", ls {fig['ls']:.2f} s, ls --json {fig['ls_json']:.2f} s")
    return (f"{fig['kind']} W={fig['W']}: registered {fig['registered']:.2f} s, rss "
            f"{fig['rss'] / 1e6:.0f} MB, {fig['rate']:,.0f} tasks/s, head cpu "
            f"{fig['cpu_us']:.1f} us/job (workers' {fig['sim_us']:.1f}"
            + (f", mission's {fig['mission_us']:.1f}" if "mission_us" in fig else "") + f"){ls}")


def summary(figs):
    parts = []
    for kind in ("floor", "own", "daemon"):
        mine = {f["W"]: f for f in figs if f["kind"] == kind}
        if not mine:
            continue
        if kind == "floor":
            parts.append("floor (trio's bare I/O): " + ", ".join(
                f"W={w} {f['rate']:,.0f} tasks/s, head cpu {f['cpu_us']:.0f} us/job"
                for w, f in sorted(mine.items())))
            continue
        big = mine[max(mine)]
        small = mine[min(mine)] if len(mine) > 1 else None
        vs = f" ({small['W']} workers: {small['rate']:,.0f})" if small else ""
        misses = [what for what, ok in (
            ("registered", big["registered"] <= 10 or big["W"] < 1000),
            ("rss", big["rss"] <= 200e6),
            ("rate", small is None or big["rate"] >= 0.9 * small["rate"]),
            ("cpu", big["cpu_us"] <= 20),
            ("ls", max(big["ls"], big["ls_json"]) <= 1)) if not ok]
        parts.append(f"W={big['W']} {kind}: registered {big['registered']:.1f} s, rss "
                     f"{big['rss'] / 1e6:.0f} MB, {big['rate']:,.0f} tasks/s{vs}, head cpu "
                     f"{big['cpu_us']:.0f} us/job, ls {big['ls']:.2f} s, ls --json "
                     f"{big['ls_json']:.2f} s; targets missed: {', '.join(misses) or 'none'}")
    return "; ".join(parts)


async def one_configuration(kind, workers):
    """(--role config KIND: the child that measures one configuration.) Its figures, as
    a JSON line."""
    with tempfile.TemporaryDirectory(prefix="grain-swarm-") as home:
        key_path = os.path.join(home, "key")
        key = grain.load_auth_key(key_path)  # (made here, mode 0600: this run's alone)
        bench = {"floor": bench_floor, "own": bench_own, "daemon": bench_daemon}[kind]
        say(**await bench(workers, home, key_path, key))


def median_figures(runs):
    """One configuration's figures: the median of each over its rounds."""
    fig = dict(runs[0])
    for name, value in runs[0].items():
        if isinstance(value, float) or name in ("rss", "rss_after"):
            fig[name] = statistics.median(run[name] for run in runs)
    return fig


def driver():
    kinds = [k for k in ("floor", "own", "daemon")
             if ONLY == k or ONLY is None and (k != "floor" or FLOOR)]
    runs = {}
    for r in range(ROUNDS):
        for kind in kinds:
            for workers in WORKERS:
                if ROUNDS > 1:
                    progress(f"round {r + 1} of {ROUNDS}: {kind}, {workers} workers")
                out = subprocess.run(child_argv("config", "--workers", str(workers), kind),
                                     stdout=subprocess.PIPE, check=True)
                fig = json.loads(out.stdout.splitlines()[-1])
                runs.setdefault((kind, workers), []).append(fig)
                print(line(fig), flush=True)
    figs = [median_figures(r) for r in runs.values()]
    if ROUNDS > 1:
        print(f"medians of {ROUNDS} rounds:", flush=True)
        for fig in figs:
            print(line(fig), flush=True)
    print(f"swarm of simulated workers ({CORES} cores each), {N} no-op Cores(1) jobs; "
          f"{socket.gethostname()}, {os.cpu_count()} cores", file=sys.stderr)
    print(summary(figs), flush=True)


def main():
    raise_fd_limit(max(4096, 3 * max(WORKERS) + 256))
    if ROLE == "floor":  # --workers W
        trio.run(floor_head, WORKERS[0], N)
    elif ROLE == "own":  # --workers W KEY
        trio.run(own_mission, WORKERS[0], N, ARGS[0])
    elif ROLE == "mission":  # URL KEY
        trio.run(daemon_mission, ARGS[0], N, ARGS[1])
    elif ROLE == "config":  # --workers W KIND
        trio.run(one_configuration, ARGS[0], WORKERS[0])
    else:
        driver()


if __name__ == "__main__":
    main()
