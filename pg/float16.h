// Scalar float16 / bfloat16 <-> float32 conversions, round to nearest even (internal;
// pg/reduce.h exposes them as functions). Header-only so that the kernels inline them: the
// CPU's (pg/reduce_kernels.h) and the GPU reduction's (pg/device_reduce_body.h, compiled by
// nvcc too), so both round the same way by construction.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MC_PG_HD __host__ __device__ __forceinline__
#else
#define MC_PG_HD inline
#endif

namespace mooncake::pg::detail {

MC_PG_HD uint32_t bitsOf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MC_PG_HD float floatOf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

MC_PG_HD float halfToFloatInline(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in float32.
    float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return floatOf(sign | bitsOf(v));
  }
  if (exp == 31) return floatOf(sign | 0x7f800000u | (man << 13));
  return floatOf(sign | ((exp + 112u) << 23) | (man << 13));
}

MC_PG_HD uint16_t floatToHalfInline(float f) {
  uint32_t x = bitsOf(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)  // inf or NaN (NaN stays NaN, quieted)
    return sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                         // below 2^-14: half subnormal (or zero)
    float v = floatOf(ax) * 16777216.0f;          // exact: scaled by 2^24
    return sign | static_cast<uint16_t>(static_cast<int>(rintf(v)));  // to nearest even
  }
  uint32_t r = ax - 0x38000000u;  // rebias the exponent (127 - 15 = 112)
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

MC_PG_HD float bf16ToFloatInline(uint16_t h) { return floatOf(static_cast<uint32_t>(h) << 16); }

// torch's round_to_nearest_even: NaN -> 0x7fc0.
MC_PG_HD uint16_t floatToBf16Inline(float f) {
  uint32_t x = bitsOf(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace mooncake::pg::detail
