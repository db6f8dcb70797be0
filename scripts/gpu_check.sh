#!/usr/bin/env bash
# The GPU machine's check (issue 11): builds the engine (without rdma and hwloc) against the CUDA
# driver API's header and runs on the GPU (MC_DEVICE=cuda) tests/gpu/device_check -- allocation
# and pointer attributes, copies and events, dma-buf export, an IPC handle opened by a second
# process, the device's own 64 MiB device-to-device copy rate -- and tests/gpu/engine_check: two
# processes' engines move 64 MiB GPU to GPU over the cuda transport and back, and a notification
# follows a write not waited for -- and tests/gpu/pg_check: a 2-rank process group's allreduce,
# allgather, alltoall, broadcast and reduce_scatter on 16 MiB of GPU memory (through GPU comm
# halves, reduced by pg/device_reduce.cu, built here by nvcc), checked, GPU allreduces equal to
# host ones bit for bit, allreduce timed against host buffers (16 MiB; 64 KiB; each with its
# time by phase, pg/profile.h; once more with MC_DEVICE_SPIN_US=0, once more in 16 MiB steps),
# and a send/recv exchange that must go device to device -- and
# tests/gpu/ep_kernel_check: the EP low-latency kernels (ep/kernels/ll_kernels.cu) for 2-4
# ranks simulated on GPU 0 against a reference and bit for bit against the same bodies on the
# host, a silent rank marked inactive by the kernels' deadline or
# by its gone flag (host-mapped memory raised while they wait), normal-mode dispatch + combine (a
# stream per rank), and dispatch/combine timed at 128 x 7168 x top-8 -- and
# tests/gpu/torch_check.py: the torch backend (built here against the machine's torch as a module
# of its own) on CUDA tensors, 2 processes on GPU 0: every collective and send/recv checked, an op
# waits for the caller's stream, a Work's future, and all_reduce, all_gather, all_to_all timed 64
# KiB..256 MiB against the device-to-device copy rate, and mooncake.ep's low-latency dispatch/
# combine on a buffer in GPU memory (the kernels' entry point, ep/kernels/ll_entry.cu) equal
# bit for bit to a host buffer's on the same inputs, bf16 and fp8, a dispatch + combine
# captured with torch.cuda.graph and replayed on new inputs against the host buffer, timed at
# 128 x 7168 x top-8 with --bench. A module that carries libstdc++ code of its
# own is linked again against the libstdc++ torch's process runs on (the GPU machine's first run
# crashed on that); a crash in the torch check prints its native stack with the module's frames
# named, and a hang every thread's stack. The torch check runs twice: Work.wait() as shipped
# (blocking) with the timings, then Work.wait() as a stream gate (MC_PG_BLOCKING_WAIT=0); and,
# on CUDA, once more through the package itself, mooncake._C built by CMake without its tests.
# Log and JSON go to $OUT
# (the device tool's output folder) or $GPU_CHECK_BUILD/out (default build-gpu-check/).
#
# It needs a C++17 compiler and the CUDA toolkit's include/ only: the GPU machine has no
# protobuf or googletest, so this does not configure the whole project. What it does not run
# yet: the store (it needs protobuf), rdma, NCCL beside us (NCCL refuses two ranks on one GPU).
# GPU_CHECK_TORCH=0 skips the torch module; GPU_CHECK_BENCH=0 the torch timings; GPU_CHECK_GATE=0
# the torch check's second pass (Work.wait() as a stream gate); GPU_CHECK_ONLY=torch runs the
# torch check alone (a diagnosis); GPU_CHECK_TORCH_TIMEOUT (150 s) bounds each torch pass;
# GPU_CHECK_PACKAGE=0 skips the package (=1 builds it in a dry run too); with the package, the
# store's get_into a GPU buffer is timed (GPU_CHECK_STORE=0 skips it).
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
# -fPIC: the torch check's module links the same archives.
FLAGS=(-std=c++17 -O2 -Wall -fPIC -I"$ROOT" -I"$B/generated" -I"$CUDA_HOME/include")
# Compiles go through ccache where there is one (GPU_CHECK_CCACHE=0: never): the dry run is
# part of the test suite, and a checkout's second run, or another clone's, then compiles
# nothing that has not changed. Paths under the checkout are hashed relative to it.
CCACHE=()
if [[ "${GPU_CHECK_CCACHE:-1}" == 1 ]] && command -v ccache >/dev/null; then
  CCACHE=(ccache)
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
fi
CXXC=("${CCACHE[@]}" "$CXX") # compile only (a link through ccache is not cached)
t0=$SECONDS
# The engine without rdma and hwloc (nothing but libc, libdl, pthreads), one object per source.
mkdir -p "$B/obj"
SRCS=$(ls engine/*.cc engine/transport/table.cc engine/transport/shm/*.cc \
          engine/transport/tcp/*.cc engine/transport/cuda/*.cc engine/device/*.cc |
       grep -v mc_params_main.cc)
printf '%s\n' $SRCS | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" "$@" -c {} -o "'"$B"'/obj/$(echo {} | tr / _).o"' "${CXXC[@]}" "${FLAGS[@]}" \
  2>&1 | tee "$OUT/build.log"
rm -f "$B/libmc_engine.a"
ar rcs "$B/libmc_engine.a" "$B"/obj/*.o
# The process group (its portable reduction kernels only: no AVX2 copies), for pg_check.
mkdir -p "$B/pgobj"
ls pg/*.cc pg/algorithms/*.cc | grep -v _avx2.cc | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" "$@" -c {} -o "'"$B"'/pgobj/$(echo {} | tr / _).o"' "${CXXC[@]}" "${FLAGS[@]}" \
  2>&1 | tee -a "$OUT/build.log"
# The reduction kernel (pg/device_reduce.cu) as a fatbin embedded in the library, as CMake
# does (pg/CMakeLists.txt), where nvcc is; without it the GPU's reductions run on the CPU.
REDUCE_KERNEL=0
if [[ -x "$CUDA_HOME/bin/nvcc" ]]; then
  if "${CCACHE[@]}" "$CUDA_HOME/bin/nvcc" -std=c++17 -O3 --fmad=false -I"$ROOT" --fatbin \
       -arch="${GPU_CHECK_ARCH:-sm_90}" pg/device_reduce.cu -o "$B/device_reduce.fatbin" \
       2>&1 | tee -a "$OUT/build.log" &&
     "$CUDA_HOME/bin/bin2c" --const --name mc_pg_reduce_fatbin "$B/device_reduce.fatbin" \
       > "$B/generated/device_reduce_fatbin.inc" &&
     "${CCACHE[@]}" "${CC:-gcc}" -O2 -fPIC -I"$B/generated" -c pg/device_reduce_image.c \
       -o "$B/pgobj/reduce_image.o" &&
     "${CXXC[@]}" "${FLAGS[@]}" -DMC_PG_HAVE_REDUCE_IMAGE=1 -c pg/device_reduce.cc \
       -o "$B/pgobj/pg_device_reduce.cc.o"; then
    REDUCE_KERNEL=1
  else
    echo "gpu_check: the reduction kernel did not build (see build.log)" | tee -a "$OUT/build.log"
    rm -f "$B/pgobj/reduce_image.o"
  fi
fi
rm -f "$B/libmc_pg.a"
ar rcs "$B/libmc_pg.a" "$B"/pgobj/*.o
# Expert parallelism (ep/*.cc, portable combine only) for the torch check's EP step, with the
# low-latency kernels' entry point (ep/kernels/ll_entry.cu) as a fatbin embedded as CMake does
# (ep/CMakeLists.txt) where nvcc is; without it a GPU buffer's launch is refused on CUDA.
mkdir -p "$B/eplib"
EP_FLAGS=("${FLAGS[@]}" -ffp-contract=off)
EP_KERNEL=0
if [[ -x "$CUDA_HOME/bin/nvcc" ]]; then
  if "${CCACHE[@]}" "$CUDA_HOME/bin/nvcc" -std=c++17 -O3 --fmad=false -I"$ROOT" --fatbin \
       -arch="${GPU_CHECK_ARCH:-sm_90}" ep/kernels/ll_entry.cu -o "$B/ll_entry.fatbin" \
       2>&1 | tee -a "$OUT/build.log" &&
     "$CUDA_HOME/bin/bin2c" --const --name mc_ep_ll_fatbin "$B/ll_entry.fatbin" \
       > "$B/generated/ll_entry_fatbin.inc" &&
     "${CCACHE[@]}" "${CC:-gcc}" -O2 -fPIC -I"$B/generated" -c ep/ll_entry_image.c \
       -o "$B/eplib/ll_entry_image.o"; then
    EP_KERNEL=1
    EP_FLAGS+=(-DMC_EP_HAVE_LL_IMAGE=1)
  else
    echo "gpu_check: the EP kernels' fatbin did not build (see build.log)" | tee -a "$OUT/build.log"
    rm -f "$B/eplib/ll_entry_image.o"
  fi
fi
# The library's sources as ep/CMakeLists.txt lists them (its add_library block).
EP_SRCS=$(sed -n '/^add_library(mooncake_ep STATIC/,/^)/p' ep/CMakeLists.txt |
          sed -n 's/^[[:space:]]*\([a-z_]*\.cc\)$/ep\/\1/p')
[[ -n "$EP_SRCS" ]] || { echo "gpu_check: no sources found in ep/CMakeLists.txt" >&2; exit 1; }
printf '%s\n' $EP_SRCS | xargs -P "$(nproc)" -I{} \
  sh -c '"$0" "$@" -c {} -o "'"$B"'/eplib/$(echo {} | tr / _).o"' "${CXXC[@]}" "${EP_FLAGS[@]}" \
  2>&1 | tee -a "$OUT/build.log"
rm -f "$B/libmc_ep.a"
ar rcs "$B/libmc_ep.a" "$B"/eplib/*.o
mkdir -p "$B/checkobj"
for check in device_check engine_check pg_check; do
  { "${CXXC[@]}" "${FLAGS[@]}" -c "tests/gpu/$check.cc" -o "$B/checkobj/$check.o" &&
    "$CXX" "$B/checkobj/$check.o" "$B/libmc_pg.a" "$B/libmc_engine.a" -o "$B/$check" \
      -ldl -lpthread -lrt; } 2>&1 | tee -a "$OUT/build.log"
done
# The torch backend alone (tests/gpu/torch_check_module.cc; mooncake._C needs the store's
# protobuf and re2, which the GPU machine lacks), against the torch of $PYTHON.
PYTHON="${MC_PYTHON:-python3}"
TORCH_INFO=""
if [[ "${GPU_CHECK_TORCH:-1}" == 1 ]]; then
  # One line each: "cflag F", "lflag F", "suffix S", "about TEXT".
  TORCH_INFO=$("$PYTHON" - <<'P' 2>/dev/null || true
import sysconfig, torch, torch.utils.cpp_extension as c
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
for p in c.include_paths() + [sysconfig.get_paths()["include"]]:
    print("cflag -isystem" + p)  # (their warnings are not ours)
print("cflag -std=" + ("c++20" if v >= (2, 13) else "c++17"))  # 2.13's headers need C++20
print("cflag -D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
for k in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):  # pybind11 shares types only when equal
    if getattr(torch._C, "_PYBIND11_" + k, None):
        print('cflag -DPYBIND11_%s="%s"' % (k, getattr(torch._C, "_PYBIND11_" + k)))
for p in c.library_paths():
    print("lflag -L" + p)
    print("lflag -Wl,-rpath," + p)
print("suffix " + sysconfig.get_config_var("EXT_SUFFIX"))
try:  # the libstdc++ that torch's process runs on (for the relink below)
    with open("/proc/self/maps") as maps:
        print("stdcxx " + next(l.split()[-1] for l in maps if "/libstdc++.so" in l))
except (OSError, StopIteration):
    pass
print("about torch %s, CUDA %s, GPU available: %s" % (torch.__version__, torch.version.cuda,
                                                      torch.cuda.is_available()))
P
)
fi
MODULE=""
TORCH_BUILD_FAILED=0
if [[ -n "$TORCH_INFO" ]]; then
  TFLAGS=(-O2 -Wall -fPIC -fvisibility=hidden -I"$ROOT" -I"$B/generated" -I"$CUDA_HOME/include"
          -DTORCH_EXTENSION_NAME=mc_torch_check)
  LFLAGS=()
  STDCXX=""
  while read -r kind rest; do
    case "$kind" in
      cflag) TFLAGS+=("$rest") ;;
      lflag) LFLAGS+=("$rest") ;;
      suffix) MODULE="$B/mc_torch_check$rest" ;;
      stdcxx) STDCXX="$rest" ;;
      about) echo "gpu_check: $rest" | tee -a "$OUT/build.log" ;;
    esac
  done <<<"$TORCH_INFO"
  build_module() {  # (called in a condition: set -e is off inside, hence the returns)
    mkdir -p "$B/torchobj" || return 1
    ls torch_ext/csrc/{process_group,process_group_coalesced,mooncake_work,op_queue}.cc \
       torch_ext/csrc/{store_rendezvous,gpu_tensors}.cc \
       torch_ext/csrc/{engine_handle,ep_binding}.cc tests/gpu/torch_check_module.cc |
      xargs -P "$(nproc)" -I{} sh -c \
        '"$0" "$@" -c {} -o "'"$B"'/torchobj/$(echo {} | tr / _).o"' "${CXXC[@]}" "${TFLAGS[@]}" \
      2>&1 | tee -a "$OUT/build.log" || return 1
    # (GPU_CHECK_MODULE_LDFLAGS: extra flags for this link; -static-libstdc++ reproduces below.)
    # shellcheck disable=SC2086
    "$CXX" -shared -o "$MODULE" "$B"/torchobj/*.o "$B/libmc_ep.a" "$B/libmc_pg.a" "$B/libmc_engine.a" \
      "${LFLAGS[@]}" -ltorch -ltorch_cpu -ltorch_python -lc10 -ldl -lpthread -lrt \
      ${GPU_CHECK_MODULE_LDFLAGS:-} 2>&1 | tee -a "$OUT/build.log" || return 1
    # The module must run on the libstdc++ of the process that loads it. On the GPU machine
    # (2026-12-04) the link above put libstdc++'s own code (std::codecvt, ostream::_M_insert)
    # into the module: a second copy whose locale facet ids disagree with the loaded one's, and
    # the first number an ostringstream formatted (tcp's labelOf, creating the group) crashed
    # both ranks. Where that happens, link again against the loaded copy and nothing else.
    if ownStdcxx; then
      echo "gpu_check: the module carries libstdc++ code of its own; linking it again against" \
           "${STDCXX:-(none found)}, the copy torch's process runs on" | tee -a "$OUT/build.log"
      [[ -n "$STDCXX" ]] || return 1
      "$CXX" -shared -nodefaultlibs -o "$MODULE" "$B"/torchobj/*.o "$B/libmc_ep.a" "$B/libmc_pg.a" \
        "$B/libmc_engine.a" "${LFLAGS[@]}" -ltorch -ltorch_cpu -ltorch_python -lc10 "$STDCXX" \
        -lm -lgcc_s -lgcc -lc -ldl -lpthread -lrt 2>&1 | tee -a "$OUT/build.log" || return 1
      if ownStdcxx; then
        echo "gpu_check: the module still carries libstdc++ code" | tee -a "$OUT/build.log"
        return 1
      fi
    fi
  }
  ownStdcxx() {  # libstdc++'s out-of-line members defined (and exported) by the module
    local n  # (grep -c reads all of nm's output: grep -q would stop it, a failure under pipefail)
    n=$(nm -D --defined-only "$MODULE" 2>/dev/null |
        grep -cE ' (_ZNSo9_M_insertI|_ZNKSt7codecvtI|_ZNSt6locale)' || true)
    ((n > 0))
  }
  # A failed module build is reported (the check fails) but the other checks still run.
  if ! build_module; then
    echo "gpu_check: building the torch check's module FAILED (see build.log)" |
      tee -a "$OUT/build.log"
    rm -f "$MODULE"
    TORCH_BUILD_FAILED=1
  fi
else
  echo "gpu_check: no torch through $PYTHON (or GPU_CHECK_TORCH=0): the torch check is skipped" |
    tee -a "$OUT/build.log"
fi
# The package itself (mooncake._C: the backend with the store, EP and the engine bindings) built
# by CMake against the machine's torch, without the tests (MC_BUILD_TESTS=OFF: the machine has
# no googletest, and no re2, which the store's master then goes without), rdma or hwloc; the
# torch check runs through it too. On CUDA by default; GPU_CHECK_PACKAGE=0 skips it, =1 builds
# it in a dry run too (minutes on 2 cores).
PKG_DIR=""
PKG_FAILED=0
PKG_DEFAULT=0
[[ "$DEVICE" == cuda ]] && PKG_DEFAULT=1
if [[ "${GPU_CHECK_PACKAGE:-$PKG_DEFAULT}" == 1 && -n "$TORCH_INFO" ]]; then
  t1=$SECONDS
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  if command -v cmake >/dev/null &&
     cmake -S "$ROOT" -B "$B/pkg" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DMC_BUILD_TESTS=OFF \
       -DMC_WITH_RDMA=OFF -DMC_WITH_HWLOC=OFF -DMC_CUDA_HOME="$CUDA_HOME" \
       -DMC_PYTHON="$(command -v "$PYTHON")" > "$OUT/package.log" 2>&1 &&
     cmake --build "$B/pkg" --target mooncake_python mooncake_master -j "$(nproc)" \
       >> "$OUT/package.log" 2>&1; then
    PKG_DIR="$B/pkg/python"
    echo "gpu_check: the package (CMake, MC_BUILD_TESTS=OFF) built in $((SECONDS - t1)) s" |
      tee -a "$OUT/build.log"
  else
    PKG_FAILED=1
    echo "gpu_check: the package did not build (package.log; cmake: $(command -v cmake ||
      echo none)):" | tee -a "$OUT/build.log"
    tail -25 "$OUT/package.log" | tee -a "$OUT/build.log"
  fi
fi
# The EP low-latency kernels (ep/kernels/ll_kernels.cu) and their check (tests/gpu/
# ep_kernel_check.cc): the host executor's build with the compiler alone, the CUDA one with
# nvcc (sm_90, GPU_CHECK_ARCH to change) where the toolkit has it -- a dry run still compiles
# and links the kernels.
"$CXX" "${FLAGS[@]}" -ffp-contract=off tests/gpu/ep_kernel_check.cc ep/layout.cc \
  -o "$B/ep_kernel_check" -lpthread 2>&1 | tee -a "$OUT/build.log"
EP_CUDA_BUILT=0
ONLY="${GPU_CHECK_ONLY:-}"  # "torch": the torch check alone (a diagnosis; the EP kernels not built)
if [[ -x "$CUDA_HOME/bin/nvcc" && "$ONLY" != torch ]]; then
  NV=("${CCACHE[@]}" "$CUDA_HOME/bin/nvcc" -std=c++17 -O2 -arch="${GPU_CHECK_ARCH:-sm_90}" --fmad=false
      -Xcompiler -ffp-contract=off -DMC_EP_CHECK_CUDA -I"$ROOT" -I"$B/generated")
  # (A binary left by an earlier build must not count: built means built now.)
  rm -rf "$B/epobj" "$B/ep_kernel_check_cuda"
  mkdir -p "$B/epobj"
  { "${NV[@]}" -x cu -c tests/gpu/ep_kernel_check.cc -o "$B/epobj/check.o" &&
    "${NV[@]}" -c tests/gpu/ep_kernel_check_cuda.cu -o "$B/epobj/exec.o" &&
    "${NV[@]}" -c ep/kernels/ll_kernels.cu -o "$B/epobj/kernels.o" &&
    "${CXXC[@]}" "${FLAGS[@]}" -ffp-contract=off -c ep/layout.cc -o "$B/epobj/layout.o" &&
    "${NV[@]}" "$B"/epobj/*.o -o "$B/ep_kernel_check_cuda" -lpthread; } 2>&1 |
    tee -a "$OUT/build.log" || true  # (a failed build is reported when the checks run)
  [[ -x "$B/ep_kernel_check_cuda" ]] && EP_CUDA_BUILT=1
fi
# A crash in the torch check explains itself: tests/gpu/crash_backtrace.c, preloaded, writes the
# native stack; symbolize (below) names the module's frames.
CRASH_BT=""
if "${CC:-gcc}" -shared -fPIC -O1 tests/gpu/crash_backtrace.c -o "$B/crash_backtrace.so" \
     2>&1 | tee -a "$OUT/build.log"; then
  CRASH_BT="$B/crash_backtrace.so"
fi
symbolize() {  # $1: a log with native backtraces; prints the module's frames, named
  grep -o 'mc_torch_check[^ (]*\.so(+0x[0-9a-f]*)' "$1" | sort -u | while read -r f; do
    local off=${f##*(+}
    off=${off%)}
    echo "  $f = $(addr2line -f -C -e "$MODULE" "$off" 2>/dev/null | head -1 | cut -c1-240)"
  done
}
echo "gpu_check: built in $((SECONDS - t0)) s" | tee -a "$OUT/build.log"
# One pass of the torch check: torch_pass NAME BLOCKING_WAIT ARGS... (its rows in $OUT/NAME.json,
# its stderr in $OUT/NAME.err and the log). Under a deadline (GPU_CHECK_TORCH_TIMEOUT, 150 s):
# a rank that hangs has every thread's stack written (torch_check.py) and the pass fails.
TT="${GPU_CHECK_TORCH_TIMEOUT:-150}"
torch_pass() {
  local name=$1 blocking=$2
  shift 2
  MC_PG_BLOCKING_WAIT=$blocking PYTHONFAULTHANDLER=1 LD_PRELOAD="$CRASH_BT" \
    timeout -s INT -k 10 $((TT + 40)) "$PYTHON" tests/gpu/torch_check.py --timeout "$TT" \
    --device "$DEVICE" "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.json"
  local rc=${PIPESTATUS[0]}
  cat "$OUT/$name.err"
  if grep -q "native backtrace" "$OUT/$name.err"; then
    echo "gpu_check: the module's frames in the native backtraces above:"
    symbolize "$OUT/$name.err"
  fi
  return "$rc"
}

set +e
{
  echo "gpu_check: MC_DEVICE=$DEVICE, $(date -u +%FT%TZ), $(uname -n)"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "(no nvidia-smi)"; fi
  # What the machine runs (whether binaries built elsewhere could run here, and what the store
  # would need): the OS, glibc, the newest libstdc++ ABI, protobuf and re2.
  echo "machine: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}"); $(ldd --version 2>&1 |
    head -1); $(strings "$(g++ -print-file-name=libstdc++.so.6)" 2>/dev/null |
    grep -o 'GLIBCXX_3\.4\.[0-9]*' | sort -t. -k3 -n | tail -1); protobuf/re2:" \
    "$(ls /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib 2>/dev/null |
    grep -E '^lib(protobuf|re2)\.so' | sort -u | tr '\n' ' ')$(command -v protoc || true)"
  r=0
  if [[ "$ONLY" != torch ]]; then
  MC_DEVICE="$DEVICE" "$B/device_check" --json "$OUT/device_check.json" || r=$?
  MC_DEVICE="$DEVICE" timeout 90 "$B/engine_check" | tee "$OUT/engine_check.json" || r=$?
  MC_DEVICE="$DEVICE" timeout 120 "$B/pg_check" | tee "$OUT/pg_check.json" || r=$?
  if [[ "$DEVICE" == cuda ]]; then  # (the waits' polling: MC_DEVICE_SPIN_US against none)
    MC_DEVICE=cuda MC_DEVICE_SPIN_US=0 timeout 120 "$B/pg_check" |
      tee "$OUT/pg_check_spin0.json" || r=$?
    # (steps: a 16 MiB allreduce in one 16 MiB step instead of eight of 2 MiB; with the
    # checks' time by phase, whether the GPU path's time goes per step)
    MC_DEVICE=cuda MC_PG_BUFFER_BYTES=67108864 MC_PG_CHUNK_BYTES=16777216 timeout 120 \
      "$B/pg_check" | tee "$OUT/pg_check_bigsteps.json" || r=$?
  fi
  if [[ -x "$CUDA_HOME/bin/nvcc" ]] && ((!REDUCE_KERNEL)); then
    echo '{"check": "pg reduction kernel (nvcc)", "ok": false, "detail": "it did not build"}'
    r=1
  fi
  if [[ -x "$CUDA_HOME/bin/nvcc" ]] && ((!EP_KERNEL)); then
    echo '{"check": "EP kernels fatbin (nvcc)", "ok": false, "detail": "it did not build"}'
    r=1
  fi
  # EP kernels: on the GPU against the reference and the host executor, timed; a dry run runs
  # the host executor (the CUDA build must still have compiled where nvcc is).
  if [[ "$DEVICE" == cuda ]]; then
    if ((EP_CUDA_BUILT)); then
      timeout 150 "$B/ep_kernel_check_cuda" cuda "$OUT/ep_kernel_check.json" || r=$?
    else
      echo '{"check": "ep kernels", "ok": false, "detail": "ep_kernel_check_cuda did not build"}'
      r=1
    fi
  else
    timeout 300 "$B/ep_kernel_check" host "$OUT/ep_kernel_check.json" || r=$?
    if [[ -x "$CUDA_HOME/bin/nvcc" ]] && ((!EP_CUDA_BUILT)); then
      echo '{"check": "ep kernels (nvcc)", "ok": false, "detail": "the CUDA kernels did not compile"}'
      r=1
    fi
  fi
  fi  # (not GPU_CHECK_ONLY=torch)
  if ((TORCH_BUILD_FAILED)); then
    echo '{"check": "torch_check", "ok": false, "detail": "the module did not build"}'
    r=1
  elif [[ -n "$MODULE" && -f "$MODULE" ]]; then
    # As shipped (host-driven ops' Work.wait() blocks, MC_PG_BLOCKING_WAIT=1; all_reduce is
    # stream-ordered), timed; then, on CUDA, with the stream gate (MC_PG_BLOCKING_WAIT=0),
    # which deadlocked on the GPU machine's second session (docs/gpu.md), all_reduce timed.
    BENCH=()
    [[ "${GPU_CHECK_BENCH:-1}" == 1 ]] && BENCH=(--bench)
    echo "gpu_check: the torch check, Work.wait() blocking"
    torch_pass torch_check 1 --module-dir "$B" "${BENCH[@]}" || r=$?
    # EP on GPU buffers whose group spans (simulated) hosts, a rank per host: the host proxy
    # (ep/ll_proxy.h: the kernels stage, a host thread moves the rows through the engine).
    echo "gpu_check: the torch check's EP step across simulated hosts (the host proxy)"
    torch_pass torch_check_ep_hosts 1 --module-dir "$B" --ep-hosts 1 || r=$?
    # (The first pass's all_reduce of CUDA tensors is stream-ordered, pg/stream_ops.h; this
    # one takes the host-driven path, MC_PG_STREAM_OPS=0, so that the gate is what orders the
    # streams, and times all_reduce that way for the A/B.)
    if [[ "$DEVICE" == cuda && "${GPU_CHECK_GATE:-1}" == 1 ]]; then
      echo "gpu_check: the torch check, host-driven all_reduce, Work.wait() as a stream gate"
      MC_PG_STREAM_OPS=0 torch_pass torch_check_gate 0 --module-dir "$B" "${BENCH[@]}" \
        --bench-ops all_reduce || r=$?
    fi
  fi
  if ((PKG_FAILED)); then
    echo '{"check": "package", "ok": false, "detail": "CMake did not build it (package.log)"}'
    r=1
  elif [[ -n "$PKG_DIR" ]]; then
    echo "gpu_check: the torch check through the package (CMake's mooncake._C)"
    torch_pass torch_check_package 1 --package-dir "$PKG_DIR" || r=$?
    # The store: get_into a GPU buffer (64 MiB) from a segment in host memory and from one in
    # GPU memory (MC_STORE_SEGMENT_DEVICE), against the device's own copy (issue 11's bar:
    # >= 0.5x it), through the package and its mooncake_master.
    if [[ "${GPU_CHECK_STORE:-1}" == 1 ]]; then
      echo "gpu_check: the store, get_into a GPU buffer (benchmarks/store_bench.py --gpu)"
      PYTHONPATH="$PKG_DIR" MC_MASTER_BIN="$B/pkg/store/mooncake_master" \
        timeout -s INT -k 10 180 "$PYTHON" benchmarks/store_bench.py --gpu "$DEVICE" \
        --sizes 1M,64M --json "$OUT/store_gpu.json" || r=$?
    fi
    # Upstream's TransferEngine on GPU memory (what vLLM's, SGLang's and LMCache's P/D
    # connectors register, location "*"): two processes on the GPU, 64 MiB written in blocks,
    # read back, a write timed.
    echo "gpu_check: TransferEngine on GPU memory (tests/gpu/p2p_gpu_check.py)"
    PYTHONPATH="$PKG_DIR" timeout -s INT -k 10 120 "$PYTHON" tests/gpu/p2p_gpu_check.py \
      --device "$DEVICE" --json "$OUT/p2p_gpu.json" || r=$?
  fi
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
