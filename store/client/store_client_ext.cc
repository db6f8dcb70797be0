// StoreClient: upserts, ranged reads and replica queries (the rest of Mooncake Store's Python
// API). Same data path as store_client.cc: the master places, the engine moves the bytes.
#include <chrono>

#include "store/client/store_client.h"
#include "store/master/record.h"

namespace mooncake::store {

ErrorCode StoreClient::upsertParts(const std::string& key,
                                   const std::vector<std::pair<const void*, size_t>>& parts,
                                   const ReplicateConfig& config) {
  auto joined = std::make_shared<std::string>();  // (a late WRITE may still read it)
  const char* src = nullptr;
  uint64_t size = 0;
  if (ErrorCode ec = checkedValue(key, parts, config, joined.get(), &src, &size);
      ec != ErrorCode::OK)
    return ec;
  const std::vector<std::string> one{key};
  forgetReadLists(&one);  // (and again below, once the new value is in)
  proto::UpsertStartRequest req;
  req.set_client_id(client_id_);
  req.set_key(key);
  req.set_size(size);
  toProto(config, req.mutable_config());
  proto::UpsertStartResponse us;
  std::shared_ptr<Link> link;
  ErrorCode ec = callMaster(proto::UPSERT_START, req, &us, false, &link);
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(us.error_code());
  if (ec != ErrorCode::OK) return ec;
  // Same write protocol as a put (client_put.cc): records + bytes, the master's ack, then the
  // records' commit word, so that a new master rebuilds the new value (its put id is newer).
  std::vector<WriteTarget> targets;
  ec = targetsOf(us.replicas(), key, size, &targets);
  const uint64_t put_id = newPutId();
  std::vector<std::string> records;
  records.reserve(targets.size());
  std::vector<engine::TransferRequest> reqs;
  if (ec == ErrorCode::OK) {
    ec = writePieces(targets, key, put_id, size, recordFlagsOf(config), src, &records, &reqs);
  }
  std::shared_ptr<LateHold> hold;  // made if the writes are handed over
  if (ec == ErrorCode::OK && !reqs.empty() &&
      !transferHeld(reqs, heldLate(heldWith(records, joined), {}, &hold)).ok())
    ec = ErrorCode::TRANSFER_FAIL;
  if (ec != ErrorCode::OK) {
    proto::UpsertRevokeRequest rv;
    rv.set_client_id(client_id_);
    rv.set_key(key);
    rv.set_upsert_id(us.upsert_id());
    rv.set_writes_pending(writesPending(hold));
    proto::UpsertRevokeResponse rr;
    if (callMaster(proto::UPSERT_REVOKE, rv, &rr, true) == ErrorCode::OK)
      holdGiven(hold, rr.hold());
    return ec;
  }
  proto::UpsertEndRequest end;
  end.set_client_id(client_id_);
  end.set_key(key);
  end.set_upsert_id(us.upsert_id());
  proto::UpsertEndResponse er;
  std::shared_ptr<Link> end_link;
  // Not retried: a second UpsertEnd after a first that landed answers INVALID_WRITE.
  ec = callMaster(proto::UPSERT_END, end, &er, false, &end_link);
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(er.error_code());
  if (ec != ErrorCode::OK) return ec;
  // Ended by another master (another epoch): the put it started is not the one that ended.
  // The same master over a new link (a reconnect after a blip) is fine.
  if (end_link->epoch != link->epoch) return ErrorCode::RPC_FAIL;
  forgetReadLists(&one);  // a session started meanwhile has the old replicas
  return commit(targets, put_id, end_link);
}

namespace {

// The ranges that lie inside an object of `size` bytes (the others are INVALID_PARAMS).
std::vector<size_t> rangesInside(uint64_t size, const std::vector<StoreClient::Range>& ranges) {
  std::vector<size_t> todo;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const StoreClient::Range& g = ranges[i];
    if (g.length == 0 || g.dst == nullptr || g.src_offset > size || g.length > size - g.src_offset)
      continue;
    todo.push_back(i);
  }
  return todo;
}

// Each range of `todo` gets its length when `result` is OK (LEASE_EXPIRED when the read lease
// lapsed before the bytes were in: they may have been replaced meanwhile), else `result`.
void answerRanges(const proto::GetReplicaListResponse& rl,
                  std::chrono::steady_clock::time_point asked, ErrorCode result,
                  const std::vector<StoreClient::Range>& ranges, const std::vector<size_t>& todo,
                  std::vector<ErrorOr<uint64_t>>* out) {
  if (result == ErrorCode::OK && rl.lease_ttl_ms() > 0 &&
      std::chrono::steady_clock::now() - asked > std::chrono::milliseconds(rl.lease_ttl_ms()))
    result = ErrorCode::LEASE_EXPIRED;
  for (size_t i : todo)
    (*out)[i] = result == ErrorCode::OK ? ErrorOr<uint64_t>(ranges[i].length)
                                        : ErrorOr<uint64_t>(result);
}

}  // namespace

