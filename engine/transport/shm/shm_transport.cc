// shm transport: same-host peers. Regions the engine allocated are shared-memory files that
// a peer maps once and then reaches with plain loads/stores/memcpy; other registered host
// memory is reached with process_vm_readv/writev (a fallback: ~1-1.6 GB/s here against
// ~6 GB/s for memcpy). Notifications and messages go straight into the peer's inbox.
//
// Every access is checked against the peer's exported descriptor: the only memory of the
// peer this process can map is the shm files it exported, so an address outside them
// cannot be reached by construction. process_vm copies reach any of the peer's memory, so
// they also pass the peer's fence (shm_fence.h): only a region it has registered now is
// copied into or out of, and its unregistration waits for the copies running.
//
// Cold pages go through the file, not the mapping. The first load or store through a fresh
// mapping of a page costs a page fault in this process; on the VM we measure on (shadow
// paging) that is ~14 us per 4 KiB page, and it slows the other processes' system calls while
// it lasts: a one-sided write of 64 KiB into memory this process never touched cost ~230 us,
// against ~15 us with pwrite on the shm file (the kernel copies through its own mapping) and
// ~4 us with memcpy through a mapping already faulted in. A store writer puts each object into
// memory it never wrote before, so every put met the fault. Each mapping made for copies
// therefore keeps a heat count per page: a copy over pages this process has not yet copied
// MC_SHM_WARM_AFTER times uses pread/pwrite on the file; a page copied that often (or handed
// out through mappedAddress, whose callers load and store directly) goes through the mapping.
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <set>
#include <string>
#include <vector>

#include "engine/log.h"
#include "engine/memory.h"
#include "engine/params.h"
#include "engine/transport/shm/shm_fence.h"
#include "engine/transport/transport.h"

namespace mooncake::engine {

namespace {

constexpr uint64_t kPage = 4096;
// process_vm copies pass the peer's fence in pieces of this size (~40 ms each at ~1.5 GB/s).
constexpr uint64_t kFencedPiece = 64ull << 20;

// Per page of a mapping: how often this process copied it through the file (0..warm_after-1),
// or kWarm once it goes through the mapping. Relaxed: a lost count only delays warming.
class PageHeat {
 public:
  static constexpr uint8_t kWarm = 255;
  explicit PageHeat(uint64_t len)
      : n_((len + kPage - 1) / kPage), h_(std::make_unique<std::atomic<uint8_t>[]>(n_)) {}

  bool warm(uint64_t page, int warm_after) const {
    return h_[page].load(std::memory_order_relaxed) >= warm_after;
  }
  // One copy of the page, through the mapping or through the file.
  void note(uint64_t page, bool mapped) {
    const uint8_t v = h_[page].load(std::memory_order_relaxed);
    if (mapped) {
      if (v != kWarm) h_[page].store(kWarm, std::memory_order_relaxed);
    } else if (v < kWarm - 1) {
      h_[page].store(static_cast<uint8_t>(v + 1), std::memory_order_relaxed);
    }
  }
  void warmRange(uint64_t off, uint64_t len) {
    if (len == 0) return;
    for (uint64_t p = off / kPage; p <= (off + len - 1) / kPage && p < n_; ++p) note(p, true);
  }

 private:
  uint64_t n_;
  std::unique_ptr<std::atomic<uint8_t>[]> h_;
};

class ShmPeer : public TransportPeer {
 public:
  ShmPeer(EngineContext* ctx, SegmentDesc remote, std::unique_ptr<Inbox> inbox,
          std::unique_ptr<ShmFence> fence)
      : ctx_(ctx),
        remote_(std::move(remote)),
        fence_(std::move(fence)),
        inbox_(std::move(inbox)),
        push_timeout_ms_(params::getInt("MC_CONNECT_TIMEOUT_MS")),
        warm_after_(static_cast<int>(
            std::clamp<int64_t>(params::getInt("MC_SHM_WARM_AFTER"), 0, PageHeat::kWarm - 1))) {}

