// Data path against a real peer process: WRITE then READ back at odd offsets, for every
// transport x size, every kind of local memory and both kinds of remote region; the peer
// checks what landed in its memory independently, byte for byte, guards included.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/engine/peer_fixture.h"

namespace mooncake::test {
namespace {

constexpr uint64_t kRemoteOff = 7;  // odd offsets on both sides
constexpr uint64_t kLocalOff = 3;
constexpr uint64_t kReadOff = 5;
constexpr uint64_t kGuard = 61;  // bytes checked untouched after the written range

enum class LocalKind { kRegistered, kAllocated, kUnregistered };
enum class RemoteKind { kAllocated, kRegistered };

const char* name(LocalKind k) {
  return k == LocalKind::kRegistered ? "local=registerMemory(malloc)"
         : k == LocalKind::kAllocated ? "local=allocate()"
                                      : "local=unregistered malloc";
}
const char* name(RemoteKind k) {
  return k == RemoteKind::kAllocated ? "remote=allocate()" : "remote=registerMemory(malloc)";
}

// Local memory of one kind, released at scope exit.
class LocalBuffer {
 public:
  LocalBuffer(TransferEngine& eng, LocalKind kind, size_t n) : eng_(eng), kind_(kind) {
    if (kind == LocalKind::kAllocated) {
      auto r = eng.allocate(n);
      EXPECT_TRUE(r.ok()) << "allocate(" << n << "): " << r.status().toString();
      if (r.ok()) p_ = static_cast<uint8_t*>(r.value());
    } else {
      host_ = std::make_unique<HostBuffer>(n);
      p_ = host_->data();
      if (kind == LocalKind::kRegistered) {
        Status st = eng.registerMemory(p_, n);
        EXPECT_TRUE(st.ok()) << "registerMemory: " << st.toString();
        if (!st.ok()) p_ = nullptr;
      }
    }
  }
  ~LocalBuffer() {
    if (p_ == nullptr) return;
    if (kind_ == LocalKind::kAllocated) {
      MC_EXPECT_OK(eng_.free(p_));
    } else if (kind_ == LocalKind::kRegistered) {
      MC_EXPECT_OK(eng_.unregisterMemory(p_));
    }
  }
  uint8_t* get() const { return p_; }

 private:
  TransferEngine& eng_;
  LocalKind kind_;
  std::unique_ptr<HostBuffer> host_;
  uint8_t* p_ = nullptr;
};

using TransferParam = std::tuple<std::string, uint64_t>;

class TransferTest : public PeerTestBase, public ::testing::WithParamInterface<TransferParam> {};

TEST_P(TransferTest, WriteThenReadBackAtOddOffsets) {
  const auto& [transport, size] = GetParam();
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = size + kRemoteOff + kGuard;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  EXPECT_EQ(eng->peerTransport(pid), transport);
  MC_EXPECT_OK(eng->peerStatus(pid));

  uint64_t seed = 1;
  for (LocalKind lk : {LocalKind::kRegistered, LocalKind::kAllocated, LocalKind::kUnregistered}) {
    for (RemoteKind rk : {RemoteKind::kAllocated, RemoteKind::kRegistered}) {
      SCOPED_TRACE(std::string(name(lk)) + ", " + name(rk));
      const uint64_t base =
          rk == RemoteKind::kAllocated ? peer->info().alloc_addr : peer->info().reg_addr;
      const uint64_t base_seed = rk == RemoteKind::kAllocated ? allocSeed(cfg) : regSeed(cfg);
      const uint64_t wseed = ++seed;
      LocalBuffer src(*eng, lk, size + kLocalOff + kGuard);
      LocalBuffer dst(*eng, lk, size + kReadOff + kGuard);
      ASSERT_NE(src.get(), nullptr);
      ASSERT_NE(dst.get(), nullptr);
      fillPattern(src.get(), size + kLocalOff + kGuard, wseed, 0);

      // WRITE local+3 -> remote+7.
      auto t0 = SteadyClock::now();
      MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, src.get() + kLocalOff, size, pid,
                            base + kRemoteOff));
      double write_ms = msSince(t0);
      // The peer checks its memory itself: the payload, and nothing written around it.
      EXPECT_EQ(peer->expect(base + kRemoteOff, size, wseed, kLocalOff), "") << "written bytes";
      EXPECT_EQ(peer->expect(base, kRemoteOff, base_seed, 0), "") << "bytes before the target";
      EXPECT_EQ(peer->expect(base + kRemoteOff + size, kGuard, base_seed, kRemoteOff + size), "")
          << "bytes after the target";

      // READ remote+7 -> another local buffer at +5; compare byte for byte.
      const uint64_t dseed = ++seed;
      fillPattern(dst.get(), size + kReadOff + kGuard, dseed, 0);
      t0 = SteadyClock::now();
      MC_ASSERT_OK(transfer(*eng, OpCode::kRead, dst.get() + kReadOff, size, pid,
                            base + kRemoteOff));
      double read_ms = msSince(t0);
      EXPECT_EQ(checkPattern(dst.get() + kReadOff, size, wseed, kLocalOff), "") << "read bytes";
      EXPECT_EQ(checkPattern(dst.get(), kReadOff, dseed, 0), "") << "local bytes before";
      EXPECT_EQ(checkPattern(dst.get() + kReadOff + size, kGuard, dseed, kReadOff + size), "")
          << "local bytes after";
      if (size >= (64u << 20)) {
        std::printf("  %s %s, %s: write %.1f ms, read %.1f ms\n", transport.c_str(),
                    name(lk), name(rk), write_ms, read_ms);
      }
    }
  }
}

