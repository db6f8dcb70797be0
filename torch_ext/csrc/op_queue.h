// Issue-order execution of a group's collectives: run by the thread that waits on them when
// it can, handed to the communicator's worker only when nobody claims them in time.
//
// A synchronous collective (dist.all_reduce(t) = submit + wait at once) should not touch a
// second thread. Handing every op to the worker at submit (what this queue did before) costs
// a futex wake and a context switch per op even when the waiting caller then runs the op
// itself: measured through torch at 2 ranks on 2 cores, a 4 KiB all_reduce took 5.4 us at
// p50 and 48 us at p90 that way against 3.5 / 3.8 us with no hand-off (the woken worker
// preempts a rank that its peer is spinning on; docs/perf/pg.md). So:
//  - submit() queues the op. On an idle queue it wakes nobody: the caller's Work::wait() is
//    likely to come at once and run it (runUpTo). When an earlier op is still pending or
//    running (the caller issues ops asynchronously), the queue goes to the worker at once.
//  - runUpTo(id) (a waiting caller) runs every pending op up to its own, in issue order, on
//    the calling thread, while no other thread runs one of them.
//  - An op that no thread claimed is handed to the worker by the process's hand-off thread
//    (op_queue.cc), which looks every MC_PG_HANDOFF_US (1 ms) while ops are pending, backs
//    off to 16x that while its looks find none (synchronous use), and sleeps without a
//    deadline once the process's queues have been idle for a while. An async op nobody waits
//    on thus starts within 1-16 ms, and peers (or a dependency through another group) never
//    wait on it forever. The ticks are deliberately rare: each one is a context switch, and
//    on 4 ranks over 2 cores even 1 ms ticks lengthen the tail of small ops.
//  - A queue that saw asynchronous use (an op issued while another was pending, or one the
//    hand-off thread had to hand over) hands its next kAsyncCredit ops over at submit, as
//    before, so that overlapping callers do not wait for a tick.
//  MC_PG_HANDOFF_US=0 hands every op to the worker at submit.
//
// Order is kept (only the head of the queue ever starts) and so is pg's contract that one
// thread at a time runs a group's ops.
//
// Completions. An op whose Work has no future completes inside its task (no callback can run).
// One with a future completes after the op released the queue, on the queue's completion
// thread, one at a time in op order (as NCCL's callbacks run in issue order): a callback may
// issue ops of the group and wait on them (DDP's PowerSGD hook does, through Future.wait(),
// which runs no op), so it must neither hold the queue nor block the worker that runs those
// ops, and callbacks that issue collectives must do so in the same order on every rank (two
// callbacks running at once issued them in different orders: mismatched or silently wrong
// collectives). An op issued by such a callback (of any group: "nested") completes apart, at
// once, on the thread that ran it, since that callback may be waiting for it; a nested op's
// own callbacks (chained ones) thus run there, on the worker for one it ran, and must not wait
// on further ops of the group. A callback that waits on a Work of its group issued outside it
// (an earlier one) through Work.wait() runs the completions queued before that Work's meanwhile
// (helpCompletions); through Future.wait(), which runs nothing, it would wait forever: not
// supported (documented in the README). Lifetime: tokens hold the queue through a shared_ptr;
// close() must be called before the communicator goes (it hands the pending ops to the worker,
// whose destructor runs them), and the communicator must outlive the queue's last token.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "pg/communicator.h"

namespace mooncake::torch_ext {

class OpQueue : public std::enable_shared_from_this<OpQueue> {
 public:
  using Id = uint64_t;
  using Clock = std::chrono::steady_clock;

  // A queue for comm's collectives, known to the process's hand-off thread.
  static std::shared_ptr<OpQueue> create(pg::Communicator* comm);

  // An op: runs it and returns what completes it (its Work), which the queue runs once the op
  // no longer holds the queue: a Work's future callbacks run there, and they may issue and wait
  // on ops of the same group (DDP's PowerSGD hook does), which the queue must then be free to
  // run. Ops must not throw.
  using Task = std::function<std::function<void()>()>;
  // Queues fn behind every op queued before; returns its id. Throws after close().
  Id submit(const char* op, Task fn);
  // A waiting caller: runs the pending ops up to `id` here, in order, unless another thread
  // is running one (then the worker has the queue and this caller just waits).
  void runUpTo(Id id);
  // Gives the pending ops to the worker now (a waiter that will not run them itself).
  void handOff();
  // After close(): waits until the worker ran the ops it was handed and every completion ran
  // (a no-op from a completion, or from a thread running this queue's ops).
  void waitClosed();
  // From a callback on this queue's completion thread waiting on a Work of this queue: runs
  // the next queued completion here (those before the Work's own); false when none is queued
  // or the caller is not that thread.
  bool helpCompletions();
  bool onCompletionThread() const;
  ~OpQueue();
  // The group is going away: waits for an op a caller is running, then pending ops go to the
  // worker (callers no longer take any); later submits throw.
  void close();
  // The hand-off thread: hands the queue to the worker when its oldest op has waited
  // unclaimed for a quarter of the period.
  enum class Overdue { kNone, kHandedOver, kWaiting };  // kWaiting: ops still unclaimed
  Overdue handOffIfOverdue(Clock::time_point now);

 private:
  struct Op {
    Id id;
    Clock::time_point since;
    const char* name;
    Task fn;
    bool nested;  // issued by one of this queue's completions
  };
  struct Completions;
  explicit OpQueue(pg::Communicator* comm);
  // Posts the worker's token when ops are pending, none runs, no token is out and the queue
  // is open. Under mu_; true if it posted.
  bool handOffLocked();
  // The worker's token: runs pending ops until the queue is empty or a caller runs one.
  void drain();
  // Takes the head (up to id `up_to`) for the calling thread and sets running_; false if there
  // is none or another thread runs one (worker: then the token is spent).
  bool takeHead(Task* fn, bool* nested, Id up_to, bool worker);
  // Runs what takeHead took, clears running_, then passes on the op's completion.
  void finishOne(Task* fn, bool nested);

  pg::Communicator* comm_;
  static constexpr int kAsyncCredit = 16;
  const Clock::duration period_;  // MC_PG_HANDOFF_US; zero: hand off at submit
  std::mutex mu_;
  std::deque<Op> pending_;
  Id next_id_ = 1;
  bool running_ = false;  // a thread runs the op it took off the head
  bool token_ = false;    // the worker has (or is about to get) a token for this queue
  bool closed_ = false;
  bool closing_ = false;             // close() waits on idle_ for a caller's op to end
  std::condition_variable idle_;
  int async_credit_ = 0;  // ops still handed over at submit after asynchronous use was seen
  std::shared_ptr<Completions> done_;  // its thread holds it too
};

}  // namespace mooncake::torch_ext
