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
#include "pg/comm_impl.h"

namespace mooncake::pg {

using engine::Clock;
using engine::Deadline;
using engine::PeerId;

PgParams PgParams::load(size_t buffer_bytes_override) {
  PgParams p;
  int64_t b = buffer_bytes_override > 0 ? static_cast<int64_t>(buffer_bytes_override)
                                        : params::getInt("MC_PG_BUFFER_BYTES");
  p.buffer_bytes = static_cast<size_t>(std::max<int64_t>(b, 128 << 10));
  p.chunk_bytes = static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_CHUNK_BYTES"), 4096));
  p.flat_bytes = static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_FLAT_BYTES"), 0));
  // A multiple of 64: senders cut pieces in bytes, receivers of reductions in elements.
  p.net_piece_bytes =
      static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_NET_PIECE_BYTES"), 4096)) &
      ~static_cast<size_t>(63);
  p.net_slots = static_cast<int>(std::clamp<int64_t>(params::getInt("MC_PG_NET_SLOTS"), 1, 64));
  p.stream_out_bytes =
      static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_STREAM_OUT_BYTES"), 0));
  p.wait.spin_us = std::max<int64_t>(params::getInt("MC_PG_SPIN_US"), 0);
  p.wait.yield_us = std::max<int64_t>(params::getInt("MC_PG_YIELD_US"), 0);
  p.wait.health_us = std::max<int64_t>(params::getInt("MC_PG_HEALTH_US"), 100);
  p.hierarchical = params::getBool("MC_PG_HIERARCHICAL");
  return p;
}

namespace {

// Message channels of a group: a hash of its name with the top bit set (other services use
// small channel numbers). Two groups of one engine must not share one: claimed here.
uint32_t channelFor(const std::string& kind, const std::string& group) {
  uint32_t h = 2166136261u;
  for (char c : "pg/" + kind + "/" + group) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  return h | 0x80000000u;
}

std::mutex g_channels_mu;
std::map<const engine::TransferEngine*, std::set<uint32_t>> g_channels;

void claimChannel(const engine::TransferEngine* e, uint32_t ch, const std::string& group) {
  std::lock_guard<std::mutex> g(g_channels_mu);
  if (!g_channels[e].insert(ch).second)
    throw std::invalid_argument("mooncake pg: group name '" + group +
                                "' is already used by a communicator on this engine (or "
                                "collides with one); group names must be distinct");
}

void releaseChannel(const engine::TransferEngine* e, uint32_t ch) {
  std::lock_guard<std::mutex> g(g_channels_mu);
  auto it = g_channels.find(e);
  if (it == g_channels.end()) return;
  it->second.erase(ch);
  if (it->second.empty()) g_channels.erase(it);
}

[[noreturn]] void setupFailed(const CommOptions& o, const std::string& what, const Status& st,
                              int peer = -1) {
  throw CommError("mooncake pg: creating group " + o.group_name + " (rank " +
                      std::to_string(o.rank) + " of " + std::to_string(o.size) + "): " + what +
                      ": " + st.toString(),
                  peer, "init");
}

struct RankRecord {
  std::string engine_name;
  uint64_t engine_id = 0;
  uint64_t buffer = 0;
  uint64_t buffer_bytes = 0;
  std::string segment;

