// Failover of the store master, with real processes: etcd-server, mooncake_master binaries and
// forked clients running a checksummed writer/reader load (ha_harness.h). After each failure,
// every put that returned OK (logged by the clients) must read back with the right bytes through
// a fresh client, and the clients must resume putting within 3 s of the new master serving.
#include <gtest/gtest.h>

#include "tests/store/ha_harness.h"

namespace mooncake::test {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kClients = 4;

struct Scenario {
  std::string dir = makeTempDir("mc_ha_");
  std::string cluster;
  std::string address;  // what clients are given
  std::vector<pid_t> loads;

  ~Scenario() {
    stopLoads();
    removeTree(dir);
  }
  std::string log(int i) const { return dir + "/c" + std::to_string(i) + ".log"; }
  void startLoads(int n = kClients, const std::string& transport = "") {
    for (int i = 0; i < n; ++i) {
      LoadOptions o;
      o.master_address = address;
      o.cluster_id = cluster;
      o.name = cluster + "-c" + std::to_string(i);
      o.log = log(i);
      o.stop_file = dir + "/stop";
      o.transport = transport;
      loads.push_back(forkChild([o] { return runLoad(o); }));
    }
    // Writing starts once every client is connected (its segment mounted).
    for (int i = 0; i < n; ++i)
      for (int w = 0; w < 3000 && access((log(i) + ".ready").c_str(), F_OK) != 0; ++w)
        usleep(10000);
    std::ofstream(dir + "/stop.go") << "1";
  }
  // Stops the writing; the clients stay up (holding replicas) until endLoads().
  void stopWriting() {
    std::ofstream(dir + "/stop") << "1";
    for (size_t i = 0; i < loads.size(); ++i) {
      if (loads[i] <= 0) continue;
      for (int w = 0; w < 3000 && access((log(static_cast<int>(i)) + ".done").c_str(), F_OK) != 0;
           ++w)
        usleep(10000);
    }
  }
  // Ends the loads; true when every one exited 0 (no corrupt read).
  bool stopLoads() {
    if (loads.empty()) return true;
    stopWriting();
    std::ofstream(dir + "/stop.exit") << "1";
    bool ok = true;
    for (pid_t p : loads) {
      if (p <= 0) continue;
      int rc = waitChild(p, 30000);
      if (rc != 0) {
        std::fprintf(stderr, "load process %d ended with %d\n", p, rc);
        ok = false;
      }
    }
    loads.clear();
    return ok;
  }
  std::vector<Acked> acked(int n = kClients) const {
    std::vector<Acked> all;
    for (int i = 0; i < n; ++i) {
      auto v = readLog(log(i));
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  // Waits until client i acknowledged `count` puts after time `since_ns`; returns the time of
  // the first of them (0 when none came within timeout_ms).
  int64_t waitAcks(int i, int64_t since_ns, size_t count, int timeout_ms) const {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      size_t n = 0;
      int64_t first = 0;
      for (const Acked& a : readLog(log(i))) {
        if (a.ns <= since_ns) continue;
        if (first == 0) first = a.ns;
        ++n;
      }
      if (n >= count) return first;
      if (Clock::now() >= deadline) return 0;
      usleep(20000);
    }
  }
  // Checks every acknowledged put through a fresh client (in a child: no engine in the test
  // process, which forks). Returns the number of problems (printed).
  int verify(int n = kClients) const {
    std::vector<Acked> all = acked(n);
    std::string addr = address, cl = cluster;
    pid_t p = forkChild([all, addr, cl]() -> int {
      auto problems = verifyAll(addr, cl, all, 20000);
      for (size_t i = 0; i < problems.size() && i < 20; ++i)
        std::fprintf(stderr, "lost or corrupt: %s\n", problems[i].c_str());
      size_t upserted = 0;
      for (const Acked& a : all) upserted += a.upserts > 0 ? 1 : 0;
      std::fprintf(stderr,
                   "verified %zu acknowledged objects (%zu of them upserted): %zu problems\n",
                   all.size(), upserted, problems.size());
      return problems.empty() ? 0 : 1;
    });
    return waitChild(p, 120000);
  }
};

// The index of the master that serves, waiting up to timeout_ms; -1 if none. `t_ns` gets the
// time it was first seen serving.
int waitServing(const std::vector<std::unique_ptr<HaMaster>>& ms, int timeout_ms,
                int64_t* t_ns = nullptr) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    for (size_t i = 0; i < ms.size(); ++i) {
      if (ms[i]->alive() && ms[i]->serving()) {
        if (t_ns) *t_ns = monoNs();
        return static_cast<int>(i);
      }
    }
    usleep(20000);
  }
  return -1;
}

