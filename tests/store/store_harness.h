// Helpers for the store client tests: a standalone master spawned from its binary, forked
// client processes (each creates its engine after the fork), and keyed data patterns so that any
// reader can verify any object from its key alone.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "store/client/store_client.h"
#include "tests/engine/test_util.h"
#include "tests/common/test_secret.h"

namespace mooncake::test {

inline uint64_t keySeed(const std::string& key) {
  uint64_t h = 1469598103934665603ull;
  for (char c : key) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}
inline std::string valueFor(const std::string& key, size_t n) {
  std::string s(n, '\0');
  fillPattern(s.data(), n, keySeed(key));
  return s;
}

// The mooncake_master binary, running until destroyed (SIGTERM, then SIGKILL).
class MasterProcess {
 public:
  // extra: more flags. Returns nullptr if it did not print its ready line within 10 s.
  static std::unique_ptr<MasterProcess> spawn(const std::string& extra = "") {
    int fds[2];
    if (pipe(fds) != 0) return nullptr;
    pid_t pid = fork();
    if (pid == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      // A fresh master waits for clients that might report objects (a restart) until none came
      // for --rebuild-quiet-ms; tests start fresh masters, so keep that short.
      std::string cmd = std::string("exec ") + MC_MASTER_BIN +
                        " --host 127.0.0.1 --port 0 --metrics-port 0 --rebuild-quiet-ms 200 " +
                        extra;
      execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      _exit(127);
    }
    close(fds[1]);
    std::unique_ptr<MasterProcess> m(new MasterProcess());
    m->pid_ = pid;
    std::string line;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[256];
      ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    close(fds[0]);
    auto at = line.find("port=");
    if (at == std::string::npos) return nullptr;
    m->port_ = static_cast<uint16_t>(std::stoi(line.substr(at + 5)));
    return m;
  }
  ~MasterProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      for (int i = 0; i < 100; ++i) {
        if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        usleep(20000);
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  uint16_t port() const { return port_; }

 private:
  MasterProcess() = default;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

// A forked child running body(); its exit status is body's return value (0 = pass).
inline pid_t forkChild(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (...) {
      rc = 99;
    }
    _exit(rc);
  }
  return pid;
}

// Waits for a child; returns its exit code, or -signal, or -1000 on timeout (then kills it).
inline int waitChild(pid_t pid, int timeout_ms) {
  int status = 0;
  for (int waited = 0; waited <= timeout_ms; waited += 10) {
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1000;
}

// Everything a client process needs: rendezvous client, engine, store client.
struct ClientProc {
  std::unique_ptr<engine::TcpRendezvousClient> rdv;
  std::unique_ptr<engine::TransferEngine> eng;
  std::unique_ptr<store::StoreClient> client;
};

inline bool makeClient(uint16_t port, const std::string& name, uint64_t segment, ClientProc* out,
                       const std::string& transport = "") {
  auto rdv = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(), engine::deadlineInMs(5000));
  if (!rdv.ok()) return false;
  out->rdv = std::move(rdv).value();
  engine::EngineOptions eo;
  eo.name = name;
  eo.transport = transport;
  auto eng = engine::TransferEngine::create(eo);
  if (!eng.ok()) return false;
  out->eng = std::move(eng).value();
  store::StoreClientOptions so;
  so.segment_size = segment;
  so.rpc_timeout_ms = 3000;
  so.transfer_timeout_ms = 3000;
  auto c = store::StoreClient::create(out->eng.get(), out->rdv.get(), nullptr, so);
  if (!c.ok()) {
    std::fprintf(stderr, "client %s: create failed: %d\n", name.c_str(), toInt(c.error()));
    return false;
  }
  out->client = std::move(c).value();
  return true;
}

// Counter barrier over the rendezvous: returns once `n` processes arrived (or false at 30 s).
inline bool barrier(engine::Rendezvous& rdv, const std::string& name, int64_t n) {
  auto v = rdv.add("barrier/" + name, 1);
  if (!v.ok()) return false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    auto cur = rdv.add("barrier/" + name, 0);
    if (cur.ok() && *cur >= n) return true;
    usleep(2000);
  }
  return false;
}

}  // namespace mooncake::test
