// Inbox: the shared-memory notification/message rings. Several producer threads, a producer
// in another process, a full ring under a deadline, fragmented messages.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/inbox.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

using test::msSince;
using test::SteadyClock;

std::string inboxName() {
  static std::atomic<int> n{0};
  return "/mc-test-inbox-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

std::unique_ptr<Inbox> makeInbox(uint32_t slots) {
  auto r = Inbox::create(inboxName(), slots);
  EXPECT_TRUE(r.ok()) << r.status().toString();
  return r.ok() ? std::move(r).value() : nullptr;
}

TEST(InboxTest, PushPopInOrder) {
  auto box = makeInbox(16);
  ASSERT_TRUE(box);
  uint64_t src = 0, tag = 0;
  EXPECT_FALSE(box->popNotify(&src, &tag)) << "empty";
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(box->pushNotify(7, 100 + i, deadlineInMs(100)).ok());
  for (uint64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(box->popNotify(&src, &tag));
    EXPECT_EQ(src, 7u);
    EXPECT_EQ(tag, 100 + i);
  }
  EXPECT_FALSE(box->popNotify(&src, &tag));
  ASSERT_TRUE(box->pushNotify(1, ~uint64_t{0}, deadlineInMs(100)).ok());
  ASSERT_TRUE(box->waitNotify(&src, &tag, deadlineInMs(100)));
  EXPECT_EQ(tag, ~uint64_t{0}) << "all 64 bits of a tag survive";
}

TEST(InboxTest, FullRingReturnsErrorAtDeadline) {
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  int pushed = 0;
  Status st;
  auto t0 = SteadyClock::now();
  while (pushed < 10000) {
    st = box->pushNotify(1, pushed, deadlineInMs(50));
    if (!st.ok()) break;
    ++pushed;
  }
  EXPECT_FALSE(st.ok()) << "a ring of 8 slots took " << pushed << " notifications";
  EXPECT_GE(pushed, 8);
  EXPECT_LT(msSince(t0), 2000) << "push on a full ring overran its deadline";
  EXPECT_NE(st.code(), Code::kOk);
  // After draining one slot, a push succeeds again; order is kept.
  uint64_t src, tag;
  ASSERT_TRUE(box->popNotify(&src, &tag));
  EXPECT_EQ(tag, 0u);
  EXPECT_TRUE(box->pushNotify(1, 999, deadlineInMs(50)).ok());
  for (int i = 1; i < pushed; ++i) {
    ASSERT_TRUE(box->popNotify(&src, &tag));
    EXPECT_EQ(tag, static_cast<uint64_t>(i));
  }
  ASSERT_TRUE(box->popNotify(&src, &tag));
  EXPECT_EQ(tag, 999u);
}

TEST(InboxTest, WaitOnEmptyHonoursDeadline) {
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  uint64_t src, tag;
  auto t0 = SteadyClock::now();
  EXPECT_FALSE(box->waitNotify(&src, &tag, deadlineInMs(150)));
  double ms = msSince(t0);
  EXPECT_GE(ms, 100);
  EXPECT_LT(ms, 1500);
  Inbox::Fragment f;
  t0 = SteadyClock::now();
  EXPECT_FALSE(box->waitFragment(&f, deadlineInMs(100)));
  EXPECT_LT(msSince(t0), 1500);
}

// Four producer threads (through attached handles, as peers push) and two consumers: every
// notification arrives exactly once and each producer's arrive in its order.
TEST(InboxTest, ManyProducersManyConsumers) {
  auto box = makeInbox(64);
  ASSERT_TRUE(box);
  constexpr int kProducers = 4, kPer = 20000;
  std::atomic<int> push_errors{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      auto h = Inbox::attach(box->shmName());
      if (!h.ok()) {
        push_errors++;
        return;
      }
      for (int i = 0; i < kPer; ++i)
        if (!h.value()->pushNotify(p, i, deadlineInMs(10000)).ok()) push_errors++;
    });
  }
  std::mutex mu;
  std::vector<std::vector<uint64_t>> seen(kProducers);
  std::atomic<int> total{0}, order_errors{0};
  std::vector<std::thread> consumers;
  for (int c = 0; c < 2; ++c) {
    consumers.emplace_back([&] {
      std::vector<int64_t> last(kProducers, -1);
      uint64_t src, tag;
      while (total.load() < kProducers * kPer) {
        if (!box->waitNotify(&src, &tag, deadlineInMs(100))) continue;
        total++;
        if (src >= kProducers) {
          order_errors++;
          continue;
        }
        // One consumer's view of one producer is increasing (FIFO ring).
        if (static_cast<int64_t>(tag) <= last[src]) order_errors++;
        last[src] = static_cast<int64_t>(tag);
        std::lock_guard<std::mutex> g(mu);
        seen[src].push_back(tag);
      }
    });
  }
  for (auto& t : producers) t.join();
  auto t0 = SteadyClock::now();
  for (auto& t : consumers) t.join();
  EXPECT_LT(msSince(t0), 20000);
  EXPECT_EQ(push_errors.load(), 0);
  EXPECT_EQ(order_errors.load(), 0);
  for (int p = 0; p < kProducers; ++p) {
    auto& v = seen[p];
    std::sort(v.begin(), v.end());
    ASSERT_EQ(v.size(), static_cast<size_t>(kPer)) << "producer " << p;
    for (int i = 0; i < kPer; ++i) ASSERT_EQ(v[i], static_cast<uint64_t>(i)) << "producer " << p;
  }
}

