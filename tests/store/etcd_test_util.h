// Helpers of the etcd authentication and TLS tests (etcd_security_test.cc, etcd_tls_test.cc).
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "store/ha/etcd_gateway.h"
#include "tests/store/ha_harness.h"

namespace mooncake::test {

using Clock = std::chrono::steady_clock;

inline bool writeFile(const std::string& path, const std::string& text, mode_t mode = 0600) {
  {
    std::ofstream f(path, std::ios::trunc);
    if (!f) return false;
    f << text;
  }
  return chmod(path.c_str(), mode) == 0;
}

inline std::string readFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline double secondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A temp dir of the test (password files, certificates, stderr of masters), removed with it.
struct TempDir {
  std::string path = makeTempDir("mc_etcdsec_");
  ~TempDir() { removeTree(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// POSTs to etcd's gateway at "http://host:port" as EtcdClient does (store/ha/etcd_gateway.h:
// the status and body received count, though the gateway's error answers end with trailers);
// the status (0: no answer) and the body.
inline std::pair<int, std::string> rawPost(const std::string& url, const std::string& path,
                                           const std::string& body,
                                           const httplib::Headers& headers = {}) {
  httplib::Client cli(url);
  cli.set_read_timeout(5, 0);
  store::ha::GatewayReply r = store::ha::gatewayPost(cli, path, body, headers);
  return {r.status, r.body};
}

// Waits until the master serves (at most timeout_ms).
inline bool waitServing(const HaMaster& m, int timeout_ms) {
  for (int w = 0; w < timeout_ms; w += 20) {
    if (m.serving()) return true;
    usleep(20000);
  }
  return false;
}

// In a forked child (no engine in the test process): a store client of `cluster` at `address`
// ("etcd://..."), with the environment variables `env` set first (MC_ETCD_*), puts one object
// and reads it back. 0 when it did; with `expect_error`, 0 when connect failed within 10 s
// saying that. Its stderr says what happened.
inline int clientRoundTrip(const std::string& address, const std::string& cluster,
                           const std::vector<std::pair<std::string, std::string>>& env,
                           const std::string& expect_error = "") {
  pid_t p = forkChild([=]() -> int {
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    engine::EngineOptions eo;
    eo.name = "etcdsec-client-" + std::to_string(getpid());
    auto eng = engine::TransferEngine::create(eo);
    if (!eng.ok()) return 10;
    store::StoreClientOptions so;
    so.segment_size = 8 << 20;
    so.master_address = address;
    so.cluster_id = cluster;
    so.secret = jobSecret();
    std::string why;
    const auto t0 = Clock::now();
    auto c = store::StoreClient::connect(eng->get(), so, &why);
    std::fprintf(stderr, "client: connect %s after %.2f s: %s\n", c.ok() ? "ok" : "failed",
                 secondsSince(t0), why.c_str());
    if (!expect_error.empty()) {
      if (c.ok()) return 20;
      if (why.find(expect_error) == std::string::npos) return 21;
      return secondsSince(t0) < 10 ? 0 : 22;
    }
    if (!c.ok()) return 11;
    const std::string v = valueFor("etcdsec", 4000);
    if ((*c)->put("etcdsec", v.data(), v.size()) != store::ErrorCode::OK) return 12;
    auto got = (*c)->get("etcdsec");
    if (!got.ok() || *got != v) return 13;
    (*c)->close();
    return 0;
  });
  return waitChild(p, 30000);
}

}  // namespace mooncake::test
