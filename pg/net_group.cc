#include "pg/net_group.h"

#include <algorithm>
#include <cstring>
#include <string_view>
#include <thread>

#include "engine/log.h"
#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504743;  // "MPGC"
constexpr uint64_t kAbortSeq = ~0ull;    // an abort notice: payload = i32 blamed rank, reason
constexpr int32_t kAbortDied = 1 << 30;  // in the blamed rank: its engine saw it die
// A grant of receive slots (payload: SlotSender::grantFor).
constexpr uint64_t kGrantSeq = ~1ull;
// A refusal (reject): sig[0] = the op's seq; payload = u8 length of the op's name, the name,
// why.
constexpr uint64_t kRejectSeq = ~2ull;
constexpr size_t kRefusalsKept = 1024;  // the oldest notes go beyond that
}  // namespace

struct NetGroup::Header {
  uint32_t magic;
  int32_t src;
  uint64_t seq;
  uint64_t sig[2];  // OpSig::pack of the op
  uint64_t stream;  // per (sender, receiver): the order of sending
  uint64_t len;     // payload bytes
};
static_assert(sizeof(NetGroup::Header) == NetGroup::kHeaderBytes, "header layout");
static_assert(NetGroup::kHeaderBytes <= NetArea::kSlotHeaderBytes, "slot header");

// ---- NetGroup ----

NetGroup::NetGroup(engine::TransferEngine* engine, const Health* health,
                   std::vector<engine::PeerId> peers, int rank, uint32_t channel,
                   int64_t health_us, size_t piece_bytes, std::shared_ptr<NetArea> area,
                   std::vector<int> index, std::vector<uint8_t> grant,
                   size_t slot_min_bytes)
    : engine_(engine),
      health_(health),
      peers_(std::move(peers)),
      rank_(rank),
      channel_(channel),
      health_us_(health_us),
      piece_(piece_bytes),
      q_(std::make_shared<Queues>()),
      area_(std::move(area)),
      index_(std::move(index)),
      grant_(std::move(grant)),
      slot_min_(slot_min_bytes) {
  const size_t n = peers_.size();
  q_->by_src.resize(n);
  q_->next_in.assign(n, 0);
  q_->aborted.assign(n, 0);
  q_->abort_seq.assign(n, 0);
  q_->abort_reason.resize(n);
  q_->abort_died.assign(n, 0);
  out_stream_.assign(n, 0);
  if (index_.empty())
    for (size_t r = 0; r < n; ++r) index_.push_back(static_cast<int>(r));
  if (grant_.empty()) grant_.assign(n, 1);
  if (area_ != nullptr) {
    bool fits = area_->payload() >= piece_;
    for (int i : index_) fits = fits && i >= 0 && i < area_->capacity();
    if (!fits) area_.reset();
  }
  if (area_ != nullptr) slots_ = std::make_unique<SlotSender>(engine_, channel_, area_, index_);
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
  if (drop_on_close_) {
    engine_->setMessageHandler(channel_, [](engine::Message&&) {});
    engine_->setNotifyHandler(channel_, [](const engine::Notification&) {});
  } else {
    engine_->setMessageHandler(channel_, nullptr);
    engine_->setNotifyHandler(channel_, nullptr);
  }
  slots_.reset();  // waits for its writes: the next view's group writes into the same slots
}

