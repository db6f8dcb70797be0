// Set-up shared by plain groups and the views of elastic ones: parameters, message channels,
// rank records, and building a group's data plane (shm / net / hierarchical) once every rank's
// peers are open and its buffers mapped.
#include <sched.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "engine/log.h"
#include "engine/params.h"
#include "engine/wire.h"
#include "pg/comm_impl.h"
#include "pg/elastic.h"  // Impl holds the controller: constructing one needs it whole

namespace mooncake::pg {

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
  p.net_slots = static_cast<int>(std::clamp<int64_t>(params::getInt("MC_PG_NET_SLOTS"), 0, 1024));
  p.net_slot_min_bytes =
      static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_NET_SLOT_MIN_BYTES"), 1));
  p.net_one_sided = params::getString("MC_PG_NET_ONE_SIDED");
  if (p.net_one_sided != "all" && p.net_one_sided != "none") p.net_one_sided = "rdma";
  p.stream_out_bytes =
      static_cast<size_t>(std::max<int64_t>(params::getInt("MC_PG_STREAM_OUT_BYTES"), 0));
  p.wait.spin_us = std::max<int64_t>(params::getInt("MC_PG_SPIN_US"), 0);
  p.wait.yield_us = std::max<int64_t>(params::getInt("MC_PG_YIELD_US"), 0);
  p.wait.health_us = std::max<int64_t>(params::getInt("MC_PG_HEALTH_US"), 100);
  p.hierarchical = params::getBool("MC_PG_HIERARCHICAL");
  p.gpu_halves = params::getBool("MC_PG_GPU_HALVES");
  const std::string so = params::getString("MC_PG_STREAM_OPS");
  p.stream_ops = so == "1" || so == "on" || so == "true"
                     ? PgParams::StreamOpsMode::kOn
                     : (so == "0" || so == "off" || so == "false" ? PgParams::StreamOpsMode::kOff
                                                                  : PgParams::StreamOpsMode::kAuto);
  // Whole 4 KiB pages, so that every element size divides it.
  p.stream_chunk_bytes = static_cast<size_t>(std::max<int64_t>(
                             params::getInt("MC_PG_STREAM_OPS_CHUNK_BYTES"), 4096)) &
                         ~static_cast<size_t>(4095);
  p.stream_oneshot_bytes = static_cast<size_t>(
      std::max<int64_t>(params::getInt("MC_PG_STREAM_OPS_ONESHOT_BYTES"), 0));
  p.stream_p2p_slot_bytes = static_cast<size_t>(std::max<int64_t>(
                                params::getInt("MC_PG_STREAM_P2P_SLOT_BYTES"), 4096)) &
                            ~static_cast<size_t>(4095);
  return p;
}

// ---- channels ----

uint32_t channelFor(const std::string& kind, const std::string& group) {
  uint32_t h = 2166136261u;
  for (char c : "pg/" + kind + "/" + group) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  return h | 0x80000000u;  // other services use small channel numbers
}

namespace {
std::mutex g_channels_mu;
std::map<const engine::TransferEngine*, std::set<uint32_t>> g_channels;
}  // namespace

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

// ---- rank records ----

std::string RankRecord::serialize() const {
  wire::Writer w;
  w.u32(1);
  w.str(engine_name);
  w.u64(engine_id);
  w.u64(buffer);
  w.u64(buffer_bytes);
  w.str(segment);
  return w.take();
}

bool RankRecord::parse(std::string_view s, RankRecord* out) {
  wire::Reader r(s);
  if (r.u32() != 1) return false;
  out->engine_name = r.str();
  out->engine_id = r.u64();
  out->buffer = r.u64();
  out->buffer_bytes = r.u64();
  out->segment = r.str(64u << 20);
  return r.done();
}

// ---- the data plane ----

