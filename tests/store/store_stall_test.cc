// Store client against a replica holder that is stopped (SIGSTOP) past the transfer timeout:
// the reads that timed out still land when it resumes, in memory the engine kept for them
// (engine.h, keepUntilDone), never in memory the client freed or returned; reads go on to
// another replica only into fresh memory; a put's late write keeps its slab reserved until it
// landed. Real processes, the standalone master, tcp.
#include <gtest/gtest.h>
#include <malloc.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/common/test_secret.h"
#include "tests/store/ha_harness.h"

namespace mooncake::test {
namespace {

using store::ErrorCode;
using store::ReplicateConfig;

// A forked holder that the test stops and resumes: killed and reaped when the test ends, however
// it ends (an ASSERT leaves no holder behind), and asked how it is faring in failure messages.
class Holder {
 public:
  explicit Holder(pid_t pid) : pid_(pid) {}
  ~Holder() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitChild(pid_, 5000);
    }
  }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;
  pid_t pid() const { return pid_; }
  // "alive" (running or stopped), else how it ended (reaped here, once).
  std::string state() {
    if (!reaped_ && waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
    if (!reaped_) return "alive";
    if (WIFSIGNALED(status_)) return "killed by signal " + std::to_string(WTERMSIG(status_));
    return "exited with status " + std::to_string(WEXITSTATUS(status_));
  }

 private:
  pid_t pid_;
  bool reaped_ = false;
  int status_ = 0;
};

// The only holder of a 32 MiB object is stopped (SIGSTOP) past the reader's transfer timeout:
// get() fails, and its READ, still queued at the holder, lands once the holder resumes. It must
// land in memory the engine kept for it, not in get()'s freed result: with mmap'ed blocks (set
// below) that result is unmapped when freed and the next block of its size usually takes its
// place, so here a fresh buffer with a pattern that no late READ may touch; or the process
// crashes. Then the object reads back whole.
TEST(StoreStall, GetThatTimedOutLeavesNoLateReadInFreedMemory) {
  constexpr size_t kSize = 32u << 20;
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 1 << 20), 1);  // (no dynamic threshold: freed = unmapped)
  auto master = MasterProcess::spawn();
  ASSERT_NE(master, nullptr);
  const uint16_t port = master->port();
  Holder holder(forkChild([=]() -> int {
    ClientProc p;
    if (!makeClient(port, "H", 2 * kSize, &p, "tcp")) return 2;
    std::string v = valueFor("big", kSize);
    ReplicateConfig one;
    one.preferred_segment = "H";
    if (p.client->put("big", v.data(), v.size(), one) != ErrorCode::OK) return 4;
    (void)p.rdv->set("big-done", "1");
    pause();  // until killed
    return 0;
  }));
  const pid_t h = holder.pid();
  auto rdv = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(),
                                                  engine::deadlineInMs(5000));
  ASSERT_TRUE(rdv.ok());
  ASSERT_TRUE((*rdv)->wait("big-done", engine::deadlineInMs(20000)).ok());
  ClientProc r;
  ASSERT_TRUE(makeClient(port, "reader", 0, &r, "tcp"));  // transfer timeout 3 s
  auto g = r.client->get("big");
  ASSERT_TRUE(g.ok()) << toInt(g.error());
  EXPECT_EQ(checkPattern(g->data(), g->size(), keySeed("big")), "");

  if (!stopProcess(h)) FAIL() << "the holder did not stop";
  auto t0 = std::chrono::steady_clock::now();
  auto late = r.client->get("big");
  EXPECT_FALSE(late.ok()) << "read from a stopped holder";
  if (!late.ok()) {
    EXPECT_EQ(late.error(), ErrorCode::TRANSFER_FAIL);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  // A stopped process runs no code and dies of SIGKILL only: nothing here sends it one before
  // the end, so a holder gone now was killed from outside the test (seen once in a full run:
  // its connections closed mid-get, the get failed without its transfer timeout, and the one
  // after SIGCONT found no holder: TRANSFER_FAIL).
  const std::string stopped = holder.state();
  if (stopped != "alive")
    FAIL() << "the holder (pid " << h << ") ended while it was stopped (" << stopped
           << "): killed from outside this test, not a failure of the store";
  std::string fresh(kSize, '\0');
  fillPattern(fresh.data(), kSize, 4242);
  kill(h, SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the late READ lands
  EXPECT_EQ(checkPattern(fresh.data(), kSize, 4242), "") << "a late READ wrote into freed memory";
  auto again = r.client->get("big");
  ASSERT_TRUE(again.ok()) << toInt(again.error()) << " (the holder: " << holder.state() << ")";
  EXPECT_EQ(checkPattern(again->data(), again->size(), keySeed("big")), "");
}

// Two replicas; the holder of the first one listed is stopped. get() and batch_get wait out
// the transfer timeout on it, then read the other replica into a fresh buffer (the stopped
// one's READ still lands later, in the one the engine kept): the values returned are whole and
// stay so after the holder resumed. get_into fails instead: the late READ may still write into
// the caller's buffer, so no other replica is read into it.
TEST(StoreStall, StoppedFirstReplicaFallsOverIntoFreshMemory) {
  constexpr size_t kSize = 4u << 20;
  auto master = MasterProcess::spawn();
  ASSERT_NE(master, nullptr);
  const uint16_t port = master->port();
  auto holder = [&](const std::string& name) {
    return forkChild([=]() -> int {
      ClientProc p;
      if (!makeClient(port, name, 4 * kSize, &p, "tcp")) return 2;
      if (!barrier(*p.rdv, "mounted", 2)) return 3;
      pause();  // until killed
      return 0;
    });
  };
  pid_t a = holder("A"), b = holder("B");
  auto rdv = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(),
                                                  engine::deadlineInMs(5000));
  ASSERT_TRUE(rdv.ok());
  ASSERT_TRUE(barrier(**rdv, "mounted", 2));
  ClientProc r;
  ASSERT_TRUE(makeClient(port, "reader", 0, &r, "tcp"));  // transfer timeout 3 s
  ReplicateConfig two;
  two.replica_num = 2;
  const std::string v = valueFor("dup", kSize);
  ASSERT_EQ(r.client->put("dup", v.data(), v.size(), two), ErrorCode::OK);
  auto rl = r.client->replicaList("dup");
  ASSERT_TRUE(rl.ok());
  ASSERT_EQ(rl->replicas_size(), 2);
  const std::string first = rl->replicas(0).pieces(0).client_id();
  const pid_t stopped = first.rfind("A", 0) == 0 ? a : b;
  if (!stopProcess(stopped)) {
    kill(a, SIGKILL);
    kill(b, SIGKILL);
    FAIL() << "the holder did not stop";
  }
  auto t0 = std::chrono::steady_clock::now();
  auto g = r.client->get("dup");
  ASSERT_TRUE(g.ok()) << "get with the first replica's holder stopped: " << toInt(g.error());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(2500))
      << "the first replica (" << first << ") was not the one tried first";
  auto bg = r.client->batchGet({"dup"});
  ASSERT_EQ(bg.size(), 1u);
  ASSERT_TRUE(bg[0].ok()) << toInt(bg[0].error());
  std::string into(kSize, '\0');
  auto gi = r.client->getInto("dup", into.data(), into.size());
  EXPECT_FALSE(gi.ok()) << "get_into read another replica into a buffer a late READ may hit";
  if (!gi.ok()) {
    EXPECT_EQ(gi.error(), ErrorCode::TRANSFER_FAIL);
  }
  kill(stopped, SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the late READs land
  EXPECT_EQ(checkPattern(g->data(), g->size(), keySeed("dup")), "");
  EXPECT_EQ(checkPattern(bg[0]->data(), bg[0]->size(), keySeed("dup")), "");
  kill(a, SIGKILL);
  kill(b, SIGKILL);
  waitChild(a, 5000);
  waitChild(b, 5000);
}

