#include "pg/p2p.h"

#include <cstring>

#include "pg/communicator.h"

namespace mooncake::pg {

namespace {
constexpr uint32_t kMagic = 0x4d504750;  // "MPGP"

struct Header {
  uint32_t magic;
  int32_t src;
  uint64_t tag;
  uint64_t id;
  uint64_t total;
  uint64_t offset;
};
}  // namespace

static_assert(sizeof(Header) <= NetSlots::kOwnerHeaderBytes, "p2p header fits a slot");

P2p::P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
         int rank, int64_t health_us, std::unique_ptr<NetSlots> slots)
    : engine_(engine),
      health_(health),
      peers_(std::move(peers)),
      rank_(rank),
      health_us_(health_us),
      slots_(std::move(slots)),
      piece_(slots_->slotBytes()),
      box_(std::make_shared<Box>()) {}

P2p::~P2p() { slots_.reset(); }  // removes its handler before box_ can go

void P2p::start() {
  std::shared_ptr<Box> box = box_;
  NetSlots* slots = slots_.get();
  // On the engine's dispatcher: copy the piece out and hand the slot straight back.
  slots_->start([box, slots](int src, int k) {
    NetSlots::View v = slots->view(src, k);
    if (v.ok) box->deliver(v.owner_hdr, v.payload, v.len);
    (void)slots->giveBack(src, k);
  });
  started_ = true;
}

void P2p::Box::deliver(const char* hdr, const char* payload, size_t len) {
  Header h{};
  std::memcpy(&h, hdr, sizeof(h));
  if (h.magic != kMagic || h.offset + len > h.total) return;
  std::lock_guard<std::mutex> g(mu);
  if (h.offset == 0 && len == h.total) {
    ready.push_back(Complete{h.src, h.tag, std::string(payload, len)});
    cv.notify_all();
    return;
  }
  auto key = std::make_pair(static_cast<int>(h.src), h.id);
  Partial& p = partial[key];
  if (h.offset == 0) {
    p.tag = h.tag;
    p.data.reserve(h.total);
  }
  if (p.data.size() != h.offset) {  // pieces of one message arrive in order
    partial.erase(key);
    return;
  }
  p.data.append(payload, len);
  if (p.data.size() == h.total) {
    ready.push_back(Complete{h.src, p.tag, std::move(p.data)});
    partial.erase(key);
    cv.notify_all();
  }
}

void P2p::send(const void* buf, size_t bytes, int dst, uint64_t tag,
               std::chrono::milliseconds timeout) {
  OpCtx op{"send", engine::Clock::now() + timeout, 0, timeout};
  std::lock_guard<std::mutex> g(send_mu_);
  uint64_t id = next_id_++;
  size_t off = 0;
  auto failed = [&](const Status& st) {
    health_->check(op, dst);
    throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                        std::to_string(dst) + " (group " + health_->group() +
                        ") failed: " + st.toString(),
                    dst, "send");
  };
  do {
    size_t len = std::min(piece_, bytes - off);
    Header h{kMagic, rank_, tag, id, bytes, off};
    const char* piece = static_cast<const char*>(buf) + off;
    if (dst == rank_) {
      box_->deliver(reinterpret_cast<const char*>(&h), piece, len);
    } else {
      Status st = slots_->send(dst, &h, sizeof(h), piece, len);
      if (!st.ok()) failed(st);
    }
    off += len;
  } while (off < bytes);
  // "Completes when the data left this process": the writes from the caller's buffer.
  if (dst != rank_) {
    int failed_dst = dst;
    Status st = slots_->drainOverlapping(buf, bytes, op.deadline, &failed_dst);
    if (!st.ok()) {
      health_->check(op, failed_dst);
      failed(st);
    }
  }
}

int P2p::recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout) {
  OpCtx op{"recv", engine::Clock::now() + timeout, 0, timeout};
  Complete c;
  {
    std::unique_lock<std::mutex> g(box_->mu);
    for (;;) {
      auto it = box_->ready.begin();
      for (; it != box_->ready.end(); ++it)
        if ((src < 0 || it->src == src) && it->tag == tag) break;
      if (it != box_->ready.end()) {
        c = std::move(*it);
        box_->ready.erase(it);
        break;
      }
      box_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      g.unlock();
      // A specific source: only its death matters. Any source: any dead peer fails it.
      if (src != rank_) health_->check(op, src);
      if (engine::Clock::now() >= op.deadline)
        health_->timedOut(op, src, "no message with tag " + std::to_string(tag));
      g.lock();
    }
  }
  if (c.data.size() != bytes)
    throw CommError("mooncake pg: recv size mismatch on rank " + std::to_string(rank_) +
                        " (group " + health_->group() + "): rank " + std::to_string(c.src) +
                        " sent " + std::to_string(c.data.size()) + " bytes with tag " +
                        std::to_string(tag) + " but the receive buffer holds " +
                        std::to_string(bytes) + " bytes",
                    c.src, "recv");
  if (bytes > 0) std::memcpy(buf, c.data.data(), bytes);
  return c.src;
}

}  // namespace mooncake::pg
