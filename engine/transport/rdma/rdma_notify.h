// Notifications over several QPs: a notify() must reach the target after every write the
// initiator issued before it, and RC orders work only within one QP. When a peer's writes went
// over several QPs (several NICs), the initiator posts one part of the notification on each QP
// that carried writes since its last notification, and the target delivers it once all parts
// arrived, each after its own QP's writes. Notifications from one connection are delivered in
// the order they were issued.
//
// Wire: the 16-byte notify message is u32 channel | u32 word | u64 tag, where word is
// (parts << 26) | (part << 20) | seq: `parts` (1..63) the number of QPs it was posted on,
// `part` which one this is (0..parts-1), `seq` (20 bits, wrapping) its number in the
// connection's sequence, starting at 0. A part resent after a QP failed (failover) may arrive
// twice: the target counts each part once and ignores parts of notifications it delivered.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

namespace mooncake::engine::rdma {

constexpr uint32_t kNotifySeqMask = 0xfffff;
constexpr uint32_t kMaxNotifyParts = 63;

inline uint32_t notifyWord(uint32_t parts, uint32_t part, uint32_t seq) {
  return (parts << 26) | ((part & 63) << 20) | (seq & kNotifySeqMask);
}

// The target's side, one per initiator connection (shared by its QPs).
class NotifyOrder {
 public:
  using Deliver = std::function<void(uint32_t channel, uint64_t tag)>;

  // One part arrived. Delivers (under this object's lock, so in order) every notification that
  // is now complete and next in sequence. False when the word is malformed.
  bool arrive(uint32_t word, uint32_t channel, uint64_t tag, const Deliver& deliver) {
    const uint32_t parts = word >> 26, part = (word >> 20) & 63, seq = word & kNotifySeqMask;
    if (parts == 0 || part >= parts) return false;
    std::lock_guard<std::mutex> g(mu_);
    // Behind the next one expected (up to half the sequence space back): delivered already.
    if (((seq - next_) & kNotifySeqMask) > kNotifySeqMask / 2) return true;
    Entry& e = waiting_[seq];
    e.parts = parts;
    e.channel = channel;
    e.tag = tag;
    e.seen |= 1ull << part;
    for (auto it = waiting_.find(next_); it != waiting_.end() && it->second.complete();
         it = waiting_.find(next_)) {
      deliver(it->second.channel, it->second.tag);
      waiting_.erase(it);
      next_ = (next_ + 1) & kNotifySeqMask;
    }
    return true;
  }

  // Notifications waiting for a part (or for an earlier one).
  size_t waiting() {
    std::lock_guard<std::mutex> g(mu_);
    return waiting_.size();
  }

 private:
  struct Entry {
    uint32_t parts = 0, channel = 0;
    uint64_t seen = 0;  // the parts that arrived, a bit each
    uint64_t tag = 0;
    bool complete() const { return __builtin_popcountll(seen) >= static_cast<int>(parts); }
  };
  std::mutex mu_;
  uint32_t next_ = 0;
  std::unordered_map<uint32_t, Entry> waiting_;
};

}  // namespace mooncake::engine::rdma
