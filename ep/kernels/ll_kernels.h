// The low-latency dispatch/combine kernels' bodies, written once for two executors:
//   - ep/kernels/ll_kernels.cu: CUDA blocks (CudaLanes: a lane is a thread of the block),
//     compiled by nvcc when MC_WITH_CUDA is on;
//   - ep/kernels/host_lanes.h: one host thread per "block", one lane (HostLanes), which
//     ep/buffer.cc runs instead of its own loops when MC_EP_KERNELS=host and every peer's
//     buffer is mapped, so the Python and C++ EP tests check these bodies against the
//     plain-torch reference here, where no GPU is.
// Same buffer layout and signal protocol as the CPU path (ep/layout.h, ep/kernels/README.md):
// a rank running these bodies interoperates with one running ep/buffer.cc's loops.
//
// Mapped peers are addressed directly (peers[r], this process's view of rank r's buffer: shm
// here, CUDA IPC on a GPU). Rows of one expert go in token order, so slots, src_info and recv_x
// equal the CPU path's (which lists tokens in the same order).
//
// Proxied peers (peers[r] == nullptr: a rank on another host, reached by a host thread of the
// sender's through the engine; ep/kernels/README.md, "Proxied ranks"). The bodies' side:
//   - dispatch to proxied o: local expert l's rows and token ids go to the sender's `stage`
//     (device memory with a dispatch region's layout, indexed [o][l][slot] instead of
//     [l][src][slot]), then proxy_words[o * L + l] (host-mapped) = (round, rows), or
//     (round, kProxySkip) when o is inactive. The proxy moves the rows to o's block (l, me)
//     and then stores o's signal word (l * R + me).
//   - combine to proxied r: for each local expert l the rows y holds for r's tokens, compact in
//     handle order at stage block (r, l), their tokens at its id slots, then
//     proxy_words[r * L + l] = (round, rows) (skip mark: r inactive). The proxy moves row j to
//     r's combine row (me * L + l, token j), then r's combine signal word (me) = (round, the
//     rows of every l).
//   - a proxied source's signal words (and its abandon word) are read from `ctrl` (host-mapped
//     memory of this rank that its proxy's notifications are stored into), at their offsets
//     from dispatch_signals: this half's signal words, laid out as in the buffer.
//   A word carries the round, not the kind, and dispatch and combine count rounds apart: the
//   host gives each (kind, half) a stage and words of its own, as it gives each half its own
//   regions.
//
// The Lanes interface (L is the executor's type):
//   lane(), lanes()                  this lane's index, the block's width
//   sync()                           block barrier
//   count(flag, &total)              flags of lanes below this one; total of the block
//   share(v)                         lane 0's v, to every lane
//   loadAcquire(p), storeRelease(p, v), fenceSystem()   u64 words seen by other processes
//   cas(p, expected, desired)        int32 compare-and-swap, returns the old value
//   add(p, v)                        int32 atomic add (device scope is enough)
//   ringDoorbell(p)                  wakes the host waiters of a buffer (host: futex)
//   loadFlag(p)                      an int32 another thread or the host writes (acquire)
//   nowUs(), pause()                 a clock for deadlines, a polite spin
// Dead ranks: the caller passes `gone`, an int32 per rank that the host sets once the engine
// reports the rank's process gone (memory the kernels can read while they run: host memory,
// or host-mapped memory for a GPU); a wait gives a gone rank gone_grace_us more (its last
// signal may be behind the notice) and then counts it silent, with or without timeout_us.
#pragma once

#include <cstdint>

#include "ep/kernels/numerics.h"

