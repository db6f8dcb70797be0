#include "tests/common/test_secret.h"

#include <cstdlib>
#include <random>

#include "engine/params.h"

namespace mooncake::test {
namespace {

std::string makeSecret() {
  if (std::string s = params::getString("MC_SECRET"); !s.empty()) return s;
  std::random_device rd;
  std::string out;
  static const char* kHex = "0123456789abcdef";
  for (int i = 0; i < 32; ++i) out.push_back(kHex[rd() & 15]);
  setenv("MC_SECRET", out.c_str(), 1);
  return out;
}

// Before main(): before any thread exists, so setenv() is safe.
const std::string g_secret = makeSecret();

}  // namespace

const std::string& jobSecret() { return g_secret; }

}  // namespace mooncake::test
