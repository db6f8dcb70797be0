// rdma faults against real peer processes on the verbs emulator (tests/fakes/verbs): a CQ that
// overruns (the NIC is out of service, its work moves on), a CQ too small for another QP (the
// QP is refused instead of overrunning it), a request's own error (remote access: that request
// fails, the peer's other traffic stays on rdma and only the lane is reconnected) and memory
// registration refused by the kernel's limits (RLIMIT_MEMLOCK, unmapped memory).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/capabilities.h"
#include "tests/engine/rdma_fixture.h"

namespace mooncake::test {
namespace {

class RdmaFaultTest : public RdmaPeerTest {
 public:
  // For helpers shared by several tests.
  bool setUpPeer() { return setUp(); }
  TransferEngine* engine() { return eng_.get(); }
  PeerProcess* peer() { return peer_; }
  PeerId pid() const { return pid_; }
  fakeverbs::NicControl* nic(int i) { return nic_[i].get(); }
  bool checkNotifications(int count, uint64_t remote, uint64_t tag_base, uint64_t seed,
                          int timeout_ms) {
    return startNotifyCheck(peer_, count, remote, tag_base, seed, timeout_ms);
  }
};

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

// One NIC (one lane to the peer), MC_RDMA_TCP_FALLBACK `fallback`, 64 KiB slices: request A's
// first slice fails with a remote access error (its own error) while request B of the same
// batch waits behind A on the same QP. A fails with that error; B is not failed (it used to
// fail, blamed for A's error, with no other lane and the fallback off) and does not go over
// tcp (it used to with the fallback on: GPU memory would fail there): it waits for the lane's
// immediate redial and goes over mlx5_0, every byte in place. A's other slices are not carried
// (they used to be rerouted and executed): mlx5_0 sends about B's 4 MiB, not 8.
void ownErrorOnTheOnlyLane(RdmaFaultTest* t, const char* fallback) {
  ScopedEnv devs("MC_RDMA_DEVICES", "mlx5_0");
  ScopedEnv fb("MC_RDMA_TCP_FALLBACK", fallback);
  ScopedEnv slice("MC_RDMA_SLICE_BYTES", "65536");
  ScopedEnv retry("MC_RDMA_RETRY_MS", "60000");
  ASSERT_TRUE(t->setUpPeer());
  auto& eng = *t->engine();
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng.registerMemory(buf.data(), 8u << 20));
  fillPattern(buf.data(), 8u << 20, 77, 0);
  const uint64_t remote = t->peer()->info().alloc_addr;
  const uint64_t tx0 = t->nic(0)->txBytes();
  t->nic(0)->failNext(1, 10);  // IBV_WC_REM_ACCESS_ERR
  auto id = eng.submit({{OpCode::kWrite, buf.data(), 4u << 20, t->pid(), remote},
                        {OpCode::kWrite, buf.data() + (4u << 20), 4u << 20, t->pid(),
                         remote + (4u << 20)}});
  ASSERT_TRUE(id.ok()) << id.status().toString();
  std::vector<Status> per;
  (void)eng.wait(*id, engine::deadlineInMs(20000), &per);
  const uint64_t sent = t->nic(0)->txBytes() - tx0;
  ASSERT_EQ(per.size(), 2u);
  EXPECT_EQ(per[0].code(), Code::kPermissionDenied) << per[0].toString();
  EXPECT_NE(per[0].message().find("remote access error"), std::string::npos) << per[0].toString();
  MC_EXPECT_OK(per[1]);
  EXPECT_EQ(t->peer()->expect(remote + (4u << 20), 4u << 20, 77, 4u << 20), "");
  EXPECT_GE(sent, 4u << 20) << "B did not go over mlx5_0 (tcp?)";
  EXPECT_LT(sent, 5u << 20) << "A's other slices were carried after A failed";
  MC_EXPECT_OK(eng.unregisterMemory(buf.data()));
}

TEST_F(RdmaFaultTest, OwnErrorOnTheOnlyLaneFailsOnlyItsRequest) {
  ownErrorOnTheOnlyLane(this, "0");
}

TEST_F(RdmaFaultTest, OwnErrorOnTheOnlyLaneKeepsTheOthersOffTcp) {
  ownErrorOnTheOnlyLane(this, "1");
}

// A notification part that completes with an error the emulator reports as a request's own
// (a remote access error on its SEND) is not a request: it is carried by the other NIC, and
// the peer gets the notification after the write (it used to be dropped, "notification lost",
// and the peer waited for it for ever).
TEST_F(RdmaFaultTest, NotificationPartWithARemoteAccessErrorIsCarriedElsewhere) {
  constexpr uint64_t kTag = 0x7e57000000000001ull, kSeed = 5100;
  ASSERT_TRUE(setUp(notifyBytes(1) + 8));
  const uint64_t remote = peer_->info().alloc_addr;
  ASSERT_TRUE(startNotifyCheck(peer_, 1, remote, kTag, kSeed, 10000));
  HostBuffer local(notifyBytes(1));
  MC_ASSERT_OK(eng_->registerMemory(local.data(), notifyBytes(1)));
  const Slot s = notifySlot(0);
  fillPattern(local.data() + s.offset, s.len, kSeed, 0);
  const uint64_t tx0 = nic_[0]->txBytes();
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, local.data() + s.offset, s.len, pid_,
                        remote + s.offset));
  // The part goes on the lane that carried the write.
  const int lane_nic = nic_[0]->txBytes() > tx0 ? 0 : 1;
  const uint64_t failed = nic_[lane_nic]->wrFailed();
  nic_[lane_nic]->failNext(1, 10);  // IBV_WC_REM_ACCESS_ERR
  MC_ASSERT_OK(eng_->notify(pid_, kTag));
  std::string reply, why;
  ASSERT_TRUE(peer_->recv(&reply, 20000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  EXPECT_EQ(nic_[lane_nic]->wrFailed(), failed + 1) << "the part did not fail: not exercised";
  MC_EXPECT_OK(eng_->unregisterMemory(local.data()));
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

// One NIC refuses a registration (its MR resources exhausted; the emulator's
// refuseRegistrations) while the other takes it: registerMemory succeeds (it failed outright
// after the first review's change) with "-" for that NIC, and writes and reads of the region
// move every byte (mlx5_1's share through the bounce pool).
TEST_F(RdmaFaultTest, RegistrationOneNicRefusesUsesTheOthers) {
  ASSERT_TRUE(setUp());
  HostBuffer buf(4u << 20), back(4u << 20);
  nic_[0]->refuseRegistrations(1);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 4u << 20));
  uint64_t b0 = 0, b1 = 0;
  MC_EXPECT_OK(write(buf, 4u << 20, 61, &b0, &b1));
  EXPECT_EQ(b0 + b1, 4u << 20) << "the write did not go over the NICs";
  MC_ASSERT_OK(eng_->registerMemory(back.data(), 4u << 20));
  MC_EXPECT_OK(transfer(*eng_, OpCode::kRead, back.data(), 4u << 20, pid_,
                        peer_->info().alloc_addr));
  EXPECT_EQ(checkPattern(back.data(), 4u << 20, 61, 0), "");
  MC_EXPECT_OK(eng_->unregisterMemory(back.data()));
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
  // Both refuse: it fails, naming the cause.
  nic_[0]->refuseRegistrations(1);
  nic_[1]->refuseRegistrations(1);
  Status st = eng_->registerMemory(buf.data(), 4u << 20);
  EXPECT_FALSE(st.ok()) << "registered although every NIC refused";
  EXPECT_NE(st.message().find("Cannot allocate memory"), std::string::npos) << st.toString();
  if (st.ok()) MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
  nic_[0]->refuseRegistrations(0);
  nic_[1]->refuseRegistrations(0);
}

