// Client liveness: heartbeats, expiry, a writer that dies between putStart and putEnd, reads
// falling to surviving replicas, unmount of segments holding (striped) replicas, and the
// background maintenance thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "store/master/master_service.h"

namespace mooncake::store {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

struct FakeClock {
  std::shared_ptr<std::atomic<int64_t>> ns = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  ClockFn fn() const {
    auto p = ns;
    return [p] { return TimePoint(std::chrono::nanoseconds(p->load())); };
  }
  void advanceMs(int64_t v) { ns->fetch_add(v * 1'000'000); }
};

class LivenessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MasterConfig c;
    c.clock = clock_.fn();
    m_ = std::make_unique<MasterService>(c);  // client TTL 10 s
  }
  SegmentId mount(const std::string& client, uint64_t size = kMiB) {
    auto id = m_->mountSegment(client, client + "-seg", 0x100000 * (++mounts_), size);
    EXPECT_TRUE(id.ok());
    return id.ok() ? *id : 0;
  }
  // Advances time by `ms` in 1 s steps; `alive` clients heartbeat at every step, maintenance
  // runs at every step.
  void live(int64_t ms, const std::vector<std::string>& alive) {
    for (int64_t t = 0; t < ms; t += 1000) {
      clock_.advanceMs(1000);
      for (const auto& c : alive) ASSERT_TRUE(m_->heartbeat(c).ok());
      m_->runMaintenance();
    }
  }
  FakeClock clock_;
  std::unique_ptr<MasterService> m_;
  int mounts_ = 0;
};

TEST_F(LivenessTest, HeartbeatTellsAnUnknownClientToRemount) {
  EXPECT_TRUE(*m_->heartbeat("a")) << "first contact";
  EXPECT_FALSE(*m_->heartbeat("a"));
  mount("a");
  live(9000, {});
  EXPECT_EQ(m_->metrics().segments, 1u) << "9 s of silence is within the 10 s TTL";
  live(2000, {});
  EXPECT_EQ(m_->metrics().segments, 0u) << "silent past the TTL: expired, segment unmounted";
  EXPECT_EQ(m_->metrics().client_expirations, 1u);
  EXPECT_TRUE(*m_->heartbeat("a")) << "an expired client must remount";
  EXPECT_EQ(m_->heartbeat("").error(), ErrorCode::INVALID_PARAMS);
  EXPECT_TRUE(m_->checkInvariants());
}

