// te_bench: one-sided READ/WRITE throughput and latency of the transfer engine between two
// processes on this host, per transport, with memcpy and raw-socket baselines measured in
// the same run (so ratios survive a noisy machine).
//
// Usage:
//   build/benchmarks/te_bench [--transport shm,tcp] [--op read,write]
//                             [--sizes 4K,64K,1M,16M,64M] [--threads N] [--batch N]
//                             [--iters N] [--warmup N] [--rtt-iters N] [--json FILE]
//                             [--no-notify-rtt] [--no-baselines]
//
//   --transport   comma list of transports to force (shm, tcp, rdma); default shm,tcp
//   --nic-gbps    rdma on the verbs emulator: each emulated NIC's cap in Gbit/s (default 16)
//   --op          comma list of read, write; default both
//   --sizes       request sizes, K/M/G binary suffixes; default 4K,64K,1M,16M,64M
//   --threads     submitting threads in the initiator (default 1); each owns its buffers
//   --batch       requests per submitted batch (default 1); latency is per batch
//   --iters       timed batches per thread and size; 0 (default) = about 1 GiB per size,
//                 clamped to [20, 2000]
//   --warmup      untimed batches before each measurement; default iters/10, at least 2
//   --rtt-iters   round trips of the notify measurement (default 2000)
//   --json FILE   also write every row as a JSON array of {"transport","op","bytes","gbps",
//                 "p50_us","p99_us","gbps_p50","iters","threads","batch"}; gbps_p50 is the
//                 bandwidth implied by the median batch (robust on a loaded machine)
//   --notify-rtt / --no-notify-rtt   the 4 KiB write + notify round trip (default on)
//   --baselines / --no-baselines     memcpy and socket rows (default on)
//
// How it measures. The process forks a target (this binary, `--role target`) per transport.
// The target allocates a registered buffer with engine->allocate(), publishes its segment
// through a TcpRendezvousServer this process runs on 127.0.0.1 (port 0), and answers
// notifications. The initiator opens it with EngineOptions.transport forced and times
// submit()+wait() of each batch: p50/p99 are per-batch latencies; GB/s is
// bytes moved / wall time of all threads' timed batches (1 GB = 1e9 bytes).
// Notify RTT: write 4 KiB, notify(peer, seq) without waiting for the write, the target
// answers notify(seq); the time from the write's submit to the answer is one sample.
// Baselines: "memcpy" = single-thread memcpy between two touched buffers of the same size;
// "socket" = one TCP connection over loopback between two processes (4 MiB socket buffers,
// TCP_NODELAY), the sender sends `size` bytes and waits for a 1-byte ack per message, i.e.
// the same one-request-in-flight pattern as the engine rows.
// The table ends with ratios: shm write vs memcpy and tcp write vs socket at the largest
// size both measured.
// rdma: on a machine without an RDMA NIC te_bench runs itself again on the verbs emulator
// (tests/fakes/verbs, 2 NICs capped at --nic-gbps; te_rdma.h). Engine rows use one NIC
// (MC_RDMA_DEVICES = the first), the largest size also both ("nics" in the JSON); the
// baseline "verbs_raw" posts and polls the same WRITEs on one raw RC QP of the first NIC
// without the engine (1 MiB work requests, 64 outstanding: the engine's defaults),
// "write_rtt" is one 4 KiB WRITE until its completion (the raw round trip issue 10 compares
// the engine's notify_rtt to), and verbs_raw "notify_rtt" is the engine's notify_rtt done
// with raw verbs: a 4 KiB WRITE and a 16-byte SEND behind it, the target's thread polls its
// CQ (yielding between empty polls, so that the emulator's NIC threads get a core) and
// answers with a SEND.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <atomic>
#include <cinttypes>
#include <fstream>
#include <thread>

#include "benchmarks/te_common.h"
#include "mooncake/config.h"
#if MC_HAVE_RDMA
#include "benchmarks/te_rdma.h"
#include "tests/fakes/verbs/fake_verbs_control.h"
#endif

namespace mb = mooncake::bench;
namespace me = mooncake::engine;
using mooncake::Status;

