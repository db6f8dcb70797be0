// allReduce and reduce.
//
// Same host (every buffer mapped): small payloads take a flat exchange (each rank copies
// its input into its half, one flag barrier, each rank reduces all n inputs straight out
// of the peers' halves). Larger payloads run the 2-phase algorithm, chunk by chunk through
// the double-buffered halves: every rank copies the slices other ranks own into its half
// (its own slice stays where it is), flag; rank i reduces slice i reading every peer's
// half directly and writes the result into its output and its half, flag; every rank
// copies the other reduced slices out of the owners' halves. Per rank that is (n-1)/n of
// the data copied in, one read of every input of its slice, (n-1)/n copied out.
//
// Groups spanning hosts whose same-host ranks map each other: hierarchical (below).
//
// Other groups: pairwise direct exchange over messages (reduce-scatter by sending each
// slice to its owner, who reduces the n contributions in rank order at once; all-gather
// by sending the reduced slice to everyone): the same rank-order result as on shm.
#include <cstring>

#include "pg/comm_impl.h"
#include "pg/copy.h"
#include "pg/device_stage.h"

namespace mooncake::pg::algo {

namespace {

using Flag = ShmGroup::Flag;

void shmFlat(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
             DataType t, ReduceOp rop, int root) {
  ShmGroup& g = *c.shm;
  const int n = c.size, me = c.rank;
  const size_t bytes = count * dtypeSize(t);
  uint64_t s = g.beginStep(op, true);
  copyToShared(g.half(me, s), in, bytes);
  g.post(ShmGroup::kReady, s);
  if (root < 0 || root == me) {
    std::vector<const void*> srcs(n);
    for (int r = 0; r < n; ++r) srcs[r] = r == me ? in : g.half(r, s);
    g.waitAll(op, ShmGroup::kReady, s);
    reduceInto(out, nullptr, srcs.data(), n, count, t, rop);
  }
  g.endStep(s);
}

// root < 0: allreduce; else reduce to root.
void shmTwoPhase(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                 size_t count, DataType t, ReduceOp rop, int root) {
  ShmGroup& g = *c.shm;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t), align = lineElems(es);
  size_t chunk = std::min(g.halfBytes(), c.params.chunk_bytes) / es;
  const size_t unit = align * static_cast<size_t>(n);  // whole lines per slice
  if (chunk >= unit) chunk -= chunk % unit;
  std::vector<const void*> srcs(n);
  const bool so = count * es >= c.params.stream_out_bytes;
  for (size_t base = 0; base < count; base += chunk) {
    const size_t m = std::min(chunk, count - base);
    const char* cin = static_cast<const char*>(in) + base * es;
    char* cout = out != nullptr ? static_cast<char*>(out) + base * es : nullptr;
    uint64_t s = g.beginStep(op, true);
    char* mine = g.half(me, s);
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      size_t b = partBegin(m, n, j, align), e = partBegin(m, n, j + 1, align);
      copyToSharedNoFence(mine + b * es, cin + b * es, (e - b) * es);
    }
    streamFence();
    g.post(ShmGroup::kReady, s);
    const size_t b = partBegin(m, n, me, align), e = partBegin(m, n, me + 1, align);
    for (int r = 0; r < n; ++r) srcs[r] = r == me ? cin + b * es : g.half(r, s) + b * es;
    g.waitAll(op, ShmGroup::kReady, s);
    if (root < 0) {  // result into my output and, for the others, into my half
      reduceInto(cout + b * es, mine + b * es, srcs.data(), n, e - b, t, rop, so);
    } else if (root == me) {
      reduceInto(cout + b * es, nullptr, srcs.data(), n, e - b, t, rop, so);
    } else {
      reduceInto(nullptr, mine + b * es, srcs.data(), n, e - b, t, rop);
    }
    g.post(ShmGroup::kReduced, s);
    if (root < 0 || root == me) {
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        size_t jb = partBegin(m, n, j, align), je = partBegin(m, n, j + 1, align);
        if (je == jb) continue;
        g.wait(op, j, ShmGroup::kReduced, s);
        copyOut(cout + jb * es, g.half(j, s) + jb * es, (je - jb) * es, so);
      }
    }
    g.endStep(s);
  }
  if (so) streamFence();
}

