// ep_kernel_check: the low-latency EP kernels' bodies (ep/kernels/ll_kernels.h) for R ranks
// simulated in one process (each rank's buffer, inputs and outputs its own allocations, peers
// addressed directly), against a naive reference computed here from the inputs:
//   - dispatch: each local expert's blocks in source order from the rank itself, rows equal
//     to the source token's (fp8: its num::quantizeRow bytes and scales), src_info, counts,
//     layout_range; combine: sum over k ascending of w * y_owner[row] in float32, rounded once;
//   - bf16, float32 and fp8 dispatch; topk 1..11 with -1 entries, empty experts, every token
//     to one expert, two rounds (both buffer halves);
//   - a rank that sends nothing: the others mark it inactive by the bodies' own deadline
//     (timeout_us) and finish; and without a deadline, once the host raises the rank's gone
//     flag (LlArgs::gone) while the waits run, after gone_grace_us.
// And normal mode (tests/gpu/ep_normal_check.h): dispatch with top-k and weights, then combine,
// each rank's calls concurrent with the others', against its own naive reference; bad
// input the kernels find (tests/gpu/ep_bad_input_check.h: kBadTopk, kBadHandle); and ranks on
// two hosts whose peers on the other host are proxied (tests/gpu/ep_proxy_check.h: the test
// does the host proxy's moves; same reference).
// Executors: "host" (HostLanes, one thread: runs everywhere, ctest ep.kernel_check_host),
// "threads" (each block's lanes are 5 host threads with barriers: the multi-lane logic, ctest
// ep.kernel_check_threads; compared with "host" bit for bit) and "cuda" (ep/kernels/ll_kernels.cu on GPU 0, built with nvcc by scripts/gpu_check.sh and in
// the build when MC_WITH_CUDA; only runs where a GPU is). With "cuda" the results must also
// equal the host executor's bit for bit, and dispatch/combine are timed at 128 tokens x 7168
// x top-8 (all ranks' kernels on one GPU, one stream: sends, then receives) beside the GPU's
// device-to-device copy rate.
//
//   ep_kernel_check host|threads|cuda [json path]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ep/kernels/host_lanes.h"
#include "ep/kernels/ll_kernels.h"
#include "ep/layout.h"
#include "tests/gpu/ep_kernel_exec.h"

namespace ep = mooncake::ep;
namespace kern = mooncake::ep::kern;
namespace num = mooncake::ep::num;

