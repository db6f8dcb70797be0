// Fuzz-style tests of the engine's decoders: SegmentDesc::parse, wire::Reader and the tcp
// HELLO payload, fed every truncation, random bytes and mutations of valid input. Inputs
// live in heap blocks of exactly their size, so (in the sanitizer build) any read past the
// end is caught by ASan. Deterministic seeds; a failure prints the input that caused it.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "engine/hmac.h"
#include "engine/segment.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_transport.h"
#include "engine/wire.h"

namespace mooncake::engine {
namespace {

constexpr uint64_t kSeed = 0x5eedf00d;

// A copy of `s` in a heap block of exactly s.size() bytes.
class Exact {
 public:
  explicit Exact(std::string_view s) : n_(s.size()), p_(new char[s.size() ? s.size() : 1]) {
    if (n_) std::memcpy(p_.get(), s.data(), n_);
  }
  std::string_view view() const { return {p_.get(), n_}; }

 private:
  size_t n_;
  std::unique_ptr<char[]> p_;
};

std::string hexPrefix(std::string_view s, size_t max = 64) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    out += d[static_cast<uint8_t>(s[i]) >> 4];
    out += d[static_cast<uint8_t>(s[i]) & 15];
  }
  if (s.size() > max) out += "...";
  return out + " (" + std::to_string(s.size()) + " bytes)";
}

SegmentDesc sampleDesc() {
  SegmentDesc d;
  d.name = "peer-\xc3\xbc-7";
  d.engine_id = 0x1122334455667788ull;
  d.host_id = "boot-id/net:[4026531992]";
  d.pid = 4242;
  d.tcp_host = "10.1.2.3";
  d.tcp_port = 40001;
  d.inbox_shm = "/mc-inbox-4242";
  d.transports = 0b1010;
  d.endpoints[static_cast<int>(TransportKind::kRdma)] = std::string("\x02nic\x00gid", 8);
  d.regions_version = 9;
  for (int i = 0; i < 3; ++i) {
    RegionDesc r;
    r.addr = 0x7f0000000000ull + i * 0x100000;
    r.len = 0x1000u << i;
    r.kind = i == 2 ? MemoryKind::kCuda : MemoryKind::kHost;
    r.device = i == 2 ? 1 : -1;
    r.shm_name = i == 0 ? "/mc-4242-0" : "";
    r.keys[static_cast<int>(TransportKind::kRdma)] = std::string("\x00\x01rkey\xff", 7);
    if (i == 2) r.keys[static_cast<int>(TransportKind::kCuda)] = std::string(64, '\x5a');
    d.regions.push_back(r);
  }
  return d;
}

void expectSameDesc(const SegmentDesc& a, const SegmentDesc& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.engine_id, b.engine_id);
  EXPECT_EQ(a.host_id, b.host_id);
  EXPECT_EQ(a.pid, b.pid);
  EXPECT_EQ(a.tcp_host, b.tcp_host);
  EXPECT_EQ(a.tcp_port, b.tcp_port);
  EXPECT_EQ(a.inbox_shm, b.inbox_shm);
  EXPECT_EQ(a.transports, b.transports);
  for (int k = 0; k < kNumTransportKinds; ++k) EXPECT_EQ(a.endpoints[k], b.endpoints[k]);
  EXPECT_EQ(a.regions_version, b.regions_version);
  ASSERT_EQ(a.regions.size(), b.regions.size());
  for (size_t i = 0; i < a.regions.size(); ++i) {
    EXPECT_EQ(a.regions[i].addr, b.regions[i].addr);
    EXPECT_EQ(a.regions[i].len, b.regions[i].len);
    EXPECT_EQ(a.regions[i].kind, b.regions[i].kind);
    EXPECT_EQ(a.regions[i].device, b.regions[i].device);
    EXPECT_EQ(a.regions[i].shm_name, b.regions[i].shm_name);
    for (int k = 0; k < kNumTransportKinds; ++k) EXPECT_EQ(a.regions[i].keys[k], b.regions[i].keys[k]);
  }
}

