// The host executors of ep/kernels/ll_kernels.h and normal_kernels.h. HostLanes: a "block" is
// one call on the calling thread, with one lane (so count/share/sync are trivial), atomics are
// the compiler's, the doorbell also wakes the CPU path's futex sleepers, and a waiting lane
// yields its core. ThreadLanes (below): a block's lanes are threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

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
  void add(int32_t* p, int32_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  // The value before; ordered after this lane's earlier accesses, before its later ones.
  int32_t fetchAdd(int32_t* p, int32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
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
  int32_t loadFlag(const int32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void pause() { std::this_thread::yield(); }
};

// Lanes that are host threads: a block of n lanes runs as n threads with barriers, so the
// bodies' multi-lane logic (striding, count(), share(), the barriers' placement, lane 0's
// waits) runs on the host as in a GPU block (MC_EP_KERNELS=threads, tests/gpu/
// ep_kernel_check threads).
class BlockThreads {
 public:
  explicit BlockThreads(int n) : n_(n), flags_(n) {}
  int size() const { return n_; }
  void barrier() {
    std::unique_lock<std::mutex> g(mu_);
    const uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(g, [&] { return gen_ != gen; });
  }
  std::vector<int>& flags() { return flags_; }
  int32_t& shared() { return shared_; }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t gen_ = 0;
  std::vector<int> flags_;
  int32_t shared_ = 0;
};

struct ThreadLanes : HostLanes {
  ThreadLanes(const HostLanes& base, BlockThreads* b, int id) : HostLanes(base), b_(b), id_(id) {}
  int lane() const { return id_; }
  int lanes() const { return b_->size(); }
  void sync() { b_->barrier(); }
  int count(bool flag, int* total) {
    b_->flags()[id_] = flag ? 1 : 0;
    b_->barrier();
    int before = 0, all = 0;
    for (int i = 0; i < b_->size(); ++i) {
      before += i < id_ ? b_->flags()[i] : 0;
      all += b_->flags()[i];
    }
    b_->barrier();
    *total = all;
    return before;
  }
  int32_t share(int32_t v) {
    b_->barrier();
    if (id_ == 0) b_->shared() = v;
    b_->barrier();
    const int32_t r = b_->shared();
    b_->barrier();
    return r;
  }

 private:
  BlockThreads* b_;
  int id_;
};

// Runs block(lanes) for blocks 0..n-1 in order, each on `lanes` threads (ThreadLanes copies of
// base), or on the calling thread when lanes == 1 (base itself).
template <typename Block>
void runBlocks(int n, int lanes, HostLanes& base, Block block) {
  for (int b = 0; b < n; ++b) {
    if (lanes <= 1) {
      block(base, b);
      continue;
    }
    BlockThreads bt(lanes);
    std::vector<std::thread> ts;
    for (int i = 0; i < lanes; ++i)
      ts.emplace_back([&, i] {
        ThreadLanes ln(base, &bt, i);
        block(ln, b);
      });
    for (auto& t : ts) t.join();
  }
}

}  // namespace mooncake::ep::kern