  std::string serialize() const {
    wire::Writer w;
    w.u32(1);
    w.str(engine_name);
    w.u64(engine_id);
    w.u64(buffer);
    w.u64(buffer_bytes);
    w.str(segment);
    return w.take();
  }
  static bool parse(std::string_view s, RankRecord* out) {
    wire::Reader r(s);
    if (r.u32() != 1) return false;
    out->engine_name = r.str();
    out->engine_id = r.u64();
    out->buffer = r.u64();
    out->buffer_bytes = r.u64();
    out->segment = r.str(64u << 20);
    return r.done();
  }
};

// Receive slots per sender are bounded in all: at most this many bytes per mailbox set, so a
// large group gets smaller pieces rather than hundreds of MiB of registered memory.
constexpr size_t kMaxSlotAreaBytes = 64u << 20;

// The mailboxes of a group (or sub-group) over its peers; collective over them.
std::unique_ptr<NetSlots> makeSlots(const Communicator::Impl& c, uint32_t channel,
                                    const std::string& key, int slots, const Deadline& dl) {
  NetSlots::Config cfg;
  cfg.channel = channel;
  cfg.slots = slots;
  size_t senders = static_cast<size_t>(std::max(1, c.size - 1));
  size_t cap = kMaxSlotAreaBytes / (senders * static_cast<size_t>(slots));
  cfg.slot_bytes = std::max<size_t>(4096, std::min(c.params.net_piece_bytes, cap)) &
                   ~static_cast<size_t>(63);
  cfg.key = key;
  auto s = NetSlots::create(c.engine.get(), *c.rdv, c.peers, c.rank, cfg, dl);
  if (!s.ok()) setupFailed(c.opts, "setting up the " + key + " mailboxes", s.status());
  return std::move(s).value();
}

int usableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

// Wait tuning of a shm group of `ranks` ranks on this host.
ShmGroup::WaitOptions shmWait(const PgParams& p, int ranks) {
  ShmGroup::WaitOptions w = p.wait;
  if (ranks > usableCpus()) {
    // More ranks than cores: a spinning rank would steal the core its peer needs; spin
    // briefly, then hand the core over (sched_yield) before sleeping.
    w.spin_us = std::min<int64_t>(w.spin_us, 2);
  } else {
    // Ranks have cores of their own: spin, then sleep. No yield phase: measured with the
    // torch adapter (2 ranks x 2 threads on 2 cores), yielding for 200 us made a 4 KiB
    // allreduce take 80-130 us at p50 instead of 4-10 us.
    w.yield_us = 0;
  }
  return w;
}

// Reads every page of the peers' mapped buffers once (faults the mappings in now, not inside
// the first timed op).
void prefault(const std::vector<char*>& bases, int me, size_t bytes) {
  volatile char sink = 0;
  for (size_t r = 0; r < bases.size(); ++r)
    if (static_cast<int>(r) != me)
      for (size_t off = 0; off < bytes; off += 4096) sink = sink + bases[r][off];
}

// A sub-group of `parent` over `ranks` (ascending, parent ranks, this rank among them): the
// parent's engine, peers and options; its Health names the parent's ranks.
std::unique_ptr<Communicator::Impl> subGroup(const Communicator::Impl& parent,
                                             const std::vector<int>& ranks) {
  auto s = std::make_unique<Communicator::Impl>();
  s->engine = parent.engine;
  s->rdv = parent.rdv;
  s->opts = parent.opts;
  s->params = parent.params;
  s->size = static_cast<int>(ranks.size());
  for (int i = 0; i < s->size; ++i) {
    if (ranks[i] == parent.rank) s->rank = i;
    s->peers.push_back(parent.peers[ranks[i]]);
  }
  s->health = std::make_unique<Health>(parent.engine.get(), s->peers, s->rank,
                                       parent.opts.group_name, ranks);
  return s;
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
  if (broken.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(broken_mu);
    throw CommError("mooncake pg: " + std::string(name) + " on group " + opts.group_name +
                        " that already failed: " + broken_what,
                    broken_rank, name);
  }
  OpCtx op{name, Clock::now() + opts.timeout, ++op_seq, opts.timeout, sig};  // timeout clamped
  try {
    fn(op);
    finishOps(op);
  } catch (const UsageError&) {
    throw;
  } catch (const CommError& e) {
    {
      std::lock_guard<std::mutex> g(broken_mu);
      if (!broken.load()) {
        broken_what = e.what();
        broken_rank = e.peerRank();
        broken.store(true, std::memory_order_release);
      }
    }
    if (shm) shm->abort(e.peerRank());
    if (net) net->abort(e.peerRank(), e.what());
    if (local) local->shm->abort(e.peerRank());
    if (leaders) leaders->net->abort(e.peerRank(), e.what());
    // Writes of the failed op may still read the caller's memory: let them end first.
    if (net) net->quiesce();
    if (leaders) leaders->net->quiesce();
    MC_LOG(WARN, PG) << e.what();
    throw;
  }
}

Communicator::Impl::~Impl() {
  worker.reset();  // drains the queued ops and joins, while the groups they use still exist
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
  const Deadline dl = Clock::now() + c.opts.timeout;

  uint32_t coll_ch = channelFor("coll", g_name), p2p_ch = channelFor("p2p", g_name);
  claimChannel(engine.get(), coll_ch, g_name);
  c.channels.push_back(coll_ch);
  claimChannel(engine.get(), p2p_ch, g_name);
  c.channels.push_back(p2p_ch);
  // Keys of this incarnation of the group: a group re-created under the same name on the
  // same rendezvous (destroy + init again) must not read the previous incarnation's keys.
  // Every rank bumps its own counter once per incarnation, so all ranks agree on it.
  auto gen = rdv->add(g_name + "/gen/" + std::to_string(c.rank), 1);
  if (!gen.ok()) setupFailed(options, "rendezvous add", gen.status());
  const std::string g = g_name + "#" + std::to_string(*gen);

  // One registered buffer per rank for the group's lifetime: header page + two halves.
  size_t half = (c.params.buffer_bytes / 2 + 4095) & ~static_cast<size_t>(4095);
  c.buffer_bytes = ShmGroup::kHeaderBytes + 2 * half;
  auto mem = engine->allocate(c.buffer_bytes);
  if (!mem.ok()) setupFailed(options, "allocating the comm buffer", mem.status());
  c.buffer = *mem;
  std::memset(c.buffer, 0, c.buffer_bytes);  // fault the pages in now, not in the first op

  Status st = engine->publish(*rdv);
  if (!st.ok()) setupFailed(options, "publishing the segment", st);
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
  bool all_mapped = true;
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
    if (rec.buffer_bytes != c.buffer_bytes) {
      all_mapped = false;  // a different MC_PG_BUFFER_BYTES: the step layout would differ
      continue;
    }
    bases[r] = static_cast<char*>(engine->mappedAddress(*peer, rec.buffer, rec.buffer_bytes));
    if (bases[r] == nullptr) all_mapped = false;
  }
  // This host's ranks (ascending) and the hosts' leaders (the lowest rank of each host).
  std::vector<int> local_ranks, leader_ranks;
  bool local_mapped = true;  // every same-host peer's buffer is mapped here
  {
    std::set<std::string> seen;
    for (int r = 0; r < c.size; ++r) {
      if (hosts[r] == hosts[c.rank]) {
        local_ranks.push_back(r);
        if (bases[r] == nullptr) local_mapped = false;
      }
      if (seen.insert(hosts[r]).second) leader_ranks.push_back(r);
    }
  }
  // Every rank must take the same path: shm only if every rank mapped every peer;
  // hierarchical only if every rank mapped its own host's peers.
  // (MC_PG_HIERARCHICAL=0 on any rank makes it say "net": every rank then goes flat.)
  st = rdv->set(g + "/mode/" + std::to_string(c.rank),
                all_mapped                             ? "shm"
                : local_mapped && c.params.hierarchical ? "local"
                                                        : "net");
  if (!st.ok()) setupFailed(options, "rendezvous set", st);
  bool shm = true, hier = true;
  for (int r = 0; r < c.size; ++r) {
    auto v = rdv->wait(g + "/mode/" + std::to_string(r), dl);
    if (!v.ok()) setupFailed(options, "waiting for rank " + std::to_string(r), v.status(), r);
    if (*v != "shm") shm = false;
    if (*v == "net") hier = false;
  }
  // Worth it when there are several hosts and some host has several ranks.
  hier = hier && !shm && leader_ranks.size() > 1 &&
         leader_ranks.size() < static_cast<size_t>(c.size);

