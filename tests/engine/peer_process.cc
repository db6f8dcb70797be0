#include "tests/engine/peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "engine/rendezvous.h"
#include "tests/engine/test_util.h"
#include "tests/common/test_secret.h"

namespace mooncake::test {

using engine::Deadline;
using engine::TransferEngine;

namespace {

constexpr const char* kPeerFlag = "--mc-test-peer";
// Fixed descriptor numbers of the command/reply pipes inside the peer.
constexpr int kPeerCmdFd = 100;
constexpr int kPeerReplyFd = 101;

uint64_t slotLen(int k) {
  // A mix of tiny, odd and sliced (> 1 MiB, the default tcp slice) writes.
  if (k % 8 == 3) return (2u << 20) + 5;
  if (k % 2 == 1) return 4096 + static_cast<uint64_t>(k);
  return 1 + static_cast<uint64_t>(k) * 7;
}

bool writeAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

std::string argValue(int argc, char** argv, const std::string& key) {
  std::string prefix = key + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0)
      return argv[i] + prefix.size();
  }
  return "";
}

uint64_t num(const std::string& s) { return std::strtoull(s.c_str(), nullptr, 0); }

// ---------------- the peer side ----------------

class PeerMain {
 public:
  int run(int argc, char** argv) {
    cfg_.name = argValue(argc, argv, "--name");
    cfg_.transport = argValue(argc, argv, "--transport");
    cfg_.secret = argValue(argc, argv, "--secret");
    cfg_.region_bytes = num(argValue(argc, argv, "--bytes"));
    cfg_.seed = num(argValue(argc, argv, "--seed"));
    uint16_t port = static_cast<uint16_t>(num(argValue(argc, argv, "--rdv-port")));

    auto rdv = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(), engine::deadlineInMs(10000));
    if (!rdv.ok()) return fail("rendezvous connect: " + rdv.status().toString());
    rdv_ = std::move(rdv).value();
    engine::EngineOptions opt;
    opt.name = cfg_.name;
    opt.secret = cfg_.secret;
    opt.transport = cfg_.transport;
    auto eng = TransferEngine::create(opt);
    if (!eng.ok()) return fail("engine create: " + eng.status().toString());
    eng_ = std::move(eng).value();

    auto a = eng_->allocate(cfg_.region_bytes);
    if (!a.ok()) return fail("allocate: " + a.status().toString());
    alloc_ = a.value();
    fillPattern(alloc_, cfg_.region_bytes, allocSeed(cfg_));
    reg_ = std::malloc(cfg_.region_bytes);
    unreg_ = std::malloc(kUnregBytes);
    if (reg_ == nullptr || unreg_ == nullptr) return fail("malloc failed");
    fillPattern(reg_, cfg_.region_bytes, regSeed(cfg_));
    fillPattern(unreg_, kUnregBytes, unregSeed(cfg_));
    Status st = eng_->registerMemory(reg_, cfg_.region_bytes);
    if (!st.ok()) return fail("registerMemory: " + st.toString());
    st = eng_->publish(*rdv_);
    if (!st.ok()) return fail("publish: " + st.toString());

    std::ostringstream os;
    os << "ready " << reinterpret_cast<uint64_t>(alloc_) << " " << reinterpret_cast<uint64_t>(reg_)
       << " " << reinterpret_cast<uint64_t>(unreg_) << " " << cfg_.region_bytes << " "
       << eng_->engineId() << " " << getpid();
    reply(os.str());

