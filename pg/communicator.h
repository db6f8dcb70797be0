// Communicator: a process group over one TransferEngine. Ranks exchange segments through a
// Rendezvous, register their comm buffers once, and run collectives and point-to-point ops
// on host memory. No torch here; torch_ext adapts c10d onto this.
//
// Contract (as c10d): collectives are called in the same order on every rank of the group.
// The blocking op methods are called by ONE thread at a time per communicator (the group's
// worker, see enqueue()); send/recv may be called from any thread concurrently with them.
// Every op is bounded by options.timeout; a dead peer makes the op throw CommError naming
// the rank and the op within ~2 s (engine peerStatus + control link).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "pg/types.h"

namespace mooncake::pg {

// Elastic groups (docs/elastic.md): Mooncake PG's dynamic membership. `size` ranks found the
// group in slots [0, size); max_group_size slots are reserved; slots are never renumbered; ops
// run over the active slots. Off by default: a plain group behaves as before (a failure
// raises, naming the dead rank, and poisons the group).
struct ElasticOptions {
  bool enabled = false;
  int max_group_size = 0;  // slots (0: size)
  // This process takes slot `rank` of a running group (a replacement or an extension rank):
  // it starts isolated (ops are local-only) until join() and an activation.
  bool is_extension = false;
  bool auto_deactivate_on_failure = true;  // failures make unhealthy members inactive
  bool auto_sync_on_failure = true;        // a failed op reconciles before it completes
  // Tests only: called at this process's points of agreement ("phase1", "phase2", "decided";
  // see ViewLog::on_point), e.g. to kill or stop the process that proposes a view.
  std::function<void(const char* point)> test_hook;
};

// The process-wide defaults of elastic groups (upstream's setters): every op of an elastic
// group is bounded by the collective (or p2p) timeout as well as by CommOptions::timeout; a
// reconciliation waits at most the window for every live member's observations.
void setCollectiveTimeout(std::chrono::microseconds t);
void setP2pTimeout(std::chrono::microseconds t);
void setReconciliationWindow(std::chrono::microseconds t);
std::chrono::microseconds collectiveTimeout();
std::chrono::microseconds p2pTimeout();
std::chrono::microseconds reconciliationWindow();

struct CommOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous keys of this group are prefixed with it; distinct per group in a job.
  std::string group_name = "default";
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Bytes of the registered comm buffer per rank (0: MC_PG_BUFFER_BYTES).
  size_t buffer_bytes = 0;
  ElasticOptions elastic;
};

class CommError : public std::runtime_error {
 public:
  CommError(const std::string& what, int peer_rank, std::string op)
      : std::runtime_error(what), peer_rank_(peer_rank), op_(std::move(op)) {}
  int peerRank() const { return peer_rank_; }  // -1 when no single peer is to blame
  const std::string& op() const { return op_; }

 private:
  int peer_rank_;
  std::string op_;
};

// Elastic groups: an op that failed because of peers (dead, unreachable, timed out, not active,
// or the view changed under it). It is the op's evidence, not a verdict: hint() has one entry
// per slot (1 = this rank saw a failure involving that slot in this op; may be all zero when
// the op did not run because the view changed). The group is not poisoned: later ops run on
// the agreed view. The op's outputs are unspecified.
class PeerFailure : public CommError {
 public:
  PeerFailure(const std::string& what, std::vector<uint8_t> hint, std::string op)
      : CommError(what, firstSet(hint), std::move(op)), hint_(std::move(hint)) {}
  const std::vector<uint8_t>& hint() const { return hint_; }

 private:
  static int firstSet(const std::vector<uint8_t>& h) {
    for (size_t i = 0; i < h.size(); ++i)
      if (h[i]) return static_cast<int>(i);
    return -1;
  }
  std::vector<uint8_t> hint_;
};

// Ranks called different collectives (or shapes, roots): raised on every rank, in elastic
// groups too (a program error, not a peer failure).
class MismatchError : public CommError {
 public:
  using CommError::CommError;
};

// A peer refused its own arguments of this collective (it raised an argument error there):
// raised on the other ranks of the op, which stay in step (the group is not poisoned).
class PeerRejected : public CommError {
 public:
  using CommError::CommError;
};

