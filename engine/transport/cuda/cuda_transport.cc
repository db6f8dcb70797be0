// cuda transport: GPU memory of same-host peers (DESIGN.md section 3), over the device layer
// (engine/device/device.h: the CUDA driver, or its host simulation in tests).
//
// - A GPU region (MemoryKind::kCuda) gets an IPC handle as its key when it is registered:
//   "<handle hex>:<offset of the region in the handle's allocation>".
// - A peer opens a handle once (cached per handle, so two regions of one allocation share the
//   mapping) and copies with the device layer's copy stream of the GPU involved (the copy
//   engines); a task completes when the event recorded after its copy does.
// - The other side of a copy may be host memory: here any (the copy engines read pageable
//   memory too), at the peer only the regions the engine allocated (shared-memory files,
//   mapped once): other host memory of a peer has nothing a copy could address. Host memory
//   the engine knows is pinned for the devices (Device::pinHost) on its first copy: a peer's
//   region when it is mapped, a region registered here (the whole region, until it is
//   unregistered). Only unregistered host memory here is copied pageable (the driver then
//   bounces it through a staging buffer of its own).
// - Only requests with GPU memory on a side come here: the engine sends host<->host requests,
//   notifications and messages to the peer's host transport (shm), and before a notification
//   waits until this peer's copies are done (quiesce), so that it still follows them.
// Every access is checked against the peer's descriptor, as shm does: only the regions it
// exported can be mapped.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/transport/transport.h"

