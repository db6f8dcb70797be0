// See gpu_tensors.h.
#include "torch_ext/csrc/gpu_tensors.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <dlfcn.h>

#include <algorithm>
#include <stdexcept>
#include <mutex>
#include <set>
#include <thread>

#include "engine/device/device.h"
#include "engine/log.h"
#include "pg/device_reduce.h"
#include "mooncake/config.h"

namespace mooncake::torch_ext {

void noteCudaDevice(const at::Tensor& t, std::vector<c10::Device>* devices) {
  if (!t.defined() || !t.is_cuda()) return;
  if (std::find(devices->begin(), devices->end(), t.device()) == devices->end())
    devices->push_back(t.device());
}

bool onGpu(const at::Tensor& t) {
  if (t.is_cuda()) return true;
  // Host-only processes pay one relaxed load (device::active()). (An empty tensor too: like an
  // empty CUDA tensor, one of the layer's -- its storage is a byte of GPU memory -- stays one,
  // so that every rank of a collective whose blocks differ decides alike.)
  if (!t.device().is_cpu() || !engine::device::active()) return false;
  const void* p = t.storage().data();
  return p != nullptr && engine::device::isDeviceMemory(p);
}

bool onGpu(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) return false;
  for (const auto& t : ts)
    if (!onGpu(t)) return false;
  return true;
}

int gpuOrdinal(const at::Tensor& t) {
  if (t.is_cuda()) return static_cast<int>(t.device().index());
  if (!onGpu(t)) return -1;
  auto layer = engine::device::get();
  return layer.ok() ? (*layer)->pointer(t.storage().data()).ordinal : -1;
}

std::string cudaUnavailableReason() {
#if MC_HAVE_CUDA
  static const std::string reason = [] {
    auto d = engine::device::get();
    if (!d.ok()) return "the engine has no CUDA device layer: " + d.status().toString();
    const std::string name = (*d)->name();
    if (name != "cuda") return "the engine's device layer is '" + name + "' (MC_DEVICE), not cuda";
    // Torch allocated these tensors, not the layer: from now on the engine and the
    // communicator look pointers up (device::isDeviceMemory) instead of assuming host memory.
    engine::device::noteUse();
    return std::string();
  }();
  return reason;
#else
  return "this build of mooncake has no CUDA (configure with -DMC_WITH_CUDA=ON)";
#endif
}

at::Tensor deviceEmptyLike(const at::Tensor& like, int device) {
  return deviceEmpty(like.sizes(), like.scalar_type(), device);
}

