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

Status zeroAndProbeWords(device::Device& layer, int ordinal, const std::vector<uint32_t*>& words) {
  const engine::Deadline dl = engine::deadlineInMs(10000);
  Status st;
  for (size_t i = 0; i < words.size() && st.ok(); ++i) st = layer.storeWord(words[i], 0, dl);
  if (words.empty()) return st;
  if (st.ok()) st = layer.writeWord(ordinal, device::kCopyStream, words[0], 0);
  if (st.ok()) st = layer.waitWord(ordinal, device::kCopyStream, words[0], 0);
  if (st.ok()) {
    auto ev = layer.record(ordinal);
    st = ev.ok() ? (*ev)->wait(dl) : ev.status();
  }
  return st;
}

bool readDeviceWord(const uint32_t* w, uint32_t* out) {
  // One pinned host word for every reader (a group's end is no hot path), made once.
  static uint32_t* word = [] {
    auto l = device::get();
    auto h = l.ok() ? (*l)->allocHostWords(1) : Result<uint32_t*>(l.status());
    if (!h.ok()) return static_cast<uint32_t*>(nullptr);
    (void)(*l)->pinHost(*h, sizeof(uint32_t));  // (CUDA's are pinned already: refused)
    return *h;
  }();
  static std::mutex word_mu;
  if (word == nullptr) return false;
  std::lock_guard<std::mutex> g(word_mu);
  if (!device::copy(word, w, sizeof *out, engine::deadlineInMs(1000)).ok()) return false;
  *out = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  return true;
}

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

bool StreamOps::unusable() const {
  std::lock_guard<std::mutex> g(mu_);
  return state_ == kUnusable;
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
    std::vector<uint32_t*> all;
    for (int r = 0; r < c_.size; ++r) {
      all.push_back(words(me, r, false));
      all.push_back(words(me, r, true));
    }
    Status st = zeroAndProbeWords(*layer, ordinal, all);
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
                            "timeout: every rank must call the same collectives on GPU memory "
                            "(a group that mixes host and GPU tensors needs "
                            "MC_PG_STREAM_OPS=0)",
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
                     << ": stream-ordered collectives off ("
                     << (why.empty() ? std::string("a peer could not set it up") : why)
                     << "): GPU collectives are host-driven";
  }
  return state_ == kUsable;
}

// What an op's steps are queued with (StreamOps::issue; mu_ held).
struct StreamOps::Issue {
  StreamOps& so;
  device::Device* layer;
  int ordinal;
  const void* stream;
  std::unique_lock<std::mutex>& lk;
  Ticket& tk;
  std::vector<const void*> srcs;

  void check(const Status& st, const char* what) {
    if (st.ok()) return;
    CommError e("mooncake pg: " + std::string(tk.op.name) + " on rank " +
                    std::to_string(so.c_.rank) + ": queueing " + what +
                    " on the stream failed: " + st.toString(),
                -1, tk.op.name);
    lk.unlock();
    so.fail(tk, e);
    // Released, the stream runs the steps queued so far: done before the caller, told of the
    // failure, frees the memory they write.
    auto ev = layer->recordOn(ordinal, stream);
    if (ev.ok()) so.drainFailed(**ev, tk);
    throw e;
  }
  int me() const { return so.c_.rank; }
  int n() const { return so.c_.size; }
  uint64_t step() { return ++so.step_; }
  char* buf(int owner, uint64_t s) const { return so.buffer(owner, s); }
  void copy(void* dst, const void* src, size_t len) {
    if (len > 0 && dst != src)
      check(layer->copyAsyncOn(dst, src, len, ordinal, stream), "a copy");
  }
  // Every peer's arrive word from this rank raised to the next epoch, then this rank's from
  // every peer awaited: the stream goes on once every rank's stream got here.
  void exchange() {
    const uint32_t e = ++so.epoch_;
    for (int r = 0; r < n(); ++r)
      if (r != me()) check(layer->writeWord(ordinal, stream, so.words(r, me(), false), e), "a flag");
    for (int r = 0; r < n(); ++r)
      if (r != me()) check(layer->waitWord(ordinal, stream, so.words(me(), r, false), e), "a wait");
  }
  // dst (and dst2) = the reduction of srcs, `elems` elements.
  void reduce(void* dst, void* dst2, size_t elems, DataType t, ReduceOp rop) {
    if (elems == 0) return;
    bool queued = false;
    try {
      queued = deviceReduceAsync(dst, dst2, srcs.data(), n(), elems, t, rop, ordinal,
                                 tk.op.name, stream);
    } catch (const CommError& err) {
      check(MC_STATUS(kInternal, err.what()), "the reduction");
    }
    if (!queued) check(MC_STATUS(kNotSupported, "no GPU form"), "the reduction");
  }
};

