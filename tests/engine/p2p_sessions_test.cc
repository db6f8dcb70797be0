// P2pSessions (upstream Mooncake's session/batch/notify model) between two engines of this
// process, over shared memory and over tcp: sessions found by "host:port" alone (descriptor
// query, no rendezvous), transfers checked against both sides' regions, batches, named
// notifications, probes. The two-process version of the same calls is
// tests/python/test_engine_p2p.py.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/p2p_sessions.h"
#include "tests/common/test_secret.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

using Req = P2pSessions::Request;

std::unique_ptr<TransferEngine> makeEngine(const std::string& transport) {
  EngineOptions o;
  o.name = "127.0.0.1";
  o.host = "127.0.0.1";
  o.transport = transport;
  o.name_with_port = true;
  auto e = TransferEngine::create(o);
  EXPECT_TRUE(e.ok()) << e.status().toString();
  return e.ok() ? std::move(e).value() : nullptr;
}

uint16_t closedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t l = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &l);
  close(fd);  // nobody listens there now
  return ntohs(a.sin_port);
}

class P2pSessionsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    a_ = makeEngine(GetParam());
    b_ = makeEngine(GetParam());
    ASSERT_TRUE(a_ && b_);
    sessions_ = std::make_unique<P2pSessions>(a_.get());
    src_.assign(kBytes, 0);
    for (size_t i = 0; i < kBytes; ++i) src_[i] = static_cast<char>(i * 7 + 3);
    dst_.assign(kBytes, 0);
    MC_ASSERT_OK(a_->registerMemory(src_.data(), kBytes));
    MC_ASSERT_OK(b_->registerMemory(dst_.data(), kBytes));
  }
  void TearDown() override {
    sessions_.reset();
    if (a_) (void)a_->unregisterMemory(src_.data());
    if (b_) (void)b_->unregisterMemory(dst_.data());
  }
  uint64_t addr(std::vector<char>& v, size_t off = 0) {
    return reinterpret_cast<uint64_t>(v.data()) + off;
  }

  static constexpr size_t kBytes = 1 << 20;
  std::unique_ptr<TransferEngine> a_, b_;
  std::unique_ptr<P2pSessions> sessions_;
  std::vector<char> src_, dst_;
};

TEST_P(P2pSessionsTest, NamesAreHostPort) {
  const SegmentDesc d = b_->localSegment();
  EXPECT_EQ(b_->name(), "127.0.0.1:" + std::to_string(d.tcp_port));
  EXPECT_EQ(d.name, b_->name());
  std::string host;
  uint16_t port = 0;
  MC_EXPECT_OK(P2pSessions::parseSession("[::1]:80", &host, &port));
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 80);
  MC_EXPECT_OK(P2pSessions::parseSession("/10.0.0.1:15001", &host, &port));
  EXPECT_EQ(host, "10.0.0.1");
  EXPECT_EQ(port, 15001);
  for (const char* bad : {"", "host", "host:", ":1", "host:0", "host:70000", "host:1x", "[::1]"})
    EXPECT_EQ(P2pSessions::parseSession(bad, &host, &port).code(), Code::kInvalidArgument) << bad;
}

TEST_P(P2pSessionsTest, WriteReadAndBatches) {
  const std::string s = b_->name();
  // Blocks of a "KV region" written to the peer's registered addresses, then read back.
  std::vector<Req> w;
  for (size_t i = 0; i < 16; ++i)
    w.push_back({OpCode::kWrite, addr(src_, i * 4096), addr(dst_, (15 - i) * 4096), 4096});
  MC_ASSERT_OK(sessions_->transfer(s, w));
  for (size_t i = 0; i < 16; ++i)
    ASSERT_EQ(std::memcmp(src_.data() + i * 4096, dst_.data() + (15 - i) * 4096, 4096), 0) << i;
  std::memset(src_.data(), 0, 65536);
  std::vector<Req> r;
  for (size_t i = 0; i < 16; ++i)
    r.push_back({OpCode::kRead, addr(src_, i * 4096), addr(dst_, (15 - i) * 4096), 4096});
  auto id = sessions_->submit(s, r);
  ASSERT_TRUE(id.ok()) << id.status().toString();
  P2pSessions::State st = P2pSessions::State::kPending;
  auto until = deadlineInMs(20000);
  while (st == P2pSessions::State::kPending && Clock::now() < until)
    st = sessions_->check(*id);
  ASSERT_EQ(st, P2pSessions::State::kCompleted);
  EXPECT_EQ(sessions_->check(*id), P2pSessions::State::kFailed) << "released ids are unknown";
  for (size_t i = 0; i < 16; ++i)
    ASSERT_EQ(std::memcmp(src_.data() + i * 4096, dst_.data() + (15 - i) * 4096, 4096), 0) << i;
  auto id2 = sessions_->submit(s, {{OpCode::kWrite, addr(src_), addr(dst_), kBytes}});
  ASSERT_TRUE(id2.ok());
  MC_EXPECT_OK(sessions_->wait(*id2));
  EXPECT_EQ(sessions_->wait(*id2).code(), Code::kNotFound);
}

