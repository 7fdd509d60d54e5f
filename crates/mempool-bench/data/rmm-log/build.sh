#!/usr/bin/env bash
# Builds make_rmm_log (beside this script) against RMM 26.10's and rapids-logger's pip wheels.
#
#   bash crates/mempool-bench/data/rmm-log/build.sh WHEEL_DIR OUT_DIR
#   OUT_DIR/make_rmm_log LOG.csv            # needs a GPU
#
# WHEEL_DIR holds librmm_cu13-26.10.0-*.whl and rapids_logger-*.whl (the repository keeps them in .whl/,
# ignored by git). Needs nvcc (CUDA 13) in PATH and python3 (to unzip); no network. The wheels are
# unpacked into OUT_DIR/wheels and kept there: the program's rpath points at their libraries.
#
# RMM 26.10 needs C++20 and CCCL 3.5, which the wheel ships (include/rapids); those headers go before the
# toolkit's own CCCL (nvcc puts that after every -I, as a system include). The compile definitions are the
# ones RMM's CMake package gives its users (lib64/cmake/rmm/rmm-dependencies.cmake).
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 WHEEL_DIR OUT_DIR" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
wheels="$(cd "$1" && pwd)"
mkdir -p "$2"
out="$(cd "$2" && pwd)"

command -v nvcc >/dev/null || { echo "nvcc is not in PATH" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is not in PATH" >&2; exit 1; }

one() { # the one file matching a pattern
  local matches=("$wheels"/$1)
  if [ ! -e "${matches[0]}" ] || [ ${#matches[@]} -ne 1 ]; then
    echo "expected one $1 in $wheels, found: ${matches[*]}" >&2
    exit 1
  fi
  echo "${matches[0]}"
}
rmm_whl="$(one 'librmm_cu13-26.10.*.whl')"
logger_whl="$(one 'rapids_logger-*.whl')"

rm -rf "$out/wheels"
mkdir -p "$out/wheels/librmm" "$out/wheels/rapids_logger"
python3 -m zipfile -e "$rmm_whl" "$out/wheels/librmm"
python3 -m zipfile -e "$logger_whl" "$out/wheels/rapids_logger"
rmm="$out/wheels/librmm/librmm"
logger="$out/wheels/rapids_logger/rapids_logger"
for f in "$rmm/include/rmm/mr/logging_resource_adaptor.hpp" "$rmm/lib64/librmm.so" \
         "$logger/include/rapids_logger/logger.hpp" "$logger/lib64/librapids_logger.so"; do
  [ -e "$f" ] || { echo "missing $f in the unpacked wheels" >&2; exit 1; }
done
echo "RMM $(cat "$rmm/VERSION") (commit $(cat "$rmm/GIT_COMMIT")), rapids-logger $(cat "$logger/VERSION")"

set -x
nvcc -std=c++20 -O2 \
  -I"$rmm/include/rapids" -I"$rmm/include" -I"$logger/include" \
  -DCUB_DISABLE_NAMESPACE_MAGIC -DCUB_IGNORE_NAMESPACE_MAGIC_ERROR \
  -DTHRUST_DISABLE_ABI_NAMESPACE -DTHRUST_IGNORE_ABI_NAMESPACE_ERROR -DCCCL_DISABLE_PDL \
  -o "$out/make_rmm_log" "$here/make_rmm_log.cu" \
  -L"$rmm/lib64" -L"$logger/lib64" -lrmm -lrapids_logger -ldl \
  -Xlinker -rpath -Xlinker "$rmm/lib64:$logger/lib64"
set +x
echo "built $out/make_rmm_log"
