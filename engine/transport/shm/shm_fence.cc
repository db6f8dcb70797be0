#include "engine/transport/shm/shm_fence.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace mooncake::engine {

namespace {
constexpr uint32_t kMagic = 0x4d434656;  // "MCFV"

bool processGone(uint64_t owner) {
  const pid_t pid = static_cast<pid_t>(owner >> 32);
  return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

std::atomic<uint32_t> g_next_token{1};
}  // namespace

// In shared memory, zero-filled by ftruncate (the atomics' zero state).
struct ShmFence::Layout {
  uint32_t magic;
  uint32_t ring;
  uint32_t slots;
  uint32_t reserved;
  std::atomic<uint64_t> removals;  // how many removals were written (entry k at k % kRing)
  struct Entry {
    std::atomic<uint64_t> addr, len, version;
  } entries[kRing];
  struct Slot {
    std::atomic<uint64_t> owner;  // pid << 32 | a per-process token; 0: free
    std::atomic<uint64_t> busy;   // copies this peer has running
  } slot[kSlots];
};

Result<std::unique_ptr<ShmFence>> ShmFence::create(const std::string& name) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return MC_STATUS(kIo, "shm fence " << name << ": shm_open: " << strerror(errno));
  if (ftruncate(fd, sizeof(Layout)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    return MC_STATUS(kIo, "shm fence " << name << ": ftruncate: " << strerror(e));
  }
  void* p = mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return MC_STATUS(kIo, "shm fence " << name << ": mmap: " << strerror(e));
  }
  std::unique_ptr<ShmFence> f(new ShmFence());
  f->name_ = name;
  f->owner_ = true;
  f->l_ = static_cast<Layout*>(p);
  f->l_->ring = kRing;
  f->l_->slots = kSlots;
  std::atomic_thread_fence(std::memory_order_release);
  f->l_->magic = kMagic;
  return f;
}

Result<std::unique_ptr<ShmFence>> ShmFence::attach(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return MC_STATUS(kIo, "shm fence " << name << ": shm_open: " << strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(Layout)) {
    close(fd);
    return MC_STATUS(kIo, "shm fence " << name << ": too small");
  }
  void* p = mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (p == MAP_FAILED) return MC_STATUS(kIo, "shm fence " << name << ": mmap: " << strerror(e));
  std::unique_ptr<ShmFence> f(new ShmFence());
  f->name_ = name;
  f->l_ = static_cast<Layout*>(p);
  if (f->l_->magic != kMagic || f->l_->ring != kRing || f->l_->slots != kSlots)
    return MC_STATUS(kIo, "shm fence " << name << ": not a fence of this version");
  const uint64_t token = (static_cast<uint64_t>(getpid()) << 32) | g_next_token.fetch_add(1);
  for (uint32_t i = 0; i < kSlots && f->slot_ < 0; ++i) {
    Layout::Slot& s = f->l_->slot[i];
    uint64_t cur = s.owner.load(std::memory_order_acquire);
    if ((cur == 0 || processGone(cur)) && s.owner.compare_exchange_strong(cur, token)) {
      s.busy.store(0, std::memory_order_seq_cst);  // (a dead process's copies end with it)
      f->slot_ = static_cast<int>(i);
    }
  }
  return f;  // (no slot free: copies unfenced, see guard())
}

ShmFence::~ShmFence() {
  if (l_ == nullptr) return;
  if (slot_ >= 0) l_->slot[slot_].owner.store(0, std::memory_order_release);
  munmap(l_, sizeof(Layout));
  if (owner_) shm_unlink(name_.c_str());
}

bool ShmFence::removed(uint64_t addr, uint64_t len, uint64_t version, Deadline deadline) {
  std::lock_guard<std::mutex> g(owner_mu_);
  version = last_version_ = std::max(version, last_version_);  // (concurrent unregistrations)
  const uint64_t k = l_->removals.load(std::memory_order_relaxed);
  Layout::Entry& e = l_->entries[k % kRing];
  e.addr.store(addr, std::memory_order_relaxed);
  e.len.store(len, std::memory_order_relaxed);
  e.version.store(version, std::memory_order_relaxed);
  l_->removals.store(k + 1, std::memory_order_seq_cst);  // (publishes the entry too)
  bool all = true;
  for (uint32_t i = 0; i < kSlots; ++i) {
    Layout::Slot& s = l_->slot[i];
    for (int spins = 0;; ++spins) {
      const uint64_t owner = s.owner.load(std::memory_order_acquire);
      if (owner == 0 || s.busy.load(std::memory_order_seq_cst) == 0) break;
      if (processGone(owner)) break;
      if (Clock::now() >= deadline) {
        all = false;
        break;
      }
      if (spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
  return all;
}

void ShmFence::enter() { l_->slot[slot_].busy.fetch_add(1, std::memory_order_seq_cst); }

void ShmFence::leave() { l_->slot[slot_].busy.fetch_sub(1, std::memory_order_release); }

Status ShmFence::check(uint64_t addr, uint64_t len, uint64_t desc_version) {
  std::lock_guard<std::mutex> g(mu_);
  const uint64_t n = l_->removals.load(std::memory_order_seq_cst);
  if (n > seen_) {
    // Entry n % kRing may be rewritten by the owner's next removal meanwhile (it cannot go
    // further while this peer's copy count is raised): the kRing - 1 before it are stable.
    uint64_t from = seen_;
    if (n - from > kRing - 1) {
      from = n - (kRing - 1);
      // The ones lost are older than this one, so their versions are no later than its.
      lost_ = true;
      lost_version_ = std::max(lost_version_,
                               l_->entries[from % kRing].version.load(std::memory_order_relaxed));
    }
    for (uint64_t k = from; k < n; ++k) {
      const Layout::Entry& e = l_->entries[k % kRing];
      removals_.push_back({e.addr.load(std::memory_order_relaxed),
                           e.len.load(std::memory_order_relaxed),
                           e.version.load(std::memory_order_relaxed)});
    }
    while (removals_.size() > kRing) {
      lost_ = true;
      lost_version_ = std::max(lost_version_, removals_.front().version);
      removals_.pop_front();
    }
    seen_ = n;
  }
  // A descriptor whose version is beyond a removal's no longer lists that region (beyond,
  // not equal: the owner reads the version after removing, and a descriptor made meanwhile
  // may carry that version and still the region).
  if (lost_ && desc_version <= lost_version_)
    return MC_STATUS(kPermissionDenied, "shm: the peer unregistered more regions than this "
                                        "process has seen since its descriptor: refused until "
                                        "the descriptor is updated");
  for (const Removal& r : removals_)
    if (r.version >= desc_version && addr < r.addr + r.len && r.addr < addr + len)
      return MC_STATUS(kPermissionDenied, "shm: [0x" << std::hex << addr << ", +" << std::dec
                                                     << len << ") lies in a region the peer "
                                                     << "unregistered");
  return Status::OK();
}

}  // namespace mooncake::engine
