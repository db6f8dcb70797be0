// The store's etcd client against a real etcd-server serving https with --client-cert-auth:
// a throwaway CA, server certificate (SAN IP:127.0.0.1) and client certificate made with the
// openssl program into the test's temp dir; etcd's certificate is verified (against the CA
// file, else the system's CAs, which do not know the throwaway CA), and the client presents its
// certificate. Without OpenSSL support in cpp-httplib they are skipped, and the one that checks
// that https is then refused runs instead.
#include <gtest/gtest.h>

#include "tests/store/etcd_test_util.h"

namespace mooncake::test {
namespace {

using store::ha::EtcdClient;
using store::ha::EtcdSecurity;

// CA, server and client certificates (EC P-256, valid two days) in `dir`; a second CA that
// signed nothing of these (other-ca.crt). False when openssl failed.
bool makeCertificates(const std::string& dir) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string script =
      "set -e\ncd '" + dir +
      "'\n"
      "printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' > "
      "server.ext; "
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext; "
      "openssl req -x509 " + key + " -keyout ca.key -out ca.crt -days 2 -subj /CN=mc-test-ca; "
      "openssl req -x509 " + key + " -keyout other-ca.key -out other-ca.crt -days 2 "
      "-subj /CN=mc-other-ca; "
      "openssl req " + key + " -keyout server.key -out server.csr -subj /CN=mc-test-etcd; "
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
      "-out server.crt -days 2 -extfile server.ext; "
      "printf 'subjectAltName=DNS:some-other-host.example\\n' > cn.ext; "
      "openssl req " + key + " -keyout cn.key -out cn.csr -subj /CN=127.0.0.1; "
      "openssl x509 -req -in cn.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
      "-out cn.crt -days 2 -extfile cn.ext; "
      "openssl req " + key + " -keyout client.key -out client.csr -subj /CN=mc-test-client; "
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
      "-out client.crt -days 2 -extfile client.ext; "
      "chmod 600 *.key";
  if (!writeFile(dir + "/make.sh", script)) return false;
  const std::string cmd = "sh '" + dir + "/make.sh' >'" + dir + "/openssl.log' 2>&1";
  return std::system(cmd.c_str()) == 0;
}

struct TlsEtcd {
  TempDir dir;
  std::unique_ptr<EtcdProcess> etcd;

  EtcdSecurity full() const {  // CA + client certificate
    EtcdSecurity s;
    s.ca_file = dir / "ca.crt";
    s.cert_file = dir / "client.crt";
    s.key_file = dir / "client.key";
    return s;
  }
};

std::unique_ptr<TlsEtcd> startTlsEtcd() {
  auto t = std::make_unique<TlsEtcd>();
  if (t->dir.path.empty() || !makeCertificates(t->dir.path)) {
    std::fprintf(stderr, "openssl: %s\n", readFile(t->dir / "openssl.log").c_str());
    return nullptr;
  }
  EtcdOptions o;
  o.cert_file = t->dir / "server.crt";
  o.key_file = t->dir / "server.key";
  o.client_ca_file = t->dir / "ca.crt";
  o.probe = t->full();
  t->etcd = EtcdProcess::start(o);
  if (!t->etcd) return nullptr;
  return t;
}

// CPPHTTPLIB_OPENSSL_SUPPORT comes with cpp-httplib's flags (mooncake::httplib).
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
constexpr bool kHttps = true;
#else
constexpr bool kHttps = false;
#endif
#define MC_NEED_HTTPS() \
  if (!kHttps) GTEST_SKIP() << "cpp-httplib has no OpenSSL support: https is refused"

// A client of `endpoint` with `s` cannot ping: etcd's certificate does not name the host.
void expectHostNotNamed(const std::string& endpoint, const EtcdSecurity& s) {
  auto c = EtcdClient::create(endpoint, 1000, s);
  ASSERT_TRUE(c.ok()) << c.status().toString();
  Status st = (*c)->ping();
  std::fprintf(stderr, "error: %s\n", st.toString().c_str());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("does not name the endpoint's host"), std::string::npos)
      << st.toString();
}

TEST(EtcdTls, CaAndClientCertificateWork) {
  MC_NEED_HTTPS();
  auto t = startTlsEtcd();
  ASSERT_NE(t, nullptr);
  const std::string ep = t->etcd->endpoint();
  ASSERT_EQ(ep.rfind("https://", 0), 0u);
  auto c = EtcdClient::create(ep, 1000, t->full());
  ASSERT_TRUE(c.ok()) << c.status().toString();
  const std::string key = store::ha::clientMemberKey("tls", "a");
  auto lease = (*c)->grantLease(5);
  ASSERT_TRUE(lease.ok()) << lease.status().toString();
  ASSERT_TRUE((*c)->put(key, "v", *lease).ok());
  // Without a scheme, TLS settings make the endpoint https.
  auto bare = EtcdClient::create("127.0.0.1:" + std::to_string(t->etcd->clientPort()), 1000,
                                 t->full());
  ASSERT_TRUE(bare.ok());
  auto got = (*bare)->get(key);
  ASSERT_TRUE(got.ok()) << got.status().toString();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->value, "v");
  auto left = (*c)->keepAlive(*lease);
  ASSERT_TRUE(left.ok()) << left.status().toString();
  EXPECT_GT(*left, 0);
}

