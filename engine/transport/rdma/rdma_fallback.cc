// RdmaPeer's tcp fallback (MC_RDMA_TCP_FALLBACK): work no lane can carry goes, in order, over
// the control link (rdma_peer.h; the requests are "F ..." of rdma_transport.h).
#include <cstring>
#include <sstream>

#include "engine/log.h"
#include "engine/transport/rdma/rdma_peer.h"
#include "engine/transport/rdma/rdma_notify.h"

namespace mooncake::engine::rdma {

void RdmaPeer::toFallback(std::vector<Op*>& ops, std::vector<std::pair<Op*, Status>>* failed) {
  {
    std::lock_guard<std::mutex> g(fb_mu_);
    if (fb_stop_) {
      for (Op* o : ops)
        failed->emplace_back(o, MC_STATUS(kCancelled, "rdma: peer " << name_ << " closed"));
      ops.clear();
      return;
    }
    if (!fb_warned_) {
      fb_warned_ = true;
      MC_LOG(WARN, RDMA) << "peer " << name_ << ": no NIC reaches it; its requests go over "
                            "the tcp control link until a NIC is back";
    }
    for (Op* o : ops) fb_.push_back(o);
    fb_pending_.fetch_add(static_cast<int64_t>(ops.size()));
    if (!fb_thread_.joinable()) fb_thread_ = std::thread([this] { fallbackLoop(); });
  }
  ops.clear();
  fb_cv_.notify_one();
}

void RdmaPeer::fallbackLoop() {
  for (;;) {
    Op* o = nullptr;
    bool closing = false;  // the peer is being closed: what is queued fails, not carried
    {
      std::unique_lock<std::mutex> g(fb_mu_);
      fb_cv_.wait(g, [&] { return fb_stop_ || !fb_.empty(); });
      if (fb_.empty()) return;
      o = fb_.front();
      fb_.pop_front();
      closing = fb_stop_;
    }
    Status st;
    bool dead;
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      dead = dead_ || closing;
      if (dead_) st = dead_why_;
    }
    if (closing && st.ok()) st = MC_STATUS(kCancelled, "rdma: peer " << name_ << " closed");
    if (!dead) st = overTcp(*o);
    if (!dead && !st.ok()) {
      std::lock_guard<std::recursive_mutex> g(mu_);
      Status nics = everyNicFailed(*o);
      st = Status(nics.code(), nics.message() + " and over tcp: " + st.message());
    }
    std::vector<std::pair<Op*, Status>> done{{o, st}};
    finishOps(done);
    fb_pending_.fetch_sub(1);
  }
}

Status RdmaPeer::overTcp(Op& o) {
  constexpr uint64_t kPiece = 512 << 10;  // under the control link's 1 MiB exchange limit
  const Deadline deadline = deadlineInMs(30000);
  if (o.ts == nullptr) {
    std::ostringstream req;
    req << "F N " << conn_ << " " << o.channel << " " << o.word << " " << o.tag;
    return control_->exchange(TransportKind::kRdma, req.str(), deadline).status();
  }
  if (t_->isDeviceMemory(o.user))
    return MC_STATUS(kNotSupported, "the local side of an rdma " << o.what() << " to " << name_
                                                                 << " is GPU memory, which "
                                                                    "tcp cannot carry");
  std::vector<int64_t> rkeys;
  if (!findRemote(o.raddr, o.len, &rkeys))
    return MC_STATUS(kPermissionDenied, "[" << hex(o.raddr) << ", +" << o.len
                                            << ") is not in a region peer " << name_
                                            << " registered for rdma");
  size_t nic = 0;
  while (nic < rkeys.size() && rkeys[nic] < 0) ++nic;
  if (nic == rkeys.size())
    return MC_STATUS(kPermissionDenied, "peer " << name_ << "'s region has no key");
  const bool write = o.op == OpCode::kWrite;
  for (uint64_t off = 0; off < o.len; off += kPiece) {
    const uint64_t n = std::min(kPiece, o.len - off);
    std::ostringstream head;
    head << "F " << (write ? "W " : "R ") << (o.raddr + off) << " " << nic << " "
         << rkeys[nic] << " " << n << "\n";
    std::string req = head.str();
    auto gave_up = [&o] {
      return MC_STATUS(kCancelled, "rdma (tcp fallback): the " << o.what()
                                   << " was cut short: its caller gave up");
    };
    if (write) {
      std::lock_guard<std::mutex> g(fb_copy_mu_);  // (fenceAbandoned)
      if (o.abandoned()) return gave_up();
      req.append(o.user + off, n);
    }
    auto r = control_->exchange(TransportKind::kRdma, req, deadline);
    if (!r.ok()) return r.status();
    if (write) continue;
    if (r->size() != n)
      return MC_STATUS(kProtocol, "a READ over tcp returned " << r->size() << " of " << n
                                                             << " bytes");
    std::lock_guard<std::mutex> g(fb_copy_mu_);
    if (o.abandoned()) return gave_up();
    std::memcpy(o.user + off, r->data(), n);
  }
  return Status::OK();
}