  c.health = std::make_unique<Health>(engine.get(), c.peers, c.rank, g_name);
  if (shm) {
    c.shm = std::make_unique<ShmGroup>(c.health.get(), bases, c.buffer_bytes, c.rank,
                                       shmWait(c.params, c.size));
    prefault(bases, c.rank, c.buffer_bytes);
  } else {
    c.net = std::make_unique<NetGroup>(engine.get(), c.health.get(), c.peers, c.rank, coll_ch,
                                       c.params.wait.health_us,
                                       makeSlots(c, coll_ch, g + "/slots/coll", c.params.net_slots, dl));
    c.net->start();
  }
  if (hier) {
    for (int r = 0; r < c.size; ++r)
      for (size_t h = 0; h < leader_ranks.size(); ++h)
        if (hosts[r] == hosts[leader_ranks[h]]) c.host_of.push_back(static_cast<int>(h));
    c.local_ranks = local_ranks;
    c.leader_ranks = leader_ranks;
    c.local = subGroup(c, local_ranks);
    std::vector<char*> local_bases;
    for (int r : local_ranks) local_bases.push_back(bases[r]);
    c.local->shm = std::make_unique<ShmGroup>(c.local->health.get(), local_bases, c.buffer_bytes,
                                              c.local->rank, shmWait(c.params, c.local->size));
    prefault(local_bases, c.local->rank, c.buffer_bytes);
    if (local_ranks[0] == c.rank) {
      uint32_t hier_ch = channelFor("leaders", g_name);
      claimChannel(engine.get(), hier_ch, g_name);
      c.channels.push_back(hier_ch);
      c.leaders = subGroup(c, leader_ranks);
      c.leaders->net = std::make_unique<NetGroup>(
          engine.get(), c.leaders->health.get(), c.leaders->peers, c.leaders->rank, hier_ch,
          c.params.wait.health_us,
          makeSlots(*c.leaders, hier_ch, g + "/slots/leaders", c.params.net_slots, dl));
      c.leaders->net->start();
    }
  }
  c.p2p = std::make_unique<P2p>(engine.get(), c.health.get(), c.peers, c.rank,
                                c.params.wait.health_us,
                                makeSlots(c, p2p_ch, g + "/slots/p2p", 2, dl));
  c.p2p->start();
  c.path = shm    ? "shm"
           : hier ? "hierarchical: " + std::to_string(leader_ranks.size()) + " hosts, " +
                        std::to_string(local_ranks.size()) + " ranks on this one"
                  : "net";
  MC_LOG(INFO, PG) << "group " << g << " rank " << c.rank << "/" << c.size << " ready on "
                   << c.path << ", buffer " << c.buffer_bytes
                   << " bytes, reduce kernels " << reduceIsa();
  return std::unique_ptr<Communicator>(new Communicator(std::move(impl)));
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
const CommOptions& Communicator::options() const { return impl_->opts; }
engine::TransferEngine& Communicator::engine() { return *impl_->engine; }
engine::PeerId Communicator::peerOf(int rank) const {
  if (rank < 0 || rank >= impl_->size) throw std::invalid_argument("mooncake pg: peerOf: bad rank");
  return impl_->peers[rank];
}
std::shared_ptr<engine::Rendezvous> Communicator::rendezvous() const { return impl_->rdv; }
std::vector<int> Communicator::deadRanks() const { return impl_->health->deadRanks(); }
const std::string& Communicator::path() const { return impl_->path; }

std::shared_ptr<Work> Communicator::enqueue(std::string op_name, std::function<void()> fn) {
  return impl_->worker->enqueue(std::move(op_name), std::move(fn));
}

// ---- validation helpers ----
namespace {
void checkRoot(const Communicator::Impl& c, int root, const char* op) {
  if (root < 0 || root >= c.size)
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": root " +
                                std::to_string(root) + " is outside the group of size " +
                                std::to_string(c.size));
}
void checkReduce(DataType t, ReduceOp rop, const char* op) {
  if (!reduceSupported(t, rop))
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": reduce op " +
                                reduceOpName(rop) + " is not defined for dtype " + dtypeName(t));
}
OpSig typedSig(OpKind kind, size_t count, DataType t, ReduceOp op, int root = -1) {
  OpSig s;
  s.kind = kind;
  s.dtype = static_cast<uint8_t>(static_cast<int>(t) + 1);
  s.redop = static_cast<uint8_t>(static_cast<int>(op) + 1);
  s.count = count;
  s.root = root;
  return s;
}

OpSig bytesSig(OpKind kind, size_t bytes, int root = -1) {
  OpSig s;
  s.kind = kind;
  s.count = bytes;
  s.root = root;
  return s;
}

uint64_t hashSizes(const std::vector<size_t>& v) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
  for (size_t x : v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(x) >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

void checkPtr(const void* p, size_t bytes, const char* what, const char* op) {
  if (p == nullptr && bytes > 0)
    throw std::invalid_argument(std::string("mooncake pg: ") + op + ": null " + what +
                                " buffer for " + std::to_string(bytes) + " bytes");
}
}  // namespace

void Communicator::allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  checkReduce(t, op, "allreduce");
  checkPtr(in, count, "input", "allreduce");
  checkPtr(out, count, "output", "allreduce");
  impl_->run("allreduce", typedSig(OpKind::kAllReduce, count, t, op),
             [&](const OpCtx& o) { algo::allReduce(*impl_, o, in, out, count, t, op); });
}

