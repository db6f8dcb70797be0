// An EP buffer in GPU memory (ep/buffer.h, "Device mode"): set-up through the engine's device
// layer (allocation, IPC handles of every rank's buffer), and the low-latency calls as the
// kernels' entry point (ep/kernels/ll_entry.h) queued on the buffer's stream: its CUDA
// form from the fatbin built out of ep/kernels/ll_entry.cu, its simulation form below (the same
// bodies on the simulated stream's thread, every address through the layer's host view), so
// that everything but the CUDA executor itself is tested on a machine without a GPU.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "engine/log.h"
#include "ep/buffer.h"
#include "ep/device_scratch.h"
#include "ep/kernels/host_lanes.h"
#include "ep/kernels/ll_entry.h"
#include "ep/ll_proxy.h"
#include "ep/str.h"

#if MC_EP_HAVE_LL_IMAGE
// The fatbin of ep/kernels/ll_entry.cu (ep/ll_entry_image.c).
extern "C" const unsigned char mc_ep_ll_fatbin[];
extern "C" const size_t mc_ep_ll_fatbin_len;
#endif

namespace mooncake::ep {

namespace dev = engine::device;

namespace {

// [p, p+len) as the simulated kernel reaches it (null and empty ranges stay as they are).
template <class T>
Status mapInto(const dev::HostView& view, T*& p, uint64_t len) {
  if (p == nullptr || len == 0) return Status::OK();
  MC_ASSIGN_OR_RETURN(void* h, view.at(p, len));
  p = static_cast<T*>(h);
  return Status::OK();
}

// The peers' buffers as the simulated kernel reaches them: the table itself, then each entry
// (held in *keep, which p then points into).
Status mapPeers(const dev::HostView& view, char* const*& peers, int R, uint64_t bytes,
                std::vector<char*>* keep) {
  MC_RETURN_IF_ERROR(mapInto(view, peers, R * 8u));
  keep->assign(peers, peers + R);
  for (char*& b : *keep) MC_RETURN_IF_ERROR(mapInto(view, b, bytes));
  peers = keep->data();
  return Status::OK();
}

// A GPU buffer has no host waiters to wake: its lanes ring no doorbell (nor do the CUDA ones,
// ll_entry.cu), which spares a futex wake (here) or a system-scope atomic on a peer GPU's
// memory (there) per signal.
struct SimLanes : kern::HostLanes {
  void ringDoorbell(uint32_t*) {}
};

// The simulation's form of mc_ep_ll: the blocks one after another on this thread, in the order
// ep/ll_host.cc runs them (a call's sends to other ranks first).
// The rounds' words as the simulated kernel reaches them (the proxy's are host memory). A
// send's last block posts its args to the ring as mapped here: the proxy takes the only
// addresses it uses, the stage's and the words', from its own numbers (ll_proxy.h, fill).
Status mapRounds(const dev::HostView& view, kern::DeviceRounds& d) {
  MC_RETURN_IF_ERROR(mapInto(view, d.words, kern::kDeviceRoundWords * 4));
  MC_RETURN_IF_ERROR(mapInto(view, d.ctl, kern::kCtlWords * 4));
  return mapInto(view, d.ring, kern::kProxyRingSlots * sizeof(kern::ProxyJob));
}

Status simEntry(const void* params, const dev::HostView& view) {
  kern::LlLaunch l;
  std::memcpy(&l, params, sizeof l);
  kern::LlArgs& p = l.p;
  const int R = p.world, L = p.local_experts, me = p.me;
  const uint64_t RM = static_cast<uint64_t>(R) * p.max_tokens, T = p.tokens, K = p.topk;
  const uint64_t in_row = kern::inputRowBytes(p);
  const uint64_t recv_row = p.dtype == kern::kDtypeFp8 ? p.hidden : in_row;
  MC_RETURN_IF_ERROR(mapInto(view, p.x, T * in_row));
  MC_RETURN_IF_ERROR(mapInto(view, p.topk_idx, T * K * 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.topk_weights, T * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.active, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.gone, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_x, L * RM * recv_row));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_scales, L * RM * (p.hidden / num::kFp8Group) * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_count, L * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.src_info, L * RM * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.layout_range, static_cast<uint64_t>(L) * R * 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.y, L * RM * in_row));
  MC_RETURN_IF_ERROR(mapInto(view, p.out, T * in_row));
  MC_RETURN_IF_ERROR(mapInto(view, p.decision, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.self_count, L * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.error, 8));
  MC_RETURN_IF_ERROR(mapInto(view, l.toks, static_cast<uint64_t>(l.experts) * p.max_tokens * 4));
  // Proxied ranks' stage (a dispatch region's layout: rows, then token ids), words and ctrl.
  MC_RETURN_IF_ERROR(mapInto(view, p.stage, p.src_base + RM * L * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.proxy_words, static_cast<uint64_t>(R) * L * 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.ctrl, kSignalBytes));
  MC_RETURN_IF_ERROR(mapRounds(view, l.rounds));
  std::vector<char*> peers;
  MC_RETURN_IF_ERROR(mapPeers(view, p.peers, R, l.peer_bytes, &peers));
  // A stage that takes its round counts its blocks (kern::endSend): as many as run here.
  const int64_t runs = l.stage == kern::kDispatchSend ? static_cast<int64_t>(R) * L
                       : l.stage == kern::kCombineSend ? R
                       : l.stage == kern::kAbandonRound ? 1
                                                        : -1;
  if (l.rounds.blocks > 0 && l.rounds.blocks != runs)
    return MC_STATUS(kInvalidArgument, "mc_ep_ll: stage " << l.stage << " takes its round after "
                                       << l.rounds.blocks << " blocks but runs " << runs);
  SimLanes ln;
  const int64_t start = ln.nowUs();
  switch (l.stage) {
    case kern::kDispatchSend:
      for (int i = 0; i < R * L; ++i)
        kern::llBlock(l, ((me + 1 + i / L) % R) * L + i % L, ln, start);
      break;
    case kern::kDispatchRecv:
      for (int b = 0; b < L; ++b) kern::llBlock(l, b, ln, start);
      break;
    case kern::kCombineSend:
      for (int i = 0; i < R; ++i) kern::llBlock(l, (me + 1 + i) % R, ln, start);
      break;
    case kern::kCombineWait:
      for (int o = 0; o < R; ++o) kern::llBlock(l, o, ln, start);
      break;
    case kern::kCombineToken:
      for (uint64_t t = 0; t < T; ++t) kern::llBlock(l, static_cast<int>(t), ln, start);
      break;
    case kern::kAbandonRound:
    case kern::kStageWait:
      kern::llBlock(l, 0, ln, start);
      break;
    default:
      return MC_STATUS(kInvalidArgument, "mc_ep_ll: stage " << l.stage);
  }
  return Status::OK();
}

