// The rdma transport's initiator side: QPs, a peer's lanes, slicing, striping and failover
// (rdma_internal.h; what it does is in rdma_transport.h and docs/rdma.md).
#include <algorithm>
#include <cstring>

#include "engine/log.h"
#include "engine/transport/rdma/rdma_peer.h"

namespace mooncake::engine::rdma {

void finishOps(std::vector<std::pair<Op*, Status>>& done) {
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

void Op::onCompletion(const ibv_wc& wc) { qp->complete(this, wc); }

// ---------------------------------------------------------------------------------------
// Qp

Qp::Qp(RdmaTransportImpl* t, Nic* nic, ibv_qp* qp, std::string peer, Reroute reroute)
    : t_(t), nic_(nic), qp_(qp), peer_(std::move(peer)), reroute_(std::move(reroute)),
      nbuf_(kNotifyBytes * t->maxWr()) {
  nmr_ = ibv_reg_mr(nic->pd, nbuf_.data(), nbuf_.size(), IBV_ACCESS_LOCAL_WRITE);
  t_->addQp(this);
  // Its NIC may have gone out of service since the QP was created (nicDied did not see it):
  // nothing would poll its completions. Failed now, before it carries anything; the owner
  // sees it when it installs it (RdmaPeer::installLocked).
  Status dead = nic->deadStatus();
  if (!dead.ok()) {
    std::lock_guard<std::mutex> g(mu_);
    failLocked(dead);
  }
}

Qp::~Qp() {
  t_->removeQp(this);
  fail(MC_STATUS(kCancelled, "rdma: peer " << peer_ << " closed"));
  // The poller flushes what was posted; wait for it so that no completion refers to us (and
  // for the transport's pins). On a NIC out of service nothing completes any more: what is
  // posted completes here.
  // After 5 s without the flush, the verbs objects are leaked (a completion may still name
  // them) but this object still waits for its pins and hand-backs: their holders use it.
  auto until = Clock::now() + std::chrono::seconds(5);
  bool leak = false;
  for (;;) {
    bool flushing = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      if ((inflight_ == 0 || leak) && handing_ == 0 && pins_.load() == 0) break;
      flushing = inflight_ > 0;
    }
    if (flushing) {
      Status dead = nic_->deadStatus();
      if (!dead.ok()) abandon(dead);
    }
    if (!leak && flushing && Clock::now() > until) {
      MC_LOG(ERROR, RDMA) << "QP to " << peer_ << " on " << nic_->name
                          << " did not flush; leaking it";
      leak = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (leak) return;
  nic_->destroyQp(qp_);
  if (nmr_ != nullptr) ibv_dereg_mr(nmr_);
}

void Qp::enqueue(std::vector<Op*>& ops) {
  std::vector<std::pair<Op*, Status>> done;
  bool back = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (failed_ && !reroutable_) {
      for (Op* o : ops) done.emplace_back(o, why_);
    } else {
      for (Op* o : ops) {
        o->qp = this;
        pending_.push_back(o);
      }
      if (!failed_) pumpLocked(&done);
      back = handBackDueLocked();
    }
  }
  ops.clear();
  finishOps(done);
  if (back) handBack();
}

void Qp::pump() {
  std::vector<std::pair<Op*, Status>> done;
  bool back = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (pending_.empty() || failed_) return;
    pumpLocked(&done);
    back = handBackDueLocked();
  }
  finishOps(done);
  if (back) handBack();
}

void Qp::complete(Op* o, const ibv_wc& wc) {
  std::vector<std::pair<Op*, Status>> done;
  bool back = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    --inflight_;
    last_progress_ = Clock::now();
    if (!posted_.empty() && posted_.front() == o) {  // RC completes in post order
      posted_.pop_front();
    } else {
      auto it = std::find(posted_.begin(), posted_.end(), o);
      if (it != posted_.end()) posted_.erase(it);
    }
    if (wc.status == IBV_WC_SUCCESS) {
      // Once its caller gave up on it (RdmaPeer::fenceAbandoned) a READ is not copied out.
      const bool late = o->bounce && o->op == OpCode::kRead && o->abandoned();
      if (o->bounce && o->op == OpCode::kRead && o->chunk != nullptr && !late)
        std::memcpy(o->user, o->chunk, o->len);
      releaseChunk(o);
      done.emplace_back(o, late ? MC_STATUS(kCancelled, "rdma: a READ was discarded: its "
                                                        "caller gave up waiting")
                                : Status::OK());
      if (!failed_) pumpLocked(&done);
    } else {
      releaseChunk(o);
      // A request's own error (a key, a bound, a length) fails that request: another NIC would
      // refuse it the same way. The QP is in error all the same; the rest of its work moves
      // (RdmaPeer::giveBack). A notification part is not a request: it is carried elsewhere,
      // as after any failure (its target waits for every part).
      const bool own = permanentWcError(wc.status) && o->ts != nullptr;
      Status st;
      if (own || !failed_) {
        const Code code =
            wc.status == IBV_WC_REM_ACCESS_ERR || wc.status == IBV_WC_LOC_PROT_ERR
                ? Code::kPermissionDenied
                : own ? Code::kInvalidArgument : Code::kIo;
        std::ostringstream os;
        os << "rdma " << o->what() << " of " << o->len << " bytes to peer " << peer_
           << " (remote " << hex(o->raddr) << ") via NIC " << nic_->name
           << " failed: " << ibv_wc_status_str(wc.status)
           << (own ? " (not retried on another NIC)" : "");
        st = Status(code, os.str());
      }
      if (!failed_) failLocked(st, own);
      // Flushed or failed: given back (in post order, which is completion order on RC) for
      // another QP to carry, unless the failure is final or the request's own.
      if (own) {
        done.emplace_back(o, st);
      } else if (reroutable_) {
        orphans_.push_back(o);
      } else {
        done.emplace_back(o, why_);
      }
    }
    back = handBackDueLocked();
  }
  finishOps(done);
  if (back) handBack();
}