  ~ShmPeer() override {
    for (auto& [addr, m] : maps_) release(&m);
    for (auto& m : retired_) release(&m);
  }

  void submit(Task* t) override { t->done(run(t)); }

  Status notify(uint32_t channel, uint64_t tag) override {
    MC_RETURN_IF_ERROR(failed());
    // Writes to this peer were completed (memcpy returned) before submit() returned; the
    // release store inside the inbox push orders them before the tag.
    return inbox_->pushNotify(ctx_->engine_id, channel, tag, deadlineInMs(push_timeout_ms_));
  }

  Status sendMessage(uint32_t channel, std::string_view payload) override {
    return sendMessage(channel, payload, deadlineInMs(push_timeout_ms_));
  }

  Status sendMessage(uint32_t channel, std::string_view payload, Deadline deadline) override {
    MC_RETURN_IF_ERROR(failed());
    return inbox_->pushMessage(ctx_->engine_id, channel, payload, deadline);
  }

  void* mappedAddress(uint64_t remote, uint64_t len) override {
    if (!failed().ok()) return nullptr;
    std::shared_lock<std::shared_mutex> g(mu_);
    const RegionDesc* r = remote_.findRegion(remote, len);
    if (r == nullptr || r->shm_name.empty() || r->kind != MemoryKind::kHost) return nullptr;
    uint64_t off = remote - r->addr;  // r may not survive mapLocked's relock
    Mapping* m = mapLocked(*r, &g, false);
    if (m == nullptr) return nullptr;
    if (m->heat) m->heat->warmRange(off, len);  // the caller loads and stores through it
    {
      std::lock_guard<std::mutex> h(handed_mu_);
      handed_.insert(m->base);
    }
    return m->base + off;
  }

  void releaseMapped(const void* local) override {
    const char* p = static_cast<const char*>(local);
    auto inside = [p](const Mapping& m) { return p >= m.base && p < m.base + m.len; };
    std::unique_lock<std::shared_mutex> g(mu_);  // (copies through a mapping hold mu_ shared)
    for (auto it = maps_.begin(); it != maps_.end(); ++it)
      if (inside(it->second)) {
        drop(&it->second);
        maps_.erase(it);
        return;
      }
    for (auto it = retired_.begin(); it != retired_.end(); ++it)
      if (inside(*it)) {
        drop(&*it);
        retired_.erase(it);
        return;
      }
  }

  Status updateRemote(const SegmentDesc& remote) override {
    std::unique_lock<std::shared_mutex> g(mu_);
    remote_ = remote;
    // Mappings whose pointers were handed out (mappedAddress) stay until the peer is closed
    // or releaseMapped; those only copies used go with their region (no one else holds them,
    // and a region the peer dropped keeps its memory while it is mapped here).
    auto handed = [&](const Mapping& m) {
      std::lock_guard<std::mutex> h(handed_mu_);
      return handed_.count(m.base) != 0;
    };
    for (auto it = maps_.begin(); it != maps_.end();) {
      const RegionDesc* r = remote_.findRegion(it->first, it->second.len);
      const bool same = r != nullptr && r->addr == it->first && r->len == it->second.len &&
                        r->shm_name == it->second.name;
      if (same || handed(it->second)) {
        ++it;
        continue;
      }
      drop(&it->second);
      it = maps_.erase(it);
    }
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (handed(*it)) {
        ++it;
        continue;
      }
      drop(&*it);
      it = retired_.erase(it);
    }
    return Status::OK();
  }

  void fail(const Status& why) override {
    std::lock_guard<std::mutex> g(fail_mu_);
    if (fail_.ok()) fail_ = why;
    has_failed_.store(true, std::memory_order_release);
  }

 private:
  struct Mapping {
    char* base;
    uint64_t len;
    std::string name;  // the shm file: an address the peer reuses for a new region differs
    int fd = -1;       // the file, for copies over cold pages (-1: always the mapping)
    std::unique_ptr<PageHeat> heat;
  };

