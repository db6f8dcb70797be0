// What the rdma transport's files share (rdma_transport.cc: NICs, memory, connections, the
// target side; rdma_peer.h/.cc: the initiator's QPs, slicing, striping and failover).
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/bounce_pool.h"
#include "engine/topology.h"
#include "engine/transport/rdma/rdma_nic.h"
#include "engine/transport/rdma/rdma_notify.h"
#include "engine/transport/transport.h"

namespace mooncake::engine::rdma {

constexpr int kRecvSlots = 64;       // receives a target keeps posted per QP
constexpr size_t kNotifyBytes = 16;  // u32 channel | u32 word | u64 tag (rdma_notify.h)
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

inline std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

inline uint32_t randomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

// One request being moved: done once every slice completed.
struct TaskState {
  Task* task;
  std::atomic<int> remaining;
  std::mutex mu;
  Status err;
  std::atomic<bool> failed{false};  // a slice failed: the rest is not carried any more
  TaskState(Task* t, int n) : task(t), remaining(n) {}
  void finish(const Status& st) {
    if (!st.ok()) {
      std::lock_guard<std::mutex> g(mu);
      if (err.ok()) err = st;
      failed.store(true);
    }
    if (remaining.fetch_sub(1) != 1) return;
    Status s;
    {
      std::lock_guard<std::mutex> g(mu);
      s = err;
    }
    Task* t = task;
    delete this;
    t->done(std::move(s));
  }
};

class Qp;

// The RoCE traffic class and the service level of every QP (MC_RDMA_TRAFFIC_CLASS,
// MC_RDMA_SERVICE_LEVEL, as NCCL_IB_TC / NCCL_IB_SL).
struct RoceClass {
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
};

// Whether a failed work request's status is the request's own fault (a key, a bound, a
// length): it fails that request, and moving it to another NIC would fail the same way.
inline bool permanentWcError(ibv_wc_status s) {
  return s == IBV_WC_REM_ACCESS_ERR || s == IBV_WC_REM_INV_REQ_ERR || s == IBV_WC_LOC_PROT_ERR ||
         s == IBV_WC_LOC_LEN_ERR;
}

// One work request (a slice of a READ/WRITE, or one part of a notification).
struct Op final : CompletionTarget {
  Qp* qp = nullptr;
  TaskState* ts = nullptr;  // null for a notification
  OpCode op = OpCode::kWrite;
  char* local = nullptr;  // registered source/destination (or the bounce chunk, once set)
  uint32_t lkey = 0;
  bool bounce = false;    // the caller's memory is not registered on this NIC: via a chunk
  char* user = nullptr;   // the caller's memory
  char* chunk = nullptr;
  uint64_t len = 0;
  uint64_t raddr = 0;
  uint32_t rkey = 0;
  uint32_t channel = 0;
  uint32_t word = 0;  // notification: parts, part and sequence (rdma_notify.h)
  uint64_t tag = 0;
  void onCompletion(const ibv_wc& wc) override;
  const char* what() const { return ts == nullptr ? "NOTIFY" : op == OpCode::kWrite ? "WRITE" : "READ"; }
  // Its request's caller gave up on it (Task::isAbandoned): `user` is not to be touched.
  bool abandoned() const { return ts != nullptr && ts->task->isAbandoned(); }
};

// Completes ops: their request's share (or logs a lost notification), then deletes them.
void finishOps(std::vector<std::pair<Op*, Status>>& done);

class RdmaTransportImpl;

// The initiator's QP on one lane of a peer: an ordered queue of work requests, at most maxWr()
// posted. When a work request fails (or cannot be posted), the QP goes to the error state and,
// once the NIC has flushed everything posted, gives every op that did not complete back to
// its owner in issue order (`reroute`), for another QP to carry. fail() is final instead: the
// ops complete with its status.
class Qp {
 public:
  // Called (without mu_) when the failed QP has work to give back; the owner takes it with
  // takeBack() under its own lock.
  using Reroute = std::function<void(Qp* from)>;
  Qp(RdmaTransportImpl* t, Nic* nic, ibv_qp* qp, std::string peer, Reroute reroute);
  ~Qp();
  Nic* nic() const { return nic_; }
  bool ok() const { return nmr_ != nullptr; }

