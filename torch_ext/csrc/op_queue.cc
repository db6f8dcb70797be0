#include "torch_ext/csrc/op_queue.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "engine/params.h"

namespace mooncake::torch_ext {

namespace {

// The process's hand-off thread: while collectives are being submitted it asks each queue, every
// `period`, to hand over ops that waited unclaimed for a quarter of that. A look that finds no
// op pending doubles the interval (up to kMaxBackoff periods: a loop of synchronous ops, whose
// ops are run by their waiters, then costs ~60 context switches a second, not 1000); one that
// finds an op pending or hands one over resets it. After kQuiet without a submit and with
// nothing waiting it sleeps until the next submit wakes it, so an idle process has no ticking
// thread and a busy one no wake per op. One for the process (leaked: it must not be joined by
// static destructors while a queue may still call it).
class HandOffThread {
 public:
  static constexpr auto kQuiet = std::chrono::milliseconds(20);
  static constexpr int kMaxBackoff = 16;

  static HandOffThread& get(OpQueue::Clock::duration period) {
    static HandOffThread* t = new HandOffThread(period);
    return *t;
  }

  void add(std::weak_ptr<OpQueue> q) {
    std::lock_guard<std::mutex> lk(mu_);
    queues_.push_back(std::move(q));
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }

  // After an op was queued (and published under its queue's mutex).
  void submitted() {
    last_submit_.store(OpQueue::Clock::now().time_since_epoch().count(),
                       std::memory_order_relaxed);
    // Pairs with the fence in loop(): either this sees sleeping_, or the thread's re-scan
    // after setting it sees the new op.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_relaxed) && sleeping_.exchange(false)) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        woken_ = true;
      }
      cv_.notify_one();
    }
  }

 private:
  explicit HandOffThread(OpQueue::Clock::duration period) : period_(period) {}

  struct Seen {
    bool pending = false;  // some queue had ops nobody had started
    bool waiting = false;  // some still has (not yet overdue, or a caller runs an earlier one)
  };

  // Hands over what is overdue.
  Seen scan() {
    std::vector<std::weak_ptr<OpQueue>> qs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      queues_.erase(std::remove_if(queues_.begin(), queues_.end(),
                                   [](const std::weak_ptr<OpQueue>& q) { return q.expired(); }),
                    queues_.end());
      qs = queues_;
    }
    const auto now = OpQueue::Clock::now();
    Seen seen;
    for (auto& w : qs) {
      auto q = w.lock();
      if (!q) continue;
      const OpQueue::Overdue o = q->handOffIfOverdue(now);
      seen.pending |= o != OpQueue::Overdue::kNone;
      seen.waiting |= o == OpQueue::Overdue::kWaiting;
    }
    return seen;
  }

  void loop() {
    OpQueue::Clock::duration every = period_;
    for (;;) {
      const Seen seen = scan();
      every = seen.pending ? period_ : std::min(every * 2, period_ * kMaxBackoff);
      const auto last = OpQueue::Clock::time_point(
          OpQueue::Clock::duration(last_submit_.load(std::memory_order_relaxed)));
      std::unique_lock<std::mutex> lk(mu_);
      if (!seen.waiting && OpQueue::Clock::now() - last > kQuiet) {
        sleeping_.store(true, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        lk.unlock();
        if (scan().waiting) {  // an op queued before the flag was visible
          sleeping_.store(false, std::memory_order_relaxed);
          every = period_;
          continue;
        }
        lk.lock();
        cv_.wait(lk, [&] { return woken_ || !sleeping_.load(std::memory_order_relaxed); });
        woken_ = false;
        every = period_;
        continue;
      }
      cv_.wait_for(lk, every);
    }
  }

  const OpQueue::Clock::duration period_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<OpQueue>> queues_;
  std::thread thread_;
  bool woken_ = false;
  std::atomic<bool> sleeping_{false};
  std::atomic<OpQueue::Clock::rep> last_submit_{0};
};

// Runs the completions of ops the worker ran (OpQueue::Task's second part) when they carry a
// Work's future callbacks: those may wait on a later op of the same group through its future
// (torch's Future.wait() runs no op, unlike Work.wait()), which only the worker or a waiter can
// run, so they must not block the worker. Each completion gets a thread of its own when none is
// idle (a callback may wait on a future whose completion comes through here too); threads
// exit after kIdle without work. One for the process (leaked, as the hand-off thread).
class CompletionThreads {
 public:
  static constexpr auto kIdle = std::chrono::seconds(5);

  static CompletionThreads& get() {
    static CompletionThreads* t = new CompletionThreads();
    return *t;
  }

