// Failover: standby, rebuild and serving states of the master, and the rebuild of its metadata
// from what the clients hold (docs/store.md, "Failover").
//
// A master that starts leading (or a single master that restarted) knows nothing: the objects'
// bytes are in the clients' segments, each piece behind a record (record.h). Every client mounts
// its segment again and reports the committed records it finds there (REPORT_OBJECTS); when
// every expected client has reported, the master assembles the objects: for each key, the put
// whose replicas are complete (their pieces tile the object), its pieces reserved at the exact
// offsets where they lie. Pieces of incomplete replicas or of losing puts are wiped and freed.
// Until then every call but registration answers UNAVAILABLE_IN_CURRENT_STATUS (retryable).
#include <algorithm>
#include <map>
#include <optional>
#include <random>

#include "store/master/master_service.h"
#include "store/master/record.h"

namespace mooncake::store {

namespace {
std::chrono::milliseconds ms(uint64_t v) { return std::chrono::milliseconds(v); }
}  // namespace

void MasterService::clearAllLocked() {
  objects_.clear();
  lru_.clear();
  soft_lru_.clear();
  processing_.clear();
  slabs_.clear();
  segment_order_.clear();
  segment_by_name_.clear();
  segments_.clear();
  clients_.clear();
  quarantine_.clear();
  staged_.clear();
  expected_clients_.clear();
  used_bytes_ = 0;
  capacity_bytes_ = 0;
  hard_pinned_count_ = 0;
  rr_cursor_ = 0;
  reseedIdsLocked();
}

void MasterService::reseedIdsLocked() {
  std::random_device rd;
  auto base = [&] { return ((static_cast<uint64_t>(rd()) << 30) ^ rd()) | 1; };  // < 2^62
  next_slab_id_ = base();
  next_upsert_id_ = base();
  next_hold_ = base();
  next_put_token_ = base();  // a PutEnd retried onto a new master names no put of its own
}

void MasterService::startServing(uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  clearAllLocked();
  epoch_.store(epoch);
  role_.store(MasterRole::kServing, std::memory_order_release);
}

void MasterService::becomeStandby() {
  std::lock_guard<std::mutex> lock(mu_);
  role_.store(MasterRole::kStandby, std::memory_order_release);
  epoch_.store(0);
  clearAllLocked();
}

void MasterService::beginRebuild(uint64_t epoch, RebuildPolicy policy) {
  std::lock_guard<std::mutex> lock(mu_);
  clearAllLocked();
  epoch_.store(epoch);
  rebuild_policy_ = policy;
  rebuild_start_ = last_registration_ = now();
  role_.store(MasterRole::kRebuilding, std::memory_order_release);
}

void MasterService::setExpectedClients(std::vector<std::string> clients) {
  std::lock_guard<std::mutex> lock(mu_);
  expected_clients_ = std::unordered_set<std::string>(clients.begin(), clients.end());
}

void MasterService::noteElection(bool failover) {
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.leader_elections;
  if (failover) ++counters_.failovers;
}

bool MasterService::rebuildDoneLocked(TimePoint t) const {
  if (t - rebuild_start_ >= ms(rebuild_policy_.timeout_ms)) return true;
  if (t - last_registration_ < ms(rebuild_policy_.quiet_ms)) return false;
  for (const std::string& c : expected_clients_)
    if (!clients_.count(c)) return false;  // a member that has not come back yet
  for (const Segment* s : segment_order_)
    if (s->awaiting_report) return false;  // a report under way
  return true;
}

bool MasterService::pollRebuild() {
  std::lock_guard<std::mutex> lock(mu_);
  if (role_.load() != MasterRole::kRebuilding) return role_.load() == MasterRole::kServing;
  const TimePoint t = now();
  if (!rebuildDoneLocked(t)) return false;
  finishRebuildLocked(t);
  return true;
}

void MasterService::finishRebuildLocked(TimePoint t) {
  addReportedLocked(std::move(staged_), false);
  staged_.clear();
  uint64_t reporters = 0;
  for (auto& [name, c] : clients_) reporters += c.reported ? 1 : 0;
  // A segment whose report has not ended (its client still sending, or gone) takes no new
  // object: unreported records lie there. Its last report part (or its unmount) ends that.
  ++counters_.rebuilds;
  counters_.rebuild_clients += reporters;
  counters_.last_rebuild_seconds =
      std::chrono::duration_cast<std::chrono::duration<double>>(t - rebuild_start_).count();

  role_.store(MasterRole::kServing, std::memory_order_release);
}

ErrorCode MasterService::reportObjects(const std::string& client_id,
                                       const std::string& segment_name,
                                       std::vector<ReportedPiece> records, uint64_t pending,
                                       bool last) {
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint t = now();
  auto sit = segment_by_name_.find(segment_name);
  if (sit == segment_by_name_.end()) return ErrorCode::SEGMENT_NOT_FOUND;
  Segment* seg = segments_.at(sit->second).get();
  if (seg->client_id != client_id) return ErrorCode::ILLEGAL_CLIENT;
  Client& c = touchClientLocked(client_id, t, nullptr);
  last_registration_ = t;
  counters_.objects_revoked += pending;
  // A client speaks for its own segment only (its identity is its authenticated connection):
  // records must lie inside it, at allocation boundaries.
  const uint64_t g = config_.alloc_granularity;
  const uint64_t cap = seg->alloc.capacity();
  std::vector<Staged> good;
  good.reserve(records.size());
  for (ReportedPiece& r : records) {
    const uint64_t len = recordAllocBytes(r.key.size(), r.piece_length);
    if (seg->record_tag == 0 || checkKey(r.key) != ErrorCode::OK || r.piece_length == 0 ||
        r.offset % g != 0 || r.offset > cap || len > cap - r.offset ||
        r.piece_offset > r.object_size || r.piece_length > r.object_size - r.piece_offset)
      continue;
    good.push_back(Staged{seg->id, std::move(r)});
  }
  if (role_.load() == MasterRole::kRebuilding) {
    for (Staged& s : good) staged_.push_back(std::move(s));
    if (last) c.reported = true;
    if (last) seg->awaiting_report = false;
    if (rebuildDoneLocked(t)) finishRebuildLocked(t);
    return ErrorCode::OK;
  }
  // Late (the rebuild ended without this client): add what does not conflict now.
  addReportedLocked(std::move(good), true);
  if (last) {
    c.reported = true;
    seg->awaiting_report = false;
  }
  return ErrorCode::OK;
}

// Assembles objects from reported records. For each key: group its records by put id, then by
// replica; a replica counts when its pieces tile [0, size) exactly. The newest put (largest id)
// with a complete replica wins. Its pieces are reserved where they lie; every
// other record is wiped and its memory freed. Of records that overlap in a segment only the
// newest (largest put id) is reserved: the others' memory was reused after a wipe that failed,
// and their header is wiped where it does not lie in a reserved range. late: the master already
// serves, so keys it knows keep their current object and reported records of them are dropped.
void MasterService::addReportedLocked(std::vector<Staged> staged, bool late) {
  const TimePoint t = now();
  std::map<std::string, std::vector<Staged*>> by_key;
  for (Staged& s : staged) by_key[s.rec.key].push_back(&s);

  struct Plan {
    std::string key;
    uint64_t size = 0;
    uint8_t flags = 0;
    std::vector<std::vector<Staged*>> replicas;  // chosen, each tiling the object
  };
  std::vector<Plan> plans;
  std::vector<Staged*> dropped;
  for (auto& [key, recs] : by_key) {
    if (late && objects_.count(key)) {
      dropped.insert(dropped.end(), recs.begin(), recs.end());
      continue;
    }
    std::map<uint64_t, std::map<uint32_t, std::vector<Staged*>>> by_put;
    for (Staged* s : recs) by_put[s->rec.put_id][s->rec.replica_index].push_back(s);
    Plan best;
    uint64_t best_put = 0;
    size_t best_count = 0;
    for (auto& [put, reps] : by_put) {
      Plan p;
      p.key = key;
      p.size = reps.begin()->second.front()->rec.object_size;
      p.flags = reps.begin()->second.front()->rec.flags;
      for (auto& [idx, pieces] : reps) {
        std::sort(pieces.begin(), pieces.end(), [](const Staged* a, const Staged* b) {
          return a->rec.piece_offset < b->rec.piece_offset;
        });
        uint64_t at = 0;
        bool ok = true;
        for (const Staged* s : pieces) {
          ok = ok && s->rec.object_size == p.size && s->rec.piece_offset == at;
          at += s->rec.piece_length;
        }
        if (ok && at == p.size) p.replicas.push_back(pieces);
      }
      // The newest put with a complete replica wins (put ids grow with time: newPutId()): two
      // committed puts of one key mean an upsert or a put after a remove whose older records
      // were not wiped yet when the master died.
      if (!p.replicas.empty() && put > best_put) {
        best = std::move(p);
        best_put = put;
        best_count = best.replicas.size();
      }
    }
    // Everything not in the winning replicas goes.
    std::unordered_set<Staged*> kept;
    for (auto& r : best.replicas) kept.insert(r.begin(), r.end());
    for (Staged* s : recs)
      if (!kept.count(s)) dropped.push_back(s);
    if (best_count == 0) {
      ++counters_.objects_revoked;
      continue;
    }
    plans.push_back(std::move(best));
  }

  // Reserve every reported piece where it lies, one walk per segment.
  std::unordered_map<Staged*, OffsetAllocator::Allocation> allocs;
  std::unordered_set<Staged*> dropped_headers;  // overlap losers: only their header reserved
  std::map<SegmentId, std::vector<Staged*>> by_seg;
  for (Staged& s : staged) by_seg[s.seg].push_back(&s);
  for (auto& [sid, list] : by_seg) {
    auto sit = segments_.find(sid);
    if (sit == segments_.end()) continue;  // unmounted meanwhile
    Segment* seg = sit->second.get();
    std::sort(list.begin(), list.end(),
              [](const Staged* a, const Staged* b) { return a->rec.offset < b->rec.offset; });
    // Two records that overlap cannot both be live: the memory of the older one (smaller put
    // id: put ids grow with time) was handed out again while its record survived (its wipe
    // failed), and the newer put wrote into it. The newer one is kept; the older, whose bytes
    // were partly overwritten, goes. `kept` stays sorted and disjoint, so the records that
    // overlap the next one are at its end.
    auto endOf = [](const Staged* s) {
      return s->rec.offset + recordAllocBytes(s->rec.key.size(), s->rec.piece_length);
    };
    std::vector<Staged*> kept;
    std::vector<Staged*> overlapped;  // losers: their headers are wiped below where possible
    for (Staged* s : list) {
      bool lost = false;
      while (!kept.empty() && endOf(kept.back()) > s->rec.offset) {
        if (kept.back()->rec.put_id >= s->rec.put_id) {
          lost = true;
          break;
        }
        overlapped.push_back(kept.back());
        kept.pop_back();
      }
      (lost ? overlapped : kept).push_back(s);
    }
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    ranges.reserve(kept.size());
    for (Staged* s : kept) ranges.emplace_back(s->rec.offset, endOf(s) - s->rec.offset);
    std::vector<OffsetAllocator::Allocation> got = seg->alloc.allocateAt(ranges);
    for (size_t i = 0; i < kept.size(); ++i) {
      if (!got[i].valid()) continue;
      used_bytes_ += got[i].size;
      allocs[kept[i]] = got[i];
    }
    // A loser's header must not come back at a later failover (once the records that beat it
    // are gone): reserve just its header and key where that is free, so that it is wiped and
    // freed with the other dropped records below.
    std::sort(overlapped.begin(), overlapped.end(),
              [](const Staged* a, const Staged* b) { return a->rec.offset < b->rec.offset; });
    ranges.clear();
    std::vector<Staged*> headers;
    uint64_t end = 0;
    for (Staged* s : overlapped) {
      if (s->rec.offset < end) continue;
      ranges.emplace_back(s->rec.offset, recordBytes(s->rec.key.size()));
      end = s->rec.offset + ranges.back().second;
      headers.push_back(s);
    }
    got = seg->alloc.allocateAt(ranges);
    for (size_t i = 0; i < headers.size(); ++i) {
      if (!got[i].valid()) continue;
      used_bytes_ += got[i].size;
      allocs[headers[i]] = got[i];
      dropped_headers.insert(headers[i]);
    }
  }
  auto pieceOf = [&](Staged* s) -> std::optional<PieceRec> {
    auto a = allocs.find(s);
    auto sit = segments_.find(s->seg);
    if (a == allocs.end() || sit == segments_.end()) return std::nullopt;
    if (dropped_headers.count(s)) return PieceRec{sit->second.get(), a->second, 0,
                                                  recordBytes(s->rec.key.size())};
    return PieceRec{sit->second.get(), a->second, s->rec.piece_length,
                    recordBytes(s->rec.key.size())};
  };

  for (Plan& p : plans) {
    std::vector<Replica> reps;
    for (auto& pieces : p.replicas) {
      Replica r;
      bool ok = true;
      for (Staged* s : pieces) {
        auto piece = dropped_headers.count(s) ? std::nullopt : pieceOf(s);
        if (!piece)
          ok = false;
        else
          r.pieces.push_back(*piece);
      }
      if (ok) {
        reps.push_back(std::move(r));
      } else {  // a piece could not be reserved: the replica is incomplete
        for (const PieceRec& q : r.pieces) freePiece(q, true);
      }
      for (Staged* s : pieces)
        if (!dropped_headers.count(s)) allocs.erase(s);  // a header: wiped below
    }
    if (reps.empty()) {
      ++counters_.objects_revoked;
      continue;
    }
    auto owned = std::make_unique<Object>();
    Object* o = owned.get();
    auto [pos, inserted] = objects_.emplace(p.key, std::move(owned));
    o->key = &pos->first;
    o->size = p.size;
    o->soft_pin = (p.flags & kRecordSoftPin) != 0;
    o->hard_pin = (p.flags & kRecordHardPin) != 0;
    o->put_start = t;
    o->complete = true;
    o->replicas = std::move(reps);
    for (const Replica& r : o->replicas)
      for (const PieceRec& q : r.pieces) q.seg->objects.insert(o);
    if (o->hard_pin) ++hard_pinned_count_;
    if (o->soft_pin) o->soft_pin_deadline = t + ms(config_.soft_pin_ttl_ms);
    linkLru(o, t);
    ++counters_.objects_recovered;
  }
  // Records that lost (or whose replica did): wipe them before their memory is reused.
  for (Staged* s : dropped) {
    if (auto piece = pieceOf(s)) freePiece(*piece, true);
    allocs.erase(s);
  }
  for (Staged* s : dropped_headers) {  // overlap losers whose key won elsewhere
    if (auto piece = pieceOf(s)) freePiece(*piece, true);
    allocs.erase(s);
  }
}

void MasterService::setRecordWiper(RecordWiper* wiper) {
  std::lock_guard<std::mutex> lock(mu_);
  wiper_ = wiper;
}

void MasterService::wipeDone(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint t = now();
  for (size_t i = 0; i < quarantine_.size(); ++i) {
    Quarantined& q = quarantine_[i];
    if (q.wipe_token != token) continue;
    q.wipe_token = 0;
    if (q.release_at <= t) {
      if (q.seg->alloc.free(q.alloc)) used_bytes_ -= q.alloc.size;
      quarantine_[i] = quarantine_.back();
      quarantine_.pop_back();
    }
    return;
  }
}

}  // namespace mooncake::store
