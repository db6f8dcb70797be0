// The low-latency calls through the CUDA kernels' bodies (ep/kernels/ll_kernels.h) run on
// this thread by ep/kernels/host_lanes.h (MC_EP_KERNELS=host): one call per block, in an
// order that lets a single thread finish every block (a dispatch's sends before its
// receives, a combine's owner waits before its tokens).
#include <chrono>
#include <memory>
#include <stdexcept>

#include "engine/log.h"
#include "ep/buffer.h"
#include "ep/kernels/host_lanes.h"
#include "ep/str.h"

namespace mooncake::ep {

kern::HostLanes EpBuffer::watchingLanes() const {
  using Clock = std::chrono::steady_clock;
  struct Watch {
    std::vector<Clock::time_point> dead_since, next_check;
  };
  auto w = std::make_shared<Watch>();
  w->dead_since.assign(g_.size, Clock::time_point::max());
  w->next_check.assign(g_.size, Clock::time_point::min());
  kern::HostLanes ln;
  ln.gone = [this, w](int r) {
    const auto now = Clock::now();
    if (w->dead_since[r] == Clock::time_point::max() && now >= w->next_check[r]) {
      w->next_check[r] = now + std::chrono::milliseconds(1);
      if (peerDead(r)) w->dead_since[r] = now;
    }
    return w->dead_since[r] != Clock::time_point::max() && now - w->dead_since[r] >= kDeadPeerGrace;
  };
  return ln;
}

bool EpBuffer::kernelPath() const {
  if (!host_kernels_) return false;
  for (char* m : mapped_)
    if (m == nullptr) return false;
  return true;
}

kern::LlArgs EpBuffer::kernelArgs(uint32_t round, RoundKind kind, int experts, int64_t max_tokens,
                                  int64_t hidden, DType dtype) const {
  const int h = round & 1;
  const auto lay = LowLatencyLayout::make(g_.size, experts, max_tokens, hidden, dtype);
  kern::LlArgs p;
  p.me = g_.rank;
  p.world = g_.size;
  p.local_experts = lay.local_experts;
  p.dtype = static_cast<int>(dtype);
  p.max_tokens = max_tokens;
  p.hidden = hidden;
  p.round = round;
  p.peers = mapped_.data();
  p.dispatch_region = geo_.dispatchRegion(h);
  p.combine_region = geo_.combineRegion(h);
  p.dispatch_signals = geo_.dispatchSignal(h, 0);
  p.combine_signals = geo_.combineSignal(h, 0);
  p.abandon_signals = geo_.abandonSignal(h, static_cast<int>(kind), 0);
  p.row_stride = lay.row_stride;
  p.src_base = lay.src_base;
  return p;
}

kern::LlArgs EpBuffer::kernelArgs(const LowLatencyDispatchArgs& a, uint32_t round) const {
  kern::LlArgs p =
      kernelArgs(round, RoundKind::kDispatch, a.experts, a.max_tokens, a.hidden, a.dtype);
  p.x = a.x;
  p.tokens = a.tokens;
  p.topk_idx = a.topk_idx;
  p.topk = a.topk;
  p.active = a.active_ranks;
  p.timeout_us = a.timeout_us;
  p.recv_x = a.recv_x;
  p.recv_scales = a.recv_scales;
  p.recv_count = a.recv_count;
  p.src_info = a.src_info;
  p.layout_range = a.layout_range;
  return p;
}

kern::LlArgs EpBuffer::kernelArgs(const LowLatencyCombineArgs& a, uint32_t round) const {
  kern::LlArgs p =
      kernelArgs(round, RoundKind::kCombine, a.experts, a.max_tokens, a.hidden, a.dtype);
  p.y = a.y;
  p.tokens = a.tokens;
  p.topk = a.topk;
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.active = a.active_ranks;
  p.timeout_us = a.timeout_us;
  p.src_info = const_cast<int32_t*>(a.src_info);  // (read only by the combine bodies)
  p.layout_range = const_cast<int64_t*>(a.layout_range);
  p.out = a.out;
  return p;
}

void EpBuffer::kernelOutcome(const char* op, uint32_t round, const std::vector<int32_t>& decision,
                             const std::vector<int32_t>& was_active) {
  std::vector<int> gave_up;
  for (int r = 0; r < g_.size; ++r) {
    if (decision[r] == kern::kGaveUp) gave_up.push_back(r);
    if (decision[r] == kern::kSilent && was_active[r] != 0) {
      MC_LOG(WARN, EP) << op << ": rank " << g_.rank << " got nothing from rank " << r
                       << " in round " << round << "; marking it inactive";
    }
  }
  throwIfAbandoned(op, round, gave_up);
}

void EpBuffer::kernelDispatchSend(const LowLatencyDispatchArgs& a, uint32_t round) {
  kern::LlArgs p = kernelArgs(a, round);
  std::vector<int32_t>& own = self_count_[round & 1];
  own.assign(p.local_experts, 0);
  p.self_count = own.data();
  std::vector<int32_t> toks(static_cast<size_t>(a.max_tokens));
  kern::HostLanes ln;
  const int R = g_.size, L = p.local_experts;
  for (int step = 1; step <= R; ++step) {  // other ranks first, from the next one on
    const int o = (g_.rank + step) % R;
    for (int l = 0; l < L; ++l) kern::dispatchSend(p, o * L + l, ln, toks.data());
  }
}

void EpBuffer::kernelDispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round) {
  kern::LlArgs p = kernelArgs(a, round);
  std::vector<int32_t>& own = self_count_[round & 1];
  own.resize(p.local_experts, 0);
  p.self_count = own.data();
  const std::vector<int32_t> was_active(a.active_ranks, a.active_ranks + g_.size);
  std::vector<int32_t> decision(g_.size, kern::kUndecided), error(2, kern::kNoError);
  p.decision = decision.data();
  p.error = error.data();
  kern::HostLanes ln = watchingLanes();
  const int64_t start = ln.nowUs();
  for (int l = 0; l < p.local_experts; ++l) kern::dispatchRecv(p, l, ln, start);
  kernelOutcome("dispatch", round, decision, was_active);
  if (error[0] == kern::kTooManyRows)
    throw std::runtime_error(str("dispatch: rank ", error[1], " sent more than M=", a.max_tokens,
                                 " rows for a local expert of rank ", g_.rank,
                                 " (M differs across ranks?)"));
}

