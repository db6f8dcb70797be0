// GPU memory (MemoryKind::kCuda) against real peer processes, over the device layer's host
// simulation (MC_DEVICE=sim, whose device memory faults when host code touches it): a forced
// host transport (shm, tcp) moves GPU memory here through staging in host memory, and the
// peer's GPU memory over tcp through staging at the peer (over a forced shm it is refused,
// naming peer and transport; unforced, a process without a device layer reaches it over its
// tcp control connection); on one host without a forced transport the cuda transport moves it, between
// hosts tcp with staging. (Over rdma GPU memory moves directly: rdma_test.cc.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "tests/engine/peer_fixture.h"
#include "tests/engine/test_util.h"

namespace mooncake::test {
namespace {

class GpuMemoryTest : public PeerTestBase, public ::testing::WithParamInterface<std::string> {};

uint64_t addrOf(const std::string& reply) {
  return std::strtoull(reply.c_str() + 3, nullptr, 10);  // "ok <address>"
}

// Tells the peer to check `count` notifications, then writes notification slot k (of local
// memory local(k, slot), filled with pattern seed + k) to remote + the slot's offset, each
// submitted and not waited for, followed by a notification tagged tag_base + k. The peer reads
// each slot when its notification arrives. Returns its verdict: "ok", or what it found.
std::string writesThenNotifies(TransferEngine& eng, PeerId pid, PeerProcess* peer, int count,
                               uint64_t remote, uint64_t tag_base, uint64_t seed,
                               const std::function<uint8_t*(const Slot&, int k)>& local) {
  if (!peer->send("notify_check " + std::to_string(count) + " " + std::to_string(remote) + " " +
                  std::to_string(tag_base) + " " + std::to_string(seed) + " " +
                  std::to_string(eng.engineId()) + " 30000"))
    return "the peer took no command";
  std::vector<engine::BatchId> ids;
  for (int k = 0; k < count; ++k) {
    Slot s = notifySlot(k);
    uint8_t* src = local(s, k);
    fillPattern(src, s.len, seed + k, 0);
    auto id = eng.submit({{OpCode::kWrite, src, s.len, pid, remote + s.offset}});
    if (!id.ok()) return "submit " + std::to_string(k) + ": " + id.status().toString();
    ids.push_back(*id);
    Status st = eng.notify(pid, tag_base + k);
    if (!st.ok()) return "notify " + std::to_string(k) + ": " + st.toString();
  }
  for (auto id : ids) MC_EXPECT_OK(eng.wait(id, engine::deadlineInMs(20000)));
  std::string reply;
  if (!peer->recv(&reply, 35000)) return "no verdict from the peer";
  return reply;
}

TEST_P(GpuMemoryTest, ForcedHostTransportStagesGpuMemory) {
  ScopedEnv dev("MC_DEVICE", "sim");  // this process and the peer (it inherits it)
  const std::string transport = GetParam();
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = 1u << 16;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  const std::string r = peer->call("alloc_gpu 65536 501 1");  // published before we open it
  ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
  const uint64_t remote_gpu = addrOf(r);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), transport);

  // Host memory here, the peer's GPU memory there: tcp stages it at the peer; shm, whose
  // initiator maps only the peer's host regions, refuses it naming peer and transport.
  HostBuffer host(1u << 16);
  fillPattern(host.data(), 1u << 16, 502, 0);
  MC_ASSERT_OK(eng->registerMemory(host.data(), 1u << 16));
  Status st = transfer(*eng, OpCode::kWrite, host.data(), 4096, pid, remote_gpu);
  if (transport == "tcp") {
    MC_EXPECT_OK(st);
    EXPECT_EQ(peer->expect(remote_gpu, 4096, 502, 0), "");
    EXPECT_EQ(peer->expect(remote_gpu + 4096, 65536 - 4096, 501, 4096), "");
  } else {
    EXPECT_EQ(st.code(), Code::kNotSupported) << st.toString();
    for (const char* word : {"GPU memory", "peer", transport.c_str()})
      EXPECT_NE(st.message().find(word), std::string::npos) << word << " not in " << st.toString();
    EXPECT_EQ(peer->expect(remote_gpu, 65536, 501, 0), "") << "the peer's GPU memory changed";
    st = transfer(*eng, OpCode::kRead, host.data(), 4096, pid, remote_gpu);
    EXPECT_FALSE(st.ok()) << "a read of the peer's GPU memory over " << transport;
  }

