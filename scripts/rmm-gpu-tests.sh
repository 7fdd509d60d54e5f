#!/usr/bin/env bash
# The RMM bridge's GPU tests (docs/rmm.md, "Running the GPU tests"), packed here for a GPU machine without a
# network:
#   scripts/rmm-gpu-tests.sh pack [DIR]    (default DIR: target/rmm-gpu)
# puts into DIR (and DIR.tgz): the pinned wheels' files and GoogleTest's sources (scripts/rmm-deps.sh, cached in
# target/rmm-bridge), RMM's cpp/tests at the commit the librmm-cu13 26.10.0 wheel was built from, a release
# libmempool_capi.so, mempool's headers, the tests' sources and Makefile (crates/mempool-capi/tests/rmm), and
# DIR/run. On the GPU machine (g++, make and a CUDA 13 driver; no toolkit, no CMake, no network):
#   bash DIR/run             builds bridge_tests and rmm_typed_tests there and runs them (one GPU: all but
#                            TwoGpu.*; TWO_GPU=1: those too)
#   bash DIR/run-bench [ARGS] the C++ benchmark (bench_device_buffer: RMM's resources against the bridge's)
#   bash DIR/run-python      installs RMM's Python wheels, the bridge and mempool (.gpu/wheels of gpu-pack)
#                            into a scratch site and runs the bridge's Python GPU tests, then RMM's own
#                            Python tests with mempool current (TWO_GPU=1: the two-GPU test too)
# RMM's tests come from GitHub (an archive of the commit), or from RMM_SOURCE, a local clone of rapidsai/rmm
# (git archive), or from RMM_TESTS, a folder that already holds RMM's cpp/tests (then RMM's Python tests are
# not packed, and run-python says so). A commit other than the
# wheel's (RMM_COMMIT_OVERRIDE=...) is taken only when asked for, and BUILD-INFO and every run say so.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
usage() {
  echo "usage: scripts/rmm-gpu-tests.sh pack [DIR]   (then, on the GPU machine: bash DIR/run)" >&2
  exit 2
}
[ "${1:-}" = pack ] || usage
dir=${2:-target/rmm-gpu}
. scripts/rmm-deps.sh
cache=target/rmm-bridge
rmm_deps_fetch "$cache"
wheel_commit=$(cat "$cache/sdk/librmm/GIT_COMMIT")
[ "$wheel_commit" = "$RMM_COMMIT" ] || {
  echo "rmm-gpu-tests: the librmm wheel was built from $wheel_commit, scripts/rmm-deps.sh pins $RMM_COMMIT" >&2
  exit 1
}
commit=${RMM_COMMIT_OVERRIDE:-$RMM_COMMIT}
# RMM's Python tests that apply to any current resource (run under crates/mempool-py/rmm-bridge/rmm-tests/
# conftest.py, with mempool current).
RMM_PY_TESTS=(test_device_buffer.py test_cupy_integration.py test_rmm_pytorch.py test_lifecycle.py
  test_statistics.py test_helpers.py)

rm -rf "$dir"
mkdir -p "$dir/lib" "$dir/rmm-tests"
cp -a "$cache/sdk" "$dir/sdk"
cp -a "$cache/googletest" "$dir/googletest"
rm -rf "$dir/googletest/googlemock"

# RMM's tests: cpp/tests/mr and cpp/tests/byte_literals.hpp (what the typed suites include).
fetched=$(mktemp -d)
trap 'rm -rf "$fetched"' EXIT
if [ -n "${RMM_TESTS:-}" ]; then
  source_note="the folder $RMM_TESTS (commit not checked)"
  cp -a "$RMM_TESTS/mr" "$RMM_TESTS/byte_literals.hpp" "$dir/rmm-tests/"
else
  if [ -n "${RMM_SOURCE:-}" ]; then
    source_note="git archive $commit of $RMM_SOURCE"
    git -C "$RMM_SOURCE" archive "$commit" cpp/tests/mr cpp/tests/byte_literals.hpp VERSION \
      "${RMM_PY_TESTS[@]/#/python/rmm/rmm/tests/}" | tar -x -C "$fetched"
  else
    url="https://github.com/rapidsai/rmm/archive/$commit.tar.gz"
    source_note="$url"
    if ! curl -fsSL --retry 2 -o "$fetched/rmm.tar.gz" "$url"; then
      echo "rmm-gpu-tests: could not download RMM's sources ($url); give RMM_SOURCE=<a clone of rapidsai/rmm>" >&2
      echo "  or RMM_TESTS=<RMM's cpp/tests> instead" >&2
      exit 1
    fi
    tar -x -C "$fetched" --strip-components=1 -f "$fetched/rmm.tar.gz" \
      "rmm-$commit/cpp/tests/mr" "rmm-$commit/cpp/tests/byte_literals.hpp" "rmm-$commit/VERSION" \
      "${RMM_PY_TESTS[@]/#/rmm-$commit/python/rmm/rmm/tests/}"
  fi
  echo "RMM's tests: version $(cat "$fetched/VERSION"), from $source_note"
  cp -a "$fetched/cpp/tests/mr" "$fetched/cpp/tests/byte_literals.hpp" "$dir/rmm-tests/"
  mkdir -p "$dir/python/rmm-tests"
  for f in "${RMM_PY_TESTS[@]}"; do cp "$fetched/python/rmm/rmm/tests/$f" "$dir/python/rmm-tests/"; done
