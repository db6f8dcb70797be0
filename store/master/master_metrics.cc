// Prometheus text exposition of MasterMetrics (served on /metrics by the master's HTTP side).
#include <sstream>

#include "store/master/master_types.h"

namespace mooncake::store {

std::string MasterMetrics::toPrometheus() const {
  std::ostringstream os;
  auto one = [&](const char* name, const char* type, const char* help, uint64_t v) {
    os << "# HELP mooncake_store_" << name << ' ' << help << '\n'
       << "# TYPE mooncake_store_" << name << ' ' << type << '\n'
       << "mooncake_store_" << name << ' ' << v << '\n';
  };
  one("objects", "gauge", "Complete objects.", objects);
  one("processing_objects", "gauge", "Puts started and not yet ended.", processing_objects);
  one("soft_pinned_objects", "gauge", "Complete objects holding a soft pin.", soft_pinned_objects);
  one("hard_pinned_objects", "gauge", "Complete hard-pinned objects.", hard_pinned_objects);
  one("bytes_used", "gauge", "Bytes reserved in mounted segments.", bytes_used);
  one("bytes_capacity", "gauge", "Bytes of all mounted segments.", bytes_capacity);
  one("segments", "gauge", "Mounted segments.", segments);
  one("clients", "gauge", "Clients the master considers alive.", clients);
  one("put_starts_total", "counter", "PutStart calls.", put_starts);
  one("put_ends_total", "counter", "Puts completed.", put_ends);
  one("put_revokes_total", "counter", "Puts revoked (explicitly, by client expiry or timeout).",
      put_revokes);
  one("gets_total", "counter", "Replica-list lookups.", gets);
  one("get_hits_total", "counter", "Replica-list lookups that found a complete object.", get_hits);
  one("removes_total", "counter", "Objects removed by request.", removes);
  one("evictions_total", "counter", "Objects evicted.", evictions);
  one("evicted_bytes_total", "counter", "Bytes freed by eviction.", evicted_bytes);
  one("eviction_rounds_total", "counter", "Eviction passes run.", eviction_rounds);
  one("allocation_failures_total", "counter", "Puts refused for lack of space.",
      allocation_failures);
  one("client_expirations_total", "counter", "Clients expired for silence.", client_expirations);
  one("clients_gone_total", "counter",
      "Clients whose engine was seen gone (their segments stopped taking replicas at once).",
      clients_gone);
  one("replicas_dropped_total", "counter", "Replicas lost with an unmounted segment.",
      replicas_dropped);
  one("slabs", "gauge", "Slabs writers hold (space reserved for their next puts).", slabs);
  one("slab_bytes", "gauge", "Bytes of slabs not yet published into.", slab_bytes);
  one("slab_grants_total", "counter", "Slabs granted.", slab_grants);
  one("publishes_total", "counter", "Objects published from slabs (one-round-trip puts).",
      publishes);
  os << "# HELP mooncake_store_master_role 1 for this master's current role.\n"
     << "# TYPE mooncake_store_master_role gauge\n";
  const char* roles[] = {"standby", "rebuilding", "serving"};
  for (int r = 0; r < 3; ++r)
    os << "mooncake_store_master_role{role=\"" << roles[r] << "\"} " << (role == r ? 1 : 0) << '\n';
  one("leader", "gauge", "1 when this master leads (rebuilding or serving), 0 on standby.",
      role != 0 ? 1 : 0);
  one("epoch", "gauge", "This master's epoch (a new one after every failover or restart).", epoch);
  one("leader_elections_total", "counter", "Times this master became leader.", leader_elections);
  one("failovers_total", "counter",
      "Times this master took over from a previous leader (or restarted and rebuilt).", failovers);
  one("rebuilds_total", "counter", "Metadata rebuilds completed.", rebuilds);
  os << "# HELP mooncake_store_rebuild_duration_seconds Duration of the last metadata rebuild.\n"
     << "# TYPE mooncake_store_rebuild_duration_seconds gauge\n"
     << "mooncake_store_rebuild_duration_seconds " << last_rebuild_seconds << '\n';
  one("rebuild_clients_total", "counter", "Clients that reported in rebuilds.", rebuild_clients);
  one("objects_recovered_total", "counter", "Objects rebuilt from what the clients hold.",
      objects_recovered);
  one("objects_revoked_total", "counter",
      "Puts found unfinished (or without a complete replica) in a rebuild, dropped.",
      objects_revoked);
  one("records_wiped_total", "counter", "Records wiped before their memory was reused.",
      records_wiped);
  if (!rpcs.empty()) {
    os << "# HELP mooncake_store_rpc_calls_total Master RPCs served, by method.\n"
       << "# TYPE mooncake_store_rpc_calls_total counter\n";
    for (const RpcStat& r : rpcs)
      os << "mooncake_store_rpc_calls_total{method=\"" << r.method << "\"} " << r.calls << '\n';
    os << "# HELP mooncake_store_rpc_errors_total Master RPCs answered with an error code.\n"
       << "# TYPE mooncake_store_rpc_errors_total counter\n";
    for (const RpcStat& r : rpcs)
      os << "mooncake_store_rpc_errors_total{method=\"" << r.method << "\"} " << r.errors << '\n';
    os << "# HELP mooncake_store_rpc_seconds_total Time spent serving master RPCs.\n"
       << "# TYPE mooncake_store_rpc_seconds_total counter\n";
    for (const RpcStat& r : rpcs)
      os << "mooncake_store_rpc_seconds_total{method=\"" << r.method << "\"} "
         << static_cast<double>(r.total_ns) * 1e-9 << '\n';
    os << "# HELP mooncake_store_rpc_duration_seconds Time the master spent serving an RPC.\n"
       << "# TYPE mooncake_store_rpc_duration_seconds histogram\n";
    for (const RpcStat& r : rpcs) {
      if (r.buckets.size() != static_cast<size_t>(kLatencyBuckets)) continue;
      uint64_t cum = 0;
      for (int b = 0; b < kLatencyBuckets; ++b) {
        cum += r.buckets[b];
        os << "mooncake_store_rpc_duration_seconds_bucket{method=\"" << r.method << "\",le=\"";
        if (b + 1 < kLatencyBuckets)
          os << kLatencyBucketsUs[b] * 1e-6;
        else
          os << "+Inf";
        os << "\"} " << cum << '\n';
      }
      os << "mooncake_store_rpc_duration_seconds_sum{method=\"" << r.method << "\"} "
         << static_cast<double>(r.total_ns) * 1e-9 << '\n'
         << "mooncake_store_rpc_duration_seconds_count{method=\"" << r.method << "\"} " << cum
         << '\n';
    }
  }
  return os.str();
}

}  // namespace mooncake::store
