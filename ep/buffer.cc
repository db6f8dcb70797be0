#include "ep/buffer.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "engine/futex.h"
#include "engine/log.h"
#include "engine/params.h"
#include "ep/ll_proxy.h"
#include "ep/peer_writer.h"
#include "ep/str.h"
#include "pg/copy.h"

namespace mooncake::ep {

namespace {

using engine::Clock;


// timeout_us -1 (Mooncake EP's "no timeout"), or one too long for the clock: a source is
// waited for until it delivers, its engine peer is seen dead, or it gives the round up.
engine::Deadline deadlineInUs(int64_t us) {
  if (us == -1 || us >= EpBuffer::kNoDeadlineUs) return engine::noDeadline();
  return Clock::now() + std::chrono::microseconds(std::max<int64_t>(us, 0));
}

}  // namespace

void EpBuffer::abandon(RoundKind kind, uint32_t round) {
  if (device_ >= 0) return deviceAbandon(kind, round);
  const int R = g_.size, me = g_.rank;
  Writer w(*this, engine::deadlineInMs(timeout_ms_), kind, round);
  for (int step = 1; step < R; ++step) {
    const int o = (me + step) % R;
    w.signal(o, geo_.abandonSignal(round & 1, static_cast<int>(kind), me), makeSignal(round, 1));
    w.commit(o);
  }
  (void)w.flush();  // a peer that cannot be told is dead, and its fate is decided elsewhere
  {  // Nothing of it will be read, but a hook may still read round - 2 there: its release marks.
    std::lock_guard<std::mutex> g(stream_mu_);
    const int k = static_cast<int>(kind), h = static_cast<int>(round & 1);
    if (hook_pending_[k][h] != 0) {
      given_up_[k][h] = round;
      return;
    }
  }
  markRead(kind, round);
}

void EpBuffer::checkHalfLocked(const char* op, RoundKind kind, uint32_t round) const {
  const uint32_t held = hook_pending_[static_cast<int>(kind)][round & 1];
  if (held != 0)
    throw std::invalid_argument(str(
        op, ": rank ", g_.rank, ": the ", op, " of round ", held - 1,
        " still waits for its hook() (return_recv_hook), and the buffer holds two calls of a "
        "kind in flight; call the hook first (this call's round is given up)"));
}

void EpBuffer::claimHalf(const char* op, RoundKind kind, uint32_t round, bool hook) {
  std::lock_guard<std::mutex> g(stream_mu_);
  checkHalfLocked(op, kind, round);
  if (hook) hook_pending_[static_cast<int>(kind)][round & 1] = round + 1;
}

void EpBuffer::releaseHalf(RoundKind kind, uint32_t round) {
  uint32_t mark = 0;
  {
    std::lock_guard<std::mutex> g(stream_mu_);
    const int k = static_cast<int>(kind), h = static_cast<int>(round & 1);
    if (hook_pending_[k][h] != round + 1) return;
    hook_pending_[k][h] = 0;
    const uint32_t gave = given_up_[k][h];  // (0: none)
    mark = gave != 0 && roundAfter(gave, round) ? gave : round;
    given_up_[k][h] = 0;
  }
  // A hook whose receive ran has marked its round already: nothing to queue then.
  if (device_ >= 0 || !roundAfter(mark, readMark(kind, mark))) return;
  // Behind the queue: an earlier asynchronous call may still read the half. (From destructors.)
  try {
    (void)enqueue([this, kind, mark] { markRead(kind, mark); });
  } catch (...) {
    MC_LOG(WARN, EP) << "ep: rank " << g_.rank << " could not queue read mark " << mark;
  }
}

bool EpBuffer::hookHolds(RoundKind kind, uint32_t round) {
  std::lock_guard<std::mutex> g(stream_mu_);
  return hook_pending_[static_cast<int>(kind)][round & 1] == round + 1;
}

bool EpBuffer::abandoned(RoundKind kind, uint32_t round, int r) {
  return signalWord(geo_.abandonSignal(round & 1, static_cast<int>(kind), r))
             ->load(std::memory_order_acquire) == makeSignal(round, 1);
}

std::function<bool(int)> EpBuffer::orAbandoned(RoundKind kind, uint32_t round,
                                               std::function<bool(int)> arrived) {
  return [this, kind, round, arrived = std::move(arrived)](int r) {
    return abandoned(kind, round, r) || arrived(r);
  };
}

std::function<void(int)> EpBuffer::unlessAbandoned(RoundKind kind, uint32_t round,
                                                   std::function<void(int)> on_arrival,
                                                   std::vector<int>* gave_up) {
  return [this, kind, round, on_arrival = std::move(on_arrival), gave_up](int r) {
    if (abandoned(kind, round, r)) {
      gave_up->push_back(r);
      return;
    }
    on_arrival(r);
  };
}

void EpBuffer::throwIfAbandoned(const char* op, uint32_t round,
                                const std::vector<int>& gave_up) const {
  if (gave_up.empty()) return;
  std::ostringstream os;
  os << op << ": rank " << g_.rank << ": rank";
  if (gave_up.size() > 1) os << "s";
  for (size_t i = 0; i < gave_up.size(); ++i) os << (i ? ", " : " ") << gave_up[i];
  os << " gave up round " << round
     << " (their own call was invalid and raised there, or, a GPU buffer across hosts, their "
        "host proxy could not move the rows: their log says which); this call's output is "
        "incomplete. After an invalid call the next round is in step on every rank.";
  throw std::runtime_error(os.str());
}

void EpBuffer::watchPeers() {
  if (gone_ptr_ == nullptr) {  // (device mode set host-mapped words already)
    gone_.reset(new int32_t[static_cast<size_t>(g_.size)]());
    gone_ptr_ = gone_.get();
  }
  gone_handler_ = g_.engine->addPeerGoneHandler(
      [this](uint64_t engine_id, const std::string&, const Status&) {
        for (int r = 0; r < g_.size; ++r)
          if (r != g_.rank && engine_ids_[r] == engine_id)
            __atomic_store_n(&gone_ptr_[r], 1, __ATOMIC_RELEASE);
      });
  // Gone before the handler was there: the engine said so already.
  for (int r = 0; r < g_.size; ++r)
    if (peerDead(r)) __atomic_store_n(&gone_ptr_[r], 1, __ATOMIC_RELEASE);
}

bool EpBuffer::peerDead(int r) const {
  return r != g_.rank && !g_.engine->peerStatus(g_.peers[r]).ok();
}

void EpBuffer::waitSources(std::vector<int>& pending, engine::Deadline deadline,
                           const std::function<bool(int)>& arrived,
                           const std::function<void(int)>& on_arrival,
                           const std::function<void(int)>& on_silent) {
  const auto spin_end = Clock::now() + std::chrono::microseconds(spin_us_);
  auto next_liveness = Clock::now() + std::chrono::milliseconds(1);
  // A peer seen dead may have sent everything just before it went: its signal message can
  // still be queued in this engine behind the notice of its death. Wait a grace period.
  std::vector<Clock::time_point> dead_since(g_.size, Clock::time_point::max());
  while (!pending.empty()) {
    uint32_t bell = doorbell()->load(std::memory_order_acquire);
    bool progress = false;
    for (size_t i = 0; i < pending.size();) {
      if (arrived(pending[i])) {
        on_arrival(pending[i]);
        pending.erase(pending.begin() + static_cast<long>(i));
        progress = true;
      } else {
        ++i;
      }
    }
    if (pending.empty() || progress) continue;
    auto now = Clock::now();
    if (now >= deadline) {
      for (int r : pending) on_silent(r);
      pending.clear();
      break;
    }
    if (now >= next_liveness) {
      next_liveness = now + std::chrono::milliseconds(1);
      for (size_t i = 0; i < pending.size();) {
        const int r = pending[i];
        if (dead_since[r] == Clock::time_point::max() && peerDead(r)) dead_since[r] = now;
        if (dead_since[r] != Clock::time_point::max() && now - dead_since[r] >= kDeadPeerGrace) {
          on_silent(r);
          pending.erase(pending.begin() + static_cast<long>(i));
        } else {
          ++i;
        }
      }
      continue;
    }
    if (now < spin_end) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    auto slice = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(1));
    engine::futexWait(doorbell(), bell, slice);
  }
}