// A producer in another process (fork, before this test starts any thread), waking a consumer
// that sleeps on the futex.
TEST(InboxTest, ProducerInAnotherProcess) {
  auto box = makeInbox(32);
  ASSERT_TRUE(box);
  constexpr int kCount = 5000;
  const std::string name = box->shmName();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto h = Inbox::attach(name);
    if (!h.ok()) _exit(2);
    usleep(50 * 1000);  // let the parent block in waitNotify first
    for (int i = 0; i < kCount; ++i)
      if (!h.value()->pushNotify(42, i, deadlineInMs(10000)).ok()) _exit(3);
    std::string msg(3 * Inbox::kFragmentBytes + 11, '\0');
    test::fillPattern(msg.data(), msg.size(), 8, 0);
    if (!h.value()->pushMessage(42, 5, msg, deadlineInMs(10000)).ok()) _exit(4);
    _exit(0);
  }
  uint64_t src, tag;
  int got = 0;
  auto t0 = SteadyClock::now();
  while (got < kCount && msSince(t0) < 20000) {
    if (!box->waitNotify(&src, &tag, deadlineInMs(1000))) continue;
    EXPECT_EQ(src, 42u);
    EXPECT_EQ(tag, static_cast<uint64_t>(got));
    ++got;
  }
  EXPECT_EQ(got, kCount);
  std::string msg;
  Inbox::Fragment f;
  while (msSince(t0) < 20000) {
    if (!box->waitFragment(&f, deadlineInMs(1000))) continue;
    EXPECT_EQ(f.channel, 5u);
    EXPECT_EQ(f.offset, msg.size()) << "fragments of one producer arrive in order";
    msg += f.data;
    if (msg.size() >= f.total) break;
  }
  EXPECT_EQ(msg.size(), 3 * Inbox::kFragmentBytes + 11);
  EXPECT_EQ(test::checkPattern(msg.data(), msg.size(), 8, 0), "");
  int ws = 0;
  ASSERT_EQ(waitpid(pid, &ws, 0), pid);
  EXPECT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0) << "producer exit status " << ws;
}

