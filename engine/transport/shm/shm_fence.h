// ShmFence: keeps same-host peers' process_vm_readv/writev copies out of the memory this engine
// unregistered. Those copies are checked against the initiator's copy of this engine's
// descriptor, which unregistering does not update: without the fence a peer could write into
// memory freed and reused since at the same address.
//
// The engine exports a small shared-memory file ("/<prefix>-<pid>-fence-<engine id>", named in
// its descriptor's shm endpoint): a ring of its last removals and one slot per attached peer
// (a ShmPeer of any process), whose count says how many copies it has running. A peer raises
// its count, reads the removal count, and copies only if no removal it had not seen covers the
// range; the engine writes the removal, bumps the count, then waits until every live peer's
// count is 0. Both sides' store-then-load is sequentially consistent, so either the peer sees
// the removal or the engine sees the copy and waits for it (Dekker's handshake). Each removal
// carries the registry version it left at: a descriptor of a later version no longer lists
// the region, so the peer refuses a range only while its descriptor predates a removal that
// covers it, and everything while it predates a removal it could not read (it fell more than
// a ring behind).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

class ShmFence {
 public:
  static constexpr uint32_t kRing = 256;   // removals a peer may fall behind
  static constexpr uint32_t kSlots = 512;  // peers attached at once (more: copies unfenced)

  // The owner's side: creates the file (unlinked again by the destructor).
  static Result<std::unique_ptr<ShmFence>> create(const std::string& name);
  // A peer's side: maps the owner's file and claims a slot (or a dead process's).
  static Result<std::unique_ptr<ShmFence>> attach(const std::string& name);
  ~ShmFence();
  ShmFence(const ShmFence&) = delete;
  ShmFence& operator=(const ShmFence&) = delete;

  const std::string& name() const { return name_; }

  // Owner: [addr, addr+len) left the registry at registry version `version`. Returns once no
  // peer's copy that may have missed it runs any more (a peer whose process is gone is not
  // waited for), or at the deadline (false, and the copies still running may touch it).
  bool removed(uint64_t addr, uint64_t len, uint64_t version, Deadline deadline);

  // Peer: runs copy() (returning its status) unless [addr, addr+len) was removed after the
  // descriptor this peer has (`desc_version`: its regions_version); PERMISSION_DENIED then.
  template <class Copy>
  Status guard(uint64_t addr, uint64_t len, uint64_t desc_version, Copy&& copy) {
    if (slot_ < 0) return copy();  // (no slot: unfenced, as before the fence)
    enter();
    Status refused = check(addr, len, desc_version);
    Status st = refused.ok() ? copy() : refused;
    leave();
    return st;
  }

 private:
  struct Layout;
  ShmFence() = default;
  void enter();
  void leave();
  Status check(uint64_t addr, uint64_t len, uint64_t desc_version);

  std::string name_;
  bool owner_ = false;
  Layout* l_ = nullptr;
  int slot_ = -1;
  // Peer: the last kRing removals read (addr, len, version), and the newest version among
  // those it could not read or dropped (`lost`).
  std::mutex mu_;
  uint64_t seen_ = 0;
  bool lost_ = false;
  uint64_t lost_version_ = 0;
  struct Removal {
    uint64_t addr, len, version;
  };
  std::deque<Removal> removals_;
  // Owner: one removal at a time, their versions never decreasing.
  std::mutex owner_mu_;
  uint64_t last_version_ = 0;
};

}  // namespace mooncake::engine
