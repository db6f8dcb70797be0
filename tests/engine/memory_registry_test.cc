// MemoryRegistry: registration, overlap rejection, lookup, removal, shm allocation.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "engine/memory.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

Region region(uint64_t addr, uint64_t len) {
  Region r;
  r.addr = addr;
  r.len = len;
  return r;
}

bool shmExists(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

std::string prefix() { return "mc-test-" + std::to_string(getpid()); }

TEST(MemoryRegistryTest, AddFindRemove) {
  MemoryRegistry reg;
  const uint64_t v0 = reg.version();
  ASSERT_TRUE(reg.add(region(0x10000, 0x1000)).ok());
  ASSERT_TRUE(reg.add(region(0x20000, 0x100)).ok());
  EXPECT_GT(reg.version(), v0);

  auto f = reg.find(0x10000, 0x1000);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->addr, 0x10000u);
  EXPECT_EQ(f->len, 0x1000u);
  EXPECT_TRUE(reg.find(0x10001, 0x10).has_value());
  EXPECT_TRUE(reg.find(0x10fff, 1).has_value());
  EXPECT_FALSE(reg.find(0x10fff, 2).has_value()) << "straddles the end";
  EXPECT_FALSE(reg.find(0xffff, 2).has_value()) << "straddles the start";
  EXPECT_FALSE(reg.find(0x11000, 1).has_value()) << "one past the end";
  EXPECT_FALSE(reg.find(0x10000, 0x1001).has_value()) << "longer than the region";
  EXPECT_FALSE(reg.find(0x15000, 8).has_value()) << "between regions";
  EXPECT_FALSE(reg.find(0, 8).has_value());
  EXPECT_FALSE(reg.find(0x10000, ~uint64_t{0}).has_value()) << "length wraps";
  EXPECT_FALSE(reg.find(~uint64_t{0} - 4, 16).has_value()) << "address wraps";
  EXPECT_EQ(reg.find(0x20010, 0x10)->addr, 0x20000u);
  EXPECT_EQ(reg.snapshot().size(), 2u);

  const uint64_t v1 = reg.version();
  auto r = reg.remove(0x10000);
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r->len, 0x1000u);
  EXPECT_GT(reg.version(), v1);
  EXPECT_FALSE(reg.find(0x10000, 1).has_value());
  EXPECT_EQ(reg.remove(0x10000).status().code(), Code::kNotFound);
  EXPECT_FALSE(reg.remove(0x20001).ok()) << "remove needs the start address";
  EXPECT_EQ(reg.snapshot().size(), 1u);
}

TEST(MemoryRegistryTest, OverlapsRejected) {
  MemoryRegistry reg;
  ASSERT_TRUE(reg.add(region(0x10000, 0x1000)).ok());
  const uint64_t v = reg.version();
  struct Case {
    uint64_t addr, len;
    const char* what;
  } cases[] = {
      {0x10000, 0x1000, "identical"},  {0x10800, 0x1000, "overlapping the end"},
      {0xf800, 0x1000, "overlapping the start"}, {0x10100, 0x10, "inside"},
      {0xf000, 0x3000, "containing"},  {0x10fff, 1, "last byte"},
  };
  for (const auto& c : cases) {
    Status st = reg.add(region(c.addr, c.len));
    EXPECT_FALSE(st.ok()) << c.what;
  }
  EXPECT_EQ(reg.version(), v) << "a rejected add must not change the registry";
  EXPECT_TRUE(reg.add(region(0x11000, 0x10)).ok()) << "adjacent after";
  EXPECT_TRUE(reg.add(region(0xfff0, 0x10)).ok()) << "adjacent before";
  EXPECT_FALSE(reg.add(region(0x5000, 0)).ok()) << "empty region";
  EXPECT_FALSE(reg.add(region(~uint64_t{0} - 10, 100)).ok()) << "wrapping region";
  EXPECT_EQ(reg.snapshot().size(), 3u);
}

TEST(MemoryRegistryTest, ConcurrentAddFindRemove) {
  MemoryRegistry reg;
  constexpr int kThreads = 4, kPer = 500;
  std::vector<std::thread> th;
  std::atomic<int> bad{0};
  for (int t = 0; t < kThreads; ++t) {
    th.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        uint64_t a = 0x100000 + (static_cast<uint64_t>(t) * kPer + i) * 0x100;
        if (!reg.add(region(a, 0x80)).ok()) bad++;
        if (!reg.find(a + 1, 0x7f).has_value()) bad++;
        if (i % 2 == 0 && !reg.remove(a).ok()) bad++;
      }
    });
  }
  for (auto& x : th) x.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(reg.snapshot().size(), static_cast<size_t>(kThreads * kPer / 2));
}

