// Stream-ordered collectives on GPU memory in same-host groups: the op is queued on a stream of
// the caller's (torch's current CUDA stream) when it is issued -- copies, stream memory
// operations on flag words in the ranks' GPU memory, the reduction kernel -- and no host thread
// waits for any of it, as NCCL's ops are. The host-driven device paths (pg/device_stage.h) wait
// on the host three times a step, which capped a GPU allreduce at ~5 GB/s on an H200
// (docs/gpu.md); these do not.
//
// Each rank owns one allocation of GPU memory, opened by every peer through the device layer's
// IPC:
//
//   [words: per source rank r, `arrive` at r*128 and `done` at r*128+64] [buffer 0] [buffer 1]
//
// An op is cut into steps of at most MC_PG_STREAM_OPS_CHUNK_BYTES; step s uses buffer (s & 1).
// Ranks meet through exchanges: each one raises an epoch (1, 2, ...; numbered alike on every
// rank, since every rank derives the steps from the same sizes) and, on rank i's stream, writes
// it into every peer r's arrive[i] (Device::writeWord: after the stream's earlier work, with a
// memory barrier), then waits until its own arrive[r] >= it for every peer (Device::waitWord).
// Allreduce, step s, on rank i's stream:
//   1. copy its piece of the input into its own buffer (s & 1); exchange;
//   2. one shot (ops up to MC_PG_STREAM_OPS_ONESHOT_BYTES): the reduction kernel
//      (pg/device_reduce.h: rank order, so every rank gets the same bits) reads buffer (s & 1)
//      of every rank and writes the output piece. Two shots (larger ops): it reduces slice i
//      of the step only, into its output and back into its own buffer; exchange; then copies
//      every peer's reduced slice out of that peer's buffer into its output.
// (The other ops, one exchange a step: below. Reduce, gather and scatter use only some
// ranks' buffers, but every rank exchanges every step: the buffer-reuse rule stays the same.)
// A rank writes buffer (s & 1) again at step s+2 only after step s+1's first exchange: every
// peer's stream then copied step s+1 in, so it is done with step s, which read that buffer.
// After an op's last step every rank writes its epoch into every peer's done[i]: what a rank
// whose group ends waits for before it frees its buffers (peers may still be reading them);
// and into its own done[i], which another stream of its own can wait on (orderAfter).
//
// Setup (first op, once per group, on the host): allocate, publish the IPC handle in the
// comm buffer's header (ShmGroup::StreamInfo), open every peer's, check that the device can
// reach them, publish whether it could; the ops run on streams only when every rank could.
//
// The host learns about an op only afterwards: finish() (the torch backend runs it on the
// group's worker, like a host-driven op) waits for an event recorded after the op, checking
// peers' health, their abort words and the deadline meanwhile, then compares every peer's
// signature of the op (OpSig, published in the header's ring when the op was issued): a
// mismatch is a MismatchError naming both calls. On any failure it releases its own stream
// (Device::storeWord raises every arrive word past every epoch, so no stream waits for a rank
// that is gone), marks the group failed and aborts its host groups, which makes the peers'
// finish() fail too and release theirs; then it waits (up to 5 s) until the released stream has
// run the op's remaining steps, which would otherwise write memory the caller may free once it
// is told. A failed op's output is undefined.
//
// All ranks must issue the same stream ops in the same order (NCCL's rule); a group in which
// one rank calls an op on host memory while another calls it on GPU memory fails (the host
// rank never sets up or never exchanges; the GPU rank times out) -- MC_PG_STREAM_OPS=0 takes
// every rank to the host-driven path.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "pg/communicator.h"
#include "pg/health.h"
#include "pg/shm_group.h"
#include "pg/types.h"