std::vector<std::unique_ptr<HaMaster>> startMasters(const EtcdProcess& etcd,
                                                    const std::string& cluster, int n,
                                                    const std::string& extra = "") {
  std::vector<std::unique_ptr<HaMaster>> ms;
  for (int i = 0; i < n; ++i) {
    ms.push_back(std::make_unique<HaMaster>("--etcd-endpoints " + etcd.endpoint() +
                                            " --cluster-id " + cluster + " --name m" +
                                            std::to_string(i) + " " + extra));
    if (!ms.back()->start()) return {};
  }
  return ms;
}

// Kill the leader of 3 while 4 clients write and read; the others take over without losing an
// acknowledged object, and the clients carry on.
void leaderFailover(const std::string& cluster, bool kill_a_client, bool kill_during_rebuild) {
  auto etcd = EtcdProcess::start();
  ASSERT_NE(etcd, nullptr) << "etcd did not start";
  Scenario s;
  s.cluster = cluster;
  s.address = "etcd://" + etcd->endpoint();
  const std::string extra = kill_during_rebuild ? "--rebuild-quiet-ms 1500" : "";
  auto masters = startMasters(*etcd, cluster, 3, "--leader-ttl-s 3 " + extra);
  ASSERT_EQ(masters.size(), 3u);
  int leader = waitServing(masters, 20000);
  ASSERT_GE(leader, 0) << "no master leads";
  s.startLoads();
  for (int i = 0; i < kClients; ++i)
    ASSERT_NE(s.waitAcks(i, 0, 40, 30000), 0) << "client " << i << " made no progress";

  const int64_t t_kill = monoNs();
  masters[leader]->kill9();
  if (kill_a_client) {
    kill(s.loads[kClients - 1], SIGKILL);
    waitpid(s.loads[kClients - 1], nullptr, 0);
    s.loads[kClients - 1] = -1;
  }
  if (kill_during_rebuild) {
    // The next leader, caught while it collects the clients' reports, dies too.
    int rebuilding = -1;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (rebuilding < 0 && Clock::now() < deadline) {
      for (size_t i = 0; i < masters.size(); ++i)
        if (masters[i]->alive() && masters[i]->rebuilding()) rebuilding = static_cast<int>(i);
      usleep(10000);
    }
    ASSERT_GE(rebuilding, 0) << "no master was seen rebuilding";
    masters[rebuilding]->kill9();
  }
  int64_t t_serving = 0;
  int next = waitServing(masters, 30000, &t_serving);
  ASSERT_GE(next, 0) << "no master took over";
  ASSERT_NE(next, leader);
  const int live = kill_a_client ? kClients - 1 : kClients;
  for (int i = 0; i < live; ++i) {
    int64_t first = s.waitAcks(i, t_serving, 1, 15000);
    ASSERT_NE(first, 0) << "client " << i << " did not resume";
    const double resume_s = (first - t_serving) * 1e-9;
    std::fprintf(stderr,
                 "client %d: first put %.3f s after the new leader served (%.3f s after "
                 "the kill)\n",
                 i, resume_s, (first - t_kill) * 1e-9);
    EXPECT_LE(resume_s, 3.0) << "client " << i;
  }
  for (int i = 0; i < live; ++i) ASSERT_NE(s.waitAcks(i, t_serving, 20, 30000), 0);
  s.stopWriting();
  EXPECT_EQ(s.verify(), 0);
  EXPECT_TRUE(s.stopLoads()) << "a client read wrong bytes";
  EXPECT_GE(masters[next]->metric("mooncake_store_failovers_total"), 1);
  EXPECT_GE(masters[next]->metric("mooncake_store_objects_recovered_total"), 40 * live);
  EXPECT_EQ(masters[next]->metric("mooncake_store_evictions_total"), 0);
  std::fprintf(stderr, "kill -> new leader serving: %.3f s; rebuild %.3f s\n",
               (t_serving - t_kill) * 1e-9,
               masters[next]->metric("mooncake_store_rebuild_duration_seconds"));
}

TEST(StoreHa, LeaderKilledMidLoad) { leaderFailover("ha-kill", false, false); }
TEST(StoreHa, ClientKilledDuringFailover) { leaderFailover("ha-client", true, false); }
TEST(StoreHa, MasterKilledDuringRebuild) { leaderFailover("ha-rebuild", false, true); }