fi
for f in cccl_mr_ref_test_basic.hpp cccl_mr_ref_test_allocation.hpp cccl_mr_ref_test_mt.hpp; do
  [ -f "$dir/rmm-tests/mr/$f" ] || { echo "rmm-gpu-tests: RMM's tests lack mr/$f" >&2; exit 1; }
done

cargo build -q --release -p mempool-capi
target_dir=${CARGO_TARGET_DIR:-$root/target}
cp "$target_dir/release/libmempool_capi.so" "$dir/lib/"
# Smaller to carry: no symbols in the library, no static CUDA libraries (nothing here links them).
strip --strip-unneeded "$dir/lib/libmempool_capi.so"
rm -f "$dir"/sdk/cuda/lib/*.a
cp -a crates/mempool-capi/include "$dir/include"
mkdir -p "$dir/src"
cp crates/mempool-capi/tests/rmm/*.cpp crates/mempool-capi/tests/rmm/Makefile "$dir/src/"
{
  echo "mempool commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- crates/mempool-capi || echo ' (with local changes)')"
  echo "librmm wheel commit: $wheel_commit"
  echo "RMM tests: commit $commit from $source_note"
  [ "$commit" = "$RMM_COMMIT" ] || echo "NOTE: RMM's tests are NOT at the wheel's commit"
  printf 'pinned: %s\n' "${RMM_WHEELS[@]}" "$RMM_GTEST_DEB"
} >"$dir/BUILD-INFO"
# The Python half: the bridge's wheel (abi3), RMM's Python wheels for the GPU machine's CPython 3.12 (and
# cuda-pathfinder and the CUDA runtime, should the machine lack them; cuda-bindings it has, with cuda-core
# and numba-cuda), the project's tests and the fixture for RMM's tests.
mkdir -p "$dir/python/wheels" "$dir/python/tests"
[ -x target/rmm-py/bin/python ] || python3 -m venv target/rmm-py
scripts/build-rmm-bridge.sh target/rmm-py/bin/python "$dir/python/wheels" >/dev/null
if ! log=$(python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir/python/wheels" \
    rmm-cu13==26.10.0 librmm-cu13==26.10.0 rapids-logger==0.3.0 cuda-pathfinder==1.9.1 \
    nvidia-cuda-runtime==13.0.96 2>&1); then
  echo "rmm-gpu-tests: could not download RMM's Python wheels:" >&2
  echo "$log" | tail -5 >&2
  exit 1
fi
cp crates/mempool-py/rmm-bridge/tests/*.py "$dir/python/tests/"
cp docs/rmm.md "$dir/python/tests/rmm.md"
mkdir -p "$dir/python/rmm-tests"
cp crates/mempool-py/rmm-bridge/rmm-tests/conftest.py "$dir/python/rmm-tests/"
cp crates/mempool-py/rmm-bridge/run-python "$dir/run-python"
chmod +x "$dir/run-python"

cat >"$dir/run" <<'EOF'
#!/usr/bin/env bash
# Builds and runs the RMM bridge's GPU tests from this folder (scripts/rmm-gpu-tests.sh made it).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cat "$here/BUILD-INFO"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
echo "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(nproc) cores)"
args=(SDK="$here/sdk" GTEST="$here/googletest" RMM_TESTS="$here/rmm-tests" MEMPOOL_LIB="$here/lib"
  MEMPOOL_INCLUDE="$here/include" OUT="$here/build")
make -s -C "$here/src" -j"$(nproc)" gpu "${args[@]}" || { echo "0 passed, 1 failed (the build)"; exit 1; }
passed=0 failed=0
filter=--gtest_filter=-TwoGpu.*
[ -n "${TWO_GPU:-}" ] && filter=--gtest_filter=*
for t in bridge_tests rmm_typed_tests; do
  f=$filter
  [ "$t" = bridge_tests ] || f=--gtest_filter=*
  echo "== $t $f"
  if "$here/build/$t" "$f" --gtest_color=no; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "test binaries: $passed passed, $failed failed"
[ "$failed" = 0 ]
EOF
chmod +x "$dir/run"
cat >"$dir/run-bench" <<'EOF'
#!/usr/bin/env bash
# rmm::device_buffer on the standard random workload: RMM's pool, binning and async against mempool's through
# the bridge, in one run (docs/rmm.md, "Measured"). Arguments go to bench_device_buffer (--points, --repeats,
# --only).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cat "$here/BUILD-INFO"
echo "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(nproc) cores)"
make -s -C "$here/src" -j"$(nproc)" "$here/build/bench_device_buffer" SDK="$here/sdk" GTEST="$here/googletest" \
  RMM_TESTS="$here/rmm-tests" MEMPOOL_LIB="$here/lib" MEMPOOL_INCLUDE="$here/include" OUT="$here/build" || exit 1
echo "command: bench_device_buffer $*"
"$here/build/bench_device_buffer" "$@"
EOF
chmod +x "$dir/run-bench"
tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
du -sh "$dir" "$dir.tgz"
echo "packed $dir (and $dir.tgz, to carry); on the GPU machine: bash $dir/run (C++; TWO_GPU=1 for the"
echo "two-GPU tests too) and bash $dir/run-python (Python; needs .gpu/wheels from gpu-pack for mempool itself)"