void Qp::fail(const Status& why) {
  std::vector<std::pair<Op*, Status>> done;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!failed_) failLocked(why);
    if (reroutable_) why_ = why;  // final now: what is still here completes with this
    reroutable_ = false;
    for (Op* o : orphans_) done.emplace_back(o, why_);
    for (Op* o : pending_) done.emplace_back(o, why_);
    orphans_.clear();
    pending_.clear();
  }
  finishOps(done);
}

Status Qp::failedStatus() {
  std::lock_guard<std::mutex> g(mu_);
  return failed_ ? why_ : Status::OK();
}

int Qp::inflight() {
  std::lock_guard<std::mutex> g(mu_);
  return inflight_;
}

bool Qp::idle() {
  std::lock_guard<std::mutex> g(mu_);
  return inflight_ == 0 && pending_.empty() && orphans_.empty() && handing_ == 0;
}

void Qp::checkStall(Clock::time_point now, std::chrono::milliseconds after) {
  std::lock_guard<std::mutex> g(mu_);
  if (failed_ || inflight_ == 0 || now - last_progress_ < after) return;
  // Moving the QP to the error state makes the NIC flush what it holds (a real NIC's driver
  // does so even when its transport is hung; the emulator's too): completions give it back.
  failLocked(MC_STATUS(kTimeout, "rdma: NIC " << nic_->name << " completed none of "
                                              << inflight_ << " work request(s) to peer " << peer_
                                              << " in " << after.count() << " ms (stalled)"));
}

void Qp::abandon(const Status& why) {
  std::vector<std::pair<Op*, Status>> done;
  bool back = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!failed_) failLocked(why);
    for (Op* o : posted_) {
      releaseChunk(o);
      if (reroutable_) {
        orphans_.push_back(o);
      } else {
        done.emplace_back(o, why_);
      }
    }
    posted_.clear();
    inflight_ = 0;
    back = handBackDueLocked();
  }
  finishOps(done);
  if (back) handBack();
}

void Qp::failLocked(const Status& why, bool permanent) {
  failed_ = true;
  reroutable_ = true;
  permanent_ = permanent;
  why_ = why;
  // Everything posted completes with IBV_WC_WR_FLUSH_ERR (and is given back then).
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp_, &a, IBV_QP_STATE);
}

bool Qp::handBackDueLocked() {
  if (!failed_ || !reroutable_ || inflight_ != 0 ||
      (announced_ && orphans_.empty() && pending_.empty()))
    return false;
  ++handing_;
  return true;
}

void Qp::handBack() {
  reroute_(this);
  std::lock_guard<std::mutex> g(mu_);
  --handing_;
}

