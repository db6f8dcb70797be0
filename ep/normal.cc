// Normal mode: each token goes once to every rank holding one of its experts; rows arrive
// ordered by source rank, then token index. Same buffer, same signal words as low-latency
// mode (dispatch signal index = source rank, combine signal index = sending rank).
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "engine/log.h"
#include "ep/buffer.h"
#include "ep/peer_writer.h"
#include "ep/str.h"
#include "pg/copy.h"

namespace mooncake::ep {

int64_t EpBuffer::normalCapacity(int64_t hidden, DType t, int topk) const {
  return NormalLayout::make(geo_.regionBytes(), g_.size, topk, hidden, t).capacity;
}

std::string EpBuffer::silentError(const char* op, int r) const {
  if (peerDead(r))
    return str(op, ": rank ", g_.rank, " got nothing from rank ", r,
               ": its process is gone (the engine reported it)");
  return str(op, ": rank ", g_.rank, " got nothing from rank ", r, " within ", timeout_ms_,
             " ms (MC_EP_TIMEOUT_MS); peer dead?");
}

void EpBuffer::validate(const NormalDispatchArgs& a_in) const {
  const std::string op = "normal_dispatch";
  const int R = g_.size;
  // A GPU buffer's arguments are GPU memory: the checks read host copies.
  NormalDispatchArgs a = a_in;
  std::vector<int64_t> topk_h;
  std::vector<uint8_t> in_rank_h;
  if (device_ >= 0 && a.tokens >= 0) {
    if (a.with_topk_idx && a.topk > 0) {
      topk_h = hostCopy(a.topk_idx, a.tokens * a.topk, op.c_str());
      a.topk_idx = topk_h.data();
    }
    in_rank_h = hostCopy(a.is_token_in_rank, a.tokens * R, op.c_str());
    a.is_token_in_rank = in_rank_h.data();
  }
  if (a.tokens < 0 || a.hidden <= 0)
    invalid(op, str("x has shape [", a.tokens, ", ", a.hidden, "]"));
  if (a.dtype == DType::kFp8) invalid(op, "fp8 is a low-latency dispatch format only");
  if (a.with_topk_idx) {
    if (a.experts <= 0 || a.experts % R != 0 || a.experts > kMaxSignals)
      invalid(op,
              str("num_experts=", a.experts, " must be a positive multiple of the group size ", R));
    if (a.topk <= 0) invalid(op, str("topk_idx has ", a.topk, " columns"));
    validateTopk(a.topk_idx, a.tokens, a.topk, a.experts);
  }
  if (a.expert_alignment < 1) invalid(op, str("expert_alignment=", a.expert_alignment));
  const int64_t cap = normalCapacity(a.hidden, a.dtype, a.topk);
  std::vector<int64_t> per_dst(R, 0);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int d = 0; d < R; ++d) per_dst[d] += a.is_token_in_rank[t * R + d] != 0;
  for (int d = 0; d < R; ++d)
    if (per_dst[d] > cap)
      invalid(op, str("rank ", g_.rank, " sends ", per_dst[d], " tokens to rank ", d,
                      "; this buffer holds ", cap, " per source for H=", a.hidden, " ",
                      dtypeName(a.dtype), " K=", a.topk, " (use a larger num_ep_buffer_bytes)"));
}

