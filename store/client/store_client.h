// StoreClient: the data path of the store. It lends a segment of its engine's registered memory
// to the store (mount), stays registered at the master (heartbeat thread; it reconnects, registers
// again and reports what its segment holds when the master restarted or another took over), and
// moves object bytes client-to-client through the engine:
//   put     = (space from a slab the master reserved for this writer) -> one engine batch writing
//             record + bytes to every replica -> PUBLISH (the one round trip to the master) ->
//             commit word written into each record (store/master/record.h);
//             objects too large for a slab, or with a preferred segment: PutStart -> write ->
//             PutEnd -> commit (two round trips);
//   get     = GetReplicaList -> READ from the first replica, falling back to the next one when a
//             transfer fails (holder dead);
//   getInto = the same, straight into the caller's buffer: one engine transfer, no copy.
// Batch put: one engine batch and one PUBLISH for the whole batch.
// Pieces in this client's own segment are copied with memcpy; same-host peers are reached over
// shared memory by the engine, others over tcp.
//
// Master: an embedded one (called directly), a rendezvous the caller owns, or an address the
// client connects to itself and follows across restarts and failovers (`master_address`:
// "host:port" of a master's rendezvous, or "etcd://host:port[;host:port...]" to find the leader
// of cluster `cluster_id` in etcd). While no master serves, calls wait and retry within their
// deadline (rpc_timeout_ms); calls whose request may have been served by a master that then
// died answer RPC_FAIL at once; no call waits past its deadline.
//
// Peers are found by name: a piece's client_id is the owner's engine name, published in the
// (current master's) rendezvous as "mc/seg/<name>".
//
// Threading: every method is thread-safe. Lifetime: the engine, a rendezvous and a local master
// passed to create() must outlive the client.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/device/device.h"
#include "engine/engine.h"
#include "store/client/rpc.h"
#include "store/master/error_codes.h"
#include "store/master/master_types.h"
#include "store/master/record.h"

namespace mooncake::store {

// ReplicateConfig on the wire (shared by the client's source files).
void toProto(const ReplicateConfig& c, proto::ReplicateConfig* p);
// The pin flags a put's records carry (record.h).
uint8_t recordFlagsOf(const ReplicateConfig& c);

// What a put's late WRITEs may still read (StoreClient::Held): its records, moved in (a
// vector's elements stay where they are), and the value when the client made it (`src_owner`).
inline std::function<std::shared_ptr<void>()> heldWith(std::vector<std::string>& records,
                                                       std::shared_ptr<void> src_owner) {
  return [&records, src_owner] {
    return std::make_shared<std::pair<std::vector<std::string>, std::shared_ptr<void>>>(
        std::move(records), src_owner);
  };
}

namespace ha {
class EtcdClient;
}

struct StoreClientOptions {
  uint64_t segment_size = 0;            // bytes lent to the store; 0: mount nothing
  int64_t rpc_timeout_ms = 5000;        // per call, retries included
  int64_t transfer_timeout_ms = 10000;  // per engine batch
  bool publish_engine = true;           // publish the engine's segment in the rendezvous
  // connect(): "host:port" or "etcd://host:port[;host:port]".
  std::string master_address;
  std::string secret;            // presented to the masters' rendezvous (the job secret)
  std::string cluster_id;        // etcd: the store cluster (mooncake_master --cluster-id)
  int64_t etcd_lease_ttl_s = 3;  // etcd: TTL of this client's membership key
  bool use_slabs = true;         // the one-round-trip put path
  // Where the segment is allocated: -1 host memory, N >= 0 GPU memory of device N (the
  // engine's device layer), kSegmentDeviceFromParams: as MC_STORE_SEGMENT_DEVICE says.
  static constexpr int kSegmentDeviceFromParams = -2;
  int segment_device = kSegmentDeviceFromParams;
};

class StoreClient {
 public:
  // local_master: a MasterService in this process to call directly (embedded master sharing
  // this engine); nullptr: find the master through `rdv` ("mc/seg/mooncake-master").
  static ErrorOr<std::unique_ptr<StoreClient>> create(engine::TransferEngine* engine,
                                                      engine::Rendezvous* rdv,
                                                      MasterService* local_master,
                                                      StoreClientOptions options);
  // Connects to options.master_address (see above) and follows it across restarts and
  // failovers. why (optional) gets a sentence when it fails.
  static ErrorOr<std::unique_ptr<StoreClient>> connect(engine::TransferEngine* engine,
                                                       StoreClientOptions options,
                                                       std::string* why = nullptr);
  ~StoreClient();
  // Unmounts the segment and stops the heartbeat. Idempotent.
  void close();

