// EP on top of the process-group harness: each forked rank builds its Communicator, then an
// EpBuffer on it; helpers run and check one low-latency round against the reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "ep/buffer.h"
#include "tests/ep/ep_reference.h"
#include "tests/pg/pg_harness.h"

namespace mooncake::ep::test {

using pg::test::RankEnv;
using pg::test::RunOptions;

inline std::unique_ptr<EpBuffer> makeBuffer(RankEnv& env, size_t bytes) {
  std::shared_ptr<pg::Communicator> comm(std::move(env.comm));
  return EpBuffer::create(groupOf(comm), bytes);
}

// Every rank exited 0.
inline void expectAllOk(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// One low-latency round's inputs and outputs on one rank.
struct LlRound {
  Case c;
  RankInputs in;
  std::vector<int32_t>* active = nullptr;
  std::vector<char> recv_x, y, out;
  std::vector<int32_t> recv_count, src_info;
  std::vector<int64_t> layout;
  LowLatencyDispatchArgs d;
  LowLatencyCombineArgs cb;
  uint32_t dround = 0, cround = 0;

  LlRound(const Case& cs, int me, std::vector<int32_t>* act, int64_t timeout_us)
      : c(cs), in(makeInputs(cs, me)), active(act) {
    const int L = c.experts / c.world;
    const int64_t RM = c.world * c.max_tokens;
    const size_t rb = c.hidden * elem(c.dtype);
    recv_x.assign(L * RM * rb, 0);
    y.assign(L * RM * rb, 0);
    out.assign(c.T(me) * rb, 0x55);
    recv_count.assign(L, -1);
    src_info.assign(L * RM, -1);
    layout.assign(L * c.world, -1);
    d.x = in.x.data();
    d.dtype = c.dtype;
    d.tokens = c.T(me);
    d.hidden = c.hidden;
    d.topk_idx = in.topk.data();
    d.topk = c.topk;
    d.active_ranks = active->data();
    d.max_tokens = c.max_tokens;
    d.experts = c.experts;
    d.timeout_us = timeout_us;
    d.recv_x = recv_x.data();
    d.recv_count = recv_count.data();
    d.src_info = src_info.data();
    d.layout_range = layout.data();
    cb.y = y.data();
    cb.dtype = c.dtype;
    cb.hidden = c.hidden;
    cb.max_tokens = c.max_tokens;
    cb.experts = c.experts;
    cb.src_info = src_info.data();
    cb.layout_range = layout.data();
    cb.topk_idx = in.topk.data();
    cb.topk_weights = in.w.data();
    cb.tokens = c.T(me);
    cb.topk = c.topk;
    cb.active_ranks = active->data();
    cb.timeout_us = timeout_us;
    cb.out = out.data();
  }

  void dispatchSend(EpBuffer& b) {
    b.validate(d);
    dround = b.nextDispatchRound();
    b.dispatchSend(d, dround);
  }
  void dispatchRecv(EpBuffer& b) { b.dispatchRecv(d, dround); }

  // y = expert function of the received rows (only rows < recv_count are defined).
  void computeY(int me) {
    const int L = c.experts / c.world;
    const int64_t RM = c.world * c.max_tokens;
    const size_t rb = c.hidden * elem(c.dtype);
    for (int l = 0; l < L; ++l)
      for (int64_t i = 0; i < recv_count[l]; ++i)
        expertRow(recv_x.data() + (l * RM + i) * rb, y.data() + (l * RM + i) * rb, c.hidden,
                  c.dtype, me * L + l);
  }
  void combineSend(EpBuffer& b) {
    b.validate(cb);
    cround = b.nextCombineRound();
    b.combineSend(cb, cround);
  }
  void combineRecv(EpBuffer& b) { b.combineRecv(cb, cround); }

  // Checks recv_x/recv_count/src_info/layout_range of rank `me` against the reference.
  void checkDispatch(int me) const {
    const int R = c.world, L = c.experts / R;
    const int64_t RM = R * c.max_tokens, H = c.hidden;
    const size_t rb = H * elem(c.dtype);
    for (int l = 0; l < L; ++l) {
      const int e = me * L + l;
      std::vector<std::pair<int64_t, int64_t>> blocks;
      for (int r = 0; r < R; ++r) {
        const int64_t v = layout[l * R + r];
        const int64_t b = v >> 32, cnt = v & 0xffffffff;
        std::vector<int32_t> expect;
        if ((*active)[r] != 0) {
          RankInputs src = makeInputs(c, r);
          for (int64_t t = 0; t < c.T(r); ++t)
            for (int k = 0; k < c.topk; ++k)
              if (src.topk[t * c.topk + k] == e) expect.push_back(static_cast<int32_t>(t));
        }
        ASSERT_EQ(cnt, static_cast<int64_t>(expect.size()))
            << "rank " << me << " expert " << e << " from rank " << r;
        std::vector<int32_t> got(src_info.begin() + l * RM + b,
                                 src_info.begin() + l * RM + b + cnt);
        std::sort(got.begin(), got.end());
        EXPECT_EQ(got, expect) << "rank " << me << " expert " << e << " from rank " << r;
        for (int64_t i = b; i < b + cnt; ++i) {
          const char* row = recv_x.data() + (l * RM + i) * rb;
          const int32_t t = src_info[l * RM + i];
          EXPECT_EQ(getElem(row, 0, c.dtype), static_cast<float>(r)) << "row " << i;
          EXPECT_EQ(getElem(row, H / 2, c.dtype), static_cast<float>(r)) << "row " << i;
          EXPECT_EQ(getElem(row, H - 1, c.dtype), static_cast<float>(t)) << "row " << i;
          EXPECT_EQ(getElem(row, H - 2, c.dtype), static_cast<float>((r * 7 + t * 3) % 13) * 0.25f);
        }
        blocks.push_back({b, cnt});
      }
      std::sort(blocks.begin(), blocks.end());
      int64_t end = 0;
      for (auto [b, cnt] : blocks) {
        if (cnt == 0) continue;
        EXPECT_EQ(b, end) << "blocks of expert " << e << " do not tile";
        end = b + cnt;
      }
      EXPECT_EQ(recv_count[l], end) << "expert " << e;
    }
  }

  void checkCombine(int me) const {
    const size_t rb = c.hidden * elem(c.dtype);
    std::vector<char> ref(rb);
    for (int64_t t = 0; t < c.T(me); ++t) {
      referenceCombineRow(c, in, t, *active, ref.data());
      ASSERT_EQ(std::memcmp(ref.data(), out.data() + t * rb, rb), 0)
          << "rank " << me << " token " << t << ": got " << getElem(out.data() + t * rb, 0, c.dtype)
          << " want " << getElem(ref.data(), 0, c.dtype);
    }
  }
};

}  // namespace mooncake::ep::test
