// The CUDA executor of the EP kernels' bodies (ep/kernels/ll_kernels.h, normal_kernels.h): a
// lane is a thread of the block (blockDim a multiple of 32), signal words are read and written
// with system-scope acquire/release (peers' buffers are CUDA IPC mappings or host memory), the
// deadline clock is %globaltimer. Included by the .cu files only (ll_kernels.cu, the runtime
// API launchers of the GPU check; ll_entry.cu, the module's entry point the device layer loads).
#pragma once

#include <cstdint>

namespace mooncake::ep::kern {

struct CudaLanes {
  __device__ int lane() const { return static_cast<int>(threadIdx.x); }
  __device__ int lanes() const { return static_cast<int>(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  // Block-wide: how many lanes below this one have flag set, and how many in all.
  __device__ int count(bool flag, int* total) {
    __shared__ int per_warp[32];
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) per_warp[w] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & ((1u << l) - 1u)), all = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
      if (i < w) before += per_warp[i];
      all += per_warp[i];
    }
    __syncthreads();  // per_warp is read by every lane before the next call writes it
    *total = all;
    return before;
  }
  __device__ int32_t share(int32_t v) {
    __shared__ int32_t s;
    __syncthreads();
    if (threadIdx.x == 0) s = v;
    __syncthreads();
    const int32_t r = s;
    __syncthreads();
    return r;
  }
  __device__ uint64_t loadAcquire(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ void storeRelease(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
  __device__ void fenceSystem() { __threadfence_system(); }
  __device__ int32_t cas(int32_t* p, int32_t expected, int32_t desired) {
    return atomicCAS_system(reinterpret_cast<int*>(p), expected, desired);
  }
  __device__ void add(int32_t* p, int32_t v) { atomicAdd(reinterpret_cast<int*>(p), v); }
  // The value before (device scope); fenced on both sides: ordered after this thread's earlier
  // accesses and before its later ones (endSend's count of a stage's ended blocks).
  __device__ int32_t fetchAdd(int32_t* p, int32_t v) {
    __threadfence();
    const int32_t r = atomicAdd(reinterpret_cast<int*>(p), v);
    __threadfence();
    return r;
  }
  __device__ void ringDoorbell(uint32_t* p) { atomicAdd_system(reinterpret_cast<unsigned*>(p), 1u); }
  __device__ int64_t nowUs() const {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return static_cast<int64_t>(ns / 1000);
  }
  __device__ int32_t loadFlag(const int32_t* p) const {
    int32_t v;  // host-mapped memory the host writes while the kernel runs
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ void pause() { __nanosleep(256); }
};

}  // namespace mooncake::ep::kern
