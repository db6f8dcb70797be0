// Runs point-to-point ops off the collective worker, one serial lane per (peer, tag,
// direction): isend/irecv must not wait behind each other or behind a collective (two ranks
// that both irecv before they isend would deadlock on a single queue), yet two sends to the
// same peer with the same tag must stay in issue order so that receives match them in
// order (MPI's non-overtaking rule, which gloo also keeps).
//
// A task returns what completes it (its Work), run once the task no longer holds its lane: a
// Work's future callbacks run there and may post to the same lane and wait (a recv issued from
// a recv's callback), which another thread must then be free to run.
//
// Threads are started on demand (a lane blocked in recv holds one) and exit after a short
// idle period. They are detached: a lane still blocked when the owner goes away finishes on
// its own (the task keeps what it needs alive through its captures); the owner never joins.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

namespace mooncake::torch_ext {

class P2pLanes {
 public:
  using Key = std::tuple<int, int64_t, int>;  // peer (-1: any), tag, 0 = send / 1 = recv
  using Task = std::function<std::function<void()>()>;  // the op; returns its completion

  P2pLanes() : s_(std::make_shared<State>()) {}
  ~P2pLanes() {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->stop = true;
    s_->cv.notify_all();
  }
  P2pLanes(const P2pLanes&) = delete;
  P2pLanes& operator=(const P2pLanes&) = delete;

  void post(const Key& key, Task task) {
    std::lock_guard<std::mutex> lk(s_->mu);
    Lane& lane = s_->lanes[key];
    lane.tasks.push_back(std::move(task));
    if (lane.running) return;  // the thread draining this lane will get to it
    lane.running = true;
    readyLocked(key);
  }

  // Runs task on the calling thread when its lane has nothing queued or running, holding the
  // lane meanwhile so that posts to it queue behind (order kept); then hands what was posted
  // meanwhile to a thread. False, without running it: the lane is busy (post it instead).
  bool runInline(const Key& key, const Task& task) {
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      Lane& lane = s_->lanes[key];
      if (lane.running) return false;
      lane.running = true;
    }
    auto release = [&] {
      std::lock_guard<std::mutex> lk(s_->mu);
      if (s_->lanes[key].tasks.empty()) {
        s_->lanes.erase(key);
      } else {
        readyLocked(key);
      }
    };
    std::function<void()> done;
    try {
      done = task();
    } catch (...) {
      release();
      throw;
    }
    release();
    if (done) done();
    return true;
  }

 private:
  // A lane with tasks and no thread: queue it for one (s_->mu held).
  void readyLocked(const Key& key) { ready(s_, key); }

  struct Lane {
    std::deque<Task> tasks;
    bool running = false;
  };
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::map<Key, Lane> lanes;
    std::deque<Key> ready;
    int idle = 0;
    bool stop = false;
  };

  // Queues a lane with tasks and no thread for one (s->mu held).
  static void ready(const std::shared_ptr<State>& s, const Key& key) {
    s->ready.push_back(key);
    // Every ready lane needs a thread of its own: the running ones may block for long (a
    // recv waiting for a send posted after it, to oneself or by the peer). An idle thread
    // takes one ready lane when it wakes, but counts as idle until then, so it covers only
    // one of the lanes queued meanwhile: spawn when the idle threads are fewer than the
    // ready lanes (comparing with 0 would leave the second of two quick posts, e.g. irecv
    // then isend to oneself, without a thread until the first one's recv timed out).
    if (static_cast<size_t>(s->idle) >= s->ready.size()) {
      s->cv.notify_one();
    } else {
      std::thread([s] { run(s); }).detach();
    }
  }

  static void run(std::shared_ptr<State> s) {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      if (s->ready.empty()) {
        if (s->stop) return;
        ++s->idle;
        bool woke = s->cv.wait_for(lk, std::chrono::seconds(5),
                                   [&] { return !s->ready.empty() || s->stop; });
        --s->idle;
        if (!woke || s->ready.empty()) return;
      }
      Key key = s->ready.front();
      s->ready.pop_front();
      // Drain the lane in order; tasks never throw (they report through their Work). Each
      // task's completion runs after the lane is released: erased when nothing is left in it,
      // else handed to a thread (this one, if no other takes it first).
      for (;;) {
        Lane& lane = s->lanes[key];
        if (lane.tasks.empty()) {
          s->lanes.erase(key);
          break;
        }
        Task task = std::move(lane.tasks.front());
        lane.tasks.pop_front();
        lk.unlock();
        std::function<void()> done = task();
        task = nullptr;  // release captures outside the lock
        lk.lock();
        if (!done) continue;
        if (s->lanes[key].tasks.empty()) {
          s->lanes.erase(key);
        } else {
          ready(s, key);
        }
        lk.unlock();
        done();
        done = nullptr;
        lk.lock();
        break;
      }
    }
  }

  std::shared_ptr<State> s_;
};

}  // namespace mooncake::torch_ext
