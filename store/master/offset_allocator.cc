#include "store/master/offset_allocator.h"

#include <algorithm>
#include <cassert>

namespace mooncake::store {

namespace {

inline int msb64(uint64_t x) { return 63 - __builtin_clzll(x); }
inline int lsb64(uint64_t x) { return __builtin_ctzll(x); }
inline int lsb32(uint32_t x) { return __builtin_ctz(x); }

// Smallest size (units) of list (fl, sl).
[[maybe_unused]] uint64_t classMin(int fl, int sl) {
  if (fl == 0) return static_cast<uint64_t>(sl);
  int msb = fl + OffsetAllocator::kSlLog2 - 1;
  return (uint64_t{1} << msb) + (static_cast<uint64_t>(sl) << (msb - OffsetAllocator::kSlLog2));
}

}  // namespace

OffsetAllocator::OffsetAllocator(uint64_t capacity, uint64_t granularity)
    : gran_(granularity == 0 ? 1 : granularity) {
  assert((gran_ & (gran_ - 1)) == 0 && "granularity must be a power of two");
  gran_shift_ = msb64(gran_);
  units_ = capacity >> gran_shift_;
  for (auto& row : heads_)
    for (auto& h : row) h = kInvalidNode;
  if (units_ > 0) {
    uint32_t n = newNode();
    nodes_[n].offset = 0;
    nodes_[n].size = units_;
    insertFree(n);
  }
}

// Size classes: sizes below kSlCount units map linearly to (0, size); larger sizes map to
// (log2(size) - kSlLog2 + 1, the kSlLog2 bits below the leading one).
void OffsetAllocator::mapping(uint64_t units, int* fl, int* sl) {
  if (units < static_cast<uint64_t>(kSlCount)) {
    *fl = 0;
    *sl = static_cast<int>(units);
    return;
  }
  int msb = msb64(units);
  *fl = msb - kSlLog2 + 1;
  *sl = static_cast<int>((units >> (msb - kSlLog2)) ^ (uint64_t{1} << kSlLog2));
}

uint32_t OffsetAllocator::newNode() {
  uint32_t n;
  if (!spare_nodes_.empty()) {
    n = spare_nodes_.back();
    spare_nodes_.pop_back();
    nodes_[n] = Node{};
  } else {
    n = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[n].alive = true;
  return n;
}

void OffsetAllocator::releaseNode(uint32_t n) {
  nodes_[n].alive = false;
  nodes_[n].used = false;
  spare_nodes_.push_back(n);
}

void OffsetAllocator::insertFree(uint32_t n) {
  Node& node = nodes_[n];
  int fl, sl;
  mapping(node.size, &fl, &sl);
  node.used = false;
  node.prev_free = kInvalidNode;
  node.next_free = heads_[fl][sl];
  if (node.next_free != kInvalidNode) nodes_[node.next_free].prev_free = n;
  heads_[fl][sl] = n;
  fl_bitmap_ |= uint64_t{1} << fl;
  sl_bitmap_[fl] |= 1u << sl;
  ++free_blocks_;
}

void OffsetAllocator::removeFree(uint32_t n) {
  Node& node = nodes_[n];
  int fl, sl;
  mapping(node.size, &fl, &sl);
  if (node.prev_free != kInvalidNode) {
    nodes_[node.prev_free].next_free = node.next_free;
  } else {
    heads_[fl][sl] = node.next_free;
    if (node.next_free == kInvalidNode) {
      sl_bitmap_[fl] &= ~(1u << sl);
      if (sl_bitmap_[fl] == 0) fl_bitmap_ &= ~(uint64_t{1} << fl);
    }
  }
  if (node.next_free != kInvalidNode) nodes_[node.next_free].prev_free = node.prev_free;
  node.prev_free = node.next_free = kInvalidNode;
  --free_blocks_;
}

uint32_t OffsetAllocator::findFit(uint64_t units) const {
  // Good fit: round the request up to the next class boundary, so that every block of the
  // class found is large enough.
  uint64_t rounded = units;
  if (units >= static_cast<uint64_t>(kSlCount)) {
    uint64_t step = uint64_t{1} << (msb64(units) - kSlLog2);
    rounded = units + step - 1;
    if (rounded < units) rounded = units;  // overflow: only the fallback can help
  }
  int fl, sl;
  mapping(rounded, &fl, &sl);
  if (fl < kFlCount) {
    uint32_t sl_map = sl_bitmap_[fl] & (~0u << sl);
    if (sl_map == 0) {
      uint64_t fl_map = (fl + 1 < 64) ? (fl_bitmap_ & (~uint64_t{0} << (fl + 1))) : 0;
      if (fl_map != 0) {
        int f = lsb64(fl_map);
        return heads_[f][lsb32(sl_bitmap_[f])];
      }
    } else {
      return heads_[fl][lsb32(sl_map)];
    }
  }
  // Fallback: the request's own class may hold a block that fits; look at a bounded number.
  mapping(units, &fl, &sl);
  uint32_t n = heads_[fl][sl];
  for (int i = 0; i < kFallbackScan && n != kInvalidNode; ++i, n = nodes_[n].next_free)
    if (nodes_[n].size >= units) return n;
  return kInvalidNode;
}

uint32_t OffsetAllocator::splitRaw(uint32_t n, uint64_t units) {
  uint32_t rest = newNode();  // may reallocate nodes_: re-take references below
  Node& a = nodes_[n];
  Node& b = nodes_[rest];
  b.offset = a.offset + units;
  b.size = a.size - units;
  b.used = a.used;
  b.prev_phys = n;
  b.next_phys = a.next_phys;
  if (a.next_phys != kInvalidNode) nodes_[a.next_phys].prev_phys = rest;
  a.next_phys = rest;
  a.size = units;
  return rest;
}

void OffsetAllocator::splitTail(uint32_t n, uint64_t units) {
  if (nodes_[n].size <= units) return;
  insertFree(splitRaw(n, units));
}

bool OffsetAllocator::liveUsed(const Allocation& a) const {
  if (a.node >= nodes_.size()) return false;
  const Node& node = nodes_[a.node];
  return node.alive && node.used && (node.offset << gran_shift_) == a.offset &&
         (node.size << gran_shift_) == a.size;
}

bool OffsetAllocator::carve(const Allocation& a, uint64_t offset, uint64_t size, Allocation* head,
                            Allocation* mid, Allocation* tail) {
  if (!liveUsed(a) || size == 0) return false;
  uint64_t lo = offset >> gran_shift_;
  uint64_t hi = (offset + size + gran_ - 1) >> gran_shift_;
  uint32_t n = a.node;
  const uint64_t start = nodes_[n].offset, end = start + nodes_[n].size;
  if (offset + size < offset || lo < start || hi > end || hi <= lo) return false;
  *head = *mid = *tail = Allocation{};
  auto describe = [&](uint32_t m) {
    return Allocation{nodes_[m].offset << gran_shift_, nodes_[m].size << gran_shift_, m};
  };
  if (lo > start) {
    uint32_t rest = splitRaw(n, lo - start);
    *head = describe(n);
    ++live_;
    n = rest;
  }
  if (hi < end) {
    uint32_t rest = splitRaw(n, hi - lo);
    *tail = describe(rest);
    ++live_;
  }
  *mid = describe(n);
  return true;
}

std::vector<OffsetAllocator::Allocation> OffsetAllocator::allocateAt(
    const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::vector<Allocation> out(ranges.size());
  uint32_t cur = kInvalidNode;
  for (uint32_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].alive && nodes_[i].offset == 0) cur = i;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const uint64_t off = ranges[r].first, size = ranges[r].second;
    if (size == 0 || (off & (gran_ - 1)) != 0 || off + size < off) continue;
    const uint64_t lo = off >> gran_shift_;
    const uint64_t hi = (off + size + gran_ - 1) >> gran_shift_;
    while (cur != kInvalidNode && nodes_[cur].offset + nodes_[cur].size <= lo)
      cur = nodes_[cur].next_phys;
    if (cur == kInvalidNode) break;
    if (nodes_[cur].used || nodes_[cur].offset > lo || nodes_[cur].offset + nodes_[cur].size < hi)
      continue;  // not entirely free
    removeFree(cur);
    if (lo > nodes_[cur].offset) {
      uint32_t rest = splitRaw(cur, lo - nodes_[cur].offset);
      insertFree(cur);  // the free part before the range
      cur = rest;
    }
    if (nodes_[cur].size > hi - lo) insertFree(splitRaw(cur, hi - lo));  // the free part after
    nodes_[cur].used = true;
    used_units_ += nodes_[cur].size;
    ++live_;
    out[r] = Allocation{lo << gran_shift_, (hi - lo) << gran_shift_, cur};
    cur = nodes_[cur].next_phys;
  }
  return out;
}

