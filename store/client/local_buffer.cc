#include "store/client/local_buffer.h"

namespace mooncake::store {

struct LocalBuffer::Lease::Slot {
  std::shared_ptr<LocalBuffer> owner;
  OffsetAllocator::Allocation alloc;
  ~Slot() { owner->release(alloc); }
};

ErrorOr<std::shared_ptr<LocalBuffer>> LocalBuffer::create(
    std::shared_ptr<engine::TransferEngine> engine, uint64_t size) {
  if (engine == nullptr || size == 0) return ErrorCode::INVALID_PARAMS;
  auto mem = engine->allocate(size);
  if (!mem.ok()) return ErrorCode::NO_AVAILABLE_HANDLE;
  return std::shared_ptr<LocalBuffer>(
      new LocalBuffer(std::move(engine), static_cast<char*>(*mem), size));
}

LocalBuffer::LocalBuffer(std::shared_ptr<engine::TransferEngine> engine, char* base,
                         uint64_t size)
    : engine_(std::move(engine)), base_(base), size_(size), alloc_(size, 64) {}

LocalBuffer::~LocalBuffer() { (void)engine_->free(base_); }

std::optional<LocalBuffer::Lease> LocalBuffer::acquire(uint64_t size) {
  if (size == 0) return std::nullopt;
  OffsetAllocator::Allocation a;
  {
    std::lock_guard<std::mutex> g(mu_);
    a = alloc_.allocate(size);
  }
  if (!a.valid()) return std::nullopt;
  Lease l;
  l.slot_ = std::make_shared<Lease::Slot>();
  l.slot_->owner = shared_from_this();
  l.slot_->alloc = a;
  l.data_ = base_ + a.offset;
  l.size_ = size;
  return l;
}

uint64_t LocalBuffer::freeBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return alloc_.freeBytes();
}

void LocalBuffer::release(const OffsetAllocator::Allocation& a) {
  std::lock_guard<std::mutex> g(mu_);
  alloc_.free(a);
}

}  // namespace mooncake::store
