// Leader election and membership of store masters on etcd (etcd_client.h).
//
// Every master holds one etcd lease (TTL ttl_s) and keeps it alive every ttl_s / 3; under it,
// its membership key "mooncake-store/<cluster>/masters/<name>" and, while it leads, the election
// key "mooncake-store/<cluster>/leader" = "<address>\n<name>". A standby tries to create the
// election key (a txn: only if absent) every poll period; the one that creates it leads, and
// the key's create_revision is the leadership's epoch (etcd revisions only grow, so every new
// leader has a larger epoch than any before it). When the leader dies its lease lapses after at
// most ttl_s, etcd deletes the key, and a standby takes over.
//
// Fencing: a leader steps down by itself (on_lost) once it has not renewed its lease for
// two thirds of ttl_s (at least 300 ms less than ttl_s), measured from when it *sent* its last
// successful keep-alive, so that it stops serving before etcd can let another master lead; etcd
// calls time out well within the remaining third. It also steps down when the lease or
// the key is gone. It then campaigns again as a standby.
//
// Nothing here is touched per put: a keep-alive every ttl_s / 3, a txn per poll while standing by.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "store/ha/etcd_client.h"

namespace mooncake::store::ha {

struct ElectionOptions {
  std::string cluster_id = "mooncake";
  std::string name;     // unique among the cluster's masters
  std::string address;  // what clients connect to (the master's rendezvous host:port)
  int64_t ttl_s = 3;
  int64_t poll_ms = 200;  // how often a standby tries to take the election key
};

class LeaderElection {
 public:
  // on_elected(epoch, took_over) and on_lost() run on the election thread, in order, never
  // concurrently. took_over: another master led the cluster while this one stood by.
  LeaderElection(std::unique_ptr<EtcdClient> etcd, ElectionOptions options,
                 std::function<void(int64_t epoch, bool took_over)> on_elected,
                 std::function<void()> on_lost);
  ~LeaderElection();  // stop()

  // Grants the lease and writes the membership key (fails with etcd's error, e.g. unreachable),
  // then starts the election thread.
  Status start();
  // Stops the thread; a leader resigns (deletes its key, revokes its lease: the others take over
  // at once instead of after the TTL).
  void stop();

  bool isLeader() const { return leader_.load(); }
  int64_t epoch() const { return epoch_.load(); }
  uint64_t elections() const { return elections_.load(); }  // times this master became leader

 private:
  void loop();
  Status renewLease();  // keep-alive; re-grants a lapsed lease (and rewrites membership)
  void stepDown(const char* why);

  std::unique_ptr<EtcdClient> etcd_;
  ElectionOptions opt_;
  std::function<void(int64_t, bool)> on_elected_;
  bool saw_other_ = false;  // another master's election key seen since we last led
  std::function<void()> on_lost_;
  std::string leader_key_, member_key_, value_;

  int64_t lease_ = 0;
  std::chrono::steady_clock::time_point last_renew_sent_{};  // of the last successful renewal
  std::chrono::steady_clock::time_point next_renew_{};
  std::atomic<bool> leader_{false};
  std::atomic<int64_t> epoch_{0};
  std::atomic<uint64_t> elections_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// The leader as clients see it: the address in the election key and its epoch.
struct LeaderInfo {
  std::string address;  // host:port of the leader's rendezvous
  std::string name;
  int64_t epoch = 0;
};
// kNotFound when there is no leader right now (an election is under way).
Result<LeaderInfo> readLeader(EtcdClient& etcd, const std::string& cluster_id);

}  // namespace mooncake::store::ha
