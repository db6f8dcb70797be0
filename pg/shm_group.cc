#include "pg/shm_group.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "engine/futex.h"
#include "pg/communicator.h"
#include "pg/profile.h"

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
                   int rank, WaitOptions wait, uint64_t epoch)
    : health_(health),
      bases_(std::move(bases)),
      rank_(rank),
      wait_(wait),
      epoch_(epoch & ((uint64_t{1} << (64 - kStepBits)) - 1)),
      tag_(epoch_ << kStepBits),
      next_tag_((epoch_ + 1) << kStepBits) {
  if (next_tag_ == 0) next_tag_ = ~uint64_t{0};  // the last epoch: nothing is newer
  half_ = ((buffer_bytes - kHeaderBytes) / 2) & ~static_cast<size_t>(4095);
  verified_.assign(bases_.size(), 1);
}

uint64_t ShmGroup::beginStep(const OpCtx& op, bool will_write) {
  if (op.seq != op_seq_) beginOp(op);
  uint64_t s = ++step_;
  if (s > kStepMask)
    throw CommError("mooncake pg: " + std::string(op.name) + " (group " + health_->group() +
                        "): this view's shared-memory step counter is exhausted; re-create "
                        "the group",
                    -1, op.name);
  if (will_write && s > 2) waitAll(op, kConsumed, s - 2);
  return s;
}

void ShmGroup::movedOn(const OpCtx& op, int r) const {
  health_->aborted(op, r, Health::kLeftView,
                   "it left this view of the group (epoch " + std::to_string(epoch_) +
                       ") for a newer one");
}

void ShmGroup::beginOp(const OpCtx& op) {
  op_seq_ = op.seq;
  op_first_step_ = step_ + 1;
  posted_ready_ = false;
  verified_.assign(bases_.size(), 0);
  verified_[rank_] = 1;
  op.sig.pack(desc_words_);
  desc_pending_ = true;
}

// Published with the op's first flag (peers only read a descriptor after they saw a flag of
// the op): written just before the flag, so that a peer spinning on this rank's kReady line
// does not pull it away between the two writes.
void ShmGroup::publishDesc() {
  Desc& d = descOf(rank_, op_seq_);
  d[1].store(desc_words_[0], std::memory_order_relaxed);
  d[2].store(desc_words_[1], std::memory_order_relaxed);
  d[0].store(tag_ | op_seq_, std::memory_order_relaxed);  // ordered by the flag's seq_cst exchange
  desc_pending_ = false;
}

void ShmGroup::verify(const OpCtx& op, int r) {
  const Desc& d = descOf(r, op.seq);
  uint64_t theirs = d[0].load(std::memory_order_acquire);
  const uint64_t mine = tag_ | op.seq;
  if (theirs == mine) {
    uint64_t w[2] = {d[1].load(std::memory_order_relaxed), d[2].load(std::memory_order_relaxed)};
    OpSig sig = OpSig::unpack(w);
    if (op.sig.kind != OpKind::kNone && sig != op.sig) health_->mismatch(op, r, sig);
  } else if (theirs < mine) {
    // Its flag of a step of this op, posted before it began this op: the step counts of an
    // earlier op differed.
    health_->outOfStep(op, r, theirs & kStepMask);
  } else if (theirs >= next_tag_) {
    movedOn(op, r);
  }  // theirs > mine: it already finished this op (and checked it against others)
  verified_[r] = 1;
}

void ShmGroup::reportMismatch(const OpCtx& op) const {
  const int n = size();
  for (int slot = 0; slot < 2; ++slot) {
    std::vector<uint64_t> seqs(n);
    std::vector<OpSig> sigs(n);
    for (int r = 0; r < n; ++r) {
      const Desc& d = descOf(r, static_cast<uint64_t>(slot));
      seqs[r] = d[0].load(std::memory_order_acquire);
      uint64_t w[2] = {d[1].load(std::memory_order_relaxed), d[2].load(std::memory_order_relaxed)};
      sigs[r] = OpSig::unpack(w);
    }
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b)
        if (seqs[a] != 0 && seqs[a] == seqs[b] && (seqs[a] & ~kStepMask) == tag_ &&
            sigs[a] != sigs[b] && sigs[a].kind != OpKind::kNone && sigs[b].kind != OpKind::kNone)
          health_->mismatchBetween(op, seqs[a] & kStepMask, a, sigs[a], b, sigs[b]);
  }
}

