// Tensors in GPU memory given to the process group (docs/gpu.md): which tensors are, whether
// this build and process can serve CUDA tensors, byte copies that work on either kind of
// memory, and the ordering against the caller's CUDA stream.
//
// A tensor is "on the GPU" when it is a CUDA tensor or when its storage is GPU memory of the
// engine's device layer (engine/device/device.h; over the host simulation, MC_DEVICE=sim, a
// CPU tensor whose storage is the layer's memory: mooncake._C._device_empty_like makes them
// for the tests). The communicator takes GPU memory in every op (pg/device_stage.h) and moves
// it with the device layer's copies only, so the backend hands such tensors' pointers to it as
// they are; nothing here touches their bytes from the host.
//
// On one host every collective of GPU tensors is stream-ordered (pg/stream_ops.h, ProcessGroupMooncake::streamCollective): queued on torch's
// current stream when issued, no host thread waits for it, Work.wait() orders the current
// stream after it. The other ops:
// CUDA stream semantics (ProcessGroupNCCL's model, partly): an op on CUDA tensors records an
// event on the caller's current stream of each CUDA device involved, when it is issued; the
// op does not touch those tensors before the events have completed (the kernels queued before
// the call have produced its inputs). The op's own copies are waited for on the host by the
// thread that runs it, so when its Work completes, its outputs are in GPU memory and kernels
// queued afterwards on any stream see them. Work.wait() blocks the calling thread until the op
// completes (MC_PG_BLOCKING_WAIT=1, the default). With MC_PG_BLOCKING_WAIT=0, Work.wait()
// (without a timeout) on an op with CUDA outputs that has not completed makes the caller's
// current stream of each output device wait for it, as NCCL's does, and returns: a gate (a
// host word, engine/device/device.h) is queued on the stream with cuStreamWaitValue32, and the
// op's thread opens it when the op completes, failed or not. No host synchronisation -- but a
// driver call on the op's path that takes the driver's context lock then deadlocks with a
// synchronous copy of the caller's queued behind the gate (the GPU machine's second session,
// docs/gpu.md): the op's path must not create or destroy events, load kernels or streams.
// Where the gate cannot be queued (torch's CUDA streams out of reach, a driver without stream
// memory operations; logged once), wait() blocks instead.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/device/device.h"

namespace mooncake::torch_ext {

// Adds t's device to *devices when t is a CUDA tensor on a device not listed yet.
void noteCudaDevice(const at::Tensor& t, std::vector<c10::Device>* devices);

// Whether t's bytes are GPU memory (a CUDA tensor, or device-layer memory under a CPU tensor).
bool onGpu(const at::Tensor& t);
// Whether every tensor of a non-empty list is.
bool onGpu(const std::vector<at::Tensor>& ts);
// The device of a tensor on the GPU (a CUDA tensor's index, or the device of the layer's memory
// under it); -1 for any other.
int gpuOrdinal(const at::Tensor& t);

// Empty when this process can serve CUDA tensors (a build with MC_WITH_CUDA whose device layer
// is the CUDA driver's); else why not, for the error that names the op and the tensor. The
// first CUDA tensor seen also tells the engine that GPU memory is in use (device::noteUse).
std::string cudaUnavailableReason();

// A CPU tensor of like's shape and dtype whose storage is GPU memory of the engine's device
// layer on `device` (freed with the tensor): for tests and benchmarks over the simulation
// (MC_DEVICE=sim), where torch has no CUDA. Host code must not touch its bytes.
at::Tensor deviceEmptyLike(const at::Tensor& like, int device);
// The same with a shape and dtype.
at::Tensor deviceEmpty(at::IntArrayRef shape, at::ScalarType dtype, int device);

// Byte copies between any two of host memory and GPU memory (the device layer's copies, waited
// for; a plain memcpy between host buffers). Throws std::runtime_error naming `op`.
void copyBytes(void* dst, const void* src, size_t n, const char* op);

// The caller's CUDA streams at the time an op was issued (one event per CUDA device among the
// op's tensors); empty for ops on host memory and on the simulation's memory.
// Queues on the caller's current CUDA stream of each device in `devices` a wait for `gate`
// (Device::waitWord). False where this process cannot (why is logged once): the caller then
// waits on the host. The stream handle comes from torch's libc10_cuda, looked up at run time
// (CUDAStream::stream(); the extension links no CUDA library of torch's).
bool streamWaitGate(const std::vector<c10::Device>& devices, const engine::device::Gate& gate);

// torch's current CUDA stream of device d (a CUstream); nullopt where this process cannot name
// it (torch's libc10_cuda not loaded, or without CUDAStream::stream()).
std::optional<const void*> currentStream(const c10::Device& d);
// The stream a stream-ordered op on t is queued on (pg/stream_ops.h): torch's current stream of
// t's device for a CUDA tensor, the device layer's copy stream for a tensor in the simulation's
// memory (MC_DEVICE=sim); nullopt where there is none to name.
std::optional<const void*> opStream(const at::Tensor& t);
// Whether t is on the GPU and its opStream is capturing a CUDA graph (torch.cuda.graph; the
// simulation's own capture in the tests): the group's ops refuse such tensors (Check::tensor).
bool streamCapturing(const at::Tensor& t);

class StreamFence {
 public:
  // Records the events on the current thread's current streams.
  explicit StreamFence(const std::vector<c10::Device>& cuda_devices);
  ~StreamFence();
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;
  // Blocks until every event has completed; throws std::runtime_error naming `op` when one
  // has not by `timeout`.
  void wait(const char* op, std::chrono::milliseconds timeout) const;

 private:
  struct Events;
  std::unique_ptr<Events> events_;
};

}  // namespace mooncake::torch_ext
