// Helpers of the failover tests: a real etcd-server on free loopback ports (own data dir), masters
// spawned from the binary (with pid, metrics port, kill -9 and restart on the same ports), and a
// writer/reader load in forked client processes whose acknowledged puts are logged to files, so
// that the test can check every one of them after a failover.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/transport/tcp/tcp_socket.h"
#include "store/client/store_client.h"
#include "store/ha/etcd_client.h"
#include "tests/common/test_secret.h"
#include "tests/engine/test_util.h"
#include "tests/store/store_harness.h"

namespace mooncake::test {

inline int64_t monoNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A port to listen on that is free now. Picked below the kernel's ephemeral range
// (32768-60999 by default), where outgoing connections of other processes on this host (tests
// running beside this one) take their local ports: a port from bind(0) could be taken by one
// of those before the service that is given it binds it.
// True when binding 127.0.0.1:port fails (someone listens there or holds it).
inline bool portInUse(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool used = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0;
  close(fd);
  return used;
}

inline uint16_t freePort() {
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const uint16_t port = static_cast<uint16_t>(20000 + rng() % 12000);
    if (!portInUse(port)) return port;
  }
  return 0;
}

inline std::string makeTempDir(const std::string& prefix) {
  std::string t = "/tmp/" + prefix + "XXXXXX";
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  char* d = mkdtemp(buf.data());
  return d == nullptr ? std::string() : std::string(d);
}

inline void removeTree(const std::string& dir) {
  if (dir.size() < 6 || dir.rfind("/tmp/", 0) != 0) return;
  std::string cmd = "rm -rf '" + dir + "'";
  (void)std::system(cmd.c_str());
}

