// StoreClient: upserts, ranged reads and replica queries (the rest of Mooncake Store's Python
// API). Same data path as store_client.cc: the master places, the engine moves the bytes.
#include <algorithm>
#include <cstring>

#include "store/client/store_client.h"

namespace mooncake::store {

namespace {
constexpr size_t kMaxKeyLength = 4096;
ErrorCode checkKey(const std::string& key) {
  return (key.empty() || key.size() > kMaxKeyLength) ? ErrorCode::INVALID_KEY : ErrorCode::OK;
}
}  // namespace

ErrorCode StoreClient::upsertParts(const std::string& key,
                                   const std::vector<std::pair<const void*, size_t>>& parts,
                                   const ReplicateConfig& config) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  uint64_t size = 0;
  for (const auto& p : parts) {
    if (p.first == nullptr && p.second > 0) return ErrorCode::INVALID_PARAMS;
    size += p.second;
  }
  if (size == 0 || config.replica_num > 16) return ErrorCode::INVALID_PARAMS;
  const char* src = nullptr;
  std::string joined;
  if (parts.size() == 1) {
    src = static_cast<const char*>(parts[0].first);
  } else {
    joined.reserve(size);
    for (const auto& p : parts) joined.append(static_cast<const char*>(p.first), p.second);
    src = joined.data();
  }
  proto::UpsertStartRequest req;
  req.set_client_id(client_id_);
  req.set_key(key);
  req.set_size(size);
  toProto(config, req.mutable_config());
  proto::UpsertStartResponse us;
  if (ErrorCode ec = rpc_->call(proto::UPSERT_START, req, &us); ec != ErrorCode::OK) return ec;
  if (us.error_code() != 0) return errorCodeFromInt(us.error_code());
  std::vector<engine::TransferRequest> reqs;
  bool ok = true;
  for (const auto& r : us.replicas())
    if (planReplica(r, size, engine::OpCode::kWrite, const_cast<char*>(src), &reqs) !=
        ErrorCode::OK)
      ok = false;
  if (ok && !reqs.empty())
    ok = engine_->transfer(reqs, engine::deadlineInMs(options_.transfer_timeout_ms)).ok();
  if (!ok) {
    proto::UpsertRevokeRequest rv;
    rv.set_client_id(client_id_);
    rv.set_key(key);
    rv.set_upsert_id(us.upsert_id());
    proto::UpsertRevokeResponse rr;
    (void)rpc_->call(proto::UPSERT_REVOKE, rv, &rr);
    return ErrorCode::TRANSFER_FAIL;
  }
  proto::UpsertEndRequest end;
  end.set_client_id(client_id_);
  end.set_key(key);
  end.set_upsert_id(us.upsert_id());
  proto::UpsertEndResponse er;
  if (ErrorCode ec = rpc_->call(proto::UPSERT_END, end, &er); ec != ErrorCode::OK) return ec;
  return errorCodeFromInt(er.error_code());
}

ErrorCode StoreClient::planRange(const proto::Replica& r, uint64_t size, uint64_t off,
                                 uint64_t len, char* local,
                                 std::vector<engine::TransferRequest>* reqs) {
  uint64_t at = 0;  // object offset of the current piece
  for (const auto& p : r.pieces()) {
    if (at + p.length() > size) return ErrorCode::INVALID_READ;
    const uint64_t lo = std::max(at, off), hi = std::min(at + p.length(), off + len);
    if (lo < hi) {
      auto peer = peerFor(p.client_id());
      if (!peer.ok()) {
        forgetPeer(p.client_id());
        return peer.error();
      }
      char* dst = local + (lo - off);
      const uint64_t src = p.address() + (lo - at);
      if (*peer == engine::kInvalidPeer) {  // our own segment: inside what we lent, or refused
        const uint64_t seg = reinterpret_cast<uint64_t>(segment_);
        if (segment_ == nullptr || p.address() < seg || p.length() > options_.segment_size ||
            p.address() - seg > options_.segment_size - p.length())
          return ErrorCode::INVALID_READ;
        std::memcpy(dst, reinterpret_cast<const char*>(src), hi - lo);
      } else {
        reqs->push_back({engine::OpCode::kRead, dst, hi - lo, *peer, src});
      }
    }
    at += p.length();
  }
  return at == size ? ErrorCode::OK : ErrorCode::INVALID_READ;
}

