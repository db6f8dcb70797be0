#include "pg/profile.h"

#include <atomic>
#include <cstdio>

#include "engine/params.h"

namespace mooncake::pg::profile {
namespace {

// -1: not read yet (MC_PG_PROFILE on first use), 0 off, 1 on.
std::atomic<int> g_state{-1};
std::atomic<uint64_t> g_count[kPhases];
std::atomic<uint64_t> g_ns[kPhases];
thread_local int t_op_depth = 0;

}  // namespace

const char* name(Phase p) {
  switch (p) {
    case kOp: return "op";
    case kFlagWait: return "flag wait";
    case kDeviceWait: return "device wait";
    case kDeviceQueue: return "device queue";
    default: return "?";
  }
}

bool enabled() {
  int s = g_state.load(std::memory_order_relaxed);
  if (s < 0) {
    s = params::getBool("MC_PG_PROFILE") ? 1 : 0;
    int expected = -1;
    if (!g_state.compare_exchange_strong(expected, s, std::memory_order_relaxed)) s = expected;
  }
  return s == 1;
}

void setEnabled(bool on) { g_state.store(on ? 1 : 0, std::memory_order_relaxed); }

void add(Phase p, uint64_t ns) {
  g_count[p].fetch_add(1, std::memory_order_relaxed);
  g_ns[p].fetch_add(ns, std::memory_order_relaxed);
}

Totals take(bool reset) {
  Totals t;
  for (int p = 0; p < kPhases; ++p) {
    t.count[p] = reset ? g_count[p].exchange(0, std::memory_order_relaxed)
                       : g_count[p].load(std::memory_order_relaxed);
    t.ns[p] = reset ? g_ns[p].exchange(0, std::memory_order_relaxed)
                    : g_ns[p].load(std::memory_order_relaxed);
  }
  return t;
}

std::string format(const Totals& t) {
  const double ops = static_cast<double>(t.count[kOp]);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%llu ops, %.1f us/op", static_cast<unsigned long long>(t.count[kOp]),
                ops > 0 ? t.ns[kOp] / ops / 1e3 : 0.0);
  std::string s = buf;
  uint64_t parts = 0;
  for (int p = kOp + 1; p < kPhases; ++p) {
    parts += t.ns[p];
    std::snprintf(buf, sizeof buf, "; %s %.1f us/op (%.1f per op)", name(static_cast<Phase>(p)),
                  ops > 0 ? t.ns[p] / ops / 1e3 : 0.0, ops > 0 ? t.count[p] / ops : 0.0);
    s += buf;
  }
  const double rest = t.ns[kOp] > parts ? static_cast<double>(t.ns[kOp] - parts) : 0.0;
  std::snprintf(buf, sizeof buf, "; the rest %.1f us/op", ops > 0 ? rest / ops / 1e3 : 0.0);
  return s + buf;
}

Scope::Scope(Phase p) : p_(p), on_(enabled()) {
  if (!on_) return;
  if (p_ == kOp) {
    holds_depth_ = true;  // (this scope holds a level of the thread's op depth)
    if (t_op_depth++ > 0) {
      on_ = false;  // an op inside an op: the outer one counts
      return;
    }
  }
  t0_ = std::chrono::steady_clock::now();
}

Scope::~Scope() {
  if (holds_depth_) --t_op_depth;
  if (!on_) return;
  add(p_, static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - t0_)
                                    .count()));
}

}  // namespace mooncake::pg::profile