namespace mooncake::ep::kern {

// Decisions about a source (dispatch) or owner (combine), one int32 each, shared by blocks.
// kOverran: a signal word carries a later round of the same half (kOverrun).
enum Decision : int32_t { kUndecided = 0, kArrived = 1, kSilent = 2, kGaveUp = 3, kOverran = 4 };
// Error codes a body leaves in LlArgs::error (the first one wins); error_rank says who.
enum Error : int32_t {
  kNoError = 0,
  kTooManyRows = 1,    // dispatch: a source sent more than M rows for an expert
  kWrongRowCount = 2,  // combine: an owner returned another number of rows than expected
  kNoOwnRow = 3,       // combine: the handle has no row of this rank for a token's expert
  // Found by the kernels only in the stream-ordered calls (the host checks a host path's or
  // a waited call's inputs before any kernel runs): error_rank is then a token or an expert.
  kBadTopk = 4,    // an entry of topk_idx outside [-1, num_experts): error_rank the token
  kBadHandle = 5,  // combine: layout_range or src_info outside its bounds: the local expert
  // A source's round two after this one reached this half first (GPU buffers do not wait for
  // the read marks, docs/ep.md "Rounds and ordering"): this round's rows from it are lost.
  kOverrun = 6,
};
constexpr int kMaxTopk = 32;
constexpr uint32_t kProxySkip = 0xffffffffu;  // a proxy word's count: nothing for that rank
constexpr int kDtypeBf16 = 0, kDtypeF32 = 1, kDtypeFp8 = 2;  // ep::DType's values

using num::makeSignal;
using num::signalCount;
using num::signalRound;

// Everything a body needs, plain values and pointers (copied to the device by value).
struct LlArgs {
  int me = 0, world = 1, local_experts = 1, topk = 0, dtype = kDtypeBf16;
  int64_t max_tokens = 0, hidden = 0, tokens = 0;
  uint32_t round = 0;
  int64_t timeout_us = -1;  // -1: no deadline
  const int32_t* gone = nullptr;  // [R] or null (see "Dead ranks" above)
  int64_t gone_grace_us = 0;
  // Each rank's buffer as this process addresses it, and offsets in a buffer (this round's
  // half): ep::BufferGeometry and ep::LowLatencyLayout's numbers.
  char* const* peers = nullptr;
  // Proxied ranks (above): staging rows (device memory), the words the proxy reads ([R][L],
  // host-mapped), this half's signal words of proxied sources (host-mapped). Null when every
  // peer is mapped.
  char* stage = nullptr;
  uint64_t* proxy_words = nullptr;
  const char* ctrl = nullptr;
  uint64_t dispatch_region = 0, combine_region = 0;
  uint64_t dispatch_signals = 0;  // dispatchSignal(half, 0)
  uint64_t combine_signals = 0;   // combineSignal(half, 0)
  uint64_t abandon_signals = 0;   // abandonSignal(half, kind, 0) of this call's kind
  uint64_t row_stride = 0, src_base = 0;
  // The caller's tensors.
  const void* x = nullptr;
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int32_t* active = nullptr;
  void* recv_x = nullptr;
  float* recv_scales = nullptr;
  int32_t* recv_count = nullptr;
  int32_t* src_info = nullptr;
  int64_t* layout_range = nullptr;
  const void* y = nullptr;
  void* out = nullptr;
  // Scratch, zeroed before each call's kernels: decision[R], self_count[L], error[2].
  int32_t* decision = nullptr;
  int32_t* self_count = nullptr;
  int32_t* error = nullptr;  // [0] code, [1] rank
};

// ---- pieces ----

MC_HD uint64_t inputRowBytes(const LlArgs& p) {
  return static_cast<uint64_t>(p.hidden) * (p.dtype == kDtypeF32 ? 4u : 2u);
}
MC_HD uint64_t wireRowBytes(const LlArgs& p) {
  return p.dtype == kDtypeFp8 ? num::fp8RowBytes(p.hidden) : inputRowBytes(p);
}
// The block's lanes copy n bytes together: 16-byte words when both sides and n allow (rows in
// the buffer are 64-byte aligned), else 4-byte words, else bytes.
struct alignas(16) Word16 {
  uint32_t w[4];
};
MC_HD_TEMPLATE
template <class Ln>
MC_HD void laneCopy(Ln& ln, void* dst, const void* src, uint64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n;
  const uint64_t lane = ln.lane(), lanes = ln.lanes();
  if ((a & 15u) == 0) {
    Word16* d = static_cast<Word16*>(dst);
    const Word16* s = static_cast<const Word16*>(src);
    for (uint64_t i = lane; i < n / 16; i += lanes) d[i] = s[i];
  } else if ((a & 3u) == 0) {
    uint32_t* d = static_cast<uint32_t*>(dst);
    const uint32_t* s = static_cast<const uint32_t*>(src);
    for (uint64_t i = lane; i < n / 4; i += lanes) d[i] = s[i];
  } else {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    for (uint64_t i = lane; i < n; i += lanes) d[i] = s[i];
  }
}
template <class Args>  // LlArgs or NormalArgs
MC_HD void setError(const Args& p, int32_t code, int32_t rank) {
  // First error wins; a benign race between blocks leaves one of them.
  if (p.error[0] == kNoError) {
    p.error[1] = rank;
    p.error[0] = code;
  }
}

// fp8: group g of a bf16 row quantized into q (128 bytes) and its scale stored at *scale.
MC_HD void quantizeInto(const char* x_row, int64_t g, uint8_t* q, void* scale) {
  const float s =
      num::quantizeGroup(reinterpret_cast<const uint16_t*>(x_row) + g * num::kFp8Group, q);
  memcpy(scale, &s, 4);
}

// Token t of the caller's x as a wire row at dst, by the block's lanes (fp8: a group each,
// the scales after the bytes).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void writeWireRow(Ln& ln, const LlArgs& p, int64_t t, char* dst) {
  const char* src = static_cast<const char*>(p.x) + t * inputRowBytes(p);
  if (p.dtype != kDtypeFp8) return laneCopy(ln, dst, src, inputRowBytes(p));
  for (int64_t g = ln.lane(); g < p.hidden / num::kFp8Group; g += ln.lanes())
    quantizeInto(src, g, reinterpret_cast<uint8_t*>(dst) + g * num::kFp8Group,
                 dst + p.hidden + g * 4);
}

