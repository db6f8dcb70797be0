#include "store/tools/status_http.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <sstream>
#include <thread>
#include <vector>

#include "engine/log.h"
#include "engine/transport/tcp/tcp_poll_server.h"
#include "engine/transport/tcp/tcp_socket.h"

namespace mooncake::store {

namespace {

namespace sock = engine::sock;
using engine::Clock;
using engine::Deadline;

constexpr size_t kMaxHeadBytes = 8192;
constexpr int kRequestMs = 2000;

const char* reasonOf(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string render(const StatusReply& r, bool head_only) {
  std::ostringstream o;
  o << "HTTP/1.1 " << r.status << " " << reasonOf(r.status) << "\r\n"
    << "Content-Type: " << r.content_type << "\r\n"
    << "Content-Length: " << r.body.size() << "\r\n"
    << "Connection: close\r\n";
  if (r.status == 405) o << "Allow: GET, HEAD\r\n";
  o << "\r\n";
  if (!head_only) o << r.body;
  return o.str();
}

// Where the request head ends (after its last header line, before the empty line), or npos
// while it has not ended. Empty lines before the request line do not end it.
size_t headEnd(const std::string& in) {
  size_t start = 0;
  while (start < in.size() && (in[start] == '\r' || in[start] == '\n')) ++start;
  for (size_t i = in.find('\n', start); i != std::string::npos; i = in.find('\n', i + 1)) {
    size_t j = i + 1;
    if (j < in.size() && in[j] == '\r') ++j;
    if (j < in.size() && in[j] == '\n') return i + 1;
  }
  return std::string::npos;
}

StatusReply plain(int status, std::string body) {
  StatusReply r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

}  // namespace

struct StatusHttpServer::Impl {
  struct Conn {
    int fd = -1;
    std::string src;
    Deadline deadline{};
    std::string in;
    std::string out;
    size_t out_off = 0;
    bool answered = false;
  };

  engine::tcp::PollServer server{"status http"};
  std::map<std::string, Route> routes;
  uint64_t next_id = 1;
  std::map<uint64_t, Conn> conns;

  ~Impl() {
    server.stop();
    for (auto& [id, c] : conns) {
      close(c.fd);
      server.admission().closed(c.src, false);
    }
  }

  void drop(uint64_t id) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    close(it->second.fd);
    server.admission().closed(it->second.src, false);
    conns.erase(it);
  }

  // The answer to a complete request head (the request line and headers).
  StatusReply answer(std::string head, bool* head_only) {
    *head_only = false;
    // Lines may end in a bare LF (RFC 9112 allows it); empty lines before the request line are
    // skipped.
    std::string norm;
    for (size_t i = 0; i < head.size(); ++i)
      if (head[i] != '\r') norm += head[i];
    head = norm.substr(norm.find_first_not_of('\n') == std::string::npos
                           ? norm.size()
                           : norm.find_first_not_of('\n'));
    size_t eol = head.find('\n');
    std::istringstream line(head.substr(0, eol));
    std::string method, target, version, extra;
    line >> method >> target >> version;
    if (method.empty() || target.empty() || version.rfind("HTTP/1.", 0) != 0 || (line >> extra))
      return plain(400, "bad request\n");
    for (size_t at = eol + 1; eol != std::string::npos && at < head.size();) {
      size_t next = head.find('\n', at);
      if (next == std::string::npos) next = head.size();
      const std::string h = head.substr(at, next - at);
      at = next + 1;
      size_t colon = h.find(':');
      if (colon == std::string::npos) continue;
      const std::string name = lower(trim(h.substr(0, colon)));
      const std::string value = trim(h.substr(colon + 1));
      if (name == "transfer-encoding" || (name == "content-length" && value != "0"))
        return plain(413, "no request body is accepted\n");
    }
    if (method != "GET" && method != "HEAD") return plain(405, "GET or HEAD only\n");
    *head_only = method == "HEAD";
    // Absolute form ("http://host:port/health"), which proxies send: the path is what counts.
    if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0) {
      const size_t slash = target.find('/', target.find("://") + 3);
      target = slash == std::string::npos ? "/" : target.substr(slash);
    }
    auto r = routes.find(target.substr(0, target.find('?')));
    if (r == routes.end()) return plain(404, "not found\n");
    return r->second();
  }

