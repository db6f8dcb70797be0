// Admission control for a listener that serves peers only after they authenticate (the engine's
// tcp transport, the tcp rendezvous server): what an unauthenticated connection may cost.
//
//  - At most MC_MAX_PREAUTH_PER_SOURCE connections from one source address, and MC_MAX_PREAUTH in
//    all, may be waiting to authenticate; MC_MAX_CONNS connections may be open in all. A
//    connection over a limit is closed as it is accepted.
//  - An unauthenticated connection gets MC_HANDSHAKE_TIMEOUT_MS to authenticate (the owner
//    sweeps with expired()); the owner also bounds what it reads before authentication.
//  - Out of file descriptors (EMFILE/ENFILE), accept() would fail forever while the connection
//    stays in the backlog, and a level-triggered poll loop would spin. acceptAll() gives up a
//    reserved descriptor to accept and close such connections, logs once per episode, and when
//    even that fails (ENFILE) tells the owner to stop polling the listener for a while.
//
// Not thread-safe: one owner thread (the listener's loop) calls everything.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>

#include "engine/types.h"

namespace mooncake::engine::tcp {

class Admission {
 public:
  struct Limits {
    int64_t per_source = 128;
    int64_t preauth = 1024;
    int64_t total = 16384;
    int64_t handshake_ms = 5000;
    static Limits fromParams();
  };

  // what: the listener's name in log lines ("engine tcp", "rendezvous").
  explicit Admission(std::string what, Limits limits = Limits::fromParams());
  ~Admission();
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Accepts every pending connection of the non-blocking listen_fd. admit(fd, source) takes each
  // one within the limits (it then owns fd and must report closed()); the others are closed here.
  // Returns false when the listener should not be polled until pausedUntil() (descriptors
  // exhausted and none could be freed).
  bool acceptAll(int listen_fd, const std::function<void(int fd, const std::string& src)>& admit);
  Deadline pausedUntil() const { return paused_until_; }

  // A connection admitted from `src` authenticated (it no longer counts as pre-auth).
  void authenticated(const std::string& src);
  // An admitted connection closed; authed: whether it had authenticated.
  void closed(const std::string& src, bool authed);

  // When a connection accepted at `accepted` must have authenticated.
  Deadline handshakeDeadline(Deadline accepted) const;
  int64_t handshakeMs() const { return limits_.handshake_ms; }
  int64_t preauthCount() const { return preauth_; }

 private:
  bool admit(const std::string& src);
  void reopenReserve();

  std::string what_;
  Limits limits_;
  int reserve_fd_ = -1;
  bool exhausted_logged_ = false;
  bool refused_logged_ = false;
  Deadline paused_until_{};
  int64_t preauth_ = 0;
  int64_t open_ = 0;
  std::unordered_map<std::string, int64_t> preauth_by_src_;
};

// "a.b.c.d" or "v6addr" of a socket's peer ("?" when unknown).
std::string peerAddress(int fd);

}  // namespace mooncake::engine::tcp
