// Python API of expert parallelism: mooncake._C.EpBuffer (wrapped by mooncake/ep.py).
// Converts tensors to the raw pointers and shapes of ep::EpBuffer, keeps every tensor alive
// until the operation that uses it has finished, and maps errors (std::invalid_argument ->
// ValueError, anything else -> RuntimeError). No algorithm lives here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <optional>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/device/device.h"
#include "ep/buffer.h"
#include "ep/layout.h"
#include "torch_ext/csrc/compat.h"
#include "torch_ext/csrc/ep_events.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/process_group.h"
#include "torch_ext/csrc/tensor_pool.h"

namespace py = pybind11;

namespace mooncake::torch_ext {

namespace {

using at::Tensor;

template <typename... A>
[[noreturn]] void bad(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  throw std::invalid_argument(os.str());
}

std::string shapeOf(const Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

ep::DType hiddenType(const Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return ep::DType::kBFloat16;
  if (t.scalar_type() == at::kFloat) return ep::DType::kFloat32;
  bad(op, ": ", name, " must be bfloat16 or float32, got ", t.scalar_type());
}

at::ScalarType scalarOf(ep::DType t) {
  return t == ep::DType::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

// The dtype of fp8 dispatch's recv_x: e4m3fn, or its bytes where torch has no fp8 type.
constexpr at::ScalarType kFp8Scalar =
#if MC_TORCH_HAS_FP8
    at::kFloat8_e4m3fn;
#else
    at::kByte;
#endif

// A CPU tensor of `dtype` with `dims` dimensions, contiguous (copied if needed).
Tensor input(const Tensor& t, at::ScalarType dtype, int64_t dims, const char* op,
             const char* name) {
  if (!t.defined()) bad(op, ": ", name, " is undefined");
  if (!t.device().is_cpu() || (engine::device::active() && onGpu(t)))
    bad(op, ": ", name, " must be a CPU tensor in host memory (a buffer made without device= and "
        "normal mode take those)");
  if (t.scalar_type() != dtype) bad(op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  if (t.dim() != dims) bad(op, ": ", name, " must be ", dims, "-D, got shape ", shapeOf(t));
  return t.contiguous();
}

// active_ranks is written in place: it must be the caller's own contiguous int32 [R].
void checkActive(const Tensor& a, int world, const char* op) {
  if (!a.defined() || !a.device().is_cpu() || a.scalar_type() != at::kInt || a.dim() != 1 ||
      a.size(0) != world || !a.is_contiguous())
    bad(op, ": active_ranks must be a contiguous CPU int32 tensor of shape [", world, "], got ",
        a.defined() ? shapeOf(a) : std::string("undefined"));
}

// Runs on the buffer's ordering; keeps `keep` (tensors) alive until the task ran.
struct Keep {
  std::vector<Tensor> tensors;
};

using ep_py::callerStream;
using ep_py::refuseCapture;
using ep_py::dropBuffer;
using ep_py::PyEvent;
using ep_py::PyHook;

class PyEpBuffer {
 public:
  // device: -1 for a host buffer, else the ordinal of the engine's device layer that holds it
  // (ep/buffer.h, "Device mode"); cuda: the caller asked for CUDA (the layer must be CUDA's).
  // min_size: EpGroup::min_size (update_ep_member passes the size the buffer had).
  PyEpBuffer(c10::intrusive_ptr<ProcessGroupMooncake> pg, int64_t bytes, bool disable_p2p,
             int64_t device, bool cuda, int64_t min_size)
      : pg_(std::move(pg)), device_(static_cast<int>(device)) {
    if (!pg_) bad("ep.Buffer: group is None");
    if (bytes <= 0) bad("ep.Buffer: num_ep_buffer_bytes must be positive, got ", bytes);
    if (device_ >= 0) {
      // (No layer, or no such device: the buffer's set-up reports it on every rank alike.)
      auto layer = engine::device::get();
      cuda_ = layer.ok() && std::string((*layer)->name()) == "cuda";
      if (cuda && layer.ok() && !cuda_)  // (a configuration every rank shares)
        bad("ep.Buffer(device='cuda'): ", cudaUnavailableReason());
    }
    // Non-owning view of the group's communicator that keeps the group alive.
    auto keep = pg_;
    std::shared_ptr<pg::Communicator> comm(&pg_->communicator(),
                                           [keep](pg::Communicator*) mutable { keep.reset(); });
    py::gil_scoped_release nogil;
    ep::EpGroup group = ep::groupOf(std::move(comm));
    group.min_size = static_cast<int>(std::max<int64_t>(0, min_size));
    buf_ = ep::EpBuffer::create(std::move(group), static_cast<size_t>(bytes),
                                disable_p2p, device_);
  }
  ~PyEpBuffer() { dropBuffer(buf_); }

  int rank() const { return buf_->rank(); }
  int size() const { return buf_->size(); }
  int64_t bytes() const { return static_cast<int64_t>(buf_->bytes()); }
  // What runs the calls: "cpu" (ep/buffer.cc's and normal.cc's loops) or "kernels on host"
  // (MC_EP_KERNELS=host or threads: the CUDA kernels' bodies on host lanes).
  // A GPU buffer: "kernels on <layer> device <n>".
  std::string lowLatencyExecutor() const {
    if (buf_->onDevice())
      return "kernels on " + std::string(cuda_ ? "cuda" : "sim") + " device " +
             std::to_string(device_) + (buf_->streamCalls() ? ", stream-ordered" : "");
    return buf_->kernelPath() ? "kernels on host" : "cpu";
  }
  int64_t device() const { return device_; }
  bool isMapped(int r) const {
    if (r < 0 || r >= buf_->size()) bad("is_mapped: rank ", r, " out of range");
    return buf_->isMapped(r);
  }

  using RoundKind = ep::EpBuffer::RoundKind;
  // A call that fails before it reserved its round (bad input) still takes the round and tells
  // the peers it gave up (ep/buffer.h, "Abandoned rounds"), so that their calls of the round
  // end at once and later rounds stay in step.
  void giveUp(RoundKind kind) {
    py::gil_scoped_release nogil;
    buf_->runSync([&] {
      uint32_t round;
      {
        std::lock_guard<std::mutex> g(mu_);
        round = kind == RoundKind::kDispatch ? buf_->nextDispatchRound() : buf_->nextCombineRound();
      }
      buf_->abandon(kind, round);
    });
  }
  // Armed at the top of a dispatch/combine; disarmed where the call reserves its round. An
  // exception that leaves the call while armed gives the round up.
  class RoundGuard {
   public:
    RoundGuard(PyEpBuffer* self, RoundKind kind) : self_(self), kind_(kind) {}
    ~RoundGuard() {
      if (!armed_ || std::uncaught_exceptions() == 0) return;
      try {
        self_->giveUp(kind_);
      } catch (...) {  // the caller's own error is what it must see
      }
    }
    void reserved() { armed_ = false; }

   private:
    PyEpBuffer* self_;
    RoundKind kind_;
    bool armed_ = true;
  };

  // An argument of a call: a CPU tensor for a host buffer (input()); for a GPU buffer a
  // contiguous tensor in GPU memory of the buffer's device (a CUDA tensor, or over the
  // simulation a tensor on the layer's memory).
  Tensor arg(const Tensor& t, at::ScalarType dtype, int64_t dims, const char* op,
             const char* name) const {
    if (device_ < 0) return input(t, dtype, dims, op, name);
    if (!t.defined()) bad(op, ": ", name, " is undefined");
    checkOnDevice(t, op, name);
    if (t.scalar_type() != dtype) bad(op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    if (t.dim() != dims) bad(op, ": ", name, " must be ", dims, "-D, got shape ", shapeOf(t));
    if (!t.is_contiguous()) bad(op, ": ", name, " must be contiguous (a GPU buffer's call)");
    return t;
  }
  void checkOnDevice(const Tensor& t, const char* op, const char* name) const {
    const char* where = cuda_ ? "a CUDA tensor" : "GPU memory of the device layer";
    if (t.numel() == 0) return;  // (its pointer is not read)
    if (!onGpu(t))
      bad(op, ": ", name, " must be ", where, " on device ", device_,
          " (this ep.Buffer is GPU memory), got a tensor on ", t.device());
    auto layer = engine::device::get();
    const engine::device::PointerInfo pi =
        layer.ok() ? (*layer)->pointer(t.data_ptr()) : engine::device::PointerInfo{};
    if (pi.device && pi.ordinal != device_)
      bad(op, ": ", name, " is on device ", pi.ordinal, ", this ep.Buffer on device ", device_);
  }
  void checkActiveArg(const Tensor& a, int world, const char* op) const {
    if (device_ < 0) return checkActive(a, world, op);
    if (!a.defined() || a.scalar_type() != at::kInt || a.dim() != 1 || a.size(0) != world ||
        !a.is_contiguous())
      bad(op, ": active_ranks must be a contiguous int32 tensor of shape [", world, "], got ",
          a.defined() ? shapeOf(a) : std::string("undefined"));
    checkOnDevice(a, op, "active_ranks");
  }
  // An output: from the pool (host buffer), or GPU memory of the buffer's device.
  Tensor output(int64_t n, std::vector<int64_t> rest, at::ScalarType dtype, bool slack) {
    if (device_ < 0) return pool_.get(n, std::move(rest), dtype, slack);
    std::vector<int64_t> shape{n};
    shape.insert(shape.end(), rest.begin(), rest.end());
    if (cuda_)
      return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    return deviceEmpty(shape, dtype, device_);
  }
  Tensor small(std::vector<int64_t> shape, at::ScalarType dtype) {
    if (device_ < 0) return at::empty(shape, at::TensorOptions().dtype(dtype));
    const int64_t n = shape[0];
    return output(n, std::vector<int64_t>(shape.begin() + 1, shape.end()), dtype, false);
  }
  // CUDA buffers: the call's inputs come from kernels queued on the caller's current stream;
  // before it reads them (its checks, its kernels) the call waits on the host for what was
  // queued there until now. Called on the caller's thread.
  void awaitCallerStream(const char* op, int64_t timeout_us) const {
    if (!cuda_) return;
    StreamFence fence(std::vector<c10::Device>{c10::Device(at::kCUDA, device_)});
    if (PyGILState_Check()) {  // (some callers hold the GIL here)
      py::gil_scoped_release nogil;
      fence.wait(op, timeoutOf(timeout_us));
    } else {
      fence.wait(op, timeoutOf(timeout_us));
    }
  }
  // A GPU buffer's argument read on the host (a host copy), or the tensor itself.
  Tensor hostOf(const Tensor& t, const char* op) const {
    if (device_ < 0) return t;
    Tensor h = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    copyBytes(h.data_ptr(), t.data_ptr(), h.numel() * h.element_size(), op);
    return h;
  }
  // A host tensor's copy in the GPU buffer's memory (the tensor itself for a host buffer).
  Tensor onDevice(const Tensor& h, const char* op) {
    if (device_ < 0) return h;
    std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
    Tensor d = small(shape, h.scalar_type());
    copyBytes(d.data_ptr(), h.data_ptr(), h.numel() * h.element_size(), op);
    return d;
  }

  py::tuple dispatch(const Tensor& x_in, const Tensor& topk_in, const Tensor& active, int64_t M,
                     int64_t E, int64_t timeout_us, bool use_fp8, bool async_finish,
                     bool return_hook) {
    const char* op = "dispatch";
    if (!buf_->streamCalls()) refuseCapture(device_, cuda_, op);  // (before a round: ep_events.h)
    RoundGuard guard(this, RoundKind::kDispatch);
    const int R = buf_->size();
    const ep::DType dt = hiddenType(x_in, op, "x");
    if (use_fp8 && dt != ep::DType::kBFloat16)
      bad(op, ": use_fp8 quantizes bfloat16 x, got ", x_in.scalar_type());
    Tensor x = arg(x_in, scalarOf(dt), 2, op, "x");
    Tensor topk = arg(topk_in, at::kLong, 2, op, "topk_idx");
    if (topk.size(0) != x.size(0))
      bad(op, ": topk_idx has ", topk.size(0), " rows, x has ", x.size(0));
    checkActiveArg(active, R, op);
    if (E <= 0 || E % R != 0) bad(op, ": num_experts=", E, " must be a positive multiple of ", R);
    if (M <= 0) bad(op, ": num_max_dispatch_tokens_per_rank=", M);
    const int64_t L = E / R, H = x.size(1);
    if (use_fp8 && H % ep::num::kFp8Group != 0)
      bad(op, ": use_fp8 needs a hidden size that is a multiple of ", ep::num::kFp8Group, ", got ",
          H);
    ep::LowLatencyDispatchArgs a;
    a.dtype = use_fp8 ? ep::DType::kFp8 : dt;
    a.tokens = x.size(0);
    a.hidden = H;
    a.topk = static_cast<int>(topk.size(1));
    a.max_tokens = M;
    a.experts = static_cast<int>(E);
    a.timeout_us = timeout_us;
    // The shapes and the buffer's capacity before the outputs are allocated: an M far beyond
    // the buffer is its ValueError, not the allocator's error for [L, R*M, H].
    buf_->validate(a, false);
    Tensor recv_x = output(L, {R * M, H}, use_fp8 ? kFp8Scalar : scalarOf(dt), false);
    Tensor recv_scales;  // [L, R*M, H/128] float32 (fp8)
    if (use_fp8) recv_scales = output(L, {R * M, H / ep::num::kFp8Group}, at::kFloat, false);
    Tensor recv_count = small({L}, at::kInt);
    Tensor src_info = small({L, R * M}, at::kInt);
    Tensor layout = small({L, R}, at::kLong);
    a.x = x.data_ptr();
    a.topk_idx = topk.data_ptr<int64_t>();
    a.active_ranks = active.data_ptr<int32_t>();
    a.recv_x = recv_x.data_ptr();
    a.recv_scales = use_fp8 ? recv_scales.data_ptr<float>() : nullptr;
    a.recv_count = recv_count.data_ptr<int32_t>();
    a.src_info = src_info.data_ptr<int32_t>();
    a.layout_range = layout.data_ptr<int64_t>();
    auto keep = std::make_shared<Keep>(
        Keep{{x, topk, active, recv_x, recv_scales, recv_count, src_info, layout}});
    a.inputs = keep;  // (ep::EpBuffer keeps it past a send that timed out)
    py::object event = py::none(), hook = py::none();
    if (buf_->streamCalls()) {
      streamCall(op, &guard, async_finish, return_hook, &event, &hook,
                 [a](ep::EpBuffer* b, uint32_t round, ep::EpBuffer::StreamPart part,
                     const void* s, bool detach, std::shared_ptr<void> k) {
                   return b->streamDispatch(a, round, part, s, detach, std::move(k));
                 },
                 [this, a] { buf_->validate(a, false); }, keep);
    } else {
      py::gil_scoped_release nogil;
      awaitCallerStream(op, timeout_us);
      buf_->validate(a);
      uint32_t round;
      {
        std::lock_guard<std::mutex> g(mu_);
        round = buf_->nextDispatchRound();
      }
      guard.reserved();
      ep::EpBuffer* b = buf_.get();
      auto send = [b, a, round, keep] { b->dispatchSend(a, round); };
      auto recv = [b, a, round, keep] { b->dispatchRecv(a, round); };
      run(op, RoundKind::kDispatch, round, send, recv, async_finish, return_hook, &event, &hook);
    }
    py::object scales = use_fp8 ? py::cast(recv_scales) : py::none();
    return py::make_tuple(recv_x, scales, recv_count, src_info, layout, event, hook);
  }

  py::tuple combine(const Tensor& y_in, const Tensor& topk_in, const Tensor& w_in,
                    const Tensor& active, int64_t timeout_us, const Tensor& src_info_in,
                    const Tensor& layout_in, int64_t M, int64_t H, int64_t E, bool async_finish,
                    bool return_hook, std::optional<Tensor> out_opt) {
    const char* op = "combine";
    if (!buf_->streamCalls()) refuseCapture(device_, cuda_, op);
    RoundGuard guard(this, RoundKind::kCombine);
    const int R = buf_->size();
    const ep::DType dt = hiddenType(y_in, op, "y");
    Tensor y = arg(y_in, scalarOf(dt), 3, op, "y");
    Tensor topk = arg(topk_in, at::kLong, 2, op, "topk_idx");
    Tensor w = arg(w_in, at::kFloat, 2, op, "topk_weights");
    Tensor src_info = arg(src_info_in, at::kInt, 2, op, "handle src_info");
    Tensor layout = arg(layout_in, at::kLong, 2, op, "handle layout_range");
    checkActiveArg(active, R, op);
    if (E <= 0 || E % R != 0) bad(op, ": handle's num_experts=", E, " does not fit ", R, " ranks");
    const int64_t L = E / R, T = topk.size(0), K = topk.size(1);
    if (y.size(0) != L || y.size(1) != R * M || y.size(2) != H)
      bad(op, ": y must have shape [", L, ", ", R * M, ", ", H, "], got ", shapeOf(y));
    if (w.size(0) != T || w.size(1) != K)
      bad(op, ": topk_weights shape ", shapeOf(w), " differs from topk_idx ", shapeOf(topk));
    if (src_info.size(0) != L || src_info.size(1) != R * M || layout.size(0) != L ||
        layout.size(1) != R)
      bad(op, ": handle does not match y (src_info ", shapeOf(src_info), ", layout_range ",
          shapeOf(layout), ")");
    Tensor out;
    if (out_opt.has_value() && out_opt->defined()) {
      out = *out_opt;
      if ((device_ < 0 && !out.device().is_cpu()) || out.scalar_type() != scalarOf(dt) ||
          out.dim() != 2 || out.size(0) != T || out.size(1) != H || !out.is_contiguous())
        bad(op, ": out must be a contiguous ", device_ < 0 ? "CPU " : "", scalarOf(dt),
            " tensor of shape [", T, ", ", H, "], got ", shapeOf(out));
      if (device_ >= 0) checkOnDevice(out, op, "out");
    } else {
      out = output(T, {H}, scalarOf(dt), true);
    }
    ep::LowLatencyCombineArgs a;
    a.y = y.data_ptr();
    a.dtype = dt;
    a.hidden = H;
    a.max_tokens = M;
    a.experts = static_cast<int>(E);
    a.src_info = src_info.data_ptr<int32_t>();
    a.layout_range = layout.data_ptr<int64_t>();
    a.topk_idx = topk.data_ptr<int64_t>();
    a.topk_weights = w.data_ptr<float>();
    a.tokens = T;
    a.topk = static_cast<int>(K);
    a.active_ranks = active.data_ptr<int32_t>();
    a.timeout_us = timeout_us;
    a.out = out.data_ptr();
    auto keep = std::make_shared<Keep>(Keep{{y, topk, w, src_info, layout, active, out}});
    a.inputs = keep;
    py::object event = py::none(), hook = py::none();
    if (buf_->streamCalls()) {
      streamCall(op, &guard, async_finish, return_hook, &event, &hook,
                 [a](ep::EpBuffer* b, uint32_t round, ep::EpBuffer::StreamPart part,
                     const void* s, bool detach, std::shared_ptr<void> k) {
                   return b->streamCombine(a, round, part, s, detach, std::move(k));
                 },
                 [this, a] { buf_->validate(a, false); }, keep);
    } else {
      py::gil_scoped_release nogil;
      awaitCallerStream(op, timeout_us);
      buf_->validate(a);
      uint32_t round;
      {
        std::lock_guard<std::mutex> g(mu_);
        round = buf_->nextCombineRound();
      }
      guard.reserved();
      ep::EpBuffer* b = buf_.get();
      auto send = [b, a, round, keep] { b->combineSend(a, round); };
      auto recv = [b, a, round, keep] { b->combineRecv(a, round); };
      run(op, RoundKind::kCombine, round, send, recv, async_finish, return_hook, &event, &hook);
    }
    return py::make_tuple(out, event, hook);
  }

  py::tuple dispatchLayout(const Tensor& topk_in, int64_t E) {
    const char* op = "get_dispatch_layout";
    const int R = buf_->size();
    Tensor topk = arg(topk_in, at::kLong, 2, op, "topk_idx");
    if (E <= 0 || E % R != 0) bad(op, ": num_experts=", E, " must be a positive multiple of ", R);
    const int64_t T = topk.size(0);
    const int K = static_cast<int>(topk.size(1));
    refuseCapture(device_, cuda_, op);
    awaitCallerStream(op, -1);
    Tensor topk_h = hostOf(topk, op);  // (computed on the host; a GPU buffer gets GPU tensors)
    ep::validateTopk(topk_h.data_ptr<int64_t>(), T, K, static_cast<int>(E));
    Tensor per_rank = at::empty({R}, at::kInt), per_expert = at::empty({E}, at::kInt);
    Tensor in_rank = at::empty({T, R}, at::kBool);
    ep::dispatchLayout(topk_h.data_ptr<int64_t>(), T, K, static_cast<int>(E), R,
                       per_rank.data_ptr<int32_t>(), per_expert.data_ptr<int32_t>(),
                       reinterpret_cast<uint8_t*>(in_rank.data_ptr<bool>()));
    return py::make_tuple(onDevice(per_rank, op), onDevice(per_expert, op), onDevice(in_rank, op));
  }

  // Normal dispatch; routing from topk_idx, or from is_token_in_rank (a cached dispatch).
  py::tuple normalDispatch(const Tensor& x_in, std::optional<Tensor> topk_opt,
                           std::optional<Tensor> w_opt, int64_t E, int64_t alignment,
                           std::optional<Tensor> in_rank_opt) {
    const char* op = "normal_dispatch";
    refuseCapture(device_, cuda_, op);
    RoundGuard guard(this, RoundKind::kDispatch);
    const int R = buf_->size();
    const ep::DType dt = hiddenType(x_in, op, "x");
    Tensor x = arg(x_in, scalarOf(dt), 2, op, "x");
    const int64_t T = x.size(0), H = x.size(1);
    const bool with_topk = topk_opt.has_value() && topk_opt->defined();
    const bool with_w = w_opt.has_value() && w_opt->defined();
    Tensor topk, w, in_rank;
    int K = 0;
    if (with_topk) {
      topk = arg(*topk_opt, at::kLong, 2, op, "topk_idx");
      if (topk.size(0) != T) bad(op, ": topk_idx has ", topk.size(0), " rows, x has ", T);
      K = static_cast<int>(topk.size(1));
      if (E <= 0 || E % R != 0) bad(op, ": num_experts=", E, " must be a positive multiple of ", R);
      awaitCallerStream(op, -1);  // (a GPU buffer's topk_idx is read here)
      Tensor topk_h = hostOf(topk, op);
      ep::validateTopk(topk_h.data_ptr<int64_t>(), T, K, static_cast<int>(E));
      in_rank = at::empty({T, R}, at::kBool);
      Tensor pr = at::empty({R}, at::kInt), pe = at::empty({E}, at::kInt);
      ep::dispatchLayout(topk_h.data_ptr<int64_t>(), T, K, static_cast<int>(E), R,
                         pr.data_ptr<int32_t>(), pe.data_ptr<int32_t>(),
                         reinterpret_cast<uint8_t*>(in_rank.data_ptr<bool>()));
      in_rank = onDevice(in_rank, op);
    } else {
      if (!in_rank_opt.has_value() || !in_rank_opt->defined())
        bad(op, ": needs topk_idx or a handle");
      in_rank = arg(*in_rank_opt, at::kBool, 2, op, "handle is_token_in_rank");
      if (in_rank.size(0) != T || in_rank.size(1) != R)
        bad(op, ": handle routes ", in_rank.size(0), " tokens over ", in_rank.size(1),
            " ranks; x has ", T, " tokens and the group ", R, " ranks");
    }
    if (with_w) {
      w = arg(*w_opt, at::kFloat, 2, op, "topk_weights");
      if (w.size(0) != T || (with_topk && w.size(1) != K))
        bad(op, ": topk_weights shape ", shapeOf(w), " does not match [", T, ", K]");
      K = static_cast<int>(w.size(1));
    }
    ep::NormalDispatchArgs a;
    a.x = x.data_ptr();
    a.dtype = dt;
    a.tokens = T;
    a.hidden = H;
    a.is_token_in_rank = reinterpret_cast<const uint8_t*>(in_rank.data_ptr<bool>());
    a.with_topk_idx = with_topk;
    a.with_weights = with_w;
    a.topk_idx = with_topk ? topk.data_ptr<int64_t>() : nullptr;
    a.topk_weights = with_w ? w.data_ptr<float>() : nullptr;
    a.topk = K;
    a.experts = static_cast<int>(E);
    a.expert_alignment = static_cast<int>(alignment);
    a.inputs = std::make_shared<Keep>(Keep{{x}});
    Tensor recv_x, recv_src, recv_topk, recv_w, per_expert, counts_t;
    {
      py::gil_scoped_release nogil;
      awaitCallerStream(op, -1);
      buf_->validate(a);
      buf_->runSync([&] {
        uint32_t round;
        {
          std::lock_guard<std::mutex> g(mu_);
          round = buf_->nextDispatchRound();
        }
        guard.reserved();
        claimOrGiveUp(op, RoundKind::kDispatch, round, false, true);  // (low-latency halves)
        std::vector<int32_t> counts = buf_->normalDispatchSend(a, round);
        const ep::EpBuffer::MarkOnExit unread(buf_.get(), RoundKind::kDispatch, round, true);
        int64_t n = 0;
        for (int32_t c : counts) n += c;
        recv_x = output(n, {H}, scalarOf(dt), true);
        recv_src = small({n}, at::kInt);
        counts_t = at::empty({R}, at::kInt);
        std::copy(counts.begin(), counts.end(), counts_t.data_ptr<int32_t>());
        counts_t = onDevice(counts_t, op);
        ep::NormalDispatchOutputs o;
        o.recv_x = recv_x.data_ptr();
        o.recv_src_idx = recv_src.data_ptr<int32_t>();
        if (with_topk) {
          recv_topk = small({n, K}, at::kLong);
          per_expert = small({E / R}, at::kInt);
          o.recv_topk_idx = recv_topk.data_ptr<int64_t>();
          o.num_recv_per_expert = per_expert.data_ptr<int32_t>();
        }
        if (with_w) {
          recv_w = small({n, K}, at::kFloat);
          o.recv_topk_weights = recv_w.data_ptr<float>();
        }
        buf_->normalDispatchRecv(a, round, counts, o);
      });
    }
    auto opt = [](const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
    return py::make_tuple(recv_x, opt(recv_topk), opt(recv_w), opt(per_expert), recv_src, counts_t,
                          in_rank);
  }

  py::tuple normalCombine(const Tensor& y_in, const Tensor& counts_in, const Tensor& in_rank_in,
                          std::optional<Tensor> w_opt) {
    const char* op = "normal_combine";
    refuseCapture(device_, cuda_, op);
    RoundGuard guard(this, RoundKind::kCombine);
    const int R = buf_->size();
    const ep::DType dt = hiddenType(y_in, op, "y");
    Tensor y = arg(y_in, scalarOf(dt), 2, op, "y");
    Tensor counts = arg(counts_in, at::kInt, 1, op, "handle recv_counts");
    Tensor in_rank = arg(in_rank_in, at::kBool, 2, op, "handle is_token_in_rank");
    if (counts.size(0) != R || in_rank.size(1) != R)
      bad(op, ": the handle belongs to a group of another size");
    awaitCallerStream(op, -1);  // (a GPU buffer's handle is read here)
    const int64_t n = hostOf(counts, op).sum().item<int64_t>();
    if (y.size(0) != n) bad(op, ": y has ", y.size(0), " rows; the dispatch delivered ", n);
    const bool with_w = w_opt.has_value() && w_opt->defined();
    Tensor w;
    if (with_w) {
      w = arg(*w_opt, at::kFloat, 2, op, "topk_weights");
      if (w.size(0) != n) bad(op, ": topk_weights has ", w.size(0), " rows, y has ", n);
    }
    const int64_t T = in_rank.size(0), H = y.size(1);
    const int K = with_w ? static_cast<int>(w.size(1)) : 0;
    Tensor out = output(T, {H}, scalarOf(dt), true);
    Tensor out_w = with_w ? small({T, K}, at::kFloat) : Tensor();
    ep::NormalCombineArgs a;
    a.y = y.data_ptr();
    a.dtype = dt;
    a.hidden = H;
    a.recv_counts = counts.data_ptr<int32_t>();
    a.with_weights = with_w;
    a.weights = with_w ? w.data_ptr<float>() : nullptr;
    a.topk = K;
    a.is_token_in_rank = reinterpret_cast<const uint8_t*>(in_rank.data_ptr<bool>());
    a.tokens = T;
    a.out = out.data_ptr();
    a.out_weights = with_w ? out_w.data_ptr<float>() : nullptr;
    a.inputs = std::make_shared<Keep>(Keep{{y, w}});
    {
      py::gil_scoped_release nogil;
      buf_->validate(a);
      buf_->runSync([&] {
        uint32_t round;
        {
          std::lock_guard<std::mutex> g(mu_);
          round = buf_->nextCombineRound();
        }
        guard.reserved();
        claimOrGiveUp(op, RoundKind::kCombine, round, false, true);
        buf_->normalCombine(a, round);
      });
    }
    return py::make_tuple(out, with_w ? py::cast(out_w) : py::none());
  }

 private:
  // A stream-ordered call (ep/buffer.h): the shapes, the round, the kernels queued on the
  // buffer's stream; then the outcomes of earlier calls whose kernels ran: a failure of one
  // raises here, after this call's kernels were queued, so that every rank's rounds stay in
  // step (a call that raised before its round would make it a round given up, and the peers'
  // next calls would raise in turn). With the GIL; releases it meanwhile.
  using StreamQueue = std::function<std::shared_ptr<engine::device::Event>(
      ep::EpBuffer*, uint32_t, ep::EpBuffer::StreamPart, const void*, bool,
      std::shared_ptr<void>)>;
  void streamCall(const char* op, RoundGuard* guard, bool async_finish, bool return_hook,
                  py::object* event, py::object* hook, StreamQueue queue,
                  const std::function<void()>& validate, std::shared_ptr<Keep> keep) {
    using Part = ep::EpBuffer::StreamPart;
    const void* stream = callerStream(cuda_, device_, op);
    std::shared_ptr<engine::device::Event> ev;
    uint32_t round = 0;
    const bool dispatch = std::string(op) == "dispatch";
    {
      py::gil_scoped_release nogil;
      buf_->runSync([&] {
        validate();
        {
          std::lock_guard<std::mutex> g(mu_);
          round = dispatch ? buf_->nextDispatchRound() : buf_->nextCombineRound();
        }
        guard->reserved();
        ev = queue(buf_.get(), round, return_hook ? Part::kSend : Part::kBoth, stream,
                   async_finish, keep);
      });
    }
    if (async_finish) *event = py::cast(std::make_shared<PyEvent>(buf_, ev, cuda_));
    if (return_hook) {
      // hook(): the receive, queued after the caller's current stream at that time (the
      // PyHook holds the buffer).
      ep::EpBuffer* b = buf_.get();
      const bool cuda = cuda_;
      const int device = device_;
      // An earlier call's failure raises from hook(), after the receive is queued.
      auto recv = [b, queue, round, keep, cuda, device, op] {
        const void* s = callerStream(cuda, device, op);
        queue(b, round, Part::kRecv, s, false, keep);
        b->checkStreamCalls();
      };
      const auto kind = dispatch ? RoundKind::kDispatch : RoundKind::kCombine;
      auto drop = [b, op, kind, round] { b->dropStreamHook(op, kind, round); };
      *hook = py::cast(std::make_shared<PyHook>(buf_, std::move(recv), std::move(drop)));
      return;  // (raising here would lose the hook, and with it the round's receive)
    }
    py::gil_scoped_release nogil;
    buf_->checkStreamCalls();
  }

  // EpBuffer::claimHalf for `round` (reserved; without the GIL): a refusal gives the round up,
  // as a bad call's is, and rethrows. on_queue: called from the buffer's queue (runSync).
  void claimOrGiveUp(const char* op, RoundKind kind, uint32_t round, bool hook, bool on_queue) {
    try {
      buf_->claimHalf(op, kind, round, hook);
    } catch (const std::invalid_argument&) {
      if (on_queue)
        buf_->abandon(kind, round);
      else
        buf_->runSync([&] { buf_->abandon(kind, round); });
      throw;
    }
  }

  // The four ways to run the send/recv pair of `round` (reserved; called without the GIL).
  // A third call of a kind in flight while a hook holds its half (EpBuffer::claimHalf) is
  // refused and its round given up, as on the stream path.
  void run(const char* op, RoundKind kind, uint32_t round, std::function<void()> send,
           std::function<void()> recv, bool async_finish, bool return_hook, py::object* event,
           py::object* hook) {
    ep::EpBuffer* b = buf_.get();
    claimOrGiveUp(op, kind, round, return_hook, false);
    std::shared_ptr<ep::EpEvent> ev;
    if (return_hook) {
      try {
        if (async_finish)
          ev = b->enqueue(std::move(send));
        else
          b->runSync(send);
      } catch (...) {  // no hook: the half is free again
        b->releaseHalf(kind, round);
        throw;
      }
      // The hook's receive frees the half once it ran (or failed); so does dropping it.
      auto received = [b, kind, round, recv = std::move(recv)] {
        struct Release {
          ep::EpBuffer* b;
          RoundKind kind;
          uint32_t round;
          ~Release() { b->releaseHalf(kind, round); }
        } release{b, kind, round};
        recv();
      };
      auto drop = [b, kind, round] { b->releaseHalf(kind, round); };
      py::gil_scoped_acquire gil;
      *hook = py::cast(std::make_shared<PyHook>(buf_, std::move(received), std::move(drop)));
    } else if (async_finish) {
      ev = b->enqueue([send, recv] {
        send();
        recv();
      });
    } else {
      b->runSync([&] {
        send();
        recv();
      });
    }
    if (ev) {
      py::gil_scoped_acquire gil;
      *event = py::cast(std::make_shared<PyEvent>(std::move(ev)));
    }
  }

  // How long a GPU buffer's call waits for the kernels the caller queued before it.
  static std::chrono::milliseconds timeoutOf(int64_t timeout_us) {
    return std::chrono::milliseconds(timeout_us < 0 || timeout_us >= ep::EpBuffer::kNoDeadlineUs
                                         ? 24LL * 3600 * 1000
                                                    : std::max<int64_t>(timeout_us / 1000, 0) +
                                                          60000);
  }

  c10::intrusive_ptr<ProcessGroupMooncake> pg_;
  int device_ = -1;    // GPU buffer: its device (ep/buffer.h, "Device mode")
  bool cuda_ = false;  // ... of the CUDA device layer (else the simulation's)
  std::shared_ptr<ep::EpBuffer> buf_;  // shared with hooks, which may outlive this object
  std::mutex mu_;
  TensorPool pool_;
};

}  // namespace

void registerEpApis(py::module_& m) {
  py::class_<PyEvent, std::shared_ptr<PyEvent>>(m, "EpEvent",
                                                "Completion of an async EP operation.")
      .def("wait", &PyEvent::wait, "Blocks until the operation finished; raises its error.")
      .def("current_stream_wait", &PyEvent::currentStreamWait,
           "DeepEP's: the current stream waits for the operation (a stream-ordered GPU call); "
           "CPU tensors have no stream, so there it waits for the operation.")
      .def("done", &PyEvent::done);
  py::class_<PyHook, std::shared_ptr<PyHook>>(m, "EpHook",
                                              "Completes the receive half of an EP operation.")
      .def("__call__", &PyHook::call);
  py::class_<PyEpBuffer, std::shared_ptr<PyEpBuffer>>(m, "EpBuffer")
      .def(py::init<c10::intrusive_ptr<ProcessGroupMooncake>, int64_t, bool, int64_t, bool,
                    int64_t>(),
           py::arg("group"), py::arg("num_bytes"), py::arg("disable_p2p") = false,
           py::arg("device") = -1, py::arg("cuda") = false, py::arg("min_size") = 0)
      .def_property_readonly("device", &PyEpBuffer::device)
      .def_property_readonly("rank", &PyEpBuffer::rank)
      .def_property_readonly("group_size", &PyEpBuffer::size)
      .def_property_readonly("num_bytes", &PyEpBuffer::bytes)
      .def("is_mapped", &PyEpBuffer::isMapped, py::arg("rank"))
      .def("low_latency_executor", &PyEpBuffer::lowLatencyExecutor)
      .def("dispatch", &PyEpBuffer::dispatch, py::arg("x"), py::arg("topk_idx"),
           py::arg("active_ranks"), py::arg("num_max_dispatch_tokens_per_rank"),
           py::arg("num_experts"), py::arg("timeout_us"), py::arg("use_fp8"),
           py::arg("async_finish"), py::arg("return_recv_hook"))
      .def("combine", &PyEpBuffer::combine, py::arg("y"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("active_ranks"), py::arg("timeout_us"),
           py::arg("src_info"), py::arg("layout_range"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"),
           py::arg("async_finish"), py::arg("return_recv_hook"), py::arg("out"))
      .def("get_dispatch_layout", &PyEpBuffer::dispatchLayout, py::arg("topk_idx"),
           py::arg("num_experts"))
      .def(
          "abandon",
          [](PyEpBuffer& b, const std::string& kind) {
            if (kind != "dispatch" && kind != "combine")
              bad("abandon: kind must be 'dispatch' or 'combine', got '", kind, "'");
            b.giveUp(kind == "dispatch" ? PyEpBuffer::RoundKind::kDispatch
                                        : PyEpBuffer::RoundKind::kCombine);
          },
          "Gives up this rank's next dispatch/combine round (a call that failed before it "
          "reached the buffer): the peers' calls of the round end at once.")
      .def("normal_dispatch", &PyEpBuffer::normalDispatch, py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("num_experts"), py::arg("expert_alignment"),
           py::arg("is_token_in_rank"))
      .def("normal_combine", &PyEpBuffer::normalCombine, py::arg("y"), py::arg("recv_counts"),
           py::arg("is_token_in_rank"), py::arg("topk_weights"))
      .def_static(
          "size_hint",
          [](int64_t M, int64_t H, int64_t R, int64_t E) {
            return static_cast<int64_t>(
                ep::sizeHint(M, H, static_cast<int>(R), static_cast<int>(E)));
          },
          py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
          py::arg("num_experts"));
}

}  // namespace mooncake::torch_ext
