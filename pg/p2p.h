// Point-to-point send/recv over engine messages (a channel per group). Eager: a message is
// delivered into the receiver's mailbox whether or not a matching recv is posted, so
// isend/irecv patterns in any order never deadlock. Messages larger than a piece are split
// and reassembled; recv matches by (src, tag), first sent first matched; src = -1 matches
// any sender. Any thread may send or receive.
//
// Pieces of messages of MC_PG_NET_SLOT_MIN_BYTES and more to a peer that granted receive
// slots (the peers reached over rdma, MC_PG_NET_ONE_SIDED; net_slots.h) are written
// one-sidedly into them; the receiver copies each into its mailbox as it arrives and gives
// the slot back at once. The rest are two-sided messages. Every piece carries a stream
// number per (sender, receiver), so the mailbox takes them in sending order whichever way
// each travelled.
//
// Elastic groups index ranks by slot, and a slot's process can change (a replacement): the
// table of peers is swapped at each view (setPeers), and a message matches a receive from slot
// s only when it came from the engine that holds s now. Messages of a replaced process are
// dropped; messages of a process this rank does not know yet (it joined, and sent, before
// this rank applied the view) wait in the mailbox.
//
// Plain groups, peers on this host (reached over shm): a message from GPU memory travels
// device to device through a staging buffer of the sender's GPU memory, a host message of
// MC_PG_P2P_STAGE_BYTES and more through one of its shared host memory (pg/p2p_stage.h);
// else GPU data is staged through pinned host memory into the engine's messages. A receive
// into GPU or host memory takes every kind.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
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
#include "pg/net_slots.h"
#include "pg/p2p_stage.h"

namespace mooncake::pg {

class P2p {
 public:
  // area: receive slots when a peer first gets a grant (null: none); one_sided:
  // MC_PG_NET_ONE_SIDED; slot_min_bytes: smaller messages go two-sided.
  P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
      int rank, uint32_t channel, int64_t health_us, size_t piece_bytes,
      std::function<std::shared_ptr<NetArea>()> area = nullptr, std::string one_sided = "none",
      size_t slot_min_bytes = 0);
  ~P2p();
  void start();
  // Elastic groups: the peers by slot (kInvalidPeer: not active in the view), the engine id of
  // each slot's process (0: none; inactive members too), and a Health over the peers. Sends and receives in flight see the new table at
  // their next check; a receive from a slot that has no process any more fails.
  void setPeers(std::vector<engine::PeerId> peers, std::vector<uint64_t> engines,
                std::shared_ptr<const Health> health);

  // buf and the receive buffer may be GPU memory of the device layer (engine/device/device.h).
  void send(const void* buf, size_t bytes, int dst, uint64_t tag, std::chrono::milliseconds timeout);
  int recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout);
  // Messages sent and received through staging buffers so far (GPU ones: device to device;
  // host ones), for tests.
  uint64_t deviceMessages() const { return device_messages_.load(); }
  uint64_t hostStagedMessages() const { return host_staged_.load(); }

 private:
  struct Complete {
    int src;
    uint64_t tag;
    std::string data;     // the message, or (staged) its descriptor
    uint64_t engine = 0;  // the sender's engine
    uint32_t staged = 0;  // in a staging buffer of the sender (p2p_stage.h): kFlag* of p2p.cc
    uint64_t bytes = 0;   // staged: the message's size
  };
  struct Partial {
    uint64_t tag = 0;
    std::string data;
  };
  struct Stream {  // what one sender's engine sent here, by stream number
    uint64_t next = 0;
    std::map<uint64_t, std::string> held;  // arrived ahead of `next`
  };
  struct Box {
    std::mutex mu;
    std::condition_variable cv;
    std::list<Complete> ready;                              // sending order per sender
    std::map<std::pair<int, uint64_t>, Partial> partial;  // (src, message id)
    std::map<uint64_t, Stream> streams;                   // by sender engine
    // A piece (header + data) from `engine`; self: sent by this rank to itself (in order).
    void deliver(std::string&& payload, uint64_t engine, bool self);
    void take(std::string&& payload, uint64_t engine);  // mu held, in order
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
  std::map<engine::PeerId, uint64_t> out_stream_;  // send_mu_: next stream number per peer
  bool started_ = false;

  // ---- receive slots (net_slots.h) ----
  std::function<std::shared_ptr<NetArea>()> get_area_;
  std::string one_sided_;
  size_t slot_min_;
  std::shared_ptr<NetArea> area_;        // table_mu_; set once
  std::shared_ptr<SlotSender> slots_;    // table_mu_; set once
  std::vector<uint64_t> granted_;        // table_mu_: per slot, the engine granted to (1: a plain peer)
  std::vector<uint64_t> known_;          // table_mu_: per slot, the engine the sender state is for
  std::map<uint64_t, std::pair<int, std::string>> early_grants_;  // table_mu_: by engine
  bool area_tried_ = false;              // table_mu_
  std::shared_ptr<SlotSender> slotSender() const;
  // Makes slots_ when it can (table_mu_ held); false: none (two-sided only).
  bool ensureSlotsLocked(const Table& t);
  // Grants slots to the table's peers that should have them and have not (table_mu_ held).
  void grantLocked(const Table& t);
  void onNotify(const engine::Notification& nt);
  // The first message in the mailbox that a receive (src, tag) matches, taken out (box_->mu).
  bool takeLocked(int src, uint64_t tag, Complete* out);
  // The end of a receive: the size check, the copy into buf; the sender's rank.
  int finishRecv(Complete& c, void* buf, size_t bytes, uint64_t tag);
  // A message to a same-host peer through a staging buffer (device: GPU data, device to
  // device); false: it must go the other way.
  bool sendStaged(const Table& t, const OpCtx& op, const void* buf, size_t bytes, int dst,
                  uint64_t tag, bool device);
  // Tells rank src's process that its staging buffer `token` (of the pool `flags` names) is
  // free again.
  void releaseStaged(int src, uint32_t flags, uint64_t token);

  bool device_p2p_;         // MC_PG_GPU_P2P
  size_t host_stage_min_;   // MC_PG_P2P_STAGE_BYTES (0: never)
  StageOutbox gpu_out_;
  StageOutbox host_out_;
  StageInbox inbox_;
  std::atomic<uint64_t> device_messages_{0};
  std::atomic<uint64_t> host_staged_{0};
  void onGrant(int src, uint64_t engine, std::string grant);
};

}  // namespace mooncake::pg
