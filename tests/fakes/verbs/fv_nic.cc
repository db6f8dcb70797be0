// The emulated NIC: one thread per open context moves the packets of its QPs through the
// shared-memory rings, as requester (transmits posted work requests in chunks, completes
// them in order when the responder acknowledges) and as responder (checks every request's
// rkey, access rights and bounds against its own MRs before it touches memory, consumes
// posted receives for SEND and WRITE_WITH_IMM, answers RNR when there is none).
//
// What a NIC enforces, enforced here: a request outside an MR, with a wrong rkey, an MR of
// another PD or without the access right completes at the requester with
// IBV_WC_REM_ACCESS_ERR and moves the requester's QP to the error state (its later work
// requests complete with IBV_WC_WR_FLUSH_ERR); a bad local key completes with
// IBV_WC_LOC_PROT_ERR; completions of one QP come in posting order; a request that is not
// acknowledged within the QP's transport timeout (4.096 us * 2^timeout * (retry_cnt + 1), or
// MC_FAKE_VERBS_ACK_TIMEOUT_MS) completes with IBV_WC_RETRY_EXC_ERR; RNR NAKs are retried
// after min_rnr_timer, rnr_retry times (7: forever), then IBV_WC_RNR_RETRY_EXC_ERR.
// A responder that refuses a request (access, length) NAKs it and then moves its own QP to
// the error state too, as hardware does (IBV_EVENT_QP_ACCESS_ERR there): requests behind the
// refused one are never executed (a READ refused part-way, its MR deregistered while its
// response went out, is the exception: requests behind it had run, only their answers are
// dropped).
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <arpa/inet.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "tests/fakes/verbs/fv_internal.h"

namespace mooncake::fakeverbs {

namespace {

constexpr size_t kMaxChunk = 64 * 1024;
constexpr int kInboundBudget = 64;  // records per QP per round (fairness between QPs)

uint64_t monoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// The per-NIC bandwidth cap (shared by every process using the NIC): reserves the link for
// `bytes` and returns once they had time to cross it.
void throttle(Ctx* c, size_t bytes) {
  uint64_t rate = c->shm->cap_bytes_per_s.load(std::memory_order_relaxed);
  if (rate == 0 || bytes == 0) return;
  uint64_t dur = static_cast<uint64_t>(static_cast<double>(bytes) * 1e9 / static_cast<double>(rate));
  uint64_t now = monoNs();
  // A token bucket with a small burst: time lost to a late wake-up (a loaded machine) is
  // made up by the next chunks, so the average rate is the cap.
  const uint64_t burst = std::max<uint64_t>(20000000, 8 * dur);
  uint64_t busy = c->shm->cap_busy_ns.load();
  uint64_t end;
  do {
    end = std::max(busy, now > burst ? now - burst : 0) + dur;
  } while (!c->shm->cap_busy_ns.compare_exchange_weak(busy, end));
  for (;;) {
    now = monoNs();
    if (now >= end) return;
    uint64_t left = end - now;
    if (left > 100000) {
      timespec ts{0, static_cast<long>(left - 50000)};
      nanosleep(&ts, nullptr);
    } else {
      sched_yield();
    }
  }
}

ibv_wc_opcode wcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    default: return IBV_WC_SEND;
  }
}

uint8_t pktType(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE: return kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM: return kWriteImm;
    case IBV_WR_SEND: return kSend;
    case IBV_WR_SEND_WITH_IMM: return kSendImm;
    default: return kReadReq;
  }
}

// Copies [off, off+len) of a gather list into dst (or scatters src into it).
void gather(const std::vector<ibv_sge>& sge, uint64_t off, size_t len, char* dst) {
  for (const auto& s : sge) {
    if (len == 0) return;
    if (off >= s.length) {
      off -= s.length;
      continue;
    }
    size_t n = std::min<uint64_t>(s.length - off, len);
    std::memcpy(dst, reinterpret_cast<const char*>(s.addr) + off, n);
    dst += n;
    len -= n;
    off = 0;
  }
}

