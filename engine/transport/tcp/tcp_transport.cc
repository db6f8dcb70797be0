// tcp transport: one epoll progress thread, a control and several data connections per peer,
// sliced zero-copy transfers, deferred notifications. The wire format, safety, ordering and
// failure contracts are stated in tcp_transport.h.
//
// Threading model. Everything that completes a request in flight (acks, responses, failure)
// runs on the progress thread, or in stop() after it was joined: that thread is also the only
// one that receives into user memory, so a request is never completed while bytes may still
// land in its buffer. Other threads (submit, notify, fail, peer destruction) append to
// per-connection output queues under the connection's mutex, or post work to the loop.
// A connection's output queue is cleared under that mutex before any of its requests is
// failed, so no queued frame points at a buffer its owner got back.
#include "engine/transport/tcp/tcp_transport.h"

#include <endian.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <future>
#include <random>
#include <sstream>

#include "engine/log.h"
#include "engine/params.h"
#include "engine/hmac.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_core.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "engine/wire.h"

namespace mooncake::engine {

namespace tcp {

void encodeHeader(const FrameHeader& h, uint8_t out[kHeaderBytes]) {
  uint32_t magic = htole32(h.magic);
  uint16_t status = htole16(h.status);
  uint64_t q[4] = {htole64(h.req_id), htole64(h.addr), htole64(h.length), htole64(h.aux)};
  std::memcpy(out, &magic, 4);
  out[4] = static_cast<uint8_t>(h.type);
  out[5] = h.flags;
  std::memcpy(out + 6, &status, 2);
  std::memcpy(out + 8, q, 32);
}

FrameHeader decodeHeader(const uint8_t in[kHeaderBytes]) {
  FrameHeader h;
  uint32_t magic;
  uint16_t status;
  uint64_t q[4];
  std::memcpy(&magic, in, 4);
  std::memcpy(&status, in + 6, 2);
  std::memcpy(q, in + 8, 32);
  h.magic = le32toh(magic);
  h.type = static_cast<FrameType>(in[4]);
  h.flags = in[5];
  h.status = le16toh(status);
  h.req_id = le64toh(q[0]);
  h.addr = le64toh(q[1]);
  h.length = le64toh(q[2]);
  h.aux = le64toh(q[3]);
  return h;
}

// ---------------------------------------------------------------- set-up and shutdown

namespace {

uint64_t randomLinkId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd()) + counter.fetch_add(1);
}

std::string advertiseHost(const std::string& bind) {
  std::string a = params::getString("MC_TCP_ADVERTISE_HOST");
  if (!a.empty()) return a;
  if (!sock::isWildcard(bind)) return bind;
  return sock::firstNonLoopbackIPv4();
}

}  // namespace