namespace mooncake::engine {

namespace {

std::string toHex(const std::string& s) {
  static const char* k = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) {
    out += k[c >> 4];
    out += k[c & 15];
  }
  return out;
}

bool fromHex(const std::string& h, std::string* out) {
  if (h.size() % 2 != 0) return false;
  out->clear();
  for (size_t i = 0; i < h.size(); i += 2) {
    int v = 0;
    for (size_t j = i; j < i + 2; ++j) {
      char c = h[j];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    out->push_back(static_cast<char>(v));
  }
  return true;
}

class CudaTransport;

// What a peer's quiesce() waits on: its copies in flight (shared: the completer may still
// count a copy down after the peer is gone).
struct InFlight {
  std::mutex mu;
  std::condition_variable cv;
  int64_t n = 0;
  void add() {
    std::lock_guard<std::mutex> g(mu);
    ++n;
  }
  void done() {
    std::lock_guard<std::mutex> g(mu);
    if (--n == 0) cv.notify_all();
  }
};

// A copy in flight: the task completes once `event` does.
struct Flight {
  std::unique_ptr<device::Event> event;
  Task* task;
  std::shared_ptr<InFlight> peer;
};

class CudaPeer final : public TransportPeer {
 public:
  CudaPeer(CudaTransport* t, device::Device* dev, EngineContext* ctx, SegmentDesc remote)
      : t_(t), dev_(dev), ctx_(ctx), remote_(std::move(remote)) {}
  ~CudaPeer() override;

  void submit(Task* task) override;
  Status notify(uint32_t, uint64_t) override {
    return MC_STATUS(kInternal, "cuda: notifications go over the peer's host transport");
  }
  Status sendMessage(uint32_t, std::string_view) override {
    return MC_STATUS(kInternal, "cuda: messages go over the peer's host transport");
  }
  Status updateRemote(const SegmentDesc& remote) override {
    std::lock_guard<std::mutex> g(mu_);
    remote_ = remote;  // what was opened stays open until the peer is closed
    return Status::OK();
  }
  void fail(const Status& why) override {
    std::lock_guard<std::mutex> g(mu_);
    if (fail_.ok()) fail_ = why;
  }
  Status quiesce(Deadline deadline) override {
    std::unique_lock<std::mutex> g(flight_->mu);
    if (flight_->cv.wait_until(g, deadline, [&] { return flight_->n == 0; })) return Status::OK();
    return MC_STATUS(kTimeout, "cuda: copies to " << remote_.name << " not done by the deadline");
  }

 private:
  struct Opened {
    char* base = nullptr;
    uint64_t len = 0;
    bool ipc = false;  // else a mapped shm file
    device::PinnedRange pin;  // a mapped shm file, pinned while mapped
  };
  // A pointer here for [remote, remote+len) of the peer, and the GPU it is on (-1: host).
  Result<char*> resolve(uint64_t remote, uint64_t len, int* gpu);

  CudaTransport* t_;
  device::Device* dev_;
  EngineContext* ctx_;
  std::mutex mu_;
  SegmentDesc remote_;
  Status fail_;
  std::map<std::string, Opened> opened_;  // by IPC handle or shm name
  std::shared_ptr<InFlight> flight_ = std::make_shared<InFlight>();
  friend class CudaTransport;
};

class CudaTransport final : public Transport {
 public:
  TransportKind kind() const override { return TransportKind::kCuda; }

  Status start(EngineContext* ctx) override {
    ctx_ = ctx;
    auto dev = device::get();
    if (!dev.ok()) return dev.status();  // the engine goes on without it
    dev_ = *dev;
    completer_ = std::thread([this] { completeLoop(); });
    return Status::OK();
  }

  void fillLocalSegment(SegmentDesc* desc) override {
    if (dev_ == nullptr) return;
    desc->transports |= 1u << static_cast<int>(TransportKind::kCuda);
    desc->endpoints[static_cast<int>(TransportKind::kCuda)] = dev_->name();
  }

  Status registerRegion(Region* region) override {
    if (dev_ == nullptr || region->kind != MemoryKind::kCuda) return Status::OK();
    uint64_t off = 0;
    auto h = dev_->exportIpc(reinterpret_cast<void*>(region->addr), &off);
    if (!h.ok()) {
      // Peers on this host then get an error naming the region; rdma may still reach it.
      MC_LOG(WARN, ENGINE) << "cuda: no IPC handle for GPU memory at " << region->addr << ": "
                           << h.status().message();
      return Status::OK();
    }
    region->keys[static_cast<int>(TransportKind::kCuda)] = toHex(*h) + ":" + std::to_string(off);
    return Status::OK();
  }

  bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const override {
    const int k = static_cast<int>(TransportKind::kCuda);
    return dev_ != nullptr && remote.offers(TransportKind::kCuda) && !remote.host_id.empty() &&
           remote.host_id == local.host_id && remote.endpoints[k] == local.endpoints[k];
  }

  Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote, Deadline, bool,
                                                 std::shared_ptr<ControlLink>) override {
    if (dev_ == nullptr) return MC_STATUS(kUnavailable, "cuda: no device layer here");
    return std::unique_ptr<TransportPeer>(new CudaPeer(this, dev_, ctx_, remote));
  }

  void unregisterRegion(const Region& region) override {
    device::PinnedRange unpin;  // released outside the lock
    std::lock_guard<std::mutex> g(pin_mu_);
    auto it = pinned_.find(region.addr);
    if (it == pinned_.end()) return;
    unpin = std::move(it->second);
    pinned_.erase(it);
  }

  // A host region registered here, pinned on its first copy to or from GPU memory.
  void pinLocal(const Region& r) {
    std::lock_guard<std::mutex> g(pin_mu_);
    if (pinned_.count(r.addr) != 0) return;
    pinned_.emplace(r.addr, device::PinnedRange(dev_, reinterpret_cast<void*>(r.addr), r.len));
  }

  bool reachesDeviceMemory() const override { return true; }
  bool movesHostMemory() const override { return false; }

  void stop() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (completer_.joinable()) completer_.join();
  }

  void push(Flight f) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_all();
  }

 private:
  // Completes tasks in the order their copies were queued (each waits for its event).
  void completeLoop() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [&] { return stopping_ || !q_.empty(); });
      if (q_.empty()) return;  // stopping, and everything queued is done
      Flight f = std::move(q_.front());
      q_.pop_front();
      g.unlock();
      Status st = f.event->wait(Clock::now() + std::chrono::seconds(60));
      // The bytes are there (quiesce may return), then the task completes (its batch, and the
      // peer once its last task is done, may go away inside done()).
      f.peer->done();
      f.task->done(st.ok() ? st : Status(st.code(), "cuda: " + st.message()));
      g.lock();
    }
  }

  EngineContext* ctx_ = nullptr;
  device::Device* dev_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Flight> q_;
  bool stopping_ = false;
  std::thread completer_;
  std::mutex pin_mu_;
  std::map<uint64_t, device::PinnedRange> pinned_;  // by region start (pinLocal)
};