// Output row `row` of recv_x (and recv_scales) from a wire row, by the block's lanes.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void storeRecvRow(Ln& ln, const LlArgs& p, int64_t row, const char* wire) {
  if (p.dtype != kDtypeFp8)
    return laneCopy(ln, static_cast<char*>(p.recv_x) + row * inputRowBytes(p), wire,
                    inputRowBytes(p));
  const int64_t groups = p.hidden / num::kFp8Group;
  laneCopy(ln, static_cast<char*>(p.recv_x) + row * p.hidden, wire, p.hidden);
  laneCopy(ln, p.recv_scales + row * groups, wire + p.hidden, groups * 4);
}

// Output row `row` of recv_x straight from token t of x (the rank's own experts).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void storeOwnRow(Ln& ln, const LlArgs& p, int64_t row, int64_t t) {
  const char* src = static_cast<const char*>(p.x) + t * inputRowBytes(p);
  if (p.dtype != kDtypeFp8)
    return laneCopy(ln, static_cast<char*>(p.recv_x) + row * inputRowBytes(p), src,
                    inputRowBytes(p));
  const int64_t groups = p.hidden / num::kFp8Group;
  for (int64_t g = ln.lane(); g < groups; g += ln.lanes())
    quantizeInto(src, g, static_cast<uint8_t*>(p.recv_x) + row * p.hidden + g * num::kFp8Group,
                 p.recv_scales + row * groups + g);
}

MC_HD bool routesTo(const LlArgs& p, int64_t t, int64_t e) {
  for (int k = 0; k < p.topk; ++k)
    if (p.topk_idx[t * p.topk + k] == e) return true;
  return false;
}

