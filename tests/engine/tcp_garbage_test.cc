// Hostile bytes on an engine's tcp listener (desc.tcp_host:tcp_port), built from the frame
// spec in engine/transport/tcp/tcp_transport.h: random bytes, truncated headers, absurd
// lengths, frames before the handshake, wrong secrets, stalled half-sent frames, data
// connections of no open link, an authenticated raw client asking for memory outside the
// registered regions, and an impostor target (a member must not give it the secret). Afterwards
// the engine must still serve legitimate peers. Target and peers are engines in this process.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/hmac.h"
#include "engine/rendezvous.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "engine/transport/tcp/tcp_transport.h"
#include "engine/wire.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

using test::checkPattern;
using test::fillPattern;
using test::msSince;
using test::SteadyClock;
using tcp::FrameHeader;
using tcp::FrameType;

// A plain blocking client socket with deadlines on reads.
class RawConn {
 public:
  RawConn(const std::string& host, uint16_t port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
    fd_ = socket(res->ai_family, SOCK_STREAM, 0);
    if (fd_ >= 0 && connect(fd_, res->ai_addr, res->ai_addrlen) != 0) {
      close(fd_);
      fd_ = -1;
    }
    freeaddrinfo(res);
  }
  ~RawConn() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool send(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t k = ::send(fd_, c, n, MSG_NOSIGNAL);
      if (k <= 0) return false;
      c += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  bool send(const std::string& s) { return send(s.data(), s.size()); }
  bool sendFrame(const FrameHeader& h, const std::string& payload = "") {
    uint8_t b[tcp::kHeaderBytes];
    tcp::encodeHeader(h, b);
    return send(b, sizeof(b)) && send(payload);
  }
  // Reads exactly n bytes: 1 done, 0 closed by the engine, -1 timeout.
  int readExact(void* p, size_t n, int timeout_ms) {
    char* c = static_cast<char*>(p);
    auto t0 = SteadyClock::now();
    while (n > 0) {
      int left = timeout_ms - static_cast<int>(msSince(t0));
      if (left <= 0) return -1;
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, left) <= 0) continue;
      ssize_t k = ::recv(fd_, c, n, 0);
      if (k <= 0) return 0;
      c += k;
      n -= static_cast<size_t>(k);
    }
    return 1;
  }
  int readFrame(FrameHeader* h, std::string* payload, int timeout_ms = 5000) {
    uint8_t b[tcp::kHeaderBytes];
    int r = readExact(b, sizeof(b), timeout_ms);
    if (r != 1) return r;
    *h = tcp::decodeHeader(b);
    payload->clear();
    bool has_payload = h->type == FrameType::kHelloDenied || h->type == FrameType::kReadResp ||
                       h->type == FrameType::kMsg || h->type == FrameType::kDesc ||
                       h->type == FrameType::kChallenge || h->type == FrameType::kHelloProof;
    if (has_payload && h->length > 0 && h->length < (64u << 20)) {
      payload->resize(h->length);
      return readExact(payload->data(), h->length, timeout_ms);
    }
    return 1;
  }
  // True when the engine closes the connection within the timeout (data before EOF is
  // discarded).
  // The CHALLENGE the engine sends first on every connection ("" when none came).
  std::string challenge() {
    FrameHeader h;
    std::string nonce;
    if (readFrame(&h, &nonce) != 1 || h.type != FrameType::kChallenge ||
        nonce.size() != tcp::kNonceBytes)
      return "";
    return nonce;
  }
  bool closedByEngine(int timeout_ms) {
    auto t0 = SteadyClock::now();
    char buf[4096];
    while (msSince(t0) < timeout_ms) {
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, 50) <= 0) continue;
      ssize_t k = ::recv(fd_, buf, sizeof(buf), 0);
      if (k <= 0) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
};

FrameHeader header(FrameType t, uint64_t length, uint64_t addr = 0, uint64_t req = 1) {
  FrameHeader h;
  h.type = t;
  h.length = length;
  h.addr = addr;
  h.req_id = req;
  return h;
}

class TcpGarbageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions opt;
    opt.name = "target";
    opt.secret = "job-secret-of-this-test-0123456789ab";
    opt.transport = "tcp";
    auto e = TransferEngine::create(opt);
    ASSERT_TRUE(e.ok()) << e.status().toString();
    target_ = std::move(e).value();
    auto m = target_->allocate(kRegion);
    ASSERT_TRUE(m.ok()) << m.status().toString();
    region_ = static_cast<uint8_t*>(m.value());
    fillPattern(region_, kRegion, 1, 0);
    ASSERT_TRUE(target_->publish(rdv_).ok());
    desc_ = target_->localSegment();
    ASSERT_NE(desc_.tcp_port, 0);
    fillPattern(unregistered_, sizeof(unregistered_), 2, 0);
  }
  void TearDown() override {
    if (target_ && region_) {
      EXPECT_TRUE(target_->free(region_).ok());
    }
  }

  std::unique_ptr<RawConn> conn() {
    auto c = std::make_unique<RawConn>(desc_.tcp_host, desc_.tcp_port);
    EXPECT_TRUE(c->ok()) << "cannot connect to " << desc_.tcp_host << ":" << desc_.tcp_port;
    return c;
  }

  // A HELLO answering `c`'s CHALLENGE (read here) with a proof made with `secret`; *sent gets
  // the fields as sent (for checking the target's proof).
  std::string hello(RawConn& c, const std::string& secret, uint64_t engine_id,
                    tcp::ConnRole role = tcp::ConnRole::kControl, uint64_t link = 0,
                    tcp::Hello* sent = nullptr, std::string* challenge_out = nullptr) {
    const std::string challenge = c.challenge();
    EXPECT_EQ(challenge.size(), tcp::kNonceBytes) << "no CHALLENGE from the target";
    tcp::Hello h;
    h.engine_id = engine_id;
    h.role = role;
    h.link = link;
    h.index = role == tcp::ConnRole::kData ? 1 : 0;
    h.nonce = randomBytes(tcp::kNonceBytes);
    h.proof = secretProof(secret, tcp::kInitiatorProof, challenge, h.nonce, tcp::helloBound(h));
    if (sent != nullptr) *sent = h;
    if (challenge_out != nullptr) *challenge_out = challenge;
    return tcp::encodeHello(h);
  }
  // Sends a correct HELLO and checks the target's HELLO_PROOF; false (and a test failure)
  // when it does not check out.
  bool proven(RawConn& c, uint64_t engine_id, tcp::ConnRole role, uint64_t link = 0) {
    tcp::Hello sent;
    std::string challenge;
    std::string h = hello(c, "job-secret-of-this-test-0123456789ab", engine_id, role, link, &sent, &challenge);
    if (!c.sendFrame(header(FrameType::kHello, h.size()), h)) return false;
    FrameHeader r;
    std::string proof;
    int got = c.readFrame(&r, &proof);
    EXPECT_EQ(got, 1) << "no answer to a valid HELLO";
    EXPECT_EQ(r.type, FrameType::kHelloProof) << "status " << r.status << " " << proof;
    EXPECT_EQ(r.aux, target_->engineId());
    EXPECT_EQ(proof, tcp::targetProof("job-secret-of-this-test-0123456789ab", challenge, sent, r.aux))
        << "the target's proof does not check out";
    return got == 1 && r.type == FrameType::kHelloProof &&
           proof == tcp::targetProof("job-secret-of-this-test-0123456789ab", challenge, sent, r.aux);
  }
  std::string desc(uint64_t engine_id) {
    SegmentDesc fake;
    fake.name = "raw-client";
    fake.engine_id = engine_id;
    fake.host_id = "elsewhere";
    fake.tcp_host = "127.0.0.1";
    fake.tcp_port = 1;  // nobody listens: the target must not depend on reaching it
    fake.transports = 1u << static_cast<int>(TransportKind::kTcp);
    return fake.serialize();
  }

  // A raw connection that completed the handshake as a control connection (HELLO + DESC);
  // nullptr (and a test failure) otherwise.
  std::unique_ptr<RawConn> authenticated(uint64_t engine_id, uint64_t link = 0) {
    auto c = conn();
    if (!proven(*c, engine_id, tcp::ConnRole::kControl, link)) return nullptr;
    std::string d = desc(engine_id);
    if (!c->sendFrame(header(FrameType::kDesc, d.size()), d)) return nullptr;
    FrameHeader r;
    std::string payload;
    int got = c->readFrame(&r, &payload);
    EXPECT_EQ(got, 1) << "no answer to a valid HELLO";
    EXPECT_EQ(r.type, FrameType::kHelloOk) << "status " << r.status << " " << payload;
    EXPECT_EQ(r.aux, target_->engineId());
    if (got != 1 || r.type != FrameType::kHelloOk) return nullptr;
    return c;
  }

  // A tcp engine of this process with that name and secret (a test failure if none).
  static std::unique_ptr<TransferEngine> tcpEngine(const std::string& name,
                                                   const std::string& secret) {
    EngineOptions opt;
    opt.name = name;
    opt.secret = secret;
    opt.transport = "tcp";
    auto e = TransferEngine::create(opt);
    EXPECT_TRUE(e.ok()) << e.status().toString();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  // A legitimate engine (forced transport) opens the target, moves data both ways and
  // notifies it: proof that the target still serves after whatever came before.
  void expectServesLegitimatePeer(const std::string& transport, const std::string& name) {
    SCOPED_TRACE("legitimate peer over " + transport);
    EngineOptions opt;
    opt.name = name;
    opt.secret = "job-secret-of-this-test-0123456789ab";
    opt.transport = transport;
    auto e = TransferEngine::create(opt);
    ASSERT_TRUE(e.ok()) << e.status().toString();
    auto eng = std::move(e).value();
    auto t0 = SteadyClock::now();
    auto pid = eng->openPeer(rdv_, "target", deadlineInMs(10000));
    ASSERT_TRUE(pid.ok()) << pid.status().toString();
    EXPECT_LT(msSince(t0), 5000) << "opening the target was slowed down by hostile clients";
    std::vector<uint8_t> buf(1 << 20);
    fillPattern(buf.data(), buf.size(), 3, 0);
    Status st = eng->transfer({{OpCode::kWrite, buf.data(), buf.size(), pid.value(),
                                reinterpret_cast<uint64_t>(region_) + 1}},
                              deadlineInMs(10000));
    ASSERT_TRUE(st.ok()) << st.toString();
    EXPECT_EQ(checkPattern(region_ + 1, buf.size(), 3, 0), "");
    std::vector<uint8_t> back(buf.size());
    st = eng->transfer({{OpCode::kRead, back.data(), back.size(), pid.value(),
                         reinterpret_cast<uint64_t>(region_) + 1}},
                       deadlineInMs(10000));
    ASSERT_TRUE(st.ok()) << st.toString();
    EXPECT_EQ(checkPattern(back.data(), back.size(), 3, 0), "");
    ASSERT_TRUE(eng->notify(pid.value(), 0xfeed).ok());
    auto n = target_->waitNotify(deadlineInMs(5000));
    ASSERT_TRUE(n.ok()) << n.status().toString();
    EXPECT_EQ(n->tag, 0xfeedu);
    EXPECT_EQ(n->src_engine, eng->engineId());
    fillPattern(region_, kRegion, 1, 0);
  }

  static constexpr uint64_t kRegion = 2u << 20;
  InProcessRendezvous rdv_;
  std::unique_ptr<TransferEngine> target_;
  SegmentDesc desc_;
  uint8_t* region_ = nullptr;
  uint8_t unregistered_[8192];
};