// The simulation's form of mc_ep_normal, in ep/ll_host.cc's order.
Status simNormal(const void* params, const dev::HostView& view) {
  kern::NormalLaunch l;
  std::memcpy(&l, params, sizeof l);
  kern::NormalArgs& p = l.p;
  const int R = p.world, me = p.me;
  const uint64_t T = p.tokens, K = p.topk, N = l.rows, row = kern::rowBytes(p);
  MC_RETURN_IF_ERROR(mapInto(view, p.x, T * row));
  MC_RETURN_IF_ERROR(mapInto(view, p.in_rank, T * R));
  MC_RETURN_IF_ERROR(mapInto(view, p.topk_idx, T * K * 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.topk_weights, T * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.counts, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_x, N * row));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_src_idx, N * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_topk_idx, N * K * 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_topk_weights, N * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.num_recv_per_expert, p.local_experts * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.y, N * row));
  MC_RETURN_IF_ERROR(mapInto(view, p.recv_counts, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.weights, N * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.out, T * row));
  MC_RETURN_IF_ERROR(mapInto(view, p.out_weights, T * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.active, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.decision, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, p.error, 8));
  MC_RETURN_IF_ERROR(mapInto(view, p.gone, R * 4u));
  MC_RETURN_IF_ERROR(mapInto(view, l.toks, static_cast<uint64_t>(R) * std::max<uint64_t>(T, 1) * 4));
  // Proxied ranks' stage (a region's layout, R blocks of every field), words and ctrl.
  const uint64_t RC = static_cast<uint64_t>(R) * p.capacity;
  MC_RETURN_IF_ERROR(mapInto(view, p.stage, std::max(p.weight_base, p.cweight_base) + RC * K * 4));
  MC_RETURN_IF_ERROR(mapInto(view, p.proxy_words, R * 8u));
  MC_RETURN_IF_ERROR(mapInto(view, p.ctrl, kSignalBytes));
  MC_RETURN_IF_ERROR(mapRounds(view, l.rounds));
  std::vector<char*> peers;
  MC_RETURN_IF_ERROR(mapPeers(view, p.peers, R, l.peer_bytes, &peers));
  SimLanes ln;
  const int64_t start = ln.nowUs();
  // Sends to other ranks first (ll_host.cc's order); the rest block by block.
  const bool sends = l.stage == kern::kNormalDispatchSend || l.stage == kern::kNormalCombineSend;
  int64_t blocks = 0;
  switch (l.stage) {
    case kern::kNormalDispatchSend:
    case kern::kNormalDispatchWait:
    case kern::kNormalDispatchRecv:
    case kern::kNormalCombineSend:
    case kern::kNormalCombineWait:
      blocks = R;
      break;
    case kern::kNormalAlign:
      blocks = 1;
      break;
    case kern::kNormalCombineToken:
      blocks = static_cast<int64_t>(T);
      break;
    default:
      return MC_STATUS(kInvalidArgument, "mc_ep_normal: stage " << l.stage);
  }
  if (l.rounds.blocks > 0 && (!sends || l.rounds.blocks != blocks))  // (kern::endSend)
    return MC_STATUS(kInvalidArgument, "mc_ep_normal: stage " << l.stage << " takes its round "
                                       << "after " << l.rounds.blocks << " blocks but runs "
                                       << blocks);
  for (int64_t i = 0; i < blocks; ++i)
    kern::normalBlock(l, static_cast<int>(sends ? (me + 1 + i) % R : i), ln, start);
  return Status::OK();
}

