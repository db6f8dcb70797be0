// EpBuffer::Proxy (ep/ll_proxy.h): a GPU buffer's ranks on other hosts.
#include "ep/ll_proxy.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/params.h"
#include "ep/peer_writer.h"
#include "ep/str.h"

namespace mooncake::ep {

namespace dev = engine::device;

namespace {

constexpr size_t kWordsBytes = 4 * static_cast<size_t>(kMaxSignals) * 8;  // [kind][half]
constexpr size_t kDoneBytes = kern::kCtlWords * 4;  // done[kind][half], taken, stopped
constexpr size_t kRingBytes = kern::kProxyRingSlots * sizeof(kern::ProxyJob);

// Areas of buffers freed, for the next (host words are never freed: Device::allocHostWords).
std::mutex g_pool_mu;
std::vector<char*>& areaPool() {
  static auto* v = new std::vector<char*>();
  return *v;
}

char* takeArea(dev::Device* layer, size_t bytes) {
  {
    std::lock_guard<std::mutex> g(g_pool_mu);
    if (!areaPool().empty()) {
      char* a = areaPool().back();
      areaPool().pop_back();
      std::memset(a, 0, bytes);  // (rounds start again at 1: no stale word may match)
      return a;
    }
  }
  auto words = layer->allocHostWords(bytes / 4);
  if (!words.ok())
    throw std::runtime_error(str("host-mapped words for the proxy: ", words.status().toString()));
  return reinterpret_cast<char*>(*words);
}

}  // namespace

size_t EpBuffer::Proxy::shadowHalfBytes() { return kSignalBytes + kMailboxBytes; }

size_t EpBuffer::Proxy::shadow(int h, size_t off) const {
  return static_cast<size_t>(h) * shadowHalfBytes() + (off - buf_.geo_.dispatchSignal(h, 0));
}

uint32_t* EpBuffer::Proxy::ctl() const {
  return reinterpret_cast<uint32_t*>(area_ + 2 * shadowHalfBytes() + kWordsBytes);
}

uint32_t* EpBuffer::Proxy::doneWord(int kind, int half) const { return ctl() + kind * 2 + half; }

kern::ProxyJob* EpBuffer::Proxy::ring() const {
  return reinterpret_cast<kern::ProxyJob*>(reinterpret_cast<char*>(ctl()) + kDoneBytes);
}

EpBuffer::Proxy::Proxy(EpBuffer& buf) : buf_(buf) {
  try {
    init();
  } catch (...) {
    release();  // (a constructor that throws has no destructor run)
    throw;
  }
}

void EpBuffer::Proxy::init() {
  const int R = buf_.g_.size;
  proxied_.assign(R, 0);
  for (int r = 0; r < R; ++r) proxied_[r] = r != buf_.g_.rank && buf_.mapped_[r] == nullptr;
  dev::Device* layer = buf_.deviceLayer("ep.Buffer");
  engine::TransferEngine& eng = *buf_.g_.engine;
  area_bytes_ = 2 * shadowHalfBytes() + kWordsBytes + kDoneBytes + kRingBytes;
  area_ = takeArea(layer, area_bytes_);
  auto fail = [&](const char* what, const Status& st) {
    throw std::runtime_error(str(what, ": ", st.toString()));
  };
  Status st = eng.registerMemory(area_, area_bytes_, engine::MemoryKind::kHost);
  if (!st.ok()) fail("registering the proxy's host words", st);
  registered_area_ = true;
  st = eng.registerMemory(buf_.base_, buf_.geo_.totalBytes(), engine::MemoryKind::kCuda, buf_.device_);
  if (!st.ok()) fail("registering the buffer with the engine", st);
  registered_buffer_ = true;
  // A low-latency call's layout fits in one region (validate), and a normal-mode call's
  // NormalLayout is made from the region's size: so does either's stage.
  stage_bytes_ = buf_.geo_.regionBytes();
  auto mem = layer->allocate(4 * stage_bytes_, buf_.device_);
  if (!mem.ok()) fail("allocating the proxy's stages", mem.status());
  stage_ = static_cast<char*>(*mem);
  st = eng.registerMemory(stage_, 4 * stage_bytes_, engine::MemoryKind::kCuda, buf_.device_);
  if (!st.ok()) fail("registering the proxy's stages", st);
  registered_stage_ = true;
  delay_ms_ = std::max<int64_t>(0, params::getInt("MC_EP_PROXY_DELAY_MS"));
  thread_ = std::thread([this] { loop(); });
}

EpBuffer::Proxy::~Proxy() {
  stop(false);
  release();
}

void EpBuffer::Proxy::release() {
  engine::TransferEngine& eng = *buf_.g_.engine;
  if (registered_stage_) (void)eng.unregisterMemory(stage_);
  if (registered_buffer_) (void)eng.unregisterMemory(buf_.base_);
  if (registered_area_) (void)eng.unregisterMemory(area_);
  if (stage_ != nullptr) {
    auto layer = dev::get();
    if (layer.ok()) (void)(*layer)->free(stage_);
  }
  if (area_ != nullptr) {
    std::lock_guard<std::mutex> g(g_pool_mu);
    areaPool().push_back(area_);
  }
  stage_ = area_ = nullptr;
  registered_stage_ = registered_buffer_ = registered_area_ = false;
}

void EpBuffer::Proxy::stop(bool drained) {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
    abort_ = abort_ || !drained;
    // (Kernels that wait for the proxy -- a stage, a ring slot -- go on.)
    if (abort_) __atomic_store_n(ctl() + kern::kCtlStopped, 1u, __ATOMIC_RELEASE);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t EpBuffer::Proxy::remoteMailbox(int r, int half, int kind) const {
  return peer_areas_[r] + shadow(half, buf_.geo_.mailbox(half, kind, buf_.g_.rank));
}

template <class Args>
void EpBuffer::Proxy::fill(Args& p, RoundKind kind, uint32_t round) const {
  const int k = static_cast<int>(kind), h = static_cast<int>(round & 1);
  p.stage = stage_ + static_cast<size_t>(2 * k + h) * stage_bytes_;
  p.proxy_words = reinterpret_cast<uint64_t*>(area_ + 2 * shadowHalfBytes()) +
                  static_cast<size_t>(2 * k + h) * kMaxSignals;
  p.ctrl = area_ + static_cast<size_t>(h) * shadowHalfBytes();
}
template void EpBuffer::Proxy::fill(kern::LlArgs&, RoundKind, uint32_t) const;
template void EpBuffer::Proxy::fill(kern::NormalArgs&, RoundKind, uint32_t) const;

void EpBuffer::Proxy::stageFree(RoundKind kind, uint32_t round, const char* op) {
  const int k = static_cast<int>(kind), h = static_cast<int>(round & 1);
  std::unique_lock<std::mutex> g(mu_);
  const auto bound = std::chrono::milliseconds(2 * buf_.timeout_ms_);
  if (!cv_.wait_for(g, bound, [&] { return pending_[k][h] == 0; }))
    throw std::runtime_error(str(op, ": rank ", buf_.g_.rank, ": the host proxy did not move "
                                 "round ", queued_[k][h], "'s rows to the ranks on other hosts "
                                 "within ", bound.count(), " ms"));
}

void EpBuffer::Proxy::push(Job j) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!j.abandon) {
      const int k = static_cast<int>(j.kind), h = static_cast<int>(j.round & 1);
      queued_[k][h] = j.round;
      ++pending_[k][h];
    }
    jobs_.push_back(std::move(j));
  }
  cv_.notify_all();
}