ErrorCode StoreClient::readRangesFrom(const proto::GetReplicaListResponse& rl,
                                      const std::vector<Range>& ranges,
                                      const std::vector<size_t>& todo, int from,
                                      bool* timed_out) {
  ErrorCode result = ErrorCode::TRANSFER_FAIL;
  for (int rep = from; rep < rl.replicas_size() && !todo.empty(); ++rep) {
    std::vector<engine::TransferRequest> reqs;
    ErrorCode ec = ErrorCode::OK;
    for (size_t i : todo) {
      ec = planRange(rl.replicas(rep), rl.size(), engine::OpCode::kRead, ranges[i].src_offset,
                     ranges[i].length, static_cast<char*>(ranges[i].dst), &reqs);
      if (ec != ErrorCode::OK) break;
    }
    if (ec == ErrorCode::INVALID_READ) return ec;
    if (ec != ErrorCode::OK) continue;
    Status st = reqs.empty() ? Status::OK() : transferHeld(reqs, nullptr);  // (caller's memory)
    if (!st.ok()) {
      for (const auto& p : rl.replicas(rep).pieces()) forgetPeer(p.client_id());
      if (st.code() == Code::kTimeout) {
        if (timed_out != nullptr) *timed_out = true;
        return ErrorCode::TRANSFER_FAIL;
      }
      continue;
    }
    return ErrorCode::OK;
  }
  return result;
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
  if (ErrorCode ec = callMaster(proto::GET_REPLICA_LIST, req, &rl, true); ec != ErrorCode::OK)
    return fail_all(ec);
  if (rl.error_code() != 0) return fail_all(errorCodeFromInt(rl.error_code()));
  const std::vector<size_t> todo = rangesInside(rl.size(), ranges);
  answerRanges(rl, asked, readRangesFrom(rl, ranges, todo, 0), ranges, todo, &out);
  return out;
}

ErrorOr<std::vector<std::shared_ptr<const StoreClient::ReadList>>> StoreClient::fetchReadLists(
    const std::vector<std::string>& keys) {
  proto::BatchGetReplicaListRequest req;
  for (const auto& k : keys) req.add_keys(k);
  proto::BatchGetReplicaListResponse resp;
  const uint64_t forgotten = forgotten_.load();
  const auto asked = std::chrono::steady_clock::now();
  ErrorCode ec = callMaster(proto::BATCH_GET_REPLICA_LIST, req, &resp, true);
  if (ec == ErrorCode::OK && resp.error_code() != 0) ec = errorCodeFromInt(resp.error_code());
  if (ec == ErrorCode::OK && resp.results_size() != static_cast<int>(keys.size()))
    ec = ErrorCode::RPC_FAIL;
  if (ec != ErrorCode::OK) return ec;
  std::vector<std::shared_ptr<const ReadList>> out;
  out.reserve(keys.size());
  for (int i = 0; i < resp.results_size(); ++i) {
    auto l = std::make_shared<ReadList>();
    l->rl = std::move(*resp.mutable_results(i));
    l->asked = asked;
    l->fresh_until = asked + std::chrono::milliseconds(l->rl.lease_ttl_ms() / 2);
    l->forgotten = forgotten;
    out.push_back(std::move(l));
  }
  return out;
}

