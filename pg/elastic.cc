// Elastic groups: set-up, views and the view barrier, the agent. See pg/elastic.h.
#include "pg/elastic.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "engine/log.h"
#include "engine/params.h"
#include "engine/wire.h"

namespace mooncake::pg {

using engine::Clock;
using engine::Deadline;
using std::chrono::microseconds;
using std::chrono::milliseconds;

// ---- process-wide defaults (upstream: 10 s, 10 s; our window is how long a reconciliation
// waits for live members' observations, not a delay before it) ----
namespace {
std::atomic<int64_t> g_coll_us{10'000'000};
std::atomic<int64_t> g_p2p_us{10'000'000};
std::atomic<int64_t> g_window_us{1'000'000};
}  // namespace

void setCollectiveTimeout(microseconds t) { g_coll_us.store(std::max<int64_t>(t.count(), 1000)); }
void setP2pTimeout(microseconds t) { g_p2p_us.store(std::max<int64_t>(t.count(), 1000)); }
void setReconciliationWindow(microseconds t) {
  g_window_us.store(std::max<int64_t>(t.count(), 1000));
}
microseconds collectiveTimeout() { return microseconds(g_coll_us.load()); }
microseconds p2pTimeout() { return microseconds(g_p2p_us.load()); }
microseconds reconciliationWindow() { return microseconds(g_window_us.load()); }

void validateElastic(const CommOptions& o) {
  const ElasticOptions& e = o.elastic;
  const int max = e.max_group_size > 0 ? e.max_group_size : o.size;
  if (max < o.size)
    throw std::invalid_argument("mooncake pg: max_group_size " + std::to_string(max) +
                                " is smaller than the group size " + std::to_string(o.size));
  if (e.auto_sync_on_failure && !e.auto_deactivate_on_failure)
    throw std::invalid_argument(
        "mooncake pg: auto_sync_on_failure requires auto_deactivate_on_failure");
}

void createElastic(Communicator::Impl& root, uint32_t p2p_channel, Deadline deadline) {
  root.elastic = std::make_unique<Elastic>(root, p2p_channel);
  root.elastic->start(deadline);
}

// ---------------------------------------------------------------------------------------

Elastic::Elastic(Communicator::Impl& root, uint32_t p2p_channel)
    : root_(root), p2p_channel_(p2p_channel) {
  eo_ = root.opts.elastic;
  name_ = root.opts.group_name;
  slot_ = root.opts.rank;
  declared_ = root.opts.size;
  max_size_ = eo_.max_group_size > 0 ? eo_.max_group_size : root.opts.size;
  procs_.resize(max_size_);
  // The root indexes its peers by slot (p2p, peerOf); the data planes by compact rank.
  root_.rank = slot_;
  root_.size = max_size_;
  root_.peers.assign(max_size_, engine::kInvalidPeer);
  root_.health = std::make_unique<Health>(root_.engine.get(), root_.peers, slot_, name_);
}

Elastic::~Elastic() {
  {
    std::lock_guard<std::mutex> g(wake_mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  if (agent_.joinable()) agent_.join();
  // A member that is not active leaves the group for good (its slot reads Left), best effort
  // and briefly: a job that is ending may have lost its store already.
  try {
    View v;
    {
      std::lock_guard<std::mutex> g(mu_);
      v = latest_;
    }
    if (log_ && v.maxSize() > slot_ && v.incarnation[slot_] == inc_ && !v.active(slot_) &&
        v.state[slot_] != MemberState::kNone && v.state[slot_] != MemberState::kLeft &&
        !isolated_.load()) {
      const Deadline d = Clock::now() + milliseconds(1000);
      for (int i = 0; i < 5 && Clock::now() < d; ++i) {
        View cur = refreshLatest();
        if (cur.incarnation[slot_] != inc_ || cur.active(slot_) ||
            cur.state[slot_] == MemberState::kLeft)
          break;
        View got = decide(left(cur, slot_), d);
        if (got.state[slot_] == MemberState::kLeft) {
          ring();
          break;
        }
      }
    }
  } catch (const std::exception& e) {
    MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_ << ": leaving: " << e.what();
  }
  if (gone_handler_ != 0) root_.engine->removePeerGoneHandler(gone_handler_);
  if (ctl_channel_ != 0) {
    root_.engine->setMessageHandler(ctl_channel_, [](engine::Message&&) {});
    releaseChannel(root_.engine.get(), ctl_channel_);
  }
  std::lock_guard<std::mutex> g(op_mu_);
  plane_ = Plane{};
}

void Elastic::start(Deadline deadline) {
  engine::TransferEngine& eng = *root_.engine;
  engine::Rendezvous& rdv = *root_.rdv;
  auto fail = [&](const std::string& what, const Status& st) {
    throw CommError("mooncake pg: creating elastic group " + name_ + " (slot " +
                        std::to_string(slot_) + "): " + what + ": " + st.toString(),
                    -1, "init");
  };
  // This incarnation of the group (see the plain groups' gen): founders bump their slot's
  // counter; a process joining a running group uses slot 0's (a founder's).
  int64_t gen = 0;
  if (!eo_.is_extension) {
    auto r = rdv.add(name_ + "/gen/" + std::to_string(slot_), 1);
    if (!r.ok()) fail("rendezvous add", r.status());
    gen = *r;
  } else {
    for (;;) {
      auto r = rdv.add(name_ + "/gen/0", 0);
      if (!r.ok()) fail("rendezvous add", r.status());
      if (*r > 0) {
        gen = *r;
        break;
      }
      if (Clock::now() >= deadline)
        fail("waiting for the group's founders", MC_STATUS(kTimeout, "no founder yet"));
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  prefix_ = name_ + "#" + std::to_string(gen) + "/el";
  auto inc = rdv.add(key("inc/" + std::to_string(slot_)), 1);
  if (!inc.ok()) fail("rendezvous add", inc.status());
  inc_ = static_cast<uint32_t>(*inc);
  if (!eo_.is_extension && inc_ != 1)
    fail("slot " + std::to_string(slot_),
         MC_STATUS(kInvalidArgument, "is already taken (two founders with one rank?)"));
  RankRecord mine{eng.name(), eng.engineId(), reinterpret_cast<uint64_t>(root_.buffer),
                  root_.buffer_bytes, eng.localSegment().serialize()};
  Status st = rdv.set(key("rec/" + std::to_string(slot_) + "/" + std::to_string(inc_)),
                      mine.serialize());
  if (!st.ok()) fail("rendezvous set", st);
  {
    Proc& me = procs_[slot_];
    me.inc = inc_;
    me.have_record = true;
    me.rec = mine;
    me.base = static_cast<char*>(root_.buffer);
    me.host = eng.localSegment().host_id;
  }
  log_ = std::make_unique<ViewLog>(root_.rdv, key("log"),
                                   (static_cast<uint64_t>(slot_) + 1) << 24 | (inc_ & 0xffffff));
  log_->on_point = eo_.test_hook;
  bar_log_ = std::make_unique<ViewLog>(root_.rdv, key("bar"),
                                       (static_cast<uint64_t>(slot_) + 1) << 24 | (inc_ & 0xffffff));
  // Doorbells and deaths wake the agent.
  ctl_channel_ = channelFor("ctl", name_);
  claimChannel(&eng, ctl_channel_, name_);
  eng.setMessageHandler(ctl_channel_, [this](engine::Message&&) { wake(); });
  gone_handler_ = eng.addPeerGoneHandler([this](uint64_t, const std::string&, const Status&) {
    // The engine marks the peer dead right after its handlers ran: ops look again for a while.
    gone_at_ns_.store(Clock::now().time_since_epoch().count());
    gone_events_.fetch_add(1);
    wake();
  });
  root_.p2p = std::make_unique<P2p>(&eng, root_.health.get(), root_.peers, slot_, p2p_channel_,
                                    root_.params.wait.health_us, root_.params.net_piece_bytes,
                                    p2pArea(root_), root_.params.net_one_sided,
                                    root_.params.net_slot_min_bytes);
  root_.p2p->start();

  if (!eo_.is_extension) {
    // View 1 is the same for every founder: each writes it (same bytes), no agreement needed.
    View v1 = initialView(max_size_, declared_);
    st = rdv.set(key("log/d/1"), v1.serialize());
    if (!st.ok()) fail("rendezvous set", st);
    {
      std::lock_guard<std::mutex> g(mu_);
      latest_ = v1;
      views_[1] = v1;
      latest_epoch_ = 1;
      applied_.state.assign(max_size_, MemberState::kNone);
      applied_.incarnation.assign(max_size_, 0);
      applied_.healthy.assign(max_size_, 0);
    }
    std::vector<int> dropped;
    {
      std::lock_guard<std::mutex> g(op_mu_);
      data_ = applied_;
      applyAll(deadline, &dropped);
    }
    if (!dropped.empty() || !plane_.impl) {
      std::string who;
      for (int s : dropped) who += " " + std::to_string(s);
      fail("waiting for the founders", MC_STATUS(kTimeout, "no answer from slots" << who));
    }
  } else {
    // Wait for the founders' view 1, then follow the views; isolated until activated.
    for (;;) {
      View latest = refreshLatest();
      if (latest.epoch >= 1) break;
      if (Clock::now() >= deadline)
        fail("waiting for the group's first view", MC_STATUS(kTimeout, "none yet"));
      std::this_thread::sleep_for(milliseconds(5));
    }
    View latest = refreshLatest();
    if (latest.maxSize() != max_size_)
      fail("joining", MC_STATUS(kInvalidArgument, "the group has " << latest.maxSize()
                                                                   << " slots, this rank asked for "
                                                                   << max_size_));
    std::string refusal = joinRefusal(latest, slot_, inc_);
    if (!refusal.empty()) fail("joining", MC_STATUS(kInvalidArgument, refusal));
    openKnown(latest, Clock::now() + milliseconds(3000));
    isolated_ = true;
    std::lock_guard<std::mutex> og(op_mu_);
    {
      std::lock_guard<std::mutex> g(mu_);
      applied_ = latest;
      applied_epoch_ = latest.epoch;
      views_.clear();
    }
    data_ = View{};
    installPlane(latest, {"shm"}, /*isolated=*/true);
    updateP2p(latest);
  }
  // (Logged before the agent starts: it may install a plane, and path_, at once.)
  MC_LOG(INFO, PG) << "elastic group " << prefix_ << " slot " << slot_ << " (incarnation "
                   << inc_ << ", " << max_size_ << " slots) ready: " << path();
  agent_ = std::thread([this] { agentLoop(); });
}

// ---- queries ----

int Elastic::size() const {
  if (isolated_.load()) return declared_;
  std::lock_guard<std::mutex> g(mu_);
  return std::max(1, applied_.size());
}

uint64_t Elastic::epoch() const { return applied_epoch_.load(); }

SlotMask Elastic::activeMask() const {
  if (isolated_.load()) {
    SlotMask m(max_size_, 0);
    m[slot_] = 1;
    return m;
  }
  std::lock_guard<std::mutex> g(mu_);
  return applied_.activeMask();
}

bool Elastic::alive(int slot, uint32_t inc) const {
  if (slot == slot_) return inc == inc_;
  const Proc& p = procs_[slot];  // mu_ held by the caller
  return p.inc == inc && inc != 0 && p.peer != engine::kInvalidPeer &&
         root_.engine->peerStatus(p.peer).ok();
}

std::vector<uint8_t> Elastic::peerState(const std::vector<int>& slots) const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint8_t> out;
  for (int s : slots) {
    const MemberState st = latest_.state[s];
    out.push_back((st == MemberState::kActive || st == MemberState::kAwaiting) &&
                          alive(s, latest_.incarnation[s])
                      ? 1
                      : 0);
  }
  return out;
}

int Elastic::numSynced() const {
  std::vector<int> all(max_size_);
  for (int s = 0; s < max_size_; ++s) all[s] = s;
  std::vector<uint8_t> st = peerState(all);
  return static_cast<int>(std::count(st.begin(), st.end(), 1));
}

std::vector<int> Elastic::deadSlots() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int> out;
  for (int s = 0; s < applied_.maxSize(); ++s)
    if (s != slot_ && applied_.active(s) && !alive(s, applied_.incarnation[s])) out.push_back(s);
  return out;
}

engine::PeerId Elastic::peerOf(int slot) const {
  std::lock_guard<std::mutex> g(mu_);
  if (slot == slot_ || !applied_.active(slot)) return engine::kInvalidPeer;
  return procs_[slot].inc == applied_.incarnation[slot] ? procs_[slot].peer : engine::kInvalidPeer;
}

const std::string& Elastic::path() const { return path_; }

void Elastic::onViewChange(std::function<void()> cb) {
  std::lock_guard<std::mutex> g(mu_);
  callbacks_.push_back(std::move(cb));
}

// ---- doorbells ----

void Elastic::wake() {
  {
    std::lock_guard<std::mutex> g(wake_mu_);
    ++bell_;
  }
  wake_cv_.notify_all();
}

void Elastic::nap(Deadline d, milliseconds max) {
  std::unique_lock<std::mutex> g(wake_mu_);
  const uint64_t seen = bell_;
  const Deadline until = std::min<Deadline>(d, Clock::now() + max);
  wake_cv_.wait_until(g, until, [&] { return bell_ != seen || stop_; });
}

void Elastic::ring() {
  std::vector<engine::PeerId> peers;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int s = 0; s < max_size_; ++s)
      if (s != slot_ && procs_[s].peer != engine::kInvalidPeer) peers.push_back(procs_[s].peer);
  }
  for (engine::PeerId p : peers)
    (void)root_.engine->sendMessage(p, ctl_channel_, "", Clock::now());  // never blocks
}

// ---- views ----

View Elastic::refreshLatest() {
  uint64_t e;
  {
    std::lock_guard<std::mutex> g(mu_);
    e = latest_.epoch;
  }
  for (;;) {
    auto d = log_->decided(e + 1);
    if (!d.ok())
      throw CommError("mooncake pg: group " + name_ + ": reading view " + std::to_string(e + 1) +
                          ": " + d.status().toString(),
                      -1, "view");
    if (!d->has_value()) break;
    View v;
    if (!View::parse(**d, &v) || v.epoch != e + 1 || v.maxSize() != max_size_)
      throw CommError("mooncake pg: group " + name_ + ": view " + std::to_string(e + 1) +
                          " is malformed",
                      -1, "view");
    std::lock_guard<std::mutex> g(mu_);
    if (v.epoch > applied_.epoch) views_[v.epoch] = v;
    if (v.epoch > latest_.epoch) {  // another thread may have read further already
      latest_ = v;
      latest_epoch_ = v.epoch;
    }
    e = latest_.epoch;
  }
  std::lock_guard<std::mutex> g(mu_);
  return latest_;
}

void Elastic::ensureOpen(int slot, uint32_t inc, Deadline deadline) {
  if (slot == slot_ || inc == 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    const Proc& p = procs_[slot];
    if (p.inc > inc) return;  // a newer process holds it already
    if (p.inc == inc && p.peer != engine::kInvalidPeer) return;
  }
  auto blob = root_.rdv->get(key("rec/" + std::to_string(slot) + "/" + std::to_string(inc)));
  if (!blob.ok()) return;  // not published yet: the next tick tries again
  Proc p;
  p.inc = inc;
  if (!RankRecord::parse(*blob, &p.rec)) return;
  p.have_record = true;
  if (p.rec.engine_id == root_.engine->engineId()) return;
  auto desc = engine::SegmentDesc::parse(p.rec.segment);
  if (!desc.ok()) return;
  auto peer = root_.engine->openPeer(*desc, deadline);
  if (!peer.ok()) {
    MC_LOG(INFO, PG) << "group " << name_ << ": opening slot " << slot << " (incarnation " << inc
                     << "): " << peer.status().toString();
    return;
  }
  p.peer = *peer;
  p.host = desc->host_id;
  if (p.rec.buffer_bytes == root_.buffer_bytes)
    p.base = static_cast<char*>(
        root_.engine->mappedAddress(*peer, p.rec.buffer, p.rec.buffer_bytes));
  std::lock_guard<std::mutex> g(mu_);
  Proc& cur = procs_[slot];
  // Another thread (the agent, an op's barrier, an admission) may have opened this process
  // meanwhile: its entry (the same engine peer) holds the replaced process, which this one,
  // read before, would lose.
  if (cur.inc > inc || (cur.inc == inc && cur.peer != engine::kInvalidPeer)) return;
  if (cur.inc < inc && cur.peer != engine::kInvalidPeer) {
    p.prev_inc = cur.inc;
    p.prev_peer = cur.peer;
  }
  cur = std::move(p);
}

void Elastic::openKnown(const View& v, Deadline deadline) {
  // Members and joiners only: an inactive slot needs no link until it joins again (Awaiting),
  // and one whose host went silent held each caller (the agent, every tick) for the deadline
  // (test_pg_elastic.py::test_a_silent_inactive_slot_does_not_stall_the_agent).
  for (int s = 0; s < v.maxSize(); ++s)
    if (v.incarnation[s] != 0 &&
        (v.state[s] == MemberState::kActive || v.state[s] == MemberState::kAwaiting))
      ensureOpen(s, v.incarnation[s], deadline);
}

void Elastic::applyAll(Deadline deadline, std::vector<int>* dropped) {
  for (;;) {
    View next;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = views_.find(applied_.epoch + 1);
      if (it == views_.end()) return;
      next = it->second;
    }
    applyOne(next, deadline, dropped);
  }
}