// A client the master expired whose put (or slab request, publish, ...) reaches the master
// before its heartbeat is known again, but without its segment: the heartbeat, which names the
// segments the client has mounted, must still ask it to remount (before, it answered false for
// good: the segment was lost and its stale records never wiped).
TEST_F(LivenessTest, ExpiredClientKnownAgainThroughAnotherCallIsToldToRemount) {
  mount("a");
  mount("b");
  live(11000, {"b"});
  ASSERT_EQ(m_->metrics().client_expirations, 1u);
  ASSERT_EQ(m_->metrics().segments, 1u);
  // a resumes: its application thread's calls come first and make it known again.
  EXPECT_TRUE(m_->allocSlab("a", 1, 64 * kKiB, {}, 4096).ok()) << "a slab on b's segment";
  ASSERT_TRUE(m_->putStart("a", "k", kKiB, {}).ok());
  EXPECT_TRUE(*m_->heartbeat("a", {"a-seg"})) << "a's segment is not mounted: remount";
  for (int i = 0; i < 5; ++i) {  // and it keeps saying so until a mounts it again
    clock_.advanceMs(1000);
    EXPECT_TRUE(*m_->heartbeat("a", {"a-seg"}));
    m_->runMaintenance();
  }
  ASSERT_TRUE(m_->mountSegment("a", "a-seg", 0x100000, kMiB).ok());
  EXPECT_FALSE(*m_->heartbeat("a", {"a-seg"}));
  EXPECT_TRUE(*m_->heartbeat("a", {"b-seg"})) << "another client's segment is not a's";
  EXPECT_EQ(m_->metrics().segments, 2u);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(LivenessTest, WriterDyingBetweenStartAndEndRevokesThePut) {
  mount("owner");
  auto start = m_->putStart("writer", "k", 256 * kKiB, {});
  ASSERT_TRUE(start.ok());
  EXPECT_EQ(m_->metrics().bytes_used, 256 * kKiB);
  live(5000, {"owner", "writer"});
  EXPECT_EQ(m_->metrics().processing_objects, 1u);
  live(11000, {"owner"});  // the writer falls silent
  EXPECT_EQ(m_->metrics().processing_objects, 0u);
  EXPECT_EQ(m_->metrics().bytes_used, 0u) << "the reservation is freed";
  EXPECT_EQ(m_->getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m_->putEnd("writer", "k"), ErrorCode::OBJECT_NOT_FOUND) << "a late PutEnd fails";
  EXPECT_EQ(m_->metrics().put_revokes, 1u);
  // The key is free for another writer, the segment still mounted.
  ASSERT_TRUE(m_->putStart("other", "k", 256 * kKiB, {}).ok());
  EXPECT_EQ(m_->putEnd("other", "k"), ErrorCode::OK);
  EXPECT_TRUE(m_->getReplicaList("k").ok());
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(LivenessTest, CompletedPutsOfADeadWriterSurvive) {
  mount("owner");
  ASSERT_TRUE(m_->putStart("writer", "done", kKiB, {}).ok());
  ASSERT_EQ(m_->putEnd("writer", "done"), ErrorCode::OK);
  ASSERT_TRUE(m_->putStart("writer", "half", kKiB, {}).ok());
  live(11000, {"owner"});
  EXPECT_TRUE(m_->getReplicaList("done").ok()) << "data lives on the owner's segment";
  EXPECT_EQ(m_->getReplicaList("half").error(), ErrorCode::OBJECT_NOT_FOUND);
}

TEST_F(LivenessTest, ReadsFallToSurvivingReplicas) {
  mount("a");
  mount("b");
  mount("c");
  ReplicateConfig rc;
  rc.replica_num = 2;
  auto start = m_->putStart("w", "k", 64 * kKiB, rc);
  ASSERT_TRUE(start.ok());
  ASSERT_EQ(start->size(), 2u);
  ASSERT_EQ(m_->putEnd("w", "k"), ErrorCode::OK);
  std::string first = (*start)[0].pieces[0].client_id;
  std::string second = (*start)[1].pieces[0].client_id;
  ASSERT_NE(first, second);
  std::vector<std::string> all = {"a", "b", "c", "w"};
  auto without = [&](const std::vector<std::string>& dead) {
    std::vector<std::string> v;
    for (const auto& c : all)
      if (std::find(dead.begin(), dead.end(), c) == dead.end()) v.push_back(c);
    return v;
  };

  live(11000, without({first}));  // the holder of the first replica dies
  auto got = m_->getReplicaList("k");
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->replicas.size(), 1u);
  EXPECT_EQ(got->replicas[0].pieces[0].client_id, second);
  EXPECT_EQ(m_->metrics().replicas_dropped, 1u);
  EXPECT_TRUE(m_->checkInvariants());

  live(11000, without({first, second}));  // the last holder dies: the object is gone
  EXPECT_EQ(m_->getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_FALSE(*m_->exists("k"));
  EXPECT_EQ(m_->metrics().objects, 0u);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(LivenessTest, LeasedObjectOnADeadClientIsStillDropped) {
  // A lease protects against remove/evict, not against the memory's owner dying: the reader's
  // transfer fails and it retries elsewhere.
  mount("a");
  ASSERT_TRUE(m_->putStart("w", "k", kKiB, {}).ok());
  ASSERT_EQ(m_->putEnd("w", "k"), ErrorCode::OK);
  ASSERT_TRUE(m_->getReplicaList("k").ok());
  live(11000, {"w"});
  EXPECT_EQ(m_->getReplicaList("k").error(), ErrorCode::OBJECT_NOT_FOUND);
}

TEST_F(LivenessTest, UnmountDropsStripedReplicaThatLostAPiece) {
  SegmentId a = mount("a");
  mount("b");
  mount("c");
  mount("d", 4 * kMiB);
  ReplicateConfig rc;
  rc.replica_num = 2;
  // 2.5 MiB: one replica whole on d, the other striped over a, b, c.
  auto start = m_->putStart("w", "big", 2 * kMiB + 512 * kKiB, rc);
  ASSERT_TRUE(start.ok());
  ASSERT_EQ(start->size(), 2u);
  ASSERT_EQ(m_->putEnd("w", "big"), ErrorCode::OK);
  size_t striped = (*start)[0].pieces.size() > 1 ? 0 : 1;
  ASSERT_EQ((*start)[striped].pieces.size(), 3u);
  const uint64_t used_before = m_->metrics().bytes_used;

  EXPECT_EQ(m_->unmountSegment("a", a), ErrorCode::OK);
  auto got = m_->getReplicaList("big");
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->replicas.size(), 1u);
  EXPECT_EQ(got->replicas[0].pieces.size(), 1u);
  EXPECT_EQ(got->replicas[0].pieces[0].client_id, "d");
  // The striped replica's pieces on b and c were freed too.
  EXPECT_EQ(m_->metrics().bytes_used, used_before - (2 * kMiB + 512 * kKiB));
  EXPECT_TRUE(m_->checkInvariants());
}

// A reader holds a lease on the striped replica when one of its segments goes: the replica's
// pieces on the other segments must stay allocated until the lease lapses (before, they were
// freed at once, and a new put could land under the reader's READs).
TEST_F(LivenessTest, UnmountKeepsALeasedStripedReplicasOtherPiecesUntilTheLeaseLapses) {
  SegmentId a = mount("a");
  mount("b");
  mount("c");
  mount("d", 4 * kMiB);
  ReplicateConfig rc;
  rc.replica_num = 2;
  auto start = m_->putStart("w", "big", 2 * kMiB + 512 * kKiB, rc);
  ASSERT_TRUE(start.ok());
  ASSERT_EQ(m_->putEnd("w", "big"), ErrorCode::OK);
  size_t striped = (*start)[0].pieces.size() > 1 ? 0 : 1;
  ASSERT_EQ((*start)[striped].pieces.size(), 3u);
  uint64_t on_a = 0;
  for (const auto& p : (*start)[striped].pieces)
    if (p.client_id == "a") on_a = p.length;
  ASSERT_GT(on_a, 0u);
  ASSERT_TRUE(m_->getReplicaList("big").ok());  // a reader's lease (5 s)
  const uint64_t used_before = m_->metrics().bytes_used;
  EXPECT_EQ(m_->unmountSegment("a", a), ErrorCode::OK);
  EXPECT_EQ(m_->metrics().bytes_used, used_before - on_a)
      << "the pieces on b and c stay while the lease lasts";
  live(3000, {"b", "c", "d", "w"});
  EXPECT_EQ(m_->metrics().bytes_used, used_before - on_a);
  live(3000, {"b", "c", "d", "w"});
  EXPECT_EQ(m_->metrics().bytes_used, used_before - (2 * kMiB + 512 * kKiB))
      << "freed once the lease lapsed";
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(LivenessTest, UnmountUnderAnUnfinishedPut) {
  SegmentId a = mount("a");
  ASSERT_TRUE(m_->putStart("w", "k", kKiB, {}).ok());
  EXPECT_EQ(m_->unmountSegment("a", a), ErrorCode::OK);
  EXPECT_EQ(m_->putEnd("w", "k"), ErrorCode::OBJECT_NOT_FOUND) << "no replica survived";
  EXPECT_EQ(m_->metrics().processing_objects, 0u);
  EXPECT_TRUE(m_->checkInvariants());
}

TEST_F(LivenessTest, ExpiredClientCanRemountAndServeAgain) {
  mount("a");
  live(11000, {});
  EXPECT_EQ(m_->metrics().segments, 0u);
  EXPECT_TRUE(*m_->heartbeat("a"));
  ASSERT_TRUE(m_->mountSegment("a", "a-seg", 0x100000, kMiB).ok());
  ASSERT_TRUE(m_->putStart("a", "k", kKiB, {}).ok());
  EXPECT_EQ(m_->putEnd("a", "k"), ErrorCode::OK);
  EXPECT_TRUE(m_->getReplicaList("k").ok());
}

TEST_F(LivenessTest, BackgroundThreadRunsMaintenance) {
  mount("a");
  m_->startBackground(std::chrono::milliseconds(1));
  clock_.advanceMs(11000);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (m_->metrics().client_expirations == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  m_->stopBackground();
  EXPECT_EQ(m_->metrics().client_expirations, 1u);
  EXPECT_EQ(m_->metrics().segments, 0u);
}

}  // namespace
}  // namespace mooncake::store
