#include "store/master/master_service.h"

#if MC_STORE_HAVE_RE2
#include <re2/re2.h>
#endif

#include <algorithm>
#include <random>

#include "store/master/record.h"

namespace mooncake::store {

namespace {
std::chrono::milliseconds ms(uint64_t v) { return std::chrono::milliseconds(v); }
}  // namespace

MasterService::MasterService(MasterConfig config) : config_(std::move(config)) {
  reseedIdsLocked();  // not shared yet: no lock needed
  if (config_.alloc_granularity == 0 ||
      (config_.alloc_granularity & (config_.alloc_granularity - 1)) != 0)
    config_.alloc_granularity = 64;
  if (config_.max_pieces_per_replica == 0) config_.max_pieces_per_replica = 1;
  // Out-of-range shares (a typo in an environment variable) fall back to the defaults.
  if (!(config_.eviction_high_watermark > 0.0 && config_.eviction_high_watermark <= 1.0))
    config_.eviction_high_watermark = MasterConfig{}.eviction_high_watermark;
  if (!(config_.eviction_ratio > 0.0 && config_.eviction_ratio <= 1.0))
    config_.eviction_ratio = MasterConfig{}.eviction_ratio;
  std::random_device rd;
  uint64_t e = (static_cast<uint64_t>(rd()) << 32) | rd();
  epoch_.store(e == 0 ? 1 : e);
}

MasterService::~MasterService() { stopBackground(); }

ErrorCode MasterService::checkKey(const std::string& key) const {
  if (key.empty() || key.size() > config_.max_key_length) return ErrorCode::INVALID_KEY;
  return ErrorCode::OK;
}

MasterService::Client& MasterService::touchClientLocked(const std::string& client_id, TimePoint t,
                                                        bool* was_new) {
  auto [it, inserted] = clients_.try_emplace(client_id);
  it->second.last_seen = t;
  if (it->second.gone) {  // it called again: its engine is back
    it->second.gone = false;
    for (SegmentId id : it->second.segments) {
      auto s = segments_.find(id);
      if (s != segments_.end()) s->second->owner_gone = false;
    }
  }
  if (was_new) *was_new = inserted;
  return it->second;
}

void MasterService::clientGone(const std::string& client_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(client_id);
  if (it == clients_.end() || it->second.gone) return;
  it->second.gone = true;
  for (SegmentId id : it->second.segments) {
    auto s = segments_.find(id);
    if (s != segments_.end()) s->second->owner_gone = true;
  }
  ++counters_.clients_gone;
}

// ---------------------------------------------------------------- segments and clients

ErrorOr<SegmentId> MasterService::mountSegment(const std::string& client_id,
                                               const std::string& name, uint64_t base,
                                               uint64_t size, uint64_t record_tag,
                                               bool will_report) {
  if (client_id.empty() || name.empty() || size < config_.alloc_granularity || base + size < base)
    return ErrorCode::INVALID_PARAMS;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  if (!clients_.count(client_id)) last_registration_ = t;
  auto by_name = segment_by_name_.find(name);
  if (by_name != segment_by_name_.end()) {
    Segment* s = segments_.at(by_name->second).get();
    if (s->client_id == client_id && s->base == base &&
        s->alloc.capacity() == (size & ~(config_.alloc_granularity - 1))) {
      touchClientLocked(client_id, t, nullptr);
      if (will_report) {
        // The client (re)starts its report: what an earlier, unfinished one staged goes (the
        // new one sends it all again), and the segment takes no new object until it ends.
        staged_.erase(std::remove_if(staged_.begin(), staged_.end(),
                                     [&](const Staged& x) { return x.seg == s->id; }),
                      staged_.end());
        s->awaiting_report = true;
      }
      return s->id;  // the same mount, retried
    }
    return ErrorCode::SEGMENT_ALREADY_EXISTS;
  }
  auto seg = std::make_unique<Segment>(size, config_.alloc_granularity);
  seg->id = next_segment_id_++;
  seg->name = name;
  seg->client_id = client_id;
  seg->base = base;
  seg->record_tag = config_.record_headers ? record_tag : 0;
  seg->awaiting_report = will_report;
  Segment* raw = seg.get();
  capacity_bytes_ += raw->alloc.capacity();
  segments_.emplace(raw->id, std::move(seg));
  segment_by_name_.emplace(name, raw->id);
  segment_order_.push_back(raw);
  touchClientLocked(client_id, t, nullptr).segments.push_back(raw->id);
  return raw->id;
}

ErrorCode MasterService::unmountSegment(const std::string& client_id, SegmentId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = segments_.find(id);
  if (it == segments_.end()) return ErrorCode::OK;
  if (it->second->client_id != client_id) return ErrorCode::ILLEGAL_CLIENT;
  touchClientLocked(client_id, now(), nullptr);
  unmountLocked(it->second.get());
  return ErrorCode::OK;
}

ErrorCode MasterService::unmountSegmentByName(const std::string& client_id,
                                              const std::string& name) {
  SegmentId id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segment_by_name_.find(name);
    if (it == segment_by_name_.end()) return ErrorCode::OK;
    id = it->second;
  }
  return unmountSegment(client_id, id);
}

