// rdma transport (see rdma_transport.h for what it does and the exchange format).
#include "engine/transport/rdma/rdma_transport.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "engine/bounce_pool.h"
#include "engine/log.h"
#include "engine/params.h"
#include "engine/transport/rdma/rdma_nic.h"

namespace mooncake::engine {
namespace rdma {
namespace {

constexpr int kRecvSlots = 64;        // receives a target keeps posted per QP
constexpr size_t kNotifyBytes = 16;   // u32 channel | u32 0 | u64 tag
constexpr int kAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

uint32_t randomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

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
  ia.send_cq = nic->cq;
  ia.recv_cq = nic->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = static_cast<uint32_t>(send_wr);
  ia.cap.max_recv_wr = static_cast<uint32_t>(recv_wr);
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(nic->pd, &ia);
  if (qp == nullptr)
    return MC_STATUS(kUnavailable, "rdma: cannot create a QP on " << nic->name << ": "
                                                                  << strerror(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                IBV_QP_ACCESS_FLAGS) != 0) {
    ibv_destroy_qp(qp);
    return MC_STATUS(kUnavailable, "rdma: cannot move a QP of " << nic->name << " to INIT");
  }
  return qp;
}

// INIT -> RTR -> RTS toward `remote`.
Status connectQp(Nic* nic, ibv_qp* qp, uint32_t my_psn, const QpAddr& remote, bool remote_ib) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(nic->port.active_mtu, remote.mtu));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(rdAtom(*nic));
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = 1;
  if (nic->ib) {
    a.ah_attr.dlid = remote.lid;
  } else {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = remote.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(nic->gid_index);
    a.ah_attr.grh.hop_limit = 64;
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

// One request being moved: done once every slice completed.
struct TaskState {
  Task* task;
  std::atomic<int> remaining;
  std::mutex mu;
  Status err;
  TaskState(Task* t, int n) : task(t), remaining(n) {}
  void finish(const Status& st) {
    if (!st.ok()) {
      std::lock_guard<std::mutex> g(mu);
      if (err.ok()) err = st;
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

// One work request (a slice of a READ/WRITE, or a notification).
struct Op final : CompletionTarget {
  Qp* qp = nullptr;
  TaskState* ts = nullptr;  // null for a notification
  OpCode op = OpCode::kWrite;
  char* local = nullptr;     // registered source/destination (or the bounce chunk, once set)
  uint32_t lkey = 0;
  bool bounce = false;       // local is the caller's unregistered memory: move via a chunk
  char* user = nullptr;      // the caller's memory when bouncing
  char* chunk = nullptr;
  uint64_t len = 0;
  uint64_t raddr = 0;
  uint32_t rkey = 0;
  uint32_t channel = 0;
  uint64_t tag = 0;
  void onCompletion(const ibv_wc& wc) override;
};

}  // namespace

// The transport (declared outside the anonymous namespace: Qp refers to it).
class RdmaTransportImpl final : public Transport {
 public:
  explicit RdmaTransportImpl(const TransportOptions& o) : opts_(o) {}
  ~RdmaTransportImpl() override { stop(); }
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
  void stop() override;

  // The lkey of [p, p+len) on `nic` when the whole range is in one registered region.
  bool lkey(const void* p, uint64_t len, int nic, uint32_t* key) const;
  BouncePool* bounce() { return ctx_->bounce ? ctx_->bounce() : nullptr; }
  EngineContext* ctx() const { return ctx_; }
  uint64_t sliceBytes() const { return slice_bytes_; }
  int maxWr() const { return max_wr_; }
  void addQp(Qp* q) {
    std::lock_guard<std::mutex> g(qps_mu_);
    qps_.insert(q);
  }
  void removeQp(Qp* q) {
    std::lock_guard<std::mutex> g(qps_mu_);
    qps_.erase(q);
  }
  void pumpAll();
  void deliverNotify(uint64_t src, uint32_t channel, uint64_t tag);
  const std::vector<std::unique_ptr<Nic>>& nics() const { return nics_; }

 private:
  struct LocalMr {
    uint64_t len;
    std::vector<ibv_mr*> mrs;  // by NIC (nullptr where it could not register)
  };
  struct TargetQp;

  TransportOptions opts_;
  EngineContext* ctx_ = nullptr;
  std::vector<std::unique_ptr<Nic>> nics_;
  uint64_t slice_bytes_ = 1 << 20;
  int max_wr_ = 64;
  bool stopped_ = false;
  mutable std::shared_mutex mr_mu_;
  std::map<uint64_t, LocalMr> mrs_;
  std::mutex qps_mu_;
  std::set<Qp*> qps_;
  std::mutex target_mu_;
  std::multimap<uint64_t, std::unique_ptr<TargetQp>> targets_;  // by initiator engine id
  std::vector<std::unique_ptr<TargetQp>> graveyard_;           // of gone peers (until stop)
};

namespace {

// The initiator's QP to one peer: an ordered queue of work requests, at most maxWr() posted.
class Qp {
 public:
  Qp(RdmaTransportImpl* t, Nic* nic, ibv_qp* qp, std::string peer)
      : t_(t), nic_(nic), qp_(qp), peer_(std::move(peer)), nbuf_(kNotifyBytes * t->maxWr()) {
    nmr_ = ibv_reg_mr(nic->pd, nbuf_.data(), nbuf_.size(), IBV_ACCESS_LOCAL_WRITE);
    t_->addQp(this);
  }
  ~Qp() {
    t_->removeQp(this);
    fail(MC_STATUS(kCancelled, "rdma: peer " << peer_ << " closed"));
    // The poller flushes what was posted; wait for it so that no completion refers to us.
    auto until = Clock::now() + std::chrono::seconds(5);
    for (;;) {
      {
        std::lock_guard<std::mutex> g(mu_);
        if (inflight_ == 0) break;
      }
      if (Clock::now() > until) {
        MC_LOG(ERROR, RDMA) << "QP to " << peer_ << " on " << nic_->name
                            << " did not flush; leaking it";
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ibv_destroy_qp(qp_);
    if (nmr_ != nullptr) ibv_dereg_mr(nmr_);
  }
  Nic* nic() const { return nic_; }
  ibv_qp* qp() const { return qp_; }
  bool ok() const { return nmr_ != nullptr; }

  void enqueue(std::vector<Op*>& ops) {
    std::vector<std::pair<Op*, Status>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (failed_) {
        for (Op* o : ops) done.emplace_back(o, why_);
      } else {
        for (Op* o : ops) pending_.push_back(o);
        pumpLocked(&done);
      }
    }
    finish(done);
  }

  void pump() {
    std::vector<std::pair<Op*, Status>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (pending_.empty()) return;
      pumpLocked(&done);
    }
    finish(done);
  }

  void complete(Op* o, const ibv_wc& wc) {
    std::vector<std::pair<Op*, Status>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      --inflight_;
      Status st;
      if (wc.status != IBV_WC_SUCCESS) {
        if (failed_) {
          st = why_;
        } else {
          st = MC_STATUS(kIo, "rdma " << (o->ts == nullptr ? "NOTIFY"
                                                           : o->op == OpCode::kWrite ? "WRITE"
                                                                                     : "READ")
                                      << " of " << o->len << " bytes to peer " << peer_
                                      << " (remote " << hex(o->raddr) << ") via NIC "
                                      << nic_->name << " failed: "
                                      << ibv_wc_status_str(wc.status));
          failLocked(st, &done);
        }
      } else if (o->bounce && o->op == OpCode::kRead) {
        std::memcpy(o->user, o->chunk, o->len);
      }
      if (o->chunk != nullptr) {
        if (BouncePool* b = t_->bounce()) b->release(o->chunk);
        o->chunk = nullptr;
      }
      done.emplace_back(o, st);
      if (!failed_) pumpLocked(&done);
    }
    finish(done);
  }

  void fail(const Status& why) {
    std::vector<std::pair<Op*, Status>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!failed_) failLocked(why, &done);
    }
    finish(done);
  }

  Status failedStatus() {
    std::lock_guard<std::mutex> g(mu_);
    return failed_ ? why_ : Status::OK();
  }
  int inflight() {
    std::lock_guard<std::mutex> g(mu_);
    return inflight_;
  }

 private:
  void failLocked(const Status& why, std::vector<std::pair<Op*, Status>>* done) {
    failed_ = true;
    why_ = why;
    for (Op* o : pending_) done->emplace_back(o, why);
    pending_.clear();
    // Everything posted completes with IBV_WC_WR_FLUSH_ERR (and then with why_).
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp_, &a, IBV_QP_STATE);
  }

  // Posts queued work requests in order while the QP has room (and chunks, for bounces).
  void pumpLocked(std::vector<std::pair<Op*, Status>>* done) {
    while (!pending_.empty() && inflight_ < t_->maxWr()) {
      Op* o = pending_.front();
      ibv_sge sge{};
      ibv_send_wr wr{};
      ibv_send_wr* bad = nullptr;
      if (o->ts == nullptr) {  // notification
        char* slot = nbuf_.data() + kNotifyBytes * (nseq_++ % static_cast<uint64_t>(t_->maxWr()));
        std::memset(slot, 0, kNotifyBytes);
        std::memcpy(slot, &o->channel, 4);
        std::memcpy(slot + 8, &o->tag, 8);
        sge = {reinterpret_cast<uint64_t>(slot), static_cast<uint32_t>(kNotifyBytes), nmr_->lkey};
        wr.opcode = IBV_WR_SEND;
      } else {
        if (o->bounce && o->chunk == nullptr) {
          BouncePool* b = t_->bounce();
          char* c = b == nullptr ? nullptr : b->tryAcquire();
          if (c == nullptr) break;  // retried when a chunk comes back (pumpAll)
          if (!t_->lkey(c, o->len, nic_->index, &o->lkey)) {
            b->release(c);
            pending_.pop_front();
            done->emplace_back(o, MC_STATUS(kInternal, "rdma: bounce pool not registered on "
                                                           << nic_->name));
            continue;
          }
          o->chunk = c;
          if (o->op == OpCode::kWrite) std::memcpy(c, o->user, o->len);
          o->local = c;
        }
        sge = {reinterpret_cast<uint64_t>(o->local), static_cast<uint32_t>(o->len), o->lkey};
        wr.opcode = o->op == OpCode::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = o->raddr;
        wr.wr.rdma.rkey = o->rkey;
      }
      wr.wr_id = reinterpret_cast<uint64_t>(static_cast<CompletionTarget*>(o));
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_SIGNALED;
      int rc = ibv_post_send(qp_, &wr, &bad);
      if (rc != 0) {
        Status st = MC_STATUS(kIo, "rdma: posting to peer " << peer_ << " via NIC " << nic_->name
                                                            << " failed: " << strerror(rc));
        if (o->chunk != nullptr) {
          if (BouncePool* b = t_->bounce()) b->release(o->chunk);
          o->chunk = nullptr;
        }
        pending_.pop_front();
        done->emplace_back(o, st);
        failLocked(st, done);
        return;
      }
      pending_.pop_front();
      ++inflight_;
    }
  }

  static void finish(std::vector<std::pair<Op*, Status>>& done) {
    for (auto& [o, st] : done) {
      if (o->ts != nullptr) {
        o->ts->finish(st);
      } else if (!st.ok() && st.code() != Code::kCancelled) {
        MC_LOG(WARN, RDMA) << "notification lost: " << st.toString();
      }
      delete o;
    }
    done.clear();
  }

  RdmaTransportImpl* t_;
  Nic* nic_;
  ibv_qp* qp_;
  std::string peer_;
  std::vector<char> nbuf_;
  ibv_mr* nmr_ = nullptr;
  uint64_t nseq_ = 0;
  std::mutex mu_;
  std::deque<Op*> pending_;
  int inflight_ = 0;
  bool failed_ = false;
  Status why_;
};

void Op::onCompletion(const ibv_wc& wc) { qp->complete(this, wc); }

// A remote region as this peer sees it on the chosen remote NIC.
struct RemoteRegion {
  uint64_t addr;
  uint64_t len;
  uint32_t rkey;
};

class RdmaPeer final : public TransportPeer {
 public:
  RdmaPeer(RdmaTransportImpl* t, std::unique_ptr<Qp> qp, int remote_nic, const SegmentDesc& d)
      : t_(t), qp_(std::move(qp)), remote_nic_(remote_nic), name_(d.name) {
    setRegions(d);
  }
  ~RdmaPeer() override { qp_.reset(); }

