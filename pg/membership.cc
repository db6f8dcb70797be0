#include "pg/membership.h"

#include <algorithm>
#include <bitset>

#include "engine/wire.h"

namespace mooncake::pg {

const char* memberStateName(MemberState s) {
  switch (s) {
    case MemberState::kNone:
      return "None";
    case MemberState::kInactive:
      return "Inactive";
    case MemberState::kAwaiting:
      return "AwaitingActivation";
    case MemberState::kActive:
      return "Active";
    case MemberState::kLeft:
      return "Left";
  }
  return "?";
}

std::vector<int> View::activeSlots() const {
  std::vector<int> out;
  for (int s = 0; s < maxSize(); ++s)
    if (active(s)) out.push_back(s);
  return out;
}

SlotMask View::activeMask() const {
  SlotMask m(state.size(), 0);
  for (int s = 0; s < maxSize(); ++s) m[s] = active(s) ? 1 : 0;
  return m;
}

int View::size() const {
  for (int s = maxSize() - 1; s >= 0; --s)
    if (active(s)) return s + 1;
  return 0;
}

bool View::sameData(const View& o) const {
  if (o.maxSize() != maxSize()) return false;
  for (int s = 0; s < maxSize(); ++s) {
    if (active(s) != o.active(s)) return false;
    if (active(s) && incarnation[s] != o.incarnation[s]) return false;
  }
  return true;
}

bool View::sameMembers(const View& o) const {
  return state == o.state && incarnation == o.incarnation;
}

std::string View::serialize() const {
  wire::Writer w;
  w.u32(1);  // format version
  w.u64(epoch);
  w.u64(data_epoch);
  w.u32(static_cast<uint32_t>(state.size()));
  for (size_t s = 0; s < state.size(); ++s) {
    w.u8(static_cast<uint8_t>(state[s]));
    w.u32(incarnation[s]);
    w.u8(healthy[s]);
  }
  return w.take();
}

bool View::parse(std::string_view bytes, View* out) {
  wire::Reader r(bytes);
  if (r.u32() != 1) return false;
  View v;
  v.epoch = r.u64();
  v.data_epoch = r.u64();
  uint32_t n = r.u32();
  if (!r.ok() || n > r.remaining() / 6) return false;
  v.state.resize(n);
  v.incarnation.resize(n);
  v.healthy.resize(n);
  for (uint32_t s = 0; s < n; ++s) {
    uint8_t st = r.u8();
    if (st > static_cast<uint8_t>(MemberState::kLeft)) return false;
    v.state[s] = static_cast<MemberState>(st);
    v.incarnation[s] = r.u32();
    v.healthy[s] = r.u8() != 0 ? 1 : 0;
  }
  if (!r.done()) return false;
  *out = std::move(v);
  return true;
}

std::string View::describe() const {
  std::string out = "epoch " + std::to_string(epoch) + ":";
  for (MemberState st : {MemberState::kActive, MemberState::kAwaiting, MemberState::kInactive,
                         MemberState::kLeft}) {
    std::string list;
    for (int s = 0; s < maxSize(); ++s)
      if (state[s] == st) list += (list.empty() ? "" : " ") + std::to_string(s);
    if (!list.empty() || st == MemberState::kActive)
      out += std::string(" ") + memberStateName(st) + " [" + list + "]";
  }
  return out;
}

View initialView(int max_size, int founders) {
  View v;
  v.epoch = 1;
  v.data_epoch = 1;
  v.state.assign(max_size, MemberState::kNone);
  v.incarnation.assign(max_size, 0);
  v.healthy.assign(max_size, 0);
  for (int s = 0; s < founders && s < max_size; ++s) {
    v.state[s] = MemberState::kActive;
    v.incarnation[s] = 1;
    v.healthy[s] = 1;
  }
  return v;
}

// ---- links and the healthy set ----

LinkMatrix::LinkMatrix(int n) : n_(n), words_((n + 63) / 64) {
  bits_.assign(static_cast<size_t>(n_) * words_, 0);
}

void LinkMatrix::set(int a, int b, bool up) {
  uint64_t& w = bits_[static_cast<size_t>(a) * words_ + b / 64];
  const uint64_t bit = uint64_t{1} << (b % 64);
  w = up ? (w | bit) : (w & ~bit);
}

bool LinkMatrix::link(int a, int b) const {
  return (bits_[static_cast<size_t>(a) * words_ + b / 64] >> (b % 64)) & 1;
}

std::vector<int> observersToAwait(const View& v, int self, const std::function<bool(int)>& up,
                                  bool* all) {
  std::vector<int> seen_up, unseen;
  // Self counts as a member (seen) only when it is one: an inactive process that reconciles
  // (sync_after_failure) would otherwise score itself into a majority it is not part of.
  const bool self_counts = self >= 0 && self < v.maxSize() &&
                           (v.state[self] == MemberState::kActive ||
                            v.state[self] == MemberState::kAwaiting);
  int members = self_counts, seen = self_counts;
  for (int s = 0; s < v.maxSize(); ++s) {
    if (s == self || v.incarnation[s] == 0 || v.state[s] == MemberState::kNone ||
        v.state[s] == MemberState::kLeft)
      continue;
    const bool counts = v.state[s] == MemberState::kActive || v.state[s] == MemberState::kAwaiting;
    const bool alive = up(s);
    members += counts;
    seen += counts && alive;
    if (alive)
      seen_up.push_back(s);
    else if (counts)
      unseen.push_back(s);
  }
  *all = 2 * seen < members;
  if (*all) {
    seen_up.insert(seen_up.end(), unseen.begin(), unseen.end());
    std::sort(seen_up.begin(), seen_up.end());
  }
  return seen_up;
}

SlotMask healthySet(const SlotMask& candidates, const LinkMatrix& links, const SlotMask* active) {
  const int n = links.size();
  const int words = links.words_;
  auto rowOf = [&](std::vector<uint64_t>& m, int a) { return m.data() + size_t(a) * words; };
  // mutual[a] = out-links of a AND in-links of a (the transpose), without the diagonal.
  std::vector<uint64_t> mutual(static_cast<size_t>(n) * words, 0);
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (links.mutual(a, b)) {
        rowOf(mutual, a)[b / 64] |= uint64_t{1} << (b % 64);
        rowOf(mutual, b)[a / 64] |= uint64_t{1} << (a % 64);
      }
  std::vector<uint64_t> in(words, 0);
  int members = 0;
  for (int a = 0; a < n && a < static_cast<int>(candidates.size()); ++a)
    if (candidates[a]) {
      in[a / 64] |= uint64_t{1} << (a % 64);
      ++members;
    }
  auto isIn = [&](int a) { return (in[a / 64] >> (a % 64)) & 1; };
  // degree[a]: mutual connections of a inside the set.
  std::vector<int> degree(n, 0);
  for (int a = 0; a < n; ++a) {
    if (!isIn(a)) continue;
    const uint64_t* r = rowOf(mutual, a);
    for (int w = 0; w < words; ++w) degree[a] += static_cast<int>(std::bitset<64>(r[w] & in[w]).count());
  }
  // Evict the least connected (ties: one not Active, then the highest slot) until every member
  // is connected to every other member.
  auto isActive = [&](int a) {
    return active == nullptr || (a < static_cast<int>(active->size()) && (*active)[a]);
  };
  auto evictedBefore = [&](int a, int b) {
    if (degree[a] != degree[b]) return degree[a] < degree[b];
    if (isActive(a) != isActive(b)) return !isActive(a);
    return a > b;
  };
  while (members > 0) {
    int worst = -1;
    for (int a = 0; a < n; ++a)
      if (isIn(a) && (worst < 0 || evictedBefore(a, worst))) worst = a;
    if (degree[worst] == members - 1) break;  // the least connected sees everyone: a clique
    in[worst / 64] &= ~(uint64_t{1} << (worst % 64));
    --members;
    const uint64_t* r = rowOf(mutual, worst);
    for (int b = 0; b < n; ++b)
      if (isIn(b) && ((r[b / 64] >> (b % 64)) & 1)) --degree[b];
  }
  // A lone survivor with no link either way to any other candidate is the isolated one.
  if (members == 1) {
    int only = -1;
    for (int a = 0; a < n; ++a)
      if (isIn(a)) only = a;
    bool others = false, linked = false;
    for (int b = 0; b < n && b < static_cast<int>(candidates.size()); ++b) {
      if (b == only || !candidates[b]) continue;
      others = true;
      linked |= links.link(only, b) || links.link(b, only);
    }
    if (others && !linked) {
      in[only / 64] &= ~(uint64_t{1} << (only % 64));
      members = 0;
    }
  }
  // Add back candidates connected to every member, lowest slot first.
  for (int a = 0; a < n && a < static_cast<int>(candidates.size()); ++a) {
    if (!candidates[a] || isIn(a)) continue;
    const uint64_t* r = rowOf(mutual, a);
    bool all = true;
    for (int w = 0; w < words && all; ++w) all = (in[w] & ~r[w]) == 0;
    if (all && members > 0) {
      in[a / 64] |= uint64_t{1} << (a % 64);
      ++members;
    }
  }
  SlotMask out(candidates.size(), 0);
  for (int a = 0; a < n && a < static_cast<int>(out.size()); ++a) out[a] = isIn(a) ? 1 : 0;
  return out;
}

// ---- transitions ----

namespace {
View next(const View& v) {
  View n = v;
  n.epoch = v.epoch + 1;
  return n;
}
void finish(const View& before, View* after, bool resync = false) {
  if (resync || !after->sameData(before)) after->data_epoch = after->epoch;
}
bool valid(const View& v, int s) { return s >= 0 && s < v.maxSize(); }
}  // namespace

View reconciled(const View& v, const SlotMask& healthy, bool auto_deactivate, bool resync) {
  View n = next(v);
  n.healthy.assign(v.maxSize(), 0);
  for (int s = 0; s < v.maxSize() && s < static_cast<int>(healthy.size()); ++s)
    n.healthy[s] = healthy[s] ? 1 : 0;
  if (auto_deactivate)
    for (int s = 0; s < v.maxSize(); ++s)
      if (!n.healthy[s] &&
          (n.state[s] == MemberState::kActive || n.state[s] == MemberState::kAwaiting))
        n.state[s] = MemberState::kInactive;
  finish(v, &n, resync);
  return n;
}

View activated(const View& v, const std::vector<int>& targets) {
  View n = next(v);
  for (int t : targets)
    if (valid(v, t) && n.state[t] == MemberState::kAwaiting) n.state[t] = MemberState::kActive;
  finish(v, &n);
  return n;
}

View deactivated(const View& v, const std::vector<int>& targets) {
  View n = next(v);
  for (int t : targets)
    if (valid(v, t) && n.state[t] == MemberState::kActive) n.state[t] = MemberState::kInactive;
  finish(v, &n);
  return n;
}

std::string joinRefusal(const View& v, int s, uint32_t incarnation) {
  if (!valid(v, s))
    return "slot " + std::to_string(s) + " is outside the group's " +
           std::to_string(v.maxSize()) + " slots";
  if (incarnation == 0) return "incarnation 0 is no process";
  if (v.incarnation[s] > incarnation)
    return "slot " + std::to_string(s) + " is held by a newer process (incarnation " +
           std::to_string(v.incarnation[s]) + ")";
  if (v.incarnation[s] == incarnation && v.state[s] == MemberState::kActive)
    return "slot " + std::to_string(s) + " is already active";
  return "";
}

View joined(const View& v, int s, uint32_t incarnation) {
  View n = next(v);
  n.state[s] = MemberState::kAwaiting;
  n.incarnation[s] = incarnation;
  finish(v, &n);
  return n;
}

View left(const View& v, int s) {
  View n = next(v);
  if (n.state[s] != MemberState::kActive) n.state[s] = MemberState::kLeft;
  finish(v, &n);
  return n;
}

Admission admitActivation(const View& v, const std::vector<int>& targets, const SlotMask& healthy,
                          const LinkMatrix& links) {
  std::vector<int> future = v.activeSlots();
  for (int t : targets) {
    if (!valid(v, t)) return {Admission::kReject, "target in-group rank is out of valid range"};
    switch (v.state[t]) {
      case MemberState::kNone:
      case MemberState::kLeft:
        return {Admission::kReject, "target rank is not valid group member"};
      case MemberState::kInactive:
        return {Admission::kWait,
                "slot " + std::to_string(t) + " has not called join_group yet"};
      case MemberState::kAwaiting:
        if (t >= static_cast<int>(healthy.size()) || !healthy[t])
          return {Admission::kWait, "slot " + std::to_string(t) + " is not healthy yet"};
        future.push_back(t);
        break;
      case MemberState::kActive:
        break;
    }
  }
  std::sort(future.begin(), future.end());
  future.erase(std::unique(future.begin(), future.end()), future.end());
  for (size_t i = 0; i < future.size(); ++i)
    for (size_t j = i + 1; j < future.size(); ++j)
      if (!links.mutual(future[i], future[j]))
        return {Admission::kWait, "slots " + std::to_string(future[i]) + " and " +
                                      std::to_string(future[j]) + " are not connected both ways"};
  return {Admission::kAdmit, ""};
}

}  // namespace mooncake::pg
