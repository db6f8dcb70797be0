// The store's control plane over the engine's two-sided messages (no second RPC library).
//
// Wire: a request message on kStoreRpcChannel carries [u32 reply channel, little endian][a
// store.proto RequestEnvelope]; the master answers with the ResponseEnvelope MasterService::
// handle() produced, sent on the reply channel to the sender (found with peerOf). Responses
// are matched to calls by the envelope's rpc_id, so one client may have many calls in flight.
//
// Bootstrap: the master's engine segment is published in a Rendezvous under
// "mc/seg/<kMasterName>"; clients openPeer() that name.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <thread>
#include <vector>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine/engine.h"
#include "store/master/error_codes.h"
#include "store/master/master_service.h"
#include "store/proto/store.pb.h"

namespace mooncake::store {

constexpr const char* kMasterName = "mooncake-master";
constexpr uint32_t kStoreRpcChannel = 0x53540001;  // requests to the master
constexpr uint32_t kStoreReplyBase = 0x53541000;   // + per-client index: replies

// Serves a MasterService on an engine.
//
// Identity: a request is served in the name of the engine it came from as that engine
// authenticated (TransferEngine::authenticatedName), whatever client_id its body carries
// (MasterService::handle's caller); a message from an engine that never authenticated is
// dropped.
//
// No head-of-line blocking: the engine's dispatcher thread serves a request and queues its
// answer without waiting (the common case: the client's peer is open and takes the reply).
// When the answer cannot go out at once (the client's peer is not open yet, or its inbox is
// full), that client's requests queue behind it in arrival order and a worker thread opens
// the peer / waits for room with a deadline, so a slow, stalled or dead client delays only
// its own requests. Each client's backlog is bounded (kMaxBacklog); beyond it requests are
// dropped (the client times out with RPC_FAIL).
//
// Liveness: when the engine reports a client's engine gone, the service stops placing
// replicas on its segments at once (MasterService::clientGone).
//
// Records (store/master/record.h): the server is the service's RecordWiper. It wipes a record
// in the owner's memory before the master reuses it: with a plain store where the owner's
// segment is mapped here (same host, or this very process), else with an engine write from a
// worker thread (the memory stays quarantined until it landed).
class MasterRpcServer : public MasterService::RecordWiper {
 public:
  static constexpr size_t kMaxBacklog = 4096;
  static constexpr int kWorkers = 4;

  // Installs the handlers; the engine and service must outlive this object.
  MasterRpcServer(engine::TransferEngine* engine, MasterService* service);
  ~MasterRpcServer() override;  // removes the handlers, stops the workers
  // Publishes the engine's segment under "mc/seg/mooncake-master" (in addition to its own name).
  Status publish(engine::Rendezvous& rdv);

  bool wipe(const std::string& client_id, uint64_t address, uint64_t token) override;

 private:
  struct Wipe {
    std::string client_id;
    uint64_t address;
    uint64_t token;
  };
  void wipeLoop();
  struct Pending {
    uint32_t reply_channel = 0;
    std::string request;   // not yet served
    std::string response;  // served; waiting to be sent
    bool served = false;
  };
  struct Client {
    std::string name;  // authenticated identity
    engine::PeerId peer = engine::kInvalidPeer;
    std::deque<Pending> backlog;
    bool busy = false;  // queued for, or held by, a worker
  };
  void onMessage(engine::Message&& m);
  void onPeerGone(uint64_t engine_id, const std::string& name);
  void workerLoop();
  // Worker: drains one client's backlog (opening its peer first when needed).
  void drain(uint64_t engine_id);

  engine::TransferEngine* engine_;
  MasterService* service_;
  uint64_t gone_handler_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::unordered_map<uint64_t, Client> clients_;  // by engine id
  std::deque<uint64_t> ready_;                    // clients with a backlog for a worker
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> dropped_{0};
  std::unordered_map<std::string, uint64_t> by_name_;  // authenticated name -> engine id

  void* zeros_ = nullptr;  // registered: the source of remote wipes
  std::mutex wipe_mu_;
  std::condition_variable wipe_cv_;
  std::deque<Wipe> wipes_;
  bool wipe_stop_ = false;
  std::thread wipe_thread_;
};

// Calls the master. Either over the engine (remote master) or directly (master embedded in
// this process on the same engine: no message at all). Thread-safe.
class MasterRpcClient {
 public:
  // Remote: opens the master's peer by name through the rendezvous, waiting up to
  // open_timeout_ms for it to be published (a master may come up after its clients).
  static ErrorOr<std::unique_ptr<MasterRpcClient>> connect(engine::TransferEngine* engine,
                                                           engine::Rendezvous& rdv,
                                                           int64_t timeout_ms,
                                                           int64_t open_timeout_ms = 30000);
  // In-process master: calls service->handle() directly.
  static std::unique_ptr<MasterRpcClient> local(MasterService* service, int64_t timeout_ms);
  ~MasterRpcClient();

  // What happened to a call, for callers that retry (StoreClient).
  struct CallInfo {
    bool sent = false;         // the request left: the master may have served it
    bool master_dead = false;  // the master's peer is gone (it died, or its link broke)
    uint64_t epoch = 0;        // the answering master's epoch (0: no answer)
  };
  // One call: encodes `request` as the body of `method`, decodes the reply into `response`.
  // RPC_FAIL when the master is unreachable, dead, or silent past the deadline (default: the
  // client's timeout); the envelope's error code (UNAVAILABLE_IN_CURRENT_STATUS while the master
  // rebuilds, ...) when it answered with one.
  ErrorCode call(proto::Method method, const google::protobuf::MessageLite& request,
                 google::protobuf::MessageLite* response);
  ErrorCode call(proto::Method method, const google::protobuf::MessageLite& request,
                 google::protobuf::MessageLite* response, engine::Deadline deadline,
                 CallInfo* info);
  bool masterAlive() const;
  bool isLocal() const { return local_ != nullptr; }

 private:
  MasterRpcClient() = default;
  void onReply(engine::Message&& m);

  engine::TransferEngine* engine_ = nullptr;
  MasterService* local_ = nullptr;
  engine::PeerId master_ = engine::kInvalidPeer;
  uint32_t reply_channel_ = 0;
  int64_t timeout_ms_ = 5000;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> arrivals_{0};  // replies received so far (what call() yields on)
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::string> replies_;  // rpc id -> response envelope bytes
  std::map<uint64_t, bool> waiting_;
};

}  // namespace mooncake::store
