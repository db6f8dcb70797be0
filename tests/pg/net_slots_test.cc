// One-sided slot messages (pg/net_slots.h) to a receiver that stops: the write from the
// sender's staging cannot finish, and the staging must stay mapped until it has.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "engine/status.h"
#include "pg/net_slots.h"
#include "tests/engine/test_util.h"
#include "tests/pg/pg_harness.h"

namespace mooncake::pg::test {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kChannel = 0x50470099;  // this test's notifications ("PG" 0x99)

bool waitFor(const std::function<bool()>& done, int ms) {
  auto until = Clock::now() + std::chrono::milliseconds(ms);
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

uint8_t patternByte(size_t i) { return static_cast<uint8_t>((i * 131 + (i >> 12) * 7 + 5) & 0xff); }

// Rank 0 writes 32 MiB (more than a stopped receiver's socket takes in) into rank 1's slot
// while rank 1 is stopped, then destroys its SlotSender (whose bounded wait gives up) and
// drops its own reference to the area, as a communicator being destroyed does. The area
// stays alive while the write cannot finish and is dropped once rank 1 resumed and the write
// finished; rank 1 then finds every byte in its slot. An area freed at once would have the
// tcp transport send from unmapped (or reused) memory.
TEST(PgNetSlots, StalledWriteKeepsTheStagingUntilItFinished) {
  constexpr size_t kLen = 32u << 20;
  RunOptions o;
  o.world = 2;
  o.transport = "tcp";
  o.create_comm = false;
  o.deadline_s = 120;
  auto codes = runRanks(o, [&](RankEnv& env) {
    engine::TransferEngine& e = *env.engine;
    const int me = env.rank, other = 1 - env.rank;
    const std::string key = env.group + "/slots/";
    ASSERT_TRUE(e.publish(*env.rdv).ok());
    ASSERT_TRUE(env.rdv->set(key + "name/" + std::to_string(me), e.name()).ok());
    auto name = env.rdv->wait(key + "name/" + std::to_string(other), engine::deadlineInMs(20000));
    ASSERT_TRUE(name.ok()) << name.status().toString();
    auto peer = e.openPeer(*env.rdv, *name, engine::deadlineInMs(20000));
    ASSERT_TRUE(peer.ok()) << peer.status().toString();
    auto area = NetArea::create(env.engine, 2, 1, kLen);
    ASSERT_NE(area, nullptr);
    auto sender = std::make_unique<SlotSender>(&e, kChannel, area, std::vector<int>{0, 1});
    ASSERT_TRUE(env.rdv->set(key + "grant/" + std::to_string(me), sender->grantFor(other)).ok());
    std::atomic<int64_t>& pid1 = env.shared->values[0];
    std::atomic<int64_t>& verified = env.shared->values[1];
    std::atomic<int64_t>& sender_done = env.shared->values[2];

    if (me == 1) {
      std::atomic<bool> got{false};
      e.setNotifyHandler(kChannel, [&](const engine::Notification& n) {
        if (SlotSender::kindOf(n.tag) == SlotSender::kTagData) got.store(true);
      });
      pid1.store(getpid());
      // Stopped by rank 0 here, resumed by it later.
      EXPECT_TRUE(waitFor([&] { return got.load(); }, 90000)) << "the message never arrived";
      const uint8_t* slot =
          reinterpret_cast<const uint8_t*>(area->recvSlot(0, 0)) + NetArea::kSlotHeaderBytes;
      size_t wrong = 0;
      for (size_t i = 0; i < kLen; ++i) wrong += slot[i] != patternByte(i) ? 1 : 0;
      EXPECT_EQ(wrong, 0u) << "bytes of the late write that differ in rank 1's slot";
      verified.store(1);
      EXPECT_TRUE(waitFor([&] { return sender_done.load() != 0; }, 60000));
      e.setNotifyHandler(kChannel, nullptr);
      return;
    }
    auto grant = env.rdv->wait(key + "grant/1", engine::deadlineInMs(20000));
    ASSERT_TRUE(grant.ok()) << grant.status().toString();
    sender->onGrant(1, *grant);
    ASSERT_TRUE(waitFor([&] { return pid1.load() != 0; }, 20000));
    const pid_t stopped = static_cast<pid_t>(pid1.load());
    ASSERT_TRUE(mooncake::test::stopProcess(stopped));
    std::vector<uint8_t> data(kLen);
    for (size_t i = 0; i < kLen; ++i) data[i] = patternByte(i);
    const char hdr[16] = "net-slots-test";
    Status st;
    EXPECT_TRUE(sender->send(*peer, 1, hdr, sizeof(hdr), data.data(), kLen,
                             engine::deadlineInMs(5000), &st, "rank 1"));
    EXPECT_TRUE(st.ok()) << st.toString();
    data = {};
    sender.reset();  // its wait (2 s) for the write ends before the write does
    EXPECT_TRUE(area->tainted(1)) << "the sender's wait for the stopped receiver did not time out";
    std::weak_ptr<NetArea> weak = area;
    area.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_FALSE(weak.expired()) << "the staging was freed while its write still ran";
    ASSERT_EQ(kill(stopped, SIGCONT), 0);
    EXPECT_TRUE(waitFor([&] { return weak.expired(); }, 60000))
        << "the area was never dropped after the receiver resumed";
    EXPECT_TRUE(waitFor([&] { return verified.load() != 0; }, 60000));
    sender_done.store(1);
  });
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

}  // namespace
}  // namespace mooncake::pg::test
