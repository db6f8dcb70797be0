// rdma-only behaviour against real peer processes on the verbs emulator (tests/fakes/verbs),
// whose two NICs (mlx5_0, mlx5_1; PeerTestBase) both processes share: striping over NICs,
// the NIC nearest to a buffer (hwloc XML fixtures, tests/data/topology), failover when a NIC's
// work requests fail or its port goes down, and the error when every NIC failed. What the
// emulator's NICs count (bytes, work requests) is what the assertions read. (The shared suites
// run over rdma too; see MC_TEST_TRANSPORTS.)
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "engine/device/device.h"
#include "tests/engine/rdma_fixture.h"

namespace mooncake::test {
namespace {

class RdmaTest : public RdmaPeerTest {
 protected:
  void downNicJoinsOnceUp(bool at_start, uint64_t seed);
};

std::string fixture(const std::string& name) {
  return std::string(MC_TEST_DATA_DIR) + "/topology/" + name;
}

// Memory the topology does not place (this machine's probe knows neither emulated NIC): a
// large write is striped over both NICs, within 10% of even.
TEST_F(RdmaTest, LargeWriteIsStripedEvenlyOverNics) {
  ASSERT_TRUE(setUp());
  HostBuffer buf(16u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 16u << 20));
  auto [b0, b1] = writeAndCount(buf, 16u << 20, 11);
  std::printf("bytes per NIC: mlx5_0 %llu, mlx5_1 %llu\n", static_cast<unsigned long long>(b0),
              static_cast<unsigned long long>(b1));
  const double even = (16u << 20) / 2.0;
  EXPECT_NEAR(static_cast<double>(b0), even, even * 0.1);
  EXPECT_NEAR(static_cast<double>(b1), even, even * 0.1);
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// With the 2-socket fixture (mlx5_0 on NUMA node 0, mlx5_1 on node 1), memory registered on a
// node goes through that node's NIC only; MC_RDMA_STRIPE=all uses both anyway.
TEST_F(RdmaTest, BufferUsesTheNicOfItsNumaNode) {
  const std::string xml_path = fixture("2socket.xml");
  ScopedEnv xml("MC_TOPOLOGY_XML", xml_path.c_str());
  ASSERT_TRUE(setUp());
  HostBuffer on0(4u << 20), on1(4u << 20);
  MC_ASSERT_OK(eng_->registerMemory(on0.data(), 4u << 20, engine::MemoryKind::kHost, 0));
  MC_ASSERT_OK(eng_->registerMemory(on1.data(), 4u << 20, engine::MemoryKind::kHost, 1));
  auto [a0, a1] = writeAndCount(on1, 4u << 20, 21);
  EXPECT_EQ(a0, 0u) << "memory on node 1 went through mlx5_0 (node 0)";
  EXPECT_GE(a1, 4u << 20);
  auto [c0, c1] = writeAndCount(on0, 4u << 20, 22);
  EXPECT_GE(c0, 4u << 20);
  EXPECT_EQ(c1, 0u) << "memory on node 0 went through mlx5_1 (node 1)";

  ScopedEnv all("MC_RDMA_STRIPE", "all");
  auto eng2 = makeEngine("rdma", "parent2");
  ASSERT_NE(eng2, nullptr);
  PeerId p2 = openPeer(*eng2, "peer");
  ASSERT_NE(p2, engine::kInvalidPeer);
  HostBuffer other(4u << 20);
  fillPattern(other.data(), 4u << 20, 23, 0);
  MC_ASSERT_OK(eng2->registerMemory(other.data(), 4u << 20, engine::MemoryKind::kHost, 1));
  const uint64_t tx0 = nic_[0]->txBytes(), tx1 = nic_[1]->txBytes();
  const uint64_t remote = peer_->info().alloc_addr;
  MC_ASSERT_OK(transfer(*eng2, OpCode::kWrite, other.data(), 4u << 20, p2, remote));
  EXPECT_EQ(peer_->expect(remote, 4u << 20, 23, 0), "");
  EXPECT_GT(nic_[0]->txBytes() - tx0, 0u) << "MC_RDMA_STRIPE=all left mlx5_0 out";
  EXPECT_GT(nic_[1]->txBytes() - tx1, 0u);
}

// MC_RDMA_QPS_PER_EP=3: three QPs per NIC to the peer (and three on the peer's side), the
// bytes still spread evenly over the NICs, and the notifications after writes that went over
// six QPs arrive in order, once each.
TEST_F(RdmaTest, SeveralQpsPerNic) {
  constexpr int kCount = 24;
  constexpr uint64_t kTagBase = 0x3C3C000000000000ull;
  constexpr uint64_t kSeed = 500;
  ScopedEnv qps("MC_RDMA_QPS_PER_EP", "3");
  PeerConfig cfg;
  cfg.transport = "rdma";
  cfg.region_bytes = 16u << 20;
  peer_ = spawnPeer(cfg);
  ASSERT_NE(peer_, nullptr);
  eng_ = makeEngine("rdma");
  ASSERT_NE(eng_, nullptr);
  ASSERT_TRUE(openNicControls());
  const uint64_t q0 = nic_[0]->nextQpn(), q1 = nic_[1]->nextQpn();
  pid_ = openPeer(*eng_, "peer");
  ASSERT_NE(pid_, engine::kInvalidPeer);
  EXPECT_EQ(nic_[0]->nextQpn() - q0, 6u) << "3 QPs of this engine and 3 of the peer on mlx5_0";
  EXPECT_EQ(nic_[1]->nextQpn() - q1, 6u);
  HostBuffer buf(12u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 12u << 20));
  auto [b0, b1] = writeAndCount(buf, 12u << 20, 81);
  EXPECT_EQ(b0, 6u << 20);
  EXPECT_EQ(b1, 6u << 20);
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));

  const uint64_t remote = peer_->info().reg_addr;
  ASSERT_TRUE(startNotifyCheck(peer_, kCount, remote, kTagBase, kSeed, 30000));
  HostBuffer local(notifyBytes(kCount));
  MC_ASSERT_OK(eng_->registerMemory(local.data(), notifyBytes(kCount)));
  for (int k = 0; k < kCount; ++k) {
    Slot s = notifySlot(k);
    fillPattern(local.data() + s.offset, s.len, kSeed + k, 0);
    auto id = eng_->submit({{OpCode::kWrite, local.data() + s.offset, s.len, pid_,
                             remote + s.offset}});
    ASSERT_TRUE(id.ok()) << id.status().toString();
    MC_ASSERT_OK(eng_->notify(pid_, kTagBase + k));
  }
  std::string reply, why;
  ASSERT_TRUE(peer_->recv(&reply, 40000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  ASSERT_TRUE(peer_->send("drain_notify 300"));
  ASSERT_TRUE(peer_->recv(&reply, 10000, &why)) << why;
  EXPECT_EQ(reply, "ok 0");
  MC_EXPECT_OK(eng_->unregisterMemory(local.data()));
}

// A work request that fails on one NIC (injected: the NIC completes it with an error and its
// QP goes to the error state) moves, with the rest of that QP's work, to the other NIC: the
// request succeeds with every byte in place. The failed NIC carries nothing for the peer until
// MC_RDMA_RETRY_MS passed, then it is reconnected and carries its share again.
TEST_F(RdmaTest, FailedWorkRequestMovesToTheOtherNic) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "400");
  ASSERT_TRUE(setUp());
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  const uint64_t failed0 = nic_[0]->wrFailed();
  nic_[0]->failNext(1);
  auto [a0, a1] = writeAndCount(buf, 8u << 20, 31);
  // (The emulator counts the work requests the error flushed too.)
  EXPECT_GE(nic_[0]->wrFailed(), failed0 + 1) << "the emulator did not fail a work request";
  EXPECT_GE(a1, 4u << 20) << "mlx5_1 should have carried its share and mlx5_0's failed slices";
  // Paused: the next requests go over mlx5_1 only.
  auto [b0, b1] = writeAndCount(buf, 4u << 20, 32);
  EXPECT_EQ(b0, 0u) << "mlx5_0 carried bytes while paused";
  EXPECT_GE(b1, 4u << 20);
  // Back after the retry delay (the prober reconnects it).
  const uint64_t back = waitForNic(buf, 0, 40);
  EXPECT_GT(back, 0u) << "mlx5_0 never carried bytes again";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// Notifications stay ordered after the writes they follow, and are delivered exactly once,
