// The fixture of the rdma engine tests (rdma_test.cc, rdma_faults_test.cc): a real peer
// process and an engine of this process connected to it over rdma on the verbs emulator
// (tests/fakes/verbs), whose two NICs (mlx5_0, mlx5_1) both share, with their controls.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "tests/engine/peer_fixture.h"
#include "tests/engine/test_util.h"
#include "tests/fakes/verbs/fake_verbs_control.h"

namespace mooncake::test {

class RdmaPeerTest : public PeerTestBase {
 protected:
  void TearDown() override {
    eng_.reset();  // before the base checks that destroyed engines left nothing behind
    PeerTestBase::TearDown();
  }
  // A peer, an engine of this process connected to it over rdma, and both NICs' controls;
  // `before_connect` (when set) runs once the controls are open, before the engine connects.
  bool setUp(uint64_t region_bytes = 16u << 20,
             const std::function<void()>& before_connect = nullptr) {
    PeerConfig cfg;
    cfg.transport = "rdma";
    cfg.region_bytes = region_bytes;
    peer_ = spawnPeer(cfg);
    if (peer_ == nullptr) return false;
    eng_ = makeEngine("rdma");
    if (eng_ == nullptr) return false;
    if (!openNicControls()) return false;
    if (before_connect) before_connect();
    pid_ = openPeer(*eng_, "peer");
    if (pid_ == engine::kInvalidPeer) return false;
    EXPECT_EQ(eng_->peerTransport(pid_), "rdma");
    return true;
  }
  // Writes [buf, buf+len) to the peer's allocated region at `off`, checks it succeeded and the
  // bytes arrived; returns the bytes each NIC sent meanwhile.
  std::pair<uint64_t, uint64_t> writeAndCount(HostBuffer& buf, uint64_t len, uint64_t seed,
                                              uint64_t off = 0) {
    uint64_t b0 = 0, b1 = 0;
    Status st = write(buf, len, seed, &b0, &b1, off);
    EXPECT_TRUE(st.ok()) << st.toString();
    return {b0, b1};
  }

  // The controls of both emulated NICs (the fabric exists once an engine was made).
  bool openNicControls() {
    for (int i = 0; i < 2; ++i) {
      nic_[i] = std::make_unique<fakeverbs::NicControl>(fakeVerbsFabric(), "",
                                                        "mlx5_" + std::to_string(i));
      if (!nic_[i]->ok()) return false;
    }
    return true;
  }
  // Writes 4 MiB every 100 ms (5 s at most) until NIC `nic` (-1: either) carries bytes again;
  // the bytes it carried in the write that saw it back (0: never).
  uint64_t waitForNic(HostBuffer& buf, int nic, uint64_t seed) {
    for (int i = 0; i < 50; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      auto [b0, b1] = writeAndCount(buf, 4u << 20, seed + i);
      const uint64_t got = nic == 0 ? b0 : nic == 1 ? b1 : b0 + b1;
      if (got > 0) return got;
    }
    return 0;
  }
  // Writes `len` bytes of pattern(seed) to the peer's allocated region at `off`; the status,
  // and the bytes each NIC sent meanwhile. The bytes are checked when it succeeded.
  Status write(HostBuffer& buf, uint64_t len, uint64_t seed, uint64_t* b0, uint64_t* b1,
               uint64_t off = 0) {
    fillPattern(buf.data(), len, seed, 0);
    const uint64_t tx0 = nic_[0]->txBytes(), tx1 = nic_[1]->txBytes();
    const uint64_t remote = peer_->info().alloc_addr + off;
    Status st = transfer(*eng_, OpCode::kWrite, buf.data(), len, pid_, remote);
    if (st.ok()) {
      EXPECT_EQ(peer_->expect(remote, len, seed, 0), "");
    }
    *b0 = nic_[0]->txBytes() - tx0;
    *b1 = nic_[1]->txBytes() - tx1;
    return st;
  }
  // How many times the peer's (simulated) device flushed GPUDirect writes; -1 if it cannot say.
  int64_t peerGpuFlushes() {
    const std::string r = peer_->call("gpu_flushes", 10000);
    return r.rfind("ok ", 0) == 0 ? std::strtoll(r.c_str() + 3, nullptr, 10) : -1;
  }

  // Asks `p` to check `count` notifications from this engine (tests/engine/peer_main.cc).
  bool startNotifyCheck(PeerProcess* p, int count, uint64_t remote, uint64_t tag_base,
                        uint64_t seed, int timeout_ms) {
    return p->send("notify_check " + std::to_string(count) + " " + std::to_string(remote) + " " +
                   std::to_string(tag_base) + " " + std::to_string(seed) + " " +
                   std::to_string(eng_->engineId()) + " " + std::to_string(timeout_ms));
  }

  PeerProcess* peer_ = nullptr;
  std::unique_ptr<TransferEngine> eng_;
  PeerId pid_ = engine::kInvalidPeer;
  std::unique_ptr<fakeverbs::NicControl> nic_[2];
};

}  // namespace mooncake::test
