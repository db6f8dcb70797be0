// MasterService: segments, two-phase put, visibility, placement, leases, removal, metrics,
// put timeouts, and a concurrent stress. Time is a fake clock; nothing sleeps.
#include "store/master/master_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

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

class MasterTest : public ::testing::Test {
 protected:
  MasterConfig cfg() {
    MasterConfig c;
    c.clock = clock_.fn();
    return c;
  }
  // Mounts `n` segments of `size` bytes, segment i owned by client "c<i>" and named "s<i>".
  void mountN(MasterService& m, int n, uint64_t size) {
    for (int i = 0; i < n; ++i) {
      auto id = m.mountSegment("c" + std::to_string(i), "s" + std::to_string(i),
                               kBase + i * (1ull << 32), size);
      ASSERT_TRUE(id.ok());
    }
  }
  ErrorCode put(MasterService& m, const std::string& key, uint64_t size, ReplicateConfig rc = {},
                const std::string& writer = "w") {
    auto r = m.putStart(writer, key, size, rc);
    if (!r.ok()) return r.error();
    return m.putEnd(writer, key);
  }
  FakeClock clock_;
};

TEST_F(MasterTest, MountValidationAndIdempotence) {
  MasterService m(cfg());
  EXPECT_EQ(m.mountSegment("", "s", kBase, kMiB).error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.mountSegment("c", "", kBase, kMiB).error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.mountSegment("c", "s", kBase, 0).error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.mountSegment("c", "s", ~uint64_t{0} - 10, kMiB).error(), ErrorCode::INVALID_PARAMS);
  auto a = m.mountSegment("c", "s", kBase, kMiB);
  ASSERT_TRUE(a.ok());
  auto again = m.mountSegment("c", "s", kBase, kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a) << "a retried mount is the same mount";
  EXPECT_EQ(m.mountSegment("c", "s", kBase + kMiB, kMiB).error(),
            ErrorCode::SEGMENT_ALREADY_EXISTS);
  EXPECT_EQ(m.mountSegment("other", "s", kBase, kMiB).error(), ErrorCode::SEGMENT_ALREADY_EXISTS);
  EXPECT_EQ(m.unmountSegment("other", *a), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m.metrics().bytes_capacity, kMiB);
  EXPECT_EQ(m.unmountSegment("c", *a), ErrorCode::OK);
  EXPECT_EQ(m.unmountSegment("c", *a), ErrorCode::OK) << "unmount is idempotent";
  EXPECT_EQ(m.metrics().bytes_capacity, 0u);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, TwoPhasePutVisibility) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  auto start = m.putStart("w", "k", 1000, {});
  ASSERT_TRUE(start.ok());
  ASSERT_EQ(start->size(), 1u);
  const Piece& p = (*start)[0].pieces.at(0);
  EXPECT_EQ(p.segment_name, "s0");
  EXPECT_EQ(p.client_id, "c0");
  EXPECT_EQ(p.address, kBase + p.offset);
  EXPECT_EQ(p.length, 1000u);

  // PROCESSING: invisible to readers, unremovable, and the key is taken.
  EXPECT_EQ(m.getReplicaList("k").error(), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_FALSE(*m.exists("k"));
  EXPECT_EQ(m.getSize("k").error(), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_EQ(m.remove("k"), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_EQ(m.remove("k", /*force=*/true), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_EQ(m.removeAll(true), 0u);
  EXPECT_EQ(m.putStart("w2", "k", 10, {}).error(), ErrorCode::OBJECT_ALREADY_EXISTS);
  EXPECT_EQ(m.putEnd("intruder", "k"), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m.metrics().processing_objects, 1u);

  ASSERT_EQ(m.putEnd("w", "k"), ErrorCode::OK);
  EXPECT_EQ(m.putEnd("w", "k"), ErrorCode::OK) << "a retried PutEnd succeeds";
  auto got = m.getReplicaList("k");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->size, 1000u);
  EXPECT_EQ(got->lease_ttl_ms, 5000u);
  ASSERT_EQ(got->replicas.size(), 1u);
  EXPECT_EQ(got->replicas[0].pieces[0].address, p.address);
  EXPECT_EQ(*m.getSize("k"), 1000u);
  EXPECT_EQ(m.putStart("w", "k", 10, {}).error(), ErrorCode::OBJECT_ALREADY_EXISTS);
  EXPECT_EQ(m.putRevoke("w", "k"), ErrorCode::INVALID_WRITE) << "complete objects are immutable";
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, RevokeFreesTheReservation) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  ASSERT_TRUE(m.putStart("w", "k", 512 * kKiB, {}).ok());
  EXPECT_EQ(m.metrics().bytes_used, 512 * kKiB);
  EXPECT_EQ(m.putRevoke("x", "k"), ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m.putRevoke("w", "k"), ErrorCode::OK);
  EXPECT_EQ(m.putRevoke("w", "k"), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_EQ(m.getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(put(m, "k", kMiB), ErrorCode::OK) << "the key and the space are free again";
  EXPECT_EQ(m.metrics().put_revokes, 1u);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, BadInputCodes) {
  MasterConfig c = cfg();
  c.max_key_length = 16;
  MasterService m(c);
  EXPECT_EQ(m.putStart("w", "k", 10, {}).error(), ErrorCode::NO_AVAILABLE_HANDLE)
      << "no segment mounted";
  mountN(m, 1, kMiB);
  EXPECT_EQ(m.putStart("w", "", 10, {}).error(), ErrorCode::INVALID_KEY);
  EXPECT_EQ(m.putStart("w", std::string(17, 'x'), 10, {}).error(), ErrorCode::INVALID_KEY);
  EXPECT_EQ(m.getReplicaList("").error(), ErrorCode::INVALID_KEY);
  EXPECT_EQ(m.exists("").error(), ErrorCode::INVALID_KEY);
  EXPECT_EQ(m.remove(""), ErrorCode::INVALID_KEY);
  EXPECT_EQ(m.putStart("w", "k", 0, {}).error(), ErrorCode::INVALID_PARAMS);
  ReplicateConfig many;
  many.replica_num = 17;
  EXPECT_EQ(m.putStart("w", "k", 10, many).error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.putStart("w", "k", kMiB + 1, {}).error(), ErrorCode::NO_AVAILABLE_HANDLE);
  EXPECT_EQ(m.metrics().allocation_failures, 2u);
  EXPECT_EQ(m.getReplicaList("nope").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.getSize("nope").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.remove("nope"), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.putEnd("w", "nope"), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_FALSE(*m.exists("nope"));
  EXPECT_EQ(m.removeByRegex("(").error(), ErrorCode::INVALID_PARAMS);
  // A failed put left nothing behind.
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_EQ(put(m, "k", kMiB), ErrorCode::OK);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, ReplicasOnDistinctSegmentsAndClients) {
  MasterService m(cfg());
  mountN(m, 4, kMiB);
  ReplicateConfig rc;
  rc.replica_num = 3;
  for (int i = 0; i < 20; ++i) {
    auto r = m.putStart("w", "k" + std::to_string(i), 4 * kKiB, rc);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->size(), 3u);
    std::set<uint64_t> segs;
    for (const auto& rep : *r) {
      ASSERT_EQ(rep.pieces.size(), 1u);
      segs.insert(rep.pieces[0].segment_id);
    }
    EXPECT_EQ(segs.size(), 3u) << "replicas must not share a segment";
  }
  // More replicas than segments: best effort, one per segment.
  rc.replica_num = 6;
  auto r = m.putStart("w", "wide", 4 * kKiB, rc);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 4u);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, DistinctClientsPreferredOverDistinctSegments) {
  MasterService m(cfg());
  ASSERT_TRUE(m.mountSegment("a", "a0", kBase, kMiB).ok());
  ASSERT_TRUE(m.mountSegment("a", "a1", kBase + kMiB, kMiB).ok());
  ASSERT_TRUE(m.mountSegment("b", "b0", kBase + 2 * kMiB, kMiB).ok());
  ReplicateConfig rc;
  rc.replica_num = 2;
  for (int i = 0; i < 10; ++i) {
    auto r = m.putStart("w", "k" + std::to_string(i), kKiB, rc);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->size(), 2u);
    EXPECT_NE((*r)[0].pieces[0].client_id, (*r)[1].pieces[0].client_id) << i;
  }
}

TEST_F(MasterTest, PreferredSegmentGetsTheFirstReplica) {
  MasterService m(cfg());
  mountN(m, 4, kMiB);
  for (int i = 0; i < 8; ++i) {
    ReplicateConfig rc;
    rc.preferred_segment = "s" + std::to_string(i % 4);
    auto r = m.putStart("w", "k" + std::to_string(i), kKiB, rc);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)[0].pieces[0].segment_name, rc.preferred_segment);
  }
  ReplicateConfig unknown;
  unknown.preferred_segment = "nowhere";
  EXPECT_TRUE(m.putStart("w", "x", kKiB, unknown).ok()) << "a preference is best effort";
}

