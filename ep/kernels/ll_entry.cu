// mc_ep_ll and mc_ep_normal: the low-latency and normal kernels' bodies (ep/kernels/
// ll_kernels.h, normal_kernels.h) as one CUDA kernel each with a stage (ep/kernels/ll_entry.h),
// built by nvcc into the fatbin that ep/ll_device.cc embeds and the device layer loads
// (cuModuleLoadData) and launches on the device's copy stream.
#include "ep/kernels/cuda_lanes.cuh"
#include "ep/kernels/ll_entry.h"
#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/normal_kernels.h"

using namespace mooncake::ep::kern;

// A GPU buffer's peers have no host waiters (no futex sleeps on its doorbell): no system-scope
// atomic on a peer GPU's memory per signal.
struct EntryLanes : CudaLanes {
  __device__ void ringDoorbell(uint32_t*) {}
};

extern "C" __global__ void mc_ep_ll(LlLaunch l) {
  EntryLanes ln;
  llBlock(l, static_cast<int>(blockIdx.x), ln, ln.nowUs());
}

extern "C" __global__ void mc_ep_normal(NormalLaunch l) {
  EntryLanes ln;
  normalBlock(l, static_cast<int>(blockIdx.x), ln, ln.nowUs());
}