std::vector<int32_t> EpBuffer::normalDispatchSend(const NormalDispatchArgs& a, uint32_t round) {
  const MarkOnExit if_thrown(this, RoundKind::kDispatch, round, true);
  (void)awaitRead("normal_dispatch", RoundKind::kDispatch, round, nullptr,
                  engine::deadlineInMs(timeout_ms_));
  if (kernelPath()) return kernelNormalDispatchSend(a, round);

  const int R = g_.size, me = g_.rank, h = round & 1;
  const auto nl = NormalLayout::make(geo_.regionBytes(), R, a.topk, a.hidden, a.dtype);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtypeBytes(a.dtype);
  const char* x = static_cast<const char*>(a.x);
  std::vector<std::vector<int32_t>> toks(R);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int d = 0; d < R; ++d)
      if (a.is_token_in_rank[t * R + d]) toks[d].push_back(static_cast<int32_t>(t));
  // Per-destination metadata blocks (contiguous in the destination's layout).
  std::vector<std::vector<int64_t>> topk(R);
  std::vector<std::vector<float>> weights(R);
  const size_t region = geo_.dispatchRegion(h);
  Writer w(*this, engine::deadlineInMs(timeout_ms_), RoundKind::kDispatch, round);
  for (int step = 1; step <= R; ++step) {
    const int d = (me + step) % R;
    const auto& td = toks[d];
    if (d == me) {  // own rows are copied from x by normalDispatchRecv: only the count
      w.signal(d, geo_.dispatchSignal(h, me), makeSignal(round, static_cast<uint32_t>(td.size())));
      w.commit(d);
      continue;
    }
    w.copyRows(d, region + nl.row(me, 0), nl.row_stride, x, row_bytes, td);
    w.copy(d, region + nl.srcIdx(me, 0), td.data(), td.size() * 4);
    if (a.with_topk_idx) {
      for (int32_t t : td)
        topk[d].insert(topk[d].end(), a.topk_idx + t * a.topk, a.topk_idx + (t + 1) * a.topk);
      w.copy(d, region + nl.topkIdx(me, 0), topk[d].data(), topk[d].size() * 8);
    }
    if (a.with_weights) {
      for (int32_t t : td)
        weights[d].insert(weights[d].end(), a.topk_weights + t * a.topk,
                          a.topk_weights + (t + 1) * a.topk);
      w.copy(d, region + nl.weights(me, 0), weights[d].data(), weights[d].size() * 4);
    }
    w.signal(d, geo_.dispatchSignal(h, me), makeSignal(round, static_cast<uint32_t>(td.size())));
    w.commit(d);
  }
  std::vector<int> failed = w.flush();
  w.keepWhileLate(a.inputs);
  w.keepLocalWhileLate(toks);
  w.keepLocalWhileLate(topk);
  w.keepLocalWhileLate(weights);
  if (!failed.empty())
    throw std::runtime_error(
        str("normal_dispatch: rank ", me, " could not write to rank ", failed[0], " (peer dead?)"));
  std::vector<int32_t> counts(R, 0);
  std::vector<int> pending(R);
  for (int r = 0; r < R; ++r) pending[r] = r;
  int silent = -1;
  std::vector<int> gave_up;
  waitSources(
      pending, engine::deadlineInMs(timeout_ms_),
      orAbandoned(RoundKind::kDispatch, round,
                  [&](int r) {
                    return signalRound(signalWord(geo_.dispatchSignal(h, r))
                                           ->load(std::memory_order_acquire)) == round;
                  }),
      unlessAbandoned(
          RoundKind::kDispatch, round,
          [&](int r) {
            counts[r] = static_cast<int32_t>(signalCount(
                signalWord(geo_.dispatchSignal(h, r))->load(std::memory_order_acquire)));
            if (counts[r] > nl.capacity)
              throw std::runtime_error(str("normal_dispatch: rank ", r, " sent ", counts[r],
                                           " rows, above capacity ", nl.capacity,
                                           " (H, K or dtype differ across ranks?)"));
          },
          &gave_up),
      [&](int r) {
        if (silent < 0) silent = r;
      });
  throwIfAbandoned("normal_dispatch", round, gave_up);
  if (silent >= 0)
    throw std::runtime_error(silentError("normal_dispatch", silent));
  return counts;
}

