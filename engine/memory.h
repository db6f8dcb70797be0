// MemoryRegistry: the regions this process has made reachable to peers.
// Thread-safe. Registration is a set-up operation, never done per transfer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

struct Region {
  uint64_t addr = 0;
  uint64_t len = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;
  // Non-empty when the region is exactly a shared-memory file (allocated by the engine):
  // same-host peers map it. Other host memory is reached with process_vm_readv/writev.
  std::string shm_name;
  bool engine_owned = false;
  // Per-transport keys (RDMA rkey, CUDA IPC handle, ...): opaque bytes by TransportKind.
  std::string keys[kNumTransportKinds];
  // Set by MemoryRegistry::add: tells this registration from a later one at the same address.
  uint64_t serial = 0;
};

// MemoryRegistry::intoRegion's memory of one request: the registration it targets, the
// registry's version() at which that was last seen still registered, and its bounds then.
struct RegionCheck {
  uint64_t serial = 0;
  uint64_t version = 0;
  uint64_t addr = 0, len = 0;
};

class MemoryRegistry {
 public:
  ~MemoryRegistry();

  // Registers [addr, addr+len). Overlapping an existing region is an error.
  Status add(const Region& r);
  // Replaces the per-transport keys of the region that starts at addr (set by the transports
  // after the region was added, e.g. for engine-allocated memory).
  Status setKeys(uint64_t addr, const std::string (&keys)[kNumTransportKinds]);
  // Removes the region that starts at addr. Returns the removed region.
  Result<Region> remove(uint64_t addr);
  // The region containing [addr, addr+len), if any.
  std::optional<Region> find(uint64_t addr, uint64_t len) const;
  std::vector<Region> snapshot() const;
  // Bumped by every add/remove: lets the engine tell peers its segment changed.
  uint64_t version() const;

  // For a transport that moves a peer's one-sided WRITE or READ into or out of registered
  // memory in steps (tcp: one recv() per step, a READ response queued, a device copy): runs
  // step() while [addr, addr+len) lies in the region registration chk->serial names (the one
  // the request was admitted to: a region registered later at the same address is not it),
  // which cannot be removed meanwhile, and returns true; false, without running it, when it
  // does not. remove() waits for the steps in progress, so none touches a region after
  // remove() returned (its memory may be unmapped at once) and a later step finds it gone; a
  // step must therefore be done with the memory when it returns (an asynchronous copy that it
  // gave up waiting for is not covered). The lookup is skipped while nothing was added or
  // removed since chk->version.
  template <class Step>
  bool intoRegion(uint64_t addr, uint64_t len, RegionCheck* chk, Step&& step) {
    std::shared_lock<std::shared_mutex> use(use_mu_);
    const uint64_t now = version_.load(std::memory_order_acquire);
    if (chk->version != now) {
      auto r = find(addr, len);
      if (!r.has_value() || r->serial != chk->serial) return false;
      *chk = RegionCheck{r->serial, now, r->addr, r->len};
    } else if (addr < chk->addr || len > chk->len || addr - chk->addr > chk->len - len) {
      return false;
    }
    step();
    return true;
  }

  // Allocates `len` bytes of host memory backed by a fresh shared-memory file named
  // "/<prefix>-<pid>-<n>" and registers it (engine_owned). The file is unlinked when freed
  // or when the registry is destroyed.
  Result<void*> allocateShm(size_t len, const std::string& prefix);
  // Frees memory from allocateShm: unregisters it, then runs removed(region) (the transports'
  // unregistration: the memory is still mapped), then unmaps it.
  Status freeShm(void* p, const std::function<void(const Region&)>& removed = {});

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, Region> regions_;  // by start address
  std::atomic<uint64_t> version_{1};    // written under mu_
  // Shared by intoRegion's steps, exclusive in remove() (taken before mu_).
  std::shared_mutex use_mu_;
};

// OK when every byte of [addr, addr+len) lies in a readable and writable mapping of this
// process (from /proc/self/maps); kInvalidArgument naming the first byte that does not.
// Registration calls it so that a bogus address fails there, not as a crash in a later copy.
Status checkMappedWritable(uint64_t addr, uint64_t len);

// How this process's shared-memory file names say whose they are: "<pid>n<inode of its pid
// namespace>". Processes of other pid namespaces may share /dev/shm (containers of one pod):
// the same pid number there is another process.
std::string shmOwnerTag();

// Unlinks the shared-memory files "/<prefix>-<owner>-..." and "/<prefix>-inbox-<owner>-..."
// of processes that no longer exist (killed processes cannot clean up after themselves), where
// the owner tag (shmOwnerTag) names this pid namespace and the file belongs to this user.
// Returns how many files were removed.
int reapStaleShm(const std::string& prefix);

// Maps another process's shm region (read-write). Returns nullptr with errno set on failure.
// With fd_out, the file stays open and its descriptor is stored there (the caller closes it).
void* mapShm(const std::string& name, size_t len, int* fd_out = nullptr);
void unmapShm(void* p, size_t len);

}  // namespace mooncake::engine
