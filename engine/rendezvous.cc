// Rendezvous implementations: in-process (mutex + condvar) and a tiny TCP key/value server
// with its client.
//
// TCP protocol (all little-endian, built with engine/wire.h). Every message is a frame:
//   u32 body_length | body
// request body:  u8 op | str key | str value | u64 wait_timeout_ms
// response body: u8 code (mooncake::Code) | str value-or-error-message
// The server speaks first: on accept it sends one response (code kOk, value = a fresh 32-byte
// challenge). ops: AUTH (value = the client's fresh 32-byte nonce followed by its proof of the
// job secret, engine/hmac.h's secretProof with role kClientProof over the challenge and that
// nonce; must be a connection's first request, else it is closed; a wrong proof is answered
// kPermissionDenied and the connection closed; a right one kOk with the server's proof, role
// kServerProof over the same nonces, which the client checks before it sends anything else:
// neither side ever sends the secret itself), SET, GET
// (NotFound when absent), WAIT (answered when the key exists, or kTimeout after
// wait_timeout_ms), ADD (value = decimal delta; the stored value and the answer are decimal).
// A frame longer than its limit (kMaxPreAuthFrame before AUTH, kMaxFrame after), or a body
// that does not decode exactly, closes that connection; the server never trusts the wire.
//
// The server is one thread around poll(); a WAIT never blocks it: the waiter is parked under
// its key and answered by the SET/ADD that creates it (or by its timeout). The client sends
// set/get/add on its one connection under a mutex; wait() first tries a GET there and, when
// the key is absent, waits on a dedicated short-lived connection so that a long wait never
// holds up the client's other calls (another thread may be about to set that very key).
#include "engine/rendezvous.h"

#include <endian.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "engine/hmac.h"
#include "engine/log.h"
#include "engine/params.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_poll_server.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "engine/wire.h"

namespace mooncake::engine {

// ---------------------------------------------------------------- in-process

Status InProcessRendezvous::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> g(mu_);
    kv_[key] = value;
  }
  cv_.notify_all();
  return Status::OK();
}

Result<std::string> InProcessRendezvous::get(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = kv_.find(key);
  if (it == kv_.end()) return MC_STATUS(kNotFound, "rendezvous key '" << key << "' not set");
  return it->second;
}

Result<std::string> InProcessRendezvous::wait(const std::string& key, Deadline deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  bool found = cv_.wait_until(lk, deadline, [&] { return kv_.count(key) != 0; });
  if (!found) return MC_STATUS(kTimeout, "rendezvous key '" << key << "' not set in time");
  return kv_[key];
}

namespace {

// Parses a whole decimal int64 (the stored form of ADD counters).
bool parseInt64(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

// Adds with the counter semantics every implementation shares (absent = 0).
Result<int64_t> addTo(std::map<std::string, std::string>& kv, const std::string& key,
                      int64_t delta) {
  int64_t cur = 0;
  auto it = kv.find(key);
  if (it != kv.end() && !parseInt64(it->second, &cur))
    return MC_STATUS(kInvalidArgument, "rendezvous key '" << key << "' is not a counter");
  int64_t next = static_cast<int64_t>(static_cast<uint64_t>(cur) + static_cast<uint64_t>(delta));
  kv[key] = std::to_string(next);
  return next;
}

}  // namespace

Result<int64_t> InProcessRendezvous::add(const std::string& key, int64_t delta) {
  Result<int64_t> r(int64_t{0});
  {
    std::lock_guard<std::mutex> g(mu_);
    r = addTo(kv_, key, delta);
  }
  cv_.notify_all();
  return r;
}

// ---------------------------------------------------------------- tcp protocol

namespace {

enum Op : uint8_t { kSet = 1, kGet = 2, kWait = 3, kAdd = 4, kAuth = 5 };
constexpr size_t kNonceBytes = 32;
constexpr const char* kClientProof = "mooncake rendezvous v1 client";
constexpr const char* kServerProof = "mooncake rendezvous v1 server";
constexpr uint32_t kMaxFrame = 64u << 20;  // descriptors are small; this is a sanity bound
constexpr uint32_t kMaxKey = 4096;
constexpr uint32_t kMaxPreAuthFrame = 64 + kMaxSecretBytes;  // an AUTH request, no more

std::string frame(const std::string& body) {
  wire::Writer w;
  w.u32(static_cast<uint32_t>(body.size()));
  w.raw(body.data(), body.size());
  return w.take();
}

std::string encodeResponse(Code code, const std::string& value) {
  wire::Writer w;
  w.u8(static_cast<uint8_t>(code));
  w.str(value);
  return frame(w.data());
}

}  // namespace

// ---------------------------------------------------------------- server

struct TcpRendezvousServer::Impl {
  struct Conn {
    int fd = -1;
    std::string src;
    Deadline handshake_by{};
    bool authed = false;
    std::string challenge;  // sent on accept, answered by AUTH
    std::string in;
    size_t in_off = 0;
    std::string out;
    size_t out_off = 0;
  };
  struct Waiter {
    uint64_t conn;
    Deadline deadline;
  };

