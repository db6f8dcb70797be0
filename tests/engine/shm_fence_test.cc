// ShmFence (engine/transport/shm/shm_fence.h) in one process: the owner's side and a peer's
// side on the same file. The cross-process path is ShmFenceTest in failure_test.cc.
#include "engine/transport/shm/shm_fence.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace mooncake::engine {
namespace {

std::string fenceName(const char* what) {
  std::string name = "/mcft-" + std::to_string(getpid()) + "-" + what;
  shm_unlink(name.c_str());  // (left by a crashed run with this pid)
  return name;
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
  // The owner stops: nothing is copied any more.
  EXPECT_TRUE((*owner)->removedAll(deadlineInMs(1000)));
  EXPECT_EQ((*peer)->guard(0x30000, 8, copy).code(), Code::kPermissionDenied);
}

// Copies racing the owner's registrations and removals never run inside a region after its
// removal returned (the owner marks it freed then; a copy finding the mark failed the fence).
TEST(ShmFenceTest, NoCopyOutlivesItsRemoval) {
  auto owner = ShmFence::create(fenceName("race"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  constexpr int kRegions = 4;
  std::atomic<bool> freed[kRegions];
  for (auto& f : freed) f = true;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> copied{0}, bad{0};
  std::vector<std::thread> copiers;
  for (int t = 0; t < 2; ++t) {
    copiers.emplace_back([&, t] {
      auto peer = ShmFence::attach((*owner)->name());
      ASSERT_TRUE(peer.ok());
      for (uint64_t i = t; !stop; ++i) {
        const int r = static_cast<int>(i % kRegions);
        (void)(*peer)->guard(0x100000 * (r + 1), 0x1000, [&] {
          if (freed[r]) ++bad;
          ++copied;
          return Status::OK();
        });
      }
    });
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500); ++k) {
    const int r = k % kRegions;
    freed[r] = false;
    (*owner)->added(0x100000 * (r + 1), 0x1000);
    std::this_thread::yield();
    const bool waited = (*owner)->removed(0x100000 * (r + 1), 0x1000, deadlineInMs(5000));
    EXPECT_TRUE(waited) << "removal " << k << " ran out its deadline";
    freed[r] = true;
    if (!waited) break;  // (the copiers are stopped and joined below either way)
  }
  stop = true;
  for (auto& t : copiers) t.join();
  EXPECT_EQ(bad.load(), 0u) << "copies ran in a region after its removal returned";
  EXPECT_GT(copied.load(), 0u) << "no copy ever ran: the race was not exercised";
}

// A peer process killed in the middle of a copy (not reaped yet: a zombie) is not waited for.
TEST(ShmFenceTest, KilledPeerInACopyIsNotWaitedFor) {
  auto owner = ShmFence::create(fenceName("killed"));
  ASSERT_TRUE(owner.ok()) << owner.status().toString();
  (*owner)->added(0x10000, 0x1000);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto peer = ShmFence::attach((*owner)->name());
    if (!peer.ok()) _exit(2);
    (void)(*peer)->guard(0x10000, 0x1000, [&] {
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(3);
      for (;;) pause();
      return Status::OK();
    });
    _exit(0);
  }
  close(ready[1]);  // (EOF if the child exits without entering its copy)
  char c = 0;
  pollfd pf{ready[0], POLLIN, 0};
  const bool entered = poll(&pf, 1, 10000) == 1 && read(ready[0], &c, 1) == 1;
  kill(child, SIGKILL);
  if (!entered) {
    waitpid(child, nullptr, 0);
    close(ready[0]);
    FAIL() << "the child never entered its copy";
  }
  // (Not reaped: a zombie until waitpid below.)
  for (int i = 0; i < 200; ++i) {  // until the kernel made it one
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(child));
    FILE* f = std::fopen(path, "r");
    char buf[512] = {0};
    if (f != nullptr) {
      (void)!std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
    }
    const char* p = std::strrchr(buf, ')');
    if (p != nullptr && p[2] == 'Z') break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE((*owner)->removed(0x10000, 0x1000, deadlineInMs(5000)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2))
      << "waited for a dead process's copy";
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, 0), child);
  close(ready[0]);
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
