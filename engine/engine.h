// TransferEngine: the public face of the engine. Registers memory once, exports a segment,
// opens peers over the best transport that reaches them, and moves bytes one-sidedly.
//
// Threading: every method is thread-safe. Completion of a batch may happen on an engine
// thread; wait()/poll() observe it. Handlers set with setMessageHandler run on the engine's
// dispatcher thread, one message at a time, and must not block for long.
//
// Failure: when a peer's process dies, its pending and future requests fail with kPeerDead
// naming the peer (detected from its control connection, within milliseconds); every
// blocking call takes a deadline and returns kTimeout when it passes. A wait() that times
// out fences the batch's local memory before it returns (see wait()); the peer stays usable.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/rendezvous.h"
#include "engine/segment.h"
#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

struct EngineOptions {
  // Name the segment is published under (rendezvous key "mc/seg/<name>"). Must be unique
  // in the job. Empty: "engine-<engine id>".
  std::string name;
  // The job secret every peer must present. Empty: MC_SECRET, else the file MC_SECRET_FILE
  // names (when set). create() fails when there is none, unless MC_ALLOW_NO_SECRET=1.
  std::string secret;
  // The address the tcp listener binds and advertises. Empty: MC_TCP_BIND_HOST, else the local
  // address that routes to `reach_host`, else the first non-loopback IPv4 address. Never every
  // interface unless it says 0.0.0.0.
  std::string host;
  // A host the job talks through (its rendezvous, torch's MASTER_ADDR, the store master): the
  // engine listens on the local interface that reaches it (127.0.0.1 when it is local).
  std::string reach_host;
  // "" = choose per peer by locality; a transport's name ("shm", "rdma", "tcp") forces it.
  // Empty reads MC_TRANSPORT.
  std::string transport;
  // Data connections per tcp peer; 0 reads MC_TCP_CONNS_PER_PEER.
  int tcp_conns_per_peer = 0;
  // Upstream Mooncake's segment names ("host:port", the address peers reach the engine at):
  // once the tcp listener is up, the name becomes "<name>:<listener port>", or
  // "<advertised tcp host>:<port>" when name is empty; an IPv6 host is written "[addr]".
  bool name_with_port = false;
};

struct Message {
  uint64_t src_engine;
  PeerId peer;  // the sender as a peer of this engine (opened on demand), or kInvalidPeer
  uint32_t channel;
  std::string payload;
};

class TransferEngine {
 public:
  static Result<std::unique_ptr<TransferEngine>> create(EngineOptions options = {});
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // ---- memory ----
  // Registered host memory backed by shared memory (same-host peers map it directly), or
  // (kCuda) memory of GPU `device` (default 0) from the device layer (engine/device/device.h).
  Result<void*> allocate(size_t len, MemoryKind kind = MemoryKind::kHost, int device = -1);
  Status free(void* p);
  // Makes any existing memory reachable by peers (host: via process_vm_* on the same host,
  // via tcp otherwise). kCuda: memory of one GPU of the device layer (`device` -1 = the one it
  // lives on); same-host peers with the same layer reach it through the cuda transport (IPC),
  // others over rdma (GPUDirect) or, without it, tcp, which stages it through host memory
  // (engine/device_staging.h).
  Status registerMemory(void* addr, size_t len, MemoryKind kind = MemoryKind::kHost,
                        int device = -1);
  Status unregisterMemory(void* addr);
  // True when [addr, addr+len) lies inside one region registered with (or allocated by) this
  // engine.
  bool isRegistered(const void* addr, uint64_t len) const;