    std::string line;
    while (readLine(&line)) {
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd == "exit") {
        eng_.reset();  // the engine goes first: it may still reference the buffers
        std::free(reg_);
        std::free(unreg_);
        reply("bye");
        return 0;
      }
      reply(handle(cmd, in));
    }
    return 3;  // the parent went away
  }

 private:
  int fail(const std::string& why) {
    std::fprintf(stderr, "[peer %s pid %d] %s\n", cfg_.name.c_str(), getpid(), why.c_str());
    reply("fail " + why);
    return 2;
  }

  void reply(const std::string& s) { writeAll(kPeerReplyFd, s + "\n"); }

  bool readLine(std::string* line) {
    for (;;) {
      size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        *line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return true;
      }
      char tmp[4096];
      ssize_t n = ::read(kPeerCmdFd, tmp, sizeof(tmp));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }

  // Only the peer's own buffers may be inspected (a typo must not crash the peer).
  bool mine(uint64_t addr, uint64_t len) const {
    auto in = [&](const void* base, uint64_t n) {
      uint64_t b = reinterpret_cast<uint64_t>(base);
      return addr >= b && len <= n && addr - b <= n - len;
    };
    for (auto& [p, n] : gpu_)
      if (in(p, n)) return true;
    return in(alloc_, cfg_.region_bytes) || in(reg_, cfg_.region_bytes) || in(unreg_, kUnregBytes);
  }

  std::string handle(const std::string& cmd, std::istringstream& in) {
    std::string s1, s2, s3, s4, s5, s6;
    in >> s1 >> s2 >> s3 >> s4 >> s5 >> s6;
    if (cmd == "expect" || cmd == "fill" || cmd == "sum") {
      uint64_t addr = num(s1), len = num(s2);
      if (!mine(addr, len)) return "bad address outside the peer's buffers";
      void* p = reinterpret_cast<void*>(addr);
      if (cmd == "sum") {
        char hex[32];
        std::snprintf(hex, sizeof(hex), "%016" PRIx64, checksum(p, len));
        return std::string("ok ") + hex;
      }
      if (cmd == "fill") {
        fillPattern(p, len, num(s3), num(s4));
        return "ok";
      }
      std::string diff = checkPattern(p, len, num(s3), num(s4));
      return diff.empty() ? "ok" : "bad " + diff;
    }
    if (cmd == "notify_check") return notifyCheck(static_cast<int>(num(s1)), num(s2), num(s3),
                                                  num(s4), num(s5), static_cast<int>(num(s6)));
    if (cmd == "drain_notify") {
      int quiet_ms = static_cast<int>(num(s1));
      uint64_t n = 0;
      while (eng_->waitNotify(engine::deadlineInMs(quiet_ms)).ok()) ++n;
      return "ok " + std::to_string(n);
    }
    if (cmd == "echo") return echo(static_cast<uint32_t>(num(s1)), static_cast<int>(num(s2)),
                                   static_cast<int>(num(s3)));
    if (cmd == "gpu_flushes") {  // the device layer's remoteWriteFlushes() (the simulation's)
      auto dev = engine::device::get();
      if (!dev.ok()) return "bad " + dev.status().toString();
      return "ok " + std::to_string((*dev)->remoteWriteFlushes());
    }
    if (cmd == "alloc_gpu") {  // GPU memory of the device layer (MC_DEVICE), published
      auto p = eng_->allocate(num(s1), engine::MemoryKind::kCuda, static_cast<int>(num(s3)));
      if (!p.ok()) return "bad " + p.status().toString();
      fillPattern(*p, num(s1), num(s2));  // through a device copy (test_util.h)
      gpu_.emplace_back(*p, num(s1));
      Status st = eng_->publish(*rdv_);
      return st.ok() ? "ok " + std::to_string(reinterpret_cast<uint64_t>(*p)) : "bad " + st.toString();
    }
    if (cmd == "free_alloc_on_arrival" || cmd == "free_gpu_on_arrival") {
      // Frees the engine-allocated region (unregistered, unmapped) as soon as a WRITE starts
      // landing in it: the first word of one of its 64 KiB blocks changed (s1: ms to wait).
      // free_gpu_on_arrival: the alloc_gpu allocation at s2 instead, watched at its first word
      // only (each look is a device copy). Answers "watching" first, then the outcome.
      const bool gpu = cmd == "free_gpu_on_arrival";
      auto g = std::find_if(gpu_.begin(), gpu_.end(), [&](const auto& a) {
        return reinterpret_cast<uint64_t>(a.first) == num(s2);
      });
      if (gpu && g == gpu_.end()) return "bad no alloc_gpu allocation at " + s2;
      void* region = gpu ? g->first : alloc_;
      const uint64_t n = gpu ? 1 : cfg_.region_bytes / 65536;
      Status looked;
      auto word = [&](uint64_t i) -> uint64_t {
        const char* at = static_cast<const char*>(region) + i * 65536;
        if (!gpu) return *reinterpret_cast<const volatile uint64_t*>(at);
        uint64_t v = 0;
        if (looked.ok()) looked = engine::device::copy(&v, at, sizeof(v), engine::deadlineInMs(5000));
        return v;
      };
      std::vector<uint64_t> before(n);
      for (uint64_t i = 0; i < n; ++i) before[i] = word(i);
      reply("watching");  // (the caller's WRITE may go now)
      const Deadline until = engine::deadlineInMs(static_cast<int64_t>(num(s1)));
      bool changed = false;
      while (!changed && looked.ok() && engine::Clock::now() < until)
        for (uint64_t i = 0; i < n && !changed; ++i) changed = word(i) != before[i] && looked.ok();
      if (!looked.ok()) return "bad looking at the region: " + looked.toString();
      if (!changed) return "bad nothing arrived";
      Status st = eng_->free(region);
      if (st.ok() && gpu) gpu_.erase(g);
      if (st.ok() && !gpu) alloc_ = nullptr;
      return st.ok() ? "ok" : "bad " + st.toString();
    }
    if (cmd == "free_alloc") {  // frees the engine-allocated region now (unregistered, unmapped)
      if (alloc_ == nullptr) return "bad already freed";
      Status st = eng_->free(alloc_);
      if (st.ok()) alloc_ = nullptr;
      return st.ok() ? "ok" : "bad " + st.toString();
    }
    if (cmd == "unregister") {
      Status st = eng_->unregisterMemory(reinterpret_cast<void*>(num(s1)));
      if (st.ok()) st = eng_->publish(*rdv_);
      return st.ok() ? "ok" : "bad " + st.toString();
    }
    return "bad unknown command " + cmd;
  }

  // Receives `count` messages on `channel` and sends each back to its sender (found with
  // peerOf: this engine never opened the parent itself) on channel+1, then notifies it with
  // the number of messages echoed.
  std::string echo(uint32_t channel, int count, int timeout_ms) {
    Deadline deadline = engine::deadlineInMs(timeout_ms);
    uint64_t src = 0;
    for (int k = 0; k < count; ++k) {
      auto m = eng_->waitMessage(channel, deadline);
      if (!m.ok()) return "bad message " + std::to_string(k) + ": " + m.status().toString();
      if (k > 0 && m->src_engine != src) return "bad messages from two engines";
      src = m->src_engine;
      auto p = eng_->peerOf(m->src_engine, deadline);
      if (!p.ok()) return "bad peerOf: " + p.status().toString();
      Status st = eng_->sendMessage(p.value(), channel + 1, m->payload);
      if (!st.ok()) return "bad sendMessage back: " + st.toString();
    }
    if (count > 0) {
      auto p = eng_->peerOf(src, deadline);
      Status st = p.ok() ? eng_->notify(p.value(), static_cast<uint64_t>(count)) : p.status();
      if (!st.ok()) return "bad notify back: " + st.toString();
    }
    return "ok";
  }

  std::string notifyCheck(int count, uint64_t addr, uint64_t tagbase, uint64_t seed,
                          uint64_t src, int timeout_ms) {
    if (!mine(addr, notifyBytes(count))) return "bad notify area outside the peer's buffers";
    Deadline deadline = engine::deadlineInMs(timeout_ms);
    std::ostringstream errs;
    int bad = 0;
    for (int k = 0; k < count; ++k) {
      auto n = eng_->waitNotify(deadline);
      if (!n.ok()) {
        errs << " notification " << k << " of " << count << " missing: " << n.status().toString();
        return "bad" + errs.str();
      }
      uint64_t tag = n->tag;
      if (n->src_engine != src && bad++ < 4)
        errs << " [tag " << tag << " from engine " << n->src_engine << ", expected " << src << "]";
      if (tag != tagbase + static_cast<uint64_t>(k) && bad++ < 4)
        errs << " [notification " << k << " carries tag " << tag << ", expected "
             << tagbase + k << " (out of order or corrupt)]";
      uint64_t idx = tag - tagbase;
      if (idx >= static_cast<uint64_t>(count)) continue;
      Slot s = notifySlot(static_cast<int>(idx));
      std::string diff =
          checkPattern(reinterpret_cast<void*>(addr + s.offset), s.len, seed + idx, 0);
      if (!diff.empty() && bad++ < 4)
        errs << " [write before notify " << idx << " not visible: " << diff << "]";
    }
    return bad == 0 ? "ok" : "bad " + std::to_string(bad) + " problems:" + errs.str();
  }

  PeerConfig cfg_;
  std::unique_ptr<engine::TcpRendezvousClient> rdv_;
  std::unique_ptr<TransferEngine> eng_;
  void* alloc_ = nullptr;
  std::vector<std::pair<void*, uint64_t>> gpu_;  // alloc_gpu's allocations (the engine frees them)
  void* reg_ = nullptr;
  void* unreg_ = nullptr;
  std::string buf_;
};

}  // namespace

