// The host executor of ep/kernels/ll_kernels.h: a "block" is one call on the calling thread,
// with one lane (so count/share/sync are trivial), atomics are the compiler's, the doorbell
// also wakes the CPU path's futex sleepers, and a waiting lane yields its core.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>

#include "engine/futex.h"

namespace mooncake::ep::kern {

struct HostLanes {
  int lane() const { return 0; }
  int lanes() const { return 1; }
  void sync() {}
  int count(bool flag, int* total) {
    *total = flag ? 1 : 0;
    return 0;
  }
  template <typename T>
  T share(T v) {
    return v;
  }
  uint64_t loadAcquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void storeRelease(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void fenceSystem() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
  int32_t cas(int32_t* p, int32_t expected, int32_t desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
  }
  void ringDoorbell(uint32_t* p) {
    auto* word = reinterpret_cast<std::atomic<uint32_t>*>(p);
    word->fetch_add(1, std::memory_order_release);
    engine::futexWakeAll(word);
  }
  int64_t nowUs() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void pause() { std::this_thread::yield(); }
  // Set by the caller that knows the peers (ep/ll_host.cc: the engine's view, with the CPU
  // path's grace for signals still queued behind a death notice); unset: nobody is gone.
  std::function<bool(int)> gone;
  bool peerGone(int r) const { return gone && gone(r); }
};

}  // namespace mooncake::ep::kern