void scatter(const std::vector<ibv_sge>& sge, uint64_t off, const char* src, size_t len) {
  for (const auto& s : sge) {
    if (len == 0) return;
    if (off >= s.length) {
      off -= s.length;
      continue;
    }
    size_t n = std::min<uint64_t>(s.length - off, len);
    std::memcpy(reinterpret_cast<char*>(s.addr) + off, src, n);
    src += n;
    len -= n;
    off = 0;
  }
}

// Local keys of a gather/scatter list (ctx->mu taken inside). Once checked, each entry's
// address is turned into where its bytes are in this process (a dma-buf MR's own mapping).
bool localKeysOk(Qp* q, std::vector<ibv_sge>& sge, bool write) {
  std::lock_guard<std::mutex> g(q->ctx->mu);
  for (const auto& s : sge) {
    Mr* m = q->ctx->findMr(s.lkey);
    if (m == nullptr || &m->pd->pd != q->qp.pd) return false;
    uint64_t lo = reinterpret_cast<uint64_t>(m->mr.addr);
    if (s.addr < lo || s.length > m->mr.length || s.addr - lo > m->mr.length - s.length) return false;
    if (write && !(m->access & IBV_ACCESS_LOCAL_WRITE)) return false;
  }
  for (auto& s : sge) {
    Mr* m = q->ctx->findMr(s.lkey);
    s.addr = reinterpret_cast<uint64_t>(m->host) + (s.addr - reinterpret_cast<uint64_t>(m->mr.addr));
  }
  return true;
}

// The requester's second look at a request's local keys (place_mu held shared): unchanged
// when no MR went since they were checked; else each must still be registered around the
// range it was posted with. A NIC whose translation of a buffer is gone does not touch it.
bool localKeysStill(Qp* q, SendWr& w) {
  const uint64_t gen = q->ctx->mr_gen.load(std::memory_order_acquire);
  if (w.is_inline || gen == w.gen) return true;
  w.gen = gen;
  std::lock_guard<std::mutex> g(q->ctx->mu);
  for (size_t i = 0; i < w.sge.size() && i < w.posted_addr.size(); ++i) {
    const ibv_sge& s = w.sge[i];
    Mr* m = q->ctx->findMr(s.lkey);
    if (m == nullptr) return false;
    const uint64_t lo = reinterpret_cast<uint64_t>(m->mr.addr), a = w.posted_addr[i];
    if (a < lo || s.length > m->mr.length || a - lo > m->mr.length - s.length) return false;
  }
  return true;
}

// The responder's check of a remote access; returns the local address or nullptr.
char* remoteTarget(Qp* q, uint32_t rkey, uint64_t raddr, uint64_t len, int need) {
  if (!(q->access & need)) return nullptr;
  std::lock_guard<std::mutex> g(q->ctx->mu);
  Mr* m = q->ctx->findMr(rkey);
  if (m == nullptr || &m->pd->pd != q->qp.pd || !(m->access & need)) return nullptr;
  if (raddr < m->iova || len > m->mr.length || raddr - m->iova > m->mr.length - len) return nullptr;
  return m->host + (raddr - m->iova);
}

void recvCompletion(Qp* q, const RecvWr& r, ibv_wc_status st, ibv_wc_opcode op, uint32_t len,
                    bool with_imm, uint32_t imm) {
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.status = st;
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = q->qp.qp_num;
  wc.src_qp = q->dest_qpn;
  if (with_imm) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = htonl(imm);
  }
  reinterpret_cast<Cq*>(q->qp.recv_cq)->add(wc);
}

void pushResp(Qp* q, uint8_t type, uint32_t msn, uint16_t status) {
  if (type == kAck && !q->resps.empty() && q->resps.back().type == kAck) {
    q->resps.back().msn = msn;  // a later ACK covers the earlier one
    return;
  }
  Resp r;
  r.type = type;
  r.msn = msn;
  r.status = status;
  q->resps.push_back(r);
}

