// Communicator: set-up (segment exchange, comm buffer, peer mapping), the op entry points
// (validate -> run on the calling thread with a deadline), enqueue, and teardown.
#include "pg/communicator.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

#include "engine/log.h"
#include "engine/params.h"
#include "engine/wire.h"
#include "pg/comm_checks.h"
#include "pg/comm_impl.h"
#include "pg/device_stage.h"
#include "pg/elastic.h"
#include "pg/profile.h"

namespace mooncake::pg {

using engine::Clock;
using engine::Deadline;
using engine::PeerId;

namespace {

[[noreturn]] void setupFailed(const CommOptions& o, const std::string& what, const Status& st,
                              int peer = -1) {
  throw CommError("mooncake pg: creating group " + o.group_name + " (rank " +
                      std::to_string(o.rank) + " of " + std::to_string(o.size) + "): " + what +
                      ": " + st.toString(),
                  peer, "init");
}

}  // namespace

// ---------------------------------------------------------------------------------------

void Communicator::Impl::finishOps(const OpCtx& op) {
  if (size == 1) return;
  bool used = false;
  if (shm) used |= shm->finishOp(op);
  if (net) used |= net->finishOp(op);
  if (local && local->shm) used |= local->shm->finishOp(op);
  if (leaders && leaders->net) used |= leaders->net->finishOp(op);
  if (used) return;
  if (shm)
    shm->barrierOp(op);
  else if (net)
    net->barrierOp(op);
}

template <class Fn>
void Communicator::Impl::run(const char* name, const OpSig& sig, Fn&& fn) {
  if (broken.load(std::memory_order_acquire)) throw alreadyFailed(name);
  profile::Scope timed(profile::kOp);
  OpCtx op{name, Clock::now() + opts.timeout, ++op_seq, opts.timeout, sig};  // timeout clamped
  try {
    fn(op);
    finishOps(op);
  } catch (const UsageError&) {
    throw;
  } catch (const PeerRejected&) {
    // A peer refused the op (Communicator::reject): realign with every rank, then raise it.
    // (Message groups need no resync: later ops drop the refused op's messages as they come;
    // the slots of those this rank took and dropped unread go back.)
    try {
      if (shm) shm->resync(op);
      if (net) net->releaseHeld();
    } catch (const CommError& f) {
      breakOn(f);
      throw;
    }
    throw;
  } catch (const CommError& e) {
    breakOn(e);
    throw;
  }
}

CommError Communicator::Impl::alreadyFailed(const char* op) {
  std::lock_guard<std::mutex> g(broken_mu);
  return CommError("mooncake pg: " + std::string(op) + " on group " + opts.group_name +
                       " that already failed: " + broken_what,
                   broken_rank, op);
}

void Communicator::Impl::breakOn(const CommError& e) {
  {
    std::lock_guard<std::mutex> g(broken_mu);
    if (!broken.load()) {
      broken_what = e.what();
      broken_rank = e.peerRank();
      broken.store(true, std::memory_order_release);
    }
  }
  abortGroups(e.peerRank(), e.what());
  MC_LOG(WARN, PG) << e.what();
}

void Communicator::Impl::abortGroups(int blamed, const std::string& why) {
  // Whether this rank's engine saw the blamed rank die (peers that hear of the failure only
  // through this abort then wait for their engines to agree: Health::aborted). Names are the
  // user's ranks: find the blamed one's index here.
  bool died = false;
  for (int r = 0; r < size && blamed >= 0; ++r)
    if (health && health->name(r) == blamed && r != rank && peers[r] != engine::kInvalidPeer)
      died = !engine->peerStatus(peers[r]).ok();
  if (shm) shm->abort(blamed, died);
  if (net) net->abort(blamed, why, died);
  if (local) local->shm->abort(blamed, died);
  if (leaders) leaders->net->abort(blamed, why, died);
}

Communicator::Impl::~Impl() {
  worker.reset();  // drains the queued ops and joins, while the groups they use still exist
  stream_ops.reset();  // (its buffers' descriptions live in shm's header)
  stream_p2p.reset();  // (the same)
  elastic.reset();  // stops the controller (its agent uses p2p and the engine) first
  p2p.reset();
  leaders.reset();
  local.reset();
  net.reset();
  shm.reset();
  for (uint32_t ch : channels) releaseChannel(engine.get(), ch);
  if (buffer != nullptr && engine) {
    Status st = engine->free(buffer);
    if (!st.ok()) {
      MC_LOG(WARN, PG) << "freeing the comm buffer: " << st.toString();
    }
  }
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::unique_ptr<Communicator> Communicator::create(std::shared_ptr<engine::TransferEngine> engine,
                                                   std::shared_ptr<engine::Rendezvous> rdv,
                                                   const CommOptions& options) {
  if (!engine || !rdv) throw std::invalid_argument("mooncake pg: create needs an engine and a rendezvous");
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size)
    throw std::invalid_argument("mooncake pg: rank " + std::to_string(options.rank) +
                                " is outside a group of size " + std::to_string(options.size));
  if (options.group_name.empty()) throw std::invalid_argument("mooncake pg: empty group name");
  if (options.timeout.count() <= 0) throw std::invalid_argument("mooncake pg: timeout must be > 0");
  if (options.elastic.enabled) validateElastic(options);
  const std::string& g_name = options.group_name;

  auto impl = std::make_unique<Impl>();
  Impl& c = *impl;
  c.engine = engine;
  c.rdv = rdv;
  c.opts = options;
  c.opts.timeout = std::min<std::chrono::milliseconds>(options.timeout, std::chrono::hours(24 * 365));
  c.rank = options.rank;
  c.size = options.size;
  c.params = PgParams::load(options.buffer_bytes);
  {
    // Receive slots of the non-shm path, per rank (per slot of an elastic group): allocated
    // when a group first takes that path. Pieces shrink so that they stay bounded.
    const int cap = options.elastic.enabled && options.elastic.max_group_size > 0
                        ? options.elastic.max_group_size
                        : options.size;
    const size_t piece_param = c.params.net_piece_bytes;
    c.params.net_piece_bytes = NetAreas::pieceBytes(piece_param, cap, c.params.net_slots);
    c.net_areas = std::make_shared<NetAreas>(cap, c.params.net_slots, c.params.net_piece_bytes);
  }
  const Deadline dl = Clock::now() + c.opts.timeout;

  uint32_t p2p_ch = channelFor("p2p", g_name);
  claimChannel(engine.get(), p2p_ch, g_name);
  c.channels.push_back(p2p_ch);

  // One registered buffer per rank for the group's lifetime: header page + two halves.
  size_t half = (c.params.buffer_bytes / 2 + 4095) & ~static_cast<size_t>(4095);
  c.buffer_bytes = ShmGroup::kHeaderBytes + 2 * half;
  auto mem = engine->allocate(c.buffer_bytes);
  if (!mem.ok()) setupFailed(options, "allocating the comm buffer", mem.status());
  c.buffer = *mem;
  std::memset(c.buffer, 0, c.buffer_bytes);  // fault the pages in now, not in the first op
  Status st = engine->publish(*rdv);
  if (!st.ok()) setupFailed(options, "publishing the segment", st);

  if (options.elastic.enabled) {
    createElastic(c, p2p_ch, dl);
    return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
  }

  // Keys of this incarnation of the group: a group re-created under the same name on the
  // same rendezvous (destroy + init again) must not read the previous incarnation's keys.
  // Every rank bumps its own counter once per incarnation, so all ranks agree on it.
  auto gen = rdv->add(g_name + "/gen/" + std::to_string(c.rank), 1);
  if (!gen.ok()) setupFailed(options, "rendezvous add", gen.status());
  const std::string g = g_name + "#" + std::to_string(*gen);

  RankRecord mine{engine->name(), engine->engineId(), reinterpret_cast<uint64_t>(c.buffer),
                  c.buffer_bytes, engine->localSegment().serialize()};
  st = rdv->set(g + "/rank/" + std::to_string(c.rank), mine.serialize());
  if (!st.ok()) setupFailed(options, "rendezvous set", st);

  // Open every peer and map its buffer where the transport allows it.
  c.peers.assign(c.size, engine::kInvalidPeer);
  std::vector<char*> bases(c.size, nullptr);
  bases[c.rank] = static_cast<char*>(c.buffer);
  std::vector<std::string> hosts(c.size);  // host id per rank (equal: may share memory)
  hosts[c.rank] = engine->localSegment().host_id;
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank) continue;
    auto blob = rdv->wait(g + "/rank/" + std::to_string(r), dl);
    if (!blob.ok()) setupFailed(options, "waiting for rank " + std::to_string(r), blob.status(), r);
    RankRecord rec;
    if (!RankRecord::parse(*blob, &rec))
      setupFailed(options, "rank " + std::to_string(r) + "'s record",
                  Status(Code::kProtocol, "malformed"), r);
    if (rec.engine_id == engine->engineId())
      setupFailed(options, "rank " + std::to_string(r),
                  Status(Code::kInvalidArgument, "uses this rank's engine (one engine per rank)"), r);
    auto desc = engine::SegmentDesc::parse(rec.segment);
    if (!desc.ok()) setupFailed(options, "rank " + std::to_string(r) + "'s segment", desc.status(), r);
    auto peer = engine->openPeer(*desc, dl);
    if (!peer.ok()) setupFailed(options, "opening rank " + std::to_string(r), peer.status(), r);
    c.peers[r] = *peer;
    hosts[r] = desc->host_id;
    // A different MC_PG_BUFFER_BYTES would make a different step layout: not mapped.
    if (rec.buffer_bytes == c.buffer_bytes)
      bases[r] = static_cast<char*>(engine->mappedAddress(*peer, rec.buffer, rec.buffer_bytes));
  }
  st = rdv->set(g + "/mode/" + std::to_string(c.rank), localMode(c.params, bases, hosts, c.rank));
  if (!st.ok()) setupFailed(options, "rendezvous set", st);
  std::vector<std::string> modes(c.size);
  for (int r = 0; r < c.size; ++r) {
    auto v = rdv->wait(g + "/mode/" + std::to_string(r), dl);
    if (!v.ok()) setupFailed(options, "waiting for rank " + std::to_string(r), v.status(), r);
    modes[r] = *v;
  }
  buildDataPlane(c, bases, hosts, modes, "", 0, {}, false);
  c.p2p = std::make_unique<P2p>(engine.get(), c.health.get(), c.peers, c.rank, p2p_ch,
                                c.params.wait.health_us, c.params.net_piece_bytes,
                                p2pArea(c), c.params.net_one_sided,
                                c.params.net_slot_min_bytes);
  c.p2p->start();
  MC_LOG(INFO, PG) << "group " << g << " rank " << c.rank << "/" << c.size << " ready on "
                   << c.path << ", buffer " << c.buffer_bytes
                   << " bytes, reduce kernels " << reduceIsa();
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

