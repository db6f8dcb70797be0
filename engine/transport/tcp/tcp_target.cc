// tcp transport, the target side of one-sided requests: a peer's WRITE or READ checked against
// this engine's registry, its payload received into registered memory or sent out of it (GPU
// memory staged through a host buffer by the device layer), and the fence that keeps both
// away from a region once it is unregistered or freed; on the initiator side, the fence that
// keeps a task's frames away from its buffer once its caller gave up on it.
// Contracts: tcp_transport.h; threading: the comment at the top of tcp_transport.cc.
#include <sys/socket.h>

#include <new>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/transport/tcp/tcp_core.h"

namespace mooncake::engine::tcp {

namespace {
// A staged copy into or out of GPU memory (one frame's worth) that takes longer failed.
constexpr int64_t kDeviceCopyMs = 30000;

// A device copy that missed its deadline is not cancelled: it may still run (its stream is in
// order), so the host buffer it reads or writes is never used again (leaked, a wedged device's
// cost). Neither is the region held for it: the fence covers copies that end in time.
void abandonToCopy(std::string* buf, const Status& st) {
  if (st.code() != Code::kTimeout || buf->empty()) return;
  (void)new std::string(std::move(*buf));
  *buf = std::string();
}
}  // namespace

// WRITE or READ_REQ header read (frameStart). Every access to a region's memory runs under
// MemoryRegistry::intoRegion with the registration admitted here, so that unregisterMemory and
// free wait for it and a later step finds the region gone: a host WRITE's recv() steps
// (onReadable), a READ's response queued straight out of the region (a removal after that
// copies it: regionRemoved), and the device copies of GPU memory (staged: the WRITE's payload
// is copied in once it arrived, onWriteEnd; a READ is copied out into a host buffer here).
bool Core::onRequest(const std::shared_ptr<Conn>& c) {
  const FrameHeader& h = c->cur;
  auto region = ctx_->registry->find(h.addr, h.length);
  const bool gpu = region.has_value() && region->kind == MemoryKind::kCuda;
  bool ok = h.length == 0 || (region.has_value() && region->kind == MemoryKind::kHost) || gpu;
  c->verdict = ok ? Code::kOk : Code::kPermissionDenied;
  if (!ok) {
    MC_LOG(WARN, TCP) << "refused " << (h.type == FrameType::kWrite ? "WRITE" : "READ") << " of ["
                      << hexId(h.addr) << ", +" << h.length << ") from " << c->src_name
                      << ": not inside one registered region";
  }
  if (h.type == FrameType::kWrite) {
    const Conn::Sink sink = !ok                   ? Conn::Sink::kDiscard
                            : gpu && h.length > 0 ? Conn::Sink::kBuffer
                                                  : Conn::Sink::kMemory;
    if (!expectPayload(c, sink, reinterpret_cast<char*>(h.addr))) return false;
    if (ok && h.length > 0) {
      c->guarded = sink == Conn::Sink::kMemory;
      c->region = RegionCheck{region->serial, 0, 0, 0};  // (the first step looks it up)
    }
    return true;
  }
  FrameHeader resp;
  resp.type = FrameType::kReadResp;
  resp.req_id = h.req_id;
  resp.addr = h.addr;
  std::string staged;
  if (ok && h.length > 0) {
    RegionCheck chk{region->serial, 0, 0, 0};
    Status copied;
    const bool there = ctx_->registry->intoRegion(h.addr, h.length, &chk, [&] {
      if (!gpu) {  // straight out of the region
        resp.status = static_cast<uint16_t>(Code::kOk);
        resp.length = h.length;
        send(*c, resp, reinterpret_cast<const char*>(h.addr), h.length, {}, true);
        return;
      }
      staged.resize(h.length);
      copied = device::transferCopy(staged.data(), reinterpret_cast<const void*>(h.addr),
                                    h.length, deadlineInMs(kDeviceCopyMs));
    });
    if (there && !gpu) return true;
    if (!there) {
      MC_LOG(WARN, TCP) << "refused READ of [" << hexId(h.addr) << ", +" << h.length << ") from "
                        << c->src_name << ": its region was unregistered meanwhile";
      c->verdict = Code::kPermissionDenied;
    } else if (!copied.ok()) {
      MC_LOG(WARN, TCP) << "READ of GPU memory [" << hexId(h.addr) << ", +" << h.length
                        << ") for " << c->src_name << ": " << copied.toString();
      c->verdict = Code::kInternal;
      abandonToCopy(&staged, copied);
    }
    if (c->verdict != Code::kOk) {
      ok = false;
      staged.clear();
    }
  }
  resp.status = static_cast<uint16_t>(c->verdict);
  resp.length = ok ? h.length : 0;
  send(*c, resp, nullptr, resp.length, std::move(staged));
  return true;
}

// A WRITE's payload is in (frameEnd): GPU memory is copied in from its host buffer now, if
// the registration admitted at its header is still there; then the ack.
bool Core::onWriteEnd(const std::shared_ptr<Conn>& c) {
  const FrameHeader& h = c->cur;
  if (c->sink == Conn::Sink::kBuffer) {
    Status st;
    if (!ctx_->registry->intoRegion(h.addr, h.length, &c->region, [&] {
          st = device::transferCopy(reinterpret_cast<void*>(h.addr), c->buf.data(),
                                    c->buf.size(), deadlineInMs(kDeviceCopyMs));
        })) {
      MC_LOG(WARN, TCP) << "refused WRITE of [" << hexId(h.addr) << ", +" << h.length
                        << ") from " << c->src_name << ": its region was unregistered meanwhile";
      c->verdict = Code::kPermissionDenied;
    } else if (!st.ok()) {
      MC_LOG(WARN, TCP) << "WRITE of GPU memory [" << hexId(h.addr) << ", +" << h.length
                        << ") from " << c->src_name << ": " << st.toString();
      c->verdict = Code::kInternal;
      abandonToCopy(&c->buf, st);
    }
    if (ctx_->buffers) ctx_->buffers->give(std::move(c->buf));
    c->buf.clear();
  }
  FrameHeader ack;
  ack.type = FrameType::kWriteAck;
  ack.req_id = h.req_id;
  ack.addr = h.addr;
  ack.status = static_cast<uint16_t>(c->verdict);
  send(*c, ack, nullptr, 0);
  if (c->role == ConnRole::kData) {
    // The bytes are in memory (or were refused): NOTIFYs waiting for them may go.
    auto it = links_.find({c->src_engine, c->link});
    if (it == links_.end())
      it = links_.emplace(std::make_pair(c->src_engine, c->link), LinkState()).first;
    ++it->second.writes_done[c->index];
    if (!it->second.held.empty()) releaseHeld(it->second, c->src_engine);
  }
  return true;
}

// Under c.out_mu: what `it` still has to send is copied into it, so that the frame goes out
// whole (its header, with its length, may be out already) without its memory. No memory for
// the copy: the connection is shut down now (the peer is then failed, as on any broken
// connection) rather than read from memory its owner took back; false.
bool Core::ownRestLocked(Conn& c, OutItem& it, const char* what) {
  // `off` counts the header and the payload sent: the item keeps the part of its payload
  // already out in its count and its offsets.
  const size_t sent = it.off > kHeaderBytes ? it.off - kHeaderBytes : 0;
  try {
    it.owned.assign(it.data + sent, it.len - sent);
  } catch (const std::bad_alloc&) {
    c.broken = true;
    shutdown(c.fd, SHUT_RDWR);
    try {
      MC_LOG(ERROR, TCP) << "connection " << c.id << ": no memory to keep " << it.len - sent
                         << " bytes of " << what << ": connection closed";
    } catch (...) {
    }
    return false;
  }
  it.len -= sent;
  it.off -= sent;
  it.data = nullptr;
  it.from_region = false;
  return true;
}

void Core::regionRemoved(const Region& r) {
  std::vector<std::shared_ptr<Conn>> all;
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    all.reserve(conns_.size());
    for (auto& kv : conns_) all.push_back(kv.second);
  }
  for (auto& c : all) {
    std::lock_guard<std::mutex> g(c->out_mu);
    for (OutItem& it : c->outq) {
      const uint64_t a = reinterpret_cast<uint64_t>(it.data);
      if (!it.from_region || !it.owned.empty() || a < r.addr || a - r.addr >= r.len) continue;
      if (!ownRestLocked(*c, it, "a READ response out of a region being freed")) break;
    }
  }
}

