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
  const int b = static_cast<int>(blockIdx.x);
  switch (l.stage) {
    case kDispatchSend:
      dispatchSend(l.p, b, ln, l.toks + static_cast<int64_t>(b) * l.p.max_tokens);
      break;
    case kDispatchRecv:
      dispatchRecv(l.p, b, ln, ln.nowUs());
      break;
    case kCombineSend:
      combineSend(l.p, b, ln);
      break;
    case kCombineWait:
      combineWait(l.p, b, ln, ln.nowUs());
      break;
    case kCombineToken:
      combineRecvToken(l.p, b, ln);
      break;
    default:
      break;
  }
}

extern "C" __global__ void mc_ep_normal(NormalLaunch l) {
  EntryLanes ln;
  const int b = static_cast<int>(blockIdx.x);
  int32_t* toks = l.toks + static_cast<int64_t>(b) * (l.p.tokens > 0 ? l.p.tokens : 1);
  switch (l.stage) {
    case kNormalDispatchSend:
      normalDispatchSend(l.p, b, ln, toks);
      break;
    case kNormalDispatchWait:
      normalDispatchWait(l.p, b, ln, ln.nowUs());
      break;
    case kNormalDispatchRecv:
      normalDispatchRecv(l.p, b, ln, toks);
      break;
    case kNormalAlign:
      normalAlign(l.p, ln);
      break;
    case kNormalCombineSend:
      normalCombineSend(l.p, b, ln);
      break;
    case kNormalCombineWait:
      normalCombineWait(l.p, b, ln, ln.nowUs());
      break;
    case kNormalCombineToken:
      normalCombineToken(l.p, b, ln);
      break;
    default:
      break;
  }
}
