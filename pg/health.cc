#include "pg/health.h"

#include <thread>

#include "pg/communicator.h"
#include "pg/types.h"

namespace mooncake::pg {

Health::Health(engine::TransferEngine* engine, std::vector<engine::PeerId> peers, int rank,
               std::string group, std::vector<int> names)
    : engine_(engine),
      peers_(std::move(peers)),
      rank_(rank),
      group_(std::move(group)),
      names_(std::move(names)) {}

void Health::check(const OpCtx& op, int only_rank) const {
  int lo = only_rank >= 0 ? only_rank : 0;
  int hi = only_rank >= 0 ? only_rank + 1 : static_cast<int>(peers_.size());
  for (int r = lo; r < hi; ++r) {
    if (r == rank_ || peers_[r] == engine::kInvalidPeer) continue;
    Status st = engine_->peerStatus(peers_[r]);
    if (st.ok()) continue;
    throw CommError("mooncake pg: rank " + std::to_string(name(r)) + " (group " + group_ +
                        ") died during " + op.name + ": " + st.toString(),
                    name(r), op.name);
  }
}

std::vector<int> Health::deadRanks() const {
  std::vector<int> dead;
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
    if (r == rank_ || peers_[r] == engine::kInvalidPeer) continue;
    if (!engine_->peerStatus(peers_[r]).ok()) dead.push_back(r);
  }
  return dead;
}

void Health::timedOut(const OpCtx& op, int rank, const std::string& what) const {
  std::string who = rank >= 0 ? "rank " + std::to_string(name(rank)) : std::string("the group");
  throw CommError("mooncake pg: " + std::string(op.name) + " timed out after " +
                      std::to_string(op.timeout.count()) + " ms on rank " +
                      std::to_string(name(rank_)) + " (group " + group_ + ", op #" +
                      std::to_string(op.seq) + ") waiting for " + who + ": " + what,
                  name(rank), op.name);
}

