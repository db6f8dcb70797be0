// mooncake_master: the standalone store master.
//
//   mooncake_master [--host 127.0.0.1] [--port 50051] [--secret-file F]
//                   [--eviction-high-watermark 0.95] [--eviction-ratio 0.05]
//                   [--lease-ttl-ms 5000] [--client-ttl-s 10] [--metrics-port 9003]
//                   [--etcd-endpoints http(s)://H:P[,H:P] --cluster-id NAME [--leader-ttl-s 3]
//                    [--name NAME] [--etcd-user U --etcd-password-file F] [--etcd-ca-file F]
//                    [--etcd-cert-file F --etcd-key-file F]]
//                   [--rebuild-quiet-ms N] [--rebuild-timeout-ms N]
//
// --etcd-user/--etcd-password-file (etcd's authentication) and --etcd-ca-file/--etcd-cert-file/
// --etcd-key-file (https endpoints) override MC_ETCD_USER, MC_ETCD_PASSWORD_FILE,
// MC_ETCD_CA_FILE, MC_ETCD_CERT_FILE and MC_ETCD_KEY_FILE (store/ha/etcd_security.h).
//
// One process runs: a TcpRendezvousServer on --port (the `master_server_address` host:port that
// clients are given; clients publish their own engine segments there too, so they find each
// other by name), an engine whose two-sided messages carry the store RPCs to the MasterService,
// and, unless --metrics-port is 0, an HTTP server with /metrics (Prometheus text), /health and
// /get_all_segments (upstream's route: the mounted segments' names).
// --host applies to every port it opens; without it the master listens on 127.0.0.1 only (as
// Redis and etcd do by default): pass the address clients on other hosts reach it at, or 0.0.0.0
// for every interface.
//
// Alone, the master starts by rebuilding its metadata from whatever its clients hold (they
// report their segments' records when they reconnect after a restart; docs/store.md) and serves
// once no new client has come for --rebuild-quiet-ms (1000). With --etcd-endpoints it is one of
// several masters of cluster --cluster-id: it stands by until it wins the election (an etcd lease
// of --leader-ttl-s, 3 s), then rebuilds (waiting for every client whose membership key is in
// etcd, at most --rebuild-timeout-ms) and serves until it dies or loses its lease. A master that
// loses the lease stops serving and replaces its engine, so that clients see the old master go
// before a new one can serve, then stands by again.
//
// The job secret (docs/security.md): the file --secret-file when given, else MC_SECRET when set,
// else the file MC_SECRET_FILE / ~/.mooncake/secret, created (mode 0600) when missing, so that
// clients of the same user on this host find it with no configuration. Every master of a cluster must use the
// same secret. MC_ALLOW_NO_SECRET=1 runs without one. Defaults not given on the command line come
// from the MC_STORE_* parameters. Prints "mooncake_master ready port=<p> metrics_port=<m>" once
// it listens (in a cluster: standing by or leading).

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "engine/engine.h"
#include "engine/log.h"
#include "engine/params.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "store/client/rpc.h"
#include "store/ha/etcd_client.h"
#include "store/ha/leader_election.h"
#include "store/master/master_params.h"
#include "store/master/master_service.h"
#include "store/tools/status_http.h"

namespace {

volatile std::sig_atomic_t g_stop = 0;
void onSignal(int) { g_stop = 1; }

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "mooncake_master: %s\nusage: mooncake_master [--host H (127.0.0.1)] [--port P] "
               "[--secret-file F] [--eviction-high-watermark F] [--eviction-ratio F] "
               "[--lease-ttl-ms N] [--client-ttl-s N] [--metrics-port P (0: off)] "
               "[--etcd-endpoints http(s)://H:P[,H:P] --cluster-id NAME [--leader-ttl-s N] "
               "[--name NAME] [--etcd-user U --etcd-password-file F] [--etcd-ca-file F] "
               "[--etcd-cert-file F --etcd-key-file F]] [--rebuild-quiet-ms N] "
               "[--rebuild-timeout-ms N]\n",
               why);
  std::exit(2);
}

