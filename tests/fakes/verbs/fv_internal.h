// Internals of the verbs emulator (see docs/rdma.md): its objects behind the ibv_* handles, the
// shared-memory rings that carry packets between processes, and the NIC thread.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tests/fakes/verbs/fake_verbs_control.h"

namespace mooncake::fakeverbs {

using Clock = std::chrono::steady_clock;

// ---- configuration (fv_config.cc) ----

struct DevCfg {
  std::string name;
  std::string host;  // "" = every process sees it
  std::string pci;   // PCI address, "0000:17:00.0"
  bool ib = false;   // link layer: InfiniBand (LID routed) or Ethernet (RoCE, GID routed)
  uint16_t lid = 0;
  int ngids = 0;
  uint8_t gids[4][16] = {};
  uint32_t gid_types[4] = {};  // enum ibv_gid_type_sysfs: 0 IB, 1 RoCE v1, 2 RoCE v2
  int mtu = IBV_MTU_4096;      // active MTU (enum ibv_mtu)
  uint64_t max_mr_size = 1ull << 40;
  int max_cqe = 1 << 22;  // device limit on a CQ's entries (ibv_device_attr::max_cqe)
  double gbps = 0;  // bandwidth cap (0: MC_FAKE_VERBS_GBPS)
  bool start_down = false;
  std::string key() const { return (host.empty() ? "_" : host) + "." + name; }
};

struct Fabric {
  std::string id;                 // shm name component
  std::string sysfs;              // the fake sysfs tree (ibdev_path points into it)
  std::vector<DevCfg> devices;    // every device of the fabric (all hosts)
  std::vector<int> visible;       // the ones this process sees (its MC_HOST_ID)
  double default_gbps = 0;        // MC_FAKE_VERBS_GBPS
  int64_t ack_timeout_ms = 0;     // MC_FAKE_VERBS_ACK_TIMEOUT_MS (0: from the QP's attributes)
  size_t ring_bytes = 1u << 20;   // MC_FAKE_VERBS_RING_BYTES
  std::string error;              // why there are no devices
};
// Parsed once per process (thread-safe).
const Fabric& fabric();
// The device whose GID table holds `gid` (is_global) or whose LID is `lid`; -1 when none.
int findDevice(const ibv_ah_attr& ah);

// ---- shared-memory rings ----

// A packet. Records in a ring are [Pkt][payload], 8-byte aligned; kPad fills the end.
enum PktType : uint8_t {
  kWrite = 1,
  kWriteImm = 2,
  kSend = 3,
  kSendImm = 4,
  kReadReq = 5,
  kAck = 6,
  kNak = 7,
  kReadResp = 8,
  kRnrNak = 9,
  kPad = 0xff,
};
constexpr uint8_t kFirst = 1;
constexpr uint8_t kLast = 2;

struct Pkt {
  uint32_t rec_len;  // record bytes (header + payload, padded to 8)
  uint8_t type;
  uint8_t flags;     // kFirst / kLast
  uint16_t status;   // kNak: the ibv_wc_status the requester completes with
  uint32_t msn;      // message sequence number of the request (per QP direction)
  uint32_t imm;
  uint32_t rkey;
  uint32_t len;      // payload bytes in this record
  uint32_t psn;      // requests: the requester's starting PSN (sq_psn), checked against rq_psn
  uint64_t raddr;
  uint64_t total;    // message bytes (read request: bytes asked for)
  uint64_t offset;   // of this record's payload in the message
};

struct Doorbell {  // in shared memory: one per context (its NIC thread sleeps on it)
  std::atomic<uint32_t> word;
  std::atomic<uint32_t> waiters;
};

struct RingHdr {
  uint32_t magic;
  uint32_t qpn;
  uint64_t size;  // data bytes (power of two)
  int32_t owner_pid;
  uint32_t pad;
  char doorbell[96];  // shm name of the owner context's doorbell
  alignas(64) std::atomic<uint64_t> tail;  // producer (the remote QP's NIC thread)
  alignas(64) std::atomic<uint64_t> head;  // consumer (the owner's NIC thread)
};

// One direction of a QP pair: the owner consumes, the connected remote QP produces.
class Ring {
 public:
  // Creates the owner's ring (name unlinked in the destructor).
  static std::unique_ptr<Ring> create(const std::string& name, size_t bytes, uint32_t qpn,
                                      const std::string& doorbell);
  // Maps a remote QP's ring to produce into it; nullptr while it does not exist.
  static std::unique_ptr<Ring> attach(const std::string& name);
  ~Ring();
  // Producer: false when there is no room (nothing written).
  bool push(const Pkt& h, const void* payload, size_t len, const void* payload2 = nullptr,
            size_t len2 = 0);
  size_t room() const;
  // Consumer: the next record, or false.
  bool peek(const Pkt** h, const char** payload);
  void pop();
  const RingHdr* hdr() const { return h_; }
  Doorbell* doorbell() const { return db_; }

