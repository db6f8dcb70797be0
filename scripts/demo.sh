#!/usr/bin/env bash
# The main job: builds and installs the project (scripts/setup.sh), then
#   1. a torchrun job of 2 ranks with backend "mooncake" that runs the collectives, checks
#      their results against gloo and prints a side-by-side timing table; then, on the same
#      group and engine, KV-cache offload through mooncake.store (a second request with the
#      same system prompt reloads the first one's KV blocks from the other rank's memory:
#      time to first token with and without the cache, logits compared) and one MoE
#      dispatch/combine round through mooncake.ep (scripts/demo_serving.py);
#   2. the two-process transfer-engine demo (shm and tcp: write, read back, notify).
# Works from any directory.
#
# Usage: scripts/demo.sh [--python PY] [demo_torch.py arguments, e.g. --quick]
#   --python PY  run with an interpreter that already has mooncake installed (a venv, see
#                docs/install.md): nothing is installed, only build/'s te_demo is brought up
#                to date (build/ must be configured: scripts/setup.sh --no-install).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY=/usr/bin/python3
INSTALLED=0
if [[ "${1:-}" == "--python" ]]; then
  PY="$2"
  INSTALLED=1
  shift 2
fi

if ((INSTALLED)); then
  if ! where="$(cd / && env -u PYTHONPATH "$PY" -c 'import mooncake; print(mooncake.__file__)')"; then
    echo "demo: $PY cannot import mooncake; install it first (docs/install.md)" >&2
    exit 1
  fi
  if [[ ! -f build/build.ninja ]]; then
    echo "demo: build/ is not configured; run scripts/setup.sh --no-install" >&2
    exit 1
  fi
  ninja -C build -j2 --quiet te_demo
  echo "demo: mooncake from $where"
else
  bash scripts/setup.sh
fi
t0=$SECONDS
# mooncake.run is torchrun (torch.distributed.run) made to work with Debian's torch builds:
# it repairs torch 1.13's parser of the default --redirects/--tee (Python 3.11), and sets
# USE_LIBUV=0 for a torch built without libuv (Debian 13's 2.6). On a torch 2.x wheel it is
# plain torchrun.
echo "== torch.distributed backend \"mooncake\" vs gloo (torchrun, 2 ranks) =="
(cd / && env -u PYTHONPATH "$PY" -m mooncake.run --nproc_per_node 2 --master_addr 127.0.0.1 \
  --master_port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
  "$ROOT/scripts/demo_torch.py" "$@")
echo
echo "== transfer engine: two processes over shm and tcp =="
build/benchmarks/te_demo
echo
echo "demo: done in $((SECONDS - t0)) s after the build"
