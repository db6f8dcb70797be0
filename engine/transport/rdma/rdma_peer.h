// RdmaPeer: one peer's lanes (a QP per local NIC that reaches one of its NICs), slicing,
// striping, failover, the endpoint cache's side of a peer and the tcp fallback. Methods in
// rdma_peer.cc (data path, failover, regions), rdma_endpoints.cc (MC_RDMA_MAX_ENDPOINTS) and
// rdma_fallback.cc (MC_RDMA_TCP_FALLBACK). Internal to engine/transport/rdma.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/transport/rdma/rdma_internal.h"

namespace mooncake::engine::rdma {

// A remote region as this peer sees it: its rkey on each of the peer's NICs (-1: none).
struct RemoteRegion {
  uint64_t addr;
  uint64_t len;
  std::vector<int64_t> rkeys;
};

// Lanes: one QP per local NIC that reaches a NIC of the peer. A request's slices go over the
// lanes of the NICs nearest to its local memory (MC_RDMA_STRIPE=near) or over all (all), round
// robin; a notification goes over each lane that carried work since the last one
// (rdma_notify.h). A lane whose QP fails gives its work to another lane (in order, so that a
// notification part still follows the writes it covers) and is reconnected by the transport's
// prober MC_RDMA_RETRY_MS later; when no lane is left, requests fail naming every NIC's error.
class RdmaPeer final : public TransportPeer {
 public:
  RdmaPeer(RdmaTransportImpl* t, std::vector<LaneInit> inits, const SegmentDesc& d,
           uint64_t conn, std::shared_ptr<ControlLink> control);
  ~RdmaPeer() override;
  bool ok() const {
    bool any = false;
    for (const Lane& l : lanes_) {
      if (l.qp && !l.qp->ok()) return false;
      any |= l.qp != nullptr;
    }
    return any;
  }

  void submit(Task* task) override;

  Status notify(uint32_t channel, uint64_t tag) override;

  bool carriesMessages() const override { return false; }
  Status sendMessage(uint32_t channel, std::string_view payload) override {
    return MC_STATUS(kNotSupported, "rdma: messages go over the control link");
  }

  Status updateRemote(const SegmentDesc& remote) override {
    setRegions(remote);
    return Status::OK();
  }

  // The peer is gone (or the engine stops): final, nothing is rerouted or reconnected.
  void fail(const Status& why) override;
  // TransportPeer::fenceAbandoned: nothing more is copied between a bounce chunk (or the tcp
  // fallback) and an abandoned task's memory, and its slices not posted yet are not posted.
  // What is posted out of or into registered memory is the NIC's: fenced by deregistration.
  void fenceAbandoned() override;

  // MC_RDMA_MAX_ENDPOINTS (the transport's prober decides which): see EndpointState.
  EndpointState endpointOn(int nic);

  // Closes the lanes on `nic` if they are still idle: this end's QPs, then the target's (told
  // over the control link). Their writes completed, so no notification has to follow them.
  // Serialised with wake() (wake_mu_), so a lane's close and its next dial reach the target in
  // that order; neither holds mu_ while it waits for the target.
  void evictOn(int nic);

  // The prober: reconnects lanes that failed at least MC_RDMA_RETRY_MS ago, once their QP
  // gave back everything, on a NIC whose port is up; a lane failed by a request's own error at
  // once. True when such a lane's QP was still handing its work back (probe again soon).
  bool probe();

 private:
  struct Lane {
    std::shared_ptr<Qp> qp;  // null: not connected (failed at its first dial, or evicted)
    bool evicted = false;    // closed while idle (MC_RDMA_MAX_ENDPOINTS): dialled on next use
    Nic* nic = nullptr;
    int remote_nic = -1;
    bool remote_ib = false;
    int id = 0;           // its number in the connection (LaneInit::id)
    bool dirty = false;   // carried work since the last notification
    bool failed = false;  // its QP gave its work back; reconnected at retry_at
    // Failed by a request's own error (the link is fine): redialled at once, and the work no
    // other live lane could take waits here for that (`parked`, in order) rather than failing
    // or going to tcp. Cleared when the lane is back (the work goes to its new QP) or its
    // redial fails (the work moves as after a link failure).
    bool redial = false;
    std::vector<Op*> parked;
    Clock::time_point retry_at{};
    Status error;  // why it failed last
  };

  std::shared_ptr<Qp> newQp(Nic* nic, ibv_qp* raw) {
    return std::make_shared<Qp>(t_, nic, raw, name_, [this](Qp* from) { giveBack(from); });
  }

  // Under mu_: a lane's new QP (dialled by connect, probe or wake). One whose NIC went out of
  // service meanwhile is failed at once (the prober dials it again), and work parked on the
  // lane goes to it.
  void installLocked(Lane& l, std::shared_ptr<Qp> qp);