  static void release(Mapping* m) {
    unmapShm(m->base, m->len);
    if (m->fd >= 0) close(m->fd);
  }
  // release() of a mapping in maps_ or retired_ (mu_ held exclusively).
  void drop(Mapping* m) {
    {
      std::lock_guard<std::mutex> h(handed_mu_);
      handed_.erase(m->base);
    }
    release(m);
  }

  Status failed() {
    if (!has_failed_.load(std::memory_order_acquire)) return Status::OK();
    std::lock_guard<std::mutex> g(fail_mu_);
    return fail_;
  }

  // Called with mu_ held shared; upgrades to map a new region. Returns the mapping, which
  // lives until the peer is closed, releaseMapped drops it or (if mappedAddress never handed
  // it out) updateRemote drops its region (std::map nodes do not move). A region first mapped
  // for copies (with_file) keeps its file open for the cold-page path; one first mapped for
  // mappedAddress (process-group and EP buffers, used through the pointer) holds no
  // descriptor, and copies to it always go through the mapping.
  Mapping* mapLocked(const RegionDesc& r, std::shared_lock<std::shared_mutex>* g,
                     bool with_file) {
    auto it = maps_.find(r.addr);
    if (it != maps_.end() && it->second.len == r.len && it->second.name == r.shm_name)
      return &it->second;
    std::string name = r.shm_name;
    uint64_t addr = r.addr, len = r.len;
    g->unlock();
    int fd = -1;
    void* p = mapShm(name, len, with_file && warm_after_ > 0 ? &fd : nullptr);
    std::unique_lock<std::shared_mutex> w(mu_);
    Mapping* out = nullptr;
    auto again = maps_.find(addr);
    if (again != maps_.end() && again->second.len == len && again->second.name == name) {
      if (p != nullptr) {
        Mapping dup{static_cast<char*>(p), len, name, fd, nullptr};
        release(&dup);
      }
      out = &again->second;
    } else if (p != nullptr) {
      // The peer freed the region and registered a new one at the same address (or with a
      // new size): map the new file; the old mapping stays valid until the peer is closed.
      if (again != maps_.end()) {
        retired_.push_back(std::move(again->second));
        maps_.erase(again);
      }
      Mapping& m = maps_[addr];
      m = Mapping{static_cast<char*>(p), len, name, fd,
                  fd >= 0 ? std::make_unique<PageHeat>(len) : nullptr};
      out = &m;
    } else {
      MC_LOG(WARN, SHM) << "cannot map " << name << " of peer " << remote_.name << ": "
                        << std::strerror(errno);
    }
    w.unlock();
    g->lock();
    if (out == nullptr) return nullptr;
    // (releaseMapped may have dropped it while no lock was held: find it again.)
    auto now = maps_.find(addr);
    return now != maps_.end() && now->second.len == len && now->second.name == name
               ? &now->second
               : nullptr;
  }

  Status run(Task* t) {
    MC_RETURN_IF_ERROR(failed());
    if (t->length == 0) return Status::OK();
    std::shared_lock<std::shared_mutex> g(mu_);
    const RegionDesc* r = remote_.findRegion(t->remote, t->length);
    if (r == nullptr)
      return MC_STATUS(kPermissionDenied, "shm: [0x" << std::hex << t->remote << ", +" << std::dec
                                                     << t->length
                                                     << ") is not inside a registered region of "
                                                     << remote_.name);
    if (r->kind != MemoryKind::kHost)
      return MC_STATUS(kNotSupported, "shm: region of " << remote_.name << " is not host memory");
    if (!r->shm_name.empty()) {
      uint64_t off = t->remote - r->addr;  // r may not survive mapLocked's relock
      if (Mapping* m = mapLocked(*r, &g, true)) return copy(m, off, t);
    }
    if (!fence_) return vmCopy(t, 0, t->length);  // (a peer without a fence: an older build)
    // In pieces, each under the fence: a removal waits for the piece running, not the rest.
    for (uint64_t at = 0; at < t->length; at += kFencedPiece) {
      const uint64_t n = std::min<uint64_t>(kFencedPiece, t->length - at);
      MC_RETURN_IF_ERROR(
          fence_->guard(t->remote + at, n, [&] { return vmCopy(t, at, at + n); }));
    }
    return Status::OK();
  }

