// Routing layout and buffer geometry of expert parallelism. Pure functions on raw pointers
// and shapes: no engine, no torch. Everything here is identical on every rank given the same
// (buffer size, world size, call parameters), which is what lets a rank compute where in a
// PEER's buffer a row must land without asking it.
//
// One rank's EP buffer (allocated once from the engine, zero-filled by the OS):
//
//   [header: kHeaderBytes]          doorbell word (futex) senders bump after signalling;
//                                   read marks, u32 rounds (host buffers; EpBuffer::markRead):
//                                   own[kind][half] at 64 (the last round of that kind this
//                                   rank finished reading from that half), from 4096 peer
//                                   [kind][half][rank] (the same, as each rank reported it)
//   half 0, half 1                  a round uses half (round & 1): two rounds in flight
//     [signals: kSignalBytes]       u64 words: (round << 32) | count
//        dispatch[kMaxSignals]      LL: index l*R + r (local expert, source rank)
//                                   normal: index r (source rank)
//        combine[kMaxRanks]         index = sending (owner) rank
//        abandon[2][kMaxRanks]      [dispatch|combine][source rank]: makeSignal(round, 1)
//                                   when that rank gave up the round (its input was bad)
//     [mailbox: kMailboxBytes]      [dispatch|combine][source rank][mailboxCap()] entries of
//                                   (signal offset, value), u64 each: a sender that reaches
//                                   this buffer through the engine WRITEs its signals here
//                                   with its data and then notify()s; the handler stores them
//                                   (ep/peer_writer.h)
//     [dispatch region]             LL: rows [L][R][M], src token ids [L][R][M] int32
//                                   normal: rows [R][C], token ids [R][C], topk [R][C][K]
//                                   int64, weights [R][C][K] f32 (C = per-source capacity)
//     [combine region]              LL: rows [E][M] (global expert, source token)
//                                   normal: rows [R][C], weights [R][C][K] f32
//
// A CUDA kernel replaces the CPU copy loops behind exactly these offsets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ep/kernels/numerics.h"

namespace mooncake::ep {

// kFp8: low-latency dispatch only. The caller's x is bfloat16; each token travels as its
// e4m3 row and one float32 scale per 128 channels (num::quantizeRow), and arrives split into
// recv_x (e4m3 bytes) and recv_scales.
enum class DType : uint8_t { kBFloat16 = 0, kFloat32 = 1, kFp8 = 2 };
size_t dtypeBytes(DType t);  // of one element of recv_x (kFp8: 1)
const char* dtypeName(DType t);
// Bytes of one token as it travels (kFp8: H + 4 * H / 128).
inline size_t wireRowBytes(int64_t hidden, DType t) {
  if (t == DType::kFp8) return num::fp8RowBytes(hidden);
  return static_cast<size_t>(hidden) * (t == DType::kBFloat16 ? 2 : 4);
}

constexpr int kMaxRanks = 1024;
constexpr size_t kHeaderBytes = 4096 + 2 * 2 * kMaxRanks * sizeof(uint32_t);
constexpr int kMaxSignals = 8192;  // bounds E = L * R in low-latency mode
constexpr size_t kSignalBytes = (kMaxSignals + 3 * kMaxRanks) * sizeof(uint64_t);
// Room for every source's mailbox of both kinds: mailboxCap(R) * R <= kMaxSignals + 3 * R.
constexpr size_t kMailboxEntryBytes = 2 * sizeof(uint64_t);
constexpr size_t kMailboxBytes = 2 * (kMaxSignals + 3 * kMaxRanks) * kMailboxEntryBytes;
constexpr size_t kAlign = 64;

inline size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Row stride in the buffer: a token's wire row rounded up to a cache line.
inline size_t rowStride(int64_t hidden, DType t) { return alignUp(wireRowBytes(hidden, t), kAlign); }

// Signal words: (round << 32) | count (ep/kernels/numerics.h).
using num::makeSignal;
using num::signalCount;
using num::signalRound;
using num::roundAfter;

// Offsets (bytes from the buffer base) of everything in one rank's buffer.
class BufferGeometry {
 public:
  BufferGeometry() = default;
  // Throws std::invalid_argument when total_bytes cannot hold the header and signals.
  BufferGeometry(size_t total_bytes, int world);

