// broadcast and scatter: the root copies into its half, the others copy straight out of
// it (shm, pipelined through the two halves; broadcast in steps of about a quarter of the
// payload); over messages the root sends to each rank; groups spanning hosts broadcast
// hierarchically (one copy per host over messages). GPU memory on one host
// (broadcastOnDevice): the same steps with the device layer's copies, the root's data through
// its GPU halves (device to device).
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "pg/comm_impl.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg::algo {

namespace {

// A group spanning hosts: the root sends to one rank per other host (its leader) over
// messages, then every host broadcasts through shared memory from the rank that has the
// data (the root on its own host, the leader elsewhere). Each byte crosses to every other
// host once instead of once per rank there.
void hierBroadcast(Communicator::Impl& c, const OpCtx& op, char* p, size_t bytes, int root) {
  const int me = c.rank, root_host = c.host_of[root];
  if (me == root) {
    for (size_t h = 0; h < c.leader_ranks.size(); ++h)
      if (static_cast<int>(h) != root_host) c.net->sendPieces(op, c.leader_ranks[h], p, bytes);
  } else if (c.host_of[me] != root_host && c.local_ranks[0] == me) {
    c.net->recvPieces(op, root, p, bytes);
  }
  int source = 0;  // local index of the rank that holds the data on this host
  if (c.host_of[me] == root_host)
    source = static_cast<int>(std::find(c.local_ranks.begin(), c.local_ranks.end(), root) -
                              c.local_ranks.begin());
  broadcast(*c.local, op, p, bytes, source);
}

}  // namespace

namespace {

// dev (shm only): buf is GPU memory, moved by the device layer's copies: the root's through
// its GPU halves (DeviceHalves), device to device. A receiver reads a root's GPU half with the
// device layer's copies whatever its own buffer is.
void shmBroadcast(Communicator::Impl& c, const OpCtx& op, char* p, size_t bytes, int root,
                  DeviceCopies* dev);

}  // namespace

bool broadcastOnDevice(Communicator::Impl& c, const OpCtx& op, void* buf, size_t bytes,
                       int root) {
  if (!c.shm || c.size == 1) return false;
  if (bytes == 0) return true;
  DeviceCopies copies("broadcast");
  shmBroadcast(c, op, static_cast<char*>(buf), bytes, root, &copies);
  return true;
}

void broadcast(Communicator::Impl& c, const OpCtx& op, void* buf, size_t bytes, int root) {
  if (bytes == 0 || c.size == 1) return;
  const int me = c.rank;
  char* p = static_cast<char*>(buf);
  if (!c.shm && c.local) return hierBroadcast(c, op, p, bytes, root);
  if (!c.shm) {
    if (me == root) {
      for (int k = 1; k < c.size; ++k) c.net->sendPieces(op, (me + k) % c.size, p, bytes);
    } else {
      c.net->recvPieces(op, root, p, bytes);
    }
    return;
  }
  shmBroadcast(c, op, p, bytes, root, nullptr);
}

namespace {

void shmBroadcast(Communicator::Impl& c, const OpCtx& op, char* p, size_t bytes, int root,
                  DeviceCopies* dev) {
  const int me = c.rank;
  ShmGroup& g = *c.shm;
  std::optional<DeviceCopies> own_dev;  // a host buffer's copies out of the root's GPU half
  // Pipelined in about four steps (at least 64 KiB each): the root fills one half while the
  // others copy the previous step out of the other, instead of copying everything in before
  // anyone copies out. Measured with pg_perf at 2 ranks: 1 MiB 99 -> 33 us, 4 MiB 476 ->
  // 139 us; no change from 16 MiB (memory-bound) nor for allgather, where every rank copies
  // in and out at once anyway.
  const size_t quarter = (bytes / 4 + 4095) & ~static_cast<size_t>(4095);
  const size_t chunk = std::min(g.halfBytes(), std::max<size_t>(quarter, 64 << 10));
  const bool so = bytes >= c.params.stream_out_bytes;
  // The receivers announce each step as they reach it, and the root's last wait is for those
  // announcements, not for the receivers' copies: it checks their calls (mismatch detection)
  // without waiting until they have copied, so it can fill the next op's step while they do.
  uint64_t s = 0;
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t len = std::min(chunk, bytes - off);
    s = g.beginStep(op, me == root);
    if (me == root) {
      if (dev != nullptr) {
        dev->add(deviceHalves(c).writeTarget(s, p), p + off, len);
        dev->wait();
      } else {
        g.setGpuHalf(s, false);
        copyToShared(g.half(me, s), p + off, len);
      }
      g.post(ShmGroup::kReady, s);
    } else {
      g.announce(s);
      g.wait(op, root, ShmGroup::kReady, s);
      if (g.gpuHalf(root, s)) {
        DeviceCopies& d = copiesFor(dev, own_dev, op.name);
        d.add(p + off, deviceHalves(c).peerHalf(op, root, s), len);
        d.wait();  // out of the half before the root may reuse it
      } else if (dev != nullptr) {
        dev->add(p + off, g.half(root, s), len);
        dev->wait();
      } else {
        copyOut(p + off, g.half(root, s), len, so);
      }
    }
    g.endStep(s);
  }
  if (so && dev == nullptr) streamFence();
  if (me == root)
    for (int r = 0; r < c.size; ++r)
      if (r != me) g.wait(op, r, ShmGroup::kReady, s);
}

}  // namespace