  // [off, off + t->length) of m: runs of warm pages through the mapping, the rest through the
  // file (see the comment at the top).
  Status copy(Mapping* m, uint64_t off, Task* t) {
    const bool wr = t->op == OpCode::kWrite;
    char* local = static_cast<char*>(t->local);
    const uint64_t end = off + t->length;
    for (uint64_t at = off; at < end;) {
      const bool mapped = !m->heat || m->heat->warm(at / kPage, warm_after_);
      uint64_t stop = m->heat ? std::min(end, (at / kPage + 1) * kPage) : end;
      while (stop < end && m->heat->warm(stop / kPage, warm_after_) == mapped)
        stop = std::min(end, stop + kPage);
      if (m->heat)
        for (uint64_t p = at / kPage; p <= (stop - 1) / kPage; ++p) m->heat->note(p, mapped);
      char* mine = local + (at - off);
      if (!mapped) {
        MC_RETURN_IF_ERROR(fileCopy(*m, wr, mine, stop - at, at));
      } else if (wr) {
        std::memcpy(m->base + at, mine, stop - at);
      } else {
        std::memcpy(mine, m->base + at, stop - at);
      }
      at = stop;
    }
    return Status::OK();
  }

  Status fileCopy(const Mapping& m, bool wr, char* local, uint64_t len, uint64_t at) {
    while (len > 0) {
      ssize_t n = wr ? pwrite(m.fd, local, len, static_cast<off_t>(at))
                     : pread(m.fd, local, len, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : ERANGE;
        Status st = MC_STATUS(kIo, "shm: " << (wr ? "pwrite" : "pread") << " of " << len
                                           << " bytes at +" << at << " of " << m.name
                                           << " (peer " << remote_.name
                                           << "): " << std::strerror(e));
        // EFAULT: the local buffer is not mapped in this process (the caller's mistake).
        return e == EFAULT ? Status(Code::kInvalidArgument, st.message()) : st;
      }
      local += n;
      at += static_cast<uint64_t>(n);
      len -= static_cast<uint64_t>(n);
    }
    return Status::OK();
  }

  // [from, to) of the task.
  Status vmCopy(Task* t, uint64_t from, uint64_t to) {
    uint64_t done = from;
    while (done < to) {
      struct iovec local {
        static_cast<char*>(t->local) + done, to - done
      };
      struct iovec remote {
        reinterpret_cast<void*>(t->remote + done), to - done
      };
      ssize_t n = t->op == OpCode::kWrite ? process_vm_writev(remote_.pid, &local, 1, &remote, 1, 0)
                                          : process_vm_readv(remote_.pid, &local, 1, &remote, 1, 0);
      if (n <= 0) {
        int e = errno;
        if (e == ESRCH) {
          Status dead = MC_STATUS(kPeerDead, "shm: peer " << remote_.name << " (pid "
                                                          << remote_.pid << ") is gone");
          // The engine hears first, so that whoever sees this request fail also finds the
          // peer marked dead.
          if (ctx_->on_peer_failure) ctx_->on_peer_failure(remote_.engine_id, dead, false);
          return dead;
        }
        return MC_STATUS(kIo, "shm: process_vm_" << (t->op == OpCode::kWrite ? "writev" : "readv")
                                                 << " to " << remote_.name << " failed: "
                                                 << std::strerror(e));
      }
      done += static_cast<uint64_t>(n);
    }
    return Status::OK();
  }

