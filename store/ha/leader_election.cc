#include "store/ha/leader_election.h"

#include "engine/log.h"

namespace mooncake::store::ha {

namespace {
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
}  // namespace

LeaderElection::LeaderElection(std::unique_ptr<EtcdClient> etcd, ElectionOptions options,
                               std::function<void(int64_t, bool)> on_elected,
                               std::function<void()> on_lost)
    : etcd_(std::move(etcd)),
      opt_(std::move(options)),
      on_elected_(std::move(on_elected)),
      on_lost_(std::move(on_lost)) {
  if (opt_.ttl_s < 1) opt_.ttl_s = 1;
  if (opt_.poll_ms < 10) opt_.poll_ms = 10;
  leader_key_ = leaderKey(opt_.cluster_id);
  member_key_ = masterMemberKey(opt_.cluster_id, opt_.name);
  value_ = opt_.address + "\n" + opt_.name;
}

LeaderElection::~LeaderElection() { stop(); }

Status LeaderElection::start() {
  MC_ASSIGN_OR_RETURN(lease_, etcd_->grantLease(opt_.ttl_s));
  last_renew_sent_ = Clock::now();
  next_renew_ = last_renew_sent_ + milliseconds(opt_.ttl_s * 1000 / 3);
  MC_RETURN_IF_ERROR(etcd_->put(member_key_, opt_.address, lease_));
  thread_ = std::thread([this] { loop(); });
  return Status::OK();
}

void LeaderElection::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Resign: the next master need not wait for the lease to lapse.
  if (leader_.exchange(false)) (void)etcd_->deleteIfCreated(leader_key_, epoch_.load());
  if (lease_ != 0) (void)etcd_->revokeLease(lease_);
}

Status LeaderElection::renewLease() {
  const auto sent = Clock::now();
  if (lease_ == 0) {  // dropped when stepping down
    MC_ASSIGN_OR_RETURN(lease_, etcd_->grantLease(opt_.ttl_s));
    last_renew_sent_ = sent;
    return etcd_->put(member_key_, opt_.address, lease_);
  }
  auto ttl = etcd_->keepAlive(lease_);
  if (!ttl.ok()) return ttl.status();
  if (*ttl > 0) {
    last_renew_sent_ = sent;
    return Status::OK();
  }
  // The lease lapsed (etcd was away longer than the TTL): whatever it held is gone.
  if (leader_.load()) stepDown("its etcd lease lapsed");
  MC_ASSIGN_OR_RETURN(lease_, etcd_->grantLease(opt_.ttl_s));
  last_renew_sent_ = sent;
  return etcd_->put(member_key_, opt_.address, lease_);
}

void LeaderElection::stepDown(const char* why) {
  if (!leader_.exchange(false)) return;
  MC_LOG(WARN, STORE) << "master " << opt_.name << ": stepping down as leader (epoch "
                      << epoch_.load() << "): " << why;
  on_lost_();
  // Give the lease up: the election key goes with it, and a lease that is still alive would
  // keep our own stale key in place. If etcd is away, the lease lapses by itself.
  (void)etcd_->revokeLease(lease_);
  lease_ = 0;
  next_renew_ = Clock::now();
}

void LeaderElection::loop() {
  const auto ttl = milliseconds(opt_.ttl_s * 1000);
  const auto renew_every = ttl / 3;
  // Stop leading this long before etcd may expire the lease (measured from the sending of the
  // last renewal that etcd accepted, so the leader's view is never later than etcd's).
  const auto fence = ttl - std::max(milliseconds(300), ttl / 3);
  auto next_campaign_warn = Clock::time_point{};  // failed campaigns: one warning per 5 s
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    auto wake = now + milliseconds(opt_.poll_ms);
    lk.unlock();
    if (now >= next_renew_) {
      Status st = renewLease();
      // A failed renewal is retried soon; the fence below decides when to give up leading.
      next_renew_ = Clock::now() + (st.ok() ? renew_every : milliseconds(opt_.poll_ms));
      if (!st.ok()) {
        MC_LOG(WARN, STORE) << "master " << opt_.name
                            << ": etcd lease renewal failed: " << st.toString();
      }
      // While leading, make sure the key is still ours (someone may have deleted it by hand).
      if (st.ok() && leader_.load()) {
        auto kv = etcd_->get(leader_key_);
        if (kv.ok() && (!kv->has_value() || (*kv)->create_revision != epoch_.load()))
          stepDown("the election key is gone or belongs to another master");
      }
    }
    if (leader_.load() && Clock::now() - last_renew_sent_ > fence)
      stepDown("etcd did not renew its lease in time");
    if (!leader_.load() && lease_ != 0) {
      auto r = etcd_->createIfAbsent(leader_key_, value_, lease_);
      // Ours under our live lease although the create "failed": an earlier create went through
      // and its answer was lost (etcd restarting answers late). etcd says we lead: take it.
      const bool ours = r.ok() && !r->first && r->second.create_revision != 0 &&
                        r->second.value == value_ && r->second.lease == lease_;
      if (r.ok() && (r->first || ours)) {
        epoch_.store(r->second.create_revision);
        leader_.store(true);
        elections_.fetch_add(1);
        MC_LOG(INFO, STORE) << "master " << opt_.name << ": leader of cluster " << opt_.cluster_id
                            << " (epoch " << r->second.create_revision << ")"
                            << (ours ? ": the answer to its create was lost" : "");
        const bool took_over = saw_other_;
        saw_other_ = false;
        on_elected_(r->second.create_revision, took_over);
      } else if (r.ok() && r->second.value != value_ && r->second.create_revision != 0) {
        saw_other_ = true;
      } else if (!r.ok()) {
        if (Clock::now() >= next_campaign_warn) {
          MC_LOG(WARN, STORE) << "master " << opt_.name << ": campaign for the election key "
                              << "failed: " << r.status().toString();
          next_campaign_warn = Clock::now() + milliseconds(5000);
        }
      } else if (r.ok() && r->second.value == value_ && r->second.lease != lease_ &&
                 r->second.create_revision != 0) {
        // Our own key from an earlier lease (we stepped down while etcd was away): clear it
        // rather than wait out its TTL.
        (void)etcd_->deleteIfCreated(leader_key_, r->second.create_revision);
        wake = Clock::now();
      }
    }
    lk.lock();
    if (leader_.load()) wake = std::min(wake, std::max(Clock::now(), next_renew_));
    cv_.wait_until(lk, std::min(wake, next_renew_), [&] { return stop_; });
  }
}

Result<LeaderInfo> readLeader(EtcdClient& etcd, const std::string& cluster_id) {
  MC_ASSIGN_OR_RETURN(auto kv, etcd.get(leaderKey(cluster_id)));
  if (!kv.has_value())
    return MC_STATUS(kNotFound, "no leader of store cluster '" << cluster_id << "' in etcd");
  LeaderInfo li;
  size_t nl = kv->value.find('\n');
  li.address = kv->value.substr(0, nl);
  if (nl != std::string::npos) li.name = kv->value.substr(nl + 1);
  li.epoch = kv->create_revision;
  return li;
}

}  // namespace mooncake::store::ha
