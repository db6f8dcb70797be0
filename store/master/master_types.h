// Value types of the store master's API: configuration, placement descriptors, metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mooncake::store {

using SegmentId = uint64_t;  // assigned by the master at mount, never reused; 0 is "none"
using MasterClock = std::chrono::steady_clock;
using TimePoint = MasterClock::time_point;
// The master's notion of "now". Injectable so tests advance time instead of sleeping.
using ClockFn = std::function<TimePoint()>;

// Mooncake's ReplicateConfig: how many copies, pinning, and where the first copy should go.
struct ReplicateConfig {
  uint32_t replica_num = 1;
  bool with_soft_pin = false;     // evicted only after every unpinned object (evicted last)
  bool with_hard_pin = false;     // never evicted; only remove() drops it
  std::string preferred_segment;  // segment name; empty: no preference
  // More preferred segments, in order (upstream's preferred_segments): each replica goes to
  // the first of preferred_segment, then these, that it can use (not holding a replica of the
  // object yet, with room), before any other segment.
  std::vector<std::string> preferred_segments;
  uint64_t soft_pin_ttl_ms = 0;   // with_soft_pin: how long it holds unread; 0: the master's
  // An upsert of a complete object keeps that object's soft pin (and its deadline) instead of
  // taking with_soft_pin (upstream's SoftPinAction.PRESERVE). Plain puts ignore it.
  bool keep_soft_pin = false;
};

// A contiguous piece of one replica, inside one mounted segment.
struct Piece {
  SegmentId segment_id = 0;
  std::string segment_name;
  std::string client_id;  // the client that mounted the segment (the engine peer to talk to)
  uint64_t offset = 0;    // from the segment's base
  uint64_t address = 0;   // where the bytes are, in the owner's address space
  uint64_t length = 0;    // bytes of the object held here (the pieces of a replica sum to size)
  // Non-zero when a record (record.h) precedes the bytes: the segment's record tag; the record
  // starts at address - recordBytes(key length).
  uint64_t record_tag = 0;
};

// One copy of an object: its pieces in object order (one piece unless striped).
struct ReplicaPlacement {
  std::vector<Piece> pieces;
};

// One extent of a writer's slab: `bytes` reserved at `address` in a segment (master_service.h).
struct SlabExtentInfo {
  SegmentId segment_id = 0;
  std::string segment_name;
  std::string client_id;
  uint64_t address = 0;
  uint64_t record_tag = 0;
};
struct SlabGrant {
  uint64_t id = 0;
  uint64_t bytes = 0;
  std::vector<SlabExtentInfo> extents;
};
// An object a writer placed in one of its slabs and asks the master to publish.
struct PublishItem {
  std::string key;
  uint64_t size = 0;
  uint64_t slab_id = 0;
  uint64_t offset = 0;  // of the record, from the slab's start
  uint64_t put_id = 0;
  bool soft_pin = false;
  bool hard_pin = false;
};
// A committed record a client found in its segment (record.h), as reported after a failover.
struct ReportedPiece {
  std::string key;
  uint64_t put_id = 0;
  uint64_t object_size = 0;
  uint64_t piece_offset = 0;
  uint64_t piece_length = 0;
  uint32_t replica_index = 0;
  uint8_t flags = 0;
  uint64_t offset = 0;  // of the record, from the segment's base
};

struct MountedSegmentInfo {
  SegmentId id = 0;
  std::string name;
  std::string client_id;
  uint64_t base = 0;
  uint64_t size = 0;
  uint64_t used = 0;
};

struct MasterConfig {
  uint64_t lease_ttl_ms = 5000;
  uint64_t soft_pin_ttl_ms = 30ull * 60 * 1000;  // a soft pin lapses after this long unread
  double eviction_high_watermark = 0.95;         // evict when used/capacity passes this
  double eviction_ratio = 0.05;                  // share of objects one eviction round frees
  uint64_t client_ttl_ms = 10000;                // silent clients are expired after this
  // A PROCESSING put older than this may be taken over by a new putStart of the same key; its
  // memory stays reserved until put_release_timeout_ms after its start (the old writer may still
  // be writing).
  uint64_t put_discard_timeout_ms = 30000;
  // A PROCESSING put older than this is revoked by maintenance and its memory freed.
  uint64_t put_release_timeout_ms = 600000;
  uint64_t alloc_granularity = 64;  // bytes; every piece starts at a multiple of it
  uint32_t max_replicas = 16;       // replica_num above this is INVALID_PARAMS
  uint32_t max_pieces_per_replica = 16;
  uint64_t min_stripe_bytes = 64 * 1024;  // smallest piece of a striped replica
  uint64_t max_key_length = 4096;         // longer keys are INVALID_KEY
  uint64_t max_regex_length = 4096;       // longer remove_by_regex patterns: INVALID_PARAMS
  // Every piece starts with a record (store/master/record.h) in segments that were mounted with
  // a record tag, so that a new master can rebuild from what the clients hold. The standalone
  // master turns it on; unit tests of the bookkeeping leave it off (allocations are then the
  // bare object sizes).
  bool record_headers = false;
  // Slabs (the one-round-trip put path): the largest a writer may reserve, and at most this
  // share of a segment's capacity per slab.
  uint64_t max_slab_bytes = 64ull << 20;
  double max_slab_share = 1.0 / 16;
  ClockFn clock;                          // empty: MasterClock::now
};

