// Low-latency and normal calls through the CUDA kernels' bodies (ep/kernels/ll_kernels.h,
// normal_kernels.h) run by ep/kernels/host_lanes.h (MC_EP_KERNELS=host: one lane on the calling
// thread; threads: 4 lane threads a block): blocks one after another, in an order that lets
// them all finish (a call's sends before its waits, its waits before its receives).
#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>

#include "engine/log.h"
#include "ep/buffer.h"
#include "ep/kernels/host_lanes.h"
#include "ep/ll_proxy.h"
#include "ep/str.h"

namespace mooncake::ep {

// The kernels take the dtype as an int (ep/kernels/ll_kernels.h does not include layout.h).
static_assert(static_cast<int>(DType::kBFloat16) == kern::kDtypeBf16 &&
              static_cast<int>(DType::kFloat32) == kern::kDtypeF32 &&
              static_cast<int>(DType::kFp8) == kern::kDtypeFp8);

bool EpBuffer::kernelPath() const {
  if (device_ >= 0) return true;
  if (kernel_lanes_ == 0) return false;
  for (char* m : mapped_)
    if (m == nullptr) return false;
  return true;
}

kern::LlArgs EpBuffer::kernelArgs(uint32_t round, RoundKind kind, int experts, int64_t max_tokens,
                                  int64_t hidden, DType dtype) const {
  const auto lay = LowLatencyLayout::make(g_.size, experts, max_tokens, hidden, dtype);
  kern::LlArgs p;
  p.me = g_.rank;
  p.world = g_.size;
  p.local_experts = lay.local_experts;
  p.dtype = static_cast<int>(dtype);
  p.max_tokens = max_tokens;
  p.hidden = hidden;
  p.round = round;
  p.gone = gone_ptr_;
  p.gone_grace_us = kGoneGraceUs;
  p.peers = mapped_.data();
  setRoundOffsets(p, geo_, round, static_cast<int>(kind));
  p.row_stride = lay.row_stride;
  p.src_base = lay.src_base;
  if (proxy_) proxy_->fill(p, kind, round);  // (ranks on other hosts: ll_proxy.h)
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

void EpBuffer::throwKernelError(const char* op, const int32_t* error, int64_t max_tokens,
                                const int32_t* counts, int64_t capacity) const {
  const std::string o(op);
  const bool normal = o.rfind("normal_", 0) == 0;
  switch (error[0]) {
    case kern::kTooManyRows:
      if (normal)
        throw std::runtime_error(str(op, ": rank ", error[1], " sent ", counts[error[1]],
                                     " rows, above capacity ", capacity,
                                     " (H, K or dtype differ across ranks?)"));
      throw std::runtime_error(str(op, ": rank ", error[1], " sent more than M=", max_tokens,
                                   " rows for a local expert of rank ", g_.rank,
                                   " (M differs across ranks?)"));
    case kern::kWrongRowCount:
      if (o == "normal_dispatch")
        throw std::runtime_error(str(op, ": rank ", g_.rank,
                                     " counted another number of own rows than it signalled"));
      if (normal)
        throw std::runtime_error(str(op, ": rank ", error[1],
                                     " returned another number of rows to rank ", g_.rank,
                                     " than it was sent (handle from another dispatch?)"));
      throw std::runtime_error(str(op, ": rank ", error[1], " returned another number of rows "
                                   "to rank ", g_.rank,
                                   " than its topk_idx routes there (topk_idx differs from the "
                                   "dispatch's?)"));
    case kern::kBadTopk:
      throw std::invalid_argument(str(op, ": rank ", g_.rank, ": topk_idx of token ", error[1],
                                      " names an expert outside [-1, num_experts) or one expert twice"));
    case kern::kBadHandle:
      throw std::invalid_argument(str(op, ": rank ", g_.rank, ": the handle's layout_range or "
                                      "src_info of local expert ", error[1],
                                      " is out of its bounds (handle from another dispatch?)"));
    case kern::kOverrun:
      throw std::runtime_error(str(
          op, ": rank ", error[1], "'s call two rounds later reached rank ", g_.rank,
          "'s buffer before rank ", g_.rank, " read this round (its rows from rank ", error[1],
          " are lost): a GPU buffer does not hold a third call of a kind back until every rank "
          "read the first (docs/ep.md, \"Rounds and ordering\")"));
    case kern::kNoOwnRow:
      throw std::runtime_error(str(op, ": the handle has no row for token ", error[1],
                                   " of an expert of rank ", g_.rank,
                                   " (handle from another dispatch?)"));
    default:
      return;
  }
}

void EpBuffer::kernelDispatchSend(const LowLatencyDispatchArgs& a, uint32_t round) {
  if (device_ >= 0) return deviceDispatchSend(a, round);
  kern::LlArgs p = kernelArgs(a, round);
  std::vector<int32_t>& own = self_count_[round & 1];
  own.assign(p.local_experts, 0);
  p.self_count = own.data();
  std::vector<int32_t> toks(static_cast<size_t>(a.max_tokens));
  kern::HostLanes ln;
  const int R = g_.size, L = p.local_experts;
  // Experts of the other ranks first, from the next rank on.
  kern::runBlocks(R * L, kernel_lanes_, ln, [&](auto& lanes, int i) {
    kern::dispatchSend(p, ((g_.rank + 1 + i / L) % R) * L + i % L, lanes, toks.data());
  });
}

void EpBuffer::kernelDispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round) {
  if (device_ >= 0) return deviceDispatchRecv(a, round);
  kern::LlArgs p = kernelArgs(a, round);
  std::vector<int32_t>& own = self_count_[round & 1];
  own.resize(p.local_experts, 0);
  p.self_count = own.data();
  const std::vector<int32_t> was_active(a.active_ranks, a.active_ranks + g_.size);
  std::vector<int32_t> decision(g_.size, kern::kUndecided), error(2, kern::kNoError);
  p.decision = decision.data();
  p.error = error.data();
  kern::HostLanes ln;
  const int64_t start = ln.nowUs();
  kern::runBlocks(p.local_experts, kernel_lanes_, ln,
                  [&](auto& lanes, int l) { kern::dispatchRecv(p, l, lanes, start); });
  kernelOutcome("dispatch", round, decision, was_active);
  throwKernelError("dispatch", error.data(), a.max_tokens);
}

void EpBuffer::kernelCombineSend(const LowLatencyCombineArgs& a, uint32_t round) {
  if (device_ >= 0) return deviceCombineSend(a, round);
  kern::LlArgs p = kernelArgs(a, round);
  kern::HostLanes ln;
  kern::runBlocks(g_.size - 1, kernel_lanes_, ln, [&](auto& lanes, int i) {
    kern::combineSend(p, (g_.rank + 1 + i) % g_.size, lanes);
  });
}

void EpBuffer::kernelCombineRecv(const LowLatencyCombineArgs& a, uint32_t round) {
  if (device_ >= 0) return deviceCombineRecv(a, round);
  kern::LlArgs p = kernelArgs(a, round);
  const std::vector<int32_t> was_active(a.active_ranks, a.active_ranks + g_.size);
  std::vector<int32_t> decision(g_.size, kern::kUndecided), error(2, kern::kNoError);
  p.decision = decision.data();
  p.error = error.data();
  kern::HostLanes ln;
  const int64_t start = ln.nowUs();
  kern::runBlocks(g_.size, kernel_lanes_, ln,
                  [&](auto& lanes, int o) { kern::combineWait(p, o, lanes, start); });
  kernelOutcome("combine", round, decision, was_active);
  throwKernelError("combine", error.data(), a.max_tokens);
  kern::runBlocks(static_cast<int>(a.tokens), kernel_lanes_, ln,
                  [&](auto& lanes, int t) { kern::combineRecvToken(p, t, lanes); });
  throwKernelError("combine", error.data(), a.max_tokens);
}

// ---- normal mode ----

kern::NormalArgs EpBuffer::normalArgs(uint32_t round, RoundKind kind, int topk, int64_t hidden,
                                      DType dtype) const {
  const auto nl = NormalLayout::make(geo_.regionBytes(), g_.size, topk, hidden, dtype);
  kern::NormalArgs p;
  p.me = g_.rank;
  p.world = g_.size;
  p.topk = topk;
  p.dtype = static_cast<int>(dtype);
  p.hidden = hidden;
  p.round = round;
  p.timeout_us = timeout_ms_ * 1000;
  p.gone = gone_ptr_;
  p.gone_grace_us = kGoneGraceUs;
  p.peers = mapped_.data();
  setRoundOffsets(p, geo_, round, static_cast<int>(kind));
  nl.setArgs(p);
  if (proxy_) proxy_->fill(p, kind, round);  // (ranks on other hosts: ll_proxy.h)
  return p;
}

void EpBuffer::kernelNormalOutcome(const char* op, uint32_t round,
                                   const std::vector<int32_t>& decision) {
  std::vector<int> gave_up;
  int silent = -1;
  for (int r = 0; r < g_.size; ++r) {
    if (decision[r] == kern::kGaveUp) gave_up.push_back(r);
    if (decision[r] == kern::kSilent && silent < 0) silent = r;
  }
  throwIfAbandoned(op, round, gave_up);
  if (silent >= 0)
    throw std::runtime_error(silentError(op, silent));
}

kern::NormalArgs EpBuffer::normalArgs(const NormalDispatchArgs& a, uint32_t round) const {
  kern::NormalArgs p = normalArgs(round, RoundKind::kDispatch, a.topk, a.hidden, a.dtype);
  p.x = a.x;
  p.tokens = a.tokens;
  p.in_rank = a.is_token_in_rank;
  p.with_topk = a.with_topk_idx;
  p.with_weights = a.with_weights;
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  return p;
}

kern::NormalArgs EpBuffer::normalArgs(const NormalCombineArgs& a, uint32_t round) const {
  kern::NormalArgs p = normalArgs(round, RoundKind::kCombine, a.topk, a.hidden, a.dtype);
  p.y = a.y;
  p.recv_counts = a.recv_counts;
  p.with_weights = a.with_weights;
  p.weights = a.weights;
  p.in_rank = a.is_token_in_rank;
  p.tokens = a.tokens;
  p.out = a.out;
  p.out_weights = a.out_weights;
  return p;
}

std::vector<int32_t> EpBuffer::kernelNormalDispatchSend(const NormalDispatchArgs& a,
                                                        uint32_t round) {
  if (device_ >= 0) return deviceNormalDispatchSend(a, round);
  const int R = g_.size;
  kern::NormalArgs p = normalArgs(a, round);
  std::vector<int32_t> toks(static_cast<size_t>(std::max<int64_t>(1, a.tokens)));
  kern::HostLanes ln;
  kern::runBlocks(R, kernel_lanes_, ln, [&](auto& lanes, int i) {
    kern::normalDispatchSend(p, (g_.rank + 1 + i) % R, lanes, toks.data());
  });
  std::vector<int32_t> counts(R, 0), active(R, 1), decision(R, kern::kUndecided),
      error(2, kern::kNoError);
  p.counts = counts.data();
  p.active = active.data();
  p.decision = decision.data();
  p.error = error.data();
  const int64_t start = ln.nowUs();
  kern::runBlocks(R, kernel_lanes_, ln,
                  [&](auto& lanes, int r) { kern::normalDispatchWait(p, r, lanes, start); });
  kernelNormalOutcome("normal_dispatch", round, decision);
  throwKernelError("normal_dispatch", error.data(), 0, counts.data(), p.capacity);
  return counts;
}

void EpBuffer::kernelNormalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                                        const std::vector<int32_t>& counts,
                                        const NormalDispatchOutputs& o) {
  if (device_ >= 0) return deviceNormalDispatchRecv(a, round, counts, o);
  const int R = g_.size;
  kern::NormalArgs p = normalArgs(a, round);
  p.local_experts = a.with_topk_idx ? a.experts / R : 0;
  p.expert_alignment = a.expert_alignment;
  p.counts = const_cast<int32_t*>(counts.data());  // (read only by the receive)
  p.recv_x = o.recv_x;
  p.recv_src_idx = o.recv_src_idx;
  p.recv_topk_idx = o.recv_topk_idx;
  p.recv_topk_weights = o.recv_topk_weights;
  p.num_recv_per_expert = o.num_recv_per_expert;
  if (a.with_topk_idx) std::fill(o.num_recv_per_expert, o.num_recv_per_expert + p.local_experts, 0);
  std::vector<int32_t> toks(static_cast<size_t>(std::max<int64_t>(1, a.tokens))),
      error(2, kern::kNoError);
  p.error = error.data();
  kern::HostLanes ln;
  kern::runBlocks(R, kernel_lanes_, ln,
                  [&](auto& lanes, int r) { kern::normalDispatchRecv(p, r, lanes, toks.data()); });
  throwKernelError("normal_dispatch", error.data());
  kern::runBlocks(1, kernel_lanes_, ln, [&](auto& lanes, int) { kern::normalAlign(p, lanes); });
}