std::shared_ptr<StreamOps::Ticket> StreamOps::issue(const char* name, const OpSig& sig,
                                                    int ordinal, const void* stream,
                                                    const std::function<void(Issue&)>& steps) {
  std::unique_lock<std::mutex> lk(mu_);
  if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed(name);
  OpCtx op{name, Clock::now() + c_.opts.timeout, seq_ + 1, c_.opts.timeout, sig};
  if (state_ < 0) {
    bool ok = false;
    try {
      ok = setUp(ordinal, op);
    } catch (const CommError& e) {
      state_ = kUnusable;
      lk.unlock();
      c_.breakOn(e);
      throw;
    }
    if (!ok) return nullptr;
  }
  if (state_ != kUsable) return nullptr;
  if (ordinal != ordinal_)
    throw UsageError("mooncake pg: " + std::string(name) + " on rank " +
                         std::to_string(c_.rank) + ": the tensor is on device " +
                         std::to_string(ordinal) +
                         " but the group's stream-ordered buffers are on device " +
                         std::to_string(ordinal_) + " (one device per rank and group)",
                     -1, name);
  // The signature ring holds kStreamRing ops: wait while too many are unfinished.
  while (seq_ - finished_ >= kMaxInFlight && !failed_) {
    if (finished_cv_.wait_until(lk, op.deadline) == std::cv_status::timeout &&
        seq_ - finished_ >= kMaxInFlight)
      throw CommError("mooncake pg: " + std::string(name) + " on rank " +
                          std::to_string(c_.rank) + ": " + std::to_string(kMaxInFlight) +
                          " stream-ordered ops issued and none finished within the group "
                          "timeout",
                      -1, name);
  }
  if (failed_) throw c_.alreadyFailed(name);
  auto tk = std::make_shared<Ticket>();
  tk->seq = ++seq_;
  tk->op = op;
  tk->op.seq = tk->seq;
  publishSig(*tk);
  Issue is{*this, layerOrThrow(name), ordinal, stream, lk, *tk,
           std::vector<const void*>(static_cast<size_t>(c_.size))};
  steps(is);
  // Peers' done words, and this rank's own (what orderAfter's streams wait on).
  for (int r = 0; r < c_.size; ++r)
    is.check(is.layer->writeWord(ordinal, stream, words(r, c_.rank, true), epoch_), "a flag");
  tk->last_epoch = epoch_;
  auto ev = is.layer->recordOn(ordinal, stream);
  if (!ev.ok()) is.check(ev.status(), "an event");
  tk->done = std::move(*ev);
  return tk;
}

