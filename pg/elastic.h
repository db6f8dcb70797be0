// Elastic: the controller of an elastic group (docs/elastic.md). Internal to pg/.
//
// Control plane, without a coordinator. Everything the processes agree on lives in the group's
// Rendezvous under "<group>#<gen>/el/": each slot's incarnation counter and records, each
// process's latest link observation, view acknowledgements, and the views themselves, one per
// epoch, decided by ViewLog (Disk Paxos: any process proposes; a proposer that dies or stalls
// cannot split the decision). Engine messages on the group's control channel are doorbells
// only (they carry nothing; they make the others look at the store now instead of at their
// next poll). A background agent per communicator follows the views, opens the processes
// they name, answers observation requests, and (auto_deactivate) starts a reconciliation when
// an active or awaiting member's process is gone or an op failed; the lowest live active slot
// proposes at once, the others only after a stagger, so a dead or stalled proposer delays
// the agreement by that stagger, never blocks it.
//
// Data plane, per view. Views that change the active slots (or the processes holding them)
// run the view barrier: every live process active in the old or the new data view leaves the
// old one (its peers still in an op of it fail that op at once), acknowledges the new epoch
// with the number of ops it called in the old view (one that failed at its start counts) and
// the path it can take, and waits for the others' acknowledgements. K = the most ops any old
// member called: a member that called fewer fails its next ops up to K without running them
// (local_success=false, the others ran them in the old view), after any such skips an earlier
// barrier left it owing, so every member runs op K+1 in the new view. The new data
// plane is a Communicator::Impl over the active slots (the algorithms run on it unchanged),
// with shm flags tagged by the epoch and fresh message channels.
//
// Threading: ops (collectives) run under op_mu_, one at a time; views are applied under
// op_mu_ too (by the op thread at an op's start or inside a failed op with auto_sync, by the
// agent while no op runs, or by a user call that waits for a view). mu_ guards what queries
// read (views, processes); it is never held across a store call or a wait.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pg/comm_impl.h"
#include "pg/consensus.h"
#include "pg/membership.h"

namespace mooncake::pg {

// Checks CommOptions::elastic (std::invalid_argument).
void validateElastic(const CommOptions& o);
// Creates root.elastic and starts it (founders: view 1 and its barrier; an extension rank:
// registration, isolated). Called by Communicator::create once the buffer is allocated.
void createElastic(Communicator::Impl& root, uint32_t p2p_channel, engine::Deadline deadline);

class Elastic {
 public:
  Elastic(Communicator::Impl& root, uint32_t p2p_channel);
  ~Elastic();
  void start(engine::Deadline deadline);

  // ---- queries (any thread) ----
  int rank() const { return slot_; }
  int size() const;
  int maxSize() const { return max_size_; }
  uint64_t epoch() const;
  SlotMask activeMask() const;
  std::vector<uint8_t> peerState(const std::vector<int>& slots) const;
  int numSynced() const;
  std::vector<int> deadSlots() const;
  engine::PeerId peerOf(int slot) const;
  const std::string& path() const;

  // ---- membership (user threads) ----
  ProposalResult activate(const std::vector<int>& slots);
  ProposalResult deactivate(const std::vector<int>& slots);
  void join();
  SyncResult sync();
  void onViewChange(std::function<void()> cb);