void Communicator::reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op,
                          int root) {
  checkReduce(t, op, "reduce");
  checkRoot(*impl_, root, "reduce");
  checkPtr(in, count, "input", "reduce");
  if (impl_->rank == root) checkPtr(out, count, "output", "reduce");
  impl_->run("reduce", typedSig(OpKind::kReduce, count, t, op, root),
             [&](const OpCtx& o) { algo::reduce(*impl_, o, in, out, count, t, op, root); });
}

void Communicator::broadcast(void* buf, size_t bytes, int root) {
  checkRoot(*impl_, root, "broadcast");
  checkPtr(buf, bytes, "data", "broadcast");
  impl_->run("broadcast", bytesSig(OpKind::kBroadcast, bytes, root),
             [&](const OpCtx& o) { algo::broadcast(*impl_, o, buf, bytes, root); });
}

void Communicator::allGather(const void* in, void* out, size_t bytes) {
  checkPtr(in, bytes, "input", "allgather");
  checkPtr(out, bytes, "output", "allgather");
  std::vector<size_t> sizes(impl_->size, bytes);
  impl_->run("allgather", bytesSig(OpKind::kAllGather, bytes),
             [&](const OpCtx& o) { algo::allGatherV(*impl_, o, in, out, sizes); });
}

void Communicator::allGatherV(const void* in, void* out, const std::vector<size_t>& bytes) {
  if (bytes.size() != static_cast<size_t>(impl_->size))
    throw std::invalid_argument("mooncake pg: allgatherv: " + std::to_string(bytes.size()) +
                                " sizes for a group of " + std::to_string(impl_->size));
  checkPtr(in, bytes[impl_->rank], "input", "allgatherv");
  size_t total = 0;
  for (size_t b : bytes) total += b;
  checkPtr(out, total, "output", "allgatherv");
  OpSig sig = bytesSig(OpKind::kAllGatherV, 0);
  sig.shape = hashSizes(bytes);
  impl_->run("allgatherv", sig,
             [&](const OpCtx& o) { algo::allGatherV(*impl_, o, in, out, bytes); });
}

