#!/usr/bin/env bash
# Installs the `mooncake` Python package into Debian's Python (/usr/bin/python3), so that
# `python3 -c "import mooncake"` works from any directory with no PYTHONPATH.
#
# How: the build tree holds an importable package at <build>/python/mooncake (the built
# _C*.so next to symlinks of torch_ext/python/mooncake/*.py); a mooncake.pth file in the
# interpreter's first site directory (/usr/local/lib/python3.11/dist-packages here) puts
# <build>/python on sys.path. Rebuilding updates the package in place; running this again
# is harmless (idempotent).
#
# Usage: scripts/install_python.sh [BUILD_DIR]     (default: <repo>/build)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
PY=/usr/bin/python3

BUILD="$(cd "$BUILD" && pwd)"
PKG="$BUILD/python/mooncake"
shopt -s nullglob
sos=("$PKG"/_C*.so)
if [ ${#sos[@]} -eq 0 ]; then
  echo "install_python: no $PKG/_C*.so; build it first: ninja -C $BUILD mooncake_python" >&2
  exit 1
fi

# CMake creates these links too; redo them so a new .py (ep.py, store.py) needs no reconfigure.
for f in "$ROOT"/torch_ext/python/mooncake/*.py; do
  ln -sfn "$f" "$PKG/$(basename "$f")"
done

SITE="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
mkdir -p "$SITE"
PTH="$SITE/mooncake.pth"
changed=0
if [ "$(cat "$PTH" 2>/dev/null || true)" != "$BUILD/python" ]; then
  printf '%s\n' "$BUILD/python" > "$PTH.tmp.$$"
  mv -f "$PTH.tmp.$$" "$PTH"
  changed=1
fi

# Prove it from a neutral directory with a clean environment (quiet unless it changed).
where="$(cd / && env -u PYTHONPATH "$PY" -c \
  'import mooncake, torch.distributed as d; assert "MOONCAKE" in d.Backend._plugins; print(mooncake.__file__)' \
  2>/dev/null)" || {
  echo "install_python: 'import mooncake' fails with $PTH -> $BUILD/python:" >&2
  (cd / && env -u PYTHONPATH "$PY" -c 'import mooncake') >&2 || true
  exit 1
}
if [ "$changed" = 1 ]; then
  echo "install_python: $PTH -> $BUILD/python (import mooncake: $where)"
fi