  // GPU memory here, the peer's host memory there: staged through host memory here, both ways.
  auto gpu = eng->allocate(1u << 16, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  EXPECT_TRUE(eng->isRegistered(*gpu, 1u << 16));
  const uint64_t remote_host = peer->info().alloc_addr;
  fillPattern(*gpu, 1u << 16, 503, 0);
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, *gpu, 1u << 16, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, 1u << 16, 503, 0), "");
  ASSERT_EQ(peer->call("fill " + std::to_string(remote_host) + " 65536 504 0"), "ok");
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, *gpu, 1u << 16, pid, remote_host));
  EXPECT_EQ(checkPattern(*gpu, 1u << 16, 504, 0), "");

  // GPU memory the engine does not know: the device layer still copies it.
  auto dev_layer = engine::device::get();
  ASSERT_TRUE(dev_layer.ok());
  auto loose = (*dev_layer)->allocate(4096, 0);
  ASSERT_TRUE(loose.ok());
  fillPattern(*loose, 4096, 505, 0);
  MC_EXPECT_OK(transfer(*eng, OpCode::kWrite, *loose, 4096, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, 4096, 505, 0), "");
  MC_EXPECT_OK((*dev_layer)->free(*loose));

  // Host memory still moves once GPU memory is about.
  MC_EXPECT_OK(transfer(*eng, OpCode::kWrite, host.data(), 4096, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, 4096, 502, 0), "");
  MC_EXPECT_OK(eng->free(*gpu));
  EXPECT_FALSE(eng->isRegistered(*gpu, 1)) << "freed GPU memory is still registered";
  MC_EXPECT_OK(eng->unregisterMemory(host.data()));
}

// Registration checks what it is told: host memory is not GPU memory, and a GPU's memory is
// registered as that GPU's.
TEST_P(GpuMemoryTest, RegistrationChecksTheMemoryIsOnTheDevice) {
  ScopedEnv dev("MC_DEVICE", "sim");
  auto eng = makeEngine(GetParam());
  ASSERT_NE(eng, nullptr);
  HostBuffer host(1u << 16);
  Status st = eng->registerMemory(host.data(), 1u << 16, engine::MemoryKind::kCuda, 0);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_NE(st.message().find("not memory of one sim device"), std::string::npos) << st.toString();
  auto dev_layer = engine::device::get();
  ASSERT_TRUE(dev_layer.ok());
  auto p = (*dev_layer)->allocate(1u << 16, 3);
  ASSERT_TRUE(p.ok());
  st = eng->registerMemory(*p, 1u << 16, engine::MemoryKind::kCuda, 1);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_NE(st.message().find("on device 3"), std::string::npos) << st.toString();
  MC_EXPECT_OK(eng->registerMemory(*p, 1u << 16, engine::MemoryKind::kCuda, -1));
  EXPECT_TRUE(eng->isRegistered(*p, 1u << 16));
  MC_EXPECT_OK(eng->unregisterMemory(*p));
  MC_EXPECT_OK((*dev_layer)->free(*p));
}

// The engine's own choice on one host (no forced transport): host memory over shm, GPU memory
// (either side) over the cuda transport -- IPC handles and the device layer's copy stream --
// with the peer's engine-allocated host memory on the other side too, and its registered host
// memory (which cuda cannot map) staged through host memory here over shm; a notification
// follows the copies before it (the peer checks each write is visible when its tag arrives).
class CudaSameHost : public PeerTestBase {
 protected:
  // A peer spawned with var=value in its environment (this process's is left as it was).
  PeerProcess* spawnWith(const PeerConfig& cfg, const char* var, const char* value) {
    ScopedEnv there(var, value);  // the peer inherits it
    return spawnPeer(cfg);
  }
  // `len` bytes of the peer's GPU memory holding pattern(seed): its address, 0 on failure.
  uint64_t allocGpuThere(PeerProcess* peer, uint64_t len, int seed) {
    const std::string r = peer->call("alloc_gpu " + std::to_string(len) + " " +
                                     std::to_string(seed) + " 0");
    EXPECT_EQ(r.rfind("ok ", 0), 0u) << r;
    return r.rfind("ok ", 0) == 0 ? addrOf(r) : 0;
  }
};

