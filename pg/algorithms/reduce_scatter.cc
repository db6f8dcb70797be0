// reduceScatter and barrier. Shm: each step every rank copies the next piece of every
// block except its own into slot j of its half, flag, and rank i reduces block i reading
// the peers' slots i directly (its own block from its input), in rank order. Messages:
// block j goes to rank j, which reduces the n contributions piece by piece.
#include <algorithm>
#include <cstring>

#include "pg/comm_impl.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg::algo {

void reduceScatter(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                   size_t count, DataType t, ReduceOp rop) {
  if (count == 0) return;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  auto block = [&](int j) { return src + static_cast<size_t>(j) * count * es; };
  if (n == 1) {
    const void* s0 = in;
    reduceInto(out, nullptr, &s0, 1, count, t, rop);
    return;
  }
  std::vector<const void*> srcs(n);
  if (!c.shm) {
    NetGroup& net = *c.net;
    for (int k = 1; k < n; ++k) {
      int j = (me + k) % n;
      net.sendPieces(op, j, block(j), count * es);
    }
    const size_t piece = net.pieceBytes() / es;
    std::vector<NetGroup::Msg> msgs(n);
    for (size_t off = 0; off < count; off += piece) {
      size_t len = std::min(piece, count - off);
      for (int r = 0; r < n; ++r) {
        if (r == me) {
          srcs[r] = block(me) + off * es;
        } else {
          msgs[r] = net.take(op, r, len * es);
          srcs[r] = msgs[r].data();
        }
      }
      reduceInto(dst + off * es, nullptr, srcs.data(), n, len, t, rop);
      for (int r = 0; r < n; ++r)
        if (r != me) net.recycle(std::move(msgs[r]));
    }
    return;
  }
  ShmGroup& g = *c.shm;
  const size_t slot = (g.halfBytes() / n) & ~static_cast<size_t>(63);
  const size_t step_elems = slot / es;
  const bool so = count * es >= c.params.stream_out_bytes;
  for (size_t off = 0; off < count; off += step_elems) {
    const size_t len = std::min(step_elems, count - off);
    uint64_t s = g.beginStep(op, true);
    g.setGpuHalf(s, false);
    char* h = g.half(me, s);
    for (int j = 0; j < n; ++j)
      if (j != me) copyToSharedNoFence(h + j * slot, block(j) + off * es, len * es);
    streamFence();
    g.post(ShmGroup::kReady, s);
    for (int r = 0; r < n; ++r)
      srcs[r] = r == me ? block(me) + off * es : g.half(r, s) + me * slot;
    g.waitAll(op, ShmGroup::kReady, s);
    if (anyPeerOnGpu(c, s)) {  // a peer with GPU data (reduceScatterOnDevice)
      StepSources src(n);
      src.build(c, op, s, block(me) + off * es, false, me * slot);
      reduceMixed(op, dst + off * es, false, nullptr, false, src, len, t, rop);
    } else {
      reduceInto(dst + off * es, nullptr, srcs.data(), n, len, t, rop, so);
    }
    g.endStep(s);
  }
}

// The same steps on GPU memory (one host): this rank's blocks for the others go into its GPU
// half (device to device) and, when every peer's are in GPU halves too, the device reduces
// this rank's block from the peers' halves and its own input straight into its output
// (pg/device_reduce.h); otherwise on the CPU from host copies (reduceMixed).
bool reduceScatterOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                           size_t count, DataType t, ReduceOp rop) {
  if (!c.shm || c.size == 1) return false;
  if (count == 0) return true;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  auto block = [&](int j) { return src + static_cast<size_t>(j) * count * es; };
  const bool in_gpu = DeviceStage::any({in}), out_gpu = DeviceStage::any({out});
  ShmGroup& g = *c.shm;
  const size_t slot = (g.halfBytes() / n) & ~static_cast<size_t>(63);
  const size_t step_elems = slot / es;
  StepSources from(n);
  DeviceCopies copies("reduce_scatter");
  for (size_t off = 0; off < count; off += step_elems) {
    const size_t len = std::min(step_elems, count - off);
    uint64_t s = g.beginStep(op, true);
    char* h = deviceHalves(c).writeTarget(s, in);
    for (int j = 0; j < n; ++j)
      if (j != me) copies.add(h + j * slot, block(j) + off * es, len * es);
    copies.wait();
    g.post(ShmGroup::kReady, s);
    g.waitAll(op, ShmGroup::kReady, s);
    from.build(c, op, s, block(me) + off * es, in_gpu, me * slot);
    if (!(from.all_gpu && out_gpu &&
          copies.reduce(dst + off * es, nullptr, from.p.data(), n, len, t, rop)))
      reduceMixed(op, dst + off * es, out_gpu, nullptr, false, from, len, t, rop);
    copies.wait();
    g.endStep(s);
  }
  return true;
}

void barrier(Communicator::Impl& c, const OpCtx& op) {
  const int n = c.size, me = c.rank;
  if (n == 1) return;
  if (!c.shm) {
    for (int k = 1; k < n; ++k) c.net->send(op, (me + k) % n, nullptr, 0);
    for (int k = 1; k < n; ++k) c.net->recv(op, (me + n - k) % n, nullptr, 0);
    return;
  }
  ShmGroup& g = *c.shm;
  uint64_t s = g.beginStep(op, false);
  g.post(ShmGroup::kReady, s);
  g.waitAll(op, ShmGroup::kReady, s);
  g.endStep(s);
}

}  // namespace mooncake::pg::algo
