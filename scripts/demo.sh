#!/usr/bin/env bash
# The main job: builds the project (scripts/setup.sh), then
#   1. a torchrun job of 2 ranks with backend "mooncake" that runs the collectives, checks
#      their results against gloo and prints a side-by-side timing table;
#   2. the two-process transfer-engine demo (shm and tcp: write, read back, notify).
# Extra arguments go to the torch demo (e.g. --quick). Works from any directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
# mooncake.run is torchrun (torch.distributed.run) made to work with Debian's torch builds:
# it repairs torch 1.13's parser of the default --redirects/--tee (Python 3.11), and sets
# USE_LIBUV=0 for a torch built without libuv (Debian 13's 2.6). On a torch 2.x wheel it is
# plain torchrun.
echo "== torch.distributed backend \"mooncake\" vs gloo (torchrun, 2 ranks) =="
/usr/bin/python3 -m mooncake.run --nproc_per_node 2 --master_addr 127.0.0.1 \
  --master_port "$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
  scripts/demo_torch.py "$@"
echo
echo "== transfer engine: two processes over shm and tcp =="
build/benchmarks/te_demo