std::string paramName(const ::testing::TestParamInfo<TransferParam>& info) {
  return std::get<0>(info.param) + "_" + sizeName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Engine, TransferTest,
                         ::testing::Combine(MC_TEST_TRANSPORTS,
                                            ::testing::Values(1, 4096 + 3, 1u << 20, 64u << 20)),
                         paramName);

// ---- by transport only ----

class TransportTest : public PeerTestBase, public ::testing::WithParamInterface<std::string> {};

// mappedAddress: non-null over shm for allocate()d memory (load/store straight into the peer),
// nullptr where the memory is not mapped here (tcp, or memory the peer did not allocate).
TEST_P(TransportTest, MappedAddress) {
  const std::string transport = GetParam();
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = 1u << 20;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  const PeerInfo& in = peer->info();

  void* m = eng->mappedAddress(pid, in.alloc_addr + 5, 1000);
  EXPECT_EQ(eng->mappedAddress(pid, in.alloc_addr + in.region_bytes - 10, 100), nullptr)
      << "a range past the region's end must not be mapped";
  EXPECT_EQ(eng->mappedAddress(pid, in.unreg_addr, 16), nullptr) << "unregistered memory";
  if (transport != "shm") {
    EXPECT_EQ(m, nullptr) << transport << " peers are not mapped";
    EXPECT_EQ(eng->mappedAddress(pid, in.reg_addr, 16), nullptr);
    return;
  }
  ASSERT_NE(m, nullptr) << "shm peer's allocate()d region must be mapped";
  EXPECT_EQ(eng->mappedAddress(pid, in.reg_addr, 16), nullptr)
      << "memory the peer did not allocate (process_vm path) is not mapped";
  // Reads see the peer's contents; writes through the pointer are visible to the peer.
  EXPECT_EQ(checkPattern(m, 1000, allocSeed(cfg), 5), "");
  fillPattern(m, 1000, 4242, 0);
  EXPECT_EQ(peer->expect(in.alloc_addr + 5, 1000, 4242, 0), "");
  // And the pointer is consistent with one-sided transfers.
  HostBuffer back(1000);
  MC_EXPECT_OK(transfer(*eng, OpCode::kRead, back.data(), 1000, pid, in.alloc_addr + 5));
  EXPECT_EQ(checkPattern(back.data(), 1000, 4242, 0), "");
  // releaseMapped: the region's mapping goes now (the copies above used the same one), not
  // when the peer closes; later copies and mappedAddress map it again.
  const engine::RegionDesc* region = eng->peerSegment(pid)->findRegion(in.alloc_addr, 1);
  ASSERT_NE(region, nullptr);
  const std::string file = region->shm_name.substr(region->shm_name.rfind('/') + 1);
  ASSERT_FALSE(file.empty());
  auto mapsOfFile = [&] {
    std::ifstream maps("/proc/self/maps");
    int n = 0;
    for (std::string line; std::getline(maps, line);) {
      const size_t at = line.find("/" + file);  // (the path ends there, or " (deleted)" follows)
      const size_t end = at + 1 + file.size();
      n += at != std::string::npos && (end == line.size() || line[end] == ' ');
    }
    return n;
  };
  EXPECT_GE(mapsOfFile(), 1);
  eng->releaseMapped(pid, static_cast<char*>(m) + 100);  // (any pointer into the mapping)
  EXPECT_EQ(mapsOfFile(), 0) << "the mapping of " << file << " is still there";
  eng->releaseMapped(pid, m);  // (no longer mapped: a no-op)
  HostBuffer again(1000);
  MC_EXPECT_OK(transfer(*eng, OpCode::kRead, again.data(), 1000, pid, in.alloc_addr + 5));
  EXPECT_EQ(checkPattern(again.data(), 1000, 4242, 0), "");
  EXPECT_EQ(mapsOfFile(), 1) << "the read above maps the region again";
  // A descriptor without the region (the peer freed it): the mapping only copies used goes;
  // one whose pointer was handed out stays until releaseMapped.
  const engine::SegmentDesc original = *eng->peerSegment(pid);
  engine::SegmentDesc without = original;
  without.regions.clear();
  for (const auto& r : original.regions)
    if (r.addr != region->addr) without.regions.push_back(r);
  ASSERT_EQ(without.regions.size() + 1, original.regions.size());
  MC_ASSERT_OK(eng->updatePeer(pid, without));
  EXPECT_EQ(mapsOfFile(), 0) << "a copy-only mapping of a dropped region is still there";
  MC_ASSERT_OK(eng->updatePeer(pid, original));
  void* m2 = eng->mappedAddress(pid, in.alloc_addr + 5, 1000);
  ASSERT_NE(m2, nullptr);
  MC_ASSERT_OK(eng->updatePeer(pid, without));
  EXPECT_EQ(mapsOfFile(), 1) << "a handed-out mapping went with the descriptor";
  EXPECT_EQ(checkPattern(m2, 1000, 4242, 0), "");
  eng->releaseMapped(pid, m2);
  EXPECT_EQ(mapsOfFile(), 0);
  MC_ASSERT_OK(eng->updatePeer(pid, original));
}

