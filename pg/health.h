// Peer liveness and the errors that name a failed rank. One per communicator; read-only
// after construction, so any thread may call it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

// What every rank must agree on for one collective: checked on the data path (the shm
// group's descriptor lines, the net group's message headers), so that ranks that called
// different collectives, dtypes, sizes or roots all raise an error naming both shapes
// instead of exchanging wrong data. Packed into 2 words for the wire and shared memory (so
// that a shm descriptor shares the cache line of the flag a peer reads anyway).
enum class OpKind : uint8_t {
  kNone = 0,
  kAllReduce,
  kReduce,
  kBroadcast,
  kAllGather,
  kAllGatherV,
  kGather,
  kScatter,
  kReduceScatter,
  kAllToAll,
  kBarrier,
};

struct OpSig {
  OpKind kind = OpKind::kNone;
  uint8_t dtype = 0;  // DataType + 1; 0: the op moves bytes
  uint8_t redop = 0;  // ReduceOp + 1; 0: none
  int32_t root = -1;
  uint64_t count = 0;  // elements (typed ops) or bytes (per rank where each rank sends one block)
  uint64_t shape = 0;  // allgatherv only (count 0): a hash of the per-rank sizes

  bool operator==(const OpSig& o) const {
    return kind == o.kind && dtype == o.dtype && redop == o.redop && root == o.root &&
           count == o.count && shape == o.shape;
  }
  bool operator!=(const OpSig& o) const { return !(*this == o); }
  void pack(uint64_t w[2]) const;
  static OpSig unpack(const uint64_t w[2]);
  // "allreduce(float32 x 10, sum)", "broadcast(50 bytes, root 0)", ...
  std::string describe() const;
};

// What an op in flight carries: its name (for errors), its deadline and sequence number,
// and its signature (OpKind::kNone: not checked, e.g. point-to-point).
struct OpCtx {
  const char* name;
  engine::Deadline deadline;
  uint64_t seq;
  std::chrono::milliseconds timeout;
  OpSig sig{};
};

class Health {
 public:
  // names[r]: the rank that index r is in the user's group, for errors (a sub-group of a
  // hierarchical group indexes a subset of the ranks); empty: r itself.
  Health(engine::TransferEngine* engine, std::vector<engine::PeerId> peers, int rank,
         std::string group, std::vector<int> names = {});
  // Throws CommError("mooncake pg: rank R (group G) died during OP: <engine status>") for
  // the lowest dead rank; no-op while every peer is alive. only_rank >= 0 checks just it
  // (waits check the rank they wait for: a peer that finished and exited is no failure).
  void check(const OpCtx& op, int only_rank = -1) const;
  std::vector<int> deadRanks() const;
  // Throws the CommError for a deadline that passed while waiting for `rank` (-1: several).
  [[noreturn]] void timedOut(const OpCtx& op, int rank, const std::string& what) const;
  // Throws a CommError for a peer that aborted the op (it saw a failure first); reason: what
  // the peer said, when it said anything. died: the peer's engine had seen `blamed` die; this
  // rank then first waits (up to 1 s) until its own engine sees that too, so that deadRanks()
  // names the rank the error blames (the peer's abort can arrive before this engine reads the
  // dead rank's closed connection).
  [[noreturn]] void aborted(const OpCtx& op, int rank, int blamed, const std::string& reason = "",
                            bool died = false) const;
  // blamed value of an abort that says the peer left this view of an elastic group for a
  // newer one: the CommError then blames no rank (the peer did not fail).
  static constexpr int kLeftView = -2;
  // Throws the CommError for a peer that called another collective (or another shape of it)
  // as op #op.seq: both sides' calls, named.
  [[noreturn]] void mismatch(const OpCtx& op, int rank, const OpSig& theirs) const;
  // Throws the CommError for two other ranks found to have called different things as op
  // #seq (seen while this rank handled op `op`, e.g. after one of them aborted).
  [[noreturn]] void mismatchBetween(const OpCtx& op, uint64_t seq, int a, const OpSig& sa, int b,
                                    const OpSig& sb) const;
  // Throws PeerRejected for a peer that refused its own arguments of op #op.seq: "rank R gave
  // OP an invalid argument: WHY" (its_op: the op as that rank named it).
  [[noreturn]] void rejected(const OpCtx& op, int rank, const std::string& its_op,
                             const std::string& why) const;
  // Throws the CommError for a peer whose flags or messages belong to another op (#theirs)
  // than this one: the ranks' collectives went out of step earlier.
  [[noreturn]] void outOfStep(const OpCtx& op, int rank, uint64_t theirs) const;
  const std::string& group() const { return group_; }
  int rank() const { return rank_; }
  int name(int r) const { return names_.empty() || r < 0 ? r : names_[r]; }

 private:
  engine::TransferEngine* engine_;
  std::vector<engine::PeerId> peers_;
  int rank_;
  std::string group_;
  std::vector<int> names_;
};

}  // namespace mooncake::pg