namespace {

// ---- the host executor ----
class HostExec : public kern::Exec {
 public:
  const char* name() const override { return "host"; }
  void* alloc(size_t n) override {
    void* p = std::calloc(1, n == 0 ? 1 : n);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void download(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void zero(void* p, size_t n) override { std::memset(p, 0, n); }
  int32_t* allocFlags(int n, int32_t** kernel_view) override {
    *kernel_view = static_cast<int32_t*>(alloc(sizeof(int32_t) * n));
    return *kernel_view;
  }
  void releaseFlags(int32_t* host) override { release(host); }
  // Low latency: the blocks one after another on the calling thread, lanes_ lanes each
  // (ep/kernels/host_lanes.h runBlocks: 1 runs on the calling thread itself).
  void dispatchSend(const kern::LlArgs& p, int experts, int32_t* toks) override {
    kern::HostLanes base;
    kern::runBlocks(experts, lanes_, base, [&](auto& ln, int e) {
      kern::dispatchSend(p, e, ln, toks + e * p.max_tokens);
    });
  }
  void dispatchRecv(const kern::LlArgs& p) override {
    kern::HostLanes base;
    const int64_t start = base.nowUs();
    kern::runBlocks(p.local_experts, lanes_, base,
                    [&](auto& ln, int l) { kern::dispatchRecv(p, l, ln, start); });
  }
  void combineSend(const kern::LlArgs& p) override {
    kern::HostLanes base;
    kern::runBlocks(p.world, lanes_, base, [&](auto& ln, int r) { kern::combineSend(p, r, ln); });
  }
  void combineRecv(const kern::LlArgs& p) override {
    kern::HostLanes base;
    const int64_t start = base.nowUs();
    kern::runBlocks(p.world, lanes_, base,
                    [&](auto& ln, int o) { kern::combineWait(p, o, ln, start); });
    kern::runBlocks(static_cast<int>(p.tokens), lanes_, base,
                    [&](auto& ln, int t) { kern::combineRecvToken(p, t, ln); });
  }
  // Normal mode: each call on a thread of its own (the ranks' calls wait for each other),
  // its blocks one after another with lanes_ lanes each, in the launchers' order.
  void normalDispatchSend(int, const kern::NormalArgs& p, int32_t* toks) override {
    const int lanes = lanes_;
    calls_.emplace_back([p, toks, lanes] {
      kern::HostLanes base;
      kern::runBlocks(p.world, lanes, base, [&](auto& ln, int d) {
        kern::normalDispatchSend(p, d, ln, toks + d * p.tokens);
      });
      const int64_t start = base.nowUs();
      kern::runBlocks(p.world, lanes, base,
                      [&](auto& ln, int r) { kern::normalDispatchWait(p, r, ln, start); });
    });
  }
  void normalDispatchRecv(int, const kern::NormalArgs& p, int32_t* toks) override {
    const int lanes = lanes_;
    calls_.emplace_back([p, toks, lanes] {
      kern::HostLanes base;
      kern::runBlocks(p.world, lanes, base, [&](auto& ln, int r) {
        kern::normalDispatchRecv(p, r, ln, toks + r * p.tokens);
      });
      kern::runBlocks(1, lanes, base, [&](auto& ln, int) { kern::normalAlign(p, ln); });
    });
  }
  void normalCombine(int, const kern::NormalArgs& p) override {
    const int lanes = lanes_;
    calls_.emplace_back([p, lanes] {
      kern::HostLanes base;
      kern::runBlocks(p.world, lanes, base, [&](auto& ln, int r) { kern::normalCombineSend(p, r, ln); });
      const int64_t start = base.nowUs();
      kern::runBlocks(p.world, lanes, base,
                      [&](auto& ln, int d) { kern::normalCombineWait(p, d, ln, start); });
      kern::runBlocks(static_cast<int>(p.tokens), lanes, base,
                      [&](auto& ln, int t) { kern::normalCombineToken(p, t, ln); });
    });
  }
  void finish() override {
    for (auto& t : calls_) t.join();
    calls_.clear();
  }
  double copyRateGBs(size_t) override { return 0; }

 protected:
  int lanes_ = 1;
  std::vector<std::thread> calls_;
};

#ifndef MC_EP_CHECK_CUDA
}  // namespace
std::unique_ptr<kern::Exec> kern::makeCudaExec(std::string* why) {
  *why = "this ep_kernel_check was built without CUDA (nvcc builds ep_kernel_check_cuda)";
  return nullptr;
}
namespace {
#endif

// ---- the threads executor: each block's lanes are host threads (kThreadLanes of them, not
// a multiple of anything on purpose; ep/kernels/host_lanes.h runBlocks), so the bodies'
// multi-lane logic runs here as on a GPU block. ----
constexpr int kThreadLanes = 5;

class ThreadsExec : public HostExec {
 public:
  ThreadsExec() { lanes_ = kThreadLanes; }
  const char* name() const override { return "threads"; }
};

struct Shape {
  int R, M, H, E, K;
  ep::DType dtype;
  int tokens_all_to = -1;  // every token to this expert (else random routing)
  uint64_t seed = 1;
};

std::string describe(const Shape& s) {
  std::ostringstream os;
  os << "R=" << s.R << " M=" << s.M << " H=" << s.H << " E=" << s.E << " K=" << s.K << " "
     << ep::dtypeName(s.dtype) << (s.tokens_all_to >= 0 ? " all-to-one" : "");
  return os.str();
}

// Host copies of one rank's inputs.
struct RankInput {
  int64_t T = 0;
  std::vector<uint16_t> x16;  // bf16 (bf16 and fp8)
  std::vector<float> x32;     // float32
  std::vector<int64_t> topk;
  std::vector<float> w;
};

RankInput makeInput(const Shape& s, int r) {
  std::mt19937_64 g(s.seed * 1000003 + r);
  RankInput in;
  in.T = std::max(0, s.M - 3 * r);
  if (r == 1) in.T = s.M;  // a full rank too
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t n = static_cast<size_t>(in.T) * s.H;
  if (s.dtype == ep::DType::kFloat32) {
    in.x32.resize(n);
    for (auto& v : in.x32) v = nd(g) * 10.0f;
  } else {
    in.x16.resize(n);
    for (size_t i = 0; i < n; ++i) in.x16[i] = num::floatToBf16(nd(g) * std::ldexp(1.0f, static_cast<int>(i % 23) - 11));
  }
  in.topk.assign(static_cast<size_t>(in.T) * s.K, -1);
  in.w.resize(static_cast<size_t>(in.T) * s.K);
  std::uniform_real_distribution<float> ud(0.001f, 1.0f);
  for (auto& v : in.w) v = ud(g);
  std::vector<int> ids(s.E);
  for (int64_t t = 0; t < in.T; ++t) {
    if (s.tokens_all_to >= 0) {
      in.topk[t * s.K] = s.tokens_all_to;
      continue;
    }
    if (t % 7 == 5) continue;  // a row of all -1
    for (int e = 0; e < s.E; ++e) ids[e] = e;
    std::shuffle(ids.begin(), ids.end(), g);
    for (int k = 0; k < s.K; ++k) in.topk[t * s.K + k] = (g() % 8 == 0) ? -1 : ids[k];
  }
  return in;
}

size_t inRowBytes(const Shape& s) { return s.H * (s.dtype == ep::DType::kFloat32 ? 4 : 2); }
size_t outRowBytes(const Shape& s) { return s.dtype == ep::DType::kFp8 ? s.H : inRowBytes(s); }
ep::DType combineType(const Shape& s) {
  return s.dtype == ep::DType::kFloat32 ? ep::DType::kFloat32 : ep::DType::kBFloat16;
}

// What one rank's calls produced (host copies).
struct RankOutput {
  std::vector<uint8_t> recv_x;
  std::vector<float> recv_scales;
  std::vector<int32_t> recv_count, src_info, active;
  std::vector<int64_t> layout;
  std::vector<uint8_t> out;  // combine
  bool operator==(const RankOutput& o) const {
    return recv_x == o.recv_x && recv_count == o.recv_count && src_info == o.src_info &&
           layout == o.layout && active == o.active && out == o.out &&
           std::memcmp(recv_scales.data(), o.recv_scales.data(), recv_scales.size() * 4) == 0;
  }
};

constexpr int64_t kGoneGraceUs = 5000;

// R simulated ranks on one executor.
class World {
 public:
  // split > 0: ranks [0, split) and [split, R) are two hosts, each rank's peers on the other
  // one proxied (tests/gpu/ep_proxy_check.h moves what they stage, as a host proxy would).
  World(kern::Exec& ex, const Shape& s, int split = 0) : ex_(ex), s_(s), split_(split) {
    bytes_ = ep::sizeHint(s.M, s.H, s.R, s.E);
    geo_ = ep::BufferGeometry(bytes_, s.R);
    L_ = s.E / s.R;
    for (int r = 0; r < s.R; ++r) {
      bufs_.push_back(ex.alloc(bytes_));
      ex.zero(bufs_.back(), bytes_);
    }
    gone_host_ = ex.allocFlags(s.R, &gone_view_);
    for (int r = 0; r < s.R; ++r) {
      std::vector<char*> table;
      for (int o = 0; o < s.R; ++o)
        table.push_back(hostOf(o) == hostOf(r) ? static_cast<char*>(bufs_[o]) : nullptr);
      peers_.push_back(ex.alloc(sizeof(char*) * s.R));
      ex.upload(peers_.back(), table.data(), sizeof(char*) * s.R);
      if (split_ > 0) addProxy();
    }
    for (int r = 0; r < s.R; ++r) in_.push_back(makeInput(s, r));
    const int64_t RM = static_cast<int64_t>(s.R) * s.M;
    for (int r = 0; r < s.R; ++r) {
      Dev d;
      const RankInput& in = in_[r];
      d.x = ex.put(s.dtype == ep::DType::kFloat32 ? static_cast<const void*>(in.x32.data())
                                                : static_cast<const void*>(in.x16.data()),
                in.T * inRowBytes(s));
      d.topk = ex.put(in.topk.data(), in.topk.size() * 8);
      d.w = ex.put(in.w.data(), in.w.size() * 4);
      d.active = ex.alloc(4 * s.R);
      d.recv_x = ex.alloc(L_ * RM * outRowBytes(s));
      d.recv_scales = ex.alloc(L_ * RM * (s.H / num::kFp8Group) * 4 + 4);
      d.recv_count = ex.alloc(4 * L_);
      d.src_info = ex.alloc(4 * L_ * RM);
      d.layout = ex.alloc(8 * L_ * s.R);
      d.y = ex.alloc(L_ * RM * s.H * (combineType(s) == ep::DType::kFloat32 ? 4 : 2));
      d.out = ex.alloc(std::max<int64_t>(1, in.T) * s.H * 4);
      d.toks = ex.alloc(4 * s.E * s.M);
      d.decision = ex.alloc(4 * s.R);
      d.self_count = ex.alloc(4 * L_);
      d.error = ex.alloc(8);
      dev_.push_back(d);
    }
  }
  ~World() {
    for (auto& d : dev_)
      for (void* p : {d.x, d.topk, d.w, d.active, d.recv_x, d.recv_scales, d.recv_count,
                      d.src_info, d.layout, d.y, d.out, d.toks, d.decision, d.self_count,
                      d.error})
        ex_.release(p);
    for (void* b : bufs_) ex_.release(b);
    for (void* t : peers_) ex_.release(t);
    for (Proxy& x : proxy_) {
      for (int k = 0; k < 2; ++k)
        for (int h = 0; h < 2; ++h) {
          ex_.release(x.stage[k][h]);
          ex_.releaseFlags(x.words[k][h]);
        }
      ex_.releaseFlags(x.ctrl);
    }
    ex_.releaseFlags(gone_host_);
  }
  int hostOf(int r) const { return split_ > 0 && r >= split_ ? 1 : 0; }
  // Rank r's gone flag goes up `ms` after this call, from another thread (as the engine's
  // peer-gone handler would), while the waits run; joined by the next round's start.
  void markGoneAfter(int r, int ms) {
    if (raiser_.joinable()) raiser_.join();
    raiser_ = std::thread([this, r, ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      __atomic_store_n(&gone_host_[r], 1, __ATOMIC_RELEASE);
    });
  }
  void joinRaiser() {
    if (raiser_.joinable()) raiser_.join();
  }
  const RankInput& input(int r) const { return in_[r]; }
  int local() const { return L_; }
  // Bad input (tests/gpu/ep_bad_input_check.h): rank r's topk_idx[t][k] = e; rank r's
  // layout_range[l][src] (its last dispatch's handle) = v; rank r's error words.
  void setTopk(int r, int64_t t, int k, int64_t e) {
    in_[r].topk[t * s_.K + k] = e;
    ex_.upload(dev_[r].topk, in_[r].topk.data(), in_[r].topk.size() * 8);
  }
  void setLayout(int r, int l, int src, int64_t v) {
    ex_.upload(static_cast<int64_t*>(dev_[r].layout) + l * s_.R + src, &v, 8);
  }
  std::pair<int32_t, int32_t> errorOf(int r) {
    int32_t err[2];
    ex_.download(err, dev_[r].error, 8);
    return {err[0], err[1]};
  }