  const std::string& clientId() const { return client_id_; }
  // The epoch of the master this client is registered with (0: none right now).
  uint64_t masterEpoch() const;
  // Times this client registered again after losing its master.
  uint64_t reconnects() const { return reconnects_.load(); }

  // Time spent in each step of this thread's last put() (benchmarks/store_put_profile.cc):
  // reserving space (slab path: from the slab, or ALLOC_SLAB; classic: PutStart), writing the
  // bytes, the round trip that publishes (PUBLISH or PutEnd), and the commit.
  struct PutPhases {
    bool slab = false;
    int64_t alloc_ns = 0, write_ns = 0, publish_ns = 0, commit_ns = 0;
  };
  static PutPhases lastPutPhases();

  // ---- writes ----
  ErrorCode put(const std::string& key, const void* data, size_t size,
                const ReplicateConfig& config = {});
  // One object from several buffers, concatenated.
  ErrorCode putParts(const std::string& key,
                     const std::vector<std::pair<const void*, size_t>>& parts,
                     const ReplicateConfig& config = {});
  std::vector<ErrorCode> batchPut(const std::vector<std::string>& keys,
                                  const std::vector<std::pair<const void*, size_t>>& values,
                                  const ReplicateConfig& config = {});

  // ---- upserts (store_client_ext.cc): replace the value; readers get the old bytes or the
  // new ones, never a mix (MasterService::upsertStart). INVALID_WRITE: a later upsert of the
  // key preempted this one.
  ErrorCode upsertParts(const std::string& key,
                        const std::vector<std::pair<const void*, size_t>>& parts,
                        const ReplicateConfig& config = {});
  ErrorCode upsert(const std::string& key, const void* data, size_t size,
                   const ReplicateConfig& config = {}) {
    return upsertParts(key, {{data, size}}, config);
  }

  // ---- put sessions (client_session.cc): upstream's layer-wise put. Start places the object
  // (PutStart); ranges write bytes of it straight from the caller's memory (registered
  // buffers), over as many calls as it takes; end publishes it (records, PutEnd, commit words:
  // the classic put's protocol) once every byte was written; revoke drops it. Readers see
  // nothing before end. One session per key in a client. A session must end within the time
  // the master keeps an unfinished put (MC_STORE_PUT_RELEASE_TIMEOUT_S), less a transfer
  // deadline: later ranges and ends are LEASE_EXPIRED. A session whose master changed or forgot
  // this client meanwhile: RPC_FAIL; so are ranges while the client has not heard from its
  // master for half the client TTL (the master may be expiring it).
  // OBJECT_ALREADY_EXISTS: the key exists, or this client has a session of it open.
  // One master call for every key (BatchPutStart); per key.
  std::vector<ErrorCode> putSessionStart(const std::vector<std::string>& keys,
                                         const std::vector<uint64_t>& sizes,
                                         const ReplicateConfig& config = {});
  struct SourceRange {
    const void* src;
    uint64_t dst_offset;  // where in the object
    uint64_t length;
  };
  // For key i, each of ranges[i] writes object bytes [dst_offset, dst_offset + length) from
  // src; one engine batch for every key. Per key: the bytes written, or why not:
  // OBJECT_NOT_FOUND (no session open), INVALID_PARAMS (no ranges, an empty one, a null src, a
  // range past the object: nothing of that key is written), TRANSFER_FAIL (the session can
  // then only be revoked; ending it revokes it too).
  std::vector<ErrorOr<uint64_t>> putSessionRanges(
      const std::vector<std::string>& keys, const std::vector<std::vector<SourceRange>>& ranges);
  // Publishes the objects: the records of all in one engine batch, one BatchPutEnd, the
  // commit words. Per key: INVALID_WRITE when some bytes of it were never written, RPC_FAIL
  // when no heartbeat was answered lately (the session stays open for both); any other
  // failure ends the session (revoked when the master still has it).
  std::vector<ErrorCode> putSessionEnd(const std::vector<std::string>& keys);
  ErrorCode putSessionRevoke(const std::string& key);

