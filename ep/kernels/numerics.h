// Signal words and element arithmetic of expert parallelism shared by the CPU path (ep/*.cc) and the CUDA
// kernels (ep/kernels/*.cu): one definition of every rounding, compiled for the host by the
// C++ compiler and for the device by nvcc, so that what the host tests check (tests/ep/
// numerics_test.cc, the Python EP tests) is the arithmetic the kernels run.
//
//   bf16 <-> float   bit-exact with torch's c10::BFloat16 (round to nearest even, NaN 0x7fc0)
//   e4m3 <-> float   OCP FP8 E4M3 ("e4m3fn": no infinities, NaN S.1111.111, max 448), round
//                    to nearest even, saturating finite values to +-448 (as CUDA's
//                    __NV_SATFINITE conversion)
//   fp8 groups       DeepEP's low-latency fp8 dispatch: per token and per 128 channels,
//                    amax = max(|x|, 1e-4), x_fp8 = e4m3(x * (448 / amax)), and the scale
//                    kept beside it is amax * (1 / 448) (x ~= float(x_fp8) * scale)
//
// No FMA contraction may touch these (ep/CMakeLists.txt builds with -ffp-contract=off; the
// kernels with --fmad=false).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MC_HD __host__ __device__ __forceinline__
// Before a host/device template whose executor type is host-only or device-only (the
// kernels' bodies, instantiated with HostLanes or CudaLanes): no cross-space warning.
#define MC_HD_TEMPLATE _Pragma("nv_exec_check_disable")
#else
#define MC_HD inline
#define MC_HD_TEMPLATE
#endif

namespace mooncake::ep::num {

MC_HD uint32_t floatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MC_HD float bitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- signal words ----
// Signal words carry the round so a word left by an earlier round (or by a rank that died
// before writing this round's) never matches. Rounds start at 1; a zeroed word is "never".
MC_HD uint64_t makeSignal(uint32_t round, uint32_t count) {
  return (static_cast<uint64_t>(round) << 32) | count;
}
MC_HD uint32_t signalRound(uint64_t s) { return static_cast<uint32_t>(s >> 32); }
MC_HD uint32_t signalCount(uint64_t s) { return static_cast<uint32_t>(s & 0xffffffffu); }
// Round a came after round b (32-bit rounds compared as a wrapping sequence).
MC_HD bool roundAfter(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) > 0; }

// ---- bfloat16 ----
MC_HD float bf16ToFloat(uint16_t v) { return bitsFloat(static_cast<uint32_t>(v) << 16); }
MC_HD uint16_t floatToBf16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as c10::BFloat16
  u += ((u >> 16) & 1u) + 0x7fffu;                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// ---- FP8 E4M3 (fn) ----
constexpr float kE4m3Max = 448.0f;
constexpr uint8_t kE4m3Nan = 0x7f;

MC_HD float e4m3ToFloat(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  if (e == 15 && m == 7) return bitsFloat(0x7fc00000u);
  if (e == 0) return sign * static_cast<float>(m) * (1.0f / 512.0f);  // m * 2^-9
  // (8 + m) * 2^(e - 10), exactly: an exponent field of e - 10 + 127 with mantissa m/8.
  return sign * bitsFloat(((e + 120u) << 23) | (m << 20));
}

MC_HD uint8_t floatToE4m3(float f) {
  uint32_t u = floatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | kE4m3Nan;  // NaN stays NaN
  if (u >= 0x43e00000u) return sign | 0x7e;     // >= 448 (and inf): saturate to 448
  if (u < 0x3c800000u) {                        // below 2^-6: a multiple of 2^-9
    // |f| * 512 < 8 is exact; adding and removing 2^23 rounds it to an integer, ties to
    // even, in float arithmetic (no rounding-mode or library call: the same on the device).
    const float q = (bitsFloat(u) * 512.0f + 8388608.0f) - 8388608.0f;
    return sign | static_cast<uint8_t>(q);  // 8 is 2^-6, the smallest normal: same bits
  }
  // Normal: keep 3 of 23 mantissa bits, ties to even; a carry moves into the exponent.
  const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);
  return sign | static_cast<uint8_t>((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}

// ---- DeepEP's fp8 groups ----
constexpr int kFp8Group = 128;        // channels per scale
constexpr float kFp8Margin = 1e-4f;   // smallest amax a group's scale is made from

// Multiplier applied before the conversion, and the scale stored for the group.
MC_HD float fp8Multiplier(float amax) { return kE4m3Max / (amax > kFp8Margin ? amax : kFp8Margin); }
MC_HD float fp8Scale(float amax) { return (amax > kFp8Margin ? amax : kFp8Margin) * (1.0f / kE4m3Max); }

// One group of kFp8Group bf16 values to e4m3 bytes; returns the group's scale.
MC_HD float quantizeGroup(const uint16_t* x, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < kFp8Group; ++i) {
    const float m = bf16ToFloat(static_cast<uint16_t>(x[i] & 0x7fffu));  // |x|, no branch
    amax = m > amax ? m : amax;  // (a NaN never wins: the comparison is false)
  }
  const float mul = fp8Multiplier(amax);
  for (int i = 0; i < kFp8Group; ++i) out[i] = floatToE4m3(bf16ToFloat(x[i]) * mul);
  return fp8Scale(amax);
}

// The wire row of an fp8 token: H e4m3 bytes, then H/128 float32 scales.
MC_HD uint64_t fp8RowBytes(int64_t hidden) {
  return static_cast<uint64_t>(hidden) + static_cast<uint64_t>(hidden / kFp8Group) * 4u;
}

// Quantizes one token of `hidden` (a multiple of kFp8Group) bf16 values into its wire row.
MC_HD void quantizeRow(const uint16_t* x, int64_t hidden, uint8_t* row) {
  float* scales = reinterpret_cast<float*>(row + hidden);
  for (int64_t g = 0; g < hidden / kFp8Group; ++g) {
    const float s = quantizeGroup(x + g * kFp8Group, row + g * kFp8Group);
    memcpy(scales + g, &s, 4);  // (row + hidden need not be 4-byte aligned)
  }
}

}  // namespace mooncake::ep::num
