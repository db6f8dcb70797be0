// pg/device_reduce: the GPU reduction's arithmetic (pg/device_reduce_body.h, the code the CUDA
// kernel runs) against the CPU's reduceInto, bit for bit, for every dtype x op x arity, on
// random bit patterns (float16/bfloat16 subnormals and overflow included); and the kernel's
// simulated launch on the device layer's simulation: ordered with the copies queued before
// it, in place and into a second destination, a bad range failing the next event.
#include "pg/device_reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "engine/device/device.h"
#include "pg/communicator.h"
#include "pg/reduce.h"
#include "tests/pg/pg_reference.h"

namespace mooncake::pg::test {
namespace {

// Random values of type t: any finite bit pattern for 16-bit floats (subnormals, the largest
// values, whose sums overflow), wide-ranging finite floats, any integer, 0/1 bools.
void randomFill(DataType t, void* buf, size_t count, std::mt19937_64& rng) {
  const size_t es = dtypeSize(t);
  auto* b = static_cast<unsigned char*>(buf);
  for (size_t i = 0; i < count; ++i) {
    uint64_t x = rng();
    switch (t) {
      case DataType::kFloat16: {
        auto h = static_cast<uint16_t>(x);
        if (((h >> 10) & 0x1f) == 0x1f) h &= 0xbfff;  // no inf/NaN inputs
        std::memcpy(b + i * es, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        auto h = static_cast<uint16_t>(x);
        if (((h >> 7) & 0xff) == 0xff) h &= 0xbfff;
        std::memcpy(b + i * es, &h, 2);
        break;
      }
      case DataType::kFloat32:
      case DataType::kComplex64:  // (complex: no overflow in products of 8)
        for (size_t k = 0; k < es / 4; ++k) {
          float f = std::ldexp(static_cast<float>((x >> (16 * k)) & 0xffff) - 32768.0f,
                               isComplex(t) ? static_cast<int>((x >> 40) % 8) - 15
                                            : static_cast<int>((x >> 40) % 40) - 20);
          std::memcpy(b + i * es + 4 * k, &f, 4);
        }
        break;
      case DataType::kFloat64:
      case DataType::kComplex128:
        for (size_t k = 0; k < es / 8; ++k) {
          double d = std::ldexp(static_cast<double>(static_cast<int32_t>(x >> (8 * k))),
                                static_cast<int>((x >> 50) % 60) - 30);
          std::memcpy(b + i * es + 8 * k, &d, 8);
        }
        break;
      case DataType::kBool: b[i] = static_cast<unsigned char>(x & 1); break;
      default: std::memcpy(b + i * es, &x, es); break;
    }
  }
}

// Complex products may differ in the last bits (the CPU's AVX2 kernels may fuse multiply-adds):
// each result part within n ulps of the product of the inputs' magnitudes (the size of the
// terms that cancel), not of the result.
bool closeComplex(DataType t, const void* a, const void* b, const std::vector<const void*>& ins,
                  size_t count) {
  const bool f = t == DataType::kComplex64;
  auto at = [&](const void* p, size_t i) {
    return f ? static_cast<double>(static_cast<const float*>(p)[i]) : static_cast<const double*>(p)[i];
  };
  const double eps = f ? 1.2e-7 : 2.3e-16;
  for (size_t i = 0; i < count; ++i) {
    double mag = 1;
    for (const void* in : ins) mag *= std::fabs(at(in, 2 * i)) + std::fabs(at(in, 2 * i + 1));
    for (size_t k = 2 * i; k < 2 * i + 2; ++k) {
      double x = at(a, k), y = at(b, k);
      if (x == y || (std::isnan(x) && std::isnan(y))) continue;
      if (!(std::fabs(x - y) <= 4.0 * static_cast<double>(ins.size()) * eps * mag)) return false;
    }
  }
  return true;
}

TEST(PgDeviceReduce, HostFormEqualsReduceIntoBitForBit) {
  std::mt19937_64 rng(12345);
  int checked = 0;
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      const size_t es = dtypeSize(t);
      std::vector<char> a(8 * es), d(8 * es);
      const void* s1[1] = {a.data()};
      if (!reduceSupported(t, op)) {
        EXPECT_FALSE(deviceReduceOnHost(d.data(), nullptr, s1, 1, 8, t, op))
            << dtypeName(t) << " " << reduceOpName(op) << " has no GPU form either";
        continue;
      }
      for (int n : {1, 2, 3, 5, 8}) {
        for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
          std::vector<std::vector<char>> in(n, std::vector<char>(count * es));
          std::vector<const void*> ptrs;
          for (auto& v : in) {
            randomFill(t, v.data(), count, rng);
            ptrs.push_back(v.data());
          }
          std::vector<char> want(count * es), got(count * es), got2(count * es);
          reduceInto(want.data(), nullptr, ptrs.data(), n, count, t, op);
          ASSERT_TRUE(deviceReduceOnHost(got.data(), got2.data(), ptrs.data(), n, count, t, op));
          const bool same = isComplex(t) && op == ReduceOp::kProduct
                                ? closeComplex(t, got.data(), want.data(), ptrs, count)
                                : std::memcmp(got.data(), want.data(), count * es) == 0;
          EXPECT_TRUE(same) << dtypeName(t) << " " << reduceOpName(op) << " n=" << n
                            << " count=" << count;
          EXPECT_EQ(std::memcmp(got.data(), got2.data(), count * es), 0) << "second destination";
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(PgDeviceReduce, InPlaceLikeTheCpu) {
  std::mt19937_64 rng(7);
  const size_t count = 3001;
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}) {
    const size_t es = dtypeSize(t);
    std::vector<std::vector<char>> in(3, std::vector<char>(count * es));
    for (auto& v : in) randomFill(t, v.data(), count, rng);
    std::vector<const void*> ptrs = {in[0].data(), in[1].data(), in[2].data()};
    std::vector<char> want(count * es);
    reduceInto(want.data(), nullptr, ptrs.data(), 3, count, t, ReduceOp::kSum);
    ASSERT_TRUE(deviceReduceOnHost(in[1].data(), nullptr, ptrs.data(), 3, count, t, ReduceOp::kSum));
    EXPECT_EQ(std::memcmp(in[1].data(), want.data(), count * es), 0) << dtypeName(t);
  }
}

// The launch on the device layer's simulation: device memory that host code cannot touch,
// copies in, the kernel, copies out, one event at the end.
class SimDeviceReduce : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { setenv("MC_DEVICE", "sim", 1); }
  engine::device::Device* layer() {
    auto d = engine::device::get();
    EXPECT_TRUE(d.ok()) << d.status().toString();
    return d.ok() ? *d : nullptr;
  }
};

TEST_F(SimDeviceReduce, QueuedAfterCopiesInPlaceAndSecondDestination) {
  engine::device::Device* dev = layer();
  ASSERT_NE(dev, nullptr);
  ASSERT_STREQ(dev->name(), "sim");
  std::mt19937_64 rng(99);
  const size_t count = 100003;
  for (DataType t : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                     DataType::kInt32, DataType::kComplex64}) {
    const size_t es = dtypeSize(t), bytes = count * es;
    const int n = 4;
    std::vector<std::vector<char>> host(n, std::vector<char>(bytes));
    std::vector<void*> gpu(n);
    std::vector<const void*> hp, gp;
    for (int r = 0; r < n; ++r) {
      randomFill(t, host[r].data(), count, rng);
      auto p = dev->allocate(bytes, 1);
      ASSERT_TRUE(p.ok());
      gpu[r] = *p;
      hp.push_back(host[r].data());
      gp.push_back(gpu[r]);
      ASSERT_TRUE(dev->copyAsync(gpu[r], host[r].data(), bytes, 1).ok());
    }
    auto second = dev->allocate(bytes, 1);
    ASSERT_TRUE(second.ok());
    // No wait between the copies in and the kernel: the stream orders them.
    ASSERT_TRUE(deviceReduceAsync(gpu[2], *second, gp.data(), n, count, t, ReduceOp::kSum, 1,
                                  "allreduce"));
    std::vector<char> got(bytes), got2(bytes), want(bytes);
    ASSERT_TRUE(dev->copyAsync(got.data(), gpu[2], bytes, 1).ok());
    ASSERT_TRUE(dev->copyAsync(got2.data(), *second, bytes, 1).ok());
    auto ev = dev->record(1);
    ASSERT_TRUE(ev.ok());
    ASSERT_TRUE((*ev)->wait(engine::deadlineInMs(30000)).ok());
    reduceInto(want.data(), nullptr, hp.data(), n, count, t, ReduceOp::kSum);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << dtypeName(t);
    EXPECT_EQ(std::memcmp(got2.data(), want.data(), bytes), 0) << dtypeName(t);
    for (void* p : gpu) ASSERT_TRUE(dev->free(p).ok());
    ASSERT_TRUE(dev->free(*second).ok());
  }
}

TEST_F(SimDeviceReduce, ARangePastAnAllocationFailsTheNextWait) {
  engine::device::Device* dev = layer();
  ASSERT_NE(dev, nullptr);
  // On its own device: a failure is sticky for the stream (as a CUDA fault).
  constexpr int kOrdinal = engine::device::kSimDevices - 1;
  auto a = dev->allocate(4096, kOrdinal);
  ASSERT_TRUE(a.ok());
  const void* srcs[2] = {*a, *a};
  // 2048 floats = 8 KiB from a 4 KiB allocation.
  ASSERT_TRUE(deviceReduceAsync(*a, nullptr, srcs, 2, 2048, DataType::kFloat32, ReduceOp::kSum,
                                kOrdinal, "allreduce"));
  auto ev = dev->record(kOrdinal);
  ASSERT_TRUE(ev.ok());
  Status st = (*ev)->wait(engine::deadlineInMs(30000));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.toString().find("runs past"), std::string::npos) << st.toString();
  ASSERT_TRUE(dev->free(*a).ok());
}