TEST_F(CudaSameHost, GpuMemoryMovesOverCudaHostOverShm) {
  ScopedEnv dev("MC_DEVICE", "sim");
  constexpr int kCount = 24;
  constexpr uint64_t kLen = (2u << 20) + 333;
  constexpr uint64_t kTagBase = 0xC0DA000000000000ull;
  PeerConfig cfg;
  cfg.region_bytes = 4u << 20;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  const std::string r = peer->call("alloc_gpu " + std::to_string(8u << 20) + " 700 1");
  ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
  const uint64_t remote_gpu = addrOf(r);
  auto eng = makeEngine("");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  EXPECT_EQ(eng->peerTransport(pid), "shm");
  auto gpu = eng->allocate(8u << 20, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  auto* g = static_cast<uint8_t*>(*gpu);  // device memory: filled and checked through copies
  HostBuffer host(kLen);
  MC_ASSERT_OK(eng->registerMemory(host.data(), kLen));
  std::vector<uint8_t> loose(kLen);  // unregistered host memory
  const uint64_t remote_host = peer->info().alloc_addr;
  // Host memory the engine knows (registered here, the peer's engine-allocated regions, the
  // staging buffer) is pinned for the copies; only unregistered host memory is not.
  auto layer = engine::device::get();
  ASSERT_TRUE(layer.ok());
  uint64_t pageable = 0;
  auto pageableSince = [&] {
    const uint64_t now = (*layer)->pageableCopies(), d = now - pageable;
    pageable = now;
    return d;
  };

  fillPattern(host.data(), kLen, 701, 0);  // host -> the peer's GPU
  pageableSince();
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, host.data(), kLen, pid, remote_gpu + 5));
  EXPECT_EQ(pageableSince(), 0u) << "registered host memory was copied pageable";
  EXPECT_EQ(peer->expect(remote_gpu + 5, kLen, 701, 0), "");
  fillPattern(g, kLen, 702, 0);  // GPU -> GPU
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, g, kLen, pid, remote_gpu));
  EXPECT_EQ(peer->expect(remote_gpu, kLen, 702, 0), "");
  pageableSince();
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, loose.data(), kLen, pid, remote_gpu));  // -> host
  EXPECT_GE(pageableSince(), 1u) << "the count misses a pageable copy";
  EXPECT_EQ(checkPattern(loose.data(), kLen, 702, 0), "");
  pageableSince();
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, g + 9, kLen, pid, remote_host));  // host -> GPU
  EXPECT_EQ(pageableSince(), 0u) << "the peer's engine-allocated memory was copied pageable";
  EXPECT_EQ(checkPattern(g + 9, kLen, allocSeed(cfg), 0), "");
  fillPattern(g, kLen, 703, 0);  // GPU -> the peer's engine-allocated host memory
  pageableSince();
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, g, kLen, pid, remote_host));
  EXPECT_EQ(pageableSince(), 0u);
  EXPECT_EQ(peer->expect(remote_host, kLen, 703, 0), "");
  // Host memory the peer registered (not engine-allocated) is nothing cuda can map: staged
  // through host memory here and moved over shm, both ways.
  const uint64_t remote_reg = peer->info().reg_addr;
  fillPattern(g + 1, kLen, 704, 0);
  pageableSince();
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, g + 1, kLen, pid, remote_reg));
  EXPECT_EQ(peer->expect(remote_reg, kLen, 704, 0), "");
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, g + 3, kLen - 10, pid, remote_reg + 10));
  EXPECT_EQ(pageableSince(), 0u) << "the staging buffer was copied pageable";
  EXPECT_EQ(checkPattern(g + 3, kLen - 10, 704, 10), "");
  // Host to host still goes over shm, untouched.
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, host.data(), 4096, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, 4096, 701, 0), "");

  // Each write (submitted, not waited for) then a notification: it arrives after the bytes.
  ASSERT_LE(notifyBytes(kCount), 8u << 20);
  EXPECT_EQ(writesThenNotifies(*eng, pid, peer, kCount, remote_gpu, kTagBase, 800,
                               [&](const Slot& s, int) { return g + s.offset; }),
            "ok")
      << "the peer saw a notification before its write";

  // The same into the peer's registered host memory (staged here, then shm).
  constexpr int kStaged = 8;
  ASSERT_LE(notifyBytes(kStaged), cfg.region_bytes);
  EXPECT_EQ(writesThenNotifies(*eng, pid, peer, kStaged, remote_reg, kTagBase + 100, 850,
                               [&](const Slot& s, int) { return g + s.offset; }),
            "ok")
      << "the peer saw a notification before its staged write";
  MC_EXPECT_OK(eng->free(*gpu));
  MC_EXPECT_OK(eng->unregisterMemory(host.data()));
}

