// NetGroup: the path for groups whose peers are not all mapped (other hosts, MC_TRANSPORT=
// tcp). Collectives are built from ordered messages per (sender, receiver), carried by
// one-sided writes into the receiver's registered slots followed by a notification
// (pg/net_slots.h): the bytes travel as RDMA WRITEs over rdma and straight from and into
// memory over tcp, and a receiver reduces or copies straight out of its slot.
//
// Messages of one sender are taken in order; sends never wait (NetSlots queues a copy while
// the receiver has no free slot), so exchange patterns in any order never deadlock.
//
// Every message carries the op's sequence number and signature (OpSig); a difference means
// the ranks called different collectives or shapes (CommError naming both calls).
// finishOp() completes the check for ranks that only sent to, or only received from, a peer:
// the receiver acknowledges with an empty message of the op, so every rank has heard from
// every rank it exchanged with. It also waits for the op's writes to finish, so that the
// caller's memory is free when the op returns. Abort notices travel as engine messages.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "pg/health.h"
#include "pg/net_slots.h"

namespace mooncake::pg {

class NetGroup {
 public:
  static constexpr size_t kHeaderBytes = 32;  // the op's header in each message

  // A received message, in its slot until recycle() gives it back.
  struct Msg {
    int src = -1;
    int slot = -1;
    const char* ptr = nullptr;
    size_t len = 0;
    const char* data() const { return ptr; }
    size_t size() const { return len; }
  };

  // slots: the group's mailboxes (created collectively beforehand; see NetSlots), whose
  // slotBytes() is the piece size.
  NetGroup(engine::TransferEngine* engine, const Health* health,
           std::vector<engine::PeerId> peers, int rank, uint32_t channel, int64_t health_us,
           std::unique_ptr<NetSlots> slots);
  ~NetGroup();
  // Installs the handlers (before any peer can send to this group).
  void start();

  // Large payloads are cut into pieces of pieceBytes(); senders and receivers cut the same
  // way (sendPieces / recvPieces), so both agree on the message sequence.
  size_t pieceBytes() const { return piece_; }
  // `data` must stay valid and unmodified until the op ends (finishOp), or until a receive
  // into memory that overlaps it (which waits for the write first).
  void send(const OpCtx& op, int dst, const void* data, size_t len);
  Msg take(const OpCtx& op, int src, size_t expect_len);
  void recv(const OpCtx& op, int src, void* out, size_t len);
  // Hands a consumed message's slot back to its sender.
  void recycle(Msg&& m);
  void sendPieces(const OpCtx& op, int dst, const void* data, size_t len);
  void recvPieces(const OpCtx& op, int src, void* out, size_t len);
  // Tells every peer (best effort) that this rank gave up on the group, blaming `blamed`
  // (-1: none in particular) for `reason`: their waits fail fast, with that reason.
  void abort(int blamed, const std::string& reason = "");
  // End of an op: acknowledgements where one side only sent (see above), then the op's
  // writes finish. False when the op exchanged no message in this group.
  bool finishOp(const OpCtx& op);
  // After a failed op: waits (briefly) for writes still reading the caller's memory.
  void quiesce();
  // An op that used no group at all (zero bytes): an empty message to and from every peer.
  void barrierOp(const OpCtx& op);
  // Ops where only the root receives (reduce, gather): the root sends every rank an empty
  // message first and the others take it before they send, so ranks that disagree on the
  // root still hear a call they can check instead of all waiting to receive.
  void rootGo(const OpCtx& op, int root);

 private:
  struct Queues {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::deque<int>> by_src;  // slots holding messages not taken yet, in order
    std::vector<int> aborted;  // per peer: 0, or 2 + blamed rank (1: no rank in particular)
    std::vector<std::string> abort_reason;
    size_t bad = 0;            // malformed messages dropped
  };

  [[noreturn]] void sendFailed(const OpCtx& op, int dst, size_t len, const Status& st);

  engine::TransferEngine* engine_;
  const Health* health_;
  std::vector<engine::PeerId> peers_;
  int rank_;
  uint32_t channel_;
  int64_t health_us_;
  std::unique_ptr<NetSlots> slots_;
  size_t piece_;
  std::shared_ptr<Queues> q_;
  bool started_ = false;
  // Throws the abort of the first peer that sent one (no-op when none did).
  void throwIfAborted(const OpCtx& op);
  // The op in flight (the collective-running thread only): whom it sent to, heard from.
  void track(const OpCtx& op);
  uint64_t op_seq_ = 0;
  std::vector<uint8_t> sent_, heard_;
};

}  // namespace mooncake::pg
