// P2pLanes: every lane that has work gets a thread, whatever the others are doing.
#include "torch_ext/csrc/p2p_lanes.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace mooncake::torch_ext {
namespace {

using namespace std::chrono_literals;

// A lane task from a plain function, with no completion.
template <typename F>
P2pLanes::Task task(F f) {
  return [f]() -> std::function<void()> {
    f();
    return nullptr;
  };
}

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  bool set = false;
  void notify() {
    std::lock_guard<std::mutex> lk(mu);
    set = true;
    cv.notify_all();
  }
  bool waitFor(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, d, [&] { return set; });
  }
};

// A task that blocks until a later task of another lane runs (a receive posted before the
// send it waits for, as irecv then isend to oneself), posted while exactly one lane thread
// is idle: the second post must not count on that thread, which the first one claimed.
TEST(P2pLanes, BlockedLaneDoesNotStarveALanePostedRightAfterIt) {
  for (int round = 0; round < 50; ++round) {
    P2pLanes lanes;
    Event first_done;
    lanes.post({0, 1, 0}, task([&] { first_done.notify(); }));
    ASSERT_TRUE(first_done.waitFor(5s));
    std::this_thread::sleep_for(5ms);  // its thread is idle now, the only one

    Event sent, received;
    std::atomic<bool> saw_send{false};
    lanes.post({0, 2, 1}, task([&] {  // "recv": waits for the "send" below
                 saw_send = sent.waitFor(2s);
                 received.notify();
               }));
    lanes.post({0, 2, 0}, task([&] { sent.notify(); }));  // "send"
    ASSERT_TRUE(received.waitFor(10s)) << "round " << round;
    ASSERT_TRUE(saw_send) << "round " << round
                          << ": the second lane ran only after the first gave up";
  }
}

// Tasks of one lane run in order, one at a time; other lanes run beside them.
TEST(P2pLanes, OneLaneInOrderOthersConcurrently) {
  P2pLanes lanes;
  std::mutex mu;
  std::vector<int> order;
  Event gate, other_ran;
  lanes.post({1, 0, 0}, task([&] {
               gate.waitFor(5s);
               std::lock_guard<std::mutex> lk(mu);
               order.push_back(0);
             }));
  for (int i = 1; i < 5; ++i)
    lanes.post({1, 0, 0}, task([&, i] {
                 std::lock_guard<std::mutex> lk(mu);
                 order.push_back(i);
               }));
  lanes.post({2, 0, 0}, task([&] { other_ran.notify(); }));
  EXPECT_TRUE(other_ran.waitFor(5s)) << "a lane waited behind another lane's blocked task";
  gate.notify();
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (order.size() == 5) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  std::lock_guard<std::mutex> lk(mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

// A task's completion (a Work's future callbacks) runs once the task no longer holds its lane:
// a callback that posts to the same lane and waits for it (a recv issued from a recv's
// callback) gets it run, with tasks queued behind it still in order; inline tasks too.
TEST(P2pLanes, CompletionMayPostToItsOwnLaneAndWait) {
  P2pLanes lanes;
  std::mutex mu;
  std::vector<int> order;
  auto record = [&](int i) {
    std::lock_guard<std::mutex> lk(mu);
    order.push_back(i);
  };
  Event nested_ran, all_done, completed;
  std::atomic<bool> waited{false};
  Event gate;
  lanes.post({3, 0, 1}, [&]() -> std::function<void()> {
    gate.waitFor(5s);  // the tasks below queue behind this one meanwhile
    record(0);
    return [&] {  // its completion: a callback that issues an op on the same lane, waits
      lanes.post({3, 0, 1}, task([&] {
                   record(9);
                   nested_ran.notify();
                 }));
      waited = nested_ran.waitFor(5s);
      completed.notify();
    };
  });
  for (int i = 1; i < 4; ++i) lanes.post({3, 0, 1}, task([&, i] { record(i); }));
  lanes.post({3, 0, 1}, task([&] { all_done.notify(); }));
  gate.notify();
  ASSERT_TRUE(all_done.waitFor(10s)) << "the lane stalled behind a completion";
  ASSERT_TRUE(completed.waitFor(10s)) << "the completion never ended";
  EXPECT_TRUE(waited) << "the completion's own post did not run while it waited";
  {
    std::lock_guard<std::mutex> lk(mu);
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 9})) << "issue order within the lane";
  }
  // Inline: the completion runs after the lane was released.
  Event inline_nested;
  std::atomic<bool> inline_waited{false};
  ASSERT_TRUE(lanes.runInline({4, 0, 0}, [&]() -> std::function<void()> {
    return [&] {
      lanes.post({4, 0, 0}, task([&] { inline_nested.notify(); }));
      inline_waited = inline_nested.waitFor(5s);
    };
  }));
  EXPECT_TRUE(inline_waited);
}

}  // namespace
}  // namespace mooncake::torch_ext
