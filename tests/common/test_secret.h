// Every test binary runs as a job with a secret, as a real job does: MC_SECRET is set to a random
// value before main() when the environment has none, so the engines, rendezvous servers and peer
// processes a test starts (children inherit the environment) all present the same one.
#pragma once

#include <string>

namespace mooncake::test {

// The job secret of this test process (MC_SECRET).
const std::string& jobSecret();

}  // namespace mooncake::test
