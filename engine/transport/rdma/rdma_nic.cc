#include "engine/transport/rdma/rdma_nic.h"

#include <limits.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "engine/log.h"
#include "engine/params.h"

namespace mooncake::engine::rdma {

namespace {

bool nameListed(const std::string& list, const std::string& name) {
  if (list.empty()) return true;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ','))
    if (item == name) return true;
  return false;
}

bool isIpv4Mapped(const ibv_gid& g) {
  for (int i = 0; i < 10; ++i)
    if (g.raw[i] != 0) return false;
  return g.raw[10] == 0xff && g.raw[11] == 0xff;
}

// RoCE: the RoCE v2 GID holding an IPv4-mapped address (what RoCE v2 routes over IPv4).
Status chooseGid(Nic* n) {
  int forced = static_cast<int>(params::getInt("MC_RDMA_GID_INDEX"));
  if (forced >= 0) {
    if (forced >= n->port.gid_tbl_len || ibv_query_gid(n->ctx, 1, forced, &n->gid) != 0)
      return MC_STATUS(kInvalidArgument, "rdma: " << n->name << " has no GID index " << forced
                                                  << " (MC_RDMA_GID_INDEX)");
    n->gid_index = forced;
    return Status::OK();
  }
  for (int i = 0; i < n->port.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(n->ctx, 1, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    if (e.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    std::memcpy(n->gid.raw, e.gid.raw, 16);
    if (!isIpv4Mapped(n->gid)) continue;
    n->gid_index = i;
    return Status::OK();
  }
  return MC_STATUS(kUnavailable, "rdma: " << n->name
                                          << " has no RoCE v2 IPv4-mapped GID (set MC_RDMA_GID_INDEX)");
}

// The PCI address behind a device's sysfs directory (<ibdev_path>/device links to
// .../devices/.../<domain:bus:dev.fn>); empty when it cannot be read.
std::string pciAddress(ibv_device* dev) {
  std::string link = std::string(dev->ibdev_path) + "/device";
  char buf[PATH_MAX];
  ssize_t len = readlink(link.c_str(), buf, sizeof(buf) - 1);
  if (len <= 0) return "";
  std::string target(buf, static_cast<size_t>(len));
  size_t slash = target.find_last_of('/');
  return slash == std::string::npos ? target : target.substr(slash + 1);
}

Result<std::unique_ptr<Nic>> openOne(ibv_device* dev, int index) {
  auto n = std::make_unique<Nic>();
  n->index = index;
  n->name = ibv_get_device_name(dev);
  n->pci = pciAddress(dev);
  n->ctx = ibv_open_device(dev);
  if (n->ctx == nullptr)
    return MC_STATUS(kUnavailable, "rdma: cannot open " << n->name << ": " << strerror(errno));
  if (ibv_query_port(n->ctx, 1, &n->port) != 0)
    return MC_STATUS(kUnavailable, "rdma: cannot query port 1 of " << n->name);
  n->ib = n->port.link_layer == IBV_LINK_LAYER_INFINIBAND;
  if (n->port.state != IBV_PORT_ACTIVE) n->down_at_start = true;
  ibv_device_attr da{};
  if (ibv_query_device(n->ctx, &da) != 0)
    return MC_STATUS(kUnavailable, "rdma: cannot query " << n->name);
  n->max_mr_size = da.max_mr_size;
  n->max_rd_atom = std::min(da.max_qp_rd_atom, da.max_qp_init_rd_atom);
  n->max_cqe = da.max_cqe > 0 ? da.max_cqe : 16384;
  if (!n->ib) MC_RETURN_IF_ERROR(chooseGid(n.get()));
  n->pd = ibv_alloc_pd(n->ctx);
  n->channel = ibv_create_comp_channel(n->ctx);
  // 16384 entries to begin with (a few hundred QPs); createQp() grows it when QPs need more.
  int cqe = std::min(n->max_cqe, 16384);
  if (n->pd != nullptr && n->channel != nullptr)
    n->cq = ibv_create_cq(n->ctx, cqe, nullptr, n->channel, 0);
  if (n->pd == nullptr || n->channel == nullptr || n->cq == nullptr)
    return MC_STATUS(kUnavailable, "rdma: cannot set up " << n->name << " (PD/CQ)");
  return n;
}

}  // namespace

// Why ibv_reg_mr refused host memory (errno `e`), as the kernel decides it: pinning beyond
// RLIMIT_MEMLOCK without CAP_IPC_LOCK (ENOMEM, or EPERM with a limit of 0), a range that is
// not mapped, or not with the access asked for (EFAULT).
Status registrationError(const std::string& nic, uint64_t addr, uint64_t len, int e) {
  std::ostringstream os;
  os << "rdma: cannot register [" << "0x" << std::hex << addr << std::dec << ", +" << len << ") with " << nic << ": "
     << strerror(e);
  if (e == ENOMEM || e == EPERM) {
    rlimit rl{};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    os << " (pinned memory is limited by RLIMIT_MEMLOCK, ";
    if (rl.rlim_cur == RLIM_INFINITY)
      os << "unlimited";
    else
      os << rl.rlim_cur << " bytes";
    os << " here: raise it (ulimit -l, the service's LimitMEMLOCK) or grant CAP_IPC_LOCK)";
    return Status(Code::kUnavailable, os.str());
  }
  if (e == EFAULT) {
    os << " (the range is not mapped memory, or not readable and writable: rdma needs both)";
    return Status(Code::kInvalidArgument, os.str());
  }
  return Status(Code::kUnavailable, os.str());
}

Nic::~Nic() {
  stopPoller();
  if (cq != nullptr) ibv_destroy_cq(cq);
  if (channel != nullptr) ibv_destroy_comp_channel(channel);
  if (pd != nullptr) ibv_dealloc_pd(pd);
  if (ctx != nullptr) ibv_close_device(ctx);
}

uint16_t Nic::lid() const {
  ibv_port_attr now{};
  if (ibv_query_port(ctx, 1, &now) == 0 && now.state == IBV_PORT_ACTIVE) return now.lid;
  return port.lid;
}

int Nic::activeMtu() const {
  ibv_port_attr now{};
  if (ibv_query_port(ctx, 1, &now) == 0 && now.state == IBV_PORT_ACTIVE) return now.active_mtu;
  return port.active_mtu;
}

Result<ibv_qp*> Nic::createQp(ibv_qp_init_attr* attr) {
  const int need = static_cast<int>(attr->cap.max_send_wr + attr->cap.max_recv_wr);
  std::lock_guard<std::mutex> g(cq_mu_);
  if (!dead_.ok()) return dead_;
  if (cq_reserved_ + need > cq->cqe) {
    // Grow the CQ (doubling, up to the device's limit) before refusing the QP.
    int want = std::min<int64_t>(max_cqe, std::max<int64_t>(int64_t{cq->cqe} * 2, cq_reserved_ + need));
    if (cq_reserved_ + need > want || ibv_resize_cq(cq, want) != 0 || cq->cqe < cq_reserved_ + need)
      return MC_STATUS(kUnavailable,
                       "rdma: the CQ of " << name << " has no room for another QP ("
                                          << cq_reserved_ << " of " << cq->cqe
                                          << " entries reserved, " << need << " more needed, max_cqe "
                                          << max_cqe << ")");
    MC_LOG(INFO, RDMA) << name << ": CQ grown to " << cq->cqe << " entries";
  }
  attr->send_cq = cq;
  attr->recv_cq = cq;
  ibv_qp* qp = ibv_create_qp(pd, attr);
  if (qp == nullptr)
    return MC_STATUS(kUnavailable, "rdma: cannot create a QP on " << name << ": " << strerror(errno));
  cq_reserved_ += need;
  cq_share_[qp] = need;
  return qp;
}

void Nic::destroyQp(ibv_qp* qp) {
  if (qp == nullptr) return;
  ibv_destroy_qp(qp);
  std::lock_guard<std::mutex> g(cq_mu_);
  auto it = cq_share_.find(qp);
  if (it == cq_share_.end()) return;
  cq_reserved_ -= it->second;
  cq_share_.erase(it);
}

std::pair<int, int> Nic::cqUsage() {
  std::lock_guard<std::mutex> g(cq_mu_);
  return {cq_reserved_, cq->cqe};
}

Status Nic::deadStatus() {
  std::lock_guard<std::mutex> g(cq_mu_);
  return dead_;
}

int Nic::poll(ibv_wc* wcs, int n) {
  const int got = ibv_poll_cq(cq, n, wcs);
  if (got >= 0) return got;
  Status why = MC_STATUS(kIo, "rdma: polling the CQ of " << name
                                  << " failed (a CQ overrun or a device error): the NIC is out of "
                                     "service, its work moves to other NICs or tcp");
  {
    std::lock_guard<std::mutex> g(cq_mu_);
    dead_ = why;
  }
  dead_flag_.store(true);
  MC_LOG(ERROR, RDMA) << why.message();
  if (on_dead) on_dead(why);
  return -1;
}

void Nic::startPoller(int64_t spin_us) {
  poller = std::thread([this, spin_us] {
    ibv_wc wcs[32];
    auto last = std::chrono::steady_clock::now();
    while (!stopping.load(std::memory_order_relaxed)) {
      if (dead_flag_.load()) {  // nothing completes any more: only wait for stop()
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      int n = poll(wcs, 32);
      if (n > 0) {
        for (int i = 0; i < n; ++i)
          reinterpret_cast<CompletionTarget*>(wcs[i].wr_id)->onCompletion(wcs[i]);
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (n < 0) continue;
      if (std::chrono::steady_clock::now() - last < std::chrono::microseconds(spin_us)) continue;
      // Idle: arm the CQ, check once more (a completion may have raced the arming), sleep.
      if (on_idle) on_idle();
      ibv_req_notify_cq(cq, 0);
      n = poll(wcs, 32);
      if (n > 0) {
        for (int i = 0; i < n; ++i)
          reinterpret_cast<CompletionTarget*>(wcs[i].wr_id)->onCompletion(wcs[i]);
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (n < 0) continue;
      pollfd p{channel->fd, POLLIN, 0};
      if (::poll(&p, 1, 5) > 0) {
        ibv_cq* ev_cq = nullptr;
        void* ev_ctx = nullptr;
        if (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
      }
    }
  });
}

void Nic::stopPoller() {
  stopping.store(true);
  if (poller.joinable()) poller.join();
}

std::string gidHex(const ibv_gid& g) {
  char b[33];
  for (int i = 0; i < 16; ++i) std::snprintf(b + 2 * i, 3, "%02x", g.raw[i]);
  return std::string(b, 32);
}

bool parseGid(const std::string& hex, ibv_gid* g) {
  if (hex.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    char* end = nullptr;
    std::string byte = hex.substr(2 * i, 2);
    g->raw[i] = static_cast<uint8_t>(std::strtoul(byte.c_str(), &end, 16));
    if (end != byte.c_str() + 2) return false;
  }
  return true;
}

std::string encodeNics(const std::vector<std::unique_ptr<Nic>>& nics) {
  std::ostringstream os;
  for (const auto& n : nics)
    os << n->name << " " << (n->ib ? 1 : 0) << " " << n->port.lid << " " << gidHex(n->gid) << " "
       << static_cast<int>(n->port.active_mtu) << "\n";
  return os.str();
}

Result<std::vector<NicAddress>> decodeNics(const std::string& s) {
  std::vector<NicAddress> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream ls(line);
    NicAddress a;
    int ib = 0, lid = 0;
    std::string gid;
    if (!(ls >> a.name >> ib >> lid >> gid >> a.mtu) || !parseGid(gid, &a.gid) || a.mtu < 1 ||
        a.mtu > 5 || lid < 0 || lid > 0xffff)
      return MC_STATUS(kProtocol, "rdma: malformed NIC address '" << line << "'");
    a.ib = ib != 0;
    a.lid = static_cast<uint16_t>(lid);
    out.push_back(a);
    if (out.size() > 64) return MC_STATUS(kProtocol, "rdma: too many NICs in a descriptor");
  }
  return out;
}

Result<std::vector<std::unique_ptr<Nic>>> openNics() {
  int num = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr)
    return MC_STATUS(kUnavailable, "rdma: no verbs devices (ibv_get_device_list: "
                                       << strerror(errno) << ")");
  std::string filter = params::getString("MC_RDMA_DEVICES");
  std::vector<std::unique_ptr<Nic>> nics;
  std::string why;
  for (int i = 0; i < num; ++i) {
    if (!nameListed(filter, ibv_get_device_name(list[i]))) continue;
    auto n = openOne(list[i], static_cast<int>(nics.size()));
    if (!n.ok()) {
      why += (why.empty() ? "" : "; ") + n.status().message();
      continue;
    }
    nics.push_back(std::move(n).value());
  }
  ibv_free_device_list(list);
  // The engine forks (engine_data.cc's pthread_atfork handlers): registered memory is safe in
  // a child only when the kernel copies pinned pages on fork, or after ibv_fork_init().
  if (!nics.empty() && ibv_is_fork_initialized() == IBV_FORK_DISABLED) {
    MC_LOG(WARN, RDMA) << "fork() is not safe with registered memory here (ibv_is_fork_initialized: "
                          "disabled: the kernel does not copy pinned pages on fork and ibv_fork_init() "
                          "was not called; RDMAV_FORK_SAFE=1 calls it): a forked child that "
                          "touches registered pages may corrupt transfers";
  }
  bool any_up = false;
  for (const auto& n : nics) any_up |= !n->down_at_start;
  if (!any_up && !nics.empty()) {
    why += (why.empty() ? "" : "; ") + std::string("the port of every NIC is down");
    nics.clear();
  }
  for (const auto& n : nics) {
    if (!n->down_at_start) continue;
    MC_LOG(WARN, RDMA) << n->name << ": port 1 is down; its lanes connect once it is up";
  }
  if (nics.empty())
    return MC_STATUS(kUnavailable, "rdma: no usable NIC among " << num << " device(s)"
                                                               << (filter.empty() ? "" : " (MC_RDMA_DEVICES=" + filter + ")")
                                                               << (why.empty() ? "" : ": " + why));
  return nics;
}

}  // namespace mooncake::engine::rdma
