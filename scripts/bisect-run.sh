#!/usr/bin/env bash
# On the GPU machine, after scripts/bisect-pack.sh (carry .bisect.tgz, `tar xzf .bisect.tgz` first): runs each
# packed conformance binary once per round, interleaved (ROUNDS rounds, default 10), each run with a limit
# of LIMIT seconds (default 30). A run that passes is 'ok', one at its limit 'stalled', one that fails or
# dies 'failed' (with its exit status: 101 a failed test, 128+N signal N). Ends with a line per version:
# 'NAME: P passed, S stalled, F failed of N'. Further
# arguments go to every binary (a filter, --skip NAME, --test-threads=N).
set -u
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
rounds=${1:-10} lim=${2:-30}; shift 2 2>/dev/null || shift $#
names=$(ls .bisect 2>/dev/null) || true
[ -n "$names" ] || { echo "bisect-run: no .bisect/: run scripts/bisect-pack.sh and unpack .bisect.tgz" >&2; exit 2; }
declare -A pass stall died
for n in $names; do pass[$n]=0 stall[$n]=0 died[$n]=0; cat ".bisect/$n/REV"; done
for r in $(seq 1 "$rounds"); do
  for n in $names; do
    timeout -s KILL "$lim" ".bisect/$n/conformance" "$@" > /tmp/bisect-run.log 2>&1
    rc=$?
    case $rc in
      0) pass[$n]=$((pass[$n]+1)); what=ok ;;
      137) stall[$n]=$((stall[$n]+1)); what=stalled ;;
      *) died[$n]=$((died[$n]+1)); what="failed (rc $rc)" ;;
    esac
    echo "round $r $n: $what"
  done
done
for n in $names; do echo "$n: ${pass[$n]} passed, ${stall[$n]} stalled, ${died[$n]} failed of $rounds"; done
