#include "pg/stream_p2p.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "engine/log.h"
#include "pg/comm_impl.h"
#include "pg/shm_group.h"
#include "pg/stream_ops.h"

namespace mooncake::pg {

namespace device = engine::device;
using engine::Clock;

namespace {

constexpr size_t kWordStride = 128;  // per peer: posted at +0, freed at +64
constexpr uint32_t kRelease = uint32_t{1} << 30;  // past every chunk a stream may wait for

std::string who(const Communicator::Impl& c, const char* op) {
  return "mooncake pg: " + std::string(op) + " on rank " + std::to_string(c.rank) + " (group " +
         c.opts.group_name + ")";
}

// Naps between polls of a host wait: yields first, then sleeps up to 1 ms.
struct Nap {
  int spins = 0;
  std::chrono::microseconds nap{10};
  void operator()() {
    if (++spins < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::milliseconds(1)) nap *= 2;
  }
};

}  // namespace

struct StreamP2p::Lane {
  int peer = -1;
  bool send = false;
  std::mutex issue_mu;  // its issuers, one at a time: notes and queueing in message order
  std::mutex mu;        // below
  const void* stream = nullptr;
  uint64_t msgs = 0;    // issued
  uint64_t chunks = 0;  // queued
  bool dead = false;    // queueing failed part way: nothing more is queued
  std::deque<std::shared_ptr<Ticket>> pending;  // issued, waiting for the peer's area
  // Receiving: messages checked against their notes, all up to `checked` and some beyond.
  uint64_t checked = 0;
  std::set<uint64_t> checked_beyond;
};

StreamP2p::StreamP2p(Communicator::Impl& c)
    : c_(c),
      slot_bytes_(c.params.stream_p2p_slot_bytes),
      words_bytes_((static_cast<size_t>(c.size) * kWordStride + 4095) & ~size_t{4095}),
      peer_base_(static_cast<size_t>(c.size)),
      peer_slot_(static_cast<size_t>(c.size), 0),
      opened_(static_cast<size_t>(c.size), nullptr) {
  for (auto& b : peer_base_) b.store(nullptr, std::memory_order_relaxed);
  for (int i = 0; i < 2 * c.size; ++i) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->peer = i / 2;
    lanes_.back()->send = (i & 1) != 0;
  }
}

StreamP2p::~StreamP2p() {
  {
    std::lock_guard<std::mutex> g(pump_mu_);
    stop_ = true;
  }
  pump_cv_.notify_all();
  if (pumper_.joinable()) pumper_.join();
  const bool ran_out = drain();
  auto layer = device::get();
  if (!layer.ok()) return;
  // A stream still holding work is left as it is, with the memory it may touch (leaked): freed,
  // it would be reused, or run its copies on freed memory.
  if (!ran_out) return;
  for (auto& l : lanes_)
    if (l->stream != nullptr) (void)(*layer)->freeStream(ordinal_, l->stream);
  for (void* b : opened_)
    if (b != nullptr) (void)(*layer)->closeIpc(b);
  if (own_ != nullptr) (void)(*layer)->free(own_);
}

StreamP2p::Lane& StreamP2p::lane(int peer, bool send) {
  return *lanes_[static_cast<size_t>(peer) * 2 + (send ? 1 : 0)];
}

uint32_t* StreamP2p::word(char* base, int r, bool freed) const {
  return reinterpret_cast<uint32_t*>(base + static_cast<size_t>(r) * kWordStride +
                                     (freed ? 64 : 0));
}

char* StreamP2p::slot(char* base, size_t slot_bytes, int to, uint64_t chunk) const {
  return base + words_bytes_ + (static_cast<size_t>(to) * 2 + (chunk & 1u)) * slot_bytes;
}