OffsetAllocator::Allocation OffsetAllocator::allocate(uint64_t size, uint64_t alignment) {
  Allocation out;
  if (size == 0 || units_ == 0) return out;
  if (alignment != 0 && (alignment & (alignment - 1)) != 0) return out;
  uint64_t units = (size >> gran_shift_) + ((size & (gran_ - 1)) != 0 ? 1 : 0);
  uint64_t align_units = alignment > gran_ ? (alignment >> gran_shift_) : 1;
  if (units > units_ || align_units > units_) return out;
  uint64_t need = units + (align_units - 1);  // worst-case padding in front
  if (need > units_) return out;

  uint32_t n = findFit(need);
  if (n == kInvalidNode) return out;
  removeFree(n);

  uint64_t start = nodes_[n].offset;
  uint64_t pad = (align_units - (start & (align_units - 1))) & (align_units - 1);
  if (pad > 0) {
    // The front padding becomes a free block of its own; its previous neighbour is used (no
    // two free blocks are adjacent), so nothing to merge.
    splitTail(n, pad);  // inserts the aligned remainder into the free lists ...
    uint32_t aligned = nodes_[n].next_phys;
    removeFree(aligned);  // ... take it back out
    insertFree(n);        // the padding is free
    n = aligned;
  }
  splitTail(n, units);
  Node& node = nodes_[n];
  node.used = true;
  used_units_ += node.size;
  ++live_;
  out.offset = node.offset << gran_shift_;
  out.size = node.size << gran_shift_;
  out.node = n;
  return out;
}

