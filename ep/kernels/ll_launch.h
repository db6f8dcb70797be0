// Launchers of the low-latency kernels (ep/kernels/ll_kernels.cu), on a CUDA stream (a
// cudaStream_t passed as void*, so that callers need no CUDA header). Each returns the
// cudaError_t of the launch as an int (0: launched). Order on one stream per call:
//   dispatch: launchDispatchSend (E blocks; toks: device scratch of E * M int32), then
//             launchDispatchRecv (L blocks)
//   combine:  launchCombineSend (R blocks), then launchCombineRecv (R wait blocks, then one
//             block per token)
// LlArgs' pointers are device (or host-mapped) addresses; its scratch (decision, self_count,
// error) zeroed before the call's first launch, self_count kept from dispatch send to recv.
#pragma once

#include <cstdint>

#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/normal_kernels.h"

namespace mooncake::ep::kern {

constexpr int kLanes = 256;  // threads per block

int launchDispatchSend(const LlArgs& p, int experts, int32_t* toks, void* stream);
int launchDispatchRecv(const LlArgs& p, void* stream);
int launchCombineSend(const LlArgs& p, void* stream);
int launchCombineRecv(const LlArgs& p, void* stream);

// Normal mode (ep/kernels/normal_kernels.h). toks: device scratch of R * T int32.
//   dispatch: launchNormalDispatchSend (sends, then the waits that fill counts), the host
//             reads counts and sizes the outputs, launchNormalDispatchRecv (receive, align)
//   combine:  launchNormalCombine (sends, waits, then a block per token)
int launchNormalDispatchSend(const NormalArgs& p, int32_t* toks, void* stream);
int launchNormalDispatchRecv(const NormalArgs& p, int32_t* toks, void* stream);
int launchNormalCombine(const NormalArgs& p, void* stream);

}  // namespace mooncake::ep::kern
