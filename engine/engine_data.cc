// The engine's data path: transfers (submit, poll, wait), notifications, messages, peer
// lookups by engine id (engine.cc: creation, memory, peers).
#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>

#include "engine/engine_impl.h"

namespace mooncake::engine {

Result<BatchId> TransferEngine::submit(const std::vector<TransferRequest>& requests) {
  Impl& m = *impl_;
  std::vector<TransportPeer*> routes(requests.size());  // data, or device for GPU memory
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    PeerEntry* e = m.peer(r.peer);
    if (e == nullptr) return MC_STATUS(kInvalidArgument, "request " << i << ": unknown peer " << r.peer);
    if (r.local == nullptr && r.length > 0)
      return MC_STATUS(kInvalidArgument, "request " << i << ": null local address");
    // A range past the end of the address space is no memory anywhere (and its arithmetic
    // would wrap in the transports): refused before anything moves.
    const uint64_t local = reinterpret_cast<uint64_t>(r.local);
    if (r.length > kMaxRequestBytes || (r.length > 0 && (local + (r.length - 1) < local ||
                                                         r.remote + (r.length - 1) < r.remote)))
      return MC_STATUS(kInvalidArgument,
                       "request " << i << " (" << (r.op == OpCode::kWrite ? "WRITE" : "READ")
                                  << " of " << r.length << " bytes, local " << r.local
                                  << ", remote 0x" << std::hex << r.remote << std::dec
                                  << ", peer " << r.peer << "): the length "
                                  << (r.length > kMaxRequestBytes ? "is absurd"
                                                                  : "runs past the end of the "
                                                                    "address space"));
    MC_RETURN_IF_ERROR(m.peerStatus(e));
    routes[i] = e->data;
    if (m.device_regions.load(std::memory_order_relaxed) > 0 || device::active() ||
        e->remote_gpu_regions.load(std::memory_order_relaxed) > 0) {
      MC_ASSIGN_OR_RETURN(routes[i], m.route(r, i, e));
    }
  }
  auto b = std::make_shared<Batch>();
  BatchId id = m.next_batch.fetch_add(1);
  b->tasks.resize(requests.size());
  for (const auto& r : requests)
    if (std::find(b->peers.begin(), b->peers.end(), r.peer) == b->peers.end())
      b->peers.push_back(r.peer);
  for (TransportPeer* t : routes)
    if (std::find(b->routes.begin(), b->routes.end(), t) == b->routes.end())
      b->routes.push_back(t);
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
    t.abandoned = &b->given_up;
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
      // Released when its requests end (finishOne), which they still do: the late transfers
      // go on, and keepUntilDone's owners wait for them. Before this returns, each transport
      // stops touching the unfinished requests' local memory (engine.h).
      b->abandoned = true;
      g.unlock();
      b->given_up.store(true, std::memory_order_release);
      for (TransportPeer* t : b->routes) t->fenceAbandoned();
      return MC_STATUS(kTimeout, "batch " << id << " not finished by its deadline (its local "
                                          << "memory is no longer touched; the transfers still "
                                          << "in flight end on their own)");
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

namespace {

// dropOwnersLater's thread and queue. Made on first use and never destroyed (the thread is
// detached, so it may outlive every static); a forked child makes its own (pthread_atfork).
class Reaper {
 public:
  static void drop(std::vector<std::shared_ptr<void>> owners) {
    static const bool forks = [] {
      pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); });
      return true;
    }();
    (void)forks;
    Reaper* r = current().load();
    if (r == nullptr) {
      auto* made = new Reaper();  // (one made by a racing caller is leaked: a few bytes)
      r = current().compare_exchange_strong(r, made) ? made : r;
      if (r == made) std::thread([made] { made->run(); }).detach();
    }
    {
      std::lock_guard<std::mutex> g(r->mu_);
      for (auto& o : owners) r->queue_.push_back(std::move(o));
    }
    r->cv_.notify_one();
  }

 private:
  static std::atomic<Reaper*>& current() {
    static std::atomic<Reaper*> r{nullptr};
    return r;
  }
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [this] { return !queue_.empty(); });
      std::vector<std::shared_ptr<void>> batch;
      batch.swap(queue_);
      g.unlock();
      batch.clear();  // the owners' destructors run here, without the lock
      g.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<void>> queue_;
};

}  // namespace

void dropOwnersLater(std::vector<std::shared_ptr<void>> owners) {
  Reaper::drop(std::move(owners));
}

void TransferEngine::keepUntilDone(BatchId id, std::shared_ptr<void> owner) {
  std::shared_ptr<Batch> b;
  {
    std::lock_guard<std::mutex> g(impl_->batches_mu);
    auto it = impl_->batches.find(id);
    if (it == impl_->batches.end()) return;  // released: nothing reads its memory any more
    b = it->second;
  }
  std::lock_guard<std::mutex> g(b->mu);
  // Finished: its completer no longer touches the memory (finishOne drops the count under mu).
  if (b->pending.load(std::memory_order_acquire) == 0) return;
  b->owners.push_back(std::move(owner));
  b->abandoned = true;  // (given up, waited for or not: released when it finishes)
}

Status TransferEngine::settle(PeerId peer, Deadline deadline) {
  std::vector<std::shared_ptr<Batch>> running;
  {
    std::lock_guard<std::mutex> g(impl_->batches_mu);
    for (const auto& [id, b] : impl_->batches)
      if (b->pending.load(std::memory_order_acquire) != 0 &&
          std::find(b->peers.begin(), b->peers.end(), peer) != b->peers.end())
        running.push_back(b);
  }
  size_t left = 0;
  for (const auto& b : running) {
    std::unique_lock<std::mutex> g(b->mu);
    if (!b->cv.wait_until(g, deadline,
                          [&] { return b->pending.load(std::memory_order_acquire) == 0; }))
      ++left;
  }
  if (left > 0)
    return MC_STATUS(kTimeout, left << " batch(es) with requests to peer " << peer
                                    << " still running at the deadline");
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
  // GPU memory to this peer moves over another transport (cuda, staging): the notification
  // follows those writes too once they are done.
  for (TransportPeer* t : {e->device_owned.get(), e->staged.get()}) {
    if (t == nullptr) continue;
    Status st = t->quiesce(deadlineInMs(60000));
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
      return MC_STATUS(kNotFound, "engine " << hex16(engine_id) << " never connected here");
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

void TransferEngine::releaseMapped(PeerId peer, const void* local) {
  PeerEntry* e = impl_->peer(peer);
  if (e != nullptr && e->data != nullptr && local != nullptr) e->data->releaseMapped(local);
}

}  // namespace mooncake::engine