// The kernels' image (CUDA builds), one module for both entry points.
const void* entryImage() {
#if MC_EP_HAVE_LL_IMAGE
  // An 8-byte aligned copy (the driver reads the fatbin's header in place).
  static const std::vector<uint64_t>* image = [] {
    auto* v = new std::vector<uint64_t>((mc_ep_ll_fatbin_len + 7) / 8);
    std::memcpy(v->data(), mc_ep_ll_fatbin, mc_ep_ll_fatbin_len);
    return v;
  }();
  return image->data();
#else
  return nullptr;
#endif
}

dev::Kernel entryKernel(const char* name, Status (*host)(const void*, const dev::HostView&)) {
  dev::Kernel k;
  k.image = entryImage();
  k.name = name;
  k.host = host;
  return k;
}

const dev::Kernel& llKernel() {
  static const dev::Kernel k = entryKernel(kern::kLlEntryName, &simEntry);
  return k;
}
const dev::Kernel& normalKernel() {
  static const dev::Kernel k = entryKernel(kern::kNormalEntryName, &simNormal);
  return k;
}

// What each rank publishes about its GPU buffer.
struct DeviceInfo {
  uint64_t ok = 0;  // 1: its buffer is made and exported
  uint64_t bytes = 0;
  uint64_t offset = 0;  // of the buffer in the allocation the handle names
  uint64_t engine_id = 0;
  uint64_t addr = 0;  // the buffer in its process (engine WRITEs from other hosts)
  uint64_t key = 0;   // a candidate for the buffer's key (rank 0's is taken)
  uint64_t min_size = 0;  // EpGroup::min_size
  uint64_t late = 0;      // EpBuffer::settleEarlierWrites
  uint32_t handle_len = 0;
  uint32_t host_len = 0;
  char handle[384] = {};
  char host[128] = {};
};

}  // namespace

dev::Device* EpBuffer::deviceLayer(const char* op) const {
  auto layer = dev::get();
  if (!layer.ok())
    throw std::runtime_error(str(op, ": rank ", g_.rank, ": no GPU device layer: ",
                                 layer.status().toString()));
  return *layer;
}

int32_t* EpBuffer::streamOutcome(RoundKind kind, uint32_t round) {
  const size_t slot = scratchSlot(g_.size);
  return reinterpret_cast<int32_t*>(scratch_ + kScratchCounts * 4 +
                                    (4 + 2 * static_cast<size_t>(kind) + (round & 1)) * slot);
}

