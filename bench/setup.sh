#!/usr/bin/env bash
# Virtualenvs for the side-by-side benchmarks (bench/compare.py), under bench/.venvs/ (ignored
# by git). Idempotent: a venv whose packages already import is left alone.
#   grainpy   this repository's grain.py, with trio and dill
#   upstream  grain-scheduler 0.17.1 from PyPI (upstream Grain)
#   dask      dask[distributed]
# All three use the same Python (PYTHON, default python3) and the newest trio pip finds, so
# the figures differ by the scheduler, not by the interpreter or the event loop.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p .venvs

make_venv() {  # name, import check, packages...
  local name=$1 check=$2
  shift 2
  local py=.venvs/$name/bin/python
  if [ -x "$py" ] && "$py" -c "$check" 2>/dev/null; then
    echo "bench/.venvs/$name: ready"
    return
  fi
  echo "bench/.venvs/$name: installing $*"
  rm -rf ".venvs/$name"
  "$PYTHON" -m venv ".venvs/$name"
  "$py" -m pip install -q --upgrade "$@"
  "$py" -c "$check"
}

make_venv grainpy "import trio, dill" trio dill
make_venv upstream "import grain.delayed, grain.resource, importlib.metadata as m; \
assert m.version('grain-scheduler') == '0.17.1'" trio "grain-scheduler==0.17.1"
make_venv dask "import dask.distributed" trio "dask[distributed]"
for name in grainpy upstream dask; do
  printf '%-9s %s, trio %s\n' "$name" "$(.venvs/$name/bin/python --version)" \
    "$(.venvs/$name/bin/python -c 'import trio; print(trio.__version__)')"
done