// ---- responder ----
void handleRequest(Qp* q, const Pkt& p, const char* payload) {
  if (q->refused) return;  // in error once its NAK is out: nothing behind it runs
  // A PSN other than the one the responder expects: out of sequence, never answered (the
  // requester's transport timer then fails the request with IBV_WC_RETRY_EXC_ERR).
  if (p.psn != q->rq_psn) return;
  const bool first = p.flags & kFirst, last = p.flags & kLast;
  if (first) {
    q->dropping = false;
    if (p.msn != q->expect_msn) {  // after an RNR NAK: the requester will resend from there
      q->dropping = true;
    } else if (p.type == kReadReq && q->max_dest_rd_atomic == 0) {
      pushResp(q, kNak, p.msn, IBV_WC_REM_INV_REQ_ERR);  // no READ may be outstanding here
      q->refused = true;
      return;
    } else if (p.type == kReadReq) {
      const uint64_t gen = q->ctx->mr_gen.load(std::memory_order_acquire);
      char* src = remoteTarget(q, p.rkey, p.raddr, p.total, IBV_ACCESS_REMOTE_READ);
      if (src == nullptr && p.total > 0) {
        pushResp(q, kNak, p.msn, IBV_WC_REM_ACCESS_ERR);
        q->refused = true;
      } else {
        Resp r;
        r.type = kReadResp;
        r.msn = p.msn;
        r.src = src;
        r.total = p.total;
        r.rkey = p.rkey;
        r.raddr = p.raddr;
        r.gen = gen;
        q->resps.push_back(r);
      }
      ++q->expect_msn;
      return;
    } else {
      bool needs_recv = p.type != kWrite;
      if (needs_recv && q->rq.empty()) {
        pushResp(q, kRnrNak, p.msn, 0);
        q->dropping = true;
      } else if (p.type == kWrite || p.type == kWriteImm) {
        q->cur_gen = q->ctx->mr_gen.load(std::memory_order_acquire);
        q->cur_rkey = p.rkey;
        q->cur_raddr = p.raddr;
        q->cur_total = p.total;
        q->cur_dst = remoteTarget(q, p.rkey, p.raddr, p.total, IBV_ACCESS_REMOTE_WRITE);
        if (q->cur_dst == nullptr && p.total > 0) {
          pushResp(q, kNak, p.msn, IBV_WC_REM_ACCESS_ERR);
          q->refused = true;
          return;
        }
      } else {  // send: the receive's keys (local write), then: fits its buffers?
        RecvWr& rw = q->rq.front();
        if (!rw.checked && !localKeysOk(q, rw.sge, true)) {
          RecvWr r = rw;
          q->rq.pop_front();
          recvCompletion(q, r, IBV_WC_LOC_PROT_ERR, IBV_WC_RECV, 0, false, 0);
          pushResp(q, kNak, p.msn, IBV_WC_REM_OP_ERR);
          q->refused = true;
          return;
        }
        rw.checked = true;
        uint64_t room = 0;
        for (const auto& s : q->rq.front().sge) room += s.length;
        if (p.total > room) {
          RecvWr r = q->rq.front();
          q->rq.pop_front();
          recvCompletion(q, r, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0, false, 0);
          pushResp(q, kNak, p.msn, IBV_WC_REM_INV_REQ_ERR);
          q->refused = true;
          return;
        }
      }
    }
    q->cur_msn = p.msn;
  }
  if (q->dropping || p.msn != q->cur_msn) return;
  if (p.len > 0) {
    if (p.type == kWrite || p.type == kWriteImm) {
      std::shared_lock<std::shared_mutex> use(q->ctx->place_mu);
      const uint64_t gen = q->ctx->mr_gen.load(std::memory_order_acquire);
      if (gen != q->cur_gen) {  // an MR went since the check: is this one still there?
        q->cur_dst = remoteTarget(q, q->cur_rkey, q->cur_raddr, q->cur_total,
                                  IBV_ACCESS_REMOTE_WRITE);
        q->cur_gen = gen;
        if (q->cur_dst == nullptr) {
          pushResp(q, kNak, p.msn, IBV_WC_REM_ACCESS_ERR);
          q->refused = true;
          return;
        }
      }
      std::memcpy(q->cur_dst + p.offset, payload, p.len);
    } else {
      scatter(q->rq.front().sge, p.offset, payload, p.len);
    }
    q->ctx->shm->rx_bytes.fetch_add(p.len, std::memory_order_relaxed);
  }
  if (!last) return;
  if (p.type != kWrite) {
    RecvWr r = q->rq.front();
    q->rq.pop_front();
    bool imm = p.type == kWriteImm || p.type == kSendImm;
    recvCompletion(q, r, IBV_WC_SUCCESS,
                   p.type == kWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV,
                   static_cast<uint32_t>(p.total), imm, p.imm);
  }
  ++q->expect_msn;
  pushResp(q, kAck, p.msn, 0);
}

