#include "engine/inbox.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <thread>

#include "engine/futex.h"
#include "engine/log.h"
#include "engine/params.h"

namespace mooncake::engine {

namespace {

constexpr uint32_t kMagic = 0x4d43494f;  // "MCIO": layout 2 (service ring)
constexpr uint32_t kFragSlots = 64;

struct alignas(64) NotifyCell {
  std::atomic<uint64_t> seq;
  uint64_t src;
  uint64_t tag;
  uint32_t channel;
};

struct alignas(64) FragCell {
  std::atomic<uint64_t> seq;
  uint64_t src;
  uint64_t msg_id;
  uint32_t channel;
  uint32_t total;
  uint32_t offset;
  uint32_t len;
  char data[Inbox::kFragmentBytes];
};

// One bounded MPMC ring's control words (Vyukov) plus its futex.
struct alignas(64) RingCtl {
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint32_t> futex;
  std::atomic<uint32_t> waiters;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

}  // namespace

// Three rings: application notifications, service notifications (channel != 0) and message
// fragments. The service ring has no futex of its own: its producers wake the fragment
// ring's, because one thread (the engine's dispatcher) consumes both.
struct InboxLayout {
  uint32_t magic;
  uint32_t notify_slots;  // power of two; also the service ring's
  uint32_t frag_slots;
  uint32_t pad;
  RingCtl notify;
  RingCtl svc;
  RingCtl frag;
  // followed by NotifyCell[notify_slots], NotifyCell[notify_slots] (service), FragCell[...]
  NotifyCell* notifyCells() { return reinterpret_cast<NotifyCell*>(this + 1); }
  NotifyCell* svcCells() { return notifyCells() + notify_slots; }
  FragCell* fragCells() { return reinterpret_cast<FragCell*>(svcCells() + notify_slots); }
};

namespace {

size_t layoutBytes(uint32_t nslots) {
  return sizeof(InboxLayout) + 2 * sizeof(NotifyCell) * nslots + sizeof(FragCell) * kFragSlots;
}

// Reserves a cell in a Vyukov ring; returns the position or false when full.
template <typename Cell>
bool reserve(RingCtl& ctl, Cell* cells, uint32_t nslots, uint64_t* pos_out) {
  uint64_t pos = ctl.tail.load(std::memory_order_relaxed);
  for (;;) {
    Cell& c = cells[pos & (nslots - 1)];
    uint64_t seq = c.seq.load(std::memory_order_acquire);
    int64_t dif = static_cast<int64_t>(seq) - static_cast<int64_t>(pos);
    if (dif == 0) {
      if (ctl.tail.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        *pos_out = pos;
        return true;
      }
    } else if (dif < 0) {
      return false;
    } else {
      pos = ctl.tail.load(std::memory_order_relaxed);
    }
  }
}

template <typename Cell>
bool claim(RingCtl& ctl, Cell* cells, uint32_t nslots, uint64_t* pos_out) {
  uint64_t pos = ctl.head.load(std::memory_order_relaxed);
  for (;;) {
    Cell& c = cells[pos & (nslots - 1)];
    uint64_t seq = c.seq.load(std::memory_order_acquire);
    int64_t dif = static_cast<int64_t>(seq) - static_cast<int64_t>(pos + 1);
    if (dif == 0) {
      if (ctl.head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        *pos_out = pos;
        return true;
      }
    } else if (dif < 0) {
      return false;
    } else {
      pos = ctl.head.load(std::memory_order_relaxed);
    }
  }
}

void publish(RingCtl& ctl) {
  ctl.futex.fetch_add(1, std::memory_order_seq_cst);
  if (ctl.waiters.load(std::memory_order_seq_cst) > 0) futexWakeAll(&ctl.futex);
}

// Spin, then sleep on the ring's futex, until try_pop() succeeds or the deadline passes.
template <typename F>
bool waitOn(RingCtl& ctl, F try_pop, Deadline deadline, const std::atomic<bool>& closing,
            int64_t spin_us) {
  if (try_pop()) return true;
  const auto spin_until = Clock::now() + std::chrono::microseconds(spin_us);
  // Polite spinning: yield between polls so that, with more runnable threads than cores,
  // the thread we are waiting for gets the core (the producer may be on this very core).
  while (Clock::now() < spin_until) {
    if (try_pop()) return true;
    sched_yield();
  }
  for (;;) {
    ctl.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = ctl.futex.load(std::memory_order_seq_cst);
    if (try_pop()) {
      ctl.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return true;
    }
    auto now = Clock::now();
    if (now >= deadline || closing.load(std::memory_order_acquire)) {
      ctl.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return false;
    }
    // Sleep in bounded steps so a waiter re-checks its deadline and shutdown promptly.
    auto left = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100));
    futexWait(&ctl.futex, v, left);
    ctl.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (try_pop()) return true;
  }
}

// Producers back off when the ring is full (consumer slow) until the deadline.
bool backoff(Deadline deadline, int* round) {
  if (Clock::now() >= deadline) return false;
  if (++*round < 64) {
    sched_yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

// Message ids: one counter for the process, from a random start, so that no two messages of
// one sender engine share an id, whichever attachment pushed them (a peer opened again
// attaches anew) and even across a restart.
uint64_t nextMsgId() {
  static std::atomic<uint64_t> next{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32 | rd()) | 1;
  }()};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// The lock that orders this process's multi-fragment pushes into one inbox, shared by every
// Inbox object of the process for it (its attachments and, for tcp's pushes, its owner).
std::shared_ptr<std::timed_mutex> sendLockOf(const std::string& name) {
  static auto* mu = new std::mutex();
  static auto* locks = new std::map<std::string, std::weak_ptr<std::timed_mutex>>();
  std::lock_guard<std::mutex> g(*mu);
  for (auto it = locks->begin(); it != locks->end();)
    it = it->second.expired() ? locks->erase(it) : std::next(it);
  std::weak_ptr<std::timed_mutex>& w = (*locks)[name];
  std::shared_ptr<std::timed_mutex> lock = w.lock();
  if (!lock) {
    lock = std::make_shared<std::timed_mutex>();
    w = lock;
  }
  return lock;
}

std::atomic<uint64_t> g_reassembly_held{0};  // MessageReassembler::processHeldBytes()

std::string hexId(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

Result<std::unique_ptr<Inbox>> Inbox::create(const std::string& shm_name, uint32_t slots) {
  uint32_t n = 8;
  while (n < slots) n <<= 1;
  size_t bytes = layoutBytes(n);
  int fd = shm_open(shm_name.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0) return MC_STATUS(kIo, "inbox shm_open " << shm_name << ": " << strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(shm_name.c_str());
    return MC_STATUS(kResourceExhausted, "inbox ftruncate: " << strerror(errno));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(shm_name.c_str());
    return MC_STATUS(kResourceExhausted, "inbox mmap: " << strerror(errno));
  }
  auto* l = static_cast<InboxLayout*>(p);
  l->notify_slots = n;
  l->frag_slots = kFragSlots;
  for (RingCtl* r : {&l->notify, &l->svc, &l->frag}) {
    new (r) RingCtl();
    r->tail = r->head = 0;
    r->futex = 0;
    r->waiters = 0;
  }
  for (uint32_t i = 0; i < n; ++i) new (&l->notifyCells()[i].seq) std::atomic<uint64_t>(i);
  for (uint32_t i = 0; i < n; ++i) new (&l->svcCells()[i].seq) std::atomic<uint64_t>(i);
  for (uint32_t i = 0; i < kFragSlots; ++i) new (&l->fragCells()[i].seq) std::atomic<uint64_t>(i);
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint32_t>*>(&l->magic)->store(kMagic, std::memory_order_release);
  std::unique_ptr<Inbox> box(new Inbox());
  box->name_ = shm_name;
  box->owner_ = true;
  box->spin_us_ = params::getInt("MC_SPIN_US");
  box->send_lock_ = sendLockOf(shm_name);
  box->bytes_ = bytes;
  box->l_ = l;
  return box;
}

Result<std::unique_ptr<Inbox>> Inbox::attach(const std::string& shm_name) {
  int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) return MC_STATUS(kNotFound, "inbox " << shm_name << ": " << strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(InboxLayout)) {
    close(fd);
    return MC_STATUS(kProtocol, "inbox " << shm_name << " too small");
  }
  size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return MC_STATUS(kIo, "inbox mmap: " << strerror(errno));
  auto* l = static_cast<InboxLayout*>(p);
  uint32_t n = l->notify_slots;
  if (reinterpret_cast<std::atomic<uint32_t>*>(&l->magic)->load(std::memory_order_acquire) !=
          kMagic ||
      n == 0 || (n & (n - 1)) != 0 || l->frag_slots != kFragSlots || layoutBytes(n) > bytes) {
    munmap(p, bytes);
    return MC_STATUS(kProtocol, "inbox " << shm_name << " has a bad layout");
  }
  std::unique_ptr<Inbox> box(new Inbox());
  box->name_ = shm_name;
  box->bytes_ = bytes;
  box->l_ = l;
  box->spin_us_ = params::getInt("MC_SPIN_US");
  box->send_lock_ = sendLockOf(shm_name);
  return box;
}

Inbox::~Inbox() {
  if (l_ == nullptr) return;
  if (owner_) wakeAll();
  munmap(l_, bytes_);
  if (owner_) shm_unlink(name_.c_str());
}

void Inbox::wakeAll() {
  closing_.store(true, std::memory_order_release);
  l_->notify.futex.fetch_add(1);
  futexWakeAll(&l_->notify.futex);
  l_->frag.futex.fetch_add(1);
  futexWakeAll(&l_->frag.futex);
}

Status Inbox::pushNotify(uint64_t src_engine, uint32_t channel, uint64_t tag,
                         Deadline deadline) {
  RingCtl& ring = channel == 0 ? l_->notify : l_->svc;
  NotifyCell* cells = channel == 0 ? l_->notifyCells() : l_->svcCells();
  uint64_t pos;
  int round = 0;
  while (!reserve(ring, cells, l_->notify_slots, &pos)) {
    if (!backoff(deadline, &round))
      return MC_STATUS(kResourceExhausted, "inbox " << name_ << " full ("
                                                    << (channel == 0 ? "" : "service ")
                                                    << "notifications not consumed)");
  }
  NotifyCell& c = cells[pos & (l_->notify_slots - 1)];
  c.src = src_engine;
  c.tag = tag;
  c.channel = channel;
  c.seq.store(pos + 1, std::memory_order_release);
  publish(channel == 0 ? l_->notify : l_->frag);  // the dispatcher sleeps on frag's futex
  return Status::OK();
}

bool Inbox::popService(ServiceNotify* out) {
  uint64_t pos;
  if (!claim(l_->svc, l_->svcCells(), l_->notify_slots, &pos)) return false;
  NotifyCell& c = l_->svcCells()[pos & (l_->notify_slots - 1)];
  out->src_engine = c.src;
  out->channel = c.channel;
  out->tag = c.tag;
  c.seq.store(pos + l_->notify_slots, std::memory_order_release);
  return true;
}

int Inbox::waitDispatch(ServiceNotify* svc, Fragment* frag, Deadline deadline) {
  int got = 0;
  auto try_pop = [&] {
    if (popService(svc)) {
      got = 1;
    } else if (popFragment(frag)) {
      got = 2;
    }
    return got != 0;
  };
  return waitOn(l_->frag, try_pop, deadline, closing_, spin_us_) ? got : 0;
}

bool Inbox::popNotify(uint64_t* src_engine, uint64_t* tag) {
  uint64_t pos;
  if (!claim(l_->notify, l_->notifyCells(), l_->notify_slots, &pos)) return false;
  NotifyCell& c = l_->notifyCells()[pos & (l_->notify_slots - 1)];
  *src_engine = c.src;
  *tag = c.tag;
  c.seq.store(pos + l_->notify_slots, std::memory_order_release);
  return true;
}

bool Inbox::waitNotify(uint64_t* src_engine, uint64_t* tag, Deadline deadline) {
  return waitOn(l_->notify, [&] { return popNotify(src_engine, tag); }, deadline, closing_,
                spin_us_);
}

Status Inbox::pushMessage(uint64_t src_engine, uint32_t channel, std::string_view payload,
                          Deadline deadline) {
  if (payload.size() > kMaxMessageBytes)
    return MC_STATUS(kInvalidArgument, "message of " << payload.size() << " bytes exceeds "
                                                     << kMaxMessageBytes);
  uint32_t total = static_cast<uint32_t>(payload.size());
  // One multi-fragment message of this process at a time (see the header): the receiver takes
  // a sender's next first fragment as the end of any part it still holds of that sender.
  std::unique_lock<std::timed_mutex> one_at_a_time(*send_lock_, std::defer_lock);
  if (total > kFragmentBytes && !one_at_a_time.try_lock_until(deadline))
    return MC_STATUS(kResourceExhausted, "inbox " << name_ << " full (another message of this "
                                                  << "process to it still being pushed)");
  // Unique per process, whichever Inbox object pushes (src_engine names the process).
  uint64_t msg_id = nextMsgId();
  uint32_t off = 0;
  do {
    uint32_t len = std::min<uint32_t>(kFragmentBytes, total - off);
    uint64_t pos;
    int round = 0;
    while (!reserve(l_->frag, l_->fragCells(), l_->frag_slots, &pos)) {
      if (!backoff(deadline, &round))
        return MC_STATUS(kResourceExhausted, "inbox " << name_ << " full (messages not consumed)");
    }
    FragCell& c = l_->fragCells()[pos & (l_->frag_slots - 1)];
    c.src = src_engine;
    c.msg_id = msg_id;
    c.channel = channel;
    c.total = total;
    c.offset = off;
    c.len = len;
    std::memcpy(c.data, payload.data() + off, len);
    c.seq.store(pos + 1, std::memory_order_release);
    publish(l_->frag);
    off += len;
  } while (off < total);
  return Status::OK();
}

bool Inbox::popFragment(Fragment* out) {
  uint64_t pos;
  if (!claim(l_->frag, l_->fragCells(), l_->frag_slots, &pos)) return false;
  FragCell& c = l_->fragCells()[pos & (l_->frag_slots - 1)];
  out->src_engine = c.src;
  out->msg_id = c.msg_id;
  out->channel = c.channel;
  out->total = c.total;
  out->offset = c.offset;
  uint32_t len = std::min<uint32_t>(c.len, kFragmentBytes);
  out->data.assign(c.data, len);
  c.seq.store(pos + l_->frag_slots, std::memory_order_release);
  return true;
}

bool Inbox::waitFragment(Fragment* out, Deadline deadline) {
  return waitOn(l_->frag, [&] { return popFragment(out); }, deadline, closing_, spin_us_);
}

// ---------------------------------------------------------------- reassembly

MessageReassembler::~MessageReassembler() { held(-static_cast<int64_t>(held_.load())); }

uint64_t MessageReassembler::processHeldBytes() {
  return g_reassembly_held.load(std::memory_order_relaxed);
}

void MessageReassembler::held(int64_t delta) {
  held_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed);
  g_reassembly_held.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed);
}