void Communicator::gather(const void* in, void* out, size_t bytes, int root) {
  checkRoot(*impl_, root, "gather");
  checkPtr(in, bytes, "input", "gather");
  if (impl_->rank == root) checkPtr(out, bytes, "output", "gather");
  impl_->run("gather", bytesSig(OpKind::kGather, bytes, root),
             [&](const OpCtx& o) { algo::gather(*impl_, o, in, out, bytes, root); });
}

void Communicator::scatter(const void* in, void* out, size_t bytes, int root) {
  checkRoot(*impl_, root, "scatter");
  if (impl_->rank == root) checkPtr(in, bytes, "input", "scatter");
  checkPtr(out, bytes, "output", "scatter");
  impl_->run("scatter", bytesSig(OpKind::kScatter, bytes, root),
             [&](const OpCtx& o) { algo::scatter(*impl_, o, in, out, bytes, root); });
}

void Communicator::reduceScatter(const void* in, void* out, size_t count, DataType t,
                                 ReduceOp op) {
  checkReduce(t, op, "reduce_scatter");
  checkPtr(in, count, "input", "reduce_scatter");
  checkPtr(out, count, "output", "reduce_scatter");
  impl_->run("reduce_scatter", typedSig(OpKind::kReduceScatter, count, t, op),
             [&](const OpCtx& o) { algo::reduceScatter(*impl_, o, in, out, count, t, op); });
}

