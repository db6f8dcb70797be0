// The device layer: the few operations on GPU memory the engine needs, behind one interface
// with two implementations (DESIGN.md section 2):
//   - cuda: the CUDA driver API, loaded at run time (dlopen "libcuda.so.1"), so a build with
//     CUDA still runs where no driver is installed (this machine, CI);
//   - sim: a host simulation for the tests: "device memory" is shared host memory (a memfd per
//     allocation) that the engine must treat as device memory (never memcpy'd by shm or tcp),
//     and its dma-buf is that memfd, which the verbs emulator maps like a NIC maps a GPU's BAR.
// Chosen once per process by MC_DEVICE (auto: cuda when a driver and a device are there).
// What is here today: allocation, pointer attributes and dma-buf export (what rdma needs to
// register GPU memory). IPC handles, copies and events come with the cuda transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/status.h"

namespace mooncake::engine::device {

struct PointerInfo {
  bool device = false;  // the address is device memory of this layer
  int ordinal = -1;     // which device
};

// A dma-buf file descriptor that maps a device range (owned by the caller: close it).
struct DmaBuf {
  int fd = -1;
  uint64_t offset = 0;  // where the range starts within the dma-buf
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;  // "cuda" or "sim"
  virtual int count() const = 0;         // devices (ordinals 0 .. count-1)
  virtual Result<void*> allocate(size_t len, int ordinal) = 0;
  virtual Status free(void* p) = 0;
  virtual PointerInfo pointer(const void* p) const = 0;
  // A dma-buf for [p, p+len), which must lie in one allocation.
  virtual Result<DmaBuf> exportDmabuf(const void* p, size_t len) = 0;
};

// The process's device layer (made on first call; MC_DEVICE). An error says why there is none
// (MC_DEVICE=none, no CUDA driver, no device, a build without CUDA).
Result<Device*> get();
// A device layer of kind `which` (auto, cuda, sim, none), apart from the process's one: for
// tests, and what get() makes from MC_DEVICE.
Result<std::unique_ptr<Device>> make(const std::string& which);
// Whether get() has made a device layer in this process (cheap; never makes one).
bool active();

// The simulation's device count.
constexpr int kSimDevices = 8;

}  // namespace mooncake::engine::device
