// A small client of etcd's v3 API through etcd's JSON gateway (HTTP POST /v3/kv/range,
// /v3/kv/txn, /v3/lease/grant, ... on the client URL), over cpp-httplib.
//
// Why the gateway and not gRPC (docs/store.md): the store talks to etcd only for leadership and
// membership (a lease keep-alive every TTL/3, a read when a client looks for the leader), never
// per put, so a millisecond per call costs nothing; the gateway needs no generated etcd stubs, no
// second RPC stack beside the engine and no new library (cpp-httplib already serves /metrics).
//
// Keys and values are byte strings (base64 on the wire). Every call has the client's timeout;
// with several endpoints a call that cannot reach one tries the next, starting from the last one
// that answered. Thread-safe (calls are serialised).
//
// Security (etcd_security.h): with a user, the first call gets a token from
// /v3/auth/authenticate and every call carries it in the Authorization header (as etcd's
// gateway takes it). etcd's tokens expire (simple tokens unused for --auth-token-ttl, JWTs at
// their expiry; simple tokens live in etcd's memory, rebuilt from its log on a restart, so a
// restart may or may not keep them): a call answered "invalid auth token" (gRPC code 16)
// authenticates again once and is sent again (etcd checks the token before it applies
// anything). Wrong credentials, a missing user on an etcd with auth enabled, or a user without
// permission on the keys fail at once with kPermissionDenied naming the endpoint
// ("authentication failed", ...), without trying the other endpoints. https:// endpoints
// verify etcd's certificate (always: there is no switch to skip it) against the CA file or the
// system's CAs, and present the client certificate when one is configured; a build whose
// cpp-httplib lacks OpenSSL support refuses them with kNotSupported. The gateway ends error
// answers with HTTP trailers, which cpp-httplib 0.11 cannot parse: the status and body are
// taken as they arrive (send()).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/status.h"
#include "store/ha/etcd_security.h"

namespace mooncake::store::ha {

struct EtcdKv {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

class EtcdClient {
 public:
  // endpoints: "host:port", "http://host:port" or "https://host:port", several separated by
  // ',' or ';'; "host:port" is https when `security` has a CA file or client certificate, else
  // http. kInvalidArgument for an empty or malformed list, kNotSupported for https without
  // OpenSSL support in this build; nothing is contacted yet.
  static Result<std::unique_ptr<EtcdClient>> create(const std::string& endpoints,
                                                    int64_t timeout_ms,
                                                    const EtcdSecurity& security);
  // The same with the MC_ETCD_* parameters (EtcdSecurity::fromParams(): its errors too).
  static Result<std::unique_ptr<EtcdClient>> create(const std::string& endpoints,
                                                    int64_t timeout_ms);
  ~EtcdClient();

  // Reaches etcd (a range read of one key); kUnavailable naming every endpoint tried when
  // none answers.
  Status ping();
  Result<int64_t> grantLease(int64_t ttl_s);
  // Renews the lease once; returns its remaining TTL in seconds, 0 when it no longer exists.
  Result<int64_t> keepAlive(int64_t lease);
  Status revokeLease(int64_t lease);

  Result<std::optional<EtcdKv>> get(const std::string& key);
  Result<std::vector<EtcdKv>> getPrefix(const std::string& prefix);
  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status del(const std::string& key);
  // Creates key = value (attached to `lease`, 0: none) unless the key exists. Returns whether
  // it created it, and the key as it now is (the existing one when it did not).
  Result<std::pair<bool, EtcdKv>> createIfAbsent(const std::string& key, const std::string& value,
                                                 int64_t lease);
  // Deletes the key only if its create_revision is `create_revision` (a leader resigning must
  // not delete its successor's key).
  Status deleteIfCreated(const std::string& key, int64_t create_revision);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // Tokens this client got from etcd (the first one, then one per renewal).
  uint64_t authentications() const { return authentications_.load(); }

 private:
  EtcdClient() = default;
  // POSTs `body` (JSON) to `path` on the first endpoint that answers, with the token (getting
  // one first, and once more when etcd says it is no longer valid); returns the response body.
  Result<std::string> post(const std::string& path, const std::string& body);
  // One try over the endpoints. *stale_token: etcd refused the token (or wants one and this
  // client has a user): authenticate and send again.
  Result<std::string> send(const std::string& path, const std::string& body, bool* stale_token);
  Status authenticate();  // mu_ held

  std::vector<std::string> endpoints_;  // "http://host:port" or "https://host:port"
  int64_t timeout_ms_ = 2000;
  EtcdSecurity security_;
  std::mutex mu_;
  size_t current_ = 0;
  std::string token_;          // etcd's auth token; empty: none yet (or no user)
  bool auth_disabled_ = false;  // etcd answered that its authentication is not enabled
  std::atomic<uint64_t> authentications_{0};
};

// "mooncake-store/<cluster>/": every key of one cluster lives under it, so clusters with other
// ids on the same etcd never see each other.
std::string clusterPrefix(const std::string& cluster_id);
std::string leaderKey(const std::string& cluster_id);
std::string masterMemberKey(const std::string& cluster_id, const std::string& name);
std::string clientMemberPrefix(const std::string& cluster_id);
std::string clientMemberKey(const std::string& cluster_id, const std::string& client_id);

// Base64 (RFC 4648, with padding), as etcd's gateway encodes bytes.
std::string base64Encode(const std::string& in);
std::optional<std::string> base64Decode(const std::string& in);

}  // namespace mooncake::store::ha
