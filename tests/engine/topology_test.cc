// Topology (engine/topology.h) on the hwloc XML fixtures of tests/data/topology (made by
// make_fixtures.py there: the expected placements below are the ones that script builds).
#include "engine/topology.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "mooncake/config.h"

namespace mooncake::engine {
namespace {

std::string fixture(const std::string& name) {
  return std::string(MC_TEST_DATA_DIR) + "/topology/" + name;
}

// PCI address of an OS device, as make_fixtures.py places it (bus = 0x10 + 0x40 * socket +
// 8 * switch + 3 for a NIC, + 4 for a GPU).
std::string bus(int socket, int sw, int plus) {
  char b[32];
  snprintf(b, sizeof(b), "0000:%02x:00.0", 0x10 + 0x40 * socket + 8 * sw + plus);
  return b;
}

#if MC_HAVE_HWLOC

TEST(Topology, Dgx8NicPerSwitch) {
  auto t = Topology::fromXml(fixture("dgx8.xml"));
  ASSERT_TRUE(t.ok()) << t.status().toString();
  const Topology& topo = **t;
  std::vector<std::string> nics;
  for (int k = 0; k < 8; ++k) {
    nics.push_back(topo.pciOf("mlx5_" + std::to_string(k)));
    EXPECT_EQ(nics.back(), bus(k / 4, k % 4, 3)) << "mlx5_" << k;
    EXPECT_EQ(topo.numaOf(nics.back()), k / 4);
  }
  for (int g = 0; g < 8; ++g) {
    MemLocation gpu;
    gpu.pci = topo.pciOf("cuda" + std::to_string(g));
    ASSERT_EQ(gpu.pci, bus(g / 4, g % 4, 4));
    // The NIC on the GPU's switch, and only it.
    EXPECT_EQ(topo.nearest(nics, gpu), std::vector<int>{g}) << "cuda" << g;
    for (int k = 0; k < 8; ++k) {
      Topology::Distance want = k == g ? Topology::kSwitch
                                : k / 4 == g / 4 ? Topology::kNuma
                                                 : Topology::kFar;
      EXPECT_EQ(topo.distance(nics[k], gpu), want) << "cuda" << g << " mlx5_" << k;
    }
  }
  // Host memory: the socket's four NICs.
  MemLocation n1;
  n1.numa = 1;
  EXPECT_EQ(topo.nearest(nics, n1), (std::vector<int>{4, 5, 6, 7}));
  // Unknown location: every NIC.
  EXPECT_EQ(topo.nearest(nics, MemLocation::any()).size(), 8u);
  // Subsets keep their order (indices into the list given).
  std::vector<std::string> two{nics[6], nics[1]};
  MemLocation g1;
  g1.pci = topo.pciOf("cuda1");
  EXPECT_EQ(topo.nearest(two, g1), std::vector<int>{1});
}

TEST(Topology, TwoSocketsTwoNics) {
  auto t = Topology::fromXml(fixture("2socket.xml"));
  ASSERT_TRUE(t.ok()) << t.status().toString();
  const Topology& topo = **t;
  std::vector<std::string> nics{topo.pciOf("mlx5_0"), topo.pciOf("mlx5_1")};
  EXPECT_EQ(nics[0], bus(0, 0, 3));
  EXPECT_EQ(nics[1], bus(1, 0, 3));
  for (int s = 0; s < 2; ++s) {
    MemLocation m;
    m.numa = s;
    EXPECT_EQ(topo.nearest(nics, m), std::vector<int>{s});
    EXPECT_EQ(topo.distance(nics[s], m), Topology::kNuma);
    EXPECT_EQ(topo.distance(nics[1 - s], m), Topology::kFar);
  }
  // No GPU here: a GPU location is unknown, so both NICs.
  MemLocation gpu;
  gpu.pci = "0000:99:00.0";
  EXPECT_EQ(topo.distance(nics[0], gpu), Topology::kUnknown);
  EXPECT_EQ(topo.nearest(nics, gpu), (std::vector<int>{0, 1}));
  // A NIC the topology does not have (another machine's address) ranks unknown, not near.
  MemLocation m0;
  m0.numa = 0;
  EXPECT_EQ(topo.nearest({"0000:77:00.0", nics[1], nics[0]}, m0), std::vector<int>{2});
}

TEST(Topology, NoNic) {
  auto t = Topology::fromXml(fixture("nonic.xml"));
  ASSERT_TRUE(t.ok()) << t.status().toString();
  const Topology& topo = **t;
  EXPECT_EQ(topo.pciOf("mlx5_0"), "");
  EXPECT_EQ(topo.pciOf("sda"), "0000:01:00.0");
  MemLocation m0;
  m0.numa = 0;
  // NICs the topology does not place (an emulator's, say) are all equally near.
  std::vector<std::string> nics{bus(0, 0, 3), bus(1, 0, 3)};
  EXPECT_EQ(topo.distance(nics[0], m0), Topology::kUnknown);
  EXPECT_EQ(topo.nearest(nics, m0), (std::vector<int>{0, 1}));
}

TEST(Topology, BadFileIsAnError) {
  auto t = Topology::fromXml(fixture("no-such-file.xml"));
  EXPECT_FALSE(t.ok());
}

TEST(Topology, ProbesThisMachine) {
  auto t = Topology::probe();
  ASSERT_TRUE(t.ok()) << t.status().toString();
  EXPECT_TRUE((*t)->known());
  EXPECT_EQ((*t)->pciOf("no-such-device"), "");
  // Touched memory of this process is on one of the machine's NUMA nodes (or unknown where
  // the kernel does not say).
  std::vector<char> buf(1 << 20, 1);
  int n = (*t)->numaOfMemory(buf.data(), buf.size());
  EXPECT_GE(n, -1);
  EXPECT_LT(n, 1024);
}

#else

TEST(Topology, WithoutHwlocNothingIsKnown) {
  EXPECT_FALSE(Topology::fromXml(fixture("dgx8.xml")).ok());
  EXPECT_EQ(Topology::empty()->nearest({bus(0, 0, 3), bus(1, 0, 3)}, MemLocation{0, ""}).size(),
            2u);
}

#endif

}  // namespace
}  // namespace mooncake::engine