void MasterService::unmountLocked(Segment* seg) {
  // Drop every replica with a piece on this segment. Copy the set: destroying objects edits it.
  std::vector<Object*> affected(seg->objects.begin(), seg->objects.end());
  for (Object* o : affected) {
    std::vector<Segment*> touched;  // segments that held a piece of a dropped replica
    counters_.replicas_dropped += dropReplicasOnLocked(o, seg, &touched, /*seg_gone=*/true);
    // An upsert writing onto this segment cannot finish: its staged replicas go (its End fails).
    bool staged_here = false;
    for (const Replica& r : o->staged)
      for (const PieceRec& p : r.pieces) staged_here = staged_here || p.seg == seg;
    if (staged_here) {
      for (const Replica& r : o->staged)
        for (const PieceRec& p : r.pieces) touched.push_back(p.seg);
      dropStagedLocked(o, nullptr);
    }
    unindexLocked(o, touched);
    if (o->replicas.empty()) destroyObjectLocked(o);
  }
  // Slabs with an extent here publish nothing more; their other extents stay reserved until
  // their writer retires them (it may still be writing into them).
  for (Slab* slab : seg->slabs) {
    slab->broken = true;
    for (SlabExtent& e : slab->extents) {
      if (e.seg != seg) continue;
      for (auto& [off, a] : e.blocks) used_bytes_ -= a.size;  // the allocator dies with seg
      e.blocks.clear();
      e.seg = nullptr;
    }
  }
  // Quarantined ranges on this segment die with it.
  for (size_t i = 0; i < quarantine_.size();) {
    if (quarantine_[i].seg == seg) {
      seg->alloc.free(quarantine_[i].alloc);
      used_bytes_ -= quarantine_[i].alloc.size;
      quarantine_[i] = quarantine_.back();
      quarantine_.pop_back();
    } else {
      ++i;
    }
  }
  capacity_bytes_ -= seg->alloc.capacity();
  auto cit = clients_.find(seg->client_id);
  if (cit != clients_.end()) {
    auto& v = cit->second.segments;
    v.erase(std::remove(v.begin(), v.end(), seg->id), v.end());
  }
  segment_order_.erase(std::find(segment_order_.begin(), segment_order_.end(), seg));
  segment_by_name_.erase(seg->name);
  segments_.erase(seg->id);  // frees seg
}

size_t MasterService::dropReplicasOnLocked(Object* o, const Segment* seg,
                                           std::vector<Segment*>* touched, bool seg_gone) {
  std::vector<Replica> kept;
  size_t dropped = 0;
  // A reader may be transferring out of the replica's other pieces right now: while its lease
  // lasts they stay allocated (quarantined), so no later put's bytes land under its READs.
  const TimePoint lease_until = o->lease_deadline;
  const bool leased_now = leased(o, now());
  for (Replica& r : o->replicas) {
    bool on_seg = std::any_of(r.pieces.begin(), r.pieces.end(),
                              [&](const PieceRec& p) { return p.seg == seg; });
    if (!on_seg) {
      kept.push_back(std::move(r));
      continue;
    }
    for (const PieceRec& p : r.pieces) {
      // A complete object's records are wiped before their memory is reused, except on a
      // segment that leaves the store (its memory goes with it).
      const bool wipe = o->complete && !(seg_gone && p.seg == seg);
      if (leased_now && !(seg_gone && p.seg == seg))
        releasePieceLocked(p, wipe, &lease_until);
      else
        freePiece(p, wipe);
      touched->push_back(p.seg);
    }
    ++dropped;
  }
  o->replicas = std::move(kept);
  return dropped;
}

