// Point-to-point send/recv over the engine's two-sided messages (a channel per group).
// Eager: a message is delivered into the receiver's mailbox whether or not a matching recv
// is posted, so isend/irecv patterns in any order never deadlock. Messages larger than a
// piece are split and reassembled; recv matches by (src, tag), first arrived first
// matched; src = -1 matches any sender. Any thread may send or receive.
//
// Elastic groups index ranks by slot, and a slot's process can change (a replacement): the
// table of peers is swapped at each view (setPeers), and a message matches a receive from slot
// s only when it came from the engine that holds s now. Messages of a replaced process are
// dropped; messages of a process this rank does not know yet (it joined, and sent, before
// this rank applied the view) wait in the mailbox.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "pg/health.h"

namespace mooncake::pg {

class P2p {
 public:
  P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
      int rank, uint32_t channel, int64_t health_us, size_t piece_bytes);
  ~P2p();
  void start();
  // Elastic groups: the peers by slot (kInvalidPeer: not active in the view), the engine id of
  // each slot's process (0: none; inactive members too), and a Health over the peers. Sends and receives in flight see the new table at
  // their next check; a receive from a slot that has no process any more fails.
  void setPeers(std::vector<engine::PeerId> peers, std::vector<uint64_t> engines,
                std::shared_ptr<const Health> health);

  void send(const void* buf, size_t bytes, int dst, uint64_t tag, std::chrono::milliseconds timeout);
  int recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout);

 private:
  struct Complete {
    int src;
    uint64_t tag;
    std::string data;
    uint64_t engine = 0;  // the sender's engine
  };
  struct Partial {
    uint64_t tag = 0;
    std::string data;
  };
  struct Box {
    std::mutex mu;
    std::condition_variable cv;
    std::list<Complete> ready;                              // arrival order
    std::map<std::pair<int, uint64_t>, Partial> partial;  // (src, message id)
    void deliver(std::string&& payload, uint64_t engine);
  };
  // Who is where (swapped whole by setPeers; readers take a snapshot).
  struct Table {
    std::vector<engine::PeerId> peers;
    std::vector<uint64_t> engines;  // empty: plain group (no check)
    const Health* health = nullptr;
    std::shared_ptr<const Health> owned;
  };
  std::shared_ptr<const Table> table() const;
  // Whether a message of `engine` from slot `src` may match under table t.
  static bool current(const Table& t, int src, uint64_t engine);

  engine::TransferEngine* engine_;
  mutable std::mutex table_mu_;
  std::shared_ptr<const Table> table_;
  std::set<uint64_t> retired_;  // engines that held a slot and were replaced (table_mu_)
  int rank_;
  uint32_t channel_;
  int64_t health_us_;
  size_t piece_;
  std::shared_ptr<Box> box_;
  std::mutex send_mu_;  // keeps the pieces of one message together per sender
  uint64_t next_id_ = 1;
  bool started_ = false;
};

}  // namespace mooncake::pg