bool StreamP2p::setUp(int ordinal, const char* op) {
  auto layer = device::get();
  ShmGroup::P2pInfo& mine = c_.shm->p2pInfo(c_.rank);
  std::string why;
  if (!layer.ok()) why = layer.status().toString();
  if (why.empty()) {
    auto mem = (*layer)->allocate(words_bytes_ + 2 * static_cast<size_t>(c_.size) * slot_bytes_,
                                  ordinal);
    if (mem.ok()) {
      own_ = static_cast<char*>(*mem);
      device::noteUse();
    } else {
      why = mem.status().toString();
    }
  }
  if (why.empty()) {
    std::vector<uint32_t*> words;
    for (int r = 0; r < c_.size; ++r) {
      words.push_back(word(own_, r, false));
      words.push_back(word(own_, r, true));
    }
    Status st = zeroAndProbeWords(**layer, ordinal, words);
    uint64_t offset = 0;
    Result<std::string> h = st.ok() ? (*layer)->exportIpc(own_, &offset) : Result<std::string>(st);
    if (!h.ok()) {
      why = h.status().toString();
    } else if (h->size() > sizeof mine.handle) {
      why = "IPC handle too long";
    } else {
      std::memcpy(mine.handle, h->data(), h->size());
      mine.handle_len = static_cast<uint32_t>(h->size());
      mine.offset = offset;
      mine.slot_bytes = slot_bytes_;
    }
  }
  ordinal_ = ordinal;
  state_ = why.empty() ? kPublished : kUnusable;
  mine.state.store(static_cast<uint32_t>(state_), std::memory_order_release);
  if (!why.empty()) {
    MC_LOG(WARN, PG) << who(c_, op) << ": stream-ordered send/recv off (" << why
                     << "): this rank's send/recv of GPU memory is host-driven, and its peers' "
                        "stream-ordered ones to it fail";
  }
  return state_ == kPublished;
}

bool StreamP2p::openPeer(int peer, const OpCtx* wait_for) {
  if (peer_base_[static_cast<size_t>(peer)].load(std::memory_order_acquire) != nullptr)
    return true;
  ShmGroup::P2pInfo& info = c_.shm->p2pInfo(peer);
  const char* op = wait_for != nullptr ? wait_for->name : "send/recv";
  for (Nap nap;; nap()) {
    const uint32_t s = info.state.load(std::memory_order_acquire);
    if (s == kPublished) break;
    if (s == kUnusable)
      throw CommError(who(c_, op) + ": rank " + std::to_string(peer) +
                          " could not set up stream-ordered send/recv (its log says why): "
                          "MC_PG_STREAM_OPS=0 on every rank runs them host-driven",
                      peer, op);
    if (wait_for == nullptr) return false;
    if (Clock::now() >= wait_for->deadline)
      throw CommError(who(c_, op) + ": rank " + std::to_string(peer) +
                          " made no stream-ordered send or recv within the group timeout (its "
                          "first one sets them up): a send or recv of GPU memory must be "
                          "matched by one of GPU memory",
                      peer, op);
    c_.shm->checkHealth(*wait_for);
  }
  auto layer = device::get();
  if (!layer.ok()) throw CommError(who(c_, op) + ": " + layer.status().toString(), -1, op);
  std::lock_guard<std::mutex> g(open_mu_);
  auto& base = peer_base_[static_cast<size_t>(peer)];
  if (base.load(std::memory_order_relaxed) != nullptr) return true;
  auto mapped = (*layer)->openIpc(std::string(info.handle, info.handle_len));
  if (!mapped.ok())
    throw CommError(who(c_, op) + ": opening rank " + std::to_string(peer) +
                        "'s send/recv buffers: " + mapped.status().toString(),
                    peer, op);
  char* at = static_cast<char*>(*mapped) + info.offset;
  if (!(*layer)->canAccess(ordinal_, at)) {
    (void)(*layer)->closeIpc(*mapped);
    throw CommError(who(c_, op) + ": device " + std::to_string(ordinal_) + " cannot reach rank " +
                        std::to_string(peer) + "'s GPU memory",
                    peer, op);
  }
  opened_[static_cast<size_t>(peer)] = *mapped;
  peer_slot_[static_cast<size_t>(peer)] = info.slot_bytes;
  base.store(at, std::memory_order_release);
  return true;
}