// One batch with many requests of both directions, to both regions, of mixed sizes;
// completion observed with poll(), statuses per request.
TEST_P(TransportTest, MixedBatchWithPoll) {
  const std::string transport = GetParam();
  constexpr int kPieces = 16;
  const uint64_t lens[4] = {1, 4096 + 3, (1u << 20) + 1, 77};
  std::vector<uint64_t> offs;  // same offset locally and remotely; odd
  uint64_t total = 1;
  for (int i = 0; i < kPieces; ++i) {
    offs.push_back(total);
    total += lens[i % 4] + 2;
  }
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = total;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  auto local = eng->allocate(total);
  ASSERT_TRUE(local.ok()) << local.status().toString();
  auto* buf = static_cast<uint8_t*>(local.value());
  std::vector<TransferRequest> reqs;
  for (int i = 0; i < kPieces; ++i) {
    const uint64_t rbase = i % 2 == 0 ? peer->info().alloc_addr : peer->info().reg_addr;
    uint8_t* l = buf + offs[i];
    if (i % 4 < 2) {  // write pattern(500+i) into the peer
      fillPattern(l, lens[i % 4], 500 + i, 0);
      reqs.push_back({OpCode::kWrite, l, lens[i % 4], pid, rbase + offs[i]});
    } else {  // read the peer's initial contents
      reqs.push_back({OpCode::kRead, l, lens[i % 4], pid, rbase + offs[i]});
    }
  }
  auto id = eng->submit(reqs);
  ASSERT_TRUE(id.ok()) << id.status().toString();
  bool done = false;
  std::vector<Status> per;
  auto t0 = SteadyClock::now();
  while (!done && msSince(t0) < 20000) {
    MC_ASSERT_OK(eng->poll(id.value(), &done, &per));
  }
  ASSERT_TRUE(done) << "batch not done after 20 s of polling";
  MC_EXPECT_OK(eng->wait(id.value(), engine::deadlineInMs(5000), &per));
  ASSERT_EQ(per.size(), reqs.size());
  for (int i = 0; i < kPieces; ++i) {
    EXPECT_TRUE(per[i].ok()) << "request " << i << ": " << per[i].toString();
    const uint64_t rbase = i % 2 == 0 ? peer->info().alloc_addr : peer->info().reg_addr;
    const uint64_t rseed = i % 2 == 0 ? allocSeed(cfg) : regSeed(cfg);
    if (i % 4 < 2) {
      EXPECT_EQ(peer->expect(rbase + offs[i], lens[i % 4], 500 + i, 0), "") << "request " << i;
    } else {
      EXPECT_EQ(checkPattern(reqs[i].local, lens[i % 4], rseed, offs[i]), "") << "request " << i;
    }
  }
  MC_EXPECT_OK(eng->free(buf));
}

