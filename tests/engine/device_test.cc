// The device layer (engine/device/device.h): its host simulation, what the verbs emulator and
// the engine's GPU-memory paths are tested over, and the choice by name.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "engine/device/device.h"
#include "mooncake/config.h"
#include "tests/engine/test_util.h"

namespace mooncake::test {
namespace {

using engine::device::Device;

std::unique_ptr<Device> sim() {
  auto d = engine::device::make("sim");
  EXPECT_TRUE(d.ok()) << d.status().toString();
  return d.ok() ? std::move(d).value() : nullptr;
}

// Host code cannot touch the simulation's device memory (as on a GPU): the tests move bytes in
// and out with the layer's copies.
Status copyWait(Device& d, void* dst, const void* src, size_t len, int ordinal) {
  MC_RETURN_IF_ERROR(d.copyAsync(dst, src, len, ordinal));
  MC_ASSIGN_OR_RETURN(std::unique_ptr<engine::device::Event> ev, d.record(ordinal));
  return ev->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10));
}

std::string bytes(size_t len, int mul, int add) {
  std::string s(len, '\0');
  for (size_t i = 0; i < len; ++i) s[i] = static_cast<char>(i * mul + add);
  return s;
}

TEST(DeviceSim, AllocationsAreDeviceMemoryOfTheirOrdinal) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  EXPECT_STREQ(d->name(), "sim");
  const size_t len = 3 * 4096 + 100;
  auto p = d->allocate(len, 2);
  ASSERT_TRUE(p.ok()) << p.status().toString();
  char* c = static_cast<char*>(*p);
  for (const void* q : {static_cast<const void*>(c), static_cast<const void*>(c + len - 1)}) {
    auto info = d->pointer(q);
    EXPECT_TRUE(info.device);
    EXPECT_EQ(info.ordinal, 2);
  }
  int host = 0;
  EXPECT_FALSE(d->pointer(&host).device);
  EXPECT_FALSE(d->allocate(4096, engine::device::kSimDevices).ok());
  EXPECT_FALSE(d->allocate(4096, -1).ok());
  EXPECT_TRUE(d->free(c).ok());
  EXPECT_FALSE(d->pointer(c).device) << "freed memory still counts as device memory";
  EXPECT_FALSE(d->free(c).ok()) << "a second free was accepted";
  EXPECT_FALSE(d->free(&host).ok());
}

// The dma-buf of a range maps the same pages: what is written through the allocation is read
// through the dma-buf's mapping and back (the verbs emulator registers GPU memory this way).
TEST(DeviceSim, DmabufMapsTheSamePages) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 4 * 4096;
  auto p = d->allocate(len, 0);
  ASSERT_TRUE(p.ok()) << p.status().toString();
  char* c = static_cast<char*>(*p);
  const std::string pattern = bytes(len, 7, 1);
  ASSERT_TRUE(copyWait(*d, c, pattern.data(), len, 0).ok());
  const size_t off = 5000, n = 6000;
  auto buf = d->exportDmabuf(c + off, n);
  ASSERT_TRUE(buf.ok()) << buf.status().toString();
  EXPECT_EQ(buf->offset, off);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t lo = buf->offset / page * page;
  void* m = mmap(nullptr, buf->offset - lo + n, PROT_READ | PROT_WRITE, MAP_SHARED, buf->fd,
                 static_cast<off_t>(lo));
  ASSERT_NE(m, MAP_FAILED);
  char* v = static_cast<char*>(m) + (buf->offset - lo);
  EXPECT_EQ(std::memcmp(v, pattern.data() + off, n), 0);
  std::memset(v, 0x5a, 16);
  std::string back(16, '\0');
  ASSERT_TRUE(copyWait(*d, back.data(), c + off, 16, 0).ok());
  EXPECT_EQ(back, std::string(16, '\x5a'));
  munmap(m, buf->offset - lo + n);
  close(buf->fd);
  EXPECT_FALSE(d->exportDmabuf(c + len - 10, 20).ok()) << "a range past the allocation";
  int host = 0;
  EXPECT_FALSE(d->exportDmabuf(&host, sizeof host).ok());
  EXPECT_TRUE(d->free(c).ok());
}

