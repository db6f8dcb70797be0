#include "pg/work.h"

namespace mooncake::pg {

void Work::State::finish(std::exception_ptr e) {
  // Callbacks run before the work reads as done, so that a waiter that returns from wait()
  // (or sees isCompleted()) knows every callback registered before completion has run.
  std::unique_lock<std::mutex> g(mu);
  if (done) return;
  error = std::move(e);
  while (!callbacks.empty()) {
    std::vector<std::function<void()>> cbs;
    cbs.swap(callbacks);
    g.unlock();
    for (auto& cb : cbs) {
      try {
        cb();
      } catch (...) {  // a callback's failure must not take the worker down
      }
    }
    g.lock();
  }
  done = true;
  g.unlock();
  cv.notify_all();
}

bool Work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> g(s_->mu);
  if (!s_->cv.wait_for(g, timeout, [&] { return s_->done; })) return false;
  if (s_->error) std::rethrow_exception(s_->error);
  return true;
}

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->done;
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->done && !s_->error;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> g(s_->mu);
  return s_->error;
}

void Work::onComplete(std::function<void()> cb) {
  {
    std::lock_guard<std::mutex> g(s_->mu);
    if (!s_->done) {
      s_->callbacks.push_back(std::move(cb));
      return;
    }
  }
  cb();  // already finished: run it here
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> Worker::enqueue(std::string op, std::function<void()> fn) {
  auto st = std::make_shared<Work::State>();
  st->op = std::move(op);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) {
      st->finish(std::make_exception_ptr(
          CommError("mooncake pg: " + st->op + " enqueued on a communicator being destroyed",
                    -1, st->op)));
      return std::make_shared<Work>(st);
    }
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    queue_.push_back(Item{st, std::move(fn)});
  }
  cv_.notify_one();
  return std::make_shared<Work>(st);
}

void Worker::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr err;
    try {
      item.fn();
    } catch (...) {
      err = std::current_exception();
    }
    item.state->finish(err);
  }
}

}  // namespace mooncake::pg
