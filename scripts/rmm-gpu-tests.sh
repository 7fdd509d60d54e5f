#!/usr/bin/env bash
# The RMM bridge's GPU tests (docs/rmm.md, "Running the GPU tests"), packed here for a GPU machine without a
# network:
#   scripts/rmm-gpu-tests.sh pack [DIR]    (default DIR: target/rmm-gpu)
# puts into DIR: the pinned wheels' files and GoogleTest's sources (scripts/rmm-deps.sh, cached in
# target/rmm-bridge), RMM's cpp/tests at the commit the librmm-cu13 26.10.0 wheel was built from, a release
# libmempool_capi.so, mempool's headers, the tests' sources and Makefile (crates/mempool-capi/tests/rmm), and
# DIR/run. On the GPU machine (g++, make and a CUDA 13 driver; no toolkit, no CMake, no network):
#   bash DIR/run             builds bridge_tests and rmm_typed_tests there and runs them (one GPU: all but
#                            TwoGpu.*; TWO_GPU=1: those too)
# RMM's tests come from GitHub (an archive of the commit), or from RMM_SOURCE, a local clone of rapidsai/rmm
# (git archive), or from RMM_TESTS, a folder that already holds RMM's cpp/tests. A commit other than the
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
    git -C "$RMM_SOURCE" archive "$commit" cpp/tests/mr cpp/tests/byte_literals.hpp VERSION | tar -x -C "$fetched"
  else
    url="https://github.com/rapidsai/rmm/archive/$commit.tar.gz"
    source_note="$url"
    if ! curl -fsSL --retry 2 -o "$fetched/rmm.tar.gz" "$url"; then
      echo "rmm-gpu-tests: could not download RMM's sources ($url); give RMM_SOURCE=<a clone of rapidsai/rmm>" >&2
      echo "  or RMM_TESTS=<RMM's cpp/tests> instead" >&2
      exit 1
    fi
    tar -x -C "$fetched" --strip-components=1 -f "$fetched/rmm.tar.gz" \
      "rmm-$commit/cpp/tests/mr" "rmm-$commit/cpp/tests/byte_literals.hpp" "rmm-$commit/VERSION"
  fi
  echo "RMM's tests: version $(cat "$fetched/VERSION"), from $source_note"
  cp -a "$fetched/cpp/tests/mr" "$fetched/cpp/tests/byte_literals.hpp" "$dir/rmm-tests/"
fi
for f in cccl_mr_ref_test_basic.hpp cccl_mr_ref_test_allocation.hpp cccl_mr_ref_test_mt.hpp; do
  [ -f "$dir/rmm-tests/mr/$f" ] || { echo "rmm-gpu-tests: RMM's tests lack mr/$f" >&2; exit 1; }
done

cargo build -q --release -p mempool-capi
target_dir=${CARGO_TARGET_DIR:-$root/target}
cp "$target_dir/release/libmempool_capi.so" "$dir/lib/"
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
du -sh "$dir"
echo "packed $dir; on the GPU machine: bash $dir/run (TWO_GPU=1 for the two-GPU tests too)"
