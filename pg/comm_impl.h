// Communicator::Impl: the state a communicator holds and the entry points of the algorithm
// families (pg/algorithms/*.cc). Internal to pg/.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pg/communicator.h"
#include "pg/device_stage.h"
#include "pg/copy.h"
#include "pg/health.h"
#include "pg/net_group.h"
#include "pg/p2p.h"
#include "pg/reduce.h"
#include "pg/shm_group.h"
#include "pg/stream_ops.h"
#include "pg/stream_p2p.h"
#include "pg/work.h"

namespace mooncake::pg {

class Elastic;  // pg/elastic.h

// Tunables, read once per communicator from the MC_PG_* parameters (engine/params.cc).
struct PgParams {
  size_t buffer_bytes;     // MC_PG_BUFFER_BYTES
  size_t chunk_bytes;      // MC_PG_CHUNK_BYTES: allreduce pipeline step (<= half buffer)
  size_t flat_bytes;       // MC_PG_FLAT_BYTES: allreduce/reduce at or below: flat exchange
  size_t net_piece_bytes;  // MC_PG_NET_PIECE_BYTES: message size on the non-shm path
  int net_slots;           // MC_PG_NET_SLOTS: receive slots per sender (0: two-sided only)
  size_t net_slot_min_bytes;  // MC_PG_NET_SLOT_MIN_BYTES
  std::string net_one_sided;  // MC_PG_NET_ONE_SIDED: rdma, all, none
  size_t stream_out_bytes;  // MC_PG_STREAM_OUT_BYTES: outputs this large: streaming stores
  ShmGroup::WaitOptions wait;
  bool hierarchical;  // MC_PG_HIERARCHICAL
  bool gpu_halves;    // MC_PG_GPU_HALVES
  enum class StreamOpsMode { kOff, kAuto, kOn };
  StreamOpsMode stream_ops;  // MC_PG_STREAM_OPS
  size_t stream_chunk_bytes;  // MC_PG_STREAM_OPS_CHUNK_BYTES
  size_t stream_oneshot_bytes;  // MC_PG_STREAM_OPS_ONESHOT_BYTES
  size_t stream_p2p_slot_bytes;  // MC_PG_STREAM_P2P_SLOT_BYTES
  static PgParams load(size_t buffer_bytes_override);
};

class Communicator::Impl {
 public:
  std::shared_ptr<engine::TransferEngine> engine;
  std::shared_ptr<engine::Rendezvous> rdv;
  CommOptions opts;
  int rank = 0;
  int size = 1;
  PgParams params{};
  std::vector<engine::PeerId> peers;  // by rank; kInvalidPeer for this rank

  void* buffer = nullptr;  // this rank's comm buffer (engine-allocated, shared memory)
  size_t buffer_bytes = 0;
  std::unique_ptr<Health> health;
  std::unique_ptr<ShmGroup> shm;  // set when every peer's buffer is mapped here
  std::unique_ptr<DeviceHalves> dev_halves;  // with shm: GPU halves, made on first GPU data
  std::mutex stream_ops_mu;
  std::unique_ptr<StreamOps> stream_ops;  // with shm: made on the first stream-ordered op
  std::unique_ptr<StreamP2p> stream_p2p;  // with shm: made on the first stream-ordered p2p
  std::unique_ptr<NetGroup> net;  // used when shm is not
  // Receive slots of the NetGroups (pg/net_group.h); shared by an elastic group's views and
  // by sub-groups. Declared after `engine`: freed before it.
  std::shared_ptr<NetAreas> net_areas;
  std::unique_ptr<P2p> p2p;
  // Groups spanning hosts whose same-host ranks all map each other (DESIGN.md section 4):
  // `local` runs shm algorithms over this host's ranks (index 0, the lowest rank, is the
  // host's leader); `leaders` runs net algorithms over the hosts' leaders (set on leaders
  // only). Sub-groups own no buffer or channel of their own (the parent's), and their
  // Health names the user's ranks. Null on single-host groups.
  std::unique_ptr<Impl> local;
  std::unique_ptr<Impl> leaders;
  std::vector<int> host_of;       // with `local`: host index of every rank (0 = rank 0's)
  std::vector<int> local_ranks;   // with `local`: this host's ranks, ascending
  std::vector<int> leader_ranks;  // with `local`: every host's lowest rank, by host index
  std::vector<uint32_t> channels;  // claimed message channels (released in the destructor)
  std::string path;                // Communicator::path()
  std::unique_ptr<Worker> worker = std::make_unique<Worker>();

