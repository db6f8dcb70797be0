// engine_check: two processes' engines move GPU memory on one host (the cuda transport: IPC
// handles, the device layer's copy stream), on whatever layer MC_DEVICE selects: the real GPU
// on the GPU machine (scripts/gpu_check.sh), the host simulation here (ctest
// engine.engine_check_sim). No gtest, like device_check.
//
//   engine_check                      the parent: rendezvous, spawns the child, checks
//   engine_check --child PORT SECRET  the child: a GPU buffer, published; checks what arrived
// One JSON object per line on stdout; exit status 0 when every check passed.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "tests/gpu/check_util.h"
#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"

extern char** environ;

namespace {

using mooncake::Status;
using mooncake::engine::deadlineInMs;
using mooncake::engine::MemoryKind;
using mooncake::engine::OpCode;
using mooncake::engine::TransferEngine;
using mooncake::engine::device::Device;
using mooncake::gpucheck::copyWait;
using mooncake::gpucheck::fill;
using mooncake::gpucheck::Row;
using mooncake::gpucheck::same;

constexpr size_t kBig = 64u << 20;

std::unique_ptr<TransferEngine> engineNamed(const std::string& name, const std::string& secret) {
  mooncake::engine::EngineOptions o;
  o.name = name;
  o.secret = secret;
  o.reach_host = "127.0.0.1";
  auto e = TransferEngine::create(o);
  if (!e.ok()) {
    std::fprintf(stderr, "engine %s: %s\n", name.c_str(), e.status().toString().c_str());
    return nullptr;
  }
  return std::move(e).value();
}

int child(Device& d, uint16_t port, const std::string& secret) {
  auto rdv = mooncake::engine::TcpRendezvousClient::connect("127.0.0.1", port, secret,
                                                            deadlineInMs(10000));
  if (!rdv.ok()) return 20;
  auto eng = engineNamed("child", secret);
  if (!eng) return 21;
  auto gpu = eng->allocate(kBig, MemoryKind::kCuda, 0);
  if (!gpu.ok()) return 22;
  std::vector<char> host(kBig, 0);
  if (!copyWait(d, *gpu, host.data(), kBig).ok()) return 23;
  if (!(*rdv)->set("gpu_check/child_gpu", std::to_string(reinterpret_cast<uint64_t>(*gpu))).ok() ||
      !eng->publish(**rdv).ok())
    return 24;
  // The parent writes a pattern and then notifies with its seed: the bytes are there when
  // the tag is.
  auto n = eng->waitNotify(deadlineInMs(60000));
  std::string verdict = "no notification";
  if (n.ok()) {
    Status st = copyWait(d, host.data(), *gpu, kBig);
    verdict = !st.ok() ? st.toString() : same(host, n->tag) ? "ok" : "bytes differ";
  }
  (void)(*rdv)->set("gpu_check/child_verdict", verdict);
  (void)(*rdv)->wait("gpu_check/parent_done", deadlineInMs(60000));
  (void)eng->free(*gpu);
  return verdict == "ok" ? 0 : 25;
}

}  // namespace

