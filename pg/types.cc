#include "pg/types.h"

namespace mooncake::pg {

size_t dtypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kInt16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUInt8: return 1;
    case DataType::kBool: return 1;
    case DataType::kComplex64: return 8;
    case DataType::kComplex128: return 16;
  }
  return 0;
}

const char* dtypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kBool: return "bool";
    case DataType::kComplex64: return "complex64";
    case DataType::kComplex128: return "complex128";
  }
  return "unknown";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "unknown";
}

// What torch defines per dtype (see pg/reduce.h for the semantics of each pair):
//   floating (f32, f64, f16, bf16): SUM AVG PRODUCT MIN MAX            (no bitwise ops)
//   integers (i8..i64, u8):         SUM AVG PRODUCT MIN MAX BAND BOR BXOR
//                                   (AVG = exact sum / size, truncated toward zero, as NCCL;
//                                    gloo has no AVG at all)
//   bool:                           SUM PRODUCT MIN MAX BAND BOR BXOR  (logical; no AVG)
//   complex:                        SUM AVG PRODUCT                     (no ordering, no bits)
bool reduceSupported(DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return op != ReduceOp::kBand && op != ReduceOp::kBor && op != ReduceOp::kBxor;
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32:
    case DataType::kInt64:
    case DataType::kUInt8:
      return true;
    case DataType::kBool:
      return op != ReduceOp::kAvg;
    case DataType::kComplex64:
    case DataType::kComplex128:
      return op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kProduct;
  }
  return false;
}

}  // namespace mooncake::pg
