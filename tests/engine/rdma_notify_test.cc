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
  std::vector<bool> nic;  // whether a part of each came over a NIC
  NotifyOrder::Deliver fn() {
    return [this](uint32_t, uint64_t tag, bool over_nic) {
      tags.push_back(tag);
      nic.push_back(over_nic);
    };
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

// Whether a notification came (in part) over a NIC, so that the target flushes the NICs'
// GPUDirect writes before delivering it: not when every part came over the tcp fallback,
// which never carries GPU memory; yes when one part did, even if the tcp part completed it,
// and for a later notification that the tcp part released.
TEST(RdmaNotifyOrder, SaysWhetherAPartCameOverANic) {
  NotifyOrder o;
  Sink s;
  o.arrive(notifyWord(1, 0, 0), 1, 20, s.fn(), /*over_nic=*/false);
  o.arrive(notifyWord(2, 0, 1), 1, 21, s.fn(), true);
  o.arrive(notifyWord(1, 0, 3), 1, 23, s.fn(), true);
  o.arrive(notifyWord(2, 1, 1), 1, 21, s.fn(), false);
  o.arrive(notifyWord(1, 0, 2), 1, 22, s.fn(), false);
  EXPECT_EQ(s.tags, (std::vector<uint64_t>{20, 21, 22, 23}));
  EXPECT_EQ(s.nic, (std::vector<bool>{false, true, false, true}));
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