Slot notifySlot(int k) {
  uint64_t off = 1;  // odd offsets throughout
  for (int j = 0; j < k; ++j) off += slotLen(j) + 3;
  return {off, slotLen(k)};
}

uint64_t notifyBytes(int count) {
  if (count == 0) return 0;
  Slot s = notifySlot(count - 1);
  return s.offset + s.len;
}

bool maybeRunPeer(int argc, char** argv, int* rc) {
  std::signal(SIGPIPE, SIG_IGN);
  if (argc < 2 || std::strcmp(argv[1], kPeerFlag) != 0) return false;
  PeerMain m;
  *rc = m.run(argc, argv);
  return true;
}

// ---------------- the parent side ----------------

std::unique_ptr<PeerProcess> PeerProcess::spawn(const PeerConfig& cfg, uint16_t rdv_port,
                                                std::string* error, int ready_timeout_ms) {
  std::signal(SIGPIPE, SIG_IGN);
  int cmd[2], rep[2];
  if (pipe2(cmd, O_CLOEXEC) != 0) {
    *error = std::string("pipe: ") + std::strerror(errno);
    return nullptr;
  }
  if (pipe2(rep, O_CLOEXEC) != 0) {
    *error = std::string("pipe: ") + std::strerror(errno);
    ::close(cmd[0]);
    ::close(cmd[1]);
    return nullptr;
  }
  // Everything the child needs is built before fork(): after it, only async-signal-safe calls.
  std::vector<std::string> args = {
      "mc-test-peer",
      kPeerFlag,
      "--name=" + cfg.name,
      "--transport=" + cfg.transport,
      "--secret=" + cfg.secret,
      "--bytes=" + std::to_string(cfg.region_bytes),
      "--seed=" + std::to_string(cfg.seed),
      "--rdv-port=" + std::to_string(rdv_port),
  };
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) {
    *error = "readlink /proc/self/exe failed";
    return nullptr;
  }
  exe[n] = '\0';
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) {
    *error = std::string("fork: ") + std::strerror(errno);
    for (int fd : {cmd[0], cmd[1], rep[0], rep[1]}) ::close(fd);
    return nullptr;
  }
  if (pid == 0) {
    // Dies with the parent (no orphans even if the test binary is killed).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    if (dup2(cmd[0], kPeerCmdFd) < 0 || dup2(rep[1], kPeerReplyFd) < 0) _exit(125);
    execv(exe, argv.data());
    _exit(127);
  }
  ::close(cmd[0]);
  ::close(rep[1]);
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  p->cfg_ = cfg;
  p->pid_ = pid;
  p->cmd_fd_ = cmd[1];
  p->reply_fd_ = rep[0];

  std::string line, why;
  if (!p->recv(&line, ready_timeout_ms, &why)) {
    *error = "peer '" + cfg.name + "' did not report ready: " + why;
    return nullptr;  // the destructor kills and reaps it
  }
  std::istringstream in(line);
  std::string word;
  in >> word;
  if (word != "ready") {
    *error = "peer '" + cfg.name + "' failed to start: " + line;
    return nullptr;
  }
  PeerInfo& i = p->info_;
  in >> i.alloc_addr >> i.reg_addr >> i.unreg_addr >> i.region_bytes >> i.engine_id >> i.pid;
  if (!in) {
    *error = "peer '" + cfg.name + "' sent a malformed ready line: " + line;
    return nullptr;
  }
  return p;
}

