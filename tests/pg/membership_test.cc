// The elastic group's state machine alone (pg/membership.h): views and their wire form, the
// healthy-set rule (clique, least-connected eviction with the highest-slot tie-break, isolated
// singleton), reconciliation with and without auto-deactivation, joins, activation admission,
// all of it also at 1024 slots (no 64-rank cap anywhere), and the agreement log
// (pg/consensus.h) with concurrent, stalled and vanished proposers.
#include "pg/membership.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "engine/rendezvous.h"
#include "pg/consensus.h"

namespace mooncake::pg {
namespace {

SlotMask mask(int n, std::initializer_list<int> on) {
  SlotMask m(n, 0);
  for (int s : on) m[s] = 1;
  return m;
}

LinkMatrix full(int n) {
  LinkMatrix l(n);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b)
      if (a != b) l.set(a, b, true);
  return l;
}

void cut(LinkMatrix& l, int a, int b) {  // both directions
  l.set(a, b, false);
  l.set(b, a, false);
}

TEST(PgMembership, InitialViewSizeAndHoles) {
  View v = initialView(8, 4);
  EXPECT_EQ(v.epoch, 1u);
  EXPECT_EQ(v.activeSlots(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(v.size(), 4);
  EXPECT_EQ(v.maxSize(), 8);
  // The design doc's example: deactivate 2, then activate 4 (after it joined).
  View a = deactivated(v, {2});
  EXPECT_EQ(a.activeSlots(), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(a.size(), 4);  // one past the highest active slot, holes included
  EXPECT_EQ(a.data_epoch, a.epoch);
  View j = joined(a, 4, 1);
  EXPECT_EQ(j.state[4], MemberState::kAwaiting);
  EXPECT_EQ(j.data_epoch, a.data_epoch) << "a join does not change the data plane";
  View b = activated(j, {4});
  EXPECT_EQ(b.activeSlots(), (std::vector<int>{0, 1, 3, 4}));
  EXPECT_EQ(b.size(), 5);
  EXPECT_EQ(b.epoch, 4u);
  EXPECT_EQ(b.data_epoch, 4u);
  // active=[1,0,1,0] -> size 3 (upstream's example).
  View c = deactivated(deactivated(initialView(4, 4), {1}), {3});
  EXPECT_EQ(c.size(), 3);
  EXPECT_EQ(deactivated(initialView(2, 2), {0, 1}).size(), 0);
}

TEST(PgMembership, SerializeRoundTripAndRejectsGarbage) {
  View v = joined(deactivated(initialView(1024, 1000), {7, 999}), 1010, 3);
  v = reconciled(v, mask(1024, {0, 1, 2}), false, true);
  View w;
  ASSERT_TRUE(View::parse(v.serialize(), &w));
  EXPECT_EQ(w.epoch, v.epoch);
  EXPECT_EQ(w.data_epoch, v.data_epoch);
  EXPECT_TRUE(w.sameMembers(v));
  EXPECT_EQ(w.healthy, v.healthy);
  std::string bytes = v.serialize();
  EXPECT_FALSE(View::parse(bytes.substr(0, bytes.size() - 1), &w));
  EXPECT_FALSE(View::parse(bytes + "x", &w));
  bytes[24] = static_cast<char>(9);  // slot 0's state (after version, epochs, count): invalid
  EXPECT_FALSE(View::parse(bytes, &w));
  EXPECT_FALSE(View::parse("", &w));
}

TEST(PgMembership, HealthySetAllConnected) {
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), full(4)), mask(4, {0, 1, 2, 3}));
  // Only candidates count: slot 2 did not answer.
  EXPECT_EQ(healthySet(mask(4, {0, 1, 3}), full(4)), mask(4, {0, 1, 3}));
}

TEST(PgMembership, HealthySetEvictsLeastConnectedHighestOnTie) {
  // A dead rank: nobody reaches it, it reaches nobody.
  LinkMatrix l = full(4);
  for (int b = 0; b < 4; ++b)
    if (b != 2) cut(l, 2, b);
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l), mask(4, {0, 1, 3}));
  // One broken pair (1, 3): both have 2 mutual links; the tie evicts the higher slot.
  l = full(4);
  cut(l, 1, 3);
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l), mask(4, {0, 1, 2}));
  // A directed failure (1 -> 0 only) also breaks mutual connectivity: world 2 keeps slot 0
  // (upstream's in-place rejoin test: the higher rank deactivates itself).
  l = full(2);
  l.set(1, 0, false);
  EXPECT_EQ(healthySet(mask(2, {0, 1}), l), mask(2, {0}));
  // Least connected first: slot 0 lost links to 1 and 2; slot 3 only to 1.
  l = full(5);
  cut(l, 0, 1);
  cut(l, 0, 2);
  cut(l, 3, 1);
  // degrees: 0:2 1:2 2:3 3:3 4:4 -> evict 1 (tie with 0, higher) -> 0:2 2:2 3:3 4:3 -> evict
  // 2 (tie with 0, higher) -> {0, 3, 4}, a clique.
  EXPECT_EQ(healthySet(mask(5, {0, 1, 2, 3, 4}), l), mask(5, {0, 3, 4}));
}

