#include "ep/peer_writer.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_map>

#include "engine/futex.h"
#include "engine/log.h"
#include "ep/ll_proxy.h"
#include "ep/str.h"
#include "pg/copy.h"

namespace mooncake::ep {

static_assert(sizeof(std::pair<uint64_t, uint64_t>) == kMailboxEntryBytes,
              "a queued signal is written to the mailbox as it is");

namespace {

std::mutex g_mu;
std::unordered_map<uint32_t, EpBuffer*> g_targets;  // by the key's low 32 bits
std::set<uint64_t> g_installed;                     // engine ids carrying the handler

void onSignalNotify(const engine::Notification& n) {
  const uint32_t count = static_cast<uint32_t>(n.tag & 0x3fff);
  const int src = static_cast<int>((n.tag >> 14) & 0x3ff);
  const int kind = static_cast<int>((n.tag >> 24) & 1);
  const uint32_t round_bits = static_cast<uint32_t>((n.tag >> 25) & kRoundBitsMask);
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_targets.find(static_cast<uint32_t>(n.tag >> 32));
  if (it == g_targets.end()) return;  // the buffer is gone; the round is over for it
  if (!it->second->takeMailbox(static_cast<int>(round_bits & 1), kind, src, count, round_bits)) {
    MC_LOG(WARN, EP) << "EP signals from rank " << src << " with a bad entry (count " << count
                     << ")";
  }
}

void onMarkNotify(const engine::Notification& n) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_targets.find(static_cast<uint32_t>(n.tag >> 32));
  if (it == g_targets.end()) return;
  it->second->takeReadMark(static_cast<int>((n.tag >> 31) & 1),
                           static_cast<int>((n.tag >> 21) & 0x3ff),
                           static_cast<uint32_t>(n.tag & kMarkRoundMask));
}

}  // namespace

void ringDoorbell(char* base) {
  auto* bell = reinterpret_cast<std::atomic<uint32_t>*>(base);
  bell->fetch_add(1, std::memory_order_release);
  engine::futexWakeAll(bell);
}

bool registerSignalTarget(uint64_t key, EpBuffer* buf, engine::TransferEngine* engine) {
  bool install = false;
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_targets.emplace(static_cast<uint32_t>(key), buf).second) return false;
    install = g_installed.insert(engine->engineId()).second;
  }
  if (install) {
    engine->setNotifyHandler(kEpSignalChannel, onSignalNotify);
    engine->setNotifyHandler(kEpMarkChannel, onMarkNotify);
  }
  return true;
}

void unregisterSignalTarget(uint64_t key) {
  std::lock_guard<std::mutex> g(g_mu);
  g_targets.erase(static_cast<uint32_t>(key));
}

void EpBuffer::joinSignalTargets(const std::function<void()>& undo, const std::string& failed) {
  const int n = g_.size;
  // Nobody signals before every rank registered its handler target; every rank fails alike
  // when one could not (another buffer of its process has the key's low bits: 2^-32 odds) or
  // failed a step before (`failed`: why).
  int state = !failed.empty() ? -1 : registerSignalTarget(key_, this, g_.engine) ? 1 : 0;
  std::vector<int> all(n);
  g_.all_gather(&state, all.data(), sizeof(int));
  for (int r = 0; r < n; ++r) {
    if (all[r] == 1) continue;
    if (state == 1) unregisterSignalTarget(key_);
    const uint64_t key = key_;
    key_ = 0;
    undo();
    if (!failed.empty()) throw std::runtime_error(failed);
    if (all[r] < 0)
      throw std::runtime_error(str("ep.Buffer: rank ", r, " could not set up (its log says why)"));
    throw std::runtime_error(str("ep.Buffer: rank ", r, " already has a buffer with key ", std::hex,
                                 static_cast<uint32_t>(key), "; create the buffer again"));
  }
}

uint64_t EpBuffer::mailboxAddress(int r, int half, int kind) const {
  if (proxy_) return proxy_->remoteMailbox(r, half, kind);
  return remote_[r] + geo_.mailbox(half, kind, g_.rank);
}