namespace {
thread_local uint8_t t_sig_dtype = 0;
}  // namespace
SigDtype::SigDtype(DataType t) : prev_(t_sig_dtype) {
  t_sig_dtype = static_cast<uint8_t>(static_cast<int>(t) + 1);
}
SigDtype::~SigDtype() { t_sig_dtype = prev_; }
uint8_t SigDtype::current() { return t_sig_dtype; }

// The size users see: one past the highest active slot in an elastic group.
int pubSize(const Communicator::Impl& c) { return c.elastic ? c.elastic->size() : c.size; }

namespace {
Elastic& elasticOf(const std::unique_ptr<Communicator::Impl>& c, const char* what) {
  if (!c->elastic)
    throw std::logic_error(std::string("mooncake pg: ") + what + " needs an elastic group "
                           "(CommOptions::elastic / pg_options=MooncakeBackendOptions(...))");
  return *c->elastic;
}
}  // namespace

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return pubSize(*impl_); }
const CommOptions& Communicator::options() const { return impl_->opts; }
engine::TransferEngine& Communicator::engine() { return *impl_->engine; }
engine::PeerId Communicator::peerOf(int rank) const {
  if (rank < 0 || rank >= impl_->size) throw std::invalid_argument("mooncake pg: peerOf: bad rank");
  if (impl_->elastic) return impl_->elastic->peerOf(rank);
  return impl_->peers[rank];
}
std::shared_ptr<engine::Rendezvous> Communicator::rendezvous() const { return impl_->rdv; }
std::vector<int> Communicator::deadRanks() const {
  if (impl_->elastic) return impl_->elastic->deadSlots();
  return impl_->health->deadRanks();
}
const std::string& Communicator::path() const {
  return impl_->elastic ? impl_->elastic->path() : impl_->path;
}

