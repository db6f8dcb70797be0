// Job secrets: where a component gets the secret its peers must present, and how it is checked.
//
// There is always a secret (docs/security.md): a torch group generates one on its first rank and
// shares it through the group's c10d store (torch_ext); the store master and its clients read a
// file (MC_SECRET_FILE, default ~/.mooncake/secret, created by the master when missing); MC_SECRET
// overrides both. Running without one takes MC_ALLOW_NO_SECRET=1.
#pragma once

#include <string>
#include <string_view>

#include "engine/status.h"

namespace mooncake::engine {

constexpr size_t kMaxSecretBytes = 1024;
// A handshake shows whoever takes part in it (or reads the traffic) an HMAC of the secret, so a
// guessable secret can be found offline. 32 characters: 128 bits as hex (`openssl rand -hex 16`).
constexpr size_t kMinSecretBytes = 32;

// 32 bytes from the kernel's CSPRNG, as 64 hex characters.
std::string generateSecret();

// ~/.mooncake/secret ($HOME, else the passwd entry of this user).
std::string defaultSecretFilePath();

// Reads the secret from the first line of `path`. The file must belong to this user and allow
// no access to group or others (as ssh does with keys). create: a missing file (and a missing
// directory, mode 0700) is created with a fresh secret, mode 0600, atomically (two processes
// creating it at once end up with the same secret).
Result<std::string> loadSecretFile(const std::string& path, bool create);

enum class SecretFile {
  kIfSet,          // read MC_SECRET_FILE only when it is set (engines, torch groups)
  kDefault,        // MC_SECRET_FILE, else the default file; fail when it is missing (clients)
  kDefaultCreate,  // the same, creating the file when it is missing (the store master)
};

// The secret to use: `given` when non-empty, else MC_SECRET, else the file as `file` says; ""
// when none applies. Errors: a file that cannot be read, is unsafe, or is empty.
Result<std::string> resolveSecret(const std::string& given, SecretFile file);

// OK for a usable secret. An empty one is refused (naming `who` and the ways to set one) unless
// MC_ALLOW_NO_SECRET=1; one shorter than kMinSecretBytes or longer than kMaxSecretBytes is
// refused.
Status checkSecret(const std::string& secret, const std::string& who);

// Equal-time comparison (the time does not depend on where the strings differ).
bool secretsEqual(std::string_view a, std::string_view b);

}  // namespace mooncake::engine
