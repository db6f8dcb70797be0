// The device layer (engine/device/device.h): its host simulation, what the verbs emulator and
// the engine's GPU-memory paths are tested over, and the choice by name.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>

#include "engine/device/device.h"
#include "mooncake/config.h"

namespace mooncake::test {
namespace {

using engine::device::Device;

std::unique_ptr<Device> sim() {
  auto d = engine::device::make("sim");
  EXPECT_TRUE(d.ok()) << d.status().toString();
  return d.ok() ? std::move(d).value() : nullptr;
}

TEST(DeviceSim, AllocationsAreDeviceMemoryOfTheirOrdinal) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  EXPECT_STREQ(d->name(), "sim");
  const size_t len = 3 * 4096 + 100;
  auto p = d->allocate(len, 2);
  ASSERT_TRUE(p.ok()) << p.status().toString();
  char* c = static_cast<char*>(*p);
  for (const void* q : {static_cast<const void*>(c), static_cast<const void*>(c + len - 1)}) {
    auto info = d->pointer(q);
    EXPECT_TRUE(info.device);
    EXPECT_EQ(info.ordinal, 2);
  }
  int host = 0;
  EXPECT_FALSE(d->pointer(&host).device);
  EXPECT_FALSE(d->allocate(4096, engine::device::kSimDevices).ok());
  EXPECT_FALSE(d->allocate(4096, -1).ok());
  EXPECT_TRUE(d->free(c).ok());
  EXPECT_FALSE(d->pointer(c).device) << "freed memory still counts as device memory";
  EXPECT_FALSE(d->free(c).ok()) << "a second free was accepted";
  EXPECT_FALSE(d->free(&host).ok());
}

// The dma-buf of a range maps the same pages: what is written through the allocation is read
// through the dma-buf's mapping and back (the verbs emulator registers GPU memory this way).
TEST(DeviceSim, DmabufMapsTheSamePages) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 4 * 4096;
  auto p = d->allocate(len, 0);
  ASSERT_TRUE(p.ok()) << p.status().toString();
  char* c = static_cast<char*>(*p);
  for (size_t i = 0; i < len; ++i) c[i] = static_cast<char>(i * 7 + 1);
  const size_t off = 5000, n = 6000;
  auto buf = d->exportDmabuf(c + off, n);
  ASSERT_TRUE(buf.ok()) << buf.status().toString();
  EXPECT_EQ(buf->offset, off);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t lo = buf->offset / page * page;
  void* m = mmap(nullptr, buf->offset - lo + n, PROT_READ | PROT_WRITE, MAP_SHARED, buf->fd,
                 static_cast<off_t>(lo));
  ASSERT_NE(m, MAP_FAILED);
  char* v = static_cast<char*>(m) + (buf->offset - lo);
  EXPECT_EQ(std::memcmp(v, c + off, n), 0);
  std::memset(v, 0x5a, 16);
  EXPECT_EQ(c[off], 0x5a);
  EXPECT_EQ(c[off + 15], 0x5a);
  munmap(m, buf->offset - lo + n);
  close(buf->fd);
  EXPECT_FALSE(d->exportDmabuf(c + len - 10, 20).ok()) << "a range past the allocation";
  int host = 0;
  EXPECT_FALSE(d->exportDmabuf(&host, sizeof host).ok());
  EXPECT_TRUE(d->free(c).ok());
}

TEST(DeviceChoice, ByName) {
  auto bad = engine::device::make("tpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("MC_DEVICE=tpu"), std::string::npos)
      << bad.status().toString();
  auto none = engine::device::make("none");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("none"), std::string::npos);
  // cuda: the driver's layer where one is installed with a device (the GPU machine); here
  // an error that says why there is none, never a crash.
  auto cuda = engine::device::make("cuda");
  if (cuda.ok()) {
    EXPECT_STREQ((*cuda)->name(), "cuda");
    EXPECT_GE((*cuda)->count(), 1);
  } else {
    const std::string why = cuda.status().message();
    EXPECT_TRUE(why.find("CUDA") != std::string::npos) << why;
    EXPECT_EQ(cuda.status().code(), Code::kNotSupported) << why;
  }
}

}  // namespace
}  // namespace mooncake::test
