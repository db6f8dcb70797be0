#include "pg/p2p_device.h"

#include <cstring>

#include "engine/device/device.h"
#include "engine/log.h"
#include "pg/communicator.h"
#include "pg/device_stage.h"

namespace mooncake::pg {

namespace {

constexpr size_t kMinBuf = size_t{64} << 10;

// A descriptor: token, offset of the buffer in the exported allocation, handle.
struct DescHead {
  uint64_t token;
  uint64_t offset;
  uint32_t handle_len;
};

size_t bufSize(size_t bytes) {
  size_t cap = kMinBuf;
  while (cap < bytes) cap <<= 1;
  return cap;
}

}  // namespace

DeviceOutbox::~DeviceOutbox() {
  if (all_.empty()) return;
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  for (auto& b : all_) (void)(*layer)->free(b->p);
}

std::optional<std::string> DeviceOutbox::stage(const void* src, size_t bytes,
                                               engine::PeerId peer, const char* op) {
  auto layer = engine::device::get();
  if (!layer.ok()) return std::nullopt;
  const engine::device::PointerInfo pi = (*layer)->pointer(src);
  if (!pi.device) return std::nullopt;
  const size_t cap = bufSize(bytes);
  Buf* b = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = idle_.find({pi.ordinal, cap});
    if (it != idle_.end()) {
      b = it->second;
      idle_.erase(it);
    } else if (bytes_ + cap <= kPoolBytes) {
      // A new buffer on the data's device, exported once.
      auto mem = (*layer)->allocate(cap, pi.ordinal);
      uint64_t offset = 0;
      Result<std::string> handle =
          mem.ok() ? (*layer)->exportIpc(*mem, &offset) : Result<std::string>(mem.status());
      if (!handle.ok()) {
        if (mem.ok()) (void)(*layer)->free(*mem);
        if (!warned_) {
          MC_LOG(WARN, PG) << op << ": no GPU staging buffer of " << cap << " bytes ("
                           << handle.status().toString()
                           << "): GPU messages go through host memory";
        }
        warned_ = true;
        return std::nullopt;
      }
      auto nb = std::make_unique<Buf>();
      nb->p = static_cast<char*>(*mem);
      nb->cap = cap;
      nb->ordinal = pi.ordinal;
      nb->handle = std::move(*handle);
      nb->offset = offset;
      b = nb.get();
      all_.push_back(std::move(nb));
      bytes_ += cap;
    } else {
      return std::nullopt;  // the pool is full of messages not yet received
    }
  }
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
  std::string desc(sizeof(DescHead) + b->handle.size(), '\0');
  std::lock_guard<std::mutex> g(mu_);
  const DescHead h{next_token_++, b->offset, static_cast<uint32_t>(b->handle.size())};
  std::memcpy(desc.data(), &h, sizeof(h));
  std::memcpy(desc.data() + sizeof(h), b->handle.data(), b->handle.size());
  out_[h.token] = {b, peer};
  return desc;
}

uint64_t DeviceOutbox::tokenOf(const std::string& desc) {
  DescHead h{};
  if (desc.size() >= sizeof(h)) std::memcpy(&h, desc.data(), sizeof(h));
  return h.token;
}

void DeviceOutbox::release(uint64_t token) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = out_.find(token);
  if (it == out_.end()) return;  // not ours (or given back twice)
  Buf* b = it->second.first;
  out_.erase(it);
  idle_.emplace(std::make_pair(b->ordinal, b->cap), b);
  cv_.notify_all();
}

void DeviceOutbox::drain(const std::function<bool(engine::PeerId)>& alive,
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

size_t DeviceOutbox::held() const {
  std::lock_guard<std::mutex> g(mu_);
  return out_.size();
}

DeviceInbox::~DeviceInbox() {
  if (opened_.empty()) return;
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  for (auto& [key, base] : opened_) (void)(*layer)->closeIpc(base);
}

void DeviceInbox::take(const std::string& desc, uint64_t sender, int src, void* dst,
                       size_t bytes, const char* op) {
  auto fail = [&](const std::string& why) {
    throw CommError("mooncake pg: " + std::string(op) + ": the GPU message from rank " +
                        std::to_string(src) + " could not be read: " + why,
                    src, op);
  };
  DescHead h{};
  if (desc.size() < sizeof(h)) fail("its descriptor is cut short");
  std::memcpy(&h, desc.data(), sizeof(h));
  if (desc.size() != sizeof(h) + h.handle_len) fail("its descriptor is malformed");
  std::string handle = desc.substr(sizeof(h));
  char* base = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto key = std::make_pair(sender, std::move(handle));
    auto it = opened_.find(key);
    if (it != opened_.end()) {
      base = it->second;
    } else {
      auto layer = engine::device::get();
      if (!layer.ok()) fail(layer.status().toString());
      auto opened = (*layer)->openIpc(key.second);
      if (!opened.ok()) fail("opening its staging buffer: " + opened.status().toString());
      engine::device::noteUse();
      base = static_cast<char*>(*opened);
      opened_.emplace(std::move(key), base);
    }
  }
  if (bytes == 0) return;
  const char* from = base + h.offset;
  DeviceCopies cp(op);
  if (DeviceStage::any({dst})) {
    cp.add(dst, from, bytes);
    cp.wait();
    return;
  }
  DeviceStage st(op, bytes);  // host memory: through a pinned buffer, as a staged recv
  cp.add(st.host(), from, bytes);
  cp.wait();
  std::memcpy(dst, st.host(), bytes);
}

}  // namespace mooncake::pg
