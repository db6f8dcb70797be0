// The store's etcd client against a real etcd-server (Debian's etcd 3.4) with authentication
// enabled (store/ha/etcd_security.h): credentials, token renewal, setting checks, and a master
// and clients configured through its flags and MC_ETCD_* (TLS: etcd_tls_test.cc).
// Every etcd runs on free loopback ports with its own temp dir, removed at the end (also when a
// test fails: the objects own them).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "store/ha/leader_election.h"
#include "tests/common/loopback.h"
#include "tests/store/etcd_test_util.h"

namespace mooncake::test {
namespace {

using store::ha::EtcdClient;
using store::ha::EtcdSecurity;

constexpr const char* kUser = "mc";
constexpr const char* kPassword = "mc pass\tword";  // a space and a tab: kept as written

// An etcd with authentication enabled: root (role root) and kUser, whose role may read and write
// the prefix mooncake-store/ only; set up through the gateway's /v3/auth/* calls.
struct AuthEtcd {
  TempDir dir;
  std::unique_ptr<EtcdProcess> etcd;
  std::string right_file, wrong_file;  // password files

  EtcdSecurity security(const std::string& password_file) const {
    store::ha::EtcdSettings s;
    s.user = kUser;
    s.password_file = password_file;
    auto r = EtcdSecurity::load(s);
    return r.ok() ? *r : EtcdSecurity{};
  }
  EtcdSecurity right() const { return security(right_file); }
};

std::unique_ptr<AuthEtcd> startAuthEtcd(const std::string& extra_flags = "") {
  auto a = std::make_unique<AuthEtcd>();
  a->right_file = a->dir / "right";
  a->wrong_file = a->dir / "wrong";
  if (!writeFile(a->right_file, std::string(kPassword) + "\n") ||
      !writeFile(a->wrong_file, "not the password\n"))
    return nullptr;
  EtcdOptions o;
  o.extra_flags = extra_flags;
  a->etcd = EtcdProcess::start(o);
  if (!a->etcd) return nullptr;
  const std::string b64_prefix = store::ha::base64Encode("mooncake-store/");
  const std::string b64_end = store::ha::base64Encode("mooncake-store0");
  const std::vector<std::pair<const char*, std::string>> calls = {
      {"/v3/auth/user/add", R"({"name":"root","password":"rootpw"})"},
      {"/v3/auth/user/grant", R"({"user":"root","role":"root"})"},
      {"/v3/auth/user/add",
       std::string(R"({"name":")") + kUser + R"(","password":"mc pass\tword"})"},
      {"/v3/auth/role/add", R"({"name":"mc-store"})"},
      {"/v3/auth/role/grant", R"({"name":"mc-store","perm":{"permType":"READWRITE","key":")" +
                                  b64_prefix + R"(","range_end":")" + b64_end + R"("}})"},
      {"/v3/auth/user/grant", std::string(R"({"user":")") + kUser + R"(","role":"mc-store"})"},
      {"/v3/auth/enable", "{}"},
  };
  for (const auto& [path, body] : calls) {
    auto [code, answer] = rawPost("http://" + a->etcd->endpoint(), path, body);
    if (code != 200) {
      std::fprintf(stderr, "etcd %s: %d %s\n", path, code, answer.c_str());
      return nullptr;
    }
  }
  return a;
}

Result<std::unique_ptr<EtcdClient>> client(const std::string& endpoint,
                                           const EtcdSecurity& security) {
  return EtcdClient::create(endpoint, 1000, security);
}

TEST(EtcdAuth, WithoutAUserIsRefusedClearly) {
  auto a = startAuthEtcd();
  ASSERT_NE(a, nullptr);
  auto c = client(a->etcd->endpoint(), {});
  ASSERT_TRUE(c.ok());
  const auto t0 = Clock::now();
  auto got = (*c)->get(store::ha::leaderKey("x"));
  ASSERT_FALSE(got.ok());
  std::fprintf(stderr, "error: %s\n", got.status().toString().c_str());
  EXPECT_EQ(got.status().code(), Code::kPermissionDenied);
  EXPECT_NE(got.status().message().find("etcd requires authentication"), std::string::npos)
      << got.status().toString();
  EXPECT_NE(got.status().message().find("MC_ETCD_USER"), std::string::npos);
  EXPECT_NE(got.status().message().find("http://" + a->etcd->endpoint()), std::string::npos);
  // A master without credentials cannot join: its membership key is refused.
  store::ha::ElectionOptions eo;
  eo.cluster_id = "noauth";
  eo.name = "m0";
  eo.address = "127.0.0.1:1";
  store::ha::LeaderElection el(std::move(c).value(), eo, [](int64_t, bool) {}, [] {});
  Status st = el.start();
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_LT(secondsSince(t0), 3.0);
}

TEST(EtcdAuth, RightCredentialsRunTheElection) {
  auto a = startAuthEtcd();
  ASSERT_NE(a, nullptr);
  auto c = client(a->etcd->endpoint(), a->right());
  ASSERT_TRUE(c.ok());
  store::ha::ElectionOptions eo;
  eo.cluster_id = "auth";
  eo.name = "m0";
  eo.address = "127.0.0.1:4242";
  eo.ttl_s = 2;
  std::atomic<int64_t> epoch{0};
  store::ha::LeaderElection el(
      std::move(c).value(), eo, [&](int64_t e, bool) { epoch = e; }, [] {});
  ASSERT_TRUE(el.start().ok());
  for (int i = 0; i < 250 && !el.isLeader(); ++i) usleep(20000);
  ASSERT_TRUE(el.isLeader());
  auto reader = client(a->etcd->endpoint(), a->right());
  ASSERT_TRUE(reader.ok());
  auto leader = store::ha::readLeader(**reader, "auth");
  ASSERT_TRUE(leader.ok()) << leader.status().toString();
  EXPECT_EQ(leader->address, "127.0.0.1:4242");
  EXPECT_EQ(leader->name, "m0");
  EXPECT_EQ(leader->epoch, epoch.load());
  EXPECT_EQ((*reader)->authentications(), 1u);
  // The role covers mooncake-store/ only: the user's grant is what etcd enforces.
  Status outside = (*reader)->put("elsewhere", "x");
  EXPECT_EQ(outside.code(), Code::kPermissionDenied) << outside.toString();
  EXPECT_NE(outside.message().find("permission denied"), std::string::npos) << outside.toString();
  el.stop();
  auto gone = store::ha::readLeader(**reader, "auth");
  EXPECT_EQ(gone.status().code(), Code::kNotFound) << gone.status().toString();
}

TEST(EtcdAuth, WrongPasswordFailsFastNamingTheEndpoint) {
  auto a = startAuthEtcd();
  ASSERT_NE(a, nullptr);
  auto c = client(a->etcd->endpoint(), a->security(a->wrong_file));
  ASSERT_TRUE(c.ok());
  const auto t0 = Clock::now();
  Status st = (*c)->ping();
  std::fprintf(stderr, "error: %s\n", st.toString().c_str());
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_NE(st.message().find("authentication failed"), std::string::npos) << st.toString();
  EXPECT_NE(st.message().find("http://" + a->etcd->endpoint()), std::string::npos)
      << st.toString();
  EXPECT_LT(secondsSince(t0), 2.0);
  EXPECT_EQ((*c)->authentications(), 0u);
  // mooncake_master with the wrong password says so and exits at once.
  HaMaster m("--etcd-endpoints " + a->etcd->endpoint() + " --cluster-id wrong --etcd-user " +
                 kUser + " --etcd-password-file " + a->wrong_file,
             0, a->dir / "master.err");
  EXPECT_FALSE(m.start());
  EXPECT_EQ(m.waitExit(10000), 1);
  const std::string err = readFile(a->dir / "master.err");
  EXPECT_NE(err.find("authentication failed"), std::string::npos) << err;
  EXPECT_NE(err.find(a->etcd->endpoint()), std::string::npos) << err;
  EXPECT_LT(secondsSince(t0), 10.0);
}

TEST(EtcdAuth, ExpiredTokenIsRenewed) {
  auto a = startAuthEtcd("--auth-token-ttl 1");
  ASSERT_NE(a, nullptr);
  auto c = client(a->etcd->endpoint(), a->right());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->put(store::ha::clientMemberKey("ttl", "a"), "1").ok());
  EXPECT_EQ((*c)->authentications(), 1u);
  // A token got beside it at the same time, to show that etcd does expire them here.
  const std::string url = "http://" + a->etcd->endpoint();
  auto [code, body] = rawPost(url, "/v3/auth/authenticate",
                              std::string(R"({"name":")") + kUser +
                                  R"(","password":"mc pass\tword"})");
  ASSERT_EQ(code, 200) << body;
  const size_t at = body.find("\"token\":\"");
  ASSERT_NE(at, std::string::npos) << body;
  const std::string token = body.substr(at + 9, body.find('"', at + 9) - at - 9);
  // etcd drops a simple token unused for --auth-token-ttl (its keeper looks every second).
  usleep(3000 * 1000);
  auto [stale, why] = rawPost(url, "/v3/kv/range", R"({"key":"bW9vbmNha2Utc3RvcmUv"})",
                              {{"Authorization", token}});
  EXPECT_EQ(stale, 401) << why;
  EXPECT_NE(why.find("invalid auth token"), std::string::npos) << why;
  // The client's token expired the same way: the call authenticates again and succeeds.
  auto got = (*c)->get(store::ha::clientMemberKey("ttl", "a"));
  ASSERT_TRUE(got.ok()) << got.status().toString();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->value, "1");
  EXPECT_EQ((*c)->authentications(), 2u);
}

