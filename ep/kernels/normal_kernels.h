// Normal mode's kernels' bodies (DeepEP's normal dispatch/combine, ep/normal.cc's protocol and
// NormalLayout), over the same executors as ll_kernels.h. A call runs:
//   dispatch: normalDispatchSend (block per destination), normalDispatchWait (block per source:
//             counts[r]; the host reads them to size the outputs, as DeepEP's normal mode
//             does), normalDispatchRecv (block per source), normalAlign (one block);
//   combine:  normalCombineSend (block per destination), normalCombineWait (block per owner),
//             normalCombineToken (block per token).
// Rows from one source arrive in its token order, sources in rank order: recv_x, recv_src_idx
// and every output equal the CPU path's.
//
// Proxied ranks (peers[r] == nullptr: another host; ll_kernels.h and ep/ll_proxy.h): a send
// stores what it would have stored in rank d's region block [me] into the sender's `stage`
// block [d] instead (a region's layout: the same capacity, rows, ids, top-k and weights),
// then proxy_words[d] = (round, rows); the proxy moves the block to d's block [me] and then
// stores d's signal word (me). A proxied source's signal and abandon words are read from
// `ctrl`, as in low-latency mode.
#pragma once

#include <cstdint>

#include "ep/kernels/ll_kernels.h"

namespace mooncake::ep::kern {

// Ranks one token's combine can gather rows from (a block keeps a pointer per rank).
constexpr int kMaxCombineRanks = 64;

struct NormalArgs {
  int me = 0, world = 1, topk = 0, dtype = kDtypeBf16, local_experts = 0;
  int64_t hidden = 0, tokens = 0;
  uint32_t round = 0;
  int64_t timeout_us = -1;
  const int32_t* gone = nullptr;  // [R] or null (ll_kernels.h, "Dead ranks")
  int64_t gone_grace_us = 0;
  char* const* peers = nullptr;
  // Proxied ranks (above; null when every peer is mapped): the stage of this call's (kind,
  // half) (device memory), its proxy words ([R], host-mapped), this half's ctrl.
  char* stage = nullptr;
  uint64_t* proxy_words = nullptr;
  const char* ctrl = nullptr;
  uint64_t dispatch_region = 0, combine_region = 0;
  uint64_t dispatch_signals = 0, combine_signals = 0, abandon_signals = 0;
  // ep::NormalLayout's numbers.
  int64_t capacity = 0;
  uint64_t row_stride = 0, src_base = 0, topk_base = 0, weight_base = 0, cweight_base = 0;
  // Dispatch.
  const void* x = nullptr;
  const uint8_t* in_rank = nullptr;  // [T][R]
  bool with_topk = false, with_weights = false;
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int expert_alignment = 1;
  int32_t* counts = nullptr;  // [R]: rows from each source (wait writes, recv reads)
  void* recv_x = nullptr;
  int32_t* recv_src_idx = nullptr;
  int64_t* recv_topk_idx = nullptr;
  float* recv_topk_weights = nullptr;
  int32_t* num_recv_per_expert = nullptr;  // [L], zeroed before the call
  // Combine.
  const void* y = nullptr;
  const int32_t* recv_counts = nullptr;  // [R] (the handle's)
  const float* weights = nullptr;        // [N][K]
  void* out = nullptr;
  float* out_weights = nullptr;
  // Scratch: active[R] all 1 (normal mode has no mask; decide() writes it), decision[R],
  // error[2].
  int32_t* active = nullptr;
  int32_t* decision = nullptr;
  int32_t* error = nullptr;
};

MC_HD uint64_t rowBytes(const NormalArgs& p) {
  return static_cast<uint64_t>(p.hidden) * (p.dtype == kDtypeF32 ? 4u : 2u);
}
MC_HD uint64_t normalRow(const NormalArgs& p, int src, int64_t j) {
  return (static_cast<uint64_t>(src) * p.capacity + j) * p.row_stride;
}
MC_HD uint64_t normalSlot(const NormalArgs& p, int src, int64_t j) {
  return static_cast<uint64_t>(src) * p.capacity + j;
}

// The tokens of this rank routed to rank d, ascending, into toks (all lanes); returns how many.
MC_HD_TEMPLATE
template <class Ln>
MC_HD int64_t tokensFor(const NormalArgs& p, int d, Ln& ln, int32_t* toks) {
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < p.tokens; t0 += ln.lanes()) {
    const int64_t t = t0 + ln.lane();
    const bool hit = t < p.tokens && p.in_rank[t * p.world + d] != 0;
    int total = 0;
    const int before = ln.count(hit, &total);
    if (hit) toks[n + before] = static_cast<int32_t>(t);
    n += total;
  }
  ln.sync();
  return n;
}

