// Inbox: a process's notification and message queues, in one shared-memory file so that a
// same-host peer pushes into them directly (no syscall on the fast path), and the tcp
// transport pushes what arrives from remote peers. Multi-producer multi-consumer bounded
// rings (Vyukov), futex wake-ups across processes, spin-then-block waiting.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

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
  // A payload over kFragmentBytes goes as several fragments, pushed one at a time; the
  // multi-fragment messages of one process to an inbox go one after the other (the attachments
  // of it in this process share a lock, taken by the deadline too), so that their fragments
  // never interleave (MessageReassembler relies on it). Message ids are unique per process
  // (one counter, random start), never reused when a peer is opened again. A push that gives
  // up part-way (kResourceExhausted) leaves a part that the receiver drops.
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
  std::shared_ptr<std::timed_mutex> send_lock_;  // this process's multi-fragment pushes here
  std::atomic<bool> closing_{false};
  int64_t spin_us_ = 0;  // MC_SPIN_US, read once: waits are a hot path
};

// Reassembles the message fragments that one inbox's consumer pops. A sender pushes its
// multi-fragment messages one after the other (pushMessage), so it has at most one under way
// here: the first fragment of its next one ends whatever part of an earlier one is held (the
// sender gave up on that one), and so does discardSender() (the sender is gone). Memory held
// is thus at most one message per live sender. Fragments of no held part are dropped.
class MessageReassembler {
 public:
  MessageReassembler() = default;
  ~MessageReassembler();
  MessageReassembler(const MessageReassembler&) = delete;
  MessageReassembler& operator=(const MessageReassembler&) = delete;

  // Consumer thread. True when `f` completes a message: *body gets its payload (f names its
  // sender and channel); false when it is a part (held) or was dropped.
  bool add(Inbox::Fragment& f, std::string* body);
  // Any thread: drops the part held for `src` whose first fragment came before this call, at
  // the consumer's next add() or sweep().
  void discardSender(uint64_t src);
  // Consumer thread: applies discardSender() requests.
  void sweep();
  // Consumer thread: messages under way.
  size_t parts() const { return parts_.size(); }
  uint64_t heldBytes() const { return held_.load(std::memory_order_relaxed); }
  uint64_t droppedFragments() const { return dropped_.load(std::memory_order_relaxed); }
  // Bytes held by every reassembler of this process (tests watch it).
  static uint64_t processHeldBytes();

 private:
  struct Part {
    uint64_t msg_id;
    uint32_t channel;
    uint32_t total;
    uint64_t first_seq;  // add() count at its first fragment
    std::string buf;
  };
  using Parts = std::unordered_map<uint64_t, Part>;  // by sender
  void drop(Parts::iterator it);
  void dropFragment(const Inbox::Fragment& f, const char* why);
  void held(int64_t delta);

  Parts parts_;
  uint64_t seq_ = 0;                   // fragments added (consumer thread)
  std::atomic<uint64_t> seq_seen_{0};  // seq_, for discardSender()
  std::atomic<uint64_t> held_{0};
  std::atomic<uint64_t> dropped_{0};
  std::pair<uint64_t, uint64_t> last_logged_{0, 0};  // (sender, id) of the last drop logged
  std::mutex mu_;
  std::vector<std::pair<uint64_t, uint64_t>> discards_;  // (sender, seq_seen_ then)
  std::atomic<bool> has_discards_{false};
};

}  // namespace mooncake::engine
