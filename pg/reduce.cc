#include "pg/reduce.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "pg/copy.h"
#include "pg/float16.h"

namespace mooncake::pg {

void reduceBaseline(void* d, void* d2, const void* const* s, int n, size_t c, DataType t,
                    ReduceOp op, bool sd);
#if defined(__x86_64__) && defined(MC_PG_HAVE_AVX2_KERNELS)
void reduceAvx2(void* d, void* d2, const void* const* s, int n, size_t c, DataType t,
                ReduceOp op, bool sd);
bool reduceFusedFloatAvx2(float* dst, float* dst2, const float* const* s, int n, size_t count,
                          ReduceOp op, bool stream_dst);
#endif

namespace {

using Kernel = void (*)(void*, void*, const void* const*, int, size_t, DataType, ReduceOp, bool);

struct Choice {
  Kernel fn;
  const char* name;
  bool fused_float = false;  // reduceFusedFloatAvx2 available
};

Choice choose() {
#if defined(__x86_64__) && defined(MC_PG_HAVE_AVX2_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return {&reduceAvx2, "avx2", true};
#endif
  return {&reduceBaseline, "baseline"};
}

const Choice& kernel() {
  static const Choice c = choose();
  return c;
}

}  // namespace

void reduceInto(void* dst, void* dst2, const void* const* srcs, int nsrc, size_t count,
                DataType t, ReduceOp op, bool stream_dst) {
  if (!reduceSupported(t, op))
    throw std::invalid_argument(std::string("mooncake pg: reduce op ") + reduceOpName(op) +
                                " is not supported for dtype " + dtypeName(t));
  if (nsrc < 1) throw std::invalid_argument("mooncake pg: reduceInto needs at least one input");
  if (count == 0) return;
  if (dst == nullptr && dst2 == nullptr) return;
  if (nsrc == 1) {  // identity for every op (AVG divides by 1)
    size_t bytes = count * dtypeSize(t);
    if (dst != nullptr && dst != srcs[0]) std::memmove(dst, srcs[0], bytes);
    if (dst2 != nullptr) copyToShared(dst2, srcs[0], bytes);
    return;
  }
#if defined(__x86_64__) && defined(MC_PG_HAVE_AVX2_KERNELS)
  if (t == DataType::kFloat32 && (dst2 != nullptr || stream_dst) && kernel().fused_float &&
      reduceFusedFloatAvx2(static_cast<float*>(dst), static_cast<float*>(dst2),
                           reinterpret_cast<const float* const*>(srcs), nsrc, count, op,
                           stream_dst)) {
    streamFence();
    return;
  }
#endif
  kernel().fn(dst, dst2, srcs, nsrc, count, t, op, stream_dst);
  if (dst2 != nullptr || stream_dst) streamFence();
}

const char* reduceIsa() { return kernel().name; }

float halfToFloat(uint16_t h) { return detail::halfToFloatInline(h); }
uint16_t floatToHalf(float f) { return detail::floatToHalfInline(f); }
float bf16ToFloat(uint16_t h) { return detail::bf16ToFloatInline(h); }
uint16_t floatToBf16(float f) { return detail::floatToBf16Inline(f); }

}  // namespace mooncake::pg