std::shared_ptr<StreamP2p::Ticket> StreamP2p::send(const void* buf, size_t bytes, int peer,
                                                   uint64_t tag, int ordinal,
                                                   const void* stream) {
  return issue(true, const_cast<void*>(buf), bytes, peer, tag, ordinal, stream);
}

std::shared_ptr<StreamP2p::Ticket> StreamP2p::recv(void* buf, size_t bytes, int peer,
                                                   uint64_t tag, int ordinal,
                                                   const void* stream) {
  return issue(false, buf, bytes, peer, tag, ordinal, stream);
}

std::shared_ptr<StreamP2p::Ticket> StreamP2p::issue(bool send, void* buf, size_t bytes, int peer,
                                                    uint64_t tag, int ordinal,
                                                    const void* stream) {
  const char* name = send ? "send" : "recv";
  if (c_.broken.load(std::memory_order_acquire) || failed_.load(std::memory_order_acquire))
    throw c_.alreadyFailed(name);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ < 0) setUp(ordinal, name);
    if (state_ != kPublished) return nullptr;
    if (ordinal != ordinal_)
      throw UsageError(who(c_, name) + ": the tensor is on device " + std::to_string(ordinal) +
                           " but the group's stream-ordered send/recv buffers are on device " +
                           std::to_string(ordinal_) + " (one device per rank and group)",
                       -1, name);
  }
  auto layer = device::get();
  if (!layer.ok()) throw CommError(who(c_, name) + ": " + layer.status().toString(), -1, name);
  Lane& l = lane(peer, send);
  std::lock_guard<std::mutex> ig(l.issue_mu);
  auto t = std::make_shared<Ticket>();
  t->peer = peer;
  t->send = send;
  t->msg = l.msgs + 1;
  t->bytes = bytes;
  t->tag = tag;
  t->buf = buf;
  t->op = OpCtx{name, Clock::now() + c_.opts.timeout, t->msg, c_.opts.timeout, OpSig{}};
  try {
    l.msgs = t->msg;
    issued_.fetch_add(1, std::memory_order_relaxed);
    auto ev = (*layer)->recordOn(ordinal, stream);
    if (!ev.ok())
      throw CommError(who(c_, name) + ": an event on the caller's stream: " +
                          ev.status().toString(),
                      -1, name);
    t->ready = std::move(*ev);
    std::unique_lock<std::mutex> lk(l.mu);
    if (l.stream == nullptr) {
      auto s = (*layer)->newStream(ordinal);
      if (!s.ok())
        throw CommError(who(c_, name) + ": a stream for it: " + s.status().toString(), -1, name);
      l.stream = *s;
    }
    l.pending.push_back(t);
    pump(l, lk, nullptr, nullptr);
    if (!l.pending.empty()) {
      lk.unlock();
      kick();
    }
  } catch (const CommError& e) {
    fail(*t, e);
    throw;
  } catch (const std::exception& e) {
    // (Numbered already: the group cannot go on in step with its peers.)
    CommError ce(who(c_, name) + ": " + e.what(), -1, name);
    fail(*t, ce);
    throw ce;
  }
  return t;
}

