// Elastic groups under repeated faults, with no coordinator to lose:
//  - 20 rounds of: SIGKILL one member (slot 0, the first proposer, included), time until every
//    survivor holds the view without it, a replacement process takes the slot and the group is
//    whole again; p50/max printed (docs/perf/pg.md);
//  - the proposing rank killed in the middle of its proposal (after it accepted its value):
//    the others finish the agreement (adopting its value, as Paxos must) and then evict it;
//  - the proposing rank stopped (SIGSTOP) in the middle of its proposal for longer than the
//    others wait: they agree without it; when it resumes it learns the same views (no split).
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "tests/pg/elastic_util.h"

namespace mooncake::pg::test {
namespace {

using Ms = std::chrono::milliseconds;

// Shared layout (Shared::more):
//   [0]        round being run (parent)          [1] victim slot    [2] kill time (ns)
//   [3]        members ready for the round        [4] round done count
//   [8 + s]    process index holding slot s
//   [32 + r]   worst survivor latency of round r (ns, max over survivors: CAS-max)
//   [64 + p]   process p: take slot (value - 1) now (replacements)
constexpr int kRounds = 20, kWorld = 4;

void casMax(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

TEST(PgElasticFaults, TwentyKillsEachReconciledFast) {
  std::vector<double> lat;  // seconds from each kill to the last survivor holding the view
  RunOptions o;
  o.world = kWorld;
  o.extra = kRounds;
  o.create_comm = false;
  o.deadline_s = 280;
  o.parent = [&lat](const std::vector<pid_t>& pids, Shared* sh) {
    for (int s = 0; s < kWorld; ++s) sh->more[8 + s].store(s);
    for (int r = 0; r < kRounds; ++r) {
      if (!waitFor([&] { return sh->more[3].load() >= (r + 1) * kWorld; }, 60)) return;
      const int victim = (r * 3 + 1) % kWorld;  // 1, 0, 3, 2, 1, ...: every slot, slot 0 too
      sh->more[1].store(victim);
      sh->more[0].store(r + 1);
      std::this_thread::sleep_for(Ms(30));  // members are idle, polling their views
      sh->more[2].store(monotonicNs());
      kill(pids[sh->more[8 + victim].load()], SIGKILL);
      const int repl = kWorld + r;
      sh->more[8 + victim].store(repl);
      sh->more[64 + repl].store(victim + 1);
      if (!waitFor([&] { return sh->more[4].load() >= (r + 1) * kWorld; }, 60)) return;
      lat.push_back(sh->more[32 + r].load() / 1e9);
    }
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    std::unique_ptr<Communicator> c;
    int first_round = 0;
    if (env.rank < kWorld) {
      c = elasticComm(env, env.rank, kWorld, kWorld, false);
    } else {
      const int p = env.rank;
      if (!waitFor([&] { return sh->more[64 + p].load() > 0; }, 250)) return;  // unused spare
      const int slot = static_cast<int>(sh->more[64 + p].load()) - 1;
      c = elasticComm(env, slot, kWorld, kWorld, true);
      c->joinGroup();
      first_round = p - kWorld + 1;
      int64_t v = 1, got = 0;
      c->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(got, kWorld);
      sh->more[4].fetch_add(1);
    }
    const int me = c->rank();
    for (int r = first_round; r < kRounds; ++r) {
      sh->more[3].fetch_add(1);
      ASSERT_TRUE(waitFor([&] { return sh->more[0].load() >= r + 1; }, 120));
      const int victim = static_cast<int>(sh->more[1].load());
      if (victim == me) {
        std::this_thread::sleep_for(std::chrono::seconds(60));  // the parent kills it
        return;
      }
      ASSERT_TRUE(waitFor([&] { return c->activeMask()[victim] == 0; }, 20)) << "round " << r;
      casMax(sh->more[32 + r], monotonicNs() - sh->more[2].load());
      EXPECT_EQ(static_cast<int>(activeSlots(*c).size()), kWorld - 1);
      ASSERT_TRUE(waitFor([&] { return c->peerState({victim})[0] == 1; }, 30)) << "round " << r;
      ProposalResult res = c->activateRanks({victim});
      ASSERT_EQ(res.status, ProposalStatus::kApplied) << res.reject_reason;
      int64_t v = 1, got = 0;
      c->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(got, kWorld) << "round " << r;
      sh->more[4].fetch_add(1);
    }
    checkCollectives(*c, 99, 64);
  });
  ASSERT_EQ(static_cast<int>(lat.size()), kRounds);
  std::vector<double> sorted = lat;
  std::sort(sorted.begin(), sorted.end());
  const double p50 = sorted[kRounds / 2], worst = sorted.back();
  std::string all;
  for (double x : lat) all += " " + std::to_string(static_cast<int>(x * 1000));
  std::printf("elastic: SIGKILL -> every survivor holds the new view, %d kills: p50 %.0f ms, "
              "max %.0f ms (ms:%s)\n",
              kRounds, p50 * 1000, worst * 1000, all.c_str());
  EXPECT_LT(p50, 2.0) << "p50 over " << kRounds << " kills";
  // Generous for a shared 2-core machine; the target (2 s) is what docs/perf/pg.md reports.
  EXPECT_LT(worst, 5.0);
  int killed = 0;
  for (int p = 0; p < kWorld + kRounds; ++p) {
    if (codes[p] == 128 + SIGKILL) ++killed;
    else EXPECT_EQ(codes[p], 0) << "process " << p;
  }
  EXPECT_EQ(killed, kRounds);
}

// Where process `pid` is stopped (SIGSTOP): state 'T' in /proc/<pid>/stat.
bool stopped(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T';
}

// Every survivor records the active set of each view it applies (more[16 + 8*p + k] for its
// k-th view: epoch << 32 | mask) so that the test can check they applied the same history.
void recordViews(Communicator& c, Shared* sh, int p) {
  auto k = std::make_shared<int>(0);
  Communicator* cp = &c;
  c.onViewChange([cp, sh, p, k] {
    int64_t mask = 0;
    auto m = cp->activeMask();
    for (size_t s = 0; s < m.size(); ++s)
      if (m[s]) mask |= int64_t{1} << s;
    if (*k < 8) sh->more[128 + 8 * p + (*k)++].store(static_cast<int64_t>(cp->epoch()) << 32 | mask);
  });
}

// Slot 0 proposes the view after slot 3's death (it is the first live active slot) and is
// killed right after it accepted its value: slots 1 and 2 must decide that value (it may have
// been chosen), then evict slot 0 too.
TEST(PgElasticFaults, ProposerKilledMidAgreement) {
  RunOptions o;
  o.world = 4;
  o.create_comm = false;
  o.deadline_s = 90;
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[0].load() >= 4; }, 60);
    sh->kill_time_ns.store(monotonicNs());
    kill(pids[3], SIGKILL);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    std::atomic<bool> armed{false};
    auto hook = [&armed](const char* point) {
      if (armed.load() && std::string(point) == "phase2") raise(SIGKILL);
    };
    auto c = elasticComm(env, env.rank, 4, 4, false, {}, "",
                         env.rank == 0 ? std::function<void(const char*)>(hook) : nullptr);
    checkCollectives(*c, 1, 64);
    recordViews(*c, sh, env.rank);
    armed = true;
    arrive(sh, 0, 4);
    if (env.rank == 0 || env.rank == 3) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return;
    }
    ASSERT_TRUE(waitFor([&] { return activeSlots(*c) == (std::vector<int>{1, 2}); }, 20))
        << "survivors never evicted both";
    double s = (monotonicNs() - sh->kill_time_ns.load()) / 1e9;
    std::printf("slot %d: proposer killed mid-agreement: view {1, 2} after %.0f ms\n", env.rank,
                s * 1000);
    EXPECT_LT(s, 5.0);
    checkCollectives(*c, 2, 64);
    arrive(sh, 1, 2);
    // Both histories as they are now: once a survivor has read them it waits for the other
    // (barrier 2), since a survivor that leaves first makes the other apply one view more.
    std::vector<int64_t> seen(16);
    for (int k = 0; k < 16; ++k) seen[k] = sh->more[128 + 8 + k].load();
    arrive(sh, 2, 2);
    // Same history on both survivors, and slot 0's accepted value was decided: a view with
    // {0, 1, 2} active came before {1, 2}.
    bool zero_won = false;
    for (int k = 0; k < 8; ++k) {
      EXPECT_EQ(seen[k], seen[8 + k]) << k;
      if ((seen[8 * (env.rank - 1) + k] & 0xffffffff) == 0b0111) zero_won = true;
    }
    EXPECT_TRUE(zero_won) << "the dead proposer's accepted view was not decided";
  });
  EXPECT_EQ(codes[0], 128 + SIGKILL);
  EXPECT_EQ(codes[3], 128 + SIGKILL);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(codes[2], 0);
}

