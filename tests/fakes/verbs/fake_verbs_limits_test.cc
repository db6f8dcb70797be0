// The emulator's limits that a NIC and the kernel enforce: a CQ that overruns (in error, its
// QPs too), ibv_resize_cq, and memory registration as the kernel pins it (RLIMIT_MEMLOCK
// unless the thread has CAP_IPC_LOCK, every page mapped with the access asked for), and QP
// creation refused or held by the refuseQps / holdQps knobs.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/common/capabilities.h"
#include "tests/fakes/verbs/fake_verbs_control.h"
#include "tests/fakes/verbs/fake_verbs_util.h"

namespace mooncake::fakeverbs::test {
namespace {

using mooncake::test::setIpcLock;

ibv_qp_state qpState(ibv_qp* qp) {
  ibv_qp_attr a{};
  ibv_qp_init_attr ia{};
  ibv_query_qp(qp, &a, IBV_QP_STATE, &ia);
  return a.qp_state;
}

bool connectPair(Endpoint& a, Endpoint& b) {
  return a.open("mlx5_0", 1 << 20) && b.open("mlx5_1", 1 << 20) && a.connect(b.address()) &&
         b.connect(a.address());
}

// More completions than the CQ holds: the CQ is in error (polls fail) and its QP goes to the
// error state, as on a NIC; the NIC's shared state counts the overrun.
TEST(FakeVerbsLimits, CqOverrunPutsTheCqAndItsQpsInError) {
  const Fabric& f = testFabric();
  NicControl nic(f.fabric, "", "mlx5_0");
  ASSERT_TRUE(nic.ok());
  const uint64_t overruns = nic.cqOverruns();
  Endpoint a, b;
  ASSERT_TRUE(connectPair(a, b));
  ASSERT_EQ(ibv_resize_cq(a.cq, 4), 0);
  EXPECT_EQ(a.cq->cqe, 4);
  Remote r;
  ASSERT_TRUE(parseAddress(b.address(), &r));
  for (int i = 0; i < 6; ++i)
    ASSERT_EQ(a.post(IBV_WR_RDMA_WRITE, 100 + i, 0, 64, r.addr, r.rkey), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (qpState(a.qp) != IBV_QPS_ERR && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(qpState(a.qp), IBV_QPS_ERR) << "a QP of an overrun CQ stays usable";
  ibv_wc wc[8];
  EXPECT_LT(ibv_poll_cq(a.cq, 8, wc), 0) << "an overrun CQ polls without an error";
  EXPECT_EQ(nic.cqOverruns(), overruns + 1);
  // The peer's QP is untouched (its CQ did not overrun).
  EXPECT_EQ(qpState(b.qp), IBV_QPS_RTS);
}

// ibv_resize_cq: not below the entries it holds, not above the device's max_cqe; the knob
// overruns a CQ that has room.
TEST(FakeVerbsLimits, ResizeAndOverrunKnob) {
  const Fabric& f = testFabric();
  Endpoint a, b;
  ASSERT_TRUE(connectPair(a, b));
  ibv_device_attr da{};
  ASSERT_EQ(ibv_query_device(a.ctx, &da), 0);
  EXPECT_EQ(ibv_resize_cq(a.cq, da.max_cqe + 1), EINVAL);
  EXPECT_EQ(ibv_resize_cq(a.cq, 0), EINVAL);
  EXPECT_EQ(ibv_resize_cq(a.cq, 8192), 0);
  NicControl nic(f.fabric, "", "mlx5_0");
  nic.overrunNextCompletion();
  Remote r;
  ASSERT_TRUE(parseAddress(b.address(), &r));
  ASSERT_EQ(a.post(IBV_WR_RDMA_WRITE, 1, 0, 64, r.addr, r.rkey), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  ibv_wc wc{};
  int n = 0;
  while ((n = ibv_poll_cq(a.cq, 1, &wc)) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_LT(n, 0) << "the knob did not overrun the CQ";
}

// The kernel pins an MR's pages: each must be mapped (EFAULT for a hole), readable (EFAULT for
// PROT_NONE) and writable when the MR is (EFAULT for a read-only mapping with LOCAL_WRITE).
TEST(FakeVerbsLimits, RegMrNeedsMappedPagesWithTheAccess) {
  testFabric();
  Endpoint a;
  ASSERT_TRUE(a.open("mlx5_0", 4096));
  const size_t len = 1 << 20;
  void* gone = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(gone, MAP_FAILED);
  ASSERT_EQ(munmap(gone, len), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(a.pd, gone, len, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT) << "unmapped memory";
  void* none = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(none, MAP_FAILED);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(a.pd, none, len, 0), nullptr);
  EXPECT_EQ(errno, EFAULT) << "PROT_NONE memory";
  ASSERT_EQ(mprotect(none, len, PROT_READ), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(a.pd, none, len, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT) << "read-only memory registered writable";
  ibv_mr* ro = ibv_reg_mr(a.pd, none, len, IBV_ACCESS_REMOTE_READ);
  EXPECT_NE(ro, nullptr) << "read-only memory for remote reads: " << strerror(errno);
  if (ro != nullptr) ibv_dereg_mr(ro);
  munmap(none, len);
}

// RLIMIT_MEMLOCK bounds the pinned pages of a process whose registering thread lacks
// CAP_IPC_LOCK (ENOMEM beyond it, EPERM when it is 0); with the capability it does not. Tests
// run as root here: the thread drops the capability from its effective set first.
TEST(FakeVerbsLimits, RegMrIsBoundByMemlockWithoutCapIpcLock) {
  testFabric();
  Endpoint a;
  ASSERT_TRUE(a.open("mlx5_0", 4096));
  const size_t big = 256u << 20;
  void* p = mmap(nullptr, big, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &old), 0);
  int e_big = 0, e_zero = 0, e_small = -1;
  bool cap_back = false, with_cap = false;
  std::thread([&] {
    setIpcLock(false);
    rlimit lim{64 << 10, old.rlim_max};
    setrlimit(RLIMIT_MEMLOCK, &lim);
    errno = 0;
    if (ibv_mr* m = ibv_reg_mr(a.pd, p, big, IBV_ACCESS_LOCAL_WRITE)) ibv_dereg_mr(m);
    e_big = errno;
    ibv_mr* small = ibv_reg_mr(a.pd, p, 16 << 10, IBV_ACCESS_LOCAL_WRITE);
    e_small = small == nullptr ? errno : 0;
    if (small != nullptr) ibv_dereg_mr(small);
    lim.rlim_cur = 0;
    setrlimit(RLIMIT_MEMLOCK, &lim);
    errno = 0;
    if (ibv_mr* m = ibv_reg_mr(a.pd, p, 4096, IBV_ACCESS_LOCAL_WRITE)) ibv_dereg_mr(m);
    e_zero = errno;
    lim.rlim_cur = 64 << 10;
    setrlimit(RLIMIT_MEMLOCK, &lim);
    cap_back = setIpcLock(true);
    if (cap_back) {
      ibv_mr* m = ibv_reg_mr(a.pd, p, big, IBV_ACCESS_LOCAL_WRITE);
      with_cap = m != nullptr;
      if (m != nullptr) ibv_dereg_mr(m);
    }
  }).join();
  setrlimit(RLIMIT_MEMLOCK, &old);
  munmap(p, big);
  EXPECT_EQ(e_big, ENOMEM) << "256 MiB pinned under a 64 KiB RLIMIT_MEMLOCK";
  EXPECT_EQ(e_small, 0) << "16 KiB is within the limit";
  EXPECT_EQ(e_zero, EPERM) << "RLIMIT_MEMLOCK 0 without CAP_IPC_LOCK";
  if (cap_back) EXPECT_TRUE(with_cap) << "CAP_IPC_LOCK is exempt from RLIMIT_MEMLOCK";
}

// INIT -> RTR -> RTS toward `remote` with the given PSNs and READ resources (Endpoint::connect
// uses 0, 0 and 16); the ibv_modify_qp error of the RTR step in *rtr.
bool connectWith(Endpoint& e, const std::string& remote, uint32_t rq_psn, uint32_t sq_psn,
                 uint8_t max_dest_rd, uint8_t sgid = 3, int* rtr = nullptr) {
  Remote r;
  if (!parseAddress(remote, &r)) return false;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = e.port.active_mtu;
  a.dest_qp_num = r.qpn;
  a.rq_psn = rq_psn;
  a.max_dest_rd_atomic = max_dest_rd;
  a.min_rnr_timer = 1;
  a.ah_attr.port_num = 1;
  a.ah_attr.is_global = 1;
  std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
  a.ah_attr.grh.sgid_index = sgid;
  a.ah_attr.grh.hop_limit = 64;
  int rc = ibv_modify_qp(e.qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                       IBV_QP_MIN_RNR_TIMER);
  if (rtr != nullptr) *rtr = rc;
  if (rc != 0) return false;
  ibv_qp_attr b{};
  b.qp_state = IBV_QPS_RTS;
  b.sq_psn = sq_psn;
  b.timeout = 4;  // 4.096 us * 2^4 * 8 tries: about 1 ms
  b.retry_cnt = 7;
  b.rnr_retry = 7;
  b.max_rd_atomic = 16;
  return ibv_modify_qp(e.qp, &b, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                     IBV_QP_MAX_QP_RD_ATOMIC) == 0;
}

// The requester's sq_psn must be the responder's rq_psn: otherwise nothing it sends is
// answered and the request fails with IBV_WC_RETRY_EXC_ERR (its bytes never land).
TEST(FakeVerbsLimits, PsnMismatchEndsInRetryExceeded) {
  testFabric();
  for (uint32_t sq : {77u, 78u}) {
    Endpoint a, b;
    ASSERT_TRUE(a.open("mlx5_0", 4096) && b.open("mlx5_1", 4096));
    ASSERT_TRUE(connectWith(a, b.address(), 0, sq, 16));
    ASSERT_TRUE(connectWith(b, a.address(), 77, 0, 16));
    Remote r;
    ASSERT_TRUE(parseAddress(b.address(), &r));
    fill(a.buf.data(), 256, 5);
    std::memset(b.buf.data(), 0, 256);
    ASSERT_EQ(a.post(IBV_WR_RDMA_WRITE, 1, 0, 256, r.addr, r.rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(a.poll(&wc, 10000));
    if (sq == 77) {
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
      EXPECT_TRUE(same(b.buf.data(), 256, 5));
    } else {
      EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
      EXPECT_EQ(b.buf[0], 0) << "a request with the wrong PSN was executed";
    }
  }
}

// A responder with max_dest_rd_atomic 0 has no READ resources: a READ is NAKed as an invalid
// request (IBV_WC_REM_INV_REQ_ERR); a WRITE goes through.
TEST(FakeVerbsLimits, ReadWithoutResponderReadResourcesIsRefused) {
  testFabric();
  Endpoint a, b;
  ASSERT_TRUE(a.open("mlx5_0", 4096) && b.open("mlx5_1", 4096));
  ASSERT_TRUE(connectWith(a, b.address(), 0, 0, 16));
  ASSERT_TRUE(connectWith(b, a.address(), 0, 0, 0));
  Remote r;
  ASSERT_TRUE(parseAddress(b.address(), &r));
  ibv_wc wc{};
  ASSERT_EQ(a.post(IBV_WR_RDMA_WRITE, 1, 0, 64, r.addr, r.rkey), 0);
  ASSERT_TRUE(a.poll(&wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  ASSERT_EQ(a.post(IBV_WR_RDMA_READ, 2, 0, 64, r.addr, r.rkey), 0);
  ASSERT_TRUE(a.poll(&wc));
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
}

// A receive whose buffer is not in a locally writable MR of the QP's PD: the SEND that lands
// on it completes the receive with IBV_WC_LOC_PROT_ERR and the sender with a NAK
// (IBV_WC_REM_OP_ERR); nothing is written into the buffer.
TEST(FakeVerbsLimits, ReceiveIntoMemoryWithoutLocalWriteIsRefused) {
  testFabric();
  for (bool bad_key : {false, true}) {
    Endpoint a, b;
    ASSERT_TRUE(a.open("mlx5_0", 4096) && b.open("mlx5_1", 4096));
    ASSERT_TRUE(a.connect(b.address()) && b.connect(a.address()));
    std::vector<char> ro(4096, 0);
    ibv_mr* mr = ibv_reg_mr(b.pd, ro.data(), ro.size(), IBV_ACCESS_REMOTE_READ);
    ASSERT_NE(mr, nullptr);
    ibv_sge sge{reinterpret_cast<uint64_t>(ro.data()), 64, bad_key ? mr->lkey + 1 : mr->lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* badwr = nullptr;
    wr.wr_id = 9;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ASSERT_EQ(ibv_post_recv(b.qp, &wr, &badwr), 0);
    fill(a.buf.data(), 64, 3);
    ASSERT_EQ(a.post(IBV_WR_SEND, 1, 0, 64, 0, 0), 0);
    ibv_wc wc{};
    ASSERT_TRUE(a.poll(&wc));
    EXPECT_EQ(wc.status, IBV_WC_REM_OP_ERR) << ibv_wc_status_str(wc.status);
    ASSERT_TRUE(b.poll(&wc));
    EXPECT_EQ(wc.wr_id, 9u);
    EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(wc.status);
    EXPECT_EQ(ro[0], 0) << "a SEND landed in memory without local write";
    ibv_dereg_mr(mr);
  }
}

// ibv_modify_qp refuses a source GID index past the port's table; ibv_create_qp refuses
// queues above the device's limits (the kernel does not clamp them).
TEST(FakeVerbsLimits, AttributesAboveTheDeviceLimitsAreRefused) {
  testFabric();
  Endpoint a, b;
  ASSERT_TRUE(a.open("mlx5_0", 4096) && b.open("mlx5_1", 4096));
  int rtr = 0;
  EXPECT_FALSE(connectWith(a, b.address(), 0, 0, 16, 4, &rtr));
  EXPECT_EQ(rtr, EINVAL) << "sgid_index 4 of a 4-entry GID table";
  ibv_qp_init_attr ia{};
  ia.send_cq = a.cq;
  ia.recv_cq = a.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 20000;
  ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  errno = 0;
  EXPECT_EQ(ibv_create_qp(a.pd, &ia), nullptr);
  EXPECT_EQ(errno, EINVAL) << "max_send_wr above max_qp_wr";
  ia.cap.max_send_wr = 16;
  ia.cap.max_inline_data = 1024;
  errno = 0;
  EXPECT_EQ(ibv_create_qp(a.pd, &ia), nullptr);
  EXPECT_EQ(errno, EINVAL) << "max_inline_data above the device's";
  ia.cap.max_inline_data = 64;
  ibv_qp* ok = ibv_create_qp(a.pd, &ia);
  ASSERT_NE(ok, nullptr);
  ibv_destroy_qp(ok);
}

// A send-queue slot stays busy until its completion is polled (as mlx5 frees it): with
// max_send_wr completed and unpolled, ibv_post_send says ENOMEM; polling one frees one.
TEST(FakeVerbsLimits, SendSlotsAreFreedWhenPolled) {
  testFabric();
  Endpoint a, b;
  ASSERT_TRUE(connectPair(a, b));
  ibv_qp_attr qa{};
  ibv_qp_init_attr ia{};
  ASSERT_EQ(ibv_query_qp(a.qp, &qa, IBV_QP_CAP, &ia), 0);
  const uint32_t slots = ia.cap.max_send_wr;
  Remote r;
  ASSERT_TRUE(parseAddress(b.address(), &r));
  for (uint32_t i = 0; i < slots; ++i)
    ASSERT_EQ(a.post(IBV_WR_RDMA_WRITE, i, 0, 8, r.addr, r.rkey), 0) << i;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // all completed, none polled
  EXPECT_EQ(a.post(IBV_WR_RDMA_WRITE, 999, 0, 8, r.addr, r.rkey), ENOMEM)
      << "a slot was free before its completion was polled";
  ibv_wc wc{};
  ASSERT_EQ(ibv_poll_cq(a.cq, 1, &wc), 1);
  EXPECT_EQ(a.post(IBV_WR_RDMA_WRITE, 1000, 0, 8, r.addr, r.rkey), 0);
}

// NicControl::refuseQps: the next n ibv_create_qp calls on that NIC fail with ENOMEM (the other
// NIC's are not counted), then they succeed again. NicControl::holdQps: a QP's move from RESET
// to INIT waits until the hold is released (counted by heldQps), then succeeds.
TEST(FakeVerbsLimits, QpCreationCanBeRefusedAndHeld) {
  const Fabric& f = testFabric();
  NicControl nic0(f.fabric, "", "mlx5_0");
  ASSERT_TRUE(nic0.ok());
  Endpoint a, b;
  ASSERT_TRUE(a.open("mlx5_0", 4096) && b.open("mlx5_1", 4096));
  auto create = [](Endpoint& e) {
    ibv_qp_init_attr ia{};
    ia.send_cq = e.cq;
    ia.recv_cq = e.cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 16;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    errno = 0;
    return ibv_create_qp(e.pd, &ia);
  };
  nic0.refuseQps(2);
  ibv_qp* other = create(b);
  EXPECT_NE(other, nullptr) << "mlx5_1 refused a QP for mlx5_0's knob";
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(create(a), nullptr) << "refusal " << i;
    EXPECT_EQ(errno, ENOMEM);
  }
  EXPECT_EQ(nic0.refuseQpsPending(), 0);
  ibv_qp* ok = create(a);
  ASSERT_NE(ok, nullptr) << "still refused after the count ran out";
  // Held on its way to INIT until released.
  const uint64_t held = nic0.heldQps();
  nic0.holdQps(true);
  std::atomic<int> done{0};
  int rc = -1;
  std::thread t([&] {
    ibv_qp_attr qa{};
    qa.qp_state = IBV_QPS_INIT;
    qa.port_num = 1;
    qa.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
    rc = ibv_modify_qp(ok, &qa, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                    IBV_QP_ACCESS_FLAGS);
    done.store(1);
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (nic0.heldQps() == held && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(nic0.heldQps(), held + 1) << "the move to INIT did not wait on the hold";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(done.load(), 0) << "ibv_modify_qp returned while held";
  nic0.holdQps(false);
  t.join();
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(qpState(ok), IBV_QPS_INIT);
  ibv_destroy_qp(ok);
  if (other != nullptr) ibv_destroy_qp(other);
}

}  // namespace
}  // namespace mooncake::fakeverbs::test