 private:
  Ring() = default;
  std::string name_;
  bool owner_ = false;
  RingHdr* h_ = nullptr;
  char* data_ = nullptr;
  size_t map_bytes_ = 0;
  Doorbell* db_ = nullptr;  // producer side: the owner's doorbell, mapped
};

Doorbell* mapDoorbell(const std::string& name, bool create);
void unmapDoorbell(Doorbell* d);
void ring(Doorbell* d);

// ---- verbs objects ----

struct Ctx;
struct Pd;

struct Mr {
  ibv_mr mr;  // first: ibv_mr* <-> Mr*
  Pd* pd;
  int access;
  uint64_t iova;
  // Where the bytes are in this process: mr.addr for ibv_reg_mr; for a dma-buf MR (whose
  // mr.addr is its iova, as rdma-core sets it) the emulator's own mapping of the dma-buf.
  char* host = nullptr;
  void* map = nullptr;  // that mapping (dma-buf only), unmapped at deregistration
  size_t map_len = 0;
  uint64_t pinned_pages = 0;  // charged to the process's locked memory (ibv_reg_mr only)
};

struct Pd {
  ibv_pd pd;
  Ctx* ctx;
};

struct Channel {
  ibv_comp_channel ch;
  int wfd = -1;
  std::mutex mu;
  std::deque<ibv_cq*> events;
};

// Send-queue slots a QP's completions hold until they are polled (as mlx5 frees them).
using SlotCount = std::shared_ptr<std::atomic<int>>;

struct Cq {
  ibv_cq cq;
  Ctx* ctx;
  std::mutex mu;
  std::deque<std::pair<ibv_wc, SlotCount>> q;
  size_t cap = 0;
  bool armed = false;
  Channel* ch = nullptr;
  // Overrun: a completion found it full (or the overrun_next knob fired). As on a NIC the CQ
  // is then in error: polls fail, nothing is added, and its QPs go to the error state.
  std::atomic<bool> overrun{false};
  // And signals the channel when armed. `slots`: the send-queue slot count of the QP whose
  // send completion it is (decremented when polled).
  void add(const ibv_wc& wc, SlotCount slots = nullptr);
};

struct SendWr {
  uint64_t wr_id;
  ibv_wr_opcode op;
  bool signaled;
  uint32_t imm;
  uint64_t raddr;
  uint32_t rkey;
  std::vector<ibv_sge> sge;
  std::string inline_data;
  bool is_inline = false;
  uint64_t len = 0;
  uint32_t msn = 0;
  bool checked = false;   // local keys validated, fault knobs consulted
  uint64_t read_got = 0;  // read: bytes of the response placed
  // Its list's addresses as posted (`sge` holds this process's once checked) and Ctx::mr_gen
  // when its keys were checked: a WRITE packet gathered from it, or a READ response placed
  // into it, after an MR went checks them again (the requester's side of place_mu).
  std::vector<uint64_t> posted_addr;
  uint64_t gen = 0;
};

struct RecvWr {
  uint64_t wr_id;
  std::vector<ibv_sge> sge;
  bool checked = false;  // its local keys validated (addresses turned into this process's)
};

// A response this QP owes its peer (in order): an ACK/NAK, or a read's data.
struct Resp {
  uint8_t type;
  uint32_t msn;
  uint16_t status;
  const char* src = nullptr;  // read: local memory
  uint64_t total = 0;
  uint64_t sent = 0;
  // read: what src was checked against (its rkey and address, Ctx::mr_gen then): a READ whose
  // MR goes before its last packet is out is NAKed at the next one, as a NIC's rkey check would.
  uint32_t rkey = 0;
  uint64_t raddr = 0, gen = 0;
};

struct Qp {
  ibv_qp qp;  // first
  Ctx* ctx;
  std::mutex mu;
  ibv_qp_cap cap{};
  bool sq_sig_all = false;
  int access = 0;           // qp_access_flags (responder)
  uint8_t port = 1;
  ibv_ah_attr ah{};
  uint32_t dest_qpn = 0;
  uint8_t timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
  uint32_t sq_psn = 0, rq_psn = 0;  // RTS / RTR: a request whose PSN differs is never answered
  uint8_t max_dest_rd_atomic = 0;   // 0: READs are refused (REM_INV_REQ_ERR)
  SlotCount sq_unpolled = std::make_shared<std::atomic<int>>(0);
  int remote_dev = -1;      // fabric device index of the peer
  std::unique_ptr<Ring> in;   // ours
  std::unique_ptr<Ring> out;  // the peer's (attached at the first packet)
  std::vector<std::unique_ptr<Ring>> retired;  // earlier peers' rings (after a reset)
  // requester
  std::deque<SendWr> wrs;   // posted, not completed; [0, tx) fully transmitted
  size_t tx = 0;
  uint64_t tx_off = 0;
  uint32_t next_msn = 1;
  Clock::time_point last_progress{};
  Clock::time_point rnr_until{};
  int rnr_left = 7;
  // responder
  std::deque<RecvWr> rq;
  uint32_t expect_msn = 1;
  bool dropping = false;    // discarding the rest of a refused/RNR'd message
  uint32_t cur_msn = 0;
  char* cur_dst = nullptr;  // write target of the message being received
  // ... and what it was checked against: its rkey and range, and Ctx::mr_gen then (a WRITE
  // whose MR went meanwhile is refused on its next packet, as a NIC's rkey check would).
  uint32_t cur_rkey = 0;
  uint64_t cur_raddr = 0, cur_total = 0, cur_gen = 0;
  std::deque<Resp> resps;
  bool refused = false;     // refused a request: in error once its NAK is sent
  bool destroyed = false;  // ibv_destroy_qp ran: the NIC thread drops it
};

struct Ctx {
  ibv_context ctx;  // first
  int dev;          // fabric device index
  DevShm* shm = nullptr;
  std::string db_name;
  Doorbell* db = nullptr;
  std::mutex mu;                                // qps, mrs
  std::vector<std::shared_ptr<Qp>> qps;  // the NIC thread works on a snapshot
  std::unordered_map<uint32_t, Mr*> mrs;        // by lkey (== rkey)
  // WRITE placement into an MR and a READ response's copy out of one hold place_mu shared, as
  // do, on the requester, a WRITE's gather and a READ response's scatter; ibv_dereg_mr takes
  // it exclusively (before mu) and bumps mr_gen, so that no packet lands in or is read from
  // memory deregistered before it (a request in flight on it fails: IBV_WC_LOC_PROT_ERR).
  std::shared_mutex place_mu;
  std::atomic<uint64_t> mr_gen{0};
  uint32_t next_key = 0x1000;
  std::thread nic;
  std::atomic<bool> stop{false};
  uint64_t cap_bytes_per_s = 0;
  Mr* findMr(uint32_t key);  // ctx->mu held
};

// fv_nic.cc
void nicLoop(Ctx* c);
// Moves a QP to the error state: flushes its queues (qp->mu held).
void qpError(Qp* q, ibv_wc_status first_status);
void completeSend(Qp* q, const SendWr& w, ibv_wc_status st);
int64_t ackTimeoutMs(const Qp* q);

}  // namespace mooncake::fakeverbs