// while a NIC fails under them (the failed QP's notification parts move with its writes).
TEST_F(RdmaTest, NotificationsSurviveFailover) {
  constexpr int kCount = 48;
  constexpr uint64_t kTagBase = 0x5A5A000000000000ull;
  constexpr uint64_t kSeed = 9000;
  ScopedEnv retry("MC_RDMA_RETRY_MS", "200");
  ASSERT_TRUE(setUp(notifyBytes(kCount) + 8));
  const uint64_t remote = peer_->info().alloc_addr;
  ASSERT_TRUE(startNotifyCheck(peer_, kCount, remote, kTagBase, kSeed, 30000));
  HostBuffer local(notifyBytes(kCount));
  MC_ASSERT_OK(eng_->registerMemory(local.data(), notifyBytes(kCount)));
  const uint64_t failed = nic_[0]->wrFailed() + nic_[1]->wrFailed();
  std::vector<engine::BatchId> batches;
  for (int k = 0; k < kCount; ++k) {
    if (k == 5) nic_[1]->failNext(1);
    if (k == 30) nic_[0]->failNext(1);
    Slot s = notifySlot(k);
    fillPattern(local.data() + s.offset, s.len, kSeed + k, 0);
    auto id = eng_->submit({{OpCode::kWrite, local.data() + s.offset, s.len, pid_,
                             remote + s.offset}});
    ASSERT_TRUE(id.ok()) << "submit " << k << ": " << id.status().toString();
    batches.push_back(id.value());
    MC_ASSERT_OK(eng_->notify(pid_, kTagBase + k));
    if (k == 20) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // mlx5_1 back
  }
  for (auto& b : batches) MC_EXPECT_OK(eng_->wait(b, engine::deadlineInMs(20000)));
  std::string reply, why;
  ASSERT_TRUE(peer_->recv(&reply, 40000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  EXPECT_GE(nic_[0]->wrFailed() + nic_[1]->wrFailed(), failed + 1)
      << "no work request failed: the test did not exercise failover";
  ASSERT_TRUE(peer_->send("drain_notify 300"));
  ASSERT_TRUE(peer_->recv(&reply, 10000, &why)) << why;
  EXPECT_EQ(reply, "ok 0") << "a notification was delivered twice";
}

// A port that goes down: its work requests time out and move to the other NIC.
TEST_F(RdmaTest, PortDownMovesTrafficToTheOtherNic) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "300");
  ASSERT_TRUE(setUp());
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  nic_[1]->setPortUp(false);
  writeAndCount(buf, 8u << 20, 51);
  auto [b0, b1] = writeAndCount(buf, 4u << 20, 52);
  EXPECT_GE(b0, 4u << 20);
  EXPECT_EQ(b1, 0u) << "mlx5_1 is down";
  nic_[1]->setPortUp(true);
  const uint64_t back = waitForNic(buf, 1, 60);
  EXPECT_GT(back, 0u) << "mlx5_1 never carried bytes again after its port came up";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// Without the tcp fallback, when every NIC failed the request fails, naming the peer, each NIC
// and the operation; the bytes written before stay intact.
TEST_F(RdmaTest, EveryNicFailedNamesPeerNicsAndOp) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "600000");  // no reconnection during the test
  ScopedEnv no_tcp("MC_RDMA_TCP_FALLBACK", "0");
  ASSERT_TRUE(setUp());
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  writeAndCount(buf, 4096, 71);
  nic_[0]->failNext(1);
  nic_[1]->failNext(1);
  fillPattern(buf.data() + 4096, (8u << 20) - 4096, 72, 0);
  Status st = transfer(*eng_, OpCode::kWrite, buf.data() + 4096, (8u << 20) - 4096, pid_,
                       peer_->info().alloc_addr + 4096);
  ASSERT_FALSE(st.ok()) << "both NICs failed a work request, yet the write succeeded";
  std::printf("error seen: %s\n", st.toString().c_str());
  const std::string msg = st.message();
  for (const char* want : {"WRITE", "peer", "every NIC", "mlx5_0", "mlx5_1"})
    EXPECT_NE(msg.find(want), std::string::npos) << "'" << want << "' missing from: " << msg;
  EXPECT_EQ(peer_->expect(peer_->info().alloc_addr, 4096, 71, 0), "")
      << "earlier bytes must stay intact";
  st = transfer(*eng_, OpCode::kRead, buf.data(), 4096, pid_, peer_->info().alloc_addr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("every NIC"), std::string::npos) << st.toString();
  // A notification has no NIC either: an error, not a silent loss.
  st = eng_->notify(pid_, 1);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("every NIC"), std::string::npos) << st.toString();
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// Both ports go down: tcp (the control link) takes over. Writes and reads move every byte while
// the NICs send nothing; in a stream of writes, each followed by a notification, with the ports
// going down and up again under it, every byte lands and every notification arrives once and
// after its write; once the ports are up the NICs carry the traffic again.
TEST_F(RdmaTest, EveryNicDownTcpTakesOver) {
  constexpr int kCount = 40;
  constexpr uint64_t kTagBase = 0x7C7C000000000000ull;
  constexpr uint64_t kSeed = 7000;
  constexpr uint64_t kBig = 8u << 20;
  ScopedEnv retry("MC_RDMA_RETRY_MS", "200");
  ASSERT_TRUE(setUp(notifyBytes(kCount) + kBig));
  const uint64_t remote = peer_->info().alloc_addr;
  const uint64_t big = remote + notifyBytes(kCount);
  {
    nic_[0]->setPortUp(false);
    nic_[1]->setPortUp(false);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a packet on its way lands
    const uint64_t tx = nic_[0]->txBytes() + nic_[1]->txBytes();
    HostBuffer w(kBig), r(kBig);
    fillPattern(w.data(), kBig, 77, 0);
    MC_ASSERT_OK(eng_->registerMemory(w.data(), kBig));
    MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, w.data(), kBig, pid_, big));
    EXPECT_EQ(peer_->expect(big, kBig, 77, 0), "");
    MC_ASSERT_OK(transfer(*eng_, OpCode::kRead, r.data(), kBig, pid_, big));  // unregistered
    EXPECT_EQ(std::memcmp(w.data(), r.data(), kBig), 0) << "a READ over tcp differs";
    EXPECT_EQ(nic_[0]->txBytes() + nic_[1]->txBytes(), tx) << "a NIC whose port is down sent";
    MC_EXPECT_OK(eng_->unregisterMemory(w.data()));
    nic_[0]->setPortUp(true);
    nic_[1]->setPortUp(true);
  }
  ASSERT_TRUE(startNotifyCheck(peer_, kCount, remote, kTagBase, kSeed, 60000));
  HostBuffer local(notifyBytes(kCount));
  MC_ASSERT_OK(eng_->registerMemory(local.data(), notifyBytes(kCount)));
  std::vector<engine::BatchId> batches;
  for (int k = 0; k < kCount; ++k) {
    const bool down = k >= 10 && k < 30;
    nic_[0]->setPortUp(!down);
    nic_[1]->setPortUp(!down);
    if (k == 20) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    Slot s = notifySlot(k);
    fillPattern(local.data() + s.offset, s.len, kSeed + k, 0);
    auto id = eng_->submit({{OpCode::kWrite, local.data() + s.offset, s.len, pid_,
                             remote + s.offset}});
    ASSERT_TRUE(id.ok()) << "submit " << k << ": " << id.status().toString();
    batches.push_back(id.value());
    MC_ASSERT_OK(eng_->notify(pid_, kTagBase + k));
  }
  for (auto& b : batches) MC_EXPECT_OK(eng_->wait(b, engine::deadlineInMs(30000)));
  std::string reply, why;
  ASSERT_TRUE(peer_->recv(&reply, 70000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  ASSERT_TRUE(peer_->send("drain_notify 300"));
  ASSERT_TRUE(peer_->recv(&reply, 10000, &why)) << why;
  EXPECT_EQ(reply, "ok 0") << "a notification was delivered twice";
  // The NICs are back once the prober reconnected them and tcp has nothing left.
  HostBuffer buf(4u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 4u << 20));
  const uint64_t back = waitForNic(buf, -1, 90);
  EXPECT_GT(back, 0u) << "no NIC carried bytes again after the ports came up";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
  MC_EXPECT_OK(eng_->unregisterMemory(local.data()));
}