  tcp::PollServer server{"rendezvous server"};
  uint64_t next_conn = 1;
  std::map<uint64_t, Conn> conns;
  std::map<std::string, std::string> kv;
  std::multimap<std::string, Waiter> waiters;
  std::string secret;
  uint64_t max_value = 4u << 20;
  uint64_t max_total = 256u << 20;
  uint64_t total_bytes = 0;  // keys + values held

  ~Impl() {
    server.stop();
    for (auto& [id, c] : conns) {
      close(c.fd);
      server.admission().closed(c.src, c.authed);
    }
  }

  void reply(uint64_t id, Code code, const std::string& value) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    it->second.out += encodeResponse(code, value);
    flush(id);
  }

  // Writes what the socket takes now; the rest goes out on POLLOUT. Closes on error.
  void flush(uint64_t id) {
    Conn& c = conns[id];
    const int sent = sock::sendPending(c.fd, c.out, &c.out_off);
    if (sent == 0) return;
    if (sent < 0) {
      drop(id, "send failed");
      return;
    }
    c.out.clear();
    c.out_off = 0;
  }

  void drop(uint64_t id, const char* why) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    MC_LOG(DEBUG, ENGINE) << "rendezvous server: closing connection " << id << ": " << why;
    close(it->second.fd);
    server.admission().closed(it->second.src, it->second.authed);
    conns.erase(it);
    for (auto w = waiters.begin(); w != waiters.end();)
      w = (w->second.conn == id) ? waiters.erase(w) : std::next(w);
  }

  void keySet(const std::string& key) {
    auto range = waiters.equal_range(key);
    std::vector<uint64_t> ids;
    for (auto it = range.first; it != range.second; ++it) ids.push_back(it->second.conn);
    waiters.erase(range.first, range.second);
    const std::string& v = kv[key];
    for (uint64_t id : ids) reply(id, Code::kOk, v);
  }

  // Stores key = value within the size limits; false (with the reason) when refused.
  bool store(const std::string& key, std::string value, std::string* why) {
    if (value.size() > max_value) {
      *why = "value of " + std::to_string(value.size()) + " bytes for '" + key +
             "' exceeds MC_RENDEZVOUS_MAX_VALUE_BYTES (" + std::to_string(max_value) + ")";
      return false;
    }
    auto it = kv.find(key);
    uint64_t old_bytes = it == kv.end() ? 0 : key.size() + it->second.size();
    uint64_t new_total = total_bytes - old_bytes + key.size() + value.size();
    if (new_total > max_total) {
      *why = "the rendezvous holds " + std::to_string(total_bytes) +
             " bytes; setting '" + key + "' would pass MC_RENDEZVOUS_MAX_TOTAL_BYTES (" +
             std::to_string(max_total) + ")";
      return false;
    }
    total_bytes = new_total;
    kv[key] = std::move(value);
    return true;
  }

  // Decodes and serves one request body; false when malformed or refused (the caller closes;
  // *refused: a wrong secret, already logged).
  bool handle(uint64_t id, std::string_view body, bool* refused) {
    wire::Reader r(body);
    uint8_t op = r.u8();
    std::string key = r.str(kMaxKey);
    std::string value = r.str(kMaxFrame);
    uint64_t timeout_ms = r.u64();
    if (!r.done()) return false;
    Conn& c = conns[id];
    if (!c.authed) {
      if (op != kAuth || value.size() != kNonceBytes + kSha256Bytes) return false;
      const std::string nonce = value.substr(0, kNonceBytes);
      if (!secretsEqual(value.substr(kNonceBytes),
                        secretProof(secret, kClientProof, c.challenge, nonce, ""))) {
        MC_LOG(WARN, ENGINE) << "rendezvous server: wrong job secret from " << c.src;
        reply(id, Code::kPermissionDenied, "wrong job secret");  // best effort, then closed
        *refused = true;
        return false;
      }
      c.authed = true;
      server.admission().authenticated(c.src);
      std::string proof = secretProof(secret, kServerProof, c.challenge, nonce, "");
      c.challenge.clear();
      reply(id, Code::kOk, proof);  // (may drop the connection: `c` is not used after it)
      return true;
    }
    switch (op) {
      case kSet: {
        std::string why;
        if (!store(key, std::move(value), &why)) {
          reply(id, Code::kResourceExhausted, why);
          return true;
        }
        reply(id, Code::kOk, "");
        keySet(key);
        return true;
      }
      case kGet: {
        auto it = kv.find(key);
        if (it == kv.end())
          reply(id, Code::kNotFound, "key '" + key + "' not set");
        else
          reply(id, Code::kOk, it->second);
        return true;
      }
      case kWait: {
        auto it = kv.find(key);
        if (it != kv.end()) {
          reply(id, Code::kOk, it->second);
        } else {
          timeout_ms = std::min<uint64_t>(timeout_ms, 365ull * 24 * 3600 * 1000);
          waiters.emplace(key, Waiter{id, Clock::now() + std::chrono::milliseconds(timeout_ms)});
        }
        return true;
      }
      case kAdd: {
        int64_t delta = 0;
        if (!parseInt64(value, &delta)) return false;
        auto existed = kv.find(key);
        uint64_t before = existed == kv.end() ? 0 : key.size() + existed->second.size();
        if (existed == kv.end() && total_bytes + key.size() + 20 > max_total) {
          reply(id, Code::kResourceExhausted, "rendezvous full (MC_RENDEZVOUS_MAX_TOTAL_BYTES)");
          return true;
        }
        Result<int64_t> res = addTo(kv, key, delta);
        if (res.ok()) total_bytes = total_bytes - before + key.size() + kv[key].size();
        if (!res.ok()) {
          reply(id, res.status().code(), res.status().message());
        } else {
          reply(id, Code::kOk, std::to_string(*res));
          keySet(key);
        }
        return true;
      }
      default:
        return false;
    }
  }

  void readable(uint64_t id) {
    Conn* c = &conns[id];
    char buf[64 * 1024];
    for (;;) {
      // Before AUTH nothing beyond one small frame is buffered.
      constexpr size_t kPreAuthBytes = 4 + kMaxPreAuthFrame;
      size_t room = sizeof(buf);
      if (!c->authed) {
        if (c->in.size() > kPreAuthBytes) {
          drop(id, "oversized request before AUTH");
          return;
        }
        room = std::min(room, kPreAuthBytes + 1 - c->in.size());
      }
      ssize_t r = recv(c->fd, buf, room, MSG_DONTWAIT);
      if (r > 0) {
        c->in.append(buf, static_cast<size_t>(r));
        if (static_cast<size_t>(r) < room) break;
        if (!c->authed) break;  // parse what came before reading more
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      drop(id, r == 0 ? "closed by client" : "recv failed");
      return;
    }
    // Serve every complete frame.
    for (;;) {
      size_t avail = c->in.size() - c->in_off;
      if (avail < 4) break;
      uint32_t len;
      std::memcpy(&len, c->in.data() + c->in_off, 4);
      len = le32toh(len);
      if (len > (c->authed ? kMaxFrame : kMaxPreAuthFrame)) {
        MC_LOG(WARN, ENGINE) << "rendezvous server: oversized frame (" << len
                             << " bytes), closing connection";
        drop(id, "oversized frame");
        return;
      }
      if (avail < 4 + static_cast<size_t>(len)) break;
      std::string_view body(c->in.data() + c->in_off + 4, len);
      c->in_off += 4 + len;
      bool refused = false;
      if (!handle(id, body, &refused)) {
        if (!refused) {
          MC_LOG(WARN, ENGINE) << "rendezvous server: malformed request, closing connection";
        }
        drop(id, refused ? "wrong job secret" : "malformed request");
        return;
      }
      auto it = conns.find(id);  // a reply may have dropped the connection
      if (it == conns.end()) return;
      c = &it->second;
    }
    if (c->in_off > 0) {
      c->in.erase(0, c->in_off);
      c->in_off = 0;
    }
  }

  void sweepHandshakes() {
    if (server.admission().preauthCount() == 0) return;
    Deadline now = Clock::now();
    std::vector<uint64_t> late;
    for (auto& [id, c] : conns)
      if (!c.authed && c.handshake_by <= now) late.push_back(id);
    for (uint64_t id : late) drop(id, "no AUTH within MC_HANDSHAKE_TIMEOUT_MS");
  }

  void expireWaiters() {
    Deadline now = Clock::now();
    std::vector<std::pair<uint64_t, std::string>> expired;
    for (auto it = waiters.begin(); it != waiters.end();) {
      if (it->second.deadline <= now) {
        expired.emplace_back(it->second.conn, it->first);
        it = waiters.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [id, key] : expired) reply(id, Code::kTimeout, "key '" + key + "' not set in time");
  }

  void run() {
    std::vector<pollfd> pfds;
    std::vector<uint64_t> ids;
    while (!server.stopping()) {
      server.head(&pfds);
      ids.clear();
      for (auto& [id, c] : conns) {
        short ev = POLLIN;
        if (c.out_off < c.out.size()) ev |= POLLOUT;
        pfds.push_back({c.fd, ev, 0});
        ids.push_back(id);
      }
      int timeout = -1;
      for (auto& [k, w] : waiters) {
        int ms = std::min(sock::msUntil(w.deadline), 3600 * 1000) + 1;
        timeout = timeout < 0 ? ms : std::min(timeout, ms);
      }
      if (server.admission().preauthCount() > 0)
        timeout = timeout < 0 ? 100 : std::min(timeout, 100);
      if (server.paused()) {
        int ms = std::max(1, sock::msUntil(server.admission().pausedUntil()));
        timeout = timeout < 0 ? ms : std::min(timeout, ms);
      }
      int n = poll(pfds.data(), pfds.size(), timeout);
      if (n < 0 && errno != EINTR) {
        MC_LOG(ERROR, ENGINE) << "rendezvous server: poll: " << sock::errnoStr(errno);
        break;
      }
      if (server.stopping()) break;
      server.accept(pfds, [this](int fd, const std::string& src) {
        sock::setNoDelay(fd);
        // A client whose host vanished is closed (its waits and buffers freed) in seconds.
        sock::setLiveness(fd, params::getInt("MC_TCP_USER_TIMEOUT_MS"));
        const uint64_t id = next_conn++;
        Conn& c = conns[id];
        c.fd = fd;
        c.src = src;
        c.handshake_by = server.admission().handshakeDeadline(Clock::now());
        c.challenge = randomBytes(kNonceBytes);
        reply(id, Code::kOk, c.challenge);  // a fresh socket: written at once
      });
      for (size_t i = 0; i < ids.size(); ++i) {
        short re = pfds[i + tcp::PollServer::kHead].revents;
        if (re == 0 || conns.count(ids[i]) == 0) continue;
        if (re & POLLOUT) flush(ids[i]);
        if (conns.count(ids[i]) == 0) continue;
        if (re & (POLLIN | POLLHUP | POLLERR)) readable(ids[i]);
      }
      expireWaiters();
      sweepHandshakes();
    }
  }
};

TcpRendezvousServer::TcpRendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpRendezvousServer::~TcpRendezvousServer() = default;
uint16_t TcpRendezvousServer::port() const { return impl_->server.port(); }

Result<std::unique_ptr<TcpRendezvousServer>> TcpRendezvousServer::start(const std::string& host,
                                                                        uint16_t port,
                                                                        const std::string& secret) {
  MC_RETURN_IF_ERROR(checkSecret(secret, "rendezvous server"));
  auto impl = std::make_unique<Impl>();
  impl->secret = secret;
  impl->max_value = static_cast<uint64_t>(
      std::clamp<int64_t>(params::getInt("MC_RENDEZVOUS_MAX_VALUE_BYTES"), 1024, kMaxFrame - 8192));
  impl->max_total = static_cast<uint64_t>(
      std::max<int64_t>(params::getInt("MC_RENDEZVOUS_MAX_TOTAL_BYTES"), 1 << 20));
  MC_RETURN_IF_ERROR(impl->server.listen(host, port));
  Impl* p = impl.get();
  impl->server.start([p] { p->run(); });
  MC_LOG(INFO, ENGINE) << "rendezvous server listening on " << (host.empty() ? "*" : host) << ":"
                       << impl->server.port();
  return std::unique_ptr<TcpRendezvousServer>(new TcpRendezvousServer(std::move(impl)));
}

// ---------------------------------------------------------------- client

namespace {

std::string encodeRequest(uint8_t op, const std::string& key, const std::string& value,
                          uint64_t timeout_ms) {
  wire::Writer w;
  w.u8(op);
  w.str(key);
  w.str(value);
  w.u64(timeout_ms);
  return frame(w.data());
}

// What a server's reply may hold before it proved the job secret: the challenge, the proof or
// a short refusal (a stranger posing as the server must not make us allocate kMaxFrame).
constexpr uint32_t kMaxUnprovenReply = 1024;

// Reads one response of at most max_len bytes. A timeout or error in the middle of a frame
// leaves the stream unusable; *broken tells the caller to drop the connection.
Result<std::string> readReply(int fd, Deadline deadline, bool* broken,
                              uint32_t max_len = kMaxFrame) {
  *broken = true;
  uint32_t len = 0;
  MC_RETURN_IF_ERROR(sock::recvAll(fd, &len, 4, deadline));
  len = le32toh(len);
  if (len > max_len) return MC_STATUS(kProtocol, "rendezvous reply of " << len << " bytes");
  std::string body(len, '\0');
  MC_RETURN_IF_ERROR(sock::recvAll(fd, body.data(), len, deadline));
  wire::Reader r(body);
  uint8_t code = r.u8();
  std::string v = r.str(kMaxFrame);
  if (!r.done() || code > static_cast<uint8_t>(Code::kInternal))
    return MC_STATUS(kProtocol, "malformed rendezvous reply");
  *broken = false;
  if (code != 0) return Status(static_cast<Code>(code), "rendezvous: " + v);
  return v;
}

// One request/response exchange on fd (*broken as readReply's).
Result<std::string> exchange(int fd, uint8_t op, const std::string& key, const std::string& value,
                             uint64_t timeout_ms, Deadline deadline, bool* broken,
                             uint32_t max_reply = kMaxFrame) {
  *broken = true;
  std::string req = encodeRequest(op, key, value, timeout_ms);
  Status st = sock::sendAll(fd, req.data(), req.size(), deadline);
  if (!st.ok()) return st;
  return readReply(fd, deadline, broken, max_reply);
}

// The client's side of the handshake (the protocol comment at the top).
Status authenticate(int fd, const std::string& secret, Deadline deadline) {
  bool broken = false;
  MC_ASSIGN_OR_RETURN(std::string challenge,
                      readReply(fd, deadline, &broken, kMaxUnprovenReply));
  if (challenge.size() != kNonceBytes)
    return MC_STATUS(kProtocol, "not a rendezvous server (no challenge)");
  const std::string nonce = randomBytes(kNonceBytes);
  MC_ASSIGN_OR_RETURN(std::string proof,
                      exchange(fd, kAuth, "", nonce + secretProof(secret, kClientProof,
                                                                  challenge, nonce, ""),
                               0, deadline, &broken, kMaxUnprovenReply));
  if (!secretsEqual(proof, secretProof(secret, kServerProof, challenge, nonce, "")))
    return MC_STATUS(kPermissionDenied,
                     "the server did not prove that it holds the job secret (not this job's "
                     "rendezvous)");
  return Status::OK();
}

Status describe(Status st, const char* what, const std::string& key) {
  Code c = st.code() == Code::kTimeout || st.code() == Code::kNotFound ||
                   st.code() == Code::kInvalidArgument
               ? st.code()
               : Code::kUnavailable;
  return Status(c, std::string("rendezvous ") + what + " '" + key + "': " + st.message());
}

}  // namespace

// Connects and authenticates one connection.
static Result<int> openAuthed(const std::string& host, uint16_t port, const std::string& secret,
                       Deadline deadline, bool retry_refused) {
  MC_ASSIGN_OR_RETURN(int fd, sock::connectTo(host, port, deadline, retry_refused, 0));
  sock::setNoDelay(fd);
  // A long wait() on a server whose host vanished fails in seconds, not at its deadline.
  sock::setLiveness(fd, params::getInt("MC_TCP_USER_TIMEOUT_MS"));
  Status st = authenticate(fd, secret, deadline);
  if (!st.ok()) {
    close(fd);
    Code c = st.code() == Code::kPermissionDenied || st.code() == Code::kTimeout
                 ? st.code()
                 : Code::kUnavailable;
    return Status(c, "rendezvous " + host + ":" + std::to_string(port) + " refused AUTH: " +
                         st.message());
  }
  return fd;
}

Result<std::unique_ptr<TcpRendezvousClient>> TcpRendezvousClient::connect(const std::string& host,
                                                                          uint16_t port,
                                                                          const std::string& secret,
                                                                          Deadline deadline) {
  // A short secret's HMAC must not go out to whatever answers (it could be guessed offline).
  MC_RETURN_IF_ERROR(checkSecret(secret, "rendezvous client"));
  MC_ASSIGN_OR_RETURN(int fd, openAuthed(host, port, secret, deadline, true));
  return std::unique_ptr<TcpRendezvousClient>(new TcpRendezvousClient(fd, secret));
}

TcpRendezvousClient::~TcpRendezvousClient() {
  if (fd_ >= 0) close(fd_);
}

Result<std::string> TcpRendezvousClient::call(uint8_t op, const std::string& key,
                                              const std::string& value, Deadline deadline) {
  std::lock_guard<std::mutex> g(mu_);
  if (fd_ < 0) return MC_STATUS(kUnavailable, "rendezvous connection is broken");
  bool broken = false;
  Result<std::string> r = exchange(fd_, op, key, value, 0, deadline, &broken);
  if (broken) {
    close(fd_);
    fd_ = -1;
  }
  return r;
}

static Deadline callDeadline() { return deadlineInMs(params::getInt("MC_RENDEZVOUS_TIMEOUT_MS")); }

Status TcpRendezvousClient::set(const std::string& key, const std::string& value) {
  Result<std::string> r = call(kSet, key, value, callDeadline());
  return r.ok() ? Status::OK() : describe(r.status(), "set", key);
}

Result<std::string> TcpRendezvousClient::get(const std::string& key) {
  return get(key, callDeadline());
}

Result<std::string> TcpRendezvousClient::get(const std::string& key, Deadline deadline) {
  Result<std::string> r = call(kGet, key, "", deadline);
  if (!r.ok()) return describe(r.status(), "get", key);
  return r;
}

Result<int64_t> TcpRendezvousClient::add(const std::string& key, int64_t delta) {
  Result<std::string> r = call(kAdd, key, std::to_string(delta), callDeadline());
  if (!r.ok()) return describe(r.status(), "add", key);
  int64_t v = 0;
  if (!parseInt64(*r, &v)) return MC_STATUS(kProtocol, "rendezvous add: bad counter reply");
  return v;
}

Result<std::string> TcpRendezvousClient::wait(const std::string& key, Deadline deadline) {
  Result<std::string> got = get(key);
  if (got.ok() || got.status().code() != Code::kNotFound) return got;
  // Absent: wait on a connection of its own to the same server.
  sockaddr_storage sa{};
  socklen_t sl = sizeof(sa);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (fd_ < 0 || getpeername(fd_, reinterpret_cast<sockaddr*>(&sa), &sl) != 0)
      return MC_STATUS(kUnavailable, "rendezvous wait '" << key << "': connection is broken");
  }
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (sa.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  Result<int> fd = openAuthed(host, port, secret_, deadline, false);
  if (!fd.ok()) return describe(fd.status(), "wait", key);
  bool broken = false;
  uint64_t ms = static_cast<uint64_t>(sock::msUntil(deadline));
  Result<std::string> r = exchange(*fd, kWait, key, "", ms, deadline, &broken);
  close(*fd);
  if (!r.ok()) return describe(r.status(), "wait", key);
  return r;
}

}  // namespace mooncake::engine
