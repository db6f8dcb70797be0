#include "store/client/rpc.h"

#include "engine/device/device.h"
#include "engine/log.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace mooncake::store {
namespace {

std::atomic<uint32_t> g_reply_channels{0};
constexpr int64_t kYieldUs = 100;

void putU32(std::string* s, uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  s->append(b, 4);
}
uint32_t getU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace

// ---- server ----

MasterRpcServer::MasterRpcServer(engine::TransferEngine* engine, MasterService* service)
    : engine_(engine), service_(service) {
  auto z = engine_->allocate(64);
  if (z.ok()) {
    zeros_ = *z;
    std::memset(zeros_, 0, 64);
  }
  wipe_thread_ = std::thread([this] { wipeLoop(); });
  service_->setRecordWiper(this);
  for (int i = 0; i < kWorkers; ++i) workers_.emplace_back([this] { workerLoop(); });
  gone_handler_ = engine_->addPeerGoneHandler(
      [this](uint64_t id, const std::string& name, const Status&) { onPeerGone(id, name); });
  engine_->setMessageHandler(kStoreRpcChannel,
                             [this](engine::Message&& m) { onMessage(std::move(m)); });
}

MasterRpcServer::~MasterRpcServer() {
  engine_->setMessageHandler(kStoreRpcChannel, nullptr);
  engine_->removePeerGoneHandler(gone_handler_);
  service_->setRecordWiper(nullptr);
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  {
    std::lock_guard<std::mutex> g(wipe_mu_);
    wipe_stop_ = true;
  }
  wipe_cv_.notify_all();
  wipe_thread_.join();
  if (zeros_ != nullptr) (void)engine_->free(zeros_);
}

bool MasterRpcServer::wipe(const std::string& client_id, uint64_t address, uint64_t token) {
  // Runs under the service's lock: only non-blocking work here.
  const bool own = client_id == engine_->name();  // a master embedded in a client
  if (own && !engine::device::isDeviceMemory(reinterpret_cast<const void*>(address))) {
    std::memset(reinterpret_cast<void*>(address), 0, 8);
    return true;
  }
  engine::PeerId peer = engine::kInvalidPeer;
  if (!own) {  // (our own GPU segment: a device copy, on the wipe thread)
    std::lock_guard<std::mutex> g(mu_);
    auto n = by_name_.find(client_id);
    if (n != by_name_.end()) {
      auto c = clients_.find(n->second);
      if (c != clients_.end()) peer = c->second.peer;
    }
  }
  if (peer != engine::kInvalidPeer) {
    if (void* p = engine_->mappedAddress(peer, address, 8)) {
      // The magic word goes first: a record without it is no record.
      static_cast<std::atomic<uint64_t>*>(p)->store(0, std::memory_order_release);
      return true;
    }
  }
  std::lock_guard<std::mutex> g(wipe_mu_);
  wipes_.push_back({client_id, address, token});
  wipe_cv_.notify_one();
  return false;
}

void MasterRpcServer::wipeLoop() {
  std::unique_lock<std::mutex> lk(wipe_mu_);
  for (;;) {
    wipe_cv_.wait(lk, [&] { return wipe_stop_ || !wipes_.empty(); });
    if (wipe_stop_) return;
    Wipe w = std::move(wipes_.front());
    wipes_.pop_front();
    lk.unlock();
    uint64_t engine_id = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto n = by_name_.find(w.client_id);
      if (n != by_name_.end()) engine_id = n->second;
    }
    bool ok = false;
    if (w.client_id == engine_->name()) {  // our own segment in GPU memory: a device copy
      static const uint64_t kZero = 0;
      ok = engine::device::copy(reinterpret_cast<void*>(w.address), &kZero, 8,
                                engine::deadlineInMs(2000))
               .ok();
    } else if (engine_id != 0 && zeros_ != nullptr) {
      auto peer = engine_->peerOf(engine_id, engine::deadlineInMs(2000));
      if (peer.ok()) {
        std::vector<engine::TransferRequest> req{
            {engine::OpCode::kWrite, zeros_, 8, *peer, w.address}};
        ok = engine_->transfer(req, engine::deadlineInMs(2000)).ok();
      }
    }
    if (!ok) {  // the owner is gone or unreachable: it will not report this record to anyone
      MC_LOG(WARN, STORE) << "master: could not wipe a record in " << w.client_id
                          << "'s segment (owner unreachable); releasing its memory";
    }
    service_->wipeDone(w.token);
    lk.lock();
  }
}

Status MasterRpcServer::publish(engine::Rendezvous& rdv) {
  return rdv.set(std::string("mc/seg/") + kMasterName, engine_->localSegment().serialize());
}