  kern::LlArgs args(int r, uint32_t round, bool combine, ep::DType dt) {
    const auto lay = ep::LowLatencyLayout::make(s_.R, s_.E, s_.M, s_.H, dt);
    kern::LlArgs p;
    p.me = r;
    p.world = s_.R;
    p.local_experts = L_;
    p.topk = s_.K;
    p.dtype = static_cast<int>(dt);
    p.max_tokens = s_.M;
    p.hidden = s_.H;
    p.tokens = in_[r].T;
    p.round = round;
    p.gone = gone_view_;
    p.gone_grace_us = kGoneGraceUs;
    p.peers = static_cast<char* const*>(peers_[r]);
    if (split_ > 0) {
      const Proxy& x = proxy_[r];
      const int k = combine ? 1 : 0, h = static_cast<int>(round & 1);
      p.stage = static_cast<char*>(x.stage[k][h]);
      p.proxy_words = reinterpret_cast<uint64_t*>(x.words_view[k][h]);
      p.ctrl = reinterpret_cast<const char*>(x.ctrl_view) + (round & 1) * ep::kSignalBytes;
    }
    ep::setRoundOffsets(p, geo_, round, combine ? 1 : 0);
    p.row_stride = lay.row_stride;
    p.src_base = lay.src_base;
    const Dev& d = dev_[r];
    p.x = d.x;
    p.topk_idx = static_cast<const int64_t*>(d.topk);
    p.topk_weights = static_cast<const float*>(d.w);
    p.active = static_cast<int32_t*>(d.active);
    p.recv_x = d.recv_x;
    p.recv_scales = static_cast<float*>(d.recv_scales);
    p.recv_count = static_cast<int32_t*>(d.recv_count);
    p.src_info = static_cast<int32_t*>(d.src_info);
    p.layout_range = static_cast<int64_t*>(d.layout);
    p.y = d.y;
    p.out = d.out;
    p.decision = static_cast<int32_t*>(d.decision);
    p.self_count = static_cast<int32_t*>(d.self_count);
    p.error = static_cast<int32_t*>(d.error);
    return p;
  }