// What a parse of arbitrary bytes must satisfy: no crash (the call itself), and when it
// accepts, the result is a valid descriptor that serializes back to exactly the input.
::testing::AssertionResult parseIsSane(std::string_view in) {
  Exact e(in);
  auto r = SegmentDesc::parse(e.view());
  if (!r.ok()) {
    if (r.status().code() == Code::kOk) return ::testing::AssertionFailure() << "error with kOk";
    return ::testing::AssertionSuccess();
  }
  for (const auto& reg : r->regions) {
    if (reg.addr + reg.len < reg.addr)
      return ::testing::AssertionFailure() << "accepted a wrapping region from " << hexPrefix(in);
    if (reg.kind != MemoryKind::kHost && reg.kind != MemoryKind::kCuda)
      return ::testing::AssertionFailure() << "accepted an unknown memory kind";
  }
  std::string again = r->serialize();
  if (again != in)
    return ::testing::AssertionFailure() << "accepted input does not round-trip: "
                                         << hexPrefix(in);
  return ::testing::AssertionSuccess();
}

TEST(SegmentDescFuzz, RoundTrip) {
  SegmentDesc d = sampleDesc();
  std::string bytes = d.serialize();
  auto r = SegmentDesc::parse(bytes);
  ASSERT_TRUE(r.ok()) << r.status().toString();
  expectSameDesc(d, r.value());
  EXPECT_EQ(r->serialize(), bytes);
  const RegionDesc* f = r->findRegion(0x7f0000000000ull + 0x100000 + 5, 16);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->addr, 0x7f0000000000ull + 0x100000);
  EXPECT_EQ(r->findRegion(0x7f0000000000ull + 0xff8, 16), nullptr) << "straddles an end";
  EXPECT_EQ(r->findRegion(~uint64_t{0} - 3, 8), nullptr);
  EXPECT_TRUE(r->offers(TransportKind::kShm));
  EXPECT_FALSE(r->offers(TransportKind::kCuda));
  SegmentDesc empty;
  auto e = SegmentDesc::parse(empty.serialize());
  ASSERT_TRUE(e.ok()) << e.status().toString();
  EXPECT_TRUE(e->regions.empty());
}

TEST(SegmentDescFuzz, EveryTruncationRejected) {
  const std::string bytes = sampleDesc().serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    Exact e(std::string_view(bytes).substr(0, n));
    auto r = SegmentDesc::parse(e.view());
    EXPECT_FALSE(r.ok()) << "a truncation to " << n << " of " << bytes.size()
                         << " bytes was accepted";
  }
  // Trailing garbage is malformed too.
  EXPECT_FALSE(SegmentDesc::parse(bytes + "x").ok());
}

TEST(SegmentDescFuzz, RandomBytes) {
  std::mt19937_64 rng(kSeed);
  const std::string valid = sampleDesc().serialize();
  int accepted = 0;
  for (int i = 0; i < 10000; ++i) {
    size_t n = rng() % 600;
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    // Half start with a valid magic and version so the decoder goes past its first check.
    if (i % 2 == 0 && n >= 8) std::memcpy(s.data(), valid.data(), 8);
    // Some also keep a valid prefix of random length.
    if (i % 4 == 0) {
      size_t keep = std::min(n, static_cast<size_t>(rng() % valid.size()));
      std::memcpy(s.data(), valid.data(), keep);
    }
    ASSERT_TRUE(parseIsSane(s)) << "input #" << i;
    accepted += SegmentDesc::parse(s).ok();
  }
  std::printf("  %d of 10000 random inputs parsed as valid descriptors\n", accepted);
}

