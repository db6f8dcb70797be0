// Collectives and point-to-point calls on GPU memory (pg/device_stage.h), over the device
// layer's simulation (MC_DEVICE=sim), whose device memory faults when host code touches it:
// every op runs once on host buffers and once on GPU buffers holding the same inputs, and the
// GPU results (copied back with the layer) must equal the host results byte for byte (the host
// path is checked against a reference in collectives_test.cc). Outputs start as a sentinel, so
// bytes an op must leave alone (all_to_all gaps, a reduce's non-root output) are checked too.
// Over shm (where allreduce and allgather move GPU memory in and out of the comm buffers
// themselves, no staging; also with GPU and host buffers mixed across ranks), tcp, tcp with
// one-sided messages, and a group spanning two simulated hosts.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "engine/device/device.h"
#include "pg/device_reduce.h"
#include "pg/profile.h"
#include "pg/reduce.h"
#include "tests/pg/pg_harness.h"
#include "tests/pg/pg_reference.h"

namespace mooncake::pg::test {
namespace {

using Buf = std::vector<char>;

// GPU memory of the process's (simulated) device layer, freed at the end of the scope.
class Gpu {
 public:
  explicit Gpu(size_t n, int ordinal) : n_(std::max<size_t>(n, 1)) {
    auto layer = engine::device::get();
    if (!layer.ok()) throw std::runtime_error(layer.status().toString());
    dev_ = *layer;
    auto p = dev_->allocate(n_, ordinal);
    if (!p.ok()) throw std::runtime_error(p.status().toString());
    p_ = static_cast<char*>(*p);
  }
  ~Gpu() { (void)dev_->free(p_); }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  char* get() { return p_; }
  void put(const Buf& h) { copy(p_, h.data(), std::min(h.size(), n_)); }
  Buf read(size_t n) const {
    Buf h(n);
    copy(h.data(), p_, n);
    return h;
  }