// A joiner (slot 1, awaiting) that slot 3 has not opened yet, and slot 3 that has not opened
// it: degrees 1 and 3 tie. Found by a review: the tie evicted Active slot 3; the joiner goes.
TEST(PgMembership, HealthySetEvictsTheJoinerBeforeAnActiveMemberOnTie) {
  LinkMatrix l = full(4);
  cut(l, 1, 3);
  const SlotMask active = mask(4, {0, 2, 3});
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l, &active), mask(4, {0, 2, 3}));
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l), mask(4, {0, 1, 2}));  // no view: upstream's rule
  // Degrees decide before states: a joiner better connected than an Active member stays.
  l = full(4);
  cut(l, 3, 0);
  cut(l, 3, 2);
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l, &active), mask(4, {0, 1, 2}));
}

TEST(PgMembership, HealthySetIsolatedSingletonAndReAdd) {
  // Three ranks that reach nobody: the lone survivor of the evictions is dropped too.
  LinkMatrix none(3);
  EXPECT_EQ(healthySet(mask(3, {0, 1, 2}), none), mask(3, {}));
  // The only process left online keeps itself.
  EXPECT_EQ(healthySet(mask(3, {1}), none), mask(3, {1}));
  // Slot 2 was evicted while 1 was still in; once 1 is gone it is connected to everyone left
  // and comes back: 0-1 broken, 1-2 broken, 0-2 fine -> {0, 2}? degrees 0:1 1:0 2:1 -> evict
  // 1 -> {0, 2} is a clique.
  LinkMatrix l = full(3);
  cut(l, 0, 1);
  cut(l, 1, 2);
  EXPECT_EQ(healthySet(mask(3, {0, 1, 2}), l), mask(3, {0, 2}));
}

