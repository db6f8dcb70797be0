// GPU memory given to a collective or a point-to-point call (device memory of the engine's
// device layer, engine/device/device.h) is staged through host memory: the call's GPU inputs
// are copied into a pinned host buffer with the layer's copies, the host algorithm runs on it, and
// the results are copied back. Correct on any device and over every path (shm, net,
// hierarchical, elastic); not fast: two extra copies, each waited for by the host, and the
// reduction runs on the CPU (no GPU kernels yet; docs/gpu.md). Host code never touches the
// GPU memory itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "pg/types.h"

namespace mooncake::pg {

class ShmGroup;
struct OpCtx;

class DeviceStage {
 public:
  // True when any pointer is GPU memory. False at once while no GPU memory was used in this
  // process (engine::device::active()): host-only jobs pay one relaxed load.
  static bool any(std::initializer_list<const void*> ps);

  // A host buffer of at least `bytes` (contents undefined), from a pool of buffers pinned for
  // the device layer's copies once and reused (up to 256 MiB; larger ones are made per call
  // and left pageable: pinning them each time would cost more than the driver's bounce).
  DeviceStage(const char* op, size_t bytes);
  ~DeviceStage();
  DeviceStage(const DeviceStage&) = delete;
  DeviceStage& operator=(const DeviceStage&) = delete;
  char* host();
  struct Buffer;  // (pg/device_stage.cc)
  // Copies n bytes of src (GPU or host memory) to host() + at.
  void in(const void* src, size_t n, size_t at = 0);
  // Copies n bytes at host() + at to dst (GPU or host memory).
  void out(void* dst, size_t n, size_t at = 0);

 private:
  const char* op_;
  std::unique_ptr<Buffer> buf_;
};

// Copies between GPU and host memory queued on the device layer's copy stream of the GPU
// involved (the first GPU pointer given), waited for together: for algorithms that move GPU
// memory in and out of the shared comm buffers themselves (allreduce on one host).
class DeviceCopies {
 public:
  explicit DeviceCopies(const char* op) : op_(op) {}
  void add(void* dst, const void* src, size_t n);
  // Queues dst (and dst2) = the reduction of srcs (pg/device_reduce.h) after the copies queued
  // so far, on the same stream. False, with nothing queued, when it has no GPU form here.
  bool reduce(void* dst, void* dst2, const void* const* srcs, int n, size_t count, DataType t,
              ReduceOp op);
  void wait();  // throws CommError when a copy or a reduction failed
  // Waits for what was queued, ignoring failures: before memory a queued copy may still touch
  // is freed on an error path.
  void drain() noexcept;

 private:
  const char* op_;
  int ordinal_ = -1;
  bool pending_ = false;
};

// `dev` when given, else `own`, made on first use: the copies a step queues out of a peer's GPU
// half (a rank with host buffers makes its own).
inline DeviceCopies& copiesFor(DeviceCopies* dev, std::optional<DeviceCopies>& own, const char* op) {
  if (dev != nullptr) return *dev;
  return own ? *own : own.emplace(op);
}

// GPU halves beside a same-host group's host halves: a rank whose data of a step is GPU
// memory copies it into its own GPU half (device to device) instead of the host half, and
// says so in its header (ShmGroup::DeviceHalfInfo) before it posts the step; a peer copies it
// out of that half, which it opens once through the device layer's IPC handle, straight into
// its own output. GPU bytes then never cross host memory. The halves are allocated on first
// use (2 x the host half's size, on the device of the first GPU data) and live as long as this
// object (one per group view); a rank whose allocation fails keeps using its host half.
class DeviceHalves {
 public:
  // enabled false (MC_PG_GPU_HALVES=0): this rank's data always goes through its host half.
  DeviceHalves(ShmGroup& g, bool enabled);
  ~DeviceHalves();
  DeviceHalves(const DeviceHalves&) = delete;
  DeviceHalves& operator=(const DeviceHalves&) = delete;

  // Where this rank writes its data of step s: its GPU half when src is GPU memory and the
  // half could be had, else the host half. Records the choice for the peers (before the step
  // is posted: ShmGroup::setGpuHalf).
  char* writeTarget(uint64_t s, const void* src);
  // Rank r's GPU half of step s (ShmGroup::gpuHalf said the data is there), opened here on
  // first use; a failure throws CommError naming r.
  const char* peerHalf(const OpCtx& op, int r, uint64_t s);
  // Steps whose data this rank wrote into its GPU half so far (tests).
  uint64_t deviceSteps() const { return device_steps_; }

 private:
  ShmGroup& g_;
  char* own_ = nullptr;  // 2 halves of GPU memory, or null
  bool own_failed_ = false;
  std::vector<char*> opened_;  // peers' GPU halves as mapped here (by rank)
  std::vector<void*> opened_base_;  // what to close
  uint64_t device_steps_ = 0;
};

}  // namespace mooncake::pg