uint64_t Communicator::netSlotSends() const {
  return impl_->net_areas ? impl_->net_areas->slotSends() : 0;
}

uint64_t Communicator::p2pDeviceMessages() const {
  return impl_->p2p ? impl_->p2p->deviceMessages() : 0;
}

uint64_t Communicator::p2pHostStagedMessages() const {
  return impl_->p2p ? impl_->p2p->hostStagedMessages() : 0;
}

uint64_t Communicator::deviceHalfSteps() const {
  return impl_->dev_halves ? impl_->dev_halves->deviceSteps() : 0;
}

bool Communicator::elastic() const { return impl_->elastic != nullptr; }
int Communicator::maxGroupSize() const {
  return impl_->elastic ? impl_->elastic->maxSize() : impl_->size;
}
uint64_t Communicator::epoch() const { return elasticOf(impl_, "epoch").epoch(); }
std::vector<uint8_t> Communicator::activeMask() const {
  return elasticOf(impl_, "get_active_ranks").activeMask();
}
std::vector<uint8_t> Communicator::peerState(const std::vector<int>& slots) const {
  Elastic& e = elasticOf(impl_, "get_peer_state");
  for (int s : slots)
    if (s < 0 || s >= e.maxSize())
      throw std::invalid_argument("mooncake pg: get_peer_state: rank " + std::to_string(s) +
                                  " is outside the group's " + std::to_string(e.maxSize()) +
                                  " rank slots");
  return e.peerState(slots);
}
int Communicator::numSyncedRanks() const {
  return elasticOf(impl_, "get_num_synced_ranks").numSynced();
}
ProposalResult Communicator::activateRanks(const std::vector<int>& slots) {
  return elasticOf(impl_, "activate_ranks").activate(slots);
}
ProposalResult Communicator::deactivateRanks(const std::vector<int>& slots) {
  return elasticOf(impl_, "deactivate_ranks").deactivate(slots);
}
void Communicator::joinGroup() { elasticOf(impl_, "join_group").join(); }
SyncResult Communicator::syncAfterFailure() {
  return elasticOf(impl_, "sync_after_failure").sync();
}
void Communicator::onViewChange(std::function<void()> cb) {
  elasticOf(impl_, "onViewChange").onViewChange(std::move(cb));
}

