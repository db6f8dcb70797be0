// pg_perf: a quick C++ timing tool for the process group (no torch): forks --world ranks
// (shm, or tcp with --transport tcp) and prints nccl-tests-like rows per op and size:
//   op size_bytes time_us(p50 of per-iteration max over ranks) algbw busbw (GB/s)
// Usage: pg_perf [--world N] [--transport tcp] [--async 1] [--ops allreduce,allgather,alltoall,
//                 broadcast,reduce_scatter,sendrecv] [--sizes 4K,64K,1M,16M] [--min-ms 300]
//                [--hosts aabb] (rank r looks like host letter r: groups spanning hosts)
//                [--device cpu,sim] (buffers in host memory and/or GPU memory of the device
//                layer's simulation, MC_DEVICE=sim: GPU memory is staged, pg/device_stage.h)
//                [--profile 1] (after each row, rank 0's time per op by phase: pg/profile.h)
// Full benchmarks against gloo and MPI: benchmarks/pg_bench.py.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "pg/profile.h"
#include "tests/pg/pg_harness.h"

using namespace mooncake::pg;
using namespace mooncake::pg::test;

namespace {

size_t parseSize(const std::string& s) {
  size_t v = std::strtoull(s.c_str(), nullptr, 10);
  char u = s.empty() ? 0 : s.back();
  if (u == 'K' || u == 'k') v <<= 10;
  if (u == 'M' || u == 'm') v <<= 20;
  if (u == 'G' || u == 'g') v <<= 30;
  return v;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

double busFactor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast" || op == "sendrecv") return 1.0;
  return static_cast<double>(n - 1) / n;
}

}  // namespace