namespace {

struct Options {
  std::vector<std::string> transports{"shm", "tcp"};
  std::vector<std::string> ops{"read", "write"};
  std::vector<uint64_t> sizes{4ull << 10, 64ull << 10, 1ull << 20, 16ull << 20, 64ull << 20};
  int threads = 1;
  int batch = 1;
  int iters = 0;
  int warmup = -1;
  int rtt_iters = 2000;
  std::string json;
  double nic_gbps = 16;
  std::string emulator_conf, emulator_fabric;  // set when te_bench restarted on the emulator
  bool notify_rtt = true;
  bool baselines = true;
  // Roles other than the initiator (internal flags).
  std::string role;
  uint16_t rdv_port = 0;
  uint16_t sock_port = 0;
  std::string name;
  std::string target_transport;
  uint64_t target_bytes = 0;
};

struct Row {
  std::string transport;
  std::string op;
  uint64_t bytes = 0;
  double gbps = 0;
  double p50_us = 0;
  double p99_us = 0;
  int iters = 0;
  int threads = 1;
  int batch = 1;
  int nics = 0;  // rdma rows: NICs used
};

[[noreturn]] void usage(const char* msg) {
  if (msg != nullptr) std::fprintf(stderr, "te_bench: %s\n", msg);
  std::fprintf(stderr,
               "usage: te_bench [--transport shm,tcp,rdma] [--nic-gbps G] [--op read,write] "
               "[--sizes 4K,64K,1M,16M,64M]\n"
               "                [--threads N] [--batch N] [--iters N] [--warmup N] "
               "[--rtt-iters N]\n"
               "                [--json FILE] [--no-notify-rtt] [--no-baselines]\n");
  std::exit(msg == nullptr ? 0 : 2);
}

int toInt(const std::string& s, const char* flag) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0' || v < 0) {
    std::string m = std::string("bad value for ") + flag + ": " + s;
    usage(m.c_str());
  }
  return static_cast<int>(v);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(nullptr);
    } else if (a == "--transport") {
      o.transports = mb::splitComma(next());
      for (auto& t : o.transports)
        if (t != "shm" && t != "tcp" && t != "rdma") usage(("unknown transport " + t).c_str());
    } else if (a == "--emulator-conf") {
      o.emulator_conf = next();
    } else if (a == "--emulator-fabric") {
      o.emulator_fabric = next();
    } else if (a == "--nic-gbps") {
      o.nic_gbps = std::strtod(next().c_str(), nullptr);
    } else if (a == "--op") {
      o.ops = mb::splitComma(next());
      for (auto& t : o.ops)
        if (t != "read" && t != "write") usage(("unknown op " + t).c_str());
    } else if (a == "--sizes") {
      o.sizes.clear();
      for (auto& s : mb::splitComma(next())) {
        uint64_t b = mb::parseSize(s);
        if (b == 0) usage(("bad size " + s).c_str());
        // Buffers live in /dev/shm (tmpfs): a size past it would SIGBUS, not fail cleanly.
        if (b > (4ull << 30)) usage(("size " + s + " is over the 4G limit").c_str());
        o.sizes.push_back(b);
      }
    } else if (a == "--threads") {
      o.threads = std::max(1, toInt(next(), "--threads"));
    } else if (a == "--batch") {
      o.batch = std::max(1, toInt(next(), "--batch"));
    } else if (a == "--iters") {
      o.iters = toInt(next(), "--iters");
    } else if (a == "--warmup") {
      o.warmup = toInt(next(), "--warmup");
    } else if (a == "--rtt-iters") {
      o.rtt_iters = std::max(1, toInt(next(), "--rtt-iters"));
    } else if (a == "--json") {
      o.json = next();
    } else if (a == "--notify-rtt") {
      o.notify_rtt = true;
    } else if (a == "--no-notify-rtt") {
      o.notify_rtt = false;
    } else if (a == "--baselines") {
      o.baselines = true;
    } else if (a == "--no-baselines") {
      o.baselines = false;
    } else if (a == "--role") {
      o.role = next();
    } else if (a == "--rdv-port") {
      o.rdv_port = static_cast<uint16_t>(toInt(next(), "--rdv-port"));
    } else if (a == "--sock-port") {
      o.sock_port = static_cast<uint16_t>(toInt(next(), "--sock-port"));
    } else if (a == "--name") {
      o.name = next();
    } else if (a == "--target-bytes") {
      o.target_bytes = mb::parseSize(next());
    } else if (a == "--max-bytes") {
      o.target_bytes = mb::parseSize(next());
    } else if (a == "--target-transport") {
      o.target_transport = next();
    } else {
      usage(("unknown flag " + a).c_str());
    }
  }
  if (o.sizes.empty()) usage("no sizes");
  return o;
}

