// See device_staging.h. One worker thread per staging peer (started by its first task) moves
// its tasks in order, each in pieces of kStageBytes through one host buffer (allocated then): a
// write copies a piece out of GPU memory and sends it, a read receives a piece and copies it
// into GPU memory. Simple, not pipelined. Host memory here (the peer's GPU memory on the
// other side) goes over the host transport as it is; tcp stages it at the target.
//
// A task whose caller gave up (TransportPeer::fenceAbandoned): the worker touches the task's
// local memory only under touch_mu_ and after checking Task::abandoned there, so once the fence
// took touch_mu_ no copy into or out of it starts (the pieces still moving go through stage_,
// which is this peer's). Host memory here, which the host transport moves itself, is fenced by
// that transport: its piece carries the task's abandoned flag and the fence fences it too.
#include "engine/device_staging.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mooncake::engine {

namespace {

constexpr uint64_t kStageBytes = 4u << 20;

class StagingPeer final : public TransportPeer {
 public:
  StagingPeer(TransportPeer* host, TransportKind host_kind, TransportPeer* gpu_host,
              device::Device* dev, EngineContext* ctx, SegmentDesc remote)
      : host_(host),
        host_kind_(host_kind),
        gpu_host_(host_kind == TransportKind::kTcp ? host : gpu_host),
        dev_(dev),
        ctx_(ctx),
        remote_(std::move(remote)) {}