void EpBuffer::setUpDevice(size_t bytes) {
  const char* what = "ep.Buffer on GPU memory";
  engine::TransferEngine& eng = *g_.engine;
  const int n = g_.size;
  if (disable_p2p_)
    invalid("ep.Buffer", "disable_p2p is for host buffers: a GPU buffer's peers are opened "
                         "through IPC handles");
  // This rank's buffer: allocated, zeroed (signal words start at round 0), its IPC handle,
  // and the kernels loaded (loading synchronises the device: not in the middle of a call).
  // A failure here is published in the exchange below, so that every rank fails alike.
  DeviceInfo mine;
  std::string own_error;
  auto got = dev::get();
  dev::Device* layer = got.ok() ? *got : nullptr;
  Result<void*> mem = got.ok() ? layer->allocate(bytes, device_) : Result<void*>(got.status());
  if (mem.ok()) {
    base_ = static_cast<char*>(*mem);
    dev::noteUse();
    const size_t chunk = std::min<size_t>(bytes, 16u << 20);
    std::vector<char> zeros(chunk, 0);
    for (size_t off = 0; off < bytes && own_error.empty(); off += chunk) {
      Status st = dev::copy(base_ + off, zeros.data(), std::min(chunk, bytes - off),
                            engine::deadlineInMs(timeout_ms_));
      if (!st.ok()) own_error = str("zeroing the buffer: ", st.toString());
    }
  } else {
    own_error = str("allocating ", bytes, " bytes on device ", device_, ": ",
                    mem.status().toString());
  }
  for (const dev::Kernel* k : {&llKernel(), &normalKernel()}) {
    if (!own_error.empty()) break;
    Status st = layer->load(*k, device_);
    if (!st.ok()) own_error = str("loading ", k->name, ": ", st.toString());
  }
  const engine::SegmentDesc self = eng.localSegment();
  if (own_error.empty()) {
    auto handle = layer->exportIpc(base_, &mine.offset);
    if (!handle.ok())
      own_error = str("exporting an IPC handle: ", handle.status().toString());
    else if (handle->size() > sizeof(mine.handle) || self.host_id.size() > sizeof(mine.host))
      own_error = "IPC handle or host id too long";
    else {
      mine.handle_len = static_cast<uint32_t>(handle->size());
      std::memcpy(mine.handle, handle->data(), handle->size());
    }
  }
  mine.ok = own_error.empty() ? 1 : 0;
  mine.bytes = bytes;
  mine.engine_id = self.engine_id;
  mine.addr = reinterpret_cast<uint64_t>(base_);
  mine.key = randomKey();
  mine.min_size = static_cast<uint64_t>(std::max(0, g_.min_size));
  mine.late = settleEarlierWrites();
  mine.host_len = static_cast<uint32_t>(std::min(self.host_id.size(), sizeof(mine.host)));
  std::memcpy(mine.host, self.host_id.data(), mine.host_len);
  std::vector<DeviceInfo> all(n);
  g_.all_gather(&mine, all.data(), sizeof(DeviceInfo));
  // Every rank sees the same table, so every rank refuses alike.
  auto hostOf = [&](int r) {
    return std::string(all[r].host, std::min<size_t>(all[r].host_len, sizeof all[r].host));
  };
  for (int r = 0; r < n; ++r) {
    if (all[r].late != 0) {
      freeDevice();
      refuseLate(r, all[r].late, timeout_ms_);
    }
    if (all[r].ok == 0) {
      freeDevice();
      refuseVacant(g_, r);
      throw std::runtime_error(str(what, ": rank ", r, " could not make its buffer",
                                   r == g_.rank ? ": " + own_error : std::string()));
    }
    if (all[r].bytes != bytes) {
      freeDevice();
      invalid("ep.Buffer", str("num_ep_buffer_bytes differs across ranks: rank ", g_.rank,
                               " has ", bytes, ", rank ", r, " has ", all[r].bytes));
    }
  }
  uint64_t wanted = 0;
  for (const DeviceInfo& d : all) wanted = std::max(wanted, d.min_size);
  if (wanted > static_cast<uint64_t>(n)) {
    freeDevice();
    refuseShrunk(g_, wanted);
  }
  mapped_.assign(n, nullptr);
  remote_.assign(n, 0);
  engine_ids_.assign(n, 0);
  opened_.assign(n, nullptr);
  std::string open_error;
  // Ranks on other hosts: the proxy's (ll_proxy.h). (Marked before anything can fail: every
  // rank must see whether the group spans hosts, which decides the exchanges below.)
  std::vector<char> proxied(n, 0);
  for (int r = 0; r < n; ++r) {
    engine_ids_[r] = all[r].engine_id;
    remote_[r] = all[r].addr;
    proxied[r] = hostOf(r) != hostOf(g_.rank);
  }
  for (int r = 0; r < n; ++r) {
    if (r == g_.rank) {
      mapped_[r] = base_;
      continue;
    }
    if (proxied[r]) continue;
    auto base = layer->openIpc(std::string(all[r].handle, all[r].handle_len));
    if (!base.ok()) {
      open_error = str("opening rank ", r, "'s buffer: ", base.status().toString());
      break;
    }
    opened_[r] = *base;
    mapped_[r] = static_cast<char*>(*base) + all[r].offset;
    // The kernels on device_ store into it: its GPU must be device_ or a peer of it (the
    // layer enables peer access on this first ask).
    if (!layer->canAccess(device_, mapped_[r])) {
      open_error = str("rank ", r, "'s buffer is on a GPU that device ", device_,
                       " cannot reach (no peer access)");
      break;
    }
  }
  // The peers' table and the scratch the kernels use, and the dead-rank flags they read.
  if (open_error.empty()) {
    auto table = layer->allocate(n * sizeof(char*), device_);
    if (table.ok()) {
      dev_peers_ = static_cast<char**>(*table);
      Status st = dev::copy(dev_peers_, mapped_.data(), n * sizeof(char*),
                            engine::deadlineInMs(timeout_ms_));
      if (!st.ok()) open_error = str("writing the peers' table: ", st.toString());
    } else {
      open_error = str("allocating the peers' table: ", table.status().toString());
    }
  }
  if (open_error.empty()) {
    auto words = layer->allocHostWords(static_cast<size_t>(n));
    if (words.ok())
      gone_ptr_ = reinterpret_cast<int32_t*>(*words);
    else
      open_error = str("host-mapped flags: ", words.status().toString());
  }
  if (open_error.empty()) open_error = setUpStream();
  // (Every rank sees the same host table: all of them set the proxy up, or none.)
  if (std::find(proxied.begin(), proxied.end(), 1) != proxied.end())
    setUpProxy(proxied, all[0].key, &open_error);
  device_rounds_ = stream_calls_ && dev_rounds_ != nullptr;
  int ok = open_error.empty() ? 1 : 0;
  std::vector<int> all_ok(n);
  g_.all_gather(&ok, all_ok.data(), sizeof(int));
  for (int r = 0; r < n; ++r) {
    if (all_ok[r] != 0) continue;
    freeDevice();
    throw std::runtime_error(str(what, ": rank ", r, " could not set up",
                                 open_error.empty() ? std::string() : ": " + open_error));
  }
  watchPeers();
  const auto far = std::count(proxied.begin(), proxied.end(), 1);
  MC_LOG(INFO, EP) << "ep buffer rank " << g_.rank << "/" << n << ": " << bytes
                   << " bytes of GPU memory on " << layer->name() << " device " << device_ << ", "
                   << n - far << " ranks' buffers opened through IPC handles, " << far
                   << " on other hosts through the host proxy";
}

