// Upserts (replace an object atomically) and batchReplicaClear. Contracts: master_service.h.
//
// Why readers never see a mix: an upsert of a complete object writes into NEW replicas
// (`staged`) while getReplicaList keeps answering the old ones; upsertEnd swaps the lists in
// one step under the master's mutex. A reader holding the old placement got a lease with it, and
// the old replicas' memory is quarantined until that lease lapses, so nothing overwrites it
// while such a reader may be copying; a reader whose copy outlasts its lease is told
// LEASE_EXPIRED by its client (store_client.cc), never handed the bytes.
#include <algorithm>

#include "store/master/master_service.h"

namespace mooncake::store {

namespace {
std::chrono::milliseconds ms(uint64_t v) { return std::chrono::milliseconds(v); }
// How long the replaced value's records outlive upsertEnd (see there).
constexpr uint64_t kUpsertCommitGraceMs = 2000;
}  // namespace

bool MasterService::hasPieceOn(const Object* o, const Segment* s) {
  for (const auto* list : {&o->replicas, &o->staged})
    for (const Replica& r : *list)
      for (const PieceRec& p : r.pieces)
        if (p.seg == s) return true;
  return false;
}

void MasterService::dropStagedLocked(Object* o, const TimePoint* quarantine_until) {
  if (o->staged.empty()) return;
  std::vector<Replica> staged = std::move(o->staged);
  o->staged.clear();
  // Staged records are never committed (their writer commits after upsertEnd): no wipe.
  for (const Replica& r : staged)
    for (const PieceRec& p : r.pieces) releasePieceLocked(p, false, quarantine_until);
  for (const Replica& r : staged)
    for (const PieceRec& p : r.pieces)
      if (!hasPieceOn(o, p.seg)) p.seg->objects.erase(o);
  upserting_.erase(o->upsert_it);
  auto c = clients_.find(o->upsert_writer);
  if (c != clients_.end()) c->second.pending_upserts.erase(o);
  o->upsert_id = 0;
  o->staged_size = 0;
  o->upsert_writer.clear();
}

ErrorOr<std::vector<ReplicaPlacement>> MasterService::upsertStart(const std::string& client_id,
                                                                  const std::string& key,
                                                                  uint64_t size,
                                                                  const ReplicateConfig& config,
                                                                  uint64_t* upsert_id) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  uint32_t replica_num = config.replica_num == 0 ? 1 : config.replica_num;
  if (size == 0 || replica_num > config_.max_replicas || upsert_id == nullptr)
    return ErrorCode::INVALID_PARAMS;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  ++counters_.put_starts;
  if (!client_id.empty()) touchClientLocked(client_id, t, nullptr);
  ReplicateConfig cfg = config;
  cfg.replica_num = replica_num;

  Object* existing = nullptr;
  if (auto it = objects_.find(key); it != objects_.end()) {
    Object* old = it->second.get();
    if (old->complete) {
      existing = old;
      if (!old->staged.empty()) {  // preempt the upsert in progress; its writer may still write
        const TimePoint until = old->upsert_start + ms(config_.put_release_timeout_ms);
        dropStagedLocked(old, &until);
        ++counters_.put_revokes;
      }
    } else {
      // A put or upsert still writing: preempted (as upstream), its memory kept reserved until
      // its writer may have stopped.
      const TimePoint until = old->put_start + ms(config_.put_release_timeout_ms);
      destroyObjectLocked(old, &until);
      ++counters_.put_revokes;
    }
  }

  // The object being replaced keeps its replicas while the new ones are placed: the segments
  // it uses are not excluded (a one-segment store can still upsert).
  std::vector<Replica> replicas = allocateReplicas(key, size, cfg);
  if (replicas.empty() && size <= capacity_bytes_) {
    evictLocked(t, size);  // may evict `existing` itself: then the upsert creates the key
    if (existing != nullptr && objects_.count(key) == 0) existing = nullptr;
    replicas = allocateReplicas(key, size, cfg);
  }
  if (replicas.empty()) {
    ++counters_.allocation_failures;
    return ErrorCode::NO_AVAILABLE_HANDLE;
  }
  const uint64_t id = next_upsert_id_++;
  *upsert_id = id;
  std::vector<ReplicaPlacement> out;
  out.reserve(replicas.size());
  for (const Replica& r : replicas) out.push_back(describe(r));
  if (existing == nullptr) {
    Object* o = createLocked(client_id, key, size, cfg, std::move(replicas), t);
    o->upsert_id = id;
  } else {
    Object* o = existing;
    o->staged = std::move(replicas);
    o->staged_size = size;
    o->staged_config = cfg;
    o->upsert_id = id;
    o->upsert_writer = client_id;
    o->upsert_start = t;
    for (const Replica& r : o->staged)
      for (const PieceRec& p : r.pieces) p.seg->objects.insert(o);
    o->upsert_it = upserting_.insert(upserting_.end(), o);
    if (!client_id.empty()) clients_[client_id].pending_upserts.insert(o);
  }
  if (aboveWatermark(0)) evictLocked(t, 0);
  return out;
}

