#include "pg/health.h"

#include "pg/communicator.h"

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
void Health::aborted(const OpCtx& op, int rank, int blamed) const {
  std::string cause = blamed >= 0 ? "it saw rank " + std::to_string(blamed) + " fail"
                                  : std::string("it timed out or failed");
  throw CommError("mooncake pg: rank " + std::to_string(name(rank)) + " (group " + group_ +
                      ") aborted " + op.name + ": " + cause,
                  blamed >= 0 ? blamed : name(rank), op.name);
}

}  // namespace mooncake::pg
