// Normal-mode dispatch/combine with real rank processes against the reference: row order
// (source rank, then token), local expert ids, weights, aligned per-expert counts, combine
// sums, the cached (handle) dispatch, and the capacity error.
#include <stdexcept>

#include "tests/ep/ep_harness.h"

namespace mooncake::ep::test {
namespace {

struct NormalRun {
  Case c;
  RankInputs in;
  std::vector<uint8_t> in_rank;
  std::vector<int32_t> counts;
  std::vector<char> recv_x;
  std::vector<int32_t> src_idx, per_expert;
  std::vector<int64_t> recv_topk;
  std::vector<float> recv_w;
  NormalDispatchArgs a;

  NormalRun(const Case& cs, int me) : c(cs), in(makeInputs(cs, me)) {
    const int R = c.world;
    std::vector<int32_t> per_rank(R), per_exp(c.experts);
    in_rank.resize(c.T(me) * R);
    dispatchLayout(in.topk.data(), c.T(me), c.topk, c.experts, R, per_rank.data(), per_exp.data(),
                   in_rank.data());
    a.x = in.x.data();
    a.dtype = c.dtype;
    a.tokens = c.T(me);
    a.hidden = c.hidden;
    a.is_token_in_rank = in_rank.data();
    a.with_topk_idx = a.with_weights = true;
    a.topk_idx = in.topk.data();
    a.topk_weights = in.w.data();
    a.topk = c.topk;
    a.experts = c.experts;
    a.expert_alignment = 4;
  }

  void dispatch(EpBuffer& b) {
    b.validate(a);
    uint32_t round = b.nextDispatchRound();
    counts = b.normalDispatchSend(a, round);
    int64_t n = 0;
    for (int32_t v : counts) n += v;
    const int L = c.experts / c.world;
    recv_x.assign(n * c.hidden * elem(c.dtype), 0);
    src_idx.assign(n, -1);
    per_expert.assign(L, -1);
    recv_topk.assign(n * c.topk, -7);
    recv_w.assign(n * c.topk, -7.0f);
    NormalDispatchOutputs o;
    o.recv_x = recv_x.data();
    o.recv_src_idx = src_idx.data();
    o.recv_topk_idx = recv_topk.data();
    o.recv_topk_weights = recv_w.data();
    o.num_recv_per_expert = per_expert.data();
    b.normalDispatchRecv(a, round, counts, o);
  }
};

void checkNormalDispatch(const NormalRun& nr, int me) {
  const Case& c = nr.c;
  const int R = c.world, L = c.experts / R, K = c.topk;
  const size_t rb = c.hidden * elem(c.dtype);
  int64_t i = 0;
  std::vector<int32_t> per_expert(L, 0);
  for (int r = 0; r < R; ++r) {
    RankInputs src = makeInputs(c, r);
    int64_t from_r = 0;
    for (int64_t t = 0; t < c.T(r); ++t) {
      bool mine = false;
      for (int k = 0; k < K; ++k) mine |= src.topk[t * K + k] >= 0 && src.topk[t * K + k] / L == me;
      if (!mine) continue;
      ++from_r;
      ASSERT_LT(i, static_cast<int64_t>(nr.src_idx.size()));
      EXPECT_EQ(nr.src_idx[i], t) << "row " << i;
      EXPECT_EQ(std::memcmp(nr.recv_x.data() + i * rb, src.x.data() + t * rb, rb), 0)
          << "row " << i;
      for (int k = 0; k < K; ++k) {
        const int64_t e = src.topk[t * K + k];
        const bool local = e >= 0 && e / L == me;
        EXPECT_EQ(nr.recv_topk[i * K + k], local ? e % L : -1) << "row " << i << " k " << k;
        EXPECT_EQ(nr.recv_w[i * K + k], local ? src.w[t * K + k] : 0.0f);
        if (local) ++per_expert[e % L];
      }
      ++i;
    }
    EXPECT_EQ(nr.counts[r], from_r) << "rows from rank " << r;
  }
  EXPECT_EQ(i, static_cast<int64_t>(nr.src_idx.size()));
  for (int l = 0; l < L; ++l) EXPECT_EQ(nr.per_expert[l], (per_expert[l] + 3) / 4 * 4);
}

// Reference normal combine of rank r's token t when every rank d multiplies what it
// received by (1 + d/8): the sum over receiving ranks in ascending order, in float32.
std::vector<char> referenceNormalOut(const Case& c, int r, const RankInputs& in, int64_t t) {
  const int L = c.experts / c.world, K = c.topk;
  const size_t rb = c.hidden * elem(c.dtype);
  std::vector<float> acc(c.hidden, 0.0f);
  for (int d = 0; d < c.world; ++d) {
    bool to_d = false;
    for (int k = 0; k < K; ++k) to_d |= in.topk[t * K + k] >= 0 && in.topk[t * K + k] / L == d;
    if (!to_d) continue;
    for (int64_t h = 0; h < c.hidden; ++h) {
      char tmp[8];
      putElem(tmp, 0, c.dtype, getElem(in.x.data() + t * rb, h, c.dtype) * (1.0f + d / 8.0f));
      acc[h] = acc[h] + getElem(tmp, 0, c.dtype);  // y was rounded to dtype on rank d
    }
  }
  std::vector<char> ref(rb);
  for (int64_t h = 0; h < c.hidden; ++h) putElem(ref.data(), h, c.dtype, acc[h]);
  return ref;
}

class Normal : public ::testing::TestWithParam<int> {};

TEST_P(Normal, DispatchCombineAndCachedDispatch) {
  const int world = GetParam();
  RunOptions o;
  o.world = world;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    auto buf = makeBuffer(env, sizeHint(32, 96, world, 4 * world));
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      Case c;
      c.world = world;
      c.experts = 4 * world;
      c.max_tokens = 32;
      c.hidden = dt == DType::kFloat32 ? 40 : 96;
      c.topk = 3;
      c.dtype = dt;
      c.seed = 21 + static_cast<int>(dt);
      for (int r = 0; r < world; ++r) c.tokens.push_back(r == world - 1 ? 0 : 30 - 3 * r);
      NormalRun nr(c, env.rank);
      nr.dispatch(*buf);
      checkNormalDispatch(nr, env.rank);

      // combine: y = recv_x * (1 + rank/8); out[t] = sum over receiving ranks, ascending.
      const int64_t n = nr.src_idx.size();
      const size_t rb = c.hidden * elem(dt);
      std::vector<char> y(n * rb);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < c.hidden; ++h)
          putElem(y.data() + i * rb, h, dt,
                  getElem(nr.recv_x.data() + i * rb, h, dt) * (1.0f + env.rank / 8.0f));
      const int64_t T = c.T(env.rank);
      std::vector<char> out(T * rb, 0x33);
      std::vector<float> out_w(T * c.topk, -1.0f);
      NormalCombineArgs cb;
      cb.y = y.data();
      cb.dtype = dt;
      cb.hidden = c.hidden;
      cb.recv_counts = nr.counts.data();
      cb.with_weights = true;
      cb.weights = nr.recv_w.data();
      cb.topk = c.topk;
      cb.is_token_in_rank = nr.in_rank.data();
      cb.tokens = T;
      cb.out = out.data();
      cb.out_weights = out_w.data();
      buf->validate(cb);
      buf->normalCombine(cb, buf->nextCombineRound());
      for (int64_t t = 0; t < T; ++t) {
        std::vector<char> ref = referenceNormalOut(c, env.rank, nr.in, t);
        ASSERT_EQ(std::memcmp(ref.data(), out.data() + t * rb, rb), 0) << "token " << t;
        for (int k = 0; k < c.topk; ++k)
          EXPECT_EQ(out_w[t * c.topk + k],
                    nr.in.topk[t * c.topk + k] >= 0 ? nr.in.w[t * c.topk + k] : 0.0f);
      }