// blamed is already a rank of the user's group: abort notices carry those.
void Health::aborted(const OpCtx& op, int rank, int blamed, const std::string& reason,
                     bool died) const {
  if (died && blamed >= 0) {
    int idx = -1;  // blamed's index here (a sub-group's Health names its ranks)
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r)
      if (name(r) == blamed) idx = r;
    if (idx >= 0 && idx != rank_ && peers_[idx] != engine::kInvalidPeer) {
      const auto until = engine::Clock::now() + std::chrono::seconds(1);
      while (engine_->peerStatus(peers_[idx]).ok() && engine::Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::string cause = !reason.empty() ? reason
                      : blamed >= 0   ? "it saw rank " + std::to_string(blamed) + " fail"
                      : blamed == kLeftView
                          ? std::string("it left this view of the group for a newer one")
                          : std::string("it timed out or failed");
  throw CommError("mooncake pg: rank " + std::to_string(name(rank)) + " (group " + group_ +
                      ") aborted " + op.name + ": " + cause,
                  blamed >= 0 ? blamed : blamed == kLeftView ? -1 : name(rank), op.name);
}

void Health::mismatch(const OpCtx& op, int rank, const OpSig& theirs) const {
  throw MismatchError("mooncake pg: mismatched collective (group " + group_ + ", op #" +
                      std::to_string(op.seq) + "): rank " + std::to_string(name(rank_)) +
                      " called " + op.sig.describe() + " but rank " +
                      std::to_string(name(rank)) + " called " + theirs.describe() +
                      ": every rank must call the same collectives in the same order, with "
                      "the same dtype, element count and root",
                  name(rank), op.name);
}

void Health::mismatchBetween(const OpCtx& op, uint64_t seq, int a, const OpSig& sa, int b,
                             const OpSig& sb) const {
  throw MismatchError("mooncake pg: " + std::string(op.name) + " on rank " + std::to_string(name(rank_)) +
                      " (group " + group_ + ") failed: the group broke on mismatched collectives "
                      "(op #" + std::to_string(seq) + "): rank " + std::to_string(name(a)) +
                      " called " + sa.describe() + " but rank " + std::to_string(name(b)) +
                      " called " + sb.describe() +
                      ": every rank must call the same collectives in the same order, with "
                      "the same dtype, element count and root",
                  name(b), op.name);
}

void Health::rejected(const OpCtx& op, int rank, const std::string& its_op,
                      const std::string& why) const {
  throw PeerRejected("mooncake pg: " + std::string(op.name) + " on rank " +
                         std::to_string(name(rank_)) + " (group " + group_ + ", op #" +
                         std::to_string(op.seq) + ") failed: rank " +
                         std::to_string(name(rank)) + " gave " + its_op +
                         " an invalid argument: " + why,
                     name(rank), op.name);
}

void Health::outOfStep(const OpCtx& op, int rank, uint64_t theirs) const {
  throw MismatchError("mooncake pg: " + std::string(op.name) + " (group " + group_ + ", op #" +
                      std::to_string(op.seq) + ") on rank " + std::to_string(name(rank_)) +
                      ": rank " + std::to_string(name(rank)) + " is at op #" +
                      std::to_string(theirs) +
                      ": the ranks' collectives went out of step (an earlier call differed)",
                  name(rank), op.name);
}

void OpSig::pack(uint64_t w[2]) const {
  w[0] = static_cast<uint64_t>(kind) | static_cast<uint64_t>(dtype) << 8 |
         static_cast<uint64_t>(redop) << 16 |
         static_cast<uint64_t>(static_cast<uint32_t>(root + 1)) << 24;
  w[1] = kind == OpKind::kAllGatherV ? shape : count;
}

OpSig OpSig::unpack(const uint64_t w[2]) {
  OpSig s;
  s.kind = static_cast<OpKind>(w[0] & 0xff);
  s.dtype = static_cast<uint8_t>(w[0] >> 8);
  s.redop = static_cast<uint8_t>(w[0] >> 16);
  s.root = static_cast<int32_t>(static_cast<uint32_t>(w[0] >> 24)) - 1;
  (s.kind == OpKind::kAllGatherV ? s.shape : s.count) = w[1];
  return s;
}

std::string OpSig::describe() const {
  static const char* const kNames[] = {"an unchecked op", "allreduce", "reduce", "broadcast",
                                       "allgather",       "allgatherv", "gather", "scatter",
                                       "reduce_scatter",  "alltoall",   "barrier"};
  size_t k = static_cast<size_t>(kind);
  std::string s = k < sizeof(kNames) / sizeof(kNames[0]) ? kNames[k] : "op kind " + std::to_string(k);
  const bool bytes_op = kind == OpKind::kBroadcast || kind == OpKind::kAllGather ||
                        kind == OpKind::kAllGatherV || kind == OpKind::kGather ||
                        kind == OpKind::kScatter || kind == OpKind::kAllToAll;
  const std::string dt = dtype != 0 ? dtypeName(static_cast<DataType>(dtype - 1)) : "";
  if (kind == OpKind::kAllToAll && dtype != 0) return s + "(" + dt + ")";
  if (kind == OpKind::kNone || kind == OpKind::kBarrier || kind == OpKind::kAllToAll) return s;
  s += "(";
  if (kind == OpKind::kAllGatherV) {
    if (dtype != 0) s += dt + ", ";
    s += "per-rank sizes #" + std::to_string(shape % 100000);
  } else if (bytes_op && dtype != 0) {  // a copy op with its dtype: count is bytes
    s += dt + ", " + std::to_string(count) + " bytes";
  } else if (dtype != 0) {
    s += dt + " x " + std::to_string(count);
  } else {
    s += std::to_string(count) + " bytes";
  }
  if (redop != 0) s += std::string(", ") + reduceOpName(static_cast<ReduceOp>(redop - 1));
  if (root >= 0) s += ", root " + std::to_string(root);
  s += ")";
  return s;
}

}  // namespace mooncake::pg