void EpBuffer::kernelNormalCombine(const NormalCombineArgs& a, uint32_t round) {
  if (device_ >= 0) return deviceNormalCombine(a, round);
  const int R = g_.size, me = g_.rank;
  kern::NormalArgs p = normalArgs(a, round);
  kern::HostLanes ln;
  kern::runBlocks(R - 1, kernel_lanes_, ln, [&](auto& lanes, int i) {
    kern::normalCombineSend(p, (me + 1 + i) % R, lanes);
  });
  int64_t sent_me = 0;
  for (int64_t t = 0; t < a.tokens; ++t) sent_me += a.is_token_in_rank[t * R + me] != 0;
  if (sent_me != a.recv_counts[me])
    throw std::runtime_error(str("normal_combine: rank ", me, " sent itself ", sent_me,
                                 " rows but the handle says ", a.recv_counts[me]));
  std::vector<int32_t> active(R, 1), decision(R, kern::kUndecided), error(2, kern::kNoError);
  p.active = active.data();
  p.decision = decision.data();
  p.error = error.data();
  const int64_t start = ln.nowUs();
  kern::runBlocks(R, kernel_lanes_, ln,
                  [&](auto& lanes, int d) { kern::normalCombineWait(p, d, lanes, start); });
  kernelNormalOutcome("normal_combine", round, decision);
  throwKernelError("normal_combine", error.data());
  kern::runBlocks(static_cast<int>(a.tokens), kernel_lanes_, ln,
                  [&](auto& lanes, int t) { kern::normalCombineToken(p, t, lanes); });
}

}  // namespace mooncake::ep
