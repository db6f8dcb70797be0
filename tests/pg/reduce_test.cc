// pg/reduce: every supported dtype x op x number of inputs against the reference in
// pg_reference.h, bit for bit; aliasing of the destination; the second destination;
// float16/bfloat16 conversions against the compiler's _Float16.
#include "pg/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <stdexcept>
#include <vector>

#include "tests/pg/pg_reference.h"

namespace mooncake::pg::test {
namespace {

TEST(PgReduce, EveryTypeOpAndArity) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      if (!reduceSupported(t, op)) continue;
      if (isComplex(t) && op == ReduceOp::kProduct) continue;  // separate test (tolerance)
      for (int n = 1; n <= 4; ++n) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{3001}}) {
          const size_t es = dtypeSize(t);
          std::vector<std::vector<char>> in(n, std::vector<char>(count * es + 1));
          std::vector<const void*> ptrs;
          for (int r = 0; r < n; ++r) {
            fill(t, in[r].data(), count, r, static_cast<uint32_t>(count));
            ptrs.push_back(in[r].data());
          }
          std::vector<char> want(count * es + 1), got(count * es + 1), copy(count * es + 1);
          refReduce(t, op, ptrs, count, want.data());
          reduceInto(got.data(), copy.data(), ptrs.data(), n, count, t, op);
          int64_t d = firstDiff(got.data(), want.data(), count, es);
          EXPECT_EQ(d, -1) << dtypeName(t) << " " << reduceOpName(op) << " n=" << n
                           << " count=" << count;
          EXPECT_EQ(firstDiff(copy.data(), want.data(), count, es), -1) << "second destination";
          // Streaming stores to the destination, and a result for the shared buffer only.
          std::vector<char> streamed(count * es + 1), shared_only(count * es + 1);
          reduceInto(streamed.data(), nullptr, ptrs.data(), n, count, t, op, true);
          reduceInto(nullptr, shared_only.data(), ptrs.data(), n, count, t, op);
          EXPECT_EQ(firstDiff(streamed.data(), want.data(), count, es), -1) << "streamed";
          EXPECT_EQ(firstDiff(shared_only.data(), want.data(), count, es), -1) << "shared only";
          // In place: the destination is one of the inputs.
          if (count > 0) {
            int k = n - 1;
            std::vector<char> alias = in[k];
            std::vector<const void*> p2 = ptrs;
            p2[k] = alias.data();
            reduceInto(alias.data(), nullptr, p2.data(), n, count, t, op);
            EXPECT_EQ(firstDiff(alias.data(), want.data(), count, es), -1)
                << "in place " << dtypeName(t) << " " << reduceOpName(op) << " n=" << n;
          }
        }
      }
    }
  }
}

// The fused float32 path (streamed destinations): every alignment of the destinations.
TEST(PgReduce, Float32StreamingAlignments) {
  const size_t count = 1003;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                      ReduceOp::kProduct}) {
    for (int n = 2; n <= 4; ++n) {
      std::vector<std::vector<float>> in(n, std::vector<float>(count + 16));
      for (int r = 0; r < n; ++r) fill(DataType::kFloat32, in[r].data(), count + 16, r, 9);
      for (size_t so = 0; so < 8; ++so) {
        std::vector<const void*> ptrs;
        for (int r = 0; r < n; ++r) ptrs.push_back(in[r].data() + so);
        std::vector<float> want(count);
        refReduce(DataType::kFloat32, op, ptrs, count, want.data());
        for (size_t d1 = 0; d1 < 8; d1 += 3) {
          for (size_t d2 = 0; d2 < 8; d2 += 2) {
            alignas(64) static float a[2048], b[2048];
            reduceInto(a + d1, b + d2, ptrs.data(), n, count, DataType::kFloat32, op, true);
            ASSERT_EQ(firstDiff(a + d1, want.data(), count, 4), -1) << reduceOpName(op) << n << so << d1 << d2;
            ASSERT_EQ(firstDiff(b + d2, want.data(), count, 4), -1) << reduceOpName(op) << n << so << d1 << d2;
            reduceInto(a + d1, b + d2, ptrs.data(), n, count, DataType::kFloat32, op, false);
            ASSERT_EQ(firstDiff(a + d1, want.data(), count, 4), -1);
            ASSERT_EQ(firstDiff(b + d2, want.data(), count, 4), -1);
            reduceInto(nullptr, b + d2, ptrs.data(), n, count, DataType::kFloat32, op, false);
            ASSERT_EQ(firstDiff(b + d2, want.data(), count, 4), -1);
          }
        }
      }
    }
  }
}