  // Elastic groups: this (root) Impl owns the engine, buffer, p2p and worker and indexes its
  // peers by slot; the controller owns the data plane of the current view (an Impl of its
  // own over the active slots: rank/size/peers/shm/net/local/leaders) that ops run on.
  std::unique_ptr<Elastic> elastic;

  uint64_t op_seq = 0;  // collectives started (the collective-running thread only)
  std::atomic<bool> broken{false};
  std::mutex broken_mu;
  std::string broken_what;  // first failure that broke the group
  int broken_rank = -1;

  ~Impl();

  // Runs one collective: fails fast when the group is broken, builds the op context, and
  // on a CommError poisons the group (later ops fail at once) and tells shm peers.
  // sig: what every rank must agree on (checked on the data path, then by finishOps).
  template <class Fn>
  void run(const char* name, const OpSig& sig, Fn&& fn);
  // After an op's algorithm: the agreement checks of every group the op used (ShmGroup /
  // NetGroup::finishOp); an op that used none runs one barrier on the widest group.
  void finishOps(const OpCtx& op);
  // Tells every group the op used that this rank gave up on it (blamed: a rank of the user's
  // group, -1 for none); see ShmGroup::abort / NetGroup::abort.
  void abortGroups(int blamed, const std::string& why);
  // The error of an op on a group that failed before (its first failure's text), for ops run
  // here and stream-ordered ones (pg/stream_ops.h) alike.
  CommError alreadyFailed(const char* op);
  // Records e as the group's failure (the first one stays), logs it and aborts the groups.
  void breakOn(const CommError& e);
};

// The group view's GPU halves (pg/device_stage.h), made on first use; needs c.shm.
inline DeviceHalves& deviceHalves(Communicator::Impl& c) {
  if (!c.dev_halves) c.dev_halves = std::make_unique<DeviceHalves>(*c.shm, c.params.gpu_halves);
  return *c.dev_halves;
}

// ---- set-up shared by plain groups and the views of elastic ones (pg/data_plane.cc) ----

// What a rank publishes about itself: its engine, its comm buffer and its segment.
struct RankRecord {
  std::string engine_name;
  uint64_t engine_id = 0;
  uint64_t buffer = 0;
  uint64_t buffer_bytes = 0;
  std::string segment;
  std::string serialize() const;
  static bool parse(std::string_view s, RankRecord* out);
};

// Message channels of a group: a hash of (kind, group) with the top bit set. Two communicators
// of one engine must not share one: claimed (std::invalid_argument on a collision).
uint32_t channelFor(const std::string& kind, const std::string& group);
void claimChannel(const engine::TransferEngine* e, uint32_t ch, const std::string& group);
void releaseChannel(const engine::TransferEngine* e, uint32_t ch);

// The path this rank can take over the given ranks ("shm": every buffer mapped; "local": this
// host's buffers mapped and MC_PG_HIERARCHICAL; else "net"). Every rank must then take the
// same: see buildDataPlane.
std::string localMode(const PgParams& p, const std::vector<char*>& bases,
                      const std::vector<std::string>& hosts, int rank);

// How a P2p of c gets its receive slots (c.net_areas, kind "p2p") when it first needs them.
std::function<std::shared_ptr<NetArea>()> p2pArea(const Communicator::Impl& c);

// Builds c's algorithms' state over its ranks: c.engine, rdv, opts, params, rank, size, peers
// and buffer_bytes must be set. bases/hosts: per rank (bases[rank] = this rank's buffer);
// modes: what every rank's localMode said. chan_tag names the group's message channels
// (claimed into c.channels); epoch tags the shm flags (0 for plain groups); names: the slot of
// each rank for errors (empty: the rank itself); retire: drop messages that arrive on the
// channels once c is gone (elastic views).
void buildDataPlane(Communicator::Impl& c, const std::vector<char*>& bases,
                    const std::vector<std::string>& hosts, const std::vector<std::string>& modes,
                    const std::string& chan_tag, uint64_t epoch, std::vector<int> names,
                    bool retire);

// A CommError every rank raises at the same point of the same op (e.g. allToAllV sizes
// that do not match): the ranks stay in step, so it does not poison the group.
class UsageError : public CommError {
 public:
  using CommError::CommError;
};

// ---- algorithm families: each picks shm or net and handles size() == 1 ----
namespace algo {

// The sources of a rank's share of a reducing step on one host (allreduce, reduce_scatter):
// peer r's data is in its GPU half or its host half (ShmGroup::gpuHalf, read after waiting for
// r's kReady); this rank's own source is given.
struct StepSources {
  std::vector<const void*> p;
  std::vector<char> gpu;  // p[r] is GPU memory
  bool all_gpu = false;
  explicit StepSources(int n) : p(n), gpu(n) {}
  // Peers' sources at byte `at` of their halves of step s.
  void build(Communicator::Impl& c, const OpCtx& op, uint64_t s, const void* mine, bool mine_gpu,
             size_t at);
};
// Whether a peer's data of step s is in its GPU half (after waiting for every kReady).
bool anyPeerOnGpu(Communicator::Impl& c, uint64_t s);
// A reduction whose sources are partly GPU memory (src.gpu) where the GPU cannot run it (some
// source is host memory, or no GPU form here): the GPU sources are copied into host memory
// with the device layer's copies, the CPU reduces, and the result goes to dst and dst2 (each
// GPU or host memory: *_gpu; either may be null).
void reduceMixed(const OpCtx& op, void* dst, bool dst_gpu, void* dst2, bool dst2_gpu,
                 const StepSources& src, size_t count, DataType t, ReduceOp rop);

void allReduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
               DataType t, ReduceOp rop);
void reduce(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t count,
            DataType t, ReduceOp rop, int root);
// allreduce with GPU memory on either side, moved in and out of the shared comm buffers by
// the device layer, when every rank maps every other's buffer (c.shm); false otherwise (the
// caller stages it through host memory, pg/device_stage.h).
// reduceScatter of GPU memory on one host (false: not this group's path; stage instead).
bool reduceScatterOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                           size_t count, DataType t, ReduceOp rop);
// reduce of GPU memory on one host (the same steps as reduce's host path; false: stage).
bool reduceOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                    size_t count, DataType t, ReduceOp rop, int root);
bool allReduceOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                       size_t count, DataType t, ReduceOp rop);
// allgatherv likewise (the input is this rank's block of the output or apart from it: the
// device layer's copies have memcpy semantics). Both take the same steps as the host path,
// so ranks with host buffers and ranks with GPU buffers meet in one op.
bool allGatherVOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                        const std::vector<size_t>& bytes);
void reduceScatter(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                   size_t count, DataType t, ReduceOp rop);
void broadcast(Communicator::Impl& c, const OpCtx& op, void* buf, size_t bytes, int root);
// gather() and scatter() on GPU memory through shared memory without staging; false when the
// group is not shm (the caller stages it). in and out must not overlap.
bool gatherOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                    size_t bytes, int root);
bool scatterOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                     size_t bytes, int root);
// broadcast() on GPU memory (buf) through shared memory without staging; false when the group
// is not shm (the caller stages it).
bool broadcastOnDevice(Communicator::Impl& c, const OpCtx& op, void* buf, size_t bytes,
                       int root);