// ---- requester: responses ----
void handleResponse(Qp* q, const Pkt& p, const char* payload) {
  q->last_progress = Clock::now();
  if (p.type == kAck) {
    q->rnr_left = q->rnr_retry;
    while (q->tx > 0 && q->wrs.front().msn <= p.msn &&
           !(q->wrs.front().op == IBV_WR_RDMA_READ && q->wrs.front().read_got < q->wrs.front().len)) {
      completeSend(q, q->wrs.front(), IBV_WC_SUCCESS);
      q->wrs.pop_front();
      --q->tx;
    }
    return;
  }
  // The others name one request among those transmitted; a NAK or RNR NAK may also name the
  // one still being transmitted (the responder refuses a message at any of its packets).
  const size_t sending = p.type != kReadResp && q->tx_off > 0 && q->tx < q->wrs.size() ? 1 : 0;
  size_t i = 0;
  while (i < q->tx + sending && q->wrs[i].msn != p.msn) ++i;
  if (i == q->tx + sending) return;  // stale (a request already failed or rewound)
  // Takes request i out of the queue (the one being transmitted: its transmission ends).
  auto take = [q](size_t k) {
    SendWr out = std::move(q->wrs[k]);
    q->wrs.erase(q->wrs.begin() + static_cast<long>(k));
    if (k < q->tx)
      --q->tx;
    else
      q->tx_off = 0;
    return out;
  };
  SendWr& w = q->wrs[i];
  if (p.type == kReadResp) {
    if (p.len > 0) {
      std::shared_lock<std::shared_mutex> use(q->ctx->place_mu);
      if (!localKeysStill(q, w)) {  // its buffer was deregistered meanwhile
        use.unlock();
        SendWr failed = take(i);
        completeSend(q, failed, IBV_WC_LOC_PROT_ERR);
        qpError(q, IBV_WC_WR_FLUSH_ERR);
        return;
      }
      scatter(w.sge, p.offset, payload, p.len);
    }
    w.read_got += p.len;
    if (w.read_got >= w.len && i == 0) {
      completeSend(q, w, IBV_WC_SUCCESS);
      q->wrs.pop_front();
      --q->tx;
    }
    return;
  }
  if (p.type == kNak) {
    // In order: everything before it was acknowledged already.
    SendWr failed = take(i);
    completeSend(q, failed, static_cast<ibv_wc_status>(p.status));
    qpError(q, IBV_WC_WR_FLUSH_ERR);
    return;
  }
  if (p.type == kRnrNak) {
    if (q->rnr_retry != 7 && q->rnr_left-- <= 0) {
      SendWr failed = take(i);
      completeSend(q, failed, IBV_WC_RNR_RETRY_EXC_ERR);
      qpError(q, IBV_WC_WR_FLUSH_ERR);
      return;
    }
    // Resend from that request on, after the receiver's RNR timer (scaled: 10 us per step).
    for (size_t k = i; k < q->tx; ++k) q->wrs[k].read_got = 0;
    q->tx = i;
    q->tx_off = 0;
    q->rnr_until = Clock::now() + std::chrono::microseconds(10 * (1 + q->min_rnr_timer));
  }
}

// What the NIC sends next for one QP (built under its lock, sent outside it).
struct Outgoing {
  Pkt h{};
  size_t len = 0;
  bool any = false;
};

