#!/usr/bin/env bash
# The GPU machine's check (issue 11): builds the engine (without rdma and hwloc) against the
# CUDA driver API's header and runs on the GPU (MC_DEVICE=cuda) tests/gpu/device_check --
# allocation and pointer attributes, copies and events, dma-buf export, an IPC handle opened by
# a second process, the device's own 64 MiB device-to-device copy rate -- and
# tests/gpu/engine_check: two processes' engines move 64 MiB GPU to GPU over the cuda transport
# and back, and a notification follows a write not waited for -- and tests/gpu/pg_check: a
# 2-rank process group's allreduce, allgather, alltoall, broadcast and reduce_scatter on 16 MiB
# of GPU memory (staged through host memory), checked and allreduce timed against host
# buffers. Log and JSON go to $OUT
# (the device tool's output folder) or $GPU_CHECK_BUILD/out (default build-gpu-check/).
#
# It needs a C++17 compiler and the CUDA toolkit's include/ only: the GPU machine has no
# protobuf or googletest, so this does not configure the whole project. What it does not run
# yet: CUDA tensors through torch (the backend refuses them), the store (it needs protobuf),
# rdma.
#
#   scripts/gpu_check.sh          on the GPU machine
#   scripts/gpu_check.sh --sim    a dry run anywhere: the same build, over the host simulation
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEVICE=cuda
[[ "${1:-}" == "--sim" ]] && DEVICE=sim
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
B="${GPU_CHECK_BUILD:-$ROOT/build-gpu-check}"
OUT="${OUT:-$B/out}"
mkdir -p "$B/generated/mooncake" "$OUT"
cat > "$B/generated/mooncake/config.h" <<'H'
// Written by scripts/gpu_check.sh: the device layer with CUDA, nothing else.
#pragma once
#define MC_HAVE_CUDA 1
#define MC_HAVE_RDMA 0
#define MC_HAVE_TORCH 0
#define MC_HAVE_HWLOC 0
H
CXX="${CXX:-g++}"
FLAGS=(-std=c++17 -O2 -Wall -I"$ROOT" -I"$B/generated" -I"$CUDA_HOME/include")
t0=$SECONDS
# The engine without rdma and hwloc (nothing but libc, libdl, pthreads), one object per source.
mkdir -p "$B/obj"
SRCS=$(ls engine/*.cc engine/transport/table.cc engine/transport/shm/*.cc \
          engine/transport/tcp/*.cc engine/transport/cuda/*.cc engine/device/*.cc |
       grep -v mc_params_main.cc)
printf '%s\n' $SRCS | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" "$@" -c {} -o "'"$B"'/obj/$(echo {} | tr / _).o"' "$CXX" "${FLAGS[@]}" \
  2>&1 | tee "$OUT/build.log"
rm -f "$B/libmc_engine.a"
ar rcs "$B/libmc_engine.a" "$B"/obj/*.o
# The process group (its portable reduction kernels only: no AVX2 copies), for pg_check.
mkdir -p "$B/pgobj"
ls pg/*.cc pg/algorithms/*.cc | grep -v _avx2.cc | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" "$@" -c {} -o "'"$B"'/pgobj/$(echo {} | tr / _).o"' "$CXX" "${FLAGS[@]}" \
  2>&1 | tee -a "$OUT/build.log"
rm -f "$B/libmc_pg.a"
ar rcs "$B/libmc_pg.a" "$B"/pgobj/*.o
for check in device_check engine_check pg_check; do
  "$CXX" "${FLAGS[@]}" "tests/gpu/$check.cc" "$B/libmc_pg.a" "$B/libmc_engine.a" -o "$B/$check" \
    -ldl -lpthread -lrt 2>&1 | tee -a "$OUT/build.log"
done
echo "gpu_check: built in $((SECONDS - t0)) s" | tee -a "$OUT/build.log"

set +e
{
  echo "gpu_check: MC_DEVICE=$DEVICE, $(date -u +%FT%TZ), $(uname -n)"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "(no nvidia-smi)"; fi
  r=0
  MC_DEVICE="$DEVICE" "$B/device_check" --json "$OUT/device_check.json" || r=$?
  MC_DEVICE="$DEVICE" timeout 300 "$B/engine_check" | tee "$OUT/engine_check.json" || r=$?
  MC_DEVICE="$DEVICE" timeout 300 "$B/pg_check" | tee "$OUT/pg_check.json" || r=$?
  exit "$r"
} 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e
if ((rc == 0)); then
  echo "gpu_check: OK ($DEVICE)" | tee -a "$OUT/gpu_check.log"
else
  echo "gpu_check: FAILED ($DEVICE, rc=$rc)" | tee -a "$OUT/gpu_check.log"
fi
exit "$rc"
