// ViewLog: agreement on one value per epoch (an elastic group's next view) among any processes
// of the group, with no coordinator: the group's Rendezvous (torch's c10d store under torch) is
// the only shared object, and it is used as plain registers (set/get) plus a counter (add).
//
// Why not "first add wins, the winner writes the value": the winner may stall (a descheduled
// process on a busy host) after winning; another process that takes over after a deadline can
// then be overwritten by the late winner, and two processes would hold different views of
// the same epoch. A fetch-and-add cannot break that tie for three or more processes (its
// consensus number is 2), so this is Disk Paxos (Gafni and Lamport) on one disk: safe however
// processes stall or die, live as soon as one proposer runs alone for a few store round trips.
//
// Per epoch E, under `prefix`:
//   d/E            the decided value (written by whoever learns it; always the same bytes)
//   n/E            proposers registered so far (add); r/E/<i> = the i-th proposer's id
//   b/E/<id>       that proposer's block: mbal (the highest ballot it started), bal and val (the
//                  last ballot it accepted and the value). Only its owner writes a block.
// A proposer with ballot b: phase 1 writes its block with mbal = b, then reads every registered
// block; a higher mbal aborts; else it adopts the value of the highest bal seen (its own
// proposal when none). Phase 2 writes (b, b, v) and reads again; no higher mbal: v is chosen.
// The registry is read after the write in each phase, so of two proposers at least one reads
// the other's block (the later registration reads the earlier one's block).
// Ballots are (round, id): ids are unique per process (slot and incarnation), rounds grow.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "engine/rendezvous.h"
#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::pg {

class ViewLog {
 public:
  // id: unique among every process that may ever propose in this log (never 0).
  ViewLog(std::shared_ptr<engine::Rendezvous> rdv, std::string prefix, uint64_t id);

  // The decided value of `epoch`, if known yet (one store read).
  Result<std::optional<std::string>> decided(uint64_t epoch);
  // Thread-safe (one proposal of this process runs at a time).
  // Proposes `value` for `epoch` and returns the decided value, which is this proposal or one
  // that another process got decided first. kTimeout when nothing was decided by the deadline
  // (e.g. proposers kept pre-empting each other); errors of the store pass through.
  Result<std::string> propose(uint64_t epoch, const std::string& value, engine::Deadline deadline);

  // Test hook: called at "phase1", "phase2" (after this proposer wrote its block) and "decided"
  // (before the decided value is published), so a test can kill or stop a proposer there.
  std::function<void(const char* point)> on_point;

 private:
  struct Block {
    uint64_t mbal_round = 0, mbal_id = 0;
    uint64_t bal_round = 0, bal_id = 0;
    std::string val;
    std::string serialize() const;
    static bool parse(const std::string& s, Block* out);
  };
  Status writeBlock(uint64_t epoch, const Block& b);
  // Every registered proposer's block (own included); empty blocks for ids not written yet.
  Result<std::vector<Block>> readBlocks(uint64_t epoch);
  std::string key(const char* what, uint64_t epoch) const;

  std::shared_ptr<engine::Rendezvous> rdv_;
  std::string prefix_;
  uint64_t id_;
  std::mutex mu_;            // one proposal of this process at a time (threads share the log)
  uint64_t registered_ = 0;  // the epoch this process registered for (registers once per epoch)
  Block mine_;               // this proposer's block for registered_
};

}  // namespace mooncake::pg
