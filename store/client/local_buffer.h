// LocalBuffer: a client's local buffer (Mooncake Store's local_buffer_size): registered engine
// memory that reads are delivered into and handed to the caller without a copy (get_buffer,
// batch_get_buffer, BufferPool leases). Leases are carved out with an offset allocator and
// returned when the caller drops them; a request that does not fit now is refused (nullopt),
// never waited for here.
//
// Threading: thread-safe. Lifetime: leases hold a shared_ptr to the buffer, and the buffer one to
// its engine, so the memory stays valid until the last lease is gone.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "engine/engine.h"
#include "store/master/error_codes.h"
#include "store/master/offset_allocator.h"

namespace mooncake::store {

class LocalBuffer : public std::enable_shared_from_this<LocalBuffer> {
 public:
  // `size` bytes from engine->allocate() (registered, shared-memory backed). The buffer keeps
  // the engine alive until its last lease is gone.
  static ErrorOr<std::shared_ptr<LocalBuffer>> create(
      std::shared_ptr<engine::TransferEngine> engine, uint64_t size);
  ~LocalBuffer();
  LocalBuffer(const LocalBuffer&) = delete;
  LocalBuffer& operator=(const LocalBuffer&) = delete;

  // A slice of the buffer; returned to it when the last copy of the lease is destroyed.
  class Lease {
   public:
    char* data() const { return data_; }
    uint64_t size() const { return size_; }

   private:
    friend class LocalBuffer;
    struct Slot;
    std::shared_ptr<Slot> slot_;
    char* data_ = nullptr;
    uint64_t size_ = 0;
  };

  // nullopt when `size` bytes do not fit now (or size is 0).
  std::optional<Lease> acquire(uint64_t size);
  uint64_t capacity() const { return size_; }
  uint64_t freeBytes() const;
  char* base() const { return base_; }

 private:
  LocalBuffer(std::shared_ptr<engine::TransferEngine> engine, char* base, uint64_t size);
  void release(const OffsetAllocator::Allocation& a);

  std::shared_ptr<engine::TransferEngine> engine_;
  char* base_;
  uint64_t size_;
  mutable std::mutex mu_;
  OffsetAllocator alloc_;  // guarded by mu_
};

}  // namespace mooncake::store
