// Typed element-wise reductions over n inputs, for every DataType x ReduceOp pair that
// reduceSupported() accepts. Vectorised: the kernels are compiled twice (baseline x86-64
// and AVX2+F16C+FMA) and the best one for the running CPU is picked once.
//
// Semantics (mirroring torch; gloo where torch leaves it to the backend):
//   - The n inputs are folded left in the order given: ((s0 op s1) op s2) ... so every
//     caller that lists contributions in rank order gets bit-identical results everywhere.
//   - float16/bfloat16: every input is converted to float32, the n inputs are combined in
//     float32 and the result is rounded once (round to nearest even; NaN -> quiet NaN).
//     (One call. The hierarchical all-reduce across hosts with several ranks on a host,
//     algorithms/allreduce.cc, reduces each host first and keeps that partial sum in the
//     tensor's dtype: its fp16/bf16 results are rounded twice, and folded host by host.)
//   - AVG: SUM divided by n. Floating and complex types divide in their accumulation type
//     (float32 for fp16/bf16). Integers: the exact sum (accumulated in 64 bits) divided
//     by n, truncated toward zero (NCCL's behaviour; gloo has no AVG). bool: unsupported.
//   - Integer SUM/PRODUCT wrap modulo 2^bits (two's complement), as torch does.
//   - bool: SUM = MAX = BOR = logical or, PRODUCT = MIN = BAND = logical and, BXOR = xor.
//   - MIN/MAX on floating types: std::min/std::max per pair (NaN handling unspecified, as gloo).
//   - complex: SUM, AVG and PRODUCT only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pg/types.h"

namespace mooncake::pg {

// dst[k] = srcs[0][k] op ... op srcs[nsrc-1][k] for k < count (nsrc >= 1; AVG divides by
// nsrc). dst may be exactly one of the srcs (same address), never a partial overlap.
// dst2, when non-null, receives a copy of the result (written from cache with streaming
// stores, fenced: meant for a shared comm buffer, see pg/copy.h); dst may then be null.
// stream_dst: write dst with streaming stores too (large outputs that would not stay in
// cache anyway: saves the read-for-ownership of every output line).
// Throws std::invalid_argument when !reduceSupported(t, op).
void reduceInto(void* dst, void* dst2, const void* const* srcs, int nsrc, size_t count,
                DataType t, ReduceOp op, bool stream_dst = false);

// Name of the kernel set in use ("avx2" or "baseline"), for logs and benchmarks.
const char* reduceIsa();

// Scalar conversions (round to nearest even), also used by tests.
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float bf16ToFloat(uint16_t h);
uint16_t floatToBf16(float f);

}  // namespace mooncake::pg