void Elastic::applyOne(const View& v, Deadline deadline, std::vector<int>* dropped) {
  const bool was_isolated = isolated_.load();
  const bool now_member = v.incarnation[slot_] == inc_ && v.active(slot_);
  // An isolated rank keeps its local plane until a view activates it.
  const bool data = v.data_epoch != data_.data_epoch && (!was_isolated || now_member);
  std::vector<int> lost;
  if (data) {
    lost = runBarrier(v, deadline);
    if (dropped != nullptr) *dropped = lost;
  } else {
    updateP2p(v);
  }
  if (was_isolated && now_member) isolated_ = false;
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard<std::mutex> g(mu_);
    applied_ = v;
    applied_epoch_ = v.epoch;
    views_.erase(views_.begin(), views_.upper_bound(v.epoch));
    if (data) dropped_[v.epoch] = lost;
    while (dropped_.size() > 64) dropped_.erase(dropped_.begin());
    cbs = callbacks_;
  }
  MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_ << " applied " << v.describe()
                   << (data ? " (new data plane: " + path_ + ")" : "");
  for (auto& cb : cbs) {
    try {
      cb();
    } catch (...) {  // a callback's failure must not stop the group
    }
  }
  wake();  // threads waiting for this epoch
}

std::vector<int> Elastic::runBarrier(const View& v, Deadline deadline) {
  const View& w = data_;
  auto inW = [&](int s) { return w.maxSize() > s && w.active(s); };
  const bool meW = inW(slot_) && w.incarnation[slot_] == inc_;
  const bool meV = v.active(slot_) && v.incarnation[slot_] == inc_;
  // Participants: every process active in the old or the new data view.
  std::vector<std::pair<int, uint32_t>> parts;
  for (int s = 0; s < max_size_; ++s) {
    if (inW(s)) parts.emplace_back(s, w.incarnation[s]);
    if (v.active(s) && !(inW(s) && w.incarnation[s] == v.incarnation[s]))
      parts.emplace_back(s, v.incarnation[s]);
  }
  if (!meW && !meV) {
    // Not involved (an inactive member): no plane; follow the view.
    plane_ = Plane{};
    path_ = "none (not active)";
    data_ = v;
    updateP2p(v);
    return {};
  }
  // Leave the old plane: peers still in one of its ops fail it now.
  if (meW && plane_.impl) {
    Communicator::Impl& p = *plane_.impl;
    if (p.shm) p.shm->leave();
    if (p.local && p.local->shm) p.local->shm->leave();
    const std::string why = "it left this view of the group (epoch " +
                            std::to_string(w.epoch) + ") for a newer one";
    if (p.net) p.net->abort(Health::kLeftView, why);
    if (p.leaders && p.leaders->net) p.leaders->net->abort(Health::kLeftView, why);
  }
  const uint64_t my_count = meW ? count_ : 0;
  // Open the new view's processes (founders publish their records as they start: view 1 waits
  // for them as long as creation may take; later views' processes are known already, or a
  // joiner the agent opened, so one try each); then the path this rank can take over them.
  std::vector<int> slots = v.activeSlots();
  const Deadline open_by = v.epoch == 1 ? deadline : Clock::now() + milliseconds(2000);
  for (int s : slots) {
    for (;;) {
      ensureOpen(s, v.incarnation[s], open_by);
      bool open;
      {
        std::lock_guard<std::mutex> g(mu_);
        open = s == slot_ ||
               (procs_[s].inc == v.incarnation[s] && procs_[s].peer != engine::kInvalidPeer);
      }
      if (open || v.epoch != 1 || Clock::now() >= open_by) break;
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  std::string mode = "-";
  if (meV) {
    std::vector<char*> bases;
    std::vector<std::string> hosts;
    int me = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (size_t i = 0; i < slots.size(); ++i) {
        const Proc& p = procs_[slots[i]];
        const bool ok = p.inc == v.incarnation[slots[i]];
        bases.push_back(ok ? p.base : nullptr);
        hosts.push_back(ok ? p.host : "?" + std::to_string(slots[i]));
        if (slots[i] == slot_) me = static_cast<int>(i);
      }
    }
    mode = localMode(root_.params, bases, hosts, me);
  }
  auto ackKey = [&](int s, uint32_t inc) {
    return key("ack/" + std::to_string(v.epoch) + "/" + std::to_string(s) + "." +
               std::to_string(inc));
  };
  Status st = root_.rdv->set(ackKey(slot_, inc_), std::to_string(my_count) + " " + mode);
  if (!st.ok())
    throw CommError("mooncake pg: group " + name_ + ": acknowledging view " +
                        std::to_string(v.epoch) + ": " + st.toString(),
                    -1, "view");
  ring();
  // Everyone's acknowledgement; a process seen dead is dropped (after a last look: it may
  // have acknowledged before it died), one that does not answer by the deadline too.
  std::map<int, std::pair<uint64_t, std::string>> acks;  // slot (in W or V) -> (count, mode)
  Acks by_proc;
  by_proc[{slot_, inc_}] = {my_count, mode};
  std::vector<int> lost;
  // View 1 waits for the founders as long as group creation may take; later views give a
  // member that does not answer the collective timeout.
  const Deadline until =
      v.epoch == 1 ? deadline
                   : std::min(deadline, Clock::now() + std::chrono::duration_cast<milliseconds>(
                                                           collectiveTimeout()));
  for (const auto& [s, inc] : parts) {
    if (s == slot_ && inc == inc_) continue;
    for (;;) {
      bool dead;
      {
        // The process of (s, inc) as this process knows it: the slot's current one, or the
        // one a replacement took the slot from (a joiner's view can be decided before the
        // view that evicts the dead process it replaces). One this process never opened and
        // that a newer one replaced already is gone too: waiting for it would only cost the
        // collective timeout.
        std::lock_guard<std::mutex> g(mu_);
        const Proc& p = procs_[s];
        const engine::PeerId peer = p.inc == inc        ? p.peer
                                    : p.prev_inc == inc ? p.prev_peer
                                                        : engine::kInvalidPeer;
        dead = peer != engine::kInvalidPeer ? !root_.engine->peerStatus(peer).ok() : p.inc > inc;
      }
      auto r = root_.rdv->get(ackKey(s, inc));
      if (r.ok()) {
        std::istringstream in(*r);
        uint64_t n = 0;
        std::string m;
        in >> n >> m;
        by_proc[{s, inc}] = {n, m};
        break;
      }
      if (dead || Clock::now() >= until || stop_) {
        lost.push_back(s);
        break;
      }
      nap(until, milliseconds(20));
      serviceRequests();
    }
  }
  agreeOnBarrier(v.epoch, &by_proc, &lost);
  uint64_t K = 0;
  for (const auto& [who, val] : by_proc)
    if (inW(who.first) && w.incarnation[who.first] == who.second) K = std::max(K, val.first);
  // Skips an earlier barrier owed and this rank has not taken yet stay owed (they are ops of
  // an older view: the others ran them before any op of W); then the ops of W others started.
  const uint64_t owed = meW ? skip_ : 0;
  if (owed == 0) skip_hint_.assign(max_size_, 0);
  skip_ = owed + (meW && K > my_count ? K - my_count : 0);
  for (int s = 0; s < max_size_; ++s)
    if (inW(s) && !(v.active(s) && v.incarnation[s] == w.incarnation[s])) skip_hint_[s] = 1;
  // The new plane, over the new view's active slots.
  std::vector<std::string> modes;
  for (int s : slots) {
    auto it = by_proc.find({s, v.incarnation[s]});
    modes.push_back(it == by_proc.end() ? "net" : it->second.second);
  }
  if (meV) {
    installPlane(v, modes, false);
  } else {
    plane_ = Plane{};
    path_ = "none (not active)";
  }
  count_ = 0;
  broken_ = false;
  broken_flag_ = false;
  broken_hint_.assign(max_size_, 0);
  for (int s : lost)
    if (v.active(s)) {  // an active member that is gone: ops fail until the next view
      broken_ = true;
      broken_flag_ = true;
      broken_hint_[s] = 1;
    }
  data_ = v;
  updateP2p(v);
  if (!lost.empty()) wake();  // the agent reconciles (auto_deactivate)
  return lost;
}

void Elastic::installPlane(const View& v, const std::vector<std::string>& modes, bool isolated) {
  Plane p;
  p.slots = isolated ? std::vector<int>{slot_} : v.activeSlots();
  p.index.assign(max_size_, -1);
  for (size_t i = 0; i < p.slots.size(); ++i) p.index[p.slots[i]] = static_cast<int>(i);
  p.size = isolated ? declared_ : std::max(1, v.size());
  p.data_epoch = isolated ? 0 : v.data_epoch;
  auto impl = std::make_unique<Communicator::Impl>();
  Communicator::Impl& c = *impl;
  c.engine = root_.engine;
  c.rdv = root_.rdv;
  c.opts = root_.opts;
  c.params = root_.params;
  c.buffer_bytes = root_.buffer_bytes;  // the root's buffer (not owned here)
  c.net_areas = root_.net_areas;
  c.size = static_cast<int>(p.slots.size());
  std::vector<char*> bases;
  std::vector<std::string> hosts;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < p.slots.size(); ++i) {
      const int s = p.slots[i];
      const Proc& pr = procs_[s];
      const bool ok = s == slot_ || pr.inc == v.incarnation[s];
      if (s == slot_) c.rank = static_cast<int>(i);
      c.peers.push_back(s == slot_ || !ok ? engine::kInvalidPeer : pr.peer);
      bases.push_back(s == slot_ ? static_cast<char*>(root_.buffer) : ok ? pr.base : nullptr);
      hosts.push_back(ok ? pr.host : "?" + std::to_string(s));
    }
  }
  // Drop the old plane first: its channels are released before the new ones are claimed.
  plane_ = Plane{};
  buildDataPlane(c, bases, hosts, modes, isolated ? "@iso" : "@" + std::to_string(v.data_epoch),
                 isolated ? 0 : v.data_epoch, p.slots, /*retire=*/true);
  path_ = isolated ? "isolated (local only until join_group)" : c.path;
  p.impl = std::move(impl);
  plane_ = std::move(p);
}

