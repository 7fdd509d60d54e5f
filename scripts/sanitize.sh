#!/usr/bin/env bash
# On the GPU machine, after gpu-pack: the GPU suites under NVIDIA's compute-sanitizer.
#
#   scripts/sanitize.sh TOOL [LIMIT] [rust|python|both] [FILTER...]
#
# TOOL is memcheck or racecheck (initcheck and synccheck work too). Every packed Rust test binary runs
# under `compute-sanitizer --tool TOOL --target-processes all` (its child processes too: the IPC tests
# re-execute themselves), each with a limit of LIMIT seconds (default 600); `python` runs the Python GPU
# suite (`.gpu/run-pytest -m "gpu and not two_gpu"`) under it the same way. FILTER goes to each Rust binary.
# A report is clean when the sanitizer's 'ERROR SUMMARY' lines count no error other than the API errors
# the suites provoke on purpose: CUDA_ERROR_OUT_OF_MEMORY (the out-of-memory tests),
# CUDA_ERROR_INVALID_VALUE from an impossible size, and CUDA_ERROR_NOT_SUPPORTED / NOT_PERMITTED from the
# tests that check a refusal. Logs go to $OUT/sanitize-TOOL-NAME.log (or /tmp) when not clean.
# Ends with 'TOOL: N clean, N with errors, N failed or timed out'.
set -u
cd "$(dirname "$0")/.." || exit 1
export MEMPOOL_SOURCE_ROOT="${MEMPOOL_SOURCE_ROOT:-$PWD}"
tool=${1:?usage: scripts/sanitize.sh TOOL [LIMIT] [rust|python|both] [FILTER...]}
lim=${2:-600}; which=${3:-both}; shift 3 2>/dev/null || shift $#
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$san" ] || { echo "sanitize: compute-sanitizer not found" >&2; exit 2; }
out=${OUT:-/tmp}
clean=0 dirty=0 broken=0
# The API errors the suites provoke on purpose (out of memory, refusals); anything else is an error.
allowed='CUDA_ERROR_OUT_OF_MEMORY|CUDA_ERROR_INVALID_VALUE|CUDA_ERROR_NOT_SUPPORTED|CUDA_ERROR_NOT_PERMITTED|CUDA_ERROR_INVALID_HANDLE|CUDA_ERROR_ALREADY_MAPPED|CUDA_ERROR_NOT_READY'
judge() { # name log rc
  local name=$1 log=$2 rc=$3
  # Errors that are not API errors, and API errors outside the allowed list.
  local bad
  bad=$(grep -E '^========= (Invalid|Race|Uninitialized|Barrier|Memory leak|Out-of-range|Address|Misaligned|Program hit)' "$log" \
        | grep -vE "Program hit ($allowed)" | sort | uniq -c | sort -rn | head -5)
  local api
  api=$(grep -cE "Program hit ($allowed)" "$log")
  if [ -n "$bad" ]; then
    dirty=$((dirty+1)); echo "$name: ERRORS"; echo "$bad" | sed 's/^/    /'; cp "$log" "$out/sanitize-$tool-$name.log"
  elif [ "$rc" != 0 ]; then
    broken=$((broken+1)); echo "$name: rc=$rc (test failure or limit)"; grep -E '^test result|panicked|FAILED|failed' "$log" | head -5 | sed 's/^/    /'; cp "$log" "$out/sanitize-$tool-$name.log"
  else
    clean=$((clean+1)); echo "$name: clean ($api deliberate API errors) $(grep -E '^test result|passed' "$log" | tail -1)"
  fi
}
if [ "$which" != python ]; then
  for t in .gpu/tests/*; do
    name=$(basename "$t"); log=$(mktemp)
    timeout "$lim" "$san" --tool "$tool" --target-processes all --print-limit 50 "$t" "$@" > "$log" 2>&1
    judge "$name" "$log" $?
    rm -f "$log"
  done
fi
if [ "$which" != rust ]; then
  log=$(mktemp)
  timeout "$lim" "$san" --tool "$tool" --target-processes all --print-limit 50 bash .gpu/run-pytest -m "gpu and not two_gpu" -q > "$log" 2>&1
  judge python "$log" $?
  rm -f "$log"
fi
echo "$tool: $clean clean, $dirty with errors, $broken failed or timed out"
[ "$dirty" -eq 0 ] && [ "$broken" -eq 0 ]
