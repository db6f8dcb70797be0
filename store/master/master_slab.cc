// Slabs: the one-round-trip put path. A writer reserves the same number of bytes on up to
// replica_num distinct segments (a slab), places its next objects in it itself, writes them, and
// publishes them in one call per put or per batch; publishing cuts each object out of every
// extent of the slab (OffsetAllocator::carve), after which it is an ordinary complete object.
// Every function here takes mu_ or runs with it held (the *Locked ones).
#include <algorithm>

#include "store/master/master_service.h"
#include "store/master/record.h"

namespace mooncake::store {

bool MasterService::allocateWhole(uint64_t size, std::unordered_set<Segment*>* used_segments,
                                  std::unordered_set<std::string>* used_clients, PieceRec* out) {
  const size_t n = segment_order_.size();
  // Distinct clients first, then other segments of clients already used; from the round-robin
  // cursor, as replica placement does.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < n; ++i) {
      Segment* s = segment_order_[(rr_cursor_ + i) % n];
      if (s->owner_gone || s->awaiting_report || used_segments->count(s)) continue;
      if ((pass == 0) == (used_clients->count(s->client_id) > 0)) continue;
      const uint64_t cap =
          static_cast<uint64_t>(config_.max_slab_share * static_cast<double>(s->alloc.capacity()));
      if (size > std::max(cap, config_.alloc_granularity) || s->alloc.freeBytes() < size) continue;
      // (allocSlab sized the slab for the largest segment: smaller ones sit this one out)
      OffsetAllocator::Allocation a = s->alloc.allocate(size);
      if (!a.valid()) continue;
      used_bytes_ += a.size;
      *out = PieceRec{s, a, size, 0};
      used_segments->insert(s);
      used_clients->insert(s->client_id);
      return true;
    }
  }
  return false;
}

ErrorOr<SlabGrant> MasterService::allocSlab(const std::string& client_id, uint32_t replica_num,
                                            uint64_t bytes, const std::vector<uint64_t>& retire,
                                            uint64_t min_bytes) {
  if (client_id.empty() || bytes == 0 || replica_num > config_.max_replicas)
    return ErrorCode::INVALID_PARAMS;
  if (replica_num == 0) replica_num = 1;
  const uint64_t g = config_.alloc_granularity;
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint t = now();
  touchClientLocked(client_id, t, nullptr);
  for (uint64_t id : retire) {
    auto it = slabs_.find(id);
    if (it != slabs_.end() && it->second->writer == client_id) retireSlabLocked(it->second.get());
  }
  // No more than the largest segment allows (a share of it), never less than the object needs.
  uint64_t cap = 0;
  for (const Segment* s : segment_order_)
    cap = std::max(cap, static_cast<uint64_t>(config_.max_slab_share *
                                              static_cast<double>(s->alloc.capacity())));
  bytes = std::min({bytes, config_.max_slab_bytes, std::max(cap, min_bytes)});
  bytes = (std::max(bytes, min_bytes) + g - 1) / g * g;
  if (min_bytes > std::max(cap, g)) return ErrorCode::NO_AVAILABLE_HANDLE;  // not an eviction's job
  auto reserve = [&](std::vector<PieceRec>* got) {
    std::unordered_set<Segment*> used_segments;
    std::unordered_set<std::string> used_clients;
    for (uint32_t r = 0; r < replica_num; ++r) {
      PieceRec p{};
      if (!allocateWhole(bytes, &used_segments, &used_clients, &p)) break;
      got->push_back(p);
    }
    if (!segment_order_.empty()) rr_cursor_ = (rr_cursor_ + 1) % segment_order_.size();
  };
  std::vector<PieceRec> got;
  reserve(&got);
  // Short of room (a full store): a slab only as large as the object that asks. Evicting a
  // whole slab's worth per grant would evict far more than the puts need (and the freed
  // ranges, scattered over older slabs, rarely make one contiguous slab), so that a full
  // store would hold far fewer objects than its memory allows; this way a put evicts what it
  // needs, one object at a time as PutStart does, and the reserved but unused rest stays small.
  const uint64_t small = (min_bytes + g - 1) / g * g;
  if (got.empty() && small > 0 && small < bytes) {
    bytes = small;
    reserve(&got);
  }
  if (got.empty() && bytes <= capacity_bytes_) {
    evictLocked(t, bytes);
    reserve(&got);
  }
  if (got.empty()) {
    ++counters_.allocation_failures;
    return ErrorCode::NO_AVAILABLE_HANDLE;
  }
  auto slab = std::make_unique<Slab>();
  slab->id = next_slab_id_++;
  slab->writer = client_id;
  slab->bytes = bytes;
  SlabGrant grant;
  grant.id = slab->id;
  grant.bytes = bytes;
  for (const PieceRec& p : got) {
    SlabExtent e;
    e.seg = p.seg;
    e.start = p.alloc.offset;
    e.blocks.emplace(p.alloc.offset, p.alloc);
    slab->extents.push_back(std::move(e));
    p.seg->slabs.insert(slab.get());
    grant.extents.push_back({p.seg->id, p.seg->name, p.seg->client_id, p.seg->base + p.alloc.offset,
                             config_.record_headers ? p.seg->record_tag : 0});
  }
  clients_[client_id].slabs.insert(slab->id);
  slabs_.emplace(slab->id, std::move(slab));
  ++counters_.slab_grants;
  if (aboveWatermark(0)) evictLocked(t, 0);
  return grant;
}

