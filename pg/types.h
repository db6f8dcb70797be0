// Data types and reduce operations of the process group (no torch here: torch_ext maps
// at::ScalarType / c10d::ReduceOp onto these).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake::pg {

enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
  kComplex64,
  kComplex128,
};

enum class ReduceOp : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

size_t dtypeSize(DataType t);
const char* dtypeName(DataType t);
const char* reduceOpName(ReduceOp op);
// Whether `op` is defined for `t` (as torch defines it: bitwise ops on integers and bool,
// MIN/MAX not on complex, AVG not on bool/integers is allowed by gloo? see reduce.cc).
bool reduceSupported(DataType t, ReduceOp op);

}  // namespace mooncake::pg
