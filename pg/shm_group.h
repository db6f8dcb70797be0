// ShmGroup: the same-host fast path's memory and synchronisation. Every rank owns one
// registered shared-memory buffer (allocated once per communicator) that all ranks map:
//
//   [header: one 128-byte line per flag, written only by the owner] [half 0] [half 1]
//
// Collectives run as a sequence of steps; every rank numbers its steps identically
// (steps are derived from sizes every rank knows). Step s uses half (s & 1) of each
// buffer, so a rank can fill step s+1 while slower peers still read step s. Flags are
// 64-bit step numbers, posted with release stores and read with acquire loads:
//   kReady    the owner's data for step s is in its half
//   kReduced  (2-phase algorithms) the owner's reduced slice for step s is in its half
//   kConsumed the owner finished reading peers' halves of step s: a writer reuses its
//             half for step s+2 only when every peer consumed step s.
// Waiting spins (MC_PG_SPIN_US, not when ranks outnumber cores), then yields (MC_PG_YIELD_US,
// only when ranks outnumber cores), then sleeps on a futex on the flag word (the poster only
// calls futex_wake when a waiter registered). Sleeping frees the core, which lets the
// scheduler move a waiting peer onto it; the fast path (peer running on another core) makes
// no syscalls.
// Every wait checks, about every MC_PG_HEALTH_US: the op's deadline, the engine's view of
// every peer (a dead process -> CommError naming it) and peers' abort words.
//
// Agreement (mismatch detection): the first step of each op publishes the op's sequence number
// and signature (OpSig) in a descriptor line of the header (two, by op parity). The first
// time a rank sees a peer's flag of a step of the current op, it reads that peer's descriptor:
// another signature, or an older op, is a CommError naming both calls. finishOp() makes sure
// every rank that wrote data for peers checked them: a rank that posted kReady in the op but
// never waited on some peer (a non-root of a reduce) waits for that peer's last kConsumed (a
// broadcast's receivers announce() each step instead, and the root waits for that); an op that moved no data (zero bytes) runs one barrier step. So a
// rank raises in the op when its call differs from a peer it exchanged data with; a rank
// whose call matched the root's gets its data, and raises at its next op (the others abort
// the group, and a rank that sees an abort reports the differing calls it finds in the
// descriptors). Ranks cannot be two ops apart (every op ends in a wait on, or for, every
// peer it moved data with), so two descriptor slots suffice.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "pg/health.h"

namespace mooncake::pg {

class ShmGroup {
 public:
  enum Flag { kReady = 0, kReduced = 1, kConsumed = 2, kNumFlags = 3 };
  static constexpr size_t kHeaderBytes = 16384;

  struct WaitOptions {
    int64_t spin_us = 50;
    int64_t yield_us = 200;
    int64_t health_us = 1000;
  };

  // bases[r]: where rank r's buffer (buffer_bytes long) is mapped in this process.
  static constexpr int kStepBits = 44;  // steps per view; the epoch takes the top 20 bits
  static constexpr uint64_t kStepMask = (uint64_t{1} << kStepBits) - 1;

  ShmGroup(const Health* health, std::vector<char*> bases, size_t buffer_bytes, int rank,
           WaitOptions wait, uint64_t epoch = 0);

  int size() const { return static_cast<int>(bases_.size()); }
  int rank() const { return rank_; }
  size_t halfBytes() const { return half_; }
  // Rank r's half used by step s.
  char* half(int r, uint64_t s) const { return bases_[r] + kHeaderBytes + (s & 1) * half_; }

  // Starts the next step. will_write: this rank writes its half in the step, so it first
  // waits until every peer consumed the step that last used that half.
  uint64_t beginStep(const OpCtx& op, bool will_write);
  void post(Flag f, uint64_t s);
  // Posts kReady for step s with no data in it: a rank that only receives in the step says it
  // reached it (and publishes its call for the peers that wait on it). Unlike post(kReady),
  // finishOp() does not then make this rank wait for every peer.
  void announce(uint64_t s);
  void wait(const OpCtx& op, int r, Flag f, uint64_t s);
  void waitAll(const OpCtx& op, Flag f, uint64_t s);
  void endStep(uint64_t s) { post(kConsumed, s); }
  // Tells peers this rank gave up on the group (they fail fast instead of timing out).
  // died: the blamed rank is dead as far as this rank's engine knows (a peer that hears of the
  // failure through this abort then waits, briefly, until its own engine sees the death too, so
  // that its deadRanks() agrees with the error it raises).
  void abort(int blamed, bool died = false);
  // This rank left the view for a newer one (elastic groups): peers still in an op of this view
  // fail it at once, naming this rank.
  void leave();
  // End of an op (after its algorithm returned): the agreement checks described above. False
  // when the op did not use this group (nothing to do; see barrierOp).
  bool finishOp(const OpCtx& op);
  // An op that used no group at all (zero bytes): one barrier step, which checks agreement.
  void barrierOp(const OpCtx& op);

