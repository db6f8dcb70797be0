#include "store/ha/etcd_client.h"

#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <ctime>
#include <sstream>

#include "engine/log.h"

// MC_STORE_HAVE_ETCD (store/CMakeLists.txt): built with cpp-httplib and nlohmann-json. Without
// them EtcdClient::create() fails with kNotSupported, naming what the build lacked.
#if MC_STORE_HAVE_ETCD
#include <httplib.h>

#include <nlohmann/json.hpp>

#include "store/ha/etcd_gateway.h"
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
namespace {

// CPPHTTPLIB_OPENSSL_SUPPORT comes with cpp-httplib's own flags (mooncake::httplib,
// cmake/dependencies.cmake): it says whether httplib::Client can speak https at all.
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
constexpr bool kHttpsBuilt = true;
#else
constexpr bool kHttpsBuilt = false;
#endif

// An error answer of the gateway: {"error": "...", "code": N, "message": "..."} for unary calls,
// {"error": {"grpc_code": N, "message": "..."}} inside a stream.
struct GatewayError {
  int code = -1;  // gRPC code (16: UNAUTHENTICATED, 7: PERMISSION_DENIED, 3: INVALID_ARGUMENT)
  std::string message;
};
GatewayError gatewayError(const std::string& body) {
  GatewayError e;
  auto j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    e.message = body.substr(0, 300);
    return e;
  }
  const json* from = &j;
  if (j.contains("error") && j["error"].is_object()) from = &j["error"];
  for (const char* f : {"code", "grpc_code"})
    if (from->contains(f) && (*from)[f].is_number_integer()) e.code = (*from)[f].get<int>();
  if (from->contains("message") && (*from)["message"].is_string())
    e.message = (*from)["message"].get<std::string>();
  else if (from->contains("error") && (*from)["error"].is_string())
    e.message = (*from)["error"].get<std::string>();
  else
    e.message = body.substr(0, 300);
  return e;
}

bool has(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

// OpenSSL writes to the socket with write(): an etcd that closes a TLS connection (a refused
// client certificate) would raise SIGPIPE, which ends a process that did not ignore it. While
// a call runs, SIGPIPE is blocked in the calling thread, and one it raised is taken away.
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    pending_before_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~SigpipeBlock() {
    if (!pending_before_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &zero) == -1 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t pipe_, old_;
  bool pending_before_ = false;
};

// "host" of "https://host:port" ("[v6]:port": without the brackets).
std::string hostOf(const std::string& ep) {
  std::string h = ep.substr(ep.find("://") + 3);
  h = h.substr(0, h.rfind(':'));
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  return h;
}

#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
// The certificate must name `host`: an IP address in an IP SAN, a name in a DNS SAN (never the
// subject's CN), checked by OpenSSL during the handshake (X509_V_ERR_*_MISMATCH).
void checkHostInCertificate(SSL_CTX* ctx, const std::string& host) {
  X509_VERIFY_PARAM* p = SSL_CTX_get0_param(ctx);
  in6_addr a6{};
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1) {
    X509_VERIFY_PARAM_set1_ip_asc(p, host.c_str());
  } else {
    X509_VERIFY_PARAM_set_hostflags(p, X509_CHECK_FLAG_NEVER_CHECK_SUBJECT);
    X509_VERIFY_PARAM_set1_host(p, host.c_str(), 0);
  }
}
#endif

constexpr const char* kUserHint =
    "set MC_ETCD_USER and MC_ETCD_PASSWORD_FILE (mooncake_master: --etcd-user, "
    "--etcd-password-file)";

}  // namespace

