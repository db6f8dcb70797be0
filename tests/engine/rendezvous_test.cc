// Rendezvous implementations: the same contract tests over the in-process map and over the
// TCP server/client pair, plus TCP-specific failure cases.
#include <endian.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/rendezvous.h"
#include "tests/engine/test_util.h"
#include "tests/common/loopback.h"
#include "tests/common/test_secret.h"

namespace mooncake::engine {
namespace {

using test::msSince;
using test::SteadyClock;

// Makes clients of one store: several for the TCP server (one connection each), the same
// object for the in-process one.
class RendezvousTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "tcp") {
      auto s = TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
      ASSERT_TRUE(s.ok()) << s.status().toString();
      server_ = std::move(s).value();
      ASSERT_NE(server_->port(), 0);
    } else {
      inproc_ = std::make_shared<InProcessRendezvous>();
    }
  }
  std::shared_ptr<Rendezvous> client() {
    if (inproc_) return inproc_;
    auto c = TcpRendezvousClient::connect("127.0.0.1", server_->port(), mooncake::test::jobSecret(), deadlineInMs(5000));
    EXPECT_TRUE(c.ok()) << c.status().toString();
    if (!c.ok()) return nullptr;
    return std::shared_ptr<Rendezvous>(std::move(c).value());
  }
  std::unique_ptr<TcpRendezvousServer> server_;
  std::shared_ptr<InProcessRendezvous> inproc_;
};

TEST_P(RendezvousTest, SetGet) {
  auto a = client(), b = client();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->get("missing").status().code(), Code::kNotFound);
  ASSERT_TRUE(a->set("k", "v1").ok());
  auto r = b->get("k");
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r.value(), "v1");
  ASSERT_TRUE(b->set("k", "v2").ok()) << "overwrite";
  EXPECT_EQ(a->get("k").value(), "v2");
  // Binary values: NULs, high bytes, empty, large.
  std::string bin("\0\x01\xff\n\r mid\0end", 15);
  ASSERT_TRUE(a->set("bin", bin).ok());
  EXPECT_EQ(b->get("bin").value(), bin);
  ASSERT_TRUE(a->set("empty", "").ok());
  auto e = b->get("empty");
  ASSERT_TRUE(e.ok()) << "an empty value exists: " << e.status().toString();
  EXPECT_EQ(e.value(), "");
  std::string big(1 << 20, '\0');
  test::fillPattern(big.data(), big.size(), 12, 0);
  ASSERT_TRUE(a->set("big", big).ok());
  EXPECT_EQ(b->get("big").value(), big);
  // Keys with separators and odd bytes are distinct keys.
  ASSERT_TRUE(a->set("mc/seg/x y", "1").ok());
  EXPECT_EQ(b->get("mc/seg/x").status().code(), Code::kNotFound);
  EXPECT_EQ(b->get("mc/seg/x y").value(), "1");
}

TEST_P(RendezvousTest, WaitTimesOutAtDeadline) {
  auto a = client();
  ASSERT_TRUE(a);
  auto t0 = SteadyClock::now();
  auto r = a->wait("never", deadlineInMs(200));
  double ms = msSince(t0);
  EXPECT_EQ(r.status().code(), Code::kTimeout) << r.status().toString();
  EXPECT_GE(ms, 150);
  EXPECT_LT(ms, 2000) << "wait overran its deadline";
  // A deadline already past returns at once.
  t0 = SteadyClock::now();
  r = a->wait("never", Clock::now() - std::chrono::seconds(1));
  EXPECT_EQ(r.status().code(), Code::kTimeout);
  EXPECT_LT(msSince(t0), 500);
  // The client is still usable after a timed-out wait.
  ASSERT_TRUE(a->set("after", "x").ok());
  EXPECT_EQ(a->get("after").value(), "x");
}