TEST(SegmentDescFuzz, Mutations) {
  std::mt19937_64 rng(kSeed + 1);
  const std::string valid = sampleDesc().serialize();
  // Every position set to each interesting value (lengths and counts become 0, huge, ...).
  for (size_t pos = 0; pos < valid.size(); ++pos) {
    for (uint8_t v : {0x00, 0xff, 0x80, 0x7f, 0x01}) {
      std::string s = valid;
      s[pos] = static_cast<char>(v);
      ASSERT_TRUE(parseIsSane(s)) << "byte " << pos << " := " << int(v);
    }
    std::string s = valid;
    s[pos] ^= 1;
    ASSERT_TRUE(parseIsSane(s)) << "byte " << pos << " ^= 1";
    // Deleted and inserted bytes shift every later field.
    ASSERT_TRUE(parseIsSane(valid.substr(0, pos) + valid.substr(pos + 1))) << "delete " << pos;
    ASSERT_TRUE(parseIsSane(valid.substr(0, pos) + '\xff' + valid.substr(pos)))
        << "insert at " << pos;
  }
  // Random multi-byte mutations, including whole 32-bit fields set to extreme values.
  for (int i = 0; i < 10000; ++i) {
    std::string s = valid;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      size_t pos = rng() % s.size();
      if (rng() % 3 == 0 && pos + 4 <= s.size()) {
        uint32_t v = rng() % 2 ? 0xffffffffu : static_cast<uint32_t>(rng());
        std::memcpy(&s[pos], &v, 4);
      } else {
        s[pos] = static_cast<char>(rng());
      }
    }
    ASSERT_TRUE(parseIsSane(s)) << "mutation #" << i;
  }
}

// Random operation sequences over random inputs: the reader never hands out more bytes than
// it was given, fails for good on the first short read, and then returns zeros.
TEST(WireReaderFuzz, NeverReadsOutOfBounds) {
  std::mt19937_64 rng(kSeed + 2);
  for (int iter = 0; iter < 20000; ++iter) {
    size_t n = rng() % 80;
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    // Make plausible small string lengths appear often.
    if (n >= 4 && rng() % 2) {
      uint32_t len = static_cast<uint32_t>(rng() % 40);
      std::memcpy(s.data(), &len, 4);
    }
    Exact e(s);
    wire::Reader r(e.view());
    size_t consumed = 0;
    bool failed = false;
    for (int op = 0; op < 12; ++op) {
      size_t before = r.remaining();
      bool ok_before = r.ok();
      uint64_t got = 0;
      size_t want = 0;
      switch (rng() % 7) {
        case 0: got = r.u8(); want = 1; break;
        case 1: got = r.u16(); want = 2; break;
        case 2: got = r.u32(); want = 4; break;
        case 3: got = r.u64(); want = 8; break;
        case 4: got = static_cast<uint32_t>(r.i32()); want = 4; break;
        case 5: {
          std::string str = r.str(static_cast<uint32_t>(rng() % 64));
          got = str.size();
          want = 4 + str.size();
          if (!r.ok()) want = 0;
          break;
        }
        default: {
          char buf[16];
          size_t k = rng() % sizeof(buf);
          std::memset(buf, 0x55, sizeof(buf));
          r.raw(buf, k);
          want = k;
          if (!r.ok()) {
            for (size_t j = 0; j < k; ++j) ASSERT_EQ(buf[j], 0) << "failed raw() must zero";
          }
          break;
        }
      }
      ASSERT_LE(r.remaining(), before) << "remaining grew";
      if (!r.ok()) {
        if (failed || !ok_before) {
          ASSERT_EQ(got, 0u) << "a failed reader returned data";
        }
        failed = true;
      } else {
        ASSERT_TRUE(ok_before) << "a failed reader recovered";
        consumed += want;
        ASSERT_EQ(before - r.remaining(), want);
      }
      ASSERT_LE(consumed, n);
    }
    ASSERT_EQ(r.done(), r.ok() && r.remaining() == 0);
  }
}

TEST(WireReaderFuzz, StringLengthLimits) {
  wire::Writer w;
  w.str(std::string(100, 'a'));
  std::string s = w.take();
  EXPECT_EQ(wire::Reader(s).str(100).size(), 100u);
  wire::Reader r1(s);
  EXPECT_EQ(r1.str(99), "");
  EXPECT_FALSE(r1.ok()) << "longer than max_len is malformed";
  // A length field larger than what follows.
  std::string huge("\xff\xff\xff\x7f" "abc", 7);
  wire::Reader r2(huge);
  EXPECT_EQ(r2.str(~0u), "");
  EXPECT_FALSE(r2.ok());
  EXPECT_EQ(r2.u64(), 0u);
}

