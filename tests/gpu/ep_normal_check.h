// ep_kernel_check's normal-mode part (included by ep_kernel_check.cc after its World): R ranks
// in one process run ep/kernels/normal_kernels.h through an executor's normal calls (the
// launchers' order, each rank's call concurrent with the others', as separate processes
// would be), against a naive reference computed here from the inputs:
//   - dispatch: from each source in rank order its tokens for this rank in token order: rows
//     equal to the source's, src ids, the local top-k (-1 and weight 0 for other ranks'
//     experts), per-expert counts rounded up to the alignment;
//   - combine (y: fresh rows per rank, the received weights as the weights to return): out[t]
//     = the rows t came back with, over destinations in rank order, summed in float32 and
//     rounded once; out_weights[t] = the returned weights summed alike.
#pragma once

#include <iomanip>
#include <sstream>
#include "ep/kernels/normal_kernels.h"

namespace {

class NormalWorld {
 public:
  NormalWorld(kern::Exec& ex, const Shape& s, int alignment) : ex_(ex), s_(s), align_(alignment) {
    L_ = s.E / s.R;
    bytes_ = ep::sizeHint(s.M, s.H, s.R, s.E);
    geo_ = ep::BufferGeometry(bytes_, s.R);
    for (int r = 0; r < s.R; ++r) {
      bufs_.push_back(ex.alloc(bytes_));
      ex.zero(bufs_.back(), bytes_);
    }
    std::vector<char*> host_peers;
    for (void* b : bufs_) host_peers.push_back(static_cast<char*>(b));
    peers_ = ex.alloc(sizeof(char*) * s.R);
    ex.upload(peers_, host_peers.data(), sizeof(char*) * s.R);
    const size_t row = inRowBytes(s);
    for (int r = 0; r < s.R; ++r) {
      in_.push_back(makeInput(s, r));
      const RankInput& in = in_[r];
      std::vector<uint8_t> in_rank(static_cast<size_t>(in.T) * s.R, 0);
      for (int64_t t = 0; t < in.T; ++t)
        for (int k = 0; k < s.K; ++k) {
          const int64_t e = in.topk[t * s.K + k];
          if (e >= 0) in_rank[t * s.R + e / L_] = 1;
        }
      in_rank_.push_back(in_rank);
      Dev d;
      d.x = ex.put(s.dtype == ep::DType::kFloat32 ? static_cast<const void*>(in.x32.data())
                                                : static_cast<const void*>(in.x16.data()),
                in.T * row);
      d.in_rank = ex.put(in_rank.data(), in_rank.size());
      d.topk = ex.put(in.topk.data(), in.topk.size() * 8);
      d.w = ex.put(in.w.data(), in.w.size() * 4);
      const int64_t N = static_cast<int64_t>(s.R) * s.M;  // at most M rows from each source
      d.recv_x = ex.alloc(N * row);
      d.recv_src = ex.alloc(N * 4);
      d.recv_topk = ex.alloc(N * s.K * 8);
      d.recv_w = ex.alloc(N * s.K * 4);
      d.per_expert = ex.alloc(4 * L_);
      d.counts = ex.alloc(4 * s.R);
      d.y = ex.alloc(N * row);
      d.out = ex.alloc(std::max<int64_t>(1, in.T) * row);
      d.out_w = ex.alloc(std::max<int64_t>(1, in.T) * s.K * 4);
      d.toks = ex.alloc(4 * s.R * std::max<int64_t>(1, s.M));
      d.active = ex.alloc(4 * s.R);
      d.decision = ex.alloc(4 * s.R);
      d.error = ex.alloc(8);
      dev_.push_back(d);
    }
  }
  ~NormalWorld() {
    for (auto& d : dev_)
      for (void* p : {d.x, d.in_rank, d.topk, d.w, d.recv_x, d.recv_src, d.recv_topk, d.recv_w,
                      d.per_expert, d.counts, d.y, d.out, d.out_w, d.toks, d.active, d.decision,
                      d.error})
        ex_.release(p);
    for (void* b : bufs_) ex_.release(b);
    ex_.release(peers_);
  }

