// allToAllV. Every rank publishes its send and receive sizes (on shm at the head of its first
// step's half, beside that step's data; one message per peer otherwise), so that every rank
// checks the whole size matrix and all of them raise the same error when a pair disagrees.
// Shm: each step, every rank copies the next slot of its block for rank j into slot j of its
// half; rank j copies it out.
// Groups spanning hosts: same-host blocks through shared memory, the rest over messages.
// GPU memory on one host (allToAllVOnDevice): the same steps with the device layer's copies,
// a GPU input's slots through the rank's GPU halves (device to device).
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "pg/comm_impl.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg::algo {

namespace {

// sizes[r * 2n + j] = rank r's send_bytes[j]; sizes[r * 2n + n + j] = its recv_bytes[j].
void validate(const Communicator::Impl& c, const OpCtx& op, const std::vector<uint64_t>& sizes) {
  const int n = c.size;
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) {
      uint64_t sent = sizes[r * 2 * n + j], expected = sizes[j * 2 * n + n + r];
      if (sent != expected)
        throw UsageError("mooncake pg: " + std::string(op.name) + " (group " + c.opts.group_name +
                             "): rank " + std::to_string(r) + " sends " + std::to_string(sent) +
                             " bytes to rank " + std::to_string(j) + " but rank " +
                             std::to_string(j) + " expects " + std::to_string(expected) +
                             " bytes from rank " + std::to_string(r) + " (split sizes differ)",
                         j == c.rank ? r : j, op.name);  // the peer: the other end, from here
    }
}

void shmAllToAllV(Communicator::Impl& c, const OpCtx& op, const char* src,
                  const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  char* dst, const std::vector<size_t>& recv_offsets,
                  const std::vector<uint64_t>& mine, DeviceCopies* dev);

}  // namespace

void allToAllV(Communicator::Impl& c, const OpCtx& op, const void* in,
               const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
               void* out, const std::vector<size_t>& recv_bytes,
               const std::vector<size_t>& recv_offsets) {
  const int n = c.size, me = c.rank;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<uint64_t> mine(2 * n);
  for (int j = 0; j < n; ++j) {
    mine[j] = send_bytes[j];
    mine[n + j] = recv_bytes[j];
  }
  std::vector<uint64_t> sizes(2 * n * n);
  const size_t row = 2 * n * sizeof(uint64_t);

  if (n > 1 && !c.shm) {
    NetGroup& net = *c.net;
    for (int k = 1; k < n; ++k) net.send(op, (me + k) % n, mine.data(), row);
    for (int r = 0; r < n; ++r) {
      if (r == me) std::memcpy(&sizes[r * 2 * n], mine.data(), row);
      else net.recv(op, r, &sizes[r * 2 * n], row);
    }
    validate(c, op, sizes);
    // A group spanning hosts: blocks for other hosts go over messages (sent first: sends
    // never wait), this host's blocks through shared memory (a nested allToAllV over the
    // host's ranks), then the other hosts' blocks are received.
    const bool hier = c.local != nullptr;
    auto remote = [&](int r) { return !hier || c.host_of[r] != c.host_of[me]; };
    if (!hier && send_bytes[me] > 0 && dst + recv_offsets[me] != src + send_offsets[me])
      std::memcpy(dst + recv_offsets[me], src + send_offsets[me], send_bytes[me]);
    for (int k = 1; k < n; ++k) {
      int j = (me + k) % n;
      if (remote(j)) net.sendPieces(op, j, src + send_offsets[j], send_bytes[j]);
    }
    if (hier) {
      const size_t ln = c.local_ranks.size();
      std::vector<size_t> sb(ln), so(ln), rb(ln), ro(ln);
      for (size_t i = 0; i < ln; ++i) {
        const int r = c.local_ranks[i];
        sb[i] = send_bytes[r];
        so[i] = send_offsets[r];
        rb[i] = recv_bytes[r];
        ro[i] = recv_offsets[r];
      }
      allToAllV(*c.local, op, in, sb, so, out, rb, ro);
    }
    for (int k = 1; k < n; ++k) {
      int r = (me + n - k) % n;
      if (remote(r)) net.recvPieces(op, r, dst + recv_offsets[r], recv_bytes[r]);
    }
    return;
  }

  if (n == 1) {
    validate(c, op, mine);
    if (send_bytes[0] > 0 && dst + recv_offsets[0] != src + send_offsets[0])
      std::memcpy(dst + recv_offsets[0], src + send_offsets[0], send_bytes[0]);
    return;
  }
  shmAllToAllV(c, op, src, send_bytes, send_offsets, dst, recv_offsets, mine, nullptr);
}

bool allToAllVOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in,
                       const std::vector<size_t>& send_bytes,
                       const std::vector<size_t>& send_offsets, void* out,
                       const std::vector<size_t>& recv_bytes,
                       const std::vector<size_t>& recv_offsets) {
  const int n = c.size;
  if (!c.shm || n == 1) return false;
  std::vector<uint64_t> mine(2 * n);
  for (int j = 0; j < n; ++j) {
    mine[j] = send_bytes[j];
    mine[n + j] = recv_bytes[j];
  }
  DeviceCopies copies("alltoall");
  shmAllToAllV(c, op, static_cast<const char*>(in), send_bytes, send_offsets,
               static_cast<char*>(out), recv_offsets, mine, &copies);
  return true;
}

