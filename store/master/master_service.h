// MasterService: the store's metadata service. It knows which objects exist, where their
// replicas lie (segment, offset, length), which clients are alive and which memory they lent;
// it never sees object data, which moves client-to-client through the engine.
//
// Object life cycle (Mooncake Store's model):
//   putStart  -> the object is PROCESSING: space is reserved on up to replica_num distinct
//                segments and the placements are returned to the writer, which writes the data;
//   putEnd    -> COMPLETE: visible to readers, immutable until removed or evicted;
//   putRevoke -> the reservation is dropped (the writer failed).
// Readers never see a PROCESSING object: getReplicaList answers REPLICA_IS_NOT_READY,
// exists() answers false. A putStart of an existing key is OBJECT_ALREADY_EXISTS; an upsert
// (upsertStart/End) replaces the value atomically (master_upsert.cc).
//
// Leases: getReplicaList and exists (hits) grant a lease of lease_ttl_ms; until it lapses
// remove() fails with OBJECT_HAS_LEASE and eviction skips the object, so a reader's transfer is
// never overwritten while the lease holds.
//
// Eviction: when bytes used pass eviction_high_watermark of capacity (checked after each
// putStart and by maintenance), or when an allocation fails, the least recently used complete
// objects are evicted until eviction_ratio of them are gone and usage is back under the
// watermark. Exempt: leased, PROCESSING and hard-pinned objects. Soft-pinned objects sit on a
// second LRU list that is touched only when the first cannot meet the target; a soft pin lapses
// after soft_pin_ttl_ms without a read.
//
// Clients: any call carrying a client id, and heartbeat(), refresh the client's liveness. A client
// silent for client_ttl_ms is expired by maintenance: its unfinished puts are revoked and its
// segments unmounted. Unmounting a segment drops every replica with a piece on it; an object left
// without replicas is removed, so reads fall to surviving replicas or get OBJECT_NOT_FOUND.
//
// One round trip per put (master_slab.cc): a writer reserves a slab (the same bytes on up to
// replica_num segments), places objects in it itself and publishes them (publish()): complete at
// once. Records (record.h): with config.record_headers, every piece starts with a record the
// writer writes; the master wipes it (RecordWiper) before the memory can be reused.
//
// Failover (master_rebuild.cc): a master is a standby, rebuilding, or serving. A new leader (or a
// restarted single master) rebuilds its metadata from the records clients report; until then it
// serves registration calls only.
//
// Threading: every public method is thread-safe (one mutex; every operation is O(1) in the number
// of objects except removeByRegex/removeAll, rebuilds and the bounded eviction walk). Time comes
// from config.clock, so tests advance a fake clock instead of sleeping. Maintenance runs when
// runMaintenance() is called, or periodically after startBackground().
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "store/master/error_codes.h"
#include "store/master/master_types.h"
#include "store/master/offset_allocator.h"

namespace mooncake::store {

class MasterService {
 public:
  struct ReplicaList {
    uint64_t size = 0;
    std::vector<ReplicaPlacement> replicas;  // complete replicas only
    uint64_t lease_ttl_ms = 0;
  };

  explicit MasterService(MasterConfig config = {});
  ~MasterService();
  MasterService(const MasterService&) = delete;
  MasterService& operator=(const MasterService&) = delete;

  const MasterConfig& config() const { return config_; }

  // ---- segments and clients ----
  // Lends [base, base + size) of client_id's memory to the store. Names are unique among
  // mounted segments: mounting the same (client, name, base, size) again returns the existing id
  // (a retried RPC), anything else under a mounted name is SEGMENT_ALREADY_EXISTS.
  // record_tag: the tag of the records in the segment (record.h; 0: it holds none).
  // will_report: its owner will report the records it holds (after a failover); until that
  // report ends, no new object is placed in the segment.
  ErrorOr<SegmentId> mountSegment(const std::string& client_id, const std::string& name,
                                  uint64_t base, uint64_t size, uint64_t record_tag = 0,
                                  bool will_report = false);
  // Drops every replica on the segment, then forgets it. Unknown id: OK (idempotent, as
  // Mooncake); a segment of another client: ILLEGAL_CLIENT.
  ErrorCode unmountSegment(const std::string& client_id, SegmentId id);
  ErrorCode unmountSegmentByName(const std::string& client_id, const std::string& name);
  std::vector<MountedSegmentInfo> segments() const;
  // Refreshes the client's liveness. Returns need_remount = true when the master did not know the
  // client (first contact or expired), or when one of `segment_names` (the segments the client
  // says it has mounted) is not mounted here under this client: other calls of a client the
  // master expired make it known again, but never mount its segment.
  ErrorOr<bool> heartbeat(const std::string& client_id,
                          const std::vector<std::string>& segment_names = {});
  // The client's engine is gone (its process died or its link broke: the master's engine or a
  // peer saw it). Its segments stop being allocation targets at once; everything else follows
  // the usual rules (its objects stay readable where their holder still answers, and it
  // expires after client_ttl_ms of silence). A later call from the client undoes this.
  void clientGone(const std::string& client_id);