void StreamP2p::queue(Lane& l, Ticket& t) {
  auto layer = device::get();
  auto check = [&](const Status& st, const char* what) {
    if (st.ok()) return;
    l.dead = true;  // (some of its steps may be queued: the direction is out of step)
    throw CommError(who(c_, t.op.name) + ": queueing " + what + " on its stream failed: " +
                        st.toString(),
                    -1, t.op.name);
  };
  if (!layer.ok()) check(layer.status(), "anything");
  device::Device& d = **layer;
  const int me = c_.rank, p = t.peer;
  char* peer = peer_base_[static_cast<size_t>(p)].load(std::memory_order_acquire);
  const void* s = l.stream;
  t.touched = true;
  if (t.send) {
    // The note first: the receiver's recv cannot complete before it (a recv of 0 bytes waits
    // for it on the host).
    ShmGroup::P2pNote& n = c_.shm->p2pNote(me, p, t.msg);
    n.seq.store(0, std::memory_order_relaxed);
    n.bytes.store(t.bytes, std::memory_order_relaxed);
    n.tag.store(t.tag, std::memory_order_relaxed);
    n.seq.store(t.msg, std::memory_order_release);
  }
  check(d.waitEvent(ordinal_, s, *t.ready), "the wait for the caller's stream");
  t.ready.reset();  // (pooled events: give it back early)
  char* buf = static_cast<char*>(t.buf);
  if (t.send) {
    for (size_t off = 0; off < t.bytes; off += slot_bytes_) {
      const size_t len = std::min(slot_bytes_, t.bytes - off);
      const uint64_t c = ++l.chunks;
      if (c > 2)
        check(d.waitWord(ordinal_, s, word(own_, p, true), static_cast<uint32_t>(c - 2)), "a wait");
      check(d.copyAsyncOn(slot(own_, slot_bytes_, p, c), buf + off, len, ordinal_, s), "a copy");
      check(d.writeWord(ordinal_, s, word(peer, me, false), static_cast<uint32_t>(c)), "a flag");
    }
  } else {
    const size_t sb = peer_slot_[static_cast<size_t>(p)];
    for (size_t off = 0; off < t.bytes; off += sb) {
      const size_t len = std::min(sb, t.bytes - off);
      const uint64_t c = ++l.chunks;
      check(d.waitWord(ordinal_, s, word(own_, p, false), static_cast<uint32_t>(c)), "a wait");
      check(d.copyAsyncOn(buf + off, slot(peer, sb, me, c), len, ordinal_, s), "a copy");
      check(d.writeWord(ordinal_, s, word(peer, me, true), static_cast<uint32_t>(c)), "a flag");
    }
  }
  // Streams ordered after it while it was pending (orderAfter) wait on these.
  for (const device::Gate& g : t.gates) check(d.writeWord(ordinal_, s, g.word, g.value), "a gate");
  auto ev = d.recordOn(ordinal_, s);
  if (!ev.ok()) check(ev.status(), "an event");
  t.done = std::move(*ev);
  t.queued = true;
}

bool StreamP2p::noteFree(int peer, uint64_t msg, const OpCtx* wait_for) {
  if (msg <= ShmGroup::kP2pRing) return true;
  std::atomic<uint64_t>& checked = c_.shm->p2pChecked(peer, c_.rank);
  for (Nap nap;; nap()) {
    if (checked.load(std::memory_order_acquire) >= msg - ShmGroup::kP2pRing) return true;
    if (wait_for == nullptr) return false;
    if (Clock::now() >= wait_for->deadline)
      throw CommError(who(c_, wait_for->name) + ": rank " + std::to_string(peer) +
                          " received none of the " + std::to_string(ShmGroup::kP2pRing) +
                          " messages this rank sent it before message #" + std::to_string(msg) +
                          " within the group timeout",
                      peer, wait_for->name);
    c_.shm->checkHealth(*wait_for);
  }
}

void StreamP2p::pump(Lane& l, std::unique_lock<std::mutex>& lk, const Ticket* until,
                     const OpCtx* wait_for) {
  while (!l.pending.empty() && !(until != nullptr && until->queued)) {
    // (A failed group queues nothing more: ops left pending by a failed issue among them.)
    if (l.dead || c_.broken.load(std::memory_order_acquire)) {
      if (wait_for == nullptr) return;
      throw c_.alreadyFailed(wait_for->name);
    }
    Ticket& t = *l.pending.front();
    // A failure here fails the group, whichever thread queues (the ticket's finish() reports
    // it); l.mu released for fail().
    auto failWith = [&](const CommError& e) {
      lk.unlock();
      fail(t, e);
      lk.lock();
    };
    if (peer_base_[static_cast<size_t>(l.peer)].load(std::memory_order_acquire) == nullptr ||
        (t.send && !noteFree(l.peer, t.msg, nullptr))) {
      if (wait_for == nullptr) {
        // (Opens the peer's area if it is there now; only waiting releases l.mu.)
        bool open = false;
        try {
          open = openPeer(l.peer, nullptr);
        } catch (const CommError& e) {
          failWith(e);
          throw;
        }
        if (!open || (t.send && !noteFree(l.peer, t.msg, nullptr))) return;
        continue;
      }
      // Wait on the host (l.mu released: issuers of this direction may add to it meanwhile).
      const uint64_t msg = t.msg;
      const bool send = t.send;
      lk.unlock();
      openPeer(l.peer, wait_for);
      if (send) noteFree(l.peer, msg, wait_for);
      lk.lock();
      continue;  // (another thread may have queued it meanwhile)
    }
    const bool last = &t == until;
    try {
      queue(l, t);
    } catch (const CommError& e) {
      failWith(e);
      throw;
    } catch (const std::exception& e) {
      l.dead = true;
      CommError ce(who(c_, t.op.name) + ": queueing it: " + e.what(), -1, t.op.name);
      failWith(ce);
      throw ce;
    }
    l.pending.pop_front();
    if (last) return;
  }
}