  ~StagingPeer() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
      if (fail_.ok()) fail_ = MC_STATUS(kCancelled, "staging: peer " << remote_.name << " closed");
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  void submit(Task* t) override {
    if (t->length == 0) return t->done(Status::OK());
    std::unique_lock<std::mutex> g(mu_);
    const RegionDesc* r = remote_.findRegion(t->remote, t->length);
    if (r != nullptr && r->kind == MemoryKind::kCuda && gpu_host_ == nullptr) {
      g.unlock();
      return t->done(MC_STATUS(kNotSupported,
                               "the GPU memory of peer " << remote_.name << " is reached over "
                                   << transportName(host_kind_) << ", which does not stage it at "
                                   << "the peer (tcp does; rdma and cuda reach it directly)"));
    }
    q_.push_back(t);
    ++pending_;
    // Made on first use: every peer over tcp gets a staging peer where a device layer exists.
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    g.unlock();
    cv_.notify_all();
  }
  Status notify(uint32_t, uint64_t) override {
    return MC_STATUS(kInternal, "staging: notifications go over the peer's host transport");
  }
  Status sendMessage(uint32_t, std::string_view) override {
    return MC_STATUS(kInternal, "staging: messages go over the peer's host transport");
  }
  Status updateRemote(const SegmentDesc& remote) override {
    std::lock_guard<std::mutex> g(mu_);
    remote_ = remote;
    return Status::OK();
  }
  void fail(const Status& why) override {
    std::lock_guard<std::mutex> g(mu_);
    if (fail_.ok()) fail_ = why;
  }
  void fenceAbandoned() override {
    { std::lock_guard<std::mutex> g(touch_mu_); }  // a copy or submit under way ends first
    if (host_ != nullptr) host_->fenceAbandoned();
    if (gpu_host_ != nullptr && gpu_host_ != host_) gpu_host_->fenceAbandoned();
  }
  Status quiesce(Deadline deadline) override {
    std::unique_lock<std::mutex> g(mu_);
    if (idle_cv_.wait_until(g, deadline, [&] { return pending_ == 0; })) return Status::OK();
    return MC_STATUS(kTimeout, "staging: transfers to " << remote_.name
                                                        << " not done by the deadline");
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [&] { return stopping_ || !q_.empty(); });
      if (q_.empty()) return;
      Task* t = q_.front();
      q_.pop_front();
      Status failed = fail_;
      g.unlock();
      Status st = failed.ok() ? move(t) : failed;
      g.lock();
      --pending_;  // the bytes moved (or never will) before the task completes
      idle_cv_.notify_all();
      g.unlock();
      t->done(std::move(st));
      g.lock();
    }
  }

  // The GPU the local side is on (for the copies), or -1 when it is host memory (always,
  // in a process without a device layer).
  int gpuOf(const void* p, uint64_t len) const {
    if (dev_ == nullptr) return -1;
    auto region = ctx_->registry->find(reinterpret_cast<uint64_t>(p), len);
    if (region.has_value() && region->kind == MemoryKind::kCuda)
      return std::max(region->device, 0);
    device::PointerInfo info = dev_->pointer(p);
    return info.device ? std::max(info.ordinal, 0) : -1;
  }

  // What a task whose caller gave up completes with (its batch already timed out).
  static Status gaveUp(const Task* t) {
    return MC_STATUS(kTimeout, "staging: the caller gave up waiting for this "
                                   << (t->op == OpCode::kWrite ? "write" : "read")
                                   << "; its remaining bytes were not moved");
  }

  // A copy between t's local memory and stage_ (fenced: see the top of the file).
  Status copyWait(const Task* t, void* dst, const void* src, uint64_t n, int gpu) {
    std::lock_guard<std::mutex> g(touch_mu_);
    if (t->isAbandoned()) return gaveUp(t);
    return device::transferCopy(dev_, dst, src, n, gpu, deadlineInMs(60000));
  }

  // One piece over `via` (a host transport), waited for (every task completes exactly once).
  // of: the task when `local` is its memory (the piece is fenced as it is), else null (stage_).
  Status hostOp(const Task* of, TransportPeer* via, OpCode op, char* local, uint64_t n,
                uint64_t remote) {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    Status out;
    Task s;
    s.op = op;
    s.local = local;
    s.length = n;
    s.remote = remote;
    s.on_done = [&](Status x) {
      std::lock_guard<std::mutex> g(m);
      out = std::move(x);
      done = true;
      cv.notify_all();
    };
    if (of != nullptr) {
      std::lock_guard<std::mutex> touch(touch_mu_);
      if (of->isAbandoned()) return gaveUp(of);
      s.abandoned = of->abandoned;  // the host transport's fence covers it (fenceAbandoned)
      via->submit(&s);
    } else {
      via->submit(&s);
    }
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [&] { return done; });
    return out;
  }

  Status move(Task* t) {
    const int gpu = gpuOf(t->local, t->length);
    char* local = static_cast<char*>(t->local);
    // The peer's GPU memory goes where the target stages it: tcp (the peer's data transport,
    // or else the engine's tcp control connection to it).
    TransportPeer* via = host_;
    {
      std::lock_guard<std::mutex> g(mu_);
      const RegionDesc* r = remote_.findRegion(t->remote, t->length);
      if (r != nullptr && r->kind == MemoryKind::kCuda) via = gpu_host_;
    }
    if (via == nullptr) return MC_STATUS(kUnavailable, "staging: peer's GPU memory unreachable");
    // Host memory here (the peer's GPU memory is the reason this came here): as it is; the
    // target stages it.
    if (gpu < 0) return hostOp(t, via, t->op, local, t->length, t->remote);
    if (stage_.empty()) {  // only the worker touches it
      stage_.resize(kStageBytes);
      stage_pin_ = device::PinnedRange(dev_, stage_.data(), stage_.size());
    }
    for (uint64_t off = 0; off < t->length; off += kStageBytes) {
      const uint64_t n = std::min(kStageBytes, t->length - off);
      if (t->op == OpCode::kWrite) {
        MC_RETURN_IF_ERROR(copyWait(t, stage_.data(), local + off, n, gpu));
        MC_RETURN_IF_ERROR(
            hostOp(nullptr, via, OpCode::kWrite, stage_.data(), n, t->remote + off));
      } else {
        MC_RETURN_IF_ERROR(
            hostOp(nullptr, via, OpCode::kRead, stage_.data(), n, t->remote + off));
        MC_RETURN_IF_ERROR(copyWait(t, local + off, stage_.data(), n, gpu));
      }
    }
    return Status::OK();
  }

  TransportPeer* host_;
  TransportKind host_kind_;
  TransportPeer* gpu_host_;  // what moves bytes into and out of the peer's GPU memory (tcp)
  device::Device* dev_;      // null in a process without a device layer
  EngineContext* ctx_;
  std::mutex mu_;
  std::mutex touch_mu_;  // held while the worker touches a task's local memory (the fence)
  std::condition_variable cv_, idle_cv_;
  SegmentDesc remote_;
  Status fail_;
  std::deque<Task*> q_;
  int64_t pending_ = 0;
  bool stopping_ = false;
  std::vector<char> stage_;
  device::PinnedRange stage_pin_;  // stage_, pinned for the device layer's copies
  std::thread worker_;
};

}  // namespace

std::unique_ptr<TransportPeer> makeStagingPeer(TransportPeer* host, TransportKind host_kind,
                                               TransportPeer* gpu_host, device::Device* dev,
                                               EngineContext* ctx, const SegmentDesc& remote) {
  return std::unique_ptr<TransportPeer>(
      new StagingPeer(host, host_kind, gpu_host, dev, ctx, remote));
}

}  // namespace mooncake::engine
