// MasterService::handle(): the master's RPC surface. Decodes a store.proto RequestEnvelope,
// calls the service, encodes the ResponseEnvelope. Transport-agnostic and defensive: any byte
// string gets an answer, never an exception or a crash.
#include <algorithm>
#include <chrono>
#include <climits>

#include "store/master/master_service.h"
#include "store/proto/store.pb.h"

namespace mooncake::store {

namespace pb = ::mooncake::store::proto;

static_assert(pb::Method_ARRAYSIZE == 24, "update MasterService::kRpcMethods");

namespace {

ReplicateConfig fromProto(const pb::ReplicateConfig& c) {
  ReplicateConfig out;
  out.replica_num = c.replica_num() == 0 ? 1 : c.replica_num();
  out.with_soft_pin = c.with_soft_pin();
  out.with_hard_pin = c.with_hard_pin();
  out.preferred_segment = c.preferred_segment();
  out.preferred_segments.assign(c.preferred_segments().begin(), c.preferred_segments().end());
  out.soft_pin_ttl_ms = c.soft_pin_ttl_ms();
  out.keep_soft_pin = c.keep_soft_pin();
  return out;
}

void toProto(const ReplicaPlacement& r, pb::Replica* out, bool with_tags = false) {
  for (const Piece& p : r.pieces) {
    pb::Piece* q = out->add_pieces();
    q->set_segment_id(p.segment_id);
    q->set_segment_name(p.segment_name);
    q->set_client_id(p.client_id);
    q->set_offset(p.offset);
    q->set_address(p.address);
    q->set_length(p.length);
    if (with_tags) q->set_record_tag(p.record_tag);  // writers only: readers skip records
  }
}

void toProto(const SlabGrant& g, pb::Slab* out) {
  out->set_slab_id(g.id);
  out->set_bytes(g.bytes);
  for (const SlabExtentInfo& e : g.extents) {
    pb::SlabExtent* x = out->add_extents();
    x->set_segment_id(e.segment_id);
    x->set_segment_name(e.segment_name);
    x->set_client_id(e.client_id);
    x->set_address(e.address);
    x->set_record_tag(e.record_tag);
  }
}

std::vector<uint64_t> idsOf(const google::protobuf::RepeatedField<uint64_t>& ids) {
  return std::vector<uint64_t>(ids.begin(), ids.end());
}

// Calls that a rebuilding master serves: what clients need to register and report.
bool servedWhileRebuilding(int method) {
  return method == pb::HEARTBEAT || method == pb::MOUNT_SEGMENT || method == pb::UNMOUNT_SEGMENT ||
         method == pb::REPORT_OBJECTS;
}

void toProto(const ErrorOr<MasterService::ReplicaList>& r, pb::GetReplicaListResponse* out) {
  out->set_error_code(toInt(r.error()));
  if (!r.ok()) return;
  out->set_size(r->size);
  out->set_lease_ttl_ms(r->lease_ttl_ms);
  for (const ReplicaPlacement& p : r->replicas) toProto(p, out->add_replicas());
}

// Parses Req from `body`, runs fn(req, resp), serializes Resp into `out`. False when the body is
// not a valid Req.
template <typename Req, typename Resp, typename Fn>
bool serve(const std::string& body, std::string* out, int32_t* call_error, Fn&& fn) {
  Req req;
  if (body.size() > static_cast<size_t>(INT_MAX) || !req.ParseFromString(body)) return false;
  Resp resp;
  fn(req, resp);
  *call_error = resp.error_code();
  return resp.SerializeToString(out);
}

std::vector<std::string> keysOf(const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

}  // namespace

std::string MasterService::handle(std::string_view request_bytes, const std::string* caller) {
  const auto t0 = std::chrono::steady_clock::now();
  // A remote call acts in the name of the client its connection authenticated as, never in
  // the name its body claims.
  auto impersonates = [caller](const std::string& claimed) {
    return caller != nullptr && claimed != *caller;
  };
  constexpr int32_t kIllegal = static_cast<int32_t>(ErrorCode::ILLEGAL_CLIENT);
  // PUT_START and each put of a BATCH_PUT_START.
  auto put_start = [this](const std::string& client_id, const pb::PutStartRequest& q,
                          pb::PutStartResponse* r) {
    uint64_t token = 0;
    auto res = putStart(client_id, q.key(), q.size(), fromProto(q.config()), &token);
    r->set_error_code(toInt(res.error()));
    if (res.ok())
      for (const ReplicaPlacement& p : *res) toProto(p, r->add_replicas(), true);
    r->set_release_after_ms(std::max<uint64_t>(1, config_.put_release_timeout_ms));
    r->set_put_token(token);
  };
  pb::ResponseEnvelope resp;
  int method_index = -1;
  int32_t call_error = 0;
  try {
    pb::RequestEnvelope env;
    if (request_bytes.size() > static_cast<size_t>(INT_MAX) ||
        !env.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size()))) {
      resp.set_error_code(toInt(ErrorCode::INVALID_PARAMS));
      return resp.SerializeAsString();
    }
    resp.set_rpc_id(env.rpc_id());
    resp.set_method(env.method());
    if (env.method() >= 0 && env.method() < kRpcMethods) method_index = env.method();
    resp.set_epoch(epoch());
    const MasterRole role_now = role();
    if (role_now == MasterRole::kStandby ||
        (role_now == MasterRole::kRebuilding && !servedWhileRebuilding(env.method()))) {
      resp.set_error_code(toInt(role_now == MasterRole::kStandby
                                    ? ErrorCode::UNAVAILABLE_IN_CURRENT_MODE
                                    : ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS));
      resp.set_epoch(epoch());
      return resp.SerializeAsString();
    }
    const std::string& body = env.body();
    std::string* out = resp.mutable_body();
    bool decoded = false;
    switch (env.method()) {
      case pb::MOUNT_SEGMENT:
        decoded = serve<pb::MountSegmentRequest, pb::MountSegmentResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              // No client id at all is a malformed call (INVALID_PARAMS), not an impersonation.
              if (!q.client_id().empty() && impersonates(q.client_id()))
                return r.set_error_code(kIllegal);
              auto res = mountSegment(q.client_id(), q.segment_name(), q.base(), q.size(),
                                      q.record_tag(), q.will_report());
              r.set_error_code(toInt(res.error()));
              if (res.ok()) r.set_segment_id(*res);
            });
        break;
      case pb::UNMOUNT_SEGMENT:
        decoded = serve<pb::UnmountSegmentRequest, pb::UnmountSegmentResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              ErrorCode e = q.segment_id() != 0
                                ? unmountSegment(q.client_id(), q.segment_id())
                                : unmountSegmentByName(q.client_id(), q.segment_name());
              r.set_error_code(toInt(e));
            });
        break;
      case pb::HEARTBEAT:
        decoded = serve<pb::HeartbeatRequest, pb::HeartbeatResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (!q.client_id().empty() && impersonates(q.client_id()))
                return r.set_error_code(kIllegal);
              auto res = heartbeat(q.client_id(), std::vector<std::string>(
                                                      q.segment_names().begin(),
                                                      q.segment_names().end()));
              r.set_error_code(toInt(res.error()));
              if (res.ok()) r.set_need_remount(*res);
              r.set_client_ttl_ms(config_.client_ttl_ms);
              r.set_rebuilding(role() == MasterRole::kRebuilding);
            });
        break;
      case pb::PUT_START:
        decoded = serve<pb::PutStartRequest, pb::PutStartResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              put_start(q.client_id(), q, &r);
            });
        break;
      case pb::BATCH_PUT_START:
        decoded = serve<pb::BatchPutStartRequest, pb::BatchPutStartResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              r.set_error_code(0);
              for (const auto& p : q.puts()) put_start(q.client_id(), p, r.add_results());
            });
        break;
      case pb::BATCH_PUT_END:
        decoded = serve<pb::BatchPutEndRequest, pb::BatchPutEndResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              r.set_error_code(0);
              for (const auto& p : q.puts())
                r.add_results()->set_error_code(
                    toInt(putEnd(q.client_id(), p.key(), p.put_token())));
            });
        break;
      case pb::PUT_END:
        decoded = serve<pb::PutEndRequest, pb::PutEndResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              r.set_error_code(toInt(putEnd(q.client_id(), q.key(), q.put_token())));
            });
        break;
      case pb::PUT_REVOKE:
        decoded = serve<pb::PutRevokeRequest, pb::PutRevokeResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              uint64_t hold = 0;
              r.set_error_code(toInt(
                  putRevoke(q.client_id(), q.key(), q.writes_pending(), &hold, q.put_token())));
              r.set_hold(hold);
            });
        break;
      case pb::GET_REPLICA_LIST:
        decoded = serve<pb::GetReplicaListRequest, pb::GetReplicaListResponse>(
            body, out, &call_error,
            [&](const auto& q, auto& r) { toProto(getReplicaList(q.key()), &r); });
        break;
      case pb::BATCH_GET_REPLICA_LIST:
        decoded = serve<pb::BatchGetReplicaListRequest, pb::BatchGetReplicaListResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              r.set_error_code(0);
              for (const auto& res : batchGetReplicaList(keysOf(q.keys())))
                toProto(res, r.add_results());
            });
        break;
      case pb::EXISTS:
        decoded = serve<pb::ExistsRequest, pb::ExistsResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              auto res = exists(q.key());
              r.set_error_code(toInt(res.error()));
              r.set_exists(res.ok() && *res);
            });
        break;
      case pb::BATCH_EXISTS:
        decoded = serve<pb::BatchExistsRequest, pb::BatchExistsResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              r.set_error_code(0);
              for (const auto& res : batchExists(keysOf(q.keys()))) {
                pb::ExistsResponse* e = r.add_results();
                e->set_error_code(toInt(res.error()));
                e->set_exists(res.ok() && *res);
              }
            });
        break;
      case pb::GET_SIZE:
        decoded = serve<pb::GetSizeRequest, pb::GetSizeResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              auto res = getSize(q.key());
              r.set_error_code(toInt(res.error()));
              if (res.ok()) r.set_size(*res);
            });
        break;
      case pb::REMOVE:
        decoded = serve<pb::RemoveRequest, pb::RemoveResponse>(
            body, out, &call_error,
            [&](const auto& q, auto& r) { r.set_error_code(toInt(remove(q.key(), q.force()))); });
        break;
      case pb::REMOVE_BY_REGEX:
        decoded = serve<pb::RemoveByRegexRequest, pb::RemoveByRegexResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              auto res = removeByRegex(q.regex(), q.force());
              r.set_error_code(toInt(res.error()));
              if (res.ok()) r.set_removed(*res);
            });
        break;
      case pb::REMOVE_ALL:
        decoded = serve<pb::RemoveAllRequest, pb::RemoveAllResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              r.set_error_code(0);
              r.set_removed(removeAll(q.force()));
            });
        break;
      case pb::UPSERT_START:
        decoded = serve<pb::UpsertStartRequest, pb::UpsertStartResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              uint64_t id = 0;
              auto res = upsertStart(q.client_id(), q.key(), q.size(), fromProto(q.config()), &id);
              r.set_error_code(toInt(res.error()));
              if (!res.ok()) return;
              r.set_upsert_id(id);
              for (const ReplicaPlacement& p : *res)
                toProto(p, r.add_replicas(), true);  // the writer writes the records
            });
        break;
      case pb::UPSERT_END:
        decoded = serve<pb::UpsertEndRequest, pb::UpsertEndResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              r.set_error_code(toInt(upsertEnd(q.client_id(), q.key(), q.upsert_id())));
            });
        break;
      case pb::UPSERT_REVOKE:
        decoded = serve<pb::UpsertRevokeRequest, pb::UpsertRevokeResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              uint64_t hold = 0;
              r.set_error_code(toInt(upsertRevoke(q.client_id(), q.key(), q.upsert_id(),
                                                  q.writes_pending(), &hold)));
              r.set_hold(hold);
            });
        break;
      case pb::BATCH_REPLICA_CLEAR:
        decoded = serve<pb::BatchReplicaClearRequest, pb::BatchReplicaClearResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              r.set_error_code(0);
              for (const std::string& k :
                   batchReplicaClear(q.client_id(), keysOf(q.keys()), q.segment_name()))
                r.add_cleared(k);
            });
        break;
      case pb::ALLOC_SLAB:
        decoded = serve<pb::AllocSlabRequest, pb::AllocSlabResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              auto res = allocSlab(q.client_id(), q.replica_num(), q.bytes(), idsOf(q.retire()),
                                   q.min_bytes());
              r.set_error_code(toInt(res.error()));
              if (res.ok()) toProto(*res, r.mutable_slab());
            });
        break;
      case pb::PUBLISH:
        decoded = serve<pb::PublishRequest, pb::PublishResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              std::vector<PublishItem> items;
              items.reserve(q.entries_size());
              for (const auto& e : q.entries())
                items.push_back({e.key(), e.size(), e.slab_id(), e.offset(), e.put_id(),
                                 e.soft_pin(), e.hard_pin()});
              r.set_error_code(0);
              for (ErrorCode ec : publish(q.client_id(), items)) r.add_results(toInt(ec));
              if (q.retire_size() > 0) retireSlabs(q.client_id(), idsOf(q.retire()));
              if (q.release_holds_size() > 0)
                releaseHolds(q.client_id(), idsOf(q.release_holds()));
              if (q.has_next_slab() && q.next_slab().replica_num() > 0) {
                auto res =
                    allocSlab(q.client_id(), q.next_slab().replica_num(), q.next_slab().bytes(),
                              idsOf(q.next_slab().retire()), q.next_slab().min_bytes());
                r.set_next_slab_error(toInt(res.error()));
                if (res.ok()) toProto(*res, r.mutable_next_slab());
              }
            });
        break;
      case pb::REPORT_OBJECTS:
        decoded = serve<pb::ReportObjectsRequest, pb::ReportObjectsResponse>(
            body, out, &call_error, [&](const auto& q, auto& r) {
              if (impersonates(q.client_id())) return r.set_error_code(kIllegal);
              std::vector<ReportedPiece> recs;
              recs.reserve(q.records_size());
              for (const auto& x : q.records())
                recs.push_back({x.key(), x.put_id(), x.object_size(), x.piece_offset(),
                                x.piece_length(), x.replica_index(),
                                static_cast<uint8_t>(x.flags()), x.offset()});
              r.set_error_code(toInt(reportObjects(q.client_id(), q.segment_name(), std::move(recs),
                                                   q.pending(), q.last())));
            });
        break;
      default:  // METHOD_UNSPECIFIED or a method this master does not know
        break;
    }
    if (!decoded) {
      resp.clear_body();
      resp.set_error_code(toInt(ErrorCode::INVALID_PARAMS));
    }
  } catch (...) {  // bad_alloc and the like: answer, never unwind into the transport
    resp.clear_body();
    resp.set_error_code(toInt(ErrorCode::INTERNAL_ERROR));
  }
  if (method_index >= 0) {
    RpcCounters& c = rpc_stats_[method_index];
    c.calls.fetch_add(1, std::memory_order_relaxed);
    if (resp.error_code() != 0 || call_error != 0) c.errors.fetch_add(1, std::memory_order_relaxed);
    auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    c.total_ns.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
    int b = 0;
    while (b + 1 < MasterMetrics::kLatencyBuckets &&
           static_cast<double>(ns) > MasterMetrics::kLatencyBucketsUs[b] * 1000.0)
      ++b;
    c.buckets[b].fetch_add(1, std::memory_order_relaxed);
  }
  try {
    return resp.SerializeAsString();
  } catch (...) {
    return std::string();
  }
}

void MasterService::fillRpcStats(MasterMetrics* m) const {
  m->rpcs.clear();
  for (int i = 1; i < kRpcMethods; ++i) {
    MasterMetrics::RpcStat s;
    s.method = pb::Method_Name(static_cast<pb::Method>(i));
    s.calls = rpc_stats_[i].calls.load(std::memory_order_relaxed);
    s.errors = rpc_stats_[i].errors.load(std::memory_order_relaxed);
    s.total_ns = rpc_stats_[i].total_ns.load(std::memory_order_relaxed);
    for (const auto& b : rpc_stats_[i].buckets)
      s.buckets.push_back(b.load(std::memory_order_relaxed));
    m->rpcs.push_back(std::move(s));
  }
}

}  // namespace mooncake::store
