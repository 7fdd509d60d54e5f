#!/usr/bin/env bash
# The RMM bridge's host check (docs/rmm.md, "What is verified where"), run by CI: no GPU, no CUDA toolkit.
# Fetches the pinned librmm-cu13 26.10.0, rapids-logger and CUDA 13 runtime wheels from PyPI and Debian's
# GoogleTest sources into target/rmm-bridge (once: later runs reuse them), builds libmempool_capi.so, then
# with g++ (crates/mempool-capi/tests/rmm/Makefile):
#   - include/mempool/rmm.hpp alone, as C++17, -Wall -Wextra -Werror -Wpedantic;
#   - host_check.cpp (C++20, as RMM 26.10 needs): the static_asserts of what RMM asks of a resource
#     (cuda::mr::resource_with<mempool::rmm_resource, cuda::mr::device_accessible>, any_resource,
#     device_async_resource_ref, device_buffer, device_uvector, set_current_device_resource), linked with
#     librmm and libmempool_capi and run: statuses to RMM's exceptions, the no-driver refusals;
#   - the GPU tests' sources (bridge_tests.cpp; rmm_typed_tests.cpp too when RMM_TESTS names RMM's
#     cpp/tests) and every ```cpp block of docs/rmm.md, with -fsyntax-only.
# A registry that cannot be reached fails the check, naming what could not be fetched: a check that skips
# itself when offline would pass without checking anything.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
. scripts/rmm-deps.sh
cache=target/rmm-bridge
rmm_deps_fetch "$cache"
target_dir=${CARGO_TARGET_DIR:-$root/target}
cargo build -q -p mempool-capi
# The CMake package's version is the workspace's.
cargo_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
grep -q "set(PACKAGE_VERSION \"$cargo_version\")" crates/mempool-capi/cmake/mempoolConfigVersion.cmake || {
  echo "rmm-bridge-check: crates/mempool-capi/cmake/mempoolConfigVersion.cmake is not at version $cargo_version" >&2
  exit 1
}
out=$root/$cache/build
mkdir -p "$out/snippets"
rm -f "$out"/snippets/*.cpp
# docs/rmm.md's C++ blocks, one file each.
awk -v dir="$out/snippets" '
  /^```cpp$/ { n++; file = sprintf("%s/rmm-md-%d.cpp", dir, n); inside = 1; next }
  /^```/ && inside { inside = 0; close(file); next }
  inside { print > file }
' docs/rmm.md
snippets=$(ls "$out"/snippets/*.cpp 2>/dev/null | tr '\n' ' ')
[ -n "$snippets" ] || { echo "rmm-bridge-check: docs/rmm.md has no cpp block" >&2; exit 1; }
make_args=(-s -C crates/mempool-capi/tests/rmm SDK="$root/$cache/sdk" GTEST="$root/$cache/googletest"
  MEMPOOL_LIB="$target_dir/debug" OUT="$out" SNIPPETS="$snippets" RMM_TESTS="${RMM_TESTS:+$(realpath "$RMM_TESTS")}")
make "${make_args[@]}" syntax
make "${make_args[@]}" host-check
