// Elastic groups with real rank processes, over shared memory ("shm") and over tcp between
// simulated hosts ("tcp": MC_TRANSPORT=tcp, a different MC_HOST_ID per rank): a rank killed
// and the others going on over the survivors (every collective and p2p checked against a
// reference, holes zero-filled), the three failure-handling modes, a replacement process
// taking the dead rank's slot, extension ranks (in a second group too), an in-place rejoin,
// membership changes at world 8, and the option checks.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>

#include "tests/pg/elastic_util.h"

namespace mooncake::pg::test {
namespace {

using Ms = std::chrono::milliseconds;

RunOptions options(const std::string& transport, int world, int extra = 0) {
  RunOptions o;
  o.world = world;
  o.extra = extra;
  o.create_comm = false;
  o.deadline_s = 120;
  if (transport == "tcp") {
    o.transport = "tcp";
    // The one-sided path (receive slots granted per view) is what rdma peers take: run it
    // over tcp here (the two-sided one is covered by the plain groups' tests).
    o.env = {{"MC_PG_NET_ONE_SIDED", "all"}};
    o.rank_env = [](int r) {
      return std::vector<std::pair<std::string, std::string>>{
          {"MC_HOST_ID", "host-" + std::to_string(r)}};
    };
  }
  return o;
}

class PgElastic : public ::testing::TestWithParam<std::string> {};

// The parent kills slot 1 once every rank is ready; the survivors hold the view without it
// (auto_deactivate) within 2 s, then every collective and p2p runs over slots {0, 2, 3}.
TEST_P(PgElastic, DeadRankDeactivatedThenCollectives) {
  RunOptions o = options(GetParam(), 4);
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[0].load() >= 4; }, 60);
    sh->kill_time_ns.store(monotonicNs());
    kill(pids[1], SIGKILL);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    auto c = elasticComm(env, env.rank, 4, 4, false);
    EXPECT_EQ(c->size(), 4);
    EXPECT_EQ(c->epoch(), 1u);
    checkCollectives(*c, 1);
    const uint64_t slot_sends = c->netSlotSends();
    arrive(env.shared, 0, 4);
    if (env.rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(30));  // killed before
      return;
    }
    ASSERT_TRUE(waitFor([&] { return c->activeMask()[1] == 0; }, 10));
    double s = (monotonicNs() - env.shared->kill_time_ns.load()) / 1e9;
    EXPECT_LT(s, 2.0) << "the view without slot 1 arrived " << s << " s after the kill";
    EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 2, 3}));
    EXPECT_EQ(c->size(), 4);
    EXPECT_GT(c->epoch(), 1u);
    EXPECT_EQ(c->peerState({0, 1, 2, 3}), (std::vector<uint8_t>{1, 0, 1, 1}));
    for (int round = 0; round < 3; ++round) checkCollectives(*c, 10 + round);
    // Over tcp with MC_PG_NET_ONE_SIDED=all the new view's large messages went into
    // receive slots again (granted anew).
    if (GetParam() == "tcp") {
      EXPECT_GT(slot_sends, 0u);
      EXPECT_GT(c->netSlotSends(), slot_sends);
    }
  });
  EXPECT_EQ(codes[1], 128 + SIGKILL);
  for (int r : {0, 2, 3}) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// The highest slot dies: size() shrinks to 3; ops keep running (no hole).