std::vector<Op*> Qp::takeBack(Status* why, bool* permanent, bool* first) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Op*> out;
  *first = false;
  if (!failed_ || !reroutable_ || inflight_ != 0) return out;
  *first = !announced_;
  announced_ = true;
  *permanent = permanent_;
  out.swap(orphans_);
  out.insert(out.end(), pending_.begin(), pending_.end());
  pending_.clear();
  *why = why_;
  return out;
}

void Qp::releaseChunk(Op* o) {
  if (o->chunk == nullptr) return;
  if (BouncePool* b = t_->bounce()) b->release(o->chunk);
  o->chunk = nullptr;
}

// Posts queued work requests in order while the QP has room (and chunks, for bounces).
void Qp::pumpLocked(std::vector<std::pair<Op*, Status>>* done) {
  while (!pending_.empty() && inflight_ < t_->maxWr()) {
    Op* o = pending_.front();
    if (o->ts != nullptr && o->ts->failed.load()) {  // its request failed: not carried
      pending_.pop_front();
      done->emplace_back(o, MC_STATUS(kCancelled, "rdma: another slice of the request failed"));
      continue;
    }
    if (o->abandoned()) {  // its caller gave up (fenceAbandoned): its memory is not ours now
      pending_.pop_front();
      done->emplace_back(o, MC_STATUS(kCancelled, "rdma: not carried: its caller gave up"));
      continue;
    }
    ibv_sge sge{};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    if (o->ts == nullptr) {  // a notification (part)
      char* slot = nbuf_.data() + kNotifyBytes * (nseq_++ % static_cast<uint64_t>(t_->maxWr()));
      std::memcpy(slot, &o->channel, 4);
      std::memcpy(slot + 4, &o->word, 4);
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
      // Left at the head of the queue: given back after what is in flight has flushed.
      releaseChunk(o);
      failLocked(MC_STATUS(kIo, "rdma: posting a " << o->what() << " to peer " << peer_
                                                  << " via NIC " << nic_->name
                                                  << " failed: " << strerror(rc)));
      return;
    }
    pending_.pop_front();
    posted_.push_back(o);
    if (inflight_++ == 0) last_progress_ = Clock::now();
  }
}

// ---------------------------------------------------------------------------------------
// RdmaPeer (rdma_peer.h): data path, failover, regions

RdmaPeer::RdmaPeer(RdmaTransportImpl* t, std::vector<LaneInit> inits, const SegmentDesc& d,
                   uint64_t conn, std::shared_ptr<ControlLink> control)
    : t_(t), name_(d.name), conn_(conn), control_(std::move(control)) {
  lanes_of_nic_.assign(t_->nics().size(), {});
  {
    // (A QP's NIC may die while the lanes are built: its give-back waits for them.)
    std::lock_guard<std::recursive_mutex> g(mu_);
    lanes_.reserve(inits.size());
    for (const LaneInit& in : inits) {
      lanes_of_nic_[static_cast<size_t>(in.nic->index)].push_back(static_cast<int>(lanes_.size()));
      lanes_.emplace_back();
      Lane& l = lanes_.back();
      l.nic = in.nic;
      l.remote_nic = in.remote_nic;
      l.remote_ib = in.remote_ib;
      l.id = in.id;
      if (in.qp != nullptr) {
        installLocked(l, newQp(in.nic, in.qp));
      } else {  // its first dial failed: the prober dials it again
        l.failed = true;
        l.error = in.why;
        l.retry_at = Clock::now() + t_->retryAfter();
      }
    }
  }
  setRegions(d);
  t_->addPeer(this);
}

RdmaPeer::~RdmaPeer() {
  t_->removePeer(this);  // waits for a probe of this peer
  {
    std::lock_guard<std::mutex> g(fb_mu_);
    fb_stop_ = true;  // what is queued fails (cancelled); nothing new joins it
  }
  fb_cv_.notify_all();
  if (fb_thread_.joinable()) fb_thread_.join();
  std::vector<Lane> lanes;
  std::vector<std::pair<Op*, Status>> parked;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    lanes.swap(lanes_);  // a give-back racing this finds no lane and fails its ops
    for (Lane& l : lanes)
      for (Op* o : l.parked)
        parked.emplace_back(o, MC_STATUS(kCancelled, "rdma: peer " << name_ << " closed"));
  }
  finishOps(parked);
  lanes.clear();
}

