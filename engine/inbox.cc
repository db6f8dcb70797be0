#include "engine/inbox.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <thread>

#include "engine/futex.h"
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
  // Message ids are unique per producer process+inbox object; src_engine disambiguates.
  uint64_t msg_id = next_msg_id_.fetch_add(1);
  uint32_t total = static_cast<uint32_t>(payload.size());
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

}  // namespace mooncake::engine
