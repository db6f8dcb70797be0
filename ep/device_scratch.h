// The kernels' scratch of an EP buffer in GPU memory (ep/ll_device.cc allocates it,
// ep/normal_device.cc uses it too): where each part lives.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/layout.h"

namespace mooncake::ep {

constexpr size_t kScratchCounts = 2 * kMaxSignals;  // self_count of each half

// Where the kernels' scratch lives in the buffer's scratch allocation (device memory).
struct Scratch {
  int32_t* self_count;  // [2][kMaxSignals]: low latency, kept from a dispatch's send to its recv
  int32_t* decision;    // [R]
  int32_t* error;       // [2]
  int32_t* active;      // [R]: normal mode (all 1)
  int32_t* counts;      // [R]: normal dispatch
  int32_t* toks;        // the blocks' token lists
};
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }
inline size_t scratchSlot(int R) { return align256(static_cast<size_t>(R) * 4 + 8); }
// Fixed part: self_count, four slots of R + 2 words (decision, error, active, counts), and
// four outcome slots (ep/ll_stream.cc); then the token lists.
inline size_t scratchFixed(int R) { return kScratchCounts * 4 + 8 * scratchSlot(R); }
inline Scratch scratchAt(char* base, int R) {
  const size_t slot = scratchSlot(R);
  char* p = base + kScratchCounts * 4;
  return Scratch{reinterpret_cast<int32_t*>(base), reinterpret_cast<int32_t*>(p),
                 reinterpret_cast<int32_t*>(p + slot), reinterpret_cast<int32_t*>(p + 2 * slot),
                 reinterpret_cast<int32_t*>(p + 3 * slot),
                 reinterpret_cast<int32_t*>(p + 8 * slot)};
}

}  // namespace mooncake::ep