  EngineContext* ctx_;
  std::shared_mutex mu_;
  SegmentDesc remote_;
  std::map<uint64_t, Mapping> maps_;
  std::vector<Mapping> retired_;  // replaced mappings, unmapped with the peer (or releaseMapped)
  std::unique_ptr<ShmFence> fence_;  // the peer's, for process_vm copies
  std::mutex handed_mu_;           // (after mu_)
  std::set<const char*> handed_;   // bases of mappings mappedAddress handed out
  std::unique_ptr<Inbox> inbox_;
  const int64_t push_timeout_ms_;  // read once: notify/sendMessage are hot paths
  const int warm_after_;          // MC_SHM_WARM_AFTER (0: every copy through the mapping)
  std::mutex fail_mu_;
  Status fail_;
  std::atomic<bool> has_failed_{false};
};

class ShmTransport : public Transport {
 public:
  TransportKind kind() const override { return TransportKind::kShm; }
  Status start(EngineContext* ctx) override {
    ctx_ = ctx;
    char id[17];
    std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(ctx->engine_id));
    // "<prefix>-<owner>-...": reaped with the process's other files if it is killed.
    auto f = ShmFence::create("/" + params::getString("MC_SHM_PREFIX") + "-" + shmOwnerTag() +
                              "-fence-" + id);
    if (!f.ok()) return f.status();
    fence_ = std::move(f).value();
    return Status::OK();
  }
  void fillLocalSegment(SegmentDesc* desc) override {
    desc->transports |= 1u << static_cast<int>(TransportKind::kShm);
    if (fence_) desc->endpoints[static_cast<int>(TransportKind::kShm)] = fence_->name();
  }
  // The fence lists the host regions peers' process_vm copies may reach (shm_fence.h); on
  // removal the copies running end first and later ones are refused.
  Status registerRegion(Region* region) override {
    if (fence_ && region->kind == MemoryKind::kHost) fence_->added(region->addr, region->len);
    return Status::OK();
  }
  void unregisterRegion(const Region& region) override {
    if (!fence_ || region.kind != MemoryKind::kHost) return;
    if (!fence_->removed(region.addr, region.len, deadlineInMs(kFenceWaitMs))) {
      MC_LOG(WARN, SHM) << "unregistering [0x" << std::hex << region.addr << ", +" << std::dec
                        << region.len << "): a same-host peer's copy still ran after "
                        << kFenceWaitMs << " ms; the region goes anyway";
    }
  }
  bool canReach(const SegmentDesc& local, const SegmentDesc& remote) const override {
    return remote.offers(TransportKind::kShm) && !remote.host_id.empty() &&
           remote.host_id == local.host_id && !remote.inbox_shm.empty();
  }
  Result<std::unique_ptr<TransportPeer>> connect(const SegmentDesc& remote, Deadline deadline,
                                                 bool data,
                                                 std::shared_ptr<ControlLink> control) override {
    auto inbox = Inbox::attach(remote.inbox_shm);
    if (!inbox.ok())
      return MC_STATUS(kUnavailable, "shm: cannot attach the inbox of " << remote.name << ": "
                                                                        << inbox.status().message());
    std::unique_ptr<ShmFence> fence;
    const std::string& fence_name = remote.endpoints[static_cast<int>(TransportKind::kShm)];
    if (!fence_name.empty()) {
      auto f = ShmFence::attach(fence_name);
      if (!f.ok())
        return MC_STATUS(kUnavailable, "shm: cannot attach the fence of " << remote.name << ": "
                                                                          << f.status().message());
      fence = std::move(f).value();
    }
    return std::unique_ptr<TransportPeer>(
        new ShmPeer(ctx_, remote, std::move(inbox).value(), std::move(fence)));
  }
  // The engine stops: its regions may be freed once this returns, so same-host peers' copies
  // into them end first and later ones are refused.
  void stop() override {
    if (fence_ && !fence_->removedAll(deadlineInMs(kFenceWaitMs))) {
      MC_LOG(WARN, SHM) << "stopping: a same-host peer's copy still ran after " << kFenceWaitMs
                        << " ms";
    }
  }

 private:
  // How long unregistering waits for a same-host peer's copy into the region (a stopped peer).
  static constexpr int64_t kFenceWaitMs = 10000;
  EngineContext* ctx_ = nullptr;
  std::unique_ptr<ShmFence> fence_;
};

}  // namespace

std::unique_ptr<Transport> makeShmTransport(const TransportOptions& options) {
  (void)options;
  return std::make_unique<ShmTransport>();
}

}  // namespace mooncake::engine