// (Args: LlArgs or NormalArgs: decision, active, round, timeout_us.)
// Decides once, for all blocks, whether `src` delivered this round: all `words` signal words
// at base + first (stride `stride`) carry the round (kArrived), its abandon word at base +
// abandon does (kGaveUp), one carries a later round (kOverran; error kOverrun), or the
// deadline passed first (kSilent; active[src] = 0). Lane 0 waits; all lanes return it.
MC_HD_TEMPLATE
template <class Ln, class Args>
MC_HD int32_t decide(const Args& p, Ln& ln, int src, const char* base, uint64_t first,
                     uint64_t stride, int words, uint64_t abandon, int64_t start_us) {
  int32_t d = kUndecided;
  if (ln.lane() == 0) {
    int64_t gone_at = -1;  // when this wait first saw src's gone flag
    int32_t* slot = p.decision + src;
    d = ln.cas(slot, kUndecided, kUndecided);  // (a read other blocks' writes are seen by)
    if (d == kUndecided && p.active[src] == 0) d = kSilent;  // not waited for at all
    while (d == kUndecided) {
      bool all = true, later = false;
      for (int i = 0; i < words && all; ++i) {
        const uint32_t seen = signalRound(
            ln.loadAcquire(reinterpret_cast<const uint64_t*>(base + first + i * stride)));
        all = seen == p.round;
        later = num::roundAfter(seen, p.round);
      }
      int32_t want = kUndecided;
      if (all) {
        want = kArrived;
      } else if (ln.loadAcquire(reinterpret_cast<const uint64_t*>(base + abandon)) ==
                 makeSignal(p.round, 1)) {
        want = kGaveUp;
      } else if (later) {
        want = kOverran;
      } else {
        const int64_t now = ln.nowUs();
        if (gone_at < 0 && p.gone != nullptr && ln.loadFlag(p.gone + src) != 0) gone_at = now;
        if ((p.timeout_us >= 0 && now - start_us >= p.timeout_us) ||
            (gone_at >= 0 && now - gone_at >= p.gone_grace_us))
          want = kSilent;
      }
      if (want != kUndecided) {
        const int32_t old = ln.cas(slot, kUndecided, want);
        d = old == kUndecided ? want : old;
        if (d == kSilent) p.active[src] = 0;
        if (old == kUndecided && want == kOverran) setError(p, kOverrun, src);
      } else {
        ln.pause();
        d = ln.cas(slot, kUndecided, kUndecided);
      }
    }
  }
  return ln.share(d);
}

// Where source `src`'s signal words of this call's half are: base + (buffer offset - shift).
struct Signals {
  const char* base;
  uint64_t shift;
};
// (Args: LlArgs or NormalArgs.)
MC_HD_TEMPLATE
template <class Args>
MC_HD Signals signalsOf(const Args& p, int src) {
  if (p.peers[src] == nullptr) return {p.ctrl, p.dispatch_signals};  // proxied: ctrl
  return {p.peers[p.me], 0};
}

// Posts (round, rows) for proxied rank `dest` and local expert l (kProxySkip: nothing, dest
// inactive), by the calling lane, after the rows it announces (the caller's fence and sync).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void postProxy(const LlArgs& p, Ln& ln, int dest, int l, uint32_t rows) {
  ln.storeRelease(p.proxy_words + static_cast<uint64_t>(dest) * p.local_experts + l,
                  makeSignal(p.round, rows));
}

// Every entry of topk_idx in [-1, E) (E = world * local_experts) and no expert twice in a
// token's row, by the block's lanes: an entry outside is skipped by the bodies (routesTo,
// combineWait and combineRecvToken match only experts in range; a repeated one makes the
// combine's row counts differ), and either is reported here as kBadTopk with its token.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void checkTopk(const LlArgs& p, Ln& ln) {
  const int64_t E = static_cast<int64_t>(p.world) * p.local_experts, n = p.tokens * p.topk;
  for (int64_t i = ln.lane(); i < n; i += ln.lanes()) {
    const int64_t e = p.topk_idx[i], k = i % p.topk;
    bool bad = e < -1 || e >= E;
    for (int64_t j = i - k; j < i && !bad && e >= 0; ++j) bad = p.topk_idx[j] == e;
    if (bad) setError(p, kBadTopk, static_cast<int32_t>(i / p.topk));
  }
}

// ---- dispatch ----

