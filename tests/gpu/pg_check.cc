// pg_check: a 2-rank process group (two processes on one host) running collectives on GPU
// memory (one host: the GPU halves, pg/device_stage.h; reductions by pg/device_reduce.h), on
// whatever layer MC_DEVICE selects: the real GPU on the GPU machine (scripts/gpu_check.sh),
// the host simulation here (ctest engine.pg_check_sim). Every result is copied back and
// compared with what the inputs make; allreduce 16 MiB is timed on GPU and on host buffers;
// GPU allreduces of 16-bit floats and integers equal the host's bit for bit.
// No gtest, like device_check.
//
//   pg_check                      rank 0: rendezvous, spawns rank 1, reports
//   pg_check --child PORT SECRET  rank 1
// One JSON object per line on stdout (rank 0); exit status 0 when every check passed.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/device/device.h"
#include "engine/engine.h"
#include "engine/params.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"
#include "pg/communicator.h"
#include "pg/device_reduce.h"
#include "pg/profile.h"
#include "pg/types.h"
#include "tests/gpu/check_util.h"

extern char** environ;

namespace {

using mooncake::Status;
using mooncake::engine::deadlineInMs;
using mooncake::engine::device::Device;
using mooncake::gpucheck::copyWait;
using mooncake::gpucheck::Row;
using mooncake::pg::Communicator;
using mooncake::pg::DataType;
using mooncake::pg::ReduceOp;

constexpr size_t kFloats = 4u << 20;  // 16 MiB of float32

// Rank r's input element i (exact in float32: small integers).
float input(int r, size_t i) { return static_cast<float>(i % 251) + 1000.0f * r; }

// GPU memory for one check, freed at the end of the scope.
struct Gpu {
  Device& d;
  void* p = nullptr;
  Gpu(Device& dev, size_t n) : d(dev) {
    auto a = d.allocate(n, 0);
    if (a.ok()) p = *a;
  }
  ~Gpu() {
    if (p != nullptr) (void)d.free(p);
  }
};

// Seconds each of `iters` allreduces of `count` floats in place on buf took (each after a
// barrier), sorted; this rank's time in them by phase (pg/profile.h; the barriers not counted)
// goes to `phases`.
std::vector<double> allReduceTimes(Communicator& c, void* buf, size_t count, int iters,
                                   std::string& phases) {
  std::vector<double> ts;
  (void)mooncake::pg::profile::take(true);
  for (int k = 0; k < iters; ++k) {
    c.barrier();
    mooncake::pg::profile::setEnabled(true);
    auto t0 = std::chrono::steady_clock::now();
    c.allReduce(buf, buf, count, DataType::kFloat32, ReduceOp::kSum);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    mooncake::pg::profile::setEnabled(false);
  }
  phases = mooncake::pg::profile::format(mooncake::pg::profile::take(true));
  std::sort(ts.begin(), ts.end());
  return ts;
}

std::vector<Row> runChecks(Device& d, Communicator& c) {
  std::vector<Row> rows;
  const int me = c.rank(), n = c.size();
  auto check = [&](const std::string& name, const std::function<std::string()>& fn) {
    std::string why;
    try {
      why = fn();
    } catch (const std::exception& e) {
      why = e.what();
    }
    rows.push_back({name, why.rfind("ok", 0) == 0, why});
  };
  std::vector<float> host(kFloats * n), back(kFloats * n);
  for (size_t i = 0; i < kFloats; ++i) host[i] = input(me, i);
  const size_t bytes = kFloats * 4;

  check("allreduce_16MiB", [&]() -> std::string {
    Gpu g(d, bytes);
    if (g.p == nullptr) return "allocation failed";
    Status st = copyWait(d, g.p, host.data(), bytes);
    if (!st.ok()) return st.toString();
    c.allReduce(g.p, g.p, kFloats, DataType::kFloat32, ReduceOp::kSum);
    st = copyWait(d, back.data(), g.p, bytes);
    if (!st.ok()) return st.toString();
    for (size_t i = 0; i < kFloats; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += input(r, i);
      if (back[i] != want) return "element " + std::to_string(i) + " differs";
    }
    // Timing: best of 3 on GPU buffers against the same op on host buffers.
    std::string pg, ph;
    const double tg = allReduceTimes(c, g.p, kFloats, 3, pg)[0];
    const double th = allReduceTimes(c, back.data(), kFloats, 3, ph)[0];
    char s[128];
    std::snprintf(s, sizeof s, "ok: GPU %.0f us, host %.0f us (%.2fx)", tg * 1e6, th * 1e6, tg / th);
    return s + ("; GPU by phase: " + pg) + ("; host by phase: " + ph);
  });
  // Small-op latency: 64 KiB allreduce, median of 50, GPU against host buffers (each step of a
  // GPU op waits for its copies on the host: MC_DEVICE_SPIN_US says how long it polls before it
  // sleeps; gpu_check.sh runs this check with the default and with 0).
  check("allreduce_64KiB", [&]() -> std::string {
    const size_t count = 16384;
    Gpu g(d, count * 4);
    if (g.p == nullptr) return "allocation failed";
    Status st = copyWait(d, g.p, host.data(), count * 4);
    if (!st.ok()) return st.toString();
    std::string pg, ph;
    const double tg = allReduceTimes(c, g.p, count, 50, pg)[25];
    const double th = allReduceTimes(c, back.data(), count, 50, ph)[25];
    char s[160];
    std::snprintf(s, sizeof s, "ok: GPU p50 %.0f us, host p50 %.0f us (%.2fx), MC_DEVICE_SPIN_US=%lld",
                  tg * 1e6, th * 1e6, tg / th,
                  static_cast<long long>(mooncake::params::getInt("MC_DEVICE_SPIN_US")));
    return s + ("; GPU by phase: " + pg) + ("; host by phase: " + ph);
  });
  // The reduction kernel (pg/device_reduce.cu) against the CPU's reduceInto: the same
  // allreduce on GPU and on host buffers must agree bit for bit (fp16/bf16 rounding, int AVG),
  // and the GPU ones must have been reduced by the device.
  check("allreduce_kernel_vs_host", [&]() -> std::string {
    const bool kernel = std::string(d.name()) == "sim" || mooncake::pg::deviceReduceHasImage();
    const uint64_t launches = mooncake::pg::deviceReduceLaunches();
    struct Case {
      DataType t;
      ReduceOp op;
      size_t count;
    };
    for (Case k : {Case{DataType::kBFloat16, ReduceOp::kSum, 4099}, Case{DataType::kFloat16, ReduceOp::kAvg, 1 << 20},
                   Case{DataType::kInt64, ReduceOp::kAvg, 3001}, Case{DataType::kFloat32, ReduceOp::kMax, 1 << 19}}) {
      const size_t es = mooncake::pg::dtypeSize(k.t), nb = k.count * es;
      std::vector<unsigned char> in(nb), want(nb), got(nb);
      for (size_t i = 0; i < nb; ++i) in[i] = static_cast<unsigned char>((i * 131 + me * 71 + 7) % 251);
      if (k.t == DataType::kFloat16 || k.t == DataType::kBFloat16)  // no inf/NaN inputs
        for (size_t i = 1; i < nb; i += 2) in[i] &= 0x3f;
      c.allReduce(in.data(), want.data(), k.count, k.t, k.op);
      Gpu g(d, nb);
      if (g.p == nullptr) return "allocation failed";
      Status st = copyWait(d, g.p, in.data(), nb);
      if (st.ok()) c.allReduce(g.p, g.p, k.count, k.t, k.op);
      if (st.ok()) st = copyWait(d, got.data(), g.p, nb);
      if (!st.ok()) return st.toString();
      if (got != want)
        return std::string(mooncake::pg::dtypeName(k.t)) + " " + mooncake::pg::reduceOpName(k.op) +
               ": GPU result differs from the host's";
    }
    const uint64_t ran = mooncake::pg::deviceReduceLaunches() - launches;
    if (kernel && ran == 0) return "the GPU allreduces were not reduced by the device";
    return "ok: " + std::to_string(ran) + " device reductions" +
           (kernel ? "" : " (no kernel image in this build: reduced on the CPU)");
  });
  // Stream-ordered allreduce (pg/stream_ops.h; here on the layer's copy stream): the same
  // bytes as the host-driven op, one shot (bf16, 4099) and two shots in several steps (float32,
  // 16 MiB, 8 MiB steps), then timed: p50 of issue + wait at 64 KiB, 16 MiB and 256 MiB.
  check("stream_allreduce", [&]() -> std::string {
    using mooncake::engine::device::kCopyStream;
    struct Case {
      DataType t;
      size_t count;
    };
    for (Case k : {Case{DataType::kBFloat16, 4099}, Case{DataType::kFloat32, kFloats}}) {
      const size_t nb = k.count * mooncake::pg::dtypeSize(k.t);
      std::vector<unsigned char> in(nb), want(nb), got(nb);
      for (size_t i = 0; i < nb; ++i) in[i] = static_cast<unsigned char>((i * 37 + me * 11 + 3) % 251);
      if (k.t == DataType::kBFloat16)
        for (size_t i = 1; i < nb; i += 2) in[i] &= 0x3f;
      c.allReduce(in.data(), want.data(), k.count, k.t, ReduceOp::kSum);
      Gpu g(d, nb);
      if (g.p == nullptr) return "allocation failed";
      Status st = copyWait(d, g.p, in.data(), nb);
      if (!st.ok()) return st.toString();
      auto op = c.allReduceOnStream(g.p, g.p, k.count, k.t, ReduceOp::kSum, kCopyStream);
      if (!op)
        return std::string(d.name()) == "cuda"
                   ? "the stream-ordered path was not taken (MC_PG_STREAM_OPS, setup: the log)"
                   : "ok: skipped (MC_PG_STREAM_OPS=" +
                         mooncake::params::getString("MC_PG_STREAM_OPS") + " here)";
      op->wait();
      st = copyWait(d, got.data(), g.p, nb);
      if (!st.ok()) return st.toString();
      if (got != want)
        return std::string(mooncake::pg::dtypeName(k.t)) + " x " + std::to_string(k.count) +
               ": differs from the host-driven allreduce";
    }
    std::string out = "ok: p50";
    for (size_t nb : {size_t{64} << 10, size_t{16} << 20, size_t{256} << 20}) {
      if (std::string(d.name()) != "cuda" && nb > (size_t{16} << 20)) break;
      Gpu g(d, nb);
      if (g.p == nullptr) return "allocation failed";
      std::vector<double> ts;
      const int iters = nb >= (size_t{256} << 20) ? 5 : 30;
      for (int it = 0; it < iters; ++it) {
        c.barrier();
        auto t0 = std::chrono::steady_clock::now();
        auto op = c.allReduceOnStream(g.p, g.p, nb / 4, DataType::kFloat32, ReduceOp::kSum,
                                      kCopyStream);
        if (!op) return "the stream-ordered path was not taken";
        op->wait();
        ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ts.begin(), ts.end());
      const double t = ts[ts.size() / 2];
      char b[96];
      std::snprintf(b, sizeof b, " %zu KiB %.0f us (busbw %.2f GB/s);", nb >> 10, t * 1e6,
                    nb / t / 1e9 * 2 * (n - 1) / n);
      out += b;
    }
    return out + " " + std::to_string(c.streamOps()) + " stream-ordered ops";
  });
  // The other stream-ordered collectives against their host-driven forms on the same inputs
  // (16 MiB inputs less a few bytes, so that steps end off the block and chunk boundaries).
  check("stream_collectives", [&]() -> std::string {
    using mooncake::engine::device::kCopyStream;
    const size_t nb = bytes - 12 * n;  // per rank (a multiple of 4 and of n)
    std::vector<unsigned char> in(nb * n), want(nb * n), got(nb * n);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned char>((i * 53 + me * 29) % 241);
    Gpu gi(d, nb * n), go(d, nb * n);
    if (gi.p == nullptr || go.p == nullptr) return "allocation failed";
    struct Op {
      const char* name;
      size_t out_bytes;
      std::function<void(const void*, void*)> host;
      std::function<std::shared_ptr<Communicator::StreamOp>(const void*, void*)> stream;
    };
    const std::vector<size_t> blk(n, nb / n);  // alltoall's blocks and their offsets
    std::vector<size_t> off(n);
    for (int j = 0; j < n; ++j) off[j] = j * (nb / n);
    std::vector<size_t> vsb(n), vso(n), vrb(n), vro(n);  // alltoallv's sizes and offsets
    size_t vrecv_total = 0;
    for (int j = 0, at = 0; j < n; ++j) {
      vsb[j] = static_cast<size_t>(me + j + 1) * (nb / 4);
      vso[j] = static_cast<size_t>(at);
      at += static_cast<int>(vsb[j]);
      vrb[j] = static_cast<size_t>(j + me + 1) * (nb / 4);
      vro[j] = vrecv_total;
      vrecv_total += vrb[j];
    }
    const Op ops[] = {
        {"allgather", nb * n, [&](const void* i, void* o) { c.allGather(i, o, nb); },
         [&](const void* i, void* o) { return c.allGatherOnStream(i, o, nb, kCopyStream); }},
        {"broadcast", nb,
         [&](const void* i, void* o) { std::memcpy(o, i, nb); c.broadcast(o, nb, 1); },
         [&](const void* i, void* o) {
           Status st = copyWait(d, o, i, nb);
           if (!st.ok()) throw std::runtime_error(st.toString());
           return c.broadcastOnStream(o, nb, 1, kCopyStream);
         }},
        {"reduce_scatter", nb / n,
         [&](const void* i, void* o) {
           c.reduceScatter(i, o, nb / n / 4, DataType::kFloat32, ReduceOp::kMax);
         },
         [&](const void* i, void* o) {
           return c.reduceScatterOnStream(i, o, nb / n / 4, DataType::kFloat32, ReduceOp::kMax,
                                          kCopyStream);
         }},
        {"alltoall", nb, [&](const void* i, void* o) { c.allToAllV(i, blk, off, o, blk, off); },
         [&](const void* i, void* o) { return c.allToAllOnStream(i, o, nb / n, kCopyStream); }},
        // (int32 sums: the same bits whatever order the ranks are added in; rank 0, which
        // reports, is the root of reduce and gather and a receiver of scatter)
        {"reduce", me == 0 ? nb : 0,
         [&](const void* i, void* o) {
           c.reduce(i, o, nb / 4, DataType::kInt32, ReduceOp::kSum, 0);
         },
         [&](const void* i, void* o) {
           return c.reduceOnStream(i, o, nb / 4, DataType::kInt32, ReduceOp::kSum, 0,
                                   kCopyStream);
         }},
        {"gather", me == 0 ? nb : 0, [&](const void* i, void* o) { c.gather(i, o, nb / n, 0); },
         [&](const void* i, void* o) {
           std::vector<void*> outs;
           if (me == 0)
             for (int r = 0; r < n; ++r) outs.push_back(static_cast<char*>(o) + r * (nb / n));
           return c.gatherOnStream(i, outs, nb / n, 0, kCopyStream);
         }},
        {"scatter", nb / n, [&](const void* i, void* o) { c.scatter(i, o, nb / n, n - 1); },
         [&](const void* i, void* o) {
           std::vector<const void*> ins;
           if (me == n - 1)
             for (int j = 0; j < n; ++j) ins.push_back(static_cast<const char*>(i) + j * (nb / n));
           return c.scatterOnStream(ins, o, nb / n, n - 1, kCopyStream);
         }},
        // uneven blocks, the largest (3/4 of 16 MiB) over more than one 8 MiB step's slot
        {"alltoallv", vrecv_total, [&](const void* i, void* o) { c.allToAllV(i, vsb, vso, o, vrb, vro); },
         [&](const void* i, void* o) {
           return c.allToAllVOnStream(i, vsb, vso, o, vrb, vro, kCopyStream);
         }},
    };
    for (const Op& op : ops) {
      op.host(in.data(), want.data());
      Status st = copyWait(d, gi.p, in.data(), in.size());
      if (!st.ok()) return st.toString();
      auto so = op.stream(gi.p, go.p);
      if (!so)
        return std::string(d.name()) == "cuda"
                   ? std::string(op.name) + ": the stream-ordered path was not taken"
                   : "ok: skipped (MC_PG_STREAM_OPS=" +
                         mooncake::params::getString("MC_PG_STREAM_OPS") + " here)";
      so->wait();
      st = copyWait(d, got.data(), go.p, op.out_bytes);
      if (!st.ok()) return st.toString();
      if (std::memcmp(got.data(), want.data(), op.out_bytes) != 0)
        return std::string(op.name) + ": differs from the host-driven op";
    }
    return "ok: allgather, broadcast, reduce_scatter, alltoall, reduce, gather, scatter, alltoallv "
           "equal to the host-driven ops";
  });
  check("allgather_16MiB", [&]() -> std::string {
    Gpu in(d, bytes), out(d, bytes * n);
    if (in.p == nullptr || out.p == nullptr) return "allocation failed";
    Status st = copyWait(d, in.p, host.data(), bytes);
    if (st.ok()) c.allGather(in.p, out.p, bytes);
    if (st.ok()) st = copyWait(d, back.data(), out.p, bytes * n);
    if (!st.ok()) return st.toString();
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < kFloats; i += 4099)
        if (back[r * kFloats + i] != input(r, i)) return "block " + std::to_string(r) + " differs";
    return "ok";
  });
  check("alltoall_16MiB", [&]() -> std::string {
    Gpu in(d, bytes), out(d, bytes);
    if (in.p == nullptr || out.p == nullptr) return "allocation failed";
    const size_t part = bytes / n;
    std::vector<size_t> sz(n, part), off(n);
    for (int j = 0; j < n; ++j) off[j] = j * part;
    Status st = copyWait(d, in.p, host.data(), bytes);
    if (st.ok()) c.allToAllV(in.p, sz, off, out.p, sz, off);
    if (st.ok()) st = copyWait(d, back.data(), out.p, bytes);
    if (!st.ok()) return st.toString();
    const size_t per = kFloats / n;
    for (int r = 0; r < n; ++r)  // block r came from rank r's block `me`
      for (size_t i = 0; i < per; i += 1021)
        if (back[r * per + i] != input(r, me * per + i))
          return "block from rank " + std::to_string(r) + " differs";
    return "ok";
  });
  check("broadcast_16MiB_from_rank_1", [&]() -> std::string {
    Gpu g(d, bytes);
    if (g.p == nullptr) return "allocation failed";
    std::vector<float> mine(kFloats);
    for (size_t i = 0; i < kFloats; ++i) mine[i] = me == 1 ? input(1, i) : -1.0f;
    Status st = copyWait(d, g.p, mine.data(), bytes);
    if (st.ok()) c.broadcast(g.p, bytes, 1);
    if (st.ok()) st = copyWait(d, back.data(), g.p, bytes);
    if (!st.ok()) return st.toString();
    for (size_t i = 0; i < kFloats; i += 997)
      if (back[i] != input(1, i)) return "element " + std::to_string(i) + " differs";
    return "ok";
  });
  check("reduce_scatter_16MiB", [&]() -> std::string {
    Gpu in(d, bytes), out(d, bytes / n);
    if (in.p == nullptr || out.p == nullptr) return "allocation failed";
    const size_t per = kFloats / n;
    Status st = copyWait(d, in.p, host.data(), bytes);
    if (st.ok()) c.reduceScatter(in.p, out.p, per, DataType::kFloat32, ReduceOp::kSum);
    if (st.ok()) st = copyWait(d, back.data(), out.p, bytes / n);
    if (!st.ok()) return st.toString();
    for (size_t i = 0; i < per; i += 513) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += input(r, me * per + i);
      if (back[i] != want) return "element " + std::to_string(i) + " differs";
    }
    return "ok";
  });
  // Send/recv of GPU memory between the two ranks (one host): device to device through the
  // sender's staging buffers (pg/p2p_stage.h), counted by p2pDeviceMessages; timed, best of
  // 3 exchanges, against the same exchange of host buffers.
  check("sendrecv_16MiB", [&]() -> std::string {
    Gpu src(d, bytes), dst(d, bytes);
    if (src.p == nullptr || dst.p == nullptr) return "allocation failed";
    const int peer = 1 - me;
    Status st = copyWait(d, src.p, host.data(), bytes);
    if (!st.ok()) return st.toString();
    const uint64_t before = c.p2pDeviceMessages();
    c.send(src.p, bytes, peer, 7);
    c.recv(dst.p, bytes, peer, 7);
    const uint64_t moved = c.p2pDeviceMessages() - before;
    st = copyWait(d, back.data(), dst.p, bytes);
    if (!st.ok()) return st.toString();
    for (size_t i = 0; i < kFloats; ++i)
      if (back[i] != input(peer, i)) return "element " + std::to_string(i) + " differs";
    if (moved != 2)
      return std::to_string(moved) + " of this rank's 2 messages went device to device";
    auto best = [&](const void* from, void* to) {
      double t = 1e9;
      for (int k = 0; k < 3; ++k) {
        c.barrier();
        auto t0 = std::chrono::steady_clock::now();
        c.send(from, bytes, peer, 8);
        c.recv(to, bytes, peer, 8);
        t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return t;
    };
    std::vector<float> host_out(kFloats);
    const double tg = best(src.p, dst.p), th = best(host.data(), host_out.data());
    char s[160];
    std::snprintf(s, sizeof s, "ok: device to device; GPU %.0f us, host %.0f us (%.2fx)",
                  tg * 1e6, th * 1e6, tg / th);
    return s;
  });
  // Stream-ordered send/recv (pg/stream_p2p.h): a ring, 16 MiB a message (several slots), the
  // same bytes as the host-driven send/recv; timed against it (best of 3, send + recv waited).
  check("stream_sendrecv_16MiB", [&]() -> std::string {
    using mooncake::engine::device::kCopyStream;
    Gpu src(d, bytes), dst(d, bytes), hdst(d, bytes);
    if (src.p == nullptr || dst.p == nullptr || hdst.p == nullptr) return "allocation failed";
    const int to = (me + 1) % n, from = (me + n - 1) % n;
    Status st = copyWait(d, src.p, host.data(), bytes);
    if (!st.ok()) return st.toString();
    bool ordered_checked = false, ordered_ok = true;
    auto ring = [&](bool stream) {
      c.barrier();
      auto t0 = std::chrono::steady_clock::now();
      if (stream) {
        // The first time, rank 1 comes late: rank 0's ops wait (pending) for its buffers, and
        // orderAfter puts gates on the stream that open once they are queued and done.
        if (!ordered_checked && me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        auto s = c.sendOnStream(src.p, bytes, to, 0, kCopyStream);
        auto r = c.recvOnStream(dst.p, bytes, from, 0, kCopyStream);
        if (!s || !r) return -1.0;
        // The copy stream ordered after both (Work.wait() on CUDA; the first ring's ops may
        // still be pending, the peer's buffers not there yet: then through gates).
        Status st = s->orderAfter(kCopyStream);
        if (st.ok()) st = r->orderAfter(kCopyStream);
        if (!st.ok()) throw std::runtime_error("orderAfter: " + st.toString());
        if (!ordered_checked) {  // what the copy stream reads after it is the message
          ordered_checked = true;
          std::vector<float> early(kFloats);
          st = copyWait(d, early.data(), dst.p, bytes);
          if (!st.ok()) throw std::runtime_error(st.toString());
          for (size_t i = 0; i < kFloats; i += 4099)
            if (early[i] != input(from, i)) ordered_ok = false;
        }
        r->wait();
        s->wait();
      } else {
        c.send(src.p, bytes, to, 3);
        c.recv(hdst.p, bytes, from, 3);
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    double ts = ring(true);
    if (ts < 0)
      return std::string(d.name()) == "cuda"
                 ? std::string("the stream-ordered path was not taken")
                 : "ok: skipped (MC_PG_STREAM_OPS=" +
                       mooncake::params::getString("MC_PG_STREAM_OPS") + " here)";
    double th = ring(false);
    std::vector<float> got(kFloats), want(kFloats);
    st = copyWait(d, got.data(), dst.p, bytes);
    if (st.ok()) st = copyWait(d, want.data(), hdst.p, bytes);
    if (!st.ok()) return st.toString();
    for (size_t i = 0; i < kFloats; ++i)
      if (got[i] != input(from, i) || got[i] != want[i])
        return "element " + std::to_string(i) + " differs";
    if (!ordered_ok) return "a stream ordered after the recv (orderAfter) read it before it ended";
    for (int k = 0; k < 2; ++k) {
      ts = std::min(ts, ring(true));
      th = std::min(th, ring(false));
    }
    char s[160];
    std::snprintf(s, sizeof s, "ok: a ring; stream-ordered %.0f us, host-driven %.0f us (%.2fx)",
                  ts * 1e6, th * 1e6, ts / th);
    return s;
  });
  return rows;
}

int rank(Device& d, int me, uint16_t port, const std::string& secret) {
  auto rdv = mooncake::engine::TcpRendezvousClient::connect("127.0.0.1", port, secret,
                                                            deadlineInMs(10000));
  if (!rdv.ok()) {
    std::fprintf(stderr, "rank %d: rendezvous: %s\n", me, rdv.status().toString().c_str());
    return 20;
  }
  mooncake::engine::EngineOptions o;
  o.name = "pg-check-" + std::to_string(me);
  o.secret = secret;
  o.reach_host = "127.0.0.1";
  auto eng = mooncake::engine::TransferEngine::create(o);
  if (!eng.ok()) {
    std::fprintf(stderr, "rank %d: engine: %s\n", me, eng.status().toString().c_str());
    return 21;
  }
  mooncake::pg::CommOptions co;
  co.rank = me;
  co.size = 2;
  co.group_name = "gpu_check";
  co.timeout = std::chrono::seconds(60);
  std::vector<Row> rows;
  try {
    auto comm = Communicator::create(std::shared_ptr<mooncake::engine::TransferEngine>(std::move(eng).value()),
                                     std::shared_ptr<mooncake::engine::Rendezvous>(std::move(rdv).value()), co);
    rows = runChecks(d, *comm);
    rows.insert(rows.begin(), {"group", true, "2 ranks, path " + comm->path()});
  } catch (const std::exception& e) {
    rows.push_back({"group", false, e.what()});
  }
  if (me == 0) return mooncake::gpucheck::report(rows, d.name(), "") ? 0 : 1;
  for (const auto& r : rows)
    if (!r.ok) {
      std::fprintf(stderr, "rank 1: %s: %s\n", r.check.c_str(), r.detail.c_str());
      return 25;
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Device* layer = mooncake::gpucheck::layerOrSay();
  if (layer == nullptr) return 2;
  if (argc == 4 && std::strcmp(argv[1], "--child") == 0)
    return rank(*layer, 1, static_cast<uint16_t>(std::atoi(argv[2])), argv[3]);
  const std::string secret = mooncake::engine::generateSecret();
  auto server = mooncake::engine::TcpRendezvousServer::start("127.0.0.1", 0, secret);
  if (!server.ok()) {
    mooncake::gpucheck::report({{"setup", false, server.status().message()}}, layer->name(), "");
    return 1;
  }
  std::string port = std::to_string((*server)->port());
  char* args[] = {argv[0], const_cast<char*>("--child"), port.data(),
                  const_cast<char*>(secret.c_str()), nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args, environ) != 0) {
    mooncake::gpucheck::report({{"setup", false, "spawn failed"}}, layer->name(), "");
    return 1;
  }
  int rc = rank(*layer, 0, (*server)->port(), secret);
  int status = -1;
  bool exited = waitpid(pid, &status, 0) == pid && WIFEXITED(status);
  bool child_ok = exited && WEXITSTATUS(status) == 0;
  mooncake::gpucheck::report({{"rank1_exit", child_ok,
                               exited ? "exit " + std::to_string(WEXITSTATUS(status)) : "no exit"}},
                             layer->name(), "");
  return rc == 0 && child_ok ? 0 : 1;
}
