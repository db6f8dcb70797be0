// The job secret: where it comes from (MC_SECRET, the secret file, its default under $HOME),
// that an engine or rendezvous without one is refused unless MC_ALLOW_NO_SECRET=1, how the
// file is created and checked, and that a rendezvous client without it gets nothing.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_admission.h"
#include "engine/wire.h"
#include "tests/common/test_secret.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

using test::ScopedEnv;

std::string tempDir() {
  char tmpl[] = "/tmp/mc_secret_test_XXXXXX";
  char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d ? d : "/tmp";
}

std::string readFile(const std::string& p) {
  std::ifstream f(p);
  std::string s;
  std::getline(f, s);
  return s;
}

TEST(SecretTest, GeneratedSecretsAreLongAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string s = generateSecret();
    EXPECT_EQ(s.size(), 64u);
    EXPECT_EQ(s.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(s);
  }
  EXPECT_EQ(seen.size(), 100u);
}

// A short secret is refused everywhere it is checked (engines, rendezvous servers, the store
// master): a handshake shows an HMAC of it, from which a guessable one is found offline.
TEST(SecretTest, ShortSecretIsRefused) {
  Status st = checkSecret("hunter2", "test");
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.toString();
  EXPECT_NE(st.message().find("at least 32"), std::string::npos) << st.toString();
  EXPECT_FALSE(checkSecret(std::string(kMinSecretBytes - 1, 'a'), "test").ok());
  EXPECT_TRUE(checkSecret(std::string(kMinSecretBytes, 'a'), "test").ok());
  EXPECT_TRUE(checkSecret(generateSecret(), "test").ok());
  {
    ScopedEnv weak("MC_SECRET", "hunter2");
    auto e = TransferEngine::create();
    ASSERT_FALSE(e.ok()) << "an engine with a 7-byte secret was created";
    EXPECT_EQ(e.status().code(), Code::kInvalidArgument) << e.status().toString();
  }
  auto r = TcpRendezvousServer::start("127.0.0.1", 0, "hunter2");
  EXPECT_FALSE(r.ok()) << "a rendezvous server with a 7-byte secret was started";
  // A client does not send a short secret's proof out either (a store client sharing a
  // group's engine connects to the master with its own secret).
  auto server = TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
  ASSERT_TRUE(server.ok()) << server.status().toString();
  auto c = TcpRendezvousClient::connect("127.0.0.1", (*server)->port(), "hunter2",
                                        deadlineInMs(5000));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status().toString();
}

TEST(SecretTest, EmptySecretIsRefusedUnlessAllowed) {
  ScopedEnv no_secret("MC_SECRET", nullptr);
  ScopedEnv no_file("MC_SECRET_FILE", nullptr);
  {
    ScopedEnv strict("MC_ALLOW_NO_SECRET", nullptr);
    auto e = TransferEngine::create();
    ASSERT_FALSE(e.ok()) << "an engine without a secret was created";
    EXPECT_EQ(e.status().code(), Code::kPermissionDenied);
    EXPECT_NE(e.status().message().find("MC_ALLOW_NO_SECRET"), std::string::npos)
        << e.status().toString();
    auto r = TcpRendezvousServer::start("127.0.0.1", 0, "");
    ASSERT_FALSE(r.ok()) << "a rendezvous server without a secret was started";
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  }
  {
    ScopedEnv open("MC_ALLOW_NO_SECRET", "1");
    auto e = TransferEngine::create();
    EXPECT_TRUE(e.ok()) << e.status().toString();
  }
}

TEST(SecretTest, EngineTakesMcSecretAndMcSecretFile) {
  std::string dir = tempDir();
  std::string file = dir + "/s";
  ASSERT_TRUE(loadSecretFile(file, true).ok());
  {
    ScopedEnv env("MC_SECRET", "from-env");
    ScopedEnv f("MC_SECRET_FILE", file.c_str());
    auto s = resolveSecret("", SecretFile::kIfSet);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*s, "from-env") << "MC_SECRET wins over the file";
    EXPECT_EQ(resolveSecret("given", SecretFile::kIfSet).value(), "given") << "an explicit one wins";
  }
  {
    ScopedEnv env("MC_SECRET", nullptr);
    ScopedEnv f("MC_SECRET_FILE", file.c_str());
    auto s = resolveSecret("", SecretFile::kIfSet);
    ASSERT_TRUE(s.ok()) << s.status().toString();
    EXPECT_EQ(*s, readFile(file));
  }
  {
    ScopedEnv env("MC_SECRET", nullptr);
    ScopedEnv f("MC_SECRET_FILE", nullptr);
    auto s = resolveSecret("", SecretFile::kIfSet);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*s, "") << "engines do not read the default file";
  }
}

