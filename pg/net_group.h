// NetGroup: the path for groups whose peers are not all mapped (tcp peers, other hosts,
// MC_TRANSPORT=tcp). Collectives are built from ordered two-sided messages on a channel of
// the group: the engine delivers each message to a handler that queues it per sender, so
// sends never wait for the receiver (no deadlock in exchange patterns) and a receiver
// takes the next message of a given sender. Every message carries the op's sequence
// number and signature (OpSig); a difference means the ranks called different collectives or
// shapes (CommError naming both calls). finishOp() completes the check for ranks that only
// sent to, or only received from, a peer: the receiver acknowledges with an empty message of
// the op, so every rank has heard from every rank it exchanged with.
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

namespace mooncake::pg {

class NetGroup {
 public:
  static constexpr size_t kHeaderBytes = 32;

  // A received message; data()/size() exclude the header.
  struct Msg {
    std::string buf;
    const char* data() const { return buf.data() + kHeaderBytes; }
    size_t size() const { return buf.size() - kHeaderBytes; }
  };

  NetGroup(engine::TransferEngine* engine, const Health* health,
           std::vector<engine::PeerId> peers, int rank, uint32_t channel, int64_t health_us,
           size_t piece_bytes);
  ~NetGroup();
  // Installs the message handler (before any peer can send to this group).
  void start();

  // Large payloads are cut into pieces of pieceBytes(); senders and receivers cut the same
  // way (sendPieces / recvPieces), so both agree on the message sequence.
  size_t pieceBytes() const { return piece_; }
  void send(const OpCtx& op, int dst, const void* data, size_t len);
  Msg take(const OpCtx& op, int src, size_t expect_len);
  void recv(const OpCtx& op, int src, void* out, size_t len);
  // Hands a consumed message's memory back to the engine (for the next received ones).
  void recycle(Msg&& m) { engine_->recycleMessageBuffer(std::move(m.buf)); }
  void sendPieces(const OpCtx& op, int dst, const void* data, size_t len);
  void recvPieces(const OpCtx& op, int src, void* out, size_t len);
  // Tells every peer (best effort) that this rank gave up on the group, blaming `blamed`
  // (-1: none in particular) for `reason`: their waits fail fast, with that reason. died: see
  // ShmGroup::abort.
  void abort(int blamed, const std::string& reason = "", bool died = false);
  // Elastic groups retire a view's channel: once this group is destroyed, messages still
  // arriving on it are dropped (instead of queued in the engine for a handler that never comes).
  void dropOnClose() { drop_on_close_ = true; }
  // End of an op: acknowledgements where one side only sent (see above). False when the op
  // exchanged no message in this group.
  bool finishOp(const OpCtx& op);
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
    std::vector<std::deque<std::string>> by_src;
    std::vector<int> aborted;  // per peer: 0, or 2 + blamed rank (1: no rank in particular)
    std::vector<std::string> abort_reason;
    std::vector<uint8_t> abort_died;
    size_t bad = 0;            // malformed messages dropped
  };

  engine::TransferEngine* engine_;
  const Health* health_;
  std::vector<engine::PeerId> peers_;
  int rank_;
  uint32_t channel_;
  int64_t health_us_;
  size_t piece_;
  std::shared_ptr<Queues> q_;
  bool started_ = false;
  bool drop_on_close_ = false;
  // Throws the abort of the first peer that sent one (no-op when none did).
  void throwIfAborted(const OpCtx& op);
  // The op in flight (the collective-running thread only): whom it sent to, heard from.
  void track(const OpCtx& op);
  uint64_t op_seq_ = 0;
  std::vector<uint8_t> sent_, heard_;
};

}  // namespace mooncake::pg