  // ---- reads ----
  ErrorOr<std::string> get(const std::string& key);
  // Reads into [buf, buf + capacity); returns the object size. BUFFER_OVERFLOW if it is larger.
  // `buf_owner`: what keeps buf valid (a slice of this client's local buffer): the engine holds
  // it past a read that timed out (it still lands when the holder resumes). Null: the caller's
  // memory, which such a read may still write after this returned (docs/store.md).
  ErrorOr<uint64_t> getInto(const std::string& key, void* buf, size_t capacity,
                            const std::shared_ptr<void>& buf_owner = nullptr);
  // The same for several keys; `bufs_owner` keeps every buffer valid.
  std::vector<ErrorOr<uint64_t>> batchGetInto(const std::vector<std::string>& keys,
                                              const std::vector<std::pair<void*, size_t>>& bufs,
                                              const std::shared_ptr<void>& bufs_owner = nullptr);
  std::vector<ErrorOr<std::string>> batchGet(const std::vector<std::string>& keys);

  // Ranged reads (store_client_ext.cc): for one key, each range copies object bytes
  // [src_offset, src_offset + length) to dst; one replica-list call, one engine batch. A range
  // past the object's end is INVALID_PARAMS (the others still run); returns bytes per range.
  struct Range {
    uint64_t src_offset;
    uint64_t length;
    void* dst;
  };
  std::vector<ErrorOr<uint64_t>> getRanges(const std::string& key, const std::vector<Range>& ranges);
  // The same for several keys (ranges[i] of keys[i]): one replica-list call for all, the first
  // replica of every key in one engine batch; a key whose transfer failed reads its other
  // replicas alone. Per key, per range.
  std::vector<std::vector<ErrorOr<uint64_t>>> batchGetRanges(
      const std::vector<std::string>& keys, const std::vector<std::vector<Range>>& ranges);
  // Read sessions (upstream's batch_get_session_start / _end): the replica lists of keys a
  // caller is about to read in ranges, asked for once (one master call, which takes each
  // object's read lease); batchGetRanges reads from them while half the lease is left (the
  // values as they were at the start: the lease keeps their memory), and asks again after,
  // or when this client re-registered, removed or upserted the key since. Per key: OK, or
  // why it cannot be read (OBJECT_NOT_FOUND ...). A session pins nothing past the lease. End
  // forgets the keys' lists.
  std::vector<ErrorCode> readSessionStart(const std::vector<std::string>& keys);
  void readSessionEnd(const std::vector<std::string>& keys);
  // This client changed or removed the keys (all: a pattern): their session lists go.
  void forgetReadLists(const std::vector<std::string>* keys);

  // ---- replicas (store_client_ext.cc) ----
  // The complete replicas of a key, as the master placed them (a read: grants a lease).
  ErrorOr<proto::GetReplicaListResponse> replicaList(const std::string& key);
  // MasterService::batchReplicaClear for this client: the keys cleared.
  ErrorOr<std::vector<std::string>> batchReplicaClear(const std::vector<std::string>& keys,
                                                      const std::string& segment_name);
  // OK when the master answers (a heartbeat).
  ErrorCode ping();

  // ---- metadata ----
  ErrorOr<bool> exists(const std::string& key);
  std::vector<ErrorOr<bool>> batchExists(const std::vector<std::string>& keys);
  ErrorOr<uint64_t> getSize(const std::string& key);
  ErrorCode remove(const std::string& key, bool force = false);
  ErrorOr<uint64_t> removeByRegex(const std::string& regex, bool force = false);
  ErrorOr<uint64_t> removeAll(bool force = false);

  // ---- caller buffers (put_from / get_into targets) ----
  ErrorCode registerBuffer(void* addr, size_t len);
  ErrorCode unregisterBuffer(void* addr);
  // True when [addr, addr+len) lies in a registered buffer (or in engine-allocated memory).
  bool isRegistered(const void* addr, size_t len) const;
  // memcpy, or the device layer's copy when either side is GPU memory (a registered buffer).
  ErrorCode copyLocal(void* dst, const void* src, size_t len) const;