// A batch read whose first replica is given up while it is being planned: a striped replica
// whose first piece's holder P is known (and then stopped) and whose second piece's holder Q
// is dead (no peer can be opened for it). batchGetInto must drop the READ it already planned
// from P: it would otherwise go into the shared engine batch, time out there (P is stopped),
// and land in the caller's buffer after the call returned, on top of what the caller put there
// since; the key itself is read from the other replica. (Before b785c71 the planned READ
// stayed in the batch: the call took the whole transfer timeout and the sentinel below was
// overwritten once P resumed.)
TEST(StoreStall, BatchGetIntoDropsTheReadsOfAReplicaGivenUpWhilePlanned) {
  constexpr size_t kSeg = 8u << 20, kSize = 12u << 20;
  auto master = MasterProcess::spawn();
  ASSERT_NE(master, nullptr);
  const uint16_t port = master->port();
  auto holder = [&](const std::string& name) {
    return forkChild([=]() -> int {
      ClientProc p;
      if (!makeClient(port, name, kSeg, &p, "tcp")) return 2;
      if (!barrier(*p.rdv, "mounted", 5)) return 3;  // four holders and the writer
      pause();  // until killed
      return 0;
    });
  };
  const pid_t P = holder("P"), Q = holder("Q"), R = holder("R"), S = holder("S");
  // The writer: "big" striped twice, P+Q and R+S (no 8 MiB segment holds it whole); "warm"
  // on P only, for the reader to know P without ever talking to Q.
  const pid_t w = forkChild([=]() -> int {
    ClientProc p;
    if (!makeClient(port, "W", 0, &p, "tcp")) return 2;
    if (!barrier(*p.rdv, "mounted", 5)) return 3;  // four holders and the writer
    ReplicateConfig on_p;
    on_p.preferred_segment = "P";
    const std::string warm = valueFor("warm", 64u << 10);
    if (p.client->put("warm", warm.data(), warm.size(), on_p) != ErrorCode::OK) return 4;
    ReplicateConfig two;
    two.replica_num = 2;
    two.preferred_segments = {"P", "Q", "R", "S"};
    const std::string v = valueFor("big", kSize);
    ErrorCode ec = p.client->put("big", v.data(), v.size(), two);
    if (ec != ErrorCode::OK) {
      std::fprintf(stderr, "put big: %d\n", toInt(ec));
      return 5;
    }
    (void)p.rdv->set("put-done", "1");
    pause();
    return 0;
  });
  auto cleanup = [&] {
    for (pid_t k : {P, Q, R, S, w}) {
      kill(k, SIGKILL);
      waitChild(k, 5000);
    }
  };
  auto rdv = engine::TcpRendezvousClient::connect("127.0.0.1", port, mooncake::test::jobSecret(),
                                                  engine::deadlineInMs(5000));
  ASSERT_TRUE(rdv.ok());
  if (!(*rdv)->wait("put-done", engine::deadlineInMs(20000)).ok()) {
    cleanup();
    FAIL() << "the writer did not put";
  }
  ClientProc r;
  ASSERT_TRUE(makeClient(port, "reader", 0, &r, "tcp"));  // transfer timeout 3 s
  auto rl = r.client->replicaList("big");
  ASSERT_TRUE(rl.ok());
  auto holderOf = [&](int rep, int piece) {
    return rl->replicas(rep).pieces(piece).client_id().substr(0, 1);
  };
  ASSERT_EQ(rl->replicas_size(), 2);
  ASSERT_EQ(rl->replicas(0).pieces_size(), 2);
  ASSERT_EQ(holderOf(0, 0) + holderOf(0, 1), "PQ") << "the layout this test needs";
  for (int i = 0; i < rl->replicas(1).pieces_size(); ++i) ASSERT_NE(holderOf(1, i), "P");
  auto warm = r.client->get("warm");  // the reader now has a peer for P, none for Q
  ASSERT_TRUE(warm.ok()) << toInt(warm.error());

  kill(Q, SIGKILL);
  waitChild(Q, 5000);
  if (!stopProcess(P)) {
    cleanup();
    FAIL() << "P did not stop";
  }
  std::string buf(kSize, '\0');
  auto t0 = std::chrono::steady_clock::now();
  auto got = r.client->batchGetInto({"big"}, {{buf.data(), buf.size()}});
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].ok()) << "the other replica was not read: " << toInt(got[0].error());
  if (got[0].ok()) {
    EXPECT_EQ(*got[0], kSize);
    EXPECT_EQ(checkPattern(buf.data(), kSize, keySeed("big")), "");
  }
  // Nothing of the batch went to P: no waiting out the 3 s transfer timeout on it.
  EXPECT_LT(took, std::chrono::milliseconds(2500)) << "the batch waited on the stopped P";
  // The buffer is the caller's again: it reuses it; nothing may write into it any more.
  fillPattern(buf.data(), kSize, 4242);
  kill(P, SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));  // a late READ would land now
  EXPECT_EQ(checkPattern(buf.data(), kSize, 4242), "")
      << "a READ of the given-up replica landed in the caller's buffer after the call";
  cleanup();
}

