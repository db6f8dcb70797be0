// GPU memory (MemoryKind::kCuda) on the host-only transports, against real peer processes,
// over the device layer's host simulation (MC_DEVICE=sim): shm and tcp move host memory only,
// so a request with GPU memory on either side is refused -- on the initiator before anything
// moves, and on the target whatever the initiator claims -- naming the peer and transport;
// nothing is written. (Over rdma GPU memory moves: rdma_test.cc.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "engine/device/device.h"
#include "tests/engine/peer_fixture.h"
#include "tests/engine/test_util.h"

namespace mooncake::test {
namespace {

class GpuMemoryTest : public PeerTestBase, public ::testing::WithParamInterface<std::string> {};

uint64_t addrOf(const std::string& reply) {
  return std::strtoull(reply.c_str() + 3, nullptr, 10);  // "ok <address>"
}

TEST_P(GpuMemoryTest, HostOnlyTransportsRefuseGpuMemory) {
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

  // Host memory here, the peer's GPU memory there: refused (shm by the initiator, which maps
  // only the peer's host regions; tcp by the target, which serves only host regions).
  HostBuffer host(1u << 16);
  fillPattern(host.data(), 1u << 16, 502, 0);
  MC_ASSERT_OK(eng->registerMemory(host.data(), 1u << 16));
  Status st = transfer(*eng, OpCode::kWrite, host.data(), 4096, pid, remote_gpu);
  EXPECT_FALSE(st.ok()) << "a write into the peer's GPU memory over " << transport;
  EXPECT_EQ(peer->expect(remote_gpu, 65536, 501, 0), "") << "the peer's GPU memory changed";
  st = transfer(*eng, OpCode::kRead, host.data(), 4096, pid, remote_gpu);
  EXPECT_FALSE(st.ok()) << "a read of the peer's GPU memory over " << transport;

  // GPU memory here, the peer's host memory there: refused before anything moves.
  auto gpu = eng->allocate(1u << 16, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  EXPECT_TRUE(eng->isRegistered(*gpu, 1u << 16));
  const uint64_t remote_host = peer->info().alloc_addr;
  for (OpCode op : {OpCode::kWrite, OpCode::kRead}) {
    st = transfer(*eng, op, *gpu, 4096, pid, remote_host);
    ASSERT_FALSE(st.ok()) << "GPU memory went over " << transport;
    EXPECT_EQ(st.code(), Code::kNotSupported) << st.toString();
    for (const char* word : {"GPU memory", "peer", transport.c_str()})
      EXPECT_NE(st.message().find(word), std::string::npos) << word << " not in " << st.toString();
  }
  EXPECT_EQ(peer->expect(remote_host, cfg.region_bytes, allocSeed(cfg), 0), "");

  // GPU memory the engine does not know: refused the same way.
  auto dev_layer = engine::device::get();
  ASSERT_TRUE(dev_layer.ok());
  auto loose = (*dev_layer)->allocate(4096, 0);
  ASSERT_TRUE(loose.ok());
  st = transfer(*eng, OpCode::kWrite, *loose, 4096, pid, remote_host);
  EXPECT_EQ(st.code(), Code::kNotSupported) << st.toString();
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

INSTANTIATE_TEST_SUITE_P(HostOnly, GpuMemoryTest, ::testing::Values("shm", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace mooncake::test