// mlx5_1's port is down when the engine starts (at_start) or when the peer is opened: it
// carries nothing while down; once its port is up the prober connects its lanes, which then
// carry their share.
void RdmaTest::downNicJoinsOnceUp(bool at_start, uint64_t seed) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "200");
  PeerConfig cfg;
  cfg.transport = "rdma";
  cfg.region_bytes = 16u << 20;
  peer_ = spawnPeer(cfg);
  ASSERT_NE(peer_, nullptr);
  if (at_start) {
    auto first = makeEngine("rdma", "starter");  // creates this host's emulated NICs
    ASSERT_NE(first, nullptr);
    first.reset();
    ASSERT_TRUE(openNicControls());
    nic_[1]->setPortUp(false);
  }
  eng_ = makeEngine("rdma");
  ASSERT_NE(eng_, nullptr);
  if (!at_start) {
    ASSERT_TRUE(openNicControls());
    nic_[1]->setPortUp(false);
  }
  pid_ = openPeer(*eng_, "peer");
  ASSERT_NE(pid_, engine::kInvalidPeer);
  ASSERT_EQ(eng_->peerTransport(pid_), "rdma");
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  auto [a0, a1] = writeAndCount(buf, 8u << 20, seed);
  EXPECT_GE(a0, 8u << 20);
  EXPECT_EQ(a1, 0u) << "a NIC whose port is down carried bytes";
  nic_[1]->setPortUp(true);
  const uint64_t back = waitForNic(buf, 1, seed + 1);
  EXPECT_GT(back, 0u) << "mlx5_1 never carried bytes after its port came up";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