void MasterRpcServer::onPeerGone(uint64_t engine_id, const std::string& name) {
  if (!name.empty()) service_->clientGone(name);
  std::lock_guard<std::mutex> g(mu_);
  auto it = clients_.find(engine_id);
  // A worker holding it finds the peer dead and drops what is left.
  if (it != clients_.end() && !it->second.busy) clients_.erase(it);
  auto n = by_name_.find(name);
  if (n != by_name_.end() && n->second == engine_id) by_name_.erase(n);
}

void MasterRpcServer::onMessage(engine::Message&& m) {
  if (m.payload.size() < 4) return;  // not ours: nothing to answer
  Pending p;
  p.reply_channel = getU32(m.payload.data());
  bool fast = false;
  std::string name;
  engine::PeerId peer = engine::kInvalidPeer;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = clients_.find(m.src_engine);
    if (it == clients_.end()) {
      name = engine_->authenticatedName(m.src_engine);
      if (name.empty()) {
        if (dropped_.fetch_add(1) == 0) {
          MC_LOG(WARN, STORE) << "master: dropping a request from an engine that did not "
                                 "authenticate (logged once)";
        }
        return;
      }
      it = clients_.emplace(m.src_engine, Client{}).first;
      it->second.name = name;
      by_name_[name] = m.src_engine;
    }
    Client& c = it->second;
    if (c.peer == engine::kInvalidPeer && m.peer != engine::kInvalidPeer) c.peer = m.peer;
    name = c.name;
    peer = c.peer;
    fast = !c.busy && c.backlog.empty() && peer != engine::kInvalidPeer;
    if (!fast) {
      if (c.backlog.size() >= kMaxBacklog) {
        dropped_.fetch_add(1);
        return;
      }
      p.request = m.payload.substr(4);
      c.backlog.push_back(std::move(p));
      if (!c.busy) {
        c.busy = true;
        ready_.push_back(m.src_engine);
        cv_.notify_one();
      }
      return;
    }
  }
  // Fast path, on the dispatcher: serve and send without waiting for room.
  p.response = service_->handle(std::string_view(m.payload).substr(4), &name);
  Status st = engine_->sendMessage(peer, p.reply_channel, p.response, engine::Clock::now());
  if (st.ok() || st.code() != Code::kResourceExhausted) return;  // sent, or the client is gone
  // Its inbox is full: a worker waits for room while later requests queue behind this one.
  p.served = true;
  std::lock_guard<std::mutex> g(mu_);
  auto it = clients_.find(m.src_engine);
  if (it == clients_.end()) return;  // gone meanwhile
  Client& c = it->second;
  c.backlog.push_front(std::move(p));
  if (!c.busy) {
    c.busy = true;
    ready_.push_back(m.src_engine);
    cv_.notify_one();
  }
}

void MasterRpcServer::workerLoop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !ready_.empty(); });
    if (stop_) return;
    uint64_t id = ready_.front();
    ready_.pop_front();
    lk.unlock();
    drain(id);
    lk.lock();
  }
}

void MasterRpcServer::drain(uint64_t engine_id) {
  const int64_t timeout_ms = 2000;
  for (;;) {
    Pending p;
    std::string name;
    engine::PeerId peer;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = clients_.find(engine_id);
      if (it == clients_.end()) return;
      Client& c = it->second;
      if (c.backlog.empty()) {
        c.busy = false;
        return;
      }
      p = std::move(c.backlog.front());
      c.backlog.pop_front();
      name = c.name;
      peer = c.peer;
    }
    bool ok = true;
    if (peer == engine::kInvalidPeer || !engine_->peerStatus(peer).ok()) {
      auto opened = engine_->peerOf(engine_id, engine::deadlineInMs(timeout_ms));
      ok = opened.ok();
      if (ok) peer = *opened;
    }
    if (ok) {
      if (!p.served) p.response = service_->handle(p.request, &name);
      ok = engine_->sendMessage(peer, p.reply_channel, p.response, engine::deadlineInMs(timeout_ms))
               .ok();
    }
    std::lock_guard<std::mutex> g(mu_);
    auto it = clients_.find(engine_id);
    if (it == clients_.end()) return;
    if (!ok) {  // unreachable: what it queued is dropped, its calls time out with RPC_FAIL
      dropped_.fetch_add(it->second.backlog.size() + 1);
      clients_.erase(it);
      return;
    }
    it->second.peer = peer;
  }
}

// ---- client ----

