// Low-latency dispatch/combine with real rank processes: results against the reference,
// edge cases, two rounds in flight, validation, the remote (engine WRITE) path, ranks
// killed between rounds and between dispatch and combine, and a stopped rank's late WRITEs.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "tests/ep/ep_harness.h"

namespace mooncake::ep::test {
namespace {

constexpr int64_t kTimeoutUs = 20 * 1000 * 1000;

class LowLatency : public ::testing::TestWithParam<int> {};

// Two rounds, bf16 then fp32, both in flight at once; T differs per rank and is 0 on one.
// transport "": same host, buffers mapped; "tcp": every peer through engine WRITEs, signals
// through the mailboxes and notifications of both halves.
void twoRoundsInFlight(int world, const std::string& transport) {
  RunOptions o;
  o.world = world;
  o.transport = transport;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    Case a;
    a.world = world;
    a.experts = 4 * world;
    a.max_tokens = 24;
    a.hidden = 96;
    a.topk = 3;
    a.seed = 11;
    for (int r = 0; r < world; ++r) a.tokens.push_back(r == 1 ? 0 : 24 - 5 * r);
    Case b = a;
    b.dtype = DType::kFloat32;
    b.hidden = 72;  // rows not a multiple of the 64-byte stride
    b.seed = 12;
    b.tokens.clear();
    auto buf = makeBuffer(env, sizeHint(24, 96, world, 4 * world));
    std::vector<int32_t> act_a(world, 1), act_b(world, 1);
    LlRound ra(a, env.rank, &act_a, kTimeoutUs), rb(b, env.rank, &act_b, kTimeoutUs);
    ra.dispatchSend(*buf);
    rb.dispatchSend(*buf);
    ra.dispatchRecv(*buf);
    rb.dispatchRecv(*buf);
    ra.checkDispatch(env.rank);
    rb.checkDispatch(env.rank);
    ra.computeY(env.rank);
    rb.computeY(env.rank);
    ra.combineSend(*buf);
    rb.combineSend(*buf);
    ra.combineRecv(*buf);
    rb.combineRecv(*buf);
    ra.checkCombine(env.rank);
    rb.checkCombine(env.rank);
    EXPECT_EQ(act_a, std::vector<int32_t>(world, 1));
    // And a third and fourth round, sequential, reusing both halves.
    for (int round = 0; round < 2; ++round) {
      Case c = round == 0 ? a : b;
      c.seed += 100;
      std::vector<int32_t> act(world, 1);
      LlRound rc(c, env.rank, &act, kTimeoutUs);
      rc.dispatchSend(*buf);
      rc.dispatchRecv(*buf);
      rc.checkDispatch(env.rank);
      rc.computeY(env.rank);
      rc.combineSend(*buf);
      rc.combineRecv(*buf);
      rc.checkCombine(env.rank);
    }
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(buf->isMapped(r), transport.empty() || r == env.rank) << "rank " << r;
  });
  expectAllOk(codes);
}

TEST_P(LowLatency, TwoRoundsInFlight) { twoRoundsInFlight(GetParam(), ""); }

// Every token of every rank to expert 0: rank 0 receives the capacity bound R*M rows.
TEST_P(LowLatency, AllTokensToOneExpert) {
  const int world = GetParam();
  RunOptions o;
  o.world = world;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    Case c;
    c.world = world;
    c.experts = 2 * world;
    c.max_tokens = 16;
    c.hidden = 64;
    c.topk = 2;
    c.all_to_expert0 = true;
    c.tokens.assign(world, 16);
    auto buf = makeBuffer(env, sizeHint(16, 64, world, 2 * world));
    std::vector<int32_t> act(world, 1);
    LlRound r(c, env.rank, &act, kTimeoutUs);
    r.dispatchSend(*buf);
    r.dispatchRecv(*buf);
    r.checkDispatch(env.rank);
    if (env.rank == 0) {
      EXPECT_EQ(r.recv_count[0], world * 16);
    }
    r.computeY(env.rank);
    r.combineSend(*buf);
    r.combineRecv(*buf);
    r.checkCombine(env.rank);
  });
  expectAllOk(codes);
}