at::Tensor deviceEmpty(at::IntArrayRef shape, at::ScalarType dtype, int device) {
  auto d = engine::device::get();
  if (!d.ok()) throw std::runtime_error("mooncake: no device layer: " + d.status().toString());
  engine::device::Device* layer = *d;
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const size_t n =
      std::max<size_t>(static_cast<size_t>(numel) * c10::elementSize(dtype), 1);
  auto p = layer->allocate(n, device);
  if (!p.ok()) throw std::runtime_error("mooncake: " + p.status().toString());
  return at::from_blob(
      *p, shape, [layer](void* q) { (void)layer->free(q); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void copyBytes(void* dst, const void* src, size_t n, const char* op) {
  if (n == 0) return;
  // A copy that has not finished in a minute is stuck (a lost device): an error, not a hang.
  Status st = engine::device::copyAny(dst, src, n, engine::deadlineInMs(60000));
  if (!st.ok()) {
    throw std::runtime_error(std::string(op) + ": copying " + std::to_string(n) +
                             " bytes between GPU and host memory failed: " + st.toString());
  }
}

namespace {

// torch's CUDAStream::stream() (libc10_cuda, loaded by a CUDA build of torch), or nullptr.
// CUDAStream's one data member is its c10::Stream, so a c10::Stream stands in for `this`.
using CudaStreamOf = void* (*)(const c10::Stream*);
CudaStreamOf cudaStreamOf(std::string* why) {
  static std::string missing;
  static const CudaStreamOf fn = []() -> CudaStreamOf {
    void* lib = dlopen("libc10_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
    if (lib == nullptr) {
      missing = "torch's libc10_cuda.so is not loaded";
      return nullptr;
    }
    void* sym = dlsym(lib, "_ZNK3c104cuda10CUDAStream6streamEv");
    if (sym == nullptr) missing = "libc10_cuda.so has no c10::cuda::CUDAStream::stream()";
    return reinterpret_cast<CudaStreamOf>(sym);
  }();
  *why = missing;
  return fn;
}

}  // namespace

std::optional<const void*> currentStream(const c10::Device& d) {
  std::string why;
  CudaStreamOf stream_of = cudaStreamOf(&why);
  if (stream_of == nullptr || !d.is_cuda()) return std::nullopt;
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Stream s = cuda.getStream(d);
  return static_cast<const void*>(stream_of(&s));
}

std::optional<const void*> opStream(const at::Tensor& t) {
  if (t.is_cuda()) return currentStream(t.device());
  if (onGpu(t)) return engine::device::kCopyStream;
  return std::nullopt;
}

bool streamCapturing(const at::Tensor& t) {
  if (!onGpu(t)) return false;
  std::optional<const void*> s = opStream(t);
  auto layer = engine::device::get();
  return s && layer.ok() && (*layer)->capturing(gpuOrdinal(t), *s);
}

bool streamWaitGate(const std::vector<c10::Device>& devices, const engine::device::Gate& gate) {
  static std::once_flag logged;
  auto cannot = [&](const std::string& why) {
    std::call_once(logged, [&] {
      MC_LOG(WARN, PG) << "Work.wait() on CUDA tensors blocks the calling thread: " << why;
    });
    return false;
  };
  std::string why;
  CudaStreamOf stream_of = cudaStreamOf(&why);
  if (stream_of == nullptr) return cannot(why);
  auto d = engine::device::get();
  if (!d.ok()) return cannot(d.status().toString());
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  for (const c10::Device& dev : devices) {
    // The kernels an op may launch are loaded before the first gate on this device: loaded at
    // a first launch behind the gate instead, they would wait for it (Device::load).
    static std::mutex mu;
    static std::set<int> loaded;
    {
      std::lock_guard<std::mutex> g(mu);
      if (!loaded.count(dev.index())) {
        Status st = pg::prepareDeviceReduce(dev.index());
        if (!st.ok()) return cannot("the GPU reduction kernel did not load: " + st.toString());
        loaded.insert(dev.index());
      }
    }
    const c10::Stream s = cuda.getStream(dev);
    Status st = (*d)->waitWord(dev.index(), stream_of(&s), gate.word, gate.value);
    if (!st.ok()) return cannot(st.toString());
  }
  return true;
}

struct StreamFence::Events {
  // The device layer's events where it can record on torch's stream: they come from a pool and
  // go back to it, so the op's thread that drops the fence makes no driver call that could meet
  // a gate (gpu_tensors.h); c10's otherwise.
  std::vector<std::unique_ptr<engine::device::Event>> layer;
  std::vector<c10::Event> list;
};

StreamFence::StreamFence(const std::vector<c10::Device>& cuda_devices) {
  if (cuda_devices.empty()) return;
  events_ = std::make_unique<Events>();
  std::string why;
  CudaStreamOf stream_of = cudaStreamOf(&why);
  auto layer = engine::device::get();
  // Through c10's device-guard interface (libc10), which the CUDA build of torch implements:
  // the extension links no CUDA library of torch's and builds against CPU-only torch too.
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  for (const c10::Device& d : cuda_devices) {
    const c10::Stream s = cuda.getStream(d);
    if (stream_of != nullptr && layer.ok()) {
      auto ev = (*layer)->recordOn(d.index(), stream_of(&s));
      if (ev.ok()) {
        events_->layer.push_back(std::move(*ev));
        continue;
      }
    }
    events_->list.emplace_back(c10::DeviceType::CUDA);
    events_->list.back().record(s);
  }
}

StreamFence::~StreamFence() = default;

void StreamFence::wait(const char* op, std::chrono::milliseconds timeout) const {
  if (!events_) return;
  const engine::Deadline deadline = engine::deadlineIn(timeout);
  for (const auto& e : events_->layer) {
    Status st = e->wait(deadline);
    if (st.code() == Code::kTimeout) {
      throw std::runtime_error(std::string(op) +
                               ": the caller's CUDA stream did not reach the op within the "
                               "group timeout (" +
                               std::to_string(timeout.count()) + " ms)");
    }
    if (!st.ok())
      throw std::runtime_error(std::string(op) + ": the caller's CUDA stream failed before the op: " +
                               st.toString());
  }
  for (const c10::Event& e : events_->list) {
    // Polled: a blocking event wait has no deadline. Short sleeps: the kernels the caller
    // queued before the op usually finish within microseconds to milliseconds.
    auto nap = std::chrono::microseconds(5);
    while (!e.query()) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error(std::string(op) +
                                 ": the caller's CUDA stream did not reach the op within the "
                                 "group timeout (" +
                                 std::to_string(timeout.count()) + " ms)");
      }
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::microseconds(500)) nap *= 2;
    }
  }
}

}  // namespace mooncake::torch_ext