void NetGroup::start() {
  std::shared_ptr<Queues> q = q_;
  SlotSender* slots = slots_.get();  // alive while the handler is installed
  engine_->setMessageHandler(channel_, [q, slots](engine::Message&& m) {
    Header h{};
    if (m.payload.size() >= sizeof(h)) std::memcpy(&h, m.payload.data(), sizeof(h));
    std::lock_guard<std::mutex> g(q->mu);
    if (m.payload.size() < sizeof(h) || h.magic != kMagic || h.src < 0 ||
        static_cast<size_t>(h.src) >= q->by_src.size()) {
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
      q->abort_seq[h.src] = h.sig[0];
      if (m.payload.size() > sizeof(h) + 4)
        q->abort_reason[h.src] = m.payload.substr(sizeof(h) + 4, 4096);
    } else if (h.seq == kRejectSeq) {
      const std::string_view p(m.payload.data() + sizeof(h), m.payload.size() - sizeof(h));
      const size_t k = p.empty() ? 0 : std::min<size_t>(static_cast<uint8_t>(p[0]), p.size() - 1);
      Queues::Refusal f;
      f.rank = h.src;
      f.op = std::string(p.empty() ? p : p.substr(1, k));
      f.why = std::string(p.empty() ? p : p.substr(1 + k, 4096));
      q->refused.emplace(h.sig[0], std::move(f));  // the first note of an op stays
      if (q->refused.size() > kRefusalsKept) q->refused.erase(q->refused.begin());
    } else if (h.seq == kGrantSeq) {
      if (slots != nullptr) slots->onGrant(h.src, m.payload.substr(sizeof(h)));
    } else {
      Entry e;
      e.len = m.payload.size() - sizeof(h);
      e.seq = h.seq;
      e.sig[0] = h.sig[0];
      e.sig[1] = h.sig[1];
      e.buf = std::move(m.payload);
      q->by_src[h.src].emplace(h.stream, std::move(e));
    }
    q->cv.notify_all();
  });
  engine_->setNotifyHandler(channel_, [this](const engine::Notification& nt) { onNotify(nt); });
  started_ = true;
  if (slots_ == nullptr) return;
  // Grant the peers their slots here (a peer sends one-sidedly only once it has its grant).
  for (size_t r = 0; r < peers_.size(); ++r) {
    if (static_cast<int>(r) == rank_ || !grant_[r]) continue;
    Header h{kMagic, rank_, kGrantSeq, {0, 0}, 0, 0};
    std::string p(reinterpret_cast<const char*>(&h), sizeof(h));
    p += slots_->grantFor(static_cast<int>(r));
    (void)engine_->sendMessageOwned(peers_[r], channel_, std::move(p));  // a dead peer: found later
  }
}

void NetGroup::onNotify(const engine::Notification& nt) {
  int src = -1;
  for (size_t r = 0; r < peers_.size(); ++r)
    if (peers_[r] == nt.peer && nt.peer != engine::kInvalidPeer) src = static_cast<int>(r);
  const int k = SlotSender::slotOf(nt.tag);
  std::unique_lock<std::mutex> g(q_->mu);
  if (src < 0 || area_ == nullptr || k >= area_->slots() || src == rank_) {
    ++q_->bad;
    return;
  }
  if (SlotSender::kindOf(nt.tag) == SlotSender::kTagData && grant_[src]) {
    // The bytes are in the slot (the engine delivers a notification after its sender's
    // writes): take the header from there.
    Header h{};
    const char* s = area_->recvSlot(index_[src], k);
    std::memcpy(&h, s, sizeof(h));
    if (h.magic != kMagic || h.src != src || h.len > area_->payload()) {
      ++q_->bad;
      return;
    }
    Entry e;
    e.slot = k;
    e.len = h.len;
    e.seq = h.seq;
    e.sig[0] = h.sig[0];
    e.sig[1] = h.sig[1];
    q_->by_src[src].emplace(h.stream, std::move(e));
    q_->cv.notify_all();
  } else if (SlotSender::kindOf(nt.tag) == SlotSender::kTagCredit && slots_ != nullptr) {
    g.unlock();
    slots_->onCredit(peers_[src], src, k);
  } else {
    ++q_->bad;
  }
}

void NetGroup::throwIfSendFailed(const OpCtx& op) {
  if (slots_ == nullptr) return;
  int dst = -1;
  Status st = slots_->takeFailure(&dst);
  if (!st.ok()) failSend(op, dst, 0, st);
}

void NetGroup::failSend(const OpCtx& op, int dst, size_t len, const Status& st) {
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
  Header h{kMagic, rank_, op.seq, {0, 0}, out_stream_[dst]++, len};
  op.sig.pack(h.sig);
  track(op);
  sent_[dst] = 1;
  if (len >= slot_min_ && len > 0 && slots_ != nullptr) {
    Status st;
    if (slots_->send(peers_[dst], dst, &h, sizeof(h), data, len, op.deadline, &st,
                     "rank " + std::to_string(health_->name(dst)))) {
      if (!st.ok()) failSend(op, dst, len, st);
      throwIfSendFailed(op);
      return;
    }
  }
  std::string payload;  // header + data, built without zero-filling first
  payload.reserve(sizeof(h) + len);
  payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
  if (len > 0) payload.append(static_cast<const char*>(data), len);
  Status st = engine_->sendMessageOwned(peers_[dst], channel_, std::move(payload));
  if (!st.ok()) failSend(op, dst, len, st);
  throwIfSendFailed(op);
}

