#include "pg/p2p_stage.h"

#include <cstring>
#include <tuple>

#include "engine/device/device.h"
#include "engine/log.h"
#include "pg/communicator.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg {

namespace {

constexpr size_t kMinBuf = size_t{64} << 10;
// How long a send waits for a buffer to be given back when the pool is full.
constexpr int64_t kFullWaitMs = 100;
// Copies out of a staging buffer at least this large stream into the output (pg/copy.h).
constexpr size_t kStreamOut = size_t{256} << 10;

// A descriptor: this head, the handle, then (host buffers new to the receiver) the sender's
// segment descriptor.
struct DescHead {
  uint64_t token;
  uint64_t offset;  // of the buffer in what the handle names
  uint64_t cap;
  uint32_t device;
  uint32_t handle_len;
  uint32_t seg_len;
  uint32_t pad;
};

size_t bufSize(size_t bytes) {
  size_t cap = kMinBuf;
  while (cap < bytes) cap <<= 1;
  return cap;
}

}  // namespace

uint64_t stageToken(const std::string& desc) {
  DescHead h{};
  if (desc.size() >= sizeof(h)) std::memcpy(&h, desc.data(), sizeof(h));
  return h.token;
}

StageOutbox::StageOutbox(engine::TransferEngine* engine, bool device)
    : engine_(engine), device_(device) {}

StageOutbox::~StageOutbox() {
  if (all_.empty()) return;
  if (!device_) {
    for (auto& b : all_) (void)engine_->free(b->p);
    return;
  }
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  for (auto& b : all_) (void)(*layer)->free(b->p);
}

std::unique_ptr<StageOutbox::Buf> StageOutbox::make(size_t cap, int ordinal, const char* op) {
  auto b = std::make_unique<Buf>();
  b->cap = cap;
  b->ordinal = ordinal;
  Status st;
  if (device_) {
    auto layer = engine::device::get();
    auto mem = layer.ok() ? (*layer)->allocate(cap, ordinal) : Result<void*>(layer.status());
    Result<std::string> handle =
        mem.ok() ? (*layer)->exportIpc(*mem, &b->offset) : Result<std::string>(mem.status());
    if (handle.ok()) {
      b->p = static_cast<char*>(*mem);
      b->handle = std::move(*handle);
    } else {
      if (mem.ok()) (void)(*layer)->free(*mem);
      st = handle.status();
    }
  } else {
    auto mem = engine_->allocate(cap);
    if (mem.ok()) {
      b->p = static_cast<char*>(*mem);
      const uint64_t addr = reinterpret_cast<uint64_t>(b->p);
      b->handle.assign(reinterpret_cast<const char*>(&addr), sizeof(addr));
    } else {
      st = mem.status();
    }
  }
  if (st.ok()) return b;
  if (!warned_) {
    MC_LOG(WARN, PG) << op << ": no " << (device_ ? "GPU" : "host") << " staging buffer of "
                     << cap << " bytes (" << st.toString()
                     << "): messages go through the engine's messages";
  }
  warned_ = true;
  return nullptr;
}

std::optional<std::string> StageOutbox::stage(const void* src, size_t bytes,
                                              engine::PeerId peer, const char* op) {
  int ordinal = -1;
  if (device_) {
    auto layer = engine::device::get();
    if (!layer.ok()) return std::nullopt;
    const engine::device::PointerInfo pi = (*layer)->pointer(src);
    if (!pi.device) return std::nullopt;
    ordinal = pi.ordinal;
  }
  const size_t cap = bufSize(bytes);
  const std::pair<int, size_t> key{ordinal, cap};
  Buf* b = nullptr;
  {
    std::unique_lock<std::mutex> g(mu_);
    // Full of messages not yet received: wait a little for one to be given back (a sender
    // running ahead of its receiver), then go the other way.
    if (idle_.count(key) == 0 && bytes_ + cap > kPoolBytes)
      cv_.wait_for(g, std::chrono::milliseconds(kFullWaitMs), [&] { return idle_.count(key) > 0; });
    auto it = idle_.find(key);
    if (it != idle_.end()) {
      b = it->second;
      idle_.erase(it);
    } else {
      if (bytes_ + cap > kPoolBytes) return std::nullopt;
      std::unique_ptr<Buf> nb = make(cap, ordinal, op);
      if (nb == nullptr) return std::nullopt;
      b = nb.get();
      all_.push_back(std::move(nb));
      bytes_ += cap;
    }
  }
  if (device_) {
    DeviceCopies cp(op);
    try {
      cp.add(b->p, src, bytes);
      cp.wait();
    } catch (...) {
      cp.drain();
      std::lock_guard<std::mutex> g(mu_);
      idle_.emplace(std::make_pair(b->ordinal, b->cap), b);
      throw;
    }
    engine::device::noteUse();
  } else {
    copyToShared(b->p, src, bytes);  // fenced: the descriptor is sent after
  }
  std::lock_guard<std::mutex> g(mu_);
  std::string seg;
  if (!device_ && b->told.insert(peer).second) seg = engine_->localSegment().serialize();
  const DescHead h{next_token_++, b->offset, b->cap, device_ ? 1u : 0u,
                   static_cast<uint32_t>(b->handle.size()), static_cast<uint32_t>(seg.size()), 0};
  std::string desc(reinterpret_cast<const char*>(&h), sizeof(h));
  desc += b->handle;
  desc += seg;
  out_[h.token] = {b, peer};
  return desc;
}