namespace mooncake::pg {

// Shared with pg/stream_p2p.h: zeroes `words` (device memory of this process's, on `ordinal`)
// and finds out whether the device runs stream memory operations (a write and a wait on the
// copy stream, then an event after them); and reads one such word from the host (a group's
// end, bounded: false when it could not).
Status zeroAndProbeWords(engine::device::Device& layer, int ordinal,
                         const std::vector<uint32_t*>& words);
bool readDeviceWord(const uint32_t* w, uint32_t* out);

class StreamOps {
 public:
  enum State : uint32_t { kNone = 0, kPublished = 1, kUsable = 2, kUnusable = 3 };
  // One op in flight.
  struct Ticket {
    uint64_t seq = 0;  // stream ops of this group, from 1
    OpCtx op{};        // name, signature, deadline (from issue), seq
    uint32_t last_epoch = 0;
    std::unique_ptr<engine::device::Event> done;  // recorded on the stream after the op
  };

  explicit StreamOps(Communicator::Impl& c);
  ~StreamOps();
  StreamOps(const StreamOps&) = delete;
  StreamOps& operator=(const StreamOps&) = delete;

  // Queue an op on GPU memory on `stream` of device `ordinal` (where its memory lies); sig: the
  // op's signature as the host-driven op has it (mismatch checks and errors). Null, with
  // nothing queued, when the group does not take this path (setup failed on some rank); throw
  // CommError for a failed setup or launch, UsageError for memory on another device than the
  // group's buffers. Their steps, each rank's stream:
  //   allGather: its piece into its buffer; exchange; every rank's piece out into outs[r];
  //   gather: the same, only the root copies out (outs: the root's; ignored elsewhere);
  //   broadcast: the root's piece into the root's buffer; exchange; the others copy it out;
  //   scatter: the root puts a piece of every block ins[j] into its buffer; exchange; the
  //     others copy theirs out (ins: the root's; ignored elsewhere);
  //   reduce: its piece into its buffer; exchange; the root reduces every rank's buffer;
  //   reduceScatter: a piece of every block ins[j] into its buffer; exchange; its block
  //     reduced out of every rank's buffer;
  //   allToAll (equal blocks of `block` bytes): a piece of every block ins[j] into its
  //     buffer; exchange; from every rank's buffer the piece meant for it, into outs[r].
  //   allToAllV (blocks of any size: send_bytes[j] at ins[j] to rank j, recv_bytes[r] from
  //     rank r into outs[r]): first, on the host, the ranks
  //     agree on the sizes (ShmGroup::SizesNote: every rank waits until every peer issued the
  //     call, then takes the largest block of any rank, so that all run the same steps, and
  //     checks that the sizes pair up: a checksum over what each rank sends minus what it
  //     receives sums to 0 only when every block sent is the size its receiver expects;
  //     UsageError on every rank otherwise); then per step a piece of every block into its
  //     buffer (slots of chunk / n bytes); exchange; from every rank's buffer the piece meant
  //     for it. The host wait costs what the slowest rank's issue takes; no GPU work is waited
  //     for.
  // Block lists hold one pointer per rank, in rank order.
  std::shared_ptr<Ticket> allReduce(const void* in, void* out, size_t count, DataType t,
                                    ReduceOp op, const OpSig& sig, int ordinal,
                                    const void* stream);
  std::shared_ptr<Ticket> allGather(const void* in, const std::vector<void*>& outs,
                                    size_t bytes, const OpSig& sig, int ordinal,
                                    const void* stream);
  std::shared_ptr<Ticket> gather(const void* in, const std::vector<void*>& outs, size_t bytes,
                                 int root, const OpSig& sig, int ordinal, const void* stream);
  std::shared_ptr<Ticket> broadcast(void* data, size_t bytes, int root, const OpSig& sig,
                                    int ordinal, const void* stream);
  std::shared_ptr<Ticket> scatter(const std::vector<const void*>& ins, void* out, size_t bytes,
                                  int root, const OpSig& sig, int ordinal, const void* stream);
  std::shared_ptr<Ticket> reduce(const void* in, void* out, size_t count, DataType t,
                                 ReduceOp op, int root, const OpSig& sig, int ordinal,
                                 const void* stream);
  std::shared_ptr<Ticket> reduceScatter(const std::vector<const void*>& ins, void* out,
                                        size_t count, DataType t, ReduceOp op, const OpSig& sig,
                                        int ordinal, const void* stream);
  std::shared_ptr<Ticket> allToAll(const std::vector<const void*>& ins,
                                   const std::vector<void*>& outs, size_t block,
                                   const OpSig& sig, int ordinal, const void* stream);
  std::shared_ptr<Ticket> allToAllV(const std::vector<const void*>& ins,
                                    const std::vector<size_t>& send_bytes,
                                    const std::vector<void*>& outs,
                                    const std::vector<size_t>& recv_bytes, const OpSig& sig,
                                    int ordinal, const void* stream);
  // Waits until the ticket's op is done, then checks it (see above). Throws CommError.
  // Called once per ticket, in issue order, by the thread that runs the group's ops.
  void finish(Ticket& t);