TEST_P(P2pSessionsTest, BadInputFailsBeforeAnyByteMoves) {
  const std::string s = b_->name();
  std::vector<char> loose(4096, 1);  // never registered
  std::vector<char> before = dst_;
  // Local range not registered, or past the end of its region; zero length.
  EXPECT_EQ(sessions_->transfer(s, {{OpCode::kWrite, addr(loose), addr(dst_), 64}}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(sessions_->transfer(s, {{OpCode::kWrite, addr(src_, kBytes - 8), addr(dst_), 64}})
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_), 0}}).code(),
            Code::kInvalidArgument);
  // Remote range outside the peer's regions, or past the end of one.
  EXPECT_EQ(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(loose), 64}}).code(),
            Code::kPermissionDenied);
  EXPECT_EQ(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_, kBytes - 8), 64}})
                .code(),
            Code::kPermissionDenied);
  // One bad request fails the whole batch before anything is sent.
  EXPECT_FALSE(sessions_
                   ->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_), 64},
                                  {OpCode::kWrite, addr(src_), addr(loose), 64}})
                   .ok());
  EXPECT_EQ(dst_, before);
  EXPECT_EQ(loose, std::vector<char>(4096, 1));
  // Unknown sessions: nothing listens, not a session id.
  const std::string gone = "127.0.0.1:" + std::to_string(closedPort());
  EXPECT_FALSE(sessions_->transfer(gone, {{OpCode::kWrite, addr(src_), addr(dst_), 64}}).ok());
  EXPECT_FALSE(sessions_->submit(gone, {{OpCode::kWrite, addr(src_), addr(dst_), 64}}).ok());
  EXPECT_FALSE(sessions_->probe(gone).ok());
  EXPECT_EQ(sessions_->transfer("nonsense", {{OpCode::kWrite, addr(src_), addr(dst_), 64}}).code(),
            Code::kInvalidArgument);
  // Still serves.
  MC_EXPECT_OK(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_), 64}}));
}

TEST_P(P2pSessionsTest, PeerRegistersLaterAndNotifies) {
  const std::string s = b_->name();
  MC_ASSERT_OK(sessions_->probe(s));
  auto first = sessions_->firstBufferAddress(s);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, addr(dst_));
  // Memory the peer registers after the session was opened: found on the next transfer.
  std::vector<char> late(8192, 0);
  MC_ASSERT_OK(b_->registerMemory(late.data(), late.size()));
  MC_EXPECT_OK(sessions_->transfer(s, {{OpCode::kWrite, addr(src_, 100), addr(late), 8192}}));
  EXPECT_EQ(std::memcmp(late.data(), src_.data() + 100, 8192), 0);
  // Named notifications, after the data; drained once, in order.
  P2pSessions at_b(b_.get());
  EXPECT_TRUE(at_b.drainNotifies().empty());
  MC_ASSERT_OK(sessions_->notify(s, "req-1", "done"));
  MC_ASSERT_OK(sessions_->notify(s, "req-2", std::string("\0bin", 4)));
  std::vector<P2pSessions::Notify> got;
  auto until = deadlineInMs(10000);
  while (got.size() < 2 && Clock::now() < until) {
    for (auto& n : at_b.drainNotifies()) got.push_back(n);
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].name, "req-1");
  EXPECT_EQ(got[0].msg, "done");
  EXPECT_EQ(got[1].name, "req-2");
  EXPECT_EQ(got[1].msg, std::string("\0bin", 4));
  EXPECT_TRUE(at_b.drainNotifies().empty());
  MC_EXPECT_OK(b_->unregisterMemory(late.data()));
}

TEST_P(P2pSessionsTest, PeerRestartedAtAnotherPortIsAnotherSession) {
  const std::string s = b_->name();
  MC_ASSERT_OK(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_), 64}}));
  auto pid = sessions_->peer(s);
  ASSERT_TRUE(pid.ok());
  MC_EXPECT_OK(b_->unregisterMemory(dst_.data()));
  b_.reset();  // the peer's engine stops (its BYE reaches a_ asynchronously)
  auto until = deadlineInMs(10000);
  while (a_->peerStatus(*pid).ok() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_FALSE(a_->peerStatus(*pid).ok()) << "the stopped peer was never reported gone";
  EXPECT_FALSE(sessions_->transfer(s, {{OpCode::kWrite, addr(src_), addr(dst_), 64}}).ok());
  EXPECT_FALSE(sessions_->probe(s).ok());
  b_ = makeEngine(GetParam());
  ASSERT_TRUE(b_);
  MC_ASSERT_OK(b_->registerMemory(dst_.data(), kBytes));
  MC_EXPECT_OK(sessions_->transfer(b_->name(), {{OpCode::kWrite, addr(src_), addr(dst_), 64}}));
}

INSTANTIATE_TEST_SUITE_P(Transports, P2pSessionsTest, ::testing::Values("", "tcp"),
                         [](const auto& info) {
                           return info.param.empty() ? std::string("auto") : info.param;
                         });

}  // namespace
}  // namespace mooncake::engine
