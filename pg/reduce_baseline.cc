// Reduction kernels for baseline x86-64 (or any other architecture): scalar float16
// conversion, everything else auto-vectorised with the default instruction set.
#include <cstddef>
#include <cstdint>

#include "pg/float16.h"

namespace mooncake::pg::baseline {
inline void h2fBlock(const uint16_t* __restrict s, float* __restrict d, size_t m) {
  for (size_t k = 0; k < m; ++k) d[k] = detail::halfToFloatInline(s[k]);
}
inline void f2hBlock(const float* __restrict s, uint16_t* __restrict d, size_t m) {
  for (size_t k = 0; k < m; ++k) d[k] = detail::floatToHalfInline(s[k]);
}
}  // namespace mooncake::pg::baseline

#define MC_PG_ISA_NS baseline
#include "pg/reduce_kernels.h"

namespace mooncake::pg {
void reduceBaseline(void* d, void* d2, const void* const* s, int n, size_t c, DataType t,
                    ReduceOp op, bool sd) {
  baseline::reduceImpl(d, d2, s, n, c, t, op, sd);
}
}  // namespace mooncake::pg
