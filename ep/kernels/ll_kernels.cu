// CUDA executor of the low-latency kernels' bodies (ep/kernels/ll_kernels.h): a lane is a
// thread of the block (blockDim a multiple of 32), signal words are read and written with
// system-scope acquire/release (peers' buffers are CUDA IPC mappings or host memory), the
// deadline clock is %globaltimer. The same bodies run on the host in the tests
// (ep/kernels/host_lanes.h); see ep/kernels/ll_launch.h for what is launched when.
#include <cuda_runtime.h>

#include "ep/kernels/cuda_lanes.cuh"
#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/ll_launch.h"
#include "ep/kernels/normal_kernels.h"

namespace mooncake::ep::kern {

namespace {

__global__ void dispatchSendKernel(LlArgs p, int32_t* toks) {
  CudaLanes ln;
  dispatchSend(p, blockIdx.x, ln, toks + static_cast<int64_t>(blockIdx.x) * p.max_tokens);
}
__global__ void dispatchRecvKernel(LlArgs p) {
  CudaLanes ln;
  dispatchRecv(p, blockIdx.x, ln, ln.nowUs());
}
__global__ void combineSendKernel(LlArgs p) {
  CudaLanes ln;
  combineSend(p, blockIdx.x, ln);
}
__global__ void combineWaitKernel(LlArgs p) {
  CudaLanes ln;
  combineWait(p, blockIdx.x, ln, ln.nowUs());
}
__global__ void combineRecvKernel(LlArgs p) {
  CudaLanes ln;
  combineRecvToken(p, blockIdx.x, ln);
}

__global__ void normalDispatchSendKernel(NormalArgs p, int32_t* toks) {
  CudaLanes ln;
  normalDispatchSend(p, blockIdx.x, ln, toks + static_cast<int64_t>(blockIdx.x) * p.tokens);
}
__global__ void normalDispatchWaitKernel(NormalArgs p) {
  CudaLanes ln;
  normalDispatchWait(p, blockIdx.x, ln, ln.nowUs());
}
__global__ void normalDispatchRecvKernel(NormalArgs p, int32_t* toks) {
  CudaLanes ln;
  normalDispatchRecv(p, blockIdx.x, ln, toks + static_cast<int64_t>(blockIdx.x) * p.tokens);
}
__global__ void normalAlignKernel(NormalArgs p) {
  CudaLanes ln;
  normalAlign(p, ln);
}
__global__ void normalCombineSendKernel(NormalArgs p) {
  CudaLanes ln;
  normalCombineSend(p, blockIdx.x, ln);
}
__global__ void normalCombineWaitKernel(NormalArgs p) {
  CudaLanes ln;
  normalCombineWait(p, blockIdx.x, ln, ln.nowUs());
}
__global__ void normalCombineTokenKernel(NormalArgs p) {
  CudaLanes ln;
  normalCombineToken(p, blockIdx.x, ln);
}

int asInt(cudaError_t e) { return static_cast<int>(e); }

// Every kernel of this file loaded before the first launch. With lazy loading (CUDA's default
// since 12.2) a kernel loads at its first launch, and loading may wait for the context's
// running kernels: a wait kernel spinning on a peer whose send kernel this thread has yet to
// launch then stalls the launch until its deadline. That is how we read the GPU machine's first
// run (2026-12-04, docs/gpu.md): in normal mode's first round on one GPU, rank 0's combined
// weights came out 0 while its rows were right. cudaFuncGetAttributes loads a kernel.
int loadAll() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(dispatchSendKernel),
      reinterpret_cast<const void*>(dispatchRecvKernel),
      reinterpret_cast<const void*>(combineSendKernel),
      reinterpret_cast<const void*>(combineWaitKernel),
      reinterpret_cast<const void*>(combineRecvKernel),
      reinterpret_cast<const void*>(normalDispatchSendKernel),
      reinterpret_cast<const void*>(normalDispatchWaitKernel),
      reinterpret_cast<const void*>(normalDispatchRecvKernel),
      reinterpret_cast<const void*>(normalAlignKernel),
      reinterpret_cast<const void*>(normalCombineSendKernel),
      reinterpret_cast<const void*>(normalCombineWaitKernel),
      reinterpret_cast<const void*>(normalCombineTokenKernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes a;
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return asInt(e);
  }
  return 0;
}
int loaded() {
  static const int e = loadAll();  // (once per process, thread-safe)
  return e;
}

}  // namespace

int launchDispatchSend(const LlArgs& p, int experts, int32_t* toks, void* stream) {
  if (int e = loaded()) return e;
  dispatchSendKernel<<<experts, kLanes, 0, static_cast<cudaStream_t>(stream)>>>(p, toks);
  return asInt(cudaGetLastError());
}
int launchDispatchRecv(const LlArgs& p, void* stream) {
  if (int e = loaded()) return e;
  dispatchRecvKernel<<<p.local_experts, kLanes, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return asInt(cudaGetLastError());
}
int launchCombineSend(const LlArgs& p, void* stream) {
  if (int e = loaded()) return e;
  combineSendKernel<<<p.world, kLanes, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return asInt(cudaGetLastError());
}
int launchCombineRecv(const LlArgs& p, void* stream) {
  if (int e = loaded()) return e;
  auto s = static_cast<cudaStream_t>(stream);
  combineWaitKernel<<<p.world, kLanes, 0, s>>>(p);
  if (p.tokens > 0) combineRecvKernel<<<static_cast<unsigned>(p.tokens), kLanes, 0, s>>>(p);
  return asInt(cudaGetLastError());
}

int launchNormalDispatchSend(const NormalArgs& p, int32_t* toks, void* stream) {
  if (int e = loaded()) return e;
  auto s = static_cast<cudaStream_t>(stream);
  normalDispatchSendKernel<<<p.world, kLanes, 0, s>>>(p, toks);
  normalDispatchWaitKernel<<<p.world, kLanes, 0, s>>>(p);
  return asInt(cudaGetLastError());
}
int launchNormalDispatchRecv(const NormalArgs& p, int32_t* toks, void* stream) {
  if (int e = loaded()) return e;
  auto s = static_cast<cudaStream_t>(stream);
  normalDispatchRecvKernel<<<p.world, kLanes, 0, s>>>(p, toks);
  normalAlignKernel<<<1, kLanes, 0, s>>>(p);
  return asInt(cudaGetLastError());
}
int launchNormalCombine(const NormalArgs& p, void* stream) {
  if (int e = loaded()) return e;
  auto s = static_cast<cudaStream_t>(stream);
  normalCombineSendKernel<<<p.world, kLanes, 0, s>>>(p);
  normalCombineWaitKernel<<<p.world, kLanes, 0, s>>>(p);
  if (p.tokens > 0) normalCombineTokenKernel<<<static_cast<unsigned>(p.tokens), kLanes, 0, s>>>(p);
  return asInt(cudaGetLastError());
}

}  // namespace mooncake::ep::kern
