// BufferPool: payload strings of messages that were consumed, kept for the next messages a
// transport receives (tcp), so that a steady stream of large messages (the process group's
// pieces) reuses memory instead of allocating, page-faulting and zero-filling a fresh
// buffer per message. Bounded in count and bytes; thread-safe.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace mooncake::engine {

class BufferPool {
 public:
  // Buffers smaller than this are not worth keeping (malloc serves them from its bins).
  static constexpr size_t kMinBytes = 64 << 10;
  static constexpr size_t kMaxBuffers = 32;
  static constexpr size_t kMaxBytes = 64 << 20;

  // A string of exactly len bytes (contents unspecified): the smallest kept one that holds
  // len and is at most twice as large (no fill when it was at least len long), else a new
  // zero-filled one.
  std::string take(size_t len) {
    if (len >= kMinBytes) {
      std::string s;
      {
        std::lock_guard<std::mutex> g(mu_);
        size_t best = kept_.size();
        for (size_t i = 0; i < kept_.size(); ++i) {
          const size_t cap = kept_[i].capacity();
          if (cap < len || cap / 2 > len) continue;
          if (best == kept_.size() || cap < kept_[best].capacity()) best = i;
        }
        if (best < kept_.size()) {
          s = std::move(kept_[best]);
          kept_[best] = std::move(kept_.back());
          kept_.pop_back();
          bytes_ -= s.capacity();
        }
      }
      if (s.capacity() >= len) {
        s.resize(len);
        return s;
      }
    }
    return std::string(len, '\0');
  }

  // Keeps s for a later take() if there is room.
  void give(std::string&& s) {
    const size_t cap = s.capacity();
    if (cap < kMinBytes) return;
    std::lock_guard<std::mutex> g(mu_);
    if (kept_.size() >= kMaxBuffers || bytes_ + cap > kMaxBytes) return;
    bytes_ += cap;
    kept_.push_back(std::move(s));
  }

 private:
  std::mutex mu_;
  std::vector<std::string> kept_;
  size_t bytes_ = 0;
};

}  // namespace mooncake::engine