  // Queues ops in order (takes them). On a QP that failed they go back to the owner behind
  // what it still holds (or complete with the error when the failure is final).
  void enqueue(std::vector<Op*>& ops);
  void pump();
  void complete(Op* o, const ibv_wc& wc);
  void fail(const Status& why);
  Status failedStatus();
  int inflight();
  bool idle();  // nothing queued or in flight
  // Waits out a copy between a bounce chunk and the caller's memory in progress (they run
  // under mu_, and check Op::abandoned() first): RdmaPeer::fenceAbandoned.
  void fence() { std::lock_guard<std::mutex> g(mu_); }
  // Once failed (reroutably) with nothing in flight: every op it holds, in issue order, the
  // failure, whether a request's own error caused it (`permanent`: that request failed, the
  // link is fine) and whether this is the first call since it failed (`first`: the owner
  // marks its lane failed even when nothing is left to move). Empty otherwise. The owner
  // calls it under its lock (Reroute).
  std::vector<Op*> takeBack(Status* why, bool* permanent, bool* first);
  // Its NIC's CQ failed: no completion comes for what is posted; all of it is given back as
  // if flushed (the QP moves to the error state).
  void abandon(const Status& why);
  // A stalled NIC: work outstanding and nothing completed for `after`: fails the QP (its
  // work moves on as after an error completion). The prober calls it.
  void checkStall(Clock::time_point now, std::chrono::milliseconds after);
  // Keeps the QP alive while the transport works on it outside its QP list's lock
  // (RdmaTransportImpl::pinned): taken under that lock, the destructor waits for it.
  void pin() { pins_.fetch_add(1); }
  void unpin() { pins_.fetch_sub(1); }

 private:
  void failLocked(const Status& why, bool permanent = false);
  void pumpLocked(std::vector<std::pair<Op*, Status>>* done);
  // Under mu_: failed (reroutably), nothing in flight and ops held: counts a hand-back.
  bool handBackDueLocked();
  // Tells the owner (without mu_), which takes the ops with takeBack().
  void handBack();
  void releaseChunk(Op* o);

  RdmaTransportImpl* t_;
  Nic* nic_;
  ibv_qp* qp_;
  std::string peer_;
  Reroute reroute_;
  std::vector<char> nbuf_;
  ibv_mr* nmr_ = nullptr;
  uint64_t nseq_ = 0;
  std::mutex mu_;
  std::deque<Op*> pending_;   // not posted yet, in order
  std::vector<Op*> orphans_;  // posted, then flushed by a failure, in post order
  std::deque<Op*> posted_;    // posted and not completed, in post order
  int inflight_ = 0;
  Clock::time_point last_progress_{};  // last completion, or the post that ended an idle spell
  int handing_ = 0;  // give-backs running (the destructor waits for them too)
  std::atomic<int> pins_{0};  // pin(): the destructor waits for them too
  bool failed_ = false;
  bool reroutable_ = false;  // failed by a work request (not by fail()): give ops back
  bool permanent_ = false;   // ... whose own error (permanentWcError) it was
  bool announced_ = false;   // the owner was told of the failure (takeBack ran)
  Status why_;
};

// A lane to be: a connected QP from a local NIC to a peer NIC (null: the dial failed, `why`).
struct LaneInit {
  Nic* nic = nullptr;
  ibv_qp* qp = nullptr;
  Status why;
  int remote_nic = -1;
  bool remote_ib = false;
  int id = 0;  // the lane's number in its connection (the target replaces a reconnected one)
};

class RdmaPeer;

// The transport (rdma_transport.h).
class RdmaTransportImpl final : public Transport {
 public:
  explicit RdmaTransportImpl(const TransportOptions& o);
  ~RdmaTransportImpl() override;
  TransportKind kind() const override { return TransportKind::kRdma; }
  Status start(EngineContext* ctx) override;
  void fillLocalSegment(SegmentDesc* desc) override;
  Status registerRegion(Region* region) override;
  void unregisterRegion(const Region& region) override;
  bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const override;
  Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote, Deadline deadline,
                                                 bool data,
                                                 std::shared_ptr<ControlLink> control) override;
  void onExchange(const SegmentDesc& from, std::string request,
                  std::function<void(Result<std::string>)> reply) override;
  void onPeerGone(uint64_t engine_id) override;
  bool needsRegisteredLocal() const override { return true; }
  bool reachesDeviceMemory() const override { return true; }
  void stop() override;

