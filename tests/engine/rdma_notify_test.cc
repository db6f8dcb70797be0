// NotifyOrder (engine/transport/rdma/rdma_notify.h): a notification posted in parts over
// several QPs is delivered once, when its last part arrives, and in issue order.
#include "engine/transport/rdma/rdma_notify.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace mooncake::engine::rdma {
namespace {

struct Sink {
  std::vector<uint64_t> tags;
  NotifyOrder::Deliver fn() {
    return [this](uint32_t, uint64_t tag) { tags.push_back(tag); };
  }
};

TEST(RdmaNotifyOrder, WaitsForEveryPart) {
  NotifyOrder o;
  Sink s;
  EXPECT_TRUE(o.arrive(notifyWord(3, 2, 0), 1, 100, s.fn()));
  EXPECT_TRUE(o.arrive(notifyWord(3, 0, 0), 1, 100, s.fn()));
  EXPECT_TRUE(s.tags.empty()) << "delivered before its third part";
  EXPECT_TRUE(o.arrive(notifyWord(3, 1, 0), 1, 100, s.fn()));
  EXPECT_EQ(s.tags, std::vector<uint64_t>{100});
}

TEST(RdmaNotifyOrder, DuplicatePartsCountOnce) {
  NotifyOrder o;
  Sink s;
  o.arrive(notifyWord(2, 0, 0), 1, 7, s.fn());
  o.arrive(notifyWord(2, 0, 0), 1, 7, s.fn());  // resent after a failover
  EXPECT_TRUE(s.tags.empty());
  o.arrive(notifyWord(2, 1, 0), 1, 7, s.fn());
  o.arrive(notifyWord(2, 1, 0), 1, 7, s.fn());  // a late copy of a delivered one
  EXPECT_EQ(s.tags, std::vector<uint64_t>{7});
  EXPECT_EQ(o.waiting(), 0u);
}

TEST(RdmaNotifyOrder, DeliversInIssueOrder) {
  NotifyOrder o;
  Sink s;
  // #1 (one part) completes before #0 (two parts): held until #0 is whole.
  o.arrive(notifyWord(2, 0, 0), 1, 10, s.fn());
  o.arrive(notifyWord(1, 0, 1), 1, 11, s.fn());
  EXPECT_TRUE(s.tags.empty());
  o.arrive(notifyWord(2, 1, 0), 1, 10, s.fn());
  EXPECT_EQ(s.tags, (std::vector<uint64_t>{10, 11}));
}

TEST(RdmaNotifyOrder, SequenceWraps) {
  NotifyOrder o;
  Sink s;
  for (uint32_t i = 0; i <= kNotifySeqMask + 5; ++i) o.arrive(notifyWord(1, 0, i), 1, i, s.fn());
  ASSERT_EQ(s.tags.size(), kNotifySeqMask + 6u);
  EXPECT_EQ(s.tags.back(), kNotifySeqMask + 5u);
}

TEST(RdmaNotifyOrder, MalformedWordRefused) {
  NotifyOrder o;
  Sink s;
  EXPECT_FALSE(o.arrive(notifyWord(0, 0, 0), 1, 1, s.fn()));
  EXPECT_FALSE(o.arrive(notifyWord(2, 2, 0), 1, 1, s.fn()));
  EXPECT_TRUE(s.tags.empty());
}

}  // namespace
}  // namespace mooncake::engine::rdma