  // ---- segments and peers ----
  uint64_t engineId() const;
  const std::string& name() const;
  SegmentDesc localSegment() const;
  // Publishes the local segment under "mc/seg/<name>" (republish after registering more).
  Status publish(Rendezvous& rdv);
  // Opens a peer from its descriptor: handshake with the job secret, transport choice.
  Result<PeerId> openPeer(const SegmentDesc& remote, Deadline deadline);
  // Waits for "mc/seg/<name>" in the rendezvous, then opens it.
  Result<PeerId> openPeer(Rendezvous& rdv, const std::string& name, Deadline deadline);
  // Asks the engine whose tcp listener is at host:port for its descriptor, presenting the job
  // secret (tcp_query.h): how a peer is found without a rendezvous (upstream's P2P handshake).
  // Open it with openPeer(), or refresh an open one with updatePeer().
  Result<SegmentDesc> queryPeer(const std::string& host, uint16_t port, Deadline deadline);
  // Re-reads a peer's descriptor (after it registered more memory).
  Status updatePeer(PeerId peer, const SegmentDesc& remote);
  // OK while the peer is usable; kPeerDead (naming it) once it died or its link broke.
  Status peerStatus(PeerId peer) const;
  // The transport chosen for a peer ("shm", "tcp", ...).
  std::string peerTransport(PeerId peer) const;
  const SegmentDesc* peerSegment(PeerId peer) const;

  // ---- one-sided transfers ----
  // Validates and starts every request; returns at once. Requests to one peer run in
  // parallel; there is no ordering between requests of a batch. A request whose local or
  // remote range runs past the end of the address space, or longer than kMaxRequestBytes, is
  // refused here (kInvalidArgument naming it) and nothing of the batch starts. The local
  // memory of a request must stay valid until its batch finished, or until a wait() on it
  // returned kTimeout and the fence that wait() describes for its transport was passed.
  static constexpr uint64_t kMaxRequestBytes = 1ull << 56;
  Result<BatchId> submit(const std::vector<TransferRequest>& requests);
  // done=true when every request finished; per_request (optional) gets each status.
  Status poll(BatchId id, bool* done, std::vector<Status>* per_request = nullptr);
  // Waits for the batch (spin, then block) and releases it. Returns the first failure.
  // kTimeout: the deadline passed first. Nothing is cancelled and no peer is failed: the
  // requests still unfinished keep running (a late WRITE still reaches the target, late acks
  // and responses still come) and the batch is released once they ended (poll() then says
  // kNotFound). What their local memory may see afterwards, by transport:
  //  - tcp: before wait() returns, the progress thread detached them from it (a READ response
  //    still to come, or half received, goes to a discard sink; what WRITE frames still have to
  //    send was copied into the engine's memory). After it returned, the tcp transport no
  //    longer reads or writes the batch's local buffers: they may be freed at once.
  //  - rdma: memory registered with the engine is accessed by the NIC itself; it is fenced by
  //    unregisterMemory() (deregistration: a late access fails instead of landing), so
  //    unregister it before freeing or reusing it. Memory the engine did not register is staged
  //    through its bounce buffers: fenced by the return of wait() (nothing more is copied
  //    into it or out of it, over rdma or the tcp fallback).
  //  - shm moves every byte inside submit(): nothing is late.
  // What a request moved before its wait() gave up is undefined (a WRITE's target range, a
  // READ's local range may hold a part of it; a late WRITE may still change the target range
  // after wait() returned).
  Status wait(BatchId id, Deadline deadline, std::vector<Status>* per_request = nullptr);
  // For a caller that gives up on a batch (wait's kTimeout, or without waiting) but must keep
  // something alive until its transfers really ended (the local memory of a batch given up
  // without waiting, or of rdma-registered memory it will not unregister; a remote slab that a
  // late WRITE still lands in): the engine holds `owner` and drops it once the batch finished
  // (or failed, at the latest when the engine shuts down and its transports stop), then
  // releases the batch. A timed-out wait() does not shorten this: the late transfers still run
  // to their end and the owner lives until then. A batch already finished, released or never
  // known: `owner` is dropped here. Otherwise it is dropped later on a process-wide thread of
  // its own, never a transport's (its destructor may take the GIL or drop the last reference
  // to this engine).
  void keepUntilDone(BatchId id, std::shared_ptr<void> owner);
  // Waits until every batch submitted before the call with a request to `peer` has finished
  // (each request completed or failed), whether anyone waits for it or not; kTimeout, saying
  // how many still run, when the deadline passes first. For a service that gave up on writes
  // into a peer's memory and is about to reuse that memory's addresses (EP's buffer rebuilt
  // by update_ep_member): a late WRITE could otherwise land in what replaced it.
  Status settle(PeerId peer, Deadline deadline);
  // submit + wait.
  Status transfer(const std::vector<TransferRequest>& requests, Deadline deadline);

