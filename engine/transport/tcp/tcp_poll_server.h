// The frame of a server run by one thread around poll() (the tcp rendezvous server,
// engine/rendezvous.cc; the store master's status port, store/tools/status_http.cc): its
// listening socket, whose connections are admitted as tcp_admission.h says (not polled while
// admission pauses it), an eventfd that wakes the thread to stop, and the thread. The owner
// keeps its connections and runs the loop: each round starts with head() and, after poll(),
// accept(); its connections' pollfds follow the kHead first ones.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/status.h"
#include "engine/transport/tcp/tcp_admission.h"
#include "engine/transport/tcp/tcp_socket.h"

namespace mooncake::engine::tcp {

class PollServer {
 public:
  static constexpr size_t kHead = 2;  // the wake fd, the listener

  // what: the server's name in admission's log lines.
  explicit PollServer(std::string what) : admission_(std::move(what)) {}
  ~PollServer() {
    stop();
    if (listen_fd_ >= 0) close(listen_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }
  PollServer(const PollServer&) = delete;
  PollServer& operator=(const PollServer&) = delete;

  // Listens on host:port (0: a free port); the wake fd.
  Status listen(const std::string& host, uint16_t port) {
    MC_ASSIGN_OR_RETURN(listen_fd_, sock::listenOn(host, port, 0));
    port_ = sock::localPort(listen_fd_);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return MC_STATUS(kIo, "eventfd: " << sock::errnoStr(errno));
    return Status::OK();
  }
  void start(std::function<void()> loop) { thread_ = std::thread(std::move(loop)); }
  // Ends the loop (stopping() turns true, poll() returns) and joins it. The owner calls it
  // before it lets go of what the loop uses; idempotent.
  void stop() {
    if (!thread_.joinable()) return;
    stop_ = true;
    uint64_t one = 1;
    ssize_t w = write(wake_fd_, &one, sizeof(one));
    (void)w;
    thread_.join();
  }
  bool stopping() const { return stop_.load(); }
  uint16_t port() const { return port_; }
  Admission& admission() { return admission_; }
  bool paused() const { return paused_; }  // the listener is left out until pausedUntil()

  // The first pollfds of a round (pfds is cleared first).
  void head(std::vector<pollfd>* pfds) {
    pfds->clear();
    pfds->push_back({wake_fd_, POLLIN, 0});
    if (paused_ && Clock::now() >= admission_.pausedUntil()) paused_ = false;
    pfds->push_back({listen_fd_, static_cast<short>(paused_ ? 0 : POLLIN), 0});
  }
  // After poll(): takes the connections waiting on the listener (admit as Admission::acceptAll).
  void accept(const std::vector<pollfd>& pfds,
              const std::function<void(int fd, const std::string& src)>& admit) {
    if ((pfds[1].revents & POLLIN) && !admission_.acceptAll(listen_fd_, admit)) paused_ = true;
  }

 private:
  Admission admission_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  uint16_t port_ = 0;
  bool paused_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace mooncake::engine::tcp
