// EpBuffer's life: set-up over the group (ep/buffer.h, EpBuffer::create; Device mode's in
// ll_device.cc) and teardown.
#include <algorithm>
#include <random>
#include <stdexcept>

#include "engine/log.h"
#include "engine/params.h"
#include "ep/buffer.h"
#include "ep/ll_proxy.h"
#include "ep/peer_writer.h"
#include "ep/str.h"

namespace mooncake::ep {

namespace {

// Per-buffer identity shared by all ranks (rank 0's pick), names the buffer in messages.

struct RankInfo {
  uint64_t key;
  uint64_t base;
  uint64_t bytes;
  uint64_t min_size;  // EpGroup::min_size
  uint64_t late;      // EpBuffer::settleEarlierWrites
};

}  // namespace

// ---------------------------------------------------------------------------------------
// set-up

void refuseShrunk(const EpGroup& g, uint64_t wanted) {
  if (wanted > static_cast<uint64_t>(g.size))
    throw std::runtime_error(
        str("ep.Buffer: ranks ", g.size, "..", wanted - 1, " of the elastic group are inactive; "
            "call update_ep_member once every rank of the group is active (pg.recover_ranks)"));
}

void refuseVacant(const EpGroup& g, int r) {
  if (r != g.rank && r < static_cast<int>(g.vacant.size()) && g.vacant[r] != 0)
    throw std::runtime_error(
        str("ep.Buffer: rank ", r, " of the elastic group is inactive; set up EP buffers (or "
            "call update_ep_member) once every rank of the group is active (pg.recover_ranks)"));
}

void refuseLate(int r, uint64_t late, int64_t timeout_ms) {
  if (late == 0) return;
  throw std::runtime_error(
      str("ep.Buffer: rank ", r, "'s writes to rank ", late - 1, " (of an earlier EP buffer, "
          "whose calls gave up on them) were still running after ", timeout_ms,
          " ms (MC_EP_TIMEOUT_MS); they could land in the new buffer: retry once rank ",
          late - 1, " answers"));
}

uint64_t EpBuffer::settleEarlierWrites() const {
  const engine::Deadline deadline = engine::deadlineInMs(timeout_ms_);
  for (int r = 0; r < g_.size; ++r) {
    if (r == g_.rank || g_.peers[r] == engine::kInvalidPeer) continue;
    Status st = g_.engine->settle(g_.peers[r], deadline);
    if (!st.ok()) {
      MC_LOG(WARN, EP) << "ep buffer rank " << g_.rank << ": writes to rank " << r
                       << " still running: " << st.toString();
      return static_cast<uint64_t>(r) + 1;
    }
  }
  return 0;
}

uint64_t EpBuffer::randomKey() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v == 0 ? 1 : v;
}

std::unique_ptr<EpBuffer> EpBuffer::create(EpGroup group, size_t bytes, bool disable_p2p,
                                           int device) {
  if (group.engine == nullptr || !group.all_gather ||
      static_cast<int>(group.peers.size()) != group.size || group.rank < 0 ||
      group.rank >= group.size)
    invalid("ep.Buffer", "the group has no engine, no all_gather or a bad rank/size");
  std::unique_ptr<EpBuffer> b(new EpBuffer());
  b->g_ = std::move(group);
  b->disable_p2p_ = disable_p2p;
  b->geo_ = BufferGeometry(bytes, b->g_.size);
  b->spin_us_ = params::getInt("MC_EP_SPIN_US");
  b->timeout_ms_ = std::max<int64_t>(1, params::getInt("MC_EP_TIMEOUT_MS"));
  b->stream_out_bytes_ = std::max<int64_t>(0, params::getInt("MC_PG_STREAM_OUT_BYTES"));
  const std::string kernels = params::getString("MC_EP_KERNELS");
  if (kernels != "cpu" && kernels != "host" && kernels != "threads")
    invalid("ep.Buffer", str("MC_EP_KERNELS=", kernels, ": cpu, host or threads"));
  b->kernel_lanes_ = kernels == "host" ? 1 : kernels == "threads" ? kThreadLanes : 0;
  b->device_ = device;
  if (device >= 0)
    b->setUpDevice(bytes);
  else
    b->setUp(bytes);
  return b;
}

