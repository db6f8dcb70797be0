// Reduction kernels, compiled once per instruction set: a .cc defines MC_PG_ISA_NS and the
// float16 block conversions h2fBlock/f2hBlock inside that namespace, then includes this
// file. Internal to pg/reduce*.cc; see pg/reduce.h for the semantics.
//
// Shape: data is processed in blocks of kBlock elements so that a block's accumulator and
// result stay in L1 (the optional second destination is then written from cache). The
// inner loops are plain loops over __restrict pointers that the compiler vectorises.
// A destination may be exactly one of the sources: each block reads every source before
// it writes the destination, and element-wise loops read element k before writing it.
#ifndef MC_PG_ISA_NS
#error "define MC_PG_ISA_NS before including pg/reduce_kernels.h"
#endif

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "pg/copy.h"
#include "pg/float16.h"
#include "pg/types.h"

namespace mooncake::pg::MC_PG_ISA_NS {

constexpr size_t kBlock = 1024;

// ---- element operations on the accumulation type ----
template <class A>
using Wide = std::conditional_t<std::is_integral_v<A> && (sizeof(A) < sizeof(unsigned)),
                                unsigned, A>;
struct OpSum {
  template <class A> static A f(A a, A b) { return static_cast<A>(Wide<A>(a) + Wide<A>(b)); }
};
struct OpProd {
  template <class A> static A f(A a, A b) { return static_cast<A>(Wide<A>(a) * Wide<A>(b)); }
};
struct OpMin {
  template <class A> static A f(A a, A b) { return b < a ? b : a; }
};
struct OpMax {
  template <class A> static A f(A a, A b) { return a < b ? b : a; }
};
struct OpAnd {
  template <class A> static A f(A a, A b) { return static_cast<A>(a & b); }
};
struct OpOr {
  template <class A> static A f(A a, A b) { return static_cast<A>(a | b); }
};
struct OpXor {
  template <class A> static A f(A a, A b) { return static_cast<A>(a ^ b); }
};

template <class Op, class A>
inline void op2(A* __restrict d, const A* __restrict a, const A* __restrict b, size_t m) {
  for (size_t k = 0; k < m; ++k) d[k] = Op::template f<A>(a[k], b[k]);
}
template <class Op, class A>
inline void opAcc(A* __restrict d, const A* __restrict b, size_t m) {
  for (size_t k = 0; k < m; ++k) d[k] = Op::template f<A>(d[k], b[k]);
}
template <class A>
inline void divBy(A* __restrict d, size_t m, int n) {
  const A dn = static_cast<A>(n);
  for (size_t k = 0; k < m; ++k) d[k] = d[k] / dn;
}

// T == accumulation type (float, double, integers without AVG, bool as uint8).
// dst == nullptr: the result goes to dst2 only (through a block on the stack).
template <class T, class Op, bool kAvg>
void directN(T* dst, T* dst2, const T* const* s, int n, size_t count, bool sd) {
  alignas(64) T acc[kBlock];
  alignas(64) T tmp[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    size_t m = std::min(kBlock, count - b);
    T* d = dst != nullptr && !sd ? dst + b : tmp;
    if (n == 2) {
      op2<Op>(d, s[0] + b, s[1] + b, m);
    } else {
      op2<Op>(acc, s[0] + b, s[1] + b, m);
      for (int j = 2; j < n - 1; ++j) opAcc<Op>(acc, s[j] + b, m);
      op2<Op>(d, acc, s[n - 1] + b, m);
    }
    if (kAvg) divBy(d, m, n);
    if (sd && dst != nullptr) copyToSharedNoFence(dst + b, d, m * sizeof(T));
    if (dst2 != nullptr) copyToSharedNoFence(dst2 + b, d, m * sizeof(T));
  }
}

// ---- converting kernels: storage T, accumulation A ----
struct CvtHalf {
  static void in(const uint16_t* s, float* d, size_t m) { h2fBlock(s, d, m); }
  static void out(const float* s, uint16_t* d, size_t m) { f2hBlock(s, d, m); }
};
struct CvtBf16 {
  static void in(const uint16_t* __restrict s, float* __restrict d, size_t m) {
    for (size_t k = 0; k < m; ++k) d[k] = detail::floatOf(static_cast<uint32_t>(s[k]) << 16);
  }
  static void out(const float* __restrict s, uint16_t* __restrict d, size_t m) {
    for (size_t k = 0; k < m; ++k) {
      uint32_t x = detail::bitsOf(s[k]);
      uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
      d[k] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
    }
  }
};
template <class T, class A>
struct CvtWiden {
  static void in(const T* __restrict s, A* __restrict d, size_t m) {
    for (size_t k = 0; k < m; ++k) d[k] = static_cast<A>(s[k]);
  }
  static void out(const A* __restrict s, T* __restrict d, size_t m) {
    for (size_t k = 0; k < m; ++k) d[k] = static_cast<T>(s[k]);
  }
};

template <class T, class A, class Cvt, class Op, bool kAvg>
void convertedN(T* dst, T* dst2, const T* const* s, int n, size_t count, bool sd) {
  alignas(64) A acc[kBlock];
  alignas(64) A tmp[kBlock];
  alignas(64) T res[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    size_t m = std::min(kBlock, count - b);
    Cvt::in(s[0] + b, acc, m);
    for (int j = 1; j < n; ++j) {
      Cvt::in(s[j] + b, tmp, m);
      opAcc<Op>(acc, tmp, m);
    }
    if (kAvg) divBy(acc, m, n);
    T* d = dst != nullptr && !sd ? dst + b : res;
    Cvt::out(acc, d, m);
    if (sd && dst != nullptr) copyToSharedNoFence(dst + b, d, m * sizeof(T));
    if (dst2 != nullptr) copyToSharedNoFence(dst2 + b, d, m * sizeof(T));
  }
}

// complex product on interleaved (re, im) pairs; count = number of complex elements.
template <class R>
void complexProdN(R* dst, R* dst2, const R* const* s, int n, size_t count, bool sd) {
  alignas(64) R acc[2 * kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    size_t m = std::min(kBlock, count - b);
    std::memcpy(acc, s[0] + 2 * b, 2 * m * sizeof(R));
    for (int j = 1; j < n; ++j) {
      const R* __restrict x = s[j] + 2 * b;
      R* __restrict a = acc;
      for (size_t k = 0; k < m; ++k) {
        R re = a[2 * k] * x[2 * k] - a[2 * k + 1] * x[2 * k + 1];
        R im = a[2 * k] * x[2 * k + 1] + a[2 * k + 1] * x[2 * k];
        a[2 * k] = re;
        a[2 * k + 1] = im;
      }
    }
    if (dst != nullptr && sd) copyToSharedNoFence(dst + 2 * b, acc, 2 * m * sizeof(R));
    else if (dst != nullptr) std::memcpy(dst + 2 * b, acc, 2 * m * sizeof(R));
    if (dst2 != nullptr) copyToSharedNoFence(dst2 + 2 * b, acc, 2 * m * sizeof(R));
  }
}

// ---- dispatch ----
template <class T, class... Rest>
void callDirect(ReduceOp op, void* d, void* d2, const void* const* s, int n, size_t c, bool sd) {
  auto* td = static_cast<T*>(d);
  auto* td2 = static_cast<T*>(d2);
  auto* ts = reinterpret_cast<const T* const*>(s);
  switch (op) {
    case ReduceOp::kSum: return directN<T, OpSum, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kAvg: return directN<T, OpSum, true>(td, td2, ts, n, c, sd);
    case ReduceOp::kProduct: return directN<T, OpProd, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kMin: return directN<T, OpMin, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kMax: return directN<T, OpMax, false>(td, td2, ts, n, c, sd);
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::kBand: return directN<T, OpAnd, false>(td, td2, ts, n, c, sd);
      case ReduceOp::kBor: return directN<T, OpOr, false>(td, td2, ts, n, c, sd);
      case ReduceOp::kBxor: return directN<T, OpXor, false>(td, td2, ts, n, c, sd);
      default: break;
    }
  }
  throw std::invalid_argument("mooncake pg: unsupported reduce op");
}

