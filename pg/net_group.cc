#include "pg/net_group.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "engine/log.h"
#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504743;  // "MPGC"
constexpr uint64_t kAbortSeq = ~0ull;    // an abort notice: payload = i32 blamed rank, reason
constexpr int32_t kAbortDied = 1 << 30;  // in the blamed rank: its engine saw it die
// A grant of receive slots: payload = u64 address of the sender's first slot, u32 slots,
// u32 stride, the receiver's engine descriptor (which lists the area's keys).
constexpr uint64_t kGrantSeq = ~1ull;
constexpr size_t kGrantFixed = 16;

// Notification tags on the group's channel: kind in the top 2 bits, the slot in the low 16.
constexpr uint64_t kTagData = 1ull << 62;
constexpr uint64_t kTagCredit = 2ull << 62;
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

// ---- NetArea ----

std::shared_ptr<NetArea> NetArea::create(std::shared_ptr<engine::TransferEngine> engine,
                                         int capacity, int slots, size_t payload) {
  std::shared_ptr<NetArea> a(new NetArea());
  a->engine_ = engine;
  a->capacity_ = capacity;
  a->slots_ = slots;
  a->payload_ = payload;
  const size_t bytes = static_cast<size_t>(capacity) * slots * a->stride();
  auto recv = engine->allocate(bytes);
  auto staging = recv.ok() ? engine->allocate(bytes) : recv;
  if (!recv.ok() || !staging.ok()) {
    MC_LOG(WARN, PG) << "no receive slots (" << bytes << " bytes): "
                     << (recv.ok() ? staging : recv).status().toString()
                     << "; the group's messages go two-sided";
    if (recv.ok()) (void)engine->free(*recv);
    return nullptr;
  }
  a->recv_ = static_cast<char*>(*recv);
  a->staging_ = static_cast<char*>(*staging);
  a->tainted_.reset(new std::atomic<uint8_t>[capacity]);
  for (int i = 0; i < capacity; ++i) a->tainted_[i].store(0);
  return a;
}

NetArea::~NetArea() {
  if (recv_ != nullptr) (void)engine_->free(recv_);
  if (staging_ != nullptr) (void)engine_->free(staging_);
}

size_t NetAreas::pieceBytes(size_t piece_param, int capacity, int slots) {
  if (slots <= 0 || capacity <= 0) return piece_param;
  size_t fit = kMaxAreaBytes / (static_cast<size_t>(capacity) * slots);
  fit = fit > NetArea::kSlotHeaderBytes ? (fit - NetArea::kSlotHeaderBytes) & ~size_t{4095} : 0;
  return std::max<size_t>(std::min(piece_param, fit), 4096);
}

std::shared_ptr<NetArea> NetAreas::get(const std::string& kind,
                                       const std::shared_ptr<engine::TransferEngine>& engine) {
  if (slots_ <= 0) return nullptr;
  std::lock_guard<std::mutex> g(mu_);
  auto it = by_kind_.find(kind);
  if (it != by_kind_.end()) return it->second;
  auto a = NetArea::create(engine, capacity_, slots_, payload_);
  by_kind_[kind] = a;  // a failure is not retried
  return a;
}

uint64_t NetAreas::slotSends() {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t n = 0;
  for (auto& [kind, a] : by_kind_)
    if (a != nullptr) n += a->slotSends();
  return n;
}

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
  q_->abort_reason.resize(n);
  q_->abort_died.assign(n, 0);
  q_->grant_addr.assign(n, 0);
  q_->grant_seg.resize(n);
  q_->free.resize(n);
  q_->queued.resize(n);
  out_stream_.assign(n, 0);
  if (index_.empty())
    for (size_t r = 0; r < n; ++r) index_.push_back(static_cast<int>(r));
  if (grant_.empty()) grant_.assign(n, 1);
  if (area_ != nullptr) {
    bool fits = area_->payload() >= piece_;
    for (int i : index_) fits = fits && i >= 0 && i < area_->capacity();
    if (!fits) area_.reset();
  }
  if (area_ != nullptr)
    q_->staged.assign(n, std::vector<engine::BatchId>(area_->slots(), 0));
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
  if (area_ == nullptr) return;
  // Writes still in flight read the staging: let them end (the area outlives this group and
  // the next view's group writes into the same slots at the receiver).
  const auto deadline = engine::deadlineInMs(2000);
  std::lock_guard<std::mutex> g(q_->mu);
  for (size_t d = 0; d < q_->staged.size(); ++d)
    for (engine::BatchId& id : q_->staged[d]) {
      if (id == 0) continue;
      if (engine_->wait(id, deadline).code() == Code::kTimeout) area_->taint(index_[d]);
      id = 0;
    }
}