void scatter(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t bytes,
             int root);
void allGatherV(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                const std::vector<size_t>& bytes);
void gather(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t bytes,
            int root);
void allToAllV(Communicator::Impl& c, const OpCtx& op, const void* in,
               const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
               void* out, const std::vector<size_t>& recv_bytes,
               const std::vector<size_t>& recv_offsets);
// allToAllV() on GPU memory (in and/or out) through shared memory without staging; false when
// the group is not shm (the caller stages it).
bool allToAllVOnDevice(Communicator::Impl& c, const OpCtx& op, const void* in,
                       const std::vector<size_t>& send_bytes,
                       const std::vector<size_t>& send_offsets, void* out,
                       const std::vector<size_t>& recv_bytes,
                       const std::vector<size_t>& recv_offsets);
void barrier(Communicator::Impl& c, const OpCtx& op);

// [begin, end) of part j when `count` elements are cut into n parts whose boundaries are
// multiples of `align` elements (the last part takes the rest).
inline size_t partBegin(size_t count, int n, int j, size_t align) {
  if (j >= n) return count;
  size_t per = count / static_cast<size_t>(n), rem = count % static_cast<size_t>(n);
  size_t b = per * static_cast<size_t>(j) + rem * static_cast<size_t>(j) / static_cast<size_t>(n);
  b -= b % align;
  return b;
}
// Elements per 64-byte line, the alignment of parts (so that ranks do not share lines).
inline size_t lineElems(size_t es) { return es >= 64 ? 1 : 64 / es; }
}  // namespace algo

}  // namespace mooncake::pg