int main(int argc, char** argv) {
  RunOptions o;
  o.world = 2;
  std::vector<std::string> ops = {"allreduce", "allgather", "alltoall", "broadcast",
                                  "reduce_scatter"};
  std::vector<std::string> sizes = {"4K", "64K", "1M", "16M"};
  double min_ms = 300;
  bool async = false;  // run every op through enqueue() + Work::wait, as the torch adapter does
  bool prof = false;
  std::vector<std::string> devices = {"cpu"};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--world") o.world = std::atoi(v.c_str());
    else if (k == "--transport") o.transport = v;
    else if (k == "--ops") ops = split(v);
    else if (k == "--sizes") sizes = split(v);
    else if (k == "--min-ms") min_ms = std::atof(v.c_str());
    else if (k == "--async") async = v == "1";
    else if (k == "--device") devices = split(v);
    else if (k == "--profile") prof = v == "1";
    else if (k == "--hosts") {  // e.g. aabb: rank r pretends to be on host v[r] (MC_HOST_ID)
      o.rank_env = [v](int r) {
        return std::vector<std::pair<std::string, std::string>>{
            {"MC_HOST_ID", std::string("perf-host-") + v.at(static_cast<size_t>(r))}};
      };
    }
  }
  o.deadline_s = 600;
  for (const auto& d : devices) {
    if (d == "sim") o.env.push_back({"MC_DEVICE", "sim"});
    else if (d != "cpu") {
      std::fprintf(stderr, "pg_perf: --device %s: expected cpu or sim\n", d.c_str());
      return 2;
    }
  }
  auto codes = runRanks(o, [&](RankEnv& env) {
    Communicator& c = *env.comm;
    const int n = c.size();
    for (const auto& dev : devices)
    for (const auto& op : ops) {
      for (const auto& sz : sizes) {
        const size_t bytes = parseSize(sz);  // per-rank payload (nccl-tests "size")
        const size_t count = bytes / 4;
        std::vector<float> host_in(count * n + 16, 1.0f), host_out(count * n + 16, 0.0f);
        // "in" and "out": host vectors, or GPU memory of the simulated layer holding the same.
        struct Span {
          float* p;
          float* data() const { return p; }
        } in{host_in.data()}, out{host_out.data()};
        void* gpu_in = nullptr;
        void* gpu_out = nullptr;
        auto layer = mooncake::engine::device::get();
        if (dev == "sim") {
          if (!layer.ok()) throw std::runtime_error(layer.status().toString());
          const size_t nb = host_in.size() * 4;
          auto a = (*layer)->allocate(nb, 0), b = (*layer)->allocate(nb, 0);
          if (!a.ok() || !b.ok()) throw std::runtime_error("pg_perf: sim device allocation");
          gpu_in = *a;
          gpu_out = *b;
          (void)mooncake::engine::device::copy(gpu_in, host_in.data(), nb, mooncake::engine::deadlineInMs(30000));
          in.p = static_cast<float*>(gpu_in);
          out.p = static_cast<float*>(gpu_out);
        }
        std::vector<size_t> blk(n, bytes / n), offs(n);
        for (int j = 0; j < n; ++j) offs[j] = j * (bytes / n);
        auto run = [&] {
          if (op == "allreduce")
            c.allReduce(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum);
          else if (op == "allgather")
            c.allGather(in.data(), out.data(), bytes / n);
          else if (op == "alltoall")
            c.allToAllV(in.data(), blk, offs, out.data(), blk, offs);
          else if (op == "broadcast")
            c.broadcast(in.data(), bytes, 0);
          else if (op == "reduce_scatter")
            c.reduceScatter(in.data(), out.data(), count / n, DataType::kFloat32, ReduceOp::kSum);
          else if (op == "sendrecv") {  // a ring: to the next rank, from the previous one
            c.send(in.data(), bytes, (c.rank() + 1) % n, 1);
            (void)c.recv(out.data(), bytes, (c.rank() + n - 1) % n, 1);
          }
        };
        auto once = [&] {
          if (async) {
            c.enqueue(op, run)->wait(std::chrono::seconds(60));
          } else {
            run();
          }
        };
        for (int w = 0; w < 5; ++w) once();
        // Iterations: enough for min_ms, decided by rank 0 and shared with a broadcast.
        int64_t t0 = monotonicNs();
        once();
        int64_t one = std::max<int64_t>(monotonicNs() - t0, 1000);
        int64_t iters = std::clamp<int64_t>(static_cast<int64_t>(min_ms * 1e6 / one), 5, 20000);
        c.broadcast(&iters, sizeof(iters), 0);
        std::vector<double> ts;
        ts.reserve(iters);
        c.barrier();
        if (prof) {
          profile::setEnabled(true);
          (void)profile::take(true);
        }
        for (int64_t i = 0; i < iters; ++i) {
          int64_t a = monotonicNs();
          once();
          ts.push_back((monotonicNs() - a) / 1e3);
        }
        profile::Totals phases;
        if (prof) {
          phases = profile::take(true);
          profile::setEnabled(false);
        }
        // Per-iteration time as the slowest rank saw it.
        std::vector<double> mx(ts.size());
        c.allReduce(ts.data(), mx.data(), ts.size(), DataType::kFloat64, ReduceOp::kMax);
        std::sort(mx.begin(), mx.end());
        double p50 = mx[mx.size() / 2], p99 = mx[std::min(mx.size() - 1, mx.size() * 99 / 100)];
        if (c.rank() == 0) {
          double algbw = bytes / (p50 * 1e-6) / 1e9;
          std::printf("%-15s %-3s n=%d %10zu B  p50 %10.2f us  p99 %10.2f us  algbw %7.3f  busbw %7.3f GB/s\n",
                      op.c_str(), dev.c_str(), n, bytes, p50, p99, algbw, algbw * busFactor(op, n));
          if (prof) std::printf("  rank 0 by phase: %s\n", profile::format(phases).c_str());
          std::fflush(stdout);
        }
        if (gpu_in != nullptr) {
          (void)(*layer)->free(gpu_in);
          (void)(*layer)->free(gpu_out);
        }
      }
    }
  });
  for (int c : codes)
    if (c != 0) return 1;
  return 0;
}