Status Core::start(EngineContext* ctx) {
  ctx_ = ctx;
  slice_bytes_ = static_cast<uint64_t>(
      std::clamp<int64_t>(params::getInt("MC_TCP_SLICE_BYTES"), 4096, 256ll << 20));
  push_timeout_ms_ = std::max<int64_t>(1, params::getInt("MC_CONNECT_TIMEOUT_MS"));
  user_timeout_ms_ = std::max<int64_t>(0, params::getInt("MC_TCP_USER_TIMEOUT_MS"));
  // The engine resolved where to listen (EngineOptions.host, MC_TCP_BIND_HOST, or the
  // interface toward the job's rendezvous); never every interface unless asked to.
  std::string bind = ctx->tcp_host.empty() ? std::string("127.0.0.1") : ctx->tcp_host;
  int64_t port = params::getInt("MC_TCP_PORT");
  if (port < 0 || port > 65535) return MC_STATUS(kInvalidArgument, "MC_TCP_PORT=" << port);
  MC_ASSIGN_OR_RETURN(listen_fd_,
                      sock::listenOn(bind, static_cast<uint16_t>(port), kSocketBufferBytes));
  port_ = sock::localPort(listen_fd_);
  host_ = advertiseHost(bind);
  ep_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (ep_fd_ < 0 || wake_fd_ < 0) return MC_STATUS(kIo, "epoll/eventfd: " << sock::errnoStr(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeId;
  epoll_ctl(ep_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  ev.data.u64 = kListenId;
  epoll_ctl(ep_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  admission_ = std::make_unique<Admission>("engine tcp listener");
  running_ = true;
  thread_ = std::thread([this] { loop(); });
  MC_LOG(INFO, TCP) << "tcp transport listening on " << bind << ":" << port_ << ", advertised as "
                    << host_ << ":" << port_ << ", " << data_conns_ << " data connections/peer";
  return Status::OK();
}

void Core::sayGoodbye() {
  std::vector<std::shared_ptr<PeerState>> peers;
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    for (auto& w : peers_)
      if (auto p = w.lock()) peers.push_back(p);
    for (auto& [id, c] : conns_)
      if (!c->active && c->authed) conns.push_back(c);  // peers' connections to this engine
  }
  for (auto& p : peers) {
    std::lock_guard<std::mutex> g(p->mu);
    if (!p->failed) conns.insert(conns.end(), p->conns.begin(), p->conns.end());
  }
  FrameHeader h;
  h.type = FrameType::kBye;
  h.aux = kByeEngineStopping;
  // Idle connections (the usual case at the end of a job) write it at once; a frame queued
  // behind others may not leave before the sockets close, and that peer logs a failure.
  for (auto& c : conns) send(*c, h, nullptr, 0);
}

void Core::stop() {
  if (thread_.joinable()) {
    runOnLoop([this] { sayGoodbye(); }, true);
    stopping_ = true;
    wake();
    thread_.join();
    std::vector<std::function<void()>> rest;
    {
      std::lock_guard<std::mutex> g(cmd_mu_);
      running_ = false;
      rest.swap(cmds_);
    }
    for (auto& f : rest) f();
    std::vector<std::shared_ptr<PeerState>> peers;
    std::vector<std::shared_ptr<Conn>> conns;
    {
      std::lock_guard<std::mutex> g(conns_mu_);
      for (auto& w : peers_)
        if (auto p = w.lock()) peers.push_back(p);
      for (auto& [id, c] : conns_) conns.push_back(c);
    }
    for (auto& p : peers) failPeer(*p, MC_STATUS(kCancelled, "tcp transport stopped"), false);
    for (auto& c : conns) dropConn(*c);
    if (!notify_backlog_.empty() || !msg_backlog_.empty()) {
      MC_LOG(WARN, TCP) << "tcp transport stopped with " << notify_backlog_.size()
                        << " notifications and " << msg_backlog_.size()
                        << " messages not delivered (inbox full)";
    }
  }
  for (int* fd : {&listen_fd_, &wake_fd_, &ep_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void Core::runOnLoop(std::function<void()> fn, bool wait) {
  if (std::this_thread::get_id() == loop_tid_) return fn();
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> fut = done->get_future();
  bool posted = false;
  {
    std::lock_guard<std::mutex> g(cmd_mu_);
    if (running_) {
      cmds_.push_back([done, fn = std::move(fn)] {
        fn();
        done->set_value();
      });
      posted = true;
    }
  }
  if (!posted) return fn();  // the loop is gone: nothing can race with fn
  wake();
  if (wait) fut.wait();
}

// ---------------------------------------------------------------- the loop

// Accepts what the listener has, within the admission limits; out of descriptors, stops
// polling the listener until the pause ends (no busy loop on a listener that stays readable).
void Core::acceptNew() {
  bool ok = admission_->acceptAll(listen_fd_, [this](int fd, const std::string& src) {
    sock::setNoDelay(fd);
    sock::setLiveness(fd, user_timeout_ms_);
    auto c = std::make_shared<Conn>();
    c->id = next_conn_++;
    c->fd = fd;
    c->src_addr = src;
    c->handshake_by = admission_->handshakeDeadline(Clock::now());
    c->challenge = randomBytes(kNonceBytes);
    addConn(c);
    FrameHeader h;
    h.type = FrameType::kChallenge;
    send(*c, h, nullptr, 0, c->challenge);  // a fresh socket: written at once
  });
  if (!ok && !listen_paused_) {
    listen_paused_ = true;
    epoll_event ev{};
    ev.events = 0;
    ev.data.u64 = kListenId;
    epoll_ctl(ep_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  }
}

// Closes the connections that did not authenticate in time (MC_HANDSHAKE_TIMEOUT_MS).
void Core::sweepHandshakes() {
  if (admission_->preauthCount() == 0) return;
  Deadline now = Clock::now();
  std::vector<std::shared_ptr<Conn>> late;
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    for (auto& [id, c] : conns_)
      if (!c->active && !c->authed && c->handshake_by <= now) late.push_back(c);
  }
  for (auto& c : late) {
    MC_LOG(INFO, TCP) << "closing connection " << c->id << " from " << c->src_addr
                      << ": no HELLO within " << admission_->handshakeMs() << " ms";
    closeConn(c, MC_STATUS(kTimeout, "handshake deadline"));
  }
}

int Core::loopTimeoutMs() const {
  int t = -1;
  auto least = [&t](int ms) { t = t < 0 ? ms : std::min(t, ms); };
  if (!notify_backlog_.empty() || !msg_backlog_.empty()) least(1);
  if (admission_->preauthCount() > 0) least(100);
  if (listen_paused_) least(std::max(1, sock::msUntil(admission_->pausedUntil())));
  return t;
}

void Core::loop() {
  loop_tid_ = std::this_thread::get_id();
  epoll_event evs[64];
  while (!stopping_.load(std::memory_order_acquire)) {
    int timeout = loopTimeoutMs();
    int n = epoll_wait(ep_fd_, evs, 64, timeout);
    if (n < 0 && errno != EINTR) {
      MC_LOG(ERROR, TCP) << "epoll_wait: " << sock::errnoStr(errno);
      break;
    }
    for (int i = 0; i < n; ++i) {
      uint64_t id = evs[i].data.u64;
      if (id == kWakeId) {
        uint64_t v;
        ssize_t r = read(wake_fd_, &v, sizeof(v));
        (void)r;
        continue;
      }
      if (id == kListenId) {
        acceptNew();
        continue;
      }
      std::shared_ptr<Conn> c;
      {
        std::lock_guard<std::mutex> g(conns_mu_);
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;  // closed earlier in this batch
        c = it->second;
      }
      if (evs[i].events & EPOLLOUT) {
        std::lock_guard<std::mutex> g(c->out_mu);
        if (!c->closed) flushLocked(*c);
      }
      if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) onReadable(c);
    }
    std::vector<std::function<void()>> cmds;
    {
      std::lock_guard<std::mutex> g(cmd_mu_);
      cmds.swap(cmds_);
    }
    for (auto& f : cmds) f();
    retryBacklog();
    sweepHandshakes();
    if (listen_paused_ && Clock::now() >= admission_->pausedUntil()) {
      listen_paused_ = false;
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kListenId;
      epoll_ctl(ep_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
    }
  }
  // Stopped, or a fatal epoll error: from now on commands run on their caller's thread
  // (runOnLoop checks running_), so no waiter is left with a command nobody will run.
  std::vector<std::function<void()>> rest;
  {
    std::lock_guard<std::mutex> g(cmd_mu_);
    running_ = false;
    rest.swap(cmds_);
  }
  for (auto& f : rest) f();
}
// ---------------------------------------------------------------- initiator side

// Opens one connection and runs its handshake (blocking with the deadline, before the
// connection is handed to the progress thread).
// A listener at its admission limits closes new connections before reading them (see
// tcp_admission.h); that is a "try again", so the handshake is retried until the deadline.
// A peer that is gone refuses the connection instead, which fails at once.
Result<int> Core::openConn(const SegmentDesc& remote, const std::string& label,
                           const Hello& hello, const std::string& desc, Deadline deadline) {
  int backoff_ms = 5;
  for (;;) {
    bool dropped = false;
    Result<int> fd = openConnOnce(remote, label, hello, desc, deadline, &dropped);
    if (fd.ok() || !dropped || sock::msUntil(deadline) <= backoff_ms) return fd;
    MC_LOG(DEBUG, TCP) << "handshake with " << label << " closed unanswered; retrying";
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(backoff_ms * 2, 200);
  }
}

Result<int> Core::openConnOnce(const SegmentDesc& remote, const std::string& label,
                               const Hello& hello, const std::string& desc,
                               Deadline deadline, bool* dropped) {
  Result<int> fd =
      sock::connectTo(remote.tcp_host, remote.tcp_port, deadline, false, kSocketBufferBytes);
  if (!fd.ok())
    return Status(fd.status().code(), "tcp peer " + label + ": " + fd.status().message());
  sock::setNoDelay(*fd);
  // Every connection of a peer, control and data: a WRITE or a message in flight when the
  // peer's host vanishes fails the peer after the user timeout, not after ~15 minutes.
  sock::setLiveness(*fd, user_timeout_ms_);
  auto fail = [&](Status st) {
    ::close(*fd);
    Code code = st.code() == Code::kTimeout || st.code() == Code::kPermissionDenied
                    ? st.code()
                    : Code::kUnavailable;
    return Status(code, "tcp handshake with " + label + ": " + st.message());
  };
  Result<FrameHeader> answer = helloExchange(*fd, hello, ctx_->secret, desc, remote.engine_id,
                                             nullptr, deadline, dropped);
  if (!answer.ok()) return fail(answer.status());
  const FrameHeader& r = *answer;
  const FrameType last = hello.role == ConnRole::kData ? FrameType::kHelloProof
                                                       : FrameType::kHelloOk;
  if (r.type != last || (last == FrameType::kHelloOk && r.length != 0))
    return fail(MC_STATUS(kProtocol, "unexpected answer type " << int(r.type)));
  return fd;
}

Result<std::shared_ptr<PeerState>> Core::connect(const SegmentDesc& remote, Deadline deadline,
                                                 bool data) {
  std::string label = labelOf(remote);
  if (!remote.offers(TransportKind::kTcp) || remote.tcp_host.empty() || remote.tcp_port == 0)
    return MC_STATUS(kUnavailable, "peer " << label << " offers no tcp endpoint");
  {
    std::lock_guard<std::mutex> g(cmd_mu_);
    if (!running_) return MC_STATUS(kUnavailable, "tcp transport is not running");
  }
  Hello hello;
  hello.engine_id = ctx_->engine_id;
  hello.link = randomLinkId();
  SegmentDesc self;
  if (ctx_->local_segment) {
    self = ctx_->local_segment();
  } else {
    self.engine_id = ctx_->engine_id;
    fill(&self);
  }
  const std::string desc = self.serialize();
  int n = 1 + (data ? data_conns_ : 0);
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    hello.role = i == 0 ? ConnRole::kControl : ConnRole::kData;
    hello.index = static_cast<uint32_t>(i);
    Result<int> fd =
        openConn(remote, label, hello, i == 0 ? desc : std::string(), deadline);
    if (!fd.ok()) {
      // Say goodbye on the ones already open so the target reports no failure of ours.
      uint8_t bye[kHeaderBytes];
      FrameHeader h;
      h.type = FrameType::kBye;
      encodeHeader(h, bye);
      for (int f : fds) {
        ssize_t w = ::send(f, bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
        ::close(f);
      }
      return fd.status();
    }
    fds.push_back(*fd);
  }
  auto p = std::make_shared<PeerState>();
  p->core = shared_from_this();
  p->label = label;
  p->engine_id = remote.engine_id;
  p->link = hello.link;
  p->remote = remote;
  for (int i = 0; i < n; ++i) {
    auto c = std::make_shared<Conn>();
    c->id = next_conn_++;
    c->fd = fds[i];
    c->active = true;
    c->authed = true;
    c->link = hello.link;
    c->index = static_cast<uint32_t>(i);
    c->role = i == 0 ? ConnRole::kControl : ConnRole::kData;
    c->peer = p;
    p->conns.push_back(c);
  }
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    peers_.erase(std::remove_if(peers_.begin(), peers_.end(),
                                [](const std::weak_ptr<PeerState>& w) { return w.expired(); }),
                 peers_.end());
    peers_.push_back(p);
  }
  for (auto& c : p->conns) addConn(c);
  MC_LOG(DEBUG, TCP) << "connected to " << label << " with " << n << " connection(s)";
  return p;
}

void Core::submit(PeerState& p, Task* t) {
  struct Post {
    Conn* conn;
    FrameHeader h;
    const char* data;
  };
  std::vector<Post> posts;
  Status st;
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.failed) {
      st = p.why;
    } else if (t->length > 0) {
      // Each frame is checked whole by the target. A request the peer's descriptor does not
      // show inside one region (stale descriptor, or out of range) goes as one frame, so that
      // the target refuses or accepts all of it, never a part.
      uint64_t slice = slice_bytes_;
      if (t->length > slice && p.remote.findRegion(t->remote, t->length) == nullptr)
        slice = kMaxDataBytes;
      // Such a request longer than one frame would go as several, which the target could
      // accept in part: refused whole here, before any byte moves.
      if (slice == kMaxDataBytes && t->length > kMaxDataBytes) {
        std::ostringstream os;
        os << "tcp peer " << p.label << " refused a "
           << (t->op == OpCode::kWrite ? "write to" : "read from") << " [" << hexId(t->remote)
           << ", +" << t->length << "): not inside one region of its descriptor, and longer "
           << "than one frame (" << kMaxDataBytes << " bytes)";
        st = Status(Code::kPermissionDenied, os.str());
      } else {
        uint64_t n = t->length / slice + (t->length % slice != 0);  // (no overflow)
        auto* ts = new TaskState{t, n, Status::OK()};
        size_t ndata = p.conns.size() - 1;
        posts.reserve(n);
        for (uint64_t i = 0; i < n; ++i) {
          uint64_t off = i * slice;
          uint64_t len = std::min(slice, t->length - off);
          uint64_t req = p.next_req++;
          p.slices.emplace(req, Slice{ts, t->op, off, len});
          Post post{ndata == 0 ? p.conns[0].get() : p.conns[1 + p.rr++ % ndata].get(), {},
                    nullptr};
          post.h.type = t->op == OpCode::kWrite ? FrameType::kWrite : FrameType::kReadReq;
          post.h.req_id = req;
          post.h.addr = t->remote + off;
          post.h.length = len;
          if (t->op == OpCode::kWrite) post.data = static_cast<const char*>(t->local) + off;
          posts.push_back(post);
        }
      }
    }
  }
  if (!st.ok() || posts.empty()) return t->done(std::move(st));
  // No lock held: acks may complete slices (and the task) while later ones are still posted;
  // everything needed here was copied. A closed connection drops the frame: the failure
  // path completes the slice. Frames are queued per connection and then written together
  // (several per sendmsg).
  Conn* last = nullptr;
  std::unique_lock<std::mutex> g;
  std::vector<Conn*> touched;
  for (const Post& post : posts) {
    if (post.conn != last) {
      if (g.owns_lock()) g.unlock();
      g = std::unique_lock<std::mutex>(post.conn->out_mu);
      last = post.conn;
      if (std::find(touched.begin(), touched.end(), last) == touched.end()) touched.push_back(last);
    }
    queueLocked(*post.conn, post.h, post.data, post.data != nullptr ? post.h.length : 0, {});
  }
  if (g.owns_lock()) g.unlock();
  for (Conn* c : touched) kick(*c);
}

// No waiting for acknowledgements: the NOTIFY names how many WRITE frames each data
// connection carried before it, and the target holds it until it received them all. Writes
// submitted before this call have all been queued (submit() queues before it returns).
Status Core::notify(PeerState& p, uint32_t channel, uint64_t tag) {
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.failed) return p.why;
  }
  std::string wm;
  wm.reserve(8 * (p.conns.size() - 1));
  for (size_t i = 1; i < p.conns.size(); ++i) {
    uint64_t n;
    {
      std::lock_guard<std::mutex> g(p.conns[i]->out_mu);
      n = p.conns[i]->writes_queued;
    }
    wm.append(reinterpret_cast<const char*>(&n), 8);  // little-endian hosts only (x86, arm)
  }
  FrameHeader h;
  h.type = FrameType::kNotify;
  h.addr = channel;
  h.aux = tag;
  h.length = wm.size();
  bool sent = wm.empty() ? send(*p.conns[0], h, nullptr, 0) : send(*p.conns[0], h, nullptr, 0, std::move(wm));
  if (sent) return Status::OK();
  std::lock_guard<std::mutex> g(p.mu);
  return p.failed ? p.why : MC_STATUS(kPeerDead, "tcp peer " << p.label << " is closed");
}

Result<std::string> Core::exchange(PeerState& p, TransportKind kind, std::string_view request,
                                   Deadline deadline) {
  if (request.size() > kMaxExchangeBytes)
    return MC_STATUS(kInvalidArgument, "exchange request of " << request.size() << " bytes");
  auto w = std::make_shared<ExchangeWait>();
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.failed) return p.why;
    id = p.next_xchg++;
    p.exchanges[id] = w;
  }
  FrameHeader h;
  h.type = FrameType::kXchg;
  h.req_id = id;
  h.aux = static_cast<uint64_t>(kind);
  h.length = request.size();
  bool sent = request.empty() ? send(*p.conns[0], h, nullptr, 0)
                              : send(*p.conns[0], h, nullptr, 0, std::string(request));
  if (!sent) {
    std::lock_guard<std::mutex> g(p.mu);
    p.exchanges.erase(id);
    return p.failed ? p.why : MC_STATUS(kPeerDead, "tcp peer " << p.label << " is closed");
  }
  std::unique_lock<std::mutex> g(w->mu);
  if (!w->cv.wait_until(g, deadline, [&] { return w->done; })) {
    g.unlock();
    std::lock_guard<std::mutex> pg(p.mu);
    p.exchanges.erase(id);
    return MC_STATUS(kTimeout, "no answer from tcp peer " << p.label << " to a "
                                                          << transportName(kind)
                                                          << " exchange before the deadline");
  }
  if (!w->status.ok()) return w->status;
  return std::move(w->answer);
}

