#!/usr/bin/env bash
# Issue 33's GPU run, on a machine with two GPUs, after gpu-pack (carry .gpu.tgz; `tar xzf .gpu.tgz` first):
#
#   scripts/issue33-gpu.sh start [RUNS] [TORTURE_SECS]   the torture test in the background (its own session,
#                                                        so it outlives the call), then the conformance
#                                                        binary RUNS times (default 50) beside it, then the
#                                                        raw-driver reproducer's module mode
#   scripts/issue33-gpu.sh collect                       waits for the torture test and prints its result
#
# Logs go to $OUT (or /tmp); the torture's own log stays in /tmp/torture.log on the machine.
set -u
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
out=${OUT:-/tmp}
case "${1:-}" in
  start)
    runs=${2:-50} secs=${3:-600}
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
    lscpu | grep 'Model name'
    MEMPOOL_TORTURE_SECS=$secs setsid nohup .gpu/tests/mempool-rmm--test--torture --nocapture \
      > /tmp/torture.log 2>&1 < /dev/null &
    echo "torture: started for $secs s at $(date -u +%T)"
    bash scripts/stress-conformance.sh "$runs" 90 2>&1 | tee "$out/stress-conformance.txt" | tail -4
    ;;
  collect)
    while pgrep -f mempool-rmm--test--torture > /dev/null; do sleep 2; done
    cp /tmp/torture.log "$out/torture.log"
    grep -E '^torture:|^test result|STALL|panicked' /tmp/torture.log
    ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
