#include "engine/engine.h"

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

namespace {

uint64_t randomId() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v == 0 ? 1 : v;
}

std::string hex(uint64_t v) {
  char b[24];
  snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

// One batch of requests: statuses and a countdown. Lives in the engine's table until it
// completed and was waited for (a batch abandoned by a timed-out wait is dropped when its
// last request completes).
struct Batch {
  std::vector<Task> tasks;
  std::vector<Status> status;
  std::atomic<int64_t> pending{0};
  std::mutex mu;
  std::condition_variable cv;
  bool abandoned = false;  // guarded by mu
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
  std::atomic<int> remote_gpu_regions{0};  // GPU regions in the peer's descriptor
  std::atomic<bool> dead{false};
  std::mutex mu;
  Status why;  // guarded by mu
};

using PeerGoneHandler = TransferEngine::PeerGoneHandler;

class TransferEngine::Impl {
 public:
  EngineOptions opts;
  uint64_t id = randomId();
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
    auto dev = device::get();
    for (const Region& r : registry.snapshot())
      if (r.kind == MemoryKind::kCuda && r.engine_owned && dev.ok())
        (void)(*dev)->free(reinterpret_cast<void*>(r.addr));
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
    if (!gpu && e->remote_gpu_regions.load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> g(e->mu);
      const RegionDesc* rr = e->desc.findRegion(r.remote, n);
      gpu = rr != nullptr && rr->kind == MemoryKind::kCuda;
      side = "the peer's memory";
    }
    if (!gpu) return e->data;
    if (e->device != nullptr) return e->device;
    return MC_STATUS(kNotSupported, "request " << i << ": " << side << " at "
                                               << (side[0] == 'i' ? a : r.remote)
                                               << " is GPU memory and peer " << e->desc.name
                                               << " is reached over " << transportName(e->kind)
                                               << ", which moves host memory only; no transport "
                                                  "here moves GPU memory to it (rdma between "
                                                  "hosts, cuda on one host with the same device "
                                                  "layer on both sides)");
  }

  // Chooses what moves GPU memory to a newly opened peer (PeerEntry::device). A forced
  // transport (MC_TRANSPORT) is the only one used, for GPU memory too.
  void connectDevice(PeerEntry* e, const SegmentDesc& local, const SegmentDesc& remote,
                     Deadline deadline) {
    if (transports[static_cast<int>(e->kind)]->reachesDeviceMemory()) {
      e->device = e->data;
      e->device_kind = e->kind;
      return;
    }
    if (forced >= 0) return;
    for (int k = 0; k < kNumTransportKinds; ++k) {
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
      return;
    }
    // None reaches it: this side's GPU memory is staged through host memory over the peer's
    // own transport (device_staging.h), where this process has a device layer at all.
    auto dev = device::get();
    if (!dev.ok()) return;
    e->device_owned = makeStagingPeer(e->data, e->kind, *dev, &ctx, remote);
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
    if (!e->dead.load(std::memory_order_acquire)) return Status::OK();
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
    // Reassembly of fragmented messages by (sender, message id).
    std::map<std::pair<uint64_t, uint64_t>, std::string> partial;
    Inbox::Fragment f;
    Inbox::ServiceNotify sn;
    while (!stopping.load()) {
      int got = inbox->waitDispatch(&sn, &f, deadlineInMs(100));
      if (got == 0) continue;
      if (got == 1) {
        // Same-host peers push these themselves, like fragments: only from authenticated ones.
        if (!authenticated(sn.src_engine)) continue;
        deliverNotify(Notification{sn.src_engine, peerIdOf(sn.src_engine), sn.tag, sn.channel});
        continue;
      }
      std::string body;
      if (f.offset == 0 && f.data.size() == f.total) {
        body = std::move(f.data);
      } else {
        auto key = std::make_pair(f.src_engine, f.msg_id);
        std::string& buf = partial[key];
        if (buf.size() != f.offset) {  // fragments of one message arrive in order
          MC_LOG(WARN, ENGINE) << "dropping out-of-order message fragment from " << hex(f.src_engine);
          partial.erase(key);
          continue;
        }
        buf += f.data;
        if (buf.size() < f.total) continue;
        body = std::move(buf);
        partial.erase(key);
      }
      // A same-host sender writes its engine id into our inbox itself: accept it only from an
      // engine that authenticated to us (every sender opens us over tcp first, HELLO + DESC).
      if (!authenticated(f.src_engine)) {
        if (dropped_msgs.fetch_add(1) == 0) {
          MC_LOG(WARN, ENGINE) << "dropping a message from engine " << hex(f.src_engine)
                               << ", which never authenticated here (logged once)";
        }
        continue;
      }
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
    }
  }
};

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() { impl_->shutdown(); }

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  const std::string given_name = options.name;  // name_with_port appends to it
  if (options.name.empty()) options.name = "engine-" + hex(m.id);
  {
    auto secret = resolveSecret(options.secret, SecretFile::kIfSet);
    if (!secret.ok()) return secret.status();
    options.secret = std::move(secret).value();
    MC_RETURN_IF_ERROR(checkSecret(options.secret, "transfer engine " + options.name));
  }
  if (options.host.empty()) options.host = params::getString("MC_TCP_BIND_HOST");
  if (options.host.empty() && !options.reach_host.empty()) {
    options.host = sock::localAddressToward(options.reach_host);
    if (options.host.empty())
      return MC_STATUS(kUnavailable, "transfer engine " << options.name << ": no local address "
                                                         << "routes to " << options.reach_host);
  }
  if (options.host.empty()) options.host = sock::firstNonLoopbackIPv4();
  if (options.transport.empty()) options.transport = params::getString("MC_TRANSPORT");
  if (options.tcp_conns_per_peer <= 0)
    options.tcp_conns_per_peer =
        static_cast<int>(std::max<int64_t>(1, params::getInt("MC_TCP_CONNS_PER_PEER")));
  m.opts = options;
  if (!options.transport.empty()) {
    const TransportRow* row = findTransport(options.transport);
    if (row == nullptr || row->make == nullptr) {
      std::string have;
      for (int k = 0; k < kNumTransportKinds; ++k)
        if (transportTable()[k].make != nullptr)
          have += std::string(have.empty() ? "" : ", ") + transportTable()[k].name;
      return MC_STATUS(kInvalidArgument, "transport '" << options.transport << "' "
                                             << (row == nullptr ? "is unknown" : "is not built in")
                                             << " (this build has " << have << ")");
    }
    m.forced = static_cast<int>(row->kind);
  }
  std::string prefix = params::getString("MC_SHM_PREFIX");
  reapStaleShm(prefix);
  auto inbox = Inbox::create("/" + prefix + "-inbox-" + std::to_string(getpid()) + "-" + hex(m.id),
                             static_cast<uint32_t>(params::getInt("MC_INBOX_SLOTS")));
  if (!inbox.ok()) return inbox.status();
  m.inbox = std::move(inbox).value();

  Impl* raw = impl.get();
  m.ctx.engine_id = m.id;
  m.ctx.secret = options.secret;
  m.ctx.tcp_host = options.host;
  m.ctx.registry = &m.registry;
  m.ctx.inbox = m.inbox.get();
  m.ctx.buffers = &m.buffers;
  m.ctx.local_segment = [raw] { return raw->localSegment(); };
  m.ctx.on_peer_failure = [raw](uint64_t eid, Status why, bool orderly) {
    raw->onPeerFailure(eid, why, orderly);
  };
  m.ctx.deliver_message = [raw](uint64_t src, uint32_t channel, std::string&& payload) {
    raw->enqueueLocal(src, channel, std::move(payload));
  };
  m.ctx.deliver_notify = [raw](uint64_t src, uint32_t channel, uint64_t tag) {
    raw->enqueueLocalNotify(src, channel, tag);
  };
  m.ctx.bounce = [raw] { return raw->bouncePool(); };
  m.ctx.on_exchange = [raw](uint64_t src, TransportKind kind, std::string req,
                            std::function<void(Result<std::string>)> reply) {
    SegmentDesc from;
    {
      std::shared_lock<std::shared_mutex> g(raw->peers_mu);
      auto it = raw->hellos.find(src);
      if (it == raw->hellos.end()) {
        g.unlock();
        return reply(MC_STATUS(kPermissionDenied, "exchange from an engine without a handshake"));
      }
      from = it->second;
    }
    Transport* t = raw->transports[static_cast<int>(kind)].get();
    if (t == nullptr)
      return reply(MC_STATUS(kNotSupported, "this engine has no " << transportName(kind)
                                                                  << " transport"));
    t->onExchange(from, std::move(req), std::move(reply));
  };
  m.ctx.on_peer_hello = [raw](const SegmentDesc& d) {
    {
      std::unique_lock<std::shared_mutex> g(raw->peers_mu);
      raw->hellos[d.engine_id] = d;
    }
    std::lock_guard<std::mutex> g(raw->gone_mu);
    raw->gone.erase(d.engine_id);  // back (a new link): its next departure is reported again
  };

  TransportOptions topts;
  topts.tcp_data_conns = options.tcp_conns_per_peer;
  for (int k = 0; k < kNumTransportKinds; ++k) {
    const TransportRow& row = transportTable()[k];
    if (row.make == nullptr) continue;
    m.transports[k] = row.make(topts);
    Status st = m.transports[k]->start(&m.ctx);
    if (!st.ok()) {
      // A transport without usable hardware (rdma without NICs) steps aside; tcp must work.
      if (row.kind == TransportKind::kTcp || m.forced == k) return st;
      MC_LOG(INFO, ENGINE) << "transport " << row.name << " unavailable: " << st.message();
      m.transports[k]->stop();
      m.transports[k].reset();
    }
  }
  if (m.forced >= 0 && m.transports[m.forced] && !m.transports[m.forced]->movesHostMemory())
    return MC_STATUS(kInvalidArgument, "transport '" << options.transport << "' moves GPU memory "
                                                     << "only; it cannot be forced for every peer");
  if (options.name_with_port) {
    // The listener's port is known only now; nothing has used the name yet.
    SegmentDesc d;
    m.transports[static_cast<int>(TransportKind::kTcp)]->fillLocalSegment(&d);
    std::string host = given_name.empty() ? d.tcp_host : given_name;
    if (host.find(':') != std::string::npos && host.front() != '[') host = "[" + host + "]";
    std::lock_guard<std::mutex> g(m.name_mu);
    m.opts.name = host + ":" + std::to_string(d.tcp_port);
  }
  m.dispatcher = std::thread([raw] { raw->dispatchLoop(); });
  m.local_dispatcher = std::thread([raw] { raw->localDispatchLoop(); });
  MC_LOG(INFO, ENGINE) << "engine " << m.opts.name << " id " << hex(m.id) << " host " << m.host_id
                       << " transport " << (options.transport.empty() ? "auto" : options.transport);
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