  // GPU halves beside the host halves (pg/device_stage.h, DeviceHalves): each rank may keep
  // its data of a step in GPU memory of its own that peers open through the device layer's
  // IPC handle published here, written once by the owner (then ready, with release).
  struct alignas(128) DeviceHalfInfo {
    std::atomic<uint32_t> ready;  // 1: handle and offset are set
    uint32_t handle_len;
    uint64_t offset;  // of the halves in the allocation the handle names
    char handle[356];
  };
  DeviceHalfInfo& deviceHalfInfo(int r) const { return hdr(r)->dev; }
  // Whether this rank's data of step s is in its GPU half (set before posting the step), and
  // whether rank r's is (after waiting for its kReady of step s).
  void setGpuHalf(uint64_t s, bool on);
  bool gpuHalf(int r, uint64_t s) const {
    return (hdr(r)->flags[kReady].gpu_halves.load(std::memory_order_relaxed) >> (s & 1)) & 1u;
  }

  // Stream-ordered ops (pg/stream_ops.h): rank r's GPU buffers and flag words, published once
  // by their owner, and the signature of each of its stream ops, by sequence number in a ring
  // (written when the op is issued, read by peers when theirs completes).
  struct alignas(128) StreamInfo {
    std::atomic<uint32_t> state;  // StreamOps::State
    uint32_t handle_len;
    uint64_t offset;  // of the buffers in the allocation the handle names
    char handle[356];
  };
  static constexpr int kStreamRing = 64;
  struct StreamSig {
    std::atomic<uint64_t> seq;  // the op's sequence number (stored last, with release)
    std::atomic<uint64_t> w[2];  // OpSig::pack
  };
  // A stream-ordered all-to-all with sizes (StreamOps::allToAllV) first agrees on the sizes on
  // the host: each rank notes, by the number of such calls (from 1), the largest block it sends
  // or receives and a checksum of its sizes; a rank reads every peer's note of the same call.
  // A rank notes call v + 1 only after reading every peer's note of call v, so a ring of 4
  // always still holds the call a peer reads.
  static constexpr int kSizesRing = 4;
  struct SizesNote {
    std::atomic<uint64_t> seq;  // the call (stored last, with release)
    std::atomic<uint64_t> max_block;
    std::atomic<uint64_t> balance;
  };
  SizesNote& sizesNote(int r, uint64_t seq) const { return hdr(r)->sizes[seq % kSizesRing]; }
  StreamInfo& streamInfo(int r) const { return hdr(r)->stream; }
  StreamSig& streamSig(int r, uint64_t seq) const {
    return hdr(r)->stream_sigs[seq % kStreamRing];
  }
  // Stream-ordered send/recv (pg/stream_p2p.h): rank r's p2p area, published once by its
  // owner; its note of each message it sends to each rank (by the message's number in that
  // direction, from 1, in a ring: stored when the send is issued, read by the receiver); and how
  // many messages from each rank it has checked against their notes, which a sender waits for
  // before it reuses a note. Groups of at most kP2pMaxRanks ranks.
  struct alignas(128) P2pInfo {
    std::atomic<uint32_t> state;  // StreamP2p::State
    uint32_t handle_len;
    uint64_t offset;      // of the area in the allocation the handle names
    uint64_t slot_bytes;  // its owner's MC_PG_STREAM_P2P_SLOT_BYTES
    char handle[356];
  };
  static constexpr int kP2pMaxRanks = 32;
  static constexpr int kP2pRing = 16;
  struct P2pNote {
    std::atomic<uint64_t> seq;  // the message (stored last, with release)
    std::atomic<uint64_t> bytes;
    std::atomic<uint64_t> tag;
  };
  P2pInfo& p2pInfo(int r) const { return hdr(r)->p2p; }
  P2pNote& p2pNote(int from, int to, uint64_t seq) const {
    return hdr(from)->p2p_notes[to][seq % kP2pRing];
  }
  std::atomic<uint64_t>& p2pChecked(int owner, int from) const {
    return hdr(owner)->p2p_checked[from];
  }

  // A rank that refused its own arguments of op #op.seq (which its peers called) says so
  // here, with why: peers waiting in that op raise PeerRejected (Health::rejected). Then every
  // rank of the op calls resync(op): each publishes its step count, waits for every peer's,
  // and all go on from the highest (flags raised to it), so that the next op's steps line up
  // whatever part of the refused op each rank ran. finishOp() makes every rank hear from every
  // peer in every op (it waits until a peer it never waited on reached the op), so every rank
  // of the op raises and resyncs.
  void reject(const OpCtx& op, const std::string& why);
  void resync(const OpCtx& op);

