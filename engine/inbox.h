// Inbox: a process's notification and message queues, in one shared-memory file so that a
// same-host peer pushes into them directly (no syscall on the fast path), and the tcp
// transport pushes what arrives from remote peers. Multi-producer multi-consumer bounded
// rings (Vyukov), futex wake-ups across processes, spin-then-block waiting.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

struct InboxLayout;  // in shared memory; defined in inbox.cc

class Inbox {
 public:
  // Message payloads larger than this are split into fragments and reassembled.
  static constexpr uint32_t kFragmentBytes = 16 * 1024;
  static constexpr uint32_t kMaxMessageBytes = 64u << 20;

  // Creates this process's inbox (owner; unlinked on destruction).
  static Result<std::unique_ptr<Inbox>> create(const std::string& shm_name, uint32_t slots);
  // Maps a same-host peer's inbox to push into it.
  static Result<std::unique_ptr<Inbox>> attach(const std::string& shm_name);
  ~Inbox();

  const std::string& shmName() const { return name_; }

  // Producers (any thread, any process). Wait for space up to the deadline.
  // channel 0: an application notification (waitNotify); else a service notification, for
  // the dispatcher (waitDispatch), in a ring of its own so that neither kind holds up the
  // other.
  Status pushNotify(uint64_t src_engine, uint64_t tag, Deadline deadline) {
    return pushNotify(src_engine, 0, tag, deadline);
  }
  Status pushNotify(uint64_t src_engine, uint32_t channel, uint64_t tag, Deadline deadline);
  Status pushMessage(uint64_t src_engine, uint32_t channel, std::string_view payload,
                     Deadline deadline);

  // Consumers (owner only).
  bool popNotify(uint64_t* src_engine, uint64_t* tag);
  // Waits (spin MC_SPIN_US, then futex) until a notification is there or the deadline.
  bool waitNotify(uint64_t* src_engine, uint64_t* tag, Deadline deadline);
  // One fragment; the caller reassembles (see Engine). Returns false when empty.
  struct Fragment {
    uint64_t src_engine;
    uint64_t msg_id;
    uint32_t channel;
    uint32_t total;   // bytes of the whole message
    uint32_t offset;  // of this fragment
    std::string data;
  };
  bool popFragment(Fragment* out);
  bool waitFragment(Fragment* out, Deadline deadline);
  // A service notification (channel != 0); false when there is none.
  struct ServiceNotify {
    uint64_t src_engine;
    uint32_t channel;
    uint64_t tag;
  };
  bool popService(ServiceNotify* out);
  // The dispatcher's wait: a service notification (returns 1) or a message fragment
  // (returns 2), whichever is there first; 0 at the deadline.
  int waitDispatch(ServiceNotify* svc, Fragment* frag, Deadline deadline);
  // Wakes every waiter of this process and makes later waits return at once (shutdown).
  void wakeAll();

 private:
  Inbox() = default;
  std::string name_;
  bool owner_ = false;
  size_t bytes_ = 0;
  InboxLayout* l_ = nullptr;
  std::atomic<uint64_t> next_msg_id_{1};
  std::atomic<bool> closing_{false};
  int64_t spin_us_ = 0;  // MC_SPIN_US, read once: waits are a hot path
};

}  // namespace mooncake::engine
