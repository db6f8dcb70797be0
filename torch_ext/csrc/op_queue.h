// Issue-order execution of a group's collectives, with "run it yourself" for the caller
// that waits on the op at the head of the queue.
//
// Every op is handed to the communicator's worker (pg::Communicator::enqueue) as a token
// that runs the oldest pending op, so async ops progress without anyone waiting. But a
// synchronous collective (dist.all_reduce(t) = enqueue + wait at once) would then pay two
// thread hand-offs (wake the worker, wake the caller back): tens of microseconds on a busy
// 2-core host, more than the op itself for small tensors. So Work::wait(), when its op is
// next in line and nothing is running, takes the op off the queue and runs it on the
// calling thread; the worker's token then finds nothing to do. Order is kept (only the
// head ever runs) and so is pg's contract that one thread at a time runs a group's ops.
//
// Lifetime: tokens hold the queue through a shared_ptr; the communicator must outlive the
// queue's last op (pg's destructor drains its worker's tokens before tearing down).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "pg/communicator.h"

namespace mooncake::torch_ext {

class OpQueue : public std::enable_shared_from_this<OpQueue> {
 public:
  using Id = uint64_t;
  explicit OpQueue(pg::Communicator* comm) : comm_(comm) {}

  // Queues fn (which must not throw) behind every op queued before; returns its id.
  Id submit(const char* op, std::function<void()> fn) {
    Id id;
    {
      std::lock_guard<std::mutex> lk(mu_);
      id = next_id_++;
      pending_.emplace_back(id, std::move(fn));
    }
    try {
      comm_->enqueue(op, [self = shared_from_this()] { self->runNext(/*only=*/0); });
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (it->first == id) {
          pending_.erase(it);
          break;
        }
      }
      throw;
    }
    return id;
  }

  // Runs op `id` on this thread if it is the next one and no op is running. True if it did.
  bool runIfNext(Id id) { return runNext(id); }

 private:
  // only == 0: the worker's token (waits for a running op, then runs the head if any);
  // otherwise: a waiting caller (runs the head only if it is `only` and nothing runs).
  bool runNext(Id only) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (only == 0) {
        cv_.wait(lk, [&] { return !running_; });
      } else if (running_ || pending_.empty() || pending_.front().first != only) {
        return false;
      }
      if (pending_.empty()) return false;  // a caller ran it already
      fn = std::move(pending_.front().second);
      pending_.pop_front();
      running_ = true;
    }
    fn();
    fn = nullptr;  // release the op's tensors before waking anyone
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = false;
    }
    cv_.notify_all();
    return true;
  }

  pg::Communicator* comm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Id, std::function<void()>>> pending_;
  Id next_id_ = 1;
  bool running_ = false;
};

}  // namespace mooncake::torch_ext