  // ---- ops (pg/elastic_ops.cc): slot-indexed, as Communicator's, which validated the
  // arguments and built the signature. blocks: how many rank blocks the caller's buffers hold
  // (its size() when it called); a view change since then fails the op (see enter()). ----
  void allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp op,
                 const OpSig& sig);
  void reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op, int root,
              const OpSig& sig);
  void broadcast(void* buf, size_t bytes, int root, const OpSig& sig);
  void allGatherV(const void* in, void* out, const std::vector<size_t>& bytes, const char* name,
                  const OpSig& sig);
  void gather(const void* in, void* out, size_t bytes, int root, int blocks, const OpSig& sig);
  void scatter(const void* in, void* out, size_t bytes, int root, int blocks, const OpSig& sig);
  void reduceScatter(const void* in, void* out, size_t count, DataType t, ReduceOp op,
                     int blocks, const OpSig& sig);
  void allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                 const std::vector<size_t>& send_offsets, void* out,
                 const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                 const OpSig& sig);
  void barrier(const OpSig& sig);
  void send(const void* buf, size_t bytes, int dst, uint64_t tag);
  int recv(void* buf, size_t bytes, int src, uint64_t tag);

 private:
  // A process holding a slot, as this process knows it.
  struct Proc {
    uint32_t inc = 0;
    bool have_record = false;
    RankRecord rec;
    engine::PeerId peer = engine::kInvalidPeer;
    char* base = nullptr;  // its comm buffer mapped here (same host), else null
    std::string host;
    // The process this one replaced in the slot (when this process had opened it): a view
    // barrier may still wait for that one's acknowledgement, and needs to see it die.
    uint32_t prev_inc = 0;
    engine::PeerId prev_peer = engine::kInvalidPeer;
  };
  // The data plane ops run on (op_mu_).
  struct Plane {
    std::unique_ptr<Communicator::Impl> impl;  // null: this process is not active
    std::vector<int> slots;                    // compact rank -> slot
    std::vector<int> index;                    // slot -> compact rank, -1 if not in the plane
    int size = 0;                              // the public size while this plane is current
    uint64_t data_epoch = 0;
  };
  struct Obs {
    uint32_t inc = 0;
    int64_t tag = 0;
    std::vector<uint32_t> conn;  // by slot: the incarnation this process is connected to
    std::string serialize() const;
    static bool parse(const std::string& s, Obs* out);
  };
  struct Found {  // what an observation round found
    SlotMask candidates;
    SlotMask healthy;
    LinkMatrix links{0};
  };

  // ---- keys, doorbells, waiting ----
  std::string key(const std::string& what) const { return prefix_ + "/" + what; }
  void ring();
  void wake();
  // Waits until woken (doorbell, peer gone) or `d` passes or `max` elapses.
  void nap(engine::Deadline d, std::chrono::milliseconds max);
  bool alive(int slot, uint32_t inc) const;  // this process's engine sees it alive (or self)

  // ---- views (pg/elastic.cc) ----
  View refreshLatest();  // reads newer decided views from the store; returns the latest
  void ensureOpen(int slot, uint32_t inc, engine::Deadline deadline);
  void openKnown(const View& v, engine::Deadline deadline);
  // Applies every decided view up to the latest (op_mu_ held). dropped: slots of the last
  // barrier that did not acknowledge.
  void applyAll(engine::Deadline deadline, std::vector<int>* dropped = nullptr);
  void applyOne(const View& v, engine::Deadline deadline, std::vector<int>* dropped);
  std::vector<int> runBarrier(const View& v, engine::Deadline deadline);
  // The barrier's outcome every participant uses (pg/elastic_members.cc): this process's
  // acknowledgements and lost slots proposed to bar_log_ for the epoch, replaced by the decided
  // ones (each process stops waiting at its own deadline, so a late acknowledgement may be seen
  // by some and not others: skipping different op counts paired their ops off by one).
  using Acks = std::map<std::pair<int, uint32_t>, std::pair<uint64_t, std::string>>;
  void agreeOnBarrier(uint64_t epoch, Acks* acks, std::vector<int>* lost);
  void installPlane(const View& v, const std::vector<std::string>& modes, bool isolated);
  void updateP2p(const View& v);
  // Blocks until the applied epoch reaches `epoch`, applying views on this thread.
  void applyUntil(uint64_t epoch, engine::Deadline deadline, std::vector<int>* dropped);
  void agentLoop();
  void agentTick();

  // ---- membership (pg/elastic_members.cc) ----
  void publishObs(int64_t tag);
  // Answers a newer observation request if there is one (every wait loop calls it, so a
  // process busy in a barrier or a proposal still answers the others' rounds).
  void serviceRequests();
  Found observe(const View& base, const std::vector<int>& must, engine::Deadline deadline);
  // Proposes `v` for epoch v.epoch; returns the decided view.
  View decide(const View& v, engine::Deadline deadline);
  // Applies the decided view `epoch` (this thread) and answers Applied, or
  // AppliedWithDroppedRanks with the slots its barrier dropped.
  ProposalResult applyDecided(uint64_t epoch, engine::Deadline deadline);
  bool needsReconcile(const View& latest) const;
  // One reconciliation (after a stagger unless urgent); returns when a view newer than `base`
  // is decided (by anyone). holding_op: this thread holds op_mu_ (applies inline).
  void reconcile(bool urgent, engine::Deadline deadline);
  int proposerRank(const View& v) const;  // this process's place in the proposer order
  SyncResult syncImpl(bool holding_op);

  // ---- ops (pg/elastic_ops.cc) ----
  template <class Fn>
  void collective(const char* name, const OpSig& sig, int blocks, Fn&& fn);
  const Plane& enter(const char* name, int blocks);
  [[noreturn]] void failed(const OpCtx& op, const CommError& e);
  [[noreturn]] void p2pFailed(const char* op, int peer, const CommError& e);
  std::vector<uint8_t> hintOf(const std::vector<int>& slots) const;

  Communicator::Impl& root_;
  const uint32_t p2p_channel_;
  std::string name_;    // the group name (channels)
  std::string prefix_;  // store keys
  int slot_ = 0;
  uint32_t inc_ = 0;
  int max_size_ = 0;
  int declared_ = 0;
  ElasticOptions eo_;
  std::unique_ptr<ViewLog> log_;
  std::unique_ptr<ViewLog> bar_log_;  // per epoch: the barrier's decided acknowledgements
  uint32_t ctl_channel_ = 0;
  uint64_t gone_handler_ = 0;

  mutable std::mutex mu_;
  std::vector<Proc> procs_;          // by slot
  std::map<uint64_t, View> views_;   // decided views not applied yet
  View latest_;                      // the latest decided view known here
  View applied_;                     // the latest applied here
  std::atomic<uint64_t> latest_epoch_{0};
  std::atomic<uint64_t> applied_epoch_{0};
  std::atomic<bool> isolated_{false};   // an extension rank before its activation
  std::atomic<bool> quiescing_{false};  // join() in progress
  std::string path_ = "none";
  std::vector<std::function<void()>> callbacks_;
  std::map<uint64_t, std::vector<int>> dropped_;  // epoch -> slots its barrier dropped

  // op_mu_: the data plane and the op counters.
  std::mutex op_mu_;
  Plane plane_;
  View data_;                  // the view plane_ was built for (empty: none)
  uint64_t count_ = 0;         // ops called on plane_ (run or failed)
  uint64_t skip_ = 0;          // ops to fail without running (the view barrier's K)
  std::vector<uint8_t> skip_hint_;
  bool broken_ = false;        // an op failed on plane_: later ops fail until a new plane
  std::vector<uint8_t> broken_hint_;
  std::atomic<bool> broken_flag_{false};  // broken_, readable without op_mu_ (agent)
  std::vector<char> scratch_;  // compacting rank-indexed inputs around holes (op_mu_)
  std::atomic<uint64_t> gone_events_{0};  // engine "peer gone" reports so far
  std::atomic<int64_t> gone_at_ns_{0};    // steady-clock time of the last one
  uint64_t gone_seen_ = 0;                // ... when the plane's members were last checked

  // Agent and doorbells.
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  uint64_t bell_ = 0;
  std::atomic<bool> stop_{false};  // set under wake_mu_; runBarrier reads it without
  std::thread agent_;
  std::atomic<int64_t> answered_{0};  // the last observation request this process answered
  engine::Clock::time_point need_since_{};  // when the agent first saw a reconcile was needed
};

}  // namespace mooncake::pg
