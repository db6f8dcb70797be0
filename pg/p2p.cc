#include "pg/p2p.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

#include "engine/params.h"
#include "pg/communicator.h"
#include "pg/device_stage.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504750;       // "MPGP"
constexpr uint32_t kGrantMagic = 0x4d504747;  // "MPGG": a grant of slots (SlotSender::grantFor)
constexpr uint32_t kReleaseMagic = 0x4d504752;  // "MPGR": a staging buffer is free (tag: token)
// Header::flags: the payload describes a staging buffer (p2p_stage.h) of host or GPU memory.
constexpr uint32_t kFlagStaged = 1;
constexpr uint32_t kFlagDevice = 2;
// How long a group's end waits for same-host receivers to copy messages out of the staging
// buffers it is about to free.
constexpr int64_t kDrainMs = 5000;

struct Header {
  uint32_t magic;
  int32_t src;
  uint64_t tag;
  uint64_t id;
  uint64_t total;
  uint64_t offset;
  uint64_t stream;  // per (sender, receiver)
  uint64_t len;     // this piece's bytes
  uint32_t flags;   // kFlagStaged, kFlagDevice
};
static_assert(sizeof(Header) <= NetArea::kSlotHeaderBytes, "slot header");
}  // namespace

P2p::P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
         int rank, uint32_t channel, int64_t health_us, size_t piece_bytes,
         std::function<std::shared_ptr<NetArea>()> area, std::string one_sided,
         size_t slot_min_bytes)
    : engine_(engine),
      rank_(rank),
      channel_(channel),
      health_us_(health_us),
      piece_(piece_bytes),
      box_(std::make_shared<Box>()),
      get_area_(std::move(area)),
      one_sided_(std::move(one_sided)),
      slot_min_(std::max<size_t>(slot_min_bytes, 1)),
      device_p2p_(params::getBool("MC_PG_GPU_P2P")),
      host_stage_min_(static_cast<size_t>(
          std::max<int64_t>(params::getInt("MC_PG_P2P_STAGE_BYTES"), 0))),
      gpu_out_(engine, true),
      host_out_(engine, false),
      inbox_(engine) {
  granted_.assign(peers.size(), 0);
  known_.assign(peers.size(), 0);
  auto t = std::make_shared<Table>();
  t->peers = std::move(peers);
  t->health = health;
  table_ = std::move(t);
}

std::shared_ptr<SlotSender> P2p::slotSender() const {
  std::lock_guard<std::mutex> g(table_mu_);
  return slots_;
}