void EpBuffer::Proxy::moveSend(const kern::LlArgs& p, RoundKind kind,
                               std::shared_ptr<dev::Event> sent) {
  Job j;
  j.kind = kind;
  j.round = p.round;
  j.p = p;
  j.sent = std::move(sent);
  push(std::move(j));
}

void EpBuffer::Proxy::moveSend(const kern::NormalArgs& p, RoundKind kind,
                               std::shared_ptr<dev::Event> sent) {
  Job j;
  j.normal = true;
  j.kind = kind;
  j.round = p.round;
  j.np = p;
  j.sent = std::move(sent);
  push(std::move(j));
}

void EpBuffer::Proxy::abandon(RoundKind kind, uint32_t round) {
  Job j;
  j.abandon = true;
  j.kind = kind;
  j.round = round;
  push(std::move(j));
}

void EpBuffer::Proxy::fillDeviceRounds(kern::DeviceRounds& d) {
  d.ctl = ctl();
  d.ring = reinterpret_cast<char*>(ring());
  d.stage_half = stage_bytes_;
  d.words_half = kMaxSignals;
  d.ctrl_half = shadowHalfBytes();
  if (!ring_.exchange(true)) {  // (the first time: the thread starts polling the ring)
    std::lock_guard<std::mutex> g(mu_);
    cv_.notify_all();
  }
}