// Copies run on the device's stream in the order queued (the second reads what the first
// wrote) and an event completes only after the copies queued before it.
TEST(DeviceSim, CopiesRunInOrderAndEventsFollowThem) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 4u << 20;
  auto a = d->allocate(len, 1), b = d->allocate(len, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  std::string host(len, '\0');
  for (size_t i = 0; i < len; ++i) host[i] = static_cast<char>(i * 13 + 5);
  auto idle = d->record(1);
  ASSERT_TRUE(idle.ok());
  EXPECT_TRUE((*idle)->done()) << "an event with nothing before it";
  const std::string zeros(len, '\0');
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(d->copyAsync(*b, zeros.data(), len, 1).ok());
    ASSERT_TRUE(d->copyAsync(*a, host.data(), len, 1).ok());  // host -> device
    ASSERT_TRUE(d->copyAsync(*b, *a, len, 1).ok());           // device -> device, after it
    std::string back(len, '\1');
    ASSERT_TRUE(d->copyAsync(back.data(), *b, len, 1).ok());  // device -> host, after that
    auto ev = d->record(1);
    ASSERT_TRUE(ev.ok());
    ASSERT_TRUE((*ev)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)).ok());
    EXPECT_TRUE((*ev)->done());
    ASSERT_TRUE(back == host) << "round " << round;
  }
  // recordOn: the copy stream named as waitWord names it; the simulation has no other stream.
  ASSERT_TRUE(d->copyAsync(*b, *a, len, 1).ok());
  auto on = d->recordOn(1, engine::device::kCopyStream);
  ASSERT_TRUE(on.ok()) << on.status().toString();
  EXPECT_TRUE((*on)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)).ok());
  EXPECT_EQ(d->recordOn(1, nullptr).status().code(), Code::kNotSupported);
  EXPECT_FALSE(d->copyAsync(*a, *b, 16, engine::device::kSimDevices).ok());
  // A copy that runs past an allocation's end is refused, from either side of it.
  EXPECT_FALSE(d->copyAsync(static_cast<char*>(*a) + len - 8, host.data(), 16, 1).ok());
  EXPECT_FALSE(d->copyAsync(host.data(), static_cast<char*>(*a) + len - 8, 16, 1).ok());
  EXPECT_TRUE(d->free(*a).ok());
  EXPECT_TRUE(d->free(*b).ok());
}

// As on a GPU, host code cannot load or store device memory: it faults. (So a path that
// memcpy's GPU memory crashes in the tests here, not first on a GPU machine.)
TEST(DeviceSimDeathTest, HostAccessToDeviceMemoryFaults) {
#ifdef GTEST_FLAG_SET
  GTEST_FLAG_SET(death_test_style, "threadsafe");
#else
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
#endif
  auto d = sim();
  ASSERT_NE(d, nullptr);
  auto p = d->allocate(4096, 0);
  ASSERT_TRUE(p.ok());
  volatile char* c = static_cast<volatile char*>(*p);
  EXPECT_DEATH(c[0] = 1, "");
  EXPECT_DEATH((void)c[100], "");
  EXPECT_TRUE(d->free(*p).ok());
}

