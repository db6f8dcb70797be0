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
#include <optional>
#include <utility>

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
  g.setGpuHalf(s, false);
  copyToShared(g.half(me, s), in, bytes);
  g.post(ShmGroup::kReady, s);
  if (root < 0 || root == me) {
    std::vector<const void*> srcs(n);
    for (int r = 0; r < n; ++r) srcs[r] = r == me ? in : g.half(r, s);
    g.waitAll(op, ShmGroup::kReady, s);
    if (anyPeerOnGpu(c, s)) {  // a peer with GPU data (shmFlatDevice)
      StepSources src(n);
      src.build(c, op, s, in, false, 0);
      reduceMixed(op, out, false, nullptr, false, src, count, t, rop);
    } else {
      reduceInto(out, nullptr, srcs.data(), n, count, t, rop);
    }
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
  std::optional<DeviceCopies> own_dev;  // copies out of peers' GPU halves
  for (size_t base = 0; base < count; base += chunk) {
    const size_t m = std::min(chunk, count - base);
    const char* cin = static_cast<const char*>(in) + base * es;
    char* cout = out != nullptr ? static_cast<char*>(out) + base * es : nullptr;
    uint64_t s = g.beginStep(op, true);
    g.setGpuHalf(s, false);
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
    const bool peer_gpu = anyPeerOnGpu(c, s);
    if (peer_gpu) {  // a peer with GPU data (shmTwoPhaseDevice): read it with device copies
      StepSources src(n);
      src.build(c, op, s, cin + b * es, false, b * es);
      if (e > b)
        reduceMixed(op, root < 0 || root == me ? cout + b * es : nullptr, false,
                    root != me ? mine + b * es : nullptr, false, src, e - b, t, rop);
    } else if (root < 0) {  // result into my output and, for the others, into my half
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
        if (peer_gpu && g.gpuHalf(j, s))
          copiesFor(nullptr, own_dev, op.name)
              .add(cout + jb * es, deviceHalves(c).peerHalf(op, j, s) + jb * es, (je - jb) * es);
        else
          copyOut(cout + jb * es, g.half(j, s) + jb * es, (je - jb) * es, so);
      }
    }
    if (own_dev) own_dev->wait();
    g.endStep(s);
  }
  if (so) streamFence();
}