TEST_P(PgElastic, HighestSlotDiesSizeShrinks) {
  RunOptions o = options(GetParam(), 3);
  auto codes = runRanks(o, [&](RankEnv& env) {
    auto c = elasticComm(env, env.rank, 3, 3, false);
    checkCollectives(*c, 1, 100);
    arrive(env.shared, 0, 3);
    if (env.rank == 2) raise(SIGKILL);
    ASSERT_TRUE(waitFor([&] { return c->size() == 2; }, 10)) << c->size();
    checkCollectives(*c, 2, 100);
  });
  EXPECT_EQ(codes[2], 128 + SIGKILL);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// A replacement process takes the dead rank's slot (is_extension): isolated and local-only
// until join_group; one survivor asks for the activation before the join (it waits for it),
// the others after they see the joiner ready; then the full group runs again.
TEST_P(PgElastic, ReplacementRecoversSlot) {
  RunOptions o = options(GetParam(), 4, 1);
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[0].load() >= 4; }, 60);
    kill(pids[2], SIGKILL);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    if (env.rank == 4) {  // the replacement for slot 2
      ASSERT_TRUE(waitFor([&] { return sh->more[1].load() >= 3; }, 60));
      auto c = elasticComm(env, 2, 4, 4, true);
      EXPECT_EQ(c->size(), 4) << "declared size while isolated";
      EXPECT_EQ(activeSlots(*c), std::vector<int>{2});
      int64_t v = 5, got = 0;
      c->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(got, 5) << "isolated: local only";
      c->joinGroup();
      EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 1, 2, 3}));
      checkCollectives(*c, 20);
      return;
    }
    auto c = elasticComm(env, env.rank, 4, 4, false);
    checkCollectives(*c, 1);
    arrive(sh, 0, 4);
    if (env.rank == 2) {
      std::this_thread::sleep_for(std::chrono::seconds(30));
      return;
    }
    ASSERT_TRUE(waitFor([&] { return c->activeMask()[2] == 0; }, 10));
    checkCollectives(*c, 2);
    arrive(sh, 1, 3);  // lets the replacement start
    if (env.rank != 0) {
      ASSERT_TRUE(waitFor([&] { return c->peerState({2})[0] == 1; }, 30)) << "joiner never ready";
    }
    ProposalResult r = c->activateRanks({2});
    EXPECT_EQ(r.status, ProposalStatus::kApplied) << r.reject_reason;
    EXPECT_TRUE(r.dropped_ranks.empty());
    EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 1, 2, 3}));
    checkCollectives(*c, 20);
  });
  EXPECT_EQ(codes[2], 128 + SIGKILL);
  for (int r : {0, 1, 3, 4}) EXPECT_EQ(codes[r], 0) << "process " << r;
}

// Extension ranks: founders 0-2 (size 3, 4 slots) and a second group of founders 0-1 (size 2,
// 3 slots); the extension process joins slot 3 of the first and slot 2 of the second.
TEST_P(PgElastic, ExtensionRanksJoinTwoGroups) {
  RunOptions o = options(GetParam(), 3, 1);
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    const bool ext = env.rank == 3;
    if (ext) {
      ASSERT_TRUE(waitFor([&] { return sh->more[0].load() >= 3; }, 60));
    }
    auto world = elasticComm(env, env.rank, ext ? 4 : 3, 4, ext);
    std::unique_ptr<Communicator> sub;
    if (env.rank != 2) sub = elasticComm(env, ext ? 2 : env.rank, ext ? 3 : 2, 3, ext, {}, "/sub");
    int64_t v = env.rank + 1, got = 0;
    world->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
    EXPECT_EQ(got, ext ? 4 : 6);
    EXPECT_EQ(world->size(), ext ? 4 : 3);
    if (sub) {
      sub->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(got, ext ? 4 : 3);
    }
    if (!ext) arrive(sh, 0, 3);
    if (ext) {
      world->joinGroup();
      sub->joinGroup();
    } else {
      ASSERT_TRUE(waitFor([&] { return world->peerState({3})[0] == 1; }, 30));
      EXPECT_EQ(world->activateRanks({3}).status, ProposalStatus::kApplied);
      if (sub) {
        ASSERT_TRUE(waitFor([&] { return sub->peerState({2})[0] == 1; }, 30));
        EXPECT_EQ(sub->activateRanks({2}).status, ProposalStatus::kApplied);
      }
    }
    EXPECT_EQ(world->size(), 4);
    world->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
    EXPECT_EQ(got, 10);
    checkCollectives(*world, 30);
    if (sub) {
      EXPECT_EQ(sub->size(), 3);
      sub->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum);
      EXPECT_EQ(got, 1 + 2 + 4);
      checkCollectives(*sub, 40);
    }
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(codes[r], 0) << "process " << r;
}

