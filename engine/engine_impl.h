// The engine's internals (TransferEngine::Impl and what it keeps per batch and per peer), shared
// by engine.cc (creation, memory, peers) and engine_data.cc (transfers, notifications,
// messages). Nothing outside those two includes it.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "engine/bounce_pool.h"
#include "engine/device/device.h"
#include "engine/device_staging.h"
#include "engine/engine.h"
#include "engine/inbox.h"
#include "engine/log.h"
#include "engine/memory.h"
#include "engine/params.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_query.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "engine/transport/transport.h"
#include "mooncake/config.h"

namespace mooncake::engine {

inline uint64_t randomEngineId() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v == 0 ? 1 : v;
}

inline std::string hex16(uint64_t v) {
  char b[24];
  snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// Drops what callers handed over with keepUntilDone on a process-wide thread of its own,
// never on a transport's: an owner's destructor may take Python's GIL (a tensor whose memory
// Python owns) or drop the last reference to this very engine (a store lease holds it), and a
// transport thread can neither wait for the GIL nor join itself (engine_data.cc).
void dropOwnersLater(std::vector<std::shared_ptr<void>> owners);

// One batch of requests: statuses and a countdown. Lives in the engine's table until it
// completed and was waited for (a batch abandoned by a timed-out wait, or given up with
// keepUntilDone, is dropped when its last request completes).
struct Batch {
  std::vector<Task> tasks;
  std::vector<PeerId> peers;  // the peers its requests go to, each once (settle)
  // The transport peers its requests went to, each once (a timed-out wait fences them).
  std::vector<TransportPeer*> routes;
  std::vector<Status> status;
  std::atomic<int64_t> pending{0};
  // Set by a timed-out wait() before it fences `routes`: every task points at it
  // (Task::abandoned).
  std::atomic<bool> given_up{false};
  std::mutex mu;
  std::condition_variable cv;
  bool abandoned = false;  // guarded by mu
  // What keeps the local memory of an abandoned batch valid (keepUntilDone): dropped with the
  // batch. Guarded by mu.
  std::vector<std::shared_ptr<void>> owners;
};

struct PeerEntry {
  SegmentDesc desc;
  TransportKind kind = TransportKind::kTcp;
  std::unique_ptr<TransportPeer> control;  // tcp link: handshake, liveness (maybe data too)
  std::unique_ptr<TransportPeer> data_owned;
  TransportPeer* data = nullptr;
  // What moves GPU memory (MemoryKind::kCuda, either side) to this peer: `data` itself when
  // its transport reaches GPU memory (rdma), a second transport's peer (cuda, same host), or
  // none (requests with GPU memory are refused).
  TransportPeer* device = nullptr;
  std::unique_ptr<TransportPeer> device_owned;
  TransportKind device_kind = TransportKind::kTcp;
  // With cuda as `device`: staging through host memory over `data`, for the peer's host
  // memory that cuda cannot map (registered, not allocated by its engine).
  std::unique_ptr<TransportPeer> staged;
  std::atomic<int> remote_gpu_regions{0};  // GPU regions in the peer's descriptor
  std::atomic<bool> dead{false};
  std::mutex mu;
  Status why;  // guarded by mu
};

using PeerGoneHandler = TransferEngine::PeerGoneHandler;

class TransferEngine::Impl {
 public:
  EngineOptions opts;
  uint64_t id = randomEngineId();
  std::string host_id = localHostId();
  MemoryRegistry registry;
  std::unique_ptr<Inbox> inbox;
  BufferPool buffers;  // message payloads consumed and handed back, for the transports
  EngineContext ctx;
  std::unique_ptr<Transport> transports[kNumTransportKinds];  // by TransportKind (table order)
  int forced = -1;  // TransportKind forced by options / MC_TRANSPORT
  int64_t spin_us = params::getInt("MC_SPIN_US");  // read once: wait() is a hot path
  // Regions of GPU memory registered (kCuda): while there are none, submit() does not look
  // the local side of requests up.
  std::atomic<int> device_regions{0};

  mutable std::shared_mutex peers_mu;
  std::vector<std::unique_ptr<PeerEntry>> peers;
  std::unordered_map<uint64_t, PeerId> by_engine;
  std::unordered_map<uint64_t, SegmentDesc> hellos;  // descriptors from handshakes
  std::mutex open_mu;                                 // serialises openPeer
  std::mutex gone_mu;
  std::map<uint64_t, PeerGoneHandler> gone_handlers;  // guarded by gone_mu
  uint64_t next_gone_handler = 1;                     // guarded by gone_mu
  std::unordered_set<uint64_t> gone;  // engines reported gone (guarded by gone_mu)
  std::recursive_mutex gone_run_mu;   // held while handlers run
  std::atomic<uint64_t> dropped_msgs{0};  // from engines that never authenticated here
  MessageReassembler reassembly;          // the dispatcher's, of inbox fragments

  std::mutex batches_mu;
  std::unordered_map<BatchId, std::shared_ptr<Batch>> batches;
  std::atomic<BatchId> next_batch{1};

  // messages
  std::mutex msg_mu;
  std::condition_variable msg_cv;
  std::map<uint32_t, std::function<void(Message&&)>> handlers;
  std::map<uint32_t, std::deque<Message>> queues;
  // Service notifications (channel != 0): handlers, and what arrived before one was set.
  std::map<uint32_t, std::function<void(const Notification&)>> notify_handlers;
  std::map<uint32_t, std::deque<Notification>> notify_queues;
  // The bounce pool (created on first use; see bounce_pool.h).
  std::mutex bounce_mu;
  std::unique_ptr<BouncePool> bounce;
  void* bounce_mem = nullptr;
  std::thread dispatcher;
  // Held by the dispatcher while a handler runs: setMessageHandler() waits on it so that
  // once it returns the replaced handler is no longer running (its owner may free it).
  std::mutex handler_run_mu;
  std::atomic<bool> stopping{false};
  // Messages a transport received in this process (tcp): a second dispatcher delivers them
  // (handler calls of both dispatchers are serialised by handler_run_mu).
  std::mutex local_mu;
  std::condition_variable local_cv;
  std::deque<Message> local_msgs;
  std::deque<Notification> local_notifies;
  std::thread local_dispatcher;

  ~Impl() {
    shutdown();
    // GPU memory the engine allocated goes back to the device layer once no transport holds
    // it registered (host memory goes with the registry).
    for (auto& t : transports) t.reset();
    if (device_regions.load() == 0) return;
    for (const Region& r : registry.snapshot()) {
      if (r.kind != MemoryKind::kCuda || !r.engine_owned) continue;
      auto dev = device::layerOf(reinterpret_cast<void*>(r.addr));  // MC_DEVICE may differ now
      if (dev.ok()) (void)(*dev)->free(reinterpret_cast<void*>(r.addr));
    }
  }

  void shutdown() {
    if (stopping.exchange(true)) return;
    if (inbox) inbox->wakeAll();
    if (dispatcher.joinable()) dispatcher.join();
    {
      std::lock_guard<std::mutex> g(local_mu);
      local_cv.notify_all();
    }
    if (local_dispatcher.joinable()) local_dispatcher.join();
    for (auto& t : transports)
      if (t) t->stop();
    std::unique_lock<std::shared_mutex> g(peers_mu);
    peers.clear();
  }

  // Registers [r.addr, r.addr+r.len) with every transport (their per-region keys land in r).
  // On failure, the transports that accepted it drop it again.
  Status registerWithTransports(Region* r) {
    for (int k = 0; k < kNumTransportKinds; ++k) {
      if (!transports[k]) continue;
      Status st = transports[k]->registerRegion(r);
      if (!st.ok()) {
        for (int j = 0; j < k; ++j)
          if (transports[j]) transports[j]->unregisterRegion(*r);
        return st;
      }
    }
    return Status::OK();
  }

  void unregisterWithTransports(const Region& r) {
    for (auto& t : transports)
      if (t) t->unregisterRegion(r);
  }

  Result<void*> allocateRegistered(size_t len) {
    MC_ASSIGN_OR_RETURN(void* p, registry.allocateShm(len, params::getString("MC_SHM_PREFIX")));
    auto r = registry.find(reinterpret_cast<uint64_t>(p), len);
    Region copy = *r;
    Status st = registerWithTransports(&copy);
    if (st.ok()) st = registry.setKeys(copy.addr, copy.keys);
    if (!st.ok()) {
      (void)registry.freeShm(p);
      return st;
    }
    return p;
  }

  // Where request i to peer e goes once GPU memory is about: its peer's data transport, or,
  // when either side is GPU memory (registered as kCuda, device memory the engine does not
  // know, or a GPU region of the peer), the transport that moves GPU memory to it; an error
  // when there is none (shm and tcp would memcpy it).
  Result<TransportPeer*> route(const TransferRequest& r, size_t i, PeerEntry* e) {
    const uint64_t a = reinterpret_cast<uint64_t>(r.local);
    const uint64_t n = std::max<uint64_t>(r.length, 1);
    auto region = registry.find(a, n);
    bool gpu = region.has_value() && region->kind == MemoryKind::kCuda;
    if (!region.has_value() && device::active()) {
      auto dev = device::get();
      gpu = dev.ok() && (*dev)->pointer(r.local).device;
    }
    const char* side = "its local memory";
    uint64_t where = a;
    if (!gpu && e->remote_gpu_regions.load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> g(e->mu);
      const RegionDesc* rr = e->desc.findRegion(r.remote, n);
      gpu = rr != nullptr && rr->kind == MemoryKind::kCuda;
      side = "the peer's memory";
      where = r.remote;
    }
    if (!gpu) return e->data;
    if (e->staged != nullptr) {
      std::lock_guard<std::mutex> g(e->mu);
      const RegionDesc* rr = e->desc.findRegion(r.remote, n);
      if (rr != nullptr && rr->kind == MemoryKind::kHost && rr->shm_name.empty())
        return e->staged.get();
    }
    if (e->device != nullptr) return e->device;
    return MC_STATUS(kNotSupported, "request " << i << ": " << side << " at "
                                               << where
                                               << " is GPU memory and peer " << e->desc.name
                                               << " is reached over " << transportName(e->kind)
                                               << ", which moves host memory only; no transport "
                                                  "here moves GPU memory to it (rdma between "
                                                  "hosts, cuda on one host with the same device "
                                                  "layer on both sides)");
  }

  // Chooses what moves GPU memory to a newly opened peer (PeerEntry::device). A forced
  // transport (MC_TRANSPORT) is the only one that moves bytes, for GPU memory too: through
  // staging when it does not reach GPU memory itself.
  void connectDevice(PeerEntry* e, const SegmentDesc& local, const SegmentDesc& remote,
                     Deadline deadline) {
    if (transports[static_cast<int>(e->kind)]->reachesDeviceMemory()) {
      e->device = e->data;
      e->device_kind = e->kind;
      return;
    }
    for (int k = 0; k < kNumTransportKinds && forced < 0; ++k) {
      Transport* t = transports[k].get();
      if (t == nullptr || !t->reachesDeviceMemory() || !t->canReach(local, remote)) continue;
      auto p = t->connect(remote, deadline, true, e->control->controlLink());
      if (!p.ok()) {
        MC_LOG(WARN, ENGINE) << "GPU memory to " << remote.name << ": " << transportName(TransportKind(k))
                             << " does not connect: " << p.status().message();
        continue;
      }
      e->device_owned = std::move(p).value();
      e->device = e->device_owned.get();
      e->device_kind = TransportKind(k);
      if (auto dev = device::get(); dev.ok() && TransportKind(k) == TransportKind::kCuda)
        e->staged = makeStagingPeer(e->data, e->kind, nullptr, *dev, &ctx, remote);
      return;
    }
    // None reaches it: this side's GPU memory is staged through host memory over the peer's
    // own transport (device_staging.h), and the peer's GPU memory goes over tcp, whose target
    // side stages it: the peer's data transport when that is tcp, else the engine's tcp control
    // connection to it (a process without a device layer, a store master wiping a record in a
    // GPU segment on its host; not when another transport is forced).
    auto dev = device::get();
    TransportPeer* gpu_host =
        forced < 0 || forced == static_cast<int>(TransportKind::kTcp) ? e->control.get() : nullptr;
    e->device_owned =
        makeStagingPeer(e->data, e->kind, gpu_host, dev.ok() ? *dev : nullptr, &ctx, remote);
    e->device = e->device_owned.get();
    e->device_kind = e->kind;
  }

  static int gpuRegions(const SegmentDesc& d) {
    int n = 0;
    for (const RegionDesc& r : d.regions) n += r.kind == MemoryKind::kCuda;
    return n;
  }

  BouncePool* bouncePool() {
    std::lock_guard<std::mutex> g(bounce_mu);
    if (bounce) return bounce.get();
    size_t chunk = static_cast<size_t>(
        std::clamp<int64_t>(params::getInt("MC_BOUNCE_CHUNK_BYTES"), 4096, 64ll << 20));
    size_t total = static_cast<size_t>(std::max<int64_t>(params::getInt("MC_BOUNCE_BYTES"), 0));
    size_t n = std::max<size_t>(2, total / chunk);
    auto mem = allocateRegistered(chunk * n);
    if (!mem.ok()) {
      MC_LOG(ERROR, ENGINE) << "cannot allocate the bounce pool (" << chunk * n
                            << " bytes): " << mem.status().toString();
      return nullptr;
    }
    bounce_mem = *mem;
    bounce = std::make_unique<BouncePool>(static_cast<char*>(bounce_mem), chunk, n);
    MC_LOG(INFO, ENGINE) << "bounce pool: " << n << " chunks of " << chunk << " bytes";
    return bounce.get();
  }

  PeerEntry* peer(PeerId p) const {
    std::shared_lock<std::shared_mutex> g(peers_mu);
    if (p < 0 || static_cast<size_t>(p) >= peers.size()) return nullptr;
    return peers[p].get();
  }

  PeerId peerIdOf(uint64_t engine_id) const {
    std::shared_lock<std::shared_mutex> g(peers_mu);
    auto it = by_engine.find(engine_id);
    return it == by_engine.end() ? kInvalidPeer : it->second;
  }

  Status peerStatus(const PeerEntry* e) const {
    if (!e->dead.load(std::memory_order_acquire)) {
      // The control link may already fail requests while the engine has not heard yet.
      return e->control ? e->control->health() : Status::OK();
    }
    std::lock_guard<std::mutex> g(const_cast<PeerEntry*>(e)->mu);
    return e->why;
  }

  std::string authenticatedName(uint64_t engine_id) const {
    std::shared_lock<std::shared_mutex> g(peers_mu);
    auto h = hellos.find(engine_id);
    if (h != hellos.end()) return h->second.name;
    auto it = by_engine.find(engine_id);
    return it == by_engine.end() ? std::string() : peers[it->second]->desc.name;
  }

  void reportGone(uint64_t engine_id, const Status& why) {
    {
      std::lock_guard<std::mutex> g(gone_mu);
      if (gone_handlers.empty() || !gone.insert(engine_id).second) return;
    }
    std::string name = authenticatedName(engine_id);
    // gone_run_mu: removePeerGoneHandler waits out a call in flight.
    std::lock_guard<std::recursive_mutex> running(gone_run_mu);
    std::vector<PeerGoneHandler> hs;
    {
      std::lock_guard<std::mutex> g(gone_mu);
      for (auto& [id, h] : gone_handlers) hs.push_back(h);
    }
    for (auto& h : hs) h(engine_id, name, why);
  }

  // orderly: the peer's engine said it is stopping (a normal end of job: logged at INFO).
  void onPeerFailure(uint64_t engine_id, const Status& why, bool orderly) {
    reassembly.discardSender(engine_id);  // the part of a message it left in the inbox
    reportGone(engine_id, why);
    for (auto& t : transports)
      if (t) t->onPeerGone(engine_id);
    PeerId p = peerIdOf(engine_id);
    PeerEntry* e = peer(p);
    if (e == nullptr) return;
    {
      std::lock_guard<std::mutex> g(e->mu);
      if (e->dead.load()) return;
      e->why = why.code() == Code::kPeerDead
                   ? why
                   : MC_STATUS(kPeerDead, "peer " << e->desc.name << " lost: " << why.message());
      e->dead.store(true, std::memory_order_release);
    }
    if (orderly)
      MC_LOG(INFO, ENGINE) << "peer " << e->desc.name << " left: " << why.message();
    else
      MC_LOG(WARN, ENGINE) << "peer " << e->desc.name << " failed: " << why.toString();
    if (e->data != nullptr && e->data != e->control.get()) e->data->fail(e->why);
    if (e->device_owned) e->device_owned->fail(e->why);
    if (e->staged) e->staged->fail(e->why);
    if (e->control) e->control->fail(e->why);
  }

  // Guards opts.name while create() may still rename the engine (name_with_port) and the tcp
  // listener, already up, could be asked for the descriptor.
  mutable std::mutex name_mu;

  SegmentDesc localSegment() const {
    SegmentDesc d;
    {
      std::lock_guard<std::mutex> g(name_mu);
      d.name = opts.name;
    }
    d.engine_id = id;
    d.host_id = host_id;
    d.pid = getpid();
    d.inbox_shm = inbox ? inbox->shmName() : "";
    d.regions_version = registry.version();
    for (const auto& t : transports)
      if (t) t->fillLocalSegment(&d);
    for (const auto& r : registry.snapshot()) {
      RegionDesc rd;
      rd.addr = r.addr;
      rd.len = r.len;
      rd.kind = r.kind;
      rd.device = r.device;
      rd.shm_name = r.shm_name;
      for (int i = 0; i < kNumTransportKinds; ++i) rd.keys[i] = r.keys[i];
      d.regions.push_back(std::move(rd));
    }
    return d;
  }

  void dispatchLoop() {
    Inbox::Fragment f;
    Inbox::ServiceNotify sn;
    // A same-host sender writes its engine id into our inbox itself: accept it only from an
    // engine that authenticated to us (every sender opens us over tcp first, HELLO + DESC).
    auto from_stranger = [this](uint64_t src) {
      if (authenticated(src)) return false;
      if (dropped_msgs.fetch_add(1) == 0) {
        MC_LOG(WARN, ENGINE) << "dropping a message from engine " << hex16(src)
                             << ", which never authenticated here (logged once)";
      }
      return true;
    };
    while (!stopping.load()) {
      reassembly.sweep();  // parts of messages whose senders are gone (onPeerFailure)
      int got = inbox->waitDispatch(&sn, &f, deadlineInMs(100));
      if (got == 0) continue;
      if (got == 1) {
        // Same-host peers push these themselves, like fragments: only from authenticated ones.
        if (!authenticated(sn.src_engine)) continue;
        deliverNotify(Notification{sn.src_engine, peerIdOf(sn.src_engine), sn.tag, sn.channel});
        continue;
      }
      // Reassembled per sender (MessageReassembler): a part that its sender gave up on or
      // left behind is dropped there. Nothing is held for a stranger.
      if (f.offset == 0 && f.data.size() < f.total && from_stranger(f.src_engine)) continue;
      std::string body;
      if (!reassembly.add(f, &body) || from_stranger(f.src_engine)) continue;
      deliver(Message{f.src_engine, peerIdOf(f.src_engine), f.channel, std::move(body)});
    }
  }

  bool authenticated(uint64_t engine_id) const {
    std::shared_lock<std::shared_mutex> g(peers_mu);
    return hellos.count(engine_id) != 0 || by_engine.count(engine_id) != 0;
  }

  void localDispatchLoop() {
    for (;;) {
      Message m;
      Notification n{};
      bool is_notify = false;
      {
        std::unique_lock<std::mutex> g(local_mu);
        local_cv.wait(g, [&] {
          return stopping.load() || !local_msgs.empty() || !local_notifies.empty();
        });
        if (stopping.load()) return;
        if (!local_notifies.empty()) {
          n = local_notifies.front();
          local_notifies.pop_front();
          is_notify = true;
        } else {
          m = std::move(local_msgs.front());
          local_msgs.pop_front();
        }
      }
      if (is_notify) {
        n.peer = peerIdOf(n.src_engine);
        deliverNotify(n);
        continue;
      }
      m.peer = peerIdOf(m.src_engine);
      deliver(std::move(m));
    }
  }

  void enqueueLocalNotify(uint64_t src, uint32_t channel, uint64_t tag) {
    std::lock_guard<std::mutex> g(local_mu);
    local_notifies.push_back(Notification{src, kInvalidPeer, tag, channel});
    local_cv.notify_one();
  }

  // Runs the channel's notification handler on the calling dispatcher, or queues it until
  // one is set.
  void deliverNotify(const Notification& n) {
    std::function<void(const Notification&)> h;
    std::lock_guard<std::mutex> running(handler_run_mu);
    {
      std::lock_guard<std::mutex> g(msg_mu);
      auto it = notify_handlers.find(n.channel);
      if (it != notify_handlers.end() && it->second) {
        h = it->second;
      } else {
        notify_queues[n.channel].push_back(n);
        return;
      }
    }
    h(n);
  }

  void enqueueLocal(uint64_t src, uint32_t channel, std::string&& payload) {
    std::lock_guard<std::mutex> g(local_mu);
    local_msgs.push_back(Message{src, kInvalidPeer, channel, std::move(payload)});
    local_cv.notify_one();
  }

  // Runs the channel's handler on the calling dispatcher, or queues for waitMessage().
  void deliver(Message&& m) {
    std::function<void(Message&&)> h;
    std::lock_guard<std::mutex> running(handler_run_mu);
    {
      std::lock_guard<std::mutex> g(msg_mu);
      auto it = handlers.find(m.channel);
      if (it != handlers.end() && it->second) {
        h = it->second;
      } else {
        queues[m.channel].push_back(std::move(m));
        msg_cv.notify_all();
        return;
      }
    }
    h(std::move(m));
  }

  // Records one request's completion. The batch's mutex is held while the count drops so
  // that a waiter that saw the count reach zero (and then takes the mutex once) knows the
  // completer no longer touches the batch.
  void finishOne(Batch* b, BatchId id, size_t i, Status s) {
    bool erase = false;
    {
      std::lock_guard<std::mutex> g(b->mu);
      b->status[i] = std::move(s);
      if (b->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        b->cv.notify_all();
        erase = b->abandoned;
      }
    }
    if (erase) {
      std::shared_ptr<Batch> keep;
      {
        std::lock_guard<std::mutex> bg(batches_mu);
        auto it = batches.find(id);
        if (it != batches.end()) {
          keep = std::move(it->second);
          batches.erase(it);
        }
      }
      if (keep) {
        std::vector<std::shared_ptr<void>> owners;
        {
          std::lock_guard<std::mutex> g(keep->mu);
          owners.swap(keep->owners);
        }
        if (!owners.empty()) dropOwnersLater(std::move(owners));
      }
    }
  }
};

}  // namespace mooncake::engine