  // ---- two-phase put ----
  // Reserves `size` bytes on up to config.replica_num distinct segments (distinct clients first;
  // fewer replicas when fewer segments have room; a replica too large for any one segment is
  // striped). client_id may be empty (then only put_release_timeout_ms reclaims a lost put).
  // *token (optional): names this put for putEnd / putRevoke.
  ErrorOr<std::vector<ReplicaPlacement>> putStart(const std::string& client_id,
                                                  const std::string& key, uint64_t size,
                                                  const ReplicateConfig& config,
                                                  uint64_t* token = nullptr);
  // token != 0: only the put putStart named so (else OBJECT_NOT_FOUND: the key is another
  // put's now); 0: the writer's put of the key, whichever it is.
  ErrorCode putEnd(const std::string& client_id, const std::string& key, uint64_t token = 0);
  // writes_pending: the writer's WRITEs timed out and may still land. The key goes at once, its
  // memory stays allocated until the writer releases *hold (releaseHolds, once its writes
  // finished) or put_release_timeout_ms passed; *hold is 0 when nothing was kept.
  ErrorCode putRevoke(const std::string& client_id, const std::string& key,
                      bool writes_pending = false, uint64_t* hold = nullptr, uint64_t token = 0);
  // A revoked put's or upsert's writer says its late writes finished: their memory is freed.
  void releaseHolds(const std::string& client_id, const std::vector<uint64_t>& holds);

  // ---- upsert: replace an object atomically (master_upsert.cc) ----
  // Starts writing `size` bytes as key's new value; *upsert_id names this upsert for End and
  // Revoke. An absent key (or one whose put/upsert is still PROCESSING: that writer is
  // preempted, its memory reserved until put_release_timeout_ms after it started) becomes a
  // PROCESSING object as with putStart. A complete object gets new replicas reserved and
  // returned while readers keep getting the old ones; upsertEnd swaps them in at once, and the
  // old replicas' memory stays quarantined while a read lease granted before the swap lasts. So
  // a reader gets the old bytes or the new ones, never a mix, and the key never disappears.
  // A second upsert of the key preempts the first (whose End then fails with INVALID_WRITE).
  // Pins: hard stays hard; soft follows config (keep_soft_pin keeps the old object's).
  ErrorOr<std::vector<ReplicaPlacement>> upsertStart(const std::string& client_id,
                                                     const std::string& key, uint64_t size,
                                                     const ReplicateConfig& config,
                                                     uint64_t* upsert_id);
  ErrorCode upsertEnd(const std::string& client_id, const std::string& key, uint64_t upsert_id);
  // writes_pending, *hold: as putRevoke's (the staged replicas' memory is held).
  ErrorCode upsertRevoke(const std::string& client_id, const std::string& key,
                         uint64_t upsert_id, bool writes_pending = false,
                         uint64_t* hold = nullptr);
  // Drops the replicas of keys this client wrote: all of them (the object is removed) when
  // segment_name is empty, else only those with a piece on that segment (an object left with
  // none is removed). Keys that are absent, written by another client, leased, not complete or
  // being upserted are skipped. Returns the keys that were cleared.
  std::vector<std::string> batchReplicaClear(const std::string& client_id,
                                             const std::vector<std::string>& keys,
                                             const std::string& segment_name);