// preferred_segments (upstream's list): replica r lands on the r-th listed segment it can use;
// a listed segment without room (or unknown) is passed over for the next one, then any.
TEST_F(MasterTest, PreferredSegmentsPlaceEachReplicaInOrder) {
  MasterService m(cfg());
  mountN(m, 4, kMiB);
  for (int i = 0; i < 10; ++i) {
    ReplicateConfig rc;
    rc.replica_num = 2;
    rc.preferred_segments = {"s" + std::to_string(1 + i % 3), "s0"};
    auto r = m.putStart("w", "k" + std::to_string(i), kKiB, rc);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->size(), 2u);
    EXPECT_EQ((*r)[0].pieces[0].segment_name, rc.preferred_segments[0]) << i;
    EXPECT_EQ((*r)[1].pieces[0].segment_name, "s0") << i;
  }
  ReplicateConfig both;  // preferred_segment first, then the list
  both.replica_num = 3;
  both.preferred_segment = "s3";
  both.preferred_segments = {"nowhere", "s2", "s3", "s1"};
  auto r = m.putStart("w", "both", kKiB, both);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].pieces[0].segment_name, "s3");
  EXPECT_EQ((*r)[1].pieces[0].segment_name, "s2");
  EXPECT_EQ((*r)[2].pieces[0].segment_name, "s1");
  ReplicateConfig fill;  // s2 nearly full: a 512 KiB object preferring [s2, s1] goes to s1
  fill.preferred_segment = "s2";
  auto big = m.putStart("w", "fill", kMiB - 256 * kKiB, fill);
  ASSERT_TRUE(big.ok());
  ASSERT_EQ((*big)[0].pieces[0].segment_name, "s2");
  ReplicateConfig next;
  next.preferred_segments = {"s2", "s1"};
  auto f = m.putStart("w", "half", 512 * kKiB, next);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->size(), 1u);
  ASSERT_EQ((*f)[0].pieces.size(), 1u);
  EXPECT_EQ((*f)[0].pieces[0].segment_name, "s1");
}

