#!/usr/bin/env bash
# Downloads the wheels of scripts/dask-wheels.lock (dask-cuda 26.10.0, dask and distributed 2026.7.1, what
# they need, pytest and pytest-timeout) for CPython 3.12 on x86-64 Linux into DIR (default .dask-wheels/, ignored by git),
# for the GPU machine, which has no network: carry DIR with the tree and run scripts/dask-gpu-tests.sh there.
#
#   scripts/dask-wheels.sh [DIR]
#
# Exactly the locked versions, no resolving (pip download --no-deps); then a dry-run install from DIR alone
# checks that the set is complete for dask-cuda on CPython 3.12. NumPy is left out by default (the GPU
# machine's CuPy and PyTorch bring their own, and it is the largest wheel): DASK_WHEELS_SKIP lists the names
# to leave out (default "numpy"; set it empty to download everything). Needs python3 with pip, and PyPI.
# Put the mempool wheel in DIR too (a release build, for the benchmarks):
#
#   (cd crates/mempool-py && maturin build --release -o ../../.dask-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.dask-wheels}
skip=${DASK_WHEELS_SKIP-numpy}
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
grep -v '^#' scripts/dask-wheels.lock | grep -v '^$' | while read -r line; do
  name=${line%%==*}
  for s in $skip; do
    [ "$name" = "$s" ] && continue 2
  done
  echo "$line"
done > "$reqs"
mkdir -p "$dir"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --disable-pip-version-check --no-deps "${platform[@]}" -r "$reqs" -d "$dir"
# Complete? Resolve dask-cuda and pytest from DIR alone for CPython 3.12 tags (Requires-Python is not
# checked: this python3 may be older; the tags are 3.12's). What DASK_WHEELS_SKIP leaves out,
# fetched into a scratch folder just for this check, stands for what the GPU machine has installed.
scratch=$(mktemp -d)
trap 'rm -f "$reqs"; rm -rf "$scratch"' EXIT
for s in $skip; do
  grep "^$s==" scripts/dask-wheels.lock >> "$scratch/skipped.txt" || true
done
if [ -s "$scratch/skipped.txt" ]; then
  python3 -m pip download -q --disable-pip-version-check --no-deps "${platform[@]}" -r "$scratch/skipped.txt" \
    -d "$scratch/skipped"
fi
python3 -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --ignore-requires-python --no-index \
  --find-links "$dir" --find-links "$scratch/skipped" "${platform[@]}" --target "$scratch/target" \
  dask-cuda==26.10.0 dask==2026.7.1 distributed==2026.7.1 pytest pytest-timeout \
  || { echo "dask-wheels.sh: the wheels in $dir do not install dask-cuda on CPython 3.12 (above)" >&2; exit 1; }
n=$(ls "$dir"/*.whl | wc -l)
size=$(du -sm "$dir" | cut -f1)
echo "dask-wheels.sh: $n wheels, ${size} MiB in $dir"
if [ "$size" -gt 60 ]; then
  echo "dask-wheels.sh: more than 60 MiB: a carry to the GPU machine may not take it all" >&2
fi