  void submit(Task* task) override {
    if (task->length == 0) return task->done(Status::OK());
    Status st = qp_->failedStatus();
    if (!st.ok()) return task->done(st);
    uint32_t rkey = 0;
    if (!findRemote(task->remote, task->length, &rkey))
      return task->done(MC_STATUS(kPermissionDenied,
                                  "rdma: [" << hex(task->remote) << ", +" << task->length
                                            << ") is not inside a region peer " << name_
                                            << " registered for rdma"));
    Nic* nic = qp_->nic();
    uint32_t lkey = 0;
    bool bounce = !t_->lkey(task->local, task->length, nic->index, &lkey);
    uint64_t slice = t_->sliceBytes();
    if (bounce) {
      BouncePool* b = t_->bounce();
      if (b == nullptr)
        return task->done(MC_STATUS(kUnavailable, "rdma: the local memory of a request to "
                                                      << name_
                                                      << " is not registered and the engine has "
                                                         "no bounce pool"));
      slice = std::min<uint64_t>(slice, b->chunkBytes());
    }
    int n = static_cast<int>((task->length + slice - 1) / slice);
    auto* ts = new TaskState(task, n);
    std::vector<Op*> ops;
    ops.reserve(n);
    for (uint64_t off = 0; off < task->length; off += slice) {
      auto* o = new Op();
      o->qp = qp_.get();
      o->ts = ts;
      o->op = task->op;
      o->len = std::min(slice, task->length - off);
      o->raddr = task->remote + off;
      o->rkey = rkey;
      o->bounce = bounce;
      if (bounce) {
        o->user = static_cast<char*>(task->local) + off;
      } else {
        o->local = static_cast<char*>(task->local) + off;
        o->lkey = lkey;
      }
      ops.push_back(o);
    }
    qp_->enqueue(ops);
  }