std::vector<ErrorOr<uint64_t>> StoreClient::getRanges(const std::string& key,
                                                      const std::vector<Range>& ranges) {
  std::vector<ErrorOr<uint64_t>> out(ranges.size(), ErrorOr<uint64_t>(ErrorCode::INVALID_PARAMS));
  if (ranges.empty()) return out;
  auto fail_all = [&](ErrorCode ec) {
    for (auto& o : out) o = ec;
    return out;
  };
  if (closed_) return fail_all(ErrorCode::INVALID_PARAMS);
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return fail_all(ec);
  proto::GetReplicaListRequest req;
  req.set_key(key);
  proto::GetReplicaListResponse rl;
  auto asked = std::chrono::steady_clock::now();
  if (ErrorCode ec = rpc_->call(proto::GET_REPLICA_LIST, req, &rl); ec != ErrorCode::OK)
    return fail_all(ec);
  if (rl.error_code() != 0) return fail_all(errorCodeFromInt(rl.error_code()));
  std::vector<size_t> todo;  // ranges inside the object
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& g = ranges[i];
    if (g.length == 0 || g.dst == nullptr || g.src_offset > rl.size() ||
        g.length > rl.size() - g.src_offset)
      continue;  // INVALID_PARAMS
    todo.push_back(i);
  }
  ErrorCode result = ErrorCode::TRANSFER_FAIL;
  for (int rep = 0; rep < rl.replicas_size() && !todo.empty(); ++rep) {
    std::vector<engine::TransferRequest> reqs;
    ErrorCode ec = ErrorCode::OK;
    for (size_t i : todo) {
      ec = planRange(rl.replicas(rep), rl.size(), ranges[i].src_offset, ranges[i].length,
                     static_cast<char*>(ranges[i].dst), &reqs);
      if (ec != ErrorCode::OK) break;
    }
    if (ec == ErrorCode::INVALID_READ) {
      result = ec;
      break;
    }
    if (ec != ErrorCode::OK) continue;
    if (!reqs.empty() &&
        !engine_->transfer(reqs, engine::deadlineInMs(options_.transfer_timeout_ms)).ok()) {
      for (const auto& p : rl.replicas(rep).pieces()) forgetPeer(p.client_id());
      continue;
    }
    result = ErrorCode::OK;
    break;
  }
  if (result == ErrorCode::OK && rl.lease_ttl_ms() > 0 &&
      std::chrono::steady_clock::now() - asked > std::chrono::milliseconds(rl.lease_ttl_ms()))
    result = ErrorCode::LEASE_EXPIRED;  // the bytes may have been replaced meanwhile
  for (size_t i : todo)
    out[i] = result == ErrorCode::OK ? ErrorOr<uint64_t>(ranges[i].length)
                                     : ErrorOr<uint64_t>(result);
  return out;
}

ErrorOr<proto::GetReplicaListResponse> StoreClient::replicaList(const std::string& key) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  proto::GetReplicaListRequest req;
  req.set_key(key);
  proto::GetReplicaListResponse rl;
  if (ErrorCode ec = rpc_->call(proto::GET_REPLICA_LIST, req, &rl); ec != ErrorCode::OK) return ec;
  if (rl.error_code() != 0) return errorCodeFromInt(rl.error_code());
  return rl;
}

ErrorOr<std::vector<std::string>> StoreClient::batchReplicaClear(
    const std::vector<std::string>& keys, const std::string& segment_name) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  proto::BatchReplicaClearRequest req;
  req.set_client_id(client_id_);
  for (const auto& k : keys) req.add_keys(k);
  req.set_segment_name(segment_name);
  proto::BatchReplicaClearResponse resp;
  if (ErrorCode ec = rpc_->call(proto::BATCH_REPLICA_CLEAR, req, &resp); ec != ErrorCode::OK)
    return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return std::vector<std::string>(resp.cleared().begin(), resp.cleared().end());
}

ErrorCode StoreClient::ping() {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  proto::HeartbeatRequest req;
  req.set_client_id(client_id_);
  proto::HeartbeatResponse resp;
  if (ErrorCode ec = rpc_->call(proto::HEARTBEAT, req, &resp); ec != ErrorCode::OK) return ec;
  return errorCodeFromInt(resp.error_code());
}

}  // namespace mooncake::store