// Whether done() holds within ms (polled every 100 ms).
bool within(const std::function<bool()>& done, int ms) {
  for (auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
       std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(std::chrono::milliseconds(100)))
    if (done()) return true;
  return done();
}

// A master with metrics, a holder process "H" (64 MiB segment) and a writer client here
// (transfer timeout 3 s) for the late-write cases below.
struct PutStallRig {
  explicit PutStallRig(const std::string& master_flags) : master(master_flags) {}
  ~PutStallRig() {
    if (h > 0) {
      kill(h, SIGKILL);
      waitChild(h, 5000);
    }
  }
  bool start() {
    if (!master.start()) return false;
    const uint16_t port = master.port();
    h = forkChild([=]() -> int {
      ClientProc p;
      if (!makeClient(port, "H", 64u << 20, &p, "tcp")) return 2;
      (void)p.rdv->set("h-up", "1");
      pause();  // until killed
      return 0;
    });
    auto rdv = engine::TcpRendezvousClient::connect(
        "127.0.0.1", port, mooncake::test::jobSecret(), engine::deadlineInMs(5000));
    return rdv.ok() && (*rdv)->wait("h-up", engine::deadlineInMs(20000)).ok() &&
           makeClient(port, "writer", 0, &w, "tcp");
  }
  HaMaster master;
  pid_t h = -1;
  ClientProc w;
};

