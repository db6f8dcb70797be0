// EpBuffer::Writer: the writes of one send phase to every destination rank's buffer.
//
// Mapped destinations (same host): copy() is a memcpy into the peer's buffer right away and
// commit(r) publishes r's signal words at once (release stores, then a doorbell wake), so a
// receiver starts on one destination's rows while the sender fills the next. Remote
// destinations: copy() queues an engine WRITE (the source must stay valid until flush());
// flush() posts one batch per destination, waits for it and only then sends the signal
// words as one engine message, which the destination's handler stores. A destination whose
// writes fail (dead peer) is reported by flush(); the others are unaffected.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "ep/buffer.h"

namespace mooncake::ep {

// Engine message channel of EP signal words ("EP\0\1").
constexpr uint32_t kEpSignalChannel = 0x45500001u;

class EpBuffer::Writer {
 public:
  Writer(EpBuffer& buf, engine::Deadline deadline);

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
  // Completes everything; returns the ranks whose writes or signals failed.
  std::vector<int> flush();

 private:
  EpBuffer& buf_;
  engine::Deadline deadline_;
  std::vector<std::vector<engine::TransferRequest>> reqs_;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> sigs_;
};

// Installs the EP signal handler on the buffer's engine and makes the buffer findable by key.
void registerSignalTarget(uint64_t key, EpBuffer* buf, engine::TransferEngine* engine);
void unregisterSignalTarget(uint64_t key);

// Bumps the doorbell word of a buffer (local or mapped) and wakes its sleepers.
void ringDoorbell(char* buffer_base);

}  // namespace mooncake::ep