// Lane 0, after the rows it announces (the caller's fence and sync): rank d's signal word
// (me) at `signals` = (round, n), or, d proxied, the proxy word [d].
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalSignal(const NormalArgs& p, Ln& ln, int d, uint64_t signals, int64_t n) {
  const uint64_t v = makeSignal(p.round, static_cast<uint32_t>(n));
  char* const dst = p.peers[d];
  if (dst == nullptr) {
    ln.storeRelease(p.proxy_words + d, v);
    return;
  }
  ln.storeRelease(reinterpret_cast<uint64_t*>(dst + signals + static_cast<uint64_t>(p.me) * 8), v);
  ln.ringDoorbell(reinterpret_cast<uint32_t*>(dst));
}

// ---- dispatch ----

// Block `d`: this rank's rows for d (token order) with their ids, top-k and weights into d's
// dispatch region [me][j], then the count; for d == me only the count (recv reads x).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalDispatchSend(const NormalArgs& p, int d, Ln& ln, int32_t* toks) {
  const int64_t n = tokensFor(p, d, ln, toks);
  char* dst = p.peers[d];  // (null: proxied)
  const int K = p.topk;
  if (d != p.me) {
    // Mapped: d's dispatch region, block [me]; proxied: the stage, block [d].
    char* const region = dst != nullptr ? dst + p.dispatch_region : p.stage;
    const int block = dst != nullptr ? p.me : d;
    for (int64_t j = 0; j < n; ++j)
      laneCopy(ln, region + normalRow(p, block, j),
               static_cast<const char*>(p.x) + toks[j] * rowBytes(p), rowBytes(p));
    for (int64_t j = ln.lane(); j < n; j += ln.lanes()) {
      const uint64_t slot = normalSlot(p, block, j);
      *reinterpret_cast<int32_t*>(region + p.src_base + slot * 4) = toks[j];
      for (int k = 0; k < K; ++k) {
        if (p.with_topk)
          reinterpret_cast<int64_t*>(region + p.topk_base)[slot * K + k] =
              p.topk_idx[toks[j] * K + k];
        if (p.with_weights)
          reinterpret_cast<float*>(region + p.weight_base)[slot * K + k] =
              p.topk_weights[toks[j] * K + k];
      }
    }
  }
  ln.fenceSystem();
  ln.sync();
  if (ln.lane() == 0) normalSignal(p, ln, d, p.dispatch_signals, n);
}

// Block `r`: waits for source r's count (this rank's own included) into counts[r].
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalDispatchWait(const NormalArgs& p, int r, Ln& ln, int64_t start_us) {
  const Signals sg = signalsOf(p, r);
  const uint64_t word = p.dispatch_signals - sg.shift + static_cast<uint64_t>(r) * 8;
  const int32_t d = decide(p, ln, r, sg.base, word, 8, 1,
                           p.abandon_signals - sg.shift + static_cast<uint64_t>(r) * 8, start_us);
  if (d != kArrived || ln.lane() != 0) return;
  const uint64_t w = ln.loadAcquire(reinterpret_cast<const uint64_t*>(sg.base + word));
  const int64_t c = signalCount(w);
  if (c > p.capacity) setError(p, kTooManyRows, r);
  p.counts[r] = static_cast<int32_t>(c);
}

// Block `r`: source r's rows at recv_x[sum of counts before r ...], with src ids, local top-k
// (another rank's expert: -1, weight 0; without ids, weights pass unchanged) and per-expert
// counts. `toks`: scratch of T entries (own rows come from x).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalDispatchRecv(const NormalArgs& p, int r, Ln& ln, int32_t* toks) {
  int64_t n0 = 0;
  for (int i = 0; i < r; ++i) n0 += p.counts[i];
  const int64_t c = p.counts[r];
  const int K = p.topk, L = p.local_experts;
  const char* region = p.peers[p.me] + p.dispatch_region;
  if (r == p.me) {
    const int64_t own = tokensFor(p, r, ln, toks);
    if (own != c) {
      if (ln.lane() == 0) setError(p, kWrongRowCount, r);
      return;
    }
  }
  for (int64_t j = 0; j < c; ++j)
    laneCopy(ln, static_cast<char*>(p.recv_x) + (n0 + j) * rowBytes(p),
             r == p.me ? static_cast<const char*>(p.x) + toks[j] * rowBytes(p)
                       : region + normalRow(p, r, j),
             rowBytes(p));
  for (int64_t j = ln.lane(); j < c; j += ln.lanes()) {
    const uint64_t slot = normalSlot(p, r, j);
    p.recv_src_idx[n0 + j] =
        r == p.me ? toks[j] : *reinterpret_cast<const int32_t*>(region + p.src_base + slot * 4);
    for (int k = 0; k < K; ++k) {
      const int64_t i = (n0 + j) * K + k;
      int64_t local = -1;
      if (p.with_topk) {
        const int64_t e = r == p.me ? p.topk_idx[toks[j] * K + k]
                                    : reinterpret_cast<const int64_t*>(region + p.topk_base)[slot * K + k];
        if (e >= 0 && e / L == p.me) local = e % L;
        p.recv_topk_idx[i] = local;
        if (local >= 0) ln.add(p.num_recv_per_expert + local, 1);
      }
      if (p.with_weights) {
        const float w = r == p.me ? p.topk_weights[toks[j] * K + k]
                                  : reinterpret_cast<const float*>(region + p.weight_base)[slot * K + k];
        p.recv_topk_weights[i] = (!p.with_topk || local >= 0) ? w : 0.0f;
      }
    }
  }
}

