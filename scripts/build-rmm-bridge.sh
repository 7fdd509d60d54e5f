#!/usr/bin/env bash
# Builds the Python half of the RMM bridge, the mempool-rmm-bridge wheel (crates/mempool-py/rmm-bridge;
# docs/rmm.md, "Python"), with PYTHON (a virtual environment's python), into OUT:
#   scripts/build-rmm-bridge.sh PYTHON OUT
# Installs into PYTHON's environment, pinned: RMM 26.10 (rmm-cu13, which brings librmm-cu13, rapids-logger,
# cuda-bindings and numpy), the CUDA 13 runtime's headers and library (nvidia-cuda-runtime, nvidia-cuda-crt),
# and the build's tools (Cython, setuptools, wheel); then builds the wheel without isolation against them.
# The wheel is abi3 (CPython 3.11 and later), as RMM's own. Needs g++ and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# = 2 ] || { echo "usage: scripts/build-rmm-bridge.sh PYTHON OUT" >&2; exit 2; }
py=$1 out=$2
# Pinned with the C++ half's wheels (scripts/rmm-deps.sh).
pins=(rmm-cu13==26.10.0 librmm-cu13==26.10.0 rapids-logger==0.3.0 nvidia-cuda-runtime==13.0.96
  nvidia-cuda-crt==13.0.88 "cython==3.2.9" "setuptools==80.9.0" "wheel==0.45.1")
if ! log=$("$py" -m pip install -q --disable-pip-version-check "${pins[@]}" 2>&1); then
  echo "build-rmm-bridge: could not install ${pins[*]} from PyPI:" >&2
  echo "$log" | tail -5 >&2
  exit 1
fi
mkdir -p "$out"
rm -f "$out"/mempool_rmm_bridge-*.whl
src=crates/mempool-py/rmm-bridge
rm -rf "$src/build" "$src"/*.egg-info "$src/mempool_rmm_bridge/_bridge.cpp"
# LDSHARED: the build Python's own (sysconfig) adds its lib folder to the module's RUNPATH; the bridge needs
# only the RUNPATH setup.py gives it (RMM's and the CUDA runtime's wheels, beside it in site-packages).
LDSHARED="${CXX:-g++} -shared" MEMPOOL_INCLUDE=$PWD/crates/mempool-capi/include "$py" -m pip wheel -q --disable-pip-version-check \
  --no-build-isolation --no-deps "$src" -w "$out"
rm -rf "$src/build" "$src"/*.egg-info "$src/mempool_rmm_bridge/_bridge.cpp"
ls "$out"/mempool_rmm_bridge-*.whl