// Responses first (they unblock the peer), then requests. qp->mu held.
bool nextOutgoing(Qp* q, bool up, std::vector<char>& scratch, size_t chunk, Outgoing* out) {
  // A hung NIC sends nothing, checked here too and not only once per round: a request posted
  // after the stall was set must not go out in a round that began before it.
  if (q->ctx->shm->stalled.load(std::memory_order_acquire)) return false;
  Ring* r = q->out.get();
  while (!q->resps.empty()) {
    Resp& rs = q->resps.front();
    if (!up || r == nullptr) {
      q->resps.pop_front();  // into the void: the requester times out
      continue;
    }
    Pkt h{};
    h.type = rs.type;
    h.msn = rs.msn;
    h.status = rs.status;
    if (rs.type != kReadResp) {
      if (r->room() < 2 * sizeof(Pkt) + 8) return false;
      r->push(h, nullptr, 0);
      q->resps.pop_front();
      ring(r->doorbell());
      continue;
    }
    size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, rs.total - rs.sent));
    if (r->room() < 2 * (sizeof(Pkt) + n) + 16) return false;
    std::shared_lock<std::shared_mutex> use(q->ctx->place_mu, std::defer_lock);
    if (n > 0) {
      use.lock();
      const uint64_t gen = q->ctx->mr_gen.load(std::memory_order_acquire);
      if (gen != rs.gen) {  // an MR went since the check: is this one still there?
        rs.gen = gen;
        if (remoteTarget(q, rs.rkey, rs.raddr, rs.total, IBV_ACCESS_REMOTE_READ) == nullptr) {
          rs.type = kNak;  // instead of the rest; the QP fails once it is out
          rs.status = IBV_WC_REM_ACCESS_ERR;
          q->refused = true;
          q->resps.resize(1);  // nothing behind the refused request is answered
          continue;
        }
      }
    }
    h.offset = rs.sent;
    h.total = rs.total;
    h.len = static_cast<uint32_t>(n);
    h.flags = (rs.sent == 0 ? kFirst : 0) | (rs.sent + n == rs.total ? kLast : 0);
    if (n > 0) std::memcpy(scratch.data(), rs.src + rs.sent, n);
    rs.sent += n;
    if (rs.sent >= rs.total) q->resps.pop_front();
    out->h = h;
    out->len = n;
    out->any = true;
    return true;
  }
  if (q->qp.state != IBV_QPS_RTS || q->tx >= q->wrs.size()) return false;
  if (Clock::now() < q->rnr_until) return false;
  SendWr& w = q->wrs[q->tx];
  if (!w.checked) {
    w.checked = true;
    bool is_read = w.op == IBV_WR_RDMA_READ;
    w.gen = q->ctx->mr_gen.load(std::memory_order_acquire);
    for (const auto& s : w.sge) w.posted_addr.push_back(s.addr);
    if (!w.is_inline && !localKeysOk(q, w.sge, is_read)) {
      SendWr failed = std::move(w);
      q->wrs.erase(q->wrs.begin() + static_cast<long>(q->tx));
      completeSend(q, failed, IBV_WC_LOC_PROT_ERR);
      qpError(q, IBV_WC_WR_FLUSH_ERR);
      return false;
    }
    int64_t left = q->ctx->shm->fail_next.load();
    while (left > 0 && !q->ctx->shm->fail_next.compare_exchange_weak(left, left - 1)) {
    }
    if (left > 0) {  // fault injection: this request fails as the knob says
      SendWr failed = std::move(w);
      q->wrs.erase(q->wrs.begin() + static_cast<long>(q->tx));
      completeSend(q, failed, static_cast<ibv_wc_status>(q->ctx->shm->fail_status.load()));
      qpError(q, IBV_WC_WR_FLUSH_ERR);
      return false;
    }
  }
  Pkt h{};
  h.type = pktType(w.op);
  h.msn = w.msn;
  h.psn = q->sq_psn;
  h.imm = w.imm;
  h.rkey = w.rkey;
  h.raddr = w.raddr;
  h.total = w.len;
  h.offset = q->tx_off;
  size_t n = 0;
  if (h.type != kReadReq) {
    n = static_cast<size_t>(std::min<uint64_t>(chunk, w.len - q->tx_off));
    if (r != nullptr && up && r->room() < 2 * (sizeof(Pkt) + n) + 16) return false;
    if (w.is_inline) {
      std::memcpy(scratch.data(), w.inline_data.data() + q->tx_off, n);
    } else {
      std::shared_lock<std::shared_mutex> use(q->ctx->place_mu);
      if (!localKeysStill(q, w)) {  // its buffer was deregistered meanwhile
        use.unlock();
        SendWr failed = std::move(w);
        q->wrs.erase(q->wrs.begin() + static_cast<long>(q->tx));
        q->tx_off = 0;
        completeSend(q, failed, IBV_WC_LOC_PROT_ERR);
        qpError(q, IBV_WC_WR_FLUSH_ERR);
        return false;
      }
      gather(w.sge, q->tx_off, n, scratch.data());
    }
  } else if (r != nullptr && up && r->room() < 2 * sizeof(Pkt) + 16) {
    return false;
  }
  h.len = static_cast<uint32_t>(n);
  h.flags = (q->tx_off == 0 ? kFirst : 0);
  q->tx_off += n;
  if (h.type == kReadReq || q->tx_off >= w.len) {
    h.flags |= kLast;
    ++q->tx;
    q->tx_off = 0;
  }
  q->last_progress = Clock::now();
  if (!up || r == nullptr) return true;  // sent into the void: it will time out
  out->h = h;
  out->len = n;
  out->any = true;
  return true;
}

