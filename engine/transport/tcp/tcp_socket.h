// Small blocking-with-deadline socket helpers shared by the tcp transport and the tcp
// rendezvous. Every socket here is non-blocking; "blocking" calls poll() until their deadline.
// All sends use MSG_NOSIGNAL: a dead peer is an error code, never a SIGPIPE.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine::sock {

// Milliseconds left until d, clamped to [0, INT_MAX] (the unit poll() takes).
inline int msUntil(Deadline d) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

inline std::string errnoStr(int e) { return std::string(std::strerror(e)); }

// Sends what a non-blocking socket takes now of out[*off..]: advances *off. 1: all of it went
// out; 0: the socket is full (wait for POLLOUT); -1: the connection broke.
inline int sendPending(int fd, const std::string& out, size_t* off) {
  while (*off < out.size()) {
    ssize_t w = send(fd, out.data() + *off, out.size() - *off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      *off += static_cast<size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return 0;
    } else {
      return -1;
    }
  }
  return 1;
}

inline bool setNonBlocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

inline void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Keepalive probes on an idle connection: a peer whose host vanished (no FIN, no RST) is
// noticed after about idle + intvl * cnt seconds. Only an idle one: while sent data waits
// for its acknowledgement the kernel sends no probe (see setUserTimeout).
inline void setKeepAlive(int fd, int idle_s = 10, int intvl_s = 2, int cnt = 3) {
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl_s, sizeof(intvl_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

// TCP_USER_TIMEOUT: the connection errors (ETIMEDOUT) once data it sent has stayed
// unacknowledged for `ms`, instead of after the kernel's ~15 minutes of retransmissions
// (net.ipv4.tcp_retries2) - the case keepalive does not cover: a peer whose host vanished
// while this side had bytes queued toward it. It also closes a connection whose peer
// advertised a zero window for that long (a receiver that stopped reading: a stopped
// process), and with keepalive on, an idle connection whose probes go unanswered for that
// long since the peer was last heard. ms <= 0 leaves the kernel's default.
inline void setUserTimeout(int fd, int64_t ms) {
  if (ms <= 0) return;
  unsigned int v = static_cast<unsigned int>(std::min<int64_t>(ms, INT_MAX));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &v, sizeof(v));
}

// Both: what a long-lived connection to a peer that may vanish gets.
inline void setLiveness(int fd, int64_t user_timeout_ms) {
  setKeepAlive(fd);
  setUserTimeout(fd, user_timeout_ms);
}

// Asks for `bytes` of socket buffer each way (capped by net.core.[rw]mem_max). Must be set
// before connect()/listen() so that the window scale is negotiated for it.
inline void setBuffers(int fd, int bytes) {
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

// Resolves host:port (IPv4 or IPv6, numeric or name). An empty host or "0.0.0.0" with
// passive=true means every local address.
inline Status resolve(const std::string& host, uint16_t port, bool passive, sockaddr_storage* out,
                      socklen_t* out_len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string port_s = std::to_string(port);
  const char* h = host.empty() ? nullptr : host.c_str();
  if (passive && host.empty()) hints.ai_family = AF_INET;
  int rc = getaddrinfo(h, port_s.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    return MC_STATUS(kUnavailable,
                     "cannot resolve " << host << ":" << port << ": " << gai_strerror(rc));
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  freeaddrinfo(res);
  return Status::OK();
}

inline bool isWildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

// The first non-loopback IPv4 address of an interface that is up, or 127.0.0.1.
inline std::string firstNonLoopbackIPv4() {
  ifaddrs* ifs = nullptr;
  std::string found = "127.0.0.1";
  if (getifaddrs(&ifs) != 0) return found;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char buf[INET_ADDRSTRLEN];
    auto* in = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf)) != nullptr) {
      found = buf;
      break;
    }
  }
  freeifaddrs(ifs);
  return found;
}

// The local address this host would use to talk to `host` (the routing table's answer: a UDP
// socket is "connected", which sends nothing, and asked for its own address). A loopback answer
// comes back as 127.0.0.1 / ::1. Empty when `host` does not resolve or no route leads there.
inline std::string localAddressToward(const std::string& host) {
  std::string h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(h.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "";
  std::string out;
  for (addrinfo* a = res; a != nullptr && out.empty(); a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage me{};
    socklen_t ml = sizeof(me);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&me), &ml) == 0) {
      char buf[INET6_ADDRSTRLEN] = {0};
      if (me.ss_family == AF_INET)
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&me)->sin_addr, buf, sizeof(buf));
      else if (me.ss_family == AF_INET6)
        inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&me)->sin6_addr, buf, sizeof(buf));
      out = buf;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

