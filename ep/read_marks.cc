// Read marks: the buffer's halves guarded across ranks (host buffers). A round's rows and
// signal words live in half (round & 1) of each destination's buffer, and the local rule
// (claimHalf) keeps a rank from issuing round n+2 of a kind before its own round n's receive
// ran. A peer's round n+2 needs more: it must not reach this rank's half before this rank has
// read round n there. So a rank that is done with a half reports it (markRead) into every
// peer's header, and a sender waits for the reports of round n before its round n+2 writes
// anything (awaitRead). In a MoE layer's order the report is always there already.
#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>

#include "engine/log.h"
#include "ep/buffer.h"
#include "ep/peer_writer.h"
#include "ep/str.h"

namespace mooncake::ep {

namespace {
std::atomic<uint32_t>* markAt(char* base, size_t off) {
  return reinterpret_cast<std::atomic<uint32_t>*>(base + off);
}
// Raises *w to `round` unless it holds that round or a later one; false when it did.
bool raiseMark(std::atomic<uint32_t>* w, uint32_t round) {
  uint32_t cur = w->load(std::memory_order_relaxed);
  do {
    if (!roundAfter(round, cur)) return false;
  } while (!w->compare_exchange_weak(cur, round, std::memory_order_release,
                                     std::memory_order_relaxed));
  return true;
}
}  // namespace

void EpBuffer::markRead(RoundKind kind, uint32_t round) {
  if (device_ >= 0 || base_ == nullptr) return;
  const int k = static_cast<int>(kind), h = static_cast<int>(round & 1), me = g_.rank;
  // (Marked already: a receive, then its hook's release.)
  if (!raiseMark(markAt(base_, geo_.ownReadMark(k, h)), round)) return;
  for (int r = 0; r < g_.size; ++r) {
    if (r == me) continue;
    if (char* p = mapped_[r]) {
      (void)raiseMark(markAt(p, geo_.peerReadMark(k, h, me)), round);  // (threads may race)
      continue;
    }
    // A peer that cannot be told is dead or leaves; its sends do not matter any more.
    (void)g_.engine->notify(g_.peers[r], kEpMarkChannel, markTag(key_, k, me, round));
  }
}

uint32_t EpBuffer::readMark(RoundKind kind, uint32_t round) const {
  return markAt(base_, geo_.ownReadMark(static_cast<int>(kind), static_cast<int>(round & 1)))
      ->load(std::memory_order_acquire);
}

void EpBuffer::takeReadMark(int kind, int src, uint32_t round_bits) {
  if (src < 0 || src >= g_.size || kind < 0 || kind > 1 || base_ == nullptr || device_ >= 0)
    return;
  std::atomic<uint32_t>* w = markAt(base_, geo_.peerReadMark(kind, round_bits & 1, src));
  const uint32_t cur = w->load(std::memory_order_relaxed);
  // Low bits behind the mark's (a notification overtaken by a later one) are old news; a mark
  // moves up by far less than 2^20 rounds at a time.
  const uint32_t ahead = (round_bits - cur) & kMarkRoundMask;
  if (ahead == 0 || ahead > kMarkRoundMask / 2) return;
  w->store(cur + ahead, std::memory_order_release);  // (only this handler writes it)
  ringDoorbell(base_);                                // (a send may sleep on it: awaitRead)
}

std::vector<int> EpBuffer::awaitRead(const char* op, RoundKind kind, uint32_t round,
                                     int32_t* active, engine::Deadline deadline) {
  std::vector<int> late;
  if (device_ >= 0 || round <= 2) return late;
  const int k = static_cast<int>(kind), h = static_cast<int>(round & 1);
  const uint32_t want = round - 2;
  auto read = [&](int r) {
    return !roundAfter(want,
                       markAt(base_, geo_.peerReadMark(k, h, r))->load(std::memory_order_acquire));
  };
  std::vector<int> pending;  // (none in a MoE layer's order: no wait set up then)
  for (int r = 0; r < g_.size; ++r)
    if (r != g_.rank && (active == nullptr || active[r] != 0) && !read(r)) pending.push_back(r);
  if (pending.empty()) return late;
  waitSources(pending, deadline, read, [](int) {}, [&](int r) { late.push_back(r); });
  if (late.empty()) return late;
  if (active == nullptr) {  // normal mode: the round is given up, so that no peer waits for it
    const int r = late[0];
    const std::string why =
        peerDead(r) ? str(op, ": rank ", r, " is gone (the engine reported it)")
                    : str(op, ": rank ", r, " did not finish reading round ", want, " from rank ",
                          g_.rank, " within ", timeout_ms_,
                          " ms (MC_EP_TIMEOUT_MS), and this round's rows would overwrite it");
    abandon(kind, round);
    throw std::runtime_error(why);
  }
  for (int r : late) {
    MC_LOG(WARN, EP) << op << ": rank " << r << " did not finish reading round " << want
                     << " from rank " << g_.rank << " in time; marking it inactive";
    active[r] = 0;
  }
  return late;
}

EpBuffer::MarkOnExit::MarkOnExit(EpBuffer* b, RoundKind kind, uint32_t round, bool thrown)
    : b(b), kind(kind), round(round), exceptions(thrown ? std::uncaught_exceptions() : -1) {}

EpBuffer::MarkOnExit::~MarkOnExit() {
  if (exceptions >= 0 && std::uncaught_exceptions() <= exceptions) return;
  // A failed send whose hook holds the half: the hook may still read it; its release marks.
  if (exceptions >= 0 && b->hookHolds(kind, round)) return;
  try {
    b->markRead(kind, round);
  } catch (...) {  // (peers then wait for it until their deadline)
    MC_LOG(WARN, EP) << "ep: rank " << b->g_.rank << " could not mark round " << round << " read";
  }
}

}  // namespace mooncake::ep