uint64_t wallClockMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mooncake;
  store::MasterConfig cfg = store::masterConfigFromParams();
  cfg.record_headers = true;  // clients hold what a restarted or new master rebuilds from
  std::string host = "127.0.0.1";
  std::string secret_file;
  std::string etcd_endpoints, cluster_id, member_name;
  // etcd's authentication and TLS: the MC_ETCD_* parameters, each overridden by its flag.
  store::ha::EtcdSettings etcd_settings = store::ha::EtcdSettings::fromParams();
  bool etcd_flags = false;
  int port = 50051;
  int metrics_port = 9003;
  int64_t leader_ttl_s = 3;
  int64_t quiet_ms = -1, rebuild_timeout_ms = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string v;
    auto eq = a.find('=');
    if (eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (a == "--help" || a == "-h") {
      usage("help");
    } else {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      v = argv[++i];
    }
    char* end = nullptr;
    double d = std::strtod(v.c_str(), &end);
    bool num = end != v.c_str() && *end == '\0';
    if (a == "--host")
      host = v;
    else if (a == "--secret-file")
      secret_file = v;
    else if (a == "--etcd-endpoints")
      etcd_endpoints = v;
    else if (a == "--cluster-id")
      cluster_id = v;
    else if (a == "--etcd-user")
      etcd_settings.user = v, etcd_flags = true;
    else if (a == "--etcd-password-file")
      etcd_settings.password_file = v, etcd_flags = true;
    else if (a == "--etcd-ca-file")
      etcd_settings.ca_file = v, etcd_flags = true;
    else if (a == "--etcd-cert-file")
      etcd_settings.cert_file = v, etcd_flags = true;
    else if (a == "--etcd-key-file")
      etcd_settings.key_file = v, etcd_flags = true;
    else if (a == "--name")
      member_name = v;
    else if (!num)
      usage(("not a number: " + a + " " + v).c_str());
    else if (a == "--port")
      port = static_cast<int>(d);
    else if (a == "--metrics-port")
      metrics_port = static_cast<int>(d);
    else if (a == "--eviction-high-watermark")
      cfg.eviction_high_watermark = d;
    else if (a == "--eviction-ratio")
      cfg.eviction_ratio = d;
    else if (a == "--lease-ttl-ms")
      cfg.lease_ttl_ms = static_cast<uint64_t>(d);
    else if (a == "--client-ttl-s")
      cfg.client_ttl_ms = static_cast<uint64_t>(d * 1000);
    else if (a == "--leader-ttl-s")
      leader_ttl_s = static_cast<int64_t>(d);
    else if (a == "--rebuild-quiet-ms")
      quiet_ms = static_cast<int64_t>(d);
    else if (a == "--rebuild-timeout-ms")
      rebuild_timeout_ms = static_cast<int64_t>(d);
    else
      usage(("unknown flag " + a).c_str());
  }
  if (port < 0 || port > 65535 || metrics_port < 0 || metrics_port > 65535)
    usage("port out of range");
  if (!(cfg.eviction_high_watermark > 0 && cfg.eviction_high_watermark <= 1) ||
      !(cfg.eviction_ratio >= 0 && cfg.eviction_ratio <= 1))
    usage("watermark must be in (0, 1], ratio in [0, 1]");
  if (leader_ttl_s < 1) usage("--leader-ttl-s must be at least 1");
  const bool ha_mode = !etcd_endpoints.empty();
  if (!ha_mode && (!cluster_id.empty() || !member_name.empty() || etcd_flags))
    usage("--cluster-id, --name and --etcd-* need --etcd-endpoints");
  if (ha_mode && cluster_id.empty()) cluster_id = params::getString("MC_STORE_CLUSTER_ID");
  if (ha_mode && (cluster_id.empty() || cluster_id.find('/') != std::string::npos))
    usage("--cluster-id must be a non-empty name without '/'");
  store::RebuildPolicy policy;
  // Alone, nothing says which clients exist: wait until they stop arriving. In a cluster the
  // clients' etcd keys say whom to wait for, so a short quiet time is enough.
  policy.quiet_ms = quiet_ms >= 0 ? static_cast<uint64_t>(quiet_ms) : (ha_mode ? 300 : 1000);
  policy.timeout_ms = rebuild_timeout_ms >= 0 ? static_cast<uint64_t>(rebuild_timeout_ms)
                                              : static_cast<uint64_t>(leader_ttl_s * 2000 + 2000);

  std::signal(SIGINT, onSignal);
  std::signal(SIGTERM, onSignal);
  std::signal(SIGPIPE, SIG_IGN);

  std::string secret;
  {
    // --secret-file wins over MC_SECRET / MC_SECRET_FILE; the file is created when missing.
    Result<std::string> r = secret_file.empty()
                                 ? engine::resolveSecret("", engine::SecretFile::kDefaultCreate)
                                 : engine::loadSecretFile(secret_file, true);
    if (!r.ok()) {
      std::fprintf(stderr, "mooncake_master: job secret: %s\n", r.status().toString().c_str());
      return 1;
    }
    secret = std::move(r).value();
    Status ok = engine::checkSecret(secret, "mooncake_master");
    if (!ok.ok()) {
      std::fprintf(stderr, "mooncake_master: %s\n", ok.toString().c_str());
      return 1;
    }
  }

  // etcd first: a master pointed at an etcd it cannot reach says so and exits.
  std::unique_ptr<store::ha::EtcdClient> etcd, etcd_reader;
  if (ha_mode) {
    // Calls must end well within the TTL: the leader fences itself on time (leader_election.h).
    const int64_t call_ms = std::max<int64_t>(200, leader_ttl_s * 1000 / 6);
    auto security = store::ha::EtcdSecurity::load(etcd_settings);
    if (!security.ok()) {
      std::fprintf(stderr, "mooncake_master: %s\n", security.status().toString().c_str());
      return 2;
    }
    auto e = store::ha::EtcdClient::create(etcd_endpoints, call_ms, *security);
    auto r = store::ha::EtcdClient::create(etcd_endpoints, 1000, *security);
    if (!e.ok() || !r.ok()) {
      std::fprintf(stderr, "mooncake_master: --etcd-endpoints: %s\n",
                   (e.ok() ? r.status() : e.status()).toString().c_str());
      return 2;
    }
    etcd = std::move(e).value();
    etcd_reader = std::move(r).value();
    // Also authenticates: wrong credentials or a refused certificate end the master here.
    Status st = etcd_reader->ping();
    if (!st.ok()) {
      std::fprintf(stderr, "mooncake_master: %s etcd at %s: %s\n",
                   st.code() == mooncake::Code::kPermissionDenied ? "refused by" : "cannot reach",
                   etcd_endpoints.c_str(), st.toString().c_str());
      return 1;
    }
  }

  auto server = engine::TcpRendezvousServer::start(host, static_cast<uint16_t>(port), secret);
  if (!server.ok()) {
    std::fprintf(stderr, "mooncake_master: rendezvous on %s:%d: %s\n", host.c_str(), port,
                 server.status().toString().c_str());
    return 1;
  }
  uint16_t bound = (*server)->port();
  const std::string self = engine::sock::isWildcard(host) ? "127.0.0.1" : host;
  auto rdv = engine::TcpRendezvousClient::connect(self, bound, secret, engine::deadlineInMs(5000));
  if (!rdv.ok()) {
    std::fprintf(stderr, "mooncake_master: %s\n", rdv.status().toString().c_str());
    return 1;
  }
  if (member_name.empty()) member_name = self + ":" + std::to_string(bound);

  store::MasterService service(cfg);
  // The engine and the RPC server are replaced when this master loses the leadership: clients
  // must see the old master's engine go (they check it before acknowledging a put).
  std::unique_ptr<engine::TransferEngine> eng;
  std::unique_ptr<store::MasterRpcServer> rpc;
  int generation = 0;
  auto makeEngine = [&]() -> bool {
    rpc.reset();
    eng.reset();
    engine::EngineOptions eo;
    eo.name = ha_mode ? std::string(store::kMasterName) + "-" + member_name + "-" +
                            std::to_string(generation++)
                      : store::kMasterName;
    eo.secret = secret;
    eo.host = host;  // the engine listens where the rendezvous does
    auto made = engine::TransferEngine::create(eo);
    if (!made.ok()) {
      std::fprintf(stderr, "mooncake_master: engine: %s\n", made.status().toString().c_str());
      return false;
    }
    eng = std::move(made).value();
    rpc = std::make_unique<store::MasterRpcServer>(eng.get(), &service);
    Status st = rpc->publish(**rdv);
    if (!st.ok()) {
      std::fprintf(stderr, "mooncake_master: publish: %s\n", st.toString().c_str());
      return false;
    }
    return true;
  };
  if (!makeEngine()) return 1;

  std::atomic<bool> lost{false};
  std::unique_ptr<store::ha::LeaderElection> election;
  if (ha_mode) {
    service.becomeStandby();
    store::ha::ElectionOptions eo;
    eo.cluster_id = cluster_id;
    eo.name = member_name;
    eo.address = self + ":" + std::to_string(bound);
    eo.ttl_s = leader_ttl_s;
    election = std::make_unique<store::ha::LeaderElection>(
        std::move(etcd), eo,
        [&](int64_t epoch, bool took_over) {
          service.beginRebuild(static_cast<uint64_t>(epoch), policy);
          service.noteElection(took_over);
        },
        [&] {
          service.becomeStandby();  // stop serving now; the engine goes on the main thread
          lost = true;
        });
    Status st = election->start();
    if (!st.ok()) {
      std::fprintf(stderr, "mooncake_master: etcd at %s: %s\n", etcd_endpoints.c_str(),
                   st.toString().c_str());
      return 1;
    }
  } else {
    // A restarted master: its clients still hold the objects; it serves once they reported.
    service.beginRebuild(wallClockMs(), policy);
    service.noteElection(false);
  }
  auto period = std::chrono::milliseconds(
      std::max<uint64_t>(20, std::min<uint64_t>(1000, cfg.client_ttl_ms / 4)));
  service.startBackground(period);

  std::unique_ptr<store::StatusHttpServer> http;
  int bound_metrics = 0;
  if (metrics_port > 0) {
    std::map<std::string, store::StatusHttpServer::Route> routes;
    routes["/metrics"] = [&] {
      return store::StatusReply{200, "text/plain; version=0.0.4", service.metrics().toPrometheus()};
    };
    routes["/health"] = [] { return store::StatusReply{200, "text/plain", "OK\n"}; };
    // Upstream's admin route, which SGLang polls (MOONCAKE_CHECK_SERVER) until a segment is
    // mounted: the mounted segments' names, one a line (empty while none is). 503 with an empty
    // body while this master stands by (SGLang reads only the body: empty = not ready yet).
    // Names only: no keys, no object data (docs/security.md).
    routes["/get_all_segments"] = [&] {
      if (service.role() == store::MasterRole::kStandby)
        return store::StatusReply{503, "text/plain", ""};
      std::string body;
      for (const auto& s : service.segments()) body += s.name + "\n";
      return store::StatusReply{200, "text/plain", body};
    };
    auto h = store::StatusHttpServer::start(host, static_cast<uint16_t>(metrics_port),
                                            std::move(routes));
    if (!h.ok()) {
      std::fprintf(stderr, "mooncake_master: metrics port %d: %s\n", metrics_port,
                   h.status().toString().c_str());
      return 1;
    }
    http = std::move(h).value();
    bound_metrics = http->port();
  }
  std::printf("mooncake_master ready port=%u metrics_port=%d\n", bound, bound_metrics);
  std::fflush(stdout);

  store::MasterRole last_role = service.role();
  auto next_members = std::chrono::steady_clock::now();
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (lost.exchange(false)) {
      MC_LOG(WARN, STORE) << "mooncake_master " << member_name
                          << ": lost the leadership; replacing the engine, standing by";
      if (!makeEngine()) return 1;
    }
    const store::MasterRole role = service.role();
    if (role == store::MasterRole::kRebuilding) {
      auto now = std::chrono::steady_clock::now();
      if (ha_mode && now >= next_members) {
        // Whom to wait for: the clients with a live membership key.
        auto members = etcd_reader->getPrefix(store::ha::clientMemberPrefix(cluster_id));
        if (members.ok()) {
          std::vector<std::string> names;
          const size_t skip = store::ha::clientMemberPrefix(cluster_id).size();
          for (const auto& kv : *members) names.push_back(kv.key.substr(skip));
          service.setExpectedClients(std::move(names));
        }
        next_members = now + std::chrono::milliseconds(200);
      }
      service.pollRebuild();
    }
    const store::MasterRole now_role = service.role();
    if (now_role != last_role) {
      auto m = service.metrics();
      if (now_role == store::MasterRole::kServing)
        std::fprintf(stderr,
                     "mooncake_master %s: serving (epoch %llu; rebuilt %llu objects from %llu "
                     "clients in %.3f s)\n",
                     member_name.c_str(), static_cast<unsigned long long>(m.epoch),
                     static_cast<unsigned long long>(m.objects),
                     static_cast<unsigned long long>(m.rebuild_clients), m.last_rebuild_seconds);
      else if (now_role == store::MasterRole::kRebuilding)
        std::fprintf(stderr, "mooncake_master %s: leading (epoch %llu), rebuilding\n",
                     member_name.c_str(), static_cast<unsigned long long>(m.epoch));
      else
        std::fprintf(stderr, "mooncake_master %s: standing by\n", member_name.c_str());
      last_role = now_role;
    }
  }
  http.reset();
  if (election) election->stop();  // resigns: a standby takes over at once
  service.stopBackground();
  rpc.reset();
  return 0;
}
