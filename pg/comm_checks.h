// The op entry points' argument checks and op signatures (pg/communicator.cc and
// pg/communicator_stream.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pg/comm_impl.h"

namespace mooncake::pg {

// The size users see: one past the highest active slot in an elastic group.
int pubSize(const Communicator::Impl& c);

inline void checkRoot(const Communicator::Impl& c, int root, const char* op) {
  if (root < 0 || root >= pubSize(c))
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": root " +
                                std::to_string(root) + " is outside the group of size " +
                                std::to_string(pubSize(c)));
}
inline void checkReduce(DataType t, ReduceOp rop, const char* op) {
  if (!reduceSupported(t, rop))
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": reduce op " +
                                reduceOpName(rop) + " is not defined for dtype " + dtypeName(t));
}
inline OpSig typedSig(OpKind kind, size_t count, DataType t, ReduceOp op, int root = -1) {
  OpSig s;
  s.kind = kind;
  s.dtype = static_cast<uint8_t>(static_cast<int>(t) + 1);
  s.redop = static_cast<uint8_t>(static_cast<int>(op) + 1);
  s.count = count;
  s.root = root;
  return s;
}

inline OpSig bytesSig(OpKind kind, size_t bytes, int root = -1) {
  OpSig s;
  s.kind = kind;
  s.dtype = SigDtype::current();  // 0 (bytes) unless the caller named a dtype
  s.count = bytes;
  s.root = root;
  return s;
}

inline uint64_t hashSizes(const std::vector<size_t>& v) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
  for (size_t x : v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(x) >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

inline void checkPtr(const void* p, size_t bytes, const char* what, const char* op) {
  if (p == nullptr && bytes > 0)
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": null " + what +
                                " buffer for " + std::to_string(bytes) + " bytes");
}

// Whether [a, a + alen) and [b, b + blen) do not overlap.
inline bool apart(const void* a, size_t alen, const void* b, size_t blen) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return x + alen <= y || y + blen <= x;
}

// An all-to-all's split vectors (bytes and offsets of the blocks to and from each of n ranks)
// against its buffers: one entry per rank, no null buffer under a block, input and output
// apart. Returns the extents of in and out that the blocks use. std::invalid_argument.
inline std::pair<size_t, size_t> checkSplits(size_t n, const void* in,
                                             const std::vector<size_t>& send_bytes,
                                             const std::vector<size_t>& send_offsets, void* out,
                                             const std::vector<size_t>& recv_bytes,
                                             const std::vector<size_t>& recv_offsets) {
  if (send_bytes.size() != n || send_offsets.size() != n || recv_bytes.size() != n ||
      recv_offsets.size() != n)
    throw std::invalid_argument("mooncake pg: alltoall: split vectors must have one entry per "
                                "rank (" + std::to_string(n) + ")");
  size_t in_end = 0, out_end = 0;
  for (size_t j = 0; j < n; ++j) {
    if (send_bytes[j] > 0) in_end = std::max(in_end, send_offsets[j] + send_bytes[j]);
    if (recv_bytes[j] > 0) out_end = std::max(out_end, recv_offsets[j] + recv_bytes[j]);
  }
  checkPtr(in, in_end, "input", "alltoall");
  checkPtr(out, out_end, "output", "alltoall");
  if (in_end > 0 && out_end > 0 && !apart(in, in_end, out, out_end))
    throw std::invalid_argument("mooncake pg: alltoall: input and output buffers overlap");
  return {in_end, out_end};
}

}  // namespace mooncake::pg
