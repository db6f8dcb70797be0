// Elastic groups: observations, reconciliation, and the membership calls (activate,
// deactivate, join, sync_after_failure). See pg/elastic.h.
#include <algorithm>
#include <sstream>

#include "engine/log.h"
#include "engine/wire.h"
#include "pg/elastic.h"

namespace mooncake::pg {

using engine::Clock;
using engine::Deadline;
using std::chrono::milliseconds;

namespace {
constexpr auto kAdmissionTimeout = std::chrono::seconds(20);  // upstream's
constexpr auto kJoinTimeout = std::chrono::seconds(300);      // upstream's
constexpr auto kStagger = milliseconds(150);  // per place in the proposer order

milliseconds ms(std::chrono::microseconds us) {
  return std::chrono::duration_cast<milliseconds>(us);
}
}  // namespace

// ---- observations ----

std::string Elastic::Obs::serialize() const {
  wire::Writer w;
  w.u32(1);
  w.u32(inc);
  w.u64(static_cast<uint64_t>(tag));
  w.u32(static_cast<uint32_t>(conn.size()));
  for (uint32_t c : conn) w.u32(c);
  return w.take();
}

bool Elastic::Obs::parse(const std::string& s, Obs* out) {
  wire::Reader r(s);
  if (r.u32() != 1) return false;
  Obs o;
  o.inc = r.u32();
  o.tag = static_cast<int64_t>(r.u64());
  uint32_t n = r.u32();
  if (!r.ok() || n > r.remaining() / 4) return false;
  o.conn.resize(n);
  for (uint32_t i = 0; i < n; ++i) o.conn[i] = r.u32();
  if (!r.done()) return false;
  *out = std::move(o);
  return true;
}

void Elastic::publishObs(int64_t tag) {
  Obs o;
  o.inc = inc_;
  o.tag = tag;
  o.conn.assign(max_size_, 0);
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int s = 0; s < max_size_; ++s)
      if (alive(s, procs_[s].inc)) o.conn[s] = procs_[s].inc;
    o.conn[slot_] = inc_;
  }
  Status st = root_.rdv->set(key("obs/" + std::to_string(slot_)), o.serialize());
  if (!st.ok())
    throw CommError("mooncake pg: group " + name_ + ": publishing observations: " + st.toString(),
                    -1, "view");
  int64_t prev = answered_.load();
  while (prev < tag && !answered_.compare_exchange_weak(prev, tag)) {
  }
}

void Elastic::serviceRequests() {
  auto req = root_.rdv->add(key("req"), 0);
  if (req.ok() && *req > answered_.load()) publishObs(*req);
}

Elastic::Found Elastic::observe(const View& base, const std::vector<int>& must, Deadline deadline) {
  for (int s : must) ensureOpen(s, base.incarnation[s], std::min(deadline, Clock::now() + milliseconds(2000)));
  auto r = root_.rdv->add(key("req"), 1);
  if (!r.ok())
    throw CommError("mooncake pg: group " + name_ + ": requesting observations: " +
                        r.status().toString(),
                    -1, "view");
  publishObs(*r);
  ring();
  // Whom to wait for (membership.h): those this process sees alive, or, when it sees fewer
  // than half of the members, all of them.
  std::vector<int> expect;
  bool all = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    expect = observersToAwait(base, slot_, [&](int s) { return alive(s, base.incarnation[s]); },
                              &all);
  }
  if (all) {
    MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_
                     << ": sees fewer than half of the members alive; waiting for every "
                        "member's observations";
  }
  std::map<int, Obs> fresh;
  {
    Obs mine;
    mine.inc = inc_;
    mine.tag = *r;
    mine.conn.assign(max_size_, 0);
    std::lock_guard<std::mutex> g(mu_);
    for (int s = 0; s < max_size_; ++s)
      if (alive(s, procs_[s].inc)) mine.conn[s] = procs_[s].inc;
    mine.conn[slot_] = inc_;
    fresh[slot_] = std::move(mine);
  }
  const Deadline window = std::min(deadline, Clock::now() + ms(reconciliationWindow()));
  for (;;) {
    for (int s : expect) {
      if (fresh.count(s)) continue;
      auto blob = root_.rdv->get(key("obs/" + std::to_string(s)));
      Obs o;
      if (blob.ok() && Obs::parse(*blob, &o) && o.inc == base.incarnation[s] && o.tag >= *r &&
          static_cast<int>(o.conn.size()) == max_size_)
        fresh[s] = std::move(o);
    }
    if (fresh.size() == expect.size() + 1 || Clock::now() >= window) break;
    nap(window, milliseconds(5));
    serviceRequests();
  }
  Found f;
  f.candidates.assign(max_size_, 0);
  f.links = LinkMatrix(max_size_);
  for (const auto& [a, o] : fresh) {
    f.candidates[a] = 1;
    for (int b = 0; b < max_size_; ++b)
      if (b != a && base.incarnation[b] != 0 && o.conn[b] == base.incarnation[b])
        f.links.set(a, b, true);
  }
  SlotMask active(max_size_, 0);
  for (int s = 0; s < max_size_ && s < base.maxSize(); ++s)
    active[s] = base.state[s] == MemberState::kActive ? 1 : 0;
  f.healthy = healthySet(f.candidates, f.links, &active);
  return f;
}