void MasterService::unindexLocked(Object* o, const std::vector<Segment*>& touched) {
  // A segment stays in o's index only if a replica of o still has a piece there.
  for (Segment* s : touched)
    if (!hasPieceOn(o, s)) s->objects.erase(o);
}

std::vector<MountedSegmentInfo> MasterService::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MountedSegmentInfo> out;
  for (const Segment* s : segment_order_)
    out.push_back(
        {s->id, s->name, s->client_id, s->base, s->alloc.capacity(), s->alloc.usedBytes()});
  return out;
}

ErrorOr<bool> MasterService::heartbeat(const std::string& client_id,
                                       const std::vector<std::string>& segment_names) {
  if (client_id.empty()) return ErrorCode::INVALID_PARAMS;
  std::lock_guard<std::mutex> lock(mu_);
  bool was_new = false;
  const TimePoint t = now();
  touchClientLocked(client_id, t, &was_new);
  if (was_new) last_registration_ = t;
  // A client expired and then made known again by another call (a put that reached the master
  // before this heartbeat) has no segments here: it must mount (and wipe its records) again.
  bool missing = false;
  for (const std::string& name : segment_names) {
    auto it = segment_by_name_.find(name);
    missing = missing || it == segment_by_name_.end() ||
              segments_.at(it->second)->client_id != client_id;
  }
  return was_new || missing;
}

void MasterService::expireClientLocked(const std::string& client_id) {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return;
  // Revoke the puts it started and never ended: nobody will finish writing them.
  std::vector<Object*> pending(it->second.pending_puts.begin(), it->second.pending_puts.end());
  for (Object* o : pending) {
    destroyObjectLocked(o);
    ++counters_.put_revokes;
  }
  std::vector<Object*> upserts(it->second.pending_upserts.begin(),
                               it->second.pending_upserts.end());
  for (Object* o : upserts) {
    dropStagedLocked(o, nullptr);
    ++counters_.put_revokes;
  }
  std::vector<uint64_t> slabs(it->second.slabs.begin(), it->second.slabs.end());
  for (uint64_t id : slabs) {
    auto sl = slabs_.find(id);
    if (sl != slabs_.end()) retireSlabLocked(sl->second.get());
  }
  std::vector<SegmentId> segs = it->second.segments;
  for (SegmentId id : segs) {
    auto s = segments_.find(id);
    if (s != segments_.end()) unmountLocked(s->second.get());
  }
  clients_.erase(client_id);
  ++counters_.client_expirations;
}

// ---------------------------------------------------------------- object bookkeeping

void MasterService::linkLru(Object* o, TimePoint t) {
  if (o->hard_pin) return;
  if (o->soft_pin && o->soft_pin_deadline > t) {
    soft_lru_.push_front(o);
    o->lru_it = soft_lru_.begin();
    o->list = ListId::kSoft;
  } else {
    lru_.push_front(o);
    o->lru_it = lru_.begin();
    o->list = ListId::kNormal;
  }
}

void MasterService::unlinkLru(Object* o) {
  if (o->list == ListId::kNormal) lru_.erase(o->lru_it);
  if (o->list == ListId::kSoft) soft_lru_.erase(o->lru_it);
  o->list = ListId::kNone;
}

void MasterService::touchLru(Object* o, TimePoint t) {
  if (o->list == ListId::kNormal) lru_.splice(lru_.begin(), lru_, o->lru_it);
  if (o->list == ListId::kSoft) soft_lru_.splice(soft_lru_.begin(), soft_lru_, o->lru_it);
}

void MasterService::grantLease(Object* o, TimePoint t) {
  o->lease_deadline = std::max(o->lease_deadline, t + ms(config_.lease_ttl_ms));
  if (o->soft_pin && o->list == ListId::kSoft)
    o->soft_pin_deadline = std::max(o->soft_pin_deadline, t + ms(softPinTtlMs(o)));
  touchLru(o, t);
}