void StageOutbox::release(uint64_t token) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = out_.find(token);
  if (it == out_.end()) return;  // not ours (or given back twice)
  Buf* b = it->second.first;
  out_.erase(it);
  idle_.emplace(std::make_pair(b->ordinal, b->cap), b);
  cv_.notify_all();
}

void StageOutbox::drain(const std::function<bool(engine::PeerId)>& alive,
                        engine::Deadline deadline) {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    bool waiting = false;
    for (const auto& [token, held] : out_)
      if (alive(held.second)) waiting = true;
    if (!waiting || engine::Clock::now() >= deadline) return;
    cv_.wait_for(g, std::chrono::milliseconds(10));
  }
}

size_t StageOutbox::held() const {
  std::lock_guard<std::mutex> g(mu_);
  return out_.size();
}

StageInbox::~StageInbox() {
  bool any_device = false;
  for (auto& [key, base] : opened_) any_device = any_device || std::get<1>(key);
  if (!any_device) return;
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  for (auto& [key, base] : opened_)
    if (std::get<1>(key)) (void)(*layer)->closeIpc(base);
}

void StageInbox::take(const std::string& desc, uint64_t sender, engine::PeerId peer, int src,
                      void* dst, size_t bytes, const char* op) {
  auto fail = [&](const std::string& why) {
    throw CommError("mooncake pg: " + std::string(op) + ": the message from rank " +
                        std::to_string(src) + " could not be read: " + why,
                    src, op);
  };
  DescHead h{};
  if (desc.size() < sizeof(h)) fail("its descriptor is cut short");
  std::memcpy(&h, desc.data(), sizeof(h));
  if (desc.size() != sizeof(h) + h.handle_len + h.seg_len || bytes > h.cap)
    fail("its descriptor is malformed");
  const bool device = h.device != 0;
  char* base = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto key = std::make_tuple(sender, device, desc.substr(sizeof(h), h.handle_len));
    auto it = opened_.find(key);
    if (it != opened_.end()) {
      base = it->second;
    } else if (device) {
      auto layer = engine::device::get();
      if (!layer.ok()) fail(layer.status().toString());
      auto opened = (*layer)->openIpc(std::get<2>(key));
      if (!opened.ok()) fail("opening its GPU staging buffer: " + opened.status().toString());
      engine::device::noteUse();
      base = static_cast<char*>(*opened) + h.offset;
      opened_.emplace(std::move(key), base);
    } else {
      uint64_t addr = 0;
      if (std::get<2>(key).size() != sizeof(addr)) fail("its descriptor is malformed");
      std::memcpy(&addr, std::get<2>(key).data(), sizeof(addr));
      void* p = engine_->mappedAddress(peer, addr, h.cap);
      if (p == nullptr && h.seg_len > 0) {
        // A buffer this engine's view of the sender predates: the descriptor sent with it is
        // newer than that view (the buffer was made before it), so taking it loses nothing.
        auto seg = engine::SegmentDesc::parse(
            std::string_view(desc).substr(sizeof(h) + h.handle_len, h.seg_len));
        Status st = seg.ok() ? engine_->updatePeer(peer, *seg) : seg.status();
        if (!st.ok()) fail("updating its segment: " + st.toString());
        p = engine_->mappedAddress(peer, addr, h.cap);
      }
      if (p == nullptr) fail("its staging buffer is not mapped here");
      base = static_cast<char*>(p);
      opened_.emplace(std::move(key), base);
    }
  }
  if (bytes == 0) return;
  const bool dst_gpu = DeviceStage::any({dst});
  if (!device && !dst_gpu) {
    copyOut(dst, base, bytes, bytes >= kStreamOut);
    if (bytes >= kStreamOut) streamFence();
    return;
  }
  DeviceCopies cp(op);
  if (dst_gpu && device) {
    cp.add(dst, base, bytes);
    cp.wait();
    return;
  }
  // Between kinds: through a pinned buffer.
  DeviceStage st(op, bytes);
  if (device) {
    cp.add(st.host(), base, bytes);
    cp.wait();
    std::memcpy(dst, st.host(), bytes);
  } else {
    copyFromShared(st.host(), base, bytes);
    st.out(dst, bytes);
  }
}

}  // namespace mooncake::pg
