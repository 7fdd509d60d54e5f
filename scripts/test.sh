#!/usr/bin/env bash
# The README's test command: the workspace's host tests (with the cudarc interop compiled in), the RMM
# bridge's host check (scripts/rmm-bridge-check.sh: the pinned librmm 26.10 wheel and its dependencies from
# PyPI, GoogleTest's sources from Debian, g++; docs/rmm.md), then the Python package's wheel build and host
# pytest suite (scripts/python-tests.sh), the self-test of the lock diagnostic that found issue 33's driver
# race (scripts/repro/lockwatch-selftest.sh), then the snapshot viewer's browser test (scripts/browser-tests.sh:
# headless Chromium, installed from the distribution's packages when missing). Needs a Rust toolchain, gcc
# and g++ (the C ABI's test, the RMM bridge), make, dpkg-deb and apt-get, python3 with its venv module and
# access to PyPI (maturin, pytest, the RMM wheels) and Debian's packages, and Chromium, or root or
# password-less sudo and apt-get to install it (README, "Quick start").
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --features cudarc
scripts/rmm-bridge-check.sh
scripts/python-tests.sh
scripts/repro/lockwatch-selftest.sh
scripts/browser-tests.sh