uint64_t TransferEngine::engineId() const { return impl_->id; }
const std::string& TransferEngine::name() const { return impl_->opts.name; }
SegmentDesc TransferEngine::localSegment() const { return impl_->localSegment(); }

Result<void*> TransferEngine::allocate(size_t len, MemoryKind kind, int device) {
  if (kind == MemoryKind::kHost) return impl_->allocateRegistered(len);
  auto dev = device::get();
  if (!dev.ok())
    return MC_STATUS(kNotSupported, "allocate: no GPU memory here: " << dev.status().message());
  if (len == 0) return MC_STATUS(kInvalidArgument, "allocate: 0 bytes");
  MC_ASSIGN_OR_RETURN(void* p, (*dev)->allocate(len, device < 0 ? 0 : device));
  Status st = registerDevice(p, len, device < 0 ? 0 : device, true);
  if (!st.ok()) {
    (void)(*dev)->free(p);
    return st;
  }
  return p;
}

Status TransferEngine::free(void* p) {
  auto r = impl_->registry.find(reinterpret_cast<uint64_t>(p), 1);
  if (!r || r->addr != reinterpret_cast<uint64_t>(p) || !r->engine_owned)
    return MC_STATUS(kInvalidArgument, "pointer " << p << " was not allocated by the engine");
  impl_->unregisterWithTransports(*r);
  if (r->kind == MemoryKind::kCuda) {
    MC_RETURN_IF_ERROR(impl_->registry.remove(r->addr).status());
    impl_->device_regions.fetch_sub(1);
    auto dev = device::get();  // it made this allocation, so it exists
    return dev.ok() ? (*dev)->free(p) : dev.status();
  }
  return impl_->registry.freeShm(p);
}

