// main() of the test binaries that run peer processes: the same executable is the peer when
// started with the peer flag (see peer_process.h), and the gtest runner otherwise.
#include <gtest/gtest.h>

#include "tests/engine/peer_process.h"

int main(int argc, char** argv) {
  int rc = 0;
  if (mooncake::test::maybeRunPeer(argc, argv, &rc)) return rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
