// One-sided messages into a peer's receive slots, shared by the process group's non-shm
// collectives (NetGroup) and its send/recv (P2p); how they use them: net_group.h, p2p.h and
// docs/rdma.md ("The process group between hosts").
//
// A receiver has, per sender index, `slots` receive slots in registered memory (a NetArea)
// and grants them to the sender: the address of the sender's first slot, the count, the
// stride and its engine descriptor (which lists the area and, over rdma, its keys), carried
// in the owner's own grant message. The sender (SlotSender) copies a message (a header of at
// most kSlotHeaderBytes, then the payload) into its staging copy of a free slot, WRITEs it
// into the receiver's slot and notify()s the receiver on the owner's channel (kTagData |
// slot); the engine delivers the notification after the bytes. The receiver gives the slot
// back with kTagCredit | slot once it is done with it. With no slot free a message waits in
// a queue, posted by the thread that receives the credit, so sends never wait for the
// receiver.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

// Registered memory for one kind of slot user of a communicator ("coll", "leaders", "p2p"):
// per index (a rank, or an elastic group's slot) `slots` receive slots, and as many staging
// slots per destination index. Freed with the communicator, or later: a SlotSender that gives
// up on a write from its staging hands the area to the engine (keepUntilDone), which drops it
// once the write finished. It holds its engine weakly (the engine holding it must not keep
// itself alive); one destroyed first unmapped the area's memory itself.
class NetArea {
 public:
  static constexpr size_t kSlotHeaderBytes = 64;
  // Null (logged) when the engine cannot allocate it.
  static std::shared_ptr<NetArea> create(std::shared_ptr<engine::TransferEngine> engine,
                                         int capacity, int slots, size_t payload);
  ~NetArea();
  int slots() const { return slots_; }
  size_t payload() const { return payload_; }
  size_t stride() const { return kSlotHeaderBytes + payload_; }
  int capacity() const { return capacity_; }
  char* recvSlot(int src_index, int k) const { return at(recv_, src_index, k); }
  char* stagingSlot(int dst_index, int k) const { return at(staging_, dst_index, k); }
  // A NetGroup could not wait out its writes to dst_index: later ones use messages to it.
  void taint(int dst_index) { tainted_[dst_index].store(1); }
  bool tainted(int dst_index) const { return tainted_[dst_index].load() != 0; }
  // Messages written into receive slots through this area so far.
  void countSlotSend() { slot_sends_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t slotSends() const { return slot_sends_.load(std::memory_order_relaxed); }

 private:
  NetArea() = default;
  char* at(char* base, int index, int k) const {
    return base + (static_cast<size_t>(index) * slots_ + k) * stride();
  }
  std::weak_ptr<engine::TransferEngine> engine_;
  int capacity_ = 0, slots_ = 0;
  size_t payload_ = 0;
  char* recv_ = nullptr;
  char* staging_ = nullptr;
  std::unique_ptr<std::atomic<uint8_t>[]> tainted_;
  std::atomic<uint64_t> slot_sends_{0};
};

// A communicator's NetAreas by kind, made when a user of that kind first needs one.
// Elastic groups share the root's between views.
class NetAreas {
 public:
  // capacity: ranks (slots of an elastic group); slots: MC_PG_NET_SLOTS (0: none);
  // payload: the pieces' size (netPieceBytes).
  NetAreas(int capacity, int slots, size_t payload)
      : capacity_(capacity), slots_(slots), payload_(payload) {}
  std::shared_ptr<NetArea> get(const std::string& kind,
                               const std::shared_ptr<engine::TransferEngine>& engine);
  // The size pieces are cut to: MC_PG_NET_PIECE_BYTES, smaller where capacity x slots slots
  // of it would exceed kMaxAreaBytes. The same on every rank of a group whatever the
  // allocations do (senders and receivers must cut alike).
  static size_t pieceBytes(size_t piece_param, int capacity, int slots);
  static constexpr size_t kMaxAreaBytes = 64u << 20;
  uint64_t slotSends();  // over every kind

 private:
  int capacity_, slots_;
  size_t payload_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<NetArea>> by_kind_;
};


// Whether a rank grants its receive slots to `peer` (MC_PG_NET_ONE_SIDED: "rdma" = peers
// reached over rdma, "all", "none").
bool grantSlotsTo(const engine::TransferEngine& engine, engine::PeerId peer,
                  const std::string& mode);

class SlotSender {
 public:
  // Notification tags: kind in the top 2 bits, the slot in the low 16.
  static constexpr uint64_t kTagData = 1ull << 62;
  static constexpr uint64_t kTagCredit = 2ull << 62;
  static uint64_t kindOf(uint64_t tag) { return tag & (3ull << 62); }
  static int slotOf(uint64_t tag) { return static_cast<int>(tag & 0xffff); }

  // index: each destination's index in the area (its rank, or its slot in an elastic group).
  SlotSender(engine::TransferEngine* engine, uint32_t channel, std::shared_ptr<NetArea> area,
             std::vector<int> index);
  // Waits (bounded) for the writes still reading the staging; a destination whose writes do
  // not end gets no one-sided message through this area again (NetArea::taint), and the
  // engine keeps the area until they finished.
  ~SlotSender();
  NetArea& area() const { return *area_; }

  // The grant for destination r of this rank (its slots here).
  std::string grantFor(int r) const;
  // dst's grant arrived (grantFor's bytes at dst); it is checked at first use.
  void onGrant(int dst, std::string grant);
  // dst's process changed (elastic): its grant, free slots and queued messages are dropped.
  void reset(int dst);
  // Writes hdr (hdr_len <= kSlotHeaderBytes) and then len bytes of data into a slot of dst
  // (reached as `peer`), or queues a copy. False: dst granted no usable slots (send it
  // two-sided). *st: this post's error (deadline: for the staging slot's previous write; dst
  // then gets no one-sided message through this area again, and the engine keeps the area
  // until the write finished).
  bool send(engine::PeerId peer, int dst, const void* hdr, size_t hdr_len, const void* data,
            size_t len, engine::Deadline deadline, Status* st, const std::string& who);
  // dst gave slot k back: the oldest message queued for it is posted (errors: takeFailure).
  void onCredit(engine::PeerId peer, int dst, int k);
  // The first error of a queued message's post since the last call (OK: none).
  Status takeFailure(int* dst);
  // Receiver side: slot k of src_index was read; poisons its header (a stale notification
  // cannot read it again) and gives it back to `peer`.
  static void giveBack(engine::TransferEngine* engine, engine::PeerId peer, uint32_t channel,
                       NetArea& area, int src_index, int k);

 private:
  struct Dest {
    uint64_t addr = 0;      // our first slot at dst (0: not granted; ~0: unusable)
    std::string grant;      // not checked yet
    std::deque<int> free;   // its slots we may write
    std::deque<std::string> queued;  // messages (slot header + payload) waiting for a slot
    std::vector<engine::BatchId> staged;  // per slot: the batch that last wrote from it
  };
  Status post(engine::PeerId peer, int dst, int k, const char* hdr, size_t hdr_len,
              const void* data, size_t len, engine::Deadline deadline);
  engine::TransferEngine* engine_;
  uint32_t channel_;
  std::shared_ptr<NetArea> area_;
  std::vector<int> index_;
  std::mutex mu_;
  std::vector<Dest> dests_;
  Status failure_;
  int failed_dst_ = -1;
};

}  // namespace mooncake::pg
