// MasterService upserts (replace an object atomically) and batchReplicaClear: readers keep the
// old replicas until the swap, the old memory outlives every lease granted before it, preempted
// and revoked upserts leave nothing behind, pins carry over, and the indexes stay consistent
// (checkInvariants) through unmounts, expiry, eviction, removal and a concurrent stress. Time is
// a fake clock; nothing sleeps. The client side (bytes, torn-read check across processes) is
// tests/python/test_store_api.py.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <set>
#include <thread>

#include "store/master/master_service.h"

namespace mooncake::store {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kBase = 0x7f0000000000ull;

struct FakeClock {
  std::shared_ptr<std::atomic<int64_t>> ns = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  ClockFn fn() const {
    auto p = ns;
    return [p] { return TimePoint(std::chrono::nanoseconds(p->load())); };
  }
  void advanceMs(int64_t v) { ns->fetch_add(v * 1'000'000); }
};

uint64_t addrOf(const MasterService::ReplicaList& l) { return l.replicas.at(0).pieces.at(0).address; }

class UpsertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MasterConfig c;
    c.clock = clock_.fn();
    c.lease_ttl_ms = 1000;
    c.put_release_timeout_ms = 60000;
    m_ = std::make_unique<MasterService>(c);
    ASSERT_TRUE(m_->mountSegment("c0", "s0", kBase, 4 * kMiB).ok());
  }
  // A whole upsert by `who`; the id through *id.
  ErrorCode upsert(const std::string& key, uint64_t size, ReplicateConfig rc = {},
                   const std::string& who = "w") {
    uint64_t id = 0;
    auto r = m_->upsertStart(who, key, size, rc, &id);
    if (!r.ok()) return r.error();
    return m_->upsertEnd(who, key, id);
  }
  FakeClock clock_;
  std::unique_ptr<MasterService> m_;
};

