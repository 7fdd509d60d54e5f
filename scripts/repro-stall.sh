#!/usr/bin/env bash
# On the GPU machine: build scripts/repro/pool_stall.c (raw driver calls, no mempool code) and run it
# RUNS times for each MODE given (see the modes in pool_stall.c), each run THREADS threads for SECONDS
# seconds. A run whose workers make no progress for 20 s is a stall: every thread's stack is taken with
# cuda-gdb (or gdb) into $OUT/repro-stall-MODE-RUN.txt, then the run is killed.
#
#   scripts/repro-stall.sh RUNS THREADS SECONDS MODE...
#
# Prints one line per run and, per mode, 'MODE: N runs, K stalls, F failures'. STACKS=none skips the stacks.
set -u
cd "$(dirname "$0")/.." || exit 1
runs=$1 threads=$2 secs=$3; shift 3
cuda=${CUDA_HOME:-/usr/local/cuda}
work=${TMPDIR:-/tmp}/pool_stall.$$
mkdir -p "$work"
gcc -O2 -pthread -I"$cuda/include" scripts/repro/pool_stall.c -o "$work/pool_stall" -L"$cuda/lib64/stubs" -lcuda || exit 1
"$cuda/bin/nvcc" -ptx -arch=native scripts/repro/fill.cu -o "$work/fill.ptx" 2>/dev/null \
  || "$cuda/bin/nvcc" -ptx scripts/repro/fill.cu -o "$work/fill.ptx" || exit 1
export FILL_PTX="$work/fill.ptx" STALL_WAIT_S=600
dbg=$(command -v cuda-gdb || command -v gdb || true)
[ "${STACKS:-all}" = none ] && dbg=  # STACKS=none: no stacks (taking them costs up to 120 s a stall)
total_stalls=0
for mode in "$@"; do
  stalls=0 fails=0
  for r in $(seq 1 "$runs"); do
    log="$work/run.log"
    "$work/pool_stall" "$threads" "$secs" "$mode" 20 > "$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && ! grep -q '^STALL' "$log"; do sleep 0.5; done
    if grep -q '^STALL' "$log"; then
      stalls=$((stalls+1))
      dump=${OUT:-$work}/repro-stall-$mode-$r.txt
      { cat "$log"; [ -n "$dbg" ] && timeout 120 "$dbg" -p "$pid" -batch -ex "thread apply all bt 30" 2>&1; } > "$dump"
      kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
      echo "$mode run $r: STALLED (stacks in $dump)"; head -3 "$log" | sed 's/^/    /'
    else
      wait "$pid"; rc=$?
      [ "$rc" = 0 ] || fails=$((fails+1))
      echo "$mode run $r: rc=$rc $(tail -1 "$log")"
      [ "$rc" = 0 ] || sed 's/^/    /' "$log" | head -5
    fi
  done
  echo "$mode: $runs runs, $stalls stalls, $fails failures ($threads threads, $secs s each)"
  total_stalls=$((total_stalls+stalls))
done
rm -rf "$work"
[ "$total_stalls" -eq 0 ]