std::vector<ErrorCode> StoreClient::readSessionStart(const std::vector<std::string>& keys) {
  std::vector<ErrorCode> out(keys.size(), ErrorCode::INVALID_PARAMS);
  if (closed_ || keys.empty()) return out;
  auto got = fetchReadLists(keys);
  if (!got.ok()) {
    std::fill(out.begin(), out.end(), got.error());
    return out;
  }
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> g(read_mu_);
  // Lists past their use (sessions that were never ended) go.
  for (auto it = read_lists_.begin(); it != read_lists_.end();)
    it = now >= it->second->fresh_until ? read_lists_.erase(it) : std::next(it);
  for (size_t i = 0; i < keys.size(); ++i) {
    const ReadList& l = *(*got)[i];
    if (ErrorCode k = checkKey(keys[i]); k != ErrorCode::OK) {
      out[i] = k;
    } else if (l.rl.error_code() != 0) {
      out[i] = errorCodeFromInt(l.rl.error_code());
    } else {
      out[i] = ErrorCode::OK;
      read_lists_[keys[i]] = (*got)[i];
    }
  }
  return out;
}

void StoreClient::readSessionEnd(const std::vector<std::string>& keys) { forgetReadLists(&keys); }

void StoreClient::forgetReadLists(const std::vector<std::string>* keys) {
  std::lock_guard<std::mutex> g(read_mu_);
  if (keys == nullptr) {
    read_lists_.clear();
    return;
  }
  for (const auto& k : *keys) read_lists_.erase(k);
}

