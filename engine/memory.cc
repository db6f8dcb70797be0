#include "engine/memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>

#include "engine/log.h"
#include "engine/secret.h"

namespace mooncake::engine {

MemoryRegistry::~MemoryRegistry() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [addr, r] : regions_) {
    if (r.engine_owned && r.kind == MemoryKind::kHost) {  // GPU memory: the engine frees it
      munmap(reinterpret_cast<void*>(r.addr), r.len);
      shm_unlink(r.shm_name.c_str());
    }
  }
}

Status checkMappedWritable(uint64_t addr, uint64_t len) {
  if (len == 0) return Status::OK();
  if (addr + len < addr) return MC_STATUS(kInvalidArgument, "range wraps around");
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (f == nullptr) return Status::OK();  // no procfs: nothing to check against
  uint64_t cursor = addr;  // first byte not yet known to be covered
  const uint64_t end = addr + len;
  char line[512];
  std::string bad;
  while (cursor < end && std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long lo = 0, hi = 0;
    char perms[8] = {0};
    if (std::sscanf(line, "%llx-%llx %7s", &lo, &hi, perms) != 3) continue;
    // Lines come sorted by address: a mapping above the cursor leaves a hole.
    if (lo > cursor) break;
    if (hi <= cursor) continue;
    if (perms[0] != 'r' || perms[1] != 'w') {
      bad = std::string("mapped ") + perms + ", not read-write";
      break;
    }
    cursor = hi;
  }
  std::fclose(f);
  if (cursor >= end) return Status::OK();
  return MC_STATUS(kInvalidArgument, "[0x" << std::hex << addr << ", +" << std::dec << len
                                           << ") is not memory this process may write: 0x"
                                           << std::hex << cursor << std::dec << " is "
                                           << (bad.empty() ? "not mapped" : bad));
}

Status MemoryRegistry::add(const Region& r) {
  if (r.len == 0) return MC_STATUS(kInvalidArgument, "cannot register an empty region");
  if (r.addr + r.len < r.addr) return MC_STATUS(kInvalidArgument, "region wraps around");
  std::lock_guard<std::mutex> g(mu_);
  auto next = regions_.lower_bound(r.addr);
  if (next != regions_.end() && next->first < r.addr + r.len)
    return MC_STATUS(kAlreadyExists, "region [0x" << std::hex << r.addr << ", +" << std::dec
                                                  << r.len << ") overlaps a registered region");
  if (next != regions_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.len > r.addr)
      return MC_STATUS(kAlreadyExists, "region at 0x" << std::hex << r.addr
                                                      << " overlaps a registered region");
  }
  Region& added = regions_[r.addr] = r;
  added.serial = ++version_;
  return Status::OK();
}

Status MemoryRegistry::setKeys(uint64_t addr, const std::string (&keys)[kNumTransportKinds]) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = regions_.find(addr);
  if (it == regions_.end())
    return MC_STATUS(kNotFound, "no region registered at 0x" << std::hex << addr);
  for (int i = 0; i < kNumTransportKinds; ++i) it->second.keys[i] = keys[i];
  ++version_;
  return Status::OK();
}

Result<Region> MemoryRegistry::remove(uint64_t addr) {
  std::unique_lock<std::shared_mutex> use(use_mu_);  // (intoRegion's steps in progress end)
  std::lock_guard<std::mutex> g(mu_);
  auto it = regions_.find(addr);
  if (it == regions_.end())
    return MC_STATUS(kNotFound, "no region registered at 0x" << std::hex << addr);
  Region r = it->second;
  regions_.erase(it);
  ++version_;
  return r;
}

std::optional<Region> MemoryRegistry::find(uint64_t addr, uint64_t len) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin()) return std::nullopt;
  --it;
  const Region& r = it->second;
  if (addr < r.addr || len > r.len || addr - r.addr > r.len - len) return std::nullopt;
  return r;
}

std::vector<Region> MemoryRegistry::snapshot() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Region> out;
  out.reserve(regions_.size());
  for (auto& kv : regions_) out.push_back(kv.second);
  return out;
}

uint64_t MemoryRegistry::version() const { return version_.load(std::memory_order_acquire); }

