// The small interface every transport implements (shm, tcp, later rdma and cuda), and the
// view of the engine a transport is given. Transports never see torch, collectives or keys.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "engine/buffer_pool.h"
#include "engine/inbox.h"
#include "engine/memory.h"
#include "engine/segment.h"
#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

// One request in flight. The transport that accepts it calls done() exactly once, from any
// thread, after the bytes moved (or with the error). Slicing is the transport's business.
struct Task {
  OpCode op;
  void* local;
  uint64_t length;
  uint64_t remote;
  // Set by the engine: where the completion goes.
  std::function<void(Status)> on_done;
  void done(Status s) { on_done(std::move(s)); }
};

// What a transport may use of its engine.
struct EngineContext {
  uint64_t engine_id = 0;
  // Peers must present it (never empty unless MC_ALLOW_NO_SECRET=1; see engine/secret.h).
  std::string secret;
  // The address the tcp listener binds (resolved by the engine; see EngineOptions.host).
  std::string tcp_host;
  MemoryRegistry* registry = nullptr;
  Inbox* inbox = nullptr;
  // Where a transport takes buffers for the messages it receives (consumed payloads come
  // back through TransferEngine::recycleMessageBuffer). Null: allocate each time.
  BufferPool* buffers = nullptr;
  // The current local descriptor (regions change as memory is registered).
  std::function<SegmentDesc()> local_segment;
  // A peer (by engine id) became unreachable: its process died or its link broke, or
  // (orderly) its engine told this one it is stopping. Either way the peer is gone.
  std::function<void(uint64_t engine_id, Status why, bool orderly)> on_peer_failure;
  // A transport that received a whole message into this process's memory (tcp) hands it
  // over here: it is queued in process for the engine's handlers, without a copy through the
  // shared-memory inbox, and the call never blocks. Null: push it into `inbox`.
  std::function<void(uint64_t src_engine, uint32_t channel, std::string&& payload)>
      deliver_message;
  // A peer handed over its descriptor in a handshake (lets the target answer messages).
  std::function<void(const SegmentDesc& desc)> on_peer_hello;
};

// A connection to one peer over one transport.
class TransportPeer {
 public:
  virtual ~TransportPeer() = default;
  virtual void submit(Task* task) = 0;
  // Delivers tag into the peer's inbox after every write submitted here before the call.
  virtual Status notify(uint64_t tag) = 0;
  virtual Status sendMessage(uint32_t channel, std::string_view payload) = 0;
  // The same, waiting at most until `deadline` where the transport could block (a full
  // same-host inbox): kTimeout then, nothing sent. Transports that only queue ignore it.
  virtual Status sendMessage(uint32_t channel, std::string_view payload, Deadline deadline) {
    (void)deadline;
    return sendMessage(channel, payload);
  }
  // The same, taking the payload over (a transport that queues it need not copy it).
  virtual Status sendOwnedMessage(uint32_t channel, std::string&& payload) {
    return sendMessage(channel, std::string_view(payload));
  }
  // A local pointer where the peer's memory is mapped; nullptr when not mapped.
  virtual void* mappedAddress(uint64_t remote, uint64_t len) {
    (void)remote;
    (void)len;
    return nullptr;
  }
  // The peer republished its descriptor (more or fewer regions).
  virtual Status updateRemote(const SegmentDesc& remote) = 0;
  // Poison: fail pending and future tasks with `why`.
  virtual void fail(const Status& why) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  // Called once before any peer: listeners, threads; may fill fields of the local segment.
  virtual Status start(EngineContext* ctx) = 0;
  virtual void fillLocalSegment(SegmentDesc* desc) = 0;
  // Per-region keys (rkey, IPC handle): called on register/unregister.
  virtual Status registerRegion(Region* region) {
    (void)region;
    return Status::OK();
  }
  virtual void unregisterRegion(const Region& region) { (void)region; }
  virtual bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const = 0;
  // data=false: the link is only for the handshake, liveness and messages (the engine
  // always holds a tcp link to every peer for those, whatever carries the data).
  virtual Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote,
                                                         Deadline deadline, bool data) = 0;
  // Stops threads; called before the engine's memory goes away.
  virtual void stop() = 0;
};

std::unique_ptr<Transport> makeShmTransport();
// data_conns: data connections per peer (the control connection is extra).
std::unique_ptr<Transport> makeTcpTransport(int data_conns);

}  // namespace mooncake::engine