void EpBuffer::Proxy::kick() {
  {
    std::lock_guard<std::mutex> g(mu_);
    kicked_ = true;
  }
  cv_.notify_all();
}

bool EpBuffer::Proxy::takeRingJob(Job* j) {
  const uint32_t n = ring_taken_ + 1;
  const kern::ProxyJob* slot = ring() + (n - 1) % kern::kProxyRingSlots;
  if (__atomic_load_n(&slot->seq, __ATOMIC_ACQUIRE) != n) return false;
  j->kind = slot->kind == 0 ? RoundKind::kDispatch : RoundKind::kCombine;
  j->round = slot->round;
  j->normal = slot->mode == kern::kJobNormal;
  j->abandon = slot->mode == kern::kJobAbandon;
  j->p = slot->ll;
  j->np = slot->np;
  // The stage and proxy words of (kind, round) are the proxy's own numbers: the kernels' (the
  // simulation's kernels post their host views of them).
  fill(j->p, j->kind, j->round);
  fill(j->np, j->kind, j->round);
  j->sent = nullptr;  // (every word is waited for: the send's last block posted the job)
  ring_taken_ = n;
  return true;
}

void EpBuffer::Proxy::loop() {
  std::unique_lock<std::mutex> g(mu_);
  int idle = 0;
  for (;;) {
    // With the ring, polled: yielding, then sleeping 10 us growing to 100 us, as runSend's.
    const auto nap = std::chrono::microseconds(idle < 64 ? 0 : 10 * std::min(idle - 63, 10));
    if (!ring_ || stop_)
      cv_.wait(g, [&] { return stop_ || ring_ || !jobs_.empty(); });
    else if (jobs_.empty() && nap.count() == 0) {
      g.unlock();
      std::this_thread::yield();
      g.lock();
    } else if (jobs_.empty()) {
      cv_.wait_for(g, nap, [&] { return stop_ || kicked_ || !jobs_.empty(); });
    }
    if (std::exchange(kicked_, false)) idle = 0;
    if (abort_) {  // the rest is dropped; the streams' waits on the stages are let go
      for (int k = 0; k < 2; ++k)
        for (int h = 0; h < 2; ++h) __atomic_store_n(doneWord(k, h), queued_[k][h], __ATOMIC_RELEASE);
      jobs_.clear();
      for (auto& k : pending_) k[0] = k[1] = 0;
      cv_.notify_all();
      return;
    }
    Job j;
    bool from_ring = false;
    if (!jobs_.empty()) {
      j = jobs_.front();
    } else if (ring_ && takeRingJob(&j)) {
      from_ring = true;
    } else if (stop_) {  // (drained: the kernels ran, so the ring holds nothing more)
      return;
    } else {
      idle = std::min(idle + 1, 73);
      continue;
    }
    idle = 0;
    g.unlock();
    try {
      if (j.abandon)
        runAbandon(j);
      else
        runSend(j);
    } catch (const std::exception& e) {  // (allocation failures: the peers time out on us)
      MC_LOG(ERROR, EP) << "ep proxy rank " << buf_.g_.rank << ": " << e.what();
    }
    g.lock();
    const int k = static_cast<int>(j.kind), h = static_cast<int>(j.round & 1);
    if (from_ring) {
      // The stage is free (a round given up used none): the send of round + 2 waits on it.
      __atomic_store_n(doneWord(k, h), j.round, __ATOMIC_RELEASE);
      __atomic_store_n(ctl() + kern::kCtlTaken, ring_taken_, __ATOMIC_RELEASE);  // (its slot too)
      continue;
    }
    jobs_.pop_front();
    if (!j.abandon) {
      --pending_[k][h];
      // The stage is free: a stream-ordered send of the next round of (kind, half) waits on it.
      __atomic_store_n(doneWord(k, h), j.round, __ATOMIC_RELEASE);
    }
    cv_.notify_all();
  }
}