bool OffsetAllocator::free(const Allocation& a) {
  uint32_t n = a.node;
  if (n >= nodes_.size()) return false;
  Node* node = &nodes_[n];
  if (!node->alive || !node->used || (node->offset << gran_shift_) != a.offset ||
      (node->size << gran_shift_) != a.size)
    return false;
  used_units_ -= node->size;
  --live_;
  node->used = false;
  // Merge with a free physical predecessor: it absorbs this block.
  uint32_t prev = node->prev_phys;
  if (prev != kInvalidNode && !nodes_[prev].used) {
    removeFree(prev);
    Node& p = nodes_[prev];
    p.size += node->size;
    p.next_phys = node->next_phys;
    if (node->next_phys != kInvalidNode) nodes_[node->next_phys].prev_phys = prev;
    releaseNode(n);
    n = prev;
    node = &nodes_[n];
  }
  // Merge with a free physical successor: this block absorbs it.
  uint32_t next = node->next_phys;
  if (next != kInvalidNode && !nodes_[next].used) {
    removeFree(next);
    Node& s = nodes_[next];
    node->size += s.size;
    node->next_phys = s.next_phys;
    if (s.next_phys != kInvalidNode) nodes_[s.next_phys].prev_phys = n;
    releaseNode(next);
  }
  insertFree(n);
  return true;
}

uint64_t OffsetAllocator::largestFreeHint() const {
  if (fl_bitmap_ == 0) return 0;
  int fl = msb64(fl_bitmap_);
  int sl = 31 - __builtin_clz(sl_bitmap_[fl]);
  // The head of the top list is found by findFit's fallback scan, so its exact size is safe to
  // promise; classMin(fl, sl) would be safe through the good-fit path alone.
  uint64_t head = nodes_[heads_[fl][sl]].size;
  assert(head >= classMin(fl, sl));
  return head << gran_shift_;
}

bool OffsetAllocator::checkConsistency() const {
  // Find the first physical block: offset 0.
  uint64_t used = 0, live = 0, free_count = 0, expect_offset = 0;
  uint32_t first = kInvalidNode;
  for (uint32_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].alive && nodes_[i].offset == 0) first = i;
  if (units_ == 0) return first == kInvalidNode && fl_bitmap_ == 0;
  if (first == kInvalidNode || nodes_[first].prev_phys != kInvalidNode) return false;
  bool prev_free = false;
  uint64_t alive_nodes = 0;
  for (uint32_t n = first, prev = kInvalidNode; n != kInvalidNode;
       prev = n, n = nodes_[n].next_phys) {
    const Node& node = nodes_[n];
    if (!node.alive || node.prev_phys != prev || node.offset != expect_offset || node.size == 0)
      return false;
    if (!node.used && prev_free) return false;  // adjacent free blocks: a merge was missed
    prev_free = !node.used;
    expect_offset += node.size;
    ++alive_nodes;
    if (node.used) {
      used += node.size;
      ++live;
    } else {
      ++free_count;
      int fl, sl;
      mapping(node.size, &fl, &sl);
      if (!(sl_bitmap_[fl] & (1u << sl)) || !(fl_bitmap_ & (uint64_t{1} << fl))) return false;
      bool found = false;  // the block must be on its list
      for (uint32_t f = heads_[fl][sl]; f != kInvalidNode; f = nodes_[f].next_free)
        if (f == n) found = true;
      if (!found) return false;
    }
  }
  if (expect_offset != units_) return false;
  // Every list entry is a free block of the list's class; bitmaps match non-empty lists.
  uint64_t listed = 0;
  for (int fl = 0; fl < kFlCount; ++fl) {
    for (int sl = 0; sl < kSlCount; ++sl) {
      bool bit = (sl_bitmap_[fl] & (1u << sl)) != 0;
      if (bit != (heads_[fl][sl] != kInvalidNode)) return false;
      for (uint32_t f = heads_[fl][sl]; f != kInvalidNode; f = nodes_[f].next_free) {
        int a, b;
        mapping(nodes_[f].size, &a, &b);
        if (nodes_[f].used || !nodes_[f].alive || a != fl || b != sl) return false;
        ++listed;
      }
    }
    if (((fl_bitmap_ >> fl) & 1) != (sl_bitmap_[fl] != 0 ? 1u : 0u)) return false;
  }
  uint64_t spare_alive = 0;
  for (const Node& nd : nodes_) spare_alive += nd.alive ? 1 : 0;
  return used == used_units_ && live == live_ && free_count == free_blocks_ &&
         listed == free_count && spare_alive == alive_nodes;
}

}  // namespace mooncake::store
