// ep_kernel_check's bad-input part (included by ep_kernel_check.cc after its World): what the
// low-latency kernels check themselves in a stream-ordered call, whose inputs the host does
// not read (ep/kernels/ll_kernels.h: checkTopk, combineSend's bounds), on the executor under
// test, 3 ranks, bf16:
//   - an expert id E (outside [-1, E)) in rank 0's topk_idx: rank 0's error words say
//     kBadTopk and the token; the entry is skipped: every rank's dispatch outputs, and the
//     other ranks' combine outputs, equal those of the same rounds with the entry -1 (run on
//     the same executor); rank 0's combine, whose error is set, writes no output;
//   - an expert twice in a token's row of rank 0: kBadTopk and the token;
//   - rank 0's combine handle with local expert 0's block of a peer beyond R*M rows:
//     kBadHandle and the local expert; nothing of the block is sent, so that peer's combine
//     finds fewer rows from rank 0 than its topk_idx routes there (kWrongRowCount, rank 0).
#pragma once

#include <utility>
#include <vector>

namespace {

std::vector<Result> runBadInput(kern::Exec& ex) {
  std::vector<Result> rows;
  const Shape s{3, 16, 128, 6, 2, ep::DType::kBFloat16, -1, 12};
  auto row = [&](const std::string& check, const std::string& error) {
    rows.push_back(
        {"ll bad input: " + check, error.empty(), error.empty() ? "as expected" : error});
  };
  auto errorIs = [](std::pair<int32_t, int32_t> got, int32_t code, int32_t who) {
    if (got.first == code && got.second == who) return std::string();
    return "error words (" + std::to_string(got.first) + ", " + std::to_string(got.second) +
           "), want (" + std::to_string(code) + ", " + std::to_string(who) + ")";
  };
  // A token of rank 0 whose first entry names an expert, and one whose second does too.
  World bad(ex, s), ok(ex, s);
  const RankInput& in0 = bad.input(0);
  int64_t t1 = -1, t2 = -1;
  for (int64_t t = 0; t < in0.T; ++t) {
    if (in0.topk[t * s.K] >= 0 && t1 < 0) t1 = t;
    else if (in0.topk[t * s.K] >= 0 && in0.topk[t * s.K + 1] >= 0 && t2 < 0) t2 = t;
  }
  if (t1 < 0 || t2 < 0) {
    row("inputs", "no token of rank 0 to make bad (another seed?)");
    return rows;
  }
  bad.setTopk(0, t1, 0, s.E);
  ok.setTopk(0, t1, 0, -1);
  bad.dispatch(1, -1, -1);
  ok.dispatch(1, -1, -1);
  std::string e = errorIs(bad.errorOf(0), kern::kBadTopk, static_cast<int32_t>(t1));
  bad.combine(1, -1, -1);
  ok.combine(1, -1, -1);
  for (int r = 0; r < s.R && e.empty(); ++r) {
    RankOutput b = bad.output(r), o = ok.output(r);
    if (r == 0) b.out = o.out = {};
    if (!(b == o)) e = "rank " + std::to_string(r) + "'s outputs differ from the entry's -1";
    if (r != 0 && e.empty() && bad.errorOf(r).first != 0)
      e = "rank " + std::to_string(r) + ": error " + std::to_string(bad.errorOf(r).first);
  }
  row("an expert id outside [-1, E) is reported and skipped", e);

  World dup(ex, s);
  dup.setTopk(0, t2, 1, dup.input(0).topk[t2 * s.K]);
  dup.dispatch(1, -1, -1);
  row("an expert twice in a token's row is reported",
      errorIs(dup.errorOf(0), kern::kBadTopk, static_cast<int32_t>(t2)));

  World handle(ex, s);
  handle.dispatch(1, -1, -1);
  const RankOutput d = handle.output(0);
  int src = -1;  // a peer with rows for rank 0's local expert 0
  for (int r = 1; r < s.R && src < 0; ++r)
    if ((d.layout[r] & 0xffffffff) != 0) src = r;
  if (src < 0) {
    row("a combine handle out of its bounds", "no peer rows at local expert 0 (another seed?)");
    return rows;
  }
  const int64_t RM = static_cast<int64_t>(s.R) * s.M;
  handle.setLayout(0, 0, src, (RM << 32) | (d.layout[src] & 0xffffffff));
  handle.combine(1, -1, -1);
  e = errorIs(handle.errorOf(0), kern::kBadHandle, 0);
  if (e.empty()) e = errorIs(handle.errorOf(src), kern::kWrongRowCount, 0);
  row("a combine handle out of its bounds is reported, its rows not sent", e);
  return rows;
}

}  // namespace