void EpBuffer::setUpProxy(const std::vector<char>& proxied, uint64_t key, std::string* error) {
  // Collective: every step's exchange runs on every rank, whatever failed before it here.
  const int n = g_.size;
  if (error->empty()) {
    try {
      proxy_ = std::make_unique<Proxy>(*this);
    } catch (const std::exception& e) {
      *error = str("the host proxy: ", e.what());
    }
  }
  struct Info {
    uint64_t ok, area;
  } mine{error->empty() ? 1u : 0u, proxy_ ? proxy_->areaAddress() : 0}, none{0, 0};
  std::vector<Info> all(n, none);
  g_.all_gather(&mine, all.data(), sizeof(Info));
  for (const Info& i : all)
    if (i.ok == 0) return;  // (the rank that failed says why in the next exchange)
  std::vector<uint64_t> areas(n);
  for (int r = 0; r < n; ++r) areas[r] = all[r].area;
  proxy_->setPeerAreas(std::move(areas));
  // (Both are collectives that throw only after their exchanges: each runs on every rank,
  // and the second reports a failure of the first to every rank.)
  std::string seg_error;
  try {
    (void)exchangeSegments(proxied);  // (they now list the buffer, the stages, the area)
  } catch (const std::exception& e) {
    seg_error = e.what();
  }
  try {
    key_ = key;  // (0 again when joining failed)
    joinSignalTargets([] {}, seg_error);
  } catch (const std::exception& e) {
    *error = e.what();
  }
}

const void* EpBuffer::kernelStream() const { return stream_ ? stream_ : dev::kCopyStream; }

bool EpBuffer::freeDevice() {
  auto layer = dev::get();
  if (!layer.ok()) return true;
  if (!freeStream()) return false;  // kernels may still touch the memory: it stays (logged)
  endProxy(true);
  for (void*& b : opened_)
    if (b != nullptr) (void)(*layer)->closeIpc(b), b = nullptr;
  if (dev_peers_ != nullptr) (void)(*layer)->free(dev_peers_), dev_peers_ = nullptr;
  if (scratch_ != nullptr) (void)(*layer)->free(scratch_), scratch_ = nullptr;
  if (dev_rounds_ != nullptr) (void)(*layer)->free(dev_rounds_), dev_rounds_ = nullptr;
  device_rounds_ = false;
  scratch_bytes_ = 0;
  if (base_ != nullptr) (void)(*layer)->free(base_), base_ = nullptr;
  return true;
}

void EpBuffer::deviceCopy(void* dst, const void* src, size_t len, const char* op) const {
  if (len == 0) return;
  Status st = dev::copy(dst, src, len, engine::deadlineInMs(timeout_ms_));
  if (!st.ok())
    throw std::runtime_error(str(op, ": rank ", g_.rank, ": GPU copy of ", len,
                                 " bytes failed: ", st.toString()));
}

