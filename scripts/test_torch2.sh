#!/usr/bin/env bash
# Builds and tests the project against torch 2.x: Debian 13's python3-torch / libtorch-dev
# (2.6) in a Debian 13 (trixie) root, beside the host's Debian 12 + torch 1.13 build.
#
#   1. creates the root once (debootstrap minbase + the build dependencies with apt) in a
#      cache directory outside the checkout, or reuses it;
#   2. in a private mount + pid namespace (nothing it mounts is visible outside, and every
#      mount and every process it started goes away with it, on any exit path, kill -9
#      included) mounts /proc, /sys, /dev, a fresh /dev/shm, /run, /tmp and the checkout at
#      /src;
#   3. builds the checkout there into <checkout>/build-torch2 (its own build directory;
#      compiler cache in the cache directory): the package and what the Python tests run (the
#      master, the verbs emulator), not the C++ tests; installs the package into the root's
#      Python (a mooncake.pth in the root's own site dir, not the host's) and runs the whole
#      pytest suite there, then scripts/gpu_check.sh's dry run of the torch check.
#
# The C++ tests (ctest) take no torch and are the host's (scripts/test.sh runs them on Debian
# 12); here they would cost a third of the time for nothing torch-related. MOONCAKE_T2_CTEST=1
# builds and runs them in the root too (a compiler or library upgrade to vet).
#
# Usage: scripts/test_torch2.sh [PYTEST_ARGS...]     (e.g. -x tests/python/test_pg_torch2.py)
#   MOONCAKE_CACHE   cache directory (default /var/cache/mooncake): the root is
#                    debian13-torch2/ there, the compiler cache ccache-debian13/
#   MOONCAKE_MIRROR  Debian mirror for a new root (default http://deb.debian.org/debian)
# Needs root (debootstrap, chroot, mounts) and, the first time, the Debian archive (about
# 1.9 GB unpacked). Called by scripts/test.sh. The last line is a one-line summary.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MOONCAKE_CACHE:-/var/cache/mooncake}"
MIRROR="${MOONCAKE_MIRROR:-http://deb.debian.org/debian}"
SUITE=trixie
RFS="$CACHE/debian13-torch2"
MARK="$RFS/.mooncake-root" # the package list, written last: a root without it is incomplete
CCACHE="$CACHE/ccache-debian13"
# What the root must hold. Changing this list makes the next run install the difference.
PACKAGES=(
  build-essential cmake ninja-build pkgconf ccache
  libtorch-dev python3-torch python3-pytest python3-numpy pybind11-dev python3-pybind11
  libprotobuf-dev protobuf-compiler libcpp-httplib-dev libre2-dev
  libgtest-dev libgmock-dev libibverbs-dev libhwloc-dev
  redis-server python3-redis
  python3-mpi4py openmpi-bin libopenmpi-dev
  python3-matplotlib python3-tqdm
  python3-pip python3-venv
  iproute2 procps
)
BUILD=build-torch2 # inside the checkout (ignored by git as build-*/)
PYTEST_LIMIT_S=1200

log() { echo "test_torch2: $*" >&2; }