// etcd's JWT tokens carry the revision of its auth store: after any change of users or roles
// etcd refuses older ones ("revision of auth store is old", gRPC 3) until they expire. The
// client takes a new token (as etcd's clientv3 does) instead of failing for the JWT's life.
TEST(EtcdAuth, AuthChangeIsRenewedWithJwtTokens) {
  TempDir keys;
  const std::string cmd = "cd '" + keys.path +
                          "' && openssl genrsa -out jwt.key 2048 && "
                          "openssl rsa -in jwt.key -pubout -out jwt.pub";
  if (std::system((cmd + " >/dev/null 2>&1").c_str()) != 0) GTEST_SKIP() << "no openssl";
  auto a = startAuthEtcd("--auth-token jwt,pub-key=" + (keys / "jwt.pub") +
                         ",priv-key=" + (keys / "jwt.key") + ",sign-method=RS256,ttl=10m");
  ASSERT_NE(a, nullptr);
  auto c = client(a->etcd->endpoint(), a->right());
  ASSERT_TRUE(c.ok());
  const std::string key = store::ha::clientMemberKey("jwt", "a");
  ASSERT_TRUE((*c)->put(key, "1").ok());
  EXPECT_EQ((*c)->authentications(), 1u);
  // root adds a user: the auth store's revision moves on.
  const std::string url = "http://" + a->etcd->endpoint();
  auto [code, body] =
      rawPost(url, "/v3/auth/authenticate", R"({"name":"root","password":"rootpw"})");
  ASSERT_EQ(code, 200) << body;
  const size_t at = body.find("\"token\":\"");
  ASSERT_NE(at, std::string::npos) << body;
  const std::string root = body.substr(at + 9, body.find('"', at + 9) - at - 9);
  auto [added, why] = rawPost(url, "/v3/auth/user/add", R"({"name":"other","password":"x"})",
                              {{"Authorization", root}});
  ASSERT_EQ(added, 200) << why;
  auto got = (*c)->get(key);
  ASSERT_TRUE(got.ok()) << got.status().toString();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->value, "1");
  EXPECT_EQ((*c)->authentications(), 2u);
}

