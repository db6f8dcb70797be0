#include "pg/device_stage.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/device/device.h"
#include "engine/log.h"
#include "pg/communicator.h"
#include "pg/device_reduce.h"
#include "pg/health.h"
#include "pg/profile.h"
#include "pg/shm_group.h"

namespace mooncake::pg {

namespace {
constexpr int64_t kCopyMs = 60000;

void copyOrThrow(void* dst, const void* src, size_t n, const char* op, const char* what) {
  Status st = engine::device::copyAny(dst, src, n, engine::deadlineInMs(kCopyMs));
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op + ": copying " + std::to_string(n) +
                        " bytes " + what + " GPU memory failed: " + st.toString(),
                    -1, op);
}
}  // namespace

// A staging buffer: its memory and, where the device layer could, its pin.
struct DeviceStage::Buffer {
  std::unique_ptr<char[]> mem;
  size_t cap = 0;
  engine::device::PinnedRange pin;
};

namespace {

constexpr size_t kMinStage = 64u << 10;      // smallest pooled size
constexpr size_t kMaxPooled = 256u << 20;    // larger: per call, pageable
constexpr size_t kIdlePerSize = 2;           // idle buffers kept per size
constexpr size_t kIdleBytes = 512u << 20;    // and in all

// Idle staging buffers by size (a power of two), kept for the process's life.
struct StagePool {
  std::mutex mu;
  std::map<size_t, std::vector<std::unique_ptr<DeviceStage::Buffer>>> idle;
  size_t idle_bytes = 0;
};
StagePool& stagePool() {
  static StagePool* p = new StagePool();  // never destroyed (used until the process ends)
  return *p;
}

size_t stageSize(size_t bytes) {
  size_t cap = kMinStage;
  while (cap < bytes) cap <<= 1;
  return cap;
}

}  // namespace

DeviceStage::DeviceStage(const char* op, size_t bytes) : op_(op) {
  const bool pooled = bytes <= kMaxPooled;
  const size_t cap = pooled ? stageSize(bytes) : bytes;
  if (pooled) {
    StagePool& p = stagePool();
    std::lock_guard<std::mutex> g(p.mu);
    auto it = p.idle.find(cap);
    if (it != p.idle.end() && !it->second.empty()) {
      buf_ = std::move(it->second.back());
      it->second.pop_back();
      p.idle_bytes -= cap;
      return;
    }
  }
  buf_ = std::make_unique<Buffer>();
  buf_->mem.reset(new char[cap]);
  buf_->cap = cap;
  if (pooled) {
    auto layer = engine::device::get();
    if (layer.ok()) buf_->pin = engine::device::PinnedRange(*layer, buf_->mem.get(), cap);
  }
}

DeviceStage::~DeviceStage() {
  if (!buf_ || buf_->cap > kMaxPooled) return;
  StagePool& p = stagePool();
  std::lock_guard<std::mutex> g(p.mu);
  auto& list = p.idle[buf_->cap];
  if (list.size() >= kIdlePerSize || p.idle_bytes + buf_->cap > kIdleBytes) return;
  p.idle_bytes += buf_->cap;
  list.push_back(std::move(buf_));
}

char* DeviceStage::host() { return buf_->mem.get(); }

bool DeviceStage::any(std::initializer_list<const void*> ps) {
  if (!engine::device::active()) return false;
  for (const void* p : ps)
    if (p != nullptr && engine::device::isDeviceMemory(p)) return true;
  return false;
}

void DeviceStage::in(const void* src, size_t n, size_t at) {
  copyOrThrow(host() + at, src, n, op_, "out of");
}

void DeviceStage::out(void* dst, size_t n, size_t at) {
  copyOrThrow(dst, host() + at, n, op_, "into");
}

void DeviceCopies::add(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  profile::Scope timed(profile::kDeviceQueue);
  auto layer = engine::device::get();
  Status st = layer.status();
  if (st.ok()) {
    if (ordinal_ < 0) {
      engine::device::PointerInfo a = (*layer)->pointer(dst), b = (*layer)->pointer(src);
      ordinal_ = a.device ? a.ordinal : b.device ? b.ordinal : 0;
    }
    st = (*layer)->copyAsync(dst, src, n, ordinal_);
  }
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op_ + ": queueing a copy of " +
                        std::to_string(n) + " bytes of GPU memory failed: " + st.toString(),
                    -1, op_);
  pending_ = true;
}

