# Source this on a machine whose NCCL comes from pip's nvidia-nccl-cu13 (the GPU machines' layout) before
# running NCCL tests, benchmarks or examples:  . scripts/nccl-env.sh
# - MEMPOOL_NCCL_LIBRARY: the path of libnccl.so.2, for mempool-nccl's loader;
# - LD_LIBRARY_PATH gains a directory with a `libnccl.so` link to it, the name cudarc's own NCCL loader
#   looks for (the pip package ships only `libnccl.so.2`);
# - NCCL_NVLS_ENABLE=0: NVLink multicast stays off (on shared machines it can take GPUs out of service).
export NCCL_NVLS_ENABLE=0
if [ -z "${MEMPOOL_NCCL_LIBRARY:-}" ]; then
  _nccl_dir=$(python3 - <<'PY' 2>/dev/null
import os
try:
    import nvidia.nccl as m
    for d in list(getattr(m, "__path__", [])):
        lib = os.path.join(d, "lib")
        if os.path.exists(os.path.join(lib, "libnccl.so.2")):
            print(lib)
            break
except Exception:
    pass
PY
)
  if [ -n "$_nccl_dir" ]; then
    export MEMPOOL_NCCL_LIBRARY="$_nccl_dir/libnccl.so.2"
  fi
  unset _nccl_dir
fi
if [ -n "${MEMPOOL_NCCL_LIBRARY:-}" ]; then
  _link_dir="${TMPDIR:-/tmp}/mempool-nccl-lib"
  mkdir -p "$_link_dir"
  ln -sf "$MEMPOOL_NCCL_LIBRARY" "$_link_dir/libnccl.so"
  export LD_LIBRARY_PATH="$_link_dir:$(dirname "$MEMPOOL_NCCL_LIBRARY")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  unset _link_dir
  echo "nccl-env: MEMPOOL_NCCL_LIBRARY=$MEMPOOL_NCCL_LIBRARY" >&2
else
  echo "nccl-env: no libnccl.so.2 found in the nvidia-nccl Python package; set MEMPOOL_NCCL_LIBRARY" >&2
fi
