#include "pg/net_group.h"

#include <cstring>
#include <thread>

#include "engine/log.h"
#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504743;  // "MPGC"
constexpr uint64_t kAbortSeq = ~0ull;    // an abort notice: payload = i32 blamed rank

struct Header {
  uint32_t magic;
  int32_t src;
  uint64_t seq;
  uint64_t sig[2];  // OpSig::pack of the op
};
static_assert(sizeof(Header) == NetGroup::kHeaderBytes, "header layout");
}  // namespace

NetGroup::NetGroup(engine::TransferEngine* engine, const Health* health,
                   std::vector<engine::PeerId> peers, int rank, uint32_t channel,
                   int64_t health_us, std::unique_ptr<NetSlots> slots)
    : engine_(engine),
      health_(health),
      peers_(std::move(peers)),
      rank_(rank),
      channel_(channel),
      health_us_(health_us),
      slots_(std::move(slots)),
      piece_(slots_->slotBytes()),
      q_(std::make_shared<Queues>()) {
  q_->by_src.resize(peers_.size());
  q_->aborted.assign(peers_.size(), 0);
  q_->abort_reason.resize(peers_.size());
}

void NetGroup::track(const OpCtx& op) {
  if (op.seq == op_seq_) return;
  op_seq_ = op.seq;
  sent_.assign(peers_.size(), 0);
  heard_.assign(peers_.size(), 0);
}

bool NetGroup::finishOp(const OpCtx& op) {
  if (op.seq != op_seq_ || op.seq == 0) return false;
  const int n = static_cast<int>(peers_.size());
  // Acknowledge what was only received; then wait for the acknowledgement of what was only
  // sent (which carries the peer's signature of the op).
  std::vector<uint8_t> sent = sent_, heard = heard_;
  for (int r = 0; r < n; ++r)
    if (r != rank_ && heard[r] && !sent[r]) send(op, r, nullptr, 0);
  for (int r = 0; r < n; ++r)
    if (r != rank_ && sent[r] && !heard[r]) recycle(take(op, r, 0));
  // The caller's memory is theirs again once the op returns: the writes from it must be done.
  // A write to a peer that died since fails, but the op itself is decided by what this rank
  // heard (above): a peer that needed our bytes acknowledged them, or the wait for it failed.
  // The transport read nothing more of a dead peer's writes once they failed.
  int failed = -1;
  Status st = slots_->drain(op.deadline, &failed);
  if (!st.ok() && st.code() != Code::kPeerDead) {
    if (failed >= 0) sendFailed(op, failed, 0, st);
    health_->check(op);
    throw CommError("mooncake pg: " + std::string(op.name) + " on rank " +
                        std::to_string(health_->name(rank_)) + " (group " + health_->group() +
                        "): writes to peers did not finish: " + st.toString(),
                    -1, op.name);
  }
  return true;
}

void NetGroup::quiesce() { (void)slots_->drain(engine::deadlineInMs(2000)); }

void NetGroup::throwIfAborted(const OpCtx& op) {
  std::unique_lock<std::mutex> g(q_->mu);
  for (size_t r = 0; r < q_->aborted.size(); ++r) {
    int a = q_->aborted[r];
    if (a == 0) continue;
    std::string reason = q_->abort_reason[r];
    g.unlock();
    health_->aborted(op, static_cast<int>(r), a >= 2 ? a - 2 : -1, reason);
  }
}

void NetGroup::rootGo(const OpCtx& op, int root) {
  const int n = static_cast<int>(peers_.size());
  if (root == rank_) {
    for (int k = 1; k < n; ++k) send(op, (rank_ + k) % n, nullptr, 0);
  } else {
    recycle(take(op, root, 0));
  }
}

void NetGroup::barrierOp(const OpCtx& op) {
  const int n = static_cast<int>(peers_.size());
  for (int k = 1; k < n; ++k) send(op, (rank_ + k) % n, nullptr, 0);
  for (int k = 1; k < n; ++k) recycle(take(op, (rank_ + n - k) % n, 0));
}