bool EpBuffer::takeMailbox(int half, int kind, int src, uint32_t count, uint32_t round_bits) {
  // kAbandonSlotCount: the one entry in the mailbox's last slot (ep/peer_writer.h).
  const bool abandon = count == kAbandonSlotCount;
  if (src < 0 || src >= g_.size || (!abandon && count > geo_.mailboxCap() - 1)) return false;
  // A GPU buffer's (its group spans hosts): the proxy's host words stand for its mailboxes and
  // signal words (ep/ll_proxy.h), and no host thread sleeps on a doorbell.
  auto at = [&](size_t off) { return proxy_ ? proxy_->shadowAt(off) : base_ + off; };
  const size_t box = geo_.mailbox(half, kind, src) + (abandon ? geo_.abandonSlotOffset() : 0);
  if (abandon) count = 1;
  const auto* e = reinterpret_cast<const uint64_t*>(at(box));
  bool ok = true;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t off = e[2 * i], value = e[2 * i + 1];
    if (off % 8 != 0 || !geo_.isSignalRange(off, 8)) {
      ok = false;
      continue;
    }
    // An entry of a later round (this source's round of the same half went on while the
    // notification of this one waited) is left to that round's notification.
    if ((signalRound(value) & kRoundBitsMask) != round_bits) continue;
    reinterpret_cast<std::atomic<uint64_t>*>(at(off))->store(value, std::memory_order_release);
  }
  if (!proxy_) ringDoorbell(base_);
  return ok;
}

EpBuffer::Writer::Writer(EpBuffer& buf, engine::Deadline deadline, RoundKind kind,
                         uint32_t round)
    : buf_(buf),
      deadline_(deadline),
      kind_(kind),
      round_(round),
      reqs_(buf.size()),
      sigs_(buf.size()) {}

uint64_t EpBuffer::Writer::tag(uint32_t n) const {
  return (buf_.key_ << 32) | (static_cast<uint64_t>(round_ & kRoundBitsMask) << 25) |
         (static_cast<uint64_t>(kind_) << 24) | (static_cast<uint64_t>(buf_.g_.rank) << 14) | n;
}

void EpBuffer::Writer::copy(int r, size_t off, const void* src, size_t len) {
  if (len == 0) return;
  if (char* p = buf_.mapped_[r]) {
    // Streaming stores: the destination's lines were last read by the peer's core, and a
    // plain store would pull each back first (pg/copy.h has the measurements).
    pg::copyToSharedNoFence(p + off, src, len);
    return;
  }
  reqs_[r].push_back({engine::OpCode::kWrite, const_cast<void*>(src), len, buf_.g_.peers[r],
                      buf_.remote_[r] + off});
}

void EpBuffer::Writer::copyRows(int r, size_t off, size_t dst_stride, const char* src,
                                size_t row_bytes, const std::vector<int32_t>& idx) {
  if (char* p = buf_.mapped_[r]) {
    char* dst = p + off;
    if (dst_stride == row_bytes) {
      forEachRun(idx.data(), idx.size(), [&](size_t j, size_t c) {
        pg::copyToSharedNoFence(dst + j * row_bytes,
                                src + static_cast<size_t>(idx[j]) * row_bytes, c * row_bytes);
      });
    } else {
      for (size_t j = 0; j < idx.size(); ++j)
        pg::copyToSharedNoFence(dst + j * dst_stride,
                                src + static_cast<size_t>(idx[j]) * row_bytes, row_bytes);
    }
    return;
  }
  if (dst_stride == row_bytes) {
    forEachRun(idx.data(), idx.size(), [&](size_t j, size_t c) {
      copy(r, off + j * row_bytes, src + static_cast<size_t>(idx[j]) * row_bytes, c * row_bytes);
    });
    return;
  }
  for (size_t j = 0; j < idx.size(); ++j)
    copy(r, off + j * dst_stride, src + static_cast<size_t>(idx[j]) * row_bytes, row_bytes);
}

void EpBuffer::Writer::commit(int r) {
  char* p = buf_.mapped_[r];
  if (p == nullptr || sigs_[r].empty()) return;
  pg::streamFence();  // the streaming stores above are seen before the signal words
  for (const auto& s : sigs_[r])
    reinterpret_cast<std::atomic<uint64_t>*>(p + s.first)
        ->store(s.second, std::memory_order_release);
  sigs_[r].clear();
  ringDoorbell(p);
}