// One QP's share of a round; true when something moved.
bool serviceQp(Ctx* c, const std::shared_ptr<Qp>& qp, bool up, std::vector<char>& scratch,
               size_t chunk) {
  Outgoing out;
  Ring* to = nullptr;
  bool progress = false;
  {
    std::lock_guard<std::mutex> g(qp->mu);
    Qp* q = qp.get();
    if (q->destroyed) return false;
    if (q->qp.state != IBV_QPS_ERR && q->qp.state != IBV_QPS_RESET &&
        (reinterpret_cast<Cq*>(q->qp.send_cq)->overrun.load() ||
         reinterpret_cast<Cq*>(q->qp.recv_cq)->overrun.load())) {
      qpError(q, IBV_WC_WR_FLUSH_ERR);  // its CQ overran: the QP is in error (nothing completes)
      progress = true;
    }
    ibv_qp_state st = q->qp.state;
    if (q->out == nullptr && (st == IBV_QPS_RTR || st == IBV_QPS_RTS) && q->remote_dev >= 0) {
      const Fabric& f = fabric();
      q->out = Ring::attach("/mcfv-" + f.id + "-" + f.devices[q->remote_dev].key() + "-q" +
                            std::to_string(q->dest_qpn));
    }
    if (st == IBV_QPS_RTR || st == IBV_QPS_RTS || st == IBV_QPS_ERR) {
      const Pkt* p;
      const char* payload;
      for (int k = 0; k < kInboundBudget && q->in->peek(&p, &payload); ++k) {
        // The port's state when the packet is taken, not when this round began: a port taken
        // down before the peer posted must refuse the packet (checked per packet, as a NIC
        // would; a round-start sample let a packet through that was sent after the flip).
        if (c->shm->stalled.load(std::memory_order_acquire)) break;
        up = up && c->shm->port_state.load(std::memory_order_acquire) == kPortActive;
        if (up && q->qp.state != IBV_QPS_ERR) {
          if (p->type >= kAck)
            handleResponse(q, *p, payload);
          else
            handleRequest(q, *p, payload);
        }
        q->in->pop();
        progress = true;
      }
    }
    if (q->qp.state == IBV_QPS_RTR || q->qp.state == IBV_QPS_RTS) {
      progress |= nextOutgoing(q, up, scratch, chunk, &out);
      if (q->refused && q->resps.empty()) {  // the NAK is out: the responder's QP fails too
        qpError(q, IBV_WC_WR_FLUSH_ERR);
        progress = true;
      }
      to = q->out.get();
      // Transport timeout: transmitted requests nobody acknowledged.
      if (q->tx > 0 && Clock::now() - q->last_progress > std::chrono::milliseconds(ackTimeoutMs(q))) {
        SendWr failed = std::move(q->wrs.front());
        q->wrs.pop_front();
        --q->tx;
        completeSend(q, failed, IBV_WC_RETRY_EXC_ERR);
        qpError(q, IBV_WC_WR_FLUSH_ERR);
        out.any = false;
        progress = true;
      }
    }
  }
  if (out.any && to != nullptr) {
    throttle(c, out.len);
    to->push(out.h, scratch.data(), out.len);
    if (out.h.type != kReadReq && out.len > 0)
      c->shm->tx_bytes.fetch_add(out.len, std::memory_order_relaxed);
    ring(to->doorbell());
  }
  return progress;
}

}  // namespace

