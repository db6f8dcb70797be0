#include "pg/p2p.h"

#include <cstring>
#include <set>

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

P2p::P2p(engine::TransferEngine* engine, const Health* health, std::vector<engine::PeerId> peers,
         int rank, uint32_t channel, int64_t health_us, size_t piece_bytes)
    : engine_(engine),
      rank_(rank),
      channel_(channel),
      health_us_(health_us),
      piece_(piece_bytes),
      box_(std::make_shared<Box>()) {
  auto t = std::make_shared<Table>();
  t->peers = std::move(peers);
  t->health = health;
  table_ = std::move(t);
}

std::shared_ptr<const P2p::Table> P2p::table() const {
  std::lock_guard<std::mutex> g(table_mu_);
  return table_;
}

bool P2p::current(const Table& t, int src, uint64_t engine) {
  if (t.engines.empty()) return true;
  if (src < 0 || static_cast<size_t>(src) >= t.engines.size()) return false;
  return t.engines[src] == engine;
}

void P2p::setPeers(std::vector<engine::PeerId> peers, std::vector<uint64_t> engines,
                   std::shared_ptr<const Health> health) {
  auto t = std::make_shared<Table>();
  t->peers = std::move(peers);
  t->engines = std::move(engines);
  t->health = health.get();
  t->owned = std::move(health);
  {
    std::lock_guard<std::mutex> g(table_mu_);
    const auto& old = table_->engines;
    for (size_t i = 0; i < old.size() && i < t->engines.size(); ++i)
      if (old[i] != 0 && t->engines[i] != 0 && old[i] != t->engines[i]) retired_.insert(old[i]);
    table_ = t;
  }
  // Drop what processes that held a slot before sent: their messages can never match (a
  // receive from the slot means its current process). Processes this table does not know yet
  // keep theirs.
  std::set<uint64_t> retired;
  {
    std::lock_guard<std::mutex> g(table_mu_);
    retired = retired_;
  }
  std::lock_guard<std::mutex> g(box_->mu);
  for (auto it = box_->ready.begin(); it != box_->ready.end();)
    it = retired.count(it->engine) ? box_->ready.erase(it) : std::next(it);
  box_->cv.notify_all();
}

P2p::~P2p() {
  if (started_) engine_->setMessageHandler(channel_, nullptr);
}

void P2p::start() {
  std::shared_ptr<Box> box = box_;
  engine_->setMessageHandler(channel_, [box](engine::Message&& m) {
    box->deliver(std::move(m.payload), m.src_engine);
  });
  started_ = true;
}

void P2p::Box::deliver(std::string&& payload, uint64_t engine) {
  Header h{};
  if (payload.size() < sizeof(h)) return;
  std::memcpy(&h, payload.data(), sizeof(h));
  size_t len = payload.size() - sizeof(h);
  if (h.magic != kMagic || h.offset + len > h.total) return;
  std::lock_guard<std::mutex> g(mu);
  if (h.offset == 0 && len == h.total) {
    payload.erase(0, sizeof(h));
    ready.push_back(Complete{h.src, h.tag, std::move(payload), engine});
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
  p.data.append(payload, sizeof(h), len);
  if (p.data.size() == h.total) {
    ready.push_back(Complete{h.src, p.tag, std::move(p.data), engine});
    partial.erase(key);
    cv.notify_all();
  }
}

void P2p::send(const void* buf, size_t bytes, int dst, uint64_t tag,
               std::chrono::milliseconds timeout) {
  OpCtx op{"send", engine::Clock::now() + timeout, 0, timeout};
  auto t = table();
  if (dst != rank_ && t->peers[dst] == engine::kInvalidPeer)
    throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                        std::to_string(dst) + " (group " + t->health->group() +
                        "): it is not an active member",
                    dst, "send");
  std::lock_guard<std::mutex> g(send_mu_);
  uint64_t id = next_id_++;
  size_t off = 0;
  do {
    size_t len = std::min(piece_, bytes - off);
    Header h{kMagic, rank_, tag, id, bytes, off};
    std::string payload;  // header + data, built without zero-filling first
    payload.reserve(sizeof(h) + len);
    payload.append(reinterpret_cast<const char*>(&h), sizeof(h));
    if (len > 0) payload.append(static_cast<const char*>(buf) + off, len);
    if (dst == rank_) {
      box_->deliver(std::move(payload), engine_->engineId());
    } else {
      Status st = engine_->sendMessageOwned(t->peers[dst], channel_, std::move(payload));
      if (!st.ok()) {
        t->health->check(op, dst);
        throw CommError("mooncake pg: send of " + std::to_string(bytes) + " bytes to rank " +
                            std::to_string(dst) + " (group " + t->health->group() +
                            ") failed: " + st.toString(),
                        dst, "send");
      }
    }
    off += len;
  } while (off < bytes);
}

int P2p::recv(void* buf, size_t bytes, int src, uint64_t tag, std::chrono::milliseconds timeout) {
  OpCtx op{"recv", engine::Clock::now() + timeout, 0, timeout};
  Complete c;
  {
    std::unique_lock<std::mutex> g(box_->mu);
    for (;;) {
      auto t = table();
      auto it = box_->ready.begin();
      for (; it != box_->ready.end(); ++it)
        if ((src < 0 || it->src == src) && it->tag == tag &&
            (it->engine == engine_->engineId() || current(*t, it->src, it->engine)))
          break;
      if (it != box_->ready.end()) {
        c = std::move(*it);
        box_->ready.erase(it);
        break;
      }
      box_->cv.wait_for(g, std::chrono::microseconds(health_us_));
      g.unlock();
      t = table();
      if (src >= 0 && src != rank_ && t->peers[src] == engine::kInvalidPeer)
        throw CommError("mooncake pg: recv from rank " + std::to_string(src) + " (group " +
                            t->health->group() + "): it is not an active member",
                        src, "recv");
      // A specific source: only its death matters. Any source: any dead peer fails it.
      if (src != rank_) t->health->check(op, src);
      if (engine::Clock::now() >= op.deadline)
        t->health->timedOut(op, src, "no message with tag " + std::to_string(tag));
      g.lock();
    }
  }
  if (c.data.size() != bytes)
    throw CommError("mooncake pg: recv size mismatch on rank " + std::to_string(rank_) +
                        " (group " + table()->health->group() + "): rank " + std::to_string(c.src) +
                        " sent " + std::to_string(c.data.size()) + " bytes with tag " +
                        std::to_string(tag) + " but the receive buffer holds " +
                        std::to_string(bytes) + " bytes",
                    c.src, "recv");
  if (bytes > 0) std::memcpy(buf, c.data.data(), bytes);
  return c.src;
}

}  // namespace mooncake::pg
