// Work state and the per-communicator worker thread that runs enqueued ops in order
// (c10d's model: validate -> enqueue -> the worker runs it -> the Work completes).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pg/communicator.h"

namespace mooncake::pg {

struct Work::State {
  std::string op;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::vector<std::function<void()>> callbacks;

  // Marks the work finished (once) and runs the callbacks on the calling thread.
  void finish(std::exception_ptr e);
};

// One thread, started on the first enqueue. The destructor lets queued ops run to the end
// (each is bounded by the group's timeout), then joins.
class Worker {
 public:
  Worker() = default;
  ~Worker();
  std::shared_ptr<Work> enqueue(std::string op, std::function<void()> fn);

 private:
  struct Item {
    std::shared_ptr<Work::State> state;
    std::function<void()> fn;
  };
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mooncake::pg