TEST_F(MasterTest, LargeObjectIsStripedOverSegments) {
  MasterService m(cfg());
  mountN(m, 3, kMiB);
  ReplicateConfig rc;
  rc.replica_num = 2;
  auto r = m.putStart("w", "big", 2 * kMiB + 512 * kKiB, rc);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u) << "one striped replica uses all three segments; no room for two";
  const auto& pieces = (*r)[0].pieces;
  EXPECT_EQ(pieces.size(), 3u);
  uint64_t total = 0;
  std::set<uint64_t> segs;
  for (const Piece& p : pieces) {
    total += p.length;
    segs.insert(p.segment_id);
    EXPECT_LE(p.offset + p.length, kMiB);
  }
  EXPECT_EQ(total, 2 * kMiB + 512 * kKiB);
  EXPECT_EQ(segs.size(), 3u);
  ASSERT_EQ(m.putEnd("w", "big"), ErrorCode::OK);
  EXPECT_EQ(m.getReplicaList("big")->replicas[0].pieces.size(), 3u);
  EXPECT_EQ(m.putStart("w", "huge", 3 * kMiB + 1, {}).error(), ErrorCode::NO_AVAILABLE_HANDLE);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, LeaseBlocksRemoveUntilItLapses) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  ASSERT_EQ(put(m, "k", kKiB), ErrorCode::OK);
  EXPECT_EQ(m.remove("k"), ErrorCode::OK) << "no read, no lease";
  ASSERT_EQ(put(m, "k", kKiB), ErrorCode::OK);
  ASSERT_TRUE(m.getReplicaList("k").ok());
  EXPECT_EQ(m.remove("k"), ErrorCode::OBJECT_HAS_LEASE);
  clock_.advanceMs(4999);
  EXPECT_EQ(m.remove("k"), ErrorCode::OBJECT_HAS_LEASE);
  ASSERT_TRUE(m.getReplicaList("k").ok());  // renews to now + 5 s
  clock_.advanceMs(4999);
  EXPECT_EQ(m.remove("k"), ErrorCode::OBJECT_HAS_LEASE);
  clock_.advanceMs(2);
  EXPECT_EQ(m.remove("k"), ErrorCode::OK);
  // exists() grants a lease too (as Mooncake's ExistKey); force ignores it.
  ASSERT_EQ(put(m, "k", kKiB), ErrorCode::OK);
  EXPECT_TRUE(*m.exists("k"));
  EXPECT_EQ(m.remove("k"), ErrorCode::OBJECT_HAS_LEASE);
  EXPECT_EQ(m.remove("k", /*force=*/true), ErrorCode::OK);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, ForcedRemoveKeepsLeasedMemoryUntilTheLeaseLapses) {
  MasterService m(cfg());  // lease 5 s
  mountN(m, 1, 64 * kKiB);
  ASSERT_EQ(put(m, "k", 64 * kKiB), ErrorCode::OK);  // fills the only segment
  auto read = m.getReplicaList("k");                 // a reader holds a lease from here
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(m.remove("k", /*force=*/true), ErrorCode::OK);
  EXPECT_EQ(m.getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND) << "the key is gone";
  EXPECT_EQ(m.metrics().bytes_used, 64 * kKiB) << "its memory is held for the reader";
  EXPECT_FALSE(m.putStart("w", "other", 64 * kKiB, {}).ok()) << "no reuse under the lease";
  EXPECT_TRUE(m.checkInvariants());
  clock_.advanceMs(5'001);
  ASSERT_TRUE(m.heartbeat("c0").ok());  // the segment owner stays alive
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 0u) << "released when the lease lapsed";
  ASSERT_EQ(put(m, "other", 64 * kKiB), ErrorCode::OK);
  // Without a lease a forced remove frees at once.
  EXPECT_EQ(m.remove("other", /*force=*/true), ErrorCode::OK);
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  // removeByRegex / removeAll with force take the same path.
  ASSERT_EQ(put(m, "r", 64 * kKiB), ErrorCode::OK);
  ASSERT_TRUE(m.exists("r").ok());
  EXPECT_EQ(m.removeAll(/*force=*/true), 1u);
  EXPECT_EQ(m.metrics().bytes_used, 64 * kKiB);
  EXPECT_TRUE(m.checkInvariants());
}

