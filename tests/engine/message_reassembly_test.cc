// Reassembly of multi-fragment messages at the receiver (engine dispatcher + inbox), with two
// engines of this process over shm: a sender that gives up part-way through a message (its
// deadline passed while the receiver's inbox was full) leaves nothing behind at the receiver,
// and later messages, also after the sender reopened the receiver (a fresh inbox attachment),
// arrive intact.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/inbox.h"
#include "tests/engine/peer_fixture.h"

namespace mooncake::test {
namespace {

using engine::Message;

constexpr uint32_t kBlockChannel = 7;  // its handler holds the receiver's dispatcher
constexpr uint32_t kDataChannel = 8;
constexpr uint32_t kSyncChannel = 9;

long rssKb() {
  std::ifstream f("/proc/self/status");
  std::string l;
  while (std::getline(f, l))
    if (l.rfind("VmRSS:", 0) == 0) return std::stol(l.substr(6));
  return 0;
}

// A payload whose first 8 bytes name its pattern seed, so that the receiver checks it alone.
std::string payloadOf(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  fillPattern(s.data(), n, seed, 0);
  if (n >= 8) std::memcpy(s.data(), &seed, 8);
  return s;
}
std::string checkPayload(const std::string& s) {
  if (s.size() < 8) return "short payload";
  uint64_t seed;
  std::memcpy(&seed, s.data(), 8);
  return checkPattern(s.data() + 8, s.size() - 8, seed, 8);
}

// Receiver B with a gate on kBlockChannel, a recorder on kDataChannel and a sync channel that
// tells when B's dispatcher consumed everything pushed before it.
class MessageReassemblyTest : public PeerTestBase {
 protected:
  void SetUp() override {
    PeerTestBase::SetUp();
    a_ = makeEngine("shm", "sender");
    b_ = makeEngine("shm", "receiver");
    ASSERT_TRUE(a_ && b_);
    pb_ = openPeer(*a_, "receiver");
    ASSERT_NE(pb_, engine::kInvalidPeer);
    ASSERT_EQ(a_->peerTransport(pb_), "shm");
    b_->setMessageHandler(kBlockChannel, [this](Message&&) {
      in_block_ = true;
      while (!gate_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      in_block_ = false;
    });
    b_->setMessageHandler(kDataChannel, [this](Message&& m) {
      std::lock_guard<std::mutex> g(mu_);
      got_.push_back(std::move(m.payload));
      cv_.notify_all();
    });
    b_->setMessageHandler(kSyncChannel, [this](Message&& m) {
      std::lock_guard<std::mutex> g(mu_);
      synced_ = std::max<uint64_t>(synced_, std::stoull(m.payload));
      cv_.notify_all();
    });
  }
  void TearDown() override {
    gate_ = true;
    if (b_) {
      b_->setMessageHandler(kBlockChannel, nullptr);
      b_->setMessageHandler(kDataChannel, nullptr);
      b_->setMessageHandler(kSyncChannel, nullptr);
    }
    a_.reset();
    b_.reset();
    PeerTestBase::TearDown();
  }

  // Sends a message of `bytes` that B cannot take in time: B's dispatcher is held while the
  // sender fills the inbox's fragment ring, then gives up (kResourceExhausted) part-way.
  void abandonOne(size_t bytes, uint64_t seed) {
    gate_ = false;
    MC_ASSERT_OK(a_->sendMessage(pb_, kBlockChannel, "block"));
    for (int i = 0; i < 5000 && !in_block_.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_TRUE(in_block_.load()) << "B's dispatcher never ran the blocking handler";
    Status st = a_->sendMessage(pb_, kDataChannel, payloadOf(bytes, seed),
                                engine::deadlineInMs(100));
    EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.toString();
    gate_ = true;
    sync();
  }
  // Returns once B's dispatcher consumed everything A pushed before.
  void sync() {
    uint64_t n = ++sync_seq_;
    MC_ASSERT_OK(
        a_->sendMessage(pb_, kSyncChannel, std::to_string(n), engine::deadlineInMs(10000)));
    std::unique_lock<std::mutex> lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, std::chrono::seconds(10), [&] { return synced_ >= n; }))
        << "sync " << n << " never arrived";
  }
  bool waitGot(size_t n, int ms) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::milliseconds(ms), [&] { return got_.size() >= n; });
  }

  std::unique_ptr<TransferEngine> a_, b_;
  PeerId pb_ = engine::kInvalidPeer;
  std::atomic<bool> gate_{true};
  std::atomic<bool> in_block_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> got_;
  uint64_t synced_ = 0;
  uint64_t sync_seq_ = 0;
};