 private:
  static void copy(void* dst, const void* src, size_t n) {
    Status st = engine::device::copy(dst, src, n, engine::deadlineInMs(30000));
    if (!st.ok()) throw std::runtime_error(st.toString());
  }
  engine::device::Device* dev_ = nullptr;
  size_t n_;
  char* p_ = nullptr;
};

Buf inputs(size_t bytes, int rank, uint32_t salt) {
  Buf b(bytes);
  fill(DataType::kUInt8, b.data(), bytes, rank, salt);
  return b;
}

// The sentinel every output starts as.
Buf sentinel(size_t bytes) { return Buf(bytes, static_cast<char>(0x5a)); }

// Runs op on host buffers (in, out = sentinel) and on GPU buffers holding the same bytes, and
// checks the outputs agree (and the inputs were left alone where the op only reads them).
void same(Communicator& c, const char* what, const Buf& in, size_t out_bytes,
          const std::function<void(const void* in, void* out)>& op) {
  SCOPED_TRACE(std::string(what) + " rank " + std::to_string(c.rank()) + "/" +
               std::to_string(c.size()));
  Buf hin = in, hout = sentinel(out_bytes);
  op(hin.data(), hout.data());
  // Overwrite both host halves of every rank's comm buffer (an allgather of 3 half-sizes of
  // junk a rank): a GPU run that wrongly read a peer's host half would otherwise find the
  // host run's bytes still there (same step parity) and pass.
  if (c.path() != "net") {
    const size_t junk = 9u << 20;
    Buf mine(junk, static_cast<char>(0x40 + c.rank())), all(junk * c.size());
    c.allGather(mine.data(), all.data(), junk);
  }
  Gpu gin(in.size(), c.rank() % 2), gout(out_bytes, (c.rank() + 1) % 2);
  gin.put(in);
  gout.put(sentinel(out_bytes));
  // GPU data in and out: nothing is copied between GPU memory and pageable host memory
  // (staging goes through pinned buffers; on one host it stays in GPU memory).
  auto layer = engine::device::get();
  ASSERT_TRUE(layer.ok());
  const uint64_t pageable = (*layer)->pageableCopies();
  op(gin.get(), gout.get());
  EXPECT_EQ((*layer)->pageableCopies() - pageable, 0u)
      << what << ": GPU data copied to or from pageable host memory";
  EXPECT_TRUE(gout.read(out_bytes) == hout) << what << ": GPU output differs from host output";
  EXPECT_TRUE(gin.read(in.size()) == in) << what << ": GPU input changed";
}

void everyOp(Communicator& c) {
  const int n = c.size(), me = c.rank();
  const size_t count = (1u << 16) + 3;  // floats: 256 KiB + 12 B
  const size_t fb = count * 4;
  same(c, "allreduce float32 sum", inputs(fb, me, 1), fb, [&](const void* i, void* o) {
    c.allReduce(i, o, count, DataType::kFloat32, ReduceOp::kSum);
  });
  same(c, "allreduce int64 max", inputs(8 * 1001, me, 2), 8 * 1001, [&](const void* i, void* o) {
    c.allReduce(i, o, 1001, DataType::kInt64, ReduceOp::kMax);
  });
  // Every rank on the GPU, flat exchange and 2-phase, 16-bit floats and integers: on one host
  // each rank's slice is reduced by the device (pg/device_reduce.h) out of the peers' GPU halves.
  // Several 2-phase steps (MC_PG_CHUNK_BYTES is 2 MiB): 5 MiB + 12 B of floats.
  same(c, "allreduce float32 sum, several steps", inputs(4 * ((5u << 18) + 3), me, 26),
       4 * ((5u << 18) + 3), [&](const void* i, void* o) {
         c.allReduce(i, o, (5u << 18) + 3, DataType::kFloat32, ReduceOp::kSum);
       });
  for (size_t cnt : {size_t{100}, size_t{(1u << 17) + 5}}) {
    same(c, "allreduce bfloat16 sum", inputs(2 * cnt, me, 21), 2 * cnt,
         [&](const void* i, void* o) { c.allReduce(i, o, cnt, DataType::kBFloat16, ReduceOp::kSum); });
    same(c, "allreduce float16 avg", inputs(2 * cnt, me, 22), 2 * cnt,
         [&](const void* i, void* o) { c.allReduce(i, o, cnt, DataType::kFloat16, ReduceOp::kAvg); });
    same(c, "allreduce int32 min", inputs(4 * cnt, me, 23), 4 * cnt,
         [&](const void* i, void* o) { c.allReduce(i, o, cnt, DataType::kInt32, ReduceOp::kMin); });
  }
  {  // in place
    Buf h = inputs(fb, me, 3);
    Buf want = h;
    c.allReduce(want.data(), want.data(), count, DataType::kFloat32, ReduceOp::kSum);
    Gpu g(fb, 0);
    g.put(h);
    c.allReduce(g.get(), g.get(), count, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_TRUE(g.read(fb) == want) << "allreduce in place on GPU memory";
  }
  {  // ranks with GPU buffers and ranks with host buffers in one op (even ranks on the GPU):
     // the GPU path takes the host path's steps, flat exchange and 2-phase alike
    for (size_t cnt : {size_t{100}, count, size_t{(5u << 18) + 3}}) {
      const size_t nb = cnt * 4;
      // The reference from every rank's inputs, here (see reduce_scatter below).
      std::vector<Buf> all;
      std::vector<const void*> ins;
      for (int r = 0; r < n; ++r) all.push_back(inputs(nb, r, 13));
      for (int r = 0; r < n; ++r) ins.push_back(all[r].data());
      Buf h = all[me], want(nb);
      reduceInto(want.data(), nullptr, ins.data(), n, cnt, DataType::kFloat32, ReduceOp::kSum);
      Buf got(nb);
      if (me % 2 == 0) {
        Gpu gi(nb, 0), go(nb, 1);
        gi.put(h);
        c.allReduce(gi.get(), go.get(), cnt, DataType::kFloat32, ReduceOp::kSum);
        got = go.read(nb);
      } else {
        c.allReduce(h.data(), got.data(), cnt, DataType::kFloat32, ReduceOp::kSum);
      }
      EXPECT_TRUE(got == want) << "allreduce of " << cnt << " floats, GPU and host ranks mixed";
    }
    const size_t ab = 70001;
    Buf h = inputs(ab, me, 14), want(ab * n), got(ab * n);
    c.allGather(h.data(), want.data(), ab);
    if (me % 2 == 0) {
      Gpu gi(ab, 0), go(ab * n, 1);
      gi.put(h);
      c.allGather(gi.get(), go.get(), ab);
      got = go.read(ab * n);
    } else {
      c.allGather(h.data(), got.data(), ab);
    }
    EXPECT_TRUE(got == want) << "allgather, GPU and host ranks mixed";
  }
  {  // allgather in place on GPU memory (the input is this rank's block of the output)
    const size_t ab = 5000;
    Buf h = inputs(ab, me, 15), want(ab * n);
    c.allGather(h.data(), want.data(), ab);
    Gpu g(ab * n, 0);
    Buf start = sentinel(ab * n);
    std::memcpy(start.data() + me * ab, h.data(), ab);
    g.put(start);
    c.allGather(g.get() + me * ab, g.get(), ab);
    EXPECT_TRUE(g.read(ab * n) == want) << "allgather in place on GPU memory";
  }
  for (int root : {0, n - 1}) {  // GPU and host ranks mixed (even ranks on the GPU)
    const size_t bb = 3 * 70001;  // several steps of the pipeline
    Buf want = inputs(bb, root, 16);
    Buf h = me == root ? want : sentinel(bb);
    const uint64_t gpu_steps = c.deviceHalfSteps();
    if (me % 2 == 0) {
      Gpu g(bb, 1);
      g.put(h);
      c.broadcast(g.get(), bb, root);
      EXPECT_TRUE(g.read(bb) == want) << "broadcast from " << root << ", ranks mixed, GPU here";
    } else {
      c.broadcast(h.data(), bb, root);
      EXPECT_TRUE(h == want) << "broadcast from " << root << ", ranks mixed, host here";
    }
    // A GPU root on one host sends from its GPU halves.
    if (me == root && me % 2 == 0 && c.path() == "shm") {
      EXPECT_GT(c.deviceHalfSteps(), gpu_steps);
    }
  }
  same(c, "reduce float32 sum to rank 1", inputs(fb, me, 4), fb, [&](const void* i, void* o) {
    c.reduce(i, o, count, DataType::kFloat32, ReduceOp::kSum, 1);
  });
  same(c, "reduce bfloat16 max to rank 0 (flat)", inputs(2 * 999, me, 24), 2 * 999,
       [&](const void* i, void* o) { c.reduce(i, o, 999, DataType::kBFloat16, ReduceOp::kMax, 0); });
  for (size_t cnt : {size_t{100}, count}) {  // reduce, GPU and host ranks mixed, both roots
    const size_t nb = cnt * 4;
    std::vector<Buf> all;
    std::vector<const void*> ins;
    for (int r = 0; r < n; ++r) all.push_back(inputs(nb, r, 25));
    for (int r = 0; r < n; ++r) ins.push_back(all[r].data());
    Buf want(nb);
    reduceInto(want.data(), nullptr, ins.data(), n, cnt, DataType::kFloat32, ReduceOp::kSum);
    for (int root : {0, n - 1}) {
      Buf got = sentinel(nb);
      if (me % 2 == 0) {
        Gpu gi(nb, 0), go(nb, 1);
        gi.put(all[me]);
        go.put(got);
        c.reduce(gi.get(), go.get(), cnt, DataType::kFloat32, ReduceOp::kSum, root);
        got = go.read(nb);
      } else {
        c.reduce(all[me].data(), got.data(), cnt, DataType::kFloat32, ReduceOp::kSum, root);
      }
      if (me == root) {
        EXPECT_TRUE(got == want) << "reduce of " << cnt << " floats to " << root << ", ranks mixed";
      } else {
        EXPECT_TRUE(got == sentinel(nb)) << "reduce wrote a non-root's output";
      }
    }
  }
  for (int root : {0, n - 1}) {
    Buf h = me == root ? inputs(fb + 5, root, 5) : sentinel(fb + 5);
    Buf want = inputs(fb + 5, root, 5);
    Gpu g(fb + 5, 1);
    g.put(h);
    c.broadcast(g.get(), fb + 5, root);
    EXPECT_TRUE(g.read(fb + 5) == want) << "broadcast from " << root << " into GPU memory";
  }
  const size_t blk = 4096 + 5;
  same(c, "allgather", inputs(blk, me, 6), n * blk,
       [&](const void* i, void* o) { c.allGather(i, o, blk); });
  std::vector<size_t> sizes(n);
  for (int r = 0; r < n; ++r) sizes[r] = 1000 * (r + 1) + r;
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  same(c, "allgatherv", inputs(sizes[me], me, 7), total,
       [&](const void* i, void* o) { c.allGatherV(i, o, sizes); });
  same(c, "gather to rank 0", inputs(blk, me, 8), n * blk,
       [&](const void* i, void* o) { c.gather(i, o, blk, 0); });
  same(c, "scatter from the last rank", inputs(n * blk, me, 9), blk,
       [&](const void* i, void* o) { c.scatter(i, o, blk, n - 1); });
  {  // scatter and gather with GPU and host ranks mixed (even ranks on the GPU), roots of both
    for (int root : {0, n - 1}) {
      Buf all = inputs(n * blk, root, 18), want(all.begin() + me * blk, all.begin() + (me + 1) * blk);
      Buf got(blk);
      if (me % 2 == 0) {
        Gpu gi(n * blk, 0), go(blk, 1);
        gi.put(all);
        go.put(sentinel(blk));
        c.scatter(gi.get(), go.get(), blk, root);
        got = go.read(blk);
      } else {
        Buf o = sentinel(blk);
        c.scatter(all.data(), o.data(), blk, root);
        got = o;
      }
      EXPECT_TRUE(got == want) << "scatter from " << root << ", ranks mixed";
      Buf mine = inputs(blk, me, 19), gathered = sentinel(n * blk), expect;
      for (int r = 0; r < n; ++r) {
        Buf b = inputs(blk, r, 19);
        expect.insert(expect.end(), b.begin(), b.end());
      }
      if (me % 2 == 0) {
        Gpu gi(blk, 1), go(n * blk, 0);
        gi.put(mine);
        go.put(sentinel(n * blk));
        c.gather(gi.get(), go.get(), blk, root);
        gathered = go.read(n * blk);
      } else {
        c.gather(mine.data(), gathered.data(), blk, root);
      }
      if (me == root) {
        EXPECT_TRUE(gathered == expect) << "gather to " << root << ", ranks mixed";
      }
    }
  }
  same(c, "reduce_scatter float64 min", inputs(8 * 777 * n, me, 10), 8 * 777,
       [&](const void* i, void* o) {
         c.reduceScatter(i, o, 777, DataType::kFloat64, ReduceOp::kMin);
       });
  {  // blocks larger than a step's slot (several steps), all ranks on the GPU, then mixed
    const size_t cnt = (size_t{1} << 20) + 17, bb = 2 * cnt;  // bfloat16: 2 MiB + 34 B a block
    same(c, "reduce_scatter bfloat16 sum, several steps", inputs(bb * n, me, 15), bb,
         [&](const void* i, void* o) {
           c.reduceScatter(i, o, cnt, DataType::kBFloat16, ReduceOp::kSum);
         });
    // The reference from every rank's inputs, here (not a host-buffer run first: that would
    // leave the same bytes in the host halves that a wrong read would then find).
    std::vector<Buf> all;
    std::vector<const void*> mine_of;
    for (int r = 0; r < n; ++r) all.push_back(inputs(bb * n, r, 16));
    for (int r = 0; r < n; ++r) mine_of.push_back(all[r].data() + me * bb);
    Buf h = all[me], want(bb), got(bb);
    reduceInto(want.data(), nullptr, mine_of.data(), n, cnt, DataType::kBFloat16, ReduceOp::kSum);
    if (me % 2 == 0) {
      Gpu gi(bb * n, 0), go(bb, 1);
      gi.put(h);
      c.reduceScatter(gi.get(), go.get(), cnt, DataType::kBFloat16, ReduceOp::kSum);
      got = go.read(bb);
    } else {
      c.reduceScatter(h.data(), got.data(), cnt, DataType::kBFloat16, ReduceOp::kSum);
    }
    EXPECT_TRUE(got == want) << "reduce_scatter, GPU and host ranks mixed";
  }
  {  // all_to_all with gaps in both buffers (and a pair that sends nothing)
    std::vector<size_t> sb(n), so(n), rb(n), ro(n);
    auto len = [](int from, int to) -> size_t { return from == to ? 0 : 3000 + 17 * from + to; };
    size_t at = 0;
    for (int j = 0; j < n; ++j) {
      sb[j] = len(me, j);
      so[j] = at + 11;
      at = so[j] + sb[j];
    }
    const size_t in_bytes = at + 7;
    at = 0;
    for (int j = 0; j < n; ++j) {
      rb[j] = len(j, me);
      ro[j] = at + 13;
      at = ro[j] + rb[j];
    }
    const size_t out_bytes = at + 9;
    same(c, "all_to_all with gaps", inputs(in_bytes, me, 11), out_bytes,
         [&](const void* i, void* o) { c.allToAllV(i, sb, so, o, rb, ro); });
    // GPU and host buffers mixed: even ranks send from GPU memory into a host buffer, odd
    // ranks from host memory into GPU memory.
    Buf in = inputs(in_bytes, me, 17), want = sentinel(out_bytes);
    c.allToAllV(in.data(), sb, so, want.data(), rb, ro);
    const uint64_t gpu_steps = c.deviceHalfSteps();
    Buf got = sentinel(out_bytes);
    if (me % 2 == 0) {
      Gpu gi(in_bytes, 0);
      gi.put(in);
      c.allToAllV(gi.get(), sb, so, got.data(), rb, ro);
      if (c.path() == "shm") {
        EXPECT_GT(c.deviceHalfSteps(), gpu_steps);  // its slots went through its GPU halves
      }
    } else {
      Gpu go(out_bytes, 1);
      go.put(sentinel(out_bytes));
      c.allToAllV(in.data(), sb, so, go.get(), rb, ro);
      got = go.read(out_bytes);
    }
    EXPECT_TRUE(got == want) << "all_to_all, GPU and host buffers mixed";
  }
  {  // point to point: a ring, GPU to GPU
    const size_t pb = 70000 + me;
    Buf mine = inputs(pb, me, 12);
    Gpu s(pb, 0), r(70000 + (me + n - 1) % n, 1);
    s.put(mine);
    const int to = (me + 1) % n, from = (me + n - 1) % n;
    auto layer = engine::device::get();
    ASSERT_TRUE(layer.ok());
    const uint64_t pageable = (*layer)->pageableCopies(), dev_msgs = c.p2pDeviceMessages();
    if (me % 2 == 0) {
      c.send(s.get(), pb, to, 77);
      EXPECT_EQ(c.recv(r.get(), 70000 + from, from, 77), from);
    } else {
      EXPECT_EQ(c.recv(r.get(), 70000 + from, from, 77), from);
      c.send(s.get(), pb, to, 77);
    }
    EXPECT_EQ((*layer)->pageableCopies() - pageable, 0u) << "send/recv of GPU memory";
    // Between ranks of one host the message went device to device (one send and one receive
    // here); else through pinned host memory.
    auto same_host = [&](int a, int b) {
      if (c.path() == "shm") return true;
      if (c.path().find("hierarchical") == std::string::npos) return false;
      return (a < n / 2) == (b < n / 2);  // the test's two simulated hosts
    };
    if (n > 1) {
      EXPECT_EQ(c.p2pDeviceMessages() - dev_msgs,
                uint64_t{same_host(me, to)} + uint64_t{same_host(me, from)});
    }
    EXPECT_TRUE(r.read(70000 + from) == inputs(70000 + from, from, 12)) << "recv into GPU memory";
  }
}

class PgGpuBuffers : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(PgGpuBuffers, EveryOpMatchesTheHostPath) {
  const auto [transport, world] = GetParam();
  RunOptions o;
  o.world = world;
  o.deadline_s = 120;
  o.env.push_back({"MC_DEVICE", "sim"});
  if (transport == "hier") {  // two simulated hosts: shm within, tcp between
    o.rank_env = [world = world](int r) {
      return std::vector<std::pair<std::string, std::string>>{
          {"MC_HOST_ID", r < world / 2 ? "gpu-pg-host-a" : "gpu-pg-host-b"}};
    };
  } else {
    useTransport(o, transport);
  }
  auto codes = runRanks(o, [&](RankEnv& env) {
    if (transport == "hier") {
      EXPECT_NE(env.comm->path().find("hierarchical"), std::string::npos) << env.comm->path();
    }
    const uint64_t reductions = deviceReduceLaunches();
    everyOp(*env.comm);
    // On one host the GPU blocks went device to device (GPU halves) and the allreduces of
    // GPU data were reduced by the device.
    if (transport == "shm") {
      EXPECT_GT(env.comm->deviceHalfSteps(), 0u);
      EXPECT_GE(deviceReduceLaunches() - reductions, 12u);
    } else if (transport == "hier") {
      // The allreduces reduce onto each host's leader on the device (the rest is staged).
      EXPECT_GT(deviceReduceLaunches(), reductions);
    } else {
      EXPECT_EQ(env.comm->deviceHalfSteps(), 0u);
      EXPECT_EQ(deviceReduceLaunches(), reductions);
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Pg, PgGpuBuffers,
    ::testing::Values(std::make_tuple(std::string("shm"), 2), std::make_tuple(std::string("shm"), 3),
                      std::make_tuple(std::string("tcp"), 3),
                      std::make_tuple(std::string("tcp_onesided"), 2),
                      std::make_tuple(std::string("hier"), 4)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
    });

// Messages between ranks of one host through the sender's staging buffers (pg/p2p_stage.h):
// GPU ones device to device, host ones of MC_PG_P2P_STAGE_BYTES (128 KiB) and more through
// shared memory. Eager: the sender returns and reuses its buffer before the receiver posts its
// recv; a message of the other path behind the staged ones keeps its place; a recv into the
// other kind of memory takes a staged message; a size mismatch names the sender and frees its
// buffer; once the pool is full of unreceived messages the next one goes the other way, and
// the pool is used again after they were received; a sender whose group ends right after its
// sends still delivers them, from a buffer the receiver never opened before too (the
// simulation poisons freed device memory, and a freed host buffer can no longer be mapped).
class PgStagedP2p : public ::testing::TestWithParam<std::string> {};

TEST_P(PgStagedP2p, SameHostMessagesGoThroughTheSendersBuffers) {
  const bool gpu = GetParam() == "gpu";
  RunOptions o;
  o.world = 2;
  o.deadline_s = 120;
  o.transport = "shm";
  o.env.push_back({"MC_DEVICE", "sim"});
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const int me = c.rank();
    auto layer = engine::device::get();
    ASSERT_TRUE(layer.ok());
    auto staged = [&] { return gpu ? c.p2pDeviceMessages() : c.p2pHostStagedMessages(); };
    // Memory of the kind under test, and of the other kind.
    struct Mem {
      std::unique_ptr<Gpu> g;
      Buf h;
      Mem(bool on_gpu, size_t n, int ordinal) {
        if (on_gpu) g = std::make_unique<Gpu>(n, ordinal); else h.resize(n);
      }
      char* get() { return g ? g->get() : h.data(); }
      void put(const Buf& b) {
        if (g) g->put(b); else std::memcpy(h.data(), b.data(), b.size());
      }
      Buf read(size_t n) { return g ? g->read(n) : Buf(h.begin(), h.begin() + n); }
    };
    const std::vector<size_t> sizes = {128u << 10, (128u << 10) + 1, 3u << 20};
    const size_t big = 64u << 20;  // 4 of these fill a pool (StageOutbox::kPoolBytes)
    const size_t fresh = 16u << 20;  // a buffer size the pool has not made before phase 2
    if (me == 0) {
      Mem s(gpu, big, 0);
      for (size_t i = 0; i < sizes.size(); ++i) {
        s.put(inputs(sizes[i], 0, 40 + i));
        c.send(s.get(), sizes[i], 1, 5);
        s.put(Buf(sizes[i], 'x'));  // reused at once: the message keeps what was sent
      }
      Buf small = inputs(1000, 0, 49);  // host memory below the threshold: a message
      c.send(small.data(), small.size(), 1, 5);
      EXPECT_EQ(staged(), sizes.size());
      s.put(inputs(140000, 0, 50));
      c.send(s.get(), 140000, 1, 6);  // received with the wrong size
      for (int i = 0; i < 5; ++i) {
        s.put(inputs(big, 0, 60 + i));
        c.send(s.get(), big, 1, 7);
      }
      // The first sends hold four small buffers until rank 1 received them (after the
      // barrier below): only 3 of the 64 MiB ones fit beside them; the rest went the other way
      // (each after waiting a little for a buffer to come back).
      EXPECT_EQ(staged(), sizes.size() + 1 + 3);
      c.barrier();
      c.barrier();  // rank 1 received everything: the pool is free again
      const uint64_t before = staged();
      s.put(inputs(big, 0, 70));
      c.send(s.get(), big, 1, 8);
      s.put(inputs(fresh, 0, 71));
      c.send(s.get(), fresh, 1, 8);
      EXPECT_EQ(staged() - before, 2u);
      env.comm.reset();  // ends the group before rank 1 received those two
      return;
    }
    c.barrier();
    // The receives copy nothing between GPU memory and pageable host memory (the checks'
    // reads do: they are left out).
    uint64_t pageable = 0;
    auto recv = [&](void* buf, size_t bytes, uint64_t tag) {
      const uint64_t before = (*layer)->pageableCopies();
      const int from = c.recv(buf, bytes, 0, tag);
      pageable += (*layer)->pageableCopies() - before;
      return from;
    };
    for (size_t i = 0; i < sizes.size(); ++i) {
      SCOPED_TRACE("message " + std::to_string(i));
      Mem r(i == 1 ? !gpu : gpu, sizes[i], 1);  // message 1 into the other kind of memory
      EXPECT_EQ(recv(r.get(), sizes[i], 5), 0);
      EXPECT_TRUE(r.read(sizes[i]) == inputs(sizes[i], 0, 40 + i));
    }
    Mem r(gpu, big, 1);
    EXPECT_EQ(recv(r.get(), 1000, 5), 0);
    EXPECT_TRUE(r.read(1000) == inputs(1000, 0, 49)) << "the message behind the staged ones";
    EXPECT_EQ(staged(), sizes.size());
    try {
      recv(r.get(), 135000, 6);
      ADD_FAILURE() << "a receive of 135000 bytes took a 140000-byte message";
    } catch (const CommError& e) {
      EXPECT_EQ(e.peerRank(), 0);
      EXPECT_NE(std::string(e.what()).find("sent 140000 bytes"), std::string::npos) << e.what();
    }
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(recv(r.get(), big, 7), 0);
      EXPECT_TRUE(r.read(big) == inputs(big, 0, 60 + i)) << "64 MiB message " << i;
    }
    EXPECT_EQ(staged(), sizes.size() + 3);
    c.barrier();
    // Rank 0 ends its group once it sent these: they are still here.
    EXPECT_EQ(recv(r.get(), big, 8), 0);
    EXPECT_TRUE(r.read(big) == inputs(big, 0, 70)) << "after the sender's group ended";
    EXPECT_EQ(recv(r.get(), fresh, 8), 0);
    EXPECT_TRUE(r.read(fresh) == inputs(fresh, 0, 71))
        << "from a new buffer, after the sender's group ended";
    EXPECT_EQ(staged(), sizes.size() + 3 + 2);
    EXPECT_EQ(pageable, 0u) << "messages received through pageable host memory";
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Pg, PgStagedP2p, ::testing::Values("gpu", "host"),
                         [](const auto& info) { return info.param; });

// pg/profile.h: off, nothing is counted; on, every allreduce counts once as an op; GPU ones on
// one host spend time waiting for and queueing device work and host ones none; a wait for a
// peer that is late shows as a flag wait of about its lateness; no phase adds up to more than
// the ops it is part of.
TEST(PgProfile, PhasesOfGpuAndHostAllreduces) {
  RunOptions o;
  o.world = 2;
  o.deadline_s = 60;
  o.env.push_back({"MC_DEVICE", "sim"});
  o.env.push_back({"MC_PG_PROFILE", "0"});
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const size_t count = 1 << 18;  // 1 MiB of floats: the 2-phase algorithm
    std::vector<float> h(count, 1.0f);
    Gpu g(count * 4, 0);
    g.put(Buf(count * 4, 0));
    (void)profile::take(true);
    c.allReduce(h.data(), h.data(), count, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(profile::take(true).count[profile::kOp], 0u) << "counted while off";
    profile::setEnabled(true);
    for (int i = 0; i < 4; ++i)
      c.allReduce(g.get(), g.get(), count, DataType::kFloat32, ReduceOp::kSum);
    const profile::Totals gpu = profile::take(true);
    for (int i = 0; i < 4; ++i)
      c.allReduce(h.data(), h.data(), count, DataType::kFloat32, ReduceOp::kSum);
    const profile::Totals host = profile::take(true);
    // Rank 1 comes 30 ms late: rank 0 waits for its flag.
    if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    c.allReduce(h.data(), h.data(), count, DataType::kFloat32, ReduceOp::kSum);
    const profile::Totals late = profile::take(true);
    profile::setEnabled(false);

    EXPECT_EQ(gpu.count[profile::kOp], 4u);
    EXPECT_EQ(host.count[profile::kOp], 4u);
    EXPECT_GE(gpu.count[profile::kDeviceWait], 4u);
    EXPECT_GE(gpu.count[profile::kDeviceQueue], 4u);
    EXPECT_GT(gpu.ns[profile::kDeviceWait], 0u);
    EXPECT_EQ(host.count[profile::kDeviceWait], 0u);
    EXPECT_EQ(host.count[profile::kDeviceQueue], 0u);
    if (c.rank() == 0) {
      EXPECT_GE(late.count[profile::kFlagWait], 1u);
      EXPECT_GE(late.ns[profile::kFlagWait], 20'000'000u) << profile::format(late);
    }
    for (const profile::Totals* t : {&gpu, &host, &late}) {
      uint64_t parts = 0;
      for (int p = profile::kOp + 1; p < profile::kPhases; ++p) parts += t->ns[p];
      EXPECT_GT(t->ns[profile::kOp], 0u);
      EXPECT_LE(parts, t->ns[profile::kOp]) << profile::format(*t);
    }
    EXPECT_EQ(profile::format(gpu).rfind("4 ops, ", 0), 0u) << profile::format(gpu);
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// An op scope inside another on the same thread (a group's op run by a subgroup) counts once.
TEST(PgProfile, NestedOpsCountOnce) {
  profile::setEnabled(true);
  (void)profile::take(true);
  {
    profile::Scope outer(profile::kOp);
    profile::Scope inner(profile::kOp);
    profile::Scope wait(profile::kFlagWait);
  }
  { profile::Scope again(profile::kOp); }
  const profile::Totals t = profile::take(true);
  profile::setEnabled(false);
  EXPECT_EQ(t.count[profile::kOp], 2u);
  EXPECT_EQ(t.count[profile::kFlagWait], 1u);
  { profile::Scope off(profile::kOp); }
  EXPECT_EQ(profile::take(true).count[profile::kOp], 0u);
}

}  // namespace
}  // namespace mooncake::pg::test
