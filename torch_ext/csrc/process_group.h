// The c10d backend "mooncake": converts c10d calls (tensors, options) into pg::Communicator
// calls and pg errors into Python-visible exceptions. No algorithm lives here.
//
// Pattern (as ProcessGroupGloo): validate on the caller's thread (bad arguments raise
// ValueError at once) -> build a MooncakeWork -> enqueue the op on the communicator's worker
// (collectives, in issue order) or on a P2pLanes lane (send/recv) -> return the Work. The
// op's body stages non-contiguous tensors, calls the communicator, copies results back and
// completes the Work and its Future on the thread that ran it.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "engine/device/device.h"
#include "pg/communicator.h"
#include "torch_ext/csrc/compat.h"
#include "torch_ext/csrc/gpu_tensors.h"
#if MC_TORCH_HAS_BACKEND
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // the wrapper linkWrapper() keeps
#endif
#include "torch_ext/csrc/op_queue.h"
#include "torch_ext/csrc/p2p_lanes.h"

namespace mooncake::torch_ext {

class StoreRendezvous;
class Scratch;        // convert.h
class Check;          // convert.h
class StreamFence;    // gpu_tensors.h
struct ErrorContext;  // convert.h

// One op in flight. Completion state lives in c10d::Work's own fields (mutex_, cv_,
// completed_, exception_), so isCompleted/isSuccess/exception are the base class's. Locks
// name no mutex type (CTAD): mutex_ is a std::mutex in 1.13, a std::timed_mutex later.
class MooncakeWork : public c10d::Work {
 public:
  MooncakeWork(int rank, c10d::OpType type, const char* op, std::shared_ptr<const ErrorContext> ctx,
               std::vector<at::Tensor> outputs);
  ~MooncakeWork() override;

  // timeout 0 (kNoTimeout): until the op ends (every op is bounded by the group timeout);
  // with CUDA outputs, the caller's current streams wait instead of the host (gpu_tensors.h).
  bool wait(std::chrono::milliseconds timeout) override;
  // Created on first use (most ops are only waited on); completed with the output tensors
  // or the op's error. Completed before wait() returns when it existed by then.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
#if MC_TORCH_HAS_WORK_RESULT
  // torch >= 2.5: a future of the c10d::WorkResult (an int: SUCCESS 0, COMM_ERROR 2) that
  // never holds an error, for callers that handle failures without exceptions.
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
#endif
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // One Work for several: completes when all of `works` have (with the first error among
  // them), its result() is their outputs in order. What endCoalescing() returns.
  static c10::intrusive_ptr<MooncakeWork> joinAll(
      int rank, c10d::OpType type, const char* op, std::shared_ptr<const ErrorContext> ctx,
      std::vector<c10::intrusive_ptr<MooncakeWork>> works);

  // Called once by the thread that ran the op. nullptr = success.
  void complete(std::exception_ptr error);
  // complete(error) now, or, when a future of this Work exists (its callbacks would run inside
  // complete() and may issue ops of the same group and wait on them), the call to make once the
  // op no longer holds its queue or lane (OpQueue::Task, P2pLanes::Task).
  static std::function<void()> completion(const c10::intrusive_ptr<MooncakeWork>& work,
                                          std::exception_ptr error);
  // Elastic groups: the op failed because of peers (pg::PeerFailure) and completes without an
  // error, with this evidence (set before complete()): local_success false, the hint by slot.
  void setEvidence(std::vector<uint8_t> hint);
  bool localSuccess() const;
  // One entry per rank slot (1 = this rank saw that slot fail in this op).
  std::vector<uint8_t> failedRanksHint() const;
  void setSlots(int slots) { slots_ = slots; }
  void setSourceRank(int r) { source_rank_.store(r); }
  // A collective: wait() may run it on the waiting thread when it is next (see op_queue.h).
  void setQueued(std::shared_ptr<OpQueue> q, OpQueue::Id id) {
    queue_ = std::move(q);
    queue_id_ = id;
  }
  // A stream-ordered op (pg/stream_ops.h), queued on `stream` when it was issued: wait()
  // without a timeout returns at once, the caller's current stream, when it is another one,
  // made to wait for the op (NCCL's wait); MC_PG_BLOCKING_WAIT does not apply. `on`: a tensor
  // on the op's device (a Work without outputs, a gather's on a non-root, still orders the
  // caller's stream of that device instead of blocking).
  void setOnStream(std::shared_ptr<pg::Communicator::StreamOp> op, const void* stream,
                   const at::Tensor& on) {
    stream_op_ = std::move(op);
    issue_stream_ = stream;
    noteCudaDevice(on, &devices_);
  }