// Block `e` (global expert): sends this rank's tokens routed to e, in token order, to its
// owner's dispatch region [l][me][slot] (or, own experts, to recv_x's first block), then the
// signal word (round, rows). `toks` is scratch of M entries for the block.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void dispatchSend(const LlArgs& p, int e, Ln& ln, int32_t* toks) {
  const int L = p.local_experts, o = e / L, l = e % L;
  char* const dst = p.peers[o];  // (null: proxied)
  if (e == 0) checkTopk(p, ln);
  if (p.active[o] == 0) {
    if (dst == nullptr && ln.lane() == 0) postProxy(p, ln, o, l, kProxySkip);
    return;
  }
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < p.tokens; t0 += ln.lanes()) {
    const int64_t t = t0 + ln.lane();
    const bool hit = t < p.tokens && routesTo(p, t, e);
    int total = 0;
    const int before = ln.count(hit, &total);
    if (hit) toks[n + before] = static_cast<int32_t>(t);
    n += total;
  }
  ln.sync();
  const int64_t RM = static_cast<int64_t>(p.world) * p.max_tokens;
  if (o == p.me) {
    for (int64_t j = 0; j < n; ++j) storeOwnRow(ln, p, l * RM + j, toks[j]);
    for (int64_t j = ln.lane(); j < n; j += ln.lanes()) p.src_info[l * RM + j] = toks[j];
    if (ln.lane() == 0) p.self_count[l] = static_cast<int32_t>(n);
    return;
  }
  // Mapped: o's dispatch region, block (l, me); proxied: the stage, block (o, l).
  char* const rows = dst != nullptr ? dst + p.dispatch_region : p.stage;
  const uint64_t block = (dst != nullptr ? static_cast<uint64_t>(l) * p.world + p.me
                                          : static_cast<uint64_t>(o) * L + l) *
                         p.max_tokens;
  for (int64_t j = 0; j < n; ++j) writeWireRow(ln, p, toks[j], rows + (block + j) * p.row_stride);
  for (int64_t j = ln.lane(); j < n; j += ln.lanes())
    *reinterpret_cast<int32_t*>(rows + p.src_base + (block + j) * 4) = toks[j];
  ln.fenceSystem();  // every lane's rows before lane 0's release of the signal
  ln.sync();
  if (ln.lane() != 0) return;
  if (dst == nullptr) return postProxy(p, ln, o, l, static_cast<uint32_t>(n));
  const uint64_t word = p.dispatch_signals + (static_cast<uint64_t>(l) * p.world + p.me) * 8;
  ln.storeRelease(reinterpret_cast<uint64_t*>(dst + word),
                  makeSignal(p.round, static_cast<uint32_t>(n)));
  ln.ringDoorbell(reinterpret_cast<uint32_t*>(dst));
}

// Block `l` (local expert): recv_x's blocks in source order from this rank (own rows, which
// dispatchSend of the same call wrote) on; a source counts once all its L signal words carry
// the round (decide). layout_range[l][r] = (begin << 32) | count; empty blocks at the end.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void dispatchRecv(const LlArgs& p, int l, Ln& ln, int64_t start_us) {
  const int R = p.world, L = p.local_experts, me = p.me;
  const int64_t RM = static_cast<int64_t>(R) * p.max_tokens;
  const char* mine = p.peers[me];
  int64_t begin = p.active[me] != 0 ? p.self_count[l] : 0;
  if (ln.lane() == 0)
    for (int r = 0; r < R; ++r) p.layout_range[l * R + r] = r == me ? begin : 0;
  for (int step = 1; step < R; ++step) {
    const int r = (me + step) % R;
    const Signals sg = signalsOf(p, r);
    const int32_t d = decide(p, ln, r, sg.base,
                             p.dispatch_signals - sg.shift + static_cast<uint64_t>(r) * 8,
                             static_cast<uint64_t>(R) * 8, L,
                             p.abandon_signals - sg.shift + static_cast<uint64_t>(r) * 8, start_us);
    if (d != kArrived) continue;
    const uint64_t w = ln.loadAcquire(reinterpret_cast<const uint64_t*>(
        sg.base + p.dispatch_signals - sg.shift + (static_cast<uint64_t>(l) * R + r) * 8));
    const int64_t c = signalCount(w);
    if (c > p.max_tokens) {
      if (ln.lane() == 0) setError(p, kTooManyRows, r);
      continue;
    }
    const uint64_t block = (static_cast<uint64_t>(l) * R + r) * p.max_tokens;
    for (int64_t j = 0; j < c; ++j)
      storeRecvRow(ln, p, l * RM + begin + j, mine + p.dispatch_region + (block + j) * p.row_stride);
    for (int64_t j = ln.lane(); j < c; j += ln.lanes())
      p.src_info[l * RM + begin + j] =
          *reinterpret_cast<const int32_t*>(mine + p.dispatch_region + p.src_base + (block + j) * 4);
    if (ln.lane() == 0) p.layout_range[l * R + r] = (begin << 32) | c;
    begin += c;
  }
  ln.sync();
  if (ln.lane() == 0) {
    p.recv_count[l] = static_cast<int32_t>(begin);
    for (int r = 0; r < R; ++r)
      if ((p.layout_range[l * R + r] & 0xffffffff) == 0) p.layout_range[l * R + r] = begin << 32;
  }
}

