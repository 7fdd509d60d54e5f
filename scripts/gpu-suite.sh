#!/usr/bin/env bash
# On the GPU machine, after gpu-pack: every packed test binary with its own time limit ($1 seconds, default
# 240; further arguments go to each binary), one line each with its duration, the failures' details, then
# 'N passed, N failed'. Unlike .gpu/run-tests, a hung binary costs its limit, not the whole run.
# Runs from the repository root whatever the current directory, and tells the tests where it is
# (MEMPOOL_SOURCE_ROOT: the packed binaries find the crates' committed data under it, not under the build
# machine's path).
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
lim=${1:-240}; shift || true
pass=0; fail=0
for t in .gpu/tests/*; do
  name=$(basename "$t"); log=${OUT:-/tmp}/$name.log
  s=$SECONDS; timeout "$lim" "$t" "$@" > "$log" 2>&1; rc=$?; d=$((SECONDS-s))
  res=$(grep -E '^test result:' "$log" | tail -1)
  p=$(echo "$res" | sed -nE 's/.* ([0-9]+) passed.*/\1/p'); f=$(echo "$res" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
  [ -z "$res" ] && f=1
  pass=$((pass+${p:-0})); fail=$((fail+${f:-0}))
  printf "%-50s %4ss rc=%s %s passed %s failed\n" "$name" "$d" "$rc" "${p:-0}" "${f:-0}"
  if [ "${f:-0}" != 0 ] || [ "$rc" != 0 ]; then
    grep -E -A12 '^---- |panicked|has been running' "$log" | head -40
    [ "$rc" = 124 ] && grep -E '^test .* \.\.\. ' "$log" | tail -5
  fi
  # A failing binary's whole log stays under $OUT (when set) for the run's files; a passing one's goes.
  if [ -n "${OUT:-}" ] && { [ "${f:-0}" != 0 ] || [ "$rc" != 0 ]; }; then :; else rm -f "$log"; fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
