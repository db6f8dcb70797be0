#include "engine/transport/shm/shm_fence.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "engine/log.h"

namespace mooncake::engine {

namespace {
constexpr uint32_t kMagic = 0x4d434657;  // "MCFW"

// A process's start time (clock ticks since boot, /proc/<pid>/stat field 22) and whether it
// is a zombie: a pid alone may be reused, and a killed process not yet reaped still exists.
bool procStat(pid_t pid, uint64_t* start, bool* zombie) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // (the command name may hold spaces and parens)
  if (p == nullptr) return false;
  char state = 0;
  long threads = 0;
  unsigned long long st = 0;
  // Fields 3-22: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
  // utime stime cutime cstime priority nice num_threads itrealvalue starttime.
  if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d "
                         "%ld %*d %llu", &state, &threads, &st) != 3)
    return false;
  *start = st;
  // The state is the main thread's: a zombie leader with other threads still running (one
  // may be in the middle of a copy) is not a dead process.
  *zombie = (state == 'Z' || state == 'X') && threads <= 1;
  return true;
}

// (Read each time: a forked child is another process with another start time.)
uint64_t selfStart() {
  uint64_t s = 0;
  bool z = false;
  return procStat(getpid(), &s, &z) ? s : 0;
}

// A slot's owner: the pid and the low 32 bits of the process's start time (0: unknown).
uint64_t ownerToken() {
  return (static_cast<uint64_t>(getpid()) << 32) | (selfStart() & 0xffffffffu);
}

// The owner's process has exited: dead, a zombie, or its pid now another process's.
bool processGone(uint64_t owner) {
  const pid_t pid = static_cast<pid_t>(owner >> 32);
  if (pid <= 0) return false;
  uint64_t now = 0;
  bool zombie = false;
  if (!procStat(pid, &now, &zombie)) return kill(pid, 0) != 0 && errno == ESRCH;
  const uint64_t start = owner & 0xffffffffu;
  return zombie || (start != 0 && (now & 0xffffffffu) != start);
}
}  // namespace