// Initiator side. The progress thread is the only one that receives into a task's buffer, and
// frames are sent under their connection's out_mu: run there, with each out_mu taken, this is
// the fence TransportPeer::fenceAbandoned promises.
void Core::fenceAbandoned(const std::shared_ptr<PeerState>& p) {
  runOnLoop(
      [this, p] {
        std::unordered_set<uint64_t> writes;  // abandoned WRITE slices (their frames' req ids)
        {
          std::lock_guard<std::mutex> g(p->mu);
          for (auto& [req, s] : p->slices)
            if (s.op == OpCode::kWrite && s.ts->task->isAbandoned()) writes.insert(req);
          // A READ response being received: the rest of it goes nowhere (frameStart sends the
          // next ones there too). The stream stays in step; the slice completes at its end.
          for (auto& c : p->conns) {
            if (c->closed || !c->in_payload || c->sink != Conn::Sink::kMemory ||
                c->cur.type != FrameType::kReadResp)
              continue;
            auto it = p->slices.find(c->cur.req_id);
            if (it == p->slices.end() || !it->second.ts->task->isAbandoned()) continue;
            c->sink = Conn::Sink::kDiscard;
            c->dst = nullptr;
            abandonSliceLocked(it->second);
          }
        }
        if (writes.empty()) return;
        for (auto& c : p->conns) {
          std::lock_guard<std::mutex> g(c->out_mu);
          for (OutItem& it : c->outq) {
            if (it.data == nullptr || !it.owned.empty() || it.from_region) continue;
            const FrameHeader h = decodeHeader(it.hdr);
            if (h.type != FrameType::kWrite || writes.count(h.req_id) == 0) continue;
            if (!ownRestLocked(*c, it, "a WRITE whose caller gave up waiting")) break;
          }
        }
      },
      true);
}

}  // namespace mooncake::engine::tcp
