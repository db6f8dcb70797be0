// Peer liveness and the errors that name a failed rank. One per communicator; read-only
// after construction, so any thread may call it.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

// What an op in flight carries: its name (for errors), its deadline and sequence number.
struct OpCtx {
  const char* name;
  engine::Deadline deadline;
  uint64_t seq;
  std::chrono::milliseconds timeout;
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
  // Throws a CommError for a peer that aborted the op (it saw a failure first).
  [[noreturn]] void aborted(const OpCtx& op, int rank, int blamed) const;
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
