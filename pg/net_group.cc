#include "pg/net_group.h"

#include <cstring>
#include <thread>

#include "engine/log.h"
#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504743;  // "MPGC"
constexpr uint64_t kAbortSeq = ~0ull;    // an abort notice: payload = i32 blamed rank, reason
constexpr int32_t kAbortDied = 1 << 30;  // in the blamed rank: its engine saw it die

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
                   int64_t health_us, size_t piece_bytes)
    : engine_(engine),
      health_(health),
      peers_(std::move(peers)),
      rank_(rank),
      channel_(channel),
      health_us_(health_us),
      piece_(piece_bytes),
      q_(std::make_shared<Queues>()) {
  q_->by_src.resize(peers_.size());
  q_->aborted.assign(peers_.size(), 0);
  q_->abort_reason.resize(peers_.size());
  q_->abort_died.assign(peers_.size(), 0);
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
  return true;
}

void NetGroup::throwIfAborted(const OpCtx& op) {
  std::unique_lock<std::mutex> g(q_->mu);
  for (size_t r = 0; r < q_->aborted.size(); ++r) {
    int a = q_->aborted[r];
    if (a == 0) continue;
    std::string reason = q_->abort_reason[r];
    bool died = q_->abort_died[r] != 0;
    g.unlock();
    health_->aborted(op, static_cast<int>(r), a >= 2 ? a - 2 : a == -1 ? Health::kLeftView : -1,
                     reason, died);
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
  if (!started_) return;
  if (drop_on_close_)
    engine_->setMessageHandler(channel_, [](engine::Message&&) {});
  else
    engine_->setMessageHandler(channel_, nullptr);
}

void NetGroup::start() {
  std::shared_ptr<Queues> q = q_;
  engine_->setMessageHandler(channel_, [q](engine::Message&& m) {
    Header h{};
    if (m.payload.size() >= sizeof(h)) std::memcpy(&h, m.payload.data(), sizeof(h));
    std::lock_guard<std::mutex> g(q->mu);
    if (h.magic != kMagic || h.src < 0 || static_cast<size_t>(h.src) >= q->by_src.size()) {
      ++q->bad;
      return;
    }
    if (h.seq == kAbortSeq) {
      int32_t blamed = -1;
      if (m.payload.size() >= sizeof(h) + 4) std::memcpy(&blamed, m.payload.data() + sizeof(h), 4);
      if (blamed >= 0 && (blamed & kAbortDied) != 0) {
        blamed &= ~kAbortDied;
        q->abort_died[h.src] = 1;
      }
      q->aborted[h.src] = blamed >= 0 ? blamed + 2 : blamed == Health::kLeftView ? -1 : 1;
      if (m.payload.size() > sizeof(h) + 4)
        q->abort_reason[h.src] = m.payload.substr(sizeof(h) + 4, 4096);
    } else {
      q->by_src[h.src].push_back(std::move(m.payload));
    }
    q->cv.notify_all();
  });
  started_ = true;
}

void NetGroup::send(const OpCtx& op, int dst, const void* data, size_t len) {
  Header h{kMagic, rank_, op.seq, {0, 0}};
  op.sig.pack(h.sig);
  track(op);
  sent_[dst] = 1;
  std::string payload;  // header + data, built without zero-filling first
  payload.reserve(sizeof(h) + len);
  payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
  if (len > 0) payload.append(static_cast<const char*>(data), len);
  Status st = engine_->sendMessageOwned(peers_[dst], channel_, std::move(payload));
  if (!st.ok()) {
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
}

NetGroup::Msg NetGroup::take(const OpCtx& op, int src, size_t expect_len) {
  using engine::Clock;
  Msg m;
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
          bool died = q_->abort_died[r] != 0;
          g.unlock();
          health_->aborted(op, static_cast<int>(r),
                           a >= 2 ? a - 2 : a == -1 ? Health::kLeftView : -1, reason, died);
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
    m.buf = std::move(dq.front());
    dq.pop_front();
  }
  Header h{};
  std::memcpy(&h, m.buf.data(), sizeof(h));
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
    throw MismatchError("mooncake pg: " + std::string(op.name) + " on rank " +
                        std::to_string(health_->name(rank_)) +
                        " (group " + health_->group() + ", op #" + std::to_string(op.seq) +
                        ") got " + std::to_string(m.size()) + " bytes of op #" +
                        std::to_string(h.seq) + " from rank " + std::to_string(health_->name(src)) +
                        " but expected " + std::to_string(expect_len) +
                        " bytes: ranks called different collectives or sizes",
                    health_->name(src), op.name);
  }
  return m;
}

void NetGroup::recv(const OpCtx& op, int src, void* out, size_t len) {
  Msg m = take(op, src, len);
  if (len > 0) std::memcpy(out, m.data(), len);
  recycle(std::move(m));
}

void NetGroup::abort(int blamed, const std::string& reason, bool died) {
  std::string payload(sizeof(Header) + 4, '\0');
  Header h{kMagic, rank_, kAbortSeq, {0, 0}};
  int32_t b = blamed >= 0 && died ? (blamed | kAbortDied) : blamed;
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
