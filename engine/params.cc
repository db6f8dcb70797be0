#include "engine/params.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace mooncake::params {

namespace {

// Built on first use, so that code running before main() (a test's static initialiser) may
// read parameters whatever the order of static initialisation across files.
const std::vector<ParamDef>& table() {
  static const std::vector<ParamDef> kParams = {
      // ---- engine ----
      {"MC_LOG_LEVEL", Type::kString, "WARN", "Log level: ERROR, WARN, INFO, DEBUG or TRACE."},
      {"MC_LOG_SUBSYS", Type::kString, "ALL",
       "Comma-separated subsystems to log (ENGINE,SHM,TCP,RDMA,CUDA,PG,EP,STORE) or ALL; a "
       "leading ^ excludes the listed ones."},
      {"MC_TRANSPORT", Type::kString, "",
       "Force one transport for every peer (shm, rdma or tcp); empty chooses by locality (shm on "
       "one host, rdma between hosts that both publish a NIC of the same link layer, tcp "
       "otherwise)."},
      {"MC_TCP_CONNS_PER_PEER", Type::kInt, "2",
       "Data connections a tcp peer opens to another (besides the control connection)."},
      {"MC_TCP_SLICE_BYTES", Type::kInt, "1048576",
       "Large tcp requests are cut into slices of this many bytes, spread over connections."},
      {"MC_TCP_BIND_HOST", Type::kString, "",
       "Address the engine's tcp listener binds (and advertises, unless MC_TCP_ADVERTISE_HOST "
       "says otherwise). Empty: the local address that routes to the job's rendezvous or master "
       "(127.0.0.1 when that is on this host), else the first non-loopback IPv4 address. "
       "0.0.0.0 listens on every interface (explicit opt-in)."},
      {"MC_TCP_ADVERTISE_HOST", Type::kString, "",
       "Address peers use to reach this engine; empty: the address it binds (with 0.0.0.0, the "
       "first non-loopback IPv4 address, or 127.0.0.1)."},
      {"MC_TCP_PORT", Type::kInt, "0", "Port of the engine's tcp listener; 0 picks a free one."},
      {"MC_TCP_USER_TIMEOUT_MS", Type::kInt, "16000",
       "Engine tcp connections (tcp transport peers, tcp rendezvous): one whose sent data stays "
       "unacknowledged this long (the peer's host vanished, no FIN or RST) errors and its peer "
       "is failed (TCP_USER_TIMEOUT; without it Linux retransmits for ~15 minutes). Also fails "
       "a peer that advertised a zero window this long (stopped reading: a stopped process). "
       "Idle connections are probed by keepalive after 10 s of silence, every 2 s; one left "
       "unanswered is closed about this long after the peer was last heard (at least 12 s). 0: "
       "the kernel's default (an idle one is then closed after 16 s)."},
      {"MC_CONNECT_TIMEOUT_MS", Type::kInt, "10000",
       "Deadline for opening a peer (connect and handshake)."},
      {"MC_HOST_ID", Type::kString, "",
       "Override the host identity used to decide that two engines share memory (default: "
       "boot id + network namespace + pid namespace)."},
      {"MC_SHM_PREFIX", Type::kString, "mc",
       "Prefix of the shared-memory files the engine creates."},
      {"MC_SPIN_US", Type::kInt, "50",
       "Microseconds a waiter spins before it blocks (futex / condition variable)."},
      {"MC_SHM_WARM_AFTER", Type::kInt, "8",
       "shm transport: a page of a peer's region this process has not touched through its "
       "mapping is copied with pread/pwrite on the region's file (no page fault in this process) "
       "until it has been copied this many times; then through the mapping. 0: always through "
       "the mapping."},
      {"MC_INBOX_SLOTS", Type::kInt, "256", "Slots of a process's notification/message inbox."},
      {"MC_SECRET", Type::kString, "",
       "Job secret every peer must present (engine handshakes, rendezvous, store master); at "
       "least 32 characters. Set: used as is by every component (mooncake_master: unless "
       "--secret-file is given). Empty: a torch group generates one on its first rank and "
       "shares it through the group's c10d store; the store master and its clients read "
       "MC_SECRET_FILE."},
      {"MC_SECRET_FILE", Type::kString, "",
       "File holding the job secret for the store master and store clients (and for any engine "
       "when set). Empty: ~/.mooncake/secret, which mooncake_master creates (mode 0600) when it "
       "is missing. A file readable by group or others is refused."},
      {"MC_ALLOW_NO_SECRET", Type::kBool, "0",
       "1: run without a job secret (any process that reaches a port may read and write "
       "registered memory). Without it an empty secret is refused."},
      {"MC_HANDSHAKE_TIMEOUT_MS", Type::kInt, "5000",
       "A connection that has not authenticated (engine HELLO, rendezvous AUTH) within this "
       "long is closed."},
      {"MC_MAX_PREAUTH_PER_SOURCE", Type::kInt, "128",
       "Connections from one source address that may be waiting to authenticate at once; more "
       "are closed as they arrive (an engine opening a peer retries such a close until its "
       "deadline)."},
      {"MC_MAX_PREAUTH", Type::kInt, "1024",
       "Connections (all sources) that may be waiting to authenticate at once, per listener "
       "(each may hold at most 4 KiB before it authenticates); at most a quarter of the "
       "process's descriptor limit (RLIMIT_NOFILE), and at least 16."},
      {"MC_MAX_CONNS", Type::kInt, "16384",
       "Connections a listener (engine, rendezvous) holds at once, authenticated or not."},
      {"MC_RDMA_DEVICES", Type::kString, "",
       "Comma-separated RDMA NIC names the rdma transport may use (empty: every NIC whose port "
       "1 is active)."},
      {"MC_RDMA_GID_INDEX", Type::kInt, "-1",
       "RoCE GID index (-1: the RoCE v2 GID holding an IPv4-mapped address). Ignored on "
       "InfiniBand, which is addressed by LID."},
      {"MC_RDMA_SLICE_BYTES", Type::kInt, "1048576",
       "Largest RDMA READ/WRITE work request the rdma transport posts (requests are cut into "
       "slices of this size)."},
      {"MC_RDMA_MAX_WR", Type::kInt, "64",
       "Work requests the rdma transport keeps outstanding per queue pair (the rest wait in "
       "order)."},
      {"MC_RDMA_SPIN_US", Type::kInt, "-1",
       "How long an rdma completion poller busy-polls after the last completion before it "
       "sleeps on the completion channel. -1: 50 on a machine with 8 or more CPUs, 0 below "
       "(a spinning poller per NIC takes a core the application needs: docs/perf/engine.md)."},
      {"MC_RDMA_QPS_PER_EP", Type::kInt, "1",
       "RC queue pairs (lanes) per local NIC to each peer (1-16; at most 63 per peer in all): "
       "a request's slices go round robin over the lanes of its NICs."},
      {"MC_RDMA_RETRY_MS", Type::kInt, "1000",
       "After a work request fails on an rdma NIC (its slices move to another NIC), how long "
       "before that NIC is tried again for the peer (its port must be up)."},
      {"MC_RDMA_MAX_ENDPOINTS", Type::kInt, "4096",
       "Peers an rdma NIC keeps connected queue pairs to (an endpoint: a peer on a local NIC, "
       "MC_RDMA_QPS_PER_EP QPs). Beyond it the least recently used idle endpoints are closed "
       "(at both ends) and dialled again on their next use. 0: no limit."},
      {"MC_RDMA_STALL_MS", Type::kInt, "5000",
       "An rdma queue pair with work requests outstanding and no completion for this long is "
       "taken for a stalled NIC: failed, its work moved to another NIC (or to tcp). 0: never."},
      {"MC_RDMA_TCP_FALLBACK", Type::kBool, "1",
       "1: when no NIC reaches a peer any more, the rdma transport carries its reads, writes and "
       "notifications over the engine's tcp control link to it until a NIC is back. 0: such "
       "requests fail, naming the peer, the operation and every NIC's error."},
      {"MC_RDMA_TRAFFIC_CLASS", Type::kInt, "0",
       "Traffic class (0-255: DSCP * 4 + ECN bits) in the GRH of the rdma transport's RoCE QPs, as "
       "NCCL_IB_TC; what a lossless (PFC) or ECN-marked class needs is the fabric's choice."},
      {"MC_RDMA_SERVICE_LEVEL", Type::kInt, "0",
       "Service level (0-15) of the rdma transport's QPs, as NCCL_IB_SL (InfiniBand: the SL "
       "the fabric maps to a virtual lane; RoCE: the VLAN priority where the NIC uses it)."},
      {"MC_RDMA_STRIPE", Type::kString, "near",
       "Which NICs carry a request's slices: near (the NICs nearest to its local buffer: same "
       "PCI switch, else same NUMA node, else all; docs/rdma.md) or all (every NIC)."},
      {"MC_TOPOLOGY_XML", Type::kString, "",
       "hwloc XML file (lstopo's format) to read the machine's topology from instead of "
       "probing it: which NICs, GPUs and NUMA nodes are near each other."},
      {"MC_DEVICE", Type::kString, "auto",
       "The device layer for GPU memory (MemoryKind::kCuda): auto (the CUDA driver when one is "
       "installed and sees a device), cuda, sim (a host simulation: device memory is shared host "
       "memory; for tests) or none."},
      {"MC_DEVICE_SPIN_US", Type::kInt, "200",
       "CUDA: how long a host thread that waits for the device's copies or kernels (an event of "
       "the engine's copy stream) polls, yielding, before it sleeps 20 us at a time: a step of "
       "a GPU collective on small data finishes within it."},
      {"MC_BOUNCE_BYTES", Type::kInt, "67108864",
       "Registered host memory the engine lends to transports that need the local side of a "
       "request registered (rdma), for requests from unregistered memory; allocated on first "
       "use."},
      {"MC_BOUNCE_CHUNK_BYTES", Type::kInt, "1048576",
       "Size of one bounce-pool chunk (requests from unregistered memory move through chunks "
       "of this size)."},
      {"MC_RENDEZVOUS_TIMEOUT_MS", Type::kInt, "60000",
       "Deadline for rendezvous waits (segment exchange)."},
      {"MC_RENDEZVOUS_MAX_VALUE_BYTES", Type::kInt, "4194304",
       "Largest value the tcp rendezvous server stores (segment descriptors are a few KiB)."},
      {"MC_RENDEZVOUS_MAX_TOTAL_BYTES", Type::kInt, "268435456",
       "Keys and values the tcp rendezvous server holds in all; a set beyond it is refused."},
      // ---- mooncake.engine (upstream Mooncake's Python TransferEngine) ----
      {"MC_FORCE_TCP", Type::kBool, "0",
       "mooncake.engine: 1 carries every transfer over tcp, also to same-host peers (which use "
       "shared memory otherwise) and to peers an RDMA NIC reaches. Upstream Mooncake's switch "
       "from RDMA to tcp."},
      {"MC_TRANSFER_TIMEOUT", Type::kInt, "30",
       "mooncake.engine: seconds a transfer batch may take (at least 5), plus 1 ns per byte, "
       "as upstream Mooncake's budget; a batch past it fails."},
      // ---- the verbs emulator (tests/fakes/verbs: test infrastructure, never in the product) ----
      {"MC_FAKE_VERBS_CONFIG", Type::kString, "",
       "Verbs emulator only: the file listing its NICs (names, host, PCI address, link layer, "
       "LID or IP, MTU, max_mr_size, bandwidth cap, initial port state)."},
      {"MC_FAKE_VERBS_FABRIC", Type::kString, "",
       "Verbs emulator only: the name of its shared-memory fabric (processes with the same name "
       "reach each other's QPs); empty: derived from the config file's path."},
      {"MC_FAKE_VERBS_GBPS", Type::kDouble, "0",
       "Verbs emulator only: bandwidth cap per emulated NIC in Gbit/s (0: none), unless the "
       "config gives the NIC its own."},
      {"MC_FAKE_VERBS_ACK_TIMEOUT_MS", Type::kInt, "0",
       "Verbs emulator only: transport timeout of its QPs (0: from the QP's timeout and "
       "retry_cnt, as RC specifies)."},
      {"MC_FAKE_VERBS_RING_BYTES", Type::kInt, "1048576",
       "Verbs emulator only: bytes of the shared-memory ring each of its QPs receives into."},
      // ---- pg ----
      {"MC_PG_BUFFER_BYTES", Type::kInt, "8388608",
       "Bytes of the comm buffer a process group registers per rank (two halves; plus a "
       "header page). Same-host collectives stream through it."},
      {"MC_PG_CHUNK_BYTES", Type::kInt, "2097152",
       "Pipeline step of the same-host 2-phase allreduce (at most half the buffer)."},
      {"MC_PG_FLAT_BYTES", Type::kInt, "16384",
       "Allreduce/reduce payloads up to this size use the flat exchange (every rank reduces "
       "all inputs) instead of reduce-scatter + all-gather."},
      {"MC_PG_NET_PIECE_BYTES", Type::kInt, "1048576",
       "Message size of the process group's non-shm path and of large send/recv: the size of "
       "one receive slot (smaller in large groups: a kind of group's slots take at most 64 "
       "MiB per rank, and as much again for the staging copies)."},
      {"MC_PG_NET_SLOTS", Type::kInt, "8",
       "Receive slots per sender on the process group's non-shm path: collective messages "
       "of at least MC_PG_NET_SLOT_MIN_BYTES to the peers MC_PG_NET_ONE_SIDED names are "
       "written one-sidedly into them. 0: every message is two-sided."},
      {"MC_PG_NET_ONE_SIDED", Type::kString, "rdma",
       "Which peers of the non-shm path get collective messages one-sidedly (into receive "
       "slots): rdma (those reached over rdma, whose two-sided messages would take the tcp "
       "control link), all (tcp peers too: there a one-sided write is itself a socket message "
       "and the extra notification and credit frames cost time, docs/perf/pg.md), none."},
      {"MC_PG_NET_SLOT_MIN_BYTES", Type::kInt, "4096",
       "Smaller collective messages on the non-shm path are two-sided (one frame instead of "
       "a write, a notification and a credit back)."},
      {"MC_PG_STREAM_OUT_BYTES", Type::kInt, "4194304",
       "Collective outputs (and EP normal-mode recv_x) at least this large are written with "
       "streaming (non-temporal) stores: they would leave the cache anyway, and this saves "
       "reading every line first."},
      {"MC_PG_SPIN_US", Type::kInt, "50",
       "Microseconds a process-group wait spins before it sleeps on a futex (0 when the "
       "group's ranks outnumber the cores)."},
      {"MC_PG_YIELD_US", Type::kInt, "200",
       "When the group's ranks outnumber the cores: microseconds a wait yields the core "
       "(sched_yield) before it sleeps on a futex."},
      {"MC_PG_HANDOFF_US", Type::kInt, "1000",
       "torch backend: a collective is run by the thread that waits on it; one that no thread "
       "started is handed to the group's worker thread by the process's hand-off thread, which "
       "looks this often while ops are pending (backing off to 16x while it finds none). 0: "
       "every op goes to the worker when it is issued."},
      {"MC_PG_BLOCKING_WAIT", Type::kBool, "1",
       "torch backend, host-driven ops on CUDA tensors (not the stream-ordered ones, "
       "MC_PG_STREAM_OPS): Work.wait() blocks the calling thread until the op "
       "completes (like TORCH_NCCL_BLOCKING_WAIT=1). 0: it makes the caller's current CUDA "
       "streams wait for the op instead (a gate, as NCCL's wait), which deadlocked on the GPU "
       "machine's first run and whose fix has not run on a GPU yet (docs/gpu.md)."},
      {"MC_PG_PROFILE", Type::kBool, "0",
       "Process group: time every op and the phases inside it (waits for peers' flags, waits "
       "for GPU copies, queueing GPU work) in process-wide counters (pg/profile.h), which "
       "pg_perf --profile 1 and tests/gpu/pg_check print. Off: one relaxed load per phase."},
      {"MC_PG_HEALTH_US", Type::kInt, "1000",
       "How often a waiting process-group op checks peer liveness and its deadline."},
      {"MC_PG_HIERARCHICAL", Type::kBool, "1",
       "Groups that span hosts: allreduce (not AVG), allgather and broadcast run within each "
       "host through shared memory and between one leader per host, alltoall moves same-host "
       "blocks through shared memory (0: every rank exchanges messages with every other)."},
      {"MC_PG_GPU_HALVES", Type::kBool, "1",
       "Same-host groups: allgather, broadcast and all_to_all put a rank's GPU data into GPU "
       "comm halves of its own that peers open through the device layer's IPC (device to "
       "device). 0: this rank's GPU data goes through the host halves (peers still read others' "
       "GPU halves)."},
      {"MC_PG_STREAM_OPS", Type::kString, "auto",
       "Same-host groups, every collective of GPU memory (torch backend: all_reduce, broadcast, "
       "reduce, all_gather and all_gather_into_tensor, gather, scatter, reduce_scatter and "
       "reduce_scatter_tensor, the coalesced forms, all_to_all_single, all_to_all) and "
       "send/recv (on a stream per peer and direction, ordered after the caller's; groups of at "
       "most 32 ranks): queued on "
       "the caller's "
       "stream -- copies, stream memory operations on flag words in the ranks' GPU memory and "
       "the reduction kernel -- so no host thread waits for them (pg/stream_ops.h); all ranks "
       "of a group must then call these on GPU tensors. auto: with the CUDA device layer "
       "(the simulation's stream is host threads competing with the ranks for the cores, "
       "slower than its host-driven path: docs/gpu.md); 1: with any device layer (tests); 0: "
       "never (the host-driven path)."},
      {"MC_PG_STREAM_OPS_CHUNK_BYTES", Type::kInt, "8388608",
       "Stream-ordered collectives: bytes per step; each rank keeps two buffers of this size in "
       "GPU memory per group."},
      {"MC_PG_STREAM_OPS_ONESHOT_BYTES", Type::kInt, "262144",
       "Stream-ordered allreduce of at most this many bytes: every rank reduces the whole "
       "op from every rank's buffer (one exchange a step); larger ones reduce a slice each "
       "and copy the others' slices (two exchanges, 1/n of the reduction work). Not tuned."},
      {"MC_PG_STREAM_P2P_SLOT_BYTES", Type::kInt, "4194304",
       "Stream-ordered send/recv (MC_PG_STREAM_OPS): bytes per step of a message; each rank "
       "keeps two slots of this size per peer in GPU memory (the sender's, which its receiver "
       "reads), made at its first such send or recv in a group."},
      {"MC_PG_GPU_P2P", Type::kBool, "1",
       "Plain groups: send/recv of GPU memory to a rank on the same host goes device to device "
       "through staging buffers in the sender's GPU memory that the receiver opens through the "
       "device layer's IPC. 0: through pinned host memory and the engine's messages."},
      {"MC_PG_P2P_STAGE_BYTES", Type::kInt, "131072",
       "Plain groups: send/recv of host memory of at least this many bytes to a rank on the "
       "same host goes through staging buffers in the sender's shared memory that the "
       "receiver copies out of (two copies), instead of the engine's messages (0: never)."},
      {"MC_PG_ELASTIC_POLL_MS", Type::kInt, "50",
       "Elastic groups: how often each communicator's agent reads the group's views and "
       "observation requests from the store when no doorbell or peer death woke it first."},
      // ---- ep ----
      {"MC_EP_SPIN_US", Type::kInt, "20",
       "Microseconds an EP receiver spins on its signal words before it sleeps on the buffer's "
       "doorbell (futex)."},
      {"MC_EP_KERNELS", Type::kString, "cpu",
       "EP calls on CPU tensors: cpu (the CPU path's loops), host (the CUDA kernels' bodies, "
       "ep/kernels/, one lane on the calling thread) or threads (the same with 4 lane threads a "
       "block); host and threads only where every peer's buffer is mapped, else cpu: how the "
       "kernels' logic is tested without a GPU."},
      {"MC_EP_STREAM_CALLS", Type::kString, "auto",
       "EP low-latency dispatch/combine on a GPU buffer: 1 queues the kernels on the buffer's "
       "stream after the caller's current stream and returns (no host wait; a failure is "
       "raised by the buffer's next call or event.wait()); 0 waits on the host for the caller's "
       "stream and the kernels and raises at once; auto: 1 on the CUDA device layer, 0 on its "
       "simulation."},
      {"MC_EP_TIMEOUT_MS", Type::kInt, "30000",
       "Deadline of EP normal-mode waits and of EP writes to peers reached over the engine "
       "(low-latency receives use the call's timeout_us instead)."},
      {"MC_EP_PROXY_DELAY_MS", Type::kInt, "0",
       "Tests: the host proxy of an EP buffer in GPU memory whose group spans hosts waits this "
       "long before it moves each send's rows, so that a later send reusing the same stage "
       "must wait for the move (ep/ll_proxy.h). 0 in production."},
      // ---- store ----
      {"MC_STORE_LEASE_TTL_MS", Type::kInt, "5000",
       "Lease a store read grants: the object cannot be removed or evicted for this long."},
      {"MC_STORE_SOFT_PIN_TTL_MS", Type::kInt, "1800000",
       "A soft pin lapses after this long without a read (then the object is evicted as any)."},
      {"MC_STORE_EVICTION_HIGH_WATERMARK", Type::kDouble, "0.95",
       "The store master evicts when bytes used pass this share of the mounted capacity."},
      {"MC_STORE_EVICTION_RATIO", Type::kDouble, "0.05",
       "Share of evictable objects (least recently used first) one eviction round removes."},
      {"MC_STORE_CLIENT_TTL_S", Type::kInt, "10",
       "A store client silent this long is expired: its segments unmounted, its puts revoked."},
      {"MC_STORE_PUT_DISCARD_TIMEOUT_S", Type::kInt, "30",
       "A store put not ended after this long may be taken over by a new put of the same key."},
      {"MC_STORE_PUT_RELEASE_TIMEOUT_S", Type::kInt, "600",
       "A store put not ended after this long is revoked and its memory freed."},
      {"MC_STORE_ONE_RTT_PUT", Type::kBool, "1",
       "Store clients put through slabs (one round trip to the master per put or batch); 0: the "
       "PutStart/PutEnd path (two round trips), kept for comparison."},
      {"MC_STORE_SEGMENT_DEVICE", Type::kString, "",
       "Where a store client's segment (the memory it lends to the store) lives: empty or cpu: "
       "host memory; cuda:N (or gpu:N, N): GPU memory of device N, through the engine's device "
       "layer (MC_DEVICE), so that gets into and puts from GPU buffers move device to device."},
      {"MC_STORE_HEARTBEAT_MISSES", Type::kInt, "3",
       "A store client gives up on a master that answered none of this many heartbeats in a row "
       "(it hangs: stopped, deadlocked, overloaded) and looks for the master (the leader in "
       "etcd) again; with etcd it also does so at the first unanswered heartbeat when the "
       "leader key names another master."},
      {"MC_STORE_CLUSTER_ID", Type::kString, "mooncake",
       "Store cluster an etcd:// master address (clients) or mooncake_master --etcd-endpoints "
       "(without --cluster-id) belongs to: its etcd keys live under mooncake-store/<id>/."},
      {"MC_ETCD_USER", Type::kString, "",
       "etcd user the store's etcd client (mooncake_master --etcd-endpoints, clients with an "
       "etcd:// address) authenticates as (etcd auth enabled; the user needs readwrite on the "
       "prefix mooncake-store/). Empty: no authentication. Needs MC_ETCD_PASSWORD_FILE; "
       "mooncake_master --etcd-user overrides it."},
      {"MC_ETCD_PASSWORD_FILE", Type::kString, "",
       "File whose first line is the password of MC_ETCD_USER (a regular file of this user, "
       "mode 0600; there is no password variable: the environment leaks into child processes "
       "and /proc). mooncake_master --etcd-password-file overrides it."},
      {"MC_ETCD_CA_FILE", Type::kString, "",
       "PEM CA bundle that verifies etcd's certificate on https:// endpoints (empty: the "
       "system's CAs); the certificate must name the endpoint's host. Set (or a client "
       "certificate set): endpoints without a scheme use https. mooncake_master --etcd-ca-file "
       "overrides it."},
      {"MC_ETCD_CERT_FILE", Type::kString, "",
       "PEM client certificate the etcd client presents on https:// endpoints (etcd's "
       "--client-cert-auth); needs MC_ETCD_KEY_FILE. mooncake_master --etcd-cert-file "
       "overrides it."},
      {"MC_ETCD_KEY_FILE", Type::kString, "",
       "PEM private key of MC_ETCD_CERT_FILE. mooncake_master --etcd-key-file overrides it."},
  };
  return kParams;
}

const ParamDef* lookup(const char* name) {
  for (const auto& p : table())
    if (std::strcmp(p.name, name) == 0) return &p;
  std::fprintf(stderr, "mooncake: parameter %s is not in the registry (engine/params.cc)\n", name);
  std::abort();
}

const char* raw(const char* name) {
  const ParamDef* p = lookup(name);
  const char* v = std::getenv(name);
  return (v != nullptr) ? v : p->default_value;
}

}  // namespace