TEST(PgReduce, ComplexProduct) {
  const size_t count = 777;
  for (int n = 2; n <= 4; ++n) {
    std::vector<std::vector<std::complex<double>>> in(n, std::vector<std::complex<double>>(count));
    std::vector<const void*> ptrs;
    for (int r = 0; r < n; ++r) {
      fill(DataType::kComplex128, in[r].data(), count, r, 3);
      ptrs.push_back(in[r].data());
    }
    std::vector<std::complex<double>> got(count);
    reduceInto(got.data(), nullptr, ptrs.data(), n, count, DataType::kComplex128, ReduceOp::kProduct);
    for (size_t i = 0; i < count; ++i) {
      std::complex<double> w = in[0][i];
      for (int r = 1; r < n; ++r) w *= in[r][i];
      ASSERT_NEAR(got[i].real(), w.real(), 1e-9 * (1 + std::abs(w))) << i;
      ASSERT_NEAR(got[i].imag(), w.imag(), 1e-9 * (1 + std::abs(w))) << i;
    }
  }
}

TEST(PgReduce, HalfPrecisionAccumulatesInFloat) {
  // 2048 + 1 + 1 in float16: folding in fp16 gives 2048 (each +1 rounds away), fp32
  // accumulation gives 2050 (exactly representable).
  uint16_t a = fToF16(2048.0f), b = fToF16(1.0f), c = fToF16(1.0f);
  const void* srcs[] = {&a, &b, &c};
  uint16_t out = 0;
  reduceInto(&out, nullptr, srcs, 3, 1, DataType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(f16ToF(out), 2050.0f);
  uint16_t ba = fToBf16(256.0f), bb = fToBf16(1.0f), bc = fToBf16(1.0f);
  const void* bsrcs[] = {&ba, &bb, &bc};
  reduceInto(&out, nullptr, bsrcs, 3, 1, DataType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(bf16ToF(out), 258.0f);
}

TEST(PgReduce, ConversionsMatchTheCompiler) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float want = f16ToF(static_cast<uint16_t>(h));
    float got = halfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << std::hex << h;
  }
  for (uint64_t u = 0; u < (1ull << 32); u += 65537) {
    uint32_t bits = static_cast<uint32_t>(u);
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToHalf(f), fToF16(f)) << std::hex << bits;
    ASSERT_EQ(floatToBf16(f), fToBf16(f)) << std::hex << bits;
  }
}

TEST(PgReduce, UnsupportedPairsThrow) {
  float a = 1, b = 2, out = 0;
  const void* srcs[] = {&a, &b};
  EXPECT_THROW(reduceInto(&out, nullptr, srcs, 2, 1, DataType::kFloat32, ReduceOp::kBand),
               std::invalid_argument);
  uint8_t x = 1, y = 0, o = 0;
  const void* bs[] = {&x, &y};
  EXPECT_THROW(reduceInto(&o, nullptr, bs, 2, 1, DataType::kBool, ReduceOp::kAvg),
               std::invalid_argument);
  EXPECT_FALSE(reduceSupported(DataType::kComplex64, ReduceOp::kMax));
  EXPECT_TRUE(reduceSupported(DataType::kInt8, ReduceOp::kBxor));
}

TEST(PgReduce, IntegerAvgTruncatesTheExactSum) {
  int8_t a = 100, b = 100, c = -1;  // exact sum 199 (wraps in int8), / 3 = 66
  const void* srcs[] = {&a, &b, &c};
  int8_t out = 0;
  reduceInto(&out, nullptr, srcs, 3, 1, DataType::kInt8, ReduceOp::kAvg);
  EXPECT_EQ(out, 66);
  int32_t p = -7, q = 2, r = 0;
  const void* s2[] = {&p, &q};
  reduceInto(&r, nullptr, s2, 2, 1, DataType::kInt32, ReduceOp::kAvg);
  EXPECT_EQ(r, -2);  // -5 / 2 truncates toward zero
}

}  // namespace
}  // namespace mooncake::pg::test
