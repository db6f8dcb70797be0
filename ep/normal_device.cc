// Normal mode on an EP buffer in GPU memory (ep/buffer.h, "Device mode"; the kernels:
// ep/kernels/normal_kernels.h): each stage queued on the buffer's stream and waited for on the
// host (the dispatch reads its row counts back to size its outputs). Ranks on other hosts are
// reached through the buffer's host proxy (ep/ll_proxy.h), as in low-latency mode: the sends
// stage their rows, deviceSend hands them to the proxy.
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "ep/buffer.h"
#include "ep/device_scratch.h"
#include "ep/str.h"

namespace mooncake::ep {

kern::NormalLaunch EpBuffer::deviceNormalLaunch(kern::NormalArgs p, int64_t rows,
                                                RoundKind kind) {
  const int R = g_.size;
  // Stream-ordered low-latency calls still on the stream run out first: their waits (bounded
  // by their own timeout_us) must not count against this call's deadlines.
  if (stream_calls_) deviceSync("normal", engine::noDeadline());
  const size_t toks = static_cast<size_t>(R) * static_cast<size_t>(std::max<int64_t>(1, p.tokens)) * 4;
  char* scratch;
  {  // (a stream call's hook dropped on another thread reads scratch_: dropStreamHook)
    std::unique_lock<std::mutex> g(stream_mu_, std::defer_lock);
    if (stream_calls_) g.lock();
    capturing_call_ = false;  // (normal mode is never captured: the binding refuses it)
    scratch = deviceScratch(toks);
  }
  const Scratch sc = scratchAt(scratch, R);
  p.peers = dev_peers_;
  p.gone = gone_ptr_;
  p.active = sc.active;
  p.decision = sc.decision;
  p.error = sc.error;
  kern::NormalLaunch l;
  l.p = p;
  l.toks = sc.toks;
  l.peer_bytes = geo_.totalBytes();
  l.rows = rows;
  deviceRoundsFor(l, kind, p.round);
  // Normal mode has no mask: every rank active; no source decided yet; no error.
  const std::vector<int32_t> ones(R, 1), zeros(R + 2, 0);
  deviceCopy(sc.active, ones.data(), R * 4, "normal");
  deviceCopy(sc.decision, zeros.data(), R * 4, "normal");
  deviceCopy(sc.error, zeros.data(), 8, "normal");
  return l;
}

template <class Prepare>
Scratch EpBuffer::sendOrGiveUp(RoundKind kind, uint32_t round, Prepare prepare,
                               kern::NormalStage stage, const char* op) {
  bool sent = false;
  try {
    kern::NormalLaunch* l = prepare();
    deviceSend(*l, stage, kind, g_.size, op, &sent);
  } catch (...) {
    // With rounds on the device the round must still be taken there (given up), or this
    // rank's later calls would be a round behind its peers'.
    if (!sent && device_rounds_) deviceAbandon(kind, round);
    throw;
  }
  return scratchAt(scratch_, g_.size);
}

std::vector<int32_t> EpBuffer::deviceNormalDispatchSend(const NormalDispatchArgs& a,
                                                        uint32_t round) {
  const char* op = "normal_dispatch";
  const int R = g_.size;
  kern::NormalLaunch l;
  const Scratch sc = sendOrGiveUp(RoundKind::kDispatch, round, [&] {
    l = deviceNormalLaunch(normalArgs(a, round), 0, RoundKind::kDispatch);
    l.p.counts = scratchAt(scratch_, R).counts;
    return &l;
  }, kern::kNormalDispatchSend, op);  // (proxied: staged)
  deviceLaunch(l, kern::kNormalDispatchWait, static_cast<unsigned>(R), op);
  deviceSync(op, waitBound(timeout_ms_ * 1000, timeout_ms_));
  std::vector<int32_t> decision(R), counts(R), error(2);
  deviceCopy(decision.data(), sc.decision, R * 4, op);
  deviceCopy(error.data(), sc.error, 8, op);
  deviceCopy(counts.data(), sc.counts, R * 4, op);
  kernelNormalOutcome(op, round, decision);
  throwKernelError(op, error.data(), 0, counts.data(), l.p.capacity);
  return counts;
}

void EpBuffer::deviceNormalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                                        const std::vector<int32_t>& counts,
                                        const NormalDispatchOutputs& o) {
  const char* op = "normal_dispatch";
  const int R = g_.size;
  int64_t n = 0;
  for (int32_t c : counts) n += c;
  kern::NormalArgs p = normalArgs(a, round);
  p.local_experts = a.with_topk_idx ? a.experts / R : 0;
  p.expert_alignment = a.expert_alignment;
  p.recv_x = o.recv_x;
  p.recv_src_idx = o.recv_src_idx;
  p.recv_topk_idx = o.recv_topk_idx;
  p.recv_topk_weights = o.recv_topk_weights;
  p.num_recv_per_expert = o.num_recv_per_expert;
  kern::NormalLaunch l = deviceNormalLaunch(p, n, RoundKind::kDispatch);
  const Scratch sc = scratchAt(scratch_, R);
  deviceCopy(sc.counts, counts.data(), R * 4, op);
  l.p.counts = sc.counts;
  if (a.with_topk_idx) {
    const std::vector<int32_t> zeros(p.local_experts, 0);
    deviceCopy(o.num_recv_per_expert, zeros.data(), zeros.size() * 4, op);
  }
  deviceLaunch(l, kern::kNormalDispatchRecv, static_cast<unsigned>(R), op);
  deviceLaunch(l, kern::kNormalAlign, 1, op);
  deviceSync(op, engine::deadlineInMs(timeout_ms_));
  int32_t error[2];
  deviceCopy(error, sc.error, 8, op);
  throwKernelError(op, error);
}

