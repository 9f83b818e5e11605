#!/usr/bin/env bash
# Upstream Grain's own tests of its public API (grain/test_delayed.py, test_resource.py and
# test_combine.py from the grain-scheduler 0.17.1 sdist on PyPI), run unchanged against
# grain.py. Usage: bash .ci/upstream-tests.sh [PYTHON]   (default: python)
#
# The files import their subject relatively (`from .resource import *`), so they are put
# in a package of their own whose __init__ makes each grain.X submodule its own .X.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python}
here=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m pip download -q --no-deps --no-binary :all: grain-scheduler==0.17.1 -d "$work"
tar -xzf "$work"/grain_scheduler-0.17.1.tar.gz -C "$work"
pkg="$work/run/upstream_grain"
mkdir -p "$pkg"
for name in test_delayed test_resource test_combine; do
  cp "$work/grain_scheduler-0.17.1/grain/$name.py" "$pkg/"
done
cat > "$pkg/__init__.py" <<'PY'
import sys
import grain

for _name, _module in list(sys.modules.items()):
    if _name.startswith("grain."):
        sys.modules[__name__ + _name[len("grain"):]] = _module
PY
printf '[pytest]\ntrio_mode = true\n' > "$work/run/pytest.ini"
cd "$work/run"
PYTHONPATH="$here" "$python" -m pytest -q -p no:cacheprovider
