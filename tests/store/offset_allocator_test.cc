// OffsetAllocator: exhaustion, reuse, coalescing, fragmentation, alignment, and a random
// alloc/free stress checked against an independent interval set.
#include "store/master/offset_allocator.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

namespace mooncake::store {
namespace {

using Allocation = OffsetAllocator::Allocation;
constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

TEST(OffsetAllocator, EmptyAndZeroRequests) {
  OffsetAllocator empty(0);
  EXPECT_FALSE(empty.allocate(1).valid());
  EXPECT_TRUE(empty.checkConsistency());

  OffsetAllocator a(1 * kMiB);
  EXPECT_FALSE(a.allocate(0).valid());
  EXPECT_FALSE(a.allocate(64, 3).valid()) << "non-power-of-two alignment must be refused";
  EXPECT_FALSE(a.allocate(2 * kMiB).valid());
  EXPECT_FALSE(a.allocate(~uint64_t{0}).valid());
  EXPECT_EQ(a.usedBytes(), 0u);
  EXPECT_TRUE(a.checkConsistency());
}

TEST(OffsetAllocator, WholeCapacityInOnePiece) {
  // An empty segment must hand out all of itself, even though the size is not a class boundary.
  for (uint64_t cap : {64 * kKiB, 1 * kMiB + 64 * 7, 1000 * kMiB + 64 * 13}) {
    OffsetAllocator a(cap);
    Allocation x = a.allocate(cap);
    ASSERT_TRUE(x.valid()) << cap;
    EXPECT_EQ(x.offset, 0u);
    EXPECT_EQ(x.size, cap);
    EXPECT_EQ(a.freeBytes(), 0u);
    EXPECT_FALSE(a.allocate(64).valid());
    EXPECT_TRUE(a.free(x));
    EXPECT_EQ(a.largestFreeHint(), cap);
    EXPECT_TRUE(a.checkConsistency());
  }
}

TEST(OffsetAllocator, ExhaustionReturnsErrorNeverOverlap) {
  OffsetAllocator a(1 * kMiB, 64);
  std::vector<Allocation> got;
  for (;;) {
    Allocation x = a.allocate(4 * kKiB);
    if (!x.valid()) break;
    got.push_back(x);
  }
  EXPECT_EQ(got.size(), 256u);
  EXPECT_EQ(a.freeBytes(), 0u);
  std::map<uint64_t, uint64_t> seen;
  for (const auto& x : got) seen[x.offset] = x.size;
  uint64_t end = 0;
  for (const auto& [off, size] : seen) {
    EXPECT_GE(off, end) << "overlap";
    end = off + size;
  }
  EXPECT_LE(end, 1 * kMiB);
  EXPECT_TRUE(a.checkConsistency());
}

TEST(OffsetAllocator, ReuseAfterFreeAndDoubleFreeRefused) {
  OffsetAllocator a(64 * kKiB);
  Allocation x = a.allocate(64 * kKiB);
  ASSERT_TRUE(x.valid());
  EXPECT_TRUE(a.free(x));
  EXPECT_FALSE(a.free(x)) << "double free must be refused";
  Allocation y = a.allocate(64 * kKiB);
  ASSERT_TRUE(y.valid());
  EXPECT_EQ(y.offset, x.offset);
  // A stale handle whose node was reused by y must not free y.
  Allocation stale = x;
  stale.size = 128;
  EXPECT_FALSE(a.free(stale));
  Allocation bogus;
  bogus.node = 12345;
  EXPECT_FALSE(a.free(bogus));
  EXPECT_EQ(a.liveAllocations(), 1u);
  EXPECT_TRUE(a.checkConsistency());
}

TEST(OffsetAllocator, CoalescesNeighboursInAnyOrder) {
  for (int order = 0; order < 6; ++order) {
    OffsetAllocator a(3 * kKiB, 64);
    Allocation p[3];
    for (auto& x : p) {
      x = a.allocate(kKiB);
      ASSERT_TRUE(x.valid());
    }
    static const int perms[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                    {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(a.free(p[perms[order][i]]));
      ASSERT_TRUE(a.checkConsistency());
    }
    EXPECT_EQ(a.freeBlocks(), 1u) << "order " << order;
    EXPECT_TRUE(a.allocate(3 * kKiB).valid()) << "coalesced block must serve the whole range";
  }
}

TEST(OffsetAllocator, FragmentationThenCoalescing) {
  OffsetAllocator a(1 * kMiB, 64);
  std::vector<Allocation> blocks;
  for (int i = 0; i < 256; ++i) blocks.push_back(a.allocate(4 * kKiB));
  // Free every other block: half the space is free, but no free run exceeds 4 KiB.
  for (size_t i = 0; i < blocks.size(); i += 2) ASSERT_TRUE(a.free(blocks[i]));
  EXPECT_EQ(a.freeBytes(), 512 * kKiB);
  EXPECT_EQ(a.freeBlocks(), 128u);
  EXPECT_FALSE(a.allocate(8 * kKiB).valid()) << "no contiguous 8 KiB exists";
  EXPECT_TRUE(a.allocate(4 * kKiB).valid());
  EXPECT_LE(a.largestFreeHint(), 4 * kKiB);
  EXPECT_TRUE(a.checkConsistency());
  // Freeing the rest coalesces everything back into one block.
  OffsetAllocator b(1 * kMiB, 64);
  blocks.clear();
  for (int i = 0; i < 256; ++i) blocks.push_back(b.allocate(4 * kKiB));
  for (size_t i = 0; i < blocks.size(); i += 2) ASSERT_TRUE(b.free(blocks[i]));
  for (size_t i = 1; i < blocks.size(); i += 2) ASSERT_TRUE(b.free(blocks[i]));
  EXPECT_EQ(b.freeBlocks(), 1u);
  EXPECT_TRUE(b.allocate(1 * kMiB).valid());
}

TEST(OffsetAllocator, AlignmentAndGranularity) {
  OffsetAllocator a(1 * kMiB, 64);
  Allocation small = a.allocate(1);
  ASSERT_TRUE(small.valid());
  EXPECT_EQ(small.size, 64u) << "sizes round up to the granularity";
  for (uint64_t align : {128ull, 4096ull, 65536ull}) {
    Allocation x = a.allocate(100, align);
    ASSERT_TRUE(x.valid()) << align;
    EXPECT_EQ(x.offset % align, 0u) << align;
  }
  EXPECT_TRUE(a.checkConsistency());
  OffsetAllocator odd(1000, 64);  // a tail shorter than a granule is not used
  EXPECT_EQ(odd.capacity(), 960u);
  EXPECT_TRUE(odd.allocate(960).valid());
}

TEST(OffsetAllocator, LargestFreeHintIsAllocatable) {
  std::mt19937_64 rng(7);
  OffsetAllocator a(64 * kMiB, 64);
  std::vector<Allocation> live;
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      size_t k = rng() % live.size();
      ASSERT_TRUE(a.free(live[k]));
      live[k] = live.back();
      live.pop_back();
    } else {
      Allocation x = a.allocate(64 + rng() % (256 * kKiB));
      if (x.valid()) live.push_back(x);
    }
    uint64_t hint = a.largestFreeHint();
    if (hint == 0) continue;
    Allocation h = a.allocate(hint);
    ASSERT_TRUE(h.valid()) << "hint " << hint << " at step " << i;
    ASSERT_TRUE(a.free(h));
  }
}

// Random alloc/free against an interval set: no overlap, in bounds, aligned, byte counts exact.
TEST(OffsetAllocator, RandomStressAgainstIntervalSet) {
  for (uint64_t seed : {1ull, 2ull, 3ull}) {
    std::mt19937_64 rng(seed);
    const uint64_t cap = 16 * kMiB + 64 * 5;
    OffsetAllocator a(cap, 64);
    std::map<uint64_t, Allocation> live;  // offset -> allocation
    uint64_t used = 0, failures = 0;
    for (int step = 0; step < 50000; ++step) {
      bool do_alloc = live.empty() || (rng() % 100) < 55;
      if (do_alloc) {
        uint64_t size;
        switch (rng() % 4) {
          case 0:
            size = 1 + rng() % 256;
            break;
          case 1:
            size = 1 + rng() % (16 * kKiB);
            break;
          case 2:
            size = 1 + rng() % (256 * kKiB);
            break;
          default:
            size = 1 + rng() % (2 * kMiB);
            break;
        }
        uint64_t align = (rng() % 8 == 0) ? (uint64_t{1} << (7 + rng() % 8)) : 0;
        Allocation x = a.allocate(size, align);
        if (!x.valid()) {
          ++failures;
          continue;
        }
        ASSERT_GE(x.size, size);
        ASSERT_EQ(x.offset % 64, 0u);
        if (align) {
          ASSERT_EQ(x.offset % align, 0u);
        }
        ASSERT_LE(x.offset + x.size, cap);
        auto next = live.lower_bound(x.offset);
        if (next != live.end()) {
          ASSERT_LE(x.offset + x.size, next->first) << "overlap (next)";
        }
        if (next != live.begin()) {
          auto prev = std::prev(next);
          ASSERT_LE(prev->first + prev->second.size, x.offset) << "overlap (prev)";
        }
        live.emplace(x.offset, x);
        used += x.size;
      } else {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        ASSERT_TRUE(a.free(it->second));
        used -= it->second.size;
        live.erase(it);
      }
      ASSERT_EQ(a.usedBytes(), used);
      if (step % 5000 == 0) {
        ASSERT_TRUE(a.checkConsistency()) << "step " << step;
      }
    }
    EXPECT_GT(failures, 0u) << "the stress should reach exhaustion sometimes";
    for (auto& [off, x] : live) ASSERT_TRUE(a.free(x));
    EXPECT_TRUE(a.checkConsistency());
    EXPECT_EQ(a.freeBlocks(), 1u);
    EXPECT_TRUE(a.allocate(a.capacity()).valid());
  }
}

}  // namespace
}  // namespace mooncake::store
