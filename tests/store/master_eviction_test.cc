// Eviction: LRU order, the share evicted, and the exemptions (leased, PROCESSING, hard-pinned;
// soft-pinned last, and a soft pin that lapses). Fake clock; nothing sleeps.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "store/master/master_service.h"

namespace mooncake::store {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kObj = 16 * kKiB;
constexpr uint64_t kSeg = 100 * kObj;  // room for exactly 100 objects

struct FakeClock {
  std::shared_ptr<std::atomic<int64_t>> ns = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  ClockFn fn() const {
    auto p = ns;
    return [p] { return TimePoint(std::chrono::nanoseconds(p->load())); };
  }
  void advanceMs(int64_t v) { ns->fetch_add(v * 1'000'000); }
};

std::string key(int i) { return "k" + std::to_string(i); }

class EvictionTest : public ::testing::Test {
 protected:
  void SetUp() override { make(0.90, 0.10); }
  void make(double watermark, double ratio) {
    MasterConfig c;
    c.clock = clock_.fn();
    c.eviction_high_watermark = watermark;
    c.eviction_ratio = ratio;
    c.client_ttl_ms = 1ull << 40;  // liveness is not under test here
    c.put_release_timeout_ms = 1ull << 40;
    m_ = std::make_unique<MasterService>(c);
    ASSERT_TRUE(m_->mountSegment("c", "s", 0x10000000, kSeg).ok());
  }
  // Puts objects [from, to), each completed at its own millisecond so LRU order = key order.
  void putRange(int from, int to, ReplicateConfig rc = {}) {
    for (int i = from; i < to; ++i) {
      clock_.advanceMs(1);
      ASSERT_TRUE(m_->putStart("w", key(i), kObj, rc).ok()) << i;
      ASSERT_EQ(m_->putEnd("w", key(i)), ErrorCode::OK);
    }
  }
  bool present(int i) { return m_->getSize(key(i)).ok(); }
  int countPresent(int from, int to) {
    int n = 0;
    for (int i = from; i < to; ++i) n += present(i) ? 1 : 0;
    return n;
  }
  FakeClock clock_;
  std::unique_ptr<MasterService> m_;
};

TEST_F(EvictionTest, NothingEvictedAtOrBelowTheWatermark) {
  putRange(0, 90);  // exactly 90%
  m_->runMaintenance();
  EXPECT_EQ(countPresent(0, 90), 90);
  EXPECT_EQ(m_->metrics().evictions, 0u);
}

TEST_F(EvictionTest, PassingTheWatermarkEvictsTheLeastRecentlyUsedShare) {
  putRange(0, 90);
  putRange(90, 91);  // 91% > 90%: evict ceil(10% of 90 evictable) = 9 objects, oldest first
  EXPECT_EQ(countPresent(0, 9), 0);
  EXPECT_EQ(countPresent(9, 91), 82);
  MasterMetrics mm = m_->metrics();
  EXPECT_EQ(mm.evictions, 9u);
  EXPECT_EQ(mm.evicted_bytes, 9 * kObj);
  EXPECT_EQ(mm.objects, 82u);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, ReadsRefreshRecency) {
  putRange(0, 90);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(m_->getReplicaList(key(i)).ok());
  clock_.advanceMs(10'000);  // leases lapse; the reads still count for recency
  putRange(90, 91);
  EXPECT_EQ(countPresent(0, 5), 5) << "recently read objects survive";
  EXPECT_EQ(countPresent(5, 14), 0) << "the next least recently used go";
  EXPECT_EQ(countPresent(14, 91), 77);
}

TEST_F(EvictionTest, LeasedObjectsAreSkipped) {
  putRange(0, 20);
  // Lease the 20 oldest; the reads move them to the front, so put the rest afterwards to leave
  // the leased ones at the least-recently-used end, where eviction starts.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(m_->getReplicaList(key(i)).ok());
  putRange(20, 90);
  putRange(90, 91);  // ~90 ms later: the 5 s leases still hold
  EXPECT_EQ(countPresent(0, 20), 20) << "leased objects must never be evicted";
  EXPECT_EQ(countPresent(20, 29), 0);
  EXPECT_EQ(countPresent(29, 91), 62);
  EXPECT_EQ(m_->metrics().evictions, 9u);
  EXPECT_EQ(m_->remove(key(0)), ErrorCode::OBJECT_HAS_LEASE);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, ProcessingObjectsAreExempt) {
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(m_->putStart("w", key(i), kObj, {}).ok());
  putRange(50, 91);
  EXPECT_EQ(m_->metrics().processing_objects, 50u) << "unfinished puts are never evicted";
  EXPECT_EQ(countPresent(50, 54), 0) << "10% of the 40 complete objects go instead";
  EXPECT_EQ(countPresent(54, 91), 37);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(m_->putEnd("w", key(i)), ErrorCode::OK);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, HardPinnedObjectsAreNeverEvicted) {
  ReplicateConfig hard;
  hard.with_hard_pin = true;
  putRange(0, 50, hard);
  putRange(50, 100);
  // Every unpinned object may go, but no pinned one, however old.
  EXPECT_EQ(countPresent(0, 50), 50);
  EXPECT_EQ(m_->metrics().hard_pinned_objects, 50u);
  // Fill with more unpinned objects until only pinned ones would remain: puts keep succeeding
  // by evicting unpinned objects, never a pinned one.
  for (int i = 100; i < 300; ++i) {
    clock_.advanceMs(1);
    ASSERT_TRUE(m_->putStart("w", key(i), kObj, {}).ok()) << i;
    ASSERT_EQ(m_->putEnd("w", key(i)), ErrorCode::OK);
  }
  EXPECT_EQ(countPresent(0, 50), 50);
  // A store full of pinned objects refuses a put rather than evicting them.
  ASSERT_EQ(m_->removeByRegex("^k([5-9][0-9]|[1-2][0-9][0-9])$", true).error(), ErrorCode::OK);
  ASSERT_EQ(m_->metrics().objects, 50u);
  putRange(300, 350, hard);
  EXPECT_EQ(m_->putStart("w", "one-more", kObj, {}).error(), ErrorCode::NO_AVAILABLE_HANDLE);
  EXPECT_EQ(countPresent(0, 50) + countPresent(300, 350), 100);
  EXPECT_GE(m_->metrics().allocation_failures, 1u);
  EXPECT_EQ(m_->remove(key(0)), ErrorCode::OK) << "remove() still drops a pinned object";
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, SoftPinnedObjectsAreEvictedLast) {
  ReplicateConfig soft;
  soft.with_soft_pin = true;
  putRange(0, 10, soft);  // the oldest objects, but soft-pinned
  putRange(10, 90);
  putRange(90, 91);
  EXPECT_EQ(countPresent(0, 10), 10) << "unpinned objects go first, even newer ones";
  EXPECT_EQ(countPresent(10, 19), 0);
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 10u);
  // With nothing else left to evict, soft-pinned objects go too.
  ASSERT_TRUE(m_->removeByRegex("^k([1-9][0-9])$", true).ok());
  ASSERT_EQ(m_->metrics().objects, 10u);
  make(0.05, 0.10);  // a fresh master whose watermark 5 soft-pinned objects reach
  putRange(0, 5, soft);
  putRange(5, 6, soft);  // 6% > 5%: must evict a soft-pinned object, the least recent
  EXPECT_FALSE(present(0));
  EXPECT_EQ(countPresent(1, 6), 5);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, SoftPinLapsesWithoutReads) {
  ReplicateConfig soft;
  soft.with_soft_pin = true;
  putRange(0, 10, soft);
  putRange(10, 80);
  clock_.advanceMs(29 * 60 * 1000);
  ASSERT_TRUE(m_->getReplicaList(key(9)).ok());  // key 9's soft pin now holds until ~59 min
  clock_.advanceMs(2 * 60 * 1000);               // keys 0..8 went 31 min unread: lapsed
  putRange(80, 90);
  m_->runMaintenance();
  EXPECT_EQ(m_->metrics().soft_pinned_objects, 1u) << "lapsed pins are demoted";
  putRange(90, 91);  // evict ceil(10% of 90) = 9: the lapsed keys 0..8, oldest of all
  EXPECT_EQ(countPresent(0, 9), 0);
  EXPECT_TRUE(present(9));
  EXPECT_EQ(countPresent(10, 91), 81);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, AllocationFailureEvictsThenRetries) {
  make(1.0, 0.05);  // the watermark never triggers: only a failed allocation does
  putRange(0, 100);
  EXPECT_EQ(m_->metrics().bytes_used, kSeg);
  clock_.advanceMs(1);
  ASSERT_TRUE(m_->putStart("w", "new", kObj, {}).ok());
  EXPECT_EQ(countPresent(0, 5), 0) << "ceil(5% of 100) = 5 least recently used evicted";
  EXPECT_EQ(countPresent(5, 100), 95);
  EXPECT_EQ(m_->metrics().allocation_failures, 0u);
  // A value larger than the whole store fails without evicting anything.
  uint64_t before = m_->metrics().evictions;
  EXPECT_EQ(m_->putStart("w", "giant", 2 * kSeg, {}).error(), ErrorCode::NO_AVAILABLE_HANDLE);
  EXPECT_EQ(m_->metrics().evictions, before);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(EvictionTest, ConfiguredRatioIsHonoured) {
  make(0.5, 0.5);
  putRange(0, 50);
  putRange(50, 51);  // 51% > 50%: evict ceil(50% of 50) = 25
  EXPECT_EQ(countPresent(0, 25), 0);
  EXPECT_EQ(countPresent(25, 51), 26);
  EXPECT_EQ(m_->metrics().evictions, 25u);
}

}  // namespace
}  // namespace mooncake::store
