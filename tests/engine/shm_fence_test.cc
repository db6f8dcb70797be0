// ShmFence (engine/transport/shm/shm_fence.h) in one process: the owner's side and a peer's
// side on the same file. The cross-process path is ShmFenceTest in failure_test.cc.
#include "engine/transport/shm/shm_fence.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace mooncake::engine {
namespace {

std::string fenceName(const char* what) {
  return "/mcft-" + std::to_string(getpid()) + "-" + what;
}

// A peer copies only inside a region the owner has registered now: not past its ends, not
// after it was unregistered, and again once it is registered again (at the same address).
TEST(ShmFenceTest, OnlyRegisteredRangesAreCopied) {
  auto owner = ShmFence::create(fenceName("refuse"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok()) << peer.status().toString();
  int copies = 0;
  auto copy = [&] {
    ++copies;
    return Status::OK();
  };
  (*owner)->added(0x10000, 0x1000);
  (*owner)->added(0x30000, 0x1000);
  EXPECT_TRUE((*peer)->guard(0x10000, 0x1000, copy).ok());
  EXPECT_TRUE((*peer)->guard(0x30800, 0x10, copy).ok());
  EXPECT_EQ((*peer)->guard(0x10f00, 0x200, copy).code(), Code::kPermissionDenied) << "past the end";
  EXPECT_EQ((*peer)->guard(0x0ff00, 0x200, copy).code(), Code::kPermissionDenied) << "the start";
  EXPECT_EQ((*peer)->guard(0x20000, 0x10, copy).code(), Code::kPermissionDenied) << "between";
  EXPECT_EQ(copies, 2);
  EXPECT_TRUE((*owner)->removed(0x10000, 0x1000, deadlineInMs(1000)));
  Status st = (*peer)->guard(0x10800, 0x10, copy);
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_TRUE((*peer)->guard(0x30000, 0x1000, copy).ok()) << "the other region";
  (*owner)->added(0x10000, 0x1000);
  EXPECT_TRUE((*peer)->guard(0x10800, 0x10, copy).ok()) << "registered again";
  EXPECT_EQ(copies, 4);
  // A registration refused for overlapping one that exists is listed, then taken out again
  // (the engine's rollback): the region it overlapped stays.
  (*owner)->added(0x30000, 0x1000);
  EXPECT_TRUE((*owner)->removed(0x30000, 0x1000, deadlineInMs(1000)));
  EXPECT_TRUE((*peer)->guard(0x30000, 0x1000, copy).ok());
  // A peer that attaches later sees the same table.
  auto late = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(late.ok());
  EXPECT_TRUE((*late)->guard(0x10000, 8, copy).ok());
  EXPECT_EQ((*late)->guard(0x50000, 8, copy).code(), Code::kPermissionDenied);
}

// A peer copying without pause does not hold a removal up: the removal waits only for the
// copies that began before it.
TEST(ShmFenceTest, BusyPeerDoesNotHoldARemovalUp) {
  auto owner = ShmFence::create(fenceName("busy"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok());
  (*owner)->added(0x10000, 0x1000);
  std::atomic<bool> stop{false};
  std::vector<std::thread> copiers;
  for (int t = 0; t < 3; ++t) {
    copiers.emplace_back([&] {
      while (!stop) {
        (void)(*peer)->guard(0x10000, 0x1000, [] {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          return Status::OK();
        });
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int k = 0; k < 10; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    (*owner)->added(0x80000 + k * 0x1000, 0x1000);
    EXPECT_TRUE((*owner)->removed(0x80000 + k * 0x1000, 0x1000, deadlineInMs(5000)));
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - t0)
                        .count();
    EXPECT_LT(ms, 2000) << "removal " << k << " waited for copies that began after it";
  }
  stop = true;
  for (auto& t : copiers) t.join();
}

// The owner's removal waits for a copy that began before it (and may not have seen it).
TEST(ShmFenceTest, RemovalWaitsForTheCopyInProgress) {
  auto owner = ShmFence::create(fenceName("wait"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  auto peer = ShmFence::attach((*owner)->name());
  ASSERT_TRUE(peer.ok());
  (*owner)->added(0x20000, 0x1000);
  (*owner)->added(0x30000, 0x1000);
  (*owner)->added(0x40000, 0x1000);
  std::atomic<bool> in_copy{false};
  std::atomic<int64_t> copy_end{0};
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::thread copier([&] {
    EXPECT_TRUE((*peer)->guard(0x20000, 0x1000, [&] {
      in_copy = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      copy_end = now_ns();
      return Status::OK();
    }).ok());
  });
  while (!in_copy) std::this_thread::yield();
  EXPECT_TRUE((*owner)->removed(0x20000, 0x1000, deadlineInMs(5000)));
  const int64_t removed_at = now_ns();
  copier.join();
  EXPECT_GE(removed_at, copy_end.load()) << "the removal returned during the copy";
  // A copy that outlives the deadline: the removal gives up and says so.
  std::atomic<bool> release{false};
  in_copy = false;
  std::thread stuck([&] {
    (void)(*peer)->guard(0x30000, 0x1000, [&] {
      in_copy = true;
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return Status::OK();
    });
  });
  while (!in_copy) std::this_thread::yield();
  EXPECT_FALSE((*owner)->removed(0x40000, 0x1000, deadlineInMs(50)));
  release = true;
  stuck.join();
}

}  // namespace
}  // namespace mooncake::engine