// An endpoint that answers but cannot serve (a learner: 503, gRPC 14) is passed over for the
// next one, as one that does not answer is.
TEST(EtcdAuth, AnEndpointThatCannotServeIsPassedOver) {
  auto a = startAuthEtcd();
  ASSERT_NE(a, nullptr);
  uint16_t port = 0;
  int lfd = listenLoopback(&port);
  ASSERT_GE(lfd, 0);
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::thread learner([&] {  // answers every request as etcd 3.4's gateway on a learner
    const std::string b = R"({"error":"etcdserver: rpc not supported for learner",)"
                          R"("code":14,"message":"etcdserver: rpc not supported for learner"})";
    const std::string reply = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                              "application/json\r\nContent-Length: " +
                              std::to_string(b.size()) + "\r\nConnection: close\r\n\r\n" + b;
    while (!stop) {
      pollfd p{lfd, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      int fd = accept(lfd, nullptr, nullptr);
      if (fd < 0) continue;
      char buf[8192];
      (void)!recv(fd, buf, sizeof(buf), 0);
      (void)!send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
      close(fd);
      ++served;
    }
  });
  const std::string eps =
      "127.0.0.1:" + std::to_string(port) + "," + a->etcd->endpoint();
  auto c = client(eps, a->right());
  ASSERT_TRUE(c.ok());
  Status st = (*c)->ping();
  stop = true;
  learner.join();
  close(lfd);
  EXPECT_TRUE(st.ok()) << st.toString();
  EXPECT_GT(served.load(), 0) << "the learner endpoint was never asked";
}

TEST(EtcdAuth, SettingsAreChecked) {
  TempDir d;
  store::ha::EtcdSettings s;
  s.user = "u";
  EXPECT_EQ(EtcdSecurity::load(s).status().code(), Code::kInvalidArgument);  // no password file
  s.password_file = d / "missing";
  EXPECT_EQ(EtcdSecurity::load(s).status().code(), Code::kNotFound);
  ASSERT_TRUE(writeFile(d / "open", "pw\n", 0644));
  s.password_file = d / "open";
  auto open = EtcdSecurity::load(s);
  EXPECT_EQ(open.status().code(), Code::kPermissionDenied);
  EXPECT_NE(open.status().message().find("mode 0600"), std::string::npos);
  ASSERT_TRUE(writeFile(d / "pw", "secret pw\r\nsecond line\n"));
  s.password_file = d / "pw";
  auto ok = EtcdSecurity::load(s);
  ASSERT_TRUE(ok.ok()) << ok.status().toString();
  EXPECT_EQ(ok->password, "secret pw");
  s.cert_file = d / "pw";  // a certificate without its key
  EXPECT_EQ(EtcdSecurity::load(s).status().code(), Code::kInvalidArgument);
  // The scheme decides; without one, TLS settings make it https.
  EXPECT_EQ(EtcdClient::create("ftp://127.0.0.1:1", 100, {}).status().code(),
            Code::kInvalidArgument);
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  EtcdSecurity tls;
  tls.ca_file = d / "pw";
  auto bare = EtcdClient::create("127.0.0.1:1;http://127.0.0.1:2", 100, tls);
  ASSERT_TRUE(bare.ok()) << bare.status().toString();
  EXPECT_EQ((*bare)->endpoints(),
            (std::vector<std::string>{"https://127.0.0.1:1", "http://127.0.0.1:2"}));
#else
  auto https = EtcdClient::create("https://127.0.0.1:1", 100, {});
  EXPECT_EQ(https.status().code(), Code::kNotSupported);
  EXPECT_NE(https.status().message().find("OpenSSL"), std::string::npos);
#endif
}

// End to end: a mooncake_master given the user by its flags leads, and a store client given it
// by MC_ETCD_USER / MC_ETCD_PASSWORD_FILE finds it through etcd; one without them is refused.
TEST(EtcdAuth, MasterAndClientOnAuthenticatedEtcd) {
  auto a = startAuthEtcd();
  ASSERT_NE(a, nullptr);
  const std::string ep = a->etcd->endpoint();
  HaMaster m("--etcd-endpoints " + ep + " --cluster-id authc --name m0 --etcd-user " + kUser +
                 " --etcd-password-file " + a->right_file,
             0, a->dir / "master.err");
  ASSERT_TRUE(m.start()) << readFile(a->dir / "master.err");
  ASSERT_TRUE(waitServing(m, 15000)) << readFile(a->dir / "master.err");
  EXPECT_EQ(clientRoundTrip("etcd://" + ep, "authc",
                            {{"MC_ETCD_USER", kUser}, {"MC_ETCD_PASSWORD_FILE", a->right_file}}),
            0);
  EXPECT_EQ(clientRoundTrip("etcd://" + ep, "authc", {}, "etcd requires authentication"), 0);
  EXPECT_EQ(clientRoundTrip("etcd://" + ep, "authc",
                            {{"MC_ETCD_USER", kUser}, {"MC_ETCD_PASSWORD_FILE", a->wrong_file}},
                            "authentication failed"),
            0);
  EXPECT_TRUE(m.serving());
}

}  // namespace
}  // namespace mooncake::test
