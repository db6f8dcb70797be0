// In-process checks of the EP CPU kernels: the baseline and AVX2 builds of combineRows give
// the same bits as a plain float32 loop (order, rounding, signed zero, NaN, infinities).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ep/kernels/combine_rows.h"
#include "ep/layout.h"

namespace mooncake::ep {
namespace {

std::vector<float> specialValues() {
  const float inf = std::numeric_limits<float>::infinity();
  return {0.0f,
          -0.0f,
          1.0f,
          -1.0f,
          inf,
          -inf,
          std::nanf(""),
          1.00390625f /* bf16 tie */,
          3.0e38f,
          -3.0e38f,
          1e-40f /* subnormal */,
          65504.0f};
}

template <typename E>
void runCase(DType t, int n, bool weighted, int64_t hidden, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const auto special = specialValues();
  std::vector<std::vector<E>> rows(n, std::vector<E>(hidden));
  std::vector<float> w(n);
  for (int i = 0; i < n; ++i) {
    w[i] = u(rng);
    for (int64_t h = 0; h < hidden; ++h) {
      float v = (h < static_cast<int64_t>(special.size()) && i == 0) ? special[h] : u(rng);
      if constexpr (sizeof(E) == 2) {
        rows[i][h] = floatToBf16(v);
      } else {
        rows[i][h] = v;
      }
    }
  }
  std::vector<const void*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = rows[i].data();
  // Reference: acc = 0; acc = acc + (w * x) per row in order; round once.
  std::vector<E> ref(hidden), base(hidden), avx(hidden);
  for (int64_t h = 0; h < hidden; ++h) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      float x;
      if constexpr (sizeof(E) == 2) {
        x = bf16ToFloat(rows[i][h]);
      } else {
        x = rows[i][h];
      }
      float p = weighted ? w[i] * x : x;
      acc = acc + p;
    }
    if constexpr (sizeof(E) == 2) {
      ref[h] = floatToBf16(acc);
    } else {
      ref[h] = acc;
    }
  }
  const float* wp = weighted ? w.data() : nullptr;
  kernels::combineRowsBaseline(base.data(), ptrs.data(), wp, n, t, hidden);
  EXPECT_EQ(std::memcmp(ref.data(), base.data(), hidden * sizeof(E)), 0)
      << "baseline n=" << n << " weighted=" << weighted << " H=" << hidden;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) {
    kernels::combineRowsAvx2(avx.data(), ptrs.data(), wp, n, t, hidden);
    EXPECT_EQ(std::memcmp(ref.data(), avx.data(), hidden * sizeof(E)), 0)
        << "avx2 n=" << n << " weighted=" << weighted << " H=" << hidden;
  }
#endif
}

TEST(EpKernels, CombineRowsIsBitExact) {
  for (int n : {0, 1, 2, 3, 8}) {
    for (bool weighted : {false, true}) {
      for (int64_t hidden : {1, 13, 1024, 1500, 7168}) {
        runCase<uint16_t>(DType::kBFloat16, n, weighted, hidden, n * 31 + hidden);
        runCase<float>(DType::kFloat32, n, weighted, hidden, n * 17 + hidden);
      }
    }
  }
}

TEST(EpKernels, Bf16Rounding) {
  EXPECT_EQ(floatToBf16(1.00390625f), 0x3f80);  // tie: to even (down)
  EXPECT_EQ(floatToBf16(1.01171875f), 0x3f82);  // tie: to even (up)
  EXPECT_EQ(floatToBf16(std::nanf("")), 0x7fc0);
  EXPECT_EQ(floatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16ToFloat(0x3f80), 1.0f);
}

TEST(EpLayout, ValidateTopk) {
  std::vector<int64_t> ok = {0, 1, -1, -1, 3, -1};
  EXPECT_NO_THROW(validateTopk(ok.data(), 2, 3, 4));
  std::vector<int64_t> dup = {0, 1, 0};
  EXPECT_THROW(validateTopk(dup.data(), 1, 3, 4), std::invalid_argument);
  std::vector<int64_t> big = {4};
  EXPECT_THROW(validateTopk(big.data(), 1, 1, 4), std::invalid_argument);
  std::vector<int64_t> neg = {-2};
  EXPECT_THROW(validateTopk(neg.data(), 1, 1, 4), std::invalid_argument);
}

TEST(EpLayout, GeometryFitsTheHint) {
  for (int world : {1, 2, 3, 4, 8}) {
    const int experts = (world % 2 ? 1 : 8) * world;
    const size_t bytes = sizeHint(128, 7168, world, experts);
    BufferGeometry g(bytes, world);
    for (DType t : {DType::kBFloat16, DType::kFloat32}) {
      auto l = LowLatencyLayout::make(world, experts, 128, 7168, t);
      EXPECT_LE(std::max(l.dispatch_bytes, l.combine_bytes), g.regionBytes()) << world;
      for (int k : {1, 8, kHintMaxTopk})
        EXPECT_GE(NormalLayout::make(g.regionBytes(), world, k, 7168, t).capacity, 128);
    }
    EXPECT_LE(g.combineRegion(1) + g.regionBytes(), bytes);
    EXPECT_TRUE(g.isSignalRange(g.dispatchSignal(1, kMaxSignals - 1), 8));
    EXPECT_FALSE(g.isSignalRange(g.dispatchRegion(0), 8));
  }
  EXPECT_THROW(BufferGeometry(1024, 2), std::invalid_argument);
}

}  // namespace
}  // namespace mooncake::ep