std::shared_ptr<StreamOps::Ticket> StreamOps::allReduce(const void* in, void* out, size_t count,
                                                        DataType t, ReduceOp rop,
                                                        const OpSig& sig, int ordinal,
                                                        const void* stream) {
  const size_t es = dtypeSize(t), bytes = count * es;
  // One shot (small ops): every rank reduces the whole step from every rank's buffer. Two
  // shots: each rank reduces its slice of the step into its output and back into its own
  // buffer, and after a second exchange copies the peers' reduced slices out of theirs.
  const bool two_shot = bytes > c_.params.stream_oneshot_bytes;
  return issue("allreduce", sig, ordinal, stream, [&](Issue& is) {
    const int me = is.me(), n = is.n();
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const uint64_t s = is.step();
      char* o = static_cast<char*>(out) + off;
      is.copy(is.buf(me, s), static_cast<const char*>(in) + off, len);
      is.exchange();
      if (!two_shot) {
        for (int r = 0; r < n; ++r) is.srcs[static_cast<size_t>(r)] = is.buf(r, s);
        is.reduce(o, nullptr, len / es, t, rop);
        continue;
      }
      auto part = [&](int r) { return algo::partBegin(len / es, n, r, 1) * es; };
      for (int r = 0; r < n; ++r) is.srcs[static_cast<size_t>(r)] = is.buf(r, s) + part(me);
      is.reduce(o + part(me), is.buf(me, s) + part(me), (part(me + 1) - part(me)) / es, t, rop);
      is.exchange();
      for (int r = 0; r < n; ++r)
        if (r != me) is.copy(o + part(r), is.buf(r, s) + part(r), part(r + 1) - part(r));
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::allGather(const void* in,
                                                        const std::vector<void*>& outs,
                                                        size_t bytes, const OpSig& sig,
                                                        int ordinal, const void* stream) {
  // Each step: this rank's piece into its buffer; exchange; every rank's piece out of its
  // buffer (this rank's straight from the input).
  return issue("allgather", sig, ordinal, stream, [&](Issue& is) {
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const uint64_t s = is.step();
      is.copy(is.buf(is.me(), s), static_cast<const char*>(in) + off, len);
      is.exchange();
      for (int r = 0; r < is.n(); ++r) {
        char* to = static_cast<char*>(outs[static_cast<size_t>(r)]) + off;
        is.copy(to, r == is.me() ? static_cast<const char*>(in) + off : is.buf(r, s), len);
      }
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::gather(const void* in,
                                                     const std::vector<void*>& outs,
                                                     size_t bytes, int root, const OpSig& sig,
                                                     int ordinal, const void* stream) {
  // allGather's steps, where only the root copies out (and only the others copy in).
  return issue("gather", sig, ordinal, stream, [&](Issue& is) {
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const uint64_t s = is.step();
      const char* mine = static_cast<const char*>(in) + off;
      if (is.me() != root) is.copy(is.buf(is.me(), s), mine, len);
      is.exchange();
      if (is.me() != root) continue;
      for (int r = 0; r < is.n(); ++r)
        is.copy(static_cast<char*>(outs[static_cast<size_t>(r)]) + off,
                r == root ? mine : is.buf(r, s), len);
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::broadcast(void* data, size_t bytes, int root,
                                                        const OpSig& sig, int ordinal,
                                                        const void* stream) {
  // Each step: the root's piece into its buffer; exchange (every rank: buffer reuse needs the
  // receivers' streams to have copied the step before the root writes it again); the others
  // copy it out.
  return issue("broadcast", sig, ordinal, stream, [&](Issue& is) {
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const uint64_t s = is.step();
      char* at = static_cast<char*>(data) + off;
      if (is.me() == root) is.copy(is.buf(root, s), at, len);
      is.exchange();
      if (is.me() != root) is.copy(at, is.buf(root, s), len);
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::scatter(const std::vector<const void*>& ins,
                                                      void* out, size_t bytes, int root,
                                                      const OpSig& sig, int ordinal,
                                                      const void* stream) {
  // Each step: the root puts a piece of every other rank's block into its buffer (block j's
  // at j * piece); exchange; every other rank copies its piece out of the root's buffer.
  return issue("scatter", sig, ordinal, stream, [&](Issue& is) {
    const int me = is.me(), n = is.n();
    const size_t per = std::max<size_t>(chunk_ / static_cast<size_t>(n), 1);
    for (size_t off = 0; off < bytes; off += per) {
      const size_t len = std::min(per, bytes - off);
      const uint64_t s = is.step();
      if (me == root)
        for (int j = 0; j < n; ++j) {
          const char* from = static_cast<const char*>(ins[static_cast<size_t>(j)]) + off;
          if (j == root)
            is.copy(static_cast<char*>(out) + off, from, len);
          else
            is.copy(is.buf(root, s) + static_cast<size_t>(j) * per, from, len);
        }
      is.exchange();
      if (me != root)
        is.copy(static_cast<char*>(out) + off, is.buf(root, s) + static_cast<size_t>(me) * per,
                len);
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::reduce(const void* in, void* out, size_t count,
                                                     DataType t, ReduceOp rop, int root,
                                                     const OpSig& sig, int ordinal,
                                                     const void* stream) {
  // Each step: this rank's piece into its buffer; exchange; the root reduces every rank's
  // buffer into its output (the one-shot allreduce's steps, one rank reducing).
  const size_t es = dtypeSize(t), bytes = count * es;
  const size_t step_bytes = std::max<size_t>(chunk_ / es, 1) * es;
  return issue("reduce", sig, ordinal, stream, [&](Issue& is) {
    for (size_t off = 0; off < bytes; off += step_bytes) {
      const size_t len = std::min(step_bytes, bytes - off);
      const uint64_t s = is.step();
      is.copy(is.buf(is.me(), s), static_cast<const char*>(in) + off, len);
      is.exchange();
      if (is.me() != root) continue;
      for (int r = 0; r < is.n(); ++r) is.srcs[static_cast<size_t>(r)] = is.buf(r, s);
      is.reduce(static_cast<char*>(out) + off, nullptr, len / es, t, rop);
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::reduceScatter(const std::vector<const void*>& ins,
                                                            void* out, size_t count, DataType t,
                                                            ReduceOp rop, const OpSig& sig,
                                                            int ordinal, const void* stream) {
  // Each step: a piece of every block of the input into this rank's buffer (block j's at
  // j * piece); exchange; this rank's block reduced out of every rank's buffer.
  const size_t es = dtypeSize(t);
  return issue("reduce_scatter", sig, ordinal, stream, [&](Issue& is) {
    const int me = is.me(), n = is.n();
    const size_t per = std::max<size_t>(chunk_ / static_cast<size_t>(n) / es, 1);
    for (size_t e0 = 0; e0 < count; e0 += per) {
      const size_t k = std::min(per, count - e0);
      const uint64_t s = is.step();
      for (int j = 0; j < n; ++j)
        is.copy(is.buf(me, s) + static_cast<size_t>(j) * per * es,
                static_cast<const char*>(ins[static_cast<size_t>(j)]) + e0 * es, k * es);
      is.exchange();
      for (int r = 0; r < n; ++r)
        is.srcs[static_cast<size_t>(r)] = is.buf(r, s) + static_cast<size_t>(me) * per * es;
      is.reduce(static_cast<char*>(out) + e0 * es, nullptr, k, t, rop);
    }
  });
}

std::shared_ptr<StreamOps::Ticket> StreamOps::allToAll(const std::vector<const void*>& ins,
                                                       const std::vector<void*>& outs,
                                                       size_t block, const OpSig& sig,
                                                       int ordinal, const void* stream) {
  // Each step: a piece of every block of the input into this rank's buffer (block j's at
  // j * piece); exchange; from every rank's buffer the piece meant for this rank.
  return issue("alltoall", sig, ordinal, stream, [&](Issue& is) {
    const int me = is.me(), n = is.n();
    const size_t per = std::max<size_t>(chunk_ / static_cast<size_t>(n), 1);
    for (size_t off = 0; off < block; off += per) {
      const size_t len = std::min(per, block - off);
      const uint64_t s = is.step();
      auto from = [&](int j) { return static_cast<const char*>(ins[static_cast<size_t>(j)]) + off; };
      for (int j = 0; j < n; ++j)
        if (j != me) is.copy(is.buf(me, s) + static_cast<size_t>(j) * per, from(j), len);
      is.exchange();
      for (int r = 0; r < n; ++r) {
        char* to = static_cast<char*>(outs[static_cast<size_t>(r)]) + off;
        is.copy(to, r == me ? from(me) : is.buf(r, s) + static_cast<size_t>(me) * per, len);
      }
    }
  });
}

namespace {
uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// A block of `bytes` from rank `from` to rank `to`, as a term of the checksum: the sender adds
// it, the receiver subtracts it.
uint64_t pairTerm(int from, int to, size_t bytes) {
  return mix(mix((static_cast<uint64_t>(from) << 32) | static_cast<uint32_t>(to)) ^ bytes);
}
}  // namespace

size_t StreamOps::agreeSizes(const char* name, const std::vector<size_t>& send_bytes,
                             const std::vector<size_t>& recv_bytes) {
  ShmGroup& g = *c_.shm;
  const int me = c_.rank, n = c_.size;
  uint64_t v = 0, next_op = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    v = ++sizes_seq_;
    next_op = seq_ + 1;
  }
  size_t max_block = 0;
  uint64_t balance = 0;
  for (int j = 0; j < n; ++j) {
    max_block = std::max({max_block, send_bytes[static_cast<size_t>(j)],
                          recv_bytes[static_cast<size_t>(j)]});
    balance += pairTerm(me, j, send_bytes[static_cast<size_t>(j)]);
    balance -= pairTerm(j, me, recv_bytes[static_cast<size_t>(j)]);
  }
  ShmGroup::SizesNote& mine = g.sizesNote(me, v);
  mine.max_block.store(max_block, std::memory_order_relaxed);
  mine.balance.store(balance, std::memory_order_relaxed);
  mine.seq.store(v, std::memory_order_release);
  OpSig sig;
  sig.kind = OpKind::kAllToAll;
  OpCtx op{name, Clock::now() + c_.opts.timeout, next_op, c_.opts.timeout, sig};
  uint64_t total = balance;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    ShmGroup::SizesNote& note = g.sizesNote(r, v);
    int spins = 0;
    auto nap = std::chrono::microseconds(10);
    while (note.seq.load(std::memory_order_acquire) != v) {
      // A peer that issued its next stream-ordered op without this agreement called another
      // op (or an all-to-all without sizes) here.
      // (The peer notes this call before it issues it: a note that arrived meanwhile is read
      // again first, so that a peer that agreed and issued it in between is no mismatch.)
      ShmGroup::StreamSig& other = g.streamSig(r, next_op);
      if (other.seq.load(std::memory_order_acquire) == next_op &&
          note.seq.load(std::memory_order_acquire) != v) {
        uint64_t w[2] = {other.w[0].load(std::memory_order_relaxed),
                         other.w[1].load(std::memory_order_relaxed)};
        const OpSig theirs = OpSig::unpack(w);
        throw CommError("mooncake pg: " + std::string(name) + " on rank " + std::to_string(me) +
                            " (group " + c_.opts.group_name + "): rank " + std::to_string(r) +
                            " called " + theirs.describe() +
                            (theirs.kind == OpKind::kAllToAll ? " without split sizes" : "") +
                            " where this rank calls all_to_all with split sizes: every rank "
                            "must pass split sizes or none, and call the same collectives in "
                            "the same order",
                        r, name);
      }
      if (Clock::now() >= op.deadline)
        throw CommError("mooncake pg: " + std::string(name) + " on rank " + std::to_string(me) +
                            ": rank " + std::to_string(r) +
                            " did not call the all-to-all within the group timeout",
                        r, name);
      g.checkHealth(op);
      if (++spins < 64) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::milliseconds(1)) nap *= 2;
    }
    max_block = std::max<size_t>(max_block, note.max_block.load(std::memory_order_relaxed));
    total += note.balance.load(std::memory_order_relaxed);
  }
  if (total != 0)
    throw UsageError("mooncake pg: " + std::string(name) + " on rank " + std::to_string(me) +
                         " (group " + c_.opts.group_name +
                         "): the ranks' split sizes do not pair up (some rank sends a block of "
                         "another size than its receiver expects; MC_PG_STREAM_OPS=0 runs it "
                         "host-driven, which names the pair)",
                     -1, name);
  return max_block;
}

std::shared_ptr<StreamOps::Ticket> StreamOps::allToAllV(const std::vector<const void*>& ins,
                                                        const std::vector<size_t>& send_bytes,
                                                        const std::vector<void*>& outs,
                                                        const std::vector<size_t>& recv_bytes,
                                                        const OpSig& sig, int ordinal,
                                                        const void* stream) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_ == kUnusable) return nullptr;  // (every rank knows: none agrees)
  }
  if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed("alltoall");
  size_t max_block = 0;
  try {
    max_block = agreeSizes("alltoall", send_bytes, recv_bytes);
  } catch (const UsageError&) {
    throw;  // (every rank raises it: the group stays usable)
  } catch (const CommError& e) {
    c_.breakOn(e);  // peers may be waiting for this rank on their streams
    throw;
  }
  // Each step: a piece of every block into this rank's buffer (the block for rank j at
  // j * per); exchange; from every rank's buffer the piece meant for this rank.
  return issue("alltoall", sig, ordinal, stream, [&](Issue& is) {
    const int me = is.me(), n = is.n();
    const size_t per = std::max<size_t>(chunk_ / static_cast<size_t>(n), 1);
    auto piece = [&](size_t block, size_t off) { return off < block ? std::min(per, block - off) : 0; };
    const auto m = static_cast<size_t>(me);
    is.copy(outs[m], ins[m], send_bytes[m]);
    for (size_t off = 0; off < max_block; off += per) {
      const uint64_t s = is.step();
      for (int j = 0; j < n; ++j) {
        const auto k = static_cast<size_t>(j);
        const size_t len = piece(send_bytes[k], off);
        if (j != me && len > 0)
          is.copy(is.buf(me, s) + k * per, static_cast<const char*>(ins[k]) + off, len);
      }
      is.exchange();
      for (int r = 0; r < n; ++r) {
        const auto k = static_cast<size_t>(r);
        const size_t len = piece(recv_bytes[k], off);
        if (r != me && len > 0)
          is.copy(static_cast<char*>(outs[k]) + off, is.buf(r, s) + m * per, len);
      }
    }
  });
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
    if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed(t.op.name);
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
    // Released, the stream runs the op's remaining steps (on whatever the buffers hold: the
    // output is undefined): they must be done before the caller, told of the failure, frees
    // the memory they write.
    drainFailed(*t.done, t);
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  finished_ = std::max(finished_, t.seq);
  finished_cv_.notify_all();
}

void StreamOps::drainFailed(engine::device::Event& done, const Ticket& t) {
  // A live peer's stream may still write this rank's arrive words with its (lower) epochs
  // after the release, which would hold this stream again: released once more each slice.
  const auto until = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    Status st = done.wait(std::min(Clock::now() + std::chrono::milliseconds(1), until));
    if (st.code() != Code::kTimeout) return;  // done (or failed: nothing more runs)
    if (Clock::now() >= until) {
      MC_LOG(WARN, PG) << t.op.name << " #" << t.seq
                       << ": the stream did not finish the failed op's steps within 5 s";
      return;
    }
    release(t);
  }
}

void StreamOps::fail(const Ticket& t, const CommError& e) {
  // Peers first (their finish() fails on the abort word), then this rank's stream: released,
  // it may write peers' words with later epochs, which they must not take for success. Again
  // for every later op of a failed group: ops issued since need the release too.
  c_.breakOn(e);
  {
    std::lock_guard<std::mutex> g(mu_);
    failed_ = true;
    finished_ = std::max(finished_, t.seq);
    finished_cv_.notify_all();
  }
  release(t);
}

void StreamOps::release(const Ticket& t) {
  uint32_t last = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    last = epoch_;
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
  const auto until = Clock::now() + std::chrono::seconds(5);
  for (int r = 0; r < c_.size; ++r) {
    if (r == c_.rank) continue;
    for (;;) {
      uint32_t v = 0;
      if (!readDeviceWord(words(c_.rank, r, true), &v)) break;
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
