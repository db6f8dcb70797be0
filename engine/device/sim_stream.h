// The device layer's host simulation of a stream (engine/device/device.cc's SimDevice), its
// events and the graphs captured from it. Internal to the device layer.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/device/device.h"

namespace mooncake::engine::device::sim {

// A simulated copy stream: a thread that runs the copies (and simulated kernels) queued on it
// in order. A host thread waiting for the stream runs the next items itself while the worker
// is not running one (still one at a time, in order): a condition-variable handoff to the
// worker and back costs a futex wake on each side, several times the copy itself for the
// small steps of a collective, which a GPU's stream does not pay. Items nobody waits for run
// on the worker, asynchronously. A gate (waitWord) at the front holds everything behind it;
// whoever finds it open passes it, and while a host thread waits for the stream, that thread
// polls a closed gate itself (keeping its deadline) and the worker leaves it alone.
struct SimGraph;

class SimStream {
 public:
  SimStream() : worker_([this] { run(); }) {}
  ~SimStream() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void push(void* dst, const void* src, size_t len) { enqueue({dst, src, len, nullptr}); }
  // A simulated kernel: runs in order with the copies; a failure fails later events' waits.
  void push(std::function<Status()> task) { enqueue({nullptr, nullptr, 0, std::move(task)}); }
  // A gate: later items wait until (int32_t)(*word - value) >= 0.
  void pushGate(const uint32_t* word, uint32_t value) {
    enqueue({nullptr, nullptr, 0, nullptr, word, value});
  }
  // A gate until `other` (this stream or another) ran its first n items: an event's wait. The
  // gate holds the other's count, not the stream (freeing a stream must not wait for another).
  void pushEventGate(const SimStream& other, uint64_t n) {
    Copy c{nullptr, nullptr, 0, nullptr, nullptr, 0, other.done_count_, n};
    enqueue(std::move(c));
  }
  uint64_t queued() {
    std::lock_guard<std::mutex> g(mu_);
    return queued_;
  }
  bool reached(uint64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    return done_ >= n;
  }
  // Ok once the first n items are done; kTimeout past the deadline; the first failed
  // kernel's error for every n at or past it (sticky, as a CUDA fault).
  Status waitFor(uint64_t n, Deadline deadline) {
    std::unique_lock<std::mutex> g(mu_);
    ++waiters_;
    struct Leave {
      SimStream* s;
      ~Leave() {
        --s->waiters_;
        s->cv_.notify_all();  // the worker may poll a gate again
      }
    } leave{this};
    while (done_ < n) {
      if (waiterMayRun()) {
        runFront(g);
        continue;
      }
      if (!busy_) {
        if (!frontGateClosed()) {
          if (done_ >= n || waiterMayRun()) continue;  // gates passed just now
        } else {  // poll it here, yielding the core in between
          g.unlock();
          sched_yield();
          g.lock();
          if (std::chrono::steady_clock::now() >= deadline && done_ < n && !busy_ &&
              frontGateClosed())
            return MC_STATUS(kTimeout, "sim device: a stream gate still closed at the deadline");
          continue;
        }
      }
      g.unlock();  // the worker runs an item: poll a little before sleeping
      spinUntil([&] { return done_seen_.load(std::memory_order_acquire) >= n; });
      g.lock();
      if (!cv_.wait_until(g, deadline, [&] {
            return done_ >= n || waiterMayRun() ||
                   (!busy_ && !q_.empty() && q_.front().gate());  // a gate to poll
          }))
        return MC_STATUS(kTimeout, "sim device: copies not done by the deadline");
    }
    if (failed_at_ != 0 && failed_at_ <= n) return failure_;
    return Status::OK();
  }