void EpBuffer::Proxy::runSend(const Job& j) {
  const kern::LlArgs& p = j.p;
  const int R = buf_.g_.size, me = buf_.g_.rank;
  const uint32_t round = j.round;
  // Words per destination: a low-latency call's local experts, a normal-mode call's one.
  const int L = j.normal ? 1 : p.local_experts;
  const uint64_t* words = j.normal ? j.np.proxy_words : p.proxy_words;
  const bool dispatch = j.kind == RoundKind::kDispatch;
  if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
  Writer w(buf_, engine::deadlineInMs(buf_.timeout_ms_), j.kind, round);
  std::vector<char> taken(static_cast<size_t>(R) * L, 0);
  std::vector<int> left(R, 0);
  std::vector<uint32_t> counts(static_cast<size_t>(R) * L, 0);  // [o][l]: each word's rows
  std::vector<char> failed(R, 0);  // 1: skipped (inactive), 2: a move failed
  // A low-latency combine's rows for o are moved once every expert's word for o is in: one
  // read of their staged tokens for all of o's experts (the writes only leave at flush()).
  const bool per_dest = !j.normal && !dispatch;
  size_t pending = 0;
  for (int o = 0; o < R; ++o)
    if (proxied_[o]) left[o] = L, pending += L;
  int idle = 0;
  // A job without an event (from the ring: posted once the send's blocks all ended) waits
  // this long for a word that is not there (a word is written by the block that ended).
  const engine::Deadline words_by = engine::deadlineInMs(buf_.timeout_ms_);
  while (pending > 0) {
    // Checked before the words: once the send's kernels ended, every word they post is there.
    const bool ended = j.sent != nullptr ? j.sent->done() : engine::Clock::now() >= words_by;
    bool any = false;
    for (int o = 0; o < R; ++o) {
      if (!proxied_[o]) continue;
      for (int l = 0; l < L; ++l) {
        char& t = taken[static_cast<size_t>(o) * L + l];
        if (t != 0) continue;
        const uint64_t v =
            __atomic_load_n(words + static_cast<size_t>(o) * L + l, __ATOMIC_ACQUIRE);
        if (signalRound(v) != round) continue;
        t = 1;
        --pending;
        --left[o];
        any = true;
        const uint32_t n = signalCount(v);
        if (n == kern::kProxySkip) {  // o inactive for this rank: nothing, no signal
          failed[o] = 1;
          continue;
        }
        counts[static_cast<size_t>(o) * L + l] = n;
        if (failed[o] == 0 && !per_dest &&
            !(j.normal ? moveNormal(w, j.np, dispatch, o, n) : moveDispatch(w, p, o, l, n)))
          failed[o] = 2;
        if (per_dest && left[o] == 0 && failed[o] == 0) {
          const uint32_t* n_o = counts.data() + static_cast<size_t>(o) * L;
          if (moveCombine(w, p, o, n_o))  // (then o's signal: the rows of every expert)
            w.signal(o, p.combine_signals + static_cast<uint64_t>(me) * 8,
                     makeSignal(round, std::accumulate(n_o, n_o + L, 0u)));
          else
            failed[o] = 2;
        }
      }
    }
    if (any) {
      idle = 0;
      continue;
    }
    if (ended) break;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (abort_) break;
    }
    // (Spin briefly, then sleep 10 us growing to 100 us: a proxy whose kernels are queued
    // behind a long wait polls about 10^4 times a second, not 10^5.)
    if (idle < 64) {
      ++idle;
      std::this_thread::yield();
    } else {
      idle = std::min(idle + 1, 73);  // (10 us, growing to 100 us)
      std::this_thread::sleep_for(std::chrono::microseconds(10 * (idle - 63)));
    }
  }
  if (pending > 0) {
    MC_LOG(WARN, EP) << "ep proxy rank " << me << ": the " << (dispatch ? "dispatch" : "combine")
                     << " of round " << round << " posted nothing for " << pending
                     << (j.normal ? " ranks" : " (rank, expert) pairs")
                     << "; those ranks get no signal of it from this rank";
  }
  // A destination whose rows could not be moved is told this rank gave the round up (its
  // call then fails naming this rank, at once, as for a bad input's round).
  for (int o = 0; o < R; ++o)
    if (failed[o] == 2)
      w.signal(o, buf_.geo_.abandonSignal(round & 1, static_cast<int>(j.kind), me),
               makeSignal(round, 1));
  // (The deadline from now: the job may have waited long for its kernels to run.)
  w.setDeadline(engine::deadlineInMs(buf_.timeout_ms_));
  for (int o : w.flush()) {
    MC_LOG(WARN, EP) << "ep proxy rank " << me << ": round " << round << "'s rows to rank " << o
                     << " did not all arrive";
  }
}