// ---------------------------------------------------------------------------------------
// ordering

std::shared_ptr<EpEvent> EpBuffer::enqueue(std::function<void()> fn) {
  auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
  auto ev = std::make_shared<EpEvent>(task->get_future().share());
  {
    std::lock_guard<std::mutex> g(q_mu_);
    if (!worker_.joinable()) worker_ = std::thread([this] { workerLoop(); });
    q_.push_back([task] { (*task)(); });
  }
  q_cv_.notify_all();
  return ev;
}

void EpBuffer::runSync(const std::function<void()>& fn) {
  {
    std::unique_lock<std::mutex> g(q_mu_);
    q_cv_.wait(g, [&] { return q_.empty() && !q_busy_; });
    q_busy_ = true;
  }
  struct Release {
    EpBuffer* b;
    ~Release() {
      {
        std::lock_guard<std::mutex> g(b->q_mu_);
        b->q_busy_ = false;
      }
      b->q_cv_.notify_all();
    }
  } release{this};
  fn();
}

void EpBuffer::workerLoop() {
  std::unique_lock<std::mutex> g(q_mu_);
  for (;;) {
    // Drains the queue before stopping (tasks enqueued before destruction still run).
    q_cv_.wait(g, [&] { return (q_stop_ && q_.empty()) || (!q_.empty() && !q_busy_); });
    if (q_.empty()) return;
    std::function<void()> fn = std::move(q_.front());
    q_.pop_front();
    q_busy_ = true;
    g.unlock();
    fn();          // a packaged_task: exceptions land in its future
    fn = nullptr;  // releases the task's tensors outside the lock
    g.lock();
    q_busy_ = false;
    q_cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------
// low-latency mode

void EpBuffer::validate(const LowLatencyDispatchArgs& a, bool data) const {
  const std::string op = "dispatch";
  const int R = g_.size;
  if (a.experts <= 0 || a.experts % R != 0)
    invalid(op,
            str("num_experts=", a.experts, " must be a positive multiple of the group size ", R));
  if (a.experts > kMaxSignals) invalid(op, str("num_experts=", a.experts, " above ", kMaxSignals));
  if (a.max_tokens <= 0) invalid(op, str("num_max_dispatch_tokens_per_rank=", a.max_tokens));
  if (a.tokens < 0 || a.tokens > a.max_tokens)
    invalid(op, str("x has ", a.tokens,
                    " tokens, above num_max_dispatch_tokens_per_rank=", a.max_tokens));
  if (a.hidden <= 0) invalid(op, str("hidden size ", a.hidden));
  if (a.topk <= 0) invalid(op, str("topk_idx has ", a.topk, " columns"));
  if (a.timeout_us < -1) invalid(op, str("timeout_us=", a.timeout_us, " (-1: no timeout)"));
  if (a.dtype == DType::kFp8 && a.hidden % num::kFp8Group != 0)
    invalid(op, str("use_fp8 needs a hidden size that is a multiple of ", num::kFp8Group, ", got ",
                    a.hidden));
  auto l = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  if (std::max(l.dispatch_bytes, l.combine_bytes) > geo_.regionBytes())
    invalid(op, str("M=", a.max_tokens, " H=", a.hidden, " E=", a.experts, " ", dtypeName(a.dtype),
                    " needs ", sizeHint(a.max_tokens, a.hidden, R, a.experts),
                    " buffer bytes; this buffer has ", geo_.totalBytes()));
  if (!data) return;  // (shapes only: the outputs may not exist yet)
  if (a.dtype == DType::kFp8 && a.recv_scales == nullptr)
    invalid(op, "use_fp8 without an output for the scales");
  if (device_ >= 0) {  // the indices are GPU memory: check a host copy
    validateTopk(hostCopy(a.topk_idx, a.tokens * a.topk, op.c_str()).data(), a.tokens, a.topk,
                 a.experts);
    return;
  }
  validateTopk(a.topk_idx, a.tokens, a.topk, a.experts);
}

void EpBuffer::dispatchSend(const LowLatencyDispatchArgs& a, uint32_t round) {
  const MarkOnExit if_thrown(this, RoundKind::kDispatch, round, true);
  (void)awaitRead("dispatch", RoundKind::kDispatch, round, a.active_ranks,
                  deadlineInUs(a.timeout_us));
  if (kernelPath()) return kernelDispatchSend(a, round);
  const int R = g_.size, me = g_.rank, h = round & 1;
  const auto lay = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  const int L = lay.local_experts;
  // Rows travel in their wire format: the caller's rows, or (fp8) each token quantized once.
  const size_t row_bytes = wireRowBytes(a.hidden, a.dtype);
  const char* x = static_cast<const char*>(a.x);
  std::vector<uint8_t> packed;
  if (a.dtype == DType::kFp8) {
    packed.resize(static_cast<size_t>(a.tokens) * row_bytes);
    for (int64_t t = 0; t < a.tokens; ++t)
      num::quantizeRow(static_cast<const uint16_t*>(a.x) + t * a.hidden, a.hidden,
                       packed.data() + t * row_bytes);
    x = reinterpret_cast<const char*>(packed.data());
  }
  // Pass 1: slot of each (token, expert) pair, grouped by destination rank.
  std::vector<uint32_t> count(a.experts, 0);
  std::vector<std::vector<int32_t>> tokens_of(a.experts);  // source token ids per expert
  for (int64_t t = 0; t < a.tokens; ++t) {
    for (int k = 0; k < a.topk; ++k) {
      int64_t e = a.topk_idx[t * a.topk + k];
      if (e < 0 || a.active_ranks[ownerOf(e, L)] == 0) continue;
      tokens_of[e].push_back(static_cast<int32_t>(t));
      ++count[e];
    }
  }
  // Pass 2: destination-major copies, starting after this rank so that ranks spread out;
  // each destination gets its signals as soon as its rows are in place.
  Writer w(*this, engine::deadlineInMs(timeout_ms_), RoundKind::kDispatch, round);
  const size_t region = geo_.dispatchRegion(h);
  const int64_t RM = R * a.max_tokens;
  for (int step = 1; step <= R; ++step) {
    const int o = (me + step) % R;
    if (a.active_ranks[o] == 0) continue;
    if (o == me) {
      // Rows for local experts go straight to recv_x as the first block (begin 0);
      // dispatchRecv places the other sources' blocks after them.
      for (int l = 0; l < L; ++l) {
        const auto& toks = tokens_of[me * L + l];
        if (a.dtype == DType::kFp8) {
          for (size_t j = 0; j < toks.size(); ++j)
            storeRecvRows(a, l * RM + j, x + toks[j] * row_bytes, row_bytes, 1, false);
        } else {
          char* dst = static_cast<char*>(a.recv_x) + l * RM * row_bytes;
          gatherRows(dst, row_bytes, x, row_bytes, toks.data(), toks.size());
        }
        std::memcpy(a.src_info + l * RM, toks.data(), toks.size() * 4);
      }
      continue;
    }
    for (int l = 0; l < L; ++l) {
      const int e = o * L + l;
      const auto& toks = tokens_of[e];
      w.copyRows(o, region + lay.dispatchRow(l, me, 0), lay.row_stride, x, row_bytes, toks);
      w.copy(o, region + lay.dispatchSrc(l, me, 0), toks.data(), toks.size() * 4);
      w.signal(o, geo_.dispatchSignal(h, l * R + me), makeSignal(round, count[e]));
    }
    w.commit(o);
  }
  for (int r : w.flush()) a.active_ranks[r] = 0;
  w.keepWhileLate(a.inputs);
  w.keepLocalWhileLate(packed);
  w.keepLocalWhileLate(tokens_of);
}

void EpBuffer::storeRecvRows(const LowLatencyDispatchArgs& a, int64_t first, const char* src,
                             size_t src_stride, int64_t n, bool stream) {
  if (a.dtype != DType::kFp8) {
    const size_t row_bytes = wireRowBytes(a.hidden, a.dtype);
    char* dst = static_cast<char*>(a.recv_x) + first * row_bytes;
    if (src_stride == row_bytes) {
      pg::copyOut(dst, src, n * row_bytes, stream);
    } else {
      for (int64_t j = 0; j < n; ++j)
        pg::copyOut(dst + j * row_bytes, src + j * src_stride, row_bytes, stream);
    }
    return;
  }
  // fp8: the e4m3 bytes to recv_x, the scales after them to recv_scales.
  const int64_t groups = a.hidden / num::kFp8Group;
  for (int64_t j = 0; j < n; ++j) {
    const char* row = src + j * src_stride;
    pg::copyOut(static_cast<char*>(a.recv_x) + (first + j) * a.hidden, row, a.hidden, stream);
    std::memcpy(a.recv_scales + (first + j) * groups, row + a.hidden, groups * 4);
  }
}

void EpBuffer::dispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round) {
  const MarkOnExit done(this, RoundKind::kDispatch, round, false);
  if (kernelPath()) return kernelDispatchRecv(a, round);
  const int R = g_.size, h = round & 1;
  const auto lay = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  const int L = lay.local_experts;
  const int64_t RM = R * a.max_tokens;
  const size_t row_bytes = wireRowBytes(a.hidden, a.dtype);
  const char* region = base_ + geo_.dispatchRegion(h);
  const int me = g_.rank;
  // A large recv_x (by its capacity) is written with streaming stores, as in normal mode.
  const bool stream =
      static_cast<int64_t>(L) * RM * static_cast<int64_t>(row_bytes) >= stream_out_bytes_;
  std::vector<int64_t> begin(L, 0);
  std::vector<int> pending;
  for (int r = 0; r < R; ++r) {
    if (a.active_ranks[r] != 0 && r != me) pending.push_back(r);
    for (int l = 0; l < L; ++l) a.layout_range[l * R + r] = 0;
  }
  if (a.active_ranks[me] != 0) {  // dispatchSend wrote this rank's own rows first
    for (int64_t i = 0; i < a.tokens * a.topk; ++i) {
      const int64_t e = a.topk_idx[i];
      if (e >= 0 && ownerOf(e, L) == me) ++begin[e - me * L];
    }
    for (int l = 0; l < L; ++l) a.layout_range[l * R + me] = begin[l];
  }
  auto arrived = [&](int r) {
    for (int l = 0; l < L; ++l)
      if (signalRound(
              signalWord(geo_.dispatchSignal(h, l * R + r))->load(std::memory_order_acquire)) !=
          round)
        return false;
    return true;
  };
  auto on_arrival = [&](int r) {
    for (int l = 0; l < L; ++l) {
      const int64_t c = signalCount(
          signalWord(geo_.dispatchSignal(h, l * R + r))->load(std::memory_order_acquire));
      if (c > a.max_tokens)
        throw std::runtime_error(str("dispatch: rank ", r, " sent ", c, " rows for local expert ",
                                     l, ", above M=", a.max_tokens, " (M differs across ranks?)"));
      const int64_t b = begin[l];
      storeRecvRows(a, l * RM + b, region + lay.dispatchRow(l, r, 0), lay.row_stride, c, stream);
      std::memcpy(a.src_info + l * RM + b, region + lay.dispatchSrc(l, r, 0), c * 4);
      a.layout_range[l * R + r] = (b << 32) | c;
      begin[l] = b + c;
    }
  };
  auto on_silent = [&](int r) {
    MC_LOG(WARN, EP) << "dispatch: rank " << g_.rank << " got nothing from rank " << r
                     << " in round " << round << "; marking it inactive";
    a.active_ranks[r] = 0;
  };
  struct FenceOnExit {  // also when on_arrival throws after streaming some rows
    bool on;
    ~FenceOnExit() {
      if (on) pg::streamFence();
    }
  } fence{stream};
  std::vector<int> gave_up;
  waitSources(pending, deadlineInUs(a.timeout_us),
              orAbandoned(RoundKind::kDispatch, round, arrived),
              unlessAbandoned(RoundKind::kDispatch, round, on_arrival, &gave_up), on_silent);
  throwIfAbandoned("dispatch", round, gave_up);
  for (int l = 0; l < L; ++l) {
    a.recv_count[l] = static_cast<int32_t>(begin[l]);
    for (int r = 0; r < R; ++r)
      if ((a.layout_range[l * R + r] & 0xffffffff) == 0)
        a.layout_range[l * R + r] = begin[l] << 32;  // empty blocks sit at the end
  }
}

void EpBuffer::validate(const LowLatencyCombineArgs& a, bool data) const {
  const std::string op = "combine";
  const int R = g_.size;
  if (a.experts <= 0 || a.experts % R != 0 || a.experts > kMaxSignals)
    invalid(op, str("handle's num_experts=", a.experts, " does not fit group size ", R));
  if (a.max_tokens <= 0 || a.tokens < 0 || a.tokens > a.max_tokens)
    invalid(op, str("topk_idx has ", a.tokens, " rows; the handle's M is ", a.max_tokens));
  if (a.topk <= 0) invalid(op, str("topk_idx has ", a.topk, " columns"));
  if (a.timeout_us < -1) invalid(op, str("timeout_us=", a.timeout_us, " (-1: no timeout)"));
  if (a.dtype == DType::kFp8) invalid(op, "y must be bfloat16 or float32, not fp8");
  if (kernelPath() && a.topk > kern::kMaxTopk)
    invalid(op, str("topk_idx has ", a.topk, " columns; the kernels take at most ", kern::kMaxTopk,
                    " (MC_EP_KERNELS=host)"));
  auto l = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  if (std::max(l.dispatch_bytes, l.combine_bytes) > geo_.regionBytes())
    invalid(op, str("M=", a.max_tokens, " H=", a.hidden, " E=", a.experts, " ", dtypeName(a.dtype),
                    " does not fit this buffer (", geo_.totalBytes(), " bytes)"));
  if (!data) return;
  const int L = a.experts / R;
  const int64_t RM = R * a.max_tokens;
  // A GPU buffer's arguments are GPU memory: the checks read host copies.
  std::vector<int64_t> topk_h, layout_h;
  std::vector<int32_t> src_h;
  const int64_t* topk_idx = a.topk_idx;
  const int64_t* layout_range = a.layout_range;
  const int32_t* src_info = a.src_info;
  if (device_ >= 0) {
    topk_h = hostCopy(a.topk_idx, a.tokens * a.topk, op.c_str());
    layout_h = hostCopy(a.layout_range, static_cast<int64_t>(L) * R, op.c_str());
    src_h = hostCopy(a.src_info, L * RM, op.c_str());
    topk_idx = topk_h.data();
    layout_range = layout_h.data();
    src_info = src_h.data();
  }
  validateTopk(topk_idx, a.tokens, a.topk, a.experts);
  for (int l = 0; l < L; ++l) {
    int64_t end = 0;
    for (int r = 0; r < R; ++r) {
      int64_t v = layout_range[l * R + r];
      int64_t b = v >> 32, c = v & 0xffffffff;
      if (b < 0 || c > a.max_tokens || b + c > RM)
        invalid(op, str("layout_range[", l, "][", r, "] = ", v, " is outside [0, R*M)"));
      for (int64_t i = b; i < b + c; ++i) {
        int32_t t = src_info[l * RM + i];
        if (t < 0 || t >= a.max_tokens)
          invalid(op, str("src_info[", l, "][", i, "] = ", t, " is not a token index < M"));
      }
      end = std::max(end, b + c);
    }
    (void)end;
  }
}

void EpBuffer::combineSend(const LowLatencyCombineArgs& a, uint32_t round) {
  const MarkOnExit if_thrown(this, RoundKind::kCombine, round, true);
  (void)awaitRead("combine", RoundKind::kCombine, round, a.active_ranks,
                  deadlineInUs(a.timeout_us));
  if (kernelPath()) return kernelCombineSend(a, round);
  const int R = g_.size, me = g_.rank, h = round & 1;
  const auto lay = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  const int L = lay.local_experts;
  const int64_t RM = R * a.max_tokens;
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtypeBytes(a.dtype);
  const char* y = static_cast<const char*>(a.y);
  const size_t region = geo_.combineRegion(h);
  Writer w(*this, engine::deadlineInMs(timeout_ms_), RoundKind::kCombine, round);
  for (int step = 1; step <= R; ++step) {
    const int r = (me + step) % R;
    if (a.active_ranks[r] == 0 || r == me) continue;  // own rows are read from y directly
    uint32_t rows = 0;
    for (int l = 0; l < L; ++l) {
      const int64_t v = a.layout_range[l * R + r];
      const int64_t b = v >> 32, c = v & 0xffffffff;
      for (int64_t i = b; i < b + c; ++i)
        w.copy(r, region + lay.combineRow(me * L + l, a.src_info[l * RM + i]),
               y + (l * RM + i) * row_bytes, row_bytes);
      rows += static_cast<uint32_t>(c);
    }
    w.signal(r, geo_.combineSignal(h, me), makeSignal(round, rows));
    w.commit(r);
  }
  for (int r : w.flush()) a.active_ranks[r] = 0;
  w.keepWhileLate(a.inputs);
}

void EpBuffer::combineRecv(const LowLatencyCombineArgs& a, uint32_t round) {
  const MarkOnExit done(this, RoundKind::kCombine, round, false);
  if (kernelPath()) return kernelCombineRecv(a, round);
  const int R = g_.size, h = round & 1;
  const auto lay = LowLatencyLayout::make(R, a.experts, a.max_tokens, a.hidden, a.dtype);
  const int L = lay.local_experts;
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtypeBytes(a.dtype);
  // Rows each owner should send back: one per (token, expert on that owner).
  std::vector<uint32_t> expected(R, 0);
  for (int64_t i = 0; i < a.tokens * a.topk; ++i)
    if (a.topk_idx[i] >= 0) ++expected[ownerOf(a.topk_idx[i], L)];
  std::vector<int> pending;
  for (int r = 0; r < R; ++r)
    if (a.active_ranks[r] != 0 && r != g_.rank) pending.push_back(r);
  auto arrived = [&](int o) {
    return signalRound(signalWord(geo_.combineSignal(h, o))->load(std::memory_order_acquire)) ==
           round;
  };
  auto on_arrival = [&](int o) {
    uint32_t got =
        signalCount(signalWord(geo_.combineSignal(h, o))->load(std::memory_order_acquire));
    if (got != expected[o])
      throw std::runtime_error(str("combine: rank ", o, " returned ", got, " rows to rank ",
                                   g_.rank, ", expected ", expected[o],
                                   " (topk_idx differs from the dispatch's?)"));
  };
  auto on_silent = [&](int o) {
    MC_LOG(WARN, EP) << "combine: rank " << g_.rank << " got nothing from rank " << o
                     << " in round " << round << "; marking it inactive";
    a.active_ranks[o] = 0;
  };
  std::vector<int> gave_up;
  waitSources(pending, deadlineInUs(a.timeout_us),
              orAbandoned(RoundKind::kCombine, round, arrived),
              unlessAbandoned(RoundKind::kCombine, round, on_arrival, &gave_up), on_silent);
  throwIfAbandoned("combine", round, gave_up);

  // Rows this rank computed for its own tokens: y[l][i] with src_info[l][i] = t.
  const int me = g_.rank;
  const int64_t RM = R * a.max_tokens;
  std::vector<int64_t> own(static_cast<size_t>(L) * a.max_tokens, -1);
  for (int l = 0; l < L; ++l) {
    const int64_t v = a.layout_range[l * R + me];
    for (int64_t i = v >> 32; i < (v >> 32) + (v & 0xffffffff); ++i)
      own[l * a.max_tokens + a.src_info[l * RM + i]] = l * RM + i;
  }
  const char* region = base_ + geo_.combineRegion(h);
  const char* y = static_cast<const char*>(a.y);
  char* out = static_cast<char*>(a.out);
  std::vector<const void*> rows(a.topk);
  std::vector<float> ws(a.topk);
  for (int64_t t = 0; t < a.tokens; ++t) {
    int n = 0;
    for (int k = 0; k < a.topk; ++k) {
      const int64_t e = a.topk_idx[t * a.topk + k];
      const int o = e < 0 ? -1 : ownerOf(e, L);
      if (o < 0 || a.active_ranks[o] == 0) continue;
      if (o == me) {
        const int64_t i = own[(e - me * L) * a.max_tokens + t];
        if (i < 0)
          throw std::runtime_error(str("combine: the handle has no row for token ", t,
                                       " of expert ", e, " (handle from another dispatch?)"));
        rows[n] = y + i * row_bytes;
      } else {
        rows[n] = region + lay.combineRow(static_cast<int>(e), t);
      }
      ws[n++] = a.topk_weights[t * a.topk + k];
    }
    combineRows(out + t * row_bytes, rows.data(), ws.data(), n, a.dtype, a.hidden);
  }
}

}  // namespace mooncake::ep
