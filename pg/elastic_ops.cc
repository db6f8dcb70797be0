// Elastic groups: the ops. Arguments are indexed by slot; each op runs on the data plane of
// the applied view (an Impl over the active slots, compact ranks), so the algorithms are the
// plain groups' own. Gathered outputs and all-to-all outputs hold `size` blocks: an inactive
// slot's block (a hole) is zero-filled. Rank-indexed inputs (reduce_scatter, scatter) are
// compacted around holes before the algorithm runs (a copy, only when there are holes).
#include <algorithm>
#include <cstring>
#include <numeric>

#include "engine/log.h"
#include "pg/elastic.h"

namespace mooncake::pg {

using engine::Clock;
using std::chrono::milliseconds;

namespace {
milliseconds opTimeout(const CommOptions& o, std::chrono::microseconds cap) {
  return std::min(o.timeout, std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(cap)));
}
// Moves n blocks gathered back to back at the front of `out` to their slots' places (block i
// belongs to slot slots[i] at displ[slots[i]]; compact places never exceed slot places, so
// moving from the last block down is safe in place), and zero-fills the holes.
void spread(char* out, const std::vector<int>& slots, const std::vector<size_t>& bytes,
            const std::vector<int>& index) {
  const size_t n = slots.size();
  std::vector<size_t> displ(bytes.size() + 1, 0), cdispl(n + 1, 0);
  for (size_t s = 0; s < bytes.size(); ++s) displ[s + 1] = displ[s] + bytes[s];
  for (size_t i = 0; i < n; ++i) cdispl[i + 1] = cdispl[i] + bytes[slots[i]];
  for (size_t i = n; i-- > 0;) {
    const size_t b = bytes[slots[i]];
    if (b > 0 && displ[slots[i]] != cdispl[i]) std::memmove(out + displ[slots[i]], out + cdispl[i], b);
  }
  for (size_t s = 0; s < bytes.size(); ++s)
    if (index[s] < 0 && bytes[s] > 0) std::memset(out + displ[s], 0, bytes[s]);
}
bool dense(const std::vector<int>& slots) {
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i] != static_cast<int>(i)) return false;
  return true;
}
}  // namespace

std::vector<uint8_t> Elastic::hintOf(const std::vector<int>& slots) const {
  std::vector<uint8_t> h(max_size_, 0);
  for (int s : slots)
    if (s >= 0 && s < max_size_ && s != slot_) h[s] = 1;
  return h;
}

// op_mu_ held. Applies decided views, then either returns the plane to run on or throws
// (PeerFailure: the op did not run, as evidence; CommError: this rank cannot run ops).
const Elastic::Plane& Elastic::enter(const char* name, int blocks) {
  auto who = [&] {
    return std::string("mooncake pg: ") + name + " on rank " + std::to_string(slot_) +
           " (group " + name_ + ", epoch " + std::to_string(applied_epoch_.load()) + ")";
  };
  if (quiescing_.load())
    throw CommError(who() + ": rank is quiescing and cannot issue operations (join_group)",
                    -1, name);
  if (applied_epoch_.load() < latest_epoch_.load())
    applyAll(Clock::now() + std::chrono::duration_cast<milliseconds>(collectiveTimeout()));
  if (skip_ > 0) {
    --skip_;
    throw PeerFailure(who() + " did not run: the group moved to a new view, and the other "
                              "members had run it in the previous one",
                      skip_hint_, name);
  }
  if (!plane_.impl)
    throw CommError(who() + ": this rank is not an active member; call join_group() and wait "
                            "for an activation",
                    -1, name);
  Communicator::Impl& c = *plane_.impl;
  // This call is the view's op count_ whether it runs or fails below: the others may have run
  // it, or failed it in the op, and the next view barrier must pair the ranks' next ops.
  ++count_;
  if (blocks >= 0 && blocks != plane_.size) {
    // The caller sized its buffers before a view change: no rank can run it; fail it as a
    // failure of this view (the others see the abort and fail it too).
    c.abortGroups(-1, "the group's size changed");
    broken_ = true;
    broken_flag_ = true;
    broken_hint_.assign(max_size_, 0);
    wake();
    throw PeerFailure(who() + ": its buffers hold " + std::to_string(blocks) +
                          " rank blocks but the group's size is now " +
                          std::to_string(plane_.size) + " (the view changed after the call)",
                      broken_hint_, name);
  }
  if (broken_)
    throw PeerFailure(who() + ": an earlier op failed in this view; the group needs a "
                              "reconciliation (sync_after_failure) or a membership change first",
                      broken_hint_, name);
  // Members known dead: fail at once (no rank waits on them); the abort tells the others.
  const uint64_t events = gone_events_.load();
  const int64_t since = Clock::now().time_since_epoch().count() - gone_at_ns_.load();
  if (events != gone_seen_ || since < 100'000'000) {
    gone_seen_ = events;
    std::vector<int> dead;
    for (int i = 0; i < c.size; ++i)
      if (i != c.rank && c.peers[i] != engine::kInvalidPeer &&
          !c.engine->peerStatus(c.peers[i]).ok())
        dead.push_back(plane_.slots[i]);
    if (!dead.empty()) {
      c.abortGroups(dead[0], "rank " + std::to_string(dead[0]) + " is dead");
      broken_ = true;
      broken_flag_ = true;
      broken_hint_ = hintOf(dead);
      wake();
      std::string list;
      for (int s : dead) list += (list.empty() ? "" : ", ") + std::to_string(s);
      PeerFailure f(who() + ": rank(s) " + list + " of this view are dead", broken_hint_, name);
      if (eo_.auto_sync_on_failure) {
        try {
          syncImpl(true);
        } catch (const std::exception& e) {
          MC_LOG(WARN, PG) << "group " << name_ << ": sync after failure: " << e.what();
        }
      }
      throw f;
    }
  }
  return plane_;
}