char* EpBuffer::deviceScratch(size_t toks_bytes) {
  const size_t need = scratchFixed(g_.size) + toks_bytes;
  if (need > scratch_bytes_) {  // the kernels of earlier calls are done (deviceSync)
    if (capturing_call_)  // (the old scratch goes only after a host wait, and replays would
                          // keep using what the capture was given)
      throw std::invalid_argument(str(
          "ep: rank ", g_.rank, ": a call inside a CUDA-graph capture needs more kernel scratch "
          "than any call before it; run a call of the same shape once before the capture"));
    dev::Device* layer = deviceLayer("ep");
    // Stream calls return before their kernels ran: the old scratch goes once they did (a
    // host wait, only when a call needs more scratch than any before).
    if (stream_calls_ && scratch_ != nullptr) deviceSync("ep", engine::noDeadline());
    const size_t len = need;  // (grows with the largest call seen: a rare reallocation)
    auto mem = layer->allocate(len, device_);
    if (!mem.ok())
      throw std::runtime_error(str("ep: rank ", g_.rank, ": GPU scratch of ", need,
                                   " bytes: ", mem.status().toString()));
    if (scratch_ != nullptr) {  // a dispatch sent, not yet received, keeps its self_count
                                // (and a stream call its outcome words)
      Status st = dev::copy(*mem, scratch_, scratchFixed(g_.size), engine::deadlineInMs(timeout_ms_));
      // A CUDA graph's replays keep using the scratch its capture was given: it stays.
      if (graph_keep_.empty())
        (void)layer->free(scratch_);
      else
        graph_keep_.push_back(std::shared_ptr<void>(scratch_, [layer](void* q) { (void)layer->free(q); }));
      if (!st.ok()) {
        (void)layer->free(*mem);
        scratch_ = nullptr;
        scratch_bytes_ = 0;
        throw std::runtime_error(str("ep: rank ", g_.rank, ": moving the GPU scratch: ",
                                     st.toString()));
      }
    }
    scratch_ = static_cast<char*>(*mem);
    scratch_bytes_ = len;
  }
  return scratch_;
}

kern::LlLaunch EpBuffer::deviceLaunchArgs(kern::LlArgs p, int experts, uint32_t round) {
  const size_t toks = static_cast<size_t>(experts) * static_cast<size_t>(p.max_tokens) * 4;
  const Scratch sc = scratchAt(deviceScratch(toks), g_.size);
  kern::LlLaunch l;
  p.peers = dev_peers_;
  p.gone = gone_ptr_;
  p.self_count = sc.self_count + (round & 1) * kMaxSignals;
  p.decision = sc.decision;
  p.error = sc.error;
  l.p = p;
  l.toks = sc.toks;
  l.peer_bytes = geo_.totalBytes();
  l.experts = experts;
  return l;
}

// Queues an entry point's stage on `stream` (the buffer's).
static void launchEntry(dev::Device* layer, const dev::Kernel& k, const void* params, size_t len,
                        unsigned grid, int device, const void* stream, int rank, const char* op) {
  if (grid == 0) return;
  Status st = layer->launchOn(k, grid, kern::kEntryLanes, params, len, device, stream);
  if (!st.ok())
    throw std::runtime_error(str(op, ": rank ", rank, ": launching ", k.name, " on device ",
                                 device, " failed: ", st.toString()));
}

void EpBuffer::deviceLaunch(kern::LlLaunch l, kern::LlStage stage, unsigned grid,
                            const char* op) {
  l.stage = stage;
  launchEntry(deviceLayer(op), llKernel(), &l, sizeof l, grid, device_, kernelStream(), g_.rank,
              op);
}

void EpBuffer::deviceLaunch(kern::NormalLaunch l, kern::NormalStage stage, unsigned grid,
                            const char* op) {
  l.stage = stage;
  launchEntry(deviceLayer(op), normalKernel(), &l, sizeof l, grid, device_, kernelStream(),
              g_.rank, op);
}

template <class Launch>
void EpBuffer::deviceRoundsFor(Launch& l, RoundKind kind, uint32_t round) const {
  if (!device_rounds_) return;
  setRoundOffsets(l.p, geo_, 0, static_cast<int>(kind));
  l.rounds.words = dev_rounds_;
  l.rounds.kind = static_cast<int32_t>(kind);
  l.rounds.slot = static_cast<int32_t>(round & 1);
  l.rounds.from = kern::kRoundOfCall;
  l.rounds.half_bytes = geo_.halfStride();
  if (proxy_) {  // (ranks on other hosts: the half-0 stage, words and ctrl, and the ring)
    proxy_->fill(l.p, kind, 0);
    proxy_->fillDeviceRounds(l.rounds);
  }
}
template void EpBuffer::deviceRoundsFor(kern::LlLaunch&, RoundKind, uint32_t) const;
template void EpBuffer::deviceRoundsFor(kern::NormalLaunch&, RoundKind, uint32_t) const;

