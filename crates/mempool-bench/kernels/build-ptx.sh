#!/usr/bin/env bash
# Regenerates every kernels/*.ptx from the .cu beside it. Needs nvcc (CUDA 11.0 or newer); run it on a
# machine with the CUDA toolkit and commit the .ptx files: the harness loads them through the driver
# (JIT-compiled for whatever GPU runs it), so building mempool-bench needs no nvcc.
#
#   crates/mempool-bench/kernels/build-ptx.sh            # all kernels
#   NVCC=/usr/local/cuda/bin/nvcc ARCH=compute_90 ...    # another nvcc or virtual architecture
#   OUTDIR=$OUT crates/mempool-bench/kernels/build-ptx.sh  # write the .ptx files elsewhere
#
# A binary built before the .ptx files were committed can still run fresh ones: set
# MEMPOOL_BENCH_PTX_DIR to the directory holding work.ptx and query.ptx.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
# compute_80 (A100 and newer): __match_any_sync needs sm_70+, and PTX for compute_80 JITs on Hopper.
ARCH=${ARCH:-compute_80}
OUTDIR=${OUTDIR:-.}
mkdir -p "$OUTDIR"
"$NVCC" --version | tail -n 2
for cu in *.cu; do
  ptx="$OUTDIR/${cu%.cu}.ptx"
  "$NVCC" -ptx -arch="$ARCH" -O3 -std=c++14 -I. -o "$ptx.tmp" "$cu"
  {
    echo "// Generated from $cu by build-ptx.sh ($("$NVCC" --version | tail -n 1 | sed 's/^ *//'), -arch=$ARCH). Do not edit."
    cat "$ptx.tmp"
  } > "$ptx"
  rm -f "$ptx.tmp"
  echo "build-ptx: $ptx ($(grep -c '^.visible .entry' "$ptx") kernels)"
done
