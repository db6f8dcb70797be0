// BufferPool: kept buffers are handed out again (same memory, no fill when long enough),
// small ones are not kept, and the pool stays within its count and byte bounds.
#include <gtest/gtest.h>

#include "engine/buffer_pool.h"

namespace mooncake::engine {
namespace {

TEST(BufferPool, ReusesKeptBuffersWithoutRefilling) {
  BufferPool pool;
  std::string a = pool.take(256 << 10);
  ASSERT_EQ(a.size(), 256u << 10);
  EXPECT_EQ(a[0], '\0');  // a new buffer is zero-filled
  a.assign(a.size(), 'x');
  const char* mem = a.data();
  pool.give(std::move(a));
  std::string b = pool.take(200 << 10);  // smaller: the kept buffer, truncated, not filled
  EXPECT_EQ(b.data(), mem);
  ASSERT_EQ(b.size(), 200u << 10);
  EXPECT_EQ(b[0], 'x');
  EXPECT_EQ(b[b.size() - 1], 'x');
  std::string c = pool.take(200 << 10);  // the pool is empty again: a new buffer
  EXPECT_NE(c.data(), mem);
}

TEST(BufferPool, KeepsOnlyLargeBuffersWithinBounds) {
  BufferPool pool;
  std::string small(1000, 's');
  pool.give(std::move(small));
  std::string s = pool.take(BufferPool::kMinBytes);
  EXPECT_EQ(s[0], '\0') << "a small buffer was kept";
  // More than kMaxBytes offered: the pool keeps at most kMaxBytes of them.
  const size_t big = 8u << 20;
  for (size_t i = 0; i < BufferPool::kMaxBytes / big + 4; ++i) pool.give(std::string(big, 'b'));
  size_t reused = 0;
  for (size_t i = 0; i < BufferPool::kMaxBytes / big + 4; ++i)
    if (pool.take(big)[0] == 'b') ++reused;
  EXPECT_GE(reused, 1u);
  EXPECT_LE(reused * big, BufferPool::kMaxBytes);
  // Never more than kMaxBuffers, whatever their size.
  for (size_t i = 0; i < BufferPool::kMaxBuffers + 8; ++i)
    pool.give(std::string(BufferPool::kMinBytes, 'k'));
  reused = 0;
  for (size_t i = 0; i < BufferPool::kMaxBuffers + 8; ++i)
    if (pool.take(BufferPool::kMinBytes)[0] == 'k') ++reused;
  EXPECT_EQ(reused, BufferPool::kMaxBuffers);
}

}  // namespace
}  // namespace mooncake::engine