INSTANTIATE_TEST_SUITE_P(World, LowLatency, ::testing::Values(2, 3, 4),
                         [](const auto& i) { return "R" + std::to_string(i.param); });

// Bad arguments are refused on every rank before anything is sent; a good round follows.
TEST(LowLatencyValidation, RefusedBeforeSending) {
  RunOptions o;
  o.world = 2;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    Case c;
    c.world = 2;
    c.experts = 4;
    c.max_tokens = 8;
    c.hidden = 32;
    c.topk = 2;
    auto buf = makeBuffer(env, sizeHint(8, 32, 2, 4));
    std::vector<int32_t> act(2, 1);
    auto expect_invalid = [&](auto mutate, const char* what) {
      LlRound r(c, env.rank, &act, kTimeoutUs);
      mutate(r);
      EXPECT_THROW(r.dispatchSend(*buf), std::invalid_argument) << what;
    };
    expect_invalid([](LlRound& r) { r.d.tokens = 9; }, "T > M");
    expect_invalid([](LlRound& r) { r.in.topk[0] = 4; }, "expert out of range");
    expect_invalid([](LlRound& r) { r.in.topk[0] = -2; }, "negative expert");
    expect_invalid([](LlRound& r) { r.in.topk[0] = 1, r.in.topk[1] = 1; }, "duplicate");
    expect_invalid([](LlRound& r) { r.d.experts = 3; }, "E not divisible by R");
    expect_invalid([](LlRound& r) { r.d.max_tokens = 1 << 20; }, "buffer too small");
    try {
      LlRound r(c, env.rank, &act, kTimeoutUs);
      r.in.topk[2] = r.in.topk[3] = 3;
      r.dispatchSend(*buf);
      ADD_FAILURE() << "duplicate accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("twice"), std::string::npos) << e.what();
    }
    LlRound r(c, env.rank, &act, kTimeoutUs);
    r.dispatchSend(*buf);
    r.dispatchRecv(*buf);
    r.checkDispatch(env.rank);
    EXPECT_THROW(
        {
          LowLatencyCombineArgs bad = r.cb;
          bad.tokens = c.max_tokens + 1;
          buf->validate(bad);
        },
        std::invalid_argument);
    r.computeY(env.rank);
    r.combineSend(*buf);
    r.combineRecv(*buf);
    r.checkCombine(env.rank);
  });
  expectAllOk(codes);
}

// The remote path: engine WRITEs plus signal messages (tcp forced, nothing mapped).
TEST(LowLatencyRemote, TwoRoundsInFlightOverTcp) { twoRoundsInFlight(3, "tcp"); }

TEST(LowLatencyRemote, OverTcp) {
  RunOptions o;
  o.world = 3;
  o.transport = "tcp";
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    Case c;
    c.world = 3;
    c.experts = 6;
    c.max_tokens = 12;
    c.hidden = 80;
    c.topk = 3;
    auto buf = makeBuffer(env, sizeHint(12, 80, 3, 6));
    for (int r = 0; r < 3; ++r) EXPECT_EQ(buf->isMapped(r), r == env.rank);
    for (int round = 0; round < 3; ++round) {
      c.seed = 40 + round;
      c.dtype = round == 1 ? DType::kFloat32 : DType::kBFloat16;
      std::vector<int32_t> act(3, 1);
      LlRound r(c, env.rank, &act, kTimeoutUs);
      r.dispatchSend(*buf);
      r.dispatchRecv(*buf);
      r.checkDispatch(env.rank);
      r.computeY(env.rank);
      r.combineSend(*buf);
      r.combineRecv(*buf);
      r.checkCombine(env.rank);
      EXPECT_EQ(act, std::vector<int32_t>(3, 1));
    }
  });
  expectAllOk(codes);
}

// ---- failures ----

struct KillCase {
  int world;
  std::string transport;
};
void PrintTo(const KillCase& k, std::ostream* os) {
  *os << "world " << k.world << " transport '" << k.transport << "'";
}

class LowLatencyKill : public ::testing::TestWithParam<KillCase> {};