// intoRegion: a step runs only while the request's own registration is there (not a later one
// at the same address), and remove() waits for the step in progress.
TEST(MemoryRegistryTest, IntoRegionFencesRemoval) {
  MemoryRegistry reg;
  ASSERT_TRUE(reg.add(region(0x10000, 0x1000)).ok());
  RegionCheck chk{reg.find(0x10000, 1)->serial, 0, 0, 0};
  EXPECT_NE(chk.serial, 0u);
  int steps = 0;
  EXPECT_TRUE(reg.intoRegion(0x10800, 0x100, &chk, [&] { ++steps; }));
  EXPECT_FALSE(reg.intoRegion(0x10f80, 0x100, &chk, [&] { ++steps; })) << "past the region";
  EXPECT_EQ(steps, 1);
  ASSERT_TRUE(reg.add(region(0x30000, 0x1000)).ok());  // another region: this one still holds
  EXPECT_TRUE(reg.intoRegion(0x10800, 0x100, &chk, [&] { ++steps; }));
  EXPECT_EQ(steps, 2);

  // remove() while a step runs: it returns only after the step ended.
  std::atomic<bool> in_step{false};
  std::atomic<int64_t> step_end_ns{0}, removed_ns{0};
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::thread stepper([&] {
    EXPECT_TRUE(reg.intoRegion(0x10000, 0x1000, &chk, [&] {
      in_step = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      step_end_ns = now_ns();
    }));
  });
  while (!in_step) std::this_thread::yield();
  ASSERT_TRUE(reg.remove(0x10000).ok());
  removed_ns = now_ns();
  stepper.join();
  EXPECT_GE(removed_ns.load(), step_end_ns.load()) << "remove() returned during a step";
  EXPECT_FALSE(reg.intoRegion(0x10800, 0x100, &chk, [&] { ++steps; })) << "removed";

  // Registered again at the same address: a different registration, so the WRITE admitted to
  // the first one does not go on into it; one admitted to the new one does.
  ASSERT_TRUE(reg.add(region(0x10000, 0x1000)).ok());
  EXPECT_FALSE(reg.intoRegion(0x10800, 0x100, &chk, [&] { ++steps; }));
  EXPECT_EQ(steps, 2);
  RegionCheck fresh{reg.find(0x10000, 1)->serial, 0, 0, 0};
  EXPECT_NE(fresh.serial, chk.serial);
  EXPECT_TRUE(reg.intoRegion(0x10800, 0x100, &fresh, [&] { ++steps; }));
  EXPECT_EQ(steps, 3);

  // GPU memory (tcp stages it: the device copy is the step) is fenced the same way.
  Region gpu = region(0x50000, 0x1000);
  gpu.kind = MemoryKind::kCuda;
  gpu.device = 0;
  ASSERT_TRUE(reg.add(gpu).ok());
  RegionCheck dev{reg.find(0x50000, 1)->serial, 0, 0, 0};
  EXPECT_TRUE(reg.intoRegion(0x50000, 0x1000, &dev, [&] { ++steps; }));
  ASSERT_TRUE(reg.remove(0x50000).ok());
  EXPECT_FALSE(reg.intoRegion(0x50000, 0x1000, &dev, [&] { ++steps; })) << "removed";
  EXPECT_EQ(steps, 4);
}

TEST(MemoryRegistryTest, AllocateShmIsRegisteredAndMappable) {
  MemoryRegistry reg;
  constexpr size_t kLen = (1u << 20) + 3;
  auto p = reg.allocateShm(kLen, prefix());
  ASSERT_TRUE(p.ok()) << p.status().toString();
  auto r = reg.find(reinterpret_cast<uint64_t>(p.value()), kLen);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->engine_owned);
  EXPECT_FALSE(r->shm_name.empty());
  EXPECT_TRUE(shmExists(r->shm_name)) << r->shm_name;

  // A second mapping (as a peer would make) sees the same bytes, both ways.
  test::fillPattern(p.value(), kLen, 3, 0);
  void* m = mapShm(r->shm_name, kLen);
  ASSERT_NE(m, nullptr) << "mapShm " << r->shm_name;
  EXPECT_EQ(test::checkPattern(m, kLen, 3, 0), "");
  test::fillPattern(m, 4096, 4, 0);
  EXPECT_EQ(test::checkPattern(p.value(), 4096, 4, 0), "");
  EXPECT_EQ(mapShm(r->shm_name, kLen + (1u << 20)), nullptr)
      << "mapping more than the file holds must fail (would SIGBUS on access)";
  EXPECT_EQ(mapShm("/mc-test-no-such-file", 4096), nullptr);
  unmapShm(m, kLen);

  const std::string name = r->shm_name;
  ASSERT_TRUE(reg.freeShm(p.value()).ok());
  EXPECT_FALSE(reg.find(reinterpret_cast<uint64_t>(p.value()), 1).has_value());
  EXPECT_FALSE(shmExists(name)) << "freeShm must unlink " << name;
  EXPECT_FALSE(reg.freeShm(p.value()).ok()) << "double free";
}

