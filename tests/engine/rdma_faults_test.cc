// rdma faults against real peer processes on the verbs emulator (tests/fakes/verbs): a CQ that
// overruns (the NIC is out of service, its work moves on), a CQ too small for another QP (the
// QP is refused instead of overrunning it), a request's own error (remote access: that request
// fails, the peer's other traffic stays on rdma and only the lane is reconnected) and memory
// registration refused by the kernel's limits (RLIMIT_MEMLOCK, unmapped memory).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <cstring>
#include <string>
#include <thread>

#include "tests/common/capabilities.h"
#include "tests/engine/rdma_fixture.h"

namespace mooncake::test {
namespace {

class RdmaFaultTest : public RdmaPeerTest {};

// mlx5_0's CQ overruns under a write (the emulator puts the CQ and its QPs in error and
// completes nothing more there): the write still completes, exactly, over mlx5_1, within the
// test's deadline (it used to hang: the poller only logged, nothing was flushed), and later
// writes go over mlx5_1 alone (mlx5_0 is out of service).
TEST_F(RdmaFaultTest, CqOverrunMovesTheNicsWorkToTheOtherNic) {
  ScopedEnv slice("MC_RDMA_SLICE_BYTES", "65536");
  ASSERT_TRUE(setUp());
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  const uint64_t overruns = nic_[0]->cqOverruns();
  nic_[0]->overrunNextCompletion();
  uint64_t a0 = 0, a1 = 0;
  MC_EXPECT_OK(write(buf, 8u << 20, 11, &a0, &a1));
  EXPECT_EQ(nic_[0]->cqOverruns(), overruns + 1) << "the emulator did not overrun the CQ";
  EXPECT_GE(a1, 4u << 20) << "mlx5_1 did not carry mlx5_0's work";
  uint64_t b0 = 0, b1 = 0;
  MC_EXPECT_OK(write(buf, 4u << 20, 12, &b0, &b1));
  EXPECT_EQ(b0, 0u) << "mlx5_0 carried bytes after its CQ failed";
  EXPECT_EQ(b1, 4u << 20) << "the write did not go over mlx5_1 (tcp?)";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// NICs whose CQs hold 100 entries and two lanes per NIC of 64 work requests each (4 KiB
// slices keep them full): the second QP on a NIC does not fit, so it is not created (it would
// overrun the CQ: the transfer used to hang); a 1 MiB write goes over the lanes that fit and no
// CQ overruns, in either process.
TEST_F(RdmaFaultTest, QpThatDoesNotFitTheCqIsRefused) {
  setFakeNicExtra(" max_cqe=100");
  ScopedEnv slice("MC_RDMA_SLICE_BYTES", "4096");
  ScopedEnv qps("MC_RDMA_QPS_PER_EP", "2");
  ASSERT_TRUE(setUp(4u << 20));
  HostBuffer buf(1u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 1u << 20));
  for (int round = 0; round < 3; ++round) {
    uint64_t b0 = 0, b1 = 0;
    MC_EXPECT_OK(write(buf, 1u << 20, 20 + round, &b0, &b1));
    EXPECT_EQ(b0 + b1, 1u << 20) << "the write did not go over the NICs";
  }
  EXPECT_EQ(nic_[0]->cqOverruns() + nic_[1]->cqOverruns(), 0u) << "a CQ overran";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// A request's own error (the NIC reports a remote access error for one slice): that request
// fails with it, naming the peer; it is not retried on mlx5_1 (which would refuse it the same
// way), mlx5_1 fails nothing, the peer's next writes go over rdma (not tcp), and mlx5_0's lane
// is reconnected at once although MC_RDMA_RETRY_MS is a minute.
TEST_F(RdmaFaultTest, RemoteAccessErrorFailsItsRequestOnly) {
  ScopedEnv retry("MC_RDMA_RETRY_MS", "60000");
  ASSERT_TRUE(setUp());
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  const uint64_t failed1 = nic_[1]->wrFailed();
  nic_[0]->failNext(1, 10);  // IBV_WC_REM_ACCESS_ERR
  uint64_t a0 = 0, a1 = 0;
  Status st = write(buf, 8u << 20, 31, &a0, &a1);
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_NE(st.message().find("remote access error"), std::string::npos) << st.toString();
  EXPECT_NE(st.message().find("peer"), std::string::npos) << st.toString();
  EXPECT_EQ(nic_[1]->wrFailed(), failed1) << "the failure spread to mlx5_1";
  uint64_t b0 = 0, b1 = 0;
  MC_EXPECT_OK(write(buf, 4u << 20, 32, &b0, &b1));
  EXPECT_EQ(b0 + b1, 4u << 20) << "the next write did not go over rdma";
  bool back = false;
  for (int i = 0; i < 30 && !back; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    MC_EXPECT_OK(write(buf, 4u << 20, 40 + i, &b0, &b1));
    back = b0 > 0;
  }
  EXPECT_TRUE(back) << "mlx5_0's lane was not reconnected within 3 s";
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

// Registration the NIC refuses fails registerMemory with the cause (it used to succeed with no
// rdma keys, and peers then got a misleading permission error): beyond RLIMIT_MEMLOCK (the
// registering thread without CAP_IPC_LOCK; tests run as root) and unmapped memory.
TEST_F(RdmaFaultTest, RegistrationTheNicRefusesFailsWithTheCause) {
  auto eng = makeEngine("rdma");
  ASSERT_NE(eng, nullptr);
  HostBuffer buf(4u << 20);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &old), 0);
  Status st;
  std::thread([&] {
    setIpcLock(false);
    rlimit lim{64 << 10, old.rlim_max};
    setrlimit(RLIMIT_MEMLOCK, &lim);
    st = eng->registerMemory(buf.data(), 4u << 20);
    setrlimit(RLIMIT_MEMLOCK, &old);
    setIpcLock(true);
  }).join();
  EXPECT_FALSE(st.ok()) << "4 MiB registered under a 64 KiB RLIMIT_MEMLOCK";
  EXPECT_NE(st.message().find("RLIMIT_MEMLOCK"), std::string::npos) << st.toString();
  EXPECT_NE(st.message().find("CAP_IPC_LOCK"), std::string::npos) << st.toString();
  if (st.ok()) MC_EXPECT_OK(eng->unregisterMemory(buf.data()));
  MC_EXPECT_OK(eng->registerMemory(buf.data(), 4u << 20));  // within the limits again
  MC_EXPECT_OK(eng->unregisterMemory(buf.data()));
  const size_t len = 1u << 20;
  void* gone = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(gone, MAP_FAILED);
  ASSERT_EQ(munmap(gone, len), 0);
  st = eng->registerMemory(gone, len);
  EXPECT_FALSE(st.ok()) << "unmapped memory registered";
  EXPECT_NE(st.message().find("not mapped"), std::string::npos) << st.toString();
  if (st.ok()) MC_EXPECT_OK(eng->unregisterMemory(gone));
}

}  // namespace
}  // namespace mooncake::test
