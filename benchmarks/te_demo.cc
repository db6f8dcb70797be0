// te_demo: the transfer engine end to end between two processes, for shm and then tcp.
//
// Usage: build/benchmarks/te_demo [--transport shm,tcp] [--bytes 64M] [--iters 5]
//                                 [--rtt-iters 1000]
// (scripts/demo.sh builds the project and runs this.)
//
// For each transport the demo starts a peer process (this binary, `--role target`), which
// allocates a registered 64 MiB buffer and publishes its segment through a TCP rendezvous
// server this process runs on 127.0.0.1 (port 0). Then, with the transport forced on both
// sides, it
//   1. WRITEs a pattern into the peer's buffer (timed, GB/s),
//   2. sends a notify that asks the peer for a checksum of its buffer: the notify is ordered
//      after the writes, so the peer must see every byte; it answers with a notify,
//   3. READs the buffer back into a zeroed local buffer (timed) and compares byte for byte,
//   4. measures the notify round trip (notify -> the peer answers with a notify), p50/p99.
// It prints a table and exits non-zero when any check failed.
#include <cinttypes>

#include "benchmarks/te_common.h"

namespace mb = mooncake::bench;
namespace me = mooncake::engine;
using mooncake::Status;

namespace {

struct Options {
  std::vector<std::string> transports{"shm", "tcp"};
  uint64_t bytes = 64ull << 20;
  int iters = 5;
  int rtt_iters = 1000;
  std::string role;
  uint16_t rdv_port = 0;
  std::string name;
  std::string target_transport;
  uint64_t target_bytes = 0;
};

struct Result {
  std::string transport;
  double write_gbps = 0;
  double read_gbps = 0;
  double rtt_p50_us = 0;
  double rtt_p99_us = 0;
  bool notify_ok = false;
  bool data_ok = false;
  std::string error;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s%susage: te_demo [--transport shm,tcp] [--bytes 64M] [--iters N] "
               "[--rtt-iters N]\n",
               msg.c_str(), msg.empty() ? "" : "\n");
  std::exit(msg.empty() ? 0 : 2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value for " + a);
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage("");
    } else if (a == "--transport") {
      o.transports = mb::splitComma(next());
      for (auto& t : o.transports)
        if (t != "shm" && t != "tcp") usage("unknown transport " + t);
    } else if (a == "--bytes") {
      o.bytes = mb::parseSize(next());
      if (o.bytes < 8 || o.bytes > (4ull << 30)) usage("--bytes must be between 8 and 4G");
    } else if (a == "--iters") {
      o.iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--rtt-iters") {
      o.rtt_iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--role") {
      o.role = next();
    } else if (a == "--rdv-port") {
      o.rdv_port = static_cast<uint16_t>(std::atoi(next().c_str()));
    } else if (a == "--name") {
      o.name = next();
    } else if (a == "--target-transport") {
      o.target_transport = next();
    } else if (a == "--target-bytes") {
      o.target_bytes = mb::parseSize(next());
    } else {
      usage("unknown flag " + a);
    }
  }
  return o;
}

// Deterministic, position-dependent bytes, different per transport run.
void fillPattern(char* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<char>(i ^ seed);
}

// One batch of `op` over the whole buffer: one request, the engine slices it.
Status move(me::TransferEngine& eng, me::OpCode op, char* local, uint64_t n, me::PeerId peer,
            uint64_t remote) {
  return eng.transfer({me::TransferRequest{op, local, n, peer, remote}}, me::deadlineInMs(120000));
}

