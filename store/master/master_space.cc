// Space management of the master: where replicas go (placement) and what leaves when space runs
// short (eviction). Every function here runs with mu_ held.
#include <algorithm>
#include <cmath>

#include "store/master/master_service.h"
#include "store/master/record.h"

namespace mooncake::store {

// ---------------------------------------------------------------- placement

uint64_t MasterService::startWipeLocked(const Segment* seg, const OffsetAllocator::Allocation& a) {
  if (wiper_ == nullptr) return 0;
  const uint64_t token = next_wipe_token_++;
  ++counters_.records_wiped;
  return wiper_->wipe(seg->client_id, seg->base + a.offset, token) ? 0 : token;
}

void MasterService::freePiece(const PieceRec& p, bool wipe) {
  if (wipe && p.record_bytes > 0) {
    if (uint64_t token = startWipeLocked(p.seg, p.alloc); token != 0) {
      // Reused only once the wipe landed (wipeDone).
      quarantine_.push_back({p.seg, p.alloc, TimePoint{}, token});
      return;
    }
  }
  if (p.seg->alloc.free(p.alloc)) used_bytes_ -= p.alloc.size;
}

void MasterService::releasePieceLocked(const PieceRec& p, bool wipe, const TimePoint* until) {
  if (until == nullptr) return freePiece(p, wipe);
  // The record goes now, the bytes when `until` passes (a reader's lease).
  const uint64_t token = wipe && p.record_bytes > 0 ? startWipeLocked(p.seg, p.alloc) : 0;
  quarantine_.push_back({p.seg, p.alloc, *until, token});
}

uint64_t MasterService::recordBytesFor(const Segment* s, const std::string& key) const {
  return s->record_tag != 0 ? recordBytes(key.size()) : 0;
}

ReplicaPlacement MasterService::describe(const Replica& r) const {
  ReplicaPlacement out;
  out.pieces.reserve(r.pieces.size());
  for (const PieceRec& p : r.pieces) {
    Piece piece;
    piece.segment_id = p.seg->id;
    piece.segment_name = p.seg->name;
    piece.client_id = p.seg->client_id;
    piece.offset = p.alloc.offset;
    piece.address = p.seg->base + p.alloc.offset + p.record_bytes;
    piece.length = p.length;
    piece.record_tag = p.record_bytes > 0 ? p.seg->record_tag : 0;
    out.pieces.push_back(std::move(piece));
  }
  return out;
}

// Candidate order for one replica: the preferred segments in their order, then the segments of
// clients that hold no replica of this object yet, then the other clients' (never a segment
// already used by this object). Both walks start at the round-robin cursor, which moves once per
// put, so that successive puts spread over the segments.
bool MasterService::allocateReplica(const std::string& key, uint64_t size,
                                    const std::vector<std::string>& preferred,
                                    std::unordered_set<Segment*>* used_segments,
                                    std::unordered_set<std::string>* used_clients, Replica* out) {
  const size_t n = segment_order_.size();
  if (n == 0) return false;
  std::vector<Segment*> order;
  order.reserve(n);
  std::unordered_set<Segment*> prefs;
  for (const std::string& name : preferred) {
    auto it = name.empty() ? segment_by_name_.end() : segment_by_name_.find(name);
    if (it == segment_by_name_.end()) continue;
    Segment* s = segments_.at(it->second).get();
    if (used_segments->count(s) || s->owner_gone || s->awaiting_report || !prefs.insert(s).second)
      continue;
    order.push_back(s);
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < n; ++i) {
      Segment* s = segment_order_[(rr_cursor_ + i) % n];
      // A segment whose owner's engine is gone takes no new replica (its objects stay until
      // the client expires, as any silent client's do).
      if (prefs.count(s) || s->owner_gone || s->awaiting_report || used_segments->count(s))
        continue;
      bool client_used = used_clients->count(s->client_id) > 0;
      if ((pass == 0) != client_used) order.push_back(s);
    }
  }

  auto claim = [&](Segment* s, OffsetAllocator::Allocation a, uint64_t length) {
    used_bytes_ += a.size;
    out->pieces.push_back({s, a, length, recordBytesFor(s, key)});
  };

  // Whole: one piece on the first candidate with a fitting free block.
  for (Segment* s : order) {
    const uint64_t need = size + recordBytesFor(s, key);
    if (s->alloc.freeBytes() < need) continue;
    OffsetAllocator::Allocation a = s->alloc.allocate(need);
    if (!a.valid()) continue;
    claim(s, a, size);
    used_segments->insert(s);
    used_clients->insert(s->client_id);
    return true;
  }