// Deactivation by one rank (others idle), ops over the rest, an in-place rejoin (the same
// process calls join_group) and the activation.
TEST_P(PgElastic, DeactivateAndRejoinInPlace) {
  RunOptions o = options(GetParam(), 3);
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    auto c = elasticComm(env, env.rank, 3, 3, false);
    checkCollectives(*c, 1, 100);
    arrive(sh, 0, 3);
    if (env.rank == 0) {
      ProposalResult r = c->deactivateRanks({1});
      EXPECT_EQ(r.status, ProposalStatus::kApplied) << r.reject_reason;
      EXPECT_EQ(r.new_epoch, 2u);
      // Deactivating an inactive rank changes nothing.
      ProposalResult again = c->deactivateRanks({1});
      EXPECT_EQ(again.status, ProposalStatus::kApplied);
      EXPECT_EQ(again.new_epoch, 2u);
    }
    ASSERT_TRUE(waitFor([&] { return c->activeMask()[1] == 0 && c->epoch() >= 2; }, 10));
    if (env.rank == 1) {
      int64_t v = 1, got;
      EXPECT_THROW(c->allReduce(&v, &got, 1, DataType::kInt64, ReduceOp::kSum), CommError);
      arrive(sh, 1, 3);
      c->joinGroup();
    } else {
      checkCollectives(*c, 2, 100);
      arrive(sh, 1, 3);
      ASSERT_TRUE(waitFor([&] { return c->peerState({1})[0] == 1; }, 30));
      EXPECT_EQ(c->activateRanks({1}).status, ProposalStatus::kApplied);
    }
    EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 1, 2}));
    checkCollectives(*c, 3, 100);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, PgElastic, ::testing::Values("shm", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// ---- the three failure-handling modes: a rank killed while the others loop allreduce ----

struct ModeCase {
  const char* name;
  Mode mode;
};
// gtest prints a parameter in the test's listing (and so in ctest's name): by name, not bytes.
void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.name; }

class PgElasticMode : public ::testing::TestWithParam<ModeCase> {};

TEST_P(PgElasticMode, FailedOpCompletesWithEvidence) {
  const Mode mode = GetParam().mode;
  RunOptions o = options("shm", 4);
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[0].load() >= 4; }, 60);
    std::this_thread::sleep_for(Ms(100));  // they loop for a while
    kill(pids[1], SIGKILL);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    auto c = elasticComm(env, env.rank, 4, 4, false, mode);
    arrive(sh, 0, 4);
    const size_t n = 4096;
    int first_fail = -1, failures = 0, stop = 1 << 30, ok_after = 0;
    for (int i = 0; i < stop; ++i) {
      std::vector<int64_t> buf = input(env.rank, n, i);
      try {
        c->allReduce(buf.data(), buf.data(), n, DataType::kInt64, ReduceOp::kSum);
      } catch (const PeerFailure& f) {
        ++failures;
        ASSERT_EQ(f.hint().size(), 4u);
        EXPECT_EQ(f.hint()[env.rank], 0) << f.what();
        EXPECT_EQ(f.hint()[0] + f.hint()[2] + f.hint()[3], 0) << "only slot 1 failed: " << f.what();
        if (first_fail < 0) {
          first_fail = i;
          if (mode.auto_sync) {
            EXPECT_EQ(c->activeMask()[1], 0) << "auto_sync: the new view before the op ends";
          } else if (mode.auto_deactivate) {
            SyncResult s = c->syncAfterFailure();
            EXPECT_NE(s.status, SyncStatus::kRejected);
            EXPECT_EQ(c->activeMask()[1], 0) << "deferred: applied by sync_after_failure";
          } else {
            SyncResult s = c->syncAfterFailure();
            EXPECT_NE(s.status, SyncStatus::kRejected);
            // Membership is unchanged unless another survivor already deactivated slot 1
            // (each raises more[20] before it proposes; its view may reach this rank's sync).
            const bool mask1 = c->activeMask()[1] == 1;
            EXPECT_TRUE(mask1 || sh->more[20].load() > 0)
                << "framework-managed: membership unchanged until a survivor deactivates";
            EXPECT_EQ(c->peerState({1})[0], 0);
            sh->more[20].fetch_add(1);
            ProposalResult r = c->deactivateRanks({1});
            EXPECT_NE(r.status, ProposalStatus::kRejected) << r.reject_reason;
            EXPECT_EQ(c->activeMask()[1], 0);
          }
          sh->more[10 + env.rank].store(i + 1);
          // Everyone stops 20 ops after the last survivor's first failure.
          ASSERT_TRUE(waitFor([&] {
            return sh->more[10].load() > 0 && sh->more[12].load() > 0 && sh->more[13].load() > 0;
          }, 30));
          stop = static_cast<int>(std::max({sh->more[10].load(), sh->more[12].load(),
                                            sh->more[13].load()})) + 20;
        }
        continue;
      }
      int64_t want0 = 0, wantN = 0;
      const std::vector<int> act = activeSlots(*c);
      for (int s : act) {
        want0 += val(s, 0, i);
        wantN += val(s, n - 1, i);
      }
      if (first_fail >= 0) {
        ++ok_after;
        EXPECT_EQ(act, (std::vector<int>{0, 2, 3}));
      }
      ASSERT_EQ(buf[0], want0) << "op " << i;
      ASSERT_EQ(buf[n - 1], wantN) << "op " << i;
    }
    EXPECT_GE(first_fail, 0) << "no op failed after the kill";
    EXPECT_LE(failures, 3) << "the group kept failing ops";
    EXPECT_GE(ok_after, 17);
  });
  EXPECT_EQ(codes[1], 128 + SIGKILL);
  for (int r : {0, 2, 3}) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Modes, PgElasticMode,
    ::testing::Values(ModeCase{"auto_sync", {true, true}}, ModeCase{"deferred", {true, false}},
                      ModeCase{"framework", {false, false}}),
    [](const ::testing::TestParamInfo<ModeCase>& i) { return std::string(i.param.name); });