const std::vector<ParamDef>& all() { return table(); }

bool isSet(const char* name) {
  lookup(name);
  return std::getenv(name) != nullptr;
}

int64_t getInt(const char* name) {
  const char* v = raw(name);
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 0);
  if (end == v) x = std::strtoll(lookup(name)->default_value, nullptr, 0);
  return x;
}

double getDouble(const char* name) {
  const char* v = raw(name);
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (end == v) x = std::strtod(lookup(name)->default_value, nullptr);
  return x;
}

bool getBool(const char* name) {
  std::string v = raw(name);
  return v == "1" || v == "true" || v == "TRUE" || v == "yes" || v == "on";
}

std::string getString(const char* name) { return raw(name); }

std::string getSystem(const char* name) {
  static const char* const kAllowed[] = {"HOME", "LD_LIBRARY_PATH"};
  for (const char* a : kAllowed) {
    if (std::strcmp(a, name) == 0) {
      const char* v = std::getenv(name);
      return v != nullptr ? v : "";
    }
  }
  std::fprintf(stderr, "mooncake: %s is not a system variable params::getSystem may read\n", name);
  std::abort();
}

std::string markdown() {
  std::ostringstream os;
  os << "# Environment parameters\n\n"
     << "Generated from the registry in `engine/params.cc` by `build/engine/mc_params "
        "--markdown`;\n"
     << "a test fails when this file and the registry disagree.\n\n"
     << "| name | type | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const auto& p : table()) {
    const char* t = p.type == Type::kInt      ? "int"
                    : p.type == Type::kBool   ? "bool"
                    : p.type == Type::kDouble ? "double"
                                              : "string";
    os << "| `" << p.name << "` | " << t << " | `" << p.default_value << "` | " << p.doc
       << " |\n";
  }
  return os.str();
}

}  // namespace mooncake::params
