// The GPU reduction's arithmetic, one definition for both of its forms: compiled by nvcc into
// the kernel (pg/device_reduce.cu) and by the C++ compiler into the host form
// (deviceReduceOnHost, pg/device_reduce.cc), so that the tests here check the arithmetic the
// kernel runs; the 16-bit conversions are pg/float16.h's, the CPU kernels' own. Element k of the result is computed from element k of every source, in
// the semantics of pg/reduce.h (left fold in the order given, fp16/bf16 in float32 rounded
// once to nearest even, integer AVG on 64-bit sums truncated, bool as logical ops) and equal
// to reduceInto's bit for bit (the host tests check it), complex PRODUCT aside (the CPU's
// AVX2 kernels may contract it into FMAs; the kernel is built with --fmad=false).
//
// Internal to pg/device_reduce.*.
#pragma once

#include <stdint.h>

#include <initializer_list>

#include "pg/float16.h"  // the conversions, and MC_PG_HD

namespace mooncake::pg::devred {

constexpr int kMaxSources = 64;

// The kernel's one parameter (passed by value; the same layout on both sides). Addresses as
// integers so the struct is plain bytes.
struct Params {
  uint64_t dst;   // 0: none
  uint64_t dst2;  // 0: none
  uint64_t count;  // elements (complex types: complex elements)
  uint32_t n;      // sources, 1..kMaxSources
  uint8_t dtype;   // pg::DataType
  uint8_t op;      // pg::ReduceOp
  uint16_t pad;
  uint64_t src[kMaxSources];
};

// The numeric values of pg::DataType and pg::ReduceOp (pg/types.h; checked there by
// static_asserts in device_reduce.cc, so this header needs no host-only include).
enum : uint8_t { kF32, kF64, kF16, kBF16, kI8, kI16, kI32, kI64, kU8, kBool, kC64, kC128 };
enum : uint8_t { kSum, kAvg, kProd, kMin, kMax, kBand, kBor, kBxor };

// ---- element operations on the accumulation type ----
// Integer SUM/PRODUCT narrower than unsigned run in unsigned (no signed-overflow UB from
// the promotion to int; the same wrap-around as pg/reduce_kernels.h).
template <class A> struct Wide { using type = A; };
template <> struct Wide<uint8_t> { using type = uint32_t; };
template <> struct Wide<uint16_t> { using type = uint32_t; };
struct Sum {
  template <class A> MC_PG_HD static A f(A a, A b) {
    using W = typename Wide<A>::type;
    return static_cast<A>(static_cast<W>(a) + static_cast<W>(b));
  }
};
struct Prod {
  template <class A> MC_PG_HD static A f(A a, A b) {
    using W = typename Wide<A>::type;
    return static_cast<A>(static_cast<W>(a) * static_cast<W>(b));
  }
};
struct Min {
  template <class A> MC_PG_HD static A f(A a, A b) { return b < a ? b : a; }
};
struct Max {
  template <class A> MC_PG_HD static A f(A a, A b) { return a < b ? b : a; }
};
struct And {
  template <class A> MC_PG_HD static A f(A a, A b) { return static_cast<A>(a & b); }
};
struct Or {
  template <class A> MC_PG_HD static A f(A a, A b) { return static_cast<A>(a | b); }
};
struct Xor {
  template <class A> MC_PG_HD static A f(A a, A b) { return static_cast<A>(a ^ b); }
};

// Storage T <-> accumulation A.
template <class T, class A>
struct Plain {
  MC_PG_HD static A in(T v) { return static_cast<A>(v); }
  MC_PG_HD static T out(A v) { return static_cast<T>(v); }
};
struct Half {
  MC_PG_HD static float in(uint16_t v) { return detail::halfToFloatInline(v); }
  MC_PG_HD static uint16_t out(float v) { return detail::floatToHalfInline(v); }
};
struct Bf16 {
  MC_PG_HD static float in(uint16_t v) { return detail::bf16ToFloatInline(v); }
  MC_PG_HD static uint16_t out(float v) { return detail::floatToBf16Inline(v); }
};

// Element k: fold the n sources left, AVG divides by n, the result to dst and dst2.
template <class T, class A, class Cvt, class Op, bool kAvg>
struct Element {
  MC_PG_HD void operator()(const Params& p, uint64_t k) const {
    A acc = Cvt::in(reinterpret_cast<const T*>(p.src[0])[k]);
    for (uint32_t j = 1; j < p.n; ++j)
      acc = Op::template f<A>(acc, Cvt::in(reinterpret_cast<const T*>(p.src[j])[k]));
    if (kAvg) acc = acc / static_cast<A>(p.n);
    const T r = Cvt::out(acc);
    if (p.dst != 0) reinterpret_cast<T*>(p.dst)[k] = r;
    if (p.dst2 != 0) reinterpret_cast<T*>(p.dst2)[k] = r;
  }
};

// Complex product, element k of interleaved (re, im) pairs.
template <class R>
struct ComplexProduct {
  MC_PG_HD void operator()(const Params& p, uint64_t k) const {
    R re = reinterpret_cast<const R*>(p.src[0])[2 * k];
    R im = reinterpret_cast<const R*>(p.src[0])[2 * k + 1];
    for (uint32_t j = 1; j < p.n; ++j) {
      const R xr = reinterpret_cast<const R*>(p.src[j])[2 * k];
      const R xi = reinterpret_cast<const R*>(p.src[j])[2 * k + 1];
      const R nr = re * xr - im * xi;
      const R ni = re * xi + im * xr;
      re = nr;
      im = ni;
    }
    for (uint64_t d : {p.dst, p.dst2}) {
      if (d == 0) continue;
      reinterpret_cast<R*>(d)[2 * k] = re;
      reinterpret_cast<R*>(d)[2 * k + 1] = im;
    }
  }
};

// Picks the element function of (dtype, op) and runs loop(elements, fn), fn(p, k) computing
// element k (complex SUM/AVG: 2 x count reals). False for a pair pg/reduce.h does not define.
template <class T, class Loop>
MC_PG_HD bool floating(const Params& p, const Loop& loop, uint64_t c) {
  switch (p.op) {
    case kSum: loop(c, Element<T, T, Plain<T, T>, Sum, false>()); return true;
    case kAvg: loop(c, Element<T, T, Plain<T, T>, Sum, true>()); return true;
    case kProd: loop(c, Element<T, T, Plain<T, T>, Prod, false>()); return true;
    case kMin: loop(c, Element<T, T, Plain<T, T>, Min, false>()); return true;
    case kMax: loop(c, Element<T, T, Plain<T, T>, Max, false>()); return true;
    default: return false;
  }
}
template <class Cvt, class Loop>
MC_PG_HD bool sixteen(const Params& p, const Loop& loop) {
  const uint64_t c = p.count;
  switch (p.op) {
    case kSum: loop(c, Element<uint16_t, float, Cvt, Sum, false>()); return true;
    case kAvg: loop(c, Element<uint16_t, float, Cvt, Sum, true>()); return true;
    case kProd: loop(c, Element<uint16_t, float, Cvt, Prod, false>()); return true;
    case kMin: loop(c, Element<uint16_t, float, Cvt, Min, false>()); return true;
    case kMax: loop(c, Element<uint16_t, float, Cvt, Max, false>()); return true;
    default: return false;
  }
}
template <class T, class U, class Wide64, class Loop>
MC_PG_HD bool integer(const Params& p, const Loop& loop) {
  const uint64_t c = p.count;
  switch (p.op) {
    case kSum: loop(c, Element<U, U, Plain<U, U>, Sum, false>()); return true;
    case kAvg: loop(c, Element<T, Wide64, Plain<T, Wide64>, Sum, true>()); return true;
    case kProd: loop(c, Element<U, U, Plain<U, U>, Prod, false>()); return true;
    case kMin: loop(c, Element<T, T, Plain<T, T>, Min, false>()); return true;
    case kMax: loop(c, Element<T, T, Plain<T, T>, Max, false>()); return true;
    case kBand: loop(c, Element<T, T, Plain<T, T>, And, false>()); return true;
    case kBor: loop(c, Element<T, T, Plain<T, T>, Or, false>()); return true;
    case kBxor: loop(c, Element<T, T, Plain<T, T>, Xor, false>()); return true;
    default: return false;
  }
}
template <class R, class Loop>
MC_PG_HD bool complexOf(const Params& p, const Loop& loop) {
  if (p.op == kSum || p.op == kAvg) return floating<R>(p, loop, 2 * p.count);
  if (p.op != kProd) return false;
  loop(p.count, ComplexProduct<R>());
  return true;
}
template <class Loop>
MC_PG_HD bool boolean(const Params& p, const Loop& loop) {
  using B = Plain<uint8_t, uint8_t>;
  const uint64_t c = p.count;
  switch (p.op) {
    case kSum: case kMax: case kBor: loop(c, Element<uint8_t, uint8_t, B, Or, false>()); return true;
    case kProd: case kMin: case kBand:
      loop(c, Element<uint8_t, uint8_t, B, And, false>());
      return true;
    case kBxor: loop(c, Element<uint8_t, uint8_t, B, Xor, false>()); return true;
    default: return false;
  }
}
template <class Loop>
MC_PG_HD bool dispatch(const Params& p, const Loop& loop) {
  switch (p.dtype) {
    case kF32: return floating<float>(p, loop, p.count);
    case kF64: return floating<double>(p, loop, p.count);
    case kF16: return sixteen<Half>(p, loop);
    case kBF16: return sixteen<Bf16>(p, loop);
    case kI8: return integer<int8_t, uint8_t, int64_t>(p, loop);
    case kI16: return integer<int16_t, uint16_t, int64_t>(p, loop);
    case kI32: return integer<int32_t, uint32_t, int64_t>(p, loop);
    case kI64: return integer<int64_t, uint64_t, int64_t>(p, loop);
    case kU8: return integer<uint8_t, uint8_t, uint64_t>(p, loop);
    case kBool: return boolean(p, loop);
    case kC64: return complexOf<float>(p, loop);
    case kC128: return complexOf<double>(p, loop);
    default: return false;
  }
}

}  // namespace mooncake::pg::devred