Status Core::sendMessage(PeerState& p, uint32_t channel, std::string_view payload) {
  return sendMessage(p, channel, std::string(payload));
}

Status Core::sendMessage(PeerState& p, uint32_t channel, std::string&& payload) {
  if (payload.size() > kMaxMessageBytes)
    return MC_STATUS(kInvalidArgument,
                     "message of " << payload.size() << " bytes exceeds " << kMaxMessageBytes);
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.failed) return p.why;
  }
  FrameHeader h;
  h.type = FrameType::kMsg;
  h.aux = channel;
  // An empty message has no owned copy: len 0 with no data pointer is what it needs.
  if (send(*p.conns[0], h, nullptr, 0, std::move(payload))) return Status::OK();
  std::lock_guard<std::mutex> g(p.mu);
  return p.failed ? p.why : MC_STATUS(kPeerDead, "tcp peer " << p.label << " is closed");
}

void Core::fail(const std::shared_ptr<PeerState>& p, const Status& why) {
  {
    std::lock_guard<std::mutex> g(p->mu);
    if (p->failed) return;
    p->failed = true;
    p->why = why;
  }
  runOnLoop([this, p, why] { failPeer(*p, why, false); }, false);
}

void Core::close(const std::shared_ptr<PeerState>& p) {
  bool graceful;
  {
    std::lock_guard<std::mutex> g(p->mu);
    graceful = !p->failed;
  }
  if (graceful) {
    FrameHeader h;
    h.type = FrameType::kBye;
    send(*p->conns[0], h, nullptr, 0);
    std::lock_guard<std::mutex> g(p->mu);
    if (!p->failed) {
      p->failed = true;
      p->why = MC_STATUS(kCancelled, "tcp peer " << p->label << " was closed");
    }
  }
  runOnLoop([this, p] { failPeer(*p, MC_STATUS(kCancelled, "tcp peer closed"), false); }, true);
}

}  // namespace tcp

