#!/usr/bin/env bash
# On the GPU machine: build scripts/bench/driver_floor.c (raw driver calls, no mempool code) and print what
# one driver call or one lock costs there (the floors issue 35's targets are measured against).
#
#   scripts/bench/driver-floor.sh [ITERS] [THREADS...]     (default: 200000 1 2 4 8 16)
set -eu
cd "$(dirname "$0")/../.."
cuda=${CUDA_HOME:-/usr/local/cuda}
work=${TMPDIR:-/tmp}/driver_floor.$$
mkdir -p "$work"
gcc -O2 -pthread -I"$cuda/include" scripts/bench/driver_floor.c -o "$work/driver_floor" -L"$cuda/lib64/stubs" -lcuda
lscpu | grep 'Model name' || true
if [ $# -eq 0 ]; then set -- 200000 1 2 4 8 16; fi
"$work/driver_floor" "$@"