TEST_F(RdmaTest, NicDownAtOpenIsConnectedLater) { downNicJoinsOnceUp(false, 111); }

// A RoCE NIC down at engine start is kept (its GID is known), not left out for good.
TEST_F(RdmaTest, NicDownAtEngineStartJoinsOnceUp) { downNicJoinsOnceUp(true, 121); }

// An InfiniBand NIC down at engine start is kept too: its LID (none while the port is down)
// is read again when its lanes connect.
TEST_F(RdmaTest, IbNicDownAtEngineStartJoinsOnceUp) {
  if (!setFakeNicsInfiniBand())
    GTEST_SKIP() << "the emulator already read a RoCE config in this process (run it alone)";
  downNicJoinsOnceUp(true, 131);
}

// Every port down when the engine starts: rdma is not offered (peers get tcp).
TEST_F(RdmaTest, EveryPortDownAtEngineStartLeavesRdmaOut) {
  {
    auto first = makeEngine("rdma", "starter");
    ASSERT_NE(first, nullptr);
  }
  ASSERT_TRUE(openNicControls());
  nic_[0]->setPortUp(false);
  nic_[1]->setPortUp(false);
  engine::EngineOptions opt;
  opt.name = "parent";
  opt.transport = "rdma";
  opt.secret = "job-secret-of-this-test-0123456789ab";
  auto eng = TransferEngine::create(opt);
  nic_[0]->setPortUp(true);
  nic_[1]->setPortUp(true);
  ASSERT_FALSE(eng.ok()) << "MC_TRANSPORT=rdma with every port down made an engine";
  EXPECT_NE(eng.status().message().find("the port of every NIC is down"), std::string::npos)
      << eng.status().toString();
}