namespace {

using tcp::Core;
using tcp::PeerState;

// ---------------------------------------------------------------- the interface

class TcpControlLink : public ControlLink {
 public:
  explicit TcpControlLink(std::shared_ptr<PeerState> st) : st_(std::move(st)) {}
  Result<std::string> exchange(TransportKind kind, std::string_view request,
                               Deadline deadline) override {
    return st_->core->exchange(*st_, kind, request, deadline);
  }

 private:
  std::shared_ptr<PeerState> st_;
};

class TcpPeer : public TransportPeer {
 public:
  explicit TcpPeer(std::shared_ptr<PeerState> st) : st_(std::move(st)) {}
  ~TcpPeer() override { st_->core->close(st_); }
  void submit(Task* task) override { st_->core->submit(*st_, task); }
  Status notify(uint32_t channel, uint64_t tag) override {
    return st_->core->notify(*st_, channel, tag);
  }
  std::shared_ptr<ControlLink> controlLink() override {
    return std::make_shared<TcpControlLink>(st_);
  }
  using TransportPeer::sendMessage;  // the deadline form: tcp queues, it never blocks
  Status sendMessage(uint32_t channel, std::string_view payload) override {
    return st_->core->sendMessage(*st_, channel, payload);
  }
  Status sendOwnedMessage(uint32_t channel, std::string&& payload) override {
    return st_->core->sendMessage(*st_, channel, std::move(payload));
  }
  Status updateRemote(const SegmentDesc& remote) override {
    std::lock_guard<std::mutex> g(st_->mu);
    st_->remote = remote;  // informational: the target checks every access itself
    return Status::OK();
  }
  void fail(const Status& why) override { st_->core->fail(st_, why); }
  void fenceAbandoned() override { st_->core->fenceAbandoned(st_); }
  Status health() override {
    std::lock_guard<std::mutex> g(st_->mu);
    if (!st_->failed) return Status::OK();
    return st_->why.code() == Code::kPeerDead
               ? st_->why
               : MC_STATUS(kPeerDead, "tcp peer " << st_->label << " lost: " << st_->why.message());
  }