void EpBuffer::deviceRoundStage(kern::LlStage stage, kern::DeviceRounds rounds, const char* op) {
  kern::LlLaunch l;
  l.p.me = g_.rank;
  l.p.world = g_.size;
  l.p.peers = dev_peers_;
  l.p.abandon_signals = geo_.abandonSignal(0, rounds.kind, 0);
  l.peer_bytes = geo_.totalBytes();
  rounds.from = kern::kRoundNext;
  rounds.blocks = stage == kern::kAbandonRound ? 1 : 0;  // (it takes the round given up)
  l.rounds = rounds;
  deviceLaunch(l, stage, 1, op);
}

template <class Launch, class Stage>
void EpBuffer::deviceSend(const Launch& l, Stage stage, RoundKind kind, int64_t grid,
                          const char* op, bool* launched) {
  // Rounds on the device: the send's blocks take the round (words[kind] + 1, recorded in the
  // call's slot). With ranks on other hosts the stage's wait is a one-block stage before the
  // send (one lane waits, not every block of the send, which would hold the GPU while the
  // proxy lags), and the send's last block posts the proxy's job (ll_proxy.h).
  if (grid <= 0)  // (E, R >= 1: validated before any call gets here)
    throw std::logic_error(str(op, ": rank ", g_.rank, ": a send of ", grid, " blocks"));
  const bool rounds = l.rounds.words != nullptr, ring = proxy_ && rounds;
  if (ring)
    deviceRoundStage(kern::kStageWait, l.rounds, op);
  else if (proxy_)
    proxy_->stageFree(kind, l.p.round, op);
  Launch send = l;
  if (rounds) {
    send.rounds.from = kern::kRoundNext;
    send.rounds.blocks = static_cast<int32_t>(grid);
  }
  deviceLaunch(send, stage, static_cast<unsigned>(grid), op);
  if (launched != nullptr) *launched = true;
  if (ring) {  // (the send's last block posted the job)
    proxy_->kick();
    return;
  }
  if (!proxy_) return;
  auto sent = deviceLayer(op)->recordOn(device_, kernelStream());
  // (Without the event the proxy still moves what the kernels post: it waits for every word.)
  proxy_->moveSend(l.p, kind, sent.ok() ? std::shared_ptr<dev::Event>(std::move(*sent)) : nullptr);
  if (!sent.ok())
    throw std::runtime_error(str(op, ": rank ", g_.rank, ": an event after the send: ",
                                 sent.status().toString()));
}
template void EpBuffer::deviceSend(const kern::LlLaunch&, kern::LlStage, RoundKind, int64_t,
                                   const char*, bool*);
template void EpBuffer::deviceSend(const kern::NormalLaunch&, kern::NormalStage, RoundKind,
                                   int64_t, const char*, bool*);

void EpBuffer::deviceSync(const char* op, engine::Deadline deadline) {
  auto ev = deviceLayer(op)->recordOn(device_, kernelStream());
  Status st = ev.ok() ? (*ev)->wait(deadline) : ev.status();
  if (!st.ok())
    throw std::runtime_error(str(op, ": rank ", g_.rank, ": the kernels on device ", device_,
                                 " did not complete: ", st.toString()));
}

engine::Deadline EpBuffer::waitBound(int64_t timeout_us, int64_t slack_ms) {
  if (timeout_us < 0 || timeout_us >= kNoDeadlineUs) return engine::noDeadline();
  return engine::Clock::now() + std::chrono::microseconds(timeout_us) +
         std::chrono::milliseconds(100 + slack_ms);
}

std::vector<int32_t> EpBuffer::deviceOutcome(const kern::LlLaunch& l, int32_t error[2],
                                             const char* op) {
  std::vector<int32_t> decision(g_.size);
  deviceCopy(decision.data(), l.p.decision, decision.size() * 4, op);
  deviceCopy(error, l.p.error, 8, op);
  return decision;
}

void EpBuffer::deviceDispatchSend(const LowLatencyDispatchArgs& a, uint32_t round) {
  kern::LlLaunch l = deviceLaunchArgs(kernelArgs(a, round), a.experts, round);
  deviceSend(l, kern::kDispatchSend, RoundKind::kDispatch, a.experts, "dispatch");
  // The caller's x may be reused once the call returns: its rows are out.
  deviceSync("dispatch", engine::deadlineInMs(timeout_ms_));
}