 private:
  // The connection to the master that serves now.
  struct Link {
    std::shared_ptr<engine::Rendezvous> rdv;
    std::unique_ptr<MasterRpcClient> rpc;
    uint64_t epoch = 0;  // the master's epoch this client registered with
    std::atomic<bool> broken{false};
  };
  // A slab this writer places objects in (master_slab.cc).
  struct SlabState {
    uint64_t id = 0;
    uint64_t epoch = 0;
    uint64_t bytes = 0;
    uint64_t used = 0;  // bump pointer
    int inflight = 0;   // reservations not yet published or abandoned
    bool exhausted = false;
    struct Extent {
      std::string client_id;
      uint64_t address = 0;
      uint64_t record_tag = 0;
    };
    std::vector<Extent> extents;
  };
  struct SlabPool {
    std::shared_ptr<SlabState> cur, next;
    bool prefetching = false;
  };
  // Where a put writes one piece, and where its commit word goes.
  struct WriteTarget {
    std::string client_id;
    uint64_t record_address = 0;  // 0: no record
    uint64_t record_tag = 0;
    uint64_t data_address = 0;
    uint64_t piece_offset = 0, piece_length = 0;
    uint32_t replica_index = 0;
  };

  StoreClient() = default;
  // INVALID_KEY for an empty key or one over 4096 bytes.
  static ErrorCode checkKey(const std::string& key);
  // The bytes of `parts` as one buffer (*src): the part itself when there is one, else their
  // concatenation in *joined; *size: the total. INVALID_PARAMS for a null part with bytes.
  static ErrorCode gatherParts(const std::vector<std::pair<const void*, size_t>>& parts,
                               std::string* joined, const char** src, uint64_t* size);
  // The checks of a put or upsert (open client, key, parts, size > 0, replica_num <= 16), then
  // gatherParts.
  ErrorCode checkedValue(const std::string& key,
                         const std::vector<std::pair<const void*, size_t>>& parts,
                         const ReplicateConfig& config, std::string* joined, const char** src,
                         uint64_t* size) const;
  // What a call's transfers may still touch of its own memory once it stopped waiting for
  // them: built only then (a late batch keeps running, engine.h wait), and handed to the
  // engine, which drops it when the batch finished. Null: nothing of the call's own.
  using Held = std::function<std::shared_ptr<void>()>;
  // Submits `reqs` as one engine batch and waits (transfer_timeout_ms): one status per request.
  std::vector<Status> transferEach(const std::vector<engine::TransferRequest>& reqs,
                                   const Held& held = nullptr);
  // The same, with the first failure (OK when all succeeded).
  Status transferHeld(const std::vector<engine::TransferRequest>& reqs, const Held& held);
  // A put outside slabs or an upsert whose writes timed out: the master keeps their memory
  // under a hold (PutRevoke / UpsertRevoke writes_pending) until they finished.
  // Made (in *hold of heldLate) when the writes are handed over to the engine.
  struct LateHold {
    bool done = false;   // the engine dropped the owner since (the writes finished)
    uint64_t token = 0;  // the master's hold, once the revoke returned it
  };
  // `inner` for late writes into `slabs` (or a put's memory, with a LateHold made in *hold),
  // and one more reservation of each slab: a slab that a late write may still land in is not
  // handed back (the master would place other objects in its unpublished space), nor a hold
  // released, until the engine dropped the owner, after the writes finished.
  Held heldLate(Held inner, std::vector<std::shared_ptr<SlabState>> slabs,
                std::shared_ptr<LateHold>* hold = nullptr) const;
  // After a failed write: whether its writes still run (hold made and not done: the revoke
  // then says writes_pending), and the master's hold for them (0: none) once it returned.
  bool writesPending(const std::shared_ptr<LateHold>& hold);
  void holdGiven(const std::shared_ptr<LateHold>& hold, uint64_t token);
  // Hands the retired slabs and released holds back now (the heartbeat; slabs otherwise go
  // with the next put).
  void flushRetired(const std::shared_ptr<Link>& link);
  ErrorCode startHeartbeat();
  // ---- link (client_link.cc) ----
  // Calls the master that serves now, waiting for one (and retrying) within rpc_timeout_ms.
  // idempotent: a call whose request may have reached a master that died is retried too
  // (otherwise it answers RPC_FAIL).
  ErrorCode callMaster(proto::Method method, const google::protobuf::MessageLite& request,
                       google::protobuf::MessageLite* response, bool idempotent,
                       std::shared_ptr<Link>* used = nullptr);
  std::shared_ptr<Link> currentLink(engine::Deadline deadline);
  void markBroken(const std::shared_ptr<Link>& link);
  // Finds the master, connects, registers (mount + report when it is a new master).
  ErrorCode reconnect(std::string* why);
  ErrorOr<std::shared_ptr<Link>> openLink(std::string* why);
  ErrorCode registerWith(Link& link, bool need_remount, uint64_t epoch);
  ErrorCode mount(Link& link, bool will_report);
  ErrorCode reportRecords(Link& link);
  bool wipeOwnRecords();
  void heartbeatLoop();
  void membershipTick();
  // etcd: the leader key names another master than `link`'s (or none).
  bool leaderMoved(const Link& link);
  std::shared_ptr<engine::Rendezvous> rendezvous();
  // ---- writes (client_put.cc) ----
  // `src_owner`: what keeps src valid when this client made it (a joined value), else null
  // (the caller's memory: valid until the call returns; docs/store.md, Known limits).
  ErrorCode putOne(const std::string& key, const char* src, uint64_t size,
                   const ReplicateConfig& config, const std::shared_ptr<void>& src_owner = nullptr);
  ErrorCode putClassic(const std::string& key, const char* src, uint64_t size,
                       const ReplicateConfig& config,
                       const std::shared_ptr<void>& src_owner = nullptr);
  bool slabEligible(const std::string& key, uint64_t size, const ReplicateConfig& config) const;
  // Reserves `need` bytes in a slab with replica_num extents (asks the master for one when the
  // current is full); nullptr when no slab can be had.
  std::shared_ptr<SlabState> reserve(uint32_t replica_num, uint64_t need, uint64_t batch_bytes,
                                     uint64_t* offset, ErrorCode* why);
  void release(const std::shared_ptr<SlabState>& slab);
  // No more puts into `slab` (a write into it failed, or the master lost it): it is handed
  // back once none is in flight (the master keeps a broken slab's other extents until then).
  void abandon(uint32_t replica_num, const std::shared_ptr<SlabState>& slab);
  void abandonLocked(SlabPool& pool, const std::shared_ptr<SlabState>& slab);  // book_->mu held
  // Slab ids a call to the master carried that failed: sent again with a later one.
  void retireAgain(const google::protobuf::RepeatedField<uint64_t>& ids);
  void takeNextSlab(uint32_t replica_num, const proto::PublishResponse& resp);
  std::vector<uint64_t> takeRetired();
  ErrorCode writePieces(const std::vector<WriteTarget>& targets, const std::string& key,
                        uint64_t put_id, uint64_t size, uint8_t flags, const char* src,
                        std::vector<std::string>* records,
                        std::vector<engine::TransferRequest>* reqs);
  // Writes the commit word into every record of a published put; then checks that the master
  // that acknowledged it still serves (else the put's fate is unknown: RPC_FAIL).
  ErrorCode commit(const std::vector<WriteTarget>& targets, uint64_t put_id,
                   const std::shared_ptr<Link>& link);
  uint64_t newPutId();
  // Where to write each piece of `replicas` (as PutStart / UpsertStart placed them), records
  // included. INVALID_WRITE when the pieces do not tile [0, size).
  static ErrorCode targetsOf(const google::protobuf::RepeatedPtrField<proto::Replica>& replicas,
                             const std::string& key, uint64_t size, std::vector<WriteTarget>* out);
  // ---- put sessions (client_session.cc) ----
  struct PutSession {
    bool ready = false;   // PutStart answered (until then the key is only reserved)
    bool ending = false;  // an end or revoke claimed it: no more ranges
    int inflight = 0;     // range calls writing into it
    uint64_t size = 0;
    uint8_t flags = 0;
    uint64_t forgotten = 0;  // forgotten_ before PutStart
    uint64_t token = 0;      // PutStartResponse.put_token
    std::shared_ptr<Link> link;  // the link PutStart went over (its master's epoch)
    google::protobuf::RepeatedPtrField<proto::Replica> replicas;
    std::vector<WriteTarget> targets;
    std::chrono::steady_clock::time_point write_until;  // no range starts after this
    std::map<uint64_t, uint64_t> written;  // bytes written: [begin, end), merged
    ErrorCode failed = ErrorCode::OK;      // a range write failed: only revoke is left
    // Range writes that timed out and may still land: the master keeps the memory under a
    // hold until they finished. `late_owner` is what the engine keeps of them.
    std::shared_ptr<LateHold> hold;
    std::weak_ptr<void> late_owner;
  };
  // OK when the session may write into its put's memory now: LEASE_EXPIRED past write_until,
  // RPC_FAIL when its master forgot this client or may be expiring it.
  ErrorCode mayWrite(const PutSession& s) const;
  // Takes the key's session for an end or revoke once no range writes into it; null (and
  // *why) when there is none.
  std::shared_ptr<PutSession> claimSession(const std::string& key, ErrorCode* why);
  void dropSession(const std::string& key, const std::shared_ptr<PutSession>& s);
  // PutRevoke for a session (writes_pending when its late writes still run).
  ErrorCode revokeSession(const std::string& key, PutSession& s,
                          std::shared_ptr<Link> link = nullptr);
  // The record of piece `t` of a put (encodeRecord), for writePieces and a session's end.
  static void recordOf(const WriteTarget& t, const std::string& key, uint64_t put_id,
                       uint64_t size, uint8_t flags, std::string* out);
  // ---- peers and data (store_client.cc) ----
  // The engine peer for a piece's owner; kInvalidPeer for this client itself.
  ErrorOr<engine::PeerId> peerFor(const std::string& client_id);
  void forgetPeer(const std::string& client_id);
  // Appends the requests that move `size` bytes between `local` and a replica's pieces;
  // pieces of this client are copied at once. INVALID_READ if the pieces do not add up.
  ErrorCode planReplica(const proto::Replica& r, uint64_t size, engine::OpCode op, char* local,
                        std::vector<engine::TransferRequest>* reqs) {
    return planRange(r, size, op, 0, size, local, reqs);
  }
  // Appends the requests that move object bytes [off, off + len) of one replica between it
  // and local (op: kRead into local, kWrite from it); pieces of this client are copied at
  // once. INVALID_READ if the pieces do not add up to size; a piece of ours outside the
  // segment this client lent: INVALID_READ / INVALID_WRITE.
  ErrorCode planRange(const proto::Replica& r, uint64_t size, engine::OpCode op, uint64_t off,
                      uint64_t len, char* local, std::vector<engine::TransferRequest>* reqs);
  // Reads ranges[todo] of the object rl describes from its replicas [from, end): each replica
  // one engine batch, the next one after a failure; one that timed out ends it (its READs may
  // still land in the ranges' memory). OK, or why not.
  ErrorCode readRangesFrom(const proto::GetReplicaListResponse& rl,
                           const std::vector<Range>& ranges, const std::vector<size_t>& todo,
                           int from, bool* timed_out = nullptr);
  // ---- read sessions (store_client_ext.cc) ----
  struct ReadList {
    proto::GetReplicaListResponse rl;
    std::chrono::steady_clock::time_point asked;        // when it was asked for
    std::chrono::steady_clock::time_point fresh_until;  // half its read lease
    uint64_t forgotten = 0;  // forgotten_ before it was asked for (a new master: no lease)
  };
  // BatchGetReplicaList for `keys`: per key its list (an error code in rl when it has none).
  ErrorOr<std::vector<std::shared_ptr<const ReadList>>> fetchReadLists(
      const std::vector<std::string>& keys);
  // True when [address, address + len) lies inside this client's segment.
  bool inOwnSegment(uint64_t address, uint64_t len) const;
  // batchGetInto; a key whose first replica's read timed out goes on into fresh(i) (null, or
  // none given: it fails, TRANSFER_FAIL, as its READs may still land in bufs[i]).
  std::vector<ErrorOr<uint64_t>> batchRead(const std::vector<std::string>& keys,
                                           const std::vector<std::pair<void*, size_t>>& bufs,
                                           const std::shared_ptr<void>& bufs_owner,
                                           const std::function<void*(size_t)>& fresh);
  // `asked`: when the replica list was requested (the read lease runs from after it).
  // `buf_owner`: what keeps buf valid when this client made it (get's result), else null. A
  // replica whose read timed out ends it (TRANSFER_FAIL: its READs may still land in buf);
  // *late (optional) is then that replica's index + 1, else 0.
  ErrorCode readReplicas(const proto::GetReplicaListResponse& rl, void* buf, size_t skip_first,
                         std::chrono::steady_clock::time_point asked,
                         const std::shared_ptr<void>& buf_owner = nullptr,
                         size_t* late = nullptr);

