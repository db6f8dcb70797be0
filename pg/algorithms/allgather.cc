// allGatherV (allGather is the equal-size case) and gather. Shm: every rank copies its
// block (a half at a time) into its own half, flag, the receivers copy straight out of the
// owners' halves. Messages: every rank sends its block to every receiver. Groups spanning
// hosts: hierarchical (hierAllGatherV). GPU memory on one host: the same on shm, with the
// device layer's copies in and out (allGatherVOnDevice), a rank's GPU block through its GPU
// halves (DeviceHalves: device to device, never through host memory).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>

#include "pg/comm_impl.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg::algo {

namespace {

// root < 0: everyone receives (allgather); else only root does (gather). at (optional):
// where rank r's block goes in out (default: the blocks back to back in rank order). dev
// (shm only): in and out may be GPU memory, moved by the device layer's copies in the same
// steps (allGatherVOnDevice).
void run(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
         const std::vector<size_t>& bytes, int root, const std::vector<size_t>* at = nullptr,
         DeviceCopies* dev = nullptr) {
  const int n = c.size, me = c.rank;
  const bool receive = root < 0 || root == me;
  std::vector<size_t> displ(n + 1, 0);
  for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + bytes[r];
  const size_t total = displ[n];
  if (at != nullptr) std::copy(at->begin(), at->end(), displ.begin());
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const bool so = total >= c.params.stream_out_bytes;
  if (receive && bytes[me] > 0 && dst + displ[me] != src) {
    char* mine = dst + displ[me];
    // Disjoint and large: streaming stores (no read-for-ownership of the output's lines).
    if (dev != nullptr)
      dev->add(mine, src, bytes[me]);  // disjoint (the caller's check)
    else if (so && (mine + bytes[me] <= src || src + bytes[me] <= mine))
      copyToShared(mine, src, bytes[me]);
    else
      std::memmove(mine, src, bytes[me]);
  }
  if (n == 1 || total == 0) return;

  if (!c.shm) {
    if (root >= 0) c.net->rootGo(op, root);  // gather: see netAllReduce
    for (int k = 1; k < n; ++k) {
      int j = (me + k) % n;
      if (root < 0 || j == root) c.net->sendPieces(op, j, src, bytes[me]);
    }
    if (receive)
      for (int k = 1; k < n; ++k) {
        int j = (me + n - k) % n;
        c.net->recvPieces(op, j, dst + displ[j], bytes[j]);
      }
    return;
  }
  ShmGroup& g = *c.shm;
  // A rank's GPU block goes through its GPU halves (device to device; DeviceHalves), which a
  // peer with host buffers reads with the device layer's copies too.
  std::optional<DeviceCopies> own_dev;  // a host-buffer rank's copies out of GPU halves
  const size_t chunk = g.halfBytes();
  const size_t most = *std::max_element(bytes.begin(), bytes.end());
  for (size_t off = 0; off < most; off += chunk) {
    auto lenOf = [&](int r) { return bytes[r] > off ? std::min(chunk, bytes[r] - off) : 0; };
    uint64_t s = g.beginStep(op, lenOf(me) > 0);
    if (dev != nullptr) {
      if (lenOf(me) > 0) dev->add(deviceHalves(c).writeTarget(s, src), src + off, lenOf(me));
      dev->wait();
    } else if (lenOf(me) > 0) {
      g.setGpuHalf(s, false);
      copyToShared(g.half(me, s), src + off, lenOf(me));
    }
    g.post(ShmGroup::kReady, s);
    if (receive) {
      for (int k = 1; k < n; ++k) {
        int j = (me + k) % n;  // start at different peers: spreads the reads
        size_t len = lenOf(j);
        if (len == 0) continue;
        g.wait(op, j, ShmGroup::kReady, s);
        if (g.gpuHalf(j, s)) {
          DeviceCopies& d = copiesFor(dev, own_dev, op.name);
          d.add(dst + displ[j] + off, deviceHalves(c).peerHalf(op, j, s), len);
        } else if (dev != nullptr) {
          dev->add(dst + displ[j] + off, g.half(j, s), len);
        } else {
          copyOut(dst + displ[j] + off, g.half(j, s), len, so);
        }
      }
    }
    if (dev != nullptr) dev->wait();  // out of this half before peers may reuse it
    if (own_dev) own_dev->wait();
    g.endStep(s);
  }
  if (so && dev == nullptr) streamFence();
}

// A group spanning hosts: the ranks of each host gather their blocks among themselves
// through shared memory (into their final places); the leaders exchange their hosts' blocks
// over messages; each leader broadcasts the other hosts' blocks to its host through shared
// memory. A block crosses to every other host once instead of once per rank there.
void hierAllGatherV(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                    const std::vector<size_t>& bytes) {
  const int n = c.size, me = c.rank, my_host = c.host_of[me];
  char* dst = static_cast<char*>(out);
  std::vector<size_t> displ(n + 1, 0);
  for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + bytes[r];
  std::vector<size_t> local_bytes, local_at;
  for (int r : c.local_ranks) {
    local_bytes.push_back(bytes[r]);
    local_at.push_back(displ[r]);
  }
  run(*c.local, op, in, out, local_bytes, -1, &local_at);
  if (c.local_ranks[0] == me) {
    for (size_t h = 0; h < c.leader_ranks.size(); ++h) {
      if (static_cast<int>(h) == my_host) continue;
      for (int r : c.local_ranks) c.net->sendPieces(op, c.leader_ranks[h], dst + displ[r], bytes[r]);
    }
    for (int r = 0; r < n; ++r)
      if (c.host_of[r] != my_host)
        c.net->recvPieces(op, c.leader_ranks[c.host_of[r]], dst + displ[r], bytes[r]);
  }
  for (int r = 0; r < n; ++r)
    if (c.host_of[r] != my_host) broadcast(*c.local, op, dst + displ[r], bytes[r], 0);
}

}  // namespace

bool allGatherVOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                        const std::vector<size_t>& bytes) {
  if (!c.shm || c.size == 1) return false;
  DeviceCopies copies("allgather");
  run(c, op, in, out, bytes, -1, nullptr, &copies);
  copies.wait();  // the own block's copy when nothing else was waited for
  return true;
}

void allGatherV(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                const std::vector<size_t>& bytes) {
  if (!c.shm && c.local) return hierAllGatherV(c, op, in, out, bytes);
  run(c, op, in, out, bytes, -1);
}

void gather(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t bytes,
            int root) {
  run(c, op, in, out, std::vector<size_t>(c.size, bytes), root);
}

bool gatherOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                    size_t bytes, int root) {
  if (!c.shm || c.size == 1) return false;
  DeviceCopies copies("gather");
  run(c, op, in, out, std::vector<size_t>(c.size, bytes), root, nullptr, &copies);
  copies.wait();  // the own block's copy when nothing else was waited for
  return true;
}

}  // namespace mooncake::pg::algo
