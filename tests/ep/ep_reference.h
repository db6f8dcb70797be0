// Inputs and plain reference math for EP tests. Every rank regenerates every rank's inputs
// from (seed, rank), so each process computes the full reference without communication.
//
// Identity encoding (as DeepEP's tests): row t of rank r holds r in its body and t in its
// last element, so a received row names its own source; the second-to-last element holds
// a small per-(r, t) value so that rows are not all alike.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "ep/layout.h"

namespace mooncake::ep::test {

struct Case {
  int world = 2;
  int experts = 8;
  int64_t max_tokens = 16;  // M
  int64_t hidden = 64;
  int topk = 3;
  DType dtype = DType::kBFloat16;
  uint64_t seed = 1;
  // tokens[r] (<= M); empty: M - r.
  std::vector<int64_t> tokens;
  bool all_to_expert0 = false;  // every token of every rank goes to expert 0 only
  int64_t T(int r) const { return tokens.empty() ? max_tokens - r : tokens[r]; }
};

inline size_t elem(DType t) { return dtypeBytes(t); }

inline void putElem(void* base, int64_t i, DType t, float v) {
  if (t == DType::kFloat32)
    static_cast<float*>(base)[i] = v;
  else
    static_cast<uint16_t*>(base)[i] = floatToBf16(v);
}

inline float getElem(const void* base, int64_t i, DType t) {
  return t == DType::kFloat32 ? static_cast<const float*>(base)[i]
                              : bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
}

struct RankInputs {
  std::vector<char> x;        // [T][H] in dtype
  std::vector<int64_t> topk;  // [T][K]
  std::vector<float> w;       // [T][K]
};

inline RankInputs makeInputs(const Case& c, int r) {
  RankInputs in;
  const int64_t T = c.T(r), H = c.hidden;
  const int K = c.topk;
  in.x.resize(static_cast<size_t>(T * H) * elem(c.dtype));
  in.topk.assign(static_cast<size_t>(T * K), -1);
  in.w.assign(static_cast<size_t>(T * K), 0.0f);
  std::mt19937_64 rng(c.seed * 1000003 + r);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float v = static_cast<float>(r);
      if (h == H - 1) v = static_cast<float>(t);
      if (h == H - 2) v = static_cast<float>((r * 7 + t * 3) % 13) * 0.25f;
      putElem(in.x.data(), t * H + h, c.dtype, v);
    }
    for (int k = 0; k < K; ++k)
      in.w[t * K + k] = static_cast<float>(rng() % 1000) / 1000.0f + 0.001f;
    if (c.all_to_expert0) {
      in.topk[t * K] = 0;
      continue;
    }
    if (t % 7 == 5) continue;  // a row of all -1
    std::vector<int64_t> perm(c.experts);
    for (int e = 0; e < c.experts; ++e) perm[e] = e;
    for (int k = 0; k < K && k < c.experts; ++k) {
      std::uniform_int_distribution<int> d(k, c.experts - 1);
      std::swap(perm[k], perm[d(rng)]);
      in.topk[t * K + k] = (rng() % 8 == 0) ? -1 : perm[k];  // some -1 columns
    }
  }
  return in;
}

// y row for expert e from a received x row: x * (1 + e/16), rounded to dtype.
inline void expertRow(const void* x_row, void* y_row, int64_t H, DType t, int e) {
  const float s = 1.0f + static_cast<float>(e) / 16.0f;
  for (int64_t h = 0; h < H; ++h) putElem(y_row, h, t, getElem(x_row, h, t) * s);
}

// Reference low-latency combine of rank `me`'s token t, over `active` owners.
inline void referenceCombineRow(const Case& c, const RankInputs& in, int64_t t,
                                const std::vector<int32_t>& active, void* out_row) {
  const int64_t H = c.hidden;
  const int L = c.experts / c.world;
  std::vector<float> acc(H, 0.0f);
  std::vector<char> xr(H * elem(c.dtype)), yr(H * elem(c.dtype));
  std::memcpy(xr.data(), in.x.data() + t * H * elem(c.dtype), xr.size());
  for (int k = 0; k < c.topk; ++k) {
    int64_t e = in.topk[t * c.topk + k];
    if (e < 0 || active[e / L] == 0) continue;
    expertRow(xr.data(), yr.data(), H, c.dtype, static_cast<int>(e));
    const float w = in.w[t * c.topk + k];
    for (int64_t h = 0; h < H; ++h) {
      float p = w * getElem(yr.data(), h, c.dtype);
      acc[h] = acc[h] + p;
    }
  }
  for (int64_t h = 0; h < H; ++h) putElem(out_row, h, c.dtype, acc[h]);
}

}  // namespace mooncake::ep::test
