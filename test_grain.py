"""Tests for grain.py. Run: python -m pytest -q

Real processes, real pipes and files; trio's MockClock where time matters."""
import ast
import contextlib
import dataclasses
import functools
import gc
import html
import io
import json
import logging
import math
import os
import pathlib
import pickle
import random
import re
import shlex
import signal
import socket
import sqlite3
import stat
import struct
import subprocess
import sys
import textwrap
import time
import types
import unittest.mock
import weakref
from collections import Counter

import pytest
import trio
import trio.testing

# Missions listen on ~/.local/share/edge-file-default and keep their key in
# ~/.local/share/grain; sockets go to $TMPDIR/grain-<uid>: give the whole test run (and its
# child processes) a home of its own with its TMPDIR inside, removed at its end (see
# remove_the_runs_home). A SIGTERM (a CI job's timeout) ends the run as Ctrl-C does, so
# that this happens then too (the default SIGTERM leaves without atexit). A process of the
# run that imports this file to unpickle a job's function (a worker, a subprocess-pool
# process) has that home already: it makes none (nor leaves one behind when killed), and
# keeps its own SIGTERM.
import atexit
import select
import shutil
import tempfile

RUN_HOME = os.environ.get("HOME", "")
if not os.path.basename(RUN_HOME).startswith("grain-test-home-"):
    RUN_HOME = os.environ["HOME"] = tempfile.mkdtemp(prefix="grain-test-home-")
    os.environ["TMPDIR"] = os.path.join(RUN_HOME, "tmp")
    os.mkdir(os.environ["TMPDIR"])
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # (registered before `import grain`, which may fail: then no process of the run's
    # can have started, and only its HOME goes)
    atexit.register(lambda: globals().get("remove_the_runs_home", lambda: shutil.rmtree(
        RUN_HOME, ignore_errors=True))())

import grain

try:
    BaseExceptionGroup
except NameError:  # Python < 3.11
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup
from grain import GVAR
from grain.delayed import delayed, each, run
from grain.resource import ZERO, Capacity, Cores, Gpus, Memory, Node, Token, WTime
from grain.subproc import BrokenSubprocessError, subprocify, subprocess_pool_scope

HERE = os.path.dirname(os.path.abspath(__file__))
GRAIN = os.path.join(HERE, "grain.py")


def run_processes():
    """``{pid: argv}`` of the running processes with this test run's HOME (set above),
    but this one: those it started, and theirs. A user's own, on a login node, never are."""
    ours, found = f"HOME={RUN_HOME}".encode(), {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if ours in environ and int(entry) != os.getpid():  # (a zombie's environ is empty)
            found[int(entry)] = argv
    return found


def head_daemons():
    """Pids of the head daemons (`grain.py head`) this test run started."""
    return {pid for pid, argv in run_processes().items() if b"head" in argv and any(
        a.endswith(b"grain.py") or a.endswith(b".pyz") for a in argv)}


def remove_the_runs_home():
    """The run's HOME and TMPDIR go at its end, with what its processes left there (sockets
    of killed ones too). Those still running (a head daemon a mission started, a worker a
    batch-system stand-in did) are killed first, and awaited: none writes there after."""
    for pid in run_processes():
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            os.kill(pid, signal.SIGKILL)
            select.select([fd], [], [], 15)  # readable once the process has ended
            os.close(fd)
    shutil.rmtree(RUN_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_daemon_outlives_its_test():
    """A head daemon a test started (through run()) is stopped when the test ends, as a
    user's would be by idle_quit; a test that checks its end stops it itself."""
    before = head_daemons()
    yield
    for pid in head_daemons() - before:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
trio_test = pytest.mark.trio


def run_py(*args, timeout=60, cwd=HERE, **kw):
    """Run a Python process (in the repo directory unless told); returns CompletedProcess
    (text)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pid_running(pid):
    """Alive and not a zombie waiting to be reaped by its (former) parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


###############################################################################
# Helpers shared by the tests #################################################
###############################################################################
# Workers, daemons, configs and the functions jobs run; the tests follow, in the order
# of grain.py's table of contents, each section with the helpers only it uses.


class GPU(grain.Resource):
    """A user's own kind: a count of GPUs with ids, as the documented interface asks."""

    def __init__(self, n):
        self.ids = list(range(n)) if isinstance(n, int) else list(n)
        self.want = n if isinstance(n, int) else len(n)

    def _request(self, res):
        return res.want <= len(self.ids)

    def _alloc(self, res):
        taken, self.ids = self.ids[:res.want], self.ids[res.want:]
        return GPU(taken)

    def _dealloc(self, res):
        self.ids = sorted(self.ids + res.ids)

    def _repr(self):
        return f"GPU({self.ids})"

    def _stat(self):
        return (len(self.ids), 2)


class Recorder(grain.Worker):
    """A worker for the Scheduler alone: start() only records the job."""

    def __init__(self, res, name):
        super().__init__(None, res, name)
        self.started = []

    def start(self, job):
        self.started.append(job.id)


class Policy:
    """A Scheduler on a clock the test moves: the policy, with no trio and no I/O."""

    def __init__(self, *queues):
        self.now = 0.0
        self.sched = grain.Scheduler(clock=lambda: self.now)
        self.queues = {}
        for name in queues or ("q",):
            self.queues[name] = grain.JobQueue(name, prioritized=name.startswith("!"))
            self.sched.add_queue(self.queues[name])
        self.jobs = {}

    def push(self, jid, cores, queue="q"):
        self.jobs[jid] = grain.Job(jid, Cores(cores), None, (), {}, self.queues[queue])
        self.sched.push(self.jobs[jid])

    def end(self, jid):
        self.sched.release(self.jobs[jid], ok=True)
        self.sched.pump()


@delayed
async def add1(x):
    await trio.sleep(x / 10)
    return x + 1


@delayed(nout=2)
async def pair(x):
    return x, str(x)


@delayed
async def make(obj):
    return obj


async def _in_mission(fn, local=Cores(2), **kw):
    async with grain.GrainExecutor(rpw=local, **kw):
        return await fn()


@subprocify
def sp_info(x):
    import os
    from grain import GVAR
    print(f"child {x}")
    return x * x, os.getpid(), sorted(os.sched_getaffinity(0)), GVAR.res.c, GVAR.instance


class NeedsTwo(Exception):
    def __init__(self, a, b):  # pickles, but cannot be made again from its args
        super().__init__(f"{a}/{b}")


class Workers:
    """Worker processes started for a test, all killed at its end."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs = []

    def start(self, *args, name="w", env=None):
        log = open(self.tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, GRAIN, "worker", "--name", name, *args],
                                stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env)
        proc.log_path = self.tmp_path / f"{name}.log"
        self.procs.append(proc)
        return proc

    def close(self):
        kill_all(self.procs)


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path)
    yield w
    w.close()


async def wait_exit(proc, timeout=15):
    with trio.fail_after(timeout):
        while proc.poll() is None:
            await trio.sleep(0.05)
    return proc.returncode


async def where_am_i(x, delay=0.0):
    import os
    import trio
    from grain import GVAR
    await trio.sleep(delay)
    return x, os.getpid(), list(GVAR.res.c), GVAR.instance


async def pid_then_sleep(pidfile, seconds):
    import os
    import trio
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    await trio.sleep(seconds)
    return os.getpid()


async def pid_then_wait(pidfile, release):
    """Record this process's pid, then run until the file ``release`` exists."""
    import os
    import trio
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    while not os.path.exists(release):
        await trio.sleep(0.05)
    return os.getpid()


class OnlyItsWorkerPickles:
    """A result that cannot be pickled again in the head's process."""

    def __init__(self, head_pid):
        self.head_pid = head_pid

    def __reduce__(self):
        if os.getpid() == self.head_pid:
            raise TypeError("not in the head")
        return OnlyItsWorkerPickles, (self.head_pid,)


DAEMON_MISSION = textwrap.dedent("""
    import json, os, sys, time, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def job(seconds, marker):
        started = time.time()
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            if marker:
                with open(marker, "w") as f:
                    f.write("cancelled")
            raise
        return os.getpid(), started

    async def main():
        n, seconds = int(sys.argv[1]), float(sys.argv[2])
        marker = sys.argv[3] if len(sys.argv) > 3 else ""
        return await each((job @ Cores(1))(seconds, marker) for i in range(n))

    results = run(main, config_file={config!r}, prioritized="--first" in sys.argv)
    print(json.dumps({{"pids": sorted({{p for p, _ in results}}),
                      "starts": [s for _, s in results], "end": time.time()}}), flush=True)
""")


class Daemon:
    """A config for one address in tmp_path, missions using it, and the CLI."""

    def __init__(self, tmp_path, workers, extra="", gnaw=""):
        self.tmp_path, self.workers = tmp_path, workers
        self.edge = f"edge://{tmp_path}/edge"
        self.config = tmp_path / "grain.toml"
        # upstream's key for the daemon's log: [head.gnaw] log_file
        self.config.write_text(f'address = "{self.edge}"\n[head.gnaw]\n'
                               f'log_file = "{tmp_path}/head.log"\n{gnaw}\n[head]\n{extra}')
        self.script = tmp_path / "mission.py"
        self.script.write_text(DAEMON_MISSION.format(here=HERE, config=str(self.config)))
        self.missions = []

    def worker(self, cores=1, name="w"):
        return self.workers.start("--url", self.edge, "--res",
                                  f'{{"Cores": {{"N": {cores}}}}}', name=name)

    def mission(self, *args):
        p = subprocess.Popen([sys.executable, str(self.script), *map(str, args)],
                             cwd=self.tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.missions.append(p)
        return p

    @staticmethod
    def result(p, timeout=60):
        out, p.err = p.communicate(timeout=timeout)
        assert p.returncode == 0, p.err
        return _json.loads(out.strip().splitlines()[-1])

    def cli(self, *args):
        return grain_cli(*args, "-c", str(self.config), cwd=self.tmp_path)

    def wait_ls(self, *texts, timeout=30):
        seen = {}

        def shows():
            seen["ls"] = self.cli("ls").stdout
            return all(text in seen["ls"] for text in texts)

        try:
            wait_for(shows, timeout, f"`ls` to show {texts!r}")
        except AssertionError:
            raise AssertionError(seen.get("ls")) from None
        return seen["ls"]

    def close(self):
        kill_all(self.missions)


@pytest.fixture
def daemon(tmp_path, workers):
    d = Daemon(tmp_path, workers)
    yield d
    d.close()


def _daemon_pids(tmp_path):
    log = (tmp_path / "head.log").read_text()
    return {int(p) for p in re.findall(r"head daemon pid (\d+)", log)}


LONG_JOBS = textwrap.dedent("""
    import json, os, sys, time, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores, ZERO

    @delayed
    async def long(i, seconds):
        with open({runs!r}, "a") as f:   # one line per run of a job
            f.write(f"{{i}} {{os.getpid()}}\\n")
        await trio.sleep(seconds)
        return i, os.getpid()

    async def main():
        return await each((long @ Cores(1))(i, float(sys.argv[1])) for i in range(8))

    print(json.dumps(run(main, {options})), flush=True)
""")


SUBMIT_LOCAL = textwrap.dedent("""
    # A "batch system" for tests: runs the job script here, in the background; the job id
    # is the script's pid. Every submission is logged.
    import subprocess, sys
    script = sys.argv[-1]
    log = open(script + ".out", "w")
    p = subprocess.Popen(["bash", script], stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    with open({submissions!r}, "a") as f:
        f.write(f"{{p.pid}}\\n")
    print(p.pid)
""")


JOB_ALIVE = textwrap.dedent("""
    import sys
    try:
        state = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        sys.exit(1)
    sys.exit(0 if state != "Z" else 1)
""")


import json as _json  # noqa: E402


import shutil  # noqa: E402


EXAMPLE_TOML = textwrap.dedent("""
    system = "slurm"
    address = "edge:///shared/edge"
    [script]
    queue = "debug"
    walltime = "1-00:00:00"
    cores = 16
    memory = 30
    extra_args = ["--account=chem"]
    setup_cleanup = '''
    module load vasp
    mkdir -p /scratch/{{HHMMSS}}
    defer rm -r /scratch/{{HHMMSS}}
    defer echo first-deferred-runs-last
    '''
    [head]
    address = "tcp://login1:7777"
    [head.script]
    cores = 1
    [worker]
    res = { Token = { token = "gpu" } }
    log_file = "logs/w-{{HHMMSS}}.log"
""")


needs_slurm = pytest.mark.skipif(shutil.which("sbatch") is None,
                                 reason="needs a Slurm (CI installs one: .ci/slurm-up.sh)")


def slurm_config(tmp_path, system="slurm", **script):
    lines = [f'system = "{system}"', f'address = "edge://{tmp_path}/edge"', "[script]",
             'walltime = "0:10:00"', "memory = 1",
             f'setup_cleanup = "defer touch {tmp_path}/cleaned-$SLURM_JOB_ID"']
    lines += [f"{k} = {_json.dumps(v)}" for k, v in script.items()]
    path = tmp_path / "grain.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def grain_cli(*args, cwd=HERE, timeout=120, **kw):
    """Run ``python grain.py ARGS``: the one way the tests run the CLI."""
    return run_py(GRAIN, *args, cwd=cwd, timeout=timeout, **kw)


def squeue_ids():
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return set(out.split())


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def slurm_cleanup(tmp_path):
    """Cancel, after the test, the batch jobs it submitted (from its directory): never
    another's (a second suite may run beside this one, or a user's own jobs)."""
    yield
    if shutil.which("scancel"):
        out = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True,
                             text=True).stdout
        for job, _, workdir in (line.partition(" ") for line in out.splitlines()):
            if workdir == str(tmp_path) or workdir.startswith(f"{tmp_path}/"):
                subprocess.run(["scancel", job])


_GATES = {}


async def _memory_of_my_job():
    return GVAR.res.m, GVAR.res.M, GVAR.res.N


OWN_HEAD_MISSION = textwrap.dedent("""
    import json, os, sys, trio
    sys.path.insert(0, {here!r})
    import grain
    from grain.delayed import delayed, each, run
    from grain.resource import Cores, ZERO
    if sys.argv[1:] == ["unflushed"]:   # the kill lands before any "running" entry is written
        grain.STORE_FLUSH_S = 3600

    @delayed
    async def work(i):
        import os, trio
        fd = os.open({runs!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{{i}} {{os.getpid()}}\\n".encode())
        os.close(fd)
        await trio.sleep({seconds})
        return i * i

    async def main():
        return await each((work @ Cores(1))(i) for i in range(4))

    print(json.dumps(run(main, local=ZERO, address={edge!r}, results={store!r},
                         config_file=False)))
""")


class _FakeChannel:
    """What a worker's Channel is to the head, recording what is sent."""

    stream = None

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _returning_worker(cores=4):
    w = grain.RemoteWorker(None, Cores(list(range(cores))), "w", _FakeChannel())
    return w


def _head_of(w, scheduler, reunion, **hooks):
    """A real HeadCore as ``w``'s owner, with ``scheduler`` and ``reunion`` (and ``hooks``,
    the owner's methods a test stands in for)."""
    w.owner = grain.HeadCore(grain.Retries())
    w.owner.scheduler, w.owner.reunion = scheduler, reunion
    for name, fn in hooks.items():
        setattr(w.owner, name, fn)


FAKE_NVIDIA_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then
  cat <<'END'
{listing}END
else
  cat <<'END'
0, 00000000:07:00.0
1, 00000000:0B:00.0
2, 00000000:87:00.0
3, 00000000:8B:00.0
END
fi
"""


def _process_group(pgid):
    """Pids of the processes of group ``pgid``, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry))
    return pids


###############################################################################
# Trampoline ##################################################################
###############################################################################


def test_script_and_import_share_one_module_identity():
    # A pool process runs `python grain.py _subproc`; the job's pickled allocation and the
    # GVAR it reads there must be the classes and objects of the module `grain`.
    code = textwrap.dedent("""
        import sys
        from grain.delayed import delayed, run
        from grain.resource import Cores
        from grain.subproc import subprocify, subprocess_pool_scope

        @subprocify
        def probe():
            import grain, sys
            return (sys.modules["__main__"] is not grain, type(grain.GVAR.res) is grain.Cores,
                    grain.GVAR is sys.modules["grain"].GVAR, grain.GVAR.res.c)

        async def main():
            async with subprocess_pool_scope():
                return await (delayed(probe) @ Cores(1))()
        print(run(main, local=Cores(1), config_file=False))
    """)
    cp = run_py("-c", code)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip().startswith("(True, True, True, [")


def test_python_dash_m_grain_runs_the_cli():
    cp = run_py("-m", "grain", "--version")
    assert cp.returncode == 0 and cp.stdout.startswith("grain.py ")


###############################################################################
# Imports and compat ##########################################################
###############################################################################


def test_version_and_help():
    cp = grain_cli("--version")
    assert cp.returncode == 0
    assert cp.stdout.startswith(f"grain.py {grain.__version__} (trio {trio.__version__}")
    cp = grain_cli("--help")
    assert cp.returncode == 0 and "usage: grain.py" in cp.stdout
    assert "_subproc" not in cp.stdout  # internal commands stay out of the help


def test_an_older_trio_than_supported_is_refused_at_import_in_one_line(tmp_path):
    fake = tmp_path / "trio"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit('grain imported the old trio')\n")
    (fake / "_version.py").write_text('__version__ = "0.21.0"\n')
    cp = run_py("-c", "import grain", env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{HERE}"))
    assert cp.returncode == 1
    assert cp.stderr.strip().splitlines()[-1] == \
        "ImportError: grain.py needs trio >= 0.22, but trio 0.21.0 is installed; upgrade it " \
        "with `python -m pip install -U trio`, or use the self-contained grain.pyz"


def test_a_mission_raises_the_same_group_on_every_supported_trio():
    # trio 0.22 (still installed on many sites) collapses a nursery's lone error unless
    # told not to; >= 0.25 wraps it. A mission must not depend on which one a site has:
    # upstream's own test_main_subtask_exception expects the group.
    async def fails():
        raise ValueError("in one main")

    async def fine():
        pass

    with pytest.raises(ExceptionGroup) as info:
        run([fails, fine], local=Cores(1), config_file=False)
    assert [type(e) for e in info.value.exceptions] == [ValueError]

    async def nested():   # a mission's own nursery, as on trio >= 0.25, under trio 0.22
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails)
    with pytest.raises(ExceptionGroup):
        run(nested, local=Cores(1), config_file=False)


def test_import_configures_no_logging():
    code = ("import logging, grain; "
            "assert not logging.getLogger().handlers, 'root configured'; "
            "assert not logging.getLogger('grain').handlers, 'grain configured'; print('ok')")
    cp = run_py("-c", code)
    assert cp.returncode == 0 and cp.stdout.strip() == "ok", cp.stderr


def test_run_leaves_an_application_logging_setup_alone():
    code = textwrap.dedent("""
        import logging, grain
        from grain.delayed import run
        logging.basicConfig(level=logging.INFO, format="APP %(message)s")
        async def main():
            return 1
        run(main, config_file=False)
        assert not logging.getLogger("grain").handlers
    """)
    cp = run_py("-c", code)
    assert cp.returncode == 0, cp.stderr
    assert "APP Time elapsed for all jobs:" in cp.stderr


###############################################################################
# Helpers #####################################################################
###############################################################################


def test_walltime_parsing():
    assert grain.parse_walltime("1:00:00") == 3600
    assert grain.parse_walltime("2-01:02:03") == 2 * 86400 + 3723
    assert grain.parse_walltime(90) == 90 and grain.parse_walltime("45") == 45
    for bad in ["1:60:00", "ab", "1:2", "-5", "1-2-3:00:00"]:
        with pytest.raises(ValueError, match=r"malformed WTime\(T\)"):
            WTime(T=bad)
    with pytest.raises(ValueError, match="cannot exceed"):
        WTime(T=10, softT=20)
    w = WTime(T="1:00:00")
    assert w.T == 3600 and w.softT == 3600 and not w.countdown
    assert grain.format_walltime(3723) == "1:02:03"


def test_core_id_lists():
    assert grain.parse_ids("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert grain.parse_ids("5") == [5]


###############################################################################
# Resources ###################################################################
###############################################################################


def test_cores_request_alloc_dealloc_and_repr():
    pool = Cores([0, 1, 2, 5])
    assert repr(pool) == "CPU_Cores([0-2,5])" and pool.N == 4
    # Cores(N) is cores 0..N-1, as upstream: a request for N cores, or a provider of them.
    assert repr(Cores(3)) == "CPU_Cores([0-2])" and Cores(3).c == [0, 1, 2]
    assert Cores(16).alloc(Cores(3)).c == [0, 1, 2]
    assert pool.request(Cores(4)) and not pool.request(Cores(5))
    got = pool.alloc(Cores(3))
    assert got.c == [0, 1, 2] and got.N == 3 and repr(got) == "CPU_Cores([0-2])"
    assert pool.c == [5] and not pool.request(Cores(2))
    with pytest.raises(ValueError, match=r"CPU_Cores\(\[5\]\) cannot allocate 2 core\(s\)"):
        pool.alloc(Cores(2))
    # .c is a list that answers set operations too (upstream's was a set).
    assert got.c & pool.c == set() and got.c | pool.c == {0, 1, 2, 5} and got.c == {0, 1, 2}
    pool.dealloc(got)
    assert pool.c == [0, 1, 2, 5]
    # An allocation can be a request again: a request counts cores, it does not name them.
    assert pool.alloc(Cores([2, 5])).c == [0, 1] and pool.c == [2, 5]
    assert pool.stat() == {"Cores": (2, 4)}


@pytest.mark.parametrize("bad", [-1, 2.5, "4", True, None, [0, -3]])
def test_bad_core_counts_are_refused(bad):
    with pytest.raises(ValueError, match=r"Cores"):
        Cores(bad)


def test_memory_capacity_token_node():
    m = Memory(8)
    assert repr(m) == "Memory(8GB)" and m.m == m.M == 8
    a = m.alloc(Memory(2.5))
    # .m is the amount now (free here, held by the allocation), .M the total: as upstream.
    assert a.m == a.M == 2.5 and m.m == 5.5 and m.M == 8 and not m.request(Memory(6))
    with pytest.raises(ValueError, match=r"Memory\(5.5GB\) cannot allocate Memory\(6GB\)"):
        m.alloc(Memory(6))
    m.dealloc(a)
    assert m.m == 8 and m.stat() == {"Memory": (8, 8)}
    for bad in (-1, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"Memory\(M\) must be a non-negative finite"):
            Memory(bad)
    with pytest.raises(ValueError, match=r"WTime\(T\) must be a non-negative finite"):
        WTime(T=math.inf)
    n = Node(N=16, M=10)
    assert n.N == 16 and n.M == 10 and n.m == 10 and repr(n) == "CPU_Cores([0-15]) & Memory(10GB)"
    gpu = Token("gpu")
    assert gpu.request(Token("gpu")) and not gpu.request(Token("fpga"))
    assert (Cores([0]) & gpu).request(Cores(1))               # token workers run plain jobs
    assert not Cores([0]).request(Cores(1) & Token("gpu"))    # token jobs need the token
    seats = Capacity(3)
    assert seats.alloc(Capacity(2)).v == 2 and seats.v == 1 and seats.V == 3
    one = Capacity(1)
    assert repr(grain.ONE_INSTANCE) == "ONE" and grain.ONE_INSTANCE.v == -1
    assert one.request(grain.ONE_INSTANCE)
    held = one.alloc(grain.ONE_INSTANCE)
    assert held.v == -1 and one.v == 0 and not one.request(grain.ONE_INSTANCE)
    with pytest.raises(ValueError, match="has no capacity"):
        one.alloc(grain.ONE_INSTANCE)
    one.dealloc(held)
    assert one.request(grain.ONE_INSTANCE) and one.v == one.V == 1


def test_combining_and_zero():
    r = Cores(2) & Memory(4) & Token("gpu")
    assert r.N == 2 and r.M == 4 and r.token == "gpu"
    with pytest.raises(AttributeError, match="no attribute 'zz'"):
        r.zz
    with pytest.raises(ValueError, match=r"same kind: Memory\(2GB\) & Memory\(8GB\)"):
        Memory(2) & Memory(8)
    with pytest.raises(ValueError, match="same kind"):
        Node(1, 2) & Cores(3)
    assert repr(ZERO) == "Ø" and (Cores(1) & ZERO) == Cores(1)
    assert Cores([0, 1]).request(ZERO) and ZERO.request(ZERO) and not ZERO.request(Cores(1))
    assert repr(Cores([0, 1]).alloc(ZERO)) == "Ø"
    with pytest.raises(ValueError, match="Cannot alloc: resource Ø does not have the same shape"):
        ZERO.alloc(Cores(1))
    # A request naming a kind the provider lacks is refused, as upstream.
    assert not Cores([0, 1, 2]).request(Node(2, 1))
    with pytest.raises(ValueError, match="does not have the same shape"):
        Cores([0, 1, 2]).alloc(Cores(1) & WTime(T=5))
    # Comparisons: a <= b when request a fits in provider b.
    assert Cores(2) <= Cores([0, 1, 2]) and not Cores(4) <= Cores([0, 1, 2])
    assert ((Cores([0, 1, 2]) & Memory(1)) >= Node(2, 1)) is True
    assert (Cores([0, 1, 2]) >= Node(2, 1)) is False
    assert Cores(2) < (Cores([0, 1]) & Memory(3)) and not Cores(2) < Cores(2)
    assert Cores(3) == Cores([0, 1, 2]) and Cores(3) != Cores([1, 2, 3]) and Memory(2) != Cores(2)
    # Reject grants nothing and keeps what is given back.
    r = grain.Reject(Memory(8))
    r.dealloc(Memory(4))
    assert repr(r) == "N/A" and not r.request(Memory(1)) and r.eject() == Memory(12)
    assert not grain.REJECT.request(ZERO)
    with pytest.raises(ValueError, match="No resource is or will be available"):
        r.alloc(Memory(1))


def test_dict_form_round_trip_and_errors():
    d = {"Cores": {"N": 16}, "Memory": {"M": 32}, "WTime": {"T": "1:00:00", "countdown": True}}
    r = grain.Resource.from_dict(d)
    assert r.N == 16 and r.M == 32 and r.T == 3600 and r.countdown
    assert grain.Resource.from_dict(Cores([3, 4]).to_dict()).c == [3, 4]
    rt = grain.Resource.from_dict((Memory(2) & Token("gpu") & Capacity(3)).to_dict())
    assert rt == Memory(2) & Token("gpu") & Capacity(3)
    assert grain.Resource.from_dict({}) is ZERO
    with pytest.raises(ValueError, match="unknown resource kind 'GPU'.*known: Capacity, Cores"):
        grain.Resource.from_dict({"GPU": {"N": 1}})
    with pytest.raises(ValueError, match="resource Cores: unknown argument 'n'"):
        grain.Resource.from_dict({"Cores": {"n": 1}})
    with pytest.raises(ValueError, match="Cores"):
        grain.Resource.from_dict({"Cores": {"N": -2}})


@trio_test
async def test_custom_resource_kind_in_the_executor():
    seen = []

    async def job():
        seen.append(list(GVAR.res.ids))
        await trio.sleep(0.01)

    async with grain.GrainExecutor(rpw=Cores(4) & GPU(2)) as exer:
        jobs = [exer.submit(Cores(1) & GPU(1), job) for _ in range(4)]
    assert all(j.done() and j.error is None for j in jobs)
    assert sorted(map(tuple, seen)) == [(0,), (0,), (1,), (1,)]
    # `ls` and explain show a request of it by its repr (it need not say its arguments)
    assert grain.request_text(Cores(1) & GPU(1)) == "Cores(N=1) & GPU([0])"
    grain.register_resource(GPU)
    assert grain.RESOURCE_TYPES["GPU"] is GPU
    del grain.RESOURCE_TYPES["GPU"]


###############################################################################
# Resource kinds ##############################################################
###############################################################################


@trio_test
async def test_wtime_countdown_and_softT(autojump_clock):
    worker = WTime(T=100, countdown=True)  # counts down from its construction
    assert repr(worker) == "Walltime(00:01:40)" and repr(WTime(T="1:56:40")) == "Walltime(01:56:40)"
    assert worker.request(WTime(T=200, softT=90))
    await trio.sleep(20)
    assert worker.remaining() == pytest.approx(80) and repr(worker) == "Walltime(00:01:20)"
    assert not worker.request(WTime(T=200, softT=90)) and worker.request(WTime(T=70))
    assert worker.request(WTime(group="g"))  # no estimate yet: fits anywhere
    assert worker.alloc(WTime(T=3)).T == 3


@trio_test
async def test_wtime_group_estimates_through_the_resource_api(autojump_clock):
    worker = WTime(T=7000, countdown=True)
    runs = [worker.alloc(WTime(group="g")) for _ in range(grain.TIMESTAT_NSAMPLE)]
    assert all(r.T is None for r in runs) and repr(runs[0]) == "Walltime(group=g)"
    await trio.sleep(12)
    for r in runs:
        worker.dealloc(r)
    estimated = worker.alloc(WTime(group="g"))
    assert estimated.T == estimated.softT == 12.0 and estimated.group == "g"
    # Runs of 10 s or less teach nothing.
    short = [worker.alloc(WTime(group="s")) for _ in range(grain.TIMESTAT_NSAMPLE)]
    await trio.sleep(5)
    for r in short:
        worker.dealloc(r)
    assert worker.alloc(WTime(group="s")).T is None


def test_wtime_outside_trio_counts_wall_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    w = WTime(T=30, countdown=True)
    now[0] += 2
    assert w.remaining() == 28 and not w.request(WTime(T=29)) and w.request(WTime(T=28))


def test_gpus_whole_devices_and_shares():
    node = Gpus(4)
    whole, pair = node.alloc(Gpus(1)), node.alloc(Gpus(2))
    halves = [node.alloc(Gpus(0.5)) for _ in range(2)]
    assert whole.ids == ["0"] and pair.ids == ["1", "2"]
    assert halves[0].ids == halves[1].ids == ["3"]        # shares fill one device
    assert not node.request(Gpus(0.25)) and not node.request(Gpus(1))
    node.dealloc(pair)
    quarter = node.alloc(Gpus(0.25))                      # shares one device, not two
    assert node.alloc(Gpus(0.25)).ids == quarter.ids == ["1"]
    node.dealloc(quarter)
    node.dealloc(quarter)
    assert node.request(Gpus(2)) and not node.request(Gpus(3))
    assert repr(halves[0]) == "GPUs([3]x0.5)" and repr(pair) == "GPUs([1-2])"
    assert repr(Gpus(["MIG-a", "MIG-b"])) == "GPUs([MIG-a,MIG-b])"
    assert node.stat() == {"Gpus": (2.0, 4)}
    with pytest.raises(ValueError, match=r"Gpus\(1.5\): a fraction of a GPU must be below 1"):
        Gpus(1.5)
    assert grain.Resource.from_dict({"Gpus": {"N": 2}, "Cores": {"N": 4}}) == \
        Gpus(2) & Cores(4)
    assert pickle.loads(pickle.dumps(node)).stat() == node.stat()
    # a worker that comes back to a new head with a job still holds its devices
    fresh = Gpus(4)
    fresh.claim(halves[0])
    fresh.claim(whole)
    assert fresh.stat() == {"Gpus": (2.5, 4)} and not fresh.request(Gpus(3))


###############################################################################
# Context #####################################################################
###############################################################################


@trio_test
async def test_gvar_outside_and_inside_jobs():
    assert GVAR.res is ZERO and GVAR.instance is None

    async def job():
        await trio.sleep(0)
        return GVAR.res, GVAR.instance

    async with grain.GrainExecutor(rpw=Cores([6, 7, 9])) as exer:
        res, inst = await exer.submit(Cores(3), job)
        zero_res, _ = await exer.submit(ZERO, job)
    assert res.c == [6, 7, 9] and isinstance(res, Cores) and inst == "local"
    assert zero_res is ZERO
    assert GVAR.res is ZERO


@trio_test
async def test_a_worker_runs_jobs_one_after_another_in_one_task_each_seeing_its_gvar():
    tasks, cores = [], []

    async def job(i):
        tasks.append(trio.lowlevel.current_task())
        cores.append(list(GVAR.res.c))
        GVAR.res = Cores([99])  # what a job sets for itself stays its own

    async with grain.GrainExecutor(rpw=Cores([4, 5])) as exer:
        for i in range(50):
            await exer.submit(Cores(1), job, i)
        await exer.submit(Cores(2), job, 50)
    assert len(set(tasks)) == 1  # the task of a job that ended took the next
    assert cores == [[4]] * 50 + [[4, 5]]


@trio_test
async def test_a_task_pool_reuses_a_task_and_keeps_nothing_of_the_call_it_ended():
    class Payload:  # (bytes cannot be weakly referenced)
        pass

    tasks, ended = [], trio.Event()

    async def call(payload, last):
        tasks.append(trio.lowlevel.current_task())
        if last:
            ended.set()

    payload = Payload()
    gone = weakref.ref(payload)
    async with trio.open_nursery() as nursery:
        pool = grain.TaskPool(nursery, call)
        pool.start(payload, False)
        del payload
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        assert gone() is None  # an idle task does not keep its last call's arguments
        pool.start(Payload(), True)
        await ended.wait()
        nursery.cancel_scope.cancel()  # (idle tasks leave when their nursery is cancelled)
    assert len(tasks) == 2 and tasks[0] is tasks[1]


@trio_test
async def test_a_large_mission_keeps_the_collector_off_its_jobs_until_it_ends(monkeypatch):
    monkeypatch.setattr(grain, "FREEZE_JOBS", 10)  # (100,000 in real use)

    async def job():
        pass

    # Python 3.12 starts with objects of its own frozen (375 of them): counts are taken
    # against what was frozen before the mission, not against 0.
    before = gc.get_freeze_count()
    async with grain.GrainExecutor(rpw=Cores(1)) as exer:
        for _ in range(9):
            exer.submit(Cores(1), job)
        assert gc.get_freeze_count() == before  # a small mission changes nothing
        jobs = [exer.submit(Cores(1), job) for _ in range(16)]
        frozen = gc.get_freeze_count()
    assert frozen > before + 25  # the jobs, their requests, ...: out of the collector's walk
    assert gc.get_freeze_count() == 0 and all(j.done() for j in jobs)  # back in, at its end


@trio_test
async def test_a_plain_trio_tasklet_sets_gvar_res_and_subprocify_pins_to_it():
    cores = sorted(os.sched_getaffinity(0))[:2]
    seen = {}

    async def child():
        seen["child"] = (list(GVAR.res.c), GVAR.res.N, GVAR.res.m, GVAR.instance)

    async def tasklet():
        # How upstream documents running a tasklet outside a mission.
        GVAR.res = Node(N=cores, M=1)
        GVAR.instance = "by hand"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
        async with subprocess_pool_scope():
            seen["pool"] = await sp_info(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tasklet)
    assert seen["child"] == (cores, len(cores), 1, "by hand")
    _, child_pid, pinned, child_cores, child_instance = seen["pool"]
    assert child_pid != os.getpid() and pinned == cores  # the pool process ran on those cores
    assert child_cores == cores and child_instance == "by hand"
    assert GVAR.res is ZERO and GVAR.instance is None  # context-local: not set out here


def test_a_node_job_reads_its_memory_from_gvar():
    async def main():
        return await (delayed(_memory_of_my_job) @ Node(1, 1))()

    assert run(main, local=Node(2, 4), config_file=False) == (1, 1, 1)


###############################################################################
# Jobs ########################################################################
###############################################################################


def test_a_job_moves_only_as_its_life_allows_and_counts_a_run_as_it_starts():
    job = grain.Job(7, Cores(1), len, (), {})
    job.change("start")
    job.change("requeue")     # a retry: queued again, its first run counted
    job.change("start")
    assert (job.state, job.attempts) == ("running", 2)
    job.change("adopt")       # its worker came back with this run: not a new one
    job.change("report")
    assert (job.state, job.attempts) == ("running", 2)
    job.change("succeed")
    assert job.done() and job.state == "done"
    with pytest.raises(grain.GrainError, match=r"job #7 len cannot fail when done"):
        job.change("fail")    # an outcome is delivered once
    assert job.state == "done"
    job = grain.Job(8, Cores(1), len, (), {})
    with pytest.raises(grain.GrainError, match="cannot finish when queued"):
        job.change("finish")  # no such event
    job.change("report")      # the result of a run for an earlier head: one attempt
    assert (job.state, job.attempts) == ("running", 1)
    job = grain.Job(9, Cores(1), len, (), {})
    job.change("adopt")       # a worker came back running it: a run this head never started
    job.change("requeue")
    job.change("fail")        # failed in the queue (its mission's head went): no run more
    assert (job.state, job.attempts) == ("failed", 1)
    assert not grain.outlives_head(job.wire)  # its head's number, till it is named
    job.name_on_wire("3f2a#0")
    assert grain.outlives_head(job.wire)
    with pytest.raises(grain.GrainError, match=r"job #9 len: a wire name is text, not \('k', 0\)"):
        job.name_on_wire(("k", 0))  # (a store key's pair: its text goes to workers)


@trio_test
async def test_job_past_its_T_fails_with_too_slow(autojump_clock):
    async def slow():
        await trio.sleep(100)

    async def quick():
        return "ok"

    async def own_deadline():   # a deadline of the job's own passes, well within its T
        with trio.fail_after(1):
            await trio.sleep(100)

    async with grain.GrainExecutor(rpw=Cores(1)) as exer:
        job = exer.submit(Cores(1) & WTime(T=30), slow)
        with pytest.raises(trio.TooSlowError) as info:
            await job
        assert trio.current_time() == 30.0
        # the error names the job and its limit, as other failures name their job
        assert str(info.value) == f"job {job.name} ran past its T (WTime(T=30))"
        assert await exer.submit(Cores(1), quick) == "ok"   # the worker keeps serving
        with pytest.raises(trio.TooSlowError) as info:
            await exer.submit(Cores(1) & WTime(T=30), own_deadline)
        assert str(info.value) == ""   # the job's own error, not blamed on its T


@trio_test
async def test_job_exception_propagates_and_worker_keeps_serving():
    class Oops(Exception):
        pass

    async def bad(x):
        raise Oops(f"bad {x}")

    async def good(x):
        return x * 2

    async with grain.GrainExecutor(rpw=Cores(1)) as exer:
        with pytest.raises(Oops, match="bad 1") as info:
            await exer.submit(Cores(1), bad, 1)
        assert "bad" in "".join(__import__("traceback").format_tb(info.value.__traceback__))
        assert await exer.submit(Cores(1), good, 21) == 42
    assert exer.counts["failed"] == 1 and exer.counts["done"] == 1


@trio_test
async def test_temporary_errors_are_retried_then_reported():
    attempts = []

    async def flaky(n_fail):
        attempts.append(1)
        if len(attempts) <= n_fail:
            raise ConnectionError(f"try {len(attempts)}")
        return "finally"

    async with grain.GrainExecutor(rpw=Cores(1), temporary_err=ConnectionError) as exer:
        assert await exer.submit(Cores(1), flaky, 2) == "finally"
        assert len(attempts) == 3
        attempts.clear()
        with pytest.raises(ConnectionError) as info:
            await exer.submit(Cores(1), flaky, 100)
    assert len(attempts) == 4  # max_retries=3 -> 4 attempts
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "failed after 4 attempts (temporary error, 3 retries allowed)" in notes
    assert exer.counts["retried"] == 5


def test_a_failed_jobs_note_counts_the_runs_started_and_says_the_retries_when_they_differ():
    retries, tally = grain.Retries(max_retries=3, temporary_err=ConnectionError), grain.Tally()

    def note(job, kind, error=None):
        error = error or ConnectionError("refused")
        retries.note(job, error, kind)
        return error.__notes__[-1]
    job = grain.Job(3, Cores(1), len, ("a.xyz",), {})
    job.change("start")
    assert note(job, None, ValueError("bad")) == "grain: job #3 len('a.xyz') failed"
    for _ in range(3):        # three runs, each lost: retried, and run again
        assert retries.again(job, grain.RETRY_LOST, ConnectionError("gone"), tally)
        job.change("requeue")
        job.change("start")
    assert not retries.again(job, grain.RETRY_LOST, ConnectionError("gone"), tally)
    assert note(job, grain.RETRY_LOST).endswith(
        "failed after 4 attempts (worker lost, 3 retries allowed)")
    job = grain.Job(4, Cores(1), len, (), {})
    job.change("start")       # one run: its worker lost, back with it, lost again for good
    assert retries.again(job, grain.RETRY_LOST, ConnectionError("gone"), tally)
    job.change("requeue")
    job.change("adopt")
    assert note(job, grain.RETRY_LOST).endswith(
        "failed after 1 attempt and 1 retry (worker lost, 3 retries allowed)")
    assert note(job, None, ValueError("bad")).endswith("failed after 1 attempt and 1 retry")
    assert tally.retried_by_class == {grain.RETRY_LOST: 4}


@trio_test
async def test_other_errors_are_not_retried():
    calls = []

    async def bad():
        calls.append(1)
        raise KeyError("x")

    async with grain.GrainExecutor(rpw=Cores(1), temporary_err=(ConnectionError,),
                                   max_retries=5) as exer:
        with pytest.raises(KeyError):
            await exer.submit(Cores(1), bad)
    assert calls == [1]


@trio_test
async def test_unawaited_failures_are_raised_at_the_end():
    async def bad():
        raise ValueError("nobody listened")

    async def good():
        return 1

    with pytest.raises(ExceptionGroup, match="1 job.s. failed and nobody awaited") as info:
        async with grain.GrainExecutor(rpw=Cores(1)) as exer:
            exer.submit(Cores(1), bad)
            exer.submit(Cores(1), good)
    assert isinstance(info.value.exceptions[0], ValueError)


@trio_test
async def test_submit_checks_its_arguments():
    def sync_fn():
        return 1

    async with grain.GrainExecutor(rpw=Cores(1)) as exer:
        with pytest.raises(TypeError, match="sync_fn is not an async function.*@subprocify"):
            exer.submit(Cores(1), sync_fn)
        with pytest.raises(TypeError, match="res must be a Resource"):
            exer.submit(3, sync_fn)


@trio_test
async def test_unpicklable_job_or_result(tmp_path):
    async def returns_lock():
        return (i for i in range(3))

    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        gen = (i for i in range(3))
        with pytest.raises(TypeError, match=r"where_am_i: argument 1 \(<generator object.*"
                                            "cannot be pickled"):
            exer.submit(Cores(1), where_am_i, 1, gen)
    w = Workers(tmp_path)
    try:
        async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
            w.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
            await exer.wait_for_workers(1)
            with pytest.raises(grain.GrainError, match="the result cannot be pickled.*generator"):
                await exer.submit(Cores(1), returns_lock)
    finally:
        w.close()


def test_job_function_by_value_takes_a_module_subclass_by_name():
    # trio before 0.23 is an instance of a ModuleType subclass, which dill alone refuses to
    # pickle; a decorated function (pickled by value) that uses such a module must travel.
    mod = type("LazyModule", (types.ModuleType,), {})("grain_test_lazy_module")
    mod.answer = 42
    sys.modules[mod.__name__] = mod
    try:
        def uses_module():
            return mod.answer

        uses_module.__module__ = "__main__"  # as a script's function: by value, not by name
        data = grain.dumps_job_value(uses_module, "the job function")
        assert data[:1] == b"d"
        fn = grain.loads_job_value(data)
        assert fn() == 42
    finally:
        del sys.modules[mod.__name__]


def test_functions_of_the_users_script_travel_by_value(monkeypatch):
    # pickle takes a function of __main__ by name, and a worker's __main__ is not the
    # user's script: such a function must go by value (dill).
    async def script_job():
        return 7

    script_job.__module__, script_job.__qualname__ = "__main__", "script_job"
    monkeypatch.setattr(sys.modules["__main__"], "script_job", script_job, raising=False)
    data = grain.dumps_job_value(script_job, "the job function")
    monkeypatch.delattr(sys.modules["__main__"], "script_job")
    assert data[:1] == b"d"
    assert trio.run(grain.loads_job_value(data)) == 7


###############################################################################
# Wire protocol ###############################################################
###############################################################################


def test_handshake_state_machine():
    key = os.urandom(32)
    a, b = grain.Handshake(key, dialer=True), grain.Handshake(key, dialer=False)
    pa, pb = a.proof(b.hello()), b.proof(a.hello())
    a.verify(pb)
    b.verify(pa)
    with pytest.raises(grain.AuthenticationError):
        a.verify(pa)                     # a proof reflected back is refused
    c = grain.Handshake(os.urandom(32), dialer=False)
    pc = c.proof(a.hello())
    with pytest.raises(grain.AuthenticationError, match="does not hold the grain key"):
        a.verify(pc)
    with pytest.raises(grain.AuthenticationError, match="does not speak"):
        a.proof(b"HTTP/1.1 200 OK" + b"x" * 25)
    older = b"GRAIN\x04\r\n" + os.urandom(32)  # a daemon that does not say when jobs start
    with pytest.raises(grain.AuthenticationError, match="speaks version 4 of the grain protocol"
                       ", this grain.py 5: run the same grain.py on both sides"):
        a.proof(older)


@trio_test
async def test_a_write_that_would_exceed_the_largest_frame_goes_in_several():
    # A write's messages are pickled together; when that would make a frame larger than
    # the receiver takes, they go as several frames, each within it, in their order, each
    # with its tag (a receiver holds at most a frame's worth untagged). (Whole: four
    # 400-byte results are 1.7 KB, over a 1,000-byte limit.)
    key = os.urandom(32)
    left, right = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(grain.authenticate, left, key, True)
        nursery.start_soon(grain.authenticate, right, key, False)
    sent = [("done", i, True, os.urandom(400), 0.5) for i in range(4)]
    a, b = grain.Channel(left, 1000, "left"), grain.Channel(right, 1000, "right")
    for msg in sent:
        a.send(msg)
    await a.flush()
    assert [await b.receive() for _ in sent] == sent
    assert (a._seal.sent, b._seal.received) == (2, 2)  # two frames of two, two tags
    assert len(grain._frames_of(sent, 1 << 20)) == 1   # ...and one frame when it fits


@trio_test
async def test_a_write_the_socket_cannot_take_at_once_goes_whole_when_it_can():
    # A Channel on a socket writes to the socket itself what the kernel takes at once, and
    # leaves the rest to trio, which waits until the socket can take it: 8 MB (more than
    # a socket's buffers) arrive whole and in order, with what was queued after them.
    key = os.urandom(32)
    left, right = (trio.SocketStream(s) for s in trio.socket.socketpair())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(grain.authenticate, left, key, True)
        nursery.start_soon(grain.authenticate, right, key, False)
    a, b = grain.Channel(left, peer="left"), grain.Channel(right, peer="right")
    assert a._fileno is not None  # (a plain socket: the direct path is taken)
    big = ("done", 1, True, os.urandom(8 << 20), 0.5)
    async with trio.open_nursery() as nursery:
        a.send(big)
        a.send(("ping",))
        nursery.start_soon(a.flush)  # (it waits for b to read)
        assert await b.receive() == big
        assert await b.receive() == ("ping",)
    await a.aclose()
    await b.aclose()


@trio_test
async def test_the_protocol_over_memory_streams(autojump_clock):
    key = os.urandom(32)
    left, right = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:  # both sides of the handshake at once
        nursery.start_soon(grain.authenticate, left, key, True)
        nursery.start_soon(grain.authenticate, right, key, False)
    got = []
    handlers = {"done": lambda *fields: got.append(fields), "ping": lambda: None}
    t0 = trio.current_time()
    async with grain.open_channel(left, "left") as a, \
            grain.open_channel(right, "right", heartbeat=False, silent_after=None) as b:
        a.send(("done", 7, True, b"data", 0.5))          # [kind] may be left out
        a.send(("done", 8, False, b"err", 0.1, "raised"))
        for _ in range(2):
            grain.dispatch(handlers, await b.receive(), "left")
        assert got == [(7, True, b"data", 0.5), (8, False, b"err", 0.1, "raised")]
        await trio.sleep(grain.HEARTBEAT_S + 1)          # the heartbeat of open_channel
        assert await b.receive() == ("ping",)
        with pytest.raises(grain.PeerError, match="'done' with 2 field"):
            grain.dispatch(handlers, ("done", 1, True), "left")
        with pytest.raises(grain.PeerError, match="unexpected message"):
            grain.dispatch(handlers, ("fin",), "left")   # in MESSAGES, but not handled here
        with pytest.raises(grain.PeerError, match="unexpected message"):
            grain.dispatch(handlers, "hack", "left")
        # Silence: b sends nothing, so SILENT_S after it opened, a's block is cancelled.
        await trio.sleep_forever()
    assert a.silent and trio.current_time() - t0 == pytest.approx(grain.SILENT_S, abs=1)
    assert set(grain.MESSAGES) >= {"register", "run", "done", "fin"} and \
        len(grain.MESSAGES) == 22


def test_frame_decoder():
    dec = grain.FrameDecoder(max_frame=10)
    data = grain.encode_frame(b"abc") + grain.encode_frame(b"") + grain.encode_frame(b"0123")
    assert dec.feed(data[:5]) == [] and dec.feed(data[5:]) == [b"abc", b"", b"0123"]
    assert dec.feed(grain.encode_frame(b"12")[:3]) == [] and dec.pending == 3
    with pytest.raises(grain.FrameError, match="exceeds the maximum 10"):
        grain.FrameDecoder(max_frame=10).feed(grain.FRAME_HEADER.pack(11))


def test_key_file_is_created_private_and_a_readable_one_is_refused(tmp_path):
    path = tmp_path / "sub" / "key"
    key = grain.load_auth_key(str(path))
    assert len(key) == 32 and oct(path.stat().st_mode)[-3:] == "600"
    assert grain.load_auth_key(str(path)) == key
    path.chmod(0o644)
    with pytest.raises(grain.GrainError, match=r"readable by others \(mode 0644\).*chmod 600"):
        grain.load_auth_key(str(path))
    cp = grain_cli("ls", "--key", str(path), "-a", "tcp://127.0.0.1:1")
    assert cp.returncode == 1 and "chmod 600" in cp.stderr and "Traceback" not in cp.stderr


def test_a_tls_certificate_that_cannot_be_used_is_one_line_naming_it(tmp_path):
    cert, private = _tls_pair(tmp_path)
    key = tmp_path / "key"
    assert grain.load_auth_key(str(key), cert, private).tls is not None
    with pytest.raises(grain.GrainError, match=r"cannot use TLS certificate .*nope.crt.*No such"):
        grain.load_auth_key(str(key), str(tmp_path / "nope.crt"))
    with pytest.raises(grain.GrainError, match=r"cannot use TLS certificate .*: .*PEM"):
        grain.load_auth_key(str(key), str(key))  # (not a certificate)
    pathlib.Path(private).chmod(0o640)
    toml = tmp_path / "grain.toml"
    toml.write_text(f'auth_key = "{key}"\ntls_cert = "{cert}"\ntls_key = "{private}"\n')
    cp = grain_cli("ls", "-c", str(toml), "-a", "tcp://127.0.0.1:1")
    assert cp.returncode == 1 and "Traceback" not in cp.stderr
    assert f"TLS key file {private} is readable by others (mode 0640)" in cp.stderr


def test_key_file_made_by_eight_processes_at_once_is_read_whole_by_all(tmp_path):
    # `up -n 2` on a fresh home: the workers race to make the key. Each process waits at a
    # barrier (a file appearing), then loads the key; all must get the same 32 bytes, none
    # may read it half written ("holds 0 bytes").
    go = tmp_path / "go"
    code = ("import os, sys, time\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "import grain\n"
            "print('ready', flush=True)\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.0005)\n"
            "print(grain.load_auth_key(sys.argv[3]).hex())\n")
    for attempt in range(3):
        key = tmp_path / f"home{attempt}" / "grain" / "key"
        procs = [subprocess.Popen([sys.executable, "-c", code, HERE, str(go), str(key)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(8)]
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 8
        go.touch()
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, [err for _, err in outs]
        assert len({out for out, _ in outs}) == 1 and len(outs[0][0].strip()) == 64
        assert sorted(os.listdir(key.parent)) == ["key"]   # no temporary file left
        assert oct(key.stat().st_mode)[-3:] == "600"
        go.unlink()


###############################################################################
# Transports ##################################################################
###############################################################################


class CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@trio_test
async def test_the_head_refuses_bad_peers_and_keeps_serving(workers, tmp_path, caplog):
    evil = tmp_path / "pwned"
    with caplog.at_level(logging.WARNING, logger="grain"):
        async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
            url = exer.urls["tcp"]
            port = int(url.rsplit(":", 1)[1])
            good = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="good")
            await exer.wait_for_workers(1)
            payload = pickle.dumps(CreatesFile(str(evil)))
            attacks = [
                grain.encode_frame(pickle.dumps(("register", {"name": "x"}))),   # no handshake
                grain.encode_frame(payload),                                     # a pickle bomb
                os.urandom(300),                                                 # noise
                b"\xff\xff\xff\xff" + os.urandom(64),                            # huge length
                grain.AUTH_MAGIC + os.urandom(32) + os.urandom(32),              # wrong key
            ]
            for data in attacks:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(data)
                    with trio.move_on_after(grain.HANDSHAKE_TIMEOUT_S + 2):
                        while await stream.receive_some(1024):
                            pass
                await stream.aclose()
            # A peer with the wrong key, speaking the protocol properly.
            with pytest.raises(grain.AuthenticationError):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await grain.authenticate(stream, os.urandom(32), dialer=True)
            assert not evil.exists()
            assert (await exer.submit(Cores(1), where_am_i, 7))[1] == good.pid
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in
                r.getMessage()]
    assert len(refusals) == 6 and all("127.0.0.1:" in m for m in refusals)


@trio_test
async def test_oversized_frame_after_auth_closes_only_that_connection(workers):
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0", max_frame=1000) as exer:
        url = exer.urls["tcp"]
        port = int(url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await grain.authenticate(stream, exer.key, dialer=True)
        await stream.send_all(grain.FRAME_HEADER.pack(10 ** 6) + b"x" * 100)
        with trio.fail_after(5):
            while await stream.receive_some(1024):
                pass   # the head closes this connection
        w = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="after")
        await exer.wait_for_workers(1)
        assert (await exer.submit(Cores(1), where_am_i, 1))[1] == w.pid


async def _read_messages(frames, n):
    """The next ``n`` messages (at least) a grain side wrote on an unsealed stream: a frame
    holds a write's messages, pickled together as a list."""
    got = []
    while len(got) < n:
        got += pickle.loads(await frames.receive())
    return got


def _sealed(seal, payload, tag_of=None):
    """A write of ``payload``'s frame and the tag frame ``seal`` gives it (or gave
    ``tag_of``'s)."""
    return grain.encode_frame(payload) + seal.tag(
        [grain.encode_frame(payload if tag_of is None else tag_of)])


@trio_test
async def test_a_frame_altered_dropped_replayed_or_injected_closes_its_connection(
        workers, tmp_path, caplog):
    # After the handshake: what a relay or the path could do to the frames of an
    # authenticated worker. Each closes that connection, with a line naming the peer,
    # before anything is unpickled; the head serves on. (A frame injected into a write
    # is caught by that write's tag: the "ping" after it.)
    evil = tmp_path / "pwned"
    bomb = pickle.dumps(CreatesFile(str(evil)))
    register = grain.dumps_control([("register", {"name": "w", "res": Cores(1), "pid": 1})])
    ping = grain.dumps_control([("ping",)])
    attacks = {
        "altered": lambda s: [(f := _sealed(s, register))[:30] + bytes([f[30] ^ 1]) + f[31:]],
        "dropped": lambda s: [(s.tag([grain.encode_frame(register)]), _sealed(s, bomb))[1]],
        "replayed": lambda s: [_sealed(s, register), (f := _sealed(s, ping)), f],
        "injected": lambda s: [_sealed(s, register), grain.encode_frame(bomb),
                               _sealed(s, ping)],
        "tag of another": lambda s: [_sealed(s, bomb, tag_of=register)],
    }
    with caplog.at_level(logging.WARNING, logger="grain"):
        async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
            port = int(exer.urls["tcp"].rsplit(":", 1)[1])
            for name, frames in attacks.items():
                caplog.clear()
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await grain.authenticate(stream, exer.key, dialer=True)
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(b"".join(frames(stream.seal)))
                    with trio.fail_after(5):
                        while await stream.receive_some(1024):
                            pass   # the head closes this connection
                await stream.aclose()
                lines = [r.getMessage() for r in caplog.records]
                assert any("failed its integrity check" in m and "127.0.0.1:" in m
                           for m in lines), (name, lines)
            assert not evil.exists() and exer.workers == []
            w = workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
            await exer.wait_for_workers(1)
            assert (await exer.submit(Cores(1), where_am_i, 1))[1] == w.pid


def _tls_pair(tmp_path):
    """A self-signed certificate and its key, made as the README says."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=grain",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    key.chmod(0o600)
    return str(cert), str(key)


async def _recording_proxy(nursery, port, seen):
    """A port forwarding to 127.0.0.1:``port`` that keeps in ``seen`` the bytes it passes
    (what anyone on the path sees)."""
    async def handle(client):
        async with client, await trio.open_tcp_stream("127.0.0.1", port) as server:
            async with trio.open_nursery() as both:
                async def pipe(a, b):
                    with contextlib.suppress(trio.BrokenResourceError, OSError):
                        async for data in a:
                            seen.extend(data)
                            await b.send_all(data)
                    both.cancel_scope.cancel()
                both.start_soon(pipe, client, server)
                both.start_soon(pipe, server, client)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"),
                                    handle, 0)
    return listeners[0].socket.getsockname()[1]


@pytest.mark.parametrize("tls", [True, False])
@trio_test
async def test_with_tls_in_the_config_the_path_cannot_read_a_job(workers, tmp_path, caplog,
                                                                   tls):
    # The worker runs the line a job script would (worker_command), from a config naming
    # the certificate; a recording proxy between it and the head sees the bytes.
    cert, private = _tls_pair(tmp_path)
    key = grain.load_auth_key(str(tmp_path / "key"), *((cert, private) if tls else ()))
    secret, seen = "the-molecule-nobody-else-may-see", bytearray()
    with caplog.at_level(logging.WARNING, logger="grain"):
        async with trio.open_nursery() as nursery, \
                grain.GrainExecutor(listen="tcp://127.0.0.1:0", key=key) as exer:
            proxy = await _recording_proxy(nursery, int(exer.urls["tcp"].rsplit(":", 1)[1]),
                                           seen)
            toml = tmp_path / "grain.toml"
            toml.write_text(f'address = "tcp://127.0.0.1:{proxy}"\nauth_key = "{tmp_path}/key"\n'
                            + (f'tls_cert = "{cert}"\ntls_key = "{private}"\n' if tls else ""))
            line = grain.worker_command(grain.load_config(str(toml)).role("worker"))
            assert ("--tls-cert" in line) == tls
            w = workers.start(*shlex.split(line)[3:], "--res", '{"Cores": {"N": 1}}')
            if tls:  # a worker that does not speak TLS is refused, saying why
                workers.start("--url", f"tcp://127.0.0.1:{proxy}", "--key",
                              str(tmp_path / "key"), "--reattach", "0", name="plain")
            await exer.wait_for_workers(1)
            assert (await exer.submit(Cores(1), where_am_i, secret))[:2] == (secret, w.pid)
            with trio.fail_after(10):
                while tls and not any("no TLS session" in r.getMessage()
                                      for r in caplog.records):
                    await trio.sleep(0.05)
            assert [x.name for x in exer.workers] == ["w"]
            nursery.cancel_scope.cancel()
    assert (secret.encode() in seen) is not tls and len(seen) > 500  # (it went that way)


@trio_test
async def test_remote_worker_over_tcp(workers):
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        url = exer.urls["tcp"]
        w = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="tcpw")
        await exer.wait_for_workers(1)
        results = [await j for j in [exer.submit(Cores(1), where_am_i, i) for i in range(5)]]
        allowed = sorted(os.sched_getaffinity(0))
        for i, (x, pid, cores, inst) in enumerate(results):
            assert x == i and pid == w.pid != os.getpid() and inst == "tcpw"
            assert cores == allowed[:1]   # the allocated slice of the worker's real cpuset
    assert await wait_exit(w) == 0           # FIN at mission end: it leaves cleanly
    log_text = w.log_path.read_text()
    assert "the head said goodbye" in log_text and "lost the head" not in log_text


@pytest.mark.parametrize("worker_first", [True, False])
@trio_test
async def test_remote_workers_meet_the_head_through_an_edge_file(workers, tmp_path,
                                                                  worker_first):
    edge = tmp_path / "edge"
    url = f"edge://{edge}"
    if worker_first:
        w = workers.start("--url", url, name="edgew")
        with trio.fail_after(15):
            while not (edge.exists() and '"did"' in edge.read_text()):
                await trio.sleep(0.05)   # recorded as a waiting dialer
    async with grain.GrainExecutor(listen=url) as exer:
        assert '"lid"' in edge.read_text() and oct(edge.stat().st_mode)[-3:] == "600"
        if not worker_first:
            w = workers.start("--url", url, name="edgew")
        await exer.wait_for_workers(1)
        x, pid, cores, inst = await exer.submit(Cores(2), where_am_i, 1)
        assert pid == w.pid and len(cores) == 2 and inst == "edgew"
    assert await wait_exit(w) == 0
    import json
    assert json.loads(edge.read_text())["listener"] is None   # our record is gone


@trio_test
async def test_a_waiting_worker_whose_record_a_head_dropped_dials_again(tmp_path,
                                                                        monkeypatch, caplog):
    # A head that could not call a waiting worker back (a network cut between them) drops
    # its record, and will not call it again: the worker, once its record is gone, dials
    # the recorded head again (it waited for good), and reaches it when it answers. That
    # it waits for that head it says once, however often it dials.
    monkeypatch.setattr(grain, "EDGE_HEARTBEAT_S", 0.05)
    key = grain.load_auth_key(str(tmp_path / "key"))
    edge = grain.EdgeFile(str(tmp_path / "edge"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # (the head's address: nobody answers there yet)
    with edge.locked() as data:
        data["listener"] = {"host": grain.hostname(), "lid": "h", "pid": os.getpid(),
                            "heartbeat": time.time(), "urls": {"lo": f"tcp://127.0.0.1:{port}"}}

    def dialers():
        with edge.locked() as data:
            return data["dialer"]
    got = []
    async with trio.open_nursery() as nursery:
        async def worker():
            got.append(await grain.connect(f"edge://{tmp_path}/edge", key, wait=True))
        nursery.start_soon(worker)
        with trio.fail_after(10), caplog.at_level(logging.INFO, logger="grain"):
            for _ in range(2):
                while not dialers():
                    await trio.sleep(0.01)
                with edge.locked() as data:
                    data["dialer"] = []   # (what a head that could not call it does)
            listeners, _ = await grain.open_listeners(f"tcp://127.0.0.1:{port}")
            async with await grain.accept_one(listeners, key):
                while not got:
                    await trio.sleep(0.01)
    await got[0].aclose()
    assert dialers() == []
    said = [r.getMessage().split(" (")[0].split(" at ")[0] for r in caplog.records
            if r.levelno >= logging.INFO]
    assert said == [f"the head recorded in {tmp_path}/edge does not answer",
                    "waiting for a head to call"], said


def test_edge_file_recovery(tmp_path):
    edge = tmp_path / "edge"
    for content in ["", "{not json", '{"listener": {"host": "x", "urls": {}, "heartbeat": 1}}',
                    '["a list"]']:
        edge.write_text(content)
        with grain.EdgeFile(str(edge)).locked() as data:
            assert not grain.EdgeFile(str(edge)).live(data["listener"])
            assert data["dialer"] == []


@pytest.mark.parametrize("skew", [-300, 300])
def test_a_heads_edge_record_is_aged_by_the_file_servers_clock(tmp_path, monkeypatch, skew):
    # A head on one node writes its heartbeat; workers and other heads on other nodes,
    # whose clocks may be minutes off, read it. Both sides use the file server's clock: a
    # live head is not taken for dead (a second head would replace it, its workers would
    # wait for nobody), nor a dead one for live (no head could start there).
    path = tmp_path / "edge"
    edge = grain.EdgeFile(str(path))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)  # (this host's clock)
    for age, live in ((0, True), (2 * grain.EDGE_STALE_S, False)):
        with edge.locked() as data:
            data["listener"] = {"host": "elsewhere", "lid": "h", "pid": 1,
                                "heartbeat": grain.file_server_time(f"{path}.lock") - age,
                                "urls": {"lo": "tcp://127.0.0.1:1"}}
        assert edge.live(data["listener"]) is live
        assert bool(grain._head_seems_there(f"edge://{path}")) is live
    assert sorted(os.listdir(tmp_path)) == ["edge", "edge.lock"]


def test_an_address_that_cannot_be_listened_on_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for url, why in [("unix:///no/such/dir/s", "its directory does not exist"),
                         ("tcp://192.0.2.1:5000", "no interface of this machine has that "
                                                  "address"),
                         (f"tcp://127.0.0.1:{port}", "another process listens there already")]:
            cp = grain_cli("worker", "--listen", url)
            assert cp.returncode == 1 and cp.stderr == \
                f"grain.py worker: cannot listen at {url}: {why}\n", cp.stderr
    # a mission given such an address stops (only an Edge file another head holds is
    # passed over, to run without accepting workers)
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from grain.delayed import run; "
            "from grain.resource import Cores\nasync def main(): pass\n"
            "run(main, local=Cores(1), config_file=False, address='tcp://192.0.2.1:5000')")
    cp = run_py("-c", code)
    assert cp.returncode == 1 and cp.stderr.strip().splitlines()[-1] == (
        "grain.ListenError: cannot listen at tcp://192.0.2.1:5000: no interface of this "
        "machine has that address")


def test_edge_in_a_directory_we_cannot_write(tmp_path, monkeypatch):
    # The suite runs as root in CI, for whom every directory is writable: ask os.access.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path)
                        else real_access(p, mode))
    with pytest.raises(grain.UsageError, match=f"directory {tmp_path} is not writable"):
        grain.EdgeFile(str(tmp_path / "edge"))


@trio_test
async def test_a_crashed_heads_edge_record_is_replaced(workers, tmp_path, caplog):
    edge = tmp_path / "edge"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()   # a pid that no longer runs, as after `kill -9` of a head
    edge.write_text(_json.dumps({"listener": {
        "host": grain.hostname(), "lid": "old", "pid": dead.pid, "heartbeat": time.time(),
        "urls": {"lo": "tcp://127.0.0.1:1"}}, "dialer": []}))
    w = workers.start("--url", f"edge://{edge}", "--res", '{"Cores": {"N": 1}}', name="patient")
    with trio.fail_after(15):
        while '"did"' not in edge.read_text():
            await trio.sleep(0.05)   # it saw the record was stale and waits to be called
    with caplog.at_level(logging.WARNING, logger="grain"):
        async with grain.GrainExecutor(listen=f"edge://{edge}") as exer:
            await exer.wait_for_workers(1)
            assert (await exer.submit(Cores(1), where_am_i, 1))[3] == "patient"
    assert f"replacing the stale record of pid {dead.pid}" in caplog.text
    assert "stale head record" in w.log_path.read_text()


@pytest.fixture
def tmpdir_of_its_own(monkeypatch):
    """A TMPDIR for one test, short enough for sockets' paths below it (tmp_path is not)."""
    path = pathlib.Path(tempfile.mkdtemp(dir=RUN_HOME))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path)


@trio_test
async def test_sockets_are_in_a_private_directory_in_tmpdir(tmpdir_of_its_own, tmp_path,
                                                            monkeypatch):
    private = tmpdir_of_its_own / f"grain-{os.getuid()}"
    sock = pathlib.Path(grain.mission_socket_path("edge:///x/edge"))
    assert sock.parent == private and sock.name.startswith("head-")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    # an Edge head's socket for peers on this host is there too, not beside the Edge file
    (tmp_path / "share").mkdir()
    async with grain.GrainExecutor(listen=f"edge://{tmp_path}/share/edge") as exer:
        sock = pathlib.Path(grain.parse_url(exer.urls["unix"])[2])
        assert sock.parent == private and sock.name.startswith("edge-head-") and sock.exists()
        assert sorted(os.listdir(tmp_path / "share")) == ["edge", "edge.lock"]
    assert not sock.exists()
    private.chmod(0o755)
    with pytest.raises(grain.GrainError) as info:
        grain.mission_socket_path("edge:///x/edge")
    assert str(info.value) == (f"{private} must be a directory of yours that only you can read "
                               "(mode 0700): it holds grain's sockets; remove it or chmod 700 it")
    # a TMPDIR too long for a socket's path below it: /tmp's
    had_tmp = os.path.isdir(f"/tmp/grain-{os.getuid()}")
    monkeypatch.setenv("TMPDIR", str(tmpdir_of_its_own / ("d" * 60)))
    assert os.path.dirname(grain.mission_socket_path("x")) == f"/tmp/grain-{os.getuid()}"
    if not had_tmp:
        os.rmdir(f"/tmp/grain-{os.getuid()}")


@trio_test
async def test_a_new_listener_removes_the_sockets_dead_processes_left_never_live_ones(
        tmpdir_of_its_own, tmp_path, caplog):
    private = tmpdir_of_its_own / f"grain-{os.getuid()}"
    edge = f"edge://{tmp_path}/edge"
    with caplog.at_level(logging.WARNING, logger="grain"), \
            socket.socket(socket.AF_UNIX) as listening:
        async with grain.GrainExecutor(listen=edge) as exer:   # a live grain listener
            head = pathlib.Path(grain.parse_url(exer.urls["unix"])[2])
            live, dead = private / "live.sock", private / "head-0123456789abcdef.sock"
            listening.bind(str(live))
            listening.listen()
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(dead))   # bound, never listened on: as a killed process left it
            old = time.time() - grain.SOCKET_GRACE_S - 1
            os.utime(dead, (old, old), follow_symlinks=False)
            # bound a moment ago by a process that will listen on it next: not taken for dead
            starting = socket.socket(socket.AF_UNIX)
            starting.bind(str(private / "worker-starting.sock"))
            (listener,), _ = await grain.open_listeners(f"unix://{tmp_path}/new.sock")
            await listener.aclose()
            starting.close()
            assert sorted(p.name for p in private.iterdir()) == sorted(
                [head.name, live.name, "worker-starting.sock"])
            # the head, probed, answers as before, and took the probe for no attack
            await (await grain.connect(edge, exer.key)).aclose()
    assert "refused a connection" not in caplog.text


def test_a_process_of_the_run_that_imports_this_file_keeps_the_runs_home(tmp_path):
    # as a worker or a subprocess-pool process unpickling a function defined here does;
    # killed, it leaves nothing behind
    code = ("import os, test_grain as t; print(t.RUN_HOME, t.signal.getsignal(15) == 0, "
            "flush=True); os.kill(os.getpid(), 9)")
    cp = run_py("-c", code, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert cp.returncode == -9 and cp.stdout == f"{RUN_HOME} True\n", cp.stderr
    assert list(tmp_path.iterdir()) == []


# A test run of this file, killed (SIGTERM, as a CI job's timeout does) while a head
# daemon it started runs detached and a worker it killed left its socket.
KILLED_RUN = textwrap.dedent("""
    import json, os, signal, subprocess, sys
    sys.path.insert(0, {here!r})
    from test_grain import GRAIN, wait_for

    def test_killed_while_its_processes_run():
        edges = ["edge://" + os.environ["HOME"] + e for e in ("/a", "/b")]
        head = subprocess.Popen([sys.executable, GRAIN, "head", "--no-config", "-a", edges[0]],
                                start_new_session=True)   # as run() starts one
        worker = subprocess.Popen([sys.executable, GRAIN, "worker", "--url", edges[1]])
        private = os.path.join(os.environ["TMPDIR"], f"grain-{{os.getuid()}}")
        wait_for(lambda: len(os.listdir(private)) == 3 if os.path.isdir(private) else False,
                 30, "the sockets")   # the daemon's two, the worker's
        worker.kill()
        worker.wait()
        with open({ready!r} + ".tmp", "w") as f:
            json.dump({{"home": os.environ["HOME"], "head": head.pid,
                       "sockets": os.listdir(private)}}, f)
        os.rename({ready!r} + ".tmp", {ready!r})
        signal.pause()
""")


def test_a_test_run_killed_removes_its_home_its_sockets_and_its_daemons(tmp_path):
    ready = tmp_path / "ready"
    (tmp_path / "test_killed.py").write_text(KILLED_RUN.format(here=HERE, ready=str(ready)))
    # (its own home and TMPDIR, not this run's: those set above)
    env = dict(os.environ, HOME=str(tmp_path), TMPDIR=tempfile.gettempdir())
    killed = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_killed.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    left = {}
    try:
        wait_for(lambda: ready.exists() or killed.poll() is not None, 60, "the run")
        assert ready.exists(), killed.communicate()[0]
        left = _json.loads(ready.read_text())
        killed.send_signal(signal.SIGTERM)
        out = killed.communicate(timeout=60)[0]
    finally:
        kill_all([killed])
        if left and pid_running(left["head"]):  # (a run that did not clean up after itself)
            os.kill(left["head"], signal.SIGKILL)
        if left and os.path.exists(left["home"]):
            shutil.rmtree(left["home"])
    assert len(left["sockets"]) == 3 and "KeyboardInterrupt" in out, out
    assert not os.path.exists(left["home"]) and not pid_running(left["head"])


###############################################################################
# Bridge ######################################################################
###############################################################################


def _packet(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack(">I", len(data)) + data


async def _read_packet(stream):
    head = b""
    while len(head) < 4:
        head += await stream.receive_some(4 - len(head))
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        body += await stream.receive_some(n - len(body))
    return body.decode()


def _local_address(stream):
    host, port = stream.socket.getsockname()[:2]
    return f"{host}:{port}"


async def _upstream_rendezvous(port, session="sess1"):
    """Upstream's head and worker, byte for byte: INIT, SUBD, the head's HEAD answer. Each
    side's address as the bridge saw it must come through."""
    head = await trio.open_tcp_stream("127.0.0.1", port)
    await head.send_all(_packet(f"INIT,{session},"))
    await trio.testing.wait_all_tasks_blocked()
    worker = await trio.open_tcp_stream("127.0.0.1", port)
    await worker.send_all(_packet(f"SUBD,{session},10.9.8.7:4567"))
    with trio.fail_after(5):
        assert await _read_packet(head) == f"{_local_address(worker)}|10.9.8.7:4567"
        answer = await trio.open_tcp_stream("127.0.0.1", port)
        await answer.send_all(_packet(f"HEAD,{_local_address(worker)},10.1.2.3:7654"))
        assert await _read_packet(worker) == f"{_local_address(answer)}|10.1.2.3:7654"
    for s in (head, worker, answer):
        await s.aclose()


@trio_test
async def test_a_head_whose_bridge_closes_each_connection_at_once_redials_after_a_pause():
    # A bridge (or a tunnel to one) that accepts and closes right away: the head is "on
    # the bridge", then loses it, each time; it must not redial in a tight loop.
    dials = []

    async def close_at_once(stream):
        dials.append(trio.current_time())
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(functools.partial(trio.serve_tcp, close_at_once, 0,
                                                            host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        with trio.move_on_after(3):
            await grain._serve_bridge(f"bridge://label@127.0.0.1:{port}", b"k" * 32,
                                      None, grain.TASK_STATUS_IGNORED)
        nursery.cancel_scope.cancel()
    assert 2 <= len(dials) <= 5, dials   # about one a second


@trio_test
async def test_the_bridge_pairs_upstreams_rendezvous_messages():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(grain.BridgeServer().serve, "tcp://127.0.0.1:0")
        await _upstream_rendezvous(port)
        await _upstream_rendezvous(port, "sess2")   # (and again: nothing left behind)
        nursery.cancel_scope.cancel()


@trio_test
async def test_the_bridge_says_what_was_wrong_with_bad_input_and_serves_on(monkeypatch,
                                                                           caplog):
    monkeypatch.setattr(grain, "BRIDGE_WAIT_S", 0.5)
    bad = {"malformed": (_packet("hello"), "not a message it knows"),
           "unknown": (_packet("PING,a,b"), "not a message it knows"),
           "oversized": (struct.pack(">I", 5000) + b"x" * 100, "5000 bytes (at most 1000)"),
           "truncated": (struct.pack(">I", 50) + b"INIT,", "closed the connection inside"),
           "not ascii": (_packet(b"INIT,\xff\xfe,"), "not ASCII"),
           "silent": (b"", "said nothing for 0.5 s"),
           "an answer nobody waits for": (_packet("HEAD,1.2.3.4:5,6.7.8.9:10"),
                                          "who waits for no answer")}
    with caplog.at_level(logging.INFO, logger="grain"):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(grain.BridgeServer().serve, "tcp://127.0.0.1:0")
            idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(200)]
            for name, (data, said) in bad.items():
                caplog.clear()
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(data)
                if name in ("truncated", "an answer nobody waits for"):
                    await stream.aclose()
                with trio.fail_after(5):
                    while not any(said in r.getMessage() for r in caplog.records):
                        await trio.sleep(0.01)
                assert "127.0.0.1:" in caplog.records[-1].getMessage(), name
                await _upstream_rendezvous(port)      # it serves on
            for s in idle:
                await s.aclose()
            nursery.cancel_scope.cancel()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bridge(tmp_path, port):
    """A bridge process on loopback, once it listens."""
    log_path = tmp_path / f"bridge-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([sys.executable, GRAIN, "bridge", "--listen",
                             f"tcp://127.0.0.1:{port}"], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)
    proc.log_path = log_path
    deadline = time.monotonic() + 15
    while "listening at" not in log_path.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
        time.sleep(0.02)
    return proc


class Bridges:
    """The bridge processes of a test, on one loopback port, all killed at its end."""

    def __init__(self, tmp_path, label="site"):
        self.tmp_path, self.port, self.procs = tmp_path, free_port(), []
        self.url = f"bridge://{label}@127.0.0.1:{self.port}"

    def start(self):
        self.procs.append(_bridge(self.tmp_path, self.port))
        return self.procs[-1]


@pytest.fixture
def bridges(tmp_path):
    b = Bridges(tmp_path)
    yield b
    kill_all(b.procs)


@pytest.mark.parametrize("order", ["bridge head workers", "workers head bridge",
                                   "head workers bridge"])
@trio_test
async def test_a_mission_meets_its_workers_through_a_bridge_in_any_order(workers, bridges,
                                                                         order):
    def start(what):
        if what == "bridge":
            bridges.start()
        for name in ("w1", "w2") if what == "workers" else ():
            workers.start("--url", bridges.url, "--res", '{"Cores": {"N": 1}}', name=name)

    before, _, after = order.partition("head")
    for what in before.split():
        start(what)
    async with grain.GrainExecutor(listen=bridges.url) as exer:
        for what in after.split():
            start(what)
        with trio.fail_after(60):
            await exer.wait_for_workers(2)
        assert all("direct through bridge 127.0.0.1:" in w.where for w in exer.workers)
        pids = {(await j)[1] for j in [exer.submit(Cores(1), where_am_i, i, 0.2)
                                       for i in range(6)]}
        assert pids == {p.pid for p in workers.procs}


async def _two_workers_join(exer, workers, url, cores=1, *flags):
    for name in ("w1", "w2"):
        workers.start("--url", url, "--res", json.dumps({"Cores": {"N": cores}}), *flags,
                      name=name)
    with trio.fail_after(30):
        await exer.wait_for_workers(2)


@pytest.mark.parametrize("tls", [False, True])
@trio_test
async def test_with_no_direct_path_the_bridge_relays_and_ls_says_so(workers, bridges,
                                                                    tmp_path, tls):
    url = bridges.url + "?direct=no"   # (as if no address of the other side answered)
    bridge = bridges.start()
    cert, private = _tls_pair(tmp_path) if tls else ("", "")
    toml = tmp_path / "grain.toml"     # (for ls)
    toml.write_text(f'tls_cert = "{cert}"\ntls_key = "{private}"\n')
    key = grain.load_auth_key(None, cert, private)
    async with grain.GrainExecutor(listen=url, key=key) as exer:
        await _two_workers_join(exer, workers, url, 1, *(
            ("--tls-cert", cert, "--tls-key", private) if tls else ()))
        pids = {(await j)[1] for j in [exer.submit(Cores(1), where_am_i, i, 0.2)
                                       for i in range(6)]}
        assert pids == {p.pid for p in workers.procs}
        cp = await trio.to_thread.run_sync(lambda: grain_cli("ls", "--json", "-a", url,
                                                             "-c", str(toml)))
        shown = json.loads(cp.stdout)["workers"]
        assert [w["via"] for w in shown] == \
            [f"relayed through bridge 127.0.0.1:{bridges.port}"] * 2
    assert bridge.log_path.read_text().count("bridge: relaying between") == 3  # (+ ls)
    assert exer.key.hex() not in bridge.log_path.read_text()


@trio_test
async def test_a_worker_with_another_key_never_pairs_through_the_bridge(workers, bridges,
                                                                      tmp_path):
    bridges.start()
    other_key = tmp_path / "other-key"
    async with grain.GrainExecutor(listen=bridges.url) as exer:
        stranger = workers.start("--url", bridges.url, "--key", str(other_key),
                                 name="stranger")
        good = workers.start("--url", bridges.url, "--res", '{"Cores": {"N": 1}}',
                             name="good")
        with trio.fail_after(30):
            await exer.wait_for_workers(1)
        assert (await exer.submit(Cores(1), where_am_i, 1))[1] == good.pid
        cp = await trio.to_thread.run_sync(lambda: grain_cli(
            "ls", "-a", bridges.url, "--key", str(other_key)))
        assert cp.returncode == 1 and f"no head is listening at {bridges.url}" in cp.stderr
        assert [w.name for w in exer.workers] == ["good"]
        assert stranger.poll() is None and "registered" not in stranger.log_path.read_text()


@trio_test
async def test_a_relayed_mission_completes_through_its_bridge_restarted(workers, bridges,
                                                                       tmp_path):
    # The bridge is killed while every job runs, and started again 1 s later: the head
    # holds the jobs of the relayed workers it lost; they come back to it through the new
    # bridge with them, and the mission completes with each job run once.
    url = bridges.url + "?direct=no"
    runs = tmp_path / "runs"
    bridge = bridges.start()
    async with grain.GrainExecutor(listen=url) as exer:
        await _two_workers_join(exer, workers, url, cores=2)
        jobs = [exer.submit(Cores(1), pid_then_sleep, str(runs), 3) for _ in range(4)]
        with trio.fail_after(10):
            while not runs.exists() or len(runs.read_text().split()) < 4:
                await trio.sleep(0.05)
        bridge.kill()
        bridge.wait()
        await trio.sleep(1)
        bridges.start()
        with trio.fail_after(60):
            done = [await j for j in jobs]
        assert sorted(done) == sorted(int(pid) for pid in runs.read_text().split())
        assert len(done) == 4 and exer.retried_by_class == {}    # each ran once
        assert len(exer.workers) == 2     # both came back through the new bridge


def test_the_two_sites_example_runs_through_a_bridge(workers, tmp_path):
    # examples/two_sites.py as its README section runs it, both "sites" on loopback: the
    # config names the bridge; the mission's head daemon and the workers meet there.
    bridges = Bridges(tmp_path, "campaign1")
    config = tmp_path / "site_a.toml"
    config.write_text(f'address = "{bridges.url}"\n[head.gnaw]\n'
                      f'log_file = "{tmp_path}/head.log"\n')
    try:
        bridges.start()
        for name in ("a1", "b1"):
            workers.start("--url", bridges.url, "--res", '{"Cores": {"N": 2}}', name=name)
        cp = run_py(os.path.join("examples", "two_sites.py"),
                    env=dict(os.environ, GRAIN_CONFIG=str(config)), timeout=120)
        assert cp.returncode == 0, cp.stderr[-2000:]
        assert cp.stdout.strip() == f"{socket.gethostname()}: 32 job(s)"
    finally:
        grain_cli("stop", "-c", str(config))
        kill_all(bridges.procs)

TWO_SITES_MISSION = """
import json, os, sys, trio
sys.path.insert(0, {root!r})
import grain
from grain.resource import Cores

async def where(i):
    import os, trio
    await trio.sleep(0.3)
    return i, os.getpid()

async def main():
    async with grain.GrainExecutor(listen={url!r}) as exer:
        with trio.fail_after(60):
            await exer.wait_for_workers(2)
        results = [await j for j in [exer.submit(Cores(1), where, i) for i in range(6)]]
        print(json.dumps({{"results": results, "via": [w.via for w in exer.workers]}}))

trio.run(main)
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("ip"),
                    reason="making network namespaces needs root and iproute2")
def test_two_sites_that_cannot_reach_each_other_run_one_mission_through_the_bridge(tmp_path):
    # Three namespaces made here: site A (the head), site B (two workers) and the bridge's,
    # which each site reaches over a veth pair of its own. Nothing routes between A and B.
    tag = f"g{os.getpid() % 10 ** 6}"
    a, b, br = f"{tag}a", f"{tag}b", f"{tag}r"
    setup = [f"netns add {ns}" for ns in (a, b, br)]
    for site, net in ((a, "10.251.1"), (b, "10.251.2")):
        setup += [f"link add {site}0 type veth peer name {site}1",
                  f"link set {site}0 netns {site}", f"link set {site}1 netns {br}",
                  f"-n {site} addr add {net}.2/24 dev {site}0", f"-n {site} link set {site}0 up",
                  f"-n {site} link set lo up",
                  f"-n {br} addr add {net}.1/24 dev {site}1", f"-n {br} link set {site}1 up"]
    env = dict(os.environ, HOME=str(tmp_path))   # (one key, on the "shared filesystem")
    procs = []
    try:
        for command in setup:
            cp = subprocess.run(["ip", *command.split()], capture_output=True, text=True)
            if cp.returncode != 0:
                pytest.skip(f"cannot make the namespaces here: ip {command}: {cp.stderr}")
        subprocess.run(["ip", "-n", br, "link", "set", "lo", "up"], check=True)
        unreachable = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c",
                                      "import socket; socket.create_connection(('10.251.2.2',"
                                      " 9), timeout=2)"], capture_output=True, text=True)
        assert "Network is unreachable" in unreachable.stderr   # (A cannot reach B at all)
        bridge_log = open(tmp_path / "bridge.log", "w")
        procs.append(subprocess.Popen(["ip", "netns", "exec", br, sys.executable, GRAIN,
                                       "bridge"], stdout=bridge_log, stderr=subprocess.STDOUT,
                                      env=env))
        for i in range(2):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", b, sys.executable, GRAIN, "worker", "--name",
                 f"b{i}", "--url", "bridge://site@10.251.2.1:9555", "--res",
                 '{"Cores": {"N": 1}}'], stdout=open(tmp_path / f"b{i}.log", "w"),
                stderr=subprocess.STDOUT, env=env))
        script = tmp_path / "mission.py"
        script.write_text(TWO_SITES_MISSION.format(root=HERE,
                                                   url="bridge://site@10.251.1.1:9555"))
        mission = subprocess.run(["ip", "netns", "exec", a, sys.executable, str(script)],
                                 capture_output=True, text=True, env=env, timeout=120)
        assert mission.returncode == 0, mission.stderr[-3000:]
        out = json.loads(mission.stdout.strip().splitlines()[-1])
        assert [r[0] for r in out["results"]] == list(range(6))
        assert {r[1] for r in out["results"]} == {p.pid for p in procs[1:]}
        assert out["via"] == ["relayed through bridge 10.251.1.1:9555"] * 2
    finally:
        kill_all(procs)
        for ns in (a, b, br):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)



###############################################################################
# Subprocesses ################################################################
###############################################################################


@subprocify
def sp_sleep(seconds, pidfile=None, program_pidfile=None):
    import os
    import subprocess
    import time
    if program_pidfile:  # a program the job starts, as jobs do
        program = subprocess.Popen(["sleep", str(seconds)])
        with open(program_pidfile, "w") as f:
            f.write(str(program.pid))
    if pidfile:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(seconds)
    return os.getpid()


@subprocify
def sp_die(how):
    import ctypes
    import os
    if how == "exit":
        os._exit(3)
    ctypes.string_at(0)  # segfault


@subprocify
def sp_raise():
    raise ValueError("from the child")


@subprocify
def sp_surroundings(chdir_to=None):
    import os
    import subprocess
    seen = (os.getcwd(), sorted(os.sched_getaffinity(0)),
            subprocess.run(["cat"], capture_output=True, timeout=10).stdout)  # its stdin
    if chdir_to:
        os.chdir(chdir_to)
    return seen


@subprocify
def sp_raise_needs_two():
    raise NeedsTwo(1, 2)


async def _group_gone(pgid):
    """Wait (5 s at most) until group ``pgid`` has no live process: a signalled process
    takes a moment to end, longer on a busy machine."""
    with trio.fail_after(5):
        while _process_group(pgid):
            await trio.sleep(0.02)


async def _program_report():
    import subprocess
    from grain import run_program
    r = await run_program(["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES|$OMP_NUM_THREADS|'
                                       '$MKL_NUM_THREADS"; grep Cpus_allowed_list '
                                       '/proc/self/status'], stdout=subprocess.PIPE)
    env, allowed = r.stdout.decode().splitlines()
    return env, allowed.split()[1]


def sp_environment():
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")


@trio_test
async def test_subprocify_pins_cores_and_sees_gvar():
    async def main():
        async with subprocess_pool_scope() as pool:
            async with subprocess_pool_scope() as again:   # a no-op the second time
                assert again is pool
            sq, pid, affinity, cores, inst = await (delayed(sp_info) @ Cores(1))(7)
            assert sq == 49 and pid != os.getpid() and inst == "local"
            assert affinity == cores and len(cores) == 1
            _, pid2, *_ = await (delayed(sp_info) @ Cores(1))(8)
            assert pid2 == pid   # reused
            with pytest.raises(ValueError, match="from the child") as info:
                await (delayed(sp_raise) @ Cores(1))()
            assert "Traceback in pool process" in "\n".join(info.value.__notes__)
            return True

    allowed = sorted(os.sched_getaffinity(0))
    assert await _in_mission(main, local=Cores(allowed[:1]))


@trio_test
async def test_subprocify_refuses_a_job_without_cores():
    async def main():
        async with subprocess_pool_scope():
            with pytest.raises(RuntimeError, match="needs at least one core.*holds Ø"):
                await delayed(sp_info)(1)
            return True

    assert await _in_mission(main)


@trio_test
async def test_subprocify_needs_the_pool_scope():
    async def main():
        with pytest.raises(RuntimeError, match="subprocess_pool_scope"):
            await (delayed(sp_info) @ Cores(1))(1)
        return True

    assert await _in_mission(main)


@trio_test
async def test_subprocify_enforces_T_in_the_child_and_reuses_it():
    async def main():
        async with subprocess_pool_scope(limit=1):
            pid = await (delayed(sp_sleep) @ Cores(1))(0)
            with pytest.raises(trio.TooSlowError):
                await (delayed(sp_sleep) @ (Cores(1) & WTime(T=1)))(30)
            assert await (delayed(sp_sleep) @ Cores(1))(0) == pid   # the child survived
            return True

    assert await _in_mission(main)


@pytest.mark.parametrize("how", ["exit", "segv"])
@trio_test
async def test_a_dying_child_is_broken_retried_and_replaced(how):
    async def main():
        async with subprocess_pool_scope(limit=1) as pool:
            pid = await (delayed(sp_sleep) @ Cores(1))(0)
            with pytest.raises(BrokenSubprocessError) as info:
                await (delayed(sp_die) @ Cores(1))(how)
            notes = "\n".join(info.value.__notes__)
            assert "failed after 3 attempts (infrastructure failure" in notes
            assert ("exited with code 3" if how == "exit" else "killed by signal 11") in \
                str(info.value)
            pid2 = await (delayed(sp_sleep) @ Cores(1))(0)
            assert pid2 != pid and pool.statistics().pids == [pid2]
            return True

    assert await _in_mission(main, max_retries=2)


@trio_test
async def test_pool_jobs_start_clean_and_outlive_the_thread_that_spawned_their_process(
        monkeypatch, tmp_path):
    # trio starts processes from worker threads that end when idle (after 10 s; here after
    # 1 s, once the pool process is up): a pool process must not die with that thread
    monkeypatch.setattr(trio._core._thread_cache, "IDLE_TIMEOUT", 1.0)
    allowed = sorted(os.sched_getaffinity(0))

    async def hold(seconds):
        await trio.sleep(seconds)

    async def main():
        async with subprocess_pool_scope(limit=1):
            assert await (delayed(sp_sleep) @ Cores(1))(2.5) > 0   # it outlived that thread
            cwd, cores, stdin = await (delayed(sp_surroundings) @ Cores(1))(str(tmp_path))
            assert cwd == os.getcwd() and len(cores) == 1 and cores[0] in allowed
            assert stdin == b""   # its programs read /dev/null, not the pool's job pipe
            # the same process, after that job moved and was pinned, given a virtual core
            # (every real one is held): as it started, not as the last job left it
            hog = (delayed(hold) @ Cores(len(allowed)))(1)
            cwd, cores, _ = await (delayed(sp_surroundings) @ Cores(1))()
            assert cwd == os.getcwd() and cores == allowed
            await hog
            with pytest.raises(grain.GrainError, match=r"NeedsTwo: 1/2 \(the exception could "
                                                       r"not be pickled\)"):
                await (delayed(sp_raise_needs_two) @ Cores(1))()
            return True

    assert await _in_mission(main, local=Cores(len(allowed) + 1))


@trio_test
async def test_a_pool_call_cancelled_while_its_process_starts_leaves_none():
    grain.GVAR.res = Cores([0])   # (as a job's code sees it)
    async with subprocess_pool_scope(limit=2) as pool:
        for _ in range(10):
            with trio.move_on_after(0.002):
                await sp_sleep(0)
        assert pool.statistics().idle == len(pool.statistics().pids)  # none is nobody's
        assert await sp_sleep(0) in pool.statistics().pids            # and it still works


@trio_test
async def test_pool_is_bounded_and_idle_processes_shut_down(mock_clock):
    async def main():
        async with subprocess_pool_scope(limit=1) as pool:
            pids = await each([(delayed(sp_sleep) @ Cores(1))(0.05) for _ in range(3)])
            assert len(set(pids)) == 1   # one process served all three, one at a time
            assert pool.statistics().pids == pids[:1]
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().idle == 1 and pid_alive(pids[0])  # not idle long enough
            mock_clock.jump(grain.SUBPROC_IDLE_S + 10)
            mock_clock.autojump_threshold = 0  # from now on: the shutdown takes real time
            while pool.statistics().pids:
                await trio.sleep(0.01)
            assert not pid_alive(pids[0])
            return True

    assert await _in_mission(main, local=Cores(3))


@trio_test
async def test_cancellation_leaves_no_orphan(tmp_path):
    pidfile, program = tmp_path / "pid", tmp_path / "program"
    with trio.CancelScope() as scope:
        async with grain.GrainExecutor(rpw=Cores(1)):
            async with subprocess_pool_scope():
                job = (delayed(sp_sleep) @ Cores(1))(60, str(pidfile), str(program))
                while not pidfile.exists() or not pidfile.read_text():
                    await trio.sleep(0.02)
                scope.cancel()
                await job
    assert scope.cancelled_caught
    assert not pid_alive(int(pidfile.read_text()))
    # The program the job started goes with the pool process: its whole process group was
    # signalled. (Its end takes a moment; then it is a zombie until init reaps it.)
    wait_for(lambda: not pid_running(int(program.read_text())), 10, "the job's program")


def test_ctrl_c_leaves_no_orphan(tmp_path):
    pidfile = tmp_path / "pid"
    script = tmp_path / "mission.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from grain.delayed import delayed, run
        from grain.resource import Cores
        from grain.subproc import subprocify, subprocess_pool_scope
        import test_grain
        async def main():
            async with subprocess_pool_scope():
                await (delayed(test_grain.sp_sleep) @ Cores(1))(60, {str(pidfile)!r})
        run(main, local=Cores(1), config_file=False)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=HERE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=20)[1]
    assert proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt")
    assert err.count('File "') <= 3, err   # from the mission's run() call, not trio's depths
    assert not pid_alive(child)


INTERRUPTED_MISSION = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores
    from grain.subproc import subprocify, subprocess_pool_scope

    @delayed
    @subprocify
    def spin(i, go):
        os.write(1, f"start {{i}}\\n".encode())   # (one write: lines of two jobs never mix)
        while i >= 2 and not os.path.exists(go):  # the first two end; the rest hold on
            time.sleep(0.01)
        os.write(1, f"end {{i}}\\n".encode())
        return i

    async def main():
        async with subprocess_pool_scope():
            jobs = [(spin @ Cores(1))(i, {go!r}) for i in range(10)]
            print("submitted", flush=True)
            return await each(jobs)

    print(run(main, local=Cores(2), config_file=False, results={store!r},
              rerun_failed=len(sys.argv) == 1))
""")


@pytest.mark.parametrize("moment", ["submitted", "end 0", "start 3"])
def test_ctrl_c_stores_no_interrupted_job_as_failed(tmp_path, moment):
    # Ctrl-C of a mission whose @subprocify jobs run, or wait: before any has run, as a
    # result is on its way to the store, with two done and two running
    store, go, script = tmp_path / "r.db", tmp_path / "go", tmp_path / "mission.py"
    script.write_text(INTERRUPTED_MISSION.format(here=HERE, go=str(go), store=str(store)))
    # (stdout is read through its buffer to the end, not by communicate(), which reads the
    # pipe itself: a line readline() had buffered, "end 1" behind "end 0", would be lost)
    with open(tmp_path / "err", "w+") as stderr:
        p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            seen = []
            while moment not in seen:
                seen.append(p.stdout.readline().strip())
                assert seen[-1], (tmp_path / "err").read_text()
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
            out = p.stdout.read()
        finally:
            p.kill()
            p.communicate()
    err = (tmp_path / "err").read_text()
    assert p.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert "retrying" not in err and "subprocess_pool_scope" not in err, err
    ended = {int(line.split()[1]) for line in seen + out.splitlines() if line.startswith("end")}
    with contextlib.closing(sqlite3.connect(store)) as db:
        states = [s for (s,) in db.execute("SELECT state FROM results_log")]
    assert set(states) <= {"done"} and len(states) <= len(ended)   # none failed
    if moment == "start 3":    # the two that ended before were stored
        assert len(states) == 2
    # Run again with rerun_failed=False, which would raise a stored failure at once: it
    # completes, running the jobs not stored, and only those
    go.touch()
    again = run_py(str(script), "--rerun-failed=False", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    *starts, result = again.stdout.splitlines()
    assert result == str(list(range(10)))
    assert len([s for s in starts if s.startswith("start")]) == 10 - len(states)


def test_a_killed_mission_takes_its_pool_processes_and_their_programs_along(tmp_path):
    pidfile, program = tmp_path / "pid", tmp_path / "program"
    script = tmp_path / "mission.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from grain.delayed import delayed, run
        from grain.resource import Cores
        from grain.subproc import subprocess_pool_scope
        import test_grain
        async def main():
            async with subprocess_pool_scope():
                await (delayed(test_grain.sp_sleep) @ Cores(1))(60, {str(pidfile)!r},
                                                                {str(program)!r})
        run(main, local=Cores(1), config_file=False)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=HERE, stderr=subprocess.DEVNULL)
    wait_for(lambda: pidfile.exists() and pidfile.read_text() or proc.poll() is not None, 20,
             "the pool process")
    proc.kill()   # no goodbye: the pool process sees its parent gone
    proc.wait()
    wait_for(lambda: not pid_running(int(pidfile.read_text())), 10, "the pool process")
    wait_for(lambda: not pid_running(int(program.read_text())), 10, "the job's program")


def test_a_local_jobs_program_writes_its_stderr_to_the_job_log(tmp_path):
    # With head.log_file, the mission's own worker's jobs print there, and so do the programs
    # they run: their stderr is forwarded from run_program's thread, in the job's context.
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'[head]\nlog_file = "{tmp_path}/jobs.log"\n')
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import grain
        from grain.delayed import delayed, run
        from grain.resource import Cores

        @delayed
        async def job():
            await grain.run_program(["sh", "-c", "echo from-the-program >&2"])

        async def main():
            await (job @ Cores(1))()

        run(main, local=Cores(1), config_file={str(cfg)!r})
    """)
    cp = run_py("-c", code)
    assert cp.returncode == 0, cp.stderr
    assert "from-the-program" in (tmp_path / "jobs.log").read_text()
    assert "from-the-program" not in cp.stderr + cp.stdout


@trio_test
async def test_a_programs_environment_is_the_missions_as_it_is_when_the_program_starts(
        monkeypatch):
    # The environment read once is kept until os.environ changes: a variable set, changed
    # or removed between two programs is what the next one gets.
    async def probe():
        done = await grain.run_program('echo "${GRAIN_PROBE-unset}|$OMP_NUM_THREADS"',
                                       stdout=subprocess.PIPE)
        return done.stdout.decode().strip()

    async with grain.GrainExecutor(rpw=Cores(2)) as exer:
        monkeypatch.delenv("GRAIN_PROBE", raising=False)
        seen = [await exer.submit(Cores(1), probe)]
        for value in ("a", "b"):
            monkeypatch.setenv("GRAIN_PROBE", value)
            seen.append(await exer.submit(Cores(2), probe))
        monkeypatch.delenv("GRAIN_PROBE")
        seen.append(await exer.submit(Cores(1), probe))
    assert seen == ["unset|1", "a|2", "b|2", "unset|1"]
    assert grain.job_env({"A": "1"}, Cores(1)) == {"A": "1", **dict.fromkeys(
        grain.THREAD_VARIABLES, "1")}   # (an environment given: that one)


@trio_test
async def test_run_program_pins_sets_the_environment_and_reports_failures(tmp_path, capsys):
    cores = sorted(os.sched_getaffinity(0))
    async with grain.GrainExecutor(rpw=Cores(cores) & Gpus(4)) as exer:
        env, allowed = await exer.submit(Cores(1) & Gpus(2), _program_report)
        assert env == "0,1|1|1" and grain.parse_ids(allowed) == [cores[0]]
        env, allowed = await exer.submit(Cores(len(cores)), _program_report)
        assert env.startswith(f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}|{len(cores)}|")

        async def failing():
            await grain.run_program("echo starting; echo 'no basis set' >&2; exit 3")

        with pytest.raises(grain.ProgramError) as info:
            await exer.submit(Cores(1), failing)
        assert info.value.returncode == 3 and info.value.stderr_tail == "no basis set"
        assert str(info.value).endswith("exited with status 3; the end of its stderr:\n"
                                        "no basis set")

        async def chatty():  # more stderr than is kept, a character split between writes
            await grain.run_program("{ printf '\\303'; sleep 0.2; printf '\\251\\n'; "
                                    "head -c 10000 /dev/zero | tr '\\0' x; } >&2; exit 1")

        with pytest.raises(grain.ProgramError) as info:
            await exer.submit(Cores(1), chatty)
        assert info.value.stderr_tail == "x" * grain.STDERR_TAIL
        assert "é\n" in capsys.readouterr().err   # forwarded whole

        pgid_file = tmp_path / "pgid"

        async def stuck():   # a program that starts children of its own, and hangs
            await grain.run_program(f"echo $$ > {pgid_file}; sleep 60 & sleep 60 & wait")

        with pytest.raises(trio.TooSlowError):
            await exer.submit(Cores(1) & WTime(T=2), stuck)   # its T is enforced
        pgid = int(pgid_file.read_text())
        await _group_gone(pgid)                               # the whole group went

    pgid_file.unlink()
    with trio.CancelScope() as scope:   # the mission is cancelled while the program runs
        async with grain.GrainExecutor(rpw=Cores(1)) as exer:
            exer.submit(Cores(1), stuck)
            with trio.fail_after(10):
                while not pgid_file.exists() or not pgid_file.read_text():
                    await trio.sleep(0.05)
            pgid = int(pgid_file.read_text())
            assert len(_process_group(pgid)) == 3
            scope.cancel()
    assert scope.cancelled_caught
    await _group_gone(pgid)


async def _program_cores(cwd=None):
    """The cores the job was given, and those its program may run on (as the kernel says)."""
    import subprocess
    from grain import GVAR, parse_ids, run_program
    r = await run_program(["grep", "Cpus_allowed_list", "/proc/self/status"],
                          stdout=subprocess.PIPE, cwd=cwd)
    return list(GVAR.res.c), parse_ids(r.stdout.split()[1].decode())


async def _start_missing(path, cwd=None):
    from grain import run_program
    await run_program([str(path), "--in", "h2o.xyz"], cwd=cwd)


def _marked_processes(mark):
    """Pids of the live processes whose environment holds GRAIN_TEST_MARK=``mark``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"GRAIN_TEST_MARK={mark}".encode() in f.read().split(b"\0") \
                        and pid_running(int(entry)):
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("after", [0, 0.0002, 0.001, 0.003, 0.01, 0.05, 0.5])
@trio_test
async def test_a_program_cancelled_at_any_moment_leaves_nothing_running(after):
    # A job is cancelled before the thread that starts its program began, as the program
    # starts, while it starts children of its own, and while they run: when run_program
    # has returned, the thread is done and no process of the program's is left.
    mark = f"{os.getpid()}-{after}"
    with trio.move_on_after(after) as scope:
        await grain.run_program("sleep 60 & sleep 60 & wait",
                                env=dict(os.environ, GRAIN_TEST_MARK=mark))
    assert scope.cancelled_caught
    with trio.fail_after(5):   # (a signalled process takes a moment to end)
        while _marked_processes(mark):
            await trio.sleep(0.02)


def test_a_program_whose_job_was_cancelled_as_it_started_is_killed_by_its_thread(
        monkeypatch):
    # The job's task gives up while the thread is starting the program, before the pid is
    # known to it: the thread must stop the program itself, at once (then the task's wait
    # ends). A job that gave up before the thread began starts nothing.
    options = dict(shell=True, cwd=None, stdin=None, stdout=None, stderr=subprocess.PIPE,
                   env=dict(os.environ))
    program, start = grain._Program(), grain._start_pinned

    def start_then_give_up(*args):
        started = start(*args)
        program.cancelled = True
        return started

    monkeypatch.setattr(grain, "_start_pinned", start_then_give_up)
    code, _, _ = program.run("sleep 60", [], options, None)
    assert code == -signal.SIGKILL and program.ended
    late = grain._Program()
    late.cancelled = True
    assert late.run("sleep 60", [], options, None) is None and late.pid is None


@trio_test
async def test_a_program_with_stdin_pipe_a_path_or_a_closed_stderr_runs_as_popen_would(
        tmp_path, monkeypatch):
    with trio.fail_after(10):   # stdin=PIPE: an empty input (`cat` ends), as Popen's gives
        done = await grain.run_program(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert done.stdout == b""
    script = tmp_path / "hello"   # a path as the program
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    assert (await grain.run_program(script, stdout=subprocess.PIPE)).stdout == b"hi\n"

    class Closed:   # the mission's stderr, gone (`python mission.py 2>&1 | head`)
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Closed())
    with pytest.raises(grain.ProgramError) as info:   # still read, kept, and named
        await grain.run_program("echo 'SCF failed' >&2; exit 1")
    assert info.value.stderr_tail == "SCF failed"


@trio_test
async def test_programs_are_not_limited_to_trios_threads_and_keep_their_signals(tmp_path):
    # Each program has a thread for its whole run: more than trio's default 40 of them
    # run at once. Each gets the signals Python ignores back, as a shell's would: `yes`
    # in a pipeline ends quietly when its reader has gone.
    n, go = 45, tmp_path / "go"
    started = tmp_path / "started"
    started.mkdir()

    async def one(i):
        done = await grain.run_program(
            f"touch {started}/{i}; while [ ! -e {go} ]; do sleep 0.01; done; yes | head -1",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert (done.stdout, done.stderr) == (b"y\n", b"")

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
        with trio.fail_after(30):
            while len(os.listdir(started)) < n:
                await trio.sleep(0.02)
        go.touch()


@pytest.mark.parametrize("where", ["the mission's own worker", "a worker process"])
@trio_test
async def test_each_program_runs_on_exactly_its_jobs_cores(workers, tmp_path, where):
    # Programs start from a thread pinned to the job's cores (no preexec_fn, which would
    # make CPython fork the whole process): the child must still get exactly those cores,
    # for a job of one core, of two, and of all of them, wherever the job runs.
    cores = sorted(os.sched_getaffinity(0))
    local = where == "the mission's own worker"
    async with grain.GrainExecutor(rpw=Cores(cores) if local else None,
                                   listen=None if local else "tcp://127.0.0.1:0") as exer:
        if not local:
            workers.start("--url", exer.urls["tcp"], "--res",
                          json.dumps({"Cores": {"N": len(cores)}}))
            await exer.wait_for_workers(1)
        for n in sorted({1, min(2, len(cores)), len(cores)}):
            given, pinned = await exer.submit(Cores(n), _program_cores)
            assert len(given) == n and pinned == given
        # (the thread that starts a program gets its own cores back: it is trio's, and
        # starts the next job's program, or an unpinned one, next)
        for cwd in (None, str(tmp_path)):   # (posix_spawn, and Popen for a cwd)
            options = dict(shell=False, cwd=cwd, stdin=None, stdout=None,
                           stderr=subprocess.PIPE, env=dict(os.environ))
            after = await trio.to_thread.run_sync(
                lambda: (grain._start_pinned(["true"], cores[:1], options).wait(),
                         sorted(os.sched_getaffinity(0))))
            assert after == (0, cores)
        # The same cores through Popen, which starts a program that has a cwd.
        given, pinned = await exer.submit(Cores(1), _program_cores, str(tmp_path))
        assert pinned == given
        # A program that cannot start costs its job, named, not the worker.
        script = tmp_path / "not-executable"
        script.write_text("#!/bin/sh\n")
        for path, error in [(tmp_path / "no-such-program", FileNotFoundError),
                            (script, PermissionError)]:
            for cwd in (None, str(tmp_path)):
                with pytest.raises(error, match=re.escape(str(path))):
                    await exer.submit(Cores(1), _start_missing, path, cwd)
        assert len((await exer.submit(Cores(1), _program_cores))[1]) == 1


@trio_test
async def test_a_subprocify_child_gets_the_jobs_environment():
    fn = subprocify(sp_environment)

    async def job():
        return await fn()

    async with subprocess_pool_scope():
        async with grain.GrainExecutor(rpw=Cores(2) & Gpus(2)) as exer:
            assert await exer.submit(Cores(2) & Gpus(0.5), job) == ("0", "2")
            assert await exer.submit(Cores(1) & Gpus(1), job) == ("0", "1")


###############################################################################
# Config ######################################################################
###############################################################################


# Upstream's reference config (example/grain.reference.toml): its keys and values.
UPSTREAM_REFERENCE = """
system = ""
contextmod = ""
address = "edge://$HOME/.local/share/edge-file-default"
[head]
name = "grain_head"
main_log_file = "/dev/null"
log_file = ""
listen = ""
cmd = '''
python ENTRYPOINT.py
'''
[head.gnaw]
enabled = true
log_file = ""
max_conn = 8
idle_quit = "30m"
swarm = 0
extra_args = []
[head.script]
walltime = "24:00:00"
[worker]
name = "w{{HHMMSS}}"
log_file = "./w{{HHMMSS}}.log"
dial = ""
cli_dial = ""
[worker.res]
Token = { token="has-gpu" }
Capacity = { V=8 }
[script]
shebang = "#!/bin/bash"
queue = "''"
walltime = ""
cores = 0
memory = 0
extra_args = []
setup_cleanup = '''
module load gaussian/16
defer rm -r $GAUSS_SCRDIR
'''
"""


# As upstream's stampede2 example: Slurm through a template of its own, without --mem.
UPSTREAM_CUSTOM_TEMPLATE = '''
system = "slurm"
[worker]
log_file = "./w{{HHMMSS}}-sp2.log"
[script]
queue = "skx-dev"
walltime = "00:30:00"
cores = 48
memory = 150
[custom_system]
submit_cmd = "sbatch"
directory = "#SBATCH"
template = """{c.script.shebang}
#SBATCH -J {c.name}
#SBATCH -p {c.script.queue}
#SBATCH --ntasks-per-node={c.script.cores}
#SBATCH --time={c.script.walltime}
#SBATCH -o {c.log_file}
{c.script.extra_args_str}

{{MAIN}}
"""
'''


def test_config_overrides_and_defaults(tmp_path):
    cfg = grain.parse_config(EXAMPLE_TOML, "x.toml")
    w, h = cfg.role("worker"), cfg.role("head")
    assert w.system == h.system == "slurm"
    assert w.address == w.dial == w.cli_dial == "edge:///shared/edge"
    assert h.address == h.listen == "tcp://login1:7777"     # [head] overrides the top level
    assert w.script.cores == 16 and h.script.cores == 1     # [head.script] overrides [script]
    assert h.script.queue == "debug" and w.script.python == sys.executable
    assert w.res == {"Token": {"token": "gpu"}} and h.idle_quit == 1800
    d = grain.Config().role("worker")
    # Upstream's defaults: ask the batch system for no cores, memory or walltime.
    assert d.system == "" and d.dial == grain.default_address() and d.script.cores == 0
    assert d.script.memory == 0 and d.script.walltime == 0
    assert grain.parse_config('[head]\nidle_quit = "90s"\nswarm = 3', "y").role(
        "head").idle_quit == 90
    # The reference config is valid as it stands, and means the defaults.
    with open(os.path.join(HERE, "grain.toml.example")) as f:
        ref = grain.parse_config(f.read(), "grain.toml.example")
    for role in ("head", "worker"):
        assert ref.role(role) == grain.Config().role(role)


@pytest.mark.parametrize("text,message", [
    ("sytem = 'slurm'", "x.toml: unknown key 'sytem'"),
    ("[worker.script]\ncorse = 2", "x.toml: unknown key 'worker.script.corse'"),
    ("[script]\ncores = 'four'", "x.toml: script.cores: expected a whole number >= 0, "
                                 "got 'four'"),
    ("[script]\nmemory = -3", "x.toml: script.memory: expected a number of GB >= 0"),
    ("[script]\nmemory = inf", "x.toml: script.memory: expected a number of GB >= 0"),
    ("[head.gnaw]\nenabled = 'no'", "x.toml: head.gnaw.enabled: expected true or false"),
    ("[head.gnaw]\nmax_con = 3", "x.toml: unknown key 'head.gnaw.max_con'"),
    ("[script]\nwalltime = '25:61:00'", "x.toml: script.walltime: expected a walltime"),
    ("system = 'loadleveler'", "x.toml: system: expected one of 'slurm', 'pbs', 'pbspro', "
                               "'sge', 'lsf', 'flux', 'custom'"),
    ("[head]\nidle_quit = 'soon'", "x.toml: head.idle_quit: expected a duration"),
    ("[worker]\nres = { GPU = { N = 1 } }", "x.toml: worker.res: expected resources"),
    ("system = slurm", "x.toml: malformed TOML: Invalid value (at line 1, column 10)"),
    ("script = 3", "x.toml: [script] must be a table"),
    # (said before `up` submits a worker that could only fail with it)
    ("address = 'foo://x'", "x.toml: address: expected tcp://host:port, unix:///path, "
                            "edge:///abs/path or bridge://LABEL@HOST:PORT, got 'foo://x'"),
    ("[worker]\ndial = 'tcp://head'", "x.toml: worker.dial: expected tcp://host:port"),
    ("[head]\nlisten = 'edge://rel/path'", "x.toml: head.listen: expected tcp://host:port"),
])
def test_config_errors_name_the_file_and_key(text, message):
    with pytest.raises(grain.ConfigError) as info:
        grain.parse_config(text, "x.toml")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_misspelt_config_key_gets_the_nearest_known_one():
    def error(text):
        with pytest.raises(grain.ConfigError) as info:
            grain.parse_config(text, "x.toml")
        return str(info.value)

    assert error("adress = 'tcp://:1'") == (
        "x.toml: unknown key 'adress'; did you mean 'address'? (known here: address, auth_key, "
        "contextmod, custom_system, head, report, results, script, system, tls_cert, tls_key, "
        "worker)")
    assert error("[head.gnaw]\nmax_con = 3").startswith(
        "x.toml: unknown key 'head.gnaw.max_con'; did you mean 'head.gnaw.max_conn'? (known")
    assert error("[script]\nzzz = 1").startswith("x.toml: unknown key 'script.zzz' (known")


def test_config_error_from_the_cli_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "grain.toml"
    bad.write_text("[worker]\nnmae = 'x'\n")
    for args in (["up", "--dry"], ["ls"], ["down"]):
        cp = grain_cli(*args, "-c", str(bad))
        assert cp.returncode == 2
        assert cp.stderr.strip() == f"grain.py {args[0]}: {bad}: unknown key 'worker.nmae'; " \
                                    "did you mean 'worker.name'? (known here: address, " \
                                    "auth_key, cli_dial, contextmod, dial, log_file, name, " \
                                    "reattach, report, res, results, script, " \
                                    "specialized_type, system, tls_cert, tls_key, wrap)"
    cp = grain_cli("up", "-c", str(tmp_path / "none.toml"))
    assert cp.returncode == 2 and "does not exist" in cp.stderr
    cp = grain_cli("up", "-c", str(tmp_path))
    assert cp.returncode == 2 and "is a directory" in cp.stderr
    cp = grain_cli("head", "-c", str(bad), "--no-config")
    assert cp.returncode == 2 and "give one of them" in cp.stderr
    cp = grain_cli("ls", "--key", str(tmp_path / "no" / "key"))
    assert cp.returncode == 1 and "no key file at" in cp.stderr
    assert not (tmp_path / "no").exists()   # a client makes no key
    cp = grain_cli("pack", "-o", str(tmp_path / "no" / "g.pyz"))
    assert cp.returncode == 2 and cp.stderr.endswith(f"no directory {tmp_path}/no\n")
    (tmp_path / "latin1.toml").write_bytes(b"name = '\xe9'\n")
    cp = grain_cli("ls", "-c", str(tmp_path / "latin1.toml"))
    assert cp.returncode == 2 and cp.stderr == f"grain.py ls: {tmp_path}/latin1.toml: cannot " \
        "be read: not UTF-8 text (invalid continuation byte at byte 8)\n"
    env = dict(os.environ, GRAIN_CONFIG=str(bad))
    cp = grain_cli("up", "--dry", env=env)
    assert cp.returncode == 2 and "worker.nmae" in cp.stderr
    # from a mission: run() raises it, without grain's frames (the mission did not start)
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from grain.delayed import run\n"
            f"async def main(): pass\nrun(main, config_file={str(bad)!r})")
    cp = run_py("-c", code)
    assert cp.stderr.strip().splitlines()[-1].startswith(
        f"grain.ConfigError: {bad}: unknown key 'worker.nmae'")
    assert cp.stderr.count('File "') <= 3, cp.stderr


def test_upstream_configs_pass_up_dry(tmp_path):
    ref = tmp_path / "grain.reference.toml"
    ref.write_text(UPSTREAM_REFERENCE)
    cp = grain_cli("up", "--dry", "-c", str(ref))
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0] == "#!/bin/bash" and "defer" not in cp.stdout
    worker = shlex.split(lines[-1])
    res = _json.loads(worker[worker.index("--res") + 1])
    # cores = 0, memory = 0, walltime = "": nothing asked; the worker offers what it finds.
    assert res == {"Token": {"token": "has-gpu"}, "Capacity": {"V": 8}}
    h, w = (grain.parse_config(UPSTREAM_REFERENCE, "ref").role(r) for r in ("head", "worker"))
    assert h.gnaw_enabled and h.max_missions == 8 and h.idle_quit == 1800 and h.swarm == 0
    assert w.script.queue == "" and h.script.walltime == 86400 and w.cli_dial == w.dial
    slurm = tmp_path / "slurm.toml"
    slurm.write_text(UPSTREAM_REFERENCE.replace('system = ""', 'system = "slurm"'))
    cp = grain_cli("up", "--dry", "-c", str(slurm))
    assert cp.returncode == 0, cp.stderr
    assert "#SBATCH --nodes=1" in cp.stdout and "--time" not in cp.stdout \
        and "--mem" not in cp.stdout and "--ntasks" not in cp.stdout and "-p " not in cp.stdout
    custom = tmp_path / "stampede2.toml"
    custom.write_text(UPSTREAM_CUSTOM_TEMPLATE)
    cp = grain_cli("up", "--dry", "-c", str(custom))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("#!/bin/bash\n#SBATCH -J grain-worker\n#SBATCH -p skx-dev\n"
                                "#SBATCH --ntasks-per-node=48\n#SBATCH --time=00:30:00\n")
    assert "--mem" not in cp.stdout
    worker = shlex.split(cp.stdout.strip().splitlines()[-1])
    assert _json.loads(worker[worker.index("--res") + 1])["Cores"] == {"N": 48}
    gnaw = grain.parse_config('[head.gnaw]\nenabled = false\nlog_file = "d.log"\n'
                              'max_conn = 2\nidle_quit = "5m"\nswarm = 3\n', "g").role("head")
    assert (gnaw.gnaw_enabled, gnaw.daemon_log, gnaw.max_missions, gnaw.idle_quit,
            gnaw.swarm) == (False, "d.log", 2, 300, 3)


###############################################################################
# Cluster #####################################################################
###############################################################################


SLURM_MISSION = textwrap.dedent("""
    import json, os, sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores
    from grain import GVAR

    @delayed
    async def job(i):
        await trio.sleep(2)
        return GVAR.instance, os.environ.get("SLURM_JOB_ID"), os.getpid(), GVAR.res.c

    async def main():
        print(json.dumps(await each((job @ Cores(1))(i) for i in range(6))), flush=True)

    run(main, config_file={config!r})
""")


def start_mission(tmp_path, cfg, job_id_variable="SLURM_JOB_ID", env=None, text=SLURM_MISSION):
    """SLURM_MISSION, or ``text`` (its results name each job's batch job by
    ``job_id_variable``) as a process, once its head is up in ``tmp_path/edge``."""
    mission = tmp_path / "mission.py"
    mission.write_text(text.replace("SLURM_JOB_ID", job_id_variable).format(
        here=HERE, config=str(cfg)))
    head = subprocess.Popen([sys.executable, str(mission)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: '"lid"' in (tmp_path / "edge").read_text()
                 if (tmp_path / "edge").exists() else False, 30, "the mission's head")
    except BaseException:
        head.kill()
        head.wait()
        raise
    return head


def test_render_slurm_script():
    w = grain.parse_config(EXAMPLE_TOML, "x.toml").role("worker")
    when = time.mktime((2026, 11, 22, 13, 14, 15, 0, 0, -1))
    script = grain.render_script(w, grain.worker_command(w, "/opt/grain.py"), when)
    lines = script.splitlines()
    assert lines[:9] == [
        "#!/bin/bash", "#SBATCH -J grain-worker", "#SBATCH -p debug", "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=16", "#SBATCH --mem=30720M", "#SBATCH --time=1-00:00:00",
        f"#SBATCH -o {os.path.abspath('logs/w-131415.log')}", "#SBATCH --account=chem"]
    body = "\n".join(lines[9:])
    assert body.index("echo first-deferred-runs-last") < body.index("rm -r /scratch/131415")
    assert body.index("trap grain_cleanup EXIT") < body.index("module load vasp") < \
        body.index("mkdir -p /scratch/131415") < body.index("/opt/grain.py worker")
    cmd = shlex.split(lines[-1])  # what runs, as a person reading the script expects
    assert cmd[:5] == [sys.executable, "/opt/grain.py", "worker", "--url", "edge:///shared/edge"]
    res = _json.loads(cmd[cmd.index("--res") + 1])
    assert res == {"Cores": {"N": 16}, "Memory": {"M": 28.0},
                   "WTime": {"T": "23:57:00", "countdown": True},
                   "Token": {"token": "gpu"}}


def test_render_pbs_and_custom_scripts():
    w = grain.parse_config(EXAMPLE_TOML.replace('system = "slurm"', 'system = "pbs"'),
                           "x.toml").role("worker")
    s = grain.render_script(w, "MAIN", 0)
    assert "#PBS -N grain-worker\n#PBS -q debug\n#PBS -l nodes=1:ppn=16\n" \
           "#PBS -l walltime=24:00:00\n#PBS -l vmem=30720mb\n#PBS -j oe\n#PBS -o " in s
    assert '#PBS --account=chem\ncd "$PBS_O_WORKDIR"\n' in s and s.endswith("MAIN\n")
    custom = grain.parse_config(textwrap.dedent("""
        system = "custom"
        [custom_system]
        submit_cmd = "qsub -terse"
        directive = "#$"
        template = '''#!/bin/sh
        #$ -N {name} -pe smp {cores} -l h_rt={walltime} -o {log_file}
        {directives}
        {main}
        '''
        [script]
        extra_args = ["-V"]
        cores = 1
        walltime = "1:00:00"
    """), "x.toml").role("worker")
    s = grain.render_script(custom, "MAIN", 0)
    assert "#$ -N grain-worker -pe smp 1 -l h_rt=01:00:00 -o /" in s and "#$ -V\nMAIN" in s


def test_script_gpus_asks_the_batch_system():
    base = 'system = "{}"\n[script]\ncores = 4\ngpus = 2\n'
    slurm = grain.parse_config(base.format("slurm"), "x.toml").role("worker")
    script = grain.render_script(slurm, grain.worker_command(slurm, "/opt/grain.py"))
    assert "#SBATCH --gres=gpu:2" in script.splitlines()
    assert '"Gpus":{"N":2}' in script
    pbs = grain.parse_config(base.format("pbs"), "x.toml").role("worker")
    assert "#PBS -l ngpus=2" in grain.render_script(pbs, "true").splitlines()
    custom = grain.parse_config(base.format("custom") + '[custom_system]\ntemplate = '
                                '"#!/bin/sh\\n# gpus={gpus}\\n{main}"\n', "x.toml")
    assert "# gpus=2" in grain.render_script(custom.role("worker"), "true")


def test_a_template_with_its_own_submit_cmd_needs_no_system(tmp_path):
    # upstream's way: no `system`, a custom template and the command that submits it
    cfg = grain.parse_config('[custom_system]\ntemplate = "#!/bin/sh\\n{main}"\n'
                             'submit_cmd = "sh -c \'echo 4242\'"\n', "x.toml").role("worker")
    script = grain.render_script(cfg, "true")
    assert grain.submit_script(cfg, script) == ["4242"]


def test_a_submit_command_that_fails_to_run_or_to_return_is_one_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grain, "SUBMIT_S", 0.5)
    for cmd, said in [("/no/such/qsub", "/no/such/qsub: command not found — check "
                                        "custom_system.submit_cmd in grain.toml"),
                      ("sh -c 'sleep 30'", "submission failed: sh did not return within 0.5 s — "
                                   "check custom_system.submit_cmd in grain.toml")]:
        cfg = grain.parse_config(f'[custom_system]\ntemplate = "#!/bin/sh\\n{{main}}"\n'
                                 f'submit_cmd = "{cmd}"\n', "x.toml").role("worker")
        with pytest.raises(grain.GrainError) as info:
            grain.submit_script(cfg, grain.render_script(cfg, "true"))
        assert str(info.value) == said


def test_a_busy_batch_system_is_tried_again_with_back_off_then_reported(tmp_path, monkeypatch):
    # A fake sbatch, on PATH: busy (Slurm's own words) as many times as busy.txt says, then
    # it takes the job; its tries are counted in tries.txt.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f"cd {tmp_path}\n"
        "echo x >> tries.txt\n"
        "if [ $(wc -l < tries.txt) -le $(cat busy.txt) ]; then\n"
        "  echo 'sbatch: error: Batch job submission failed: Socket timed out on send/recv "
        "operation' >&2; exit 1\n"
        "fi\n"
        "if [ -e refuse ]; then echo 'sbatch: error: invalid partition specified: x' >&2; "
        "exit 1; fi\n"
        "echo 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(grain, "SUBMIT_BACKOFF_S", 0.01)
    monkeypatch.chdir(tmp_path)
    cfg = grain.parse_config('system = "slurm"\n', "x.toml").role("worker")
    script = grain.render_script(cfg, "true")

    def submit(busy, refuse=False):
        (tmp_path / "busy.txt").write_text(busy)
        if refuse:
            (tmp_path / "refuse").write_text("")
        (tmp_path / "tries.txt").write_text("")
        try:
            return grain.submit_script(cfg, script)
        finally:
            tries.append(len((tmp_path / "tries.txt").read_text().split()))

    tries = []
    assert submit("2") == ["4242"]  # busy twice, then taken: submitted once
    with pytest.raises(grain.GrainError) as busy:
        submit("9")
    with pytest.raises(grain.GrainError) as refused:
        submit("0", refuse=True)
    assert tries == [3, grain.SUBMIT_TRIES, 1]  # a refusal is not tried again
    assert str(busy.value).endswith("Socket timed out on send/recv operation (tried 4 times: "
                                    "the batch system was busy each time)")
    assert "invalid partition" in str(refused.value) and "tried" not in str(refused.value)


def test_submit_without_a_batch_system(tmp_path):
    cfg = tmp_path / "grain.toml"
    cfg.write_text('system = "slurm"\n')
    env = dict(os.environ, PATH="/nonexistent")
    cp = grain_cli("up", "-c", str(cfg), env=env, cwd=tmp_path)
    assert cp.returncode == 1
    assert cp.stderr.strip().splitlines()[-1] == (
        "grain.py up: sbatch: command not found — is this a Slurm login node? If not, set "
        "system in grain.toml")
    cfg.write_text("")
    cp = grain_cli("up", "-c", str(cfg))
    assert cp.returncode == 2 and "no batch system configured" in cp.stderr


@needs_slurm
def test_a_rejected_submission_shows_the_schedulers_message(tmp_path, slurm_cleanup):
    cfg = slurm_config(tmp_path)
    cp = grain_cli("up", "-c", str(cfg), "--", "--partition=nosuchpartition", cwd=tmp_path)
    assert cp.returncode == 1
    last = cp.stderr.strip().splitlines()[-1]
    assert last.startswith("grain.py up: submission failed (sbatch exit 1): ")
    assert "invalid partition" in last.lower()


def test_up_forwards_other_arguments_and_names_each_submission(tmp_path):
    submitted = tmp_path / "submitted"
    (tmp_path / "sbatch.py").write_text(textwrap.dedent(f"""
        import sys
        with open({str(submitted)!r}, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        print(len(open({str(submitted)!r}).read().splitlines()))
    """))
    cfg = tmp_path / "grain.toml"
    cfg.write_text(textwrap.dedent(f"""
        system = "custom"
        address = "edge://{tmp_path}/edge"
        [custom_system]
        submit_cmd = "{sys.executable} {tmp_path}/sbatch.py"
        template = "#!/bin/sh\\n# {{name}} {{log_file}}\\n{{main}}"
        [worker]
        name = "w{{{{HHMMSS}}}}"
        log_file = "{tmp_path}/w{{{{HHMMSS}}}}.log"
    """))
    cp = grain_cli("up", "-n", "5", "-c", str(cfg), "--qos=x", "-A", "chem", cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr
    calls = submitted.read_text().splitlines()
    assert len(calls) == 5 and all(c.startswith("--qos=x -A chem ") for c in calls)
    names = re.findall(r"submitted worker job \d+ \((w\S+)\); log: (\S+)", cp.stdout)
    assert len({n for n, _ in names}) == 5 and len({log for _, log in names}) == 5
    assert names[1][0] == names[0][0] + "-1"


def test_start_runs_head_cmd_locally_or_renders_its_job(tmp_path):
    cfg = tmp_path / "grain.toml"
    cfg.write_text('system = "slurm"\n[head]\ncmd = "echo head-ran > started.txt"\n'
                   '[head.script]\nwalltime = "2:00:00"\n')
    cp = grain_cli("start", "-c", str(cfg), "--dry", cwd=tmp_path)
    assert cp.returncode == 0 and "#SBATCH -J grain-head" in cp.stdout
    assert "#SBATCH --time=2:00:00" in cp.stdout
    assert cp.stdout.rstrip().endswith("echo head-ran > started.txt")
    cp = grain_cli("start", "-c", str(cfg), "--local", cwd=tmp_path)
    assert cp.returncode == 0 and (tmp_path / "started.txt").read_text() == "head-ran\n"
    cfg.write_text('system = "slurm"\n')
    cp = grain_cli("start", "-c", str(cfg), cwd=tmp_path)
    assert cp.returncode == 2 and "set head.cmd" in cp.stderr


@pytest.mark.parametrize("fake,states", [
    ("echo 5 RUNNING", {"5": "RUNNING", "6": "ENDED"}),
    ("echo 5 COMPLETED; echo 6 TIMEOUT", {"5": "ENDED", "6": "ENDED"}),  # (still listed)
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
     {"5": "ENDED", "6": "ENDED"}),
    ("echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1",
     {"5": "UNKNOWN", "6": "UNKNOWN"}),
])
def test_a_failed_batch_query_means_unknown_never_ended(tmp_path, monkeypatch, fake, states):
    (tmp_path / "squeue").write_text(f"#!/bin/sh\n{fake}\n")
    (tmp_path / "qstat").write_text("#!/bin/sh\necho 'cannot connect to server' >&2; exit 1\n")
    for f in ("squeue", "qstat"):
        (tmp_path / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert grain.batch_states("slurm", ["5", "6"]) == states
    assert grain.batch_states("pbs", ["7"]) == {"7": "UNKNOWN"}


def test_pbs_is_asked_about_all_jobs_in_one_query(tmp_path, monkeypatch):
    # What Torque's `qstat -f 41.srv 42.srv 43.srv` says when 43 has gone: the blocks of
    # the others, a line for 43 on stderr, and exit 153 (PBSE_UNKJOBID).
    (tmp_path / "qstat").write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "$@" >> {calls}
        cat <<'EOF'
        Job Id: 41.srv.cluster
            Job_Name = grain-worker
            job_state = R
            Walltime.Remaining = 300

        Job Id: 42.srv.cluster
            Job_Name = grain-worker-1
            job_state = Q
        EOF
        echo 'qstat: Unknown Job Id Error 43.srv.cluster' >&2
        exit 153
        """).format(calls=tmp_path / "calls"))
    (tmp_path / "qstat").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert grain.batch_states("pbs", ["41.srv", "42.srv", "43.srv"]) == {
        "41.srv": "RUNNING", "42.srv": "PENDING", "43.srv": "ENDED"}
    assert (tmp_path / "calls").read_text() == "-f 41.srv 42.srv 43.srv\n"  # one query


FAKE_BATCH = r'''# A batch system in one file, for the tests: Slurm, Torque, PBS Pro, Grid Engine, LSF or
# Flux (FAKE_SYSTEM), each parsing a job script's directives as the real one does (the
# lines of its prefix before the first command; an option it does not know is refused)
# and answering in its real formats. Jobs live in FAKE_STATE (JSON) until cancelled.
import json, os, re, sys

SYSTEM, STATE = os.environ["FAKE_SYSTEM"], os.environ["FAKE_STATE"]
ANY, NUM, HMS = r"\S+", r"\d+", r"\d+:\d\d:\d\d"
GRAMMAR = {  # the directive prefix, and the options it takes (whole-line patterns)
    "slurm": ("#SBATCH", [f"-J {ANY}", f"-p {ANY}", "--nodes=1", f"--ntasks-per-node={NUM}",
                          f"--gres=gpu:{NUM}", f"--mem={NUM}M", f"--time=(\\d+-)?{HMS}",
                          f"-o {ANY}", f"--array=1-{NUM}"]),
    "pbs": ("#PBS", [f"-N {ANY}", f"-q {ANY}", f"-l nodes=1(:ppn={NUM})?", f"-l ngpus={NUM}",
                     f"-l walltime={HMS}", f"-l vmem={NUM}mb", "-j oe", f"-o {ANY}",
                     f"-t 1-{NUM}"]),
    "pbspro": ("#PBS", [f"-N {ANY}", f"-q {ANY}", f"-l select=1(:ncpus={NUM})?(:ngpus={NUM})?"
                        f"(:mem={NUM}mb)?", f"-l walltime={HMS}", "-j oe", f"-o {ANY}",
                        f"-J 1-{NUM}"]),
    "sge": ("#$", [f"-N {ANY}", "-S /\\S+", "-cwd", f"-q {ANY}", f"-pe \\w+ {NUM}",
                   f"-binding linear:{NUM}",
                   f"-l h_vmem={NUM}M", f"-l gpu={NUM}", f"-l h_rt={HMS}", "-j y",
                   f"-o {ANY}", f"-t 1-{NUM}", "-notify"]),
    "lsf": ("#BSUB", [f"-J [^\\s\\[]+(\\[1-{NUM}\\])?", f"-q {ANY}", f"-n {NUM}",
                      '-R "span\\[hosts=1\\]"', f'-gpu "num={NUM}"', f"-M {NUM}MB",
                      f'-R "rusage\\[mem={NUM}MB\\]"', f"-W (\\d+:)?\\d+", f"-o {ANY}"]),
    "flux": ("#flux:", [f"--job-name={ANY}", f"--queue={ANY}", "-N 1", "-n 1", f"-c {NUM}",
                        f"-g {NUM}", f"-t {NUM}[smhd]?", f"--output={ANY}"]),
}
BUSY = {"slurm": "sbatch: error: Batch job submission failed: Socket timed out on send/recv "
                 "operation",
        "pbs": "qsub: cannot connect to server srv (errno=111) Connection refused",
        "pbspro": "Connection refused\nqsub: cannot connect to server srv (errno=15010)",
        "sge": "error: commlib error: got select error (Connection refused)\nUnable to run "
               "job: unable to contact qmaster using port 6444 on host \"master\".",
        "lsf": "Failed in an LSF library call: Slave LIM configuration is not ready yet. "
               "Job not submitted.",
        "flux": "flux-batch: ERROR: Unable to connect to Flux: Connection refused"}


DOWN = {"slurm": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
        "pbs": "Connection refused\nqstat: cannot connect to server srv (errno=111)",
        "pbspro": "Connection refused\nqstat: cannot connect to server srv (errno=15010)",
        "sge": "error: commlib error: got select error (Connection refused)\nerror: unable "
               "to send message to qmaster using port 6444 on host \"master\": got send error",
        "lsf": "LSF is down. Please wait ...", "flux": "flux-jobs: ERROR: Unable to connect "
        "to Flux: broker socket /run/flux/local was not found"}


def load():
    try:
        with open(STATE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"next": 41, "jobs": {}, "calls": []}


def fail(msg, code=1):
    print(msg, file=sys.stderr)
    sys.exit(code)


def directives(text):
    prefix, options = GRAMMAR[SYSTEM]
    found = []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break  # the first command ends them
        if line.startswith(prefix + " "):
            opt = line[len(prefix) + 1:]
            if not any(re.fullmatch(o, opt) for o in options):
                fail(f"{SYSTEM}: invalid directive: {line}")
            found.append(opt)
    return found


def submit(state, args, script):
    if state.pop("busy", 0):
        state["busy_said"] = state.get("busy_said", 0) + 1
        save(state)
        fail(BUSY[SYSTEM])
    found = directives(script)
    n = next((int(m.group(1)) for d in found for m in [re.search(r"1-(\d+)\]?$", d)] if m
              and re.match(r"(--array|-t|-J)", d)), 0)
    job = str(state["next"])
    state["next"] += 1
    ids = {"slurm": (job, lambda i: f"{job}_{i}"), "sge": (job, lambda i: f"{job}.{i}"),
           "pbs": (f"{job}[].srv" if n else f"{job}.srv", lambda i: f"{job}[{i}].srv"),
           "pbspro": (f"{job}[].srv" if n else f"{job}.srv", lambda i: f"{job}[{i}].srv"),
           "lsf": (job, lambda i: f"{job}[{i}]"), "flux": (f"\u0192{job}x", None)}[SYSTEM]
    state["submissions"] = state.get("submissions", 0) + 1
    for i in range(1, n + 1) if n else [None]:
        state["jobs"][ids[1](i) if i else ids[0]] = "R"
    printed = {"slurm": job, "pbs": ids[0], "pbspro": ids[0],
               "sge": f"{job}.1-{n}:1" if n else job,
               "lsf": f"Job <{job}> is submitted to queue <normal>.", "flux": ids[0]}
    return printed[SYSTEM]


def save(state):
    with open(STATE, "w") as f:
        json.dump(state, f)


def main(cmd, args):
    state = load()
    state["calls"].append([cmd] + args)
    jobs, out = state["jobs"], ""
    if state.get("down") and cmd in ("squeue", "qstat", "bjobs", "flux jobs"):
        save(state)
        fail(DOWN[SYSTEM], 255 if SYSTEM == "lsf" else 1)
    if cmd in ("sbatch", "qsub", "flux batch"):
        out = submit(state, args, open(args[-1]).read())
    elif cmd == "bsub":
        if args and os.path.isfile(args[-1]):
            fail("bsub: a script given as a path runs as a command: its #BSUB lines are not read")
        out = submit(state, args, sys.stdin.read())
    elif cmd in ("scancel", "qdel", "bkill", "flux cancel"):
        ids = [i for a in args for i in a.split(",")]
        if unknown := [i for i in ids if i not in jobs]:
            save(state)
            fail(f"{cmd}: unknown job {unknown[0]}")
        for i in ids:
            del jobs[i]
    elif cmd == "squeue":  # -h -r -j IDS -o "%i %T"
        ids = args[args.index("-j") + 1].split(",")
        if not any(i in jobs for i in ids):
            save(state)
            fail("slurm_load_jobs error: Invalid job id specified")
        out = "\n".join(f"{i} RUNNING" for i in ids if i in jobs)
    elif cmd == "qstat" and SYSTEM == "sge":  # -u USER
        out = "job-ID  prior   name       user  state submit/start at     queue  slots " \
              "ja-task-ID\n" + "-" * 40 + "\n" + "\n".join(
                  f"{i.split('.')[0]} 0.555 grain-work me r 11/25/2026 12:00:00 all.q@n1 1 "
                  f"{i.split('.')[1] if '.' in i else ''}" for i in jobs)
    elif cmd == "qstat":  # [-x] -f IDS
        ids = [a for a in args if not a.startswith("-")]
        out = "\n".join(f"Job Id: {i}\n    job_state = R\n" for i in ids if i in jobs)
        if gone := [i for i in ids if i not in jobs]:
            print("\n".join(f"qstat: Unknown Job Id Error {i}" for i in gone), file=sys.stderr)
    elif cmd == "bjobs":  # -noheader -a -o "jobid stat jobindex" IDS
        ids = args[4:]
        for i in ids:
            if i not in jobs:
                print(f"Job <{i}> is not found", file=sys.stderr)
        out = "\n".join(f"{i.split('[')[0]} RUN {i.split('[')[1][:-1] if '[' in i else 0}"
                        for i in ids if i in jobs)
    elif cmd == "flux jobs":  # -n -o "{id.f58} {state}" IDS
        for i in args[3:]:
            if i not in jobs:
                print(f"JobID {i} unknown", file=sys.stderr)
        out = "\n".join(f"{i} RUN" for i in args[3:] if i in jobs)
    else:
        fail(f"fakebatch: {cmd} {args}: not a command of {SYSTEM}")
    save(state)
    print(out)


cmd, args = os.path.basename(sys.argv[1]), sys.argv[2:]
if cmd == "flux":
    cmd, args = f"flux {args[0]}", args[1:]
main(cmd, args)
'''
BATCH_COMMANDS = ("sbatch", "squeue", "scancel", "qsub", "qstat", "qdel", "bsub", "bjobs",
                  "bkill", "flux")


def fake_batch_system(tmp_path, system):
    """The environment of a login node of ``system``, simulated by FAKE_BATCH: its
    commands on PATH, its jobs in state.json."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fakebatch.py").write_text(FAKE_BATCH)
    for cmd in BATCH_COMMANDS:
        (bin_dir / cmd).write_text(f'#!/bin/sh\nexec {sys.executable} {bin_dir}/fakebatch.py '
                                   f'{cmd} "$@"\n')
        (bin_dir / cmd).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SYSTEM=system,
                FAKE_STATE=str(tmp_path / "state.json"))


# What each system's script asks for 4 cores, 8 GB, 1:30:00 and a GPU in queue "short".
SCRIPT_DIRECTIVES = {
    "slurm": ["-J grain-worker", "-p short", "--nodes=1", "--ntasks-per-node=4",
              "--gres=gpu:1", "--mem=8192M", "--time=1:30:00", "-o LOG"],
    "pbs": ["-N grain-worker", "-q short", "-l nodes=1:ppn=4", "-l ngpus=1",
            "-l walltime=01:30:00", "-l vmem=8192mb", "-j oe", "-o LOG"],
    "pbspro": ["-N grain-worker", "-q short", "-l select=1:ncpus=4:ngpus=1:mem=8192mb",
               "-l walltime=01:30:00", "-j oe", "-o LOG"],
    "sge": ["-N grain-worker", "-S /bin/bash", "-cwd", "-q short", "-pe smp 4",
            "-binding linear:4", "-l h_vmem=2048M", "-l gpu=1", "-l h_rt=01:30:00", "-j y", "-o LOG",
            "-notify"],
    "lsf": ["-J grain-worker", "-q short", "-n 4", '-R "span[hosts=1]"', '-gpu "num=1"',
            "-M 8192MB", '-R "rusage[mem=8192MB]"', "-W 1:30", "-o LOG"],
    "flux": ["--job-name=grain-worker", "--queue=short", "-N 1", "-n 1", "-c 4", "-g 1",
             "-t 90m", "--output=LOG"],
}


@pytest.mark.parametrize("system", list(SCRIPT_DIRECTIVES))
def test_each_batch_system_takes_its_script_and_its_jobs_are_asked_about_and_cancelled(
        tmp_path, system):
    env = fake_batch_system(tmp_path, system)
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'system = "{system}"\naddress = "edge://{tmp_path}/edge"\n[script]\n'
                   'queue = "short"\ncores = 4\nmemory = 8\nwalltime = "1:30:00"\ngpus = 1\n'
                   '[worker]\nlog_file = "w.log"\n')
    prefix = {"slurm": "#SBATCH ", "pbs": "#PBS ", "pbspro": "#PBS ", "sge": "#$ ",
              "lsf": "#BSUB ", "flux": "#flux: "}[system]
    dry = grain_cli("up", "--dry", "-c", str(cfg), env=env, cwd=tmp_path)
    assert [x[len(prefix):].replace(str(tmp_path / "w.log"), "LOG") for x in
            dry.stdout.splitlines() if x.startswith(prefix)] == SCRIPT_DIRECTIVES[system]
    state = lambda: json.loads((tmp_path / "state.json").read_text())  # noqa: E731
    up = grain_cli("up", "-n", "2", "-c", str(cfg), env=env, cwd=tmp_path)
    assert up.returncode == 0, up.stderr  # (the fake refuses a directive it cannot parse)
    assert state()["submissions"] == 2 and len(state()["jobs"]) == 2
    up = grain_cli("up", "-n", "3", "--array", "-c", str(cfg), env=env, cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    arrays = system != "flux"  # (Flux has none: three jobs)
    assert state()["submissions"] == (3 if arrays else 5) and len(state()["jobs"]) == 5
    if arrays:
        assert "submitted worker array job of 3 tasks" in up.stdout
        assert "logs: " + str(tmp_path / "w-*.log") in up.stdout
    book = grain.JobBook(f"edge://{tmp_path}/edge")
    assert sorted(r["id"] for r in book.records()) == sorted(state()["jobs"])
    # the controller away: every state unknown; a job it forgot (finished long ago): ended
    for change, said in (({"down": True}, "state unknown"), ({"down": False}, "ENDED")):
        st = state()
        st.update(change)
        forgot = sorted(st["jobs"])[0]
        if "ENDED" in said:
            del st["jobs"][forgot]
        (tmp_path / "state.json").write_text(json.dumps(st))
        ls = grain_cli("ls", "-c", str(cfg), env=env, cwd=tmp_path)
        assert f"job {forgot} (grain-worker): {said}" in ls.stdout, ls.stdout
        assert ls.stdout.count(said) == (5 if "unknown" in said else 1), ls.stdout
    down = grain_cli("down", "-c", str(cfg), env=env, cwd=tmp_path)  # it forgets that one
    assert "no job to cancel" not in down.stdout and len(book.records()) == 0
    for _ in range(2):
        up = grain_cli("up", "-n", "2" if _ else "3", *(["--array"] if _ else []), "-c",
                       str(cfg), env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
    before = len(state()["calls"])
    ls = grain_cli("ls", "-c", str(cfg), env=env, cwd=tmp_path)
    for job_id in state()["jobs"]:
        assert f"job {job_id} (grain-worker): RUNNING" in ls.stdout, ls.stdout
    assert len(state()["calls"]) == before + 1  # one query for all five
    down = grain_cli("down", "-c", str(cfg), env=env, cwd=tmp_path)
    assert down.returncode == 0 and down.stdout.count("cancelled worker job") == 5, down.stdout
    assert state()["jobs"] == {} and book.records() == []
    assert len(state()["calls"]) == before + 3  # one query, one cancel for all
    # a busy controller, in its own words: tried again, submitted once
    st = state()
    st["busy"] = 1
    (tmp_path / "state.json").write_text(json.dumps(st))
    up = grain_cli("up", "-c", str(cfg), env=env, cwd=tmp_path, timeout=60)
    assert up.returncode == 0 and "the batch system is busy: trying again in 2 s" in up.stderr
    assert state()["busy_said"] == 1 and len(state()["jobs"]) == 1


def test_up_keeps_to_max_queued_and_max_submit_rate(tmp_path, monkeypatch):
    env = fake_batch_system(tmp_path, "slurm")
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'system = "slurm"\naddress = "edge://{tmp_path}/edge"\n'
                   '[script]\nmax_queued = 3\nmax_submit_rate = 4\n')
    up = grain_cli("up", "-n", "2", "-c", str(cfg), env=env, cwd=tmp_path)
    assert up.returncode == 0 and up.stdout.count("submitted worker job") == 2
    up = grain_cli("up", "-n", "2", "-c", str(cfg), env=env, cwd=tmp_path)
    assert up.returncode == 0 and up.stdout.count("submitted worker job") == 1
    assert "max_queued = 3 and 2 worker job(s) are queued: submitting 1 of 2" in up.stderr
    # the rate: a pause of 1/4 s between submissions, none before the first
    for var in ("PATH", "FAKE_SYSTEM", "FAKE_STATE"):
        monkeypatch.setenv(var, env[var])
    pauses = []
    s = grain.load_config(str(cfg)).role("worker")
    assert len(list(grain.submit_workers(s, 3, pause=pauses.append))) == 3
    assert pauses == [0.25, 0.25]


@trio_test
async def test_the_swarm_submits_an_array_within_max_queued_and_the_rate(autojump_clock,
                                                                         monkeypatch):
    async def at_once(fn, *args):  # (a thread's wait would let the mock clock jump)
        return fn(*args)

    submitted = []  # (time, tasks)

    def submit(s, script, extra, role, when, seq, tasks):
        submitted.append((trio.current_time(), tasks))
        assert ("--array=1-%d" % tasks in script) == bool(tasks)
        return [f"{len(submitted)}_{i}" for i in range(1, tasks + 1)] or [str(len(submitted))]

    monkeypatch.setattr(trio.to_thread, "run_sync", at_once)
    monkeypatch.setattr(grain, "submit_script", submit)
    monkeypatch.setattr(grain, "batch_states", lambda system, ids, custom: dict.fromkeys(
        ids, "PENDING"))
    s = grain.parse_config('system = "slurm"\n[script]\narray = true\nmax_queued = 5\n'
                           'max_submit_rate = 0.1\n', "x.toml").role("worker")
    keeper = grain.SwarmKeeper(s, target=8, quota=100, window=600.0)
    with trio.move_on_after(100):
        await keeper.run(lambda: 0)
    # five at once as one array (max_queued), then nothing: they stay queued
    assert [tasks for _, tasks in submitted] == [5]
    assert keeper.note == "max_queued reached: 5 worker job(s) queued"
    one_by_one = dataclasses.replace(s.script, array=False, max_queued=0)
    keeper = grain.SwarmKeeper(dataclasses.replace(s, script=one_by_one), 3, 100, 600.0)
    submitted.clear()
    with trio.move_on_after(100):
        await keeper.run(lambda: 0)
    start = submitted[0][0]
    assert [(t - start, tasks) for t, tasks in submitted] == [(0, 0), (10, 0), (20, 0)]


@pytest.mark.parametrize("system,env,fake,seconds", [
    ("slurm", {"SLURM_JOB_ID": "42"}, "[ \"$*\" = '-h -j 42 -o %e' ] && date -d @$(( $(date "
     "+%s) + 600 )) +%Y-%m-%dT%H:%M:%S", 600),
    ("pbs", {"PBS_JOBID": "42.srv"}, "echo 'Job Id: 42.srv'; echo '    Walltime.Remaining = "
     "540'", 540),
    ("pbs", {"PBS_JOBID": "42.srv"}, "echo '    Resource_List.walltime = 01:00:00'; echo '  "
     "  resources_used.walltime = 00:10:00'", 3000),  # (PBS Pro's)
    ("lsf", {"LSB_JOBID": "42", "LSB_JOBINDEX": "0"}, "[ \"$*\" = '-noheader -o time_left 42' ]"
     " && echo '1:30 L'", 5400),
    ("flux", {"FLUX_JOB_ID": "\u0192Abc"}, "[ \"$*\" = 'job timeleft' ] && echo 120", 120),
])
def test_a_worker_asks_its_batch_system_when_its_allocation_ends(tmp_path, monkeypatch, system,
                                                                 env, fake, seconds):
    for var in _JOB_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    for cmd in ("squeue", "qstat", "bjobs", "flux"):
        (tmp_path / cmd).write_text(f"#!/bin/bash\n{fake}\n")
        (tmp_path / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert abs(grain.allocation_end() - seconds) < 5


def test_an_lsf_worker_takes_the_cores_lsf_bound_it_to(monkeypatch):
    for var in _JOB_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LSB_JOBID", "42")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # (its cpuset: the whole node)
    monkeypatch.setenv("LSB_BIND_CPU_LIST", "1,3")
    assert grain.batch_cpu_ids([0, 1, 2, 3]) == [1, 3]
    monkeypatch.delenv("LSB_BIND_CPU_LIST")  # (no affinity asked: nothing better to say)
    assert grain.batch_cpu_ids([0, 1, 2, 3]) is None


_JOB_ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "PBS_JOBID",
            "JOB_ID", "SGE_TASK_ID", "LSB_JOBID", "LSB_JOBINDEX", "FLUX_JOB_ID", "GRAIN_JOB_ID")


@pytest.mark.parametrize("system,env,task_id", [
    ("slurm", {"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "3"},
     "42_3"),
    ("slurm", {"SLURM_JOB_ID": "42"}, "42"),
    ("pbs", {"PBS_JOBID": "42[3].srv", "PBS_ARRAYID": "3"}, "42[3].srv"),
    ("sge", {"JOB_ID": "42", "SGE_TASK_ID": "3"}, "42.3"),
    ("sge", {"JOB_ID": "42", "SGE_TASK_ID": "undefined"}, "42"),
    ("lsf", {"LSB_JOBID": "42", "LSB_JOBINDEX": "3"}, "42[3]"),
    ("lsf", {"LSB_JOBID": "42", "LSB_JOBINDEX": "0"}, "42"),
    ("flux", {"FLUX_JOB_ID": "\u0192Abc"}, "\u0192Abc"),
])
def test_a_worker_knows_its_job_or_array_task_by_the_id_up_recorded(monkeypatch, system, env,
                                                                        task_id):
    # (the head marks a worker's job joined by this id: it must be the JobBook's)
    for var in _JOB_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert grain.batch_job() == (system, task_id)
    spec = grain.SYSTEMS[system]
    if "3" in env.values():  # an array's task: as submit_script names it
        job = {"pbs": "42[].srv"}.get(system, "42")
        assert spec["array"][1](job, 3) == task_id


def test_down_and_ls_keep_jobs_whose_state_is_unknown(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for cmd in ("squeue", "scancel"):
        (fake / cmd).write_text("#!/bin/sh\necho 'Unable to contact slurm controller' >&2\n"
                                "exit 1\n")
        (fake / cmd).chmod(0o755)
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'system = "slurm"\naddress = "edge://{tmp_path}/edge"\n')
    book = grain.JobBook(f"edge://{tmp_path}/edge")
    book.update(lambda rs: rs + [{"id": "41", "system": "slurm", "role": "worker",
                                  "name": "w", "log": ""}])
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    ls = grain_cli("ls", "-c", str(cfg), env=env)
    assert "job 41 (w): state unknown" in ls.stdout and "ENDED" not in ls.stdout
    down = grain_cli("down", "-c", str(cfg), env=env)
    assert "job 41 (w): cancel failed (scancel exit 1)" in down.stdout
    assert [r["id"] for r in book.records()] == ["41"]  # not forgotten while unknown


@needs_slurm
@pytest.mark.parametrize("system", ["slurm", "pbs"])
def test_up_n_2_on_a_real_batch_system(tmp_path, slurm_cleanup, system):
    # Slurm's torque wrapper ignores PBS's vmem and would give each job the whole node's
    # memory; a mem request through extra_args lets both run at once.
    extra = {"extra_args": ["-l mem=1gb"]} if system == "pbs" else {}
    cfg = slurm_config(tmp_path, system, **extra)
    head = start_mission(tmp_path, cfg)
    try:
        up = grain_cli("up", "-c", str(cfg), "-n", "2", cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        ids = re.findall(r"submitted worker job (\S+) ", up.stdout)
        assert len(ids) == 2
        seen = {}

        def both_listed():
            ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
            seen["ls"] = ls.stdout
            return all(re.search(rf"^\S+-{i}\s", ls.stdout, re.M) for i in ids)

        wait_for(both_listed, 90, "both workers in `ls`")
        assert "2 worker(s)" in seen["ls"]
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err
        results = _json.loads(out.strip().splitlines()[-1])
        assert len(results) == 6 and {r[1] for r in results} <= set(ids)
        assert all(r[2] != head.pid for r in results)
        # Each worker offers the core Slurm allocated to its job, not both "core 0".
        cores = {r[1]: tuple(r[3]) for r in results}
        assert len(cores) == 2 and len(set(cores.values())) == 2, cores
        # After the mission the head daemon keeps the workers for the next one; `stop`
        # sends them FIN: then no allocation lingers, and the deferred cleanup ran in both.
        ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
        assert "2 worker(s)" in ls.stdout and "missions: 0 attached" in ls.stdout, ls.stdout
        stop = grain_cli("stop", "-c", str(cfg), cwd=tmp_path)
        assert stop.returncode == 0 and "FIN to 2 worker(s)" in stop.stdout, stop.stderr
        wait_for(lambda: not (squeue_ids() & set(ids)), 60, "the jobs to leave squeue")
        if system == "slurm":
            wait_for(lambda: all((tmp_path / f"cleaned-{i}").exists() for i in ids), 10,
                     "the defer cleanup")
        else:  # the torque wrapper names jobs by Slurm's id too
            wait_for(lambda: len(list(tmp_path.glob("cleaned-*"))) == 2, 10, "the cleanup")
        # Their workers joined, so a later `ls` raises no false alarm about them.
        ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
        assert ls.returncode == 1 and "ENDED WITHOUT" not in ls.stdout
        down = grain_cli("down", "-c", str(cfg), cwd=tmp_path)
        assert down.stdout.strip() == "no job to cancel"
    finally:
        head.kill()
        head.wait()


def test_a_wrapped_worker_runs_in_its_container_given_files_gpus_cores_and_job(tmp_path):
    def line(wrap):
        s = grain.parse_config(f'address = "edge://{tmp_path}/e/edge"\n[script]\ngpus = 1\n'
                               f'[worker]\nwrap = "{wrap}"\n', "x.toml").role("worker")
        return grain.worker_command(s, "/opt/g/grain.py")

    key_dir = os.path.dirname(grain.default_key_path())
    folders = sorted(["/opt/g", f"{tmp_path}/e", key_dir])
    worker = (f"python3 /opt/g/grain.py worker --url edge://{tmp_path}/e/edge --res "
              "'{\"Gpus\":{\"N\":1}}'")  # (the container's python3, unless script.python)
    assert line("apptainer exec img.sif").startswith(
        f"apptainer exec --bind={','.join(folders)} --nv img.sif {worker}")
    podman = line("podman run --ipc=host img")
    assert podman.startswith("podman run --rm --network=host " + " ".join(
        f"--volume={d}:{d}" for d in folders))
    assert "--env=SLURM_JOB_ID --env=SLURM_ARRAY_JOB_ID" in podman
    assert "--device=nvidia.com/gpu=all --cpuset-cpus=\"$(sed -n " in podman
    assert podman.endswith(f'/proc/self/status)" --ipc=host img {worker} --key '
                           f'{grain.default_key_path()} --reattach 600s')
    cp = subprocess.run(["bash", "-c", podman.split("--cpuset-cpus=")[1].split(" --ipc")[0]
                         .join(["echo ", ""])], capture_output=True, text=True)
    assert grain.parse_ids(cp.stdout.strip()) == sorted(os.sched_getaffinity(0))
    assert line("env OMP_NUM_THREADS=1").startswith(f"env OMP_NUM_THREADS=1 {worker}")


@needs_slurm
def test_an_array_of_workers_on_slurm_each_in_its_container(tmp_path, slurm_cleanup):
    # `up -n 2` with script.array: one sbatch; each task a worker, in a container (a fake
    # apptainer that notes the flags it was given, then runs the command inside), that
    # joins under its task id and writes its own log.
    apptainer = tmp_path / "apptainer"
    apptainer.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        [ "$1" = exec ] || exit 64
        shift
        while [[ "$1" == -* ]]; do echo "$1" >> {tmp_path}/flags-$SLURM_ARRAY_TASK_ID; shift; done
        shift  # the image
        exec "$@"
    """))
    apptainer.chmod(0o755)
    cfg = slurm_config(tmp_path, python=sys.executable, array=True)
    cfg.write_text(cfg.read_text() + f'[worker]\nwrap = "{apptainer} exec grain.sif"\n')
    # Each job waits (a minute at most) until jobs have run on both tasks: on a busy machine
    # the second task's worker may join after the first has run all six jobs of 2 s.
    both = SLURM_MISSION.replace("await trio.sleep(2)", textwrap.dedent(f"""\
        open(os.path.join({str(tmp_path)!r}, "ran-" + GVAR.instance), "w").close()
            with trio.move_on_after(60):
                while len(glob.glob(os.path.join({str(tmp_path)!r}, "ran-*"))) < 2:
                    await trio.sleep(0.2)""")).replace("import json", "import glob, json")
    head = start_mission(tmp_path, cfg, text=both)
    try:
        up = grain_cli("up", "-c", str(cfg), "-n", "2", cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        job, = re.findall(r"submitted worker array job of 2 tasks, (\d+)_1 to \1_2 ", up.stdout)
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err
        results = _json.loads(out.strip().splitlines()[-1])
        assert len(results) == 6
        ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
        assert all(re.search(rf"^\S+-{job}_{i}\s", ls.stdout, re.M) for i in (1, 2)), ls.stdout
        assert "submitted, not joined" not in ls.stdout  # each task marked by its id
        for i in (1, 2):
            folders = {HERE, str(tmp_path), os.path.dirname(grain.default_key_path())}
            assert (tmp_path / f"flags-{i}").read_text().split() == [
                f"--bind={','.join(sorted(folders))}"]
            log, = tmp_path.glob(f"grain-worker-*-{i}.log")  # each task its own
            assert f"worker {grain.hostname()}-{job}_{i} registered" in log.read_text()
        assert len({tuple(r[3]) for r in results}) == 2  # each task the core it was given
        stop = grain_cli("stop", "-c", str(cfg), cwd=tmp_path)
        assert stop.returncode == 0 and "FIN to 2 worker(s)" in stop.stdout, stop.stderr
        wait_for(lambda: not any(i.startswith(f"{job}_") for i in squeue_ids()), 60,
                 "the tasks to leave squeue")
    finally:
        head.kill()
        head.wait()


@needs_slurm
@pytest.mark.skipif(os.environ.get("GRAIN_TEST_RESTART_SLURMCTLD") != "1",
                    reason="stops the Slurm controller for seconds: only where it is the "
                           "suite's own (.ci/run sets GRAIN_TEST_RESTART_SLURMCTLD=1)")
def test_up_n_4_rides_out_a_slurm_controller_gone_for_seconds(tmp_path, slurm_cleanup):
    # The controller stops after the first submission and is back 12 s later: sbatch
    # gives up after about 9 s of its own tries, grain tries again. Every worker job is
    # submitted once, none twice.
    cfg = slurm_config(tmp_path, python="/bin/false", max_submit_rate=1)
    up = subprocess.Popen([sys.executable, GRAIN, "up", "-c", str(cfg), "-n", "4"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    book = grain.JobBook(f"edge://{tmp_path}/edge")
    try:
        wait_for(lambda: book.records(), 30, "the first submission")
        subprocess.run(["pkill", "-x", "slurmctld"], check=True)
        wait_for(lambda: subprocess.run(["pgrep", "-x", "slurmctld"]).returncode == 1, 30,
                 "the controller to stop")
        time.sleep(12)  # (the fault itself: the controller away this long)
    finally:
        if subprocess.run(["pgrep", "-x", "slurmctld"]).returncode == 1:
            # (without the run's HOME: the run kills what holds it at its end, and this
            # controller is the machine's, for the runs that follow)
            subprocess.run(["slurmctld"], check=True, env={
                k: v for k, v in os.environ.items() if k not in ("HOME", "TMPDIR")})
    out, err = up.communicate(timeout=180)
    assert up.returncode == 0, err
    ids = re.findall(r"submitted worker job (\d+) ", out)
    assert len(ids) == 4 == len(set(ids))
    assert "Unable to contact slurm controller" in err and "trying again in 2 s" in err

    def mine():
        out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %Z"],
                             capture_output=True, text=True).stdout
        return sorted(i for i, _, d in (x.partition(" ") for x in out.splitlines())
                      if d == str(tmp_path))
    wait_for(lambda: mine() == sorted(ids), 60, "Slurm to hold these four jobs, no more")
    assert sorted(r["id"] for r in book.records()) == sorted(ids)


# Grid Engine's commands, where .ci/sge-up.sh puts them (beside Slurm's qsub, whose
# package conflicts with Grid Engine's)
SGE_BIN = os.environ.get("GRAIN_TEST_SGE_BIN", "/opt/gridengine/bin")
needs_sge = pytest.mark.skipif(not os.path.exists(os.path.join(SGE_BIN, "qsub")),
                               reason=f"no Grid Engine in {SGE_BIN} (.ci/sge-up.sh)")


@needs_sge
def test_an_array_of_workers_on_grid_engine_runs_a_mission(tmp_path):
    env = dict(os.environ, PATH=f"{SGE_BIN}:{os.environ['PATH']}")
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'system = "sge"\naddress = "edge://{tmp_path}/edge"\n[script]\n'
                   f'python = "{sys.executable}"\ncores = 1\nmemory = 1\n'
                   'walltime = "0:10:00"\nsetup_cleanup = "defer touch '
                   f'{tmp_path}/cleaned-$SGE_TASK_ID"\n')
    head, job = start_mission(tmp_path, cfg, "JOB_ID", env), None
    try:
        up = grain_cli("up", "-c", str(cfg), "-n", "2", "--array", cwd=tmp_path, env=env)
        assert up.returncode == 0, up.stderr
        job, = re.findall(r"submitted worker array job of 2 tasks, (\d+)\.1 to \1\.2 ",
                          up.stdout)
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err
        results = _json.loads(out.strip().splitlines()[-1])
        assert len(results) == 6 and {r[1] for r in results} == {job}  # (JOB_ID: the array's)
        assert len({tuple(r[3]) for r in results}) == 2  # each bound to its own core
        ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path, env=env)
        assert all(re.search(rf"^\S+-{job}\.{i}\s", ls.stdout, re.M) for i in (1, 2)), ls.stdout
        assert "submitted, not joined" not in ls.stdout
        # `down` cancels the array (qdel): Grid Engine warns each task's process group
        # (-notify: SIGUSR2, and SIGKILL 60 s later); the worker leaves at once, telling its
        # head, and its job script's shell, which ignores the notice, ends as it does.
        down = grain_cli("down", "-c", str(cfg), cwd=tmp_path, env=env)
        assert down.stdout.splitlines() == [f"cancelled worker job {job}.{i} (grain-worker)"
                                            for i in (1, 2)], down.stdout + down.stderr

        def listed():
            return subprocess.run(["qstat", "-u", "*"], capture_output=True, text=True,
                                  env=env).stdout.split()
        wait_for(lambda: job not in listed(), 30, "the tasks to leave qstat")
        for i in (1, 2):
            log, = tmp_path.glob(f"grain-worker-*-{i}.log")  # each task its own
            text = log.read_text()
            assert f"worker {grain.hostname()}-{job}.{i} registered" in text
            assert "got SIGUSR2: the batch system is about to end this job" in text, text
            assert (tmp_path / f"cleaned-{i}").exists(), text

        def exit_statuses():  # (what Grid Engine's accounting says each task ended with)
            return re.findall(r"^exit_status\s+(\d+)", subprocess.run(
                ["qacct", "-j", job], capture_output=True, text=True, env=env).stdout, re.M)
        wait_for(lambda: len(exit_statuses()) == 2, 30, "the accounting of both tasks")
        assert exit_statuses() == ["0", "0"]  # (not 140: no task died of the notice)
        stop = grain_cli("stop", "-c", str(cfg), cwd=tmp_path, env=env)
        assert stop.returncode == 0 and "FIN to 0 worker(s)" in stop.stdout, stop.stderr
    finally:
        head.kill()
        head.wait()
        if job:
            subprocess.run(["qdel", job], capture_output=True, env=env)


@needs_slurm
def test_a_worker_that_never_starts_is_reported_and_down_cancels(tmp_path, slurm_cleanup):
    cfg = slurm_config(tmp_path, python="/nonexistent/python3")
    up = grain_cli("up", "-c", str(cfg), cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    (job,) = re.findall(r"submitted worker job (\S+) ", up.stdout)
    wait_for(lambda: job not in squeue_ids(), 60, "the broken job to end")
    ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
    assert ls.returncode == 1 and "no head is listening" in ls.stderr
    assert f"job {job} (grain-worker): ENDED WITHOUT ITS WORKER EVER JOINING" in ls.stdout
    assert "/nonexistent/python3" in ls.stdout    # the tail of its log says why
    # A pending job (held back an hour) is cancelled by `down`.
    cfg = slurm_config(tmp_path)
    up = grain_cli("up", "-c", str(cfg), "--", "--begin=now+1hour", cwd=tmp_path)
    (pending,) = re.findall(r"submitted worker job (\S+) ", up.stdout)
    assert pending in squeue_ids()
    down = grain_cli("down", "-c", str(cfg), cwd=tmp_path)
    assert f"cancelled worker job {pending} (grain-worker)" in down.stdout
    wait_for(lambda: pending not in squeue_ids(), 30, "the cancelled job to leave")


@needs_slurm
def test_the_mission_head_reports_a_job_that_never_joins(tmp_path, slurm_cleanup):
    cfg = slurm_config(tmp_path, python="/nonexistent/python3")
    mission = tmp_path / "mission.py"
    mission.write_text(SLURM_MISSION.format(here=HERE, config=str(cfg)).replace(
        "from grain import GVAR", "from grain import GVAR\nimport grain\ngrain.JOB_WATCH_S = 1"
    ).replace("run(main, ", "run(main, local=grain.ZERO, "))  # this process is the head
    log = tmp_path / "head.err"
    with open(log, "w") as err:
        head = subprocess.Popen([sys.executable, str(mission)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: (tmp_path / "edge").exists(), 30, "the head")
        up = grain_cli("up", "-c", str(cfg), cwd=tmp_path)
        (job,) = re.findall(r"submitted worker job (\S+) ", up.stdout)
        said = f"batch job {job} (grain-worker) ended without its worker ever joining"
        wait_for(lambda: said in log.read_text(), 60, "the head's report")
        # explain: the mission's jobs wait for a worker, and what became of the one submitted
        out = grain_cli("explain", "-c", str(cfg), cwd=tmp_path).stdout
        assert "no worker has joined yet" in out, out
        assert f"job {job} (grain-worker): ENDED WITHOUT ITS WORKER EVER JOINING" in out
    finally:
        head.kill()
        head.wait()
    assert "/nonexistent/python3" in log.read_text()


# A cluster of hosts: .ci/cluster-up.sh's login host and nodes node1..node3, each a network
# namespace of this machine with a hostname and an address of its own, one Slurm across
# them (slurmctld on login, a slurmd on each node, partition batch), and this machine's
# filesystem shared by all, as on a cluster. `.ci/on-host NAME CMD...` runs CMD on a host;
# every grain command below runs on the login host, as a user would type it there. The
# login host lists first an interface the nodes cannot reach.

ON_HOST = os.path.join(HERE, ".ci", "on-host")
NODES = ("node1", "node2", "node3")


def on_host(host, *argv, cwd=HERE, timeout=120, **kw):
    """Run ``argv`` on ``host`` (login, node1..3) of the cluster; CompletedProcess (text)."""
    return subprocess.run([ON_HOST, host, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _cluster_trouble():
    """Why the cluster of hosts cannot be used here (None: it can). Asked once a run: the
    processes of the run that import this file (a worker unpickling a job's function) are
    given the answer, not asking the cluster again (which, when it does not answer, would
    hold each such job for the timeout)."""
    known = os.environ.get("GRAIN_TEST_CLUSTER_TROUBLE")
    if known is None:
        known = os.environ["GRAIN_TEST_CLUSTER_TROUBLE"] = _ask_the_cluster() or ""
    return known or None


def _ask_the_cluster():
    if os.geteuid() != 0:
        return "entering the cluster's hosts (network namespaces) needs root"
    if not os.path.exists("/var/run/netns/grain-login") or not shutil.which("nsenter"):
        return "no cluster of hosts here: run .ci/cluster-up.sh (as root) to make one"
    try:
        nodes = on_host("login", "sinfo", "-h", "-N", "-o", "%N %t", timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"the cluster does not answer: {e}"
    up = {n for n, _, state in (line.partition(" ") for line in nodes.splitlines())
          if re.match(r"(idle|mix|alloc)", state)}
    if not set(NODES) <= up:
        return f"the cluster's nodes are not all up (sinfo -N: {nodes.strip() or 'nothing'})"
    return None


needs_cluster = pytest.mark.skipif(_cluster_trouble() is not None, reason=str(_cluster_trouble()))


def node_cores():
    """{node: the cores a process there may use}, asked of each node."""
    out = {}
    for node in NODES:
        cp = on_host(node, sys.executable, "-c", "import os, socket; print(socket.gethostname()"
                     ", sorted(os.sched_getaffinity(0)))")
        host, cores = cp.stdout.split(" ", 1)
        assert host == node, cp
        out[node] = json.loads(cores)
    return out


def cluster_jobs(where):
    """{job id: (state, node)} of the cluster's jobs submitted from ``where`` (or below)."""
    out = on_host("login", "squeue", "-h", "-o", "%i %T %N %Z").stdout
    jobs = {}
    for line in out.splitlines():
        job, state, *rest = line.split()
        if rest and (rest[-1] == str(where) or rest[-1].startswith(f"{where}/")):
            jobs[job] = (state, rest[0] if len(rest) == 2 else "")
    return jobs


class HostCluster:
    """A test's grain set-up on the cluster: grain.toml and the Edge file in its tmp_path (the
    shared filesystem), a head daemon on the login host when asked; all cleaned up."""

    def __init__(self, path):
        self.path, self.cfg, self.head = path, path / "grain.toml", None
        self.cfg.write_text(f'system = "slurm"\naddress = "edge://{path}/edge"\n[script]\n'
                            f'queue = "batch"\nwalltime = "0:10:00"\n'
                            f'python = "{sys.executable}"\n')

    def grain(self, *args, timeout=120):
        return on_host("login", sys.executable, GRAIN, *args, "-c", str(self.cfg),
                       cwd=self.path, timeout=timeout)

    def start_head(self):
        """A head daemon on the login host, once its Edge record is there."""
        self.head_log = open(self.path / "head.log", "w")
        self.head = subprocess.Popen([ON_HOST, "login", sys.executable, GRAIN, "head", "-c",
                                      str(self.cfg)], cwd=self.path, stdout=self.head_log,
                                     stderr=subprocess.STDOUT)
        edge = self.path / "edge"
        wait_for(lambda: edge.exists() and '"lid"' in edge.read_text(), 30, "the head")

    def up(self, n):
        """`up -n N` on the login host: {job id: its log file}."""
        cp = self.grain("up", "-n", str(n))
        assert cp.returncode == 0, cp.stderr
        jobs = dict(re.findall(r"submitted worker job (\S+) \(\S+\); log: (\S+)", cp.stdout))
        assert len(jobs) == n, cp.stdout
        return jobs

    def wait_for_workers(self, n, timeout=90):
        seen = {}

        def joined():
            cp = self.grain("ls", "--json")
            seen.update(json.loads(cp.stdout) if cp.stdout.startswith("{") else {})
            return len(seen.get("workers", ())) >= n

        wait_for(joined, timeout, f"{n} workers in `ls`")
        return seen["workers"]

    def close(self):
        self.grain("stop", timeout=60)  # (a head daemon, ours or a mission's: FIN to the
        self.grain("down", timeout=60)  # workers, so their jobs end)
        for job in cluster_jobs(self.path):  # anything else this test submitted
            on_host("login", "scancel", job)
        if self.head is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.head.wait(timeout=15)
            kill_all([self.head])
            self.head_log.close()


@pytest.fixture
def hosts(tmp_path):
    c = HostCluster(tmp_path)
    yield c
    c.close()


def _node_of(worker):
    m = re.search(r" on (\S+)$", worker["where"])
    return m and m.group(1)


@needs_cluster
def test_up_n_3_on_the_login_host_puts_one_worker_on_each_node_with_its_cores(hosts):
    cores = node_cores()
    hosts.start_head()
    jobs = hosts.up(3)
    workers = hosts.wait_for_workers(3)
    # One worker a node, named <node>-<job id> by the node it runs on, in the job Slurm put
    # there, offering that node's cores (the cores its processes may use), not the machine's.
    placed = {job: node for job, (_, node) in cluster_jobs(hosts.path).items()}
    assert sorted(_node_of(w) for w in workers) == list(NODES), workers
    for w in workers:
        node = _node_of(w)
        assert w["name"] == f"{node}-{w['job_id']}" and w["job_id"] in jobs, w
        assert placed[w["job_id"]] == node and w["cores"][1] == len(cores[node]), (w, cores)
    for log in jobs.values():  # which cores: each worker says them as it registers
        text = open(log).read()
        m = re.search(r"worker (\S+) registered with .*CPU_Cores\(\[([\d, ]*)\]\)", text)
        assert m, text
        assert [int(i) for i in m.group(2).split(",")] == cores[m.group(1).rpartition("-")[0]]
    ls = hosts.grain("ls")
    rows = re.findall(r"^(node\d)-(\S+)\s.*\bpid \d+ on (\S+)\s*$", ls.stdout, re.M)
    assert sorted(r[0] for r in rows) == list(NODES), ls.stdout   # each worker's host
    assert all(name == host and job in jobs for name, job, host in rows), ls.stdout


CLUSTER_MISSION = textwrap.dedent("""
    import json, os, socket, sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores
    from grain import GVAR

    @delayed
    async def where(i):
        await trio.sleep(2)
        return [i, socket.gethostname(), os.environ.get("SLURMD_NODENAME"), GVAR.instance,
                os.environ.get("SLURM_JOB_ID"), sorted(GVAR.res.c)]

    async def main():  # a job takes all of a node's cores: one at a time on each worker
        return await each((where @ Cores({per}))(i) for i in range(6))

    print(json.dumps(run(main, config_file={config!r})), flush=True)
""")


@needs_cluster
def test_a_mission_on_the_login_host_runs_jobs_on_every_node_and_down_ends_them(hosts):
    cores = node_cores()
    hosts.path.joinpath("mission.py").write_text(CLUSTER_MISSION.format(
        here=HERE, per=len(cores["node1"]), config=str(hosts.cfg)))
    # The workers start first and wait in the Edge file: the head the mission starts calls
    # them, and names each by the address that reached it, a node's own, never a loopback
    # one (which, on the login host, is the login host's).
    jobs = hosts.up(3)
    edge = hosts.path / "edge"
    wait_for(lambda: edge.exists() and len(json.loads(edge.read_text() or "{}")
                                           .get("dialer", [])) == 3, 90, "three waiting workers")
    cp = on_host("login", sys.executable, "mission.py", cwd=hosts.path, timeout=180)
    assert cp.returncode == 0, cp.stderr[-3000:]
    results = json.loads(cp.stdout.strip().splitlines()[-1])
    assert [r[0] for r in results] == list(range(6))
    assert {r[1] for r in results} == set(NODES), results
    for i, host, slurm_node, worker, job, job_cores in results:
        assert slurm_node == host and worker == f"{host}-{job}" and job in jobs, results[i]
        assert job_cores == cores[host], (results[i], cores)
    log = next(hosts.path.glob("grain-head-*.log"))   # (beside the Edge file)
    joined = re.findall(r"worker (node\d)-\S+ joined from (\S+)", log.read_text())
    assert sorted(n for n, _ in joined) == list(NODES), joined
    assert not [via for _, via in joined if "127.0.0.1" in via or "unix" in via], joined
    down = hosts.grain("down")
    assert down.returncode == 0, down.stderr
    assert sorted(re.findall(r"cancelled worker job (\S+)", down.stdout)) == sorted(jobs)
    wait_for(lambda: not set(cluster_jobs(hosts.path)) & set(jobs), 60, "the jobs to end")
    assert hosts.grain("down").stdout.strip() == "no job to cancel"


@needs_cluster
def test_a_worker_that_cannot_reach_the_head_names_the_addresses_it_tried(tmp_path):
    # The head's record lists only the login host's first interface, which the nodes
    # cannot reach (and, from another host, its loopback and Unix addresses, never tried).
    port = 40000 + os.getpid() % 20000
    edge = tmp_path / "edge"
    edge.write_text(json.dumps({"listener": {
        "host": "login", "lid": "x", "pid": 1, "heartbeat": time.time() + 600,
        "urls": {"lo": f"tcp://127.0.0.1:{port}", "eth0": f"tcp://10.77.1.1:{port}",
                 "unix": f"unix://{tmp_path}/head.sock"}}, "dialer": []}))
    log = tmp_path / "w.log"
    with open(log, "w") as out:
        w = subprocess.Popen([ON_HOST, "node1", sys.executable, GRAIN, "worker", "--url",
                              f"edge://{edge}", "--reattach", "0"], cwd=tmp_path,
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "does not answer" in log.read_text(), 30, "the worker to say so")
    finally:
        kill_all([w])
    said = [line for line in log.read_text().splitlines() if "does not answer" in line]
    assert len(said) == 1 and f"does not answer at tcp://10.77.1.1:{port} (" in said[0], said
    assert "127.0.0.1" not in said[0] and "unix" not in said[0], said


###############################################################################
# Host ########################################################################
###############################################################################


FAKE_ROCM_SMI = "#!/bin/sh\n" + "".join(  # (echo: a builtin, PATH holds only this)
    f"echo '{line}'\n" for line in [
        "=========== ROCm System Management Interface ===========",
        "====================== PCI Bus ID ======================",
        "GPU[0]\t\t: PCI Bus: 0000:07:00.0", "GPU[1]\t\t: PCI Bus: 0000:0B:00.0",
        "GPU[2]\t\t: PCI Bus: 0000:87:00.0", "GPU[3]\t\t: PCI Bus: 0000:8B:00.0",
        "================== End of ROCm SMI Log =================="])


PLAIN_GPUS = "".join(f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-{i}aaa)\n" for i in range(4))


MIG_GPUS = ("GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0aaa)\n"
            "  MIG 3g.20gb     Device  0: (UUID: MIG-0a)\n"
            "  MIG 3g.20gb     Device  1: (UUID: MIG-0b)\n"
            "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-1aaa)\n")


def fake_gpu_machine(tmp_path, listing):
    """A directory with a fake nvidia-smi (for PATH) and a fake sysfs: GPUs 0-1 on NUMA
    node 0 (cores 0-3), 2-3 on node 1 (cores 4-7)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI.format(listing=listing))
    smi.chmod(0o755)
    sysfs = tmp_path / "sys"
    for bus, node in (("07", 0), ("0b", 0), ("87", 1), ("8b", 1)):
        d = sysfs / "bus/pci/devices" / f"0000:{bus}:00.0"
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{node}\n")
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = sysfs / f"devices/system/node/node{node}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    return bin_dir, sysfs


async def _devices_for_a_while():
    import subprocess
    import time
    from grain import run_program
    started = time.time()
    r = await run_program('echo "$CUDA_VISIBLE_DEVICES"; sleep 1.5', stdout=subprocess.PIPE)
    return r.stdout.decode().strip(), started, time.time()


GPU_MISSION = textwrap.dedent("""
    import json, subprocess, sys
    sys.path.insert(0, {here!r})
    from grain import run_program
    from grain.delayed import delayed, each, run
    from grain.resource import Gpus

    @delayed
    async def devices():
        done = await run_program("echo $CUDA_VISIBLE_DEVICES; sleep 1", stdout=subprocess.PIPE)
        return done.stdout.decode().strip()

    async def main():
        return await each((devices @ Gpus(1))() for _ in range(2))

    print(json.dumps(run(main, config_file={config!r})))
""")


def test_worker_resources_come_from_the_affinity_set():
    allowed = sorted(os.sched_getaffinity(0))
    full = grain.worker_provider()
    assert full.c == allowed and full.M > 0
    assert grain.worker_provider(Cores(1) & Token("gpu")).c == allowed[:1]
    with pytest.raises(grain.UsageError, match="may use only"):
        grain.worker_provider(Cores(len(allowed) + 2))
    over = grain.worker_provider(Cores(len(allowed) + 2), oversubscribe=True)
    assert over.N == len(allowed) + 2 and over.c[:len(allowed)] == allowed
    with pytest.raises(grain.UsageError, match="names cores"):
        grain.worker_provider(Cores([max(allowed) + 5]))


def test_a_worker_finds_its_gpus(tmp_path, monkeypatch):
    bin_dir, sysfs = fake_gpu_machine(tmp_path, PLAIN_GPUS)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = grain.find_gpus(sysfs=str(sysfs))
    assert found.ids == ["0", "1", "2", "3"] and found.vendor == "nvidia"
    assert found.cpus_near(Gpus(["2"])) == {4, 5, 6, 7}
    # the batch system's choice wins (Slurm sets it for --gres)
    found = grain.find_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, sysfs=str(sysfs))
    assert found.ids == ["2", "3"] and found.cpus_near(found) == {4, 5, 6, 7}
    assert grain.find_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None
    # MIG: a partitioned GPU's instances are the devices, by UUID
    bin_dir, sysfs = fake_gpu_machine(tmp_path, MIG_GPUS)
    found = grain.find_gpus(sysfs=str(sysfs))
    assert found.ids == ["MIG-0a", "MIG-0b", "1"]
    assert found.cpus_near(Gpus(["MIG-0b"])) == {0, 1, 2, 3}
    # AMD, when there is no NVIDIA tool: rocm-smi's devices, their NUMA nodes from sysfs
    amd_bin = tmp_path / "amd"
    amd_bin.mkdir()
    (amd_bin / "rocm-smi").write_text(FAKE_ROCM_SMI)
    (amd_bin / "rocm-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(amd_bin))
    found = grain.find_gpus({}, sysfs=str(sysfs))
    assert found.ids == ["0", "1", "2", "3"] and found.vendor == "amd"
    found = grain.find_gpus({"ROCR_VISIBLE_DEVICES": "2,3"}, sysfs=str(sysfs))
    assert found.ids == ["2", "3"] and found.cpus_near(Gpus(["3"])) == {4, 5, 6, 7}
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    found = grain.find_gpus({"ROCR_VISIBLE_DEVICES": "0,1"})
    assert found.ids == ["0", "1"] and found.vendor == "amd"
    assert grain.job_env({}, Gpus(["1"], vendor="amd")) == {"ROCR_VISIBLE_DEVICES": "1"}
    assert grain.find_gpus({}) is None                      # none found: none offered


def test_a_jobs_cores_come_from_its_gpus_numa_node():
    node = Gpus(["0", "1", "2", "3"], near={"0": [0, 1, 2, 3], "1": [0, 1, 2, 3],
                                             "2": [4, 5, 6, 7], "3": [4, 5, 6, 7]}) & Cores(8)
    first = node.alloc(Gpus(2) & Cores(2))
    assert first.ids == ["0", "1"] and first.c == [0, 1]
    second = node.alloc(Cores(1))
    assert second.c == [2]
    third = node.alloc(Gpus(1) & Cores(3))
    assert third.ids == ["2"] and third.c == [4, 5, 6]
    fourth = node.alloc(Gpus(1) & Cores(2))      # one near core left: then the nearest
    assert fourth.ids == ["3"] and fourth.c == [3, 7]


@trio_test
async def test_a_worker_offers_the_gpus_it_finds_and_jobs_share_only_fractions(workers,
                                                                               tmp_path):
    bin_dir, _ = fake_gpu_machine(tmp_path, PLAIN_GPUS)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}', env=env,
                      name="gpu-node")
        await exer.wait_for_workers(1)
        ls = await trio.to_thread.run_sync(lambda: grain_cli("ls", "-a",
                                                          exer.urls["tcp"]).stdout)
        assert re.search(r"^gpu-node\s+1/1\s+\S+ GB\s+4/4\s", ls, re.M), ls
        jobs = [exer.submit(req, _devices_for_a_while)
                for req in (Gpus(1), Gpus(2), Gpus(0.5), Gpus(0.5))]
        (one, _, _), (two, _, _), (half, s1, e1), (other_half, s2, e2) = \
            [await j for j in jobs]
    whole = one.split(",") + two.split(",")
    assert len(whole) == len(set(whole)) == 3                  # whole devices: disjoint
    assert half == other_half and half not in whole            # the halves share one
    assert s2 < e1 and s1 < e2                                 # ... at the same time


@needs_slurm
def test_a_worker_job_with_script_gpus_offers_the_gpus_slurm_gave_it(tmp_path, slurm_cleanup):
    node = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True).stdout
    assert "gpu:4" in node, "the CI Slurm has no stand-in GPUs (.ci/slurm-up.sh): " + node
    cfg = slurm_config(tmp_path, gpus=2, cores=1)
    mission = tmp_path / "mission.py"
    mission.write_text(GPU_MISSION.format(here=HERE, config=str(cfg)))
    head = subprocess.Popen([sys.executable, str(mission)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        up = grain_cli("up", "-c", str(cfg), cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        (job,) = re.findall(r"submitted worker job (\S+) ", up.stdout)
        seen = {}

        def listed():
            seen["ls"] = grain_cli("ls", "-c", str(cfg), cwd=tmp_path).stdout
            return re.search(rf"^\S+-{job}\s+\S+\s+\S+ GB\s+(\S+)\s", seen["ls"], re.M)

        wait_for(listed, 90, "the worker in `ls`")
        assert listed().group(1) in ("2/2", "1/2", "0/2"), seen["ls"]   # two GPUs offered
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err
        slurm = subprocess.run(["scontrol", "show", "job", "-d", job], capture_output=True,
                               text=True).stdout
        given = re.search(r"GRES=gpu(?:\(IDX:|:\d+\(IDX:)([\d,-]+)\)", slurm)
        devices = _json.loads(out.strip().splitlines()[-1])
        assert sorted(devices) == [str(i) for i in grain.parse_ids(given.group(1))], \
            (devices, slurm)                          # one each, of those Slurm gave
        assert grain_cli("stop", "-c", str(cfg), cwd=tmp_path).returncode == 0
    finally:
        head.kill()
        head.wait()


###############################################################################
# Results store ###############################################################
###############################################################################


async def only_its_worker_pickles(head_pid):
    return OnlyItsWorkerPickles(head_pid)


async def _store_resumed_main():
    return await (add1 @ Cores(1))(6)


STORE_MISSION = textwrap.dedent("""
    import json, os, sys, time, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    def note(line):
        fd = os.open({runs!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, line.encode())
        os.close(fd)

    @delayed
    async def work(i):
        note(f"{{i}} run\\n")      # a line per run, and one when it returns
        await trio.sleep(0.005 * (i % 4))
        note(f"{{i}} end {{time.time()}}\\n")
        return i * i + {salt}

    async def main():
        return await each((work @ Cores(1))(i) for i in range(200))

    print(json.dumps(run(main, local=Cores(4), config_file=False, results={store!r})))
""")


@dataclasses.dataclass
class UnhashableJob:   # (a dataclass with eq: not hashable)
    add: int

    async def __call__(self, x):
        return x + self.add


def test_a_job_key_follows_what_it_computes():
    def make(body):
        ns = {}
        exec(textwrap.dedent(f"""
            K = 3
            def helper(x):
                return x + K
            async def job(x, s):
                return helper(x) {body}
        """), ns)
        return ns["job"]

    a, same, edited = make("* 2"), make("* 2"), make("* 3")
    digest = grain.code_digest
    assert digest(a) == digest(same) != digest(edited)
    # what it uses counts too: a helper's body, a constant it reads
    b = make("* 2")
    b.__globals__["K"] = 4
    assert digest(b) != digest(a)
    key = functools.partial(grain.job_key, digest(a))
    args = ((1, {"b", "a", "c"}), {})
    assert key(*args, Cores(1)) == key(*args, Cores(1) & WTime(T=60))  # time limits: no
    assert key(*args, Cores(1)) != key(*args, Cores(2))
    assert key(*args, Cores(1)) != key((2, {"a"}), {}, Cores(1))
    with pytest.raises(TypeError):
        key((lambda: 0,), {}, Cores(1))      # not picklable: no key (the job just runs)
    # sets pickle the same in every process, whatever its string hash seed
    code = ("import sys; sys.path.insert(0, {!r}); import grain; "
            "print(grain.job_key(b'x', ({{'alpha', 'beta', 'gamma', 'delta'}},), {{}}, "
            "grain.Cores(1)), grain.job_key(b'x', ([frozenset({{'alpha', 'beta', 'gamma', "
            "'delta'}})],), {{}}, grain.Cores(1)))").format(HERE)
    keys = {run_py("-c", code, env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout
            for seed in (1, 2, 3)}
    assert len(keys) == 1
    # keys never change between versions (a store's entries would be lost): as made first
    assert grain.job_key(b"x", (1, "a", 2.5), {}, Cores(1)) == \
        "a5d7088c46520ce657dd77c1b97637abd5c3440c"
    assert grain.job_key(b"x", ([1, {"k": (2, None)}],), {}, Cores(2)) == \
        "433c1bc98f9a7aafac92910f0132dd062b9b7bd6"
    assert grain.job_key(b"x", (frozenset({"b", "a"}),), {"n": 3}, Cores(1)) == \
        "34ecdc3174d876ef5c37717afa399a792efd244d"


@pytest.mark.parametrize("skew", [-300, 300])
def test_a_store_held_from_another_host_is_judged_by_the_file_servers_clock(tmp_path,
                                                                          monkeypatch, skew):
    # A holder on another host is alive while its file is touched, by the clock of the
    # file server that touched it: this host's clock running minutes ahead must not take a
    # live store (two missions would write it), nor one running behind keep a dead one.
    path = tmp_path / "r.db"
    grain.ResultStore(path).open().close()
    holder = tmp_path / "r.db.holder"
    holder.write_text(_json.dumps({"host": "elsewhere", "pid": 1, "since": 0}))
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    with pytest.raises(grain.GrainError, match=r"is in use by the mission pid 1 on "
                       "elsewhere"):
        grain.ResultStore(path).open()
    assert holder.exists()
    old = real_time() - 2 * grain.STORE_STALE_S
    os.utime(holder, (old, old))
    store = grain.ResultStore(path).open()
    assert store.crashed and _json.loads(holder.read_text())["host"] == grain.hostname()
    store.close()
    assert sorted(os.listdir(tmp_path)) == ["r.db"]  # (the clock read leaves no file)


def test_a_store_is_held_by_one_mission_and_a_broken_one_is_named(tmp_path, caplog):
    path = tmp_path / "r.db"
    store = grain.ResultStore(path).open()
    try:
        store.record("k1", "f", "done", b"v", duration=1.0)
        store.record("k2", "g", "failed", b"e", "ValueError: no", "raised")
        store.flush()
        with pytest.raises(grain.GrainError) as info:
            grain.ResultStore(path).open()
        assert f"in use by the mission pid {os.getpid()} on {grain.hostname()}" in \
            str(info.value)
        # a mission on another host holding it: by its holder file
        cp = grain_cli("results", str(path))  # reading needs no hold
        assert cp.returncode == 0, cp.stderr
        assert re.search(r"^f\s+done\s+1$", cp.stdout, re.M)
        assert re.search(r"^g\s+failed\s+1$", cp.stdout, re.M)
        assert "2 job(s)" in cp.stdout
    finally:
        store.close()
    assert not (tmp_path / "r.db.holder").exists()
    reopened = grain.ResultStore(path).open()
    assert reopened.states == {"k1": "done", "k2": "failed"} and not reopened.crashed
    reopened.close()
    cp = grain_cli("results", str(path), "--state", "failed")
    assert cp.returncode == 2 and "--state failed goes with --forget" in cp.stderr
    cp = grain_cli("results", str(path), "--forget", "nomatch*")
    assert cp.returncode == 0 and "forgot 0 entries of 'nomatch*': none matches" in cp.stdout
    cp = grain_cli("results", str(path), "--forget", "g*", "--state", "failed")
    assert cp.returncode == 0 and "forgot 1 entry of 'g*' (failed)" in cp.stdout
    assert "g " not in cp.stdout.split("forgot")[1].split("\n", 1)[1]
    # a holder that died (same host, pid gone) is taken over
    (tmp_path / "r.db.holder").write_text(_json.dumps({"host": grain.hostname(),
                                                        "pid": 2 ** 22 + 1, "since": 0}))
    taken = grain.ResultStore(path).open()
    taken.close()
    # ... and then a job it has no entry for may have been running (sent within
    # STORE_FLUSH_S of its death) on any of its workers: held for them (True)
    assert taken.crashed
    results = grain.MissionResults(str(path))
    results.store = taken
    assert results.known(grain.Job(1, Cores(1), len, (), {})) is True
    taken.crashed = False
    assert not results.known(grain.Job(2, Cores(1), len, ("x",), {}))
    # ... but not by a mission no worker can come back to (it listens nowhere)
    (tmp_path / "r.db.holder").write_text(_json.dumps({"host": grain.hostname(),
                                                        "pid": 2 ** 22 + 1, "since": 0}))
    with caplog.at_level(logging.WARNING, logger="grain"):
        assert run(_store_resumed_main, local=Cores(1), address=False, config_file=False,
                   results=str(path)) == 7
    assert "run again: their worker did not come back" not in caplog.text
    # truncated by hand: one line naming it, from run() and from the command line
    data = path.read_bytes()
    path.write_bytes(data[:100])
    with pytest.raises(grain.GrainError) as info:
        grain.ResultStore(path).open()
    assert str(info.value).startswith(f"results store {path} cannot be read") and \
        "\n" not in str(info.value)
    cp = grain_cli("results", str(path))
    assert cp.returncode != 0 and cp.stderr.count("\n") == 1 and str(path) in cp.stderr
    cp = grain_cli("results", str(tmp_path / "none.db"))
    assert cp.returncode == 2 and "none.db: no such file" in cp.stderr
    cp = grain_cli("results", str(tmp_path))
    assert cp.returncode == 2 and "a directory, not a store" in cp.stderr
    other = tmp_path / "other.db"   # somebody's own database: never written into
    with contextlib.closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE samples (x)")
    before = other.read_bytes()
    cp = grain_cli("results", str(other), "--forget", "*")
    assert cp.returncode != 0 and "an SQLite database of something else (its tables: " \
        "samples)" in cp.stderr and other.read_bytes() == before
    # a mission whose store cannot be: the error from run(), without grain's frames
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from grain.delayed import run; "
            "from grain.resource import Cores\nasync def main(): pass\n"
            f"run(main, local=Cores(1), config_file=False, results={str(path)!r})")
    cp = run_py("-c", code)
    last = cp.stderr.strip().splitlines()[-1]
    assert cp.returncode == 1 and last.startswith(f"grain.GrainError: results store {path}")
    assert "trio" not in cp.stderr and cp.stderr.count('File "') <= 3, cp.stderr
    cp = run_py("-c", code.replace(str(path), str(tmp_path / "nodir" / "r.db")))
    assert cp.stderr.strip().splitlines()[-1] == \
        f"grain.GrainError: results store {tmp_path}/nodir/r.db: no directory {tmp_path}/nodir"


def test_the_store_is_a_log_whose_newest_row_counts_and_another_format_is_refused(tmp_path):
    path = tmp_path / "r.db"
    store = grain.ResultStore(path).open()
    store.record("k", "f", "running")
    store.flush()
    store.record("k", "f", "done", b"1")
    store.record("j", "g", "failed", b"e", "ValueError: no", "raised")
    store.flush()
    cp = grain_cli("results", str(path))  # while held: both rows of k are in the file
    assert re.search(r"^f\s+done\s+1$", cp.stdout, re.M) and "running" not in cp.stdout
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:  # closing dropped the older row
        assert db.execute("SELECT key, state FROM results_log ORDER BY key").fetchall() == \
            [("j", "failed"), ("k", "done")]
    # format 1 (one row per key, WITHOUT ROWID), from grain.py's development: refused
    old = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(old)) as db:
        db.execute("CREATE TABLE results (key TEXT PRIMARY KEY, function TEXT, state TEXT, "
                   "value BLOB, error TEXT, kind TEXT, duration REAL, finished REAL) "
                   "WITHOUT ROWID")
        db.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT)")
        db.execute("INSERT INTO meta VALUES ('format', '1')")
        db.execute("INSERT INTO results VALUES ('a#0', 'f', 'done', ?, NULL, NULL, 1, 0)",
                   (grain.dumps_job_value(42, "x"),))
        db.commit()
    cp = grain_cli("results", str(old))
    assert cp.returncode != 0 and "is of format 1 (this grain.py reads 3)" in cp.stderr
    with pytest.raises(grain.GrainError, match="is of format 1"):
        grain.ResultStore(old).open()   # nor does a mission write into it
    assert not os.path.exists(f"{old}.holder")


def test_a_store_of_format_2_is_read_as_it_is_and_a_mission_takes_it_on(tmp_path):
    # a store made before failed entries kept their call: readable, and a mission adds it
    path = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT)")
        db.execute("INSERT INTO meta VALUES ('format', '2')")
        db.execute("CREATE TABLE results_log (key TEXT, function TEXT, state TEXT, value BLOB, "
                   "error TEXT, kind TEXT, duration REAL, finished REAL)")
        db.execute("INSERT INTO results_log VALUES ('a#0', 'f', 'done', 42, NULL, NULL, 1, 0)")
        db.execute("INSERT INTO results_log VALUES ('b#0', 'g', 'failed', NULL, 'ValueError: "
                   "no', 'raised', 1, 0)")
        db.commit()

    def listed():
        cp = grain_cli("results", str(path))
        assert cp.returncode == 0, cp.stderr
        return cp.stdout

    def store_format():
        with contextlib.closing(sqlite3.connect(path)) as db:
            return db.execute("SELECT v FROM meta WHERE k = 'format'").fetchone()[0]

    out = listed()
    assert re.search(r"^f\s+done\s+1$", out, re.M) and "failed: g: ValueError: no\n" in out
    assert store_format() == "2"   # (reading changes nothing)
    store = grain.ResultStore(path).open()
    try:
        assert store.fetch("a#0") == ("done", 42, None, None)
        store.record("c#0", "h", "failed", None, "KeyError: 'x'", "raised", 1.0, "#1 h(1)")
    finally:
        store.close()
    assert store_format() == "3"
    out = listed()
    assert "failed: g: ValueError: no\nfailed: #1 h(1): KeyError: 'x'\n" in out


@trio_test
async def test_the_store_writer_process_writes_and_its_death_costs_no_row(tmp_path):
    path = tmp_path / "r.db"
    store = grain.ResultStore(path).open()
    try:
        store.start_writer()
        proc = store.writer
        await store.send(["a", "f", "done", b"1", None, None, 0.5, None])  # a row's fields
        with contextlib.closing(sqlite3.connect(path)) as db:  # acknowledged: in the file
            assert db.execute("SELECT key FROM results_log").fetchall() == [("a",)]
        # a key left as its material and n (a new store's) is made text there, as here
        await store.send([(b"what it computes", 3), "f", "done", b"1", None, None, 0.5, None])
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("SELECT key FROM results_log WHERE rowid = 2").fetchone() == (
                grain._key_text((b"what it computes", 3)),)
        proc.kill()
        proc.wait()
        await store.send(["b", "f", "done", b"2", None, None, 0.5, None])  # written from here
        assert store.writer is None
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert [k for (k,) in db.execute("SELECT key FROM results_log")] == \
                ["a", grain._key_text((b"what it computes", 3)), "b"]
    finally:
        store.close()


@trio_test
async def test_the_store_writer_survives_the_missions_directory_and_leaves_when_told(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pickle.py").write_text("raise ImportError('a module of the user')\n")
    store = grain.ResultStore(tmp_path / "r.db").open()
    child = None
    try:
        store.start_writer()
        proc = store.writer
        await store.send(["a", "f", "done", b"1", None, None, 0.5, None])
        assert store.writer is proc  # (it would have died importing that pickle.py)
        child = os.fork()  # a process the mission forked holds the writer's input open
        if child == 0:
            time.sleep(60)
            os._exit(0)
    finally:
        store.close()
    try:
        assert proc.returncode == 0  # it left when told, not killed at the time limit
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@trio_test
async def test_a_batch_cut_off_from_its_answer_is_written_once(tmp_path):
    path = tmp_path / "r.db"
    store = grain.ResultStore(path).open()
    row = ["a", "f", "done", b"1", None, None, 0.5, None]
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        try:
            store.start_writer()
            db.execute("BEGIN EXCLUSIVE")  # the writer's commit waits for this
            with trio.move_on_after(0.2):
                await store.send(row)
            store.put_back(row)  # (what keep() does when cancelled)
            db.execute("ROLLBACK")
            with trio.fail_after(10):  # the writer commits it, unacknowledged
                while db.execute("SELECT COUNT(*) FROM results_log").fetchone()[0] == 0:
                    await trio.sleep(0.01)
        finally:
            store.close()  # it is written once more, and the older copy dropped
        assert db.execute("SELECT key FROM results_log").fetchall() == [("a",)]


@trio_test
async def test_a_remote_result_is_stored_as_its_worker_pickled_it(workers, tmp_path):
    store = tmp_path / "r.db"
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0", results=str(store)) as exer:
        workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
        await exer.wait_for_workers(1)
        value = await exer.submit(Cores(1), only_its_worker_pickles, os.getpid())
    assert type(value) is OnlyItsWorkerPickles  # (and the head could not pickle it again)
    with contextlib.closing(sqlite3.connect(store)) as db:
        (data,), = db.execute("SELECT value FROM results_log WHERE state = 'done'")
    assert type(grain.loads_job_value(data)) is OnlyItsWorkerPickles


@trio_test
async def test_a_missions_results_are_stored_before_its_workers_are_let_go(workers, tmp_path,
                                                                          monkeypatch):
    # A mission killed as it ends, after its goodbye: the workers have dropped the results
    # they would have brought to its next run, so these must be in the store already, even
    # one delivered less than a write's interval before the goodbye.
    monkeypatch.setattr(grain, "STORE_FLUSH_S", 3600.0)  # (no periodic write comes first)
    store = tmp_path / "r.db"
    seen = []
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0", results=str(store)) as exer:
        workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
        await exer.wait_for_workers(1)
        goodbye = exer.service.say_goodbye

        async def read_store_then_say_goodbye(abort=False):
            with contextlib.closing(sqlite3.connect(store)) as db:
                seen.extend(db.execute("SELECT state, value FROM results_log").fetchall())
            await goodbye(abort)

        exer.service.say_goodbye = read_store_then_say_goodbye
        assert await exer.submit(Cores(1), _square, 3) == 9
    assert seen == [("done", 9)]


def test_failures_are_stored_and_run_again_unless_asked_not_to(tmp_path, caplog):
    store = tmp_path / "r.db"
    calls = []

    async def flaky(x):
        calls.append(x)
        raise ValueError(f"bad {x}")

    async def main():
        with pytest.raises(ValueError, match="bad 1"):
            await (delayed(flaky) @ Cores(1))(1)

    def last_line():
        return re.findall(r"Time elapsed for all jobs: [\d.]+s; (1 jobs \([^)]*\))",
                          caplog.text)[-1]

    with caplog.at_level(logging.INFO, logger="grain"):
        for _ in range(2):
            run(main, local=Cores(1), config_file=False, results=str(store))
            assert last_line() == "1 jobs (0 done, 1 failed)"
        assert calls == [1, 1]   # stored as failed; run again by default
        calls.clear()
        run(main, local=Cores(1), config_file=False, results=str(store), rerun_failed=False)
        assert calls == []       # rerun_failed=False: the stored error, as raised the first time
        # (the last line says where the result came from: no run of it was timed here)
        assert last_line() == f"1 jobs (0 done, 1 failed; 1 from the results store {store})"


async def energy(xyz, basis="sto-3g"):
    if xyz == "h2o.xyz":
        await grain.run_program("echo 'SCF not converged' >&2; exit 2")
    return len(xyz)


class ReprCounted:
    """An argument that counts how often its repr was asked for."""
    reprs = 0

    def __repr__(self):
        ReprCounted.reprs += 1
        return "ReprCounted()"

    def __len__(self):
        return 3


def test_a_failed_job_is_named_with_its_arguments_in_its_error_store_and_report(tmp_path):
    store, report = tmp_path / "r.db", tmp_path / "r.html"

    async def main():
        ch4, h2o = ((delayed(energy) @ Cores(1))(x, basis="sto-3g") for x in ("ch4", "h2o.xyz"))
        with pytest.raises(grain.ProgramError) as info:
            await h2o
        return await ch4, info.value

    value, error = run(main, local=Cores(1), config_file=False, results=str(store),
                       report=str(report))
    call = "#2 energy('h2o.xyz', basis='sto-3g')"
    assert value == 3 and f"grain: job {call} failed" in error.__notes__
    cp = grain_cli("results", str(store))
    assert cp.returncode == 0, cp.stderr
    assert f"failed: {call}: ProgramError: echo 'SCF not converged' >&2; exit 2 exited with " \
           "status 2; the end of its stderr: SCF not converged\n" in cp.stdout
    assert cp.stdout.count("failed:") == 1   # (the job that was done: not listed)
    assert f"<td>{call}</td><td>raised</td>" in html.unescape(report.read_text())


def test_a_jobs_call_is_short_and_made_only_when_shown(tmp_path):
    job = grain.Job(12, Cores(1), energy, ("h2o.xyz",), {"basis": "sto-3g"})
    assert job.call == "#12 energy('h2o.xyz', basis='sto-3g')"
    path = "/data/" + "x" * 500 + "/h2o.xyz"
    call = grain.Job(3, Cores(1), energy, (path, list(range(10 ** 5))), {"basis": "b" * 90}).call
    assert len(call) == 80 and call.endswith("...")
    assert call.startswith("#3 energy('/data/xxx") and "/h2o.xyz', [0, 1, 2, " in call
    assert grain.Job(4, Cores(1), energy, None, None).call == "#4 energy"  # (args unknown)

    async def main():  # jobs that succeed, with a store: their arguments' repr is not made
        return await each((delayed(energy) @ Cores(1))(ReprCounted()) for _ in range(3))

    async def failing():
        with pytest.raises(grain.ProgramError):
            await (delayed(energy) @ Cores(1))("h2o.xyz", ReprCounted())

    options = dict(local=Cores(1), config_file=False, results=str(tmp_path / "r.db"))
    ReprCounted.reprs = 0
    assert run(main, **options) == [3, 3, 3] and ReprCounted.reprs == 0
    run(failing, **options)
    assert ReprCounted.reprs > 0   # (a failure: it is)


def test_a_job_that_cannot_be_keyed_runs_with_one_warning(tmp_path, caplog):
    async def apply(f, x):
        return f(x)

    async def unhashable():
        return await (delayed(UnhashableJob(1)) @ Cores(1))(1)

    async def main():
        job = delayed(apply) @ Cores(1)
        return [await job(lambda x: x + 1, i) for i in range(3)]

    with caplog.at_level(logging.WARNING, logger="grain"):
        for _ in range(2):
            assert run(main, local=Cores(1), config_file=False,
                       results=str(tmp_path / "r.db")) == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if "cannot be keyed" in r.getMessage()]
    assert len(warnings) == 2 and "apply" in warnings[0]   # once per run, naming it
    assert run(unhashable, local=Cores(1), config_file=False,     # (a function that is
               results=str(tmp_path / "other.db")) == 2           # not hashable: the same)


def test_repeated_identical_calls_keep_their_own_results(tmp_path):
    import random

    async def draw():
        return random.random()

    async def main():
        return await each((delayed(draw) @ Cores(1))() for _ in range(5))

    options = dict(local=Cores(2), config_file=False, results=str(tmp_path / "r.db"))
    first = run(main, **options)
    assert len(set(first)) == 5          # five samples, not one five times
    # a new store's keys are made text in its writer process: the text a rerun looks for
    with contextlib.closing(sqlite3.connect(tmp_path / "r.db")) as db:
        keys = sorted(key for (key,) in db.execute("SELECT key FROM results_log"))
    key = grain.job_key(grain.code_digest(draw), (), {}, Cores(1))
    assert keys == [f"{key}#{n}" for n in range(5)]
    assert run(main, **options) == first  # and the same five, in order, from the store


def test_stored_results_come_back_as_they_were_returned(tmp_path):
    # numbers and texts are kept as SQLite's own values, the rest pickled: each comes back
    # with its type and sign (NaN, a bool, a 65-bit int, -0.0 and a text with a lone
    # surrogate, as os.listdir gives for a file name that is not UTF-8, are the traps)
    values = [3, 2.5, -0.0, float("nan"), float("inf"), True, 2 ** 70, -2 ** 63, "é\x00",
              "\udcff.xyz", b"raw", None, {"e": [1.5]}]
    calls = []

    async def give(i):
        calls.append(i)
        return values[i]

    async def main():
        return await each((delayed(give) @ Cores(1))(i) for i in range(len(values)))

    options = dict(local=Cores(2), config_file=False, results=str(tmp_path / "r.db"))
    first = run(main, **options)
    again = run(main, **options)
    assert sorted(calls) == list(range(len(values)))  # the second run ran nothing
    for got in (first, again):
        assert [(type(v), repr(v)) for v in got] == [(type(v), repr(v)) for v in values]
    with contextlib.closing(sqlite3.connect(tmp_path / "r.db")) as db:
        kinds = {t for (t,) in db.execute("SELECT typeof(value) FROM results_log")}
    assert kinds == {"integer", "real", "text", "blob", "null"}


def test_the_store_from_grain_toml_lives_beside_the_mission_and_run_combine_takes_it(tmp_path):
    (tmp_path / "grain.toml").write_text('results = "campaign.db"\n[head.gnaw]\nenabled = false\n')
    script = tmp_path / "mission.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from grain.combine import run_combine, exec1
        from grain.resource import Cores
        async def double(x):
            print("ran", flush=True)
            return 2 * x
        async def main():
            return await exec1(Cores(1), double, 21)
        print(run_combine(main, rpw=Cores(1), config_file={str(tmp_path / "grain.toml")!r},
                          address=False))
    """))
    outs = [run_py(str(script)) for _ in range(2)]   # (from the repository: not its dir)
    assert [o.returncode for o in outs] == [0, 0], outs[0].stderr
    assert outs[0].stdout.split() == ["ran", "42"] and outs[1].stdout.split() == ["42"]
    assert (tmp_path / "campaign.db").exists() and not (pathlib.Path(HERE) / "campaign.db").exists()


def test_a_mission_killed_at_random_resumes_from_its_store(tmp_path):
    import random
    runs, store = tmp_path / "runs", tmp_path / "campaign.db"
    script = tmp_path / "mission.py"

    def mission(salt):
        script.write_text(STORE_MISSION.format(here=HERE, runs=str(runs), store=str(store),
                                               salt=salt))
        return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def lines():
        return [line.split() for line in runs.read_text().splitlines()] \
            if runs.exists() else []

    def count():
        return sum(1 for line in lines() if line[1] == "run")

    def finish(p):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        return _json.loads(out)

    first, at = mission(1), random.randint(100, 180)
    try:
        wait_for(lambda: count() >= at, 60, f"{at} runs")
    finally:
        killed = time.time()
        first.kill()                          # kill -9
        first.wait()
    ran = count()
    with contextlib.closing(sqlite3.connect(store)) as db:
        stored = db.execute("SELECT COUNT(*) FROM results_log WHERE state = 'done'").fetchone()[0]
    # What the store lacks of the jobs that had returned: those of the last moments only
    # (STORE_FLUSH_S, and the time the last write took)
    ended = {int(line[0]): float(line[2]) for line in lines() if line[1] == "end"}
    unstored = len(ended) - stored
    assert unstored >= 0 and sorted(ended.values())[stored - 1] < killed
    assert all(t > killed - grain.STORE_FLUSH_S - 0.2
               for t in sorted(ended.values())[stored:]), (killed, sorted(ended.values()))
    assert finish(mission(1)) == [i * i + 1 for i in range(200)]
    assert count() == 200 + ran - stored      # only the jobs not stored ran again
    finish(mission(1))
    assert count() == 200 + ran - stored      # all stored now: nothing runs
    assert finish(mission(2)) == [i * i + 2 for i in range(200)]   # an edited body
    assert count() == 400 + ran - stored      # ... is a new key: all of them ran


###############################################################################
# Workers #####################################################################
###############################################################################


CLOUD_SWORKER = textwrap.dedent("""
    # A backendless specialized worker: a service the mission reaches with a client.
    from contextlib import asynccontextmanager
    GRAIN_SWORKER_CONFIG = dict(BACKENDLESS=True)

    @asynccontextmanager
    async def grain_run_sworker():
        yield dict(name="cloud-1", region="eu")

    @asynccontextmanager
    async def grain_context(region):
        yield f"client for {region}"
""")


SERVER_SWORKER = textwrap.dedent("""
    # A specialized worker: its process runs a server; the mission's jobs use a client.
    import os
    from contextlib import asynccontextmanager
    GRAIN_SWORKER_CONFIG = dict()
    MARKS = {marks!r}

    @asynccontextmanager
    async def grain_run_sworker():
        open(MARKS + "-started", "w").write(str(os.getpid()))
        try:
            yield dict(name=f"srv-{{os.getpid()}}", server_pid=os.getpid())
        finally:
            open(MARKS + "-stopped", "w").write(str(os.getpid()))

    @asynccontextmanager
    async def grain_context(server_pid):
        yield f"client of server {{server_pid}}"
""")


async def _who_runs_me():
    await trio.sleep(0)
    return GVAR.instance, GVAR.context, os.getpid()


@trio_test
async def test_a_registered_worker_sending_garbage_is_dropped_not_the_head():
    async with grain.GrainExecutor(rpw=Cores(1)) as exer, trio.open_nursery() as nursery:
        service = grain.HeadService(exer, None, None, max_frame=1000)
        for garbage in [grain.FRAME_HEADER.pack(10 ** 6) + b"x",           # oversized
                        grain.encode_frame(b"not a pickle"),                # undecodable
                        grain.encode_frame(grain.dumps_control(("hack",)))]:  # unknown op
            head_side, fake_side = trio.testing.memory_stream_pair()
            nursery.start_soon(service.handle_connection, head_side, "fake-peer")
            register = ("register", {"name": "bad", "res": Cores([0, 1]), "pid": 1})
            await fake_side.send_all(grain.encode_frame(grain.dumps_control(register)))
            await exer.wait_for_workers(1)
            await fake_side.send_all(garbage)
            await trio.testing.wait_all_tasks_blocked()  # the head has read it, and dropped it
            assert len(exer.workers) == 1
        assert await exer.submit(Cores(1), where_am_i, 5) == (5, os.getpid(), [0], "local")


@trio_test
async def test_a_silent_worker_is_removed_and_its_jobs_requeued(autojump_clock):
    async with grain.GrainExecutor() as exer, trio.open_nursery() as nursery:
        head_side, fake_side = trio.testing.memory_stream_pair()
        service = grain.HeadService(exer, None, None)  # the head's side, on a memory stream
        nursery.start_soon(service.handle_connection, head_side, "fake-peer")
        register = ("register", {"name": "mute", "res": Cores([0, 1]), "pid": 1})
        await fake_side.send_all(grain.encode_frame(grain.dumps_control(register)))
        await exer.wait_for_workers(1)
        t0 = trio.current_time()
        job = exer.submit(Cores(1), where_am_i, 1)
        sent = await _read_messages(grain.FrameStream(fake_side), 3)
        assert [m[0] for m in sent] == ["head", "fn", "run"]  # who it is; and it was sent there
        while exer.workers:                                        # ...which never answers
            await trio.sleep(1)
        assert trio.current_time() - t0 == pytest.approx(grain.SILENT_S, abs=1)
        assert job.state == "queued" and exer.retried_by_class == {"worker lost": 1}
        exer.add_local_worker(Cores(1), "rescue")
        assert (await job)[3] == "rescue"


async def _silent_worker_with_an_alive_file(tmp_path, exer, nursery, service, alive,
                                            reattach=120.0):
    """A worker that registers with ``exer`` (through ``service``) as one touching an alive
    file, is sent a job, then says nothing more: (its stream, the job, the run message)."""
    head_side, fake_side = trio.testing.memory_stream_pair()
    nursery.start_soon(service.handle_connection, head_side, "node1")
    info = {"name": "w1", "res": Cores([0, 1]), "pid": 7, "reattach": reattach, "alive": alive}
    await fake_side.send_all(grain.encode_frame(grain.dumps_control(("register", info))))
    await exer.wait_for_workers(1)
    job = exer.submit(Cores(1), where_am_i, 1)
    sent = await _read_messages(grain.FrameStream(fake_side), 3)
    assert [m[0] for m in sent] == ["head", "fn", "run"]
    return fake_side, job, sent[2]


def _fresh_alive_file(tmp_path):
    """w1's alive file (node1.7) in the alive folder of the Edge file tmp_path/edge, just
    touched."""
    alive = tmp_path / "edge.alive" / "node1.7"
    alive.parent.mkdir()
    alive.touch()
    return alive


def _register_again(service, nursery, exer, resume):
    """w1 registers again, as a worker back with ``resume`` (wire: allocation) does: its
    stream."""
    back, head_side = trio.testing.memory_stream_pair()
    nursery.start_soon(service.handle_connection, head_side, "node1")
    info = {"name": "w1", "res": Cores([0, 1]), "pid": 7, "reattach": 120.0,
            "alive": "node1.7", "head": exer.instance, "resume": resume}
    return back, grain.encode_frame(grain.dumps_control(("register", info)))


@pytest.mark.parametrize("then", ["the result comes", "the worker goes first"])
@trio_test
async def test_a_job_whose_result_a_returning_worker_says_follows_waits_for_it(
        then, autojump_clock):
    # A worker drops its connection while running a job; the head queues the job again.
    # The worker comes back saying the job's result follows (it ended while away): the job
    # waits for it, and is not sent out again meanwhile (to this very worker, under the
    # same wire, the old run's result would be taken for the new run's). If the worker
    # goes before the result came, the job is queued again, and runs elsewhere.
    async with grain.GrainExecutor() as exer, trio.open_nursery() as nursery:
        service = grain.HeadService(exer, None, None)
        head_side, first = trio.testing.memory_stream_pair()
        nursery.start_soon(service.handle_connection, head_side, "node1")
        info = {"name": "w1", "res": Cores([0, 1]), "pid": 7, "reattach": 120.0}
        await first.send_all(grain.encode_frame(grain.dumps_control(("register", info))))
        await exer.wait_for_workers(1)
        job = exer.submit(Cores(1), where_am_i, 1)
        run_msg = (await _read_messages(grain.FrameStream(first), 3))[2]
        await first.aclose()
        while exer.workers:
            await trio.sleep(1)
        assert job.state == "queued" and exer.scheduler.n_queued == 1
        back, hello = _register_again(service, nursery, exer, {run_msg[1]: None})
        await back.send_all(hello)
        await exer.wait_for_workers(1)
        got, frames = [], grain.FrameStream(back)
        with trio.move_on_after(grain.HEARTBEAT_S / 2):  # (before the head's first ping)
            while True:
                got += pickle.loads(await frames.receive())
        assert [m[0] for m in got] == ["head"]     # not sent again: it waits for the result
        assert exer.scheduler.n_queued == 0 and job.state == "queued"
        if then == "the result comes":
            value = grain.dumps_job_value(("ran", "once"), "")
            await back.send_all(grain.encode_frame(grain.dumps_control(
                ("done", run_msg[1], True, value, 1.0))))
            assert await job == ("ran", "once")
        else:
            await back.aclose()
            while exer.workers:
                await trio.sleep(1)
            assert exer.scheduler.n_queued == 1
            exer.add_local_worker(Cores(1), "rescue")
            assert (await job)[3] == "rescue"
        assert exer.retried_by_class == {"worker lost": 1}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("node", ["comes back", "comes back without it", "stops",
                                  "stays cut off"])
@trio_test
async def test_a_worker_silent_but_touching_its_alive_file_keeps_its_jobs(
        node, tmp_path, autojump_clock, caplog):
    # A worker goes silent (its node cut off from the head's network) while its alive file
    # beside the Edge file is still touched: its job is held for it, not run again. It
    # comes back with the job (which is its run), or without it (the job runs again), or
    # its node stops touching the file (gone after all: the job runs again within
    # HEARTBEAT_S), or it stays cut off past its reattach (run again then).
    alive = _fresh_alive_file(tmp_path)
    async with grain.GrainExecutor() as exer, trio.open_nursery() as nursery:
        service = grain.HeadService(exer, f"edge://{tmp_path}/edge", None)
        with caplog.at_level(logging.WARNING, logger="grain"):
            first, job, run_msg = await _silent_worker_with_an_alive_file(
                tmp_path, exer, nursery, service, "node1.7")
            while exer.workers:
                await trio.sleep(1)
            lost = trio.current_time()
            await trio.sleep(grain.HEARTBEAT_S * 3)
            assert job.state != "queued" and exer.retried_by_class == {}   # held
            if node == "comes back":
                back, hello = _register_again(service, nursery, exer, {run_msg[1]: run_msg[4]})
                value = grain.dumps_job_value(("ran", "once"), "")
                await back.send_all(hello + grain.encode_frame(grain.dumps_control(
                    ("done", run_msg[1], True, value, 1.0))))
                assert await job == ("ran", "once") and job.attempts == 1
            elif node == "comes back without it":
                back, hello = _register_again(service, nursery, exer, {})
                await back.send_all(hello)
                t0 = trio.current_time()
                sent = await _read_messages(grain.FrameStream(back), 2)
                while not any(m[0] == "run" for m in sent):   # the job, to run again there
                    sent += await _read_messages(grain.FrameStream(back), 1)
                assert trio.current_time() - t0 <= grain.HEARTBEAT_S * 2
                again = next(m for m in sent if m[0] == "run")
                value = grain.dumps_job_value(("ran", "again"), "")
                await back.send_all(grain.encode_frame(grain.dumps_control(
                    ("done", again[1], True, value, 1.0))))
                assert await job == ("ran", "again") and job.attempts == 2
            elif node == "stops":
                os.utime(alive, (time.time() - 100,) * 2)
                while job.state != "queued":
                    await trio.sleep(1)
                assert trio.current_time() - lost <= grain.HEARTBEAT_S * 4
            else:
                while job.state != "queued":
                    await trio.sleep(1)
                assert trio.current_time() - lost == pytest.approx(120, abs=1)
        said = [r.getMessage() for r in caplog.records]
        assert any(f"worker w1 was lost (silent for 30 s) with 1 job(s) running; its node is "
                   f"up (it still touches {alive}): holding them while it does, 120 s at "
                   "most" in m for m in said), said
        requeued = [m for m in said if "held job(s)" in m]
        assert requeued == [f"worker w1: re-queueing its 1 held job(s): {why}" for why in {
            "comes back": [],
            "comes back without it": ["it came back without them"],
            "stops": [f"{alive} was not touched in the last 15 s"],
            "stays cut off": ["it is not back after 120 s"]}[node]], said
        if node in ("stops", "stays cut off"):
            assert exer.retried_by_class == {"worker lost": 1}
            exer.add_local_worker(Cores(1), "rescue")
            assert (await job)[3] == "rescue" and job.attempts == 2
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_silent_worker_back_already_is_not_held_for(tmp_path, autojump_clock, caplog):
    # The worker saw the silence first and registered again before its old connection
    # fell silent here (it was told to stop the job no one claimed then): the job runs
    # again at once, not held for a worker that is back without it.
    alive = _fresh_alive_file(tmp_path)
    async with grain.GrainExecutor() as exer, trio.open_nursery() as nursery:
        service = grain.HeadService(exer, f"edge://{tmp_path}/edge", None)
        with caplog.at_level(logging.WARNING, logger="grain"):
            _, job, run_msg = await _silent_worker_with_an_alive_file(
                tmp_path, exer, nursery, service, "node1.7")
            await trio.sleep(grain.HEARTBEAT_S)
            back, hello = _register_again(service, nursery, exer, {run_msg[1]: run_msg[4]})
            await back.send_all(hello)

            async def heartbeats():   # (this one is not silent)
                while True:
                    await trio.sleep(grain.HEARTBEAT_S)
                    await back.send_all(grain.encode_frame(grain.dumps_control(("ping",))))
            nursery.start_soon(heartbeats)
            while len(exer.workers) < 2:
                await trio.sleep(0)
            sent = await _read_messages(grain.FrameStream(back), 2)
            assert ("cancel", run_msg[1]) in sent   # (no job claimed it)
            while len(exer.workers) > 1:
                await trio.sleep(1)
            # Queued again, it is the run the worker back reported (it had not stopped it yet)
            value = grain.dumps_job_value(("ran", "there"), "")
            await back.send_all(grain.encode_frame(grain.dumps_control(
                ("done", run_msg[1], True, value, 1.0))))
            assert await job == ("ran", "there")
        assert exer.retried_by_class == {"worker lost": 1}
        assert any("with 1 job(s) running; re-queueing them" in r.getMessage()
                   for r in caplog.records)
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_silent_worker_whose_alive_file_is_stale_or_elsewhere_is_lost_at_once(
        tmp_path, autojump_clock):
    # Its node stopped touching the file (gone): its job runs again at once. A name that is
    # not a file in the head's alive folder (a path elsewhere) is not looked at, nor is the
    # file of a worker whose reattach is not a number of seconds.
    folder = tmp_path / "edge.alive"
    folder.mkdir()
    (tmp_path / "elsewhere").touch()
    os.utime(folder.parent / "elsewhere", (time.time() + 60,) * 2)
    stale = folder / "node1.7"
    stale.touch()
    os.utime(stale, (time.time() - grain.ALIVE_S - 1,) * 2)
    (folder / "fresh.8").touch()
    for alive, reattach in (("node1.7", 120.0), (f"{tmp_path}/elsewhere", 120.0),
                            ("../elsewhere", 120.0), ("fresh.8", "10m")):
        async with grain.GrainExecutor() as exer, trio.open_nursery() as nursery:
            service = grain.HeadService(exer, f"edge://{tmp_path}/edge", None)
            _, job, _ = await _silent_worker_with_an_alive_file(tmp_path, exer, nursery,
                                                                service, alive, reattach)
            while exer.workers:
                await trio.sleep(1)
            assert job.state == "queued" and exer.retried_by_class == {"worker lost": 1}
            exer.add_local_worker(Cores(1), "rescue")
            assert (await job)[3] == "rescue"
            nursery.cancel_scope.cancel()


def test_touched_within_reads_the_age_of_a_file_by_its_file_servers_clock(tmp_path):
    f = tmp_path / "f"
    f.touch()
    assert grain.touched_within(str(f), 5)
    os.utime(f, (time.time() - 10,) * 2)
    assert not grain.touched_within(str(f), 5) and grain.touched_within(str(f), 60)
    assert not grain.touched_within(str(tmp_path / "missing"), 60)


def test_a_backendless_specialized_worker_runs_in_the_mission(tmp_path):
    (tmp_path / "cloud.py").write_text(CLOUD_SWORKER)
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'address = "edge://{tmp_path}/edge"\n[worker]\n'
                   f'specialized_type = "{tmp_path}/cloud.py"\n'
                   'res = { Token = { token = "cloud" } }\n')

    async def main():
        return await (delayed(_who_runs_me) @ Token("cloud"))()

    # No local=: the mission is its own head, as its specialized worker's jobs run here.
    assert run(main, config_file=str(cfg)) == ("cloud-1", "client for eu", os.getpid())
    up = grain_cli("up", "-c", str(cfg))
    assert up.returncode == 0 and "is backendless" in up.stderr
    cfg.write_text(cfg.read_text().replace(f"{tmp_path}/cloud.py", "grain.local_sworker"))
    assert run(main, config_file=str(cfg))[:2] == ("local", None)


def test_a_specialized_worker_keeps_its_server_while_the_mission_runs_its_jobs(
        tmp_path, workers):
    marks = str(tmp_path / "server")
    (tmp_path / "server.py").write_text(SERVER_SWORKER.format(marks=marks))
    edge = f"edge://{tmp_path}/edge"
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'address = "{edge}"\n[worker]\nspecialized_type = "{tmp_path}/server.py"\n')
    dry = grain_cli("up", "--dry", "-c", str(cfg))
    assert f"--sworker {tmp_path}/server.py" in dry.stdout, dry.stderr
    w = workers.start("--url", edge, "--sworker", str(tmp_path / "server.py"), "-r",
                      '{"Token": {"token": "srv"}}', name="ignored")

    async def main():
        return await (delayed(_who_runs_me) @ Token("srv"))()

    instance, context, pid = run(main, config_file=str(cfg))
    server = int(pathlib.Path(marks + "-started").read_text())
    assert (instance, context, pid) == (f"srv-{server}", f"client of server {server}",
                                        os.getpid())
    assert server == w.pid
    w.wait(15)  # FIN at the mission's end: the worker leaves and stops its server
    assert pathlib.Path(marks + "-stopped").read_text() == str(w.pid)


###############################################################################
# Scheduler ###################################################################
###############################################################################


async def _cli(*args):
    return await trio.to_thread.run_sync(lambda: grain_cli(*args))


NODE_RES = ('{"Cores": {"N": 2}, "Token": {"token": "cpu"}, '
            '"WTime": {"T": "0:10:00", "countdown": true}}')


def _job_2_reserves_w():
    p = Policy()
    w = Recorder(Cores([0, 1]), "w")
    p.sched.add_worker(w)
    p.push(1, 1)
    p.push(2, 2)                       # blocked: one core is free
    p.push(3, 1)                       # backfills it
    p.now = grain.RESERVE_AFTER_S
    p.end(3)                           # job 2 has waited long enough: it reserves w
    return p, w


def test_scheduler_backfills_and_reserves_a_worker_for_a_starving_job():
    p = Policy()
    w = Recorder(Cores([0, 1]), "w")
    p.sched.add_worker(w)
    p.push(1, 1)
    p.push(2, 2)          # blocked: one core is free
    p.push(3, 1)          # backfills the free core, ahead of job 2
    assert w.started == [1, 3] and p.sched.n_queued == 1
    p.now = 10.0
    p.end(1)
    p.push(4, 1)          # one core free again: 4 backfills, 2 still waits
    assert w.started == [1, 3, 4]
    p.now = grain.RESERVE_AFTER_S
    p.end(3)              # job 2 has waited long enough: it reserves w...
    p.push(5, 1)          # ...so job 5 does not take the free core
    assert w.started == [1, 3, 4] and w.reserved_for is p.jobs[2]
    p.end(4)
    assert w.started == [1, 3, 4, 2, ] and w.reserved_for is None
    p.end(2)
    assert w.started == [1, 3, 4, 2, 5]


class CountedCores(Cores):
    """Cores that count how often the scheduler asks whether a request fits them."""
    kind = "Cores"
    looks = 0

    def _request(self, req):
        CountedCores.looks += 1
        return super()._request(req)


def test_placement_looks_at_a_few_workers_a_job_not_all_of_them():
    # A thousand workers of 8 cores: filling them, and then each job that ends letting a
    # queued one start, looks at a handful of workers, not at each of the thousand.
    p = Policy()
    ws = [Recorder(CountedCores(list(range(8))), f"w{i}") for i in range(1000)]
    for w in ws:
        p.sched.add_worker(w)
    CountedCores.looks = 0
    for jid in range(10_000):        # 8,000 start, 2,000 wait
        p.push(jid, 1)
    assert p.sched.n_queued == 2000 and CountedCores.looks < 3 * 10_000
    assert all(len(w.started) == 8 for w in ws)
    CountedCores.looks = 0
    order = list(range(8000))
    random.Random(7).shuffle(order)
    for jid in order[:2000]:         # each frees a core somewhere: the oldest waiting takes it
        p.end(jid)
    assert p.sched.n_queued == 0 and CountedCores.looks < 3 * 2000
    assert sorted(j for w in ws for j in w.started[8:]) == list(range(8000, 10_000))
    p.push(10_000, 1)                # nothing free: it waits, after one look
    assert p.sched.n_queued == 1


def test_scheduler_serves_queues_round_robin_and_prioritized_ones_first():
    p = Policy("a", "b", "!urgent")
    w = Recorder(Cores([0]), "w")
    for i in range(1, 4):
        p.push(i, 1, "a")
        p.push(10 + i, 1, "b")
    p.sched.add_worker(w)          # one core: one job at a time
    for _ in range(6):
        if len(w.started) == 3:
            p.push(99, 1, "!urgent")
            pushed_at = len(w.started)
        p.end(w.started[-1])
    order = w.started
    assert sorted(order) == [1, 2, 3, 11, 12, 13, 99]
    assert order[pushed_at] == 99  # a prioritized mission's job starts as soon as it can
    # Neither of the others waits for the other's backlog: each gets a job in before the
    # other's last.
    assert order.index(11) < order.index(3) and order.index(1) < order.index(13)


def test_scheduler_warns_of_a_stuck_queue_then_every_repeat():
    p = Policy()
    p.sched.add_worker(Recorder(Cores([0, 1]) & Memory(4), "small"))
    p.push(1, 16)
    assert p.sched.stuck() == []
    p.now = grain.STUCK_WARN_S
    ((queue, text),) = p.sched.stuck()
    assert "requesting Cores(N=16) has fitted no worker for 60 s; the largest worker " \
           "is small with 2 cores, 4 GB; 1 job(s) queued" in text
    p.now += grain.STUCK_REPEAT_S - 1
    assert p.sched.stuck() == []
    p.now += 1
    assert len(p.sched.stuck()) == 1


@pytest.mark.parametrize("waited_first", [True, False],
                         ids=["it waited for a worker first", "it started at once"])
def test_a_job_queued_again_after_it_ran_waits_from_then(waited_first):
    # Its worker was lost and it is queued again, with no worker to go to: the stuck
    # warning counts from then, not from when it first waited (it ran meanwhile).
    p, w = Policy(), Recorder(Cores([0]), "w")
    if waited_first:
        p.push(1, 1)
        p.now = 50.0
        p.sched.add_worker(w)
    else:
        p.sched.add_worker(w)
        p.push(1, 1)
    assert w.started == [1]
    p.now = 100.0  # it ran until its worker was lost
    p.sched.remove_worker(w)
    p.sched.release(p.jobs[1])
    p.sched.push_front(p.jobs[1])
    p.sched.pump()
    p.now = 100.0 + grain.STUCK_WARN_S - 1
    assert p.sched.stuck() == []
    p.now = 100.0 + grain.STUCK_WARN_S
    ((_, text),) = p.sched.stuck()
    assert text == (f"job #1 None requesting Cores(N=1) has fitted no worker for "
                    f"{grain.STUCK_WARN_S:.0f} s; no worker is connected: the 1 that joined "
                    f"have left; 1 job(s) queued")


def test_a_withdrawn_job_gives_up_its_reservation():
    # a job a worker came back with leaves the queue: the worker it held takes others
    p, w = _job_2_reserves_w()
    p.push(4, 1)
    assert w.started == [1, 3] and w.reserved_for is p.jobs[2]
    assert p.sched.withdraw(p.jobs[2]) and not p.sched.withdraw(p.jobs[2])
    assert w.started == [1, 3, 4] and w.reserved_for is None and p.sched.n_queued == 0


def test_explain_names_the_reservation():
    p, w = _job_2_reserves_w()
    (why,) = p.sched.explain()
    assert why["job"].startswith("#2") and why["waited"] == grain.RESERVE_AFTER_S
    assert why["reason"] == (f"it waited over {grain.RESERVE_AFTER_S:g} s and holds worker w: "
                             "nothing else starts there until it fits (free on w: 1 core, "
                             "no walltime limit)")


def test_explain_says_what_busy_workers_have_free_in_amounts():
    p = Policy()
    p.sched.add_worker(Recorder(Cores([0, 1]) & Memory(8), "w"))
    p.sched.add_worker(Recorder(Cores([0, 1]) & WTime(T=3600), "v"))
    p.push(1, 2)
    p.push(2, 2)
    p.push(3, 1)
    (why,) = p.sched.explain()
    assert why["reason"] == ("all 2 worker(s) large enough are busy: w (1 running; free: 0 "
                             "cores, 8 GB, no walltime limit), v (1 running; free: 0 cores, "
                             "1:00:00 of walltime); the first to free should be #1 None on w "
                             "(running for 0:00:00, no T)")


@trio_test
async def test_queue_waits_for_resources_and_backfills(autojump_clock):
    log = []

    async def job(i, dt):
        log.append(("start", i, trio.current_time(), GVAR.res.c))
        await trio.sleep(dt)

    async with grain.GrainExecutor(rpw=Cores([0, 1])) as exer:
        exer.submit(Cores(2), job, 0, 1.0)
        exer.submit(Cores(1), job, 1, 1.0)
        exer.submit(Cores(2), job, 2, 1.0)   # oldest waiting at t=1: core 1 alone is free
        exer.submit(Cores(1), job, 3, 1.0)   # so this one takes core 1 meanwhile (backfill)
    starts = {i: (t, c) for _, i, t, c in log}
    assert starts[0] == (0.0, [0, 1])
    assert starts[1][0] == 1.0
    assert starts[3][0] == 1.0
    assert starts[2] == (2.0, [0, 1])
    assert trio.current_time() == 3.0


@trio_test
async def test_backfill_never_starves_a_large_job(autojump_clock):
    # Two cores kept busy by a stream of 1-core jobs: every time one ends, the next small
    # job backfills the free core, so the 2-core job never sees both free by chance. After
    # RESERVE_AFTER_S it reserves the worker, which then drains and runs it.
    starts = {}

    async def job(name):
        starts[name] = trio.current_time()
        await trio.sleep(1.0)

    async with grain.GrainExecutor(rpw=Cores(2)) as exer:
        for i in range(2):
            exer.submit(Cores(1), job, f"small{i}")
        exer.submit(Cores(2), job, "big")
        for i in range(2, 100):
            exer.submit(Cores(1), job, f"small{i}")
    assert grain.RESERVE_AFTER_S == 30.0
    assert 30.0 <= starts["big"] <= 31.5
    assert starts["small2"] == 1.0       # small jobs did pass it before that
    assert max(starts.values()) > starts["big"]
    assert trio.current_time() == pytest.approx(51.0)


@trio_test
async def test_stuck_queue_warns_with_the_request_and_largest_worker(autojump_clock, caplog):
    async def job():
        pass

    with caplog.at_level(logging.WARNING, logger="grain"):  # (a worker may join it: it waits)
        async with grain.GrainExecutor(rpw=Cores(2) & Memory(4),
                                       listen="tcp://127.0.0.1:0") as exer:
            j = exer.submit(Node(16, 10), job)
            await trio.sleep(STUCK := grain.STUCK_WARN_S + grain.STUCK_CHECK_S)
            warnings = [r.getMessage() for r in caplog.records]
            assert len(warnings) == 1
            assert "requesting Cores(N=16) & Memory(M=10) has fitted no worker for" in \
                warnings[0]
            assert re.search(r"largest worker is local with \d+ cores, 4 GB;", warnings[0])
            await trio.sleep(grain.STUCK_REPEAT_S - STUCK)   # not repeated before 5 min
            assert len(caplog.records) == 1
            await trio.sleep(STUCK)
            assert len(caplog.records) == 2
            # A worker joins: the job runs and the mission ends.
            exer.add_local_worker(Cores(16) & Memory(64), "big")
            await j


@trio_test
async def test_wtime_group_estimates_are_learned_and_shared(autojump_clock):
    durations = [20, 22, 24, 26, 28, 30, 32, 34]

    async def job(d):
        await trio.sleep(d)
        return GVAR.res.T

    async with grain.GrainExecutor(rpw=Cores(8)) as exer:
        # Runs of 10 s or less teach nothing.
        await exer.submit(Cores(1) & WTime(group="g"), job, 5)
        first = [exer.submit(Cores(1) & WTime(group="g"), job, d) for d in durations]
        for j in first:
            assert await j is None         # no limit before the estimate exists
        T, softT = exer.group_times.limits["g"]
        import statistics
        mean, sd = statistics.mean(durations), statistics.stdev(durations)
        assert T == pytest.approx(mean + 5 * sd) and softT == pytest.approx(mean + 2 * sd)
        assert await exer.submit(Cores(1) & WTime(group="g"), job, 1) == pytest.approx(T)
        with pytest.raises(trio.TooSlowError):
            await exer.submit(Cores(1) & WTime(group="g"), job, 1000)


@trio_test
async def test_without_local_cores_resource_jobs_wait(autojump_clock, caplog):
    async def main():
        return await (add1 @ Cores(1))(1)

    with caplog.at_level(logging.WARNING, logger="grain"):
        with trio.move_on_after(grain.STUCK_WARN_S + 2 * grain.STUCK_CHECK_S):
            await _in_mission(main, local=None)
    assert "no worker has joined yet" in caplog.text


def test_a_job_asking_for_more_gpus_than_any_worker_is_named():
    async def job():
        pass

    async def main():
        with pytest.raises(grain.GrainError) as info:
            await (delayed(job) @ (Cores(1) & Gpus(8)))()
        return str(info.value)

    # a mission no other worker can join (no address): the job fails, it would never run
    said = run(main, local=Cores(2) & Gpus(4), address=False, config_file=False)
    assert said.split(" asks ")[1] == ("Cores(N=1) & Gpus(N=8), more than any worker has (the "
                                       "largest: local with 2 cores, 4 GPUs), and no "
                                       "other worker can join this mission (it listens at no "
                                       "address)")


@trio_test
async def test_explain_says_why_the_oldest_job_waits_with_real_workers(workers, tmp_path):
    # no worker yet, then every worker busy (and which job frees first)
    pidfile = tmp_path / "pids"
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        url = exer.urls["tcp"]
        first = exer.submit(Cores(2) & WTime(T=60), pid_then_sleep, str(pidfile), 3)
        out = (await _cli("explain", "-a", url)).stdout
        assert "#1 pid_then_sleep of local, waiting" in out and \
            out.strip().endswith("no worker has joined yet"), out
        workers.start("--url", url, "--res", NODE_RES, "--oversubscribe", name="node")
        await exer.wait_for_workers(1)
        with trio.fail_after(10):
            while not pidfile.exists():
                await trio.sleep(0.05)
        second = exer.submit(Cores(1), pid_then_sleep, str(pidfile), 0)
        out = (await _cli("explain", "-a", url)).stdout
        assert "#2 pid_then_sleep of local" in out and "all 1 worker(s) large enough are " \
            "busy: node (1 running; free: 0 cores, token 'cpu', 0:" in out, out
        assert re.search(r"the first to free should be #1 pid_then_sleep on node \(running "
                         r"for 0:00:0\d, its T ends in 0:00:5\d\)", out), out
        js = _json.loads((await _cli("ls", "--json", "-a", url)).stdout)
        assert js["head"] and js["workers"][0]["name"] == "node"
        assert js["workers"][0]["cores"] == [0, 2] and js["queued"] == 1
        assert js["waiting"][0]["job"] == "#2 pid_then_sleep"
        assert js["waiting"][0]["reason"].startswith("all 1 worker(s) large enough are busy")
        await first
        await second
    # a token no worker holds; less walltime left than the job's softT; too large
    for request, reason in [
            (Cores(1) & Token("gpu"), "its token 'gpu' matches no worker (their tokens: cpu)"),
            (Cores(1) & WTime(T="1:00:00"), "every worker has less walltime left than its "
                                           "softT 1:00:00: the most is 0:0"),
            (Cores(4), "no worker is large enough: it asks Cores(N=4); the largest is "
                       "node with 2 cores, token 'cpu', 0:")]:
        with trio.CancelScope() as scope:
            async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
                node = workers.start("--url", exer.urls["tcp"], "--res", NODE_RES,
                                     "--oversubscribe", name="node")
                await exer.wait_for_workers(1)
                exer.submit(request, pid_then_sleep, str(pidfile), 0)
                out = (await _cli("explain", "-a", exer.urls["tcp"])).stdout
                assert reason in out, out
                scope.cancel()
        node.kill()


@trio_test
async def test_explain_names_a_reservation_held_on_a_real_worker(workers, tmp_path,
                                                                 monkeypatch):
    # the head is this process: its reservation threshold, shortened; the worker is real
    monkeypatch.setattr(grain, "RESERVE_AFTER_S", 0.2)
    pidfile = tmp_path / "pids"
    with trio.CancelScope() as scope:
        async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
            url = exer.urls["tcp"]
            workers.start("--url", url, "--res", NODE_RES, "--oversubscribe", name="node")
            await exer.wait_for_workers(1)
            short = exer.submit(Cores(1), pid_then_sleep, str(pidfile), 0.5)
            exer.submit(Cores(2), pid_then_sleep, str(pidfile), 0)   # blocked: 1 core free
            exer.submit(Cores(1), pid_then_sleep, str(pidfile), 60)  # backfills that core
            await short  # then the blocked job, waiting for over 0.2 s, reserves node
            with trio.fail_after(10):
                while "holds worker node" not in (out := (await _cli(
                        "explain", "-a", url)).stdout):
                    await trio.sleep(0.05)
            assert "#2 pid_then_sleep of local, waiting" in out, out
            assert "it waited over 0.2 s and holds worker node: nothing else starts there " \
                "until it fits (free on node: 1 core, token 'cpu', 0:" in out, out
            scope.cancel()


###############################################################################
# Head service ################################################################
###############################################################################


async def _gated_job():
    _GATES["running"].set()
    await _GATES["go"].wait()
    return 42


def own_head_mission_killed_then_run_again(tmp_path, workers, unflushed, seconds=3):
    """Two workers that reattach serve a mission that is its own head;
    it is killed (kill -9) while its four jobs run, and run again 1.5 s later. Returns the
    second run's stdout (json) and the runs the jobs recorded, as (job, worker pid)."""
    runs, edge = tmp_path / "runs", f"edge://{tmp_path}/edge"
    script = tmp_path / "mission.py"
    script.write_text(OWN_HEAD_MISSION.format(here=HERE, runs=str(runs), edge=edge,
                                              store=str(tmp_path / "own.db"), seconds=seconds))
    for name in ("w1", "w2"):
        workers.start("--url", edge, "--res", '{"Cores": {"N": 2}}', "--reattach", "2m",
                      name=name)
    first = subprocess.Popen([sys.executable, str(script)] + ["unflushed"] * unflushed,
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: runs.exists() and len(runs.read_text().splitlines()) == 4, 60,
                 "the four jobs to start")
    finally:
        first.kill()
        first.wait()
    time.sleep(1.5)   # (the scenario's pause: the workers notice and wait for a head)
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    # its totals count the jobs it took back (it said "0 jobs")
    assert re.search(r"Time elapsed for all jobs: [\d.]+s; 4 jobs, ", again.stderr), again.stderr
    return again.stdout, sorted(tuple(line.split()) for line in runs.read_text().splitlines())


def test_ls_without_a_head_says_so_first_and_where_the_address_came_from(tmp_path):
    key = tmp_path / "key"
    config = tmp_path / "grain.toml"
    config.write_text(f'auth_key = "{key}"\n[worker]\ncli_dial = "edge://{tmp_path}/cli"\n')
    for made_key in (False, True):   # a fresh home has no key yet; the answer starts alike
        cp = grain_cli("ls", "-a", f"edge://{tmp_path}/edge", "--key", str(key))
        assert cp.returncode == 1 and "Traceback" not in cp.stderr
        first = f"grain.py ls: no head is listening at edge://{tmp_path}/edge (given with -a"
        assert cp.stderr.strip().splitlines()[-1] == first + (
            ")" if made_key else f"; no key file at {key} either: a head makes its key when "
                                 "it starts)")
        for command in ("ls", "explain"):
            cp = grain_cli(command, "-c", str(config))
            assert cp.returncode == 1 and cp.stderr.strip().splitlines()[-1].startswith(
                f"grain.py {command}: no head is listening at edge://{tmp_path}/cli "
                f"(worker.cli_dial in {config}")
        grain.load_auth_key(str(key))


def test_ls_and_a_worker_say_the_head_holds_another_key_and_which_file_to_copy(tmp_path,
                                                                                workers):
    # A head in one home; `ls` and a worker in another, whose key differs. Neither is told
    # that no head listens: `ls` fails with one line naming both key files; the worker says
    # it once, waits for a head that holds its key (no call to the other head, no logs of
    # its refusals) and serves the one that comes.
    edge = f"edge://{tmp_path}/edge"
    env = {h: dict(os.environ, HOME=str(tmp_path / h)) for h in ("a", "b")}
    key = {h: str(tmp_path / h / ".local/share/grain/key") for h in env}
    grain.load_auth_key(key["b"])   # (the head makes its own; `ls` makes none)
    heads = []

    def head(home):
        heads.append(subprocess.Popen([sys.executable, GRAIN, "head", "--no-config", "-a", edge],
                                      env=env[home], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        record = tmp_path / "edge"
        wait_for(lambda: record.exists() and f'"pid": {heads[-1].pid},' in record.read_text(),
                 30, f"the head of home {home} to listen")

    try:
        head("a")
        said = f"the head at {edge} holds another key: copy {key['a']} to {key['b']}"
        ls = grain_cli("ls", "-a", edge, env=env["b"])
        assert ls.returncode == 1 and ls.stderr.splitlines()[-1] == f"grain.py ls: {said}"
        w = workers.start("--url", edge, "--res", '{"Cores": {"N": 1}}', name="b", env=env["b"])
        wait_for(lambda: said in w.log_path.read_text(), 30, "the worker to say why")
        heads[0].terminate()
        heads[0].wait(15)
        head("b")
        wait_for(lambda: "registered" in w.log_path.read_text(), 30, "the worker to join")
        ls = grain_cli("ls", "-a", edge, env=env["b"])
        assert ls.returncode == 0 and "\nb " in ls.stdout
    finally:
        for p in heads:   # (stopped, not killed: a head takes its socket files along)
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
        kill_all(heads)
    log = w.log_path.read_text()
    assert log.count(said) == 1 and "refused" not in log and "does not answer" not in log, log


@trio_test
async def test_a_head_with_another_key_is_named_with_the_key_files(tmp_path):
    # A head at a tcp:// address records no key file: the message says whose to copy. One
    # at an Edge file, whose key file here was made again after it started, is to restart.
    here = grain.load_auth_key(str(tmp_path / "here" / "key"))
    there = grain.load_auth_key(str(tmp_path / "there" / "key"))
    edge = f"edge://{tmp_path}/edge"

    async def nothing(stream, peer):
        pass

    async with trio.open_nursery() as nursery:
        tcp = (await nursery.start(grain.serve, "tcp://127.0.0.1:0", there, nothing))["tcp"]
        await nursery.start(grain.serve, edge, there, nothing)
        with pytest.raises(grain.KeyMismatch) as info:
            await grain.connect(tcp, here)
        assert isinstance(info.value, grain.Unreachable)   # (to those who wait for a head)
        assert str(info.value) == (f"the head at {tcp} holds another key: copy the head's key "
                                   f"file to {here.path}")
        os.unlink(there.path)
        with pytest.raises(grain.KeyMismatch) as info:
            await grain.connect(edge, grain.load_auth_key(there.path))
        assert str(info.value) == (f"the head at {edge} holds another key: {there.path} was "
                                   "made again after the head started: restart the head")
        nursery.cancel_scope.cancel()


@trio_test
async def test_ls_and_quit_against_a_live_head(workers, tmp_path):
    pidfile = tmp_path / "pids"
    async with grain.GrainExecutor(rpw=Cores(1), listen="tcp://127.0.0.1:0") as exer:
        url = exer.urls["tcp"]
        a = workers.start("--url", url, "--res", '{"Cores": {"N": 1}, "Memory": {"M": 2}}',
                          name="node-a")
        b = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="node-b")
        await exer.wait_for_workers(2)
        # (the jobs run until told: a slow `ls` on a busy machine must not see them end)
        release = tmp_path / "release"
        jobs = [exer.submit(Cores(1), pid_then_wait, str(pidfile), str(release))
                for _ in range(3)]
        with trio.fail_after(10):
            while len(pidfile.read_text().split() if pidfile.exists() else []) < 3:
                await trio.sleep(0.05)
        cp = await trio.to_thread.run_sync(lambda: grain_cli("ls", "-a", url))
        assert cp.returncode == 0, cp.stderr
        out = cp.stdout
        assert re.search(r"^node-a\s+0/1\s+2/2 GB\s+-\s+1\s+up\s+pid \d+", out, re.M), out
        assert re.search(r"^node-b\s+0/1\s+", out, re.M)
        assert re.search(r"^local\s+0/1\s+", out, re.M)
        assert re.search(r"^TOTAL\s+0/3\s+.*3\s+3 worker\(s\)", out, re.M)
        assert "jobs: 0 queued, 3 running, 0 done, 0 failed, 0 retried" in out
        formatted = grain.format_ls(dict(exer.service.stats(), failed=3,
                                         failed_by_class={"raised": 2, "ran past its T": 1}))
        assert "3 failed (raised: 2, ran past its T: 1), 0 retried" in formatted
        # quit without -f: node-a finishes its job, then leaves.
        cp = await trio.to_thread.run_sync(lambda: grain_cli("quit", "-a", url, "node-a"))
        assert "node-a: takes no new jobs; leaves after its 1 running job(s)" in cp.stdout
        # quit -f: node-b leaves now; its job is re-queued and runs elsewhere.
        cp = await trio.to_thread.run_sync(lambda: grain_cli("quit", "-f", "-a", url,
                                                          "node-b"))
        assert "node-b: leaving now" in cp.stdout
        assert await wait_exit(b) == 0
        release.touch()
        pids = [await j for j in jobs]
        assert pids.count(a.pid) == 1 and b.pid not in pids and pids.count(os.getpid()) == 2
        assert exer.retried_by_class == {"worker retired": 1}
        assert await wait_exit(a) == 0
        cp = await trio.to_thread.run_sync(lambda: grain_cli("quit", "-a", url, "nobody*"))
        assert "no worker matches 'nobody*'" in cp.stdout and cp.returncode == 1


@trio_test
async def test_a_malformed_registration_is_refused_and_costs_no_job():
    mission = grain.MissionQueue(_FakeChannel(), {"name": "m", "token": "T"})
    daemon = grain.HeadDaemon("tcp://127.0.0.1:0", b"k" * 32)
    daemon.scheduler.add_queue(mission)
    job = grain.Job(1, Cores(1), None, None, None, mission)
    job.ref, job.wire = 1, "T/1"
    assert daemon.reunion.offer(job, hold=True)   # held for its worker, which comes back...
    for info in [{"name": "w", "res": Cores(4), "resume": {"T/1": Cores([0]), "T/2": 5}},
                 ["not", "a", "dict"], {"name": "w", "res": 4},
                 {"name": "w", "res": Cores(1), "resume": [1]}]:
        head_side, fake_side = trio.testing.memory_stream_pair()
        await fake_side.send_all(grain.encode_frame(grain.dumps_control(("register", info))))
        await daemon.service.handle_connection(head_side, "fake-peer")  # returns: dropped
    # ...saying nonsense of another job: the one it had was adopted, then given back
    assert job.state == "queued" and list(mission.jobs) == [job] and not daemon.scheduler.workers
    # a failure that is not an exception and its traceback: an error, not a crash
    for sent in [(1, 2, 3), (1, "a traceback")]:
        value, error = grain.unpickle_result(job, False, grain.dumps_job_value(sent, ""))
        assert value is None and "could not be unpickled" in str(error)


@trio_test
async def test_a_worker_is_named_to_the_next_head_only_if_it_may_come_back(autojump_clock):
    # The "running" entries of a mission's store name the worker of each job, and a run
    # after a crash holds those jobs for it. A worker that waits for a new head when its
    # head dies (worker.reattach) is named; one that does not (--reattach 0, a passive
    # worker) is not: no job waits for it.
    daemon = grain.HeadDaemon("tcp://127.0.0.1:0", b"k" * 32)
    async with trio.open_nursery() as nursery:
        for reattach, ident in [(600.0, "w (pid 7 on h)"), (0.0, None)]:
            head_side, worker_side = trio.testing.memory_stream_pair()
            nursery.start_soon(daemon.service.handle_connection, head_side, "fake-peer")
            info = {"name": "w", "res": Cores(1), "pid": 7, "host": "h", "reattach": reattach}
            await worker_side.send_all(grain.encode_frame(grain.dumps_control(("register",
                                                                                info))))
            await trio.testing.wait_all_tasks_blocked()
            assert [w.ident for w in daemon.scheduler.workers] == [ident]
            await worker_side.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert not daemon.scheduler.workers


def test_the_next_run_knows_the_workers_a_dead_run_sent_jobs_to_before_their_entries(
        tmp_path):
    # A mission dies within STORE_FLUSH_S of sending jobs to a worker: those jobs have no
    # "running" entry yet, but the holder file named the worker before they went, so the
    # next run holds them for it (else it ran them again while that worker came back
    # with the first run's results).
    first = grain.ResultStore(str(tmp_path / "s.db"))
    first.open()
    first.add_worker("w1 (pid 7 on h)")
    first.add_worker("w2 (pid 8 on h)")
    holder = json.loads(pathlib.Path(first.holder).read_text())
    assert holder["pid"] == os.getpid() and holder["workers"] == ["w1 (pid 7 on h)",
                                                                 "w2 (pid 8 on h)"]
    dead = subprocess.Popen(["true"])
    dead.wait()
    pathlib.Path(first.holder).write_text(json.dumps(dict(holder, pid=dead.pid)))
    first.held = False   # (it "died": its holder file stays)
    first.close()
    again = grain.ResultStore(str(tmp_path / "s.db"))
    again.open()
    try:
        assert again.crashed and again.last_workers == {"w1 (pid 7 on h)", "w2 (pid 8 on h)"}
        assert json.loads(pathlib.Path(again.holder).read_text())["workers"] == []
    finally:
        again.close()


@trio_test
async def test_a_result_that_ends_as_the_head_goes_reaches_the_next_head(autojump_clock):
    # The job ends just as the head's connection closes: before or after the worker sees
    # it close (trio runs the two in either order). Either way the next head gets it.
    for _ in range(8):
        _GATES.update(running=trio.Event(), go=trio.Event())
        heads = trio.open_memory_channel(1)

        async def reconnect():
            worker_side, head_side = trio.testing.memory_stream_pair()
            await heads[0].send(head_side)
            return worker_side

        worker = grain.WorkerProcess("w", {"name": "w"}, reattach=60.0)
        worker_side, head1 = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.serve, worker_side, Cores([0, 1]), reconnect)
            assert (await _read_messages(grain.FrameStream(head1), 1))[0][0] == "register"
            for msg in (("fn", "d", grain.dumps_job_value(_gated_job, "")),
                        ("run", "key#0", "d", grain.NO_ARGS_PAYLOAD, Cores([0]), None)):
                await head1.send_all(grain.encode_frame(grain.dumps_control(msg)))
            await _GATES["running"].wait()
            await head1.aclose()   # the head goes...
            _GATES["go"].set()     # ...as the job ends
            got = [m[:3] for m in await _read_messages(grain.FrameStream(await heads[1].receive()), 2)]
            assert got[0][0] == "register" and got[1] == ("done", "key#0", True)
            nursery.cancel_scope.cancel()


@trio_test
async def test_a_failure_a_returning_worker_reported_is_retried_at_once(autojump_clock):
    # A worker came back with a temporary failure of a job that waits in no queue (it was
    # held): its retry is queued, and starts on the idle worker there and then. (It hung:
    # a retry was queued without a look at the workers.)
    async def work():
        return "ok"

    async with grain.GrainExecutor(temporary_err=ConnectionResetError) as exer:
        job = exer.submit(Cores(1), work)
        assert exer.scheduler.withdraw(job)   # (as the reunion holds it)
        exer.add_local_worker(Cores(1), "w")
        exer.reported(job, False, grain.pickled_failure(ConnectionResetError("once")), 1.0,
                     "raised")
        with trio.fail_after(1):
            assert await job == "ok"
        assert job.attempts == 2 and exer.retried_by_class == {grain.RETRY_TEMPORARY: 1}


@trio_test
async def test_held_jobs_run_again_and_unclaimed_ones_are_cancelled(autojump_clock):
    pushed = []
    reunion = grain.Reunion(None, clock=trio.current_time)
    w = _returning_worker()
    j = grain.Job(1, Cores(1), None, (), {}, grain.JobQueue("m"))
    j.wire = "held"
    assert reunion.offer(j, hold=True)
    reunion.worker_runs(w, "nobody's", Cores([0]))
    async with trio.open_nursery() as nursery:
        reunion.push = pushed.append
        nursery.start_soon(grain.keep_reunion, reunion)
        await trio.sleep(grain.REJOIN_WAIT_S + 0.1)
        assert pushed == [j]                    # its worker did not come back: run again
        assert w.channel.sent == []
        await trio.sleep(grain.ORPHAN_WAIT_S * 1.2)
        assert w.channel.sent == [("cancel", "nobody's")]   # no mission claimed it
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_worker_back_after_the_hold_still_gets_its_job_if_it_waits(autojump_clock):
    sched = grain.Scheduler(clock=trio.current_time)
    queue = grain.JobQueue("m")
    sched.add_queue(queue)
    delivered = []
    reunion = grain.Reunion(lambda job, *result: delivered.append((job.wire, result)),
                            clock=trio.current_time, claim=sched.claim)
    jobs = []
    for wire in ("late", "done late", "started"):
        j = grain.Job(wire, Cores(1), None, (), {})
        j.wire, j.queue = wire, queue
        assert reunion.offer(j, hold=True)
        jobs.append(j)
    async with trio.open_nursery() as nursery:
        reunion.push = sched.push
        nursery.start_soon(grain.keep_reunion, reunion)
        await trio.sleep(grain.REJOIN_WAIT_S + 0.1)
        assert list(queue.jobs) == jobs and sched.n_queued == 3  # held in vain: queued
        sched.withdraw(jobs[2])                  # (as if it had started elsewhere)
        w = _returning_worker()
        reunion.worker_runs(w, "late", Cores([0]))         # back late, its job still waits
        reunion.worker_finished("done late", (True, b"v", 1.0, None))
        reunion.worker_runs(w, "started", Cores([1]))      # too late: it runs elsewhere
        assert jobs[0].worker is w and jobs[0].state == "running" and w.jobs["late"] is jobs[0]
        assert delivered == [("done late", (True, b"v", 1.0, None))]
        assert not queue.jobs and sched.n_queued == 0
        assert "started" in w.orphans and "started" not in w.jobs
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_failure_a_returning_worker_reports_yields_to_a_success_from_another(
        autojump_clock):
    # The last head retried a job that failed with a temporary error on worker A; the retry
    # succeeded on worker B; then the head died. Both come back to the next head, A with
    # the old failure: the success must win, whichever comes first (seed 21, again), and a
    # failure no success contradicts is delivered when the hold ends.
    delivered = []
    reunion = grain.Reunion(lambda job, *result: delivered.append((job.wire, result[0])),
                            clock=trio.current_time)
    jobs = {}
    for wire in ("retried", "failed"):
        jobs[wire] = j = grain.Job(wire, Cores(1), None, (), {})
        j.wire = wire
        assert reunion.offer(j, hold=True)
    async with trio.open_nursery() as nursery:
        reunion.push = lambda job: None
        nursery.start_soon(grain.keep_reunion, reunion)
        reunion.worker_finished("retried", (False, b"flaky", 0.1, None))   # A, first
        reunion.worker_finished("failed", (False, b"error", 0.1, None))
        assert delivered == []
        reunion.worker_finished("retried", (True, b"0", 0.2, None))        # B
        assert delivered == [("retried", True)]
        await trio.sleep(grain.REJOIN_WAIT_S + 0.1)
        assert delivered == [("retried", True), ("failed", False)]
        nursery.cancel_scope.cancel()


def test_a_job_a_returning_worker_still_runs_is_adopted_not_started_twice():
    sched = grain.Scheduler()
    queue = grain.JobQueue("m")
    sched.add_queue(queue)
    reunion = grain.Reunion(None)
    w = _returning_worker(2)
    _head_of(w, sched, reunion, job_sent=lambda job: None,
             function_bytes=lambda fn: ("d", b""))
    reunion.worker_runs(w, "a", Cores([1]))     # back with "a", which no job claimed yet
    sched.add_worker(w)
    job = grain.Job("a", Cores(1), None, (), {}, queue)
    job.wire = "a"
    sched.push(job)                            # "a" was queued again meanwhile
    assert job.worker is w and w.jobs == {"a": job} and job.alloc.c == [1]
    assert not [m for m in w.channel.sent if m[0] == "run"]   # not run a second time
    assert w.res.c == [0] and w.running == 1 and "a" not in reunion.running  # not cancelled


def test_a_new_head_matches_jobs_to_the_workers_that_come_back():
    now = [0.0]
    delivered, pushed = [], []
    reunion = grain.Reunion(lambda job, *result: delivered.append((job.wire, result)),
                            clock=lambda: now[0])

    def job(wire, cores=1):
        j = grain.Job(wire, Cores(cores), None, (), {})
        j.wire = wire
        return j

    w = _returning_worker()
    # it comes back running "a" (cores 0, 1) and "orphan", and with a result for "b"
    reunion.worker_runs(w, "a", Cores([0, 1]))
    reunion.worker_runs(w, "orphan", Cores([2]))
    reunion.worker_runs(w, 7, Cores([3]))        # an old head's number: cancelled at once
    assert w.channel.sent == [("cancel", 7)] and w.res.N == 0 and w.running == 3
    reunion.worker_finished("b", (True, b"v", 1.0, None))
    a, b, c = job("a", 2), job("b"), job("c")
    assert reunion.offer(a) and a.worker is w and a.state == "running" and w.jobs["a"] is a
    assert reunion.offer(b) and delivered == [("b", (True, b"v", 1.0, None))]
    assert reunion.offer(c, hold=True) and "c" in reunion.held   # its worker may come yet
    assert not reunion.offer(job("d"))                            # never ran: queue it
    # "a" ends as any job would; the cancelled one comes back as cancelled
    pumps = []
    _head_of(w, types.SimpleNamespace(pump=lambda: pumps.append(1), grew=pumps.append),
             reunion, job_reported=lambda *a: None)
    w.on_cancelled(7)
    assert w.res.N == 1 and w.running == 2 and pumps == [w, 1]  # freed cores take queued jobs
    now[0] = grain.REJOIN_WAIT_S + 1
    assert not reunion.offer(job("e"), hold=True)                 # too late to hold


def test_a_run_no_head_can_claim_is_stopped_at_any_worker_that_comes_back_with_it():
    # The old head's own number names no job here: the run is stopped at once, whether a
    # remote worker or a specialized one (which runs no job of its own) claims to run it.
    for w in (_returning_worker(), grain.SpecializedWorker(
            None, Cores([0, 1]), "sw", None, None, _FakeChannel(), 7, "host", None)):
        reunion = grain.Reunion(None)
        reunion.worker_runs(w, 5, Cores([0]))
        assert w.channel.sent == [("cancel", 5)] and w.orphans == {5: Cores([0])}, w


def test_a_worker_that_comes_back_after_its_job_was_queued_unheld_finds_it():
    # A mission killed within STORE_FLUSH_S of sending its jobs left
    # no "running" entry, so the next run queued them unheld; then their workers came back
    # running them. The reports must find the queued jobs; and when a job a worker came
    # back with ends, its cores must take the next queued job.
    sched = grain.Scheduler()
    queue = grain.JobQueue("m")
    sched.add_queue(queue)
    delivered = []
    reunion = grain.Reunion(lambda job, *result: delivered.append((job.wire, result)),
                            claim=sched.claim)
    jobs = {}
    for wire in ("runs", "ended", "next"):
        jobs[wire] = j = grain.Job(wire, Cores(1), None, (), {}, queue)
        j.wire = wire
        assert not reunion.offer(j)   # no entry, too late to hold: queued
        sched.push(j)
    assert sched.n_queued == 3
    w = _returning_worker(cores=2)
    _head_of(w, sched, reunion)
    started = []
    w.start = started.append
    # as a registration: the jobs it runs first, then it joins the scheduler
    reunion.worker_runs(w, "runs", Cores([0]))
    assert jobs["runs"].worker is w and w.jobs["runs"] is jobs["runs"]
    reunion.worker_runs(w, "gone", Cores([1]))   # (a job no one here has: an orphan)
    sched.add_worker(w)
    reunion.worker_finished("ended", (True, b"v", 1.0, None))
    assert delivered == [("ended", (True, b"v", 1.0, None))]
    assert list(queue.jobs) == [jobs["next"]] and sched.n_queued == 1 and started == []
    w.on_done("gone", True, b"w", 1.0)   # the orphan ends: its core takes "next"
    assert started == [jobs["next"]] and sched.n_queued == 0
    assert reunion.finished["gone"][0] == (True, b"w", 1.0, None)


@pytest.mark.parametrize("back_first", [False, True], ids=["back-after-the-rerun-starts",
                                                          "back-before-the-rerun-starts"])
@trio_test
async def test_a_new_head_holds_a_job_only_while_its_worker_may_come_back(autojump_clock,
                                                                         caplog, back_first):
    # A mission that was its own head died: worker wr still runs "runs", ran "ended" while
    # alone, and lost "lost", which its store entry says ran there; "local" has no entry
    # (it ran in the mission's own process, which died with it, or it was queued); "new"
    # never ran. Run again, it holds only what wr may come back with, and only until wr
    # comes back, before its jobs are offered or after: the rest start then, not
    # REJOIN_WAIT_S later, and nothing warns that a worker did not come back.
    sched = grain.Scheduler(clock=trio.current_time)
    queue = grain.JobQueue("m")
    sched.add_queue(queue)
    delivered, pushed = [], []
    reunion = grain.Reunion(lambda job, *result: delivered.append(job.wire),
                            clock=trio.current_time, claim=sched.claim)
    reunion.expected = {"wr"}   # (the workers the store's "running" entries name)
    w = _returning_worker()
    jobs = {}

    def wr_comes_back():
        reunion.worker_runs(w, "runs", Cores([0]))
        reunion.worker_back("wr", {"runs": Cores([0]), "ended": None})  # (None: result follows)

    def push(job):
        pushed.append((trio.current_time() - t0, job.wire))
        sched.push(job)

    with caplog.at_level(logging.WARNING, logger="grain"):
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            reunion.push = push
            nursery.start_soon(grain.keep_reunion, reunion)
            await trio.sleep(1)
            if back_first:
                wr_comes_back()
            for wire, hold in [("runs", "wr"), ("ended", "wr"), ("lost", "wr"),
                               ("local", True), ("new", False)]:
                jobs[wire] = job = grain.Job(wire, Cores(1), None, (), {}, queue)
                job.wire = wire
                if not reunion.offer(job, hold):
                    sched.push(job)
            await trio.sleep(1)
            if not back_first:
                wr_comes_back()
            reunion.worker_finished("ended", (True, b"v", 1.0, None))   # (what followed)
            await trio.sleep(grain.REJOIN_WAIT_S)
            nursery.cancel_scope.cancel()
    assert jobs["runs"].worker is w and delivered == ["ended"]    # found, not run again
    assert sorted(job.wire for job in queue.jobs) == ["local", "lost", "new"]
    assert pushed == ([] if back_first else [(2, "lost"), (2, "local")])   # not at 10 s
    assert not reunion.held and not caplog.records


@trio_test
async def test_a_new_head_warns_of_the_jobs_whose_worker_did_not_come_back_only(
        autojump_clock, caplog):
    # Of the two workers the last head had, wr comes back (without the job it ran) and
    # gone never does: its job waits REJOIN_WAIT_S for it, as does one without an entry
    # (the last head may have sent it to gone just before it died). The warning names
    # gone, counts the job that ran there, says the other may have, and never names wr.
    queue = grain.JobQueue("m")
    reunion = grain.Reunion(None, clock=trio.current_time)
    reunion.expected = {"wr", "gone"}
    pushed = []
    with caplog.at_level(logging.WARNING, logger="grain"):
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            reunion.push = lambda job: pushed.append((trio.current_time() - t0, job.wire))
            nursery.start_soon(grain.keep_reunion, reunion)
            for wire, hold in [("on wr", "wr"), ("on gone", "gone"), ("no entry", True)]:
                job = grain.Job(wire, Cores(1), None, (), {}, queue)
                job.wire = wire
                assert reunion.offer(job, hold)
            await trio.sleep(2)
            reunion.worker_back("wr", {})
            await trio.sleep(grain.REJOIN_WAIT_S)
            nursery.cancel_scope.cancel()
    assert pushed == [(2, "on wr"), (10, "on gone"), (10, "no entry")]
    assert [r.getMessage() for r in caplog.records] == [
        "1 job(s) that were running on gone when the last head went run again: no worker "
        "came back with them within 10 s",
        "1 job(s) that may have been running when the last head went run again: no worker "
        "came back with them within 10 s"]


@pytest.mark.parametrize("unflushed", [True, False], ids=["before-the-store-wrote",
                                                          "after-the-store-wrote"])
def test_a_mission_its_own_head_killed_and_run_again_takes_its_jobs_back(tmp_path, workers,
                                                                        unflushed):
    # It hung for ever when the kill came before the store wrote the jobs' "running"
    # entries: its jobs were queued, and their workers' reports found nothing.
    out, ran = own_head_mission_killed_then_run_again(tmp_path, workers, unflushed)
    assert _json.loads(out) == [0, 1, 4, 9]
    assert [job for job, _ in ran] == ["0", "1", "2", "3"]   # each ran once, in all


RESUMED_MISSION = textwrap.dedent("""
    import json, os, sys, time, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def work(i):
        with open({runs!r}, "a") as f:   # a line a run of a job: which, where, when
            f.write(f"{{i}} {{os.getpid()}} {{time.time()}}\\n")
        await trio.sleep(3)
        return i

    async def main():
        print(time.time(), flush=True)   # from now on its jobs may start
        return await each((work @ Cores(1))(i) for i in range(8))

    print(json.dumps(run(main, local=Cores(2), address={edge!r}, results={store!r},
                         config_file=False)))
""")


def test_a_mission_its_own_head_run_again_starts_at_once_what_no_worker_comes_back_with(
        tmp_path, workers):
    """kill -9 of a mission that is its own head, with 2 cores of its own, worker wr's 2
    and a store, while 4 of its 8 jobs run; run again, it holds wr's 2 for wr, which
    comes back with them, and starts the others without waiting REJOIN_WAIT_S: the 2 that
    ran in its own process (they died with it) and the 4 that were queued. (All 6 waited
    10 s, and a warning said their worker did not come back, though wr had.)"""
    runs, edge, store = tmp_path / "runs", f"edge://{tmp_path}/edge", tmp_path / "own.db"
    script = tmp_path / "mission.py"
    script.write_text(RESUMED_MISSION.format(here=HERE, runs=str(runs), edge=edge,
                                             store=str(store)))
    wr = workers.start("--url", edge, "--res", '{"Cores": {"N": 2}}', "--reattach", "2m",
                       name="wr")

    def running_entries():
        with contextlib.closing(sqlite3.connect(store)) as db:
            return db.execute("SELECT value FROM results_log WHERE state = 'running'"
                              ).fetchall()

    first = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: runs.exists() and len(runs.read_text().splitlines()) == 4, 60,
                 "4 jobs to start")
        wait_for(lambda: store.exists() and len(running_entries()) == 2, 10,
                 "the store to say where 2 run")
        entries = running_entries()
    finally:
        first.kill()
        first.wait()
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    began, out = again.stdout.split("\n", 1)
    assert _json.loads(out) == list(range(8))
    ran = [line.split() for line in runs.read_text().splitlines()]
    assert [pid for _, pid, _ in ran[:4]].count(str(wr.pid)) == 2
    started_again = [float(t) - float(began) for _, _, t in ran[4:]]
    assert len(started_again) == 6 and max(started_again) < grain.REJOIN_WAIT_S, started_again
    assert min(started_again) < grain.REJOIN_WAIT_S / 4, started_again
    once = {i: 1 if pid == str(wr.pid) else 2 for i, pid, _ in ran[:4]}
    assert _runs(runs) == {i: once.get(str(i), 1) for i in range(8)}   # wr's: once in all
    assert again.stderr.count("worker wr came back") == 1, again.stderr
    assert "came back with them" not in again.stderr, again.stderr   # (the warning)
    # (the entries named the worker each ran on: the run after held them for it)
    assert entries == [(f"wr (pid {wr.pid} on {grain.hostname()})",)] * 2


###############################################################################
# A model check of the head ###################################################
###############################################################################
# Seeded sequences of events played against a real GrainExecutor and its HeadService on
# virtual time: workers join, run jobs, drop their connection, fall silent or leave, and
# come back with the runs they kept and the results those gave meanwhile; each run a
# worker is sent meets a fate drawn for it; the mission may be killed and run again, its
# workers coming back to the new head with what the dead one had sent them. Scripted
# workers (ModelWorker) speak the worker protocol over memory streams; a Model records
# what happened and checks what the head promises, as it goes and at the end. A failure
# names its seed and a script, made smaller by deletion, that still fails.


class TemporaryTrouble(Exception):
    """The failure the model's head retries (its temporary_err)."""


async def _model_job(i):
    return i  # (never run here: the model's workers play each run's fate)


MODEL_RETRIES = 2
MODEL_RESCUE_AT = 400.0  # a worker that runs every job well joins then: every sequence ends
MODEL_FATES = ("ok", "temporary", "raise", "drop", "silent", "leave")
MODEL_STOP_S = 2.0       # how long a worker takes to stop a run the head cancels
MODEL_STEPS = 200_000    # task steps a sequence may take: more is a loop spinning


@dataclasses.dataclass
class ModelScript:
    """One sequence: ``workers`` {name: (cores, reattach, joins at)}; ``jobs`` {job:
    submitted at}; ``fates`` {(job, run): (fate, after, back)}: that run of that job meets
    ``fate`` ``after`` seconds in (its worker, gone, comes back ``back`` seconds later if
    it keeps its jobs; None: never). A run without a fate ends well after a second.
    ``kill``: None, or (at, pause, backs): the mission is killed at ``at`` s and run again
    ``pause`` s later (its jobs submitted again, as long after that as the first time);
    a worker that keeps its jobs looks for a head ``backs[name]`` s after the kill.
    ``relayed``: the workers met through a bridge (a head holds their runs a while when
    their connection closes: their bridge may have gone, not they). ``store``: the mission
    keeps a results store, which its run again resumes from."""
    workers: dict
    jobs: dict
    fates: dict
    kill: tuple = None
    relayed: frozenset = frozenset()
    store: bool = False

    def without(self, part, key):
        smaller = dataclasses.replace(self, **{part: {
            k: v for k, v in getattr(self, part).items() if k != key}})
        return dataclasses.replace(smaller, relayed=smaller.relayed - {key}) \
            if part == "workers" else smaller


def model_script(seed):
    """The sequence of ``seed``."""
    r = random.Random(seed)
    workers = {f"w{n}": (r.choice((1, 2)), r.choice((0.0, 120.0)), round(r.uniform(0, 20), 1))
               for n in range(r.randint(1, 3))}
    jobs = {i: round(r.uniform(0, 30), 1) for i in range(r.randint(1, 6))}
    fates = {}
    for i in jobs:
        for n in range(3):
            if r.random() < 0.6:
                fate = r.choice(MODEL_FATES)
                back = round(r.uniform(1, 60), 1) if fate in ("drop", "silent") and \
                    r.random() < 0.7 else None
                fates[i, n] = (fate, round(r.uniform(0.5, 40), 1), back)
    kill = None
    if r.random() < 0.3:
        kill = (round(r.uniform(1, 50), 1), round(r.uniform(0, 30), 1),
                {name: round(r.uniform(0, 40), 1) for name in workers})
    relayed = frozenset(name for name in workers if r.random() < 0.3)
    return ModelScript(workers, jobs, fates, kill, relayed, r.random() < 0.5)


class ModelWorker:
    """A scripted worker process: it registers, runs what it is sent for the time its fate
    says, and drops, falls silent (reading on: a run sent then is lost) or leaves when a
    fate says so; one that keeps its jobs (reattach) comes back later, registering again
    with the runs it kept and the results they gave while it was away."""

    def __init__(self, model, name, cores, reattach, pid, rescue=False):
        self.model, self.name, self.reattach, self.pid = model, name, reattach, pid
        self.rescue = rescue       # the last resort: every run ends well after a second
        self.res = Cores(list(range(cores)))
        self.runs = {}             # wire -> (job, run, allocation, cancel scope)
        self.started = {}          # wire -> the run it started last under it
        self.stopping = set()      # wires of the runs the head told it to stop
        self.kept = []             # results got while away
        self.out = None            # what goes to the head (None: it is away)
        self.tasks = None          # the nursery of its tasks (its head's are the model's)
        self.session = 0
        self.head = None           # the instance of the head it registered with last
        self.silent = self.gone = False

    def serving(self, session):
        """Does a message the head sends on ``session`` reach it?"""
        return session == self.session and self.out is not None and not self.silent

    def join(self):
        head_side, side = trio.testing.memory_stream_pair()
        if self.name in self.model.script.relayed:
            head_side.via = "relayed through bridge model:1"
        self.model.nursery.start_soon(self.model.service.handle_connection, head_side,
                                      self.name)
        info = {"name": self.name, "res": self.res, "pid": self.pid, "reattach": self.reattach}
        if self.head is not None:
            info["head"] = self.head
            info["resume"] = {**dict.fromkeys(m[1] for m in self.kept),
                              **{wire: r[2] for wire, r in self.runs.items()}}
        self.head = self.model.exer.instance
        self.session += 1
        self.model.sessions[head_side] = (self, self.session)
        self.silent = False
        self.out, receive = trio.open_memory_channel(math.inf)
        for task in (self._write, self._read):
            self.tasks.start_soon(task, side, receive, self.session)
        self.send(("register", info))
        kept, self.kept = self.kept, []
        for msg in kept:
            self.send(msg)

    def send(self, msg):
        if self.out is not None and not self.silent:
            self.out.send_nowait(msg)
        elif msg[0] == "done" and not self.gone:
            self.kept.append(msg)

    async def _write(self, side, messages, session):
        async def pings():
            while True:
                await trio.sleep(grain.HEARTBEAT_S)
                if self.session == session and not self.silent:
                    self.send(("ping",))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pings)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                async for msg in messages:
                    await side.send_all(grain.encode_frame(grain.dumps_control(msg)))
            nursery.cancel_scope.cancel()
        await side.aclose()

    async def _read(self, side, _, session):
        frames = grain.FrameStream(side)
        while True:
            try:
                frame = await frames.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                frame = None
            if self.session != session:
                return
            if frame is None:  # the head dropped it (a head that ended, or found it silent)
                if not self.silent:
                    self.fall("drop", None)
                return
            for msg in pickle.loads(frame):
                self._handle(msg)

    def _handle(self, msg):
        if msg[0] == "run":
            wire, (args, _) = msg[1], grain.loads_job_value(msg[3])
            run = self.model.arrived(args[0], self, wire)
            if run is not None:
                self.tasks.start_soon(self._run, wire, args[0], run, msg[4])
        elif msg[0] == "cancel" and msg[1] in self.runs:
            self.stopping.add(msg[1])
            self.tasks.start_soon(self._stop, self.runs[msg[1]][3])
        elif msg[0] in ("fin", "leave"):
            self.gone = True
            self._hang_up()

    @staticmethod
    async def _stop(scope):
        await trio.sleep(MODEL_STOP_S)  # (a program takes its time to end)
        scope.cancel()

    def _hang_up(self):
        if self.out is not None:
            self.out.close()
            self.out = None

    async def _run(self, wire, i, run, alloc):
        model = self.model  # (the mission's that sent it, killed perhaps as it runs)
        fate, after, back = ("ok", 1.0, None) if self.rescue else \
            model.script.fates.get((i, run), ("ok", 1.0, None))
        with trio.CancelScope() as scope:
            self.runs[wire] = (i, run, alloc, scope)
            self.started[wire] = (model, run)
            await trio.sleep(after)
            if fate in ("drop", "silent", "leave"):
                self.fall(fate, back)
                await trio.sleep(after)  # (unless gone: it runs on while away)
                fate = "ok"
        del self.runs[wire]
        self.stopping.discard(wire)
        if scope.cancelled_caught:
            if not self.gone:
                model.ended(i, run, "stopped")
                self.send(("cancelled", wire))
            return
        model.ended(i, run, fate)
        value = ("job", i, "run", run, model.mission) if fate == "ok" else \
            ({"temporary": TemporaryTrouble, "raise": ValueError}[fate](
                f"{i}/{model.mission}/{run}"), "")
        self.send(("done", wire, fate == "ok", grain.dumps_job_value(value, ""), after))

    def fall(self, how, back):
        """It drops its connection, falls silent or leaves; it comes back ``back`` seconds
        later if it keeps its jobs (else its runs end with it)."""
        if self.out is None or self.silent or self.gone:  # (away already)
            return
        self.model.worker_lost(self.name)
        if how == "leave":
            self.send(("leaving", "its walltime ends"))
        if how == "silent":
            self.silent = True
        else:
            self._hang_up()
        if back is not None and self.reattach > 0 and how != "leave":
            self.tasks.start_soon(self._come_back, back)
        else:
            self.gone = True
            for *_, scope in self.runs.values():
                scope.cancel()

    async def _come_back(self, back):
        await trio.sleep(back)
        if not self.gone:
            self._hang_up()  # (a silent one's connection closes only now)
            if await self.head_up(self.reattach):
                self.join()
            else:  # no head came within its reattach: it leaves, stopping its runs
                self.gone = True
                for *_, scope in self.runs.values():
                    scope.cancel()

    async def head_up(self, within=math.inf):
        """Wait for a head to serve (a mission run again starts one); False if none came."""
        with trio.move_on_after(within):
            while self.model.service is None:
                await trio.sleep(grain.REATTACH_POLL_S)
            return True
        return False

    def head_killed(self, model, back):
        """Its head died without a goodbye: nothing it still sends arrives, and ``model``
        is the mission run again. A worker that served it falls away as from a drop."""
        serving = self.out is not None and not self.silent and not self.gone
        self.session += 1
        self.model = model
        if serving:
            self.fall("drop", back)


def _mission_of(value, error):
    """The mission whose run gave an outcome (None: the head made it, as a lost worker's)."""
    if error is None:
        return value[4] if type(value) is tuple and len(value) == 5 else None
    parts = str(error).split("/")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class Model:
    """What happened to each job of a script, and the head's promises checked against it."""

    def __init__(self, script, violations=None, mission=0, killed=None):
        self.script = script
        self.mission = mission     # 0, or 1: the mission run again after it was killed
        self.exer = self.service = self.nursery = None  # (its head, once it runs)
        self.runs = {i: [] for i in script.jobs}    # job -> [worker, state] of each run
        self.current = {}          # job -> its run the head counts on (the last sent, or
        #                            one a worker came back with that the head adopted)
        self.free = dict.fromkeys(script.jobs, False)  # may it run again?
        self.gave = {i: set() for i in script.jobs}  # job -> (fate, run) of its runs' ends
        self.ends = {}             # (job, run) -> how it ended
        self.killed = None         # the killed mission's Model, when this one resumes it
        self.stored = {}           # job -> the value its store entry held at the kill
        if killed is not None and script.store:  # (its jobs and their runs go on here,
            self.killed, self.stored = killed, killed.stored  # ending as they may)
            self.runs, self.current, self.gave, self.ends, self.free = (
                killed.runs, killed.current, killed.gave, killed.ends, killed.free)
            self.free.update(dict.fromkeys(script.jobs, True))  # (what was not stored may run)
        self.sends = Counter()     # job -> runs this mission's head sent
        self.inherited = set()     # jobs whose first run it counted was the killed one's
        self.losses = Counter()    # job -> its latest runs lost (their worker went)
        self.retried = Counter()   # job -> the retries the head's warnings announced
        self.sessions = {}         # the head's side of a connection -> (worker, session)
        self.completed = Counter()  # job -> outcomes delivered
        self.attempts = {}         # job -> the attempts it counted as it ended
        self.outcomes = {}
        self.violations = [] if violations is None else violations
        self.steps = 0
        self.jobs = {}             # the head's number of a job submitted -> the job
        # job -> since when no run of it was at a worker (None: one is)
        self.away = killed.away if self.killed is not None else {}
        self.delivered = {}        # job -> when its outcome reached its caller
        self.dead = False          # killed: what its head still does is lost on the way

    def violated(self, text):
        self.violations.append(f"at {trio.current_time():.1f} s: {text}")

    def sent(self, job):
        """The head sends ``job`` to a worker (seen at the head: a run may never arrive)."""
        if self.dead:  # (a dying head, its workers dropped, sends their jobs elsewhere)
            return
        i, (worker, session) = job.args[0], self.sessions[job.worker.channel.stream]
        runs = self.runs[i]
        if runs and not self.free[i]:
            n = self.current[i]  # (the run the head counts on: not always the last sent)
            self.violated(f"job {i} was sent to {worker.name} (run {len(runs)}) while its run "
                          f"{n} on {runs[n][0]} was neither lost nor failed to retry")
        if i in self.outcomes:
            self.violated(f"job {i} was sent to {worker.name} after its outcome was delivered")
        if i in self.stored:
            self.violated(f"job {i} was sent to {worker.name}, its result stored")
        self.sends[i] += 1
        self.free[i] = False
        self.away[i] = None
        runs.append([worker.name, "sent"])
        self.current[i] = len(runs) - 1
        if not worker.serving(session):  # (on a connection gone, or to a silent worker)
            self._lose(i)

    def arrived(self, i, worker, wire):
        """The run of job ``i`` that reached ``worker`` (None: none to start there)."""
        runs = self.runs[i]
        if not runs or runs[-1][0] != worker.name or runs[-1][1] not in ("sent", "lost"):
            self.violated(f"a run of job {i} that the head did not send reached {worker.name}")
        elif runs[-1][1] == "lost":  # (sent as it went: taken for lost already)
            pass
        elif wire in worker.runs:
            self.violated(f"job {i} was sent to {worker.name}, which runs it already")
        elif not worker.serving(worker.session) or worker.gone:
            self._lose(i)
        else:
            runs[-1][1] = "live"
            return len(runs) - 1
        return None

    def _lose(self, i):
        self.losses[i] += 1
        self.free[i] = True
        self.away[i] = trio.current_time()
        self.runs[i][self.current[i]][1] = "lost"

    def worker_lost(self, name):
        """The runs the head counts on that worker ``name`` runs, or that are on their way
        to it, are lost."""
        for i, n in self.current.items():
            if self.runs[i][n][0] == name and self.runs[i][n][1] in ("sent", "live", "stopping"):
                self._lose(i)

    def adopted(self, job, w):
        """The head takes a run a worker came back with for its job's: one it may have told
        that worker to stop, when the job's run elsewhere was lost meanwhile (the job runs
        again once it stopped, its outcome still its own)."""
        i, (worker, session) = job.args[0], self.sessions[w.channel.stream]
        owner, run = worker.started[job.wire]
        if owner is not self and owner is not self.killed:
            self.violated(f"job {i} took for its own a run on {worker.name} that the killed "
                          "mission's head had sent")
            return
        if owner is not self and not self.sends[i]:
            self.inherited.add(i)
        self.current[i] = run
        fate = self.ends.get((i, run))  # (ended already: what it said is on its way)
        self.runs[i][run][1] = "stopping" if job.wire in worker.stopping or \
            fate == "stopped" else "live"
        self.free[i], self.away[i] = False, None
        if not worker.serving(session):  # (it went again as it came back)
            self._lose(i)
        elif fate is not None:
            self._settle(i, run, fate)

    def ended(self, i, run, fate):
        self.gave[i].add((fate, run))
        self.ends[i, run] = fate
        self._settle(i, run, fate)

    def _settle(self, i, run, fate):
        if run == self.current[i]:
            if fate == "temporary" or fate == "stopped" and self.runs[i][run][1] == "stopping":
                self.free[i] = True
                self.away[i] = trio.current_time()
            self.runs[i][run][1] = fate

    def check_attempts(self, i, got, attempts):
        """A job ends counting as attempts the runs the head started (the number its error
        says): a run a worker came back with, and the head adopted again, is one; so is
        the killed mission's run whose result a worker came back with, when this head
        started none (a result from the store: none)."""
        value, error = (None, got) if isinstance(got, BaseException) else (got, None)
        if self.killed is not None and not self.sends[i] and i not in self.stored and \
                _mission_of(value, error) == 0:
            self.inherited.add(i)
        expected = self.sends[i] + (i in self.inherited)
        if attempts != expected:
            self.violated(f"job {i} ended counting {attempts} attempt(s), where the head "
                          f"started {self.sends[i]} run(s) of it" +
                          (" and took one the killed mission's had" if i in self.inherited
                           else ""))

    def check_note(self, i, error):
        """A job's error says the runs its head started and, when they differ, the retries
        it announced (a worker that came back with the run it was lost with: one run,
        retried)."""
        runs, retried = self.sends[i] + (i in self.inherited), self.retried[i]
        said = re.search(r"after (\d+) attempts?(?: and (\d+) retr(?:y|ies))?( \(|$)",
                         "\n".join(getattr(error, "__notes__", ())), re.M)
        expected = None if not retried else (runs, None if runs == retried + 1 else retried)
        if (said and (int(said[1]), said[2] and int(said[2]))) != expected:
            self.violated(f"job {i}'s error says {said and said[0]!r}, where the head "
                          f"started {runs} run(s) of it and announced {retried} retries")

    def check_retries(self, i):
        """The retries the head announced for a job, against what the model saw: each
        follows a run of it lost (by this mission) or one that failed with the retried
        class (by either mission: a worker may bring the killed one's back)."""
        failed = sum(fate == "temporary" for (j, _), fate in self.ends.items() if j == i)
        if self.retried[i] > self.losses[i] + failed:
            self.violated(f"the head announced {self.retried[i]} retries of job {i}, where "
                          f"{self.losses[i]} run(s) of it were lost and {failed} failed with "
                          "the retried class")

    @property
    def missions(self):
        """The missions whose runs may give this one's outcomes: its own, and the killed
        one's that it resumes from its store."""
        return (0, 1) if self.killed is not None else (self.mission,)

    def check_outcomes(self):
        for i in self.script.jobs:
            self.check_retries(i)
            if self.completed[i] != 1:
                self.violated(f"job {i}'s outcome was delivered {self.completed[i]} times")
            kind, got = self.outcomes.get(i, ("waits", None))
            if kind != "waits":
                self.check_attempts(i, got, self.attempts[i])
            if kind == "error":
                self.check_note(i, got)
            if kind == "waits":
                self.violated(f"job {i} still waits at the end")
            elif kind == "value":
                if ("ok", got[3]) not in self.gave[i] or got[:3] != ("job", i, "run") or \
                        got[4] not in self.missions or self.stored.get(i, got) != got:
                    self.violated(f"job {i} was given {got!r}, which no run of it gave" + (
                        f" (its store entry held {self.stored[i]!r})" if i in self.stored
                        else ""))
            elif isinstance(got, grain.WorkerLostError):
                if self.losses[i] <= MODEL_RETRIES:
                    self.violated(f"job {i} ended with {got!r} after {self.losses[i]} loss(es)")
            else:
                fate = {TemporaryTrouble: "temporary", ValueError: "raise"}.get(type(got))
                run = (str(got).split("/") + ["", ""])[2]
                if fate is None or _mission_of(None, got) not in self.missions or \
                        not run.isdigit() or (fate, int(run)) not in self.gave[i]:
                    self.violated(f"job {i} ended with {got!r}, which no run of it raised")

    def status_disagrees(self, exer):
        """What the mission's status line says against what happened: done and failed are
        the outcomes delivered, total the jobs submitted, running the jobs not ended whose
        run the head counts on is at a worker that serves it (once each), and queued the
        rest. (That a worker fell silent the head cannot know yet: the jobs it sent there
        count as it counts them.)"""
        text = grain.ProgressLine(exer, None).text()
        done, total, said, queued, failed = map(int, re.search(
            r"(\d+)/(\d+) done, (\d+) running, (-?\d+) queued, (\d+) failed", text).groups())
        kinds = Counter(kind for kind, _ in self.outcomes.values())
        serving, running = set(), set()
        for w in exer.scheduler.workers:
            worker, session = self.sessions[w.channel.stream]
            if worker.silent:
                running.update(job.args[0] for job in w.busy)
            elif worker.serving(session):
                serving.add(worker.name)
        for i, n in self.current.items():
            name, state = self.runs[i][n]
            if name in serving and state in ("sent", "live", "stopping") and \
                    i not in self.outcomes:
                running.add(i)
        expected = (kinds["value"], len(self.jobs), len(running), kinds["error"])
        if (done, total, said, failed) != expected or queued < 0:
            return (f"the status line says {text.split(' | ')[1]!r}, where {expected[0]} done "
                    f"of {expected[1]}, {expected[2]} running, {expected[3]} failed")
        return None

    def warning_disagrees(self, text):
        """A warning against what happened: a job retried as its worker went was running
        there (the run the head counted on), and a job a stuck queue's warning names had no
        run at a worker for as long as it says."""
        # (a job's call names its script's number: a job is retried as it is submitted,
        # when a worker came back with a failure of the killed mission's run of it)
        m = re.match(r"job #\d+ _model_job\((\d+)\) failed with (?:\w+: \d+/(\d+)/)?.*; "
                     r"retrying \(\d+ of \d+\)$", text)
        if m is not None:
            i = int(m.group(1))
            self.retried[i] += 1
            if m.group(2) == "0" and self.killed is not None and not self.sends[i]:
                self.inherited.add(i)  # (it took the failure of the killed mission's run)
        m = re.match(r"job #\d+ _model_job\((\d+)\) failed with Worker(?:Lost|Retired)Error: "
                     r"job #\d+ \S+ was running on worker (\S+), which", text)
        if m is not None:
            i, name = int(m.group(1)), m.group(2)
            if i not in self.current or self.runs[i][self.current[i]][0] != name:
                where = self.runs[i][self.current[i]][0] if i in self.current else "none"
                return f"a warning says job {i} was running on {name}, where it ran on {where}"
            return None
        m = re.match(r"job #(\d+) \S+ requesting .* has fitted no worker for (\d+) s;", text)
        if m is None:
            return None
        i, waited = self.jobs[int(m.group(1))].args[0], int(m.group(2))
        away = self.away.get(i)
        if away is None or trio.current_time() - away < waited - 0.5:  # (said in whole s)
            where = "it runs" if away is None else \
                f"a run of it was at a worker {trio.current_time() - away:.0f} s ago"
            return f"a warning says job {i} has fitted no worker for {waited} s, where {where}"
        return None

    def waits_with_room(self, scheduler):
        """A queue's first job waiting while a worker has room for it that no other job
        holds (the Scheduler reserves a worker only for a queue's first job)."""
        for queue in scheduler.queues:
            if queue.jobs:
                job = queue.jobs[0]
                for w in scheduler.workers:
                    if w.accepting and w.res.request(job.req) and w.reserved_for in (None, job):
                        return f"job {job.args[0]} waits while {w.name} has room ({w.res!r})"
        return None


class _ModelWatch(trio.abc.Instrument):
    """Counts task steps (a spinning loop shows as too many), and when every task waits,
    checks that no job waits for room a worker has and that the status line is true."""

    def __init__(self, model, scheduler):
        self.model, self.scheduler, self.scope = model, scheduler, None
        self.exer = None

    def before_task_step(self, task):
        self.model.steps += 1
        if self.model.steps == MODEL_STEPS:
            self.model.violated(f"{MODEL_STEPS} task steps: a loop spins")
            self.scope.cancel()

    def before_io_wait(self, timeout):
        if self.exer is not None and trio.lowlevel.current_statistics().tasks_runnable == 0:
            why = self.model.waits_with_room(self.scheduler) or \
                self.model.status_disagrees(self.exer)
            if why is not None and why not in {v.split(": ", 1)[1] for v in self.model.violations}:
                self.model.violated(why)


class _ModelHearsWarnings(logging.Handler):
    """Checks each warning of grain's, as it is given, against what happened; an error
    logged is a violation (the head's handlers catch a defect such as a move a job's life
    refuses, drop the worker or fail the job, and only say so)."""

    def __init__(self, model):
        super().__init__(logging.WARNING)
        self.model = model

    def emit(self, record):
        if self.model is None:  # (between a mission's death and its run again)
            return
        if record.levelno >= logging.ERROR:
            error = record.exc_info[1] if record.exc_info else None
            self.model.violated(f"grain logged an error: {record.getMessage()}" +
                                (f" ({type(error).__name__}: {error})" if error else ""))
            return
        why = self.model.warning_disagrees(record.getMessage())
        if why is not None:
            self.model.violated(why)


def _store_as_a_kill_leaves(exer, model):
    """Leave the mission's results store as a kill -9 would: the rows written, not those
    still to write, and the holder file, naming a process that is gone. {job: the value
    of its "done" entry} of ``model``'s jobs."""
    store = exer.stored.store
    store._pending.clear()
    store._db.close()
    store._db, store.held = None, False  # (the mission's unwinding leaves it as it is)
    holder, store.holder = store.holder, store.holder + ".after-the-kill"  # (as it unwinds)
    with open(holder) as f:
        said = json.load(f)
    with open(holder, "w") as f:
        json.dump(dict(said, pid=2 ** 31 - 1), f)
    left = grain.ResultStore(store.path).open(hold=False)
    try:
        return {job.args[0]: grain.loads_job_value(left.fetch(key)[1]) for job in
                model.jobs.values() if left.states.get(key := grain._key_text(job.key)) == "done"}
    finally:
        left.close()


async def _at_once(fn, *args, **_):
    """trio.to_thread.run_sync, on the model's virtual clock: in this thread."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


def _play(script, seed):
    """Play ``script`` (trio's own choices seeded by ``seed``): the Model of its last
    mission (of the one killed too: its violations). A mission with a store keeps it in
    a folder of its own (on /dev/shm, where there is one: it is written often), written by
    the mission itself, in its thread (no thread or process runs on virtual time), every
    5 s (every STORE_FLUSH_S, its wakes would double the time a sequence takes)."""
    current = [Model(script)]  # the mission that runs, or is to run again
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
        if script.store else None
    # trio's scheduling, made a function of the seed alone (trio's own switch for test
    # runners, private): the tasks of a batch are sorted by their birth before its seeded
    # shuffle. Else they come in an order that follows addresses in memory (timers due at
    # once, tasks a cancellation wakes), so a seed replayed in another process, or after
    # other seeds, could take other steps than the failure it reproduces.
    trio._core._run._r.seed(seed)
    random.seed(seed)

    async def outcome(model, job, i):
        try:
            model.outcomes[i] = ("value", await job)
        except Exception as e:
            model.outcomes[i] = ("error", e)
        model.delivered[i] = trio.current_time()

    async def join_at(worker, at):
        await trio.sleep(at)
        await worker.head_up()
        worker.join()

    async def mission(model, start):
        """One run of the mission: its head, and its jobs submitted as the script says
        (from ``start``)."""
        async with trio.open_nursery() as head_tasks:
            async with grain.GrainExecutor(
                    temporary_err=TemporaryTrouble, max_retries=MODEL_RETRIES,
                    results=folder and os.path.join(folder, "results.db")) as exer:
                # Its jobs leave this process, as listen= would say, but without a
                # socket: trio binds a Unix socket in a thread, and the virtual clock
                # would jump ahead for as long as that takes.
                exer._remote = True
                exer.listen = "tcp://model:1"  # (its resumed jobs wait for their workers)
                complete = exer.complete

                def counted(job, *rest):
                    model.completed[job.args[0]] += 1
                    model.attempts[job.args[0]] = job.attempts
                    return complete(job, *rest)
                exer.complete = counted
                job_sent = exer.job_sent

                def sent(job):
                    model.sent(job)
                    return job_sent(job)
                exer.job_sent = sent
                model.exer, model.nursery = exer, head_tasks
                model.service = grain.HeadService(exer, None, None)
                watch.model, watch.scheduler, watch.exer = model, exer.scheduler, exer
                hears.model = model
                async with trio.open_nursery() as waiting:
                    for i, at in sorted(script.jobs.items(), key=lambda item: item[1]):
                        await trio.sleep_until(start + at)
                        model.away[i] = start + at
                        job = exer.submit(Cores(1), _model_job, i)
                        model.jobs[job.id] = job
                        waiting.start_soon(outcome, model, job, i)
            head_tasks.cancel_scope.cancel()

    async def kill(scope, workers):
        """The mission dies at once, telling no one; the mission run again is ``current``."""
        at, _, backs = script.kill
        await trio.sleep_until(at)
        first = current[0]
        first.dead = True
        if script.store:
            first.stored = _store_as_a_kill_leaves(first.exer, first)
            for i, when in first.delivered.items():  # (written at the keeper's next wake)
                if first.outcomes[i][0] == "value" and i not in first.stored and \
                        when < at - grain.STORE_FLUSH_S - 0.5:
                    first.violated(f"job {i}'s value, delivered at {when:.1f} s, is not in "
                                   "the store its mission left")
        current[0] = again = Model(script, first.violations, mission=1, killed=first)
        first.violations = []  # (what the dying head does from now on is no one's concern)
        watch.exer = hears.model = None
        watch.model = again  # (a loop that spins from now on is the run again's)
        for w in workers:
            w.head_killed(again, backs.get(w.name))
        again.losses.clear()  # (the killed head's: the new one has lost nothing yet)
        scope.cancel()

    async def main():
        with trio.move_on_after(MODEL_RESCUE_AT + grain.ORPHAN_WAIT_S + 200) as deadline:
            watch.scope = deadline
            trio.lowlevel.add_instrument(watch)
            async with trio.open_nursery() as nursery:
                workers = [ModelWorker(current[0], name, cores, reattach, 100 + n) for n, (
                    name, (cores, reattach, _)) in enumerate(script.workers.items())]
                workers.append(ModelWorker(current[0], "rescue", 2, 0.0, 99, rescue=True))
                for w, at in zip(workers, [*(v[2] for v in script.workers.values()),
                                           MODEL_RESCUE_AT]):
                    w.tasks = nursery
                    nursery.start_soon(join_at, w, at)
                with trio.CancelScope() as first:
                    async with trio.open_nursery() as dying:
                        if script.kill is not None:
                            dying.start_soon(kill, first, workers)
                        await mission(current[0], 0.0)
                        dying.cancel_scope.cancel()  # (it ended before its death)
                if first.cancelled_caught:
                    at, pause, _ = script.kill
                    await trio.sleep_until(at + pause)
                    await mission(current[0], at + pause)
                nursery.cancel_scope.cancel()
        if deadline.cancelled_caught and current[0].steps < MODEL_STEPS:
            current[0].violated("the sequence did not end")
        current[0].check_outcomes()

    def adopt(w, job, alloc, now):
        current[0].adopted(job, w)
        return grain.Worker.adopt(w, job, alloc, now)

    watch, hears = _ModelWatch(current[0], None), _ModelHearsWarnings(current[0])
    grain.log.addHandler(hears)
    try:
        with contextlib.ExitStack() as patches:
            patches.enter_context(unittest.mock.patch.object(grain.RemoteWorker, "adopt", adopt))
            patches.enter_context(unittest.mock.patch.object(
                trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", True))
            if folder:
                for where, name, value in ((trio.to_thread, "run_sync", _at_once),
                                           (grain.ResultStore, "start_writer", lambda _: None),
                                           (grain, "STORE_FLUSH_S", 5.0)):
                    patches.enter_context(unittest.mock.patch.object(where, name, value))
            trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        grain.log.removeHandler(hears)
        if folder:
            shutil.rmtree(folder)
    return current[0]


def _smallest_failing(script, seed):
    """``script`` made smaller, one worker, job or fate at a time, while it still fails."""
    if script.kill is not None and _play(dataclasses.replace(script, kill=None), seed).violations:
        script = dataclasses.replace(script, kill=None)  # (it fails without the kill too)
    for part, none in (("relayed", frozenset()), ("store", False)):
        if getattr(script, part) and _play(dataclasses.replace(script, **{part: none}),
                                           seed).violations:
            script = dataclasses.replace(script, **{part: none})
    smaller = True
    while smaller:
        smaller = False
        for part in ("fates", "jobs", "workers"):
            for key in list(getattr(script, part)):
                candidate = script.without(part, key)
                if candidate.jobs and _play(candidate, seed).violations:
                    script, smaller = candidate, True
    return script


def _model_history(seed):
    """What happened in the sequence of ``seed``, as text: the steps it took, each job's
    runs (their workers and ends), the runs each mission sent, the outcomes delivered."""
    model = _play(model_script(seed), seed)
    return repr((model.steps, sorted(model.runs.items()), sorted(model.sends.items()),
                 sorted((i, repr(outcome)) for i, outcome in model.outcomes.items())))


def test_a_sequence_of_the_model_plays_the_same_in_another_process():
    # A failing seed is reported to be replayed (bench/bench_model.py --replay SEED) in a
    # process of its own, where other seeds did not play first and strings hash otherwise:
    # it must take the same steps there. (These seeds take other steps in another process
    # when trio orders a batch's tasks by their addresses: 2, 4, 6, 7, 77.)
    seeds = [2, 4, 6, 7, 77, 150]
    for seed in range(40):  # (some history in this process first)
        _play(model_script(seed), seed)
    here = [_model_history(seed) for seed in seeds]
    there = subprocess.run(
        [sys.executable, "-c", "import sys, test_grain as t; print(repr([t._model_history(s) "
         f"for s in {seeds[::-1]}][::-1]))"],
        cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
        env=dict(os.environ, PYTHONHASHSEED="7"), timeout=120)
    assert there.returncode == 0, there.stderr[-2000:]
    for seed, mine, theirs in zip(seeds, here, ast.literal_eval(there.stdout.strip())):
        assert mine == theirs, f"seed {seed} took other steps in another process"


def test_the_head_keeps_its_promises_over_seeded_sequences_of_events():
    # The head's promises, over seeded sequences of joins, losses, returns, fates and a
    # mission killed and run again (see Model): a job runs again only after its run was
    # lost or failed with a retried class; its outcome reaches its caller exactly once and
    # is what a run of it gave, for this run of the mission (a WorkerLostError only after
    # more losses than its retries), counting as attempts the runs its head started; no
    # job waits while a worker has room for it; the status line and the warnings say what
    # happened; no loop spins; every sequence ends. GRAIN_MODEL_SEQUENCES plays more.
    sequences = int(os.environ.get("GRAIN_MODEL_SEQUENCES", "10000"))
    for seed in range(sequences):
        model = _play(model_script(seed), seed)
        if model.violations:
            script = _smallest_failing(model_script(seed), seed)
            pytest.fail(f"seed {seed}: {model.violations}\nsmallest failing script: {script}\n"
                        f"there: {_play(script, seed).violations}")


###############################################################################
# Mission link ################################################################
###############################################################################


def test_a_mission_refused_by_an_in_process_head_says_why(tmp_path):
    edge = f"edge://{tmp_path}/edge"
    code = textwrap.dedent(f"""
        import sys, trio; sys.path.insert(0, {HERE!r})
        from grain.delayed import run
        from grain.resource import ZERO
        async def main():
            await trio.sleep(30)
        run(main, local=ZERO, address={edge!r}, config_file=False)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        wait_for(lambda: '"lid"' in (tmp_path / "edge").read_text()
                 if (tmp_path / "edge").exists() else False, 15, "the mission head's record")
        cp = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import sys, trio; sys.path.insert(0, {HERE!r})
            from grain.delayed import delayed, run
            from grain.resource import Cores
            @delayed
            async def f():
                return 1
            async def main():
                return await (f @ Cores(1))()
            run(main, address={edge!r})
        """)], capture_output=True, text=True, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert cp.returncode == 1
    assert "runs a mission of its own" in cp.stderr and "local=" in cp.stderr


def test_a_started_head_daemon_logs_beside_the_edge_file_and_its_first_line_says_so(
        tmp_path, workers):
    share, work = tmp_path / "share", tmp_path / "work"
    share.mkdir()
    work.mkdir()
    edge = f"edge://{share}/edge"
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'address = "{edge}"\n')
    workers.start("--url", edge, "--res", '{"Cores": {"N": 1}}', name="w")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from grain.delayed import delayed, run
        from grain.resource import Cores
        @delayed
        async def one():
            return 1
        async def main():
            return await (one @ Cores(1))()
        print(run(main, config_file={str(cfg)!r}, progress=False))
    """)
    cp = run_py("-c", code, cwd=work)
    assert cp.returncode == 0 and cp.stdout == "1\n", cp.stderr
    (log,) = share.glob("grain-head-*.log")
    assert re.fullmatch(rf"started a head daemon \(pid \d+\) for {re.escape(edge)}; its log: "
                        rf"{re.escape(str(log))}", cp.stderr.splitlines()[0]), cp.stderr
    assert list(work.iterdir()) == []
    assert grain_cli("stop", "-c", str(cfg)).returncode == 0


def test_a_mission_with_the_daemon_disabled_is_its_own_head(tmp_path, workers):
    edge = f"edge://{tmp_path}/edge"
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'address = "{edge}"\n[head.gnaw]\nenabled = false\n')
    workers.start("--url", edge, "-r", '{"Node": {"N": 1, "M": 1}}', name="w")

    async def main():
        return await (delayed(_memory_of_my_job) @ Node(1, 1))(), os.getpid()

    assert run(main, config_file=str(cfg)) == ((1, 1, 1), os.getpid())
    assert not os.path.exists(grain.mission_socket_path(edge))  # no head daemon started


def test_a_mission_whose_head_daemon_dies_gives_its_jobs_to_the_next(daemon, tmp_path):
    """A worker that does not wait for a new head (--reattach 0) takes its job with it: the
    new daemon holds the job a while for it, then runs it again elsewhere."""
    first = daemon.workers.start("--url", daemon.edge, "--res", '{"Cores": {"N": 1}}',
                                 "--reattach", "0", name="w1")
    mission = daemon.mission(2, 3)
    daemon.wait_ls("1 running")
    (pid,) = _daemon_pids(tmp_path)
    os.kill(pid, signal.SIGKILL)         # the daemon dies; its worker leaves
    assert first.wait(15) == 0
    second = daemon.worker(cores=1, name="w2")   # waits on the Edge file for a new head
    assert daemon.result(mission)["pids"] == [second.pid]
    assert "handing them to the next one" in mission.err
    assert len(_daemon_pids(tmp_path)) == 2      # the mission started a second daemon


###############################################################################
# Watching a mission ##########################################################
###############################################################################


PROGRESS_MISSION = textwrap.dedent("""
    import sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def work(i):
        await trio.sleep(0.15)
        if i % 10 == 0:
            print(f"hello {{i}}")
        return i

    async def main():
        return await each((work @ Cores(1))(i) for i in range(40))

    print("sum", sum(run(main, local=Cores(4), config_file=False{extra})))
""")


class Terminal:
    """A Python script running on a terminal of its own (a pty, 200 columns wide), and what
    it wrote there so far."""

    def __init__(self, script, cwd=HERE):
        import pty
        self.fd, sub = pty.openpty()
        self.p = subprocess.Popen([sys.executable, str(script)], stdout=sub, stderr=sub,
                                  stdin=subprocess.DEVNULL, cwd=cwd,
                                  env=dict(os.environ, COLUMNS="200"))
        os.close(sub)
        self.out = b""

    def read(self, until=None, timeout=60):
        """Read until the output matches the pattern ``until`` (returns the match), or, with
        none, until the script ends (returns its exit status)."""
        import select
        deadline = time.monotonic() + timeout
        while until is None or not re.search(until, self.text):
            left = max(0, deadline - time.monotonic())
            assert select.select([self.fd], [], [], left)[0], self.text
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the other end closed
                chunk = b""
            if not chunk:
                assert until is None, self.text
                return self.p.wait(30)
            self.out += chunk
        return re.search(until, self.text)

    text = property(lambda self: self.out.decode(errors="replace"))

    def close(self):
        kill_all([self.p])
        os.close(self.fd)


def _run_in_pty(script):
    term = Terminal(script)
    try:
        assert term.read() == 0, term.text
    finally:
        term.close()
    return term.text


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


REPORT_MISSION = textwrap.dedent("""
    import sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, run
    from grain.resource import Cores

    @delayed
    async def work(i):
        await trio.sleep({seconds} * (1 + i % 3))
        if i % 7 == 3:
            raise ValueError(f"bad input {{i}}")
        return i

    async def main():
        jobs = [(work @ Cores(1))(i) for i in range({n})]
        for job in jobs:
            try:
                await job
            except ValueError:
                pass

    run(main, local=Cores(4), config_file=False, report={report!r}, progress=False)
""")


def test_mission_logs_time_elapsed(caplog):
    async def main():
        await trio.sleep(0.01)

    with caplog.at_level(logging.INFO, logger="grain"):
        run(main, config_file=False)
    assert any(r.getMessage().startswith("Time elapsed for all jobs: ")
               for r in caplog.records)
    assert "Config file is disabled" not in caplog.text  # (news at debug level only)


def test_the_last_line_bills_jobs_for_the_time_they_ran_and_says_how_they_ended():
    record = grain.MissionRecord()
    jobs = []
    # (started, duration its worker measured, state) 10 s after t0, at the end 20 s after:
    # a job ended bills its duration, one running since 15 s bills 5 s, a queued one nothing
    for i, (started, duration, state) in enumerate([(0, 1.0, "done"), (0, 2.0, "failed"),
                                                    (15, None, "running"),
                                                    (None, None, "queued")]):
        job = grain.Job(i, Cores(2), None, (), {})
        job.state, job.alloc = state, Cores([0, 1])
        job.started = None if started is None else record.t0 + started
        if duration is not None:
            job.duration, job.ended = duration, record.t0 + 10 + duration
        jobs.append(job)
    totals = record.totals(jobs, end=record.t0 + 20)
    assert totals["used"] == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 5)
    assert record.summary(jobs).startswith("4 jobs (1 done, 1 failed, 2 not ended), ")
    assert record.summary(jobs[:2]).startswith("2 jobs (1 done, 1 failed), ")  # all ended
    assert record.summary(jobs[:1]).startswith("1 jobs, ")


async def _calculation(i, fail=()):
    await trio.sleep(10)
    if i in fail:
        raise ValueError(f"bad input {i}")
    return i


def _status(exer):
    """The mission's status line now, without its clock."""
    return grain.ProgressLine(exer, None).text().split(" | ", 1)[1]


NO_WORKER = ("no worker has joined yet (give run() local=..., or start workers with "
             "`python grain.py up`)")


@trio_test
async def test_the_status_and_last_lines_count_calculations_not_their_wrappers(
        autojump_clock, caplog):
    # Ten @delayed wrappers without resources, each awaiting a calculation of 10 s on one
    # of two cores; the last calculation fails. The wrappers run in the mission: not counted.
    @delayed
    async def wrapper(i):
        with contextlib.suppress(ValueError):
            return await (delayed(_calculation) @ Cores(1))(i, {9})

    with caplog.at_level(logging.INFO, logger="grain"):
        async with grain.GrainExecutor(rpw=Cores(2), progress=False) as exer:
            calls = [wrapper(i) for i in range(10)]
            await trio.sleep(5)
            assert _status(exer) == ("0/10 done, 2 running, 8 queued, 0 failed | 2/2 cores "
                                     "busy on 1 worker(s)")
            assert await each(calls) == [*range(9), None]
            assert _status(exer) == ("9/10 done, 0 running, 0 queued, 1 failed (raised: 1) | "
                                     "0/2 cores busy on 1 worker(s)")
    # 100 core-seconds used of 2 cores for 50 s; the wrappers said apart
    assert re.search(r"for all jobs: [\d.]+s; 10 jobs \(9 done, 1 failed\), 0.0278 core-hours "
                     r"used of 0.0278 allocated \(100% utilization\); 10 call\(s\) without "
                     r"resources ran in the mission$", caplog.text, re.M)


@pytest.mark.parametrize("where", ["main", "a task"])
@trio_test
async def test_after_an_interrupt_the_last_line_counts_every_job_submitted(
        where, autojump_clock, caplog):
    # Ctrl-C 15 s into ten jobs of 10 s on two cores: two ended, two ran for 5 s. Trio
    # raises it in whichever task runs then: the mission's main, or a task of grain's
    # (the status line's, a job's), whose nursery then ends the executor.
    async def ctrl_c():
        await trio.sleep(15)
        raise KeyboardInterrupt

    with caplog.at_level(logging.INFO, logger="grain"), \
            pytest.raises((KeyboardInterrupt, BaseExceptionGroup)) as info:
        async with grain.GrainExecutor(rpw=Cores(2), progress=False) as exer:
            for i in range(10):
                exer.submit(Cores(1), _calculation, i)
            if where == "a task":
                exer.submit(ZERO, ctrl_c)  # (asking nothing, it is no calculation)
                await exer.wait_all()
            await trio.sleep(15)
            assert _status(exer) == ("2/10 done, 2 running, 6 queued, 0 failed | 2/2 cores "
                                     "busy on 1 worker(s)")
            raise KeyboardInterrupt
    assert info.group_contains(KeyboardInterrupt) if where == "a task" else info.type is \
        KeyboardInterrupt
    assert re.search(r"; 10 jobs \(2 done, 8 not ended\), 0.00833 core-hours used of 0.00833 "
                     r"allocated", caplog.text)


@trio_test
async def test_with_no_worker_the_status_line_says_so_from_the_start(autojump_clock):
    async with grain.GrainExecutor(progress=False) as exer:
        assert _status(exer) == f"0/0 done, 0 running, 0 queued, 0 failed | {NO_WORKER}"
        jobs = [exer.submit(Cores(1), _calculation, i) for i in range(3)]
        assert _status(exer) == f"0/3 done, 0 running, 3 queued, 0 failed | {NO_WORKER}"
        # on a terminal of 80 columns: the line without the hint (nor "0 failed"), not the
        # hint cut short; so with 5,000 jobs too
        for more in (0, 4997):
            jobs += [exer.submit(Cores(1), _calculation, 0) for _ in range(more)]
            line = grain.ProgressLine(exer, io.StringIO())
            with unittest.mock.patch.dict(os.environ, COLUMNS="80"):
                line.draw()
            n = 3 + more
            assert line.stream.getvalue() == (f"\r\x1b[K0:00:00 | 0/{n} done, 0 running, {n} "
                                              "queued | no worker has joined yet")
        exer.fail_queued("no worker came")
        for job in jobs:
            with pytest.raises(grain.GrainError, match="no worker came"):
                await job
        assert _status(exer) == ("0/5000 done, 0 running, 0 queued, 5000 failed (raised: "
                                 f"5000) | {NO_WORKER}")
        assert grain.ProgressLine(exer, None).text(narrow=True) == (
            "0:00:00 | 0/5000 done, 0 running, 0 queued, 5000 failed | no worker has joined yet")


@trio_test
async def test_once_its_workers_have_all_left_the_status_line_says_so(autojump_clock, caplog):
    # Not "no worker has joined yet" (with how to start some) once one joined and left:
    # the status line, the stuck queue's warning and explain name what happened.
    async with grain.GrainExecutor(progress=False) as exer, trio.open_nursery() as nursery:
        service = grain.HeadService(exer, None, None)
        head_side, fake_side = trio.testing.memory_stream_pair()
        nursery.start_soon(service.handle_connection, head_side, "node1")
        register = ("register", {"name": "w1", "res": Cores([0]), "pid": 1})
        await fake_side.send_all(grain.encode_frame(grain.dumps_control(register)))
        await exer.wait_for_workers(1)
        await fake_side.aclose()
        while exer.workers:
            await trio.sleep(0.1)
        gone = "no worker is connected: the 1 that joined have left"
        job = exer.submit(Cores(1), _calculation, 1)
        assert _status(exer) == f"0/1 done, 0 running, 1 queued, 0 failed | {gone}"
        with caplog.at_level(logging.WARNING, logger="grain"):
            await trio.sleep(grain.STUCK_WARN_S + grain.STUCK_CHECK_S)
        assert "has fitted no worker for 6" in caplog.text and f"s; {gone}; 1 job(s) queued" \
            in caplog.text and "no worker has joined yet" not in caplog.text, caplog.text
        assert [w["reason"] for w in exer.scheduler.explain()] == [gone]
        exer.fail_queued("no worker came")
        with pytest.raises(grain.GrainError, match="no worker came"):
            await job


def test_the_progress_line_shows_true_counts_on_a_terminal_only(tmp_path):
    script = tmp_path / "mission.py"
    script.write_text(PROGRESS_MISSION.format(here=HERE, extra=""))
    out = _run_in_pty(script)
    status = re.findall(r"\r\x1b\[K(\d+:\d\d:\d\d[^|\r\n]*\| (\d+)/(\d+) done, (\d+) running, "
                        r"(\d+) queued, (\d+) failed \| (\d+)/4 cores busy on 1 worker\(s\))",
                        out)
    assert len(status) >= 2, out
    for _, done, total, running, queued, failed, busy in status:
        done, total, running, queued, busy = map(int, (done, total, running, queued, busy))
        if total:  # (the first redraw may come before the first job)
            assert total == 40 and done + running + queued == 40 and failed == "0"
            assert running == busy <= 4
    # what the jobs print never shares a line with it: it is cleared first
    for line in out.replace("\r\x1b[K", "\n").splitlines():
        assert "hello" not in line or re.fullmatch(r"hello \d+\r?", line), line
    assert "sum 780" in out
    assert re.search(r"Time elapsed for all jobs: [\d.]+s; 40 jobs, [\d.e-]+ core-hours used "
                     r"of [\d.e-]+ allocated \(\d+% utilization\)", out)
    # off with progress=False, and off when the output is not a terminal
    script.write_text(PROGRESS_MISSION.format(here=HERE, extra=", progress=False"))
    assert "\x1b[K" not in _run_in_pty(script)
    script.write_text(PROGRESS_MISSION.format(here=HERE, extra=""))
    piped = run_py(str(script))
    assert piped.returncode == 0 and "\x1b[K" not in piped.stdout + piped.stderr
    assert "done," not in piped.stderr


@pytest.mark.skipif(_chromium() is None, reason="needs Chromium (CI installs Debian's)")
def test_the_mission_report_renders_in_a_real_browser(tmp_path):
    report = tmp_path / "mission.html"
    script = tmp_path / "mission.py"
    script.write_text(REPORT_MISSION.format(here=HERE, n=30, seconds=0.02, report=str(report)))
    cp = run_py(str(script))
    assert cp.returncode == 0, cp.stderr
    page = report.read_text()
    assert "<script" not in page and "http" not in page.split("<body>")[1]  # self-contained
    # the slowest jobs say how long they waited for a core: 30 jobs on 4 cores, most did
    waited = [float(w) for w in re.findall(r"<tr><td>#\d+ work\(\d+\)</td><td>[\d.]+</td>"
                                           r"<td>([\d.]+)</td>", page)]
    assert waited and max(waited) > 0, page
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               "--enable-logging=stderr", "--v=0", f"file://{report}"]
    dom = subprocess.run(browser[:-1] + ["--dump-dom", browser[-1]], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    bars = re.findall(r'<rect class="job( failed)?"', dom.stdout)
    assert len(bars) == 30 and sum(1 for b in bars if b) == 4   # 3, 10, 17 and 24 failed
    assert "ValueError: bad input 10" in dom.stdout and ">30<" in dom.stdout
    assert "CONSOLE" not in dom.stderr and "Uncaught" not in dom.stderr, dom.stderr
    shot = subprocess.run(browser[:-1] + [f"--screenshot={tmp_path / 'report.png'}",
                                          "--window-size=1200,900", browser[-1]],
                          capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and (tmp_path / "report.png").stat().st_size > 10_000


def test_a_report_that_cannot_be_written_costs_the_mission_nothing(tmp_path, caplog):
    async def main():
        gone.rmdir()   # its directory goes while the mission runs
        return 7

    with pytest.raises(grain.GrainError, match=f"no directory {tmp_path}/none$"):
        run(main, local=Cores(1), config_file=False, report=str(tmp_path / "none" / "r.html"))
    with pytest.raises(grain.GrainError, match="a directory, not a file"):
        run(main, local=Cores(1), config_file=False, report=str(tmp_path))
    gone = tmp_path / "gone"
    gone.mkdir()
    with caplog.at_level(logging.ERROR, logger="grain"):
        assert run(main, local=Cores(1), config_file=False, report=str(gone / "r.html")) == 7
    assert f"the mission report {gone}/r.html could not be written" in caplog.text


def test_a_report_of_ten_thousand_jobs_stays_readable(tmp_path):
    report = tmp_path / "big.html"
    script = tmp_path / "mission.py"
    script.write_text(REPORT_MISSION.format(here=HERE, n=10_000, seconds=0,
                                            report=str(report)))
    cp = run_py(str(script), timeout=120)
    assert cp.returncode == 0, cp.stderr
    page = report.read_text()
    single = len(re.findall(r'<rect class="job', page))
    merged = len(re.findall(r'<rect class="jobs"', page))
    assert merged and single + merged <= grain.REPORT_MAX_BARS   # bars thinner than a pixel
    assert len(page) < 2_000_000 and ">10000<" in page           # merge


###############################################################################
# Executor ####################################################################
###############################################################################


async def _flaky_once(state):
    state.append(1)
    if len(state) == 1:
        raise KeyError("the first time only")
    return len(state)


def test_executor_synchronous_use():
    async def double(x):
        await trio.sleep(0.01)
        return 2 * x, GVAR.res.N

    with grain.GrainExecutor(rpw=Cores(4)) as exer:
        for x in range(6):
            exer.submit(Cores(1 + x % 2), double, x)
    assert exer.results == [(0, 1), (2, 2), (4, 1), (6, 2), (8, 1), (10, 2)]

    async def maybe(x):
        if x % 2:
            raise ValueError(x)
        return x

    with pytest.raises(ExceptionGroup) as info:
        with grain.GrainExecutor(rpw=Cores(2)) as exer:
            for x in range(4):
                exer.submit(Cores(1), maybe, x)
    assert sorted(e.args[0] for e in info.value.exceptions) == [1, 3]
    assert exer.results[0] == 0 and exer.results[2] == 2  # the others' results are kept


def test_run_and_the_executor_take_upstreams_arguments(caplog):
    async def main():
        return await (add1 @ Cores(1))(1)

    assert run(main, [], Cores([0]), config_file=False) == 2  # positional waddrs, rpw
    caplog.set_level(logging.WARNING, "grain")
    assert run(main, [], Cores([0]), config_file=False, stat_tag=str) == 2
    assert "run(stat_tag=...) has no effect" not in caplog.text  # (GrainExecutor says it)
    assert "GrainExecutor(stat_tag=...) has no effect in grain.py" in caplog.text
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        run(main, local=Cores([0]), config_file=False, bogus=1)
    # (an argument that has no effect leaves the others alone: the local worker's name)
    assert grain.GrainExecutor(name="mine", stat_tag=str).local_name == "mine"

    # upstream's passive workers are host names (port 4242)
    assert grain.GrainExecutor(["node1", "tcp://node2:7"]).waddrs == [
        "tcp://node1:4242", "tcp://node2:7"]
    with pytest.raises(ValueError, match="unsupported address scheme 'udp'"):
        grain.GrainExecutor(["udp://node1:1"])

    async def exercise():
        async with grain.GrainExecutor([], Cores([0])) as exer:  # upstream's (waddrs, rpw)
            assert [w.name for w in exer.workers] == ["local"]
        async with grain.GrainExecutor(rpw=Cores([0]), nolocal=True) as exer:
            assert exer.workers == []
        tries = []

        async def flaky():
            tries.append(1)
            raise KeyError("temporary")

        async with grain.GrainExecutor(rpw=Cores(1), temporary_err=(KeyError,),
                                       reschedule=False) as exer:  # upstream: abort at once
            with pytest.raises(KeyError):
                await exer.submit(Cores(1), flaky)
        assert len(tries) == 1

    trio.run(exercise)


def test_a_failing_job_without_resources_is_retried_not_stranded():
    # With temporary_err, a ZERO job that failed once went back to the resource queue,
    # where no worker ever took it: the mission hung.
    async def bare():
        async with grain.GrainExecutor(temporary_err=(KeyError,)) as exer:
            with trio.fail_after(10):
                return await exer.submit(ZERO, _flaky_once, [])

    assert trio.run(bare) == 2

    async def delayed_main():
        with trio.fail_after(10):
            return await delayed(_flaky_once)([])

    assert run(delayed_main, local=ZERO, config_file=False, temporary_err=(KeyError,)) == 2

    async def combine_main():
        with trio.fail_after(10):
            return await grain.exec1(ZERO, _flaky_once, [])

    assert grain.combine.run(combine_main, [], ZERO, config_file=False,
                             temporary_err=(KeyError,)) == 2


@trio_test
async def test_with_persistent_false_a_lost_worker_fails_its_jobs(workers, tmp_path):
    pidfile = tmp_path / "pid"
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0", persistent=False) as exer:
        w = workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
        await exer.wait_for_workers(1)
        job = exer.submit(Cores(1), pid_then_sleep, str(pidfile), 30)
        with trio.fail_after(10):
            while not pidfile.exists():
                await trio.sleep(0.05)
        w.kill()
        with pytest.raises(grain.WorkerLostError):  # upstream: abort when a worker leaves
            await job
        assert job.attempts == 1


@trio_test
async def test_a_failed_mission_stops_its_remote_jobs(workers, tmp_path):
    pidfile = tmp_path / "pids"
    with pytest.raises(KeyError):
        async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
            w = workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}')
            await exer.wait_for_workers(1)
            exer.submit(Cores(1), pid_then_sleep, str(pidfile), 60)
            with trio.fail_after(10):
                while not pidfile.exists():
                    await trio.sleep(0.02)
            raise KeyError("the mission's own bug")
    t0 = trio.current_time()
    assert await wait_exit(w) == 0 and trio.current_time() - t0 < 10


def test_contextmod_and_head_log_file_reach_the_local_worker(tmp_path):
    (tmp_path / "ctx.py").write_text(textwrap.dedent("""
        from contextlib import asynccontextmanager
        @asynccontextmanager
        async def grain_context():
            yield "from the context module"
    """))
    cfg = tmp_path / "grain.toml"
    cfg.write_text(f'contextmod = "{tmp_path}/ctx.py"\naddress = "edge://{tmp_path}/edge"\n'
                   f'[head]\nlog_file = "{tmp_path}/jobs.log"\n')
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        from grain import GVAR
        from grain.delayed import delayed, run
        from grain.resource import Cores

        @delayed
        async def job():
            print("the job prints this")
            return GVAR.context

        async def main():
            print("main prints this")
            return await (job @ Cores(1))(), await job()

        print(run(main, local=Cores(1), config_file={str(cfg)!r}))
    """)
    cp = run_py("-c", code)
    assert cp.returncode == 0, cp.stderr
    assert "main prints this" in cp.stdout and "the job prints this" not in cp.stdout
    assert "('from the context module', 'from the context module')" in cp.stdout
    assert (tmp_path / "jobs.log").read_text() == "the job prints this\nthe job prints this\n"


###############################################################################
# Combine #####################################################################
###############################################################################


async def _square(x):
    await trio.sleep(0.01 * (5 - x))
    return x * x


def test_waitgroup_subtasks_exec1_and_run_combine():
    async def subtask(base):
        async with grain.open_waitgroup() as wg:
            for x in range(base, base + 2):
                wg.submit(Cores(1), _square, x)
        return sum(wg.results)

    async def main():
        async with grain.open_waitgroup() as wg:
            wg.submit(Cores(1), _square, 1)
            wg.start_subtask(subtask, 2)
            wg.submit(ZERO, _square, 3)
        one = await grain.exec1(Cores(2), _square, 4)
        return wg.results, one

    assert grain.run_combine(main, rpw=Cores(2)) == ([1, 4 + 9, 9], 16)
    # Top-level parallelism: a list of mains.
    assert grain.run_combine([functools.partial(_square, 2), functools.partial(_square, 3)],
                             rpw=Cores(1)) == [4, 9]


def test_waitgroup_failure_keeps_other_results():
    async def maybe(x):
        if x == 1:
            raise KeyError(x)
        return x

    async def main():
        try:
            async with grain.open_waitgroup() as wg:
                for x in range(3):
                    wg.submit(Cores(1), maybe, x)
        except ExceptionGroup as eg:
            return wg.results[0], wg.results[2], [type(e) for e in eg.exceptions]

    assert grain.run_combine(main, rpw=Cores(1)) == (0, 2, [KeyError])


@trio_test
async def test_combine_outside_a_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"grain.exec1\(\) needs a running grain mission"):
        await grain.exec1(Cores(1), _square, 1)
    with pytest.raises(RuntimeError, match="open_waitgroup"):
        async with grain.open_waitgroup():
            pass


def test_combine_asubmit_and_the_cache_protocol():
    cache, calls = {3: 30}, []

    async def compute(x, scale=10):
        calls.append(x)
        return x * scale

    async def lookup(x):
        if x == 5:  # a lookup that raises here found nothing; as a job, its error counts
            raise OSError("the cache is unreadable")
        return x in cache, cache.get(x)

    compute.cache_fn = lookup

    async def main():
        async with grain.open_waitgroup() as wg:
            await wg.asubmit(Cores(1), compute, 2)
            wg.load_cache_or_submit(Cores(1), compute, 3)  # cached: no job
            wg.load_cache_or_submit(Cores(1), compute, 4, scale=2)
            if compute.cache_res is ZERO:
                wg.load_cache_or_submit(Cores(1), compute, 5)
        return wg.results, await grain.combine.load_cache_or_exec1(Cores(1), compute, 3)

    compute.cache_res = ZERO  # the lookup runs here
    assert grain.combine.run(main, [], Cores([0]), config_file=False) == ([20, 30, 8, 50], 30)
    assert sorted(calls) == [2, 4, 5]
    compute.cache_res, calls[:] = Cores(1), []  # the lookup is a job of its own
    assert grain.combine.run(main, [], Cores([0]), config_file=False) == ([20, 30, 8], 30)
    assert sorted(calls) == [2, 4]


@trio_test
async def test_queue_limiter_and_a_nursery_with_capacity(autojump_clock):
    running, peak = [0], [0]

    async def busy(i):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await trio.sleep(1)
        running[0] -= 1
        return i

    async def main():
        total = 0
        async with grain.util.QueueLimiter(3) as ql:
            for i in range(10):
                total += await ql(delayed(busy) @ Cores(1))(i)
        return await total

    assert await _in_mission(main, local=Cores(8)) == 45
    assert peak[0] == 3 and trio.current_time() == 4   # ceil(10 / 3) rounds of 1 s
    peak[0] = 0
    async with grain.util.open_nursery_with_capacity(2) as nursery:
        for i in range(5):
            await nursery.start_once_acquired(busy, i)
    assert peak[0] == 2 and trio.current_time() == 7
    # a capacity of 0 would start nothing, ever: refused, as the limiter's is
    with pytest.raises(ValueError, match=r"QueueLimiter\(conc\) must be a whole number >= 1"):
        async with grain.util.QueueLimiter(0):
            pass
    with pytest.raises(ValueError, match=r"open_nursery_with_capacity\(conc\) must be a "
                       r"whole number >= 1, got 0"):
        async with grain.util.open_nursery_with_capacity(0):
            pass


def test_passive_workers_for_run_combine(workers, tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    w = workers.start("--listen", f"tcp://127.0.0.1:{port}", name="passive")

    async def main():
        async with grain.open_waitgroup() as wg:
            for i in range(3):
                wg.submit(Cores(1), where_am_i, i, 0.3)
        return wg.results

    deadline = time.monotonic() + 15
    while "waiting for a head" not in w.log_path.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    results = grain.run_combine(main, [f"tcp://127.0.0.1:{port}"], rpw=Cores(1),
                                address=False)
    assert {r[1] for r in results} <= {w.pid, os.getpid()} and w.pid in {r[1] for r in results}
    assert w.wait(15) == 0


###############################################################################
# Delayed #####################################################################
###############################################################################


class Box:
    def __init__(self, v):
        self.v = v

    def times(self, k):
        return self.v * k


async def _two(x):
    return x, x + 1


@trio_test
async def test_seed_tutorial_timings(autojump_clock):
    # The tutorial's second program: jobs of 0.1/0.2/0.3 s on two cores take 0.4 s.
    async def elevated_sum(l):
        s_ = 0
        for x in l:
            s_ += (add1 @ Cores(1))(x)
        return await s_

    assert await _in_mission(functools.partial(elevated_sum, [1, 2, 3])) == 9
    assert trio.current_time() == pytest.approx(0.4)

    # Program 3: three branches in parallel; 2.3 s on two cores when the branches submit in
    # the order of the seed's run (trio starts new tasks in a random order, so the test
    # fixes it by a 1 ms stagger).
    t0 = trio.current_time()

    async def staggered(delay, l):
        await trio.sleep(delay)
        return await elevated_sum(l)

    async def main():
        data = [[7, 8, 9], [4, 5, 6], [1, 2, 3]]
        return await each(delayed(staggered)(i / 1000, d) for i, d in enumerate(data))

    assert await _in_mission(main) == [27, 18, 9]
    assert trio.current_time() - t0 == pytest.approx(2.3, abs=0.005)

    # Program 1: no resources: all three run at once (0.3 s).
    t0 = trio.current_time()

    async def zero_sum():
        return await (add1(1) + add1(2) + add1(3))

    assert await _in_mission(zero_sum, local=None) == 9
    assert trio.current_time() - t0 == pytest.approx(0.3)


@pytest.mark.parametrize("script,expect", [
    ("tutorial.py", ["elevated_sum([1, 2, 3]) = 9"]),
    ("tutorial_resources.py", ["elevated_sum([1, 2, 3]) = 9", "with resource CPU_Cores([0])"]),
    ("tutorial_parallel.py", ["elevated_sum([7, 8, 9]) = 27", "elevated_sum([4, 5, 6]) = 18",
                              "elevated_sum([1, 2, 3]) = 9", "[9, 18, 27]"]),
    # upstream's own example, reading GVAR it did not import
    ("subproc.py", ["Running in a subprocess with CPU_Cores([0])\n" * 2]),
    ("programs.py", ["3 squared is 9 (2 thread(s))", "[1, 4, 9, 16]"]),
])
def test_examples_run_unchanged(script, expect):
    cp = run_py(os.path.join("examples", script))
    assert cp.returncode == 0, cp.stderr
    for line in expect:
        assert line in cp.stdout
    assert "Time elapsed for all jobs:" in cp.stderr
    if script == "tutorial.py":  # three calls, none asking for resources: no job, no bill
        assert cp.stderr.rstrip().endswith("; no job asked for resources; 3 call(s) without "
                                           "resources ran in the mission"), cp.stderr


@trio_test
async def test_delayed_operators_and_composition():
    async def main():
        a, b = (add1 @ Cores(1))(1), (add1 @ Cores(1))(2)
        assert await (a + b) == 5 and await (b - a) == 1 and await (a * 10) == 20
        assert await (10 - a) == 8 and await (-a) == -2 and await (b ** 2) == 9
        assert await (b / a) == 1.5 and await (b // a) == 1 and await (7 % b) == 1
        assert await (abs(-b)) == 3 and await (a < b) is True and await (a == 2) is True
        assert await divmod(b, a) == (1, 1)
        lst = make([1, 2, 3])
        assert await lst[1] == 2 and await lst[-1] == 3
        box = make(Box(4))
        assert await box.v == 4 and await box.times(3) == 12
        d = make({"k": 1})
        d2 = d          # another name for the same placeholder
        other = make(d)  # a job that received the old value
        d["k"] = 2
        d["j"] = a
        assert await d == {"k": 2, "j": 2} and await d2 == {"k": 2, "j": 2}
        assert await other == {"k": 1}
        plain = grain.delayedval({"a": 0})
        before = make(plain)
        summed = plain["a"] + 1
        plain["a"] = 5
        assert await before == {"a": 0} and await summed == 1 and await plain == {"a": 5}
        x, s = pair(5)
        assert await x == 5 and await s == "5"
        assert await each(a, b, 7) == [2, 3, 7] and await each([a, b]) == [2, 3]
        assert await grain.delayedval(41) + 1 == 42
        assert await add1(a) == 3         # a Delayed argument is awaited first
        assert await make([a, {"x": b}]) == [2, {"x": 3}]
        return True

    assert await _in_mission(main)


@trio_test
async def test_delayed_with_numpy():
    np = pytest.importorskip("numpy")

    async def main():
        arr = make(np.arange(4))
        assert (await np.add(arr, 1)).tolist() == [1, 2, 3, 4]
        assert await np.sum(arr) == 6
        assert (await (np.ones(4) + arr)).tolist() == [1, 2, 3, 4]
        assert (await np.concatenate([arr, arr])).tolist() == [0, 1, 2, 3] * 2
        return True

    assert await _in_mission(main)


@trio_test
async def test_a_long_chain_does_not_recurse(autojump_clock):
    async def main():
        s = 0
        for i in range(20_000):
            s += delayed(make)(i)
        return await s

    assert await _in_mission(main) == sum(range(20_000))


@trio_test
async def test_delayed_misuse_gives_type_errors():
    async def main():
        x = make(1)
        with pytest.raises(TypeError, match="truth value of a Delayed"):
            bool(x)
        with pytest.raises(TypeError, match="cannot set attribute 'y'"):
            x.y = 1
        with pytest.raises(TypeError, match=r"nout=N"):
            a, b = x
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(x)
        return await x

    assert await _in_mission(main) == 1

    def sync_fn(x):
        return x

    with pytest.raises(TypeError, match=r"sync_fn is sync.*@subprocify"):
        delayed(sync_fn)


@trio_test
async def test_calling_delayed_outside_run_is_a_clear_error_but_values_await_anywhere():
    with pytest.raises(RuntimeError, match="calling the delayed function"):
        add1(1)
    # A placeholder that needs no job can be awaited anywhere, as upstream's tests do.
    assert await (grain.delayedval(1) + 1) == 2
    pair = grain.delayedval([3, 4], length=2)
    a, b = pair
    pair[1] += 99
    assert await pair == [3, 103] and await a == 3 and await b == 4
    shared = grain.delayedval([3, 4], length=2, copy_on_setitem=False)
    a, b = shared
    shared[1] = 9
    assert await shared == [3, 9] and await b == 9  # the value itself was changed
    with pytest.raises(AttributeError):
        grain.delayedval([1])._hidden()


def test_run_accepts_rpw_alias_and_rejects_both():
    async def main():
        return await (add1 @ Cores(1))(0), str(GVAR.res)

    assert run(main, rpw=Cores([0]), config_file=False) == (1, "Ø")
    with pytest.raises(TypeError, match="not both"):
        run(main, local=Cores(1), rpw=Cores(1))


def test_a_resource_argument_that_is_not_one_is_named_as_written():
    async def main():
        pass

    for call, said in [(lambda: run(main, local=4), "run(): local="),
                       (lambda: run(main, rpw=4, config_file=False), "rpw=")]:
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == f"{said} must be a Resource such as Cores(4), got 4"


@trio_test
async def test_failed_delayed_job_raises_original_type():
    @delayed
    async def boom():
        raise ZeroDivisionError("boom")

    async def main():
        with pytest.raises(ZeroDivisionError, match="boom"):
            await ((boom @ Cores(1))() + 1)
        return "survived"

    assert await _in_mission(main) == "survived"


def test_delayed_forms_and_resource_less_calls_start_in_call_order():
    order = []

    async def note(i):
        order.append(i)  # before its first pause: the order calls started in
        await trio.sleep(0)

    pair = delayed(_two, 2)  # upstream's positional nout
    note_ = delayed(note)

    async def main():
        a, b = pair(1)
        await each(reversed([note_(i) for i in range(40)]))
        return await a, await b

    for _ in range(5):  # trio starts tasks of one batch in a random order
        order.clear()
        assert run(main, local=ZERO, config_file=False) == (1, 2)
        assert order == list(range(40))


def test_numpy_oneline_repr():
    np = pytest.importorskip("numpy")
    grain.util.set_numpy_oneline_repr()
    try:
        assert repr(np.arange(10)) == "array[(10,)](0, 1, 2...)"
        assert repr(np.zeros((2, 2))) == "array[(2, 2)](0.0, 0.0, 0.0...)"
    finally:
        grain.util.set_numpy_oneline_repr(False)
    assert repr(np.arange(3)) == "array([0, 1, 2])"


###############################################################################
# Worker process ##############################################################
###############################################################################


@pytest.mark.parametrize("args,message", [
    (["--res", "{bad"], "--res: malformed JSON"),
    (["--res", '{"GPU": {"N": 1}}'], "unknown resource kind 'GPU'"),
    (["--res", '{"Cores": {"N": 9999}}'], "asks for 9999 cores but this process may use only"),
    (["--url", "http://head:80"], "unsupported address scheme 'http'"),
    (["--url", "edge:///no/such/dir/edge"], "directory /no/such/dir does not exist"),
    (["--name", " "], "--name takes a name, got an empty one"),
    (["--context", "/tmp"], "--context /tmp: a directory, not a file"),
])
def test_worker_bad_input(args, message):
    cp = grain_cli("worker", *args)
    assert cp.returncode == 2
    assert message in cp.stderr and cp.stderr.count("\n") == 1, cp.stderr


def test_a_worker_asked_for_more_cores_or_gpus_than_it_has_names_oversubscribe():
    allowed = sorted(os.sched_getaffinity(0))
    way_out = "; --oversubscribe offers more, as virtual ids (for tests and benchmarks)\n"
    cp = grain_cli("worker", "--res", '{"Cores": {"N": 9999}}')
    assert cp.returncode == 2 and cp.stderr == (
        f"grain.py worker: --res asks for 9999 cores but this process may use only "
        f"{len(allowed)} ({grain._fmt_ids(allowed)}){way_out}")
    cp = grain_cli("worker", "--res", '{"Gpus": {"N": 99}}')
    assert cp.returncode == 2 and cp.stderr.startswith(
        "grain.py worker: --res asks for 99 GPU(s) but this machine shows ")
    assert cp.stderr.endswith(way_out) and cp.stderr.count("\n") == 1


def test_worker_without_a_head_at_a_tcp_address():
    cp = grain_cli("worker", "--url", "tcp://127.0.0.1:1")
    assert cp.returncode == 1 and "Traceback" not in cp.stderr
    assert cp.stderr.strip().startswith("grain.py worker: cannot reach a head at "
                                        "tcp://127.0.0.1:1: ")


def test_a_worker_stopped_while_it_waits_for_a_head_takes_its_edge_record_back(workers,
                                                                               tmp_path):
    edge = tmp_path / "edge"
    w = workers.start("--url", f"edge://{edge}", "--res", '{"Cores": {"N": 1}}')
    deadline = time.monotonic() + 30
    while not (edge.exists() and _json.loads(edge.read_text() or "{}").get("dialer")):
        assert time.monotonic() < deadline and w.poll() is None, w.log_path.read_text()
        time.sleep(0.05)  # (polling another process's file: nothing to await)
    sock = pathlib.Path(grain.parse_url(
        _json.loads(edge.read_text())["dialer"][0]["urls"]["unix"])[2])
    assert sock.parent == pathlib.Path(grain.private_dir()) and sock.exists()
    # A batch system's notice that it will suspend the job (Grid Engine's -notify) is
    # said, and the worker waits on: by default, SIGUSR1 would have killed it.
    w.send_signal(signal.SIGUSR1)
    wait_for(lambda: "got SIGUSR1: the batch system is about to suspend this job" in
             w.log_path.read_text(), 15, "the worker to say it got SIGUSR1")
    assert w.poll() is None and sock.exists()
    w.send_signal(signal.SIGTERM)
    assert w.wait(15) == 0
    assert _json.loads(edge.read_text())["dialer"] == [] and not sock.exists()
    assert "SIGTERM while waiting for a head; leaving" in w.log_path.read_text()


class _MissionFails(Exception):
    pass


async def _pause(seconds):
    import trio
    await trio.sleep(seconds)


@pytest.mark.parametrize("moment", ["calling", "joining", "registered", "job"])
@pytest.mark.parametrize("fails", [False, True])
@trio_test
async def test_a_mission_that_ends_as_its_worker_comes_leaves_it_serving_findable_or_gone(
        workers, tmp_path, monkeypatch, moment, fails):
    # A worker waiting in the Edge file is called by a mission that ends, or fails, at a
    # drawn moment of its coming: as the head calls it (before the handshake), once the
    # head holds its connection but not its registration, once registered, or with a job
    # (running, when the mission fails). A worker the head held hears its goodbye and
    # exits; one it did not is found by the next mission. Never a traceback, nor a
    # worker alive that no head can find (its record taken by a call cut short).
    rng = random.Random(f"{moment} {fails}")
    edge, held = tmp_path / "edge", trio.Event()  # (set: the head holds the connection)
    handle = grain.HeadService.handle_connection

    async def noted(service, *args):
        held.set()
        await handle(service, *args)

    monkeypatch.setattr(grain.HeadService, "handle_connection", noted)
    url = f"edge://{edge}"
    w = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}')
    with trio.fail_after(30):
        while '"did"' not in (edge.read_text() if edge.exists() else ""):
            await trio.sleep(0.05)  # (another process's file: nothing to await)
    with contextlib.suppress(_MissionFails):
        async with grain.GrainExecutor(listen=url) as exer:
            if moment != "calling":
                await held.wait()
            if moment in ("registered", "job"):
                await exer.wait_for_workers(1)
            if moment == "job":
                job = exer.submit(Cores(1), _pause, 30 if fails else 0.05)
                if not fails:
                    await job
            await trio.sleep(rng.uniform(0, {"calling": 5e-4, "joining": 0}.get(moment, 0.02)))
            was_held = held.is_set()
            if fails:
                raise _MissionFails
    if not was_held:  # it waits for a head, or heard a goodbye nonetheless
        async with grain.GrainExecutor(listen=url) as exer:
            with trio.fail_after(30):
                while w.poll() is None and not exer.workers:
                    await trio.sleep(0.05)  # (joined, or gone)
            if exer.workers:
                assert (await exer.submit(Cores(1), where_am_i, 1))[1] == w.pid
    with contextlib.suppress(trio.TooSlowError):
        await wait_exit(w)
    text = w.log_path.read_text()
    assert w.poll() == 0 and "Traceback" not in text and "grain.py worker:" not in text, text
    assert "lost the head" not in text or not was_held, text
    assert "the head said goodbye" in text or (fails and was_held), text


@trio_test
async def test_a_receive_loop_whose_write_finds_its_peer_gone_ends_as_at_its_close():
    # A worker told to leave as its mission failed answers "leaving" to a head that has
    # closed its end already: the write fails (EPIPE), which is the peer gone, as the end
    # of its input then says, not an error that ends the worker with a traceback.
    left, right = (trio.SocketStream(s) for s in trio.socket.socketpair())
    channel = grain.Channel(left, peer="the head")
    await right.aclose()
    channel.send(("leaving", "asked to quit now"))
    await channel.dispatch_all({})
    channel.send(("ping",))  # (nowhere to go: dropped)
    assert channel._out == []
    await left.aclose()


@trio_test
async def test_worker_context_module(workers, tmp_path):
    ctx = tmp_path / "ctx.py"
    ctx.write_text(textwrap.dedent("""
        from contextlib import asynccontextmanager
        from grain.subproc import subprocess_pool_scope

        @asynccontextmanager
        async def grain_context():
            async with subprocess_pool_scope():
                yield {"scratch": "/tmp/scratch"}
    """))

    async def job():
        from grain import GVAR
        return GVAR.context, await sp_info(2)

    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        w = workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}',
                          "--context", str(ctx), name="ctxw")
        await exer.wait_for_workers(1)
        context, (sq, child_pid, affinity, cores, inst) = await exer.submit(Cores(1), job)
    assert context == {"scratch": "/tmp/scratch"} and sq == 4 and inst == "ctxw"
    assert child_pid not in (w.pid, os.getpid()) and affinity == cores
    assert await wait_exit(w) == 0


def test_worker_reattach_option():
    cp = grain_cli("worker", "--reattach", "soon", "--url", "tcp://127.0.0.1:1")
    assert cp.returncode == 2
    assert cp.stderr.strip().endswith("--reattach: expected a duration such as 90s, 30m, 2h "
                                      "or hh:mm:ss, got 'soon'")
    s = grain.RoleSettings("worker", dial="edge:///x", reattach=300.0)
    assert "--reattach 300s" in grain.worker_command(s)


@trio_test
async def test_kill_9_of_a_worker_mid_job(workers, tmp_path):
    pidfile = tmp_path / "pids"
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        url = exer.urls["tcp"]
        first = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="first")
        await exer.wait_for_workers(1)
        job = exer.submit(Cores(1), pid_then_sleep, str(pidfile), 1.0)
        with trio.fail_after(10):
            while not pidfile.exists():
                await trio.sleep(0.02)
        second = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="second")
        await exer.wait_for_workers(2)
        first.kill()
        assert await job == second.pid
        assert exer.retried_by_class == {"worker lost": 1}
        assert [w.name for w in exer.workers] == ["second"]


@trio_test
async def test_a_worker_whose_walltime_ends_mid_mission(workers):
    async with grain.GrainExecutor(listen="tcp://127.0.0.1:0") as exer:
        url = exer.urls["tcp"]
        short = workers.start("--url", url, "--res",
                              '{"Cores": {"N": 1}, "WTime": {"T": 3, "countdown": true}}',
                              name="short")
        await exer.wait_for_workers(1)
        assert exer.workers[0].res.remaining() <= 3
        # Fits the worker's remaining time by softT, but runs past its walltime.
        job = exer.submit(Cores(1) & WTime(T=20, softT=1), where_am_i, 0, 5)
        too_long = exer.submit(Cores(1) & WTime(T=20, softT=10), where_am_i, 1)
        assert await wait_exit(short) == 0     # it leaves at its walltime, telling the head
        with trio.fail_after(5):
            while not exer.retried_by_class:
                await trio.sleep(0.05)
        assert exer.retried_by_class == {"worker retired": 1} and job.state == "queued"
        long = workers.start("--url", url, "--res", '{"Cores": {"N": 1}}', name="long")
        assert (await job)[3] == "long" and (await too_long)[3] == "long"
        assert job.attempts == 2 and too_long.attempts == 1   # never sent to "short"


@trio_test
async def test_sigterm_on_a_worker_requeues_its_jobs(workers, tmp_path):
    pidfile = tmp_path / "pids"
    async with grain.GrainExecutor(rpw=Cores(1), listen="tcp://127.0.0.1:0") as exer:
        w = workers.start("--url", exer.urls["tcp"], "--res", '{"Cores": {"N": 1}}',
                          name="slurmjob")
        await exer.wait_for_workers(1)
        job = exer.submit(Cores(1), pid_then_sleep, str(pidfile), 2)
        exer.submit(Cores(1), pid_then_sleep, str(pidfile), 2)
        with trio.fail_after(10):
            while len(pidfile.read_text().split() if pidfile.exists() else []) < 2:
                await trio.sleep(0.02)
        w.send_signal(signal.SIGTERM)
        assert await wait_exit(w) == 0
        await job
        assert exer.retried_by_class == {"worker retired": 1}


def test_a_worker_that_loses_its_head_leaves_when_its_grace_ends(workers, tmp_path):
    """worker.reattach: it keeps its job for a new head that long, then stops it and goes
    (its batch allocation with it: nothing is left holding resources)."""
    edge, marker, pidfile = tmp_path / "edge", tmp_path / "stopped", tmp_path / "pid"
    head = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time, trio; sys.path.insert(0, {HERE!r})
        from grain.delayed import delayed, run
        from grain.resource import Cores, ZERO

        @delayed
        async def long():
            open({str(pidfile)!r}, "w").write("running")
            try:
                await trio.sleep(600)
            finally:
                open({str(marker)!r}, "w").write(str(time.time()))

        async def main():
            await (long @ Cores(1))()
        # this process is the head; with a store, its jobs have keys a new head could claim
        run(main, local=ZERO, address="edge://{edge}", results={str(tmp_path / "r.db")!r})
    """)], cwd=HERE)
    try:
        (tmp_path / "grain.toml").write_text('[worker]\nreattach = "2s"\n')
        w = workers.start("--url", f"edge://{edge}", "-c", str(tmp_path / "grain.toml"),
                          name="orphan")
        wait_for(pidfile.exists, 20, "the job to start")
        head.kill()
        lost = time.time()
        assert w.wait(15) == 0
        log = w.log_path.read_text()
        assert "keeping 1 running job(s) and looking for a head for 2 s" in log, log
        assert "no head came within 2 s (worker.reattach); leaving, stopping 1 job(s)" in log
        assert float(marker.read_text()) - lost > 1.5   # it ran on through the grace
    finally:
        head.kill()
        head.wait()


@trio_test
async def test_a_worker_that_lost_its_head_resends_only_the_last_result_of_a_job():
    # A job failed with a temporary error and was run again; both results were sent to a
    # head that then died. The next head must get the last one only: the first would be
    # retried there, and the job run once more (found by the fault campaign, seed 21).
    w = grain.WorkerProcess("w", {}, reattach=60.0)
    w.channel = _FakeChannel()
    failed = ("done", "k#0", False, b"flaky", 0.1, "temporary")
    w.send(failed)
    w.send(("done", "k#0", True, b"0", 0.2, None))   # its retry, on the same wire
    w.send(("done", "other#0", True, b"1", 0.3, None))
    w.send(("done", "again#0", True, b"2", 0.3, None))
    w.running["again#0"] = (trio.CancelScope(), Cores([0]))   # ... run again: it will say
    assert w._lost("connection closed")
    assert w.outbox == [("done", "k#0", True, b"0", 0.2, None),
                        ("done", "other#0", True, b"1", 0.3, None)]


async def _raises_boom():
    raise ValueError("boom")


@trio_test
async def test_a_worker_heads_the_traceback_it_sends_with_its_name():
    # Whichever head reads it, the mission's own or a daemon between (which never opens
    # it), or the next head after a crash, the traceback names the worker that ran the job.
    worker = grain.WorkerProcess("node-7", {"name": "node-7"})
    worker_side, head = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.serve, worker_side, Cores([0]), None)
        for msg in (("fn", "d", grain.dumps_job_value(_raises_boom, "")),
                    ("run", 1, "d", grain.NO_ARGS_PAYLOAD, Cores([0]), None)):
            await head.send_all(grain.encode_frame(grain.dumps_control(msg)))
        done = (await _read_messages(grain.FrameStream(head), 2))[1]
        nursery.cancel_scope.cancel()
    heading = "Traceback on worker node-7:\nTraceback (most recent call last):\n"
    done_tb = grain.loads_job_value(done[3])[1]
    assert done_tb.startswith(heading)   # as it travels
    _, error = grain.unpickle_result(grain.Job(1, Cores(1), _raises_boom, (), {}), *done[2:4])
    assert str(error) == "boom" and error.__notes__ == [done_tb.rstrip()]


###############################################################################
# Head daemon #################################################################
###############################################################################


class InProcessDaemon:
    """A HeadDaemon in this process, its workers and missions fakes at the other end of
    memory streams: its policies, on trio's autojump clock, to the exact second."""

    def __init__(self, nursery, **options):
        self.daemon = grain.HeadDaemon("tcp://127.0.0.1:0", b"k" * 32, **options)
        self.nursery = nursery
        self.started = []        # (time, mission, ref) of each job, as the worker got it
        self.one_started = trio.Event()
        if nursery is not None:  # (its reunion: held jobs run when their hold ends)
            grain.start_head(self.daemon, nursery, self.daemon._push_held)

    def _peer(self, name):
        head_side, side = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self.daemon.service.handle_connection, head_side, name)
        return side

    def worker(self, cores, seconds):
        """A worker that runs each job for ``seconds``."""
        async def serve(stream):
            async with grain.open_channel(stream, "the daemon") as ch, \
                    trio.open_nursery() as jobs:
                ch.send(("register", {"name": "w", "res": Cores(cores), "pid": 1}))
                while (msg := await ch.receive()) is not None:
                    if msg[0] == "run":
                        jobs.start_soon(run, ch, msg[1])

        async def run(ch, jid):
            mission, ref = jid.split("/")
            self.started.append((trio.current_time(), mission, int(ref)))
            self.one_started.set()
            await trio.sleep(seconds)
            ch.send(("done", jid, True, grain.dumps_job_value(None, ""), seconds))

        self.nursery.start_soon(serve, self._peer("worker"))

    async def mission(self, name, n, prioritized=False):
        """A mission of ``n`` jobs of one core; returns when all came back."""
        async with grain.open_channel(self._peer(name), "the daemon") as ch:
            ch.send(("mission", {"name": name, "token": name, "prioritized": prioritized}))
            assert (await ch.receive())[0] == "attached"
            ch.send(("fn", b"digest", grain.dumps_job_value(abs, ""), "f"))
            for ref in range(n):
                ch.send(("job", ref, Cores(1), b"digest", grain.NO_ARGS_PAYLOAD))
            done = 0
            while done < n:
                done += (await ch.receive())[0] == "done"


@trio_test
async def test_the_head_daemon_keeps_the_collector_off_a_large_queue_until_it_is_idle(
        monkeypatch, autojump_clock):
    # As a mission does (the test above): each FREEZE_JOBS jobs it takes, the daemon freezes
    # the collector's view of the heap, so its queue of a million jobs is not walked by
    # each full collection; so it does with what it holds when a mission attaches (its
    # workers); when no mission is attached any more, it unfreezes it.
    monkeypatch.setattr(grain, "FREEZE_JOBS", 10)  # (100,000 in real use)
    before = gc.get_freeze_count()  # (not 0 on Python 3.12: see the test above)
    try:
        async with trio.open_nursery() as nursery:
            d = InProcessDaemon(nursery)
            async with grain.open_channel(d._peer("m"), "the daemon") as ch:
                ch.send(("mission", {"name": "m", "token": "m"}))
                assert (await ch.receive())[0] == "attached"
                attached = gc.get_freeze_count()
                assert attached > before                 # what the daemon held then
                ch.send(("fn", b"digest", grain.dumps_job_value(abs, ""), "f"))
                for ref in range(9):
                    ch.send(("job", ref, Cores(1), b"digest", grain.NO_ARGS_PAYLOAD))
                while d.daemon.scheduler.n_queued < 9:   # (no worker: they wait)
                    await trio.sleep(0.1)
                assert gc.get_freeze_count() <= attached  # a small queue freezes nothing
                for ref in range(9, 25):
                    ch.send(("job", ref, Cores(1), b"digest", grain.NO_ARGS_PAYLOAD))
                while d.daemon.scheduler.n_queued < 25:
                    await trio.sleep(0.1)
                frozen = gc.get_freeze_count()
            while d.daemon.missions:                     # the mission leaves...
                await trio.sleep(0.1)
            assert frozen > attached + 25 and gc.get_freeze_count() == 0  # ...walked again
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()


async def _two_missions_on_one_core(b_prioritized):
    """Mission a's three jobs, then (once its first started) b's three, on one core, each
    job 10 s: when each started, and whose it was."""
    async with trio.open_nursery() as nursery:
        d = InProcessDaemon(nursery)
        d.worker(cores=1, seconds=10)
        async with trio.open_nursery() as missions:
            missions.start_soon(d.mission, "a", 3)
            await d.one_started.wait()
            missions.start_soon(d.mission, "b", 3, b_prioritized)
        nursery.cancel_scope.cancel()
    return [(t - d.started[0][0], m) for t, m, _ in d.started]


@trio_test
async def test_the_daemon_serves_missions_round_robin_on_the_clock(autojump_clock):
    # from b's arrival on, the two missions' jobs in turn
    assert await _two_missions_on_one_core(False) == [
        (0, "a"), (10, "b"), (20, "a"), (30, "b"), (40, "a"), (50, "b")]


@trio_test
async def test_a_prioritized_mission_goes_first_on_the_clock(autojump_clock):
    # the running job ends; then all of the prioritized mission's; then the rest
    assert await _two_missions_on_one_core(True) == [
        (0, "a"), (10, "b"), (20, "b"), (30, "b"), (40, "a"), (50, "a")]


@trio_test
async def test_through_a_head_daemon_the_status_line_counts_what_its_workers_run(
        autojump_clock, caplog):
    # A mission's jobs wait on a daemon with no worker; a worker of two cores joins and
    # runs them, 10 s each; Ctrl-C 15 s later. Running is what a worker started; the
    # workers and cores are the daemon's, not the daemon as a worker of the mission.
    async def attach():
        return d._peer("mission")

    async with trio.open_nursery() as nursery:
        d = InProcessDaemon(nursery)
        setup = grain.MissionSetup(attach=attach, info={"name": "m"})
        with caplog.at_level(logging.INFO, logger="grain"), pytest.raises(KeyboardInterrupt):
            async with grain.GrainExecutor(key=b"k" * 32, mission=setup, progress=False) as exer:
                assert _status(exer) == ("0/0 done, 0 running, 0 queued, 0 failed | not "
                                         "attached to the head daemon yet")
                for i in range(3):
                    exer.submit(Cores(1), _calculation, i)
                await exer.wait_for_workers(1)   # attached
                await trio.sleep(15)
                assert _status(exer) == f"0/3 done, 0 running, 3 queued, 0 failed | {NO_WORKER}"
                d.worker(cores=2, seconds=10)
                for i in range(3, 10):
                    exer.submit(Cores(1), _calculation, i)
                await trio.sleep(5)
                assert _status(exer) == ("0/10 done, 2 running, 8 queued, 0 failed | 2/2 cores "
                                         "busy on 1 worker(s)")
                await trio.sleep(10)
                assert _status(exer) == ("2/10 done, 2 running, 6 queued, 0 failed | 2/2 cores "
                                         "busy on 1 worker(s)")
                raise KeyboardInterrupt
        nursery.cancel_scope.cancel()
    # billed: two jobs for 10 s, two for 5 s; not the waits, nor the jobs that never ran
    assert re.search(r"; 10 jobs \(2 done, 8 not ended\), 0.00833 core-hours used$",
                     caplog.text, re.M)


@trio_test
async def test_a_mission_hands_its_jobs_to_the_next_daemon_on_the_clock(autojump_clock, caplog):
    # The daemon dies 5 s into a job of 60 s, its worker with it. The mission attaches to
    # the next daemon, which holds the job REJOIN_WAIT_S for that worker, then runs it on
    # its own worker: the result comes 5 + 10 + 60 s after the start. The mission is told
    # why it waited, as a mission that is its own head would be (it was not told).
    daemons = []

    async def attach():
        return daemons[-1]._peer("mission")

    async def daemon_life(task_status):
        async with trio.open_nursery() as nursery:
            daemons.append(InProcessDaemon(nursery))
            daemons[-1].worker(cores=1, seconds=60)
            task_status.started(nursery.cancel_scope)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        first = await nursery.start(daemon_life)
        setup = grain.MissionSetup(attach=attach, info={"name": "m"})
        async with grain.GrainExecutor(key=b"k" * 32, mission=setup) as exer:
            t0 = trio.current_time()
            job = exer.submit(Cores(1), _square, 3)
            await trio.sleep(5)
            await nursery.start(daemon_life)
            first.cancel()
            with trio.fail_after(1000):
                assert await job is None     # (what the fake worker sends)
            assert trio.current_time() - t0 == grain.REJOIN_WAIT_S + 65
        assert [t - t0 for t, _, _ in daemons[1].started] == [grain.REJOIN_WAIT_S + 5]
        nursery.cancel_scope.cancel()
    told = "1 job(s) that may have been running when the last head went run again: no " \
        "worker came back with them within 10 s"
    assert told in [r.getMessage() for r in caplog.records]   # (the mission's, as said)


@trio_test
async def test_a_mission_run_again_through_the_head_daemon_holds_none_of_its_jobs(
        autojump_clock, tmp_path):
    # Its last run died holding its store; the head daemon it was attached to stayed (and
    # stopped that run's jobs): no worker can come back to the mission with them, so the
    # job goes to the daemon, and starts, at once (it waited REJOIN_WAIT_S).
    path = tmp_path / "r.db"
    (tmp_path / "r.db.holder").write_text(_json.dumps({"host": grain.hostname(),
                                                        "pid": 2 ** 22 + 1, "since": 0}))

    async def attach():
        return d._peer("mission")

    async with trio.open_nursery() as nursery:
        d = InProcessDaemon(nursery)
        d.worker(cores=1, seconds=5)
        setup = grain.MissionSetup(attach=attach, info={"name": "m"})
        async with grain.GrainExecutor(key=b"k" * 32, mission=setup,
                                       results=str(path)) as exer:
            assert exer.stored.store.crashed
            t0 = trio.current_time()
            with trio.fail_after(100):
                assert await exer.submit(Cores(1), _square, 3) is None
        assert [t - t0 for t, _, _ in d.started] == [0]
        nursery.cancel_scope.cancel()


@trio_test
async def test_an_idle_head_daemon_quits_on_the_clock(autojump_clock):
    d = InProcessDaemon(None, idle_quit=600)
    async with trio.open_nursery() as nursery:
        d.nursery = nursery
        t0 = trio.current_time()
        nursery.start_soon(d.daemon.run)
        await trio.sleep(100)
        d.worker(cores=1, seconds=50)
        await d.mission("m", 1)              # attached from 100 s to 150 s: idle from 150 s
        with trio.fail_after(700):
            await d.daemon.stopped.wait()
        assert trio.current_time() - t0 == pytest.approx(750)
        nursery.cancel_scope.cancel()


async def _mission_whose_daemons_close_on_it(closing):
    """A mission's one job, when the first ``closing`` daemons it reaches close the
    connection on its greeting (killed, or quitting idle, as it came) and the next one
    serves it: the job's result or error, and how many daemons it reached."""
    reached = []

    async def closes_on_greeting(stream):
        async with grain.open_channel(stream, "the mission") as ch:
            assert (await ch.receive())[0] == "mission"

    async def attach():
        reached.append(len(reached))
        if len(reached) <= closing:
            daemon_side, mission_side = trio.testing.memory_stream_pair()
            nursery.start_soon(closes_on_greeting, daemon_side)
            return mission_side
        return d._peer("mission")

    async with trio.open_nursery() as nursery:
        d = InProcessDaemon(nursery)
        d.worker(cores=1, seconds=5)
        setup = grain.MissionSetup(attach=attach, info={"name": "m"})
        async with grain.GrainExecutor(key=b"k" * 32, mission=setup) as exer:
            job = exer.submit(Cores(1), _square, 3)
            with trio.fail_after(100):
                try:
                    outcome = await job
                except grain.GrainError as e:
                    outcome = e
        nursery.cancel_scope.cancel()
    return outcome, len(reached)


@trio_test
async def test_a_daemon_that_closes_before_answering_a_mission_is_passed_over(autojump_clock):
    # (the fault campaign, seed 26: the daemon killed as its mission attached; the
    # mission's jobs all failed with "it closed the connection")
    assert await _mission_whose_daemons_close_on_it(grain.ATTACH_TRIES - 1) == \
        (None, grain.ATTACH_TRIES)    # (None: what the fake worker sends)
    error, reached = await _mission_whose_daemons_close_on_it(grain.ATTACH_TRIES)
    assert reached == grain.ATTACH_TRIES
    assert str(error) == ("the head daemon for this mission: it closed the connection "
                          f"before answering ({grain.ATTACH_TRIES} times in a row)")


@trio_test
async def test_a_mission_whose_daemon_holds_another_key_is_told_so_and_starts_none(tmp_path):
    # The daemon on this host answers with another key: the mission is told that, naming
    # the key files, and starts no second daemon (which would have failed, its socket
    # taken, and been named as the cause).
    address = f"edge://{tmp_path}/edge"
    there = grain.load_auth_key(str(tmp_path / "there" / "key"))
    here = grain.load_auth_key(str(tmp_path / "here" / "key"))
    marker = tmp_path / "started"

    async def nothing(stream, peer):
        pass

    async with trio.open_nursery() as nursery:
        await nursery.start(grain.serve, f"unix://{grain.mission_socket_path(address)}",
                            there, nothing)
        with pytest.raises(grain.KeyMismatch, match="holds another key"):
            await grain.attach_to_head(address, here, ["touch", str(marker)],
                                       str(tmp_path / "head.log"))
        nursery.cancel_scope.cancel()
    assert not marker.exists()


@pytest.mark.parametrize("how", ["killed", "exits"])
@trio_test
async def test_a_daemon_that_dies_before_its_mission_reaches_it(tmp_path, how):
    # Killed by a signal before the mission could reach it (the same fault, earlier): the
    # mission's link tries another, as for one that closed on it (PeerError); one that
    # exits by itself (a bad config) fails the mission at once, with the end of its log.
    code = ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)" if how == "killed"
            else "import sys; print('bad config'); sys.exit(2)")
    key = grain.load_auth_key(str(tmp_path / "key"))
    with pytest.raises(grain.GrainError) as info:
        await grain.attach_to_head(f"edge://{tmp_path}/edge", key, [sys.executable, "-c", code],
                                   str(tmp_path / "head.log"))
    assert isinstance(info.value, grain.PeerError) == (how == "killed")
    status = -9 if how == "killed" else 2
    assert f"the head daemon exited (status {status}) before answering" in str(info.value)
    assert how == "killed" or str(info.value).endswith(": bad config")


@trio_test
async def test_a_worker_without_a_head_leaves_when_its_grace_ends_on_the_clock(autojump_clock):
    head_side, worker_side = trio.testing.memory_stream_pair()
    worker = grain.WorkerProcess("w", {"name": "w"}, reattach=120)

    async def no_head_yet():
        raise grain.Unreachable("nobody there")

    async def head_that_goes():
        async with grain.open_channel(head_side, "w") as ch:
            assert (await ch.receive())[0] == "register"
        # (its stream closed, without a goodbye: the worker lost its head)

    async with trio.open_nursery() as nursery:
        t = trio.current_time()
        nursery.start_soon(head_that_goes)
        await worker.serve(worker_side, Cores(1), no_head_yet)
    assert trio.current_time() - t == pytest.approx(120, abs=grain.REATTACH_POLL_S)
    assert worker.outbox[-1] == ("leaving", "no head came within 120 s (worker.reattach)")


def _runs(path):
    """job -> how many times it ran, from the lines the jobs wrote."""
    counts = {}
    for line in path.read_text().split("\n") if path.exists() else []:
        if line:
            i = int(line.split()[0])
            counts[i] = counts.get(i, 0) + 1
    return counts


def _long_mission(tmp_path, options, seconds):
    script = tmp_path / "long.py"
    script.write_text(LONG_JOBS.format(here=HERE, runs=str(tmp_path / "runs"),
                                       options=options))
    return subprocess.Popen([sys.executable, str(script), str(seconds)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _killed_and_run_again(first, tmp_path, options, seconds):
    """kill -9 of the mission ``first``, then the same mission again (jobs of ``seconds``):
    its output and errors, once it ended well."""
    first.kill()
    first.wait()
    again = _long_mission(tmp_path, options, seconds)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    return out, err


def swarm_daemon(tmp_path, workers, template, swarm=0, quota=2):
    submissions = tmp_path / "submissions"
    (tmp_path / "submit.py").write_text(SUBMIT_LOCAL.format(submissions=str(submissions)))
    (tmp_path / "alive.py").write_text(JOB_ALIVE)
    d = Daemon(tmp_path, workers, extra=f"swarm = {swarm}\nswarm_quota = {quota}\n")
    d.config.write_text(textwrap.dedent(f"""
        system = "custom"
        address = "{d.edge}"
        [script]
        python = "{sys.executable}"
        cores = 1
        [custom_system]
        submit_cmd = "{sys.executable} {tmp_path}/submit.py"
        status_cmd = "{sys.executable} {tmp_path}/alive.py"
        template = "{template}"
        [worker]
        log_file = "{tmp_path}/worker-{{{{HHMMSS}}}}.log"
    """) + d.config.read_text().split("\n", 1)[1])
    d.submissions = lambda: submissions.read_text().split() if submissions.exists() else []
    return d


def _worker_pids(ls):
    return [int(p) for p in re.findall(r"pid (\d+) on ", ls)]


# A fixed set of the fault campaign's seeds (bench/bench_faults.py; 500 of them are run for
# the README): between them, a mission that is its own head and one through the head
# daemon, Edge and tcp, with and without a store, and each kind of fault (kill, term, stop,
# a connection cut) of the mission, a worker and the head daemon, at drawn moments.
FAULT_SEEDS = "2,3,12,16,26,29,41,59"


def test_the_swarm_quota_is_a_sliding_window():
    keeper = grain.SwarmKeeper(None, target=2, quota=0, window=600.0)  # quota 0: 2 x target
    assert keeper.quota == 4
    for t in (0, 10, 20, 30):
        assert keeper.quota_wait(t) == 0
        keeper.submitted.append(t)
    assert keeper.quota_wait(100) == 500      # full until the first leaves the window
    assert keeper.quota_wait(600) == 0 and len(keeper.submitted) == 3


@trio_test
async def test_the_swarm_keeps_to_its_quota_on_the_clock(autojump_clock, monkeypatch):
    # Workers that die at start (their batch jobs end at once): no more submissions than
    # the quota in any window, and more once the window has passed.
    async def at_once(fn, *args):  # (a thread's wait would let the mock clock jump)
        return fn(*args)

    submitted = []
    monkeypatch.setattr(trio.to_thread, "run_sync", at_once)
    monkeypatch.setattr(grain, "submit_script", lambda *args: [str(
        submitted.append(trio.current_time()) or len(submitted))])
    monkeypatch.setattr(grain, "batch_states", lambda system, ids, custom: dict.fromkeys(
        ids, grain.ENDED))
    s = grain.parse_config('[custom_system]\ntemplate = "#!/bin/sh\\n{main}"\n'
                           'submit_cmd = "true"\n', "x.toml").role("worker")
    keeper = grain.SwarmKeeper(s, target=2, quota=3, window=600.0)
    with trio.move_on_after(1250):
        await keeper.run(lambda: 0)
    # to the target of two, the first's job ending at once: three in the first seconds;
    # then none until the first leaves the window, and so on
    assert [t - submitted[0] for t in submitted] == [0, 1, 2, 600, 601, 602, 1200, 1201, 1202]
    assert keeper.note.startswith("quota reached: 3 submissions in the last 0:10:00")


def test_missions_share_the_head_daemon_fairly_and_reuse_its_worker(daemon):
    w = daemon.worker(cores=1)
    big = daemon.mission(10, 0.3)        # 3 s of jobs on the one core
    # (the worker may join after the mission has attached: that changes nothing below)
    ls = daemon.wait_ls("missions: 1 attached", "1 worker(s)")
    assert "mission.py[" in ls
    small = daemon.mission(2, 0.1)       # arrives behind 9 queued jobs
    small_r, big_r = daemon.result(small), daemon.result(big)
    # Round robin between missions: the small one did not wait for the big one's backlog.
    assert small_r["end"] < big_r["end"]
    assert min(small_r["starts"]) < max(big_r["starts"])
    assert small_r["pids"] == big_r["pids"] == [w.pid]
    # The next mission finds the same worker process: the daemon kept it.
    assert daemon.result(daemon.mission(1, 0))["pids"] == [w.pid]
    ls = daemon.wait_ls("missions: 0 attached")
    assert "13 done" in ls
    stop = daemon.cli("stop")
    assert stop.returncode == 0 and "FIN to 1 worker(s)" in stop.stdout
    assert w.wait(15) == 0
    wait_for(lambda: not head_daemons() & set(_daemon_pids(daemon.tmp_path)), 15,
             "the daemon to exit")


STATUS_MISSION = textwrap.dedent("""
    import sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def job(i):
        await trio.sleep(2)
        return i

    async def main():
        return await each((job @ Cores(1))(i) for i in range(10))

    print("sum", sum(run(main, config_file={config!r})))
""")


def test_a_mission_on_a_terminal_shows_what_the_head_daemons_workers_run(daemon):
    # Ten jobs of 2 s through a head daemon with no worker, then one worker of two cores;
    # Ctrl-C once two jobs are done. The status line says what happened, no more.
    script = daemon.tmp_path / "status.py"
    script.write_text(STATUS_MISSION.format(here=HERE, config=str(daemon.config)))
    term = Terminal(script, cwd=daemon.tmp_path)
    try:
        term.read(re.escape(NO_WORKER), timeout=30)  # (not the daemon's warning, 60 s on)
        joined = time.monotonic()
        daemon.worker(cores=2)
        term.read(r"\| 2/10 done,")
        term.p.send_signal(signal.SIGINT)
        assert term.read() != 0
        ran = time.monotonic() - joined
    finally:
        term.close()
    lines = re.findall(r"\r\x1b\[K\d+:\d\d:\d\d[^|\r\n]*\| (\d+)/(\d+) done, (\d+) running, "
                       r"(\d+) queued, 0 failed \| ([^\r\n]*)", term.text)
    wheres = [where for *_, where in lines]
    assert wheres[0] in ("not attached to the head daemon yet", NO_WORKER), term.text
    for done, total, running, queued, where in lines:
        done, total, running, queued = map(int, (done, total, running, queued))
        assert total in (0, 10) and done + running + queued == total and running <= 2
        assert where in ("not attached to the head daemon yet", NO_WORKER) and not running or \
            where == f"{running}/2 cores busy on 1 worker(s)", term.text
    joined_at = next(i for i, where in enumerate(wheres) if "cores busy" in where)
    assert NO_WORKER not in wheres[joined_at:]
    last = re.search(r"Time elapsed for all jobs: [\d.]+s; 10 jobs \((\d+) done, (\d+) not "
                     r"ended\), ([\d.e-]+) core-hours used\r?$", term.text, re.M)
    assert last, term.text
    done, unended, used = last.groups()
    # billed: the jobs a worker ran, while they ran (not the wait for a worker)
    assert int(done) >= 2 and int(done) + int(unended) == 10
    assert 2 * int(done) * 0.99 <= float(used) * 3600 <= 2 * ran, term.text


def test_a_prioritized_mission_goes_first(daemon):
    # The smoke test of the policy (test_a_prioritized_mission_goes_first_on_the_clock
    # tells the order to the second): a mission's `prioritized` reaches the daemon, which
    # says so, and both missions get their results.
    daemon.worker(cores=1)
    normal = daemon.mission(10, 0.2)
    daemon.wait_ls("missions: 1 attached")
    first = daemon.mission(2, 0.2, "", "--first")
    assert len(daemon.result(first)["starts"]) == 2
    assert len(daemon.result(normal)["starts"]) == 10
    assert re.search(r"mission \S+ attached from \S+ \(prioritized\)",
                     (daemon.tmp_path / "head.log").read_text())


FAILING_JOBS = textwrap.dedent("""
    import sys, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, run
    from grain.resource import Cores, WTime

    @delayed
    async def boom():
        raise ValueError("boom")

    @delayed
    async def slow():
        await trio.sleep(60)

    async def main():
        for job in ((boom @ Cores(1))(), (slow @ (Cores(1) & WTime(T=1)))()):
            try:
                await job
            except Exception as e:
                print(f"{{type(e).__name__}}: {{e}}", *e.__notes__, sep="\\n", flush=True)

    run(main, config_file={config!r})
""")


def test_a_failure_through_the_daemon_names_its_job_and_the_worker_that_ran_it(daemon):
    # Through the head daemon (a mission's usual way), a job raising on worker node-7 and
    # a job past its T there: each error names what failed, and its traceback the worker
    # that ran it, as `ls` shows it, not the daemon the mission sees as its one worker.
    daemon.worker(name="node-7")
    daemon.script.write_text(FAILING_JOBS.format(here=HERE, config=str(daemon.config)))
    mission = daemon.mission()
    out, err = mission.communicate(timeout=60)
    assert mission.returncode == 0, err
    assert re.fullmatch(r"ValueError: boom\nTraceback on worker node-7:\n.*"
                        r"\nTooSlowError: job #\d+ slow ran past its T \(WTime\(T=1\)\)\n"
                        r"Traceback on worker node-7:\n.*", out, re.S), out
    assert "on worker head" not in out


EXITING_JOB = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, run
    from grain.resource import Cores

    @delayed
    async def quits(x):
        if x:
            sys.exit(x)
        return "after"

    async def main():
        try:
            await (quits @ Cores(1))(3)
        except SystemExit as e:
            print(f"SystemExit {{e.code}}", *e.__notes__, sep="\\n", flush=True)
        print(await (quits @ Cores(1))(0), flush=True)

    run(main, config_file={config!r})
""")


def test_a_job_that_calls_sys_exit_fails_itself_not_its_worker(daemon):
    # A job's sys.exit() reaches its caller as the job's SystemExit, run once (no class
    # retries it), and the worker that ran it serves the next job: a worker process that
    # exited with it would have its job retried as lost, to end the next worker too.
    worker = daemon.worker(name="node-7")
    daemon.script.write_text(EXITING_JOB.format(here=HERE, config=str(daemon.config)))
    mission = daemon.mission()
    out, err = mission.communicate(timeout=60)
    assert mission.returncode == 0, err
    assert re.fullmatch(r"SystemExit 3\n.*Traceback on worker node-7:\n.*\nafter\n", out,
                        re.S), out
    assert worker.poll() is None
    assert "lost" not in (daemon.tmp_path / "head.log").read_text()
    daemon.wait_ls("node-7")


def test_a_job_that_calls_sys_exit_in_the_mission_ends_it_with_that_status(tmp_path):
    # In the mission's own worker the job's SystemExit reaches main as the job's error:
    # left uncaught, the mission exits with its code, as a script that calls sys.exit does,
    # not with a traceback of grain's tasks and status 1.
    script = tmp_path / "m.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        from grain.delayed import delayed, run
        from grain.resource import Cores

        @delayed
        async def quits():
            sys.exit(3)

        async def main():
            await (quits @ Cores(1))()
            print("not reached")

        run(main, local=Cores(1))
    """))
    cp = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 3 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stdout == ""


def test_a_mission_killed_mid_run_has_its_jobs_cancelled_on_the_worker(daemon, tmp_path):
    w = daemon.worker(cores=1)
    marker = tmp_path / "cancelled"
    doomed = daemon.mission(3, 60, marker)
    daemon.wait_ls("1 running")
    doomed.kill()                        # kill -9: no goodbye from the mission
    wait_for(marker.exists, 15, "the job to be cancelled on the worker")
    ls = daemon.wait_ls("missions: 0 attached")
    assert "0 queued, 0 running" in ls
    # The core is free again: another mission runs on the same worker.
    assert daemon.result(daemon.mission(2, 0.05))["pids"] == [w.pid]
    log = (tmp_path / "head.log").read_text()
    assert "dropped 2 queued and cancelled 1 running job(s)" in log


def test_a_head_daemon_killed_mid_run_costs_no_job(daemon, tmp_path):
    """kill -9 of the daemon while 8 long jobs run on 2 workers: the workers keep them and
    come back to the daemon the mission starts, which the mission hands its jobs to."""
    ws = [daemon.workers.start("--url", daemon.edge, "--res", '{"Cores": {"N": 4}}',
                               "--oversubscribe", name=f"w{i}") for i in (1, 2)]
    mission = _long_mission(tmp_path, f"config_file={str(daemon.config)!r}", 6)
    daemon.missions.append(mission)
    wait_for(lambda: sum(_runs(tmp_path / "runs").values()) == 8, 30, "8 jobs to run")
    (pid,) = _daemon_pids(tmp_path)
    os.kill(pid, signal.SIGKILL)
    out, err = mission.communicate(timeout=60)
    assert mission.returncode == 0, err
    results = _json.loads(out.strip().splitlines()[-1])
    assert _runs(tmp_path / "runs") == {i: 1 for i in range(8)}    # each ran exactly once
    assert {p for _, p in results} == {w.pid for w in ws}
    assert all(w.poll() is None for w in ws)                      # the same processes
    assert "handing them to the next one" in err
    assert len(_daemon_pids(tmp_path)) == 2
    log = (tmp_path / "head.log").read_text()
    assert log.count("came back") == 2, log


def test_a_mission_that_was_its_own_head_resumes_its_running_jobs(workers, tmp_path):
    """kill -9 of a mission that is its own head, with a results store, while 8 long jobs
    run on 2 workers; run again, it becomes the head its workers come back to, and matches
    their jobs to its own by key: none runs twice."""
    edge = f"edge://{tmp_path}/edge"
    store = tmp_path / "campaign.db"
    ws = [workers.start("--url", edge, "--res", '{"Cores": {"N": 4}}', "--oversubscribe",
                        name=f"w{i}") for i in (1, 2)]
    options = f"local=ZERO, address={edge!r}, results={str(store)!r}"
    first = _long_mission(tmp_path, options, 8)
    try:
        wait_for(lambda: sum(_runs(tmp_path / "runs").values()) == 8, 30, "8 jobs to run")

        def running_in_store():
            with contextlib.closing(sqlite3.connect(store)) as db:
                return db.execute("SELECT COUNT(*) FROM results_log WHERE state = 'running'"
                                  ).fetchone()[0]

        wait_for(lambda: running_in_store() == 8, 10, "the store to say they run")
        out, err = _killed_and_run_again(first, tmp_path, options, 8)
    finally:
        first.kill()
        first.wait()
    results = _json.loads(out.strip().splitlines()[-1])
    assert results == [[i, p] for i, p in results] and [i for i, _ in results] == list(range(8))
    assert _runs(tmp_path / "runs") == {i: 1 for i in range(8)}
    assert {p for _, p in results} == {w.pid for w in ws}     # the same processes...
    assert err.count("came back") == 2, err
    assert [w.wait(15) for w in ws] == [0, 0]                  # ... which the mission's end let go


def test_a_mission_run_again_without_a_store_never_takes_its_last_runs_jobs_for_its_own(
        workers, tmp_path):
    """kill -9 of a mission that is its own head, without a store, while 8 long jobs run
    on a worker of 12 cores; run again at once, its jobs are numbered as the last run's
    were. The worker comes back still running those, which no new head can claim (they
    are stopped there), with 4 cores free: the new run's jobs must run there, not be
    taken for the old ones (the fault campaign's seed 14 hung so, until a head's
    numbers were its own)."""
    edge = f"edge://{tmp_path}/edge"
    workers.start("--url", edge, "--res", '{"Cores": {"N": 12}}', "--oversubscribe", name="w")
    options = f"local=ZERO, address={edge!r}"
    first = _long_mission(tmp_path, options, 60)
    try:
        wait_for(lambda: sum(_runs(tmp_path / "runs").values()) == 8, 30, "8 jobs to run")
        out, err = _killed_and_run_again(first, tmp_path, options, 0.2)
    finally:
        first.kill()
        first.wait()
    results = _json.loads(out.strip().splitlines()[-1])
    assert [i for i, _ in results] == list(range(8))
    assert _runs(tmp_path / "runs") == {i: 2 for i in range(8)}   # each ran again, once
    assert err.count("came back") == 1, err


def test_an_idle_head_daemon_quits_and_cleans_up(tmp_path, workers):
    edge = tmp_path / "edge"
    w = workers.start("--url", f"edge://{edge}", "--res", '{"Cores": {"N": 1}}', name="w")
    head = subprocess.Popen([sys.executable, GRAIN, "head", "--no-config", "-a",
                             f"edge://{edge}", "--idle-quit", "2s"], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    sock = grain.mission_socket_path(f"edge://{edge}")
    try:
        wait_for(lambda: os.path.exists(sock), 15, "the mission socket")
        assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0
        assert head.wait(20) == 0
    finally:
        head.kill()
    err = head.stderr.read()
    assert "no mission for 0:00:02; stopping" in err
    assert w.wait(15) == 0 and "the head said goodbye" in w.log_path.read_text()
    assert not os.path.exists(sock)
    assert _json.loads(edge.read_text())["listener"] is None


def test_head_daemon_bad_input(tmp_path):
    edge = f"edge://{tmp_path}/edge"
    sock = grain.mission_socket_path(edge)
    # A stale socket file left by a crashed daemon (nobody listens on it) is recovered from.
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock)
    s.close()
    head = subprocess.Popen([sys.executable, GRAIN, "head", "--no-config", "-a", edge],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        cli = functools.partial(grain_cli, cwd=tmp_path)

        wait_for(lambda: cli("ls", "-a", edge).returncode == 0, 15, "the daemon")
        # A second daemon for the same address refuses, naming the live one.
        second = cli("head", "--no-config", "-a", edge)
        assert second.returncode == 1
        assert f"already listening at {edge} (pid {head.pid}" in second.stderr
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"grain.py head: a head is already listening at {edge}")
        # A mission that is its own head runs beside it without accepting workers: a job
        # larger than its own worker then fails at once, as where it listens nowhere.
        mission = run_py("-c", textwrap.dedent(f"""
            import sys; sys.path.insert(0, {HERE!r})
            from grain.delayed import delayed, run
            from grain.resource import Cores
            async def big(): pass
            async def main(): await (delayed(big) @ Cores(8))()
            run(main, local=Cores(1), address={edge!r}, config_file=False)"""), timeout=30)
        assert mission.returncode == 1, mission.stderr
        assert "this mission runs without accepting workers" in mission.stderr
        assert "and no other worker can join this mission (it listens at no address)\n" \
            "grain: job #1 big() failed\n" in mission.stderr, mission.stderr
        neg = cli("scale", "-1", "-a", edge)
        assert neg.returncode == 2 and "got -1" in neg.stderr
        no_system = cli("scale", "2", "-a", edge)
        assert no_system.returncode == 1 and "no batch system" in no_system.stderr
        assert cli("stop", "-a", edge).returncode == 0
        assert head.wait(15) == 0
        gone = cli("stop", "-a", edge)
        assert gone.returncode == 1 and "no head is listening" in gone.stderr
    finally:
        head.kill()
        head.wait()


@trio_test
async def test_the_head_daemon_tells_a_mission_of_its_stuck_job(autojump_clock):
    daemon = grain.HeadDaemon("tcp://127.0.0.1:0", b"k" * 32)
    mission = grain.MissionQueue(_FakeChannel(), {"name": "m"})
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        daemon.scheduler.add_queue(mission)
        daemon.scheduler.add_worker(_returning_worker(2))
        job = grain.Job(1, Cores(4), None, None, None, mission)
        daemon.scheduler.push(job)
        await trio.sleep(grain.STUCK_WARN_S + grain.STUCK_CHECK_S)
        warnings = [m[1] for m in mission.channel.sent if m[0] == "warn"]
        assert len(warnings) == 1 and "requesting Cores(N=4) has fitted no worker for 6" in \
            warnings[0] and "the largest worker is w with 2 cores" in warnings[0]
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_rejected_swarm_submission_is_told_to_the_missions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = grain.parse_config('system = "custom"\n[custom_system]\ntemplate = '
                                  '"#!/bin/sh\\n{main}"\nsubmit_cmd = "sh -c \'echo '
                                  'no such partition >&2; exit 1\'"\n', "x.toml").role("worker")
    swarm = grain.SwarmKeeper(settings, 1, 2, 600)
    daemon = grain.HeadDaemon("tcp://127.0.0.1:0", b"k" * 32, swarm=swarm)
    mission = grain.MissionQueue(_FakeChannel(), {"name": "m"})
    daemon.missions.append(mission)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(swarm.run, lambda: 0)
        with trio.fail_after(20):
            while not mission.channel.sent:
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    (said,) = [m[1] for m in mission.channel.sent if m[0] == "warn"]
    assert said.startswith("swarm: the last submission failed: submission failed (sh exit "
                           "1): no such partition")


def test_a_head_daemon_counts_failures_by_class_and_holds_max_conn(tmp_path, workers):
    daemon = Daemon(tmp_path, workers, gnaw="max_conn = 1")
    try:
        daemon.worker(cores=2)
        failing = tmp_path / "failing.py"
        failing.write_text(textwrap.dedent(f"""
            import sys, trio; sys.path.insert(0, {HERE!r})
            from grain.delayed import delayed, run
            from grain.resource import Cores, WTime

            @delayed
            async def fail(seconds):
                await trio.sleep(seconds)
                raise ValueError("no")

            async def main():
                for job in ((fail @ Cores(1))(0), (fail @ (Cores(1) & WTime(T=1)))(30)):
                    try:
                        await job
                    except (ValueError, trio.TooSlowError) as e:
                        print(type(e).__name__)
                await trio.sleep(30)  # stay attached, holding the daemon's one place

            run(main, config_file={str(daemon.config)!r})
        """))
        holder = subprocess.Popen([sys.executable, str(failing)], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        daemon.missions.append(holder)
        ls = daemon.wait_ls("2 failed (raised: 1, ran past its T: 1)", "missions: 1 attached")
        refused = daemon.mission(1, 0)
        out, err = refused.communicate(timeout=60)
        assert refused.returncode == 1
        assert "serves 1 missions already, its limit ([head.gnaw] max_conn)" in err, err
    finally:
        daemon.close()


def test_the_swarm_replaces_a_worker_that_dies_within_its_quota(tmp_path, workers):
    d = swarm_daemon(tmp_path, workers, "#!/bin/bash\\nexport GRAIN_JOB_ID=$$\\n{main}\\n",
                     swarm=1, quota=2)
    head = subprocess.Popen([sys.executable, GRAIN, "head", "-c", str(d.config)],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        ls = d.wait_ls("swarm: target 1, 1 joined, 0 submitted")
        (first,) = _worker_pids(ls)
        # A job runs on the swarm's worker.
        assert d.result(d.mission(1, 0))["pids"] == [first]
        os.kill(first, signal.SIGKILL)   # the worker dies: a second one is submitted
        ls = d.wait_ls("swarm: target 1, 1 joined, 0 submitted")
        (second,) = _worker_pids(ls)
        assert second != first and len(d.submissions()) == 2
        os.kill(second, signal.SIGKILL)  # again: the quota (2 per 10 minutes) says no
        ls = d.wait_ls("swarm: quota reached: 2 submissions in the last 0:10:00")
        assert "target 1, 0 joined, 0 submitted" in ls and len(d.submissions()) == 2
        assert d.cli("stop").returncode == 0
        assert head.wait(15) == 0
    finally:
        head.kill()
        head.wait()


def test_down_turns_the_swarm_off_so_that_no_worker_replaces_those_it_cancels(tmp_path,
                                                                             workers):
    d = swarm_daemon(tmp_path, workers, "#!/bin/bash\\nexport GRAIN_JOB_ID=$$\\n{main}\\n",
                     swarm=1, quota=3)
    d.config.write_text(d.config.read_text().replace(  # (a job: the session of its script)
        "[custom_system]\n", '[custom_system]\ncancel_cmd = "pkill -TERM -s"\n'))
    head = subprocess.Popen([sys.executable, GRAIN, "head", "-c", str(d.config)],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_ls("swarm: target 1, 1 joined, 0 submitted")
        (job,) = d.submissions()
        down = d.cli("down")
        assert down.returncode == 0, down.stderr
        assert down.stdout.splitlines()[0] == ("turned the head's autoscaling off "
                                               "(`grain.py scale N` turns it on again)")
        assert down.stdout.splitlines()[1].startswith(f"cancelled worker job {job} ")
        d.wait_ls("0 worker(s)", "swarm: autoscaling is off")
        assert d.submissions() == [job]
        assert d.cli("down").stdout == "no job to cancel\n"  # (off already: nothing said)
        assert d.cli("stop").returncode == 0
        assert head.wait(15) == 0
    finally:
        head.kill()
        head.wait()


def test_the_swarm_quota_holds_when_workers_crash_at_start(tmp_path, workers):
    d = swarm_daemon(tmp_path, workers, "#!/bin/bash\\necho cannot start >&2\\nexit 3\\n",
                     swarm=0, quota=3)
    head = subprocess.Popen([sys.executable, GRAIN, "head", "-c", str(d.config)],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_ls("swarm: autoscaling is off")
        scale = d.cli("scale", "2")      # on the fly
        assert scale.returncode == 0 and "swarm target: 2 worker(s)" in scale.stdout
        ls = d.wait_ls("swarm: quota reached: 3 submissions", timeout=60)
        assert "target 2, 0 joined" in ls and len(d.submissions()) == 3  # not a flood
        assert d.cli("scale", "0").stdout.strip() == "autoscaling is off"
        assert d.cli("stop").returncode == 0
        assert head.wait(15) == 0
    finally:
        head.kill()
        head.wait()
    assert "ended without joining" in head.stderr.read()


def test_a_fixed_set_of_fault_scenarios_keeps_the_promise():
    cp = run_py(os.path.join("bench", "bench_faults.py"), "--seeds", FAULT_SEEDS, "--quick",
                timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr[-3000:]
    assert cp.stdout.strip().splitlines()[-1].startswith(
        f"{len(FAULT_SEEDS.split(','))} scenarios: 0 lost, 0 ran twice without a killed "
        "worker, 0 hung, 0 left behind, 0 failed, 0 store faults")


###############################################################################
# Pack ########################################################################
###############################################################################


BUNDLE_MISSION = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import grain
    assert grain.__file__.startswith(sys.argv[1]), grain.__file__
    from grain.delayed import delayed, each, run
    from grain.resource import Cores
    from grain.subproc import subprocify, subprocess_pool_scope
    from grain import GVAR

    @delayed
    async def add(x):
        import trio
        await trio.sleep(x / 10)
        return x + 1

    @delayed
    async def elevated_sum(l):
        s_ = 0
        for x in l:
            s_ += (add @ Cores(1))(x)
        return await s_

    @delayed
    @subprocify
    def square(x):
        import os, sys
        return x * x, os.getpid(), sys.flags.isolated

    @delayed
    async def where():
        import os
        return os.getpid(), GVAR.instance

    async def main():
        sums = await each(elevated_sum(d) for d in [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
        async with subprocess_pool_scope():
            sq, child, isolated = await (square @ Cores(1))(7)
        remote = list(await (where @ Cores(3))()) if len(sys.argv) > 2 else None
        print(repr([sums, sq, child != os.getpid(), isolated, remote]))

    run(main, local=Cores([0]), address=sys.argv[2] if len(sys.argv) > 2 else False,
        config_file=False)
""")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    out = {}
    d = tmp_path_factory.mktemp("bundles")
    for version in ("3.9", "3.13"):
        target = tuple(int(x) for x in version.split("."))
        python = grain.find_python(target)
        if python is None:
            pytest.skip(f"needs a Python {version} (pyenv on these machines has it)")
        path = str(d / f"grain-{version}.pyz")
        grain.pack(path, version, say=lambda msg: None)
        out[version] = (python, path)
    return out


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_bundle_runs_with_nothing_installed(bundles, version, tmp_path):
    python, pyz = bundles[version]
    assert os.path.getsize(pyz) <= 1.5e6
    cp = subprocess.run([python, "-I", "-S", pyz, "--version"], capture_output=True,
                        text=True)
    assert cp.returncode == 0 and cp.stdout.startswith("grain.py bundle ")
    assert ("trio 0.31" in cp.stdout) == (version == "3.9") and "dill " in cp.stdout
    mission = tmp_path / "mission.py"
    mission.write_text(BUNDLE_MISSION)
    env = dict(os.environ, HOME=str(tmp_path))
    cp = subprocess.run([python, "-I", "-S", str(mission), pyz], capture_output=True,
                        text=True, cwd=tmp_path, env=env, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert eval(cp.stdout.strip()) == [[9, 18, 27], 49, True, 1, None]
    # A worker from the bundle joins a mission over an Edge file.
    edge = f"edge://{tmp_path}/edge"
    worker = subprocess.Popen([python, "-I", "-S", pyz, "worker", "--url", edge, "--res",
                               '{"Cores": {"N": 3}}', "--oversubscribe", "--name", "bundled"],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        cp = subprocess.run([python, "-I", "-S", str(mission), pyz, edge],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
        assert cp.returncode == 0, cp.stderr
        assert eval(cp.stdout.strip())[4] == [worker.pid, "bundled"]
        assert worker.wait(15) == 0
    finally:
        worker.kill()
        worker.wait()


def test_bundles_are_byte_identical_when_rebuilt(bundles, tmp_path):
    for version, (_, first) in bundles.items():
        again = str(tmp_path / f"again-{version}.pyz")
        grain.pack(again, version, say=lambda msg: None)
        with open(first, "rb") as a, open(again, "rb") as b:
            assert a.read() == b.read(), version


def test_pack_refuses_what_it_cannot_build(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cp = grain_cli("pack", "-o", str(tmp_path / "x.pyz"), "--python", "3.9",
                "--wheels", str(wheels))
    assert cp.returncode == 1 and not (tmp_path / "x.pyz").exists()
    assert cp.stderr.strip().splitlines()[-1] == (
        f"grain.py pack: no wheel of trio supporting Python 3.9 in {wheels} (trio 0.31 is "
        "the newest for Python 3.9)")
    # A file named like a wheel that is not one (no zip, or a zip without METADATA) is named
    for name, body in (("bad-1.0-py3-none-any.whl", b"not a zip"), ("empty-1.0-py3-none-any.whl",
                                                                     None)):
        path = wheels / name
        if body is None:
            import zipfile
            with zipfile.ZipFile(path, "w") as z:
                z.writestr("empty-1.0.dist-info/RECORD", "")
        else:
            path.write_bytes(body)
        cp = grain_cli("pack", "-o", str(tmp_path / "x.pyz"), "--python", "3.9",
                       "--wheels", str(wheels))
        assert cp.returncode == 1 and not (tmp_path / "x.pyz").exists()
        assert cp.stderr.strip().splitlines()[-1] == (
            f"grain.py pack: {path}: not a wheel (no METADATA)"), cp.stderr
        path.unlink()
    # No package index: the installed copies, if they support the target.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cp = grain_cli("pack", "-o", str(tmp_path / "y.pyz"), "--python", here, env=env)
    assert cp.returncode == 0, cp.stderr
    assert "using this interpreter's installed copies" in cp.stdout
    assert f"tested with {sys.executable} -I -S" in cp.stdout
    import importlib.metadata as md
    if not grain.python_supports(md.distribution("trio").metadata["Requires-Python"], (3, 9)):
        cp = grain_cli("pack", "-o", str(tmp_path / "z.pyz"), "--python", "3.9", env=env)
        assert cp.returncode == 1 and "the installed trio" in cp.stderr
        assert "needs Python >=3.10, not 3.9; give --wheels DIR" in cp.stderr
    cp = grain_cli("pack", "--python", "3")
    assert cp.returncode == 2 and "--python takes X.Y" in cp.stderr


def test_ls_without_the_key_of_a_head_that_listens_says_the_key_is_missing(tmp_path, workers):
    # A second machine, or a mistyped --key: "no head is listening" would send the user
    # looking for a head that is there.
    d = Daemon(tmp_path, workers)
    head = subprocess.Popen([sys.executable, GRAIN, "head", "-c", str(d.config)],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        d.wait_ls("0 worker(s)")
        missing = tmp_path / "elsewhere" / "key"
        cp = d.cli("ls", "--key", str(missing))
        key = grain.load_config(str(d.config)).role("worker").auth_key
        assert cp.returncode == 1 and cp.stderr == (
            f"grain.py ls: a head listens at {d.edge} (address in {d.config}), but there is "
            f"no key file at {missing} to speak to it: copy the head's key ({key}) there\n")
        assert d.cli("stop").returncode == 0
        assert head.wait(15) == 0
    finally:
        head.kill()
        head.wait()


def test_requires_python_specifiers():
    ok = grain.python_supports
    assert ok(">=3.9", (3, 9)) and not ok(">=3.10", (3, 9)) and ok(None, (3, 9))
    assert ok(">=3.8, !=3.9.*", (3, 10)) and not ok(">=3.8, !=3.9.*", (3, 9))
    assert ok("~=3.7", (3, 12)) and not ok("<3.11", (3, 11)) and ok(">3.7", (3, 9))


###############################################################################
# CLI #########################################################################
###############################################################################


def test_a_command_whose_reader_went_away_says_nothing(tmp_path):
    # `grain.py ls | head -3`: head leaves once it has its lines; ls's next write fails.
    p = subprocess.Popen([sys.executable, GRAIN, "ls", "--json", "-a", "tcp://127.0.0.1:1",
                          "--key", str(tmp_path / "no-key")], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    assert (p.wait(30), p.stderr.read()) == (128 + signal.SIGPIPE, "")
    p.stderr.close()


def test_without_a_config_file_only_verbose_says_so(tmp_path):
    nobody = ("grain.py ls: no head is listening at tcp://127.0.0.1:1 (given with -a; no key "
              "file at {} either: a head makes its key when it starts)\n")
    key = tmp_path / "no-key"
    cp = grain_cli("ls", "-a", "tcp://127.0.0.1:1", "--key", str(key), cwd=tmp_path)
    assert cp.returncode == 1 and cp.stderr == nobody.format(key)
    cp = grain_cli("-v", "ls", "-a", "tcp://127.0.0.1:1", "--key", str(key), cwd=tmp_path)
    assert cp.returncode == 1 and cp.stderr == ("No config file (./grain.toml or $GRAIN_CONFIG); "
                                                "using default settings.\n" + nobody.format(key))
    # a mission says nothing of it either
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from grain.delayed import run\n"
            "from grain.resource import ZERO\nasync def main(): pass\n"
            "run(main, local=ZERO, address=False, progress=False)")
    cp = run_py("-c", code, cwd=tmp_path)
    assert cp.returncode == 0 and cp.stderr.startswith("Time elapsed for all jobs: "), cp.stderr
    # a GRAIN_CONFIG naming no file is an error naming it
    env = dict(os.environ, GRAIN_CONFIG=str(tmp_path / "none.toml"))
    cp = grain_cli("ls", cwd=tmp_path, env=env)
    assert cp.returncode == 2
    assert cp.stderr == f"grain.py ls: GRAIN_CONFIG={tmp_path}/none.toml: no such file\n"


def test_a_misspelt_command_gets_the_nearest_one():
    commands = ("worker, ls, explain, quit, head, bridge, stop, scale, up, down, pack, start, "
                "results")
    for argv, line in [(["lss"], "grain.py: unknown command 'lss'; did you mean 'ls'?"),
                       (["-v", "explian", "-a", "x"], "grain.py: unknown command 'explian'; "
                                                      "did you mean 'explain'?"),
                       (["frobnicate"], "grain.py: unknown command 'frobnicate'")]:
        cp = grain_cli(*argv)
        assert cp.returncode == 2 and cp.stdout == ""
        assert cp.stderr == f"{line} (commands: {commands})\n"
    assert grain_cli("-v").returncode == 0  # (no command: the help)
    cp = grain_cli("-c", "site.toml", "ls")  # (an option of the command's, put before it)
    assert (cp.returncode, cp.stderr) == (2, "grain.py: -c site.toml: a command's options "
                                             "come after it (grain.py ls -c site.toml)\n")


def test_ls_watch_redraws_until_interrupted(tmp_path):
    p = subprocess.Popen([sys.executable, GRAIN, "ls", "--watch", "0.2", "-a",
                          "tcp://127.0.0.1:1"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    frames = 0
    try:
        for line in p.stdout:
            frames += "(every 0.2 s; Ctrl-C ends)" in line
            if frames == 3:
                break
    finally:
        p.send_signal(signal.SIGINT)
    assert p.wait(10) == 0 and frames == 3
    for bad in ("0", "nan", "inf"):
        cp = grain_cli("ls", "--watch", bad, "-a", "tcp://x:1")
        assert cp.returncode == 2 and cp.stderr.startswith("grain.py ls: --watch takes a "
                                                           "number of seconds above 0")


###############################################################################
# Submodules ##################################################################
###############################################################################


def test_seed_import_lines_and_flat_names():
    code = textwrap.dedent("""
        import importlib.util, pickle, sys
        import grain
        from grain.delayed import delayed, each, run
        from grain.resource import Cores, Memory, Node, WTime, Token, ZERO
        from grain.subproc import subprocify, subprocess_pool_scope
        from grain.combine import open_waitgroup, exec1, run_combine
        from grain import GVAR
        import grain.resource
        assert grain.delayed is delayed and callable(grain.delayed)   # the decorator
        assert sys.modules["grain.delayed"].delayed is delayed         # the submodule
        assert grain.resource.Cores is grain.Cores is Cores
        assert importlib.util.find_spec("grain.subproc") is not None
        assert grain.open_waitgroup is open_waitgroup and grain.exec1 is exec1
        assert grain.run_combine is run_combine
        # trio, dill and sqlite3 come on first use: most of the start-up time of `ls`,
        # `--version` and a script that only imports (a module-level trio.X brings it)
        assert not {"trio", "dill", "sqlite3"} & set(sys.modules), "imported at import"
        c = pickle.loads(pickle.dumps(Cores([1, 2])))
        assert type(c) is grain.Cores and c.c == [1, 2]
        print("ok")
    """)
    cp = run_py("-c", code)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "ok"


def test_every_upstream_import_path_resolves():
    import grain.combine
    import grain.local_sworker
    from grain.combine import exec1, load_cache_or_exec1, open_waitgroup  # noqa: F401
    from grain.contextvar import GVAR as gvar
    from grain.delayed import Delayed, DelayedFn, delayedval  # noqa: F401
    from grain.head import GrainExecutor
    from grain.resource import REJECT, TIMESTAT_NSAMPLE, Reject  # noqa: F401
    from grain.subproc import BrokenSubprocessError as broken  # noqa: F401
    from grain.util import QueueLimiter, open_nursery_with_capacity, set_numpy_oneline_repr  # noqa: F401

    assert gvar is GVAR and GrainExecutor is grain.GrainExecutor and TIMESTAT_NSAMPLE == 8
    assert grain.combine.run is grain.run_combine and "run" in grain.combine.__all__
    assert grain.local_sworker.GRAIN_SWORKER_CONFIG == {"BACKENDLESS": True}
    assert isinstance(delayed(add1.fn), DelayedFn) and grain.DelayedFunction is DelayedFn



VANISH_MISSION = textwrap.dedent("""
    import json, os, socket, sys, time, trio
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores

    @delayed
    async def job(i):
        start = os.path.join({starts!r}, f"{{i}} {{socket.gethostname()}} {{time.time()}}")
        open(start, "w").close()
        await trio.sleep(10)
        return [i, socket.gethostname()]

    async def main():  # a job takes all of a node's cores: one at a time on each worker
        return await each((job @ Cores({per}))(i) for i in range(3))

    print(json.dumps(run(main, config_file={config!r})), flush=True)
""")


def _signal_host(host, sig):
    """``sig`` to every process of ``host`` (its network namespace): SIGSTOP takes it away
    with no word on the network (no FIN, no RST), as a power cut or a panic would."""
    for _ in range(3):   # (again: a process may have forked meanwhile)
        pids = subprocess.run(["ip", "netns", "pids", f"grain-{host}"], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)


@needs_cluster
def test_nodes_that_vanish_have_their_jobs_run_elsewhere_and_come_back_or_are_cancelled(
        hosts):
    # Two nodes vanish without a word while each runs a job: the head takes them for lost
    # within SILENT_S (the README's bound) and runs their jobs on the node left; nothing is
    # lost, and only their jobs run twice. One node comes back within worker.reattach:
    # its worker rejoins. The other does not: its batch job is cancelled.
    cores = node_cores()
    starts = hosts.path / "starts"
    starts.mkdir()
    with open(hosts.cfg, "a") as f:
        f.write('[worker]\nreattach = "20s"\n')
    hosts.path.joinpath("mission.py").write_text(VANISH_MISSION.format(
        here=HERE, starts=str(starts), per=len(cores["node1"]), config=str(hosts.cfg)))
    hosts.start_head()
    jobs = hosts.up(3)
    by_node = {_node_of(w): w for w in hosts.wait_for_workers(3)}
    mission = subprocess.Popen([ON_HOST, "login", sys.executable, "mission.py"],
                               cwd=hosts.path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        wait_for(lambda: len(os.listdir(starts)) == 3, 60, "a job started on each node")
        first = {line.split()[1]: line.split()[0] for line in os.listdir(starts)}
        assert sorted(first) == list(NODES), first
        vanished = time.time()
        for node in ("node2", "node3"):
            _signal_host(node, signal.SIGSTOP)
        out, err = mission.communicate(timeout=180)
        assert mission.returncode == 0, err[-3000:]
        results = json.loads(out.strip().splitlines()[-1])
        assert [r[0] for r in results] == [0, 1, 2] and {r[1] for r in results} == {"node1"}
        again = sorted((float(t), int(i), host) for i, host, t in map(str.split,
                                                                         os.listdir(starts)))
        reruns = [(t, i, host) for t, i, host in again if host == "node1" and
                  i != int(first["node1"])]
        assert sorted(i for _, i, _ in reruns) == sorted(int(first[n]) for n in ("node2",
                                                                                "node3"))
        assert len(again) == 5, again   # each job of a lost node once more; no other
        # (taken for lost SILENT_S after the last word heard; its job then waits for node1)
        assert reruns[0][0] - vanished < grain.SILENT_S + 15, (vanished, again)
        head_log = (hosts.path / "head.log").read_text()
        for node in ("node2", "node3"):
            w = by_node[node]
            assert re.search(rf"worker {w['name']} was lost \(silent for 30 s\) with 1 "
                             r"job\(s\) running; re-queueing them", head_log), head_log
        # node3 comes back within its reattach: its worker rejoins, the same batch job.
        _signal_host("node3", signal.SIGCONT)
        def node3_back():
            ls = hosts.grain("ls", "--json").stdout
            workers = json.loads(ls).get("workers", []) if ls.startswith("{") else []
            return [w for w in workers if _node_of(w) == "node3"]

        wait_for(node3_back, 60, "node3's worker to rejoin")
        assert node3_back()[0]["job_id"] == by_node["node3"]["job_id"]
        # node2 does not: its batch job is cancelled once its reattach is over.
        job2 = by_node["node2"]["job_id"]
        wait_for(lambda: f"cancelled its batch job {job2}" in
                 (hosts.path / "head.log").read_text(), 90, "node2's job to be cancelled")
        assert cluster_jobs(hosts.path).get(job2, ("CANCELLED",))[0] in \
            ("CANCELLED", "COMPLETING"), cluster_jobs(hosts.path)
        assert len(os.listdir(starts)) == 5   # nothing ran again when node3 came back
    finally:
        for node in ("node2", "node3"):
            _signal_host(node, signal.SIGCONT)
        if mission.poll() is None:
            mission.kill()
            mission.communicate()



@needs_cluster
@pytest.mark.parametrize("cut", [10, grain.SILENT_S + 15])
def test_a_node_cut_off_keeps_its_job(hosts, cut):
    # node1's link goes down while its job runs, and comes back ``cut`` s later, its job's
    # end in between. Shorter than SILENT_S: TCP carries the result over when the link is
    # back; nothing is taken for lost. Longer: the head takes its worker for lost, but sees
    # its alive file still touched (the filesystem is shared apart from that network), and
    # holds the job; the worker comes back with its result. Either way, nothing runs again.
    # (A node that stops is lost: above.)
    cores = node_cores()
    starts = hosts.path / "starts"
    starts.mkdir()
    hosts.path.joinpath("mission.py").write_text(VANISH_MISSION.format(
        here=HERE, starts=str(starts), per=len(cores["node1"]), config=str(hosts.cfg)))
    hosts.start_head()
    hosts.up(3)
    node1 = {_node_of(w): w for w in hosts.wait_for_workers(3)}["node1"]
    mission = subprocess.Popen([ON_HOST, "login", sys.executable, "mission.py"],
                               cwd=hosts.path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        wait_for(lambda: len(os.listdir(starts)) == 3, 60, "a job started on each node")
        subprocess.run(["ip", "-n", "grain-switch", "link", "set", "v-node1", "down"],
                       check=True)
        time.sleep(cut)   # (the cut itself: what the test is about)
        subprocess.run(["ip", "-n", "grain-switch", "link", "set", "v-node1", "up"],
                       check=True)
        out, err = mission.communicate(timeout=120)
        assert mission.returncode == 0, err[-3000:]
        results = json.loads(out.strip().splitlines()[-1])
        assert sorted(r[1] for r in results) == list(NODES), results
        assert len(os.listdir(starts)) == 3, os.listdir(starts)   # none ran again
        head_log = (hosts.path / "head.log").read_text()
        if cut < grain.SILENT_S:
            assert "was lost" not in head_log, head_log
        else:
            assert re.search(rf"worker {node1['name']} was lost \(silent for 30 s\) with 1 "
                             r"job\(s\) running; its node is up \(it still touches \S+\): "
                             r"holding them", head_log), head_log
            assert "re-queueing" not in head_log and "did not come back" not in head_log, \
                head_log
            assert re.search(rf"worker {node1['name']} came back", head_log), head_log
    finally:
        subprocess.run(["ip", "-n", "grain-switch", "link", "set", "v-node1", "up"])
        if mission.poll() is None:
            mission.kill()
            mission.communicate()


# -- A shared filesystem without working locks ----------------------------------------
# Lustre mounted without `-o flock` answers flock() and POSIX locks with ENOSYS, NFS
# without its lock daemon with ENOLCK. A shim preloaded into grain's processes makes this
# machine's filesystem answer so below one directory: flock() and fcntl()'s locks fail
# there, and SQLite's own locking (fcntl) with them.

NOLOCK_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cannot_lock(int fd) {
    const char *dir = getenv("NOLOCK_DIR");
    char link[64], path[4096];
    ssize_t n;
    if (dir == NULL) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    if ((n = readlink(link, path, sizeof path - 1)) < 0) return 0;
    path[n] = 0;
    if (strncmp(path, dir, strlen(dir)) != 0) return 0;
    errno = atoi(getenv("NOLOCK_ERRNO"));
    return 1;
}

int flock(int fd, int op) {
    static int (*real)(int, int);
    if (cannot_lock(fd)) return -1;
    if (real == NULL) real = dlsym(RTLD_NEXT, "flock");
    return real(fd, op);
}

#define LOCKING(cmd) ((cmd) == F_SETLK || (cmd) == F_SETLKW || (cmd) == F_GETLK \
                      || (cmd) == F_OFD_SETLK || (cmd) == F_OFD_SETLKW || (cmd) == F_OFD_GETLK)
#define FCNTL(name) \
    int name(int fd, int cmd, ...) { \
        static int (*real)(int, int, ...); \
        va_list ap; \
        void *arg; \
        va_start(ap, cmd); \
        arg = va_arg(ap, void *); \
        va_end(ap); \
        if (LOCKING(cmd) && cannot_lock(fd)) return -1; \
        if (real == NULL) real = dlsym(RTLD_NEXT, #name); \
        return real(fd, cmd, arg); \
    }
FCNTL(fcntl)
FCNTL(fcntl64)
"""

NOLOCK_PROBE = """
import fcntl, os, sqlite3, sys
shared, other = sys.argv[1:]
for where in (shared, other):
    with open(os.path.join(where, "probe"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            print("locks", end=" ")
        except OSError as e:
            print(e.errno, end=" ")
try:
    sqlite3.connect(os.path.join(shared, "plain.db")).execute("CREATE TABLE t (x)")
    print("sqlite")
except sqlite3.Error as e:
    print("sqlite:", e)
"""

NOLOCK_EDITS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import grain
for _ in range(25):
    with grain.edit_locked(sys.argv[2], lambda: json.load(open(sys.argv[2])), 
                           lambda d: json.dumps(d).encode()) as data:
        data["n"] += 1
"""

NOLOCK_MISSION = """
import os, sys
sys.path.insert(0, sys.argv[1])
from grain.delayed import delayed, each, run
from grain.resource import Cores, ZERO

@delayed
async def square(x, calls):
    with open(os.path.join(calls, f"{x}.{os.getpid()}"), "w"):
        pass
    return x * x

async def main():
    print(sum(await each([(square @ Cores(1))(x, sys.argv[3]) for x in range(6)])))

run(main, local=ZERO, address=f"edge://{sys.argv[2]}/edge", results=f"{sys.argv[2]}/r.db",
    config_file=False)
"""


@pytest.fixture(scope="module")
def nolock_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here to build the shim that makes a filesystem's locks fail")
    where = tmp_path_factory.mktemp("nolock")
    (where / "nolock.c").write_text(NOLOCK_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(where / "nolock.so"),
                    str(where / "nolock.c"), "-ldl"], check=True)
    return where / "nolock.so"


@pytest.mark.parametrize("error", ["ENOSYS", "ENOLCK"])
def test_grain_works_on_a_shared_filesystem_whose_locks_fail(tmp_path, nolock_shim, workers,
                                                            error):
    import errno
    shared, calls = tmp_path / "shared", tmp_path / "calls"
    shared.mkdir()
    calls.mkdir()
    env = dict(os.environ, LD_PRELOAD=str(nolock_shim), NOLOCK_DIR=str(shared),
               NOLOCK_ERRNO=str(getattr(errno, error)))
    # The filesystem as the shim makes it: no lock works there, SQLite's neither; elsewhere
    # locks work (without this, the test could pass on a filesystem that locks).
    probe = run_py("-c", NOLOCK_PROBE, str(shared), str(tmp_path), env=env)
    assert probe.stdout.startswith(f"{getattr(errno, error)} locks sqlite: "), probe
    # Small files edited under grain's lock by 4 processes at once: no edit is lost.
    counter = shared / "counter"
    counter.write_text('{"n": 0}')
    editors = [subprocess.Popen([sys.executable, "-c", NOLOCK_EDITS, HERE, str(counter)],
                                env=env) for _ in range(4)]
    assert [p.wait(60) for p in editors] == [0] * 4
    assert json.loads(counter.read_text()) == {"n": 100}
    # A mission there: its worker found through an Edge file there, its results stored
    # there; run again, it takes them from the store, and no job ran twice.
    script = tmp_path / "mission.py"
    script.write_text(NOLOCK_MISSION)
    for run_ in range(2):
        if run_:   # as a store writer killed mid-commit leaves SQLite's lock by file
            (shared / "r.db.lock").mkdir()
        workers.start("--url", f"edge://{shared}/edge", "--res", '{"Cores": {"N": 2}}',
                      name=f"w{run_}", env=env)
        done = run_py(str(script), HERE, str(shared), str(calls), env=env, timeout=120)
        assert done.returncode == 0 and done.stdout.split() == ["55"], done
    assert sorted(name.split(".")[0] for name in os.listdir(calls)) == list("012345")
    results = grain_cli("results", str(shared / "r.db"), env=env)
    assert results.returncode == 0 and re.search(r"square +done +6\n", results.stdout), results


def test_a_class_calls_only_methods_it_or_its_bases_define():
    # A base that calls a hook only its subclasses define is a template no reader can
    # follow from the base: each method a class calls on self is defined (or assigned) in
    # the class or one of its bases in grain.py.
    import ast
    tree = ast.parse(pathlib.Path(GRAIN).read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def defined(cls):
        names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef))}
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                names |= {e.attr if isinstance(e, ast.Attribute) else e.id
                          for e in ast.walk(target) if isinstance(e, ast.Name) or
                          isinstance(e, ast.Attribute) and getattr(e.value, "id", "") == "self"}
        return names

    def lineage(cls):   # None: a base from outside grain.py, which may define anything
        out = [cls]
        for base in cls.bases:
            out += lineage(classes[base.id]) if getattr(base, "id", None) in classes else [None]
        return out

    undefined = []
    for name, cls in classes.items():
        family = lineage(cls)
        if None in family:
            continue
        known = set().union(*map(defined, family))
        undefined += [f"{name}.{n.func.attr} (line {n.lineno})" for n in ast.walk(cls)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                      and getattr(n.func.value, "id", "") == "self"
                      and n.func.attr not in known]
    assert undefined == []


@pytest.mark.parametrize("case", ["lost for good", "back since", "not grain's job"])
@trio_test
async def test_a_silent_workers_batch_job_is_cancelled_only_if_ours_and_not_back(
        autojump_clock, monkeypatch, case):
    # On virtual time: the head's timer after a worker was lost in silence. It cancels the
    # worker's batch job only when grain submitted it as a worker's, and no registration of
    # that job's worker came after the loss (one that came back, even if lost again since,
    # has a timer of its own).
    cancelled = []
    monkeypatch.setattr(grain, "cancel_jobs", lambda system, ids, custom: cancelled.extend(ids))
    book = types.SimpleNamespace(records=lambda: [{"id": "41", "role": "worker"}] +
                                 ([{"id": "42", "role": "worker"}] if case != "not grain's job"
                                  else []))
    service = grain.HeadService(None, None, b"k" * 32, job_book=("slurm", book, None))
    service.registered["42"] = 1
    worker = types.SimpleNamespace(name="node2-42", job_id="42")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._cancel_unless_back, worker, 20.0, 1)
        await trio.sleep(15)
        if case == "back since":
            service.registered["42"] += 1
    assert trio.current_time() >= 20.0 + grain.HEARTBEAT_S
    assert cancelled == (["42"] if case == "lost for good" else [])


def test_a_lock_file_a_killed_process_left_is_taken_over_and_a_live_one_waited_for(
        tmp_path, monkeypatch):
    import errno
    import fcntl
    import threading

    def no_locks(fd, operation):   # the filesystem of a Lustre mount without -o flock
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path, held = tmp_path / "edge", tmp_path / "edge.lock.held"
    path.write_text("{}")
    held.touch()   # left by a process killed while it held the lock
    old = time.time() - grain.LOCK_STALE_S - 5
    os.utime(held, (old, old))
    edit = functools.partial(grain.edit_locked, str(path), lambda: json.loads(path.read_text()),
                             lambda data: json.dumps(data).encode())
    with edit() as data:
        data["n"] = 1
        assert held.exists() and held.stat().st_mtime > old   # ours now
    assert json.loads(path.read_text()) == {"n": 1} and not held.exists()
    held.touch()   # held by a live process: waited for until it is released
    threading.Timer(0.3, held.unlink).start()
    started = time.monotonic()
    with edit() as data:
        data["n"] += 1
    assert time.monotonic() - started >= 0.3 and json.loads(path.read_text()) == {"n": 2}


CTRL_C_WITH_A_WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from grain.delayed import delayed, each, run
    from grain.resource import Cores, ZERO
    from grain.subproc import run_program

    @delayed
    async def sleeps(i):
        await run_program(["sh", "-c", "touch {tmp}/started-$0; exec sleep 60", str(i)])

    async def main():
        await each((sleeps @ Cores(1))(i) for i in range(3))

    run(main, local=ZERO, address="edge://{tmp}/edge", config_file=False,
        results="{tmp}/r.db", progress=False)
""")


def test_ctrl_c_of_a_mission_with_workers_says_no_worker_was_lost(tmp_path, workers):
    # The mission tells its workers to leave now, as it goes: that is no loss of a worker,
    # no job is retried, the worker says why it left, and the store keeps no job running.
    script = tmp_path / "mission.py"
    script.write_text(CTRL_C_WITH_A_WORKER.format(here=HERE, tmp=tmp_path))
    with open(tmp_path / "err", "w+") as stderr:
        p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stderr=stderr)
        try:
            w = workers.start("--url", f"edge://{tmp_path}/edge", "--res",
                              '{"Cores": {"N": 2}}', "--oversubscribe", name="node-1")
            wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 2, 30, "two programs")
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
        finally:
            kill_all([p])
    err = (tmp_path / "err").read_text()
    assert p.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert "lost" not in err and "retrying" not in err and "re-queueing" not in err, err
    assert w.wait(15) == 0
    assert "the head told it to leave now" in w.log_path.read_text()
    with contextlib.closing(sqlite3.connect(tmp_path / "r.db")) as db:
        assert [s for (s,) in db.execute("SELECT state FROM results_log")] == []


@needs_slurm
def test_ls_with_no_head_names_the_worker_jobs_that_still_hold_an_allocation(tmp_path):
    # A mission that was its own head is killed: its worker waits for a new head (its
    # reattach) in a batch job that still runs. `ls` says no head answers, and names that
    # job, which `down` ends, beside the jobs whose worker never joined.
    cfg = slurm_config(tmp_path, cores=1)
    cfg.write_text(cfg.read_text() + "[head.gnaw]\nenabled = false\n")
    marker = tmp_path / "started"
    head = start_mission(tmp_path, cfg, text=SLURM_MISSION.replace(
        "await trio.sleep(2)", f"open({str(marker)!r}, 'w').close(); await trio.sleep(60)"))
    try:
        up = grain_cli("up", "-c", str(cfg), cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        job, = re.findall(r"submitted worker job (\d+) ", up.stdout)
        wait_for(marker.exists, 120, "a job on the worker")
    finally:
        head.kill()
        head.communicate()
    try:
        ls = grain_cli("ls", "-c", str(cfg), cwd=tmp_path)
        assert ls.returncode == 1 and "no head is listening" in ls.stderr, ls.stderr
        assert re.search(rf"^joined a head that no longer answers, still queued or running "
                         rf"\(`down` ends them\):\n  job {job} \(grain-worker\): RUNNING$",
                         ls.stdout, re.M), ls.stdout
    finally:
        assert grain_cli("down", "-c", str(cfg), cwd=tmp_path).returncode == 0
        wait_for(lambda: job not in squeue_ids(), 60, "the worker job to end")