// An IPC handle maps the allocation in another process (a forked child with its own device
// layer): it reads what the exporter wrote and the exporter sees what it writes; the exporter
// itself cannot open its own handle, and what was opened is closed with closeIpc, not freed.
TEST(DeviceSim, IpcHandleMapsTheAllocationInAnotherProcess) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 1u << 16;
  auto a = d->allocate(len, 3);
  ASSERT_TRUE(a.ok());
  char* c = static_cast<char*>(*a);
  const std::string pattern = bytes(len, 3, 1);
  ASSERT_TRUE(copyWait(*d, c, pattern.data(), len, 3).ok());
  uint64_t off = 0;
  auto h = d->exportIpc(c + 4096, &off);
  ASSERT_TRUE(h.ok()) << h.status().toString();
  EXPECT_EQ(off, 4096u);
  EXPECT_FALSE(d->openIpc(*h).ok()) << "a process opened its own IPC handle";
  EXPECT_FALSE(d->openIpc("sim 1 2").ok());
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = engine::device::make("sim");
    if (!mine.ok()) _exit(10);
    auto base = (*mine)->openIpc(*h);
    if (!base.ok()) _exit(11);
    char* v = static_cast<char*>(*base);
    std::string got(len, '\0');
    if (!copyWait(**mine, got.data(), v, len, 3).ok() || got != pattern) _exit(12);
    auto info = (*mine)->pointer(v + 100);
    if (!info.device || info.ordinal != 3) _exit(13);
    if ((*mine)->free(v).ok()) _exit(14);
    const std::string sevens(100, '\x77');
    if (!copyWait(**mine, v, sevens.data(), 100, 3).ok()) _exit(17);
    if (!(*mine)->closeIpc(v).ok()) _exit(15);
    if ((*mine)->pointer(v).device) _exit(16);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child failed at step " << WEXITSTATUS(status) - 10;
  std::string back(101, '\0');
  ASSERT_TRUE(copyWait(*d, back.data(), c, 101, 3).ok());
  EXPECT_EQ(back.substr(0, 100), std::string(100, '\x77')) << "the child's write is not seen";
  EXPECT_EQ(back[100], static_cast<char>(100 * 3 + 1));
  EXPECT_TRUE(d->free(c).ok());
}

// A stream held by a host word (what Work.wait() queues on the caller's stream, gpu_tensors.h):
// what follows the wait runs once the word reaches the value, compared cyclically; a host
// thread waiting for the stream does not run the gate itself (it keeps its deadline).
// What pg/stream_ops.h builds on: words in device memory written by one stream (writeWord,
// after its earlier work) and waited on by another (waitWord), and storeWord releasing a wait
// from the host; here two devices' streams of one layer stand in for two processes' streams.
TEST(DeviceSim, StreamsMeetOnWordsInDeviceMemory) {
  using engine::device::kCopyStream;
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 1u << 16;
  auto words = d->allocate(4096, 3);
  auto a = d->allocate(len, 3);
  auto b = d->allocate(len, 4);
  ASSERT_TRUE(words.ok() && a.ok() && b.ok());
  uint32_t* w = static_cast<uint32_t*>(*words);
  const auto far = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(10); };
  for (int i = 0; i < 4; ++i) MC_ASSERT_OK(d->storeWord(&w[i], 0, far()));
  const std::string host = bytes(len, 5, 9), zeros(len, '\0');
  ASSERT_TRUE(copyWait(*d, *b, zeros.data(), len, 4).ok());

  // Stream 4 waits for word 0, then copies a -> b; stream 3 fills a, then raises word 0.
  MC_ASSERT_OK(d->waitWord(4, kCopyStream, &w[0], 1));
  MC_ASSERT_OK(d->copyAsync(*b, *a, len, 4));
  auto ev4 = d->record(4);
  ASSERT_TRUE(ev4.ok());
  auto soon = [] { return std::chrono::steady_clock::now() + std::chrono::milliseconds(30); };
  EXPECT_EQ((*ev4)->wait(soon()).code(), Code::kTimeout) << "ran past a closed device word";
  MC_ASSERT_OK(d->copyAsync(*a, host.data(), len, 3));
  MC_ASSERT_OK(d->writeWord(3, kCopyStream, &w[0], 1));
  MC_EXPECT_OK((*ev4)->wait(far()));
  std::string back(len, '\1');
  ASSERT_TRUE(copyWait(*d, back.data(), *b, len, 4).ok());
  EXPECT_TRUE(back == host) << "the copy behind the word did not see the data written before it";

  // A wait nobody will open is released from the host.
  MC_ASSERT_OK(d->waitWord(4, kCopyStream, &w[1], 7));
  auto held = d->record(4);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ((*held)->wait(soon()).code(), Code::kTimeout);
  MC_ASSERT_OK(d->storeWord(&w[1], 7u + (1u << 30), far()));
  MC_EXPECT_OK((*held)->wait(far()));
  // storeWord takes device memory only; the simulation has its copy streams only.
  uint32_t on_host = 0;
  EXPECT_EQ(d->storeWord(&on_host, 1, far()).code(), Code::kInvalidArgument);
  int not_a_stream = 0;
  EXPECT_EQ(d->writeWord(3, &not_a_stream, &w[2], 1).code(), Code::kNotSupported);
  EXPECT_EQ(d->copyAsyncOn(*a, *b, 16, 3, &not_a_stream).code(), Code::kNotSupported);
  EXPECT_TRUE(d->free(*a).ok());
  EXPECT_TRUE(d->free(*b).ok());
  EXPECT_TRUE(d->free(*words).ok());
}

