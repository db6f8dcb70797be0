// ep_kernel_check's proxy (included by ep_kernel_check.cc after its World): what a host proxy
// does for ranks on other hosts (ep/kernels/ll_kernels.h, "Proxied peers"), done by the test
// between the sends and the receives of a round, through the executor's copies: for each
// sender and each rank of the other host, the rows (and token ids) its kernels staged for
// each local expert, by the counts they posted in its proxy words, go to the destination's
// buffer -- dispatch: block (l, sender); combine: row (sender * L + l, token) -- and then the
// destination's signal words in its host-mapped ctrl words. A word that does not carry the
// round is a failure of the kernels (reported as error code 100). The receives then must
// give what they give with every peer mapped: runShape compares them with the reference.
// In lock-step (after the sends ran, before the receives), so this checks what the kernels
// stage, post and read, not the order of a word against its rows while a kernel runs, nor
// an inactive destination's skip mark (active is all 1 at each round's start).
#pragma once

#include <vector>

namespace {

void World::proxyMove(uint32_t round, bool combine, int silent) {
  ex_.finish();  // (the sends' kernels may still run on an asynchronous executor)
  const int R = s_.R, L = L_, h = static_cast<int>(round & 1), k = combine ? 1 : 0;
  const auto lay =
      ep::LowLatencyLayout::make(R, s_.E, s_.M, s_.H, combine ? combineType(s_) : s_.dtype);
  const uint64_t stride = lay.row_stride, first = geo_.dispatchSignal(h, 0);
  auto signal = [&](int o, uint64_t off, uint64_t value) {  // o's word at buffer offset off
    char* ctrl = reinterpret_cast<char*>(proxy_[o].ctrl) + h * ep::kSignalBytes;
    __atomic_store_n(reinterpret_cast<uint64_t*>(ctrl + (off - first)), value, __ATOMIC_RELEASE);
  };
  for (int src = 0; src < R; ++src) {
    if (src == silent) continue;
    const uint64_t* words = reinterpret_cast<const uint64_t*>(proxy_[src].words[k][h]);
    const char* stage = static_cast<const char*>(proxy_[src].stage[k][h]);
    for (int o = 0; o < R; ++o) {
      if (hostOf(o) == hostOf(src)) continue;
      char* dst = static_cast<char*>(bufs_[o]);
      uint64_t total = 0;
      bool skipped = false;
      for (int l = 0; l < L; ++l) {
        const uint64_t w = __atomic_load_n(&words[o * L + l], __ATOMIC_ACQUIRE);
        if (num::signalRound(w) != round) {
          if (error_ == 0) error_ = 100;  // the kernels posted no word for this round
          return;
        }
        const uint32_t n = num::signalCount(w);
        if (n == kern::kProxySkip) {
          skipped = true;
          continue;
        }
        const uint64_t staged = (static_cast<uint64_t>(o) * L + l) * s_.M;
        std::vector<char> rows(n * stride + 1);
        std::vector<int32_t> ids(n + 1);
        ex_.download(rows.data(), stage + staged * stride, n * stride);
        ex_.download(ids.data(), stage + lay.src_base + staged * 4, n * 4);
        if (!combine) {
          const uint64_t block = (static_cast<uint64_t>(l) * R + src) * s_.M;
          ex_.upload(dst + geo_.dispatchRegion(h) + block * stride, rows.data(), n * stride);
          ex_.upload(dst + geo_.dispatchRegion(h) + lay.src_base + block * 4, ids.data(), n * 4);
          signal(o, geo_.dispatchSignal(h, l * R + src), num::makeSignal(round, n));
          continue;
        }
        for (uint32_t j = 0; j < n; ++j)
          ex_.upload(dst + geo_.combineRegion(h) +
                         ((static_cast<uint64_t>(src) * L + l) * s_.M + ids[j]) * stride,
                     rows.data() + j * stride, stride);
        total += n;
      }
      if (combine && !skipped)
        signal(o, geo_.combineSignal(h, src), num::makeSignal(round, static_cast<uint32_t>(total)));
    }
  }
}

}  // namespace
