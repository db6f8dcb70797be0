// The engine: creation, memory registration, peers (engine_data.cc: transfers, notifications,
// messages; engine_impl.h: the internals both share).
#include "engine/engine.h"

#include "engine/engine_impl.h"

namespace mooncake::engine {


TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() { impl_->shutdown(); }

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  const std::string given_name = options.name;  // name_with_port appends to it
  if (options.name.empty()) options.name = "engine-" + hex16(m.id);
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
  auto inbox = Inbox::create("/" + prefix + "-inbox-" + shmOwnerTag() + "-" + hex16(m.id),
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
  MC_LOG(INFO, ENGINE) << "engine " << m.opts.name << " id " << hex16(m.id) << " host " << m.host_id
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
  // Out of the registry first (no transfer is admitted into it after that), then out of the
  // transports while it is still mapped (tcp copies the READ responses still queued out of
  // it), then freed or unmapped; as unregisterMemory() does before the caller frees.
  if (r->kind == MemoryKind::kCuda) {
    MC_RETURN_IF_ERROR(impl_->registry.remove(r->addr).status());
    impl_->unregisterWithTransports(*r);
    impl_->device_regions.fetch_sub(1);
    auto dev = device::layerOf(p);  // the layer that made it (MC_DEVICE may differ now)
    return dev.ok() ? (*dev)->free(p) : dev.status();
  }
  return impl_->registry.freeShm(p, [this](const Region& r) { impl_->unregisterWithTransports(r); });
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
  // (Engine-owned memory is refused before its removal: removing and adding it back would make
  // it a new registration, which WRITEs arriving into it meanwhile may not enter.)
  auto owned = impl_->registry.find(reinterpret_cast<uint64_t>(addr), 1);
  if (owned.has_value() && owned->addr == reinterpret_cast<uint64_t>(addr) && owned->engine_owned)
    return MC_STATUS(kInvalidArgument, "unregisterMemory: " << addr << " was allocated by the "
                                                            << "engine; use free()");
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
  if (e->staged) MC_RETURN_IF_ERROR(e->staged->updateRemote(remote));
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

}  // namespace mooncake::engine