void RdmaPeer::submit(Task* task) {
  if (task->length == 0) return task->done(Status::OK());
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (dead_) return task->done(dead_why_);
  }
  std::vector<int64_t> rkeys, lkeys;
  const bool one_remote = findRemote(task->remote, task->length, &rkeys);
  if (!one_remote && !remoteCovers(task->remote, task->length))
    return task->done(MC_STATUS(kPermissionDenied,
                                "rdma: [" << hex(task->remote) << ", +" << task->length
                                          << ") is not inside a region peer " << name_
                                          << " registered for rdma"));
  // The local memory's nearest NICs (none: the engine does not know the memory, which then
  // moves through the bounce pool's chunks).
  std::vector<int> mine = t_->localKeys(task->local, task->length, &lkeys);
  // Across chunks of a region registered in chunks (either side): no slice crosses a chunk's
  // end, and each looks its keys up itself.
  const uint64_t local_span = t_->localSpan(task->local);
  if (local_span == 0 && t_->isDeviceMemory(task->local))
    return task->done(MC_STATUS(kInvalidArgument,
                                "rdma: the local memory of a request to " << name_ << " at "
                                    << task->local << " is GPU memory the engine does not know: "
                                                      "register it (MemoryKind::kCuda) first"));
  const bool chunked = !one_remote || (local_span > 0 && local_span < task->length);
  if (chunked) {
    std::vector<int64_t> first;
    mine = t_->localKeys(task->local, std::min(local_span, task->length), &first);
  }
  const std::vector<int> near = t_->stripeAll() ? std::vector<int>{} : mine;
  uint64_t slice = t_->sliceBytes();
  BouncePool* b = t_->bounce();
  if (mine.empty() && b != nullptr) slice = std::min<uint64_t>(slice, b->chunkBytes());
  std::vector<Op*> ops;
  ops.reserve((task->length + slice - 1) / slice);
  for (uint64_t off = 0; off < task->length;) {
    auto* o = new Op();
    o->op = task->op;
    o->len = std::min(slice, task->length - off);
    o->raddr = task->remote + off;
    o->user = static_cast<char*>(task->local) + off;
    if (chunked) {
      o->len = std::min(o->len, remoteSpan(o->raddr));
      if (const uint64_t ls = t_->localSpan(o->user)) o->len = std::min(o->len, ls);
    }
    ops.push_back(o);
    if (o->len == 0) {  // the peer's regions changed under us
      for (Op* x : ops) delete x;
      return task->done(MC_STATUS(kPermissionDenied, "rdma: peer " << name_ << " no longer has "
                                                         << hex(task->remote + off)
                                                         << " registered"));
    }
    off += o->len;
  }
  auto* ts = new TaskState(task, static_cast<int>(ops.size()));
  for (Op* o : ops) o->ts = ts;
  std::vector<std::pair<Op*, Status>> failed;
  if (evicted_.load() > 0) wake();
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    last_used_ = Clock::now();
    std::vector<int> use = liveLanes(near);
    if (use.empty()) use = liveLanes({});
    // None live: a lane redialled at once after a request's own error takes it (it waits).
    if (use.empty()) use = waitingLanes(near);
    if (use.empty()) use = waitingLanes({});
    // No lane: tcp. (Once a lane is back new work takes it, even while tcp still carries
    // older work: requests are not ordered among themselves, and a notification gets a part
    // on tcp too while tcp holds work, so it still follows all of it.)
    if (t_->tcpFallback() && use.empty()) {
      toFallback(ops, &failed);
      use.clear();
    }
    // Slices go round robin over the lanes, starting one further for each request (a
    // request of one slice thus uses one lane, and a run of them all of them).
    std::vector<std::vector<Op*>> per(lanes_.size());
    size_t next = use.empty() ? 0 : rr_++ % use.size();
    for (Op* o : ops) {
      Status st = use.empty() ? everyNicFailed(*o) : Status::OK();
      int lane = -1;
      for (size_t k = 0; st.ok() && k < use.size(); ++k) {
        int cand = use[(next + k) % use.size()];
        st = chunked ? bind(o, lanes_[static_cast<size_t>(cand)])
                     : bindWith(o, lanes_[static_cast<size_t>(cand)], rkeys, lkeys);
        if (st.ok()) {
          lane = cand;
          break;
        }
      }
      next = (next + 1) % std::max<size_t>(use.size(), 1);
      if (lane < 0) {
        failed.emplace_back(o, st);
      } else {
        per[static_cast<size_t>(lane)].push_back(o);
      }
    }
    for (size_t i = 0; i < lanes_.size(); ++i) {
      if (per[i].empty()) continue;
      lanes_[i].dirty = true;
      toLaneLocked(lanes_[i], per[i]);
    }
  }
  finishOps(failed);
}

