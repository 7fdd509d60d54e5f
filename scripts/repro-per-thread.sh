#!/usr/bin/env bash
# On the GPU machine: build scripts/repro/per_thread_pool.c (raw driver calls, no mempool code) and run each
# MODE given (default: a b c d e A B C D E; upper case: contexts pushed and popped, as mempool does) for ROUNDS rounds with a LIMIT-second limit; a run past its limit prints its
# last steps (the call that did not return) and the kernel's view of every thread.
#
#   scripts/repro-per-thread.sh [ROUNDS] [LIMIT] [MODE...]
set -u
cd "$(dirname "$0")/.." || exit 1
rounds=${1:-3} limit=${2:-20}; shift 2 2>/dev/null || set --
[ $# -gt 0 ] || set -- a b c d e A B C D E
cuda=${CUDA_HOME:-/usr/local/cuda}
work=${TMPDIR:-/tmp}/per_thread_pool.$$
mkdir -p "$work"
gcc -O2 -pthread -I"$cuda/include" scripts/repro/per_thread_pool.c -o "$work/ptp" -L"$cuda/lib64/stubs" -lcuda || exit 1
for m in "$@"; do
  "$work/ptp" "$m" "$rounds" > "$work/$m.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 $((limit * 10))); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if kill -0 $pid 2>/dev/null; then
    echo "mode $m: HUNG after $limit s; last steps:"
    tail -4 "$work/$m.log" | sed 's/^/  /'
    for t in /proc/$pid/task/*; do echo "  thread $(basename "$t"): $(cat "$t/wchan" 2>/dev/null) $(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"; done
    kill -9 $pid
  else
    wait $pid; echo "mode $m: rc=$? $(tail -1 "$work/$m.log")"
  fi
done