int itersFor(const Options& o, uint64_t size) {
  if (o.iters > 0) return o.iters;
  uint64_t per = size * static_cast<uint64_t>(o.batch);
  uint64_t n = (1ull << 30) / std::max<uint64_t>(per, 1);
  return static_cast<int>(std::clamp<uint64_t>(n, 20, 2000));
}

int warmupFor(const Options& o, int iters) {
  if (o.warmup >= 0) return o.warmup;
  return std::max(2, iters / 10);
}

uint64_t maxSize(const Options& o) { return *std::max_element(o.sizes.begin(), o.sizes.end()); }

// Buffer bytes for `slots` requests of the largest size, capped so that threads x batch
// does not ask for gigabytes; requests wrap around the slots that fit.
uint64_t bufferBytes(const Options& o) {
  uint64_t slots = static_cast<uint64_t>(o.threads) * static_cast<uint64_t>(o.batch);
  uint64_t want = maxSize(o) * slots;
  uint64_t cap = std::max<uint64_t>(maxSize(o), 512ull << 20);
  return std::min(want, cap);
}

// ---------------------------------------------------------------- engine measurements

Row measureEngine(me::TransferEngine& eng, const mb::TargetHandle& t, char* local,
                  uint64_t local_len, const std::string& transport, me::OpCode op, uint64_t size,
                  const Options& o) {
  const int iters = itersFor(o, size);
  const int warm = warmupFor(o, iters);
  const uint64_t lslots = std::max<uint64_t>(1, local_len / size);
  const uint64_t rslots = std::max<uint64_t>(1, t.remote_len / size);

  auto makeBatch = [&](int thread) {
    std::vector<me::TransferRequest> reqs;
    for (int b = 0; b < o.batch; ++b) {
      uint64_t slot = static_cast<uint64_t>(thread) * o.batch + b;
      me::TransferRequest r;
      r.op = op;
      r.local = local + (slot % lslots) * size;
      r.length = size;
      r.peer = t.peer;
      r.remote = t.remote + (slot % rslots) * size;
      reqs.push_back(r);
    }
    return reqs;
  };

  auto runOne = [&](const std::vector<me::TransferRequest>& reqs) -> Status {
    auto id = eng.submit(reqs);
    if (!id.ok()) return id.status();
    return eng.wait(id.value(), me::deadlineInMs(120000));
  };

  {
    auto reqs = makeBatch(0);
    for (int i = 0; i < warm; ++i) mb::must(runOne(reqs), "warm-up " + transport);
  }

  std::vector<std::vector<double>> lat(o.threads);
  std::atomic<bool> go{false};
  std::atomic<int> ready{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> workers;
  for (int th = 0; th < o.threads; ++th) {
    workers.emplace_back([&, th] {
      auto reqs = makeBatch(th);
      lat[th].reserve(iters);
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (int i = 0; i < iters; ++i) {
        double t0 = mb::nowUs();
        Status st = runOne(reqs);
        double t1 = mb::nowUs();
        if (!st.ok()) {
          std::fprintf(stderr, "%s %s %s: %s\n", transport.c_str(),
                       op == me::OpCode::kRead ? "read" : "write", mb::fmtSize(size).c_str(),
                       st.toString().c_str());
          failed.store(true);
          return;
        }
        lat[th].push_back(t1 - t0);
      }
    });
  }
  while (ready.load() < o.threads) std::this_thread::yield();
  double start = mb::nowUs();
  go.store(true, std::memory_order_release);
  for (auto& w : workers) w.join();
  double end = mb::nowUs();
  if (failed.load()) std::exit(2);

  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  Row r;
  r.transport = transport;
  r.op = op == me::OpCode::kRead ? "read" : "write";
  r.bytes = size;
  double bytes = static_cast<double>(size) * o.batch * iters * o.threads;
  r.gbps = bytes / ((end - start) * 1e-6) / 1e9;
  r.p50_us = mb::percentile(all, 50);
  r.p99_us = mb::percentile(all, 99);
  r.iters = iters;
  r.threads = o.threads;
  r.batch = o.batch;
  return r;
}

// 4 KiB write, then notify(seq) right away (ordered after the write), then the answer.
Row measureNotifyRtt(me::TransferEngine& eng, const mb::TargetHandle& t, char* local,
                     const std::string& transport, const Options& o) {
  const uint64_t size = 4096;
  me::TransferRequest r{me::OpCode::kWrite, local, size, t.peer, t.remote};
  std::vector<me::TransferRequest> reqs{r};
  std::vector<double> lat;
  lat.reserve(o.rtt_iters);
  const int warm = std::max(10, o.rtt_iters / 10);
  double total = 0;
  for (int i = 0; i < warm + o.rtt_iters; ++i) {
    uint64_t seq = static_cast<uint64_t>(i) + 1;
    double t0 = mb::nowUs();
    auto id = mb::must(eng.submit(reqs), "rtt submit");
    mb::must(eng.notify(t.peer, seq), "rtt notify");
    mb::must(mb::awaitAnswer(eng, seq, me::deadlineInMs(30000)), "rtt answer");
    double t1 = mb::nowUs();
    mb::must(eng.wait(id, me::deadlineInMs(30000)), "rtt write");
    if (i >= warm) {
      lat.push_back(t1 - t0);
      total += t1 - t0;
    }
  }
  Row row;
  row.transport = transport;
  row.op = "notify_rtt";
  row.bytes = size;
  row.gbps = static_cast<double>(size) * o.rtt_iters / (total * 1e-6) / 1e9;
  row.p50_us = mb::percentile(lat, 50);
  row.p99_us = mb::percentile(lat, 99);
  row.iters = o.rtt_iters;
  return row;
}

std::vector<Row> benchTransport(const std::string& transport, me::Rendezvous& rdv,
                                uint16_t rdv_port, const Options& o, int nics = 0) {
  me::EngineOptions eo;
  eo.name = "tebench-init-" + transport + "-" + std::to_string(getpid());
  eo.transport = transport;
  auto eng = mb::must(me::TransferEngine::create(eo), "create engine (" + transport + ")");
  const uint64_t len = bufferBytes(o);
  mb::TargetHandle t = mb::startTarget(*eng, rdv, rdv_port, transport, len);
  char* local = static_cast<char*>(mb::must(eng->allocate(len), "allocate local buffer"));
  for (uint64_t i = 0; i < len; ++i) local[i] = static_cast<char>(i * 131 + 7);

  std::vector<Row> rows;
  for (const auto& op : o.ops) {
    me::OpCode code = op == "read" ? me::OpCode::kRead : me::OpCode::kWrite;
    for (uint64_t size : o.sizes) {
      Row r = measureEngine(*eng, t, local, len, transport, code, size, o);
      r.nics = nics;
      std::printf("  %-6s %-10s %8s %10.3f %10.1f %10.1f\n", r.transport.c_str(), r.op.c_str(),
                  mb::fmtSize(r.bytes).c_str(), r.gbps, r.p50_us, r.p99_us);
      std::fflush(stdout);
      rows.push_back(r);
    }
  }
  if (o.notify_rtt) {
    Row r = measureNotifyRtt(*eng, t, local, transport, o);
    r.nics = nics;
    std::printf("  %-6s %-10s %8s %10.3f %10.1f %10.1f\n", r.transport.c_str(), r.op.c_str(),
                mb::fmtSize(r.bytes).c_str(), r.gbps, r.p50_us, r.p99_us);
    rows.push_back(r);
  }
  if (!mb::stopTarget(*eng, t))
    std::fprintf(stderr, "warning: target %s did not exit cleanly\n", t.name.c_str());
  mb::must(eng->free(local), "free local buffer");
  return rows;
}

#if MC_HAVE_RDMA
// ---------------------------------------------------------------- rdma

std::vector<std::string> rdmaNics() {
  std::vector<std::string> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int i = 0; list != nullptr && i < n; ++i) out.push_back(ibv_get_device_name(list[i]));
  if (list != nullptr) ibv_free_device_list(list);
  return out;
}