  // One dispatch round; `silent` (>= 0) sends nothing and receives nothing.
  void dispatch(uint32_t round, int silent, int64_t timeout_us) {
    std::vector<int32_t> ones(s_.R, 1);
    for (int r = 0; r < s_.R; ++r) {
      ex_.upload(dev_[r].active, ones.data(), 4 * s_.R);
      ex_.zero(dev_[r].self_count, 4 * L_);
    }
    // (The error words are zeroed before the sends, as a stream-ordered call does: the sends
    // check topk_idx.)
    for (int r = 0; r < s_.R; ++r) {
      if (r == silent) continue;
      ex_.zero(dev_[r].error, 8);
      auto p = args(r, round, false, s_.dtype);
      p.timeout_us = timeout_us;
      ex_.dispatchSend(p, s_.E, static_cast<int32_t*>(dev_[r].toks));
    }
    if (split_ > 0) proxyMove(round, false, silent);
    for (int r = 0; r < s_.R; ++r) {
      if (r == silent) continue;
      ex_.zero(dev_[r].decision, 4 * s_.R);
      auto p = args(r, round, false, s_.dtype);
      p.timeout_us = timeout_us;
      ex_.dispatchRecv(p);
    }
    ex_.finish();
    collectErrors(silent);
  }

  // One combine round over the last dispatch's handles, with y = expert outputs made here
  // (fresh_y) or the last round's.
  void combine(uint32_t round, int silent, int64_t timeout_us, bool fresh_y = true) {
    const int64_t RM = static_cast<int64_t>(s_.R) * s_.M;
    const ep::DType ct = combineType(s_);
    for (int r = 0; r < s_.R && fresh_y; ++r) {
      std::vector<uint8_t> y(L_ * RM * s_.H * (ct == ep::DType::kFloat32 ? 4 : 2));
      std::mt19937 g(static_cast<uint32_t>(s_.seed * 31 + r));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      if (ct == ep::DType::kFloat32) {
        auto* f = reinterpret_cast<float*>(y.data());
        for (size_t i = 0; i < y.size() / 4; ++i) f[i] = nd(g);
      } else {
        auto* b = reinterpret_cast<uint16_t*>(y.data());
        for (size_t i = 0; i < y.size() / 2; ++i) b[i] = num::floatToBf16(nd(g));
      }
      ex_.upload(dev_[r].y, y.data(), y.size());
      ys_.push_back(std::move(y));
    }
    for (int r = 0; r < s_.R; ++r) {
      if (r == silent) continue;
      ex_.zero(dev_[r].error, 8);
      auto p = args(r, round, true, ct);
      p.timeout_us = timeout_us;
      ex_.combineSend(p);
    }
    if (split_ > 0) proxyMove(round, true, silent);
    for (int r = 0; r < s_.R; ++r) {
      if (r == silent) continue;
      ex_.zero(dev_[r].decision, 4 * s_.R);
      auto p = args(r, round, true, ct);
      p.timeout_us = timeout_us;
      ex_.combineRecv(p);
    }
    ex_.finish();
    collectErrors(silent);
  }
  void collectErrors(int silent) {
    for (int r = 0; r < s_.R; ++r) {
      if (r == silent) continue;
      int32_t err[2];
      ex_.download(err, dev_[r].error, 8);
      if (err[0] != 0 && error_ == 0) error_ = err[0];
    }
  }
  const std::vector<uint8_t>& y(int r) const { return ys_[ys_.size() - s_.R + r]; }