int64_t ackTimeoutMs(const Qp* q) {
  int64_t forced = fabric().ack_timeout_ms;
  if (forced > 0) return forced;
  double us = 4.096 * static_cast<double>(1ull << std::min<int>(q->timeout, 31)) *
              (q->retry_cnt + 1);
  return std::max<int64_t>(1, static_cast<int64_t>(us / 1000));
}

void completeSend(Qp* q, const SendWr& w, ibv_wc_status st) {
  if (st == IBV_WC_SUCCESS) {
    q->ctx->shm->wr_done.fetch_add(1, std::memory_order_relaxed);
  } else {
    q->ctx->shm->wr_failed.fetch_add(1, std::memory_order_relaxed);
  }
  if (st == IBV_WC_SUCCESS && !w.signaled) return;
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = st;
  wc.opcode = wcOpcode(w.op);
  wc.byte_len = w.op == IBV_WR_RDMA_READ ? static_cast<uint32_t>(w.len) : 0;
  wc.qp_num = q->qp.qp_num;
  reinterpret_cast<Cq*>(q->qp.send_cq)->add(wc, q->sq_unpolled);
}

void qpError(Qp* q, ibv_wc_status first) {
  q->qp.state = IBV_QPS_ERR;
  bool head = true;
  while (!q->wrs.empty()) {
    completeSend(q, q->wrs.front(), head ? first : IBV_WC_WR_FLUSH_ERR);
    q->wrs.pop_front();
    head = false;
  }
  q->tx = 0;
  q->tx_off = 0;
  while (!q->rq.empty()) {
    recvCompletion(q, q->rq.front(), IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
    q->rq.pop_front();
  }
  q->resps.clear();
}

void nicLoop(Ctx* c) {
  const size_t chunk = std::min(kMaxChunk, fabric().ring_bytes / 4);
  std::vector<char> scratch(chunk + 64);
  int idle = 0;
  while (!c->stop.load(std::memory_order_acquire)) {
    uint32_t seen = c->db->word.load(std::memory_order_seq_cst);
    if (c->shm->stalled.load(std::memory_order_relaxed)) {  // a hung NIC: nothing moves
      timespec ts{0, 1000000};
      nanosleep(&ts, nullptr);
      continue;
    }
    bool up = c->shm->port_state.load(std::memory_order_relaxed) == kPortActive;
    std::vector<std::shared_ptr<Qp>> qps;
    {
      std::lock_guard<std::mutex> g(c->mu);
      qps = c->qps;
    }
    bool progress = false;
    for (auto& q : qps) progress |= serviceQp(c, q, up, scratch, chunk);
    if (progress) {
      idle = 0;
      continue;
    }
    if (++idle < 64) {
      sched_yield();
      continue;
    }
    // Sleep until a post or a peer's packet rings, or 1 ms (timeouts, RNR timers).
    c->db->waiters.fetch_add(1, std::memory_order_seq_cst);
    timespec ts{0, 1000000};
    syscall(SYS_futex, &c->db->word, FUTEX_WAIT, seen, &ts, nullptr, 0);
    c->db->waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace mooncake::fakeverbs