  // Reads what the socket has; answers once the head is complete.
  void readable(uint64_t id) {
    Conn& c = conns[id];
    char buf[4096];
    for (;;) {
      ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        if (c.answered) continue;  // what follows the head is not read into memory
        c.in.append(buf, static_cast<size_t>(n));
        size_t end = headEnd(c.in);
        if (end != std::string::npos) {
          bool head_only = false;
          const StatusReply reply = answer(c.in.substr(0, end), &head_only);
          c.out = render(reply, head_only);
          c.answered = true;
          c.in.clear();
          c.in.shrink_to_fit();
          flush(id);
          return;
        }
        if (c.in.size() > kMaxHeadBytes) {
          c.out = render(plain(431, "request head over 8 KiB\n"), false);
          c.answered = true;
          c.in.clear();
          flush(id);
          return;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      // The peer closed (or failed) before its answer was taken.
      if (!c.answered || c.out_off < c.out.size()) drop(id);
      return;
    }
  }

  // Writes what the socket takes now; closes once the whole answer went out.
  void flush(uint64_t id) {
    Conn& c = conns[id];
    const int sent = sock::sendPending(c.fd, c.out, &c.out_off);
    if (sent == 0) return;  // the rest on POLLOUT
    if (sent > 0) shutdown(c.fd, SHUT_WR);
    drop(id);
  }

  void run() {
    std::vector<pollfd> pfds;
    std::vector<uint64_t> ids;
    while (!server.stopping()) {
      server.head(&pfds);
      ids.clear();
      Deadline next = Clock::now() + std::chrono::hours(1);
      for (auto& [id, c] : conns) {
        short ev = c.answered ? POLLOUT : POLLIN;
        pfds.push_back({c.fd, ev, 0});
        ids.push_back(id);
        next = std::min(next, c.deadline);
      }
      if (server.paused()) next = std::min(next, server.admission().pausedUntil());
      int n = poll(pfds.data(), pfds.size(), sock::msUntil(next) + 1);
      if (n < 0 && errno != EINTR) {
        MC_LOG(ERROR, STORE) << "status http: poll: " << sock::errnoStr(errno);
        break;
      }
      if (server.stopping()) break;
      server.accept(pfds, [this](int fd, const std::string& src) {
        Conn& c = conns[next_id++];
        c.fd = fd;
        c.src = src;
        c.deadline = Clock::now() + std::chrono::milliseconds(kRequestMs);
      });
      for (size_t i = 0; i < ids.size(); ++i) {
        const short re = pfds[i + engine::tcp::PollServer::kHead].revents;
        if (re == 0 || conns.count(ids[i]) == 0) continue;
        if (conns[ids[i]].answered) {
          if (re & (POLLERR | POLLHUP)) drop(ids[i]);
          else flush(ids[i]);
        } else {
          readable(ids[i]);
        }
      }
      const Deadline now = Clock::now();
      std::vector<uint64_t> late;
      for (auto& [id, c] : conns)
        if (c.deadline <= now) late.push_back(id);
      for (uint64_t id : late) drop(id);
    }
  }
};

StatusHttpServer::StatusHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StatusHttpServer::~StatusHttpServer() = default;
uint16_t StatusHttpServer::port() const { return impl_->server.port(); }

Result<std::unique_ptr<StatusHttpServer>> StatusHttpServer::start(
    const std::string& host, uint16_t port, std::map<std::string, Route> routes) {
  auto impl = std::make_unique<Impl>();
  impl->routes = std::move(routes);
  MC_RETURN_IF_ERROR(impl->server.listen(host, port));
  Impl* p = impl.get();
  impl->server.start([p] { p->run(); });
  return std::unique_ptr<StatusHttpServer>(new StatusHttpServer(std::move(impl)));
}

}  // namespace mooncake::store