void EpBuffer::setUp(size_t bytes) {
  engine::TransferEngine& eng = *g_.engine;
  const int n = g_.size;
  // (A failure is published in the exchange below: every rank fails alike, none waits.)
  auto mem = eng.allocate(bytes);
  base_ = mem.ok() ? static_cast<char*>(*mem) : nullptr;

  // One exchange: key candidate, base address and size; then the segment descriptors (which
  // now list the buffer, so peers can map it or address it with WRITEs).
  RankInfo mine{randomKey(), reinterpret_cast<uint64_t>(base_), bytes,
                static_cast<uint64_t>(std::max(0, g_.min_size)), settleEarlierWrites()};
  std::vector<RankInfo> all(n);
  g_.all_gather(&mine, all.data(), sizeof(RankInfo));
  key_ = all[0].key;
  for (int r = 0; r < n; ++r) {
    if (all[r].late != 0) {
      if (base_ != nullptr) (void)eng.free(base_);
      base_ = nullptr;
      key_ = 0;
      refuseLate(r, all[r].late, timeout_ms_);
    }
    if (all[r].base == 0) {  // (its allocation failed)
      if (base_ != nullptr) (void)eng.free(base_);
      base_ = nullptr;
      key_ = 0;
      refuseVacant(g_, r);
      throw std::runtime_error(
          r == g_.rank ? str("ep.Buffer: allocating ", bytes, " bytes of registered memory failed: ",
                             mem.status().toString())
                       : str("ep.Buffer: rank ", r, " could not allocate its buffer of ", bytes,
                             " bytes"));
    }
    if (all[r].bytes != bytes) {
      (void)eng.free(base_);
      base_ = nullptr;
      key_ = 0;  // (not joined: nothing to leave)
      invalid("ep.Buffer", str("num_ep_buffer_bytes differs across ranks: rank ", g_.rank, " has ",
                               bytes, ", rank ", r, " has ", all[r].bytes));
    }
  }
  uint64_t wanted = 0;
  for (const RankInfo& ri : all) wanted = std::max(wanted, ri.min_size);
  if (wanted > static_cast<uint64_t>(n)) {
    (void)eng.free(base_);
    base_ = nullptr;
    key_ = 0;
    refuseShrunk(g_, wanted);
  }
  std::vector<char> others(n, 1);
  others[g_.rank] = 0;
  std::string seg_error;  // (reported by joinSignalTargets, a collective every rank reaches)
  try {
    engine_ids_ = exchangeSegments(others);
  } catch (const std::exception& e) {
    seg_error = e.what();
    engine_ids_.assign(n, 0);
  }
  mapped_.assign(n, nullptr);
  remote_.assign(n, 0);
  for (int r = 0; r < n; ++r) {
    remote_[r] = all[r].base;
    // disable_p2p: every peer through engine WRITEs, even where its buffer could be mapped.
    if (r == g_.rank)
      mapped_[r] = base_;
    else if (!disable_p2p_)
      mapped_[r] = static_cast<char*>(eng.mappedAddress(g_.peers[r], all[r].base, bytes));
  }
  joinSignalTargets(
      [&] {
        (void)eng.free(base_);
        base_ = nullptr;
      },
      seg_error);
  if (kernel_lanes_ > 0) watchPeers();
  int n_mapped = 0;
  for (auto* p : mapped_) n_mapped += p != nullptr;
  MC_LOG(INFO, EP) << "ep buffer rank " << g_.rank << "/" << n << ": " << bytes << " bytes, "
                   << n_mapped << " ranks mapped, " << (n - n_mapped) << " over the engine";
}

std::vector<uint64_t> EpBuffer::exchangeSegments(const std::vector<char>& update) {
  engine::TransferEngine& eng = *g_.engine;
  const int n = g_.size;
  std::string seg = eng.localSegment().serialize();
  uint64_t len = seg.size();
  std::vector<uint64_t> lens(n);
  g_.all_gather(&len, lens.data(), sizeof len);
  size_t seg_max = 0;
  for (uint64_t l : lens) seg_max = std::max<size_t>(seg_max, l);
  seg.resize(seg_max, '\0');
  std::string segs(seg_max * n, '\0');
  g_.all_gather(seg.data(), segs.data(), seg_max);
  std::vector<uint64_t> ids(n, 0);
  for (int r = 0; r < n; ++r) {
    auto desc = engine::SegmentDesc::parse(std::string_view(segs.data() + r * seg_max, lens[r]));
    if (!desc.ok())
      throw std::runtime_error(
          str("ep.Buffer: bad segment descriptor from rank ", r, ": ", desc.status().toString()));
    ids[r] = desc->engine_id;
    if (update[r] == 0) continue;
    Status st = eng.updatePeer(g_.peers[r], *desc);
    if (!st.ok())
      throw std::runtime_error(str("ep.Buffer: cannot update peer rank ", r, ": ", st.toString()));
  }
  return ids;
}

void EpBuffer::endProxy(bool drained) {
  if (!proxy_) return;
  proxy_->stop(drained);
  // No notification may store into the proxy's words once they go back to the pool.
  if (key_ != 0) unregisterSignalTarget(key_);
  key_ = 0;
  if (drained) {
    proxy_.reset();
    return;
  }
  MC_LOG(WARN, EP) << "ep buffer rank " << g_.rank << ": the host proxy's stages and host "
                   << "words stay allocated (kernels may still use them)";
  (void)proxy_.release();
}

EpBuffer::~EpBuffer() {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    q_stop_ = true;
  }
  q_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  // (A GPU buffer's kernels still queued end on the dead-rank flags the handler raises, so it
  // goes after them; kernels that did not run out keep a handler of their own, which holds
  // nothing of this object.)
  const bool drained = device_ < 0 || freeDevice();
  if (!drained) endProxy(false);  // (freeDevice ended it when drained)
  if (!drained && gone_handler_ != 0) {
    const std::vector<uint64_t> ids = engine_ids_;
    int32_t* gone = gone_ptr_;  // (host words: never freed)
    const int me = g_.rank;
    (void)g_.engine->addPeerGoneHandler(
        [ids, gone, me](uint64_t engine_id, const std::string&, const Status&) {
          for (size_t r = 0; r < ids.size(); ++r)
            if (static_cast<int>(r) != me && ids[r] == engine_id)
              __atomic_store_n(&gone[r], 1, __ATOMIC_RELEASE);
        });
  }
  if (gone_handler_ != 0) g_.engine->removePeerGoneHandler(gone_handler_);
  if (key_ != 0) unregisterSignalTarget(key_);
  // Peers' buffers mapped here: unmapped now, so that a peer that frees its buffer (its own
  // update_ep_member, or its end) gets the memory back while this process lives on.
  if (device_ < 0)
    for (int r = 0; r < static_cast<int>(mapped_.size()); ++r)
      if (r != g_.rank && mapped_[r] != nullptr) g_.engine->releaseMapped(g_.peers[r], mapped_[r]);
  if (device_ < 0 && base_ != nullptr) (void)g_.engine->free(base_);
}

}  // namespace mooncake::ep