Status TransferEngine::registerDevice(void* addr, size_t len, int device, bool owned) {
  auto dev = device::get();
  if (!dev.ok())
    return MC_STATUS(kNotSupported, "registerMemory: CUDA memory at " << addr << ": "
                                                                     << dev.status().message());
  if (len == 0) return MC_STATUS(kInvalidArgument, "registerMemory: 0 bytes at " << addr);
  device::PointerInfo first = (*dev)->pointer(addr);
  device::PointerInfo last = (*dev)->pointer(static_cast<char*>(addr) + len - 1);
  if (!first.device || !last.device || first.ordinal != last.ordinal)
    return MC_STATUS(kInvalidArgument, "registerMemory: [" << addr << ", +" << len
                                                           << ") is not memory of one "
                                                           << (*dev)->name() << " device");
  if (device >= 0 && device != first.ordinal)
    return MC_STATUS(kInvalidArgument, "registerMemory: " << addr << " was given as device "
                                                          << device << " but is on device "
                                                          << first.ordinal);
  Region r;
  r.addr = reinterpret_cast<uint64_t>(addr);
  r.len = len;
  r.kind = MemoryKind::kCuda;
  r.device = first.ordinal;
  r.engine_owned = owned;
  MC_RETURN_IF_ERROR(impl_->registerWithTransports(&r));
  Status st = impl_->registry.add(r);
  if (!st.ok()) {
    impl_->unregisterWithTransports(r);
    return st;
  }
  impl_->device_regions.fetch_add(1);
  device::noteUse();
  return Status::OK();
}