bool DeviceCopies::reduce(void* dst, void* dst2, const void* const* srcs, int n, size_t count,
                          DataType t, ReduceOp op) {
  profile::Scope timed(profile::kDeviceQueue);
  auto layer = engine::device::get();
  if (!layer.ok()) return false;
  if (ordinal_ < 0) {
    engine::device::PointerInfo a = (*layer)->pointer(dst != nullptr ? dst : dst2);
    if (!a.device) return false;
    ordinal_ = a.ordinal;
  }
  // Every pointer must be reachable by a kernel on this device (another GPU's memory only
  // with peer access): else the caller reduces on the CPU.
  for (const void* p : {static_cast<const void*>(dst), static_cast<const void*>(dst2)})
    if (p != nullptr && !(*layer)->canAccess(ordinal_, p)) return false;
  for (int j = 0; j < n; ++j)
    if (!(*layer)->canAccess(ordinal_, srcs[j])) return false;
  if (!deviceReduceAsync(dst, dst2, srcs, n, count, t, op, ordinal_, op_)) return false;
  pending_ = true;
  return true;
}

void DeviceCopies::drain() noexcept {
  if (!pending_) return;
  pending_ = false;
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  auto ev = (*layer)->record(ordinal_);
  if (ev.ok()) (void)(*ev)->wait(engine::deadlineInMs(kCopyMs));
}

void DeviceCopies::wait() {
  if (!pending_) return;
  pending_ = false;
  profile::Scope timed(profile::kDeviceWait);
  auto layer = engine::device::get();
  Status st = layer.status();
  if (st.ok()) {
    auto ev = (*layer)->record(ordinal_);
    st = ev.ok() ? (*ev)->wait(engine::deadlineInMs(kCopyMs)) : ev.status();
  }
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op_ + ": copying GPU memory failed: " +
                        st.toString(),
                    -1, op_);
}

DeviceHalves::DeviceHalves(ShmGroup& g, bool enabled)
    : g_(g), own_failed_(!enabled), opened_(g.size(), nullptr), opened_base_(g.size(), nullptr) {}

DeviceHalves::~DeviceHalves() {
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  for (void* b : opened_base_)
    if (b != nullptr) (void)(*layer)->closeIpc(b);
  if (own_ != nullptr) (void)(*layer)->free(own_);
}

char* DeviceHalves::writeTarget(uint64_t s, const void* src) {
  ShmGroup::DeviceHalfInfo& mine = g_.deviceHalfInfo(g_.rank());
  const int h = static_cast<int>(s & 1);
  auto layer = engine::device::get();
  engine::device::PointerInfo pi;
  if (layer.ok()) pi = (*layer)->pointer(src);
  if (pi.device && own_ == nullptr && !own_failed_) {
    // First GPU data: allocate both halves on its device and publish their IPC handle.
    const size_t len = 2 * g_.halfBytes();
    auto mem = (*layer)->allocate(len, pi.ordinal);
    uint64_t offset = 0;
    Result<std::string> handle = mem.ok() ? (*layer)->exportIpc(*mem, &offset)
                                          : Result<std::string>(mem.status());
    if (handle.ok() && handle->size() <= sizeof(mine.handle)) {
      own_ = static_cast<char*>(*mem);
      engine::device::noteUse();
      std::memcpy(mine.handle, handle->data(), handle->size());
      mine.handle_len = static_cast<uint32_t>(handle->size());
      mine.offset = offset;
      mine.ready.store(1, std::memory_order_release);
    } else {
      own_failed_ = true;
      if (mem.ok()) (void)(*layer)->free(*mem);
      MC_LOG(WARN, PG) << "GPU comm halves unavailable ("
                       << (handle.ok() ? std::string("IPC handle too long")
                                       : handle.status().toString())
                       << "): GPU data goes through host memory";
    }
  }
  const bool device = pi.device && own_ != nullptr;
  g_.setGpuHalf(s, device);
  if (!device) return g_.half(g_.rank(), s);
  ++device_steps_;
  return own_ + h * g_.halfBytes();
}

const char* DeviceHalves::peerHalf(const OpCtx& op, int r, uint64_t s) {
  const ShmGroup::DeviceHalfInfo& info = g_.deviceHalfInfo(r);
  const int h = static_cast<int>(s & 1);
  if (opened_[r] == nullptr) {
    auto fail = [&](const std::string& why) {
      throw CommError("mooncake pg: " + std::string(op.name) + ": opening rank " +
                          std::to_string(r) + "'s GPU comm halves failed: " + why,
                      r, op.name);
    };
    if (info.ready.load(std::memory_order_acquire) == 0 ||
        info.handle_len > sizeof(info.handle))
      fail("it published no handle");
    auto layer = engine::device::get();
    if (!layer.ok()) fail(layer.status().toString());
    auto base = (*layer)->openIpc(std::string(info.handle, info.handle_len));
    if (!base.ok()) fail(base.status().toString());
    engine::device::noteUse();
    opened_base_[r] = *base;
    opened_[r] = static_cast<char*>(*base) + info.offset;
  }
  return opened_[r] + h * g_.halfBytes();
}

}  // namespace mooncake::pg