  // Creates a QP on `nic` and connects it to the peer's NIC `remote_nic` through `control`
  // as lane `lane` of connection `conn` (rdma_notify.h).
  Result<ibv_qp*> dial(Nic* nic, int remote_nic, bool remote_ib, uint64_t conn, int lane,
                       ControlLink& control, const std::string& peer, Deadline deadline);
  // The lkey of [p, p+len) on `nic` when the whole range is in one registered region.
  bool lkey(const void* p, uint64_t len, int nic, uint32_t* key) const;
  BouncePool* bounce() { return ctx_->bounce ? ctx_->bounce() : nullptr; }
  EngineContext* ctx() const { return ctx_; }
  uint64_t sliceBytes() const { return slice_bytes_; }
  int maxWr() const { return max_wr_; }
  bool stripeAll() const { return stripe_all_; }
  int qpsPerNic() const { return qps_per_nic_; }
  std::chrono::milliseconds retryAfter() const { return retry_; }
  bool tcpFallback() const { return tcp_fallback_; }
  // The NICs nearest to the registered region holding [p, p+len) (empty: not registered), and
  // that region's lkey on each NIC in `lkeys` (-1: not registered there; empty: the range is
  // not in one registered region): one lookup for all of a request's slices.
  std::vector<int> localKeys(const void* p, uint64_t len, std::vector<int64_t>* lkeys) const;
  // Bytes from p to the end of the registered chunk holding it (0: not registered). A region
  // above a NIC's max_mr_size is registered in chunks; an op must stay inside one.
  uint64_t localSpan(const void* p) const;
  // Whether p is GPU memory: registered here as kCuda, or device memory the engine does not
  // know (which cannot go through the bounce pool or the tcp fallback: both memcpy).
  bool isDeviceMemory(const void* p) const;
  void addQp(Qp* q);
  void removeQp(Qp* q);
  // Peers whose failed lanes the prober reconnects.
  void addPeer(RdmaPeer* p);
  void removePeer(RdmaPeer* p);
  void pumpAll();
  // Delivers a complete notification, after flushGpuWrites (whatever carried it).
  void deliverNotify(uint64_t src, uint32_t channel, uint64_t tag);
  // Wakes the prober now (a lane to be redialled at once).
  void kickProber();
  const std::vector<std::unique_ptr<Nic>>& nics() const { return nics_; }
  // A NIC's CQ failed (Nic::on_dead): its QPs' work goes to other lanes or tcp, its target
  // QPs are closed.
  void nicDied(Nic* nic, const Status& why);