// In shared memory, zero-filled by ftruncate (the atomics' zero state).
struct ShmFence::Layout {
  uint32_t magic;
  uint32_t table_cap;
  uint32_t slots;
  uint32_t reserved;
  std::atomic<uint64_t> seq;       // odd while the owner rewrites the table
  std::atomic<uint64_t> count;     // entries in the table
  std::atomic<uint64_t> overflow;  // 1: more regions than the table holds (copies unchecked)
  std::atomic<uint64_t> epoch;     // which of a slot's counts new copies raise (its low bit)
  struct Entry {
    std::atomic<uint64_t> addr, len;
  } table[kTable];  // sorted by addr
  struct Slot {
    std::atomic<uint64_t> owner;    // ownerToken() of the process holding it; 0: free
    std::atomic<uint64_t> busy[2];  // copies running, by the epoch they began in
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
  f->l_->table_cap = kTable;
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
  if (f->l_->magic != kMagic || f->l_->table_cap != kTable || f->l_->slots != kSlots)
    return MC_STATUS(kIo, "shm fence " << name << ": not a fence of this version");
  const uint64_t token = ownerToken();
  // A free slot first; only if there is none, a dead process's (each look reads /proc).
  for (const bool reclaim : {false, true}) {
    for (uint32_t i = 0; i < kSlots && f->slot_ < 0; ++i) {
      Layout::Slot& s = f->l_->slot[i];
      uint64_t cur = s.owner.load(std::memory_order_seq_cst);
      if ((reclaim ? cur != 0 && processGone(cur) : cur == 0) &&
          s.owner.compare_exchange_strong(cur, token)) {
        // (A dead process's copies ended with it.)
        s.busy[0].store(0, std::memory_order_seq_cst);
        s.busy[1].store(0, std::memory_order_seq_cst);
        f->slot_ = static_cast<int>(i);
        f->token_ = token;
      }
    }
    if (f->slot_ >= 0) break;
  }
  if (f->slot_ < 0) {
    MC_LOG(WARN, SHM) << "shm fence " << name << ": all " << kSlots << " slots taken; this "
                      << "process's copies to that peer go unchecked";
  }
  return f;
}

ShmFence::~ShmFence() {
  if (l_ == nullptr) return;
  // (A forked child's copy of this object does not release its parent's slot.)
  uint64_t mine = token_;
  if (slot_ >= 0 && static_cast<pid_t>(token_ >> 32) == getpid())
    l_->slot[slot_].owner.compare_exchange_strong(mine, 0);
  munmap(l_, sizeof(Layout));
  if (owner_) shm_unlink(name_.c_str());
}

void ShmFence::publishLocked() {
  const uint64_t s = l_->seq.load(std::memory_order_relaxed);
  l_->seq.store(s + 1, std::memory_order_seq_cst);  // odd: readers retry
  std::atomic_thread_fence(std::memory_order_release);
  const bool over = live_.size() > kTable;
  const bool was_over = l_->overflow.load(std::memory_order_relaxed) != 0;
  uint64_t n = 0;
  if (!over) {
    for (const auto& [addr, len] : live_) {
      l_->table[n].addr.store(addr, std::memory_order_relaxed);
      l_->table[n].len.store(len, std::memory_order_relaxed);
      ++n;
    }
  }
  l_->count.store(n, std::memory_order_relaxed);
  l_->overflow.store(over ? 1 : 0, std::memory_order_relaxed);
  l_->seq.store(s + 2, std::memory_order_seq_cst);  // even again (release: the table with it)
  if (over && !was_over) {  // (logged outside the rewrite, which peers wait out)
    MC_LOG(WARN, SHM) << "shm fence " << name_ << ": more than " << kTable << " registered "
                      << "regions; same-host peers' copies go unchecked until fewer";
  }
}

void ShmFence::added(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> g(owner_mu_);
  live_.emplace(addr, len);
  publishLocked();
}

bool ShmFence::removed(uint64_t addr, uint64_t len, Deadline deadline) {
  std::lock_guard<std::mutex> g(owner_mu_);
  for (auto it = live_.lower_bound(addr); it != live_.end() && it->first == addr; ++it) {
    if (it->second == len) {
      live_.erase(it);
      break;
    }
  }
  return drainLocked(deadline);
}

bool ShmFence::removedAll(Deadline deadline) {
  std::lock_guard<std::mutex> g(owner_mu_);
  live_.clear();
  return drainLocked(deadline);
}

bool ShmFence::drainLocked(Deadline deadline) {
  publishLocked();
  // Copies raise the count of the epoch they read: new ones go to the other count from now on
  // (and see the table above), the old count only falls.
  const uint64_t old = l_->epoch.fetch_add(1, std::memory_order_seq_cst) & 1;
  bool all = true;
  for (uint32_t i = 0; i < kSlots; ++i) {
    Layout::Slot& s = l_->slot[i];
    Deadline look = Clock::now();  // when to look at the owner process again (/proc)
    for (int spins = 0;; ++spins) {
      if (s.busy[old].load(std::memory_order_seq_cst) == 0) break;
      // A free slot has no copy running (a slot is released after its peer's last copy; one
      // claimed after this load counts its copies under the new epoch).
      uint64_t owner = s.owner.load(std::memory_order_seq_cst);
      if (owner == 0) break;
      const bool now_look = Clock::now() >= look;
      if (now_look) look = Clock::now() + std::chrono::milliseconds(5);
      if (now_look && processGone(owner)) {
        // Its copies ended with it: the slot is free for the next peer (which zeroes it).
        s.owner.compare_exchange_strong(owner, 0);
        break;
      }
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

int ShmFence::enter() {
  Layout::Slot& s = l_->slot[slot_];
  for (;;) {
    const int e = static_cast<int>(l_->epoch.load(std::memory_order_seq_cst) & 1);
    s.busy[e].fetch_add(1, std::memory_order_seq_cst);
    // The epoch flipped in between: the removal may have waited for the other count already,
    // so count under the new epoch instead (this copy then sees its table).
    if (static_cast<int>(l_->epoch.load(std::memory_order_seq_cst) & 1) == e) return e;
    s.busy[e].fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ShmFence::leave(int epoch) {
  l_->slot[slot_].busy[epoch].fetch_sub(1, std::memory_order_seq_cst);
}

Status ShmFence::check(uint64_t addr, uint64_t len) const {
  // A rewrite takes microseconds: one that lasts is an owner stopped or killed in it.
  const Deadline give_up = Clock::now() + std::chrono::seconds(2);
  for (;;) {
    const uint64_t s1 = l_->seq.load(std::memory_order_seq_cst);
    if (s1 & 1) {
      if (Clock::now() >= give_up)
        return MC_STATUS(kUnavailable, "shm: the peer's fence " << name_ << " has been in a "
                                                                << "rewrite for 2 s (the peer "
                                                                << "stopped or died in it)");
      std::this_thread::yield();
      continue;
    }
    bool inside = false;
    const bool over = l_->overflow.load(std::memory_order_relaxed) != 0;
    const uint64_t n = std::min<uint64_t>(l_->count.load(std::memory_order_relaxed), kTable);
    // The last entry starting at or before addr (the table is sorted by address).
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (l_->table[mid].addr.load(std::memory_order_relaxed) <= addr)
        lo = mid + 1;
      else
        hi = mid;
    }
    // (Registrations do not overlap, but one being refused for overlapping is listed for a
    // moment: look at the few entries before too.)
    for (uint64_t k = lo; k > 0 && k + 4 > lo && !inside; --k) {
      const uint64_t a = l_->table[k - 1].addr.load(std::memory_order_relaxed);
      const uint64_t l = l_->table[k - 1].len.load(std::memory_order_relaxed);
      inside = addr >= a && len <= l && addr - a <= l - len;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (l_->seq.load(std::memory_order_relaxed) != s1) continue;  // rewritten meanwhile
    if (inside || over) return Status::OK();
    return MC_STATUS(kPermissionDenied, "shm: [0x" << std::hex << addr << ", +" << std::dec << len
                                                   << ") is not inside a region the peer has "
                                                   << "registered now");
  }
}

}  // namespace mooncake::engine