void printRow(const Row& r) {
  std::printf("  %-9s %-10s %8s %10.3f %10.1f %10.1f   nics=%d\n", r.transport.c_str(),
              r.op.c_str(), mb::fmtSize(r.bytes).c_str(), r.gbps, r.p50_us, r.p99_us, r.nics);
  std::fflush(stdout);
}

// Raw verbs on the first NIC, then the engine on that NIC alone, then the engine on every NIC
// at the largest size (the striping row).
std::vector<Row> benchRdma(me::Rendezvous& rdv, uint16_t rdv_port, const Options& o) {
  const std::vector<std::string> nics = rdmaNics();
  if (nics.empty()) {
    std::fprintf(stderr, "te_bench: libibverbs lists no NIC\n");
    std::exit(2);
  }
  std::vector<Row> rows;
  auto raw_row = [&](const char* op, uint64_t size, const mb::rdma::RawResult& res) {
    if (res.iters == 0) {  // the raw loop failed (it said why) or its target did
      std::fprintf(stderr, "te_bench: the raw-verbs %s of %s failed\n", op,
                   mb::fmtSize(size).c_str());
      std::exit(2);
    }
    Row r;
    r.transport = "verbs_raw";
    r.op = op;
    r.bytes = size;
    r.gbps = res.gbps;
    r.p50_us = res.p50_us;
    r.p99_us = res.p99_us;
    r.iters = res.iters;
    r.nics = 1;
    printRow(r);
    rows.push_back(r);
  };
  if (o.baselines) {
    mb::rdma::RawInitiator raw;
    if (!raw.start(nics[0], maxSize(o), 64)) {
      std::fprintf(stderr, "te_bench: raw verbs setup on %s failed\n", nics[0].c_str());
      std::exit(2);
    }
    for (uint64_t size : o.sizes) {
      const int iters = itersFor(o, size);
      raw_row("write", size, raw.write(size, 1u << 20, iters, warmupFor(o, iters)));
    }
    if (o.notify_rtt) {
      const int warm = std::max(10, o.rtt_iters / 10);
      raw_row("write_rtt", 4096, raw.write(4096, 4096, o.rtt_iters, warm));
      raw_row("notify_rtt", 4096, raw.pingPong(o.rtt_iters, warm));
    }
  }
  setenv("MC_RDMA_DEVICES", nics[0].c_str(), 1);  // the engine (and its target) on one NIC
  auto one = benchTransport("rdma", rdv, rdv_port, o, 1);
  unsetenv("MC_RDMA_DEVICES");
  rows.insert(rows.end(), one.begin(), one.end());
  if (nics.size() > 1) {
    Options big = o;
    big.sizes = {maxSize(o)};
    big.notify_rtt = false;
    auto all = benchTransport("rdma", rdv, rdv_port, big, static_cast<int>(nics.size()));
    rows.insert(rows.end(), all.begin(), all.end());
  }
  return rows;
}