View Elastic::decide(const View& v, Deadline deadline) {
  auto got = log_->propose(v.epoch, v.serialize(), deadline);
  if (!got.ok())
    throw CommError("mooncake pg: group " + name_ + " slot " + std::to_string(slot_) +
                        ": agreeing on view " + std::to_string(v.epoch) + ": " +
                        got.status().toString(),
                    -1, "view");
  ring();
  View latest = refreshLatest();
  View out;
  if (!View::parse(*got, &out))
    throw CommError("mooncake pg: group " + name_ + ": view " + std::to_string(v.epoch) +
                        " is malformed",
                    -1, "view");
  (void)latest;
  return out;
}

// ---- reconciliation ----

bool Elastic::needsReconcile(const View& latest) const {
  std::lock_guard<std::mutex> g(mu_);
  for (int s = 0; s < latest.maxSize(); ++s) {
    if (s == slot_) continue;
    const MemberState st = latest.state[s];
    if (st != MemberState::kActive && st != MemberState::kAwaiting) continue;
    if (!eo_.auto_deactivate_on_failure && !latest.healthy[s]) continue;  // recorded already
    const Proc& p = procs_[s];
    if (p.inc == latest.incarnation[s] && p.peer != engine::kInvalidPeer &&
        !root_.engine->peerStatus(p.peer).ok())
      return true;
  }
  return broken_flag_.load() && latest.data_epoch == applied_.data_epoch;
}

int Elastic::proposerRank(const View& v) const {
  std::lock_guard<std::mutex> g(mu_);
  if (!(v.active(slot_) && v.incarnation[slot_] == inc_)) return -1;
  int pos = 0;
  for (int s = 0; s < slot_; ++s)
    if (v.active(s) && alive(s, v.incarnation[s])) ++pos;
  return pos;
}

void Elastic::reconcile(bool urgent, Deadline deadline) {
  View base = refreshLatest();
  if (!urgent) {
    // The lowest live active slot proposes at once; the others give it kStagger per place
    // (and non-members do not propose), so proposals rarely collide, and a dead or stalled
    // first proposer costs one stagger.
    const int pos = proposerRank(base);
    if (pos < 0) return;
    const Deadline go = Clock::now() + pos * kStagger;
    while (Clock::now() < go) {
      nap(go, milliseconds(10));
      serviceRequests();
      if (refreshLatest().epoch > base.epoch) return;  // someone decided: the caller re-checks
    }
  }
  Found f = observe(base, {}, deadline);
  bool resync;
  {
    std::lock_guard<std::mutex> g(mu_);
    resync = broken_flag_.load() && base.data_epoch == applied_.data_epoch;
  }
  View next = reconciled(base, f.healthy, eo_.auto_deactivate_on_failure, resync);
  if (next.sameMembers(base) && next.healthy == base.healthy && next.data_epoch == base.data_epoch)
    return;  // nothing to change
  View got = decide(next, deadline);
  MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_ << " reconciled: "
                   << got.describe();
}