  // ---- notifications (write-with-immediate semantics) ----
  // Delivers `tag` to the peer after every write this process posted to it before the call
  // (the peer finds the written bytes in its memory when it sees the tag), for its
  // waitNotify()/pollNotify().
  Status notify(PeerId peer, uint64_t tag);
  Result<Notification> waitNotify(Deadline deadline);
  bool pollNotify(Notification* out);
  // Service notifications: the same ordering, delivered to the handler of `channel` (!= 0)
  // at the peer instead of its waitNotify(), so that services sharing an engine (pg, ep, the
  // store) never take each other's. Notifications of one sender arrive in order.
  Status notify(PeerId peer, uint32_t channel, uint64_t tag);
  // Handlers run on the engine's dispatcher threads (serialised with message handlers) and
  // must not block for long. Notifications that arrive on a channel without a handler are
  // queued and handed to the next handler set. Same lifetime rule as setMessageHandler.
  void setNotifyHandler(uint32_t channel, std::function<void(const Notification&)> handler);

  // ---- two-sided messages (active messages) ----
  Status sendMessage(PeerId peer, uint32_t channel, std::string_view payload);
  // The same, waiting no longer than `deadline` for room at the peer (a same-host peer whose
  // inbox is full): kResourceExhausted then. A message of one inbox fragment
  // (Inbox::kFragmentBytes) was then not sent at all; of a larger one a part may have been,
  // which the receiver discards when this process's next large message to it begins, or when
  // this process is gone. One process's large messages to one peer go one at a time (a later
  // one waits for the earlier, within its deadline). Deadline now() never blocks.
  Status sendMessage(PeerId peer, uint32_t channel, std::string_view payload, Deadline deadline);
  // The same, taking the payload over: no copy where the transport queues it (tcp).
  Status sendMessageOwned(PeerId peer, uint32_t channel, std::string&& payload);
  // Hands a consumed message payload back: the transports reuse its memory for messages
  // they receive later (optional; saves an allocation and a zero-fill per large message).
  void recycleMessageBuffer(std::string&& payload);
  // handler == nullptr: messages on the channel are queued for waitMessage(). When called
  // from any thread but the dispatcher, the previous handler is not running any more once
  // this returns, so its owner may be destroyed right after.
  void setMessageHandler(uint32_t channel, std::function<void(Message&&)> handler);
  Result<Message> waitMessage(uint32_t channel, Deadline deadline);
  // Opens (or returns) the peer a message came from, from the descriptor it handed over
  // in its handshake.
  Result<PeerId> peerOf(uint64_t engine_id, Deadline deadline);
  // The name an engine published in the handshake it authenticated with (it presented the
  // job secret), or that of a peer this engine opened; "" for an engine that did neither.
  // Services that act for a peer (the store master) take its identity from here, never from
  // the message body.
  std::string authenticatedName(uint64_t engine_id) const;
  // Called once per remote engine that is gone: its process died, its link broke, or it
  // stopped (orderly), whether this engine opened it or it only connected here (an engine that
  // authenticates again later counts anew). Runs on an engine thread; must not block. Returns
  // an id for removePeerGoneHandler(); once that returns, the handler is not running.
  using PeerGoneHandler =
      std::function<void(uint64_t engine_id, const std::string& name, const Status& why)>;
  uint64_t addPeerGoneHandler(PeerGoneHandler handler);
  void removePeerGoneHandler(uint64_t id);

  // ---- mapped access ----
  // A local pointer to the peer's [remote, remote+len) when it is mapped here (shm), else
  // nullptr. Valid until the peer is closed or unregisters the region, or releaseMapped.
  void* mappedAddress(PeerId peer, uint64_t remote, uint64_t len);
  // The caller is done with `local`, a pointer mappedAddress returned for this peer, and with
  // every pointer into the same mapping: it is unmapped now instead of when the peer closes
  // (a region the peer freed otherwise keeps its memory while this process maps it). Nobody
  // may use such a pointer afterwards; copies to the region map it again. No-op when it is
  // not mapped.
  void releaseMapped(PeerId peer, const void* local);

  class Impl;

 private:
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  Status registerDevice(void* addr, size_t len, int device, bool owned);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mooncake::engine