Status RdmaPeer::notify(uint32_t channel, uint64_t tag) {
  std::vector<std::pair<Op*, Status>> failed;
  if (evicted_.load() > 0) wake();
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    if (dead_) return dead_why_;
    last_used_ = Clock::now();
    std::vector<int> live = liveLanes({});
    if (live.empty()) live = waitingLanes({});  // (it waits there for the lane's redial)
    const bool fb = t_->tcpFallback() && (live.empty() || fb_pending_.load() > 0);
    if (live.empty() && !fb) {  // nothing could carry it (nor the writes it follows)
      Op none;
      return everyNicFailed(none);
    }
    // One part on each lane that carried work since the last notification (a failed lane
    // still takes it: it gives it back behind that work), and one on the tcp fallback when
    // it holds work. None of them: one part on a live lane (or on tcp when none is live).
    std::vector<Lane*> parts;
    for (Lane& l : lanes_)
      if (l.dirty) parts.push_back(&l);
    const bool fb_part = fb && (fb_pending_.load() > 0 || live.empty());
    if (parts.empty() && !fb_part) parts.push_back(&lanes_[static_cast<size_t>(live[0])]);
    const uint32_t total = static_cast<uint32_t>(parts.size()) + (fb_part ? 1 : 0);
    const uint32_t seq = seq_;
    seq_ = (seq_ + 1) & kNotifySeqMask;
    auto part = [&](uint32_t i) {
      auto* o = new Op();
      o->channel = channel;
      o->tag = tag;
      o->word = notifyWord(total, i, seq);
      return o;
    };
    for (size_t i = 0; i < parts.size(); ++i) {
      std::vector<Op*> one{part(static_cast<uint32_t>(i))};
      parts[i]->dirty = false;
      toLaneLocked(*parts[i], one);
    }
    if (fb_part) {
      std::vector<Op*> one{part(total - 1)};
      toFallback(one, &failed);
    }
  }
  finishOps(failed);
  return Status::OK();
}

void RdmaPeer::fail(const Status& why) {
  std::vector<std::shared_ptr<Qp>> qps;
  std::vector<std::pair<Op*, Status>> parked;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    dead_ = true;
    dead_why_ = why;
    for (Lane& l : lanes_) {
      if (l.qp) qps.push_back(l.qp);
      for (Op* o : l.parked) parked.emplace_back(o, why);
      l.parked.clear();
      l.redial = false;
    }
  }
  finishOps(parked);
  for (auto& q : qps) q->fail(why);
}

void RdmaPeer::fenceAbandoned() {
  std::vector<std::shared_ptr<Qp>> qps;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    for (Lane& l : lanes_)
      if (l.qp) qps.push_back(l.qp);
  }
  // Every copy between a bounce chunk or the tcp fallback and a caller's memory checks
  // Op::abandoned() under one of these locks first: once each was taken, none is left.
  for (auto& q : qps) q->fence();
  std::lock_guard<std::mutex> g(fb_copy_mu_);
}

std::vector<int> RdmaPeer::liveLanes(const std::vector<int>& nics) {
  std::vector<int> out;
  auto live = [&](int lane) {
    const Lane& l = lanes_[static_cast<size_t>(lane)];
    return !l.failed && l.qp && l.qp->failedStatus().ok();
  };
  if (nics.empty()) {
    for (size_t i = 0; i < lanes_.size(); ++i)
      if (live(static_cast<int>(i))) out.push_back(static_cast<int>(i));
    return out;
  }
  for (int n : nics) {
    if (n < 0 || static_cast<size_t>(n) >= lanes_of_nic_.size()) continue;
    for (int lane : lanes_of_nic_[static_cast<size_t>(n)])
      if (live(lane)) out.push_back(lane);
  }
  return out;
}

Status RdmaPeer::bind(Op* o, const Lane& l) {
  std::vector<int64_t> rkeys, lkeys;
  findRemote(o->raddr, o->len, &rkeys);
  t_->localKeys(o->user, o->len, &lkeys);
  return bindWith(o, l, rkeys, lkeys);
}

