// send/recv over shm and tcp: a ring at every size, tags matched out of order (eager
// delivery), any-source receives, concurrent senders and receivers on several threads,
// self-sends, and a size mismatch that names both sizes.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "tests/pg/pg_harness.h"
#include "tests/pg/pg_reference.h"

namespace mooncake::pg::test {
namespace {

class PgP2p : public ::testing::TestWithParam<std::string> {};

TEST_P(PgP2p, RingTagsAnySourceThreads) {
  RunOptions o;
  o.world = 3;
  useTransport(o, GetParam());
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
    // Ring at every size: send first, then receive (eager sends never wait for the recv).
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, (size_t{1} << 20) + 3}) {
      std::vector<float> out(count), in(count + 1, -1.0f), want(count);
      fill(DataType::kFloat32, out.data(), count, me, 7);
      fill(DataType::kFloat32, want.data(), count, prev, 7);
      c.send(out.data(), count * 4, next, 100 + count);
      EXPECT_EQ(c.recv(in.data(), count * 4, prev, 100 + count), prev);
      EXPECT_EQ(firstDiff(in.data(), want.data(), count, 4), -1) << "ring count=" << count;
    }
    // Tags out of order: rank 0 sends tag 2 then tag 1; rank 1 takes tag 1 first.
    if (me == 0) {
      int a = 2, b = 1;
      c.send(&a, 4, 1, 2);
      c.send(&b, 4, 1, 1);
    } else if (me == 1) {
      int x = 0, y = 0;
      c.recv(&x, 4, 0, 1);
      c.recv(&y, 4, 0, 2);
      EXPECT_EQ(x, 1);
      EXPECT_EQ(y, 2);
    }
    // One tag, large, large, small: taken in sending order. With tcp_onesided_large the
    // second large message waits at the sender for the receiver's only slot while the small
    // one leaves two-sided at once: the receiver puts them back in order.
    if (me == 0) {
      std::vector<char> big1(100000, 'a'), big2(100000, 'b');
      char small = 'c';
      c.send(big1.data(), big1.size(), 1, 42);
      c.send(big2.data(), big2.size(), 1, 42);
      c.send(&small, 1, 1, 42);
    } else if (me == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // all three sent first
      std::vector<char> r1(100000), r2(100000);
      char r3 = 0;
      c.recv(r1.data(), r1.size(), 0, 42);
      c.recv(r2.data(), r2.size(), 0, 42);
      c.recv(&r3, 1, 0, 42);
      EXPECT_EQ(r1[99999], 'a');
      EXPECT_EQ(r2[0], 'b');
      EXPECT_EQ(r3, 'c');
    }
    // Any source: everyone else sends its rank to rank 0.
    if (me == 0) {
      std::set<int> seen;
      for (int k = 1; k < n; ++k) {
        int v = -1;
        int src = c.recv(&v, 4, -1, 9);
        EXPECT_EQ(v, src);
        seen.insert(src);
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(n - 1));
    } else {
      c.send(&me, 4, 0, 9);
    }
    // Self send.
    double d = 3.5, e = 0;
    c.send(&d, 8, me, 77);
    EXPECT_EQ(c.recv(&e, 8, me, 77), me);
    EXPECT_EQ(e, 3.5);
    // Several threads sending and receiving at once, both directions, while the worker
    // runs collectives.
    const size_t big = 300000;
    std::vector<std::vector<int>> got(n, std::vector<int>(big));
    std::vector<std::thread> threads;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      threads.emplace_back([&, j] {
        std::vector<int> v(big, me * 1000 + j);
        c.send(v.data(), big * 4, j, 555);
      });
      threads.emplace_back([&, j] { c.recv(got[j].data(), big * 4, j, 555); });
    }
    auto w = c.enqueue("allreduce", [&c] {
      float v = 1, s = 0;
      c.allReduce(&v, &s, 1, DataType::kFloat32, ReduceOp::kSum);
      if (s != static_cast<float>(c.size())) throw std::runtime_error("bad allreduce");
    });
    for (auto& t : threads) t.join();
    EXPECT_TRUE(w->wait(std::chrono::seconds(30)));
    for (int j = 0; j < n; ++j) {
      if (j != me) {
        EXPECT_EQ(got[j][big - 1], j * 1000 + me) << "from " << j;
      }
    }
    c.barrier();
    if (GetParam().rfind("tcp_onesided", 0) == 0) {
      EXPECT_GT(c.netSlotSends(), 0u);
    } else {
      EXPECT_EQ(c.netSlotSends(), 0u);
    }
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST_P(PgP2p, SizeMismatchNamesBothSizes) {
  RunOptions o;
  o.world = 2;
  useTransport(o, GetParam());
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    if (c.rank() == 0) {
      uint64_t v = 42;
      c.send(&v, 8, 1, 3);
    } else {
      char buf[16];
      try {
        c.recv(buf, 16, 0, 3);
        ADD_FAILURE() << "recv of a wrong size did not throw";
      } catch (const CommError& e) {
        std::string w = e.what();
        EXPECT_NE(w.find("8 bytes"), std::string::npos) << w;
        EXPECT_NE(w.find("16 bytes"), std::string::npos) << w;
        EXPECT_EQ(e.peerRank(), 0);
      }
    }
    EXPECT_THROW(c.send(nullptr, 0, 5, 0), std::invalid_argument);
    c.barrier();
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, PgP2p, ::testing::Values("shm", "tcp", "tcp_onesided",
                                                                 "tcp_onesided_large"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace mooncake::pg::test
