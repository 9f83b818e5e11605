"""What the side-by-side benchmarks share: which implementation to run, and how each of them
starts a head and its workers. Not part of grain.py.

Every benchmark takes ``--impl grainpy|upstream|dask`` (default grainpy) and must run under
that implementation's Python (``bench/.venvs/<impl>/bin/python``, made by bench/setup.sh;
bench/compare.py does this). ``grainpy`` is this repository's grain.py; ``upstream`` is
grain-scheduler 0.17.1, whose package is also called ``grain``, hence one venv each."""
import logging
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GRAIN_PY = os.path.join(ROOT, "grain.py")
IMPLS = ("grainpy", "upstream", "dask")


def parse_impl(argv=None):
    """``(impl, rest)``: the ``--impl`` value and the other arguments. For grainpy, makes
    this repository's grain.py importable as ``grain``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    impl = "grainpy"
    if "--impl" in argv:
        i = argv.index("--impl")
        impl = argv[i + 1]
        del argv[i:i + 2]
    if impl not in IMPLS:
        sys.exit(f"--impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "grainpy":
        sys.path.insert(0, ROOT)
    logging.getLogger("grain").setLevel(logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    return impl, argv


def rss_bytes(pid="self"):
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grainpy_worker(edge, cores, name, *flags):
    """A grain.py worker process, started as the job scripts of `grain.py up` start one
    (``edge``: the Edge file's path, or any URL; ``flags``: more of its options)."""
    import grain
    return subprocess.Popen(
        grain.boot_argv(sys.executable, GRAIN_PY, "worker", "--url",
                        edge if "://" in edge else f"edge://{edge}",
                        "--name", name, "--res", '{"Cores": {"N": %d}}' % cores,
                        "--oversubscribe", *flags),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def upstream_config(port):
    """Upstream's head config: its pure-Python head listening on loopback (``[head.gnaw]
    enabled = false`` is what its loose defaults give a config read from a StringIO)."""
    from io import StringIO
    return StringIO(f'head.listen = "tcp://127.0.0.1:{port}"\nhead.log_file = "/dev/null"\n'
                    '[head.gnaw]\nenabled = false\n')


def upstream_worker(port, cores):
    return subprocess.Popen(
        [sys.executable, "-m", "grain.worker", "--url", f"tcp://127.0.0.1:{port}",
         "--res", '{"Cores": {"N": %d}}' % cores],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def upstream_wait_for_workers(n, timeout=120):
    """Wait until upstream's head (the delayed API's executor) has ``n`` remote workers."""
    import trio
    import grain.delayed as gd
    with trio.fail_after(timeout):
        while len([w for w in gd.exer.mgr.pool if not w.name.endswith("(local)")]) < n:
            await trio.sleep(0.01)


def dask_cluster(workers, cores, processes=True):
    """A Dask LocalCluster whose workers each offer ``cores`` of a "cores" resource."""
    from dask.distributed import Client, LocalCluster
    cluster = LocalCluster(n_workers=workers, threads_per_worker=cores, processes=processes,
                           resources={"cores": cores}, dashboard_address=None,
                           silence_logs=logging.ERROR)
    return cluster, Client(cluster)


def stop(procs, timeout=10):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def noop_sync(*_):
    return None