  kern::NormalArgs args(int r, uint32_t round, bool combine) {
    const auto nl = ep::NormalLayout::make(geo_.regionBytes(), s_.R, s_.K, s_.H, s_.dtype);
    kern::NormalArgs p;
    p.me = r;
    p.world = s_.R;
    p.topk = s_.K;
    p.dtype = static_cast<int>(s_.dtype);
    p.hidden = s_.H;
    p.round = round;
    p.timeout_us = 10'000'000;
    p.peers = static_cast<char* const*>(peers_);
    ep::setRoundOffsets(p, geo_, round, combine ? 1 : 0);
    nl.setArgs(p);
    const Dev& d = dev_[r];
    p.tokens = in_[r].T;
    p.in_rank = static_cast<const uint8_t*>(d.in_rank);
    p.active = static_cast<int32_t*>(d.active);
    p.decision = static_cast<int32_t*>(d.decision);
    p.error = static_cast<int32_t*>(d.error);
    return p;
  }

  // normal_dispatch on every rank (with top-k and weights), then normal_combine of fresh y
  // with the received weights; returns the first error code any rank left (0: none).
  int32_t round(uint32_t round) {
    wait_problem_.clear();
    std::vector<int32_t> ones(s_.R, 1);
    auto fresh = [&](int r) {
      ex_.upload(dev_[r].active, ones.data(), 4 * s_.R);
      ex_.zero(dev_[r].decision, 4 * s_.R);
      ex_.zero(dev_[r].error, 8);
    };
    for (int r = 0; r < s_.R; ++r) {
      fresh(r);
      ex_.zero(dev_[r].counts, 4 * s_.R);
      ex_.zero(dev_[r].per_expert, 4 * L_);
    }
    for (int r = 0; r < s_.R; ++r) ex_.normalDispatchSend(r, dispatchArgs(r, round), toks(r));
    ex_.finish();
    if (int32_t e = errors()) return e;
    if (!allArrived("dispatch", true)) return 0;
    counts_.assign(s_.R, std::vector<int32_t>(s_.R));
    for (int r = 0; r < s_.R; ++r) ex_.download(counts_[r].data(), dev_[r].counts, 4 * s_.R);
    for (int r = 0; r < s_.R; ++r) ex_.normalDispatchRecv(r, dispatchArgs(r, round), toks(r));
    ex_.finish();
    if (int32_t e = errors()) return e;
    ys_.clear();
    wcache_.clear();
    for (int r = 0; r < s_.R; ++r) {
      fresh(r);
      int64_t n = 0;
      for (int32_t c : counts_[r]) n += c;
      std::vector<uint8_t> y(n * inRowBytes(s_));
      std::mt19937 g(static_cast<uint32_t>(s_.seed * 17 + r + round * 101));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      if (s_.dtype == ep::DType::kFloat32) {
        auto* f = reinterpret_cast<float*>(y.data());
        for (size_t i = 0; i < y.size() / 4; ++i) f[i] = nd(g);
      } else {
        auto* b = reinterpret_cast<uint16_t*>(y.data());
        for (size_t i = 0; i < y.size() / 2; ++i) b[i] = num::floatToBf16(nd(g));
      }
      if (!y.empty()) ex_.upload(dev_[r].y, y.data(), y.size());
      ys_.push_back(std::move(y));
    }
    for (int r = 0; r < s_.R; ++r) {
      kern::NormalArgs p = args(r, round, true);
      p.y = dev_[r].y;
      p.recv_counts = static_cast<const int32_t*>(dev_[r].counts);
      p.with_weights = true;
      p.weights = static_cast<const float*>(dev_[r].recv_w);
      p.out = dev_[r].out;
      p.out_weights = static_cast<float*>(dev_[r].out_w);
      ex_.normalCombine(r, p);
    }
    ex_.finish();
    if (int32_t e = errors()) return e;
    allArrived("combine", false);
    return 0;
  }

  // "" when every rank saw every peer's signal in the last round's phases; else which rank gave
  // up on whom (a wait that ran into its deadline reads the rows it has, whatever they are).
  const std::string& waitProblem() const { return wait_problem_; }