// Op numbering across failures (framework-managed mode: no view until the ranks ask). Slot 1
// enters op 1 and fails it (slot 2 dies).
//  - "early": slot 0 calls op 1 after it has seen slot 2 dead, before any view: the op fails
//    at its start, and it is slot 0's op 1 all the same. One view (the deactivation) follows.
//  - "late": slot 0 calls op 1 only after two views with a data barrier each (the
//    reconciliation slot 1 asks for, then the deactivation): its op 1 must fail without
//    running, since slot 1 ran op 1 two views ago.
// Either way op 2 then runs on both with op 2's data. Both were wrong once (an op failed at
// its start did not count; a second view dropped the skips the first one owed): slot 0's
// op k+1 ran with slot 1's op k.
class PgElasticNumbering : public ::testing::TestWithParam<bool> {};

TEST_P(PgElasticNumbering, OpsStayPairedAcrossViews) {
  const bool early = GetParam();
  RunOptions o = options("shm", 3);
  o.parent = [](const std::vector<pid_t>& pids, Shared* sh) {
    waitFor([&] { return sh->more[2].load() >= 1; }, 60);
    std::this_thread::sleep_for(Ms(200));  // slot 1 waits in op 1
    kill(pids[2], SIGKILL);
    sh->more[3].store(1);
  };
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    // "late": slot 1's op 1 waits for slot 0, which does not call it: give up after 1 s.
    setCollectiveTimeout(std::chrono::seconds(1));
    auto c = elasticComm(env, env.rank, 3, 3, false, Mode{false, false});
    const size_t n = 1024;
    auto allreduce = [&](int64_t salt) {
      std::vector<int64_t> buf = input(env.rank, n, salt);
      c->allReduce(buf.data(), buf.data(), n, DataType::kInt64, ReduceOp::kSum);
      return buf;
    };
    std::vector<int64_t> got = allreduce(0);
    EXPECT_EQ(got[0], val(0, 0, 0) + val(1, 0, 0) + val(2, 0, 0));
    arrive(sh, 1, 3);
    if (env.rank == 2) {
      std::this_thread::sleep_for(std::chrono::seconds(30));  // killed before
      return;
    }
    if (env.rank == 1) {
      sh->more[2].store(1);
      EXPECT_THROW(allreduce(1), PeerFailure);
      if (!early) {
        // A reconciliation with a new data plane (this rank's plane failed); slot 0's agent
        // takes part in its barrier while slot 0 calls nothing.
        EXPECT_NE(c->syncAfterFailure().status, SyncStatus::kRejected);
        EXPECT_GT(c->epoch(), 1u);
      }
      sh->more[4].store(1);
    } else {
      ASSERT_TRUE(waitFor([&] { return sh->more[3].load() > 0; }, 30));
      ASSERT_TRUE(waitFor([&] { return c->peerState({2})[0] == 0; }, 30));
      if (early) {
        EXPECT_THROW(allreduce(1), PeerFailure) << "op 1 with slot 2 dead";
      }
      ASSERT_TRUE(waitFor([&] { return sh->more[4].load() > 0; }, 30));
      if (!early) {
        ASSERT_TRUE(waitFor([&] { return c->epoch() > 1; }, 30));
      }
    }
    ProposalResult r = c->deactivateRanks({2});
    EXPECT_NE(r.status, ProposalStatus::kRejected) << r.reject_reason;
    ASSERT_EQ(c->activeMask()[2], 0);
    if (env.rank == 0 && !early) {
      try {
        allreduce(1);
        ADD_FAILURE() << "slot 0's op 1 ran, but slot 1 ran op 1 two views ago";
      } catch (const PeerFailure& f) {
        EXPECT_NE(std::string(f.what()).find("did not run"), std::string::npos) << f.what();
      }
    }
    for (int64_t salt : {2, 3}) {
      got = allreduce(salt);
      EXPECT_EQ(got[0], val(0, 0, salt) + val(1, 0, salt)) << "op " << salt;
      EXPECT_EQ(got[n - 1], val(0, n - 1, salt) + val(1, n - 1, salt)) << "op " << salt;
    }
  });
  EXPECT_EQ(codes[2], 128 + SIGKILL);
  for (int r : {0, 1}) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Entry, PgElasticNumbering, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "early" : "late");
                         });

