// The entry points of the EP kernels that the engine's device layer launches
// (engine/device/device.h, Kernel): `mc_ep_ll` (low latency, one by-value LlLaunch) and
// `mc_ep_normal` (normal mode, one NormalLaunch), grid and stage as below.
// Its CUDA form is ep/kernels/ll_entry.cu (nvcc builds it into a fatbin that ep/ll_device.cc
// embeds); its simulation form (ep/ll_device.cc) runs the same bodies on the simulated
// stream's thread, every address through the layer's host view. What a GPU-memory EP buffer
// (ep/buffer.h, device mode) queues for a call, in order on the device's copy stream:
//   dispatch: kDispatchSend (E blocks), kDispatchRecv (L blocks)
//   combine:  kCombineSend (R blocks), kCombineWait (R blocks), kCombineToken (T blocks)
//   normal dispatch: kNormalDispatchSend (R), kNormalDispatchWait (R); the host reads the
//                    counts and sizes the outputs; kNormalDispatchRecv (R), kNormalAlign (1)
//   normal combine:  kNormalCombineSend (R), kNormalCombineWait (R), kNormalCombineToken (T)
// With rounds on the device (ep/kernels/device_rounds.h), each send's stage takes its round
// (its last block to end; endSend), and a round given up before its send is kAbandonRound (1
// block, which takes it too); with ranks on other hosts a kStageWait (1) precedes the send,
// whose last block also posts its proxy job. (A send has at least one block: E for a dispatch,
// R for a combine or a normal-mode send.)
#pragma once

#include <cstdint>

#include "ep/kernels/device_rounds.h"
#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/normal_kernels.h"

namespace mooncake::ep::kern {

enum LlStage : int32_t {
  kDispatchSend = 0,
  kDispatchRecv = 1,
  kCombineSend = 2,
  kCombineWait = 3,
  kCombineToken = 4,
  kAbandonRound = 6,  // device rounds: every mapped peer's abandon word of this rank (and,
                      // ranks on other hosts, the proxy's job to tell them)
  kStageWait = 7,     // device rounds, ranks on other hosts: before a send, until the proxy
                      // moved what the (kind, half)'s stage held two rounds ago
};

struct LlLaunch {
  LlArgs p;
  int32_t* toks = nullptr;   // kDispatchSend: E * max_tokens int32 of device scratch
  uint64_t peer_bytes = 0;   // the size of every rank's buffer (the simulation maps them)
  int32_t stage = kDispatchSend;
  int32_t experts = 0;       // E (kDispatchSend's blocks)
  DeviceRounds rounds;       // from kRoundGiven: p.round as the host gave it
};

enum NormalStage : int32_t {
  kNormalDispatchSend = 0,
  kNormalDispatchWait = 1,
  kNormalDispatchRecv = 2,
  kNormalAlign = 3,
  kNormalCombineSend = 4,
  kNormalCombineWait = 5,
  kNormalCombineToken = 6,
};

struct NormalLaunch {
  NormalArgs p;
  int32_t* toks = nullptr;  // send and receive: R * max(1, tokens) int32 of device scratch
  uint64_t peer_bytes = 0;
  int64_t rows = 0;         // N: rows the dispatch receives, or the combine sends back
  int32_t stage = kNormalDispatchSend;
  DeviceRounds rounds;
};

// A job of the proxy's ring (DeviceRounds::ring), stored by one lane: a send's (its args as
// the stages resolved them; the proxy takes the stage and words of (kind, round) from its own
// numbers, EpBuffer::Proxy::fill) or a round given up; `seq` (1-based) last, with release.
enum ProxyJobMode : int32_t { kJobLowLatency = 0, kJobNormal = 1, kJobAbandon = 2 };
struct ProxyJob {
  uint64_t seq;
  int32_t kind, mode;
  uint32_t round;
  LlArgs ll;
  NormalArgs np;
};

// Lane 0: posts a job once the proxy took the one kProxyRingSlots before it (or stopped).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void postJob(const DeviceRounds& d, Ln& ln, int32_t mode, uint32_t round, const LlArgs* ll,
                   const NormalArgs* np) {
  const uint32_t n = d.words[kRoundWordPosted] + 1u;
  const int32_t* ctl = reinterpret_cast<const int32_t*>(d.ctl);
  const uint32_t need = n - kProxyRingSlots;  // taken, for slot (n - 1) % kProxyRingSlots
  while (n > kProxyRingSlots &&
         static_cast<int32_t>(static_cast<uint32_t>(ln.loadFlag(ctl + kCtlTaken)) - need) < 0 &&
         ln.loadFlag(ctl + kCtlStopped) == 0)
    ln.pause();
  ProxyJob* j = reinterpret_cast<ProxyJob*>(d.ring) + (n - 1) % kProxyRingSlots;
  j->kind = d.kind;
  j->mode = mode;
  j->round = round;
  if (ll != nullptr) j->ll = *ll;
  if (np != nullptr) j->np = *np;
  ln.fenceSystem();
  ln.storeRelease(&j->seq, n);
  d.words[kRoundWordPosted] = n;
}