void MasterService::retireSlabLocked(Slab* slab) {
  // The unpublished parts return to their segments. They may hold records of puts that were
  // written but never published: those were never committed (a writer commits only after its
  // publish was acknowledged), so they need no wiping.
  for (SlabExtent& e : slab->extents) {
    if (e.seg == nullptr) continue;
    for (auto& [off, a] : e.blocks)
      if (e.seg->alloc.free(a)) used_bytes_ -= a.size;
    e.blocks.clear();
    e.seg->slabs.erase(slab);
  }
  auto c = clients_.find(slab->writer);
  if (c != clients_.end()) c->second.slabs.erase(slab->id);
  slabs_.erase(slab->id);  // frees slab
}

void MasterService::retireSlabs(const std::string& client_id, const std::vector<uint64_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  touchClientLocked(client_id, now(), nullptr);
  for (uint64_t id : ids) {
    auto it = slabs_.find(id);
    if (it != slabs_.end() && it->second->writer == client_id) retireSlabLocked(it->second.get());
  }
}

std::vector<ErrorCode> MasterService::publish(const std::string& client_id,
                                              const std::vector<PublishItem>& items) {
  std::vector<ErrorCode> out(items.size(), ErrorCode::OK);
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint t = now();
  touchClientLocked(client_id, t, nullptr);
  const uint64_t g = config_.alloc_granularity;
  for (size_t i = 0; i < items.size(); ++i) {
    const PublishItem& it = items[i];
    if (checkKey(it.key) != ErrorCode::OK) {
      out[i] = ErrorCode::INVALID_KEY;
      continue;
    }
    auto sl = slabs_.find(it.slab_id);
    if (sl == slabs_.end() || sl->second->broken) {
      out[i] = ErrorCode::OBJECT_NOT_FOUND;
      continue;
    }
    Slab* slab = sl->second.get();
    if (slab->writer != client_id) {
      out[i] = ErrorCode::ILLEGAL_CLIENT;
      continue;
    }
    // The writer reserved room for a record in every extent; extents of segments that keep
    // records (record_tag != 0) have one in front of the bytes.
    const uint64_t rb = recordBytes(it.key.size());
    const uint64_t need = rb + it.size;
    if (it.size == 0 || it.offset % g != 0 || it.offset > slab->bytes ||
        need > slab->bytes - it.offset) {
      out[i] = ErrorCode::INVALID_PARAMS;
      continue;
    }
    auto existing = objects_.find(it.key);
    Object* stale = nullptr;  // an unfinished put of the key this one takes over
    if (existing != objects_.end()) {
      Object* old = existing->second.get();
      if (old->complete ||
          t - old->put_start < std::chrono::milliseconds(config_.put_discard_timeout_ms)) {
        out[i] = ErrorCode::OBJECT_ALREADY_EXISTS;
        continue;
      }
      stale = old;
    }
    // Every extent must still hold the range unpublished.
    std::vector<std::map<uint64_t, OffsetAllocator::Allocation>::iterator> blocks;
    for (SlabExtent& e : slab->extents) {
      const uint64_t lo = e.start + it.offset;
      auto b = e.blocks.upper_bound(lo);
      if (b == e.blocks.begin()) break;
      --b;
      if (b->second.offset + b->second.size < lo + need) break;
      blocks.push_back(b);
    }
    if (blocks.size() != slab->extents.size()) {
      out[i] = ErrorCode::INVALID_PARAMS;  // and the stale put, if any, stays
      continue;
    }
    if (stale != nullptr) {
      // Taken over only now that this publish succeeds; its memory stays reserved until its
      // release timeout (its writer may still be writing). Touches no slab block.
      TimePoint release_at =
          stale->put_start + std::chrono::milliseconds(config_.put_release_timeout_ms);
      destroyObjectLocked(stale, &release_at);
      ++counters_.put_revokes;
    }
    auto owned = std::make_unique<Object>();
    Object* o = owned.get();
    for (size_t x = 0; x < slab->extents.size(); ++x) {
      SlabExtent& e = slab->extents[x];
      OffsetAllocator::Allocation head, mid, tail;
      const OffsetAllocator::Allocation whole = blocks[x]->second;
      e.blocks.erase(blocks[x]);
      e.seg->alloc.carve(whole, e.start + it.offset, need, &head, &mid, &tail);
      if (head.valid()) e.blocks.emplace(head.offset, head);
      if (tail.valid()) e.blocks.emplace(tail.offset, tail);
      Replica r;
      const bool rec = config_.record_headers && e.seg->record_tag != 0;
      r.pieces.push_back(PieceRec{e.seg, mid, it.size, rec ? rb : 0});
      e.seg->objects.insert(o);
      o->replicas.push_back(std::move(r));
    }
    auto [pos, inserted] = objects_.emplace(it.key, std::move(owned));
    o->key = &pos->first;
    o->size = it.size;
    o->soft_pin = it.soft_pin;
    o->hard_pin = it.hard_pin;
    o->put_start = t;
    o->writer = client_id;
    o->complete = true;
    if (o->hard_pin) ++hard_pinned_count_;
    if (o->soft_pin) o->soft_pin_deadline = t + std::chrono::milliseconds(config_.soft_pin_ttl_ms);
    linkLru(o, t);
    ++counters_.put_starts;
    ++counters_.put_ends;
    ++counters_.publishes;
  }
  if (aboveWatermark(0)) evictLocked(t, 0);
  return out;
}

}  // namespace mooncake::store
