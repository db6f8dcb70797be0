// RdmaPeer's lanes coming back and going (rdma_peer.h): the prober's reconnection of failed
// lanes, a new QP's installation, work parked on a lane that waits for its redial, and the
// endpoint cache (MC_RDMA_MAX_ENDPOINTS): whether its lanes on a NIC are idle, closing them at
// both ends, dialling them again on the next use; and the transport's prober thread that
// drives both (RdmaTransportImpl::probeLoop).
#include <algorithm>

#include "engine/log.h"
#include "engine/transport/rdma/rdma_peer.h"

namespace mooncake::engine::rdma {

void RdmaPeer::installLocked(Lane& l, std::shared_ptr<Qp> qp) {
  l.qp = std::move(qp);
  l.failed = false;
  Status st = l.qp->failedStatus();
  if (!st.ok()) {  // its NIC went out of service while it was dialled
    l.failed = true;
    l.error = st;
    l.retry_at = Clock::now() + t_->retryAfter();
  }
  const bool waited = l.redial;
  l.redial = false;
  if (!waited || l.parked.empty()) return;
  std::vector<Op*> ops;
  ops.swap(l.parked);
  l.dirty = true;
  l.qp->enqueue(ops);  // (a failed QP gives them back: giveBack places them elsewhere)
}

void RdmaPeer::toLaneLocked(Lane& l, std::vector<Op*>& ops) {
  if (l.redial) {
    l.parked.insert(l.parked.end(), ops.begin(), ops.end());
    ops.clear();
    return;
  }
  l.qp->enqueue(ops);
}

std::vector<int> RdmaPeer::waitingLanes(const std::vector<int>& nics) {
  std::vector<int> out;
  if (dead_) return out;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const Lane& l = lanes_[i];
    // (A QP that failed and has not handed its work back yet: what joins it is handed back
    // behind that work, and waits with it when the failure was a request's own.)
    const bool handing = !l.failed && l.qp && !l.qp->failedStatus().ok();
    if (!l.redial && !handing) continue;
    if (!nics.empty() && std::find(nics.begin(), nics.end(), l.nic->index) == nics.end()) continue;
    out.push_back(static_cast<int>(i));
  }
  return out;
}

bool RdmaPeer::probe() {
  bool soon = false;
  for (size_t i = 0;; ++i) {
    Nic* nic = nullptr;
    int rn = -1, id = 0;
    bool rib = false;
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      if (dead_ || i >= lanes_.size()) return soon;
      Lane& l = lanes_[i];
      // Only once the failed QP holds nothing (work still in it or being handed back must
      // reach another lane first: notifications issued meanwhile follow it there).
      if (!l.failed || Clock::now() < l.retry_at) continue;
      if (l.qp && !l.qp->idle()) {
        soon |= l.redial;
        continue;
      }
      l.retry_at = Clock::now() + t_->retryAfter();
      nic = l.nic;
      rn = l.remote_nic;
      rib = l.remote_ib;
      id = l.id;
    }
    ibv_port_attr pa{};
    Result<ibv_qp*> raw = MC_STATUS(kUnavailable, "rdma: port 1 of " << nic->name << " is down");
    if (ibv_query_port(nic->ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE)
      raw = t_->dial(nic, rn, rib, conn_, id, *control_, name_, deadlineInMs(2000));
    if (!raw.ok()) {
      if (pa.state == IBV_PORT_ACTIVE) {
        MC_LOG(INFO, RDMA) << "peer " << name_ << ": " << nic->name
                           << " not back yet: " << raw.status().toString();
      }
      // Work that waited for this lane's redial moves as after a link failure.
      std::vector<std::pair<Op*, Status>> failed;
      {
        std::lock_guard<std::recursive_mutex> g(mu_);
        if (i >= lanes_.size()) return soon;
        Lane& l = lanes_[i];
        if (!l.redial) continue;
        l.redial = false;
        l.error = raw.status();
        std::vector<Op*> ops;
        ops.swap(l.parked);
        placeLocked(ops, -1, &failed);
      }
      finishOps(failed);
      continue;
    }
    std::shared_ptr<Qp> qp = newQp(nic, *raw);
    std::shared_ptr<Qp> old;
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      if (dead_ || i >= lanes_.size()) return soon;
      old = std::move(lanes_[i].qp);
      installLocked(lanes_[i], std::move(qp));
    }
    MC_LOG(INFO, RDMA) << "peer " << name_ << ": " << nic->name << " is back";
    std::lock_guard<std::mutex> g(fb_mu_);
    fb_warned_ = false;  // the next outage is reported again
  }
}

EndpointState RdmaPeer::endpointOn(int nic) {
  EndpointState st;
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (dead_ || nic < 0 || static_cast<size_t>(nic) >= lanes_of_nic_.size()) return st;
  st.idle = fb_pending_.load() == 0;
  for (int i : lanes_of_nic_[static_cast<size_t>(nic)]) {
    Lane& l = lanes_[static_cast<size_t>(i)];
    if (!l.qp || l.failed) continue;
    st.connected = true;
    st.idle = st.idle && l.qp->idle();
  }
  st.last_used = last_used_;
  return st;
}

