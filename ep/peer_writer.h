// EpBuffer::Writer: the writes of one send phase (one round of one kind) to every destination
// rank's buffer.
//
// Mapped destinations (same host): copy() is a memcpy into the peer's buffer right away and
// commit(r) publishes r's signal words at once (release stores, then a doorbell wake), so a
// receiver starts on one destination's rows while the sender fills the next. Remote
// destinations, one-sided: copy() queues an engine WRITE (the source must stay valid until
// flush()); flush() adds a WRITE of r's signal entries into this rank's mailbox in r's buffer
// (ep/layout.h), posts each destination's writes as one batch and at once a notify() on
// kEpSignalChannel, which the engine delivers only after those writes: r's handler then
// stores the mailbox entries into its signal words (EpBuffer::takeMailbox). No round trip
// sits between the data and the signals. flush() waits for the batches (the sources are
// the caller's); a destination whose writes or notification could not be posted, or whose
// writes failed for any reason but its death after the notification was posted, is reported
// by flush(), the others are unaffected. (A peer may take its signals and exit before our
// completions arrive; a dead source is found by the receive side, which waits for it.)
//
// Notification tag: bits 0-13 entry count, 14-23 source rank, 24 kind, 25-31 the round's
// low 7 bits (bit 25 = half), 32-63 the buffer's key. A mailbox is reused two rounds of its
// kind later, which the halves' rule already orders after the receiver is done with it; an
// entry whose round does not match the tag's (a sender that went on after the receiver gave
// up on it) is not stored. A round given up (abandon(), alone in its flush) is the exception:
// a refused call's round may be two after a hooked round whose notification the receiver has
// not taken yet, so its one entry goes to the mailbox's last slot, which no round's signals
// use (at most L + 1 of mailboxCap() >= L + 2), and its tag's count is kAbandonSlotCount.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "ep/buffer.h"

namespace mooncake::ep {

// Engine notification channel of EP signals ("EP\0\1").
constexpr uint32_t kEpSignalChannel = 0x45500001u;
// The bits of a round a notification tag carries.
constexpr uint32_t kRoundBitsMask = 0x7f;
// A tag's count naming the mailbox's last slot: one abandon entry (above).
constexpr uint32_t kAbandonSlotCount = 0x3fff;
// Engine notification channel of EP read marks ("EP\0\2"; EpBuffer::markRead): tag bits 0-20
// the round's low 21 bits, 21-30 the source rank, 31 the kind, 32-63 the buffer's key.
constexpr uint32_t kEpMarkChannel = 0x45500002u;
constexpr uint32_t kMarkRoundMask = (1u << 21) - 1;
inline uint64_t markTag(uint64_t key, int kind, int src, uint32_t round) {
  return (key << 32) | (static_cast<uint64_t>(kind) << 31) | (static_cast<uint64_t>(src) << 21) |
         (round & kMarkRoundMask);
}

class EpBuffer::Writer {
 public:
  Writer(EpBuffer& buf, engine::Deadline deadline, RoundKind kind, uint32_t round);

  bool isMapped(int r) const { return buf_.mapped_[r] != nullptr; }
  // Local pointer to offset `off` of rank r's buffer; only for mapped ranks.
  char* at(int r, size_t off) const { return buf_.mapped_[r] + off; }

  void copy(int r, size_t off, const void* src, size_t len);
  // Row j of the destination block at `off` (stride dst_stride) = src row idx[j]
  // (stride row_bytes); runs of consecutive rows move as one copy / one request.
  void copyRows(int r, size_t off, size_t dst_stride, const char* src, size_t row_bytes,
                const std::vector<int32_t>& idx);
  // Queues a signal word for rank r (published by commit(r) or flush()).
  void signal(int r, size_t off, uint64_t value) { sigs_[r].push_back({off, value}); }
  // Publishes r's queued signals now if r is mapped (its data is complete).
  void commit(int r);
  void setDeadline(engine::Deadline deadline) { deadline_ = deadline; }  // (flush's)
  // Completes everything; returns the ranks whose writes or signals failed. A destination
  // whose batch is not done by the deadline keeps running (engine.h, wait): its signal entries
  // go to the engine, which drops them once its writes finished.
  std::vector<int> flush();
  // After flush(), for every batch that was not done: what else those writes read goes to the
  // engine too, the caller's inputs (`owner`: null when the caller gave none) or this call's
  // own containers (moved: their elements stay where they are). No-op when all finished.
  void keepWhileLate(std::shared_ptr<void> owner);
  template <class T>
  void keepLocalWhileLate(T& local) {
    if (!late_.empty()) keepWhileLate(std::make_shared<T>(std::move(local)));
  }

 private:
  EpBuffer& buf_;
  engine::Deadline deadline_;
  RoundKind kind_;
  uint32_t round_;
  std::vector<std::vector<engine::TransferRequest>> reqs_;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> sigs_;
  std::vector<engine::BatchId> late_;  // flush()'s batches that were not done
  // The notification telling rank r to take n mailbox entries.
  uint64_t tag(uint32_t n) const;
};

// Installs the EP notification handler on the buffer's engine and makes the buffer findable by
// its key's low 32 bits (what a tag carries). False when another live buffer of this process
// has the same low bits.
bool registerSignalTarget(uint64_t key, EpBuffer* buf, engine::TransferEngine* engine);
void unregisterSignalTarget(uint64_t key);

// Bumps the doorbell word of a buffer (local or mapped) and wakes its sleepers.
void ringDoorbell(char* buffer_base);

}  // namespace mooncake::ep
