"""grain.py -- a resource-aware parallel scheduler for HPC clusters, in one file.

Write async Python; grain runs each job where the resources it asks for are free
(``Cores(4) & Memory(8)``, ``WTime(T="1:00:00")``, ``Token("gpu")``) and tells the job
its exact allocation through ``GVAR.res``. A drop-in replacement for upstream Grain
(grain-scheduler 0.17): its import lines, programs and config files work unchanged.

    from grain.delayed import delayed, run
    from grain.resource import Cores

    @delayed
    async def square(x):
        return x * x

    async def main():
        print(await ((square @ Cores(1))(3) + (square @ Cores(1))(4)))   # 25

    run(main, local=Cores(2))

Sections, in dependency order (each uses only what is above it):

    Trampoline          ``python grain.py`` and ``import grain`` share one module
    Imports and compat  trio and dill, imported at first use; 3.9/3.10 fallbacks
    Constants           every tunable and timeout, with its unit
    Errors              GrainError and its children
    Helpers             walltimes, durations, this file's argv, locked files, logging, TaskPool
    Resources           the resource algebra: Resource, ResourceSet, ZERO, the registry
    Resource kinds      Cores, Memory, Capacity, Token, Gpus, WTime, Node, Reject
    Context             GVAR and the run state, in ContextVars
    Jobs                Job, failure classes, Tally, Retries; pickling jobs' values
    Scheduler           the queue policy: fairness, backfill, reservations (no I/O)
    Head state          HeadCore and the Reunion: what a head knows, and its changes (no I/O)
    Wire protocol       sans-I/O: frames, the HMAC handshake, the key, MESSAGES, dispatch
    Transports          serve() and connect() for tcp, unix and Edge
    Channels            message sessions over a stream: batched writes, dispatch_all
    Bridge              bridge://: meeting across clusters, direct or relayed; the server
    Subprocesses        the programs a job runs (run_program, job_env); @subprocify's pool
    Config              grain.toml as frozen dataclasses
    Cluster             the batch systems as data (SYSTEMS), job scripts, job records
    Host                what this machine offers: cores, memory, GPUs, allocation end
    Results store       a mission's results in SQLite, keyed by what each job computes
    Workers             a worker as a head sees it; local, remote, specialized
    Head service        where workers, the CLI and missions reach a head; its timers
    Mission link        how a mission reaches and uses the head daemon
    Watching a mission  its status line, totals and HTML report
    Executor            GrainExecutor: jobs, retries, failure classes, lifetime
    Combine             open_waitgroup, exec1, run_combine; mission options
    Delayed             @delayed, Delayed placeholders, each, run; grain.util
    Worker process      ``grain.py worker``: the other end of a worker
    Head daemon         ``grain.py head``: the scheduler shared by missions
    Pack                ``grain.py pack``: grain.pyz for clusters without pip
    CLI                 build_parser() and main(argv); the only place that exits
    Submodules          grain.delayed, grain.resource, ... for upstream's import lines
"""

__version__ = "0.1.0"

__all__ = [
    "GVAR", "GrainError", "BrokenSubprocessError",
    "Resource", "ResourceSet", "Cores", "Memory", "Node", "WTime", "Token", "Capacity", "Gpus",
    "ONE_INSTANCE", "ZERO", "Reject", "REJECT", "RESOURCE_TYPES", "register_resource",
    "subprocify", "subprocess_pool_scope", "run_program", "job_env", "ProgramError",
    "GrainExecutor", "Job",
    "open_waitgroup", "exec1", "run_combine", "load_cache_or_exec1",
    "delayed", "Delayed", "DelayedFn", "DelayedFunction", "delayedval", "each", "run",
    "main",
]


###############################################################################
# Trampoline ##################################################################
###############################################################################
# Run as a script, this file would be module ``__main__`` and a job pickled by a mission
# (which refers to ``grain.Cores``) would meet a second, different ``Cores`` class. So the
# script loads this same file as module ``grain`` and hands over to its ``main``.

if __name__ == "__main__":
    import importlib.util as _ilu
    import sys as _sys

    _spec = _ilu.spec_from_file_location("grain", __file__)
    _grain = _ilu.module_from_spec(_spec)
    _sys.modules["grain"] = _grain
    _spec.loader.exec_module(_grain)
    _sys.exit(_grain.main(_sys.argv[1:]))


###############################################################################
# Imports and compat ##########################################################
###############################################################################

import argparse
import bisect
import builtins
import codecs
import contextlib
import contextvars
import copy
import difflib
import errno
import fnmatch
import functools
import gc
import glob
import hashlib
import hmac
import importlib.machinery
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import operator
import os
import pickle
import pwd
import re
import reprlib
import select
import shlex
import signal
import socket
import stat
import statistics as _statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
from collections import Counter, OrderedDict, deque, namedtuple
from dataclasses import dataclass, field, fields, replace

_missing = [name for name in ("trio", "dill") if importlib.util.find_spec(name) is None]
if _missing:  # pragma: no cover - depends on the machine
    raise ImportError(f"grain.py needs trio and dill (no module named {', '.join(_missing)}); "
                      "install them with `python -m pip install trio dill`, or use the "
                      "self-contained grain.pyz built by `python grain.py pack`")


def _package_version(name, version_file):
    """A package's ``__version__``, read from its source when it is not imported yet:
    `--version` should not pay for importing trio."""
    module = sys.modules.get(name)
    if module is None:
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(name)
            path = os.path.join(os.path.dirname(spec.origin), version_file)
            text = spec.loader.get_data(path).decode()  # a file, or a member of grain.pyz
            return re.search(r"^__version__ = ['\"]([^'\"]+)", text, re.M).group(1)
        module = importlib.import_module(name)
    return getattr(module, "__version__", "?")


# The oldest trio that runs a mission as the newest does: 0.22 brought the
# strict_exception_groups switch that trio_run() and open_strict_nursery() turn on (trio
# >= 0.25 has it on by default). Sites install old trios system-wide: refuse one that is
# older in one line, before a mission meets an AttributeError half-way through.
TRIO_OLDEST = (0, 22)
_trio_version = _package_version("trio", "_version.py")
_trio_numbers = tuple(int(x) for x in re.findall(r"\d+", _trio_version)[:2])
if _trio_numbers and _trio_numbers < TRIO_OLDEST:  # (a trio that does not say: let it try)
    raise ImportError(f"grain.py needs trio >= {'.'.join(map(str, TRIO_OLDEST))}, but trio "
                      f"{_trio_version} is installed; upgrade it with `python -m pip install "
                      "-U trio`, or use the self-contained grain.pyz")


class _ImportOnFirstUse(types.ModuleType):
    """Stands for a module until its first attribute is used, then imports it and takes
    its place among this file's globals. trio and dill are most of grain's start-up time
    (about 70 ms of 100), and `import grain`, `--version` or `ls` need neither."""

    def __getattr__(self, attr):
        module = importlib.import_module(self.__name__)
        globals()[self.__name__] = module
        return getattr(module, attr)


trio = _ImportOnFirstUse("trio")
dill = _ImportOnFirstUse("dill")
sqlite3 = _ImportOnFirstUse("sqlite3")  # only a mission with a results store needs it


# trio.TASK_STATUS_IGNORED without importing trio: the default ``task_status`` of a
# service that may also be called other than through ``nursery.start()``.
TASK_STATUS_IGNORED = types.SimpleNamespace(started=lambda value=None: None)


def trio_run(async_fn, *args):
    """``trio.run`` whose nurseries always raise an ExceptionGroup (trio >= 0.25's default,
    asked for so that a mission behaves the same on trio 0.22)."""
    return trio.run(async_fn, *args, strict_exception_groups=True)


def open_strict_nursery():
    """A nursery that always raises an ExceptionGroup, whatever the trio and whatever the
    ``trio.run`` (a user's own, or pytest-trio's) it runs under: grain's code unwraps
    groups in one way only."""
    return trio.open_nursery(strict_exception_groups=True)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.9 CI run
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None  # only the config loader needs it; it says so when missing
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup  # shipped with trio

log = logging.getLogger("grain")


###############################################################################
# Constants ###################################################################
###############################################################################
# Every tunable and timeout, with its unit. (Protocol constants stay with the protocol.)

MAX_RETRIES = 3           # retries of a job after a temporary failure (so 4 attempts)
RETIRED_RETRIES = 20      # ... after its worker retired: not the job's fault, a wide bound
STUCK_WARN_S = 60.0       # seconds the head job may fit no worker before we warn
STUCK_REPEAT_S = 300.0    # seconds between repeated warnings about the same stuck queue
STUCK_CHECK_S = 5.0       # seconds between checks of the stuck queue
BACKFILL_DEPTH = 64       # how far behind a blocked job the scheduler looks for jobs that fit
RESERVE_AFTER_S = 30.0    # a job blocked this long reserves a worker: nothing else starts there
FEW_WORKERS = 8           # up to this many, the scheduler looks at each for each job
IDLE_TASKS = 64           # tasks a worker keeps, done with a job, to run the next (TaskPool)
FREEZE_JOBS = 100_000     # each time a mission (or the head daemon) has taken this many more
                          # jobs, the cyclic collector stops walking the heap as it is then
                          # (gc.freeze), until the mission ends (the daemon: is idle)
DAEMON_YOUNG_GC = 10_000  # the head daemon's threshold for a young collection (Python's:
                          # 700), which walks the thousands of jobs in flight to a swarm
GROUP_MIN_RUN_S = 10.0    # runs of a WTime group at most this long teach nothing
GROUP_SAMPLES = 8         # runs of a WTime group needed before its limits are estimated
SUBPROC_IDLE_S = 60.0     # seconds an idle pool process lives before it is shut down
SUBPROC_REAP_S = 5.0      # ... checked this often
SUBPROC_MARGIN_S = 0.25   # seconds the child's own T alarm fires before the parent's
LOCK_STALE_S = 10.0       # seconds after which a lock file (where locks fail) was left
KILL_GRACE_S = 2.0        # seconds between SIGTERM and SIGKILL when stopping a child
PARENT_WATCH_S = 0.5      # how often a pool process looks whether its parent still lives
STDERR_TAIL = 4000        # bytes of a program's stderr kept for its ProgramError
PIPE_CHECK_S = 1.0        # seconds between looks whether a program holding pipes has ended
MAX_FRAME = 1 << 30       # bytes; the largest frame a peer may send (1 GiB)
HANDSHAKE_TIMEOUT_S = 5.0  # seconds a new connection has to prove it holds the key
HEARTBEAT_S = 10.0        # seconds between heartbeats, both ways
SILENT_S = 30.0           # seconds of silence after which a peer is taken for lost
ALIVE_S = 15.0            # a worker's alive file touched this recently: its node is up
MISSION_SILENT_S = 300.0  # ... a mission, whose main may block its event loop for a while
FLUSH_S = 5.0             # seconds a closing connection may take to send what it queued
EDGE_HEARTBEAT_S = 10.0   # seconds between refreshes of the listener's Edge record
SOCKET_GRACE_S = 10.0     # seconds a new socket file is not taken for a dead one
EDGE_STALE_S = 45.0       # seconds after which an unrefreshed Edge record is stale
EDGE_CONNECT_S = 3.0      # seconds to try one URL from an Edge record
CLI_TIMEOUT_S = 5.0       # seconds `ls`/`quit` wait for a head to answer
JOB_WATCH_S = 10.0        # seconds between checks for batch jobs that ended unjoined
LEAVE_BEFORE_S = 180.0    # seconds before its walltime ends that a job script's worker leaves
BATCH_QUERY_S = 30.0      # seconds a query of the batch system (squeue, qstat) may take
SUBMIT_S = 60.0           # seconds a submission (sbatch, qsub) or cancellation may take
SUBMIT_TRIES = 4          # tries of a submission while the batch system answers that it is busy
SUBMIT_BACKOFF_S = 2.0    # seconds before the second try, doubled before each next
HEAD_START_S = 20.0       # seconds a mission waits for the head daemon it started to answer
HEAD_POLL_S = 0.005       # ... polling its socket this often
ATTACH_TRIES = 3          # daemons a mission tries that close on it before answering
SWARM_CHECK_S = 1.0       # seconds between comparisons of the swarm with its target
SWARM_STATES_S = 5.0      # ... and between queries of the batch jobs not joined yet
LOG_TAIL_LINES = 10       # lines of a job's log shown when it ended without joining
STORE_FLUSH_S = 0.1       # results reach the store within this (a kill -9 loses no more)
STORE_BEAT_S = 10.0       # seconds between refreshes of a results store's holder file
STORE_STALE_S = 60.0      # ... after which one from another host is taken for dead
STORE_WRITER_EXIT_S = 10.0  # a results store's writer, told it is done, leaves within this
REATTACH_S = 600.0        # worker.reattach: how long a worker whose head went keeps its jobs
REJOIN_WAIT_S = 10.0      # a new head holds jobs that were running this long for their worker
ORPHAN_WAIT_S = 300.0     # a job a worker came back with that no mission claims is cancelled
REATTACH_POLL_S = 0.5     # seconds between a lone worker's tries to reach a new head
RESEND_S = 60.0           # results sent this long before a head was lost go to the next too


###############################################################################
# Errors ######################################################################
###############################################################################


class GrainError(Exception):
    """Root of every error grain raises on its own account."""


class BrokenSubprocessError(GrainError):
    """A subprocess-pool process died (segfault, ``os._exit``, killed) while running a job.

    Counted as an infrastructure failure: the job is retried up to ``max_retries`` times."""


class UsageError(GrainError):
    """The user asked for something malformed (a CLI argument, a config value)."""


class ListenError(GrainError, OSError):
    """An address this process cannot listen on (in use, not its own, no such directory):
    a GrainError for the command line, an OSError for those who retry."""


class PeerError(GrainError):
    """Something a peer sent or did is wrong: the peer is to blame, not this process."""


class FrameError(PeerError):
    """A peer sent a frame we cannot accept (oversized, truncated)."""


class AuthenticationError(PeerError):
    """A peer failed the handshake: it does not hold the key, or does not speak grain."""


class HungUp(AuthenticationError):
    """A peer closed the connection during the handshake."""


class WorkerLostError(GrainError):
    """The worker running a job was lost (its connection closed or went silent)."""


class WorkerRetiredError(GrainError):
    """The worker running a job left on purpose (walltime, quit, SIGTERM)."""


class Unreachable(GrainError):
    """Nobody who holds the key answers at an address."""


class KeyMismatch(AuthenticationError, Unreachable):
    """The peer failed the handshake holding another key: to a dialer, a head that is not
    theirs (connect() names both key files)."""


###############################################################################
# Helpers #####################################################################
###############################################################################
# Small pieces every later section may use: walltimes and durations, exceptions, the argv
# that runs this file again, modules named in a config, files changed under a lock,
# logging set up for a program that has not, tasks reused for one call after another.

_WALLTIME_RE = re.compile(r"^(?:(\d+)-)?(\d+):([0-5]?\d):([0-5]?\d)$")


def parse_walltime(value, what="walltime"):
    """Seconds from an int/float or a ``[d-]hh:mm:ss`` string; ``None`` stays ``None``."""
    if value is None:
        return None
    if _is_number(value):
        return _check_amount(value, what, " of seconds")
    if isinstance(value, str):
        s = value.strip()
        if s.isdigit():
            return int(s)
        m = _WALLTIME_RE.match(s)
        if m:
            d, h, mi, se = m.groups()
            return int(d or 0) * 86400 + int(h) * 3600 + int(mi) * 60 + int(se)
    raise ValueError(f"malformed {what} {value!r}: expected seconds or [d-]hh:mm:ss")


def _is_number(v, kinds=(int, float)):
    return isinstance(v, kinds) and not isinstance(v, bool)


def _check_count(value, what, least=0):
    if not (_is_number(value, int) and value >= least):
        raise ValueError(f"{what} must be a whole number >= {least}, got {value!r}")
    return value


def _check_amount(value, what, unit=""):
    if not (_is_number(value) and 0 <= value < math.inf):
        raise ValueError(f"{what} must be a non-negative finite number{unit}, got {value!r}")
    return value


def format_walltime(seconds, hhmmss=False):
    """``[d-]h:mm:ss`` for a number of seconds (rounded down); ``hhmmss``: hours past a
    day, two digits at least (a WTime's repr, PBS's walltime)."""
    if seconds is None or seconds == math.inf:
        return "inf"
    s = max(0, int(seconds))
    if hhmmss:
        return f"{s // 3600:02}:{s % 3600 // 60:02}:{s % 60:02}"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:d}:{m:02d}:{s:02d}"


def parse_duration(value, what):
    """Seconds from ``90s``, ``30m``, ``2h``, ``1d``, a number, or ``[d-]hh:mm:ss``."""
    if isinstance(value, str):
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$", value)
        if m:
            return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return parse_walltime(value, what)
    except ValueError:
        raise ValueError(f"{what}: expected a duration such as 90s, 30m, 2h or hh:mm:ss, "
                         f"got {value!r}") from None


def _run_command(argv, what="query", hint="", timeout=None, stdin=None, check=True):
    """Run ``argv`` for at most ``timeout`` seconds (BATCH_QUERY_S), output captured: its
    stdout, or (``check`` false) its CompletedProcess whatever its exit status, for the
    caller to tell a batch system's "no such job" from its failing to answer. GrainError,
    one line naming the command, when it cannot run, does not return in time or
    (``check``) exits non-zero: ``what`` failed, and ``hint``, what to do."""
    timeout = timeout or BATCH_QUERY_S
    hint = f" — {hint}" if hint else ""
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    except OSError as e:
        raise GrainError(f"{argv[0]}: " + ("command not found" if isinstance(
            e, FileNotFoundError) else e.strerror or str(e)) + hint) from None
    except subprocess.TimeoutExpired:
        raise GrainError(f"{what} failed: {argv[0]} did not return within {timeout:g} s"
                         + hint) from None
    if check and cp.returncode != 0:
        msg = (cp.stderr or cp.stdout).strip().replace("\n", " ")
        raise GrainError(f"{what} failed ({argv[0]} exit {cp.returncode}): {msg}")
    return cp.stdout if check else cp


def add_note(exc, note):
    """``exc.add_note`` on 3.11+; the same ``__notes__`` list below (shown by exceptiongroup)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python < 3.11
        with contextlib.suppress(AttributeError):
            exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


TERMINAL = threading.RLock()  # held while writing to the mission's stdout and stderr


class StandIn:
    """Stands for sys.stdout or sys.stderr (``default``): what is written goes to
    ``target()`` (where a mission's local jobs print), or to ``default`` when that gives
    None, after ``before(text)`` (a status line clears itself)."""

    def __init__(self, default, target=lambda: None, before=None):
        self._default = default
        self._target = target
        self._before = before

    def write(self, text):
        with TERMINAL:  # (programs' threads forward their stderr here too)
            if self._before is not None:
                self._before(text)
            return (self._target() or self._default).write(text)

    def flush(self):
        target = self._target()
        if target is not None:
            target.flush()
        self._default.flush()

    def __getattr__(self, name):
        return getattr(self._default, name)


# What a batch system warns a worker's job of (Grid Engine's -notify; a user's --signal):
# USR2, that it ends the job soon (qdel, say): the worker leaves in order at
# once; USR1, that it suspends it soon: nothing to do (by default each would kill it).
BATCH_NOTICES = {"SIGUSR2": "the batch system is about to end this job",
                 "SIGUSR1": "the batch system is about to suspend this job"}


async def watch_signals(on_signal, *, notices=False, task_status=TASK_STATUS_IGNORED):
    """Call ``on_signal(name)`` at each SIGTERM or SIGINT (with ``notices``, SIGUSR2; and
    SIGUSR1 is said and ignored), once started: a process that leaves in order (a worker
    tells its head, a head daemon says goodbye to its workers)."""
    more = (signal.SIGUSR1, signal.SIGUSR2) if notices else ()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, *more) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if name in BATCH_NOTICES:
                log.info("got %s: %s", name, BATCH_NOTICES[name])
            if name != "SIGUSR1":
                on_signal(name)


def lone_exception(exc):
    """The one exception inside a group of one (nested nurseries wrap an error in a group
    each), or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _unpartial(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _is_async_callable(fn):
    """True for ``async def`` functions, partials of them and objects with ``async __call__``."""
    fn = _unpartial(fn)
    if inspect.iscoroutinefunction(fn) or getattr(fn, "_grain_async", False):
        return True
    call = getattr(type(fn), "__call__", None)
    return call is not None and not isinstance(fn, type) and inspect.iscoroutinefunction(call)


def _callable_name(fn):
    fn = _unpartial(fn)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# How a child runs this file: through the import system, which keeps its compiled bytecode
# in __pycache__. `python grain.py` would compile the whole file again in every child (about
# 50 ms: most of a worker's start when a hundred start at once on a small node). Like the
# trampoline, it loads the file as module ``grain``; sys.path[0] is the file's folder, as
# for a script, unless Python runs isolated.
_CHILD_BOOT = ("import sys, os, importlib.util as u; p = sys.argv[1]; del sys.argv[1]; "
               "sys.flags.isolated or sys.path.__setitem__(0, os.path.dirname(p)); "
               "s = u.spec_from_file_location('grain', p); m = u.module_from_spec(s); "
               "sys.modules['grain'] = m; s.loader.exec_module(m); "
               "sys.exit(m.main(sys.argv[1:]))")


def self_path():
    """This file, or the grain.pyz holding it."""
    path = os.path.abspath(__file__)
    # Inside a zipapp __file__ is ".../grain.pyz/grain.py": the archive itself.
    archive = os.path.dirname(path)
    return archive if os.path.isfile(archive) else path


def boot_argv(python, path, *args):
    """The argv that runs grain.py (or grain.pyz) at ``path`` under ``python`` with
    ``args``, as ``python grain.py ARGS`` would but from cached bytecode."""
    if not path.endswith(".py"):  # grain.pyz: zipimport has no bytecode cache to use
        return [python, path, *args]
    return [python, "-c", _CHILD_BOOT, path, *args]


def self_argv(*args):
    """The argv that re-runs this very file (or the grain.pyz holding it) with ``args``.

    Every child grain starts (pool processes, workers, job scripts) is started this way, never
    as ``-m grain``, so it runs the same code as its parent."""
    # Children keep an isolated (-I) or site-less (-S) parent's view of the world: a
    # bundle run that way must not pick up other copies of trio in a child.
    flags = (["-I"] if sys.flags.isolated else []) + (["-S"] if sys.flags.no_site else [])
    python, *rest = boot_argv(sys.executable, self_path(), *args)
    return [python, *flags, *rest]


def load_module(name, what):
    """A context or specialized-worker module: a Python file (``path/to/ctx.py``), or an
    importable module (``cool_package.the_sworker``). ``what`` names it in errors."""
    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.isfile(path):
            raise GrainError(f"{what} {name}: no such file")
        spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise GrainError(f"{what} {name}: cannot import it ({e})") from None


def load_context(name, what="contextmod"):
    """The ``grain_context`` async context manager of a context module."""
    ctx = getattr(load_module(name, what), "grain_context", None)
    if ctx is None:
        raise GrainError(f"{what} {name}: defines no grain_context()")
    return ctx


@contextlib.asynccontextmanager
async def open_background_nursery():
    """A nursery for background services: cancelled when the body ends. Unlike a plain
    nursery, an exception from the body comes out as itself, not wrapped in an
    ExceptionGroup, so users see their own error."""
    manager = open_strict_nursery()
    nursery = await manager.__aenter__()
    try:
        yield nursery
    finally:
        nursery.cancel_scope.cancel()
        await manager.__aexit__(None, None, None)


def pauses(first, most=None):
    """The back-off of every loop that tries again: ``first`` seconds, then each pause twice
    the last, up to ``most`` (None: ``first`` each time)."""
    while True:
        yield first
        first = min(2 * first, most or first)


async def retry(attempt, errors, pause, most=None, failed=None):
    """``await attempt()`` until it returns, again after each of ``errors``, after pauses()
    of ``pause`` up to ``most``. ``failed(error, pause)`` hears of each failure first, and
    may raise to give up. (Each call starts afresh: a loop that lost what it reached calls
    again.)"""
    for pause in pauses(pause, most):
        try:
            return await attempt()
        except errors as e:
            if failed is not None:
                failed(e, pause)
        await trio.sleep(pause)


class HeapFreezer:
    """The cyclic collector's rule for jobs, which live until their mission ends: a full
    collection of a heap of millions of them would pause the event loop for a quarter of a
    second each time, so freeze(job) at each FREEZE_JOBS-th job taken (or freeze(): now)
    freezes the heap as it is then (gc.freeze); thaw() gives it back to the collector when
    the missions end."""

    froze = False

    def freeze(self, job=None):
        if job is None or not job.id % FREEZE_JOBS:
            gc.freeze()
            self.froze = True

    def thaw(self):
        # (the next full collection walks them again; on Python 3.12 gc.unfreeze() also
        # thaws what the interpreter froze at its start: no harm, it is walked as on the
        # other Pythons, whose start freezes nothing)
        if self.froze:
            gc.unfreeze()
            self.froze = False


class TaskPool:
    """Runs ``await fn(*args)`` for each ``start(*args)`` in tasks of ``nursery`` that it
    reuses: a task done with one call waits to be handed the next (up to IDLE_TASKS of them
    wait), which costs a wakeup instead of a new trio task, a fifth of a no-op job's cost.
    Unlike start_soon, a call sees the context variables that an earlier call in its task
    set (each job sets its own: GVAR)."""

    def __init__(self, nursery, fn):
        self.nursery = nursery
        self.fn = fn
        self.idle = []

    def start(self, *args):
        if self.idle:
            box = self.idle.pop()
            box[1] = args
            trio.lowlevel.reschedule(box[0])
        else:
            self.nursery.start_soon(self._serve, [None, args])

    async def _serve(self, box):  # box: [this task, the arguments of its next call]
        idle, box[0] = self.idle, trio.lowlevel.current_task()

        def abort(_):  # cancelled while it waits: the nursery closes
            idle.remove(box)
            return trio.lowlevel.Abort.SUCCEEDED
        while True:
            # (the arguments are never a local here: trio reads this frame's locals, and
            # a snapshot of them would keep a job's payload while the task waits)
            await self.fn(*box[1])
            box[1] = None
            if len(idle) >= IDLE_TASKS:
                return
            idle.append(box)
            await trio.lowlevel.wait_task_rescheduled(abort)


def hostname():
    """This host's short name."""
    return socket.gethostname().split(".")[0]


def _pid_lives(pid):
    """Does process ``pid`` of this host live? (True when it is someone else's.)"""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # a process killed a moment ago may not have been reaped yet
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def output_path_problem(path):
    """Why a file cannot be written at ``path`` (a directory, or one that does not exist),
    in a few words; None when it can be. Checked before the work that ends in writing it."""
    if os.path.isdir(path):
        return "a directory, not a file"
    where = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(where) else f"no directory {where}"


def _did_you_mean(word, choices, prefix=""):
    """``"; did you mean 'x'?"`` naming the choice nearest a misspelt ``word``, or ""."""
    close = difflib.get_close_matches(word, choices, 1)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def _unlink_quietly(path):
    with contextlib.suppress(OSError):
        os.unlink(path)


def atomic_write(path, data, mode=0o600):
    """Replace ``path`` with ``data`` in one step (write a temp file, then rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


# What a shared filesystem without working locks answers a lock: Lustre mounted without
# ``-o flock`` ENOSYS, NFS without its lock daemon ENOLCK, some FUSE mounts EOPNOTSUPP.
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


@contextlib.contextmanager
def edit_locked(path, read, encode):
    """Yield ``read()`` while holding an exclusive lock on ``<path>.lock``, and write back
    ``encode(data)`` if the block changed it: `up`, `down`, heads and workers change the
    same small files (Edge records, job records) at once. The lock is a flock; where the
    filesystem has none (NO_LOCKS), the file ``<path>.lock.held``, created only if it is
    not there (atomic on NFS 3 and later, and on Lustre), is the lock."""
    import fcntl

    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            release = None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                raise

            release = _hold_by_creating(path + ".lock.held",
                                        functools.partial(_file_server_now, fd))
        try:
            data = read()
            before = encode(data)
            yield data
            if encode(data) != before:
                atomic_write(path, encode(data))
        finally:
            if release is not None:
                release()
    finally:
        os.close(fd)  # closing releases the flock


def _file_server_now(fd):
    """The time now by the clock of the server of the open file ``fd`` (a client's clock
    may be off): ``fd`` is touched."""
    os.utime(fd)
    return os.fstat(fd).st_mtime


def file_server_time(path):
    """The time now by the clock of the file server of ``path``, a file of grain's that it
    touches (made if need be), for times that hosts write in shared files and read there:
    their own clocks may be minutes apart. OSError when it cannot be touched."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return _file_server_now(fd)
    finally:
        os.close(fd)


def touched_within(path, seconds, probe=None):
    """Was the file at ``path`` touched in the last ``seconds`` by its file server's clock
    (read at ``probe``, by default ``.now`` beside it)? False when it cannot be read.
    (Opened, not just stat'ed: NFS then asks the server instead of answering from what it
    cached.)"""
    try:
        now = file_server_time(probe or os.path.join(os.path.dirname(path), ".now"))
        with open(path, "rb") as f:
            return now - os.fstat(f.fileno()).st_mtime < seconds
    except OSError:
        return False


async def keep_touching(path):
    """Touch the file at ``path`` (made, with its folder, if need be) every HEARTBEAT_S
    until cancelled, then remove it. A touch that fails is only a touch missed."""
    def touch():
        try:
            os.utime(path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    try:
        while True:
            with contextlib.suppress(OSError):
                await trio.to_thread.run_sync(touch)
            await trio.sleep(HEARTBEAT_S)
    finally:
        _unlink_quietly(path)


def _hold_by_creating(path, now):
    """Create ``path`` once it is not there (waiting for whoever holds it); return a
    ``release()``. A file older than LOCK_STALE_S by ``now()`` (the file server's clock)
    was left by a process killed holding it (a hold lasts milliseconds): it is taken over
    by renaming it, which only one taker can, and released only if it is still ours."""
    for pause in pauses(0.001, 0.05):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if now() - os.stat(path).st_mtime > LOCK_STALE_S:
                    taken = f"{path}.{os.getpid()}.stale"
                    os.rename(path, taken)
                    os.unlink(taken)
                    continue
        time.sleep(pause)
    ours = os.fstat(fd).st_ino
    os.close(fd)

    def release():
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ours:  # (not one that took over from us, slowed)
                os.unlink(path)
    return release


def sqlite_uri(path, **params):
    """The URI sqlite3.connect(..., uri=True) opens ``path`` by, with ``params`` (mode=ro);
    where the filesystem cannot lock (NO_LOCKS), SQLite's unix-dotfile VFS, which locks by
    creating a file: its usual POSIX locks would fail every statement there."""
    import fcntl
    import tempfile

    with contextlib.suppress(OSError):  # (a directory it cannot write: it is not asked)
        with tempfile.TemporaryFile(dir=os.path.dirname(path)) as probe:
            try:
                fcntl.lockf(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in NO_LOCKS:
                    params["vfs"] = "unix-dotfile"
    where = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    return f"file:{where}" + "".join(f"{'&' if i else '?'}{k}={v}"
                                     for i, (k, v) in enumerate(params.items()))


def log_tail(path, n=LOG_TAIL_LINES):
    """The last ``n`` lines of a log file, indented, or why there are none."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()[-n:]
    except OSError:
        return f"(no log file at {path or 'an unknown place'})"
    return "\n".join("    " + line for line in lines) or "    (the log is empty)"


class _GrainFormatter(logging.Formatter):
    def format(self, record):
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"grain {record.levelname}: {msg}" if record.levelno >= logging.WARNING else msg


def _default_logging():
    """Give grain's logger a readable handler, unless the application configured logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_GrainFormatter())
    handler.grain_default = True  # (a mission's status line may share its terminal)
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _allowed_cores():
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


###############################################################################
# Resources ###################################################################
###############################################################################
# A resource object plays two roles: as a *request* it says what a job needs
# (``Cores(3)``); as a *provider* it is what a worker still has free
# (``Cores([0-7])``), and ``provider.alloc(request)`` carves out the *allocation*
# a job gets (``Cores([6,7,9])``). Kinds combine with ``&`` into a ResourceSet.
#
# A kind implements the five hooks of the documented interface, each seeing one
# part of its own kind: ``_request(req)`` (can I give this now?), ``_alloc(req)``
# (give it: mutate self, return the allocation), ``_dealloc(alloc)`` (take it
# back), ``_repr()`` and ``_stat()`` -> (free, total). The public methods
# (request/alloc/dealloc/stat) spread a combined resource over its parts; a
# request naming a kind the provider lacks is refused, as upstream Grain does.
# Attributes mean what they meant there: ``.m``/``.v`` the amount now (free on
# a provider, held by an allocation), ``.M``/``.V`` the total.


class Resource:
    """Base of every resource kind. Subclass it and implement the five hooks to add a kind.

    ``kind`` names the kind (default: the class name)."""

    kind = None
    __slots__ = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "kind" not in cls.__dict__:
            cls.kind = cls.__name__

    # -- the interface a kind implements ---------------------------------
    def _request(self, res):
        raise NotImplementedError(f"{type(self).__name__} does not implement _request")

    def _alloc(self, res):
        raise NotImplementedError(f"{type(self).__name__} does not implement _alloc")

    def _dealloc(self, res):
        raise NotImplementedError(f"{type(self).__name__} does not implement _dealloc")

    def _repr(self):
        return type(self).__name__

    def _stat(self):
        return (0, 0)

    _REFUSAL = "{self!r} cannot allocate {res!r}"

    def _refusal(self, res):
        """Why this provider cannot allocate ``res`` (alloc's error message)."""
        return self._REFUSAL.format(self=self, res=res)

    def _claim(self, res):
        """Take out an allocation made before (by this provider, in an earlier life)."""
        if self._request(res):
            self._alloc(res)

    def _args(self):
        """Constructor arguments: the dict form, equality and copies use them."""
        raise NotImplementedError(f"{type(self).__name__} has no dict form")

    # -- the public API --------------------------------------------------
    def _parts(self):
        return {self.kind: self}

    def _refuse(self, req):
        """Why ``req`` cannot be allocated here now, or None if it can."""
        have = self._parts()
        for kind, want in req._parts().items():
            mine = have.get(kind)
            if mine is None:
                return f"Cannot alloc: resource {self!r} does not have the same shape as {req!r}"
            if not mine._request(want):
                return mine._refusal(want)
        return None

    def request(self, req):
        """True if this provider can allocate ``req`` right now."""
        if self.kind is not None and self.kind == req.kind:  # the hot path: one kind each
            return self._request(req)
        return self._refuse(req) is None

    def alloc(self, req):
        """Take ``req`` out of this provider and return the specific allocation."""
        why = self._refuse(req)
        if why is not None:
            raise ValueError(why)
        return self._take(req)

    def _take(self, req):
        # alloc() without the check, for the scheduler, which has just called request().
        if self.kind is not None and self.kind == req.kind:
            return self._alloc(req)
        have = self._parts()
        wants = req._parts()
        out = {}
        if "Gpus" in wants and "Cores" in wants:  # cores close to the job's GPUs, if known
            out["Gpus"] = gpus = have["Gpus"]._alloc(wants["Gpus"])
            near = have["Gpus"].cpus_near(gpus)
            if near:
                out["Cores"] = have["Cores"]._alloc_near(wants["Cores"], near)
        return ResourceSet._of({kind: out[kind] if kind in out else have[kind]._alloc(want)
                                for kind, want in wants.items()})

    def dealloc(self, alloc):
        """Give an allocation made by ``alloc`` back to this provider."""
        if self.kind is not None and self.kind == alloc.kind:
            self._dealloc(alloc)
            return
        have = self._parts()
        for kind, part in alloc._parts().items():
            mine = have.get(kind)
            if mine is None:
                raise ValueError(f"Cannot dealloc: resource {self!r} does not have the same "
                                 f"shape as {alloc!r}")
            mine._dealloc(part)

    def claim(self, alloc):
        """Take out of this provider an allocation it made before: that of a job a worker
        still runs when it comes back to a new head."""
        have = self._parts()
        for kind, part in alloc._parts().items():
            if kind in have:
                have[kind]._claim(part)

    def stat(self):
        """``{kind: (free, total)}`` for every part."""
        return {kind: part._stat() for kind, part in self._parts().items()}

    def to_dict(self):
        """The JSON-able form, e.g. ``{"Cores": {"N": 16}, "Memory": {"M": 32}}``."""
        return {kind: part._args() for kind, part in self._parts().items()}

    @staticmethod
    def from_dict(d):
        """Build a resource from its dict form; unknown kinds or arguments raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"a resource must be a table/object of kinds, got {d!r}")
        out = ZERO
        for kind, args in d.items():
            cls = RESOURCE_TYPES.get(kind)
            if cls is None:
                raise ValueError(
                    f"unknown resource kind {kind!r} (known: {', '.join(sorted(RESOURCE_TYPES))})")
            if not isinstance(args, dict):
                raise ValueError(f"resource {kind}: expected a table of arguments, got {args!r}")
            allowed = getattr(cls, "_ARGS", None)
            unknown = [] if allowed is None else sorted(set(args) - set(allowed))
            if unknown:
                raise ValueError(f"resource {kind}: unknown argument {unknown[0]!r} "
                                 f"(expected {', '.join(allowed)})")
            try:
                out = out & cls(**args)
            except TypeError as e:
                raise ValueError(f"resource {kind}: {e}") from None
        return out

    def copy(self):
        return copy.deepcopy(self)

    def __and__(self, other):
        if not isinstance(other, Resource):
            return NotImplemented
        return ResourceSet._of(ResourceSet(self, other).parts)

    __rand__ = __and__

    def __repr__(self):
        return self._repr()

    def _key(self):
        return self._args()

    def __eq__(self, other):
        if not isinstance(other, Resource):
            return NotImplemented
        a = self._parts()
        b = other._parts()
        if a.keys() != b.keys():
            return False
        try:
            return all(type(p) is type(b[k]) and p._key() == b[k]._key() for k, p in a.items())
        except NotImplementedError:
            return all(p is b[k] for k, p in a.items())

    __hash__ = None  # providers mutate as they allocate: not hashable, like a list

    # ``a <= b``: request a fits in provider b.
    def __le__(self, other):
        return other.request(self) if isinstance(other, Resource) else NotImplemented

    def __ge__(self, other):
        return self.request(other) if isinstance(other, Resource) else NotImplemented

    def __lt__(self, other):
        return (self <= other) and self != other

    def __gt__(self, other):
        return (self >= other) and self != other


class ResourceSet(Resource):
    """Several kinds at once, made by ``&``; reads the attributes of every part
    (``(Cores(2) & Memory(4)).M == 4``). The empty set is ``ZERO``."""

    kind = None  # not a kind itself: its parts are
    __slots__ = ("parts",)

    def __init__(self, *resources):
        parts = {}
        for r in resources:
            for kind, part in r._parts().items():
                if kind in parts:
                    raise ValueError(f"cannot combine two resources of the same kind: "
                                     f"{parts[kind]!r} & {part!r}")
                parts[kind] = part
        self.parts = parts

    @classmethod
    def _of(cls, parts):
        if len(parts) == 1:
            return next(iter(parts.values()))
        if not parts:
            return ZERO
        rs = object.__new__(cls)
        rs.parts = parts
        return rs

    def _parts(self):
        return self.parts

    # A worker's provider is usually a set (cores, memory, time) and most requests are of
    # one kind: answer those with one lookup. The scheduler asks this for every job.
    def request(self, req):
        if req.kind is not None:
            mine = self.parts.get(req.kind)
            return mine is not None and mine._request(req)
        return self._refuse(req) is None

    def _take(self, req):
        if req.kind is not None:
            return self.parts[req.kind]._alloc(req)
        return super()._take(req)

    def dealloc(self, alloc):
        if alloc.kind is not None and alloc.kind in self.parts:
            self.parts[alloc.kind]._dealloc(alloc)
        else:
            super().dealloc(alloc)

    def _repr(self):
        return " & ".join(p._repr() for p in self.parts.values()) if self.parts else "Ø"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        for part in object.__getattribute__(self, "parts").values():
            with contextlib.suppress(AttributeError):
                return getattr(part, name)
        raise AttributeError(f"{self!r} has no attribute {name!r}")

    def __getstate__(self):
        return self.parts

    def __setstate__(self, parts):
        self.parts = parts

    def __deepcopy__(self, memo):
        return ResourceSet._of({k: copy.deepcopy(p, memo) for k, p in self.parts.items()})


ZERO = ResourceSet()

# The kinds the dict/TOML/JSON forms know, by name (filled in below, with Node).
RESOURCE_TYPES = {}


def register_resource(cls):
    """Make a custom Resource subclass known to the dict form (``--res``, config). Returns
    the class, so it works as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Resource)):
        raise TypeError(f"register_resource needs a Resource subclass, got {cls!r}")
    RESOURCE_TYPES[cls.kind] = cls
    return cls


def _fmt_ids(ids):
    """``[0,1,2,5]`` -> ``"0-2,5"``."""
    runs = [[i for _, i in run] for _, run in
            itertools.groupby(enumerate(ids), lambda pair: pair[1] - pair[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _part(res, kind):
    """The part of ``res`` of the given kind, or None."""
    if res.kind == kind:
        return res
    return res._parts().get(kind) if type(res) is ResourceSet else None


def _cores_of(res):
    """The cores ``res`` holds or asks for (0: none, or no ``res``)."""
    c = _part(res, "Cores") if res is not None else None
    return c.N if c is not None else 0


def request_text(req):
    """A request as the code that makes it, ``Cores(N=4) & Memory(M=8)``, for `ls` and
    explain: its repr, upstream's, names core ids (``CPU_Cores([0-3])``), which reads as
    "these cores" where a job asks for any four."""
    def one(kind, part):
        try:
            return f"{kind}({', '.join(f'{k}={v!r}' for k, v in part._args().items())})"
        except NotImplementedError:  # (a kind of the user's own need not say)
            return repr(part)
    return " & ".join(one(kind, part) for kind, part in req._parts().items()) or repr(req)


def amounts_text(res):
    """What a provider has free (as a worker offers it: all), in amounts (``3 cores, 23.5
    GB``): its repr names the core ids (``CPU_Cores([0-2])``), which one would have to count."""
    def one(kind, part):
        if kind == "WTime":
            return "no walltime limit" if part.T is None else \
                f"{format_walltime(part.remaining())} of walltime"
        if kind == "Token":
            return f"token {part.token!r}"
        words = {"Cores": "core", "Memory": "GB", "Gpus": "GPU"}.get(kind)
        if words is None:
            return request_text(part)
        n = round(part._stat()[0], 1)
        return f"{n:g} {words}{'s' if n != 1 and kind != 'Memory' else ''}"
    return ", ".join(one(kind, part) for kind, part in res._parts().items()) or repr(res)


###############################################################################
# Resource kinds ##############################################################
###############################################################################
# The built-in kinds: Cores, Memory, Capacity, Token, Gpus (whole devices or shares of
# one), WTime (whose providers count down and learn the walltime of job groups), Node,
# and Reject, which grants nothing.


class CoreIds(list):
    """Core ids, sorted: a list (``c == [0, 1]``) that also answers set operations
    (``a.c & b.c``, ``a.c | b.c``), as the set upstream Grain used did."""

    __slots__ = ()

    def __eq__(self, other):
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return list.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __reduce__(self):
        return CoreIds, (list(self),)


for _name, _op in {"and": operator.and_, "or": operator.or_, "sub": operator.sub,
                   "xor": operator.xor}.items():  # as sets, either way round
    setattr(CoreIds, f"__{_name}__", lambda self, other, op=_op: op(set(self), set(other)))
    setattr(CoreIds, f"__r{_name}__", lambda self, other, op=_op: op(set(other), set(self)))


class Cores(Resource):
    """CPU cores. ``Cores(3)`` is three cores: as a request, any three; as a provider, ids
    0-2. ``Cores([6, 7, 9])`` names the ids (what a worker holds and a job is given). ``.c``
    is the list of ids, ``.N`` how many. A request counts cores; it never names them."""

    _ARGS = ("N",)
    _REFUSAL = "{self!r} cannot allocate {res.N} core(s)"
    # _ids: a plain sorted list (bisect is fastest on one), or None for the ids 0..N-1 of
    # Cores(N) until they are needed: a request (one per job) never needs them.
    __slots__ = ("N", "_ids", "_total", "_counted")

    def __init__(self, N):
        if _is_number(N, int):
            self.N = self._total = _check_count(N, "Cores(N): the core count")
            self._ids = None
            self._counted = True
        elif isinstance(N, (list, tuple, set, frozenset, range)):
            ids = sorted({_check_count(i, "Cores([ids]): a core id") for i in N})
            self._ids = ids
            self.N = len(ids)
            self._total = len(ids)
            self._counted = False
        else:
            raise ValueError(f"Cores(N) takes a whole number of cores or a list of core ids, "
                             f"got {N!r}")

    @classmethod
    def _of(cls, ids):  # fast constructor for allocations: ids already sorted and valid
        r = object.__new__(cls)
        r._ids = ids
        r.N = len(ids)
        r._total = len(ids)
        r._counted = False
        return r

    def _id_list(self):
        if self._ids is None:
            self._ids = list(range(self.N))
        return self._ids

    @property
    def c(self):
        """The ids, as a CoreIds (a copy: giving cores back goes through dealloc)."""
        return CoreIds(self._id_list())

    def _request(self, res):
        return res.N <= self.N

    def _alloc(self, res):
        n = res.N
        ids = self._ids if self._ids is not None else self._id_list()
        taken = ids[:n]
        del ids[:n]
        self.N -= n
        return Cores._of(taken)

    def _alloc_near(self, res, near):
        """Like _alloc, taking the ids in ``near`` first (the cores close to a job's GPUs)."""
        ids = self._id_list()
        taken = sorted(ids, key=lambda i: i not in near)[:res.N]  # (stable: near first)
        alloc = Cores._of(sorted(taken))
        self._claim(alloc)
        return alloc

    def _dealloc(self, res):
        ids = self._ids if self._ids is not None else self._id_list()
        for i in res._ids:
            bisect.insort(ids, i)
        self.N = len(ids)

    def _claim(self, res):
        ids = self._id_list()
        taken = set(res._id_list())
        ids[:] = [i for i in ids if i not in taken]
        self.N = len(ids)

    def _repr(self):
        return f"CPU_Cores([{_fmt_ids(self._id_list())}])"

    def _stat(self):
        return (self.N, self._total)

    def _args(self):
        return {"N": self.N if self._counted else list(self._ids)}

    def _key(self):
        return (self.N, self._id_list())

    def __getstate__(self):
        return (self.N, self._ids, self._total, self._counted)

    def __setstate__(self, st):
        self.N, self._ids, self._total, self._counted = st


class _Quantity(Resource):
    """A divisible amount a worker holds and jobs use up (Memory, Capacity): ``_q`` now,
    ``_total`` in all."""

    _UNIT = ""
    __slots__ = ("_q", "_total")

    def __init__(self, amount):
        self._q = self._total = _check_amount(amount, f"{self.kind}({self._ARGS[0]})")

    def _need(self):
        """What this request takes from a provider."""
        return self._q

    def _request(self, res):
        return res._need() <= self._q + 1e-9

    def _alloc(self, res):
        self._q -= res._need()
        return type(res)(res._q)  # the allocation that grants the request

    def _dealloc(self, res):
        self._q += res._need()

    def _claim(self, res):
        self._q -= res._need()

    def _repr(self):
        return f"{self.kind}({self._q:g}{self._UNIT})"

    def _stat(self):
        return (self._q, self._total)

    def _args(self):
        return {self._ARGS[0]: self._q}

    def __getstate__(self):
        return (self._q, self._total)

    def __setstate__(self, st):
        self._q, self._total = st


class Memory(_Quantity):
    """Memory in GB: ``Memory(8)``. ``.m`` is the amount now (free on a provider, held by an
    allocation), ``.M`` the total."""

    _ARGS = ("M",)
    _UNIT = "GB"
    __slots__ = ()
    m = property(lambda self: self._q)
    M = property(lambda self: self._total)

    def __init__(self, M):
        super().__init__(M)


class Capacity(_Quantity):
    """A unitless amount ``V`` a worker holds and jobs use up, e.g. licence seats; ``.v`` now,
    ``.V`` in all. ``ONE_INSTANCE`` (``Capacity(-1)``, shown ``ONE``) takes one unit: on a
    worker with ``Capacity(1)`` one such job runs at a time."""

    _ARGS = ("V",)
    _REFUSAL = "{self!r} has no capacity for {res!r}"
    __slots__ = ()
    v = property(lambda self: self._q)
    V = property(lambda self: self._total)

    def __init__(self, V):
        if V == -1 and not isinstance(V, bool):
            self._q = self._total = -1
        else:
            super().__init__(V)

    def _need(self):
        return 1 if self._total == -1 else self._q

    def _repr(self):
        return "ONE" if self._total == -1 else super()._repr()


class Token(Resource):
    """A tag: a job with ``Token("gpu")`` runs only on a worker holding exactly that token.
    Tokens are not used up; a worker with a token still runs jobs without one."""

    _ARGS = ("token",)
    _REFUSAL = "{self!r} does not match {res!r}"
    __slots__ = ("token",)

    def __init__(self, token):
        if not isinstance(token, str) or not token:
            raise ValueError(f"Token(token) needs a non-empty string, got {token!r}")
        self.token = token

    def _request(self, res):
        return res.token == self.token

    def _alloc(self, res):
        return self

    def _dealloc(self, res):
        pass

    def _repr(self):
        return f"Token({self.token})"

    def _stat(self):
        return (1, 1)

    def _args(self):
        return {"token": self.token}

    def __getstate__(self):
        return self.token

    def __setstate__(self, st):
        self.token = st


def _fmt_devices(ids):
    """GPU ids for a repr: ``0-2`` for indices, MIG UUIDs as they are."""
    return _fmt_ids([int(i) for i in ids]) if all(i.isdigit() for i in ids) else ",".join(ids)


class Gpus(Resource):
    """GPUs. As a request, ``Gpus(2)`` is two whole devices and ``Gpus(0.25)`` a quarter of
    one (up to four such jobs share a device). As a provider or an allocation it names its
    devices as programs name them in CUDA_VISIBLE_DEVICES (an index, or a MIG instance's
    UUID): ``Gpus(["0", "1"])``; ``Gpus(4)`` as a provider is devices 0-3. ``.ids`` are the
    ids, ``.N`` how many (a fraction for a share of one). A provider may know the cores
    close to each device (``near``: its NUMA node's); a job that asks for cores and GPUs
    gets its cores there. ``vendor`` says which variable names the devices (nvidia, amd)."""

    _ARGS = ("N", "vendor", "near")
    __slots__ = ("N", "ids", "share", "vendor", "near", "_free")

    def __init__(self, N, vendor="nvidia", near=None):
        self.vendor = vendor
        self.near = near or {}
        self.share = None
        if isinstance(N, (list, tuple)):
            self.ids = [str(i) for i in N]
            if len(set(self.ids)) != len(self.ids):
                raise ValueError(f"Gpus([ids]): a device is named twice in {N!r}")
            self.N = len(self.ids)
        else:
            _check_amount(N, "Gpus(N): the number of GPUs")
            if N > 1 and N != int(N):
                raise ValueError(f"Gpus({N!r}): a fraction of a GPU must be below 1 (a "
                                 "share of one device); ask for whole devices above that")
            self.N = int(N) if N >= 1 else N
            self.ids = None
        self._free = None  # provider: device id -> the fraction of it still free

    @classmethod
    def _of(cls, ids, share, vendor):  # an allocation
        g = cls(list(ids), vendor)
        g.share = share
        g.N = share if share is not None else len(ids)
        return g

    def _devices(self):
        if self._free is None:
            self._free = {i: 1.0 for i in (self.ids or [str(i) for i in range(int(self.N))])}
        return self._free

    def _request(self, res):
        free = self._devices().values()
        if res.N < 1:
            return res.N == 0 or any(f >= res.N - 1e-9 for f in free)
        return sum(1 for f in free if f >= 1.0 - 1e-9) >= res.N

    def _alloc(self, res):
        free = self._devices()
        if 0 < res.N < 1:  # the busiest device it fits on: whole ones stay whole
            dev = min((i for i, f in free.items() if f >= res.N - 1e-9), key=free.get)
            free[dev] -= res.N
            return Gpus._of([dev], res.N, self.vendor)
        devs = [i for i, f in free.items() if f >= 1.0 - 1e-9][:int(res.N)]
        for dev in devs:
            free[dev] = 0.0
        return Gpus._of(devs, None, self.vendor)

    def _dealloc(self, res):
        free = self._devices()
        for dev in res.ids:
            free[dev] = min(1.0, free[dev] + (res.share if res.share is not None else 1.0))

    def _claim(self, res):
        free = self._devices()
        for dev in res.ids:
            if dev in free:
                free[dev] -= res.share if res.share is not None else 1.0

    def cpus_near(self, alloc):
        """The core ids close to the devices of ``alloc`` (empty when unknown)."""
        return set().union(*(self.near.get(dev, ()) for dev in alloc.ids))

    def _repr(self):
        if self.ids is None and self._free is None:
            return f"GPUs({self.N:g})"
        ids = self.ids if self._free is None else [i for i, f in self._free.items() if f > 1e-9]
        share = f"x{self.share:g}" if self.share is not None else ""
        return f"GPUs([{_fmt_devices(ids)}]{share})"

    def _stat(self):
        free = self._devices()
        return (round(sum(free.values()), 3), len(free))

    def _args(self):
        return {"N": self.N if self.ids is None else list(self.ids),
                **({} if self.vendor == "nvidia" else {"vendor": self.vendor})}

    def _key(self):
        return (self.N, self.ids, self.share)

    def __getstate__(self):
        return (self.N, self.ids, self.share, self.vendor, self.near, self._free)

    def __setstate__(self, st):
        self.N, self.ids, self.share, self.vendor, self.near, self._free = st


def _timestamp():
    """Now, for measuring a duration later with ``_elapsed``: trio's clock when inside a run
    (so a test's MockClock moves it), and the wall clock (``time.time``, looked up at each
    call) for when it is read outside that run."""
    run_now = None
    if "trio" in sys.modules:
        with contextlib.suppress(RuntimeError):
            run_now = sys.modules["trio"].current_time()
    return (run_now, time.time())


def _elapsed(stamp):
    run_then, wall_then = stamp
    if run_then is not None:
        with contextlib.suppress(RuntimeError):
            return sys.modules["trio"].current_time() - run_then
    return time.time() - wall_then


class _GroupTimes:
    """Walltime estimates for WTime groups: from the first GROUP_SAMPLES runs longer than
    GROUP_MIN_RUN_S, T = mean + 5 sd and softT = mean + 2 sd (sample standard deviation).
    A WTime provider keeps one; the workers of an executor share theirs."""

    def __init__(self):
        self.samples = {}
        self.limits = {}  # group -> (T, softT)

    def record(self, group, seconds):
        if seconds <= GROUP_MIN_RUN_S or group in self.limits:
            return
        runs = self.samples.setdefault(group, [])
        runs.append(seconds)
        if len(runs) >= GROUP_SAMPLES:
            mean = _statistics.mean(runs)
            sd = _statistics.stdev(runs)
            self.limits[group] = limits = (mean + 5 * sd, mean + 2 * sd)
            del self.samples[group]
            log.info("WTime group %r: estimated T=%.1fs softT=%.1fs from %d runs",
                     group, *limits, len(runs))


class WTime(Resource):
    """Walltime. On a job: ``T`` is the hard limit (the job fails with ``trio.TooSlowError``
    past it), ``softT`` (default T) what a worker must still have left to take the job, and
    ``group`` lets grain estimate T and softT from the group's first runs (an allocation of
    a group request carries the estimate once it is known). On a worker:
    ``WTime(T=..., countdown=True)`` is the time it has left, counting down from its
    construction. T and softT are seconds or ``[d-]hh:mm:ss``; ``WTime()`` is unlimited."""

    _ARGS = ("T", "softT", "group", "countdown")
    _REFUSAL = "{self!r} cannot allocate {res!r} (not enough time left)"
    __slots__ = ("T", "softT", "group", "countdown", "_since", "_groups")

    def __init__(self, T=None, softT=None, group=None, countdown=False):
        self.T = parse_walltime(T, "WTime(T)")
        self.softT = parse_walltime(softT, "WTime(softT)")
        if self.softT is None:
            self.softT = self.T
        elif self.T is not None and self.softT > self.T:
            raise ValueError(f"WTime: softT ({softT!r}) cannot exceed T ({T!r})")
        if group is not None and not isinstance(group, str):
            raise ValueError(f"WTime(group) must be a string, got {group!r}")
        if countdown and self.T is None:
            raise ValueError("WTime(countdown=True) needs T, the time the provider has")
        self.group = group
        self.countdown = bool(countdown)
        # When the countdown started (a provider), or the timed run of a group (an
        # allocation of a group request whose limits are not known yet).
        self._since = _timestamp() if countdown else None
        self._groups = None

    def remaining(self):
        """Seconds this provider has left (inf without a limit)."""
        if self.T is None:
            return math.inf
        return self.T if self._since is None else max(0.0, self.T - _elapsed(self._since))

    def _limits(self, res):
        """(T, softT) of ``res``: its own, or those learnt for its group (a group request
        without a T of its own); None while they are not known."""
        if res.group is None or res.T is not None:
            return res.T, res.softT
        return None if self._groups is None else self._groups.limits.get(res.group)

    def _request(self, res):
        limits = self._limits(res)
        return limits is None or limits[1] is None or limits[1] <= self.remaining()

    def _alloc(self, res):
        limits = self._limits(res)
        if limits is None:
            run = WTime(group=res.group)
            run._since = _timestamp()  # timed until it comes back (dealloc)
            return run
        return WTime(*limits, res.group)

    def _dealloc(self, res):
        if res.group is not None and res._since is not None and not res.countdown:
            if self._groups is None:
                self._groups = _GroupTimes()
            self._groups.record(res.group, _elapsed(res._since))

    def _repr(self):
        if self.group is not None and self.T is None:
            return f"Walltime(group={self.group})"
        text = format_walltime(self.T and self.remaining(), hhmmss=True)
        if self.softT is not None and self.softT != self.T and not self.countdown:
            text += f", softT={format_walltime(self.softT, hhmmss=True)}"
        return f"Walltime({text})"

    def _stat(self):
        return (self.remaining(), self.T if self.T is not None else math.inf)

    def _args(self):
        d = {"T": None if self.T is None else
             format_walltime(self.remaining() if self.countdown else self.T),
             "softT": None if self.softT in (None, self.T) else format_walltime(self.softT),
             "group": self.group, "countdown": self.countdown or None}
        return {k: v for k, v in d.items() if v is not None}

    def _key(self):
        return (self.T, self.softT, self.group, self.countdown)

    def __getstate__(self):
        # A running countdown travels as the time left, restarted by the receiver.
        T = self.remaining() if self.countdown else self.T
        return (T, self.softT, self.group, self.countdown)

    def __setstate__(self, st):
        self.T, self.softT, self.group, self.countdown = st
        self._since = _timestamp() if self.countdown else None
        self._groups = None


def Node(N, M):
    """``Cores(N) & Memory(M)``: N cores and M GB on one node."""
    return Cores(N) & Memory(M)


Node._ARGS = ("N", "M")


class Reject(Resource):
    """A provider that grants nothing, now or later, wrapping another (``REJECT`` wraps
    ``ZERO``): what is given back goes to the wrapped one, which ``eject()`` returns."""

    kind = None
    __slots__ = ("wrapped",)

    def __init__(self, wrap=None):
        self.wrapped = ZERO if wrap is None else wrap

    def _parts(self):
        return {}

    def request(self, req):
        return False

    def alloc(self, req):
        raise ValueError("No resource is or will be available")

    def dealloc(self, alloc):
        self.wrapped.dealloc(alloc)

    def stat(self):
        return self.wrapped.stat()

    def eject(self):
        return self.wrapped

    def __and__(self, other):
        return self

    __rand__ = __and__

    def __repr__(self):
        return "N/A"


ONE_INSTANCE = Capacity(-1)
REJECT = Reject(ZERO)
TIMESTAT_NSAMPLE = GROUP_SAMPLES  # upstream's name for it
RESOURCE_TYPES.update({cls.kind: cls for cls in (Cores, Memory, WTime, Token, Capacity, Gpus)},
                      Node=Node)


###############################################################################
# Context #####################################################################
###############################################################################
# What a running job or mission may ask about lives in ContextVars, never module
# globals: trio copies the context into each task, so every job sees its own
# allocation, and two runs in one process (tests) never see each other's state.

_RES = contextvars.ContextVar("grain.res", default=ZERO)
_INSTANCE = contextvars.ContextVar("grain.instance", default=None)
_CONTEXT = contextvars.ContextVar("grain.context", default=None)
_RUNTIME = contextvars.ContextVar("grain.runtime", default=None)
_OUTPUT = contextvars.ContextVar("grain.output", default=None)  # where a local job prints


class _GVar:
    """``grain.GVAR``: what the running job may know about itself.

    ``GVAR.res`` is the job's allocation (``ZERO`` outside jobs), ``GVAR.instance`` the name
    of the worker running it, ``GVAR.context`` the value the worker's context module yielded.
    Each is context-local and assignable, as in upstream Grain: ``GVAR.res = Node(N=[0, 1],
    M=1)`` in plain trio code gives that task and the tasks it starts this allocation."""

    __slots__ = ()
    __module__ = "grain"

    res = property(lambda self: _RES.get(), lambda self, value: _RES.set(value))
    instance = property(lambda self: _INSTANCE.get(), lambda self, value: _INSTANCE.set(value))
    context = property(lambda self: _CONTEXT.get(), lambda self, value: _CONTEXT.set(value))

    def __reduce__(self):  # a pickled function that names GVAR finds the receiver's own
        return "GVAR"

    def __repr__(self):
        return f"GVAR(res={self.res!r}, instance={self.instance!r})"


GVAR = _GVar()


class _Runtime:
    """The state of one run (mission or worker process), shared by all of its tasks."""

    __slots__ = ("executor", "pool")

    def __init__(self, executor=None):
        self.executor = executor
        self.pool = None


def _current_executor(what):
    rt = _RUNTIME.get()
    if rt is None or rt.executor is None:
        raise RuntimeError(
            f"{what} needs a running grain mission: call it inside the main function given "
            "to grain.delayed.run(...) or grain.run_combine(...)")
    return rt.executor


###############################################################################
# Jobs ########################################################################
###############################################################################
# A job as every head, worker and mission sees it: Job (a request, an async function and
# its arguments; awaiting it gives the result), the classes of failure a job is retried
# for, the counts of how jobs ended (Tally) and the retry budgets (Retries), and how a
# job's function, arguments and result are pickled to travel (standard pickle first, dill
# for what it cannot take).


# Failure classes a job can be retried for, kept apart in counters and messages.
RETRY_TEMPORARY = "temporary error"      # an exception type listed in temporary_err
RETRY_INFRA = "infrastructure failure"   # e.g. BrokenSubprocessError
RETRY_LOST = "worker lost"               # its connection closed or went silent
RETRY_RETIRED = "worker retired"         # it left on purpose: walltime, quit, SIGTERM


def interrupted(job, w, kind, why):
    """The error of a job whose worker ``w`` went away (``kind``: RETRY_LOST or
    RETRY_RETIRED) while running it."""
    cls = WorkerLostError if kind == RETRY_LOST else WorkerRetiredError
    return cls(f"job {job.name} was running on worker {w.name}, which {why}")


PAST_T = "ran past its T"  # a failure class, and how the error of one starts (run_job_here)


# What a job may raise for its caller to get: its exceptions, and a sys.exit() in it, which
# ends that job, not the worker that runs it (a worker gone would lose its other jobs, and
# its retries would end the next worker the same way). A Ctrl-C is the process's own.
JOB_ERRORS = (Exception, SystemExit)


def failure_class(error):
    """How a job that raised ``error`` failed, for counts and messages (not retried)."""
    return PAST_T if isinstance(error, trio.TooSlowError) else "raised"


def outlives_head(wire):
    """Whether a job's wire id (how workers know it) names it beyond its head: text (a
    store's key#n, a daemon's mission token and id) does, and a new head can claim the job
    from a worker that comes back with it; a head's own number dies with that head."""
    return type(wire) is str


# A job's life, as data: in each state, the state each event takes it to. Only Job.change
# moves a job: its state, and its attempts (the runs started; the number its error says).
# An event its state does not allow is grain's own defect, raised as one. ``start``: it is
# sent to a worker or run here, one attempt more. ``adopt``, ``report``: a worker came back
# running it, or with its result; a run counted already, or (it ran for an earlier head)
# one. A running job meets them when the worker it was held for is back with it.
_RUNNING_LIFE = {"adopt": "running", "report": "running", "requeue": "queued",
                 "succeed": "done", "fail": "failed"}  # (a queued job: these, and start)
JOB_LIFE = {
    "queued": {"start": "running", **_RUNNING_LIFE},
    "running": _RUNNING_LIFE,
    "done": {},
    "failed": {},
}


class Job:
    """One submitted job: a resource request, an async function and its arguments.

    Awaiting a Job gives the function's return value or raises its exception (with the
    original type). ``attempts`` counts runs started; ``failures`` counts each failure class
    that was retried."""

    __slots__ = ("id", "req", "fn", "args", "kwargs", "T", "group", "attempts", "failures",
                 "alloc", "worker", "value", "error", "state", "observed", "_event",
                 "duration", "payload", "queue", "ref", "wire", "key", "submitted",
                 "started", "ended", "kind")

    def __init__(self, jid, req, fn, args, kwargs, queue=None):
        self.id = jid
        # How workers know it: a number of this head's, or text that outlives the head (see
        # outlives_head): its store key's, once a worker or a resume needs it.
        self.wire = jid
        self.key = None        # its results store key, (material, n) or its text, if any
        self.queue = queue     # the JobQueue it waits in (one per mission)
        self.ref = None        # on a head daemon: the mission's own id for it
        self.req = req
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        wt = _part(req, "WTime") if req.kind != "Cores" and req is not ZERO else None
        self.T = wt.T if wt is not None else None
        self.group = wt.group if wt is not None else None
        self.attempts = 0
        self.failures = None
        self.alloc = None
        self.worker = None
        self.value = None
        self.error = None
        self.state = "queued"  # -> running -> done | failed (back to queued on a retry)
        self.observed = False
        self._event = None
        self.duration = None
        self.payload = None
        self.submitted = self.started = self.ended = None  # times, on the head's clock
        self.kind = None       # its failure class, when it failed

    @property
    def name(self):
        return f"#{self.id} {_callable_name(self.fn)}"

    @property
    def call(self):
        """Its name and its arguments, short: ``#12 energy('h2o.xyz', basis='sto-3g')``, at
        most 80 characters; made when a failure or the report shows it, not as it runs."""
        if self.args is None:  # (not known: a head daemon's job, or one not yet submitted)
            return self.name
        text = ", ".join([*map(reprlib.repr, self.args),
                          *(f"{k}={reprlib.repr(v)}" for k, v in self.kwargs.items())])
        text = f"{self.name}({text})"
        return text if len(text) <= 80 else text[:77] + "..."

    def done(self):
        return self.state == "done" or self.state == "failed"

    def change(self, event):
        """Move the job by ``event`` (see JOB_LIFE)."""
        try:
            state = JOB_LIFE[self.state][event]
        except KeyError:
            raise GrainError(f"job {self.name} cannot {event} when {self.state}") from None
        if event == "start":
            self.attempts += 1
        elif state == "running":
            self.attempts = self.attempts or 1
        self.state = state

    def name_on_wire(self, text):
        """Be known to workers by ``text`` from now on: the job outlives its head (see
        outlives_head), and a new head claims it by that name."""
        if type(text) is not str:
            raise GrainError(f"job {self.name}: a wire name is text, not {text!r}")
        self.wire = text

    def number_on_wire(self, base):
        """Be known to workers by the head's number for it, made the head's own by its
        ``base`` (a worker that comes back to another head cannot mistake it for one of
        that head's); it dies with the head."""
        self.wire = self.id + base

    async def wait_done(self):
        """Wait until the job has ended, without raising its error."""
        if self.state != "done" and self.state != "failed":
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()

    async def wait(self):
        """The job's result; raises its exception if it failed."""
        await self.wait_done()
        self.observed = True
        if self.error is not None:
            raise self.error
        return self.value

    def __await__(self):
        return self.wait().__await__()

    def __repr__(self):
        return f"<Job {self.name} {self.req!r} {self.state}>"


class Tally:
    """Jobs that ended, and retries, by failure class: what `ls` shows."""

    def __init__(self):
        self.counts = {"done": 0, "failed": 0, "retried": 0}
        self.failed_by_class = {}
        self.retried_by_class = {}

    def ended(self, state, kind=None):
        """Count a job that ended ``state`` ("done" or "failed", of class ``kind``)."""
        self.counts[state] += 1
        if state == "failed":
            self.failed_by_class[kind] = self.failed_by_class.get(kind, 0) + 1

    def retried(self, kind):
        self.counts["retried"] += 1
        self.retried_by_class[kind] = self.retried_by_class.get(kind, 0) + 1


class Retries:
    """How many times a job is retried after each failure class: temporary errors (the
    ``temporary_err`` types) and infrastructure failures up to ``max_retries``, a lost
    worker too (not at all when not ``persistent``), a retired one up to RETIRED_RETRIES."""

    def __init__(self, max_retries=MAX_RETRIES, temporary_err=(), persistent=True):
        self.temporary_err = ((temporary_err,) if isinstance(temporary_err, type)
                              else tuple(temporary_err))
        n = _check_count(max_retries, "max_retries")
        self.budgets = {RETRY_TEMPORARY: n, RETRY_INFRA: n, RETRY_LOST: n if persistent else 0,
                        RETRY_RETIRED: RETIRED_RETRIES if persistent else 0}

    def class_of(self, error):
        """The retry class of a job's exception, or None (not retried)."""
        if isinstance(error, BrokenSubprocessError):
            return RETRY_INFRA
        if self.temporary_err and isinstance(error, self.temporary_err):
            return RETRY_TEMPORARY
        return None

    def again(self, job, kind, error, tally):
        """Count one more failure of ``kind``; True while the budget allows a retry."""
        failures = job.failures = job.failures if job.failures is not None else {}
        if failures.get(kind, 0) >= self.budgets[kind]:
            return False
        failures[kind] = failures.get(kind, 0) + 1
        tally.retried(kind)
        log.warning("job %s failed with %s (%s); retrying (%d of %d)", job.call,
                    f"{type(error).__name__}: {error}", kind, failures[kind], self.budgets[kind])
        return True

    def note(self, job, error, kind):
        """Say on the final error which job it was, with its arguments (a head daemon, which
        knows none, when it retried it). A job that was retried: the runs started and, when
        they are not one more than the retries spent, those too (a worker came back with the
        run it was lost with: one run, retried; a retry that never ran, its mission gone),
        and the class that ended it if it could have been retried again."""
        retries = sum(job.failures.values()) if job.failures else 0
        if not retries:
            if job.args is not None:
                add_note(error, f"grain: job {job.call} failed")
            return
        runs = job.attempts
        text = f"grain: job {job.call} failed after {runs} attempt{'s' * (runs != 1)}"
        if runs != retries + 1:
            text += f" and {retries} retr{'y' if retries == 1 else 'ies'}"
        if kind in self.budgets:
            text += f" ({kind}, {self.budgets[kind]} retries allowed)"
        add_note(error, text)


NO_KWARGS = types.MappingProxyType({})


async def run_job_here(fn, args, kwargs, alloc, instance, context, T):
    """Run a job's function in this task as the job: GVAR tells it its allocation, its
    worker and its context; its T is a deadline (trio.TooSlowError, saying T: the mission
    names the job). Every worker runs its jobs this way (a pool process runs @subprocify's,
    synchronous, under SIGALRM)."""
    _RES.set(alloc)
    _INSTANCE.set(instance)
    _CONTEXT.set(context)
    if T is None:  # (most jobs: no context manager to enter and leave)
        return await fn(*args, **kwargs)
    try:
        with trio.fail_after(T) as scope:
            return await fn(*args, **kwargs)
    except trio.TooSlowError as e:
        if scope.cancelled_caught:  # its T, not a deadline of the job's own
            e.args = (f"{PAST_T} (WTime(T={T:g}))",)
        raise
NO_ARGS_PAYLOAD = b"p" + pickle.dumps(((), {}), protocol=pickle.HIGHEST_PROTOCOL)


@functools.lru_cache(maxsize=None)
def _by_value_pickler():
    """dill's Pickler, pickling functions by value, that takes by name a module of a
    ModuleType subclass (as trio before 0.23 is), as dill does for plain modules, instead
    of failing, and grain itself: dill would take this file, which is not installed, by
    value (a user's ``grain.GVAR`` in a job). Made at first use, as dill is imported only
    then."""
    me = sys.modules[__name__]

    class ByValuePickler(dill.Pickler):
        def reducer_override(self, obj):
            if obj is me or (isinstance(obj, types.ModuleType)
                             and type(obj) is not types.ModuleType
                             and sys.modules.get(obj.__name__) is obj):
                return importlib.import_module, (obj.__name__,)
            return NotImplemented

    return ByValuePickler


def dill_dumps(obj):
    """Bytes of ``obj`` by dill, with functions of importable modules by value where
    pickle could not take them by name (a decorated function, a closure)."""
    buf = io.BytesIO()
    _by_value_pickler()(buf, recurse=True).dump(obj)
    return buf.getvalue()


def dumps_job_value(obj, what):
    """Bytes of a job's function, arguments or result: standard pickle first (fast), dill
    for what it cannot do (lambdas, closures) and for what refers to ``__main__``: pickle
    takes a function or class of the user's script by name, which the worker's own
    ``__main__`` does not have, where dill takes it by value."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in data:
            return b"p" + data
    except Exception:
        pass
    try:
        return b"d" + dill_dumps(obj)
    except Exception as e:
        raise TypeError(f"{what} cannot be pickled: {e}") from None


def loads_job_value(data):
    return pickle.loads(data[1:]) if data[:1] == b"p" else dill.loads(data[1:])


def pickled_failure(error, tb="", dumps=lambda v: dumps_job_value(v, ""), loads=loads_job_value):
    """``dumps((error, tb))``: a job's exception and its traceback, to travel. One that
    cannot be pickled, or made again from its pickle, travels as a GrainError naming it."""
    try:
        data = dumps((error, tb))
        loads(data)
        return data
    except Exception:
        return dumps((GrainError(f"{type(error).__name__}: {error} (the exception could not "
                                 "be pickled)"), tb))


def _culprit(args, kwargs):
    """The first argument that cannot be pickled, for the error message."""
    for key, a in [*enumerate(args), *kwargs.items()]:
        try:
            dill_dumps(a)
        except Exception:
            return f"argument {key} ({a!r})" if type(key) is int else f"argument {key}={a!r}"
    return "an argument"


class FunctionBytes:
    """``(digest, bytes)`` of job functions, each serialized once (an executor's cache)."""

    def __init__(self):
        self._cache = {}
        self._last = (None, None)

    def __call__(self, fn):
        if self._last[0] is fn:  # (jobs come in runs of one function)
            return self._last[1]
        try:
            hit = self._cache.get(fn)
        except TypeError:  # unhashable callable: serialized each time
            return self._dumps(fn)
        if hit is None:
            hit = self._cache[fn] = self._dumps(fn)
        self._last = (fn, hit)
        return hit

    @staticmethod
    def _dumps(fn):
        data = dumps_job_value(fn, f"the job function {_callable_name(fn)}")
        return hashlib.sha1(data).digest(), data


def pickle_arguments(job):
    """A job's arguments as a worker process gets them; a TypeError naming the culprit."""
    if not job.args and not job.kwargs:
        return NO_ARGS_PAYLOAD
    try:
        return dumps_job_value((job.args, dict(job.kwargs)), "")
    except TypeError as e:
        raise TypeError(f"job {_callable_name(job.fn)}: {_culprit(job.args, job.kwargs)} "
                        f"cannot be pickled{str(e)[19:]}") from None


def unpickle_result(job, ok, data):
    """``(value, error)`` from a result a worker process sent (the traceback it sent, headed
    by its name, becomes a note of the error)."""
    try:
        value = loads_job_value(data)
        if not ok:
            error, tb = value
            if not isinstance(error, BaseException) or not isinstance(tb, str):
                raise TypeError(f"an exception and its traceback were expected, got {value!r:.80}")
    except Exception as e:
        return None, GrainError(f"the result of job {job.name} could not be unpickled here: {e}")
    if ok:
        return value, None
    if tb:
        add_note(error, tb.rstrip())
    return None, error


###############################################################################
# Scheduler ###################################################################
###############################################################################
# The queue policy, synchronous and free of I/O: which job starts on which worker, and
# when. It sees jobs only through their attributes (queue, req, group, state, attempts,
# alloc, worker, T) and starts one by ``worker.start(job)``, which never blocks; it reads
# time through a clock it is given, so tests can drive it without trio.


class JobQueue:
    """The jobs of one mission waiting for resources, oldest first. An executor running a
    mission in-process has one; a head daemon has one per attached mission."""

    __slots__ = ("jobs", "name", "prioritized", "blocked_job", "blocked_since", "warned_at",
                 "reserved", "run", "fits", "maybe")

    def __init__(self, name, prioritized=False):
        self.jobs = deque()
        self.name = name
        self.prioritized = prioritized
        # the head job while it fits no worker, and since when
        self.blocked_job = None
        self.blocked_since = 0.0
        self.warned_at = -math.inf
        self.reserved = None         # the worker held for blocked_job after RESERVE_AFTER_S
        self.run = 0                 # jobs right behind the first known to ask the same
        self.fits = None  # a request
        self.maybe = {}   # the workers that may have room for it

    def unreserve(self):
        """Give up the worker held for the blocked job (it started, or the queue is gone)."""
        if (w := self.reserved) is not None:
            self.reserved = None
            if w.reserved_for is self.blocked_job:
                w.reserved_for = None

    def unblock(self):
        """The blocked job started or left the queue: no worker is held for it, and should
        it come back to the head of the queue (its worker lost, say), it waits from then,
        not from when it first waited (a stuck warning would count the time it ran, and
        it would hold a worker at once)."""
        self.unreserve()
        self.blocked_job = None

    def warn(self, message):
        """Tell the mission its queue is stuck (a daemon's mission queue forwards it)."""
        log.warning("%s", message)


def _now():
    """trio's clock inside a run (so MockClock tests see it), the monotonic clock outside."""
    try:
        return trio.current_time()
    except RuntimeError:
        return time.monotonic()


def _size_key(res):
    """How large a provider is, for naming "the largest worker": (cores, memory)."""
    c = _part(res, "Cores")
    m = _part(res, "Memory")
    return (c._total if c else 0, m._total if m else 0)


def _same_request(a, b):
    """``a == b`` for two job requests, cheap for the common ``Cores(n)``: the scheduler asks
    it for many queued jobs."""
    return type(a) is type(b) and (a is b or (a.N == b.N if type(a) is Cores else a == b))


# What a stuck queue's warning, explain() and the status line say while no worker is there
NONE_JOINED = "no worker has joined yet"
NO_WORKER = f"{NONE_JOINED} (give run() local=..., or start workers with `python grain.py up`)"


def no_worker_text(joined, hint=True):
    """Why no worker runs anything when none is connected: none has joined yet (``hint``:
    with how to start some), or the ``joined`` that did have all left."""
    if joined:
        return f"no worker is connected: the {joined} that joined have left"
    return NO_WORKER if hint else NONE_JOINED

SchedulerStatistics = namedtuple("SchedulerStatistics", "queued running workers next_request")
SchedulerStatistics.__doc__ = "The queues and workers of a Scheduler at one moment."


class Scheduler:
    """Starts queued jobs on workers whose free resources can be allocated to them.

    Within a queue (one per mission): first come, first served, with backfill. The oldest
    job goes to the first worker that can allocate its request. When no worker can, later
    jobs (up to BACKFILL_DEPTH behind it) that fit somewhere now start ahead of it, so a
    large job does not leave cores idle behind it. So that the large job cannot starve,
    once it has waited RESERVE_AFTER_S it reserves one worker (among those large enough,
    the one with the most free): no other job starts there until it does, whichever
    mission it comes from.

    Between queues (the missions of a head daemon): those ``prioritized`` first; among
    equals, one job per queue per round, and each pump starts its rounds one queue further
    along, so a small mission is never stuck behind a large one's backlog.

    The queues are looked at again (``pump()``) whenever a job is pushed, a worker joins
    or an allocation comes back. The workers share one set of WTime group estimates.

    A queue looks only at the workers that may have room for its oldest job's request
    (``queue.maybe``): a worker found without room leaves it, and comes back when
    resources come back to it (grew()). So with a thousand workers a job costs a look at
    a few, not at all of them."""

    def __init__(self, clock=_now):
        self.workers = []
        self.queues = []
        self.n_queued = 0
        self.joined = 0  # workers that ever joined: none left now means all of them went
        self.group_times = _GroupTimes()
        self.clock = clock

    # -- workers and queues -------------------------------------------------------
    def add_worker(self, w):
        for wt in (_part(w.res, "WTime"), _part(w.total, "WTime")):
            if wt is not None:
                wt._groups = self.group_times
        self.workers.append(w)
        self.joined += 1
        self.grew(w)
        self.pump()

    def remove_worker(self, w):
        if w in self.workers:
            self.workers.remove(w)
            w.accepting = False  # (its jobs' resources come back after it went: grew())
            for q in self.queues:
                q.maybe.pop(w, None)

    def grew(self, w):
        """Resources came back to ``w`` (or it joined): each queue looks at it again."""
        if w.accepting:
            for q in self.queues:
                if q.fits is not None:
                    q.maybe[w] = None

    def add_queue(self, queue):
        self.queues.append(queue)

    def remove_queue(self, queue):
        """Forget a queue (its mission has gone); returns the jobs it still held."""
        self.queues.remove(queue)
        return self.take_queued(queue)

    def take_queued(self, queue):
        """Every job waiting in ``queue``, taken out."""
        jobs = list(queue.jobs)
        queue.jobs.clear()
        self.n_queued -= len(jobs)
        queue.unblock()
        queue.run = 0
        return jobs

    # -- jobs -----------------------------------------------------------------------
    def push(self, job):
        """Queue a job (it has a request: jobs without one run at once, not here)."""
        jobs = job.queue.jobs
        jobs.append(job)
        self.n_queued += 1
        if len(jobs) == 1:
            self.pump()
        elif not _same_request(job.req, jobs[0].req):
            self._backfill(job.queue, 1, len(jobs) - 1)  # behind a blocked job, it may fit

    def push_front(self, job):
        """Queue a job again ahead of the others (a retry: it came before them)."""
        job.queue.jobs.appendleft(job)
        job.queue.run = 0
        self.n_queued += 1

    def claim(self, wire):
        """The job ``wire`` taken out of the queue it waits in (a worker came back running
        it, or with its result), or None. A scan: this happens when a worker comes back."""
        job = next((j for queue in self.queues for j in queue.jobs if j.wire == wire), None)
        return job if job is not None and self.withdraw(job) else None

    def withdraw(self, job):
        """Take ``job`` out of its queue (a worker came back running it); False when it
        is not waiting there (it started again meanwhile)."""
        queue = job.queue
        try:
            queue.jobs.remove(job)
        except ValueError:
            return False
        self.n_queued -= 1
        queue.run = 0
        if queue.blocked_job is job:
            held = queue.reserved is not None
            queue.unblock()
            if held:
                self.pump()  # the worker it held may take others now
        return True

    def launch(self, job, w, now=None):
        """Allocate ``job`` its request on ``w`` and start it there (at ``now``)."""
        if w.orphans and job.wire in w.orphans:  # it runs there already
            w.adopt_orphan(job, self.clock() if now is None else now)
            return
        job.change("start")
        job.alloc = w.res._take(job.req) if job.req is not ZERO else ZERO
        if job.group is not None:
            job.T = _part(job.alloc, "WTime").T  # the group's estimate, once known
        job.worker = w
        job.started = self.clock() if now is None else now
        w.running += 1
        w.busy.add(job)
        w.start(job)

    def release(self, job, ok=False):
        """Give a job's allocation back to its worker, which it returns (only a run that
        succeeded teaches its WTime group how long the group's runs take). The job keeps
        ``alloc`` and ``worker``: where it ran last."""
        w = job.worker
        alloc = job.alloc
        w.running -= 1
        w.busy.discard(job)
        if alloc is not ZERO:
            if not ok and job.group is not None:
                _part(alloc, "WTime")._since = None
            w.res.dealloc(alloc)
            self.grew(w)
        return w

    # -- the policy -----------------------------------------------------------------
    def pump(self):
        """Start queued jobs on workers that can allocate them (see the class)."""
        queues = self.queues
        if len(queues) <= 1:
            if queues:
                self._start_from(queues[0], -1)
            return
        while self.n_queued:
            for tier in (True, False):
                # (a list: every queue of the tier starts one before any() looks)
                if any([self._start_from(q, 1) for q in queues
                        if q.jobs and q.prioritized is tier]):
                    break  # back to the prioritized tier: what started may have freed nothing
            else:
                break  # nothing started
        queues.append(queues.pop(0))

    def _start_from(self, queue, limit):
        """Start up to ``limit`` (-1: any number of) jobs of ``queue``, oldest first, then
        (backfill) later ones that fit while the oldest waits; returns how many started."""
        jobs = queue.jobs
        workers = self.workers
        started = 0
        now = self.clock()
        while jobs and started != limit:
            job = jobs[0]
            req = job.req
            if len(workers) > FEW_WORKERS:
                w = self._first_fit(queue, job, req)
            else:  # (a look at each costs less than keeping maybe)
                for w in workers:
                    if w.accepting and w.res.request(req) and (
                            w.reserved_for is None or w.reserved_for is job):
                        break
                else:
                    w = None
            if w is None:
                if queue.blocked_job is not job:
                    if queue.reserved is not None:
                        queue.unreserve()
                    queue.blocked_job = job
                    queue.blocked_since = now
                else:
                    self._reserve_if_starving(queue, job)
                if len(jobs) > queue.run + 1:
                    started += self._backfill(queue, limit - started if limit > 0 else -1)
                return started
            jobs.popleft()
            if queue.run:
                queue.run -= 1
            if queue.blocked_job is not None:
                queue.unblock()
            self.n_queued -= 1
            self.launch(job, w, now)
            started += 1
        return started

    def _first_fit(self, queue, job, req):
        """The first worker of ``queue.maybe`` (see the class) with room for ``job`` now;
        those found without it leave maybe."""
        if job.group is not None or not _same_request(req, queue.fits):  # all again
            queue.fits = req if job.group is None else None  # (a group's T changes)
            # (ordered by links: a plain dict keeps the slots of those that left, and a
            # look for the first one would step over each, a thousand with 1,000 workers)
            queue.maybe = OrderedDict.fromkeys(self.workers)
        maybe = queue.maybe
        full = []
        for w in maybe:
            if w.accepting and w.res.request(req):
                if w.reserved_for is None or w.reserved_for is job:
                    break
            else:
                full.append(w)
        else:
            w = None
        for f in full:
            del maybe[f]
        return w

    def _reserve_if_starving(self, queue, job):
        """The oldest job of ``queue`` has fitted no worker since ``queue.blocked_since``;
        once that is RESERVE_AFTER_S, hold a worker for it so that backfill cannot starve it."""
        w = queue.reserved
        if (w is not None and w.reserved_for is job and w.accepting and w in self.workers) or \
                self.clock() - queue.blocked_since < RESERVE_AFTER_S:  # held already, or not yet
            return
        queue.reserved = None
        could = [w for w in self.workers
                 if w.accepting and w.reserved_for is None and w.total.request(job.req)]
        if could:  # the one with the most free now: probably the first to have enough
            w = max(could, key=lambda w: _size_key(w.res))
            w.reserved_for = job
            queue.reserved = w
            log.info("job %s has waited %.0f s for %r: worker %s now takes no other job until it "
                     "starts", job.name, self.clock() - queue.blocked_since, job.req, w.name)

    def _backfill(self, queue, limit, first=None):
        """Start up to ``limit`` (-1: any number of) jobs from behind the blocked head of
        ``queue`` that fit a worker now (or only ``jobs[first:]``, for a new job).

        ``queue.run`` counts the jobs right behind the head that ask for the same as it:
        they cannot fit either, and each is compared once as the run grows, so a long queue
        of identical jobs costs nothing per completion. Behind the run, at most
        BACKFILL_DEPTH jobs are looked at; those asking for the same as one found not to fit
        in this pass are skipped without a look at the workers."""
        jobs = queue.jobs
        head_req = jobs[0].req
        n = len(jobs)
        if first is None:
            i = queue.run + 1
            while i < n and _same_request(jobs[i].req, head_req):
                i += 1
            queue.run = i - 1
            stop = min(n, i + BACKFILL_DEPTH)
        else:
            i = first
            stop = n
        failed = [head_req]
        started = 0
        while i < stop and started != limit:
            job = jobs[i]
            w = None
            if not any(_same_request(job.req, f) for f in failed):
                w = next((w for w in self.workers if w.accepting and w.reserved_for is None
                          and w.res.request(job.req)), None)
                if w is None:
                    failed.append(job.req)
            if w is None:
                i += 1
                continue
            del jobs[i]
            stop -= 1
            self.n_queued -= 1
            self.launch(job, w)
            started += 1
        return started

    # -- watching -------------------------------------------------------------------
    def stuck(self):
        """``[(queue, warning)]`` for each queue whose oldest job has fitted no worker for
        STUCK_WARN_S, again every STUCK_REPEAT_S while that lasts."""
        now = self.clock()
        out = []
        for q in self.queues:
            waited = now - q.blocked_since
            if not (q.jobs and q.jobs[0] is q.blocked_job) or waited < STUCK_WARN_S \
                    or now - q.warned_at < STUCK_REPEAT_S:
                continue
            q.warned_at = now
            where = (f"the largest worker is {self.largest()}" if self.workers
                     else no_worker_text(self.joined))
            out.append((q, f"job {q.blocked_job.name} requesting "
                           f"{request_text(q.blocked_job.req)} has fitted no worker for "
                           f"{waited:.0f} s; {where}; {len(q.jobs)} job(s) queued"))
        return out

    def too_large(self, job):
        """Why ``job`` fits no worker, even idle (None when one could run it)."""
        if any(w.total.request(job.req) for w in self.workers):
            return None
        return (f"job {job.name} asks {request_text(job.req)}, more than any worker has" +
                (f" (the largest: {self.largest()})" if self.workers else ""))

    def largest(self):
        """The largest worker and what it offers, in words ("w1 with 3 cores, 23.5 GB")."""
        big = max(self.workers, key=lambda w: _size_key(w.total))
        return f"{big.name} with {amounts_text(big.offered)}"

    def explain(self):
        """Why the oldest waiting job of each queue does not run: ``[{"queue", "job",
        "request", "waited", "reason"}]``, the reason in words with its figures."""
        now = self.clock()
        out = []
        for q in self.queues:
            if q.jobs:
                job = q.jobs[0]
                waited = now - q.blocked_since if q.blocked_job is job else 0.0
                out.append({"queue": q.name, "job": job.name, "request": request_text(job.req),
                            "waited": round(waited, 1), "reason": self._why(q, job, now)})
        return out

    def _why(self, queue, job, now):
        req = job.req
        workers = self.workers
        if not workers:
            return no_worker_text(self.joined, hint=False)
        if (w := queue.reserved) is not None:
            return (f"it waited over {RESERVE_AFTER_S:g} s and holds worker {w.name}: "
                    f"nothing else starts there until it fits (free on {w.name}: "
                    f"{amounts_text(w.res)})")
        token = _part(req, "Token")
        tokens = sorted({t.token for w in workers for t in [_part(w.total, "Token")] if t})
        if token is not None and token.token not in tokens:
            return (f"its token {token.token!r} matches no worker (their tokens: "
                    f"{', '.join(tokens) or 'none'})")
        wt = _part(req, "WTime")
        if wt is not None and wt.softT:
            left, w = max(((_part(w.res, "WTime").remaining(), w) for w in workers),
                          key=lambda lw: lw[0])
            if left < wt.softT:
                return (f"every worker has less walltime left than its softT "
                        f"{format_walltime(wt.softT)}: the most is {format_walltime(left)}, "
                        f"on {w.name}")
        large = [w for w in workers if w.total.request(req)]
        if not large:
            return (f"no worker is large enough: it asks {request_text(req)}; the largest "
                    f"is {self.largest()}")
        room = [w for w in large if w.res.request(req)]
        if room:
            if all(w.reserved_for is not None for w in room):
                return (f"the worker(s) with room are held for {room[0].reserved_for.name}, "
                        f"which waited longer (reserved)")
            return "a worker has room: it starts at the next pass"
        busy = ", ".join(f"{w.name} ({w.running} running; free: {amounts_text(w.res)})"
                         for w in large[:4])
        more = f" and {len(large) - 4} more" if len(large) > 4 else ""
        text = f"all {len(large)} worker(s) large enough are busy: {busy}{more}"
        running = [j for w in large for j in w.busy if j.started is not None]
        if running:
            first = min(running, key=lambda j: (j.started + j.T if j.T else math.inf, j.started))
            text += (f"; the first to free should be {first.name} on {first.worker.name} "
                     f"(running for {format_walltime(now - first.started)}" +
                     (f", its T ends in {format_walltime(first.started + first.T - now)})"
                      if first.T else ", no T)"))
        return text

    def statistics(self):
        heads = [q.jobs[0] for q in self.queues if q.jobs]
        return SchedulerStatistics(self.n_queued, sum(w.running for w in self.workers),
                                   [w.statistics() for w in self.workers],
                                   min(heads, key=lambda j: j.id).req if heads else None)


###############################################################################
# Head state ##################################################################
###############################################################################
# What a head knows of its jobs and its workers, and how that changes: the Reunion of
# jobs and workers that come back after a head was replaced, and HeadCore, what every
# head is built on (a mission's own, GrainExecutor, and the shared HeadDaemon). Rules:
#   - nothing here awaits, sleeps, or reads a socket or a file: the connections that
#     feed it and the timers that drive it (start_head, keep_reunion, hold_jobs) are
#     the head service's, and time comes in only through the clock it is given;
#   - a job moves only by Job.change, along JOB_LIFE, called here and by the Scheduler
#     (start) and a worker (adopt): the executor and the head daemon end, report or
#     queue a job again through HeadCore's end, reported and queue_again;
#   - a worker's bookkeeping (its free resources, its runs, the runs it came back with)
#     is kept here and in the Scheduler; what a worker is to do goes through its methods
#     (start, cancel, adopt, cancel_orphan, interrupt_all), which never block: what goes
#     to a worker process is queued on its channel.


class Reunion:
    """Jobs and worker processes finding each other again after their head was replaced: a
    head daemon died and another started, or a mission that was its own head was run
    again. A worker that comes back reports, by wire id, the jobs it still runs and the
    results of those that ended while it was alone; the owner offers it the jobs it has.
    A job that was (or may have been) running when the old head went is held, for
    REJOIN_WAIT_S after this head started at most, while its worker may still come back:
    the worker it ran on, or (True) any of the ``expected`` ones, the old head's; once
    they came back without it, it is queued (``push``). A job a worker comes back with
    that no one claims within ORPHAN_WAIT_S is cancelled there. Whichever
    comes first, the job or its worker's report, the other finds it: a report finds a job
    that waits in the queue, held or not (``claim(wire)`` takes it out, or gives None).
    (Only some wire ids outlive a head: see outlives_head. A head's own numbers are
    claimed only by a worker that comes back to that same head, which tells its workers
    who it is (``instance``): see HeadCore.jobs_held.)
    ``report(job, ok, data, duration, kind)`` hands a job a result a worker reported."""

    def __init__(self, report, clock=_now, claim=lambda wire: None, push=None):
        self.report = report
        self.clock = clock
        self.claim = claim
        self.push = push         # queues a job that waits no longer
        self.held = {}           # wire -> job waiting for its worker to come back
        self.held_for = {}       # worker (True: any expected) -> the jobs held for it
        self.expected = {True}   # the workers the old head had (not known: one never back)
        self.back = set()        # the workers that came back
        self.reported = set()    # the wires of the jobs they came back with or ended
        self.running = {}        # wire -> (worker, since) of jobs no one claimed yet
        self.finished = {}       # wire -> ((ok, data, duration, kind), since) unclaimed
        self.failed = {}         # wire -> a failure reported while jobs are held (see below)
        self.own_held = {}       # wire -> job held with a hold of its own (jobs_held)
        self.results_due = {}    # wire -> the worker back with its result, not read yet
        self.hold_until = clock() + REJOIN_WAIT_S

    def offer(self, job, hold=None):
        """True when ``job`` is taken care of here: its result came back, its worker still
        runs it, or it is held (``hold``: the worker it was running on when the last head
        went, True: any expected one) while that worker may come back with it."""
        wire = job.wire
        if wire in self.finished:
            self.report(job, *self.finished.pop(wire)[0])
        elif wire in self.running:
            w, _ = self.running.pop(wire)
            w.adopt(job, w.orphans.pop(wire), self.clock())
        elif hold and self.clock() < self.hold_until and (wire in self.reported or
                                                          self._away(hold)):
            self.held[wire] = job
            self.held_for.setdefault(hold, []).append(job)
        else:
            return False
        return True

    def _away(self, hold):
        """May the worker ``hold`` (True: any expected) still come back?"""
        return not (self.expected if hold is True else {hold}) <= self.back

    def worker_back(self, worker, reported):
        """``worker`` came back with the jobs ``reported`` (running, or ended: their results
        follow). The jobs held for it that it does not have are queued now; so are those
        held for any expected worker once all came back."""
        self.back.add(worker)
        self.reported.update(reported)
        for hold in (worker, True):
            if not self._away(hold):
                for job in self.held_for.pop(hold, ()):
                    if self.held.get(job.wire) is job and job.wire not in self.reported:
                        del self.held[job.wire]
                        self.push(job)

    def worker_runs(self, w, wire, alloc, ours=False):
        """A worker came back still running the job ``wire`` with ``alloc`` (``ours``: to
        the head it left, whose own numbers it may be)."""
        if not isinstance(alloc, Resource):
            raise PeerError(f"worker {w.name} says it runs job {wire!r} with {alloc!r:.60}")
        w.res.claim(alloc)
        w.running += 1
        if (job := self._claimed(wire, ours)) is not None:
            w.adopt(job, alloc, self.clock())
            return
        w.orphans[wire] = alloc
        if not outlives_head(wire):  # its old head's number: no job here can claim it
            w.cancel_orphan(wire)
        else:
            self.running[wire] = (w, self.clock())

    def result_follows(self, w, wire, ours=False):
        """A worker came back saying the result of job ``wire`` follows: the job is taken
        out of the queue until it comes (else the queue could send it out again first, to
        this very worker perhaps, under the same wire). Held by ``own_held`` meanwhile;
        queued again if the worker goes before the result came (worker_left)."""
        if (job := self._claimed(wire, ours)) is not None:
            self.own_held[wire] = job
            self.results_due[wire] = w

    def worker_finished(self, wire, result, ours=False):
        """A worker reports the result of a job that ended while it had no head. A failure
        waits for the end of the hold: it may be one the last head retried on another
        worker, which comes back with the job's success (that one wins)."""
        self.running.pop(wire, None)
        self.results_due.pop(wire, None)
        if not result[0] and outlives_head(wire) and self.clock() < self.hold_until:
            self.failed[wire] = result
            return
        self.failed.pop(wire, None)
        if (job := self._claimed(wire, ours)) is not None:
            self.report(job, *result)
        elif outlives_head(wire):
            self.finished[wire] = (result, self.clock())

    def _claimed(self, wire, ours=False):
        """The job ``wire`` if it waits here, held or queued (taken out), else None. A
        head's own number is claimed only by a worker back at that head (``ours``): held by
        jobs_held, or queued again once the hold ended. (Left queued, the job would be sent
        to a worker again, perhaps this one, while this run is stopped.)"""
        if not outlives_head(wire):
            return (self.own_held.pop(wire, None) or self.claim(wire)) if ours else None
        return self.own_held.pop(wire, None) or self.held.pop(wire, None) or self.claim(wire)

    def adopted(self, wire):
        """The job ``wire``, which a worker came back with, was started there again: it is
        that job's run now (not to be cancelled)."""
        self.running.pop(wire, None)

    def worker_left(self, w):
        for wire in w.orphans:
            self.running.pop(wire, None)
        for wire, due in list(self.results_due.items()):
            if due is w:  # (gone before the results it came back with)
                del self.results_due[wire]
                if (job := self.own_held.pop(wire, None)) is not None:
                    self.push(job)

    def hold_ended(self):
        """At hold_until: queue the held jobs (``push``), telling their queues of those
        whose workers did not come back."""
        failed = self.failed
        self.failed = {}
        for wire, result in failed.items():  # no worker had a success for these
            self.worker_finished(wire, result)
        held = self.held
        self.held = {}
        away = {}  # (queue, held for any worker) -> the workers its held jobs wait for
        for hold, jobs in self.held_for.items():
            for job in jobs:
                if held.get(job.wire) is job:
                    away.setdefault((job.queue, hold is True), []).append(hold)
        self.held_for = {}
        for (queue, anyone), holds in away.items():
            what = "may have been running" if anyone else \
                f"were running on {', '.join(sorted(set(holds)))}"
            queue.warn(f"{len(holds)} job(s) that {what} when the last head went run again: "
                       f"no worker came back with them within {REJOIN_WAIT_S:g} s")
        for job in held.values():
            self.push(job)

    def forget_unclaimed(self):
        """Cancel the jobs workers came back with that no one claimed within ORPHAN_WAIT_S,
        and forget such results."""
        old = self.clock() - ORPHAN_WAIT_S
        for wire, (w, since) in list(self.running.items()):
            if since < old:
                del self.running[wire]
                w.cancel_orphan(wire)
        self.finished = {wire: f for wire, f in self.finished.items() if f[1] >= old}


class HeadCore:
    """What every head is built on, a mission's own (GrainExecutor) or the shared one
    (HeadDaemon): the Scheduler with its workers and queues, the Tally, the Retries and the
    Reunion. It answers the worker protocol (see Workers): a job that ends gives its
    resources back and lets queued jobs start, and a failure is retried while its class's
    budget lasts, else the job ends. Its owner says how (the three methods at its end):
    ``requeue`` a retry, ``deliver`` a pickled outcome, ``complete`` an ended job."""

    def __init__(self, retries):
        self.scheduler = Scheduler()
        self.tally = Tally()
        self.retries = retries
        self.reunion = Reunion(self.reported, claim=self.scheduler.claim)
        self.closing = False
        self.instance = os.urandom(8).hex()  # which head this is, for workers that return
        self.clock = _now
        self.tasks = None  # the nursery of its timers (see start_head)
        self._ids = itertools.count(1)  # its jobs' numbers
        self.heap = HeapFreezer()  # (see GrainExecutor._track, HeadDaemon.serve_mission)
        # Set, and renewed, at each change a task of its owner waits for: a worker joined,
        # the last job ended, a mission came or went (see _changed)
        self.changed = trio.Event()

    @staticmethod
    def queue_held(push, job):
        """A job the Reunion held for a worker that did not come back with it: queued again
        (it may have been running here, held since its worker's connection went)."""
        job.change("requeue")
        push(job)

    def add_worker(self, worker):
        self.scheduler.add_worker(worker)

    def remove_worker(self, worker):
        self.scheduler.remove_worker(worker)

    def worker_gone(self, w):
        """A worker process's connection ended: it leaves the Scheduler, then the Reunion
        (which queues again the jobs whose results it was to send)."""
        self.remove_worker(w)
        self.reunion.worker_left(w)

    def worker_came_back(self, w, resume):
        """``w`` registered saying what it ran while it had no head (``resume``: wire ->
        its allocation, or None when it ended and its result follows): the jobs here that
        wait for those are its again. (PeerError for a claim that makes no sense: what it
        took so far goes back to the queue.)"""
        try:
            for wire, alloc in resume.items():
                if alloc is not None:
                    self.reunion.worker_runs(w, wire, alloc, w.ours)
                else:
                    self.reunion.result_follows(w, wire, w.ours)
        except PeerError as e:
            self.reunion.worker_left(w)
            w.interrupt_all(RETRY_LOST, f"was dropped ({e})")
            raise
        self.reunion.worker_back(w.ident, resume)

    def orphan_adopted(self, job):
        """A job ``job.worker`` came back running, unclaimed until now, is this job's run."""
        self.reunion.adopted(job.wire)

    def orphan_ended(self, w, wire, result=None):
        """A run ``w`` came back with, that no job here had claimed, ended (``result``: how;
        None: stopped, as asked): its resources take queued jobs now, and a job of this
        head that waits for the result gets it."""
        if (alloc := w.orphans.pop(wire, None)) is not None:
            w.res.dealloc(alloc)
            w.running -= 1
            self.scheduler.grew(w)
            self.scheduler.pump()
        if result is not None:
            self.reunion.worker_finished(wire, result, w.ours)

    workers = property(lambda self: self.scheduler.workers)

    def joined(self):
        """How many worker processes are joined (those with a connection)."""
        return sum(1 for w in self.workers if w.channel is not None)

    def _changed(self):
        """Wake those who wait for ``changed``: each looks again at what it waits for."""
        self.changed.set()
        self.changed = trio.Event()

    def warn_all(self, text):
        """A warning for whoever runs this head's missions."""
        log.warning("%s", text)

    def statistics(self):
        return self.scheduler.statistics()

    def explain(self):
        return self.scheduler.explain()

    # -- the worker protocol ---------------------------------------------------------
    def job_ended(self, job, value, error, duration):
        """A job of this process ended: its value, or the exception it raised."""
        self.scheduler.release(job, ok=error is None)
        job.duration = duration
        self.settle(job, value, error)
        self.pump()

    def job_reported(self, job, ok, data, duration, kind):
        """A remote worker's job ended: its value or exception, pickled. (Queued jobs start
        once the worker's whole batch of results is in: its serve loop pumps then.)"""
        self.scheduler.release(job, ok=ok)
        self.reported(job, ok, data, duration, kind)

    def reported(self, job, ok, data, duration, kind):
        """A worker process's outcome of ``job`` came, pickled: a run of it took place (see
        JOB_LIFE's report), and its owner settles the outcome or passes it on."""
        job.change("report")
        self.deliver(job, ok, data, duration, kind)

    def job_interrupted(self, job, kind, why):
        """A job's worker went away while running it (``kind``: RETRY_LOST or RETRY_RETIRED)."""
        self.settle(job, None, interrupted(job, self.scheduler.release(job), kind, why), kind)
        self.pump()

    def jobs_held(self, jobs):
        """The jobs of a worker whose connection went while the worker itself may live on:
        held (Reunion) for it to come back to this head with them, for as long as hold_jobs
        waits, which then calls release_held."""
        for job in jobs:
            self.scheduler.release(job)
            self.reunion.own_held[job.wire] = job

    def still_held(self, jobs):
        """Those of ``jobs`` that are held still: no worker came back with them yet."""
        return [job for job in jobs if self.reunion.own_held.get(job.wire) is job]

    def release_held(self, jobs, w, why, why_not):
        """The hold of ``jobs`` is over: those still held are interrupted as lost, since
        their worker ``w`` (which ``why``) did not come back with them (``why_not``)."""
        if not (left := self.still_held(jobs)):
            return
        log.warning("worker %s: re-queueing its %d held job(s): %s", w.name, len(left), why_not)
        for job in left:
            del self.reunion.own_held[job.wire]
            self.settle(job, None, interrupted(job, w, RETRY_LOST, why), RETRY_LOST)
        self.pump()

    def job_cancelled(self, job):
        """A worker stopped a job as asked. When its caller still waits (the head had
        queued it again while its worker was away, and that worker came back with the
        run), it is queued again; else (its mission went away) it ends with no result."""
        self.scheduler.release(job)
        if self.may_retry(job):
            self.queue_again(job)
        else:
            self.end(job, False)
        self.pump()

    def job_sent(self, job):
        """A job goes to a worker process, which knows it by ``job.wire`` (set it first)."""

    def settle(self, job, value, error, kind=None, pickled=None):
        """Retry a failure (of ``kind``, else its exception's class) while the budget
        allows, else end the job."""
        if error is not None:
            kind = kind or self.retries.class_of(error)
            if kind is not None and self.may_retry(job) and \
                    self.retries.again(job, kind, error, self.tally):
                self.queue_again(job)
                self.pump()  # (a result a returning worker reported frees nothing else)
                return
        self.complete(job, value, error, kind, pickled)

    def may_retry(self, job):
        return True

    def queue_again(self, job):
        """``job`` is to run again (a retry, or a run another head may still hold): its
        owner queues it."""
        job.change("requeue")
        self.requeue(job)

    def end(self, job, ok, kind=None):
        """``job`` ended for good: it succeeded (``ok``), or failed, of class ``kind``."""
        job.change("succeed" if ok else "fail")
        job.kind = None if ok else kind
        job.ended = self.clock()

    def pump(self):
        if self.scheduler.n_queued:
            self.scheduler.pump()

    # -- what its owner says: how a result reaches the job's caller ------------------
    def deliver(self, job, ok, data, duration, kind):
        """A job's outcome came pickled from a worker process (``kind``: its failure
        class): settle it, or pass it on as it is."""
        raise NotImplementedError

    def requeue(self, job):
        """Queue a job again that is to run again (see queue_again)."""
        raise NotImplementedError

    def complete(self, job, value, error, kind, pickled):
        """A job ended for good: its value or error (or ``pickled``, as a worker sent it)."""
        raise NotImplementedError


###############################################################################
# Wire protocol ###############################################################
###############################################################################
# Sans-I/O: nothing here reads or writes; the Transports below do. One frame format for
# sockets and subprocess pipes: a 4-byte big-endian length, then the payload; the decoder
# is fed bytes and hands out whole frames. Every connection starts with a mutual
# HMAC-SHA256 challenge-response over the shared key, in raw fixed-size messages:
# nothing is unpickled until both sides have proved they hold the key. Then each frame
# holds the messages of one write, pickled together (a list; one message alone may be a
# frame of its own): each a tuple ``(name, *fields)`` from the MESSAGES table, which every
# receiver hands to dispatch(). (One pickle a write, not one a message: a pickler's start
# and the classes it names -- an allocation's -- are paid once for a whole batch.) After
# the handshake, each write ends in a tag frame that proves its frames came from the key
# holder, in this order (Seal): what a relay or the path alters, drops, replays or injects
# is refused before it is unpickled.
# Job functions, arguments and results travel inside messages as pickle or dill bytes,
# opened only by missions and workers.

FRAME_HEADER = struct.Struct("!I")  # 4-byte big-endian payload length
AUTH_MAGIC = b"GRAIN\x05\r\n"  # 8 bytes: protocol name and version (5: a daemon says when
# each job starts and what workers it has)
AUTH_NONCE = 32                 # bytes of randomness each side contributes
AUTH_PROOF = 32                 # bytes of an HMAC-SHA256 digest
WRITE_MESSAGES = 1024           # messages of one write at most: a backlog goes out in many,
                                # so neither side holds its event loop long over one
SEAL_TAG = 16                   # bytes of a write's integrity tag (keyed BLAKE2b)
TAG_FRAME = b"\x00"  # a frame that starts so holds a tag (a message, a pickle, starts \x80)


class FrameDecoder:
    """Splits a byte stream into frames; raises FrameError on an oversized length."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame=MAX_FRAME):
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data):
        """Add received bytes; return the list of frames now complete."""
        buf = self._buf
        buf += data
        frames = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (size,) = FRAME_HEADER.unpack_from(buf, pos)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes exceeds the maximum {self.max_frame}")
            if n - pos - 4 < size:
                break
            frames.append(bytes(buf[pos + 4:pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self):
        """Bytes of an incomplete frame still buffered (non-zero at EOF means truncation)."""
        return len(self._buf)


def encode_frame(payload):
    return FRAME_HEADER.pack(len(payload)) + payload


class Handshake:
    """The mutual challenge-response, as a state machine with no I/O.

    Each side sends ``hello()`` (magic + a fresh nonce), feeds the peer's hello to
    ``proof(peer_hello)`` and sends the result, then checks the peer's with
    ``verify(peer_proof)``. A proof binds the sender's role (dialer or listener) and both
    nonces, so a proof cannot be replayed or reflected back."""

    HELLO_SIZE = len(AUTH_MAGIC) + AUTH_NONCE

    def __init__(self, key, dialer):
        self.key = key
        self.role = b"dialer" if dialer else b"listener"
        self.peer_role = b"listener" if dialer else b"dialer"
        self.nonce = os.urandom(AUTH_NONCE)
        self.peer_nonce = None

    def hello(self):
        return AUTH_MAGIC + self.nonce

    def _mac(self, role, first, second):
        return hmac.new(self.key, role + first + second, hashlib.sha256).digest()

    def proof(self, peer_hello):
        if len(peer_hello) != self.HELLO_SIZE or not peer_hello.startswith(AUTH_MAGIC):
            if peer_hello.startswith(AUTH_MAGIC[:5]):  # (a grain.py of another version)
                raise AuthenticationError(
                    f"the peer speaks version {peer_hello[5]} of the grain protocol, this "
                    f"grain.py {AUTH_MAGIC[5]}: run the same grain.py on both sides")
            raise AuthenticationError("the peer does not speak the grain protocol")
        self.peer_nonce = peer_hello[len(AUTH_MAGIC):]
        return self._mac(self.role, self.peer_nonce, self.nonce)

    def verify(self, peer_proof):
        expected = self._mac(self.peer_role, self.nonce, self.peer_nonce)
        if not hmac.compare_digest(expected, peer_proof):
            raise KeyMismatch("the peer does not hold the grain key")
        return Seal(self._mac(b"seal " + self.role, self.nonce, self.peer_nonce),
                    self._mac(b"seal " + self.peer_role, self.peer_nonce, self.nonce))


class Seal:
    """The integrity of one connection's frames after its handshake. Each write of frames
    (a batch: whatever a Channel had queued) ends in a tag frame, TAG_FRAME and a keyed
    BLAKE2b of the write's number and bytes; each direction has its own key (from the
    shared key and both nonces) and counts its writes. The receiver holds a batch's frames
    until its tag checks out. So a frame altered, dropped, replayed, reordered or injected
    (by a relay, or anyone on the path) is refused before it is unpickled, and the cost is
    a tag a write, not a frame."""

    __slots__ = ("_out", "_in", "sent", "received", "_held", "_held_bytes")

    def __init__(self, key_out, key_in):
        self._out = hashlib.blake2b(key=key_out, digest_size=SEAL_TAG)
        self._in = hashlib.blake2b(key=key_in, digest_size=SEAL_TAG)
        self.sent = self.received = self._held_bytes = 0
        self._held = []  # the frames of a write whose tag has not come yet

    def tag(self, parts):
        """The tag frame of the write of ``parts`` (bytes, as they go on the wire)."""
        self.sent += 1
        mac = self._out.copy()
        mac.update(self.sent.to_bytes(8, "big"))
        for part in parts:
            mac.update(part)
        return encode_frame(TAG_FRAME + mac.digest())

    def opened(self, frame, peer, most):
        """The frames of a write once its tag (``frame``) proves them, () before; FrameError
        if the tag is wrong, or more than ``most`` bytes come untagged."""
        if not frame.startswith(TAG_FRAME):
            self._held.append(frame)
            self._held_bytes += len(frame)
            if self._held_bytes > most and len(self._held) > 1:
                raise FrameError(f"{peer} sent more than a frame's worth untagged")
            return ()
        frames = self._held
        self._held = []
        self._held_bytes = 0
        self.received += 1
        mac = self._in.copy()
        mac.update(self.received.to_bytes(8, "big"))
        for held in frames:
            mac.update(FRAME_HEADER.pack(len(held)))
            mac.update(held)
        if not hmac.compare_digest(frame[1:], mac.digest()):
            raise FrameError(f"write {self.received} from {peer} failed its integrity check "
                             "(altered, dropped, replayed or injected on the way)")
        return frames


def default_key_path():
    return os.path.join(os.path.expanduser("~"), ".local", "share", "grain", "key")


def _create_key_file(path):
    """A new key at ``path``, never seen half written: two workers starting at once on a
    fresh home (``up -n 2``) race here, and the loser must read the winner's 32 bytes, not
    an empty file. The key is written to a private file beside it, then hard-linked into
    place (atomic, and refused if the name exists, on NFS too); the loser keeps the winner's."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".key-{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


class AuthKey(bytes):
    """The shared secret, and, when the config names a certificate, the TLS contexts
    ``tls`` = (as the listener, as the dialer) that wrap each TCP stream (authenticate), and
    the ``path`` of its file."""
    tls = path = None


def _refuse_if_shared(path, mode, what):
    if mode & 0o077:  # (as ssh refuses such private keys)
        raise GrainError(f"{what} {path} is readable by others (mode "
                         f"{stat.S_IMODE(mode):04o}); fix it with `chmod 600 {path}`")


def load_auth_key(path=None, tls_cert="", tls_key=""):
    """The shared secret: 32 random bytes in a file only its owner can read, created (mode
    0600) on first use. With ``tls_cert`` (and ``tls_key``, when the key is not in the
    same file), the TLS contexts of that certificate, which every side holds, as it holds
    the key: a dialer trusts that certificate alone, whatever the listener's host name."""
    path = os.path.abspath(os.path.expanduser(path or default_key_path()))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        _create_key_file(path)
        fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        _refuse_if_shared(path, os.fstat(f.fileno()).st_mode, "key file")
        key = AuthKey(f.read())
    key.path = path
    if len(key) < 16:
        raise GrainError(f"key file {path} holds {len(key)} bytes; it needs at least 16 "
                         "(delete it and grain makes a new one)")
    if tls_cert:
        import ssl

        tls_key = tls_key or tls_cert
        try:
            _refuse_if_shared(tls_key, os.stat(tls_key).st_mode, "TLS key file")
            listener = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            listener.load_cert_chain(tls_cert, tls_key)
            dialer = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            dialer.check_hostname = False  # (the certificate is pinned: names vary by site)
            dialer.load_verify_locations(tls_cert)
        except (OSError, ssl.SSLError) as e:
            raise GrainError(f"cannot use TLS certificate {tls_cert} with key {tls_key}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
        key.tls = (listener, dialer)
    return key


def dumps_control(msg):
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _frames_of(msgs, most):
    """The frame payloads that carry ``msgs``: one pickle of them all, or, when that is
    larger than a frame may be (large payloads), of each half in turn."""
    data = dumps_control(msgs)
    if len(data) > most and len(msgs) > 1:
        half = len(msgs) // 2
        return _frames_of(msgs[:half], most) + _frames_of(msgs[half:], most)
    return [data]


# Every message: its fields (``[x]`` may be left out, ``*x`` takes any number) and who
# sends it to whom. A message is the tuple ``(name, *fields)``.
MESSAGES = {
    # the first message of a connection, and the answers to it
    "register": ("info",),                   # worker -> head: name, res, pid, host, ...
    "mission": ("info",),                    # mission -> head daemon: name, pid, host, ...
    "cli": ("command", "*args"),             # CLI -> head
    "assign": ("res",),                      # head -> a passive worker it dialled
    "attached": ("info",),                   # head daemon -> mission: pid, host, log
    "refused": ("why",),                     # head -> mission
    "reply": ("reply",),                     # head -> CLI: a dict
    # jobs
    "fn": ("digest", "data", "[name]"),      # a job function, sent once per peer
    "job": ("ref", "req", "digest", "payload", "[resumed]"),  # mission -> head daemon
    "run": ("jid", "digest", "payload", "alloc", "T"),   # head -> worker
    "started": ("ref",),                     # head daemon -> mission: a worker took it
    "done": ("jid", "ok", "data", "duration", "[kind]"),  # worker -> head -> mission
    "cancel": ("jid",),                      # head -> worker: nobody wants it any more
    "cancelled": ("jid",),                   # worker -> head: it stopped
    # lifetime
    "ping": (),                              # both ways, every HEARTBEAT_S
    "warn": ("text",),                       # head daemon -> mission: for its user
    "workers": ("count", "cores"),           # head daemon -> mission: what it has joined
    "fin": (),                               # head -> worker: leave after your jobs
    "drain": (),                             # head -> worker: take no more, then leave
    "leave": (),                             # head -> worker: stop your jobs and leave now
    "head": ("instance",),                   # head -> worker: which head it is (see Reunion)
    "leaving": ("why",),                     # worker -> head: re-queue what I run
}
# (fewest, most) fields of each message
_ARITY = {name: (sum(1 for f in fields if f[0] not in "[*"),
                 math.inf if any(f[0] == "*" for f in fields) else len(fields))
          for name, fields in MESSAGES.items()}


def dispatch(handlers, msg, peer="a peer"):
    """Call the handler of ``msg`` (``handlers``: {name: callable}) with its fields, and
    return what it returns. PeerError if ``msg`` is not a message of MESSAGES that this
    receiver handles, with the number of fields the table gives it."""
    try:  # (the per-job path: no more work than this)
        handler = handlers[msg[0]]
        low, high = _ARITY[msg[0]]
    except (TypeError, KeyError, IndexError):
        raise PeerError(f"{peer} sent an unexpected message {msg!r:.60}") from None
    if not low < len(msg) <= high + 1:
        raise PeerError(f"{peer} sent {msg[0]!r} with {len(msg) - 1} field(s), expected "
                        f"{', '.join(MESSAGES[msg[0]]) or 'none'}")
    return handler(*msg[1:])


###############################################################################
# Transports ##################################################################
###############################################################################
# URLs name where to meet: ``tcp://host:port`` (``tcp://:port`` to listen on every
# interface), ``unix:///path`` and ``edge:///abs/path/file``; serve(url, key, handler) and
# connect(url, key) give, alike for each scheme, a peer that passed the handshake as a trio
# stream. Through an Edge file on the shared filesystem a head and its workers find each
# other, whichever starts first.


class FrameStream:
    """A trio byte stream spoken in frames."""

    def __init__(self, send_stream, receive_stream=None, max_frame=MAX_FRAME):
        self.send_stream = send_stream
        self.receive_stream = receive_stream if receive_stream is not None else send_stream
        self._decoder = FrameDecoder(max_frame)
        self._ready = deque()
        self.receive_some = self.receive_stream.receive_some  # (a Channel may read directly)

    async def send(self, payload):
        await self.send_stream.send_all(encode_frame(payload))

    async def receive(self):  # (None at a clean EOF; FrameError on a truncated one)
        while not self._ready:
            if not (data := await self.receive_some(1 << 16)):
                if self._decoder.pending:
                    raise FrameError(f"stream ended inside a frame "
                                     f"({self._decoder.pending} bytes pending)")
                return None
            self._ready.extend(self._decoder.feed(data))
        return self._ready.popleft()


def _bridge_url(url):
    """``(label, host, port, {option: value})`` of a bridge:// URL; ValueError otherwise."""
    m = re.match(r"^bridge://([^@/,|]+)@([^:/?@]+):(\d+)/?(?:\?([^#]*))?$", url)
    if not m or int(m.group(3)) > 65535:
        raise ValueError(f"malformed address {url!r}: expected "
                         "bridge://LABEL@HOST:PORT[?iface=NAME]")
    options = dict(kv.split("=", 1) for kv in (m.group(4) or "").split("&") if "=" in kv)
    return m.group(1), m.group(2), int(m.group(3)), options


def parse_url(url):
    """``(scheme, host, port_or_path)`` for tcp/unix/edge/bridge URLs; ValueError otherwise."""
    if not (m := re.match(r"^([a-z]+)://(.*)$", url or "")):
        raise ValueError(f"malformed address {url!r}: expected tcp://host:port, "
                         "unix:///path, edge:///abs/path or bridge://LABEL@HOST:PORT")
    scheme, rest = m.groups()
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"malformed address {url!r}: expected tcp://host:port")
        return scheme, host.strip("[]"), int(port)
    if scheme == "bridge":
        return scheme, *_bridge_url(url)[1:3]
    if scheme in ("unix", "edge"):
        if not rest.startswith("/"):
            raise ValueError(f"malformed address {url!r}: {scheme}:// needs an absolute path "
                             f"({scheme}:///abs/path)")
        return scheme, "", rest
    raise ValueError(f"unsupported address scheme {scheme!r} in {url!r} "
                     "(use tcp://, unix://, edge:// or bridge://)")


def _ipv4_addresses():
    """``{interface: ipv4}`` for the interfaces of this host that have one."""
    out = {}
    with contextlib.suppress(Exception):  # (not Linux: no fcntl or SIOCGIFADDR)
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):
                    packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                         struct.pack("256s", name[:15].encode()))
                    out[name] = socket.inet_ntoa(packed[20:24])
    return out or {"lo": "127.0.0.1"}


async def open_listeners(url):
    """Listeners for a tcp:// or unix:// URL, and the URLs peers can use to reach them
    (GrainError naming the URL when it cannot be listened on)."""
    scheme, host, where = parse_url(url)
    try:
        if scheme == "tcp":
            listeners = await trio.open_tcp_listeners(where, host=host or "0.0.0.0")
            port = listeners[0].socket.getsockname()[1]
            ips = {"tcp": host} if host and host != "0.0.0.0" else _ipv4_addresses()
            return listeners, {iface: f"tcp://{ip}:{port}" for iface, ip in ips.items()}
        if scheme == "unix":
            return [await _unix_listener(where)], {"unix": url}
    except OSError as e:
        why = {errno.EADDRINUSE: "another process listens there already",
               errno.EADDRNOTAVAIL: "no interface of this machine has that address",
               errno.ENOENT: "its directory does not exist"}.get(e.errno, e.strerror or str(e))
        raise ListenError(f"cannot listen at {url}: {why}") from None
    raise ValueError(f"cannot listen on {url!r} directly")


def private_dir():
    """$TMPDIR/grain-<uid> (/tmp's when that path is too long for sockets' 107 bytes), mode
    0700: where this host's sockets are. Made if need be; a GrainError if not only ours."""
    base = os.environ.get("TMPDIR") or "/tmp"
    base = os.path.join(base if len(base) < 60 else "/tmp", f"grain-{os.getuid()}")
    os.makedirs(base, 0o700, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise GrainError(f"{base} must be a directory of yours that only you can read (mode "
                         "0700): it holds grain's sockets; remove it or chmod 700 it")
    return base


def _remove_dead_sockets(paths, yours):
    """Remove those of the socket files ``paths`` that no one listens on (connecting is
    refused: their process died); whether ``yours`` has a listener. Another process's file
    made in the last SOCKET_GRACE_S is left: it may be bound and not listening yet."""
    live = False
    for path in paths:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.setblocking(False)  # (a live listener with a full backlog: EAGAIN)
            if probe.connect_ex(path) not in (errno.ECONNREFUSED, errno.ENOENT):
                live |= path == yours
                continue
        with contextlib.suppress(OSError):
            if path == yours or time.time() - os.lstat(path).st_mtime > SOCKET_GRACE_S:
                os.unlink(path)
    return live


async def _unix_listener(path):
    """A Unix socket listener at ``path``. Socket files that processes which died left there
    or in private_dir() are removed first."""
    if _remove_dead_sockets({path, *glob.glob(os.path.join(private_dir(), "*.sock"))}, path):
        raise GrainError(f"another process already listens on unix://{path}")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)  # the socket file is ours alone
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    return trio.SocketListener(sock)


async def _receive_exactly(stream, n, during="during the handshake", error=None):
    buf = bytearray()
    while len(buf) < n:
        if not (data := await stream.receive_some(n - len(buf))):
            raise (error or HungUp)(f"the peer closed the connection {during}")
        buf += data
    return bytes(buf)


async def authenticate(stream, key, dialer, timeout=HANDSHAKE_TIMEOUT_S):
    """The fresh ``stream`` once the handshake passed on it (AuthenticationError if not), under
    TLS first when ``key.tls`` and it is TCP; its Seal (``stream.seal``) goes to its Channel."""
    hs = Handshake(key, dialer)
    with trio.move_on_after(timeout) as scope:
        if getattr(key, "tls", None) and getattr(stream, "socket", None) is not None \
                and stream.socket.family != socket.AF_UNIX:
            tls = trio.SSLStream(stream, key.tls[dialer], server_side=not dialer)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as e:
                raise AuthenticationError(f"no TLS session ({e.__cause__ or e}); do both "
                                          "sides name the same tls_cert?") from None
            for name in ("socket", "peer", "via"):  # (what _peer_name and ls read)
                if hasattr(stream, name):
                    setattr(tls, name, getattr(stream, name))
            stream = tls
        await stream.send_all(hs.hello())
        await stream.send_all(hs.proof(await _receive_exactly(stream, Handshake.HELLO_SIZE)))
        stream.seal = hs.verify(await _receive_exactly(stream, AUTH_PROOF))
    if scope.cancelled_caught:
        raise AuthenticationError(f"no handshake within {timeout:g} s")
    return stream


def _peer_name(stream):
    if getattr(stream, "via", None):  # met through a bridge (see Bridge)
        return f"{stream.peer} ({stream.via})"
    try:
        addr = stream.socket.getpeername()
    except (AttributeError, OSError):
        return "?"
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else (
        f"unix:{addr}" if addr else "a local Unix socket")


class EdgeFile:
    """The Edge rendezvous file: JSON ``{"listener": {...} | null, "dialer": [...]}``, mode
    0600, changed only under edit_locked(). The listener (a head) records ``host``, ``lid``,
    ``pid``, ``heartbeat`` (Unix time by the file server's clock, see now(); refreshed every
    EDGE_HEARTBEAT_S), ``urls``
    ({interface: url}) and ``key`` (its key file, for those who hold another to be told
    which to copy); a dialer (a worker) that finds no live listener, where it listens."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        d = os.path.dirname(self.path)
        if not os.path.isdir(d):
            raise UsageError(f"Edge file {self.path}: directory {d} does not exist")
        if not os.access(d, os.W_OK | os.X_OK):
            raise UsageError(f"Edge file {self.path}: directory {d} is not writable")

    def locked(self):
        """Hold the lock; yields the current content (a dict) and writes back changes."""
        return edit_locked(self.path, self._read, lambda data: json.dumps(data, indent=1).encode())

    def _read(self):
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            data = json.loads(raw) if raw.strip() else None
            if not isinstance(data, dict):
                raise ValueError("not an object")
            data.setdefault("listener", None)
            if not isinstance(data.get("dialer"), list):
                data["dialer"] = []
            return data
        except FileNotFoundError:
            pass
        except ValueError as e:
            log.warning("Edge file %s is corrupt (%s); starting it afresh", self.path, e)
        return {"listener": None, "dialer": []}

    def now(self):
        """The time by the clock of the Edge file's server (this host's if it cannot say):
        a head's heartbeat, written from one node, is read from others."""
        with contextlib.suppress(OSError):
            return file_server_time(self.path + ".lock")  # (edit_locked's)
        return time.time()

    def live(self, record):
        """Is a listener record fresh? (A head that died leaves a stale heartbeat.)"""
        if not isinstance(record, dict) or not isinstance(record.get("urls"), dict):
            return False
        beat = record.get("heartbeat")
        if not isinstance(beat, (int, float)) or self.now() - beat > EDGE_STALE_S:
            return False
        return record.get("host") != hostname() or _pid_lives(record.get("pid"))


def _order_urls(record):
    """A record's URLs to dial: from this host, its Unix socket first; from another, none of
    its loopback or Unix ones (here they would reach this host, or nothing, not that one)."""
    here = record.get("host") == hostname()
    return sorted((u for u in record.get("urls", {}).values() if here or not u.startswith(
        ("unix:", "tcp://127.", "tcp://[::1]"))), key=lambda u: (
        not u.startswith("unix:"), not u.startswith("tcp://127.")))


async def _edge_listeners(tag):
    """``(listeners, {interface: url}, socket path)`` of one side of an Edge rendezvous: a free
    TCP port and a Unix socket in private_dir() (``tag`` names it), for peers on this host."""
    sock_path = os.path.join(private_dir(), f"edge-{tag}.sock")
    tcp, urls = await open_listeners("tcp://:0")
    urls["unix"] = f"unix://{sock_path}"
    return tcp + [await _unix_listener(sock_path)], urls, sock_path


async def _try_connect(urls, key, head=None, theirs=None, timeout=EDGE_CONNECT_S):
    """The first authenticated stream among ``urls`` (we dial); Unreachable if none. ``head``:
    the URL of the head they reach (and ``theirs`` its key file), for a KeyMismatch naming
    the key files."""
    why = "no address to try"
    for url in urls:
        if url.startswith("unix:") and not os.path.exists(parse_url(url)[2]):
            why = f"{url} does not exist"
            continue
        with trio.move_on_after(timeout) as attempt:
            try:
                scheme, host, where = parse_url(url)
                stream = await (trio.open_tcp_stream(host or "127.0.0.1", where)
                                if scheme == "tcp" else trio.open_unix_socket(where))
            except OSError as e:
                why = f"{e.strerror or e}"
                continue
            try:
                return await authenticate(stream, key, dialer=True)
            except (AuthenticationError, OSError, trio.BrokenResourceError) as e:
                why = f"{e}"
                await stream.aclose()
                if head and isinstance(e, KeyMismatch):  # it answered: so would its other URLs
                    theirs = theirs or "the head's key file"
                    mine = getattr(key, "path", None)
                    raise KeyMismatch(f"the head at {head} holds another key: " + (
                        f"copy {theirs} to {mine}" if theirs != mine else
                        f"{mine} was made again after the head started: restart the head"))
        if attempt.cancelled_caught:
            why = f"no answer within {timeout:g} s"
    raise Unreachable(why)


async def _admitted(stream, key):
    """An incoming ``stream`` once its peer passed the handshake (we listen); if it did
    not, None, the stream closed with a warning naming the peer."""
    try:
        return await authenticate(stream, key, dialer=False)
    except (OSError, PeerError, trio.BrokenResourceError) as e:
        # (one that hung up, as a process checking the socket is live does: no news)
        (log.debug if isinstance(e, (HungUp, trio.BrokenResourceError)) else log.warning)(
            "refused a connection from %s: %s", _peer_name(stream), e)
        await stream.aclose()


async def accept_one(listeners, key):
    """The first incoming stream on ``listeners`` that passes the handshake (we listen). Not
    trio.serve_listeners: it closes each stream when its handler returns, and this stream
    must outlive the accept loop."""
    send, receive = trio.open_memory_channel(1)

    async def accept_from(listener):
        while True:
            if (stream := await _admitted(await listener.accept(), key)) is not None:
                try:
                    send.send_nowait(stream)
                except trio.WouldBlock:
                    await stream.aclose()

    try:
        async with open_background_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(accept_from, listener)
            return await receive.receive()
    finally:
        with trio.CancelScope(shield=True):  # closed even when the wait was cancelled
            for listener in listeners:
                await listener.aclose()


# Schemes a section below speaks: {scheme: (serve(url, key, on_accept, task_status),
# connect(url, key, wait))}, filled in there (the Bridge)
MORE_SCHEMES = {}


def alive_folder(url):
    """Where the workers of the head at ``url`` touch their alive files: a folder beside
    its Edge file, on the filesystem the head and they share (None for another address).
    A head that hears nothing from a worker tells by it a node cut off from the network,
    whose jobs run on, from a node gone."""
    return f"{url[len('edge://'):]}.alive" if str(url).startswith("edge://") else None


async def serve(url, key, handler, *, task_status=TASK_STATUS_IGNORED):
    """Accept peers at ``url`` until cancelled: each stream that passes the handshake goes
    to ``handler(stream, peer)`` in a task of its own, and is closed when it returns.
    started() with the URLs peers can use ({interface: url}) once they can connect; for an
    Edge file, once its record is written (a live head's record there is a GrainError)."""
    async def on_accept(stream):
        peer = _peer_name(stream)  # (now: it may hang up later)
        if (stream := await _admitted(stream, key)) is not None:
            await handler(stream, peer)

    scheme, _, where = parse_url(url)
    if scheme == "edge":
        return await _serve_edge(where, key, on_accept, handler, task_status)
    if scheme in MORE_SCHEMES:
        return await MORE_SCHEMES[scheme][0](url, key, on_accept, task_status)
    listeners, urls = await open_listeners(url)
    try:
        async with open_strict_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, on_accept, listeners)
            task_status.started(urls)
    finally:
        if scheme == "unix":  # our socket file: nobody is to find it after us
            _unlink_quietly(where)


async def _serve_edge(path, key, on_accept, handler, task_status):
    """serve() for an Edge file: keep our record in it fresh; call the workers waiting in it."""
    edge = EdgeFile(path)
    lid = os.urandom(8).hex()
    listeners, urls, sock_path = await _edge_listeners(f"head-{lid}")
    record = {"host": hostname(), "lid": lid, "pid": os.getpid(), "urls": urls,
              "key": getattr(key, "path", None)}
    with edge.locked() as data:
        current = data["listener"]
    silent = None  # the lid of a record that looks live but whose head does not answer
    if edge.live(current):
        try:
            await (await _try_connect(_order_urls(current), key)).aclose()
        except Unreachable:
            silent = current.get("lid")

    calling = set()  # the waiting workers being called: one call each at a time

    async def call(dialer):
        urls = _order_urls(dialer)
        try:
            stream = await _try_connect(urls, key)
        except Unreachable as e:
            with edge.locked() as data:  # (gone, it seems: not called again)
                data["dialer"] = [d for d in data["dialer"] if d != dialer]
            return log.warning("could not reach the waiting worker at %s (%s); dropped its "
                               "record", ", ".join(urls) or "(no address)", e)
        finally:
            calling.discard(dialer.get("did"))
        async with stream:  # (named by the address that answered, if its socket says)
            name = _peer_name(stream)
            await handler(stream, urls[0] if name == "?" else name)

    try:
        async with open_strict_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, on_accept, listeners)
            first = True
            while True:
                with edge.locked() as data:
                    current = data["listener"]
                    if first and edge.live(current) and current.get("lid") != silent:
                        raise GrainError(
                            f"a head is already listening at edge://{path} (pid "
                            f"{current.get('pid')} on {current.get('host')}); stop it first")
                    if current and (current.get("lid") != lid):
                        log.warning("Edge file %s: %s", path, "replacing the stale record of "
                                    f"pid {current.get('pid')} on {current.get('host')}"
                                    if first else "our record was replaced; re-adding it")
                    # A worker's record stays until the worker takes it back, once called:
                    # a call cut short (this head ending, killed) leaves it to the next head.
                    pending = data["dialer"]
                    data["listener"] = dict(record, heartbeat=edge.now())
                for dialer in pending:
                    if dialer.get("did") not in calling:
                        calling.add(dialer.get("did"))
                        nursery.start_soon(call, dialer)
                if first:
                    task_status.started(urls)
                    first = False
                await trio.sleep(EDGE_HEARTBEAT_S)
    finally:
        with contextlib.suppress(OSError), edge.locked() as data:
            if (data["listener"] or {}).get("lid") == lid:
                data["listener"] = None
        _unlink_quietly(sock_path)


async def connect(url, key, *, wait=False):
    """An authenticated stream to the listener at ``url``, or the one an Edge file records (we
    dial); Unreachable if none answers, unless ``wait``: then wait to be called meanwhile (or,
    while the live head holds another key, for it to go: said once)."""
    scheme, _, where = parse_url(url)
    if scheme in MORE_SCHEMES:
        return await MORE_SCHEMES[scheme][1](url, key, wait)
    if scheme != "edge":
        return await _try_connect([url], key, url)
    edge = EdgeFile(where)
    other = None  # (the lid of a live head that holds another key)
    said = set()  # the records whose head we said we wait for (once: a long cut dials often)
    while True:
        with edge.locked() as data:
            record = data["listener"]
        lid = record.get("lid") if isinstance(record, dict) else None
        if edge.live(record) and lid == other:  # not ours, still there
            await trio.sleep(EDGE_HEARTBEAT_S)  # (a wait for it to go, no try: not retry())
            continue
        if edge.live(record):
            try:
                return await _try_connect(_order_urls(record), key, url, record.get("key"))
            except Unreachable as e:
                if not wait:
                    raise
                if isinstance(e, KeyMismatch):
                    log.warning("%s; waiting for a head that holds this one", e)
                    other = lid
                    continue
                tried = f"{', '.join(_order_urls(record)) or 'no address it can reach'} ({e})"
            (log.debug if lid in said else log.warning)(
                "the head recorded in %s does not answer at %s; waiting for one", where, tried)
        elif not wait:
            raise Unreachable(f"no live head is recorded in {where}")
        elif record:
            log.warning("Edge file %s holds a stale head record (pid %s on %s); waiting for "
                        "a live head", where, record.get("pid"), record.get("host"))
        say = log.debug if lid in said else log.info
        said.add(lid)
        if (stream := await _wait_to_be_called(edge, record, key, say)) is not None:
            return stream


async def _wait_to_be_called(edge, seen, key, say=log.info):
    """Record in the Edge file where we listen and wait for a head to call; None if a live
    head other than ``seen`` appeared meanwhile (connect to it instead), or if a head that
    could not reach us dropped our record (a network cut, say: dial it again)."""
    did = os.urandom(8).hex()
    listeners, urls, sock_path = await _edge_listeners(f"worker-{did}")

    def recorded():  # (a file that cannot be read now drops nothing: wait on)
        with contextlib.suppress(OSError), edge.locked() as data:
            return any(isinstance(d, dict) and d.get("did") == did for d in data["dialer"])
        return True

    async def while_recorded(scope):
        await trio.sleep(EDGE_HEARTBEAT_S)
        while recorded():
            await trio.sleep(EDGE_HEARTBEAT_S)
        scope.cancel()
    try:
        with edge.locked() as data:
            if edge.live(data["listener"]) and data["listener"] != seen:
                return None
            data["dialer"].append({"host": hostname(), "did": did, "pid": os.getpid(),
                                   "urls": urls})
        say("waiting for a head to call (recorded in %s)", edge.path)
        async with open_strict_nursery() as nursery:
            nursery.start_soon(while_recorded, nursery.cancel_scope)
            stream = await accept_one(listeners, key)
            nursery.cancel_scope.cancel()
            return stream
        return None
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
        _unlink_quietly(sock_path)
        with contextlib.suppress(OSError), edge.locked() as data:
            data["dialer"] = [d for d in data["dialer"]
                              if not (isinstance(d, dict) and d.get("did") == did)]


###############################################################################
# Channels ####################################################################
###############################################################################
# A Channel speaks messages over a stream that passed its handshake: sends are queued and
# go out coalesced, a batch a write (sealed, when the stream has a Seal); receives come
# checked, a message at a time, or dispatched to handlers (``dispatch_all``), the loop
# every side of the worker protocol runs. open_channel adds the heartbeat and the
# watchdog that notices a silent peer.


class Channel:
    """An authenticated connection: ``send(msg)`` queues, ``receive()`` awaits."""

    def __init__(self, stream, max_frame=MAX_FRAME, peer="?", silent_after=None):
        self.stream = stream
        self.peer = peer
        self._seal = getattr(stream, "seal", None)  # (None: an in-memory stream, in tests)
        self._frames = FrameStream(stream, max_frame=max_frame)
        self._max_frame = max_frame
        # A plain socket (not TLS's), read and written directly at its file descriptor: see
        # _read, _write. The descriptor is asked for each time: -1 once the socket is closed,
        # never a number the system has since given to another file. (The bound method, kept:
        # trio 0.22 finds a socket's fileno through __getattr__, ten times as slow.)
        self._fileno = stream.socket.fileno if type(stream) is trio.SocketStream else None
        if self._fileno is not None:
            self._frames.receive_some = self._read
        self._checked = deque()  # messages received (their writes proved, when sealed)
        self._out = []
        self._wakeup = trio.Event()
        self._reader_flushes = False  # (see dispatch_all: then send need not wake the writer)
        self._closed = False
        self._writing = False
        self.flushed = trio.Event()  # set when the writer has stopped
        self.clock = trio.lowlevel.current_clock().current_time  # (read once a frame)
        self.last_heard = self.clock()
        self.silent_after = silent_after  # seconds of silence open_channel's watchdog allows
        self.silent = False           # set when the watchdog gave up on the peer

    def send(self, msg):
        """Queue a message (left unchanged: it is pickled as the writer sends it, batched)."""
        if not self._closed:
            self._out.append(msg)
            if not self._reader_flushes:
                self._wakeup.set()

    async def run_writer(self):
        """Send what ``send`` queued whenever no one else is sending it already."""
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                await self.flush()
                # Closing, and nothing left -- not even in another task's flush, which
                # wakes us when it ends -- means everything queued has gone out.
                if self._closed and not self._out and not self._writing:
                    return
        finally:
            self.flushed.set()

    async def flush(self):
        """Send everything queued now, from the calling task (saves waking the writer on the
        per-job path). Messages queued meanwhile go out in the same loop, coalesced."""
        if self._writing:
            return
        self._writing = True
        try:
            while self._out:
                out = self._out
                self._out = []
                for i in range(0, len(out), WRITE_MESSAGES):  # (a tag a frame: see Seal)
                    for frame in _frames_of(out[i:i + WRITE_MESSAGES], self._max_frame):
                        write = [FRAME_HEADER.pack(len(frame)), frame]
                        if self._seal is not None:
                            write.append(self._seal.tag(write))
                        await self._write(b"".join(write))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The peer went (its end closed as it went, say): what was queued goes nowhere,
            # and receive() says it went. Not an error of the task that flushed.
            self._closed = True
            self._out = []
        finally:
            self._writing = False
            if self._closed:
                self._wakeup.set()  # let the writer see that the last bytes are out

    async def _write(self, data):
        """To the socket itself what the kernel takes at once; the rest to trio's send_all."""
        if self._fileno is not None:
            try:
                data = data[os.write(self._fileno(), data):]  # (non-blocking)
            except BlockingIOError:
                pass
            except OSError as e:
                raise trio.BrokenResourceError(f"{e}") from None
        if data:
            await self.stream.send_all(data)

    async def _read(self, most):
        """A plain socket's next bytes, as trio's receive_some reads them (a cancellation
        seen before, a yield after) without its three context managers: with many
        workers, a read a job."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            try:
                data = os.read(self._fileno(), most)
            except BlockingIOError:
                while True:
                    await trio.lowlevel.wait_readable(self._fileno())
                    with contextlib.suppress(BlockingIOError):
                        return os.read(self._fileno(), most)
        except OSError as e:
            raise trio.BrokenResourceError(f"{e}") from None
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    @property
    def _input_waiting(self):
        """Has input come that receive() has not handed out yet?"""
        return bool(self._checked or self._frames._ready)

    @property
    def flush_due(self):
        """Is output queued, and no input waiting that could add to it? Then send it now."""
        return bool(self._out) and not self._input_waiting

    async def dispatch_all(self, handlers, after_batch=None):
        """Dispatch every message to ``handlers`` until the peer closes the connection.
        Before waiting for more input, call ``after_batch()`` (when given: a pump, once for
        a batch of results, not once a result), then send what the handlers queued: the
        jobs a batch of results let start go out in one write. Meanwhile what they queue
        does not wake the writer: with many workers, a job each, that wake was a task
        switch a job for nothing."""
        try:
            while True:
                if after_batch is not None and not self._input_waiting:
                    after_batch()
                if self.flush_due:
                    await self.flush()
                self._reader_flushes = False
                msg = await self.receive()
                if msg is None:
                    return
                self._reader_flushes = True
                dispatch(handlers, msg, self.peer)
        finally:
            self._reader_flushes = False
            if self._out:
                self._wakeup.set()

    async def receive(self):
        """The next message, or None when the peer closed the connection."""
        while not self._checked:
            try:
                frame = await self._frames.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if frame is None:
                return None
            self.last_heard = self.clock()
            for frame in (frame,) if self._seal is None else self._seal.opened(
                    frame, self.peer, self._max_frame):
                try:
                    msgs = pickle.loads(frame)
                except Exception as e:  # authenticated, yet undecodable: drop this peer only
                    raise PeerError(f"undecodable message from {self.peer}: {e}") from None
                self._checked.extend(msgs if type(msgs) is list else (msgs,))
        return self._checked.popleft()

    def close_after_flush(self):
        self._closed = True
        self._wakeup.set()

    async def aclose(self):
        self.close_after_flush()
        with contextlib.suppress(Exception):
            await self.stream.aclose()


async def _send_heartbeats(channel):
    while True:
        await trio.sleep(HEARTBEAT_S)
        channel.send(("ping",))


async def _watch_silence(channel, scope):
    """open_channel's watchdog: cancels ``scope`` (see there); one task, not a scope a receive."""
    while True:
        limit = channel.silent_after
        if limit is None:
            await trio.sleep(HEARTBEAT_S)
            continue
        # (one sum, slept until and compared with: a deadline recomputed as a difference
        # can round below itself, and the loop would wake at it again and again)
        deadline = channel.last_heard + limit
        if channel.clock() >= deadline:
            channel.silent = True
            scope.cancel()
            return
        await trio.sleep_until(deadline)


@contextlib.asynccontextmanager
async def open_channel(stream, peer="?", *, max_frame=MAX_FRAME, heartbeat=True,
                       silent_after=SILENT_S):
    """A Channel over ``stream`` for the block: its writer runs; with ``heartbeat`` a ping
    goes out every HEARTBEAT_S; when the peer has sent nothing for ``channel.silent_after``
    seconds (None: no limit; the block may change it) the block is cancelled and
    ``channel.silent`` set. On the way out, what was queued goes out (FLUSH_S at most)
    and the stream is closed. An exception of the block comes out as itself."""
    channel = Channel(stream, max_frame, peer, silent_after)
    try:
        async with open_background_nursery() as nursery:
            nursery.start_soon(channel.run_writer)
            if heartbeat:
                nursery.start_soon(_send_heartbeats, channel)
            with trio.CancelScope() as body:
                nursery.start_soon(_watch_silence, channel, body)
                yield channel
            channel.close_after_flush()
            with trio.move_on_after(FLUSH_S):
                await channel.flushed.wait()
    finally:
        with trio.CancelScope(shield=True):
            await channel.aclose()


###############################################################################
# Bridge ######################################################################
###############################################################################
# One mission across clusters whose nodes cannot reach each other: the head and its
# workers meet through a rendezvous server both can reach, the bridge (``python grain.py
# bridge``, port 9555), in upstream's messages: a 4-byte big-endian length, then at most
# BRIDGE_PACKET bytes of ASCII "CMD,a,b". The head keeps one connection open ("INIT,
# label,"). A worker sends "SUBD,label,<its own ip:port>" and waits; the bridge tells the
# head "<the worker's address as the bridge sees it>|<its own>"; the head answers on a
# new connection "HEAD,<worker's public address>,<its own ip:port>", and the worker gets
# "<head public>|<head private>". Each side then listens on the port it spoke from and
# dials the other's two addresses from it (a simultaneous open, which crosses most
# NATs). The worker chooses the first stream that opens by sending CHOSEN on it; the
# head takes the stream that says so. When no stream opens within BRIDGE_DIRECT_S, both
# ask the bridge to relay ("RELAY,label,<the other's public address>", our own message)
# and it splices the two connections. On the chosen stream the grain handshake runs, and
# every write after it is sealed: the bridge sees the label (an HMAC of the URL's label
# under the key, never the key) and addresses, and a relay the frames' bytes (sealed, and
# encrypted only under TLS): it could read a job, never forge, alter or replay one.

BRIDGE_PORT = 9555
BRIDGE_PACKET = 1000      # bytes of one bridge message at most (upstream's limit)
BRIDGE_DIRECT_S = 3.0     # seconds to try the direct path before asking for a relay
BRIDGE_WAIT_S = 30.0      # seconds the bridge waits for a first message or a relay's half
BRIDGE_PUNCH_S = 0.5      # seconds between dials of the other side's addresses
BRIDGE_BACKOFF_S = 30.0   # the longest a head waits between tries to reach its bridge
CHOSEN = b"\x01"          # the worker's word on the stream it chose


def bridge_target(url, key):
    """``(host, port, label, options)`` of a bridge:// URL; the label is what the bridge
    sees: only holders of the key pair up, and the bridge never learns it."""
    name, host, port, options = _bridge_url(url)
    label = hmac.new(key, b"grain bridge label " + name.encode(), hashlib.sha256).hexdigest()[:32]
    return host, port, label, options


async def bridge_send(stream, text):
    await stream.send_all(encode_frame(text.encode("ascii")))


async def bridge_receive(stream):
    """The next bridge message; PeerError if it is cut short, too long or not ASCII."""
    (n,) = FRAME_HEADER.unpack(await _receive_exactly(stream, 4, "", PeerError))
    if n > BRIDGE_PACKET:
        raise PeerError(f"a message of {n} bytes (at most {BRIDGE_PACKET})")
    try:
        return (await _receive_exactly(stream, n, "inside a message", PeerError)).decode("ascii")
    except UnicodeDecodeError:
        raise PeerError("a message that is not ASCII") from None


async def _socket_from(port=0):
    """A TCP socket bound to our ``port``, which other sockets may share: a meeting's
    listener and its dials speak from one port, which a NAT maps once."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    await sock.bind(("0.0.0.0", port))
    return sock


async def _dial_from(port, host, to):
    sock = await _socket_from(port)
    try:
        infos = await trio.socket.getaddrinfo(host, to, socket.AF_INET, socket.SOCK_STREAM)
        await sock.connect(infos[0][4])
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _meet(host, port, label, options, other=None):
    """A stream to the other side of a meeting through the bridge at ``host:port`` (see the
    section), which says how it goes (``via``). A worker (``other`` None) asks for the
    head, gets its addresses in answer and chooses the stream; a head has the worker's
    (``other``), answers, and takes the stream the worker chose."""
    listener = await _socket_from()
    listener.listen(16)
    mine = listener.getsockname()[1]
    with listener:
        async with await _dial_from(mine, host, port) as to_bridge:
            ip = _ipv4_addresses().get(options["iface"]) if "iface" in options else None
            private = f"{ip or to_bridge.socket.getsockname()[0]}:{mine}"
            dialer = other is None
            await bridge_send(to_bridge, f"SUBD,{label},{private}" if dialer else
                              f"HEAD,{other[0]},{private}")
            if dialer:  # (no time limit: the head may come later; our caller has one)
                other = (await bridge_receive(to_bridge)).split("|")
        if len(other) != 2:
            raise PeerError(f"the bridge answered {'|'.join(other)!r:.60}, not two addresses")
        found, candidates = trio.open_memory_channel(math.inf)
        relay_only = options.get("direct") == "no"

        async def accept():
            with contextlib.suppress(OSError):
                while True:
                    found.send_nowait((trio.SocketStream((await listener.accept())[0]), "direct"))

        async def dial(address):
            h, _, p = address.rpartition(":")
            stream = await retry(lambda: _dial_from(mine, h, int(p)), (OSError, ValueError),
                                 BRIDGE_PUNCH_S)
            found.send_nowait((stream, "direct"))

        async def relay():
            await trio.sleep(0 if relay_only else BRIDGE_DIRECT_S)
            with contextlib.suppress(OSError, trio.BrokenResourceError):
                stream = await _dial_from(0, host, port)
                await bridge_send(stream, f"RELAY,{label},{other[0]}")
                found.send_nowait((stream, "relayed"))

        chosen = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            for address in () if relay_only else set(other):
                nursery.start_soon(dial, address)
            nursery.start_soon(relay)
            with trio.move_on_after(BRIDGE_DIRECT_S + BRIDGE_WAIT_S):
                chosen = await (_choose(candidates) if dialer else _chosen(candidates))
            nursery.cancel_scope.cancel()
    found.close()
    with contextlib.suppress(trio.EndOfChannel):
        while True:  # the streams that came too late
            await trio.aclose_forcefully(candidates.receive_nowait()[0])
    if chosen is None:
        raise PeerError(f"no stream to {other[0]}, direct or relayed, within "
                        f"{BRIDGE_DIRECT_S + BRIDGE_WAIT_S:g} s")
    stream, how = chosen
    stream.peer = other[0]
    stream.via = f"{how} through bridge {host}:{port}"
    return stream


async def _choose(candidates):
    """(The worker) the first stream that opens: say so on it."""
    async for stream, how in candidates:
        try:
            await stream.send_all(CHOSEN)
            return stream, how
        except (OSError, trio.BrokenResourceError):
            await trio.aclose_forcefully(stream)


async def _chosen(candidates):
    """(The head) the stream on which the worker says it chose it; the others close."""
    won = []
    async with trio.open_nursery() as nursery:
        async def hear(stream, how):
            with contextlib.suppress(OSError, trio.BrokenResourceError):
                if await stream.receive_some(1) == CHOSEN:
                    won.append((stream, how))
                    nursery.cancel_scope.cancel()
                    return
            await trio.aclose_forcefully(stream)

        async for candidate in candidates:
            nursery.start_soon(hear, *candidate)
    return won[0]


async def _serve_bridge(url, key, on_accept, task_status):
    """serve() for a bridge:// URL: keep our place on the bridge (back on it when it goes,
    after a growing pause while it cannot be reached) and meet each worker it announces."""
    host, port, label, options = bridge_target(url, key)

    async def meet(worker):
        try:
            stream = await _meet(host, port, label, options, worker)
        except (OSError, PeerError, trio.BrokenResourceError) as e:
            return log.warning("no path to the worker at %s through the bridge %s:%d: %s",
                               worker[0], host, port, e)
        async with stream:
            await on_accept(stream)

    async def on_the_bridge():  # (until it goes)
        async with await _dial_from(0, host, port) as stream:
            await bridge_send(stream, f"INIT,{label},")
            log.info("on the bridge %s:%d", host, port)
            try:
                while True:
                    nursery.start_soon(meet, (await bridge_receive(stream)).split("|"))
            except (OSError, PeerError, trio.BrokenResourceError) as e:
                log.warning("lost the bridge at %s:%d (%s)", host, port, e)

    def failed(e, pause):
        log.warning("cannot reach the bridge at %s:%d (%s); trying again in %g s",
                    host, port, getattr(e, "strerror", None) or e, pause)

    async with open_strict_nursery() as nursery:
        task_status.started({"bridge": url})  # (workers wait for us as for a late head)
        while True:
            await retry(on_the_bridge, (OSError, PeerError, trio.BrokenResourceError), 1.0,
                        BRIDGE_BACKOFF_S, failed)
            await trio.sleep(1.0)  # (lost: a bridge that closes at once is not redialled
            #                        in a tight loop)


async def _connect_bridge(url, key, wait):
    """connect() for a bridge:// URL: ask the bridge for the head, meet it, authenticate.
    Without ``wait``, a head must answer within CLI_TIMEOUT_S; with it, we wait for the
    head, and try the bridge again, after a growing pause, while it cannot be reached."""
    host, port, label, options = bridge_target(url, key)

    async def attempt():
        try:
            with trio.fail_after(math.inf if wait else CLI_TIMEOUT_S):
                stream = await _meet(host, port, label, options)
                try:
                    return await authenticate(stream, key, dialer=True)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError:
            raise Unreachable(f"no head answered through the bridge {host}:{port} within "
                              f"{CLI_TIMEOUT_S:g} s") from None

    def failed(e, pause):
        why = f"the bridge {host}:{port}: {getattr(e, 'strerror', None) or e}"
        if not wait:
            raise Unreachable(why) from None
        log.warning("%s; trying again in %g s", why, pause)

    return await retry(attempt, (OSError, PeerError, trio.BrokenResourceError), 1.0,
                       BRIDGE_BACKOFF_S, failed)


MORE_SCHEMES["bridge"] = (_serve_bridge, _connect_bridge)


class BridgeServer:
    """The rendezvous server: pairs the heads and workers of each label (see the section)
    and relays for those that find no direct path. It keeps nothing but who waits."""

    def __init__(self):
        self.heads = {}      # label -> the channel to the head serving it (the last INIT)
        self.waiting = {}    # label -> {worker's address: "address|private"}, headless
        self.answers = {}    # worker's address -> the channel its head's answer comes by
        self.paired = {}     # a head's address (its HEAD) -> its worker's, for RELAY
        self.relays = {}     # (label, worker's address) -> (stream, event): half a relay

    async def serve(self, url, *, task_status=TASK_STATUS_IGNORED):
        _, host, port = parse_url(url)
        try:
            listeners = await trio.open_tcp_listeners(port, host=host or None)
        except OSError as e:
            raise ListenError(f"cannot listen at {url}: {e.strerror or e}") from None
        port = listeners[0].socket.getsockname()[1]
        log.info("bridge listening at tcp://%s:%d", host, port)
        task_status.started(port)
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream):
        peer = _peer_name(stream)
        text = "?"
        try:
            with trio.fail_after(BRIDGE_WAIT_S):
                text = await bridge_receive(stream)
            command, label, rest = text.split(",", 2)
            act = {"INIT": self._head, "SUBD": self._worker, "HEAD": self._answer,
                   "RELAY": self._relay}[command]
        except trio.TooSlowError:
            return log.warning("bridge: %s said nothing for %g s", peer, BRIDGE_WAIT_S)
        except (ValueError, KeyError):
            return log.warning("bridge: %s sent %r, not a message it knows", peer, text[:60])
        except (OSError, PeerError, trio.BrokenResourceError) as e:
            return log.warning("bridge: %s: %s", peer, e)
        try:
            await act(stream, peer, label, rest)
        except Exception as e:  # its peer went mid-way: the bridge serves on
            log.info("bridge: %s went: %r", peer, lone_exception(e))

    async def _head(self, stream, peer, label, _):
        send, receive = trio.open_memory_channel(math.inf)
        if label in self.heads:  # a new head takes over; the old one hears no more
            self.heads[label].close()
        self.heads[label] = send
        log.info("bridge: head %s... at %s", label[:8], peer)
        for text in self.waiting.pop(label, {}).values():
            send.send_nowait(text)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, stream, None, nursery.cancel_scope)
                async for text in receive:
                    await bridge_send(stream, text)
        finally:
            if self.heads.get(label) is send:
                del self.heads[label]
            log.info("bridge: head %s... at %s is gone", label[:8], peer)

    async def _worker(self, stream, peer, label, private):
        send, receive = trio.open_memory_channel(1)
        self.answers[peer] = send
        if label in self.heads:
            self.heads[label].send_nowait(f"{peer}|{private}")
        else:
            self.waiting.setdefault(label, {})[peer] = f"{peer}|{private}"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, stream, None, nursery.cancel_scope)
                answer = await receive.receive()
                await bridge_send(stream, answer)
                log.info("bridge: worker %s meets head %s... at %s", peer, label[:8],
                         answer.split("|")[0])
                nursery.cancel_scope.cancel()
        finally:
            self.answers.pop(peer, None)
            self.waiting.get(label, {}).pop(peer, None)

    async def _answer(self, stream, peer, worker, private):
        try:
            self.answers[worker].send_nowait(f"{peer}|{private}")
        except (KeyError, trio.WouldBlock):
            return log.warning("bridge: %s answered %s, who waits for no answer", peer,
                               worker[:60])
        self.paired[peer] = worker
        while len(self.paired) > 10000:  # (kept for the RELAY that may follow, not forever)
            del self.paired[next(iter(self.paired))]

    async def _relay(self, stream, peer, label, other):
        slot = (label, self.paired.get(other, other))
        if slot not in self.relays:
            self.relays[slot] = (stream, trio.Event())
            with trio.move_on_after(BRIDGE_WAIT_S):
                await self.relays[slot][1].wait()
            if self.relays.get(slot, (None,))[0] is stream:
                del self.relays[slot]
                log.warning("bridge: %s waited for a relay that nobody joined", peer)
            return
        half, done = self.relays.pop(slot)
        log.info("bridge: relaying between %s and %s", _peer_name(half), peer)
        try:
            async with trio.open_nursery() as nursery:
                for a, b in ((half, stream), (stream, half)):
                    nursery.start_soon(self._pump, a, b, nursery.cancel_scope)
        finally:
            done.set()

    @staticmethod
    async def _pump(source, sink, scope):
        """Copy what ``source`` sends to ``sink`` (None: drop it, only waiting for the close)
        until ``source`` closes, then cancel ``scope``."""
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some(1 << 16):
                if sink is not None:
                    await sink.send_all(data)
        scope.cancel()


###############################################################################
# Subprocesses ################################################################
###############################################################################
# A job's external programs: ``run_program`` starts one pinned to the job's cores, with
# its allocation in the environment (``job_env``: CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS,
# ...), in a process group of its own that goes with the job (cancelled, past its T).
#
# @subprocify runs a sync, CPU-bound function in a separate Python process so it
# neither holds the GIL nor blocks the trio loop. Pool processes are this same file
# started as ``grain.py _subproc``; they are spawned on demand, reused, and shut
# down after SUBPROC_IDLE_S idle. Each call is pinned to the cores in GVAR.res.
#
# Pipes: the parent writes job frames to the child's stdin and reads results from a
# private pipe (fd passed to the child), so that whatever the job prints goes to
# the inherited stdout/stderr as the user expects. Each child leads a process group of
# its own, and is stopped with the whole group: a program a job started goes with it.


GPU_VARIABLES = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_ENVIRON = {}  # os.environ as it was last read: its "bytes", and as "text"


def _environ():
    """os.environ as text, read anew only when it changed: decoding it whole was a tenth of
    the event loop's time a program (a mission may still set a variable between two)."""
    raw = getattr(os.environ, "_data", None)  # (CPython's own: the variables, as bytes)
    if raw is None:
        return os.environ
    if raw != _ENVIRON.get("bytes"):
        _ENVIRON.update(bytes=dict(raw), text=dict(os.environ))
    return _ENVIRON["text"]


def job_env(env=None, res=None):
    """The environment a program of this job should get: ``env`` (default: this process's)
    with the job's GPUs in CUDA_VISIBLE_DEVICES (ROCR_VISIBLE_DEVICES on AMD) and its core
    count in OMP_NUM_THREADS, MKL_NUM_THREADS and OPENBLAS_NUM_THREADS. ``res``: the
    allocation (default GVAR.res). A job without Gpus leaves the GPU variables alone."""
    env = dict(_environ() if env is None else env)
    res = _RES.get() if res is None else res
    if res is None:
        return env
    cores = _part(res, "Cores")
    gpus = _part(res, "Gpus")
    if cores is not None and cores.N:
        env.update(dict.fromkeys(THREAD_VARIABLES, str(cores.N)))
    if gpus is not None and gpus.ids is not None:
        env[GPU_VARIABLES.get(gpus.vendor, "CUDA_VISIBLE_DEVICES")] = ",".join(gpus.ids)
    return env


def _real_cores(res):
    """The ids of ``res``'s cores this process may pin to (oversubscribed ones are not)."""
    cores = _part(res, "Cores") if res is not None else None
    return sorted(set(cores.c).intersection(_allowed_cores())) if cores is not None else []


class ProgramError(GrainError):
    """A program started by run_program exited with a non-zero status: ``returncode`` and
    the end of what it wrote to stderr (``stderr_tail``)."""

    def __init__(self, cmd, returncode, stderr_tail=""):
        super().__init__(cmd, returncode, stderr_tail)
        self.cmd = cmd
        self.returncode = returncode
        self.stderr_tail = stderr_tail

    def __str__(self):
        name = self.cmd if isinstance(self.cmd, str) else shlex.join(map(str, self.cmd))
        how = (f"was killed by {signal.Signals(-self.returncode).name}"
               if self.returncode < 0 else f"exited with status {self.returncode}")
        tail = f"; the end of its stderr:\n{self.stderr_tail}" if self.stderr_tail else ""
        return f"{name} {how}{tail}"


class _Spawned:
    """A program started by posix_spawn, with what run_program uses of a Popen: ``pid``,
    the pipes it writes (``stdout``, ``stderr``: PIPE asked for them), poll() and wait()."""

    returncode = stdin = stdout = stderr = None

    def __init__(self, cmd, options):
        argv = ["/bin/sh", "-c", cmd] if options["shell"] else \
            [cmd] if isinstance(cmd, (bytes, os.PathLike)) else list(cmd)
        actions = []
        ends = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            if options[name] == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(w)
                actions.append((os.POSIX_SPAWN_DUP2, w, fd))
                setattr(self, name, open(r, "rb", buffering=0))
        try:  # (signals Python ignores are the program's to have: `yes | head` ends)
            self.pid = os.posix_spawnp(argv[0], argv, options["env"], file_actions=actions,
                                       setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        except BaseException:
            for f in (self.stdout, self.stderr):
                f and f.close()
            raise
        finally:
            for w in ends:
                os.close(w)

    def poll(self, flags=os.WNOHANG):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        return self.poll(0)


# Whether posix_spawn can start a program in a session of its own: not in a CPython built
# against glibc headers older than 2.26 (NotImplementedError), as some portable builds are.
_SPAWN_SETSID = [True]


def _start_pinned(cmd, pin, options):
    """Start a program from a thread whose cores are ``pin`` (if any) while it starts it:
    the child inherits them. (A preexec_fn would pin it too, but makes CPython fork the
    whole process, not vfork it: five times the cost of a start.) posix_spawn, C's vfork
    and exec, costs a fifth less than Popen's Python; Popen takes what it does not do (a
    cwd, a stdin, output to files, a PATH of the program's own)."""
    mask = pin and os.sched_getaffinity(0)
    if pin:
        os.sched_setaffinity(0, pin)
    try:
        if (options["cwd"] is None and options["stdin"] is None and _SPAWN_SETSID
                and options["stdout"] in (None, subprocess.PIPE)
                and options["stderr"] == subprocess.PIPE
                and options["env"].get("PATH") == os.environ.get("PATH")):
            with contextlib.suppress(NotImplementedError):  # (see _SPAWN_SETSID)
                return _Spawned(cmd, options)
            _SPAWN_SETSID.clear()
        return subprocess.Popen(cmd, **options)
    finally:
        if pin:  # (the thread is trio's, and serves other calls next)
            os.sched_setaffinity(0, mask)


def _forward(stream, text):
    """Write ``text`` to ``stream`` (the mission's stderr); ``stream``, or None when it
    is closed (`python mission.py 2>&1 | head`): the program's output is still read."""
    try:
        stream.write(text)
        stream.flush()
        return stream
    except (OSError, ValueError):
        return None


async def _in_thread(fn, *args):
    """``fn(*args)`` in a thread of trio's cache, in (a copy of) the caller's context; a
    cancelled caller goes on without it (the result, when it comes, is dropped). Not
    trio.to_thread.run_sync: its capacity limiter and its checkpoints cost a tenth of a
    program's start, for the many programs of a worker, and no limit is wanted (the job's
    cores are the limit)."""
    await trio.lowlevel.checkpoint_if_cancelled()
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    waiting = [True]  # (False once the caller went on: cancelled, or given the result)

    def deliver(outcome):  # (in trio, soon after the thread ended)
        if waiting[0]:
            waiting[0] = False
            trio.lowlevel.reschedule(task, outcome)

    def done(outcome):  # (in the thread)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(deliver, outcome)

    def abort(_):
        waiting[0] = False
        return trio.lowlevel.Abort.SUCCEEDED
    # (the context: where a local job's output goes, _OUTPUT, is the job's in the thread too)
    trio.lowlevel.start_thread_soon(functools.partial(
        contextvars.copy_context().run, fn, *args), done)
    return await trio.lowlevel.wait_task_rescheduled(abort)


class _Program:
    """One program of run_program's, run from start to end by a thread of its own, which
    reads its pipes and reaps it: trio wakes once a program, not once a pipe and once for
    its exit. The job's task only stops it (``_stop_process``): it sets ``cancelled`` (which the
    thread heeds if the program is not started yet), signals ``pid``'s group, and waits
    for ``ended``."""

    stdin = stdout = pid = None
    cancelled = started = ended = False

    def run(self, cmd, pin, options, forward):
        """In the thread: start the program, read its pipes to their end (``forward``:
        the text stream stderr also goes to as it comes), wait for it. Returns its exit
        status and what its pipes gave."""
        self.started = True
        try:
            if self.cancelled:  # (the job was cancelled before this thread began)
                return None
            popen = _start_pinned(cmd, pin, options)
            self.pid = popen.pid
            try:
                return self._follow(popen, forward)
            except BaseException:  # (a bug, or a signal: the program goes, reaped)
                with contextlib.suppress(OSError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
                raise
            finally:
                for f in (popen.stdin, popen.stdout, popen.stderr):
                    f and f.close()
        finally:
            self.ended = True

    def _follow(self, popen, forward):
        """Read the pipes of the started program ``popen`` to their end, then reap it."""
        if popen.stdin is not None:  # (stdin=PIPE: the program reads an empty input)
            popen.stdin.close()
        if self.cancelled:  # (the job was cancelled as the program started)
            os.killpg(popen.pid, signal.SIGKILL)
        out, err = (f and f.fileno() for f in (popen.stdout, popen.stderr))
        kept = {fd: bytearray() for fd in (out, err) if fd is not None}
        pipes = select.poll()  # (not selectors' epoll: a file descriptor a program)
        for fd in kept:
            pipes.register(fd, select.POLLIN)
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        # A child of the program's that keeps a pipe open is not waited for: what came
        # FLUSH_S after the program's exit is what there is.
        end = math.inf
        reading = len(kept)
        while reading and time.monotonic() < end:
            for fd, _ in pipes.poll(PIPE_CHECK_S * 1000):
                if not (chunk := os.read(fd, 65536)):
                    pipes.unregister(fd)
                    reading -= 1
                elif fd == err and forward is not None:
                    del kept[fd][:-STDERR_TAIL]  # (forwarded: only its end is kept)
                    forward = _forward(forward, decode(chunk))
                kept[fd] += chunk
            if end == math.inf and popen.poll() is not None:
                end = time.monotonic() + FLUSH_S
        if forward is not None:
            _forward(forward, decode(b"", final=True))  # (a cut-off last character)
        return popen.wait(), kept.get(out), kept.get(err, b"")

    async def wait(self):
        for pause in pauses(0.001, 0.1):  # (only a cancelled program is waited for so)
            if not self.started or self.ended:
                return
            await trio.sleep(pause)


async def run_program(cmd, *, cwd=None, stdin=None, stdout=None, stderr=None, check=True,
                      env=None):
    """Run an external program as this job's: pinned to its cores, with ``job_env(env)``,
    in a process group of its own that is stopped whole (SIGTERM, KILL_GRACE_S, SIGKILL)
    when the job is cancelled or passes its T. ``cmd``: an argument list, or a string for
    the shell. ``stdout``/``stderr``: None (this process's; stderr is also kept), PIPE
    (captured, returned) or a file. Returns a subprocess.CompletedProcess; with ``check``,
    a non-zero exit raises ProgramError with the end of its stderr."""
    pipe = subprocess.PIPE
    options = dict(shell=isinstance(cmd, str), cwd=cwd, env=job_env(env), stdout=stdout,
                   stdin=stdin, stderr=pipe if stderr is None else stderr,
                   start_new_session=True)
    program = _Program()
    try:
        code, out, err = await _in_thread(program.run, cmd, _real_cores(_RES.get()), options,
                                          sys.stderr if stderr is None else None)
    except BaseException:
        program.cancelled = True
        await _stop_process(program)
        raise
    tail = err[-STDERR_TAIL:].decode(errors="replace").strip()
    if check and code != 0:
        raise ProgramError(cmd, code, tail)
    return subprocess.CompletedProcess(cmd, code, bytes(out) if stdout == pipe else None,
                                       bytes(err) if stderr == pipe else None)


def _child_die_with_parent():
    """End this pool process, and the programs its jobs started (its process group), when
    its parent dies, even mid-job: no orphan runs on. (Not Linux's PR_SET_PDEATHSIG: it
    fires when the parent *thread* ends, and trio starts processes from worker threads
    that end after 10 s idle.)"""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        if os.getpgrp() == os.getpid():  # (its own group, as the pool starts it: not another's)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="grain-parent-watch", daemon=True).start()


def _subproc_child_main(result_fd):
    """Body of a pool process: read jobs from stdin, write results to ``result_fd``. The
    programs its jobs start inherit neither: their stdin is /dev/null."""
    _child_die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us on Ctrl-C
    inp = os.fdopen(os.dup(0), "rb")  # (dup: not inheritable)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.set_inheritable(result_fd, False)
    out = os.fdopen(result_fd, "wb", buffering=0)
    home = None
    with contextlib.suppress(OSError):  # (its directory was deleted: it stays where it is)
        home = os.getcwd()
    pinning = hasattr(os, "sched_setaffinity")  # (Linux)
    allowed = os.sched_getaffinity(0) if pinning else None

    def read_frame():
        head = inp.read(4)
        if len(head) < 4:
            return None
        (size,) = FRAME_HEADER.unpack(head)
        return inp.read(size)

    too_slow = trio.TooSlowError  # imports trio now, not in the signal handler, late

    def on_alarm(signum, frame):
        raise too_slow("the job ran past its walltime T")

    signal.signal(signal.SIGALRM, on_alarm)
    if (init := read_frame()) is None:
        return 0
    sys.path[:] = pickle.loads(init)
    environ = dict(os.environ)
    # Upstream's pool process binds GVAR where the script's functions look names up, and
    # scripts written for it read GVAR.res without importing it. A function of the script
    # comes here by value with only the globals it found there: a builtin is seen by all.
    builtins.GVAR = GVAR
    while (frame := read_frame()) is not None:
        try:
            fn, args, kwargs, res, instance, cores, timeout = dill.loads(frame)
            _RES.set(res)
            _INSTANCE.set(instance)
            os.environ.clear()  # this call's allocation, not the last one's
            os.environ.update(job_env(environ, res))
            if pinning:
                os.sched_setaffinity(0, cores or allowed)
            if home is not None:
                os.chdir(home)
            if timeout is not None:
                signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-3))
            try:
                reply = (True, fn(*args, **kwargs))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                for stream in (sys.stdout, sys.stderr):  # the job's prints, now, not at exit
                    with contextlib.suppress(Exception):
                        stream.flush()
            payload = dill.dumps(reply)
        except BaseException as e:  # report everything, even SystemExit, to the caller
            payload = pickled_failure(e, traceback.format_exc(),
                                      lambda v: dill.dumps((False, v)), dill.loads)
        out.write(encode_frame(payload))
    return 0


async def _stop_process(process, grace=KILL_GRACE_S):
    """SIGTERM to its process group, a grace period, SIGKILL to the group; always reaped.
    Shielded: runs even when cancelled. (The group outlives its leader: it is signalled
    even when the leader has exited already.)"""
    with trio.CancelScope(shield=True):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.killpg(process.pid, sig)  # (TypeError: a program not started yet)
            with trio.move_on_after(grace if sig == signal.SIGTERM else math.inf):
                await process.wait()
        for stream in filter(None, (process.stdin, process.stdout)):
            with contextlib.suppress(Exception):
                await stream.aclose()


class SubprocessPool:
    """Processes for @subprocify calls, at most ``limit`` at once (default: the cores this
    process may use)."""

    def __init__(self, nursery, limit=None):
        self.limit = limit or len(_allowed_cores())  # (``nursery``: upstream's signature)
        self._idle = []  # pool processes (see _spawn), most recently used last
        self._all = set()  # the processes, idle or busy
        self._slots = trio.Semaphore(self.limit)

    async def _spawn(self):
        r, w = os.pipe()
        try:
            process = await trio.lowlevel.open_process(
                self_argv("_subproc", str(w)), stdin=subprocess.PIPE, pass_fds=(w,),
                start_new_session=True)  # its process group: see _stop_process
        finally:
            os.close(w)
        frames = FrameStream(process.stdin, trio.lowlevel.FdStream(r))
        child = types.SimpleNamespace(process=process, frames=frames, idle_since=0.0)
        self._all.add(process)
        try:
            await frames.send(pickle.dumps(sys.path))
        except BaseException:  # (cancelled: not to be left running, nobody's)
            self._all.discard(child.process)
            await _stop_process(child.process)
            raise
        return child

    async def call(self, fn, args, kwargs, res, instance, cores, timeout):
        # recurse=True: a function from __main__ carries the globals it uses, not a
        # reference to a __main__ the child does not have.
        payload = dill_dumps((fn, args, kwargs, res, instance, cores, timeout))
        async with self._slots:
            child = self._idle.pop() if self._idle else None
            frame = None
            try:
                if child is None:
                    child = await self._spawn()
                await child.frames.send(payload)
                frame = await child.frames.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
                pass
            finally:
                if frame is None and child is not None:  # died, or cancelled: it is spent
                    self._all.discard(child.process)
                    await _stop_process(child.process)
            if child is None:
                raise BrokenSubprocessError(f"a pool process for {_callable_name(fn)} ended "
                                            "as it started")
            if frame is None:
                code = child.process.returncode
                how = (f"killed by signal {-code}" if code is not None and code < 0
                       else f"exited with code {code}")
                raise BrokenSubprocessError(
                    f"pool process {child.process.pid} running {_callable_name(fn)} {how}")
            child.idle_since = _now()
            self._idle.append(child)
        success, value = dill.loads(frame)
        if success:
            return value
        exc, tb = value
        add_note(exc, f"Traceback in pool process {child.process.pid}:\n{tb.rstrip()}")
        raise exc

    def statistics(self):
        """PoolStatistics: the pids of its processes, how many are idle, the limit."""
        return PoolStatistics(sorted(p.pid for p in self._all), len(self._idle), self.limit)

    async def _reap_idle(self):
        while True:
            await trio.sleep(min(SUBPROC_IDLE_S, SUBPROC_REAP_S))
            cutoff = _now() - SUBPROC_IDLE_S
            old = [c for c in self._idle if c.idle_since <= cutoff]
            self._idle[:] = [c for c in self._idle if c.idle_since > cutoff]
            for child in old:
                await _stop_process(child.process)
                self._all.discard(child.process)  # (after: statistics() shows it until it is gone)

    async def aclose(self):
        processes = list(self._all)
        self._all = set()
        self._idle = []
        with trio.CancelScope(shield=True):
            for process in processes:
                # Closing stdin ends an idle child at once; a busy one gets SIGTERM.
                with contextlib.suppress(Exception):
                    await process.stdin.aclose()
            for process in processes:
                await _stop_process(process)


PoolStatistics = namedtuple("PoolStatistics", "pids idle limit")


@contextlib.asynccontextmanager
async def subprocess_pool_scope(limit=None):
    """Open the subprocess pool for the current run; a no-op when one is already open.

    Use it in a mission's main function, or in a worker's ``grain_context()``."""
    rt = _RUNTIME.get()
    if rt is not None and rt.pool is not None:
        yield rt.pool
        return
    token = None
    if rt is None:  # plain trio.run: a runtime of our own for this task and its children
        rt = _Runtime()
        token = _RUNTIME.set(rt)
    try:
        async with open_background_nursery() as nursery:
            pool = SubprocessPool(nursery, limit)
            nursery.start_soon(pool._reap_idle)
            rt.pool = pool
            try:
                yield pool
            except BaseException:
                # Left by Ctrl-C or an error while the mission's jobs may still run in it: it
                # closes once the mission has cancelled them. (Closed first, it would fail
                # them, their processes gone, then the pool, and a results store keep that.)
                if rt.executor is not None:
                    rt.executor.after_jobs.push_async_callback(pool.aclose)
                    pool = None
                raise
            finally:
                if pool is not None:
                    rt.pool = None
                    await pool.aclose()
    finally:
        if token is not None:
            _RUNTIME.reset(token)


class Subprocified:
    """A sync function turned into an async job that runs in the subprocess pool."""

    _grain_async = True

    def __init__(self, fn):
        if inspect.iscoroutinefunction(fn):
            raise TypeError(f"@subprocify wraps sync functions; {_callable_name(fn)} is async")
        self.fn = fn
        functools.update_wrapper(self, fn)

    async def __call__(self, *args, **kwargs):
        rt = _RUNTIME.get()
        if rt is None or rt.pool is None:
            raise RuntimeError(
                f"{_callable_name(self.fn)} is @subprocify'd: call it inside "
                "`async with subprocess_pool_scope():` (or a worker's grain_context)")
        res = _RES.get()
        cores = _part(res, "Cores")
        if cores is None or not cores.c:
            raise RuntimeError(
                f"{_callable_name(self.fn)} is @subprocify'd and needs at least one core, but "
                f"its job holds {res!r}: submit it with Cores(1) or more")
        pin = _real_cores(res)  # virtual (oversubscribed) ids pin nothing
        deadline = trio.current_effective_deadline() - SUBPROC_MARGIN_S
        timeout = None if deadline == math.inf else deadline - _now()
        return await rt.pool.call(self.fn, args, kwargs, res, _INSTANCE.get(), pin, timeout)

    def __repr__(self):
        return f"<subprocified {_callable_name(self.fn)}>"


def subprocify(fn):
    """Decorator: run this sync (CPU-bound) function in a pool process, as an async job."""
    return Subprocified(fn)


###############################################################################
# Config ######################################################################
###############################################################################
# grain.toml, parsed into frozen dataclasses: top-level keys may be overridden in
# [head] or [worker], and [script] key by key in [head.script] or [worker.script];
# ``Config.role("worker")`` gives the merged view. Upstream Grain's files are read as
# they are ([head.gnaw], specialized_type, custom_system.directory); a key grain.py
# does not know is still an error naming the file and the key.

class ConfigError(UsageError):
    """grain.toml is malformed, or a key has the wrong type or value."""


def _want(test, expected, convert=None):
    """A key's check: its value, converted, or TypeError(``expected``)."""
    def check(v):
        if not test(v):
            raise TypeError(expected)
        return convert(v) if convert else v
    return check


_want_str = _want(lambda v: isinstance(v, str), "a string")
_want_count = _want(lambda v: _is_number(v, int) and v >= 0, "a whole number >= 0")
# upstream's examples write queue = "''" for "the default queue"
_want_queue = _want(lambda v: isinstance(v, str), "a string",
                    lambda v: "" if v in ("''", '""') else v)
SYSTEMS = {}  # the batch systems by name, as data: filled in by the Cluster section


def _want_system(v):
    if v != "" and v not in SYSTEMS:
        raise TypeError("one of " + ", ".join(map(repr, SYSTEMS)) + " (or \"\" for none)")
    return v


def _want_walltime(v):
    try:
        return 0 if v == "" else parse_walltime(v)  # its seconds ("", 0: do not ask)
    except ValueError:
        raise TypeError("a walltime [d-]hh:mm:ss (\"\": do not ask)") from None


def _want_address(v):
    """An address as parse_url reads it once $VARIABLES are set in ("": the default), so a
    typo is said before `up` submits a worker that could only fail with it."""
    if _want_str(v):
        try:
            parse_url(os.path.expandvars(v))
        except ValueError:
            raise TypeError("tcp://host:port, unix:///path, edge:///abs/path or "
                            "bridge://LABEL@HOST:PORT") from None
    return v


def _want_str_list(v):
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TypeError("a list of strings")
    return tuple(v)


def _want_duration(v):
    try:
        return parse_duration(v, "duration")
    except ValueError:
        raise TypeError("a duration such as 90s, 30m or 2h") from None


def _want_resources(v):
    if not isinstance(v, dict):
        raise TypeError("a table of resources, e.g. { Token = { token = \"gpu\" } }")
    try:
        Resource.from_dict(v)
    except ValueError as e:
        raise TypeError(f"resources in the dict form ({e})") from None
    return dict(v)


# A key's check, by its field's type, unless the field names its own.
_CHECKS = {str: _want_str, int: _want_count, float: _want_duration, tuple: _want_str_list,
           dict: _want_resources, bool: _want(lambda v: isinstance(v, bool), "true or false")}


def setting(default, check=None, tables=(), path=False):
    """A field of the config: its default, its check (None: by its type), the tables of
    grain.toml where it is a key (RoleSettings: "" the top level, "head", "worker"), and
    whether it is a path ("$HOME/..." and "~/..." mean what they say)."""
    default = {"default_factory": dict} if isinstance(default, dict) else {"default": default}
    return field(**default, metadata={"check": check, "tables": tables, "path": path})


_ALL = ("", "head", "worker")
_HEAD = ("head",)
_WORKER = ("worker",)
_ROLES = ("head", "worker")


@dataclass(frozen=True)
class ScriptSettings:
    """What a job script asks of the batch system, and how it sets up and cleans up."""
    shebang: str = "#!/bin/bash"
    queue: str = setting("", _want_queue)
    walltime: float = setting(0, _want_walltime)  # seconds; 0: do not ask (its default)
    cores: int = 0
    gpus: int = 0        # whole GPUs of the node to ask for (0: none)
    memory: float = setting(0, _want(lambda v: _is_number(v) and 0 <= v < math.inf,
                                     "a number of GB >= 0 (0: do not ask)"))  # GB
    extra_args: tuple = ()
    setup_cleanup: str = ""
    python: str = ""  # "" = the interpreter running `up`
    parallel_env: str = "smp"  # Grid Engine's parallel environment of `-pe NAME cores`
    array: bool = False  # several workers at once: one array job (where the system has them)
    max_submit_rate: float = setting(0.0, _want(lambda v: _is_number(v) and v >= 0, "a number"
                                                " of submissions a second >= 0 (0: no limit)"))
    max_queued: int = 0  # worker jobs submitted and not joined, at most (0: no limit)


@dataclass(frozen=True)
class CustomSystem:
    submit_cmd: str = ""
    directive: str = "#$"
    template: str = ""
    status_cmd: str = ""   # + job id; exit 0 while the job is queued or running
    cancel_cmd: str = ""   # + job id


@dataclass(frozen=True)
class RoleSettings:
    """The merged settings of one role (head or worker)."""
    role: str
    system: str = setting("", _want_system, _ALL)
    address: str = setting("", _want_address, _ALL, path=True)
    auth_key: str = setting("", None, _ALL, path=True)
    tls_cert: str = setting("", None, _ALL, path=True)  # "": no TLS (see load_auth_key)
    tls_key: str = setting("", None, _ALL, path=True)   # "": in the tls_cert file
    contextmod: str = setting("", None, _ALL, path=True)
    name: str = setting("", None, _ROLES)
    log_file: str = setting("", None, _ROLES, path=True)  # [head]: where local jobs print
    script: ScriptSettings = field(default_factory=ScriptSettings)
    custom_system: CustomSystem = field(default_factory=CustomSystem)
    # [head]
    main_log_file: str = setting("", None, _HEAD, path=True)   # the head job's (`start`)
    listen: str = setting("", _want_address, _HEAD, path=True)
    cmd: str = setting("", None, _HEAD)
    idle_quit: float = setting(1800.0, None, _HEAD)
    swarm: int = setting(0, None, _HEAD)
    swarm_quota: int = setting(0, None, _HEAD)  # submissions per swarm_window; 0: 2 x swarm
    swarm_window: float = setting(600.0, None, _HEAD)
    gnaw_enabled: bool = True     # [head.gnaw] enabled: missions share a head daemon
    daemon_log: str = setting("grain-head-{{HHMMSS}}.log", path=True)  # [head.gnaw] log_file
    max_missions: int = setting(8, _want(lambda v: _is_number(v, int) and v > 0,
                                         "a positive whole number"))  # [head.gnaw] max_conn
    daemon_extra_args: tuple = ()  # [head.gnaw] extra_args: flags of upstream's Go daemon
    # [worker]
    dial: str = setting("", _want_address, _WORKER, path=True)
    cli_dial: str = setting("", _want_address, _WORKER, path=True)
    res: dict = setting({}, None, _WORKER)
    specialized_type: str = setting("", None, _WORKER)  # a module: see specialized workers
    wrap: str = setting("", None, _WORKER)  # the worker's command runs inside this container
    reattach: float = setting(REATTACH_S, None, _WORKER)  # a headless worker keeps its jobs
    results: str = setting("", None, _ALL)  # a mission's results store (relative: to its dir)
    report: str = setting("", None, _ALL)   # a mission's HTML report, at its end (ditto)


# Upstream Grain's names of keys, by table: its [head.gnaw] (its Go daemon: our head
# daemon) and custom_system.directory.
_RENAMED = {"custom_system": {"directory": "directive"},
            "head.gnaw": {"enabled": "gnaw_enabled", "log_file": "daemon_log",
                          "max_conn": "max_missions", "idle_quit": "idle_quit",
                          "swarm": "swarm", "extra_args": "daemon_extra_args"}}
_SUBTABLES = {"": ("script", "custom_system", "head", "worker"), "head": ("script", "gnaw"),
              "worker": ("script",)}
_ROLE_DEFAULTS = {"head": {"name": "grain-head", "main_log_file": "grain-head-job-{{HHMMSS}}.log"},
                  "worker": {"name": "grain-worker", "log_file": "grain-worker-{{HHMMSS}}.log"}}


def _schema(table):
    """``{key: (field, check)}`` of a table of grain.toml ("": the top level)."""
    cls = {"script": ScriptSettings, "custom_system": CustomSystem}.get(
        table.rpartition(".")[2], RoleSettings)
    fs = {f.name: f for f in fields(cls)}
    keys = {name: name for name, f in fs.items()
            if cls is not RoleSettings or table in f.metadata.get("tables", ())}
    keys.update(_RENAMED.get(table, {}))
    return {k: (name, fs[name].metadata.get("check") or _CHECKS[fs[name].type])
            for k, name in keys.items()}


def default_address():
    home = os.path.expanduser("~")
    return f"edge://{os.path.join(home, '.local', 'share', 'edge-file-default')}"


@dataclass(frozen=True)
class Config:
    """A parsed grain.toml (or the defaults). ``path`` is None for the defaults."""
    path: str = None
    raw: dict = field(default_factory=dict)

    def role(self, role):
        """The settings of ``role`` ("head" or "worker"), every override applied."""
        top = self.raw
        sect = self.raw.get(role, {})
        values = dict(_ROLE_DEFAULTS[role])
        values.update({k: v for k, v in top.items() if k not in _SUBTABLES[""]})
        values.update({k: v for k, v in sect.get("gnaw", {}).items()
                       if v != ""})  # ([head.gnaw] log_file = "": our default file)
        values.update({k: v for k, v in sect.items() if k not in _SUBTABLES[role]})
        values["script"] = ScriptSettings(**{**top.get("script", {}), **sect.get("script", {})})
        values["custom_system"] = CustomSystem(**top.get("custom_system", {}))
        for f in fields(RoleSettings):
            if f.metadata.get("path") and isinstance(values.get(f.name), str):
                values[f.name] = os.path.expanduser(os.path.expandvars(values[f.name]))
        s = RoleSettings(role=role, **values)
        address = s.address or default_address()
        dial = s.dial or address
        return replace(s, address=address, listen=s.listen or address, dial=dial,
                       cli_dial=s.cli_dial or dial, auth_key=s.auth_key or default_key_path(),
                       script=replace(s.script, python=s.script.python or (
                           "python3" if s.wrap else sys.executable)))  # (the container's)


def _check_table(data, table, path):
    """The keys of ``table`` in ``data``, checked, by their field's names."""
    schema = _schema(table)
    subtables = _SUBTABLES.get(table, ())
    out = {}
    for k, value in data.items():
        name = f"{table}.{k}" if table else k
        if k in subtables:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{name}] must be a table")
            out[k] = _check_table(value, name, path)
            continue
        if k not in schema:
            known = sorted(list(schema) + list(subtables))
            raise ConfigError(f"{path}: unknown key {name!r}"
                              f"{_did_you_mean(k, known, name[:-len(k)])} (known here: "
                              f"{', '.join(known)})")
        field_name, check = schema[k]
        try:
            value = check(value)
        except TypeError as e:
            raise ConfigError(f"{path}: {name}: expected {e}, got {value!r}") from None
        if k == field_name:
            out[k] = value
        else:  # upstream's name: ours wins when both are given
            out.setdefault(field_name, value)
    return out


def parse_config(text, path="grain.toml"):
    """A Config from TOML text; ConfigError names the file, the key (or line and column)
    and what was expected."""
    if tomllib is None:
        raise ConfigError(f"{path}: reading TOML on Python < 3.11 needs tomli "
                          "(`python -m pip install tomli`, or use grain.pyz)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    return Config(path=path, raw=_check_table(data, "", path))


def find_config_path(config_file=None):
    """``-c PATH``, else $GRAIN_CONFIG, else ./grain.toml; None when none exists."""
    if config_file:
        if not os.path.isfile(config_file):
            raise ConfigError(f"config file {config_file} " + (
                "is a directory" if os.path.isdir(config_file) else "does not exist"))
        return os.path.abspath(config_file)
    if env := os.environ.get("GRAIN_CONFIG"):
        if not os.path.isfile(env):
            raise ConfigError(f"GRAIN_CONFIG={env}: no such file")
        return os.path.abspath(env)
    return os.path.abspath("grain.toml") if os.path.isfile("grain.toml") else None


def load_config(config_file=None):
    """The config for ``config_file`` (a path, None to look for one, False for defaults)."""
    if config_file is False:
        log.debug("Config file is disabled, using default settings.")
        return Config()
    path = find_config_path(config_file)
    if path is None:
        log.debug("No config file (./grain.toml or $GRAIN_CONFIG); using default settings.")
        return Config()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = f"not UTF-8 text ({e.reason} at byte {e.start})" if isinstance(
            e, UnicodeDecodeError) else e.strerror or str(e)
        raise ConfigError(f"{path}: cannot be read: {why}") from None
    return parse_config(text, path)


###############################################################################
# Cluster #####################################################################
###############################################################################
# The batch systems, as data: SYSTEMS holds, for each, the job script's directives, how
# to submit, cancel and ask about jobs, how a job learns its id and when its allocation
# ends. render_script() is pure; submit_script() runs the submission and checks what it
# says. Every submitted job is recorded in a small JSON file beside the Edge file
# (JobBook), so `ls` and `down` find them even after a head crashed. A query that fails
# means UNKNOWN, never ENDED: a busy controller must not make live jobs look dead.

# batch states: the job is gone / nobody could say
ENDED = "ENDED"
UNKNOWN = "UNKNOWN"


def _directive_values(s, name, log):
    """What the directives of SYSTEMS name, from script settings ``s``; a falsy value is
    not asked for (the batch system's default applies)."""
    seconds = s.walltime
    minutes = math.ceil(seconds / 60)
    mb = max(1, int(s.memory * 1024)) if s.memory else 0
    return dict(name=name, log=log, queue=s.queue, cores=s.cores, gpus=s.gpus, mb=mb,
                slot_mb=mb and max(1, int(s.memory * 1024 / max(1, s.cores))),
                time=seconds and format_walltime(seconds), minutes=minutes,
                hms=seconds and format_walltime(seconds, True),
                hm=minutes and f"{minutes // 60}:{minutes % 60:02d}",
                shell=s.shebang[2:].split()[0], pe=s.parallel_env,
                nodes=f"1:ppn={s.cores}" if s.cores else "1",
                select="1" + "".join(f":{k}={v}" for k, v in (
                    ("ncpus", s.cores), ("ngpus", s.gpus), ("mem", mb and f"{mb}mb")) if v))


def directives(form, s, name, log):
    """The directives of ``form`` (a system's, in SYSTEMS) that every value they name is
    set for, filled in."""
    values = _directive_values(s, name, log)
    return [d.format(**values) for d in form if all(values[k] for k in re.findall(
        r"{(\w+)}", d))]


def _ask(argv, ids, listed, gone, words, key=lambda i: i):
    """``{id: state}`` of ``ids`` from one query (never one a job): ``listed(stdout)`` ->
    {key: the system's word for the state}, told through ``words`` (ENDED for those that
    finished); a job not listed has ENDED when ``gone(key, the query)`` (the system said
    it does not know it: its memory of finished jobs has passed), else UNKNOWN."""
    cp = _run_command(argv, check=False)
    said = {key(k): word for k, word in listed(cp.stdout).items()}
    tell = words if callable(words) else lambda word: words.get(word, word)
    return {i: tell(said[key(i)]) if key(i) in said else
            ENDED if gone(key(i), cp) else UNKNOWN for i in ids}


def _lines_of(text):
    """``{first word: second word}`` of each line of ``text`` that has them; a third word
    other than 0 is an array task's index (``bjobs -o "jobid stat jobindex"``: JOB[INDEX])."""
    return {r[0] + (f"[{r[2]}]" if r[2:3] not in ([], ["0"]) else ""): r[1]
            for r in (line.split() for line in text.splitlines()) if len(r) >= 2}


def _pbs_listed(text):
    return {block.split()[0].split(".")[0]: m.group(1) for block in text.split("Job Id:")[1:]
            if block.split() and (m := re.search(r"job_state\s*=\s*(\w+)", block))}


def _pbs_gone(n, cp):
    """qstat said it does not know job ``n`` (or that it finished: PBS Pro), or exited with
    only "unknown job" (153, Torque)."""
    said = " ".join(line for line in cp.stderr.splitlines()
                    if "Unknown Job" in line or "has finished" in line)
    return cp.returncode == 153 or bool(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w\[])", said))


def _sge_listed(text):
    """``qstat``'s table: job-ID prior name user state date time [queue] slots [tasks],
    the queue only for running jobs; pending tasks of an array share one line ("2-4:1")."""
    out = {}
    for row in (line.split() for line in text.splitlines()):
        if len(row) < 8 or not row[0].isdigit():
            continue
        tasks = row[9 if "@" in row[7] else 8:][:1]
        for part in tasks[0].split(",") if tasks else ():
            lo, hi, step = ([int(x) for x in re.findall(r"\d+", part)] + [None, None])[:3]
            out.update({f"{row[0]}.{t}": row[4] for t in range(lo, (hi or lo) + 1, step or 1)})
        if not tasks:
            out[row[0]] = row[4]
    return out


def _sge_word(state):
    return (f"ERROR ({state})" if "E" in state else "RUNNING" if re.search("[rt]", state)
            else "PENDING" if "q" in state else state)


def _custom_states(ids, custom):
    if custom is None or not custom.status_cmd:  # nothing to ask: pending until it joins
        return dict.fromkeys(ids, UNKNOWN)
    cmd = shlex.split(custom.status_cmd)  # exits 0 while the job is queued or running
    return {i: "ALIVE" if _run_command(cmd + [i], check=False).returncode == 0 else ENDED
            for i in ids}


def _slurm_time_left(job_id):
    end = _run_command(["squeue", "-h", "-j", job_id, "-o", "%e"]).strip()
    if re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$", end):
        return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S")) - time.time()
    return None


def _pbs_time_left(job_id):
    """Torque's Walltime.Remaining, or (PBS Pro) the walltime asked less that used."""
    out = _run_command(["qstat", "-f", job_id])
    if m := re.search(r"Walltime\.Remaining\s*=\s*(\d+)", out):
        return float(m.group(1))
    asked, used = (re.search(rf"{k}\.walltime\s*=\s*(\S+)", out) for k in (
        "Resource_List", "resources_used"))
    return parse_walltime(asked.group(1)) - parse_walltime(used.group(1) if used else 0) \
        if asked else None


def _lsf_time_left(job_id):
    """``bjobs -o time_left``: "hours:minutes" and a letter (L: to the run limit)."""
    out = _run_command(["bjobs", "-noheader", "-o", "time_left", job_id])
    return int(m[1]) * 3600 + int(m[2]) * 60 if (m := re.match(r"\s*(\d+):(\d+)", out)) \
        else None


def parse_ids(text):
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    return [i for lo, _, hi in (part.partition("-") for part in text.split(","))
            for i in range(int(lo), int(hi or lo) + 1)]


def _slurm_cpu_ids(job_id):
    """The cores Slurm allocated to this job on this node (``scontrol show job -d``:
    CPU_IDs, in Slurm's numbering, which matches the OS's on most nodes), or None."""
    out = _run_command(["scontrol", "show", "job", "-d", job_id])
    node = os.environ.get("SLURMD_NODENAME") or hostname()
    for nodes, ids in re.findall(r"Nodes=(\S+) CPU_IDs=([\d,-]+)", out):
        if nodes == node or len(re.findall(r"Nodes=", out)) == 1:
            return parse_ids(ids)
    return None


def _custom_submit(s):
    if not s.custom_system.submit_cmd:
        raise ConfigError("system = \"custom\" needs custom_system.submit_cmd")
    return shlex.split(s.custom_system.submit_cmd)


def _pbs_task(job, i):
    return job.replace("[]", f"[{i}]")  # qsub said 123[].server: its task 4 is 123[4].server


def _pbs_states(*flags):
    """The states of SYSTEMS' PBS entries: ``qstat [flags] -f ids``."""
    return lambda ids, c: _ask(["qstat", *flags, "-f", *ids], ids, _pbs_listed, _pbs_gone,
                               _PBS_WORDS, lambda i: i.split(".")[0])


# The batch systems, every command and format each needs, as data:
#   directive, lines: the script's directives (see directives()); prologue;
#   (prologue, time_left, cpu_ids, array, job_id, stdin: optional, read with .get())
#   submit(settings): the command (stdin: it reads the script from its stdin, not a path);
#   job_id: what it prints on submitting, a regular expression (default: its last word);
#   states(ids, custom) -> {id: state} (one query); cancel(custom): the command (+ ids);
#   time_left(id) -> seconds; cpu_ids(id) -> the allocated cores; me(environ): the id of
#   the job (or array task) this process runs in, as submit_script records it;
#   array: (its directive for n tasks, the id of task i from the job's, the variable
#   telling a task its index), None when it has no arrays;
#   busy: what a refused submission says when the controller was only too busy to take
#   it (a regular expression, case-insensitive): it is tried again (see submit_script).
_BUSY = "Socket timed out|Resource temporarily unavailable|try again later"
_PBS = {"directive": "#PBS", "prologue": "cd \"$PBS_O_WORKDIR\"", "submit": lambda s: ["qsub"],
        "cancel": lambda c: ["qdel"], "time_left": _pbs_time_left,
        "me": lambda e: e.get("PBS_JOBID"), "busy": _BUSY + "|busy|End of File|cannot "
        "connect to server", "hint": "is this a PBS login node? If not, set system in grain.toml"}
_PBS_WORDS = {"C": ENDED, "F": ENDED, "X": ENDED, "Q": "PENDING", "R": "RUNNING", "H": "HELD",
              "B": "RUNNING"}
SYSTEMS.update({
    "slurm": {"directive": "#SBATCH",
              "lines": ["-J {name}", "-p {queue}", "--nodes=1", "--ntasks-per-node={cores}",
                        "--gres=gpu:{gpus}", "--mem={mb}M", "--time={time}", "-o {log}"],
              "submit": lambda s: ["sbatch", "--parsable"], "cancel": lambda c: ["scancel"],
              "states": lambda ids, c: _ask(
                  ["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i %T"], ids, _lines_of,
                  lambda i, cp: cp.returncode == 0 or "Invalid job id" in cp.stderr,
                  dict.fromkeys(("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                 "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), ENDED)),
              "time_left": _slurm_time_left, "cpu_ids": _slurm_cpu_ids,
              "me": lambda e: (e.get("SLURM_ARRAY_JOB_ID") and "{SLURM_ARRAY_JOB_ID}_"
                               "{SLURM_ARRAY_TASK_ID}".format(**e)) or e.get("SLURM_JOB_ID"),
              "array": ("--array=1-{n}", lambda job, i: f"{job}_{i}", "SLURM_ARRAY_TASK_ID"),
              "busy": _BUSY + "|Unable to contact slurm controller|slurm_persist_conn",
              "hint": "is this a Slurm login node? If not, set system in grain.toml"},
    "pbs": dict(_PBS, lines=["-N {name}", "-q {queue}", "-l nodes={nodes}", "-l ngpus={gpus}",
                             "-l walltime={hms}", "-l vmem={mb}mb", "-j oe", "-o {log}"],
                states=_pbs_states(), array=("-t 1-{n}", _pbs_task, "PBS_ARRAYID")),
    "pbspro": dict(_PBS, lines=["-N {name}", "-q {queue}", "-l select={select}",  # (not
                                "-l walltime={hms}", "-j oe", "-o {log}"],  # Torque's nodes=)
                   states=_pbs_states("-x"), array=("-J 1-{n}", _pbs_task, "PBS_ARRAY_INDEX")),
    # (-notify's warnings go to the job's whole process group: this shell, which would die
    # of them and take the worker down with it, ignores them; the worker, which inherits
    # that, handles them once it runs: see BATCH_NOTICES; h_vmem: a slot's; -S: not csh)
    "sge": {"directive": "#$", "prologue": "trap '' USR1 USR2",
            "lines": ["-N {name}", "-S {shell}", "-cwd", "-q {queue}", "-pe {pe} {cores}",
                      "-binding linear:{cores}",  # its own cores: a cpuset, not all
                      "-l h_vmem={slot_mb}M", "-l gpu={gpus}", "-l h_rt={hms}", "-j y",
                      "-o {log}", "-notify"],  # (SIGUSR2 before a kill: see BATCH_NOTICES)
            "submit": lambda s: ["qsub", "-terse"], "job_id": r"^\s*(\d+)",
            "cancel": lambda c: ["qdel"],
            "states": lambda ids, c: _ask(  # (the user's jobs: all that are not ended)
                ["qstat", "-u", pwd.getpwuid(os.getuid()).pw_name], ids, _sge_listed,
                lambda i, cp: cp.returncode == 0, _sge_word),
            "me": lambda e: e.get("JOB_ID") and "SGE_TASK_ID" in e and e["JOB_ID"] + (
                "" if e["SGE_TASK_ID"] == "undefined" else "." + e["SGE_TASK_ID"]),
            "array": ("-t 1-{n}", lambda job, i: f"{job}.{i}", "SGE_TASK_ID"),
            "busy": _BUSY + "|unable to contact qmaster|commlib error|failed receiving gdi",
            "hint": "is this a Grid Engine submit host? If not, set system in grain.toml"},
    "lsf": {"directive": "#BSUB", "stdin": True,  # (a path: not parsed)
            "lines": ["-J {name}", "-q {queue}", "-n {cores}", '-R "span[hosts=1]"',
                      '-gpu "num={gpus}"', "-M {mb}MB", '-R "rusage[mem={mb}MB]"', "-W {hm}",
                      "-o {log}"],
            "submit": lambda s: ["bsub"], "job_id": r"Job <(\d+)>",
            "cancel": lambda c: ["bkill"], "time_left": _lsf_time_left,
            "cpu_ids": lambda job: os.environ.get("LSB_BIND_CPU_LIST") and parse_ids(
                os.environ["LSB_BIND_CPU_LIST"]),  # (when LSF's affinity binds them)
            "states": lambda ids, c: _ask(
                ["bjobs", "-noheader", "-a", "-o", "jobid stat jobindex", *ids], ids,
                _lines_of, lambda i, cp: f"Job <{i}> is not found" in cp.stderr,
                {"DONE": ENDED, "EXIT": ENDED, "PEND": "PENDING", "RUN": "RUNNING"}),
            "me": lambda e: e.get("LSB_JOBID") and e["LSB_JOBID"] + (
                f"[{e['LSB_JOBINDEX']}]" if e.get("LSB_JOBINDEX", "0") != "0" else ""),
            "array": ("-J {name}[1-{n}]", lambda job, i: f"{job}[{i}]", "LSB_JOBINDEX"),
            "busy": _BUSY + "|LSF is down|not responding|Failed in an LSF library call",
            "hint": "is this an LSF login node? If not, set system in grain.toml"},
    "flux": {"directive": "#flux:",  # (Flux schedules no memory)
             "lines": ["--job-name={name}", "--queue={queue}", "-N 1", "-n 1", "-c {cores}",
                       "-g {gpus}", "-t {minutes}m", "--output={log}"],
             "submit": lambda s: ["flux", "batch"], "cancel": lambda c: ["flux", "cancel"],
             "states": lambda ids, c: _ask(
                 ["flux", "jobs", "-n", "-o", "{id.f58} {state}", *ids], ids, _lines_of,
                 lambda i, cp: i in cp.stderr.replace("\u0192", "f") and re.search(
                     "unknown|not found", cp.stderr, re.I),
                 {"INACTIVE": ENDED, "RUN": "RUNNING", "CLEANUP": "RUNNING"},
                 lambda i: i.replace("\u0192", "f")),  # an id: ƒ..., or f... in ASCII
             "time_left": lambda job: float(_run_command(["flux", "job", "timeleft"])),
             "me": lambda e: e.get("FLUX_JOB_ID"),
             "busy": _BUSY + "|Unable to connect|Connection refused",
             "hint": "is this a Flux instance's login node? If not, set system in grain.toml"},
    "custom": {"submit": _custom_submit,  # (no lines: its scripts are its template's)
               "cancel": lambda c: shlex.split(c.cancel_cmd) if c.cancel_cmd else None,
               "states": _custom_states,
               "me": lambda e: e.get("GRAIN_JOB_ID"), "busy": _BUSY,
               "hint": "check custom_system.submit_cmd in grain.toml"},
})


def batch_job():
    """(system, job id) of the batch job this process runs in, or (None, None); a custom
    system's first (its jobs may run under another system, and are recorded by its ids)."""
    for system in ("custom", *SYSTEMS):
        if job_id := SYSTEMS[system]["me"](os.environ):
            return system, job_id
    return None, None


def batch_states(system, ids, custom=None):
    """``{job id: state}`` for each of ``ids``: what the batch system says, ENDED for a job
    it does not know (any more), UNKNOWN when it could not be asked. A custom system is
    asked through ``custom.status_cmd`` (exit 0: alive), if it has one."""
    if not ids:
        return {}
    spec = SYSTEMS.get(system)
    try:
        return spec["states"](ids, custom) if spec else dict.fromkeys(ids, UNKNOWN)
    except GrainError as e:
        log.warning("could not ask the batch system about job(s) %s: %s", ", ".join(ids), e)
        return dict.fromkeys(ids, UNKNOWN)


def cancel_jobs(system, ids, custom):
    """Cancel batch jobs ``ids`` of ``system``, in one command (a custom one: a command a
    job); GrainError saying why they could not be."""
    cancel = SYSTEMS[system]["cancel"](custom) if system in SYSTEMS else None
    if not cancel:
        raise GrainError(f"no cancel command for system {system!r}")
    for some in [ids] if system != "custom" else [[i] for i in ids]:
        _run_command(cancel + some, "cancel", "check custom_system.cancel_cmd, if it is yours",
                     SUBMIT_S)


def _stamp(text, when, seq=0):
    """``text`` with ``{{HHMMSS}}`` as the time ``when``; the ``seq``-th submission of the same
    second (``up -n 100``) gets a suffix, so that names and logs stay distinct."""
    return text.replace("{{HHMMSS}}", time.strftime("%H%M%S", time.localtime(when))
                        + (f"-{seq}" if seq else ""))


def job_name_and_log(s, when, seq=0):
    """The name and log file (absolute, or "") of a batch job of role settings ``s``
    submitted at ``when``: what its script says and the JobBook records."""
    log_file = os.path.abspath(_stamp(s.log_file, when, seq)) if s.log_file else ""
    return _stamp(s.name, when, seq), log_file


def _setup_and_cleanup(text):
    """(setup lines, cleanup lines in the order they must run)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return ([x for x in lines if not x.startswith("defer ")],
            [x[len("defer "):] for x in reversed(lines) if x.startswith("defer ")])


def worker_resources(s):
    """The dict form of what a worker of settings ``s`` offers: cores, memory x 14/15 and
    walltime minus LEAVE_BEFORE_S as a countdown, each only if the script asks for it
    (else the worker offers what it finds), merged with ``worker.res``."""
    res = {}
    if s.script.cores and "Node" not in s.res:  # (upstream's Node: Cores and Memory in one)
        res["Cores"] = {"N": s.script.cores}
    if s.script.gpus:  # the worker takes them from those the batch system shows it
        res["Gpus"] = {"N": s.script.gpus}
    if s.script.memory and "Node" not in s.res:
        res["Memory"] = {"M": round(s.script.memory * 14 / 15, 3)}
    if s.script.walltime:
        left = max(60, s.script.walltime - LEAVE_BEFORE_S)
        res["WTime"] = {"T": format_walltime(left), "countdown": True}
    res.update(s.res)
    return res


def specialized_module(s):
    """The module of ``worker.specialized_type`` and whether it is backendless, or
    (None, False) when the config names none."""
    if not s.specialized_type:
        return None, False
    module = load_module(s.specialized_type, "worker.specialized_type")
    config = getattr(module, "GRAIN_SWORKER_CONFIG", None)
    if not isinstance(config, dict):
        raise ConfigError(f"worker.specialized_type {s.specialized_type}: the module has no "
                          "GRAIN_SWORKER_CONFIG dict")
    return module, bool(config.get("BACKENDLESS"))


def backendless_workers(s):
    """``[(module, resources)]`` for a backendless specialized worker type (it runs in the
    mission: there is no worker process to start), else []."""
    module, backendless = specialized_module(s)
    return [(module, Resource.from_dict(worker_resources(s)))] if backendless else []


def worker_command(s, grain_path=None):
    """The worker line of a worker job script: the same grain.py under ``script.python``,
    offering worker_resources(s), inside ``worker.wrap``'s container if any. Plain
    ``python /path/grain.py worker ...``, what a person reading the script (``up --dry``)
    expects: one worker a node does not need the cached bytecode that the pool's
    processes, started by the hundred, are booted from."""
    argv = [s.script.python, grain_path or self_path(), "worker", "--url", s.dial,
            "--res", json.dumps(worker_resources(s), separators=(",", ":"))]
    if s.contextmod:
        argv += ["--context", os.path.abspath(s.contextmod)]
    if s.specialized_type:
        argv += ["--sworker", s.specialized_type]
    if s.auth_key:
        argv += ["--key", os.path.abspath(os.path.expanduser(s.auth_key))]
    for flag, path in (("--tls-cert", s.tls_cert), ("--tls-key", s.tls_key)):
        if path:
            argv += [flag, os.path.abspath(path)]
    argv += ["--reattach", f"{s.reattach:g}s"]
    line = shlex.join(argv)
    return _in_container(s, [argv[1], *argv[argv.index("--url") + 1:]], line) if s.wrap \
        else line


# What a worker in a podman or docker container is told of its batch job (apptainer
# passes every variable): its id (as SYSTEMS' "me" read it), its node and its GPUs.
CONTAINER_ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "PBS_JOBID",
                 "JOB_ID", "SGE_TASK_ID", "LSB_JOBID", "LSB_JOBINDEX", "FLUX_JOB_ID",
                 "GRAIN_JOB_ID", "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES")


def _in_container(s, args, line):
    """``line`` (the worker's command) run by ``worker.wrap``, e.g. "apptainer exec
    image.sif" or "podman run image", given the folders of the files the worker reads
    (grain.py, its key, the Edge file...) and the job's GPUs; podman and docker also get
    the host's network, the job's cores (its cpuset, read when the job starts) and the
    variables that tell it its batch job. Any other command is put in front as it is."""
    wrap = shlex.split(s.wrap)
    engine = os.path.basename(wrap[0]) if wrap else ""
    folders = sorted({os.path.dirname(os.path.abspath(a.split("://", 1)[-1].split("@")[-1]))
                      for a in args if a.startswith(("/", "edge://", "unix://"))})
    if engine in ("apptainer", "singularity"):
        flags = [f"--bind={','.join(folders)}"] + (["--nv"] if s.script.gpus else [])
    elif engine in ("podman", "docker"):
        flags = ["--rm", "--network=host", *(f"--volume={d}:{d}" for d in folders),
                 *(f"--env={v}" for v in CONTAINER_ENV)]
        flags += ([("--gpus=all" if engine == "docker" else "--device=nvidia.com/gpu=all")]
                  if s.script.gpus else [])
    else:
        return f"{s.wrap} {line}"
    cores = (' --cpuset-cpus="$(sed -n "s/^Cpus_allowed_list:\\s*//p" /proc/self/status)"'
             if engine in ("podman", "docker") else "")
    return shlex.join(wrap[:2] + flags) + cores + " " + shlex.join(wrap[2:]) + " " + line


def _template_fields(s, name, log_file, setup, cleanup):
    """``c`` of upstream's custom templates (``{c.script.cores}``, ``{c.name}``, ...); the
    walltime as hh:mm:ss, as upstream's were written."""
    walltime = format_walltime(s.script.walltime, True) if s.script.walltime else ""
    script = types.SimpleNamespace(
        **dict(vars(s.script), walltime=walltime), setup="\n".join(setup),
        cleanup="\n".join(cleanup),
        extra_args_str="\n".join(f"{s.custom_system.directive} {a}" for a in s.script.extra_args),
        res_str=json.dumps(worker_resources(s)))
    return types.SimpleNamespace(**dict(vars(s), name=name, log_file=log_file, script=script))


def array_of(s, n):
    """The system's array (see SYSTEMS) when ``n`` workers go as one array job: asked for
    (script.array, `up --array`), n > 1, and the system has arrays; else None."""
    spec = SYSTEMS.get(s.system) or {}
    return spec.get("array") if n > 1 and s.script.array and not s.custom_system.template \
        else None


def task_log(log_file, task):
    """The log of an array job's task: ``w.log`` -> ``w-3.log``."""
    root, ext = os.path.splitext(log_file)
    return f"{root}-{task}{ext}"


def render_script(s, main, when=None, seq=0, tasks=0):
    """The job script for role settings ``s`` running the shell command ``main``: its
    system's, or ``custom_system.template`` when there is one (with ``system`` "custom",
    or, as upstream, any other system it then stands in for); an array job of ``tasks``
    tasks when array_of(s, tasks)."""
    when = time.time() if when is None else when
    name, log_file = job_name_and_log(s, when, seq)
    setup, cleanup = _setup_and_cleanup(_stamp(s.script.setup_cleanup, when, seq))
    array = array_of(s, tasks)
    body = []
    if array and log_file:  # each task its own log (the system's -o, one for all, keeps
        body.append(f'exec >>"{task_log(log_file, "${" + array[2] + "}")}" 2>&1')  # the rest)
    if cleanup:
        # Deferred lines run in reverse order when the script exits, even when the worker
        # failed or the batch system sent SIGTERM (turned into a normal exit by the trap).
        body += ["grain_cleanup() {", *[f"  {c}" for c in cleanup], "}",
                 "trap grain_cleanup EXIT", "trap 'exit 143' TERM INT"]
    body = "\n".join(body + setup + [main])
    spec = SYSTEMS.get(s.system)
    if s.custom_system.template or (spec and "lines" not in spec):
        return _render_template(s, body, name, log_file, setup, cleanup, when, seq)
    if spec is None:  # no batch system: the script alone, to read (`up --dry`)
        return f"{s.script.shebang}\n{body}\n"
    lines = directives(spec["lines"], s.script, name, log_file)
    if array:  # (it replaces the line of the same option: LSF's -J name)
        line = array[0].format(n=tasks, name=name)
        lines = [x for x in lines if re.split("[ =]", x)[0] != re.split("[ =]", line)[0]] \
            + [line]
    lines = [s.script.shebang] + [f"{spec['directive']} {x}" for x in [
        *lines, *s.script.extra_args]]
    if spec.get("prologue"):
        lines.append(spec["prologue"])
    return "\n".join(lines + [body]) + "\n"


def _render_template(s, body, name, log_file, setup, cleanup, when, seq):
    c = s.custom_system
    if not c.template:
        raise ConfigError("system = \"custom\" needs custom_system.template")
    template = _stamp(c.template, when, seq)
    # upstream's {{MAIN}}: our body, its braces escaped for the format below
    template = template.replace("{{MAIN}}", body.replace("{", "{{").replace("}", "}}"))
    try:
        fields = _template_fields(s, name, log_file, setup, cleanup)
        return template.format(
            name=name, queue=s.script.queue, cores=s.script.cores, gpus=s.script.gpus,
            memory=s.script.memory, walltime=fields.script.walltime, log_file=log_file,
            directives=fields.script.extra_args_str, main=body, c=fields)
    except (KeyError, AttributeError, IndexError, ValueError) as e:
        raise ConfigError(f"custom_system.template: cannot fill it in: "
                          f"{type(e).__name__}: {e}") from None


class JobBook:
    """The jobs grain submitted for one address: JSON lines in a file beside the Edge file
    (or in ~/.local/share/grain for tcp/unix addresses), changed under edit_locked() because
    `up`, `down` and heads write it concurrently."""

    def __init__(self, address):
        scheme, host, where = parse_url(address)
        if scheme == "edge":
            self.path = where + ".jobs"
        else:
            tag = hashlib.sha1(address.encode()).hexdigest()[:12]
            self.path = os.path.join(os.path.dirname(default_key_path()), f"jobs-{tag}")

    def records(self):
        try:
            with open(self.path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []
        except ValueError as e:
            log.warning("job records %s are corrupt (%s); ignoring them", self.path, e)
            return []

    def update(self, change):
        """Rewrite the records through ``change(records) -> records``."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with edit_locked(self.path, self.records, lambda records: "".join(
                json.dumps(r) + "\n" for r in records).encode()) as records:
            records[:] = change(list(records))

    def mark_joined(self, job_id):
        self.update(lambda rs: [dict(r, joined=True) if r["id"] == job_id else r for r in rs])

    def waiting(self, system, custom, joined=(), headless=False):
        """Worker jobs whose worker has not joined (yet), but those of ``joined``, each with
        its ``state``, asked of ``system`` (else the one the first was submitted to).
        ``headless``: no head answers, so those that joined one and have not ended too (their
        worker waits for a new head, its allocation in use)."""
        records = [r for r in self.records() if r.get("role") == "worker"
                   and (headless or not r.get("joined")) and r["id"] not in joined]
        if not system and records:
            system = records[0].get("system")
        states = batch_states(system, [r["id"] for r in records], custom)
        return [dict(r, state=states[r["id"]]) for r in records
                if not (r.get("joined") and states[r["id"]] == ENDED)]


def _job_book(worker):
    """A head's HeadService ``job_book``: the worker jobs of the batch system of worker
    settings ``worker`` (their JobBook), whose ending unjoined is reported; None without one."""
    return (worker.system, JobBook(worker.dial), worker.custom_system) if worker.system else None


def _submitter(s):
    """The SYSTEMS entry that submits a job script of settings ``s``."""
    c = s.custom_system  # upstream: a template of one's own, and its command, stand in
    system = "custom" if c.template and c.submit_cmd else s.system
    if system not in SYSTEMS:
        raise ConfigError("no batch system configured: set system = " + ", ".join(
            f'"{x}"' for x in SYSTEMS) + " in grain.toml")
    return SYSTEMS[system]


def submit_script(s, script, extra_args=(), role="worker", when=None, seq=0, tasks=0):
    """Submit ``script`` to the batch system of role settings ``s`` (an array job of
    ``tasks`` tasks when array_of(s, tasks)); returns the batch job ids (one, or one a
    task), recorded in the JobBook of the address."""
    when = time.time() if when is None else when
    spec = _submitter(s)
    argv = spec["submit"](s)
    scripts_dir = os.path.join(os.path.dirname(default_key_path()), "scripts")
    os.makedirs(scripts_dir, mode=0o700, exist_ok=True)
    path = os.path.join(
        scripts_dir, f"{role}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"
        f"-{os.urandom(3).hex()}.sh")
    atomic_write(path, script.encode(), mode=0o700)
    argv += list(extra_args) + ([] if spec.get("stdin") else [path])
    # A busy controller is tried again, with back-off
    for attempt, wait in zip(range(SUBMIT_TRIES), pauses(SUBMIT_BACKOFF_S, math.inf)):
        try:
            out = _run_command(argv, "submission", spec["hint"], SUBMIT_S,
                               script if spec.get("stdin") else None)
            break
        except GrainError as e:
            if not re.search(spec["busy"], str(e), re.I):
                raise
            if attempt + 1 == SUBMIT_TRIES:
                raise GrainError(f"{e} (tried {SUBMIT_TRIES} times: the batch system was "
                                 "busy each time)") from None
            log.warning("%s; the batch system is busy: trying again in %g s", e, wait)
            time.sleep(wait)
    found = re.search(spec.get("job_id", r"([^\s;]+)(?:;\S*)?\s*$"), out)
    batch_id = found.group(1) if found else "?"
    array = array_of(s, tasks)
    name, log_file = job_name_and_log(s, when, seq)
    records = [{"id": array[1](batch_id, i) if array else batch_id, "system": s.system,
                "role": role, "name": name, "script": path, "submitted": when,
                "log": task_log(log_file, i) if array and log_file else log_file}
               for i in range(1, tasks + 1 if array else 2)]
    JobBook(s.dial if role == "worker" else s.listen).update(lambda rs: rs + records)
    return [r["id"] for r in records]


def queue_room(s, n, queued):
    """How many of ``n`` worker jobs of settings ``s`` may be submitted while ``queued``
    are submitted and not joined: script.max_queued's room (0: no limit)."""
    most = s.script.max_queued
    return min(n, max(0, most - queued)) if most else n


def submit_workers(s, n, extra_args=(), when=None, pause=time.sleep):
    """Submit ``n`` worker jobs of settings ``s`` (`up`'s and the swarm's way): one array
    job of n tasks when array_of(s, n), else n jobs, at most ``script.max_submit_rate`` a
    second. Yields (seq, ids) as each submission is made."""
    when = time.time() if when is None else when
    tasks = n if array_of(s, n) else 0
    for seq in range(1 if tasks else n):  # one {{HHMMSS}} for all, numbered: names differ
        if seq and s.script.max_submit_rate:
            pause(1 / s.script.max_submit_rate)
        script = render_script(s, worker_command(s), when, seq, tasks)
        yield seq, submit_script(s, script, extra_args, "worker", when, seq, tasks)


###############################################################################
# Host ########################################################################
###############################################################################
# What this machine offers a worker: its cores (this process's cpuset, or the cores the batch
# system allocated when nothing is bound), its memory limit, its GPUs and the cores near
# each, and the end of its allocation. One provider function, worker_provider(), says what
# a worker process offers; _local_provider() the same for the in-process worker. A request
# for more cores than there are gives virtual ids past the real ones (oversubscription,
# for tests and benchmarks), by one rule.


def allocation_end():
    """Seconds left in this batch job's allocation, asked of the batch system; None outside
    a batch job or when it cannot tell."""
    system, job = batch_job()
    time_left = SYSTEMS[system].get("time_left") if system else None
    try:
        return time_left(job) if time_left else None
    except (GrainError, ValueError):
        return None


def batch_cpu_ids(allowed):
    """The cores the batch system gave this job, when its cpuset does not say so.

    Under Slurm with TaskPlugin=task/none nothing is bound: every job's cpuset is the whole
    node, and two workers on one node would both offer core 0. The batch system still
    knows which cores it allocated to each job. Used only when the cpuset is the whole
    node; None when there is nothing better to say."""
    system, job = batch_job()
    cpu_ids = SYSTEMS[system].get("cpu_ids") if system else None
    if not cpu_ids or len(allowed) != (os.cpu_count() or 0):
        return None
    try:
        allowed = set(allowed)
        return [i for i in cpu_ids(job) or () if i in allowed] or None
    except GrainError:
        return None


def _memory_gb():
    """This process's memory limit in GB: the cgroup limit if any, else MemTotal."""
    for path, found, unit in (("/sys/fs/cgroup/memory.max", r"^(\d+)$", 1),
                              ("/sys/fs/cgroup/memory/memory.limit_in_bytes", r"^(\d+)$", 1),
                              ("/proc/meminfo", r"^MemTotal:\s+(\d+) kB", 1024)):
        with contextlib.suppress(OSError), open(path) as f:
            m = re.search(found, f.read().strip(), re.M)
            limit = int(m.group(1)) * unit if m else 1 << 60
            if limit < 1 << 60:  # (no cgroup limit is "max", or a huge number)
                return round(limit / 2 ** 30, 2)
    return 0.0


def _tool_output(argv):
    """A GPU tool's output, or None when it is missing or fails."""
    with contextlib.suppress(GrainError):
        return _run_command(argv, "asking the GPUs")
    return None


def _nvidia_devices():
    """``(ids, {id: PCI address})`` from nvidia-smi: a GPU's index, or the UUIDs of its MIG
    instances when it is partitioned (CUDA_VISIBLE_DEVICES takes either)."""
    listing = _tool_output(["nvidia-smi", "-L"])
    if listing is None:
        return [], {}
    buses = dict(re.findall(r"^\s*(\d+)\s*,\s*(\S+)", _tool_output(
        ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"]) or "", re.M))
    instances = {}  # {GPU index: its MIG instances}
    gpu = None
    for line in listing.splitlines():
        if m := re.match(r"GPU (\d+):", line.strip()):
            gpu = m.group(1)
            instances[gpu] = []
        elif (m := re.search(r"\bMIG\b.*\(UUID: (MIG-[^)\s]+)\)", line)) and gpu is not None:
            instances[gpu].append(m.group(1))
    # a partitioned GPU's instances are the devices
    where = {d: buses.get(gpu) for gpu, mig in instances.items() for d in mig or [gpu]}
    return list(where), where


def _amd_devices():
    """``(ids, {id: PCI address})`` from rocm-smi: its ``GPU[i]`` is the index
    ROCR_VISIBLE_DEVICES takes (it lists every device, whatever that variable says)."""
    listing = _tool_output(["rocm-smi", "--showbus"]) or ""
    ids = list(dict.fromkeys(re.findall(r"^GPU\[(\d+)\]", listing, re.M)))
    return ids, dict(re.findall(r"^GPU\[(\d+)\]\s*:\s*PCI Bus:\s*(\S+)", listing, re.M))


def _numa_cores(pci, sysfs):
    """The cores of the NUMA node of the PCI device ``pci`` (``00000000:3B:00.0``), from
    sysfs; None when the machine does not say."""
    if not pci:
        return None
    domain, _, rest = pci.lower().partition(":")
    try:
        with open(os.path.join(sysfs, "bus/pci/devices", f"{domain[-4:]}:{rest}",
                               "numa_node")) as f:
            node = int(f.read())
        if node < 0:
            return None
        with open(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist")) as f:
            return parse_ids(f.read().strip())
    except (OSError, ValueError):
        return None


def find_gpus(environ=None, sysfs="/sys"):
    """This machine's GPUs as a provider, or None: CUDA_VISIBLE_DEVICES when set (a batch
    system's choice for this job), else what ``nvidia-smi -L`` lists (MIG instances by
    UUID), else ROCR_VISIBLE_DEVICES, else what ``rocm-smi`` lists. Devices know the
    cores of their NUMA node when nvidia-smi or rocm-smi, and sysfs, say."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids, where = _nvidia_devices()
    vendor = "nvidia"
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip() not in ("", "-1")]
    elif not ids:
        vendor = "amd"
        ids, where = _amd_devices()
        if (rocr := environ.get("ROCR_VISIBLE_DEVICES")) is not None:
            ids = list(dict.fromkeys(d.strip() for d in rocr.split(",") if d.strip()))
    if not ids:
        return None
    near = {d: c for d in ids if (c := _numa_cores(where.get(d), sysfs))}
    return Gpus(ids, vendor=vendor, near=near)


_OVERSUBSCRIBE = "; --oversubscribe offers more, as virtual ids (for tests and benchmarks)"


def _fit_cores(parts, allowed, oversubscribe, who):
    """Make ``parts``' Cores(N) ids of this process's ``allowed`` cores: the first N, then
    (``oversubscribe``; else an error) virtual ids past the largest. Named ids must be
    allowed ones."""
    cores = parts.get("Cores")
    if cores is not None and not cores._counted and not set(cores.c) <= set(allowed):
        raise UsageError(f"--res names cores {_fmt_ids(cores.c)} but this process may use "
                         f"only {_fmt_ids(allowed)}")
    if cores is None or not cores._counted:
        return
    if cores.N > len(allowed) and not oversubscribe:
        raise UsageError(f"--res asks for {cores.N} cores but this process may use "
                         f"only {len(allowed)} ({_fmt_ids(allowed)}){_OVERSUBSCRIBE}")
    if cores.N > len(allowed):
        log.info("%s: %d cores offered, %d real (%s); the rest are virtual", who, cores.N,
                 len(allowed), _fmt_ids(allowed))
    parts["Cores"] = Cores._of(allowed[:cores.N] + [max(allowed) + 1 + i for i in
                                                    range(cores.N - len(allowed))])


def _local_provider(rpw):
    """The provider of the in-process worker: ``Cores(N)`` as core ids, as a worker's (with
    virtual ones past this process's affinity set: useful for testing)."""
    parts = dict(rpw._parts())
    if "Cores" in parts and parts["Cores"]._counted:
        _fit_cores(parts, _allowed_cores(), True, "local worker")
    return ResourceSet._of(parts)


def worker_provider(req=None, oversubscribe=False):
    """The resources a worker offers, from its ``--res`` request: without Cores, the whole
    cpuset; without Memory, its memory limit. Core ids come from this process's affinity
    set: the cores the batch system gave the job, not 0..N-1. More cores than that set is
    an error, unless ``oversubscribe`` (then the ids past the real ones are virtual, as for
    the in-process worker)."""
    allowed = _allowed_cores()
    if granted := batch_cpu_ids(allowed):
        log.info("the batch system bound no cores; using the %d it allocated to this job "
                 "(%s)", len(granted), _fmt_ids(granted))
        allowed = granted
    parts = dict((req or ZERO)._parts())
    parts.setdefault("Memory", Memory(_memory_gb()))
    _fit_gpus(parts, oversubscribe)
    parts.setdefault("Cores", Cores._of(allowed))
    _fit_cores(parts, allowed, oversubscribe, "oversubscribed")
    return ResourceSet._of(parts)


def _fit_gpus(parts, oversubscribe):
    """The GPUs a worker offers: those it finds; ``--res`` ``Gpus(N)`` takes the first N
    of them (more is an error, unless ``oversubscribe``: then the ids are virtual), and
    ``--res`` naming ids offers those."""
    asked = parts.get("Gpus")
    if asked is not None and asked.ids is not None:
        return
    found = find_gpus()
    if asked is None:
        if found is not None:
            parts["Gpus"] = found
        return
    have = found.ids if found is not None else []
    if asked.N > len(have) and not oversubscribe:
        raise UsageError(f"--res asks for {asked.N:g} GPU(s) but this machine shows "
                         f"{len(have)}{' (' + ','.join(have) + ')' if have else ''}"
                         f"{_OVERSUBSCRIBE}")
    parts["Gpus"] = (Gpus([str(i) for i in range(int(asked.N))]) if asked.N > len(have)
                     else Gpus(have[:int(asked.N)], found.vendor, found.near))


def _fit_allocation(provider):
    """Inside a batch job, count down to the earlier of the configured walltime and the real
    end of the allocation (less LEAVE_BEFORE_S), so the worker leaves before it is killed."""
    left = allocation_end()
    if left is None:
        return provider
    left = max(0.0, left - LEAVE_BEFORE_S)
    parts = dict(provider._parts())
    wt = parts.get("WTime")
    if wt is None or wt.T is None or left < wt.remaining():
        parts["WTime"] = WTime(T=left, countdown=True)
        log.info("the batch system ends this allocation in %s; leaving %s before",
                 format_walltime(left + LEAVE_BEFORE_S), format_walltime(LEAVE_BEFORE_S))
    return ResourceSet._of(parts)


###############################################################################
# Results store ###############################################################
###############################################################################
# A mission's memory of the jobs it ran, in SQLite (the standard library's, a real
# database): every job with resources is keyed by a digest of what it computes -- its
# function's code and the code and plain values that code uses, its arguments, its
# request but for time limits -- so a mission run again takes the stored value instead
# of running the job. Results are written in batches, one transaction every
# STORE_FLUSH_S, by a writer process (below): a `kill -9` loses at most that window,
# and SQLite's journal never lets it corrupt the file. One mission writes a store at a
# time: a holder file beside it (created atomically, refreshed every STORE_BEAT_S) names
# the mission that holds it.
# The table is a log: a job's newest row (largest rowid) is its entry. Appending costs
# half of updating a table kept sorted by key, and stays flat as the store grows; the
# rows a later one replaced are dropped when the mission closes the store.

STORE_FORMAT = 3  # (1 was a table by key, in development only: refused; 2 had no call)
_STORE_TABLE = ("CREATE TABLE IF NOT EXISTS results_log (key TEXT, function TEXT, state TEXT, "
                "value BLOB, error TEXT, kind TEXT, duration REAL, finished REAL, call TEXT)")
_LIBRARY_ROOTS = tuple({sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)})


def _user_module(name):
    """Is module ``name`` the user's code (not Python's, nor an installed package, nor
    grain itself)? Its code goes into a job's key; a library is keyed by name only."""
    if name in ("grain", "trio", "dill") or name in sys.builtin_module_names:
        return False
    path = getattr(sys.modules.get(name), "__file__", None) or ""
    return name == "__main__" or not path.startswith(_LIBRARY_ROOTS)


def _feed_code(h, code):
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        else:
            h.update(repr(const).encode())


def _feed(h, obj, seen, depth=0):
    """Feed ``h`` what defines ``obj``, a function, class or value a job's function uses."""
    if id(obj) in seen or depth > 50:
        return
    seen.add(id(obj))
    while isinstance(obj, functools.partial):
        _feed(h, (obj.args, obj.keywords), seen, depth + 1)
        obj = obj.func
    obj = getattr(obj, "__wrapped__", obj)  # @subprocify, @delayed, functools.wraps
    if isinstance(obj, (types.FunctionType, type)) and not _user_module(obj.__module__):
        h.update(f"{obj.__module__}.{obj.__qualname__}".encode())
    elif isinstance(obj, types.FunctionType):
        _feed_code(h, obj.__code__)
        for v in (obj.__defaults__ or ()) + tuple(c.cell_contents for c in obj.__closure__ or ()):
            _feed(h, v, seen, depth + 1)
        for name in obj.__code__.co_names:
            if name in obj.__globals__:
                _feed(h, obj.__globals__[name], seen, depth + 1)
    elif isinstance(obj, type):
        h.update(obj.__qualname__.encode())
        for value in vars(obj).values():
            _feed(h, value, seen, depth + 1)
    elif isinstance(obj, types.ModuleType):
        h.update(obj.__name__.encode())
    elif isinstance(obj, (int, float, complex, str, bytes, bool, type(None), tuple)):
        h.update(repr(obj).encode())  # a constant the code reads


def code_digest(fn):
    """A digest of what ``fn`` computes: its code, and the code, closures and plain
    constants of the user's functions and classes it uses (an edited body is a new key;
    a library's function is keyed by its name)."""
    h = hashlib.sha256()
    _feed(h, fn, set())
    return h.digest()


class _KeyPickler(pickle.Pickler):
    """Pickles the same values to the same bytes in every run: sets, whose order follows
    the per-process string hash, go sorted. (Through persistent_id: the C pickler asks
    it of every object, but not reducer_override of a set.) Its bytes are never loaded."""

    def persistent_id(self, obj):
        if type(obj) in (set, frozenset):
            return type(obj).__name__, sorted(obj, key=repr)
        return None


_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})
_CORES_KEYS = {}  # N -> the request part of the key of Cores(N), the common request


def _request_key(req):
    key = repr([(k, v._args()) for k, v in sorted(req._parts().items())
                if k != "WTime"]).encode()
    if type(req) is Cores and req._ids is None:  # (the common request: its key kept)
        _CORES_KEYS[req.N] = key
    return key


def key_material(fn_digest, args, kwargs, req):
    """What the store key of a job digests: its function's digest, its arguments pickled
    the same way in every run, and its request (but for WTime: time limits do not change
    what a job computes). TypeError when its arguments cannot be pickled. (Keys must not
    change between versions: a store's entries would no longer be found.)"""
    try:
        # (a loop costs less than a map; keywords, a dict, take the general way)
        for value in args if not kwargs else (kwargs,):
            if type(value) not in _PLAIN:
                # The standard pickler's bytes, which are the set-sorting pickler's unless
                # they hold a set (EMPTY_SET or FROZENSET; whatever else holds those too)
                data = pickle.dumps((args, dict(kwargs)), protocol=4)
                if 0x8F in data or 0x91 in data:
                    buf = io.BytesIO()
                    _KeyPickler(buf, protocol=4).dump((args, dict(kwargs)))
                    data = buf.getvalue()
                data = b"k" + data
                break
        else:  # plain values and no keywords: the common case, fast
            data = b"a" + pickle.dumps(args, protocol=4)
    except Exception as e:
        raise TypeError(f"{e}") from None
    key = _CORES_KEYS.get(req.N) if type(req) is Cores and req._ids is None else None
    return fn_digest + data + (key or _request_key(req))


def job_key(fn_digest, args, kwargs, req):
    """The store key of a job (TypeError when its arguments cannot be pickled)."""
    return hashlib.sha256(key_material(fn_digest, args, kwargs, req)).hexdigest()[:40]


def _key_text(key):
    """The text of a job's entry in the store, ``key#n`` (``key`` may be the pair of its
    material and n: see MissionResults.known; the writer process has this line too)."""
    return key if type(key) is str else f"{hashlib.sha256(key[0]).hexdigest()[:40]}#{key[1]}"


_STORE_INSERT = ("INSERT INTO results_log VALUES (?, ?, ?, ?, ?, ?, ?, "  # finished: now,
                 "(julianday('now') - 2440587.5) * 86400.0, ?)")  # in Unix time, by SQLite
_STORE_FIELDS = 8  # the values a row is given

# The store's writer: a process of its own, so that inserting rows and waiting for the
# disk never take the event loop's time. (A thread could not: it needs the interpreter
# back after every statement, and a busy loop held it for a quarter of a second at a time,
# putting the writes seconds behind.) It reads batches of rows (each a pickle of the flat
# list of their fields: pickles need no frames), commits each and answers one byte; an
# empty batch says the mission is done with it. At the end of its input (the mission
# died) it leaves too: the batches it was sent are written. A batch cut short is not
# written: the mission did not see it acknowledged and writes it itself. It also turns
# the keys a mission left as their material into text (_key_text), so that hashing them
# never takes the event loop's time. (-I: the standard library only, not a module of the
# mission's directory.)
_STORE_WRITER = """
import hashlib, pickle, sqlite3, sys
db = sqlite3.connect(sys.argv[1], uri=True, isolation_level=None, timeout=60)
db.execute("PRAGMA synchronous=FULL")
while True:
    try:
        batch = pickle.load(sys.stdin.buffer)
    except Exception:  # the end of its input, or a batch cut short
        break
    if not batch:
        break
    batch[::int(sys.argv[3])] = [k if type(k) is str else
                                 f"{hashlib.sha256(k[0]).hexdigest()[:40]}#{k[1]}"
                                 for k in batch[::int(sys.argv[3])]]
    with db:
        db.execute("BEGIN")
        db.executemany(sys.argv[2], zip(*[iter(batch)] * int(sys.argv[3])))
    try:
        sys.stdout.buffer.write(b".")
        sys.stdout.buffer.flush()
    except OSError:  # the mission went: what it sent is written
        break
"""


_INT64 = 2 ** 63
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a text UTF-8 cannot hold (a file name's)


def _stored_value(value, pickled=None):
    """A result as the store keeps it: a number or a text as SQLite's own value (no pickling,
    and readable with any SQLite tool), anything else pickled (``pickled``: as its worker
    already did). (Not NaN, which SQLite stores as NULL; not an int beyond 64 bits; not
    bool, which would come back an int; not a text with a lone surrogate, as os.listdir
    gives for a file name that is not UTF-8, which SQLite cannot take.)"""
    kind = type(value)
    if kind is float and value == value or value is None or (
            kind is int and -_INT64 <= value < _INT64) or (
            kind is str and (value.isascii() or not _SURROGATE.search(value))):
        return value
    return pickled if pickled is not None else dumps_job_value(value, "the result")


class ResultStore:
    """The results of a mission's jobs, by key, in an SQLite file (see the section)."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        self.holder = self.path + ".holder"
        # key -> "done" | "failed" | the worker a "running" entry names (None: not known):
        # the entries found on opening (the jobs of this run are not added: a key is asked
        # for once a run, before it is recorded)
        self.states = {}
        self._rowids = {}    # key -> the rowid of its entry, as found on opening
        # Rows to write, their fields in one flat list (_STORE_FIELDS a row): tuples that
        # outlive a collection would cost the mission's garbage collector a job's time
        self._pending = []
        self._replaced = 0   # rows a later one replaced (or may have: see put_back)
        self._rows = 0       # rows in the table
        self._db = None
        self._writer = None  # (process, its input, its output) while it writes
        self._in_flight = False  # a batch sent to the writer, not yet acknowledged
        self.held = False
        self.crashed = False  # the mission that held it last died holding it
        # The workers (Worker.ident) this run sent jobs to, and those the run before sent
        # some to when it died: named in the holder file before a job goes, for a job sent
        # within STORE_FLUSH_S of that death has no entry to name its worker.
        self.workers = {}  # (a dict: in order, looked up)
        self.last_workers = set()
        self._lock = threading.Lock()  # the database, between threads

    # -- opening and holding -------------------------------------------------------
    def open(self, hold=True):
        """Take the store (GrainError naming the mission that holds it) and read its
        index; a file that is not a readable store is a GrainError naming it. Without
        ``hold``: to read only, while a mission may hold it."""
        if hold:
            self._take_hold()
        self.held = hold
        try:
            uri = sqlite_uri(self.path, mode="rwc" if hold else "ro")  # (rwc: SQLite's default)
            if hold and "vfs=unix-dotfile" in uri:  # held: a lock there was left by a kill
                self._clear_dot_lock()
            # (the timeout: while a writer commits, on a slow disk; autocommit: reading only,
            # as without hold, it changes nothing)
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=STORE_STALE_S)
            if hold:  # (WAL would need shared memory between processes: not on NFS)
                self._db.execute("PRAGMA journal_mode=DELETE")
                self._db.execute("PRAGMA synchronous=FULL")
                self._create()
            if self._format() not in (str(STORE_FORMAT), "2"):  # (2: read, not written)
                raise GrainError(f"results store {self.path} is of format {self._format()} "
                                 f"(this grain.py reads {STORE_FORMAT})")
            for key, state, rowid in self._db.execute(
                    "SELECT key, CASE state WHEN 'running' THEN value ELSE state END, rowid "
                    "FROM results_log ORDER BY rowid"):
                self._replaced += key in self.states
                self.states[key], self._rowids[key] = state, rowid
            self._rows = len(self._rowids) + self._replaced
        except (GrainError, sqlite3.DatabaseError) as e:
            self.close()
            if isinstance(e, GrainError):
                raise
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise GrainError(f"results store {self.path} stayed locked for "
                                 f"{STORE_STALE_S:g} s (another process is writing it)") from None
            raise GrainError(f"results store {self.path} cannot be read ({e}); move it away "
                             "to start a new one") from None
        return self

    def _format(self):
        found = self._db.execute("SELECT v FROM meta WHERE k = 'format'").fetchone()
        return found[0] if found else None

    def _create(self):
        tables = sorted(name for (name,) in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"))
        if tables and "meta" not in tables:  # (not to be written into)
            raise GrainError(f"results store {self.path} is an SQLite database of something "
                             f"else (its tables: {', '.join(tables[:5])}), not a results "
                             "store; name another file")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)",
                             (str(STORE_FORMAT),))
            self._db.execute(_STORE_TABLE)
            if self._format() == "2":  # made before failures kept their call: it gains one
                self._db.execute("ALTER TABLE results_log ADD COLUMN call TEXT")
                self._db.execute("UPDATE meta SET v = ? WHERE k = 'format'", (str(STORE_FORMAT),))

    def _take_hold(self):
        for _ in range(2):
            try:
                fd = os.open(self.holder, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                self._stale_holder()
                self.crashed = True
                continue  # the holder died: its file was removed; take it
            except OSError as e:
                why = output_path_problem(self.path) or \
                    f"cannot create files in {os.path.dirname(self.path)} ({e.strerror})"
                raise GrainError(f"results store {self.path}: {why}") from None
            os.close(fd)
            self.since = time.time()
            return self.add_worker(None)
        raise GrainError(f"results store {self.path}: cannot take it")

    def add_worker(self, ident):
        """Name the worker ``ident`` in the holder file (None: write it as it is)."""
        if ident:
            self.workers[ident] = None
        atomic_write(self.holder, json.dumps({  # (a kill leaves no half)
            "host": hostname(), "pid": os.getpid(), "since": self.since,
            "workers": list(self.workers)}).encode(), mode=0o666)

    def _stale_holder(self):
        """Remove the holder file of a mission that died; GrainError if it lives."""
        try:
            with open(self.holder) as f:
                who = json.load(f)
        except (OSError, ValueError):
            return
        # (by the file server's clock, which touched it: this host's may be minutes off)
        dead = (not _pid_lives(who.get("pid")) if who.get("host") == hostname()
                else not touched_within(self.holder, STORE_STALE_S, probe=self.path))
        if not dead:
            raise GrainError(
                f"results store {self.path} is in use by the mission pid {who.get('pid')} "
                f"on {who.get('host')} (since {time.ctime(who.get('since', 0))}); one "
                "mission writes a store at a time")
        self.last_workers = set(who.get("workers", ()))
        _unlink_quietly(self.holder)

    def beat(self):
        """Say the holder is alive (a mission on another host tells a stale file by age)."""
        with contextlib.suppress(OSError):
            os.utime(self.holder)

    def close(self, ended=False):
        """``ended``: by the mission that held it, which leaves no job of its running (its
        workers were told to stop them, after a Ctrl-C too): their entries go."""
        self.stop_writer()
        if self._db is not None:
            self.flush()
            if ended and self.held:
                with self._lock, self._db:
                    self._db.execute("DELETE FROM results_log WHERE state = 'running'")
            if self.held and self._replaced * 8 > self._rows:
                self._drop_replaced()  # (a few replaced rows cost less than reading it all)
            self._db.close()
            self._db = None
        if self.held:
            self.held = False
            _unlink_quietly(self.holder)

    def _drop_replaced(self):
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM results_log WHERE rowid NOT IN (SELECT MAX(rowid) "
                             "FROM results_log GROUP BY key)")
        self._replaced = 0

    # -- reading and writing -------------------------------------------------------
    def fetch(self, key):
        """``(state, value bytes, error text, kind)`` stored for ``key``."""
        with self._lock:  # (by the rowid of a key found on opening: the common case, fast)
            return self._db.execute("SELECT state, value, error, kind FROM results_log WHERE "
                                    "rowid = COALESCE(?, (SELECT MAX(rowid) FROM results_log "
                                    "WHERE key = ?))", (self._rowids.get(key), key)).fetchone()

    def record(self, key, function, state, value=None, error=None, kind=None, duration=None,
               call=None):
        """Remember a job's state (written after the next ``take``; from the event
        loop's thread)."""
        if key in self.states:  # an entry found on opening: this row replaces it
            self._replaced += 1
            self.states[key] = state
            self._rowids.pop(key, None)
        elif state == "running":  # the row of its end will replace this one
            self._replaced += 1
        self._pending += (key, function, state, value, error, kind, duration, call)

    def take(self):
        """The rows recorded since the last ``take`` (flat), to ``send``."""
        rows = self._pending
        self._pending = []
        self._rows += len(rows) // _STORE_FIELDS
        return rows

    def put_back(self, rows):
        """Rows taken but maybe not written: ``close`` writes them (again, if the writer
        did before it could say so: then the newer copy replaces the older)."""
        self._pending[:0] = rows
        self._rows -= len(rows) // _STORE_FIELDS
        self._replaced += len(rows) // _STORE_FIELDS

    def write(self, rows):
        """Append ``rows`` (flat) in one transaction, from this process."""
        with self._lock:
            if rows and self._db is not None:
                rows[::_STORE_FIELDS] = map(_key_text, rows[::_STORE_FIELDS])
                with self._db:  # BEGIN ... COMMIT
                    self._db.execute("BEGIN")
                    self._db.executemany(_STORE_INSERT, zip(*[iter(rows)] * _STORE_FIELDS))

    def flush(self):
        """Write what was recorded, now, from this process."""
        self.write(self.take())

    def start_writer(self):
        """Start the writer process (see _STORE_WRITER) that ``send`` gives rows to."""
        argv = [sys.executable, "-I", "-c", _STORE_WRITER, sqlite_uri(self.path), _STORE_INSERT,
                str(_STORE_FIELDS)]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    start_new_session=True)  # (Ctrl-C: the mission ends it)
        except OSError as e:
            log.warning("results store %s: no writer process (%s): the mission writes it "
                        "itself", self.path, e)
            return
        self._writer = (proc, trio.lowlevel.FdStream(os.dup(proc.stdin.fileno())),
                        trio.lowlevel.FdStream(os.dup(proc.stdout.fileno())))

    @property
    def writer(self):
        """The writer process (a ``subprocess.Popen``), None when this process writes."""
        return self._writer[0] if self._writer is not None else None

    async def send(self, rows):
        """Have ``rows`` written, by the writer process while it works, else from here."""
        if not rows:
            return
        if self._writer is not None:
            proc, to_writer, from_writer = self._writer
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self._in_flight = True
                await to_writer.send_all(pickle.dumps(rows, protocol=4))
                if await from_writer.receive_some(1) == b".":
                    self._in_flight = False
                    return
            self.stop_writer()
            log.warning("the writer of results store %s ended (exit status %s): the "
                        "mission writes it itself", self.path, proc.returncode)
        await trio.to_thread.run_sync(self.write, rows)

    def _clear_dot_lock(self):
        """Remove the lock SQLite's unix-dotfile VFS (see sqlite_uri) takes, a directory
        that no process's end releases: this mission holds the store, so it is stale."""
        with contextlib.suppress(OSError):
            os.rmdir(self.path + ".lock")

    def stop_writer(self):
        """Tell the writer it is done and wait for it to leave. (Not by closing its input:
        a process the mission forked may hold that open.) One with a batch it has not
        acknowledged is stopped at once: the caller writes that batch itself."""
        if self._writer is None:
            return
        proc, to_writer, from_writer = self._writer
        self._writer = None
        if self._in_flight:
            proc.kill()
            proc.wait()
            self._clear_dot_lock()  # (what it held: SQLite's locks by file outlive a kill)
        else:
            with contextlib.suppress(OSError):
                os.write(proc.stdin.fileno(), pickle.dumps([]))  # an empty batch: done
        for stream in (to_writer, from_writer, proc.stdin, proc.stdout):
            stream.close()
        try:
            proc.wait(timeout=STORE_WRITER_EXIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def summary(self):
        """``[(function, state, count)]`` of the entries, the file's size in bytes, and
        ``[(call, error)]`` of the failed ones (their function, where no call was kept)."""
        newest = "rowid IN (SELECT MAX(rowid) FROM results_log GROUP BY key)"
        rows = self._db.execute(f"SELECT function, state, COUNT(*) FROM results_log WHERE "
                                f"{newest} GROUP BY function, state ORDER BY function, state")
        call = "function" if self._format() == "2" else "COALESCE(call, function)"
        failed = self._db.execute(f"SELECT {call}, error FROM results_log WHERE state = "
                                  f"'failed' AND {newest} ORDER BY rowid")
        return list(rows), os.path.getsize(self.path), list(failed)

    def forget(self, pattern, state=None):
        """Drop the entries of the functions matching the glob ``pattern`` (and ``state``);
        returns how many."""
        self.flush()
        if self._replaced:  # (then every key has one row)
            self._drop_replaced()
        names = [n for (n,) in self._db.execute("SELECT DISTINCT function FROM results_log")
                 if fnmatch.fnmatchcase(n, pattern)]
        with self._db:
            self._db.execute("BEGIN")
            return sum(self._db.execute("DELETE FROM results_log WHERE function = ? AND (? IS "
                                        "NULL OR state = ?)", (name, state, state)).rowcount
                       for name in names)


class _FunctionKeys(dict):
    """job function -> (its code digest, its name), each found once (a hit costs no call)."""

    def __missing__(self, fn):
        self[fn] = known = (code_digest(fn), _callable_name(fn))
        return known


class MissionResults:
    """A mission's use of its results store: it keys each job with resources (``job.key``:
    the n-th job of that key in this run, whose text ``key#n`` is its ``wire`` on the
    workers, and in the store), answers whether its result is stored (``known``), records
    results, and writes them every STORE_FLUSH_S (``keep``)."""

    def __init__(self, path, rerun_failed=True):
        self.store = ResultStore(path)
        self.rerun_failed = rerun_failed
        self._functions = _FunctionKeys()
        self._counts = {}
        self._unkeyable = set()
        self._sent = {}  # wire -> job sent to a worker process since the last write
        self._due = trio.Event()  # set: write now, not at the next STORE_FLUSH_S
        self._waiting = None      # write_now's callers' events, while keep runs
        self.reused = 0           # jobs whose stored result this run took (not run again)

    def known(self, job):
        """Key ``job``; "stored" when its result is stored already (then it is not to run).
        Else, when the last run of this mission died, the worker that may still run it: the
        one its "running" entry names, or True, any (a job sent within STORE_FLUSH_S of
        that death has no entry yet)."""
        fn = job.fn
        try:
            material = key_material(self._functions[fn][0], job.args, job.kwargs, job.req)
        except TypeError as e:
            name = _callable_name(fn)
            if name not in self._unkeyable:
                self._unkeyable.add(name)
                log.warning("jobs of %s cannot be keyed for the results store (%s): they "
                            "run every time", name, e)
            return None
        # The n-th job of a key in a run is stored as such: a mission that draws 100
        # samples with the same call gets its 100 results back, not one of them 100 times.
        n = self._counts[material] = self._counts.get(material, -1) + 1
        job.key = (material, n)
        store = self.store
        if not store.states and not store.crashed:  # a new store: nothing to find
            return None  # (the key's text is made when a worker or the store needs it)
        job.key = wire = _key_text(job.key)  # (the text: as the entries are)
        job.name_on_wire(wire)
        state = store.states.get(wire)
        if state == "done" or (state == "failed" and not self.rerun_failed):
            return "stored"
        return store.crashed and state != "failed" and (state or True)

    def running(self, job):
        """Remember that ``job`` goes to a worker process (it may outlive this run, which
        knows it by its key's text): it is stored as "running" at the next write, unless it
        has ended by then."""
        job.name_on_wire(_key_text(job.key))
        self._sent[job.wire] = job
        if job.worker.ident and job.worker.ident not in self.store.workers:
            with contextlib.suppress(OSError):  # (a full disk costs a resume a hold, not a job)
                self.store.add_worker(job.worker.ident)

    async def fetch(self, job):
        """``(value, error, kind)`` stored for a known job."""
        state, data, error, kind = await trio.to_thread.run_sync(self.store.fetch, job.wire)
        value = loads_job_value(data) if type(data) is bytes else data
        self.reused += 1
        if state == "done":
            return value, None, None
        exc = value[0] if isinstance(value, tuple) else GrainError(error)
        add_note(exc, f"grain: the result of an earlier run, from {self.store.path}")
        return None, exc, kind

    def record(self, job, value, error, kind, pickled=None):
        """Remember how ``job`` ended (``pickled``: its value as its worker sent it)."""
        try:
            data = _stored_value(value, pickled) if error is None else pickled_failure(error)
        except TypeError as e:
            log.warning("the result of %s is not stored: %s", job.name, e)
            return
        if self._sent:  # (jobs in worker processes only)
            self._sent.pop(job.wire, None)
        name = self._functions[job.fn][1]
        self.store.record(job.key, name, "done" if error is None else "failed", data,
                          None if error is None else f"{type(error).__name__}: {error}",
                          kind, job.duration, None if error is None else job.call)

    async def write_now(self):
        """Return once what was recorded until now is in the store (``keep`` writes it;
        when it has ended, the store's close does)."""
        if self._waiting is not None:
            written = trio.Event()
            self._waiting.append(written)
            self._due.set()
            await written.wait()

    async def keep(self):
        """Write recorded results every STORE_FLUSH_S; say the store is held."""
        beat = _now()
        self.store.start_writer()
        self._waiting = waiting = []
        try:
            while True:
                with trio.move_on_after(STORE_FLUSH_S):
                    await self._due.wait()
                self._due = trio.Event()
                waiting, self._waiting = self._waiting, []
                sent = self._sent
                self._sent = {}
                for wire, job in sent.items():  # (and where: see known)
                    self.store.record(wire, self._functions[job.fn][1], "running",
                                      job.worker.ident)
                rows = self.store.take()
                try:
                    await self.store.send(rows)
                except BaseException:  # (cancelled at the end: the store's close writes them)
                    self.store.put_back(rows)
                    raise
                for written in waiting:
                    written.set()
                if _now() - beat > STORE_BEAT_S:
                    beat = _now()
                    self.store.beat()
        finally:  # (its callers go on: the store's close writes what they wait for)
            for written in waiting + (self._waiting or []):
                written.set()
            self._waiting = None


###############################################################################
# Workers #####################################################################
###############################################################################
# A worker, as a head sees it: a name, the resources it has free (``res``, a provider
# the Scheduler allocates from; a worker without WTime gets an unlimited one, so timed
# jobs run there too), a total for display, and ``start(job)``, which launches the job
# without blocking. It reports back to its owner (a HeadCore: see Head service) through
# this protocol, exactly once per job it started:
#
#   owner.job_ended(job, value, error, duration)              a local job ended
#   owner.job_reported(job, ok, data, duration, kind)         a remote one (pickled)
#   owner.job_interrupted(job, kind, why)                     its worker went away
#   owner.job_cancelled(job)                                  cancelled, as asked
#
# and asks ``owner.function_bytes(fn)`` for a job function to send. A remote worker also
# says ``owner.job_sent(job)`` before it sends a job, whose owner may give it the id its
# worker is to know it by (one that may outlive this head: a store key's text, a
# mission's token; or a number no other head gives), and tells it how the runs it came
# back with (for an earlier head) end: ``owner.orphan_ended(w, wire, result)``, and
# ``owner.orphan_adopted(job)`` when a job here takes one.
# Worker is the interface every kind implements: LocalWorker runs jobs as
# tasks of this process; RemoteWorker is a worker process at the other end of a Channel;
# SpecializedWorker runs here the jobs of a worker process that keeps a server.


def _ignore(*args):
    """The handler of messages that need no answer (``ping``)."""


class Worker:
    """A head's view of a worker: the interface every kind of worker implements."""

    where = "local"   # where it runs, for `ls`
    job_id = None     # its batch job, if any
    channel = None    # the connection to its process, if it has one
    pid = host = None
    via = None        # met through a bridge: how ("relayed through bridge HOST:PORT")
    ident = None      # who it is to the next head, if it may come back to one (Reunion)

    def __init__(self, owner, res, name):
        self.owner = owner
        self.name = name
        self.offered = res             # as the worker offered it, for messages
        if _part(res, "WTime") is None:  # no time limit: it runs timed jobs too
            res = res & WTime()
        self.res = res.copy()          # free resources; allocation mutates this copy
        self.total = res.copy()        # for display, and to tell what could ever fit
        self.fleet = (1, _cores_of(res))  # (workers, cores) a mission's status line counts
        self.running = 0
        self.busy = set()              # the jobs running here
        self.accepting = True          # False once told to drain (quit) or retiring
        self.reserved_for = None       # a long-blocked job: no other job starts here
        self.jobs = {}                 # id -> Job, of those it reports on (not the local one)
        self.orphans = {}              # wire id -> allocation of a job no one has claimed yet
        self.leaving = None            # why it announced it leaves, if it did

    def start(self, job):
        raise NotImplementedError

    def cancel_orphan(self, wire):
        """Stop the run ``wire`` at the worker process (one it came back with, that no job
        here claims): a remote or a specialized worker's, which have a channel."""
        self.channel.send(("cancel", wire))

    def adopt(self, job, alloc, now):
        """``job`` runs here already, with ``alloc``: this worker came back to this head
        with it (see Reunion). ``now``: its start, for this head's totals (its duration is
        what the worker says)."""
        job.change("adopt")
        job.alloc = alloc
        job.worker = self
        job.started = now
        self.jobs[job.wire] = job
        self.busy.add(job)

    def adopt_orphan(self, job, now):
        """The Scheduler chose this worker for ``job``, which it came back running before
        anyone claimed it: it goes on here."""
        self.adopt(job, self.orphans.pop(job.wire), now)
        self.owner.orphan_adopted(job)

    def cancel(self, job):
        """Stop a running job whose result nobody wants any more (only a head daemon asks,
        of its remote workers)."""

    def message_handlers(self):
        """What its process may send, by message name."""
        return {"ping": _ignore, "leaving": self.on_leaving}

    def on_leaving(self, why):
        self.leaving = why
        self.accepting = False
        log.info("worker %s is leaving: %s", self.name, why)

    def interrupt_all(self, kind, why):
        """Its process went: the jobs it ran go back to the owner as interrupted."""
        jobs = list(self.jobs.values())
        self.jobs = {}
        for job in jobs:
            self.owner.job_interrupted(job, kind, why)

    def status(self):
        return "leaving" if self.leaving else "up" if self.accepting else "draining"

    def statistics(self):
        return WorkerStatistics(self.name, self.res.stat(), self.total.stat(), self.running,
                                self.status(), self.where, self.job_id, self.via)


WorkerStatistics = namedtuple("WorkerStatistics",
                              "name free total running status where job_id via")
WorkerStatistics.__doc__ = "A worker at one moment; free/total are ``Resource.stat()`` dicts."


class LocalWorker(Worker):
    """Runs jobs as trio tasks in this process, with GVAR set for each (``context`` is their
    GVAR.context; ``output`` a file for what they print, see _routed_job_output). With
    ``in_order``, jobs start in the order given, each running up to its first pause
    before the next begins: upstream Grain guaranteed that order for resource-less calls."""

    def __init__(self, owner, res, name, nursery, context=None, output=None, in_order=False):
        super().__init__(owner, _local_provider(res), name)
        self._nursery = nursery
        self.context = context
        self.output = output
        self._in_order = deque() if in_order else None
        self._tasks = TaskPool(nursery, self._run)

    def start(self, job):
        if self._in_order is None:
            self._tasks.start(job)
        else:  # (while it holds jobs, one task that runs the next is on its way)
            self._in_order.append(job)
            if len(self._in_order) == 1:
                self._nursery.start_soon(self._run_next)

    async def _run_next(self):
        """Run the first job waiting in order, having started a task for the next: trio
        runs that one in its next batch, once this job has paused (no handshake needed)."""
        job = self._in_order.popleft()
        if self._in_order:
            self._nursery.start_soon(self._run_next)
        await self._run(job)

    async def _run(self, job):
        if self.output is not None:
            _OUTPUT.set(self.output)
        clock = self.owner.clock
        started = clock()
        value = error = None
        try:
            value = await run_job_here(job.fn, job.args, job.kwargs, job.alloc, self.name,
                                       self.context, job.T)
        except JOB_ERRORS as e:
            error = e
        self._report(job, value, error, clock() - started)

    def _report(self, job, value, error, duration):
        self.owner.job_ended(job, value, error, duration)


@contextlib.contextmanager
def _routed_job_output(path):
    """The file the local worker's jobs print to (None: the terminal, as any print)."""
    if not path:
        yield None
        return
    with open(path, "a", buffering=1, encoding="utf-8") as f, \
            contextlib.redirect_stdout(StandIn(sys.stdout, _OUTPUT.get)), \
            contextlib.redirect_stderr(StandIn(sys.stderr, _OUTPUT.get)):
        yield f


class RemoteWorker(Worker):
    """A worker process on the other end of a Channel. Functions are sent once per worker
    (by digest); after that a job costs one small frame each way."""

    def __init__(self, owner, res, name, channel, pid=None, host=None, job_id=None):
        super().__init__(owner, res, name)
        self.channel = channel
        self.pid = pid
        self.host = host
        self.job_id = job_id
        self.known_functions = set()
        self.via = getattr(channel.stream, "via", None)  # met through a bridge: how
        self.ours = False  # it came back to the head it had left (see Reunion)

    where = property(lambda self: f"pid {self.pid} on {self.host}" +
                     (f", {self.via}" if self.via else ""))

    def _send_function(self, fn, named=False):
        """Send ``fn`` (``named``: with its name) unless the peer has it already; returns
        its digest."""
        digest, fn_bytes = self.owner.function_bytes(fn)
        if digest not in self.known_functions:
            self.known_functions.add(digest)
            self.channel.send(("fn", digest, fn_bytes) + ((_callable_name(fn),) if named else ()))
        return digest

    def start(self, job):
        self.owner.job_sent(job)  # (first: it may give the job the id its worker knows)
        self.jobs[job.wire] = job
        self.channel.send(("run", job.wire, self._send_function(job.fn), job.payload,
                           job.alloc, job.T))

    def message_handlers(self):
        return dict(super().message_handlers(), done=self.on_done, cancelled=self.on_cancelled)

    def on_done(self, jid, ok, data, duration, kind=None):
        job = self.jobs.pop(jid, None)
        if job is not None:
            self.owner.job_reported(job, ok, data, duration, kind)
        else:  # one it ran while it had no head: it may be what a job waits for
            self.owner.orphan_ended(self, jid, (ok, data, duration, kind))

    def cancel(self, job):
        """(Its resources come back when the worker confirms, or reports it done anyway.)"""
        if job.wire in self.jobs:
            self.cancel_orphan(job.wire)

    def on_cancelled(self, jid):
        if (job := self.jobs.pop(jid, None)) is not None:
            self.owner.job_cancelled(job)
        else:
            self.owner.orphan_ended(self, jid)


class SpecializedWorker(LocalWorker):
    """A specialized worker (upstream's "bring your own server"): its process keeps a server
    running (the module's ``grain_run_sworker()``), and its jobs run here, in the mission,
    each seeing the client that ``grain_context(**info)`` made as ``GVAR.context``. Jobs
    still running when the process goes are re-queued, as a remote worker's would be."""

    where = property(lambda self: f"pid {self.pid} on {self.host} (specialized)")

    def __init__(self, owner, res, name, nursery, context, channel, pid, host, job_id):
        super().__init__(owner, res, name, nursery, context)
        self.channel = channel
        self.pid = pid
        self.host = host
        self.job_id = job_id
        self.scopes = {}     # job id -> its cancel scope

    def start(self, job):
        self._nursery.start_soon(self._run_here, job)

    async def _run_here(self, job):
        with trio.CancelScope() as self.scopes[job.id]:
            self.jobs[job.id] = job
            await self._run(job)
        del self.scopes[job.id]

    def _report(self, job, value, error, duration):
        if self.jobs.pop(job.id, None) is not None:  # else interrupted already
            self.owner.job_ended(job, value, error, duration)

    def interrupt_all(self, kind, why):
        for scope in self.scopes.values():
            scope.cancel()
        super().interrupt_all(kind, why)


async def _enter_backendless(stack, module, res):
    """Start a backendless specialized worker in this process, for as long as ``stack`` is
    open: (name, GVAR.context, resources)."""
    info = dict(await stack.enter_async_context(module.grain_run_sworker()))
    name = info.pop("name", None) or module.__name__
    value = await stack.enter_async_context(module.grain_context(**info))
    log.info("specialized worker %s (backendless, %s) with %r", name, module.__name__, res)
    return name, value, res


###############################################################################
# Head service ################################################################
###############################################################################
# Where workers and CLI clients reach a head -- a mission's own, or the head daemon --
# at its address: the first message of a connection says who it is. A registered
# worker is served until it leaves or is lost, and its running jobs go back to its
# owner as interrupted; CLI commands are answered from a table of handlers. The owner is
# a HeadCore (see Head state) plus serve_mission(channel, info) and warn_all(text). The
# head's timers are here too: start_head starts them for a HeadCore.


async def warn_of_stuck_queues(scheduler):
    """Every STUCK_CHECK_S, warn each queue (its mission) whose oldest job fits no worker
    (Scheduler.stuck): a head's task, a mission's own or the daemon's."""
    while True:
        await trio.sleep(STUCK_CHECK_S)
        for queue, text in scheduler.stuck():
            queue.warn(text)


# The amounts `ls` shows of each worker, free/total: (its key in `stats`, the resource kind,
# the format of the pair). GPUs get a column only when some worker has one.
LS_AMOUNTS = (("cores", "Cores", "{}/{}"), ("memory", "Memory", "{:g}/{:g} GB"),
              ("gpus", "Gpus", "{:g}/{}"))


def start_head(core, nursery, push):
    """Start the timers of the head ``core`` (a HeadCore) in ``nursery``: its Reunion's
    hold, from now (the jobs it held then go to ``push``), the holds of jobs_held, and the
    warnings of stuck queues. From now on its clock is the run's clock's own method, read
    several times a job: a third of the calls of trio.current_time()."""
    core.clock = core.scheduler.clock = trio.lowlevel.current_clock().current_time
    core.reunion = Reunion(core.reported, clock=core.clock, claim=core.scheduler.claim,
                           push=functools.partial(core.queue_held, push))
    core.tasks = nursery
    nursery.start_soon(keep_reunion, core.reunion)
    nursery.start_soon(warn_of_stuck_queues, core.scheduler)


async def keep_reunion(reunion):
    """A Reunion's timers: the end of its hold, then every tenth of ORPHAN_WAIT_S a look
    for the runs and results no job claimed in time."""
    await trio.sleep(max(0.0, reunion.hold_until - reunion.clock()))
    reunion.hold_ended()
    while True:
        await trio.sleep(ORPHAN_WAIT_S / 10)
        reunion.forget_unclaimed()


async def hold_jobs(core, jobs, w, why, hold, alive):
    """The hold of ``jobs`` (HeadCore.jobs_held): ``hold`` seconds at most for their worker
    ``w`` (which ``why``) to come back to this head with them, and, with ``alive`` (the
    file it touches while its node is up: it went silent but was not gone), only while it
    touches that; then the head releases those it did not come back with."""
    why_not = f"it is not back after {hold:g} s"
    with trio.move_on_after(hold):
        # (the file is looked at here, not in a thread: as the Edge file, it is small
        # and on a filesystem the head needs anyway)
        while core.still_held(jobs):
            if w.ident is not None and any(o.ident == w.ident for o in core.workers):
                why_not = "it came back without them"
                await trio.sleep(HEARTBEAT_S)  # (the results it reported are on their way)
                break
            if alive is not None and not touched_within(alive, ALIVE_S):
                why_not = f"{alive} was not touched in the last {ALIVE_S:g} s"
                break
            await trio.sleep(HEARTBEAT_S if alive else hold)
    core.release_held(jobs, w, why, why_not)


class HeadService:
    """Serves a head's address: workers register, CLI clients send commands, missions
    attach (the owner decides). ``commands`` adds to (or replaces) the CLI commands
    ``stats`` and ``quit``; ``job_book`` is ``(system, JobBook, custom)`` of the worker
    jobs to watch for ones that end without joining; ``specialized``: whether the jobs of
    specialized workers may run here (not in the head daemon, which runs no user code)."""

    def __init__(self, owner, listen, key, *, max_frame=MAX_FRAME, job_book=None,
                 commands=None, specialized=True):
        self.owner = owner
        self.listen = listen
        self.key = key
        self.max_frame = max_frame
        self.job_book = job_book
        self.specialized = specialized
        self.commands = {"stats": self.stats, "quit": self.quit, **(commands or {})}
        self.urls = {}                # where it listens: {interface: url}
        # batch job id -> how often its worker registered (its keys: every one that ever did)
        self.registered = Counter()
        self.joining = set()          # channels of peers that have not said who they are
        self.goodbye = None           # what say_goodbye told the workers
        self._nursery = None

    async def run(self, *, task_status=TASK_STATUS_IGNORED):
        """Serve until cancelled; started() with the URLs once peers can connect."""
        async with open_strict_nursery() as nursery:
            self._nursery = nursery
            self.urls = await nursery.start(serve, self.listen, self.key, self.handle_connection)
            if self.job_book is not None:
                nursery.start_soon(self._watch_submitted_jobs)
            task_status.started(self.urls)

    async def handle_connection(self, stream, peer, assign=None):
        """One authenticated peer: a worker registering, a CLI command, or a mission. With
        ``assign``, the peer is a passive worker we dialled: it offers those resources."""
        try:
            async with open_channel(stream, peer, max_frame=self.max_frame) as channel:
                if assign is not None:
                    channel.send(("assign", assign))
                self.joining.add(channel)
                try:
                    first = await channel.receive()
                finally:
                    self.joining.discard(channel)
                if first is not None:
                    await dispatch({"register": functools.partial(self._keep_worker, channel),
                                    "cli": functools.partial(self._answer, channel),
                                    "mission": functools.partial(self.owner.serve_mission,
                                                                 channel)}, first, peer)
        except (PeerError, OSError, trio.BrokenResourceError, KeyError, TypeError) as e:
            log.warning("connection from %s dropped: %s", peer, e)
        except Exception:  # a message we misread: the head goes on (and says what it was)
            log.exception("connection from %s dropped: a message it sent could not be "
                          "handled", peer)

    async def dial_passive(self, url, assign):
        """Dial a passive worker (``worker --listen``) and give it ``assign`` to offer."""
        try:
            stream = await connect(url, self.key)
        except (Unreachable, PeerError, OSError) as e:
            log.warning("passive worker at %s: %s", url, e)
            return
        async with stream:
            await self.handle_connection(stream, url, assign)

    # -- workers ---------------------------------------------------------------------
    async def _keep_worker(self, channel, info):
        resume = info.get("resume") if isinstance(info, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("res"), Resource) or \
                not isinstance(resume, (dict, type(None))):
            raise PeerError(f"a worker's registration must be a dict with its resources "
                            f"(and a dict of the jobs it runs), got {info!r:.80}")
        sworker = info.get("sworker")
        args = (info["res"], info["name"])
        more = (channel, info.get("pid"), info.get("host"), info.get("job_id"))
        if sworker is None:
            await self._serve_worker(channel, info, RemoteWorker(self.owner, *args, *more))
            return
        if not self.specialized:
            raise PeerError(f"specialized worker {info['name']} ({sworker['type']}): only a "
                            "mission that is its own head runs specialized workers' jobs")
        module = load_module(sworker["type"], "specialized worker type")
        async with module.grain_context(**sworker["info"]) as value, \
                open_strict_nursery() as jobs:  # its jobs run here; gone when it goes
            await self._serve_worker(channel, info, SpecializedWorker(
                self.owner, *args, jobs, value, *more))

    async def _serve_worker(self, channel, info, w):
        """Serve a registered worker until it leaves or is lost, then re-queue its jobs."""
        self.registered[info.get("job_id")] += 1
        if self.goodbye is not None:  # it registered as the mission ended: goodbye to it too
            return channel.send(self.goodbye)
        w.ours = info.get("head") == self.owner.instance
        if info.get("reattach", 1):
            w.ident = f"{w.name} (pid {w.pid} on {w.host})"
        w.channel.send(("head", self.owner.instance))
        self.owner.worker_came_back(w, info.get("resume") or {})
        self.owner.add_worker(w)
        log.info("worker %s %s from %s (pid %s) with %r", w.name,
                 "came back" if info.get("resume") is not None else "joined", channel.peer,
                 w.pid, w.offered)
        why = "was lost (its connection closed)"
        kind = RETRY_LOST
        try:
            if self.job_book is not None and info.get("job_id"):
                await trio.to_thread.run_sync(self.job_book[1].mark_joined, info["job_id"])
            await channel.dispatch_all(w.message_handlers(), self.owner.pump)
        except PeerError as e:
            why = f"was dropped ({e})"
            log.warning("worker %s from %s %s", w.name, channel.peer, why)
        finally:
            self.owner.worker_gone(w)
            if self.goodbye == ("leave",):  # told to leave as its mission failed or was
                w.jobs = {}  # stopped: its jobs went with the mission, not with a lost worker
            if channel.silent:
                why = f"was lost (silent for {SILENT_S:g} s)"
            if w.leaving:
                why = f"retired ({w.leaving})"
                kind = RETRY_RETIRED
            hold = None
            alive = None
            how = "re-queueing them"
            if why.endswith("(its connection closed)") and w.via is not None and \
                    w.via.startswith("relayed"):  # (its bridge went, probably, not the worker)
                hold = REJOIN_WAIT_S
                how = f"holding them {REJOIN_WAIT_S:g} s for it to come back"
            elif channel.silent and w.jobs and (alive := self._alive_file(info)) is not None \
                    and touched_within(alive, ALIVE_S) and not any(  # (cut off; jobs run on)
                        o.ident == w.ident for o in self.owner.workers):  # (not back already)
                hold = info["reattach"]
                how = (f"its node is up (it still touches {alive}): holding them while it "
                       f"does, {hold:g} s at most (its reattach), for it to come back")
            if w.jobs:
                log.warning("worker %s %s with %d job(s) running; %s", w.name, why,
                            len(w.jobs), how)
            if hold is not None:
                jobs = list(w.jobs.values())
                w.jobs = {}
                self.owner.jobs_held(jobs)
                self.owner.tasks.start_soon(hold_jobs, self.owner, jobs, w, why, hold, alive)
            w.interrupt_all(kind, why)
            if channel.silent and self.job_book is not None and w.job_id:
                self._nursery.start_soon(self._cancel_unless_back, w, info.get("reattach", 0),
                                         self.registered[w.job_id])

    def _alive_file(self, info):
        """The alive file of the worker that registered with ``info``, if it touches one and
        keeps its jobs for a new head: in this head's folder for them (a worker names its
        file there, no other)."""
        name = info.get("alive")
        folder = alive_folder(self.listen)
        if folder and isinstance(name, str) and re.fullmatch(r"[\w.-]+", name) and \
                not name.startswith(".") and type(info.get("reattach")) in (int, float) and \
                0 < info["reattach"] < 1e9:  # (a peer's word: checked before a finally uses it)
            return os.path.join(folder, name)
        return None

    async def _cancel_unless_back(self, w, reattach, registered):
        """A worker lost in silence (its node gone, frozen or cut off) that is not back
        within its reattach (it registered ``registered`` times then): its batch job is
        cancelled, not left holding the node. Only a job grain submitted as a worker's:
        one a user started a worker in by hand is theirs."""
        await trio.sleep(reattach + HEARTBEAT_S)
        system, book, custom = self.job_book
        try:
            if self.registered[w.job_id] != registered or not any(
                    r["id"] == w.job_id and r.get("role") == "worker"
                    for r in await trio.to_thread.run_sync(book.records)):
                return
            await trio.to_thread.run_sync(cancel_jobs, system, [w.job_id], custom)
        except (GrainError, OSError) as e:
            log.warning("worker %s was lost and is not back; its batch job %s: %s", w.name,
                        w.job_id, e)
        else:
            log.warning("worker %s was lost and is not back after %g s (its reattach): "
                        "cancelled its batch job %s", w.name, reattach, w.job_id)

    async def say_goodbye(self, abort=False):
        """FIN to every worker process (or, when the mission failed, "leave now": no one will
        read what they are still computing), and wait (FLUSH_S at most) for it to go out; to
        a peer that has not said who it is yet too (a worker that registers hears it)."""
        self.goodbye = ("leave",) if abort else ("fin",)
        remote = [w.channel for w in self.owner.workers if w.channel is not None]
        for channel in remote:
            channel.send(self.goodbye)
            channel.close_after_flush()
        with trio.move_on_after(FLUSH_S):
            for channel in remote + list(self.joining):
                await channel.flushed.wait()

    async def _watch_submitted_jobs(self):
        """Report loudly, with its log's tail, a batch job that ended without its worker
        ever joining (instead of leaving the mission waiting in silence)."""
        system, book, custom = self.job_book
        reported = set()
        while True:
            await trio.sleep(JOB_WATCH_S)
            for r in await trio.to_thread.run_sync(book.waiting, system, custom,
                                                   self.registered.keys() | reported):
                if r["state"] == ENDED:
                    reported.add(r["id"])
                    self.owner.warn_all(f"batch job {r['id']} ({r['name']}) ended without its "
                                        f"worker ever joining; the end of its log {r['log']}:"
                                        f"\n{log_tail(r['log'])}")

    # -- the CLI -----------------------------------------------------------------------
    async def _answer(self, channel, command, *args):
        """Answer a CLI command. A handler returns its reply, or ``(reply, then)``: ``then()``
        runs once the reply has gone out (``stop``: the daemon ends after answering)."""
        handler = self.commands.get(command)
        then = None
        if handler is None:
            reply = {"error": f"the head at {self.listen} (pid {os.getpid()}) runs a mission "
                              f"in-process; `{command}` needs a head daemon (`grain.py head`)"
                     if command in ("stop", "scale") else f"unknown command {command!r}"}
        else:
            try:
                reply = handler(*args)
            except (TypeError, ValueError) as e:
                reply = {"error": f"{command}: {e}"}
            if isinstance(reply, tuple):
                reply, then = reply
        channel.send(("reply", reply))
        channel.close_after_flush()
        await channel.flushed.wait()
        if then is not None:
            then()

    def stats(self):
        """What `ls` shows: the workers, the queue and the counts by failure class."""
        st = self.owner.statistics()
        tally = self.owner.tally
        workers = [dict({key: (w.free.get(kind, (0, 0))[0], w.total.get(kind, (0, 0))[1])
                         for key, kind, _ in LS_AMOUNTS},
                        name=w.name, running=w.running, status=w.status, where=w.where, via=w.via,
                        walltime=w.free["WTime"][0] if w.free["WTime"][0] < math.inf else None,
                        job_id=w.job_id) for w in st.workers]
        return {"workers": workers, "joined_job_ids": sorted(j for j in self.registered if j),
                "queued": st.queued, "running": st.running, **tally.counts,
                "retried_by_class": dict(tally.retried_by_class),
                "failed_by_class": dict(tally.failed_by_class),
                "next": request_text(st.next_request) if st.next_request is not None else None,
                "waiting": self.owner.explain()}

    def quit(self, pattern, force):
        """Make the workers whose names match ``pattern`` leave: after their jobs, or now."""
        done = []
        for w in list(self.owner.workers):
            if not fnmatch.fnmatchcase(w.name, pattern):
                continue
            if w.channel is None:
                done.append(f"{w.name}: the in-process worker cannot quit (skipped)")
                continue
            w.accepting = False
            w.channel.send(("leave",) if force else ("drain",))
            done.append(f"{w.name}: leaving now; its {w.running} running job(s) will be "
                        "re-queued" if force else f"{w.name}: takes no new jobs; leaves after "
                        f"its {w.running} running job(s)")
        return {"done": done or [f"no worker matches {pattern!r}"], "matched": len(done)}


###############################################################################
# Mission link ################################################################
###############################################################################
# How a mission reaches the head daemon for its address: the one on this host (a Unix
# socket in $TMPDIR/grain-<uid>), else one answering at the address elsewhere, else a new
# one it starts, detached. Its Executor then sees the daemon as one more worker that
# takes every job (HeadLink, with an Unlimited provider): the job's request and pickled
# bytes go over, the daemon picks the real worker, and results come back as a worker's.
# The daemon says when a worker starts a job, and what workers it has, for the status line.


def mission_socket_path(address):
    """Where the head daemon for ``address`` takes missions on this host: a Unix socket in
    private_dir()."""
    return os.path.join(private_dir(),
                        f"head-{hashlib.sha1(address.encode()).hexdigest()[:16]}.sock")


def spawn_head(argv, log_file):
    """Start a head daemon detached from this process (own session: a Ctrl-C of the
    mission does not reach it), its output going to ``log_file``."""
    os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
    with open(log_file, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True,
                                env=dict(os.environ, GRAIN_HEAD_LOG=log_file))


async def attach_to_head(address, key, argv, log_file):
    """A stream to the head daemon for ``address``: the one on this host, else one listening
    at the address elsewhere, else a new one started here with ``argv``."""
    sock = f"unix://{mission_socket_path(address)}"

    async def existing():
        for url in (sock, address):
            try:
                return await connect(url, key)
            except KeyMismatch:  # (one answered: the mission is told why, not a second started)
                raise
            except Unreachable:
                pass

    if (stream := await existing()) is not None:
        return stream
    proc = spawn_head(argv, log_file)
    log.info("started a head daemon (pid %d) for %s; its log: %s", proc.pid, address, log_file)

    async def answered():
        try:
            return await connect(sock, key)
        except Unreachable:
            if proc.poll() is None:  # (starting still)
                raise
        if (stream := await existing()) is not None:  # it may have lost a race with another
            return stream
        tail = " | ".join(line.strip() for line in log_tail(log_file, 3).splitlines())
        # (killed by a signal, it says nothing of the next one: the link tries again)
        error = PeerError if proc.returncode < 0 else GrainError
        raise error(f"the head daemon exited (status {proc.returncode}) before "
                    f"answering; the end of its log {log_file}: {tail}")  # (one line)

    with trio.move_on_after(HEAD_START_S):
        return await retry(answered, Unreachable, HEAD_POLL_S)
    raise GrainError(f"the head daemon (pid {proc.pid}) did not answer within "
                     f"{HEAD_START_S:g} s; see its log {log_file}")


class Unlimited(Resource):
    """A provider that grants every request, allocating nothing: the head daemon, as its
    missions see it, decides where jobs run."""

    kind = None
    __slots__ = ()

    def _parts(self):
        return {}

    def request(self, req):
        return True

    def _take(self, req):
        return ZERO

    def __and__(self, other):
        return self

    def _repr(self):
        return "unlimited"


class HeadLink(RemoteWorker):
    """The head daemon, as one worker of a mission that takes every job: it forwards the
    job's request and pickled bytes. Results come back as they would from a worker. A job
    is busy, and has started, once the daemon says one of its workers started it."""

    def __init__(self, owner, channel, info, resumed):
        super().__init__(owner, Unlimited(), "head", channel, info.get("pid"), info.get("host"))
        self.log_file = info.get("log") or "(unknown)"
        self.resumed = resumed  # ids of jobs an earlier daemon had: this one is told so
        self.fleet = info.get("workers", (0, 0))  # (the daemon's)

    def start(self, job):
        digest = self._send_function(job.fn, named=True)
        self.jobs[job.id] = job
        self.busy.discard(job)
        job.started = None
        resumed = job.id in self.resumed
        self.resumed.discard(job.id)
        self.channel.send(("job", job.id, job.req, digest, job.payload) +
                          ((True,) if resumed else ()))

    def on_started(self, ref):
        if (job := self.jobs.get(ref)) is not None:
            job.started = self.owner.clock()
            self.busy.add(job)

    def message_handlers(self):
        return {"done": self.on_done, "ping": _ignore, "started": self.on_started,
                "workers": lambda *fleet: setattr(self, "fleet", fleet),
                "warn": lambda text: log.warning("%s", text)}


def _refused(why):
    raise GrainError(why)


class MissionLink:
    """A mission's connection to the head daemon, opened when its first job with resources
    is queued (``open``). If the daemon goes away, the jobs it had go back to the mission's
    queue, and the link opens again (to a new daemon) for them: they go over as "resumed",
    for the workers that ran them may come back to that daemon still running them, or
    with their results (see Reunion). The mission's random ``token`` in its greeting makes
    its jobs' ids on the workers its own."""

    def __init__(self, owner, attach, info, max_frame=MAX_FRAME):
        self.owner = owner
        self.attach = attach
        self.max_frame = max_frame
        self.info = dict(info, token=os.urandom(8).hex())
        self.open_ = False  # attaching or attached
        self.resumed = set()  # ids of the jobs the last daemon had
        self.closed_on_us = 0  # daemons in a row that closed before answering

    def open(self, nursery):
        if not self.open_:
            self.open_ = True
            self.nursery = nursery
            nursery.start_soon(self._run)

    async def _run(self):
        link = None
        why = "went away (its connection closed)"
        try:
            stream = await self.attach()
            async with open_channel(stream, "the head daemon", max_frame=self.max_frame,
                                    silent_after=HANDSHAKE_TIMEOUT_S + SILENT_S) as channel:
                channel.send(("mission", self.info))
                reply = await channel.receive()
                if reply is None:  # killed, or quitting idle, as we came: try the next
                    raise PeerError("it closed the connection before answering")
                info = dispatch({"attached": dict, "refused": _refused}, reply, channel.peer)
                channel.silent_after = None  # a busy daemon may be slow: its missions wait
                link = HeadLink(self.owner, channel, info, self.resumed)
                self.closed_on_us = 0
                log.info("attached to the head daemon (pid %s on %s; log %s)", link.pid,
                         link.host, link.log_file)
                self.owner.add_worker(link)
                await channel.dispatch_all(link.message_handlers())
            if channel.silent and link is None:
                raise GrainError("the head daemon did not answer this mission")
        except PeerError as e:
            why = f"was dropped ({e})"
            if link is None:
                self.closed_on_us += 1
                if self.closed_on_us >= ATTACH_TRIES:
                    self.owner.fail_queued(f"the head daemon for this mission: {e} "
                                           f"({ATTACH_TRIES} times in a row)")
        except (GrainError, OSError) as e:
            self.owner.fail_queued(f"{e}")
        finally:
            self.open_ = False
            if link is None and 0 < self.closed_on_us < ATTACH_TRIES:
                self.open(self.nursery)
            if link is not None:
                self.owner.remove_worker(link)
                if not self.owner.closing and link.jobs:
                    log.warning("the head daemon %s with %d job(s) of this mission; handing "
                                "them to the next one; its log: %s", why, len(link.jobs),
                                link.log_file)
                    jobs = list(link.jobs.values())
                    link.jobs = {}
                    self.resumed.update(job.id for job in jobs)
                    self.owner.hand_back(jobs)


###############################################################################
# Watching a mission ##########################################################
###############################################################################
# What a mission shows of itself: MissionRecord keeps, beside the jobs (which record
# their request, allocation, worker, times, attempts and failure class), the workers and
# when they came and went; at the end it gives the totals of the last log line (jobs,
# core-hours, utilization) and, asked to, a report: one self-contained HTML file (inline
# SVG and CSS, no script), for any browser, from a cluster's home directory.

REPORT_WIDTH = 1000        # pixels of the report's time axis
REPORT_MAX_BARS = 3000     # above this, a core's jobs closer than a pixel are drawn as one


def _job_cores(job):
    """The cores a job held: its allocation's, or (through a head daemon, whose workers a
    mission does not see) its request's."""
    return _cores_of(job.alloc) or _cores_of(job.req)


class MissionRecord:
    """The workers a mission saw, and its totals and report from its jobs."""

    def __init__(self):
        self.t0 = _now()
        self.workers = []   # [worker, joined, left (None while there)]

    def joined(self, w):
        self.workers.append([w, _now(), None])

    def left(self, w):
        for entry in self.workers:
            if entry[0] is w and entry[2] is None:
                entry[2] = _now()

    def totals(self, jobs, end=None):
        """jobs (the calculations submitted), done, failed, and core-seconds used (by those
        a worker started, while they ran) and held (by the workers)."""
        end = _now() if end is None else end
        # (what its worker measured, when it ended; but no more than it ran here: one a
        # worker came back with ran for the last head too)
        used = sum(_job_cores(j) * min((j.ended or end) - j.started, j.duration if
                                       j.duration is not None and j.ended else math.inf)
                   for j in jobs if j.started is not None)
        held = sum(_cores_of(w.total) * ((left or end) - joined)
                   for w, joined, left in self.workers)
        return {"jobs": len(jobs), "done": sum(j.state == "done" for j in jobs),
                "failed": sum(j.state == "failed" for j in jobs), "used": used, "held": held}

    def summary(self, jobs, here=0, stored=None):
        """The totals of ``jobs`` in words; ``here``: the calls without resources besides
        (run in the mission: not jobs, and not billed); ``stored``: the results store
        (MissionResults), which gave some of them."""
        t = self.totals(jobs)
        share = (f" of {t['held'] / 3600:.3g} allocated ({t['used'] / t['held']:.0%} "
                 "utilization)") if t["held"] else ""
        unended = t["jobs"] - t["done"] - t["failed"]
        how = "".join(f", {n} {k}" for k, n in (("failed", t["failed"]), ("not ended", unended))
                      if n)
        parts = [f"{t['done']} done{how}"] if how else []
        if stored is not None and stored.reused:  # (they ran in an earlier run: no time here)
            parts.append(f"{stored.reused} from the results store {stored.store.path}")
        jobs = f"{t['jobs']} jobs" + (f" ({'; '.join(parts)})" if parts else "")
        text = f"{jobs}, {t['used'] / 3600:.3g} core-hours used{share}"
        if here:
            text = (text + "; " if t["jobs"] else "no job asked for resources; ") + \
                f"{here} call(s) without resources ran in the mission"
        return text

    def write_html(self, path, jobs, title="grain mission"):
        """The mission report (see the section) to ``path``; a failure is logged, not
        raised: a report is not worth the mission's result."""
        try:
            atomic_write(path, _report_html(self, jobs, _now(), title).encode(), mode=0o644)
        except OSError as e:
            log.error("the mission report %s could not be written: %s", path, e.strerror or e)


class ProgressLine:
    """A mission's one status line, at the bottom of its terminal, redrawn at most twice a
    second: of the jobs submitted that ask for resources, those done, running (started on a
    worker), queued (the rest not ended), failed (by class); the workers (a head daemon's
    own) and cores busy, or that none has joined; elapsed and the time left at that rate.
    Whatever else is written there (print, grain's log) clears it first, so lines never
    mix; it comes back at the next redraw, once that output has ended its line."""

    def __init__(self, executor, stream):
        self.executor = executor
        self.stream = stream
        self.shown = False
        self.partial = False   # others wrote half a line: do not draw over it

    @staticmethod
    def wanted(stream):
        """On a terminal, and only when grain configured logging (not the application)."""
        return (stream.isatty() and not logging.getLogger().handlers and
                all(getattr(h, "grain_default", False) for h in log.handlers))

    def text(self, narrow=False):
        """The line; ``narrow``: for a narrow terminal, without how to start workers when none
        joined (a long hint) and the failures but for how many there are, if any."""
        exer = self.executor
        counts = exer.tally.counts
        workers = exer.workers
        done = counts["done"]
        failed = counts["failed"]
        total = len(exer._jobs) - exer._here
        running = [j for w in workers for j in w.busy]
        n, held = map(sum, zip((0, 0), *(w.fleet for w in workers)))
        elapsed = _now() - exer.record.t0
        ended = done + failed
        left = f" (~{format_walltime((total - ended) * elapsed / ended)} left)" \
            if ended and total > ended else ""
        why = ", ".join(f"{k}: {v}" for k, v in sorted(exer.tally.failed_by_class.items()))
        # (attached to the head daemon, its one "worker" is the link: the daemon's own
        # warnings say whether workers joined there and left)
        attached = exer._link is not None
        where = (f"{sum(map(_job_cores, running))}/{held} cores busy on {n} worker(s)" if n
                 else "not attached to the head daemon yet" if attached and not workers
                 else no_worker_text(0 if attached else exer.scheduler.joined, not narrow))
        failures = "" if narrow and not failed else \
            f", {failed} failed" + (f" ({why})" if why and not narrow else "")
        return (f"{format_walltime(elapsed)}{left} | {done}/{total} done, {len(running)} "
                f"running, {total - ended - len(running)} queued{failures} | {where}")

    def clear(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.shown = False

    def before_write(self, text):
        """Someone else writes ``text`` to the terminal."""
        self.clear()
        self.partial = bool(text) and not text.endswith("\n")

    def close(self):
        self.clear()
        self.partial = True  # nothing drawn from now on

    def draw(self):
        import shutil
        with TERMINAL:
            if not self.partial:
                columns = shutil.get_terminal_size().columns - 1
                # (on a narrow terminal, not the hint cut mid-word: the stuck-queue
                # warning gives it in full, STUCK_WARN_S on)
                if len(line := self.text()) > columns:
                    line = self.text(narrow=True)
                self.stream.write("\r\x1b[K" + line[:columns])
                self.stream.flush()
                self.shown = True

    async def run(self):
        while True:
            self.draw()
            await trio.sleep(0.5)


def start_progress(executor, stack, nursery):
    """Show the mission's status line (ProgressLine) while ``stack`` is open, if wanted."""
    stream = sys.stderr
    if not ProgressLine.wanted(stream):
        return
    line = ProgressLine(executor, stream)
    under = functools.partial(StandIn, before=line.before_write)
    for handler in log.handlers:  # grain's own log goes through the stand-in too
        stack.callback(handler.setStream, handler.setStream(under(stream)))
    stack.enter_context(contextlib.redirect_stdout(under(sys.stdout)))
    stack.enter_context(contextlib.redirect_stderr(under(stream)))
    stack.callback(line.close)
    nursery.start_soon(line.run)


def _colour(name):
    import zlib
    return f"hsl({zlib.crc32(name.encode()) % 360},60%,55%)"


def _report_rows(record, ran):
    """``[(worker name, core id)]`` from top to bottom, and each (worker, core)'s row."""
    rows = []
    where = {}
    for w, _, _ in record.workers:
        c = _part(w.total, "Cores")
        for core in (c.c if c is not None else []):
            where[(id(w), core)] = len(rows)
            rows.append((w.name, core))
    for j in ran:  # jobs whose worker held no cores (a head daemon's, as a mission sees it)
        if _cores_of(j.alloc) == 0 and (id(j.worker), None) not in where:
            where[(id(j.worker), None)] = len(rows)
            rows.append((getattr(j.worker, "name", "?"), None))
    return rows, where


def _report_bars(ran, where, t0, end, x, h):
    """SVG rects: a bar per job and core run; merged when there are too many."""
    import html
    per_row = {}
    for j in ran:
        c = _part(j.alloc, "Cores")
        for core in (c.c if c is not None and c.N else [None]):
            row = where.get((id(j.worker), core))
            if row is not None:
                per_row.setdefault(row, []).append(j)
    merge = sum(len(v) for v in per_row.values()) > REPORT_MAX_BARS
    out = []
    for row, js in per_row.items():
        js.sort(key=lambda j: j.started)
        i = 0
        while i < len(js):
            first = js[i]
            k = i + 1
            stop = first.ended or end
            while merge and k < len(js) and (js[k].started - stop) * x < 1:
                stop = max(stop, js[k].ended or end)
                k += 1
            x0 = (first.started - t0) * x
            w = max((stop - first.started) * x, 0.5)
            name = _callable_name(first.fn) if first.fn is not None else "?"
            if k - i > 1:
                label = f"{k - i} jobs from {name}"
                cls = "jobs"
            else:
                label = f"{first.call}: {stop - first.started:.2f} s"
                cls = "job failed" if first.state == "failed" else "job"
            out.append(f'<rect class="{cls}" x="{x0:.1f}" y="{row * h}" width="{w:.1f}" '
                       f'height="{max(h - 1, 1)}" fill="{_colour(name)}"><title>'
                       f'{html.escape(label)}</title></rect>')
            i = k
    return out


def _report_use(record, ran, t0, end, x):
    """Two step lines: cores busy with jobs, and cores held by workers, over time."""
    steps = [(j.started, _job_cores(j), 0) for j in ran] + \
        [(j.ended or end, -_job_cores(j), 0) for j in ran] + \
        [(joined, _cores_of(w.total), 1) for w, joined, _ in record.workers] + \
        [(left or end, -_cores_of(w.total), 1) for w, _, left in record.workers]
    steps.sort(key=lambda s: s[0])
    level = [0, 0]
    points = ([], [])
    top = 1
    for t, d, kind in steps:  # a step at each pixel where the level changed
        px = round((t - t0) * x, 1)
        if points[kind] and points[kind][-1][0] == px:
            points[kind].pop()
        else:
            points[kind].append((px, level[kind]))
        level[kind] += d
        points[kind].append((px, level[kind]))
        top = max(top, level[kind])
    return points, top


def _report_html(record, jobs, end, title):
    import html
    ran = [j for j in jobs if j.started is not None]
    t0 = min([record.t0] + [j.started for j in ran])
    x = REPORT_WIDTH / max(end - t0, 1e-3)
    t = record.totals(jobs, end)
    rows, where = _report_rows(record, ran)
    h = 10 if len(rows) <= 60 else max(1, 600 // len(rows))
    bars = _report_bars(ran, where, t0, end, x, h)
    (busy, held), top = _report_use(record, ran, t0, end, x)

    def line(points, cls):
        pts = " ".join(f"{px},{120 - 110 * v / top:.1f}" for px, v in points)
        return f'<polyline class="{cls}" points="{pts}"/>'

    labels = [f'<text x="-4" y="{i * h + 8}">{html.escape(name)}</text>'
              for i, (name, _) in enumerate(rows) if name != (rows[i - 1][0] if i else None)]
    slow = sorted((j for j in ran if j.ended), key=lambda j: j.started - j.ended)[:10]
    failed = [j for j in jobs if j.state == "failed"][:50]
    use = f"{t['used'] / t['held']:.0%}" if t["held"] else "unknown (the head daemon's)"
    cells = [("jobs", t["jobs"]), ("done", t["done"]), ("failed", t["failed"]),
             ("wall time", f"{end - t0:.1f} s" if end - t0 < 60 else format_walltime(end - t0)),
             ("core-hours allocated", f"{t['held'] / 3600:.3g}"),
             ("core-hours used by jobs", f"{t['used'] / 3600:.3g}"), ("utilization", use)]
    esc = html.escape
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>",
        "body{font:14px sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
        "td,th{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}"
        "svg text{font:10px sans-serif;text-anchor:end}"
        ".failed{stroke:#c00;stroke-width:1}.busy{fill:none;stroke:#2a7}"
        ".held{fill:none;stroke:#888;stroke-dasharray:4 2}", "</style></head><body>",
        f"<h1>{esc(title)}</h1><table>" +
        "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells) + "</table>",
        f"<h2>Jobs on each worker's cores</h2><svg class='timeline' width="
        f"'{REPORT_WIDTH + 120}' height='{len(rows) * h + 10}'><g transform="
        f"'translate(110,0)'>", *labels, *bars, "</g></svg>",
        f"<h2>Cores busy (green) and held (grey), up to {top}</h2><svg width="
        f"'{REPORT_WIDTH + 120}' height='125'><g transform='translate(110,0)'>",
        line(held, "held"), line(busy, "busy"), "</g></svg>",
        "<h2>Slowest jobs</h2><table><tr><th>job</th><th>seconds</th><th>waited (s)</th>"
        "<th>worker</th></tr>" +
        "".join(f"<tr><td>{esc(j.call)}</td><td>{j.ended - j.started:.2f}</td><td>"
                f"{j.started - (j.submitted or j.started):.2f}</td><td>"
                f"{esc(getattr(j.worker, 'name', '?'))}</td></tr>" for j in slow) + "</table>",
        f"<h2>Failures ({t['failed']})</h2><table><tr><th>job</th><th>class</th>"
        "<th>attempts</th><th>error</th></tr>" +
        "".join(f"<tr><td>{esc(j.call)}</td><td>{esc(str(j.kind))}</td><td>{j.attempts}"
                f"</td><td>{esc(type(j.error).__name__)}: {esc(str(j.error))[:300]}</td></tr>"
                for j in failed) + "</table>", "</body></html>"])


###############################################################################
# Executor ####################################################################
###############################################################################
# A mission's engine, a HeadCore: it takes jobs (submit), runs those without resources
# here at once and queues the others, retries failures by class (its Retries), and hands
# results to whoever awaits them. It is the head of its mission -- with an in-process
# worker, a HeadService for workers joining at its address -- or it is attached to a
# head daemon through a MissionLink.


class BurstClock:
    """A head's clock to the millisecond: the jobs submitted in one burst share one float
    (24 bytes a queued job fewer)."""

    def __init__(self, head):
        self.head = head
        self.last = -math.inf

    def __call__(self):
        now = self.head.clock()
        if now - self.last > 1e-3:
            self.last = now
        return self.last


# Upstream Grain's executor arguments that mean nothing here, and why.
_NO_EFFECT = {
    "_n": "grain.py runs the executor in a nursery of its own",
    "config": "give run() config_file=... instead of a loaded config",
    "stat_tag": "grain.py keeps no timing statistics by tag; `ls` counts jobs by failure class",
    "sworker_config": "specialized workers come from worker.specialized_type in the config",
    "gnaw": "missions find the head daemon by the address (head.listen)",
}


@dataclass(frozen=True)
class MissionSetup:
    """What a mission's config adds to its executor (see run()); GrainExecutor's defaults
    otherwise."""
    attach: object = None          # async () -> a stream to the head daemon; None: the head
    info: dict = field(default_factory=dict)  # the mission, for the daemon's `ls`
    listen_optional: bool = False  # another head has the address: run on, not listening
    job_book: tuple = None         # (system, JobBook, custom) of worker jobs to watch
    context: object = None         # grain_context of the context module, for local jobs
    job_log: str = None            # where local jobs print (head.log_file)
    backendless: tuple = ()        # (module, resources) of backendless specialized workers
    workers_fixed: bool = False    # no other worker can join (run() listening nowhere)


def _asks_nothing(req):
    """Whether a job of request ``req`` runs in the mission itself, at once: a wrapper of
    calculations, not one, which the mission's counts and totals leave out."""
    return req is ZERO or (req.kind is None and not req._parts())


def _worker_sources(waddrs, rpw):
    """GrainExecutor's passive workers as URLs (upstream's host names: port 4242), and its
    local worker's resources (upstream's order; grain.py's ``GrainExecutor(rpw)`` too)."""
    if isinstance(waddrs, Resource):
        waddrs, rpw = (), waddrs
    urls = [a if "://" in a else f"tcp://{a}:4242" for a in waddrs]
    for url in urls:
        parse_url(url)
    return urls, _resource_arg(rpw, "rpw")


def _resource_arg(value, name):
    """``value``, if it is a Resource (or None); else a TypeError naming the argument."""
    if value is not None and not isinstance(value, Resource):
        raise TypeError(f"{name}= must be a Resource such as Cores(4), got {value!r}")
    return value


class GrainExecutor(HeadCore):
    """Runs jobs where the resources they request fit (see Scheduler for the policy), and
    collects their results. Jobs that request nothing (``ZERO``) skip the queue and run at
    once in this process, in the order they were submitted.

    Failures: a job's exception goes to whoever awaits the job, with its original type; the
    worker keeps serving. Retries as Retries says, then the error is raised with a note of
    how many attempts were made. A failure nobody awaited is raised when the executor
    closes (in an ExceptionGroup): nothing is dropped silently.

    ``waddrs`` are passive workers to dial, given ``rpw`` too (upstream's order of
    arguments; ``GrainExecutor(rpw)`` works as well); ``listen`` an address where workers
    and the CLI reach this head. Use it asynchronously::

        async with GrainExecutor(rpw=Cores(4)) as exer:
            job = exer.submit(Cores(1), fn, x)
            print(await job)

    or synchronously (the jobs run when the ``with`` block ends)::

        with GrainExecutor(rpw=Cores(4)) as exer:
            for x in xs:
                exer.submit(Cores(1), fn, x)
        print(exer.results)            # in submission order
    """

    def __init__(self, waddrs=(), rpw=None, *, temporary_err=(), max_retries=MAX_RETRIES,
                 name="local", listen=None, key=None, max_frame=MAX_FRAME, mission=None,
                 results=None, rerun_failed=True, report=None, progress=None, nolocal=False,
                 reschedule=True, persistent=True, **no_effect):
        self.waddrs, rpw = _worker_sources(waddrs, rpw)
        for arg in no_effect:  # upstream's that mean nothing here; others are refused
            if arg not in _NO_EFFECT:
                raise TypeError(f"GrainExecutor() got an unexpected keyword argument {arg!r}")
            log.warning("GrainExecutor(%s=...) has no effect in grain.py: %s", arg,
                        _NO_EFFECT[arg])
        if not reschedule:  # upstream: "abort on any exception": no retry at all
            temporary_err = ()
            max_retries = 0
        super().__init__(Retries(max_retries, temporary_err, persistent))
        self.rpw = None if nolocal else rpw
        self.local_name = name
        self._main_queue = JobQueue(name)
        self.scheduler.add_queue(self._main_queue)
        self.mission = mission or MissionSetup()
        self.listen = listen
        self.key = key
        self.max_frame = max_frame
        self._link = None if self.mission.attach is None else MissionLink(
            self, self.mission.attach, self.mission.info, max_frame)
        # jobs may leave this process: their function and arguments are pickled at once
        self._remote = bool(listen or self.waddrs or self._link)
        self._workers_fixed = self.mission.workers_fixed and not self._remote
        self.service = None       # the HeadService, while it runs
        self.stored = MissionResults(results, rerun_failed) if results else None  # the store
        self.report = report      # an HTML file
        self.progress = progress  # the status line
        self._jobs = []           # every job, in submission order
        self._here = 0            # those asking nothing (_asks_nothing)
        self._submit_time = BurstClock(self)
        self._last_cores = Cores(1)  # the last Cores(N) asked for (see _submit)
        # Its jobs' numbers on the wire start from a base of its own: a worker that comes
        # back from the head before it (this mission, run again) may still run that one's
        # numbers, which must never be taken for this one's (see job_sent, Reunion)
        self._wire_base = int.from_bytes(os.urandom(5), "big") << 24
        self._outstanding = 0  # (at 0: _changed, see wait_all)
        self.function_bytes = FunctionBytes()  # (the worker protocol's)
        self._nursery = self._zero_worker = self._sync_jobs = self.elapsed = None

    group_times = property(lambda self: self.scheduler.group_times)
    urls = property(lambda self: self.service.urls if self.service else {})
    counts = property(lambda self: self.tally.counts)
    retried_by_class = property(lambda self: self.tally.retried_by_class)

    # -- submission -------------------------------------------------------
    def submit(self, res, fn, *args, **kwargs):
        """Queue ``await fn(*args, **kwargs)`` to run where ``res`` fits; returns the Job."""
        if not isinstance(res, Resource):
            raise TypeError(f"submit(res, fn, ...): res must be a Resource such as Cores(1) "
                            f"or ZERO, got {res!r}")
        if not callable(fn) or not _is_async_callable(fn):
            raise TypeError(f"submit(res, fn, ...): {_callable_name(fn)} is not an async "
                            "function; wrap CPU-bound sync code with @subprocify")
        if self._sync_jobs is not None:  # sync mode: collected now, run at __exit__
            self._sync_jobs.append((res, fn, args, kwargs))
            return len(self._sync_jobs) - 1
        if self._nursery is None:
            raise RuntimeError("GrainExecutor.submit: the executor is not running; use it as "
                               "`async with GrainExecutor(...)` or `with GrainExecutor(...)`")
        return self._submit(res, fn, args, kwargs)

    def _submit(self, res, fn, args, kwargs):
        # One shared empty mapping for the many jobs without keyword arguments: an empty
        # dict each is a quarter of a queued job's memory. And one request for the many
        # that ask for the same Cores(N), each made by its call: 64 bytes a job fewer.
        if type(res) is Cores and res._ids is None:
            if res.N == self._last_cores.N:
                res = self._last_cores
            else:
                self._last_cores = res
        job = Job(next(self._ids), res, fn, args, kwargs or NO_KWARGS, self._main_queue)
        self._prepare_payload(job)  # (first: a job that cannot be sent is not one)
        self._track(job)
        self._enqueue(job)
        return job

    def _track(self, job):
        """Count ``job`` as submitted: ``results`` and ``wait_all`` wait for it."""
        job.submitted = self._submit_time()
        self._jobs.append(job)
        self._here += _asks_nothing(job.req)
        self._outstanding += 1
        self.heap.freeze(job)

    def _submit_after(self, res, fn, args, kwargs, resolve):
        """Submit once ``resolve(args, kwargs)`` (an async function) gives the real arguments
        (delayed calls whose arguments are still pending). A failure to resolve fails the job."""
        job = Job(next(self._ids), res, fn, None, None, self._main_queue)
        self._track(job)

        async def resolve_then_enqueue():
            try:
                job.args, job.kwargs = await resolve(args, kwargs)
                self._prepare_payload(job)
            except Exception as e:
                self.complete(job, None, e)
                return
            self._enqueue(job)

        self._nursery.start_soon(resolve_then_enqueue)
        return job

    def _prepare_payload(self, job):
        """Serialize a job that may leave this process for remote workers now, so what
        cannot be pickled fails at submit time and names the culprit."""
        if self._remote and job.req is not ZERO:
            self.function_bytes(job.fn)
            job.payload = pickle_arguments(job)

    def _enqueue(self, job):
        if _asks_nothing(job.req):
            self.scheduler.launch(job, self._zero_worker)  # in this process, at once
            return
        if self.stored is not None:
            state = self.stored.known(job)
            if state == "stored":  # done before: not again
                self._nursery.start_soon(self._complete_stored, job)
                return
            # held while its worker may come back (only to a head listening for workers)
            if self.reunion.offer(job, hold=self.listen and state):
                return
        if self._workers_fixed and (why := self.scheduler.too_large(job)):  # never to run
            self.complete(job, None, GrainError(f"{why}, and no other worker can join this "
                                                "mission (it listens at no address)"))
            return
        self._queue(job)

    def _queue(self, job, front=False):
        """Into the queue (``front``: ahead, as a retry: it came before the others)."""
        (self.scheduler.push_front if front else self.scheduler.push)(job)
        if self._link is not None:
            self._link.open(self._nursery)

    async def _complete_stored(self, job):
        self.complete(job, *await self.stored.fetch(job))

    # -- workers, and what they report --------------------------------------------
    def add_worker(self, worker):
        super().add_worker(worker)
        self.record.joined(worker)
        self._changed()  # (see wait_for_workers)

    def remove_worker(self, worker):
        super().remove_worker(worker)
        self.record.left(worker)

    def add_local_worker(self, res, name, context=None, output=None):
        """One more in-process worker, holding ``res``."""
        self.add_worker(LocalWorker(self, res, name, self._nursery, context, output))

    async def wait_for_workers(self, n):
        """Wait until at least ``n`` worker processes have joined."""
        while self.joined() < n:
            await self.changed.wait()

    def job_sent(self, job):
        if job.key is not None:
            self.stored.running(job)
        elif job.wire == job.id:  # its number, made this head's as it goes (queued, the job
            job.number_on_wire(self._wire_base)  # shares one int for both: 36 bytes fewer)

    def deliver(self, job, ok, data, duration, kind):
        if job.started is None:  # (it ran for the last head, and ended while there was none)
            job.started = _now() - duration
        job.duration = duration
        self.settle(job, *unpickle_result(job, ok, data), pickled=data)

    # -- completion -----------------------------------------------------------------
    def requeue(self, job):
        if _asks_nothing(job.req):  # it runs here again at once, as the first time
            self._enqueue(job)
        else:
            self._queue(job, front=True)

    def complete(self, job, value, error, kind=None, pickled=None):
        if error is None:
            job.value = value
        else:
            self.retries.note(job, error, kind)
            if str(error).startswith(PAST_T):  # (said where its T passed: here is its name)
                error.args = (f"job {job.name} {error}",)
            job.error = error
            kind = kind or failure_class(error)
        self.end(job, error is None, kind)
        if job.key is not None and job.attempts:
            self.stored.record(job, value, error, kind, pickled)
        if not _asks_nothing(job.req):
            self.tally.ended(job.state, kind)
        if job._event is not None:
            job._event.set()
        self._outstanding -= 1
        if not self._outstanding:
            self._changed()

    def hand_back(self, jobs):
        """The head daemon went with these jobs: queue them ahead of the rest, for the next
        (not a retry: they may still be running; see MissionLink)."""
        for job in reversed(jobs):
            self.scheduler.release(job)
            self.queue_again(job)

    def fail_queued(self, why):
        """Fail every queued job with GrainError(why) (the head daemon cannot be reached)."""
        for job in self.scheduler.take_queued(self._main_queue):
            self.complete(job, None, GrainError(why))

    async def wait_all(self):
        """Wait until every job submitted so far has ended."""
        while self._outstanding:
            await self.changed.wait()

    # -- as a head ------------------------------------------------------------------
    async def serve_mission(self, channel, info, why=None):
        channel.send(("refused", why or f"the head at {self.listen} runs a mission of its own "
                                        f"(pid {os.getpid()} on {hostname()}), not a shared "
                                        "head daemon; give this mission a different address, "
                                        "or local=..."))

    @property
    def results(self):
        """Results in submission order; a failed job's entry is its exception."""
        return [j.value if j.error is None else j.error for j in self._jobs]

    # -- lifetime -----------------------------------------------------------
    async def __aenter__(self):
        self._stack = contextlib.AsyncExitStack()
        try:
            await self._open()
        except BaseException:
            await self._close()
            raise
        return self

    async def _open(self):
        if self.report and (problem := output_path_problem(self.report)):  # said now
            raise GrainError(f"report {self.report}: {problem}")
        if self.stored is not None:  # first: a store another mission holds stops us here
            await trio.to_thread.run_sync(self.stored.store.open)
            self._stack.callback(self.stored.store.close, ended=True)
        # The context modules first: they outlive the nursery where jobs run.
        m = self.mission
        output = self._stack.enter_context(_routed_job_output(m.job_log))
        context = await self._stack.enter_async_context(m.context()) if m.context else None
        backendless = [await _enter_backendless(self._stack, module, res)
                       for module, res in m.backendless]
        # (what must outlive its jobs: a pool that main left, see subprocess_pool_scope)
        self.after_jobs = await self._stack.enter_async_context(contextlib.AsyncExitStack())
        self._nursery = await self._stack.enter_async_context(open_background_nursery())
        self.record = MissionRecord()
        start_head(self, self._nursery, self._queue)
        if self.stored is not None and self.stored.store.crashed:  # the workers its last
            # run's "running" entries name: its jobs may be held for them (see _enqueue)
            self.reunion.expected = self.stored.store.last_workers | set(
                self.stored.store.states.values()) - {"done", "failed", None}
        rt = _RUNTIME.get()
        self._runtime = _Runtime(self)
        if rt is not None:
            self._runtime.pool = rt.pool  # a pool opened around us stays usable
        # reset before the context modules exit, which may set it too
        self._stack.callback(_RUNTIME.reset, _RUNTIME.set(self._runtime))
        self._t0 = _now()
        self._zero_worker = LocalWorker(self, ZERO, self.local_name, self._nursery, context,
                                        output, in_order=True)
        if self.rpw is not None and self.rpw._parts():
            self.add_local_worker(self.rpw, self.local_name, context, output)
        for name, value, res in backendless:
            self.add_local_worker(res, name, value)
        if self.progress is not False:
            start_progress(self, self._stack, self._nursery)
        if self.stored is not None:
            self._nursery.start_soon(self.stored.keep)
        if self._remote and self.key is None:
            self.key = load_auth_key()
        if self.listen or self.waddrs:
            self.service = HeadService(self, self.listen, self.key, max_frame=self.max_frame,
                                       job_book=m.job_book)
        if self.listen:
            try:
                await self._nursery.start(self.service.run)
            except (GrainError, BaseExceptionGroup) as e:
                e = lone_exception(e)
                if not (isinstance(e, GrainError) and m.listen_optional) or isinstance(
                        e, ListenError):  # (optional: another head has it; not a bad one)
                    raise e from None
                log.warning("%s; this mission runs without accepting workers", e)
                self._workers_fixed = not (self.waddrs or self._link)  # (as if listening nowhere)
        for url in self.waddrs:
            self._nursery.start_soon(self.service.dial_passive, url, self.rpw)

    async def _close(self):
        await self._stack.__aexit__(None, None, None)
        self._nursery = None
        self.heap.thaw()

    async def __aexit__(self, etype, exc, tb):
        try:
            if etype is None:
                await self.wait_all()
        finally:
            self.closing = True
            if self.service is not None:
                with trio.CancelScope(shield=True):
                    # The results delivered are stored before the workers, which would
                    # bring them to a run again after a crash, are let go (a kill at the
                    # end of a mission cannot lose them then).
                    if self.stored is not None:
                        with trio.move_on_after(FLUSH_S):
                            await self.stored.write_now()
                    await self.service.say_goodbye(abort=etype is not None)
            try:  # (a Ctrl-C that trio raised in a task of its nursery comes out here)
                await self._close()
            finally:
                self.elapsed = _now() - self._t0
                jobs = [j for j in self._jobs if not _asks_nothing(j.req)]
                log.info("Time elapsed for all jobs: %.3fs; %s", self.elapsed,
                         self.record.summary(jobs, self._here, self.stored))
                if self.report:
                    self.record.write_html(self.report, jobs,
                                           f"grain mission {os.path.basename(sys.argv[0])}")
        if etype is None:
            lost = [j.error for j in self._jobs if j.error is not None and not j.observed]
            for j in self._jobs:
                if j.error is not None:
                    j.observed = True
            if lost:
                raise ExceptionGroup(f"{len(lost)} job(s) failed and nobody awaited them", lost)
        return False

    def __enter__(self):
        self._sync_jobs = []
        return self

    def __exit__(self, etype, exc, tb):
        todo = self._sync_jobs
        self._sync_jobs = None
        if etype is not None:
            return False

        async def run_all():
            async with self:
                for res, fn, args, kwargs in todo:
                    self._submit(res, fn, args, kwargs)

        _default_logging()
        trio_run(run_all)
        return False


###############################################################################
# Combine #####################################################################
###############################################################################
# The "combine" front end: waitgroups of jobs and subtasks, exec1 for one
# job, run_combine as the entry point.


class WaitGroup:
    """Jobs and subtasks that run in parallel; the ``async with`` waits for all of them."""

    def __init__(self, executor, nursery):
        self._executor = executor
        self._nursery = nursery
        self._items = []

    def submit(self, res, fn, *args, **kwargs):
        """Put a job onto the waitgroup; returns the Job."""
        job = self._executor.submit(res, fn, *args, **kwargs)
        self._items.append(job)
        return job

    async def asubmit(self, res, fn, *args, **kwargs):
        """submit(), awaitable (upstream's form for a bounded queue; ours never blocks)."""
        await trio.lowlevel.checkpoint()
        return self.submit(res, fn, *args, **kwargs)

    def start_subtask(self, afn, *args, **kwargs):
        """Run ``afn(*args, **kwargs)`` locally, in parallel; it may submit jobs itself."""
        sub = _Subtask()
        self._items.append(sub)
        self._nursery.start_soon(sub.run, afn, args, kwargs)
        return sub

    def load_cache_or_submit(self, res, fn, *args, **kwargs):
        """A subtask giving ``fn``'s cached value, or its job's (see load_cache_or_exec1)."""
        return self.start_subtask(load_cache_or_exec1, res, fn, *args, **kwargs)

    @property
    def results(self):
        """Return values in submission order (a failed job's entry is its exception)."""
        return [item.error if item.error is not None else item.value for item in self._items]


class _Subtask:
    value = error = None  # (a subtask that raised fails its waitgroup: no error here)

    async def run(self, afn, args, kwargs):
        self.value = await afn(*args, **kwargs)


@contextlib.asynccontextmanager
async def open_waitgroup():
    """``async with grain.open_waitgroup() as wg:`` -- see WaitGroup. Leaving the block waits
    for every job; if some failed, raises an ExceptionGroup of their errors (the results of
    the others stay in ``wg.results``)."""
    exer = _current_executor("grain.open_waitgroup()")
    async with open_strict_nursery() as nursery:
        wg = WaitGroup(exer, nursery)
        yield wg
    jobs = [item for item in wg._items if isinstance(item, Job)]
    for job in jobs:
        await job.wait_done()
        job.observed = True
    errors = [job.error for job in jobs if job.error is not None]
    if errors:
        raise ExceptionGroup(f"{len(errors)} of {len(jobs)} job(s) in the waitgroup failed",
                             errors)


async def exec1(res, fn, *args, **kwargs):
    """Run one job and return its result: ``await grain.exec1(Cores(2), fn, x)``."""
    return await _current_executor("grain.exec1()").submit(res, fn, *args, **kwargs)


async def load_cache_or_exec1(res, fn, *args, **kwargs):
    """``fn.cache_fn`` first, then the job only if it found nothing (upstream's protocol).

    ``cache_fn`` takes the arguments of ``fn`` it names (a subset of fn's parameters, in
    order) and returns ``(found, value)``; it runs here, or as a job of its own when
    ``fn.cache_res`` is a resource other than ZERO. A cache_fn that raises found nothing."""
    cache_fn = fn.cache_fn
    wanted = list(inspect.signature(cache_fn).parameters)
    cache_kwargs = {}
    while wanted and wanted[-1] in kwargs:
        name = wanted.pop()
        cache_kwargs[name] = kwargs[name]
    params = list(inspect.signature(fn).parameters)
    cache_args = []
    i = 0
    for name in wanted:
        while i < len(args) and params[i] != name:
            i += 1
        if i == len(args):
            raise ValueError(f"{_callable_name(cache_fn)} takes {name!r}, which the call of "
                             f"{_callable_name(fn)} does not give positionally")
        cache_args.append(args[i])
    cache_res = getattr(fn, "cache_res", ZERO)
    if not cache_res._parts():
        try:
            found, value = await cache_fn(*cache_args, **cache_kwargs)
        except Exception:
            found = False
    else:
        found, value = await exec1(cache_res, cache_fn, *cache_args, **cache_kwargs)
    return value if found else await exec1(res, fn, *args, **kwargs)


def _as_mains(main):
    """The list of main functions in ``main`` (one, or an iterable of them)."""
    mains = list(main) if not callable(main) and hasattr(main, "__iter__") else [main]
    for m in mains:
        if not _is_async_callable(m):
            raise TypeError(f"the main function must be async (or a partial of one), "
                            f"got {_callable_name(m)}")
    return mains


class _SetupFailed(Exception):
    """A mission's set-up failed: its head, its store, its address (``args[0]``, a
    GrainError, is what run() raises)."""


async def _run_mission(mains, single, executor_args, executor_kwargs):
    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(GrainExecutor(*executor_args, **executor_kwargs))
        except GrainError as e:
            raise _SetupFailed(e) from None
        if single:
            return await mains[0]()
        results = [None] * len(mains)

        async def one(i, m):
            results[i] = await m()

        async with open_strict_nursery() as nursery:
            for i, m in enumerate(mains):
                nursery.start_soon(one, i, m)
        return results


def _start_mission(main, executor_args, executor_kwargs, config_file, address,
                   may_attach, name=None, prioritized=False):
    """Run a mission of ``main`` with GrainExecutor's arguments (upstream's positional
    ``waddrs, rpw`` included) and what the config adds to them. An error in setting it
    up (the config, the results store, the head) is raised from here, without grain's
    and trio's frames: the mission did not start, and its one line says what to fix."""
    mains = _as_mains(main)
    _default_logging()
    try:
        options = _mission_options(load_config(config_file), address, executor_args,
                                   executor_kwargs, may_attach and config_file is not False,
                                   name, prioritized)
    except GrainError as e:
        raise e.with_traceback(None) from None
    try:
        return trio_run(_run_mission, mains, len(mains) == 1 and callable(main),
                        executor_args, {**executor_kwargs, **options})
    except _SetupFailed as e:
        raise e.args[0].with_traceback(None) from None
    except BaseException as e:  # Ctrl-C (in a group when it hit a job's task): the last log
        if isinstance(lone_exception(e), KeyboardInterrupt):  # line said what ended; not where
            raise KeyboardInterrupt from None
        raise


def run_combine(main, *executor_args, config_file=None, address=None, **executor_kwargs):
    """Run a mission: ``main`` (or a list of mains, run in parallel) with this process as
    the head. GrainExecutor's arguments: ``waddrs`` (passive workers to dial,
    ``tcp://host:port`` or a host, port 4242) and ``rpw`` (the local worker's resources,
    given to each passive worker too), ``temporary_err``, ``max_retries``, ... The head
    listens at ``address`` for workers and CLI clients (default: the config's, the Edge
    file; False: do not listen). Returns main's value (a list for a list of mains)."""
    return _start_mission(main, executor_args, executor_kwargs, config_file, address,
                          may_attach=False)


def _mission_options(cfg, address, executor_args, executor_kwargs, may_attach, name,
                     prioritized):
    """GrainExecutor arguments for a mission, from the config. Its jobs go to the head
    daemon for the address (started if none runs) unless it may not attach or asks for a
    head of its own: local resources (``rpw``), passive workers, ``[head.gnaw] enabled =
    false``, or a specialized worker type, whose jobs run in the mission."""
    head = cfg.role("head")
    worker = cfg.role("worker")
    address = head.listen if address is None else address
    if address:
        parse_url(address)
    waddrs = executor_args[0] if executor_args else executor_kwargs.get("waddrs", ())
    own_head = (len(executor_args) > 1 or "rpw" in executor_kwargs or waddrs
                or not head.gnaw_enabled or worker.specialized_type)
    key = load_auth_key(head.auth_key or None, head.tls_cert, head.tls_key) \
        if (address or waddrs) else None
    main_file = os.path.abspath(sys.argv[0] or ".")
    here = os.path.dirname(main_file) if os.path.isfile(main_file) else os.getcwd()
    for option in ("results", "report"):  # files beside the mission's script
        if getattr(head, option) and option not in executor_kwargs:
            executor_kwargs[option] = os.path.join(here, getattr(head, option))
    if may_attach and address and not own_head:
        config = ["-c", cfg.path] if cfg.path else ["--no-config"]
        # a daemon shared by missions from any directory: its log beside its job records
        log_file = os.path.join(os.path.dirname(os.path.abspath(JobBook(address).path)),
                                _stamp(head.daemon_log, time.time()))
        return {"mission": MissionSetup(
            attach=functools.partial(attach_to_head, address, key,
                                     self_argv("head", *config, "-a", address), log_file),
            info={"name": name or os.path.basename(sys.argv[0]) or "python",
                  "pid": os.getpid(), "host": hostname(), "prioritized": bool(prioritized)})}
    return {"listen": address or None, "key": key, "mission": MissionSetup(
        listen_optional=True, workers_fixed=not address and not waddrs,
        job_book=_job_book(worker) if address else None,
        context=load_context(head.contextmod) if head.contextmod else None,
        job_log=os.path.abspath(_stamp(head.log_file, time.time())) if head.log_file else None,
        backendless=tuple(backendless_workers(worker)))}


###############################################################################
# Delayed #####################################################################
###############################################################################
# The "delayed" front end (seeds 001, 004). Calling a delayed function submits its
# job at once and returns a Delayed: a placeholder that composes with operators,
# indexing, attribute access, calls and NumPy, and is resolved by ``await``.
# Evaluation walks the expression graph with an explicit stack, so a sum built from
# 100,000 ``+=`` does not hit the recursion limit.

_NO_VALUE = object()


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _copy_setitem(obj, key, value):
    new = copy.copy(obj)
    new[key] = value
    return new


def _setitem_in_place(obj, key, value):  # copy_on_setitem=False
    obj[key] = value
    return obj


def _gather(*values):
    return list(values)


def _delayeds_in(obj, out):
    """Append every Delayed found in ``obj`` (looking into lists, tuples, sets, dicts)."""
    if isinstance(obj, Delayed):
        out.append(obj)
    elif isinstance(obj, (list, tuple, set, frozenset, dict)):
        for x in obj.values() if isinstance(obj, dict) else obj:
            _delayeds_in(x, out)
    return out


def _capture(obj):
    """``obj`` with every Delayed in it replaced by a snapshot, so that a later
    ``d[k] = v`` (which turns ``d`` into a new value) does not change what was built from
    ``d`` before: copy-on-setitem."""
    if isinstance(obj, Delayed):
        return obj._snapshot()
    t = type(obj)
    if t is tuple or t is list or t is set or t is frozenset:  # (as _substitute reads)
        return t([_capture(x) for x in obj]) if any(
            isinstance(x, (Delayed, list, tuple, set, frozenset, dict)) for x in obj) else obj
    if t is dict:
        return {k: _capture(v) for k, v in obj.items()}
    return obj


def _substitute(obj):
    """``obj`` with every (already evaluated) Delayed replaced by its value."""
    if isinstance(obj, Delayed):
        return obj._value
    if type(obj) in (list, tuple, set, frozenset):  # (not a subclass: it stays as it is)
        return type(obj)(_substitute(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _substitute(v) for k, v in obj.items()}
    return obj


class Delayed:
    """A placeholder for a value that jobs are computing. ``await`` it for the value.

    ``d[k] = v`` makes ``d`` stand for a copy of its value with the item set, so what was
    built from ``d`` before keeps the old value (``copy_on_setitem=False``: the value itself
    is changed, and what reads it after sees the change)."""

    __slots__ = ("_job", "_op", "_args", "_kwargs", "_nout", "_value", "_cow")
    __array_priority__ = 1000  # NumPy: let our reflected operators win

    def __init__(self, value=_NO_VALUE, nout=None, copy_on_setitem=True):
        self._fill(self, None, None, (), None, nout, value, copy_on_setitem)

    @staticmethod
    def _fill(d, job, op, args, kwargs, nout, value, cow=True):
        # Delayed refuses setattr (it is a placeholder), so its own slots are set this way.
        set_ = object.__setattr__
        set_(d, "_job", job)
        set_(d, "_op", op)
        set_(d, "_args", args)
        set_(d, "_kwargs", kwargs)
        set_(d, "_nout", nout)
        set_(d, "_value", value)
        set_(d, "_cow", cow)
        return d

    @classmethod
    def _of_job(cls, job, nout=None, cow=True):
        return cls._fill(object.__new__(cls), job, None, (), None, nout, _NO_VALUE, cow)

    @classmethod
    def _apply(cls, op, args, kwargs=None, nout=None):
        # A placeholder made from others keeps the copy_on_setitem of the first of them.
        cow = next((a._cow for a in args if isinstance(a, Delayed)), True)
        return cls._fill(object.__new__(cls), None, op, _capture(args),
                         _capture(kwargs) if kwargs else None, nout, _NO_VALUE, cow)

    def _snapshot(self):
        """A new placeholder for this one's current value (shares its job and cache)."""
        return self._fill(object.__new__(Delayed), self._job, self._op, self._args,
                          self._kwargs, self._nout, self._value, self._cow)

    # -- evaluation ---------------------------------------------------------
    def __await__(self):
        return _evaluate(self).__await__()

    # -- what a placeholder cannot do -----------------------------------------
    def __bool__(self):
        raise TypeError("the truth value of a Delayed is not known until it is awaited: "
                        "write `if await x:` instead of `if x:`")

    def __setattr__(self, name, value):
        raise TypeError(f"cannot set attribute {name!r} on a Delayed; await it first")

    def __delattr__(self, name):
        raise TypeError(f"cannot delete attribute {name!r} of a Delayed; await it first")

    def __iter__(self):
        if self._nout is None:
            raise TypeError("a Delayed of unknown length cannot be iterated or unpacked; "
                            "declare the count with @delayed(nout=N)")
        return iter([self[i] for i in range(self._nout)])

    def __len__(self):
        if self._nout is None:
            raise TypeError("a Delayed has no length until awaited; use @delayed(nout=N)")
        return self._nout

    def __reduce__(self):
        raise TypeError("a Delayed cannot be pickled; await it (or pass it as an argument "
                        "to a delayed function, which waits for it)")

    # -- what it composes with ------------------------------------------------
    def __getattr__(self, name):
        if name.startswith("_"):  # private and special names are never composed
            raise AttributeError(f"a Delayed has no attribute {name!r}")
        return Delayed._apply(getattr, (self, name))

    def __getitem__(self, key):
        return Delayed._apply(operator.getitem, (self, key))

    def __setitem__(self, key, value):
        # Copy-on-setitem: this placeholder now stands for a copy of the old value with the
        # item set; whoever holds the old value (e.g. another delayed) is not affected.
        op = _copy_setitem if self._cow else _setitem_in_place
        self._fill(self, None, op, (self._snapshot(), _capture(key), _capture(value)),
                   None, self._nout, _NO_VALUE, self._cow)

    def __call__(self, *args, **kwargs):
        return Delayed._apply(_call, (self, *args), kwargs or None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return Delayed._apply(getattr(ufunc, method), inputs, kwargs or None)

    def __array_function__(self, func, types, args, kwargs):
        return Delayed._apply(func, args, kwargs or None)

    __hash__ = object.__hash__

    def __repr__(self):
        if self._job is not None:
            return f"<Delayed {self._job.name}>"
        if self._op is None:
            return f"<Delayed value {self._value!r}>"
        return f"<Delayed {getattr(self._op, '__name__', self._op)}(...)>"


def _make_operators():
    def forward(op):
        return lambda self, other: Delayed._apply(op, (self, other))

    def reflected(op):
        return lambda self, other: Delayed._apply(op, (other, self))

    for name in ("add sub mul truediv floordiv mod pow lshift rshift and or xor matmul "
                 "divmod").split():
        op = divmod if name == "divmod" else getattr(operator, f"__{name}__")
        setattr(Delayed, f"__{name}__", forward(op))
        setattr(Delayed, f"__r{name}__", reflected(op))
    for name in ["lt", "le", "gt", "ge", "eq", "ne"]:
        setattr(Delayed, f"__{name}__", forward(getattr(operator, name)))
    for name in ["neg", "pos", "abs", "invert"]:
        op = getattr(operator, name)
        setattr(Delayed, f"__{name}__", lambda self, op=op: Delayed._apply(op, (self,)))


_make_operators()


async def _evaluate(root):
    """The value of a Delayed: await its jobs, then apply its operations bottom-up."""
    if root._value is not _NO_VALUE:
        return root._value
    stack = [root]
    while stack:
        node = stack[-1]
        if node._value is _NO_VALUE and node._job is not None:
            object.__setattr__(node, "_value", await node._job.wait())
        elif node._value is _NO_VALUE:
            deps = _delayeds_in((node._args, node._kwargs), [])
            pending = [d for d in deps if d._value is _NO_VALUE]
            if pending:
                stack.extend(pending)
                continue
            args = _substitute(node._args) if deps else node._args
            kwargs = _substitute(node._kwargs) if node._kwargs else {}
            object.__setattr__(node, "_value", node._op(*args, **kwargs))
        stack.pop()
    return root._value


async def _resolve_arguments(args, kwargs):
    for d in _delayeds_in((args, kwargs), []):
        await _evaluate(d)
    return _substitute(args), _substitute(kwargs)


class DelayedFn:
    """An async function that submits a job each time it is called. ``fn @ res`` binds the
    resource request; without one the job runs locally (in this process) at once, calls
    starting in the order they were made."""

    __slots__ = ("fn", "res", "nout", "copy")

    def __init__(self, fn, res=ZERO, nout=None, copy_on_setitem=True):
        self.fn = fn
        self.res = res
        self.nout = nout
        self.copy = copy_on_setitem

    def __matmul__(self, res):
        if not isinstance(res, Resource):
            return NotImplemented
        return DelayedFn(self.fn, res, self.nout, self.copy)

    def __call__(self, *args, **kwargs):
        rt = _RUNTIME.get()
        if rt is None or rt.executor is None:
            _current_executor(f"calling the delayed function {_callable_name(self.fn)}")
        exer = rt.executor
        if (args or kwargs) and _delayeds_in((args, kwargs), []):
            job = exer._submit_after(self.res, self.fn, _capture(args), _capture(kwargs),
                                     _resolve_arguments)
        else:
            job = exer._submit(self.res, self.fn, args, kwargs)
        return Delayed._of_job(job, self.nout, self.copy)

    @property
    def __wrapped__(self):
        return self.fn

    @property
    def __name__(self):
        return _callable_name(self.fn)

    def __repr__(self):
        res = "" if self.res is ZERO else f" @ {self.res!r}"
        return f"<delayed {_callable_name(self.fn)}{res}>"


DelayedFunction = DelayedFn  # grain.py's first name for it


def delayed(fn=None, nout=None, copy_on_setitem=True):
    """Decorator: make an async function delayed: ``@delayed``, ``@delayed(nout=2)`` (the
    function returns 2 values, so the call can be unpacked), or ``delayed(fn, 2)``.
    ``copy_on_setitem``: see Delayed."""
    if fn is None:
        return functools.partial(delayed, nout=nout, copy_on_setitem=copy_on_setitem)
    if nout is not None:
        _check_count(nout, "delayed(nout=...)")
    if isinstance(fn, DelayedFn):
        return DelayedFn(fn.fn, fn.res, nout if nout is not None else fn.nout, copy_on_setitem)
    if not callable(fn) or not _is_async_callable(fn):
        raise TypeError(f"@delayed needs an async function, but {_callable_name(fn)} is "
                        "sync. For CPU-bound Python code use @subprocify under it:\n"
                        "    @delayed\n    @subprocify\n    def f(...): ...")
    return DelayedFn(fn, ZERO, nout, copy_on_setitem)


def delayedval(value, length=None, copy_on_setitem=True):
    """Wrap a plain value as an (already resolved) Delayed; ``length`` as ``nout`` of
    delayed. It can be awaited anywhere, also outside a mission."""
    if length is not None:
        _check_count(length, "delayedval(length=...)")
    return Delayed(value, length, copy_on_setitem)


def each(*items):
    """A Delayed of the list of values of ``items`` (Delayeds or plain values):
    ``await each(f(x) for x in xs)`` or ``await each(a, b)``."""
    if len(items) == 1 and not isinstance(items[0], Delayed):
        with contextlib.suppress(TypeError):  # (one Delayed, or one value: not a sequence)
            items = tuple(items[0])
    return Delayed._apply(_gather, tuple(items))


def run(main, *executor_args, config_file=None, local=None, name=None, prioritized=False,
        address=None, **executor_kwargs):
    """Run a delayed mission: ``main`` (an async function, or an iterable of them, run in
    parallel); returns its value (a list for several).

    By default, jobs that request resources go to the head daemon for ``address`` (default:
    the config's, i.e. the Edge file), started in the background if none runs; it keeps
    its workers for the next mission and shares them between missions (``name`` shows in
    its `ls`, ``prioritized=True`` puts this mission first). With ``local`` (upstream's
    ``rpw``, also positional after ``waddrs``), e.g. ``Cores([0, 1])`` or ``ZERO``, this
    process is the head, with an in-process worker holding ``local``, and workers may join
    it at ``address`` (False: do not listen); so it is with ``config_file=False`` (the
    defaults) or ``[head.gnaw] enabled = false``. Other keywords go to GrainExecutor
    (``temporary_err``, ``max_retries``, upstream's ``nolocal``, ``reschedule``, ...)."""
    if local is not None:
        if "rpw" in executor_kwargs or len(executor_args) > 1:
            raise TypeError("run(): give local= or its alias rpw=, not both")
        executor_kwargs["rpw"] = _resource_arg(local, "run(): local")
    return _start_mission(main, executor_args, executor_kwargs, config_file, address,
                          True, name, prioritized)


@contextlib.asynccontextmanager
async def QueueLimiter(conc):
    """At most ``conc`` jobs of the delayed functions it wraps running at once (delayed
    calls submit eagerly; this holds back the ones past the limit)::

        async with QueueLimiter(10) as ql:
            for i in range(30):
                r_ += await ql(dfn)(i)   # waits for a free slot, not for the result

    The block ends when every job started through it has ended."""
    slots = trio.Semaphore(_check_count(conc, "QueueLimiter(conc)", 1))

    async def hold_slot(dfn, args, kwargs, task_status=TASK_STATUS_IGNORED):
        async with slots:
            placeholder = dfn(*args, **kwargs)
            task_status.started(placeholder)
            await placeholder  # the slot is free again once its job has ended

    async with open_strict_nursery() as nursery:
        def limited(dfn):
            async def call(*args, **kwargs):
                return await nursery.start(hold_slot, dfn, args, kwargs)
            return call
        yield limited


class _CappedNursery:
    """A nursery whose ``start_once_acquired(fn, *args)`` waits while ``conc`` of the tasks
    it started are running (see open_nursery_with_capacity)."""

    def __init__(self, nursery, conc):
        self._nursery, self._slots = nursery, trio.Semaphore(conc)

    async def start_once_acquired(self, fn, *args):
        async def run(task_status=TASK_STATUS_IGNORED):
            async with self._slots:
                task_status.started()
                await fn(*args)
        await self._nursery.start(run)

    def __getattr__(self, name):
        return getattr(self._nursery, name)


@contextlib.asynccontextmanager
async def open_nursery_with_capacity(conc):
    """A trio nursery with ``start_once_acquired(fn, *args)``, which waits until fewer than
    ``conc`` of the tasks it started run, then starts ``fn(*args)`` (upstream's
    grain.util)."""
    conc = _check_count(conc, "open_nursery_with_capacity(conc)", 1)  # (0: nothing starts)
    async with open_strict_nursery() as nursery:
        yield _CappedNursery(nursery, conc)


def _oneline_array_repr(a, edgeitems=3):
    """``array[(2, 3)](0, 1, 2...)``: the shape and the first items, on one line."""
    flat = a.ravel()
    items = ", ".join(str(x) for x in flat[:edgeitems])
    return f"array[{a.shape}]({items}{'...' if flat.size > edgeitems else ''})"


def set_numpy_oneline_repr(on=True):
    """Make NumPy arrays show as one short line (shape and first items), keeping logs of
    jobs with large array arguments readable (``on=False``: NumPy's own repr again)."""
    import numpy as np

    fn = _oneline_array_repr if on else None
    if "override_repr" in inspect.signature(np.set_printoptions).parameters:  # NumPy 2.1+
        np.set_printoptions(override_repr=fn)
    else:  # NumPy 1 has it public; 2.0 only in its core module
        setter = getattr(np, "set_string_function", None) or \
            importlib.import_module("numpy._core.multiarray").set_string_function
        setter(fn, True)


###############################################################################
# Worker process ##############################################################
###############################################################################
# ``python grain.py worker --url URL``: one per node. It connects to a head (or, with
# ``--listen``, waits for a head to dial it), registers its name and resources, runs the
# jobs it is sent, and sends results back (WorkerProcess). What it offers is what Host
# says of this machine.


class WorkerProcess:
    """A worker's side of its connection to a head: it runs the jobs it is sent, each with
    GVAR set, and sends their results back. It leaves when the head says FIN (after its
    jobs), drain or leave, when its walltime is up, or on SIGTERM/SIGINT, telling the head
    (which re-queues what still runs here).

    When the head is lost without a goodbye, it keeps its jobs running and their results
    for ``reattach`` seconds, looking for a head at its address (``reconnect()``): a head
    that comes is told what still runs here, then sent the results kept meanwhile (and
    those sent shortly before the loss, which the old head may never have read), and the
    jobs go on as that head's (see Reunion). Jobs known by a number (the old head's own)
    can be claimed by no new head: they are stopped at once. Without a head by the end,
    it leaves.

    Its ``state``: "serving" a head; "alone" (its head lost, looking for another until
    ``until``); "draining" (it leaves once its jobs end, because ``why``); "gone"."""

    def __init__(self, name, hello, context=None, reattach=0.0, max_frame=MAX_FRAME,
                 oversubscribe=False):
        self.name = name
        self.reattach = reattach
        self.max_frame = max_frame
        self.oversubscribe = oversubscribe
        self.hello = hello       # what registering tells a head, but the resources
        self.context = context   # GVAR.context of its jobs
        self.res = None          # what it offers (known once it registered)
        self.channel = None      # to the head, while there is one
        self.outbox = []         # messages for the head, kept while there is none
        self.recent = deque()    # (time, message) of results sent lately
        self.functions = {}      # digest -> function (or the exception loading it raised)
        self.running = {}        # job id -> (CancelScope, allocation)
        self.head = None         # the instance of the head it serves (or lost), if it said
        self.cancelled = set()   # ids of jobs the head cancelled (its mission went away)
        self.state = "serving"
        self.why = None
        self.until = None
        self._nursery = self._job_tasks = None
        self._attending = None   # the cancel scope of serving (or looking for) a head

    def send(self, msg):
        """To the head; while there is none, to the outbox. A result sent is remembered
        for a while: the head may go before it reads it."""
        if self.channel is None:
            self.outbox.append(msg)
            return
        self.channel.send(msg)
        if msg[0] == "done":
            self._remember(msg)

    async def serve(self, stream, res, reconnect):
        """Serve the head at ``stream``, offering ``res`` (None: what the head assigns);
        then any head ``reconnect()`` reaches."""
        async with open_strict_nursery() as nursery:
            self._nursery, self._job_tasks = nursery, TaskPool(nursery, self._run_job)
            await nursery.start(functools.partial(watch_signals, self._signalled, notices=True))
            await self._session(stream, res)
            while self.state == "alone":
                stream = await self._look_for_head(reconnect)
                if stream is not None:
                    self.state = "serving"
                    await self._session(stream)
                elif self.state == "alone":
                    why = f"no head came within {self.reattach:g} s (worker.reattach)"
                    log.warning("%s; leaving, stopping %d job(s)", why, len(self.running))
                    self.leave(why)
            nursery.cancel_scope.cancel()

    async def _session(self, stream, res=None):
        """Register with the head at ``stream`` and serve it, until it is gone or lost."""
        async with open_channel(stream, _peer_name(stream), max_frame=self.max_frame) \
                as channel:
            hello = dict(self.hello)
            if self.res is None:  # the first head
                self.res = res if res is not None else await self._assigned(channel)
                self._nursery.start_soon(self._watch_walltime)
            else:
                # the jobs it runs, and those whose results follow (None)
                hello["resume"] = dict.fromkeys(m[1] for m in self.outbox if m[0] == "done")
                hello["resume"].update((jid, alloc) for jid, (_, alloc) in self.running.items())
                hello["head"] = self.head
            channel.send(("register", dict(hello, res=self.res)))
            log.info("worker %s %s with %r", self.name,
                     "registered again" if "resume" in hello else "registered", self.res)
            outbox = self.outbox
            self.outbox = []
            self.channel = channel
            for msg in outbox:
                self.send(msg)
            with trio.CancelScope() as self._attending:
                await self._receive(channel)
        self.channel = None
        if channel.silent:
            self._lost(f"silent for {SILENT_S:g} s")

    async def _assigned(self, channel):
        """What a head that dialled this passive worker assigns it to offer."""
        try:
            assigned = dispatch({"assign": lambda res: res}, await channel.receive(), "the head")
        except PeerError as e:
            raise GrainError(f"{e} instead of an assignment") from None
        return _fit_allocation(worker_provider(assigned, self.oversubscribe))

    async def _receive(self, channel):
        handlers = {"fn": self.on_function, "run": self.on_run, "ping": _ignore,
                    "head": functools.partial(setattr, self, "head"),
                    "fin": self.on_fin, "drain": self.on_drain, "cancel": self.on_cancel,
                    "leave": self.on_leave}
        try:
            await channel.dispatch_all(handlers)
        except PeerError as e:
            log.warning("%s; leaving", e)
            self.leave("it could not understand the head")
            return
        if self.state == "serving":  # (draining: a FIN, then EOF, is a normal goodbye)
            self._lost("connection closed")

    def _lost(self, how):
        """The head went without a goodbye: wait for another (True: "alone"), or leave."""
        self.channel = None  # (what jobs send from now on waits in the outbox)
        if self.reattach <= 0:
            log.warning("lost the head (%s); leaving", how)
            self.state = "gone"
            self.why = f"lost the head ({how})"
            return False
        # The head's own numbers: only that head can claim them, if it comes back (its
        # relay went, say); one that never said who it is cannot.
        kept = sum(outlives_head(jid) or self.head is not None for jid in self.running)
        for jid, (scope, _) in self.running.items():
            if not outlives_head(jid) and self.head is None:
                scope.cancel()
        # Of the results of one job, only the last goes again, and none while it runs: the
        # head ran it again after the earlier (a retry), which a new head must not retry.
        since = _now() - RESEND_S
        last = {}
        for t, msg in self.recent:
            if t > since and msg[1] not in self.running:
                last[msg[1]] = msg
        self.outbox[:0] = last.values()
        self.recent.clear()
        log.warning("lost the head (%s); keeping %d running job(s) and looking for a head "
                    "for %g s (worker.reattach)", how, kept, self.reattach)
        self.state, self.why, self.until = "alone", how, _now() + self.reattach
        return True

    async def _look_for_head(self, reconnect):
        """A stream to a new head at our address; None when none came within reattach."""
        with trio.move_on_at(self.until), trio.CancelScope() as self._attending:
            while self.head is None and not all(map(outlives_head, self.running)):
                await trio.sleep(REATTACH_POLL_S)  # their cancellation ends soon
            return await retry(reconnect, (Unreachable, OSError, PeerError), REATTACH_POLL_S,
                               failed=lambda e, _: log.debug("no head yet: %s", e))
        return None

    def on_function(self, digest, data):
        try:
            self.functions[digest] = loads_job_value(data)
        except Exception as e:
            self.functions[digest] = e

    def on_run(self, jid, digest, payload, alloc, T):
        if jid in self.running:  # (its result, when it comes, is this one's)
            log.warning("the head asked to run job %r, which runs here already", jid)
            return
        self._job_tasks.start(jid, self.functions.get(digest), payload, alloc, T)

    async def _run_job(self, jid, fn, payload, alloc, T):
        started = _now()
        with trio.CancelScope() as scope:
            self.running[jid] = (scope, alloc)
            try:
                if isinstance(fn, BaseException) or fn is None:
                    raise GrainError(f"the job function could not be loaded on worker "
                                     f"{self.name}: {fn!r}")
                args, kwargs = loads_job_value(payload)
                value = await run_job_here(fn, args, kwargs, alloc, self.name, self.context, T)
                try:
                    reply = (True, dumps_job_value(value, "the result"))
                except TypeError as e:
                    raise GrainError(f"{e} (type {type(value).__name__})") from None
            except JOB_ERRORS as e:
                reply = (False, pickled_failure(e, f"Traceback on worker {self.name}:\n"
                                                f"{traceback.format_exc()}"), failure_class(e))
            self.send(("done", jid, *reply[:2], _now() - started, *reply[2:]))
        self.running.pop(jid, None)
        if jid in self.cancelled:  # its resources are free again: tell the head
            self.cancelled.discard(jid)
            if scope.cancelled_caught:
                self.send(("cancelled", jid))
        if self.state == "draining" and not self.running:
            self.leave(self.why)

    def _remember(self, msg):
        """Keep a result for RESEND_S, for a new head that may want it again (if its job
        may outlive this head)."""
        if self.reattach <= 0 or not outlives_head(msg[1]):
            return
        now = _now()
        self.recent.append((now, msg))
        while self.recent[0][0] < now - RESEND_S:
            self.recent.popleft()

    def _finish(self):
        self.state = "gone"
        # Not at once: a handler calls this from the receive loop, which flushes next; a
        # send cut short by a cancellation would lose what it was sending ("leaving").
        self._nursery.start_soon(self._stop_attending)

    async def _stop_attending(self):
        if self._attending is not None:
            self._attending.cancel()

    def leave(self, why):
        """Tell the head we go (so it re-queues what still runs here), then go."""
        self.send(("leaving", why))
        for scope, _ in self.running.values():
            scope.cancel()
        self._finish()

    def on_cancel(self, jid):
        scope, _ = self.running.get(jid, (None, None))
        if scope is not None:  # else its result is on its way already
            self.cancelled.add(jid)
            scope.cancel()

    def on_leave(self):
        log.info("the head told it to leave now (`quit -f`, or its mission failed or was "
                 "stopped); stopping its %d running job(s)", len(self.running))
        self.leave("told to leave now")

    def on_fin(self):
        log.info("the head said goodbye (its mission ended, or it was stopped); leaving "
                 "after %d running job(s)", len(self.running))
        self.state = "draining"
        self.why = "the head said goodbye"
        if not self.running:
            self._finish()

    def on_drain(self):
        self.state = "draining"
        self.why = "asked to quit"
        if not self.running:
            self.leave(self.why)

    async def _watch_walltime(self):
        wt = _part(self.res, "WTime")
        if wt is None or not wt.countdown:
            return
        await trio.sleep(wt.remaining())
        log.info("walltime is up; leaving")
        self.leave("its walltime ended")

    def _signalled(self, name):
        if self.state != "gone":
            log.info("got %s; leaving", name)
            self.leave(f"got {name}" + (f" ({BATCH_NOTICES[name]})" if name in BATCH_NOTICES
                                        else ""))


async def worker_main(url=None, res=None, name=None, context_file=None, listen=None,
                      key_path=None, max_frame=MAX_FRAME, oversubscribe=False, sworker=None,
                      reattach=REATTACH_S, tls=("", "")):
    """Run a worker until it leaves. Returns the exit code. With ``sworker`` (a specialized
    worker type), keep the module's grain_run_sworker() running while registered: the
    head runs the jobs, with what it yielded. ``reattach``: seconds it keeps its jobs for
    a new head when its head is lost. ``tls``: the certificate and key of load_auth_key."""
    key = load_auth_key(key_path, *tls)
    context = load_context(context_file, "--context") if context_file else None
    # Its batch job, as the submit command named it, so the head knows which submission
    # has joined.
    job_id = batch_job()[1]
    # A passive worker waits to be dialled: no new head would; a specialized worker's
    # jobs ran in its head, and went with it.
    reattach = 0.0 if listen or sworker else reattach
    hello = {"name": name or (f"{hostname()}-{job_id}" if job_id else hostname()),
             "pid": os.getpid(), "host": hostname(), "job_id": job_id, "sworker": None,
             "reattach": reattach}
    provider = None if listen else _fit_allocation(worker_provider(res, oversubscribe))
    async with contextlib.AsyncExitStack() as stack:
        if sworker is not None:
            module = load_module(sworker, "--sworker")
            info = dict(await stack.enter_async_context(module.grain_run_sworker()))
            hello.update(name=info.pop("name", None) or hello["name"],
                         sworker={"type": sworker, "info": info})
        # The context wraps the worker's whole life, every head it serves included.
        value = await stack.enter_async_context(context()) if context else None
        stream = await _reach_head(url, listen, key, provider)
        if stream is None:
            return 0
        worker = WorkerProcess(hello["name"], hello, value, reattach, max_frame, oversubscribe)
        async with open_strict_nursery() as nursery:
            if reattach > 0 and (folder := alive_folder(url)) is not None:
                hello["alive"] = f"{hostname()}.{os.getpid()}"
                nursery.start_soon(keep_touching, os.path.join(folder, hello["alive"]))
            await worker.serve(stream, provider, functools.partial(connect, url, key, wait=True))
            nursery.cancel_scope.cancel()
    return 0


async def _reach_head(url, listen, key, provider):
    """The stream to the head: dialled (through an Edge file: whichever starts first), or,
    with ``listen``, the head's call. A worker in a batch job waits no longer than its
    walltime: one that started after its mission ended must not sit on the allocation."""
    if listen:
        listeners, urls = await open_listeners(listen)
        log.info("waiting for a head to dial %s", ", ".join(urls.values()))
        return await accept_one(listeners, key)
    wt = _part(provider, "WTime")
    signalled = []

    def stop(name):  # (not killed outright: its Edge record is taken back)
        signalled.append(name)
        waiting.cancel()

    with trio.move_on_after(wt.remaining() if wt is not None else math.inf) as waiting:
        async with open_strict_nursery() as nursery:
            await nursery.start(functools.partial(watch_signals, stop, notices=True))
            try:
                return await connect(url, key, wait=True)
            except (Unreachable, OSError, PeerError) as e:
                raise GrainError(f"cannot reach a head at {url}: {e}") from None
            finally:
                nursery.cancel_scope.cancel()
    log.warning("%s; leaving", f"{signalled[0]} while waiting for a head" if signalled else
                "no head came within this worker's walltime")
    return None



###############################################################################
# Head daemon #################################################################
###############################################################################
# ``python grain.py head``: the scheduler on its own, shared by every mission with the
# same address, so workers outlive a mission and serve the next one. It is made of the
# pieces above -- a HeadCore with one JobQueue per mission, a HeadService for workers,
# the CLI and missions (those on this host also reach it on a Unix socket), Retries for
# lost workers -- and never opens what missions send: jobs and results pass through as
# the missions and workers pickled them, so no user code runs here. It cancels a
# mission's running jobs when it goes away, quits after head.idle_quit with no mission,
# and keeps head.swarm workers submitted when asked to. Killed, it costs no job: its
# workers wait for the next daemon with what they run, and its missions hand the next one
# their jobs by "token/ref", which a Reunion matches to what the workers report.


class _OpaqueFunction:
    """A job function as the daemon holds it: the mission's pickled bytes, never loaded."""

    __slots__ = ("digest", "data", "__name__")

    def __init__(self, digest, data, name):
        self.digest = digest
        self.data = data
        self.__name__ = name


class MissionQueue(JobQueue):
    """A mission attached to the daemon: its queue, its connection and its counters."""

    __slots__ = ("channel", "host", "token", "functions", "done", "failed", "since", "gone")

    def __init__(self, channel, info):
        super().__init__(f"{info.get('name') or 'mission'}[{info.get('pid')}]",
                         bool(info.get("prioritized")))
        self.channel = channel
        # Its jobs are known to workers as "token/ref": the same again when it comes back
        # to a new daemon with them, not the same as another mission's.
        self.token = str(info.get("token") or os.urandom(8).hex())
        self.host = info.get("host")
        self.functions = {}   # digest -> _OpaqueFunction
        self.done = self.failed = 0
        self.since = time.time()
        self.gone = False

    def warn(self, message):
        log.warning("mission %s: %s", self.name, message)
        self.channel.send(("warn", message))


class SwarmKeeper:
    """Keeps ``target`` workers: joined ones plus worker jobs submitted but not joined yet.
    At most ``quota`` submissions in any ``window`` seconds, so workers that die at start
    never turn into a flood of jobs."""

    def __init__(self, settings, target, quota, window):
        # settings: the worker RoleSettings, how to submit
        self.settings = settings
        self.target = target
        self.quota_setting = quota
        self.window = window
        self.submitted = deque()     # times of recent submissions (trio's clock)
        self.pending = {}            # batch job id -> submission time, until it joins or ends
        self.note = ""               # why it is not at target, for `ls`
        self.changed = trio.Event()  # set to look again at once (a worker left, `scale`)
        self.warn = log.warning      # (the daemon's: its missions hear it too)

    @property
    def quota(self):
        return self.quota_setting or 2 * self.target

    def quota_wait(self, now):
        """Seconds until another submission is allowed (0: now): the quota a window, and
        script.max_submit_rate."""
        while self.submitted and self.submitted[0] <= now - self.window:
            self.submitted.popleft()
        rate = self.settings.script.max_submit_rate if self.settings else 0
        return max(0.0 if len(self.submitted) < self.quota else self.submitted[0] + self.window
                   - now, self.submitted[-1] + 1 / rate - now if rate and self.submitted else 0)

    def statistics(self, joined):
        return {"target": self.target, "joined": joined, "pending": sorted(self.pending),
                "quota": self.quota, "window": self.window,
                "used": len(self.submitted), "note": self.note}

    async def run(self, joined):
        """Submit worker jobs while ``joined()`` plus the pending ones fall short of the
        target, within the quota; forget pending jobs the batch system says ended."""
        last_states = -math.inf
        while True:
            self.changed = trio.Event()
            with trio.move_on_after(SWARM_CHECK_S):
                await self.changed.wait()
            now = _now()
            if self.pending and now - last_states >= SWARM_STATES_S:
                last_states = now
                states = await trio.to_thread.run_sync(
                    batch_states, self.settings.system, list(self.pending),
                    self.settings.custom_system)
                for batch_id in list(self.pending):
                    if states[batch_id] == ENDED:
                        log.warning("worker job %s ended without joining", batch_id)
                        del self.pending[batch_id]
            if (short := self.target - joined() - len(self.pending)) > 0:
                await self._submit(joined(), short)
            else:
                self.note = ""

    async def _submit(self, joined, short):
        """Submit a worker job, or (script.array) an array job of ``short`` workers, as far
        as the quota and script.max_queued allow."""
        now = _now()  # (the quota's clock: steady, and a test's mock one)
        wait = self.quota_wait(now)
        room = queue_room(self.settings, short, len(self.pending))
        if not room:
            self.note = f"max_queued reached: {len(self.pending)} worker job(s) queued"
            return
        if wait > 0:
            self.note = (f"quota reached: {len(self.submitted)} submissions in the last "
                         f"{format_walltime(self.window)}; the next is allowed in "
                         f"{format_walltime(wait)}")
            return
        s = self.settings
        when = time.time()
        short = min(room, self.quota - len(self.submitted))
        n = short if array_of(s, short) else 1  # one submission: an array job, or one job
        self.note = ""
        self.submitted.extend([now] * n)
        try:
            ids = await trio.to_thread.run_sync(lambda: next(submit_workers(s, n, when=when))[1])
        except GrainError as e:
            self.note = f"the last submission failed: {e}"
            self.warn(f"swarm: {self.note}")
            return
        self.pending.update(dict.fromkeys(ids, now))
        log.info("swarm: submitted worker job %s (%d joined, %d pending, target %d)",
                 " ".join(ids), joined, len(self.pending), self.target)


class HeadDaemon(HeadCore):
    """A head that runs no mission and no user code: it schedules the jobs of every
    attached mission on its workers (the Scheduler serves their queues fairly) and passes
    jobs and results on as the missions and workers pickled them. It retries only the jobs
    of lost and retired workers: missions retry the rest."""

    def __init__(self, listen, key, *, idle_quit=1800.0, mission_socket=None, job_book=None,
                 swarm=None, log_file="", max_missions=8, max_frame=MAX_FRAME):
        super().__init__(Retries())
        self.service = HeadService(self, listen, key, max_frame=max_frame, job_book=job_book,
                                   commands={"stats": self._stats, "stop": self._stop,
                                             "scale": self._scale}, specialized=False)
        self.missions = []
        self.mission_socket = mission_socket
        self.idle_quit = idle_quit
        self.log_file = log_file
        self.max_missions = max_missions
        self.swarm = swarm         # a SwarmKeeper, or None when no batch system is set
        if swarm is not None:
            swarm.warn = self.warn_all
        self.stopped = trio.Event()
        self.fleet = (0, 0)  # its workers and their cores, for its missions' status lines

    async def run(self, *, task_status=TASK_STATUS_IGNORED):
        """Serve until stopped (`stop`, idle_quit, a signal); then FIN to the workers."""
        async with open_strict_nursery() as nursery:
            start_head(self, nursery, self._push_held)
            urls = await nursery.start(self.service.run)
            if self.mission_socket:
                await nursery.start(serve, f"unix://{self.mission_socket}", self.service.key,
                                    self.service.handle_connection)
            nursery.start_soon(self._watch_idle)
            if self.swarm is not None:
                nursery.start_soon(self.swarm.run, self.joined)
            task_status.started(urls)
            log.info("head daemon pid %d at %s; missions on this host attach at unix://%s",
                     os.getpid(), self.service.listen, self.mission_socket)
            await self.stopped.wait()
            self.closing = True
            with trio.CancelScope(shield=True):
                await self.service.say_goodbye()
            nursery.cancel_scope.cancel()

    # -- the worker protocol ---------------------------------------------------------
    def function_bytes(self, fn):
        return fn.digest, fn.data

    def add_worker(self, worker):
        if self.swarm is not None:
            self.swarm.pending.pop(worker.job_id, None)
        super().add_worker(worker)
        self._tell_fleet(worker, 1)

    def remove_worker(self, worker):
        super().remove_worker(worker)
        if self.swarm is not None:
            self.swarm.changed.set()
        self._tell_fleet(worker, -1)

    def _tell_fleet(self, worker, sign):
        """Its missions' status lines show its workers and their cores: a worker came or went."""
        self.fleet = tuple(a + sign * b for a, b in zip(self.fleet, worker.fleet))
        for m in self.missions:
            m.channel.send(("workers", *self.fleet))

    def job_sent(self, job):
        """A worker starts it: its mission counts it running, and its cores used, from now."""
        job.queue.channel.send(("started", job.ref))

    def _push_held(self, job):
        if not job.queue.gone:  # its worker did not come back: it runs again
            self.scheduler.push(job)

    def may_retry(self, job):
        return not job.queue.gone

    def requeue(self, job):
        self.scheduler.push_front(job)

    def complete(self, job, value, error, kind, pickled):
        """(Only the jobs of lost and retired workers end here; see deliver.)"""
        self.retries.note(job, error, kind)
        self.deliver(job, False, pickled_failure(error), 0.0, kind)

    def deliver(self, job, ok, data, duration, kind):
        """A job of a mission ended: count it and pass its result on, if the mission is
        still there."""
        self.end(job, ok, kind)
        self.tally.ended(job.state, kind)
        m = job.queue
        if m.gone:
            return
        if ok:
            m.done += 1
        else:
            m.failed += 1
        m.channel.send(("done", job.ref, ok, data, duration, kind))

    # -- missions ------------------------------------------------------------------
    async def serve_mission(self, channel, info):
        if not isinstance(info, dict):
            raise PeerError(f"a mission greeting must be a dict, got {info!r:.60}")
        if len(self.missions) >= self.max_missions:
            channel.send(("refused", f"the head daemon (pid {os.getpid()} on {hostname()}) "
                                     f"serves {len(self.missions)} missions already, its "
                                     "limit ([head.gnaw] max_conn)"))
            return
        channel.silent_after = MISSION_SILENT_S  # its main may block its event loop a while
        m = MissionQueue(channel, info)
        self.missions.append(m)
        # (What it holds already, a swarm's workers, lives on: while missions run, full
        # collections walk only what came since; each took 70 ms with 1,000.)
        self.heap.freeze()
        self.scheduler.add_queue(m)
        self._changed()
        channel.send(("attached", {"pid": os.getpid(), "host": hostname(), "log": self.log_file,
                                   "workers": self.fleet}))
        log.info("mission %s attached from %s%s", m.name, m.host,
                 " (prioritized)" if m.prioritized else "")
        try:
            await channel.dispatch_all({"job": functools.partial(self._accept_job, m),
                                        "fn": functools.partial(self._accept_function, m),
                                        "ping": _ignore})
        except PeerError as e:
            log.warning("mission %s dropped: %s", m.name, e)
        finally:
            self._detach(m)

    def _accept_function(self, m, digest, data, name="?"):
        m.functions[digest] = _OpaqueFunction(digest, data, name)

    def _accept_job(self, m, ref, req, digest, payload, resumed=False):
        """A job of mission ``m``; ``resumed``: it had given it to a daemon before this one,
        which may have started it (its worker may come back with it, or its result)."""
        fn = m.functions.get(digest)
        if fn is None or not isinstance(req, Resource) or not req._parts():
            raise PeerError(f"job {ref!r}: unknown function or no resource request")
        job = Job(next(self._ids), req, fn, None, None, m)
        job.ref = ref
        job.name_on_wire(f"{m.token}/{ref}")
        job.payload = payload
        self.heap.freeze(job)
        if not (resumed and self.reunion.offer(job, hold=True)):
            self.scheduler.push(job)

    def _detach(self, m):
        """The mission ended or died: drop its queue, cancel what still runs for it."""
        m.gone = True
        self.missions.remove(m)
        dropped = len(self.scheduler.remove_queue(m))
        running = [(w, job) for w in self.scheduler.workers for job in w.busy if job.queue is m]
        for w, job in running:
            w.cancel(job)
        self._changed()
        log.info("mission %s detached (%d done, %d failed)%s", m.name, m.done, m.failed,
                 f"; dropped {dropped} queued and cancelled {len(running)} running job(s)"
                 if dropped or running else "")
        if not self.missions:
            self.heap.thaw()
        self.pump()

    def warn_all(self, text):
        """A warning for the daemon's log and every attached mission."""
        log.warning("%s", text)
        for m in self.missions:
            m.channel.send(("warn", text))

    async def _watch_idle(self):
        while True:  # (no deadline while a mission is attached)
            with trio.move_on_after(math.inf if self.missions else self.idle_quit) as idle:
                await self.changed.wait()
            if idle.cancelled_caught:
                log.info("no mission for %s; stopping", format_walltime(self.idle_quit))
                self.stopped.set()
                return

    # -- the command line --------------------------------------------------------------
    def _stats(self):
        stats = self.service.stats()
        running = Counter(job.queue for w in self.scheduler.workers for job in w.busy)
        stats["missions"] = [{"name": m.name, "host": m.host, "prioritized": m.prioritized,
                              "queued": len(m.jobs), "running": running.get(m, 0), "done": m.done,
                              "failed": m.failed, "since": m.since} for m in self.missions]
        if self.swarm is not None:
            stats["swarm"] = self.swarm.statistics(self.joined())
        return stats

    def _stop(self):
        return ({"done": [f"the head daemon (pid {os.getpid()}) stops: FIN to "
                          f"{len(self.scheduler.workers)} worker(s), {len(self.missions)} "
                          "mission(s) detached"]}, self.stopped.set)

    def _scale(self, n):
        _check_count(n, "the number of workers")
        if self.swarm is None:
            raise ValueError("this head has no batch system to submit workers to: set system "
                             "= \"slurm\", \"pbs\" or \"custom\" in its grain.toml")
        self.swarm.target = n
        self.swarm.changed.set()
        return {"done": [f"swarm target: {n} worker(s)" if n else "autoscaling is off"]}


async def head_main(s, worker, key, idle_quit=None):
    """Run the head daemon for head settings ``s`` until stopped, idle or signalled."""
    swarm = SwarmKeeper(worker, s.swarm, s.swarm_quota, s.swarm_window) if worker.system else None
    daemon = HeadDaemon(
        s.listen, key, idle_quit=s.idle_quit if idle_quit is None else idle_quit,
        mission_socket=mission_socket_path(s.listen), swarm=swarm, max_missions=s.max_missions,
        job_book=_job_book(worker), log_file=os.environ.get("GRAIN_HEAD_LOG", ""))
    if s.daemon_extra_args:
        log.warning("[head.gnaw] extra_args %s have no effect: they were command-line flags "
                    "of upstream's Go daemon", " ".join(s.daemon_extra_args))
    def stop(name):
        log.info("got %s; stopping", name)
        daemon.stopped.set()

    async with open_strict_nursery() as nursery:
        await nursery.start(watch_signals, stop)
        await daemon.run()
        nursery.cancel_scope.cancel()
    return 0


###############################################################################
# Pack ########################################################################
###############################################################################
# ``python grain.py pack``: one self-contained zipapp (grain.py, trio and everything
# it imports, dill, and tomli below 3.11) for clusters with no pip. Wheels come from
# --wheels DIR, else `pip download` for the target Python, else this interpreter's
# installed copies when their versions support the target. Entries are sorted and
# stamped 1980-01-01, so the same inputs give the same bytes. The bundle is run
# under the target Python (isolated, no site) before it replaces the output.

PACK_PACKAGES = ["trio", "attrs", "sortedcontainers", "idna", "outcome", "sniffio", "dill"]
PACK_PACKAGES_BELOW_311 = ["exceptiongroup", "typing_extensions", "tomli"]
PACK_EPOCH = (1980, 1, 1, 0, 0, 0)
PACK_MAIN = b"import sys\nimport grain\nsys.exit(grain.main(sys.argv[1:]))\n"


def _norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _version_key(version):
    return tuple(int(x) for x in re.findall(r"\d+", version))


def python_supports(requires, target):
    """Does a Requires-Python specifier (e.g. ">=3.8, !=3.9.*") admit Python ``target``
    (a (major, minor) tuple)? Enough of PEP 440 for the packages we bundle."""
    for clause in (requires or "").split(","):
        m = re.match(r"^\s*(~=|==|!=|<=|>=|<|>)\s*([\d.]+)(\.\*)?\s*$", clause)
        if not m:
            continue
        op, ver, star = m.groups()
        want = _version_key(ver)
        have = target + (0,) * max(0, len(want) - 2) if not star else target[:len(want)]
        if not {">=": have >= want, ">": have > want, "<=": have <= want, "<": have < want,
                "==": have == want, "!=": have != want,
                "~=": have >= want and have[:len(want) - 1] == want[:len(want) - 1]}[op]:
            return False
    return True


def _bundle_file(path):
    """Should a package file go into the bundle? Code and data yes; tests, caches, type
    stubs and metadata no."""
    parts = path.split("/")
    return bool(parts[0]) and not path.endswith((".pyc", ".pyi", "py.typed")) and not any(
        p.endswith((".dist-info", ".data")) or p in ("__pycache__", "_tests", "tests")
        for p in parts)


def _dist_files(dist):
    """The files of an installed distribution, or of a wheel, that go into the bundle."""
    return {rel: f.read_binary() for f in dist.files or ()
            for rel in [str(f).replace(os.sep, "/")]
            if _bundle_file(rel) and not rel.startswith("..")}


def _from_wheels(directory, names, target):
    """Pick, for each package, the newest wheel in ``directory`` that supports ``target``."""
    import importlib.metadata as md

    found = {}
    for fn in sorted(fn for fn in os.listdir(directory) if fn.endswith(".whl")):
        path = os.path.join(directory, fn)
        # (importlib.metadata reads a wheel as it reads a zip on sys.path)
        dist = next(iter(md.distributions(path=[path])), None)
        if dist is None or not dist.read_text("METADATA"):
            raise GrainError(f"{path}: not a wheel (no METADATA)")
        if not python_supports(dist.metadata.get("Requires-Python"), target):
            continue
        name = _norm(dist.metadata["Name"])
        if name not in found or _version_key(dist.version) > _version_key(found[name][0]):
            found[name] = (dist.version, _dist_files(dist))
    for name in names:
        if _norm(name) not in found:
            raise GrainError(f"no wheel of {name} supporting Python "
                             f"{target[0]}.{target[1]} in {directory}"
                             + (" (trio 0.31 is the newest for Python 3.9)"
                                if name == "trio" and target < (3, 10) else ""))
    return {name: found[_norm(name)] for name in names}


def _from_installed(names, target):
    """This interpreter's installed copies, if their versions support ``target``."""
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise GrainError(f"{name} is not installed here and no wheel was given (use --wheels "
                             "DIR, or a machine that reaches a package index)") from None
        requires = dist.metadata.get("Requires-Python")
        if not python_supports(requires, target):
            raise GrainError(f"the installed {name} {dist.version} needs Python "
                             f"{requires}, not {target[0]}.{target[1]}; give --wheels DIR "
                             f"with a {name} for {target[0]}.{target[1]}")
        out[name] = (dist.version, _dist_files(dist))
    return out


def find_python(target):
    """An interpreter of version ``target`` to test a bundle with: this one, one of pyenv's,
    or pythonX.Y on PATH (pyenv's shims only pretend to be one)."""
    if sys.version_info[:2] == target:
        return sys.executable
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    versions = os.path.join(root, "versions")
    if os.path.isdir(versions):
        for v in sorted(os.listdir(versions), key=_version_key, reverse=True):
            candidate = os.path.join(versions, v, "bin", "python")
            if _version_key(v)[:2] == target and os.path.exists(candidate):
                return candidate
    for d in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(d, f"python{target[0]}.{target[1]}")
        if "shims" not in d.split(os.sep) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _own_source():
    """The text of this module, whether it runs from grain.py or from inside a bundle."""
    loader = globals().get("__loader__")
    if loader is not None and hasattr(loader, "get_data"):
        return loader.get_data(__file__)
    with open(__file__, "rb") as f:
        return f.read()


def build_bundle(packages, out):
    """Write the zipapp: a shebang, then sorted, timestamp-free entries."""
    import zipfile

    entries = {"__main__.py": PACK_MAIN, "grain.py": _own_source()}
    for _, (_, files) in sorted(packages.items()):
        entries.update(files)
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(f, "w") as z:
            for name in sorted(entries):
                info = zipfile.ZipInfo(name, PACK_EPOCH)
                info.external_attr = 0o644 << 16
                info.create_system = 3
                z.writestr(info, entries[name], zipfile.ZIP_DEFLATED, compresslevel=9)
    os.chmod(tmp, 0o755)
    return tmp


def pack(out="grain.pyz", python=None, wheels=None, say=print):
    """Build the bundle for Python ``python`` ("X.Y"; default: this one). Returns its path."""
    if problem := output_path_problem(out):  # (said before any download)
        raise UsageError(f"-o {out}: {problem}")
    target = sys.version_info[:2]
    if python:
        m = re.match(r"^(\d+)\.(\d+)$", python)
        if not m:
            raise UsageError(f"--python takes X.Y, e.g. 3.9, got {python!r}")
        target = tuple(map(int, m.groups()))
    if target < (3, 9):
        raise UsageError(f"grain.py needs Python 3.9 or newer, not {target[0]}.{target[1]}")
    names = PACK_PACKAGES + (PACK_PACKAGES_BELOW_311 if target < (3, 11) else [])
    if wheels:
        if not os.path.isdir(wheels):
            raise UsageError(f"--wheels {wheels}: no such directory")
        packages = _from_wheels(wheels, names, target)
        say(f"pack: using the wheels in {wheels}")
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            # pip evaluates markers for this interpreter, not the target: name every
            # package ourselves (--no-deps) rather than trust its dependency resolution.
            try:
                _run_command([sys.executable, "-m", "pip", "download", "--quiet",
                              "--only-binary=:all:", "--python-version",
                              f"{target[0]}.{target[1]}", "--no-deps", "-d", d, *names],
                             "pip download", timeout=300)
            except GrainError as e:
                say(f"pack: {e}; using this interpreter's installed copies")
                packages = _from_installed(names, target)
            else:
                packages = _from_wheels(d, names, target)
                say(f"pack: downloaded wheels for Python {target[0]}.{target[1]} with pip")
    say("pack: " + ", ".join(f"{n} {v}" for n, (v, _) in packages.items()))
    tmp = build_bundle(packages, out)
    interpreter = find_python(target)
    try:
        if interpreter is None:
            say(f"pack: no Python {target[0]}.{target[1]} here to test the bundle with")
        else:
            version = _run_command([interpreter, "-I", "-S", tmp, "--version"], "testing the "
                                   f"bundle under {interpreter}", "the bundle is not written", 120)
            say(f"pack: tested with {interpreter} -I -S: {version.strip()}")
        os.replace(tmp, out)
    finally:
        _unlink_quietly(tmp)
    say(f"pack: wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")
    return out


###############################################################################
# CLI #########################################################################
###############################################################################
# ``python grain.py COMMAND``. build_parser() describes the commands; main(argv) runs
# one and returns the exit code. Only main configures logging or decides to exit. The
# client side of the head's commands (ls, quit, stop, scale) is here too.


async def cli_request(address, key, *msg):
    """Send one command to the head at ``address``; its reply, or None if none answers."""
    with trio.move_on_after(CLI_TIMEOUT_S):
        try:
            stream = await connect(address, key)
        except KeyMismatch:  # a head answered: not one of this key
            raise
        except Unreachable:
            return None
        async with open_channel(stream, address, heartbeat=False, silent_after=None) as ch:
            ch.send(("cli", *msg))
            reply = await ch.receive()
            return dispatch({"reply": lambda r: r}, reply, address) if reply else None
    return None


def format_waiting(waiting, blocked=False):
    """A line per waiting job of explain() (``blocked``: only those that wait for a while)."""
    return [f"{w['job']} of {w['queue']}, waiting {format_walltime(w['waited'])}: "
            f"{w['reason']}" for w in waiting if w["waited"] > 0 or not blocked]


def format_ls(stats):
    """The `ls` table: one row per worker, a TOTAL row, then the queue figures."""
    workers = stats["workers"]
    amounts = [(key, fmt) for key, _, fmt in LS_AMOUNTS
               if key != "gpus" or any(w.get(key, (0, 0))[1] for w in workers)]
    rows = [("WORKER", *(f"{key.upper()} free/total" for key, _ in amounts),
             "WALLTIME", "RUNNING", "STATUS", "WHERE")]
    for w in workers:
        rows.append((w["name"], *(fmt.format(*w.get(key, (0, 0))) for key, fmt in amounts),
                     "-" if w["walltime"] is None else format_walltime(w["walltime"]),
                     str(w["running"]), w["status"], w["where"]))
    rows.append(("TOTAL", *(fmt.format(*(sum(w.get(key, (0, 0))[i] for w in workers)
                                         for i in (0, 1))) for key, fmt in amounts),
                 "", str(sum(w["running"] for w in workers)), f"{len(workers)} worker(s)", ""))
    widths = [max(map(len, column)) for column in zip(*rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    def by_class(counts):
        inner = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        return f" ({inner})" if inner else ""

    lines += ["", f"jobs: {stats['queued']} queued, {stats['running']} running, {stats['done']} "
                  f"done, {stats['failed']} failed{by_class(stats['failed_by_class'])}, "
                  f"{stats['retried']} retried{by_class(stats['retried_by_class'])}"]
    if stats["next"]:
        lines.append(f"next pending job requests {stats['next']}")
    lines += [f"  {line}" for line in format_waiting(stats.get("waiting", ()), blocked=True)]
    if "missions" in stats:
        lines += ["", f"missions: {len(stats['missions'])} attached"]
        lines += [f"  {m['name']} on {m['host']}{' (prioritized)' if m['prioritized'] else ''}: "
                  f"{m['queued']} queued, {m['running']} running, {m['done']} done, "
                  f"{m['failed']} failed" for m in stats["missions"]]
    sw = stats.get("swarm")
    if sw is not None and not sw["target"] and not sw["pending"]:
        lines.append("swarm: autoscaling is off (`grain.py scale N` turns it on)")
    elif sw is not None:
        pending = ", ".join(sw["pending"]) or "none"
        lines.append(f"swarm: target {sw['target']}, {sw['joined']} joined, "
                     f"{len(sw['pending'])} submitted not joined ({pending}); quota "
                     f"{sw['used']}/{sw['quota']} per {format_walltime(sw['window'])}")
        if sw["note"]:
            lines.append(f"swarm: {sw['note']}")
    return "\n".join(lines)


def _versions():
    where = " bundle" if os.path.isfile(os.path.dirname(os.path.abspath(__file__))) else ""
    tomli = "" if sys.version_info >= (3, 11) or tomllib is None else \
        f", tomli {getattr(tomllib, '__version__', '?')}"
    return (f"grain.py{where} {__version__} (trio {_package_version('trio', '_version.py')}, dill "
            f"{_package_version('dill', '__info__.py')}{tomli}, Python {sys.version.split()[0]})")


def _opt(*flags, **kw):
    """An option of the table below: add_argument's arguments."""
    return flags, kw


# Options several commands share, by name: (flags, argparse keywords).
_SHARED_OPTIONS = {
    "config": _opt("-c", "--config", metavar="FILE", help="the config (default: "
                   "$GRAIN_CONFIG, else ./grain.toml)"),
    "address": _opt("-a", "--address", help="the head's address (default: worker.cli_dial)"),
    "key": _opt("--key", metavar="PATH", help="the shared key file (default "
                "~/.local/share/grain/key)"),
    "dry": _opt("--dry", action="store_true", help="print the job script; submit nothing"),
}
_AT_HEAD = ("address", "config", "key")
# The commands: name, help, shared options, options of its own.
_COMMAND_LINE = [
    ("worker", "run a worker: connect to a head and run its jobs", ("key", "config"), [
        _opt("--url", help="the head's address: tcp://host:port, unix:///path, "
             "edge:///path or bridge://LABEL@HOST:PORT (default: the Edge file "
             "in ~/.local/share)"),
        _opt("--listen", metavar="URL", help="be a passive worker: wait at "
             "tcp://:PORT for a head to dial"),
        _opt("-r", "--res", metavar="JSON", help='resources to offer, e.g. \'{"Cores": '
             '{"N": 16}, "Memory": {"M": 32}}\' or \'{"Node": {"N": 16, '
             '"M": 32}}\' (default: this cpuset and memory)'),
        _opt("--max-frame", type=int, default=MAX_FRAME, metavar="BYTES", help="the "
             "largest message the head may send (default 1 GiB)"),
        _opt("--oversubscribe", action="store_true", help="allow --res to offer more "
             "cores than this process's cpuset (the extra ids are "
             "virtual; for tests and benchmarks)"),
        _opt("--context", metavar="FILE", help="a Python file whose grain_context() "
             "wraps the worker's life"),
        _opt("--name", help="the worker's name (default: the hostname)"),
        _opt("--sworker", metavar="MODULE", help="be a specialized worker of this type "
             "(worker.specialized_type): its jobs run in the mission, this "
             "process keeps the module's grain_run_sworker() running"),
        _opt("--reattach", metavar="DURATION", help="when the head is lost, keep running "
             "its jobs this long for a new head, e.g. 10m, 0 to leave at "
             "once (default: worker.reattach, 10m)"),
        _opt("--tls-cert", metavar="PEM", help="speak TLS with this certificate "
             "(default: worker.tls_cert)"),
        _opt("--tls-key", metavar="PEM", help="its private key (default: "
             "worker.tls_key, else in the --tls-cert file)")]),
    ("ls", "show the head's workers, queue and submitted jobs", _AT_HEAD, [
        _opt("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
             help="show it again every SECONDS (default 2), in place"),
        _opt("--json", action="store_true", help="print the same facts as JSON (see "
             "the README for its fields)")]),
    ("explain", "say why the oldest waiting job of each mission does not run", _AT_HEAD, []),
    ("quit", "make workers leave (after their jobs, or now with -f)", _AT_HEAD, [
        _opt("pattern", help="a glob over worker names, e.g. 'node1*'"),
        _opt("-f", "--force", action="store_true", help="leave now; their running jobs "
             "are re-queued")]),
    ("head", "run the head daemon: a scheduler shared by missions, keeping workers between "
             "them (missions start one when none runs)", ("config", "key"), [
        _opt("--no-config", action="store_true", help="use the defaults, ignore "
             "./grain.toml and $GRAIN_CONFIG"),
        _opt("-a", "--address", help="where to listen (default: head.listen)"),
        _opt("--idle-quit", metavar="DURATION", help="quit after this long without "
             "missions (default: head.idle_quit)")]),
    ("bridge", "run a bridge: the rendezvous (and relay) through which a head and workers "
               "on clusters that cannot reach each other meet (bridge://LABEL@HOST:PORT)", (), [
        _opt("--listen", default=f"tcp://:{BRIDGE_PORT}", metavar="tcp://[HOST]:PORT",
             help=f"where to listen (default: every interface, port "
                  f"{BRIDGE_PORT})")]),
    ("stop", "stop the head daemon (its workers get FIN)", _AT_HEAD, []),
    ("scale", "keep N workers submitted (0: autoscaling off)", _AT_HEAD, [
        _opt("n", type=int, metavar="N", help="the number of workers")]),
    ("up", "submit worker jobs to the batch system (other arguments go to its submit "
           "command: sbatch, qsub, bsub, flux batch)", ("config", "dry"), [
        _opt("-n", type=int, default=1, metavar="N", help="how many (default 1)"),
        _opt("--array", action="store_true", help="as one array job (as "
             "script.array = true)")]),
    ("down", "cancel every worker or head job grain submitted (and turn the head's "
             "autoscaling off)", _AT_HEAD, []),
    ("pack", "build grain.pyz: grain.py with trio and dill inside, for machines without pip",
     (), [_opt("-o", "--output", default="grain.pyz", metavar="FILE"),
          _opt("--python", metavar="X.Y", help="the target Python (default: this one)"),
          _opt("--wheels", metavar="DIR", help="take the wheels from DIR (offline)")]),
    ("start", "submit the head job (head.cmd), or run it --local", ("config", "dry"), [
        _opt("--local", action="store_true", help="run head.cmd here instead")]),
    ("results", "show what a results store holds, or forget some of it", (), [
        _opt("store", metavar="STORE", help="the store's file (run(results=...))"),
        _opt("--forget", metavar="PATTERN", help="drop the entries of the functions "
             "matching this glob, e.g. 'compute*'"),
        _opt("--state", choices=("done", "failed", "running"), help="with --forget: "
             "only those, e.g. failed")]),
]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="grain.py",
        description="A resource-aware parallel scheduler for HPC clusters, in one file.")
    parser.add_argument("--version", action="version", version=_versions())
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_, shared, own in _COMMAND_LINE:
        p = sub.add_parser(name, help=help_)
        for flags, kw in own + [_SHARED_OPTIONS[o] for o in shared]:
            p.add_argument(*flags, **kw)
    return parser


def _cmd_worker(args):
    if args.url and args.listen:
        raise UsageError("give --url (dial a head) or --listen (wait for one), not both")
    res = None
    if args.res is not None:
        try:
            res = Resource.from_dict(json.loads(args.res))
        except json.JSONDecodeError as e:
            raise UsageError(f"--res: malformed JSON ({e}): {args.res!r}") from None
        except ValueError as e:
            raise UsageError(f"--res: {e}") from None
    url = args.url or default_address()
    parse_url(args.listen or url)
    if not args.listen:
        worker_provider(res, args.oversubscribe)  # refuse impossible resources up front
    if args.max_frame < 1024:
        raise UsageError(f"--max-frame must be at least 1024 bytes, got {args.max_frame}")
    if args.context and not os.path.isfile(args.context):
        raise UsageError(f"--context {args.context}: " + (
            "a directory, not a file" if os.path.isdir(args.context) else "no such file"))
    if args.name is not None and not args.name.strip():
        raise UsageError("--name takes a name, got an empty one")
    s = load_config(args.config).role("worker")
    reattach = s.reattach if args.reattach is None else \
        parse_duration(args.reattach, "--reattach")  # (a ValueError is bad input: exit 2)
    return trio_run(functools.partial(worker_main, url=url, res=res, name=args.name,
                                      context_file=args.context, listen=args.listen,
                                      key_path=args.key, oversubscribe=args.oversubscribe,
                                      max_frame=args.max_frame, sworker=args.sworker or None,
                                      reattach=reattach, tls=(args.tls_cert or s.tls_cert,
                                                              args.tls_key or s.tls_key)))


class _CliTarget(namedtuple("_CliTarget", "settings address key why")):
    """The head a CLI command talks to: the worker settings, its address, the key (None:
    there is no key file, so no head of ours is there) and what to say when none answers."""

    def nobody(self):
        return GrainError(f"no head is listening at {self.address} ({self.why})")


def _head_seems_there(address):
    """Whether a head seems to listen at ``address``, asked with no key (so no handshake):
    its Edge file's live record (True, or the key file it names), or a socket that takes
    a connection."""
    with contextlib.suppress(GrainError, OSError, ValueError):
        scheme, host, where = parse_url(address)
        if scheme == "edge":
            edge = EdgeFile(where)
            record = edge._read()["listener"]
            return edge.live(record) and (record.get("key") or True)
        if scheme in ("tcp", "unix"):
            with socket.socket(socket.AF_UNIX if scheme == "unix" else socket.AF_INET6
                               if ":" in host else socket.AF_INET) as probe:
                probe.settimeout(1)
                probe.connect(where if scheme == "unix" else (host, where))
                return True
    return False


def _cli_target(args):
    """The _CliTarget of ls, explain, quit, stop and scale."""
    config = load_config(args.config)
    s = config.role("worker")
    # without -a, the first of these that is set decides, as in RoleSettings
    origin = "given with -a" if args.address else next((
        f"{name} in {config.path}" for attr, name, default in (
            ("cli_dial", "worker.cli_dial", s.dial), ("dial", "worker.dial", s.address),
            ("address", "address", default_address())) if getattr(s, attr) != default),
        "the default Edge file")
    key_path = args.key or s.auth_key
    address = args.address or s.cli_dial
    if not os.path.isfile(os.path.expanduser(key_path)):  # (a client makes no key)
        if theirs := _head_seems_there(address):  # (then the key is what is missing)
            raise GrainError(f"a head listens at {address} ({origin}), but there is no key "
                             f"file at {key_path} to speak to it: copy the head's key"
                             f"{f' ({theirs})' if theirs is not True else ''} there")
        return _CliTarget(s, address, None, f"{origin}; no key file at {key_path} either: a "
                          "head makes its key when it starts")
    return _CliTarget(s, address, load_auth_key(key_path, s.tls_cert, s.tls_key), origin)


def submitted_jobs(book, s, joined, headless=False):
    """The batch jobs grain submitted whose worker has not joined (yet), each a dict of
    id, name, log, state (asked of the batch system) and joined (see JobBook.waiting)."""
    return [{**{k: r[k] for k in ("id", "name", "log", "state")}, "joined": bool(r.get("joined"))}
            for r in book.waiting(s.system, s.custom_system, joined, headless)]


def format_jobs(records):
    """Lines about submitted batch jobs whose worker has not joined (submitted_jobs), or
    joined a head that is gone."""
    lines = []
    for r in sorted(records, key=lambda r: r["joined"]):  # (stable: in submission order)
        heading = ("joined a head that no longer answers, still queued or running (`down` "
                   "ends them):") if r["joined"] else "submitted, not joined:"
        if heading not in lines:
            lines += ["", heading]
        said = {UNKNOWN: "state unknown (the batch system did not answer)",
                ENDED: f"ENDED WITHOUT ITS WORKER EVER JOINING; the end of its log {r['log']}:"}
        lines.append(f"  job {r['id']} ({r['name']}): {said.get(r['state'], r['state'])}")
        lines += [log_tail(r["log"])] if r["state"] == ENDED else []
    return lines


def _cli_call(target, *msg):
    """Send one command to the head; GrainError if none answers or it refuses."""
    reply = target.key and trio_run(cli_request, target.address, target.key, *msg)
    if not reply:
        raise target.nobody()
    if "error" in reply:
        raise GrainError(reply["error"])
    return reply


def _cmd_head(args):
    if args.no_config and args.config:
        raise UsageError(f"-c {args.config} and --no-config: give one of them")
    cfg = load_config(False if args.no_config else args.config)
    s = cfg.role("head")
    worker = cfg.role("worker")
    if args.address:
        parse_url(args.address)
        s = replace(s, listen=args.address)
        worker = replace(worker, dial=args.address)
    idle_quit = parse_duration(args.idle_quit, "--idle-quit") if args.idle_quit else None
    key = load_auth_key(args.key or s.auth_key or None, s.tls_cert, s.tls_key)
    gc.set_threshold(DAEMON_YOUNG_GC, *gc.get_threshold()[1:])  # (its process: no user code)
    return trio_run(head_main, s, worker, key, idle_quit)


def _cmd_at_head(args):
    """`stop`, `scale N`, `quit [-f] PATTERN`: one command for the head; print its answer."""
    if args.command == "scale" and args.n < 0:
        raise UsageError(f"N must be a whole number >= 0, got {args.n}")
    arguments = {"stop": (), "scale": ("n",), "quit": ("pattern", "force")}[args.command]
    reply = _cli_call(_cli_target(args), args.command, *(getattr(args, a) for a in arguments))
    for line in reply["done"]:
        print(line)
    return 1 if reply.get("matched") == 0 else 0  # (quit: no worker matched the pattern)


def _ls_frame(target, as_json):
    """``(text, trouble)``: what `ls` shows now, and why no head's view is in it (None:
    a head answered)."""
    s, address, key, _ = target
    stats = key and trio_run(cli_request, address, key, "stats")
    trouble = None if stats else str(target.nobody())
    joined = set(stats["joined_job_ids"]) if stats else set()
    submitted = submitted_jobs(JobBook(address), s, joined, headless=not stats)
    if as_json:
        return json.dumps(dict(stats or {}, head=stats is not None, address=address,
                               submitted=submitted), indent=1, default=str), trouble
    if stats is None:
        return "\n".join(format_jobs(submitted)[1:]), trouble
    return "\n".join([format_ls(stats)] + format_jobs(submitted)), None


def _cmd_ls(args):
    if args.watch is not None and not 0 < args.watch <= 86400:  # (NaN too)
        raise UsageError(f"--watch takes a number of seconds above 0 (a day at most), got "
                         f"{args.watch:g}")
    target = _cli_target(args)
    if args.watch is None:
        text, trouble = _ls_frame(target, args.json)
        if text:
            print(text)
        if trouble and not args.json:
            raise GrainError(trouble)
        return 1 if trouble else 0
    redraw = "\x1b[H\x1b[J" if sys.stdout.isatty() else ""  # home, clear: in place
    try:
        while True:
            text, trouble = _ls_frame(target, args.json)
            if trouble and not args.json:
                text = f"{text}\n{trouble}".lstrip("\n")
            print(f"{redraw}{text}\n" if args.json else f"{redraw}{target.address} at "
                  f"{time.strftime('%H:%M:%S')} (every {args.watch:g} s; Ctrl-C ends)\n"
                  f"{text}\n{'' if redraw else chr(10)}", end="", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _cmd_explain(args):
    target = _cli_target(args)
    stats = _cli_call(target, "stats")
    lines = format_waiting(stats.get("waiting", ())) or ["no job is waiting"]
    if not stats["workers"]:  # what the submitted worker jobs are doing
        lines += format_jobs(submitted_jobs(JobBook(target.address), target.settings, set()))
    print("\n".join(lines))
    return 0


def _cmd_up(args):
    s = load_config(args.config).role("worker")
    if args.n < 1:
        raise UsageError(f"-n must be at least 1, got {args.n}")
    module, backendless = specialized_module(s)
    if backendless:
        print(f"specialized worker type {s.specialized_type} is backendless: it runs in the "
              "mission, there is no worker job to submit", file=sys.stderr)
        return 0
    s = replace(s, script=replace(s.script, array=s.script.array or args.array))
    if args.dry:
        print(render_script(s, worker_command(s), None, 0, args.n), end="")
        return 0
    n = args.n
    if s.script.max_queued:  # the worker jobs still queued count (one query for them all)
        queued = sum(j["state"] != ENDED for j in submitted_jobs(JobBook(s.dial), s, set()))
        n = queue_room(s, args.n, queued)
        if n < args.n:
            print(f"max_queued = {s.script.max_queued} and {queued} worker job(s) are queued: "
                  f"submitting {n} of {args.n}", file=sys.stderr)
    when = time.time()
    for seq, ids in submit_workers(s, n, args.extra, when):
        name, log_file = job_name_and_log(s, when, seq)
        print(f"submitted worker job {ids[0]} ({name}); log: {log_file}" if len(ids) == 1 else
              f"submitted worker array job of {len(ids)} tasks, {ids[0]} to {ids[-1]} "
              f"({name}); logs: {task_log(log_file, '*')}")
    return 0


def _cmd_start(args):
    s = load_config(args.config).role("head")
    if not s.cmd:
        raise ConfigError("set head.cmd in grain.toml: the command the head job runs, e.g. "
                          "\"python mission.py\"")
    if args.local:
        return subprocess.call(s.cmd, shell=True)
    when = time.time()
    s = replace(s, log_file=s.main_log_file)  # the head job's own log (head.log_file is
    script = render_script(s, s.cmd, when)    # where its local worker's jobs print)
    if args.dry:
        print(script, end="")
        return 0
    job_id, = submit_script(s, script, args.extra, "head", when)
    print(f"submitted head job {job_id} ({_stamp(s.name, when)})")
    return 0


def _by_system(records):
    """``{batch system: its records}``, in the order they come."""
    groups = {}
    for r in records:
        groups.setdefault(r.get("system"), []).append(r)
    return groups


def _cmd_down(args):
    cfg = load_config(args.config)
    # A head that keeps a swarm would submit workers again for those cancelled here.
    with contextlib.suppress(GrainError):
        target = _cli_target(args)
        stats = target.key and trio_run(cli_request, target.address, target.key, "stats")
        if stats and (stats.get("swarm") or {}).get("target"):
            _cli_call(target, "scale", 0)
            print("turned the head's autoscaling off (`grain.py scale N` turns it on again)")
    custom = cfg.role("worker").custom_system
    books = {b.path: b for b in (JobBook(cfg.role("worker").dial),
                                 JobBook(cfg.role("head").listen))}
    cancelled = 0
    for book in books.values():
        live = set()  # and those whose state is unknown: cancelling them is safe
        for system, records in _by_system(book.records()).items():
            states = batch_states(system, [r["id"] for r in records], custom)
            live |= {i for i, state in states.items() if state != ENDED}

        def cancel_live(records):
            nonlocal cancelled
            keep = []  # (ended: forget)
            for system, ones in _by_system(r for r in records if r["id"] in live).items():
                try:  # one command for all of a system's jobs (a custom one: one a job)
                    cancel_jobs(system, [r["id"] for r in ones], custom)
                except GrainError as e:
                    print(f"job {', '.join(r['id'] + ' (' + r['name'] + ')' for r in ones)}: "
                          f"{e}; cancel {'it' if len(ones) == 1 else 'them'} yourself")
                    keep += ones
                    continue
                for r in ones:
                    print(f"cancelled {r['role']} job {r['id']} ({r['name']})")
                cancelled += len(ones)
            return keep

        book.update(cancel_live)
    if not cancelled:
        print("no job to cancel")
    return 0


def _cmd_results(args):
    if not os.path.isfile(args.store):
        raise UsageError(f"results store {args.store}: " + (
            "a directory, not a store" if os.path.isdir(args.store) else "no such file"))
    if args.state and not args.forget:
        raise UsageError(f"--state {args.state} goes with --forget PATTERN")
    store = ResultStore(args.store).open(hold=bool(args.forget))
    try:
        if args.forget:
            n = store.forget(args.forget, args.state)
            print(f"forgot {n} entr{'y' if n == 1 else 'ies'} of {args.forget!r}"
                  f"{' (' + args.state + ')' if args.state else ''}"
                  f"{'' if n else ': none matches (the functions are listed below)'}")
        rows, size, failed = store.summary()
    finally:
        store.close()
    width = max([len("FUNCTION")] + [len(f) for f, _, _ in rows])
    print(f"{'FUNCTION'.ljust(width)}  STATE    JOBS")
    for function, state, count in rows:
        print(f"{function.ljust(width)}  {state.ljust(7)}  {count}")
    for call, error in failed:  # which inputs failed, and how (its error on one line, cut)
        print(f"failed: {call}: {' '.join((error or '').split()):.160}")
    print(f"{sum(c for _, _, c in rows)} job(s), {size / 1e6:.2f} MB: "
          f"{os.path.abspath(args.store)}")
    return 0


def _cmd_bridge(args):
    if parse_url(args.listen)[0] != "tcp":
        raise UsageError(f"--listen {args.listen}: a bridge listens at tcp://[HOST]:PORT")
    return trio_run(BridgeServer().serve, args.listen)


def _cmd_pack(args):
    pack(args.output, args.python, args.wheels)
    return 0


_COMMANDS = {"pack": _cmd_pack, "worker": _cmd_worker, "ls": _cmd_ls, "quit": _cmd_at_head,
             "up": _cmd_up, "down": _cmd_down, "start": _cmd_start, "head": _cmd_head,
             "stop": _cmd_at_head, "scale": _cmd_at_head, "results": _cmd_results,
             "explain": _cmd_explain, "bridge": _cmd_bridge}


def main(argv=None):
    """The command line. Returns the exit code: 0 done, 1 failed, 2 bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_subproc"]:  # internal: a subprocess-pool process (not in --help)
        return _subproc_child_main(int(argv[1]))
    names = [c[0] for c in _COMMAND_LINE]
    if (word := next((a for a in argv if a[:1] != "-"), None)) not in names + [None]:
        before = argv[argv.index(word) - 1] if argv.index(word) else ""
        if before[:1] == "-" and before not in ("-v", "--verbose"):  # (`-c FILE ls`)
            command = next((a for a in argv if a in names), "COMMAND")
            print(f"grain.py: {before} {word}: a command's options come after it "
                  f"(grain.py {command} {before} {word})", file=sys.stderr)
        else:  # (the top level's options take no value)
            print(f"grain.py: unknown command {word!r}{_did_you_mean(word, names)} (commands: "
                  f"{', '.join(names)})", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command in ("up", "start"):  # `up -n 2 --qos=debug`: the rest goes to sbatch...
        args.extra = [a for a in unknown if a != "--"]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    _default_logging()
    if args.verbose:
        log.setLevel(logging.DEBUG)
    try:
        try:
            return _COMMANDS[args.command](args)
        except BaseExceptionGroup as group:  # one error out of nested nurseries: show it
            raise lone_exception(group) from None
    except (GrainError, ValueError) as e:
        print(f"grain.py {args.command}: {e}", file=sys.stderr)
        return 2 if isinstance(e, (UsageError, ValueError)) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (`ls | head`: its reader has had what it wanted)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:  # a bug or an unforeseen failure: one line, the rest with -v
        if args.verbose:
            traceback.print_exc()
        print(f"grain.py {args.command}: {type(e).__name__}: {e} (run with -v for the "
              "traceback)", file=sys.stderr)
        return 1


###############################################################################
# Submodules ##################################################################
###############################################################################
# ``from grain.delayed import delayed`` must work although grain is one file. Each
# virtual submodule forwards the names it lists to this module (one source of truth)
# and is put straight into sys.modules; see DESIGN.md section 3 for why not a finder.

# grain.local_sworker: upstream's backendless specialized worker, for trying the mode out
# (worker.specialized_type = "grain.local_sworker"): its jobs run in the mission.
LOCAL_SWORKER_CONFIG = {"BACKENDLESS": True}


@contextlib.asynccontextmanager
async def _local_sworker_run():
    yield {"name": "local"}


@contextlib.asynccontextmanager
async def _local_sworker_context():
    yield None


def _names(spaced, **renamed):
    """``{name in the submodule: name here}``."""
    return dict({n: n for n in spaced.split()}, **renamed)


_SUBMODULES = {
    "delayed": _names("delayed Delayed DelayedFn DelayedFunction delayedval each run"),
    "resource": _names("Resource ResourceSet Cores Memory Node WTime Token Capacity Gpus "
                       "ONE_INSTANCE ZERO Reject REJECT RESOURCE_TYPES TIMESTAT_NSAMPLE "
                       "register_resource"),
    "subproc": _names("subprocify subprocess_pool_scope BrokenSubprocessError SubprocessPool "
                      "run_program job_env ProgramError"),
    "combine": _names("open_waitgroup exec1 run_combine load_cache_or_exec1 WaitGroup",
                      run="run_combine"),
    "executor": _names("GrainExecutor Job"),
    "head": _names("GrainExecutor"),
    "contextvar": _names("GVAR"),
    "util": _names("QueueLimiter open_nursery_with_capacity set_numpy_oneline_repr"),
    "local_sworker": {"GRAIN_SWORKER_CONFIG": "LOCAL_SWORKER_CONFIG",
                      "grain_run_sworker": "_local_sworker_run",
                      "grain_context": "_local_sworker_context"},
}


def _register_submodules():
    me = sys.modules[__name__]
    for short, names in _SUBMODULES.items():
        full = f"{__name__}.{short}"
        mod = types.ModuleType(full, f"grain.{short}: {', '.join(names)} (forwarded from grain)")
        mod.__all__ = list(names)
        mod.__spec__ = importlib.machinery.ModuleSpec(full, None)

        def forward(name, _names=names, _full=full):
            if name in _names:
                return getattr(me, _names[name])
            raise AttributeError(f"module {_full!r} has no attribute {name!r}")

        mod.__getattr__ = forward
        sys.modules[full] = mod
        if not hasattr(me, short):  # grain.resource.Cores works; grain.delayed stays the decorator
            setattr(me, short, mod)


_register_submodules()