TEST(InboxTest, MessagesFragmentAndReassemble) {
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  auto prod = Inbox::attach(box->shmName());
  ASSERT_TRUE(prod.ok()) << prod.status().toString();
  const std::vector<size_t> sizes = {0, 1, Inbox::kFragmentBytes - 1, Inbox::kFragmentBytes,
                                     Inbox::kFragmentBytes + 1, 5 * Inbox::kFragmentBytes + 3};
  std::thread t([&] {
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::string m(sizes[i], '\0');
      test::fillPattern(m.data(), m.size(), 100 + i, 0);
      Status st = prod.value()->pushMessage(9, static_cast<uint32_t>(i), m, deadlineInMs(10000));
      EXPECT_TRUE(st.ok()) << st.toString();
    }
  });
  std::map<uint64_t, std::string> partial;
  size_t done = 0;
  auto t0 = SteadyClock::now();
  while (done < sizes.size() && msSince(t0) < 10000) {
    Inbox::Fragment f;
    if (!box->waitFragment(&f, deadlineInMs(500))) continue;
    std::string& m = partial[f.msg_id];
    EXPECT_EQ(f.offset, m.size());
    m += f.data;
    if (m.size() == f.total) {
      ASSERT_LT(f.channel, sizes.size());
      EXPECT_EQ(m.size(), sizes[f.channel]);
      EXPECT_EQ(test::checkPattern(m.data(), m.size(), 100 + f.channel, 0), "");
      partial.erase(f.msg_id);
      ++done;
    }
  }
  t.join();
  EXPECT_EQ(done, sizes.size());
  std::string too_big(Inbox::kMaxMessageBytes + 1, 'x');
  EXPECT_FALSE(prod.value()->pushMessage(9, 1, too_big, deadlineInMs(100)).ok());
}

// Message ids stay unique across a sender's attachments of one inbox (a peer opened again
// attaches anew): the receiver keys a message's fragments by (sender, id).
TEST(InboxTest, MessageIdsNeverRepeatAcrossAttachments) {
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  const std::string m(2 * Inbox::kFragmentBytes + 1, 'm');
  for (int round = 0; round < 3; ++round) {
    auto prod = Inbox::attach(box->shmName());
    ASSERT_TRUE(prod.ok()) << prod.status().toString();
    ASSERT_TRUE(prod.value()->pushMessage(9, 1, m, deadlineInMs(1000)).ok());
  }
  std::vector<uint64_t> ids;
  Inbox::Fragment f;
  while (box->popFragment(&f))
    if (f.offset == 0) ids.push_back(f.msg_id);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], ids[2]);
}

// The fragments of one process's multi-fragment messages to an inbox never interleave, from
// several threads and several attachments at once (the receiver takes a new message's first
// fragment as the end of whatever part of that sender it held).
TEST(InboxTest, MultiFragmentMessagesOfOneProcessDoNotInterleave) {
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  auto p1 = Inbox::attach(box->shmName());
  auto p2 = Inbox::attach(box->shmName());
  ASSERT_TRUE(p1.ok() && p2.ok());
  constexpr int kThreads = 3, kEach = 30;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      Inbox* p = (t == 0 ? p2 : p1).value().get();
      std::string m(3 * Inbox::kFragmentBytes + t, static_cast<char>('a' + t));
      for (int i = 0; i < kEach; ++i)
        EXPECT_TRUE(p->pushMessage(9, static_cast<uint32_t>(t), m, deadlineInMs(10000)).ok());
    });
  int done = 0, interleaved = 0;
  uint64_t open_id = 0;
  bool open = false;
  auto t0 = SteadyClock::now();
  while (done < kThreads * kEach && msSince(t0) < 20000) {
    Inbox::Fragment f;
    if (!box->waitFragment(&f, deadlineInMs(500))) continue;
    if (f.offset == 0) {
      interleaved += open;
      open = true;
      open_id = f.msg_id;
    } else if (!open || f.msg_id != open_id) {
      ++interleaved;
    }
    if (f.offset + f.data.size() == f.total) {
      open = false;
      ++done;
    }
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(done, kThreads * kEach);
  EXPECT_EQ(interleaved, 0);
}

TEST(InboxTest, AttachRejectsMissingOrForeignFiles) {
  EXPECT_FALSE(Inbox::attach("/mc-test-no-such-inbox").ok());
  auto box = makeInbox(8);
  ASSERT_TRUE(box);
  const std::string name = box->shmName();
  box.reset();
  EXPECT_FALSE(Inbox::attach(name).ok()) << "the owner unlinks its inbox";
}

}  // namespace
}  // namespace mooncake::engine