  // Compares rank me's outputs with the reference; "" when equal.
  std::string check(int me) {
    const Shape& s = s_;
    const size_t row = inRowBytes(s);
    const int K = s.K;
    int64_t n = 0;
    for (int32_t c : counts_[me]) n += c;
    std::vector<uint8_t> recv_x(n * row);
    std::vector<int32_t> src(n), per_expert(L_);
    std::vector<int64_t> rtopk(n * K);
    std::vector<float> rw(n * K);
    if (n > 0) {
      ex_.download(recv_x.data(), dev_[me].recv_x, recv_x.size());
      ex_.download(src.data(), dev_[me].recv_src, n * 4);
      ex_.download(rtopk.data(), dev_[me].recv_topk, n * K * 8);
      ex_.download(rw.data(), dev_[me].recv_w, n * K * 4);
    }
    ex_.download(per_expert.data(), dev_[me].per_expert, 4 * L_);
    std::ostringstream err;
    std::vector<int32_t> want_per(L_, 0);
    int64_t i = 0;
    for (int r = 0; r < s.R; ++r) {
      const RankInput& in = in_[r];
      int64_t c = 0;
      for (int64_t t = 0; t < in.T; ++t) {
        if (!in_rank_[r][t * s.R + me]) continue;
        ++c;
        const void* want = s.dtype == ep::DType::kFloat32
                               ? static_cast<const void*>(in.x32.data() + t * s.H)
                               : static_cast<const void*>(in.x16.data() + t * s.H);
        if (i >= n || std::memcmp(recv_x.data() + i * row, want, row) != 0 || src[i] != t) {
          err << "rank " << me << " row " << i << " (source " << r << " token " << t
              << "): row or src id differs";
          return err.str();
        }
        for (int k = 0; k < K; ++k) {
          const int64_t e = in.topk[t * K + k];
          const int64_t local = e >= 0 && e / L_ == me ? e % L_ : -1;
          const float w = local >= 0 ? in.w[t * K + k] : 0.0f;
          if (local >= 0) ++want_per[local];
          if (rtopk[i * K + k] != local || std::memcmp(&rw[i * K + k], &w, 4) != 0) {
            err << "rank " << me << " row " << i << " k " << k << ": top-k " << rtopk[i * K + k]
                << " weight " << rw[i * K + k] << ", want " << local << " " << w;
            return err.str();
          }
        }
        ++i;
      }
      if (counts_[me][r] != c) {
        err << "rank " << me << ": " << counts_[me][r] << " rows from " << r << ", want " << c;
        return err.str();
      }
    }
    for (int l = 0; l < L_; ++l) {
      const int32_t want = (want_per[l] + align_ - 1) / align_ * align_;
      if (per_expert[l] != want) {
        err << "rank " << me << " expert " << l << ": " << per_expert[l] << " rows, want " << want;
        return err.str();
      }
    }
    // Combine: t's row at destination d is at d's recv position of (me, t).
    const RankInput& in = in_[me];
    const bool f32 = s.dtype == ep::DType::kFloat32;
    std::vector<uint8_t> out(in.T * row);
    std::vector<float> out_w(in.T * K);
    if (in.T > 0) {
      ex_.download(out.data(), dev_[me].out, out.size());
      ex_.download(out_w.data(), dev_[me].out_w, out_w.size() * 4);
    }
    for (int64_t t = 0; t < in.T; ++t) {
      std::vector<const uint8_t*> rows;
      std::vector<const float*> ws;
      for (int d = 0; d < s.R; ++d) {
        if (!in_rank_[me][t * s.R + d]) continue;
        int64_t pos = 0;  // rows d received before (me, t): earlier sources, then earlier tokens
        for (int r = 0; r < me; ++r) pos += counts_[d][r];
        for (int64_t u = 0; u < t; ++u) pos += in_rank_[me][u * s.R + d];
        rows.push_back(ys_[d].data() + pos * row);
        ws.push_back(weightsAt(d, pos));
      }
      for (int64_t h = 0; h < s.H; ++h) {
        float acc = 0.0f;
        for (size_t j = 0; j < rows.size(); ++j) {
          const float v = f32 ? reinterpret_cast<const float*>(rows[j])[h]
                              : num::bf16ToFloat(reinterpret_cast<const uint16_t*>(rows[j])[h]);
          acc = j == 0 ? 0.0f + v : acc + v;
        }
        const bool same =
            f32 ? std::memcmp(out.data() + (t * s.H + h) * 4, &acc, 4) == 0
                : reinterpret_cast<const uint16_t*>(out.data())[t * s.H + h] == num::floatToBf16(acc);
        if (!same) {
          err << "rank " << me << " combine token " << t << " channel " << h << " differs";
          return err.str();
        }
      }
      for (int k = 0; k < K; ++k) {
        float acc = 0.0f;
        for (const float* w : ws) acc += w[k];
        if (std::memcmp(&out_w[t * K + k], &acc, 4) != 0) {
          err << "rank " << me << " combine token " << t << " weight " << k << " differs: got "
              << std::setprecision(9) << out_w[t * K + k] << ", want " << acc << " (the sum of";
          for (const float* w : ws) err << " " << w[k];
          err << ")";
          return err.str();
        }
      }
    }
    return "";
  }