Case killCase(int world, uint64_t seed) {
  Case c;
  c.world = world;
  c.experts = 2 * world;
  c.max_tokens = 16;
  c.hidden = 64;
  c.topk = 3;
  c.seed = seed;
  return c;
}

// The last rank dies after round 1; survivors' round 2 marks it inactive, excludes its
// tokens and experts and reads nothing stale.
TEST_P(LowLatencyKill, BetweenRounds) {
  const int world = GetParam().world;
  const int victim = world - 1;
  RunOptions o;
  o.world = world;
  o.transport = GetParam().transport;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    auto buf = makeBuffer(env, sizeHint(16, 64, world, 2 * world));
    std::vector<int32_t> act(world, 1);
    {
      LlRound r(killCase(world, 5), env.rank, &act, kTimeoutUs);
      r.dispatchSend(*buf);
      r.dispatchRecv(*buf);
      r.checkDispatch(env.rank);
      r.computeY(env.rank);
      r.combineSend(*buf);
      r.combineRecv(*buf);
      r.checkCombine(env.rank);
    }
    if (env.rank == victim) raise(SIGKILL);
    LlRound r(killCase(world, 6), env.rank, &act, 3 * 1000 * 1000);
    auto t0 = std::chrono::steady_clock::now();
    r.dispatchSend(*buf);
    r.dispatchRecv(*buf);
    EXPECT_EQ(act[victim], 0);
    for (int i = 0; i < victim; ++i) EXPECT_EQ(act[i], 1) << "rank " << i;
    r.checkDispatch(env.rank);
    r.computeY(env.rank);
    r.combineSend(*buf);
    r.combineRecv(*buf);
    r.checkCombine(env.rank);
    auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    EXPECT_LT(ms, 3500) << "detection must be bounded by timeout_us";
  });
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(codes[r], r == victim ? 128 + SIGKILL : 0) << "rank " << r;
}

// Rank 1 dies after dispatch: survivors' combine skips its experts and marks it inactive.
TEST_P(LowLatencyKill, BetweenDispatchAndCombine) {
  const int world = GetParam().world;
  const int victim = 1;
  RunOptions o;
  o.world = world;
  o.transport = GetParam().transport;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    auto buf = makeBuffer(env, sizeHint(16, 64, world, 2 * world));
    std::vector<int32_t> act(world, 1);
    LlRound r(killCase(world, 7), env.rank, &act, 3 * 1000 * 1000);
    r.dispatchSend(*buf);
    r.dispatchRecv(*buf);
    r.checkDispatch(env.rank);
    // The victim dies once every rank has its dispatch results.
    env.shared->values[0].fetch_add(1);
    if (env.rank == victim) {
      while (env.shared->values[0].load() < world) usleep(100);
      raise(SIGKILL);
    }
    r.computeY(env.rank);
    r.combineSend(*buf);
    r.combineRecv(*buf);
    EXPECT_EQ(act[victim], 0);
    r.checkCombine(env.rank);  // the reference uses act: the victim's experts count 0
    // A later round keeps working without it.
    std::vector<int32_t> act2 = act;
    LlRound r2(killCase(world, 8), env.rank, &act2, 3 * 1000 * 1000);
    r2.dispatchSend(*buf);
    r2.dispatchRecv(*buf);
    r2.checkDispatch(env.rank);
    r2.computeY(env.rank);
    r2.combineSend(*buf);
    r2.combineRecv(*buf);
    r2.checkCombine(env.rank);
  });
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(codes[r], r == victim ? 128 + SIGKILL : 0) << "rank " << r;
}

