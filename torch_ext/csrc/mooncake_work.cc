// MooncakeWork: the c10d Work of the mooncake backend (torch_ext/csrc/process_group.h):
// waiting runs the op on the caller when nobody has yet, futures, joined works of coalesced ops.
#include <ATen/ATen.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "engine/log.h"
#include "engine/params.h"
#include "torch_ext/csrc/convert.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/process_group.h"

namespace mooncake::torch_ext {

using at::Tensor;

// ---------------------------------------------------------------------------------------
// MooncakeWork

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, const char* op,
                           std::shared_ptr<const ErrorContext> ctx, std::vector<Tensor> outputs)
    : c10d::Work(rank, type), op_(op), ctx_(std::move(ctx)), outputs_(std::move(outputs)) {
  // A future holding CUDA tensors must name their devices (torch's Future then orders its
  // consumers' streams after the completing thread's); host tensors need none.
  for (const Tensor& t : outputs_) noteCudaDevice(t, &devices_);
}

MooncakeWork::~MooncakeWork() {
  // Never completed (it cannot happen: every op completes; a safeguard): no stream waits on.
  if (gate_) engine::device::openGate(*gate_);
}

bool MooncakeWork::wait(std::chrono::milliseconds timeout) {
  if (!devices_.empty() && timeout == kNoTimeout && waitOnStreams()) return true;
  // A plain wait runs the op here (with any earlier ones still pending) unless the worker has
  // the queue; a timed wait keeps its bound and gives the queue to the worker (op_queue.h).
  if (queue_ && !isCompleted()) {
    if (timeout == kNoTimeout) queue_->runUpTo(queue_id_);
    else queue_->handOff();
  }
  std::unique_lock lk(mutex_);
  if (timeout == kNoTimeout) {
    // A callback on the group's completion thread waiting on a Work of the group: the
    // completions queued before this one's would wait for it; they run here meanwhile.
    while (!completed_ && queue_) {
      lk.unlock();
      const bool helped = queue_->helpCompletions();
      lk.lock();
      if (!helped) break;
    }
    while (!completed_ && queue_ && queue_->onCompletionThread()) {
      cv_.wait_for(lk, std::chrono::milliseconds(1), [&] { return completed_; });
      lk.unlock();
      queue_->helpCompletions();
      lk.lock();
    }
    cv_.wait(lk, [&] { return completed_; });
  } else if (!cv_.wait_for(lk, timeout, [&] { return completed_; })) {
    std::rethrow_exception(backendError(ctx_->who + ": " + op_ + ": Work.wait timed out after " +
                                        std::to_string(timeout.count()) + " ms (the op goes on)"));
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

bool MooncakeWork::waitOnStreams() {
  if (stream_op_) {
    {
      std::lock_guard lk(mutex_);
      if (completed_ && exception_) std::rethrow_exception(exception_);
    }
    for (const c10::Device& d : devices_) {
      auto s = currentStream(d);
      if (!s || *s == issue_stream_) continue;
      Status st = stream_op_->orderAfter(*s);
      if (!st.ok())
        std::rethrow_exception(backendError(ctx_->who + ": " + op_ +
                                            ": ordering the current stream after the op: " +
                                            st.toString()));
    }
    return true;
  }
  static const bool blocking = params::getBool("MC_PG_BLOCKING_WAIT");
  if (blocking) return false;
  engine::device::Gate gate;
  {
    std::lock_guard lk(mutex_);
    if (ready_) {  // its copies are done: the outputs are there for any stream
      if (ready_error_) std::rethrow_exception(ready_error_);
      return true;
    }
    if (!gate_) {
      auto g = engine::device::acquireGate();
      if (!g.ok()) return false;
      gate_ = *g;
    }
    gate = *gate_;
  }
  if (!streamWaitGate(devices_, gate)) return false;
  // Nobody runs the op on this thread now: the worker takes it (op_queue.h).
  if (queue_) queue_->handOff();
  return true;
}

void MooncakeWork::markFuture(const FuturePtr& f, std::exception_ptr e) {
  if (e) {
    f->setError(e);
  } else {
    f->markCompleted(c10::IValue(outputs_));
  }
}

void MooncakeWork::markResult(const FuturePtr& f, std::exception_ptr e) {
#if MC_TORCH_HAS_WORK_RESULT
  const auto r = e ? c10d::WorkResult::COMM_ERROR : c10d::WorkResult::SUCCESS;
  f->markCompleted(c10::IValue(static_cast<int64_t>(r)));
#else
  (void)f;
  (void)e;
#endif
}

MooncakeWork::FuturePtr MooncakeWork::lazyFuture(FuturePtr MooncakeWork::*slot,
                                                 const c10::TypePtr& type, bool result) {
  std::unique_lock lk(mutex_);
  if (this->*slot) return this->*slot;
  this->*slot = result ? c10::make_intrusive<c10::ivalue::Future>(type)
                       : c10::make_intrusive<c10::ivalue::Future>(type, devices_);
  FuturePtr f = this->*slot;
  const bool done = completed_;
  std::exception_ptr e = exception_;
  lk.unlock();
  if (done) {  // complete() ran before the future existed
    if (result) {
      markResult(f, e);
    } else {
      markFuture(f, e);
    }
  }
  return f;
}

c10::intrusive_ptr<c10::ivalue::Future> MooncakeWork::getFuture() {
  static const auto type = c10::ListType::create(c10::TensorType::get());
  return lazyFuture(&MooncakeWork::future_, type, /*result=*/false);
}

#if MC_TORCH_HAS_WORK_RESULT
c10::intrusive_ptr<c10::ivalue::Future> MooncakeWork::getFutureResult() {
  return lazyFuture(&MooncakeWork::result_future_, c10::IntType::get(), /*result=*/true);
}
#endif

std::vector<Tensor> MooncakeWork::result() { return outputs_; }

int MooncakeWork::sourceRank() const { return source_rank_.load(); }

void MooncakeWork::setEvidence(std::vector<uint8_t> hint) {
  std::lock_guard lk(mutex_);
  local_success_ = false;
  hint_ = std::move(hint);
}

bool MooncakeWork::localSuccess() const {
  std::lock_guard lk(mutex_);
  return local_success_;
}

std::vector<uint8_t> MooncakeWork::failedRanksHint() const {
  std::lock_guard lk(mutex_);
  std::vector<uint8_t> h = hint_;
  h.resize(static_cast<size_t>(slots_), 0);
  return h;
}

std::function<void()> MooncakeWork::completion(const c10::intrusive_ptr<MooncakeWork>& work,
                                               std::exception_ptr error) {
  bool has_future;
  {
    std::lock_guard lk(work->mutex_);
    has_future = work->future_ || work->result_future_;
  }
  // No future yet: no callback runs inside complete() (a future created later is marked by
  // its creator, lazyFuture), so it completes here, at once.
  if (!has_future) {
    work->complete(error);
    return nullptr;
  }
  return [work, error] { work->complete(error); };
}

void MooncakeWork::complete(std::exception_ptr error) {
  // The outputs are in place: streams that wait go on first, before any future's callback
  // runs here (one that synchronises with such a stream would otherwise wait forever). They go
  // on after a failure too: the error stays with the Work, its future and the log.
  std::optional<engine::device::Gate> gate;
  {
    std::lock_guard lk(mutex_);
    ready_ = true;
    ready_error_ = error;
    gate = gate_;
    gate_.reset();
  }
  if (gate) {
    if (error) {
      MC_LOG(WARN, PG) << ctx_->who << ": " << op_ << " failed after Work.wait() had queued "
                       << "the CUDA streams' wait; they go on with its outputs unfinished";
    }
    engine::device::openGate(*gate);
  }
  // Futures that exist are completed before the Work, so whoever returns from wait() can
  // read them; one created concurrently (at most once each) is caught by the next round.
  FuturePtr marked_f, marked_r;
  for (;;) {
    FuturePtr f, r;
    {
      std::lock_guard lk(mutex_);
      if (future_ == marked_f && result_future_ == marked_r) {
        completed_ = true;
        exception_ = error;
        break;
      }
      f = future_;
      r = result_future_;
    }
    if (f && f != marked_f) markFuture(f, error);
    if (r && r != marked_r) markResult(r, error);
    marked_f = f;
    marked_r = r;
  }
  cv_.notify_all();
}

c10::intrusive_ptr<MooncakeWork> MooncakeWork::joinAll(
    int rank, c10d::OpType type, const char* op, std::shared_ptr<const ErrorContext> ctx,
    std::vector<c10::intrusive_ptr<MooncakeWork>> works) {
  std::vector<Tensor> outputs;
  for (const auto& w : works) {
    for (auto& t : w->outputs_) outputs.push_back(t);
  }
  auto joined = c10::make_intrusive<MooncakeWork>(rank, type, op, std::move(ctx), outputs);
  if (works.empty()) {
    joined->complete(nullptr);
    return joined;
  }
  // Every part stream-ordered (batch_isend_irecv's sends and recvs, on CUDA through torch's
  // coalescing manager): waiting on the join orders the caller's stream after each part, as
  // waiting on each would, instead of blocking the host.
  bool all_on_streams = true;
  for (const auto& w : works) all_on_streams = all_on_streams && w->stream_op_ != nullptr;
  if (all_on_streams) {
    struct Joint final : pg::Communicator::StreamOp {
      std::vector<std::pair<std::shared_ptr<pg::Communicator::StreamOp>, const void*>> parts;
      void wait() override {}  // (each part's own Work waits for it)
      Status orderAfter(const void* stream) override {
        for (auto& [part, issued_on] : parts) {
          if (stream == issued_on) continue;
          Status st = part->orderAfter(stream);
          if (!st.ok()) return st;
        }
        return Status::OK();
      }
    };
    auto joint = std::make_shared<Joint>();
    for (const auto& w : works) joint->parts.emplace_back(w->stream_op_, w->issue_stream_);
    static const char kJointTag = 0;  // no stream's handle: waitOnStreams always orders
    joined->stream_op_ = std::move(joint);
    joined->issue_stream_ = &kJointTag;
  }
  struct Join {
    std::mutex mu;
    size_t left;
    std::exception_ptr first_error;
    bool peers_failed = false;  // some part failed for peers (elastic): its evidence, merged
    std::vector<uint8_t> hint;
  };
  auto join = std::make_shared<Join>();
  join->left = works.size();
  for (const auto& w : works) joined->slots_ = std::max(joined->slots_, w->slots_);
  for (const auto& w : works) {
    // Runs on the thread that completes w (or here, when it already has): w is alive then.
    MooncakeWork* part = w.get();
    w->getFuture()->addCallback([joined, join, part](c10::ivalue::Future& f) {
      std::exception_ptr done_error;
      bool peers_failed;
      std::vector<uint8_t> hint;
      {
        std::lock_guard<std::mutex> lk(join->mu);
        if (f.hasError() && !join->first_error) join->first_error = f.exception_ptr();
        if (!part->localSuccess()) {  // elastic: a part's evidence is the join's too
          join->peers_failed = true;
          const std::vector<uint8_t> h = part->failedRanksHint();
          if (join->hint.size() < h.size()) join->hint.resize(h.size(), 0);
          for (size_t i = 0; i < h.size(); ++i) join->hint[i] |= h[i];
        }
        if (--join->left != 0) return;
        done_error = join->first_error;
        peers_failed = join->peers_failed;
        hint = join->hint;
      }
      if (peers_failed) joined->setEvidence(std::move(hint));
      joined->complete(done_error);
    });
    // Waiting on the join runs the collectives among them like waiting on the last one would.
    if (w->queue_ && (!joined->queue_ || w->queue_id_ > joined->queue_id_))
      joined->setQueued(w->queue_, w->queue_id_);
  }
  return joined;
}

}  // namespace mooncake::torch_ext