std::vector<int> EpBuffer::Writer::flush() {
  std::vector<int> failed;
  const int n = buf_.size();
  const int kind = static_cast<int>(kind_);
  std::vector<engine::BatchId> batch(n, 0);
  std::vector<bool> ok(n, true);
  engine::TransferEngine& eng = *buf_.g_.engine;
  for (int r = 0; r < n; ++r) {
    if (buf_.mapped_[r] != nullptr) continue;
    if (sigs_[r].size() > buf_.geo_.mailboxCap() - 1) {  // the layout's bound: a bug if hit
      MC_LOG(ERROR, EP) << "ep: " << sigs_[r].size() << " signals for rank " << r
                        << " exceed the mailbox (" << buf_.geo_.mailboxCap() << ")";
      ok[r] = false;
      continue;
    }
    // The queued (offset, value) pairs are the mailbox entries as they are laid out there; a
    // given-up round's entry alone goes to the last slot (above).
    const bool abandon_only =
        sigs_[r].size() == 1 &&
        sigs_[r][0].first == buf_.geo_.abandonSignal(static_cast<int>(round_ & 1), kind, buf_.g_.rank);
    const uint64_t box = buf_.mailboxAddress(r, static_cast<int>(round_ & 1), kind) +
                         (abandon_only ? buf_.geo_.abandonSlotOffset() : 0);
    if (!sigs_[r].empty())
      reqs_[r].push_back({engine::OpCode::kWrite, sigs_[r].data(),
                          sigs_[r].size() * kMailboxEntryBytes, buf_.g_.peers[r], box});
    if (reqs_[r].empty()) continue;
    auto id = eng.submit(reqs_[r]);
    Status st = id.status();
    if (id.ok()) {
      batch[r] = *id;
      // Ordered after the writes just posted: r stores the entries once they are all there.
      if (!sigs_[r].empty())
        st = eng.notify(buf_.g_.peers[r], kEpSignalChannel,
                        tag(abandon_only ? kAbandonSlotCount
                                         : static_cast<uint32_t>(sigs_[r].size())));
    }
    if (!st.ok()) {
      MC_LOG(WARN, EP) << "ep: writes to rank " << r << " failed: " << st.toString();
      ok[r] = false;
    }
  }
  for (int r = 0; r < n; ++r) commit(r);
  for (int r = 0; r < n; ++r) {
    if (buf_.mapped_[r] != nullptr) continue;
    bool timed_out = false;  // (its WRITEs still run: the entries must outlive the Writer)
    if (batch[r] != 0) {
      Status st = eng.wait(batch[r], deadline_);
      timed_out = st.code() == Code::kTimeout;
      if (!st.ok() && ok[r]) {
        // A peer that died once its notification was posted may have taken everything and
        // exited (the notification travels behind the WRITEs, not behind their completions).
        // Its fate is the receive side's business: a source that never signals is found dead
        // there (waitSources), as a destination it no longer needs anything from us.
        if (st.code() == Code::kPeerDead && !sigs_[r].empty()) {
          MC_LOG(INFO, EP) << "ep: rank " << r << " is gone after its signals were posted: "
                           << st.toString();
        } else {
          MC_LOG(WARN, EP) << "ep: writes to rank " << r << " failed: " << st.toString();
          ok[r] = false;
        }
      }
    }
    if (!ok[r]) failed.push_back(r);
    if (timed_out) {
      late_.push_back(batch[r]);
      eng.keepUntilDone(batch[r], std::make_shared<std::vector<std::pair<uint64_t, uint64_t>>>(
                                      std::move(sigs_[r])));
    }
    reqs_[r].clear();
    sigs_[r].clear();
  }
  return failed;
}

void EpBuffer::Writer::keepWhileLate(std::shared_ptr<void> owner) {
  if (owner == nullptr) return;
  for (engine::BatchId id : late_) buf_.g_.engine->keepUntilDone(id, owner);
}

}  // namespace mooncake::ep
