#!/usr/bin/env bash
# On the GPU machine, after gpu-pack (carry .gpu, and .basebin for the "before" binary): the issue 17
# benchmarks in one run, the full outputs under $OUT and a summary on stdout.
#   bash scripts/issue17-bench.sh [BASELINE_BINARY]
# BASELINE_BINARY (default: the newest .basebin/mempool-bench-*) is an older mempool-bench; each of its runs
# sits right before the same run of .gpu/bin/mempool-bench, so before and after share the session.
set -u
out=${OUT:-/tmp/issue17}; mkdir -p "$out"
base=${1:-$(ls -t .basebin/mempool-bench-* 2>/dev/null | head -1)}
new=.gpu/bin/mempool-bench
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E '^(Model name|CPU\(s\)):'
  git log -1 --format='after: %h %s' 2>/dev/null || true
  echo "before: ${base:-none}"
} | tee "$out/machine.txt"
per_op="pool(async),binning(pool(async),min=256KiB,max=4MiB),arena(async)"
threads="pool(async),binning(async),arena(async)"
run() { # label binary args...
  local label=$1 bin=$2; shift 2
  [ -x "$bin" ] || { echo "== $label: $bin missing"; return; }
  echo "== $label: $bin $*"
  timeout 500 "$bin" "$@" > "$out/$label.txt" 2>&1; echo "rc=$?"
  cat "$out/$label.txt"
}
for what in per-op threads; do
  if [ "$what" = per-op ]; then args=(random -q -r "$per_op"); else args=(random -q --threads 1,2,4,8 -r "$threads"); fi
  [ -n "$base" ] && run "$what-before" "$base" "${args[@]}"
  run "$what-after" "$new" "${args[@]}"
done
if [ -x .gpu/bin/ipc_handoff ]; then
  run ipc-handoff .gpu/bin/ipc_handoff 4
  run ipc-handoff-sub-first .gpu/bin/ipc_handoff 4 --no-trace --sub-first
fi
