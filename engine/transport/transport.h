// The small interface every transport implements (shm, tcp, rdma, later cuda), the view of
// the engine a transport is given, and the table the engine chooses transports from.
// Transports never see torch, collectives or keys.
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
  // Set by the engine (null: never): true once the caller gave up on the task (a wait() on
  // its batch passed its deadline). From then on its local memory is not the transport's to
  // touch: see TransportPeer::fenceAbandoned. The task still completes (done()) as usual.
  const std::atomic<bool>* abandoned = nullptr;
  bool isAbandoned() const {
    return abandoned != nullptr && abandoned->load(std::memory_order_acquire);
  }
  void done(Status s) { on_done(std::move(s)); }
};

class BouncePool;

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
  // A transport that received a service notification (channel != 0) in this process (tcp)
  // hands it over here, to the engine's handlers; never blocks. Null: push it into `inbox`.
  std::function<void(uint64_t src_engine, uint32_t channel, uint64_t tag)> deliver_notify;
  // An authenticated peer's control link carried an exchange request for the transport of
  // `kind` (see ControlLink): the engine routes it to that transport's onExchange(), with the
  // descriptor the peer handed over in its handshake. `reply` may be called from any thread,
  // once.
  std::function<void(uint64_t src_engine, TransportKind kind, std::string request,
                     std::function<void(Result<std::string>)> reply)>
      on_exchange;
  // Registered host memory for requests whose local side is not registered, for transports
  // that need it registered (rdma): created on first use. Null where the engine has none.
  std::function<BouncePool*()> bounce;
};

// The control link to a peer (always tcp, authenticated with the job secret): a transport
// exchanges its connection data over it (QP numbers, GIDs, ...) instead of opening a second
// bootstrap channel. Thread-safe; usable for as long as the peer is open.
class ControlLink {
 public:
  virtual ~ControlLink() = default;
  // Sends `request` to the peer engine's transport of `kind` (its Transport::onExchange) and
  // waits for the answer until `deadline`. kPeerDead once the link is gone.
  virtual Result<std::string> exchange(TransportKind kind, std::string_view request,
                                       Deadline deadline) = 0;
};