bool ShmGroup::finishOp(const OpCtx& op) {
  if (op.seq != op_seq_ || size() == 1) return false;
  // Peers this rank wrote for but never waited on in the op have not been checked against:
  // wait for them to finish the op's last step, which checks their descriptor.
  if (posted_ready_) {
    for (int r = 0; r < size(); ++r)
      if (!verified_[r]) wait(op, r, kConsumed, step_);
  } else {
    // A rank that only received (a non-root of a broadcast or scatter) also hears from the
    // peers it never waited on: they reached this op (and called the same), or one refused it.
    for (int r = 0; r < size(); ++r)
      if (!verified_[r]) waitArrived(op, r);
  }
  return true;
}

template <class Done>
void ShmGroup::pollUntil(const OpCtx& op, int r, const char* what, Done&& done) {
  using engine::Clock;
  auto next_check = Clock::now();
  for (int i = 0; !done(); i += i < 1024) {  // (i stops at 1024: waits may be long)
    if (i < 256) {
      MC_PG_CPU_RELAX();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(i < 1024 ? 0 : 50));
    const auto now = Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::microseconds(wait_.health_us);
    checkRejects(op);
    checkAborts(op);
    health_->check(op, r);
    if (now >= op.deadline) health_->timedOut(op, r, what);
  }
}

void ShmGroup::waitArrived(const OpCtx& op, int r) {
  const Desc& d = descOf(r, op.seq);
  const uint64_t mine = tag_ | op.seq;
  pollUntil(op, r, "it did not reach the op",
            [&] { return d[0].load(std::memory_order_acquire) >= mine; });
  verify(op, r);
}

void ShmGroup::reject(const OpCtx& op, const std::string& why) {
  Header::Reject& n = hdr(rank_)->reject;
  std::snprintf(n.op, sizeof(n.op), "%s", op.name);
  std::snprintf(n.why, sizeof(n.why), "%s", why.c_str());
  n.seq.store(tag_ | op.seq, std::memory_order_release);
  for (auto& l : hdr(rank_)->flags) engine::futexWakeAll(futexWord(&l.v));  // sleepers look
}

// Only from the waits of host ops (slowWait, pollUntil), on the thread that runs them: not
// from checkHealth(), which stream-ordered ops call (on other threads, with sequence numbers
// of their own that may equal a refused host op's).
void ShmGroup::checkRejects(const OpCtx& op) const {
  if (op.seq != op_seq_) return;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    const Header::Reject& n = hdr(r)->reject;
    if (n.seq.load(std::memory_order_acquire) != (tag_ | op.seq)) continue;
    health_->rejected(op, r, std::string(n.op, strnlen(n.op, sizeof(n.op))),
                      std::string(n.why, strnlen(n.why, sizeof(n.why))));
  }
}

void ShmGroup::resync(const OpCtx& op) {
  if (size() == 1) return;
  const int slot = static_cast<int>(resyncs_++ & 1);
  Header::Resync& mine = hdr(rank_)->resync[slot];
  mine.step.store(step_, std::memory_order_relaxed);
  mine.seq.store(tag_ | op.seq, std::memory_order_release);
  uint64_t top = step_;
  // The op is over here (checkRejects: its refusal is known), and so is its descriptor, which
  // a rank that raised before its first flag never published (nor will: abort()).
  op_seq_ = 0;
  desc_pending_ = false;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    const Header::Resync& theirs = hdr(r)->resync[slot];
    pollUntil(op, r, "it did not resynchronise after a refused op",
              [&] { return theirs.seq.load(std::memory_order_acquire) == (tag_ | op.seq); });
    top = std::max(top, theirs.step.load(std::memory_order_relaxed));
  }
  // Every rank left the op: nobody reads a half of it. Go on from the highest step, with every
  // flag there (a peer that writes step top + 1 waits for kConsumed of top - 1).
  step_ = top;
  for (auto& l : hdr(rank_)->flags) {
    if (l.v.load(std::memory_order_relaxed) < target(top))
      l.v.store(target(top), std::memory_order_seq_cst);
    engine::futexWakeAll(futexWord(&l.v));
  }
}