Result<void*> MemoryRegistry::allocateShm(size_t len, const std::string& prefix) {
  if (len == 0) return MC_STATUS(kInvalidArgument, "cannot allocate 0 bytes");
  // Process-wide counter: two engines of one process must never pick the same name.
  // A random part too: a name another local user can guess, they can create first (an
  // allocation that then fails, or waits on a file it must not touch). A name taken (a guess
  // that hit, or a stale file of a dead process with a recycled pid) is not unlinked: another
  // one is drawn.
  static std::atomic<uint64_t> next_shm{0};
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    uint64_t n = next_shm.fetch_add(1);
    name = "/" + prefix + "-" + shmOwnerTag() + "-" + std::to_string(n) + "-" +
           generateSecret().substr(0, 16);  // 64 random bits, in hex
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return MC_STATUS(kIo, "shm_open " << name << ": " << std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    return MC_STATUS(kResourceExhausted, "ftruncate " << name << " to " << len
                                                      << " bytes: " << std::strerror(e));
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return MC_STATUS(kResourceExhausted, "mmap " << len << " bytes: " << std::strerror(errno));
  }
  Region r;
  r.addr = reinterpret_cast<uint64_t>(p);
  r.len = len;
  r.shm_name = name;
  r.engine_owned = true;
  Status st = add(r);
  if (!st.ok()) {
    munmap(p, len);
    shm_unlink(name.c_str());
    return st;
  }
  MC_LOG(DEBUG, ENGINE) << "allocated " << len << " bytes of shm as " << name;
  return p;
}

Status MemoryRegistry::freeShm(void* p, const std::function<void(const Region&)>& removed) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = regions_.find(reinterpret_cast<uint64_t>(p));
    if (it == regions_.end() || !it->second.engine_owned)
      return MC_STATUS(kInvalidArgument, "pointer " << p << " was not allocated by the engine");
  }
  auto r = remove(reinterpret_cast<uint64_t>(p));
  if (!r.ok()) return r.status();
  if (removed) removed(*r);
  munmap(p, r->len);
  shm_unlink(r->shm_name.c_str());
  return Status::OK();
}

namespace {

uint64_t pidNamespace() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

std::string shmOwnerTag() {
  static const uint64_t ns = pidNamespace();
  return std::to_string(getpid()) + "n" + std::to_string(ns);
}

int reapStaleShm(const std::string& prefix) {
  const uint64_t own_ns = pidNamespace();
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  int removed = 0;
  const std::string p1 = prefix + "-", p2 = prefix + "-inbox-";
  while (struct dirent* e = readdir(d)) {
    std::string n = e->d_name;
    size_t at;
    if (n.compare(0, p2.size(), p2) == 0) {
      at = p2.size();
    } else if (n.compare(0, p1.size(), p1) == 0) {
      at = p1.size();
    } else {
      continue;
    }
    char* end = nullptr;
    long pid = std::strtol(n.c_str() + at, &end, 10);
    if (end == n.c_str() + at || pid <= 0) continue;
    if (*end == 'n') {  // "<pid>n<pid namespace>": only this namespace's pids are ours to test
      char* ns_end = nullptr;
      const unsigned long long ns = std::strtoull(end + 1, &ns_end, 10);
      if (ns_end == end + 1 || ns != own_ns) continue;
      end = ns_end;
    }
    if (*end != '-') continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    struct stat st;  // only this user's files (another user's are not ours to judge)
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid())
      continue;
    if (shm_unlink(("/" + n).c_str()) == 0) ++removed;
  }
  closedir(d);
  if (removed > 0) {
    MC_LOG(INFO, ENGINE) << "removed " << removed << " stale shm files";
  }
  return removed;
}

void* mapShm(const std::string& name, size_t len, int* fd_out) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < len) {
    close(fd);
    errno = ERANGE;
    return nullptr;
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED || fd_out == nullptr) {
    int e = errno;
    close(fd);
    errno = e;
  } else {
    *fd_out = fd;
  }
  return p == MAP_FAILED ? nullptr : p;
}

void unmapShm(void* p, size_t len) {
  if (p != nullptr) munmap(p, len);
}

}  // namespace mooncake::engine