// ---- combine ----

// Block `r` (destination rank): this rank's expert outputs for r's tokens go to r's combine
// region row (global expert, token), then one signal word (round, rows); for a proxied r to
// the stage, compact per local expert, each expert's then announced in proxy_words.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void combineSend(const LlArgs& p, int r, Ln& ln) {
  const int R = p.world, L = p.local_experts, me = p.me;
  char* const dst = p.peers[r];  // (null: proxied)
  if (r == 0) checkTopk(p, ln);
  if (r == me) return;
  if (p.active[r] == 0) {
    if (dst == nullptr && ln.lane() == 0)
      for (int l = 0; l < L; ++l) postProxy(p, ln, r, l, kProxySkip);
    return;
  }
  const int64_t RM = static_cast<int64_t>(R) * p.max_tokens;
  const uint64_t row_bytes = inputRowBytes(p);
  uint32_t rows = 0;
  for (int l = 0; l < L; ++l) {
    const int64_t v = p.layout_range[l * R + r];
    const int64_t b = v >> 32;
    int64_t c = v & 0xffffffff;
    const uint64_t staged = (static_cast<uint64_t>(r) * L + l) * p.max_tokens;  // (proxied)
    uint32_t n = 0;  // rows of this expert sent
    // A handle out of its bounds writes nothing outside r's rows: such rows are skipped
    // (and not counted, so r's count check fails too) and reported.
    if (b < 0 || c > p.max_tokens || b + c > RM) {
      if (ln.lane() == 0) setError(p, kBadHandle, l);
      c = 0;
    }
    for (int64_t i = b; i < b + c; ++i) {
      const int32_t t = p.src_info[l * RM + i];
      if (t < 0 || t >= p.max_tokens) {
        if (ln.lane() == 0) setError(p, kBadHandle, l);
        continue;
      }
      char* out = dst != nullptr
                      ? dst + p.combine_region +
                            (static_cast<uint64_t>(me * L + l) * p.max_tokens + t) * p.row_stride
                      : p.stage + (staged + n) * p.row_stride;
      laneCopy(ln, out, static_cast<const char*>(p.y) + (l * RM + i) * row_bytes, row_bytes);
      if (dst == nullptr && ln.lane() == 0)
        *reinterpret_cast<int32_t*>(p.stage + p.src_base + (staged + n) * 4) = t;
      ++n;
    }
    rows += n;
    if (dst == nullptr) {
      ln.fenceSystem();
      ln.sync();
      if (ln.lane() == 0) postProxy(p, ln, r, l, n);
    }
  }
  if (dst == nullptr) return;
  ln.fenceSystem();
  ln.sync();
  if (ln.lane() == 0) {
    ln.storeRelease(reinterpret_cast<uint64_t*>(dst + p.combine_signals + static_cast<uint64_t>(me) * 8),
                    makeSignal(p.round, rows));
    ln.ringDoorbell(reinterpret_cast<uint32_t*>(dst));
  }
}

// Block `o` (owner rank) of the combine's wait: decides o and checks its row count against
// this rank's topk_idx. Run for every owner before combineRecvToken.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void combineWait(const LlArgs& p, int o, Ln& ln, int64_t start_us) {
  if (o == p.me) return;
  const Signals sg = signalsOf(p, o);
  const uint64_t word = p.combine_signals - sg.shift + static_cast<uint64_t>(o) * 8;
  const int32_t d = decide(p, ln, o, sg.base, word, 8, 1,
                           p.abandon_signals - sg.shift + static_cast<uint64_t>(o) * 8, start_us);
  if (d != kArrived || ln.lane() != 0) return;
  uint32_t expected = 0;
  for (int64_t i = 0; i < p.tokens * p.topk; ++i)
    if (p.topk_idx[i] >= 0 && p.topk_idx[i] / p.local_experts == o) ++expected;
  const uint64_t w = ln.loadAcquire(reinterpret_cast<const uint64_t*>(sg.base + word));
  if (signalCount(w) != expected) setError(p, kWrongRowCount, o);
}