void MasterService::removeLocked(Object* o, TimePoint now) {
  if (!leased(o, now)) return destroyObjectLocked(o);
  // A forced remove of a leased object: a reader may be transferring out of its replicas
  // right now, so the key goes at once but the memory only when the lease lapses.
  const TimePoint until = o->lease_deadline;
  destroyObjectLocked(o, &until);
}

void MasterService::destroyObjectLocked(Object* o, const TimePoint* quarantine_until) {
  if (!o->staged.empty()) {
    // An upsert is writing them: keep its memory reserved until it may have stopped.
    const TimePoint until = o->upsert_start + ms(config_.put_release_timeout_ms);
    dropStagedLocked(o, &until);
  }
  unlinkLru(o);
  for (const Replica& r : o->replicas) {
    for (const PieceRec& p : r.pieces) {
      p.seg->objects.erase(o);
      // The record goes now (the key is gone), the bytes when the readers' lease lapses.
      releasePieceLocked(p, o->complete, quarantine_until);
    }
  }
  if (!o->complete) {
    processing_.erase(o->proc_it);
    auto c = clients_.find(o->writer);
    if (c != clients_.end()) c->second.pending_puts.erase(o);
  }
  if (o->hard_pin && o->complete) --hard_pinned_count_;
  std::string key = *o->key;  // o->key points into the map node erased below
  objects_.erase(key);
}

// ---------------------------------------------------------------- two-phase put

ErrorOr<std::vector<ReplicaPlacement>> MasterService::putStart(const std::string& client_id,
                                                               const std::string& key,
                                                               uint64_t size,
                                                               const ReplicateConfig& config,
                                                               uint64_t* token) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  uint32_t replica_num = config.replica_num == 0 ? 1 : config.replica_num;
  if (size == 0 || replica_num > config_.max_replicas) return ErrorCode::INVALID_PARAMS;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  ++counters_.put_starts;
  if (!client_id.empty()) touchClientLocked(client_id, t, nullptr);

  auto existing = objects_.find(key);
  if (existing != objects_.end()) {
    Object* old = existing->second.get();
    if (old->complete || t - old->put_start < ms(config_.put_discard_timeout_ms))
      return ErrorCode::OBJECT_ALREADY_EXISTS;
    // A put that has not ended for too long: take the key over, but keep its memory reserved
    // until the release timeout, since its writer may still be writing into it.
    TimePoint release_at = old->put_start + ms(config_.put_release_timeout_ms);
    destroyObjectLocked(old, &release_at);
    ++counters_.put_revokes;
  }

  ReplicateConfig cfg = config;
  cfg.replica_num = replica_num;
  std::vector<Replica> replicas = allocateReplicas(key, size, cfg);
  if (replicas.empty() && size <= capacity_bytes_) {
    // Out of room: evict (LRU share, and at least the bytes asked for), then try once more.
    evictLocked(t, size);
    replicas = allocateReplicas(key, size, cfg);
  }
  if (replicas.empty()) {
    ++counters_.allocation_failures;
    return ErrorCode::NO_AVAILABLE_HANDLE;
  }

  Object* o = createLocked(client_id, key, size, cfg, std::move(replicas), t);
  o->put_token = next_put_token_++;
  if (token != nullptr) *token = o->put_token;

  std::vector<ReplicaPlacement> out;
  out.reserve(o->replicas.size());
  for (const Replica& r : o->replicas) out.push_back(describe(r));
  if (aboveWatermark(0)) evictLocked(t, 0);
  return out;
}

MasterService::Object* MasterService::createLocked(const std::string& client_id,
                                                   const std::string& key, uint64_t size,
                                                   const ReplicateConfig& cfg,
                                                   std::vector<Replica> replicas, TimePoint t) {
  auto [it, inserted] = objects_.emplace(key, std::make_unique<Object>());
  Object* o = it->second.get();
  o->key = &it->first;
  o->size = size;
  o->soft_pin = cfg.with_soft_pin;
  o->soft_pin_ttl_ms = cfg.soft_pin_ttl_ms;
  o->hard_pin = cfg.with_hard_pin;
  o->put_start = t;
  o->writer = client_id;
  o->replicas = std::move(replicas);
  for (const Replica& r : o->replicas)
    for (const PieceRec& p : r.pieces) p.seg->objects.insert(o);
  o->proc_it = processing_.insert(processing_.end(), o);
  if (!client_id.empty()) clients_[client_id].pending_puts.insert(o);
  return o;
}