// MC_RDMA_MAX_ENDPOINTS=1 with two peers: each NIC keeps lanes to one peer; the other's idle
// lanes are closed at both ends (the QPs are gone from the NICs) and dialled again when it is
// used. Bytes and notifications (in order, once) survive the closing and redialling.
TEST_F(RdmaTest, IdleEndpointsBeyondTheLimitAreClosedAndDialledAgain) {
  constexpr int kCount = 8;
  constexpr uint64_t kTagBase = 0x4E4E000000000000ull;
  constexpr uint64_t kSeed = 3000;
  ScopedEnv limit("MC_RDMA_MAX_ENDPOINTS", "1");
  ScopedEnv retry("MC_RDMA_RETRY_MS", "40");  // the prober looks every 10 ms
  PeerConfig c1, c2;
  c1.transport = c2.transport = "rdma";
  c1.name = "p1";
  c2.name = "p2";
  c1.region_bytes = c2.region_bytes = 8u << 20;
  PeerProcess* p1 = spawnPeer(c1);
  PeerProcess* p2 = spawnPeer(c2);
  ASSERT_TRUE(p1 != nullptr && p2 != nullptr);
  eng_ = makeEngine("rdma");
  ASSERT_NE(eng_, nullptr);
  ASSERT_TRUE(openNicControls());
  const int64_t qps0 = nic_[0]->liveQps();
  PeerId id1 = openPeer(*eng_, "p1");
  PeerId id2 = openPeer(*eng_, "p2");
  ASSERT_TRUE(id1 != engine::kInvalidPeer && id2 != engine::kInvalidPeer);
  HostBuffer buf(4u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 4u << 20));
  auto write = [&](PeerId to, PeerProcess* p, uint64_t seed) {
    fillPattern(buf.data(), 4u << 20, seed, 0);
    MC_EXPECT_OK(transfer(*eng_, OpCode::kWrite, buf.data(), 4u << 20, to, p->info().alloc_addr));
    EXPECT_EQ(p->expect(p->info().alloc_addr, 4u << 20, seed, 0), "");
  };
  // Settled: at most 1 of our QPs and the peer's QP for it per NIC.
  auto settledQps = [&] {
    int64_t n = 0;
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      n = nic_[0]->liveQps() - qps0;
      if (n <= 2) break;
    }
    return n;
  };
  write(id1, p1, 1);
  write(id2, p2, 2);
  EXPECT_EQ(settledQps(), 2) << "p1's idle lane on mlx5_0 was not closed at both ends";
  const uint64_t qpn = nic_[0]->nextQpn();
  write(id1, p1, 3);  // dials p1 again; p2 is closed next
  EXPECT_GT(nic_[0]->nextQpn(), qpn) << "p1's lane was not dialled again";
  EXPECT_EQ(settledQps(), 2);

  // Notifications to p1, each after a write, with p2 used in between so that p1's lanes are
  // closed and dialled again between them.
  const uint64_t remote = p1->info().reg_addr;
  ASSERT_TRUE(startNotifyCheck(p1, kCount, remote, kTagBase, kSeed, 30000));
  HostBuffer local(notifyBytes(kCount));
  MC_ASSERT_OK(eng_->registerMemory(local.data(), notifyBytes(kCount)));
  const uint64_t qpn2 = nic_[0]->nextQpn();
  for (int k = 0; k < kCount; ++k) {
    Slot s = notifySlot(k);
    fillPattern(local.data() + s.offset, s.len, kSeed + k, 0);
    MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, local.data() + s.offset, s.len, id1,
                          remote + s.offset));
    MC_ASSERT_OK(eng_->notify(id1, kTagBase + k));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    fillPattern(buf.data(), 4096, 50 + k, 0);
    MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, buf.data(), 4096, id2, p2->info().alloc_addr));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  std::string reply, why;
  ASSERT_TRUE(p1->recv(&reply, 40000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  ASSERT_TRUE(p1->send("drain_notify 300"));
  ASSERT_TRUE(p1->recv(&reply, 10000, &why)) << why;
  EXPECT_EQ(reply, "ok 0") << "a notification was delivered twice";
  EXPECT_GE(nic_[0]->nextQpn() - qpn2, 4u) << "the lanes were not closed and dialled again";
  MC_EXPECT_OK(eng_->unregisterMemory(local.data()));
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// NICs whose max_mr_size (1 MiB) is below the regions' size: both sides register in chunks;
// writes and reads that cross chunks (at odd offsets, from registered and from unregistered
// memory) move every byte, over the NICs.
TEST_F(RdmaTest, RegionsAboveMaxMrSizeAreRegisteredInChunks) {
  setFakeNicExtra(" max_mr_size=1048576");
  ASSERT_TRUE(setUp(6u << 20));
  constexpr uint64_t kLen = (3u << 20) + 12345;
  HostBuffer buf(5u << 20), back(5u << 20), plain(kLen);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 5u << 20));
  const uint64_t remote = peer_->info().alloc_addr + 777;
  const uint64_t tx0 = nic_[0]->txBytes() + nic_[1]->txBytes();
  auto [a, b] = writeAndCount(buf, kLen, 131, 777);
  EXPECT_GE(a + b, kLen) << "the NICs did not carry the write";
  MC_ASSERT_OK(eng_->registerMemory(back.data(), 5u << 20));
  MC_ASSERT_OK(transfer(*eng_, OpCode::kRead, back.data() + 4097, kLen, pid_, remote));
  EXPECT_EQ(std::memcmp(back.data() + 4097, buf.data(), kLen), 0) << "a READ across chunks differs";
  fillPattern(plain.data(), kLen, 132, 0);  // unregistered: through the bounce pool
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, plain.data(), kLen, pid_, remote));
  EXPECT_EQ(peer_->expect(remote, kLen, 132, 0), "");
  EXPECT_GE(nic_[0]->txBytes() + nic_[1]->txBytes() - tx0, 2 * kLen);
  MC_EXPECT_OK(eng_->unregisterMemory(back.data()));
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// GPU memory over rdma, with the device layer's simulation (MC_DEVICE=sim) standing in for a
// GPU: both processes register it on every NIC through a dma-buf (the emulator counts dma-buf
// MRs; it maps the dma-buf itself and addresses the MR by its iova, as a NIC does), and it
// moves both ways with host or GPU memory on the other side. GPU memory the engine does not
// know is refused (it cannot bounce through host memory), and so is GPU memory on either side
// once only the tcp fallback is left. Freeing deregisters.
TEST_F(RdmaTest, GpuMemoryIsRegisteredThroughDmabufAndMoves) {
  ScopedEnv dev("MC_DEVICE", "sim");  // this process and the peer (it inherits it)
  constexpr uint64_t kLen = (3u << 20) + 4096 * 3 + 123;
  ASSERT_TRUE(setUp(4u << 20));
  const int64_t mrs0 = nic_[0]->dmabufMrs() + nic_[1]->dmabufMrs();
  const std::string r = peer_->call("alloc_gpu " + std::to_string(kLen) + " 600 1");
  ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
  const uint64_t remote_gpu = std::strtoull(r.c_str() + 3, nullptr, 10);
  ASSERT_EQ(openPeer(*eng_, "peer"), pid_);  // its new descriptor
  EXPECT_EQ(nic_[0]->dmabufMrs() + nic_[1]->dmabufMrs(), mrs0 + 2) << "the peer's GPU memory "
                                                                       "is not a dma-buf MR "
                                                                       "on each NIC";
  auto gpu = eng_->allocate(kLen, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  EXPECT_EQ(nic_[0]->dmabufMrs() + nic_[1]->dmabufMrs(), mrs0 + 4);
  auto* g = static_cast<uint8_t*>(*gpu);  // simulated device memory is host memory
  HostBuffer host(kLen);
  MC_ASSERT_OK(eng_->registerMemory(host.data(), kLen));
  const uint64_t remote_host = peer_->info().alloc_addr;
  const uint64_t tx0 = nic_[0]->txBytes() + nic_[1]->txBytes();

  fillPattern(host.data(), kLen, 601, 0);  // host -> the peer's GPU
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, host.data(), kLen, pid_, remote_gpu));
  EXPECT_EQ(peer_->expect(remote_gpu, kLen, 601, 0), "");
  fillPattern(g, kLen, 602, 0);  // GPU -> GPU
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, g, kLen, pid_, remote_gpu));
  EXPECT_EQ(peer_->expect(remote_gpu, kLen, 602, 0), "");
  MC_ASSERT_OK(transfer(*eng_, OpCode::kRead, g + 77, 1u << 20, pid_, remote_host));  // host -> GPU
  EXPECT_EQ(checkPattern(g + 77, 1u << 20, 1000, 0), "") << "a READ into GPU memory differs";
  fillPattern(g, 1u << 20, 603, 0);  // GPU -> host
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, g, 1u << 20, pid_, remote_host));
  EXPECT_EQ(peer_->expect(remote_host, 1u << 20, 603, 0), "");
  EXPECT_GE(nic_[0]->txBytes() + nic_[1]->txBytes() - tx0, 2 * kLen + (1u << 20))
      << "the NICs did not carry the writes";

  // A notification after writes into its GPU memory: the peer flushed the NICs' writes to
  // the device (GPUDirect) before delivering it, and the writes are there when it arrives.
  const int64_t f0 = peerGpuFlushes();
  ASSERT_GE(f0, 0);
  ASSERT_TRUE(startNotifyCheck(peer_, 4, remote_gpu, 7000, 604, 30000));
  for (int k = 0; k < 4; ++k) {
    Slot s = notifySlot(k);
    fillPattern(g + s.offset, s.len, 604 + k, 0);
    MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, g + s.offset, s.len, pid_, remote_gpu + s.offset));
    MC_ASSERT_OK(eng_->notify(pid_, 7000 + k));
  }
  {
    std::string reply, why;
    ASSERT_TRUE(peer_->recv(&reply, 40000, &why)) << why;
    EXPECT_EQ(reply, "ok");
  }
  EXPECT_GE(peerGpuFlushes() - f0, 4) << "notifications were delivered without flushing GPU writes";
  fillPattern(g, kLen, 602, 0);  // (what the peer's GPU memory holds again, checked below)
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, g, kLen, pid_, remote_gpu));

  auto dev_layer = engine::device::get();
  ASSERT_TRUE(dev_layer.ok());
  auto loose = (*dev_layer)->allocate(1u << 16, 0);
  ASSERT_TRUE(loose.ok());
  Status st = transfer(*eng_, OpCode::kWrite, *loose, 1u << 16, pid_, remote_host);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_NE(st.message().find("register it"), std::string::npos) << st.toString();
  MC_EXPECT_OK((*dev_layer)->free(*loose));

  // Every port down: host memory goes over the tcp fallback, GPU memory does not.
  nic_[0]->setPortUp(false);
  nic_[1]->setPortUp(false);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  st = transfer(*eng_, OpCode::kWrite, g, 4096, pid_, remote_host);
  EXPECT_FALSE(st.ok()) << "GPU memory went over tcp";
  EXPECT_NE(st.message().find("GPU memory"), std::string::npos) << st.toString();
  st = transfer(*eng_, OpCode::kWrite, host.data(), 4096, pid_, remote_gpu);
  EXPECT_FALSE(st.ok()) << "the peer's GPU memory was written over tcp";
  EXPECT_NE(st.message().find("GPU memory"), std::string::npos) << st.toString();
  EXPECT_EQ(peer_->expect(remote_gpu, kLen, 602, 0), "");
  MC_EXPECT_OK(transfer(*eng_, OpCode::kWrite, host.data(), 4096, pid_, remote_host));
  nic_[0]->setPortUp(true);
  nic_[1]->setPortUp(true);

  MC_EXPECT_OK(eng_->free(*gpu));
  EXPECT_EQ(nic_[0]->dmabufMrs() + nic_[1]->dmabufMrs(), mrs0 + 2) << "free left dma-buf MRs";
  MC_EXPECT_OK(eng_->unregisterMemory(host.data()));
}

