// NetGroup: the path for groups whose peers are not all mapped (tcp peers, other hosts,
// MC_TRANSPORT=tcp). Collectives are built from ordered messages of a group: sends never
// wait for the receiver (no deadlock in exchange patterns) and a receiver takes the next
// message of a given sender. Every message carries the op's sequence number and signature
// (OpSig); a difference means the ranks called different collectives or shapes (CommError
// naming both calls). finishOp() completes the check for ranks that only sent to, or only
// received from, a peer: the receiver acknowledges with an empty message of the op, so every
// rank has heard from every rank it exchanged with. A rank that refused its arguments of an
// op (reject()) tells every peer: their waits in that op raise PeerRejected, and everyone
// drops that op's messages later (a rank that needed nothing from it, such as a broadcast's
// receiver that hears only from the root, completes the op with the right result).
//
// A message travels one of two ways (docs/rdma.md, "The process group between hosts"):
// - one-sided, into a receive slot: every rank has, per sender, `slots` slots of
//   kSlotHeaderBytes + pieceBytes() in registered memory (a NetArea, kept for the
//   communicator's life) and grants them to the sender when the group starts (a message
//   with their address and its engine descriptor). The sender copies header and payload
//   into its registered staging copy of the slot, WRITEs it into the slot and notify()s the
//   receiver on the group's channel; the engine delivers the notification after the bytes.
//   The receiver reads the payload in place and gives the slot back (a credit
//   notification). With no slot free at the receiver the message waits in a queue here and
//   is posted by the thread that receives the credit. Over rdma these are RDMA WRITEs.
// - two-sided: payloads under MC_PG_NET_SLOT_MIN_BYTES, empty acknowledgements, aborts, the
//   grants, and every message to a receiver that granted no slots: by default a rank grants
//   them to the peers it reaches over rdma only (MC_PG_NET_ONE_SIDED), since over tcp a
//   one-sided write is itself a socket message and the notification and credit frames
//   only add to it; also MC_PG_NET_SLOTS=0, or a grant that has not arrived yet.
// Messages of one sender carry a stream number, so the receiver takes them in the order
// they were sent whichever way each travelled.
//
// Elastic groups build a NetGroup per view over the same NetArea: a sender's region at a
// receiver is indexed by its slot (stable across views), a view's sender writes only after
// the receiver granted the region in that view (so after the receiver stopped reading it
// for the previous one), and a NetGroup waits for its writes before it goes (a sender whose
// writes do not end there never writes to that receiver one-sidedly again).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
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
  static constexpr size_t kHeaderBytes = 48;
  struct Header;  // of every message (net_group.cc)

  // A received message; data()/size() exclude the header. Either a two-sided message's
  // buffer or a receive slot of src (valid until recycle()).
  struct Msg {
    std::string buf;
    const char* slot_data = nullptr;
    size_t slot_len = 0;
    int src = -1, slot = -1;
    const char* data() const { return slot >= 0 ? slot_data : buf.data() + kHeaderBytes; }
    size_t size() const { return slot >= 0 ? slot_len : buf.size() - kHeaderBytes; }
  };

  // area (optional): receive slots and staging; index: each rank's index in it; grant: the
  // ranks this rank grants its slots to (empty: all); slot_min_bytes: smaller payloads go as
  // two-sided messages.
  NetGroup(engine::TransferEngine* engine, const Health* health,
           std::vector<engine::PeerId> peers, int rank, uint32_t channel, int64_t health_us,
           size_t piece_bytes, std::shared_ptr<NetArea> area = nullptr,
           std::vector<int> index = {}, std::vector<uint8_t> grant = {},
           size_t slot_min_bytes = 0);
  ~NetGroup();
  // Installs the message and notification handlers (before any peer can send to this
  // group) and grants this rank's receive slots to every peer.
  void start();

  // Large payloads are cut into pieces of pieceBytes(); senders and receivers cut the same
  // way (sendPieces / recvPieces), so both agree on the message sequence.
  size_t pieceBytes() const { return piece_; }
  void send(const OpCtx& op, int dst, const void* data, size_t len);
  Msg take(const OpCtx& op, int src, size_t expect_len);
  void recv(const OpCtx& op, int src, void* out, size_t len);
  // Hands a consumed message's memory back to the engine (for the next received ones).
  void recycle(Msg&& m);
  // After an op left by an exception that keeps the group (PeerRejected): gives back the
  // receive slots of the messages take() handed out in it and nobody recycled (the Msgs are
  // gone), so that their senders get their credit back.
  void releaseHeld();
  void sendPieces(const OpCtx& op, int dst, const void* data, size_t len);
  void recvPieces(const OpCtx& op, int src, void* out, size_t len);
  // Tells every peer (best effort) that this rank gave up on the group, blaming `blamed`
  // (-1: none in particular) for `reason`: their waits fail fast, with that reason. died: see
  // ShmGroup::abort.
  void abort(int blamed, const std::string& reason = "", bool died = false);
  // This rank refused its own arguments of op #op.seq (Communicator::reject), which its peers
  // call: tells every peer (best effort), whose waits in that op raise PeerRejected naming this
  // rank, op.name and why. Every rank then drops what was sent in a refused op as it takes
  // later ops' messages (their slots go back to the senders), so later ops pair.
  void reject(const OpCtx& op, const std::string& why);
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
  struct Entry {
    std::string buf;  // a two-sided message (header + payload)
    int slot = -1;    // or a receive slot
    size_t len = 0;
    uint64_t seq = 0;
    uint64_t sig[2] = {0, 0};
  };
  struct Queues {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::map<uint64_t, Entry>> by_src;  // by the sender's stream number
    std::vector<uint64_t> next_in;                  // per sender: the stream number taken next
    std::vector<int> aborted;  // per peer: 0, or 2 + blamed rank (1: no rank in particular)
    std::vector<std::string> abort_reason;
    std::vector<uint8_t> abort_died;
    std::vector<uint64_t> abort_seq;  // per peer: the last op it took part in when it aborted
    struct Refusal {
      int rank = -1;
      std::string op, why;
    };
    std::map<uint64_t, Refusal> refused;  // ops some rank refused (reject), the first one's note
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
  // A queued message as a Msg (for recycle()).
  Msg entryMsg(int src, Entry&& e) const;
  // The op in flight (the collective-running thread only): whom it sent to, heard from.
  void track(const OpCtx& op);
  std::atomic<uint64_t> op_seq_{0};  // read by abort(), which an elastic controller may call
  std::vector<uint8_t> sent_, heard_;
  std::vector<std::pair<int, int>> held_;  // (src, slot) taken and not recycled yet

  // ---- receive slots ----
  std::shared_ptr<NetArea> area_;
  std::vector<int> index_;
  std::vector<uint8_t> grant_;
  size_t slot_min_ = 0;
  std::unique_ptr<SlotSender> slots_;  // with area_
  std::vector<uint64_t> out_stream_;   // per receiver: the next stream number
  void onNotify(const engine::Notification& nt);
  [[noreturn]] void failSend(const OpCtx& op, int dst, size_t len, const Status& st);
  void throwIfSendFailed(const OpCtx& op);
};

}  // namespace mooncake::pg