  // ---- reads ----
  ErrorOr<ReplicaList> getReplicaList(const std::string& key);
  std::vector<ErrorOr<ReplicaList>> batchGetReplicaList(const std::vector<std::string>& keys);
  ErrorOr<bool> exists(const std::string& key);
  std::vector<ErrorOr<bool>> batchExists(const std::vector<std::string>& keys);
  ErrorOr<uint64_t> getSize(const std::string& key);

  // ---- removal ----
  // force ignores a read lease: the key is gone at once, but the object's memory stays
  // allocated (quarantined) until the lease lapses, so a reader's transfer still in flight
  // never sees it reused. A PROCESSING object is never removed (REPLICA_IS_NOT_READY): its
  // writer may still be writing into the reserved memory.
  ErrorCode remove(const std::string& key, bool force = false);
  ErrorOr<uint64_t> removeByRegex(const std::string& regex, bool force = false);
  uint64_t removeAll(bool force = false);

  // ---- one round trip per put: slabs (master_slab.cc) ----
  // Reserves `bytes` (rounded up to the granularity; less when max_slab_bytes or max_slab_share
  // of the largest segment says so, but never below min_bytes) on up to replica_num distinct
  // segments, distinct clients first, after retiring the writer's slabs in `retire`.
  // NO_AVAILABLE_HANDLE when no segment allows a slab of min_bytes, or when not even one extent
  // fits after an eviction round.
  ErrorOr<SlabGrant> allocSlab(const std::string& client_id, uint32_t replica_num, uint64_t bytes,
                               const std::vector<uint64_t>& retire = {}, uint64_t min_bytes = 0);
  // Publishes objects the writer wrote into its slabs: each is cut out of every extent of its
  // slab and becomes a complete object (visible to every reader once this returns). Per item:
  // OK, OBJECT_ALREADY_EXISTS, INVALID_KEY, INVALID_PARAMS (bad size or a range outside the slab
  // or already published), ILLEGAL_CLIENT (not the caller's slab), OBJECT_NOT_FOUND (no such slab
  // any more: retired, expired, lost with a segment or with the previous master).
  std::vector<ErrorCode> publish(const std::string& client_id,
                                 const std::vector<PublishItem>& items);
  void retireSlabs(const std::string& client_id, const std::vector<uint64_t>& ids);

  // ---- failover (master_rebuild.cc) ----
  MasterRole role() const { return role_.load(std::memory_order_acquire); }
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  // Serves at once under `epoch` (a master that can have no predecessor: embedded, tests).
  // The constructor does this with a random epoch.
  void startServing(uint64_t epoch);
  // Forgets every object, segment, client and slab: this master stands by.
  void becomeStandby();
  // This master leads (or restarted) with a new epoch: it forgets what it knew and rebuilds its
  // metadata from what the clients report; until then only registration calls are served.
  void beginRebuild(uint64_t epoch, RebuildPolicy policy);
  // Clients that are members of the cluster (their etcd keys): the rebuild waits for them.
  void setExpectedClients(std::vector<std::string> clients);
  // Ends the rebuild when its policy allows; true when (now) serving.
  bool pollRebuild();
  // A client's committed records in its segment `segment_name` (reported in parts; `last`
  // ends it). `pending`: uncommitted records it saw (puts that never ended: revoked).
  // During a rebuild the records are kept until it ends; later (a client that came back late)
  // the replicas they describe are added at once where they do not conflict.
  ErrorCode reportObjects(const std::string& client_id, const std::string& segment_name,
                          std::vector<ReportedPiece> records, uint64_t pending, bool last);
  // Counts a leadership this master won (metrics); failover: a previous leader existed.
  void noteElection(bool failover);

  // ---- records (record.h) ----
  // Wipes the record at the start of a piece's memory before the memory is handed out again.
  // Called with the service's lock held: must not block. Returns true when the record is wiped
  // (or nothing needs wiping); false when it started an asynchronous wipe, and then calls
  // wipeDone(token) once it finished (or failed: the memory is released anyway).
  class RecordWiper {
   public:
    virtual ~RecordWiper() = default;
    virtual bool wipe(const std::string& client_id, uint64_t address, uint64_t token) = 0;
  };
  void setRecordWiper(RecordWiper* wiper);  // nullptr: records are not wiped
  void wipeDone(uint64_t token);