Status TransferEngine::registerMemory(void* addr, size_t len, MemoryKind kind, int device) {
  if (addr == nullptr) return MC_STATUS(kInvalidArgument, "registerMemory: null address");
  if (kind == MemoryKind::kCuda) return registerDevice(addr, len, device, false);
  {
    Status mapped = checkMappedWritable(reinterpret_cast<uint64_t>(addr), len);
    if (!mapped.ok()) return Status(mapped.code(), "registerMemory: " + mapped.message());
  }
  Region r;
  r.addr = reinterpret_cast<uint64_t>(addr);
  r.len = len;
  r.kind = kind;
  r.device = device;
  MC_RETURN_IF_ERROR(impl_->registerWithTransports(&r));
  Status st = impl_->registry.add(r);
  if (!st.ok()) impl_->unregisterWithTransports(r);
  return st;
}

Status TransferEngine::unregisterMemory(void* addr) {
  auto r = impl_->registry.remove(reinterpret_cast<uint64_t>(addr));
  if (!r.ok()) return r.status();
  if (r->engine_owned) {
    // Put it back: engine-owned memory is released with free().
    (void)impl_->registry.add(*r);
    return MC_STATUS(kInvalidArgument, "unregisterMemory: " << addr << " was allocated by the "
                                                            << "engine; use free()");
  }
  impl_->unregisterWithTransports(*r);
  if (r->kind == MemoryKind::kCuda) impl_->device_regions.fetch_sub(1);
  return Status::OK();
}