void ShmGroup::setGpuHalf(uint64_t s, bool on) {
  std::atomic<uint32_t>& w = hdr(rank_)->flags[kReady].gpu_halves;
  const uint32_t bit = 1u << (s & 1), v = w.load(std::memory_order_relaxed);
  if (((v & bit) != 0) != on) w.store(on ? v | bit : v & ~bit, std::memory_order_relaxed);
}

void ShmGroup::barrierOp(const OpCtx& op) {
  if (size() == 1) return;
  uint64_t s = beginStep(op, false);
  post(kReady, s);
  waitAll(op, kReady, s);
  endStep(s);
}

void ShmGroup::announce(uint64_t s) {
  const bool had = posted_ready_;
  post(kReady, s);
  posted_ready_ = had;
}

void ShmGroup::post(Flag f, uint64_t s) {
  if (desc_pending_) publishDesc();
  if (f == kReady) posted_ready_ = true;
  Line& l = hdr(rank_)->flags[f];
  l.v.exchange(target(s), std::memory_order_seq_cst);  // full barrier: orders the waiters load
  if (l.waiters.load(std::memory_order_seq_cst) != 0) engine::futexWakeAll(futexWord(&l.v));
}

void ShmGroup::wait(const OpCtx& op, int r, Flag f, uint64_t s) {
  Line& l = hdr(r)->flags[f];
  const uint64_t t = target(s);
  uint64_t v = l.v.load(std::memory_order_acquire);
  if (v < t) {
    profile::Scope timed(profile::kFlagWait);
    slowWait(op, r, l, t);
    v = l.v.load(std::memory_order_acquire);
  }
  if (v >= next_tag_) movedOn(op, r);
  if (!verified_[r] && s >= op_first_step_ && op.seq == op_seq_) verify(op, r);
}

void ShmGroup::waitAll(const OpCtx& op, Flag f, uint64_t s) {
  for (int r = 0; r < size(); ++r)
    if (r != rank_) wait(op, r, f, s);
}

void ShmGroup::abort(int blamed, bool died) {
  // Peers that see the abort look for differing calls in the descriptors: show this op's.
  if (desc_pending_) publishDesc();
  uint64_t low = blamed >= 0 ? static_cast<uint64_t>(blamed) + 2 : 1;
  if (died && blamed >= 0) low |= kAbortDied;
  postAbort(low);
}

void ShmGroup::leave() { postAbort(kAbortLeft | 1); }

void ShmGroup::postAbort(uint64_t low) {
  // The first abort of this view wins; one of an older view is replaced.
  const uint64_t v = (epoch_ & 0xffffffffu) << 32 | low;
  std::atomic<uint64_t>& w = hdr(rank_)->abort.v;
  uint64_t cur = w.load(std::memory_order_acquire);
  while ((cur == 0 || (cur >> 32) < (epoch_ & 0xffffffffu)) &&
         !w.compare_exchange_weak(cur, v, std::memory_order_acq_rel)) {
  }
  // Wake every sleeper on this rank's flags so that they see the abort word now.
  for (auto& l : hdr(rank_)->flags) engine::futexWakeAll(futexWord(&l.v));
}

void ShmGroup::checkPeers(const OpCtx& op, int waiting_for) const {
  // Only the rank waited for: a peer that finished its part and exited is no failure. A
  // dead rank further down a chain of waits is reported through its waiter's abort word.
  // Abort words first: a peer that gave up (and may have exited since) says more than its
  // death does.
  checkAborts(op);
  health_->check(op, waiting_for);
  if (engine::Clock::now() >= op.deadline)
    health_->timedOut(op, waiting_for, "shared-memory flag not posted");
}

void ShmGroup::checkAborts(const OpCtx& op) const {
  const uint64_t my_epoch = epoch_ & 0xffffffffu;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    uint64_t a = hdr(r)->abort.v.load(std::memory_order_acquire);
    if (a == 0 || (a >> 32) < my_epoch) continue;  // none, or one of an older view
    if ((a >> 32) > my_epoch || (a & kAbortLeft) != 0) movedOn(op, r);
    // A peer that gave up because ranks called different collectives: say which, here too,
    // rather than only that it aborted.
    reportMismatch(op);
    const uint64_t code = a & kAbortCode;
    health_->aborted(op, r, code >= 2 ? static_cast<int>(code - 2) : -1, "",
                     (a & kAbortDied) != 0);
  }
}

// s: the flag value to wait for (target() of a step).
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
      checkRejects(op);  // (host ops only: not in checkPeers)
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