// Two peers at once: one batch writes distinct data to both; each checks its own.
TEST_P(TransportTest, TwoPeersInOneBatch) {
  const std::string transport = GetParam();
  PeerConfig a, b;
  a.name = "peer-a";
  b.name = "peer-b";
  a.transport = b.transport = transport;
  b.seed = 2000;
  PeerProcess* pa = spawnPeer(a);
  PeerProcess* pb = spawnPeer(b);
  ASSERT_TRUE(pa && pb);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId ia = openPeer(*eng, "peer-a");
  PeerId ib = openPeer(*eng, "peer-b");
  ASSERT_NE(ia, engine::kInvalidPeer);
  ASSERT_NE(ib, engine::kInvalidPeer);
  EXPECT_NE(ia, ib);
  HostBuffer buf(2 << 16);
  fillPattern(buf.data(), 1 << 16, 71, 0);
  fillPattern(buf.data() + (1 << 16), 1 << 16, 72, 0);
  MC_ASSERT_OK(eng->transfer(
      {{OpCode::kWrite, buf.data(), 1 << 16, ia, pa->info().reg_addr + 3},
       {OpCode::kWrite, buf.data() + (1 << 16), 1 << 16, ib, pb->info().alloc_addr + 9}},
      engine::deadlineInMs(20000)));
  EXPECT_EQ(pa->expect(pa->info().reg_addr + 3, 1 << 16, 71, 0), "");
  EXPECT_EQ(pb->expect(pb->info().alloc_addr + 9, 1 << 16, 72, 0), "");
  EXPECT_EQ(pb->expect(pb->info().reg_addr, 1 << 16, regSeed(b), 0), "") << "untouched region";
}

// shm copies over pages this process has not touched through its mapping go through the
// peer's shm file (pread/pwrite); after MC_SHM_WARM_AFTER copies a page goes through the
// mapping (engine/transport/shm). Ranges that mix both kinds of page, repeated past the
// switch, with the bytes checked by the peer and read back every round; the pointer of
// mappedAddress sees the same bytes as the copies on either side of it.
TEST_F(PeerTestBase, ShmColdAndWarmPagesAgree) {
  PeerConfig cfg;
  cfg.transport = "shm";
  cfg.region_bytes = 64 * 4096;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine("shm");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  const uint64_t base = peer->info().alloc_addr;
  HostBuffer buf(16 * 4096), back(16 * 4096);
  // (offset, length): within a page, across a page edge, and a span that grows over fresh
  // pages every round, so that each copy after the first mixes pages copied different numbers
  // of times (each round copies every page of a span twice: a write and a read).
  const uint64_t warm_after = 8;  // the default of MC_SHM_WARM_AFTER
  for (uint64_t round = 0; round < warm_after + 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const std::pair<uint64_t, uint64_t> spans[] = {
        {100, 50}, {4096 - 5, 11}, {3 * 4096 + 17, (2 + round) * 4096 + 333}};
    for (const auto& [off, len] : spans) {
      const uint64_t seed = 9000 + round * 10 + off % 7;
      fillPattern(buf.data(), len, seed, 0);
      MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, buf.data(), len, pid, base + off));
      EXPECT_EQ(peer->expect(base + off, len, seed, 0), "") << "write at +" << off;
      std::memset(back.data(), 0xee, len);
      MC_ASSERT_OK(transfer(*eng, OpCode::kRead, back.data(), len, pid, base + off));
      EXPECT_EQ(checkPattern(back.data(), len, seed, 0), "") << "read at +" << off;
    }
  }
  // Pages 40..42 were never copied: a store through the pointer into page 41, a copy over it
  // and its cold neighbours, then the pointer again.
  auto* m = static_cast<uint8_t*>(eng->mappedAddress(pid, base + 41 * 4096, 4096));
  ASSERT_NE(m, nullptr);
  fillPattern(m, 4096, 77, 0);
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, back.data(), 3 * 4096, pid, base + 40 * 4096));
  EXPECT_EQ(checkPattern(back.data() + 4096, 4096, 77, 0), "");
  EXPECT_EQ(checkPattern(back.data(), 4096, allocSeed(cfg), 40 * 4096), "");
  fillPattern(buf.data(), 3 * 4096, 78, 0);
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, buf.data(), 3 * 4096, pid, base + 40 * 4096));
  EXPECT_EQ(checkPattern(m, 4096, 78, 4096), "");
  EXPECT_EQ(peer->expect(base + 40 * 4096, 3 * 4096, 78, 0), "");
  // A local buffer that is not mapped: on the file path the kernel reports it (EFAULT) and the
  // copy fails with an error naming the call instead of faulting in the engine (page 50 is
  // cold); the peer's bytes stay as they were.
  Status bad = transfer(*eng, OpCode::kWrite, reinterpret_cast<void*>(uintptr_t{4096}), 4096, pid,
                        base + 50 * 4096);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.toString().find("pwrite"), std::string::npos) << bad.toString();
  EXPECT_EQ(peer->expect(base + 50 * 4096, 4096, allocSeed(cfg), 50 * 4096), "");
}

INSTANTIATE_TEST_SUITE_P(Engine, TransportTest, MC_TEST_TRANSPORTS,
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace mooncake::test