bool TransferEngine::isRegistered(const void* addr, uint64_t len) const {
  return impl_->registry.find(reinterpret_cast<uint64_t>(addr), len).has_value();
}

Result<SegmentDesc> TransferEngine::queryPeer(const std::string& host, uint16_t port,
                                              Deadline deadline) {
  return tcp::queryDescriptor(host, port, impl_->opts.secret, impl_->id, deadline);
}

Status TransferEngine::publish(Rendezvous& rdv) {
  return rdv.set("mc/seg/" + impl_->opts.name, impl_->localSegment().serialize());
}

Result<PeerId> TransferEngine::openPeer(const SegmentDesc& remote, Deadline deadline) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> og(m.open_mu);
  PeerId existing = m.peerIdOf(remote.engine_id);
  if (existing != kInvalidPeer) {
    PeerEntry* e = m.peer(existing);
    if (m.peerStatus(e).ok()) {
      MC_RETURN_IF_ERROR(updatePeer(existing, remote));
      return existing;
    }
  }
  SegmentDesc local = m.localSegment();
  int kind = -1;
  if (m.forced >= 0) {
    Transport* t = m.transports[m.forced].get();
    if (t == nullptr || !t->canReach(local, remote))
      return MC_STATUS(kUnavailable, "transport " << transportName(TransportKind(m.forced))
                                                  << " (forced) cannot reach " << remote.name
                                                  << " from " << local.name);
    kind = m.forced;
  } else {
    for (int k = 0; k < kNumTransportKinds; ++k) {
      if (m.transports[k] && m.transports[k]->movesHostMemory() &&
          m.transports[k]->canReach(local, remote)) {
        kind = k;
        break;
      }
    }
  }
  if (kind < 0)
    return MC_STATUS(kUnavailable, "no transport reaches " << remote.name << " (host "
                                                           << remote.host_id << ") from "
                                                           << local.name << " (host "
                                                           << local.host_id << ")");
  auto entry = std::make_unique<PeerEntry>();
  entry->desc = remote;
  entry->kind = TransportKind(kind);
  entry->remote_gpu_regions.store(Impl::gpuRegions(remote));
  bool tcp_data = kind == static_cast<int>(TransportKind::kTcp);
  auto control = m.transports[static_cast<int>(TransportKind::kTcp)]->connect(remote, deadline,
                                                                              tcp_data, nullptr);
  if (!control.ok()) return control.status();
  entry->control = std::move(control).value();
  if (tcp_data) {
    entry->data = entry->control.get();
  } else {
    auto data = m.transports[kind]->connect(remote, deadline, true, entry->control->controlLink());
    if (!data.ok()) return data.status();
    entry->data_owned = std::move(data).value();
    entry->data = entry->data_owned.get();
  }
  m.connectDevice(entry.get(), local, remote, deadline);
  std::unique_lock<std::shared_mutex> g(m.peers_mu);
  PeerId id = static_cast<PeerId>(m.peers.size());
  m.peers.push_back(std::move(entry));
  m.by_engine[remote.engine_id] = id;
  MC_LOG(INFO, ENGINE) << m.opts.name << " opened peer " << remote.name << " as " << id
                       << " over " << transportName(TransportKind(kind));
  return id;
}

Result<PeerId> TransferEngine::openPeer(Rendezvous& rdv, const std::string& name,
                                        Deadline deadline) {
  auto blob = rdv.wait("mc/seg/" + name, deadline);
  if (!blob.ok()) return blob.status();
  auto desc = SegmentDesc::parse(*blob);
  if (!desc.ok()) return desc.status();
  return openPeer(*desc, deadline);
}