NetGroup::Msg NetGroup::entryMsg(int src, Entry&& e) const {
  Msg m;
  if (e.slot >= 0) {
    m.src = src;
    m.slot = e.slot;
    m.slot_data = area_->recvSlot(index_[src], e.slot) + NetArea::kSlotHeaderBytes;
    m.slot_len = e.len;
  } else {
    m.buf = std::move(e.buf);
  }
  return m;
}

NetGroup::Msg NetGroup::take(const OpCtx& op, int src, size_t expect_len) {
  using engine::Clock;
  Msg m;
  Entry e;
  Clock::time_point dead_seen{};
  Clock::time_point abort_seen{};  // an abort from a rank already past this op
  Clock::time_point ahead_seen{};  // src's next message belongs to a later op
  // Messages of refused ops met on the way, recycled with the lock released (promptly: a
  // sender waiting for the slot's credit may be what this take waits for).
  std::vector<Entry> dropped;
  auto flush = [&] {
    for (Entry& d : dropped) recycle(entryMsg(src, std::move(d)));
    dropped.clear();
  };
  {
    std::unique_lock<std::mutex> g(q_->mu);
    auto& mp = q_->by_src[src];
    uint64_t& next = q_->next_in[src];
    // 0: nothing to take yet; 1: the next message is there; 2: it is one of another op: a
    // later one (src left this one: the refusal or abort that made it leave may be a moment
    // behind), or an earlier one this rank did not take (src's refusal note of that op, sent
    // by another rank, may be a moment behind it; then it is dropped).
    auto ready = [&]() -> int {
      while (!mp.empty()) {
        auto it = mp.begin();
        if (it->first < next) {  // never: stale
          mp.erase(it);
          continue;
        }
        if (it->first != next) return 0;
        const uint64_t s = it->second.seq;
        if (s != 0 && s < op.seq && q_->refused.count(s) != 0) {  // sent in a refused op
          dropped.push_back(std::move(it->second));
          mp.erase(it);
          ++next;
          continue;
        }
        return s != op.seq && s != 0 && op.seq != 0 ? 2 : 1;
      }
      return 0;
    };
    for (int st = ready(); st != 1; st = ready()) {
      auto rj = q_->refused.find(op.seq);
      if (op.seq != 0 && rj != q_->refused.end()) {
        const Queues::Refusal f = rj->second;
        g.unlock();
        flush();
        health_->rejected(op, f.rank, f.op, f.why);
      }
      if (st == 2) {
        if (ahead_seen == Clock::time_point{}) ahead_seen = Clock::now();
        if (Clock::now() - ahead_seen >= std::chrono::seconds(1)) {
          const uint64_t theirs = mp.begin()->second.seq;
          g.unlock();
          flush();
          throwIfAborted(op);
          health_->outOfStep(op, src, theirs);
        }
      }
      q_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      if (ready() == 1) break;
      for (size_t r = 0; r < q_->aborted.size(); ++r) {
        int a = q_->aborted[r];
        if (a != 0 && q_->abort_seq[r] > op.seq && op.seq != 0) {
          // r aborted a later op, so it got past this one: what this op waits for was sent
          // before the abort and may still be on its way. Give it a short grace.
          if (abort_seen == Clock::time_point{}) abort_seen = Clock::now();
          if (Clock::now() - abort_seen < std::chrono::milliseconds(200)) continue;
        }
        if (a != 0) {
          std::string reason = q_->abort_reason[r];
          bool died = q_->abort_died[r] != 0;
          g.unlock();
          flush();
          health_->aborted(op, static_cast<int>(r),
                           a >= 2 ? a - 2 : a == -1 ? Health::kLeftView : -1, reason, died);
        }
      }
      g.unlock();
      flush();
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
    e = std::move(mp.begin()->second);
    mp.erase(mp.begin());
    ++next;
  }
  flush();
  m = entryMsg(src, std::move(e));
  if (m.slot >= 0) held_.emplace_back(src, m.slot);
  track(op);
  heard_[src] = 1;
  if (e.seq == op.seq && op.sig.kind != OpKind::kNone) {
    OpSig theirs = OpSig::unpack(e.sig);
    if (theirs != op.sig) {
      recycle(std::move(m));
      health_->mismatch(op, src, theirs);
    }
  }
  if (e.seq != op.seq && op.seq != 0 && e.seq != 0) {
    recycle(std::move(m));
    // Out of step: some rank saw why first; its abort notice may be a moment behind.
    auto until = engine::Clock::now() + std::chrono::milliseconds(200);
    do {
      throwIfAborted(op);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    } while (engine::Clock::now() < until);
    health_->outOfStep(op, src, e.seq);
  }
  if (e.seq != op.seq || e.len != expect_len) {
    recycle(std::move(m));
    throw MismatchError("mooncake pg: " + std::string(op.name) + " on rank " +
                        std::to_string(health_->name(rank_)) +
                        " (group " + health_->group() + ", op #" + std::to_string(op.seq) +
                        ") got " + std::to_string(e.len) + " bytes of op #" +
                        std::to_string(e.seq) + " from rank " + std::to_string(health_->name(src)) +
                        " but expected " + std::to_string(expect_len) +
                        " bytes: ranks called different collectives or sizes",
                    health_->name(src), op.name);
  }
  return m;
}

void NetGroup::releaseHeld() {
  std::vector<std::pair<int, int>> held;
  held.swap(held_);
  for (const auto& [src, slot] : held)
    SlotSender::giveBack(engine_, peers_[src], channel_, *area_, index_[src], slot);
}

void NetGroup::recycle(Msg&& m) {
  if (m.slot >= 0) {
    for (size_t i = 0; i < held_.size(); ++i)
      if (held_[i].first == m.src && held_[i].second == m.slot) {
        held_[i] = held_.back();
        held_.pop_back();
        break;
      }
    // Poison the header so that a stale notification can never read the slot again, then
    // give it back (a dead sender: nothing to do).
    SlotSender::giveBack(engine_, peers_[m.src], channel_, *area_, index_[m.src], m.slot);
    m.slot = -1;
    return;
  }
  if (!m.buf.empty()) engine_->recycleMessageBuffer(std::move(m.buf));
}

void NetGroup::recv(const OpCtx& op, int src, void* out, size_t len) {
  Msg m = take(op, src, len);
  if (len > 0) std::memcpy(out, m.data(), len);
  recycle(std::move(m));
}

void NetGroup::abort(int blamed, const std::string& reason, bool died) {
  std::string payload(sizeof(Header) + 4, '\0');
  // sig[0]: the last op this rank took part in. A peer still in an earlier op may be
  // waiting for messages this rank or others sent before the abort; they travel by other
  // paths (one-sided writes and notifications, other senders' links) and may arrive after it.
  Header h{kMagic, rank_, kAbortSeq, {op_seq_.load(std::memory_order_relaxed), 0}, 0, 0};
  int32_t b = blamed >= 0 && died ? (blamed | kAbortDied) : blamed;
  std::memcpy(payload.data(), &h, sizeof(h));
  std::memcpy(payload.data() + sizeof(h), &b, 4);
  payload += reason.substr(0, 4096);
  for (size_t r = 0; r < peers_.size(); ++r)
    if (static_cast<int>(r) != rank_) (void)engine_->sendMessage(peers_[r], channel_, payload);
}

void NetGroup::reject(const OpCtx& op, const std::string& why) {
  track(op);
  const std::string name(op.name, strnlen(op.name, 255));
  {
    std::lock_guard<std::mutex> g(q_->mu);
    Queues::Refusal f;
    f.rank = rank_;
    f.op = name;
    f.why = why.substr(0, 4096);
    q_->refused.emplace(op.seq, std::move(f));  // this rank drops what peers sent in it
    if (q_->refused.size() > kRefusalsKept) q_->refused.erase(q_->refused.begin());
  }
  Header h{kMagic, rank_, kRejectSeq, {op.seq, 0}, 0, 0};
  std::string payload(reinterpret_cast<const char*>(&h), sizeof(h));
  payload += static_cast<char>(name.size());
  payload += name;
  payload += why.substr(0, 4096);
  for (size_t r = 0; r < peers_.size(); ++r)  // a dead peer: its death is found by the others
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
