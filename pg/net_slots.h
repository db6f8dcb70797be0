// NetSlots: one-sided mailboxes between the ranks of a group over the engine, the way the
// process group moves bytes to peers it does not map (other hosts; MC_TRANSPORT=tcp).
//
// Every rank registers one receive area holding `slots` slots per source rank. To send, a
// rank writes a message (a 64-byte slot header, the caller's header and the payload) into a
// free slot at the receiver with one-sided WRITEs and then notify()s the receiver on the
// group's notification channel; the engine delivers the notification only after the written
// bytes are in the receiver's memory (write-with-immediate semantics), so the receiver reads
// the message in place. A slot is written again only after its receiver gave it back (a
// credit notification naming it; slots may come back in any order). Over tcp the payload
// leaves from the caller's memory (writev, no copy) and lands in the receiver's registered
// area; over rdma it is an RDMA WRITE (memory the engine has not registered goes through its
// bounce pool); the receiver reads it where it landed.
//
// Sends never wait for the receiver: with no free slot at it, a message is copied and queued
// here (in order behind earlier ones to that receiver), and posted by the thread that
// receives the credit. So exchange patterns in any order never deadlock (as with two-sided
// eager messages), and a copy is made only while a receiver is behind.
//
// Ownership of memory: a payload posted straight from the caller's memory (larger than
// kInlineBytes, with a free slot) must stay valid and unmodified until drain() (or
// drainOverlapping() for a range that covers it) returned; otherwise the caller's memory is
// free when send() returns.
//
// Threading: send/drain by the owner's thread(s), serialised by an internal mutex; the data
// callback runs on the engine's dispatcher thread, which also posts queued messages.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

class NetSlots {
 public:
  static constexpr size_t kSlotHeaderBytes = 64;  // slot header (16) + owner header (<= 48)
  static constexpr size_t kOwnerHeaderBytes = 48;
  static constexpr size_t kInlineBytes = 8192;    // payloads copied into the header's WRITE

  struct Config {
    uint32_t channel = 0;   // the engine notification channel of this mailbox set
    int slots = 4;          // per source
    size_t slot_bytes = 0;  // payload capacity of one slot (multiple of 64)
    std::string key;        // rendezvous key prefix, unique per group incarnation and use
  };

  // Collective over `peers` (indexed like the group; peers[rank] unused): allocates this
  // rank's receive area and send staging from the engine (registered once), publishes their
  // addresses and this engine's descriptor, and waits for every peer's (updatePeer with it).
  static Result<std::unique_ptr<NetSlots>> create(engine::TransferEngine* engine,
                                                  engine::Rendezvous& rdv,
                                                  std::vector<engine::PeerId> peers, int rank,
                                                  Config cfg, engine::Deadline deadline);
  ~NetSlots();

  // Installs the notification handler: on_data(src, slot) on the engine's dispatcher thread
  // for every message that arrived (the owner takes it; the slot stays the owner's until
  // giveBack). Call before any peer may send (the set-up's rendezvous ensures that).
  void start(std::function<void(int src, int slot)> on_data);

  int size() const { return static_cast<int>(peers_.size()); }
  int slots() const { return cfg_.slots; }
  size_t slotBytes() const { return cfg_.slot_bytes; }

  // ---- sending ----
  // Sends one message to dst (never waits for dst; see above). owner_hdr: at most
  // kOwnerHeaderBytes. Errors: the engine's (kPeerDead naming the peer), now or from an
  // earlier queued message to any peer.
  Status send(int dst, const void* owner_hdr, size_t hdr_len, const void* data, size_t len);
  // Waits for the writes posted so far (their sources may be reused afterwards). On failure,
  // *failed_dst (optional) names the receiver of the first write that failed.
  Status drain(engine::Deadline deadline, int* failed_dst = nullptr);
  // The same, only when a posted write's source overlaps [p, p+len) (else returns at once).
  Status drainOverlapping(const void* p, size_t len, engine::Deadline deadline,
                          int* failed_dst = nullptr);

  // ---- receiving ----
  struct View {
    bool ok = false;  // false: the slot holds no well-formed message
    const char* owner_hdr = nullptr;
    const char* payload = nullptr;
    size_t len = 0;
  };
  // The message in slot k of src (valid until giveBack(src, k)).
  View view(int src, int k) const;
  // Hands slot k of src back to its sender (a credit notification).
  Status giveBack(int src, int k);

 private:
  struct Pending {
    engine::BatchId id;
    int dst;
    const char* lo;     // source range written from the caller's memory (lo == hi: none)
    const char* hi;
    std::string owned;  // a queued message's copy, alive until its write is done
  };
  struct Queued {
    std::string hdr;
    std::string data;
  };

  NetSlots() = default;
  char* localSlot(int src, int k) const;
  uint64_t remoteSlot(int dst, int k) const;
  // Writes one message into slot k of dst and notifies dst (mu_ held).
  Status postLocked(int dst, int k, const void* hdr, size_t hdr_len, const char* data,
                    size_t len, std::string owned);
  // Posts queued messages to dst while it has free slots (mu_ held).
  void flushLocked(int dst);
  void noteFailureLocked(const Status& st, int dst);
  void reapLocked();
  void onCredit(int src, int k);

  engine::TransferEngine* engine_ = nullptr;
  std::vector<engine::PeerId> peers_;
  std::vector<uint64_t> engines_;  // engine id of each index (a notification's sender)
  int rank_ = 0;
  Config cfg_;
  size_t stride_ = 0;  // bytes per slot in the area (header + slot_bytes)
  char* area_ = nullptr;
  char* staging_ = nullptr;  // [dst][slot] kSlotHeaderBytes + kInlineBytes
  std::vector<uint64_t> remote_area_;
  std::function<void(int, int)> on_data_;

  std::mutex mu_;  // everything below
  std::vector<std::deque<int>> free_;       // per receiver: its slots we may write
  std::vector<std::deque<Queued>> queued_;  // per receiver: messages waiting for a slot
  std::deque<Pending> pending_;             // posted writes, oldest first
  Status failure_;                          // first failure not reported yet
  int failed_dst_ = -1;
  uint64_t bad_ = 0;  // notifications that named no peer of this group
  bool started_ = false;
};

}  // namespace mooncake::pg
