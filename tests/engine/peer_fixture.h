// gtest fixture for tests that run real peer processes: a TCP rendezvous on 127.0.0.1 (port
// 0), the parent's client of it, engine construction with a forced transport, and peers that
// are shut down (and checked to have exited cleanly) after every test.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "mooncake/config.h"
#include "tests/engine/peer_process.h"
#include "tests/engine/test_util.h"

// The transports the engine's parameterised suites run over: rdma (over the verbs emulator,
// tests/fakes/verbs, which ctest puts in LD_LIBRARY_PATH) where the build has it.
#if MC_HAVE_RDMA
#define MC_TEST_TRANSPORTS ::testing::Values("shm", "tcp", "rdma")
#else
#define MC_TEST_TRANSPORTS ::testing::Values("shm", "tcp")
#endif

namespace mooncake::test {

using engine::PeerId;
using engine::TransferEngine;
using engine::TransferRequest;
using engine::OpCode;

// Aligned host buffer owned by a test (for registerMemory or as unregistered local memory).
struct HostBuffer {
  explicit HostBuffer(size_t n);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  uint8_t* data() { return p; }
  uint8_t* p = nullptr;
  size_t size = 0;
};

class PeerTestBase : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  uint16_t rdvPort() const;
  engine::Rendezvous& rdv() { return *rdv_; }

  // An engine for this (parent) process. Fails the test and returns nullptr on error.
  std::unique_ptr<TransferEngine> makeEngine(const std::string& transport,
                                             const std::string& name = "parent",
                                             const std::string& secret = "job-secret-of-this-test-0123456789ab");
  // Starts a peer process; fails the test and returns nullptr when it does not come up.
  PeerProcess* spawnPeer(const PeerConfig& cfg);
  // Opens a started peer through the rendezvous (deadline 10 s); kInvalidPeer on failure.
  PeerId openPeer(TransferEngine& eng, const std::string& name);
  // The verbs emulator's fabric of this test (transport "rdma"; empty before first use).
  const std::string& fakeVerbsFabric() const { return fv_fabric_; }
  // Appended to each emulated NIC's config line (" key=value"); set before the first engine.
  void setFakeNicExtra(const std::string& extra) { fv_device_extra_ = extra; }
  // The emulated NICs are InfiniBand (addressed by LID) instead of RoCE (before any engine).
  // The emulator reads its config once per process: false when an earlier test of this
  // process already had it read the RoCE one (ctest runs every case in a process of its own).
  bool setFakeNicsInfiniBand();
  // The peer will be killed by the test: TearDown does not require a clean exit.
  void markKilled(PeerProcess* p) { killed_.push_back(p); }

  static Status transfer(TransferEngine& eng, OpCode op, void* local, uint64_t len, PeerId peer,
                         uint64_t remote, int timeout_ms = 20000);

 private:
  std::unique_ptr<engine::TcpRendezvousServer> server_;
  std::unique_ptr<engine::TcpRendezvousClient> rdv_;
  std::vector<std::unique_ptr<PeerProcess>> peers_;
  std::vector<PeerProcess*> killed_;
  std::string shm_prefix_;
  // transport "rdma": the emulator's config file and fabric (set up on first use).
  void prepareTransport(const std::string& transport);
  std::string fv_config_;
  std::string fv_device_extra_;
  bool fv_ib_ = false;
  std::string fv_fabric_;
};

}  // namespace mooncake::test