void Elastic::updateP2p(const View& v) {
  std::vector<engine::PeerId> peers(max_size_, engine::kInvalidPeer);
  std::vector<uint64_t> engines(max_size_, 0);
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int s = 0; s < max_size_; ++s) {
      const Proc& p = procs_[s];
      if (p.inc != v.incarnation[s] || p.inc == 0) continue;
      engines[s] = p.have_record ? p.rec.engine_id : 0;
      const bool isolated_me = s == slot_ && isolated_.load();
      if (v.active(s) || isolated_me) peers[s] = s == slot_ ? engine::kInvalidPeer : p.peer;
    }
    root_.peers = peers;
  }
  auto h = std::make_shared<Health>(root_.engine.get(), peers, slot_, name_);
  root_.p2p->setPeers(std::move(peers), std::move(engines), std::move(h));
}

void Elastic::applyUntil(uint64_t epoch, Deadline deadline, std::vector<int>* dropped) {
  while (applied_epoch_.load() < epoch) {
    refreshLatest();
    {
      // Waits for a running op (bounded by its timeouts; one of a view this process is
      // leaving fails fast once the others left it).
      std::lock_guard<std::mutex> lk(op_mu_);
      applyAll(deadline, dropped);
    }
    if (applied_epoch_.load() >= epoch) return;
    if (Clock::now() >= deadline)
      throw CommError("mooncake pg: group " + name_ + " slot " + std::to_string(slot_) +
                          ": view " + std::to_string(epoch) + " was not applied in time",
                      -1, "view");
    nap(deadline, milliseconds(20));
    serviceRequests();
  }
}