      // Cached dispatch (the backward of combine): rows of `out` along the same routes;
      // weights pass through unmasked.
      NormalRun cached(c, env.rank);
      cached.a.x = out.data();
      cached.a.with_topk_idx = false;
      cached.a.topk_weights = out_w.data();
      cached.dispatch(*buf);
      ASSERT_EQ(cached.src_idx, nr.src_idx);
      ASSERT_EQ(cached.counts, nr.counts);
      int64_t i = 0;
      for (int r = 0; r < world; ++r) {
        RankInputs src = makeInputs(c, r);
        for (int32_t j = 0; j < nr.counts[r]; ++j, ++i) {
          const int32_t t = nr.src_idx[i];
          std::vector<char> ref = referenceNormalOut(c, r, src, t);
          EXPECT_EQ(std::memcmp(ref.data(), cached.recv_x.data() + i * rb, rb), 0) << "row " << i;
          for (int k = 0; k < c.topk; ++k)
            EXPECT_EQ(cached.recv_w[i * c.topk + k],
                      src.topk[t * c.topk + k] >= 0 ? src.w[t * c.topk + k] : 0.0f);
        }
      }
    }
  });
  expectAllOk(codes);
}

INSTANTIATE_TEST_SUITE_P(World, Normal, ::testing::Values(2, 3, 4),
                         [](const auto& i) { return "R" + std::to_string(i.param); });

TEST(NormalValidation, CapacityAndIds) {
  RunOptions o;
  o.world = 2;
  auto codes = pg::test::runRanks(o, [&](RankEnv& env) {
    auto buf = makeBuffer(env, sizeHint(4, 64, 2, 4));  // a small buffer
    Case c;
    c.world = 2;
    c.experts = 4;
    c.hidden = 64;
    c.topk = 2;
    const int64_t cap = buf->normalCapacity(64, DType::kBFloat16, 2);
    c.max_tokens = cap + 1;
    c.all_to_expert0 = true;  // every token to rank 0: one more than it can hold
    c.tokens.assign(2, cap + 1);
    NormalRun nr(c, env.rank);
    try {
      nr.dispatch(*buf);
      ADD_FAILURE() << "capacity overflow accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("holds"), std::string::npos) << e.what();
    }
    c.tokens.assign(2, 3);
    c.all_to_expert0 = false;
    NormalRun bad(c, env.rank);
    bad.in.topk[1] = 9;
    EXPECT_THROW(bad.dispatch(*buf), std::invalid_argument);
    NormalRun ok(c, env.rank);
    ok.dispatch(*buf);
    checkNormalDispatch(ok, env.rank);
  });
  expectAllOk(codes);
}

}  // namespace
}  // namespace mooncake::ep::test