bool P2p::ensureSlotsLocked(const Table& t) {
  if (slots_ != nullptr) return true;
  if (!get_area_ || area_tried_) return false;
  area_tried_ = true;
  area_ = get_area_();
  if (area_ == nullptr || area_->payload() < piece_ ||
      area_->capacity() < static_cast<int>(t.peers.size()))
    return false;
  std::vector<int> index(t.peers.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = static_cast<int>(i);
  slots_ = std::make_shared<SlotSender>(engine_, channel_, area_, std::move(index));
  return true;
}

void P2p::grantLocked(const Table& t) {
  for (size_t s = 0; s < t.peers.size(); ++s) {
    if (static_cast<int>(s) == rank_ || t.peers[s] == engine::kInvalidPeer) continue;
    const uint64_t eng = t.engines.empty() ? 1 : t.engines[s];
    if (eng == 0 || granted_[s] == eng || !grantSlotsTo(*engine_, t.peers[s], one_sided_))
      continue;
    if (!ensureSlotsLocked(t)) return;  // two-sided only
    granted_[s] = eng;
    Header h{kGrantMagic, rank_, 0, 0, 0, 0, 0, 0, 0};
    std::string p(reinterpret_cast<const char*>(&h), sizeof(h));
    p += slots_->grantFor(static_cast<int>(s));
    (void)engine_->sendMessageOwned(t.peers[s], channel_, std::move(p));  // dead: found later
  }
}

void P2p::onGrant(int src, uint64_t engine, std::string grant) {
  std::lock_guard<std::mutex> g(table_mu_);
  if (src < 0 || static_cast<size_t>(src) >= table_->peers.size()) return;
  if (!current(*table_, src, engine) || table_->peers[src] == engine::kInvalidPeer) {
    early_grants_[engine] = {src, std::move(grant)};  // a process the table does not know yet
    return;
  }
  // A grant can come before this rank granted anything itself (or if it grants nothing).
  if (ensureSlotsLocked(*table_)) slots_->onGrant(src, std::move(grant));
}

void P2p::onNotify(const engine::Notification& nt) {
  auto t = table();
  int src = -1;
  for (size_t r = 0; r < t->peers.size(); ++r)
    if (t->peers[r] == nt.peer && nt.peer != engine::kInvalidPeer) src = static_cast<int>(r);
  std::shared_ptr<SlotSender> slots = slotSender();
  if (src < 0 || slots == nullptr || !current(*t, src, nt.src_engine)) return;
  const int k = SlotSender::slotOf(nt.tag);
  NetArea& area = slots->area();
  if (k >= area.slots()) return;
  if (SlotSender::kindOf(nt.tag) == SlotSender::kTagCredit) {
    slots->onCredit(t->peers[src], src, k);
    return;
  }
  if (SlotSender::kindOf(nt.tag) != SlotSender::kTagData) return;
  // The piece is in slot k of src (the engine delivers a notification after the bytes): into
  // the mailbox, and the slot goes back at once.
  const char* slot = area.recvSlot(src, k);
  Header h{};
  std::memcpy(&h, slot, sizeof(h));
  if (h.magic == kMagic && h.src == src && h.len <= area.payload()) {
    std::string piece(sizeof(h) + h.len, '\0');
    std::memcpy(piece.data(), slot, sizeof(h));
    std::memcpy(piece.data() + sizeof(h), slot + NetArea::kSlotHeaderBytes, h.len);
    box_->deliver(std::move(piece), nt.src_engine, false);
  }
  SlotSender::giveBack(engine_, t->peers[src], channel_, area, src, k);
}

std::shared_ptr<const P2p::Table> P2p::table() const {
  std::lock_guard<std::mutex> g(table_mu_);
  return table_;
}

bool P2p::current(const Table& t, int src, uint64_t engine) {
  if (t.engines.empty()) return true;
  if (src < 0 || static_cast<size_t>(src) >= t.engines.size()) return false;
  return t.engines[src] == engine;
}

void P2p::setPeers(std::vector<engine::PeerId> peers, std::vector<uint64_t> engines,
                   std::shared_ptr<const Health> health) {
  auto t = std::make_shared<Table>();
  t->peers = std::move(peers);
  t->engines = std::move(engines);
  t->health = health.get();
  t->owned = std::move(health);
  {
    std::lock_guard<std::mutex> g(table_mu_);
    const auto& old = table_->engines;
    for (size_t i = 0; i < old.size() && i < t->engines.size(); ++i)
      if (old[i] != 0 && t->engines[i] != 0 && old[i] != t->engines[i]) retired_.insert(old[i]);
    table_ = t;
    // A slot whose process changed: what we were sending it one-sidedly is dropped (the old
    // process is gone); the new one gets a grant, and its early grant (if any) is applied.
    for (size_t s = 0; s < t->engines.size() && s < known_.size(); ++s) {
      const uint64_t e = t->engines[s];
      if (e == 0 || e == known_[s]) continue;
      if (known_[s] != 0 && slots_ != nullptr) slots_->reset(static_cast<int>(s));
      known_[s] = e;
    }
    grantLocked(*t);
    for (auto it = early_grants_.begin(); it != early_grants_.end();) {
      const int s = it->second.first;
      if (s >= 0 && static_cast<size_t>(s) < t->engines.size() && t->engines[s] == it->first) {
        if (ensureSlotsLocked(*t)) slots_->onGrant(s, std::move(it->second.second));
        it = early_grants_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Drop what processes that held a slot before sent: their messages can never match (a
  // receive from the slot means its current process). Processes this table does not know yet
  // keep theirs.
  std::set<uint64_t> retired;
  {
    std::lock_guard<std::mutex> g(table_mu_);
    retired = retired_;
  }
  std::lock_guard<std::mutex> g(box_->mu);
  for (auto it = box_->ready.begin(); it != box_->ready.end();)
    it = retired.count(it->engine) ? box_->ready.erase(it) : std::next(it);
  for (uint64_t e : retired) box_->streams.erase(e);
  box_->cv.notify_all();
}

P2p::~P2p() {
  // Staged messages nobody received here: their senders' buffers are free again. Then wait (a
  // bounded time) for same-host receivers still to take what this rank staged for them.
  std::vector<std::tuple<int, uint32_t, uint64_t>> unread;
  {
    std::lock_guard<std::mutex> g(box_->mu);
    for (const Complete& c : box_->ready)
      if (c.staged) unread.emplace_back(c.src, c.staged, stageToken(c.data));
  }
  for (const auto& [src, flags, token] : unread) releaseStaged(src, flags, token);
  const engine::Deadline end = engine::deadlineInMs(kDrainMs);
  auto alive = [this](engine::PeerId p) { return engine_->peerStatus(p).ok(); };
  for (StageOutbox* o : {&gpu_out_, &host_out_})
    if (o->held() > 0) o->drain(alive, end);
  if (started_) {
    engine_->setMessageHandler(channel_, nullptr);
    engine_->setNotifyHandler(channel_, nullptr);
  }
  std::lock_guard<std::mutex> g(table_mu_);
  slots_.reset();  // waits for its writes
}

void P2p::start() {
  std::shared_ptr<Box> box = box_;
  engine_->setMessageHandler(channel_, [this, box](engine::Message&& m) {
    Header h{};
    if (m.payload.size() >= sizeof(h)) std::memcpy(&h, m.payload.data(), sizeof(h));
    if (m.payload.size() >= sizeof(h) && h.magic == kGrantMagic) {
      onGrant(h.src, m.src_engine, m.payload.substr(sizeof(h)));
      return;
    }
    if (m.payload.size() >= sizeof(h) && h.magic == kReleaseMagic) {
      (h.flags & kFlagDevice ? gpu_out_ : host_out_).release(h.tag);
      return;
    }
    box->deliver(std::move(m.payload), m.src_engine, false);
  });
  engine_->setNotifyHandler(channel_, [this](const engine::Notification& nt) { onNotify(nt); });
  started_ = true;
  std::lock_guard<std::mutex> g(table_mu_);
  if (table_->engines.empty()) grantLocked(*table_);  // a plain group (elastic: setPeers)
}

void P2p::Box::deliver(std::string&& payload, uint64_t engine, bool self) {
  Header h{};
  if (payload.size() < sizeof(h)) return;
  std::memcpy(&h, payload.data(), sizeof(h));
  if (h.magic != kMagic || h.len != payload.size() - sizeof(h)) return;
  std::lock_guard<std::mutex> g(mu);
  if (self) return take(std::move(payload), engine);
  // In sending order: a piece ahead of its turn waits for the ones before it.
  Stream& st = streams[engine];
  if (h.stream < st.next) return;  // never: a duplicate
  if (h.stream > st.next) {
    st.held.emplace(h.stream, std::move(payload));
    return;
  }
  take(std::move(payload), engine);
  ++st.next;
  for (auto it = st.held.begin(); it != st.held.end() && it->first == st.next;
       it = st.held.erase(it), ++st.next)
    take(std::move(it->second), engine);
}

void P2p::Box::take(std::string&& payload, uint64_t engine) {
  Header h{};
  std::memcpy(&h, payload.data(), sizeof(h));
  const size_t len = h.len;
  if (h.flags & kFlagStaged) {  // one piece: the descriptor of a staged message
    payload.erase(0, sizeof(h));
    ready.push_back(Complete{h.src, h.tag, std::move(payload), engine, h.flags, h.total});
    cv.notify_all();
    return;
  }
  if (h.offset + len > h.total) return;
  if (h.offset == 0 && len == h.total) {
    payload.erase(0, sizeof(h));
    ready.push_back(Complete{h.src, h.tag, std::move(payload), engine});
    cv.notify_all();
    return;
  }
  auto key = std::make_pair(static_cast<int>(h.src), h.id);
  Partial& p = partial[key];
  if (h.offset == 0) {
    p.tag = h.tag;
    p.data.reserve(h.total);
  }
  if (p.data.size() != h.offset) {  // pieces of one message arrive in order
    partial.erase(key);
    return;
  }
  p.data.append(payload, sizeof(h), len);
  if (p.data.size() == h.total) {
    ready.push_back(Complete{h.src, p.tag, std::move(p.data), engine});
    partial.erase(key);
    cv.notify_all();
  }
}

bool P2p::sendStaged(const Table& t, const OpCtx& op, const void* buf, size_t bytes, int dst,
                     uint64_t tag, bool device) {
  // Plain groups only (an elastic group's slots change processes), peers on this host.
  if (dst == rank_ || bytes == 0 || !t.engines.empty() ||
      engine_->peerTransport(t.peers[dst]) != "shm")
    return false;
  StageOutbox& out = device ? gpu_out_ : host_out_;
  std::optional<std::string> desc = out.stage(buf, bytes, t.peers[dst], "send");
  if (!desc) return false;
  const uint32_t flags = kFlagStaged | (device ? kFlagDevice : 0);
  Status st;
  {
    std::lock_guard<std::mutex> g(send_mu_);
    Header h{kMagic, rank_, tag, next_id_++, bytes, 0, out_stream_[t.peers[dst]]++,
             desc->size(), flags};
    std::string payload(reinterpret_cast<const char*>(&h), sizeof(h));
    payload += *desc;
    st = engine_->sendMessageOwned(t.peers[dst], channel_, std::move(payload));
  }
  if (!st.ok()) {
    out.release(stageToken(*desc));
    t.health->check(op, dst);
    throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                        std::to_string(dst) + " (group " + t.health->group() +
                        ") failed: " + st.toString(),
                    dst, "send");
  }
  ++(device ? device_messages_ : host_staged_);
  return true;
}

void P2p::releaseStaged(int src, uint32_t flags, uint64_t token) {
  auto t = table();
  if (src < 0 || static_cast<size_t>(src) >= t->peers.size() ||
      t->peers[src] == engine::kInvalidPeer)
    return;
  Header h{kReleaseMagic, rank_, token, 0, 0, 0, 0, 0, flags};
  // A sender that is gone needs no answer.
  (void)engine_->sendMessage(t->peers[src], channel_,
                             std::string_view(reinterpret_cast<const char*>(&h), sizeof(h)));
}

void P2p::send(const void* buf, size_t bytes, int dst, uint64_t tag,
               std::chrono::milliseconds timeout) {
  OpCtx op{"send", engine::Clock::now() + timeout, 0, timeout};
  auto t = table();
  if (dst != rank_ && t->peers[dst] == engine::kInvalidPeer)
    throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                        std::to_string(dst) + " (group " + t->health->group() +
                        "): it is not an active member",
                    dst, "send");
  std::optional<DeviceStage> staged;  // GPU data that goes through host memory
  if (DeviceStage::any({buf})) {
    if (device_p2p_ && sendStaged(*t, op, buf, bytes, dst, tag, true)) return;
    staged.emplace("send", bytes);
    staged->in(buf, bytes);
    buf = staged->host();
  }
  if (host_stage_min_ > 0 && bytes >= host_stage_min_ &&
      sendStaged(*t, op, buf, bytes, dst, tag, false))
    return;
  std::shared_ptr<SlotSender> slots =
      dst != rank_ && bytes >= slot_min_ ? slotSender() : nullptr;
  std::lock_guard<std::mutex> g(send_mu_);
  uint64_t id = next_id_++;
  size_t off = 0;
  do {
    size_t len = std::min(piece_, bytes - off);
    const uint64_t stream = dst == rank_ ? 0 : out_stream_[t->peers[dst]]++;
    Header h{kMagic, rank_, tag, id, bytes, off, stream, len, 0};
    Status st;
    if (slots != nullptr &&
        slots->send(t->peers[dst], dst, &h, sizeof(h), static_cast<const char*>(buf) + off, len,
                    op.deadline, &st, "rank " + std::to_string(dst))) {
      int failed = -1;
      if (st.ok()) st = slots->takeFailure(&failed);
      if (!st.ok()) {
        t->health->check(op, failed >= 0 ? failed : dst);
        throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                            std::to_string(dst) + " (group " + t->health->group() +
                            ") failed: " + st.toString(),
                        dst, "send");
      }
      off += len;
      continue;
    }
    std::string payload;  // header + data, built without zero-filling first
    payload.reserve(sizeof(h) + len);
    payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
    if (len > 0) payload.append(static_cast<const char*>(buf) + off, len);
    if (dst == rank_) {
      box_->deliver(std::move(payload), engine_->engineId(), true);
    } else {
      st = engine_->sendMessageOwned(t->peers[dst], channel_, std::move(payload));
      if (!st.ok()) {
        t->health->check(op, dst);
        throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                            std::to_string(dst) + " (group " + t->health->group() +
                            ") failed: " + st.toString(),
                        dst, "send");
      }
    }
    off += len;
  } while (off < bytes);
}

bool P2p::takeLocked(int src, uint64_t tag, Complete* out) {
  auto t = table();
  for (auto it = box_->ready.begin(); it != box_->ready.end(); ++it) {
    if ((src < 0 || it->src == src) && it->tag == tag &&
        (it->engine == engine_->engineId() || current(*t, it->src, it->engine))) {
      *out = std::move(*it);
      box_->ready.erase(it);
      return true;
    }
  }
  return false;
}

int P2p::recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout) {
  OpCtx op{"recv", engine::Clock::now() + timeout, 0, timeout};
  Complete c;
  engine::Clock::time_point dead_seen{};
  {
    std::unique_lock<std::mutex> g(box_->mu);
    for (;;) {
      if (takeLocked(src, tag, &c)) break;
      box_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      g.unlock();
      auto t = table();
      if (src >= 0 && src != rank_ && t->peers[src] == engine::kInvalidPeer)
        throw CommError("mooncake pg: recv from rank " + std::to_string(src) + " (group " +
                            t->health->group() + "): it is not an active member",
                        src, "recv");
      // A specific source: only its death matters. Any source: any dead peer fails it. A
      // sender that sent and then exited: its last message may still be on its way through
      // the engine's inbox and dispatcher (data precedes the EOF that reported the death),
      // so a death is reported only after a short grace without the message.
      if (src != rank_) {
        try {
          t->health->check(op, src);
        } catch (const CommError&) {
          if (dead_seen == engine::Clock::time_point{}) dead_seen = engine::Clock::now();
          if (engine::Clock::now() - dead_seen > std::chrono::milliseconds(200)) throw;
        }
      }
      if (engine::Clock::now() >= op.deadline)
        t->health->timedOut(op, src, "no message with tag " + std::to_string(tag));
      g.lock();
    }
  }
  return finishRecv(c, buf, bytes, tag);
}

