// combineRows built for AVX2 (see combine_rows.h); only called after a CPUID check.
#include "ep/kernels/combine_rows.h"

namespace mooncake::ep::kernels {
MC_EP_COMBINE_ROWS_ENTRY(combineRowsAvx2)
}  // namespace mooncake::ep::kernels