  Status notify(uint32_t channel, uint64_t tag) override {
    MC_RETURN_IF_ERROR(qp_->failedStatus());
    auto* o = new Op();
    o->qp = qp_.get();
    o->channel = channel;
    o->tag = tag;
    std::vector<Op*> ops{o};
    qp_->enqueue(ops);
    return qp_->failedStatus();
  }

  bool carriesMessages() const override { return false; }
  Status sendMessage(uint32_t channel, std::string_view payload) override {
    return MC_STATUS(kNotSupported, "rdma: messages go over the control link");
  }

  Status updateRemote(const SegmentDesc& remote) override {
    setRegions(remote);
    return Status::OK();
  }
  void fail(const Status& why) override { qp_->fail(why); }

 private:
  void setRegions(const SegmentDesc& d) {
    std::vector<RemoteRegion> rs;
    for (const auto& r : d.regions) {
      const std::string& k = r.keys[static_cast<int>(TransportKind::kRdma)];
      std::stringstream in(k);
      std::string item;
      for (int i = 0; std::getline(in, item, ','); ++i) {
        if (i != remote_nic_) continue;
        if (item == "-" || item.empty()) break;
        rs.push_back({r.addr, r.len, static_cast<uint32_t>(std::strtoul(item.c_str(), nullptr, 10))});
        break;
      }
    }
    std::sort(rs.begin(), rs.end(),
              [](const RemoteRegion& a, const RemoteRegion& b) { return a.addr < b.addr; });
    std::unique_lock<std::shared_mutex> g(mu_);
    regions_ = std::move(rs);
  }
  bool findRemote(uint64_t addr, uint64_t len, uint32_t* rkey) const {
    std::shared_lock<std::shared_mutex> g(mu_);
    auto it = std::upper_bound(regions_.begin(), regions_.end(), addr,
                               [](uint64_t a, const RemoteRegion& r) { return a < r.addr; });
    if (it == regions_.begin()) return false;
    --it;
    if (addr - it->addr > it->len || len > it->len - (addr - it->addr)) return false;
    *rkey = it->rkey;
    return true;
  }