void RdmaPeer::evictOn(int nic) {
  std::lock_guard<std::mutex> w(wake_mu_);
  std::vector<std::shared_ptr<Qp>> gone;
  std::vector<const Lane*> closed;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (dead_ || nic < 0 || static_cast<size_t>(nic) >= lanes_of_nic_.size()) return;
    if (fb_pending_.load() != 0) return;
    for (int i : lanes_of_nic_[static_cast<size_t>(nic)]) {
      Lane& l = lanes_[static_cast<size_t>(i)];
      if (!l.qp || l.failed || !l.qp->idle()) return;
    }
    for (int i : lanes_of_nic_[static_cast<size_t>(nic)]) {
      Lane& l = lanes_[static_cast<size_t>(i)];
      gone.push_back(std::move(l.qp));
      l.evicted = true;
      l.dirty = false;
      closed.push_back(&l);
    }
    evicted_.fetch_add(static_cast<int>(closed.size()));
  }
  gone.clear();
  for (const Lane* l : closed) {
    auto st = control_->exchange(TransportKind::kRdma,
                                 "C " + std::to_string(conn_) + " " + std::to_string(l->id),
                                 deadlineInMs(2000));
    MC_LOG(INFO, RDMA) << "peer " << name_ << ": idle lane " << l->id << " on " << l->nic->name
                       << " closed (MC_RDMA_MAX_ENDPOINTS)"
                       << (st.ok() ? "" : "; the target was not told: " + st.status().message());
  }
}

void RdmaPeer::wake() {
  std::lock_guard<std::mutex> w(wake_mu_);
  std::vector<size_t> todo;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (dead_) return;
    for (size_t i = 0; i < lanes_.size(); ++i)
      if (lanes_[i].evicted) todo.push_back(i);
  }
  for (size_t i : todo) {
    const Lane& l = lanes_[i];  // its NIC, remote NIC and id do not change
    auto raw = t_->dial(l.nic, l.remote_nic, l.remote_ib, conn_, l.id, *control_, name_,
                        deadlineInMs(5000));
    // The QP is made without mu_ (it registers with the transport, whose QP list's lock is
    // never taken before mu_).
    std::shared_ptr<Qp> qp = raw.ok() ? newQp(l.nic, *raw) : nullptr;
    std::lock_guard<std::recursive_mutex> g(mu_);
    last_used_ = Clock::now();  // the latest to be closed again
    Lane& m = lanes_[i];
    m.evicted = false;
    evicted_.fetch_sub(1);
    if (raw.ok() && !dead_) {
      installLocked(m, std::move(qp));
      continue;
    }
    if (raw.ok()) continue;  // (the peer is closing: the QP goes)
    m.failed = true;
    m.error = raw.status();
    m.retry_at = Clock::now() + t_->retryAfter();
    MC_LOG(WARN, RDMA) << "peer " << name_ << ": cannot dial evicted lane " << m.id << " on "
                       << m.nic->name << " again: " << raw.status().toString();
  }
}

// ---------------------------------------------------------------------------------------
// The transport's prober

void RdmaTransportImpl::probeLoop() {
  auto every = retry_ / 4;
  if (stall_.count() > 0) every = std::min(every, stall_ / 4);
  every = std::max<std::chrono::milliseconds>(every, std::chrono::milliseconds(5));
  evict_grace_ = every * 2;
  std::unique_lock<std::mutex> lk(probe_mu_);
  bool soon = false;  // a lane to redial at once still had work being handed back
  while (!probe_stop_) {
    probe_cv_.wait_for(lk, soon ? std::min(every, std::chrono::milliseconds(2)) : every,
                       [&] { return probe_stop_ || probe_kick_; });
    if (probe_stop_) break;
    probe_kick_ = false;
    lk.unlock();
    if (stall_.count() > 0) {
      const auto now = Clock::now();
      std::lock_guard<std::mutex> g(qps_mu_);
      for (Qp* q : qps_) q->checkStall(now, stall_);
    }
    {
      std::lock_guard<std::mutex> g(peers_mu_);
      soon = false;
      for (RdmaPeer* p : peers_) soon |= probePeer(p);
      if (max_endpoints_ > 0) evictIdleLocked();
    }
    reapGraveyard();
    lk.lock();
  }
}

// Under peers_mu_: per NIC, while more peers than MC_RDMA_MAX_ENDPOINTS have lanes on it, closes
// the least recently used idle ones (RdmaPeer::evictOn), not one used in the last two rounds
// of the prober (a peer whose lanes were just dialled again is about to use them).
void RdmaTransportImpl::evictIdleLocked() {
  const auto now = Clock::now();
  for (const auto& n : nics_) {
    int count = 0;
    std::vector<std::pair<Clock::time_point, RdmaPeer*>> idle;
    for (RdmaPeer* p : peers_) {
      EndpointState st = endpointOn(p, n->index);
      if (!st.connected) continue;
      ++count;
      if (st.idle && now - st.last_used >= evict_grace_) idle.emplace_back(st.last_used, p);
    }
    if (count <= max_endpoints_) continue;
    std::sort(idle.begin(), idle.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < idle.size() && count > max_endpoints_; ++i, --count)
      evictOn(idle[i].second, n->index);
  }
}

}  // namespace mooncake::engine::rdma