void Communicator::fail(const char* op, const std::string& why) {
  impl_->breakOn(CommError("mooncake pg: " + std::string(op) + " on rank " +
                               std::to_string(impl_->rank) + " (group " +
                               impl_->opts.group_name + ") failed the group: " + why,
                           -1, op));
}

void Communicator::reject(const char* op, const std::string& why) {
  Impl& c = *impl_;
  if (c.elastic || c.local || (!c.shm && !c.net) || c.size == 1 || c.broken.load()) return;
  OpCtx o{op, Clock::now() + c.opts.timeout, ++c.op_seq, c.opts.timeout, OpSig{}};
  try {
    if (c.shm) {
      c.shm->reject(o, why);
      c.shm->resync(o);
    } else {
      c.net->reject(o, why);  // the peers drop what they sent in it (NetGroup::take)
    }
  } catch (const CommError& e) {
    c.breakOn(e);
    throw;
  }
}

std::shared_ptr<Work> Communicator::enqueue(std::string op_name, std::function<void()> fn) {
  return impl_->worker->enqueue(std::move(op_name), std::move(fn));
}


void Communicator::allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  checkReduce(t, op, "allreduce");
  checkPtr(in, count, "input", "allreduce");
  checkPtr(out, count, "output", "allreduce");
  if (DeviceStage::any({in, out})) {
    // One host, or hosts whose ranks map each other (not AVG: hierAllReduce's rule): the
    // device paths; else staged.
    if (!impl_->elastic && impl_->size > 1 &&
        (impl_->shm || (impl_->local && op != ReduceOp::kAvg)))
      return impl_->run("allreduce", typedSig(OpKind::kAllReduce, count, t, op),
                        [&](const OpCtx& o) {
                          (void)algo::allReduceOnDevice(*impl_, o, in, out, count, t, op);
                        });
    const size_t n = count * dtypeSize(t);
    DeviceStage st("allreduce", n);
    st.in(in, n);
    allReduce(st.host(), st.host(), count, t, op);
    return st.out(out, n);
  }
  if (impl_->elastic)
    return impl_->elastic->allReduce(in, out, count, t, op,
                                     typedSig(OpKind::kAllReduce, count, t, op));
  impl_->run("allreduce", typedSig(OpKind::kAllReduce, count, t, op),
             [&](const OpCtx& o) { algo::allReduce(*impl_, o, in, out, count, t, op); });
}