void MasterService::completeLocked(Object* o, TimePoint t) {
  o->complete = true;
  o->upsert_id = 0;
  processing_.erase(o->proc_it);
  auto c = clients_.find(o->writer);
  if (c != clients_.end()) c->second.pending_puts.erase(o);
  if (o->hard_pin) ++hard_pinned_count_;
  if (o->soft_pin) o->soft_pin_deadline = t + ms(softPinTtlMs(o));
  linkLru(o, t);
}

ErrorCode MasterService::putEnd(const std::string& client_id, const std::string& key,
                                uint64_t token) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  if (!client_id.empty()) touchClientLocked(client_id, t, nullptr);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  if (o->writer != client_id) return ErrorCode::ILLEGAL_CLIENT;
  if (token != 0 && o->put_token != token) return ErrorCode::OBJECT_NOT_FOUND;  // not that put
  if (o->complete) return ErrorCode::OK;  // a retried PutEnd
  if (o->upsert_id != 0) return ErrorCode::INVALID_WRITE;  // an upsert's: upsertEnd ends it
  completeLocked(o, t);
  ++counters_.put_ends;
  return ErrorCode::OK;
}

ErrorCode MasterService::putRevoke(const std::string& client_id, const std::string& key,
                                   bool writes_pending, uint64_t* hold, uint64_t token) {
  if (hold != nullptr) *hold = 0;
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  if (!client_id.empty()) touchClientLocked(client_id, now(), nullptr);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  if (o->writer != client_id) return ErrorCode::ILLEGAL_CLIENT;
  if (token != 0 && o->put_token != token) return ErrorCode::OBJECT_NOT_FOUND;  // not that put
  if (o->complete) return ErrorCode::INVALID_WRITE;  // complete objects go through remove()
  if (o->upsert_id != 0) return ErrorCode::INVALID_WRITE;  // an upsert's: upsertRevoke
  if (writes_pending && !client_id.empty() && hold != nullptr) {
    // Late WRITEs may still land in its memory: kept until the writer says they finished.
    const TimePoint until = o->put_start + ms(config_.put_release_timeout_ms);
    const size_t first = quarantineMarkLocked(o);
    destroyObjectLocked(o, &until);
    *hold = holdQuarantinedLocked(first, client_id);
  } else {
    destroyObjectLocked(o);
  }
  ++counters_.put_revokes;
  return ErrorCode::OK;
}

size_t MasterService::quarantineMarkLocked(Object* o) {
  if (!o->staged.empty()) {
    const TimePoint until = o->upsert_start + ms(config_.put_release_timeout_ms);
    dropStagedLocked(o, &until);
  }
  return quarantine_.size();
}

uint64_t MasterService::holdQuarantinedLocked(size_t first, const std::string& client_id) {
  const uint64_t hold = next_hold_++;
  for (size_t i = first; i < quarantine_.size(); ++i) {
    quarantine_[i].hold = hold;
    quarantine_[i].holder = client_id;
  }
  return hold;
}

void MasterService::releaseHolds(const std::string& client_id,
                                 const std::vector<uint64_t>& holds) {
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint t = now();
  for (Quarantined& q : quarantine_)
    if (q.hold != 0 && q.holder == client_id &&
        std::find(holds.begin(), holds.end(), q.hold) != holds.end())
      q.release_at = std::min(q.release_at, t);  // freed by the next maintenance round
}

// ---------------------------------------------------------------- reads

ErrorOr<MasterService::ReplicaList> MasterService::getReplicaListLocked(const std::string& key,
                                                                        TimePoint t) {
  ++counters_.gets;
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  if (!o->complete) return ErrorCode::REPLICA_IS_NOT_READY;
  grantLease(o, t);
  ++counters_.get_hits;
  ReplicaList out;
  out.size = o->size;
  out.lease_ttl_ms = config_.lease_ttl_ms;
  out.replicas.reserve(o->replicas.size());
  for (const Replica& r : o->replicas) out.replicas.push_back(describe(r));
  return out;
}

ErrorOr<MasterService::ReplicaList> MasterService::getReplicaList(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return getReplicaListLocked(key, now());
}