namespace {

int usableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

// Wait tuning of a shm group of `ranks` ranks on this host.
ShmGroup::WaitOptions shmWait(const PgParams& p, int ranks) {
  ShmGroup::WaitOptions w = p.wait;
  if (ranks > usableCpus()) {
    // More ranks than cores: a spinning rank steals the core its peer needs; hand the core
    // over (sched_yield) at once, then sleep. Measured (pg_perf --world 4 on 2 cores, two
    // alternating runs each): 4 KiB ops 5.3-10.0 us p50 without spinning against 11.4-15.7
    // us spinning 2 us per wait; 64 KiB 11-28 us against 17-50 us.
    w.spin_us = 0;
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
    if (static_cast<int>(r) != me && bases[r] != nullptr)
      for (size_t off = 0; off < bytes; off += 4096) sink = sink + bases[r][off];
}

// A sub-group of `parent` over `ranks` (ascending, parent ranks, this rank among them): the
// parent's engine, peers and options; its Health names the parent's names of those ranks.
std::unique_ptr<Communicator::Impl> subGroup(const Communicator::Impl& parent,
                                             const std::vector<int>& ranks,
                                             const std::vector<int>& parent_names) {
  auto s = std::make_unique<Communicator::Impl>();
  s->engine = parent.engine;
  s->rdv = parent.rdv;
  s->opts = parent.opts;
  s->params = parent.params;
  s->net_areas = parent.net_areas;
  s->size = static_cast<int>(ranks.size());
  std::vector<int> names;
  for (int i = 0; i < s->size; ++i) {
    if (ranks[i] == parent.rank) s->rank = i;
    s->peers.push_back(parent.peers[ranks[i]]);
    names.push_back(parent_names.empty() ? ranks[i] : parent_names[ranks[i]]);
  }
  s->health = std::make_unique<Health>(parent.engine.get(), s->peers, s->rank,
                                       parent.opts.group_name, names);
  return s;
}

// A NetGroup over g's ranks with receive slots from c's areas of `kind`, indexed by each
// rank's name (its rank in the user's group, or its slot in an elastic one).
std::unique_ptr<NetGroup> makeNet(const Communicator::Impl& c, const Communicator::Impl& g,
                                  const std::string& kind, uint32_t ch,
                                  const std::vector<int>& names) {
  std::vector<int> index;
  for (int r = 0; r < g.size; ++r) index.push_back(names.empty() ? r : names[r]);
  // The peers this rank grants receive slots to (MC_PG_NET_ONE_SIDED); an area only if any.
  std::vector<uint8_t> grant(g.size, 0);
  bool any = false;
  for (int r = 0; r < g.size; ++r) {
    if (r == g.rank || g.peers[r] == engine::kInvalidPeer) continue;
    const std::string& mode = c.params.net_one_sided;
    grant[r] = mode == "all" || (mode == "rdma" && c.engine->peerTransport(g.peers[r]) == "rdma");
    any = any || grant[r];
  }
  std::shared_ptr<NetArea> area =
      any && c.net_areas ? c.net_areas->get(kind, c.engine) : nullptr;
  return std::make_unique<NetGroup>(c.engine.get(), g.health.get(), g.peers, g.rank, ch,
                                    c.params.wait.health_us, c.params.net_piece_bytes,
                                    std::move(area), std::move(index), std::move(grant),
                                    c.params.net_slot_min_bytes);
}

}  // namespace

std::function<std::shared_ptr<NetArea>()> p2pArea(const Communicator::Impl& c) {
  std::shared_ptr<NetAreas> areas = c.net_areas;
  std::shared_ptr<engine::TransferEngine> engine = c.engine;
  return [areas, engine]() -> std::shared_ptr<NetArea> {
    return areas ? areas->get("p2p", engine) : nullptr;
  };
}

std::string localMode(const PgParams& p, const std::vector<char*>& bases,
                      const std::vector<std::string>& hosts, int rank) {
  bool all_mapped = true, local_mapped = true;
  for (size_t r = 0; r < bases.size(); ++r) {
    if (bases[r] == nullptr) all_mapped = false;
    if (hosts[r] == hosts[rank] && bases[r] == nullptr) local_mapped = false;
  }
  // MC_PG_HIERARCHICAL=0 on any rank makes it say "net": every rank then goes flat.
  return all_mapped ? "shm" : local_mapped && p.hierarchical ? "local" : "net";
}

void buildDataPlane(Communicator::Impl& c, const std::vector<char*>& bases,
                    const std::vector<std::string>& hosts, const std::vector<std::string>& modes,
                    const std::string& chan_tag, uint64_t epoch, std::vector<int> names,
                    bool retire) {
  engine::TransferEngine* engine = c.engine.get();
  const std::string& g_name = c.opts.group_name;
  // Every rank must take the same path: shm only if every rank mapped every peer;
  // hierarchical only if every rank mapped its own host's peers.
  bool shm = true, hier = true;
  for (const std::string& m : modes) {
    if (m != "shm") shm = false;
    if (m != "shm" && m != "local") hier = false;
  }
  // This host's ranks (ascending) and the hosts' leaders (the lowest rank of each host).
  std::vector<int> local_ranks, leader_ranks;
  {
    std::set<std::string> seen;
    for (int r = 0; r < c.size; ++r) {
      if (hosts[r] == hosts[c.rank]) local_ranks.push_back(r);
      if (seen.insert(hosts[r]).second) leader_ranks.push_back(r);
    }
  }
  // Worth it when there are several hosts and some host has several ranks.
  hier = hier && !shm && leader_ranks.size() > 1 &&
         leader_ranks.size() < static_cast<size_t>(c.size);

  c.health = std::make_unique<Health>(engine, c.peers, c.rank, g_name, names);
  c.dev_halves.reset();  // they belong to the previous plane's ShmGroup
  if (shm) {
    c.shm = std::make_unique<ShmGroup>(c.health.get(), bases, c.buffer_bytes, c.rank,
                                       shmWait(c.params, c.size), epoch);
    prefault(bases, c.rank, c.buffer_bytes);
  } else {
    uint32_t ch = channelFor("coll" + chan_tag, g_name);
    claimChannel(engine, ch, g_name);
    c.channels.push_back(ch);
    c.net = makeNet(c, c, "coll", ch, names);
    if (retire) c.net->dropOnClose();
    c.net->start();
  }
  if (hier) {
    for (int r = 0; r < c.size; ++r)
      for (size_t h = 0; h < leader_ranks.size(); ++h)
        if (hosts[r] == hosts[leader_ranks[h]]) c.host_of.push_back(static_cast<int>(h));
    c.local_ranks = local_ranks;
    c.leader_ranks = leader_ranks;
    c.local = subGroup(c, local_ranks, names);
    std::vector<char*> local_bases;
    for (int r : local_ranks) local_bases.push_back(bases[r]);
    c.local->shm = std::make_unique<ShmGroup>(c.local->health.get(), local_bases, c.buffer_bytes,
                                              c.local->rank, shmWait(c.params, c.local->size),
                                              epoch);
    prefault(local_bases, c.local->rank, c.buffer_bytes);
    if (local_ranks[0] == c.rank) {
      uint32_t hier_ch = channelFor("leaders" + chan_tag, g_name);
      claimChannel(engine, hier_ch, g_name);
      c.channels.push_back(hier_ch);
      c.leaders = subGroup(c, leader_ranks, names);
      std::vector<int> leader_names;
      for (int r : leader_ranks) leader_names.push_back(names.empty() ? r : names[r]);
      c.leaders->net = makeNet(c, *c.leaders, "leaders", hier_ch, leader_names);
      if (retire) c.leaders->net->dropOnClose();
      c.leaders->net->start();
    }
  }
  c.path = shm    ? "shm"
           : hier ? "hierarchical: " + std::to_string(leader_ranks.size()) + " hosts, " +
                        std::to_string(local_ranks.size()) + " ranks on this one"
                  : "net";
}

}  // namespace mooncake::pg
