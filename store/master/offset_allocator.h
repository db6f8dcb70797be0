// OffsetAllocator: hands out non-overlapping [offset, offset + size) ranges of one segment in
// O(1) time per allocate/free, as TLSF (two-level segregated fit, Masmano et al. 2004) does.
//
// The allocator manages offsets only; it never touches the segment's memory, so the master can
// keep one per mounted segment without mapping anything. Sizes are counted in units of the
// granularity (a power of two, 64 bytes by default): every returned offset is a multiple of it.
//
// How it works: free blocks live in segregated lists indexed by (first level = log2 of the size,
// second level = one of 2^kSlLog2 linear subdivisions of that power of two). Two bitmaps say
// which lists are non-empty, so "the smallest list whose every block is large enough" is two
// find-first-set instructions. Every block knows its physical neighbours; free() merges a block
// with free neighbours, so two free blocks are never adjacent.
//
// allocate() first looks for a list whose every block fits (good fit, O(1)); if none, it scans at
// most kFallbackScan blocks of the list that holds the request's own size class, so that a block
// of exactly the requested size (say, the whole of an empty segment) is found even though its
// class also holds smaller blocks. Worst-case time stays bounded.
//
// Thread safety: none; the owner (the master) serialises access.
#pragma once

#include <cstdint>
#include <vector>

namespace mooncake::store {

class OffsetAllocator {
 public:
  static constexpr uint32_t kInvalidNode = 0xffffffffu;
  static constexpr int kSlLog2 = 5;  // 32 second-level lists per power of two
  static constexpr int kSlCount = 1 << kSlLog2;
  static constexpr int kFlCount = 64 - kSlLog2 + 1;
  static constexpr int kFallbackScan = 16;

  // One live allocation. `node` identifies it to free(); offset/size are in bytes.
  struct Allocation {
    uint64_t offset = 0;
    uint64_t size = 0;  // bytes reserved (the request rounded up to the granularity)
    uint32_t node = kInvalidNode;
    bool valid() const { return node != kInvalidNode; }
  };

  // capacity: bytes managed, [0, capacity); a tail shorter than one granule is never used.
  // granularity: power of two >= 1.
  explicit OffsetAllocator(uint64_t capacity, uint64_t granularity = 64);

  OffsetAllocator(const OffsetAllocator&) = delete;
  OffsetAllocator& operator=(const OffsetAllocator&) = delete;
  OffsetAllocator(OffsetAllocator&&) = default;
  OffsetAllocator& operator=(OffsetAllocator&&) = default;

  // Reserves `size` bytes (> 0) starting at a multiple of `alignment` (a power of two; values
  // below the granularity mean the granularity). Returns an invalid Allocation when no free range
  // fits: never an overlapping one.
  Allocation allocate(uint64_t size, uint64_t alignment = 0);

  // Releases an allocation returned by allocate(). Returns false (and changes nothing) for an
  // allocation that is not live: already freed, or not from this allocator.
  bool free(const Allocation& a);

  // Splits the live allocation `a` into up to three live ones: before, [offset, offset + size)
  // and after (rounded out to the granularity). `mid` gets the middle one; `head`/`tail` the
  // others (invalid when empty). False, nothing changed, when the range is not inside `a` or
  // `a` is not live. The store master cuts published objects out of a writer's reserved slab
  // this way. O(1).
  bool carve(const Allocation& a, uint64_t offset, uint64_t size, Allocation* head, Allocation* mid,
             Allocation* tail);

  // Reserves exact ranges {offset, size} (sorted by offset, not overlapping). Each result is
  // the range's allocation, or an invalid one when the range is not entirely free. One walk
  // over the blocks: O(blocks + ranges). The master rebuilds a segment's allocator from the
  // records its owner reports (after a failover) this way.
  std::vector<Allocation> allocateAt(const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

  uint64_t capacity() const { return units_ * gran_; }
  uint64_t granularity() const { return gran_; }
  uint64_t usedBytes() const { return used_units_ * gran_; }
  uint64_t freeBytes() const { return (units_ - used_units_) * gran_; }
  uint64_t liveAllocations() const { return live_; }
  uint64_t freeBlocks() const { return free_blocks_; }

  // A size (bytes) that allocate() with the default alignment is sure to satisfy right now: the
  // size of one block of the largest non-empty size class. 0 when nothing is free. O(1).
  uint64_t largestFreeHint() const;

  // Walks every block and checks the invariants (neighbour links, no adjacent free blocks,
  // lists and bitmaps agree, byte counts add up). O(blocks); for tests.
  bool checkConsistency() const;

 private:
  struct Node {
    uint64_t offset = 0;  // units
    uint64_t size = 0;    // units
    uint32_t prev_phys = kInvalidNode;
    uint32_t next_phys = kInvalidNode;
    uint32_t prev_free = kInvalidNode;
    uint32_t next_free = kInvalidNode;
    bool used = false;
    bool alive = false;
  };

  static void mapping(uint64_t units, int* fl, int* sl);
  uint32_t newNode();
  void releaseNode(uint32_t n);
  void insertFree(uint32_t n);
  void removeFree(uint32_t n);
  uint32_t findFit(uint64_t units) const;
  // Cuts the first `units` off free-list-detached block n; the rest becomes a free block.
  void splitTail(uint32_t n, uint64_t units);
  // Cuts the first `units` off block n; the rest becomes a new block with n's used flag, on no
  // list. Returns the new block.
  uint32_t splitRaw(uint32_t n, uint64_t units);
  bool liveUsed(const Allocation& a) const;

  uint64_t gran_;
  int gran_shift_;
  uint64_t units_;
  uint64_t used_units_ = 0;
  uint64_t live_ = 0;
  uint64_t free_blocks_ = 0;
  uint64_t fl_bitmap_ = 0;
  uint32_t sl_bitmap_[kFlCount] = {};
  uint32_t heads_[kFlCount][kSlCount];
  std::vector<Node> nodes_;
  std::vector<uint32_t> spare_nodes_;
};

}  // namespace mooncake::store
