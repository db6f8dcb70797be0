// StoreClient: the data path of the store. It lends a segment of its engine's registered memory
// to the store (mount), keeps itself alive at the master (heartbeat thread, re-mounting when the
// master forgot it), and moves object bytes client-to-client through the engine:
//   put     = PutStart -> one engine batch of WRITEs of every piece to its owner -> PutEnd
//             (PutRevoke when a write fails);
//   get     = GetReplicaList -> READ from the first replica, falling back to the next one when a
//             transfer fails (holder dead);
//   getInto = the same, straight into the caller's buffer: one engine transfer, no copy.
// Pieces in this client's own segment are copied with memcpy; same-host peers are reached over
// shared memory by the engine, others over tcp.
//
// Peers are found by name: a piece's client_id is the owner's engine name, published in the
// rendezvous as "mc/seg/<name>".
//
// Threading: every method is thread-safe. Lifetime: the engine, the rendezvous and a local
// master passed to create() must outlive the client.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "store/client/rpc.h"
#include "store/master/error_codes.h"
#include "store/master/master_types.h"

namespace mooncake::store {

// ReplicateConfig on the wire (shared by the client's source files).
void toProto(const ReplicateConfig& c, proto::ReplicateConfig* p);

struct StoreClientOptions {
  uint64_t segment_size = 0;            // bytes lent to the store; 0: mount nothing
  int64_t rpc_timeout_ms = 5000;        // per master call
  int64_t transfer_timeout_ms = 10000;  // per engine batch
  bool publish_engine = true;           // publish the engine's segment in the rendezvous
};

class StoreClient {
 public:
  // local_master: a MasterService in this process to call directly (embedded master sharing
  // this engine); nullptr: find the master through the rendezvous ("mc/seg/mooncake-master").
  static ErrorOr<std::unique_ptr<StoreClient>> create(engine::TransferEngine* engine,
                                                      engine::Rendezvous* rdv,
                                                      MasterService* local_master,
                                                      StoreClientOptions options);
  ~StoreClient();
  // Unmounts the segment and stops the heartbeat. Idempotent.
  void close();

  const std::string& clientId() const { return client_id_; }

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

  // ---- reads ----
  ErrorOr<std::string> get(const std::string& key);
  // Reads into [buf, buf + capacity); returns the object size. BUFFER_OVERFLOW if it is larger.
  ErrorOr<uint64_t> getInto(const std::string& key, void* buf, size_t capacity);
  std::vector<ErrorOr<uint64_t>> batchGetInto(const std::vector<std::string>& keys,
                                              const std::vector<std::pair<void*, size_t>>& bufs);
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

 private:
  StoreClient() = default;
  // INVALID_KEY for an empty key or one over 4096 bytes.
  static ErrorCode checkKey(const std::string& key);
  // The bytes of `parts` as one buffer (*src): the part itself when there is one, else their
  // concatenation in *joined; *size: the total. INVALID_PARAMS for a null part with bytes.
  static ErrorCode gatherParts(const std::vector<std::pair<const void*, size_t>>& parts,
                               std::string* joined, const char** src, uint64_t* size);
  ErrorCode mount();
  void heartbeatLoop();
  // The engine peer for a piece's owner; kInvalidPeer for this client itself.
  ErrorOr<engine::PeerId> peerFor(const std::string& client_id);
  void forgetPeer(const std::string& client_id);
  // Appends the requests that move `size` bytes between `local` and a replica's pieces;
  // pieces of this client are copied at once. INVALID_READ if the pieces do not add up.
  ErrorCode planReplica(const proto::Replica& r, uint64_t size, engine::OpCode op, char* local,
                        std::vector<engine::TransferRequest>* reqs) {
    return planRange(r, size, op, 0, size, local, reqs);
  }
  // Writes src[0, size) to every replica in one engine batch; false when a replica could not
  // be planned or the batch failed.
  bool writeReplicas(const google::protobuf::RepeatedPtrField<proto::Replica>& replicas,
                     uint64_t size, const char* src);
  // `asked`: when the replica list was requested (the read lease runs from after it).
  ErrorCode readReplicas(const proto::GetReplicaListResponse& rl, void* buf, size_t skip_first,
                         std::chrono::steady_clock::time_point asked);
  ErrorCode putStart(const std::string& key, uint64_t size, const ReplicateConfig& config,
                     proto::PutStartResponse* out);
  // Appends the requests that move object bytes [off, off + len) of one replica between it
  // and local (op: kRead into local, kWrite from it); pieces of this client are copied at
  // once. INVALID_READ if the pieces do not add up to size; a piece of ours outside the
  // segment this client lent: INVALID_READ / INVALID_WRITE.
  ErrorCode planRange(const proto::Replica& r, uint64_t size, engine::OpCode op, uint64_t off,
                      uint64_t len, char* local, std::vector<engine::TransferRequest>* reqs);
  void putFinish(const std::string& key, bool ok);

  engine::TransferEngine* engine_ = nullptr;
  engine::Rendezvous* rdv_ = nullptr;
  StoreClientOptions options_;
  std::unique_ptr<MasterRpcClient> rpc_;
  std::string client_id_;
  std::string segment_name_;
  void* segment_ = nullptr;
  std::atomic<bool> closed_{false};

  mutable std::mutex mu_;
  std::unordered_map<std::string, engine::PeerId> peers_;
  std::vector<std::pair<uintptr_t, size_t>> buffers_;  // registered caller buffers

  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  uint64_t client_ttl_ms_ = 10000;
  std::thread hb_thread_;
};

}  // namespace mooncake::store