namespace {

// Shm: the size rows travel with the first step's data (each rank's half starts with its
// row, the slots follow), so the exchange costs no round of its own. The first step's
// slots are filled from this rank's own send sizes; every rank reads every row before it
// copies anything out, checks the matrix and derives the number of further steps from it.
// dev: in and out may be GPU memory, moved by the device layer's copies; a rank whose input
// is GPU memory puts its slots in its GPU half (the rows stay in the host half), and a peer
// reads them from there with the device layer's copies, whatever its own output is.
void shmAllToAllV(Communicator::Impl& c, const OpCtx& op, const char* src,
                  const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  char* dst, const std::vector<size_t>& recv_offsets,
                  const std::vector<uint64_t>& mine, DeviceCopies* dev) {
  const int n = c.size, me = c.rank;
  std::vector<uint64_t> sizes(2 * n * n);
  const size_t row = 2 * n * sizeof(uint64_t);
  ShmGroup& g = *c.shm;
  std::optional<DeviceCopies> own_dev;  // a host output's copies out of peers' GPU halves
  const size_t head = (row + 63) & ~static_cast<size_t>(63);
  const size_t slot = ((g.halfBytes() - head) / n) & ~static_cast<size_t>(63);
  if (slot == 0)
    throw CommError("mooncake pg: " + std::string(op.name) + " (group " + c.opts.group_name +
                        "): the comm buffer is too small for " + std::to_string(n) +
                        " ranks (raise MC_PG_BUFFER_BYTES)",
                    -1, op.name);
  uint64_t most = 0;
  bool so = false;
  for (uint64_t off = 0;; off += slot) {
    const bool first = off == 0;
    auto lenOf = [&](int from, int to) -> size_t {
      uint64_t b = first && from == me ? mine[to] : sizes[from * 2 * n + to];
      return b > off ? static_cast<size_t>(std::min<uint64_t>(slot, b - off)) : 0;
    };
    bool writes = first;
    for (int j = 0; j < n; ++j) writes |= j != me && lenOf(me, j) > 0;
    uint64_t s = g.beginStep(op, writes);
    char* h = g.half(me, s);
    if (first) std::memcpy(h, mine.data(), row);
    if (dev != nullptr) {
      char* slots = deviceHalves(c).writeTarget(s, src);  // the GPU half, or h
      for (int j = 0; j < n; ++j) {
        size_t len = j == me ? 0 : lenOf(me, j);
        if (len > 0) dev->add(slots + head + j * slot, src + send_offsets[j] + off, len);
      }
      dev->wait();
    } else {
      g.setGpuHalf(s, false);
      for (int j = 0; j < n; ++j) {
        size_t len = j == me ? 0 : lenOf(me, j);
        if (len > 0) copyToSharedNoFence(h + head + j * slot, src + send_offsets[j] + off, len);
      }
    }
    streamFence();
    g.post(ShmGroup::kReady, s);
    if (first) {
      for (int r = 0; r < n; ++r) {
        if (r != me) g.wait(op, r, ShmGroup::kReady, s);
        const void* from = r == me ? static_cast<const void*>(mine.data()) : g.half(r, s);
        std::memcpy(&sizes[r * 2 * n], from, row);
      }
      try {
        validate(c, op, sizes);
      } catch (...) {
        g.endStep(s);  // every rank read every row: the ranks stay in step
        throw;
      }
      for (int r = 0; r < n; ++r)
        for (int j = 0; j < n; ++j)
          if (r != j) most = std::max(most, sizes[r * 2 * n + j]);
      uint64_t received = 0;
      for (int r = 0; r < n; ++r) received += sizes[r * 2 * n + me];
      so = received >= c.params.stream_out_bytes;
      // This rank's own block: streaming stores too when the output is large (no
      // read-for-ownership of lines that leave the cache anyway).
      if (send_bytes[me] > 0 && dst + recv_offsets[me] != src + send_offsets[me]) {
        if (dev != nullptr)
          dev->add(dst + recv_offsets[me], src + send_offsets[me], send_bytes[me]);
        else
          copyOut(dst + recv_offsets[me], src + send_offsets[me], send_bytes[me], so);
      }
    }
    for (int k = 1; k < n; ++k) {
      int r = (me + k) % n;
      size_t len = lenOf(r, me);
      if (len == 0) continue;
      g.wait(op, r, ShmGroup::kReady, s);
      char* to = dst + recv_offsets[r] + off;
      if (g.gpuHalf(r, s)) {
        DeviceCopies& d = copiesFor(dev, own_dev, op.name);
        d.add(to, deviceHalves(c).peerHalf(op, r, s) + head + me * slot, len);
      } else if (dev != nullptr) {
        dev->add(to, g.half(r, s) + head + me * slot, len);
      } else {
        copyOut(to, g.half(r, s) + head + me * slot, len, so);
      }
    }
    if (dev != nullptr) dev->wait();  // out of the peers' halves before they may reuse them
    if (own_dev) own_dev->wait();
    g.endStep(s);
    if (off + slot >= most) break;
  }
  if (so) streamFence();
}

}  // namespace

}  // namespace mooncake::pg::algo