// Objects placed on the holder H.
ReplicateConfig onH() {
  ReplicateConfig c;
  c.preferred_segment = "H";
  return c;
}

// Puts "first" (`size` bytes) on H; returns the master's bytes_used after it (the baseline
// of expectHeldUntilResumed), -1 when the put failed.
double putFirstOnH(PutStallRig& rig, size_t size) {
  const std::string v0 = valueFor("first", size);
  if (rig.w.client->put("first", v0.data(), v0.size(), onH()) != ErrorCode::OK) return -1;
  return rig.master.metric("mooncake_store_bytes_used");
}

// After a revoke of `key` whose WRITE into the stopped holder is still queued: the key is gone,
// its `size` bytes stay used at the master (bytes_used over `base`) while the holder is stopped,
// and they go once it resumed (SIGCONT here) and the late WRITE landed.
void expectHeldUntilResumed(PutStallRig& rig, const std::string& key, double base, size_t size) {
  const std::string used = "mooncake_store_bytes_used";
  auto there = rig.w.client->exists(key);  // (EXPECT, not ASSERT: the SIGCONT below must run)
  EXPECT_TRUE(there.ok() && !*there) << "the revoked key " << key << " is still there";
  EXPECT_FALSE(within([&] {
                 const double now = rig.master.metric(used);  // (-1: not read)
                 return now >= 0 && now < base + size;
               },
                      6000))
      << key << ": the revoked memory was freed while a write into it was still queued";
  kill(rig.h, SIGCONT);
  EXPECT_TRUE(within([&] { return rig.master.metric(used) == base; }, 30000))
      << key << ": the hold was never released after the late write landed: "
      << rig.master.metric(used) << " bytes used, " << base << " before";
}

// The only holder is stopped past the writer's transfer timeout while a put writes into a
// slab there: the put fails, and its WRITE, still queued, lands when the holder resumes. Until
// then the slab must stay reserved at the master: a slab handed back has its unpublished space
// placed under other objects, which the late WRITE would overwrite. The writer's heartbeat
// hands retired slabs back (else they go with its next put), so the master's slab gauge shows
// when: not while the holder is stopped, soon after it resumed.
TEST(StoreStall, TimedOutPutKeepsItsSlabUntilTheLateWriteFinished) {
  constexpr size_t kSize = 256u << 10;
  PutStallRig rig("--rebuild-quiet-ms 200");  // clients heartbeat every 2.5 s (ttl 10 s)
  ASSERT_TRUE(rig.start());
  HaMaster& master = rig.master;
  store::StoreClient& w = *rig.w.client;
  const std::string slabs = "mooncake_store_slabs";
  ASSERT_EQ(master.metric(slabs), 0);
  // A first put opens the holder and takes a slab there; the next one goes into it.
  const std::string v0 = valueFor("first", kSize);
  ASSERT_EQ(w.put("first", v0.data(), v0.size()), ErrorCode::OK);
  ASSERT_EQ(master.metric(slabs), 1);

  ASSERT_TRUE(stopProcess(rig.h)) << "the holder did not stop";
  const std::string v = valueFor("late", kSize);
  EXPECT_EQ(w.put("late", v.data(), v.size()), ErrorCode::TRANSFER_FAIL)
      << "put to a stopped holder";
  EXPECT_GE(master.metric(slabs), 1) << "the put did not write into a slab";
  // Two heartbeats and more: the slab stays reserved while its write cannot land.
  EXPECT_FALSE(within([&] { return master.metric(slabs) == 0; }, 6000))
      << "the slab was handed back while a write into it was still queued";
  kill(rig.h, SIGCONT);
  EXPECT_TRUE(within([&] { return master.metric(slabs) == 0; }, 30000))
      << "the slab was never handed back after the late write landed";
  // The store works on: the holder (back, re-registered if it was expired meanwhile) takes a put.
  const std::string v2 = valueFor("after", kSize);
  ErrorCode ec = ErrorCode::INTERNAL_ERROR;
  EXPECT_TRUE(within([&] { return (ec = w.put("after", v2.data(), v2.size())) == ErrorCode::OK; },
                     20000))
      << toInt(ec);
  auto g = w.get("after");
  ASSERT_TRUE(g.ok()) << toInt(g.error());
  EXPECT_EQ(*g, v2);
}

