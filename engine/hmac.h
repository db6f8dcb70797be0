// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the handshakes' proofs of the job
// secret (docs/security.md, "Handshakes"): a peer proves it holds the secret by a MAC over
// both sides' fresh nonces, so the secret itself never travels. Not for bulk data.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace mooncake::engine {

constexpr size_t kSha256Bytes = 32;

std::array<uint8_t, kSha256Bytes> sha256(std::string_view data);

// HMAC-SHA256(key, message), 32 raw bytes.
std::string hmacSha256(std::string_view key, std::string_view message);

// `n` bytes from the kernel's CSPRNG (aborts when there is none).
std::string randomBytes(size_t n);

// The proof of the job secret one side of a handshake sends: HMAC-SHA256(secret, role | 0 |
// challenge | 0 | answer nonce | 0 | bound), where `role` names the protocol and the side (so
// that one side's proof is never valid as the other's), `challenge` is the target's fresh
// nonce, `nonce` the initiator's and `bound` what else the proof vouches for (identities).
std::string secretProof(std::string_view secret, std::string_view role,
                        std::string_view challenge, std::string_view nonce,
                        std::string_view bound);

}  // namespace mooncake::engine
