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
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/status.h"

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
  // endpoints: "host:port" or "http://host:port", several separated by ',' or ';'.
  // kInvalidArgument for an empty or malformed list; nothing is contacted yet.
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

 private:
  EtcdClient() = default;
  // POSTs `body` (JSON) to `path` on the first endpoint that answers; returns the response body.
  Result<std::string> post(const std::string& path, const std::string& body);

  std::vector<std::string> endpoints_;  // "http://host:port"
  int64_t timeout_ms_ = 2000;
  std::mutex mu_;
  size_t current_ = 0;
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
