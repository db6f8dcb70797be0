#include "store/ha/etcd_client.h"

#include <sstream>

// MC_STORE_HAVE_ETCD (store/CMakeLists.txt): built with cpp-httplib and nlohmann-json. Without
// them EtcdClient::create() fails with kNotSupported, naming what the build lacked.
#if MC_STORE_HAVE_ETCD
#include <httplib.h>

#include <nlohmann/json.hpp>
#endif

namespace mooncake::store::ha {

#if MC_STORE_HAVE_ETCD
using json = nlohmann::json;
#endif

namespace {

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

#if MC_STORE_HAVE_ETCD
int64_t asInt(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  // The gateway writes int64 as strings ("revision": "12"); accept numbers too.
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (...) {
      return 0;
    }
  }
  if (it->is_number_integer()) return it->get<int64_t>();
  return 0;
}

std::optional<EtcdKv> kvOf(const json& j) {
  EtcdKv kv;
  auto key = base64Decode(j.value("key", ""));
  auto value = base64Decode(j.value("value", ""));
  if (!key || !value) return std::nullopt;
  kv.key = std::move(*key);
  kv.value = std::move(*value);
  kv.create_revision = asInt(j, "create_revision");
  kv.mod_revision = asInt(j, "mod_revision");
  kv.lease = asInt(j, "lease");
  return kv;
}

// The smallest key greater than every key that starts with `prefix` (etcd's range_end).
std::string prefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char c = static_cast<unsigned char>(prefix.back());
    if (c < 0xff) {
      prefix.back() = static_cast<char>(c + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Result<json> parse(const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return MC_STATUS(kProtocol, "etcd: not a JSON object: " << body.substr(0, 200));
  return j;
}
#endif  // MC_STORE_HAVE_ETCD

}  // namespace

std::string base64Encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  while (i + 2 < in.size()) {
    uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8) |
                 static_cast<uint8_t>(in[i + 2]);
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += kB64[v & 63];
    i += 3;
  }
  if (i + 1 == in.size()) {
    uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8);
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> base64Decode(const std::string& in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = val(c);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

std::string clusterPrefix(const std::string& cluster_id) {
  return "mooncake-store/" + cluster_id + "/";
}
std::string leaderKey(const std::string& cluster_id) {
  return clusterPrefix(cluster_id) + "leader";
}
std::string masterMemberKey(const std::string& cluster_id, const std::string& name) {
  return clusterPrefix(cluster_id) + "masters/" + name;
}
std::string clientMemberPrefix(const std::string& cluster_id) {
  return clusterPrefix(cluster_id) + "clients/";
}
std::string clientMemberKey(const std::string& cluster_id, const std::string& client_id) {
  return clientMemberPrefix(cluster_id) + client_id;
}

#if MC_STORE_HAVE_ETCD
Result<std::unique_ptr<EtcdClient>> EtcdClient::create(const std::string& endpoints,
                                                       int64_t timeout_ms) {
  std::unique_ptr<EtcdClient> c(new EtcdClient());
  c->timeout_ms_ = timeout_ms > 0 ? timeout_ms : 2000;
  std::string cur;
  auto flush = [&]() -> Status {
    size_t b = cur.find_first_not_of(" \t");
    size_t e = cur.find_last_not_of(" \t");
    std::string ep = b == std::string::npos ? "" : cur.substr(b, e - b + 1);
    cur.clear();
    if (ep.empty()) return Status::OK();
    if (ep.rfind("https://", 0) == 0)
      return MC_STATUS(kNotSupported, "etcd endpoint " << ep << ": https is not supported");
    if (ep.rfind("http://", 0) == 0) ep = ep.substr(7);
    while (!ep.empty() && ep.back() == '/') ep.pop_back();
    size_t colon = ep.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == ep.size())
      return MC_STATUS(kInvalidArgument, "etcd endpoint '" << ep << "' is not host:port");
    for (size_t i = colon + 1; i < ep.size(); ++i)
      if (ep[i] < '0' || ep[i] > '9')
        return MC_STATUS(kInvalidArgument, "etcd endpoint '" << ep << "' is not host:port");
    c->endpoints_.push_back("http://" + ep);
    return Status::OK();
  };
  for (char ch : endpoints) {
    if (ch == ',' || ch == ';') {
      MC_RETURN_IF_ERROR(flush());
    } else {
      cur += ch;
    }
  }
  MC_RETURN_IF_ERROR(flush());
  if (c->endpoints_.empty())
    return MC_STATUS(kInvalidArgument, "no etcd endpoint in '" << endpoints << "'");
  return c;
}

EtcdClient::~EtcdClient() = default;

Result<std::string> EtcdClient::post(const std::string& path, const std::string& body) {
  std::lock_guard<std::mutex> g(mu_);
  std::ostringstream errors;
  for (size_t n = 0; n < endpoints_.size(); ++n) {
    size_t i = (current_ + n) % endpoints_.size();
    httplib::Client cli(endpoints_[i]);
    const time_t sec = timeout_ms_ / 1000;
    const time_t usec = (timeout_ms_ % 1000) * 1000;
    cli.set_connection_timeout(sec, usec);
    cli.set_read_timeout(sec, usec);
    cli.set_write_timeout(sec, usec);
    auto res = cli.Post(path.c_str(), body, "application/json");
    if (!res) {
      const httplib::Error e = res.error();
      const char* what = e == httplib::Error::Connection          ? "cannot connect"
                         : e == httplib::Error::ConnectionTimeout ? "connect timed out"
                         : e == httplib::Error::Read              ? "no answer (read failed)"
                         : e == httplib::Error::Write             ? "send failed"
                                                                  : nullptr;
      errors << (n ? "; " : "") << endpoints_[i] << ": "
             << (what ? std::string(what) : httplib::to_string(e));
      continue;
    }
    current_ = i;
    if (res->status != 200) {
      std::string msg = res->body;
      auto j = json::parse(res->body, nullptr, false);
      if (!j.is_discarded() && j.is_object()) {
        if (j.contains("message") && j["message"].is_string())
          msg = j["message"];
        else if (j.contains("error") && j["error"].is_string())
          msg = j["error"];
      }
      return MC_STATUS(kUnavailable, "etcd " << endpoints_[i] << path << ": HTTP " << res->status
                                             << ": " << msg.substr(0, 300));
    }
    return std::move(res->body);
  }
  return MC_STATUS(kUnavailable, "etcd unreachable (" << errors.str() << ")");
}

Status EtcdClient::ping() {
  auto r = get("mooncake-store/.ping");
  return r.ok() ? Status::OK() : r.status();
}

Result<int64_t> EtcdClient::grantLease(int64_t ttl_s) {
  json req = {{"TTL", ttl_s}};
  MC_ASSIGN_OR_RETURN(std::string body, post("/v3/lease/grant", req.dump()));
  MC_ASSIGN_OR_RETURN(json j, parse(body));
  int64_t id = asInt(j, "ID");
  if (id == 0) return MC_STATUS(kUnavailable, "etcd: lease grant refused: " << body.substr(0, 200));
  return id;
}

Result<int64_t> EtcdClient::keepAlive(int64_t lease) {
  json req = {{"ID", std::to_string(lease)}};
  MC_ASSIGN_OR_RETURN(std::string body, post("/v3/lease/keepalive", req.dump()));
  // The gateway streams keep-alive answers: one JSON object per line, {"result": {...}}.
  std::string first = body.substr(0, body.find('\n'));
  MC_ASSIGN_OR_RETURN(json j, parse(first));
  if (!j.contains("result") || !j["result"].is_object())
    return MC_STATUS(kProtocol, "etcd: unexpected keep-alive answer: " << first.substr(0, 200));
  return asInt(j["result"], "TTL");  // absent (0): the lease is gone
}

Status EtcdClient::revokeLease(int64_t lease) {
  json req = {{"ID", std::to_string(lease)}};
  auto r = post("/v3/lease/revoke", req.dump());
  return r.ok() ? Status::OK() : r.status();
}

Result<std::optional<EtcdKv>> EtcdClient::get(const std::string& key) {
  json req = {{"key", base64Encode(key)}};
  MC_ASSIGN_OR_RETURN(std::string body, post("/v3/kv/range", req.dump()));
  MC_ASSIGN_OR_RETURN(json j, parse(body));
  std::optional<EtcdKv> out;
  if (j.contains("kvs") && j["kvs"].is_array() && !j["kvs"].empty()) {
    out = kvOf(j["kvs"][0]);
    if (!out) return MC_STATUS(kProtocol, "etcd: undecodable key/value");
  }
  return out;
}

Result<std::vector<EtcdKv>> EtcdClient::getPrefix(const std::string& prefix) {
  json req = {{"key", base64Encode(prefix)}, {"range_end", base64Encode(prefixEnd(prefix))}};
  MC_ASSIGN_OR_RETURN(std::string body, post("/v3/kv/range", req.dump()));
  MC_ASSIGN_OR_RETURN(json j, parse(body));
  std::vector<EtcdKv> out;
  if (j.contains("kvs") && j["kvs"].is_array()) {
    for (const auto& e : j["kvs"]) {
      auto kv = kvOf(e);
      if (!kv) return MC_STATUS(kProtocol, "etcd: undecodable key/value");
      out.push_back(std::move(*kv));
    }
  }
  return out;
}

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json req = {{"key", base64Encode(key)}, {"value", base64Encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  auto r = post("/v3/kv/put", req.dump());
  return r.ok() ? Status::OK() : r.status();
}

Status EtcdClient::del(const std::string& key) {
  json req = {{"key", base64Encode(key)}};
  auto r = post("/v3/kv/deleterange", req.dump());
  return r.ok() ? Status::OK() : r.status();
}

Result<std::pair<bool, EtcdKv>> EtcdClient::createIfAbsent(const std::string& key,
                                                           const std::string& value,
                                                           int64_t lease) {
  const std::string k = base64Encode(key);
  json put = {{"key", k}, {"value", base64Encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  json req = {
      {"compare", json::array({{{"target", "CREATE"}, {"key", k}, {"createRevision", "0"}}})},
      {"success", json::array({{{"requestPut", put}}, {{"requestRange", {{"key", k}}}}})},
      {"failure", json::array({{{"requestRange", {{"key", k}}}}})}};
  MC_ASSIGN_OR_RETURN(std::string body, post("/v3/kv/txn", req.dump()));
  MC_ASSIGN_OR_RETURN(json j, parse(body));
  bool created = j.value("succeeded", false);
  // The range answer is the last response of either branch.
  if (!j.contains("responses") || !j["responses"].is_array() || j["responses"].empty())
    return MC_STATUS(kProtocol, "etcd: txn without responses: " << body.substr(0, 200));
  const json& last = j["responses"].back();
  if (!last.contains("response_range"))
    return MC_STATUS(kProtocol, "etcd: txn without a range answer: " << body.substr(0, 200));
  const json& rr = last["response_range"];
  if (!rr.contains("kvs") || !rr["kvs"].is_array() || rr["kvs"].empty()) {
    // Deleted between the compare and the read is impossible inside one txn; a lease that
    // expired at once is not: report it as not created.
    return std::make_pair(false, EtcdKv{});
  }
  auto kv = kvOf(rr["kvs"][0]);
  if (!kv) return MC_STATUS(kProtocol, "etcd: undecodable key/value");
  return std::make_pair(created, std::move(*kv));
}

Status EtcdClient::deleteIfCreated(const std::string& key, int64_t create_revision) {
  const std::string k = base64Encode(key);
  json req = {{"compare", json::array({{{"target", "CREATE"},
                                        {"key", k},
                                        {"createRevision", std::to_string(create_revision)}}})},
              {"success", json::array({{{"requestDeleteRange", {{"key", k}}}}})}};
  auto r = post("/v3/kv/txn", req.dump());
  return r.ok() ? Status::OK() : r.status();
}

#else  // !MC_STORE_HAVE_ETCD

namespace {
Status noEtcd() {
  return MC_STATUS(kNotSupported,
                   "etcd: this build has no etcd client (it needs cpp-httplib and "
                   "nlohmann-json3-dev when configured)");
}
}  // namespace

Result<std::unique_ptr<EtcdClient>> EtcdClient::create(const std::string&, int64_t) {
  return noEtcd();
}
EtcdClient::~EtcdClient() = default;
// Unreachable (create() fails), defined for the linker.
Result<std::string> EtcdClient::post(const std::string&, const std::string&) { return noEtcd(); }
Status EtcdClient::ping() { return noEtcd(); }
Result<int64_t> EtcdClient::grantLease(int64_t) { return noEtcd(); }
Result<int64_t> EtcdClient::keepAlive(int64_t) { return noEtcd(); }
Status EtcdClient::revokeLease(int64_t) { return noEtcd(); }
Result<std::optional<EtcdKv>> EtcdClient::get(const std::string&) { return noEtcd(); }
Result<std::vector<EtcdKv>> EtcdClient::getPrefix(const std::string&) { return noEtcd(); }
Status EtcdClient::put(const std::string&, const std::string&, int64_t) { return noEtcd(); }
Status EtcdClient::del(const std::string&) { return noEtcd(); }
Result<std::pair<bool, EtcdKv>> EtcdClient::createIfAbsent(const std::string&, const std::string&,
                                                           int64_t) {
  return noEtcd();
}
Status EtcdClient::deleteIfCreated(const std::string&, int64_t) { return noEtcd(); }

#endif  // MC_STORE_HAVE_ETCD

}  // namespace mooncake::store::ha