// One master, no etcd: killed and restarted on the same port under load.
TEST(StoreHa, SingleMasterRestartedUnderLoad) {
  Scenario s;
  s.cluster = "single";
  std::vector<std::unique_ptr<HaMaster>> ms;
  ms.push_back(std::make_unique<HaMaster>("--rebuild-quiet-ms 1000"));
  ASSERT_TRUE(ms[0]->start());
  s.address = ms[0]->address();
  ASSERT_EQ(waitServing(ms, 10000), 0);
  s.startLoads();
  for (int i = 0; i < kClients; ++i) ASSERT_NE(s.waitAcks(i, 0, 40, 30000), 0);
  const int64_t t_kill = monoNs();
  ms[0]->kill9();
  ms[0] = std::make_unique<HaMaster>("--rebuild-quiet-ms 1000", ms[0]->port());
  ASSERT_TRUE(ms[0]->start()) << "the master did not restart on its port";
  int64_t t_serving = 0;
  ASSERT_EQ(waitServing(ms, 20000, &t_serving), 0);
  for (int i = 0; i < kClients; ++i) {
    int64_t first = s.waitAcks(i, t_serving, 1, 15000);
    ASSERT_NE(first, 0) << "client " << i << " did not resume";
    std::fprintf(stderr,
                 "client %d: first put %.3f s after the restarted master served (%.3f s "
                 "after the kill)\n",
                 i, (first - t_serving) * 1e-9, (first - t_kill) * 1e-9);
    EXPECT_LE((first - t_serving) * 1e-9, 3.0);
  }
  for (int i = 0; i < kClients; ++i) ASSERT_NE(s.waitAcks(i, t_serving, 20, 30000), 0);
  s.stopWriting();
  EXPECT_EQ(s.verify(), 0);
  EXPECT_TRUE(s.stopLoads());
  EXPECT_GE(ms[0]->metric("mooncake_store_rebuilds_total"), 1);
  EXPECT_GE(ms[0]->metric("mooncake_store_objects_recovered_total"), 40 * kClients);
}

// etcd goes away and comes back (same data dir): puts never touch etcd, so they go on; nothing
// acknowledged is lost whether or not the leader had to step down meanwhile.
TEST(StoreHa, EtcdRestarted) {
  auto etcd = EtcdProcess::start();
  ASSERT_NE(etcd, nullptr);
  Scenario s;
  s.cluster = "ha-etcd";
  s.address = "etcd://" + etcd->endpoint();
  auto masters = startMasters(*etcd, s.cluster, 3, "--leader-ttl-s 3");
  ASSERT_EQ(masters.size(), 3u);
  ASSERT_GE(waitServing(masters, 20000), 0);
  s.startLoads();
  for (int i = 0; i < kClients; ++i) ASSERT_NE(s.waitAcks(i, 0, 30, 30000), 0);
  const int64_t t_down = monoNs();
  etcd->stop(SIGKILL);
  usleep(500000);
  size_t during = 0;
  for (const Acked& a : s.acked())
    if (a.ns > t_down) ++during;
  EXPECT_GT(during, 0u) << "puts stopped while etcd was away";
  ASSERT_TRUE(etcd->restart()) << "etcd did not come back";
  const int64_t t_up = monoNs();
  ASSERT_GE(waitServing(masters, 30000), 0);
  for (int i = 0; i < kClients; ++i) ASSERT_NE(s.waitAcks(i, t_up, 20, 30000), 0);
  s.stopWriting();
  EXPECT_EQ(s.verify(), 0);
  EXPECT_TRUE(s.stopLoads());
  std::fprintf(stderr, "puts acknowledged while etcd was down: %zu\n", during);
}

// Bad input: a master pointed at an etcd nobody listens on says so and exits; so does a client.
TEST(StoreHa, UnreachableEtcdIsAClearError) {
  const uint16_t nobody = freePort();
  const std::string err = makeTempDir("mc_ha_err_");
  HaMaster m("--etcd-endpoints 127.0.0.1:" + std::to_string(nobody) + " --cluster-id x", 0,
             err + "/stderr");
  EXPECT_FALSE(m.start());
  EXPECT_EQ(m.waitExit(10000), 1);
  std::ifstream in(err + "/stderr");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("cannot reach etcd at 127.0.0.1:" + std::to_string(nobody)),
            std::string::npos)
      << text;
  removeTree(err);
  pid_t p = forkChild([nobody]() -> int {
    auto eng = engine::TransferEngine::create({});
    if (!eng.ok()) return 10;
    store::StoreClientOptions so;
    so.master_address = "etcd://127.0.0.1:" + std::to_string(nobody);
    so.secret = jobSecret();
    std::string why;
    auto t0 = Clock::now();
    auto c = store::StoreClient::connect(eng->get(), so, &why);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::fprintf(stderr, "client: %s after %.2f s\n", why.c_str(), s);
    if (c.ok() || c.error() != store::ErrorCode::ETCD_OPERATION_ERROR) return 1;
    if (why.find("etcd at 127.0.0.1:" + std::to_string(nobody)) == std::string::npos) return 2;
    return s < 10 ? 0 : 3;
  });
  EXPECT_EQ(waitChild(p, 30000), 0);
}