 public:
  // A queued item: a copy, a kernel, or a gate.
  struct Copy {
    void* dst;
    const void* src;
    size_t len;
    std::function<Status()> task;  // a kernel instead of a copy
    const uint32_t* word = nullptr;  // a gate instead of a copy (pushGate)
    uint32_t value = 0;
    std::shared_ptr<const std::atomic<uint64_t>> count = nullptr;  // or an event's gate
    uint64_t value64 = 0;
    bool gate() const { return word != nullptr || count != nullptr; }
  };
  // The graph this stream captures into (Device::beginCapture), or null: its items go there
  // instead of running.
  std::shared_ptr<SimGraph> capture() {
    std::lock_guard<std::mutex> g(mu_);
    return capture_;
  }
  void setCapture(std::shared_ptr<SimGraph> graph) {
    std::lock_guard<std::mutex> g(mu_);
    capture_ = std::move(graph);
    captured_ = 0;
  }
  // Items this stream queued into its current capture.
  uint64_t captured() {
    std::lock_guard<std::mutex> g(mu_);
    return captured_;
  }
  // Queues an item of a captured graph (Device::launchGraph).
  void replay(const Copy& c) { enqueue(Copy(c)); }

 private:
  // Under mu_: the next item may run on a waiting host thread.
  bool waiterMayRun() const { return !busy_ && !q_.empty() && !q_.front().gate(); }
  static bool gateOpen(const Copy& c) {
    if (c.count != nullptr) return c.count->load(std::memory_order_acquire) >= c.value64;
    return static_cast<int32_t>(__atomic_load_n(c.word, __ATOMIC_ACQUIRE) - c.value) >= 0;
  }
  // Under mu_, no item running: passes the open gates at the front; true when the front is a
  // closed one.
  bool frontGateClosed() {
    bool passed = false;
    while (!q_.empty() && q_.front().gate() && gateOpen(q_.front())) {
      q_.pop_front();
      ++done_;
      passed = true;
    }
    if (passed) {
      done_seen_.store(done_, std::memory_order_release);
      done_count_->store(done_, std::memory_order_release);
      cv_.notify_all();
    }
    return !q_.empty() && q_.front().gate();
  }
  void enqueue(Copy c) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (capture_) return captureItem(std::move(c));
      q_.push_back(std::move(c));
      ++queued_;
      queued_seen_.store(queued_, std::memory_order_release);
    }
    cv_.notify_all();
  }
  template <class Pred>
  static void spinUntil(Pred done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
    while (!done() && std::chrono::steady_clock::now() < until) sched_yield();
  }
  // Under mu_ (held on return), with the queue not empty and no item running: runs the next.
  void runFront(std::unique_lock<std::mutex>& g) {
    Copy c = std::move(q_.front());
    q_.pop_front();
    busy_ = true;
    g.unlock();
    Status st;
    try {
      if (c.task) {
        st = c.task();
      } else {
        std::memmove(c.dst, c.src, c.len);
      }
    } catch (const std::exception& e) {
      st = MC_STATUS(kInternal, "sim device: a kernel threw: " << e.what());
    } catch (...) {
      st = MC_STATUS(kInternal, "sim device: a kernel threw");
    }
    g.lock();
    busy_ = false;
    ++done_;
    done_seen_.store(done_, std::memory_order_release);
    done_count_->store(done_, std::memory_order_release);
    if (!st.ok() && failed_at_ == 0) {
      failed_at_ = done_;
      failure_ = st;
    }
    cv_.notify_all();
  }
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      if (q_.empty() && !stop_) {  // poll a little for the next item before sleeping
        const uint64_t seen = queued_;
        g.unlock();
        spinUntil([&] { return queued_seen_.load(std::memory_order_acquire) != seen; });
        g.lock();
      }
      cv_.wait(g, [&] {
        return (stop_ && q_.empty() && !busy_) ||
               (!q_.empty() && !busy_ && (!q_.front().gate() || waiters_ == 0));
      });
      if (q_.empty()) return;  // stopping, everything done
      if (frontGateClosed()) {
        // Nobody waits for the stream: poll the gate here every 20 us (sleeping: spinning
        // would take a core from the processes that open it); a waiter that comes takes over
        // (polling faster, to its deadline); a stopping stream gives up.
        if (stop_) {
          q_.pop_front();
          ++done_;
          done_seen_.store(done_, std::memory_order_release);
          done_count_->store(done_, std::memory_order_release);
          cv_.notify_all();
          continue;
        }
        g.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        g.lock();
        continue;
      }
      if (!q_.empty()) runFront(g);  // (gates passed just now may have emptied it)
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Copy> q_;
  uint64_t queued_ = 0, done_ = 0;
  std::atomic<uint64_t> queued_seen_{0}, done_seen_{0};  // queued_ and done_, for spinning
  // done_ again, for other streams' event gates (which may outlive this stream).
  std::shared_ptr<std::atomic<uint64_t>> done_count_ = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t failed_at_ = 0;  // the first failed kernel's place (1-based), 0: none
  Status failure_;
  bool busy_ = false;  // an item is running (on the worker or a waiter)
  int waiters_ = 0;    // host threads in waitFor
  bool stop_ = false;
  std::shared_ptr<SimGraph> capture_;
  uint64_t captured_ = 0;
  void captureItem(Copy c);  // (under mu_; below SimGraph)
  std::thread worker_;
};