void StreamP2p::checkNote(const Ticket& t, bool complete) {
  ShmGroup& g = *c_.shm;
  ShmGroup::P2pNote& n = g.p2pNote(t.peer, c_.rank, t.msg);
  for (Nap nap;; nap()) {
    const uint64_t seq = n.seq.load(std::memory_order_acquire);
    const uint64_t bytes = n.bytes.load(std::memory_order_relaxed);
    const uint64_t tag = n.tag.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seq == t.msg && n.seq.load(std::memory_order_relaxed) == seq) {
      if (bytes != t.bytes || tag != t.tag)
        throw CommError(who(c_, "recv") + ": message #" + std::to_string(t.msg) + " from rank " +
                            std::to_string(t.peer) + " is a send of " + std::to_string(bytes) +
                            " bytes with tag " + std::to_string(tag) + ", this recv takes " +
                            std::to_string(t.bytes) + " bytes with tag " + std::to_string(t.tag) +
                            " (stream-ordered send/recv between two ranks match in order, as "
                            "NCCL's: every recv must name the size and tag of its source's "
                            "next send)",
                        t.peer, "recv");
      if (!complete) return;
      Lane& l = lane(t.peer, false);
      std::lock_guard<std::mutex> lk(l.mu);  // (the count published only grows)
      l.checked_beyond.insert(t.msg);
      while (!l.checked_beyond.empty() && *l.checked_beyond.begin() == l.checked + 1) {
        ++l.checked;
        l.checked_beyond.erase(l.checked_beyond.begin());
      }
      g.p2pChecked(c_.rank, t.peer).store(l.checked, std::memory_order_release);
      return;
    }
    if (!complete) return;  // not noted yet: looked at again while the recv runs
    if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed(t.op.name);
    // Done without the note: a recv of 0 bytes, whose send was not issued yet.
    if (Clock::now() >= t.op.deadline)
      throw CommError(who(c_, "recv") + ": rank " + std::to_string(t.peer) +
                          " did not send message #" + std::to_string(t.msg) +
                          " within the group timeout",
                      t.peer, "recv");
    g.checkHealth(t.op);
  }
}

void StreamP2p::finish(Ticket& t) {
  Lane& l = lane(t.peer, t.send);
  try {
    if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed(t.op.name);
    {
      std::unique_lock<std::mutex> lk(l.mu);
      if (!t.queued) pump(l, lk, &t, &t.op);
    }
    const auto slice = std::chrono::microseconds(std::max<int64_t>(c_.params.wait.health_us, 100));
    for (;;) {
      Status st = t.done->wait(std::min(Clock::now() + slice, t.op.deadline));
      if (st.ok()) break;
      if (st.code() != Code::kTimeout)
        throw CommError(who(c_, t.op.name) + ": its GPU work failed: " + st.toString(), -1,
                        t.op.name);
      if (!t.send) checkNote(t, false);  // a send of another size: say so now
      try {
        c_.shm->checkHealth(t.op);
      } catch (const CommError&) {
        if (t.done->done()) break;  // a peer that wrote what this rank needed and exited
        throw;
      }
    }
    // This rank's failure (another op's, on another thread) released its streams, which may
    // have let this op complete on whatever the slots held: it failed too.
    if (c_.broken.load(std::memory_order_acquire)) throw c_.alreadyFailed(t.op.name);
    if (!t.send) checkNote(t, true);
    // A peer that failed released its streams, whose later writes may have let this op
    // complete: its abort word was posted before that.
    c_.shm->checkAborts(t.op);
  } catch (const CommError& e) {
    fail(t, e);
    closeTicket(t);
    throw;
  }
  closeTicket(t);
  // Later ops of its direction left pending: queued now if they can be (their own finish()
  // reports what keeps them).
  bool left = false;
  try {
    std::unique_lock<std::mutex> lk(l.mu);
    pump(l, lk, nullptr, nullptr);
    left = !l.pending.empty();
  } catch (const CommError&) {
  }
  if (left) kick();
}