// Where a master stands (metrics, RPC gating).
enum class MasterRole : uint8_t {
  kStandby,     // not the leader: answers every call with UNAVAILABLE_IN_CURRENT_MODE
  kRebuilding,  // leader (or restarted single master) collecting what clients hold: only
                // registration calls are served, the rest answer UNAVAILABLE_IN_CURRENT_STATUS
  kServing,
};

// When a rebuild is over: every client expected to report has done so and no new client has
// registered for `quiet_ms`, or `timeout_ms` passed since it began.
struct RebuildPolicy {
  uint64_t quiet_ms = 500;
  uint64_t timeout_ms = 10000;
};

// Counters and gauges for /metrics. Gauges are current values, counters only grow.
struct MasterMetrics {
  // gauges
  uint64_t objects = 0;             // complete objects
  uint64_t processing_objects = 0;  // puts started, not ended
  uint64_t soft_pinned_objects = 0;
  uint64_t hard_pinned_objects = 0;
  uint64_t bytes_used = 0;  // reserved in segments, including PROCESSING and quarantined puts
  uint64_t bytes_capacity = 0;
  uint64_t segments = 0;
  uint64_t clients = 0;
  // counters
  uint64_t put_starts = 0;
  uint64_t put_ends = 0;
  uint64_t put_revokes = 0;  // explicit revokes plus puts revoked by client expiry / timeout
  uint64_t gets = 0;         // getReplicaList calls, batch entries counted one by one
  uint64_t get_hits = 0;
  uint64_t removes = 0;  // objects removed by remove/removeByRegex/removeAll
  uint64_t clients_gone = 0;  // clients whose engine the master saw go (clientGone)
  uint64_t evictions = 0;
  uint64_t evicted_bytes = 0;
  uint64_t eviction_rounds = 0;
  uint64_t allocation_failures = 0;  // putStart answered NO_AVAILABLE_HANDLE
  uint64_t client_expirations = 0;
  uint64_t replicas_dropped = 0;  // replicas lost with an unmounted segment
  uint64_t slabs = 0;             // gauge: slabs reserved by writers
  uint64_t slab_bytes = 0;        // gauge: bytes they still hold unpublished
  uint64_t slab_grants = 0;
  uint64_t publishes = 0;  // objects published from slabs (also counted in put_starts/put_ends)

  // Failover (counters unless noted).
  uint64_t epoch = 0;               // gauge: this master's epoch (0: standby)
  uint8_t role = 0;                 // gauge: MasterRole
  uint64_t leader_elections = 0;    // times this master became leader (filled by the binary)
  uint64_t failovers = 0;           // ... of those, taking over from a previous leader
  uint64_t rebuilds = 0;            // rebuilds completed
  double last_rebuild_seconds = 0;  // gauge: how long the last rebuild took
  uint64_t rebuild_clients = 0;     // clients that reported in rebuilds
  uint64_t objects_recovered = 0;   // objects rebuilt from client reports
  uint64_t objects_revoked = 0;     // puts found unfinished (or inconsistent) and dropped
  uint64_t records_wiped = 0;       // records wiped before their memory was reused

  // Per-RPC statistics of MasterService::handle(): calls, calls answered with an error, and
  // the total time spent serving them (decode + call + encode).
  struct RpcStat {
    std::string method;  // e.g. "PUT_START"
    uint64_t calls = 0;
    uint64_t errors = 0;
    uint64_t total_ns = 0;
    // Latency histogram: counts per bucket (upper bounds kLatencyBucketsUs, then +Inf).
    std::vector<uint64_t> buckets;
  };
  static constexpr double kLatencyBucketsUs[] = {5,    10,   20,   50,    100,   200,    500,
                                                 1000, 2000, 5000, 10000, 50000, 200000, 1000000};
  static constexpr int kLatencyBuckets = sizeof(kLatencyBucketsUs) / sizeof(double) + 1;
  std::vector<RpcStat> rpcs;

  // Prometheus text exposition (# HELP/# TYPE lines, mooncake_store_ prefix).
  std::string toPrometheus() const;
};

}  // namespace mooncake::store