// kStageWait, lane 0: the stage of (kind, round's half) was used by round - 2, whose rows (or
// whose giving up) the proxy must have taken care of first.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void waitStage(const DeviceRounds& d, Ln& ln, uint32_t round) {
  if (round <= 2) return;
  const int32_t* ctl = reinterpret_cast<const int32_t*>(d.ctl);
  const int32_t* done = ctl + 2 * d.kind + (round & 1);
  while (static_cast<int32_t>(static_cast<uint32_t>(ln.loadFlag(done)) - (round - 2)) < 0 &&
         ln.loadFlag(ctl + kCtlStopped) == 0)
    ln.pause();
}

// kAbandonRound (device rounds): this rank gives round p.round up to every mapped peer (the
// host buffer's EpBuffer::abandon, stored by the stream instead of the host).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void abandonRound(const LlArgs& p, Ln& ln) {
  for (int o = static_cast<int>(ln.lane()); o < p.world; o += static_cast<int>(ln.lanes())) {
    if (o == p.me || p.peers[o] == nullptr) continue;
    ln.storeRelease(reinterpret_cast<uint64_t*>(p.peers[o] + p.abandon_signals +
                                                static_cast<uint64_t>(p.me) * 8),
                    makeSignal(p.round, 1));
  }
}

// Block b of a stage: the one body both forms run (ll_entry.cu: one CUDA block each, `start`
// its own clock; the simulation: block after block, `start` the stage's). Each block has its
// own part of `toks`.
MC_HD_TEMPLATE
template <class Ln>
MC_HD void llStage(const LlLaunch& l, int b, Ln& ln, int64_t start) {
  switch (l.stage) {
    case kDispatchSend:
      dispatchSend(l.p, b, ln, l.toks + static_cast<int64_t>(b) * l.p.max_tokens);
      break;
    case kDispatchRecv:
      dispatchRecv(l.p, b, ln, start);
      break;
    case kCombineSend:
      combineSend(l.p, b, ln);
      break;
    case kCombineWait:
      combineWait(l.p, b, ln, start);
      break;
    case kCombineToken:
      combineRecvToken(l.p, b, ln);
      break;
    case kAbandonRound:
      if (b != 0) break;
      abandonRound(l.p, ln);
      if (l.rounds.ring != nullptr && ln.lane() == 0)
        postJob(l.rounds, ln, kJobAbandon, l.p.round, nullptr, nullptr);
      break;
    case kStageWait:
      if (b == 0 && ln.lane() == 0) waitStage(l.rounds, ln, l.p.round);
      break;
    default:
      break;
  }
}

// Block b of a stage, its round resolved first where the device counts rounds; a stage that
// takes its round counts itself ended after, and the send's last block posts its proxy job
// (a give-up posted its own in the stage).
MC_HD_TEMPLATE
template <class Ln>
MC_HD void llBlock(const LlLaunch& l, int b, Ln& ln, int64_t start) {
  if (l.rounds.from == kRoundGiven) return llStage(l, b, ln, start);
  LlLaunch r = l;
  resolveRound(r.p, r.rounds);
  llStage(r, b, ln, start);
  if (r.rounds.blocks > 0 && endSend(r.rounds, ln) && r.rounds.ring != nullptr &&
      l.stage != kAbandonRound)
    postJob(r.rounds, ln, kJobLowLatency, r.p.round, &r.p, nullptr);
}

MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalStage(const NormalLaunch& l, int b, Ln& ln, int64_t start) {
  int32_t* toks = l.toks + static_cast<int64_t>(b) * (l.p.tokens > 0 ? l.p.tokens : 1);
  switch (l.stage) {
    case kNormalDispatchSend:
      normalDispatchSend(l.p, b, ln, toks);
      break;
    case kNormalDispatchWait:
      normalDispatchWait(l.p, b, ln, start);
      break;
    case kNormalDispatchRecv:
      normalDispatchRecv(l.p, b, ln, toks);
      break;
    case kNormalAlign:
      normalAlign(l.p, ln);
      break;
    case kNormalCombineSend:
      normalCombineSend(l.p, b, ln);
      break;
    case kNormalCombineWait:
      normalCombineWait(l.p, b, ln, start);
      break;
    case kNormalCombineToken:
      normalCombineToken(l.p, b, ln);
      break;
    default:
      break;
  }
}

MC_HD_TEMPLATE
template <class Ln>
MC_HD void normalBlock(const NormalLaunch& l, int b, Ln& ln, int64_t start) {
  if (l.rounds.from == kRoundGiven) return normalStage(l, b, ln, start);
  NormalLaunch r = l;
  resolveRound(r.p, r.rounds);
  normalStage(r, b, ln, start);
  if (r.rounds.blocks > 0 && endSend(r.rounds, ln) && r.rounds.ring != nullptr)
    postJob(r.rounds, ln, kJobNormal, r.p.round, nullptr, &r.p);
}

constexpr const char* kLlEntryName = "mc_ep_ll";
constexpr const char* kNormalEntryName = "mc_ep_normal";
constexpr unsigned kEntryLanes = 256;  // threads per block on a GPU

}  // namespace mooncake::ep::kern