  // Under mu_: `ops` to lane `l`: its QP, or behind its parked work while it waits for its
  // redial.
  void toLaneLocked(Lane& l, std::vector<Op*>& ops);

  // Under mu_: work that no longer has a QP (a failed QP's, a lane's parked work whose redial
  // failed), in order: to one live lane that can bind all of it, else parked on lane
  // `park` (>= 0: a lane redialled at once), else tcp, else failed. Slices of requests that
  // already failed are not carried (they fail with their request).
  void placeLocked(std::vector<Op*>& ops, int park, std::vector<std::pair<Op*, Status>>* failed);

  // Under mu_: the lanes (indices) of the NICs in `nics` (all when empty) that wait for their
  // redial (Lane::redial), or whose QP failed and has not handed its work back yet (what it
  // finds joins that work).
  std::vector<int> waitingLanes(const std::vector<int>& nics);

  // Dials the evicted lanes again (one that cannot be dialled now is left to the prober, as a
  // failed one). Without mu_ while it waits for the target; callers that come meanwhile wait
  // on wake_mu_ for the lanes to be back.
  void wake();

  // Lanes (indices) of the NICs in `nics` (all NICs when empty) whose QP has not failed.
  std::vector<int> liveLanes(const std::vector<int>& nics);

  // Points a slice at `lane`: the remote key on its peer NIC and the local key on its NIC
  // (through the bounce pool where the local memory is not registered there).
  Status bind(Op* o, const Lane& l);
  // The same with the keys of the op's remote region (by peer NIC) and local region (by NIC)
  // looked up already (empty: none).
  Status bindWith(Op* o, const Lane& l, const std::vector<int64_t>& rkeys,
                  const std::vector<int64_t>& lkeys);

  // A failed QP's work, in issue order: all of it to one live lane (a notification part then
  // still follows the writes before it), or failed when none is left.
  void giveBack(Qp* from);

  // ---- the tcp fallback (MC_RDMA_TCP_FALLBACK): work no lane can carry goes, in order, over
  // the control link (the engine's authenticated tcp connection to the peer), while no lane
  // is live. One op at a time: a WRITE is on the target when its answer comes, so a
  // notification part behind it follows its bytes; a notification issued while the queue
  // holds work has a part here as well as on the lanes that carried work.

  // Under mu_: queues `ops` (takes them); once the peer is closing they fail instead.
  void toFallback(std::vector<Op*>& ops, std::vector<std::pair<Op*, Status>>* failed);

  void fallbackLoop();

  // One op over the control link (requests "F ..." of rdma_transport.h).
  Status overTcp(Op& o);

  // The error of a request no NIC can carry: every NIC's last error.
  Status everyNicFailed(const Op& o);

  void setRegions(const SegmentDesc& d);

  // Bytes from addr to the end of the peer's registered chunk holding it (0: none).
  uint64_t remoteSpan(uint64_t addr) const;

  // [addr, addr+len) lies in registered memory of the peer (in one chunk or several adjacent).
  bool remoteCovers(uint64_t addr, uint64_t len) const;

  bool findRemote(uint64_t addr, uint64_t len, std::vector<int64_t>* rkeys) const;

  RdmaTransportImpl* t_;
  std::string name_;
  const uint64_t conn_;
  std::shared_ptr<ControlLink> control_;
  // Lanes, their flags and the notification sequence. Recursive: a QP that fails while a
  // caller enqueues on it gives its work back on that caller's thread.
  std::recursive_mutex mu_;
  std::vector<Lane> lanes_;
  std::vector<std::vector<int>> lanes_of_nic_;  // local NIC index -> its lanes
  size_t rr_ = 0;
  uint32_t seq_ = 0;
  std::atomic<int> evicted_{0};  // lanes evicted (dialled again by the next request)
  Clock::time_point last_used_ = Clock::now();
  std::mutex wake_mu_;  // serialises evictOn() and wake() (taken before mu_, never under it)
  bool dead_ = false;
  Status dead_why_;
  mutable std::shared_mutex regions_mu_;
  std::vector<RemoteRegion> regions_;
  // The tcp fallback: ops in order, queued or being carried (fb_pending_), its thread.
  std::mutex fb_mu_;
  std::condition_variable fb_cv_;
  std::deque<Op*> fb_;
  std::atomic<int64_t> fb_pending_{0};
  // Held while the fallback copies from or into a caller's memory (fenceAbandoned).
  std::mutex fb_copy_mu_;
  bool fb_stop_ = false;
  bool fb_warned_ = false;
  std::thread fb_thread_;
};

}  // namespace mooncake::engine::rdma