// The 2-phase algorithm on GPU memory, in the same steps as shmTwoPhase (so that ranks with
// host and with GPU buffers meet in one op). This rank's GPU chunk goes, its own slice aside,
// into its GPU half (DeviceHalves: device to device); when every rank's data of the step is in
// GPU halves, the device reduces this rank's slice from the peers' halves (opened through IPC)
// and its own input into its output and its half (pg/device_reduce.h: a CUDA kernel on the
// copy stream), and the other reduced slices are copied out of the owners' halves, so no byte
// crosses host memory. Otherwise (a peer's data in its host half, GPU halves off or
// unavailable, no kernel image) the slice is reduced on the CPU from host copies
// (reduceMixed), the result placed in this rank's half of the kind it used.
void shmTwoPhaseDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                       size_t count, DataType t, ReduceOp rop, int root) {
  ShmGroup& g = *c.shm;
  const int n = c.size, me = c.rank;
  const size_t es = dtypeSize(t), align = lineElems(es);
  size_t chunk = std::min(g.halfBytes(), c.params.chunk_bytes) / es;
  const size_t unit = align * static_cast<size_t>(n);
  if (chunk >= unit) chunk -= chunk % unit;
  const bool out_gpu = DeviceStage::any({out});
  StepSources src(n);
  DeviceCopies copies(op.name);
  // The copies out of a step are waited for with the next step's copies in (one host wait
  // fewer per step); its kConsumed is posted after that wait.
  uint64_t unconsumed = 0;
  for (size_t base = 0; base < count; base += chunk) {
    const size_t m = std::min(chunk, count - base);
    const char* cin = static_cast<const char*>(in) + base * es;
    char* cout = out != nullptr ? static_cast<char*>(out) + base * es : nullptr;
    uint64_t s = g.beginStep(op, true);
    char* mine = deviceHalves(c).writeTarget(s, cin);
    const bool mine_gpu = g.gpuHalf(me, s);
    const size_t b = partBegin(m, n, me, align), e = partBegin(m, n, me + 1, align);
    if (mine_gpu) {  // the own slice is read from the input
      copies.add(mine, cin, b * es);
      copies.add(mine + e * es, cin + e * es, (m - e) * es);
    } else {
      copies.add(mine, cin, m * es);
    }
    copies.wait();  // and the previous step's copies out
    if (unconsumed != 0) g.endStep(std::exchange(unconsumed, 0));
    g.post(ShmGroup::kReady, s);
    g.waitAll(op, ShmGroup::kReady, s);
    src.build(c, op, s, mine_gpu ? cin + b * es : mine + b * es, mine_gpu, b * es);
    if (e > b) {
      // allreduce: into the output and the half; reduce: the root's into its output, the
      // others' into their halves, where the root copies them from.
      char* to = root < 0 || root == me ? cout + b * es : nullptr;
      char* to_half = root != me ? mine + b * es : nullptr;
      const bool on_device = src.all_gpu && (to == nullptr || out_gpu) &&
                             (to_half == nullptr || mine_gpu);
      if (!(on_device && copies.reduce(to, to_half, src.p.data(), n, e - b, t, rop)))
        reduceMixed(op, to, out_gpu, to_half, mine_gpu, src, e - b, t, rop);
      copies.wait();
    }
    g.post(ShmGroup::kReduced, s);
    for (int j = 0; j < n && (root < 0 || root == me); ++j) {
      size_t jb = partBegin(m, n, j, align), je = partBegin(m, n, j + 1, align);
      if (je == jb || j == me) continue;
      g.wait(op, j, ShmGroup::kReduced, s);
      const char* h = g.gpuHalf(j, s) ? deviceHalves(c).peerHalf(op, j, s) : g.half(j, s);
      copies.add(cout + jb * es, h + jb * es, (je - jb) * es);
    }
    unconsumed = s;
  }
  copies.wait();
  if (unconsumed != 0) g.endStep(unconsumed);
}

// The flat exchange on GPU memory: the same steps as shmFlat. The input goes whole into this
// rank's half (its GPU half when it can: device to device); every rank reduces all halves into
// its output, on the device when every half is GPU memory, else on the CPU (reduceMixed).
void shmFlatDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                   size_t count, DataType t, ReduceOp rop, int root) {
  ShmGroup& g = *c.shm;
  const size_t bytes = count * dtypeSize(t);
  const bool out_gpu = DeviceStage::any({out});
  DeviceCopies copies(op.name);
  uint64_t s = g.beginStep(op, true);
  char* mine = deviceHalves(c).writeTarget(s, in);
  const bool mine_gpu = g.gpuHalf(c.rank, s);
  copies.add(mine, in, bytes);
  copies.wait();
  g.post(ShmGroup::kReady, s);
  if (root < 0 || root == c.rank) {
    g.waitAll(op, ShmGroup::kReady, s);
    StepSources src(c.size);
    src.build(c, op, s, mine, mine_gpu, 0);
    if (!(src.all_gpu && out_gpu &&
          copies.reduce(out, nullptr, src.p.data(), c.size, count, t, rop)))
      reduceMixed(op, out, out_gpu, nullptr, false, src, count, t, rop);
    copies.wait();
  }
  g.endStep(s);
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

void StepSources::build(Communicator::Impl& c, const OpCtx& op, uint64_t s, const void* mine,
                        bool mine_gpu, size_t at) {
  ShmGroup& g = *c.shm;
  all_gpu = true;
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank) {
      p[r] = mine;
      gpu[r] = mine_gpu;
    } else {
      gpu[r] = g.gpuHalf(r, s);
      p[r] = (gpu[r] ? deviceHalves(c).peerHalf(op, r, s) : g.half(r, s)) + at;
    }
    all_gpu = all_gpu && gpu[r];
  }
}