 private:
  using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
  void markFuture(const FuturePtr& f, std::exception_ptr e);
  static void markResult(const FuturePtr& f, std::exception_ptr e);
  // Returns *slot (guarded by mutex_), creating it on first use; completed at once when the
  // Work already is.
  FuturePtr lazyFuture(FuturePtr MooncakeWork::*slot, const c10::TypePtr& type, bool result);
  // wait() on CUDA outputs: the current streams wait for the op's gate. False: the host waits.
  bool waitOnStreams();

  const char* op_;  // a string literal
  std::shared_ptr<const ErrorContext> ctx_;
  std::vector<at::Tensor> outputs_;
  std::vector<c10::Device> devices_;  // the CUDA devices of outputs_ (getFuture's)
  FuturePtr future_;         // getFuture(), guarded by mutex_
  FuturePtr result_future_;  // getFutureResult(), guarded by mutex_
  std::atomic<int> source_rank_{-1};
  std::shared_ptr<OpQueue> queue_;  // set before the Work is returned, then read-only
  OpQueue::Id queue_id_ = 0;
  int slots_ = 0;                  // the group's rank slots (set before the Work is returned)
  bool local_success_ = true;      // guarded by mutex_
  std::vector<uint8_t> hint_;      // guarded by mutex_; empty: no failure
  // Opened by complete() (guarded by mutex_): a stream waits on it (waitOnStreams).
  std::optional<engine::device::Gate> gate_;
  std::shared_ptr<pg::Communicator::StreamOp> stream_op_;  // setOnStream's
  const void* issue_stream_ = nullptr;
  bool ready_ = false;              // complete() began: the outputs are in place (mutex_)
  std::exception_ptr ready_error_;  // and the op's error (mutex_)
};

struct MooncakeOptions {
  std::string group_name = "default";
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Global rank of each group rank (empty: the identity), for error messages.
  std::vector<int64_t> global_ranks;
  size_t buffer_bytes = 0;  // 0: MC_PG_BUFFER_BYTES
  // The job secret (generated by the job's first process and shared through torch's store;
  // empty: the engine's own resolution, MC_SECRET / MC_SECRET_FILE) and the host the job's
  // store runs on (the engine listens on the interface that reaches it). Both are used when
  // this group creates the process's engine; later groups share that engine.
  std::string secret;
  std::string reach_host;
  // Elastic groups (pg_options=mooncake.pg.MooncakeBackendOptions(...); docs/elastic.md).
  // active_ranks (optional): a caller-owned int32 tensor of at least max_group_size entries
  // that mirrors the active slots after every view change.
  pg::ElasticOptions elastic;
  at::Tensor active_ranks;
};

class ProcessGroupMooncake : public BackendBase {
 public:
  // Collective over the group's ranks: exchanges segments through `store` (the group's
  // PrefixStore) and returns when every rank is connected. Throws std::runtime_error.
  ProcessGroupMooncake(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       MooncakeOptions options);
  ~ProcessGroupMooncake() override;

  const std::string getBackendName() const override { return "mooncake"; }
  // The device types whose tensors the ops take (Check::tensor in convert.h refuses the
  // others); torch 2.x registers the backend for exactly these (mooncake._C.DEVICES). "cuda"
  // in a build with CUDA (a process whose engine has no CUDA device layer then refuses CUDA
  // tensors with the reason).
  static std::vector<std::string> devices();
  const MooncakeOptions& mooncakeOptions() const { return opts_; }
  pg::Communicator& communicator() { return *comm_; }
  // Elastic groups: the active slots as an int32 tensor (the caller's active_ranks mirror
  // when it gave one).
  at::Tensor activeRanks();
#if MC_TORCH_HAS_BACKEND
  // torch >= 2: remembers the ProcessGroup torch made around this backend, so that its size
  // (dist.get_world_size()) follows the views too. mooncake.pg's creator calls it.
  void linkWrapper(const c10::intrusive_ptr<c10d::ProcessGroup>& wrapper);
#endif

  using Work = c10d::Work;
  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

#if MC_TORCH_HAS_BACKEND
  // The fast paths of dist._coalescing_manager and of the functional collectives: one op
  // per (output, input) pair, run as one queued collective.
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  // dist._coalescing_manager(group, device): every op this process issues on the group
  // between the two (collectives and point-to-point) runs as usual; endCoalescing returns
  // one Work that completes when all of them have. Called by one thread at a time. A block
  // that never ended (an op in it raised) is dropped by the next startCoalescing.
  void startCoalescing() override;
  c10::intrusive_ptr<Work> endCoalescing() override;
#endif

