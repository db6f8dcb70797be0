// Periodic duties of the master (client expiry, put timeouts, quarantine, soft-pin lapse,
// watermark eviction), the optional background thread that runs them, and the invariant check
// the tests use.
#include <algorithm>

#include "store/master/master_service.h"

namespace mooncake::store {

namespace {
std::chrono::milliseconds ms(uint64_t v) { return std::chrono::milliseconds(v); }
}  // namespace

// ---------------------------------------------------------------- maintenance

void MasterService::runMaintenance() {
  std::lock_guard<std::mutex> lock(mu_);
  TimePoint t = now();
  if (role_.load() == MasterRole::kRebuilding && rebuildDoneLocked(t)) finishRebuildLocked(t);
  std::vector<std::string> expired;
  for (const auto& [id, c] : clients_)
    if (t - c.last_seen > ms(config_.client_ttl_ms)) expired.push_back(id);
  for (const std::string& id : expired) expireClientLocked(id);

  while (!processing_.empty() &&
         t - processing_.front()->put_start >= ms(config_.put_release_timeout_ms)) {
    destroyObjectLocked(processing_.front());  // unlinks it from processing_
    ++counters_.put_revokes;
  }

  while (!upserting_.empty() &&
         t - upserting_.front()->upsert_start >= ms(config_.put_release_timeout_ms)) {
    dropStagedLocked(upserting_.front(), nullptr);  // unlinks it from upserting_
    ++counters_.put_revokes;
  }

  for (size_t i = 0; i < quarantine_.size();) {
    Quarantined& q = quarantine_[i];
    if (q.release_at <= t && q.wipe_token == 0 && q.wipe_at_release) {
      // Its record goes now; the memory once the wipe landed (at once, or in wipeDone).
      q.wipe_at_release = false;
      q.wipe_token = startWipeLocked(q.seg, q.alloc);
    }
    if (quarantine_[i].release_at <= t && quarantine_[i].wipe_token == 0) {
      quarantine_[i].seg->alloc.free(quarantine_[i].alloc);
      used_bytes_ -= quarantine_[i].alloc.size;
      quarantine_[i] = quarantine_.back();
      quarantine_.pop_back();
    } else {
      ++i;
    }
  }

  demoteLapsedSoftPinsLocked(t);
  if (aboveWatermark(0)) evictLocked(t, 0);
}

void MasterService::startBackground(std::chrono::milliseconds period) {
  stopBackground();
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    bg_stop_ = false;
  }
  bg_thread_ = std::thread([this, period] { backgroundLoop(period); });
}

void MasterService::stopBackground() {
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    bg_stop_ = true;
  }
  bg_cv_.notify_all();
  if (bg_thread_.joinable()) bg_thread_.join();
}

void MasterService::backgroundLoop(std::chrono::milliseconds period) {
  std::unique_lock<std::mutex> lock(bg_mu_);
  while (!bg_cv_.wait_for(lock, period, [this] { return bg_stop_; })) {
    lock.unlock();
    runMaintenance();
    lock.lock();
  }
}

bool MasterService::checkInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t used = 0, capacity = 0;
  for (const Segment* s : segment_order_) {
    if (!s->alloc.checkConsistency()) return false;
    used += s->alloc.usedBytes();
    capacity += s->alloc.capacity();
    if (segments_.count(s->id) != 1 || segment_by_name_.at(s->name) != s->id) return false;
    for (const Object* o : s->objects)
      if (!hasPieceOn(o, s) || objects_.count(*o->key) != 1) return false;
  }
  if (segment_order_.size() != segments_.size() || used != used_bytes_ ||
      capacity != capacity_bytes_)
    return false;
  uint64_t processing = 0, hard = 0, allocated = 0, upserting = 0;
  for (const auto& [key, o] : objects_) {
    if (o->key != &key || o->replicas.empty()) return false;
    if (!o->staged.empty()) {  // an upsert in progress: a complete object's new replicas
      ++upserting;
      if (!o->complete || o->upsert_id == 0 || *o->upsert_it != o.get()) return false;
      for (const Replica& r : o->staged) {
        uint64_t len = 0;
        for (const PieceRec& p : r.pieces) {
          len += p.length;
          allocated += p.alloc.size;
          if (p.alloc.size < p.length || !p.seg->objects.count(o.get())) return false;
        }
        if (len != o->staged_size) return false;
      }
      auto c = clients_.find(o->upsert_writer);
      if (!o->upsert_writer.empty() &&
          (c == clients_.end() || !c->second.pending_upserts.count(o.get())))
        return false;
    } else if (o->complete && o->upsert_id != 0) {
      return false;
    }
    processing += o->complete ? 0 : 1;
    hard += (o->complete && o->hard_pin) ? 1 : 0;
    for (const Replica& r : o->replicas) {
      uint64_t len = 0;
      for (const PieceRec& p : r.pieces) {
        len += p.length;
        allocated += p.alloc.size;
        if (p.alloc.size < p.length || !p.seg->objects.count(o.get())) return false;
      }
      if (len != o->size) return false;
    }
    bool listed = o->list != ListId::kNone;
    if (listed != (o->complete && !o->hard_pin)) return false;  // LRU: complete, unpinned
    if (!o->complete && !o->writer.empty()) {
      auto c = clients_.find(o->writer);
      if (c == clients_.end() || !c->second.pending_puts.count(o.get())) return false;
    }
  }
  for (const Quarantined& q : quarantine_) allocated += q.alloc.size;
  if (upserting != upserting_.size()) return false;
  for (const auto& [id, c] : clients_)
    for (const Object* o : c.pending_upserts)
      if (o->staged.empty() || o->upsert_writer != id) return false;
  for (const auto& [id, slab] : slabs_)
    for (const SlabExtent& e : slab->extents)
      for (const auto& [off, a] : e.blocks) {
        if (e.seg == nullptr || off != a.offset) return false;
        allocated += a.size;
      }
  if (processing != processing_.size() || hard != hard_pinned_count_ || allocated != used_bytes_)
    return false;
  for (const Object* o : processing_)
    if (o->complete || *o->proc_it != o) return false;
  if (lru_.size() + soft_lru_.size() + processing + hard != objects_.size()) return false;
  for (const Object* o : lru_)
    if (o->list != ListId::kNormal || *o->lru_it != o) return false;
  for (const Object* o : soft_lru_)
    if (o->list != ListId::kSoft || *o->lru_it != o) return false;
  return true;
}

}  // namespace mooncake::store