TEST(DeviceSim, AHostWordHoldsTheStream) {
  using engine::device::kCopyStream;
  auto d = sim();
  ASSERT_NE(d, nullptr);
  auto words = d->allocHostWords(4);
  ASSERT_TRUE(words.ok()) << words.status().toString();
  uint32_t* w = *words;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(w[i], 0u) << "words start zeroed";
  const size_t len = 1u << 16;
  auto a = d->allocate(len, 2);
  ASSERT_TRUE(a.ok());
  const std::string host = bytes(len, 7, 3), zeros(len, '\0');
  ASSERT_TRUE(copyWait(*d, *a, zeros.data(), len, 2).ok());

  // Cyclic: 0xfffffff0 is "before" 0x10 (the word wrapped past the value's use).
  w[1] = 0xfffffff0u;
  ASSERT_TRUE(d->waitWord(2, kCopyStream, &w[1], 0x10u).ok());
  ASSERT_TRUE(d->copyAsync(*a, host.data(), len, 2).ok());
  auto ev = d->record(2);
  ASSERT_TRUE(ev.ok());
  auto soon = [] { return std::chrono::steady_clock::now() + std::chrono::milliseconds(30); };
  Status st = (*ev)->wait(soon());
  EXPECT_EQ(st.code(), Code::kTimeout) << "the copy ran past a closed gate: " << st.toString();
  EXPECT_FALSE((*ev)->done());
  __atomic_store_n(&w[1], 0x0fu, __ATOMIC_RELEASE);  // one short of the value
  EXPECT_EQ((*ev)->wait(soon()).code(), Code::kTimeout);
  __atomic_store_n(&w[1], 0x10u, __ATOMIC_RELEASE);
  MC_EXPECT_OK((*ev)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  std::string back(len, '\1');
  ASSERT_TRUE(copyWait(*d, back.data(), *a, len, 2).ok());
  EXPECT_TRUE(back == host) << "the copy behind the gate did not run once it opened";

  // A value already reached (or passed) does not hold the stream.
  ASSERT_TRUE(d->waitWord(2, kCopyStream, &w[1], 0x0fu).ok());
  ASSERT_TRUE(copyWait(*d, back.data(), *a, len, 2).ok());
  // The simulation has no streams but its copy streams and newStream's; a bad device is
  // refused.
  int not_a_stream = 0;
  EXPECT_FALSE(d->waitWord(2, &not_a_stream, &w[2], 1).ok());
  EXPECT_FALSE(d->waitWord(engine::device::kSimDevices, kCopyStream, &w[2], 1).ok());
  EXPECT_TRUE(d->free(*a).ok());
}

// Streams of the layer's own (newStream) run beside the copy stream, and one waits for an
// event of another (waitEvent): what stream-ordered send/recv is built on (pg/stream_p2p.h).
TEST(DeviceSim, MadeStreamsWaitForEventsOfOthers) {
  using engine::device::kCopyStream;
  auto d = sim();
  ASSERT_NE(d, nullptr);
  auto words = d->allocHostWords(1);
  ASSERT_TRUE(words.ok());
  uint32_t* w = *words;
  const size_t len = 1u << 16;
  auto a = d->allocate(len, 1);
  auto b = d->allocate(len, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  auto s = d->newStream(1);
  ASSERT_TRUE(s.ok()) << s.status().toString();
  const std::string host = bytes(len, 5, 9);
  // The copy stream: held by a gate, then fills a. The made stream: waits for the copy
  // stream's event after that, then copies a into b.
  ASSERT_TRUE(d->waitWord(1, kCopyStream, w, 1).ok());
  ASSERT_TRUE(d->copyAsync(*a, host.data(), len, 1).ok());
  auto filled = d->record(1);
  ASSERT_TRUE(filled.ok());
  MC_EXPECT_OK(d->waitEvent(1, *s, **filled));
  MC_EXPECT_OK(d->copyAsyncOn(*b, *a, len, 1, *s));
  auto copied = d->recordOn(1, *s);
  ASSERT_TRUE(copied.ok()) << copied.status().toString();
  auto soon = [] { return std::chrono::steady_clock::now() + std::chrono::milliseconds(30); };
  EXPECT_EQ((*copied)->wait(soon()).code(), Code::kTimeout)
      << "the made stream ran past an event that had not completed";
  // Meanwhile the made stream takes other work only behind its wait; another made stream is
  // not held by it.
  auto s2 = d->newStream(1);
  ASSERT_TRUE(s2.ok());
  EXPECT_NE(*s2, *s);
  auto free_run = d->recordOn(1, *s2);
  ASSERT_TRUE(free_run.ok());
  MC_EXPECT_OK((*free_run)->wait(soon()));
  __atomic_store_n(w, 1u, __ATOMIC_RELEASE);
  MC_EXPECT_OK((*copied)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  std::string back(len, '\0');
  ASSERT_TRUE(copyWait(*d, back.data(), *b, len, 1).ok());
  EXPECT_TRUE(back == host) << "the made stream copied before the event it waited for";
  MC_EXPECT_OK(d->freeStream(1, *s));
  MC_EXPECT_OK(d->freeStream(1, *s2));
  EXPECT_FALSE(d->freeStream(1, *s).ok()) << "a stream freed twice";
  EXPECT_FALSE(d->copyAsyncOn(*b, *a, len, 1, *s).ok()) << "a freed stream took work";
  EXPECT_FALSE(d->newStream(engine::device::kSimDevices).ok());
  EXPECT_TRUE(d->free(*a).ok());
  EXPECT_TRUE(d->free(*b).ok());
}

// CUDA-graph capture over the simulation: what a capturing stream (and a stream that joined
// it through an event) queued runs only when the graph is launched, again on every launch,
// reading the memory as it is then; a host wait inside the capture invalidates it.
TEST(DeviceSim, CapturedWorkRunsOnEachLaunchOfTheGraph) {
  using engine::device::kCopyStream;
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 4096;
  auto a = d->allocate(len, 0);
  auto b = d->allocate(len, 0);
  auto c = d->allocate(len, 0);
  auto side = d->newStream(0);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && side.ok());
  const std::string one = bytes(len, 3, 1), two = bytes(len, 7, 2);
  ASSERT_TRUE(copyWait(*d, *a, one.data(), len, 0).ok());
  EXPECT_FALSE(d->capturing(0, kCopyStream));
  MC_ASSERT_OK(d->beginCapture(0, kCopyStream));
  EXPECT_TRUE(d->capturing(0, kCopyStream));
  EXPECT_FALSE(d->capturing(0, *side));
  // a -> b on the capturing stream; the side stream joins (an event of the capture) and
  // copies b -> c; the capturing stream waits for it (the join).
  MC_EXPECT_OK(d->copyAsyncOn(*b, *a, len, 0, kCopyStream));
  auto fork = d->recordOn(0, kCopyStream);
  ASSERT_TRUE(fork.ok());
  MC_EXPECT_OK(d->waitEvent(0, *side, **fork));
  EXPECT_TRUE(d->capturing(0, *side)) << "a stream that waited on a captured event joins it";
  MC_EXPECT_OK(d->copyAsyncOn(*c, *b, len, 0, *side));
  auto join = d->recordOn(0, *side);
  ASSERT_TRUE(join.ok());
  MC_EXPECT_OK(d->waitEvent(0, kCopyStream, **join));
  auto graph = d->endCapture(0, kCopyStream);
  ASSERT_TRUE(graph.ok()) << graph.status().toString();
  EXPECT_FALSE(d->capturing(0, kCopyStream));
  EXPECT_FALSE(d->capturing(0, *side));
  std::string back(len, '\0');
  ASSERT_TRUE(copyWait(*d, back.data(), *c, len, 0).ok());
  EXPECT_NE(back, one) << "captured work ran during the capture";
  for (const std::string* want : {&one, &two}) {
    ASSERT_TRUE(copyWait(*d, *a, want->data(), len, 0).ok());
    MC_EXPECT_OK(d->launchGraph(**graph, 0, kCopyStream));
    ASSERT_TRUE(copyWait(*d, back.data(), *c, len, 0).ok());
    EXPECT_TRUE(back == *want) << "a launch of the graph did not run its copies again";
  }
  // A host wait for an event recorded in a capture fails, and so does the capture.
  MC_ASSERT_OK(d->beginCapture(0, *side));
  EXPECT_FALSE(d->beginCapture(0, *side).ok()) << "a capture begun twice";
  MC_EXPECT_OK(d->copyAsyncOn(*b, *a, len, 0, *side));
  auto inside = d->recordOn(0, *side);
  ASSERT_TRUE(inside.ok());
  EXPECT_FALSE((*inside)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(1)).ok());
  auto bad = d->endCapture(0, *side);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().toString().find("host waited"), std::string::npos)
      << bad.status().toString();
  EXPECT_FALSE(d->endCapture(0, *side).ok()) << "a capture ended twice";
  // A stream that joined must be joined back (its work waited for by the capturing stream),
  // and an event of an ended capture cannot be waited on.
  MC_ASSERT_OK(d->beginCapture(0, kCopyStream));
  auto fork2 = d->recordOn(0, kCopyStream);
  ASSERT_TRUE(fork2.ok());
  MC_EXPECT_OK(d->waitEvent(0, *side, **fork2));
  MC_EXPECT_OK(d->copyAsyncOn(*c, *b, len, 0, *side));
  auto unjoined = d->endCapture(0, kCopyStream);
  ASSERT_FALSE(unjoined.ok()) << "a capture ended with a stream's work not joined back";
  EXPECT_NE(unjoined.status().toString().find("unjoined"), std::string::npos);
  EXPECT_FALSE(d->waitEvent(0, *side, **fork2).ok()) << "a wait on an ended capture's event";
  EXPECT_FALSE(d->capturing(0, *side));
  MC_EXPECT_OK(d->freeStream(0, *side));
  for (void* p : {*a, *b, *c}) EXPECT_TRUE(d->free(p).ok());
}