  engine::TransferEngine* engine_ = nullptr;
  engine::Rendezvous* fixed_rdv_ = nullptr;  // create(): the caller's rendezvous
  MasterService* local_master_ = nullptr;
  StoreClientOptions options_;
  std::string client_id_;
  std::string segment_name_;
  void* segment_ = nullptr;
  bool segment_on_device_ = false;  // segment_ is GPU memory: host code never loads from it
  // Allocates segment_ (options_.segment_size bytes, where options_.segment_device says).
  ErrorCode allocateSegment(std::string* why);
  // Copies between this client's segment and host memory when the segment is GPU memory,
  // with memcpy when it is not (records and commit words: a few bytes).
  ErrorCode copySegment(void* dst, const void* src, size_t len) const;
  // Calls fn(offset, record) for every record in this client's segment (host or GPU memory);
  // false when part of a GPU segment could not be read (fn saw a prefix of the records).
  bool scanOwnRecords(const std::function<void(uint64_t, const RecordInfo&)>& fn);
  // segment_, pinned for the device layer's copies once a GPU buffer is registered (mu_).
  engine::device::PinnedRange segment_pin_;
  bool segment_pinned_ = false;  // tried (mu_)
  uint64_t record_tag_ = 0;
  std::atomic<bool> closed_{false};