// What simulated streams captured (Device::beginCapture .. endCapture): the items their host
// queued, in the order it queued them, which is a topological order of the captured work (a
// stream joins a capture by waiting on an event recorded in it, before its own items).
// Replayed (launchGraph) as one stream's items, in that order.
struct SimGraph final : Graph {
  std::mutex mu;
  std::vector<SimStream::Copy> items;
  std::vector<std::weak_ptr<SimStream>> members;  // the streams capturing into it
  const SimStream* origin = nullptr;              // where the capture began (and must end)
  std::string invalid;  // why the capture cannot be used ("": it can)
  bool ended = false;   // endCapture ran: its events can no longer be waited on
  // Per stream that joined: the items it had queued when the origin last waited on an event
  // of it (CUDA refuses to end a capture with a stream not joined back: unjoined work).
  std::map<const SimStream*, uint64_t> joined;
  void invalidate(const std::string& why) {
    std::lock_guard<std::mutex> g(mu);
    if (invalid.empty()) invalid = why;
  }
};

inline void SimStream::captureItem(Copy c) {
  std::lock_guard<std::mutex> g(capture_->mu);
  capture_->items.push_back(std::move(c));
  ++captured_;
}

// An event: the first n items of stream s. One recorded while s captured belongs to the
// graph: a stream waiting on it joins the capture, and the host cannot wait for it (CUDA
// refuses, and a capture that tried is invalidated: a host synchronisation inside it).
class SimEvent final : public Event {
 public:
  SimEvent(std::shared_ptr<SimStream> s, uint64_t n, std::shared_ptr<SimGraph> graph)
      : s_(std::move(s)), n_(n), graph_(std::move(graph)) {
    if (graph_) n_ = s_->captured();  // (in a capture: the stream's captured items)
  }
  bool done() override {
    if (!graph_) return s_->reached(n_);
    graph_->invalidate("the host asked whether an event recorded in the capture completed");
    return false;
  }
  Status wait(Deadline deadline) override {
    if (!graph_) return s_->waitFor(n_, deadline);
    graph_->invalidate("the host waited for an event recorded in the capture");
    return MC_STATUS(kNotSupported, "sim device: the host waited for an event recorded during a "
                                    "CUDA-graph capture (a host synchronisation inside it)");
  }
  void gateOn(SimStream& on) const { on.pushEventGate(*s_, n_); }
  const std::shared_ptr<SimGraph>& graph() const { return graph_; }
  const SimStream* stream() const { return s_.get(); }
  uint64_t count() const { return n_; }

 private:
  std::shared_ptr<SimStream> s_;
  uint64_t n_;
  std::shared_ptr<SimGraph> graph_;
};


}  // namespace mooncake::engine::device::sim
