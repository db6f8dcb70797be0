#include "ep/layout.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "ep/kernels/combine_rows.h"

namespace mooncake::ep {

size_t dtypeBytes(DType t) {
  return t == DType::kBFloat16 ? 2 : t == DType::kFloat32 ? 4 : 1;
}
const char* dtypeName(DType t) {
  return t == DType::kBFloat16 ? "bfloat16" : t == DType::kFloat32 ? "float32" : "fp8 (e4m3)";
}

BufferGeometry::BufferGeometry(size_t total_bytes, int world) : total_(total_bytes), world_(world) {
  if (world < 1 || world > kMaxRanks) {
    std::ostringstream os;
    os << "ep buffer: world size " << world << " outside [1, " << kMaxRanks << "]";
    throw std::invalid_argument(os.str());
  }
  size_t fixed = kHeaderBytes + 2 * (kSignalBytes + kMailboxBytes);
  if (total_bytes < fixed + 2 * 2 * kAlign) {
    std::ostringstream os;
    os << "ep buffer: " << total_bytes
       << " bytes cannot hold the header, signal words and mailboxes (" << fixed
       << " bytes) plus data; use Buffer.get_ep_buffer_size_hint()";
    throw std::invalid_argument(os.str());
  }
  // Two halves of [signals | mailboxes | dispatch region | combine region], regions cache-line
  // sized.
  region_ = (total_bytes - fixed) / 4 / kAlign * kAlign;
  half_ = kSignalBytes + kMailboxBytes + 2 * region_;
}

bool BufferGeometry::isSignalRange(size_t off, size_t len) const {
  for (int h = 0; h < 2; ++h) {
    size_t b = halfBase(h);
    if (off >= b && len <= kSignalBytes && off - b <= kSignalBytes - len) return true;
  }
  return false;
}

LowLatencyLayout LowLatencyLayout::make(int world, int experts, int64_t max_tokens, int64_t hidden,
                                        DType t) {
  LowLatencyLayout l;
  l.world = world;
  l.experts = experts;
  l.local_experts = experts / world;
  l.max_tokens = max_tokens;
  l.row_stride = rowStride(hidden, t);
  size_t slots = static_cast<size_t>(experts) * static_cast<size_t>(max_tokens);  // L*R*M
  l.src_base = slots * l.row_stride;
  l.dispatch_bytes = alignUp(l.src_base + slots * 4, kAlign);
  l.combine_bytes = slots * l.row_stride;
  return l;
}

NormalLayout NormalLayout::make(size_t region_bytes, int world, int topk, int64_t hidden, DType t) {
  NormalLayout n;
  n.world = world;
  n.topk = topk;
  n.row_stride = rowStride(hidden, t);
  size_t per_row_dispatch = n.row_stride + 4 + static_cast<size_t>(topk) * 12;
  size_t per_row_combine = n.row_stride + static_cast<size_t>(topk) * 4;
  size_t per_row = std::max(per_row_dispatch, per_row_combine);
  size_t usable = region_bytes > 4 * kAlign ? region_bytes - 4 * kAlign : 0;
  n.capacity = static_cast<int64_t>(usable / (static_cast<size_t>(world) * per_row));
  size_t rows = static_cast<size_t>(world) * static_cast<size_t>(n.capacity);
  n.src_base = alignUp(rows * n.row_stride, kAlign);
  n.topk_base = alignUp(n.src_base + rows * 4, kAlign);
  n.weight_base = alignUp(n.topk_base + rows * topk * 8, kAlign);
  n.cweight_base = alignUp(rows * n.row_stride, kAlign);
  return n;
}

size_t sizeHint(int64_t max_tokens, int64_t hidden, int world, int experts) {
  if (max_tokens < 0 || hidden <= 0 || world <= 0 || experts <= 0) {
    std::ostringstream os;
    os << "get_ep_buffer_size_hint: bad arguments M=" << max_tokens << " H=" << hidden
       << " R=" << world << " E=" << experts;
    throw std::invalid_argument(os.str());
  }
  // float32 rows so that either dtype fits; pages never touched cost no memory.
  LowLatencyLayout l = LowLatencyLayout::make(world, experts, std::max<int64_t>(max_tokens, 1),
                                              hidden, DType::kFloat32);
  // Normal mode with T <= M and K <= kHintMaxTopk: M rows per source plus their metadata.
  const size_t normal = static_cast<size_t>(world) * static_cast<size_t>(l.max_tokens) *
                            (l.row_stride + 4 + 12 * kHintMaxTopk) +
                        8 * kAlign;
  size_t region = alignUp(std::max({l.dispatch_bytes, l.combine_bytes, normal}), kAlign);
  return kHeaderBytes + 2 * (kSignalBytes + kMailboxBytes + 2 * region);
}

void validateTopk(const int64_t* topk_idx, int64_t tokens, int topk, int experts) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t* row = topk_idx + t * topk;
    for (int k = 0; k < topk; ++k) {
      int64_t e = row[k];
      if (e < -1 || e >= experts) {
        std::ostringstream os;
        os << "topk_idx[" << t << "][" << k << "] = " << e
           << " is not an expert id (expected -1 or "
           << "0.." << experts - 1 << ")";
        throw std::invalid_argument(os.str());
      }
      if (e < 0) continue;
      for (int j = 0; j < k; ++j) {
        if (row[j] == e) {
          std::ostringstream os;
          os << "topk_idx[" << t << "] names expert " << e << " twice (columns " << j << " and "
             << k << ")";
          throw std::invalid_argument(os.str());
        }
      }
    }
  }
}

void dispatchLayout(const int64_t* topk_idx, int64_t tokens, int topk, int experts, int world,
                    int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                    uint8_t* is_token_in_rank) {
  int local = experts / world;
  std::fill(tokens_per_rank, tokens_per_rank + world, 0);
  std::fill(tokens_per_expert, tokens_per_expert + experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    uint8_t* in_rank = is_token_in_rank + t * world;
    std::fill(in_rank, in_rank + world, 0);
    for (int k = 0; k < topk; ++k) {
      int64_t e = topk_idx[t * topk + k];
      if (e < 0) continue;
      ++tokens_per_expert[e];
      in_rank[ownerOf(e, local)] = 1;
    }
    for (int r = 0; r < world; ++r) tokens_per_rank[r] += in_rank[r];
  }
}

void gatherRows(char* dst, size_t dst_stride, const char* src, size_t row_bytes, const int32_t* idx,
                size_t n) {
  if (dst_stride == row_bytes) {
    forEachRun(idx, n, [&](size_t j, size_t c) {
      __builtin_memcpy(dst + j * row_bytes, src + static_cast<size_t>(idx[j]) * row_bytes,
                       c * row_bytes);
    });
    return;
  }
  for (size_t j = 0; j < n; ++j)
    __builtin_memcpy(dst + j * dst_stride, src + static_cast<size_t>(idx[j]) * row_bytes,
                     row_bytes);
}

namespace kernels {
MC_EP_COMBINE_ROWS_ENTRY(combineRowsBaseline)
}  // namespace kernels

void combineRows(void* out, const void* const* rows, const float* weights, int n, DType t,
                 int64_t hidden) {
#if defined(MC_EP_HAVE_AVX2_KERNELS)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return kernels::combineRowsAvx2(out, rows, weights, n, t, hidden);
#endif
  kernels::combineRowsBaseline(out, rows, weights, n, t, hidden);
}

}  // namespace mooncake::ep