// A non-blocking listening socket on host:port (port 0: any free port).
inline Result<int> listenOn(const std::string& host, uint16_t port, int buf_bytes) {
  sockaddr_storage sa{};
  socklen_t sl = 0;
  MC_RETURN_IF_ERROR(resolve(host, port, true, &sa, &sl));
  int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return MC_STATUS(kIo, "socket: " << errnoStr(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (buf_bytes > 0) setBuffers(fd, buf_bytes);  // inherited by accepted sockets
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sl) != 0 || listen(fd, 512) != 0) {
    int e = errno;
    close(fd);
    return MC_STATUS(kUnavailable,
                     "cannot listen on " << host << ":" << port << ": " << errnoStr(e));
  }
  return fd;
}

inline uint16_t localPort(int fd) {
  sockaddr_storage sa{};
  socklen_t sl = sizeof(sa);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &sl) != 0) return 0;
  if (sa.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
  if (sa.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port);
  return 0;
}

// Connects to host:port before the deadline; returns a non-blocking socket. With
// retry_refused, a refused connection is retried (the server may not be up yet) until the
// deadline. kTimeout at the deadline, kUnavailable when the address is unreachable.
inline Result<int> connectTo(const std::string& host, uint16_t port, Deadline deadline,
                             bool retry_refused, int buf_bytes) {
  sockaddr_storage sa{};
  socklen_t sl = 0;
  MC_RETURN_IF_ERROR(resolve(host, port, false, &sa, &sl));
  int backoff_ms = 5;
  for (;;) {
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return MC_STATUS(kIo, "socket: " << errnoStr(errno));
    if (buf_bytes > 0) setBuffers(fd, buf_bytes);
    int err = 0;
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sl) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        int rc;
        do {
          rc = poll(&p, 1, msUntil(deadline));
        } while (rc < 0 && errno == EINTR);
        if (rc == 0) {
          close(fd);
          return MC_STATUS(kTimeout, "connect to " << host << ":" << port << " timed out");
        }
        socklen_t el = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
      }
    }
    if (err == 0) return fd;
    close(fd);
    bool retry = retry_refused && (err == ECONNREFUSED || err == ECONNRESET || err == ETIMEDOUT);
    if (!retry)
      return MC_STATUS(kUnavailable, "connect to " << host << ":" << port << ": " << errnoStr(err));
    if (msUntil(deadline) <= 0)
      return MC_STATUS(
          kTimeout, "connect to " << host << ":" << port << " timed out (" << errnoStr(err) << ")");
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(backoff_ms, std::max(1, msUntil(deadline)))));
    backoff_ms = std::min(backoff_ms * 2, 200);
  }
}

// Sends all of [p, p+n) before the deadline. kTimeout at the deadline, kUnavailable when
// the connection broke.
inline Status sendAll(int fd, const void* p, size_t n, Deadline deadline) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      c += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return MC_STATUS(kUnavailable, "send: " << errnoStr(errno));
    pollfd pf{fd, POLLOUT, 0};
    int rc = poll(&pf, 1, msUntil(deadline));
    if (rc == 0) return MC_STATUS(kTimeout, "send timed out");
  }
  return Status::OK();
}

// Receives exactly n bytes before the deadline. kTimeout at the deadline (partial data may
// have been consumed), kUnavailable on EOF or a broken connection.
inline Status recvAll(int fd, void* p, size_t n, Deadline deadline, size_t* got = nullptr) {
  char* c = static_cast<char*>(p);
  size_t done = 0;
  Status st;
  while (done < n) {
    ssize_t r = recv(fd, c + done, n - done, MSG_DONTWAIT);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) {
      st = MC_STATUS(kUnavailable, "connection closed by the other side");
      break;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      st = MC_STATUS(kUnavailable, "recv: " << errnoStr(errno));
      break;
    }
    pollfd pf{fd, POLLIN, 0};
    int rc = poll(&pf, 1, msUntil(deadline));
    if (rc == 0) {
      st = MC_STATUS(kTimeout, "receive timed out");
      break;
    }
  }
  if (got != nullptr) *got = done;
  return st;
}

}  // namespace mooncake::engine::sock