void Communicator::reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op,
                          int root) {
  checkReduce(t, op, "reduce");
  checkRoot(*impl_, root, "reduce");
  checkPtr(in, count, "input", "reduce");
  if (impl_->rank == root) checkPtr(out, count, "output", "reduce");
  if (DeviceStage::any({in, out})) {
    if (!impl_->elastic && impl_->shm && impl_->size > 1)  // one host: no staging
      return impl_->run("reduce", typedSig(OpKind::kReduce, count, t, op, root),
                        [&](const OpCtx& o) {
                          (void)algo::reduceOnDevice(*impl_, o, in, out, count, t, op, root);
                        });
    const size_t n = count * dtypeSize(t);
    DeviceStage st("reduce", 2 * n);
    st.in(in, n);
    reduce(st.host(), st.host() + n, count, t, op, root);
    if (impl_->rank == root) st.out(out, n, n);
    return;
  }
  if (impl_->elastic)
    return impl_->elastic->reduce(in, out, count, t, op, root,
                                  typedSig(OpKind::kReduce, count, t, op, root));
  impl_->run("reduce", typedSig(OpKind::kReduce, count, t, op, root),
             [&](const OpCtx& o) { algo::reduce(*impl_, o, in, out, count, t, op, root); });
}

void Communicator::broadcast(void* buf, size_t bytes, int root) {
  checkRoot(*impl_, root, "broadcast");
  checkPtr(buf, bytes, "data", "broadcast");
  if (DeviceStage::any({buf})) {
    if (!impl_->elastic && impl_->shm && impl_->size > 1)  // one host: no staging
      return impl_->run("broadcast", bytesSig(OpKind::kBroadcast, bytes, root),
                        [&](const OpCtx& o) {
                          (void)algo::broadcastOnDevice(*impl_, o, buf, bytes, root);
                        });
    DeviceStage st("broadcast", bytes);
    if (impl_->rank == root) st.in(buf, bytes);
    broadcast(st.host(), bytes, root);
    if (impl_->rank != root) st.out(buf, bytes);
    return;
  }
  if (impl_->elastic)
    return impl_->elastic->broadcast(buf, bytes, root, bytesSig(OpKind::kBroadcast, bytes, root));
  impl_->run("broadcast", bytesSig(OpKind::kBroadcast, bytes, root),
             [&](const OpCtx& o) { algo::broadcast(*impl_, o, buf, bytes, root); });
}