// Pinned host memory: copies between it and device memory are not counted as pageable, copies
// from other host memory are; ranges do not overlap; PinnedRange unpins when it goes.
TEST(DeviceSim, PinnedHostMemoryAndPageableCopies) {
  auto d = sim();
  ASSERT_NE(d, nullptr);
  const size_t len = 1u << 16, half = len / 2;
  auto dev = d->allocate(len, 0);
  ASSERT_TRUE(dev.ok());
  std::string pinned = bytes(len, 3, 1), loose = bytes(len, 5, 2);
  const uint64_t before = d->pageableCopies();
  {
    engine::device::PinnedRange pin(d.get(), pinned.data(), half);
    EXPECT_EQ(d->pinHost(pinned.data() + 100, 10).code(), Code::kAlreadyExists)
        << "overlapping pins";
    EXPECT_EQ(d->pinHost(*dev, 10).code(), Code::kInvalidArgument) << "device memory pinned";
    ASSERT_TRUE(copyWait(*d, *dev, pinned.data(), half, 0).ok());
    ASSERT_TRUE(copyWait(*d, pinned.data() + 8, *dev, half - 8, 0).ok());
    EXPECT_EQ(d->pageableCopies(), before) << "copies of pinned memory counted";
    ASSERT_TRUE(copyWait(*d, *dev, loose.data(), len, 0).ok());
    EXPECT_EQ(d->pageableCopies(), before + 1);
    ASSERT_TRUE(copyWait(*d, *dev, pinned.data(), len, 0).ok());  // runs past the pinned half
    EXPECT_EQ(d->pageableCopies(), before + 2);
    ASSERT_TRUE(copyWait(*d, loose.data(), pinned.data(), len, 0).ok());  // host to host
    EXPECT_EQ(d->pageableCopies(), before + 2) << "a host-to-host copy counted";
  }
  EXPECT_EQ(d->unpinHost(pinned.data()).code(), Code::kInvalidArgument)
      << "PinnedRange did not unpin (or unpinned twice)";
  MC_EXPECT_OK(d->pinHost(pinned.data(), len));
  MC_EXPECT_OK(d->unpinHost(pinned.data()));
  EXPECT_TRUE(d->free(*dev).ok());
}

