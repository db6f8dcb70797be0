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
// Serves only clients that present the job secret (an AUTH request first); before that a
// connection may send one small frame and has MC_HANDSHAKE_TIMEOUT_MS to do it, and the
// listener admits only so many such connections (tcp_admission.h). Values are capped at
// MC_RENDEZVOUS_MAX_VALUE_BYTES, all keys and values at MC_RENDEZVOUS_MAX_TOTAL_BYTES.
class TcpRendezvousServer {
 public:
  // port 0 picks a free port; see port(). secret: what clients must present (checkSecret:
  // empty only with MC_ALLOW_NO_SECRET=1). host: the address to listen on (127.0.0.1 for a
  // job on one host; a wildcard only when asked for).
  static Result<std::unique_ptr<TcpRendezvousServer>> start(const std::string& host,
                                                            uint16_t port,
                                                            const std::string& secret);
  ~TcpRendezvousServer();
  uint16_t port() const;
  struct Impl;

 private:
  explicit TcpRendezvousServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TcpRendezvousClient : public Rendezvous {
 public:
  // Connects and authenticates with `secret` (kPermissionDenied when the server refuses it).
  static Result<std::unique_ptr<TcpRendezvousClient>> connect(const std::string& host,
                                                              uint16_t port,
                                                              const std::string& secret,
                                                              Deadline deadline);
  ~TcpRendezvousClient() override;
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key) override;
  // get() by the caller's deadline instead of MC_RENDEZVOUS_TIMEOUT_MS.
  Result<std::string> get(const std::string& key, Deadline deadline);
  Result<std::string> wait(const std::string& key, Deadline deadline) override;
  Result<int64_t> add(const std::string& key, int64_t delta) override;

 private:
  TcpRendezvousClient(int fd, std::string secret) : fd_(fd), secret_(std::move(secret)) {}
  Result<std::string> call(uint8_t op, const std::string& key, const std::string& value,
                           Deadline deadline);
  std::mutex mu_;
  int fd_;
  const std::string secret_;
};

}  // namespace mooncake::engine