const Row* findNics(const std::vector<Row>& rows, const std::string& transport,
                    const std::string& op, uint64_t bytes, int nics) {
  for (const auto& r : rows)
    if (r.transport == transport && r.op == op && r.bytes == bytes && r.nics == nics) return &r;
  return nullptr;
}

// What issue 10's benchmark asks: engine vs raw per size, striping, notify round trip.
void printRdmaRatios(const std::vector<Row>& rows) {
  for (const auto& r : rows) {
    if (r.transport != "rdma" || r.op != "write" || r.nics != 1) continue;
    const Row* raw = findNics(rows, "verbs_raw", "write", r.bytes, 1);
    if (raw != nullptr && raw->gbps > 0)
      std::printf("ratio: rdma write %s / verbs_raw = %.3f / %.3f GB/s = %.2fx (by p50: %.2fx)\n",
                  mb::fmtSize(r.bytes).c_str(), r.gbps, raw->gbps, r.gbps / raw->gbps,
                  raw->p50_us / r.p50_us);
    for (const auto& s : rows)
      if (s.transport == "rdma" && s.op == "write" && s.bytes == r.bytes && s.nics > 1 &&
          r.gbps > 0)
        std::printf("ratio: rdma write %s on %d NICs / on 1 = %.3f / %.3f GB/s = %.2fx\n",
                    mb::fmtSize(r.bytes).c_str(), s.nics, s.gbps, r.gbps, s.gbps / r.gbps);
  }
  const Row* rtt = findNics(rows, "rdma", "notify_rtt", 4096, 1);
  const Row* raw_rtt = findNics(rows, "verbs_raw", "write_rtt", 4096, 1);
  if (rtt != nullptr && raw_rtt != nullptr && raw_rtt->p50_us > 0)
    std::printf("ratio: rdma 4K write+notify round trip p50 / raw write round trip p50 = %.1f / "
                "%.1f us = %.2fx\n", rtt->p50_us, raw_rtt->p50_us, rtt->p50_us / raw_rtt->p50_us);
  const Row* raw_pp = findNics(rows, "verbs_raw", "notify_rtt", 4096, 1);
  if (rtt != nullptr && raw_pp != nullptr && raw_pp->p50_us > 0)
    std::printf("ratio: rdma 4K write+notify round trip p50 / raw write+send ping-pong p50 = "
                "%.1f / %.1f us = %.2fx\n", rtt->p50_us, raw_pp->p50_us,
                rtt->p50_us / raw_pp->p50_us);
}
#endif

