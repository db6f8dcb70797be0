// ep/kernels/numerics.h against references built here from the formats' definitions: the
// e4m3 value of each of the 256 codes from its fields, the nearest code to a float by search
// over all of them (ties to the even code), DeepEP's fp8 group formula in double precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ep/kernels/numerics.h"

namespace num = mooncake::ep::num;

namespace {

// The value of an e4m3fn code from its definition (NaN for S.1111.111).
double e4m3Value(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}

// Nearest finite code by exhaustive search: ties go to the code with an even mantissa, and
// anything at or beyond the largest finite value saturates to it (CUDA's SATFINITE).
uint8_t e4m3Nearest(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {  // the positive finite codes, ascending
    const double d = std::fabs(e4m3Value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_d = d;
    }
  }
  if (a >= 448.0) best = 0x7e;
  return static_cast<uint8_t>(best | (std::signbit(f) ? 0x80 : 0));
}

TEST(Numerics, E4m3DecodeEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3Value(c);
    const float got = num::e4m3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), c >= 128) << "code " << c;
    }
  }
  EXPECT_EQ(num::e4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(num::e4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(num::e4m3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(Numerics, E4m3EncodeRoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(num::floatToE4m3(num::e4m3ToFloat(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(Numerics, E4m3EncodeMidpointsAndNeighbours) {
  // Between each pair of adjacent codes: the midpoint (a tie) and the floats on either side.
  int checked = 0;
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = static_cast<float>(e4m3Value(c)), hi = static_cast<float>(e4m3Value(c + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);  // exact
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), lo, hi}) {
      for (float s : {f, -f}) {
        ASSERT_EQ(num::floatToE4m3(s), e4m3Nearest(s)) << "f=" << s << " between codes " << c;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(Numerics, E4m3EncodeSpecialsAndRandom) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(num::floatToE4m3(inf), 0x7e);  // saturated
  EXPECT_EQ(num::floatToE4m3(-inf), 0xfe);
  EXPECT_EQ(num::floatToE4m3(500.0f), 0x7e);
  EXPECT_EQ(num::floatToE4m3(464.0f), 0x7e);
  EXPECT_EQ(num::floatToE4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_EQ(num::floatToE4m3(0.0f), 0x00);
  EXPECT_EQ(num::floatToE4m3(-0.0f), 0x80);
  EXPECT_EQ(num::floatToE4m3(1e-30f), 0x00);                      // underflow to zero
  EXPECT_EQ(num::floatToE4m3(std::ldexp(1.0f, -10)), 0x00);       // half the smallest: tie to 0
  EXPECT_EQ(num::floatToE4m3(std::ldexp(1.5f, -10)), 0x01);       // above the tie
  EXPECT_EQ(num::floatToE4m3(std::ldexp(1.0f, -9) * 1.5f), 0x02);  // tie 1.5 -> 2 (even)
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exp(-14.0f, 10.0f), mant(1.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(mant(rng), static_cast<int>(exp(rng)));
    if (rng() & 1) f = -f;
    ASSERT_EQ(num::floatToE4m3(f), e4m3Nearest(f)) << "f=" << f;
  }
}

// (Ties and NaN: EpKernels.Bf16Rounding.) Every finite bf16 value survives a round trip.
TEST(Numerics, Bf16RoundTripsEveryFiniteValue) {
  for (uint32_t v = 0; v < 0x10000; ++v) {
    if (((v >> 7) & 0xff) == 0xff) continue;  // inf, NaN
    ASSERT_EQ(num::floatToBf16(num::bf16ToFloat(static_cast<uint16_t>(v))), v);
  }
}

// DeepEP's group formula, computed here in double and rounded where the float path rounds.
TEST(Numerics, QuantizeRowFollowsTheGroupFormula) {
  const int H = 3 * num::kFp8Group;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(H);
  for (int h = 0; h < H; ++h) x[h] = num::floatToBf16(nd(rng) * (h < 128 ? 300.0f : 0.01f));
  for (int h = 256; h < H; ++h) x[h] = 0;  // an all-zero group: amax is the margin
  x[256 + 5] = num::floatToBf16(-1e-6f);   // (below the margin)
  std::vector<uint8_t> row(num::fp8RowBytes(H));
  ASSERT_EQ(row.size(), static_cast<size_t>(H + 3 * 4));
  num::quantizeRow(x.data(), H, row.data());
  for (int g = 0; g < 3; ++g) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(num::bf16ToFloat(x[g * 128 + i])));
    amax = std::max(amax, 1e-4f);
    const float mul = 448.0f / amax;
    float scale;
    std::memcpy(&scale, row.data() + H + 4 * g, 4);
    EXPECT_EQ(scale, amax * (1.0f / 448.0f)) << "group " << g;
    for (int i = 0; i < 128; ++i) {
      const float v = num::bf16ToFloat(x[g * 128 + i]);
      const uint8_t q = row[g * 128 + i];
      ASSERT_EQ(q, e4m3Nearest(v * mul)) << "group " << g << " channel " << i;
      // Dequantized within half an e4m3 step (2^-4 relative) of x, or of the group's scale
      // for values in the subnormal range.
      const double back = num::e4m3ToFloat(q) * static_cast<double>(scale);
      EXPECT_LE(std::fabs(back - v), std::max(std::fabs(v) / 16.0, scale / 512.0 * 0.5 + 1e-12))
          << "group " << g << " channel " << i;
    }
  }
}

}  // namespace