TEST(SecretTest, DefaultFileIsCreatedPrivateUnderHome) {
  std::string home = tempDir();
  ScopedEnv h("HOME", home.c_str());
  ScopedEnv env("MC_SECRET", nullptr);
  ScopedEnv f("MC_SECRET_FILE", nullptr);
  EXPECT_EQ(defaultSecretFilePath(), home + "/.mooncake/secret");
  auto missing = resolveSecret("", SecretFile::kDefault);
  ASSERT_FALSE(missing.ok()) << "a client must not invent a secret the master does not know";
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  auto made = resolveSecret("", SecretFile::kDefaultCreate);
  ASSERT_TRUE(made.ok()) << made.status().toString();
  EXPECT_EQ(made->size(), 64u);
  struct stat st {};
  ASSERT_EQ(stat((home + "/.mooncake/secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((home + "/.mooncake").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto again = resolveSecret("", SecretFile::kDefault);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *made) << "the second reader gets what the creator wrote";
}

TEST(SecretTest, UnsafeOrEmptyFilesAreRefused) {
  std::string dir = tempDir();
  std::string file = dir + "/s";
  ASSERT_TRUE(loadSecretFile(file, true).ok());
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  auto r = loadSecretFile(file, false);
  ASSERT_FALSE(r.ok()) << "a world-readable secret file was accepted";
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  EXPECT_NE(r.status().message().find("0600"), std::string::npos) << r.status().toString();
  std::string empty = dir + "/empty";
  { std::ofstream(empty) << "\n"; }
  ASSERT_EQ(chmod(empty.c_str(), 0600), 0);
  EXPECT_FALSE(loadSecretFile(empty, false).ok());
  std::string link = dir + "/link";
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  EXPECT_FALSE(loadSecretFile(link, false).ok()) << "a symlinked secret file was followed";
}

// Several processes creating the same missing file at once all end up with one secret.
TEST(SecretTest, ConcurrentCreatorsAgree) {
  std::string dir = tempDir();
  std::string file = dir + "/shared";
  std::vector<pid_t> kids;
  std::vector<std::string> outs;
  for (int i = 0; i < 8; ++i) {
    std::string out = dir + "/out" + std::to_string(i);
    outs.push_back(out);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto s = loadSecretFile(file, true);
      std::ofstream(out) << (s.ok() ? *s : std::string("ERR ") + s.status().toString()) << "\n";
      _exit(s.ok() ? 0 : 1);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  std::string first = readFile(outs[0]);
  EXPECT_EQ(first.size(), 64u) << first;
  for (const auto& o : outs) EXPECT_EQ(readFile(o), first);
  EXPECT_EQ(readFile(file), first);
}

// A rendezvous client with the wrong secret (or none) is refused and learns nothing; the right
// one is served.
TEST(SecretTest, RendezvousServesOnlyTheJobSecret) {
  const std::string one = "job-secret-1-0123456789abcdef012345";
  const std::string two = "job-secret-2-0123456789abcdef012345";
  auto s = TcpRendezvousServer::start("127.0.0.1", 0, one);
  ASSERT_TRUE(s.ok()) << s.status().toString();
  auto server = std::move(s).value();
  auto good = TcpRendezvousClient::connect("127.0.0.1", server->port(), one, deadlineInMs(5000));
  ASSERT_TRUE(good.ok()) << good.status().toString();
  ASSERT_TRUE((*good)->set("mc/seg/victim", "descriptor bytes").ok());
  for (const std::string& wrong : {two, std::string(), one + "x"}) {
    auto bad = TcpRendezvousClient::connect("127.0.0.1", server->port(), wrong,
                                            deadlineInMs(5000));
    ASSERT_FALSE(bad.ok()) << "secret '" << wrong << "' was accepted";
    EXPECT_EQ(bad.status().code(), Code::kPermissionDenied) << bad.status().toString();
  }
  // A raw client that skips AUTH: its GET is not answered with the value; the server closes.
  {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(server->port());
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    wire::Writer body;
    body.u8(2);  // GET
    body.str("mc/seg/victim");
    body.str("");
    body.u64(0);
    wire::Writer frame;
    frame.u32(static_cast<uint32_t>(body.data().size()));
    frame.raw(body.data().data(), body.data().size());
    ASSERT_EQ(send(fd, frame.data().data(), frame.data().size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.data().size()));
    std::string got;
    char buf[256];
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    for (;;) {
      ssize_t k = recv(fd, buf, sizeof(buf), 0);
      if (k <= 0) break;
      got.append(buf, static_cast<size_t>(k));
    }
    close(fd);
    EXPECT_EQ(got.find("descriptor bytes"), std::string::npos) << "an unauthenticated GET read a value";
  }
  auto v = (*good)->get("mc/seg/victim");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, "descriptor bytes");
}

// Values past MC_RENDEZVOUS_MAX_VALUE_BYTES are refused (the server never holds them).
TEST(SecretTest, RendezvousCapsValueSizes) {
  ScopedEnv cap("MC_RENDEZVOUS_MAX_VALUE_BYTES", "65536");
  const std::string k(32, 'k');
  auto s = TcpRendezvousServer::start("127.0.0.1", 0, k);
  ASSERT_TRUE(s.ok());
  auto server = std::move(s).value();
  auto c = TcpRendezvousClient::connect("127.0.0.1", server->port(), k, deadlineInMs(5000));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->set("small", std::string(60000, 'x')).ok());
  Status big = (*c)->set("big", std::string(32u << 20, 'x'));
  EXPECT_FALSE(big.ok()) << "a 32 MiB rendezvous value was stored";
  EXPECT_FALSE((*c)->get("big").ok());
  EXPECT_TRUE((*c)->get("small").ok()) << "the connection still serves after a refusal";
}

// Connections waiting to authenticate may take at most a quarter of the descriptor limit, so a
// stranger cannot leave the process none for its own sockets and files.
TEST(SecretTest, PreauthCapFollowsTheDescriptorLimit) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(256, old.rlim_max);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto l = tcp::Admission::Limits::fromParams();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_EQ(l.preauth, static_cast<int64_t>(std::max<rlim_t>(16, low.rlim_cur / 4)));
  EXPECT_LE(l.per_source, l.preauth);
}

}  // namespace
}  // namespace mooncake::engine