bool anyPeerOnGpu(Communicator::Impl& c, uint64_t s) {
  for (int r = 0; r < c.size; ++r)
    if (r != c.rank && c.shm->gpuHalf(r, s)) return true;
  return false;
}

void reduceMixed(const OpCtx& op, void* dst, bool dst_gpu, void* dst2, bool dst2_gpu,
                 const StepSources& src, size_t count, DataType t, ReduceOp rop) {
  const int n = static_cast<int>(src.p.size());
  const size_t bytes = count * dtypeSize(t);
  DeviceCopies copies(op.name);
  std::vector<std::vector<char>> tmp;
  tmp.reserve(n + 1);
  std::vector<const void*> hs(n);
  try {
    for (int r = 0; r < n; ++r) {
      if (!src.gpu[r]) {
        hs[r] = src.p[r];
        continue;
      }
      tmp.emplace_back(bytes);
      copies.add(tmp.back().data(), src.p[r], bytes);
      hs[r] = tmp.back().data();
    }
    copies.wait();
    tmp.emplace_back(bytes);
    char* res = tmp.back().data();
    reduceInto(res, nullptr, hs.data(), n, count, t, rop);
    for (auto [d, gpu] : {std::pair<void*, bool>{dst, dst_gpu}, {dst2, dst2_gpu}}) {
      if (d == nullptr) continue;
      if (gpu)
        copies.add(d, res, bytes);
      else
        std::memcpy(d, res, bytes);
    }
    copies.wait();
  } catch (...) {
    copies.drain();  // no queued copy may outlive tmp
    throw;
  }
}



void allReduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
               DataType t, ReduceOp rop) {
  run(c, op, in, out, count, t, rop, -1);
}

namespace {
bool onDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
              DataType t, ReduceOp rop, int root) {
  if (!c.shm || c.size == 1) return false;
  if (count == 0) return true;
  // The host path's choice (run()), so that host and GPU buffers of different ranks meet in
  // the same steps.
  const size_t bytes = count * dtypeSize(t);
  if (bytes <= c.params.flat_bytes && bytes <= c.shm->halfBytes())
    shmFlatDevice(c, op, in, out, count, t, rop, root);
  else
    shmTwoPhaseDevice(c, op, in, out, count, t, rop, root);
  return true;
}
}  // namespace

bool allReduceOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                       size_t count, DataType t, ReduceOp rop) {
  if (c.shm || !c.local || rop == ReduceOp::kAvg) return onDevice(c, op, in, out, count, t, rop, -1);
  // A group spanning hosts (hierAllReduce's steps): reduce onto the host's leader on the
  // device (GPU halves, device reductions), the leaders' allreduce between hosts through a
  // host buffer (the messages are host memory), broadcast back on the device. Only leaders'
  // bytes cross host memory, once each way.
  if (count == 0) return true;
  Communicator::Impl& local = *c.local;
  const size_t bytes = count * dtypeSize(t);
  if (local.size > 1) {
    if (!reduceOnDevice(local, op, in, out, count, t, rop, 0)) return false;
  } else if (in != out) {
    DeviceCopies copies(op.name);
    copies.add(out, in, bytes);
    copies.wait();
  }
  if (c.leaders) {
    DeviceStage st("allreduce", bytes);
    st.in(out, bytes);
    run(*c.leaders, op, st.host(), st.host(), count, t, rop, -1);
    st.out(out, bytes);
  }
  if (local.size > 1) (void)broadcastOnDevice(local, op, out, bytes, 0);
  return true;
}

bool reduceOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                    size_t count, DataType t, ReduceOp rop, int root) {
  return onDevice(c, op, in, c.rank == root ? out : nullptr, count, t, rop, root);
}

void reduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
            DataType t, ReduceOp rop, int root) {
  run(c, op, in, out, count, t, rop, root);
}

}  // namespace mooncake::pg::algo