// A put revoked with its writes pending (they timed out, may still land): the key goes at once,
// the memory stays allocated until its writer releases the hold (another client cannot), or
// until put_release_timeout_ms after the put started if it never does.
TEST_F(MasterTest, RevokeWithWritesPendingHoldsTheMemoryUntilReleased) {
  MasterConfig c = cfg();
  c.put_release_timeout_ms = 60'000;
  MasterService m(c);
  mountN(m, 1, 64 * kKiB);
  ASSERT_TRUE(m.putStart("w", "k", 64 * kKiB, {}).ok());  // fills the only segment
  uint64_t hold = 0;
  EXPECT_EQ(m.putRevoke("w", "k", /*writes_pending=*/true, &hold), ErrorCode::OK);
  EXPECT_NE(hold, 0u);
  EXPECT_EQ(m.getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND) << "the key is gone";
  EXPECT_EQ(m.metrics().bytes_used, 64 * kKiB) << "its memory is held";
  EXPECT_FALSE(m.putStart("w", "other", 64 * kKiB, {}).ok()) << "no reuse under the hold";
  EXPECT_TRUE(m.checkInvariants());
  m.releaseHolds("x", {hold});  // not its writer
  clock_.advanceMs(1'000);
  ASSERT_TRUE(m.heartbeat("c0").ok());
  ASSERT_TRUE(m.heartbeat("w").ok());
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 64 * kKiB) << "released by another client";
  m.releaseHolds("w", {hold});
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 0u) << "released by its writer";
  ASSERT_EQ(put(m, "k", 64 * kKiB), ErrorCode::OK) << "the key and the space are free again";
  EXPECT_EQ(m.remove("k"), ErrorCode::OK);
  // Never released: freed when the put would have timed out.
  ASSERT_TRUE(m.putStart("w", "k2", 64 * kKiB, {}).ok());
  EXPECT_EQ(m.putRevoke("w", "k2", true, &hold), ErrorCode::OK);
  clock_.advanceMs(59'000);
  ASSERT_TRUE(m.heartbeat("c0").ok());
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 64 * kKiB);
  clock_.advanceMs(1'001);
  ASSERT_TRUE(m.heartbeat("c0").ok());
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  // Without writes pending the memory is freed at once, and no hold is given.
  ASSERT_TRUE(m.putStart("w", "k3", 64 * kKiB, {}).ok());
  EXPECT_EQ(m.putRevoke("w", "k3", false, &hold), ErrorCode::OK);
  EXPECT_EQ(hold, 0u);
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, ConfigurableLeaseTtl) {
  MasterConfig c = cfg();
  c.lease_ttl_ms = 100;
  MasterService m(c);
  mountN(m, 1, kMiB);
  ASSERT_EQ(put(m, "k", kKiB), ErrorCode::OK);
  EXPECT_EQ(m.getReplicaList("k")->lease_ttl_ms, 100u);
  EXPECT_EQ(m.remove("k"), ErrorCode::OBJECT_HAS_LEASE);
  clock_.advanceMs(101);
  EXPECT_EQ(m.remove("k"), ErrorCode::OK);
}