std::vector<ErrorOr<MasterService::ReplicaList>> MasterService::batchGetReplicaList(
    const std::vector<std::string>& keys) {
  std::vector<ErrorOr<ReplicaList>> out;
  out.reserve(keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  for (const std::string& k : keys) out.push_back(getReplicaListLocked(k, t));
  return out;
}

ErrorOr<bool> MasterService::existsLocked(const std::string& key, TimePoint t) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  auto it = objects_.find(key);
  if (it == objects_.end() || !it->second->complete) return false;
  grantLease(it->second.get(), t);  // as Mooncake: the caller is likely to read it next
  return true;
}

ErrorOr<bool> MasterService::exists(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return existsLocked(key, now());
}

std::vector<ErrorOr<bool>> MasterService::batchExists(const std::vector<std::string>& keys) {
  std::vector<ErrorOr<bool>> out;
  out.reserve(keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  for (const std::string& k : keys) out.push_back(existsLocked(k, t));
  return out;
}

ErrorOr<uint64_t> MasterService::getSize(const std::string& key) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  if (!it->second->complete) return ErrorCode::REPLICA_IS_NOT_READY;
  return it->second->size;
}

// ---------------------------------------------------------------- removal

ErrorCode MasterService::remove(const std::string& key, bool force) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  const TimePoint t = now();
  if (!force && leased(o, t)) return ErrorCode::OBJECT_HAS_LEASE;
  if (!o->complete) return ErrorCode::REPLICA_IS_NOT_READY;
  removeLocked(o, t);
  ++counters_.removes;
  return ErrorCode::OK;
}

uint64_t MasterService::removeMatchingLocked(const std::function<bool(const std::string&)>& match,
                                             bool force) {
  TimePoint t = now();
  std::vector<Object*> victims;
  for (auto& [key, obj] : objects_)
    if (obj->complete && (force || !leased(obj.get(), t)) && match(key))
      victims.push_back(obj.get());
  for (Object* o : victims) removeLocked(o, t);
  counters_.removes += victims.size();
  return victims.size();
}

ErrorOr<uint64_t> MasterService::removeByRegex(const std::string& regex, bool force) {
  // RE2: matching time is linear in the key's length whatever the pattern (no backtracking:
  // '(a|a)*b' cannot stall the master), and the compiled program's memory is bounded. It has
  // no backreferences or lookaround (docs/store.md); such patterns are INVALID_PARAMS.
  if (regex.empty() || regex.size() > config_.max_regex_length) return ErrorCode::INVALID_PARAMS;
#if !MC_STORE_HAVE_RE2
  // A master built without RE2 (store/CMakeLists.txt) matches no pattern rather than run one
  // through a backtracking engine.
  (void)force;
  return ErrorCode::UNAVAILABLE_IN_CURRENT_MODE;
#else
  RE2::Options opt;
  opt.set_log_errors(false);
  opt.set_max_mem(8 << 20);
  RE2 re(regex, opt);
  if (!re.ok()) return ErrorCode::INVALID_PARAMS;
  std::lock_guard<std::mutex> lock(mu_);
  return removeMatchingLocked([&](const std::string& k) { return RE2::PartialMatch(k, re); },
                              force);
#endif
}

uint64_t MasterService::removeAll(bool force) {
  std::lock_guard<std::mutex> lock(mu_);
  return removeMatchingLocked([](const std::string&) { return true; }, force);
}

MasterMetrics MasterService::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  MasterMetrics m = counters_;
  m.objects = objects_.size() - processing_.size();
  m.processing_objects = processing_.size();
  m.soft_pinned_objects = soft_lru_.size();
  m.hard_pinned_objects = hard_pinned_count_;
  m.bytes_used = used_bytes_;
  m.bytes_capacity = capacity_bytes_;
  m.segments = segments_.size();
  m.clients = clients_.size();
  m.slabs = slabs_.size();
  for (const auto& [id, slab] : slabs_)
    for (const SlabExtent& e : slab->extents)
      for (const auto& [off, a] : e.blocks) m.slab_bytes += a.size;
  m.epoch = role_.load() == MasterRole::kStandby ? 0 : epoch_.load();
  m.role = static_cast<uint8_t>(role_.load());
  fillRpcStats(&m);
  return m;
}

}  // namespace mooncake::store
