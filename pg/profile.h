// Where a process group's time goes, by phase: the project's own timers (issues 11 and 17 ask
// for a breakdown before algorithms change; perf is not on every machine). Off unless
// MC_PG_PROFILE=1 or setEnabled(true): then every op of this process adds its wall time, and
// the time it spent in each phase inside ops, to process-wide counters that take() reads.
//   kOp          an op from the caller's entry into the group to its return (outermost only)
//   kFlagWait    waiting for a peer's shared-memory flag past the first look (ShmGroup::wait)
//   kDeviceWait  the host waiting for queued GPU copies and reductions (DeviceCopies::wait)
//   kDeviceQueue queueing GPU copies and reduction kernels (DeviceCopies::add / reduce)
// What an op's time leaves over is the host's own work (copies through shared memory, CPU
// reductions, messages) and its bookkeeping. Off, a phase costs one relaxed load.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace mooncake::pg::profile {

enum Phase : int { kOp, kFlagWait, kDeviceWait, kDeviceQueue, kPhases };

const char* name(Phase p);

bool enabled();
void setEnabled(bool on);  // overrides MC_PG_PROFILE for this process

void add(Phase p, uint64_t ns);

struct Totals {
  uint64_t count[kPhases] = {};
  uint64_t ns[kPhases] = {};
};
// The counters so far (and zeroes them when reset).
Totals take(bool reset);
// One line: "N ops, X us/op; flag wait: a us/op (b per op); ...; the rest c us/op".
std::string format(const Totals& t);

// Times its scope into phase p when profiling is on. A kOp scope inside another op of the
// same thread (a group's op run by a subgroup) is not counted again.
class Scope {
 public:
  explicit Scope(Phase p);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Phase p_;
  bool on_;
  bool holds_depth_ = false;  // a kOp scope that counts in the thread's op depth
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace mooncake::pg::profile
