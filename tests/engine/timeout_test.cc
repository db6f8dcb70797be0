// What a wait() that passed its deadline promises (engine.h, TransferEngine::wait): the batch's
// local memory is fenced (tcp: once wait() returned, the transport no longer reads or writes
// it; rdma: registered memory once it is unregistered, bounce-staged memory at once), the peer
// stays open and usable, the late transfers still run to their end (a late WRITE over tcp
// still lands whole, from the copy the fence took) and the batch is released then; and
// submit() refuses requests whose length is absurd or runs past the end of the address space.
//
// The peer is stopped (SIGSTOP) so that the batch cannot finish, then resumed after the
// timeout: what it sends or takes late must not reach the caller's memory.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "tests/engine/peer_fixture.h"
#include "tests/engine/test_util.h"

namespace mooncake::test {
namespace {

// An anonymous mapping the test can mprotect.
struct Mapping {
  explicit Mapping(size_t n) : len(n) {
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p = m == MAP_FAILED ? nullptr : static_cast<uint8_t*>(m);
  }
  ~Mapping() {
    if (p != nullptr) munmap(p, len);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* p;
  size_t len;
};

class TimeoutTest : public PeerTestBase,
                    public ::testing::WithParamInterface<std::tuple<std::string, bool>> {
 protected:
  std::string transport() const { return std::get<0>(GetParam()); }
  bool registered() const { return std::get<1>(GetParam()); }

  // A peer process `name` over the parameter's transport with a region of `len` bytes, an
  // engine here with the peer open, and a buffer of `len` bytes (registered when the
  // parameter says so). Check ready() with ASSERT_TRUE before using them.
  void setUpPeer(const char* name, uint64_t len) {
    cfg_.name = name;
    cfg_.transport = transport();
    cfg_.region_bytes = len;
    peer_ = spawnPeer(cfg_);
    if (peer_ == nullptr) return;
    eng_ = makeEngine(transport());
    if (eng_ == nullptr) return;
    pid_ = openPeer(*eng_, cfg_.name);
    buf_ = std::make_unique<Mapping>(len);
    if (buf_->p != nullptr && registered()) reg_status_ = eng_->registerMemory(buf_->p, len);
  }
  void TearDown() override {  // the engine goes before the peers and the rendezvous
    eng_.reset();
    buf_.reset();
    PeerTestBase::TearDown();
  }
  bool ready() const {
    return peer_ != nullptr && eng_ != nullptr && pid_ != engine::kInvalidPeer &&
           buf_ != nullptr && buf_->p != nullptr && reg_status_.ok();
  }

  PeerConfig cfg_;
  PeerProcess* peer_ = nullptr;
  std::unique_ptr<TransferEngine> eng_;
  PeerId pid_ = engine::kInvalidPeer;
  std::unique_ptr<Mapping> buf_;
  Status reg_status_;
};

// Polls until the batch was released (its late requests ended): true, or false at `ms`.
bool releasedWithin(TransferEngine& eng, engine::BatchId id, int ms) {
  auto t0 = SteadyClock::now();
  bool done = false;
  while (eng.poll(id, &done).code() != Code::kNotFound) {
    if (msSince(t0) > ms) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A READ whose wait() timed out: its local buffer is unregistered and reused at once; the
// response the peer sends once it resumes lands nowhere (it used to overwrite all of it over
// tcp). The peer stays open: the batch is released once the late response came, and the same
// READ on the same peer works.
TEST_P(TimeoutTest, LateReadResponseDoesNotLandAfterTheTimeout) {
  constexpr uint64_t kLen = 8u << 20;
  setUpPeer("slow-peer", kLen);
  ASSERT_TRUE(ready());
  std::memset(buf_->p, 0, kLen);

  ASSERT_TRUE(stopProcess(peer_->pid()));
  auto id = eng_->submit({{OpCode::kRead, buf_->p, kLen, pid_, peer_->info().alloc_addr}});
  ASSERT_TRUE(id.ok()) << id.status().toString();
  Status st = eng_->wait(*id, engine::deadlineInMs(500));
  if (st.ok()) {  // shm: a stopped process's memory stays reachable; done inside submit()
    peer_->kill(SIGCONT);
    EXPECT_EQ(transport(), "shm") << "a stopped peer answered over " << transport();
    EXPECT_EQ(checkPattern(buf_->p, kLen, allocSeed(cfg_)), "");
    return;
  }
  ASSERT_EQ(st.code(), Code::kTimeout) << st.toString();
  if (registered()) MC_EXPECT_OK(eng_->unregisterMemory(buf_->p));
  std::memset(buf_->p, 0x11, kLen);  // the memory's next owner
  MC_EXPECT_OK(eng_->peerStatus(pid_));  // a timed-out wait() fails no peer
  bool done = true;
  MC_EXPECT_OK(eng_->poll(*id, &done));
  EXPECT_FALSE(done) << "the late READ ended before its peer resumed";
  peer_->kill(SIGCONT);
  EXPECT_TRUE(releasedWithin(*eng_, *id, 10000)) << "the late READ never ended";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  size_t landed = 0;
  for (uint64_t i = 0; i < kLen; ++i) landed += buf_->p[i] != 0x11;
  EXPECT_EQ(landed, 0u) << "bytes of the late READ response written after wait() returned";

  // The caller retries on the same peer: the READ moves the right bytes.
  MC_EXPECT_OK(eng_->peerStatus(pid_));
  if (registered()) MC_ASSERT_OK(eng_->registerMemory(buf_->p, kLen));
  MC_EXPECT_OK(transfer(*eng_, OpCode::kRead, buf_->p, kLen, pid_, peer_->info().alloc_addr));
  EXPECT_EQ(checkPattern(buf_->p, kLen, allocSeed(cfg_)), "");
  if (registered()) MC_EXPECT_OK(eng_->unregisterMemory(buf_->p));
}

// A WRITE whose wait() timed out: the caller writes other bytes into its buffer and then takes
// it away (PROT_NONE) before the peer resumes. Nothing is read from it any more: no byte of the
// new contents reaches the peer, and nothing faults. What keepUntilDone was handed lives until
// the late WRITE ended; over tcp that WRITE still lands whole (the fence copied what was left
// of it), over rdma it may stop short (deregistered memory, bounce slices not posted).
TEST_P(TimeoutTest, TimedOutWriteNoLongerReadsItsBuffer) {
  constexpr uint64_t kLen = 32u << 20;  // more than a stopped peer's sockets take in
  constexpr uint64_t kChunk = 256u << 10;
  setUpPeer("slow-peer", kLen);
  ASSERT_TRUE(ready());
  fillPattern(buf_->p, kLen, 4242, 0);

  ASSERT_TRUE(stopProcess(peer_->pid()));
  auto id = eng_->submit({{OpCode::kWrite, buf_->p, kLen, pid_, peer_->info().alloc_addr}});
  ASSERT_TRUE(id.ok()) << id.status().toString();
  Status st = eng_->wait(*id, engine::deadlineInMs(500));
  if (st.ok()) {
    peer_->kill(SIGCONT);
    EXPECT_EQ(transport(), "shm") << "a stopped peer answered over " << transport();
    return;
  }
  ASSERT_EQ(st.code(), Code::kTimeout) << st.toString();
  MC_EXPECT_OK(eng_->peerStatus(pid_));  // a timed-out wait() fails no peer
  auto token = std::make_shared<int>(1);  // the store hands over a remote slab's hold like this
  std::weak_ptr<int> weak = token;
  eng_->keepUntilDone(*id, std::move(token));
  if (registered()) MC_EXPECT_OK(eng_->unregisterMemory(buf_->p));
  std::memset(buf_->p, 0x5a, kLen);
  ASSERT_EQ(mprotect(buf_->p, kLen, PROT_NONE), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(weak.expired()) << "keepUntilDone's owner dropped while the WRITE was stalled";
  peer_->kill(SIGCONT);
  EXPECT_TRUE(releasedWithin(*eng_, *id, 10000)) << "the late WRITE never ended";
  for (int i = 0; i < 200 && !weak.expired(); ++i)  // (dropped on the engine's reaper thread)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(weak.expired()) << "keepUntilDone's owner outlived the late WRITE";
  std::vector<uint8_t> fresh(kChunk, 0x5a);
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(checksumHost(fresh.data(), kChunk)));
  const std::string fresh_sum = std::string("ok ") + hex;  // the peer's answer for such a chunk
  int late = 0;
  for (uint64_t off = 0; off < kLen; off += kChunk)
    late += peer_->sum(peer_->info().alloc_addr + off, kChunk) == fresh_sum;
  EXPECT_EQ(late, 0) << "chunks of 256 KiB written from the buffer after wait() returned";
  if (transport() == "tcp") {
    EXPECT_EQ(peer_->expect(peer_->info().alloc_addr, kLen, 4242, 0), "")
        << "the late WRITE did not land whole";
  }
  ASSERT_EQ(mprotect(buf_->p, kLen, PROT_READ | PROT_WRITE), 0);

  MC_EXPECT_OK(eng_->peerStatus(pid_));
  fillPattern(buf_->p, kLen, 4343, 0);
  if (registered()) MC_ASSERT_OK(eng_->registerMemory(buf_->p, kLen));
  MC_EXPECT_OK(transfer(*eng_, OpCode::kWrite, buf_->p, kLen, pid_, peer_->info().alloc_addr));
  EXPECT_EQ(peer_->expect(peer_->info().alloc_addr, kLen, 4343, 0), "");
  if (registered()) MC_EXPECT_OK(eng_->unregisterMemory(buf_->p));
}

// Deadlines that pass while the bytes are on the move (the peer runs): each fence finds the
// transfer somewhere else (READ responses half received, WRITE frames half sent or still
// queued). After each timed-out wait() the buffer is overwritten at once: no byte of it changes
// afterwards (READ), and over tcp every late WRITE lands whole with the bytes it had when it
// was submitted (WRITE). Then the same peer still moves the right bytes.
TEST_P(TimeoutTest, DeadlinesPassingMidTransferKeepTheStreamInStep) {
  if (transport() != "tcp") GTEST_SKIP() << "the fence races only the tcp progress thread";
  constexpr uint64_t kLen = 24u << 20;
  setUpPeer("busy-peer", kLen);
  ASSERT_TRUE(ready());
  int timed_out = 0;
  for (int round = 0; round < 12; ++round) {
    const OpCode op = round % 2 == 0 ? OpCode::kRead : OpCode::kWrite;
    const uint64_t seed = 5000 + static_cast<uint64_t>(round);
    if (op == OpCode::kRead) std::memset(buf_->p, 0, kLen);
    if (op == OpCode::kWrite) fillPattern(buf_->p, kLen, seed, 0);
    const uint64_t remote = op == OpCode::kRead ? peer_->info().alloc_addr : peer_->info().reg_addr;
    auto id = eng_->submit({{op, buf_->p, kLen, pid_, remote}});
    ASSERT_TRUE(id.ok()) << id.status().toString();
    Status st = eng_->wait(*id, engine::deadlineInMs(1 + round % 4));
    if (st.ok()) continue;
    ASSERT_EQ(st.code(), Code::kTimeout) << st.toString();
    ++timed_out;
    std::memset(buf_->p, 0x11, kLen);
    EXPECT_TRUE(releasedWithin(*eng_, *id, 10000)) << "round " << round;
    size_t changed = 0;
    for (uint64_t i = 0; i < kLen; ++i) changed += buf_->p[i] != 0x11;
    EXPECT_EQ(changed, 0u) << "round " << round << ": bytes of the buffer changed after wait()";
    if (op == OpCode::kWrite) {
      EXPECT_EQ(peer_->expect(peer_->info().reg_addr, kLen, seed, 0), "") << "round " << round;
    }
    MC_ASSERT_OK(eng_->peerStatus(pid_));
  }
  EXPECT_GT(timed_out, 0) << "no deadline passed: nothing was tested";
  MC_EXPECT_OK(transfer(*eng_, OpCode::kRead, buf_->p, kLen, pid_, peer_->info().alloc_addr));
  EXPECT_EQ(checkPattern(buf_->p, kLen, allocSeed(cfg_)), "");
  fillPattern(buf_->p, kLen, 77, 0);
  MC_EXPECT_OK(transfer(*eng_, OpCode::kWrite, buf_->p, kLen, pid_, peer_->info().reg_addr));
  EXPECT_EQ(peer_->expect(peer_->info().reg_addr, kLen, 77, 0), "");
  if (registered()) MC_EXPECT_OK(eng_->unregisterMemory(buf_->p));
}

INSTANTIATE_TEST_SUITE_P(Engine, TimeoutTest,
                         ::testing::Combine(MC_TEST_TRANSPORTS, ::testing::Bool()),
                         [](const auto& i) {
                           return std::get<0>(i.param) +
                                  (std::get<1>(i.param) ? "_registered" : "_unregistered");
                         });

// ---------------------------------------------------------------------------------------

// GPU memory to a peer on another host over tcp is staged through host memory here
// (engine/device_staging.cc), in 4 MiB pieces, over the device layer's simulation
// (MC_DEVICE=sim); the peer's GPU memory is staged at the peer. The fence covers both: once a
// timed-out wait() returned, no piece of a READ is copied into the GPU buffer here, no piece
// of a WRITE is copied out of it, and a READ of the peer's GPU memory into host memory here
// (which the tcp transport moves itself) lands nowhere. The pieces used to go on: a late READ
// overwrote the buffer the caller had reused, a late WRITE sent what it held by then.
class StagedTimeoutTest : public PeerTestBase {};

TEST_F(StagedTimeoutTest, StagedTransfersStopTouchingTheBufferAfterTheTimeout) {
  ScopedEnv dev("MC_DEVICE", "sim");  // this process and the peer (it inherits it)
  constexpr uint64_t kLen = 16u << 20;  // 4 pieces
  constexpr uint64_t kChunk = 256u << 10;
  PeerConfig cfg;
  cfg.name = "gpu-peer";
  cfg.region_bytes = kLen;
  PeerProcess* peer = nullptr;
  {
    ScopedEnv there("MC_HOST_ID", "timeout-host-a");
    peer = spawnPeer(cfg);
  }
  ASSERT_NE(peer, nullptr);
  const std::string r = peer->call("alloc_gpu " + std::to_string(kLen) + " 77 0");
  ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
  const uint64_t remote_gpu = std::strtoull(r.c_str() + 3, nullptr, 10);
  ScopedEnv here("MC_HOST_ID", "timeout-host-b");
  auto eng = makeEngine("");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, cfg.name);
  ASSERT_NE(pid, engine::kInvalidPeer);
  ASSERT_EQ(eng->peerTransport(pid), "tcp");
  auto gpu = eng->allocate(kLen, engine::MemoryKind::kCuda, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status().toString();
  auto* g = static_cast<uint8_t*>(*gpu);
  HostBuffer host(kLen);

  // Submits op on the stopped peer, waits 500 ms (times out), overwrites `local` with `fill`
  // at once (GPU memory through a device copy: host code cannot touch it), resumes the peer and waits until the late transfer ended.
  auto timedOut = [&](OpCode op, uint8_t* local, uint64_t remote, uint8_t fill) {
    EXPECT_TRUE(stopProcess(peer->pid()));
    auto id = eng->submit({{op, local, kLen, pid, remote}});
    ASSERT_TRUE(id.ok()) << id.status().toString();
    Status st = eng->wait(*id, engine::deadlineInMs(500));
    EXPECT_EQ(st.code(), Code::kTimeout) << st.toString();
    const std::vector<uint8_t> next(kLen, fill);  // the memory's next contents
    if (onDevice(local))
      deviceCopyOrDie(local, next.data(), kLen);
    else
      std::memcpy(local, next.data(), kLen);
    peer->kill(SIGCONT);
    EXPECT_TRUE(releasedWithin(*eng, *id, 20000)) << "the late transfer never ended";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    MC_EXPECT_OK(eng->peerStatus(pid));  // a timed-out wait() fails no peer
  };
  auto unchanged = [&](const uint8_t* p, uint8_t fill) {  // how many bytes are not `fill`
    std::vector<uint8_t> now(kLen);
    if (onDevice(p))
      deviceCopyOrDie(now.data(), p, kLen);
    else
      std::memcpy(now.data(), p, kLen);
    size_t n = 0;
    for (uint8_t b : now) n += b != fill;
    return n;
  };

  // READ of the peer's host memory into GPU memory here.
  timedOut(OpCode::kRead, g, peer->info().alloc_addr, 0x11);
  EXPECT_EQ(unchanged(g, 0x11), 0u) << "bytes of a late staged READ landed in the GPU buffer";
  // READ of the peer's GPU memory (staged there) into host memory here.
  timedOut(OpCode::kRead, host.data(), remote_gpu, 0x22);
  EXPECT_EQ(unchanged(host.data(), 0x22), 0u) << "bytes of a late READ landed in host memory";
  // WRITE from GPU memory here: nothing it held after the timeout reaches the peer.
  fillPattern(g, kLen, 4242, 0);
  timedOut(OpCode::kWrite, g, peer->info().reg_addr, 0x5a);
  std::vector<uint8_t> fresh(kChunk, 0x5a);
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(checksumHost(fresh.data(), kChunk)));
  int late = 0;
  for (uint64_t off = 0; off < kLen; off += kChunk)
    late += peer->sum(peer->info().reg_addr + off, kChunk) == std::string("ok ") + hex;
  EXPECT_EQ(late, 0) << "chunks of 256 KiB staged out of the GPU buffer after wait() returned";

  // The same peer still moves the right bytes, all three ways.
  MC_EXPECT_OK(transfer(*eng, OpCode::kRead, g, kLen, pid, peer->info().alloc_addr));
  EXPECT_EQ(checkPattern(g, kLen, allocSeed(cfg), 0), "");
  MC_EXPECT_OK(transfer(*eng, OpCode::kRead, host.data(), kLen, pid, remote_gpu));
  EXPECT_EQ(checkPattern(host.data(), kLen, 77, 0), "");
  fillPattern(g, kLen, 4343, 0);
  MC_EXPECT_OK(transfer(*eng, OpCode::kWrite, g, kLen, pid, peer->info().reg_addr));
  EXPECT_EQ(peer->expect(peer->info().reg_addr, kLen, 4343, 0), "");
  MC_EXPECT_OK(eng->free(*gpu));
}

// ---------------------------------------------------------------------------------------

class RequestLengthTest : public PeerTestBase {};

// Lengths that run past the end of the address space (which used to wrap the tcp transport's
// slice count to 0: a request that never completed) and absurd ones are refused by submit(),
// naming the request; a request the descriptor does not show inside one region and longer
// than one tcp frame is refused whole, before a byte moves.
TEST_F(RequestLengthTest, AbsurdAndWrappingLengthsAreRefusedUpFront) {
  PeerConfig cfg;
  cfg.name = "target";
  cfg.transport = "tcp";
  PeerProcess* peer = spawnPeer(cfg);
  ASSERT_NE(peer, nullptr);
  auto eng = makeEngine("tcp");
  ASSERT_NE(eng, nullptr);
  PeerId pid = openPeer(*eng, cfg.name);
  ASSERT_NE(pid, engine::kInvalidPeer);
  HostBuffer buf(4096);
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const uint64_t remote = peer->info().unreg_addr;
  struct Case {
    const char* what;
    uint64_t len;
  } cases[] = {{"the whole address space", kMax},
               {"past the end of the remote side", kMax - remote + 2},
               {"absurd", TransferEngine::kMaxRequestBytes + 1}};
  for (const Case& c : cases) {
    for (OpCode op : {OpCode::kRead, OpCode::kWrite}) {
      auto t0 = SteadyClock::now();
      auto id = eng->submit({{op, buf.data(), 8, pid, peer->info().reg_addr},
                             {op, buf.data(), c.len, pid, remote}});
      Status st = id.status();
      if (id.ok()) st = eng->wait(*id, engine::deadlineInMs(3000));
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << c.what << ": " << st.toString();
      EXPECT_NE(st.message().find("request 1"), std::string::npos) << st.toString();
      EXPECT_LT(msSince(t0), 1000) << c.what;
    }
  }
  // Not inside a region of the descriptor, longer than one frame: refused whole, at once
  // (the local side is never read: it is not even that long).
  const uint64_t big = (1ull << 30) + 4096;
  auto t0 = SteadyClock::now();
  Status st = eng->transfer({{OpCode::kWrite, buf.data(), big, pid, peer->info().reg_addr}},
                            engine::deadlineInMs(3000));
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.toString();
  EXPECT_LT(msSince(t0), 1000);
  MC_EXPECT_OK(eng->peerStatus(pid));
  EXPECT_EQ(peer->expect(peer->info().reg_addr, cfg.region_bytes, regSeed(cfg), 0), "");
  fillPattern(buf.data(), 4096, 31, 0);
  MC_EXPECT_OK(transfer(*eng, OpCode::kWrite, buf.data(), 4096, pid, peer->info().reg_addr));
  EXPECT_EQ(peer->expect(peer->info().reg_addr, 4096, 31, 0), "");
}

}  // namespace
}  // namespace mooncake::test