  // What every wait checks (see above), once, for every peer: their abort words, whether they
  // are alive, the op's deadline. Throws CommError.
  void checkHealth(const OpCtx& op) const { checkPeers(op, -1); }
  // Only the abort words: a peer that gave up on the group throws here.
  void checkAborts(const OpCtx& op) const;

 private:
  // The op descriptor: [0] the op it describes (0: none yet), [1..2] OpSig::pack.
  using Desc = std::atomic<uint64_t>[3];
  struct alignas(128) Line {
    std::atomic<uint64_t> v;
    std::atomic<uint32_t> waiters;  // processes sleeping on v (futex)
    // kReady line only: bit h set when the data of the step using half h is in the owner's
    // GPU half (setGpuHalf), in the line every reader loads first.
    std::atomic<uint32_t> gpu_halves;
    // Used in the kReady line only: the descriptors by op parity, in the same 64 bytes as the
    // flag every peer reads first, so the check costs no extra cache miss.
    Desc desc[2];
  };
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "layout");
  struct Header {
    Line flags[kNumFlags];
    // 0 or: epoch (low 32 bits) << 32 | kAbortDied? | kAbortLeft? | code, code = 2 + the rank
    // blamed (1: no rank in particular).
    Line abort;
    DeviceHalfInfo dev;
    StreamInfo stream;
    StreamSig stream_sigs[kStreamRing];
    SizesNote sizes[kSizesRing];
    P2pInfo p2p;
    std::atomic<uint64_t> p2p_checked[kP2pMaxRanks];
    P2pNote p2p_notes[kP2pMaxRanks][kP2pRing];
    // reject(): the op refused (tag | seq, stored last) and why; resync(): by the parity of
    // the resyncs so far, the op and this rank's step count.
    struct Reject {
      std::atomic<uint64_t> seq;
      char op[32];
      char why[216];
    } reject;
    struct Resync {
      std::atomic<uint64_t> seq;
      std::atomic<uint64_t> step;
    } resync[2];
  };
  static constexpr uint64_t kAbortDied = uint64_t{1} << 31;
  static constexpr uint64_t kAbortLeft = uint64_t{1} << 30;
  static constexpr uint64_t kAbortCode = kAbortLeft - 1;
  void postAbort(uint64_t low);
  Desc& descOf(int r, uint64_t seq) const { return hdr(r)->flags[kReady].desc[seq & 1]; }
  static_assert(sizeof(Header) <= kHeaderBytes, "header page too small");

  Header* hdr(int r) const { return reinterpret_cast<Header*>(bases_[r]); }
  void slowWait(const OpCtx& op, int r, Line& line, uint64_t s);
  void checkPeers(const OpCtx& op, int waiting_for) const;
  // Throws PeerRejected when a peer refused the op this rank runs (op_seq_).
  void checkRejects(const OpCtx& op) const;
  // Waits until peer r reached op `op` (published its descriptor) and checks its call.
  void waitArrived(const OpCtx& op, int r);
  // Polls done() with the waits' back-off and health checks (aborts, rejects, death of r,
  // the deadline: `what` for a timeout).
  template <class Done>
  void pollUntil(const OpCtx& op, int r, const char* what, Done&& done);
  void beginOp(const OpCtx& op);
  void publishDesc();
  // A flag of peer r for a step of the current op was seen: check its descriptor.
  void verify(const OpCtx& op, int r);
  // Two ranks (this one included) whose descriptors of the same op differ: throws the
  // CommError naming both. No-op when every descriptor agrees.
  void reportMismatch(const OpCtx& op) const;

  // The value a flag must reach for step s of this view.
  uint64_t target(uint64_t s) const { return tag_ | s; }
  // A flag or descriptor word of peer r that belongs to a newer view than this one.
  [[noreturn]] void movedOn(const OpCtx& op, int r) const;

  const Health* health_;
  std::vector<char*> bases_;
  int rank_;
  size_t half_;
  WaitOptions wait_;
  uint64_t epoch_;
  uint64_t tag_;       // epoch_ << kStepBits
  uint64_t next_tag_;  // (epoch_ + 1) << kStepBits: words at or above it are a newer view's
  // Only the thread running collectives touches these.
  uint64_t step_ = 0;
  uint64_t op_seq_ = 0;         // the op the steps belong to (0: none yet)
  uint64_t op_first_step_ = 0;  // its first step
  std::vector<uint8_t> verified_;  // peers whose descriptor of op_seq_ matched
  bool posted_ready_ = false;      // this rank wrote data for peers in the op
  bool desc_pending_ = false;      // the op's descriptor goes out with its first flag
  uint64_t desc_words_[2] = {0, 0};
  uint64_t resyncs_ = 0;  // resync() calls so far (the same on every rank)
};

}  // namespace mooncake::pg