template <class Cvt>
void callHalfLike(ReduceOp op, void* d, void* d2, const void* const* s, int n, size_t c, bool sd) {
  auto* td = static_cast<uint16_t*>(d);
  auto* td2 = static_cast<uint16_t*>(d2);
  auto* ts = reinterpret_cast<const uint16_t* const*>(s);
  switch (op) {
    case ReduceOp::kSum: return convertedN<uint16_t, float, Cvt, OpSum, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kAvg: return convertedN<uint16_t, float, Cvt, OpSum, true>(td, td2, ts, n, c, sd);
    case ReduceOp::kProduct:
      return convertedN<uint16_t, float, Cvt, OpProd, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kMin: return convertedN<uint16_t, float, Cvt, OpMin, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kMax: return convertedN<uint16_t, float, Cvt, OpMax, false>(td, td2, ts, n, c, sd);
    default: throw std::invalid_argument("mooncake pg: unsupported reduce op for 16-bit floats");
  }
}

// Signed integers: SUM/PRODUCT run on the unsigned type (defined wrap-around), AVG on
// 64-bit sums, ordering and bitwise ops on the type itself.
template <class T>
void callInt(ReduceOp op, void* d, void* d2, const void* const* s, int n, size_t c, bool sd) {
  using U = std::make_unsigned_t<T>;
  if (op == ReduceOp::kSum || op == ReduceOp::kProduct) return callDirect<U>(op, d, d2, s, n, c, sd);
  if (op == ReduceOp::kAvg) {
    using A = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    return convertedN<T, A, CvtWiden<T, A>, OpSum, true>(
        static_cast<T*>(d), static_cast<T*>(d2), reinterpret_cast<const T* const*>(s), n, c, sd);
  }
  return callDirect<T>(op, d, d2, s, n, c, sd);
}