// The process's gates: closed when handed out, opened once, and a word handed out again holds
// a stream with its next value while a stream waiting on its earlier use goes on.
class DeviceGates : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { setenv("MC_DEVICE", "sim", 1); }
};

TEST_F(DeviceGates, OpenOnceAndReuseWithTheNextValue) {
  using engine::device::kCopyStream;
  auto layer = engine::device::get();
  ASSERT_TRUE(layer.ok()) << layer.status().toString();
  ASSERT_STREQ((*layer)->name(), "sim");
  auto g1 = engine::device::acquireGate();
  ASSERT_TRUE(g1.ok()) << g1.status().toString();
  EXPECT_LT(static_cast<int32_t>(__atomic_load_n(g1->word, __ATOMIC_ACQUIRE) - g1->value), 0)
      << "a gate handed out is closed";
  auto g2 = engine::device::acquireGate();
  ASSERT_TRUE(g2.ok());
  EXPECT_NE(g1->word, g2->word) << "two closed gates share a word";

  ASSERT_TRUE((*layer)->waitWord(5, kCopyStream, g1->word, g1->value).ok());
  auto ev = (*layer)->record(5);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ((*ev)->wait(std::chrono::steady_clock::now() + std::chrono::milliseconds(30)).code(),
            Code::kTimeout);
  engine::device::openGate(*g1);
  MC_EXPECT_OK((*ev)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)));

  // g1's word comes back (the pool is last in, first out) with the next value: closed again,
  // and a wait on the old value still passes.
  auto g3 = engine::device::acquireGate();
  ASSERT_TRUE(g3.ok());
  EXPECT_EQ(g3->word, g1->word);
  EXPECT_EQ(g3->value, g1->value + 1);
  ASSERT_TRUE((*layer)->waitWord(5, kCopyStream, g1->word, g1->value).ok());
  auto passed = (*layer)->record(5);
  ASSERT_TRUE(passed.ok());
  MC_EXPECT_OK((*passed)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  ASSERT_TRUE((*layer)->waitWord(5, kCopyStream, g3->word, g3->value).ok());
  auto held = (*layer)->record(5);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(
      (*held)->wait(std::chrono::steady_clock::now() + std::chrono::milliseconds(30)).code(),
      Code::kTimeout);
  engine::device::openGate(*g3);
  engine::device::openGate(*g2);
  MC_EXPECT_OK((*held)->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
}

TEST(DeviceChoice, ByName) {
  auto bad = engine::device::make("tpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("MC_DEVICE=tpu"), std::string::npos)
      << bad.status().toString();
  auto none = engine::device::make("none");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("none"), std::string::npos);
  // cuda: the driver's layer where one is installed with a device (the GPU machine); here
  // an error that says why there is none, never a crash.
  auto cuda = engine::device::make("cuda");
  if (cuda.ok()) {
    EXPECT_STREQ((*cuda)->name(), "cuda");
    EXPECT_GE((*cuda)->count(), 1);
  } else {
    const std::string why = cuda.status().message();
    EXPECT_TRUE(why.find("CUDA") != std::string::npos) << why;
    EXPECT_EQ(cuda.status().code(), Code::kNotSupported) << why;
  }
}

}  // namespace
}  // namespace mooncake::test