void EpBuffer::deviceDispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round) {
  kern::LlLaunch l = deviceLaunchArgs(kernelArgs(a, round), a.experts, round);
  std::vector<int32_t> was_active(g_.size);
  deviceCopy(was_active.data(), a.active_ranks, was_active.size() * 4, "dispatch");
  const std::vector<int32_t> zeros(g_.size + 2, 0);
  deviceCopy(l.p.decision, zeros.data(), g_.size * 4, "dispatch");
  deviceCopy(l.p.error, zeros.data(), 8, "dispatch");
  deviceLaunch(l, kern::kDispatchRecv, static_cast<unsigned>(l.p.local_experts), "dispatch");
  deviceSync("dispatch", waitBound(a.timeout_us, timeout_ms_));
  int32_t error[2];
  const std::vector<int32_t> decision = deviceOutcome(l, error, "dispatch");
  kernelOutcome("dispatch", round, decision, was_active);
  throwKernelError("dispatch", error, a.max_tokens);
}

void EpBuffer::deviceCombineSend(const LowLatencyCombineArgs& a, uint32_t round) {
  kern::LlLaunch l = deviceLaunchArgs(kernelArgs(a, round), 0, round);
  deviceSend(l, kern::kCombineSend, RoundKind::kCombine, g_.size, "combine");
  deviceSync("combine", engine::deadlineInMs(timeout_ms_));
}

void EpBuffer::deviceCombineRecv(const LowLatencyCombineArgs& a, uint32_t round) {
  kern::LlLaunch l = deviceLaunchArgs(kernelArgs(a, round), 0, round);
  std::vector<int32_t> was_active(g_.size);
  deviceCopy(was_active.data(), a.active_ranks, was_active.size() * 4, "combine");
  const std::vector<int32_t> zeros(g_.size + 2, 0);
  deviceCopy(l.p.decision, zeros.data(), g_.size * 4, "combine");
  deviceCopy(l.p.error, zeros.data(), 8, "combine");
  // The waits, then (as the host paths) an error before anything is written to out.
  deviceLaunch(l, kern::kCombineWait, static_cast<unsigned>(g_.size), "combine");
  deviceSync("combine", waitBound(a.timeout_us, timeout_ms_));
  int32_t error[2];
  const std::vector<int32_t> decision = deviceOutcome(l, error, "combine");
  kernelOutcome("combine", round, decision, was_active);
  throwKernelError("combine", error, a.max_tokens);
  deviceLaunch(l, kern::kCombineToken, static_cast<unsigned>(a.tokens), "combine");
  deviceSync("combine", engine::deadlineInMs(timeout_ms_));
  deviceCopy(error, l.p.error, 8, "combine");
  throwKernelError("combine", error, a.max_tokens);
}

void EpBuffer::deviceAbandon(RoundKind kind, uint32_t round) {
  if (device_rounds_) {  // on the stream, in order with the calls queued before it
    // Inside a capture that holds the buffer's stream no round is given up: every rank
    // refuses alike, and a give-up captured there would be replayed (ep.md, "CUDA graphs").
    if (deviceLayer("abandon")->capturing(device_, kernelStream())) {
      MC_LOG(WARN, EP) << "ep: rank " << g_.rank << ": a call refused inside a CUDA-graph "
                       << "capture takes no round";
      return;
    }
    kern::LlLaunch l;
    deviceRoundsFor(l, kind, round);
    l.rounds.slot = -1;  // (the host's half may be a call's in flight: it keeps its round)
    try {
      deviceRoundStage(kern::kAbandonRound, l.rounds, "abandon");  // (and takes it)
    } catch (const std::exception& e) {  // (a broken device: the peers' calls time out)
      MC_LOG(ERROR, EP) << e.what();
    }
    return;
  }
  // (On the heap: a copy that timed out may still be queued and read it later; then it stays.)
  auto* v = new uint64_t(makeSignal(round, 1));
  bool all = true;
  if (proxy_) proxy_->abandon(kind, round);  // (the ranks on other hosts)
  for (int step = 1; step < g_.size; ++step) {
    const int o = (g_.rank + step) % g_.size;
    if (mapped_[o] == nullptr) continue;
    try {
      deviceCopy(mapped_[o] + geo_.abandonSignal(round & 1, static_cast<int>(kind), g_.rank), v,
                 8, "abandon");
    } catch (const std::exception& e) {  // best effort, as the host buffer's abandon
      MC_LOG(WARN, EP) << e.what();
      all = false;
    }
  }
  if (all) delete v;
}

template <class T>
std::vector<T> EpBuffer::hostCopy(const T* p, int64_t n, const char* op) const {
  std::vector<T> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  deviceCopy(v.data(), p, v.size() * sizeof(T), op);
  return v;
}
template std::vector<int64_t> EpBuffer::hostCopy(const int64_t*, int64_t, const char*) const;
template std::vector<int32_t> EpBuffer::hostCopy(const int32_t*, int64_t, const char*) const;
template std::vector<uint8_t> EpBuffer::hostCopy(const uint8_t*, int64_t, const char*) const;

}  // namespace mooncake::ep
