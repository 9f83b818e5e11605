"""grain.py -- a resource-aware parallel scheduler for HPC clusters, in one file.

Write async Python; grain runs each job where the resources it asks for are free
(``Cores(4) & Memory(8)``, ``WTime(T="1:00:00")``, ``Token("gpu")``) and tells the job
its exact allocation through ``GVAR.res``.

    from grain.delayed import delayed, run
    from grain.resource import Cores

    @delayed
    async def square(x):
        return x * x

    async def main():
        print(await ((square @ Cores(1))(3) + (square @ Cores(1))(4)))   # 25

    run(main, local=Cores(2))

Sections, in dependency order (each uses only what is above it):

    Trampoline        ``python grain.py`` and ``import grain`` share one module
    Imports, compat   trio and dill; tomllib/exceptiongroup fallbacks below 3.11
    Constants         every tunable with its unit
    Errors            GrainError and its children
    Helpers           walltime parsing, notes on exceptions, this file's argv
    Resources         the resource algebra and the RESOURCE_TYPES registry
    Context           GVAR and the run state, in ContextVars
    Frames            the sans-I/O length-prefixed frame codec
    Subprocess pool   @subprocify and its on-demand pool of Python processes
    Workers           the worker interface and the in-process local worker
    Executor          GrainExecutor: the job queue, dispatch, retries
    Combine           open_waitgroup, exec1, run_combine
    Delayed           @delayed, Delayed placeholders, each, run
    CLI               build_parser() and main(argv); the only place that exits
    Submodules        grain.delayed, grain.resource, ... for the seeds' import lines
"""

__version__ = "0.1.0"

__all__ = [
    "GVAR", "GrainError", "BrokenSubprocessError",
    "Resource", "ResourceSet", "Cores", "Memory", "Node", "WTime", "Token", "Capacity",
    "ONE_INSTANCE", "ZERO", "RESOURCE_TYPES", "register_resource",
    "subprocify", "subprocess_pool_scope",
    "GrainExecutor", "Job",
    "open_waitgroup", "exec1", "run_combine",
    "delayed", "Delayed", "DelayedFunction", "delayedval", "each", "run",
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

import bisect
import contextlib
import contextvars
import copy
import functools
import importlib.machinery
import inspect
import itertools
import logging
import math
import operator
import os
import pickle
import re
import signal
import socket
import statistics as _statistics
import struct
import subprocess
import sys
import time
import traceback
import types
from collections import deque

try:
    import trio
    import dill
except ImportError as _e:  # pragma: no cover - depends on the machine
    raise ImportError(
        f"grain.py needs trio and dill ({_e}); install them with "
        "`python -m pip install trio dill`, or use the self-contained grain.pyz "
        "built by `python grain.py pack`"
    ) from _e

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

MAX_RETRIES = 3           # retries of a job after a temporary failure (so 4 attempts)
STUCK_WARN_S = 60.0       # seconds the head job may fit no worker before we warn
STUCK_REPEAT_S = 300.0    # seconds between repeated warnings about the same stuck queue
STUCK_CHECK_S = 5.0       # seconds between checks of the stuck queue
GROUP_MIN_RUN_S = 10.0    # runs of a WTime group at most this long teach nothing
GROUP_SAMPLES = 8         # runs of a WTime group needed before its limits are estimated
SUBPROC_IDLE_S = 60.0     # seconds an idle pool process lives before it is shut down
SUBPROC_MARGIN_S = 0.02   # seconds the child's own T alarm fires before the parent's
KILL_GRACE_S = 2.0        # seconds between SIGTERM and SIGKILL when stopping a child
MAX_FRAME = 1 << 30       # bytes; the largest frame a peer may send (1 GiB)
FRAME_HEADER = struct.Struct("!I")  # 4-byte big-endian payload length

###############################################################################
# Errors ######################################################################
###############################################################################


class GrainError(Exception):
    """Root of every error grain raises on its own account."""


class BrokenSubprocessError(GrainError):
    """A subprocess-pool process died (segfault, ``os._exit``, killed) while running a job.

    Counted as an infrastructure failure: the job is retried up to ``max_retries`` times."""


class FrameError(GrainError):
    """A peer sent a frame we cannot accept (oversized, truncated). Blames the peer."""


###############################################################################
# Helpers #####################################################################
###############################################################################

_WALLTIME_RE = re.compile(r"^(?:(\d+)-)?(\d+):([0-5]?\d):([0-5]?\d)$")


def parse_walltime(value, what="walltime"):
    """Seconds from an int/float or a ``[d-]hh:mm:ss`` string; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"malformed {what} {value!r}: expected seconds or [d-]hh:mm:ss")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ValueError(f"{what} must be a non-negative number of seconds, got {value!r}")
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.isdigit():
            return int(s)
        m = _WALLTIME_RE.match(s)
        if m:
            d, h, mi, se = m.groups()
            return int(d or 0) * 86400 + int(h) * 3600 + int(mi) * 60 + int(se)
    raise ValueError(f"malformed {what} {value!r}: expected seconds or [d-]hh:mm:ss")


def format_walltime(seconds):
    """``[d-]hh:mm:ss`` for a number of seconds (rounded down)."""
    if seconds is None or seconds == math.inf:
        return "inf"
    s = max(0, int(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:d}:{m:02d}:{s:02d}"


def add_note(exc, note):
    """``exc.add_note`` on 3.11+; the same ``__notes__`` list below (shown by exceptiongroup)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python < 3.11
        notes = getattr(exc, "__notes__", None)
        if notes is None:
            notes = []
            try:
                exc.__notes__ = notes
            except AttributeError:
                return
        notes.append(note)


def _is_async_callable(fn):
    """True for ``async def`` functions, partials of them and objects with ``async __call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn) or getattr(fn, "_grain_async", False):
        return True
    call = getattr(type(fn), "__call__", None)
    return call is not None and not isinstance(fn, type) and inspect.iscoroutinefunction(call)


def _callable_name(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def self_argv(*args):
    """The argv that re-runs this very file (or the grain.pyz holding it) with ``args``.

    Every child grain starts (pool processes, workers, job scripts) is started this way, never
    as ``-m grain``, so it runs the same code as its parent."""
    path = os.path.abspath(__file__)
    # Inside a zipapp __file__ is ".../grain.pyz/grain.py": run the archive itself.
    archive = os.path.dirname(path)
    if os.path.isfile(archive):
        path = archive
    return [sys.executable, path, *args]


@contextlib.asynccontextmanager
async def open_background_nursery():
    """A nursery for background services: cancelled when the body ends. Unlike a plain
    nursery, an exception from the body comes out as itself, not wrapped in an
    ExceptionGroup, so users see their own error."""
    manager = trio.open_nursery()
    nursery = await manager.__aenter__()
    try:
        yield nursery
    finally:
        nursery.cancel_scope.cancel()
        await manager.__aexit__(None, None, None)


def _hostname():
    return socket.gethostname().split(".")[0]


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
# (request/alloc/dealloc/stat) spread a combined resource over its parts.


class Resource:
    """Base of every resource kind. Subclass it and implement the five hooks to add a kind.

    ``kind`` names the kind (default: the class name); ``_absent_ok`` says whether a
    provider that lacks this kind altogether still accepts a request for it (True only for
    WTime: a worker with no time limit runs timed jobs)."""

    kind = None
    _absent_ok = False
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

    def _alloc_absent(self):
        """The allocation of this request on a provider that lacks the kind (``_absent_ok``)."""
        return self

    def _args(self):
        """Constructor arguments: the dict form, equality and copies use them."""
        raise NotImplementedError(f"{type(self).__name__} has no dict form")

    # -- the public API --------------------------------------------------
    def _parts(self):
        return {self.kind: self}

    def request(self, req):
        """True if this provider can allocate ``req`` right now."""
        if self.kind is not None and self.kind == req.kind:  # the hot path: one kind each
            return self._request(req)
        have = self._parts()
        for kind, want in req._parts().items():
            mine = have.get(kind)
            if mine is None:
                if want._absent_ok:
                    continue
                return False
            if not mine._request(want):
                return False
        return True

    def alloc(self, req):
        """Take ``req`` out of this provider and return the specific allocation."""
        if not self.request(req):
            raise ValueError(f"{self!r} cannot satisfy the request {req!r}")
        return self._take(req)

    def _take(self, req):
        # alloc() without the check, for the scheduler, which has just called request().
        if self.kind is not None and self.kind == req.kind:
            return self._alloc(req)
        have = self._parts()
        out = {}
        for kind, want in req._parts().items():
            mine = have.get(kind)
            out[kind] = want._alloc_absent() if mine is None else mine._alloc(want)
        return ResourceSet._of(out)

    def dealloc(self, alloc):
        """Give an allocation made by ``alloc`` back to this provider."""
        if self.kind is not None and self.kind == alloc.kind:
            self._dealloc(alloc)
            return
        have = self._parts()
        for kind, part in alloc._parts().items():
            mine = have.get(kind)
            if mine is not None:
                mine._dealloc(part)

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
            if allowed is not None:
                unknown = sorted(set(args) - set(allowed))
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
        parts = dict(self._parts())
        for kind, part in other._parts().items():
            if kind in parts:
                raise ValueError(f"cannot combine two resources of the same kind: "
                                 f"{parts[kind]!r} & {part!r}")
            parts[kind] = part
        return ResourceSet._of(parts)

    __rand__ = __and__

    def __repr__(self):
        return self._repr()

    def _key(self):
        return self._args()

    def __eq__(self, other):
        if not isinstance(other, Resource):
            return NotImplemented
        a, b = self._parts(), other._parts()
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

    def _repr(self):
        return " & ".join(p._repr() for p in self.parts.values()) if self.parts else "Ø"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        for part in object.__getattribute__(self, "parts").values():
            try:
                return getattr(part, name)
            except AttributeError:
                pass
        raise AttributeError(f"{self!r} has no attribute {name!r}")

    def __getstate__(self):
        return self.parts

    def __setstate__(self, parts):
        self.parts = parts

    def __deepcopy__(self, memo):
        return ResourceSet._of({k: copy.deepcopy(p, memo) for k, p in self.parts.items()})


def _fmt_ids(ids):
    """``[0,1,2,5]`` -> ``"0-2,5"``."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _check_count(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative whole number, got {value!r}")
    return value


