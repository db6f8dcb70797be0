#!/usr/bin/env bash
# Installs the `mooncake` package with pip (`pip install .`) into a Python environment, reusing
# an already-built CMake build directory, so that `python -c "import mooncake"` and the console
# scripts (mooncake_master, mooncake-kv-size, mooncake-hitrate) work from any directory.
#
# Usage: scripts/install_python.sh [--python PY] [BUILD_DIR]
#   PY         the interpreter to install into (default /usr/bin/python3, Debian's); a venv's
#              python installs into that venv
#   BUILD_DIR  the CMake build directory to package (default <repo>/build)
#
# Debian's own Python is "externally managed" (PEP 668): pip refuses to install into it unless
# told --break-system-packages. This script passes that flag only for that interpreter (as
# root, pip then installs into /usr/local/lib/python3.*/dist-packages and /usr/local/bin,
# which Debian leaves to the administrator; it never touches Debian's /usr/lib/python3).
# Offline: --no-index, and the build backend needs nothing from an index (docs/install.md).
# Idempotent: when the installed copy was built from the same sources and binaries (the
# fingerprint the wheel records), it does nothing. It removes the mooncake.pth that older
# versions of this script wrote (a path into one checkout's build/python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=/usr/bin/python3
BUILD=""
while (($#)); do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --python=*) PY="${1#*=}"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) BUILD="$1"; shift ;;
  esac
done
BUILD="$(cd "${BUILD:-$ROOT/build}" && pwd)"

fp="$("$PY" "$ROOT/build_backend/mooncake_build.py" fingerprint "$BUILD")"
# The fingerprint of what is installed now (none: empty), seen from a neutral directory.
installed="$(cd / && env -u PYTHONPATH "$PY" -c '
import json, importlib.metadata as m
try:
    d = m.distribution("mooncake")
    print(json.loads(d.read_text("mooncake_build.json") or "{}").get("fingerprint", ""))
except Exception:
    print("")' 2>/dev/null || true)"

if [[ "$installed" != "$fp" ]]; then
  # --no-deps: torch and the rest come from apt, not pip. pip would otherwise walk torch's own
  # requirements, and Debian 13's torch 2.6 metadata pins sympy==1.13.1 while Debian ships
  # 1.13.3: offline, pip cannot reconcile that (docs/install.md).
  args=(--no-index --no-deps --quiet --disable-pip-version-check
        --config-settings "build-dir=$BUILD" --config-settings jobs=2)
  # PEP 668: the interpreter's stdlib folder holds EXTERNALLY-MANAGED unless it is a venv.
  if "$PY" -c '
import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(marker) else 1)'; then
    args+=(--break-system-packages)
  fi
  [[ "$(id -u)" == 0 ]] && args+=(--root-user-action=ignore)
  t0=$SECONDS
  if ! "$PY" -m pip install "${args[@]}" "$ROOT"; then
    echo "install_python: pip install failed; see it with:" >&2
    echo "  $PY -m pip install -v ${args[*]} $ROOT" >&2
    exit 1
  fi
  changed=1
else
  changed=0
fi

# The .pth of the old install method (a path into one checkout's build/python, written into
# the interpreter's install directory) would put that checkout on sys.path too. Only the
# target interpreter's own install directory is looked at (a venv's, never the system's),
# and only a mooncake.pth that points at a built package is removed.
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ -f "$site/mooncake.pth" ]]; then
  target="$(head -n1 "$site/mooncake.pth")"
  if compgen -G "$target/mooncake/_C*.so" >/dev/null; then
    rm -f "$site/mooncake.pth"
    echo "install_python: removed $site/mooncake.pth (the old install: a path to $target)"
  fi
fi

# Prove it from a neutral directory with a clean environment (quiet unless it changed).
where="$(cd / && env -u PYTHONPATH "$PY" -c \
  'import mooncake, torch.distributed as d; assert "MOONCAKE" in d.Backend._plugins; print(mooncake.__file__)' \
  2>/dev/null)" || {
  echo "install_python: 'import mooncake' fails after installing into $PY:" >&2
  (cd / && env -u PYTHONPATH "$PY" -c 'import mooncake') >&2 || true
  exit 1
}
case "$where" in
  "$ROOT"/torch_ext/*|"$BUILD"/*)
    echo "install_python: $PY imports mooncake from the checkout ($where), not the install" >&2
    exit 1 ;;
esac
if [[ "$changed" == 1 ]]; then
  echo "install_python: pip-installed mooncake into $PY in $((SECONDS - t0))s (import mooncake: $where)"
fi
