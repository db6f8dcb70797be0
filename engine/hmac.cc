#include "engine/hmac.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace mooncake::engine {

namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

struct Sha256 {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t block[64];
  size_t used = 0;    // bytes in `block`
  uint64_t total = 0;  // bytes hashed so far

  void compress(const uint8_t* p) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) |
             (uint32_t(p[4 * i + 2]) << 8) | uint32_t(p[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                    kRound[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
  }

  void update(std::string_view data) {
    const auto* p = reinterpret_cast<const uint8_t*>(data.data());
    size_t n = data.size();
    total += n;
    while (n > 0) {
      size_t take = std::min(n, sizeof(block) - used);
      std::memcpy(block + used, p, take);
      used += take, p += take, n -= take;
      if (used == sizeof(block)) {
        compress(block);
        used = 0;
      }
    }
  }

  std::array<uint8_t, kSha256Bytes> finish() {
    const uint64_t bits = total * 8;
    const uint8_t one = 0x80, zero = 0;
    update(std::string_view(reinterpret_cast<const char*>(&one), 1));
    while (used != 56) update(std::string_view(reinterpret_cast<const char*>(&zero), 1));
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    update(std::string_view(reinterpret_cast<const char*>(len), 8));
    std::array<uint8_t, kSha256Bytes> out;
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h[i] >> (24 - 8 * j));
    return out;
  }
};

std::string_view view(const std::array<uint8_t, kSha256Bytes>& d) {
  return std::string_view(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

std::array<uint8_t, kSha256Bytes> sha256(std::string_view data) {
  Sha256 s;
  s.update(data);
  return s.finish();
}

std::string hmacSha256(std::string_view key, std::string_view message) {
  uint8_t k[64] = {0};
  if (key.size() > sizeof(k)) {
    auto d = sha256(key);
    std::memcpy(k, d.data(), d.size());
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  uint8_t ipad[64], opad[64];
  for (int i = 0; i < 64; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad[i] = k[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.update(std::string_view(reinterpret_cast<const char*>(ipad), 64));
  inner.update(message);
  auto ih = inner.finish();
  Sha256 outer;
  outer.update(std::string_view(reinterpret_cast<const char*>(opad), 64));
  outer.update(view(ih));
  auto oh = outer.finish();
  return std::string(view(oh));
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {  // no getrandom: the device
      int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        r = ::read(fd, out.data() + got, n - got);
        ::close(fd);
      }
      if (r <= 0) std::abort();  // no randomness at all: nothing safe to do
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string secretProof(std::string_view secret, std::string_view role,
                        std::string_view challenge, std::string_view nonce,
                        std::string_view bound) {
  std::string m;
  m.reserve(role.size() + challenge.size() + nonce.size() + bound.size() + 3);
  m.append(role).push_back('\0');
  m.append(challenge).push_back('\0');
  m.append(nonce).push_back('\0');
  m.append(bound);
  return hmacSha256(secret, m);
}

}  // namespace mooncake::engine
