// Helpers shared by the engine's benchmark (te_bench) and demo (te_demo): spawning the
// target process (this same binary with a role flag), the target's serve loop, percentiles
// (sizes and lists: bench_units.h). Benchmark code only; the engine never includes this.
//
// Why fork+exec rather than plain fork: the parent already runs threads (the rendezvous
// server, engine threads), and a child forked from a threaded process may only call
// async-signal-safe functions. Re-executing /proc/self/exe gives the target a clean process.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_units.h"
#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"

namespace mooncake::bench {

using engine::Deadline;
using engine::PeerId;
using engine::TransferEngine;

// Notification tags of the target protocol. Plain tags (< kVerifyBit) are echoed back.
constexpr uint64_t kStopTag = ~0ull;         // target exits
constexpr uint64_t kVerifyBit = 1ull << 63;  // answer = checksum of buffer[0, tag & mask)
constexpr uint64_t kVerifyLenMask = (1ull << 62) - 1;

[[noreturn]] inline void die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "[%d] %s: %s\n", static_cast<int>(getpid()), what.c_str(),
               st.toString().c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

template <typename T>
T must(Result<T> r, const std::string& what) {
  if (!r.ok()) die(what, r.status());
  return std::move(r).value();
}

inline void must(const Status& st, const std::string& what) {
  if (!st.ok()) die(what, st);
}

inline double nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Nearest-rank percentile (p in [0, 100]) of unsorted samples; 0 for none.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t idx = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size()) + 0.5);
  if (idx > 0) idx -= 1;
  return v[std::min(idx, v.size() - 1)];
}

// 64-bit FNV-1a over 8-byte words (tail bytes one by one): cheap enough for 64 MiB.
inline uint64_t checksum(const void* p, uint64_t len) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < len; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

inline std::string selfExe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