GatewayReply gatewayPost(httplib::Client& cli, const std::string& path, const std::string& body,
                         const httplib::Headers& headers) {
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = headers;
  req.set_header("Content-Type", "application/json");
  req.body = body;
  GatewayReply reply;
  req.response_handler = [&reply](const httplib::Response& r) {
    reply.status = r.status;
    return true;
  };
  req.content_receiver = [&reply](const char* data, size_t n, uint64_t, uint64_t) {
    reply.body.append(data, n);
    return true;
  };
  httplib::Response res;
  bool done;
  {
    SigpipeBlock no_sigpipe;
    done = cli.send(req, res, reply.error);
  }
  reply.answered = done || (reply.status > 0 && reply.error == httplib::Error::Read &&
                            !reply.body.empty());
  return reply;
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::create(const std::string& endpoints,
                                                       int64_t timeout_ms) {
  MC_ASSIGN_OR_RETURN(EtcdSecurity security, EtcdSecurity::fromParams());
  return create(endpoints, timeout_ms, security);
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::create(const std::string& endpoints,
                                                       int64_t timeout_ms,
                                                       const EtcdSecurity& security) {
  std::unique_ptr<EtcdClient> c(new EtcdClient());
  c->timeout_ms_ = timeout_ms > 0 ? timeout_ms : 2000;
  c->security_ = security;
  std::string cur;
  auto flush = [&]() -> Status {
    size_t b = cur.find_first_not_of(" \t");
    size_t e = cur.find_last_not_of(" \t");
    std::string ep = b == std::string::npos ? "" : cur.substr(b, e - b + 1);
    cur.clear();
    if (ep.empty()) return Status::OK();
    const std::string given = ep;
    bool https = security.tlsConfigured();
    if (ep.rfind("https://", 0) == 0) {
      https = true;
      ep = ep.substr(8);
    } else if (ep.rfind("http://", 0) == 0) {
      https = false;
      ep = ep.substr(7);
    } else if (ep.find("://") != std::string::npos) {
      return MC_STATUS(kInvalidArgument, "etcd endpoint '" << given
                                                           << "': the scheme is not http or https");
    }
    while (!ep.empty() && ep.back() == '/') ep.pop_back();
    size_t colon = ep.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == ep.size())
      return MC_STATUS(kInvalidArgument, "etcd endpoint '" << given << "' is not host:port");
    for (size_t i = colon + 1; i < ep.size(); ++i)
      if (ep[i] < '0' || ep[i] > '9')
        return MC_STATUS(kInvalidArgument, "etcd endpoint '" << given << "' is not host:port");
    if (https && !kHttpsBuilt)
      return MC_STATUS(kNotSupported,
                       "etcd endpoint " << given
                                        << ": https (or a CA / client certificate, "
                                           "MC_ETCD_CA_FILE / MC_ETCD_CERT_FILE) needs a "
                                           "cpp-httplib built with OpenSSL "
                                           "(CPPHTTPLIB_OPENSSL_SUPPORT), and this build's "
                                           "lacks it");
    c->endpoints_.push_back((https ? "https://" : "http://") + ep);
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
  if (!security.user.empty()) {
    for (const auto& ep : c->endpoints_) {
      if (ep.rfind("http://", 0) == 0) {
        MC_LOG(WARN, STORE) << "etcd: user " << security.user << "'s password and token go to "
                            << ep << " unencrypted (plain http): use https:// endpoints";
        break;
      }
    }
  }
  return c;
}

EtcdClient::~EtcdClient() = default;

Result<std::string> EtcdClient::post(const std::string& path, const std::string& body) {
  std::lock_guard<std::mutex> g(mu_);
  if (!security_.user.empty() && token_.empty() && !auth_disabled_) {
    MC_RETURN_IF_ERROR(authenticate());
  }
  bool stale = false;
  auto r = send(path, body, &stale);
  if (stale && !security_.user.empty()) {
    // The token expired (or etcd lost it, or enabled authentication since): once more with a
    // new one. etcd refuses an invalid token before it applies anything, so sending again
    // cannot apply a write twice.
    auth_disabled_ = false;
    MC_RETURN_IF_ERROR(authenticate());
    r = send(path, body, &stale);
  }
  return r;
}

Status EtcdClient::authenticate() {
  token_.clear();
  json req = {{"name", security_.user}, {"password", security_.password}};
  bool stale = false;
  auto r = send("/v3/auth/authenticate", req.dump(), &stale);
  if (!r.ok()) {
    if (has(r.status().message(), "authentication is not enabled")) {
      if (!auth_disabled_) {
        MC_LOG(WARN, STORE) << "etcd: user " << security_.user
                            << " is configured but etcd's authentication is not enabled: "
                               "calls go without a token";
      }
      auth_disabled_ = true;
      return Status::OK();
    }
    return r.status();
  }
  auto j = parse(*r);  // (its error would quote the answer, which holds the token)
  if (!j.ok()) return MC_STATUS(kProtocol, "etcd: authenticate answered something not JSON");
  if (j->contains("token") && (*j)["token"].is_string()) token_ = (*j)["token"].get<std::string>();
  if (token_.empty())
    return MC_STATUS(kProtocol, "etcd: authenticate answered without a token");
  auth_disabled_ = false;
  authentications_.fetch_add(1);
  return Status::OK();
}

Result<std::string> EtcdClient::send(const std::string& path, const std::string& body,
                                     bool* stale_token) {
  *stale_token = false;
  std::ostringstream errors;
  httplib::Headers headers;
  if (!token_.empty()) headers.emplace("Authorization", token_);
  const bool authenticating = path == "/v3/auth/authenticate";
  for (size_t n = 0; n < endpoints_.size(); ++n) {
    size_t i = (current_ + n) % endpoints_.size();
    const std::string& ep = endpoints_[i];
    const bool https = ep.rfind("https://", 0) == 0;
    std::unique_ptr<httplib::Client> cli;
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    if (https && !security_.cert_file.empty())
      cli = std::make_unique<httplib::Client>(ep, security_.cert_file, security_.key_file);
#endif
    if (!cli) cli = std::make_unique<httplib::Client>(ep);
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    if (https) {
      if (!security_.ca_file.empty()) cli->set_ca_cert_path(security_.ca_file);
      cli->enable_server_certificate_verification(true);  // the default; never turned off
      // OpenSSL checks the host too: cpp-httplib's own check falls back to the certificate's
      // CN when it has SANs, and takes an IPv6 SAN whose first bytes equal an IPv4 host.
      if (SSL_CTX* ctx = cli->ssl_context()) checkHostInCertificate(ctx, hostOf(ep));
    }
#endif
    if (!cli->is_valid()) {
      errors << (n ? "; " : "") << ep << ": cannot set up TLS (client certificate "
             << security_.cert_file << " and key " << security_.key_file
             << " do not load or do not match)";
      continue;
    }
    const time_t sec = timeout_ms_ / 1000;
    const time_t usec = (timeout_ms_ % 1000) * 1000;
    cli->set_connection_timeout(sec, usec);
    cli->set_read_timeout(sec, usec);
    cli->set_write_timeout(sec, usec);
    GatewayReply reply = gatewayPost(*cli, path, body, headers);
    const httplib::Error e = reply.error;
    const int status = reply.status;
    const std::string& answer = reply.body;
    if (!reply.answered) {
      std::string what = e == httplib::Error::Connection          ? "cannot connect"
                         : e == httplib::Error::ConnectionTimeout ? "connect timed out"
                         : e == httplib::Error::Read              ? "no answer (read failed)"
                         : e == httplib::Error::Write             ? "send failed"
                                                                  : httplib::to_string(e);
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
      const std::string ca = security_.ca_file.empty()
                                 ? std::string("the system's CAs (no MC_ETCD_CA_FILE)")
                                 : "CA file " + security_.ca_file;
      if (e == httplib::Error::SSLServerVerification) {
        const long v = cli->get_openssl_verify_result();
        if (v == X509_V_ERR_HOSTNAME_MISMATCH || v == X509_V_ERR_IP_ADDRESS_MISMATCH)
          what = "TLS: etcd's certificate does not name the endpoint's host " + hostOf(ep) +
                 " (an IP address needs an IP SAN, a name a DNS SAN)";
        else if (v != X509_V_OK)
          what = "TLS: etcd's certificate failed verification against " + ca + " (" +
                 X509_verify_cert_error_string(v) + ")";
        else
          what = "TLS: etcd's certificate does not name the endpoint's host " +
                 hostOf(ep);
      } else if (e == httplib::Error::SSLLoadingCerts) {
        what = "TLS: cannot load " + ca;
      } else if (https && (e == httplib::Error::SSLConnection || e == httplib::Error::Read ||
                           e == httplib::Error::Write)) {
        what = "TLS: handshake failed or etcd closed the connection (" + what + ")";
        if (security_.cert_file.empty())
          what += "; an etcd with --client-cert-auth needs a client certificate "
                  "(MC_ETCD_CERT_FILE, MC_ETCD_KEY_FILE)";
      }
#endif
      if (!https && e == httplib::Error::Read)
        what += " (is it an https endpoint? write https://host:port)";
      errors << (n ? "; " : "") << ep << ": " << what;
      continue;
    }
    if (status == 200) {
      current_ = i;
      return answer;
    }
    const GatewayError ge = gatewayError(answer);
    const std::string& msg = ge.message;
    // This member cannot serve now (a learner, overloaded, no leader, shutting down): the next
    // endpoint may (the gateway's errors used to look like read failures, which moved on too).
    if (status >= 500 || ge.code == 14 || has(msg, "not supported for learner") ||
        has(msg, "too many requests")) {
      errors << (n ? "; " : "") << ep << ": HTTP " << status << ": " << msg.substr(0, 200);
      continue;
    }
    current_ = i;
    if (authenticating && has(msg, "authentication failed"))
      return MC_STATUS(kPermissionDenied, "etcd " << ep << ": authentication failed for etcd user '"
                                                  << security_.user << "' (" << msg << ")");
    if (ge.code == 16 || status == 401) {  // UNAUTHENTICATED: "invalid auth token"
      *stale_token = true;
      return MC_STATUS(kPermissionDenied,
                       "etcd " << ep << path << ": " << msg
                               << (security_.user.empty() ? std::string(": ") + kUserHint
                                                          : std::string(" (after authenticating "
                                                                        "again)")));
    }
    if (has(msg, "revision of auth store is old") && !security_.user.empty()) {
      // A JWT (or a simple token issued before) predates a change of etcd's users or roles:
      // etcd refuses it before applying anything; a new token is taken (as clientv3 does).
      *stale_token = true;
      return MC_STATUS(kPermissionDenied, "etcd " << ep << path << ": " << msg
                                                  << " (after authenticating again)");
    }
    if (has(msg, "user name is empty")) {  // authentication enabled, no token sent
      *stale_token = !security_.user.empty();
      return MC_STATUS(kPermissionDenied, "etcd " << ep << path
                                                  << ": etcd requires authentication and this "
                                                     "client has no etcd user ("
                                                  << msg << "): " << kUserHint);
    }
    if (ge.code == 7 || status == 403)  // PERMISSION_DENIED
      return MC_STATUS(kPermissionDenied,
                       "etcd " << ep << path << ": " << msg << " for etcd user '" << security_.user
                               << "' (it needs readwrite on the key prefix mooncake-store/)");
    return MC_STATUS(kUnavailable, "etcd " << ep << path << ": HTTP " << status << ": "
                                           << msg.substr(0, 300));
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
Result<std::unique_ptr<EtcdClient>> EtcdClient::create(const std::string&, int64_t,
                                                       const EtcdSecurity&) {
  return noEtcd();
}
Result<std::string> EtcdClient::send(const std::string&, const std::string&, bool*) {
  return noEtcd();
}
Status EtcdClient::authenticate() { return noEtcd(); }
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