  RankOutput output(int r) {
    const int64_t RM = static_cast<int64_t>(s_.R) * s_.M;
    RankOutput o;
    o.recv_x.resize(L_ * RM * outRowBytes(s_));
    o.recv_scales.resize(s_.dtype == ep::DType::kFp8 ? L_ * RM * (s_.H / num::kFp8Group) : 0);
    o.recv_count.resize(L_);
    o.src_info.resize(L_ * RM);
    o.layout.resize(L_ * s_.R);
    o.active.resize(s_.R);
    o.out.resize(in_[r].T * s_.H * (combineType(s_) == ep::DType::kFloat32 ? 4 : 2));
    const Dev& d = dev_[r];
    ex_.download(o.recv_x.data(), d.recv_x, o.recv_x.size());
    ex_.download(o.recv_scales.data(), d.recv_scales, o.recv_scales.size() * 4);
    ex_.download(o.recv_count.data(), d.recv_count, L_ * 4);
    ex_.download(o.src_info.data(), d.src_info, L_ * RM * 4);
    ex_.download(o.layout.data(), d.layout, L_ * s_.R * 8);
    ex_.download(o.active.data(), d.active, s_.R * 4);
    ex_.download(o.out.data(), d.out, o.out.size());
    // Rows past recv_count are not outputs: zero them so that executors compare equal.
    for (int l = 0; l < L_; ++l) {
      const int64_t n = o.recv_count[l];
      std::fill(o.recv_x.begin() + (l * RM + n) * outRowBytes(s_),
                o.recv_x.begin() + (l + 1) * RM * outRowBytes(s_), 0);
      std::fill(o.src_info.begin() + l * RM + n, o.src_info.begin() + (l + 1) * RM, 0);
      if (!o.recv_scales.empty()) {
        const int64_t G = s_.H / num::kFp8Group;
        std::fill(o.recv_scales.begin() + (l * RM + n) * G, o.recv_scales.begin() + (l + 1) * RM * G,
                  0.0f);
      }
    }
    return o;
  }
  int32_t error() const { return error_; }

 private:
  // A proxied rank's staging rows, the words its kernels post for the proxy and the signal
  // words of proxied sources (both halves), host-mapped (ep/kernels/ll_kernels.h).
  // A stage and words per (kind, half), as a proxy needs them (a word carries the round, not
  // the kind: ep/kernels/README.md, "Proxied ranks").
  struct Proxy {
    void* stage[2][2];
    int32_t *words[2][2], *words_view[2][2], *ctrl, *ctrl_view;
  };
  void addProxy() {
    Proxy x;
    for (int k = 0; k < 2; ++k)
      for (int h = 0; h < 2; ++h) {
        x.stage[k][h] = ex_.alloc(bytes_);  // (more than a region of either dtype needs)
        x.words[k][h] = ex_.allocFlags(2 * s_.R * L_, &x.words_view[k][h]);
      }
    x.ctrl = ex_.allocFlags(static_cast<int>(2 * ep::kSignalBytes / 4), &x.ctrl_view);
    proxy_.push_back(x);
  }
  // Moves what the sends of `round` staged for proxied ranks, as a host proxy would (after
  // them: the executor has finished), then stores the destinations' signal words
  // (tests/gpu/ep_proxy_check.h).
  void proxyMove(uint32_t round, bool combine, int silent);

