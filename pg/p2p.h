// Point-to-point send/recv over one-sided writes into the receiver's slots (pg/net_slots.h,
// a mailbox set per group). Eager: the receiver's engine dispatcher copies each message out
// of its slot into the receiver's mailbox at once and gives the slot back, whether or not a
// matching recv is posted, so isend/irecv patterns in any order never deadlock. Messages
// larger than a piece are split and reassembled; recv matches by (src, tag), first arrived
// first matched; src = -1 matches any sender. Any thread may send or receive.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "pg/health.h"
#include "pg/net_slots.h"

namespace mooncake::pg {

class P2p {
 public:
  P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
      int rank, int64_t health_us, std::unique_ptr<NetSlots> slots);
  ~P2p();
  void start();

  void send(const void* buf, size_t bytes, int dst, uint64_t tag, std::chrono::milliseconds timeout);
  int recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout);

 private:
  struct Complete {
    int src;
    uint64_t tag;
    std::string data;
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
    // A piece of a message (its header fields and payload), copied in.
    void deliver(const char* hdr, const char* payload, size_t len);
  };

  engine::TransferEngine* engine_;
  const Health* health_;
  std::vector<engine::PeerId> peers_;
  int rank_;
  int64_t health_us_;
  std::unique_ptr<NetSlots> slots_;
  size_t piece_;
  std::shared_ptr<Box> box_;
  std::mutex send_mu_;  // keeps the pieces of one message together per sender
  uint64_t next_id_ = 1;
  bool started_ = false;
};

}  // namespace mooncake::pg