  RdmaTransportImpl* t_;
  std::unique_ptr<Qp> qp_;
  int remote_nic_;
  std::string name_;
  mutable std::shared_mutex mu_;
  std::vector<RemoteRegion> regions_;
};

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
  std::vector<char> buf = std::vector<char>(kNotifyBytes * kRecvSlots);
  ibv_mr* mr = nullptr;
  Slot slots[kRecvSlots];
  std::atomic<bool> dead{false};

  bool post(Slot* s) {
    ibv_sge sge{reinterpret_cast<uint64_t>(s->buf), static_cast<uint32_t>(kNotifyBytes), mr->lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = reinterpret_cast<uint64_t>(static_cast<CompletionTarget*>(s));
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return ibv_post_recv(qp, &wr, &bad) == 0;
  }
  void onRecv(Slot* s, const ibv_wc& wc) {
    if (wc.status != IBV_WC_SUCCESS || dead.load()) return;
    if (wc.opcode == IBV_WC_RECV && wc.byte_len == kNotifyBytes) {
      uint32_t channel;
      uint64_t tag;
      std::memcpy(&channel, s->buf, 4);
      std::memcpy(&tag, s->buf + 8, 8);
      t->deliverNotify(src, channel, tag);
    } else {
      MC_LOG(WARN, RDMA) << "dropping a malformed receive (" << wc.byte_len << " bytes) from "
                         << hex(src);
    }
    if (!post(s)) {
      MC_LOG(ERROR, RDMA) << "cannot repost a receive on " << nic->name;
    }
  }
  ~TargetQp() {
    if (qp != nullptr) ibv_destroy_qp(qp);
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
};

Status RdmaTransportImpl::start(EngineContext* ctx) {
  ctx_ = ctx;
  slice_bytes_ = static_cast<uint64_t>(
      std::clamp<int64_t>(params::getInt("MC_RDMA_SLICE_BYTES"), 4096, 1ll << 30));
  max_wr_ = static_cast<int>(std::clamp<int64_t>(params::getInt("MC_RDMA_MAX_WR"), 1, 4096));
  MC_ASSIGN_OR_RETURN(nics_, openNics());
  int64_t spin = params::getInt("MC_RDMA_SPIN_US");
  for (auto& n : nics_) {
    n->on_idle = [this] { pumpAll(); };
    n->startPoller(spin);
  }
  std::string names;
  for (auto& n : nics_) names += " " + n->name + (n->ib ? "(ib)" : "(roce)");
  MC_LOG(INFO, RDMA) << "rdma NICs:" << names;
  return Status::OK();
}

void RdmaTransportImpl::fillLocalSegment(SegmentDesc* desc) {
  desc->transports |= 1u << static_cast<int>(TransportKind::kRdma);
  desc->endpoints[static_cast<int>(TransportKind::kRdma)] = encodeNics(nics_);
}

Status RdmaTransportImpl::registerRegion(Region* region) {
  LocalMr m{region->len, {}};
  std::string keys;
  bool any = false;
  for (auto& n : nics_) {
    ibv_mr* mr = nullptr;
    if (region->len <= n->max_mr_size)
      mr = ibv_reg_mr(n->pd, reinterpret_cast<void*>(region->addr), region->len, kAccess);
    if (mr == nullptr) {
      MC_LOG(WARN, RDMA) << "cannot register " << region->len << " bytes at " << hex(region->addr)
                         << " with " << n->name << " (max_mr_size " << n->max_mr_size
                         << "): rdma requests to it fail, from it bounce";
    }
    m.mrs.push_back(mr);
    any |= mr != nullptr;
    keys += (keys.empty() ? "" : ",") + (mr ? std::to_string(mr->rkey) : std::string("-"));
  }
  region->keys[static_cast<int>(TransportKind::kRdma)] = any ? keys : "";
  std::unique_lock<std::shared_mutex> g(mr_mu_);
  mrs_[region->addr] = std::move(m);
  return Status::OK();
}

void RdmaTransportImpl::unregisterRegion(const Region& region) {
  LocalMr m;
  {
    std::unique_lock<std::shared_mutex> g(mr_mu_);
    auto it = mrs_.find(region.addr);
    if (it == mrs_.end()) return;
    m = std::move(it->second);
    mrs_.erase(it);
  }
  for (ibv_mr* mr : m.mrs)
    if (mr != nullptr) ibv_dereg_mr(mr);
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

Result<std::unique_ptr<TransportPeer>> RdmaTransportImpl::connect(
    const SegmentDesc& remote, Deadline deadline, bool data, std::shared_ptr<ControlLink> control) {
  if (control == nullptr)
    return MC_STATUS(kInvalidArgument, "rdma: connecting " << remote.name << " needs a control link");
  MC_ASSIGN_OR_RETURN(auto theirs,
                      decodeNics(remote.endpoints[static_cast<int>(TransportKind::kRdma)]));
  Nic* nic = nullptr;
  int rn = -1;
  for (auto& n : nics_) {
    for (size_t i = 0; i < theirs.size() && rn < 0; ++i)
      if (theirs[i].ib == n->ib) rn = static_cast<int>(i);
    if (rn >= 0) {
      nic = n.get();
      break;
    }
  }
  if (nic == nullptr)
    return MC_STATUS(kUnavailable, "rdma: no NIC of this engine reaches a NIC of " << remote.name);
  MC_ASSIGN_OR_RETURN(ibv_qp* raw, createQp(nic, max_wr_, 1));
  auto qp = std::make_unique<Qp>(this, nic, raw, remote.name);
  if (!qp->ok()) return MC_STATUS(kUnavailable, "rdma: cannot register a notify buffer");
  QpAddr mine;
  mine.qpn = raw->qp_num;
  mine.psn = randomPsn();
  mine.lid = nic->port.lid;
  mine.gid = nic->gid;
  mine.mtu = nic->port.active_mtu;
  std::string req = "1 " + std::to_string(nic->index) + " " + std::to_string(rn) + " " +
                    encodeQpAddr(mine) + " " + (nic->ib ? "1" : "0");
  MC_ASSIGN_OR_RETURN(std::string ans, control->exchange(TransportKind::kRdma, req, deadline));
  std::istringstream in(ans);
  QpAddr peer;
  if (!decodeQpAddr(in, &peer))
    return MC_STATUS(kProtocol, "rdma: malformed connection answer from " << remote.name);
  MC_RETURN_IF_ERROR(connectQp(nic, raw, mine.psn, peer, theirs[rn].ib));
  MC_LOG(INFO, RDMA) << "connected to " << remote.name << ": " << nic->name << " -> "
                     << theirs[rn].name << " qpn " << mine.qpn << " -> " << peer.qpn;
  return std::unique_ptr<TransportPeer>(new RdmaPeer(this, std::move(qp), rn, remote));
}

void RdmaTransportImpl::onExchange(const SegmentDesc& from, std::string request,
                                   std::function<void(Result<std::string>)> reply) {
  std::istringstream in(request);
  int version = 0, their_nic = -1, my_nic = -1, ib = 0;
  QpAddr peer;
  if (!(in >> version >> their_nic >> my_nic) || version != 1 || !decodeQpAddr(in, &peer) ||
      !(in >> ib))
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
  mine.lid = nic->port.lid;
  mine.gid = nic->gid;
  mine.mtu = nic->port.active_mtu;
  Status st = connectQp(nic, tq->qp, mine.psn, peer, ib != 0);
  if (!st.ok()) return reply(st);
  {
    std::lock_guard<std::mutex> g(target_mu_);
    targets_.emplace(from.engine_id, std::move(tq));
  }
  reply(encodeQpAddr(mine));
}

void RdmaTransportImpl::onPeerGone(uint64_t engine_id) {
  std::lock_guard<std::mutex> g(target_mu_);
  auto range = targets_.equal_range(engine_id);
  for (auto it = range.first; it != range.second; ++it) {
    it->second->dead.store(true);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(it->second->qp, &a, IBV_QP_STATE);
    graveyard_.push_back(std::move(it->second));  // destroyed at stop (after the pollers)
  }
  targets_.erase(range.first, range.second);
}

void RdmaTransportImpl::pumpAll() {
  std::lock_guard<std::mutex> g(qps_mu_);
  for (Qp* q : qps_) q->pump();
}

void RdmaTransportImpl::deliverNotify(uint64_t src, uint32_t channel, uint64_t tag) {
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
  // Fail what the peers still hold and let the pollers flush it before they stop (the peers
  // themselves are destroyed after this, and must find nothing in flight).
  {
    std::lock_guard<std::mutex> g(qps_mu_);
    for (Qp* q : qps_) q->fail(MC_STATUS(kCancelled, "rdma: the engine is stopping"));
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
