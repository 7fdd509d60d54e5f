#!/usr/bin/env bash
# The snapshot viewer's browser test (crates/mempool-rmm/tests/browser, docs/observe.md "Testing the viewer"):
# headless Chromium opens pages written from synthetic snapshots and pytest checks what they show. Installs
# Chromium from the distribution's packages when none is on PATH (Debian: chromium-headless-shell, else
# chromium; apt-get as root or through sudo), and pytest into the virtual environment under target/python-venv
# (the one scripts/python-tests.sh makes). Needs no GPU and no mempool wheel. MEMPOOL_CHROMIUM names another
# Chromium binary. Screenshots, the pages and the 1,000,000-event page's draw time land in target/browser/.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

find_chromium() {
  local b
  for b in "${MEMPOOL_CHROMIUM:-}" chromium-headless-shell chromium; do
    if [ -n "$b" ] && command -v "$b" >/dev/null 2>&1; then return 0; fi
  done
  return 1
}

if ! find_chromium; then
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo)
  else
    echo "browser-tests.sh: no Chromium on PATH (chromium-headless-shell or chromium), and it cannot install one:" >&2
    echo "  not root and no password-less sudo. Install it (Debian: apt-get install chromium-headless-shell)" >&2
    echo "  or set MEMPOOL_CHROMIUM to a Chromium binary." >&2
    exit 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser-tests.sh: no Chromium on PATH and no apt-get to install it from the distribution's packages;" >&2
    echo "  install chromium (headless) or set MEMPOOL_CHROMIUM to a Chromium binary." >&2
    exit 1
  fi
  echo "browser-tests.sh: installing Chromium from the distribution's packages" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -q
  # fonts-liberation: the screenshots' text (the packages only recommend a font)
  if apt-cache show chromium-headless-shell >/dev/null 2>&1; then pkg=chromium-headless-shell; else pkg=chromium; fi
  "${as_root[@]}" apt-get install -y -q --no-install-recommends "$pkg" fonts-liberation
  find_chromium || { echo "browser-tests.sh: installed $pkg but found no Chromium binary on PATH" >&2; exit 1; }
fi

venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check pytest
mkdir -p target/browser
cd /tmp
"$root/$venv/bin/python" -m pytest -p no:cacheprovider -s --rootdir "$root/crates/mempool-rmm/tests/browser" \
  "$root/crates/mempool-rmm/tests/browser" "$@"