int P2p::finishRecv(Complete& c, void* buf, size_t bytes, uint64_t tag) {
  const size_t got = c.staged ? c.bytes : c.data.size();
  if (got != bytes) {
    if (c.staged) releaseStaged(c.src, c.staged, stageToken(c.data));
    throw MismatchError("mooncake pg: recv size mismatch on rank " + std::to_string(rank_) +
                        " (group " + table()->health->group() + "): rank " + std::to_string(c.src) +
                        " sent " + std::to_string(got) + " bytes with tag " +
                        std::to_string(tag) + " but the receive buffer holds " +
                        std::to_string(bytes) + " bytes",
                    c.src, "recv");
  }
  if (c.staged) {
    struct Release {  // the sender's buffer is free again, whether the copy worked or not
      P2p* p;
      const Complete& c;
      ~Release() { p->releaseStaged(c.src, c.staged, stageToken(c.data)); }
    } release{this, c};
    inbox_.take(c.data, c.engine, table()->peers[c.src], c.src, buf, bytes, "recv");
    ++(c.staged & kFlagDevice ? device_messages_ : host_staged_);
  } else if (bytes > 0 && DeviceStage::any({buf})) {
    DeviceStage st("recv", bytes);
    std::memcpy(st.host(), c.data.data(), bytes);
    st.out(buf, bytes);
  } else if (bytes > 0) {
    std::memcpy(buf, c.data.data(), bytes);
  }
  return c.src;
}

}  // namespace mooncake::pg