// Starts this binary again with `args`. The child gets SIGKILL if this process dies, so an
// aborted benchmark leaves no target behind.
inline pid_t spawnSelf(const std::vector<std::string>& args) {
  std::string exe = selfExe();
  std::vector<std::string> all;
  all.push_back(exe);
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    std::perror("fork");
    std::exit(2);
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for the child up to timeout_ms; kills it when it overstays. Returns its exit code,
// or -1 when it had to be killed or died of a signal.
inline int waitChild(pid_t pid, int timeout_ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int status = 0;
  while (true) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() > end) {
      std::fprintf(stderr, "child %d did not exit in %d ms; killing it\n", static_cast<int>(pid),
                   timeout_ms);
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The job secret of a benchmark run: MC_SECRET when set, else a fresh one put into the
// environment, so that the target processes this one starts (fork + exec inherit it) present it.
// Called at the start of main(), before any thread exists.
inline std::string jobSecret() {
  auto s = engine::resolveSecret("", engine::SecretFile::kIfSet);
  if (s.ok() && !s.value().empty()) return s.value();
  std::string fresh = engine::generateSecret();
  setenv("MC_SECRET", fresh.c_str(), 1);
  return fresh;
}

// Rendezvous key where a target publishes "<addr> <len>" of its buffer.
inline std::string bufferKey(const std::string& target_name) {
  return "tebench/" + target_name + "/buf";
}

// The target process: allocates a registered buffer of `len` bytes, publishes its segment
// and buffer through the rendezvous, then answers notifications until kStopTag:
//   plain tag t          -> notify(sender, t)             (round-trip measurement)
//   kVerifyBit | n       -> notify(sender, checksum(buffer, n))  (data check after writes;
//                           the notify is ordered after the sender's writes)
inline int runTarget(uint16_t rdv_port, const std::string& name, const std::string& transport,
                     uint64_t len) {
  auto rdv =
      must(engine::TcpRendezvousClient::connect("127.0.0.1", rdv_port, jobSecret(),
                                                engine::deadlineInMs(30000)),
           "target: rendezvous connect");
  engine::EngineOptions eo;
  eo.name = name;
  eo.transport = transport;
  auto eng = must(TransferEngine::create(eo), "target: create engine");
  void* buf = must(eng->allocate(len), "target: allocate");
  std::memset(buf, 0, len);
  must(eng->publish(*rdv), "target: publish");
  must(rdv->set(bufferKey(name),
                std::to_string(reinterpret_cast<uint64_t>(buf)) + " " + std::to_string(len)),
       "target: set buffer key");

  std::map<uint64_t, PeerId> peers;  // sender engine id -> peer opened here
  pid_t parent = getppid();
  while (true) {
    auto n = eng->waitNotify(engine::deadlineInMs(1000));
    if (!n.ok()) {
      if (n.status().code() == Code::kTimeout) {
        if (getppid() != parent) break;  // the initiator is gone
        continue;
      }
      die("target: waitNotify", n.status());
    }
    if (n->tag == kStopTag) break;
    PeerId peer = n->peer;
    if (peer == engine::kInvalidPeer) {
      auto it = peers.find(n->src_engine);
      if (it == peers.end()) {
        peer = must(eng->peerOf(n->src_engine, engine::deadlineInMs(30000)), "target: peerOf");
        peers[n->src_engine] = peer;
      } else {
        peer = it->second;
      }
    }
    uint64_t answer = n->tag;
    if (n->tag & kVerifyBit)
      answer = checksum(buf, std::min<uint64_t>(n->tag & kVerifyLenMask, len));
    must(eng->notify(peer, answer), "target: notify answer");
  }
  Status st = eng->free(buf);
  (void)st;
  return 0;
}

// The initiator's view of one started target.
struct TargetHandle {
  pid_t pid = -1;
  std::string name;
  PeerId peer = engine::kInvalidPeer;
  uint64_t remote = 0;
  uint64_t remote_len = 0;
};

// Spawns a target (`--role target ...` must be understood by the binary's main), opens it
// from `eng` and reads its buffer address.
inline TargetHandle startTarget(TransferEngine& eng, engine::Rendezvous& rdv, uint16_t rdv_port,
                                const std::string& transport, uint64_t len) {
  TargetHandle t;
  static int started = 0;  // a later target of the same transport gets a name of its own
  t.name = "tebench-target-" + transport + "-" + std::to_string(getpid()) +
           (started++ == 0 ? "" : "-" + std::to_string(started));
  t.pid = spawnSelf({"--role", "target", "--rdv-port", std::to_string(rdv_port), "--name", t.name,
                     "--target-transport", transport, "--target-bytes", std::to_string(len)});
  // The target sets its buffer key after publishing its segment. Wait for it in short steps
  // so that a target that died (failed allocation, bad flags) is reported at once.
  std::string v;
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    auto r = rdv.wait(bufferKey(t.name), engine::deadlineInMs(200));
    if (r.ok()) {
      v = std::move(r).value();
      break;
    }
    if (r.status().code() != Code::kTimeout) die("wait for " + t.name, r.status());
    int status = 0;
    if (waitpid(t.pid, &status, WNOHANG) == t.pid) {
      std::fprintf(stderr, "target %s exited before it was ready (status %d)\n", t.name.c_str(),
                   status);
      std::exit(2);
    }
    if (std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr, "target %s not ready after 60 s\n", t.name.c_str());
      std::exit(2);
    }
  }
  t.peer = must(eng.openPeer(rdv, t.name, engine::deadlineInMs(60000)), "open target " + t.name);
  unsigned long long a = 0, l = 0;
  if (std::sscanf(v.c_str(), "%llu %llu", &a, &l) != 2) {
    std::fprintf(stderr, "malformed buffer key '%s'\n", v.c_str());
    std::exit(2);
  }
  t.remote = a;
  t.remote_len = l;
  std::string got = eng.peerTransport(t.peer);
  if (got != transport) {
    std::fprintf(stderr, "asked for transport %s but the engine chose %s\n", transport.c_str(),
                 got.c_str());
    std::exit(2);
  }
  return t;
}

// Sends kStopTag and reaps the target. Returns true when it exited cleanly.
inline bool stopTarget(TransferEngine& eng, const TargetHandle& t) {
  Status st = eng.notify(t.peer, kStopTag);
  if (!st.ok()) std::fprintf(stderr, "stop %s: %s\n", t.name.c_str(), st.toString().c_str());
  return waitChild(t.pid, 15000) == 0;
}

// Waits for the notification answering a request; anything else is a protocol error.
inline Status awaitAnswer(TransferEngine& eng, uint64_t expect, Deadline deadline,
                          uint64_t* got = nullptr) {
  auto n = eng.waitNotify(deadline);
  if (!n.ok()) return n.status();
  if (got != nullptr) {
    *got = n->tag;
    return Status::OK();
  }
  if (n->tag != expect)
    return MC_STATUS(kProtocol, "expected notification " << expect << ", got " << n->tag);
  return Status::OK();
}

// Keeps the compiler from dropping a memcpy whose result is never read.
inline void clobber(void* p) { asm volatile("" : : "r"(p) : "memory"); }

}  // namespace mooncake::bench