// A write into the peer's GPU memory over mlx5_0 (the only NIC), then the port goes down: the
// notification's part goes over the tcp fallback, and the peer still flushes the NIC's
// GPUDirect writes before delivering it (skipping the flush for notifications that came
// wholly over tcp let a kernel read rows the NIC had written but not flushed).
TEST_F(RdmaFaultTest, TcpNotificationAfterANicWriteIntoGpuIsFlushed) {
  ScopedEnv dev("MC_DEVICE", "sim");
  ScopedEnv devs("MC_RDMA_DEVICES", "mlx5_0");
  ScopedEnv fb("MC_RDMA_TCP_FALLBACK", "1");
  ScopedEnv retry("MC_RDMA_RETRY_MS", "600000");
  ASSERT_TRUE(setUp(4u << 20));
  const std::string r = peer_->call("alloc_gpu " + std::to_string(1u << 20) + " 610 1");
  ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
  const uint64_t remote_gpu = std::strtoull(r.c_str() + 3, nullptr, 10);
  ASSERT_EQ(openPeer(*eng_, "peer"), pid_);  // its new descriptor
  HostBuffer host(notifyBytes(1));
  MC_ASSERT_OK(eng_->registerMemory(host.data(), notifyBytes(1)));
  const int64_t f0 = peerGpuFlushes();
  ASSERT_GE(f0, 0);
  ASSERT_TRUE(startNotifyCheck(peer_, 1, remote_gpu, 9100, 611, 30000));
  const Slot s = notifySlot(0);
  fillPattern(host.data() + s.offset, s.len, 611, 0);
  const uint64_t tx0 = nic_[0]->txBytes();
  MC_ASSERT_OK(transfer(*eng_, OpCode::kWrite, host.data() + s.offset, s.len, pid_,
                        remote_gpu + s.offset));
  EXPECT_GE(nic_[0]->txBytes() - tx0, s.len) << "the write did not go over mlx5_0";
  nic_[0]->setPortUp(false);  // the notification's part fails there and goes over tcp
  MC_ASSERT_OK(eng_->notify(pid_, 9100));
  std::string reply, why;
  ASSERT_TRUE(peer_->recv(&reply, 40000, &why)) << why;
  EXPECT_EQ(reply, "ok");
  EXPECT_GE(peerGpuFlushes() - f0, 1) << "delivered without flushing the GPUDirect write of mlx5_0";
  nic_[0]->setPortUp(true);
  MC_EXPECT_OK(eng_->unregisterMemory(host.data()));
}

