#!/usr/bin/env bash
# The GPU tests (each crate's `gpu` feature; docs/testing.md), two ways:
#
#   scripts/gpu-tests.sh run [CARGO TEST ARGS...]
#       On a machine with a GPU and a Rust toolchain: cargo test --workspace --features gpu [ARGS].
#
#   scripts/gpu-tests.sh pack [DIR]
#       On a machine without a GPU: builds every test binary with the `gpu` feature in release mode
#       (cargo test --workspace --features gpu --release --no-run), the mempool-bench binary and the
#       examples, and bundles them in DIR (default .gpu/, ignored by git) with a runner. Copy DIR to a
#       machine with a GPU (same OS and CPU architecture; it needs the NVIDIA driver, no Rust) and run
#
#           DIR/run-tests [FILTER...]
#
#       which runs every bundled test binary (FILTER and other arguments go to each, as to
#       `cargo test`), prints each binary's counts and failures, and ends with 'N passed, N failed'
#       (exit status 0 only when nothing failed). With GPU_TESTS_LOGS=FOLDER it also keeps each
#       binary's full output there.
#
# Without a GPU the GPU tests fail (they never skip); the host tests in the same binaries pass.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

pack() {
  local dir=${1:-.gpu}
  # Only ever replace a bundle this script made: never delete a directory of anything else.
  if [ -e "$dir" ] && [ ! -f "$dir/BUILD-INFO" ]; then
    echo "gpu-tests.sh: $dir exists and is not a bundle of this script (no BUILD-INFO); refusing to replace it" >&2
    exit 2
  fi
  rm -rf "$dir"
  mkdir -p "$dir/tests" "$dir/bin"
  local list
  list=$(mktemp)
  trap 'rm -f "$list"' RETURN

  # Test binaries: one per test target and per library or binary with unit tests.
  cargo test --workspace --features gpu --release --no-run --message-format=json > "$list"
  python3 - "$list" "$dir/tests" <<'EOF'
import json, os, shutil, sys
names = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    # A package id is `path+file:///.../mempool-core#0.1.0`, or `...#mempool@0.1.0` when the name is
    # not the folder's.
    url, _, fragment = m["package_id"].partition("#")
    package = fragment.split("@")[0] if "@" in fragment else url.rstrip("/").rsplit("/", 1)[-1]
    kind, target = m["target"]["kind"][0], m["target"]["name"]
    # mempool-core-gpu (tests/gpu.rs or tests/gpu/main.rs), mempool-core-lib (its unit tests), mempool-bench-bin, ...
    name = f"{package}-{target}" if kind == "test" else f"{package}-{kind}"
    if name in names:
        sys.exit(f"gpu-tests: two test binaries named {name}")
    names.add(name)
    shutil.copy2(m["executable"], os.path.join(sys.argv[2], name))
print(f"gpu-tests: {len(names)} test binaries")
EOF

  # The bench binary (its host tests run it from DIR/bin) and the examples.
  cargo build --workspace --release --bins --examples --message-format=json > "$list"
  python3 - "$list" "$dir/bin" <<'EOF'
import json, os, shutil, sys
n = 0
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and not m["profile"]["test"]:
        shutil.copy2(m["executable"], os.path.join(sys.argv[2], os.path.basename(m["executable"])))
        n += 1
print(f"gpu-tests: {n} binaries and examples")
EOF
  # Debug info is for this machine's debugger; the bundle keeps symbols (backtraces name functions).
  if command -v strip > /dev/null; then
    strip --strip-debug "$dir"/tests/* "$dir"/bin/*
  fi

  {
    echo "commit: $(git rev-parse HEAD 2> /dev/null || echo unknown)$(git diff --quiet HEAD 2> /dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(uname -m), $(rustc --version)"
    echo "command: cargo test --workspace --features gpu --release --no-run"
  } > "$dir/BUILD-INFO"

  cat > "$dir/run-tests" <<'EOF'
#!/usr/bin/env bash
# Runs every bundled GPU test binary (arguments go to each, as to `cargo test`); ends with
# 'N passed, N failed'. GPU_TESTS_LOGS=FOLDER keeps each binary's output. See scripts/gpu-tests.sh.
cd "$(dirname "$0")"
cat BUILD-INFO
nvidia-smi -L 2> /dev/null || echo "nvidia-smi: not found"
passed=0
failed=0
for t in tests/*; do
  name=$(basename "$t")
  log=$(mktemp)
  "./$t" "$@" > "$log" 2>&1
  rc=$?
  [ -n "${GPU_TESTS_LOGS:-}" ] && cp "$log" "$GPU_TESTS_LOGS/$name.log"
  # A binary prints one 'test result:' line; its counts are what we add up.
  result=$(grep -E '^test result:' "$log" | tail -1)
  p=$(echo "$result" | sed -nE 's/.* ([0-9]+) passed.*/\1/p')
  f=$(echo "$result" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
  if [ -z "$result" ]; then
    # It died before reporting (a crash, an abort): one failure, and its last words.
    failed=$((failed + 1))
    echo "== $name: no result (exit status $rc)"
    tail -20 "$log"
  else
    passed=$((passed + ${p:-0}))
    failed=$((failed + ${f:-0}))
    echo "== $name: ${p:-0} passed, ${f:-0} failed"
    if [ "${f:-0}" != 0 ] || [ "$rc" != 0 ]; then
      [ "${f:-0}" = 0 ] && failed=$((failed + 1)) # all passed, yet a failing exit status
      grep -E -A12 '^---- |panicked' "$log" | head -80
    fi
  fi
  rm -f "$log"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
EOF
  chmod +x "$dir/run-tests"
  echo "gpu-tests: $dir is $(du -sm "$dir" | cut -f1) MiB; on a GPU machine run: $dir/run-tests"
}

case "${1:-}" in
  run)
    shift
    exec cargo test --workspace --features gpu "$@"
    ;;
  pack)
    shift
    [ $# -le 1 ] || usage
    pack "$@"
    ;;
  *) usage ;;
esac
