// Membership of an elastic group (docs/elastic.md): rank slots, member states, views, the
// healthy-set rule and activation admission. A pure state machine: no I/O, no clock, no
// threads, so every rule here is unit-tested alone (tests/pg/membership_test.cc, up to 1024
// slots; nothing here caps the number of slots).
//
// Model (Mooncake PG's, upstream design doc): a group reserves max_size rank slots; slots are
// never renumbered. A slot holds at most one process at a time, its incarnation (1 for the
// founder, then one more for every process that took the slot over). A View is what every
// process of the group agrees on at an epoch: each slot's member state and incarnation, and
// the healthy set found by the last reconciliation. Views are immutable; every change makes a
// new view with epoch + 1 (pg/consensus.h decides which). data_epoch is the epoch of the last
// view that changed the data plane (the active slots or the processes holding them): only
// those views need the view barrier (pg/elastic.h); the others (a join, a healthy-set update)
// only change what the control plane reports.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace mooncake::pg {

enum class MemberState : uint8_t {
  kNone = 0,      // no process registered the slot (a reserved slot)
  kInactive = 1,  // registered, not ready (deactivated, revoked, or a dead rank's slot)
  kAwaiting = 2,  // called join_group: ready to be activated
  kActive = 3,    // takes part in collectives
  kLeft = 4,      // its process left the group for good (destroyed while inactive)
};
const char* memberStateName(MemberState s);

// A set of slots, one byte per slot (0/1): views of 1024 slots stay small and readable.
using SlotMask = std::vector<uint8_t>;

struct View {
  uint64_t epoch = 0;
  uint64_t data_epoch = 0;
  std::vector<MemberState> state;     // by slot
  std::vector<uint32_t> incarnation;  // by slot; 0: no process
  SlotMask healthy;                   // by slot: the last reconciliation's healthy set

  int maxSize() const { return static_cast<int>(state.size()); }
  bool active(int s) const { return state[s] == MemberState::kActive; }
  std::vector<int> activeSlots() const;
  SlotMask activeMask() const;
  // One past the highest active slot (what get_world_size() reports); 0 when none is active.
  int size() const;
  // The active slots and the processes holding them are the same (no data-plane change).
  bool sameData(const View& o) const;
  bool sameMembers(const View& o) const;  // states and incarnations equal (epochs aside)

  std::string serialize() const;
  static bool parse(std::string_view bytes, View* out);
  // "epoch 7: active [0 1 3], awaiting [2]" (for logs and errors).
  std::string describe() const;
};

// The founders' view: epoch 1, slots [0, founders) Active (incarnation 1, healthy), the rest of
// the max_size slots reserved (kNone).
View initialView(int max_size, int founders);

// Directed link observations between slots: link(a, b) = the process of slot a reported a live
// connection to the current process of slot b. Bit rows, so that 1024 x 1024 costs 128 KiB.
class LinkMatrix {
 public:
  explicit LinkMatrix(int n);
  int size() const { return n_; }
  void set(int a, int b, bool up);
  bool link(int a, int b) const;
  bool mutual(int a, int b) const { return link(a, b) && link(b, a); }

 private:
  friend SlotMask healthySet(const SlotMask&, const LinkMatrix&, const SlotMask*);
  int n_;
  int words_;  // per row
  std::vector<uint64_t> bits_;
};

// The healthy set: the candidates (processes that are online: they answered this round) reduced
// to a clique of mutually connected slots by evicting, one at a time, the member with the
// fewest mutual connections inside the set (ties: the highest slot); a lone survivor that has
// no link in either direction to any other candidate is dropped too (it is the isolated one);
// then candidates connected to every member are added back, lowest slot first. active (when
// given): the view's Active slots; on a tie a candidate that is not Active (a joiner awaiting
// activation) is evicted before an Active one, so that a joiner some member has not opened yet
// cannot cost an Active member its place.
SlotMask healthySet(const SlotMask& candidates, const LinkMatrix& links,
                    const SlotMask* active = nullptr);

// Whose observations a reconciling process waits for: every other process of view v (state
// neither None nor Left) that it sees alive (`up`); and, when it sees fewer than half of the
// view's Active and Awaiting members alive (itself counted when it is one of them), also those
// it does not see,
// for the whole window. Their deaths and this process being the one cut off look the same from
// here; only their own observations (in the store) tell the two apart: a proposer cut off from
// every link weighed only itself and proposed a view in which it alone was healthy. *all: the
// second case. Ascending slots.
std::vector<int> observersToAwait(const View& v, int self, const std::function<bool(int)>& up,
                                  bool* all);

// ---- transitions: each returns the next view (epoch + 1; data_epoch = the new epoch when the
// data plane changes). They never fail; the checks are the callers' (see admit*). ----

// After a failure round: the healthy set is recorded; with auto_deactivate, Active and
// Awaiting slots outside it become Inactive. resync: start a new data plane even when the
// active set is unchanged (an op failed, so the ranks' step counters may differ).
View reconciled(const View& v, const SlotMask& healthy, bool auto_deactivate, bool resync);
// Awaiting targets become Active (others are left as they are).
View activated(const View& v, const std::vector<int>& targets);
// Active targets become Inactive.
View deactivated(const View& v, const std::vector<int>& targets);
// The process `incarnation` declares slot s ready: Awaiting (from None, Inactive, Left, an
// Awaiting older incarnation, or the Active slot of an older, replaced incarnation).
View joined(const View& v, int s, uint32_t incarnation);
// The process of slot s left for good (destroyed while not active).
View left(const View& v, int s);

// Whether `incarnation` may join slot s of view v: "" if so, else why not.
std::string joinRefusal(const View& v, int s, uint32_t incarnation);

struct Admission {
  enum Kind { kAdmit, kWait, kReject } kind;
  std::string reason;  // why it waits or is rejected
};
// Activation admission (upstream's rule): every target that is not already Active must be
// Awaiting (Inactive: wait, join_group may still come; None/Left: reject), healthy, and every
// slot of the resulting active set must be mutually connected with every other.
Admission admitActivation(const View& v, const std::vector<int>& targets, const SlotMask& healthy,
                          const LinkMatrix& links);

}  // namespace mooncake::pg