  // etcd: leader lookup and this client's membership key.
  std::unique_ptr<ha::EtcdClient> etcd_;
  std::string etcd_endpoints_;
  int64_t member_lease_ = 0;
  std::chrono::steady_clock::time_point next_member_renew_{};

  mutable std::mutex link_mu_;
  std::condition_variable link_cv_;
  std::shared_ptr<Link> link_;
  bool reconnect_wanted_ = false;
  std::atomic<uint64_t> reconnects_{0};
  // Times a master forgot what this client had not finished (a new master, or the same one
  // expired it): put sessions started before are gone.
  std::atomic<uint64_t> forgotten_{0};
  // When (steady clock ticks) the last heartbeat that the master answered as this client's
  // live registration was sent: the master has not expired this client before client_ttl_ms
  // after it.
  std::atomic<int64_t> heard_{0};
  uint64_t registered_epoch_ = 0;  // the epoch whose master knows this client's segment
  // The last openLink met a master that refused this client's job secret: setup does not
  // retry that (the secret will not change).
  bool secret_refused_ = false;
  uint64_t reported_epoch_ = 0;    // the epoch whose master had this client's whole report
  std::mutex register_mu_;         // one registration at a time

  mutable std::mutex mu_;
  std::unordered_map<std::string, engine::PeerId> peers_;
  std::vector<std::pair<uintptr_t, size_t>> buffers_;  // registered caller buffers

