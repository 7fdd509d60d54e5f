#!/usr/bin/env bash
# Issue 33's GPU run, on a machine with two GPUs, after gpu-pack (carry .gpu.tgz; `tar xzf .gpu.tgz` first):
#
#   scripts/issue33-gpu.sh start [RUNS] [TORTURE_SECS] [SUITE_LIMIT]
#       the torture test on both GPUs in the background, in a session of its own so that it outlives the
#       call (TORTURE_SECS, default 600); beside it, at once, the conformance binary RUNS times on GPU 0
#       (default 50, scripts/stress-conformance.sh) and every packed test binary on GPU 1
#       (scripts/gpu-suite.sh SUITE_LIMIT, default 240; the two-GPU tests fail there, saying so)
#   scripts/issue33-gpu.sh collect [PYTEST ARGS...]
#       the Python GPU tests given (none: skipped) beside the torture test, then waits for it and prints
#       its result
#
# Everything goes to $OUT (or /tmp): stress-conformance.txt, suite-gpu1.txt, pytest.txt, torture.log.
set -u
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
out=${OUT:-/tmp}
case "${1:-}" in
  start)
    runs=${2:-50} secs=${3:-600} lim=${4:-240}
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
    lscpu | grep 'Model name'
    MEMPOOL_TORTURE_SECS=$secs MEMPOOL_TORTURE_STALL_WAIT_SECS=90 setsid nohup \
      .gpu/tests/mempool-rmm--test--torture --nocapture > /tmp/torture.log 2>&1 < /dev/null &
    echo $! > /tmp/torture.pid
    # A stall of the torture test: every thread's stack, taken while it waits to abort.
    setsid nohup bash -c 'while ! grep -q "^STALL: worker .* made no step" /tmp/torture.log; do
        kill -0 "$(cat /tmp/torture.pid)" 2>/dev/null || exit 0; sleep 2; done
      pid=$(sed -nE "s/.*\(pid ([0-9]+);.*/\1/p" /tmp/torture.log | head -1)
      timeout 80 $(command -v cuda-gdb || command -v gdb) -p "$pid" -batch -ex "thread apply all bt 30" > /tmp/torture-stacks.txt 2>&1' \
      > /dev/null 2>&1 < /dev/null &
    echo "torture: started for $secs s at $(date -u +%T)"
    mkdir -p /tmp/suite-logs; CUDA_VISIBLE_DEVICES=1 OUT=/tmp/suite-logs bash scripts/gpu-suite.sh "$lim" > "$out/suite-gpu1.txt" 2>&1 &
    suite=$!
    CUDA_VISIBLE_DEVICES=0 bash scripts/stress-conformance.sh "$runs" 90 > "$out/stress-conformance.txt" 2>&1
    tail -3 "$out/stress-conformance.txt"
    wait "$suite"
    tail -1 "$out/suite-gpu1.txt"
    ;;
  collect)
    shift
    if [ $# -gt 0 ]; then
      PYTHONUNBUFFERED=1 bash .gpu/run-pytest "$@" > "$out/pytest.txt" 2>&1
      tail -3 "$out/pytest.txt"
    fi
    while kill -0 "$(cat /tmp/torture.pid)" 2>/dev/null; do sleep 2; done
    cp /tmp/torture.log "$out/torture.log"
    [ -s /tmp/torture-stacks.txt ] && cp /tmp/torture-stacks.txt "$out/torture-stacks.txt"
    grep -E '^torture:|^test result|STALL|panicked' /tmp/torture.log
    ;;
  *) sed -n '2,14p' "$0"; exit 2 ;;
esac