void Elastic::failed(const OpCtx& op, const CommError& e) {
  Communicator::Impl& c = *plane_.impl;
  std::vector<int> slots;
  if (e.peerRank() >= 0) slots.push_back(e.peerRank());
  for (int i = 0; i < c.size; ++i)
    if (i != c.rank && c.peers[i] != engine::kInvalidPeer && !c.engine->peerStatus(c.peers[i]).ok())
      slots.push_back(plane_.slots[i]);
  c.abortGroups(e.peerRank(), e.what());
  broken_ = true;
  broken_flag_ = true;
  broken_hint_ = hintOf(slots);
  wake();  // auto_deactivate: the agent reconciles
  if (dynamic_cast<const MismatchError*>(&e) != nullptr) throw;  // a program error: raise it
  PeerFailure f(e.what(), broken_hint_, op.name);
  MC_LOG(INFO, PG) << "group " << name_ << " slot " << slot_ << ": " << e.what();
  if (eo_.auto_sync_on_failure) {
    try {
      syncImpl(true);
    } catch (const std::exception& x) {
      MC_LOG(WARN, PG) << "group " << name_ << ": sync after failure: " << x.what();
    }
  }
  throw f;
}

template <class Fn>
void Elastic::collective(const char* name, const OpSig& sig, int blocks, Fn&& fn) {
  std::lock_guard<std::mutex> lk(op_mu_);
  const Plane& p = enter(name, blocks);
  const milliseconds t = opTimeout(root_.opts, collectiveTimeout());
  OpCtx op{name, Clock::now() + t, count_, t, sig};
  try {
    fn(*p.impl, op, p);
    p.impl->finishOps(op);
  } catch (const UsageError&) {
    throw;  // every rank raises it at the same point: the view stays usable
  } catch (const CommError& e) {
    failed(op, e);
  }
}

void Elastic::allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp rop,
                        const OpSig& sig) {
  collective("allreduce", sig, -1, [&](Communicator::Impl& c, const OpCtx& o, const Plane&) {
    algo::allReduce(c, o, in, out, count, t, rop);
  });
}

namespace {
int compactRoot(const std::vector<int>& index, int root, const char* op) {
  if (root < 0 || root >= static_cast<int>(index.size()) || index[root] < 0)
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": root rank " +
                                std::to_string(root) + " is not an active member");
  return index[root];
}
}  // namespace

void Elastic::reduce(const void* in, void* out, size_t count, DataType t, ReduceOp rop, int root,
                     const OpSig& sig) {
  collective("reduce", sig, -1, [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
    algo::reduce(c, o, in, out, count, t, rop, compactRoot(p.index, root, "reduce"));
  });
}

void Elastic::broadcast(void* buf, size_t bytes, int root, const OpSig& sig) {
  collective("broadcast", sig, -1, [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
    algo::broadcast(c, o, buf, bytes, compactRoot(p.index, root, "broadcast"));
  });
}

void Elastic::allGatherV(const void* in, void* out, const std::vector<size_t>& bytes,
                         const char* name, const OpSig& sig) {
  collective(name, sig, static_cast<int>(bytes.size()),
             [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
               std::vector<size_t> compact;
               for (int s : p.slots) compact.push_back(bytes[s]);
               algo::allGatherV(c, o, in, out, compact);
               if (!dense(p.slots) || p.slots.size() != bytes.size())
                 spread(static_cast<char*>(out), p.slots, bytes, p.index);
             });
}

void Elastic::gather(const void* in, void* out, size_t bytes, int root, int blocks,
                     const OpSig& sig) {
  collective("gather", sig, blocks, [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
    const int croot = compactRoot(p.index, root, "gather");
    algo::gather(c, o, in, out, bytes, croot);
    if (c.rank == croot && (!dense(p.slots) || static_cast<int>(p.slots.size()) != p.size))
      spread(static_cast<char*>(out), p.slots, std::vector<size_t>(p.size, bytes), p.index);
  });
}