// The same for a put outside slabs (a preferred segment: PutStart, write, PutEnd): its WRITE to
// the stopped holder times out, and the revoke frees the key at once but leaves the memory
// allocated under a hold until the writer says the late WRITE finished (it used to free it at
// once: the master's bytes_used gauge fell back while the holder was still stopped).
TEST(StoreStall, TimedOutClassicPutKeepsItsMemoryUntilTheLateWriteFinished) {
  constexpr size_t kSize = 1u << 20;
  // A long client ttl: the stopped holder is not expired (its segment would go, and the gauge
  // with it) while the test looks; clients then heartbeat every 7.5 s.
  PutStallRig rig("--rebuild-quiet-ms 200 --client-ttl-s 30");
  ASSERT_TRUE(rig.start());
  store::StoreClient& w = *rig.w.client;
  const ReplicateConfig on_h = onH();
  const double base = putFirstOnH(rig, kSize);
  ASSERT_GE(base, static_cast<double>(kSize))
      << "the first put on H failed (-1) or is not counted";

  ASSERT_TRUE(stopProcess(rig.h)) << "the holder did not stop";
  const std::string v = valueFor("late", kSize);
  EXPECT_EQ(w.put("late", v.data(), v.size(), on_h), ErrorCode::TRANSFER_FAIL);
  expectHeldUntilResumed(rig, "late", base, kSize);
  EXPECT_EQ(w.put("late", v.data(), v.size(), on_h), ErrorCode::OK);
  auto g = w.get("late");
  ASSERT_TRUE(g.ok()) << toInt(g.error());
  EXPECT_EQ(*g, v);
}

// The same for a put session (the layer-wise put): a range write into the stopped holder times
// out, the session can only be revoked, and the revoke leaves the memory under the session's
// own hold until the late WRITE finished; then the key takes a new session and reads back.
TEST(StoreStall, TimedOutSessionRangeKeepsItsMemoryUntilTheLateWriteFinished) {
  constexpr size_t kSize = 1u << 20;
  PutStallRig rig("--rebuild-quiet-ms 200 --client-ttl-s 30");  // (as above: no expiry)
  ASSERT_TRUE(rig.start());
  store::StoreClient& w = *rig.w.client;
  const ReplicateConfig on_h = onH();
  const double base = putFirstOnH(rig, kSize);
  ASSERT_GE(base, static_cast<double>(kSize))
      << "the first put on H failed (-1) or is not counted";

  const std::string v = valueFor("sess", kSize);
  ASSERT_EQ(w.putSessionStart({"sess"}, {kSize}, on_h), std::vector<ErrorCode>{ErrorCode::OK});
  // The first half while the holder runs, the second after it stopped.
  auto r1 = w.putSessionRanges({"sess"}, {{{v.data(), 0, kSize / 2}}});
  ASSERT_TRUE(r1[0].ok()) << toInt(r1[0].error());
  ASSERT_TRUE(stopProcess(rig.h)) << "the holder did not stop";
  auto r2 = w.putSessionRanges({"sess"}, {{{v.data() + kSize / 2, kSize / 2, kSize / 2}}});
  ASSERT_FALSE(r2[0].ok());
  EXPECT_EQ(r2[0].error(), ErrorCode::TRANSFER_FAIL);
  EXPECT_EQ(w.putSessionRevoke("sess"), ErrorCode::OK);
  expectHeldUntilResumed(rig, "sess", base, kSize);
  ASSERT_EQ(w.putSessionStart({"sess"}, {kSize}, on_h), std::vector<ErrorCode>{ErrorCode::OK});
  auto r3 = w.putSessionRanges({"sess"}, {{{v.data(), 0, kSize}}});
  ASSERT_TRUE(r3[0].ok()) << toInt(r3[0].error());
  EXPECT_EQ(*r3[0], kSize);
  ASSERT_EQ(w.putSessionEnd({"sess"}), std::vector<ErrorCode>{ErrorCode::OK});
  auto g = w.get("sess");
  ASSERT_TRUE(g.ok()) << toInt(g.error());
  EXPECT_EQ(*g, v);
}

}  // namespace
}  // namespace mooncake::test
