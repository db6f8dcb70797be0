// CPU kernel behind ep::combineRows (ep/layout.h), included by layout.cc (baseline x86-64)
// and by combine_rows_avx2.cc (built with -mavx2, chosen at run time): one source, two
// instruction sets, identical IEEE operations (multiply, then add; never fused), so both
// give the same bits.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ep/layout.h"

namespace mooncake::ep::kernels {

// Internal linkage on purpose: each including file gets its own copy, compiled for its own
// instruction set (shared inline/template symbols would let the linker mix them).
namespace {

template <DType T>
inline float load(const void* row, int64_t h) {
  if constexpr (T == DType::kFloat32) {
    return static_cast<const float*>(row)[h];
  } else {
    uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[h]) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
}

template <DType T>
inline void store(void* out, int64_t h, float v) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(out)[h] = v;
  } else {  // floatToBf16 without a branch, so that the loop vectorises
    uint32_t u;
    __builtin_memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    static_cast<uint16_t*>(out)[h] =
        static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}

template <DType T, bool kWeighted>
void combineRowsT(void* out, const void* const* rows, const float* weights, int n, int64_t hidden) {
  constexpr int64_t kTile = 1024;
  float acc[kTile];
  for (int64_t h0 = 0; h0 < hidden; h0 += kTile) {
    const int64_t len = std::min<int64_t>(kTile, hidden - h0);
    if (n == 0) {
      for (int64_t h = 0; h < len; ++h) store<T>(out, h0 + h, 0.0f);
      continue;
    }
    // 0.0f + p keeps the reference's sign of zero (-0.0 + 0.0 is +0.0).
    for (int64_t h = 0; h < len; ++h) {
      const float p = kWeighted ? weights[0] * load<T>(rows[0], h0 + h) : load<T>(rows[0], h0 + h);
      acc[h] = 0.0f + p;
    }
    for (int i = 1; i + 1 < n; ++i) {
      const float w = kWeighted ? weights[i] : 1.0f;
      for (int64_t h = 0; h < len; ++h) {
        const float p = kWeighted ? w * load<T>(rows[i], h0 + h) : load<T>(rows[i], h0 + h);
        acc[h] += p;
      }
    }
    if (n == 1) {
      for (int64_t h = 0; h < len; ++h) store<T>(out, h0 + h, acc[h]);
    } else {
      const int i = n - 1;
      const float w = kWeighted ? weights[i] : 1.0f;
      for (int64_t h = 0; h < len; ++h) {
        const float p = kWeighted ? w * load<T>(rows[i], h0 + h) : load<T>(rows[i], h0 + h);
        store<T>(out, h0 + h, acc[h] + p);
      }
    }
  }
}

}  // namespace

// Entry points of each instruction set (same contract as ep::combineRows).
void combineRowsBaseline(void* out, const void* const* rows, const float* weights, int n, DType t,
                         int64_t hidden);
void combineRowsAvx2(void* out, const void* const* rows, const float* weights, int n, DType t,
                     int64_t hidden);

#define MC_EP_COMBINE_ROWS_ENTRY(name)                                                \
  void name(void* out, const void* const* rows, const float* weights, int n, DType t, \
            int64_t hidden) {                                                         \
    if (t == DType::kFloat32) {                                                       \
      if (weights)                                                                    \
        combineRowsT<DType::kFloat32, true>(out, rows, weights, n, hidden);           \
      else                                                                            \
        combineRowsT<DType::kFloat32, false>(out, rows, weights, n, hidden);          \
    } else {                                                                          \
      if (weights)                                                                    \
        combineRowsT<DType::kBFloat16, true>(out, rows, weights, n, hidden);          \
      else                                                                            \
        combineRowsT<DType::kBFloat16, false>(out, rows, weights, n, hidden);         \
    }                                                                                 \
  }

}  // namespace mooncake::ep::kernels