CudaPeer::~CudaPeer() {
  (void)quiesce(Clock::now() + std::chrono::seconds(60));
  for (auto& [key, o] : opened_) {
    if (o.ipc) {
      (void)dev_->closeIpc(o.base);
    } else {
      o.pin = device::PinnedRange();  // unpinned before it is unmapped
      unmapShm(o.base, o.len);
    }
  }
}

Result<char*> CudaPeer::resolve(uint64_t remote, uint64_t len, int* gpu) {
  const RegionDesc* r = remote_.findRegion(remote, len);
  if (r == nullptr)
    return MC_STATUS(kPermissionDenied, "cuda: [0x" << std::hex << remote << ", +" << std::dec
                                                    << len << ") is not inside a region peer "
                                                    << remote_.name << " registered");
  const uint64_t in_region = remote - r->addr;
  if (r->kind == MemoryKind::kCuda) {
    const std::string& key = r->keys[static_cast<int>(TransportKind::kCuda)];
    const size_t colon = key.rfind(':');
    std::string handle;
    if (colon == std::string::npos || !fromHex(key.substr(0, colon), &handle))
      return MC_STATUS(kNotSupported, "cuda: GPU region of peer " << remote_.name
                                                                  << " has no IPC handle");
    const uint64_t off = std::strtoull(key.c_str() + colon + 1, nullptr, 10);
    auto it = opened_.find(handle);
    if (it == opened_.end()) {
      auto base = dev_->openIpc(handle);
      if (!base.ok())
        return Status(base.status().code(), "cuda: GPU memory of peer " + remote_.name + ": " +
                                                base.status().message());
      device::noteUse();
      it = opened_.emplace(handle, Opened{static_cast<char*>(*base), 0, true, {}}).first;
    }
    *gpu = r->device;
    return it->second.base + off + in_region;
  }
  if (r->shm_name.empty())
    return MC_STATUS(kNotSupported, "cuda: host memory of peer " << remote_.name << " at 0x"
                                        << std::hex << remote << std::dec
                                        << " was registered, not allocated by its engine: "
                                           "GPU memory cannot be copied to or from it");
  auto it = opened_.find(r->shm_name);
  if (it == opened_.end()) {
    void* p = mapShm(r->shm_name, r->len);
    if (p == nullptr)
      return MC_STATUS(kUnavailable, "cuda: cannot map " << r->shm_name << " of peer "
                                                         << remote_.name);
    it = opened_.emplace(r->shm_name, Opened{static_cast<char*>(p), r->len, false,
                                             device::PinnedRange(dev_, p, r->len)})
             .first;
  }
  *gpu = -1;
  return it->second.base + in_region;
}

void CudaPeer::submit(Task* task) {
  if (task->length == 0) return task->done(Status::OK());
  char* there = nullptr;
  int gpu = -1;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!fail_.ok()) return task->done(fail_);
    auto p = resolve(task->remote, task->length, &gpu);
    if (!p.ok()) return task->done(p.status());
    there = *p;
  }
  // The copy runs on the stream of the GPU here when the local side is GPU memory, else on
  // the stream of the peer's GPU (mapped here).
  auto local = ctx_->registry->find(reinterpret_cast<uint64_t>(task->local), task->length);
  if (local.has_value() && local->kind == MemoryKind::kCuda) gpu = local->device;
  if (local.has_value() && local->kind == MemoryKind::kHost) t_->pinLocal(*local);
  if (gpu < 0 || gpu >= dev_->count()) gpu = 0;
  char* here = static_cast<char*>(task->local);
  Status st = task->op == OpCode::kWrite ? dev_->copyAsync(there, here, task->length, gpu)
                                         : dev_->copyAsync(here, there, task->length, gpu);
  auto ev = st.ok() ? dev_->record(gpu) : Result<std::unique_ptr<device::Event>>(st);
  if (!ev.ok()) return task->done(Status(ev.status().code(), "cuda: " + ev.status().message()));
  flight_->add();
  t_->push(Flight{std::move(ev).value(), task, flight_});
}

}  // namespace

std::unique_ptr<Transport> makeCudaTransport(const TransportOptions&) {
  return std::unique_ptr<Transport>(new CudaTransport());
}

}  // namespace mooncake::engine
