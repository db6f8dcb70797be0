#include "torch_ext/csrc/op_queue.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "engine/log.h"
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

OpQueue::Clock::duration periodFromParams() {
  return std::chrono::microseconds(std::max<int64_t>(params::getInt("MC_PG_HANDOFF_US"), 0));
}

}  // namespace

// ---- completions (op_queue.h, "Completions") ----

struct OpQueue::Completions {
  std::mutex mu;
  std::condition_variable cv;       // a job, or the thread may go
  std::condition_variable idle_cv;  // outstanding reached 0
  std::deque<std::function<void()>> jobs;
  size_t outstanding = 0;  // posted and not yet finished
  bool thread_up = false;
  // The completion thread whose job runs on this thread now (any group's): ops issued there
  // are "nested".
  static thread_local const Completions* current;

  static void runJob(Completions* s, std::function<void()>& fn) {
    const Completions* was = current;
    current = s;
    try {
      fn();
    } catch (const std::exception& e) {
      MC_LOG(WARN, PG) << "a Work's completion raised: " << e.what();
    } catch (...) {
      MC_LOG(WARN, PG) << "a Work's completion raised";
    }
    current = was;
  }

  static void post(const std::shared_ptr<Completions>& s, std::function<void()> fn) {
    std::unique_lock<std::mutex> lk(s->mu);
    s->jobs.push_back(std::move(fn));
    ++s->outstanding;
    if (s->thread_up) {
      s->cv.notify_one();
      return;
    }
    try {
      std::thread([s] { run(s); }).detach();
      s->thread_up = true;
    } catch (...) {  // no thread to be had: run the queued jobs here, in order
      MC_LOG(WARN, PG) << "no thread for a Work's completion: it runs on the caller";
      lk.unlock();
      while (s->runOne()) {
      }
    }
  }

  // Runs the next queued job on this thread, if any (a callback waiting on a Work of its own
  // group lets the completions before it run, MooncakeWork::wait).
  bool runOne() {
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (jobs.empty()) return false;
      fn = std::move(jobs.front());
      jobs.pop_front();
    }
    runJob(this, fn);
    fn = nullptr;
    std::lock_guard<std::mutex> lk(mu);
    if (--outstanding == 0) idle_cv.notify_all();
    return true;
  }

  static void run(std::shared_ptr<Completions> s) {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
      if (!s->cv.wait_for(lk, std::chrono::seconds(5), [&] { return !s->jobs.empty(); })) {
        s->thread_up = false;  // idle: the next post starts another
        return;
      }
      lk.unlock();
      s->runOne();
      lk.lock();
    }
  }

  void waitIdle() {
    std::unique_lock<std::mutex> lk(mu);
    idle_cv.wait(lk, [&] { return outstanding == 0; });
  }
};

thread_local const OpQueue::Completions* OpQueue::Completions::current = nullptr;

namespace {
// The queue this thread runs ops of now, as the worker (drain) or as a nested op's inline
// completion: waitClosed() from here would wait for itself.
thread_local const OpQueue* tl_busy_with = nullptr;

struct BusyWith {
  const OpQueue* was;
  explicit BusyWith(const OpQueue* q) : was(tl_busy_with) { tl_busy_with = q; }
  ~BusyWith() { tl_busy_with = was; }
};
}  // namespace

OpQueue::OpQueue(pg::Communicator* comm)
    : comm_(comm), period_(periodFromParams()), done_(std::make_shared<Completions>()) {}

OpQueue::~OpQueue() = default;

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
    // Issued by a completion (a callback; of any group's: one of another group waiting on
    // it must not wait behind this group's queued completions either): completed apart from
    // the others (finishOne), since that callback may be waiting for it.
    const bool nested = Completions::current != nullptr;
    pending_.push_back(Op{id, Clock::now(), op, std::move(fn), nested});
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

bool OpQueue::takeHead(Task* fn, bool* nested, Id up_to, bool worker) {
  std::lock_guard<std::mutex> lk(mu_);
  // Once close() began only the worker runs ops: the communicator waits for it, not for callers.
  if (running_ || pending_.empty() || pending_.front().id > up_to || (closing_ && !worker)) {
    // The worker leaves a queue that is empty or that a caller is running: that caller hands
    // over what it leaves behind (runUpTo), the hand-off thread anything queued later.
    if (worker) {
      token_ = false;
      if (closing_) idle_.notify_all();  // waitClosed
    }
    return false;
  }
  *fn = std::move(pending_.front().fn);
  *nested = pending_.front().nested;
  pending_.pop_front();
  running_ = true;
  return true;
}

void OpQueue::finishOne(Task* fn, bool nested) {
  std::function<void()> done = (*fn)();
  *fn = nullptr;  // release the op's tensors before the next one
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = false;
    if (closing_) idle_.notify_all();
  }
  if (!done) return;  // completed in the task (no future: no callbacks)
  // After the queue is free. An op a callback issued completes here at once (that callback
  // may be waiting on its future); every other one on the queue's completion thread, in
  // order (op_queue.h, "Completions").
  if (nested) {
    // Ops its chained callbacks issue are nested too (a marker, not a completion thread).
    static Completions nested_marker;
    BusyWith busy(this);
    Completions::runJob(&nested_marker, done);
  } else {
    Completions::post(done_, std::move(done));
  }
}

void OpQueue::drain() {
  BusyWith busy(this);
  Task fn;
  bool nested = false;
  while (takeHead(&fn, &nested, ~Id{0}, true)) finishOne(&fn, nested);
}

bool OpQueue::onCompletionThread() const { return Completions::current == done_.get(); }

bool OpQueue::helpCompletions() {
  return Completions::current == done_.get() && done_->runOne();
}

void OpQueue::runUpTo(Id id) {
  Task fn;
  bool nested = false;
  while (takeHead(&fn, &nested, id, false)) finishOne(&fn, nested);
  // Ops queued behind the caller's were issued before it waited, i.e. asynchronously: give
  // them to the worker now rather than at the hand-off thread's next tick.
  handOff();
}

void OpQueue::handOff() {
  std::lock_guard<std::mutex> lk(mu_);
  handOffLocked();
}

void OpQueue::waitClosed() {
  // Not from a completion (of any group: its callbacks may wait on this one's), nor from a
  // thread that runs this queue's ops now: they would wait for themselves.
  if (Completions::current != nullptr || tl_busy_with == this) return;
  {
    std::unique_lock<std::mutex> lk(mu_);
    idle_.wait(lk, [&] { return pending_.empty() && !running_ && !token_; });
  }
  done_->waitIdle();
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