// Slot 0 stops (SIGSTOP) in the middle of its proposal, for 3 s: slots 1 and 2 agree without
// it (it does not answer, so it is not healthy); when it resumes it learns the same view, finds
// itself inactive, rejoins in place, and the three run together again.
TEST(PgElasticFaults, StalledProposerRejoins) {
  RunOptions o;
  o.world = 4;
  o.create_comm = false;
  o.deadline_s = 120;
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[0].load() >= 4; }, 60);
    kill(pids[3], SIGKILL);
    if (!waitFor([&] { return stopped(pids[0]); }, 20)) return;
    std::this_thread::sleep_for(std::chrono::seconds(3));
    kill(pids[0], SIGCONT);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    std::atomic<bool> armed{false};
    auto hook = [&armed](const char* point) {
      if (armed.exchange(false) && std::string(point) == "phase1") raise(SIGSTOP);
    };
    auto c = elasticComm(env, env.rank, 4, 4, false, {}, "",
                         env.rank == 0 ? std::function<void(const char*)>(hook) : nullptr);
    checkCollectives(*c, 1, 64);
    armed = true;
    arrive(sh, 0, 4);
    if (env.rank == 3) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return;
    }
    if (env.rank != 0) {
      ASSERT_TRUE(waitFor([&] { return activeSlots(*c) == (std::vector<int>{1, 2}); }, 30));
      checkCollectives(*c, 2, 64);
    } else {
      // Resumed: the view the others decided without this rank.
      ASSERT_TRUE(waitFor([&] { return c->activeMask()[0] == 0; }, 30));
      EXPECT_EQ(activeSlots(*c), (std::vector<int>{1, 2}));
    }
    sh->more[20 + env.rank].store(static_cast<int64_t>(c->epoch()));
    arrive(sh, 1, 3);
    EXPECT_EQ(sh->more[20].load(), sh->more[21].load()) << "same epoch after the stall";
    EXPECT_EQ(sh->more[21].load(), sh->more[22].load());
    if (env.rank == 0) {
      c->joinGroup();
    } else {
      ASSERT_TRUE(waitFor([&] { return c->peerState({0})[0] == 1; }, 30));
      EXPECT_EQ(c->activateRanks({0}).status, ProposalStatus::kApplied);
    }
    EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 1, 2}));
    checkCollectives(*c, 3, 64);
  });
  EXPECT_EQ(codes[3], 128 + SIGKILL);
  for (int r : {0, 1, 2}) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace mooncake::pg::test
