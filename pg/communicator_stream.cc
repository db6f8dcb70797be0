// Communicator's stream-ordered entry points (pg/stream_ops.h, docs/gpu.md "Stream-ordered
// collectives"): checks, whether the op takes the path, and the StreamOp the caller waits on.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "pg/comm_checks.h"
#include "pg/comm_impl.h"
#include "pg/communicator.h"
#include "pg/stream_ops.h"
#include "pg/stream_p2p.h"

namespace mooncake::pg {

namespace {

struct StreamOpTicket final : Communicator::StreamOp {
  StreamOps* owner;
  std::shared_ptr<StreamOps::Ticket> t;
  bool waited = false;
  void wait() override {
    if (waited) return;
    waited = true;
    owner->finish(*t);
  }
  Status orderAfter(const void* stream) override { return owner->orderAfter(*t, stream); }
};

// The device layer when the group's GPU ops may take a stream-ordered path at all (a plain
// same-host group, MC_PG_STREAM_OPS, the layer: auto takes CUDA's only); else null.
engine::device::Device* streamLayer(const Communicator::Impl& c) {
  using Mode = PgParams::StreamOpsMode;
  if (c.params.stream_ops == Mode::kOff || c.elastic || !c.shm || c.size < 2 ||
      !engine::device::active())
    return nullptr;
  auto layer = engine::device::get();
  if (!layer.ok()) return nullptr;
  if (c.params.stream_ops == Mode::kAuto && std::string((*layer)->name()) != "cuda")
    return nullptr;
  return *layer;
}

// A StreamOp (Op: StreamOpTicket, StreamP2pOp) of `owner`'s ticket t; null for none.
template <typename Op, typename Owner, typename T>
std::shared_ptr<Communicator::StreamOp> wrapTicket(Owner* owner, std::shared_ptr<T> t) {
  if (!t) return nullptr;
  auto r = std::make_shared<Op>();
  r->owner = owner;
  r->t = std::move(t);
  return r;
}

// The group's StreamOps when an op of `bytes` on GPU memory takes the stream-ordered path
// (pg/stream_ops.h); else null. `decide`: buffers every rank has (so that every rank decides
// alike): all on one device, whose ordinal goes to *ordinal. `must`: this rank's other buffers
// (a root's), which must then lie on that device too. Buffers on several devices, or a root's
// not on the decided one, fail the group (CommError naming `op`): the peers, which decided
// alike without this rank's view, are waiting for it.
StreamOps* streamOpsFor(Communicator::Impl& c, const char* op, size_t bytes,
                        const std::vector<const void*>& decide, int* ordinal,
                        const std::vector<const void*>& must = {}, int hint = -1) {
  engine::device::Device* layer = bytes == 0 ? nullptr : streamLayer(c);
  if (layer == nullptr) return nullptr;
  *ordinal = decide.empty() ? hint : -1;
  if (decide.empty() && hint < 0) return nullptr;
  StreamOps* ops = nullptr;
  {
    std::lock_guard<std::mutex> g(c.stream_ops_mu);
    if (!c.stream_ops) c.stream_ops = std::make_unique<StreamOps>(c);
    ops = c.stream_ops.get();
  }
  if (ops->unusable()) return nullptr;  // host-driven on every rank: nothing to refuse
  auto refuse = [&](const std::string& why) {
    CommError e("mooncake pg: " + std::string(op) + " on rank " + std::to_string(c.rank) + ": " +
                    why + " (MC_PG_STREAM_OPS=0 runs GPU collectives host-driven, which takes "
                    "them)",
                -1, op);
    c.breakOn(e);
    throw e;
  };
  std::vector<engine::device::PointerInfo> infos;
  for (const void* p : decide) {
    infos.push_back(layer->pointer(p));
    if (!infos.back().device) return nullptr;  // host memory among them: the host-driven op
  }
  for (const engine::device::PointerInfo& i : infos) {
    if (*ordinal >= 0 && i.ordinal != *ordinal)
      refuse("its buffers are on GPUs " + std::to_string(*ordinal) + " and " +
             std::to_string(i.ordinal) + "; a stream-ordered op takes one GPU");
    *ordinal = i.ordinal;
  }
  for (const void* p : must) {
    const engine::device::PointerInfo i = layer->pointer(p);
    if (!i.device || i.ordinal != *ordinal)
      refuse("the root's buffers must be GPU memory of the input's device (" +
             std::to_string(*ordinal) + ") when the op is stream-ordered");
  }
  return ops;
}

std::shared_ptr<Communicator::StreamOp> wrap(StreamOps* ops,
                                             std::shared_ptr<StreamOps::Ticket> tk) {
  return wrapTicket<StreamOpTicket>(ops, std::move(tk));
}

// Buffers `a` and `b` of `len` bytes each: apart, or (same_ok) at the same place.
void checkApart(const char* op, const void* a, const char* a_name, const void* b,
                const char* b_name, size_t len, bool same_ok) {
  if (apart(a, len, b, len) || (same_ok && a == b)) return;
  throw std::invalid_argument("mooncake pg: " + std::string(op) + ": " + a_name + " overlaps " +
                              b_name);
}

std::vector<void*> blocksOf(void* base, size_t block, int n) {
  std::vector<void*> v(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) v[static_cast<size_t>(r)] = static_cast<char*>(base) + r * block;
  return v;
}

std::vector<const void*> blocksOf(const void* base, size_t block, int n) {
  std::vector<const void*> v(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    v[static_cast<size_t>(r)] = static_cast<const char*>(base) + r * block;
  return v;
}

void checkBlocks(size_t have, const Communicator::Impl& c, const char* what, const char* op) {
  if (have != static_cast<size_t>(c.size))
    throw std::invalid_argument("mooncake pg: " + std::string(op) + ": " + std::to_string(have) +
                                " " + what + " blocks for a group of " + std::to_string(c.size));
}

// A block list (one block of `bytes` per rank, `what` in errors) against one other buffer:
// every block there and apart from `one`, or at its very place where same_ok(rank).
template <typename P, typename SameOk>
void checkBlocksAgainst(const Communicator::Impl& c, const char* op, const std::vector<P>& blocks,
                        const char* what, const char* block_name, const void* one,
                        const char* one_name, size_t bytes, SameOk same_ok) {
  checkBlocks(blocks.size(), c, what, op);
  for (int r = 0; r < c.size; ++r) {
    checkPtr(blocks[static_cast<size_t>(r)], bytes, what, op);
    checkApart(op, blocks[static_cast<size_t>(r)], block_name, one, one_name, bytes, same_ok(r));
  }
}

template <typename T>
std::vector<const void*> plus(std::vector<const void*> v, const std::vector<T*>& more) {
  v.insert(v.end(), more.begin(), more.end());
  return v;
}

}  // namespace

std::shared_ptr<Communicator::StreamOp> Communicator::allReduceOnStream(const void* in,
                                                                        void* out, size_t count,
                                                                        DataType t, ReduceOp op,
                                                                        const void* stream) {
  checkReduce(t, op, "allreduce");
  checkPtr(in, count, "input", "allreduce");
  checkPtr(out, count, "output", "allreduce");
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, "allreduce", count * dtypeSize(t), {in, out}, &ordinal);
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->allReduce(in, out, count, t, op,
                                  typedSig(OpKind::kAllReduce, count, t, op), ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::allGatherOnStream(const void* in,
                                                                        void* out, size_t bytes,
                                                                        const void* stream) {
  checkPtr(out, bytes, "output", "allgather");
  return allGatherOnStream(in, blocksOf(out, bytes, impl_->size), bytes, stream);
}

std::shared_ptr<Communicator::StreamOp> Communicator::allGatherOnStream(
    const void* in, const std::vector<void*>& outs, size_t bytes, const void* stream) {
  const char* op = "allgather";
  checkPtr(in, bytes, "input", op);
  checkBlocksAgainst(*impl_, op, outs, "output", "an output block", in, "the input", bytes,
                     [&](int r) { return r == impl_->rank; });
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, op, bytes, plus({in}, outs), &ordinal);
  if (ops == nullptr) return nullptr;
  return wrap(ops,
              ops->allGather(in, outs, bytes, bytesSig(OpKind::kAllGather, bytes), ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::gatherOnStream(
    const void* in, const std::vector<void*>& outs, size_t bytes, int root, const void* stream) {
  const char* op = "gather";
  checkRoot(*impl_, root, op);
  checkPtr(in, bytes, "input", op);
  const bool is_root = impl_->rank == root;
  if (is_root)
    checkBlocksAgainst(*impl_, op, outs, "output", "an output block", in, "the input", bytes,
                       [&](int r) { return r == root; });
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, op, bytes, {in}, &ordinal,
                                is_root ? plus({}, outs) : std::vector<const void*>{});
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->gather(in, outs, bytes, root, bytesSig(OpKind::kGather, bytes, root),
                               ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::broadcastOnStream(void* buf, size_t bytes,
                                                                        int root,
                                                                        const void* stream) {
  checkRoot(*impl_, root, "broadcast");
  checkPtr(buf, bytes, "buffer", "broadcast");
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, "broadcast", bytes, {buf}, &ordinal);
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->broadcast(buf, bytes, root, bytesSig(OpKind::kBroadcast, bytes, root),
                                  ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::scatterOnStream(
    const std::vector<const void*>& ins, void* out, size_t bytes, int root, const void* stream) {
  const char* op = "scatter";
  checkRoot(*impl_, root, op);
  checkPtr(out, bytes, "output", op);
  const bool is_root = impl_->rank == root;
  if (is_root)
    checkBlocksAgainst(*impl_, op, ins, "input", "an input block", out, "the output", bytes,
                       [&](int j) { return j == root; });
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, op, bytes, {out}, &ordinal,
                                is_root ? ins : std::vector<const void*>{});
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->scatter(ins, out, bytes, root, bytesSig(OpKind::kScatter, bytes, root),
                                ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::reduceOnStream(const void* in, void* out,
                                                                     size_t count, DataType t,
                                                                     ReduceOp op, int root,
                                                                     const void* stream) {
  const char* name = "reduce";
  checkReduce(t, op, name);
  checkRoot(*impl_, root, name);
  const size_t bytes = count * dtypeSize(t);
  checkPtr(in, bytes, "input", name);
  const bool is_root = impl_->rank == root;
  if (is_root) {
    checkPtr(out, bytes, "output", name);
    checkApart(name, out, "the output", in, "the input", bytes, true);
  }
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, name, bytes, {in}, &ordinal,
                                is_root ? std::vector<const void*>{out} : std::vector<const void*>{});
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->reduce(in, out, count, t, op, root,
                               typedSig(OpKind::kReduce, count, t, op, root), ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::reduceScatterOnStream(
    const void* in, void* out, size_t count, DataType t, ReduceOp op, const void* stream) {
  checkPtr(in, count, "input", "reduce_scatter");
  return reduceScatterOnStream(blocksOf(in, count * dtypeSize(t), impl_->size), out, count, t,
                               op, stream);
}

std::shared_ptr<Communicator::StreamOp> Communicator::reduceScatterOnStream(
    const std::vector<const void*>& ins, void* out, size_t count, DataType t, ReduceOp op,
    const void* stream) {
  const char* name = "reduce_scatter";
  checkReduce(t, op, name);
  const size_t bytes = count * dtypeSize(t);
  checkPtr(out, bytes, "output", name);
  // (out == ins[j] is safe for any j: a step reads its piece of every block before it writes
  // that piece of out, and later steps read later pieces)
  checkBlocksAgainst(*impl_, name, ins, "input", "an input block", out, "the output", bytes,
                     [](int) { return true; });
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, name, bytes, plus({out}, ins), &ordinal);
  if (ops == nullptr) return nullptr;
  return wrap(ops, ops->reduceScatter(ins, out, count, t, op,
                                      typedSig(OpKind::kReduceScatter, count, t, op), ordinal,
                                      stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::allToAllOnStream(const void* in, void* out,
                                                                       size_t block,
                                                                       const void* stream) {
  checkPtr(in, block, "input", "alltoall");
  checkPtr(out, block, "output", "alltoall");
  const size_t all = block * static_cast<size_t>(impl_->size);
  if (!apart(in, all, out, all))
    throw std::invalid_argument("mooncake pg: alltoall: input and output buffers overlap");
  return allToAllOnStream(blocksOf(in, block, impl_->size), blocksOf(out, block, impl_->size),
                          block, stream);
}

std::shared_ptr<Communicator::StreamOp> Communicator::allToAllOnStream(
    const std::vector<const void*>& ins, const std::vector<void*>& outs, size_t block,
    const void* stream) {
  const char* op = "alltoall";
  checkBlocks(ins.size(), *impl_, "input", op);
  checkBlocks(outs.size(), *impl_, "output", op);
  for (const void* i : ins) checkPtr(i, block, "input", op);
  for (void* o : outs) {
    checkPtr(o, block, "output", op);
    for (const void* i : ins) checkApart(op, o, "an output block", i, "an input block", block, false);
  }
  int ordinal = -1;
  StreamOps* ops = streamOpsFor(*impl_, op, block, plus(ins, outs), &ordinal);
  if (ops == nullptr) return nullptr;
  return wrap(ops,
              ops->allToAll(ins, outs, block, bytesSig(OpKind::kAllToAll, block), ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::allToAllVOnStream(
    const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
    void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
    const void* stream, int ordinal_hint) {
  const size_t n = static_cast<size_t>(impl_->size);
  (void)checkSplits(n, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets);
  std::vector<const void*> ins(n);
  std::vector<void*> outs(n);
  for (size_t j = 0; j < n; ++j) {
    ins[j] = send_bytes[j] > 0 ? static_cast<const char*>(in) + send_offsets[j] : nullptr;
    outs[j] = recv_bytes[j] > 0 ? static_cast<char*>(out) + recv_offsets[j] : nullptr;
  }
  return allToAllVOnStream(ins, send_bytes, outs, recv_bytes, stream, ordinal_hint);
}

std::shared_ptr<Communicator::StreamOp> Communicator::allToAllVOnStream(
    const std::vector<const void*>& ins, const std::vector<size_t>& send_bytes,
    const std::vector<void*>& outs, const std::vector<size_t>& recv_bytes, const void* stream,
    int ordinal_hint) {
  const char* op = "alltoall";
  checkBlocks(ins.size(), *impl_, "input", op);
  checkBlocks(outs.size(), *impl_, "output", op);
  checkBlocks(send_bytes.size(), *impl_, "send size", op);
  checkBlocks(recv_bytes.size(), *impl_, "receive size", op);
  std::vector<const void*> decide;  // the non-empty blocks
  for (size_t j = 0; j < ins.size(); ++j) {
    checkPtr(ins[j], send_bytes[j], "input", op);
    if (send_bytes[j] > 0) decide.push_back(ins[j]);
  }
  for (size_t r = 0; r < outs.size(); ++r) {
    checkPtr(outs[r], recv_bytes[r], "output", op);
    if (recv_bytes[r] == 0) continue;
    decide.push_back(outs[r]);
    for (size_t j = 0; j < ins.size(); ++j)
      if (send_bytes[j] > 0 && !apart(outs[r], recv_bytes[r], ins[j], send_bytes[j]))
        throw std::invalid_argument("mooncake pg: alltoall: an output block overlaps an input "
                                    "block");
  }
  int ordinal = -1;
  // (bytes: 1, not this rank's total: a rank that sends and receives nothing takes part too)
  StreamOps* ops = streamOpsFor(*impl_, op, 1, decide, &ordinal, {}, ordinal_hint);
  if (ops == nullptr) return nullptr;
  OpSig sig = bytesSig(OpKind::kAllToAll, 0);
  return wrap(ops, ops->allToAllV(ins, send_bytes, outs, recv_bytes, sig, ordinal, stream));
}

namespace {

struct StreamP2pOp final : Communicator::StreamOp {
  StreamP2p* owner;
  std::shared_ptr<StreamP2p::Ticket> t;
  std::atomic<bool> waited{false};
  void wait() override {
    if (waited.exchange(true)) return;  // (once: a failure is thrown to the first waiter)
    owner->finish(*t);
  }
  Status orderAfter(const void* stream) override { return owner->orderAfter(*t, stream); }
};

// The group's StreamP2p when a send/recv of `bytes` at buf with `peer` takes the stream-ordered
// path (pg/stream_p2p.h); else null (the host-driven send/recv, which also rejects bad ranks).
// Both ends decide alike from what each knows: the group, the mode, that the buffer is GPU
// memory (an empty one's device: hint).
StreamP2p* streamP2pFor(Communicator::Impl& c, const void* buf, size_t bytes, int peer, int hint,
                        int* ordinal) {
  if (c.size > ShmGroup::kP2pMaxRanks || peer < 0 || peer >= c.size || peer == c.rank)
    return nullptr;
  engine::device::Device* layer = streamLayer(c);
  if (layer == nullptr) return nullptr;
  *ordinal = hint;
  if (bytes > 0) {
    const engine::device::PointerInfo i = layer->pointer(buf);
    if (!i.device) return nullptr;
    *ordinal = i.ordinal;
  }
  if (*ordinal < 0) return nullptr;
  std::lock_guard<std::mutex> g(c.stream_ops_mu);
  if (!c.stream_p2p) c.stream_p2p = std::make_unique<StreamP2p>(c);
  return c.stream_p2p.get();
}

std::shared_ptr<Communicator::StreamOp> wrapP2p(StreamP2p* p2p,
                                                std::shared_ptr<StreamP2p::Ticket> t) {
  return wrapTicket<StreamP2pOp>(p2p, std::move(t));
}

}  // namespace

std::shared_ptr<Communicator::StreamOp> Communicator::sendOnStream(const void* buf, size_t bytes,
                                                                   int dst, uint64_t tag,
                                                                   const void* stream,
                                                                   int ordinal) {
  checkPtr(buf, bytes, "buffer", "send");
  StreamP2p* p2p = streamP2pFor(*impl_, buf, bytes, dst, ordinal, &ordinal);
  if (p2p == nullptr) return nullptr;
  return wrapP2p(p2p, p2p->send(buf, bytes, dst, tag, ordinal, stream));
}

std::shared_ptr<Communicator::StreamOp> Communicator::recvOnStream(void* buf, size_t bytes,
                                                                   int src, uint64_t tag,
                                                                   const void* stream,
                                                                   int ordinal) {
  checkPtr(buf, bytes, "buffer", "recv");
  StreamP2p* p2p = streamP2pFor(*impl_, buf, bytes, src, ordinal, &ordinal);
  if (p2p == nullptr) return nullptr;
  return wrapP2p(p2p, p2p->recv(buf, bytes, src, tag, ordinal, stream));
}

uint64_t Communicator::streamOps() const {
  std::lock_guard<std::mutex> g(impl_->stream_ops_mu);
  return (impl_->stream_ops ? impl_->stream_ops->issued() : 0) +
         (impl_->stream_p2p ? impl_->stream_p2p->issued() : 0);
}

}  // namespace mooncake::pg