void StreamP2p::kick() {
  {
    std::lock_guard<std::mutex> g(pump_mu_);
    if (stop_) return;
    kicked_ = true;
    if (!pumper_.joinable()) pumper_ = std::thread([this] { pumpLoop(); });
  }
  pump_cv_.notify_all();
}

void StreamP2p::pumpLoop() {
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    bool left = false;  // ops still pending
    if (!c_.broken.load(std::memory_order_acquire)) {
      for (auto& l : lanes_) {
        std::unique_lock<std::mutex> lk(l->mu);
        if (l->pending.empty()) continue;
        try {
          pump(*l, lk, nullptr, nullptr);
        } catch (const CommError&) {
          // (their finish() reports it)
        }
        left = left || !l->pending.empty();
      }
    }
    std::unique_lock<std::mutex> g(pump_mu_);
    if (stop_) return;
    if (!left) {
      pump_cv_.wait(g, [&] { return stop_ || kicked_; });
      kicked_ = false;
      nap = std::chrono::microseconds(20);
      continue;
    }
    kicked_ = false;
    pump_cv_.wait_for(g, nap, [&] { return stop_ || kicked_; });
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(1));
  }
}

void StreamP2p::closeTicket(Ticket& t) {
  std::vector<device::Gate> gates;
  bool reuse = false;
  {
    std::lock_guard<std::mutex> g(lane(t.peer, t.send).mu);
    t.finished = true;
    gates.swap(t.gates);
    // Its stream writes them after the op: their words go back to the pool only once that
    // ran (the op done) or when none of the op reached the stream. Else (a failed op whose
    // stream did not run out) they are opened and left out of the pool.
    reuse = !t.touched || (t.done && t.done->done());
  }
  // (Queued, its stream opened them after the op, with these values: storing them again
  // changes nothing. Never queued: a stream ordered after a failed op goes on.)
  for (const device::Gate& g : gates) {
    if (reuse) {
      device::openGate(g);
    } else {
      device::openGateForGood(g);
    }
  }
}

Status StreamP2p::orderAfter(Ticket& t, const void* stream) {
  auto layer = device::get();
  if (!layer.ok()) return layer.status();
  Lane& l = lane(t.peer, t.send);
  std::unique_lock<std::mutex> lk(l.mu);
  if (!t.queued) {
    if (t.finished) return MC_STATUS(kUnavailable, "the op failed before it was queued");
    auto g = device::acquireGate();
    if (!g.ok()) return g.status();
    Status st = (*layer)->waitWord(ordinal_, stream, g->word, g->value);
    if (!st.ok()) {
      device::openGate(*g);
      return st;
    }
    t.gates.push_back(*g);
    return Status::OK();
  }
  lk.unlock();
  return (*layer)->waitEvent(ordinal_, stream, *t.done);
}