std::vector<std::vector<ErrorOr<uint64_t>>> StoreClient::batchGetRanges(
    const std::vector<std::string>& keys, const std::vector<std::vector<Range>>& ranges) {
  const size_t n = keys.size();
  std::vector<std::vector<ErrorOr<uint64_t>>> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i].assign(i < ranges.size() ? ranges[i].size() : 0,
                  ErrorOr<uint64_t>(ErrorCode::INVALID_PARAMS));
  if (closed_ || n == 0 || ranges.size() != n) return out;
  auto fail_key = [&](size_t i, ErrorCode ec) {
    for (auto& o : out[i]) o = ec;
  };
  // Replica lists: a read session's (readSessionStart) while the read lease it took has half
  // its time left, else one BatchGetReplicaList for the rest.
  std::vector<std::shared_ptr<const ReadList>> lists(n);
  std::vector<bool> cached(n, false);
  std::vector<size_t> ask;
  {
    const auto now = std::chrono::steady_clock::now();
    // A master that changed since a list was asked for does not know its lease.
    const uint64_t forgotten = forgotten_.load();
    std::lock_guard<std::mutex> g(read_mu_);
    for (size_t i = 0; i < n; ++i) {
      auto it = read_lists_.find(keys[i]);
      if (it != read_lists_.end() && now < it->second->fresh_until &&
          it->second->forgotten == forgotten) {
        lists[i] = it->second;
        cached[i] = true;
      } else {
        ask.push_back(i);
      }
    }
  }
  if (!ask.empty()) {
    std::vector<std::string> ask_keys;
    for (size_t i : ask) ask_keys.push_back(keys[i]);
    auto got = fetchReadLists(ask_keys);
    if (!got.ok()) {
      for (size_t i : ask) fail_key(i, got.error());
    } else {
      for (size_t k = 0; k < ask.size(); ++k) lists[ask[k]] = (*got)[k];
    }
  }
  // The first replica of every key in one engine batch.
  enum class Step { kDone, kBatched, kOthers };  // kOthers: read from replica 1 on
  std::vector<Step> step(n, Step::kDone);
  std::vector<bool> late(n, false);  // a READ of the key timed out: it may still land
  std::vector<std::vector<size_t>> todo(n);
  std::vector<size_t> first_req(n + 1, 0);
  std::vector<engine::TransferRequest> reqs;
  for (size_t i = 0; i < n; ++i) {
    first_req[i] = reqs.size();
    if (ranges[i].empty() || lists[i] == nullptr) continue;
    const auto& rl = lists[i]->rl;
    const auto asked = lists[i]->asked;
    if (ErrorCode k = checkKey(keys[i]); k != ErrorCode::OK) {
      fail_key(i, k);
    } else if (rl.error_code() != 0) {
      fail_key(i, errorCodeFromInt(rl.error_code()));
    } else {
      todo[i] = rangesInside(rl.size(), ranges[i]);
      if (todo[i].empty()) continue;
      if (rl.replicas_size() == 0) {
        answerRanges(rl, asked, ErrorCode::TRANSFER_FAIL, ranges[i], todo[i], &out[i]);
        continue;
      }
      step[i] = Step::kBatched;
      for (size_t r : todo[i]) {
        ErrorCode pe = planRange(rl.replicas(0), rl.size(), engine::OpCode::kRead,
                                 ranges[i][r].src_offset, ranges[i][r].length,
                                 static_cast<char*>(ranges[i][r].dst), &reqs);
        if (pe == ErrorCode::OK) continue;
        reqs.resize(first_req[i]);
        if (pe == ErrorCode::INVALID_READ) {
          step[i] = Step::kDone;
          answerRanges(rl, asked, pe, ranges[i], todo[i], &out[i]);
        } else {
          step[i] = Step::kOthers;  // replica 0 cannot be reached: the others, as getRanges
        }
        break;
      }
    }
  }
  first_req[n] = reqs.size();
  std::vector<Status> per = transferEach(reqs, nullptr);  // (the caller's memory)
  for (size_t i = 0; i < n; ++i) {
    if (step[i] == Step::kDone) continue;
    const auto& rl = lists[i]->rl;
    const auto asked = lists[i]->asked;
    ErrorCode result = ErrorCode::OK;
    if (step[i] == Step::kBatched) {
      for (size_t r = first_req[i]; r < first_req[i + 1]; ++r) {
        if (!per[r].ok()) result = ErrorCode::TRANSFER_FAIL;
        late[i] = late[i] || per[r].code() == Code::kTimeout;
      }
      if (result != ErrorCode::OK)
        for (const auto& p : rl.replicas(0).pieces()) forgetPeer(p.client_id());
      // Timed out: its READs may still land in the ranges' memory, so no other replica is read
      // into it.
      if (result != ErrorCode::OK && !late[i]) step[i] = Step::kOthers;
    }
    if (step[i] == Step::kOthers) {
      bool timed_out = false;
      result = readRangesFrom(rl, ranges[i], todo[i], 1, &timed_out);
      late[i] = timed_out;
    }
    answerRanges(rl, asked, result, ranges[i], todo[i], &out[i]);
  }
  // The batch shares one read lease: a key that outlasted it (a slow holder of another key, or
  // its own fallback) is read again alone, under a lease of its own; so is a key whose read
  // session's list failed it (a holder gone since: the master's list now leaves it out),
  // unless its reads may still land (timed out).
  for (size_t i = 0; i < n; ++i) {
    if (step[i] == Step::kDone) continue;
    bool lapsed = false, failed = false;
    for (const auto& o : out[i]) {
      lapsed = lapsed || (!o.ok() && o.error() == ErrorCode::LEASE_EXPIRED);
      failed = failed || (!o.ok() && o.error() != ErrorCode::INVALID_PARAMS);
    }
    if (cached[i] && failed) {  // not that list again
      std::lock_guard<std::mutex> g(read_mu_);
      auto it = read_lists_.find(keys[i]);
      if (it != read_lists_.end() && it->second == lists[i]) read_lists_.erase(it);
    }
    if (!late[i] && (lapsed || (cached[i] && failed))) out[i] = getRanges(keys[i], ranges[i]);
  }
  return out;
}

ErrorOr<proto::GetReplicaListResponse> StoreClient::replicaList(const std::string& key) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  proto::GetReplicaListRequest req;
  req.set_key(key);
  proto::GetReplicaListResponse rl;
  if (ErrorCode ec = callMaster(proto::GET_REPLICA_LIST, req, &rl, true); ec != ErrorCode::OK)
    return ec;
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
  if (ErrorCode ec = callMaster(proto::BATCH_REPLICA_CLEAR, req, &resp, true); ec != ErrorCode::OK)
    return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return std::vector<std::string>(resp.cleared().begin(), resp.cleared().end());
}

ErrorCode StoreClient::ping() {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  proto::HeartbeatRequest req;
  req.set_client_id(client_id_);
  proto::HeartbeatResponse resp;
  if (ErrorCode ec = callMaster(proto::HEARTBEAT, req, &resp, true); ec != ErrorCode::OK) return ec;
  return errorCodeFromInt(resp.error_code());
}

}  // namespace mooncake::store