void MessageReassembler::drop(Parts::iterator it) {
  held(-static_cast<int64_t>(it->second.buf.size()));
  parts_.erase(it);
}

void MessageReassembler::dropFragment(const Inbox::Fragment& f, const char* why) {
  dropped_.fetch_add(1, std::memory_order_relaxed);
  // Once per message: the rest of a dropped part follows it fragment by fragment.
  if (last_logged_ == std::make_pair(f.src_engine, f.msg_id)) return;
  last_logged_ = {f.src_engine, f.msg_id};
  MC_LOG(WARN, ENGINE) << "dropping message " << f.msg_id << " from engine " << hexId(f.src_engine)
                       << " at byte " << f.offset << " of " << f.total << ": " << why;
}

void MessageReassembler::discardSender(uint64_t src) {
  std::lock_guard<std::mutex> g(mu_);
  discards_.emplace_back(src, seq_seen_.load(std::memory_order_acquire));
  has_discards_.store(true, std::memory_order_release);
}

void MessageReassembler::sweep() {
  if (!has_discards_.load(std::memory_order_acquire)) return;
  std::vector<std::pair<uint64_t, uint64_t>> todo;
  {
    std::lock_guard<std::mutex> g(mu_);
    todo.swap(discards_);
    has_discards_.store(false, std::memory_order_relaxed);
  }
  for (const auto& [src, seq] : todo) {
    auto it = parts_.find(src);
    if (it == parts_.end() || it->second.first_seq > seq) continue;  // begun since: a new link
    MC_LOG(INFO, ENGINE) << "discarding " << it->second.buf.size() << " of " << it->second.total
                         << " bytes of message " << it->second.msg_id << " from engine "
                         << hexId(src) << ", which is gone";
    drop(it);
  }
}