void EpBuffer::normalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                                  const std::vector<int32_t>& counts,
                                  const NormalDispatchOutputs& o) {
  const MarkOnExit done(this, RoundKind::kDispatch, round, false);
  if (kernelPath()) return kernelNormalDispatchRecv(a, round, counts, o);

  const int R = g_.size, me = g_.rank, h = round & 1;
  const auto nl = NormalLayout::make(geo_.regionBytes(), R, a.topk, a.hidden, a.dtype);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtypeBytes(a.dtype);
  const char* region = base_ + geo_.dispatchRegion(h);
  const int L = a.with_topk_idx ? a.experts / R : 0;
  const int K = a.topk;
  if (a.with_topk_idx) std::fill(o.num_recv_per_expert, o.num_recv_per_expert + L, 0);
  char* recv_x = static_cast<char*>(o.recv_x);
  int64_t total = 0;
  for (int r = 0; r < R; ++r) total += counts[r];
  // A large recv_x leaves the cache anyway: streaming stores skip reading its lines first
  // (measured: W=4 normal dispatch 3.5-3.7 ms -> 2.7-2.8 ms); a small one stays cached for
  // the experts that read it next.
  const bool stream = total * static_cast<int64_t>(row_bytes) >= stream_out_bytes_;
  // This rank's own rows come from x (normalDispatchSend did not stage them).
  std::vector<int32_t> own;
  for (int64_t t = 0; t < a.tokens; ++t)
    if (a.is_token_in_rank[t * R + me]) own.push_back(static_cast<int32_t>(t));
  if (static_cast<int64_t>(own.size()) != counts[me])
    throw std::runtime_error(str("normal_dispatch: rank ", me, " counted ", own.size(),
                                 " own rows, signalled ", counts[me]));
  int64_t n = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t c = counts[r];
    const char* rows = region + nl.row(r, 0);
    if (r == me) {
      gatherRows(recv_x + n * row_bytes, row_bytes, static_cast<const char*>(a.x), row_bytes,
                 own.data(), own.size());
      std::memcpy(o.recv_src_idx + n, own.data(), c * 4);
    } else if (nl.row_stride == row_bytes) {
      pg::copyOut(recv_x + n * row_bytes, rows, c * row_bytes, stream);
      std::memcpy(o.recv_src_idx + n, region + nl.srcIdx(r, 0), c * 4);
    } else {
      for (int64_t j = 0; j < c; ++j)
        pg::copyOut(recv_x + (n + j) * row_bytes, rows + j * nl.row_stride, row_bytes, stream);
      std::memcpy(o.recv_src_idx + n, region + nl.srcIdx(r, 0), c * 4);
    }
    for (int64_t j = 0; j < c; ++j) {
      const int64_t* ids = !a.with_topk_idx ? nullptr
                           : r == me        ? a.topk_idx + static_cast<int64_t>(own[j]) * K
                                     : reinterpret_cast<const int64_t*>(region + nl.topkIdx(r, j));
      const float* ws = !a.with_weights ? nullptr
                        : r == me       ? a.topk_weights + static_cast<int64_t>(own[j]) * K
                                        : reinterpret_cast<const float*>(region + nl.weights(r, j));
      for (int k = 0; k < K; ++k) {
        const int64_t i = (n + j) * K + k;
        int64_t local = -1;
        if (a.with_topk_idx) {
          const int64_t e = ids[k];
          if (e >= 0 && ownerOf(e, L) == me) local = e % L;
          o.recv_topk_idx[i] = local;
          if (local >= 0) ++o.num_recv_per_expert[local];
        }
        // With topk_idx, weights of other ranks' experts read 0; a cached dispatch (no ids)
        // passes weights through unchanged.
        if (a.with_weights)
          o.recv_topk_weights[i] = (!a.with_topk_idx || local >= 0) ? ws[k] : 0.0f;
      }
    }
    n += c;
  }
  if (stream) pg::streamFence();
  if (a.with_topk_idx && a.expert_alignment > 1) {
    for (int l = 0; l < L; ++l) {
      int32_t& v = o.num_recv_per_expert[l];
      v = (v + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    }
  }
}

void EpBuffer::validate(const NormalCombineArgs& a_in) const {
  const std::string op = "normal_combine";
  NormalCombineArgs a = a_in;
  std::vector<int32_t> counts_h;
  if (device_ >= 0) {  // (GPU memory: a host copy)
    counts_h = hostCopy(a.recv_counts, g_.size, op.c_str());
    a.recv_counts = counts_h.data();
  }
  if (a.hidden <= 0 || a.tokens < 0) invalid(op, str("bad shapes: H=", a.hidden, " T=", a.tokens));
  if (a.dtype == DType::kFp8) invalid(op, "fp8 is a low-latency dispatch format only");
  if (kernelPath() && g_.size > kern::kMaxCombineRanks)
    invalid(op, str("the kernels combine over at most ", kern::kMaxCombineRanks, " ranks, the group has ",
                    g_.size, " (MC_EP_KERNELS=host)"));
  if (a.with_weights && a.topk <= 0) invalid(op, "topk_weights has no columns");
  int64_t n = 0;
  for (int r = 0; r < g_.size; ++r) {
    if (a.recv_counts[r] < 0) invalid(op, str("handle's recv count from rank ", r, " is negative"));
    n += a.recv_counts[r];
  }
  (void)n;
  const int64_t cap = normalCapacity(a.hidden, a.dtype, a.topk);
  for (int r = 0; r < g_.size; ++r)
    if (a.recv_counts[r] > cap)
      invalid(op, str(a.recv_counts[r], " rows for rank ", r, " exceed the capacity ", cap));
}

