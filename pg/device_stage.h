// GPU memory given to a collective or a point-to-point call (device memory of the engine's
// device layer, engine/device/device.h) is staged through host memory: the call's GPU inputs
// are copied into a host buffer with the layer's copies, the host algorithm runs on it, and
// the results are copied back. Correct on any device and over every path (shm, net,
// hierarchical, elastic); not fast: two extra copies, each waited for by the host, and the
// reduction runs on the CPU (no GPU kernels yet; docs/gpu.md). Host code never touches the
// GPU memory itself.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <vector>

namespace mooncake::pg {

class DeviceStage {
 public:
  // True when any pointer is GPU memory. False at once while no GPU memory was used in this
  // process (engine::device::active()): host-only jobs pay one relaxed load.
  static bool any(std::initializer_list<const void*> ps);

  DeviceStage(const char* op, size_t bytes) : op_(op), buf_(bytes) {}
  char* host() { return buf_.data(); }
  // Copies n bytes of src (GPU or host memory) to host() + at.
  void in(const void* src, size_t n, size_t at = 0);
  // Copies n bytes at host() + at to dst (GPU or host memory).
  void out(void* dst, size_t n, size_t at = 0);

 private:
  const char* op_;
  std::vector<char> buf_;
};

// Copies between GPU and host memory queued on the device layer's copy stream of the GPU
// involved (the first GPU pointer given), waited for together: for algorithms that move GPU
// memory in and out of the shared comm buffers themselves (allreduce on one host).
class DeviceCopies {
 public:
  explicit DeviceCopies(const char* op) : op_(op) {}
  void add(void* dst, const void* src, size_t n);
  void wait();  // throws CommError when a copy failed

 private:
  const char* op_;
  int ordinal_ = -1;
  bool pending_ = false;
};

}  // namespace mooncake::pg
