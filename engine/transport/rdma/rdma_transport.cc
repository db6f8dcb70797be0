// rdma transport (see rdma_transport.h for what it does and the exchange format): NICs,
// memory registration, connections and the target side. The initiator's QPs and lanes are in
// rdma_peer.cc.
#include "engine/transport/rdma/rdma_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/params.h"
#include "engine/transport/rdma/rdma_internal.h"

namespace mooncake::engine {
namespace rdma {
namespace {
// Half of a QP's connection data (what each side tells the other).
struct QpAddr {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  ibv_gid gid{};
  int mtu = IBV_MTU_1024;
};

std::string encodeQpAddr(const QpAddr& a) {
  std::ostringstream os;
  os << a.qpn << " " << a.psn << " " << a.lid << " " << gidHex(a.gid) << " " << a.mtu;
  return os.str();
}

bool decodeQpAddr(std::istream& in, QpAddr* a) {
  std::string gid;
  int lid = 0;
  if (!(in >> a->qpn >> a->psn >> lid >> gid >> a->mtu)) return false;
  if (lid < 0 || lid > 0xffff || a->mtu < 1 || a->mtu > 5 || a->psn > 0xffffff) return false;
  a->lid = static_cast<uint16_t>(lid);
  return parseGid(gid, &a->gid);
}

int rdAtom(const Nic& n) { return std::max(1, std::min(16, n.max_rd_atom)); }

Result<ibv_qp*> createQp(Nic* nic, int send_wr, int recv_wr) {
  ibv_qp_init_attr ia{};
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = static_cast<uint32_t>(send_wr);
  ia.cap.max_recv_wr = static_cast<uint32_t>(recv_wr);
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  MC_ASSIGN_OR_RETURN(ibv_qp* qp, nic->createQp(&ia));  // (its CQ entries reserved)
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                IBV_QP_ACCESS_FLAGS) != 0) {
    nic->destroyQp(qp);
    return MC_STATUS(kUnavailable, "rdma: cannot move a QP of " << nic->name << " to INIT");
  }
  return qp;
}

// INIT -> RTR -> RTS toward `remote`.
Status connectQp(Nic* nic, ibv_qp* qp, uint32_t my_psn, const QpAddr& remote, bool remote_ib,
                 const RoceClass& cls) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  // A port that was down when the peer published its MTU may have reported none: at least 256.
  a.path_mtu = static_cast<ibv_mtu>(
      std::max<int>(IBV_MTU_256, std::min<int>(nic->activeMtu(), remote.mtu)));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(rdAtom(*nic));
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = 1;
  a.ah_attr.sl = cls.service_level;
  if (nic->ib) {
    a.ah_attr.dlid = remote.lid;
  } else {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = remote.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(nic->gid_index);
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.traffic_class = cls.traffic_class;
  }
  if (nic->ib != remote_ib)
    return MC_STATUS(kInvalidArgument, "rdma: link layers differ (" << nic->name << ")");
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                IBV_QP_MIN_RNR_TIMER) != 0)
    return MC_STATUS(kUnavailable, "rdma: cannot move a QP of " << nic->name << " to RTR");
  ibv_qp_attr b{};
  b.qp_state = IBV_QPS_RTS;
  b.sq_psn = my_psn;
  b.timeout = 14;
  b.retry_cnt = 7;
  b.rnr_retry = 7;  // receiver not ready: retry for ever (the target reposts its receives)
  b.max_rd_atomic = static_cast<uint8_t>(rdAtom(*nic));
  if (ibv_modify_qp(qp, &b, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) != 0)
    return MC_STATUS(kUnavailable, "rdma: cannot move a QP of " << nic->name << " to RTS");
  return Status::OK();
}

}  // namespace

// The target's QP toward one initiator: receives notifications.
struct RdmaTransportImpl::TargetQp {
  struct Slot final : CompletionTarget {
    TargetQp* owner = nullptr;
    char* buf = nullptr;
    void onCompletion(const ibv_wc& wc) override { owner->onRecv(this, wc); }
  };
  RdmaTransportImpl* t = nullptr;
  Nic* nic = nullptr;
  ibv_qp* qp = nullptr;
  uint64_t src = 0;
  uint64_t conn = 0;                   // the initiator's connection (its QPs, one per NIC)
  int lane = -1;                       // which of the initiator's lanes
  std::shared_ptr<NotifyOrder> order;  // shared by that connection's QPs
  std::vector<char> buf = std::vector<char>(kNotifyBytes * kRecvSlots);
  ibv_mr* mr = nullptr;
  Slot slots[kRecvSlots];
  std::atomic<bool> dead{false};     // its peer is gone: what still arrives is dropped
  std::atomic<bool> closing{false};  // closed (replaced, evicted): what arrived still counts
  // Receives posted and not completed: once closed (QP in ERR, which flushes them) and 0, no
  // completion refers to it any more and the prober frees it (reapGraveyard).
  std::atomic<int> posted{0};

