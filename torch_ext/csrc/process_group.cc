#include "torch_ext/csrc/process_group.h"
#include "torch_ext/csrc/engine_handle.h"

#include <Python.h>
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "mooncake/config.h"
#include "torch_ext/csrc/convert.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/store_rendezvous.h"

namespace mooncake::torch_ext {

using at::Tensor;
using c10d::OpType;

// ---------------------------------------------------------------------------------------
// Engine and group set-up

std::shared_ptr<engine::TransferEngine> sharedEngine(const std::string& secret,
                                                     const std::string& reach_host) {
  static std::mutex mu;
  static std::weak_ptr<engine::TransferEngine> current;
  std::lock_guard<std::mutex> lk(mu);
  // mooncake.pg.set_transfer_engine(): the caller's engine (its secret is its own).
  if (auto o = sharedEngineOverride()) return o;
  if (auto e = current.lock()) return e;
  engine::EngineOptions eo;
  eo.secret = secret;
  eo.reach_host = reach_host;
  eo.host = sharedEngineHost();  // mooncake.pg.set_host_ip()
  auto created = engine::TransferEngine::create(eo);
  if (!created.ok()) {
    throw std::runtime_error("mooncake: cannot start the transfer engine: " +
                             created.status().toString());
  }
  std::shared_ptr<engine::TransferEngine> e(std::move(created).value());
  current = e;
  return e;
}

ProcessGroupMooncake::ProcessGroupMooncake(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, MooncakeOptions options)
    : BackendBase(rank, size), opts_(std::move(options)) {
  if (!opts_.global_ranks.empty() && static_cast<int>(opts_.global_ranks.size()) != size) {
    throw std::invalid_argument("mooncake: global_ranks has " +
                                std::to_string(opts_.global_ranks.size()) +
                                " entries for a group of " + std::to_string(size));
  }
  {
    auto ctx = std::make_shared<ErrorContext>();
    ctx->who = "mooncake rank " + std::to_string(globalRank(rank));
    if (!opts_.global_ranks.empty()) {
      ctx->who += " (group '" + opts_.group_name + "' rank " + std::to_string(rank) + "/" +
                  std::to_string(size) + ")";
    }
    ctx->global_ranks = opts_.global_ranks;
    ectx_ = std::move(ctx);
  }
  engine_ = sharedEngine(opts_.secret, opts_.reach_host);
  rdv_ = std::make_shared<StoreRendezvous>(store);
  pg::CommOptions co;
  co.rank = rank;
  co.size = size;
  co.group_name = opts_.group_name;
  co.timeout = opts_.timeout;
  co.buffer_bytes = opts_.buffer_bytes;
  co.elastic = opts_.elastic;
  if (co.elastic.enabled) {
    // Upstream's check and message, at backend construction (RuntimeError in Python).
    if (co.elastic.auto_sync_on_failure && !co.elastic.auto_deactivate_on_failure)
      throw std::runtime_error("auto_sync_on_failure requires auto_deactivate_on_failure=true");
    const int64_t slots = co.elastic.max_group_size > 0 ? co.elastic.max_group_size : size;
    const at::Tensor& a = opts_.active_ranks;
    if (a.defined() && (a.scalar_type() != at::kInt || !a.is_contiguous() || a.numel() < slots))
      throw std::runtime_error(who() + ": active_ranks must be a contiguous int32 tensor of at "
                               "least max_group_size (" + std::to_string(slots) + ") entries");
  }
  try {
    comm_ = pg::Communicator::create(engine_, rdv_, co);
  } catch (...) {
    std::rethrow_exception(translateError(*ectx_, "init", std::current_exception()));
  }
  if (comm_->elastic()) {
    sink_->pg = this;
    onViewChange();
    comm_->onViewChange([sink = sink_] {
      c10::intrusive_ptr<c10d::ProcessGroup> keep;  // released after the lock below
      std::lock_guard<std::mutex> lk(sink->mu);
      if (sink->pg != nullptr) sink->pg->onViewChange(&keep);
    });
  }
  queue_ = OpQueue::create(comm_.get());
  scratch_ = std::make_shared<Scratch>();
  lanes_ = std::make_unique<P2pLanes>();
  init();
}

namespace {

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

}  // namespace

ProcessGroupMooncake::~ProcessGroupMooncake() {
  // Collectives nobody ran yet go to the worker, which runs them before the communicator goes.
  if (queue_) queue_->close();
  // Their Works complete on the queue's completion thread: destroy_process_group returns
  // after that (not when called from a callback). Their callbacks may need the GIL, which a
  // Python caller dropping the group holds: it is released meanwhile. An interpreter that is
  // finalizing runs no more Python callbacks: nothing is waited for then.
  if (queue_) {
    if (!Py_IsInitialized() || !PyGILState_Check()) {
      queue_->waitClosed();
    } else if (!finalizing()) {
      PyThreadState* ts = PyEval_SaveThread();
      queue_->waitClosed();
      PyEval_RestoreThread(ts);
    }
  }
  std::lock_guard<std::mutex> lk(sink_->mu);
  sink_->pg = nullptr;
}

std::vector<std::string> ProcessGroupMooncake::devices() {
#if MC_HAVE_CUDA
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

int ProcessGroupMooncake::globalRank(int group_rank) const {
  return opts_.global_ranks.empty() ? group_rank : static_cast<int>(opts_.global_ranks[group_rank]);
}

const std::string& ProcessGroupMooncake::who() const { return ectx_->who; }

at::Tensor ProcessGroupMooncake::activeRanks() {
  std::vector<uint8_t> m = comm_->activeMask();
  at::Tensor t = at::empty({static_cast<int64_t>(m.size())}, at::kInt);
  for (size_t i = 0; i < m.size(); ++i) t.data_ptr<int32_t>()[i] = m[i];
  if (!opts_.active_ranks.defined()) return t;
  return opts_.active_ranks;  // kept current by onViewChange
}

#if MC_TORCH_HAS_BACKEND
namespace {
// c10d::ProcessGroup's size_ is protected and const; a pointer to it formed through a derived
// class reaches it on any ProcessGroup (the same write onViewChange makes to our own size_).
struct WrapperSize : c10d::ProcessGroup {
  static void set(c10d::ProcessGroup& pg, int n) {
    const int c10d::ProcessGroup::*m = &WrapperSize::size_;
    __atomic_store_n(&const_cast<int&>(pg.*m), n, __ATOMIC_RELAXED);
  }
};
}  // namespace

void ProcessGroupMooncake::linkWrapper(const c10::intrusive_ptr<c10d::ProcessGroup>& wrapper) {
  if (!comm_->elastic()) return;
  std::lock_guard<std::mutex> lk(sink_->mu);
  sink_->wrapper.emplace(wrapper);
  WrapperSize::set(*wrapper, comm_->size());
}
#endif

void ProcessGroupMooncake::onViewChange(c10::intrusive_ptr<c10d::ProcessGroup>* keep) {
  // An elastic group's size follows its views (upstream's getSize() reports one past the
  // highest active slot). Called on the thread that applied the view (the agent's, often),
  // with sink_->mu held (or before the callback is set): our ops read our atomic size_;
  // c10d's (declared const; getSize() reads it each time) gets a store that cannot tear.
  const int n = comm_->size();
  size_.store(n);
  __atomic_store_n(&const_cast<int&>(BackendBase::size_), n, __ATOMIC_RELAXED);
#if MC_TORCH_HAS_BACKEND
  if (sink_->wrapper) {
    c10::intrusive_ptr<c10d::ProcessGroup> w = sink_->wrapper->lock();
    if (w) WrapperSize::set(*w, n);
    if (keep != nullptr) *keep = std::move(w);
  }
#else
  (void)keep;
#endif
  if (opts_.active_ranks.defined()) {
    std::vector<uint8_t> m = comm_->activeMask();
    at::Tensor t = at::empty({static_cast<int64_t>(m.size())}, at::kInt);
    for (size_t i = 0; i < m.size(); ++i) t.data_ptr<int32_t>()[i] = m[i];
    opts_.active_ranks.narrow(0, 0, t.numel()).copy_(t);
  }
}

std::shared_ptr<const StreamFence> ProcessGroupMooncake::fence(const Check& ck) const {
  if (ck.cudaDevices().empty()) return nullptr;
  return std::make_shared<const StreamFence>(ck.cudaDevices());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::collective(const Check& ck, OpType type,
                                                                const char* op,
                                                                std::vector<Tensor> outputs,
                                                                Body body) {
  auto work = c10::make_intrusive<MooncakeWork>(rank_, type, op, ectx_, std::move(outputs));
  work->setSlots(comm_->maxGroupSize());
  try {
    auto id = queue_->submit(op, [work, body = std::move(body), ctx = ectx_, op, f = fence(ck),
                                  timeout = opts_.timeout, dt = ck.sigDtype()]() {
      std::exception_ptr err;
      try {
        if (f) f->wait(op, timeout);  // the caller's kernels before the op have run
        at::NoGradGuard no_grad;  // copies into leaf tensors that require grad are ours
        std::optional<pg::SigDtype> typed;  // copy ops' signatures carry the dtype
        if (dt) typed.emplace(*dt);
        body();
      } catch (const pg::PeerFailure& f) {
        work->setEvidence(f.hint());  // elastic: evidence, not an error (docs/elastic.md)
      } catch (...) {
        err = translateError(*ctx, op, std::current_exception());
      }
      return MooncakeWork::completion(work, err);
    });
    work->setQueued(queue_, id);  // (a cycle Work -> queue -> task -> Work until it runs)
  } catch (...) {
    std::rethrow_exception(translateError(*ectx_, op, std::current_exception()));
  }
  track(work);
  return work;
}

std::shared_ptr<pg::Communicator::StreamOp> ProcessGroupMooncake::queueOnStream(
    const char* name, const Tensor& on,
    const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue,
    const void** stream) const {
  std::optional<const void*> s = opStream(on);
  if (!s) return nullptr;
  *stream = *s;
  try {
    std::optional<pg::SigDtype> typed;
    if (auto dt = pgType(on.scalar_type())) typed.emplace(*dt);
    return queue(*s);
  } catch (...) {
    std::rethrow_exception(translateError(*ectx_, name, std::current_exception()));
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::streamCollective(
    c10d::OpType type, const char* name, const Tensor& on, std::vector<Tensor> outputs,
    const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue,
    std::vector<Tensor> inputs) {
  const void* stream = nullptr;
  std::shared_ptr<pg::Communicator::StreamOp> so = queueOnStream(name, on, queue, &stream);
  if (!so) return {};
  auto work = c10::make_intrusive<MooncakeWork>(rank_, type, name, ectx_, std::move(outputs));
  work->setSlots(comm_->maxGroupSize());
  work->setOnStream(so, stream, on);
  try {
    // The queued task is the host's only part: it waits for the op's end on the stream and
    // checks it (a dead peer, a mismatch), in issue order with the group's other ops.
    inputs.push_back(on);
    auto id = queue_->submit(name, [work, so, ctx = ectx_, name, held = std::move(inputs)]() {
      std::exception_ptr err;
      try {
        so->wait();
      } catch (...) {
        err = translateError(*ctx, name, std::current_exception());
      }
      (void)held;  // (released with the task, after the op ended)
      return MooncakeWork::completion(work, err);
    });
    work->setQueued(queue_, id);
  } catch (...) {
    std::rethrow_exception(translateError(*ectx_, name, std::current_exception()));
  }
  track(work);
  return work;
}

// Sends of host memory up to this size run on the caller's thread (ProcessGroupMooncake::p2p).
constexpr size_t kInlineSendBytes = size_t{64} << 10;

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::p2p(const Check& ck, OpType type,
                                                         const char* op,
                                                         const P2pLanes::Key& lane,
                                                         std::vector<Tensor> outputs,
                                                         std::function<void(MooncakeWork&)> body) {
  const size_t bytes = outputs.empty() ? 0 : nbytes(outputs[0]);
  auto work = c10::make_intrusive<MooncakeWork>(rank_, type, op, ectx_, std::move(outputs));
  work->setSlots(comm_->maxGroupSize());
  std::shared_ptr<const StreamFence> f = fence(ck);
  // A small send of host memory runs on the calling thread when its lane is idle: it is eager
  // (into the peer's mailbox or a staging buffer, pg/p2p.h), and handing it to a lane thread
  // and its completion back to a waiter cost two thread wake-ups, more than the send itself.
  const bool run_here = type == OpType::SEND && f == nullptr && bytes <= kInlineSendBytes;
  // The lane task keeps the communicator alive: a recv may outlive this object.
  auto task = [work, body = std::move(body), comm = comm_, ctx = ectx_, op, f,
               timeout = opts_.timeout]() {
    std::exception_ptr err;
    try {
      if (f) f->wait(op, timeout);
      at::NoGradGuard no_grad;
      body(*work);
    } catch (const pg::PeerFailure& f) {
      work->setEvidence(f.hint());
    } catch (...) {
      err = translateError(*ctx, op, std::current_exception());
    }
    return MooncakeWork::completion(work, err);
  };
  if (!run_here || !lanes_->runInline(lane, task)) lanes_->post(lane, std::move(task));
  track(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::streamP2p(
    OpType type, const char* op, const P2pLanes::Key& lane, const Tensor& t,
    const std::function<std::shared_ptr<pg::Communicator::StreamOp>(const void*)>& queue) {
  const void* stream = nullptr;
  std::shared_ptr<pg::Communicator::StreamOp> so = queueOnStream(op, t, queue, &stream);
  if (!so) return {};
  auto work = c10::make_intrusive<MooncakeWork>(rank_, type, op, ectx_, std::vector<Tensor>{t});
  work->setSlots(comm_->maxGroupSize());
  if (type != OpType::SEND) work->setSourceRank(std::get<0>(lane));
  // The op runs on a stream of its own, never the caller's: wait() always orders the caller's
  // stream after it (a tag that no stream handle equals).
  static const char kOwnStream = 0;
  work->setOnStream(so, &kOwnStream, t);
  // The lane's task is the host's only part: it waits for the op's end and checks it.
  lanes_->post(lane, [work, so, comm = comm_, ctx = ectx_, op]() {
    std::exception_ptr err;
    try {
      so->wait();
    } catch (...) {
      err = translateError(*ctx, op, std::current_exception());
    }
    return MooncakeWork::completion(work, err);
  });
  track(work);
  return work;
}

void ProcessGroupMooncake::track(const c10::intrusive_ptr<MooncakeWork>& work) {
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  if (coalescing_) coalesced_.push_back(work);
}

// ---------------------------------------------------------------------------------------
// Collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::broadcast(std::vector<Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  Check ck = check("broadcast");
  const int n = size_;
  ck.single(tensors, "tensor");
  ck.rank(opts.rootRank, n, "root rank");
  if (opts.rootTensor != 0) ck.fail("rootTensor must be 0 (one tensor per process)");
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  int root = static_cast<int>(opts.rootRank);
  if (onGpu(t)) {
    auto w = streamCollective(OpType::BROADCAST, "broadcast", t, {t}, [&](const void* st) {
      return c->broadcastOnStream(t.data_ptr(), nbytes(t), root, st);
    });
    if (w) return w;
  }
  return collective(ck, OpType::BROADCAST, "broadcast", tensors, [c, t, root, me = rank_] {
    Staged s = Staged::in(t);
    c->broadcast(s.data(), s.bytes(), root);
    // The root's data did not change: no copy back (its tensor may be one that cannot be
    // written, e.g. an expand()ed one, which used to fail the root's broadcast after the fact).
    if (me != root) s.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::allreduce(std::vector<Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  Check ck = check("allreduce");
  ck.single(tensors, "tensor");
  auto [dt, op] = ck.reduction(tensors[0], opts.reduceOp);
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  if (onGpu(t)) {
    auto w = streamCollective(OpType::ALLREDUCE, "allreduce", t, {t}, [&](const void* st) {
      return c->allReduceOnStream(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                                  dt, op, st);
    });
    if (w) return w;
  }
  return collective(ck, OpType::ALLREDUCE, "allreduce", tensors, [c, t, dt = dt, op = op] {
    Staged s = Staged::in(t);
    c->allReduce(s.data(), s.data(), static_cast<size_t>(t.numel()), dt, op);
    s.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::reduce(std::vector<Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  Check ck = check("reduce");
  const int n = size_;
  ck.single(tensors, "tensor");
  ck.rank(opts.rootRank, n, "root rank");
  if (opts.rootTensor != 0) ck.fail("rootTensor must be 0 (one tensor per process)");
  auto [dt, op] = ck.reduction(tensors[0], opts.reduceOp);
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  int root = static_cast<int>(opts.rootRank);
  if (onGpu(t)) {
    auto w = streamCollective(OpType::REDUCE, "reduce", t, {t}, [&](const void* st) {
      return c->reduceOnStream(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), dt,
                               op, root, st);
    });
    if (w) return w;
  }
  return collective(ck, OpType::REDUCE, "reduce", tensors, [c, t, dt = dt, op = op, root] {
    Staged s = Staged::in(t);
    c->reduce(s.data(), s.data(), static_cast<size_t>(t.numel()), dt, op, root);
    s.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::allgather(
    std::vector<std::vector<Tensor>>& outputs, std::vector<Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  Check ck = check("allgather");
  const int n = size_;
  ck.single(inputs, "input");
  if (outputs.size() != 1) ck.fail("expects one output list per process");
  if (static_cast<int>(outputs[0].size()) != n) {
    ck.fail("output list has " + std::to_string(outputs[0].size()) + " tensors for a group of " +
            std::to_string(n));
  }
  ck.tensors(outputs[0], "output");
  for (int i = 0; i < n; ++i)
    ck.like(outputs[0][i], inputs[0], "output[" + std::to_string(i) + "]");
  pg::Communicator* c = comm_.get();
  Tensor in = inputs[0];
  std::vector<Tensor> outs = outputs[0];
  if (onGpu(in) && onGpu(outs)) {
    auto w = streamCollective(OpType::ALLGATHER, "allgather", in, outs, [&](const void* st) {
      return c->allGatherOnStream(in.data_ptr(), dataPtrs(outs), nbytes(in), st);
    });
    if (w) return w;
  }
  return collective(ck, OpType::ALLGATHER, "allgather", outs, [c, in, outs, sc = scratch_]() mutable {
    Staged s = Staged::in(in);
    const size_t b = s.bytes();
    uint8_t* p = sc->get(1, b * outs.size());
    c->allGather(s.data(), p, b, static_cast<int>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) unpackBytes(p + i * b, outs[i]);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::_allgather_base(
    Tensor& output, Tensor& input, const c10d::AllgatherOptions&) {
  Check ck = check("_allgather_base");
  const int n = size_;
  ck.gatherPair(output, input, n, "");
  pg::Communicator* c = comm_.get();
  Tensor in = input, out = output;
  if (onGpu(in) && onGpu(out)) {
    auto w = streamCollective(OpType::_ALLGATHER_BASE, "_allgather_base", out, {output},
                              [&](const void* st) {
                                return c->allGatherOnStream(in.data_ptr(), out.data_ptr(),
                                                            nbytes(in), st);
                              }, {in});
    if (w) return w;
  }
  return collective(ck, OpType::_ALLGATHER_BASE, "_allgather_base", {output}, [c, in, out, n] {
    Staged si = Staged::in(in), so = Staged::out(out);
    c->allGather(si.data(), so.data(), si.bytes(), n);
    so.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::gather(
    std::vector<std::vector<Tensor>>& outputs, std::vector<Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  Check ck = check("gather");
  const int n = size_;
  ck.single(inputs, "input");
  ck.rank(opts.rootRank, n, "root rank");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<Tensor> outs;
  if (rank_ == root) {
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != n) {
      ck.fail("the root expects one output list of " + std::to_string(n) + " tensors");
    }
    ck.tensors(outputs[0], "output");
    for (int i = 0; i < n; ++i)
      ck.like(outputs[0][i], inputs[0], "output[" + std::to_string(i) + "]");
    outs = outputs[0];
  } else if (!outputs.empty() && !(outputs.size() == 1 && outputs[0].empty())) {
    ck.fail("non-root ranks must pass no output tensors");
  }
  pg::Communicator* c = comm_.get();
  Tensor in = inputs[0];
  // Every rank decides by its input (the root's outputs must then be on its device too).
  if (onGpu(in)) {
    auto w = streamCollective(OpType::GATHER, "gather", in, outs, [&](const void* st) {
      return c->gatherOnStream(in.data_ptr(), dataPtrs(outs), nbytes(in), root, st);
    });
    if (w) return w;
  }
  return collective(ck, OpType::GATHER, "gather", outs,
                    [c, in, outs, root, n, sc = scratch_]() mutable {
                      Staged s = Staged::in(in);
                      const size_t b = s.bytes();
                      uint8_t* p = outs.empty() ? nullptr : sc->get(1, b * n);
                      c->gather(s.data(), p, b, root, n);
                      if (outs.empty()) return;
                      for (int i = 0; i < n; ++i) unpackBytes(p + i * b, outs[i]);
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::scatter(
    std::vector<Tensor>& outputs, std::vector<std::vector<Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  Check ck = check("scatter");
  const int n = size_;
  ck.single(outputs, "output");
  ck.rank(opts.rootRank, n, "root rank");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<Tensor> ins;
  if (rank_ == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != n) {
      ck.fail("the root expects one input list of " + std::to_string(n) + " tensors");
    }
    ck.tensors(inputs[0], "input");
    for (int i = 0; i < n; ++i)
      ck.like(inputs[0][i], outputs[0], "input[" + std::to_string(i) + "]");
    ins = inputs[0];
  } else if (!inputs.empty() && !(inputs.size() == 1 && inputs[0].empty())) {
    ck.fail("non-root ranks must pass no input tensors");
  }
  pg::Communicator* c = comm_.get();
  Tensor out = outputs[0];
  // Every rank decides by its output (the root's inputs must then be on its device too).
  if (onGpu(out)) {
    auto w = streamCollective(OpType::SCATTER, "scatter", out, {out}, [&](const void* st) {
      return c->scatterOnStream(constPtrs(ins), out.data_ptr(), nbytes(out), root, st);
    }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::SCATTER, "scatter", outputs, [c, ins, out, root, n, sc = scratch_] {
    uint8_t* p = nullptr;
    if (!ins.empty()) {
      p = sc->get(0, totalBytes(ins));
      packBytes(p, ins);
    }
    Staged so = Staged::out(out);
    c->scatter(p, so.data(), so.bytes(), root, n);
    so.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::reduce_scatter(
    std::vector<Tensor>& outputs, std::vector<std::vector<Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  Check ck = check("reduce_scatter");
  const int n = size_;
  ck.single(outputs, "output");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != n) {
    ck.fail("expects one input list of " + std::to_string(n) + " tensors");
  }
  ck.tensors(inputs[0], "input");
  for (int i = 0; i < n; ++i)
    ck.like(inputs[0][i], outputs[0], "input[" + std::to_string(i) + "]");
  auto [dt, op] = ck.reduction(outputs[0], opts.reduceOp);
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ins = inputs[0];
  Tensor out = outputs[0];
  if (onGpu(out) && onGpu(ins)) {
    auto w = streamCollective(OpType::REDUCE_SCATTER, "reduce_scatter", out, {out},
                              [&](const void* st) {
                                return c->reduceScatterOnStream(constPtrs(ins), out.data_ptr(),
                                                                static_cast<size_t>(out.numel()),
                                                                dt, op, st);
                              }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::REDUCE_SCATTER, "reduce_scatter", outputs,
                    [c, ins, out, dt = dt, op = op, sc = scratch_] {
                      uint8_t* p = sc->get(0, totalBytes(ins));
                      packBytes(p, ins);
                      Staged so = Staged::out(out);
                      c->reduceScatter(p, so.data(), static_cast<size_t>(out.numel()), dt, op,
                                       static_cast<int>(ins.size()));
                      so.writeBack();
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::_reduce_scatter_base(
    Tensor& output, Tensor& input, const c10d::ReduceScatterOptions& opts) {
  Check ck = check("_reduce_scatter_base");
  const int n = size_;
  ck.scatterPair(output, input, n, "");
  auto [dt, op] = ck.reduction(output, opts.reduceOp);
  pg::Communicator* c = comm_.get();
  Tensor in = input, out = output;
  if (onGpu(in) && onGpu(out)) {
    auto w = streamCollective(
        OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", out, {output},
        [&](const void* st) {
          return c->reduceScatterOnStream(in.data_ptr(), out.data_ptr(),
                                          static_cast<size_t>(out.numel()), dt, op, st);
        }, {in});
    if (w) return w;
  }
  return collective(ck, OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", {output},
                    [c, in, out, n, dt = dt, op = op] {
                      Staged si = Staged::in(in), so = Staged::out(out);
                      c->reduceScatter(si.data(), so.data(), static_cast<size_t>(out.numel()), dt,
                                       op, n);
                      so.writeBack();
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::alltoall_base(
    Tensor& output, Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions&) {
  Check ck = check("alltoall_base");
  const int n = size_;
  ck.tensor(input, "input");
  ck.tensor(output, "output");
  ck.sameType(output, input, "output");
  std::vector<size_t> sb, so, rb, ro;
  splitBytes(ck, input, input_splits, n, "input", &sb, &so);
  splitBytes(ck, output, output_splits, n, "output", &rb, &ro);
  pg::Communicator* c = comm_.get();
  // In place (the output's memory is the input's, as gloo allows): the input is copied first,
  // at issue (on a GPU: on the current stream, which the op waits for).
  Tensor in = input.storage().is_alias_of(output.storage()) ? input.clone() : input;
  Tensor out = output;
  // Stream-ordered on GPU tensors: without splits as equal blocks, with splits after the ranks
  // agree on the sizes (a host wait until every rank issued it). Every rank must pass splits
  // or none (one that passes none while another passes some: a mismatch error).
  if (onGpu(in) && onGpu(out)) {
    const bool equal = input_splits.empty() && output_splits.empty() && nbytes(in) == nbytes(out);
    const int hint = gpuOrdinal(in);
    auto w = streamCollective(OpType::ALLTOALL_BASE, "alltoall_base", out, {output},
                              [&](const void* st) {
                                return equal ? c->allToAllOnStream(in.data_ptr(), out.data_ptr(),
                                                                   sb.empty() ? 0 : sb[0], st)
                                             : c->allToAllVOnStream(in.data_ptr(), sb, so,
                                                                    out.data_ptr(), rb, ro, st,
                                                                    hint);
                              }, {in});
    if (w) return w;
  }
  return collective(ck, OpType::ALLTOALL_BASE, "alltoall_base", {output}, [c, in, out, sb, so, rb, ro] {
    Staged si = Staged::in(in), sout = Staged::out(out);
    c->allToAllV(si.data(), sb, so, sout.data(), rb, ro);
    sout.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::alltoall(std::vector<Tensor>& outputs,
                                                              std::vector<Tensor>& inputs,
                                                              const c10d::AllToAllOptions&) {
  Check ck = check("alltoall");
  const int n = size_;
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n) {
    ck.fail("expects " + std::to_string(n) + " input and output tensors, got " +
            std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  ck.tensors(inputs, "input");
  ck.tensors(outputs, "output");
  for (int i = 0; i < n; ++i) {
    ck.sameType(inputs[i], inputs[0], "input[" + std::to_string(i) + "]");
    ck.sameType(outputs[i], inputs[0], "output[" + std::to_string(i) + "]");
  }
  std::vector<size_t> sb, rb, ro;
  size_t off = 0;
  for (const auto& t : inputs) sb.push_back(nbytes(t));
  for (const auto& t : outputs) {
    rb.push_back(nbytes(t));
    ro.push_back(off);
    off += nbytes(t);
  }
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ins = inputs, outs = outputs;
  if (onGpu(ins) && onGpu(outs)) {  // (as alltoall_base with splits: the sizes agreed first)
    const int hint = gpuOrdinal(ins[0]);
    auto w = streamCollective(OpType::ALLTOALL, "alltoall", ins[0], outs, [&](const void* st) {
      return c->allToAllVOnStream(constPtrs(ins), sb, dataPtrs(outs), rb, st, hint);
    }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::ALLTOALL, "alltoall", outputs,
                    [c, ins, outs, sb, rb, ro, off, sc = scratch_]() mutable {
                      std::vector<size_t> so;
                      uint8_t* packed = sc->get(0, totalBytes(ins));
                      packBytes(packed, ins, &so);
                      uint8_t* p = sc->get(1, off);
                      c->allToAllV(packed, sb, so, p, rb, ro);
                      for (size_t i = 0; i < outs.size(); ++i) unpackBytes(p + ro[i], outs[i]);
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::barrier(const c10d::BarrierOptions&) {
  Check ck(who(), "barrier");
  pg::Communicator* c = comm_.get();
  return collective(ck, OpType::BARRIER, "barrier", {}, [c] { c->barrier(); });
}

// ---------------------------------------------------------------------------------------
// Point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::send(std::vector<Tensor>& tensors, int dst,
                                                          int tag) {
  Check ck(who(), "send");
  ck.single(tensors, "tensor");
  // Elastic groups: any rank slot (a p2p op with an inactive slot completes with
  // local_success false and the slot in its failed_ranks_hint, as upstream's).
  ck.rank(dst, comm_->maxGroupSize(), "destination rank");
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  if (onGpu(t)) {
    auto w = streamP2p(OpType::SEND, "send", {dst, tag, 0}, t, [&](const void* st) {
      return c->sendOnStream(t.data_ptr(), nbytes(t), dst,
                             static_cast<uint64_t>(static_cast<int64_t>(tag)), st, gpuOrdinal(t));
    });
    if (w) return w;
  }
  return p2p(ck, OpType::SEND, "send", {dst, tag, 0}, tensors, [c, t, dst, tag](MooncakeWork&) {
    Staged s = Staged::in(t);
    c->send(s.data(), s.bytes(), dst, static_cast<uint64_t>(static_cast<int64_t>(tag)));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::recv(std::vector<Tensor>& tensors, int src,
                                                          int tag) {
  Check ck(who(), "recv");
  ck.single(tensors, "tensor");
  ck.rank(src, comm_->maxGroupSize(), "source rank");
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  if (onGpu(t)) {
    auto w = streamP2p(OpType::RECV, "recv", {src, tag, 1}, t, [&](const void* st) {
      return c->recvOnStream(t.data_ptr(), nbytes(t), src,
                             static_cast<uint64_t>(static_cast<int64_t>(tag)), st, gpuOrdinal(t));
    });
    if (w) return w;
  }
  return p2p(ck, OpType::RECV, "recv", {src, tag, 1}, tensors, [c, t, src, tag](MooncakeWork& w) {
    Staged s = Staged::out(t);
    w.setSourceRank(
        c->recv(s.data(), s.bytes(), src, static_cast<uint64_t>(static_cast<int64_t>(tag))));
    s.writeBack();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::recvAnysource(std::vector<Tensor>& tensors,
                                                                   int tag) {
  Check ck(who(), "recvAnysource");
  ck.single(tensors, "tensor");
  pg::Communicator* c = comm_.get();
  Tensor t = tensors[0];
  return p2p(ck,
      OpType::RECVANYSOURCE, "recvAnysource", {-1, tag, 1}, tensors, [c, t, tag](MooncakeWork& w) {
        Staged s = Staged::out(t);
        w.setSourceRank(
            c->recv(s.data(), s.bytes(), -1, static_cast<uint64_t>(static_cast<int64_t>(tag))));
        s.writeBack();
      });
}

}  // namespace mooncake::torch_ext
