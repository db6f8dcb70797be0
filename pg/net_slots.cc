#include "pg/net_slots.h"

#include <algorithm>
#include <cstring>

#include "engine/log.h"

namespace mooncake::pg {

namespace {
constexpr size_t kGrantFixed = 16;  // u64 address, u32 slots, u32 stride; then the descriptor
}  // namespace

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
  auto engine = engine_.lock();
  if (engine == nullptr) return;
  if (recv_ != nullptr) (void)engine->free(recv_);
  if (staging_ != nullptr) (void)engine->free(staging_);
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

// ---- SlotSender ----

bool grantSlotsTo(const engine::TransferEngine& engine, engine::PeerId peer,
                  const std::string& mode) {
  if (peer == engine::kInvalidPeer || mode == "none") return false;
  return mode == "all" || engine.peerTransport(peer) == "rdma";
}

SlotSender::SlotSender(engine::TransferEngine* engine, uint32_t channel,
                       std::shared_ptr<NetArea> area, std::vector<int> index)
    : engine_(engine), channel_(channel), area_(std::move(area)), index_(std::move(index)) {
  dests_.resize(index_.size());
  for (Dest& d : dests_) d.staged.assign(area_->slots(), 0);
}

SlotSender::~SlotSender() {
  const auto deadline = engine::deadlineInMs(2000);
  std::lock_guard<std::mutex> g(mu_);
  for (size_t d = 0; d < dests_.size(); ++d)
    for (engine::BatchId& id : dests_[d].staged) {
      if (id == 0) continue;
      if (engine_->wait(id, deadline).code() == Code::kTimeout) {
        area_->taint(index_[d]);
        engine_->keepUntilDone(id, area_);  // the write still reads the staging
      }
      id = 0;
    }
}

std::string SlotSender::grantFor(int r) const {
  uint64_t addr = reinterpret_cast<uint64_t>(area_->recvSlot(index_[r], 0));
  uint32_t slots = static_cast<uint32_t>(area_->slots());
  uint32_t stride = static_cast<uint32_t>(area_->stride());
  std::string g(kGrantFixed, '\0');
  std::memcpy(g.data(), &addr, 8);
  std::memcpy(g.data() + 8, &slots, 4);
  std::memcpy(g.data() + 12, &stride, 4);
  return g + engine_->localSegment().serialize();
}

void SlotSender::onGrant(int dst, std::string grant) {
  std::lock_guard<std::mutex> g(mu_);
  Dest& d = dests_[dst];
  if (grant.size() < kGrantFixed || d.addr != 0) return;
  std::memcpy(&d.addr, grant.data(), 8);
  if (d.addr == 0) return;
  d.grant = std::move(grant);
}

void SlotSender::reset(int dst) {
  std::lock_guard<std::mutex> g(mu_);
  Dest& d = dests_[dst];
  d.addr = 0;
  d.grant.clear();
  d.free.clear();
  d.queued.clear();
  // d.staged stays: a write from a staging slot may still be in flight (waited at reuse).
}

bool SlotSender::send(engine::PeerId peer, int dst, const void* hdr, size_t hdr_len,
                      const void* data, size_t len, engine::Deadline deadline, Status* st,
                      const std::string& who) {
  *st = Status::OK();
  if (area_->tainted(index_[dst]) || len > area_->payload() ||
      hdr_len > NetArea::kSlotHeaderBytes)
    return false;
  std::unique_lock<std::mutex> g(mu_);
  Dest& d = dests_[dst];
  if (d.addr == 0 || d.addr == ~0ull) return false;  // not granted (yet), or unusable
  if (!d.grant.empty()) {
    // First use of dst's grant: check it and learn dst's descriptor (the area's keys).
    std::string grant = std::move(d.grant);
    d.grant.clear();
    uint32_t slots = 0, stride = 0;
    std::memcpy(&slots, grant.data() + 8, 4);
    std::memcpy(&stride, grant.data() + 12, 4);
    auto desc = engine::SegmentDesc::parse(std::string_view(grant).substr(kGrantFixed));
    Status ok = desc.ok() ? Status::OK() : desc.status();
    if (ok.ok() && (slots != static_cast<uint32_t>(area_->slots()) ||
                    stride != static_cast<uint32_t>(area_->stride())))
      ok = MC_STATUS(kInvalidArgument, who << " grants " << slots << " slots of " << stride
                                            << " bytes, this rank uses " << area_->slots()
                                            << " of " << area_->stride()
                                            << " (MC_PG_NET_SLOTS / MC_PG_NET_PIECE_BYTES "
                                               "differ)");
    if (ok.ok()) ok = engine_->updatePeer(peer, *desc);
    if (!ok.ok()) {
      MC_LOG(WARN, PG) << "messages to " << who << " go two-sided: " << ok.toString();
      d.addr = ~0ull;
      return false;
    }
    for (int k = 0; k < area_->slots(); ++k) d.free.push_back(k);
  }
  if (d.free.empty() || !d.queued.empty()) {
    std::string m(static_cast<const char*>(hdr), hdr_len);
    m.resize(NetArea::kSlotHeaderBytes, '\0');
    if (len > 0) m.append(static_cast<const char*>(data), len);
    d.queued.push_back(std::move(m));
  } else {
    const int k = d.free.front();
    d.free.pop_front();
    g.unlock();
    *st = post(peer, dst, k, static_cast<const char*>(hdr), hdr_len, data, len, deadline);
  }
  area_->countSlotSend();
  return true;
}

void SlotSender::onCredit(engine::PeerId peer, int dst, int k) {
  std::unique_lock<std::mutex> g(mu_);
  Dest& d = dests_[dst];
  if (d.addr == 0 || d.addr == ~0ull || k < 0 || k >= area_->slots()) return;
  d.free.push_back(k);
  // Credits arrive on one thread at a time (the engine's handlers), so queued messages leave
  // in order.
  if (d.queued.empty()) return;
  const int f = d.free.front();
  d.free.pop_front();
  std::string m = std::move(d.queued.front());
  d.queued.pop_front();
  g.unlock();
  Status st = post(peer, dst, f, m.data(), NetArea::kSlotHeaderBytes,
                   m.data() + NetArea::kSlotHeaderBytes, m.size() - NetArea::kSlotHeaderBytes,
                   engine::deadlineInMs(5000));
  g.lock();
  if (!st.ok() && failure_.ok()) {
    failure_ = st;
    failed_dst_ = dst;
  }
}

Status SlotSender::takeFailure(int* dst) {
  std::lock_guard<std::mutex> g(mu_);
  Status st = std::move(failure_);
  failure_ = Status::OK();
  if (!st.ok() && dst != nullptr) *dst = failed_dst_;
  return st;
}

Status SlotSender::post(engine::PeerId peer, int dst, int k, const char* hdr, size_t hdr_len,
                        const void* data, size_t len, engine::Deadline deadline) {
  // The staging copy of (dst, k) is ours: dst gave the slot back, so the write from it
  // landed; its batch is finished or about to be (our completion trails the peer's).
  engine::BatchId prev;
  uint64_t remote;
  {
    std::lock_guard<std::mutex> g(mu_);
    prev = dests_[dst].staged[k];
    dests_[dst].staged[k] = 0;
    remote = dests_[dst].addr + static_cast<uint64_t>(k) * area_->stride();
  }
  if (prev != 0) {
    Status st = engine_->wait(prev, deadline);
    if (st.code() == Code::kTimeout) {  // (k stays taken; later messages go two-sided)
      area_->taint(index_[dst]);
      engine_->keepUntilDone(prev, area_);
    }
    MC_RETURN_IF_ERROR(st);
  }
  char* s = area_->stagingSlot(index_[dst], k);
  std::memcpy(s, hdr, hdr_len);
  if (hdr_len < NetArea::kSlotHeaderBytes)
    std::memset(s + hdr_len, 0, NetArea::kSlotHeaderBytes - hdr_len);
  if (len > 0) std::memcpy(s + NetArea::kSlotHeaderBytes, data, len);
  auto b = engine_->submit(
      {{engine::OpCode::kWrite, s, NetArea::kSlotHeaderBytes + len, peer, remote}});
  if (!b.ok()) return b.status();
  {
    std::lock_guard<std::mutex> g(mu_);
    dests_[dst].staged[k] = *b;
  }
  return engine_->notify(peer, channel_, kTagData | static_cast<uint64_t>(k));
}

void SlotSender::giveBack(engine::TransferEngine* engine, engine::PeerId peer, uint32_t channel,
                          NetArea& area, int src_index, int k) {
  std::memset(area.recvSlot(src_index, k), 0, NetArea::kSlotHeaderBytes);
  (void)engine->notify(peer, channel, kTagCredit | static_cast<uint64_t>(k));
}

}  // namespace mooncake::pg