// ---------------------------------------------------------------- baselines

std::vector<Row> benchMemcpy(const Options& o) {
  const uint64_t len = maxSize(o);
  std::vector<char> src(len), dst(len);
  for (uint64_t i = 0; i < len; ++i) src[i] = static_cast<char>(i * 131 + 7);
  std::memset(dst.data(), 0, len);
  std::vector<Row> rows;
  for (uint64_t size : o.sizes) {
    const int iters = itersFor(o, size) * o.batch;
    const int warm = warmupFor(o, iters);
    for (int i = 0; i < warm; ++i) {
      std::memcpy(dst.data(), src.data(), size);
      mb::clobber(dst.data());
    }
    std::vector<double> lat;
    lat.reserve(iters);
    double start = mb::nowUs();
    for (int i = 0; i < iters; ++i) {
      double t0 = mb::nowUs();
      std::memcpy(dst.data(), src.data(), size);
      mb::clobber(dst.data());
      lat.push_back(mb::nowUs() - t0);
    }
    double end = mb::nowUs();
    Row r;
    r.transport = "memcpy";
    r.op = "copy";
    r.bytes = size;
    r.gbps = static_cast<double>(size) * iters / ((end - start) * 1e-6) / 1e9;
    r.p50_us = mb::percentile(lat, 50);
    r.p99_us = mb::percentile(lat, 99);
    r.iters = iters;
    rows.push_back(r);
  }
  return rows;
}

void tuneSocket(int fd) {
  int one = 1;
  int big = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
}

bool sendAll(int fd, const char* p, uint64_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<uint64_t>(k);
  }
  return true;
}

bool recvAll(int fd, char* p, uint64_t n) {
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<uint64_t>(k);
  }
  return true;
}

// The receiving process of the socket baseline: per round {size, count} header, then
// count messages of size bytes, each acknowledged with one byte. size 0 ends.
int runSocketSink(const Options& o) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  tuneSocket(fd);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(o.sock_port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    std::perror("socket sink: connect");
    return 2;
  }
  std::vector<char> buf(std::max<uint64_t>(o.target_bytes, 1));
  std::memset(buf.data(), 0, buf.size());
  while (true) {
    uint64_t hdr[2];
    if (!recvAll(fd, reinterpret_cast<char*>(hdr), sizeof hdr)) return 2;
    if (hdr[0] == 0) break;
    if (hdr[0] > buf.size()) return 2;
    for (uint64_t i = 0; i < hdr[1]; ++i) {
      if (!recvAll(fd, buf.data(), hdr[0])) return 2;
      char ack = 1;
      if (!sendAll(fd, &ack, 1)) return 2;
    }
  }
  close(fd);
  return 0;
}