NetGroup::~NetGroup() {
  if (started_) engine_->setMessageHandler(channel_, nullptr);
  slots_.reset();  // removes its notification handler before q_ can go
}

void NetGroup::start() {
  std::shared_ptr<Queues> q = q_;
  // Abort notices (rare, with a reason) come as engine messages.
  engine_->setMessageHandler(channel_, [q](engine::Message&& m) {
    Header h{};
    if (m.payload.size() >= sizeof(h)) std::memcpy(&h, m.payload.data(), sizeof(h));
    std::lock_guard<std::mutex> g(q->mu);
    if (h.magic != kMagic || h.src < 0 || static_cast<size_t>(h.src) >= q->by_src.size() ||
        h.seq != kAbortSeq) {
      ++q->bad;
      return;
    }
    int32_t blamed = -1;
    if (m.payload.size() >= sizeof(h) + 4) std::memcpy(&blamed, m.payload.data() + sizeof(h), 4);
    q->aborted[h.src] = blamed >= 0 ? blamed + 2 : 1;
    if (m.payload.size() > sizeof(h) + 4)
      q->abort_reason[h.src] = m.payload.substr(sizeof(h) + 4, 4096);
    q->cv.notify_all();
  });
  // Data arrives in slots: queue it for take() (the slot stays ours until recycle).
  slots_->start([q](int src, int slot) {
    std::lock_guard<std::mutex> g(q->mu);
    q->by_src[src].push_back(slot);
    q->cv.notify_all();
  });
  started_ = true;
}

void NetGroup::sendFailed(const OpCtx& op, int dst, size_t len, const Status& st) {
  // A peer that gave up on the group may have exited since: its abort notice (sent before
  // it left, possibly still being delivered here) says more than its death does.
  auto until = engine::Clock::now() + std::chrono::milliseconds(200);
  do {
    throwIfAborted(op);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  } while (engine::Clock::now() < until);
  health_->check(op, dst);  // names it as dead when it is
  throw CommError("mooncake pg: " + std::string(op.name) + ": sending " + std::to_string(len) +
                      " bytes to rank " + std::to_string(health_->name(dst)) + " (group " +
                      health_->group() + ") failed: " + st.toString(),
                  health_->name(dst), op.name);
}

void NetGroup::send(const OpCtx& op, int dst, const void* data, size_t len) {
  Header h{kMagic, rank_, op.seq, {0, 0}};
  op.sig.pack(h.sig);
  track(op);
  sent_[dst] = 1;
  Status st = slots_->send(dst, &h, sizeof(h), data, len);
  if (!st.ok()) sendFailed(op, dst, len, st);
}

void NetGroup::recycle(Msg&& m) {
  if (m.slot >= 0) (void)slots_->giveBack(m.src, m.slot);  // a dead sender: the waits see it
  m.slot = -1;
}