// A connection to one peer over one transport.
class TransportPeer {
 public:
  virtual ~TransportPeer() = default;
  virtual void submit(Task* task) = 0;
  // Delivers (channel, tag) into the peer's inbox after every write submitted here before
  // the call (its bytes are in the peer's memory when the peer sees the tag).
  virtual Status notify(uint32_t channel, uint64_t tag) = 0;
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
  // TransferEngine::releaseMapped: drops the mapping `local` points into, if any.
  virtual void releaseMapped(const void* local) { (void)local; }
  // The peer republished its descriptor (more or fewer regions).
  virtual Status updateRemote(const SegmentDesc& remote) = 0;
  // Poison: fail pending and future tasks with `why`.
  virtual void fail(const Status& why) = 0;
  // Some tasks submitted here were abandoned (Task::isAbandoned() is true for them now): once
  // this returns, the transport's own code no longer reads or writes their local memory. It
  // does not fail them or the peer: the connection stays up, a late transfer still moves (a
  // WRITE's bytes still reach the target, taken from a copy) and the task completes when it
  // ends, as before (tcp: the progress thread receives a late READ response into a discard
  // sink and copies what queued WRITE frames still have to send). What a NIC accesses by itself
  // (rdma, registered memory) is fenced by unregistering that memory instead. The default suits
  // transports whose tasks touch local memory only inside submit() (shm). Called by the engine
  // before a timed-out wait() returns; never on a transport thread.
  virtual void fenceAbandoned() {}
  // The failure this link already fails new tasks with (OK while none). The engine's
  // peerStatus() consults it: a link fails its tasks as soon as it sees the peer go, a moment
  // before the engine itself hears of it (tcp: on its progress thread).
  virtual Status health() { return Status::OK(); }
  // Waits until every task submitted here so far has moved its bytes (a transport whose
  // tasks complete later than submit returns: cuda). The engine calls it before a
  // notification it sends over another transport of the same peer.
  virtual Status quiesce(Deadline deadline) {
    (void)deadline;
    return Status::OK();
  }
  // The control link this peer carries (tcp only); nullptr for data-only transports.
  virtual std::shared_ptr<ControlLink> controlLink() { return nullptr; }
  // False: this transport moves data and notifications only; the engine sends the peer's
  // two-sided messages over its control link (rdma keeps them on tcp).
  virtual bool carriesMessages() const { return true; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  // Called once before any peer: listeners, threads; may fill fields of the local segment.
  virtual Status start(EngineContext* ctx) = 0;
  virtual void fillLocalSegment(SegmentDesc* desc) = 0;
  // Per-region keys (rkey, IPC handle): called on register/unregister. unregisterRegion runs
  // after the region left the registry (no request is admitted into it any more) and while
  // its memory is still mapped (tcp copies the READ responses still queued out of it).
  virtual Status registerRegion(Region* region) {
    (void)region;
    return Status::OK();
  }
  virtual void unregisterRegion(const Region& region) { (void)region; }
  virtual bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const = 0;
  // data=false: the link is only for the handshake, liveness and messages (the engine
  // always holds a tcp link to every peer for those, whatever carries the data).
  // `control`: the peer's control link (null when connecting the control link itself), for
  // transports that exchange connection data with the peer (rdma), now or later.
  virtual Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote,
                                                         Deadline deadline, bool data,
                                                         std::shared_ptr<ControlLink> control) = 0;
  // The target side of ControlLink::exchange: a peer (`from`, as it described itself in its
  // handshake) asks this transport for its connection data. Called on an engine thread; the
  // answer may come later, from any thread, through `reply` (exactly once).
  virtual void onExchange(const SegmentDesc& from, std::string request,
                          std::function<void(Result<std::string>)> reply) {
    (void)from;
    (void)request;
    reply(MC_STATUS(kNotSupported, "transport " << transportName(kind())
                                                << " exchanges no connection data"));
  }
  // A peer engine (by id) is gone (died, link broke, or stopped): drop what was kept for it
  // on the target side (queue pairs it connected to, ...).
  virtual void onPeerGone(uint64_t engine_id) { (void)engine_id; }
  // The transport needs the local side of a request registered with it (rdma): requests
  // from other memory go through the engine's bounce pool (EngineContext::bounce).
  virtual bool needsRegisteredLocal() const { return false; }
  // The transport moves GPU memory (regions of MemoryKind::kCuda, either side): rdma through
  // dma-buf / GPUDirect registration. Others move host memory only; the engine keeps GPU
  // memory away from them.
  virtual bool reachesDeviceMemory() const { return false; }
  // False for a transport of GPU memory only (cuda): the engine never chooses it as a peer's
  // transport for host memory, notifications and messages.
  virtual bool movesHostMemory() const { return true; }
  // Stops threads; called before the engine's memory goes away.
  virtual void stop() = 0;
};

// What the engine hands a transport's factory.
struct TransportOptions {
  int tcp_data_conns = 2;  // data connections per tcp peer (the control connection is extra)
};

// One row of the static priority table (NCCL's ncclTransports[]): rows are in TransportKind
// order, the first whose transport canReach() a peer wins. `make` is null for a transport
// this build does not have (rdma without libibverbs, cuda without CUDA).
struct TransportRow {
  TransportKind kind;
  const char* name;
  std::unique_ptr<Transport> (*make)(const TransportOptions& options);
};

// The table, kNumTransportKinds rows in priority order (engine/transport/table.cc).
const TransportRow* transportTable();
// The row named `name`, or nullptr.
const TransportRow* findTransport(std::string_view name);

std::unique_ptr<Transport> makeShmTransport(const TransportOptions& options);
std::unique_ptr<Transport> makeTcpTransport(const TransportOptions& options);
// Defined only in builds with MC_HAVE_RDMA (the table references it only then).
std::unique_ptr<Transport> makeRdmaTransport(const TransportOptions& options);
// Over the device layer (engine/device/device.h), in every build; it offers itself only where
// a device layer exists (the CUDA driver, or MC_DEVICE=sim).
std::unique_ptr<Transport> makeCudaTransport(const TransportOptions& options);

}  // namespace mooncake::engine