TEST(EtcdTls, WithoutTheCaTheCertificateIsRefused) {
  MC_NEED_HTTPS();
  auto t = startTlsEtcd();
  ASSERT_NE(t, nullptr);
  for (const std::string& ca : {std::string(), t->dir / "other-ca.crt"}) {
    EtcdSecurity s = t->full();
    s.ca_file = ca;  // the system's CAs, or a CA that did not sign etcd's certificate
    auto c = EtcdClient::create(t->etcd->endpoint(), 1000, s);
    ASSERT_TRUE(c.ok());
    Status st = (*c)->ping();
    std::fprintf(stderr, "error: %s\n", st.toString().c_str());
    EXPECT_EQ(st.code(), Code::kUnavailable) << st.toString();
    EXPECT_NE(st.message().find("certificate failed verification"), std::string::npos)
        << st.toString();
    EXPECT_NE(st.message().find(t->etcd->endpoint()), std::string::npos) << st.toString();
  }
}

TEST(EtcdTls, CertificateMustNameTheHost) {
  MC_NEED_HTTPS();
  auto t = startTlsEtcd();
  ASSERT_NE(t, nullptr);
  // The same etcd as "localhost": its certificate names IP 127.0.0.1 only. (localhost may
  // resolve to ::1 first, where nothing listens: then 127.0.0.1 is tried.)
  expectHostNotNamed("https://localhost:" + std::to_string(t->etcd->clientPort()), t->full());
}

// A certificate whose CN is the host but whose SANs name another: refused (the CN is not
// looked at when the certificate has SANs; cpp-httplib's own check alone took it).
TEST(EtcdTls, TheCommonNameDoesNotStandInForTheSans) {
  MC_NEED_HTTPS();
  TlsEtcd t;
  ASSERT_FALSE(t.dir.path.empty());
  ASSERT_TRUE(makeCertificates(t.dir.path)) << readFile(t.dir / "openssl.log");
  EtcdOptions o;
  o.cert_file = t.dir / "cn.crt";
  o.key_file = t.dir / "cn.key";
  o.probe.ca_file = t.dir / "ca.crt";
  o.probe_unverified = true;  // the harness's own readiness probe would be refused too
  t.etcd = EtcdProcess::start(o);
  ASSERT_NE(t.etcd, nullptr);
  EtcdSecurity s;
  s.ca_file = t.dir / "ca.crt";
  expectHostNotNamed(t.etcd->endpoint(), s);
}

TEST(EtcdTls, WithoutAClientCertificateIsRefused) {
  MC_NEED_HTTPS();
  auto t = startTlsEtcd();
  ASSERT_NE(t, nullptr);
  EtcdSecurity s;
  s.ca_file = t->dir / "ca.crt";
  auto c = EtcdClient::create(t->etcd->endpoint(), 1000, s);
  ASSERT_TRUE(c.ok());
  Status st = (*c)->ping();
  std::fprintf(stderr, "error: %s\n", st.toString().c_str());
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.toString();
  EXPECT_NE(st.message().find("TLS"), std::string::npos) << st.toString();
  EXPECT_NE(st.message().find("MC_ETCD_CERT_FILE"), std::string::npos) << st.toString();
  // Plain http to the https port fails too (and says what it may be).
  auto plain = EtcdClient::create("http://127.0.0.1:" + std::to_string(t->etcd->clientPort()),
                                  1000, {});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE((*plain)->ping().ok());
}

// End to end: a master given the TLS files by its flags leads, and a store client given them
// by MC_ETCD_CA_FILE / MC_ETCD_CERT_FILE / MC_ETCD_KEY_FILE finds it through etcd.
TEST(EtcdTls, MasterAndClientOnTlsEtcd) {
  MC_NEED_HTTPS();
  auto t = startTlsEtcd();
  ASSERT_NE(t, nullptr);
  const std::string ep = t->etcd->endpoint();
  const EtcdSecurity s = t->full();
  HaMaster m("--etcd-endpoints " + ep + " --cluster-id tlsc --name m0 --etcd-ca-file " +
                 s.ca_file + " --etcd-cert-file " + s.cert_file + " --etcd-key-file " + s.key_file,
             0, t->dir / "master.err");
  ASSERT_TRUE(m.start()) << readFile(t->dir / "master.err");
  ASSERT_TRUE(waitServing(m, 15000)) << readFile(t->dir / "master.err");
  EXPECT_EQ(clientRoundTrip("etcd://" + ep, "tlsc",
                            {{"MC_ETCD_CA_FILE", s.ca_file},
                             {"MC_ETCD_CERT_FILE", s.cert_file},
                             {"MC_ETCD_KEY_FILE", s.key_file}}),
            0);
  // Without the CA the client fails at once, saying why.
  EXPECT_EQ(clientRoundTrip("etcd://" + ep, "tlsc",
                            {{"MC_ETCD_CERT_FILE", s.cert_file}, {"MC_ETCD_KEY_FILE", s.key_file}},
                            "certificate failed verification"),
            0);
  EXPECT_TRUE(m.serving());
}

TEST(EtcdTls, HttpsIsRefusedWithoutOpenSsl) {
  if (kHttps) GTEST_SKIP() << "cpp-httplib has OpenSSL support";
  auto c = EtcdClient::create("https://127.0.0.1:2379", 1000, {});
  EXPECT_EQ(c.status().code(), Code::kNotSupported);
  EXPECT_NE(c.status().message().find("CPPHTTPLIB_OPENSSL_SUPPORT"), std::string::npos);
}

}  // namespace
}  // namespace mooncake::test
