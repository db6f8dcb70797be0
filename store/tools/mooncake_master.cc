// mooncake_master: the standalone store master.
//
//   mooncake_master [--host 127.0.0.1] [--port 50051] [--secret-file F]
//                   [--eviction-high-watermark 0.95] [--eviction-ratio 0.05]
//                   [--lease-ttl-ms 5000] [--client-ttl-s 10] [--metrics-port 9003]
//
// One process runs: a TcpRendezvousServer on --port (the `master_server_address` host:port that
// clients are given; clients publish their own engine segments there too, so they find each
// other by name), an engine named "mooncake-master" whose two-sided messages carry the store
// RPCs to the MasterService, and, unless --metrics-port is 0, an HTTP server with /metrics
// (Prometheus text) and /health. --host applies to every port it opens; without it the master
// listens on 127.0.0.1 only (as Redis and etcd do by default): pass the address clients on
// other hosts reach it at, or 0.0.0.0 for every interface.
//
// The job secret (docs/security.md): MC_SECRET when set, else the file --secret-file /
// MC_SECRET_FILE / ~/.mooncake/secret, created (mode 0600) when missing, so that clients of the
// same user on this host find it with no configuration. MC_ALLOW_NO_SECRET=1 runs without one.
// Defaults not given on the command line come from the MC_STORE_* parameters. Prints
// "mooncake_master ready port=<p> metrics_port=<m>" once it serves.
#include <httplib.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "store/client/rpc.h"
#include "store/master/master_params.h"
#include "store/master/master_service.h"

namespace {

volatile std::sig_atomic_t g_stop = 0;
void onSignal(int) { g_stop = 1; }

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "mooncake_master: %s\nusage: mooncake_master [--host H (127.0.0.1)] [--port P] "
               "[--secret-file F] [--eviction-high-watermark F] [--eviction-ratio F] "
               "[--lease-ttl-ms N] [--client-ttl-s N] [--metrics-port P (0: off)]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mooncake;
  store::MasterConfig cfg = store::masterConfigFromParams();
  std::string host = "127.0.0.1";
  std::string secret_file;
  int port = 50051;
  int metrics_port = 9003;
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
    else
      usage(("unknown flag " + a).c_str());
  }
  if (port < 0 || port > 65535 || metrics_port < 0 || metrics_port > 65535)
    usage("port out of range");
  if (!(cfg.eviction_high_watermark > 0 && cfg.eviction_high_watermark <= 1) ||
      !(cfg.eviction_ratio >= 0 && cfg.eviction_ratio <= 1))
    usage("watermark must be in (0, 1], ratio in [0, 1]");

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
  engine::EngineOptions eo;
  eo.name = store::kMasterName;
  eo.secret = secret;
  eo.host = host;  // the engine listens where the rendezvous does
  auto eng = engine::TransferEngine::create(eo);
  if (!eng.ok()) {
    std::fprintf(stderr, "mooncake_master: engine: %s\n", eng.status().toString().c_str());
    return 1;
  }
  store::MasterService service(cfg);
  store::MasterRpcServer rpc(eng->get(), &service);
  if (Status st = rpc.publish(**rdv); !st.ok()) {
    std::fprintf(stderr, "mooncake_master: publish: %s\n", st.toString().c_str());
    return 1;
  }
  auto period = std::chrono::milliseconds(
      std::max<uint64_t>(20, std::min<uint64_t>(1000, cfg.client_ttl_ms / 4)));
  service.startBackground(period);

  std::unique_ptr<httplib::Server> http;
  std::thread http_thread;
  int bound_metrics = 0;
  if (metrics_port > 0) {
    http = std::make_unique<httplib::Server>();
    // Idle keep-alive connections each hold a worker thread until they time out: short
    // timeouts and more workers than cpp-httplib's default (max(8, cores - 1)) keep /health
    // answering within milliseconds while scrapers and idle clients sit on the port.
    http->new_task_queue = [] { return new httplib::ThreadPool(64); };
    http->set_keep_alive_timeout(1);
    http->set_keep_alive_max_count(100);
    http->set_read_timeout(1, 0);
    http->set_write_timeout(1, 0);
    http->Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      res.set_content(service.metrics().toPrometheus(), "text/plain; version=0.0.4");
    });
    http->Get("/health", [&](const httplib::Request&, httplib::Response& res) {
      res.set_content("OK\n", "text/plain");
    });
    if (!http->bind_to_port(host.c_str(), metrics_port)) {
      std::fprintf(stderr, "mooncake_master: cannot bind metrics port %d\n", metrics_port);
      return 1;
    }
    bound_metrics = metrics_port;
    http_thread = std::thread([&] { http->listen_after_bind(); });
  }
  std::printf("mooncake_master ready port=%u metrics_port=%d\n", bound, bound_metrics);
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (http) {
    http->stop();
    http_thread.join();
  }
  service.stopBackground();
  return 0;
}
