#include "pg/stream_ops.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "engine/log.h"
#include "pg/comm_impl.h"
#include "pg/device_reduce.h"
#include "pg/shm_group.h"

namespace mooncake::pg {

namespace device = engine::device;
using engine::Clock;

namespace {

constexpr size_t kWordStride = 128;  // per source rank: arrive at +0, done at +64
// Raises a word past every epoch a stream may wait for (cyclic comparison: 2^30 ahead).
constexpr uint32_t kRelease = uint32_t{1} << 30;

device::Device* layerOrThrow(const char* op) {
  auto layer = device::get();
  if (!layer.ok())
    throw CommError(std::string("mooncake pg: ") + op + ": no device layer: " +
                        layer.status().toString(),
                    -1, op);
  return *layer;
}

}  // namespace

StreamOps::StreamOps(Communicator::Impl& c)
    : c_(c),
      chunk_(c.params.stream_chunk_bytes),
      base_(static_cast<size_t>(c.size), nullptr),
      opened_(static_cast<size_t>(c.size), nullptr),
      words_bytes_((static_cast<size_t>(c.size) * kWordStride + 4095) & ~size_t{4095}) {}

StreamOps::~StreamOps() {
  drain();
  auto layer = device::get();
  if (!layer.ok()) return;
  for (void* b : opened_)
    if (b != nullptr) (void)(*layer)->closeIpc(b);
  if (own_ != nullptr) (void)(*layer)->free(own_);
}

uint32_t* StreamOps::words(int owner, int from, bool done) const {
  return reinterpret_cast<uint32_t*>(base_[static_cast<size_t>(owner)] +
                                     static_cast<size_t>(from) * kWordStride + (done ? 64 : 0));
}

char* StreamOps::buffer(int owner, uint64_t step) const {
  return base_[static_cast<size_t>(owner)] + words_bytes_ + (step & 1u) * chunk_;
}

uint64_t StreamOps::issued() const {
  std::lock_guard<std::mutex> g(mu_);
  return seq_;
}

bool StreamOps::setUp(int ordinal, const OpCtx& op) {
  ShmGroup& g = *c_.shm;
  device::Device* layer = layerOrThrow(op.name);
  const int me = c_.rank;
  ShmGroup::StreamInfo& mine = g.streamInfo(me);
  std::string why;  // why this rank cannot (empty: it can)
  const bool has_kernel =
      std::string(layer->name()) == "sim" || deviceReduceHasImage();
  if (!has_kernel) why = "this build has no GPU reduction kernel";
  if (why.empty()) {
    auto mem = layer->allocate(words_bytes_ + 2 * chunk_, ordinal);
    if (!mem.ok()) {
      why = mem.status().toString();
    } else {
      own_ = static_cast<char*>(*mem);
      base_[static_cast<size_t>(me)] = own_;
      device::noteUse();
    }
  }
  if (why.empty()) {
    // Zero the words, and find out whether the device runs stream memory operations: a write
    // and a wait on the copy stream, then an event after them.
    const engine::Deadline dl = engine::deadlineInMs(10000);
    Status st;
    for (int r = 0; r < c_.size && st.ok(); ++r) {
      st = layer->storeWord(words(me, r, false), 0, dl);
      if (st.ok()) st = layer->storeWord(words(me, r, true), 0, dl);
    }
    if (st.ok()) st = layer->writeWord(ordinal, device::kCopyStream, words(me, me, false), 0);
    if (st.ok()) st = layer->waitWord(ordinal, device::kCopyStream, words(me, me, false), 0);
    if (st.ok()) {
      auto ev = layer->record(ordinal);
      st = ev.ok() ? (*ev)->wait(dl) : ev.status();
    }
    if (st.ok()) st = prepareDeviceReduce(ordinal);  // loaded now, not at a first launch
    uint64_t offset = 0;
    Result<std::string> handle =
        st.ok() ? layer->exportIpc(own_, &offset) : Result<std::string>(st);
    if (!handle.ok()) {
      why = handle.status().toString();
    } else if (handle->size() > sizeof mine.handle) {
      why = "IPC handle too long";
    } else {
      std::memcpy(mine.handle, handle->data(), handle->size());
      mine.handle_len = static_cast<uint32_t>(handle->size());
      mine.offset = offset;
    }
  }
  mine.state.store(why.empty() ? kPublished : kUnusable, std::memory_order_release);

  // Every peer's allocation, then every peer's verdict. Ranks wait for each other here once;
  // a rank that never gets here (it called allreduce on host memory) times the setup out.
  auto waitFor = [&](int r, uint32_t at_least) -> uint32_t {
    ShmGroup::StreamInfo& info = g.streamInfo(r);
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      const uint32_t s = info.state.load(std::memory_order_acquire);
      if (s >= at_least) return s;
      if (Clock::now() >= op.deadline)
        throw CommError("mooncake pg: " + std::string(op.name) + " on rank " +
                            std::to_string(me) + ": rank " + std::to_string(r) +
                            " did not set up its stream-ordered buffers within the group "
                            "timeout: every rank must call allreduce on GPU memory (a group "
                            "that mixes host and GPU tensors needs MC_PG_STREAM_OPS=0)",
                        r, op.name);
      g.checkHealth(op);
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::milliseconds(1)) nap *= 2;
    }
  };
  bool all = why.empty();
  for (int r = 0; r < c_.size; ++r) {
    if (r == me) continue;
    // (kUsable: it published and has opened every buffer already.)
    const uint32_t s = waitFor(r, kPublished);
    if (s == kUnusable) all = false;
    if (s == kUnusable || !why.empty()) continue;
    ShmGroup::StreamInfo& info = g.streamInfo(r);
    auto base = layer->openIpc(std::string(info.handle, info.handle_len));
    if (!base.ok()) {
      why = "opening rank " + std::to_string(r) + "'s buffers: " + base.status().toString();
      all = false;
      continue;
    }
    opened_[static_cast<size_t>(r)] = *base;
    base_[static_cast<size_t>(r)] = static_cast<char*>(*base) + info.offset;
    if (!layer->canAccess(ordinal, base_[static_cast<size_t>(r)])) {
      why = "device " + std::to_string(ordinal) + " cannot reach rank " + std::to_string(r) +
            "'s GPU memory";
      all = false;
    }
  }
  // (A rank that published kUnusable at once is final already.)
  if (mine.state.load(std::memory_order_relaxed) == kPublished)
    mine.state.store(all && why.empty() ? kUsable : kUnusable, std::memory_order_release);
  for (int r = 0; r < c_.size; ++r)
    if (r != me && waitFor(r, kUsable) != kUsable) all = false;
  ordinal_ = ordinal;
  state_ = all && why.empty() ? kUsable : kUnusable;
  if (state_ != kUsable) {
    MC_LOG(WARN, PG) << "group " << c_.opts.group_name << " rank " << me
                     << ": stream-ordered allreduce off ("
                     << (why.empty() ? std::string("a peer could not set it up") : why)
                     << "): GPU allreduce is host-driven";
  }
  return state_ == kUsable;
}