Status TransferEngine::updatePeer(PeerId peer, const SegmentDesc& remote) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "updatePeer: unknown peer " << peer);
  if (remote.engine_id != e->desc.engine_id)
    return MC_STATUS(kInvalidArgument, "updatePeer: descriptor of another engine");
  MC_RETURN_IF_ERROR(e->control->updateRemote(remote));
  if (e->data != e->control.get()) MC_RETURN_IF_ERROR(e->data->updateRemote(remote));
  if (e->device_owned) MC_RETURN_IF_ERROR(e->device_owned->updateRemote(remote));
  std::lock_guard<std::mutex> g(e->mu);
  e->desc = remote;
  e->remote_gpu_regions.store(Impl::gpuRegions(remote));
  return Status::OK();
}

Status TransferEngine::peerStatus(PeerId peer) const {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "unknown peer " << peer);
  return impl_->peerStatus(e);
}

std::string TransferEngine::peerTransport(PeerId peer) const {
  PeerEntry* e = impl_->peer(peer);
  return e == nullptr ? "" : transportName(e->kind);
}

const SegmentDesc* TransferEngine::peerSegment(PeerId peer) const {
  PeerEntry* e = impl_->peer(peer);
  return e == nullptr ? nullptr : &e->desc;
}

Result<BatchId> TransferEngine::submit(const std::vector<TransferRequest>& requests) {
  Impl& m = *impl_;
  std::vector<PeerEntry*> targets(requests.size());
  std::vector<TransportPeer*> routes(requests.size());  // data, or device for GPU memory
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    PeerEntry* e = m.peer(r.peer);
    if (e == nullptr) return MC_STATUS(kInvalidArgument, "request " << i << ": unknown peer " << r.peer);
    if (r.local == nullptr && r.length > 0)
      return MC_STATUS(kInvalidArgument, "request " << i << ": null local address");
    MC_RETURN_IF_ERROR(m.peerStatus(e));
    targets[i] = e;
    routes[i] = e->data;
    if (m.device_regions.load(std::memory_order_relaxed) > 0 || device::active() ||
        e->remote_gpu_regions.load(std::memory_order_relaxed) > 0) {
      MC_ASSIGN_OR_RETURN(routes[i], m.route(r, i, e));
    }
  }
  auto b = std::make_shared<Batch>();
  BatchId id = m.next_batch.fetch_add(1);
  b->tasks.resize(requests.size());
  b->status.resize(requests.size() + 1);  // the last slot belongs to the posting guard
  b->pending.store(static_cast<int64_t>(requests.size()) + 1);  // +1 until all are posted
  {
    std::lock_guard<std::mutex> g(m.batches_mu);
    m.batches[id] = b;
  }
  Batch* raw = b.get();
  Impl* mp = &m;
  auto finish_one = [mp, raw, id](size_t i, Status s) { mp->finishOne(raw, id, i, std::move(s)); };
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    Task& t = b->tasks[i];
    t.op = r.op;
    t.local = r.local;
    t.length = r.length;
    t.remote = r.remote;
    t.on_done = [finish_one, i](Status s) { finish_one(i, std::move(s)); };
    routes[i]->submit(&t);
  }
  finish_one(requests.size(), Status::OK());  // drop the posting guard
  return id;
}

Status TransferEngine::poll(BatchId id, bool* done, std::vector<Status>* per_request) {
  std::shared_ptr<Batch> b;
  {
    std::lock_guard<std::mutex> g(impl_->batches_mu);
    auto it = impl_->batches.find(id);
    if (it == impl_->batches.end()) return MC_STATUS(kNotFound, "unknown batch " << id);
    b = it->second;
  }
  *done = b->pending.load(std::memory_order_acquire) == 0;
  if (*done && per_request != nullptr) {
    std::lock_guard<std::mutex> g(b->mu);
    per_request->assign(b->status.begin(), b->status.begin() + b->tasks.size());
  }
  return Status::OK();
}

