// device_check: the device layer's checks on whatever layer MC_DEVICE selects -- the real GPU
// on the GPU machine (scripts/gpu_check.sh, MC_DEVICE=cuda), the host simulation here (ctest
// engine.device_check_sim, and gpu_check.sh's dry run). No gtest: gpu_check.sh builds it with
// the compiler alone on a machine that has no test libraries.
//
//   device_check [--json FILE]          all checks; one JSON object per line on stdout
//   device_check --ipc-child HANDLE_HEX OFFSET LEN SEED
//                                       (spawned by the ipc check: maps the handle, checks
//                                        the bytes, writes pattern SEED+1 back)
// Exit status 0 when every check passed.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "tests/gpu/check_util.h"

extern char** environ;

namespace {

using mooncake::Status;
using mooncake::engine::deadlineInMs;
using mooncake::engine::device::Device;
using mooncake::gpucheck::copyWait;
using mooncake::gpucheck::fill;
using mooncake::gpucheck::Row;
using mooncake::gpucheck::same;

std::string hexOf(const std::string& s) {
  static const char* k = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += k[c >> 4];
    out += k[c & 15];
  }
  return out;
}
std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

int ipcChild(Device& d, const std::string& handle, uint64_t off, size_t len, uint64_t seed) {
  auto base = d.openIpc(handle);
  if (!base.ok()) {
    std::fprintf(stderr, "ipc child: %s\n", base.status().toString().c_str());
    return 11;
  }
  char* p = static_cast<char*>(*base) + off;
  std::vector<char> host(len);
  if (!copyWait(d, host.data(), p, len).ok()) return 12;
  if (!same(host, seed)) return 13;
  fill(host, seed + 1);
  if (!copyWait(d, p, host.data(), len).ok()) return 14;
  if (!d.closeIpc(*base).ok()) return 15;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Device* layer = mooncake::gpucheck::layerOrSay();
  if (layer == nullptr) return 2;
  Device& d = *layer;
  if (argc == 6 && std::strcmp(argv[1], "--ipc-child") == 0)
    return ipcChild(d, unhex(argv[2]), std::strtoull(argv[3], nullptr, 10),
                    std::strtoull(argv[4], nullptr, 10), std::strtoull(argv[5], nullptr, 10));
  std::string json_path;
  if (argc == 3 && std::strcmp(argv[1], "--json") == 0) json_path = argv[2];

  std::vector<Row> out;
  auto add = [&](const std::string& c, bool ok, const std::string& detail) {
    out.push_back({c, ok, detail});
  };
  const size_t big = 64u << 20;
  auto a = d.allocate(big, 0), b = d.allocate(big, 0);
  if (!a.ok() || !b.ok()) {
    add("alloc", false, (a.ok() ? b : a).status().toString());
  } else {
    int host = 0;
    auto info = d.pointer(static_cast<char*>(*a) + big - 1);
    add("alloc", info.device && info.ordinal == 0 && !d.pointer(&host).device,
        std::string(d.name()) + ", " + std::to_string(d.count()) + " device(s)");

    // host -> device -> device -> host, in stream order, then compared
    bool copies = true;
    std::string why;
    for (size_t len : {size_t{4096}, size_t{1} << 20, big}) {
      std::vector<char> src(len), back(len, 0);
      fill(src, len);
      Status st = d.copyAsync(*a, src.data(), len, 0);
      if (st.ok()) st = d.copyAsync(*b, *a, len, 0);
      if (st.ok()) st = d.copyAsync(back.data(), *b, len, 0);
      auto ev = d.record(0);
      if (st.ok()) st = ev.ok() ? (*ev)->wait(deadlineInMs(10000)) : ev.status();
      if (!st.ok() || !same(back, len)) {
        copies = false;
        why += " " + std::to_string(len) + ": " + (st.ok() ? "bytes differ" : st.toString());
      }
    }
    add("copy_event", copies, copies ? "4 KiB, 1 MiB, 64 MiB round trips" : why);

    auto buf = d.exportDmabuf(*a, 1u << 20);
    if (buf.ok()) {
      add("dmabuf", buf->fd >= 0, "fd " + std::to_string(buf->fd));
      close(buf->fd);
    } else {
      // A device or driver without dma-buf: rdma then registers with ibv_reg_mr (peermem).
      add("dmabuf", buf.status().code() == mooncake::Code::kNotSupported,
          "not available: " + buf.status().message());
    }

    // IPC: a child process maps the allocation, checks it, writes the next pattern back.
    const size_t len = 1u << 20;
    std::vector<char> v(len);
    fill(v, 7);
    char* at = static_cast<char*>(*a) + 4096;
    uint64_t off = 0;
    auto h = d.exportIpc(at, &off);
    Status st = h.ok() ? copyWait(d, at, v.data(), len) : h.status();
    if (!st.ok()) {
      add("ipc", false, st.toString());
    } else {
      std::string hx = hexOf(*h), so = std::to_string(off), sl = std::to_string(len);
      char* args[] = {argv[0], const_cast<char*>("--ipc-child"), hx.data(), so.data(), sl.data(),
                      const_cast<char*>("7"), nullptr};
      pid_t pid = -1;
      int status = -1;
      bool ran = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args, environ) == 0 &&
                 waitpid(pid, &status, 0) == pid && WIFEXITED(status);
      std::vector<char> back(len);
      bool ok = ran && WEXITSTATUS(status) == 0 && copyWait(d, back.data(), at, len).ok() &&
                same(back, 8);
      add("ipc", ok, ran ? "child exit " + std::to_string(WEXITSTATUS(status)) : "spawn failed");
    }

    // A host word holds the copy stream (what Work.wait() queues on the caller's stream): the
    // event after it is not done while the word is short of the value, and is once it is set.
    {
      auto words = d.allocHostWords(4);
      auto gate = words.ok() ? mooncake::engine::device::acquireGate() : mooncake::Result<mooncake::engine::device::Gate>(
                                                                      words.status());
      std::string why;
      bool ok = false;
      if (!gate.ok()) {
        why = gate.status().toString();
      } else if (Status w = d.waitWord(0, mooncake::engine::device::kCopyStream, gate->word, gate->value);
                 !w.ok()) {
        why = w.toString();
      } else {
        Status c = d.copyAsync(*b, *a, 1u << 20, 0);
        auto ev = d.record(0);
        if (!c.ok() || !ev.ok()) {
          why = c.ok() ? ev.status().toString() : c.toString();
        } else {
          usleep(50000);
          const bool held = !(*ev)->done();
          mooncake::engine::device::openGate(*gate);
          Status done = (*ev)->wait(deadlineInMs(10000));
          ok = held && done.ok();
          why = std::string(held ? "held while closed" : "NOT held while closed") +
                ", then " + (done.ok() ? "released" : done.toString());
        }
      }
      add("stream_waits_on_host_word", ok, why);
    }

    // Pinned against pageable host memory, host -> device 64 MiB (pinHost: the engine's,
    // the store's and the process group's staging memory).
    {
      std::vector<char> host(big);
      fill(host, 3);
      auto rate = [&](const char* what) -> std::string {
        Status st = copyWait(d, *a, host.data(), big);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 5 && st.ok(); ++i) st = d.copyAsync(*a, host.data(), big, 0);
        auto ev = d.record(0);
        if (st.ok()) st = ev.ok() ? (*ev)->wait(deadlineInMs(60000)) : ev.status();
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s %.1f GB/s", what, st.ok() ? big * 5 / sec / 1e9 : 0.0);
        return st.ok() ? buf : std::string(what) + " " + st.toString();
      };
      const std::string pageable = rate("pageable");
      Status pin = d.pinHost(host.data(), big);
      const std::string pinned = pin.ok() ? rate("pinned") : "pinHost: " + pin.toString();
      if (pin.ok()) pin = d.unpinHost(host.data());
      add("h2d_pinned_vs_pageable_64MiB", pin.ok(), pageable + ", " + pinned);
    }

    // The device's own device-to-device copy rate (the bound for collectives on it).
    const int iters = 10;
    Status warm = copyWait(d, *b, *a, big);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters && warm.ok(); ++i) warm = d.copyAsync(*b, *a, big, 0);
    auto ev = d.record(0);
    if (warm.ok()) warm = ev.ok() ? (*ev)->wait(deadlineInMs(60000)) : ev.status();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char rate[64];
    std::snprintf(rate, sizeof rate, "%.1f GB/s", warm.ok() ? big * iters / s / 1e9 : 0.0);
    add("d2d_64MiB", warm.ok(), warm.ok() ? rate : warm.toString());
    (void)d.free(*a);
    (void)d.free(*b);
  }

  return mooncake::gpucheck::report(out, d.name(), json_path) ? 0 : 1;
}