// A reconciling process that sees fewer than half of the members alive waits for every
// member's observations: it cannot tell their deaths from its own isolation, and the
// observations they publish evict it (the proposer cut off from every link proposed a view in
// which it alone was healthy when it weighed only those it saw).
TEST(PgMembership, ObserversToAwaitWhenMostLookDead) {
  const View v = initialView(4, 4);
  auto sees = [](std::set<int> up) { return [up](int s) { return up.count(s) > 0; }; };
  bool all = false;
  EXPECT_EQ(observersToAwait(v, 0, sees({}), &all), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(all);
  // Two of four (itself and slot 2): half, enough; the unseen ones are taken for dead.
  EXPECT_EQ(observersToAwait(v, 0, sees({2}), &all), (std::vector<int>{2}));
  EXPECT_FALSE(all);
  // World 2, the peer dead: half, so a survivor of a two-member group does not wait.
  EXPECT_EQ(observersToAwait(initialView(2, 2), 1, sees({}), &all), (std::vector<int>{}));
  EXPECT_FALSE(all);
  // Inactive members do not count and are not awaited unless seen; unused slots never are.
  const View w = deactivated(initialView(6, 5), {3, 4});  // active 0 1 2, inactive 3 4
  EXPECT_EQ(observersToAwait(w, 0, sees({4}), &all), (std::vector<int>{1, 2, 4}));
  EXPECT_TRUE(all);  // 1 of 3 counted members seen (itself)
  EXPECT_EQ(observersToAwait(w, 0, sees({1}), &all), (std::vector<int>{1}));
  EXPECT_FALSE(all);
  // An inactive process (it reconciles through sync_after_failure) is not counted: seeing one
  // of the three active members is not half of them.
  const View x = deactivated(initialView(4, 4), {0});
  EXPECT_EQ(observersToAwait(x, 0, sees({1}), &all), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(all);
  EXPECT_EQ(observersToAwait(x, 0, sees({1, 2}), &all), (std::vector<int>{1, 2}));
  EXPECT_FALSE(all);
  // What the wider wait buys: slot 0 is cut off from every link, 1-3 reach one another; with
  // their observations slot 0 is evicted, with only its own it alone would be healthy.
  LinkMatrix l = full(4);
  for (int b = 1; b < 4; ++b) cut(l, 0, b);
  EXPECT_EQ(healthySet(mask(4, {0, 1, 2, 3}), l), mask(4, {1, 2, 3}));
  EXPECT_EQ(healthySet(mask(4, {0}), l), mask(4, {0}));
}

TEST(PgMembership, ReconcileModes) {
  View v = joined(initialView(6, 4), 5, 1);
  SlotMask h = mask(6, {0, 1, 3});  // 2 failed, the joiner 5 is not healthy either
  View a = reconciled(v, h, /*auto_deactivate=*/true, false);
  EXPECT_EQ(a.activeSlots(), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(a.state[2], MemberState::kInactive);
  EXPECT_EQ(a.state[5], MemberState::kInactive) << "an unhealthy joiner's readiness is revoked";
  EXPECT_EQ(a.data_epoch, a.epoch);
  EXPECT_EQ(a.healthy, h);
  View f = reconciled(v, h, /*auto_deactivate=*/false, false);
  EXPECT_EQ(f.activeSlots(), (std::vector<int>{0, 1, 2, 3})) << "framework-managed: unchanged";
  EXPECT_EQ(f.data_epoch, v.data_epoch);
  EXPECT_EQ(f.healthy, h);
  View r = reconciled(v, h, false, /*resync=*/true);
  EXPECT_EQ(r.data_epoch, r.epoch) << "an op failed: new data plane, same members";
}

TEST(PgMembership, JoinRules) {
  View v = deactivated(initialView(4, 4), {1});
  EXPECT_EQ(joinRefusal(v, 1, 1), "") << "in-place rejoin of an inactive rank";
  EXPECT_EQ(joinRefusal(v, 1, 2), "") << "a replacement process";
  EXPECT_NE(joinRefusal(v, 0, 1), "") << "already active";
  EXPECT_NE(joinRefusal(v, 4, 1), "") << "outside the slots";
  View r = joined(v, 1, 2);
  EXPECT_NE(joinRefusal(r, 1, 1), "") << "the old process may not take the slot back";
  // A replacement for an active slot whose process died (framework-managed groups).
  View j = joined(initialView(4, 4), 2, 2);
  EXPECT_EQ(j.state[2], MemberState::kAwaiting);
  EXPECT_EQ(j.data_epoch, j.epoch) << "slot 2 left the active set";
  View l = left(v, 1);
  EXPECT_EQ(l.state[1], MemberState::kLeft);
  EXPECT_EQ(joinRefusal(l, 1, 2), "");
}

TEST(PgMembership, ActivationAdmission) {
  View v = joined(joined(initialView(6, 3), 3, 1), 4, 1);  // 3 and 4 awaiting, 5 reserved
  SlotMask h = mask(6, {0, 1, 2, 3, 4});
  LinkMatrix l = full(6);
  EXPECT_EQ(admitActivation(v, {3, 4}, h, l).kind, Admission::kAdmit);
  EXPECT_EQ(admitActivation(v, {0}, h, l).kind, Admission::kAdmit) << "already active";
  Admission none = admitActivation(v, {5}, h, l);
  EXPECT_EQ(none.kind, Admission::kReject);
  EXPECT_EQ(none.reason, "target rank is not valid group member");
  EXPECT_EQ(admitActivation(v, {6}, h, l).kind, Admission::kReject);
  View d = deactivated(v, {1});
  EXPECT_EQ(admitActivation(d, {1}, h, l).kind, Admission::kWait) << "no join_group yet";
  EXPECT_EQ(admitActivation(v, {3}, mask(6, {0, 1, 2}), l).kind, Admission::kWait)
      << "unhealthy target";
  LinkMatrix broken = full(6);
  broken.set(1, 4, false);  // one direction from an active member to a target
  Admission w = admitActivation(v, {3, 4}, h, broken);
  EXPECT_EQ(w.kind, Admission::kWait);
  EXPECT_NE(w.reason.find("1 and 4"), std::string::npos) << w.reason;
  EXPECT_EQ(admitActivation(v, {3}, h, broken).kind, Admission::kAdmit) << "4 not involved";
  EXPECT_EQ(activated(v, {3, 4, 5}).activeSlots(), (std::vector<int>{0, 1, 2, 3, 4}));
}

// 1024 slots: a dead quarter, a broken pair, admission of 100 joiners, round trips, and the
// whole reconcile under a few tens of milliseconds.
TEST(PgMembership, ThousandTwentyFourSlots) {
  const int n = 1024;
  View v = initialView(n, 900);
  ASSERT_EQ(v.size(), 900);
  LinkMatrix l = full(n);
  std::set<int> dead;
  for (int s = 3; s < 900; s += 4) dead.insert(s);  // 225 ranks
  for (int d : dead)
    for (int b = 0; b < n; ++b)
      if (b != d) cut(l, d, b);
  cut(l, 10, 1000 - 500);  // one broken pair among survivors: 10 and 500 -> 500 goes
  SlotMask cand(n, 0);
  for (int s = 0; s < 900; ++s) cand[s] = 1;
  auto t0 = std::chrono::steady_clock::now();
  SlotMask h = healthySet(cand, l);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::steady_clock::now() - t0)
                .count();
  EXPECT_LT(ms, 2000) << "healthy set of 1024 slots took " << ms << " ms";
  int healthy = 0;
  for (int s = 0; s < n; ++s) healthy += h[s];
  EXPECT_EQ(healthy, 900 - 225 - 1);
  EXPECT_EQ(h[500], 0);
  EXPECT_EQ(h[10], 1);
  for (int d : dead) EXPECT_EQ(h[d], 0) << d;
  View r = reconciled(v, h, true, false);
  EXPECT_EQ(static_cast<int>(r.activeSlots().size()), 674);
  EXPECT_EQ(r.size(), 899);  // slot 899 died (3 mod 4): 898 is the highest active slot
  // 100 joiners in the reserved slots, then activated.
  View j = r;
  for (int s = 900; s < 1000; ++s) j = joined(j, s, 1);
  std::vector<int> targets;
  for (int s = 900; s < 1000; ++s) targets.push_back(s);
  for (int s = 900; s < 1000; ++s) h[s] = 1;
  EXPECT_EQ(admitActivation(j, targets, h, l).kind, Admission::kAdmit);
  View a = activated(j, targets);
  EXPECT_EQ(a.size(), 1000);
  EXPECT_EQ(static_cast<int>(a.activeSlots().size()), 774);
  View back;
  ASSERT_TRUE(View::parse(a.serialize(), &back));
  EXPECT_TRUE(back.sameMembers(a));
  EXPECT_EQ(a.epoch, 1u + 1 + 100 + 1);
}

// ---- the agreement log ----

std::shared_ptr<engine::Rendezvous> rdv() { return std::make_shared<engine::InProcessRendezvous>(); }

TEST(PgViewLog, OneProposer) {
  auto r = rdv();
  ViewLog log(r, "g", 7);
  auto d0 = log.decided(5);
  ASSERT_TRUE(d0.ok());
  EXPECT_FALSE(d0->has_value());
  auto v = log.propose(5, "five", engine::deadlineInMs(5000));
  ASSERT_TRUE(v.ok()) << v.status().toString();
  EXPECT_EQ(*v, "five");
  ViewLog other(r, "g", 8);
  auto again = other.propose(5, "other", engine::deadlineInMs(5000));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, "five") << "a decided epoch never changes";
  auto d = other.decided(5);
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_EQ(**d, "five");
}

// Many proposers at once, many epochs: every proposer of an epoch learns the same value.
TEST(PgViewLog, ConcurrentProposersAgree) {
  auto r = rdv();
  const int kProcs = 8, kEpochs = 30;
  std::vector<std::vector<std::string>> got(kProcs, std::vector<std::string>(kEpochs));
  std::vector<std::thread> th;
  for (int p = 0; p < kProcs; ++p)
    th.emplace_back([&, p] {
      ViewLog log(r, "g", static_cast<uint64_t>(p + 1));
      for (int e = 1; e <= kEpochs; ++e) {
        auto v = log.propose(e, "p" + std::to_string(p), engine::deadlineInMs(20000));
        got[p][e - 1] = v.ok() ? *v : "error: " + v.status().toString();
      }
    });
  for (auto& t : th) t.join();
  for (int e = 0; e < kEpochs; ++e) {
    EXPECT_EQ(got[0][e].substr(0, 1), "p") << got[0][e];
    for (int p = 1; p < kProcs; ++p) EXPECT_EQ(got[p][e], got[0][e]) << "epoch " << e + 1;
  }
}

// A proposer stalls right after its phase-2 write (it has accepted its value but not decided):
// another proposer must still finish, and must choose the stalled one's value (it may have been
// chosen); when the stalled one wakes up, it returns the same value.
TEST(PgViewLog, StalledProposerCannotSplitTheDecision) {
  auto r = rdv();
  std::mutex mu;
  std::condition_variable cv;
  bool stalled = false, release = false;
  ViewLog slow(r, "g", 1);
  slow.on_point = [&](const char* point) {
    if (std::string(point) != "phase2") return;
    std::unique_lock<std::mutex> g(mu);
    stalled = true;
    cv.notify_all();
    cv.wait(g, [&] { return release; });
  };
  std::string slow_result;
  std::thread t([&] {
    auto v = slow.propose(1, "slow", engine::deadlineInMs(20000));
    slow_result = v.ok() ? *v : v.status().toString();
  });
  {
    std::unique_lock<std::mutex> g(mu);
    cv.wait(g, [&] { return stalled; });
  }
  ViewLog fast(r, "g", 2);
  auto v = fast.propose(1, "fast", engine::deadlineInMs(20000));
  ASSERT_TRUE(v.ok()) << v.status().toString();
  EXPECT_EQ(*v, "slow") << "the stalled proposer's accepted value must win";
  {
    std::lock_guard<std::mutex> g(mu);
    release = true;
  }
  cv.notify_all();
  t.join();
  EXPECT_EQ(slow_result, "slow");
}

// A proposer that stalls after phase 1 (nothing accepted yet) and one that vanishes: others
// decide without them; the late one learns the decided value instead of its own.
TEST(PgViewLog, VanishedAndLateProposers) {
  auto r = rdv();
  std::mutex mu;
  std::condition_variable cv;
  bool stalled = false, release = false;
  ViewLog late(r, "g", 3);
  late.on_point = [&](const char* point) {
    if (std::string(point) != "phase1") return;
    std::unique_lock<std::mutex> g(mu);
    stalled = true;
    cv.notify_all();
    cv.wait(g, [&] { return release; });
  };
  std::string late_result;
  std::thread t([&] {
    auto v = late.propose(1, "late", engine::deadlineInMs(20000));
    late_result = v.ok() ? *v : v.status().toString();
  });
  {
    std::unique_lock<std::mutex> g(mu);
    cv.wait(g, [&] { return stalled; });
  }
  // A proposer that registered and wrote phase 1, then "died" (its log object is gone).
  {
    ViewLog gone(r, "g", 4);
    gone.on_point = [](const char* point) {
      if (std::string(point) == "phase1") throw std::runtime_error("killed");
    };
    EXPECT_THROW((void)gone.propose(1, "gone", engine::deadlineInMs(1000)), std::runtime_error);
  }
  ViewLog winner(r, "g", 2);
  auto v = winner.propose(1, "winner", engine::deadlineInMs(20000));
  ASSERT_TRUE(v.ok()) << v.status().toString();
  EXPECT_EQ(*v, "winner");
  {
    std::lock_guard<std::mutex> g(mu);
    release = true;
  }
  cv.notify_all();
  t.join();
  EXPECT_EQ(late_result, "winner");
}

}  // namespace
}  // namespace mooncake::pg
