// ShmFence: keeps same-host peers' process_vm_readv/writev copies inside the memory this engine
// has registered now. Those copies are checked against the initiator's copy of this engine's
// descriptor, which unregistering does not update: without the fence a peer could write into
// memory unregistered (and freed, or reused) since.
//
// The engine exports a small shared-memory file ("/<prefix>-<pid>-fence-<engine id>", named in
// its descriptor's shm endpoint) holding the host regions it has registered, sorted, under a
// sequence lock, and one slot per attached peer (a ShmPeer of any process) with two copy
// counts. A peer's copy raises the count of the current epoch, then looks its range up in the
// table: it runs only inside a registered region, and is refused with PERMISSION_DENIED
// otherwise. A removal updates the table, flips the epoch and waits until every live peer's
// count of the old epoch is 0: the copies that began before the flip (and may have looked the
// table up before the update) end first, those after it see the update. Every store and load
// of the handshake is sequentially consistent (SRCU's scheme): either the copy's count is seen
// by the wait or the copy sees the updated table. Copies of the new epoch are never waited for,
// so a busy peer cannot hold a removal up beyond its longest copy.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

class ShmFence {
 public:
  static constexpr uint32_t kTable = 8192;  // regions listed (more: copies go unchecked)
  static constexpr uint32_t kSlots = 512;   // peers attached at once (more: unchecked too)

  // The owner's side: creates the file (unlinked again by the destructor).
  static Result<std::unique_ptr<ShmFence>> create(const std::string& name);
  // A peer's side: maps the owner's file and claims a slot (or a dead process's).
  static Result<std::unique_ptr<ShmFence>> attach(const std::string& name);
  ~ShmFence();
  ShmFence(const ShmFence&) = delete;
  ShmFence& operator=(const ShmFence&) = delete;

  const std::string& name() const { return name_; }

  // Owner: [addr, addr+len) was registered (listed before the registry has it).
  void added(uint64_t addr, uint64_t len);
  // Owner: it was unregistered (out of the registry already). Returns once no peer's copy that
  // began before runs any more (a peer whose process is gone is not waited for), or at the
  // deadline (false: such a copy may still touch it).
  bool removed(uint64_t addr, uint64_t len, Deadline deadline);
  // Owner: every region, as removed() (the engine stops: its memory may be freed after).
  bool removedAll(Deadline deadline);

  // Peer: runs copy() (returning its status) if [addr, addr+len) lies in a region the owner
  // has registered, PERMISSION_DENIED otherwise; unchecked when this peer has no slot or the
  // owner's table overflowed.
  template <class Copy>
  Status guard(uint64_t addr, uint64_t len, Copy&& copy) {
    if (slot_ < 0) return copy();
    const int epoch = enter();
    Status refused = check(addr, len);
    Status st = refused.ok() ? copy() : refused;
    leave(epoch);
    return st;
  }

 private:
  struct Layout;
  ShmFence() = default;
  int enter();
  void leave(int epoch);
  Status check(uint64_t addr, uint64_t len) const;
  void publishLocked();  // owner: the table from live_, under the sequence lock
  bool drainLocked(Deadline deadline);  // owner: publish, flip the epoch, wait for the old

  std::string name_;
  bool owner_ = false;
  Layout* l_ = nullptr;
  int slot_ = -1;
  uint64_t token_ = 0;                      // peer: what its slot's owner word holds
  std::mutex owner_mu_;                     // owner: one change at a time
  std::multimap<uint64_t, uint64_t> live_;  // owner: registered regions, addr -> len
};

}  // namespace mooncake::engine
