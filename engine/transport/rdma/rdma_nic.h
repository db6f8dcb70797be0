// rdma NICs: one context per NIC the engine uses (PD, one CQ shared by its QPs, a completion
// channel and a poller thread), opened from libibverbs' device list at start.
//
// Contracts:
//  - openNics() opens every device (MC_RDMA_DEVICES filters by name); one whose first port
//    is down (down_at_start: a RoCE port that has its GID, or an InfiniBand port, whose LID
//    is assigned once it is up) is kept: its lanes fail to connect until the port is up, then
//    the prober connects them. At least one port must be ACTIVE. RoCE ports use the RoCE v2
//    GID that holds an IPv4-mapped address (or MC_RDMA_GID_INDEX when >= 0); InfiniBand ports
//    are addressed by LID. The LID and the path MTU (the port's active MTU) are read again at
//    each connection (lid(), activeMtu()); the LID in the descriptor is the one at open and
//    only informs (connections exchange the current one).
//  - The poller busy-polls its CQ for MC_RDMA_SPIN_US after the last completion, then arms the
//    CQ and sleeps on the completion channel (waking every 5 ms to notice stop()).
//  - CQ capacity: every QP is created through createQp(), which reserves its max_send_wr +
//    max_recv_wr entries on the NIC's CQ (growing the CQ with ibv_resize_cq up to the device's
//    max_cqe first) and refuses the QP when they do not fit; destroyQp() gives them back. So
//    the CQ cannot overrun. Should polling fail anyway (an overrun, a device error), the NIC is
//    out of service for the engine's life: the poller stops polling, logs one ERROR and calls
//    on_dead once (the transport gives its QPs' work to other NICs or tcp); no new QP is made.
//  - Every work request's wr_id is a CompletionTarget*: the poller calls its onCompletion() on
//    the poller thread. The object must outlive its work request's completion (flushes
//    included: moving a QP to ERR completes everything it holds with IBV_WC_WR_FLUSH_ERR).
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/status.h"

namespace mooncake::engine::rdma {

class CompletionTarget {
 public:
  virtual ~CompletionTarget() = default;
  virtual void onCompletion(const ibv_wc& wc) = 0;
};

struct Nic {
  int index = 0;  // in the engine's NIC list (and in the endpoint data it publishes)
  std::string name;
  std::string pci;  // PCI address from sysfs (topology lookups); empty when unknown
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_port_attr port{};
  bool ib = false;  // link layer InfiniBand (LID routed); else Ethernet (RoCE, GID routed)
  int gid_index = -1;
  ibv_gid gid{};
  uint64_t max_mr_size = 0;
  int max_rd_atom = 16;  // outstanding RDMA READs per QP (device limit)
  bool down_at_start = false;  // port down when opened (see openNics)
  int max_cqe = 0;             // device limit (ibv_device_attr::max_cqe)
  std::thread poller;
  std::atomic<bool> stopping{false};
  // Called by the poller when it has been idle (no completion) for a while: lets the
  // transport retry work that waited for a resource another NIC released.
  std::function<void()> on_idle;
  // Called once, by the poller, when polling the CQ failed: nothing it holds completes any
  // more (see the contracts above).
  std::function<void(const Status& why)> on_dead;

  // Creates a QP on this NIC's PD and CQ when its queues fit the CQ (see above).
  Result<ibv_qp*> createQp(ibv_qp_init_attr* attr);
  // Destroys a QP made by createQp() and gives its CQ entries back.
  void destroyQp(ibv_qp* qp);
  // The CQ entries reserved now and the CQ's size (tests, logs).
  std::pair<int, int> cqUsage();
  // Why the NIC is out of service (OK while it is not).
  Status deadStatus();

  ~Nic();
  // The port's active MTU now (enum ibv_mtu); the one read at open while the port is down.
  int activeMtu() const;
  // The port's LID now (InfiniBand); the one read at open while the port is down.
  uint16_t lid() const;
  void startPoller(int64_t spin_us);
  void stopPoller();

 private:
  // Polls the CQ; on a failure marks the NIC dead (once) and returns -1.
  int poll(ibv_wc* wcs, int n);
  std::mutex cq_mu_;
  int cq_reserved_ = 0;                // entries reserved by live QPs
  std::map<ibv_qp*, int> cq_share_;    // each QP's reservation
  Status dead_;                        // set once polling failed
  std::atomic<bool> dead_flag_{false};
};

// What a peer needs to reach one NIC: one line "name ib lid gidhex mtu" per NIC.
struct NicAddress {
  std::string name;
  bool ib = false;
  uint16_t lid = 0;
  ibv_gid gid{};
  int mtu = 0;  // enum ibv_mtu
};
std::string encodeNics(const std::vector<std::unique_ptr<Nic>>& nics);
Result<std::vector<NicAddress>> decodeNics(const std::string& s);
std::string gidHex(const ibv_gid& g);
bool parseGid(const std::string& hex, ibv_gid* g);

// Why ibv_reg_mr refused [addr, addr+len) of host memory on NIC `nic` (errno `e`), with what
// to do about it (RLIMIT_MEMLOCK / CAP_IPC_LOCK, an unmapped range).
Status registrationError(const std::string& nic, uint64_t addr, uint64_t len, int e);

// Opens the NICs (see above). An empty list is kUnavailable with the reason.
Result<std::vector<std::unique_ptr<Nic>>> openNics();

}  // namespace mooncake::engine::rdma