SyncResult Elastic::syncImpl(bool holding_op) {
  const Deadline deadline =
      Clock::now() + std::max(milliseconds(5000), 3 * ms(collectiveTimeout()));
  View latest = refreshLatest();
  const bool pending = needsReconcile(latest);
  if (pending) {
    reconcile(/*urgent=*/false, deadline);
    latest = refreshLatest();
    // Nobody proposed (this process is no proposer, or the others stayed quiet): do it now.
    if (needsReconcile(latest)) {
      reconcile(/*urgent=*/true, deadline);
      latest = refreshLatest();
    }
  }
  const uint64_t before = applied_epoch_.load();
  if (holding_op) {
    applyAll(deadline);
  } else {
    applyUntil(latest.epoch, deadline, nullptr);
  }
  return {pending || applied_epoch_.load() > before ? SyncStatus::kReconciled
                                                    : SyncStatus::kNoPending,
          ""};
}

SyncResult Elastic::sync() { return syncImpl(false); }

// ---- membership calls ----

namespace {
void checkSlots(const std::vector<int>& slots, int max, const char* what) {
  for (int s : slots)
    if (s < 0 || s >= max)
      throw std::invalid_argument(std::string("mooncake pg: ") + what + ": rank " +
                                  std::to_string(s) + " is outside the group's " +
                                  std::to_string(max) + " rank slots");
}
ProposalResult rejected(std::string why) {
  ProposalResult r;
  r.status = ProposalStatus::kRejected;
  r.reject_reason = std::move(why);
  return r;
}
}  // namespace

ProposalResult Elastic::activate(const std::vector<int>& slots) {
  checkSlots(slots, max_size_, "activate_ranks");
  const Deadline admission = Clock::now() + kAdmissionTimeout;
  const Deadline apply_by = admission + 3 * ms(collectiveTimeout());
  std::string waiting = "proposal admission timed out";
  for (;;) {
    View base = refreshLatest();
    bool all_active = true;
    for (int t : slots) {
      if (base.state[t] == MemberState::kNone || base.state[t] == MemberState::kLeft)
        return rejected("target rank is not valid group member");
      all_active &= base.active(t);
    }
    if (all_active) {  // nothing to change: no new epoch
      applyUntil(base.epoch, apply_by, nullptr);
      ProposalResult r;
      r.status = ProposalStatus::kApplied;
      r.new_epoch = base.epoch;
      return r;
    }
    bool joined_all = true;
    for (int t : slots) joined_all &= base.state[t] != MemberState::kInactive;
    if (joined_all) {
      std::vector<int> must = base.activeSlots();
      must.insert(must.end(), slots.begin(), slots.end());
      Found f = observe(base, must, admission);
      Admission a = admitActivation(base, slots, f.healthy, f.links);
      if (a.kind == Admission::kReject) return rejected(a.reason);
      if (a.kind == Admission::kAdmit) {
        View next = activated(base, slots);
        next.healthy = f.healthy;
        View got = decide(next, apply_by);
        bool done = true;
        for (int t : slots) done &= got.active(t);
        if (done) return applyDecided(got.epoch, apply_by);
        continue;  // another change won this epoch: look again
      }
      waiting = "proposal admission timed out (" + a.reason + ")";
    }
    if (Clock::now() >= admission) return rejected(waiting);
    nap(admission, milliseconds(50));
    serviceRequests();
  }
}

ProposalResult Elastic::deactivate(const std::vector<int>& slots) {
  checkSlots(slots, max_size_, "deactivate_ranks");
  const Deadline deadline = Clock::now() + kAdmissionTimeout + 3 * ms(collectiveTimeout());
  for (;;) {
    View base = refreshLatest();
    bool any = false;
    for (int t : slots) any |= base.active(t);
    if (!any) {
      applyUntil(base.epoch, deadline, nullptr);
      ProposalResult r;
      r.status = ProposalStatus::kApplied;
      r.new_epoch = base.epoch;
      return r;
    }
    View got = decide(deactivated(base, slots), deadline);
    bool done = true;
    for (int t : slots) done &= !got.active(t);
    if (!done) continue;
    return applyDecided(got.epoch, deadline);
  }
}