void StreamP2p::fail(Ticket& t, const CommError& e) {
  c_.breakOn(e);
  failed_.store(true, std::memory_order_release);
  release();
  // Released, the stream runs the op's remaining steps (on whatever the slots hold): done
  // before the caller, told of the failure, frees the memory they write. A live peer's stream
  // may write a word with a lower count after the release: released again meanwhile.
  // (Partly queued, its queueing having failed: an event after what reached the stream.)
  engine::device::Event* done = nullptr;
  std::unique_ptr<engine::device::Event> partial;
  {
    Lane& l = lane(t.peer, t.send);
    std::lock_guard<std::mutex> g(l.mu);
    if (t.queued) {
      done = t.done.get();
    } else if (t.touched) {
      auto layer = device::get();
      if (layer.ok()) {
        auto ev = (*layer)->recordOn(ordinal_, l.stream);
        if (ev.ok()) partial = std::move(*ev);
      }
      done = partial.get();
    }
  }
  if (done == nullptr) return;
  const auto until = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    Status st = done->wait(std::min(Clock::now() + std::chrono::milliseconds(1), until));
    if (st.code() != Code::kTimeout) return;
    if (Clock::now() >= until) {
      MC_LOG(WARN, PG) << who(c_, t.op.name)
                       << ": its stream did not finish the failed op's steps within 5 s";
      return;
    }
    release();
  }
}

void StreamP2p::release() {
  auto layer = device::get();
  if (!layer.ok() || own_ == nullptr) return;
  uint64_t most = 0;
  for (auto& l : lanes_) {
    std::lock_guard<std::mutex> g(l->mu);
    most = std::max(most, l->chunks);
  }
  const uint32_t v = static_cast<uint32_t>(most) + kRelease;
  const engine::Deadline dl = engine::deadlineInMs(5000);
  for (int r = 0; r < c_.size; ++r) {
    if (r == c_.rank) continue;
    for (bool freed : {false, true}) {
      Status st = (*layer)->storeWord(word(own_, r, freed), v, dl);
      if (!st.ok()) {
        MC_LOG(WARN, PG) << "releasing send/recv streams: " << st.toString();
      }
    }
  }
}

bool StreamP2p::drain() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != kPublished) return true;
  }
  // Receivers may still copy what this rank staged for them out of its slots: wait (up to 5 s,
  // not for dead peers) until each took every chunk.
  const auto until = Clock::now() + std::chrono::seconds(5);
  if (!failed_.load(std::memory_order_acquire)) {
    for (int r = 0; r < c_.size; ++r) {
      if (r == c_.rank) continue;
      uint64_t sent = 0;
      {
        Lane& l = lane(r, true);
        std::lock_guard<std::mutex> g(l.mu);
        sent = l.chunks;
      }
      if (sent == 0) continue;
      for (;;) {
        uint32_t v = 0;
        if (!readDeviceWord(word(own_, r, true), &v)) break;
        if (static_cast<int32_t>(v - static_cast<uint32_t>(sent)) >= 0) break;
        const engine::PeerId peer = c_.peers[static_cast<size_t>(r)];
        if (Clock::now() >= until ||
            (peer != engine::kInvalidPeer && !c_.engine->peerStatus(peer).ok())) {
          MC_LOG(WARN, PG) << "group " << c_.opts.group_name << ": rank " << r
                           << " did not receive everything this rank sent it before its "
                              "send/recv buffers are freed";
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
  }
  // This rank's streams may still wait (recvs never matched): released (again while a live
  // peer's stream lowers a word), they run out.
  auto layer = device::get();
  if (!layer.ok()) return false;
  bool all = true;
  for (auto& l : lanes_) {
    if (l->stream == nullptr) continue;
    auto ev = (*layer)->recordOn(ordinal_, l->stream);
    if (!ev.ok()) {
      all = false;
      continue;
    }
    for (;;) {
      release();
      Status st = (*ev)->wait(std::min(Clock::now() + std::chrono::milliseconds(1),
                                       until + std::chrono::seconds(1)));
      if (st.code() != Code::kTimeout) break;
      if (Clock::now() >= until + std::chrono::seconds(1)) {
        MC_LOG(WARN, PG) << "group " << c_.opts.group_name
                         << ": a send/recv stream still holds work at the group's end; its "
                            "buffers are left allocated";
        all = false;
        break;
      }
    }
  }
  return all;
}

}  // namespace mooncake::pg