ErrorOr<std::unique_ptr<MasterRpcClient>> MasterRpcClient::connect(engine::TransferEngine* engine,
                                                                   engine::Rendezvous& rdv,
                                                                   int64_t timeout_ms,
                                                                   int64_t open_timeout_ms) {
  std::unique_ptr<MasterRpcClient> c(new MasterRpcClient());
  c->engine_ = engine;
  c->timeout_ms_ = timeout_ms;
  // The master may come up after its clients (rank 0 of a group): wait longer than one call.
  auto peer = engine->openPeer(rdv, kMasterName, engine::deadlineInMs(open_timeout_ms));
  if (!peer.ok()) return ErrorCode::RPC_FAIL;
  c->master_ = *peer;
  c->reply_channel_ = kStoreReplyBase + g_reply_channels.fetch_add(1);
  MasterRpcClient* raw = c.get();
  engine->setMessageHandler(c->reply_channel_,
                            [raw](engine::Message&& m) { raw->onReply(std::move(m)); });
  return ErrorOr<std::unique_ptr<MasterRpcClient>>(std::move(c));
}

std::unique_ptr<MasterRpcClient> MasterRpcClient::local(MasterService* service,
                                                        int64_t timeout_ms) {
  std::unique_ptr<MasterRpcClient> c(new MasterRpcClient());
  c->local_ = service;
  c->timeout_ms_ = timeout_ms;
  return c;
}

MasterRpcClient::~MasterRpcClient() {
  if (engine_ != nullptr && reply_channel_ != 0)
    engine_->setMessageHandler(reply_channel_, nullptr);
}

bool MasterRpcClient::masterAlive() const {
  if (local_ != nullptr) return true;
  return engine_->peerStatus(master_).ok();
}

void MasterRpcClient::onReply(engine::Message&& m) {
  proto::ResponseEnvelope env;
  // Parsing the envelope only to read the rpc id; the body is decoded by the caller.
  if (!env.ParseFromString(m.payload)) return;
  std::lock_guard<std::mutex> g(mu_);
  auto it = waiting_.find(env.rpc_id());
  if (it == waiting_.end()) return;  // the caller gave up
  replies_[env.rpc_id()] = std::move(m.payload);
  arrivals_.fetch_add(1, std::memory_order_release);
  cv_.notify_all();
}

ErrorCode MasterRpcClient::call(proto::Method method, const google::protobuf::MessageLite& request,
                                google::protobuf::MessageLite* response) {
  CallInfo info;
  return call(method, request, response, engine::deadlineInMs(timeout_ms_), &info);
}

ErrorCode MasterRpcClient::call(proto::Method method, const google::protobuf::MessageLite& request,
                                google::protobuf::MessageLite* response, engine::Deadline deadline,
                                CallInfo* info) {
  proto::RequestEnvelope req;
  uint64_t id = next_id_.fetch_add(1);
  req.set_rpc_id(id);
  req.set_method(method);
  if (!request.SerializeToString(req.mutable_body())) return ErrorCode::INVALID_PARAMS;
  std::string reply;
  if (local_ != nullptr) {
    info->sent = true;
    reply = local_->handle(req.SerializeAsString());
  } else {
    std::string wire;
    putU32(&wire, reply_channel_);
    req.AppendToString(&wire);
    {
      std::lock_guard<std::mutex> g(mu_);
      waiting_[id] = true;
    }
    uint64_t seen = arrivals_.load(std::memory_order_acquire);
    Status st = engine_->sendMessage(master_, kStoreRpcChannel, wire);
    info->sent = st.ok();
    // A same-host master answers in microseconds. Yield (not spin: the threads that produce
    // the answer may need this core) for a short while before sleeping on the condition
    // variable, which saves this thread's futex wake-up on the fast path.
    if (st.ok()) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kYieldUs);
      while (arrivals_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until)
        sched_yield();
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (!st.ok()) {
      waiting_.erase(id);
      info->master_dead = !engine_->peerStatus(master_).ok();
      return ErrorCode::RPC_FAIL;
    }
    while (true) {
      auto it = replies_.find(id);
      if (it != replies_.end()) {
        reply = std::move(it->second);
        replies_.erase(it);
        break;
      }
      auto now = std::chrono::steady_clock::now();
      const bool dead = !engine_->peerStatus(master_).ok();
      if (now >= deadline || dead) {
        waiting_.erase(id);
        info->master_dead = dead;
        return ErrorCode::RPC_FAIL;
      }
      // Wake up now and then to notice a dead master before the deadline.
      cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(50)));
    }
    waiting_.erase(id);
  }
  proto::ResponseEnvelope env;
  if (!env.ParseFromString(reply) || env.rpc_id() != id) return ErrorCode::RPC_FAIL;
  info->epoch = env.epoch();
  if (env.error_code() != 0) return errorCodeFromInt(env.error_code());
  if (!response->ParseFromString(env.body())) return ErrorCode::RPC_FAIL;
  return ErrorCode::OK;
}

}  // namespace mooncake::store