 private:
  struct LocalMr {
    uint64_t len;
    std::vector<ibv_mr*> mrs;  // by NIC (nullptr where it could not register)
    std::vector<int> near;     // the NICs nearest to it (Topology::nearest)
    bool device = false;       // GPU memory (MemoryKind::kCuda)
    int ordinal = -1;          // its device (GPU memory)
  };
  // Bit d: GPU memory of device d (< 64) is registered here, so a notification must flush the
  // NICs' writes into it before it is delivered (recomputed under mr_mu_ at each change).
  std::atomic<uint64_t> gpu_ordinals_{0};
  std::atomic<bool> flush_warned_{false};
  void noteGpuOrdinalsLocked();
  // Before a notification is delivered: the writes it follows are visible to the kernels of
  // every device whose memory is registered here (device::Device::flushRemoteWrites).
  void flushGpuWrites();
  // Registers GPU memory [addr, addr+len) with `pd`: through a dma-buf from the device layer
  // when it gives one, else ibv_reg_mr on the device address (GPUDirect, nvidia-peermem).
  // Null with `why` when neither works.
  ibv_mr* registerDeviceMr(ibv_pd* pd, uint64_t addr, uint64_t len, std::string* why);
  struct TargetQp;
  // The QPs (all, or those of `nic`), pinned (Qp::pin), so that what is done to them next
  // runs without qps_mu_: a QP's give-back takes its peer's lock, and a peer creates QPs
  // (addQp) under it. The caller unpins each.
  std::vector<Qp*> pinned(const Nic* nic);
  void probeLoop();
  // Under target_mu_: closes the target QP of lane `lane` of connection `conn` from `src`.
  void closeTargetLocked(uint64_t src, uint64_t conn, int lane);
  // Frees closed target QPs whose receives all completed.
  void reapGraveyard();
  void evictIdleLocked();
  // The target side of the tcp fallback (requests starting "F ", rdma_transport.h).
  void onFallback(const SegmentDesc& from, const std::string& request,
                  const std::function<void(Result<std::string>)>& reply);

  TransportOptions opts_;
  EngineContext* ctx_ = nullptr;
  std::vector<std::unique_ptr<Nic>> nics_;
  uint64_t slice_bytes_ = 1 << 20;
  int max_wr_ = 64;
  bool stripe_all_ = false;
  int qps_per_nic_ = 1;
  std::chrono::milliseconds retry_{1000};
  std::chrono::milliseconds stall_{5000};  // 0: no stall detection
  int max_endpoints_ = 0;                  // per NIC (0: no limit)
  Clock::duration evict_grace_{};          // an endpoint used more recently stays
  bool tcp_fallback_ = true;
  RoceClass cls_;
  std::shared_ptr<const Topology> topo_;
  bool stopped_ = false;
  mutable std::shared_mutex mr_mu_;
  std::map<uint64_t, LocalMr> mrs_;
  std::mutex qps_mu_;
  std::set<Qp*> qps_;
  std::mutex target_mu_;
  std::multimap<uint64_t, std::unique_ptr<TargetQp>> targets_;  // by initiator engine id
  std::vector<std::unique_ptr<TargetQp>> graveyard_;           // closed, not flushed yet
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<NotifyOrder>> orders_;  // (src, conn)
  // The prober: reconnects peers' failed lanes once MC_RDMA_RETRY_MS passed.
  std::mutex peers_mu_;
  std::set<RdmaPeer*> peers_;
  std::mutex probe_mu_;
  std::condition_variable probe_cv_;
  bool probe_stop_ = false;
  bool probe_kick_ = false;
  std::thread prober_;
};

// A peer over lanes (one QP per local NIC that reaches one of its NICs); rdma_peer.h.
std::unique_ptr<TransportPeer> makeRdmaPeer(RdmaTransportImpl* t, std::vector<LaneInit> lanes,
                                            const SegmentDesc& remote, uint64_t conn,
                                            std::shared_ptr<ControlLink> control);
// The prober's call on a peer: reconnects the lanes that failed MC_RDMA_RETRY_MS ago or more.
// True when a lane to be redialled at once (a request's own error) was not ready yet (its
// QP still handing its work back): the prober comes back soon.
bool probePeer(RdmaPeer* p);
// A peer's endpoint on a local NIC (its lanes there): connected, idle (nothing queued or in
// flight, on them or on the tcp fallback), when the peer was last used.
struct EndpointState {
  bool connected = false;
  bool idle = false;
  Clock::time_point last_used{};
};
EndpointState endpointOn(RdmaPeer* p, int nic);
// Closes the peer's idle lanes on `nic` (both ends); its next request dials them again.
void evictOn(RdmaPeer* p, int nic);

}  // namespace mooncake::engine::rdma
