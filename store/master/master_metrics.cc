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
  }
  return os.str();
}

}  // namespace mooncake::store
