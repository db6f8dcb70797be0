// Two-sided messages and reverse-direction notifications against a real peer process: the
// peer echoes what it receives back to the sender, whom it only knows from the handshake
// (peerOf), so both directions and the "opened on demand" path are exercised.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "engine/inbox.h"
#include "tests/engine/peer_fixture.h"

namespace mooncake::test {
namespace {

using engine::Message;

constexpr uint32_t kChannel = 7;  // the peer answers on kChannel + 1

std::string payloadOf(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  fillPattern(s.data(), n, seed, 0);
  return s;
}

class MessageTest : public PeerTestBase, public ::testing::WithParamInterface<std::string> {};

TEST_P(MessageTest, EchoedInOrderThroughPeerOf) {
  const std::string transport = GetParam();
  PeerConfig cfg;
  cfg.transport = transport;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  // Sizes around the inbox fragment size, and one far larger than the fragment ring.
  const size_t kFrag = engine::Inbox::kFragmentBytes;
  const std::vector<size_t> sizes = {0, 1, 100, kFrag - 1, kFrag, kFrag + 1, (1u << 20) + 3,
                                     (4u << 20) + 1, 5};
  ASSERT_TRUE(peer->send("echo " + std::to_string(kChannel) + " " +
                         std::to_string(sizes.size()) + " 30000"));
  for (size_t i = 0; i < sizes.size(); ++i) {
    MC_ASSERT_OK(eng->sendMessage(pid, kChannel, payloadOf(sizes[i], 300 + i)));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto m = eng->waitMessage(kChannel + 1, engine::deadlineInMs(20000));
    ASSERT_TRUE(m.ok()) << "echo " << i << ": " << m.status().toString();
    EXPECT_EQ(m->channel, kChannel + 1);
    EXPECT_EQ(m->src_engine, peer->info().engine_id);
    EXPECT_EQ(m->peer, pid) << "the sender is a peer this engine opened";
    ASSERT_EQ(m->payload.size(), sizes[i]) << "message " << i << " (out of order or cut)";
    EXPECT_EQ(checkPattern(m->payload.data(), sizes[i], 300 + i, 0), "") << "message " << i;
  }
  auto n = eng->waitNotify(engine::deadlineInMs(10000));
  ASSERT_TRUE(n.ok()) << n.status().toString();
  EXPECT_EQ(n->tag, sizes.size());
  EXPECT_EQ(n->src_engine, peer->info().engine_id);
  EXPECT_EQ(n->peer, pid);
  std::string reply, why;
  ASSERT_TRUE(peer->recv(&reply, 30000, &why)) << why;
  EXPECT_EQ(reply, "ok");

  // Over the limit: refused here, nothing sent.
  std::string huge(engine::Inbox::kMaxMessageBytes + 1, 'x');
  Status st = eng->sendMessage(pid, kChannel, huge);
  EXPECT_FALSE(st.ok()) << "a message over " << engine::Inbox::kMaxMessageBytes
                        << " bytes was accepted";
  MC_EXPECT_OK(eng->peerStatus(pid));
  EXPECT_EQ(eng->sendMessage(12345, kChannel, "x").code(), Code::kInvalidArgument)
      << "unknown peer id";
}

TEST_P(MessageTest, HandlerRunsForItsChannel) {
  const std::string transport = GetParam();
  PeerConfig cfg;
  cfg.transport = transport;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> got;
  eng->setMessageHandler(kChannel + 1, [&](Message&& m) {
    std::lock_guard<std::mutex> g(mu);
    got.push_back(std::move(m.payload));
    cv.notify_all();
  });
  ASSERT_TRUE(peer->send("echo " + std::to_string(kChannel) + " 3 20000"));
  for (int i = 0; i < 3; ++i)
    MC_ASSERT_OK(eng->sendMessage(pid, kChannel, payloadOf(1000 * i + 1, 40 + i)));
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, std::chrono::seconds(20), [&] { return got.size() >= 3; });
    ASSERT_EQ(got.size(), 3u) << "the handler did not receive every message";
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(got[i].size(), static_cast<size_t>(1000 * i + 1));
      EXPECT_EQ(checkPattern(got[i].data(), got[i].size(), 40 + i, 0), "");
    }
  }
  std::string reply, why;
  ASSERT_TRUE(peer->recv(&reply, 30000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  auto n = eng->waitNotify(engine::deadlineInMs(10000));
  ASSERT_TRUE(n.ok()) << n.status().toString();

  // Without a handler, the channel queues for waitMessage again.
  eng->setMessageHandler(kChannel + 1, nullptr);
  ASSERT_TRUE(peer->send("echo " + std::to_string(kChannel) + " 1 20000"));
  MC_ASSERT_OK(eng->sendMessage(pid, kChannel, "queued"));
  auto m = eng->waitMessage(kChannel + 1, engine::deadlineInMs(20000));
  ASSERT_TRUE(m.ok()) << m.status().toString();
  EXPECT_EQ(m->payload, "queued");
  ASSERT_TRUE(peer->recv(&reply, 30000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  std::lock_guard<std::mutex> g(mu);
  EXPECT_EQ(got.size(), 3u) << "a removed handler was still called";
}

// Waits with nothing to receive end at their deadline with kTimeout.
TEST_P(MessageTest, WaitsHonourDeadlines) {
  auto eng = makeEngine(GetParam());
  ASSERT_NE(eng, nullptr);
  auto t0 = SteadyClock::now();
  auto m = eng->waitMessage(99, engine::deadlineInMs(200));
  double ms = msSince(t0);
  EXPECT_EQ(m.status().code(), Code::kTimeout) << m.status().toString();
  EXPECT_GE(ms, 150);
  EXPECT_LT(ms, 1500);
  t0 = SteadyClock::now();
  auto n = eng->waitNotify(engine::deadlineInMs(200));
  ms = msSince(t0);
  EXPECT_EQ(n.status().code(), Code::kTimeout) << n.status().toString();
  EXPECT_GE(ms, 150);
  EXPECT_LT(ms, 1500);
  engine::Notification none;
  EXPECT_FALSE(eng->pollNotify(&none));
  // Opening a name nobody publishes times out by the deadline.
  t0 = SteadyClock::now();
  auto p = eng->openPeer(rdv(), "nobody", engine::deadlineInMs(300));
  EXPECT_FALSE(p.ok());
  EXPECT_LT(msSince(t0), 2000) << p.status().toString();
}

INSTANTIATE_TEST_SUITE_P(Engine, MessageTest, MC_TEST_TRANSPORTS,
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace mooncake::test