inline void callBool(ReduceOp op, void* d, void* d2, const void* const* s, int n, size_t c, bool sd) {
  auto* td = static_cast<uint8_t*>(d);
  auto* td2 = static_cast<uint8_t*>(d2);
  auto* ts = reinterpret_cast<const uint8_t* const*>(s);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor: return directN<uint8_t, OpOr, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand: return directN<uint8_t, OpAnd, false>(td, td2, ts, n, c, sd);
    case ReduceOp::kBxor: return directN<uint8_t, OpXor, false>(td, td2, ts, n, c, sd);
    default: throw std::invalid_argument("mooncake pg: unsupported reduce op for bool");
  }
}

template <class R>
void callComplex(ReduceOp op, void* d, void* d2, const void* const* s, int n, size_t c, bool sd) {
  if (op == ReduceOp::kSum || op == ReduceOp::kAvg) return callDirect<R>(op, d, d2, s, n, 2 * c, sd);
  if (op == ReduceOp::kProduct)
    return complexProdN<R>(static_cast<R*>(d), static_cast<R*>(d2),
                           reinterpret_cast<const R* const*>(s), n, c, sd);
  throw std::invalid_argument("mooncake pg: unsupported reduce op for complex");
}

// Entry point of this instruction set; the caller validated (t, op) and nsrc >= 2.
inline void reduceImpl(void* d, void* d2, const void* const* s, int n, size_t c, DataType t,
                       ReduceOp op, bool sd) {
  switch (t) {
    case DataType::kFloat32: return callDirect<float>(op, d, d2, s, n, c, sd);
    case DataType::kFloat64: return callDirect<double>(op, d, d2, s, n, c, sd);
    case DataType::kFloat16: return callHalfLike<CvtHalf>(op, d, d2, s, n, c, sd);
    case DataType::kBFloat16: return callHalfLike<CvtBf16>(op, d, d2, s, n, c, sd);
    case DataType::kInt8: return callInt<int8_t>(op, d, d2, s, n, c, sd);
    case DataType::kInt16: return callInt<int16_t>(op, d, d2, s, n, c, sd);
    case DataType::kInt32: return callInt<int32_t>(op, d, d2, s, n, c, sd);
    case DataType::kInt64: return callInt<int64_t>(op, d, d2, s, n, c, sd);
    case DataType::kUInt8: return callInt<uint8_t>(op, d, d2, s, n, c, sd);
    case DataType::kBool: return callBool(op, d, d2, s, n, c, sd);
    case DataType::kComplex64: return callComplex<float>(op, d, d2, s, n, c, sd);
    case DataType::kComplex128: return callComplex<double>(op, d, d2, s, n, c, sd);
  }
  throw std::invalid_argument("mooncake pg: unknown dtype");
}

}  // namespace mooncake::pg::MC_PG_ISA_NS
