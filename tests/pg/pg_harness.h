// Multi-process harness for process-group tests: the parent (the gtest process) runs a TCP
// rendezvous server on 127.0.0.1 and forks one child per rank; each child creates its own
// TransferEngine and Communicator after the fork, runs the test body with gtest assertions
// and exits with 0 (no failure), 1 (a gtest failure) or 3 (an exception escaped). The
// parent reaps every child by a deadline and kills stragglers, so no test can hang.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "pg/communicator.h"

namespace mooncake::pg::test {

// 4 KiB of memory shared by the parent and every child (MAP_SHARED before the fork).
struct Shared {
  std::atomic<int64_t> kill_time_ns{0};  // CLOCK_MONOTONIC ns of a kill done by the parent
  std::atomic<int64_t> values[64];
  std::atomic<int64_t> more[440];  // free for tests (the struct fills most of 4 KiB)
};
static_assert(sizeof(Shared) <= 4096, "one page");

struct RankEnv {
  int rank = 0;
  int size = 1;
  std::string group;
  std::string transport;
  std::shared_ptr<engine::TransferEngine> engine;
  std::shared_ptr<engine::Rendezvous> rdv;
  std::unique_ptr<Communicator> comm;  // null when RunOptions::create_comm is false
  Shared* shared = nullptr;
  // Creates another communicator of the same ranks' engines (a subgroup when ranks is a
  // subset; only the listed ranks may call it, with the same name).
  std::unique_ptr<Communicator> subgroup(const std::string& name, const std::vector<int>& ranks,
                                         std::chrono::milliseconds timeout) const;
};

struct RunOptions {
  int world = 2;
  // Processes forked beside the world's ranks (RankEnv::rank = world, world + 1, ...; no
  // communicator is created for them): replacement or extension processes that create their
  // own communicator when the test tells them to.
  int extra = 0;
  std::string transport;  // "", "shm" or "tcp" (MC_TRANSPORT of the children)
  int deadline_s = 60;    // the parent kills every child still running after this
  std::chrono::milliseconds comm_timeout{30000};
  size_t buffer_bytes = 0;
  bool create_comm = true;
  std::vector<std::pair<std::string, std::string>> env;  // set in each child before anything
  // Per-rank environment (after `env`), e.g. MC_HOST_ID to make ranks look like other hosts.
  std::function<std::vector<std::pair<std::string, std::string>>(int rank)> rank_env;
  // Runs in the parent after every child was forked (e.g. to kill one of them).
  std::function<void(const std::vector<pid_t>& pids, Shared* shared)> parent;
};

// Sets o's transport from a test parameter: "shm", "tcp", "tcp_onesided" (tcp, with every
// message one-sided into receive slots, however small: the path rdma peers take,
// MC_PG_NET_ONE_SIDED=all and MC_PG_NET_SLOT_MIN_BYTES=1), or "tcp_onesided_large" (the
// same for messages of 4 KiB and more, the default threshold, and one slot per sender, so
// that large messages queue for credits while small ones go two-sided past them).
inline void useTransport(RunOptions& o, const std::string& param) {
  if (param.rfind("tcp_onesided", 0) != 0) {
    o.transport = param;
    return;
  }
  o.transport = "tcp";
  o.env.push_back({"MC_PG_NET_ONE_SIDED", "all"});
  if (param == "tcp_onesided") o.env.push_back({"MC_PG_NET_SLOT_MIN_BYTES", "1"});
  if (param == "tcp_onesided_large") o.env.push_back({"MC_PG_NET_SLOTS", "1"});
}

// Exit status per process (world + extra): 0 ok, 1 test failure, 3 exception, 128+N killed
// by signal N, 124 killed by the parent's deadline.
std::vector<int> runRanks(const RunOptions& o, const std::function<void(RankEnv&)>& body);

int64_t monotonicNs();

}  // namespace mooncake::pg::test
