#include "engine/transport/tcp/tcp_admission.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/log.h"
#include "engine/params.h"

namespace mooncake::engine::tcp {

Admission::Limits Admission::Limits::fromParams() {
  Limits l;
  l.per_source = std::max<int64_t>(1, params::getInt("MC_MAX_PREAUTH_PER_SOURCE"));
  l.preauth = std::max<int64_t>(1, params::getInt("MC_MAX_PREAUTH"));
  // Strangers must not take the descriptors the process needs for its own work (shm, peers,
  // etcd): at most a quarter of the soft limit waits to authenticate, per listener.
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    const auto quarter = static_cast<int64_t>(std::min<rlim_t>(nofile.rlim_cur / 4, 1 << 30));
    l.preauth = std::min(l.preauth, std::max<int64_t>(16, quarter));
  }
  l.per_source = std::min(l.per_source, l.preauth);
  l.total = std::max<int64_t>(1, params::getInt("MC_MAX_CONNS"));
  l.handshake_ms = std::max<int64_t>(1, params::getInt("MC_HANDSHAKE_TIMEOUT_MS"));
  return l;
}

Admission::Admission(std::string what, Limits limits) : what_(std::move(what)), limits_(limits) {
  reopenReserve();
}

Admission::~Admission() {
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

void Admission::reopenReserve() {
  if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

std::string peerAddress(int fd) {
  sockaddr_storage sa{};
  socklen_t sl = sizeof(sa);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &sl) != 0) return "?";
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&sa)->sin_addr, buf, sizeof(buf));
  } else if (sa.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&sa)->sin6_addr, buf, sizeof(buf));
  } else {
    return "local";
  }
  return buf;
}

bool Admission::admit(const std::string& src) {
  int64_t& mine = preauth_by_src_[src];
  if (open_ >= limits_.total || preauth_ >= limits_.preauth || mine >= limits_.per_source) {
    if (mine == 0) preauth_by_src_.erase(src);
    if (!refused_logged_) {
      refused_logged_ = true;
      MC_LOG(WARN, TCP) << what_ << ": refusing connections (from " << src << ": "
                        << (open_ >= limits_.total     ? "MC_MAX_CONNS"
                            : preauth_ >= limits_.preauth ? "MC_MAX_PREAUTH"
                                                          : "MC_MAX_PREAUTH_PER_SOURCE")
                        << " reached); logged once until the load passes";
    }
    return false;
  }
  refused_logged_ = false;
  ++mine;
  ++preauth_;
  ++open_;
  return true;
}

bool Admission::acceptAll(int listen_fd,
                          const std::function<void(int fd, const std::string& src)>& admit_fn) {
  for (;;) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (exhausted_logged_) {
        exhausted_logged_ = false;
        MC_LOG(WARN, TCP) << what_ << ": file descriptors available again";
      }
      std::string src = peerAddress(fd);
      if (!admit(src)) {
        ::close(fd);
        continue;
      }
      admit_fn(fd, src);
      continue;
    }
    int e = errno;
    if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue;
    if (e != EMFILE && e != ENFILE) return true;  // EAGAIN: the backlog is empty
    if (!exhausted_logged_) {
      exhausted_logged_ = true;
      MC_LOG(ERROR, TCP) << what_ << ": out of file descriptors (" << std::strerror(e)
                         << "); closing new connections until some are free";
    }
    // Free the reserve, take the connection off the backlog and close it: the peer gets a
    // prompt reset instead of a hang, and the listener stops being readable.
    if (reserve_fd_ >= 0) {
      ::close(reserve_fd_);
      reserve_fd_ = -1;
      int victim = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (victim >= 0) ::close(victim);
      reopenReserve();
      if (victim >= 0) continue;
    }
    // Nothing could be freed (the system table is full): back off instead of spinning.
    paused_until_ = Clock::now() + std::chrono::milliseconds(100);
    return false;
  }
}

void Admission::authenticated(const std::string& src) {
  auto it = preauth_by_src_.find(src);
  if (it != preauth_by_src_.end() && --it->second <= 0) preauth_by_src_.erase(it);
  if (preauth_ > 0) --preauth_;
}

void Admission::closed(const std::string& src, bool authed) {
  if (!authed) authenticated(src);
  if (open_ > 0) --open_;
}

Deadline Admission::handshakeDeadline(Deadline accepted) const {
  return accepted + std::chrono::milliseconds(limits_.handshake_ms);
}

}  // namespace mooncake::engine::tcp