ProposalResult Elastic::applyDecided(uint64_t epoch, engine::Deadline deadline) {
  applyUntil(epoch, deadline, nullptr);
  ProposalResult r;
  r.new_epoch = epoch;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = dropped_.find(epoch);
    if (it != dropped_.end()) r.dropped_ranks = it->second;
  }
  r.status = r.dropped_ranks.empty() ? ProposalStatus::kApplied
                                     : ProposalStatus::kAppliedWithDroppedRanks;
  return r;
}

void Elastic::join() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!isolated_.load() && applied_.incarnation[slot_] == inc_ && applied_.active(slot_))
      throw std::logic_error("mooncake pg: group " + name_ + " slot " + std::to_string(slot_) +
                             ": joinGroup requires an isolated or inactive rank");
  }
  quiescing_ = true;
  struct Unquiesce {
    std::atomic<bool>& q;
    ~Unquiesce() { q = false; }
  } unquiesce{quiescing_};
  { std::lock_guard<std::mutex> drain(op_mu_); }  // the op in flight ends first
  const Deadline deadline = Clock::now() + std::min<std::chrono::milliseconds>(
                                               kJoinTimeout, root_.opts.timeout);
  for (;;) {
    View base = refreshLatest();
    const bool mine = base.incarnation[slot_] == inc_;
    if (mine && base.active(slot_)) {
      applyUntil(base.epoch, deadline, nullptr);
      return;
    }
    if (!(mine && base.state[slot_] == MemberState::kAwaiting)) {
      std::string refusal = joinRefusal(base, slot_, inc_);
      if (!refusal.empty())
        throw std::logic_error("mooncake pg: group " + name_ + ": join_group: " + refusal);
      decide(joined(base, slot_, inc_), deadline);
      continue;
    }
    if (Clock::now() >= deadline)
      throw CommError("mooncake pg: group " + name_ + " slot " + std::to_string(slot_) +
                          ": join_group: no activation within the timeout",
                      -1, "join_group");
    nap(deadline, milliseconds(50));
    serviceRequests();
  }
}

void Elastic::agreeOnBarrier(uint64_t epoch, Acks* acks, std::vector<int>* lost) {
  std::ostringstream mine;
  for (const auto& [who, val] : *acks)
    mine << "a " << who.first << " " << who.second << " " << val.first << " " << val.second
         << "\n";
  for (int s : *lost) mine << "l " << s << "\n";
  auto got = bar_log_->propose(
      epoch, mine.str(),
      Clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(collectiveTimeout()));
  if (!got.ok())
    throw CommError("mooncake pg: group " + name_ + ": agreeing on the acknowledgements of view " +
                        std::to_string(epoch) + ": " + got.status().toString(),
                    -1, "view");
  if (*got == mine.str()) return;
  acks->clear();
  lost->clear();
  std::istringstream in(*got);
  std::string tag;
  while (in >> tag) {
    if (tag == "a") {
      int s = 0;
      uint32_t inc = 0;
      uint64_t n = 0;
      std::string m;
      in >> s >> inc >> n >> m;
      (*acks)[{s, inc}] = {n, m};
    } else {
      int s = 0;
      in >> s;
      lost->push_back(s);
    }
  }
  // This process acknowledged, but the decided outcome did not see it: it is lost to the others
  // (they count it gone: ops fail until the next view), and so to itself.
  if (acks->count({slot_, inc_}) == 0 &&
      std::find(lost->begin(), lost->end(), slot_) == lost->end())
    lost->push_back(slot_);
  MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_ << ": view " << epoch
                   << "'s barrier takes the acknowledgements another process saw";
}

}  // namespace mooncake::pg