Status RdmaPeer::bindWith(Op* o, const Lane& l, const std::vector<int64_t>& rkeys,
                          const std::vector<int64_t>& lkeys) {
  if (l.remote_nic < 0 || static_cast<size_t>(l.remote_nic) >= rkeys.size() ||
      rkeys[static_cast<size_t>(l.remote_nic)] < 0)
    return MC_STATUS(kPermissionDenied, "rdma: peer " << name_ << "'s region at "
                                                      << hex(o->raddr)
                                                      << " has no key on its NIC " << l.remote_nic);
  o->rkey = static_cast<uint32_t>(rkeys[static_cast<size_t>(l.remote_nic)]);
  const size_t n = static_cast<size_t>(l.nic->index);
  if (n < lkeys.size() && lkeys[n] >= 0) {
    o->bounce = false;
    o->local = o->user;
    o->lkey = static_cast<uint32_t>(lkeys[n]);
    return Status::OK();
  }
  BouncePool* b = t_->bounce();
  if (b == nullptr || o->len > b->chunkBytes())
    return MC_STATUS(kUnavailable, "rdma: the local memory of a request to " << name_
                                       << " is not registered on " << l.nic->name
                                       << " and cannot bounce");
  o->bounce = true;
  o->local = nullptr;
  return Status::OK();
}

void RdmaPeer::giveBack(Qp* from) {
  std::vector<std::pair<Op*, Status>> failed;
  {
    std::lock_guard<std::recursive_mutex> g(mu_);
    // Taken under mu_, as notify() and submit() enqueue under it: what the QP held (writes,
    // then the notification parts queued behind them) moves in one piece, and no notification
    // is issued while work it must follow is between two QPs.
    Status why;
    bool permanent = false, first = false;
    std::vector<Op*> ops = from->takeBack(&why, &permanent, &first);
    if (ops.empty() && !first) return;  // an earlier hand-back of this QP took it
    int own = -1;  // the QP's lane (none: replaced, or the peer is closing)
    for (size_t i = 0; i < lanes_.size(); ++i)
      if (lanes_[i].qp.get() == from) own = static_cast<int>(i);
    if (own >= 0 && !lanes_[static_cast<size_t>(own)].failed) {
      Lane& l = lanes_[static_cast<size_t>(own)];
      l.failed = true;
      l.error = why;
      // A request's own error left the link fine: only this lane's QP is replaced, at once,
      // and what no other lane takes waits for it (not failed, not sent over tcp).
      l.redial = permanent && !dead_;
      l.retry_at = Clock::now() + (permanent ? std::chrono::milliseconds(0) : t_->retryAfter());
      if (permanent) {
        MC_LOG(WARN, RDMA) << "peer " << name_ << ": " << why.message() << "; " << ops.size()
                           << " other work request(s) of that QP move to another lane or wait "
                           << "for this one, which is reconnected now";
        t_->kickProber();
      } else {
        MC_LOG(WARN, RDMA) << "peer " << name_ << ": " << why.message() << "; " << ops.size()
                           << " work request(s) move to another NIC, " << l.nic->name
                           << " is retried in " << t_->retryAfter().count() << " ms";
      }
    }
    if (ops.empty()) return;
    const bool waits = own >= 0 && lanes_[static_cast<size_t>(own)].redial;
    if (waits && !lanes_[static_cast<size_t>(own)].parked.empty()) {
      // Behind what already waits there (a part handed back late must follow it).
      toLaneLocked(lanes_[static_cast<size_t>(own)], ops);
    } else {
      placeLocked(ops, waits ? own : -1, &failed);
    }
  }
  finishOps(failed);
}

