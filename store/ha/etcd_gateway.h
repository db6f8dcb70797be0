// One POST to etcd's JSON gateway (etcd_client.h), for EtcdClient::send and for tests that talk
// to etcd directly. Only in builds with the etcd client (MC_STORE_HAVE_ETCD: cpp-httplib).
//
// The gateway ends its error answers with HTTP trailers (Grpc-Trailer-*), which cpp-httplib
// 0.11 cannot parse (it reports a read error after the body): the status and the body are
// taken as they arrive, and such a read error after them is not a failure. SIGPIPE is blocked
// in the calling thread while it runs (cpp-httplib writes sockets without MSG_NOSIGNAL, and
// OpenSSL with write()), and one it raised is taken away.
#pragma once

#include <httplib.h>

#include <string>

namespace mooncake::store::ha {

struct GatewayReply {
  bool answered = false;  // a status and a body came (whatever the status)
  int status = 0;         // the HTTP status (0: none)
  std::string body;
  httplib::Error error = httplib::Error::Success;  // why not, when not answered
};

// POSTs `body` (JSON) to `path` through `cli` (its timeouts and TLS set up by the caller), with
// `headers` and Content-Type application/json.
GatewayReply gatewayPost(httplib::Client& cli, const std::string& path, const std::string& body,
                         const httplib::Headers& headers = {});

}  // namespace mooncake::store::ha