namespace {

// dev (shm only): in (root) and out may be GPU memory, moved by the device layer's copies; a
// GPU root's slots go through its GPU halves, which every receiver reads with the device
// layer's copies whatever its own buffer is.
void scatterImpl(Communicator::Impl& c, const OpCtx& op, const char* src, char* dst,
                 size_t bytes, int root, DeviceCopies* dev) {
  const int n = c.size, me = c.rank;
  if (me == root && dst != src + static_cast<size_t>(me) * bytes) {
    if (dev != nullptr) {
      dev->add(dst, src + static_cast<size_t>(me) * bytes, bytes);
      dev->wait();
    } else {
      std::memcpy(dst, src + static_cast<size_t>(me) * bytes, bytes);
    }
  }
  if (n == 1) return;
  if (!c.shm) {
    if (me == root) {
      for (int k = 1; k < n; ++k) {
        int j = (me + k) % n;
        c.net->sendPieces(op, j, src + static_cast<size_t>(j) * bytes, bytes);
      }
    } else {
      c.net->recvPieces(op, root, dst, bytes);
    }
    return;
  }
  ShmGroup& g = *c.shm;
  std::optional<DeviceCopies> own_dev;  // a host output's copies out of the root's GPU half
  const size_t slot = (g.halfBytes() / n) & ~static_cast<size_t>(63);
  for (size_t off = 0; off < bytes; off += slot) {
    const size_t len = std::min(slot, bytes - off);
    uint64_t s = g.beginStep(op, me == root);
    if (me == root) {
      if (dev != nullptr) {
        char* h = deviceHalves(c).writeTarget(s, src);  // the GPU half, or the host half
        for (int j = 0; j < n; ++j)
          if (j != me) dev->add(h + j * slot, src + static_cast<size_t>(j) * bytes + off, len);
        dev->wait();
      } else {
        g.setGpuHalf(s, false);
        char* h = g.half(me, s);
        for (int j = 0; j < n; ++j)
          if (j != me)
            copyToSharedNoFence(h + j * slot, src + static_cast<size_t>(j) * bytes + off, len);
        streamFence();
      }
      g.post(ShmGroup::kReady, s);
    } else {
      g.wait(op, root, ShmGroup::kReady, s);
      if (g.gpuHalf(root, s)) {
        DeviceCopies& d = copiesFor(dev, own_dev, op.name);
        d.add(dst + off, deviceHalves(c).peerHalf(op, root, s) + me * slot, len);
        d.wait();  // out of the half before the root may reuse it
      } else if (dev != nullptr) {
        dev->add(dst + off, g.half(root, s) + me * slot, len);
        dev->wait();
      } else {
        copyFromShared(dst + off, g.half(root, s) + me * slot, len);
      }
    }
    g.endStep(s);
  }
}

}  // namespace

void scatter(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t bytes,
             int root) {
  if (bytes == 0) return;
  scatterImpl(c, op, static_cast<const char*>(in), static_cast<char*>(out), bytes, root,
              nullptr);
}

bool scatterOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                     size_t bytes, int root) {
  if (!c.shm || c.size == 1) return false;
  if (bytes == 0) return true;
  DeviceCopies copies("scatter");
  scatterImpl(c, op, static_cast<const char*>(in), static_cast<char*>(out), bytes, root,
              &copies);
  return true;
}

}  // namespace mooncake::pg::algo