ErrorCode MasterService::upsertEnd(const std::string& client_id, const std::string& key,
                                   uint64_t upsert_id) {
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  if (!client_id.empty()) touchClientLocked(client_id, t, nullptr);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  if (upsert_id == 0 || o->upsert_id != upsert_id) return ErrorCode::INVALID_WRITE;  // preempted
  if (!o->complete) {  // the upsert created the key
    if (o->writer != client_id) return ErrorCode::ILLEGAL_CLIENT;
    completeLocked(o, t);
    ++counters_.put_ends;
    return ErrorCode::OK;
  }
  if (o->upsert_writer != client_id) return ErrorCode::ILLEGAL_CLIENT;
  // The swap. Old replicas: freed, or quarantined while a lease granted before now lasts.
  std::vector<Replica> old = std::move(o->replicas);
  o->replicas = std::move(o->staged);
  o->staged.clear();
  o->size = o->staged_size;
  o->staged_size = 0;
  upserting_.erase(o->upsert_it);
  if (auto c = clients_.find(o->upsert_writer); c != clients_.end())
    c->second.pending_upserts.erase(o);
  o->upsert_id = 0;
  o->upsert_writer.clear();
  o->writer = client_id;
  // Their records stay until the writer has surely committed the new value's (it does right
  // after this answer): a master that dies in between leaves both, and the rebuild keeps the
  // newer. Then they are wiped and the memory freed (not before a read lease lapsed).
  // Without records: freed, or quarantined while a read lease from before the swap lasts.
  const TimePoint lease_end = o->lease_deadline;
  const TimePoint grace_end = std::max(lease_end, t + ms(kUpsertCommitGraceMs));
  for (const Replica& r : old)
    for (const PieceRec& p : r.pieces) {
      if (p.record_bytes > 0 && wiper_ != nullptr)
        quarantine_.push_back({p.seg, p.alloc, grace_end, 0, /*wipe_at_release=*/true});
      else
        releasePieceLocked(p, false, leased(o, t) ? &lease_end : nullptr);
    }
  for (const Replica& r : old)
    for (const PieceRec& p : r.pieces)
      if (!hasPieceOn(o, p.seg)) p.seg->objects.erase(o);
  // Pins: hard stays hard; soft as the upsert's config says.
  const ReplicateConfig& cfg = o->staged_config;
  unlinkLru(o);
  if (o->hard_pin) --hard_pinned_count_;
  o->hard_pin = o->hard_pin || cfg.with_hard_pin;
  if (o->hard_pin) ++hard_pinned_count_;
  if (!cfg.keep_soft_pin) {
    o->soft_pin = cfg.with_soft_pin;
    o->soft_pin_ttl_ms = cfg.soft_pin_ttl_ms;
    if (o->soft_pin) o->soft_pin_deadline = t + ms(softPinTtlMs(o));
  }
  linkLru(o, t);
  ++counters_.put_ends;
  return ErrorCode::OK;
}

ErrorCode MasterService::upsertRevoke(const std::string& client_id, const std::string& key,
                                      uint64_t upsert_id, bool writes_pending, uint64_t* hold) {
  if (hold != nullptr) *hold = 0;
  if (ErrorCode e = checkKey(key); e != ErrorCode::OK) return e;
  std::lock_guard<std::mutex> lock(mu_);
  if (!client_id.empty()) touchClientLocked(client_id, now(), nullptr);
  auto it = objects_.find(key);
  if (it == objects_.end()) return ErrorCode::OBJECT_NOT_FOUND;
  Object* o = it->second.get();
  if (upsert_id == 0 || o->upsert_id != upsert_id) return ErrorCode::INVALID_WRITE;
  if (o->complete ? o->upsert_writer != client_id : o->writer != client_id)
    return ErrorCode::ILLEGAL_CLIENT;
  // Late WRITEs may still land (writes_pending): the memory stays until the writer says not.
  const bool keep = writes_pending && !client_id.empty() && hold != nullptr;
  const TimePoint until =
      (o->complete ? o->upsert_start : o->put_start) + ms(config_.put_release_timeout_ms);
  const size_t first = o->complete ? quarantine_.size() : quarantineMarkLocked(o);
  if (!o->complete)
    destroyObjectLocked(o, keep ? &until : nullptr);
  else
    dropStagedLocked(o, keep ? &until : nullptr);  // (its staged replicas: this writer's)
  if (keep) *hold = holdQuarantinedLocked(first, client_id);
  ++counters_.put_revokes;
  return ErrorCode::OK;
}

std::vector<std::string> MasterService::batchReplicaClear(const std::string& client_id,
                                                          const std::vector<std::string>& keys,
                                                          const std::string& segment_name) {
  std::vector<std::string> cleared;
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  if (!client_id.empty()) touchClientLocked(client_id, t, nullptr);
  Segment* only = nullptr;
  if (!segment_name.empty()) {
    auto s = segment_by_name_.find(segment_name);
    if (s == segment_by_name_.end()) return cleared;
    only = segments_.at(s->second).get();
  }
  for (const std::string& key : keys) {
    if (checkKey(key) != ErrorCode::OK) continue;
    auto it = objects_.find(key);
    if (it == objects_.end()) continue;
    Object* o = it->second.get();
    if (!o->complete || !o->staged.empty() || o->writer != client_id || leased(o, t)) continue;
    if (only == nullptr) {
      destroyObjectLocked(o);
      ++counters_.removes;
      cleared.push_back(key);
      continue;
    }
    std::vector<Segment*> touched;
    if (dropReplicasOnLocked(o, only, &touched) == 0) continue;  // nothing of it there
    unindexLocked(o, touched);
    if (o->replicas.empty()) {
      destroyObjectLocked(o);
      ++counters_.removes;
    }
    cleared.push_back(key);
  }
  return cleared;
}

}  // namespace mooncake::store