 private:
  struct Dev {
    void *x, *in_rank, *topk, *w, *recv_x, *recv_src, *recv_topk, *recv_w, *per_expert, *counts,
        *y, *out, *out_w, *toks, *active, *decision, *error;
  };
  kern::NormalArgs dispatchArgs(int r, uint32_t round) {
    kern::NormalArgs p = args(r, round, false);
    const Dev& d = dev_[r];
    p.x = d.x;
    p.with_topk = true;
    p.with_weights = true;
    p.topk_idx = static_cast<const int64_t*>(d.topk);
    p.topk_weights = static_cast<const float*>(d.w);
    p.local_experts = L_;
    p.expert_alignment = align_;
    p.counts = static_cast<int32_t*>(d.counts);
    p.recv_x = d.recv_x;
    p.recv_src_idx = static_cast<int32_t*>(d.recv_src);
    p.recv_topk_idx = static_cast<int64_t*>(d.recv_topk);
    p.recv_topk_weights = static_cast<float*>(d.recv_w);
    p.num_recv_per_expert = static_cast<int32_t*>(d.per_expert);
    return p;
  }
  int32_t* toks(int r) { return static_cast<int32_t*>(dev_[r].toks); }
  // The weights rank d received at row pos (what its combine sends back).
  const float* weightsAt(int d, int64_t pos) {
    if (wcache_.size() != static_cast<size_t>(s_.R)) wcache_.assign(s_.R, {});
    auto& c = wcache_[d];
    if (c.empty()) {
      int64_t n = 0;
      for (int32_t v : counts_[d]) n += v;
      c.resize(std::max<int64_t>(1, n * s_.K));
      if (n > 0) ex_.download(c.data(), dev_[d].recv_w, n * s_.K * 4);
    }
    return c.data() + pos * s_.K;
  }
  // Every rank's decisions after a phase: each peer (and itself, in the dispatch) arrived.
  bool allArrived(const char* phase, bool self) {
    for (int r = 0; r < s_.R; ++r) {
      std::vector<int32_t> dec(s_.R);
      ex_.download(dec.data(), dev_[r].decision, 4 * s_.R);
      for (int d = 0; d < s_.R; ++d) {
        if ((d == r && !self) || dec[d] == kern::kArrived) continue;
        std::ostringstream os;
        os << "the " << phase << " of rank " << r << " did not see rank " << d
           << " arrive (decision " << dec[d] << ", "
           << (dec[d] == kern::kSilent ? "silent: its deadline passed" : "not arrived") << ")";
        wait_problem_ = os.str();
        return false;
      }
    }
    return true;
  }
  int32_t errors() {
    for (int r = 0; r < s_.R; ++r) {
      int32_t e[2];
      ex_.download(e, dev_[r].error, 8);
      if (e[0] != 0) return e[0];
    }
    return 0;
  }
  kern::Exec& ex_;
  Shape s_;
  int align_;
  int L_ = 0;
  size_t bytes_ = 0;
  ep::BufferGeometry geo_;
  std::vector<void*> bufs_;
  void* peers_ = nullptr;
  std::vector<RankInput> in_;
  std::vector<std::vector<uint8_t>> in_rank_;
  std::vector<Dev> dev_;
  std::vector<std::vector<int32_t>> counts_;  // [rank][source]
  std::vector<std::vector<uint8_t>> ys_;
  std::vector<std::vector<float>> wcache_;
  std::string wait_problem_;
};

// Two rounds (both buffer halves) of normal dispatch + combine on `ex` against the reference
// (bit for bit: every executor, host or cuda, must equal it exactly).
Result runNormalShape(kern::Exec& ex, const Shape& s, int alignment) {
  Result res{"normal " + describe(s) + " align " + std::to_string(alignment), true, ""};
  NormalWorld w(ex, s, alignment);
  std::ostringstream detail;
  for (uint32_t round = 1; round <= 2 && res.ok; ++round) {
    if (int32_t e = w.round(round)) {
      res.ok = false;
      detail << "round " << round << ": error code " << e;
      break;
    }
    if (!w.waitProblem().empty()) {
      res.ok = false;
      detail << "round " << round << ": " << w.waitProblem();
      break;
    }
    for (int r = 0; r < s.R && res.ok; ++r) {
      std::string e = w.check(r);
      if (!e.empty()) {
        res.ok = false;
        detail << "round " << round << ": " << e;
      }
    }
  }
  res.detail = res.ok ? "equal to the reference" : detail.str();
  return res;
}

}  // namespace