MC_HD float loadElem(const void* row, int64_t h, int dtype) {
  if (dtype == kDtypeF32) return static_cast<const float*>(row)[h];
  return num::bf16ToFloat(static_cast<const uint16_t*>(row)[h]);
}

// out = ((0 + w_0 * row_0) + w_1 * row_1) + ... (ws == nullptr: no multiplications) in float32,
// rounded once to dtype: ep::combineRows' order and rounding, by the block's lanes.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void sumRows(Ln& ln, char* out, const char* const* rows, const float* ws, int n, int dtype,
                   int64_t hidden) {
  for (int64_t h = ln.lane(); h < hidden; h += ln.lanes()) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float v = ws ? ws[i] * loadElem(rows[i], h, dtype) : loadElem(rows[i], h, dtype);
      acc = i == 0 ? 0.0f + v : acc + v;
    }
    if (dtype == kDtypeF32)
      reinterpret_cast<float*>(out)[h] = acc;
    else
      reinterpret_cast<uint16_t*>(out)[h] = num::floatToBf16(acc);
  }
}

// Block `t` (token): out[t] = ((0 + w_0 * row_0) + w_1 * row_1) + ... over k ascending whose
// owner is active, in float32, rounded once (ep::combineRows' order: bit-exact with it).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void combineRecvToken(const LlArgs& p, int64_t t, Ln& ln) {
  const int R = p.world, L = p.local_experts, me = p.me;
  const int64_t RM = static_cast<int64_t>(R) * p.max_tokens;
  const uint64_t row_bytes = inputRowBytes(p);
  const char* rows[kMaxTopk];
  float ws[kMaxTopk];
  int n = 0;
  // A call whose waits failed (an error, an owner that gave the round up) writes no output:
  // the host checks before it queues this stage, a stream-ordered call's stage checks here.
  if (p.error[0] != kNoError) return;
  for (int o = 0; o < R; ++o)
    if (p.decision[o] == kGaveUp) return;
  for (int k = 0; k < p.topk; ++k) {
    const int64_t e = p.topk_idx[t * p.topk + k];
    if (e < 0 || e >= static_cast<int64_t>(R) * L) continue;  // (-1, or kBadTopk)
    const int o = static_cast<int>(e / L);
    if (p.active[o] == 0) continue;
    const char* row = nullptr;
    if (o == me) {  // this rank's own output for (e, t): y's self block, found by src_info
      const int l = static_cast<int>(e - static_cast<int64_t>(me) * L);
      const int64_t v = p.layout_range[l * R + me];
      if ((v >> 32) < 0 || (v & 0xffffffff) > p.max_tokens || (v >> 32) + (v & 0xffffffff) > RM) {
        if (ln.lane() == 0) setError(p, kBadHandle, l);
        return;
      }
      for (int64_t i = v >> 32; i < (v >> 32) + (v & 0xffffffff); ++i)
        if (p.src_info[l * RM + i] == t) {
          row = static_cast<const char*>(p.y) + (l * RM + i) * row_bytes;
          break;
        }
      if (row == nullptr) {
        if (ln.lane() == 0) setError(p, kNoOwnRow, static_cast<int32_t>(t));
        return;
      }
    } else {
      row = p.peers[me] + p.combine_region +
            (static_cast<uint64_t>(e) * p.max_tokens + t) * p.row_stride;
    }
    rows[n] = row;
    ws[n++] = p.topk_weights[t * p.topk + k];
  }
  sumRows(ln, static_cast<char*>(p.out) + t * row_bytes, rows, ws, n, p.dtype, p.hidden);
}

}  // namespace mooncake::ep::kern
