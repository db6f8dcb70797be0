// Small helpers shared by the engine tests: deterministic byte patterns, checks that report
// the first differing byte, deadline arithmetic, stopping a peer process. Header-only; ScopedEnv reads old values
// through the engine's parameter registry.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "engine/device/device.h"
#include "engine/params.h"

// gtest checks of a Status, naming the expression and the error.
#define MC_ASSERT_OK(expr)                                   \
  do {                                                       \
    ::mooncake::Status mc_t_st_ = (expr);                    \
    ASSERT_TRUE(mc_t_st_.ok()) << #expr << " -> " << mc_t_st_.toString(); \
  } while (0)
#define MC_EXPECT_OK(expr)                                   \
  do {                                                       \
    ::mooncake::Status mc_t_st_ = (expr);                    \
    EXPECT_TRUE(mc_t_st_.ok()) << #expr << " -> " << mc_t_st_.toString(); \
  } while (0)

namespace mooncake::test {

// Sets (value != nullptr) or unsets an environment variable for one scope (parameters are read
// when an engine, listener or buffer is created).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    // Through the parameter registry, the one reader of the environment: MC_* names from its
    // table, the few system names (HOME) from its allow-list.
    if (std::strncmp(name, "MC_", 3) == 0) {
      had_ = params::isSet(name);
      if (had_) old_ = params::getString(name);
    } else {
      old_ = params::getSystem(name);
      had_ = !old_.empty();
    }
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// The pattern `seed` is a stream of pseudo-random 64-bit words (little-endian bytes); the
// value of a byte depends on its index and the seed, so a shifted, truncated, stale or
// cross-wired copy is caught. Generated and checked a word at a time (GB/s), because tests
// fill and verify 64 MiB buffers several times.
inline uint64_t patternWord(uint64_t seed, uint64_t j) {
  uint64_t x = j * 0x9E3779B97F4A7C15ull + (seed + 1) * 0xC2B2AE3D27D4EB4Full;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return x;
}

inline uint8_t patternByte(uint64_t seed, uint64_t i) {
  return static_cast<uint8_t>(patternWord(seed, i >> 3) >> (8 * (i & 7)));
}

// Writes pattern(seed)[first, first+len) to p.
inline void fillPatternHost(void* p, size_t len, uint64_t seed, uint64_t first = 0) {
  auto* b = static_cast<uint8_t*>(p);
  size_t i = 0;
  for (; i < len && ((first + i) & 7) != 0; ++i) b[i] = patternByte(seed, first + i);
  for (; i + 8 <= len; i += 8) {
    uint64_t w = patternWord(seed, (first + i) >> 3);
    std::memcpy(b + i, &w, 8);
  }
  for (; i < len; ++i) b[i] = patternByte(seed, first + i);
}

// "" when p[0, len) equals pattern(seed)[first, first+len), else a description of the first
// mismatch (index, got, want) and the number of differing bytes.
inline std::string checkPatternHost(const void* p, size_t len, uint64_t seed, uint64_t first = 0) {
  const auto* b = static_cast<const uint8_t*>(p);
  bool same = true;
  size_t i = 0;
  for (; i < len && ((first + i) & 7) != 0 && same; ++i) same = b[i] == patternByte(seed, first + i);
  for (; i + 8 <= len && same; i += 8) {
    uint64_t w = patternWord(seed, (first + i) >> 3), got;
    std::memcpy(&got, b + i, 8);
    same = w == got;
  }
  for (; i < len && same; ++i) same = b[i] == patternByte(seed, first + i);
  if (same) return "";
  size_t bad = 0, first_bad = 0;
  for (size_t k = 0; k < len; ++k) {
    if (b[k] != patternByte(seed, first + k)) {
      if (bad++ == 0) first_bad = k;
    }
  }
  std::ostringstream os;
  os << bad << " of " << len << " bytes differ; first at +" << first_bad << ": got "
     << static_cast<int>(b[first_bad]) << " want "
     << static_cast<int>(patternByte(seed, first + first_bad));
  return os.str();
}

// FNV-1a over 8-byte words plus the tail: a cheap fingerprint of a region.
inline uint64_t checksumHost(const void* p, size_t len) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t h = 0xcbf29ce484222325ull ^ len;
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
  }
  for (; i < len; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

using SteadyClock = std::chrono::steady_clock;

inline double msSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
}

// "1B", "4KiB+3", "1MiB", "64MiB": names for parametrised sizes.
inline std::string sizeName(uint64_t n) {
  std::ostringstream os;
  if (n >= (1u << 20) && n % (1u << 20) == 0) {
    os << (n >> 20) << "MiB";
  } else if (n >= 1024) {
    os << (n >> 10) << "KiB";
    if (n % 1024) os << "plus" << (n % 1024);
  } else {
    os << n << "B";
  }
  return os.str();
}

// GPU memory of the process's device layer (MC_DEVICE; the simulation in tests) is not host
// memory: host code cannot touch it, as on a GPU. The pattern helpers read and write it through
// a host copy made by the layer; host memory directly.
inline bool onDevice(const void* p) { return engine::device::isDeviceMemory(p); }

inline void deviceCopyOrDie(void* dst, const void* src, size_t len) {
  Status st = engine::device::copy(dst, src, len, engine::deadlineInMs(30000));
  if (!st.ok()) {
    std::fprintf(stderr, "test_util: device copy of %zu bytes failed: %s\n", len,
                 st.toString().c_str());
    std::abort();
  }
}

inline void fillPattern(void* p, size_t len, uint64_t seed, uint64_t first = 0) {
  if (!onDevice(p)) return fillPatternHost(p, len, seed, first);
  std::string host(len, '\0');
  fillPatternHost(host.data(), len, seed, first);
  deviceCopyOrDie(p, host.data(), len);
}

inline std::string checkPattern(const void* p, size_t len, uint64_t seed, uint64_t first = 0) {
  if (!onDevice(p)) return checkPatternHost(p, len, seed, first);
  std::string host(len, '\0');
  deviceCopyOrDie(host.data(), p, len);
  return checkPatternHost(host.data(), len, seed, first);
}

inline uint64_t checksum(const void* p, size_t len) {
  if (!onDevice(p)) return checksumHost(p, len);
  std::string host(len, '\0');
  deviceCopyOrDie(host.data(), p, len);
  return checksumHost(host.data(), len);
}

// Stops `pid` (SIGSTOP) and returns once it has stopped: kill() returns before a process that
// is running on another core stops, which may still serve a request meanwhile. False when it
// is not stopped (state 'T' in /proc/<pid>/stat) within 5 s.
inline bool stopProcess(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return false;
  for (int waited = 0; waited <= 5000; waited += 1) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(f, line);
    size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T') return true;
    usleep(1000);
  }
  return false;
}

}  // namespace mooncake::test