  // Queues on `stream` (of the op's device) a wait until the ticket's op is done there:
  // Work.wait() on another stream than the op's. (Raised past every epoch by a failure.)
  Status orderAfter(const Ticket& t, const void* stream);

  uint64_t issued() const;  // stream ops issued so far (tests)
  // Set up and found unusable (the same on every rank): every op runs host-driven.
  bool unusable() const;

 private:
  // At most this many ops issued and not finished: the signature ring must still hold an op's
  // entry when the last peer checks it.
  static constexpr uint64_t kMaxInFlight = ShmGroup::kStreamRing / 2;
  struct Issue;
  // The checks, the setup (first op), a ticket with its published signature; `steps` queues
  // the op's steps; then the done words and the event.
  std::shared_ptr<Ticket> issue(const char* name, const OpSig& sig, int ordinal,
                                const void* stream, const std::function<void(Issue&)>& steps);
  bool setUp(int ordinal, const OpCtx& op);  // under mu_; false: not usable by every rank
  // allToAllV's agreement (above): the largest block of any rank. Throws UsageError (sizes
  // that do not pair up) or CommError (a peer that issued another op, a dead one, the
  // timeout).
  size_t agreeSizes(const char* name, const std::vector<size_t>& send_bytes,
                    const std::vector<size_t>& recv_bytes);
  uint32_t* words(int owner, int from, bool done) const;
  char* buffer(int owner, uint64_t step) const;
  void publishSig(const Ticket& t);
  // Every peer's signature of t's op against this rank's (MismatchError). strict: a peer whose
  // entry is not t's op went out of step (CommError); else such a peer is skipped.
  void checkSigs(const Ticket& t, bool strict) const;
  // Communicator::Impl::breakOn (the group failed, its host groups aborted), then release.
  void fail(const Ticket& t, const CommError& e);
  // Raises this rank's arrive and done words past every epoch issued: its stream waits for no
  // peer any more (after a failure).
  void release(const Ticket& t);
  // Waits (up to 5 s) until `done` (recorded after t's steps) completed on the released
  // stream, releasing it again while it has not.
  void drainFailed(engine::device::Event& done, const Ticket& t);
  // The group's end: waits (bounded) until every peer's stream finished the last op.
  void drain();

  Communicator::Impl& c_;
  const size_t chunk_;
  mutable std::mutex mu_;  // issue state below
  std::condition_variable finished_cv_;
  int state_ = -1;  // -1: not set up; kUsable / kUnusable
  int ordinal_ = -1;
  char* own_ = nullptr;  // this rank's allocation
  std::vector<char*> base_;       // every rank's allocation as mapped here (own_ for this rank)
  std::vector<void*> opened_;     // peers' IPC mappings, to close
  size_t words_bytes_ = 0;
  uint32_t epoch_ = 0;    // last epoch issued
  uint64_t step_ = 0;     // last step issued (its buffer: step & 1)
  uint64_t seq_ = 0;      // last op issued
  uint64_t finished_ = 0;  // ops finished (guarded by mu_)
  uint64_t sizes_seq_ = 0;  // allToAllV calls (guarded by mu_)
  bool failed_ = false;
};

}  // namespace mooncake::pg
