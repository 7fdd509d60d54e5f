#!/usr/bin/env bash
# Builds the `mempool` wheel (crates/mempool-py) and the RMM bridge's (crates/mempool-py/rmm-bridge, with RMM
# 26.10: scripts/build-rmm-bridge.sh), and runs the host pytest suite (`-m "not gpu"`).
# Makes a virtual environment under target/python-venv, installs maturin and pytest from PyPI into it (and
# dask, distributed and NumPy, pinned in crates/mempool-py/tests/requirements-dask.txt, for mempool.dask's tests),
# builds the wheel with maturin (debug profile: quicker to build; the tests time nothing) into target/wheels, installs it, and runs pytest from outside the source
# tree, so the installed wheel is what gets imported. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9.4,<2" pytest
# mempool.dask's host tests: dask, distributed and NumPy, pinned (the file says which and why).
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r crates/mempool-py/tests/requirements-dask.txt
rm -rf target/wheels
(cd crates/mempool-py && "$root/$venv/bin/maturin" build --quiet -o "$root/target/wheels")
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/mempool-*.whl
# The RMM bridge's Python half (docs/rmm.md, "Python"): RMM 26.10 and the bridge built against it, so that the
# host tests check what mempool.rmm says without a GPU.
scripts/build-rmm-bridge.sh "$venv/bin/python" target/wheels >/dev/null
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
  target/wheels/mempool_rmm_bridge-*.whl
cd /tmp
"$root/$venv/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib --rootdir "$root/crates/mempool-py" \
  "$root/crates/mempool-py/tests" -m "not gpu" "$@"