def _check_amount(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{what} must be a non-negative number, got {value!r}")
    return value


class Cores(Resource):
    """CPU cores. ``Cores(3)`` requests any three; ``Cores([6, 7, 9])`` names specific ids
    (what a worker holds and what a job is given). ``.c`` is the list of ids (None for a
    count request) and ``.N`` how many."""

    kind = "Cores"
    _ARGS = ("N",)
    __slots__ = ("N", "c", "_total")

    def __init__(self, N):
        if isinstance(N, int) and not isinstance(N, bool):
            self.N = _check_count(N, "Cores(N): the core count")
            self.c = None
        elif isinstance(N, (list, tuple, set, frozenset, range)):
            ids = sorted({_check_count(i, "Cores([ids]): a core id") for i in N})
            self.c, self.N = ids, len(ids)
        else:
            raise ValueError(f"Cores(N) takes a whole number of cores or a list of core ids, "
                             f"got {N!r}")
        self._total = self.N

    @classmethod
    def _ids(cls, ids):  # fast constructor for allocations: ids already sorted and valid
        r = object.__new__(cls)
        r.c, r.N, r._total = ids, len(ids), len(ids)
        return r

    def _request(self, res):
        if res.c is None:
            return res.N <= self.N
        free = self.c
        return all(i in free for i in res.c)

    def _alloc(self, res):
        if res.c is None:
            n = res.N
            taken = self.c[:n]
            del self.c[:n]
        else:
            taken = list(res.c)
            for i in taken:
                self.c.remove(i)
        self.N = len(self.c)
        return Cores._ids(taken)

    def _dealloc(self, res):
        for i in res.c:
            bisect.insort(self.c, i)
        self.N = len(self.c)

    def _repr(self):
        return f"CPU_Cores({self.N})" if self.c is None else f"CPU_Cores([{_fmt_ids(self.c)}])"

    def _stat(self):
        return (self.N, self._total)

    def _args(self):
        return {"N": self.N if self.c is None else list(self.c)}

    def _key(self):
        return (self.N, self.c)

    def __getstate__(self):
        return (self.N, self.c, self._total)

    def __setstate__(self, st):
        self.N, self.c, self._total = st


class Memory(Resource):
    """Memory in GB: ``Memory(8)``; ``.M`` is the amount (int or float)."""

    kind = "Memory"
    _ARGS = ("M",)
    __slots__ = ("M", "_total")

    def __init__(self, M):
        self.M = self._total = _check_amount(M, "Memory(M): the amount in GB")

    def _request(self, res):
        return res.M <= self.M + 1e-9

    def _alloc(self, res):
        self.M -= res.M
        return Memory(res.M)

    def _dealloc(self, res):
        self.M = min(self._total, self.M + res.M)

    def _repr(self):
        return f"Memory({self.M:g}GB)"

    def _stat(self):
        return (self.M, self._total)

    def _args(self):
        return {"M": self.M}

    def __getstate__(self):
        return (self.M, self._total)

    def __setstate__(self, st):
        self.M, self._total = st


class Capacity(Resource):
    """A unitless amount ``V`` a worker holds and jobs use up, e.g. licence seats.
    ``ONE_INSTANCE`` (= ``Capacity(1)``) on a worker with ``Capacity(1)`` lets one job run
    there at a time."""

    kind = "Capacity"
    _ARGS = ("V",)
    __slots__ = ("V", "_total")

    def __init__(self, V):
        self.V = self._total = _check_amount(V, "Capacity(V)")

    def _request(self, res):
        return res.V <= self.V + 1e-9

    def _alloc(self, res):
        self.V -= res.V
        return Capacity(res.V)

    def _dealloc(self, res):
        self.V = min(self._total, self.V + res.V)

    def _repr(self):
        return f"Capacity({self.V:g})"

    def _stat(self):
        return (self.V, self._total)

    def _args(self):
        return {"V": self.V}

    def __getstate__(self):
        return (self.V, self._total)

    def __setstate__(self, st):
        self.V, self._total = st


class Token(Resource):
    """A tag: a job with ``Token("gpu")`` runs only on a worker holding exactly that token.
    Tokens are not used up; a worker with a token still runs jobs without one."""

    kind = "Token"
    _ARGS = ("token",)
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


def _clock():
    """trio's clock inside a run (so MockClock tests see it), the monotonic clock outside."""
    try:
        return trio.current_time()
    except RuntimeError:
        return time.monotonic()


class WTime(Resource):
    """Walltime. On a job: ``T`` is the hard limit (the job fails with ``trio.TooSlowError``
    past it), ``softT`` (default T) what a worker must still have left to take the job, and
    ``group`` lets grain estimate T and softT from the group's first runs. On a worker:
    ``WTime(T=..., countdown=True)`` is the time it has left, counting down from when it
    starts. T and softT are seconds or ``[d-]hh:mm:ss``."""

    kind = "WTime"
    _absent_ok = True
    _ARGS = ("T", "softT", "group", "countdown")
    __slots__ = ("T", "softT", "group", "countdown", "_deadline")

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
        self._deadline = None

    def _start(self, now=None):
        """Start the countdown of a provider (when its worker starts serving)."""
        if self.countdown and self._deadline is None:
            self._deadline = (_clock() if now is None else now) + self.T

    def remaining(self):
        """Seconds this provider has left (inf without a limit)."""
        if self.T is None:
            return math.inf
        if self._deadline is None:
            return self.T
        return max(0.0, self._deadline - _clock())

    def _request(self, res):
        return res.softT is None or res.softT <= self.remaining()

    def _alloc(self, res):
        return WTime(res.T, res.softT, res.group)

    def _dealloc(self, res):
        pass

    def _repr(self):
        fields = []
        if self.countdown:
            fields.append(f"left={format_walltime(self.remaining())}")
        elif self.T is not None:
            fields.append(f"T={format_walltime(self.T)}")
        if self.softT is not None and self.softT != self.T:
            fields.append(f"softT={format_walltime(self.softT)}")
        if self.group is not None:
            fields.append(f"group={self.group}")
        return f"WTime({', '.join(fields)})"

    def _stat(self):
        return (self.remaining(), self.T if self.T is not None else math.inf)

    def _args(self):
        d = {}
        if self.T is not None:
            d["T"] = format_walltime(self.remaining() if self.countdown else self.T)
        if self.softT is not None and self.softT != self.T:
            d["softT"] = format_walltime(self.softT)
        if self.group is not None:
            d["group"] = self.group
        if self.countdown:
            d["countdown"] = True
        return d

    def _key(self):
        return (self.T, self.softT, self.group, self.countdown)

    def __getstate__(self):
        # A running countdown travels as the time left, restarted by the receiver.
        T = self.remaining() if self._deadline is not None else self.T
        return (T, self.softT, self.group, self.countdown)

    def __setstate__(self, st):
        self.T, self.softT, self.group, self.countdown = st
        self._deadline = None


def Node(N, M):
    """``Cores(N) & Memory(M)``: N cores and M GB on one node."""
    return Cores(N) & Memory(M)


ZERO = ResourceSet()
ONE_INSTANCE = Capacity(1)

# The kinds the dict/TOML/JSON forms know, by name. register_resource() adds yours.
RESOURCE_TYPES = {cls.kind: cls for cls in (Cores, Memory, WTime, Token, Capacity)}


def register_resource(cls):
    """Make a custom Resource subclass known to the dict form (``--res``, config). Returns
    the class, so it works as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Resource)):
        raise TypeError(f"register_resource needs a Resource subclass, got {cls!r}")
    RESOURCE_TYPES[cls.kind] = cls
    return cls


def _part(res, kind):
    """The part of ``res`` of the given kind, or None."""
    if res.kind == kind:
        return res
    return res._parts().get(kind) if type(res) is ResourceSet else None


def _size_key(res):
    """How large a provider is, for naming "the largest worker": (cores, memory)."""
    c, m = _part(res, "Cores"), _part(res, "Memory")
    return (c._total if c else 0, m._total if m else 0)


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


class _GVar:
    """``grain.GVAR``: what the running job may know about itself.

    ``GVAR.res`` is the job's allocation (``ZERO`` outside jobs), ``GVAR.instance`` the name
    of the worker running it, ``GVAR.context`` the value the worker's context module yielded."""

    __slots__ = ()
    __module__ = "grain"

    @property
    def res(self):
        return _RES.get()

    @property
    def instance(self):
        return _INSTANCE.get()

    @property
    def context(self):
        return _CONTEXT.get()

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
# Frames ######################################################################
###############################################################################
# One frame format for every byte stream grain speaks over (pool pipes now, sockets
# later): a 4-byte big-endian length, then the payload. The decoder is sans-I/O:
# feed it bytes, take whole frames out; it never reads or writes anything itself.


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
        pos, n = 0, len(buf)
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


class FrameStream:
    """A trio byte stream spoken in frames."""

    def __init__(self, send_stream, receive_stream=None, max_frame=MAX_FRAME):
        self.send_stream = send_stream
        self.receive_stream = receive_stream if receive_stream is not None else send_stream
        self._decoder = FrameDecoder(max_frame)
        self._ready = deque()

    async def send(self, payload):
        await self.send_stream.send_all(encode_frame(payload))

    async def receive(self):
        """The next frame; ``None`` at a clean EOF; FrameError on a truncated one."""
        while not self._ready:
            data = await self.receive_stream.receive_some(1 << 16)
            if not data:
                if self._decoder.pending:
                    raise FrameError(f"stream ended inside a frame "
                                     f"({self._decoder.pending} bytes pending)")
                return None
            self._ready.extend(self._decoder.feed(data))
        return self._ready.popleft()


###############################################################################
# Subprocess pool #############################################################
###############################################################################
# @subprocify runs a sync, CPU-bound function in a separate Python process so it
# neither holds the GIL nor blocks the trio loop. Pool processes are this same file
# started as ``grain.py _subproc``; they are spawned on demand, reused, and shut
# down after SUBPROC_IDLE_S idle. Each call is pinned to the cores in GVAR.res.
#
# Pipes: the parent writes job frames to the child's stdin and reads results from a
# private pipe (fd passed to the child), so that whatever the job prints goes to
# the inherited stdout/stderr as the user expects.


def _child_die_with_parent():
    """Ask Linux to SIGKILL this process when its parent dies: no orphan ever runs on."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux; EOF on stdin still ends the child
        pass


def _subproc_child_main(result_fd):
    """Body of a pool process: read jobs from stdin, write results to ``result_fd``."""
    _child_die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us on Ctrl-C
    inp = sys.stdin.buffer
    out = os.fdopen(result_fd, "wb", buffering=0)

    def read_frame():
        head = inp.read(4)
        if len(head) < 4:
            return None
        (size,) = FRAME_HEADER.unpack(head)
        return inp.read(size)

    def on_alarm(signum, frame):
        raise trio.TooSlowError("the job ran past its walltime T")

    signal.signal(signal.SIGALRM, on_alarm)
    init = read_frame()
    if init is None:
        return 0
    sys.path[:] = pickle.loads(init)
    while True:
        frame = read_frame()
        if frame is None:
            return 0
        try:
            fn, args, kwargs, res, instance, cores, timeout = dill.loads(frame)
            _RES.set(res)
            _INSTANCE.set(instance)
            if cores:
                os.sched_setaffinity(0, cores)
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
            tb = traceback.format_exc()
            try:
                payload = dill.dumps((False, (e, tb)))
            except Exception:
                payload = dill.dumps((False, (GrainError(f"{type(e).__name__}: {e} "
                                                         "(the exception could not be pickled)"),
                                              tb)))
        out.write(encode_frame(payload))


class _PoolProcess:
    """One pool process and its two pipes."""

    def __init__(self, process, frames):
        self.process = process
        self.frames = frames
        self.idle_since = 0.0

    async def kill(self):
        await _stop_process(self.process)


async def _stop_process(process, grace=KILL_GRACE_S):
    """SIGTERM, a grace period, SIGKILL; always reaped. Shielded: runs even when cancelled."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()


def _allowed_cores():
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


class SubprocessPool:
    """Processes for @subprocify calls, at most ``limit`` at once (default: the cores this
    process may use)."""

    def __init__(self, nursery, limit=None, idle_s=SUBPROC_IDLE_S):
        self.limit = limit or len(_allowed_cores())
        self._nursery = nursery
        self._idle = []  # _PoolProcess, most recently used last
        self._all = set()
        self._slots = trio.Semaphore(self.limit)
        self.idle_s = idle_s

    async def _spawn(self):
        r, w = os.pipe()
        try:
            process = await trio.lowlevel.open_process(
                self_argv("_subproc", str(w)), stdin=subprocess.PIPE, pass_fds=(w,))
        finally:
            os.close(w)
        frames = FrameStream(process.stdin, trio.lowlevel.FdStream(r))
        child = _PoolProcess(process, frames)
        self._all.add(child)
        await frames.send(pickle.dumps(sys.path))
        return child

    async def call(self, fn, args, kwargs, res, instance, cores, timeout):
        # recurse=True: a function from __main__ carries the globals it uses, not a
        # reference to a __main__ the child does not have.
        payload = dill.dumps((fn, args, kwargs, res, instance, cores, timeout), recurse=True)
        async with self._slots:
            child = self._idle.pop() if self._idle else await self._spawn()
            ok = False
            try:
                await child.frames.send(payload)
                frame = await child.frames.receive()
                ok = frame is not None
            except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
                frame = None
            finally:
                if not ok:  # died, or we were cancelled mid-call: this process is spent
                    self._all.discard(child)
                    await child.kill()
            if frame is None:
                code = child.process.returncode
                how = (f"killed by signal {-code}" if code is not None and code < 0
                       else f"exited with code {code}")
                raise BrokenSubprocessError(
                    f"pool process {child.process.pid} running {_callable_name(fn)} {how}")
            child.idle_since = trio.current_time()
            self._idle.append(child)
        success, value = dill.loads(frame)
        if success:
            return value
        exc, tb = value
        add_note(exc, f"Traceback in pool process {child.process.pid}:\n{tb.rstrip()}")
        raise exc

    async def _reap_idle(self):
        while True:
            await trio.sleep(min(self.idle_s, 5.0))
            cutoff = trio.current_time() - self.idle_s
            keep = [c for c in self._idle if c.idle_since > cutoff]
            old = [c for c in self._idle if c.idle_since <= cutoff]
            self._idle[:] = keep
            for child in old:
                self._all.discard(child)
                await child.kill()

    async def aclose(self):
        children, self._all, self._idle = list(self._all), set(), []
        with trio.CancelScope(shield=True):
            for child in children:
                # Closing stdin ends an idle child at once; a busy one gets SIGTERM.
                with contextlib.suppress(Exception):
                    await child.process.stdin.aclose()
            for child in children:
                await child.kill()


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
            finally:
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
        allowed = set(_allowed_cores())
        pin = [i for i in cores.c if i in allowed]  # virtual (oversubscribed) ids pin nothing
        deadline = trio.current_effective_deadline()
        timeout = None if deadline == math.inf else deadline - trio.current_time() - SUBPROC_MARGIN_S
        return await rt.pool.call(self.fn, args, kwargs, res, _INSTANCE.get(), pin, timeout)

    def __repr__(self):
        return f"<subprocified {_callable_name(self.fn)}>"


def subprocify(fn):
    """Decorator: run this sync (CPU-bound) function in a pool process, as an async job."""
    return Subprocified(fn)


###############################################################################
# Workers #####################################################################
###############################################################################
# A worker, as the executor sees it: a name, the resources it has free (``res``,
# a provider the executor allocates from), a total for display, and ``start(job)``,
# which must launch the job without blocking and later report exactly once through
# ``executor._job_ended``. The local worker runs jobs as tasks in the mission's own
# process; remote workers (next section to come) implement the same surface.


class Worker:
    """The executor's view of a worker."""

    def __init__(self, executor, res, name):
        self.executor = executor
        self.name = name
        self.res = res.copy()          # free resources; allocation mutates this copy
        for part in self.res._parts().values():
            if isinstance(part, WTime):
                part._start()
        self.total = res.copy()        # for display
        self.running = 0
        self.accepting = True          # False once told to drain (quit) or retiring

    def fits(self, req):
        return self.accepting and self.res.request(req)

    def start(self, job):
        raise NotImplementedError

    def statistics(self):
        return WorkerStatistics(self.name, self.res.stat(), self.total.stat(), self.running,
                                "up" if self.accepting else "draining")


class WorkerStatistics(tuple):
    """(name, free, total, running, status); free/total are ``Resource.stat()`` dicts."""

    __slots__ = ()
    _fields = ("name", "free", "total", "running", "status")

    def __new__(cls, *values):
        return tuple.__new__(cls, values)

    name = property(operator.itemgetter(0))
    free = property(operator.itemgetter(1))
    total = property(operator.itemgetter(2))
    running = property(operator.itemgetter(3))
    status = property(operator.itemgetter(4))


def _local_provider(rpw):
    """The provider of the in-process worker. ``Cores(N)`` becomes N real core ids from this
    process's affinity set; asking for more than it has gives virtual ids (oversubscription,
    useful for testing), with a note in the log."""
    cores = _part(rpw, "Cores")
    if cores is None or cores.c is not None:
        return rpw
    allowed = _allowed_cores()
    if cores.N <= len(allowed):
        ids = allowed[:cores.N]
    else:
        ids = list(range(cores.N))
        log.info("local worker: %d cores requested but this process may use %d; core ids "
                 "%s are virtual", cores.N, len(allowed), _fmt_ids(ids))
    parts = dict(rpw._parts())
    parts["Cores"] = Cores._ids(ids)
    return ResourceSet._of(parts)


class LocalWorker(Worker):
    """Runs jobs as trio tasks in this process, with GVAR set for each."""

    def __init__(self, executor, res, name, nursery):
        super().__init__(executor, _local_provider(res), name)
        self._nursery = nursery

    def start(self, job):
        self._nursery.start_soon(self._run, job)

    async def _run(self, job):
        _RES.set(job.alloc)
        _INSTANCE.set(self.name)
        started = trio.current_time()
        try:
            if job.T is None:
                value = await job.fn(*job.args, **job.kwargs)
            else:
                with trio.fail_after(job.T):
                    value = await job.fn(*job.args, **job.kwargs)
        except Exception as e:
            self.executor._job_ended(job, None, e, trio.current_time() - started)
        else:
            self.executor._job_ended(job, value, None, trio.current_time() - started)


###############################################################################
# Executor ####################################################################
###############################################################################


class Job:
    """One submitted job: a resource request, an async function and its arguments.

    Awaiting a Job gives the function's return value or raises its exception (with the
    original type). ``attempts`` counts runs started; ``failures`` counts each failure class
    that was retried."""

    __slots__ = ("id", "req", "fn", "args", "kwargs", "T", "group", "attempts", "failures",
                 "alloc", "worker", "value", "error", "state", "observed", "_event",
                 "_executor", "duration")

    def __init__(self, executor, jid, req, fn, args, kwargs):
        self._executor = executor
        self.id = jid
        self.req = req
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        wt = _part(req, "WTime") if req.kind != "Cores" else None
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

    @property
    def name(self):
        return f"#{self.id} {_callable_name(self.fn)}"

    def done(self):
        return self.state == "done" or self.state == "failed"

    async def wait_done(self):
        """Wait until the job has ended, without raising its error."""
        if self.state != "done" and self.state != "failed":
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()

    async def wait(self):
        """The job's result; raises its exception if it failed."""
        if self.state != "done" and self.state != "failed":
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        self.observed = True
        if self.error is not None:
            raise self.error
        return self.value

    def __await__(self):
        return self.wait().__await__()

    def __repr__(self):
        return f"<Job {self.name} {self.req!r} {self.state}>"


class ExecutorStatistics(tuple):
    """Counters of an executor at one moment, for ``ls``."""

    __slots__ = ()
    _fields = ("queued", "running", "done", "failed", "retried", "workers", "next_request")

    def __new__(cls, *values):
        return tuple.__new__(cls, values)

    queued = property(operator.itemgetter(0))
    running = property(operator.itemgetter(1))
    done = property(operator.itemgetter(2))
    failed = property(operator.itemgetter(3))
    retried = property(operator.itemgetter(4))
    workers = property(operator.itemgetter(5))
    next_request = property(operator.itemgetter(6))


class _GroupTimes:
    """Walltime estimates per WTime group, shared across all workers of an executor: from the
    first GROUP_SAMPLES runs longer than GROUP_MIN_RUN_S, T = mean + 5 sd and
    softT = mean + 2 sd (sample standard deviation)."""

    def __init__(self):
        self.samples = {}
        self.limits = {}

    def record(self, group, seconds):
        if seconds <= GROUP_MIN_RUN_S or group in self.limits:
            return
        runs = self.samples.setdefault(group, [])
        runs.append(seconds)
        if len(runs) >= GROUP_SAMPLES:
            mean, sd = _statistics.mean(runs), _statistics.stdev(runs)
            self.limits[group] = (mean + 5 * sd, mean + 2 * sd)
            log.info("WTime group %r: estimated T=%.1fs softT=%.1fs from %d runs",
                     group, mean + 5 * sd, mean + 2 * sd, len(runs))

    def resolve(self, job):
        """Give a grouped job its group's limits once they are known."""
        lim = self.limits.get(job.group)
        if lim is None:
            return
        T, softT = lim
        parts = dict(job.req._parts())
        parts["WTime"] = WTime(T, softT, job.group)
        job.req = ResourceSet._of(parts)
        job.T = T


# Failure classes a job can be retried for, kept apart in counters and messages.
RETRY_TEMPORARY = "temporary error"      # an exception type listed in temporary_err
RETRY_INFRA = "infrastructure failure"   # e.g. BrokenSubprocessError


class GrainExecutor:
    """Schedules jobs onto workers by resource and collects their results.

    Queue policy (all of it lives in ``_pump``): strict FIFO. The job at the head of the
    queue goes to the first worker that can allocate its request; when none can, the whole
    queue waits until a job ends and gives resources back (or a worker joins). Jobs that
    request nothing (``ZERO``) skip the queue and run at once in this process.

    Failures: a job's exception goes to whoever awaits the job, with its original type; the
    worker keeps serving. Exceptions whose type is in ``temporary_err`` and infrastructure
    failures (``BrokenSubprocessError``) are retried, each class up to ``max_retries`` times,
    then raised with a note saying how many attempts were made. A failure nobody awaited is
    raised when the executor closes (in an ExceptionGroup): nothing is dropped silently.

    Use it asynchronously::

        async with GrainExecutor(rpw=Cores(4)) as exer:
            job = exer.submit(Cores(1), fn, x)
            print(await job)

    or synchronously (the jobs run when the ``with`` block ends)::

        with GrainExecutor(rpw=Cores(4)) as exer:
            for x in xs:
                exer.submit(Cores(1), fn, x)
        print(exer.results)            # in submission order
    """

    def __init__(self, rpw=None, *, temporary_err=(), max_retries=MAX_RETRIES, name="local"):
        if rpw is not None and not isinstance(rpw, Resource):
            raise TypeError(f"rpw must be a Resource such as Cores(4), got {rpw!r}")
        if isinstance(temporary_err, type):
            temporary_err = (temporary_err,)
        self.rpw = rpw
        self.temporary_err = tuple(temporary_err)
        self.max_retries = _check_count(max_retries, "max_retries")
        self.local_name = name
        self.workers = []
        self._queue = deque()
        self._jobs = []  # every job, in submission order
        self._ids = itertools.count(1)
        self._outstanding = 0
        self._all_done = None
        self._group_times = _GroupTimes()
        self._blocked_job = None
        self._blocked_since = 0.0
        self._warned_at = -math.inf
        self._nursery = None
        self._zero_worker = None
        self._sync_jobs = None
        self.counts = {"done": 0, "failed": 0, "retried": 0}
        self.elapsed = None

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
        job = Job(self, next(self._ids), res, fn, args, kwargs)
        self._jobs.append(job)
        self._outstanding += 1
        self._enqueue(job)
        return job

    def _submit_after(self, res, fn, args, kwargs, resolve):
        """Submit once ``resolve(args, kwargs)`` (an async function) gives the real arguments
        (delayed calls whose arguments are still pending). A failure to resolve fails the job."""
        job = Job(self, next(self._ids), res, fn, None, None)
        self._jobs.append(job)
        self._outstanding += 1

        async def resolve_then_enqueue():
            try:
                job.args, job.kwargs = await resolve(args, kwargs)
            except Exception as e:
                job.attempts = 0
                self._complete(job, None, e)
                return
            self._enqueue(job)

        self._nursery.start_soon(resolve_then_enqueue)
        return job

    def _enqueue(self, job):
        if job.req is ZERO or not job.req._parts():
            job.state = "running"
            job.attempts += 1
            job.alloc = ZERO
            job.worker = self._zero_worker
            self._zero_worker.running += 1
            self._zero_worker.start(job)
            return
        self._queue.append(job)
        if len(self._queue) == 1:
            self._pump()

    # -- dispatch: the queue policy ---------------------------------------
    def _pump(self):
        """Start queued jobs while the head of the queue fits a worker (strict FIFO)."""
        queue, workers = self._queue, self.workers
        while queue:
            job = queue[0]
            if job.group is not None and job.T is None:
                self._group_times.resolve(job)
            req = job.req
            for w in workers:
                if w.accepting and w.res.request(req):
                    break
            else:
                if self._blocked_job is not job:
                    self._blocked_job = job
                    self._blocked_since = trio.current_time()
                return
            queue.popleft()
            job.state = "running"
            job.attempts += 1
            job.alloc = w.res._take(req)
            job.worker = w
            w.running += 1
            w.start(job)

    def add_worker(self, worker):
        self.workers.append(worker)
        self._pump()

    def remove_worker(self, worker):
        if worker in self.workers:
            self.workers.remove(worker)

    # -- completion ---------------------------------------------------------
    def _job_ended(self, job, value, error, duration):
        """Called by a worker exactly once per attempt it started."""
        w = job.worker
        w.running -= 1
        if job.alloc is not ZERO:
            w.res.dealloc(job.alloc)
        job.alloc = None
        job.duration = duration
        if error is None:
            if job.group is not None:
                self._group_times.record(job.group, duration)
            self._complete(job, value, None)
        else:
            kind = self._retry_class(error)
            if kind is not None and self._retry(job, kind, error):
                pass
            else:
                self._complete(job, None, error, kind)
        if self._queue:
            self._pump()

    def _retry_class(self, error):
        if isinstance(error, BrokenSubprocessError):
            return RETRY_INFRA
        if self.temporary_err and isinstance(error, self.temporary_err):
            return RETRY_TEMPORARY
        return None

    def _retry(self, job, kind, error):
        failures = job.failures
        if failures is None:
            failures = job.failures = {}
        n = failures.get(kind, 0)
        if n >= self.max_retries:
            return False
        failures[kind] = n + 1
        self.counts["retried"] += 1
        log.warning("job %s failed with %s (%s, attempt %d); retrying",
                    job.name, f"{type(error).__name__}: {error}", kind, job.attempts)
        job.state = "queued"
        self._queue.appendleft(job)  # it was submitted before everything behind it
        return True

    def _complete(self, job, value, error, kind=None):
        if error is None:
            job.value = value
            job.state = "done"
            self.counts["done"] += 1
        else:
            if kind is not None and job.attempts > 1:
                add_note(error, f"grain: job {job.name} failed after {job.attempts} attempts "
                                f"({kind}, {self.max_retries} retries allowed)")
            job.error = error
            job.state = "failed"
            self.counts["failed"] += 1
        if job._event is not None:
            job._event.set()
        self._outstanding -= 1
        if self._outstanding == 0 and self._all_done is not None:
            self._all_done.set()

    async def wait_all(self):
        """Wait until every job submitted so far has ended."""
        while self._outstanding:
            self._all_done = trio.Event()
            await self._all_done.wait()

    # -- the stuck-queue warning --------------------------------------------
    async def _watch_stuck(self):
        while True:
            await trio.sleep(STUCK_CHECK_S)
            if not self._queue or self._queue[0] is not self._blocked_job:
                continue
            now = trio.current_time()
            waited = now - self._blocked_since
            if waited < STUCK_WARN_S or now - self._warned_at < STUCK_REPEAT_S:
                continue
            self._warned_at = now
            job = self._blocked_job
            if self.workers:
                big = max(self.workers, key=lambda w: _size_key(w.total))
                where = f"the largest worker is {big.name} with {big.total!r}"
            else:
                where = ("no worker has joined yet (give run() local=..., or start workers "
                         "with `python grain.py up`)")
            log.warning("job %s requesting %r has fitted no worker for %.0f s; %s; "
                        "%d job(s) queued", job.name, job.req, waited, where, len(self._queue))

    # -- statistics -----------------------------------------------------------
    def statistics(self):
        running = sum(w.running for w in self.workers)
        if self._zero_worker is not None:
            running += self._zero_worker.running
        nxt = self._queue[0].req if self._queue else None
        return ExecutorStatistics(len(self._queue), running, self.counts["done"],
                                  self.counts["failed"], self.counts["retried"],
                                  [w.statistics() for w in self.workers], nxt)

    @property
    def results(self):
        """Results in submission order; a failed job's entry is its exception."""
        return [j.value if j.error is None else j.error for j in self._jobs]

    # -- lifetime -----------------------------------------------------------
    async def __aenter__(self):
        self._stack = contextlib.AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(open_background_nursery())
        rt = _RUNTIME.get()
        self._runtime = _Runtime(self)
        if rt is not None:
            self._runtime.pool = rt.pool  # a pool opened around us stays usable
        self._rt_token = _RUNTIME.set(self._runtime)
        self._t0 = time.perf_counter()
        self._zero_worker = LocalWorker(self, ZERO, self.local_name, self._nursery)
        if self.rpw is not None and self.rpw._parts():
            self.add_worker(LocalWorker(self, self.rpw, self.local_name, self._nursery))
        self._nursery.start_soon(self._watch_stuck)
        return self

    async def __aexit__(self, etype, exc, tb):
        try:
            if etype is None:
                await self.wait_all()
        finally:
            await self._stack.__aexit__(None, None, None)
            _RUNTIME.reset(self._rt_token)
            self._nursery = None
            self.elapsed = time.perf_counter() - self._t0
            log.info("Time elapsed for all jobs: %.3fs", self.elapsed)
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
        todo, self._sync_jobs = self._sync_jobs, None
        if etype is not None:
            return False

        async def run_all():
            async with self:
                for res, fn, args, kwargs in todo:
                    self._submit(res, fn, args, kwargs)

        _default_logging()
        trio.run(run_all)
        return False


class _GrainFormatter(logging.Formatter):
    def format(self, record):
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"grain {record.levelname}: {msg}"
        return msg


def _default_logging():
    """Give grain's logger a readable handler, unless the application configured logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_GrainFormatter())
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


###############################################################################
# Combine #####################################################################
###############################################################################
# The "combine" front end (seed 000): waitgroups of jobs and subtasks, exec1 for one
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

    def start_subtask(self, afn, *args, **kwargs):
        """Run ``afn(*args, **kwargs)`` locally, in parallel; it may submit jobs itself."""
        sub = _Subtask()
        self._items.append(sub)
        self._nursery.start_soon(sub.run, afn, args, kwargs)
        return sub

    @property
    def results(self):
        """Return values in submission order (a failed job's entry is its exception)."""
        return [item.error if item.error is not None else item.value for item in self._items]


class _Subtask:
    __slots__ = ("value", "error")

    def __init__(self):
        self.value = self.error = None

    async def run(self, afn, args, kwargs):
        self.value = await afn(*args, **kwargs)


@contextlib.asynccontextmanager
async def open_waitgroup():
    """``async with grain.open_waitgroup() as wg:`` -- see WaitGroup. Leaving the block waits
    for every job; if some failed, raises an ExceptionGroup of their errors (the results of
    the others stay in ``wg.results``)."""
    exer = _current_executor("grain.open_waitgroup()")
    async with trio.open_nursery() as nursery:
        wg = WaitGroup(exer, nursery)
        yield wg
    errors = []
    jobs = [item for item in wg._items if isinstance(item, Job)]
    for job in jobs:
        await job.wait_done()
        job.observed = True
        if job.error is not None:
            errors.append(job.error)
    if errors:
        raise ExceptionGroup(f"{len(errors)} of {len(jobs)} job(s) in the waitgroup failed",
                             errors)


async def exec1(res, fn, *args, **kwargs):
    """Run one job and return its result: ``await grain.exec1(Cores(2), fn, x)``."""
    return await _current_executor("grain.exec1()").submit(res, fn, *args, **kwargs)


def _as_mains(main):
    if isinstance(main, (list, tuple)):
        mains = list(main)
    else:
        mains = [main]
    for m in mains:
        if not _is_async_callable(m):
            raise TypeError(f"the main function must be async (or a partial of one), "
                            f"got {_callable_name(m)}")
    return mains


async def _run_mission(mains, local, single, executor_kw):
    async with GrainExecutor(rpw=local, **executor_kw) as exer:
        if single:
            return await mains[0]()
        results = [None] * len(mains)

        async def one(i, m):
            results[i] = await m()

        async with trio.open_nursery() as nursery:
            for i, m in enumerate(mains):
                nursery.start_soon(one, i, m)
        return results


def run_combine(main, waddrs=(), rpw=ZERO, *, temporary_err=(), max_retries=MAX_RETRIES):
    """Run a mission: ``main`` (or a list of mains, run in parallel) with a local worker
    holding ``rpw``. Returns main's return value (a list for a list of mains)."""
    mains = _as_mains(main)
    if waddrs:
        raise GrainError("run_combine(waddrs=...): passive remote workers are not supported "
                         "by this version yet")
    _default_logging()
    return trio.run(_run_mission, mains, rpw, not isinstance(main, (list, tuple)),
                    {"temporary_err": temporary_err, "max_retries": max_retries})


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


def _gather(*values):
    return list(values)


def _delayeds_in(obj, out):
    """Append every Delayed found in ``obj`` (looking into lists, tuples, sets, dicts)."""
    if isinstance(obj, Delayed):
        out.append(obj)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            _delayeds_in(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _delayeds_in(x, out)
    return out


def _capture(obj):
    """``obj`` with every Delayed in it replaced by a snapshot, so that a later
    ``d[k] = v`` (which turns ``d`` into a new value) does not change what was built from
    ``d`` before: copy-on-setitem."""
    if isinstance(obj, Delayed):
        return obj._snapshot()
    t = type(obj)
    if t is tuple or t is list:
        return t([_capture(x) for x in obj]) if any(
            isinstance(x, (Delayed, list, tuple, dict)) for x in obj) else obj
    if t is dict:
        return {k: _capture(v) for k, v in obj.items()}
    return obj


def _substitute(obj):
    """``obj`` with every (already evaluated) Delayed replaced by its value."""
    if isinstance(obj, Delayed):
        return obj._value
    if isinstance(obj, (list, tuple, set, frozenset)):
        return type(obj)(_substitute(x) for x in obj) if type(obj) in (
            list, tuple, set, frozenset) else obj
    if isinstance(obj, dict):
        return {k: _substitute(v) for k, v in obj.items()}
    return obj


class Delayed:
    """A placeholder for a value that jobs are computing. ``await`` it for the value."""

    __slots__ = ("_job", "_op", "_args", "_kwargs", "_nout", "_value")
    __array_priority__ = 1000  # NumPy: let our reflected operators win

    def __init__(self, value=_NO_VALUE):
        object.__setattr__(self, "_job", None)
        object.__setattr__(self, "_op", None)
        object.__setattr__(self, "_args", ())
        object.__setattr__(self, "_kwargs", None)
        object.__setattr__(self, "_nout", None)
        object.__setattr__(self, "_value", value)

    @classmethod
    def _of_job(cls, job, nout=None):
        d = object.__new__(cls)
        object.__setattr__(d, "_job", job)
        object.__setattr__(d, "_op", None)
        object.__setattr__(d, "_args", ())
        object.__setattr__(d, "_kwargs", None)
        object.__setattr__(d, "_nout", nout)
        object.__setattr__(d, "_value", _NO_VALUE)
        return d

    @classmethod
    def _apply(cls, op, args, kwargs=None, nout=None):
        d = object.__new__(cls)
        object.__setattr__(d, "_job", None)
        object.__setattr__(d, "_op", op)
        object.__setattr__(d, "_args", _capture(args))
        object.__setattr__(d, "_kwargs", _capture(kwargs) if kwargs else None)
        object.__setattr__(d, "_nout", nout)
        object.__setattr__(d, "_value", _NO_VALUE)
        return d

    def _snapshot(self):
        """A new placeholder for this one's current value (shares its job and cache)."""
        if self._value is not _NO_VALUE and self._job is None and self._op is None:
            return self  # a plain value cannot be changed by setitem: no need to copy
        d = object.__new__(Delayed)
        for name in Delayed.__slots__:
            object.__setattr__(d, name, getattr(self, name))
        return d

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
        if name.startswith("__") or name in Delayed.__slots__:
            raise AttributeError(name)
        return Delayed._apply(getattr, (self, name))

    def __getitem__(self, key):
        return Delayed._apply(operator.getitem, (self, key))

    def __setitem__(self, key, value):
        # Copy-on-setitem: this placeholder now stands for a copy of the old value with the
        # item set; whoever holds the old value (e.g. another delayed) is not affected.
        old = self._snapshot()
        object.__setattr__(self, "_job", None)
        object.__setattr__(self, "_op", _copy_setitem)
        object.__setattr__(self, "_args", (old, _capture(key), _capture(value)))
        object.__setattr__(self, "_kwargs", None)
        object.__setattr__(self, "_value", _NO_VALUE)

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
    binary = ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift",
              "and", "or", "xor", "matmul"]
    for name in binary:
        op = getattr(operator, name + "_" if name in ("and", "or") else name)

        def forward(self, other, op=op):
            return Delayed._apply(op, (self, other))

        def reflected(self, other, op=op):
            return Delayed._apply(op, (other, self))

        setattr(Delayed, f"__{name}__", forward)
        setattr(Delayed, f"__r{name}__", reflected)
    for name in ["lt", "le", "gt", "ge", "eq", "ne"]:
        op = getattr(operator, name)
        setattr(Delayed, f"__{name}__", lambda self, other, op=op: Delayed._apply(op, (self, other)))
    for name in ["neg", "pos", "abs", "invert"]:
        op = getattr(operator, name)
        setattr(Delayed, f"__{name}__", lambda self, op=op: Delayed._apply(op, (self,)))
    Delayed.__divmod__ = lambda self, other: Delayed._apply(divmod, (self, other))
    Delayed.__rdivmod__ = lambda self, other: Delayed._apply(divmod, (other, self))


_make_operators()


async def _evaluate(root):
    """The value of a Delayed: await its jobs, then apply its operations bottom-up."""
    if root._value is not _NO_VALUE:
        return root._value
    if _RUNTIME.get() is None:
        raise RuntimeError("a Delayed can only be awaited inside a grain mission, i.e. in "
                           "code run by grain.delayed.run(main, ...)")
    stack = [root]
    while stack:
        node = stack[-1]
        if node._value is not _NO_VALUE:
            stack.pop()
            continue
        if node._job is not None:
            object.__setattr__(node, "_value", await node._job.wait())
            stack.pop()
            continue
        deps = _delayeds_in(node._args, [])
        if node._kwargs:
            _delayeds_in(node._kwargs, deps)
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


class DelayedFunction:
    """An async function that submits a job each time it is called. ``fn @ res`` binds the
    resource request; without one the job runs locally (in this process) at once."""

    __slots__ = ("fn", "res", "nout")

    def __init__(self, fn, res=ZERO, nout=None):
        self.fn = fn
        self.res = res
        self.nout = nout

    def __matmul__(self, res):
        if not isinstance(res, Resource):
            return NotImplemented
        bound = object.__new__(DelayedFunction)
        bound.fn, bound.res, bound.nout = self.fn, res, self.nout
        return bound

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
        return Delayed._of_job(job, self.nout)

    @property
    def __wrapped__(self):
        return self.fn

    @property
    def __name__(self):
        return _callable_name(self.fn)

    def __repr__(self):
        res = "" if self.res is ZERO else f" @ {self.res!r}"
        return f"<delayed {_callable_name(self.fn)}{res}>"


def delayed(fn=None, *, nout=None):
    """Decorator: make an async function delayed. ``@delayed`` or ``@delayed(nout=2)`` (the
    function returns 2 values, so the call can be unpacked)."""
    if fn is None:
        return functools.partial(delayed, nout=nout)
    if nout is not None:
        _check_count(nout, "delayed(nout=...)")
    if isinstance(fn, DelayedFunction):
        return DelayedFunction(fn.fn, fn.res, nout if nout is not None else fn.nout)
    if not callable(fn) or not _is_async_callable(fn):
        raise TypeError(f"@delayed needs an async function, but {_callable_name(fn)} is "
                        "sync. For CPU-bound Python code use @subprocify under it:\n"
                        "    @delayed\n    @subprocify\n    def f(...): ...")
    return DelayedFunction(fn, ZERO, nout)


def delayedval(value):
    """Wrap a plain value as an (already resolved) Delayed."""
    return Delayed(value)


def each(*items):
    """A Delayed of the list of values of ``items`` (Delayeds or plain values):
    ``await each(f(x) for x in xs)`` or ``await each(a, b)``."""
    if len(items) == 1 and not isinstance(items[0], Delayed):
        try:
            items = tuple(items[0])
        except TypeError:
            pass
    return Delayed._apply(_gather, tuple(items))


def run(main, local=None, config_file=None, *, rpw=None, temporary_err=(),
        max_retries=MAX_RETRIES):
    """Run a delayed mission: ``main`` (an async function, or a list run in parallel).

    ``local`` (alias ``rpw``) is the resource of the in-process worker, e.g.
    ``Cores([0, 1])``; without it, jobs with resources wait for workers to join.
    ``config_file``: a path, None (look for one) or False (defaults only)."""
    if rpw is not None:
        if local is not None:
            raise TypeError("run(): give local= or its alias rpw=, not both")
        local = rpw
    mains = _as_mains(main)
    _default_logging()
    if config_file is False:
        log.info("Config file is disabled, using default settings.")
    return trio.run(_run_mission, mains, local, not isinstance(main, (list, tuple)),
                    {"temporary_err": temporary_err, "max_retries": max_retries})


###############################################################################
# CLI #########################################################################
###############################################################################
# ``python grain.py COMMAND``. build_parser() describes the commands; main(argv) runs
# one and returns the exit code. Only main configures logging or decides to exit.


def _versions():
    return (f"grain.py {__version__} (trio {trio.__version__}, dill {dill.__version__}, "
            f"Python {sys.version.split()[0]})")


def build_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="grain.py",
        description="A resource-aware parallel scheduler for HPC clusters, in one file.")
    parser.add_argument("--version", action="version", version=_versions())
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv=None):
    """The command line. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_subproc"]:  # internal: a subprocess-pool process (not in --help)
        return _subproc_child_main(int(argv[1]))
    parser = build_parser()
    args = parser.parse_args(argv)
    parser.print_help()
    return 0 if args.command is None else 2


###############################################################################
# Submodules ##################################################################
###############################################################################
# ``from grain.delayed import delayed`` must work although grain is one file. Each
# virtual submodule forwards the names it lists to this module (one source of truth)
# and is put straight into sys.modules; see DESIGN.md section 3 for why not a finder.

_SUBMODULES = {
    "delayed": ["delayed", "Delayed", "DelayedFunction", "delayedval", "each", "run"],
    "resource": ["Resource", "ResourceSet", "Cores", "Memory", "Node", "WTime", "Token",
                 "Capacity", "ONE_INSTANCE", "ZERO", "RESOURCE_TYPES", "register_resource"],
    "subproc": ["subprocify", "subprocess_pool_scope", "BrokenSubprocessError",
                "SubprocessPool"],
    "combine": ["open_waitgroup", "exec1", "run_combine", "WaitGroup"],
    "executor": ["GrainExecutor", "Job"],
}


def _register_submodules():
    me = sys.modules[__name__]
    for short, names in _SUBMODULES.items():
        full = f"{__name__}.{short}"
        mod = types.ModuleType(full, f"grain.{short}: {', '.join(names)} (forwarded from grain)")
        mod.__all__ = list(names)
        mod.__spec__ = importlib.machinery.ModuleSpec(full, None)

        def forward(name, _names=frozenset(names), _full=full):
            if name in _names:
                return getattr(me, name)
            raise AttributeError(f"module {_full!r} has no attribute {name!r}")

        mod.__getattr__ = forward
        sys.modules[full] = mod
        if not hasattr(me, short):  # grain.resource.Cores works; grain.delayed stays the decorator
            setattr(me, short, mod)


_register_submodules()