  // ---- maintenance ----
  // Expires silent clients, releases timed-out puts and quarantined memory, demotes lapsed soft
  // pins, and evicts if usage is above the high watermark.
  void runMaintenance();
  void startBackground(std::chrono::milliseconds period);
  void stopBackground();

  MasterMetrics metrics() const;
  // Cross-checks every index against the others (allocators, per-segment object sets, LRU
  // lists, counters); O(everything). For tests: false means a bookkeeping bug.
  bool checkInvariants() const;

  // ---- RPC ----
  // Decodes a store.proto RequestEnvelope, runs the call, returns the encoded ResponseEnvelope.
  // Never throws and never crashes on malformed input: undecodable bytes produce a response with
  // error_code INVALID_PARAMS. Transport-agnostic: the caller moves the bytes.
  // caller: the identity of the client that sent it, taken from its authenticated connection
  // (engine::TransferEngine::authenticatedName). A call whose body names another client_id is
  // ILLEGAL_CLIENT: a client acts only on its own segments, puts and liveness. nullptr: a
  // client in this process (embedded master), trusted.
  std::string handle(std::string_view request_bytes, const std::string* caller = nullptr);

 private:
  struct Segment;
  struct Object;
  struct Slab;
  struct PieceRec {
    Segment* seg;
    OffsetAllocator::Allocation alloc;
    uint64_t length;
    uint64_t record_bytes = 0;  // the record in front of the bytes (0: none)
  };
  struct Replica {
    std::vector<PieceRec> pieces;
  };
  enum class ListId : uint8_t { kNone, kNormal, kSoft };
  struct Object {
    const std::string* key = nullptr;  // the objects_ map's key
    uint64_t size = 0;
    bool complete = false;
    bool soft_pin = false;  // still asked for; soft_pin_deadline says whether it holds
    bool hard_pin = false;
    std::vector<Replica> replicas;
    TimePoint put_start{};
    TimePoint lease_deadline{};
    TimePoint soft_pin_deadline{};
    std::string writer;
    uint64_t put_token = 0;  // putStart's (0: made otherwise)
    ListId list = ListId::kNone;
    std::list<Object*>::iterator lru_it;   // valid while list != kNone
    std::list<Object*>::iterator proc_it;  // valid while !complete
    uint64_t soft_pin_ttl_ms = 0;          // 0: config_.soft_pin_ttl_ms
    // Upserts (master_upsert.cc). upsert_id: of the upsert that created this PROCESSING object,
    // or of the one writing `staged` (0: none). staged: the replacement replicas of a complete
    // object, written by upsert_writer while readers still get `replicas`.
    uint64_t upsert_id = 0;
    std::vector<Replica> staged;
    uint64_t staged_size = 0;
    ReplicateConfig staged_config;
    std::string upsert_writer;
    TimePoint upsert_start{};
    std::list<Object*>::iterator upsert_it;  // in upserting_ while !staged.empty()
  };
  struct Segment {
    SegmentId id = 0;
    std::string name;
    std::string client_id;
    uint64_t base = 0;
    bool owner_gone = false;  // see clientGone()
    uint64_t record_tag = 0;  // 0: no records in this segment
    bool awaiting_report = false;  // its owner still reports what it holds: no new objects
    OffsetAllocator alloc;
    std::unordered_set<Object*> objects;  // objects with a piece here
    std::unordered_set<Slab*> slabs;      // slabs with an extent here
    Segment(uint64_t size, uint64_t granularity) : alloc(size, granularity) {}
  };
  struct Client {
    TimePoint last_seen{};
    bool gone = false;  // clientGone() until it calls again
    std::vector<SegmentId> segments;
    std::unordered_set<Object*> pending_puts;
    std::unordered_set<Object*> pending_upserts;  // complete objects it is upserting
    std::unordered_set<uint64_t> slabs;
    bool reported = false;  // its report (rebuild) ended
  };
  struct Quarantined {
    Segment* seg;
    OffsetAllocator::Allocation alloc;
    TimePoint release_at;
    uint64_t wipe_token = 0;  // an asynchronous record wipe still running (0: none)
    bool wipe_at_release = false;  // wipe the record when release_at passes, then free
    uint64_t hold = 0;             // a revoked put's: its writer releases it (putRevoke)
    std::string holder = {};       // that writer
  };
  struct SlabExtent {
    Segment* seg = nullptr;  // nullptr once its segment was unmounted
    uint64_t start = 0;      // segment offset of the extent's first byte
    std::map<uint64_t, OffsetAllocator::Allocation> blocks;  // unpublished parts, by offset
  };
  struct Slab {
    uint64_t id = 0;
    std::string writer;
    uint64_t bytes = 0;
    bool broken = false;  // a segment of it was unmounted: nothing more is published from it
    std::vector<SlabExtent> extents;
  };
  struct Staged {  // a reported record kept until the rebuild ends
    SegmentId seg;
    ReportedPiece rec;
  };