  // Striped: the largest block each candidate can give, in candidate order, no piece smaller
  // than min_stripe_bytes except the last.
  uint64_t remaining = size;
  for (Segment* s : order) {
    if (remaining == 0 || out->pieces.size() >= config_.max_pieces_per_replica) break;
    const uint64_t rb = recordBytesFor(s, key);
    const uint64_t hint = s->alloc.largestFreeHint();
    uint64_t take = hint > rb ? std::min(hint - rb, remaining) : 0;
    if (take == 0 || take < std::min(config_.min_stripe_bytes, remaining)) continue;
    OffsetAllocator::Allocation a = s->alloc.allocate(take + rb);
    if (!a.valid()) continue;
    claim(s, a, take);
    remaining -= take;
  }
  if (remaining > 0) {
    for (const PieceRec& p : out->pieces) freePiece(p);
    out->pieces.clear();
    return false;
  }
  for (const PieceRec& p : out->pieces) {
    used_segments->insert(p.seg);
    used_clients->insert(p.seg->client_id);
  }
  return true;
}

std::vector<MasterService::Replica> MasterService::allocateReplicas(const std::string& key,
                                                                    uint64_t size,
                                                                    const ReplicateConfig& config) {
  std::vector<Replica> out;
  std::unordered_set<Segment*> used_segments;
  std::unordered_set<std::string> used_clients;
  // Every replica prefers the listed segments it can still use, in order (upstream's rule:
  // replica r lands on the r-th listed segment when each has room).
  std::vector<std::string> preferred;
  if (!config.preferred_segment.empty()) preferred.push_back(config.preferred_segment);
  preferred.insert(preferred.end(), config.preferred_segments.begin(),
                   config.preferred_segments.end());
  for (uint32_t r = 0; r < config.replica_num; ++r) {
    Replica rep;
    if (!allocateReplica(key, size, preferred, &used_segments, &used_clients, &rep))
      break;  // fewer replicas than asked: best effort
    out.push_back(std::move(rep));
  }
  if (!segment_order_.empty()) rr_cursor_ = (rr_cursor_ + 1) % segment_order_.size();
  return out;
}

// ---------------------------------------------------------------- eviction

bool MasterService::aboveWatermark(uint64_t extra_bytes) const {
  if (capacity_bytes_ == 0) return false;
  return static_cast<double>(used_bytes_ + extra_bytes) >
         config_.eviction_high_watermark * static_cast<double>(capacity_bytes_);
}

// soft_lru_ is ordered by last read, and a read extends the soft pin to read time + TTL, so the
// pins lapse from the back of the list: O(number demoted).
void MasterService::demoteLapsedSoftPinsLocked(TimePoint t) {
  while (!soft_lru_.empty()) {
    Object* o = soft_lru_.back();
    if (o->soft_pin_deadline > t) break;
    // Unread for a whole soft-pin TTL: older than anything on the normal list, so it goes to
    // the least-recently-used end.
    lru_.splice(lru_.end(), soft_lru_, o->lru_it);
    o->list = ListId::kNormal;
  }
}

// Evicts least recently used objects until eviction_ratio of the evictable ones are gone, at
// least need_bytes are freed, and usage is back under the high watermark (whichever comes last),
// or nothing evictable remains. Leased objects are skipped where they are; PROCESSING and
// hard-pinned objects are on no list. The normal list is drained before the soft-pinned one.
uint64_t MasterService::evictLocked(TimePoint t, uint64_t need_bytes) {
  demoteLapsedSoftPinsLocked(t);
  const uint64_t total = lru_.size() + soft_lru_.size();
  if (total == 0) return 0;
  ++counters_.eviction_rounds;
  // ceil, forgiving the rounding error of ratio * total (0.1 * 90 must be 9, not 10).
  const uint64_t target_count = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::ceil(config_.eviction_ratio * total - 1e-9)));
  const double high = config_.eviction_high_watermark * static_cast<double>(capacity_bytes_);
  const uint64_t above =
      static_cast<double>(used_bytes_) > high ? used_bytes_ - static_cast<uint64_t>(high) : 0;
  const uint64_t target_bytes = std::max(need_bytes, above);
  // Leased objects were read recently and sit near the front, so the walk rarely meets them;
  // the bound keeps a store full of leased objects from turning every put into a full scan.
  const uint64_t max_skips = 1024 + 16 * target_count;

  uint64_t evicted = 0, freed = 0;
  auto done = [&] { return evicted >= target_count && freed >= target_bytes; };
  auto walk = [&](std::list<Object*>& list) {
    uint64_t skips = 0;
    auto it = list.end();
    while (it != list.begin() && !done() && skips <= max_skips) {
      auto cur = std::prev(it);
      Object* o = *cur;
      if (leased(o, t) || !o->staged.empty()) {  // read now, or being upserted
        ++skips;
        it = cur;
        continue;
      }
      for (const Replica& r : o->replicas)
        for (const PieceRec& p : r.pieces) freed += p.alloc.size;
      destroyObjectLocked(o);  // erases cur; `it` stays valid
      ++evicted;
    }
  };
  walk(lru_);
  if (!done()) walk(soft_lru_);  // soft-pinned objects go last
  counters_.evictions += evicted;
  counters_.evicted_bytes += freed;
  return evicted;
}

}  // namespace mooncake::store
