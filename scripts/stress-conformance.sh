#!/usr/bin/env bash
# On the GPU machine, after gpu-pack: run mempool-rmm's conformance binary N times (default 50), each with
# a limit of LIMIT seconds (default 90; a run takes about 6 s on an H200). A run still going at its limit
# is a stall: every thread's stack is taken with cuda-gdb (or gdb) into $OUT/conformance-stall-RUN.txt
# (or /tmp), then it is killed. Further arguments go to the test binary (a filter, --test-threads=N).
#
#   scripts/stress-conformance.sh [N] [LIMIT] [TEST ARGS...]
#
# Prints one line per run and ends with 'N runs: P passed, S stalled, F failed'; exit status 0 only when
# every run passed.
#
# LOCKWATCH=1 runs the binary under scripts/repro/lockwatch.c (built with gcc into /tmp), which writes
# who holds each driver lock that a thread waits on into $OUT/lockwatch-PID-N.txt once a wait passes
# LOCKWATCH_SECS (default a third of LIMIT); LOCKWATCH_BT=1 also keeps each acquisition's first frames.
# STACKS=all (default), first or none: which stalls get cuda-gdb's stacks (taking them costs up to 120 s).
set -u
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
n=${1:-50} lim=${2:-90}; shift 2 2>/dev/null || shift $#
bin=${CONFORMANCE_BIN:-.gpu/tests/mempool-rmm--test--conformance}
[ -x "$bin" ] || { echo "stress-conformance: $bin not found: run ../shared/tools/gpu-pack and unpack .gpu.tgz" >&2; exit 2; }
dbg=$(command -v cuda-gdb || command -v gdb || true)
out=${OUT:-/tmp}
stacks=${STACKS:-all}
preload=
if [ "${LOCKWATCH:-0}" = 1 ]; then
  gcc -O2 -shared -fPIC -o /tmp/lockwatch.so scripts/repro/lockwatch.c -ldl -lpthread || exit 2
  preload=/tmp/lockwatch.so
  export LOCKWATCH_DIR="$out" LOCKWATCH_SECS="${LOCKWATCH_SECS:-$((lim / 3))}"
fi
pass=0 stall=0 fail=0
for r in $(seq 1 "$n"); do
  log=$(mktemp)
  s=$SECONDS
  LD_PRELOAD=$preload "$bin" "$@" > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - s)) -lt "$lim" ]; do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    stall=$((stall+1))
    dump=$out/conformance-stall-$r.txt
    want=
    case $stacks in all) want=1 ;; first) [ "$stall" = 1 ] && want=1 ;; esac
    { echo "# run $r of $n: still running after $lim s (pid $pid)"; [ -n "$dbg" ] && [ -n "$want" ] && timeout 120 "$dbg" -p "$pid" -batch -ex "thread apply all bt 30" 2>&1; cat "$log"; } > "$dump"
    kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    echo "run $r: STALLED after $lim s (stacks in $dump)"
  else
    wait "$pid"; rc=$?
    res=$(grep -E '^test result:' "$log" | tail -1)
    if [ "$rc" = 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); cp "$log" "$out/conformance-fail-$r.txt"; fi
    echo "run $r: rc=$rc in $((SECONDS - s)) s: $res"
  fi
  rm -f "$log"
done
echo "$n runs: $pass passed, $stall stalled, $fail failed"
[ "$pass" -eq "$n" ]