  TimePoint now() const { return config_.clock ? config_.clock() : MasterClock::now(); }
  ErrorCode checkKey(const std::string& key) const;
  Client& touchClientLocked(const std::string& client_id, TimePoint now, bool* was_new);

  // Placement (master_space.cc).
  bool allocateReplica(const std::string& key, uint64_t size,
                       const std::vector<std::string>& preferred,
                       std::unordered_set<Segment*>* used_segments,
                       std::unordered_set<std::string>* used_clients, Replica* out);
  std::vector<Replica> allocateReplicas(const std::string& key, uint64_t size,
                                        const ReplicateConfig& config);
  // wipe: the piece held a committed record that must be wiped before the memory is reused
  // (quarantined until an asynchronous wipe ends).
  // Asks the wiper to wipe the record at the start of `a`: 0 when it is done (or there is no
  // wiper), else the token wipeDone() will bring.
  uint64_t startWipeLocked(const Segment* seg, const OffsetAllocator::Allocation& a);
  void freePiece(const PieceRec& p, bool wipe = false);
  // Slab and upsert ids start from a random base in every master and serving term: a request
  // built for an earlier master (a writer that waited out a failover) names no slab or upsert
  // of this one.
  void reseedIdsLocked();
  // freePiece, or (until given) the record wiped now and the memory quarantined until then.
  void releasePieceLocked(const PieceRec& p, bool wipe, const TimePoint* until);
  ReplicaPlacement describe(const Replica& r) const;
  uint64_t recordBytesFor(const Segment* s, const std::string& key) const;
  // Slabs (master_slab.cc).
  void retireSlabLocked(Slab* slab);
  bool allocateWhole(uint64_t size, std::unordered_set<Segment*>* used_segments,
                     std::unordered_set<std::string>* used_clients, PieceRec* out);
  // Rebuild (master_rebuild.cc).
  void clearAllLocked();
  void finishRebuildLocked(TimePoint now);
  bool rebuildDoneLocked(TimePoint now) const;
  void addReportedLocked(std::vector<Staged> staged, bool late);

  // Object bookkeeping.
  void linkLru(Object* o, TimePoint now);
  void unlinkLru(Object* o);
  void touchLru(Object* o, TimePoint now);
  // Frees (or, with quarantine_until set, quarantines) the object's memory and forgets it.
  void destroyObjectLocked(Object* o, const TimePoint* quarantine_until = nullptr);
  // Gives the quarantined ranges from index `first` on to a new hold of client_id (returned).
  uint64_t holdQuarantinedLocked(size_t first, const std::string& client_id);
  // Drops o's staged replicas (another writer's upsert: reserved until its own timeout), so
  // that what destroyObjectLocked quarantines from the index returned on is o's replicas only.
  size_t quarantineMarkLocked(Object* o);
  // remove()'s way out: destroys o, quarantining its memory while a read lease holds.
  void removeLocked(Object* o, TimePoint now);
  ErrorOr<ReplicaList> getReplicaListLocked(const std::string& key, TimePoint now);
  ErrorOr<bool> existsLocked(const std::string& key, TimePoint now);
  uint64_t softPinTtlMs(const Object* o) const {
    return o->soft_pin_ttl_ms != 0 ? o->soft_pin_ttl_ms : config_.soft_pin_ttl_ms;
  }
  // PROCESSING -> COMPLETE (putEnd, and upsertEnd of an upsert that created the key).
  void completeLocked(Object* o, TimePoint now);
  // A new PROCESSING object for key (putStart, and upserts of absent keys).
  Object* createLocked(const std::string& client_id, const std::string& key, uint64_t size,
                       const ReplicateConfig& config, std::vector<Replica> replicas,
                       TimePoint now);
  // Upserts (master_upsert.cc). Drops o's staged replicas: quarantined until quarantine_until
  // when given (their writer may still be writing), else freed.
  void dropStagedLocked(Object* o, const TimePoint* quarantine_until);
  static bool hasPieceOn(const Object* o, const Segment* s);
  void grantLease(Object* o, TimePoint now);
  bool leased(const Object* o, TimePoint now) const { return o->lease_deadline > now; }
  uint64_t removeMatchingLocked(const std::function<bool(const std::string&)>& match, bool force);