bool MessageReassembler::add(Inbox::Fragment& f, std::string* body) {
  sweep();
  const uint64_t seq = ++seq_;
  const size_t len = f.data.size();
  bool complete = false;
  auto it = parts_.find(f.src_engine);
  if (f.offset == 0 && len == f.total) {  // a whole message (may come amid a part: not ordered)
    *body = std::move(f.data);
    complete = true;
  } else if (f.offset == 0) {  // the first of several: any part held of this sender is abandoned
    if (it != parts_.end()) {
      MC_LOG(INFO, ENGINE) << "discarding " << it->second.buf.size() << " of "
                           << it->second.total << " bytes of message " << it->second.msg_id
                           << " from engine " << hexId(f.src_engine)
                           << ", which its sender gave up on";
      drop(it);
    }
    if (len == 0 || len > f.total || f.total > Inbox::kMaxMessageBytes) {
      dropFragment(f, "bad size");
    } else {
      Part p{f.msg_id, f.channel, f.total, seq, std::string()};
      p.buf.reserve(f.total);
      p.buf.append(f.data);
      held(static_cast<int64_t>(len));
      parts_.emplace(f.src_engine, std::move(p));
    }
  } else if (it == parts_.end() || it->second.msg_id != f.msg_id) {
    dropFragment(f, "no part of it held (its sender gave up on it or left)");
  } else if (Part& p = it->second; f.offset != p.buf.size() || f.total != p.total ||
                                   f.channel != p.channel || len == 0 ||
                                   len > p.total - p.buf.size()) {
    dropFragment(f, "out of order");
    drop(it);
  } else {
    p.buf.append(f.data);
    held(static_cast<int64_t>(len));
    if (p.buf.size() == p.total) {
      held(-static_cast<int64_t>(p.total));
      *body = std::move(p.buf);
      parts_.erase(it);
      complete = true;
    }
  }
  seq_seen_.store(seq, std::memory_order_release);
  return complete;
}

}  // namespace mooncake::engine