  // Slab and hold bookkeeping that the owners of late writes (heldLate) share: they may
  // outlive this client.
  struct SlabBook {
    std::mutex mu;                  // also guards slabs_ and each SlabState
    std::vector<uint64_t> retired;  // slabs to hand back (sent with the next call)
    std::vector<uint64_t> released;  // holds whose late writes finished (LateHold)
    int late = 0;                   // owners of late writes (heldLate) not dropped yet
    std::condition_variable none_late;
    // A reservation of `slab` ends; an exhausted slab with none left is handed back.
    void unreserveLocked(SlabState& slab);
  };
  std::shared_ptr<SlabBook> book_ = std::make_shared<SlabBook>();
  std::map<uint32_t, SlabPool> slabs_;  // by replica_num
  std::mutex refill_mu_;                // one slab request at a time
  std::mutex rng_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
  uint64_t last_put_id_ = 0;  // newPutId(), under rng_mu_

  std::mutex read_mu_;
  std::unordered_map<std::string, std::shared_ptr<const ReadList>> read_lists_;

  std::mutex sessions_mu_;
  std::condition_variable sessions_cv_;  // a session's inflight fell
  std::unordered_map<std::string, std::shared_ptr<PutSession>> put_sessions_;

  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  std::atomic<uint64_t> client_ttl_ms_{10000};
  std::thread hb_thread_;
};

}  // namespace mooncake::store
