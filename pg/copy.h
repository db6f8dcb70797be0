// Copies into and out of the shared comm buffers, tuned for what was measured on this
// machine (2 vCPUs, AMD EPYC, see docs in the report):
//   - plain stores into lines a peer core has just read pay a cross-core invalidation each
//     (~28 us for 64 KiB, ~1.6 ms for 4 MiB) while streaming (non-temporal) stores take
//     ~2 us / ~160 us, and the peer reads their result as fast: every write into a buffer
//     that peers read goes through copyToShared (the reduce kernels' shared output too);
//   - glibc's memcpy reads a peer's freshly written lines at half the speed of a plain
//     vector loop (64 KiB: 7.3 vs 4.5 us; 512 KiB: 59 vs 30 us): copies out of peers'
//     buffers go through copyFromShared.
// Streaming stores are weakly ordered: copyToShared ends with a store fence, so a flag
// posted after it (a release store) is seen after the data. AVX2 variants are chosen at
// run time where the CPU has them.
#pragma once

#include <cstddef>

namespace mooncake::pg {

// memcpy semantics (no overlap); streaming stores for the aligned body; fenced.
void copyToShared(void* dst, const void* src, size_t n);
// Same without the final fence (several copies, then one streamFence()).
void copyToSharedNoFence(void* dst, const void* src, size_t n);
void streamFence();
// memcpy semantics; reads a peer's buffer with a plain vector loop.
void copyFromShared(void* dst, const void* src, size_t n);

// Copies a peer's data into an op's output: streaming stores when the output is large (it
// leaves the cache anyway; no read-for-ownership), else copyFromShared. After streaming
// copies the op ends with streamFence() (pg's collectives, ep's recv_x).
inline void copyOut(void* dst, const void* src, size_t n, bool stream) {
  if (stream) {
    copyToSharedNoFence(dst, src, n);
  } else {
    copyFromShared(dst, src, n);
  }
}

namespace detail {
void streamCopyAvx2(void* dst, const void* src, size_t n);
void loadCopyAvx2(void* dst, const void* src, size_t n);
}  // namespace detail

}  // namespace mooncake::pg
