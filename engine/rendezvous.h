// Rendezvous: small-blob key/value exchange used to swap segment descriptors and job secrets.
// Implementations: in-process (tests, single process), a TCP server/client for jobs without
// torch, and (in torch_ext) an adapter over the c10d::Store torch hands a backend.
#pragma once

#include <cstdint>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // NotFound when absent (does not wait).
  virtual Result<std::string> get(const std::string& key) = 0;
  // Waits until the key exists; kTimeout at the deadline.
  virtual Result<std::string> wait(const std::string& key, Deadline deadline) = 0;
  // Atomically adds delta to an integer counter (absent = 0) and returns the new value.
  virtual Result<int64_t> add(const std::string& key, int64_t delta) = 0;
};

class InProcessRendezvous : public Rendezvous {
 public:
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key) override;
  Result<std::string> wait(const std::string& key, Deadline deadline) override;
  Result<int64_t> add(const std::string& key, int64_t delta) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

// A tiny TCP key/value server (one thread, poll loop) for jobs launched without torch.
class TcpRendezvousServer {
 public:
  // port 0 picks a free port; see port().
  static Result<std::unique_ptr<TcpRendezvousServer>> start(const std::string& host,
                                                            uint16_t port);
  ~TcpRendezvousServer();
  uint16_t port() const;
  struct Impl;

 private:
  explicit TcpRendezvousServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TcpRendezvousClient : public Rendezvous {
 public:
  static Result<std::unique_ptr<TcpRendezvousClient>> connect(const std::string& host,
                                                              uint16_t port, Deadline deadline);
  ~TcpRendezvousClient() override;
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key) override;
  Result<std::string> wait(const std::string& key, Deadline deadline) override;
  Result<int64_t> add(const std::string& key, int64_t delta) override;

 private:
  explicit TcpRendezvousClient(int fd) : fd_(fd) {}
  Result<std::string> call(uint8_t op, const std::string& key, const std::string& value,
                           Deadline deadline);
  std::mutex mu_;
  int fd_;
};

}  // namespace mooncake::engine