TEST_F(TcpGarbageTest, UnauthenticatedGarbage) {
  std::mt19937_64 rng(99);
  // Random bytes of random lengths, then close.
  for (int i = 0; i < 30; ++i) {
    auto c = conn();
    std::string junk(1 + rng() % 8192, '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    c->send(junk);
  }
  // Connect and close at once; one byte; a truncated header.
  for (int i = 0; i < 20; ++i) conn();
  conn()->send("M", 1);
  {
    uint8_t b[tcp::kHeaderBytes];
    tcp::encodeHeader(header(FrameType::kHello, 100), b);
    conn()->send(b, 20);
  }
  // A full header with a bad magic; absurd HELLO lengths; an unknown type; a data frame
  // before the handshake (aimed at registered memory): each closes that connection.
  struct Bad {
    const char* what;
    FrameHeader h;
    std::string payload;
  };
  std::vector<Bad> bad;
  FrameHeader magic = header(FrameType::kHello, 10);
  magic.magic = 0xdeadbeef;
  bad.push_back({"bad magic", magic, std::string(10, 'x')});
  bad.push_back({"HELLO of 2^63 bytes", header(FrameType::kHello, 1ull << 63), ""});
  bad.push_back({"HELLO of ~0 bytes", header(FrameType::kHello, ~uint64_t{0}), ""});
  bad.push_back({"HELLO over its limit", header(FrameType::kHello, tcp::kMaxHelloBytes + 1), ""});
  bad.push_back({"unknown type", header(static_cast<FrameType>(200), 0), ""});
  bad.push_back({"WRITE before HELLO",
                 header(FrameType::kWrite, 64, reinterpret_cast<uint64_t>(region_)),
                 std::string(64, '\x42')});
  bad.push_back({"READ_REQ before HELLO",
                 header(FrameType::kReadReq, 64, reinterpret_cast<uint64_t>(region_)), ""});
  bad.push_back({"NOTIFY before HELLO", header(FrameType::kNotify, 0), ""});
  bad.push_back({"HELLO with garbage payload", header(FrameType::kHello, 300),
                 std::string(300, '\xff')});
  for (auto& b : bad) {
    auto c = conn();
    c->sendFrame(b.h, b.payload);
    EXPECT_TRUE(c->closedByEngine(3000)) << b.what << ": the engine kept the connection open";
  }
  // A well-formed HELLO with the wrong secret: HELLO_DENIED, then the connection closes.
  {
    auto c = conn();
    std::string h = hello(*c, "wrong", 0x1234);
    c->sendFrame(header(FrameType::kHello, h.size()), h);
    FrameHeader r;
    std::string reason;
    ASSERT_EQ(c->readFrame(&r, &reason), 1) << "no answer to a HELLO with the wrong secret";
    EXPECT_EQ(r.type, FrameType::kHelloDenied);
    EXPECT_EQ(r.status, static_cast<uint16_t>(Code::kPermissionDenied));
    EXPECT_TRUE(c->closedByEngine(3000));
  }
  EXPECT_EQ(checkPattern(region_, kRegion, 1, 0), "") << "garbage changed registered memory";
  Notification stray;
  EXPECT_FALSE(target_->pollNotify(&stray)) << "garbage produced a notification";
  expectServesLegitimatePeer("tcp", "legit-tcp");
  expectServesLegitimatePeer("shm", "legit-shm");
}

// Stalled clients (nothing sent; half a header; half a HELLO payload) stay connected while a
// legitimate peer opens the target: one slow client must not block the listener.
TEST_F(TcpGarbageTest, StalledClientsDoNotBlockOthers) {
  auto silent = conn();
  auto half_header = conn();
  uint8_t b[tcp::kHeaderBytes];
  tcp::encodeHeader(header(FrameType::kHello, 1000), b);
  half_header->send(b, 17);
  auto half_hello = conn();
  std::string h = hello(*half_hello, "job-secret-of-this-test-0123456789ab", 0x99);
  half_hello->sendFrame(header(FrameType::kHello, h.size()), h.substr(0, h.size() / 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  expectServesLegitimatePeer("tcp", "legit-1");
}

// An authenticated raw client: accesses outside registered memory are refused by the target
// (kPermissionDenied in the ack/response) and change nothing; valid ones work; a later
// protocol violation closes only that connection.
TEST_F(TcpGarbageTest, AuthenticatedClientCannotEscapeRegions) {
  auto c = authenticated(0xabcdef0123ull);
  ASSERT_TRUE(c);
  FrameHeader r;
  std::string payload;

  const uint64_t base = reinterpret_cast<uint64_t>(region_);
  const uint64_t unreg = reinterpret_cast<uint64_t>(unregistered_);
  struct Case {
    const char* what;
    uint64_t addr, len;
  } cases[] = {
      {"unregistered memory", unreg, 64},
      {"straddling the region's end", base + kRegion - 8, 64},
      {"straddling the region's start", base - 8, 64},
      {"past the end", base + kRegion, 1},
      {"wrapping", ~uint64_t{0} - 7, 64},
  };
  uint64_t req = 100;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.what);
    ASSERT_TRUE(c->sendFrame(header(FrameType::kWrite, k.len, k.addr, ++req),
                             std::string(k.len, '\x77')));
    ASSERT_EQ(c->readFrame(&r, &payload), 1) << "no WRITE_ACK";
    EXPECT_EQ(r.type, FrameType::kWriteAck);
    EXPECT_EQ(r.req_id, req);
    EXPECT_EQ(r.status, static_cast<uint16_t>(Code::kPermissionDenied));
    ASSERT_TRUE(c->sendFrame(header(FrameType::kReadReq, k.len, k.addr, ++req)));
    ASSERT_EQ(c->readFrame(&r, &payload), 1) << "no READ_RESP";
    EXPECT_EQ(r.type, FrameType::kReadResp);
    EXPECT_EQ(r.req_id, req);
    EXPECT_EQ(r.status, static_cast<uint16_t>(Code::kPermissionDenied));
  }
  EXPECT_EQ(checkPattern(unregistered_, sizeof(unregistered_), 2, 0), "");
  EXPECT_EQ(checkPattern(region_, kRegion, 1, 0), "");

  // A valid WRITE and READ on the same connection work (the refusals kept it in sync).
  std::string data(100, '\0');
  fillPattern(data.data(), data.size(), 5, 0);
  ASSERT_TRUE(c->sendFrame(header(FrameType::kWrite, 100, base + 11, ++req), data));
  ASSERT_EQ(c->readFrame(&r, &payload), 1);
  EXPECT_EQ(r.type, FrameType::kWriteAck);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(checkPattern(region_ + 11, 100, 5, 0), "");
  ASSERT_TRUE(c->sendFrame(header(FrameType::kReadReq, 100, base + 11, ++req)));
  ASSERT_EQ(c->readFrame(&r, &payload), 1);
  EXPECT_EQ(r.type, FrameType::kReadResp);
  EXPECT_EQ(payload, data);

  // Absurd lengths after authentication: refused or the connection closed, never allocated.
  ASSERT_TRUE(c->sendFrame(header(FrameType::kReadReq, 1ull << 40, base, ++req)));
  int got = c->readFrame(&r, &payload, 3000);
  EXPECT_NE(got, -1) << "no answer to a 1 TiB READ_REQ";
  if (got == 1) {
    EXPECT_EQ(r.type, FrameType::kReadResp);
    EXPECT_NE(r.status, 0) << "a 1 TiB read was not refused";
  }
  auto c2 = authenticated(0xabcdef0124ull);
  ASSERT_TRUE(c2);
  ASSERT_TRUE(c2->sendFrame(header(FrameType::kWrite, ~uint64_t{0}, base, ++req)));
  EXPECT_TRUE(c2->closedByEngine(3000)) << "a WRITE announcing 2^64-1 bytes must close";
  fillPattern(region_, kRegion, 1, 0);
  expectServesLegitimatePeer("tcp", "legit-2");
}

// ---- before authentication: deadlines, limits, frame order ----

using test::ScopedEnv;

// A connection that never says HELLO is closed after MC_HANDSHAKE_TIMEOUT_MS; one that sends
// half a HELLO too. Connections from one source beyond MC_MAX_PREAUTH_PER_SOURCE are closed at
// once. A legitimate engine still opens the target meanwhile (it retries a closed handshake).
TEST_F(TcpGarbageTest, HandshakeDeadlineAndPerSourceLimit) {
  ScopedEnv deadline("MC_HANDSHAKE_TIMEOUT_MS", "400");
  ScopedEnv per_source("MC_MAX_PREAUTH_PER_SOURCE", "8");
  target_.reset();  // restart the target under these limits
  SetUp();
  std::vector<std::unique_ptr<RawConn>> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(conn());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Over the limit: closed at once (within the 100 ms above), not at the deadline.
  int closed_early = 0;
  for (auto& c : idle) closed_early += c->closedByEngine(1) ? 1 : 0;
  EXPECT_GE(closed_early, 12) << "connections beyond MC_MAX_PREAUTH_PER_SOURCE stayed open";
  auto half = conn();
  std::string h = hello(*half, "job-secret-of-this-test-0123456789ab", 0x42);
  half->sendFrame(header(FrameType::kHello, h.size()), h.substr(0, 5));
  auto t0 = SteadyClock::now();
  for (auto& c : idle) EXPECT_TRUE(c->closedByEngine(3000)) << "an idle connection outlived the handshake deadline";
  EXPECT_TRUE(half->closedByEngine(3000)) << "half a HELLO outlived the handshake deadline";
  EXPECT_LT(msSince(t0), 2500);
  // The listener serves again once the idle ones are gone; and a legitimate peer gets through
  // even while a new batch of idle connections holds every pre-auth slot of its source.
  std::vector<std::unique_ptr<RawConn>> again;
  for (int i = 0; i < 8; ++i) again.push_back(conn());
  expectServesLegitimatePeer("tcp", "legit-under-flood");
}

// The frame order of the handshake: DESC only after HELLO, only on a control connection, once;
// nothing else on a control connection before DESC. Each violation closes that connection.
TEST_F(TcpGarbageTest, DescOrder) {
  const uint64_t id = 0x5151;
  std::string d = desc(id);
  {
    auto c = conn();
    c->sendFrame(header(FrameType::kDesc, d.size()), d);
    EXPECT_TRUE(c->closedByEngine(3000)) << "DESC before HELLO";
  }
  {
    auto c = conn();
    ASSERT_TRUE(proven(*c, id, tcp::ConnRole::kControl));
    c->sendFrame(header(FrameType::kNotify, 0));
    EXPECT_TRUE(c->closedByEngine(3000)) << "NOTIFY before DESC";
  }
  {
    auto c = conn();
    ASSERT_TRUE(proven(*c, id, tcp::ConnRole::kControl));
    c->sendFrame(header(FrameType::kDesc, tcp::kMaxDescBytes + 1));
    EXPECT_TRUE(c->closedByEngine(3000)) << "DESC over its limit";
  }
  {
    auto c = authenticated(id);
    ASSERT_TRUE(c);
    c->sendFrame(header(FrameType::kDesc, d.size()), d);
    EXPECT_TRUE(c->closedByEngine(3000)) << "a second DESC";
  }
  expectServesLegitimatePeer("tcp", "legit-after-desc");
}

// A data connection joins the link of a control connection that is open at the target (same
// engine id and link id): without one it is denied, so a member cannot send in the name of an
// engine id it read elsewhere. Control-only frames on a data connection close it.
TEST_F(TcpGarbageTest, DataConnectionsJoinAnOpenControlConnection) {
  const uint64_t id = 0x6161, link = 0x1111;
  std::string d = desc(id);
  {
    auto c = conn();
    std::string h = hello(*c, "job-secret-of-this-test-0123456789ab", id, tcp::ConnRole::kData, link);
    c->sendFrame(header(FrameType::kHello, h.size()), h);
    FrameHeader r;
    std::string reason;
    ASSERT_EQ(c->readFrame(&r, &reason), 1);
    EXPECT_EQ(r.type, FrameType::kHelloDenied) << "a data connection without its control one";
    EXPECT_NE(reason.find("no open control connection"), std::string::npos) << reason;
    EXPECT_TRUE(c->closedByEngine(3000));
  }
  auto ctl = authenticated(id, link);
  ASSERT_TRUE(ctl);
  {
    auto c = conn();  // another link id of the same engine: still denied
    std::string h = hello(*c, "job-secret-of-this-test-0123456789ab", id, tcp::ConnRole::kData, link + 1);
    c->sendFrame(header(FrameType::kHello, h.size()), h);
    FrameHeader r;
    std::string reason;
    ASSERT_EQ(c->readFrame(&r, &reason), 1);
    EXPECT_EQ(r.type, FrameType::kHelloDenied) << "a data connection of another link";
  }
  const struct {
    const char* what;
    FrameType type;
    std::string payload;
  } control_only[] = {{"DESC", FrameType::kDesc, d},
                      {"MSG", FrameType::kMsg, std::string(8, 'm')},
                      {"NOTIFY", FrameType::kNotify, ""},
                      {"XCHG", FrameType::kXchg, std::string(8, 'x')}};
  for (const auto& k : control_only) {
    auto c = conn();
    ASSERT_TRUE(proven(*c, id, tcp::ConnRole::kData, link)) << "the link's data connection";
    c->sendFrame(header(k.type, k.payload.size()), k.payload);
    EXPECT_TRUE(c->closedByEngine(3000)) << k.what << " on a data connection";
  }
  // Once the control connection is gone, its link takes no more data connections.
  ctl.reset();
  bool denied = false;
  for (int i = 0; i < 100 && !denied; ++i) {  // the target notices the close asynchronously
    auto c = conn();
    std::string h = hello(*c, "job-secret-of-this-test-0123456789ab", id, tcp::ConnRole::kData, link);
    c->sendFrame(header(FrameType::kHello, h.size()), h);
    FrameHeader r;
    std::string payload;
    ASSERT_EQ(c->readFrame(&r, &payload), 1);
    denied = r.type == FrameType::kHelloDenied;
    if (!denied) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(denied) << "a closed control connection's link still took data connections";
  expectServesLegitimatePeer("tcp", "legit-after-data-links");
}

// The secret never goes on the wire, and a process that accepts a member's connection (an
// impostor at an address the member was given) learns nothing it can use: the member sends
// nothing before a CHALLENGE, only a proof bound to that challenge, which the real target
// refuses when replayed, and it stops at a target proof that does not check out (no DESC, an
// error naming the cause). The same for the rendezvous client.
TEST_F(TcpGarbageTest, ImpostorTargetLearnsNothing) {
  const std::string secret = "job-secret-of-this-test-0123456789ab";
  auto listener = sock::listenOn("127.0.0.1", 0, 0);
  ASSERT_TRUE(listener.ok()) << listener.status().toString();
  const uint16_t port = sock::localPort(*listener);
  auto e = tcpEngine("member", secret);
  ASSERT_TRUE(e);
  TransferEngine* member = e.get();
  // Reads what a connection sends within `ms` (until it closes or goes quiet).
  auto drain = [](int fd, int ms) {
    std::string got;
    char buf[4096];
    auto t0 = SteadyClock::now();
    while (static_cast<int>(msSince(t0)) < ms) {
      pollfd pfd{fd, POLLIN, 0};
      if (poll(&pfd, 1, 50) <= 0) continue;
      ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
      if (k <= 0) break;
      got.append(buf, static_cast<size_t>(k));
    }
    return got;
  };
  auto acceptOne = [&]() {
    pollfd pfd{*listener, POLLIN, 0};
    EXPECT_EQ(poll(&pfd, 1, 5000), 1) << "the member did not connect";
    return ::accept(*listener, nullptr, nullptr);
  };
  auto sendRaw = [](int fd, FrameType t, uint64_t aux, const std::string& payload) {
    FrameHeader h = header(t, payload.size());
    h.aux = aux;
    uint8_t b[tcp::kHeaderBytes];
    tcp::encodeHeader(h, b);
    std::string out(reinterpret_cast<char*>(b), sizeof(b));
    out += payload;
    return ::send(fd, out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size());
  };
  // 1. No CHALLENGE: the member sends nothing and gives up at its deadline.
  {
    auto asked = std::async(std::launch::async, [&] {
      return member->queryPeer("127.0.0.1", port, deadlineInMs(800));
    });
    int fd = acceptOne();
    ASSERT_GE(fd, 0);
    EXPECT_EQ(drain(fd, 1500), "") << "the member spoke before the target's challenge";
    auto r = asked.get();
    EXPECT_FALSE(r.ok());
    ::close(fd);
  }
  // 2. A CHALLENGE, then a made-up proof: the member's HELLO holds no secret, and it stops.
  std::string captured;
  {
    auto asked = std::async(std::launch::async, [&] {
      return member->queryPeer("127.0.0.1", port, deadlineInMs(5000));
    });
    int fd = acceptOne();
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(sendRaw(fd, FrameType::kChallenge, 0, randomBytes(tcp::kNonceBytes)));
    uint8_t b[tcp::kHeaderBytes];
    std::string first = drain(fd, 300);
    ASSERT_GE(first.size(), tcp::kHeaderBytes);
    std::memcpy(b, first.data(), sizeof(b));
    FrameHeader hh = tcp::decodeHeader(b);
    EXPECT_EQ(hh.type, FrameType::kHello);
    captured = first.substr(tcp::kHeaderBytes);
    EXPECT_EQ(first.find(secret), std::string::npos) << "the secret went on the wire";
    ASSERT_TRUE(sendRaw(fd, FrameType::kHelloProof, 0x777, randomBytes(kSha256Bytes)));
    auto r = asked.get();
    ASSERT_FALSE(r.ok()) << "a target without the secret was believed";
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().toString();
    EXPECT_NE(r.status().message().find("did not prove"), std::string::npos)
        << r.status().toString();
    EXPECT_EQ(drain(fd, 300), "") << "the member went on after a wrong proof";
    ::close(fd);
  }
  // 3. The captured HELLO replayed to the real target (which challenged afresh): denied.
  {
    auto c = conn();
    EXPECT_EQ(c->challenge().size(), tcp::kNonceBytes);
    c->sendFrame(header(FrameType::kHello, captured.size()), captured);
    FrameHeader r;
    std::string reason;
    ASSERT_EQ(c->readFrame(&r, &reason), 1);
    EXPECT_EQ(r.type, FrameType::kHelloDenied) << "a replayed HELLO was accepted";
  }
  // 4. The rendezvous client: the same with the server's challenge and proof.
  {
    auto joined = std::async(std::launch::async, [&] {
      return TcpRendezvousClient::connect("127.0.0.1", port, secret, deadlineInMs(5000));
    });
    int fd = acceptOne();
    ASSERT_GE(fd, 0);
    wire::Writer body;
    body.u8(0);  // kOk
    body.str(randomBytes(32));
    wire::Writer frame;
    frame.u32(static_cast<uint32_t>(body.data().size()));
    frame.raw(body.data().data(), body.data().size());
    std::string challenge = frame.take();
    ASSERT_EQ(::send(fd, challenge.data(), challenge.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(challenge.size()));
    std::string auth = drain(fd, 300);
    EXPECT_FALSE(auth.empty()) << "no AUTH after the challenge";
    EXPECT_EQ(auth.find(secret), std::string::npos) << "the secret went on the wire";
    wire::Writer rb;
    rb.u8(0);
    rb.str(randomBytes(32));  // a made-up server proof
    wire::Writer rf;
    rf.u32(static_cast<uint32_t>(rb.data().size()));
    rf.raw(rb.data().data(), rb.data().size());
    std::string reply = rf.take();
    ASSERT_EQ(::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(reply.size()));
    auto r = joined.get();
    ASSERT_FALSE(r.ok()) << "a rendezvous without the secret was believed";
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().toString();
    EXPECT_EQ(drain(fd, 300), "") << "the client went on after a wrong proof";
    ::close(fd);
  }
  ::close(*listener);
}

// A descriptor whose port another engine took since (a restart on the same port): the open
// fails at the target's proof, which names the engine that answers, before our descriptor goes
// out, so that engine does not take us for a peer and then report our close as our failure
// (it used to mark its own healthy peer to us dead).
TEST_F(TcpGarbageTest, StaleDescriptorLeavesTheNewOwnersPeerAlone) {
  auto a = tcpEngine("a", "job-secret-of-this-test-0123456789ab");
  ASSERT_TRUE(a);
  std::atomic<int> gone{0};
  target_->addPeerGoneHandler(
      [&](uint64_t, const std::string&, const Status&) { gone.fetch_add(1); });
  auto to_a = target_->openPeer(a->localSegment(), deadlineInMs(5000));
  ASSERT_TRUE(to_a.ok()) << to_a.status().toString();
  SegmentDesc stale = target_->localSegment();
  stale.engine_id ^= 0x1234;  // the engine that listened there before
  stale.name = "gone-engine";
  auto r = a->openPeer(stale, deadlineInMs(5000));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().toString();
  EXPECT_NE(r.status().message().find("stale descriptor"), std::string::npos)
      << r.status().toString();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(target_->peerStatus(*to_a).ok()) << target_->peerStatus(*to_a).toString();
  EXPECT_EQ(gone.load(), 0) << "the target reported a peer gone";
}

// An engine with the wrong secret is denied at once (no retry until its deadline), by name.
TEST_F(TcpGarbageTest, WrongSecretIsDeniedPromptly) {
  auto e = tcpEngine("intruder", "not-the-job-secret-0123456789abcdef");
  ASSERT_TRUE(e);
  auto t0 = SteadyClock::now();
  auto pid = e->openPeer(rdv_, "target", deadlineInMs(10000));
  ASSERT_FALSE(pid.ok()) << "an engine with the wrong secret opened the target";
  EXPECT_EQ(pid.status().code(), Code::kPermissionDenied) << pid.status().toString();
  EXPECT_LT(msSince(t0), 2000) << "a denial should not wait for the deadline";
  EXPECT_EQ(checkPattern(region_, kRegion, 1, 0), "");
}

// A query connection (HELLO role kQuery) gets the target's descriptor and nothing else: not
// without the secret, and any frame after the answer closes it.
TEST_F(TcpGarbageTest, QueryConnectionAnswersOnlyTheDescriptor) {
  {
    auto c = conn();
    std::string h = hello(*c, "not-the-job-secret-0123456789abcdef", 4242, tcp::ConnRole::kQuery);
    ASSERT_TRUE(c->sendFrame(header(FrameType::kHello, h.size()), h));
    FrameHeader r;
    std::string payload;
    ASSERT_EQ(c->readFrame(&r, &payload), 1);
    EXPECT_EQ(r.type, FrameType::kHelloDenied) << "a query without the secret was answered";
    EXPECT_TRUE(c->closedByEngine(3000));
  }
  {
    auto c = conn();
    ASSERT_TRUE(proven(*c, 4242, tcp::ConnRole::kQuery));
    FrameHeader r;
    std::string payload;
    ASSERT_EQ(c->readFrame(&r, &payload), 1);
    ASSERT_EQ(r.type, FrameType::kDesc);
    EXPECT_EQ(r.aux, target_->engineId());
    auto d = SegmentDesc::parse(payload);
    ASSERT_TRUE(d.ok()) << d.status().toString();
    EXPECT_EQ(d->engine_id, target_->engineId());
    EXPECT_EQ(d->name, "target");
    EXPECT_NE(d->findRegion(reinterpret_cast<uint64_t>(region_), kRegion), nullptr);
    // Anything after the answer is a protocol error: the engine closes the connection.
    std::string w(16, 'x');
    c->sendFrame(header(FrameType::kWrite, w.size(), reinterpret_cast<uint64_t>(region_)), w);
    EXPECT_TRUE(c->closedByEngine(3000));
  }
  EXPECT_EQ(checkPattern(region_, kRegion, 1, 0), "");
  // The engine API over the same handshake.
  EngineOptions opt;
  opt.name = "asker";
  opt.secret = "job-secret-of-this-test-0123456789ab";
  auto e = TransferEngine::create(opt);
  ASSERT_TRUE(e.ok()) << e.status().toString();
  auto d = (*e)->queryPeer(desc_.tcp_host, desc_.tcp_port, deadlineInMs(5000));
  ASSERT_TRUE(d.ok()) << d.status().toString();
  EXPECT_EQ(d->engine_id, target_->engineId());
  opt.name = "wrong";
  opt.secret = "not-the-job-secret-0123456789abcdef";
  auto bad = TransferEngine::create(opt);
  ASSERT_TRUE(bad.ok());
  auto denied = (*bad)->queryPeer(desc_.tcp_host, desc_.tcp_port, deadlineInMs(5000));
  ASSERT_FALSE(denied.ok());
  EXPECT_EQ(denied.status().code(), Code::kPermissionDenied) << denied.status().toString();
  expectServesLegitimatePeer("tcp", "after-query");
}

}  // namespace
}  // namespace mooncake::engine