namespace {
// A rank's own block `own` of an output and its input: the same place (in place) or apart;
// the device paths copy the own block as one disjoint copy.
bool disjointOrSame(const char* own, const void* in, size_t bytes) {
  return own == in || apart(own, bytes, in, bytes);
}
}  // namespace

void Communicator::allGather(const void* in, void* out, size_t bytes, int blocks) {
  checkPtr(in, bytes, "input", "allgather");
  checkPtr(out, bytes, "output", "allgather");
  std::vector<size_t> sizes(impl_->elastic && blocks >= 0 ? blocks : pubSize(*impl_), bytes);
  if (DeviceStage::any({in, out})) {
    const char* own = static_cast<const char*>(out) + static_cast<size_t>(impl_->rank) * bytes;
    if (!impl_->elastic && impl_->shm && impl_->size > 1 &&
        disjointOrSame(own, in, bytes))  // one host: no staging
      return impl_->run("allgather", bytesSig(OpKind::kAllGather, bytes), [&](const OpCtx& o) {
        (void)algo::allGatherVOnDevice(*impl_, o, in, out, sizes);
      });
    const size_t total = sizes.size() * bytes;
    DeviceStage st("allgather", bytes + total);
    st.in(in, bytes);
    allGather(st.host(), st.host() + bytes, bytes, blocks);
    return st.out(out, total, bytes);
  }
  if (impl_->elastic)
    return impl_->elastic->allGatherV(in, out, sizes, "allgather",
                                      bytesSig(OpKind::kAllGather, bytes));
  impl_->run("allgather", bytesSig(OpKind::kAllGather, bytes),
             [&](const OpCtx& o) { algo::allGatherV(*impl_, o, in, out, sizes); });
}

void Communicator::allGatherV(const void* in, void* out, const std::vector<size_t>& bytes) {
  if (!impl_->elastic && bytes.size() != static_cast<size_t>(impl_->size))
    throw std::invalid_argument("mooncake pg: allgatherv: " + std::to_string(bytes.size()) +
                                " sizes for a group of " + std::to_string(impl_->size));
  if (impl_->rank < static_cast<int>(bytes.size()))
    checkPtr(in, bytes[impl_->rank], "input", "allgatherv");
  size_t total = 0;
  for (size_t b : bytes) total += b;
  checkPtr(out, total, "output", "allgatherv");
  OpSig sig = bytesSig(OpKind::kAllGatherV, 0);
  sig.shape = hashSizes(bytes);
  if (DeviceStage::any({in, out})) {
    const size_t mine = impl_->rank < static_cast<int>(bytes.size()) ? bytes[impl_->rank] : 0;
    size_t at = 0;
    for (int r = 0; r < impl_->rank && r < static_cast<int>(bytes.size()); ++r) at += bytes[r];
    if (!impl_->elastic && impl_->shm && impl_->size > 1 &&
        disjointOrSame(static_cast<const char*>(out) + at, in, mine))  // one host: no staging
      return impl_->run("allgatherv", sig, [&](const OpCtx& o) {
        (void)algo::allGatherVOnDevice(*impl_, o, in, out, bytes);
      });
    DeviceStage st("allgatherv", mine + total);
    st.in(in, mine);
    allGatherV(st.host(), st.host() + mine, bytes);
    return st.out(out, total, mine);
  }
  if (impl_->elastic) return impl_->elastic->allGatherV(in, out, bytes, "allgatherv", sig);
  impl_->run("allgatherv", sig,
             [&](const OpCtx& o) { algo::allGatherV(*impl_, o, in, out, bytes); });
}

