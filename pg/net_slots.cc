#include "pg/net_slots.h"

#include <algorithm>
#include <cstring>

#include "engine/log.h"
#include "engine/wire.h"

namespace mooncake::pg {

namespace {

constexpr uint32_t kSlotMagic = 0x4d43534c;  // "MCSL"
constexpr uint32_t kRecordVersion = 1;

// Notification tags: kind in the top 2 bits, the sender's index in the group, the slot.
constexpr uint64_t kKindData = 1;
constexpr uint64_t kKindCredit = 2;

uint64_t makeTag(uint64_t kind, int src, int slot) {
  return (kind << 62) | (static_cast<uint64_t>(static_cast<uint32_t>(src)) << 16) |
         static_cast<uint64_t>(slot & 0xffff);
}

struct SlotHeader {
  uint32_t magic;
  uint32_t hdr_len;
  uint64_t len;
};
static_assert(sizeof(SlotHeader) + NetSlots::kOwnerHeaderBytes == NetSlots::kSlotHeaderBytes,
              "slot header layout");

}  // namespace

Result<std::unique_ptr<NetSlots>> NetSlots::create(engine::TransferEngine* engine,
                                                   engine::Rendezvous& rdv,
                                                   std::vector<engine::PeerId> peers, int rank,
                                                   Config cfg, engine::Deadline deadline) {
  if (cfg.slots < 1 || cfg.slots > 0xffff || cfg.slot_bytes == 0 || cfg.slot_bytes % 64 != 0)
    return MC_STATUS(kInvalidArgument, "net slots: " << cfg.slots << " slots of "
                                                     << cfg.slot_bytes << " bytes");
  std::unique_ptr<NetSlots> s(new NetSlots());
  s->engine_ = engine;
  s->peers_ = std::move(peers);
  s->rank_ = rank;
  s->cfg_ = cfg;
  s->stride_ = kSlotHeaderBytes + cfg.slot_bytes;
  const int n = s->size();
  s->remote_area_.assign(n, 0);
  s->engines_.assign(n, 0);
  s->queued_.resize(n);
  s->free_.resize(n);
  for (int r = 0; r < n; ++r)
    for (int k = 0; k < cfg.slots; ++k) s->free_[r].push_back(k);
  // Our area: a slot per (source, k); our own row is never written. Staging: headers and
  // inline payloads of the messages we post, [dst][k].
  MC_ASSIGN_OR_RETURN(void* area, engine->allocate(s->stride_ * cfg.slots * n));
  s->area_ = static_cast<char*>(area);
  auto staging = engine->allocate((kSlotHeaderBytes + kInlineBytes) * cfg.slots * n);
  if (!staging.ok()) return staging.status();  // the destructor frees the area
  s->staging_ = static_cast<char*>(*staging);

  wire::Writer w;
  w.u32(kRecordVersion);
  w.u64(engine->engineId());
  w.u64(reinterpret_cast<uint64_t>(s->area_));
  w.u32(static_cast<uint32_t>(cfg.slots));
  w.u64(cfg.slot_bytes);
  w.str(engine->localSegment().serialize());
  MC_RETURN_IF_ERROR(rdv.set(cfg.key + "/" + std::to_string(rank), w.take()));
  for (int r = 0; r < n; ++r) {
    if (r == rank) {
      s->engines_[r] = engine->engineId();
      continue;
    }
    auto blob = rdv.wait(cfg.key + "/" + std::to_string(r), deadline);
    if (!blob.ok()) return blob.status();
    wire::Reader rd(*blob);
    uint32_t version = rd.u32();
    uint64_t eid = rd.u64();
    uint64_t addr = rd.u64();
    uint32_t slots = rd.u32();
    uint64_t slot_bytes = rd.u64();
    std::string seg = rd.str(64u << 20);
    if (!rd.done() || version != kRecordVersion)
      return MC_STATUS(kProtocol, "net slots of rank " << r << ": malformed record");
    if (slots != static_cast<uint32_t>(cfg.slots) || slot_bytes != cfg.slot_bytes)
      return MC_STATUS(kInvalidArgument,
                       "net slots: rank " << r << " has " << slots << " slots of " << slot_bytes
                                          << " bytes, this rank " << cfg.slots << " of "
                                          << cfg.slot_bytes
                                          << " (MC_PG_NET_PIECE_BYTES / MC_PG_NET_SLOTS differ)");
    MC_ASSIGN_OR_RETURN(engine::SegmentDesc desc, engine::SegmentDesc::parse(seg));
    if (desc.engine_id != eid)
      return MC_STATUS(kProtocol, "net slots of rank " << r << ": descriptor of another engine");
    // The descriptor lists the area (and, over rdma, its keys): tell the engine.
    MC_RETURN_IF_ERROR(engine->updatePeer(s->peers_[r], desc));
    s->remote_area_[r] = addr;
    s->engines_[r] = eid;
  }
  return s;
}

NetSlots::~NetSlots() {
  if (started_) engine_->setNotifyHandler(cfg_.channel, nullptr);
  // Writes still in flight read the staging (and callers' memory): let them end first.
  (void)drain(engine::deadlineInMs(2000));
  if (staging_ != nullptr) (void)engine_->free(staging_);
  if (area_ != nullptr) (void)engine_->free(area_);
}

void NetSlots::start(std::function<void(int, int)> on_data) {
  on_data_ = std::move(on_data);
  const int slots = cfg_.slots;
  engine_->setNotifyHandler(cfg_.channel, [this, slots](const engine::Notification& nt) {
    uint64_t kind = nt.tag >> 62;
    uint64_t src64 = (nt.tag >> 16) & 0xffffffffull;
    int k = static_cast<int>(nt.tag & 0xffff);
    // The sender's engine must be the one the group knows at that index: a notification is
    // only ever acted on for the rank that sent it.
    if (src64 >= engines_.size() || engines_[src64] != nt.src_engine || k >= slots ||
        static_cast<int>(src64) == rank_) {
      std::lock_guard<std::mutex> g(mu_);
      if (bad_++ == 0) {
        MC_LOG(WARN, PG) << "dropping a net-slot notification that names no peer of the group";
      }
      return;
    }
    int src = static_cast<int>(src64);
    if (kind == kKindData) {
      on_data_(src, k);
    } else if (kind == kKindCredit) {
      onCredit(src, k);
    }
  });
  started_ = true;
}

char* NetSlots::localSlot(int src, int k) const {
  return area_ + (static_cast<size_t>(src) * cfg_.slots + k) * stride_;
}

uint64_t NetSlots::remoteSlot(int dst, int k) const {
  return remote_area_[dst] + (static_cast<uint64_t>(rank_) * cfg_.slots + k) * stride_;
}

void NetSlots::onCredit(int src, int k) {
  std::lock_guard<std::mutex> g(mu_);
  free_[src].push_back(k);
  flushLocked(src);
}

Status NetSlots::send(int dst, const void* owner_hdr, size_t hdr_len, const void* data,
                      size_t len) {
  if (hdr_len > kOwnerHeaderBytes || len > cfg_.slot_bytes)
    return MC_STATUS(kInvalidArgument, "net slot message of " << hdr_len << "+" << len
                                                              << " bytes");
  std::lock_guard<std::mutex> g(mu_);
  reapLocked();
  if (queued_[dst].empty() && !free_[dst].empty()) {
    int k = free_[dst].front();
    free_[dst].pop_front();
    Status st = postLocked(dst, k, owner_hdr, hdr_len, static_cast<const char*>(data), len, {});
    if (!st.ok()) return st;
  } else {
    // dst is behind: keep a copy, posted in order when it gives slots back.
    Queued q;
    q.hdr.assign(static_cast<const char*>(owner_hdr), hdr_len);
    q.data.assign(static_cast<const char*>(data), len);
    queued_[dst].push_back(std::move(q));
  }
  Status st = std::move(failure_);
  failure_ = Status::OK();
  return st;
}

void NetSlots::flushLocked(int dst) {
  while (!queued_[dst].empty() && !free_[dst].empty()) {
    int k = free_[dst].front();
    free_[dst].pop_front();
    Queued q = std::move(queued_[dst].front());
    queued_[dst].pop_front();
    size_t n = q.data.size();
    Status st = postLocked(dst, k, q.hdr.data(), q.hdr.size(), nullptr, n, std::move(q.data));
    if (!st.ok()) noteFailureLocked(st, dst);
  }
}

void NetSlots::noteFailureLocked(const Status& st, int dst) {
  if (!failure_.ok()) return;
  failure_ = st;
  failed_dst_ = dst;
}

// With `owned` non-empty, the payload is owned (moved into the pending record; `data` unused).
Status NetSlots::postLocked(int dst, int k, const void* owner_hdr, size_t hdr_len,
                            const char* data, size_t len, std::string owned) {
  // The staging of (dst, k) is free: the slot was given back, so the message last written
  // from it landed at dst (its notification arrived there after the bytes).
  char* st = staging_ + (static_cast<size_t>(dst) * cfg_.slots + k) *
                            (kSlotHeaderBytes + kInlineBytes);
  SlotHeader sh{kSlotMagic, static_cast<uint32_t>(hdr_len), len};
  std::memcpy(st, &sh, sizeof(sh));
  if (hdr_len > 0) std::memcpy(st + sizeof(sh), owner_hdr, hdr_len);
  const uint64_t remote = remoteSlot(dst, k);
  std::vector<engine::TransferRequest> reqs;
  Pending p{0, dst, nullptr, nullptr, {}};
  if (!owned.empty()) {
    p.owned = std::move(owned);
    data = p.owned.data();  // a heap buffer: it stays put when p moves into pending_
  }
  if (len <= kInlineBytes) {
    if (len > 0) std::memcpy(st + kSlotHeaderBytes, data, len);
    reqs.push_back({engine::OpCode::kWrite, st, kSlotHeaderBytes + len, peers_[dst], remote});
  } else {
    reqs.push_back({engine::OpCode::kWrite, st, kSlotHeaderBytes, peers_[dst], remote});
    reqs.push_back({engine::OpCode::kWrite, const_cast<char*>(data), len, peers_[dst],
                    remote + kSlotHeaderBytes});
    if (p.owned.empty()) {
      p.lo = data;
      p.hi = data + len;
    }
  }
  auto id = engine_->submit(reqs);
  if (!id.ok()) return id.status();
  p.id = *id;
  pending_.push_back(std::move(p));
  return engine_->notify(peers_[dst], cfg_.channel, makeTag(kKindData, rank_, k));
}

// Releases the batches at the front that are done; a failure is kept for the next caller.
void NetSlots::reapLocked() {
  while (!pending_.empty()) {
    bool done = false;
    if (!engine_->poll(pending_.front().id, &done).ok() || !done) return;
    Status st = engine_->wait(pending_.front().id, engine::Clock::now());
    if (!st.ok()) noteFailureLocked(st, pending_.front().dst);
    pending_.pop_front();
  }
}

Status NetSlots::drain(engine::Deadline deadline, int* failed_dst) {
  size_t todo;
  {
    std::lock_guard<std::mutex> g(mu_);
    todo = pending_.size();
  }
  // Waits outside the mutex: the dispatcher posts queued messages meanwhile.
  for (; todo > 0; --todo) {
    Pending p;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (pending_.empty()) break;
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    Status st = engine_->wait(p.id, deadline);
    std::lock_guard<std::mutex> g(mu_);
    if (st.code() == Code::kTimeout) {  // still in flight: keep it
      noteFailureLocked(st, p.dst);
      pending_.push_front(std::move(p));
      break;
    }
    if (!st.ok()) noteFailureLocked(st, p.dst);
  }
  std::lock_guard<std::mutex> g(mu_);
  Status st = std::move(failure_);
  failure_ = Status::OK();
  if (!st.ok() && failed_dst != nullptr) *failed_dst = failed_dst_;
  return st;
}

Status NetSlots::drainOverlapping(const void* p, size_t len, engine::Deadline deadline,
                                  int* failed_dst) {
  const char* lo = static_cast<const char*>(p);
  const char* hi = lo + len;
  {
    std::lock_guard<std::mutex> g(mu_);
    bool any = !failure_.ok();
    for (const auto& q : pending_) any = any || (q.lo < hi && lo < q.hi);
    if (!any) return Status::OK();
  }
  return drain(deadline, failed_dst);  // rare (in-place exchanges): simply wait for all
}

NetSlots::View NetSlots::view(int src, int k) const {
  View v;
  const char* s = localSlot(src, k);
  SlotHeader h;
  std::memcpy(&h, s, sizeof(h));
  if (h.magic != kSlotMagic || h.hdr_len > kOwnerHeaderBytes || h.len > cfg_.slot_bytes)
    return v;
  v.ok = true;
  v.owner_hdr = s + sizeof(h);
  v.payload = s + kSlotHeaderBytes;
  v.len = h.len;
  return v;
}

Status NetSlots::giveBack(int src, int k) {
  // Poison the header so that a stale notification for this slot can never read it again.
  std::memset(localSlot(src, k), 0, sizeof(SlotHeader));
  return engine_->notify(peers_[src], cfg_.channel, makeTag(kKindCredit, rank_, k));
}

}  // namespace mooncake::pg
