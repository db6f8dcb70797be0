// What device_check and engine_check share: a byte pattern, and a copy waited for on device 0's
// stream. Header-only: scripts/gpu_check.sh compiles each check as one source.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "engine/device/device.h"

namespace mooncake::gpucheck {

inline void fill(std::vector<char>& v, uint64_t seed) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>((i * 131 + seed * 7) >> 3);
}

inline bool same(const std::vector<char>& v, uint64_t seed) {
  std::vector<char> w(v.size());
  fill(w, seed);
  return v == w;
}

// Copies on device 0's stream, then waits for it (20 s).
inline Status copyWait(engine::device::Device& d, void* dst, const void* src, size_t len) {
  Status st = d.copyAsync(dst, src, len, 0);
  if (!st.ok()) return st;
  auto ev = d.record(0);
  if (!ev.ok()) return ev.status();
  return (*ev)->wait(engine::deadlineInMs(20000));
}

// One check's outcome, printed as a JSON line.
struct Row {
  std::string check;
  bool ok;
  std::string detail;
};

// Prints the rows (and writes them to json_path unless empty); true when every one passed.
inline bool report(const std::vector<Row>& rows, const char* layer, const std::string& json_path) {
  bool all = true;
  std::string lines;
  for (const auto& r : rows) {
    all &= r.ok;
    std::string detail;
    for (char c : r.detail) detail += (c == '"' || c == '\\') ? '\'' : c;
    lines += "{\"check\": \"" + r.check + "\", \"layer\": \"" + layer + "\", \"ok\": " +
             (r.ok ? "true" : "false") + ", \"detail\": \"" + detail + "\"}\n";
  }
  std::fputs(lines.c_str(), stdout);
  std::fflush(stdout);
  if (!json_path.empty()) std::ofstream(json_path) << lines;
  return all;
}

// The process's device layer (MC_DEVICE), or nullptr after printing why there is none.
inline engine::device::Device* layerOrSay() {
  auto layer = engine::device::get();
  if (layer.ok()) return *layer;
  report({{"layer", false, layer.status().message()}}, "none", "");
  return nullptr;
}

}  // namespace mooncake::gpucheck