void Communicator::gather(const void* in, void* out, size_t bytes, int root, int blocks) {
  checkRoot(*impl_, root, "gather");
  checkPtr(in, bytes, "input", "gather");
  if (impl_->rank == root) checkPtr(out, bytes, "output", "gather");
  if (DeviceStage::any({in, out})) {
    const char* own = static_cast<const char*>(out) + static_cast<size_t>(impl_->rank) * bytes;
    const bool apart = impl_->rank != root || disjointOrSame(own, in, bytes);
    if (!impl_->elastic && impl_->shm && impl_->size > 1 && apart)  // one host: no staging
      return impl_->run("gather", bytesSig(OpKind::kGather, bytes, root), [&](const OpCtx& o) {
        (void)algo::gatherOnDevice(*impl_, o, in, out, bytes, root);
      });
    const size_t total = (impl_->elastic && blocks >= 0 ? blocks : pubSize(*impl_)) * bytes;
    DeviceStage st("gather", bytes + total);
    st.in(in, bytes);
    gather(st.host(), st.host() + bytes, bytes, root, blocks);
    if (impl_->rank == root) st.out(out, total, bytes);
    return;
  }
  if (impl_->elastic)
    return impl_->elastic->gather(in, out, bytes, root, blocks,
                                  bytesSig(OpKind::kGather, bytes, root));
  impl_->run("gather", bytesSig(OpKind::kGather, bytes, root),
             [&](const OpCtx& o) { algo::gather(*impl_, o, in, out, bytes, root); });
}

void Communicator::scatter(const void* in, void* out, size_t bytes, int root, int blocks) {
  checkRoot(*impl_, root, "scatter");
  if (impl_->rank == root) checkPtr(in, bytes, "input", "scatter");
  checkPtr(out, bytes, "output", "scatter");
  if (DeviceStage::any({in, out})) {
    const size_t total = (impl_->elastic && blocks >= 0 ? blocks : pubSize(*impl_)) * bytes;
    const char* own = static_cast<const char*>(in) + static_cast<size_t>(impl_->rank) * bytes;
    const bool apart = impl_->rank != root || disjointOrSame(own, out, bytes);
    if (!impl_->elastic && impl_->shm && impl_->size > 1 && apart)  // one host: no staging
      return impl_->run("scatter", bytesSig(OpKind::kScatter, bytes, root), [&](const OpCtx& o) {
        (void)algo::scatterOnDevice(*impl_, o, in, out, bytes, root);
      });
    DeviceStage st("scatter", total + bytes);
    if (impl_->rank == root) st.in(in, total);
    scatter(st.host(), st.host() + total, bytes, root, blocks);
    return st.out(out, bytes, total);
  }
  if (impl_->elastic)
    return impl_->elastic->scatter(in, out, bytes, root, blocks,
                                   bytesSig(OpKind::kScatter, bytes, root));
  impl_->run("scatter", bytesSig(OpKind::kScatter, bytes, root),
             [&](const OpCtx& o) { algo::scatter(*impl_, o, in, out, bytes, root); });
}

void Communicator::reduceScatter(const void* in, void* out, size_t count, DataType t,
                                 ReduceOp op, int blocks) {
  checkReduce(t, op, "reduce_scatter");
  checkPtr(in, count, "input", "reduce_scatter");
  checkPtr(out, count, "output", "reduce_scatter");
  if (DeviceStage::any({in, out})) {
    if (!impl_->elastic && impl_->shm && impl_->size > 1)  // one host: no staging
      return impl_->run("reduce_scatter", typedSig(OpKind::kReduceScatter, count, t, op),
                        [&](const OpCtx& o) {
                          (void)algo::reduceScatterOnDevice(*impl_, o, in, out, count, t, op);
                        });
    const size_t n = count * dtypeSize(t);
    const size_t total = (impl_->elastic && blocks >= 0 ? blocks : pubSize(*impl_)) * n;
    DeviceStage st("reduce_scatter", total + n);
    st.in(in, total);
    reduceScatter(st.host(), st.host() + total, count, t, op, blocks);
    return st.out(out, n, total);
  }
  if (impl_->elastic)
    return impl_->elastic->reduceScatter(in, out, count, t, op, blocks,
                                         typedSig(OpKind::kReduceScatter, count, t, op));
  impl_->run("reduce_scatter", typedSig(OpKind::kReduceScatter, count, t, op),
             [&](const OpCtx& o) { algo::reduceScatter(*impl_, o, in, out, count, t, op); });
}

