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
#include <map>
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

// Serves a MasterService on an engine. The handler runs on the engine's dispatcher thread.
class MasterRpcServer {
 public:
  // Installs the handler; the engine and service must outlive this object.
  MasterRpcServer(engine::TransferEngine* engine, MasterService* service);
  ~MasterRpcServer();  // removes the handler
  // Publishes the engine's segment under "mc/seg/mooncake-master" (in addition to its own name).
  Status publish(engine::Rendezvous& rdv);

 private:
  void onMessage(engine::Message&& m);
  engine::TransferEngine* engine_;
  MasterService* service_;
  std::mutex mu_;
  std::unordered_map<uint64_t, engine::PeerId> peers_;  // engine id -> peer (reply path)
};

// Calls the master. Either over the engine (remote master) or directly (master embedded in
// this process on the same engine: no message at all). Thread-safe.
class MasterRpcClient {
 public:
  // Remote: opens the master's peer by name through the rendezvous.
  static ErrorOr<std::unique_ptr<MasterRpcClient>> connect(engine::TransferEngine* engine,
                                                           engine::Rendezvous& rdv,
                                                           int64_t timeout_ms);
  // In-process master: calls service->handle() directly.
  static std::unique_ptr<MasterRpcClient> local(MasterService* service, int64_t timeout_ms);
  ~MasterRpcClient();

  // One call: encodes `request` as the body of `method`, decodes the reply into `response`.
  // RPC_FAIL when the master is unreachable, dead, or silent past the timeout.
  ErrorCode call(proto::Method method, const google::protobuf::MessageLite& request,
                 google::protobuf::MessageLite* response);
  bool masterAlive() const;

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
