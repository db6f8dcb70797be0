// Mismatch detection: ranks that call different collectives, dtypes, element counts or roots
// get a CommError on EVERY rank, naming the op and both calls, within the group timeout,
// instead of wrong or zeroed data (the security issue's finding 8). Over shm (descriptor lines
// in the comm buffer's header) and tcp (message headers), 2 and 3 ranks, including the ranks
// that only send (a broadcast's root) and zero-byte calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "tests/pg/pg_harness.h"

namespace mooncake::pg::test {
namespace {

using Ms = std::chrono::milliseconds;

struct Case {
  const char* name;
  // The call rank r makes (its own shape).
  std::function<void(Communicator&, int rank)> call;
  // Substrings every rank's error must contain (both shapes).
  std::vector<std::string> both;
};

std::vector<Case> cases() {
  auto allreduce = [](size_t n, DataType t) {
    return [n, t](Communicator& c) {
      std::vector<char> buf(n * 8, 1);
      c.allReduce(buf.data(), buf.data(), n, t, ReduceOp::kSum);
    };
  };
  return {
      {"allreduce 10 vs 20 floats",
       [=](Communicator& c, int r) { allreduce(r == 1 ? 20 : 10, DataType::kFloat32)(c); },
       {"allreduce(float32 x 10, SUM)", "allreduce(float32 x 20, SUM)"}},
      {"allreduce float32 vs int32",
       [=](Communicator& c, int r) {
         allreduce(64, r == 1 ? DataType::kInt32 : DataType::kFloat32)(c);
       },
       {"float32 x 64", "int32 x 64"}},
      {"allreduce float32 vs float64",
       [=](Communicator& c, int r) {
         allreduce(64, r == 0 ? DataType::kFloat64 : DataType::kFloat32)(c);
       },
       {"float32 x 64", "float64 x 64"}},
      {"allreduce large vs small (two-phase vs flat)",
       [=](Communicator& c, int r) { allreduce(r == 1 ? (1 << 20) : 16, DataType::kFloat32)(c); },
       {"float32 x 16", "float32 x 1048576"}},
      {"broadcast 50 vs 100 bytes",
       [](Communicator& c, int r) {
         std::vector<char> buf(100, static_cast<char>(r));
         c.broadcast(buf.data(), r == 1 ? 100 : 50, 0);
       },
       {"broadcast(50 bytes, root 0)", "broadcast(100 bytes, root 0)"}},
      {"broadcast root 0 vs root 1",
       [](Communicator& c, int r) {
         std::vector<char> buf(64, static_cast<char>(r));
         c.broadcast(buf.data(), 64, r == 1 ? 1 : 0);
       },
       {"root 0", "root 1"}},
      {"broadcast 0 vs 100 bytes",
       [](Communicator& c, int r) {
         std::vector<char> buf(100, static_cast<char>(r));
         c.broadcast(buf.data(), r == 0 ? 0 : 100, 0);
       },
       {"broadcast(0 bytes, root 0)", "broadcast(100 bytes, root 0)"}},
      {"allgather 4 vs 6 bytes",
       [](Communicator& c, int r) {
         std::vector<char> in(6, 1), out(6 * c.size());
         c.allGather(in.data(), out.data(), r == 1 ? 6 : 4);
       },
       {"allgather(4 bytes)", "allgather(6 bytes)"}},
      {"allreduce vs broadcast",
       [=](Communicator& c, int r) {
         if (r == 1) {
           std::vector<char> buf(256, 0);
           c.broadcast(buf.data(), 256, 0);
         } else {
           allreduce(64, DataType::kFloat32)(c);
         }
       },
       {"allreduce(float32 x 64, SUM)", "broadcast(256 bytes, root 0)"}},
      {"reduce root 0 vs root 1",
       [](Communicator& c, int r) {
         std::vector<float> buf(32, 1.0f), out(32);
         c.reduce(buf.data(), out.data(), 32, DataType::kFloat32, ReduceOp::kSum, r == 1 ? 1 : 0);
       },
       {"root 0", "root 1"}},
  };
}

class PgMismatch : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(PgMismatch, EveryRankRaisesNamingBothCalls) {
  const auto [transport, world] = GetParam();
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.name);
    RunOptions o;
    o.world = world;
    useTransport(o, transport);
    o.comm_timeout = Ms(10000);
    o.deadline_s = 40;
    auto codes = runRanks(o, [&](RankEnv& env) {
      Communicator& c = *env.comm;
      c.barrier();
      int64_t t0 = monotonicNs();
      std::vector<float> x(4, 1.0f);
      std::string what;
      try {
        k.call(c, c.rank());
        // Only a rank whose call matched the one it exchanged data with (the root's) may
        // complete; the group is broken by then and its next op says why.
        try {
          c.allReduce(x.data(), x.data(), 4, DataType::kFloat32, ReduceOp::kSum);
          ADD_FAILURE() << "rank " << c.rank() << ": " << k.name << " and the next op passed";
        } catch (const CommError& e) {
          what = e.what();
        }
      } catch (const CommError& e) {
        what = e.what();
      }
      double s = (monotonicNs() - t0) / 1e9;
      EXPECT_LT(s, 5.0) << "rank " << c.rank() << " raised only after " << s << " s: " << what;
      for (const auto& sub : k.both)
        EXPECT_NE(what.find(sub), std::string::npos)
            << "rank " << c.rank() << "'s error does not name '" << sub << "': " << what;
      // The group is broken afterwards (the ranks may be out of step): later ops fail fast.
      EXPECT_THROW(c.allReduce(x.data(), x.data(), 4, DataType::kFloat32, ReduceOp::kSum),
                   CommError);
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Pg, PgMismatch,
                         ::testing::Combine(::testing::Values("shm", "tcp", "tcp_onesided"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Matching calls, including zero-byte ones and the patterns where a rank only sends, still
// work and agree (the checks add no false alarm).
TEST(PgAgreement, MatchingCallsPass) {
  for (const char* transport : {"shm", "tcp"}) {
    RunOptions o;
    o.world = 3;
    o.transport = transport;
    auto codes = runRanks(o, [&](RankEnv& env) {
      Communicator& c = *env.comm;
      for (int i = 0; i < 50; ++i) {
        std::vector<float> v(37, static_cast<float>(c.rank() + 1));
        c.broadcast(v.data(), 0, i % 3);
        c.broadcast(v.data(), v.size() * 4, i % 3);
        EXPECT_EQ(v[5], static_cast<float>(i % 3 + 1));
        std::vector<float> w(37, 1.0f), out(37, 0.0f);
        c.reduce(w.data(), out.data(), 37, DataType::kFloat32, ReduceOp::kSum, i % 3);
        if (c.rank() == i % 3) {
          EXPECT_EQ(out[0], 3.0f);
        }
        c.allReduce(w.data(), w.data(), 0, DataType::kFloat32, ReduceOp::kSum);
        std::vector<char> g(3 * 8, 0), mine(8, static_cast<char>(c.rank()));
        c.gather(mine.data(), g.data(), 8, (i + 1) % 3);
        if (c.rank() == (i + 1) % 3) {
          EXPECT_EQ(g[8 * 2], 2);
        }
        c.scatter(g.data(), mine.data(), 8, (i + 1) % 3);
        c.barrier();
      }
    });
    for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[r], 0) << transport << " rank " << r;
  }
}

// Communicator::reject: a rank that refused its own arguments of an op its peers called
// (the torch layer's argument checks) takes the op's number; the peers raise PeerRejected for
// it at once, naming that rank and why, and every rank realigns, so later ops pair and give
// the right results. 3 ranks: the refusal at the very first op, by the root of a broadcast,
// by two ranks and by every rank at once, two in a row, during a multi-step allreduce that the
// peers leave at different steps, and in a sub-group. On shared memory and on messages (tcp: two-sided, every message one-sided into
// receive slots, and large ones one-sided with one slot per sender, where a refused op's
// messages that the receiver drops must give their slot back for later ops to go on; there a
// rank that needs nothing from the refusing ones may complete the op instead of raising).
class PgReject : public ::testing::TestWithParam<std::string> {};

TEST_P(PgReject, PeersRaiseAndTheGroupStaysInStep) {
  RunOptions o;
  o.world = 3;
  useTransport(o, GetParam());
  o.comm_timeout = Ms(10000);
  o.deadline_s = 120;
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const int me = c.rank();
    // One op: `bad` ranks refuse it, the others call `kind` (rotating roots).
    auto op = [&](int i, int kind, const std::vector<int>& bad, Communicator& g, int gme,
                  int gsize) {
      const bool refuse = std::find(bad.begin(), bad.end(), gme) != bad.end();
      const std::string why = "arg " + std::to_string(i) + " of rank " + std::to_string(gme);
      int64_t t0 = monotonicNs();
      std::string what;
      try {
        if (refuse) {
          g.reject(kind == 0 ? "broadcast" : "allreduce", why);
          return;
        }
        const int root = i % gsize;
        std::vector<float> v(kind == 2 ? (1 << 20) + 17 : 64, static_cast<float>(gme + 1));
        if (kind == 0) g.broadcast(v.data(), v.size() * 4, root);
        if (kind == 1 || kind == 2)
          g.allReduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        if (kind == 3) {
          std::vector<float> all(v.size() * gsize);
          g.gather(v.data(), all.data(), v.size() * 4, root);
        }
        if (kind == 4) {
          std::vector<float> all(v.size() * gsize, static_cast<float>(gme + 1));
          g.scatter(all.data(), v.data(), v.size() * 4, root);
        }
        // On messages a rank that needs nothing from a refusing one (a non-root of a broadcast
        // or scatter whose root called it) may complete the op: then with the root's data.
        const bool root_refused = std::find(bad.begin(), bad.end(), root) != bad.end();
        if (GetParam() != "shm" && (kind == 0 || kind == 4) && gme != root && !root_refused) {
          EXPECT_EQ(v.front(), static_cast<float>(root + 1)) << "rank " << gme << ", op " << i;
          EXPECT_EQ(v.back(), static_cast<float>(root + 1)) << "rank " << gme << ", op " << i;
          return;
        }
        ADD_FAILURE() << "rank " << gme << ": op " << i << " (kind " << kind
                      << ") passed though a peer refused it";
      } catch (const PeerRejected& e) {
        what = e.what();
      }
      const double s = (monotonicNs() - t0) / 1e9;
      EXPECT_LT(s, 3.0) << "rank " << gme << " raised op " << i << " after " << s << " s";
      bool named = false;
      for (int b : bad)
        named |= what.find("rank " + std::to_string(b) + " gave ") != std::string::npos &&
                 what.find("arg " + std::to_string(i) + " of rank " + std::to_string(b)) !=
                     std::string::npos;
      EXPECT_TRUE(named) << "rank " << gme << ", op " << i << ": " << what;
    };
    // Every rank's next op works and pairs with the peers'.
    auto check = [&](Communicator& g, int gsize, int i) {
      std::vector<float> x(1000, 1.0f);
      g.allReduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      EXPECT_EQ(x[999], static_cast<float>(gsize)) << "after op " << i;
      std::vector<int32_t> y(33, g.rank() * 7);
      g.broadcast(y.data(), y.size() * 4, i % gsize);
      EXPECT_EQ(y[32], (i % gsize) * 7) << "after op " << i;
    };
    op(0, 0, {1}, c, me, 3);  // the very first op
    check(c, 3, 0);
    op(1, 0, {1}, c, me, 3);  // the root (1) refuses
    check(c, 3, 1);
    op(2, 1, {1, 2}, c, me, 3);  // two ranks
    check(c, 3, 2);
    op(3, 1, {0, 1, 2}, c, me, 3);  // every rank
    check(c, 3, 3);
    op(4, 1, {2}, c, me, 3);  // two in a row
    op(5, 4, {2}, c, me, 3);
    check(c, 3, 5);
    for (int i = 6; i < 36; ++i) {  // rotating ranks and ops, multi-step ones among them
      op(i, i % 5, {i % 3}, c, me, 3);
      if (i % 4 == 0) check(c, 3, i);
    }
    check(c, 3, 36);
    // A sub-group of ranks 0 and 2: rank 2 refuses there, then both groups work.
    if (me != 1) {
      auto sub = env.subgroup("rej", {0, 2}, Ms(10000));
      op(40, 1, {1}, *sub, sub->rank(), 2);
      check(*sub, 2, 40);
    }
    check(c, 3, 41);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Pg, PgReject,
                         ::testing::Values("shm", "tcp", "tcp_onesided", "tcp_onesided_large"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace mooncake::pg::test