Status TransferEngine::wait(BatchId id, Deadline deadline, std::vector<Status>* per_request) {
  Impl& m = *impl_;
  std::shared_ptr<Batch> b;
  {
    std::lock_guard<std::mutex> g(m.batches_mu);
    auto it = m.batches.find(id);
    if (it == m.batches.end()) return MC_STATUS(kNotFound, "unknown batch " << id);
    b = it->second;
  }
  auto is_done = [&] { return b->pending.load(std::memory_order_acquire) == 0; };
  if (!is_done()) {
    auto spin_until = Clock::now() + std::chrono::microseconds(m.spin_us);
    while (!is_done() && Clock::now() < spin_until) sched_yield();
  }
  {
    // Taken even when already done: the completer may still hold it (see finishOne).
    std::unique_lock<std::mutex> g(b->mu);
    if (!b->cv.wait_until(g, deadline, is_done)) {
      b->abandoned = true;
      return MC_STATUS(kTimeout, "batch " << id << " not finished by its deadline");
    }
  }
  {
    std::lock_guard<std::mutex> g(m.batches_mu);
    m.batches.erase(id);
  }
  b->status.resize(b->tasks.size());
  if (per_request != nullptr) *per_request = b->status;
  for (size_t i = 0; i < b->status.size(); ++i) {
    if (!b->status[i].ok()) {
      const Status& s = b->status[i];
      return Status(s.code(), "request " + std::to_string(i) + ": " + s.message());
    }
  }
  return Status::OK();
}

Status TransferEngine::transfer(const std::vector<TransferRequest>& requests, Deadline deadline) {
  auto id = submit(requests);
  if (!id.ok()) return id.status();
  return wait(*id, deadline);
}

Status TransferEngine::notify(PeerId peer, uint64_t tag) { return notify(peer, 0, tag); }

Status TransferEngine::notify(PeerId peer, uint32_t channel, uint64_t tag) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "notify: unknown peer " << peer);
  MC_RETURN_IF_ERROR(impl_->peerStatus(e));
  if (e->device_owned) {
    // GPU memory to this peer moves over another transport (cuda): the notification follows
    // those writes too once they are done.
    Status st = e->device_owned->quiesce(deadlineInMs(60000));
    if (!st.ok()) return Status(st.code(), "notify: " + st.message());
  }
  return e->data->notify(channel, tag);
}

void TransferEngine::setNotifyHandler(uint32_t channel,
                                      std::function<void(const Notification&)> handler) {
  if (channel == 0) return;  // channel 0 is waitNotify's
  const auto self = std::this_thread::get_id();
  std::unique_lock<std::mutex> running(impl_->handler_run_mu, std::defer_lock);
  if (self != impl_->dispatcher.get_id() && self != impl_->local_dispatcher.get_id())
    running.lock();
  std::deque<Notification> backlog;
  {
    std::lock_guard<std::mutex> g(impl_->msg_mu);
    impl_->notify_handlers[channel] = handler;
    if (handler) backlog.swap(impl_->notify_queues[channel]);
  }
  for (auto& n : backlog) handler(n);
}

Result<Notification> TransferEngine::waitNotify(Deadline deadline) {
  Notification n{};
  if (!impl_->inbox->waitNotify(&n.src_engine, &n.tag, deadline))
    return MC_STATUS(kTimeout, "no notification before the deadline");
  n.peer = impl_->peerIdOf(n.src_engine);
  return n;
}

bool TransferEngine::pollNotify(Notification* out) {
  if (!impl_->inbox->popNotify(&out->src_engine, &out->tag)) return false;
  out->peer = impl_->peerIdOf(out->src_engine);
  return true;
}

Status TransferEngine::sendMessage(PeerId peer, uint32_t channel, std::string_view payload) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "sendMessage: unknown peer " << peer);
  MC_RETURN_IF_ERROR(impl_->peerStatus(e));
  return (e->data->carriesMessages() ? e->data : e->control.get())->sendMessage(channel, payload);
}