std::shared_ptr<StreamOps::Ticket> StreamOps::allReduce(const void* in, void* out, size_t count,
                                                        DataType t, ReduceOp rop, int ordinal,
                                                        const void* stream) {
  const char* name = "allreduce";
  std::unique_lock<std::mutex> lk(mu_);
  if (c_.broken.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(c_.broken_mu);
    throw CommError("mooncake pg: " + std::string(name) + " on group " + c_.opts.group_name +
                        " that already failed: " + c_.broken_what,
                    c_.broken_rank, name);
  }
  OpSig sig;
  sig.kind = OpKind::kAllReduce;
  sig.dtype = static_cast<uint8_t>(static_cast<int>(t) + 1);
  sig.redop = static_cast<uint8_t>(static_cast<int>(rop) + 1);
  sig.count = count;
  OpCtx op{name, Clock::now() + c_.opts.timeout, seq_ + 1, c_.opts.timeout, sig};
  if (state_ < 0) {
    bool ok = false;
    try {
      ok = setUp(ordinal, op);
    } catch (const CommError& e) {
      state_ = kUnusable;
      lk.unlock();
      breakGroup(e);
      throw;
    }
    if (!ok) return nullptr;
  }
  if (state_ != kUsable) return nullptr;
  if (ordinal != ordinal_)
    throw UsageError("mooncake pg: allreduce on rank " + std::to_string(c_.rank) +
                         ": the tensor is on device " + std::to_string(ordinal) +
                         " but the group's stream-ordered buffers are on device " +
                         std::to_string(ordinal_) + " (one device per rank and group)",
                     -1, name);
  // The signature ring holds kStreamRing ops: wait while too many are unfinished.
  while (seq_ - finished_ >= kMaxInFlight && !failed_) {
    if (finished_cv_.wait_until(lk, op.deadline) == std::cv_status::timeout &&
        seq_ - finished_ >= kMaxInFlight)
      throw CommError("mooncake pg: allreduce on rank " + std::to_string(c_.rank) + ": " +
                          std::to_string(kMaxInFlight) +
                          " stream-ordered ops issued and none finished within the group "
                          "timeout",
                      -1, name);
  }
  if (failed_) {
    std::lock_guard<std::mutex> g(c_.broken_mu);
    throw CommError("mooncake pg: " + std::string(name) + " on group " + c_.opts.group_name +
                        " that already failed: " + c_.broken_what,
                    c_.broken_rank, name);
  }
  auto tk = std::make_shared<Ticket>();
  tk->seq = ++seq_;
  tk->op = op;
  tk->op.seq = tk->seq;
  publishSig(*tk);

  device::Device* layer = layerOrThrow(name);
  const int me = c_.rank;
  const size_t es = dtypeSize(t);
  const size_t bytes = count * es;
  auto check = [&](const Status& st, const char* what) {
    if (!st.ok()) {
      CommError e("mooncake pg: allreduce on rank " + std::to_string(me) + ": queueing " +
                      what + " on the stream failed: " + st.toString(),
                  -1, name);
      lk.unlock();
      fail(*tk, e);
      throw e;
    }
  };
  // Every peer's arrive word from this rank raised to the next epoch, then this rank's from
  // every peer awaited: the stream goes on once every rank's stream got here.
  auto exchange = [&]() {
    const uint32_t e = ++epoch_;
    for (int r = 0; r < c_.size; ++r)
      if (r != me) check(layer->writeWord(ordinal, stream, words(r, me, false), e), "a flag");
    for (int r = 0; r < c_.size; ++r)
      if (r != me) check(layer->waitWord(ordinal, stream, words(me, r, false), e), "a wait");
  };
  auto reduceInto = [&](void* dst, void* dst2, const std::vector<const void*>& from,
                        size_t elems) {
    bool queued = false;
    try {
      queued = deviceReduceAsync(dst, dst2, from.data(), c_.size, elems, t, rop, ordinal, name,
                                 stream);
    } catch (const CommError& err) {
      check(MC_STATUS(kInternal, err.what()), "the reduction");
    }
    if (!queued) check(MC_STATUS(kNotSupported, "no GPU form"), "the reduction");
  };
  // One shot (small ops): every rank reduces the whole step from every rank's buffer. Two
  // shots: each rank reduces its slice of the step into its output and back into its own
  // buffer, and after a second exchange copies the peers' reduced slices out of theirs.
  const bool two_shot = bytes > c_.params.stream_oneshot_bytes;
  std::vector<const void*> srcs(static_cast<size_t>(c_.size));
  for (size_t off = 0; off < bytes; off += chunk_) {
    const size_t n = std::min(chunk_, bytes - off);
    const uint64_t s = ++step_;
    char* o = static_cast<char*>(out) + off;
    check(layer->copyAsyncOn(buffer(me, s), static_cast<const char*>(in) + off, n, ordinal,
                             stream),
          "a copy");
    exchange();
    if (!two_shot) {
      for (int r = 0; r < c_.size; ++r) srcs[static_cast<size_t>(r)] = buffer(r, s);
      reduceInto(o, nullptr, srcs, n / es);
      continue;
    }
    const size_t elems = n / es;
    auto part = [&](int r) { return algo::partBegin(elems, c_.size, r, 1) * es; };
    for (int r = 0; r < c_.size; ++r) srcs[static_cast<size_t>(r)] = buffer(r, s) + part(me);
    if (part(me + 1) > part(me))
      reduceInto(o + part(me), buffer(me, s) + part(me), srcs, (part(me + 1) - part(me)) / es);
    exchange();
    for (int r = 0; r < c_.size; ++r)
      if (r != me && part(r + 1) > part(r))
        check(layer->copyAsyncOn(o + part(r), buffer(r, s) + part(r), part(r + 1) - part(r),
                                 ordinal, stream),
              "a copy");
  }
  // Peers' done words, and this rank's own (what orderAfter's streams wait on).
  for (int r = 0; r < c_.size; ++r)
    check(layer->writeWord(ordinal, stream, words(r, me, true), epoch_), "a flag");
  tk->last_epoch = epoch_;
  auto ev = layer->recordOn(ordinal, stream);
  if (!ev.ok()) check(ev.status(), "an event");
  tk->done = std::move(*ev);
  return tk;
}

