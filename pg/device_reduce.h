// Reductions on the GPU: the process group's reduction (pg/reduce.h's semantics) as device
// code queued on the device layer's copy stream, in order with the copies queued there, so
// that GPU data is reduced where it lives. One arithmetic (pg/device_reduce_body.h) in two
// forms: a CUDA kernel (pg/device_reduce.cu, built by nvcc into the library when CMake finds
// the toolkit) and its host form (deviceReduceOnHost), which tests/pg/device_reduce_test.cc
// compares with the CPU's reduceInto bit for bit. The device layer's simulation (MC_DEVICE=sim)
// runs reduceInto itself on its stream (as fast as the host path it stands beside; the same
// results, complex PRODUCT's last bits aside).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/device/device.h"
#include "engine/status.h"
#include "pg/types.h"

namespace mooncake::pg {

// Queues dst[k] (and dst2[k] when non-null) = srcs[0][k] op ... op srcs[n-1][k], k < count,
// on device `ordinal`'s copy stream. Every pointer is memory the device can reach (its own
// memory, a peer's mapped through IPC; on the simulation host memory too); dst may be one of
// the srcs. False, with nothing queued, when there is no GPU form for the call (no device
// layer, a CUDA build without the kernel image, n above 64, a pair reduceSupported refuses):
// the caller reduces on the host. A failed launch throws CommError naming `op_name`.
// `stream`: the layer's copy stream by default, or a stream of the caller's (Device::launchOn).
bool deviceReduceAsync(void* dst, void* dst2, const void* const* srcs, int n, size_t count,
                       DataType t, ReduceOp op, int ordinal, const char* op_name,
                       const void* stream = engine::device::kCopyStream);

// The host form on host memory, run here and now (tests): false as above.
bool deviceReduceOnHost(void* dst, void* dst2, const void* const* srcs, int n, size_t count,
                        DataType t, ReduceOp op);

// Loads the reduction kernel on device `ordinal` now (engine::device::Device::load: a caller
// that gates a stream on an op's completion must, before its first gate). OK without a GPU
// form (the CPU reduces then).
Status prepareDeviceReduce(int ordinal);

// Reductions queued on a device by this process so far (tests).
uint64_t deviceReduceLaunches();

// Whether a kernel image is built in (a CUDA build); the simulation needs none.
bool deviceReduceHasImage();

}  // namespace mooncake::pg