Status TransferEngine::sendMessage(PeerId peer, uint32_t channel, std::string_view payload,
                                   Deadline deadline) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "sendMessage: unknown peer " << peer);
  MC_RETURN_IF_ERROR(impl_->peerStatus(e));
  return (e->data->carriesMessages() ? e->data : e->control.get())->sendMessage(channel, payload, deadline);
}

void TransferEngine::recycleMessageBuffer(std::string&& payload) {
  impl_->buffers.give(std::move(payload));
}

Status TransferEngine::sendMessageOwned(PeerId peer, uint32_t channel, std::string&& payload) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr) return MC_STATUS(kInvalidArgument, "sendMessage: unknown peer " << peer);
  MC_RETURN_IF_ERROR(impl_->peerStatus(e));
  return (e->data->carriesMessages() ? e->data : e->control.get())->sendOwnedMessage(channel, std::move(payload));
}

void TransferEngine::setMessageHandler(uint32_t channel, std::function<void(Message&&)> handler) {
  // Off the dispatchers: hold handler_run_mu through the swap and the replay of queued
  // messages, so that a call of the previous handler in flight is waited out and no newer
  // message reaches the new handler before the queued ones (nor runs beside them). On a
  // dispatcher (a handler installing another) the mutex is already held by this thread.
  const auto self = std::this_thread::get_id();
  std::unique_lock<std::mutex> running(impl_->handler_run_mu, std::defer_lock);
  if (self != impl_->dispatcher.get_id() && self != impl_->local_dispatcher.get_id())
    running.lock();
  std::deque<Message> backlog;
  {
    std::lock_guard<std::mutex> g(impl_->msg_mu);
    impl_->handlers[channel] = handler;
    if (handler) backlog.swap(impl_->queues[channel]);
  }
  for (auto& m : backlog) handler(std::move(m));
}

Result<Message> TransferEngine::waitMessage(uint32_t channel, Deadline deadline) {
  std::unique_lock<std::mutex> g(impl_->msg_mu);
  auto& q = impl_->queues[channel];
  if (!impl_->msg_cv.wait_until(g, deadline, [&] { return !q.empty() || impl_->stopping; }))
    return MC_STATUS(kTimeout, "no message on channel " << channel << " before the deadline");
  if (q.empty()) return MC_STATUS(kCancelled, "engine shutting down");
  Message m = std::move(q.front());
  q.pop_front();
  return m;
}

Result<PeerId> TransferEngine::peerOf(uint64_t engine_id, Deadline deadline) {
  PeerId p = impl_->peerIdOf(engine_id);
  if (p != kInvalidPeer) return p;
  SegmentDesc d;
  {
    std::shared_lock<std::shared_mutex> g(impl_->peers_mu);
    auto it = impl_->hellos.find(engine_id);
    if (it == impl_->hellos.end())
      return MC_STATUS(kNotFound, "engine " << hex(engine_id) << " never connected here");
    d = it->second;
  }
  return openPeer(d, deadline);
}

std::string TransferEngine::authenticatedName(uint64_t engine_id) const {
  return impl_->authenticatedName(engine_id);
}

uint64_t TransferEngine::addPeerGoneHandler(PeerGoneHandler handler) {
  std::lock_guard<std::mutex> g(impl_->gone_mu);
  uint64_t id = impl_->next_gone_handler++;
  impl_->gone_handlers[id] = std::move(handler);
  return id;
}

void TransferEngine::removePeerGoneHandler(uint64_t id) {
  {
    std::lock_guard<std::mutex> g(impl_->gone_mu);
    impl_->gone_handlers.erase(id);
  }
  // Wait for a call in flight (recursive: a handler may remove itself).
  std::lock_guard<std::recursive_mutex> running(impl_->gone_run_mu);
}

void* TransferEngine::mappedAddress(PeerId peer, uint64_t remote, uint64_t len) {
  PeerEntry* e = impl_->peer(peer);
  if (e == nullptr || e->data == nullptr) return nullptr;
  return e->data->mappedAddress(remote, len);
}

}  // namespace mooncake::engine
