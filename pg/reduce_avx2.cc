// Reduction kernels for x86-64 with AVX2, FMA and F16C (compiled with -mavx2 -mfma -mf16c,
// see pg/CMakeLists.txt; only called after a CPUID check in reduce.cc).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace mooncake::pg::avx2 {
inline void h2fBlock(const uint16_t* s, float* d, size_t m) {
  size_t k = 0;
  for (; k + 8 <= m; k += 8)
    _mm256_storeu_ps(d + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k))));
  for (; k < m; ++k) d[k] = _cvtsh_ss(s[k]);
}
inline void f2hBlock(const float* s, uint16_t* d, size_t m) {
  size_t k = 0;
  for (; k + 8 <= m; k += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + k), _MM_FROUND_TO_NEAREST_INT));
  for (; k < m; ++k) d[k] = _cvtss_sh(s[k], _MM_FROUND_TO_NEAREST_INT);
}
}  // namespace mooncake::pg::avx2

#define MC_PG_ISA_NS avx2
#include "pg/reduce_kernels.h"

namespace mooncake::pg {
void reduceAvx2(void* d, void* d2, const void* const* s, int n, size_t c, DataType t,
                ReduceOp op, bool sd) {
  avx2::reduceImpl(d, d2, s, n, c, t, op, sd);
}
}  // namespace mooncake::pg

// ---- fused float32 kernel for the streaming cases ----
// When the result goes to a shared buffer and/or is streamed to a large output, the block
// kernel's compute-into-L1-then-copy costs ~30% on DRAM-resident data (measured: 1 MiB of
// a+b streamed to two destinations 154-203 us blocked vs 117 us fused). This one loads all
// sources, combines them in registers and streams each 32-byte vector to its destinations.
namespace mooncake::pg {

namespace {

template <ReduceOp kOp>
__m256 combine(__m256 a, __m256 b) {
  if constexpr (kOp == ReduceOp::kSum || kOp == ReduceOp::kAvg) return _mm256_add_ps(a, b);
  if constexpr (kOp == ReduceOp::kProduct) return _mm256_mul_ps(a, b);
  if constexpr (kOp == ReduceOp::kMin) return _mm256_min_ps(b, a);  // b < a ? b : a
  return _mm256_max_ps(b, a);                                       // a < b ? b : a
}

template <ReduceOp kOp>
void fusedLoop(float* dst, bool stream_dst, float* dst2, const float* const* s, int n,
               size_t count) {
  const __m256 inv = _mm256_set1_ps(static_cast<float>(n));
  for (size_t k = 0; k < count; k += 8) {
    __m256 acc = combine<kOp>(_mm256_loadu_ps(s[0] + k), _mm256_loadu_ps(s[1] + k));
    for (int j = 2; j < n; ++j) acc = combine<kOp>(acc, _mm256_loadu_ps(s[j] + k));
    if constexpr (kOp == ReduceOp::kAvg) acc = _mm256_div_ps(acc, inv);
    if (dst != nullptr) {
      if (stream_dst) {
        _mm256_stream_ps(dst + k, acc);
      } else {
        _mm256_storeu_ps(dst + k, acc);
      }
    }
    if (dst2 != nullptr) _mm256_stream_ps(dst2 + k, acc);
  }
}

}  // namespace

// Handles float32 with nsrc >= 2 when the streamed destinations are 32-byte aligned (the
// scalar head/tail goes through the block kernel). Returns false when it does not apply.
bool reduceFusedFloatAvx2(float* dst, float* dst2, const float* const* s, int n, size_t count,
                          ReduceOp op, bool stream_dst) {
  if (n < 2 || n > 64 || count < 64) return false;
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg && op != ReduceOp::kProduct &&
      op != ReduceOp::kMin && op != ReduceOp::kMax)
    return false;
  auto mis = [](const float* p) { return reinterpret_cast<uintptr_t>(p) & 31; };
  // Elements until the streamed destinations are aligned; they must agree.
  const float* lead = dst2 != nullptr ? dst2 : dst;
  size_t head = ((32 - mis(lead)) & 31) / 4;
  if ((mis(lead) & 3) != 0) return false;
  if (dst2 != nullptr && dst != nullptr && stream_dst && mis(dst) != mis(dst2)) return false;
  size_t body = (count - head) & ~static_cast<size_t>(7);
  if (head > 0) avx2::reduceImpl(dst, dst2, reinterpret_cast<const void* const*>(s), n, head,
                                 DataType::kFloat32, op, stream_dst);
  const float* moved[64];
  for (int j = 0; j < n; ++j) moved[j] = s[j] + head;
  float* d = dst != nullptr ? dst + head : nullptr;
  float* d2 = dst2 != nullptr ? dst2 + head : nullptr;
  switch (op) {
    case ReduceOp::kSum: fusedLoop<ReduceOp::kSum>(d, stream_dst, d2, moved, n, body); break;
    case ReduceOp::kAvg: fusedLoop<ReduceOp::kAvg>(d, stream_dst, d2, moved, n, body); break;
    case ReduceOp::kProduct: fusedLoop<ReduceOp::kProduct>(d, stream_dst, d2, moved, n, body); break;
    case ReduceOp::kMin: fusedLoop<ReduceOp::kMin>(d, stream_dst, d2, moved, n, body); break;
    default: fusedLoop<ReduceOp::kMax>(d, stream_dst, d2, moved, n, body); break;
  }
  size_t tail = count - head - body;
  if (tail > 0) {
    const float* rest[64];
    for (int j = 0; j < n; ++j) rest[j] = s[j] + head + body;
    avx2::reduceImpl(dst != nullptr ? dst + head + body : nullptr,
                     dst2 != nullptr ? dst2 + head + body : nullptr,
                     reinterpret_cast<const void* const*>(rest), n, tail, DataType::kFloat32, op,
                     stream_dst);
  }
  return true;
}

}  // namespace mooncake::pg