NetGroup::Msg NetGroup::take(const OpCtx& op, int src, size_t expect_len) {
  using engine::Clock;
  Msg m;
  m.src = src;
  Clock::time_point dead_seen{};
  {
    std::unique_lock<std::mutex> g(q_->mu);
    auto& dq = q_->by_src[src];
    while (dq.empty()) {
      q_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      if (!dq.empty()) break;
      for (size_t r = 0; r < q_->aborted.size(); ++r) {
        int a = q_->aborted[r];
        if (a != 0) {
          std::string reason = q_->abort_reason[r];
          g.unlock();
          health_->aborted(op, static_cast<int>(r), a >= 2 ? a - 2 : -1, reason);
        }
      }
      g.unlock();
      try {
        health_->check(op, src);  // the sender only: a peer that finished and exited is fine
      } catch (const CommError&) {
        // The dead sender's last messages may still be on their way through the engine's
        // inbox and dispatcher (data precedes the EOF that reported the death): give them
        // a short grace before blaming it.
        if (dead_seen == Clock::time_point{}) dead_seen = Clock::now();
        if (Clock::now() - dead_seen > std::chrono::milliseconds(200)) throw;
      }
      if (Clock::now() >= op.deadline)
        health_->timedOut(op, src, "no message from it");
      g.lock();
    }
    m.slot = dq.front();
    dq.pop_front();
  }
  Header h{};
  NetSlots::View v = slots_->view(src, m.slot);
  if (!v.ok) {
    recycle(std::move(m));
    throw CommError("mooncake pg: " + std::string(op.name) + " on rank " +
                        std::to_string(health_->name(rank_)) + " (group " + health_->group() +
                        "): a malformed message from rank " + std::to_string(health_->name(src)),
                    health_->name(src), op.name);
  }
  std::memcpy(&h, v.owner_hdr, sizeof(h));
  m.ptr = v.payload;
  m.len = v.len;
  // take() keeps messages it refuses in their slots: recycle them on the way out.
  struct Giveback {
    NetGroup* g;
    Msg* m;
    bool armed = true;
    ~Giveback() {
      if (armed) g->recycle(std::move(*m));
    }
  } guard{this, &m};
  track(op);
  heard_[src] = 1;
  if (h.seq == op.seq && op.sig.kind != OpKind::kNone) {
    OpSig theirs = OpSig::unpack(h.sig);
    if (theirs != op.sig) health_->mismatch(op, src, theirs);
  }
  if (h.seq != op.seq && op.seq != 0 && h.seq != 0) {
    // Out of step: some rank saw why first; its abort notice may be a moment behind.
    auto until = engine::Clock::now() + std::chrono::milliseconds(200);
    do {
      throwIfAborted(op);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    } while (engine::Clock::now() < until);
    health_->outOfStep(op, src, h.seq);
  }
  if (h.seq != op.seq || m.size() != expect_len) {
    throw CommError("mooncake pg: " + std::string(op.name) + " on rank " +
                        std::to_string(health_->name(rank_)) +
                        " (group " + health_->group() + ", op #" + std::to_string(op.seq) +
                        ") got " + std::to_string(m.size()) + " bytes of op #" +
                        std::to_string(h.seq) + " from rank " + std::to_string(health_->name(src)) +
                        " but expected " + std::to_string(expect_len) +
                        " bytes: ranks called different collectives or sizes",
                    health_->name(src), op.name);
  }
  guard.armed = false;
  return m;
}

void NetGroup::recv(const OpCtx& op, int src, void* out, size_t len) {
  Msg m = take(op, src, len);
  // An in-place exchange may receive where it sent from: that write must be done first.
  if (len > 0) {
    int failed = src;
    Status st = slots_->drainOverlapping(out, len, op.deadline, &failed);
    if (!st.ok() && st.code() != Code::kPeerDead) {  // as in finishOp
      recycle(std::move(m));
      sendFailed(op, failed, len, st);
    }
    std::memcpy(out, m.data(), len);
  }
  recycle(std::move(m));
}

void NetGroup::abort(int blamed, const std::string& reason) {
  std::string payload(sizeof(Header) + 4, '\0');
  Header h{kMagic, rank_, kAbortSeq, {0, 0}};
  int32_t b = blamed;
  std::memcpy(payload.data(), &h, sizeof(h));
  std::memcpy(payload.data() + sizeof(h), &b, 4);
  payload += reason.substr(0, 4096);
  for (size_t r = 0; r < peers_.size(); ++r)
    if (static_cast<int>(r) != rank_) (void)engine_->sendMessage(peers_[r], channel_, payload);
}

void NetGroup::sendPieces(const OpCtx& op, int dst, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  for (size_t off = 0; off < len; off += piece_) send(op, dst, p + off, std::min(piece_, len - off));
}

void NetGroup::recvPieces(const OpCtx& op, int src, void* out, size_t len) {
  char* p = static_cast<char*>(out);
  for (size_t off = 0; off < len; off += piece_) recv(op, src, p + off, std::min(piece_, len - off));
}

}  // namespace mooncake::pg
