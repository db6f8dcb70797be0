// Where tests/gpu/ep_kernel_check runs the low-latency kernels' bodies: memory and the four
// phases of a call, on the host (HostLanes) or on GPU 0 (tests/gpu/ep_kernel_check_cuda.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/normal_kernels.h"

namespace mooncake::ep::kern {

class Exec {
 public:
  virtual ~Exec() = default;
  virtual const char* name() const = 0;
  virtual void* alloc(size_t n) = 0;  // zero-filled
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t n) = 0;
  virtual void download(void* dst, const void* src, size_t n) = 0;
  virtual void zero(void* p, size_t n) = 0;
  // alloc + upload.
  void* put(const void* src, size_t n) {
    void* p = alloc(n);
    if (n) upload(p, src, n);
    return p;
  }
  // n int32 flags the host writes while kernels run and the kernels read (host memory; for
  // a GPU, host-mapped pinned memory): the host's pointer, and in *kernel_view the kernels'.
  virtual int32_t* allocFlags(int n, int32_t** kernel_view) = 0;
  virtual void releaseFlags(int32_t* host) = 0;
  // One rank's phases (queued in order; finish() waits for all and throws on a fault).
  virtual void dispatchSend(const LlArgs& p, int experts, int32_t* toks) = 0;
  virtual void dispatchRecv(const LlArgs& p) = 0;
  virtual void combineSend(const LlArgs& p) = 0;
  virtual void combineRecv(const LlArgs& p) = 0;
  // Normal mode: one call of rank `rank`, in ep/kernels/ll_launch.h's launch order, running
  // concurrently with the other ranks' calls (host: a thread each; cuda: the rank's stream),
  // as the calls of separate processes do. toks: R * T int32 of scratch.
  virtual void normalDispatchSend(int rank, const NormalArgs& p, int32_t* toks) = 0;
  virtual void normalDispatchRecv(int rank, const NormalArgs& p, int32_t* toks) = 0;
  virtual void normalCombine(int rank, const NormalArgs& p) = 0;
  virtual void finish() = 0;
  // Device-to-device copy rate of `bytes` (GB/s), 0 where it means nothing (host).
  virtual double copyRateGBs(size_t bytes) = 0;
};

// GPU 0's executor, or nullptr with *why (no device, or a build without CUDA).
std::unique_ptr<Exec> makeCudaExec(std::string* why);

}  // namespace mooncake::ep::kern