  void post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.push_back(std::move(fn));
    if (static_cast<size_t>(idle_) >= jobs_.size()) {
      cv_.notify_one();
    } else {
      std::thread([this] { run(); }).detach();
    }
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (jobs_.empty()) {
        ++idle_;
        const bool woke = cv_.wait_for(lk, kIdle, [&] { return !jobs_.empty(); });
        --idle_;
        if (!woke) return;
      }
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      lk.unlock();
      fn();
      fn = nullptr;  // the Work it holds goes here, not under the lock
      lk.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  int idle_ = 0;
};

OpQueue::Clock::duration periodFromParams() {
  return std::chrono::microseconds(std::max<int64_t>(params::getInt("MC_PG_HANDOFF_US"), 0));
}

}  // namespace

OpQueue::OpQueue(pg::Communicator* comm) : comm_(comm), period_(periodFromParams()) {}

std::shared_ptr<OpQueue> OpQueue::create(pg::Communicator* comm) {
  std::shared_ptr<OpQueue> q(new OpQueue(comm));
  if (q->period_.count() > 0) HandOffThread::get(q->period_).add(q);
  return q;
}

OpQueue::Id OpQueue::submit(const char* op, Task fn) {
  Id id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error(std::string(op) + " issued on a group being destroyed");
    id = next_id_++;
    const bool busy = running_ || !pending_.empty();
    if (busy) async_credit_ = kAsyncCredit;
    pending_.push_back(Op{id, Clock::now(), op, std::move(fn)});
    if (busy || period_.count() == 0 || (async_credit_ > 0 && async_credit_-- > 0)) {
      try {
        handOffLocked();
      } catch (...) {
        pending_.pop_back();
        throw;
      }
      return id;
    }
  }
  HandOffThread::get(period_).submitted();
  return id;
}

// Posted under mu_: close() then knows no token is on its way to a communicator about to go.
// (Lock order: this queue's mu_, then the worker's; the worker runs tokens without its own.)
bool OpQueue::handOffLocked() {
  if (token_ || running_ || closed_ || pending_.empty()) return false;
  comm_->enqueue(pending_.front().name, [self = shared_from_this()] { self->drain(); });
  token_ = true;
  return true;
}

bool OpQueue::takeHead(Task* fn, Id up_to, bool worker) {
  std::lock_guard<std::mutex> lk(mu_);
  // Once close() began only the worker runs ops: the communicator waits for it, not for callers.
  if (running_ || pending_.empty() || pending_.front().id > up_to || (closing_ && !worker)) {
    // The worker leaves a queue that is empty or that a caller is running: that caller hands
    // over what it leaves behind (runUpTo), the hand-off thread anything queued later.
    if (worker) token_ = false;
    return false;
  }
  *fn = std::move(pending_.front().fn);
  pending_.pop_front();
  running_ = true;
  return true;
}

void OpQueue::finishOne(Task* fn, bool worker) {
  std::function<void()> done = (*fn)();
  *fn = nullptr;  // release the op's tensors before the next one
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = false;
    if (closing_) idle_.notify_all();
  }
  if (!done) return;
  // After the queue is free: a future callback may issue an op and wait on it. A waiter's
  // thread runs it here (its nested Work.wait() runs the op; a Future.wait() leaves it to the
  // worker); the worker must not block in it (CompletionThreads).
  if (worker) {
    CompletionThreads::get().post(std::move(done));
  } else {
    done();
  }
}

void OpQueue::drain() {
  Task fn;
  while (takeHead(&fn, ~Id{0}, true)) finishOne(&fn, true);
}

void OpQueue::runUpTo(Id id) {
  Task fn;
  while (takeHead(&fn, id, false)) finishOne(&fn, false);
  // Ops queued behind the caller's were issued before it waited, i.e. asynchronously: give
  // them to the worker now rather than at the hand-off thread's next tick.
  handOff();
}

void OpQueue::handOff() {
  std::lock_guard<std::mutex> lk(mu_);
  handOffLocked();
}

void OpQueue::close() {
  std::unique_lock<std::mutex> lk(mu_);
  // An op a caller runs uses the communicator: let it end first (each op is bounded by the
  // group's timeout), then the worker has every op left, and the communicator's destructor
  // waits for the worker.
  closing_ = true;
  idle_.wait(lk, [&] { return !running_; });
  handOffLocked();
  closed_ = true;
}

OpQueue::Overdue OpQueue::handOffIfOverdue(Clock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  if (token_ || pending_.empty()) return Overdue::kNone;  // nothing, or the worker has them
  if (!running_ && (now - pending_.front().since) * 4 >= period_) {
    async_credit_ = kAsyncCredit;  // nobody waited on it: the caller issues ops asynchronously
    return handOffLocked() ? Overdue::kHandedOver : Overdue::kWaiting;
  }
  return Overdue::kWaiting;
}

}  // namespace mooncake::torch_ext
