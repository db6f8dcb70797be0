// rdma-only behaviour against real peer processes on the verbs emulator (tests/fakes/verbs):
// what the NIC reports is what the caller sees. (The shared suites run over rdma too; see
// MC_TEST_TRANSPORTS.) No failover exists yet: a failed work request poisons the peer's QP.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "tests/engine/peer_fixture.h"
#include "tests/fakes/verbs/fake_verbs_control.h"

namespace mooncake::test {
namespace {

class RdmaTest : public PeerTestBase {};

// A work request that completes with an error (injected on the initiator's NIC) fails its
// request with an error that names the peer, the NIC and the operation; the data that was
// written before it is intact, and the peer's QP stays failed (no failover yet).
TEST_F(RdmaTest, WorkRequestErrorNamesPeerNicAndOp) {
  PeerConfig cfg;
  cfg.transport = "rdma";
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine("rdma");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), "rdma");
  HostBuffer buf(1 << 16);
  fillPattern(buf.data(), 1 << 16, 77, 0);
  MC_ASSERT_OK(eng->registerMemory(buf.data(), 1 << 16));
  const uint64_t remote = peer->info().alloc_addr;
  MC_ASSERT_OK(transfer(*eng, OpCode::kWrite, buf.data(), 4096, pid, remote));
  EXPECT_EQ(peer->expect(remote, 4096, 77, 0), "");

  fakeverbs::NicControl nic(fakeVerbsFabric(), "", "mlx5_0");
  ASSERT_TRUE(nic.ok());
  const uint64_t failed_before = nic.wrFailed();
  nic.failNext(1);
  Status st = transfer(*eng, OpCode::kWrite, buf.data() + 4096, 4096, pid, remote + 4096);
  EXPECT_FALSE(st.ok()) << "an injected work-request error was not reported";
  std::printf("error seen: %s\n", st.toString().c_str());
  const std::string msg = st.message();
  EXPECT_NE(msg.find("WRITE"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mlx5_0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("peer"), std::string::npos) << msg;
  EXPECT_EQ(nic.wrFailed(), failed_before + 1) << "the emulator did not fail the request";
  EXPECT_EQ(peer->expect(remote, 4096, 77, 0), "") << "earlier bytes must stay intact";
  // The QP is in the error state: later requests fail at once with the same cause.
  st = transfer(*eng, OpCode::kRead, buf.data(), 4096, pid, remote);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("mlx5_0"), std::string::npos) << st.toString();
  MC_EXPECT_OK(eng->unregisterMemory(buf.data()));
}

}  // namespace
}  // namespace mooncake::test