void StreamOps::publishSig(const Ticket& t) {
  ShmGroup::StreamSig& s = c_.shm->streamSig(c_.rank, t.seq);
  uint64_t w[2];
  t.op.sig.pack(w);
  s.seq.store(0, std::memory_order_relaxed);
  s.w[0].store(w[0], std::memory_order_relaxed);
  s.w[1].store(w[1], std::memory_order_relaxed);
  s.seq.store(t.seq, std::memory_order_release);
}

void StreamOps::checkSigs(const Ticket& t, bool strict) const {
  for (int r = 0; r < c_.size; ++r) {
    if (r == c_.rank) continue;
    ShmGroup::StreamSig& s = c_.shm->streamSig(r, t.seq);
    const uint64_t seq = s.seq.load(std::memory_order_acquire);
    uint64_t w[2] = {s.w[0].load(std::memory_order_relaxed),
                     s.w[1].load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t again = s.seq.load(std::memory_order_relaxed);
    if (seq != t.seq || again != seq) {
      if (!strict) continue;
      // Its streams went out of step with this rank's: it issued another number of steps.
      throw CommError("mooncake pg: " + std::string(t.op.name) + " on rank " +
                          std::to_string(c_.rank) + " (group " + c_.opts.group_name +
                          "): rank " + std::to_string(r) + "'s stream-ordered op #" +
                          std::to_string(t.seq) + " is not there (it has op #" +
                          std::to_string(seq) +
                          "): the ranks' collectives went out of step earlier",
                      r, t.op.name);
    }
    const OpSig theirs = OpSig::unpack(w);
    if (theirs != t.op.sig)
      c_.health->mismatchBetween(t.op, t.seq, c_.rank, t.op.sig, r, theirs);
  }
}

void StreamOps::finish(Ticket& t) {
  try {
    const auto slice = std::chrono::microseconds(std::max<int64_t>(c_.params.wait.health_us, 100));
    for (;;) {
      Status st = t.done->wait(std::min(Clock::now() + slice, t.op.deadline));
      if (st.ok()) break;
      if (st.code() != Code::kTimeout)
        throw CommError("mooncake pg: " + std::string(t.op.name) + " on rank " +
                            std::to_string(c_.rank) + ": its GPU work failed: " + st.toString(),
                        -1, t.op.name);
      try {
        c_.shm->checkHealth(t.op);  // abort words, dead peers, the deadline
      } catch (const CommError&) {
        if (t.done->done()) break;  // a peer that wrote what this rank needed and exited
        checkSigs(t, false);        // a peer that aborted on mismatched calls: say which
        throw;
      }
    }
    checkSigs(t, true);
    // A peer that failed released its stream, whose later writes may have let this op
    // complete: its abort word was posted before that.
    c_.shm->checkAborts(t.op);
  } catch (const CommError& e) {
    fail(t, e);
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  finished_ = std::max(finished_, t.seq);
  finished_epoch_ = std::max(finished_epoch_, t.last_epoch);
  finished_cv_.notify_all();
}

void StreamOps::breakGroup(const CommError& e) {
  {
    std::lock_guard<std::mutex> g(c_.broken_mu);
    if (!c_.broken.load()) {
      c_.broken_what = e.what();
      c_.broken_rank = e.peerRank();
      c_.broken.store(true, std::memory_order_release);
    }
  }
  MC_LOG(WARN, PG) << e.what();
  c_.abortGroups(e.peerRank(), e.what());
}

void StreamOps::fail(const Ticket& t, const CommError& e) {
  // Peers first (their finish() fails on the abort word), then this rank's stream: released,
  // it may write peers' words with later epochs, which they must not take for success.
  breakGroup(e);
  uint32_t last = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    failed_ = true;
    last = epoch_;
    finished_ = std::max(finished_, t.seq);
    finished_cv_.notify_all();
  }
  auto layer = device::get();
  if (!layer.ok() || own_ == nullptr) return;
  const engine::Deadline dl = engine::deadlineInMs(5000);
  for (int r = 0; r < c_.size; ++r) {
    for (bool done : {false, true}) {
      if (r == c_.rank && !done) continue;
      Status st = (*layer)->storeWord(words(c_.rank, r, done), last + kRelease, dl);
      if (!st.ok()) {
        MC_LOG(WARN, PG) << "releasing the stream after a failed " << t.op.name << ": "
                         << st.toString();
      }
    }
  }
}

Status StreamOps::orderAfter(const Ticket& t, const void* stream) {
  auto layer = device::get();
  if (!layer.ok()) return layer.status();
  return (*layer)->waitWord(ordinal_, stream, words(c_.rank, c_.rank, true), t.last_epoch);
}

void StreamOps::drain() {
  uint32_t last = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != kUsable || failed_ || epoch_ == 0) return;
    last = epoch_;
  }
  auto layer = device::get();
  if (!layer.ok()) return;
  // Peers' streams may still read this rank's buffers for the last op: wait (up to 5 s, not
  // for dead peers) until each wrote its done word of it.
  static uint32_t* word = [] {
    auto l = device::get();
    auto w = l.ok() ? (*l)->allocHostWords(1) : Result<uint32_t*>(l.status());
    if (!w.ok()) return static_cast<uint32_t*>(nullptr);
    (void)(*l)->pinHost(*w, sizeof(uint32_t));  // (CUDA's are pinned already: refused)
    return *w;
  }();
  static std::mutex word_mu;
  if (word == nullptr) return;
  const auto until = Clock::now() + std::chrono::seconds(5);
  for (int r = 0; r < c_.size; ++r) {
    if (r == c_.rank) continue;
    for (;;) {
      uint32_t v = 0;
      {
        std::lock_guard<std::mutex> g(word_mu);
        if (!device::copy(word, words(c_.rank, r, true), sizeof v, engine::deadlineInMs(1000))
                 .ok())
          break;
        v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      }
      if (static_cast<int32_t>(v - last) >= 0) break;
      const engine::PeerId peer = c_.peers[static_cast<size_t>(r)];
      if (Clock::now() >= until || (peer != engine::kInvalidPeer &&
                                    !c_.engine->peerStatus(peer).ok())) {
        MC_LOG(WARN, PG) << "group " << c_.opts.group_name << ": rank " << r
                         << " did not finish its last stream-ordered op before this rank's "
                            "buffers are freed";
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

}  // namespace mooncake::pg