inline pid_t spawnShell(const std::string& cmd, int out_fd = -1) {
  pid_t pid = fork();
  if (pid == 0) {
    if (out_fd >= 0) dup2(out_fd, 1);
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

inline void killWait(pid_t pid, int sig) {
  if (pid <= 0) return;
  kill(pid, sig);
  for (int i = 0; i < 500; ++i) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return;
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// How a test's etcd runs: extra flags (e.g. "--auth-token-ttl 1") and TLS on its client URL.
struct EtcdOptions {
  std::string extra_flags;
  // TLS: the server's certificate and key (https client URL); with client_ca_file, etcd
  // requires client certificates signed by that CA (--client-cert-auth).
  std::string cert_file, key_file, client_ca_file;
  // What launch() checks etcd's readiness with (a CA and client certificate for TLS).
  store::ha::EtcdSecurity probe;
  // A certificate the probe must refuse: etcd counts as up once its TLS handshake fails on
  // etcd's certificate (not on a refused connection).
  bool probe_unverified = false;
};

// etcd-server (Debian's etcd 3.4) on free loopback ports with its own data dir.
class EtcdProcess {
 public:
  static std::unique_ptr<EtcdProcess> start(EtcdOptions options = {}) {
    std::unique_ptr<EtcdProcess> e(new EtcdProcess());
    e->options_ = std::move(options);
    e->dir_ = makeTempDir("mc_etcd_");
    e->client_port_ = freePort();
    e->peer_port_ = freePort();
    if (e->dir_.empty() || !e->launch()) return nullptr;
    return e;
  }
  ~EtcdProcess() {
    stop();
    removeTree(dir_);
  }
  // "127.0.0.1:P" (plain http), "https://127.0.0.1:P" with TLS.
  std::string endpoint() const {
    return std::string(options_.cert_file.empty() ? "" : "https://") + "127.0.0.1:" +
           std::to_string(client_port_);
  }
  uint16_t clientPort() const { return client_port_; }
  const std::string& dir() const { return dir_; }
  void stop(int sig = SIGTERM) {
    killWait(pid_, sig);
    pid_ = -1;
  }
  bool restart() {
    stop(SIGKILL);
    return launch();
  }

 private:
  bool launch() {
    const bool tls = !options_.cert_file.empty();
    const std::string c =
        std::string(tls ? "https" : "http") + "://127.0.0.1:" + std::to_string(client_port_);
    const std::string p = "http://127.0.0.1:" + std::to_string(peer_port_);
    std::string cmd = "etcd --name t --data-dir " + dir_ + "/data --listen-client-urls " + c +
                      " --advertise-client-urls " + c + " --listen-peer-urls " + p +
                      " --initial-advertise-peer-urls " + p + " --initial-cluster t=" + p +
                      " --log-level error --logger zap " + options_.extra_flags;
    if (tls) cmd += " --cert-file " + options_.cert_file + " --key-file " + options_.key_file;
    if (!options_.client_ca_file.empty())
      cmd += " --client-cert-auth --trusted-ca-file " + options_.client_ca_file;
    cmd += " >" + dir_ + "/log 2>&1";
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      // A test that dies by a signal (no destructors) must not leave its etcd running.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
      _exit(127);
    }
    auto etcd = store::ha::EtcdClient::create(endpoint(), 500, options_.probe);
    if (!etcd.ok()) return false;
    for (int i = 0; i < 200; ++i) {
      // An etcd with authentication enabled refuses a client without a user: it is up.
      Status st = (*etcd)->ping();
      if (st.ok() || st.code() == Code::kPermissionDenied) return true;
      if (options_.probe_unverified &&
          st.message().find("TLS: etcd's certificate") != std::string::npos)
        return true;
      usleep(50000);
    }
    return false;
  }
  EtcdOptions options_;
  std::string dir_;
  uint16_t client_port_ = 0, peer_port_ = 0;
  pid_t pid_ = -1;
};

// A mooncake_master process on fixed ports (so that it can be restarted on the same ones).
class HaMaster {
 public:
  HaMaster(std::string flags, uint16_t port = 0, std::string stderr_file = "")
      : flags_(std::move(flags)),
        port_(port ? port : freePort()),
        fixed_port_(port != 0),
        metrics_(freePort()),
        stderr_(std::move(stderr_file)) {}
  ~HaMaster() { stop(); }
  // A port freePort() found free may be taken by another test before the master binds it
  // (CI: "cannot bind metrics port"): when a start fails and one of its ports is in use, it is
  // started again on new ones (the metrics port only, when the port was given); a master that
  // failed for another reason stays as it is (waitExit).
  bool start() {
    for (int attempt = 0;; ++attempt) {
      if (startOnce()) return true;
      if (attempt == 2 || !(portInUse(metrics_) || (!fixed_port_ && portInUse(port_))))
        return false;
      stop();
      metrics_ = freePort();
      if (!fixed_port_) port_ = freePort();
    }
  }
  bool startOnce() {
    int fds[2];
    if (pipe(fds) != 0) return false;
    std::string cmd = std::string(MC_MASTER_BIN) + " --host 127.0.0.1 --port " +
                      std::to_string(port_) + " --metrics-port " + std::to_string(metrics_) + " " +
                      flags_ + (stderr_.empty() ? "" : " 2>>" + stderr_);
    pid_ = spawnShell(cmd, fds[1]);
    close(fds[1]);
    std::string line;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[256];
      ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    close(fds[0]);
    return line.find("ready") != std::string::npos;
  }
  void kill9() { killWait(pid_, SIGKILL), pid_ = -1; }
  void stop() { killWait(pid_, SIGTERM), pid_ = -1; }
  bool alive() const { return pid_ > 0; }
  uint16_t port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // A gauge or counter from /metrics ("" selects a metric without labels); -1 when unreadable.
  double metric(const std::string& name) const {
    if (pid_ <= 0) return -1;
    httplib::Client cli("127.0.0.1", metrics_);
    cli.set_connection_timeout(1, 0);
    cli.set_read_timeout(2, 0);
    auto res = cli.Get("/metrics");
    if (!res || res->status != 200) return -1;
    std::istringstream in(res->body);
    std::string l;
    while (std::getline(in, l)) {
      if (l.rfind(name + " ", 0) == 0) return std::stod(l.substr(name.size() + 1));
    }
    return -1;
  }
  bool serving() const { return metric("mooncake_store_master_role{role=\"serving\"}") == 1; }
  bool rebuilding() const { return metric("mooncake_store_master_role{role=\"rebuilding\"}") == 1; }
  // Waits for the process to exit by itself; its exit code, or -1 at the timeout.
  int waitExit(int timeout_ms) {
    int st = 0;
    for (int w = 0; w <= timeout_ms; w += 10) {
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      usleep(10000);
    }
    return -1;
  }

 private:
  std::string flags_;
  uint16_t port_;
  bool fixed_port_;
  uint16_t metrics_;
  std::string stderr_;
  pid_t pid_ = -1;
};

// One client process of the load: puts objects with checksummed contents (valueFor), upserts
// some of them with new sizes, reads its earlier ones back, and appends "<ns> <key> <size>" to
// `log` for every put or upsert that returned OK ("<ns> <key> <size> ?" for an upsert whose
// fate is unknown).
// Writes until `stop_file` exists, then writes "<log>.done" and keeps holding its segment (the
// others' replicas live there) until "<stop_file>.exit" exists; exits 0 unless a read returned
// wrong bytes (or setup failed).
struct LoadOptions {
  std::string master_address;
  std::string cluster_id;
  std::string name;
  std::string log;
  std::string stop_file;
  uint64_t segment = 32u << 20;
  int max_puts = 3000;  // keep well under capacity: evicted objects are not "lost"
  uint32_t replica_num = 2;
  std::string transport;
  int upsert_every = 4;  // every this many puts, also upsert one of its objects (0: never)
};

inline int runLoad(const LoadOptions& o) {
  engine::EngineOptions eo;
  eo.name = o.name;
  eo.transport = o.transport;
  auto eng = engine::TransferEngine::create(eo);
  if (!eng.ok()) return 10;
  store::StoreClientOptions so;
  so.segment_size = o.segment;
  so.master_address = o.master_address;
  so.cluster_id = o.cluster_id;
  so.secret = jobSecret();
  so.rpc_timeout_ms = 3000;
  so.transfer_timeout_ms = 3000;
  std::string why;
  auto c = store::StoreClient::connect(eng->get(), so, &why);
  if (!c.ok()) {
    std::fprintf(stderr, "load %s: connect: %s\n", o.name.c_str(), why.c_str());
    return 11;
  }
  auto& client = *c;
  // Every load client has mounted its segment before any writes (startLoads waits for the
  // ".ready" files, then creates the ".go" one): otherwise the first puts of the first client
  // could find fewer segments than replicas, and a test that kills that client would lose
  // them legitimately (replicas are best effort).
  std::ofstream(o.log + ".ready") << "1";
  for (int w = 0; w < 3000 && access((o.stop_file + ".go").c_str(), F_OK) != 0; ++w) usleep(10000);
  FILE* log = std::fopen(o.log.c_str(), "a");
  if (log == nullptr) return 12;
  std::mt19937_64 rng(std::hash<std::string>()(o.name));
  store::ReplicateConfig cfg;
  cfg.replica_num = o.replica_num;
  std::vector<std::pair<std::string, size_t>> acked;
  std::string buf(64 << 10, '\0');
  int bad = 0, n = 0, upserts = 0;
  while (access(o.stop_file.c_str(), F_OK) != 0) {
    if (n < o.max_puts) {
      std::string key = o.name + "/" + std::to_string(n);
      size_t size = 256 + rng() % 1792;
      std::string v = valueFor(key, size);
      store::ErrorCode ec = client->put(key, v.data(), v.size(), cfg);
      if (ec == store::ErrorCode::OK) {
        std::fprintf(log, "%lld %s %zu\n", static_cast<long long>(monoNs()), key.c_str(), size);
        std::fflush(log);
        acked.emplace_back(key, size);
        ++n;
        usleep(500);  // leave the masters (and etcd) some of this box's two cores
      } else if (ec == store::ErrorCode::OBJECT_ALREADY_EXISTS) {
        ++n;  // a put whose answer was lost in a failover, then kept: not acknowledged
      } else {
        usleep(2000);
      }
    } else {
      usleep(2000);
    }
    if (o.upsert_every > 0 && n % o.upsert_every == 0 && !acked.empty() && ++upserts) {
      // Replace one of its objects (a new size, so the value tells which one a reader got).
      // OK: logged with its new size; any other answer: the old or the new value may be the
      // one that stays, logged with '?' (the verifier accepts either), and left alone.
      const size_t at = rng() % acked.size();
      const std::string key = acked[at].first;
      size_t size = 256 + rng() % 1792;
      if (size == acked[at].second) ++size;
      std::string v = valueFor(key, size);
      store::ErrorCode ec = client->upsert(key, v.data(), v.size(), cfg);
      const bool ok = ec == store::ErrorCode::OK;
      std::fprintf(log, "%lld %s %zu%s\n", static_cast<long long>(monoNs()), key.c_str(), size,
                   ok ? "" : " ?");
      std::fflush(log);
      if (ok)
        acked[at].second = size;
      else
        acked.erase(acked.begin() + static_cast<long>(at));
    }
    if (!acked.empty()) {  // read one back and check its bytes
      const auto& [key, size] = acked[rng() % acked.size()];
      auto r = client->getInto(key, buf.data(), buf.size());
      if (r.ok()) {
        std::string w = *r == size ? checkPattern(buf.data(), *r, keySeed(key)) : "size";
        if (!w.empty()) {
          std::fprintf(stderr, "load %s: %s corrupt: %s\n", o.name.c_str(), key.c_str(), w.c_str());
          ++bad;
        }
      }
    }
  }
  std::fclose(log);
  std::ofstream(o.log + ".done") << bad;
  while (access((o.stop_file + ".exit").c_str(), F_OK) != 0) usleep(20000);
  client->close();
  return bad == 0 ? 0 : 1;
}

struct Acked {
  int64_t ns;
  std::string key;
  size_t size;
  std::vector<size_t> also;  // other sizes the value may have (upserts with unknown fate)
  int upserts = 0;           // acknowledged upserts of the key
};
// The acknowledged objects of a load log: one entry per key, with the size of its last
// acknowledged put or upsert (and the sizes of uncertain upserts after that one).
inline std::vector<Acked> readLog(const std::string& path) {
  std::vector<Acked> out;
  std::map<std::string, size_t> index;
  std::ifstream in(path);
  std::string l;
  while (std::getline(in, l)) {
    std::istringstream s(l);
    Acked a;
    std::string mark;
    if (!(s >> a.ns >> a.key >> a.size)) continue;
    const bool uncertain = static_cast<bool>(s >> mark) && mark == "?";
    auto it = index.find(a.key);
    if (it == index.end()) {
      if (uncertain) continue;  // upserts only follow acknowledged puts
      index[a.key] = out.size();
      out.push_back(a);
    } else if (uncertain) {
      out[it->second].also.push_back(a.size);
    } else {
      out[it->second].size = a.size;
      out[it->second].ns = a.ns;
      out[it->second].also.clear();
      ++out[it->second].upserts;
    }
  }
  return out;
}

// Reads every key in `acked` through a fresh client and checks its bytes; returns the problems.
inline std::vector<std::string> verifyAll(const std::string& master_address,
                                          const std::string& cluster_id,
                                          const std::vector<Acked>& acked, int64_t deadline_ms) {
  std::vector<std::string> problems;
  engine::EngineOptions eo;
  eo.name = "verifier-" + std::to_string(getpid());
  auto eng = engine::TransferEngine::create(eo);
  if (!eng.ok()) return {"verifier engine"};
  store::StoreClientOptions so;
  so.master_address = master_address;
  so.cluster_id = cluster_id;
  so.secret = jobSecret();
  std::string why;
  auto c = store::StoreClient::connect(eng->get(), so, &why);
  if (!c.ok()) return {"verifier connect: " + why};
  std::string buf(64 << 10, '\0');
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(deadline_ms);
  for (const Acked& a : acked) {
    store::ErrorOr<uint64_t> r(store::ErrorCode::RPC_FAIL);
    // Retry only errors that mean "no master right now", never a miss.
    do {
      r = (*c)->getInto(a.key, buf.data(), buf.size());
    } while (!r.ok() && r.error() == store::ErrorCode::RPC_FAIL &&
             std::chrono::steady_clock::now() < deadline);
    if (!r.ok()) {
      problems.push_back(a.key + ": " + std::string(store::errorCodeName(r.error())));
      continue;
    }
    const bool known = *r == a.size || std::count(a.also.begin(), a.also.end(), *r) > 0;
    std::string w = known ? checkPattern(buf.data(), *r, keySeed(a.key)) : "wrong size";
    if (!w.empty()) problems.push_back(a.key + ": " + w);
  }
  (*c)->close();
  return problems;
}

}  // namespace mooncake::test
