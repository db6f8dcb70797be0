// P2pSessions: upstream Mooncake's transfer-engine model on a TransferEngine: peers named by
// session ids, batches with their own deadlines, named notifications. mooncake.engine (the
// Python TransferEngine that vLLM's and SGLang's prefill/decode code calls) is a thin binding
// of this class; the policy lives here.
//
// Sessions. A peer is named "host:port" ("[v6addr]:port"): where its engine's tcp listener
// is, i.e. its engine name when that engine was created with name_with_port. The first use of
// a session asks that listener for the peer's descriptor (TransferEngine::queryPeer: the job
// secret first, no metadata server: upstream's P2PHANDSHAKE) and opens the peer. A session
// whose peer died is reopened on its next use (the peer may have restarted at that address).
//
// Transfers. Each request must lie inside ONE region on each side: the local range inside a
// region registered with this engine, the remote range inside one the peer's descriptor lists
// (fetched again once when it does not: the peer may have registered memory since). Anything
// else fails before a byte moves, with kInvalidArgument (local side, zero length) or
// kPermissionDenied (remote side); the target checks every access again itself. A batch's
// deadline is fixed at submit: MC_TRANSFER_TIMEOUT seconds (at least 5) plus 1 ns per byte.
//
// Notifications. notify() sends (name, msg) to the session's peer as one engine message on
// kNotifyChannel; sent after a transfer completed, it arrives after that transfer's bytes.
// drainNotifies() returns those this engine received, each once, in arrival order per sender,
// from senders that authenticated with the job secret.
//
// Threading: every method is thread-safe. The engine must outlive this object.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/engine.h"

namespace mooncake::engine {

class P2pSessions {
 public:
  static constexpr uint32_t kNotifyChannel = 0x54450001;  // "TE" 1

  struct Request {
    OpCode op;
    uint64_t local;
    uint64_t remote;
    uint64_t length;
  };
  enum class State { kPending, kCompleted, kFailed, kTimedOut };
  struct Notify {
    std::string name;
    std::string msg;
  };

  explicit P2pSessions(TransferEngine* engine);
  ~P2pSessions();
  P2pSessions(const P2pSessions&) = delete;
  P2pSessions& operator=(const P2pSessions&) = delete;

  // "host:port" / "[v6]:port" (leading '/' ignored) -> host (no brackets) and port.
  static Status parseSession(const std::string& session, std::string* host, uint16_t* port);

  // The open peer of a session, opening (or reopening) it.
  Result<PeerId> peer(const std::string& session);
  // OK when the session's engine answers a descriptor query now (a fresh connection that
  // presents the secret); the answer also refreshes the open peer's descriptor.
  Status probe(const std::string& session);
  // The lowest start address among the regions the session's peer exports (0 when none).
  // Upstream answers the first buffer in registration order; the descriptor has no order.
  Result<uint64_t> firstBufferAddress(const std::string& session);

  // Validates every request (see above) and starts them as one batch.
  Result<BatchId> submit(const std::string& session, const std::vector<Request>& requests);
  // Waits for a submitted batch until its deadline and releases it; the first failure. On
  // kTimeout the batch's local buffers are fenced as TransferEngine::wait says: over tcp
  // nothing reads or writes them once this returns (they may be freed); over rdma, memory
  // registered with the engine once it is unregistered, bounce-staged memory at once. The
  // session's peer stays open; the late transfers end on their own.
  Status wait(BatchId id);
  // Non-blocking. kCompleted / kFailed / kTimedOut release the batch (why: the failure);
  // an unknown (or already released) id is kFailed. kTimedOut fences as wait() does.
  State check(BatchId id, Status* why = nullptr);
  // submit + wait.
  Status transfer(const std::string& session, const std::vector<Request>& requests);

  Status notify(const std::string& session, const std::string& name, const std::string& msg);
  std::vector<Notify> drainNotifies();

 private:
  Result<PeerId> open(const std::string& session, bool refresh);
  // OK when our copy of the session's descriptor shows every request's remote range inside one
  // region (after one refresh from the peer when it does not).
  Status checkRemote(const std::string& session, PeerId peer,
                     const std::vector<Request>& requests);

  struct Session {
    PeerId peer;
    SegmentDesc desc;  // our copy of the peer's descriptor (requests are checked against it)
  };

  TransferEngine* engine_;
  const int64_t connect_ms_;
  const int64_t timeout_ms_;
  std::mutex mu_;
  std::unordered_map<std::string, Session> sessions_;  // guarded by mu_
  std::unordered_map<BatchId, Deadline> batches_;      // guarded by mu_
};

}  // namespace mooncake::engine
