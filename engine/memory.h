// MemoryRegistry: the regions this process has made reachable to peers.
// Thread-safe. Registration is a set-up operation, never done per transfer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
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

  // Allocates `len` bytes of host memory backed by a fresh shared-memory file named
  // "/<prefix>-<pid>-<n>" and registers it (engine_owned). The file is unlinked when freed
  // or when the registry is destroyed.
  Result<void*> allocateShm(size_t len, const std::string& prefix);
  // Frees memory from allocateShm (unregisters it first).
  Status freeShm(void* p);

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, Region> regions_;  // by start address
  uint64_t version_ = 0;
};

// OK when every byte of [addr, addr+len) lies in a readable and writable mapping of this
// process (from /proc/self/maps); kInvalidArgument naming the first byte that does not.
// Registration calls it so that a bogus address fails there, not as a crash in a later copy.
Status checkMappedWritable(uint64_t addr, uint64_t len);

// Unlinks the shared-memory files "/<prefix>-<pid>-..." and "/<prefix>-inbox-<pid>-..." of
// processes that no longer exist (killed processes cannot clean up after themselves).
// Returns how many files were removed.
int reapStaleShm(const std::string& prefix);

// Maps another process's shm region (read-write). Returns nullptr with errno set on failure.
// With fd_out, the file stays open and its descriptor is stored there (the caller closes it).
void* mapShm(const std::string& name, size_t len, int* fd_out = nullptr);
void unmapShm(void* p, size_t len);

}  // namespace mooncake::engine