// Two clusters on one etcd: each has its own leader and its own objects.
TEST(StoreHa, ClustersOnOneEtcdAreIsolated) {
  auto etcd = EtcdProcess::start();
  ASSERT_NE(etcd, nullptr);
  auto a = startMasters(*etcd, "iso-a", 1);
  auto b = startMasters(*etcd, "iso-b", 1);
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  ASSERT_EQ(waitServing(a, 20000), 0) << "cluster a has no leader";
  ASSERT_EQ(waitServing(b, 20000), 0) << "cluster b has no leader: it saw a's";
  const std::string ep = etcd->endpoint();
  const std::string dir = makeTempDir("mc_ha_iso_");
  // One client process per cluster (one lending engine per process), both writing key "k".
  auto client = [&](const std::string& cluster, const std::string& mine,
                    const std::string& other_only) {
    return forkChild([=]() -> int {
      engine::EngineOptions eo;
      eo.name = "iso-client-" + cluster;
      auto eng = engine::TransferEngine::create(eo);
      if (!eng.ok()) return 10;
      store::StoreClientOptions so;
      so.segment_size = 8 << 20;
      so.master_address = "etcd://" + ep;
      so.cluster_id = cluster;
      so.secret = jobSecret();
      std::string why;
      auto c = store::StoreClient::connect(eng->get(), so, &why);
      if (!c.ok()) {
        std::fprintf(stderr, "%s: %s\n", cluster.c_str(), why.c_str());
        return 11;
      }
      std::string v = valueFor(mine, 5000);
      if ((*c)->put("k", v.data(), v.size()) != store::ErrorCode::OK) return 2;
      if ((*c)->put(mine, v.data(), v.size()) != store::ErrorCode::OK) return 3;
      std::ofstream(dir + "/" + cluster) << "1";
      for (int i = 0;
           i < 1000 &&
           access((dir + "/iso-a").c_str(), F_OK) + access((dir + "/iso-b").c_str(), F_OK) != 0;
           ++i)
        usleep(10000);
      // Both put "k": each cluster has its own, and neither sees the other's key.
      auto got = (*c)->get("k");
      if (!got.ok() || *got != v) {
        std::fprintf(
            stderr, "%s: get k: %s\n", cluster.c_str(),
            got.ok() ? "other bytes" : std::string(store::errorCodeName(got.error())).c_str());
        return 4;
      }
      auto miss = (*c)->get(other_only);
      if (miss.ok() || miss.error() != store::ErrorCode::OBJECT_NOT_FOUND) return 5;
      std::ofstream(dir + "/" + cluster + ".checked") << "1";
      for (int i = 0; i < 1000 && access((dir + "/iso-a.checked").c_str(), F_OK) +
                                          access((dir + "/iso-b.checked").c_str(), F_OK) !=
                                      0;
           ++i)
        usleep(10000);
      (*c)->close();
      return 0;
    });
  };
  pid_t pa = client("iso-a", "only-a", "only-b");
  pid_t pb = client("iso-b", "only-b", "only-a");
  EXPECT_EQ(waitChild(pa, 60000), 0);
  EXPECT_EQ(waitChild(pb, 60000), 0);
  EXPECT_EQ(a[0]->metric("mooncake_store_evictions_total"), 0);
  EXPECT_EQ(b[0]->metric("mooncake_store_evictions_total"), 0);
  removeTree(dir);
  auto etcd_c = store::ha::EtcdClient::create(ep, 1000);
  ASSERT_TRUE(etcd_c.ok());
  auto la = (*etcd_c)->get(store::ha::leaderKey("iso-a"));
  auto lb = (*etcd_c)->get(store::ha::leaderKey("iso-b"));
  ASSERT_TRUE(la.ok() && lb.ok() && la->has_value() && lb->has_value());
  EXPECT_NE((*la)->value, (*lb)->value);
}

}  // namespace
}  // namespace mooncake::test