  size_t totalBytes() const { return total_; }
  int world() const { return world_; }
  // Bytes of one data region (each half has a dispatch and a combine region).
  size_t regionBytes() const { return region_; }
  // From an offset in half 0 to the same offset in half 1.
  size_t halfStride() const { return half_; }

  size_t doorbell() const { return 0; }
  // kind 0: dispatch rounds, 1: combine rounds (both modes), as abandonSignal.
  size_t ownReadMark(int kind, int half) const {
    return 64 + static_cast<size_t>(2 * kind + half) * sizeof(uint32_t);
  }
  size_t peerReadMark(int kind, int half, int rank) const {
    return 4096 + (static_cast<size_t>(2 * kind + half) * kMaxRanks + static_cast<size_t>(rank)) *
                      sizeof(uint32_t);
  }
  size_t dispatchSignal(int half, int index) const {
    return halfBase(half) + static_cast<size_t>(index) * sizeof(uint64_t);
  }
  size_t combineSignal(int half, int owner) const {
    return halfBase(half) + (kMaxSignals + static_cast<size_t>(owner)) * sizeof(uint64_t);
  }
  // kind 0: dispatch rounds, 1: combine rounds (both modes).
  size_t abandonSignal(int half, int kind, int src) const {
    return halfBase(half) +
           (kMaxSignals + (1 + static_cast<size_t>(kind)) * kMaxRanks + static_cast<size_t>(src)) *
               sizeof(uint64_t);
  }
  // Entries one source can post per round and kind: a signal per local expert (low-latency
  // dispatch; normal mode and combine send one) plus an abandon word, and the last slot, for a
  // given-up round's abandon word alone (ep/peer_writer.h).
  size_t mailboxCap() const { return (kMaxSignals + world_ - 1) / world_ + 2; }
  // Where a mailbox's last slot (a given-up round's abandon entry alone) starts in it.
  size_t abandonSlotOffset() const { return (mailboxCap() - 1) * kMailboxEntryBytes; }
  // The mailbox of source `src` for rounds of `kind` (0: dispatch, 1: combine).
  size_t mailbox(int half, int kind, int src) const {
    return halfBase(half) + kSignalBytes +
           (static_cast<size_t>(kind) * world_ + static_cast<size_t>(src)) * mailboxCap() *
               kMailboxEntryBytes;
  }
  size_t dispatchRegion(int half) const {
    return halfBase(half) + kSignalBytes + kMailboxBytes;
  }
  size_t combineRegion(int half) const { return dispatchRegion(half) + region_; }
  // True when [off, off+len) is inside the signal words of either half.
  bool isSignalRange(size_t off, size_t len) const;

 private:
  size_t halfBase(int half) const { return kHeaderBytes + static_cast<size_t>(half) * half_; }
  size_t total_ = 0;
  int world_ = 0;
  size_t half_ = 0;
  size_t region_ = 0;
};

// Low-latency layout inside a region, for one call's (M, H, dtype, E).
struct LowLatencyLayout {
  int world = 0, experts = 0, local_experts = 0;
  int64_t max_tokens = 0;  // M
  size_t row_stride = 0;
  // dispatch region
  size_t dispatchRow(int l, int src, int64_t slot) const {
    return ((static_cast<size_t>(l) * world + src) * max_tokens + slot) * row_stride;
  }
  size_t dispatchSrc(int l, int src, int64_t slot) const {
    return src_base + ((static_cast<size_t>(l) * world + src) * max_tokens + slot) * 4;
  }
  size_t src_base = 0;
  size_t dispatch_bytes = 0;
  // combine region
  size_t combineRow(int expert, int64_t token) const {
    return (static_cast<size_t>(expert) * max_tokens + token) * row_stride;
  }
  size_t combine_bytes = 0;