Status RdmaPeer::everyNicFailed(const Op& o) {
  std::ostringstream os;
  os << "rdma " << o.what() << " of " << o.len << " bytes to peer " << name_
     << " failed on every NIC:";
  for (const Lane& l : lanes_)
    os << " " << l.nic->name << ": "
       << (l.error.ok() && l.qp ? l.qp->failedStatus().message() : l.error.message()) << ";";
  return Status(Code::kIo, os.str());
}

// The tcp fallback's target side: what the NIC would have done, checked as the NIC checks it
// (the range inside a region registered here, the key the initiator names being that region's
// key on that NIC), done on the engine's tcp thread before the answer goes back.
void RdmaTransportImpl::onFallback(const SegmentDesc& from, const std::string& request,
                                   const std::function<void(Result<std::string>)>& reply) {
  const size_t nl = request.find('\n');
  std::istringstream in(request.substr(0, nl));
  std::string f, what;
  in >> f >> what;
  if (what == "N") {
    uint64_t conn = 0, tag = 0;
    uint32_t channel = 0, word = 0;
    if (!(in >> conn >> channel >> word >> tag))
      return reply(MC_STATUS(kProtocol, "rdma: malformed fallback notification"));
    std::shared_ptr<NotifyOrder> order;
    {
      std::lock_guard<std::mutex> g(target_mu_);
      auto it = orders_.find({from.engine_id, conn});
      if (it != orders_.end()) order = it->second;
    }
    if (!order)
      return reply(MC_STATUS(kNotFound, "rdma: no connection " << conn << " from " << from.name));
    const uint64_t src = from.engine_id;
    if (!order->arrive(word, channel, tag,
                       [&](uint32_t c, uint64_t tg) { deliverNotify(src, c, tg); }))
      return reply(MC_STATUS(kProtocol, "rdma: malformed fallback notification word"));
    return reply(std::string());
  }
  uint64_t addr = 0, len = 0;
  int nic = -1;
  uint32_t rkey = 0;
  if ((what != "W" && what != "R") || !(in >> addr >> nic >> rkey >> len) ||
      (what == "W" && (nl == std::string::npos || request.size() - nl - 1 != len)))
    return reply(MC_STATUS(kProtocol, "rdma: malformed fallback request"));
  std::shared_lock<std::shared_mutex> g(mr_mu_);
  auto it = mrs_.upper_bound(addr);
  bool ok = it != mrs_.begin();
  if (ok) {
    --it;
    ok = addr - it->first <= it->second.len && len <= it->second.len - (addr - it->first) &&
         nic >= 0 && static_cast<size_t>(nic) < it->second.mrs.size() &&
         it->second.mrs[static_cast<size_t>(nic)] != nullptr &&
         it->second.mrs[static_cast<size_t>(nic)]->rkey == rkey;
  }
  if (ok && it->second.device)
    return reply(MC_STATUS(kNotSupported, "rdma (tcp fallback): [" << hex(addr) << ", +" << len
                                              << ") from " << from.name
                                              << " is GPU memory, which no NIC reaches now and "
                                                 "tcp cannot carry"));
  if (!ok)
    return reply(MC_STATUS(kPermissionDenied, "rdma (tcp fallback): [" << hex(addr) << ", +" << len
                                                  << ") from " << from.name
                                                  << " is not in a region registered here "
                                                     "under that key"));
  if (what == "W") {
    std::memcpy(reinterpret_cast<void*>(addr), request.data() + nl + 1, len);
    return reply(std::string());
  }
  std::string data(reinterpret_cast<const char*>(addr), len);
  g.unlock();
  reply(std::move(data));
}

}  // namespace mooncake::engine::rdma
