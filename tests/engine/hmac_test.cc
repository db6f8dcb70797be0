// SHA-256 and HMAC-SHA256 (engine/hmac.h) against published vectors (FIPS 180-4's examples,
// RFC 4231) and against coreutils' sha256sum on inputs of every length around the block
// boundaries, plus the handshake proof's separation of roles and nonces.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>

#include "engine/hmac.h"

namespace mooncake::engine {
namespace {

std::string hex(std::string_view raw) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (char ch : raw) {
    auto b = static_cast<unsigned char>(ch);
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

std::string shaHex(std::string_view data) {
  auto d = sha256(data);
  return hex(std::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

// coreutils' answer for `data`, through a temporary file.
std::string sha256sum(const std::string& data) {
  char path[] = "/tmp/mc-hmac-test-XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  if (fd < 0) return "";
  EXPECT_EQ(write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  close(fd);
  std::string cmd = std::string("sha256sum ") + path;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[128] = {0};
  std::string out;
  if (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) out = std::string(buf, 64);
  if (p != nullptr) pclose(p);
  unlink(path);
  return out;
}

TEST(HmacTest, Sha256PublishedVectors) {
  EXPECT_EQ(shaHex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(shaHex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(shaHex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(shaHex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(HmacTest, Sha256AgreesWithSha256sumAroundBlockBoundaries) {
  std::mt19937 rng(7);
  for (size_t n : {1u, 31u, 55u, 56u, 57u, 63u, 64u, 65u, 119u, 120u, 127u, 128u, 129u, 1000u}) {
    std::string data(n, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    EXPECT_EQ(shaHex(data), sha256sum(data)) << n << " bytes";
  }
}

TEST(HmacTest, HmacRfc4231Vectors) {
  EXPECT_EQ(hex(hmacSha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // A key longer than the block is hashed first.
  EXPECT_EQ(hex(hmacSha256(std::string(131, '\xaa'),
                           "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(HmacTest, ProofsDependOnEveryInput) {
  const std::string c = randomBytes(32), n = randomBytes(32);
  EXPECT_NE(c, n);  // 32 fresh random bytes each
  const std::string p = secretProof("s", "role-a", c, n, "id");
  EXPECT_EQ(p.size(), kSha256Bytes);
  EXPECT_EQ(p, secretProof("s", "role-a", c, n, "id"));
  EXPECT_NE(p, secretProof("t", "role-a", c, n, "id"));
  EXPECT_NE(p, secretProof("s", "role-b", c, n, "id"));
  EXPECT_NE(p, secretProof("s", "role-a", n, c, "id"));
  EXPECT_NE(p, secretProof("s", "role-a", c, n, "ie"));
}

}  // namespace
}  // namespace mooncake::engine