void Communicator::allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                             const std::vector<size_t>& send_offsets, void* out,
                             const std::vector<size_t>& recv_bytes,
                             const std::vector<size_t>& recv_offsets) {
  size_t n = impl_->elastic ? send_bytes.size() : static_cast<size_t>(impl_->size);
  const auto [in_end, out_end] =
      checkSplits(n, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets);
  if (DeviceStage::any({in, out})) {
    OpSig sig = bytesSig(OpKind::kAllToAll, 0);
    if (!impl_->elastic && impl_->shm && impl_->size > 1)  // one host: no staging
      return impl_->run("alltoall", sig, [&](const OpCtx& o) {
        (void)algo::allToAllVOnDevice(*impl_, o, in, send_bytes, send_offsets, out, recv_bytes,
                                      recv_offsets);
      });
    DeviceStage st("alltoall", in_end + out_end);
    st.in(in, in_end);
    allToAllV(st.host(), send_bytes, send_offsets, st.host() + in_end, recv_bytes, recv_offsets);
    for (size_t j = 0; j < n; ++j)  // only what was received: gaps in out stay as they were
      if (recv_bytes[j] > 0)
        st.out(static_cast<char*>(out) + recv_offsets[j], recv_bytes[j], in_end + recv_offsets[j]);
    return;
  }
  OpSig sig = bytesSig(OpKind::kAllToAll, 0);  // split sizes: checked pairwise by the algorithm
  if (impl_->elastic)
    return impl_->elastic->allToAllV(in, send_bytes, send_offsets, out, recv_bytes, recv_offsets,
                                     sig);
  impl_->run("alltoall", sig, [&](const OpCtx& o) {
    algo::allToAllV(*impl_, o, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets);
  });
}

void Communicator::barrier() {
  OpSig sig;
  sig.kind = OpKind::kBarrier;
  if (impl_->elastic) return impl_->elastic->barrier(sig);
  impl_->run("barrier", sig, [&](const OpCtx& o) { algo::barrier(*impl_, o); });
}

void Communicator::send(const void* buf, size_t bytes, int dst, uint64_t tag) {
  if (dst < 0 || dst >= impl_->size)
    throw std::invalid_argument("mooncake pg: send: destination rank " + std::to_string(dst) +
                                " is outside the group of size " + std::to_string(pubSize(*impl_)));
  checkPtr(buf, bytes, "send", "send");
  if (!impl_->elastic) return impl_->p2p->send(buf, bytes, dst, tag, impl_->opts.timeout);
  if (DeviceStage::any({buf})) {  // GPU data of an elastic group: through host memory
    DeviceStage st("send", bytes);
    st.in(buf, bytes);
    return impl_->elastic->send(st.host(), bytes, dst, tag);
  }
  impl_->elastic->send(buf, bytes, dst, tag);
}

int Communicator::recv(void* buf, size_t bytes, int src, uint64_t tag) {
  if (src < -1 || src >= impl_->size)
    throw std::invalid_argument("mooncake pg: recv: source rank " + std::to_string(src) +
                                " is outside the group of size " + std::to_string(pubSize(*impl_)));
  checkPtr(buf, bytes, "receive", "recv");
  if (!impl_->elastic) return impl_->p2p->recv(buf, bytes, src, tag, impl_->opts.timeout);
  if (DeviceStage::any({buf})) {  // GPU data of an elastic group: through host memory
    DeviceStage st("recv", bytes);
    const int from = impl_->elastic->recv(st.host(), bytes, src, tag);
    st.out(buf, bytes);
    return from;
  }
  return impl_->elastic->recv(buf, bytes, src, tag);
}

}  // namespace mooncake::pg
