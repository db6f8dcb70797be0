#include "tests/pg/pg_harness.h"
#include "tests/common/test_secret.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <thread>

namespace mooncake::pg::test {

int64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

namespace {

engine::TcpRendezvousServer* server() {
  static std::unique_ptr<engine::TcpRendezvousServer> s = [] {
    auto r = engine::TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
    if (!r.ok()) {
      std::fprintf(stderr, "rendezvous server: %s\n", r.status().toString().c_str());
      std::abort();
    }
    return std::move(r).value();
  }();
  return s.get();
}

std::atomic<int> g_run{0};

int failedParts() {
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  if (t == nullptr) return ::testing::Test::HasFailure() ? 1 : 0;
  int n = 0;
  for (int i = 0; i < t->result()->total_part_count(); ++i)
    n += t->result()->GetTestPartResult(i).failed() ? 1 : 0;
  return n;
}

[[noreturn]] void childMain(const RunOptions& o, int rank, const std::string& group,
                            uint16_t port, Shared* shared,
                            const std::function<void(RankEnv&)>& body) {
  int code = 0;
  // The child inherits the parent's record of this test: only failures it adds count (a
  // failure of an earlier runRanks call in the same test must not fail every later one).
  const int failed_before = failedParts();
  try {
    for (const auto& [k, v] : o.env) setenv(k.c_str(), v.c_str(), 1);
    if (o.rank_env)
      for (const auto& [k, v] : o.rank_env(rank)) setenv(k.c_str(), v.c_str(), 1);
    if (!o.transport.empty()) setenv("MC_TRANSPORT", o.transport.c_str(), 1);
    RankEnv env;
    env.rank = rank;
    env.size = o.world;
    env.group = group;
    env.transport = o.transport;
    env.shared = shared;
    engine::EngineOptions eo;
    eo.name = group + "-r" + std::to_string(rank) + "-" + std::to_string(getpid());
    auto e = engine::TransferEngine::create(eo);
    if (!e.ok()) throw std::runtime_error("engine: " + e.status().toString());
    env.engine = std::shared_ptr<engine::TransferEngine>(std::move(e).value());
    auto c = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(), engine::deadlineInMs(10000));
    if (!c.ok()) throw std::runtime_error("rendezvous: " + c.status().toString());
    env.rdv = std::shared_ptr<engine::Rendezvous>(std::move(c).value());
    if (o.create_comm && rank < o.world) {
      CommOptions co;
      co.rank = rank;
      co.size = o.world;
      co.group_name = group;
      co.timeout = o.comm_timeout;
      co.buffer_bytes = o.buffer_bytes;
      env.comm = Communicator::create(env.engine, env.rdv, co);
    }
    body(env);
    env.comm.reset();
    code = failedParts() > failed_before ? 1 : 0;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "[rank %d] exception: %s\n", rank, ex.what());
    code = 3;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

}  // namespace

std::unique_ptr<Communicator> RankEnv::subgroup(const std::string& name,
                                                const std::vector<int>& ranks,
                                                std::chrono::milliseconds timeout) const {
  CommOptions co;
  co.size = static_cast<int>(ranks.size());
  co.rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i] == rank) co.rank = static_cast<int>(i);
  co.group_name = group + "/" + name;
  co.timeout = timeout;
  return Communicator::create(engine, rdv, co);
}

std::vector<int> runRanks(const RunOptions& o, const std::function<void(RankEnv&)>& body) {
  uint16_t port = server()->port();
  std::string group = "t" + std::to_string(getpid()) + "-" + std::to_string(g_run++);
  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
  if (mem == MAP_FAILED) return std::vector<int>(o.world + o.extra, -1);
  Shared* shared = new (mem) Shared();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  const int procs = o.world + o.extra;
  for (int r = 0; r < procs; ++r) {
    pid_t pid = fork();
    if (pid == 0) childMain(o, r, group, port, shared, body);
    pids.push_back(pid);
  }
  if (o.parent) o.parent(pids, shared);
  std::vector<int> codes(procs, -1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.deadline_s);
  int left = procs;
  while (left > 0) {
    bool progressed = false;
    for (int r = 0; r < procs; ++r) {
      if (codes[r] != -1) continue;
      int st = 0;
      pid_t w = waitpid(pids[r], &st, WNOHANG);
      if (w == pids[r]) {
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        --left;
        progressed = true;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < procs; ++r) {
        if (codes[r] != -1) continue;
        std::fprintf(stderr, "rank %d (pid %d) still running at the deadline: killed\n", r,
                     pids[r]);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        codes[r] = 124;
      }
      break;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  munmap(mem, sizeof(Shared));
  return codes;
}

}  // namespace mooncake::pg::test
