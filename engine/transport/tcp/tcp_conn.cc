// tcp transport, connection I/O: per-connection output queues written with writev, the
// input state machine (header -> payload straight into its destination; the target side of
// WRITE and READ is in tcp_target.cc), completion and failure of requests, and delivery into
// the local inbox.
// Contracts: tcp_transport.h; threading: the comment at the top of tcp_transport.cc.
#include <sys/epoll.h>
#include <sys/uio.h>

#include "engine/hmac.h"
#include "engine/log.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_core.h"
#include "engine/transport/tcp/tcp_socket.h"

namespace mooncake::engine::tcp {

// ---------------------------------------------------------------- connections

void Core::addConn(const std::shared_ptr<Conn>& c) {
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    conns_[c->id] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = c->id;
  if (epoll_ctl(ep_fd_, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
    MC_LOG(ERROR, TCP) << "epoll_ctl add: " << sock::errnoStr(errno);
  }
}

void Core::setArmed(Conn& c, bool armed) {
  if (c.out_armed == armed) return;
  c.out_armed = armed;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | (armed ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  ev.data.u64 = c.id;
  epoll_ctl(ep_fd_, EPOLL_CTL_MOD, c.fd, &ev);
}

// Queues a frame; writes it at once when nothing is queued before it, unless the progress
// thread sends it while it reads this connection (corked: written when the read ends). Other
// threads' frames never wait for a read. Never blocks. With `owned`, the header's length is
// set to its size; otherwise the caller set it (a READ_REQ's length is not its payload).
// False when the connection is closed.
bool Core::send(Conn& c, FrameHeader h, const char* data, size_t len, std::string owned,
                bool from_region) {
  std::lock_guard<std::mutex> g(c.out_mu);
  if (!queueLocked(c, h, data, len, std::move(owned), from_region)) return false;
  if (c.corked && std::this_thread::get_id() == loop_tid_.load()) return true;
  if (!c.out_armed) flushLocked(c);  // armed: EPOLLOUT writes it
  if (!c.outq.empty()) setArmed(c, true);
  return true;
}

bool Core::queueLocked(Conn& c, FrameHeader h, const char* data, size_t len, std::string owned,
                       bool from_region) {
  if (c.closed) return false;
  OutItem it;
  it.from_region = from_region && owned.empty() && len > 0;
  if (!owned.empty()) h.length = owned.size();
  encodeHeader(h, it.hdr);
  it.owned = std::move(owned);
  it.data = data;
  it.len = it.owned.empty() ? len : it.owned.size();
  if (h.type == FrameType::kWrite) ++c.writes_queued;  // counted where NOTIFY reads it
  c.outq.push_back(std::move(it));
  return true;
}

// Writes what is queued (several frames per sendmsg), unless already waiting for room
// (EPOLLOUT then writes it). Called by submitting threads, never while corked by themselves.
void Core::kick(Conn& c) {
  std::lock_guard<std::mutex> g(c.out_mu);
  if (c.closed || c.outq.empty() || c.out_armed) return;
  flushLocked(c);
  if (!c.outq.empty()) setArmed(c, true);
}

// Writes as much of the queue as the socket takes (writev, header and payload in place).
// A hard error shuts the socket down: the progress thread then sees it and fails the peer.
void Core::flushLocked(Conn& c) {
  while (!c.outq.empty() && !c.broken) {
    iovec iov[64];
    int n = 0;
    size_t total = 0;
    for (auto& it : c.outq) {
      if (n + 2 > 64) break;
      if (it.off < kHeaderBytes) iov[n++] = {it.hdr + it.off, kHeaderBytes - it.off};
      size_t poff = it.off > kHeaderBytes ? it.off - kHeaderBytes : 0;
      if (it.len > poff) iov[n++] = {const_cast<char*>(it.payload()) + poff, it.len - poff};
      total += kHeaderBytes + it.len - it.off;
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = sendmsg(c.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      MC_LOG(DEBUG, TCP) << "send on connection " << c.id << ": " << sock::errnoStr(errno);
      c.broken = true;
      c.send_errno = errno;
      shutdown(c.fd, SHUT_RDWR);
      break;
    }
    size_t left = static_cast<size_t>(w);
    while (left > 0) {
      OutItem& it = c.outq.front();
      size_t rem = kHeaderBytes + it.len - it.off;
      if (left < rem) {
        it.off += left;
        break;
      }
      left -= rem;
      c.outq.pop_front();
    }
    if (static_cast<size_t>(w) < total) break;  // the socket is full
  }
  if (c.outq.empty()) setArmed(c, false);
  // A denied connection's last frame (the denial) is out: the initiator reads it, then EOF.
  if (c.outq.empty() && c.denied && !c.broken) shutdown(c.fd, SHUT_WR);
}

// The raw close: no more output, out of epoll, fd closed. Idempotent.
void Core::dropConn(Conn& c) {
  {
    std::lock_guard<std::mutex> g(c.out_mu);
    if (c.closed) return;
    c.closed = true;
    c.outq.clear();
    epoll_ctl(ep_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
  }
  // Accepted connections are the progress thread's (or stop()'s after it ended), as is the
  // admission accounting.
  if (!c.active && admission_) admission_->closed(c.src_addr, c.authed);
  std::lock_guard<std::mutex> g(conns_mu_);
  conns_.erase(c.id);
}

void Core::closeConn(const std::shared_ptr<Conn>& c, const Status& why) {
  if (c->closed) return;
  dropConn(*c);
  if (c->active) {
    if (auto p = c->peer.lock()) {
      if (c->leaving)
        failPeer(*p, MC_STATUS(kPeerDead, "tcp peer " << p->label << " stopped its engine"), true,
                 true);
      else
        failPeer(*p, MC_STATUS(kPeerDead, "tcp peer " << p->label << ": " << why.message()),
                 true);
    }
    return;
  }
  MC_LOG(DEBUG, TCP) << "closed connection from " << (c->authed ? c->src_name : "?") << ": "
                     << why.message();
  if (c->authed && c->role == ConnRole::kControl) {
    links_.erase({c->src_engine, c->link});
    if (c->have_desc) control_links_.erase({c->src_engine, c->link});
  }
  if (!c->authed || c->role != ConnRole::kControl || !c->have_desc || !ctx_->on_peer_failure)
    return;
  if (c->leaving)
    ctx_->on_peer_failure(c->src_engine,
                          MC_STATUS(kPeerDead, "tcp peer " << c->src_name << " stopped its engine"),
                          true);
  else if (!c->bye)
    ctx_->on_peer_failure(
        c->src_engine,
        MC_STATUS(kPeerDead, "tcp peer " << c->src_name << " is gone: its control connection "
                                         << "to this engine ended (" << why.message() << ")"),
        false);
}

bool Core::protocolError(const std::shared_ptr<Conn>& c, const std::string& what) {
  MC_LOG(WARN, TCP) << "protocol error on connection " << c->id
                    << (c->authed ? " from " + c->src_name : std::string()) << ": " << what
                    << "; closing it";
  closeConn(c, MC_STATUS(kProtocol, "protocol error: " << what));
  return false;
}

// ---------------------------------------------------------------- input

void Core::onReadable(const std::shared_ptr<Conn>& c) {
  Conn& k = *c;
  if (k.denied) {  // only waiting for the initiator to close: discard what it still sends
    for (;;) {
      ssize_t r = recv(k.fd, scratch_.data(), scratch_.size(), MSG_DONTWAIT);
      if (r > 0) continue;
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return closeConn(c, MC_STATUS(kPermissionDenied, "denied peer closed"));
    }
  }
  // Frames this read makes us send (acks, answers) leave together when it ends, or before a
  // long payload is read: one sendmsg for many small frames instead of one each.
  auto uncork = [&k, this] {
    std::lock_guard<std::mutex> g(k.out_mu);
    if (!k.corked) return;
    k.corked = false;
    if (k.closed || k.outq.empty() || k.out_armed) return;
    flushLocked(k);
    if (!k.outq.empty()) setArmed(k, true);
  };
  {
    std::lock_guard<std::mutex> g(k.out_mu);
    k.corked = true;
  }
  struct Uncork {
    decltype(uncork)& f;
    ~Uncork() { f(); }
  } at_end{uncork};
  size_t budget = kReadBudget;
  while (!k.closed && budget > 0) {
    ssize_t r;
    if (k.in_payload && k.left >= kUncorkBytes) uncork();
    if (!k.in_payload) {
      r = recv(k.fd, k.hdr + k.hdr_got, kHeaderBytes - k.hdr_got, MSG_DONTWAIT);
    } else if (k.sink == Conn::Sink::kMemory && k.guarded) {
      const size_t want = std::min<uint64_t>(k.left, budget);
      if (!ctx_->registry->intoRegion(reinterpret_cast<uint64_t>(k.dst), want, &k.region,
                                      [&] { r = recv(k.fd, k.dst, want, MSG_DONTWAIT); })) {
        // Unregistered (or freed) while the WRITE arrived: the rest of it is discarded and
        // the WRITE refused; the connection goes on.
        MC_LOG(WARN, TCP) << "refused the rest of a WRITE at " << hexId(k.cur.addr) << " from "
                          << k.src_name << ": its region was unregistered meanwhile";
        k.sink = Conn::Sink::kDiscard;
        k.guarded = false;
        k.verdict = Code::kPermissionDenied;
        continue;
      }
    } else {
      char* to = k.sink == Conn::Sink::kMemory   ? k.dst
                 : k.sink == Conn::Sink::kBuffer ? &k.buf[k.buf.size() - k.left]
                                                 : scratch_.data();
      size_t want = k.sink == Conn::Sink::kDiscard ? std::min<uint64_t>(k.left, scratch_.size())
                                                   : std::min<uint64_t>(k.left, budget);
      r = recv(k.fd, to, want, MSG_DONTWAIT);
    }
    if (r == 0) {
      // A send that failed (ETIMEDOUT: unacknowledged past the user timeout) took the
      // socket's error and shut it down: say so, not "closed by the peer".
      int send_errno;
      {
        std::lock_guard<std::mutex> g(k.out_mu);
        send_errno = k.send_errno;
      }
      if (send_errno != 0)
        return closeConn(
            c, MC_STATUS(kPeerDead, "connection broken: " << sock::errnoStr(send_errno)));
      return closeConn(c, MC_STATUS(kPeerDead, "connection closed by the peer"));
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return closeConn(c, MC_STATUS(kPeerDead, "connection broken: " << sock::errnoStr(errno)));
    }
    size_t got = static_cast<size_t>(r);
    budget -= std::min(budget, got);
    if (!k.in_payload) {
      k.hdr_got += got;
      if (k.hdr_got < kHeaderBytes) continue;
      k.hdr_got = 0;
      k.cur = decodeHeader(k.hdr);
      if (!frameStart(c)) return;
    } else {
      k.left -= got;
      if (k.sink == Conn::Sink::kMemory) k.dst += got;
      if (k.left == 0) {
        k.in_payload = false;
        if (!frameEnd(c)) return;
      }
    }
  }
}

bool Core::expectPayload(const std::shared_ptr<Conn>& c, Conn::Sink sink, char* dst) {
  c->sink = sink;
  c->dst = dst;
  c->guarded = false;
  c->left = c->cur.length;
  if (sink == Conn::Sink::kBuffer)
    c->buf = ctx_->buffers ? ctx_->buffers->take(c->cur.length) : std::string(c->cur.length, '\0');
  if (c->left > 0) {
    c->in_payload = true;
    return true;
  }
  return frameEnd(c);
}

// A header arrived: validate it against the connection's direction and state, and decide
// where its payload goes. False when the connection was closed.
bool Core::frameStart(const std::shared_ptr<Conn>& c) {
  const FrameHeader& h = c->cur;
  if (h.magic != kFrameMagic) return protocolError(c, "bad frame magic " + hexId(h.magic));
  if (!c->active && !c->authed && h.type != FrameType::kHello)
    return protocolError(c, "frame before HELLO");
  if (!c->active && c->authed && c->role == ConnRole::kControl && !c->have_desc &&
      h.type != FrameType::kDesc)
    return protocolError(c, "frame before DESC");
  if (!c->active && c->authed && c->role == ConnRole::kQuery)
    return protocolError(c, "frame on a query connection");
  if (!c->active && c->authed && c->role != ConnRole::kControl &&
      (h.type == FrameType::kDesc || h.type == FrameType::kMsg ||
       h.type == FrameType::kNotify || h.type == FrameType::kXchg))
    return protocolError(c, "frame type " + std::to_string(int(h.type)) +
                                " on a data connection (control connection only)");
  bool passive_type = h.type == FrameType::kHello || h.type == FrameType::kDesc ||
                      h.type == FrameType::kWrite ||
                      h.type == FrameType::kReadReq || h.type == FrameType::kNotify ||
                      h.type == FrameType::kMsg || h.type == FrameType::kBye ||
                      h.type == FrameType::kXchg;
  bool active_type = h.type == FrameType::kWriteAck || h.type == FrameType::kReadResp ||
                     h.type == FrameType::kXchgResp ||
                     (h.type == FrameType::kBye && h.aux == kByeEngineStopping);
  if (!(c->active ? active_type : passive_type))
    return protocolError(c, "unexpected frame type " + std::to_string(int(h.type)));
  bool no_payload = h.type == FrameType::kWriteAck || h.type == FrameType::kReadReq ||
                    h.type == FrameType::kBye;
  if (no_payload && h.type != FrameType::kReadReq && h.length != 0)
    return protocolError(c, "payload on a frame that has none");
  if ((h.type == FrameType::kWrite || h.type == FrameType::kReadReq ||
       h.type == FrameType::kReadResp) &&
      h.length > kMaxDataBytes)
    return protocolError(c, "data frame of " + std::to_string(h.length) + " bytes");
  if (h.status > static_cast<uint16_t>(Code::kInternal))
    return protocolError(c, "bad status code " + std::to_string(h.status));
  switch (h.type) {
    case FrameType::kHello:
      if (c->authed) return protocolError(c, "second HELLO");
      if (h.length > kMaxHelloBytes) return protocolError(c, "oversized HELLO");
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kDesc:
      if (c->role != ConnRole::kControl || c->have_desc)
        return protocolError(c, "unexpected DESC");
      if (h.length > kMaxDescBytes) return protocolError(c, "oversized DESC");
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kMsg:
      if (h.length > kMaxMessageBytes) return protocolError(c, "oversized message");
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kNotify:
      if (c->role != ConnRole::kControl) return protocolError(c, "NOTIFY on a data connection");
      if (h.length > kMaxNotifyBytes || h.length % 8 != 0)
        return protocolError(c, "NOTIFY with " + std::to_string(h.length) + " watermark bytes");
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kXchg:
      if (c->role != ConnRole::kControl) return protocolError(c, "XCHG on a data connection");
      if (h.length > kMaxExchangeBytes) return protocolError(c, "oversized XCHG");
      if (h.aux >= static_cast<uint64_t>(kNumTransportKinds))
        return protocolError(c, "XCHG for transport " + std::to_string(h.aux));
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kXchgResp:
      if (c->role != ConnRole::kControl) return protocolError(c, "XCHG_RESP on a data connection");
      if (h.length > kMaxExchangeBytes) return protocolError(c, "oversized XCHG_RESP");
      return expectPayload(c, Conn::Sink::kBuffer, nullptr);
    case FrameType::kBye:
      c->bye = true;
      c->leaving = h.aux == kByeEngineStopping;
      return true;
    case FrameType::kWrite:
    case FrameType::kReadReq:
      return onRequest(c);
    case FrameType::kWriteAck:
    case FrameType::kReadResp: {
      auto p = c->peer.lock();
      if (!p) return protocolError(c, "response for a closed peer");
      char* dst = nullptr;
      bool discard = false;  // its caller gave up on it (fenceAbandoned): not into its buffer
      std::string err;  // protocolError() fails the peer, which takes p->mu: call it unlocked
      {
        std::lock_guard<std::mutex> g(p->mu);
        auto it = p->slices.find(h.req_id);
        OpCode want = h.type == FrameType::kWriteAck ? OpCode::kWrite : OpCode::kRead;
        if (it == p->slices.end() || it->second.op != want) {
          err = "response to unknown request " + std::to_string(h.req_id);
        } else if (h.type == FrameType::kReadResp && h.status == 0 && h.length != it->second.len) {
          err = "read response of " + std::to_string(h.length) + " bytes for a slice of " +
                std::to_string(it->second.len);
        } else if (h.type == FrameType::kReadResp && h.status != 0 && h.length != 0) {
          err = "failed read response with data";
        } else if (h.type == FrameType::kReadResp && it->second.ts->task->isAbandoned()) {
          discard = true;
          abandonSliceLocked(it->second);
        } else {
          dst = static_cast<char*>(it->second.ts->task->local) + it->second.offset;
        }
      }
      if (!err.empty()) return protocolError(c, err);
      if (h.type == FrameType::kWriteAck) return frameEnd(c);
      return expectPayload(c, discard ? Conn::Sink::kDiscard : Conn::Sink::kMemory, dst);
    }
    default:
      return protocolError(c, "unknown frame type");
  }
}

bool Core::sendHelloOk(Conn& c) {
  FrameHeader ok;
  ok.type = FrameType::kHelloOk;
  ok.aux = ctx_->engine_id;
  send(c, ok, nullptr, 0);
  return true;
}

// A frame's payload is complete.
bool Core::frameEnd(const std::shared_ptr<Conn>& c) {
  const FrameHeader& h = c->cur;
  switch (h.type) {
    case FrameType::kHello: {
      Hello hello;
      bool decoded = decodeHello(c->buf, &hello);
      c->buf.clear();
      if (!decoded) return protocolError(c, "malformed HELLO");
      if (c->challenge.empty()) return protocolError(c, "HELLO without a CHALLENGE");
      std::string challenge;
      challenge.swap(c->challenge);  // one answer per challenge
      c->src_name = "engine " + hexId(hello.engine_id) + " at " + c->src_addr;
      // Joins an open link only: the control connection that named it must be ours already.
      const bool orphan = hello.role == ConnRole::kData &&
                          control_links_.count({hello.engine_id, hello.link}) == 0;
      const bool proven =
          secretsEqual(hello.proof, secretProof(ctx_->secret, kInitiatorProof, challenge,
                                                hello.nonce, helloBound(hello)));
      if (!proven || orphan) {
        std::string reason = !proven ? "wrong job secret"
                                     : "data connection of no open control connection";
        MC_LOG(WARN, TCP) << "denied " << c->src_name << ": " << reason;
        FrameHeader d;
        d.type = FrameType::kHelloDenied;
        d.status = static_cast<uint16_t>(Code::kPermissionDenied);
        send(*c, d, nullptr, 0, reason);
        // Not closed at once: closing with unread input resets the connection, which can
        // destroy the denial in flight. Input is discarded from now on; the initiator closes
        // after reading the denial (or the handshake deadline does).
        c->denied = true;
        {
          std::lock_guard<std::mutex> g(c->out_mu);
          flushLocked(*c);  // now, corked or not (the read it came in ends here)
          if (c->outq.empty()) shutdown(c->fd, SHUT_WR);
        }
        return false;
      }
      c->authed = true;
      if (admission_) admission_->authenticated(c->src_addr);
      c->src_engine = hello.engine_id;
      c->role = hello.role;
      c->link = hello.link;
      c->index = hello.index;
      MC_LOG(DEBUG, TCP) << "accepted "
                         << (c->role == ConnRole::kControl ? "control"
                             : c->role == ConnRole::kData  ? "data"
                                                           : "query")
                         << " connection from " << c->src_name;
      FrameHeader pf;
      pf.type = FrameType::kHelloProof;
      pf.aux = ctx_->engine_id;
      send(*c, pf, nullptr, 0, targetProof(ctx_->secret, challenge, hello, ctx_->engine_id));
      if (c->role == ConnRole::kQuery) {
        // The initiator asked for our descriptor (tcp_query.h): answer it; it closes.
        FrameHeader d;
        d.type = FrameType::kDesc;
        d.aux = ctx_->engine_id;
        SegmentDesc self;
        if (ctx_->local_segment) {
          self = ctx_->local_segment();
        } else {
          self.engine_id = ctx_->engine_id;
          fill(&self);
        }
        send(*c, d, nullptr, 0, self.serialize());
      }
      return true;  // a control connection: HELLO_OK once DESC arrived
    }
    case FrameType::kDesc: {
      auto desc = SegmentDesc::parse(c->buf);
      c->buf.clear();
      if (!desc.ok() || desc->engine_id != c->src_engine)
        return protocolError(c, "DESC with a bad segment descriptor");
      c->src_name = labelOf(*desc);
      c->have_desc = true;
      control_links_.insert({c->src_engine, c->link});
      // Before HELLO_OK: once the initiator's openPeer returns, it may message us over
      // another transport, and our handler may call peerOf() on it at once.
      if (ctx_->on_peer_hello) ctx_->on_peer_hello(*desc);
      return sendHelloOk(*c);
    }
    case FrameType::kMsg: {
      std::string payload;
      payload.swap(c->buf);
      deliverMessage(c->src_engine, static_cast<uint32_t>(h.aux), std::move(payload));
      return true;
    }
    case FrameType::kWrite:
      return onWriteEnd(c);
    case FrameType::kNotify: {
      std::string wm;
      wm.swap(c->buf);
      onNotify(*c, wm, static_cast<uint32_t>(h.addr), h.aux);
      return true;
    }
    case FrameType::kXchg:
      onExchange(c);
      return true;
    case FrameType::kXchgResp: {
      auto p = c->peer.lock();
      if (!p) return protocolError(c, "response for a closed peer");
      std::shared_ptr<ExchangeWait> w;
      {
        std::lock_guard<std::mutex> g(p->mu);
        auto it = p->exchanges.find(h.req_id);
        if (it != p->exchanges.end()) {
          w = it->second;
          p->exchanges.erase(it);
        }
      }
      if (w == nullptr) return true;  // the waiter gave up (deadline)
      std::lock_guard<std::mutex> g(w->mu);
      w->done = true;
      if (h.status != 0)
        w->status = Status(static_cast<Code>(h.status), "tcp peer " + p->label + ": " + c->buf);
      else
        w->answer.swap(c->buf);
      c->buf.clear();
      w->cv.notify_all();
      return true;
    }
    case FrameType::kWriteAck:
    case FrameType::kReadResp: {
      auto p = c->peer.lock();
      if (!p) return protocolError(c, "response for a closed peer");
      if (!completeSlice(*p, h.req_id, static_cast<Code>(h.status)))
        return protocolError(c, "response to unknown request " + std::to_string(h.req_id));
      return !c->closed;
    }
    default:
      return true;
  }
}

// ---------------------------------------------------------------- completion and failure

// Progress thread (or stop() after it ended): completes one slice. False for an unknown id.
bool Core::completeSlice(PeerState& p, uint64_t req, Code code) {
  TaskState* fin = nullptr;
  {
    std::lock_guard<std::mutex> g(p.mu);
    auto it = p.slices.find(req);
    if (it == p.slices.end()) return false;
    Slice s = it->second;
    p.slices.erase(it);
    if (code != Code::kOk && s.ts->status.ok()) {
      const char* op = s.op == OpCode::kWrite ? "write to" : "read from";
      std::ostringstream os;
      os << "tcp peer " << p.label << " refused a " << op << " ["
         << hexId(s.ts->task->remote + s.offset) << ", +" << s.len << ")";
      if (code == Code::kPermissionDenied) os << ": not inside one of its registered regions";
      s.ts->status = Status(code, os.str());
    }
    if (--s.ts->remaining == 0) fin = s.ts;
  }
  if (fin != nullptr) {
    fin->task->done(std::move(fin->status));
    delete fin;
  }
  return true;
}

// Target side: a NOTIFY is delivered once every data connection of its link delivered the
// WRITE frames the initiator had queued there before it; notifications of a link keep their
// order (a held one holds back later ones).
void Core::onNotify(Conn& c, const std::string& watermarks, uint32_t channel, uint64_t tag) {
  LinkState::Held n;
  n.channel = channel;
  n.tag = tag;
  n.watermarks.resize(watermarks.size() / 8);
  if (!watermarks.empty()) std::memcpy(n.watermarks.data(), watermarks.data(), watermarks.size());
  auto it = links_.find({c.src_engine, c.link});
  if (it == links_.end()) {
    bool none = true;
    for (uint64_t w : n.watermarks) none = none && w == 0;
    if (none) return deliverNotify(c.src_engine, channel, tag);
    it = links_.emplace(std::make_pair(c.src_engine, c.link), LinkState()).first;
  }
  it->second.held.push_back(std::move(n));
  releaseHeld(it->second, c.src_engine);
}

void Core::releaseHeld(LinkState& l, uint64_t src) {
  while (!l.held.empty()) {
    const LinkState::Held& n = l.held.front();
    for (size_t i = 0; i < n.watermarks.size(); ++i)
      if (l.writes_done[i + 1] < n.watermarks[i]) return;
    deliverNotify(src, n.channel, n.tag);
    l.held.pop_front();
  }
}

// Target side: hands an exchange request to the engine; the answer goes back on the same
// connection whenever it comes (a connection closed by then drops it).
void Core::onExchange(const std::shared_ptr<Conn>& c) {
  const FrameHeader h = c->cur;
  std::string req;
  req.swap(c->buf);
  std::weak_ptr<Conn> weak = c;
  std::weak_ptr<Core> self = weak_from_this();
  auto reply = [weak, self, id = h.req_id](Result<std::string> r) {
    auto core = self.lock();
    auto conn = weak.lock();
    if (!core || !conn) return;
    FrameHeader resp;
    resp.type = FrameType::kXchgResp;
    resp.req_id = id;
    std::string body;
    if (r.ok()) {
      body = std::move(r).value();
    } else {
      resp.status = static_cast<uint16_t>(r.status().code());
      body = r.status().message().substr(0, kMaxReasonBytes);
    }
    if (body.size() > kMaxExchangeBytes) {
      resp.status = static_cast<uint16_t>(Code::kInternal);
      body = "exchange answer too large";
    }
    resp.length = body.size();
    if (body.empty())
      core->send(*conn, resp, nullptr, 0);
    else
      core->send(*conn, resp, nullptr, 0, std::move(body));
  };
  if (!ctx_->on_exchange) {
    reply(MC_STATUS(kNotSupported, "this engine serves no exchanges"));
    return;
  }
  ctx_->on_exchange(c->src_engine, static_cast<TransportKind>(h.aux), std::move(req),
                    std::move(reply));
}

// Progress thread (or stop() after it ended). Closes the peer's connections first (so no
// queued frame still points at a request's buffer), then fails what is in flight.
void Core::failPeer(PeerState& p, const Status& why, bool report, bool orderly) {
  bool first;
  Status final_why;
  {
    std::lock_guard<std::mutex> g(p.mu);
    if (p.cleaned) return;
    p.cleaned = true;
    first = !p.failed;
    if (!p.failed) {
      p.failed = true;
      p.why = why;
    }
    final_why = p.why;
  }
  for (auto& c : p.conns) dropConn(*c);
  std::vector<TaskState*> done;
  {
    std::lock_guard<std::mutex> g(p.mu);
    for (auto& [id, s] : p.slices) {
      if (s.ts->status.ok()) s.ts->status = final_why;
      if (--s.ts->remaining == 0) done.push_back(s.ts);
    }
    p.slices.clear();
    for (auto& [id, w] : p.exchanges) {
      std::lock_guard<std::mutex> wg(w->mu);
      w->done = true;
      w->status = final_why;
      w->cv.notify_all();
    }
    p.exchanges.clear();
  }
  if (first && report && (!orderly || !done.empty())) {
    MC_LOG(WARN, TCP) << final_why.toString() << " (" << done.size() << " requests failed)";
  }
  // The engine hears first, so that a waiter woken by a failed request already finds the
  // peer marked dead.
  if (first && report && ctx_->on_peer_failure)
    ctx_->on_peer_failure(p.engine_id, final_why, orderly);
  for (TaskState* ts : done) {
    ts->task->done(std::move(ts->status));
    delete ts;
  }
}

// ---------------------------------------------------------------- inbox delivery

void Core::deliverNotify(uint64_t src, uint32_t channel, uint64_t tag) {
  if (channel != 0 && ctx_->deliver_notify) return ctx_->deliver_notify(src, channel, tag);
  if (ctx_->inbox == nullptr) return;
  if (notify_backlog_.empty()) {
    Status st = ctx_->inbox->pushNotify(src, channel, tag, Clock::now());
    if (st.ok()) return;
    if (st.code() != Code::kResourceExhausted) {
      MC_LOG(ERROR, TCP) << "dropping notification from " << hexId(src) << ": " << st.toString();
      return;
    }
  }
  notify_backlog_.push_back(PendingNotify{src, channel, tag});
}

// Single-fragment messages never wait (they queue here when the inbox is full); a larger one
// is pushed fragment by fragment while the engine's dispatcher drains them.
Status Core::pushMessage(uint64_t src, uint32_t channel, const std::string& payload) {
  Deadline d =
      payload.size() <= Inbox::kFragmentBytes ? Clock::now() : deadlineInMs(push_timeout_ms_);
  return ctx_->inbox->pushMessage(src, channel, payload, d);
}

void Core::deliverMessage(uint64_t src, uint32_t channel, std::string payload) {
  if (ctx_->deliver_message) {
    ctx_->deliver_message(src, channel, std::move(payload));
    return;
  }
  if (ctx_->inbox == nullptr) return;
  if (msg_backlog_.empty()) {
    Status st = pushMessage(src, channel, payload);
    if (st.ok()) return;
    if (st.code() != Code::kResourceExhausted || payload.size() > Inbox::kFragmentBytes) {
      MC_LOG(ERROR, TCP) << "dropping message from " << hexId(src) << ": " << st.toString();
      return;
    }
  }
  msg_backlog_.push_back(PendingMsg{src, channel, std::move(payload)});
}

void Core::retryBacklog() {
  while (!notify_backlog_.empty()) {
    PendingNotify n = notify_backlog_.front();
    Status st = ctx_->inbox->pushNotify(n.src, n.channel, n.tag, Clock::now());
    if (!st.ok() && st.code() == Code::kResourceExhausted) break;
    if (!st.ok()) {
      MC_LOG(ERROR, TCP) << "dropping notification: " << st.toString();
    }
    notify_backlog_.pop_front();
  }
  while (!msg_backlog_.empty()) {
    PendingMsg& m = msg_backlog_.front();
    Status st = pushMessage(m.src, m.channel, m.payload);
    if (!st.ok() && st.code() == Code::kResourceExhausted &&
        m.payload.size() <= Inbox::kFragmentBytes)
      break;
    if (!st.ok()) {
      MC_LOG(ERROR, TCP) << "dropping message: " << st.toString();
    }
    msg_backlog_.pop_front();
  }
}

}  // namespace mooncake::engine::tcp