void EpBuffer::deviceNormalCombine(const NormalCombineArgs& a, uint32_t round) {
  const char* op = "normal_combine";
  const int R = g_.size, me = g_.rank;
  std::vector<int32_t> recv_counts;
  int64_t sent_me = 0;
  kern::NormalLaunch l;
  // As the host paths: the rows go back first (the peers wait for them), then this rank's
  // own check, the waits, and the sums only when nothing failed.
  const Scratch sc = sendOrGiveUp(RoundKind::kCombine, round, [&] {
    // The handle's counts (the rows sent back) and routing, read here.
    recv_counts = hostCopy(a.recv_counts, R, op);
    const std::vector<uint8_t> in_rank = hostCopy(a.is_token_in_rank, a.tokens * R, op);
    int64_t n = 0;
    for (int32_t c : recv_counts) n += c;
    for (int64_t t = 0; t < a.tokens; ++t) sent_me += in_rank[t * R + me] != 0;
    l = deviceNormalLaunch(normalArgs(a, round), n, RoundKind::kCombine);
    return &l;
  }, kern::kNormalCombineSend, op);
  deviceSync(op, engine::deadlineInMs(timeout_ms_));
  if (sent_me != recv_counts[me])
    throw std::runtime_error(str(op, ": rank ", me, " sent itself ", sent_me,
                                 " rows but the handle says ", recv_counts[me]));
  deviceLaunch(l, kern::kNormalCombineWait, static_cast<unsigned>(R), op);
  deviceSync(op, waitBound(timeout_ms_ * 1000, timeout_ms_));
  std::vector<int32_t> decision(R), error(2);
  deviceCopy(decision.data(), sc.decision, R * 4, op);
  deviceCopy(error.data(), sc.error, 8, op);
  kernelNormalOutcome(op, round, decision);
  throwKernelError(op, error.data());
  deviceLaunch(l, kern::kNormalCombineToken, static_cast<unsigned>(a.tokens), op);
  deviceSync(op, engine::deadlineInMs(timeout_ms_));
}

}  // namespace mooncake::ep
