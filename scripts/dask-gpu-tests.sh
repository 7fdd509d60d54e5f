#!/usr/bin/env bash
# On the GPU machine (two GPUs; CPython 3.12 with CuPy and PyTorch installed; no network): mempool.dask's GPU
# tests and its documents' blocks, and the two benchmarks, from the wheels that scripts/dask-wheels.sh put in
# .dask-wheels/ (with the mempool wheel built into it: see that script). Each step fits one 10-minute call:
#
#   bash scripts/dask-gpu-tests.sh install     # a venv in .dask-venv (system site packages: CuPy, PyTorch),
#                                              #   with RMM and the bridge from target/rmm-gpu when unpacked
#   bash scripts/dask-gpu-tests.sh tests       # test_dask_gpu.py, test_dask_docs.py, test_dask.py, the Ray block
#   bash scripts/dask-gpu-tests.sh shuffle     # 64 x 256 MiB between two workers: default comm, then handles
#   bash scripts/dask-gpu-tests.sh bdb         # the workload under mempool's stack and pool (and RMM's pool,
#                                              #   when rmm imports), results checked equal
#
# PYTHON (default python3) makes the venv; WHEELS (default .dask-wheels) holds the wheels; OUT (default
# /tmp/dask-gpu-out) receives the logs and JSON reports. SCALE, PARTITIONS (bdb; default 20 and 64),
# SHUFFLE_PARTITIONS, SHUFFLE_MIB (default 64 and 256) size the benchmarks. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
step=${1:-}
[ $# -gt 0 ] && shift
venv=$root/.dask-venv
wheels=${WHEELS:-$root/.dask-wheels}
out=${OUT:-/tmp/dask-gpu-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0

need_venv() {
  [ -x "$venv/bin/python" ] || { echo "dask-gpu-tests.sh: no venv: run '$0 install' first" >&2; exit 2; }
}

case "$step" in
install)
  ls "$wheels"/mempool-*.whl > /dev/null 2>&1 || {
    echo "dask-gpu-tests.sh: no mempool wheel in $wheels (build one into it: see scripts/dask-wheels.sh)" >&2
    exit 2
  }
  "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
    --force-reinstall --no-deps "$(ls -t "$wheels"/mempool-*.whl | head -1)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
    dask-cuda==26.10.0 dask==2026.7.1 distributed==2026.7.1 pytest pytest-timeout
  # RMM 26.10 and the RMM bridge, from the pack of scripts/rmm-gpu-tests.sh (carry target/rmm-gpu.tgz and
  # unpack it first): the baseline of RMM's pool (dask-cuda's rmm_pool_size) and the plugin's "rmm" hook.
  rmm_wheels=${RMM_WHEELS:-$root/target/rmm-gpu/python/wheels}
  if ls "$rmm_wheels"/rmm_cu13-*.whl > /dev/null 2>&1; then
    extra=()
    "$venv/bin/python" -c 'import cuda.pathfinder' 2>/dev/null || extra=("$rmm_wheels"/cuda_pathfinder-*.whl)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      "$rmm_wheels"/rmm_cu13-*.whl "$rmm_wheels"/librmm_cu13-*.whl "$rmm_wheels"/rapids_logger-*.whl \
      "$rmm_wheels"/mempool_rmm_bridge-*.whl "${extra[@]}"
  else
    echo "dask-gpu-tests.sh: no RMM wheels in $rmm_wheels: RMM's pool and the 'rmm' hook are left out"
  fi
  "$venv/bin/python" - <<'PY'
import importlib
for m in ("mempool", "mempool.dask", "dask_cuda", "distributed", "cupy", "torch", "rmm", "mempool_rmm_bridge"):
    try:
        mod = importlib.import_module(m)
    except ImportError as e:
        print(m, "does not import:", e)
        continue
    print(m, getattr(mod, "__version__", ""), getattr(mod, "__file__", ""))
from mempool import mr
print("devices:", mr.device_count())
PY
  ;;
tests)
  need_venv
  cd /tmp
  "$venv/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib --rootdir "$root/crates/mempool-py" \
    "$root/crates/mempool-py/tests/test_dask_gpu.py" "$root/crates/mempool-py/tests/test_dask_docs.py" \
    "$root/crates/mempool-py/tests/test_dask.py" -v --timeout 420 -o faulthandler_timeout=400 "$@" 2>&1 \
    | tee "$out/tests.log"
  "$venv/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib --rootdir "$root/crates/mempool-py" \
    "$root/crates/mempool-py/tests/test_guide.py" -k "beyond-one-host" -v --timeout 300 2>&1 | tee "$out/ray-block.log"
  ;;
shuffle)
  need_venv
  cd /tmp
  "$venv/bin/python" -m mempool.benchmarks.dask_gpu shuffle --partitions "${SHUFFLE_PARTITIONS:-64}" \
    --mib "${SHUFFLE_MIB:-256}" --repeats 3 --json "$out/shuffle.json" "$@" 2>&1 | tee "$out/shuffle.log"
  ;;
bdb)
  need_venv
  cd /tmp
  runs=mempool-default,mempool-pool
  if "$venv/bin/python" -c "import rmm" 2>/dev/null; then
    runs=rmm-pool,$runs
  else
    echo "dask-gpu-tests.sh: rmm does not import here: the RMM pool run is left out" | tee "$out/bdb.log"
  fi
  "$venv/bin/python" -m mempool.benchmarks.bdb --xp cupy --gpus 2 --scale "${SCALE:-20}" \
    --partitions "${PARTITIONS:-64}" --repeats 3 --allocators "$runs" --json "$out/bdb.json" "$@" 2>&1 \
    | tee -a "$out/bdb.log"
  ;;
*)
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