TEST(TcpHelloFuzz, TruncatedAndRandomPayloads) {
  tcp::Hello h;
  h.nonce = std::string(tcp::kNonceBytes, 'n');
  h.proof = std::string(kSha256Bytes, 'p');
  h.engine_id = 77;
  h.role = tcp::ConnRole::kData;
  h.link = 0x1234567890abcdefull;
  h.index = 3;
  const std::string valid = tcp::encodeHello(h);
  tcp::Hello out;
  ASSERT_TRUE(tcp::decodeHello(valid, &out));
  EXPECT_EQ(out.nonce, h.nonce);
  EXPECT_EQ(out.proof, h.proof);
  EXPECT_EQ(out.engine_id, 77u);
  EXPECT_EQ(out.role, tcp::ConnRole::kData);
  EXPECT_EQ(out.link, h.link);
  EXPECT_EQ(out.index, 3u);
  // A data connection is index 1..kMaxDataConns of its link, the control connection 0.
  for (uint32_t bad : {0u, static_cast<uint32_t>(tcp::kMaxDataConns) + 1}) {
    tcp::Hello b = h;
    b.index = bad;
    EXPECT_FALSE(tcp::decodeHello(tcp::encodeHello(b), &out)) << "data index " << bad;
  }
  tcp::Hello ctl = h;
  ctl.role = tcp::ConnRole::kControl;
  ctl.index = 1;
  EXPECT_FALSE(tcp::decodeHello(tcp::encodeHello(ctl), &out)) << "control index 1";
  // The nonce and the proof have their exact sizes (an empty proof is no proof).
  for (auto [nonce, proof] : {std::pair<size_t, size_t>{tcp::kNonceBytes - 1, kSha256Bytes},
                              {tcp::kNonceBytes, kSha256Bytes - 1},
                              {tcp::kNonceBytes, 0},
                              {0, kSha256Bytes}}) {
    tcp::Hello b = h;
    b.nonce.resize(nonce);
    b.proof.resize(proof);
    EXPECT_FALSE(tcp::decodeHello(tcp::encodeHello(b), &out)) << nonce << "/" << proof;
  }
  for (size_t n = 0; n < valid.size(); ++n) {
    Exact e(std::string_view(valid).substr(0, n));
    EXPECT_FALSE(tcp::decodeHello(e.view(), &out)) << "truncated to " << n;
  }
  std::mt19937_64 rng(kSeed + 3);
  for (int i = 0; i < 10000; ++i) {
    std::string s = valid;
    if (i % 2) {
      s.resize(rng() % 200);
      for (auto& c : s) c = static_cast<char>(rng());
    } else {
      for (int k = 0; k < 3; ++k) s[rng() % s.size()] = static_cast<char>(rng());
    }
    Exact e(s);
    tcp::decodeHello(e.view(), &out);  // must simply not crash or over-read
  }
  // Header encode/decode is a bijection on its fields.
  tcp::FrameHeader fh;
  fh.type = tcp::FrameType::kReadResp;
  fh.status = static_cast<uint16_t>(Code::kPermissionDenied);
  fh.req_id = 1;
  fh.addr = ~uint64_t{0};
  fh.length = 1ull << 40;
  fh.aux = 0x0102030405060708ull;
  uint8_t buf[tcp::kHeaderBytes];
  tcp::encodeHeader(fh, buf);
  tcp::FrameHeader back = tcp::decodeHeader(buf);
  EXPECT_EQ(back.magic, tcp::kFrameMagic);
  EXPECT_EQ(back.type, fh.type);
  EXPECT_EQ(back.status, fh.status);
  EXPECT_EQ(back.req_id, fh.req_id);
  EXPECT_EQ(back.addr, fh.addr);
  EXPECT_EQ(back.length, fh.length);
  EXPECT_EQ(back.aux, fh.aux);
  EXPECT_TRUE(secretsEqual("abc", "abc"));
  EXPECT_FALSE(secretsEqual("abc", "abd"));
  EXPECT_FALSE(secretsEqual("", "a"));
  EXPECT_FALSE(secretsEqual(std::string_view("abc\0", 4), "abc"));
}

}  // namespace
}  // namespace mooncake::engine
