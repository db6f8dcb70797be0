// Every collective, world sizes 1..4, over shared memory and over tcp (MC_TRANSPORT=tcp),
// sizes {0, 1, 7, 1000, 2^20+3} elements, against a reference computed in the test from
// the inputs every rank can regenerate (bit-exact: the group folds in rank order).
// One set of rank processes per (transport, world size) runs the whole list.
#include <gtest/gtest.h>

#include <numeric>

#include "tests/pg/pg_harness.h"
#include "tests/pg/pg_reference.h"

namespace mooncake::pg::test {
namespace {

const size_t kSizes[] = {0, 1, 7, 1000, (1u << 20) + 3};
constexpr size_t kBig = (1u << 20) + 3;

using Buf = std::vector<char>;

Buf make(DataType t, size_t count, int rank, uint32_t salt) {
  Buf b(count * dtypeSize(t) + 1);
  fill(t, b.data(), count, rank, salt);
  return b;
}

#define MC_CTX(what) \
  (what) << " " << dtypeName(t) << " count=" << count << " rank=" << c.rank() << "/" << c.size()

void allReduceCase(Communicator& c, DataType t, ReduceOp op, size_t count, bool in_place) {
  const int n = c.size();
  std::vector<Buf> ins;
  std::vector<const void*> ptrs;
  for (int r = 0; r < n; ++r) ins.push_back(make(t, count, r, 1));
  for (auto& b : ins) ptrs.push_back(b.data());
  Buf want(count * dtypeSize(t) + 1);
  refReduce(t, op, ptrs, count, want.data());
  Buf in = ins[c.rank()], out(in.size(), 0x5a);
  c.allReduce(in.data(), in_place ? in.data() : out.data(), count, t, op);
  const Buf& got = in_place ? in : out;
  EXPECT_EQ(firstDiff(got.data(), want.data(), count, dtypeSize(t)), -1)
      << MC_CTX(std::string("allreduce")) << " " << reduceOpName(op) << (in_place ? " in place" : "");
}

void reduceCase(Communicator& c, DataType t, ReduceOp op, size_t count, int root) {
  const int n = c.size();
  std::vector<Buf> ins;
  std::vector<const void*> ptrs;
  for (int r = 0; r < n; ++r) ins.push_back(make(t, count, r, 2));
  for (auto& b : ins) ptrs.push_back(b.data());
  Buf out(count * dtypeSize(t) + 1, 0x5a);
  c.reduce(ins[c.rank()].data(), c.rank() == root ? out.data() : nullptr, count, t, op, root);
  if (c.rank() != root) return;
  Buf want(out.size());
  refReduce(t, op, ptrs, count, want.data());
  EXPECT_EQ(firstDiff(out.data(), want.data(), count, dtypeSize(t)), -1)
      << MC_CTX(std::string("reduce")) << " root=" << root;
}

void broadcastCase(Communicator& c, DataType t, size_t count, int root) {
  Buf want = make(t, count, root, 3);
  Buf buf = c.rank() == root ? want : Buf(want.size(), 0x11);
  c.broadcast(buf.data(), count * dtypeSize(t), root);
  EXPECT_EQ(firstDiff(buf.data(), want.data(), count, dtypeSize(t)), -1)
      << MC_CTX(std::string("broadcast")) << " root=" << root;
}

void allGatherCase(Communicator& c, DataType t, size_t count, bool uneven, int gather_root) {
  const int n = c.size();
  const size_t es = dtypeSize(t);
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = uneven ? count + static_cast<size_t>(r) * 3 : count;
  size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  Buf want;
  for (int r = 0; r < n; ++r) {
    Buf b = make(t, counts[r], r, 4);
    want.insert(want.end(), b.begin(), b.begin() + counts[r] * es);
  }
  Buf in = make(t, counts[c.rank()], c.rank(), 4), out(total * es + 1, 0x22);
  if (gather_root >= 0) {
    c.gather(in.data(), out.data(), count * es, gather_root);
    if (c.rank() != gather_root) return;
  } else if (uneven) {
    std::vector<size_t> bytes(n);
    for (int r = 0; r < n; ++r) bytes[r] = counts[r] * es;
    c.allGatherV(in.data(), out.data(), bytes);
  } else {
    c.allGather(in.data(), out.data(), count * es);
  }
  EXPECT_EQ(firstDiff(out.data(), want.data(), total, es), -1)
      << MC_CTX(std::string(gather_root >= 0 ? "gather" : uneven ? "allgatherv" : "allgather"));
}

void scatterCase(Communicator& c, DataType t, size_t count, int root) {
  const int n = c.size();
  const size_t es = dtypeSize(t);
  Buf all;
  for (int r = 0; r < n; ++r) {
    Buf b = make(t, count, r, 5);
    all.insert(all.end(), b.begin(), b.begin() + count * es);
  }
  all.push_back(0);
  Buf out(count * es + 1, 0x33);
  c.scatter(c.rank() == root ? all.data() : nullptr, out.data(), count * es, root);
  Buf want = make(t, count, c.rank(), 5);
  EXPECT_EQ(firstDiff(out.data(), want.data(), count, es), -1) << MC_CTX(std::string("scatter")) << " root=" << root;
}

void reduceScatterCase(Communicator& c, DataType t, ReduceOp op, size_t count) {
  const int n = c.size();
  const size_t es = dtypeSize(t);
  // Rank r's input: n blocks of `count`; its block j is make(t, count, r, 10 + j).
  std::vector<Buf> blocks_of_me(n);
  Buf in;
  for (int j = 0; j < n; ++j) {
    Buf b = make(t, count, c.rank(), 10 + j);
    in.insert(in.end(), b.begin(), b.begin() + count * es);
  }
  in.push_back(0);
  std::vector<Buf> contrib;
  std::vector<const void*> ptrs;
  for (int r = 0; r < n; ++r) contrib.push_back(make(t, count, r, 10 + c.rank()));
  for (auto& b : contrib) ptrs.push_back(b.data());
  Buf want(count * es + 1), out(count * es + 1, 0x44);
  refReduce(t, op, ptrs, count, want.data());
  c.reduceScatter(in.data(), out.data(), count, t, op);
  EXPECT_EQ(firstDiff(out.data(), want.data(), count, es), -1)
      << MC_CTX(std::string("reduce_scatter")) << " " << reduceOpName(op);
}

// Rank r sends count + 5r + 3j elements to rank j (or count when even).
void allToAllCase(Communicator& c, DataType t, size_t count, bool uneven) {
  const int n = c.size(), me = c.rank();
  const size_t es = dtypeSize(t);
  auto cnt = [&](int from, int to) {
    return uneven ? count + 5 * static_cast<size_t>(from) + 3 * static_cast<size_t>(to) : count;
  };
  std::vector<size_t> sb(n), so(n), rb(n), ro(n);
  Buf in, want;
  for (int j = 0; j < n; ++j) {
    so[j] = in.size();
    sb[j] = cnt(me, j) * es;
    Buf b = make(t, cnt(me, j), me * 16 + j, 6);
    in.insert(in.end(), b.begin(), b.begin() + sb[j]);
  }
  for (int r = 0; r < n; ++r) {
    ro[r] = want.size();
    rb[r] = cnt(r, me) * es;
    Buf b = make(t, cnt(r, me), r * 16 + me, 6);
    want.insert(want.end(), b.begin(), b.begin() + rb[r]);
  }
  in.push_back(0);
  Buf out(want.size() + 1, 0x55);
  c.allToAllV(in.data(), sb, so, out.data(), rb, ro);
  EXPECT_EQ(firstDiff(out.data(), want.data(), want.size(), 1), -1)
      << MC_CTX(std::string("alltoall")) << (uneven ? " uneven" : "");
}

void allCollectives(Communicator& c) {
  const int n = c.size();
  for (size_t count : kSizes) {
    allReduceCase(c, DataType::kFloat32, ReduceOp::kSum, count, false);
    allReduceCase(c, DataType::kFloat16, ReduceOp::kSum, count, false);
    allReduceCase(c, DataType::kBFloat16, ReduceOp::kSum, count, true);
    allReduceCase(c, DataType::kInt32, ReduceOp::kSum, count, false);
    if (count < kBig) {
      allReduceCase(c, DataType::kFloat32, ReduceOp::kSum, count, true);
      allReduceCase(c, DataType::kFloat32, ReduceOp::kAvg, count, false);
      allReduceCase(c, DataType::kFloat64, ReduceOp::kMax, count, false);
      allReduceCase(c, DataType::kFloat16, ReduceOp::kMin, count, false);
      allReduceCase(c, DataType::kInt64, ReduceOp::kProduct, count, false);
      allReduceCase(c, DataType::kUInt8, ReduceOp::kMin, count, false);
      allReduceCase(c, DataType::kInt8, ReduceOp::kBxor, count, false);
      allReduceCase(c, DataType::kInt16, ReduceOp::kAvg, count, false);
      allReduceCase(c, DataType::kBool, ReduceOp::kSum, count, false);
      allReduceCase(c, DataType::kBool, ReduceOp::kProduct, count, false);
      allReduceCase(c, DataType::kComplex64, ReduceOp::kSum, count, false);
    }
    reduceCase(c, DataType::kFloat32, ReduceOp::kSum, count, n - 1);
    if (count < kBig) reduceCase(c, DataType::kBFloat16, ReduceOp::kMax, count, 0);
    broadcastCase(c, DataType::kFloat32, count, 0);
    if (count < kBig) broadcastCase(c, DataType::kUInt8, count, n - 1);
    allGatherCase(c, DataType::kFloat32, count, false, -1);
    allGatherCase(c, DataType::kInt16, count, true, -1);
    allGatherCase(c, DataType::kFloat64, count, false, n / 2);
    scatterCase(c, DataType::kFloat32, count, n - 1);
    reduceScatterCase(c, DataType::kFloat32, ReduceOp::kSum, count);
    if (count < kBig) {
      reduceScatterCase(c, DataType::kFloat16, ReduceOp::kSum, count);
      reduceScatterCase(c, DataType::kInt32, ReduceOp::kMax, count);
    }
    allToAllCase(c, DataType::kFloat32, count, false);
    allToAllCase(c, DataType::kUInt8, count, true);
    c.barrier();
  }
}

struct Param {
  std::string transport;
  int world;
  int slots = -1;         // MC_PG_NET_SLOTS (-1: the default)
  std::string one_sided;  // MC_PG_NET_ONE_SIDED ("": the default, rdma peers only)
};

class PgCollectives : public ::testing::TestWithParam<Param> {};

TEST_P(PgCollectives, EveryOpEverySize) {
  RunOptions o;
  o.world = GetParam().world;
  o.transport = GetParam().transport;
  o.deadline_s = 120;
  // Over messages, small pieces: the 2^20+3-element cases of every dtype then span many
  // pieces with odd tails (the default 1 MiB pieces are covered by the other suites).
  // Over tcp the messages are two-sided by default; with MC_PG_NET_ONE_SIDED=all the large
  // ones go into receive slots (the path rdma peers take). One slot per sender makes most
  // messages wait for a credit.
  const int slots = GetParam().slots;
  const std::string& one_sided = GetParam().one_sided;
  if (o.transport == "tcp") o.env = {{"MC_PG_NET_PIECE_BYTES", "65536"}};
  if (slots >= 0) o.env.push_back({"MC_PG_NET_SLOTS", std::to_string(slots)});
  if (!one_sided.empty()) o.env.push_back({"MC_PG_NET_ONE_SIDED", one_sided});
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    // The path under test is the one asked for.
    for (int r = 0; r < c.size(); ++r) {
      if (r != c.rank()) {
        ASSERT_EQ(env.engine->peerTransport(c.peerOf(r)), o.transport == "tcp" ? "tcp" : "shm");
      }
    }
    allCollectives(c);
    // The large messages went one-sidedly into receive slots where asked for, else none.
    if (o.transport == "tcp" && slots != 0 && one_sided == "all") {
      ASSERT_GT(c.netSlotSends(), 0u);
    } else {
      ASSERT_EQ(c.netSlotSends(), 0u);
    }
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, PgCollectives,
                         ::testing::Values(Param{"shm", 1, -1, ""}, Param{"shm", 2, -1, ""},
                                           Param{"shm", 3, -1, ""}, Param{"shm", 4, -1, ""},
                                           Param{"tcp", 2, -1, ""}, Param{"tcp", 3, -1, ""},
                                           Param{"tcp", 4, -1, ""}, Param{"tcp", 2, -1, "all"},
                                           Param{"tcp", 3, -1, "all"}, Param{"tcp", 4, -1, "all"},
                                           Param{"tcp", 3, 1, "all"}, Param{"tcp", 2, 0, "all"}),
                         [](const ::testing::TestParamInfo<Param>& i) {
                           const Param& p = i.param;
                           return p.transport + std::to_string(p.world) +
                                  (p.one_sided.empty() ? "" : "_onesided_" + p.one_sided) +
                                  (p.slots >= 0 ? "_slots" + std::to_string(p.slots) : "");
                         });

// Small comm buffers force many pipeline steps (chunking, both halves, slots) on every path.
TEST(PgCollectivesSmallBuffer, ChunkedPaths) {
  RunOptions o;
  o.world = 3;
  o.buffer_bytes = 128 << 10;
  o.env = {{"MC_PG_CHUNK_BYTES", "8192"}, {"MC_PG_FLAT_BYTES", "256"}};
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    for (size_t count : {size_t{7}, size_t{1000}, size_t{100003}}) {
      allReduceCase(c, DataType::kFloat32, ReduceOp::kSum, count, false);
      allReduceCase(c, DataType::kBFloat16, ReduceOp::kAvg, count, true);
      reduceCase(c, DataType::kFloat32, ReduceOp::kMax, count, 1);
      broadcastCase(c, DataType::kFloat32, count, 2);
      allGatherCase(c, DataType::kFloat32, count, true, -1);
      scatterCase(c, DataType::kInt32, count, 0);
      reduceScatterCase(c, DataType::kFloat32, ReduceOp::kSum, count);
      allToAllCase(c, DataType::kFloat32, count, true);
    }
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Several communicators on one engine: the world and two subgroups of non-adjacent ranks.
TEST(PgSubgroups, ShareOneEngine) {
  RunOptions o;
  o.world = 4;
  auto codes = runRanks(o, [&](RankEnv& env) {
    std::vector<int> mine = env.rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    auto sub = env.subgroup(env.rank % 2 == 0 ? "even" : "odd", mine, std::chrono::seconds(30));
    ASSERT_EQ(sub->size(), 2);
    for (size_t count : {size_t{7}, size_t{100003}}) {
      allReduceCase(*sub, DataType::kFloat32, ReduceOp::kSum, count, false);
      allReduceCase(*env.comm, DataType::kFloat32, ReduceOp::kSum, count, false);
      allToAllCase(*sub, DataType::kFloat32, count, true);
    }
    // The subgroup's result is the sum over its own members only.
    float v = static_cast<float>(env.rank), out = 0;
    sub->allReduce(&v, &out, 1, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(out, env.rank % 2 == 0 ? 2.0f : 4.0f);
    env.comm->barrier();
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A group destroyed and created again under the same name on the same rendezvous (as a
// destroy_process_group + init_process_group does) gets fresh keys, not the old ones.
TEST(PgSubgroups, RecreateUnderTheSameName) {
  RunOptions o;
  o.world = 2;
  o.create_comm = false;
  auto codes = runRanks(o, [&](RankEnv& env) {
    for (int round = 0; round < 3; ++round) {
      auto c = env.subgroup("again", {0, 1}, std::chrono::seconds(30));
      float v = static_cast<float>(round + env.rank), s = 0;
      c->allReduce(&v, &s, 1, DataType::kFloat32, ReduceOp::kSum);
      EXPECT_EQ(s, static_cast<float>(2 * round + 1));
      c->barrier();
    }
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Ops enqueued on the worker run in order; several in flight complete with their results.
TEST(PgWork, AsyncOpsInFlight) {
  RunOptions o;
  o.world = 3;
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const int k = 6;
    const size_t count = 5000;
    std::vector<std::vector<float>> bufs(k, std::vector<float>(count));
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < k; ++i) {
      for (size_t e = 0; e < count; ++e) bufs[i][e] = static_cast<float>(i + c.rank() + e % 7);
      float* p = bufs[i].data();
      works.push_back(c.enqueue("allreduce", [&c, p, count] {
        c.allReduce(p, p, count, DataType::kFloat32, ReduceOp::kSum);
      }));
    }
    std::atomic<int> callbacks{0};
    for (auto& w : works) w->onComplete([&] { callbacks++; });
    for (int i = 0; i < k; ++i) {
      ASSERT_TRUE(works[i]->wait(std::chrono::seconds(30)));
      EXPECT_TRUE(works[i]->isSuccess());
      for (size_t e = 0; e < count; e += 999)
        ASSERT_EQ(bufs[i][e], static_cast<float>(3 * i + 3 + 3 * (e % 7))) << i << " " << e;
    }
    EXPECT_EQ(callbacks.load(), k);
    // An exception thrown by the op lands in its Work.
    auto bad = c.enqueue("bad", [] { throw std::invalid_argument("boom"); });
    EXPECT_THROW(bad->wait(std::chrono::seconds(5)), std::invalid_argument);
    EXPECT_TRUE(bad->isCompleted());
    EXPECT_FALSE(bad->isSuccess());
    // wait() returns false on timeout while the op is still running.
    std::promise<void> gate;
    auto fut = gate.get_future().share();
    auto slow = c.enqueue("slow", [fut] { fut.wait(); });
    EXPECT_FALSE(slow->wait(std::chrono::milliseconds(20)));
    gate.set_value();
    EXPECT_TRUE(slow->wait(std::chrono::seconds(5)));
    c.barrier();
  });
  for (int r = 0; r < o.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace mooncake::pg::test