TEST_P(RendezvousTest, WaitWokenBySetFromAnotherClient) {
  auto a = client(), b = client();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->set("present", "p").ok());
  EXPECT_EQ(b->wait("present", deadlineInMs(1000)).value(), "p") << "existing key returns at once";
  auto fut = std::async(std::launch::async, [&] { return b->wait("late", deadlineInMs(10000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = SteadyClock::now();
  ASSERT_TRUE(a->set("late", "value").ok());
  auto r = fut.get();
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r.value(), "value");
  EXPECT_LT(msSince(t0), 1000) << "waiter was not woken promptly";
}

TEST_P(RendezvousTest, ManyWaitersOneKey) {
  std::vector<std::shared_ptr<Rendezvous>> cs;
  for (int i = 0; i < 6; ++i) cs.push_back(client());
  std::vector<std::future<Result<std::string>>> fs;
  for (int i = 1; i < 6; ++i)
    fs.push_back(std::async(std::launch::async,
                            [&, i] { return cs[i]->wait("go", deadlineInMs(10000)); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(cs[0]->set("go", "now").ok());
  for (auto& f : fs) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status().toString();
    EXPECT_EQ(r.value(), "now");
  }
}

TEST_P(RendezvousTest, AddIsAtomic) {
  auto a = client();
  ASSERT_TRUE(a);
  EXPECT_EQ(a->add("ctr", 5).value(), 5) << "absent counts as 0";
  EXPECT_EQ(a->add("ctr", -7).value(), -2);
  EXPECT_EQ(a->add("ctr", 0).value(), -2);
  constexpr int kThreads = 4, kPer = 250;
  std::vector<std::thread> th;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    th.emplace_back([&] {
      auto c = client();
      if (!c) {
        errors++;
        return;
      }
      for (int i = 0; i < kPer; ++i)
        if (!c->add("n", 1).ok()) errors++;
    });
  }
  for (auto& x : th) x.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(a->add("n", 0).value(), kThreads * kPer);
}

INSTANTIATE_TEST_SUITE_P(Engine, RendezvousTest, ::testing::Values("inprocess", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// A client connecting where nothing listens fails by its deadline.
TEST(TcpRendezvousTest, ConnectToClosedPortFails) {
  // Find a port nobody listens on: bind, read the port, close.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t sl = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &sl);
  close(fd);
  auto t0 = SteadyClock::now();
  auto c = TcpRendezvousClient::connect("127.0.0.1", ntohs(sa.sin_port), mooncake::test::jobSecret(), deadlineInMs(500));
  EXPECT_FALSE(c.ok());
  EXPECT_LT(msSince(t0), 3000) << "connect overran its deadline";
}

// The server going away while a client waits ends the wait with an error, not a hang.
TEST(TcpRendezvousTest, ServerGoneEndsWaits) {
  auto s = TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
  ASSERT_TRUE(s.ok()) << s.status().toString();
  auto server = std::move(s).value();
  auto c = TcpRendezvousClient::connect("127.0.0.1", server->port(), mooncake::test::jobSecret(), deadlineInMs(5000));
  ASSERT_TRUE(c.ok()) << c.status().toString();
  auto cli = std::move(c).value();
  auto fut = std::async(std::launch::async, [&] { return cli->wait("k", deadlineInMs(20000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = SteadyClock::now();
  server.reset();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(25)), std::future_status::ready);
  auto r = fut.get();
  EXPECT_FALSE(r.ok());
  std::printf("  wait ended %.0f ms after the server stopped: %s\n", msSince(t0),
              r.status().toString().c_str());
  EXPECT_LT(msSince(t0), 5000) << "a dead server should end waits promptly";
  EXPECT_FALSE(cli->set("x", "y").ok());
  EXPECT_FALSE(cli->get("x").ok());
}

// Garbage on the server's port must not take it down for well-behaved clients.
TEST(TcpRendezvousTest, SurvivesGarbageClients) {
  auto s = TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
  ASSERT_TRUE(s.ok()) << s.status().toString();
  auto server = std::move(s).value();
  auto good = TcpRendezvousClient::connect("127.0.0.1", server->port(), mooncake::test::jobSecret(), deadlineInMs(5000));
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(good.value()->set("k", "v").ok());
  for (int i = 0; i < 20; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(server->port());
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    std::string junk(i * 37 + 1, '\0');
    test::fillPattern(junk.data(), junk.size(), i, 0);
    if (i % 5 == 0) junk.assign(64, '\xff');  // absurd lengths
    (void)!send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    close(fd);
  }
  auto other = TcpRendezvousClient::connect("127.0.0.1", server->port(), mooncake::test::jobSecret(), deadlineInMs(5000));
  ASSERT_TRUE(other.ok()) << other.status().toString();
  auto r = other.value()->get("k");
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r.value(), "v");
  EXPECT_TRUE(good.value()->set("k2", "v2").ok());
}

// A stranger posing as the server (before it proved the secret) cannot make a client allocate
// or wait for a huge frame: a challenge announced at 60 MiB is refused at once.
TEST(TcpRendezvousTest, ClientRefusesAHugeUnprovenReply) {
  uint16_t port = 0;
  int lfd = mooncake::test::listenLoopback(&port);
  ASSERT_GE(lfd, 0);
  std::thread impostor([lfd] {
    int fd = accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    const uint32_t len = htole32(60u << 20);  // then nothing: the rest never comes
    (void)!send(fd, &len, sizeof(len), MSG_NOSIGNAL);
    char b;
    (void)!recv(fd, &b, 1, 0);  // until the client hangs up
    close(fd);
  });
  auto t0 = SteadyClock::now();
  auto c = TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(),
                                        deadlineInMs(4000));
  const double ms = msSince(t0);
  impostor.join();
  close(lfd);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("bytes"), std::string::npos) << c.status().toString();
  EXPECT_LT(ms, 2000) << "the client waited for the announced frame: " << c.status().toString();
}

}  // namespace
}  // namespace mooncake::engine