// The stall tests' dispatch on 2 ranks: every one of x's T rows of H bf16 values to rank 1's
// expert (32 MiB at 4096 x 4096); x's memory is owned by `owner`, handed over as `inputs`.
struct AllToRankOne {
  std::vector<int64_t> topk;
  std::vector<int32_t> act{1, 1}, count = std::vector<int32_t>(1), src;
  std::vector<int64_t> layout = std::vector<int64_t>(2);
  std::vector<char> recv_x;
  LowLatencyDispatchArgs d;
  AllToRankOne(const void* x, std::shared_ptr<void> owner, int64_t T, int64_t H)
      : topk(T, 1), src(2 * T), recv_x(2 * T * H * 2) {
    d.x = x;
    d.inputs = std::move(owner);
    d.tokens = T;
    d.hidden = H;
    d.topk_idx = topk.data();
    d.topk = 1;
    d.active_ranks = act.data();
    d.max_tokens = T;
    d.experts = 2;
    d.timeout_us = 400 * 1000;
    d.recv_x = recv_x.data();
    d.recv_count = count.data();
    d.src_info = src.data();
    d.layout_range = layout.data();
  }
};

// Rank 1 is stopped (SIGSTOP) while rank 0 dispatches 32 MiB of rows to it over tcp: rank
// 0's send gives up at MC_EP_TIMEOUT_MS and marks rank 1 inactive while its WRITEs still run.
// x's owner, handed over as `inputs`, stays alive until they finished (after rank 1 resumed),
// then unmaps x (a send that dropped it at once failed here: `dropped` while rank 1 stopped).
TEST(LowLatencyStall, TimedOutSendKeepsItsInputsUntilTheWritesFinished) {
  constexpr int64_t kT = 4096, kH = 4096;  // every row to rank 1's expert: 32 MiB
  static constexpr size_t kBytes = kT * kH * 2;
  RunOptions o;
  o.world = 2;
  o.transport = "tcp";
  o.env = {{"MC_EP_TIMEOUT_MS", "400"}};
  o.parent = [](const std::vector<pid_t>& pids, pg::test::Shared* sh) {
    auto until = [&](int i, int v) {
      for (int n = 0; n < 60000 && sh->values[i].load() < v; ++n) usleep(1000);
    };
    until(0, 2);  // both buffers made
    kill(pids[1], SIGSTOP);
    sh->values[1].store(1);
    until(2, 1);  // rank 0 gave up and dropped its x
    usleep(300 * 1000);
    kill(pids[1], SIGCONT);
  };
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    auto buf = makeBuffer(env, sizeHint(kT, kH, 2, 2));
    env.shared->values[0].fetch_add(1);
    if (env.rank == 1) {  // stopped by the parent meanwhile; leaves when rank 0 is done
      while (env.shared->values[3].load() == 0) usleep(1000);
      return;
    }
    while (env.shared->values[1].load() == 0) usleep(1000);
    void* x = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(x, MAP_FAILED);
    std::memset(x, 0x3c, kBytes);
    auto dropped = std::make_shared<std::atomic<bool>>(false);
    std::shared_ptr<void> owner(x, [dropped](void* p) {
      dropped->store(true);
      munmap(p, kBytes);
    });
    AllToRankOne a(x, std::move(owner), kT, kH);
    LowLatencyDispatchArgs& d = a.d;
    std::vector<int32_t>& act = a.act;
    std::vector<int32_t>& count = a.count;
    buf->validate(d);
    const uint32_t round = buf->nextDispatchRound();
    auto t0 = std::chrono::steady_clock::now();
    buf->dispatchSend(d, round);
    EXPECT_EQ(act[1], 0) << "rank 1 was stopped: its writes cannot have finished";
    d.inputs.reset();
    EXPECT_FALSE(dropped->load()) << "x dropped while the engine may still read it";
    buf->dispatchRecv(d, round);
    EXPECT_EQ(count[0], 0);
    env.shared->values[2].store(1);
    while (!dropped->load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
      usleep(1000);
    EXPECT_TRUE(dropped->load()) << "x was never released after rank 1 resumed";
    env.shared->values[3].store(1);
  });
  expectAllOk(codes);
}