  // Segments and clients.
  void unmountLocked(Segment* seg);
  // Drops o's replicas that have a piece on seg (their pieces freed); returns how many.
  // *touched gets every segment that held a piece of a dropped replica.
  size_t dropReplicasOnLocked(Object* o, const Segment* seg, std::vector<Segment*>* touched,
                              bool seg_gone = false);
  // o leaves the index of every segment in `touched` on which it has no piece left.
  static void unindexLocked(Object* o, const std::vector<Segment*>& touched);
  void expireClientLocked(const std::string& client_id);

  // Eviction (master_space.cc).
  bool aboveWatermark(uint64_t extra_bytes) const;
  void demoteLapsedSoftPinsLocked(TimePoint now);
  uint64_t evictLocked(TimePoint now, uint64_t need_bytes);

  void backgroundLoop(std::chrono::milliseconds period);
  void fillRpcStats(MasterMetrics* m) const;  // master_rpc.cc

  MasterConfig config_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<Object>> objects_;
  std::list<Object*> lru_;       // complete, unpinned; front = most recently used
  std::list<Object*> soft_lru_;  // complete, soft-pinned
  std::unordered_map<SegmentId, std::unique_ptr<Segment>> segments_;
  std::unordered_map<std::string, SegmentId> segment_by_name_;
  std::vector<Segment*> segment_order_;  // mount order; placement walks it round robin
  size_t rr_cursor_ = 0;
  SegmentId next_segment_id_ = 1;
  std::unordered_map<std::string, Client> clients_;
  std::vector<Quarantined> quarantine_;
  uint64_t used_bytes_ = 0;
  uint64_t capacity_bytes_ = 0;
  // PROCESSING objects in putStart order (the clock is monotonic), so maintenance finds the
  // timed-out ones at the front without scanning every object.
  std::list<Object*> processing_;
  std::list<Object*> upserting_;  // complete objects with staged replicas, by upsert_start
  uint64_t next_upsert_id_ = 1;  // from a random base per serving term (reseedIdsLocked)
  uint64_t next_hold_ = 1;       // likewise (putRevoke's holds)
  uint64_t next_put_token_ = 1;  // putStart's tokens
  uint64_t hard_pinned_count_ = 0;
  MasterMetrics counters_;  // counter fields only; gauges are filled in by metrics()

  std::unordered_map<uint64_t, std::unique_ptr<Slab>> slabs_;
  uint64_t next_slab_id_ = 1;    // from a random base per serving term (reseedIdsLocked)
  RecordWiper* wiper_ = nullptr;
  uint64_t next_wipe_token_ = 1;

  // Failover.
  std::atomic<MasterRole> role_{MasterRole::kServing};
  std::atomic<uint64_t> epoch_{0};
  RebuildPolicy rebuild_policy_;
  TimePoint rebuild_start_{};
  TimePoint last_registration_{};
  std::unordered_set<std::string> expected_clients_;
  std::vector<Staged> staged_;

  // Per-method RPC statistics of handle(), indexed by the proto Method number.
  static constexpr int kRpcMethods = 24;
  struct RpcCounters {
    std::atomic<uint64_t> calls{0}, errors{0}, total_ns{0};
    std::array<std::atomic<uint64_t>, MasterMetrics::kLatencyBuckets> buckets{};
  };
  std::array<RpcCounters, kRpcMethods> rpc_stats_;

  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  bool bg_stop_ = false;
  std::thread bg_thread_;
};

}  // namespace mooncake::store