 private:
  using Body = std::function<void()>;
  // Enqueues body on the collective worker; its exceptions become the Work's error.
  // ck has checked the op's tensors: when CUDA tensors were among them, the op first waits
  // for the caller's streams as they were at this call (StreamFence, gpu_tensors.h).
  c10::intrusive_ptr<Work> collective(const Check& ck, c10d::OpType type, const char* op,
                                      std::vector<at::Tensor> outputs, Body body);
  // The caller's stream of `on` (into *stream) and what `queue` put on it: null when `on` has
  // none or the group does not take a stream-ordered path; its errors translated.
  std::shared_ptr<pg::Communicator::StreamOp> queueOnStream(
      const char* name, const at::Tensor& on,
      const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue,
      const void** stream) const;
  // An op on GPU memory queued on the stream of `on` (pg/stream_ops.h) by `queue` (given that
  // stream; null when the group does not take that path), with a Work whose queued task waits
  // for it; null when it was not queued. `inputs` (and `on`) are held until the op ended on
  // the stream, as ProcessGroupNCCL stashes its tensors: a caller may drop an input at once.
  c10::intrusive_ptr<Work> streamCollective(
      c10d::OpType type, const char* op, const at::Tensor& on, std::vector<at::Tensor> outputs,
      const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue,
      std::vector<at::Tensor> inputs = {});
  c10::intrusive_ptr<Work> p2p(const Check& ck, c10d::OpType type, const char* op,
                               const P2pLanes::Key& lane,
                               std::vector<at::Tensor> outputs,
                               std::function<void(MooncakeWork&)> body);
  // A send/recv of GPU memory queued on a stream of the engine's for its peer and direction
  // (pg/stream_p2p.h) by `queue` (given the caller's stream of t; null: not that path), with a
  // Work whose task on the op's lane waits for it; null when it was not queued.
  c10::intrusive_ptr<Work> streamP2p(
      c10d::OpType type, const char* op, const P2pLanes::Key& lane, const at::Tensor& t,
      const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue);
  std::shared_ptr<const StreamFence> fence(const Check& ck) const;  // null: no CUDA tensor
  // The argument checks of collective `op`: one that fails also tells the peers, which called
  // the op, through pg::Communicator::reject (refuse; process_group_coalesced.cc).
  Check check(const char* op);
  void refuse(const Check& ck, const char* op, const std::string& why);
  // Records an op issued between startCoalescing and endCoalescing.
  void track(const c10::intrusive_ptr<MooncakeWork>& work);
  int globalRank(int group_rank) const;
  // Elastic groups, after each view change: size_ (what get_world_size() reports: one past the
  // highest active slot), the linked torch ProcessGroup's size (torch >= 2) and the
  // active_ranks mirror.
  // keep (torch >= 2): receives the wrapper while it is updated, for the caller to release
  // after sink_->mu, never under it (were it the last reference, this object would go then).
  void onViewChange(c10::intrusive_ptr<c10d::ProcessGroup>* keep = nullptr);
  const std::string& who() const;  // "mooncake rank G (group 'name' rank r/n)"

  MooncakeOptions opts_;
  std::shared_ptr<const ErrorContext> ectx_;
  std::shared_ptr<engine::TransferEngine> engine_;
  std::shared_ptr<StoreRendezvous> rdv_;
  std::shared_ptr<pg::Communicator> comm_;
  std::shared_ptr<OpQueue> queue_;    // collectives, in issue order
  std::shared_ptr<Scratch> scratch_;  // staging of the list ops (used by one op at a time)
  std::mutex coalesce_mu_;
  bool coalescing_ = false;                                  // guarded by coalesce_mu_
  std::vector<c10::intrusive_ptr<MooncakeWork>> coalesced_;  // guarded by coalesce_mu_
  // The communicator may outlive this object (a p2p lane holds it): its view callback reaches
  // this object only while it exists.
  struct ViewSink {
    std::mutex mu;
    ProcessGroupMooncake* pg = nullptr;
#if MC_TORCH_HAS_BACKEND
    // torch >= 2: the ProcessGroup wrapping this backend. dist.get_world_size() reads that
    // object's own size, not the backend's, so a view change updates both. Weak: the
    // ProcessGroup owns this backend.
    std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> wrapper;
#endif
  };
  std::shared_ptr<ViewSink> sink_ = std::make_shared<ViewSink>();
  // The size this backend's own code reads (process_group*.cc say size_: this member hides
  // c10d's). An elastic group's agent thread changes it (onViewChange) while the user's thread
  // checks an op's arguments against it; c10d's is a plain const int, and reading that raced
  // with the write. onViewChange still sets c10d's (and the wrapper's) for torch's getSize().
  // Each op reads it once (const int n = size_) so that its checks and its run agree.
  std::atomic<int> size_{BackendBase::size_};
  std::unique_ptr<P2pLanes> lanes_;  // declared last: stops first
};

// The process's one TransferEngine, shared by every group (created on first use, released
// when the last group goes away).
std::shared_ptr<engine::TransferEngine> sharedEngine(const std::string& secret = "",
                                                     const std::string& reach_host = "");

}  // namespace mooncake::torch_ext