// Many abandoned 4 MiB messages leave at most one part behind (the receiver keeps no growing
// pile of them), and the next message arrives intact.
TEST_F(MessageReassemblyTest, AbandonedPartsAreDiscarded) {
  abandonOne(4u << 20, 1);  // warm-up: the allocator's first large blocks
  const long rss0 = rssKb();
  constexpr int kRounds = 40;
  for (int i = 0; i < kRounds; ++i) {
    abandonOne(4u << 20, 100 + i);
    if (HasFatalFailure()) return;
  }
  const long grown_mb = (rssKb() - rss0) / 1024;
  // Each abandoned message left ~1 MiB (the fragment ring's worth) before the fix: 40 MB.
  EXPECT_LT(grown_mb, 16) << "the receiver's memory grew by " << grown_mb << " MB over "
                          << kRounds << " abandoned messages";
  {
    std::lock_guard<std::mutex> g(mu_);
    EXPECT_TRUE(got_.empty()) << "a cut message was delivered (" << got_[0].size() << " bytes)";
  }
  // At most the last abandoned part (what fitted the fragment ring) is held.
  EXPECT_LE(engine::MessageReassembler::processHeldBytes(), 64u * engine::Inbox::kFragmentBytes);
  const std::string next = payloadOf((1u << 20) + 5, 7);
  MC_ASSERT_OK(a_->sendMessage(pb_, kDataChannel, next, engine::deadlineInMs(10000)));
  ASSERT_TRUE(waitGot(1, 10000)) << "the message after the abandoned ones never arrived";
  std::lock_guard<std::mutex> g(mu_);
  ASSERT_EQ(got_.size(), 1u);
  EXPECT_EQ(got_[0].size(), next.size());
  EXPECT_EQ(checkPayload(got_[0]), "");
  EXPECT_EQ(engine::MessageReassembler::processHeldBytes(), 0u)
      << "a part outlived its sender's next message";
}

// Shuts down this process's tcp connections to `port` (the sender's control link to the
// receiver): both engines see the link break, as after a network failure.
int breakLinksTo(uint16_t port) {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    int fd = std::atoi(e->d_name);
    struct stat st;
    if (fd <= 2 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) continue;
    uint16_t p = 0;
    if (ss.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    if (ss.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    if (p == port && shutdown(fd, SHUT_RDWR) == 0) ++n;
  }
  closedir(d);
  return n;
}

// The sender's link to the receiver breaks after it abandoned a message and it opens the
// receiver again (a fresh inbox attachment): every message it sends then arrives intact,
// though its message ids could repeat those of the part the receiver still held.
TEST_F(MessageReassemblyTest, MessagesAfterReopenArriveIntact) {
  abandonOne(4u << 20, 1);
  if (HasFatalFailure()) return;
  const engine::SegmentDesc desc = b_->localSegment();
  ASSERT_GT(breakLinksTo(desc.tcp_port), 0) << "no connection to the receiver's port";
  auto t0 = SteadyClock::now();
  while (a_->peerStatus(pb_).ok() && msSince(t0) < 10000)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(a_->peerStatus(pb_).code(), Code::kPeerDead);
  auto reopened = a_->openPeer(desc, engine::deadlineInMs(10000));
  ASSERT_TRUE(reopened.ok()) << reopened.status().toString();
  pb_ = *reopened;
  MC_ASSERT_OK(a_->peerStatus(pb_));
  constexpr int kMessages = 4;
  for (int i = 0; i < kMessages; ++i)
    MC_ASSERT_OK(a_->sendMessage(pb_, kDataChannel, payloadOf(256 * 1024 + i, 50 + i),
                                 engine::deadlineInMs(10000)));
  EXPECT_TRUE(waitGot(kMessages, 10000)) << "messages were lost after the reopen";
  std::lock_guard<std::mutex> g(mu_);
  ASSERT_EQ(got_.size(), static_cast<size_t>(kMessages));
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(got_[i].size(), 256u * 1024 + i) << "message " << i;
    EXPECT_EQ(checkPayload(got_[i]), "") << "message " << i;
  }
  EXPECT_EQ(engine::MessageReassembler::processHeldBytes(), 0u);
}

// Large messages sent by several threads at once to one receiver all arrive intact (the
// fragments of one process's messages to a receiver never interleave).
TEST_F(MessageReassemblyTest, ConcurrentLargeMessagesArriveIntact) {
  constexpr int kThreads = 4;
  constexpr int kEach = 8;
  std::vector<std::thread> ts;
  std::atomic<int> failed{0};
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        size_t n = 20000 + (t * kEach + i) * 7919;
        if (!a_->sendMessage(pb_, kDataChannel, payloadOf(n, 1000 + t * kEach + i),
                             engine::deadlineInMs(20000))
                 .ok())
          failed++;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_TRUE(waitGot(kThreads * kEach, 20000));
  std::lock_guard<std::mutex> g(mu_);
  EXPECT_EQ(got_.size(), static_cast<size_t>(kThreads * kEach));
  for (size_t i = 0; i < got_.size(); ++i) EXPECT_EQ(checkPayload(got_[i]), "") << i;
}

}  // namespace
}  // namespace mooncake::test