  struct Dev {
    void *x, *topk, *w, *active, *recv_x, *recv_scales, *recv_count, *src_info, *layout, *y, *out,
        *toks, *decision, *self_count, *error;
  };
  kern::Exec& ex_;
  Shape s_;
  size_t bytes_ = 0;
  ep::BufferGeometry geo_;
  int L_ = 0;
  std::vector<void*> bufs_;
  int split_ = 0;
  std::vector<void*> peers_;  // each rank's table of its peers' buffers (null: proxied)
  std::vector<Proxy> proxy_;  // (split_ > 0)
  int32_t* gone_host_ = nullptr;
  int32_t* gone_view_ = nullptr;
  std::thread raiser_;
  std::vector<RankInput> in_;
  std::vector<Dev> dev_;
  std::vector<std::vector<uint8_t>> ys_;
  int32_t error_ = 0;
};

// ---- the naive reference ----
std::string checkAgainstReference(World& w, const Shape& s, int me, const RankOutput& o,
                                  int silent) {
  const int L = w.local();
  const int64_t RM = static_cast<int64_t>(s.R) * s.M;
  const int64_t G = s.H / num::kFp8Group;
  std::ostringstream err;
  for (int r = 0; r < s.R; ++r)
    if (o.active[r] != (r == silent ? 0 : 1)) {
      err << "rank " << me << ": active[" << r << "] = " << o.active[r];
      return err.str();
    }
  for (int l = 0; l < L; ++l) {
    const int e = me * L + l;
    int64_t begin = 0;
    for (int step = 0; step < s.R; ++step) {
      const int r = (me + step) % s.R;
      const RankInput& in = w.input(r);
      std::vector<int32_t> toks;
      if (r != silent)
        for (int64_t t = 0; t < in.T; ++t)
          for (int k = 0; k < s.K; ++k)
            if (in.topk[t * s.K + k] == e) toks.push_back(static_cast<int32_t>(t));
      const int64_t v = o.layout[l * s.R + r];
      const int64_t c = static_cast<int64_t>(toks.size());
      if ((v & 0xffffffff) != c || (c > 0 && (v >> 32) != begin)) {
        err << "rank " << me << " expert " << e << " from " << r << ": layout (" << (v >> 32)
            << ", " << (v & 0xffffffff) << "), want (" << begin << ", " << c << ")";
        return err.str();
      }
      for (int64_t j = 0; j < c; ++j) {
        const int64_t row = l * RM + begin + j;
        const int32_t t = toks[j];
        if (o.src_info[row] != t) {
          err << "rank " << me << " expert " << e << " row " << begin + j << ": src " << o.src_info[row]
              << ", want " << t;
          return err.str();
        }
        const uint8_t* got = o.recv_x.data() + row * outRowBytes(s);
        if (s.dtype == ep::DType::kFp8) {
          std::vector<uint8_t> wire(num::fp8RowBytes(s.H));
          num::quantizeRow(in.x16.data() + t * s.H, s.H, wire.data());
          if (std::memcmp(got, wire.data(), s.H) != 0 ||
              std::memcmp(o.recv_scales.data() + row * G, wire.data() + s.H, G * 4) != 0) {
            err << "rank " << me << " expert " << e << " row " << begin + j << ": fp8 row differs";
            return err.str();
          }
        } else {
          const void* want = s.dtype == ep::DType::kFloat32
                                 ? static_cast<const void*>(in.x32.data() + t * s.H)
                                 : static_cast<const void*>(in.x16.data() + t * s.H);
          if (std::memcmp(got, want, inRowBytes(s)) != 0) {
            err << "rank " << me << " expert " << e << " row " << begin + j << ": row differs";
            return err.str();
          }
        }
      }
      begin += c;
    }
    if (o.recv_count[l] != begin) {
      err << "rank " << me << " expert " << e << ": recv_count " << o.recv_count[l] << ", want "
          << begin;
      return err.str();
    }
  }
  // Combine: the owner o's output for (e, t) is y_o at the row its dispatch put t in.
  const RankInput& in = w.input(me);
  const bool f32 = combineType(s) == ep::DType::kFloat32;
  for (int64_t t = 0; t < in.T; ++t) {
    for (int64_t h = 0; h < s.H; ++h) {
      float acc = 0.0f;
      bool first = true;
      for (int k = 0; k < s.K; ++k) {
        const int64_t e = in.topk[t * s.K + k];
        if (e < 0) continue;
        const int owner = static_cast<int>(e / L);
        if (owner == silent) continue;
        // Row of t in the owner's recv_x for expert e: its block from `me` in source order.
        const int l = static_cast<int>(e % L);
        int64_t row = 0;
        for (int step = 0; step < s.R; ++step) {
          const int r = (owner + step) % s.R;
          if (r == silent) continue;
          const RankInput& ir = w.input(r);
          for (int64_t u = 0; u < (r == me ? t : ir.T); ++u)
            for (int kk = 0; kk < s.K; ++kk)
              if (ir.topk[u * s.K + kk] == e) ++row;
          if (r == me) break;
        }
        const uint8_t* y = w.y(owner).data() + (l * RM + row) * s.H * (f32 ? 4 : 2);
        const float v = f32 ? reinterpret_cast<const float*>(y)[h]
                            : num::bf16ToFloat(reinterpret_cast<const uint16_t*>(y)[h]);
        const float prod = in.w[t * s.K + k] * v;
        acc = first ? 0.0f + prod : acc + prod;
        first = false;
      }
      bool same;
      if (f32) {
        float got;
        std::memcpy(&got, o.out.data() + (t * s.H + h) * 4, 4);
        same = std::memcmp(&got, &acc, 4) == 0;
      } else {
        uint16_t got;
        std::memcpy(&got, o.out.data() + (t * s.H + h) * 2, 2);
        same = got == num::floatToBf16(acc);
      }
      if (!same) {
        err << "rank " << me << " combine token " << t << " channel " << h << " differs";
        return err.str();
      }
    }
  }
  return "";
}

struct Result {
  std::string check;
  bool ok;
  std::string detail;
};

// Runs one shape on `ex` (and, when given, the same on `ref` for a bit-for-bit comparison).
// gone_after_ms >= 0: the silent rank's gone flag goes up that long into the first round (the
// waits have no deadline then: timeout_us -1).
Result runShape(kern::Exec& ex, kern::Exec* ref, const Shape& s, int silent, int64_t timeout_us,
                int gone_after_ms = -1, int split = 0) {
  Result res{"ll " + describe(s) + (silent >= 0 ? " silent rank " + std::to_string(silent) : "") +
                 (gone_after_ms >= 0 ? " gone" : "") +
                 (split > 0 ? " hosts of " + std::to_string(split) + "+" +
                                  std::to_string(s.R - split) + " (proxied)"
                            : ""),
             true, ""};
  World w(ex, s, split);
  std::unique_ptr<World> wr;
  if (ref) wr = std::make_unique<World>(*ref, s, split);
  std::ostringstream detail;
  for (uint32_t round = 1; round <= 2 && res.ok; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    if (gone_after_ms >= 0 && round == 1) w.markGoneAfter(silent, gone_after_ms);
    w.dispatch(round, silent, timeout_us);
    w.combine(round, silent, timeout_us);
    w.joinRaiser();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (wr) {
      if (gone_after_ms >= 0 && round == 1) wr->markGoneAfter(silent, 0);
      wr->dispatch(round, silent, timeout_us);
      wr->combine(round, silent, timeout_us);
      wr->joinRaiser();
    }
    if (w.error() != 0) {
      res.ok = false;
      detail << "round " << round << ": error code " << w.error();
      break;
    }
    if (silent >= 0 && ms > 1000.0 + timeout_us / 500.0) {
      res.ok = false;
      detail << "round " << round << " took " << ms << " ms with timeout_us " << timeout_us;
    }
    for (int r = 0; r < s.R && res.ok; ++r) {
      if (r == silent) continue;
      RankOutput o = w.output(r);
      std::string e = checkAgainstReference(w, s, r, o, silent);
      if (!e.empty()) {
        res.ok = false;
        detail << "round " << round << ": " << e;
      } else if (wr && !(o == wr->output(r))) {
        res.ok = false;
        detail << "round " << round << ": rank " << r << " differs from the host executor";
      }
    }
  }
  res.detail = res.ok ? "equal to the reference" + std::string(ref ? " and to the host executor" : "")
                      : detail.str();
  return res;
}

// Dispatch and combine p50 at DeepEP's benchmark shape (all ranks on this executor).
Result timeShape(kern::Exec& ex, int R) {
  Shape s{R, 128, 7168, 8 * R, 8, ep::DType::kBFloat16};
  World w(ex, s);
  std::vector<double> d_us, c_us;
  for (uint32_t round = 1; round <= 40; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    w.dispatch(round, -1, 10'000'000);
    auto t1 = std::chrono::steady_clock::now();
    w.combine(round, -1, 10'000'000, round == 1);
    auto t2 = std::chrono::steady_clock::now();
    if (round > 5) {
      d_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      c_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    }
  }
  std::sort(d_us.begin(), d_us.end());
  std::sort(c_us.begin(), c_us.end());
  std::ostringstream os;
  os << "all " << R << " ranks' kernels, one stream, 128 x 7168 bf16 top-8: dispatch p50 "
     << d_us[d_us.size() / 2] << " us, combine p50 " << c_us[c_us.size() / 2]
     << " us (host-timed, launches included); device-to-device copy rate "
     << ex.copyRateGBs(64 << 20) << " GB/s";
  return {"ll timing R=" + std::to_string(R), true, os.str()};
}

}  // namespace

#include "tests/gpu/ep_normal_check.h"
#include "tests/gpu/ep_bad_input_check.h"
#include "tests/gpu/ep_proxy_check.h"

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "host";
  const std::string json = argc > 2 ? argv[2] : "";
  HostExec host;
  ThreadsExec threads;
  std::unique_ptr<kern::Exec> cuda;
  kern::Exec* ex = &host;
  if (which == "threads") {
    ex = &threads;
  } else if (which == "cuda") {
    std::string why;
    cuda = kern::makeCudaExec(&why);
    if (!cuda) {
      std::printf("{\"check\": \"ep kernels\", \"ok\": false, \"detail\": \"no cuda executor: %s\"}\n",
                  why.c_str());
      return 1;
    }
    ex = cuda.get();
  }
  kern::Exec* ref = ex == &host ? nullptr : &host;
  std::vector<Result> rows;
  const ep::DType types[] = {ep::DType::kBFloat16, ep::DType::kFloat32, ep::DType::kFp8};
  for (int R : {2, 3, 4})
    for (ep::DType t : types) rows.push_back(runShape(*ex, ref, {R, 24, 256, 4 * R, 3, t, -1, 5}, -1, -1));
  rows.push_back(runShape(*ex, ref, {2, 17, 128, 64, 11, ep::DType::kBFloat16, -1, 6}, -1, -1));
  rows.push_back(runShape(*ex, ref, {4, 9, 384, 8, 1, ep::DType::kFp8, -1, 7}, -1, -1));
  rows.push_back(runShape(*ex, ref, {3, 24, 128, 6, 2, ep::DType::kBFloat16, 0, 8}, -1, -1));
  rows.push_back(runShape(*ex, ref, {4, 20, 128, 8, 2, ep::DType::kFloat32, -1, 9}, 3, 20000));
  rows.push_back(runShape(*ex, ref, {3, 20, 256, 6, 3, ep::DType::kFp8, -1, 10}, 1, 20000));
  rows.push_back(runShape(*ex, ref, {3, 16, 128, 6, 2, ep::DType::kBFloat16, -1, 11}, 2, -1, 30));
  // Ranks on two hosts, the other host's through a proxy (tests/gpu/ep_proxy_check.h).
  // (A deadline, so that a word the kernels wait for in vain fails the row, not the run.)
  const int64_t bound = 10'000'000;
  const ep::DType bf16 = ep::DType::kBFloat16, f32 = ep::DType::kFloat32;
  rows.push_back(runShape(*ex, ref, {4, 24, 256, 16, 3, bf16, -1, 31}, -1, bound, -1, 2));
  rows.push_back(runShape(*ex, ref, {3, 20, 256, 6, 4, ep::DType::kFp8, -1, 32}, -1, bound, -1, 1));
  rows.push_back(runShape(*ex, ref, {2, 17, 128, 64, 11, f32, -1, 33}, -1, bound, -1, 1));
  rows.push_back(runShape(*ex, ref, {3, 12, 128, 6, 2, bf16, 0, 34}, -1, bound, -1, 1));
  rows.push_back(runShape(*ex, ref, {4, 20, 128, 8, 2, f32, -1, 35}, 3, 20000, -1, 2));
  // Normal mode: bf16 and float32, top-k with -1 entries, an alignment, every token to one
  // expert.
  rows.push_back(runNormalShape(*ex, {2, 24, 256, 8, 3, ep::DType::kBFloat16, -1, 21}, 1));
  rows.push_back(runNormalShape(*ex, {3, 20, 128, 6, 2, ep::DType::kFloat32, -1, 22}, 4));
  rows.push_back(runNormalShape(*ex, {4, 16, 128, 8, 4, ep::DType::kFloat32, -1, 25}, 1));
  rows.push_back(runNormalShape(*ex, {4, 17, 384, 16, 11, ep::DType::kBFloat16, -1, 23}, 1));
  rows.push_back(runNormalShape(*ex, {4, 12, 128, 8, 2, ep::DType::kBFloat16, 5, 24}, 8));
  for (Result& r : runBadInput(*ex)) rows.push_back(std::move(r));
  if (ex == cuda.get())
    for (int R : {2, 4}) rows.push_back(timeShape(*ex, R));
  bool all = true;
  std::string lines;
  for (const auto& r : rows) {
    all &= r.ok;
    std::string d;
    for (char c : r.detail) d += (c == '"' || c == '\\') ? '\'' : c;
    lines += "{\"check\": \"" + r.check + "\", \"executor\": \"" + ex->name() +
             "\", \"ok\": " + (r.ok ? "true" : "false") + ", \"detail\": \"" + d + "\"}\n";
  }
  std::fputs(lines.c_str(), stdout);
  if (!json.empty()) std::ofstream(json) << lines;
  return all ? 0 : 1;
}