TEST(PgElasticOptions, InvalidCombinationsRejectedAtCreation) {
  RunOptions o = options("shm", 1);
  auto codes = runRanks(o, [&](RankEnv& env) {
    try {
      elasticComm(env, 0, 1, 1, false, Mode{false, true});
      ADD_FAILURE() << "auto_sync without auto_deactivate was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "auto_sync_on_failure requires auto_deactivate_on_failure"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(elasticComm(env, 0, 2, 1, false), std::invalid_argument) << "max < size";
    auto c = elasticComm(env, 0, 1, 1, false);
    EXPECT_THROW(c->activateRanks({1}), std::invalid_argument);
    EXPECT_THROW(c->peerState({-1}), std::invalid_argument);
    EXPECT_THROW(c->joinGroup(), std::logic_error) << "an active rank cannot join";
  });
  EXPECT_EQ(codes[0], 0);
}

// World 8 (processes): three ranks deactivated at once (size drops to 7, holes at 2 and 5),
// collectives over the five left, the three rejoin in place, then all eight again.
TEST(PgElasticWorld8, MembershipChanges) {
  RunOptions o = options("shm", 8);
  o.deadline_s = 180;
  auto codes = runRanks(o, [&](RankEnv& env) {
    Shared* sh = env.shared;
    auto c = elasticComm(env, env.rank, 8, 8, false);
    checkCollectives(*c, 1, 64);
    arrive(sh, 0, 8);
    if (env.rank == 3) {
      ProposalResult r = c->deactivateRanks({2, 5, 7});
      EXPECT_EQ(r.status, ProposalStatus::kApplied) << r.reject_reason;
    }
    ASSERT_TRUE(waitFor([&] { return c->activeMask()[7] == 0; }, 20));
    const bool out = env.rank == 2 || env.rank == 5 || env.rank == 7;
    if (!out) {
      EXPECT_EQ(c->size(), 7);
      EXPECT_EQ(activeSlots(*c), (std::vector<int>{0, 1, 3, 4, 6}));
      checkCollectives(*c, 2, 64);
    }
    arrive(sh, 1, 8);
    if (out) {
      c->joinGroup();
    } else if (env.rank == 0) {
      ASSERT_TRUE(waitFor([&] { return c->numSyncedRanks() == 8; }, 30)) << c->numSyncedRanks();
      EXPECT_EQ(c->activateRanks({2, 5, 7}).status, ProposalStatus::kApplied);
    }
    ASSERT_TRUE(waitFor([&] { return c->activeMask()[7] == 1; }, 30));
    EXPECT_EQ(c->size(), 8);
    checkCollectives(*c, 3, 64);
  });
  for (int r = 0; r < 8; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace mooncake::pg::test