// A peer on another (simulated) host reached over tcp, no rdma: this side's GPU memory is
// staged through host memory (device_staging.h) both ways, in pieces (the request spans three),
// the peer's GPU memory is staged there by its tcp transport (from and into host and GPU memory
// here), and a notification follows unwaited staged writes on either side.
TEST_F(CudaSameHost, GpuMemoryIsStagedOverTcpBetweenHosts) {
  ScopedEnv dev("MC_DEVICE", "sim");
  constexpr uint64_t kLen = (9u << 20) + 77;
  constexpr int kCount = 16;
  constexpr uint64_t kTagBase = 0x57A6000000000000ull;
  PeerConfig cfg;
  cfg.region_bytes = 10u << 20;
  PeerProcess* peer = spawnWith(cfg, "MC_HOST_ID", "gpu-test-host-a");
  ASSERT_NE(peer, nullptr);
  constexpr uint64_t kPeerGpu = 5u << 20;
  const uint64_t remote_gpu = allocGpuThere(peer, kPeerGpu, 900);
  ASSERT_NE(remote_gpu, 0u);
  ScopedEnv here("MC_HOST_ID", "gpu-test-host-b");
  auto eng = makeEngine("");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), "tcp");
  auto gpu = eng->allocate(kLen, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  auto* g = static_cast<uint8_t*>(*gpu);
  const uint64_t remote_host = peer->info().alloc_addr;

  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, g, kLen, pid, remote_host));  // host there -> GPU
  EXPECT_EQ(checkPattern(g, kLen, allocSeed(cfg), 0), "");
  fillPattern(g, kLen, 901, 0);  // GPU -> host there
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, g, kLen, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, kLen, 901, 0), "");
  // The peer's GPU memory, staged there: read into host and GPU memory here, written from both.
  HostBuffer host(kPeerGpu);
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, host.data(), kPeerGpu, pid, remote_gpu));
  EXPECT_EQ(checkPattern(host.data(), kPeerGpu, 900, 0), "");
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, g + 5, kPeerGpu - 9, pid, remote_gpu + 9));
  EXPECT_EQ(checkPattern(g + 5, kPeerGpu - 9, 900, 9), "");
  fillPattern(host.data() + 3, kPeerGpu - 3, 930, 0);  // host here -> GPU there
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, host.data() + 3, kPeerGpu - 3, pid, remote_gpu));
  EXPECT_EQ(peer->expect(remote_gpu, kPeerGpu - 3, 930, 0), "");
  fillPattern(g, kPeerGpu, 931, 0);  // GPU here -> GPU there
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, g, kPeerGpu, pid, remote_gpu));
  EXPECT_EQ(peer->expect(remote_gpu, kPeerGpu, 931, 0), "");

  ASSERT_LE(notifyBytes(kCount), kLen);
  EXPECT_EQ(writesThenNotifies(*eng, pid, peer, kCount, remote_host, kTagBase, 950,
                               [&](const Slot& s, int) { return g + s.offset; }),
            "ok")
      << "the peer saw a notification before its staged write";

  // Unwaited writes into the peer's GPU memory (staged at the target), each followed by a
  // notification: the peer finds every write's bytes when its notification arrives.
  ASSERT_LE(notifyBytes(kCount), kPeerGpu);
  EXPECT_EQ(writesThenNotifies(*eng, pid, peer, kCount, remote_gpu, kTagBase + 100, 970,
                               [&](const Slot& s, int k) {  // host, then GPU memory here
                                 return k % 2 == 0 ? host.data() + s.offset : g + s.offset;
                               }),
            "ok")
      << "a notification overtook a write staged at the target";
  MC_EXPECT_OK(eng->free(*gpu));
}

