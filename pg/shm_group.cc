#include "pg/shm_group.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "engine/futex.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MC_PG_CPU_RELAX() _mm_pause()
#else
#define MC_PG_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace mooncake::pg {

namespace {

// The futex word is the low half of the 64-bit flag (little-endian): it changes whenever
// the flag does, as flags only grow and never by a multiple of 2^32 at once.
std::atomic<uint32_t>* futexWord(std::atomic<uint64_t>* v) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "flag layout");
  return reinterpret_cast<std::atomic<uint32_t>*>(v);
}

}  // namespace

ShmGroup::ShmGroup(const Health* health, std::vector<char*> bases, size_t buffer_bytes,
                   int rank, WaitOptions wait)
    : health_(health), bases_(std::move(bases)), rank_(rank), wait_(wait) {
  half_ = ((buffer_bytes - kHeaderBytes) / 2) & ~static_cast<size_t>(4095);
}

uint64_t ShmGroup::beginStep(const OpCtx& op, bool will_write) {
  uint64_t s = ++step_;
  if (will_write && s > 2) waitAll(op, kConsumed, s - 2);
  return s;
}

void ShmGroup::post(Flag f, uint64_t s) {
  Line& l = hdr(rank_)->flags[f];
  l.v.exchange(s, std::memory_order_seq_cst);  // full barrier: orders the waiters load below
  if (l.waiters.load(std::memory_order_seq_cst) != 0) engine::futexWakeAll(futexWord(&l.v));
}

void ShmGroup::wait(const OpCtx& op, int r, Flag f, uint64_t s) {
  Line& l = hdr(r)->flags[f];
  if (l.v.load(std::memory_order_acquire) >= s) return;
  slowWait(op, r, l, s);
}

void ShmGroup::waitAll(const OpCtx& op, Flag f, uint64_t s) {
  for (int r = 0; r < size(); ++r)
    if (r != rank_) wait(op, r, f, s);
}

void ShmGroup::abort(int blamed) {
  uint64_t v = blamed >= 0 ? static_cast<uint64_t>(blamed) + 2 : 1;
  uint64_t expected = 0;
  hdr(rank_)->abort.v.compare_exchange_strong(expected, v);
  // Wake every sleeper on this rank's flags so that they see the abort word now.
  for (auto& l : hdr(rank_)->flags) engine::futexWakeAll(futexWord(&l.v));
}

void ShmGroup::checkPeers(const OpCtx& op, int waiting_for) const {
  // Only the rank waited for: a peer that finished its part and exited is no failure. A
  // dead rank further down a chain of waits is reported through its waiter's abort word.
  health_->check(op, waiting_for);
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    uint64_t a = hdr(r)->abort.v.load(std::memory_order_acquire);
    if (a != 0) health_->aborted(op, r, a >= 2 ? static_cast<int>(a - 2) : -1);
  }
  if (engine::Clock::now() >= op.deadline)
    health_->timedOut(op, waiting_for, "shared-memory flag not posted");
}

void ShmGroup::slowWait(const OpCtx& op, int r, Line& l, uint64_t s) {
  using engine::Clock;
  const auto health_every = std::chrono::microseconds(wait_.health_us);
  auto now = Clock::now();
  auto next_check = now + health_every;
  const auto spin_end = now + std::chrono::microseconds(wait_.spin_us);
  const auto yield_end = spin_end + std::chrono::microseconds(wait_.yield_us);
  // True when the flag is set after all: a peer may post and exit just before the check.
  auto maybeCheck = [&]() -> bool {
    if (now < next_check) return false;
    try {
      checkPeers(op, r);
    } catch (...) {
      if (l.v.load(std::memory_order_acquire) >= s) return true;
      throw;
    }
    next_check = now + health_every;
    return false;
  };
  // 1. spin: the peer is usually a few hundred nanoseconds away on another core
  while (now < spin_end) {
    for (int i = 0; i < 64; ++i) {
      if (l.v.load(std::memory_order_acquire) >= s) return;
      MC_PG_CPU_RELAX();
    }
    now = Clock::now();
    if (maybeCheck()) return;
  }
  // 2. yield: let a rank sharing this core run
  while (now < yield_end) {
    if (l.v.load(std::memory_order_acquire) >= s) return;
    sched_yield();
    now = Clock::now();
    if (maybeCheck()) return;
  }
  // 3. sleep on the flag's futex; the poster wakes us when it sees a registered waiter
  for (;;) {
    l.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint64_t v = l.v.load(std::memory_order_seq_cst);
    if (v >= s) {
      l.waiters.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    auto left = std::min<Clock::duration>(next_check - now, op.deadline - now);
    if (left < std::chrono::microseconds(50)) left = std::chrono::microseconds(50);
    engine::futexWait(futexWord(&l.v), static_cast<uint32_t>(v), left);
    l.waiters.fetch_sub(1, std::memory_order_relaxed);
    if (l.v.load(std::memory_order_acquire) >= s) return;
    now = Clock::now();
    if (maybeCheck()) return;
  }
}

}  // namespace mooncake::pg