std::vector<Row> benchSocket(const Options& o) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof a;
  if (bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen) != 0) {
    std::perror("socket baseline: listen");
    std::exit(2);
  }
  const uint64_t len = maxSize(o);
  pid_t child =
      mb::spawnSelf({"--role", "socket-sink", "--sock-port", std::to_string(ntohs(a.sin_port)),
                     "--max-bytes", std::to_string(len)});
  int fd = accept(lfd, nullptr, nullptr);
  close(lfd);
  if (fd < 0) {
    std::perror("socket baseline: accept");
    std::exit(2);
  }
  tuneSocket(fd);
  std::vector<char> src(len);
  for (uint64_t i = 0; i < len; ++i) src[i] = static_cast<char>(i * 131 + 7);

  std::vector<Row> rows;
  for (uint64_t size : o.sizes) {
    const int iters = itersFor(o, size) * o.batch;
    const int warm = warmupFor(o, iters);
    uint64_t hdr[2] = {size, static_cast<uint64_t>(warm + iters)};
    if (!sendAll(fd, reinterpret_cast<char*>(hdr), sizeof hdr)) std::exit(2);
    std::vector<double> lat;
    double start = 0;
    for (int i = 0; i < warm + iters; ++i) {
      if (i == warm) start = mb::nowUs();
      double t0 = mb::nowUs();
      char ack = 0;
      if (!sendAll(fd, src.data(), size) || !recvAll(fd, &ack, 1)) {
        std::fprintf(stderr, "socket baseline: connection lost\n");
        std::exit(2);
      }
      if (i >= warm) lat.push_back(mb::nowUs() - t0);
    }
    double end = mb::nowUs();
    Row r;
    r.transport = "socket";
    r.op = "write";
    r.bytes = size;
    r.gbps = static_cast<double>(size) * iters / ((end - start) * 1e-6) / 1e9;
    r.p50_us = mb::percentile(lat, 50);
    r.p99_us = mb::percentile(lat, 99);
    r.iters = iters;
    rows.push_back(r);
  }
  uint64_t fin[2] = {0, 0};
  (void)sendAll(fd, reinterpret_cast<char*>(fin), sizeof fin);
  close(fd);
  if (mb::waitChild(child, 15000) != 0) std::fprintf(stderr, "warning: socket sink failed\n");
  return rows;
}

// ---------------------------------------------------------------- output

const Row* findRow(const std::vector<Row>& rows, const std::string& transport,
                   const std::string& op, uint64_t bytes) {
  for (const auto& r : rows)
    if (r.transport == transport && r.op == op && r.bytes == bytes) return &r;
  return nullptr;
}

void printRatio(const std::vector<Row>& rows, const std::string& tr, const std::string& base,
                const std::string& base_op) {
  // The largest size measured by both.
  const Row* a = nullptr;
  const Row* b = nullptr;
  for (const auto& r : rows) {
    if (r.transport != tr || r.op != "write") continue;
    const Row* other = findRow(rows, base, base_op, r.bytes);
    if (other != nullptr && (a == nullptr || r.bytes > a->bytes)) {
      a = &r;
      b = other;
    }
  }
  if (a == nullptr || b->gbps <= 0 || a->p50_us <= 0) return;
  // The p50-based ratio is the one that survives a noisy machine (one preempted iteration
  // moves the mean, not the median).
  std::printf(
      "ratio: %s write %s / %s %s = %.3f GB/s / %.3f GB/s = %.2fx (by p50 latency: "
      "%.2fx)\n",
      tr.c_str(), mb::fmtSize(a->bytes).c_str(), base.c_str(), mb::fmtSize(b->bytes).c_str(),
      a->gbps, b->gbps, a->gbps / b->gbps, b->p50_us / a->p50_us);
}

// Bandwidth implied by the median batch: bytes in flight per batch (all threads) / p50.
double gbpsAtP50(const Row& r) {
  if (r.p50_us <= 0) return 0;
  return static_cast<double>(r.bytes) * r.batch * r.threads / (r.p50_us * 1e-6) / 1e9;
}