enum class ProposalStatus { kRejected = 0, kApplied = 1, kAppliedWithDroppedRanks = 2 };
struct ProposalResult {
  ProposalStatus status = ProposalStatus::kRejected;
  uint64_t new_epoch = 0;
  std::vector<int> dropped_ranks;
  std::string reject_reason;
};
enum class SyncStatus { kReconciled = 0, kNoPending = 1, kRejected = 2 };
struct SyncResult {
  SyncStatus status = SyncStatus::kNoPending;
  std::string reject_reason;
};

// Async completion of one enqueued op (the c10d Work's core).
class Work {
 public:
  // Waits until done or the timeout; rethrows the op's exception. Returns false on timeout.
  bool wait(std::chrono::milliseconds timeout);
  bool isCompleted() const;
  bool isSuccess() const;
  std::exception_ptr exception() const;
  // Called (once, on the worker thread) when the op finished.
  void onComplete(std::function<void()> cb);

  struct State;
  explicit Work(std::shared_ptr<State> s) : s_(std::move(s)) {}

 private:
  std::shared_ptr<State> s_;
};

// Ops that move bytes (broadcast, allgather, allgatherv, gather, scatter, all-to-all and their
// stream-ordered forms) issued by this thread while a SigDtype lives carry `t` in their
// signature (OpSig::dtype): ranks that pass different dtypes of the same size then raise a
// mismatch, as for different sizes. Without one they are untyped (bytes): ep/, store/.
class SigDtype {
 public:
  explicit SigDtype(DataType t);
  ~SigDtype();
  SigDtype(const SigDtype&) = delete;
  SigDtype& operator=(const SigDtype&) = delete;
  static uint8_t current();  // DataType + 1; 0: none

 private:
  uint8_t prev_;
};

class Communicator {
 public:
  // Collective over the group. The engine may be shared by several communicators (sub-
  // groups reuse their parent's engine and registered memory).
  static std::unique_ptr<Communicator> create(std::shared_ptr<engine::TransferEngine> engine,
                                              std::shared_ptr<engine::Rendezvous> rdv,
                                              const CommOptions& options);
  ~Communicator();

  int rank() const;
  int size() const;
  const CommOptions& options() const;
  engine::TransferEngine& engine();

  // Runs fn on the group's worker thread, in enqueue order; the Work carries its result.
  // A thrown exception lands in the Work.
  std::shared_ptr<Work> enqueue(std::string op_name, std::function<void()> fn);

  // Fails the group on purpose (a caller that cannot go on in step with its peers, such as one
  // that queued only some of a list of stream-ordered ops): later ops fail at once here, the
  // peers' current and later ones through the abort words. `op` and `why` name it.
  void fail(const char* op, const std::string& why);
  // This rank refused its own arguments of its next collective `op` (`why`), which its peers
  // call: it takes that op's number and tells them, and they raise PeerRejected for it instead
  // of waiting until the timeout; then every rank realigns, so later ops run. Called in issue
  // order with the other collectives (enqueue it). Plain groups: same-host ones (shm: a note
  // in the shared-memory header, then a resync of the step counts) and message ones (net: a
  // note to every peer; every rank drops the messages sent in the refused op as it meets
  // them, NetGroup::reject). Elsewhere (elastic and hierarchical groups) a no-op: the peers
  // wait in that op until the timeout, as before.
  void reject(const char* op, const std::string& why);

