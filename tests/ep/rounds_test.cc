// In-process checks of the rounds the EP kernels count on the device (ep/kernels/
// device_rounds.h): a send's blocks, run at once on host threads whose lanes are threads too
// (ThreadLanes, with the barriers a GPU block has), each resolve the round at their start and
// count themselves ended after; the last one takes the round, once, and none of them sees it
// advanced. The same bodies run in the CUDA kernels (ep/kernels/ll_entry.h, llBlock).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "ep/kernels/device_rounds.h"
#include "ep/kernels/host_lanes.h"
#include "ep/kernels/ll_entry.h"
#include "ep/kernels/ll_kernels.h"

namespace mooncake::ep::kern {
namespace {

// One send of `blocks` blocks of `lanes` lanes, all started together; returns the round each
// lane resolved ([block * lanes + lane]).
std::vector<uint32_t> runSend(const DeviceRounds& d, int blocks, int lanes) {
  std::vector<uint32_t> seen(static_cast<size_t>(blocks) * lanes, 0);
  std::vector<std::unique_ptr<BlockThreads>> bt;
  for (int b = 0; b < blocks; ++b) bt.push_back(std::make_unique<BlockThreads>(lanes));
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  HostLanes base;
  for (int b = 0; b < blocks; ++b)
    for (int i = 0; i < lanes; ++i)
      ts.emplace_back([&, b, i] {
        ThreadLanes ln(base, bt[static_cast<size_t>(b)].get(), i);
        ready.fetch_add(1);
        while (ready.load() < blocks * lanes) std::this_thread::yield();
        LlArgs p;  // as llBlock: the round resolved first, the block's work, then endSend
        resolveRound(p, d);
        seen[static_cast<size_t>(b) * lanes + i] = p.round;
        std::this_thread::yield();
        endSend(d, ln);
      });
  for (auto& t : ts) t.join();
  return seen;
}

TEST(EpDeviceRounds, TheLastBlockOfASendTakesItsRoundOnce) {
  uint32_t words[kDeviceRoundWords] = {};
  constexpr int kBlocks = 6, kLanes = 3;
  uint32_t want[2] = {0, 0};
  for (int call = 0; call < 40; ++call) {
    DeviceRounds d;
    d.words = words;
    d.kind = (call / 3) % 2;  // runs of dispatches and of combines
    d.slot = call % 2;
    d.from = kRoundNext;
    d.blocks = kBlocks;
    const uint32_t next = want[d.kind] + 1;
    for (uint32_t r : runSend(d, kBlocks, kLanes))
      ASSERT_EQ(r, next) << "call " << call << ": a lane saw another round";
    want[d.kind] = next;
    EXPECT_EQ(words[d.kind], next) << "call " << call;
    EXPECT_EQ(words[2 + 2 * d.kind + d.slot], next) << "call " << call << ": the call's slot";
    EXPECT_EQ(words[1 - d.kind], want[1 - d.kind]) << "call " << call << ": the other kind";
    EXPECT_EQ(words[kRoundWordEnded], 0u) << "call " << call << ": the count of ended blocks";
    // A later stage of the call reads its slot.
    DeviceRounds later = d;
    later.from = kRoundOfCall;
    later.blocks = 0;
    LlArgs p;
    resolveRound(p, later);
    EXPECT_EQ(p.round, next);
  }
}

// Through the entry's block function (ep/kernels/ll_entry.h, as mc_ep_ll runs it): a combine's
// send of R blocks, every destination inactive (so the bodies store nothing), then a round
// given up (kAbandonRound, one block, no slot), whose abandon word goes to the peer's half of
// the round; with a proxy's ring (ranks on other hosts) each posts exactly one job.
TEST(EpDeviceRounds, TheEntryTakesASendsRoundAndAGiveUpsRound) {
  constexpr int R = 4, kLanes = 2;
  uint32_t words[kDeviceRoundWords] = {};
  std::vector<char> peer(256, 0);
  std::vector<char*> peers(R, peer.data());  // (mapped, so nothing is staged for a proxy)
  std::vector<int32_t> active(R, 0);
  LlLaunch l;
  l.p.world = R;
  l.p.active = active.data();
  l.p.peers = peers.data();
  l.p.abandon_signals = 8;
  l.rounds.words = words;
  l.rounds.kind = 1;
  l.rounds.half_bytes = 128;
  uint32_t ctl[kCtlWords] = {};
  std::vector<ProxyJob> ring(kProxyRingSlots);
  l.rounds.ctl = ctl;
  l.rounds.ring = reinterpret_cast<char*>(ring.data());
  auto posted = [&](uint32_t n, int32_t mode, uint32_t round, const char* what) {
    EXPECT_EQ(words[kRoundWordPosted], n) << what << ": jobs posted";
    const ProxyJob& j = ring[(n - 1) % kProxyRingSlots];
    EXPECT_EQ(j.seq, n) << what;
    EXPECT_EQ(j.mode, mode) << what;
    EXPECT_EQ(j.round, round) << what;
    EXPECT_EQ(j.kind, 1) << what;
  };
  for (int call = 0; call < 5; ++call) {
    l.stage = kCombineSend;
    l.rounds.from = kRoundNext;
    l.rounds.slot = call % 2;
    l.rounds.blocks = R;
    std::vector<std::unique_ptr<BlockThreads>> bt;
    std::vector<std::thread> ts;
    HostLanes base;
    for (int b = 0; b < R; ++b) bt.push_back(std::make_unique<BlockThreads>(kLanes));
    for (int b = 0; b < R; ++b)
      for (int i = 0; i < kLanes; ++i)
        ts.emplace_back([&, b, i] {
          ThreadLanes ln(base, bt[static_cast<size_t>(b)].get(), i);
          llBlock(l, b, ln, 0);
        });
    for (auto& t : ts) t.join();
    const uint32_t sent = static_cast<uint32_t>(2 * call + 1);
    EXPECT_EQ(words[1], sent) << "call " << call;
    EXPECT_EQ(words[2 + 2 + call % 2], sent) << "call " << call;
    EXPECT_EQ(words[0], 0u) << "call " << call << ": the dispatch counter moved";
    posted(2 * call + 1, kJobLowLatency, sent, "the send's job");
    // The next combine round is given up.
    l.stage = kAbandonRound;
    l.rounds.slot = -1;
    l.rounds.blocks = 1;
    HostLanes ln;
    llBlock(l, 0, ln, 0);
    const uint32_t gave = sent + 1;
    EXPECT_EQ(words[1], gave) << "call " << call;
    EXPECT_EQ(words[2 + 2 + call % 2], sent) << "call " << call << ": a give-up wrote a slot";
    EXPECT_EQ(words[kRoundWordEnded], 0u);
    uint64_t got = 0;  // rank 0's word in the half of `gave` (even: half 0)
    std::memcpy(&got, peer.data() + 8 + (gave % 2) * 128, 8);
    EXPECT_EQ(got, makeSignal(gave, 1)) << "call " << call << ": the abandon word";
    posted(2 * call + 2, kJobAbandon, gave, "the give-up's job");
  }
}

TEST(EpDeviceRounds, AnOddRoundAddressesTheSecondHalf) {
  uint32_t words[kDeviceRoundWords] = {};
  words[0] = 6;  // the next dispatch is round 7
  DeviceRounds d;
  d.words = words;
  d.from = kRoundNext;
  d.half_bytes = 1000;
  d.stage_half = 30;
  LlArgs p;
  p.dispatch_region = 5;
  p.combine_signals = 9;
  char stage[64];
  p.stage = stage;
  resolveRound(p, d);
  EXPECT_EQ(p.round, 7u);
  EXPECT_EQ(p.dispatch_region, 1005u);
  EXPECT_EQ(p.combine_signals, 1009u);
  EXPECT_EQ(p.stage, stage + 30);
  words[0] = 7;  // round 8: half 0, as filled
  LlArgs q;
  q.dispatch_region = 5;
  resolveRound(q, d);
  EXPECT_EQ(q.round, 8u);
  EXPECT_EQ(q.dispatch_region, 5u);
}

}  // namespace
}  // namespace mooncake::ep::kern