// As above, rank 0's send gives up on rank 1 (stopped) while its 32 MiB of WRITEs still run.
// Then both build a new buffer (what update_ep_member does): rank 0's set-up waits for those
// writes (engine settle, MC_EP_TIMEOUT_MS at most) and, rank 1 being still stopped, every
// rank's set-up fails naming rank 0's late writes to rank 1 (a late WRITE could land in the
// new buffer, whose rounds start over). Once they finished, a second set-up succeeds and a
// round on the new buffers is exact.
TEST(LowLatencyStall, NewBufferWaitsForTheOldOnesLateWrites) {
  constexpr int64_t kT = 4096, kH = 4096;  // every row to rank 1's expert: 32 MiB
  RunOptions o;
  o.world = 2;
  o.transport = "tcp";
  o.env = {{"MC_EP_TIMEOUT_MS", "400"}};
  o.parent = [](const std::vector<pid_t>& pids, pg::test::Shared* sh) {
    auto until = [&](int i, int v) {
      for (int n = 0; n < 60000 && sh->values[i].load() < v; ++n) usleep(1000);
    };
    until(0, 2);  // both buffers made
    kill(pids[1], SIGSTOP);
    sh->values[1].store(1);
    until(2, 1);  // rank 0 is in its second set-up: its settle (400 ms) ends while rank 1 is stopped
    usleep(3000 * 1000);
    sh->values[4].store(1);
    kill(pids[1], SIGCONT);
  };
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    std::shared_ptr<pg::Communicator> comm(std::move(env.comm));
    auto buf = EpBuffer::create(groupOf(comm), sizeHint(kT, kH, 2, 2));
    env.shared->values[0].fetch_add(1);
    auto dropped = std::make_shared<std::atomic<bool>>(false);
    if (env.rank == 1) {
      while (env.shared->values[4].load() == 0) usleep(1000);  // (stopped meanwhile)
    } else {
      while (env.shared->values[1].load() == 0) usleep(1000);
      auto x = std::make_shared<std::vector<char>>(kT * kH * 2, 0x3c);
      std::shared_ptr<void> owner(x.get(), [x, dropped](void*) { dropped->store(true); });
      AllToRankOne a(x->data(), std::move(owner), kT, kH);
      x.reset();
      LowLatencyDispatchArgs& d = a.d;
      buf->validate(d);
      const uint32_t round = buf->nextDispatchRound();
      buf->dispatchSend(d, round);
      ASSERT_EQ(a.act[1], 0) << "rank 1 was stopped: its writes cannot have finished";
      d.inputs.reset();
      ASSERT_FALSE(dropped->load()) << "the test needs writes still running";
      buf->dispatchRecv(d, round);
    }
    buf.reset();
    if (env.rank == 0) env.shared->values[2].store(1);
    const Case c = killCase(2, 9);
    const size_t small = sizeHint(c.max_tokens, c.hidden, 2, c.experts);
    std::string err;
    try {
      buf = EpBuffer::create(groupOf(comm), small);
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
    EXPECT_NE(err.find("rank 0's writes to rank 1"), std::string::npos)
        << "rank " << env.rank << ": " << (buf ? "the set-up succeeded" : err);
    EXPECT_NE(err.find("MC_EP_TIMEOUT_MS"), std::string::npos) << err;
    buf.reset();
    if (env.rank == 0) {  // (the late batch finished, then its inputs go)
      auto t0 = std::chrono::steady_clock::now();
      while (!dropped->load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
        usleep(1000);
      ASSERT_TRUE(dropped->load()) << "the late writes never finished after rank 1 resumed";
    }
    buf = EpBuffer::create(groupOf(comm), small);
    std::vector<int32_t> act{1, 1};
    LlRound r(c, env.rank, &act, 3 * 1000 * 1000);
    r.dispatchSend(*buf);
    r.dispatchRecv(*buf);
    r.checkDispatch(env.rank);
    r.computeY(env.rank);
    r.combineSend(*buf);
    r.combineRecv(*buf);
    r.checkCombine(env.rank);
    EXPECT_EQ(act, (std::vector<int32_t>{1, 1}));
  });
  expectAllOk(codes);
}

INSTANTIATE_TEST_SUITE_P(Cases, LowLatencyKill,
                         ::testing::Values(KillCase{3, ""}, KillCase{4, ""}, KillCase{3, "tcp"}),
                         [](const auto& i) {
                           return "R" + std::to_string(i.param.world) +
                                  (i.param.transport.empty() ? "" : "_" + i.param.transport);
                         });

}  // namespace
}  // namespace mooncake::ep::test