  // ---- collectives on contiguous host memory; in == out allowed where it makes sense ----
  void allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp op);

  // Same-host groups, GPU memory (pg/stream_ops.h, docs/gpu.md "Stream-ordered collectives"):
  // queues the allreduce on `stream` of the device where in and out lie (a CUstream of the
  // caller's, such as torch's current one; engine::device::kCopyStream over the simulation)
  // and returns without waiting for it. Null when the group does not take this path (elastic,
  // spanning hosts, MC_PG_STREAM_OPS=0, host memory, a rank that could not set it up): the
  // caller runs allReduce instead. The first call sets the path up on every rank (a host wait
  // for the peers, once). The returned op's wait() blocks until it is done and throws its
  // CommError (a dead or aborting peer, mismatched calls, the group timeout); every op must be
  // waited for, in issue order, by the thread that runs the group's ops.
  class StreamOp {
   public:
    virtual ~StreamOp() = default;
    virtual void wait() = 0;
    // Queues on `stream` (another stream of the op's device) a wait for the op's end.
    virtual Status orderAfter(const void* stream) = 0;
  };
  std::shared_ptr<StreamOp> allReduceOnStream(const void* in, void* out, size_t count,
                                              DataType t, ReduceOp op, const void* stream);
  // The same for the other collectives (an all-to-all of equal blocks of `block` bytes: block
  // j of `in` to rank j, rank r's block at r * block of `out`; with sizes: allToAllVOnStream).
  // The *s forms take one block pointer per rank, in rank order (torch's list forms); gather's
  // outs and scatter's ins are the root's (empty elsewhere) and must then lie on the device of
  // the other buffers (UsageError: every rank decides by the buffers every rank has).
  // Overlapping buffers other than in place (allgather's own block = in, reduce_scatter's
  // out = its own block, reduce's in = out) are refused with std::invalid_argument.
  std::shared_ptr<StreamOp> allGatherOnStream(const void* in, void* out, size_t bytes,
                                              const void* stream);
  std::shared_ptr<StreamOp> allGatherOnStream(const void* in, const std::vector<void*>& outs,
                                              size_t bytes, const void* stream);
  std::shared_ptr<StreamOp> gatherOnStream(const void* in, const std::vector<void*>& outs,
                                           size_t bytes, int root, const void* stream);
  std::shared_ptr<StreamOp> broadcastOnStream(void* buf, size_t bytes, int root,
                                              const void* stream);
  std::shared_ptr<StreamOp> scatterOnStream(const std::vector<const void*>& ins, void* out,
                                            size_t bytes, int root, const void* stream);
  std::shared_ptr<StreamOp> reduceOnStream(const void* in, void* out, size_t count, DataType t,
                                           ReduceOp op, int root, const void* stream);
  std::shared_ptr<StreamOp> reduceScatterOnStream(const void* in, void* out, size_t count,
                                                  DataType t, ReduceOp op, const void* stream);
  std::shared_ptr<StreamOp> reduceScatterOnStream(const std::vector<const void*>& ins,
                                                  void* out, size_t count, DataType t,
                                                  ReduceOp op, const void* stream);
  std::shared_ptr<StreamOp> allToAllOnStream(const void* in, void* out, size_t block,
                                             const void* stream);
  std::shared_ptr<StreamOp> allToAllOnStream(const std::vector<const void*>& ins,
                                             const std::vector<void*>& outs, size_t block,
                                             const void* stream);
  // An all-to-all with sizes (allToAllV's arguments): the ranks first agree on the sizes on
  // the host (a wait until every rank issued it; no GPU work waited for), so every rank must
  // issue it on this path (the torch backend: all_to_all_single with splits). ordinal: the
  // device of in and out, for a rank whose buffers are both empty (null pointers; -1: none).
  std::shared_ptr<StreamOp> allToAllVOnStream(const void* in, const std::vector<size_t>& send_bytes,
                                              const std::vector<size_t>& send_offsets, void* out,
                                              const std::vector<size_t>& recv_bytes,
                                              const std::vector<size_t>& recv_offsets,
                                              const void* stream, int ordinal = -1);
  // The same with one pointer per block (torch's list form; null for an empty block).
  std::shared_ptr<StreamOp> allToAllVOnStream(const std::vector<const void*>& ins,
                                              const std::vector<size_t>& send_bytes,
                                              const std::vector<void*>& outs,
                                              const std::vector<size_t>& recv_bytes,
                                              const void* stream, int ordinal = -1);
  // Send/recv of GPU memory on one host (pg/stream_p2p.h): queued on a stream of the engine's
  // for the peer and direction, after the caller's work so far on `stream`; wait() blocks
  // until done and checks it (a recv: that the message is the sender's next one of this size
  // and tag), orderAfter(s) makes stream s wait for it. Null when the group does not take this
  // path (elastic, spanning hosts, more than 32 ranks, MC_PG_STREAM_OPS, host memory, this rank
  // could not set it up): the caller runs send/recv. Messages between two ranks match in order
  // (no any-source recv); ops may be waited for in any order, from any thread. ordinal: the
  // device of an empty buffer (-1: none).
  std::shared_ptr<StreamOp> sendOnStream(const void* buf, size_t bytes, int dst, uint64_t tag,
                                         const void* stream, int ordinal = -1);
  std::shared_ptr<StreamOp> recvOnStream(void* buf, size_t bytes, int src, uint64_t tag,
                                         const void* stream, int ordinal = -1);
  // Stream-ordered ops (collectives, sends and recvs) issued by this rank so far (tests).
  uint64_t streamOps() const;
  void reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op, int root);
  void broadcast(void* buf, size_t bytes, int root);
  // out holds size() blocks of `bytes`, rank order. blocks (elastic groups): the number of
  // blocks the caller's buffers hold (its size() when it made the call; -1: size() now); an op
  // whose group changed size in between fails (PeerFailure) instead of overrunning them.
  void allGather(const void* in, void* out, size_t bytes, int blocks = -1);
  // Rank r contributes bytes[r] (may differ per rank); out is their concatenation.
  void allGatherV(const void* in, void* out, const std::vector<size_t>& bytes);
  // out used on root only
  void gather(const void* in, void* out, size_t bytes, int root, int blocks = -1);
  // in used on root only
  void scatter(const void* in, void* out, size_t bytes, int root, int blocks = -1);
  // in holds size() blocks of `count` elements; out gets the reduced block of this rank.
  void reduceScatter(const void* in, void* out, size_t count, DataType t, ReduceOp op,
                     int blocks = -1);
  // Rank r sends send_bytes[j] from in + send_offsets[j] to rank j, which receives it at
  // out + recv_offsets[r]; recv_bytes[r] must equal what r sends (checked, CommError).
  void allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                 const std::vector<size_t>& send_offsets, void* out,
                 const std::vector<size_t>& recv_bytes,
                 const std::vector<size_t>& recv_offsets);
  void barrier();

  // ---- point to point (any thread) ----
  // Completes when the data left this process (buffered at the receiver if needed).
  void send(const void* buf, size_t bytes, int dst, uint64_t tag);
  // src = -1: any source. Returns the source rank. Throws CommError on size mismatch.
  int recv(void* buf, size_t bytes, int src, uint64_t tag);

  // ---- what services built on the group (ep, store) reuse ----
  // The engine peer of a rank (this rank's own engine for rank()).
  engine::PeerId peerOf(int rank) const;
  std::shared_ptr<engine::Rendezvous> rendezvous() const;

  // How collectives travel: "shm" (every rank maps every other's buffer), "net" (engine
  // messages), or "hierarchical: H hosts, L ranks on this one" (a group spanning hosts:
  // allreduce goes through shared memory within each host and messages between hosts).
  const std::string& path() const;
  // Messages of this rank's collectives on the non-shm path written one-sidedly into a
  // peer's receive slots so far (MC_PG_NET_SLOTS; the rest travel two-sided).
  uint64_t netSlotSends() const;
  // Steps of this rank's collectives whose GPU data went device to device through its GPU
  // comm halves (same-host groups; pg/device_stage.h DeviceHalves) so far.
  uint64_t deviceHalfSteps() const;
  // Point-to-point messages this rank sent or received through staging buffers (to and from
  // same-host peers of a plain group; pg/p2p_stage.h) so far: of GPU memory (device to
  // device), of host memory.
  uint64_t p2pDeviceMessages() const;
  uint64_t p2pHostStagedMessages() const;

  // ---- health ----
  // OK, or a CommError-worthy message naming the first dead rank.
  std::vector<int> deadRanks() const;

  // ---- elastic groups (CommOptions::elastic; docs/elastic.md). Slots index everything:
  // rank() is this process's slot; size() is one past the highest active slot (the declared
  // size while an extension rank is isolated). Calls below throw std::logic_error on a plain
  // group, std::invalid_argument for slots outside [0, maxGroupSize()). ----
  bool elastic() const;
  int maxGroupSize() const;
  uint64_t epoch() const;           // the latest view applied here
  std::vector<uint8_t> activeMask() const;  // per slot (only this slot while isolated)
  // Local, communication-free, per slot (1/0): the slot's process joined or is active, and
  // this process has a live connection to it.
  std::vector<uint8_t> peerState(const std::vector<int>& slots) const;
  int numSyncedRanks() const;
  ProposalResult activateRanks(const std::vector<int>& slots);
  ProposalResult deactivateRanks(const std::vector<int>& slots);
  // Declares this (isolated or inactive) rank ready and blocks until a view makes it active.
  void joinGroup();
  SyncResult syncAfterFailure();
  // Called (on whichever thread applied it) after each view this process applies.
  void onViewChange(std::function<void()> cb);

  class Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mooncake::pg
