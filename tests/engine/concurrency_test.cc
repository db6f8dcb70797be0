// Concurrency against a real peer process: many threads submitting batches at once, and the
// ordering contract of notifications (a tag arrives after the writes posted before it).
#include <gtest/gtest.h>

#include <atomic>
#include <algorithm>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/engine/peer_fixture.h"

namespace mooncake::test {
namespace {

class ConcurrencyTest : public PeerTestBase, public ::testing::WithParamInterface<std::string> {};

// 8 threads, each owning a range of both remote regions, write and read back batches of 4
// requests concurrently; at the end the peer checks every range holds the thread's last data.
TEST_P(ConcurrencyTest, ManyThreadsSubmitting) {
  const std::string transport = GetParam();
  constexpr int kThreads = 8;
  constexpr int kIters = 12;
  constexpr int kPerBatch = 4;
  constexpr uint64_t kPiece = 64 * 1024 + 1;         // odd length
  constexpr uint64_t kRange = kPerBatch * (kPiece + 2);  // one thread's share of a region
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = kThreads * kRange + 16;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  // Each thread gets src and dst areas of kRange in one allocate()d buffer.
  auto mem = eng->allocate(2 * kThreads * kRange + 16);
  ASSERT_TRUE(mem.ok()) << mem.status().toString();
  auto* base = static_cast<uint8_t*>(mem.value());
  const uint64_t remote[2] = {peer->info().alloc_addr, peer->info().reg_addr};

  std::atomic<int> failures{0};
  std::vector<std::string> errors(kThreads);
  auto seedOf = [](int t, int it, int k, int r) {
    return 10000u + static_cast<uint64_t>(t) * 1000 + it * 10 + k * 2 + r;
  };
  auto worker = [&](int t) {
    uint8_t* src = base + 1 + static_cast<uint64_t>(2 * t) * kRange;
    uint8_t* dst = src + kRange;
    for (int it = 0; it < kIters && failures.load() == 0; ++it) {
      const int r = (it + t) % 2;  // alternate between the two remote regions
      std::vector<TransferRequest> w, rd;
      for (int k = 0; k < kPerBatch; ++k) {
        uint8_t* s = src + k * (kPiece + 2);
        fillPattern(s, kPiece, seedOf(t, it, k, r), 0);
        const uint64_t roff = 3 + t * kRange + k * (kPiece + 2);
        w.push_back({OpCode::kWrite, s, kPiece, pid, remote[r] + roff});
        rd.push_back({OpCode::kRead, dst + k * (kPiece + 2), kPiece, pid, remote[r] + roff});
      }
      Status st = eng->transfer(w, engine::deadlineInMs(20000));
      if (st.ok()) st = eng->transfer(rd, engine::deadlineInMs(20000));
      if (!st.ok()) {
        errors[t] = "iteration " + std::to_string(it) + ": " + st.toString();
        failures++;
        return;
      }
      for (int k = 0; k < kPerBatch; ++k) {
        std::string d = checkPattern(dst + k * (kPiece + 2), kPiece, seedOf(t, it, k, r), 0);
        if (!d.empty()) {
          errors[t] = "iteration " + std::to_string(it) + " piece " + std::to_string(k) + ": " + d;
          failures++;
          return;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  ASSERT_EQ(failures.load(), 0);

  // The peer's own view: for each thread and region, the last iteration that used it.
  for (int t = 0; t < kThreads; ++t) {
    for (int r = 0; r < 2; ++r) {
      int last = -1;
      for (int it = 0; it < kIters; ++it)
        if ((it + t) % 2 == r) last = it;
      for (int k = 0; k < kPerBatch; ++k) {
        const uint64_t roff = 3 + t * kRange + k * (kPiece + 2);
        EXPECT_EQ(peer->expect(remote[r] + roff, kPiece, seedOf(t, last, k, r), 0), "")
            << "thread " << t << " region " << r << " piece " << k;
      }
    }
  }
  MC_EXPECT_OK(eng->free(base));
}

// Writes of mixed sizes (some sliced over several connections) are submitted without waiting,
// each followed at once by notify(tag); when the peer receives a tag, the bytes of the write
// posted before it must be there. Tags must also arrive in order, from this engine.
TEST_P(ConcurrencyTest, NotificationOrderedAfterWrites) {
  const std::string transport = GetParam();
  constexpr int kCount = 48;
  constexpr uint64_t kTagBase = 0xA5A5000000000000ull;  // exercises all 64 bits
  constexpr uint64_t kSeed = 7000;
  PeerConfig cfg;
  cfg.transport = transport;
  cfg.region_bytes = notifyBytes(kCount) + 8;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  for (uint64_t remote : {peer->info().alloc_addr, peer->info().reg_addr}) {
    SCOPED_TRACE(remote == peer->info().alloc_addr ? "remote=allocate()" : "remote=registered");
    const uint64_t seed = remote == peer->info().alloc_addr ? kSeed : kSeed + 100;
    ASSERT_TRUE(peer->send("notify_check " + std::to_string(kCount) + " " +
                           std::to_string(remote) + " " + std::to_string(kTagBase) + " " +
                           std::to_string(seed) + " " + std::to_string(eng->engineId()) +
                           " 30000"));
    HostBuffer local(notifyBytes(kCount));
    std::vector<engine::BatchId> batches;
    for (int k = 0; k < kCount; ++k) {
      Slot s = notifySlot(k);
      fillPattern(local.data() + s.offset, s.len, seed + k, 0);
      auto id = eng->submit({{OpCode::kWrite, local.data() + s.offset, s.len, pid,
                              remote + s.offset}});
      ASSERT_TRUE(id.ok()) << "submit " << k << ": " << id.status().toString();
      batches.push_back(id.value());
      MC_ASSERT_OK(eng->notify(pid, kTagBase + k));
    }
    for (size_t k = 0; k < batches.size(); ++k)
      MC_EXPECT_OK(eng->wait(batches[k], engine::deadlineInMs(20000)));
    std::string reply;
    std::string why;
    ASSERT_TRUE(peer->recv(&reply, 40000, &why)) << why;
    EXPECT_EQ(reply, "ok");
  }
}

// A peer that does not consume notifications: once its inbox is full, notify() must still
// return (OK or an error after a bounded wait), never block forever; whatever notify()
// accepted is delivered when the peer drains its inbox.
TEST_P(ConcurrencyTest, NotifyFloodDoesNotHang) {
  const std::string transport = GetParam();
  constexpr int kFlood = 1000;  // several times MC_INBOX_SLOTS (256)
  PeerConfig cfg;
  cfg.transport = transport;
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine(transport);
  ASSERT_NE(eng, nullptr);
  // A refused shm notify waits out MC_CONNECT_TIMEOUT_MS (10 s by default): shorten it for
  // this process before the peer is opened (the shm link reads it once, at open).
  setenv("MC_CONNECT_TIMEOUT_MS", "1500", 1);
  PeerId pid = openPeer(*eng, "peer");
  ASSERT_NE(pid, engine::kInvalidPeer);

  struct Outcome {
    int ok = 0;
    Status first_err;
    double max_call_ms = 0;
  };
  // Stops at the first refusal: each refused call may legitimately wait out a deadline.
  auto flood = std::async(std::launch::async, [&] {
    Outcome o;
    for (int i = 0; i < kFlood; ++i) {
      auto t = SteadyClock::now();
      Status st = eng->notify(pid, i);
      o.max_call_ms = std::max(o.max_call_ms, msSince(t));
      if (!st.ok()) {
        o.first_err = st;
        break;
      }
      ++o.ok;
    }
    return o;
  });
  auto t0 = SteadyClock::now();
  bool finished = flood.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!finished) {
    // Unblock the engine by killing the peer, so that the test can end and report.
    peer->kill();
    markKilled(peer);
    flood.wait();
  }
  unsetenv("MC_CONNECT_TIMEOUT_MS");
  ASSERT_TRUE(finished) << "notify() to a peer whose inbox is full blocked for over 60 s";
  Outcome o = flood.get();
  std::printf("  %d of %d notifies accepted in %.0f ms (slowest call %.0f ms); refusal: %s\n",
              o.ok, kFlood, msSince(t0), o.max_call_ms, o.first_err.toString().c_str());
  EXPECT_LT(o.max_call_ms, 30000) << "a single notify() blocked too long";
  if (!o.first_err.ok()) {
    EXPECT_NE(o.first_err.code(), Code::kOk);
    EXPECT_GE(o.ok, 200) << "refused before the inbox (256 slots) could have been full";
  }
  std::string drained = peer->call("drain_notify 1000");
  EXPECT_EQ(drained, "ok " + std::to_string(o.ok)) << "every accepted notify must be delivered";
  std::printf("  after the flood: peerStatus = %s\n", eng->peerStatus(pid).toString().c_str());
}

INSTANTIATE_TEST_SUITE_P(Engine, ConcurrencyTest, MC_TEST_TRANSPORTS,
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace mooncake::test