// One block, after every normalDispatchRecv: per-expert counts rounded up to the alignment.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalAlign(const NormalArgs& p, Ln& ln) {
  if (!p.with_topk || p.expert_alignment <= 1) return;
  for (int l = ln.lane(); l < p.local_experts; l += ln.lanes()) {
    const int32_t v = p.num_recv_per_expert[l];
    p.num_recv_per_expert[l] = (v + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
  }
}

// ---- combine ----

// Block `r` (r != me): the rows received from r go back to r's combine region [me][j] in the
// order they came, with their weights, then the count.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalCombineSend(const NormalArgs& p, int r, Ln& ln) {
  if (r == p.me) return;
  int64_t n0 = 0;
  for (int i = 0; i < r; ++i) n0 += p.recv_counts[i];
  const int64_t c = p.recv_counts[r];
  const int K = p.topk;
  char* const dst = p.peers[r];  // (null: proxied)
  // Mapped: r's combine region, block [me]; proxied: the stage, block [r].
  char* const region = dst != nullptr ? dst + p.combine_region : p.stage;
  const int block = dst != nullptr ? p.me : r;
  for (int64_t j = 0; j < c; ++j)
    laneCopy(ln, region + normalRow(p, block, j),
             static_cast<const char*>(p.y) + (n0 + j) * rowBytes(p), rowBytes(p));
  if (p.with_weights)
    laneCopy(ln, region + p.cweight_base + normalSlot(p, block, 0) * K * 4,
             p.weights + n0 * K, static_cast<uint64_t>(c) * K * 4);
  ln.fenceSystem();
  ln.sync();
  if (ln.lane() == 0) normalSignal(p, ln, r, p.combine_signals, c);
}

// Block `d` (d != me): waits for d's rows; they must be as many as this rank sent d.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalCombineWait(const NormalArgs& p, int d, Ln& ln, int64_t start_us) {
  if (d == p.me) return;
  const Signals sg = signalsOf(p, d);
  const uint64_t word = p.combine_signals - sg.shift + static_cast<uint64_t>(d) * 8;
  const int32_t dec = decide(p, ln, d, sg.base, word, 8, 1,
                             p.abandon_signals - sg.shift + static_cast<uint64_t>(d) * 8, start_us);
  if (dec != kArrived || ln.lane() != 0) return;
  int64_t sent = 0;
  for (int64_t t = 0; t < p.tokens; ++t) sent += p.in_rank[t * p.world + d] != 0;
  const uint64_t w = ln.loadAcquire(reinterpret_cast<const uint64_t*>(sg.base + word));
  if (signalCount(w) != sent) setError(p, kWrongRowCount, d);
}

// Block `t`: out[t] = the rows t came back with, summed over destinations in rank order
// ((0 + row_0) + row_1 ...), in float32, rounded once; out_weights[t] the weights summed alike.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalCombineToken(const NormalArgs& p, int64_t t, Ln& ln) {
  const int R = p.world, K = p.topk;
  const char* rows[kMaxCombineRanks];
  const float* ws[kMaxCombineRanks];
  int n = 0;
  int64_t own0 = 0;
  for (int i = 0; i < p.me; ++i) own0 += p.recv_counts[i];
  for (int d = 0; d < R; ++d) {
    if (!p.in_rank[t * R + d]) continue;
    int64_t j = 0;  // position of t among the tokens sent to d
    for (int64_t u = 0; u < t; ++u) j += p.in_rank[u * R + d] != 0;
    if (d == p.me) {
      rows[n] = static_cast<const char*>(p.y) + (own0 + j) * rowBytes(p);
      ws[n] = p.with_weights ? p.weights + (own0 + j) * K : nullptr;
    } else {
      const char* region = p.peers[p.me] + p.combine_region;
      rows[n] = region + normalRow(p, d, j);
      ws[n] = p.with_weights
                  ? reinterpret_cast<const float*>(region + p.cweight_base) + normalSlot(p, d, j) * K
                  : nullptr;
    }
    ++n;
  }
  sumRows(ln, static_cast<char*>(p.out) + t * rowBytes(p), rows, nullptr, n, p.dtype, p.hidden);
  if (p.with_weights)
    for (int k = ln.lane(); k < K; k += ln.lanes()) {
      float s = 0.0f;
      for (int i = 0; i < n; ++i) s += ws[i][k];
      p.out_weights[t * K + k] = s;
    }
}

}  // namespace mooncake::ep::kern