TEST_F(UpsertTest, AbsentKeyIsAPut) {
  uint64_t id = 0;
  auto r = m_->upsertStart("w", "k", 1000, {}, &id);
  ASSERT_TRUE(r.ok());
  EXPECT_NE(id, 0u);
  EXPECT_EQ(m_->getReplicaList("k").error(), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_EQ(m_->putEnd("w", "k"), ErrorCode::INVALID_WRITE) << "an upsert is ended by upsertEnd";
  EXPECT_EQ(m_->putRevoke("w", "k"), ErrorCode::INVALID_WRITE) << "... and revoked by upsertRevoke";
  EXPECT_EQ(m_->upsertEnd("other", "k", id), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m_->upsertEnd("w", "k", id + 1), ErrorCode::INVALID_WRITE);
  EXPECT_EQ(m_->upsertEnd("w", "k", id), ErrorCode::OK);
  EXPECT_EQ(m_->getSize("k").value(), 1000u);
  EXPECT_EQ(upsert("k", 0), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(upsert("", 10), ErrorCode::INVALID_KEY);
  EXPECT_TRUE(m_->checkInvariants());
}

// An upsert revoked with its writes pending (they timed out): the old value stays, the new
// replicas' memory is held until the writer releases it; the same for an upsert of an absent key.
TEST_F(UpsertTest, RevokeWithWritesPendingHoldsTheStagedMemory) {
  ASSERT_EQ(upsert("k", kMiB), ErrorCode::OK);
  const uint64_t one = m_->metrics().bytes_used;
  uint64_t id = 0, hold = 0;
  ASSERT_TRUE(m_->upsertStart("w", "k", kMiB, {}, &id).ok());
  EXPECT_EQ(m_->upsertRevoke("x", "k", id, true, &hold), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(hold, 0u);
  EXPECT_EQ(m_->upsertRevoke("w", "k", id, true, &hold), ErrorCode::OK);
  EXPECT_NE(hold, 0u);
  EXPECT_EQ(m_->getSize("k").value(), kMiB) << "the old value stays";
  EXPECT_EQ(m_->metrics().bytes_used, 2 * one) << "the staged memory is held";
  EXPECT_TRUE(m_->checkInvariants());
  m_->releaseHolds("w", {hold});
  clock_.advanceMs(1);
  ASSERT_TRUE(m_->heartbeat("c0").ok());
  m_->runMaintenance();
  EXPECT_EQ(m_->metrics().bytes_used, one) << "released by its writer";
  ASSERT_TRUE(m_->upsertStart("w", "new", kMiB, {}, &id).ok());
  EXPECT_EQ(m_->upsertRevoke("w", "new", id, true, &hold), ErrorCode::OK);
  EXPECT_EQ(m_->getSize("new").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m_->metrics().bytes_used, 2 * one);
  m_->releaseHolds("w", {hold});
  m_->runMaintenance();
  EXPECT_EQ(m_->metrics().bytes_used, one);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(UpsertTest, ReadersKeepOldReplicasUntilTheSwap) {
  for (uint64_t new_size : {4096ull, 8192ull}) {  // same size, other size
    SCOPED_TRACE(new_size);
    ASSERT_EQ(m_->putStart("w", "k", 4096, {}).error(), ErrorCode::OK);
    ASSERT_EQ(m_->putEnd("w", "k"), ErrorCode::OK);
    clock_.advanceMs(2000);  // no lease
    const uint64_t used0 = m_->metrics().bytes_used;
    auto before = m_->getReplicaList("k");  // a reader: lease until now + 1 s
    ASSERT_TRUE(before.ok());
    uint64_t id = 0;
    auto placed = m_->upsertStart("w2", "k", new_size, {}, &id);
    ASSERT_TRUE(placed.ok());
    const uint64_t new_addr = placed->at(0).pieces.at(0).address;
    EXPECT_NE(new_addr, addrOf(*before)) << "an upsert never writes into live replicas";
    // Until the end: the old value, whole, for every reader; put of the key still refused.
    auto during = m_->getReplicaList("k");
    ASSERT_TRUE(during.ok());
    EXPECT_EQ(during->size, 4096u);
    EXPECT_EQ(addrOf(*during), addrOf(*before));
    EXPECT_TRUE(m_->exists("k").value());
    EXPECT_EQ(m_->putStart("x", "k", 10, {}).error(), ErrorCode::OBJECT_ALREADY_EXISTS);
    EXPECT_TRUE(m_->checkInvariants());
    ASSERT_EQ(m_->upsertEnd("w2", "k", id), ErrorCode::OK);
    auto after = m_->getReplicaList("k");
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->size, new_size);
    EXPECT_EQ(addrOf(*after), new_addr);
    // The old replica is leased (read before the swap): its memory is not reused until the
    // lease lapses, whatever is allocated meanwhile.
    EXPECT_EQ(m_->metrics().bytes_used, used0 + new_size);
    for (int i = 0; i < 100; ++i) {
      auto p = m_->putStart("f", "fill" + std::to_string(i), 4096, {});
      if (!p.ok()) break;
      uint64_t a = p->at(0).pieces.at(0).address;
      EXPECT_FALSE(a < addrOf(*before) + 4096 && addrOf(*before) < a + 4096)
          << "reused a leased old replica at " << a;
      ASSERT_EQ(m_->putEnd("f", "fill" + std::to_string(i)), ErrorCode::OK);
    }
    clock_.advanceMs(3000);
    m_->runMaintenance();
    EXPECT_TRUE(m_->checkInvariants());
    EXPECT_EQ(m_->removeAll(true), 101u);
    m_->runMaintenance();
    EXPECT_EQ(m_->metrics().bytes_used, 0u);
  }
}

TEST_F(UpsertTest, OldReplicasWithoutReadersAreFreedAtOnce) {
  ASSERT_EQ(upsert("k", 4096), ErrorCode::OK);
  clock_.advanceMs(2000);
  ASSERT_EQ(upsert("k", 4096), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().bytes_used, 4096u);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(UpsertTest, PreemptionRevokeAndRemoval) {
  ASSERT_EQ(upsert("k", 1000), ErrorCode::OK);
  clock_.advanceMs(2000);
  uint64_t a = 0, b = 0;
  ASSERT_TRUE(m_->upsertStart("w", "k", 2000, {}, &a).ok());
  ASSERT_TRUE(m_->upsertStart("v", "k", 3000, {}, &b).ok());  // preempts a
  EXPECT_EQ(m_->upsertEnd("w", "k", a), ErrorCode::INVALID_WRITE);
  EXPECT_EQ(m_->upsertRevoke("w", "k", a), ErrorCode::INVALID_WRITE);
  EXPECT_EQ(m_->upsertEnd("w", "k", b), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_TRUE(m_->checkInvariants());
  // a's memory stays reserved while its writer may still write (put_release_timeout).
  const uint64_t with_a = m_->metrics().bytes_used;
  EXPECT_GE(with_a, 1000u + 2000 + 3000);
  ASSERT_EQ(m_->upsertRevoke("v", "k", b), ErrorCode::OK);
  EXPECT_EQ(m_->getSize("k").value(), 1000u) << "a revoked upsert leaves the old value";
  EXPECT_EQ(m_->metrics().bytes_used, with_a - 3008);  // 64-byte granularity
  for (int i = 0; i < 12; ++i) {  // past put_release_timeout, the segment's owner alive
    clock_.advanceMs(5000);
    ASSERT_TRUE(m_->heartbeat("c0").ok());
    m_->runMaintenance();
  }
  EXPECT_EQ(m_->metrics().bytes_used, 1024u);
  // A PROCESSING put is preempted by an upsert too.
  ASSERT_TRUE(m_->putStart("p", "q", 500, {}).ok());
  ASSERT_EQ(upsert("q", 600), ErrorCode::OK);
  EXPECT_EQ(m_->putEnd("p", "q"), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m_->getSize("q").value(), 600u);
  // Removal during an upsert: the key goes; the upsert cannot end.
  ASSERT_TRUE(m_->upsertStart("w", "k", 100, {}, &a).ok());
  EXPECT_EQ(m_->remove("k"), ErrorCode::OK);
  EXPECT_EQ(m_->upsertEnd("w", "k", a), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(UpsertTest, UnmountExpiryTimeoutAndEvictionSpareNothingInconsistent) {
  ASSERT_TRUE(m_->mountSegment("c1", "s1", kBase + (1ull << 32), 4 * kMiB).ok());
  ReplicateConfig two;
  two.replica_num = 2;
  ASSERT_EQ(upsert("k", 1000, two), ErrorCode::OK);
  clock_.advanceMs(2000);
  uint64_t id = 0;
  ASSERT_TRUE(m_->upsertStart("w", "k", 1000, two, &id).ok());
  ASSERT_EQ(m_->unmountSegmentByName("c1", "s1"), ErrorCode::OK);
  EXPECT_TRUE(m_->checkInvariants());
  EXPECT_EQ(m_->upsertEnd("w", "k", id), ErrorCode::INVALID_WRITE) << "its replica was lost";
  EXPECT_TRUE(m_->getReplicaList("k").ok()) << "the old value survives on s0";
  // The writer expires: its upsert is dropped.
  clock_.advanceMs(2000);
  ASSERT_TRUE(m_->upsertStart("dies", "k", 700, {}, &id).ok());
  clock_.advanceMs(11000);
  ASSERT_TRUE(m_->heartbeat("c0").ok());
  m_->runMaintenance();
  EXPECT_EQ(m_->upsertEnd("dies", "k", id), ErrorCode::INVALID_WRITE);
  EXPECT_EQ(m_->getSize("k").value(), 1000u);
  EXPECT_TRUE(m_->checkInvariants());
  // Timeout of a silent upsert whose writer stays alive.
  ASSERT_TRUE(m_->upsertStart("slow", "k", 900, {}, &id).ok());
  for (int i = 0; i < 7; ++i) {
    clock_.advanceMs(9000);
    ASSERT_TRUE(m_->heartbeat("slow").ok());
    ASSERT_TRUE(m_->heartbeat("c0").ok());
    m_->runMaintenance();
  }
  EXPECT_EQ(m_->upsertEnd("slow", "k", id), ErrorCode::INVALID_WRITE);
  EXPECT_TRUE(m_->checkInvariants());
  // Eviction skips an object being upserted.
  ASSERT_TRUE(m_->upsertStart("w", "k", 1000, {}, &id).ok());
  for (int i = 0; i < 5000; ++i)
    if (m_->putStart("f", "f" + std::to_string(i), 64 * kKiB, {}).ok())
      (void)m_->putEnd("f", "f" + std::to_string(i));
  EXPECT_GT(m_->metrics().evictions, 0u);
  EXPECT_EQ(m_->upsertEnd("w", "k", id), ErrorCode::OK);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(UpsertTest, PinsCarryOver) {
  ReplicateConfig hard;
  hard.with_hard_pin = true;
  ASSERT_EQ(upsert("h", 1000, hard), ErrorCode::OK);
  ASSERT_EQ(upsert("h", 2000), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().hard_pinned_objects, 1u) << "hard stays hard";
  ReplicateConfig soft;
  soft.with_soft_pin = true;
  soft.soft_pin_ttl_ms = 5000;
  ASSERT_EQ(upsert("s", 1000, soft), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 1u);
  ReplicateConfig keep;
  keep.keep_soft_pin = true;
  ASSERT_EQ(upsert("s", 1000, keep), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 1u) << "PRESERVE keeps it";
  clock_.advanceMs(6000);  // its own TTL (5 s), not the master's 30 min
  m_->runMaintenance();
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 0u);
  ASSERT_EQ(upsert("s", 1000, soft), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 1u);
  ASSERT_EQ(upsert("s", 1000), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 0u) << "DISABLE (the default) unpins";
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(UpsertTest, BatchReplicaClear) {
  ASSERT_TRUE(m_->mountSegment("c1", "s1", kBase + (1ull << 32), 4 * kMiB).ok());
  ReplicateConfig two;
  two.replica_num = 2;
  for (const char* k : {"a", "b", "c", "d"}) ASSERT_EQ(upsert(k, 1000, two, "me"), ErrorCode::OK);
  ASSERT_EQ(upsert("theirs", 1000, two, "them"), ErrorCode::OK);
  clock_.advanceMs(2000);
  ASSERT_TRUE(m_->getReplicaList("c").ok());  // leased: skipped
  uint64_t id = 0;
  ASSERT_TRUE(m_->upsertStart("me", "d", 10, {}, &id).ok());  // being upserted: skipped
  auto cleared = m_->batchReplicaClear("me", {"a", "c", "d", "theirs", "none", ""}, "");
  EXPECT_EQ(cleared, std::vector<std::string>({"a"}));
  EXPECT_EQ(m_->getReplicaList("a").error(), ErrorCode::OBJECT_NOT_FOUND);
  cleared = m_->batchReplicaClear("me", {"b"}, "s1");
  EXPECT_EQ(cleared, std::vector<std::string>({"b"}));
  auto b = m_->getReplicaList("b");
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->replicas.size(), 1u);
  EXPECT_EQ(b->replicas[0].pieces[0].segment_name, "s0");
  EXPECT_TRUE(m_->batchReplicaClear("me", {"b"}, "no-such-segment").empty());
  // A segment that holds nothing of the key clears nothing and leaves the key whole (an
  // earlier version emptied its replicas' pieces here).
  EXPECT_TRUE(m_->batchReplicaClear("me", {"b"}, "s1").empty());
  b = m_->getReplicaList("b");
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->replicas.size(), 1u);
  ASSERT_EQ(b->replicas[0].pieces.size(), 1u);
  EXPECT_EQ(b->replicas[0].pieces[0].segment_name, "s0");
  EXPECT_TRUE(m_->checkInvariants());
}

// Writers upsert random keys with random sizes while readers read and maintenance runs: the
// indexes stay consistent and every read sees a complete size the key was given.
TEST_F(UpsertTest, ConcurrentStress) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> ts;
  std::atomic<int> ok_ends{0};
  for (int w = 0; w < 3; ++w) {
    ts.emplace_back([&, w] {
      std::mt19937 rng(w);
      for (int i = 0; i < 1500; ++i) {
        const std::string key = "k" + std::to_string(rng() % 8);
        const uint64_t size = 512 * (1 + rng() % 8);
        uint64_t id = 0;
        const std::string who = "w" + std::to_string(w);
        if (!m_->upsertStart(who, key, size, {}, &id).ok()) continue;
        if (rng() % 5 == 0)
          (void)m_->upsertRevoke(who, key, id);
        else if (m_->upsertEnd(who, key, id) == ErrorCode::OK)
          ++ok_ends;
      }
    });
  }
  ts.emplace_back([&] {
    while (!stop) {
      for (int k = 0; k < 8; ++k) {
        auto l = m_->getReplicaList("k" + std::to_string(k));
        if (l.ok()) {
          EXPECT_EQ(l->size % 512, 0u);
        }
      }
      (void)m_->heartbeat("c0");  // the segment's owner stays alive on the fake clock
      clock_.advanceMs(50);
    }
  });
  ts.emplace_back([&] {
    while (!stop) m_->runMaintenance();
  });
  for (int i = 0; i < 3; ++i) ts[i].join();
  stop = true;
  for (size_t i = 3; i < ts.size(); ++i) ts[i].join();
  EXPECT_GT(ok_ends.load(), 100);
  EXPECT_TRUE(m_->checkInvariants());
}

}  // namespace
}  // namespace mooncake::store