void RdmaPeer::placeLocked(std::vector<Op*>& ops, int park,
                           std::vector<std::pair<Op*, Status>>* failed) {
  // A request that failed (its own error) is not carried further: its remaining slices fail.
  std::vector<Op*> keep;
  for (Op* o : ops) {
    if (o->ts != nullptr && o->ts->failed.load())
      failed->emplace_back(o, MC_STATUS(kCancelled, "rdma: another slice of the request failed"));
    else
      keep.push_back(o);
  }
  ops.clear();
  if (keep.empty()) return;
  std::vector<int> live = dead_ ? std::vector<int>{} : liveLanes({});
  int to = -1;
  for (int cand : live) {
    bool all = true;
    for (Op* o : keep)
      if (o->ts != nullptr && !bind(o, lanes_[static_cast<size_t>(cand)]).ok()) all = false;
    if (all) {
      to = cand;
      break;
    }
  }
  if (to < 0 && park >= 0 && !dead_) {
    Lane& l = lanes_[static_cast<size_t>(park)];
    l.dirty = true;
    toLaneLocked(l, keep);
  } else if (to < 0 && !dead_ && t_->tcpFallback()) {
    toFallback(keep, failed);
  } else if (to < 0) {
    for (Op* o : keep) failed->emplace_back(o, dead_ ? dead_why_ : everyNicFailed(*o));
  } else {
    Lane& l = lanes_[static_cast<size_t>(to)];
    l.dirty = true;
    l.qp->enqueue(keep);
  }
}

void RdmaPeer::setRegions(const SegmentDesc& d) {
  std::vector<RemoteRegion> rs;
  auto parseKeys = [](const std::string& k) {
    std::vector<int64_t> out;
    std::stringstream in(k);
    std::string item;
    while (std::getline(in, item, ','))
      out.push_back(item == "-" || item.empty()
                        ? -1
                        : static_cast<int64_t>(std::strtoul(item.c_str(), nullptr, 10)));
    return out;
  };
  for (const auto& r : d.regions) {
    const std::string& k = r.keys[static_cast<int>(TransportKind::kRdma)];
    if (k.empty()) continue;
    if (k.rfind("chunk=", 0) != 0) {
      rs.push_back(RemoteRegion{r.addr, r.len, parseKeys(k)});
      continue;
    }
    // Registered in chunks (rdma_transport.h): an entry per chunk.
    std::stringstream in(k.substr(6));
    std::string item;
    std::getline(in, item, '/');
    const uint64_t chunk = std::strtoull(item.c_str(), nullptr, 10);
    for (uint64_t off = 0; chunk > 0 && off < r.len && std::getline(in, item, '/');
         off += chunk)
      rs.push_back(RemoteRegion{r.addr + off, std::min(chunk, r.len - off), parseKeys(item)});
  }
  std::sort(rs.begin(), rs.end(),
            [](const RemoteRegion& a, const RemoteRegion& b) { return a.addr < b.addr; });
  std::unique_lock<std::shared_mutex> g(regions_mu_);
  regions_ = std::move(rs);
}

uint64_t RdmaPeer::remoteSpan(uint64_t addr) const {
  std::shared_lock<std::shared_mutex> g(regions_mu_);
  auto it = std::upper_bound(regions_.begin(), regions_.end(), addr,
                             [](uint64_t a, const RemoteRegion& r) { return a < r.addr; });
  if (it == regions_.begin()) return 0;
  --it;
  return addr - it->addr < it->len ? it->len - (addr - it->addr) : 0;
}

bool RdmaPeer::remoteCovers(uint64_t addr, uint64_t len) const {
  while (len > 0) {
    const uint64_t n = remoteSpan(addr);
    if (n == 0) return false;
    if (n >= len) return true;
    addr += n;
    len -= n;
  }
  return true;
}

bool RdmaPeer::findRemote(uint64_t addr, uint64_t len, std::vector<int64_t>* rkeys) const {
  std::shared_lock<std::shared_mutex> g(regions_mu_);
  auto it = std::upper_bound(regions_.begin(), regions_.end(), addr,
                             [](uint64_t a, const RemoteRegion& r) { return a < r.addr; });
  if (it == regions_.begin()) return false;
  --it;
  if (addr - it->addr > it->len || len > it->len - (addr - it->addr)) return false;
  if (rkeys != nullptr) *rkeys = it->rkeys;
  return true;
}

std::unique_ptr<TransportPeer> makeRdmaPeer(RdmaTransportImpl* t, std::vector<LaneInit> lanes,
                                            const SegmentDesc& remote, uint64_t conn,
                                            std::shared_ptr<ControlLink> control) {
  auto p = std::make_unique<RdmaPeer>(t, std::move(lanes), remote, conn, std::move(control));
  if (!p->ok()) return nullptr;
  return p;
}

bool probePeer(RdmaPeer* p) { return p->probe(); }
EndpointState endpointOn(RdmaPeer* p, int nic) { return p->endpointOn(nic); }
void evictOn(RdmaPeer* p, int nic) { p->evictOn(nic); }

}  // namespace mooncake::engine::rdma