// The 2-phase algorithm on GPU memory (in and out), for groups whose ranks all map each
// other: the device layer copies each chunk whole into this rank's half (its own slice
// too: host code cannot read the input) and the reduced slices out of the owners' halves
// (its own too), so the bytes cross between GPU and host memory once each way, as a host
// path's copies in and out do. Each rank reduces its slice in its half, in place (no peer
// reads a rank's own slice there before its kReduced: the steps match shmTwoPhase's).
void shmTwoPhaseDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                       size_t count, DataType t, ReduceOp rop) {
  ShmGroup& g = *c.shm;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t), align = lineElems(es);
  size_t chunk = std::min(g.halfBytes(), c.params.chunk_bytes) / es;
  const size_t unit = align * static_cast<size_t>(n);
  if (chunk >= unit) chunk -= chunk % unit;
  std::vector<const void*> srcs(n);
  DeviceCopies copies("allreduce");
  for (size_t base = 0; base < count; base += chunk) {
    const size_t m = std::min(chunk, count - base);
    const char* cin = static_cast<const char*>(in) + base * es;
    char* cout = static_cast<char*>(out) + base * es;
    uint64_t s = g.beginStep(op, true);
    char* mine = g.half(me, s);
    copies.add(mine, cin, m * es);
    copies.wait();
    g.post(ShmGroup::kReady, s);
    const size_t b = partBegin(m, n, me, align), e = partBegin(m, n, me + 1, align);
    for (int r = 0; r < n; ++r) srcs[r] = g.half(r, s) + b * es;
    g.waitAll(op, ShmGroup::kReady, s);
    reduceInto(mine + b * es, nullptr, srcs.data(), n, e - b, t, rop);  // in place: allowed
    g.post(ShmGroup::kReduced, s);
    for (int j = 0; j < n; ++j) {
      size_t jb = partBegin(m, n, j, align), je = partBegin(m, n, j + 1, align);
      if (je == jb) continue;
      if (j != me) g.wait(op, j, ShmGroup::kReduced, s);
      copies.add(cout + jb * es, g.half(j, s) + jb * es, (je - jb) * es);
    }
    copies.wait();
    g.endStep(s);
  }
}

// The flat exchange on GPU memory: the same steps as shmFlat (so ranks with host and ranks
// with GPU buffers can meet in one op): the input is copied whole into this rank's half,
// every rank reduces all halves into a host buffer, which the device layer copies out.
void shmFlatDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                   size_t count, DataType t, ReduceOp rop) {
  ShmGroup& g = *c.shm;
  const int n = c.size;
  const size_t bytes = count * dtypeSize(t);
  DeviceCopies copies("allreduce");
  uint64_t s = g.beginStep(op, true);
  copies.add(g.half(c.rank, s), in, bytes);
  copies.wait();
  g.post(ShmGroup::kReady, s);
  std::vector<const void*> srcs(n);
  for (int r = 0; r < n; ++r) srcs[r] = g.half(r, s);
  g.waitAll(op, ShmGroup::kReady, s);
  std::vector<char> result(bytes);
  reduceInto(result.data(), nullptr, srcs.data(), n, count, t, rop);
  g.endStep(s);
  copies.add(out, result.data(), bytes);
  copies.wait();
}

void netAllReduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                  size_t count, DataType t, ReduceOp rop, int root) {
  NetGroup& net = *c.net;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t), align = lineElems(es);
  const char* cin = static_cast<const char*>(in);
  char* cout = static_cast<char*>(out);
  auto begin = [&](int j) { return partBegin(count, n, j, align); };
  // 0. reduce: the root says go first. Ranks that disagree on the root would otherwise all wait
  // to receive; this way each hears a call it can check (NetGroup compares signatures).
  if (root >= 0) net.rootGo(op, root);
  // 1. every slice to its owner (to the root only, for reduce)
  for (int k = 1; k < n; ++k) {
    int j = (me + k) % n;
    if (root >= 0 && j != root) continue;
    size_t b = root >= 0 ? 0 : begin(j), e = root >= 0 ? count : begin(j + 1);
    net.sendPieces(op, j, cin + b * es, (e - b) * es);
  }
  if (root >= 0 && root != me) return;
  // 2. reduce my slice (the whole buffer on the root), piece by piece, in rank order
  size_t b = root >= 0 ? 0 : begin(me), e = root >= 0 ? count : begin(me + 1);
  const size_t piece = net.pieceBytes() / es;
  std::vector<NetGroup::Msg> msgs(n);
  std::vector<const void*> srcs(n);
  for (size_t off = b; off < e; off += piece) {
    size_t len = std::min(piece, e - off);
    for (int r = 0; r < n; ++r) {
      if (r == me) {
        srcs[r] = cin + off * es;
      } else {
        msgs[r] = net.take(op, r, len * es);
        srcs[r] = msgs[r].data();
      }
    }
    reduceInto(cout + off * es, nullptr, srcs.data(), n, len, t, rop);
    for (int r = 0; r < n; ++r)
      if (r != me) net.recycle(std::move(msgs[r]));
  }
  if (root >= 0) return;
  // 3. all-gather of the reduced slices
  for (int k = 1; k < n; ++k) {
    int j = (me + k) % n;
    net.sendPieces(op, j, cout + b * es, (e - b) * es);
  }
  for (int k = 1; k < n; ++k) {
    int j = (me + n - k) % n;
    net.recvPieces(op, j, cout + begin(j) * es, (begin(j + 1) - begin(j)) * es);
  }
}

void run(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
         DataType t, ReduceOp rop, int root);

// A group spanning hosts: reduce onto each host's leader through shared memory, allreduce
// between the leaders over messages, broadcast back through shared memory. Each byte
// crosses hosts twice per leader instead of every rank exchanging with every other rank.
// (AVG goes the flat way: its division needs the whole group's count in one step.)
void hierAllReduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                   size_t count, DataType t, ReduceOp rop) {
  Communicator::Impl& local = *c.local;
  run(local, op, in, out, count, t, rop, 0);
  if (c.leaders) run(*c.leaders, op, out, out, count, t, rop, -1);
  broadcast(local, op, out, count * dtypeSize(t), 0);
}

void run(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
         DataType t, ReduceOp rop, int root) {
  if (count == 0) return;
  if (c.size == 1) {
    if (root < 0 || root == c.rank) reduceInto(out, nullptr, &in, 1, count, t, rop);
    return;
  }
  if (!c.shm) {
    if (c.local && root < 0 && rop != ReduceOp::kAvg)
      return hierAllReduce(c, op, in, out, count, t, rop);
    return netAllReduce(c, op, in, out, count, t, rop, root);
  }
  const size_t bytes = count * dtypeSize(t);
  if (bytes <= c.params.flat_bytes && bytes <= c.shm->halfBytes())
    return shmFlat(c, op, in, out, count, t, rop, root);
  shmTwoPhase(c, op, in, out, count, t, rop, root);
}

}  // namespace

void allReduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
               DataType t, ReduceOp rop) {
  run(c, op, in, out, count, t, rop, -1);
}

bool allReduceOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                       size_t count, DataType t, ReduceOp rop) {
  if (!c.shm || c.size == 1) return false;
  if (count == 0) return true;
  // The host path's choice (run()), so that host and GPU buffers of different ranks meet in
  // the same steps.
  const size_t bytes = count * dtypeSize(t);
  if (bytes <= c.params.flat_bytes && bytes <= c.shm->halfBytes())
    shmFlatDevice(c, op, in, out, count, t, rop);
  else
    shmTwoPhaseDevice(c, op, in, out, count, t, rop);
  return true;
}

void reduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
            DataType t, ReduceOp rop, int root) {
  run(c, op, in, out, count, t, rop, root);
}

}  // namespace mooncake::pg::algo