TEST_F(MasterTest, RemoveByRegexAndRemoveAllSkipLeasedAndProcessing) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  for (const char* k : {"a/1", "a/2", "a/3", "b/1", "b/2"})
    ASSERT_EQ(put(m, k, kKiB), ErrorCode::OK);
  ASSERT_TRUE(m.putStart("w", "a/processing", kKiB, {}).ok());
  ASSERT_TRUE(m.getReplicaList("a/2").ok());  // leased
  auto n = m.removeByRegex("^a/");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  EXPECT_TRUE(m.getReplicaList("a/2").ok());
  EXPECT_EQ(m.getReplicaList("a/1").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(*m.removeByRegex("/2$", /*force=*/true), 2u) << "force ignores leases";
  EXPECT_EQ(m.removeAll(), 1u);  // b/1; the PROCESSING put stays
  EXPECT_EQ(m.metrics().objects, 0u);
  EXPECT_EQ(m.metrics().processing_objects, 1u);
  EXPECT_EQ(m.metrics().removes, 5u);
  EXPECT_TRUE(m.checkInvariants());
}

// remove_by_regex runs in time linear in the keys (RE2): a pattern that makes a backtracking
// engine explode returns at once; malformed and oversized patterns are INVALID_PARAMS.
TEST_F(MasterTest, RemoveByRegexIsLinearTime) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  ASSERT_EQ(put(m, std::string(28, 'a'), 64), ErrorCode::OK);
  ASSERT_EQ(put(m, std::string(4000, 'a'), 64), ErrorCode::OK);
  auto t0 = std::chrono::steady_clock::now();
  auto n = m.removeByRegex("(a|a)*b");
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0u);
  EXPECT_LT(ms, 1000) << "catastrophic backtracking";
  n = m.removeByRegex("(a*)*$");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  EXPECT_EQ(m.removeByRegex("(").error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.removeByRegex("").error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.removeByRegex(std::string(5000, 'x')).error(), ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.removeByRegex("(a)\\1").error(), ErrorCode::INVALID_PARAMS) << "no backreferences";
  EXPECT_TRUE(m.checkInvariants());
}

