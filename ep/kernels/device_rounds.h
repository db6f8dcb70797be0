// Rounds counted by the device (docs/ep.md, "Rounds on the device"): what makes a GPU
// buffer's stream-ordered calls replayable, as a CUDA graph replays them, with no host code
// run per call.
//
// A call's signal words carry its round, so that no wait ever takes a word or row left by
// another round. When the host passes the round as a launch parameter, a captured call would
// replay with the round it was captured with, and its waits would take the words its first
// run left. Here the round lives in device memory, in words the call's own kernels advance:
//   words[kind]                 the last round of `kind` (dispatch 0, combine 1) taken
//   words[2 + 2 * kind + slot]  the round of the call that holds `slot` (the host's half of
//                               the call: a send and its hook's receive may have other calls
//                               between them, at most two of a kind in flight)
// A send's stages resolve round = words[kind] + 1 (kRoundNext); then the send's last block to
// end takes it (endSend: words[kind] += 1, and the call's slot records it); the stages after
// the send (a receive, a wait, normal mode's later stages) read the slot (kRoundOfCall).
// The half of the buffer follows the resolved round's parity: the host fills the offsets of
// half 0 and the stages add `half_bytes` for an odd round. Every rank issues the same calls
// in the same order, so the counters stay equal across ranks however often a captured
// sequence replays.
// A round given up before anything was sent (ep/buffer.h, "Abandoned rounds") is taken on the
// stream as well (kAbandonRound, which takes it without a slot), so no host ever needs to
// know the number.
#pragma once

#include <cstdint>

#include "ep/kernels/numerics.h"

namespace mooncake::ep::kern {

enum RoundFrom : int32_t {
  kRoundGiven = 0,    // the round in the args (the host counts: waited calls, the proxy)
  kRoundNext = 1,     // words[kind] + 1: a send's stages, and the round given up
  kRoundOfCall = 2,   // words[2 + 2 * kind + slot]: the stages after a call's send
};

struct DeviceRounds {
  uint32_t* words = nullptr;  // kDeviceRoundWords words of device memory, zeroed at set-up
  int32_t kind = 0, slot = 0;
  int32_t from = kRoundGiven;
  uint64_t half_bytes = 0;  // BufferGeometry: the second half's offset from the first's
  // > 0: a stage of this many blocks, from kRoundNext, that takes its round itself (endSend)
  int32_t blocks = 0;
  // Ranks on other hosts (ep/ll_proxy.h), null without: the proxy's host-mapped control words
  // ctl[2 * kind + half]  the last round of (kind, half) whose staged rows the proxy moved
  // ctl[kCtlTaken]        jobs the proxy took from the ring
  // ctl[kCtlStopped]      nonzero: the proxy stopped (the stage waits pass)
  // and its ring of kProxyRingSlots jobs (ProxyJob), which a send's last block fills: the
  // kernels feed the proxy, so that a replayed send is moved as the first run was. The
  // (kind, half)'s stage, proxy words and ctrl of half 1 are these strides past half 0's.
  uint32_t* ctl = nullptr;
  char* ring = nullptr;
  uint64_t stage_half = 0, words_half = 0, ctrl_half = 0;
};

constexpr int kDeviceRoundWords = 8;
constexpr int kRoundWordPosted = 6;  // words[6]: the jobs posted to the proxy's ring
constexpr int kRoundWordEnded = 7;   // words[7]: blocks of the running send that ended (endSend)
// The proxy's control words after done[kind][half] (ctl[0..3]):
constexpr int kCtlTaken = 4;    // jobs the proxy took from the ring
constexpr int kCtlStopped = 5;  // nonzero: the proxy stopped (the stage waits pass)
constexpr int kCtlWords = 16;   // ctl's words; the ring follows them
constexpr uint32_t kProxyRingSlots = 16;

// Args: LlArgs or NormalArgs (their round and their half's offsets, filled for half 0).
template <class Args>
MC_HD void resolveRound(Args& p, const DeviceRounds& d) {
  if (d.from == kRoundGiven) return;
  const uint32_t r = d.from == kRoundNext ? d.words[d.kind] + 1u : d.words[2 + 2 * d.kind + d.slot];
  p.round = r;
  if ((r & 1u) == 0) return;
  p.dispatch_region += d.half_bytes;
  p.combine_region += d.half_bytes;
  p.dispatch_signals += d.half_bytes;
  p.combine_signals += d.half_bytes;
  p.abandon_signals += d.half_bytes;
  if (p.stage != nullptr) p.stage += d.stage_half;
  if (p.proxy_words != nullptr) p.proxy_words += d.words_half;
  if (p.ctrl != nullptr) p.ctrl += d.ctrl_half;
}

// By one lane, after the stage that used words[kind] + 1 (endSend).
// slot < 0: a round given up, which no later stage reads (the slot may belong to a call in
// flight, whose hook's receive still reads it).
MC_HD void takeRound(const DeviceRounds& d) {
  const uint32_t r = d.words[d.kind] + 1u;
  d.words[d.kind] = r;
  if (d.slot >= 0) d.words[2 + 2 * d.kind + d.slot] = r;
}

// Every block of a stage with d.blocks > 0 (a send, a round given up), all lanes, after its
// work: the last block to end takes the round, without a launch of its own. Each block read
// words[kind] at its start (resolveRound), before it counted itself, so none reads the
// advanced word; the count goes back to 0 for the stream's next such stage (the stages of a
// buffer run one after another on its stream). True on the lane that took it (lane 0 of the
// last block), which then posts the send's proxy job (ll_entry.h, llBlock).
MC_HD_TEMPLATE
template <class Ln>
MC_HD bool endSend(const DeviceRounds& d, Ln& ln) {
  ln.sync();  // (every lane of the block is past its read of the round)
  if (ln.lane() != 0) return false;
  int32_t* ended = reinterpret_cast<int32_t*>(d.words + kRoundWordEnded);
  if (ln.fetchAdd(ended, 1) != d.blocks - 1) return false;
  *ended = 0;
  takeRound(d);
  return true;
}

}  // namespace mooncake::ep::kern
