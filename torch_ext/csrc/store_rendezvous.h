// A Rendezvous (engine/rendezvous.h) over the c10d::Store torch hands a backend (TCPStore,
// FileStore, HashStore, wrapped in the group's PrefixStore). This is how a mooncake group
// exchanges segment descriptors under torchrun / env:// without a second server.
//
// Threading: calls are serialised by a mutex (a TCPStore client is one socket). wait()
// polls check() with a growing sleep instead of c10d's Store::wait(timeout): a timed-out
// Store::wait leaves an unread reply on a TCPStore socket, and rendezvous waits happen only
// at group set-up, where a few milliseconds of polling latency do not matter.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "engine/rendezvous.h"

namespace mooncake::torch_ext {

class StoreRendezvous : public engine::Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key) override;
  Result<std::string> wait(const std::string& key, engine::Deadline deadline) override;
  Result<int64_t> add(const std::string& key, int64_t delta) override;

  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

 private:
  std::mutex mu_;
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace mooncake::torch_ext