// A NIC that stops moving anything (no completion, not even an error) in the middle of a
// write (both NICs capped at 1 Gbit/s so that the write is still going): after
// MC_RDMA_STALL_MS its QP is failed and its work moves to the other NIC; the write completes
// with its bytes, and the stalled NIC gets no new work. A port that goes down mid-write: the
// same through the transport timeout.
TEST_F(RdmaTest, NicStalledOrDownMidTransferMovesToTheOtherNic) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "600000");  // the failed NIC stays out
  ScopedEnv stall("MC_RDMA_STALL_MS", "300");
  ASSERT_TRUE(setUp());
  constexpr uint64_t kLen = 16u << 20;  // 8 MiB per NIC: 67 ms at the cap
  HostBuffer buf(kLen);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), kLen));
  const uint64_t remote = peer_->info().alloc_addr;
  for (int fault = 0; fault < 2; ++fault) {
    SCOPED_TRACE(fault == 0 ? "stalled NIC" : "port down");
    if (fault == 1) {  // a fresh engine: the first one left mlx5_1 out for good
      nic_[1]->setStalled(false);
      MC_ASSERT_OK(eng_->unregisterMemory(buf.data()));
      eng_ = makeEngine("rdma", "parent2");
      ASSERT_NE(eng_, nullptr);
      pid_ = openPeer(*eng_, "peer");
      ASSERT_NE(pid_, engine::kInvalidPeer);
      MC_ASSERT_OK(eng_->registerMemory(buf.data(), kLen));
    }
    nic_[0]->setGbps(1);
    nic_[1]->setGbps(1);
    fillPattern(buf.data(), kLen, 101 + fault, 0);
    const uint64_t tx1 = nic_[1]->txBytes();
    auto id = eng_->submit({{OpCode::kWrite, buf.data(), kLen, pid_, remote}});
    ASSERT_TRUE(id.ok()) << id.status().toString();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (fault == 0) nic_[1]->setStalled(true);
    if (fault == 1) nic_[1]->setPortUp(false);
    const uint64_t moved = nic_[1]->txBytes() - tx1;
    MC_EXPECT_OK(eng_->wait(*id, engine::deadlineInMs(20000)));
    EXPECT_GT(moved, 0u) << "mlx5_1 had not started: the fault was not mid-transfer";
    EXPECT_LT(moved, kLen / 2) << "mlx5_1 had finished its share: the fault was not mid-transfer";
    EXPECT_EQ(peer_->expect(remote, kLen, 101 + fault, 0), "");
    nic_[0]->setGbps(0);
    nic_[1]->setGbps(0);
    auto [b0, b1] = writeAndCount(buf, 4u << 20, 110 + fault);
    EXPECT_GE(b0, 4u << 20);
    EXPECT_EQ(b1, 0u) << "the failed NIC got work again";
  }
  nic_[1]->setPortUp(true);
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

}  // namespace
}  // namespace mooncake::test
