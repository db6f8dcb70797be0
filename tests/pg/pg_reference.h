// Test data and a plain C++ reference for reductions, independent of pg/reduce.cc: float16
// through the compiler's _Float16, bfloat16 through torch's rounding formula, integers
// through 64-bit arithmetic. Contributions are folded in rank order, exactly as the group
// promises, so results are compared bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pg/types.h"

namespace mooncake::pg::test {

// Every dtype and every op (reduceSupported says which pairs exist).
inline constexpr DataType kAllTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kInt16,   DataType::kInt32,   DataType::kInt64,
    DataType::kUInt8,   DataType::kBool,    DataType::kComplex64, DataType::kComplex128};
inline constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct,
                                       ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand,
                                       ReduceOp::kBor, ReduceOp::kBxor};

inline bool isComplex(DataType t) {
  return t == DataType::kComplex64 || t == DataType::kComplex128;
}

inline float f16ToF(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline uint16_t fToF16(float f) {
  _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline float bf16ToF(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t fToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Deterministic contents of rank r's buffer (values vary with index, rank and salt; floats
// are not integers, so rounding differences would show).
inline void fill(DataType t, void* buf, size_t count, int r, uint32_t salt) {
  for (size_t i = 0; i < count; ++i) {
    int64_t k = static_cast<int64_t>((r * 7 + i * 13 + salt * 5) % 23) - 11;
    double v = static_cast<double>(k) * 0.37 + static_cast<double>(r) * 0.011;
    switch (t) {
      case DataType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
      case DataType::kFloat64: static_cast<double*>(buf)[i] = v; break;
      case DataType::kFloat16: static_cast<uint16_t*>(buf)[i] = fToF16(static_cast<float>(v)); break;
      case DataType::kBFloat16: static_cast<uint16_t*>(buf)[i] = fToBf16(static_cast<float>(v)); break;
      case DataType::kInt8: static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(k * 11 + r); break;
      case DataType::kInt16: static_cast<int16_t*>(buf)[i] = static_cast<int16_t>(k * 2999 + r); break;
      case DataType::kInt32:
        static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(k * 190000007 + r * 3 + salt);
        break;
      case DataType::kInt64: static_cast<int64_t*>(buf)[i] = k * 1000000007LL + r; break;
      case DataType::kUInt8: static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(k * 23 + r * 5); break;
      case DataType::kBool: static_cast<uint8_t*>(buf)[i] = ((i + r + salt) % 3) == 0; break;
      case DataType::kComplex64:
        static_cast<float*>(buf)[2 * i] = static_cast<float>(v);
        static_cast<float*>(buf)[2 * i + 1] = static_cast<float>(-v * 0.5);
        break;
      case DataType::kComplex128:
        static_cast<double*>(buf)[2 * i] = v;
        static_cast<double*>(buf)[2 * i + 1] = -v * 0.5;
        break;
    }
  }
}

namespace detail {
template <class A>
A fold(ReduceOp op, A a, A b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return b < a ? b : a;
    case ReduceOp::kMax: return a < b ? b : a;
    default: return a;
  }
}
template <class T>
T foldInt(ReduceOp op, const std::vector<T>& v) {
  using U = uint64_t;
  int64_t n = static_cast<int64_t>(v.size());
  switch (op) {
    case ReduceOp::kSum: { U a = 0; for (T x : v) a += static_cast<U>(static_cast<int64_t>(x)); return static_cast<T>(a); }
    case ReduceOp::kProduct: { U a = 1; for (T x : v) a *= static_cast<U>(static_cast<int64_t>(x)); return static_cast<T>(a); }
    case ReduceOp::kAvg: { int64_t a = 0; for (T x : v) a += static_cast<int64_t>(x); return static_cast<T>(a / n); }
    case ReduceOp::kMin: { T a = v[0]; for (T x : v) a = x < a ? x : a; return a; }
    case ReduceOp::kMax: { T a = v[0]; for (T x : v) a = a < x ? x : a; return a; }
    case ReduceOp::kBand: { T a = v[0]; for (T x : v) a = static_cast<T>(a & x); return a; }
    case ReduceOp::kBor: { T a = v[0]; for (T x : v) a = static_cast<T>(a | x); return a; }
    case ReduceOp::kBxor: { T a = v[0]; for (size_t k = 1; k < v.size(); ++k) a = static_cast<T>(a ^ v[k]); return a; }
  }
  return 0;
}
template <class T>
void refInt(ReduceOp op, const std::vector<const void*>& ins, size_t i, void* out) {
  std::vector<T> v;
  for (const void* p : ins) v.push_back(static_cast<const T*>(p)[i]);
  static_cast<T*>(out)[i] = foldInt<T>(op, v);
}
template <class A, class Ld>
A refFloat(ReduceOp op, const std::vector<const void*>& ins, size_t i, Ld ld) {
  A a = ld(ins[0], i);
  for (size_t r = 1; r < ins.size(); ++r) a = fold<A>(op, a, ld(ins[r], i));
  if (op == ReduceOp::kAvg) a = a / static_cast<A>(ins.size());
  return a;
}
}  // namespace detail

// out[i] = ins[0][i] op ins[1][i] ... (complex: SUM/AVG only).
inline void refReduce(DataType t, ReduceOp op, const std::vector<const void*>& ins, size_t count,
                      void* out) {
  using namespace detail;
  for (size_t i = 0; i < count; ++i) {
    switch (t) {
      case DataType::kFloat32:
        static_cast<float*>(out)[i] = refFloat<float>(op, ins, i, [](const void* p, size_t k) { return static_cast<const float*>(p)[k]; });
        break;
      case DataType::kFloat64:
        static_cast<double*>(out)[i] = refFloat<double>(op, ins, i, [](const void* p, size_t k) { return static_cast<const double*>(p)[k]; });
        break;
      case DataType::kFloat16:
        static_cast<uint16_t*>(out)[i] = fToF16(refFloat<float>(op, ins, i, [](const void* p, size_t k) { return f16ToF(static_cast<const uint16_t*>(p)[k]); }));
        break;
      case DataType::kBFloat16:
        static_cast<uint16_t*>(out)[i] = fToBf16(refFloat<float>(op, ins, i, [](const void* p, size_t k) { return bf16ToF(static_cast<const uint16_t*>(p)[k]); }));
        break;
      case DataType::kInt8: refInt<int8_t>(op, ins, i, out); break;
      case DataType::kInt16: refInt<int16_t>(op, ins, i, out); break;
      case DataType::kInt32: refInt<int32_t>(op, ins, i, out); break;
      case DataType::kInt64: refInt<int64_t>(op, ins, i, out); break;
      case DataType::kUInt8: refInt<uint8_t>(op, ins, i, out); break;
      case DataType::kBool: {
        bool a = static_cast<const uint8_t*>(ins[0])[i] != 0;
        for (size_t r = 1; r < ins.size(); ++r) {
          bool b = static_cast<const uint8_t*>(ins[r])[i] != 0;
          if (op == ReduceOp::kSum || op == ReduceOp::kMax || op == ReduceOp::kBor) a = a || b;
          else if (op == ReduceOp::kBxor) a = a != b;
          else a = a && b;
        }
        static_cast<uint8_t*>(out)[i] = a ? 1 : 0;
        break;
      }
      case DataType::kComplex64:
        for (int c = 0; c < 2; ++c)
          static_cast<float*>(out)[2 * i + c] = refFloat<float>(op, ins, 2 * i + c, [](const void* p, size_t k) { return static_cast<const float*>(p)[k]; });
        break;
      case DataType::kComplex128:
        for (int c = 0; c < 2; ++c)
          static_cast<double*>(out)[2 * i + c] = refFloat<double>(op, ins, 2 * i + c, [](const void* p, size_t k) { return static_cast<const double*>(p)[k]; });
        break;
    }
  }
}

// Index of the first differing element, or -1.
inline int64_t firstDiff(const void* a, const void* b, size_t count, size_t es) {
  if (count == 0 || std::memcmp(a, b, count * es) == 0) return -1;
  for (size_t i = 0; i < count; ++i)
    if (std::memcmp(static_cast<const char*>(a) + i * es, static_cast<const char*>(b) + i * es, es) != 0)
      return static_cast<int64_t>(i);
  return -1;
}

}  // namespace mooncake::pg::test