void EpBuffer::kernelCombineSend(const LowLatencyCombineArgs& a, uint32_t round) {
  kern::LlArgs p = kernelArgs(a, round);
  kern::HostLanes ln;
  for (int step = 1; step < g_.size; ++step) kern::combineSend(p, (g_.rank + step) % g_.size, ln);
}

void EpBuffer::kernelCombineRecv(const LowLatencyCombineArgs& a, uint32_t round) {
  kern::LlArgs p = kernelArgs(a, round);
  const std::vector<int32_t> was_active(a.active_ranks, a.active_ranks + g_.size);
  std::vector<int32_t> decision(g_.size, kern::kUndecided), error(2, kern::kNoError);
  p.decision = decision.data();
  p.error = error.data();
  kern::HostLanes ln = watchingLanes();
  const int64_t start = ln.nowUs();
  for (int o = 0; o < g_.size; ++o) kern::combineWait(p, o, ln, start);
  kernelOutcome("combine", round, decision, was_active);
  if (error[0] == kern::kWrongRowCount)
    throw std::runtime_error(str("combine: rank ", error[1], " returned another number of rows "
                                 "to rank ", g_.rank,
                                 " than its topk_idx routes there (topk_idx differs from the "
                                 "dispatch's?)"));
  for (int64_t t = 0; t < a.tokens; ++t) kern::combineRecvToken(p, t, ln);
  if (error[0] == kern::kNoOwnRow)
    throw std::runtime_error(str("combine: the handle has no row for token ", error[1],
                                 " of an expert of rank ", g_.rank,
                                 " (handle from another dispatch?)"));
}

}  // namespace mooncake::ep