Result runTransport(const std::string& transport, me::Rendezvous& rdv, uint16_t rdv_port,
                    const Options& o, uint64_t seed) {
  Result res;
  res.transport = transport;
  me::EngineOptions eo;
  eo.name = "tedemo-init-" + transport + "-" + std::to_string(getpid());
  eo.transport = transport;
  auto eng = mb::must(me::TransferEngine::create(eo), "create engine (" + transport + ")");
  mb::TargetHandle t = mb::startTarget(*eng, rdv, rdv_port, transport, o.bytes);
  const uint64_t n = o.bytes;
  char* src = static_cast<char*>(mb::must(eng->allocate(n), "allocate src"));
  char* dst = static_cast<char*>(mb::must(eng->allocate(n), "allocate dst"));
  fillPattern(src, n, seed);

  auto fail = [&](const std::string& what, const Status& st) {
    res.error = what + ": " + st.toString();
    return res;
  };

  // 1. write (one untimed warm-up, then timed iterations of the whole buffer).
  Status st = move(*eng, me::OpCode::kWrite, src, n, t.peer, t.remote);
  if (!st.ok()) return fail("write", st);
  double t0 = mb::nowUs();
  for (int i = 0; i < o.iters; ++i) {
    st = move(*eng, me::OpCode::kWrite, src, n, t.peer, t.remote);
    if (!st.ok()) return fail("write", st);
  }
  res.write_gbps = static_cast<double>(n) * o.iters / ((mb::nowUs() - t0) * 1e-6) / 1e9;

  // 2. the peer checks what landed, asked by a notify that travels after the writes.
  st = eng->notify(t.peer, mb::kVerifyBit | n);
  if (!st.ok()) return fail("notify", st);
  uint64_t answer = 0;
  st = mb::awaitAnswer(*eng, 0, me::deadlineInMs(30000), &answer);
  if (!st.ok()) return fail("notify answer", st);
  res.notify_ok = answer == mb::checksum(src, n);

  // 3. read back into a zeroed buffer and compare byte for byte.
  std::memset(dst, 0, n);
  st = move(*eng, me::OpCode::kRead, dst, n, t.peer, t.remote);  // warm-up, checked below
  if (!st.ok()) return fail("read", st);
  double read_us = 0;
  for (int i = 0; i < o.iters; ++i) {
    if (i == o.iters - 1) std::memset(dst, 0, n);  // the last read is the one checked
    double s = mb::nowUs();
    st = move(*eng, me::OpCode::kRead, dst, n, t.peer, t.remote);
    read_us += mb::nowUs() - s;
    if (!st.ok()) return fail("read", st);
  }
  res.read_gbps = static_cast<double>(n) * o.iters / (read_us * 1e-6) / 1e9;
  res.data_ok = std::memcmp(src, dst, n) == 0;
  if (!res.data_ok) {
    for (uint64_t i = 0; i < n; ++i) {
      if (src[i] != dst[i]) {
        res.error = "first mismatch at byte " + std::to_string(i);
        break;
      }
    }
  }

  // 4. notify round trip.
  std::vector<double> lat;
  for (int i = 0; i < o.rtt_iters + 50; ++i) {
    uint64_t seq = static_cast<uint64_t>(i) + 1;
    double s = mb::nowUs();
    st = eng->notify(t.peer, seq);
    if (st.ok()) st = mb::awaitAnswer(*eng, seq, me::deadlineInMs(30000));
    if (!st.ok()) return fail("notify round trip", st);
    if (i >= 50) lat.push_back(mb::nowUs() - s);
  }
  res.rtt_p50_us = mb::percentile(lat, 50);
  res.rtt_p99_us = mb::percentile(lat, 99);

  if (!mb::stopTarget(*eng, t)) res.error = "peer process did not exit cleanly";
  (void)eng->free(src);
  (void)eng->free(dst);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  (void)mb::jobSecret();  // before any thread: targets inherit MC_SECRET
  Options o = parse(argc, argv);
  if (o.role == "target")
    return mb::runTarget(o.rdv_port, o.name, o.target_transport, o.target_bytes);
  if (!o.role.empty()) usage("unknown role " + o.role);

  const std::string secret = mb::jobSecret();
  auto server =
      mb::must(me::TcpRendezvousServer::start("127.0.0.1", 0, secret), "rendezvous server");
  auto rdv = mb::must(
      me::TcpRendezvousClient::connect("127.0.0.1", server->port(), secret, me::deadlineInMs(10000)),
      "rendezvous client");
  std::printf("te_demo: two processes on this host, rendezvous on 127.0.0.1:%u, %s buffers\n",
              server->port(), mb::fmtSize(o.bytes).c_str());
  std::fflush(stdout);

  std::vector<Result> results;
  uint64_t seed = 1;
  for (const auto& t : o.transports)
    results.push_back(runTransport(t, *rdv, server->port(), o, seed++));

  const std::string sz = mb::fmtSize(o.bytes);
  std::printf("\n%-9s %14s %14s %16s %16s  %s\n", "transport", ("write GB/s " + sz).c_str(),
              ("read GB/s " + sz).c_str(), "notify RTT p50", "notify RTT p99", "checks");
  bool ok = true;
  for (const auto& r : results) {
    bool good = r.notify_ok && r.data_ok && r.error.empty();
    ok = ok && good;
    std::printf("%-9s %14.3f %14.3f %13.1f us %13.1f us  %s%s%s\n", r.transport.c_str(),
                r.write_gbps, r.read_gbps, r.rtt_p50_us, r.rtt_p99_us,
                good ? "OK (bytes match, notify after writes)" : "FAILED",
                r.error.empty() ? "" : ": ", r.error.c_str());
  }
  std::printf("%s\n", ok ? "demo: all checks passed" : "demo: FAILED");
  return ok ? 0 : 1;
}