// ---- the agent ----

void Elastic::agentLoop() {
  const auto poll = milliseconds(std::max<int64_t>(params::getInt("MC_PG_ELASTIC_POLL_MS"), 1));
  for (;;) {
    uint64_t seen;  // a doorbell during the tick makes the next one start at once
    {
      std::unique_lock<std::mutex> g(wake_mu_);
      if (stop_) return;
      seen = bell_;
    }
    try {
      agentTick();
    } catch (const std::exception& e) {
      MC_LOG(WARN, PG) << "group " << name_ << " slot " << slot_ << " agent: " << e.what();
    }
    // Right after a peer went away, look again soon: the engine marks it dead just after it
    // reported it, so the first look may still find it alive.
    const int64_t since = Clock::now().time_since_epoch().count() - gone_at_ns_.load();
    const milliseconds next = since < 200'000'000 ? std::min(poll, milliseconds(5)) : poll;
    std::unique_lock<std::mutex> g(wake_mu_);
    wake_cv_.wait_for(g, next, [&] { return bell_ != seen || stop_; });
    if (stop_) return;
  }
}

void Elastic::agentTick() {
  View latest = refreshLatest();
  openKnown(latest, Clock::now() + milliseconds(2000));
  serviceRequests();  // observation requests of reconciling processes
  // Reconcile when an active or awaiting member is gone, or an op failed here.
  if (eo_.auto_deactivate_on_failure && latest.epoch >= 1 && needsReconcile(latest)) {
    if (need_since_ == Clock::time_point{}) need_since_ = Clock::now();
    reconcile(/*urgent=*/false, Clock::now() + milliseconds(5000));
    latest = refreshLatest();
    if (!needsReconcile(latest)) need_since_ = {};
  } else {
    need_since_ = {};
  }
  // Apply what was decided, when no op runs (an op applies it at its start otherwise).
  if (applied_epoch_.load() < latest_epoch_.load()) {
    std::unique_lock<std::mutex> lk(op_mu_, std::try_to_lock);
    if (lk.owns_lock()) applyAll(Clock::now() + std::chrono::duration_cast<milliseconds>(
                                                    collectiveTimeout()));
  }
}

}  // namespace mooncake::pg