# ------------------------------------------------------------------------------------------
# Inside the root (chroot), in /src: build, install into the root's Python, test.
inside() {
  cd /src
  local t0=$SECONDS launcher=()
  if command -v ccache >/dev/null; then
    export CCACHE_DIR=/ccache CCACHE_MAXSIZE=3G CCACHE_BASEDIR=/src
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  fi
  if [[ ! -f $BUILD/build.ninja || ! -f $BUILD/CMakeCache.txt ]]; then
    mkdir -p $BUILD
    if ! cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
      >$BUILD/configure.log 2>&1; then
      cat $BUILD/configure.log >&2
      log "cmake configure failed (log: $BUILD/configure.log)"
      return 1
    fi
    grep -E -m2 'mooncake: MC_WITH|mooncake deps' $BUILD/configure.log || true
  fi
  [[ ${#launcher[@]} -eq 0 ]] || ccache -z >/dev/null
  local targets=(mooncake_python mooncake_master mc_fake_verbs) # (see the header)
  [[ ${MOONCAKE_T2_CTEST:-0} == 1 ]] && targets=()              # everything
  ninja -C $BUILD -j2 --quiet "${targets[@]}"
  if [[ ${#launcher[@]} -ne 0 ]]; then
    ccache --print-stats | awk '/^(direct|preprocessed)_cache_hit\t/ {h += $2}
      /^cache_miss\t/ {m = $2} END {print "test_torch2: ccache: " h " hits, " m " misses"}'
  fi
  bash scripts/install_python.sh "/src/$BUILD"
  local t_built=$SECONDS ctest_rc=0 pytest_rc=0 ctest_note="skipped (MOONCAKE_T2_CTEST=0)"
  if [[ ${MOONCAKE_T2_CTEST:-0} == 1 ]]; then
    ctest --test-dir $BUILD --output-on-failure -j2 --timeout 600 || ctest_rc=$?
    ctest_note="rc=$ctest_rc $((SECONDS - t_built))s"
  fi
  local t_ctest=$SECONDS
  local args=("$@") a
  for a in "$@"; do [[ $a == tests/* ]] && break; done
  [[ ${a:-} == tests/* ]] || args+=(tests/python) # no test path given: all of them
  MC_TEST_BUILD_DIR=/src/$BUILD timeout -k 30 $PYTEST_LIMIT_S \
    python3 -m pytest -q -p no:cacheprovider -rs "${args[@]}" || pytest_rc=$?
  local t_end=$SECONDS gpu_rc=0 gpu_note="skipped (no CUDA headers mounted at /cuda)"
  # scripts/gpu_check.sh's dry run against this torch (the GPU machine's torch is 2.x too):
  # it builds the torch backend as a module of its own with the compiler alone and runs its
  # check over the device layer's simulation; the torch check alone (GPU_CHECK_ONLY=torch): the
  # other checks take no torch and run in the host's ctest (engine.gpu_check_dry_run). (The
  # CUDA headers come from the host's toolkit, mounted at /cuda.)
  if [[ -f /cuda/include/cuda.h ]]; then
    CUDA_HOME=/cuda MC_PYTHON=python3 GPU_CHECK_BUILD=/src/$BUILD/gpu_check GPU_CHECK_BENCH=0 \
      GPU_CHECK_ONLY=torch \
      timeout 600 bash scripts/gpu_check.sh --sim >$BUILD/gpu_check.log 2>&1 || gpu_rc=$?
    gpu_note="rc=$gpu_rc $(($SECONDS - t_end))s"
    ((gpu_rc == 0)) || tail -40 $BUILD/gpu_check.log >&2
  fi
  echo "test_torch2 (inside): $(python3 -c 'import sys, torch; print(f"torch {torch.__version__}, python {sys.version.split()[0]}")');" \
    "build $((t_built - t0))s, ctest $ctest_note," \
    "pytest rc=$pytest_rc $((t_end - t_ctest))s, gpu_check --sim $gpu_note"
  ((ctest_rc == 0 && pytest_rc == 0 && gpu_rc == 0))
}

# ------------------------------------------------------------------------------------------
# Outside, in the private namespaces.
need_host_pkg() {
  if [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" != installed ]]; then
    log "installing $1 on the host"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
  fi
}

mounts=()
mnt() { # mnt TARGET mount-args...: mounts, and remembers it for unmount_all
  local target=$1
  shift
  mkdir -p "$target"
  mount "$@" "$target"
  mounts+=("$target")
}
unmount_all() { # innermost first; lazily, so that a busy mount cannot block the exit
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount -l "${mounts[i]}" 2>/dev/null || true
  done
  mounts=()
}

mount_root() { # mount_root DIR: what apt and the tests need inside
  local d=$1
  mnt "$d" --bind "$d" # "/" inside is a mount point (`ip netns exec` remounts it rslave)
  mnt "$d/proc" -t proc proc # this pid namespace's processes only
  mnt "$d/sys" -t sysfs sysfs
  mnt "$d/dev" --rbind /dev
  mount --make-rslave "$d/dev"
  mnt "$d/dev/shm" -t tmpfs -o mode=1777,size=50% shm # our own: nothing leaks to the host's
  mnt "$d/run" -t tmpfs -o mode=755 run
  mnt "$d/tmp" -t tmpfs -o mode=1777 tmp
}

chroot_run() { # chroot_run DIR CMD...: with a clean environment
  local d=$1
  shift
  chroot "$d" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive "$@"
}

apt_inside() { # apt_inside DIR PKGS...
  local d=$1
  shift
  cp /etc/resolv.conf "$d/etc/resolv.conf"
  chroot_run "$d" apt-get -o Acquire::Retries=3 update -qq
  chroot_run "$d" apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends "$@" >/dev/null
  chroot_run "$d" apt-get clean
}

create_root() {
  need_host_pkg debootstrap
  local new="$RFS.new" t=$SECONDS
  log "creating a Debian 13 root in $RFS (debootstrap + apt; first time only, minutes)"
  local try ok=0
  for try in 1 2 3; do # a download that fails midway is tried again, from scratch
    rm -rf "$new"
    if debootstrap --variant=minbase --include=python3,python3-torch "$SUITE" "$new" \
      "$MIRROR" >"$CACHE/debootstrap.log" 2>&1; then
      ok=1
      break
    fi
    log "debootstrap attempt $try failed"
  done
  if ((!ok)); then
    tail -30 "$CACHE/debootstrap.log" >&2
    log "debootstrap failed (log: $CACHE/debootstrap.log)"
    return 1
  fi
  log "debootstrap: $((SECONDS - t))s"
  t=$SECONDS
  mount_root "$new"
  apt_inside "$new" "${PACKAGES[@]}"
  unmount_all
  log "build dependencies: $((SECONDS - t))s"
  printf '%s\n' "${PACKAGES[@]}" >"$new/.mooncake-root"
  mv "$new" "$RFS"
}

main() {
  local t_start=$SECONDS
  mkdir -p "$CACHE" "$CCACHE"
  exec 9>"$CACHE/.debian13-torch2.lock"
  trap unmount_all EXIT

  # Create or complete the root under an exclusive lock; use it under a shared one.
  flock 9
  if [[ ! -f "$MARK" ]]; then
    rm -rf "$RFS"
    create_root
  elif [[ "$(cat "$MARK")" != "$(printf '%s\n' "${PACKAGES[@]}")" ]]; then
    log "the package list changed: installing the difference into the root"
    mount_root "$RFS"
    apt_inside "$RFS" "${PACKAGES[@]}"
    unmount_all
    printf '%s\n' "${PACKAGES[@]}" >"$MARK"
  fi
  flock -s 9
  local t_root=$SECONDS

  cp /etc/hosts "$RFS/etc/hosts"
  mount_root "$RFS"
  mnt "$RFS/src" --bind "$ROOT"
  mnt "$RFS/ccache" --bind "$CCACHE"
  [[ ! -f /usr/local/cuda/include/cuda.h ]] || mnt "$RFS/cuda" --bind /usr/local/cuda

  local rc=0
  chroot_run "$RFS" bash /src/scripts/test_torch2.sh --inside "$@" || rc=$?
  unmount_all
  local verdict=OK
  ((rc == 0)) || verdict="FAILED (rc=$rc)"
  echo "test_torch2.sh: $verdict -- root $((t_root - t_start))s, build+tests $((SECONDS - t_root))s"
  return $rc
}

if [[ "${1:-}" == "--inside" ]]; then
  shift
  inside "$@"
  exit
fi
if [[ "$(id -u)" != 0 ]]; then
  log "needs root (debootstrap, chroot and mounts)"
  exit 1
fi
if [[ -z "${_MOONCAKE_T2_NS:-}" ]]; then
  # A private mount namespace and a pid namespace of our own, run by this shell: on
  # SIGTERM/SIGINT/SIGHUP (a CI timeout, ^C, kill) it kills unshare, whose --kill-child kills
  # the namespace's first process, and with it every process and mount of the namespace goes
  # away. (unshare itself ignores SIGTERM and SIGINT while it waits, and the namespace's
  # first process ignores signals it has no handler for, so neither can be the target.)
  unshare --mount --propagation private --pid --fork --kill-child \
    env _MOONCAKE_T2_NS=1 bash "${BASH_SOURCE[0]}" "$@" &
  ns=$!
  # (|| true: errexit applies inside a trap, and the killed unshare's status is not 0)
  trap 'kill -KILL $ns 2>/dev/null || true; wait $ns 2>/dev/null || true; log "stopped"; exit 143' \
    TERM INT HUP
  rc=0
  wait $ns || rc=$?
  exit $rc
fi
main "$@"
exit
