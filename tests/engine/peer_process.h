// A real peer process for engine tests. The parent fork+execs its own test binary in peer
// mode (a fresh process: no engine, thread or lock is inherited across the fork). The peer
// creates its own TransferEngine, allocates and registers memory, fills it with known
// patterns, publishes its segment to the parent's TCP rendezvous and then answers text
// commands read from a pipe, one line each, until "exit" or until the pipe closes (the
// parent died). Every parent-side wait has a deadline; a PeerProcess that is destroyed while
// its process still runs kills and reaps it, so a failing test leaves no orphan behind.
//
// Commands (addresses are the peer's own, in decimal or 0x-hex):
//   expect ADDR LEN SEED FIRST   -> "ok" | "bad <first mismatch>"   (pattern check)
//   fill ADDR LEN SEED FIRST     -> "ok"
//   sum ADDR LEN                 -> "ok <checksum hex>"
//   notify_check COUNT ADDR TAGBASE SEED SRC_ENGINE TIMEOUT_MS
//        waits COUNT notifications; the k-th must carry TAGBASE+k from SRC_ENGINE and, when
//        it arrives, slot k (notifySlot) at ADDR must already hold pattern(SEED+k)
//                                -> "ok" | "bad <what>"
//   drain_notify QUIET_MS        -> "ok <number of notifications received>"
//   echo CHANNEL COUNT TIMEOUT_MS
//        receives COUNT messages on CHANNEL, sends each back to its sender on CHANNEL+1
//        (the sender found with peerOf), then notifies it with tag COUNT -> "ok" | "bad <what>"
//   unregister ADDR              -> "ok" | "bad <status>" (then republishes the segment)
//   gpu_flushes                  -> "ok <the device layer's remoteWriteFlushes()>"
//   exit                         -> "bye", exits 0
#pragma once

#include <sys/types.h>

#include <csignal>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/engine.h"

namespace mooncake::test {

// Bytes of the peer's never-registered buffer (a target for "unregistered address" tests).
constexpr uint64_t kUnregBytes = 64 * 1024;

struct PeerConfig {
  std::string name = "peer";
  std::string transport;               // "shm", "tcp" or "" (engine chooses)
  std::string secret = "job-secret-of-this-test-0123456789ab";
  uint64_t region_bytes = 1u << 20;    // size of the allocate()d and of the registered region
  uint64_t seed = 1000;                // initial contents: see the *Seed() helpers below
};

// The allocate()d region holds pattern(allocSeed), the registerMemory()'d (malloc'ed, not
// shm-backed) one pattern(regSeed), the unregistered one pattern(unregSeed), each from 0.
inline uint64_t allocSeed(const PeerConfig& c) { return c.seed; }
inline uint64_t regSeed(const PeerConfig& c) { return c.seed + 1; }
inline uint64_t unregSeed(const PeerConfig& c) { return c.seed + 2; }

struct PeerInfo {
  uint64_t alloc_addr = 0;
  uint64_t reg_addr = 0;
  uint64_t unreg_addr = 0;
  uint64_t region_bytes = 0;
  uint64_t engine_id = 0;
  pid_t pid = -1;
};

// Layout shared by the notification test and the peer's notify_check: slot k of a buffer.
struct Slot {
  uint64_t offset;
  uint64_t len;
};
Slot notifySlot(int k);
// Bytes needed for slots [0, count).
uint64_t notifyBytes(int count);

class PeerProcess {
 public:
  // Starts the peer; returns nullptr with *error set when it could not start or did not
  // report ready within the deadline.
  static std::unique_ptr<PeerProcess> spawn(const PeerConfig& cfg, uint16_t rdv_port,
                                            std::string* error, int ready_timeout_ms = 20000);
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  const PeerInfo& info() const { return info_; }
  const PeerConfig& config() const { return cfg_; }
  pid_t pid() const { return pid_; }

  bool send(const std::string& line);
  // One reply line; false on timeout or when the peer closed its end (died).
  bool recv(std::string* line, int timeout_ms, std::string* error = nullptr);
  // send + recv: the reply, or "ERROR: <why>" when none came.
  std::string call(const std::string& line, int timeout_ms = 30000);

  // "" when [addr, addr+len) in the peer holds pattern(seed)[first...], else what differs.
  std::string expect(uint64_t addr, uint64_t len, uint64_t seed, uint64_t first = 0);
  std::string sum(uint64_t addr, uint64_t len);

  void kill(int sig = SIGKILL);
  // Reaps the process if it exited within timeout_ms; *status gets the wait status.
  bool waitExit(int timeout_ms, int* status = nullptr);
  // Asks it to exit and reaps it. Returns the exit code, or 128+signal, or -1 on timeout
  // (then it was killed).
  int shutdown(int timeout_ms = 10000);

 private:
  PeerProcess() = default;
  PeerConfig cfg_;
  PeerInfo info_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int cmd_fd_ = -1;
  int reply_fd_ = -1;
  std::string rbuf_;
};

// Call first thing in main(): when argv asks for peer mode, runs the peer and returns true
// with its exit code in *rc. Also ignores SIGPIPE (a dead peer must give errors, not kill).
bool maybeRunPeer(int argc, char** argv, int* rc);

}  // namespace mooncake::test