bool EpBuffer::Proxy::moveDispatch(Writer& w, const kern::LlArgs& p, int o, int l, uint32_t n) {
  const int R = p.world, L = p.local_experts, me = p.me;
  if (n > static_cast<uint64_t>(p.max_tokens)) {  // (the kernels never post more)
    MC_LOG(ERROR, EP) << "ep proxy rank " << me << ": " << n << " rows staged for rank " << o
                      << " expert " << l << " exceed " << p.max_tokens;
    return false;
  }
  const uint64_t from = (static_cast<uint64_t>(o) * L + l) * p.max_tokens;
  const uint64_t to = (static_cast<uint64_t>(l) * R + me) * p.max_tokens;
  w.copy(o, p.dispatch_region + to * p.row_stride, p.stage + from * p.row_stride,
         n * p.row_stride);
  w.copy(o, p.dispatch_region + p.src_base + to * 4, p.stage + p.src_base + from * 4, n * 4);
  w.signal(o, p.dispatch_signals + (static_cast<uint64_t>(l) * R + me) * 8,
           makeSignal(p.round, n));
  return true;
}

bool EpBuffer::Proxy::moveCombine(Writer& w, const kern::LlArgs& p, int r, const uint32_t* n) {
  const int L = p.local_experts, me = p.me;
  const uint64_t M = static_cast<uint64_t>(p.max_tokens);
  uint64_t used = 0;  // id slots of r's blocks up to the last expert with rows
  for (int l = 0; l < L; ++l) {
    if (n[l] > M) {  // (the kernels never post more)
      MC_LOG(ERROR, EP) << "ep proxy rank " << me << ": " << n[l] << " combine rows staged for "
                        << "rank " << r << " expert " << l << " exceed " << M;
      return false;
    }
    if (n[l] > 0) used = l * M + n[l];
  }
  if (used == 0) return true;
  // The rows' tokens (their places at r), staged beside them in GPU memory, for all of r's
  // experts in one read. (Not on the copy stream: a caller's stream may wait there for a
  // receive that needs these rows.)
  const uint64_t first = static_cast<uint64_t>(r) * L * M;  // block (r, 0)
  std::vector<int32_t> toks(used);
  Status st = dev::transferCopy(toks.data(), p.stage + p.src_base + first * 4, used * 4,
                                engine::deadlineInMs(buf_.timeout_ms_));
  if (!st.ok()) {
    MC_LOG(ERROR, EP) << "ep proxy rank " << me << ": reading the staged tokens for rank " << r
                      << ": " << st.toString();
    return false;
  }
  for (int l = 0; l < L; ++l) {
    const int32_t* t = toks.data() + l * M;
    for (uint32_t j = 0; j < n[l]; ++j)
      if (t[j] < 0 || t[j] >= p.max_tokens) return false;  // (the kernels stage none such)
    const uint64_t expert_rows = static_cast<uint64_t>(me * L + l) * M;
    const uint64_t from = first + l * M;
    forEachRun(t, n[l], [&](size_t j, size_t c) {
      w.copy(r, p.combine_region + (expert_rows + t[j]) * p.row_stride,
             p.stage + (from + j) * p.row_stride, c * p.row_stride);
    });
  }
  return true;
}

