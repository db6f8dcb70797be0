// store_put_profile: where the time of a store put goes.
//
//   store_put_profile [--sizes 4K,64K] [--iters 2000] [--segment 1G] [--json out.json]
//
// Starts a mooncake_master and a holder process (it lends --segment bytes and does nothing
// else), then puts from this process (which lends nothing, so every byte crosses to the holder
// through the engine, as in benchmarks/store_bench.py) with both write paths: "slab" (one round
// trip: PUBLISH) and "classic" (PutStart + PutEnd). Each put is timed whole and per phase
// (StoreClient::lastPutPhases: reserve, write, publish, commit). Every size and path runs twice
// over the same keys: pass 1 writes memory the holder never touched (page faults in both
// processes), pass 2 (after remove_all) reuses it. One JSON row per (path, size, pass).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/bench_units.h"
#include "engine/engine.h"
#include "engine/secret.h"
#include "store/client/store_client.h"

using namespace mooncake;
using Clock = std::chrono::steady_clock;

namespace {

double pct(std::vector<int64_t> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[std::min(v.size() - 1, static_cast<size_t>(p / 100 * v.size()))]) /
         1000.0;
}

uint16_t freePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> sizes = {4096, 65536};
  int iters = 2000;
  uint64_t segment = 1ull << 30;
  std::string json;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--sizes") {
      sizes.clear();
      for (const std::string& item : bench::splitComma(v)) sizes.push_back(bench::parseSize(item));
    } else if (a == "--iters") {
      iters = std::stoi(v);
    } else if (a == "--segment") {
      segment = bench::parseSize(v);
    } else if (a == "--json") {
      json = v;
    } else {
      std::fprintf(stderr,
                   "usage: store_put_profile [--sizes 4K,64K] [--iters N] "
                   "[--segment 1G] [--json F]\n");
      return 2;
    }
  }
  // One job secret for the master, the holder and us.
  auto secret = engine::resolveSecret("", engine::SecretFile::kDefault);
  std::string sec = secret.ok() ? *secret : engine::generateSecret();
  setenv("MC_SECRET", sec.c_str(), 1);  // children (master, holder) inherit it
  const uint16_t port = freePort();
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  int ready[2];
  if (pipe(ready) != 0) return 1;
  pid_t master = fork();
  if (master == 0) {
    dup2(ready[1], 1);
    execl(MC_MASTER_BIN, MC_MASTER_BIN, "--host", "127.0.0.1", "--port",
          std::to_string(port).c_str(), "--metrics-port", "0", "--rebuild-quiet-ms", "200",
          nullptr);
    _exit(127);
  }
  char line[256] = {};
  if (read(ready[0], line, sizeof(line) - 1) <= 0 || !std::strstr(line, "ready")) {
    std::fprintf(stderr, "store_put_profile: the master did not start\n");
    return 1;
  }
  int hold[2];
  if (pipe(hold) != 0) return 1;
  pid_t holder = fork();
  if (holder == 0) {
    engine::EngineOptions eo;
    eo.name = "profile-holder";
    auto eng = engine::TransferEngine::create(eo);
    store::StoreClientOptions so;
    so.segment_size = segment;
    so.master_address = addr;
    so.secret = sec;
    auto c = store::StoreClient::connect(eng->get(), so);
    if (!c.ok()) _exit(3);
    (void)!write(hold[1], "r", 1);
    pause();
    _exit(0);
  }
  char r;
  if (read(hold[0], &r, 1) != 1) {
    std::fprintf(stderr, "store_put_profile: the holder did not start\n");
    return 1;
  }
  std::vector<std::string> rows;
  for (bool slab : {true, false}) {
    engine::EngineOptions eo;
    eo.name = std::string("profile-writer-") + (slab ? "slab" : "classic");
    auto eng = engine::TransferEngine::create(eo);
    store::StoreClientOptions so;
    so.master_address = addr;
    so.secret = sec;
    so.use_slabs = slab;
    auto c = store::StoreClient::connect(eng->get(), so);
    if (!c.ok()) return 4;
    for (uint64_t size : sizes) {
      std::string val(size, 'v');
      for (int pass = 1; pass <= 2; ++pass) {
        std::vector<int64_t> total, alloc, wr, pub, com;
        for (int i = 0; i < iters; ++i) {
          std::string key = "p/" + std::to_string(size) + "/" + std::to_string(i);
          auto t0 = Clock::now();
          auto ec = (*c)->put(key, val.data(), val.size());
          int64_t ns =
              std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
          if (ec != store::ErrorCode::OK) {
            std::fprintf(stderr, "put %s: %d\n", key.c_str(), store::toInt(ec));
            return 5;
          }
          auto ph = store::StoreClient::lastPutPhases();
          total.push_back(ns);
          alloc.push_back(ph.alloc_ns);
          wr.push_back(ph.write_ns);
          pub.push_back(ph.publish_ns);
          com.push_back(ph.commit_ns);
        }
        (void)(*c)->removeAll(true);
        char buf[512];
        std::snprintf(buf, sizeof(buf),
                      "{\"path\": \"%s\", \"bytes\": %llu, \"pass\": %d, \"iters\": %d, "
                      "\"p50_us\": %.1f, \"p99_us\": %.1f, \"reserve_p50_us\": %.1f, "
                      "\"reserve_p99_us\": %.1f, \"write_p50_us\": %.1f, \"write_p99_us\": "
                      "%.1f, \"publish_p50_us\": %.1f, \"publish_p99_us\": %.1f, "
                      "\"commit_p50_us\": %.1f, \"commit_p99_us\": %.1f}",
                      slab ? "slab" : "classic", static_cast<unsigned long long>(size), pass, iters,
                      pct(total, 50), pct(total, 99), pct(alloc, 50), pct(alloc, 99), pct(wr, 50),
                      pct(wr, 99), pct(pub, 50), pct(pub, 99), pct(com, 50), pct(com, 99));
        std::printf("%s\n", buf);
        std::fflush(stdout);
        rows.push_back(buf);
      }
    }
    (*c)->close();
  }
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  kill(master, SIGTERM);
  waitpid(master, nullptr, 0);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return 6;
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
