# Sourced by scripts/rmm-bridge-check.sh and scripts/rmm-gpu-tests.sh: what the RMM bridge is built against,
# pinned, fetched with the ordinary clients and kept under a cache folder (docs/rmm.md).
#
# rmm_deps_fetch DIR: DIR/downloads holds the files (checked against their SHA-256 here; a file already there
# with the right hash is not fetched again), DIR/sdk/{librmm,rapids_logger,cuda} the unpacked wheels and
# DIR/googletest GoogleTest's sources. Fails, saying which and why, when a registry cannot be reached.

# name version sha256-of-the-file; the wheels are the manylinux x86_64 ones pip picks for CPython 3.12.
RMM_WHEELS=(
  "librmm-cu13 26.10.0 39edcc7396f5291e95331089909b1e13e445fa2dbd4e7323992fb29fb04a5a1b"
  "rapids-logger 0.3.0 9d9094dd241c4e0f2d0c3bad448871e62f9b915e1ef65db41b0a1cf4473b1066"
  "nvidia-cuda-runtime 13.0.96 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
  "nvidia-cuda-crt 13.0.88 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
)
# GoogleTest from Debian's package of its sources (apt-get download: nothing is installed).
RMM_GTEST_DEB="googletest 1.12.1-0.2 927be72067517da503b6538026d451455c9e860f5dbfe237f792543db7d5a928"
# RMM's tests are taken at the commit the librmm-cu13 26.10.0 wheel was built from (its librmm/GIT_COMMIT).
RMM_COMMIT=5ab042503a8c01efa3dba058cbdc9405b84aacfb

_rmm_hash_ok() { # FILE SHA256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

_rmm_fetch_wheel() { # DOWNLOADS NAME VERSION SHA256
  local dl=$1 name=$2 version=$3 sha=$4 file
  file=$(ls "$dl"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$file" ] && _rmm_hash_ok "$file" "$sha"; then return 0; fi
  rm -f "$dl"/"${name//-/_}"-"$version"-*.whl
  local log
  if ! log=$(python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" "$name==$version" 2>&1); then
    echo "rmm-deps: could not download $name==$version from PyPI with pip (the RMM bridge's check needs PyPI," >&2
    echo "  as scripts/python-tests.sh does):" >&2
    echo "$log" | tail -5 >&2
    return 1
  fi
  file=$(ls "$dl"/"${name//-/_}"-"$version"-*.whl | head -1)
  if ! _rmm_hash_ok "$file" "$sha"; then
    echo "rmm-deps: $file has SHA-256 $(sha256sum "$file" | cut -d' ' -f1), not the pinned $sha" >&2
    return 1
  fi
}

_rmm_fetch_gtest() { # DOWNLOADS
  local dl=$1 name version sha
  read -r name version sha <<<"$RMM_GTEST_DEB"
  local file="$dl/${name}_${version}_all.deb"
  if _rmm_hash_ok "$file" "$sha"; then return 0; fi
  rm -f "$file"
  local as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo -n)
  if ! (cd "$dl" && apt-get download -q "$name=$version" >/dev/null 2>&1); then
    # The package lists may be missing or old on a fresh machine.
    "${as_root[@]}" apt-get update -q >/dev/null 2>&1 || true
    if ! (cd "$dl" && apt-get download -q "$name=$version" 2>&1 | tail -3 >&2); then
      echo "rmm-deps: could not download Debian's $name $version with apt-get download" >&2
      return 1
    fi
  fi
  if ! _rmm_hash_ok "$file" "$sha"; then
    echo "rmm-deps: $file is missing or has another SHA-256 than the pinned $sha" >&2
    return 1
  fi
}

_rmm_unzip() { # WHEEL DEST
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
}

rmm_deps_fetch() { # DIR
  local dir=$1 dl=$1/downloads
  mkdir -p "$dl"
  local entry name version sha
  for entry in "${RMM_WHEELS[@]}"; do
    read -r name version sha <<<"$entry"
    _rmm_fetch_wheel "$dl" "$name" "$version" "$sha" || return 1
  done
  _rmm_fetch_gtest "$dl" || return 1
  # Unpack once per set of pins (the stamp names them).
  local stamp
  stamp=$(printf '%s\n' "${RMM_WHEELS[@]}" "$RMM_GTEST_DEB" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$dir/.unpacked" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  rm -rf "$dir/sdk" "$dir/googletest" "$dir/unpack"
  mkdir -p "$dir/sdk" "$dir/unpack"
  for entry in "${RMM_WHEELS[@]}"; do
    read -r name version sha <<<"$entry"
    _rmm_unzip "$(ls "$dl"/"${name//-/_}"-"$version"-*.whl | head -1)" "$dir/unpack"
  done
  mv "$dir/unpack/librmm" "$dir/sdk/librmm"
  mv "$dir/unpack/rapids_logger" "$dir/sdk/rapids_logger"
  mv "$dir/unpack/nvidia/cu13" "$dir/sdk/cuda"
  rm -rf "$dir/unpack"
  # Wheels do not keep symlinks: the linker's name for libcudart.
  [ -e "$dir/sdk/cuda/lib/libcudart.so" ] || ln -s libcudart.so.13 "$dir/sdk/cuda/lib/libcudart.so"
  read -r name version sha <<<"$RMM_GTEST_DEB"
  dpkg-deb -x "$dl/${name}_${version}_all.deb" "$dir/unpack"
  mv "$dir/unpack/usr/src/googletest" "$dir/googletest"
  rm -rf "$dir/unpack"
  echo "$stamp" >"$dir/.unpacked"
}