// Loading ahead (what the torch backend does before its first stream gate): the kernel's host
// form loads on every device; an ordinal past the devices and a kernel without a form for this
// layer are refused, and prepareDeviceReduce passes the refusal of a missing form over (the CPU
// reduces then) but not a bad device.
TEST_F(SimDeviceReduce, LoadedAheadOfTheFirstLaunch) {
  engine::device::Device* dev = layer();
  ASSERT_NE(dev, nullptr);
  for (int d = 0; d < engine::device::kSimDevices; ++d) {
    Status st = prepareDeviceReduce(d);
    EXPECT_TRUE(st.ok()) << st.toString();
  }
  EXPECT_FALSE(prepareDeviceReduce(engine::device::kSimDevices).ok());
  engine::device::Kernel none;
  none.name = "no_host_form";
  EXPECT_EQ(dev->load(none, 0).code(), Code::kNotSupported);
}

TEST_F(SimDeviceReduce, NoGpuFormForUnsupportedCalls) {
  engine::device::Device* dev = layer();
  ASSERT_NE(dev, nullptr);
  auto a = dev->allocate(4096, 0);
  ASSERT_TRUE(a.ok());
  std::vector<const void*> many(65, *a);
  EXPECT_FALSE(deviceReduceAsync(*a, nullptr, many.data(), 65, 16, DataType::kFloat32,
                                 ReduceOp::kSum, 0, "allreduce"));  // above 64 sources
  EXPECT_FALSE(deviceReduceAsync(*a, nullptr, many.data(), 2, 16, DataType::kComplex64,
                                 ReduceOp::kMax, 0, "allreduce"));
  ASSERT_TRUE(dev->free(*a).ok());
}

}  // namespace
}  // namespace mooncake::pg::test