 private:
  std::shared_ptr<PeerState> st_;
};

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(int data_conns) : core_(std::make_shared<Core>(data_conns)) {}
  ~TcpTransport() override { core_->stop(); }
  TransportKind kind() const override { return TransportKind::kTcp; }
  Status start(EngineContext* ctx) override { return core_->start(ctx); }
  void fillLocalSegment(SegmentDesc* desc) override { core_->fill(desc); }
  void unregisterRegion(const Region& region) override {
    if (region.kind == MemoryKind::kHost) core_->regionRemoved(region);
  }
  bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const override {
    return remote.offers(TransportKind::kTcp) && !remote.tcp_host.empty() && remote.tcp_port != 0;
  }
  Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote, Deadline deadline,
                                                 bool data,
                                                 std::shared_ptr<ControlLink> control) override {
    (void)control;  // tcp is the control link
    MC_ASSIGN_OR_RETURN(auto st, core_->connect(remote, deadline, data));
    return std::unique_ptr<TransportPeer>(new TcpPeer(std::move(st)));
  }
  void stop() override { core_->stop(); }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace

std::unique_ptr<Transport> makeTcpTransport(const TransportOptions& options) {
  return std::make_unique<TcpTransport>(std::min(options.tcp_data_conns, tcp::kMaxDataConns));
}

}  // namespace mooncake::engine