void Communicator::allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                             const std::vector<size_t>& send_offsets, void* out,
                             const std::vector<size_t>& recv_bytes,
                             const std::vector<size_t>& recv_offsets) {
  size_t n = static_cast<size_t>(impl_->size);
  if (send_bytes.size() != n || send_offsets.size() != n || recv_bytes.size() != n ||
      recv_offsets.size() != n)
    throw std::invalid_argument("mooncake pg: alltoall: split vectors must have one entry per "
                                "rank (" + std::to_string(n) + ")");
  size_t in_end = 0, out_end = 0;
  for (size_t j = 0; j < n; ++j) {
    if (send_bytes[j] > 0) in_end = std::max(in_end, send_offsets[j] + send_bytes[j]);
    if (recv_bytes[j] > 0) out_end = std::max(out_end, recv_offsets[j] + recv_bytes[j]);
  }
  checkPtr(in, in_end, "input", "alltoall");
  checkPtr(out, out_end, "output", "alltoall");
  const char* ib = static_cast<const char*>(in);
  const char* ob = static_cast<const char*>(out);
  if (in_end > 0 && out_end > 0 && ib < ob + out_end && ob < ib + in_end)
    throw std::invalid_argument("mooncake pg: alltoall: input and output buffers overlap");
  OpSig sig;
  sig.kind = OpKind::kAllToAll;  // the split sizes are checked pairwise by the algorithm
  impl_->run("alltoall", sig, [&](const OpCtx& o) {
    algo::allToAllV(*impl_, o, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets);
  });
}

void Communicator::barrier() {
  OpSig sig;
  sig.kind = OpKind::kBarrier;
  impl_->run("barrier", sig, [&](const OpCtx& o) { algo::barrier(*impl_, o); });
}

void Communicator::send(const void* buf, size_t bytes, int dst, uint64_t tag) {
  if (dst < 0 || dst >= impl_->size)
    throw std::invalid_argument("mooncake pg: send: destination rank " + std::to_string(dst) +
                                " is outside the group of size " + std::to_string(impl_->size));
  checkPtr(buf, bytes, "send", "send");
  impl_->p2p->send(buf, bytes, dst, tag, impl_->opts.timeout);
}

int Communicator::recv(void* buf, size_t bytes, int src, uint64_t tag) {
  if (src < -1 || src >= impl_->size)
    throw std::invalid_argument("mooncake pg: recv: source rank " + std::to_string(src) +
                                " is outside the group of size " + std::to_string(impl_->size));
  checkPtr(buf, bytes, "receive", "recv");
  return impl_->p2p->recv(buf, bytes, src, tag, impl_->opts.timeout);
}

}  // namespace mooncake::pg