void NetGroup::start() {
  std::shared_ptr<Queues> q = q_;
  engine_->setMessageHandler(channel_, [q](engine::Message&& m) {
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
      if (m.payload.size() > sizeof(h) + 4)
        q->abort_reason[h.src] = m.payload.substr(sizeof(h) + 4, 4096);
    } else if (h.seq == kGrantSeq) {
      // Checked and applied by the sender (slotsTo / sendToSlot); stored here.
      if (m.payload.size() >= sizeof(h) + kGrantFixed && q->grant_addr[h.src] == 0) {
        std::memcpy(&q->grant_addr[h.src], m.payload.data() + sizeof(h), 8);
        q->grant_seg[h.src] = m.payload.substr(sizeof(h));
      }
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
  if (area_ == nullptr) return;
  // Grant every peer its slots here: address, count, stride, and our descriptor (the area's
  // keys). Sent two-sided; a peer sends one-sidedly only once it has it.
  const std::string seg = engine_->localSegment().serialize();
  for (size_t r = 0; r < peers_.size(); ++r) {
    if (static_cast<int>(r) == rank_ || !grant_[r]) continue;
    Header h{kMagic, rank_, kGrantSeq, {0, 0}, 0, 0};
    uint64_t addr = reinterpret_cast<uint64_t>(area_->recvSlot(index_[r], 0));
    uint32_t slots = static_cast<uint32_t>(area_->slots());
    uint32_t stride = static_cast<uint32_t>(area_->stride());
    std::string p(sizeof(h) + kGrantFixed, '\0');
    std::memcpy(p.data(), &h, sizeof(h));
    std::memcpy(p.data() + sizeof(h), &addr, 8);
    std::memcpy(p.data() + sizeof(h) + 8, &slots, 4);
    std::memcpy(p.data() + sizeof(h) + 12, &stride, 4);
    p += seg;
    (void)engine_->sendMessageOwned(peers_[r], channel_, std::move(p));  // a dead peer: found later
  }
}

void NetGroup::onNotify(const engine::Notification& nt) {
  int src = -1;
  for (size_t r = 0; r < peers_.size(); ++r)
    if (peers_[r] == nt.peer && nt.peer != engine::kInvalidPeer) src = static_cast<int>(r);
  const int k = static_cast<int>(nt.tag & 0xffff);
  std::unique_lock<std::mutex> g(q_->mu);
  if (src < 0 || area_ == nullptr || k >= area_->slots() || src == rank_ || !grant_[src]) {
    ++q_->bad;
    return;
  }
  if ((nt.tag & (3ull << 62)) == kTagData) {
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
  } else if ((nt.tag & (3ull << 62)) == kTagCredit) {
    q_->free[src].push_back(k);
    // A message waiting for a slot at src goes out now (handlers run one at a time, so
    // queued messages leave in order).
    if (q_->queued[src].empty()) return;
    const int f = q_->free[src].front();
    q_->free[src].pop_front();
    Queued m = std::move(q_->queued[src].front());
    q_->queued[src].pop_front();
    g.unlock();
    Status st = post(src, f, m.bytes.data(), m.bytes.size(), nullptr, 0,
                     engine::deadlineInMs(5000));
    g.lock();
    if (!st.ok() && q_->failure.ok()) {
      q_->failure = st;
      q_->failed_dst = src;
    }
  } else {
    ++q_->bad;
  }
}

bool NetGroup::slotsTo(int dst) const {
  return area_ != nullptr && !area_->tainted(index_[dst]);
}

Status NetGroup::post(int dst, int k, const char* hdr, size_t hdr_len, const void* data,
                      size_t len, engine::Deadline deadline) {
  // The staging copy of (dst, k) is ours: dst gave the slot back, so the write from it
  // landed; its batch is finished or about to be (our completion trails the peer's).
  engine::BatchId prev;
  uint64_t remote;
  {
    std::lock_guard<std::mutex> g(q_->mu);
    prev = q_->staged[dst][k];
    q_->staged[dst][k] = 0;
    remote = q_->grant_addr[dst] + static_cast<uint64_t>(k) * area_->stride();
  }
  if (prev != 0) MC_RETURN_IF_ERROR(engine_->wait(prev, deadline));
  char* s = area_->stagingSlot(index_[dst], k);
  std::memcpy(s, hdr, hdr_len);
  if (len > 0) std::memcpy(s + hdr_len, data, len);
  auto b = engine_->submit({{engine::OpCode::kWrite, s, hdr_len + len, peers_[dst], remote}});
  if (!b.ok()) return b.status();
  {
    std::lock_guard<std::mutex> g(q_->mu);
    q_->staged[dst][k] = *b;
  }
  return engine_->notify(peers_[dst], channel_, kTagData | static_cast<uint64_t>(k));
}

bool NetGroup::sendToSlot(const OpCtx& op, int dst, std::string* bytes, const void* data,
                          size_t len) {
  std::unique_lock<std::mutex> g(q_->mu);
  if (q_->grant_addr[dst] == 0) return false;  // not granted (yet): a message
  if (!q_->grant_seg[dst].empty()) {
    // First use of dst's grant in this group: check it and learn dst's descriptor (it lists
    // the area and, over rdma, its keys).
    std::string grant = std::move(q_->grant_seg[dst]);
    q_->grant_seg[dst].clear();
    uint32_t slots = 0, stride = 0;
    std::memcpy(&slots, grant.data() + 8, 4);
    std::memcpy(&stride, grant.data() + 12, 4);
    auto desc = engine::SegmentDesc::parse(std::string_view(grant).substr(kGrantFixed));
    Status st = desc.ok() ? Status::OK() : desc.status();
    if (st.ok() && (slots != static_cast<uint32_t>(area_->slots()) ||
                    stride != static_cast<uint32_t>(area_->stride())))
      st = MC_STATUS(kInvalidArgument, "rank " << health_->name(dst) << " grants " << slots
                                                << " slots of " << stride << " bytes, this rank "
                                                << "uses " << area_->slots() << " of "
                                                << area_->stride()
                                                << " (MC_PG_NET_SLOTS / MC_PG_NET_PIECE_BYTES "
                                                   "differ)");
    if (st.ok()) st = engine_->updatePeer(peers_[dst], *desc);
    if (!st.ok()) {
      MC_LOG(WARN, PG) << "group " << health_->group() << ": messages to rank "
                       << health_->name(dst) << " go two-sided: " << st.toString();
      q_->grant_addr[dst] = ~0ull;  // granted, but unusable
      return false;
    }
    for (int k = 0; k < area_->slots(); ++k) q_->free[dst].push_back(k);
  }
  if (q_->grant_addr[dst] == ~0ull) return false;
  if (q_->free[dst].empty() || !q_->queued[dst].empty()) {
    Queued m;
    m.bytes = std::move(*bytes);
    if (len > 0) m.bytes.append(static_cast<const char*>(data), len);
    q_->queued[dst].push_back(std::move(m));
    return true;
  }
  int k = q_->free[dst].front();
  q_->free[dst].pop_front();
  g.unlock();
  Status st = post(dst, k, bytes->data(), bytes->size(), data, len, op.deadline);
  if (!st.ok()) failSend(op, dst, len, st);
  return true;
}

void NetGroup::throwIfSendFailed(const OpCtx& op) {
  Status st;
  int dst = -1;
  {
    std::lock_guard<std::mutex> g(q_->mu);
    if (q_->failure.ok()) return;
    st = q_->failure;
    dst = q_->failed_dst;
  }
  failSend(op, dst, 0, st);
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
  std::string payload;  // header + data, built without zero-filling first
  if (len >= slot_min_ && len > 0 && slotsTo(dst)) {
    payload.reserve(NetArea::kSlotHeaderBytes + len);
    payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
    payload.resize(NetArea::kSlotHeaderBytes, '\0');
    if (sendToSlot(op, dst, &payload, data, len)) {
      area_->countSlotSend();
      throwIfSendFailed(op);
      return;
    }
    payload.clear();
  }
  payload.reserve(sizeof(h) + len);
  payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
  if (len > 0) payload.append(static_cast<const char*>(data), len);
  Status st = engine_->sendMessageOwned(peers_[dst], channel_, std::move(payload));
  if (!st.ok()) failSend(op, dst, len, st);
  throwIfSendFailed(op);
}

NetGroup::Msg NetGroup::take(const OpCtx& op, int src, size_t expect_len) {
  using engine::Clock;
  Msg m;
  Entry e;
  Clock::time_point dead_seen{};
  {
    std::unique_lock<std::mutex> g(q_->mu);
    auto& mp = q_->by_src[src];
    uint64_t& next = q_->next_in[src];
    auto ready = [&] {
      while (!mp.empty() && mp.begin()->first < next) mp.erase(mp.begin());  // never: stale
      return !mp.empty() && mp.begin()->first == next;
    };
    while (!ready()) {
      q_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      if (ready()) break;
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
    e = std::move(mp.begin()->second);
    mp.erase(mp.begin());
    ++next;
  }
  if (e.slot >= 0) {
    m.src = src;
    m.slot = e.slot;
    m.slot_data = area_->recvSlot(index_[src], e.slot) + NetArea::kSlotHeaderBytes;
    m.slot_len = e.len;
  } else {
    m.buf = std::move(e.buf);
  }
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

void NetGroup::recycle(Msg&& m) {
  if (m.slot >= 0) {
    // Poison the header so that a stale notification can never read the slot again, then
    // give it back (a dead sender: nothing to do).
    std::memset(area_->recvSlot(index_[m.src], m.slot), 0, sizeof(Header));
    (void)engine_->notify(peers_[m.src], channel_, kTagCredit | static_cast<uint64_t>(m.slot));
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
  Header h{kMagic, rank_, kAbortSeq, {0, 0}, 0, 0};
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