void EpBuffer::normalCombine(const NormalCombineArgs& a, uint32_t round) {
  const MarkOnExit done(this, RoundKind::kCombine, round, false);
  (void)awaitRead("normal_combine", RoundKind::kCombine, round, nullptr,
                  engine::deadlineInMs(timeout_ms_));
  if (kernelPath()) return kernelNormalCombine(a, round);

  const int R = g_.size, me = g_.rank, h = round & 1;
  const auto nl = NormalLayout::make(geo_.regionBytes(), R, a.topk, a.hidden, a.dtype);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtypeBytes(a.dtype);
  const int K = a.topk;
  std::vector<int64_t> prefix(R + 1, 0);
  for (int r = 0; r < R; ++r) prefix[r + 1] = prefix[r] + a.recv_counts[r];
  // Send: rows received from source r go back to r, in the order they came.
  const char* y = static_cast<const char*>(a.y);
  const size_t region = geo_.combineRegion(h);
  Writer w(*this, engine::deadlineInMs(timeout_ms_), RoundKind::kCombine, round);
  for (int step = 1; step <= R; ++step) {
    const int r = (me + step) % R;
    const int64_t c = a.recv_counts[r];
    if (r == me) continue;  // own rows are read from y directly
    if (nl.row_stride == row_bytes) {
      w.copy(r, region + nl.row(me, 0), y + prefix[r] * row_bytes, c * row_bytes);
    } else {
      for (int64_t j = 0; j < c; ++j)
        w.copy(r, region + nl.row(me, j), y + (prefix[r] + j) * row_bytes, row_bytes);
    }
    if (a.with_weights)
      w.copy(r, region + nl.combineWeights(me, 0), a.weights + prefix[r] * K, c * K * 4);
    w.signal(r, geo_.combineSignal(h, me), makeSignal(round, static_cast<uint32_t>(c)));
    w.commit(r);
  }
  std::vector<int> failed = w.flush();
  w.keepWhileLate(a.inputs);
  if (!failed.empty())
    throw std::runtime_error(
        str("normal_combine: rank ", me, " could not write to rank ", failed[0], " (peer dead?)"));
  // Receive: what this rank sent to d comes back from d in the same order.
  std::vector<int64_t> sent(R, 0);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int d = 0; d < R; ++d) sent[d] += a.is_token_in_rank[t * R + d] != 0;
  if (sent[me] != a.recv_counts[me])
    throw std::runtime_error(str("normal_combine: rank ", me, " sent itself ", sent[me],
                                 " rows but the handle says ", a.recv_counts[me]));
  std::vector<int> pending;
  for (int r = 0; r < R; ++r)
    if (r != me) pending.push_back(r);
  int silent = -1;
  std::vector<int> gave_up;
  waitSources(
      pending, engine::deadlineInMs(timeout_ms_),
      orAbandoned(RoundKind::kCombine, round,
                  [&](int d) {
                    return signalRound(signalWord(geo_.combineSignal(h, d))
                                           ->load(std::memory_order_acquire)) == round;
                  }),
      unlessAbandoned(
          RoundKind::kCombine, round,
          [&](int d) {
            int64_t got = signalCount(
                signalWord(geo_.combineSignal(h, d))->load(std::memory_order_acquire));
            if (got != sent[d])
              throw std::runtime_error(str("normal_combine: rank ", d, " returned ", got,
                                           " rows to rank ", me, ", which sent it ", sent[d],
                                           " (handle from another dispatch?)"));
          },
          &gave_up),
      [&](int d) {
        if (silent < 0) silent = d;
      });
  throwIfAbandoned("normal_combine", round, gave_up);
  if (silent >= 0)
    throw std::runtime_error(silentError("normal_combine", silent));
  const char* rbase = base_ + region;
  char* out = static_cast<char*>(a.out);
  std::vector<int64_t> pos(R, 0);
  std::vector<const void*> rows(R);
  for (int64_t t = 0; t < a.tokens; ++t) {
    if (a.with_weights) std::fill(a.out_weights + t * K, a.out_weights + (t + 1) * K, 0.0f);
    int n = 0;
    for (int d = 0; d < R; ++d) {
      if (!a.is_token_in_rank[t * R + d]) continue;
      const int64_t j = pos[d]++;
      rows[n++] = d == me ? y + (prefix[me] + j) * row_bytes : rbase + nl.row(d, j);
      if (a.with_weights) {
        const float* ws = d == me ? a.weights + (prefix[me] + j) * K
                                  : reinterpret_cast<const float*>(rbase + nl.combineWeights(d, j));
        for (int k = 0; k < K; ++k) a.out_weights[t * K + k] += ws[k];
      }
    }
    combineRows(out + t * row_bytes, rows.data(), nullptr, n, a.dtype, a.hidden);
  }
}

}  // namespace mooncake::ep