  bool post(Slot* s) {
    ibv_sge sge{reinterpret_cast<uint64_t>(s->buf), static_cast<uint32_t>(kNotifyBytes), mr->lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = reinterpret_cast<uint64_t>(static_cast<CompletionTarget*>(s));
    wr.sg_list = &sge;
    wr.num_sge = 1;
    posted.fetch_add(1);
    if (ibv_post_recv(qp, &wr, &bad) == 0) return true;
    posted.fetch_sub(1);
    return false;
  }
  // Moves it out of service: its QP to ERR (which flushes its receives).
  void close(bool drop) {
    if (drop) dead.store(true);
    closing.store(true);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp, &a, IBV_QP_STATE);
  }
  void onRecv(Slot* s, const ibv_wc& wc) {
    handleRecv(s, wc);
    posted.fetch_sub(1);  // the last touch: the prober may free this from here on
  }
  void handleRecv(Slot* s, const ibv_wc& wc) {
    if (wc.status != IBV_WC_SUCCESS || dead.load()) return;
    bool ok = wc.opcode == IBV_WC_RECV && wc.byte_len == kNotifyBytes;
    if (ok) {
      uint32_t channel, word;
      uint64_t tag;
      std::memcpy(&channel, s->buf, 4);
      std::memcpy(&word, s->buf + 4, 4);
      std::memcpy(&tag, s->buf + 8, 8);
      // Delivered once every part of it (and every earlier notification) arrived.
      ok = order->arrive(word, channel, tag,
                         [&](uint32_t c, uint64_t tg) { t->deliverNotify(src, c, tg); });
    }
    if (!ok) {
      MC_LOG(WARN, RDMA) << "dropping a malformed receive (" << wc.byte_len << " bytes) from "
                         << hex(src);
    }
    if (closing.load()) return;
    if (!post(s)) {
      MC_LOG(ERROR, RDMA) << "cannot repost a receive on " << nic->name;
    }
  }
  ~TargetQp() {
    if (qp != nullptr) nic->destroyQp(qp);
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
};

RdmaTransportImpl::RdmaTransportImpl(const TransportOptions& o) : opts_(o) {}

RdmaTransportImpl::~RdmaTransportImpl() { stop(); }

Status RdmaTransportImpl::start(EngineContext* ctx) {
  ctx_ = ctx;
  slice_bytes_ = static_cast<uint64_t>(
      std::clamp<int64_t>(params::getInt("MC_RDMA_SLICE_BYTES"), 4096, 1ll << 30));
  max_wr_ = static_cast<int>(std::clamp<int64_t>(params::getInt("MC_RDMA_MAX_WR"), 1, 4096));
  const std::string stripe = params::getString("MC_RDMA_STRIPE");
  if (stripe != "near" && stripe != "all")
    return MC_STATUS(kInvalidArgument, "MC_RDMA_STRIPE must be near or all, not '" << stripe << "'");
  stripe_all_ = stripe == "all";
  qps_per_nic_ = static_cast<int>(std::clamp<int64_t>(params::getInt("MC_RDMA_QPS_PER_EP"), 1, 16));
  retry_ = std::chrono::milliseconds(
      std::clamp<int64_t>(params::getInt("MC_RDMA_RETRY_MS"), 1, 3600 * 1000));
  max_endpoints_ = static_cast<int>(
      std::clamp<int64_t>(params::getInt("MC_RDMA_MAX_ENDPOINTS"), 0, 1 << 20));
  stall_ = std::chrono::milliseconds(
      std::clamp<int64_t>(params::getInt("MC_RDMA_STALL_MS"), 0, 3600 * 1000));
  tcp_fallback_ = params::getBool("MC_RDMA_TCP_FALLBACK");
  const int64_t tc = params::getInt("MC_RDMA_TRAFFIC_CLASS");
  const int64_t sl = params::getInt("MC_RDMA_SERVICE_LEVEL");
  if (tc < 0 || tc > 255)
    return MC_STATUS(kInvalidArgument, "MC_RDMA_TRAFFIC_CLASS must be 0-255, not " << tc);
  if (sl < 0 || sl > 15)
    return MC_STATUS(kInvalidArgument, "MC_RDMA_SERVICE_LEVEL must be 0-15, not " << sl);
  cls_.traffic_class = static_cast<uint8_t>(tc);
  cls_.service_level = static_cast<uint8_t>(sl);
  MC_ASSIGN_OR_RETURN(nics_, openNics());
  topo_ = nics_.size() > 1 ? Topology::load() : Topology::empty();  // one NIC: nothing to choose
  int64_t spin = params::getInt("MC_RDMA_SPIN_US");
  if (spin < 0) spin = std::thread::hardware_concurrency() >= 8 ? 50 : 0;
  for (auto& n : nics_) {
    n->on_idle = [this] { pumpAll(); };
    n->on_dead = [this, nic = n.get()](const Status& why) { nicDied(nic, why); };
    n->startPoller(spin);
  }
  std::string names;
  for (auto& n : nics_)
    names += " " + n->name + (n->ib ? "(ib" : "(roce") + (n->pci.empty() ? "" : " " + n->pci) + ")";
  MC_LOG(INFO, RDMA) << "rdma NICs:" << names << "; topology: " << topo_->source();
  prober_ = std::thread([this] { probeLoop(); });
  return Status::OK();
}

void RdmaTransportImpl::fillLocalSegment(SegmentDesc* desc) {
  desc->transports |= 1u << static_cast<int>(TransportKind::kRdma);
  desc->endpoints[static_cast<int>(TransportKind::kRdma)] = encodeNics(nics_);
}

Status RdmaTransportImpl::registerRegion(Region* region) {
  LocalMr m{region->len, {}, {}};
  // Where the region lives: a GPU (its PCI address, from the topology's "cuda<N>" device), a
  // NUMA node named by the caller (host memory's device), or the node its pages are on.
  MemLocation where;
  if (region->kind == MemoryKind::kCuda && region->device >= 0)
    where.pci = topo_->pciOf("cuda" + std::to_string(region->device));
  else if (region->kind == MemoryKind::kHost && region->device >= 0)
    where.numa = region->device;
  else if (region->kind == MemoryKind::kHost)
    where.numa = topo_->numaOfMemory(reinterpret_cast<void*>(region->addr),
                                     std::min<uint64_t>(region->len, 64 << 10));  // a sample
  std::vector<std::string> pcis;
  for (auto& n : nics_) pcis.push_back(n->pci);
  m.near = topo_->nearest(pcis, where);
  // A region larger than a NIC's max_mr_size is registered in chunks of the smallest
  // max_mr_size (page multiples), the same on every NIC; each chunk is an entry of its own
  // here and has its own keys in the descriptor (rdma_transport.h).
  uint64_t chunk = region->len;
  for (auto& n : nics_)
    if (n->max_mr_size > 0) chunk = std::min(chunk, n->max_mr_size & ~uint64_t{4095});
  if (chunk == 0) chunk = region->len;
  const bool split = chunk < region->len;
  std::string keys = split ? "chunk=" + std::to_string(chunk) : "";
  std::vector<std::pair<uint64_t, LocalMr>> entries;
  const bool gpu = region->kind == MemoryKind::kCuda;
  auto undo = [&entries](const std::vector<ibv_mr*>& more) {
    for (auto& [a, e] : entries)
      for (ibv_mr* x : e.mrs)
        if (x != nullptr) ibv_dereg_mr(x);
    for (ibv_mr* x : more)
      if (x != nullptr) ibv_dereg_mr(x);
  };
  // Host memory is registered on every NIC that takes it ("-" in the keys where one refuses:
  // requests there go through another NIC or the bounce pool); it fails only when no NIC in
  // service takes a chunk, or at once for a range no NIC can pin (EFAULT: not mapped). GPU
  // memory cannot bounce through host memory: every NIC in service must reach it. NICs out of
  // service (a failed CQ) are skipped.
  std::string refused;  // the NICs that refused host memory, with the cause
  for (uint64_t off = 0; off < region->len; off += chunk) {
    LocalMr c{std::min(chunk, region->len - off), {}, m.near, gpu, gpu ? region->device : -1};
    const uint64_t addr = region->addr + off;
    std::string ck;
    Status first;  // the first refusal of this chunk
    bool any = false;
    for (auto& n : nics_) {
      ibv_mr* mr = nullptr;
      if (n->deadStatus().ok()) {
        std::string why;
        mr = gpu ? registerDeviceMr(n->pd, addr, c.len, &why)
                 : ibv_reg_mr(n->pd, reinterpret_cast<void*>(addr), c.len, kAccess);
        const int e = errno;
        if (mr == nullptr && gpu) {
          undo(c.mrs);
          return MC_STATUS(kUnavailable, "rdma: cannot register GPU memory ["
                                             << hex(addr) << ", +" << c.len << ") of device "
                                             << region->device << " with " << n->name << ": "
                                             << why);
        }
        if (mr == nullptr) {
          Status st = registrationError(n->name, addr, c.len, e);
          if (e == EFAULT) {  // the mapping: every NIC refuses it
            undo(c.mrs);
            return st;
          }
          if (first.ok()) first = st;
          if (refused.find(n->name + ":") == std::string::npos)
            refused += (refused.empty() ? "" : "; ") + st.message();
        }
      }
      c.mrs.push_back(mr);
      any |= mr != nullptr;
      ck += (ck.empty() ? "" : ",") + (mr ? std::to_string(mr->rkey) : std::string("-"));
    }
    if (!any) {
      undo(c.mrs);
      if (!first.ok()) return first;
      return MC_STATUS(kUnavailable, "rdma: no NIC is in service to register ["
                                         << hex(addr) << ", +" << c.len << ")");
    }
    keys += (split ? "/" : "") + ck;
    entries.emplace_back(addr, std::move(c));
  }
  if (!refused.empty()) {
    MC_LOG(WARN, RDMA) << "[" << hex(region->addr) << ", +" << region->len
                       << ") is registered without some NICs (requests there use the others "
                          "or the bounce pool): "
                       << refused;
  }
  region->keys[static_cast<int>(TransportKind::kRdma)] = keys;
  std::unique_lock<std::shared_mutex> g(mr_mu_);
  for (auto& [addr, c] : entries) mrs_[addr] = std::move(c);
  if (gpu) noteGpuOrdinalsLocked();
  return Status::OK();
}

void RdmaTransportImpl::noteGpuOrdinalsLocked() {
  uint64_t bits = 0;
  for (const auto& [addr, m] : mrs_)
    if (m.device && m.ordinal >= 0 && m.ordinal < 64) bits |= uint64_t{1} << m.ordinal;
  gpu_ordinals_.store(bits, std::memory_order_release);
}

void RdmaTransportImpl::flushGpuWrites() {
  const uint64_t bits = gpu_ordinals_.load(std::memory_order_acquire);
  if (bits == 0) return;
  auto dev = device::get();
  if (!dev.ok()) return;
  for (int d = 0; d < 64; ++d) {
    if (((bits >> d) & 1) == 0) continue;
    Status st = (*dev)->flushRemoteWrites(d);
    if (!st.ok() && !flush_warned_.exchange(true)) {
      MC_LOG(WARN, RDMA) << "flushing GPUDirect writes before a notification: " << st.toString();
    }
  }
}

void RdmaTransportImpl::unregisterRegion(const Region& region) {
  std::vector<LocalMr> gone;  // the region's chunks
  {
    std::unique_lock<std::shared_mutex> g(mr_mu_);
    auto it = mrs_.lower_bound(region.addr);
    while (it != mrs_.end() && it->first < region.addr + region.len) {
      gone.push_back(std::move(it->second));
      it = mrs_.erase(it);
    }
    if (region.kind == MemoryKind::kCuda) noteGpuOrdinalsLocked();
  }
  for (LocalMr& m : gone)
    for (ibv_mr* mr : m.mrs)
      if (mr != nullptr) ibv_dereg_mr(mr);
}

ibv_mr* RdmaTransportImpl::registerDeviceMr(ibv_pd* pd, uint64_t addr, uint64_t len,
                                            std::string* why) {
  auto dev = device::get();
  if (dev.ok()) {
    auto buf = (*dev)->exportDmabuf(reinterpret_cast<void*>(addr), len);
    if (buf.ok()) {
      ibv_mr* mr = ibv_reg_dmabuf_mr(pd, buf->offset, len, addr, buf->fd, kAccess);
      const int e = errno;
      close(buf->fd);  // the MR holds the dma-buf
      if (mr != nullptr) return mr;
      *why = std::string("ibv_reg_dmabuf_mr: ") + strerror(e);
    } else {
      *why = buf.status().message();
    }
  } else {
    *why = dev.status().message();
  }
  ibv_mr* mr = ibv_reg_mr(pd, reinterpret_cast<void*>(addr), len, kAccess);
  if (mr == nullptr) *why += std::string("; ibv_reg_mr: ") + strerror(errno);
  return mr;
}

bool RdmaTransportImpl::isDeviceMemory(const void* p) const {
  {
    uint64_t a = reinterpret_cast<uint64_t>(p);
    std::shared_lock<std::shared_mutex> g(mr_mu_);
    auto it = mrs_.upper_bound(a);
    if (it != mrs_.begin()) {
      --it;
      if (a - it->first < it->second.len) return it->second.device;
    }
  }
  if (!device::active()) return false;
  auto dev = device::get();
  return dev.ok() && (*dev)->pointer(p).device;
}

uint64_t RdmaTransportImpl::localSpan(const void* p) const {
  uint64_t a = reinterpret_cast<uint64_t>(p);
  std::shared_lock<std::shared_mutex> g(mr_mu_);
  auto it = mrs_.upper_bound(a);
  if (it == mrs_.begin()) return 0;
  --it;
  return a - it->first < it->second.len ? it->second.len - (a - it->first) : 0;
}

std::vector<int> RdmaTransportImpl::localKeys(const void* p, uint64_t len,
                                              std::vector<int64_t>* lkeys) const {
  lkeys->clear();
  uint64_t a = reinterpret_cast<uint64_t>(p);
  std::shared_lock<std::shared_mutex> g(mr_mu_);
  auto it = mrs_.upper_bound(a);
  if (it == mrs_.begin()) return {};
  --it;
  if (a - it->first > it->second.len || len > it->second.len - (a - it->first)) return {};
  for (ibv_mr* mr : it->second.mrs)  // (-1 as int64_t, not as the lkey's uint32_t)
    lkeys->push_back(mr == nullptr ? int64_t{-1} : static_cast<int64_t>(mr->lkey));
  return it->second.near;
}

bool RdmaTransportImpl::lkey(const void* p, uint64_t len, int nic, uint32_t* key) const {
  uint64_t a = reinterpret_cast<uint64_t>(p);
  std::shared_lock<std::shared_mutex> g(mr_mu_);
  auto it = mrs_.upper_bound(a);
  if (it == mrs_.begin()) return false;
  --it;
  if (a - it->first > it->second.len || len > it->second.len - (a - it->first)) return false;
  ibv_mr* mr = it->second.mrs[static_cast<size_t>(nic)];
  if (mr == nullptr) return false;
  *key = mr->lkey;
  return true;
}

bool RdmaTransportImpl::canReach(const SegmentDesc& local, const SegmentDesc& remote) const {
  (void)local;
  if (nics_.empty() || !remote.offers(TransportKind::kRdma)) return false;
  auto theirs = decodeNics(remote.endpoints[static_cast<int>(TransportKind::kRdma)]);
  if (!theirs.ok()) return false;
  for (const auto& n : nics_)
    for (const auto& r : *theirs)
      if (n->ib == r.ib) return true;
  return false;
}

Result<ibv_qp*> RdmaTransportImpl::dial(Nic* nic, int remote_nic, bool remote_ib, uint64_t conn,
                                        int lane, ControlLink& control, const std::string& peer,
                                        Deadline deadline) {
  MC_ASSIGN_OR_RETURN(ibv_qp* raw, createQp(nic, max_wr_, 1));
  QpAddr mine;
  mine.qpn = raw->qp_num;
  mine.psn = randomPsn();
  mine.lid = nic->lid();
  mine.gid = nic->gid;
  mine.mtu = nic->activeMtu();
  std::string req = "2 " + std::to_string(nic->index) + " " + std::to_string(remote_nic) + " " +
                    encodeQpAddr(mine) + " " + (nic->ib ? "1" : "0") + " " + std::to_string(conn) +
                    " " + std::to_string(lane);
  Status st;
  auto ans = control.exchange(TransportKind::kRdma, req, deadline);
  QpAddr theirs;
  if (!ans.ok()) {
    st = ans.status();
  } else {
    std::istringstream in(*ans);
    st = decodeQpAddr(in, &theirs)
             ? connectQp(nic, raw, mine.psn, theirs, remote_ib, cls_)
             : MC_STATUS(kProtocol, "rdma: malformed connection answer from " << peer);
  }
  if (!st.ok()) {
    nic->destroyQp(raw);
    return st;
  }
  MC_LOG(INFO, RDMA) << "connected to " << peer << ": lane " << lane << ", " << nic->name
                     << " -> its NIC " << remote_nic << ", qpn " << mine.qpn << " -> "
                     << theirs.qpn;
  return raw;
}

Result<std::unique_ptr<TransportPeer>> RdmaTransportImpl::connect(
    const SegmentDesc& remote, Deadline deadline, bool data, std::shared_ptr<ControlLink> control) {
  if (control == nullptr)
    return MC_STATUS(kInvalidArgument, "rdma: connecting " << remote.name << " needs a control link");
  MC_ASSIGN_OR_RETURN(auto theirs,
                      decodeNics(remote.endpoints[static_cast<int>(TransportKind::kRdma)]));
  // One lane per local NIC, to the peer NIC of the same link layer in the same position among
  // those (rail-matched: local NIC k of a kind talks to the peer's NIC k of that kind, modulo
  // how many the peer has). The connection id ties the lanes' notifications together at the
  // target (rdma_notify.h).
  const uint64_t conn = (static_cast<uint64_t>(randomPsn()) << 32) ^ randomPsn() ^
                        static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  std::vector<LaneInit> lanes;
  int kind_pos[2] = {0, 0};
  Status last;
  bool any = false;
  for (auto& n : nics_) {
    std::vector<int> same;
    for (size_t i = 0; i < theirs.size(); ++i)
      if (theirs[i].ib == n->ib) same.push_back(static_cast<int>(i));
    int& pos = kind_pos[n->ib ? 1 : 0];
    if (same.empty()) continue;
    const int rn = same[static_cast<size_t>(pos++) % same.size()];
    // MC_RDMA_QPS_PER_EP lanes on this NIC (a notification has at most 63 parts: so many
    // lanes at most).
    for (int q = 0; q < qps_per_nic_ && lanes.size() < kMaxNotifyParts; ++q) {
      const int id = static_cast<int>(lanes.size());
      ibv_port_attr pa{};
      Result<ibv_qp*> raw = MC_STATUS(kUnavailable, "rdma: port 1 of " << n->name << " is down");
      if (ibv_query_port(n->ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE)
        raw = dial(n.get(), rn, n->ib, conn, id, *control, remote.name, deadline);
      if (!raw.ok()) {  // this NIC does not reach the peer now; the others may (and the
                        // prober dials this lane again)
        MC_LOG(WARN, RDMA) << "peer " << remote.name << ": no lane on " << n->name << " yet: "
                           << raw.status().toString();
        last = raw.status();
        lanes.push_back(LaneInit{n.get(), nullptr, last, rn, n->ib, id});
        continue;
      }
      any = true;
      lanes.push_back(LaneInit{n.get(), *raw, Status::OK(), rn, n->ib, id});
    }
  }
  if (!any) {
    if (!last.ok()) return last;
    return MC_STATUS(kUnavailable, "rdma: no NIC of this engine reaches a NIC of " << remote.name);
  }
  auto peer = makeRdmaPeer(this, std::move(lanes), remote, conn, std::move(control));
  if (peer == nullptr) return MC_STATUS(kUnavailable, "rdma: cannot register a notify buffer");
  return peer;
}

void RdmaTransportImpl::onExchange(const SegmentDesc& from, std::string request,
                                   std::function<void(Result<std::string>)> reply) {
  if (request.rfind("F ", 0) == 0) return onFallback(from, request, reply);
  if (request.rfind("C ", 0) == 0) {  // the initiator closed a lane (eviction)
    std::istringstream in(request.substr(2));
    uint64_t conn = 0;
    int lane = -1;
    if (!(in >> conn >> lane)) return reply(MC_STATUS(kProtocol, "rdma: malformed close"));
    {
      std::lock_guard<std::mutex> g(target_mu_);
      closeTargetLocked(from.engine_id, conn, lane);
    }
    return reply(std::string());
  }
  std::istringstream in(request);
  int version = 0, their_nic = -1, my_nic = -1, ib = 0, lane = -1;
  uint64_t conn = 0;
  QpAddr peer;
  if (!(in >> version >> their_nic >> my_nic) || version != 2 || !decodeQpAddr(in, &peer) ||
      !(in >> ib >> conn >> lane))
    return reply(MC_STATUS(kProtocol, "rdma: malformed connection request"));
  if (my_nic < 0 || static_cast<size_t>(my_nic) >= nics_.size())
    return reply(MC_STATUS(kInvalidArgument, "rdma: no NIC " << my_nic << " here"));
  Nic* nic = nics_[static_cast<size_t>(my_nic)].get();
  auto raw = createQp(nic, 1, kRecvSlots);
  if (!raw.ok()) return reply(raw.status());
  auto tq = std::make_unique<TargetQp>();
  tq->t = this;
  tq->nic = nic;
  tq->qp = *raw;
  tq->src = from.engine_id;
  tq->conn = conn;
  tq->lane = lane;
  tq->mr = ibv_reg_mr(nic->pd, tq->buf.data(), tq->buf.size(), IBV_ACCESS_LOCAL_WRITE);
  if (tq->mr == nullptr) return reply(MC_STATUS(kUnavailable, "rdma: cannot register receives"));
  for (int i = 0; i < kRecvSlots; ++i) {
    tq->slots[i].owner = tq.get();
    tq->slots[i].buf = tq->buf.data() + kNotifyBytes * i;
    if (!tq->post(&tq->slots[i]))
      return reply(MC_STATUS(kUnavailable, "rdma: cannot post receives on " << nic->name));
  }
  QpAddr mine;
  mine.qpn = tq->qp->qp_num;
  mine.psn = randomPsn();
  mine.lid = nic->lid();
  mine.gid = nic->gid;
  mine.mtu = nic->activeMtu();
  Status st = connectQp(nic, tq->qp, mine.psn, peer, ib != 0, cls_);
  if (!st.ok()) return reply(st);
  {
    // The connection's QPs share one notification order (rdma_notify.h), which outlives them
    // (lanes are evicted and dialled again). A lane the initiator reconnects (failover,
    // eviction) replaces its old QP here.
    std::lock_guard<std::mutex> g(target_mu_);
    std::shared_ptr<NotifyOrder>& order = orders_[{from.engine_id, conn}];
    if (!order) order = std::make_shared<NotifyOrder>();
    tq->order = order;
    closeTargetLocked(from.engine_id, conn, lane);
    targets_.emplace(from.engine_id, std::move(tq));
  }
  reply(encodeQpAddr(mine));
}

void RdmaTransportImpl::closeTargetLocked(uint64_t src, uint64_t conn, int lane) {
  auto range = targets_.equal_range(src);
  for (auto it = range.first; it != range.second;) {
    if (it->second->conn != conn || it->second->lane != lane) {
      ++it;
      continue;
    }
    it->second->close(false);  // what it received before still counts
    graveyard_.push_back(std::move(it->second));
    it = targets_.erase(it);
  }
}

void RdmaTransportImpl::reapGraveyard() {
  std::lock_guard<std::mutex> g(target_mu_);
  graveyard_.erase(std::remove_if(graveyard_.begin(), graveyard_.end(),
                                  [](const std::unique_ptr<TargetQp>& q) {
                                    return q->posted.load() == 0;
                                  }),
                   graveyard_.end());
}

void RdmaTransportImpl::onPeerGone(uint64_t engine_id) {
  std::lock_guard<std::mutex> g(target_mu_);
  auto range = targets_.equal_range(engine_id);
  for (auto it = range.first; it != range.second; ++it) {
    it->second->close(true);
    graveyard_.push_back(std::move(it->second));  // freed once flushed (reapGraveyard)
  }
  targets_.erase(range.first, range.second);
  orders_.erase(orders_.lower_bound({engine_id, 0}), orders_.upper_bound({engine_id, UINT64_MAX}));
}

std::vector<Qp*> RdmaTransportImpl::pinned(const Nic* nic) {
  std::vector<Qp*> out;
  std::lock_guard<std::mutex> g(qps_mu_);
  for (Qp* q : qps_) {
    if (nic != nullptr && q->nic() != nic) continue;
    q->pin();
    out.push_back(q);
  }
  return out;
}

void RdmaTransportImpl::nicDied(Nic* nic, const Status& why) {
  // Without qps_mu_: a give-back takes the peer's lock. A QP created on this NIC from now on
  // finds it dead itself (Qp::Qp); one being destroyed stops waiting for its flush (Qp::~Qp).
  for (Qp* q : pinned(nic)) {
    q->abandon(why);
    q->unpin();
  }
  // Its target QPs' receives never complete now: closed and freed (nothing polls them).
  std::lock_guard<std::mutex> g(target_mu_);
  for (auto it = targets_.begin(); it != targets_.end();) {
    if (it->second->nic != nic) {
      ++it;
      continue;
    }
    it->second->close(false);
    graveyard_.push_back(std::move(it->second));
    it = targets_.erase(it);
  }
  for (auto& q : graveyard_)
    if (q->nic == nic) q->posted.store(0);
}

void RdmaTransportImpl::addQp(Qp* q) {
  std::lock_guard<std::mutex> g(qps_mu_);
  qps_.insert(q);
}

void RdmaTransportImpl::removeQp(Qp* q) {
  std::lock_guard<std::mutex> g(qps_mu_);
  qps_.erase(q);
}

void RdmaTransportImpl::addPeer(RdmaPeer* p) {
  std::lock_guard<std::mutex> g(peers_mu_);
  peers_.insert(p);
}

void RdmaTransportImpl::removePeer(RdmaPeer* p) {
  std::lock_guard<std::mutex> g(peers_mu_);  // held by the prober while it probes
  peers_.erase(p);
}

void RdmaTransportImpl::pumpAll() {
  for (Qp* q : pinned(nullptr)) {  // (a QP that fails to post gives its work back)
    q->pump();
    q->unpin();
  }
}

void RdmaTransportImpl::kickProber() {
  {
    std::lock_guard<std::mutex> g(probe_mu_);
    probe_kick_ = true;
  }
  probe_cv_.notify_all();
}

void RdmaTransportImpl::deliverNotify(uint64_t src, uint32_t channel, uint64_t tag) {
  // The writes it follows may have gone into GPU memory (GPUDirect), whatever carried the
  // notification itself: a part that went over the tcp fallback may follow writes a NIC made
  // before its lane failed.
  flushGpuWrites();
  if (channel != 0 && ctx_->deliver_notify) return ctx_->deliver_notify(src, channel, tag);
  if (ctx_->inbox == nullptr) return;
  // The engine's dispatcher drains the inbox; a full one delays this poller a little.
  Status st = ctx_->inbox->pushNotify(src, channel, tag, deadlineInMs(10000));
  if (!st.ok()) {
    MC_LOG(ERROR, RDMA) << "dropping notification from " << hex(src) << ": " << st.toString();
  }
}

void RdmaTransportImpl::stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    std::lock_guard<std::mutex> g(probe_mu_);
    probe_stop_ = true;
  }
  probe_cv_.notify_all();
  if (prober_.joinable()) prober_.join();
  // Fail what the peers still hold and let the pollers flush it before they stop (the peers
  // themselves are destroyed after this, and must find nothing in flight).
  for (Qp* q : pinned(nullptr)) {
    q->fail(MC_STATUS(kCancelled, "rdma: the engine is stopping"));
    q->unpin();
  }
  auto until = Clock::now() + std::chrono::seconds(2);
  for (bool busy = true; busy && Clock::now() < until;) {
    busy = false;
    {
      std::lock_guard<std::mutex> g(qps_mu_);
      for (Qp* q : qps_) busy |= q->inflight() > 0;
    }
    if (busy) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (auto& n : nics_) n->stopPoller();
  {
    std::lock_guard<std::mutex> g(target_mu_);
    targets_.clear();
    graveyard_.clear();
  }
  // Regions still registered are deregistered before their NIC's PD goes away.
  std::unique_lock<std::shared_mutex> g(mr_mu_);
  for (auto& [addr, m] : mrs_)
    for (ibv_mr* mr : m.mrs)
      if (mr != nullptr) ibv_dereg_mr(mr);
  mrs_.clear();
}

}  // namespace rdma

std::unique_ptr<Transport> makeRdmaTransport(const TransportOptions& options) {
  return std::make_unique<rdma::RdmaTransportImpl>(options);
}

}  // namespace mooncake::engine
