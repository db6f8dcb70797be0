#!/usr/bin/env bash
# Installs what the build needs (Debian packages, only the missing ones), configures and
# builds the project into build/, then pip-installs the `mooncake` package from that build
# into Debian's Python (scripts/install_python.sh). Idempotent and quiet when everything is
# in place. Works from any directory.
# Usage: scripts/setup.sh [--no-install]   (--no-install: build only, leave Python alone)
set -euo pipefail

INSTALL=1
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    *) echo "usage: scripts/setup.sh [--no-install]" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PACKAGES=(
  build-essential cmake ninja-build pkgconf ccache
  libgtest-dev libgmock-dev
  python3-torch python3-pytest python3-numpy pybind11-dev python3-pybind11
  libprotobuf-dev protobuf-compiler libcpp-httplib-dev libre2-dev pkg-config
  nlohmann-json3-dev etcd-server etcd-client
  redis-server python3-redis
  python3-mpi4py openmpi-bin libopenmpi-dev
  python3-matplotlib python3-tqdm
  python3-pip python3-venv
  libibverbs-dev libhwloc-dev
  iproute2
)

missing=()
for p in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)"
  [[ "$status" == "installed" ]] || missing+=("$p")
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  SUDO=()
  if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO=(sudo)
    else
      echo "setup: missing packages (${missing[*]}) and not root; install them and re-run" >&2
      exit 1
    fi
  fi
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# Configure once; after that ninja re-runs cmake by itself whenever a CMakeLists.txt or
# *.cmake file changes (configuring again by hand would cost ~10 s: it imports torch to
# detect MC_WITH_TORCH). The log is shown only when configuring fails.
# Compiles go through ccache (CCACHE_DIR, default ~/.cache/ccache), with paths hashed relative
# to the checkout and the build directory's own path left out of the hash: a second clone on
# the same machine, wherever it is (CI's clean clone), compiles only what differs. (The price:
# an object taken from the cache names the directory of the clone that compiled it first in
# its debug info. MOONCAKE_CCACHE=0 configures without ccache.)
LAUNCHER=()
if [[ "${MOONCAKE_CCACHE:-1}" != 0 ]] && command -v ccache >/dev/null; then
  LAUNCHER=("-DCMAKE_C_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$ROOT;CCACHE_NOHASHDIR=1;ccache"
            "-DCMAKE_CXX_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$ROOT;CCACHE_NOHASHDIR=1;ccache")
fi
if [[ ! -f build/build.ninja || ! -f build/CMakeCache.txt ]]; then
  mkdir -p build
  if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${LAUNCHER[@]}" \
      >build/configure.log 2>&1; then
    cat build/configure.log >&2
    echo "setup: cmake configure failed (log: build/configure.log)" >&2
    exit 1
  fi
  grep -m1 'mooncake: MC_WITH' build/configure.log || true
fi
ninja -C build -j2 --quiet

# The `mooncake` package: `pip install .` into /usr/bin/python3, packaging the build above
# (no second compile); a no-op when the installed copy is already this build's.
if ((INSTALL)); then
  bash scripts/install_python.sh build
fi
