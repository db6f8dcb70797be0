#!/usr/bin/env bash
# Builds the project (scripts/setup.sh), then runs the two-process transfer-engine demo:
# for shm and then tcp, write a pattern into a peer process's buffer, read it back, check
# it byte for byte, round-trip notifications, and print what was measured.
# Extra arguments go to te_demo (e.g. --bytes 16M). Works from any directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
exec build/benchmarks/te_demo "$@"