int main(int argc, char** argv) {
  Device* layer = mooncake::gpucheck::layerOrSay();
  if (layer == nullptr) return 2;
  Device& d = *layer;
  if (argc == 4 && std::strcmp(argv[1], "--child") == 0)
    return child(d, static_cast<uint16_t>(std::atoi(argv[2])), argv[3]);

  std::vector<Row> rows;
  const std::string secret = mooncake::engine::generateSecret();
  auto server = mooncake::engine::TcpRendezvousServer::start("127.0.0.1", 0, secret);
  auto rdv = server.ok() ? mooncake::engine::TcpRendezvousClient::connect(
                               "127.0.0.1", (*server)->port(), secret, deadlineInMs(10000))
                         : mooncake::Result<std::unique_ptr<mooncake::engine::TcpRendezvousClient>>(
                               server.status());
  auto eng = rdv.ok() ? engineNamed("parent", secret) : nullptr;
  if (!eng) {
    return mooncake::gpucheck::report({{"setup", false, rdv.ok() ? "engine" : rdv.status().message()}},
                                      d.name(), "") ? 0 : 1;
  }
  std::string port = std::to_string((*server)->port());
  char* args[] = {argv[0], const_cast<char*>("--child"), port.data(),
                  const_cast<char*>(secret.c_str()), nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args, environ) != 0) {
    mooncake::gpucheck::report({{"setup", false, "spawn failed"}}, d.name(), "");
    return 1;
  }
  auto remote = (*rdv)->wait("gpu_check/child_gpu", deadlineInMs(30000));
  auto peer = remote.ok() ? eng->openPeer(**rdv, "child", deadlineInMs(20000))
                          : mooncake::Result<mooncake::engine::PeerId>(remote.status());
  auto a = eng->allocate(kBig, MemoryKind::kCuda, 0), b = eng->allocate(kBig, MemoryKind::kCuda, 0);
  if (!peer.ok() || !a.ok() || !b.ok()) {
    rows.push_back({"setup", false, (!peer.ok() ? peer.status() : !a.ok() ? a.status() : b.status()).toString()});
  } else {
    const uint64_t there = std::strtoull(remote->c_str(), nullptr, 10);
    rows.push_back({"peer", true, "host memory over " + eng->peerTransport(*peer)});
    std::vector<char> host(kBig);
    fill(host, 5);
    Status st = copyWait(d, *a, host.data(), kBig);
    // 64 MiB GPU -> the child's GPU, three times; the best time counts.
    double best = 1e9;
    for (int i = 0; i < 3 && st.ok(); ++i) {
      auto t0 = std::chrono::steady_clock::now();
      st = eng->transfer({{OpCode::kWrite, *a, kBig, *peer, there}}, deadlineInMs(30000));
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    char rate[64];
    std::snprintf(rate, sizeof rate, "64 MiB in %.0f us, %.1f GB/s", best * 1e6, kBig / best / 1e9);
    rows.push_back({"write_gpu_to_peer_gpu", st.ok(), st.ok() ? rate : st.toString()});
    std::vector<char> back(kBig, 0);
    if (st.ok()) st = eng->transfer({{OpCode::kRead, *b, kBig, *peer, there}}, deadlineInMs(30000));
    if (st.ok()) st = copyWait(d, back.data(), *b, kBig);
    rows.push_back({"read_back", st.ok() && same(back, 5), st.ok() ? "compared" : st.toString()});
    // A write not waited for, then a notification: the child checks its buffer for the
    // notification's pattern when the tag arrives.
    fill(host, 6);
    st = copyWait(d, *a, host.data(), kBig);
    auto batch = st.ok() ? eng->submit({{OpCode::kWrite, *a, kBig, *peer, there}})
                         : mooncake::Result<mooncake::engine::BatchId>(st);
    st = batch.ok() ? eng->notify(*peer, 6) : batch.status();
    if (batch.ok()) (void)eng->wait(*batch, deadlineInMs(30000));
    auto verdict = st.ok() ? (*rdv)->wait("gpu_check/child_verdict", deadlineInMs(60000))
                           : mooncake::Result<std::string>(st);
    rows.push_back({"notify_after_writes", verdict.ok() && *verdict == "ok",
                    verdict.ok() ? *verdict : verdict.status().toString()});
    (void)eng->free(*a);
    (void)eng->free(*b);
  }
  (void)(*rdv)->set("gpu_check/parent_done", "1");
  int status = -1;
  bool exited = waitpid(pid, &status, 0) == pid && WIFEXITED(status);
  rows.push_back({"child_exit", exited && WEXITSTATUS(status) == 0,
                  exited ? "exit " + std::to_string(WEXITSTATUS(status)) : "no exit"});
  return mooncake::gpucheck::report(rows, d.name(), "") ? 0 : 1;
}
