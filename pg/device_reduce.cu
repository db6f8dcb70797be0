// The process group's reduction kernel (pg/device_reduce.h): one thread per element, grid
// stride, the arithmetic of pg/device_reduce_body.h. Built into a fatbin by nvcc (--fmad=false:
// no contraction, so its float arithmetic is the host form's) and embedded in the library; the
// device layer loads it with the driver API (engine/device/device.h, Kernel).
#include "pg/device_reduce_body.h"

namespace {
using mooncake::pg::devred::Params;

struct GridLoop {
  const Params* p;
  template <class F>
  __device__ void operator()(uint64_t count, F f) const {
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count;
         k += stride)
      f(*p, k);
  }
};
}  // namespace

extern "C" __global__ void mc_pg_reduce(Params p) {
  (void)mooncake::pg::devred::dispatch(p, GridLoop{&p});
}