TEST(MemoryRegistryTest, FreeShmRejectsForeignPointers) {
  MemoryRegistry reg;
  std::vector<char> buf(4096);
  ASSERT_TRUE(reg.add(region(reinterpret_cast<uint64_t>(buf.data()), buf.size())).ok());
  EXPECT_FALSE(reg.freeShm(buf.data()).ok()) << "not allocated by the registry";
  EXPECT_TRUE(reg.find(reinterpret_cast<uint64_t>(buf.data()), 1).has_value())
      << "a refused free must leave the region registered";
  int x = 0;
  EXPECT_FALSE(reg.freeShm(&x).ok());
  EXPECT_FALSE(reg.allocateShm(0, prefix()).ok()) << "zero bytes";
}

TEST(MemoryRegistryTest, DestructorUnlinksShm) {
  std::vector<std::string> names;
  {
    MemoryRegistry reg;
    for (int i = 0; i < 3; ++i) {
      auto p = reg.allocateShm(8192, prefix());
      ASSERT_TRUE(p.ok()) << p.status().toString();
      names.push_back(reg.find(reinterpret_cast<uint64_t>(p.value()), 1)->shm_name);
    }
    EXPECT_NE(names[0], names[1]);
  }
  for (const auto& n : names) EXPECT_FALSE(shmExists(n)) << n << " left behind";
}

// Another local user cannot make allocations fail by creating the files they would use: the
// names carry 64 random bits, and a name found taken is not unlinked (it may be the other
// user's) but drawn again. Needs root (to create files as another user); skipped otherwise.
TEST(MemoryRegistryTest, SquattedNamesDoNotBlockAllocation) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  const std::string pre = prefix() + "-squat";
  // The allocating process: user daemon (root could unlink the squatter's files anyway).
  pid_t owner = fork();
  ASSERT_GE(owner, 0);
  if (owner == 0) {
    if (setgid(1) != 0 || setuid(1) != 0) _exit(2);
    // Wait for the squatter (it writes our pid's names), then allocate.
    for (int i = 0; i < 500 && !shmExists("/" + pre + "-done"); ++i) usleep(10000);
    bool ok = true;
    {
      MemoryRegistry reg;  // its files go with it
      for (int i = 0; i < 3 && ok; ++i) ok = reg.allocateShm(8192, pre).ok();
    }
    _exit(ok ? 0 : 1);
  }
  pid_t squatter = fork();
  ASSERT_GE(squatter, 0);
  if (squatter == 0) {  // user nobody: every name of the old scheme (prefix-pid-counter)
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    // (it shares the owner's pid namespace, so it knows the owner tag: pid and namespace)
    const std::string tag = std::to_string(owner) + shmOwnerTag().substr(shmOwnerTag().find('n'));
    for (int n = 0; n < 4096; ++n) {
      std::string name = "/" + pre + "-" + tag + "-" + std::to_string(n);
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0) close(fd);
    }
    int fd = shm_open(("/" + pre + "-done").c_str(), O_CREAT | O_RDWR, 0644);
    if (fd >= 0) close(fd);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(squatter, &status, 0), squatter);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "could not act as nobody";
  ASSERT_EQ(waitpid(owner, &status, 0), owner);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "an allocation failed on names another user took (exit " << WEXITSTATUS(status) << ")";
  const std::string tag = std::to_string(owner) + shmOwnerTag().substr(shmOwnerTag().find('n'));
  for (int n = 0; n < 4096; ++n)
    shm_unlink(("/" + pre + "-" + tag + "-" + std::to_string(n)).c_str());
  shm_unlink(("/" + pre + "-done").c_str());
}

// Stale files are reaped only when their owner tag names this pid namespace: another
// namespace's pid (a container sharing /dev/shm) says nothing about its process here.
TEST(MemoryRegistryTest, ReapsOnlyThisPidNamespacesDeadOwners) {
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // a pid with no process now
  const std::string pre = prefix() + "-reap";
  const std::string own = std::to_string(child) + shmOwnerTag().substr(shmOwnerTag().find('n'));
  const std::string ours = "/" + pre + "-" + own + "-0-x";
  const std::string theirs = "/" + pre + "-" + std::to_string(child) + "n1-0-x";  // ns 1
  for (const auto& n : {ours, theirs}) {
    int fd = shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << n;
    close(fd);
  }
  EXPECT_EQ(reapStaleShm(pre), 1);
  EXPECT_FALSE(shmExists(ours)) << "a dead owner of this namespace: reaped";
  EXPECT_TRUE(shmExists(theirs)) << "another namespace's file was reaped";
  shm_unlink(theirs.c_str());
  shm_unlink(ours.c_str());
}

}  // namespace
}  // namespace mooncake::engine