PeerProcess::~PeerProcess() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    int st;
    while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
  }
  if (cmd_fd_ >= 0) ::close(cmd_fd_);
  if (reply_fd_ >= 0) ::close(reply_fd_);
}

bool PeerProcess::send(const std::string& line) { return writeAll(cmd_fd_, line + "\n"); }

bool PeerProcess::recv(std::string* line, int timeout_ms, std::string* error) {
  auto t0 = SteadyClock::now();
  for (;;) {
    size_t nl = rbuf_.find('\n');
    if (nl != std::string::npos) {
      *line = rbuf_.substr(0, nl);
      rbuf_.erase(0, nl + 1);
      return true;
    }
    int left = timeout_ms - static_cast<int>(msSince(t0));
    if (left <= 0) {
      if (error) *error = "no reply within " + std::to_string(timeout_ms) + " ms";
      return false;
    }
    pollfd pfd{reply_fd_, POLLIN, 0};
    int r = ::poll(&pfd, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char tmp[4096];
    ssize_t n = ::read(reply_fd_, tmp, sizeof(tmp));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (error) *error = "peer process exited (reply pipe closed)";
      return false;
    }
    rbuf_.append(tmp, static_cast<size_t>(n));
  }
}

std::string PeerProcess::call(const std::string& line, int timeout_ms) {
  if (!send(line)) return "ERROR: cannot send '" + line + "' (peer gone)";
  std::string reply, why;
  if (!recv(&reply, timeout_ms, &why)) return "ERROR: '" + line + "': " + why;
  return reply;
}

std::string PeerProcess::expect(uint64_t addr, uint64_t len, uint64_t seed, uint64_t first) {
  std::string r = call("expect " + std::to_string(addr) + " " + std::to_string(len) + " " +
                       std::to_string(seed) + " " + std::to_string(first));
  return r == "ok" ? "" : r;
}

std::string PeerProcess::sum(uint64_t addr, uint64_t len) {
  return call("sum " + std::to_string(addr) + " " + std::to_string(len));
}

void PeerProcess::kill(int sig) {
  if (pid_ > 0 && !reaped_) ::kill(pid_, sig);
}

bool PeerProcess::waitExit(int timeout_ms, int* status) {
  if (reaped_) return true;
  auto t0 = SteadyClock::now();
  for (;;) {
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      if (status) *status = st;
      return true;
    }
    if (r < 0 && errno != EINTR) return false;
    if (msSince(t0) > timeout_ms) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int PeerProcess::shutdown(int timeout_ms) {
  if (reaped_) return -1;
  std::string line;
  if (send("exit")) recv(&line, timeout_ms);
  int st = 0;
  if (!waitExit(timeout_ms, &st)) {
    kill(SIGKILL);
    waitExit(5000, &st);
    return -1;
  }
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

}  // namespace mooncake::test
