// The master's status port (--metrics-port): /metrics, /health, /get_all_segments.
//
// A small HTTP/1.1 server of its own instead of a general one (cpp-httplib's kept every request
// body in memory, with no limit, and gave a client that trickled its headers a worker thread for
// as long as it kept trickling: docs/security.md). Here:
//  - GET and HEAD only, without a body (a request announcing one is answered 413, other methods
//    405); the request line and headers may take 8 KiB (else 431);
//  - one request per connection, answered with "Connection: close";
//  - a connection gets 2 s in all to send its request and take the answer, then it is closed;
//  - connections are admitted as the engine's listeners admit unauthenticated ones
//    (engine/transport/tcp/tcp_admission.h: MC_MAX_PREAUTH_PER_SOURCE, MC_MAX_PREAUTH), so
//    strangers cannot take the process's descriptors;
//  - one thread polls every connection: a slow client holds nothing but its socket.
// The routes run on that thread and must be quick.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "engine/status.h"

namespace mooncake::store {

struct StatusReply {
  int status = 200;
  std::string content_type = "text/plain";
  std::string body;
};

class StatusHttpServer {
 public:
  using Route = std::function<StatusReply()>;
  // routes: path (without a query) -> handler. port 0 picks a free port.
  static Result<std::unique_ptr<StatusHttpServer>> start(const std::string& host, uint16_t port,
                                                         std::map<std::string, Route> routes);
  ~StatusHttpServer();
  uint16_t port() const;
  struct Impl;

 private:
  explicit StatusHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mooncake::store
