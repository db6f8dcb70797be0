// ShmFence (engine/transport/shm/shm_fence.h) in one process: the owner's side and a peer's
// side on the same file. The cross-process path is ShmFenceTest in failure_test.cc.
#include "engine/transport/shm/shm_fence.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace mooncake::engine {
namespace {

std::string fenceName(const char* what) {
  return "/mcft-" + std::to_string(getpid()) + "-" + what;
}

// The copies a peer may make: refused once the owner removed their range after the peer's
// descriptor, allowed again with a descriptor made after the removal; other ranges unaffected.
TEST(ShmFenceTest, RemovedRangesAreRefusedUntilTheDescriptorCatchesUp) {
  auto owner = ShmFence::create(fenceName("refuse"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok()) << peer.status().toString();
  int copies = 0;
  auto copy = [&] {
    ++copies;
    return Status::OK();
  };
  const uint64_t desc = 10;  // the peer's descriptor: regions_version 10
  EXPECT_TRUE((*peer)->guard(0x10000, 0x1000, desc, copy).ok());
  EXPECT_TRUE((*owner)->removed(0x10000, 0x1000, 11, deadlineInMs(1000)));
  Status st = (*peer)->guard(0x10800, 0x10, desc, copy);
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_TRUE((*peer)->guard(0x0f000, 0x1000, desc, copy).ok()) << "the range just before";
  EXPECT_TRUE((*peer)->guard(0x11000, 0x1000, desc, copy).ok()) << "the range just after";
  EXPECT_EQ((*peer)->guard(0x0ff00, 0x200, desc, copy).code(), Code::kPermissionDenied)
      << "straddling the start";
  EXPECT_EQ(copies, 3);
  // A descriptor read as the removal happened (same version) may still list the region.
  EXPECT_EQ((*peer)->guard(0x10000, 8, 11, copy).code(), Code::kPermissionDenied);
  // One made after it (the region registered again since: a later version) is believed, and
  // an older one again is not.
  EXPECT_TRUE((*peer)->guard(0x10000, 8, 12, copy).ok());
  EXPECT_EQ((*peer)->guard(0x10000, 8, desc, copy).code(), Code::kPermissionDenied);
  EXPECT_EQ(copies, 4);

  // A peer that attaches later learns the removals its descriptor predates.
  auto late = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(late.ok());
  EXPECT_EQ((*late)->guard(0x10000, 8, 5, copy).code(), Code::kPermissionDenied);
  EXPECT_TRUE((*late)->guard(0x10000, 8, 12, copy).ok());
}

// More removals than the ring holds since the peer last looked: everything is refused until
// its descriptor is newer than the oldest removal still in the ring.
TEST(ShmFenceTest, FallingARingBehindRefusesEverything) {
  auto owner = ShmFence::create(fenceName("behind"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok());
  auto copy = [] { return Status::OK(); };
  for (uint64_t i = 0; i < ShmFence::kRing + 10; ++i)
    ASSERT_TRUE((*owner)->removed(0x100000 + i * 0x1000, 0x1000, 100 + i, deadlineInMs(1000)));
  EXPECT_EQ((*peer)->guard(0x9000000, 8, 50, copy).code(), Code::kPermissionDenied)
      << "a range never removed, but the removals lost may have covered it";
  EXPECT_TRUE((*peer)->guard(0x9000000, 8, 100 + ShmFence::kRing + 10, copy).ok());
}

// The owner's removal waits for a copy that began before it (and may not have seen it).
TEST(ShmFenceTest, RemovalWaitsForTheCopyInProgress) {
  auto owner = ShmFence::create(fenceName("wait"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok());
  std::atomic<bool> in_copy{false};
  std::atomic<int64_t> copy_end{0};
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::thread copier([&] {
    EXPECT_TRUE((*peer)->guard(0x20000, 0x1000, 1, [&] {
      in_copy = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      copy_end = now_ns();
      return Status::OK();
    }).ok());
  });
  while (!in_copy) std::this_thread::yield();
  EXPECT_TRUE((*owner)->removed(0x20000, 0x1000, 2, deadlineInMs(5000)));
  const int64_t removed_at = now_ns();
  copier.join();
  EXPECT_GE(removed_at, copy_end.load()) << "the removal returned during the copy";
  // A copy that outlives the deadline: the removal gives up and says so.
  std::atomic<bool> release{false};
  in_copy = false;
  std::thread stuck([&] {
    (void)(*peer)->guard(0x30000, 0x1000, 2, [&] {
      in_copy = true;
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return Status::OK();
    });
  });
  while (!in_copy) std::this_thread::yield();
  EXPECT_FALSE((*owner)->removed(0x40000, 0x1000, 3, deadlineInMs(50)));
  release = true;
  stuck.join();
}

}  // namespace
}  // namespace mooncake::engine
