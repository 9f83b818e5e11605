"""Start-up: the median of 10 runs of the version command and of importing the API.

    python bench/bench_startup.py [--impl grainpy|upstream|dask] [ROUNDS]

grainpy: `python grain.py --version` and `python -c "import grain"`. upstream: its `grain
--version` and `python -c "import grain.delayed, grain.resource"`. Dask: `python -c "import
dask.distributed"` (no version command). Each command runs once first, untimed, with
PYTHONDONTWRITEBYTECODE unset, so that bytecode caches exist as they do for a user. The last
line is "version X ms import Y ms" (version "-" for Dask)."""
import os
import statistics
import subprocess
import sys
import time

from _peers import GRAIN_PY, HERE, ROOT, parse_impl

IMPL, ARGS = parse_impl()
ROUNDS = int(ARGS[0]) if ARGS else 10
BIN = os.path.dirname(sys.executable)


def median_ms(cmd):
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Run from bench/, where no grain.py is: upstream's `import grain` must find its own.
    # grain.py's import finds this repository's file through PYTHONPATH.
    if IMPL == "grainpy":
        env["PYTHONPATH"] = ROOT
    run = dict(env=env, cwd=HERE, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(cmd, **run)  # writes the bytecode caches
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        subprocess.run(cmd, **run)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    py = sys.executable
    if IMPL == "grainpy":
        version = median_ms([py, GRAIN_PY, "--version"])
        imp = median_ms([py, "-c", "import grain"])
    elif IMPL == "upstream":
        version = median_ms([os.path.join(BIN, "grain"), "--version"])
        imp = median_ms([py, "-c", "import grain.delayed, grain.resource"])
    else:
        version = None
        imp = median_ms([py, "-c", "import dask.distributed"])
    print(f"start-up ({IMPL}): median of {ROUNDS}")
    print(f"version {'-' if version is None else f'{version:.1f}'} ms import {imp:.1f} ms")