// A client whose engine is gone takes no new replica from the moment it is reported (the others
// take them all), its objects stay until it expires, and a call from it undoes the mark.
TEST_F(MasterTest, GoneClientTakesNoNewReplicas) {
  MasterService m(cfg());
  mountN(m, 2, kMiB);
  ASSERT_EQ(put(m, "old", kKiB, {}, "c1"), ErrorCode::OK);
  m.clientGone("c1");
  for (int i = 0; i < 50; ++i) {
    auto r = m.putStart("w", "k" + std::to_string(i), kKiB, {});
    ASSERT_TRUE(r.ok());
    for (const auto& rep : *r)
      for (const auto& p : rep.pieces) EXPECT_EQ(p.client_id, "c0") << "placed on a gone client";
    ASSERT_EQ(m.putEnd("w", "k" + std::to_string(i)), ErrorCode::OK);
  }
  ReplicateConfig pref;
  pref.preferred_segment = "s1";
  auto r = m.putStart("w", "pref", kKiB, pref);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].pieces[0].client_id, "c0") << "a gone client's segment was preferred";
  EXPECT_EQ(m.metrics().clients_gone, 1u);
  EXPECT_TRUE(m.exists("old").ok());
  ASSERT_TRUE(m.heartbeat("c1").ok());  // it is back
  bool used = false;
  for (int i = 0; i < 10 && !used; ++i) {
    auto q = m.putStart("w", "back" + std::to_string(i), kKiB, {});
    ASSERT_TRUE(q.ok());
    used = (*q)[0].pieces[0].client_id == "c1";
  }
  EXPECT_TRUE(used) << "a client that called again still took no replica";
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, BatchCallsAnswerPerKey) {
  MasterService m(cfg());
  mountN(m, 2, kMiB);
  ASSERT_EQ(put(m, "x", 100), ErrorCode::OK);
  ASSERT_TRUE(m.putStart("w", "p", 100, {}).ok());
  auto lists = m.batchGetReplicaList({"x", "p", "missing", ""});
  ASSERT_EQ(lists.size(), 4u);
  EXPECT_TRUE(lists[0].ok());
  EXPECT_EQ(lists[1].error(), ErrorCode::REPLICA_IS_NOT_READY);
  EXPECT_EQ(lists[2].error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(lists[3].error(), ErrorCode::INVALID_KEY);
  auto ex = m.batchExists({"x", "p", "missing"});
  ASSERT_EQ(ex.size(), 3u);
  EXPECT_TRUE(*ex[0]);
  EXPECT_FALSE(*ex[1]);
  EXPECT_FALSE(*ex[2]);
  MasterMetrics mm = m.metrics();
  EXPECT_EQ(mm.gets, 4u);
  EXPECT_EQ(mm.get_hits, 1u);
}

TEST_F(MasterTest, StalePutIsTakenOverButItsMemoryQuarantined) {
  MasterService m(cfg());  // discard after 30 s, release after 600 s
  mountN(m, 1, kMiB);
  ASSERT_TRUE(m.putStart("slow", "k", 256 * kKiB, {}).ok());
  clock_.advanceMs(29'000);
  EXPECT_EQ(m.putStart("fast", "k", 256 * kKiB, {}).error(), ErrorCode::OBJECT_ALREADY_EXISTS);
  clock_.advanceMs(2'000);
  ASSERT_TRUE(m.heartbeat("slow").ok());
  ASSERT_TRUE(m.putStart("fast", "k", 256 * kKiB, {}).ok());
  EXPECT_EQ(m.metrics().bytes_used, 512 * kKiB) << "the old reservation is still held";
  EXPECT_EQ(m.putEnd("slow", "k"), ErrorCode::ILLEGAL_CLIENT) << "the old writer lost the key";
  ASSERT_EQ(m.putEnd("fast", "k"), ErrorCode::OK);
  EXPECT_TRUE(m.checkInvariants());
  clock_.advanceMs(600'000);
  ASSERT_TRUE(m.heartbeat("fast").ok());
  ASSERT_TRUE(m.heartbeat("c0").ok());  // the segment owner stays alive
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 256 * kKiB) << "quarantine released after the timeout";
  EXPECT_TRUE(m.checkInvariants());
}

// A writer whose own stale put was taken over by its own later put of the key: PutEnd and
// PutRevoke that name the old put (its token) touch neither; without a token they would end
// or drop the new one.
TEST_F(MasterTest, PutTokenNamesOnePutOfTheKey) {
  MasterService m(cfg());  // discard after 30 s
  mountN(m, 1, kMiB);
  uint64_t old_token = 0, new_token = 0;
  ASSERT_TRUE(m.putStart("w", "k", 4 * kKiB, {}, &old_token).ok());
  ASSERT_TRUE(m.putStart("w", "k2", 4 * kKiB, {}, &new_token).ok());
  EXPECT_NE(old_token, 0u);
  EXPECT_NE(old_token, new_token);
  clock_.advanceMs(31'000);
  ASSERT_TRUE(m.heartbeat("c0").ok());
  ASSERT_TRUE(m.putStart("w", "k", 4 * kKiB, {}, &new_token).ok()) << "took the stale put over";
  EXPECT_EQ(m.putEnd("w", "k", old_token), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.putRevoke("w", "k", false, nullptr, old_token), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.getReplicaList("k").error(), ErrorCode::REPLICA_IS_NOT_READY) << "still pending";
  ASSERT_EQ(m.putEnd("w", "k", new_token), ErrorCode::OK);
  EXPECT_EQ(m.putEnd("w", "k", new_token), ErrorCode::OK) << "a retried PutEnd";
  EXPECT_EQ(m.putEnd("w", "k", old_token), ErrorCode::OBJECT_NOT_FOUND) << "complete, not its";
  EXPECT_TRUE(m.getReplicaList("k").ok());
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, ForgottenPutIsReleasedByMaintenance) {
  MasterConfig c = cfg();
  c.client_ttl_ms = 10'000'000;  // the writer stays alive; only the put timeout applies
  MasterService m(c);
  mountN(m, 1, kMiB);
  ASSERT_TRUE(m.putStart("w", "k", kKiB, {}).ok());
  clock_.advanceMs(599'000);
  m.runMaintenance();
  EXPECT_EQ(m.metrics().processing_objects, 1u);
  clock_.advanceMs(1'000);
  m.runMaintenance();
  EXPECT_EQ(m.metrics().processing_objects, 0u);
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_EQ(m.putEnd("w", "k"), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(MasterTest, PrometheusTextHasTheCounters) {
  MasterService m(cfg());
  mountN(m, 1, kMiB);
  ASSERT_EQ(put(m, "k", kKiB), ErrorCode::OK);
  std::string text = m.metrics().toPrometheus();
  EXPECT_NE(text.find("mooncake_store_objects 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("mooncake_store_bytes_capacity 1048576\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE mooncake_store_evictions_total counter"), std::string::npos);
  EXPECT_NE(text.find("mooncake_store_rpc_calls_total{method=\"PUT_START\"} 0"), std::string::npos);
}

// Several threads put, read, remove and mount/unmount at once; afterwards every index agrees
// and no two live pieces overlap (checkInvariants checks the allocators).
TEST_F(MasterTest, ConcurrentClientsKeepInvariants) {
  MasterService m(cfg());
  mountN(m, 4, 4 * kMiB);
  std::atomic<bool> bad{false};
  std::mutex why_mu;
  std::string why;  // the first unexpected answer
  auto fail = [&](const std::string& what, ErrorCode ec) {
    std::lock_guard<std::mutex> g(why_mu);
    if (!bad.exchange(true)) why = what + ": " + std::string(errorCodeName(ec));
  };
  std::atomic<int> lost{0};  // puts whose every replica went with thread 0's unmounted segment
  auto worker = [&](int t) {
    std::string me = "w" + std::to_string(t);
    ReplicateConfig rc;
    rc.replica_num = 2;
    for (int i = 0; i < 2000; ++i) {
      std::string key = me + "/" + std::to_string(i % 50);
      auto r = m.putStart(me, key, 1 + (i * 7919) % (64 * kKiB), rc);
      if (r.ok()) {
        // Space is short here, so a put may get fewer replicas than asked; when every one of
        // them has a piece on the segment thread 0 mounts and at once unmounts, the unmount
        // takes the put with it (OBJECT_NOT_FOUND), as unmount promises. Nothing else may.
        bool all_on_extra = !r->empty();
        for (const ReplicaPlacement& rp : *r) {
          bool on_extra = false;
          for (const Piece& p : rp.pieces) on_extra |= p.segment_name.rfind("extra", 0) == 0;
          all_on_extra &= on_extra;
        }
        ErrorCode ec = i % 5 == 0 ? m.putRevoke(me, key) : m.putEnd(me, key);
        if (ec == ErrorCode::OBJECT_NOT_FOUND && all_on_extra)
          ++lost;
        else if (ec != ErrorCode::OK)
          fail(std::string(i % 5 == 0 ? "putRevoke " : "putEnd ") + key, ec);
      }
      auto g = m.getReplicaList(me + "/" + std::to_string((i * 13) % 50));
      if (!g.ok() && g.error() != ErrorCode::OBJECT_NOT_FOUND) fail("getReplicaList", g.error());
      if (i % 3 == 0) m.remove(me + "/" + std::to_string((i * 17) % 50), true);
      if (t == 0 && i % 200 == 0) {
        std::string seg = "extra" + std::to_string(i);
        auto id = m.mountSegment("c0", seg, kBase + (100ull << 32), kMiB);
        if (!id.ok())
          fail("mountSegment", id.error());
        else if (ErrorCode ec = m.unmountSegment("c0", *id); ec != ErrorCode::OK)
          fail("unmountSegment", ec);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_FALSE(bad.load()) << why;
  // Each put that vanished took at least one dropped replica with it.
  if (lost.load() > 0) {
    EXPECT_GE(m.metrics().replicas_dropped, static_cast<uint64_t>(lost.load()));
  }
  EXPECT_TRUE(m.checkInvariants());
  m.removeAll(true);
  EXPECT_TRUE(m.checkInvariants());
  // Objects read in the last lease period keep their memory until their leases lapse.
  clock_.advanceMs(5'001);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(m.heartbeat("c" + std::to_string(i)).ok());
  m.runMaintenance();
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_TRUE(m.checkInvariants());
}

// Random operations of every kind, with time passing, clients dying and segments coming and
// going; every index is cross-checked after every step.
TEST_F(MasterTest, RandomOperationsKeepInvariants) {
  MasterConfig c = cfg();
  c.eviction_high_watermark = 0.7;
  c.min_stripe_bytes = 4 * kKiB;
  MasterService m(c);
  std::mt19937_64 rng(99);
  const std::vector<std::string> clients = {"c0", "c1", "c2", "c3", "c4"};
  int mounts = 0;
  std::vector<std::pair<std::string, std::string>> started;  // (writer, key) not yet ended
  for (int step = 0; step < 20000; ++step) {
    const std::string& client = clients[rng() % clients.size()];
    std::string key = "k" + std::to_string(rng() % 200);
    switch (rng() % 12) {
      case 0: {
        ++mounts;
        auto id = m.mountSegment(client, "seg" + std::to_string(mounts),
                                 kBase + (uint64_t(mounts) << 32), (64 + rng() % 512) * kKiB);
        ASSERT_TRUE(id.ok());
        break;
      }
      case 1: {
        auto segs = m.segments();
        if (!segs.empty()) {
          const auto& s = segs[rng() % segs.size()];
          ASSERT_EQ(m.unmountSegment(s.client_id, s.id), ErrorCode::OK);
        }
        break;
      }
      case 2:
      case 3: {
        ReplicateConfig rc;
        rc.replica_num = 1 + rng() % 3;
        rc.with_soft_pin = rng() % 5 == 0;
        rc.with_hard_pin = rng() % 11 == 0;
        if (m.putStart(client, key, 1 + rng() % (192 * kKiB), rc).ok())
          started.emplace_back(client, key);
        break;
      }
      case 4:
      case 5:
      case 6: {
        if (started.empty()) break;
        size_t i = rng() % started.size();
        auto [writer, k] = started[i];
        started[i] = started.back();
        started.pop_back();
        // The put may be gone meanwhile (writer expired, segment unmounted, timed out), and
        // the key put again by another client (ILLEGAL_CLIENT) or by the same one and ended
        // (INVALID_WRITE for a revoke).
        ErrorCode e = rng() % 4 == 0 ? m.putRevoke(writer, k) : m.putEnd(writer, k);
        ASSERT_TRUE(e == ErrorCode::OK || e == ErrorCode::OBJECT_NOT_FOUND ||
                    e == ErrorCode::ILLEGAL_CLIENT || e == ErrorCode::INVALID_WRITE)
            << errorCodeName(e);
        break;
      }
      case 7:
        (void)m.getReplicaList(key);
        break;
      case 8:
        (void)m.remove(key, rng() % 2 == 0);
        break;
      case 9:
        clock_.advanceMs(rng() % 4000);
        break;
      case 10:
        for (const auto& cl : clients) {
          if (cl != clients[step / 2000 % clients.size()]) {
            ASSERT_TRUE(m.heartbeat(cl).ok());
          }
        }
        break;
      default:
        m.runMaintenance();
        break;
    }
    ASSERT_TRUE(m.checkInvariants()) << "step " << step;
  }
  MasterMetrics mm = m.metrics();
  EXPECT_GT(mm.put_ends, 1000u);
  EXPECT_GT(mm.evictions, 0u);
  EXPECT_GT(mm.replicas_dropped, 0u);
  EXPECT_GT(mm.client_expirations, 0u);
}

}  // namespace
}  // namespace mooncake::store