  static LowLatencyLayout make(int world, int experts, int64_t max_tokens, int64_t hidden, DType t);
};

// The kernels' argument structs (kern::LlArgs, kern::NormalArgs) carry a round's offsets in a
// buffer: its half's regions and signal words, and the abandon words of the call's kind.
template <class Args>
void setRoundOffsets(Args& p, const BufferGeometry& g, uint32_t round, int kind) {
  const int h = static_cast<int>(round & 1);
  p.dispatch_region = g.dispatchRegion(h);
  p.combine_region = g.combineRegion(h);
  p.dispatch_signals = g.dispatchSignal(h, 0);
  p.combine_signals = g.combineSignal(h, 0);
  p.abandon_signals = g.abandonSignal(h, kind, 0);
}

// Normal-mode layout inside a region: C rows per source rank.
struct NormalLayout {
  int world = 0, topk = 0;
  int64_t capacity = 0;  // C
  size_t row_stride = 0;
  size_t src_base = 0, topk_base = 0, weight_base = 0;  // dispatch region
  size_t cweight_base = 0;                              // combine region
  size_t row(int src, int64_t j) const {
    return (static_cast<size_t>(src) * capacity + j) * row_stride;
  }
  size_t srcIdx(int src, int64_t j) const {
    return src_base + (static_cast<size_t>(src) * capacity + j) * 4;
  }
  size_t topkIdx(int src, int64_t j) const {
    return topk_base + (static_cast<size_t>(src) * capacity + j) * topk * 8;
  }
  size_t weights(int src, int64_t j) const {
    return weight_base + (static_cast<size_t>(src) * capacity + j) * topk * 4;
  }
  size_t combineWeights(int src, int64_t j) const {
    return cweight_base + (static_cast<size_t>(src) * capacity + j) * topk * 4;
  }
  // The largest C whose dispatch and combine layouts fit in region_bytes.
  static NormalLayout make(size_t region_bytes, int world, int topk, int64_t hidden, DType t);
  // Copies the numbers kern::NormalArgs needs into it.
  template <class Args>
  void setArgs(Args& p) const {
    p.capacity = capacity;
    p.row_stride = row_stride;
    p.src_base = src_base;
    p.topk_base = topk_base;
    p.weight_base = weight_base;
    p.cweight_base = cweight_base;
  }
};

// Buffer bytes that make low-latency calls with these bounds fit, for either dtype, and
// normal-mode calls with T <= M and K <= kHintMaxTopk.
constexpr int kHintMaxTopk = 32;
size_t sizeHint(int64_t max_tokens, int64_t hidden, int world, int experts);

// ---- routing ----

// Throws std::invalid_argument naming the row, column and value of the first bad entry:
// ids must be -1 or in [0, experts); an expert may appear once per row.
void validateTopk(const int64_t* topk_idx, int64_t tokens, int topk, int experts);

// The owner rank of each expert: e / (experts / world).
inline int ownerOf(int64_t expert, int local_experts) {
  return static_cast<int>(expert / local_experts);
}

// get_dispatch_layout: tokens per rank (tokens with at least one expert there), tokens per
// expert, and is_token_in_rank [T][R] (bytes 0/1). Outputs are written in full.
void dispatchLayout(const int64_t* topk_idx, int64_t tokens, int topk, int experts, int world,
                    int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                    uint8_t* is_token_in_rank);

// ---- element conversion (bit-exact with torch's bfloat16; ep/kernels/numerics.h) ----
using num::bf16ToFloat;
using num::floatToBf16;

// dst row j (stride dst_stride) = src row idx[j] (stride row_bytes), for j < n; runs of
// consecutive indices are copied with one memcpy when the strides match.
void gatherRows(char* dst, size_t dst_stride, const char* src, size_t row_bytes, const int32_t* idx,
                size_t n);
// Calls fn(j, count) for each maximal run idx[j..j+count) of consecutive values.
template <typename Fn>
void forEachRun(const int32_t* idx, size_t n, Fn fn) {
  for (size_t j = 0; j < n;) {
    size_t k = j + 1;
    while (k < n && idx[k] == idx[k - 1] + 1) ++k;
    fn(j, k - j);
    j = k;
  }
}

// out = round_to_dtype(((0 + p_0) + p_1) + ... + p_{n-1}) with p_i = w_i * rows[i] (float32
// multiply, then add; weights == nullptr: p_i = rows[i]), for each of `hidden` elements:
// the reference's float32 accumulation in the given order, rounded once. Tiled so that the
// accumulator stays in L1 and each row is read once. n == 0 gives zeros.
void combineRows(void* out, const void* const* rows, const float* weights, int n, DType t,
                 int64_t hidden);

}  // namespace mooncake::ep