// Releases a NIC's QP hold and stall and drops a pending refusal whatever the test's outcome (a
// held prober would otherwise block the engine's shutdown for the hold's 30 s).
struct QpKnobs {
  explicit QpKnobs(fakeverbs::NicControl* n) : nic(n) {}
  ~QpKnobs() {
    nic->holdQps(false);
    nic->refuseQps(0);
    nic->setStalled(false);
  }
  fakeverbs::NicControl* nic;
};

// Waits (5 s at most) until a dial on `nic` waits on its hold; false if none did.
bool waitForHeldDial(fakeverbs::NicControl* nic, uint64_t before) {
  for (int i = 0; i < 5000 && nic->heldQps() == before; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return nic->heldQps() > before;
}

// One NIC (one lane), MC_RDMA_TCP_FALLBACK `fallback`, 64 KiB slices: requests A (1 MiB), then
// B (4 MiB) and C (1 byte), then a notification, all queued on the lane's QP while the NIC is
// stalled; then A's first slice fails with its own error (remote access), so the rest waits
// (parked) for the lane's immediate redial, which the emulator refuses (ibv_create_qp: ENOMEM).
// The parked work moves as after a link failure: with the fallback, over tcp (every byte in
// place, the notification delivered once, after C's byte); without it, B and C fail at once,
// naming the peer, the NIC and the operation (and the notification is not delivered). Only A
// fails of itself.
void redialOfTheOnlyLaneFails(RdmaFaultTest* t, bool fallback) {
  constexpr uint64_t kTag = 0x7e57000000000101ull, kSeed = 5200;
  ScopedEnv devs("MC_RDMA_DEVICES", "mlx5_0");
  ScopedEnv fb("MC_RDMA_TCP_FALLBACK", fallback ? "1" : "0");
  ScopedEnv slice("MC_RDMA_SLICE_BYTES", "65536");
  ScopedEnv retry("MC_RDMA_RETRY_MS", "60000");
  ASSERT_TRUE(t->setUpPeer());
  auto& eng = *t->engine();
  fakeverbs::NicControl* nic = t->nic(0);
  QpKnobs knobs(nic);
  HostBuffer buf(8u << 20), note(notifyBytes(1));
  MC_ASSERT_OK(eng.registerMemory(buf.data(), 8u << 20));
  MC_ASSERT_OK(eng.registerMemory(note.data(), notifyBytes(1)));
  fillPattern(buf.data(), 8u << 20, 77, 0);
  const Slot s = notifySlot(0);
  fillPattern(note.data() + s.offset, s.len, kSeed, 0);
  const uint64_t remote = t->peer()->info().alloc_addr;
  if (fallback) {
    ASSERT_TRUE(t->checkNotifications(1, remote, kTag, kSeed, 30000));
  }
  const uint64_t tx0 = nic->txBytes();
  nic->setStalled(true);  // (briefly: far below MC_RDMA_STALL_MS)
  nic->refuseQps(1);
  nic->failNext(1, 10);  // IBV_WC_REM_ACCESS_ERR
  auto a = eng.submit({{OpCode::kWrite, buf.data(), 1u << 20, t->pid(), remote + (1u << 20)}});
  auto bc = eng.submit({{OpCode::kWrite, buf.data() + (4u << 20), 4u << 20, t->pid(),
                         remote + (4u << 20)},
                        {OpCode::kWrite, note.data() + s.offset, s.len, t->pid(), remote + s.offset}});
  Status notified = eng.notify(t->pid(), kTag);
  nic->setStalled(false);
  ASSERT_TRUE(a.ok()) << a.status().toString();
  ASSERT_TRUE(bc.ok()) << bc.status().toString();
  MC_ASSERT_OK(notified);
  std::vector<Status> per_a;
  (void)eng.wait(*a, engine::deadlineInMs(10000), &per_a);
  ASSERT_EQ(per_a.size(), 1u);
  EXPECT_EQ(per_a[0].code(), Code::kPermissionDenied) << per_a[0].toString();
  EXPECT_NE(per_a[0].message().find("remote access error"), std::string::npos)
      << per_a[0].toString();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> per;
  (void)eng.wait(*bc, engine::deadlineInMs(20000), &per);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(nic->refuseQpsPending(), 0) << "the lane was not redialled";
  ASSERT_EQ(per.size(), 2u);
  if (fallback) {
    MC_EXPECT_OK(per[0]);
    MC_EXPECT_OK(per[1]);
    std::string reply, why;
    ASSERT_TRUE(t->peer()->recv(&reply, 30000, &why)) << why;
    EXPECT_EQ(reply, "ok") << "the notification did not follow C's byte";
    EXPECT_EQ(t->peer()->expect(remote + (4u << 20), 4u << 20, 77, 4u << 20), "");
    EXPECT_LT(nic->txBytes() - tx0, 1u << 20) << "B went over mlx5_0 (the redial succeeded?)";
  } else {
    for (const Status& st : per) {
      EXPECT_EQ(st.code(), Code::kIo) << st.toString();
      EXPECT_NE(st.message().find("peer peer"), std::string::npos) << st.toString();
      EXPECT_NE(st.message().find("mlx5_0"), std::string::npos) << st.toString();
      EXPECT_NE(st.message().find("WRITE"), std::string::npos) << st.toString();
    }
    EXPECT_LT(took, std::chrono::seconds(5)) << "the parked work waited past the failed redial";
  }
  // Delivered once (with the fallback) or not at all (its writes failed).
  EXPECT_EQ(t->peer()->call("drain_notify 300"), "ok 0");
  MC_EXPECT_OK(eng.unregisterMemory(note.data()));
  MC_EXPECT_OK(eng.unregisterMemory(buf.data()));
}

TEST_F(RdmaFaultTest, FailedRedialSendsTheParkedWorkOverTcp) {
  redialOfTheOnlyLaneFails(this, true);
}

TEST_F(RdmaFaultTest, FailedRedialWithoutTcpFailsTheParkedWork) {
  redialOfTheOnlyLaneFails(this, false);
}

// Two NICs, no tcp fallback: mlx5_0's lane is down from the start (its port down at connect);
// its redial, once the port is up, is held (the emulator's holdQps: its QP's move to INIT,
// well within the dial's 2 s deadline). Meanwhile A's first slice fails
// with its own error on mlx5_1, the only live lane, and B waits there for that lane's redial
// (no other lane is live). Released: mlx5_0's lane is back, then mlx5_1's redial (the same
// round of the prober) is refused, and B moves to mlx5_0's lane and completes there. Only A
// fails.
TEST_F(RdmaFaultTest, FailedRedialMovesTheParkedWorkToTheOtherNic) {
  ScopedEnv fb("MC_RDMA_TCP_FALLBACK", "0");
  ScopedEnv slice("MC_RDMA_SLICE_BYTES", "65536");
  ScopedEnv retry("MC_RDMA_RETRY_MS", "300");
  uint64_t held0 = 0;
  std::unique_ptr<QpKnobs> knobs0, knobs1;
  ASSERT_TRUE(setUp(16u << 20, [&] {
    knobs0 = std::make_unique<QpKnobs>(nic_[0].get());
    knobs1 = std::make_unique<QpKnobs>(nic_[1].get());
    nic_[0]->setPortUp(false);
    held0 = nic_[0]->heldQps();
    nic_[0]->holdQps(true);
  }));
  HostBuffer buf(8u << 20);
  MC_ASSERT_OK(eng_->registerMemory(buf.data(), 8u << 20));
  fillPattern(buf.data(), 8u << 20, 78, 0);
  nic_[0]->setPortUp(true);
  ASSERT_TRUE(waitForHeldDial(nic_[0].get(), held0)) << "mlx5_0's lane was not redialled";
  const uint64_t remote = peer_->info().alloc_addr;
  const uint64_t tx0 = nic_[0]->txBytes();
  nic_[1]->refuseQps(1);
  nic_[1]->failNext(1, 10);  // IBV_WC_REM_ACCESS_ERR
  auto a = eng_->submit({{OpCode::kWrite, buf.data(), 1u << 20, pid_, remote + (1u << 20)}});
  ASSERT_TRUE(a.ok()) << a.status().toString();
  auto b = eng_->submit(
      {{OpCode::kWrite, buf.data() + (4u << 20), 4u << 20, pid_, remote + (4u << 20)}});
  ASSERT_TRUE(b.ok()) << b.status().toString();
  // A finishes once mlx5_1's QP handed its work back (A's later slices with B's): B is parked.
  std::vector<Status> per_a;
  (void)eng_->wait(*a, engine::deadlineInMs(10000), &per_a);
  ASSERT_EQ(per_a.size(), 1u);
  EXPECT_EQ(per_a[0].code(), Code::kPermissionDenied) << per_a[0].toString();
  EXPECT_EQ(nic_[0]->txBytes(), tx0) << "mlx5_0 carried bytes before its lane was back";
  nic_[0]->holdQps(false);
  std::vector<Status> per_b;
  (void)eng_->wait(*b, engine::deadlineInMs(20000), &per_b);
  ASSERT_EQ(per_b.size(), 1u);
  MC_EXPECT_OK(per_b[0]);
  EXPECT_EQ(nic_[1]->refuseQpsPending(), 0) << "mlx5_1's lane was not redialled";
  EXPECT_GE(nic_[0]->txBytes() - tx0, 4u << 20) << "B did not go over mlx5_0";
  EXPECT_EQ(peer_->expect(remote + (4u << 20), 4u << 20, 78, 4u << 20), "");
  MC_EXPECT_OK(eng_->unregisterMemory(buf.data()));
}

}  // namespace
}  // namespace mooncake::test