bool EpBuffer::Proxy::moveNormal(Writer& w, const kern::NormalArgs& p, bool dispatch, int o,
                                 uint32_t n) {
  const int me = p.me, K = p.topk;
  if (n > static_cast<uint64_t>(p.capacity)) {  // (the kernels never post more)
    MC_LOG(ERROR, EP) << "ep proxy rank " << me << ": " << n << " normal-mode rows staged for "
                      << "rank " << o << " exceed " << p.capacity;
    return false;
  }
  // Block [o] of the stage (a region's layout) to block [me] of o's region, field by field.
  const uint64_t from = static_cast<uint64_t>(o) * p.capacity;
  const uint64_t to = static_cast<uint64_t>(me) * p.capacity;
  const uint64_t region = dispatch ? p.dispatch_region : p.combine_region;
  auto move = [&](uint64_t base, uint64_t bytes_per_row) {
    w.copy(o, region + base + to * bytes_per_row, p.stage + base + from * bytes_per_row,
           n * bytes_per_row);
  };
  move(0, p.row_stride);
  if (dispatch) {
    move(p.src_base, 4);
    if (p.with_topk) move(p.topk_base, static_cast<uint64_t>(K) * 8);
    if (p.with_weights) move(p.weight_base, static_cast<uint64_t>(K) * 4);
  } else if (p.with_weights) {
    move(p.cweight_base, static_cast<uint64_t>(K) * 4);
  }
  w.signal(o, (dispatch ? p.dispatch_signals : p.combine_signals) + static_cast<uint64_t>(me) * 8,
           makeSignal(p.round, n));
  return true;
}

void EpBuffer::Proxy::runAbandon(const Job& j) {
  const int R = buf_.g_.size, me = buf_.g_.rank, h = static_cast<int>(j.round & 1);
  Writer w(buf_, engine::deadlineInMs(buf_.timeout_ms_), j.kind, j.round);
  for (int o = 0; o < R; ++o)
    if (proxied_[o])
      w.signal(o, buf_.geo_.abandonSignal(h, static_cast<int>(j.kind), me),
               makeSignal(j.round, 1));
  (void)w.flush();  // (best effort, as every abandon)
}

char* EpBuffer::Proxy::shadowAt(size_t off) const {
  return area_ + shadow(off >= buf_.geo_.dispatchSignal(1, 0) ? 1 : 0, off);
}

}  // namespace mooncake::ep