// The peer frees its GPU region while a WRITE is staged into it over tcp (once the first of its
// slices was copied in). A slice whose payload was still arriving was then copied into the
// freed memory (the simulation's copy thread faulted, SIGSEGV; a GPU's copy engine faults or
// writes into whatever was allocated there since): the copy in now runs under the registry's
// fence, so the free waits for the copy in progress and later slices are refused.
TEST_F(CudaSameHost, GpuRegionFreedUnderAStagedWriteLeavesThePeerUsable) {
  ScopedEnv dev("MC_DEVICE", "sim");
  constexpr uint64_t kLen = 48u << 20;
  PeerConfig cfg;
  cfg.region_bytes = 1u << 20;
  PeerProcess* peer = spawnWith(cfg, "MC_HOST_ID", "gpu-test-host-a");
  ASSERT_NE(peer, nullptr);
  const uint64_t remote_gpu = allocGpuThere(peer, kLen, 990);
  ASSERT_NE(remote_gpu, 0u);
  ScopedEnv here("MC_HOST_ID", "gpu-test-host-b");
  auto eng = makeEngine("");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), "tcp");
  HostBuffer host(kLen);
  fillPattern(host.data(), kLen, 991, 0);
  ASSERT_EQ(peer->call("free_gpu_on_arrival 10000 " + std::to_string(remote_gpu), 10000),
            "watching");
  auto id = eng->submit({{OpCode::kWrite, host.data(), kLen, pid, remote_gpu}});
  ASSERT_TRUE(id.ok()) << id.status().toString();
  std::string answer;
  ASSERT_TRUE(peer->recv(&answer, 15000)) << "no outcome of free_gpu_on_arrival";
  EXPECT_EQ(answer, "ok");
  Status st = eng->wait(*id, engine::deadlineInMs(10000));
  std::printf("  the WRITE into the freed GPU region: %s\n", st.toString().c_str());
  EXPECT_TRUE(st.ok() || st.code() == Code::kPermissionDenied) << st.toString();
  MC_EXPECT_OK(eng->peerStatus(pid));
  fillPattern(host.data(), cfg.region_bytes, 992, 0);
  MC_EXPECT_OK(transfer(*eng, OpCode::kWrite, host.data(), cfg.region_bytes, pid,
                        peer->info().alloc_addr));
  EXPECT_EQ(peer->expect(peer->info().alloc_addr, cfg.region_bytes, 992, 0), "");
  MC_EXPECT_OK(eng->peerStatus(pid));
}

// A process without a device layer (a store master, a CPU-only client) and a same-host peer's
// GPU memory: its data goes over shm, which cannot reach GPU memory, so reads and writes of the
// peer's GPU memory go over the engine's tcp control connection, staged at the peer; a
// notification still follows the writes before it.
TEST_F(CudaSameHost, WithoutADeviceLayerThePeersGpuMemoryGoesOverTcp) {
  constexpr uint64_t kPeerGpu = 5u << 20;
  constexpr int kCount = 16;
  PeerConfig cfg;
  cfg.region_bytes = 1u << 20;
  PeerProcess* peer = spawnWith(cfg, "MC_DEVICE", "sim");
  ASSERT_NE(peer, nullptr);
  const uint64_t remote_gpu = allocGpuThere(peer, kPeerGpu, 960);
  ASSERT_NE(remote_gpu, 0u);
  ScopedEnv none("MC_DEVICE", "none");
  auto eng = makeEngine("");
  ASSERT_NE(eng, nullptr);
  EXPECT_FALSE(engine::device::get().ok()) << "this process has a device layer";
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), "shm");
  HostBuffer host(kPeerGpu);
  MC_ASSERT_OK(eng->registerMemory(host.data(), kPeerGpu));
  MC_ASSERT_OK(transfer(*eng, OpCode::kRead, host.data(), kPeerGpu, pid, remote_gpu));
  EXPECT_EQ(checkPattern(host.data(), kPeerGpu, 960, 0), "");
  fillPattern(host.data() + 8, 5000, 961, 0);
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, host.data() + 8, 5000, pid, remote_gpu + 64));
  EXPECT_EQ(peer->expect(remote_gpu + 64, 5000, 961, 0), "");
  EXPECT_EQ(peer->expect(remote_gpu + 64 + 5000, kPeerGpu - 64 - 5000, 960, 64 + 5000), "")
      << "bytes past the write changed";
  // The peer's host memory still goes over shm.
  const uint64_t remote_host = peer->info().alloc_addr;
  fillPattern(host.data(), 4096, 962, 0);
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, host.data(), 4096, pid, remote_host));
  EXPECT_EQ(peer->expect(remote_host, 4096, 962, 0), "");
  ASSERT_LE(notifyBytes(kCount), kPeerGpu);
  EXPECT_EQ(writesThenNotifies(*eng, pid, peer, kCount, remote_gpu, 0x57A7000000000000ull, 980,
                               [&](const Slot& s, int) { return host.data() + s.offset; }),
            "ok")
      << "a notification over shm overtook a write that went over tcp";
  MC_EXPECT_OK(eng->unregisterMemory(host.data()));
}

// The cuda transport moves GPU memory only: it cannot be forced for every peer.
TEST(CudaTransport, CannotBeForced) {
  ScopedEnv dev("MC_DEVICE", "sim");
  engine::EngineOptions o;
  o.secret = "job-secret-of-this-test-0123456789ab";
  o.transport = "cuda";
  auto e = TransferEngine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("GPU memory only"), std::string::npos) << e.status().toString();
}

INSTANTIATE_TEST_SUITE_P(HostOnly, GpuMemoryTest, ::testing::Values("shm", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace mooncake::test
