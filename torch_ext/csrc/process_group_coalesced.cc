// The coalesced collectives of the torch backend (ProcessGroupMooncake, process_group.h): a
// list of tensors in one call, and the ops issued between startCoalescing and endCoalescing.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/log.h"
#include "mooncake/config.h"
#include "torch_ext/csrc/convert.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/process_group.h"

namespace mooncake::torch_ext {

Check ProcessGroupMooncake::check(const char* op) {
  Check ck(who(), op);
  ck.on_fail = [this, op](const Check& c, const std::string& why) { refuse(c, op, why); };
  return ck;
}

// A check of this rank's arguments failed: the op is not run here, but the peers called it.
// The communicator takes its number in issue order and tells them (they raise too, then every
// rank realigns). Ops that would be stream-ordered number theirs apart: only host ones here.
void ProcessGroupMooncake::refuse(const Check& ck, const char* op, const std::string& why) {
  if (MC_HAVE_CUDA && (!ck.sawCpu() || !ck.cudaDevices().empty())) return;
  try {
    pg::Communicator* c = comm_.get();
    queue_->submit(op, [c, op, why]() -> std::function<void()> {
      try {
        c->reject(op, why);
      } catch (const std::exception& e) {
        MC_LOG(WARN, PG) << "telling the peers of a refused " << op << " failed: " << e.what();
      }
      return {};
    });
    queue_->handOff();
  } catch (...) {  // a closed queue: nothing to tell
  }
}

using at::Tensor;
using c10d::OpType;
using StreamOp = pg::Communicator::StreamOp;

namespace {

// Stream-ordered ops queued one after another on one stream, waited for as one.
struct StreamOpList final : StreamOp {
  std::vector<std::shared_ptr<StreamOp>> ops;
  std::exception_ptr error;  // why queueing the rest failed (thrown by wait())
  void wait() override {
    // Each op is waited for, in order (the communicator's rule), the first failure thrown.
    std::exception_ptr first = error;
    for (auto& o : ops) {
      try {
        o->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  // The last op ends last on the stream.
  Status orderAfter(const void* stream) override { return ops.back()->orderAfter(stream); }
};

// op(i) queued for every i in [0, n) but the empty ones (empty[i]) and joined; null when the
// first one queued is not stream-ordered (nothing is then queued: the call runs host-driven),
// or all are empty. An error once some are queued fails the group (the peers queued the rest
// and would wait for this rank) and goes into the list, which its Work's task waits for in
// issue order (the communicator's rule) before it throws the error.
std::shared_ptr<StreamOp> queueAll(pg::Communicator* c, const char* name,
                                   const std::vector<bool>& empty,
                                   const std::function<std::shared_ptr<StreamOp>(size_t)>& op) {
  auto list = std::make_shared<StreamOpList>();
  for (size_t i = 0; i < empty.size(); ++i) {
    if (empty[i]) continue;
    try {
      std::shared_ptr<StreamOp> o = op(i);
      if (!o && list->ops.empty()) return nullptr;
      if (!o)
        throw std::runtime_error("tensor " + std::to_string(i) +
                                 " could not take the stream-ordered path that the first took");
      list->ops.push_back(std::move(o));
    } catch (const std::exception& e) {
      if (list->ops.empty()) throw;
      list->error = std::current_exception();
      c->fail(name, "tensor " + std::to_string(i) + " of the list: " + e.what());
      return list;
    }
  }
  return list->ops.empty() ? nullptr : list;
}

std::vector<bool> emptyOnes(const std::vector<Tensor>& ts) {
  std::vector<bool> v;
  for (const auto& t : ts) v.push_back(t.numel() == 0);
  return v;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::allreduce_coalesced(
    std::vector<Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  Check ck(who(), "allreduce_coalesced");
  if (tensors.empty()) ck.fail("expects at least one tensor");
  ck.tensors(tensors, "tensors");
  for (size_t i = 1; i < tensors.size(); ++i)
    ck.sameType(tensors[i], tensors[0], "tensors[" + std::to_string(i) + "]");
  auto [dt, op] = ck.reduction(tensors[0], opts.reduceOp);
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ts = tensors;
  if (onGpu(ts)) {
    auto w = streamCollective(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", ts[0], ts,
                              [&](const void* st) {
                                return queueAll(c, "allreduce_coalesced", emptyOnes(ts),
                                                [&](size_t i) {
                                  return c->allReduceOnStream(
                                      ts[i].data_ptr(), ts[i].data_ptr(),
                                      static_cast<size_t>(ts[i].numel()), dt, op, st);
                                });
                              });
    if (w) return w;
  }
  return collective(ck, OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors,
                    [c, ts, dt = dt, op = op, sc = scratch_]() mutable {
                      std::vector<size_t> offs;
                      const size_t total = totalBytes(ts);
                      uint8_t* p = sc->get(0, total);
                      packBytes(p, ts, &offs);
                      c->allReduce(p, p, total / ts[0].element_size(), dt, op);
                      for (size_t i = 0; i < ts.size(); ++i) unpackBytes(p + offs[i], ts[i]);
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::allgather_coalesced(
    std::vector<std::vector<Tensor>>& outputs, std::vector<Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  Check ck(who(), "allgather_coalesced");
  const int n = size_;
  ck.tensors(inputs, "input");
  if (static_cast<int>(outputs.size()) != n) {
    ck.fail("expects one output list per rank (" + std::to_string(n) + "), got " +
            std::to_string(outputs.size()));
  }
  std::vector<Tensor> flat_outs;
  for (int r = 0; r < n; ++r) {
    if (outputs[r].size() != inputs.size()) {
      ck.fail("output list " + std::to_string(r) + " has " + std::to_string(outputs[r].size()) +
              " tensors, inputs have " + std::to_string(inputs.size()));
    }
    for (size_t j = 0; j < inputs.size(); ++j) {
      std::string name = "output[" + std::to_string(r) + "][" + std::to_string(j) + "]";
      ck.tensor(outputs[r][j], name);
      ck.like(outputs[r][j], inputs[j], name);
      flat_outs.push_back(outputs[r][j]);
    }
  }
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ins = inputs;
  if (onGpu(ins) && onGpu(flat_outs)) {
    auto w = streamCollective(
        OpType::ALLGATHER_COALESCED, "allgather_coalesced", ins[0], flat_outs,
        [&](const void* st) {
          return queueAll(c, "allgather_coalesced", emptyOnes(ins), [&](size_t j) {
            std::vector<void*> outs;
            for (int r = 0; r < n; ++r) outs.push_back(outputs[r][j].data_ptr());
            return c->allGatherOnStream(ins[j].data_ptr(), outs, nbytes(ins[j]), st);
          });
        }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::ALLGATHER_COALESCED, "allgather_coalesced", flat_outs,
                    [c, ins, flat_outs, n, sc = scratch_]() mutable {
                      std::vector<size_t> offs;
                      const size_t b = totalBytes(ins);
                      uint8_t* packed = sc->get(0, b);
                      packBytes(packed, ins, &offs);
                      uint8_t* p = sc->get(1, b * n);
                      c->allGather(packed, p, b, n);
                      for (size_t k = 0; k < flat_outs.size(); ++k) {
                        const size_t r = k / ins.size(), j = k % ins.size();
                        unpackBytes(p + r * b + offs[j], flat_outs[k]);
                      }
                    });
}

#if MC_TORCH_HAS_BACKEND
namespace {

// The parts of a coalesced call that runs one op per tensor: every part runs, even after one
// failed for peers (pg::PeerFailure, an elastic group), and the first such failure is
// rethrown at the end. Every rank then makes the same number of ops per Work, whichever part
// the failure hit on each (a failed view's skipped ops are counted per op: a rank that stopped
// at its first failed part fell out of step with one that failed a later part, for good).
template <typename Part>
void everyPart(size_t parts, Part part) {
  std::exception_ptr first;
  for (size_t i = 0; i < parts; ++i) {
    try {
      part(i);
    } catch (const pg::PeerFailure&) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::allgather_into_tensor_coalesced(
    std::vector<Tensor>& outputs, std::vector<Tensor>& inputs, const c10d::AllgatherOptions&) {
  Check ck(who(), "allgather_into_tensor_coalesced");
  if (outputs.size() != inputs.size()) {
    ck.fail(std::to_string(outputs.size()) + " outputs for " + std::to_string(inputs.size()) +
            " inputs");
  }
  // The group's size once: the outputs were checked for it, and the parts say so (blocks), so
  // a view that changes the size before they run fails them instead of writing past outputs.
  const int n = size_;
  for (size_t i = 0; i < inputs.size(); ++i)
    ck.gatherPair(outputs[i], inputs[i], n, "[" + std::to_string(i) + "]");
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ins = inputs, outs = outputs;
  if (onGpu(ins) && onGpu(outs)) {
    auto w = streamCollective(OpType::COALESCED, "allgather_into_tensor_coalesced", ins[0], outs,
                              [&](const void* st) {
                                return queueAll(c, "allgather_into_tensor_coalesced",
                                                emptyOnes(ins), [&](size_t i) {
                                  return c->allGatherOnStream(ins[i].data_ptr(),
                                                              outs[i].data_ptr(),
                                                              nbytes(ins[i]), st);
                                });
                              }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::COALESCED, "allgather_into_tensor_coalesced", outputs,
                    [c, ins, outs, n] {
                      everyPart(ins.size(), [&](size_t i) {
                        Staged si = Staged::in(ins[i]), so = Staged::out(outs[i]);
                        c->allGather(si.data(), so.data(), si.bytes(), n);
                        so.writeBack();
                      });
                    });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::reduce_scatter_tensor_coalesced(
    std::vector<Tensor>& outputs, std::vector<Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  Check ck(who(), "reduce_scatter_tensor_coalesced");
  if (outputs.size() != inputs.size()) {
    ck.fail(std::to_string(outputs.size()) + " outputs for " + std::to_string(inputs.size()) +
            " inputs");
  }
  std::vector<std::pair<pg::DataType, pg::ReduceOp>> types;
  const int n = size_;  // once, as allgather_into_tensor_coalesced's
  for (size_t i = 0; i < inputs.size(); ++i) {
    ck.scatterPair(outputs[i], inputs[i], n, "[" + std::to_string(i) + "]");
    types.push_back(ck.reduction(outputs[i], opts.reduceOp));
  }
  pg::Communicator* c = comm_.get();
  std::vector<Tensor> ins = inputs, outs = outputs;
  if (onGpu(ins) && onGpu(outs)) {
    auto w = streamCollective(OpType::COALESCED, "reduce_scatter_tensor_coalesced", ins[0], outs,
                              [&](const void* st) {
                                return queueAll(c, "reduce_scatter_tensor_coalesced",
                                                emptyOnes(outs), [&](size_t i) {
                                  return c->reduceScatterOnStream(
                                      ins[i].data_ptr(), outs[i].data_ptr(),
                                      static_cast<size_t>(outs[i].numel()), types[i].first,
                                      types[i].second, st);
                                });
                              }, ins);
    if (w) return w;
  }
  return collective(ck, OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs,
                    [c, ins, outs, types, n] {
                      everyPart(ins.size(), [&](size_t i) {
                        Staged si = Staged::in(ins[i]), so = Staged::out(outs[i]);
                        c->reduceScatter(si.data(), so.data(), static_cast<size_t>(outs[i].numel()),
                                         types[i].first, types[i].second, n);
                        so.writeBack();
                      });
                    });
}

void ProcessGroupMooncake::startCoalescing() {
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  // Still coalescing: the last block never ended. dist._coalescing_manager does not end a
  // block whose op raised (a refused tensor; its fast paths' one coalesced call at the exit);
  // its ops that were issued run and complete as usual, and the group coalesces again. (A
  // nested manager fails in torch, which pops the group's op list twice.)
  if (coalescing_) {
    MC_LOG(WARN, PG) << who() << ": startCoalescing: the previous coalescing block did not end "
                     << "(an op in it raised); its " << coalesced_.size()
                     << " issued op(s) complete on their own";
  }
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMooncake::endCoalescing() {
  std::vector<c10::intrusive_ptr<MooncakeWork>> works;
  {
    std::lock_guard<std::mutex> lk(coalesce_mu_);
    if (!coalescing_) {
      throw std::invalid_argument(who() + ": endCoalescing without startCoalescing");
    }
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return MooncakeWork::joinAll(rank_, OpType::COALESCED, "coalesced", ectx_, std::move(works));
}
#endif  // MC_TORCH_HAS_BACKEND

}  // namespace mooncake::torch_ext
