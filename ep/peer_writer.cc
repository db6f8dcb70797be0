#include "ep/peer_writer.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_map>

#include "engine/futex.h"
#include "engine/log.h"
#include "engine/wire.h"
#include "pg/copy.h"

namespace mooncake::ep {

namespace {

constexpr uint32_t kSignalMagic = 0x45505347u;  // "EPSG"

std::mutex g_mu;
std::unordered_map<uint64_t, EpBuffer*> g_targets;
std::set<uint64_t> g_installed;  // engine ids carrying the handler

void onSignalMessage(engine::Message&& m) {
  wire::Reader r(m.payload);
  uint32_t magic = r.u32();
  uint64_t key = r.u64();
  uint32_t n = r.u32();
  if (!r.ok() || magic != kSignalMagic || n > kMaxSignals + kMaxRanks) {
    MC_LOG(WARN, EP) << "dropping a malformed EP signal message";
    return;
  }
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_targets.find(key);
  if (it == g_targets.end()) return;  // the buffer is gone; the round is over for it
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t off = r.u64();
    uint64_t val = r.u64();
    if (!r.ok() || !it->second->storeSignal(off, val)) {
      MC_LOG(WARN, EP) << "EP signal message with a bad entry (offset " << off << ")";
      return;
    }
  }
}

}  // namespace

void ringDoorbell(char* base) {
  auto* bell = reinterpret_cast<std::atomic<uint32_t>*>(base);
  bell->fetch_add(1, std::memory_order_release);
  engine::futexWakeAll(bell);
}

void registerSignalTarget(uint64_t key, EpBuffer* buf, engine::TransferEngine* engine) {
  bool install = false;
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_targets[key] = buf;
    install = g_installed.insert(engine->engineId()).second;
  }
  if (install) engine->setMessageHandler(kEpSignalChannel, onSignalMessage);
}

void unregisterSignalTarget(uint64_t key) {
  std::lock_guard<std::mutex> g(g_mu);
  g_targets.erase(key);
}

EpBuffer::Writer::Writer(EpBuffer& buf, engine::Deadline deadline)
    : buf_(buf), deadline_(deadline), reqs_(buf.size()), sigs_(buf.size()) {}

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
  std::vector<engine::BatchId> batch(n, 0);
  std::vector<bool> ok(n, true);
  engine::TransferEngine& eng = *buf_.g_.engine;
  for (int r = 0; r < n; ++r) {
    if (buf_.mapped_[r] != nullptr || reqs_[r].empty()) continue;
    auto id = eng.submit(reqs_[r]);
    if (!id.ok()) {
      MC_LOG(WARN, EP) << "ep: writes to rank " << r << " failed: " << id.status().toString();
      ok[r] = false;
    } else {
      batch[r] = *id;
    }
  }
  for (int r = 0; r < n; ++r) commit(r);
  for (int r = 0; r < n; ++r) {
    if (buf_.mapped_[r] != nullptr) continue;
    if (ok[r] && batch[r] != 0) {
      Status st = eng.wait(batch[r], deadline_);
      if (!st.ok()) {
        MC_LOG(WARN, EP) << "ep: writes to rank " << r << " failed: " << st.toString();
        ok[r] = false;
      }
    }
    if (ok[r] && !sigs_[r].empty()) {
      wire::Writer w;
      w.u32(kSignalMagic);
      w.u64(buf_.key_);
      w.u32(static_cast<uint32_t>(sigs_[r].size()));
      for (const auto& s : sigs_[r]) {
        w.u64(s.first);
        w.u64(s.second);
      }
      Status st = eng.sendMessage(buf_.g_.peers[r], kEpSignalChannel, w.data());
      if (!st.ok()) {
        MC_LOG(WARN, EP) << "ep: signal to rank " << r << " failed: " << st.toString();
        ok[r] = false;
      }
    }
    if (!ok[r]) failed.push_back(r);
    reqs_[r].clear();
    sigs_[r].clear();
  }
  return failed;
}

}  // namespace mooncake::ep
