// RdmaPeer's side of the endpoint cache (MC_RDMA_MAX_ENDPOINTS): whether its lanes on a NIC
// are idle, closing them at both ends, dialling them again on the next use (rdma_peer.h).
#include "engine/log.h"
#include "engine/transport/rdma/rdma_peer.h"

namespace mooncake::engine::rdma {

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
    std::lock_guard<std::recursive_mutex> g(mu_);
    last_used_ = Clock::now();  // the latest to be closed again
    Lane& m = lanes_[i];
    m.evicted = false;
    evicted_.fetch_sub(1);
    if (raw.ok() && !dead_) {
      m.qp = newQp(m.nic, *raw);
      continue;
    }
    if (raw.ok()) {
      m.nic->destroyQp(*raw);
      continue;
    }
    m.failed = true;
    m.error = raw.status();
    m.retry_at = Clock::now() + t_->retryAfter();
    MC_LOG(WARN, RDMA) << "peer " << name_ << ": cannot dial evicted lane " << m.id << " on "
                       << m.nic->name << " again: " << raw.status().toString();
  }
}

}  // namespace mooncake::engine::rdma