void Elastic::scatter(const void* in, void* out, size_t bytes, int root, int blocks,
                      const OpSig& sig) {
  collective("scatter", sig, blocks, [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
    const int croot = compactRoot(p.index, root, "scatter");
    const void* src = in;
    if (c.rank == croot && !dense(p.slots)) {
      scratch_.resize(p.slots.size() * bytes);
      for (size_t i = 0; i < p.slots.size(); ++i)
        std::memcpy(scratch_.data() + i * bytes, static_cast<const char*>(in) + p.slots[i] * bytes,
                    bytes);
      src = scratch_.data();
    }
    algo::scatter(c, o, src, out, bytes, croot);
  });
}

void Elastic::reduceScatter(const void* in, void* out, size_t count, DataType t, ReduceOp rop,
                            int blocks, const OpSig& sig) {
  collective("reduce_scatter", sig, blocks,
             [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
               const void* src = in;
               const size_t b = count * dtypeSize(t);
               if (!dense(p.slots)) {
                 scratch_.resize(p.slots.size() * b);
                 for (size_t i = 0; i < p.slots.size(); ++i)
                   std::memcpy(scratch_.data() + i * b,
                               static_cast<const char*>(in) + p.slots[i] * b, b);
                 src = scratch_.data();
               }
               algo::reduceScatter(c, o, src, out, count, t, rop);
             });
}

void Elastic::allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                        const std::vector<size_t>& send_offsets, void* out,
                        const std::vector<size_t>& recv_bytes,
                        const std::vector<size_t>& recv_offsets, const OpSig& sig) {
  collective("alltoall", sig, static_cast<int>(send_bytes.size()),
             [&](Communicator::Impl& c, const OpCtx& o, const Plane& p) {
               std::vector<size_t> sb, so, rb, ro;
               for (int s : p.slots) {
                 sb.push_back(send_bytes[s]);
                 so.push_back(send_offsets[s]);
                 rb.push_back(recv_bytes[s]);
                 ro.push_back(recv_offsets[s]);
               }
               algo::allToAllV(c, o, in, sb, so, out, rb, ro);
               for (size_t s = 0; s < recv_bytes.size(); ++s)
                 if (p.index[s] < 0 && recv_bytes[s] > 0)
                   std::memset(static_cast<char*>(out) + recv_offsets[s], 0, recv_bytes[s]);
             });
}

void Elastic::barrier(const OpSig& sig) {
  collective("barrier", sig, -1,
             [&](Communicator::Impl& c, const OpCtx& o, const Plane&) { algo::barrier(c, o); });
}

// ---- point to point: no op lock (any thread), the p2p table follows the applied view ----

void Elastic::p2pFailed(const char* op, int peer, const CommError& e) {
  std::vector<int> slots{peer};
  if (e.peerRank() >= 0 && e.peerRank() != peer) slots.push_back(e.peerRank());
  PeerFailure f(e.what(), hintOf(slots), op);
  wake();
  if (eo_.auto_sync_on_failure) {
    try {
      syncImpl(false);
    } catch (const std::exception& x) {
      MC_LOG(WARN, PG) << "group " << name_ << ": sync after failure: " << x.what();
    }
  }
  throw f;
}

void Elastic::send(const void* buf, size_t bytes, int dst, uint64_t tag) {
  if (quiescing_.load())
    throw CommError("mooncake pg: send on rank " + std::to_string(slot_) + " (group " + name_ +
                        "): rank is quiescing and cannot issue operations (join_group)",
                    -1, "send");
  try {
    root_.p2p->send(buf, bytes, dst, tag, opTimeout(root_.opts, p2pTimeout()));
  } catch (const PeerFailure&) {
    throw;
  } catch (const MismatchError&) {
    throw;  // a program error (a receive buffer of the wrong size), not a peer's failure
  } catch (const CommError& e) {
    p2pFailed("send", dst, e);
  }
}

int Elastic::recv(void* buf, size_t bytes, int src, uint64_t tag) {
  if (quiescing_.load())
    throw CommError("mooncake pg: recv on rank " + std::to_string(slot_) + " (group " + name_ +
                        "): rank is quiescing and cannot issue operations (join_group)",
                    -1, "recv");
  try {
    return root_.p2p->recv(buf, bytes, src, tag, opTimeout(root_.opts, p2pTimeout()));
  } catch (const PeerFailure&) {
    throw;
  } catch (const MismatchError&) {
    throw;  // a program error (a receive buffer of the wrong size), not a peer's failure
  } catch (const CommError& e) {
    p2pFailed("recv", src, e);
  }
}

}  // namespace mooncake::pg