bool writeJson(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream f(path);
  if (!f) return false;
  f << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "  {\"transport\": \"%s\", \"op\": \"%s\", \"bytes\": %" PRIu64
                  ", \"gbps\": %.4f, \"p50_us\": %.2f, \"p99_us\": %.2f, \"gbps_p50\": %.4f, "
                  "\"iters\": %d, \"threads\": %d, \"batch\": %d, \"nics\": %d}%s\n",
                  r.transport.c_str(), r.op.c_str(), r.bytes, r.gbps, r.p50_us, r.p99_us,
                  gbpsAtP50(r), r.iters, r.threads, r.batch, r.nics,
                  i + 1 < rows.size() ? "," : "");
    f << buf;
  }
  f << "]\n";
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  (void)mb::jobSecret();  // before any thread: targets inherit MC_SECRET
  Options o = parse(argc, argv);
  if (o.role == "target")
    return mb::runTarget(o.rdv_port, o.name, o.target_transport, o.target_bytes);
  if (o.role == "socket-sink") return runSocketSink(o);
#if MC_HAVE_RDMA
  if (o.role == "verbs-target") return mb::rdma::runRawTarget(o.sock_port, o.name, o.target_bytes, 64);
  const bool want_rdma =
      std::find(o.transports.begin(), o.transports.end(), "rdma") != o.transports.end();
  if (want_rdma && o.role.empty()) mb::rdma::useEmulatorIfNoNic(argc, argv, o.nic_gbps);
#else
  if (std::find(o.transports.begin(), o.transports.end(), "rdma") != o.transports.end())
    usage("this build has no rdma (MC_WITH_RDMA=OFF)");
#endif
  if (!o.role.empty()) usage(("unknown role " + o.role).c_str());

  std::printf("te_bench: threads=%d batch=%d (p50/p99 are per-batch latencies; GB/s = 1e9 B/s)\n",
              o.threads, o.batch);
  std::printf("  %-6s %-10s %8s %10s %10s %10s\n", "trans", "op", "size", "GB/s", "p50 us",
              "p99 us");
  std::vector<Row> rows;
  // Baselines first: this process is still single-threaded, and they set the scale.
  if (o.baselines) {
    for (auto& r : benchMemcpy(o)) {
      std::printf("  %-6s %-10s %8s %10.3f %10.1f %10.1f\n", r.transport.c_str(), r.op.c_str(),
                  mb::fmtSize(r.bytes).c_str(), r.gbps, r.p50_us, r.p99_us);
      rows.push_back(r);
    }
    for (auto& r : benchSocket(o)) {
      std::printf("  %-6s %-10s %8s %10.3f %10.1f %10.1f\n", r.transport.c_str(), r.op.c_str(),
                  mb::fmtSize(r.bytes).c_str(), r.gbps, r.p50_us, r.p99_us);
      rows.push_back(r);
    }
    std::fflush(stdout);
  }

  const std::string secret = mb::jobSecret();
  auto server =
      mb::must(me::TcpRendezvousServer::start("127.0.0.1", 0, secret), "rendezvous server");
  auto rdv = mb::must(
      me::TcpRendezvousClient::connect("127.0.0.1", server->port(), secret, me::deadlineInMs(10000)),
      "rendezvous client");
  for (const auto& t : o.transports) {
#if MC_HAVE_RDMA
    if (t == "rdma") {
      auto r = benchRdma(*rdv, server->port(), o);
      rows.insert(rows.end(), r.begin(), r.end());
      continue;
    }
#endif
    auto r = benchTransport(t, *rdv, server->port(), o);
    rows.insert(rows.end(), r.begin(), r.end());
  }
#if MC_HAVE_RDMA
  printRdmaRatios(rows);
  if (!o.emulator_conf.empty()) {  // what useEmulatorIfNoNic set up
    std::remove(o.emulator_conf.c_str());
    mooncake::fakeverbs::removeFabricFiles(o.emulator_fabric);
  }
#endif

  printRatio(rows, "shm", "memcpy", "copy");
  printRatio(rows, "tcp", "socket", "write");
  if (!o.json.empty()) {
    if (!writeJson(o.json, rows)) {
      std::fprintf(stderr, "te_bench: cannot write %s\n", o.json.c_str());
      return 2;
    }
    std::printf("wrote %zu rows to %s\n", rows.size(), o.json.c_str());
  }
  return 0;
}
