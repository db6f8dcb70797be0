// BouncePool: registered host memory the engine lends to transports that need the local side
// of a request registered (rdma), for requests whose local memory is not (the store's and
// EP's callers hand the engine plain malloc'ed or torch memory). A write copies the bytes into
// a chunk and sends from there; a read lands in a chunk and is copied out. One pool per
// engine, created on first use (EngineContext::bounce), registered with every transport.
//
// Why a bounce pool and not a registration cache: a cached registration of memory the caller
// may free and the allocator may map again at the same address would keep pinning the old
// pages, and a later transfer would move the wrong bytes (UCX needs munmap hooks for this).
// Copies cost bandwidth but are always right; registered memory (allocate/registerMemory) is
// the fast path, and the services' hot buffers are registered.
//
// Thread-safe. Chunks are fixed size; acquire never blocks (a transport queues the request
// and retries when it releases a chunk).
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

namespace mooncake::engine {

class BouncePool {
 public:
  // [base, base + chunk_bytes * chunks) is registered memory owned by the engine.
  BouncePool(char* base, size_t chunk_bytes, size_t chunks)
      : base_(base), chunk_(chunk_bytes), count_(chunks) {
    free_.reserve(chunks);
    for (size_t i = chunks; i > 0; --i) free_.push_back(base + (i - 1) * chunk_bytes);
  }
  size_t chunkBytes() const { return chunk_; }
  size_t chunks() const { return count_; }
  char* base() const { return base_; }
  // A free chunk, or nullptr when all are lent.
  char* tryAcquire() {
    std::lock_guard<std::mutex> g(mu_);
    if (free_.empty()) return nullptr;
    char* c = free_.back();
    free_.pop_back();
    return c;
  }
  void release(char* chunk) {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(chunk);
  }
  size_t available() const {
    std::lock_guard<std::mutex> g(mu_);
    return free_.size();
  }
  bool contains(const void* p) const {
    auto* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + chunk_ * count_;
  }

 private:
  char* base_;
  size_t chunk_;
  size_t count_;
  mutable std::mutex mu_;
  std::vector<char*> free_;
};

}  // namespace mooncake::engine
