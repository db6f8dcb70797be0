// StoreClient: put sessions (upstream's layer-wise batch_put_session_*). An object is placed
// once (PutStart), written in ranges over several calls straight from the caller's memory, and
// published with the classic put's protocol (client_put.cc: records, PutEnd, commit words) only
// once every byte of it was written. Until then the master holds it as an unfinished put, so
// readers never see it, and a client or master that goes away takes it with it.
#include <algorithm>
#include <chrono>

#include "store/client/store_client.h"
#include "store/master/record.h"

namespace mooncake::store {
namespace {

using Clock = std::chrono::steady_clock;

// Adds [a, b) to the merged intervals in *m.
void addCovered(std::map<uint64_t, uint64_t>* m, uint64_t a, uint64_t b) {
  auto it = m->upper_bound(a);
  if (it != m->begin()) {
    auto prev = std::prev(it);
    if (prev->second >= a) {
      a = prev->first;
      b = std::max(b, prev->second);
      it = m->erase(prev);
    }
  }
  while (it != m->end() && it->first <= b) {
    b = std::max(b, it->second);
    it = m->erase(it);
  }
  m->emplace(a, b);
}

}  // namespace

ErrorCode StoreClient::mayWrite(const PutSession& s) const {
  const auto now = Clock::now();
  if (now > s.write_until) return ErrorCode::LEASE_EXPIRED;
  // A master that changed or forgot this client since PutStart may have placed other objects
  // where this one was to go; one that has not answered a heartbeat for half its client TTL
  // may be expiring this client (it then frees its unfinished puts' memory at once).
  if (forgotten_.load() != s.forgotten) return ErrorCode::RPC_FAIL;
  if (now - Clock::time_point(Clock::duration(heard_.load())) >=
      std::chrono::milliseconds(client_ttl_ms_.load() / 2))
    return ErrorCode::RPC_FAIL;
  return ErrorCode::OK;
}

std::vector<ErrorCode> StoreClient::putSessionStart(const std::vector<std::string>& keys,
                                                    const std::vector<uint64_t>& sizes,
                                                    const ReplicateConfig& config) {
  const size_t n = keys.size();
  std::vector<ErrorCode> out(n, ErrorCode::INVALID_PARAMS);
  if (closed_ || sizes.size() != n) return out;
  // Each key's session is reserved (not ready) while its PutStart runs.
  std::vector<std::shared_ptr<PutSession>> ss(n);
  std::vector<size_t> todo;
  for (size_t i = 0; i < n; ++i) {
    if (ErrorCode ec = checkKey(keys[i]); ec != ErrorCode::OK) {
      out[i] = ec;
      continue;
    }
    if (sizes[i] == 0 || config.replica_num > 16) continue;  // INVALID_PARAMS
    auto s = std::make_shared<PutSession>();
    s->size = sizes[i];
    s->flags = recordFlagsOf(config);
    std::lock_guard<std::mutex> g(sessions_mu_);
    auto [it, fresh] = put_sessions_.emplace(keys[i], s);
    if (!fresh) {
      // An open session of this client: INVALID_PARAMS, as upstream's client answers before
      // asking its master (callers such as vllm-ascend follow a -705 key as another writer's
      // put and would wait on their own). One still starting (the key twice in this batch, or
      // another call's PutStart in flight): the master would meet a put of it in progress.
      out[i] = it->second->ready ? ErrorCode::INVALID_PARAMS : ErrorCode::OBJECT_ALREADY_EXISTS;
      continue;
    }
    ss[i] = std::move(s);
    todo.push_back(i);
  }
  for (int attempt = 0; attempt < 2 && !todo.empty(); ++attempt) {
    proto::BatchPutStartRequest req;
    req.set_client_id(client_id_);
    for (size_t i : todo) {
      proto::PutStartRequest* one = req.add_puts();
      one->set_key(keys[i]);
      one->set_size(sizes[i]);
      toProto(config, one->mutable_config());
    }
    proto::BatchPutStartResponse resp;
    std::shared_ptr<Link> link;
    const uint64_t forgotten = forgotten_.load();
    const auto asked = Clock::now();
    ErrorCode ec = callMaster(proto::BATCH_PUT_START, req, &resp, false, &link);
    if (ec == ErrorCode::OK) ec = errorCodeFromInt(resp.error_code());
    if (ec == ErrorCode::OK && resp.results_size() != static_cast<int>(todo.size()))
      ec = ErrorCode::RPC_FAIL;
    if (ec != ErrorCode::OK) {
      for (size_t i : todo) out[i] = ec;
      break;
    }
    // This client registered again while the call ran (a new master, or the same one had
    // expired it): the master that placed the puts may not know them any more. Revoke each
    // where it may still be (its token: nothing else of the key) and start again.
    const bool again = forgotten_.load() != forgotten;
    std::vector<size_t> retry;
    for (size_t k = 0; k < todo.size(); ++k) {
      const size_t i = todo[k];
      PutSession& s = *ss[i];
      const proto::PutStartResponse& r = resp.results(static_cast<int>(k));
      out[i] = errorCodeFromInt(r.error_code());
      if (out[i] != ErrorCode::OK) continue;
      s.token = r.put_token();
      s.link = link;
      s.forgotten = forgotten;
      if (again) {
        // A revoke that did not get through leaves that put where it is: starting again
        // would meet it (OBJECT_ALREADY_EXISTS, while nothing is readable).
        const ErrorCode rv = revokeSession(keys[i], s);
        out[i] = ErrorCode::RPC_FAIL;
        if (rv == ErrorCode::OK || rv == ErrorCode::OBJECT_NOT_FOUND) retry.push_back(i);
        continue;
      }
      out[i] = targetsOf(r.replicas(), keys[i], s.size, &s.targets);
      if (out[i] != ErrorCode::OK) {
        (void)revokeSession(keys[i], s, link);  // a placement we cannot use
        continue;
      }
      s.replicas = r.replicas();
      // The master may take an unfinished put's memory back release_after_ms after its
      // start: the last write must have started a transfer deadline before that.
      s.write_until = Clock::time_point::max();
      if (r.release_after_ms() > 0) {
        const int64_t ms =
            static_cast<int64_t>(r.release_after_ms()) - options_.transfer_timeout_ms;
        s.write_until = asked + std::chrono::milliseconds(std::max<int64_t>(0, ms));
      }
    }
    todo.swap(retry);
  }
  std::lock_guard<std::mutex> g(sessions_mu_);
  for (size_t i = 0; i < n; ++i) {
    if (ss[i] == nullptr) continue;
    if (out[i] == ErrorCode::OK) {
      ss[i]->ready = true;
    } else {
      auto it = put_sessions_.find(keys[i]);
      if (it != put_sessions_.end() && it->second == ss[i]) put_sessions_.erase(it);
    }
  }
  return out;
}

std::vector<ErrorOr<uint64_t>> StoreClient::putSessionRanges(
    const std::vector<std::string>& keys, const std::vector<std::vector<SourceRange>>& ranges) {
  std::vector<ErrorOr<uint64_t>> out(keys.size(), ErrorOr<uint64_t>(ErrorCode::INVALID_PARAMS));
  if (closed_ || ranges.size() != keys.size()) return out;
  struct Item {
    size_t index;
    std::shared_ptr<PutSession> s;
    size_t first_req = 0, end_req = 0;
    uint64_t bytes = 0;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::shared_ptr<PutSession> s;
    {
      std::lock_guard<std::mutex> g(sessions_mu_);
      if (closed_) continue;  // INVALID_PARAMS (close() takes the sessions under this lock)
      auto it = put_sessions_.find(keys[i]);
      if (it == put_sessions_.end() || !it->second->ready || it->second->ending) {
        out[i] = ErrorCode::OBJECT_NOT_FOUND;
        continue;
      }
      s = it->second;
      if (s->failed != ErrorCode::OK) {
        out[i] = s->failed;
        continue;
      }
      ++s->inflight;  // (only ready sessions: their fields below stay as they are)
    }
    items.push_back({i, std::move(s)});
  }
  // Plans each key's writes; a key that fails here writes nothing.
  std::vector<engine::TransferRequest> reqs;
  for (Item& it : items) {
    const PutSession& s = *it.s;
    const auto& rs = ranges[it.index];
    ErrorCode ec = rs.empty() ? ErrorCode::INVALID_PARAMS : ErrorCode::OK;
    for (const SourceRange& r : rs) {
      if (r.src == nullptr || r.length == 0 || r.dst_offset > s.size ||
          r.length > s.size - r.dst_offset)
        ec = ErrorCode::INVALID_PARAMS;
      it.bytes += r.length;
    }
    // Checked before each key's planning: it copies the pieces in this client's own segment.
    if (ec == ErrorCode::OK) ec = mayWrite(s);
    it.first_req = reqs.size();
    for (int rep = 0; ec == ErrorCode::OK && rep < s.replicas.size(); ++rep)
      for (const SourceRange& r : rs) {
        ec = planRange(s.replicas.Get(rep), s.size, engine::OpCode::kWrite, r.dst_offset,
                       r.length, const_cast<char*>(static_cast<const char*>(r.src)), &reqs);
        if (ec != ErrorCode::OK) break;
      }
    if (ec != ErrorCode::OK) {
      reqs.resize(it.first_req);  // (pieces in our own segment may have been copied: harmless,
      out[it.index] = ec;         // the object is not published before every byte is written)
      it.bytes = 0;
    }
    it.end_req = reqs.size();
  }
  // Planning may have waited (a peer's handshake): a key whose time ran out meanwhile sends
  // nothing. (Its pieces in this client's own segment were copied while planning; write_until
  // leaves a transfer deadline before the master may reuse the memory.)
  std::vector<ErrorCode> late(items.size(), ErrorCode::OK);
  for (size_t k = 0; k < items.size(); ++k)
    if (items[k].bytes > 0) late[k] = mayWrite(*items[k].s);
  if (std::any_of(late.begin(), late.end(), [](ErrorCode e) { return e != ErrorCode::OK; })) {
    std::vector<engine::TransferRequest> kept;
    for (size_t k = 0; k < items.size(); ++k) {
      Item& it = items[k];
      const size_t first = kept.size();
      if (late[k] != ErrorCode::OK) {
        out[it.index] = late[k];
        it.bytes = 0;
      } else {
        kept.insert(kept.end(), reqs.begin() + it.first_req, reqs.begin() + it.end_req);
      }
      it.first_req = first;
      it.end_req = kept.size();
    }
    reqs.swap(kept);
  }
  // One batch. Writes that time out may still land: the memory they go to is kept (the late
  // owner marks each session's hold done once the engine dropped it).
  std::vector<Status> st;
  if (!reqs.empty()) {
    st = transferEach(reqs, [&] {
      std::vector<std::shared_ptr<void>> owners;
      std::lock_guard<std::mutex> g(sessions_mu_);
      for (const Item& it : items) {
        if (it.end_req == it.first_req) continue;
        std::shared_ptr<void> o = it.s->late_owner.lock();
        if (!o) {
          o = heldLate(nullptr, {}, &it.s->hold)();
          it.s->late_owner = o;
        }
        owners.push_back(std::move(o));
      }
      return std::make_shared<std::vector<std::shared_ptr<void>>>(std::move(owners));
    });
  }
  std::lock_guard<std::mutex> g(sessions_mu_);
  for (Item& it : items) {
    if (it.bytes > 0) {
      ErrorCode ec = ErrorCode::OK;
      for (size_t r = it.first_req; r < it.end_req; ++r)
        if (!st[r].ok()) ec = ErrorCode::TRANSFER_FAIL;
      if (ec == ErrorCode::OK) {
        for (const SourceRange& r : ranges[it.index])
          addCovered(&it.s->written, r.dst_offset, r.dst_offset + r.length);
        out[it.index] = it.bytes;
      } else {
        // Some bytes may be missing or still landing: the object cannot be published.
        it.s->failed = ec;
        out[it.index] = ec;
      }
    }
    if (--it.s->inflight == 0) sessions_cv_.notify_all();
  }
  return out;
}

std::shared_ptr<StoreClient::PutSession> StoreClient::claimSession(const std::string& key,
                                                                   ErrorCode* why) {
  std::unique_lock<std::mutex> g(sessions_mu_);
  if (closed_) {
    *why = ErrorCode::INVALID_PARAMS;
    return nullptr;
  }
  auto it = put_sessions_.find(key);
  if (it == put_sessions_.end() || !it->second->ready || it->second->ending) {
    *why = ErrorCode::OBJECT_NOT_FOUND;
    return nullptr;
  }
  std::shared_ptr<PutSession> s = it->second;
  s->ending = true;
  sessions_cv_.wait(g, [&] { return s->inflight == 0; });  // each within a transfer deadline
  return s;
}

void StoreClient::dropSession(const std::string& key, const std::shared_ptr<PutSession>& s) {
  std::lock_guard<std::mutex> g(sessions_mu_);
  auto it = put_sessions_.find(key);
  if (it != put_sessions_.end() && it->second == s) put_sessions_.erase(it);
}

ErrorCode StoreClient::revokeSession(const std::string& key, PutSession& s,
                                     std::shared_ptr<Link> link) {
  proto::PutRevokeRequest rq;
  rq.set_client_id(client_id_);
  rq.set_key(key);
  rq.set_writes_pending(writesPending(s.hold));
  rq.set_put_token(s.token);
  proto::PutRevokeResponse rr;
  ErrorCode ec;
  if (link != nullptr) {  // close(): this link only, no waiting for another master
    MasterRpcClient::CallInfo info;
    ec = link->rpc->call(proto::PUT_REVOKE, rq, &rr,
                         engine::deadlineInMs(std::min<int64_t>(options_.rpc_timeout_ms, 2000)),
                         &info);
  } else {
    ec = callMaster(proto::PUT_REVOKE, rq, &rr, true);
  }
  if (ec != ErrorCode::OK) return ec;
  holdGiven(s.hold, rr.hold());
  return errorCodeFromInt(rr.error_code());
}

ErrorCode StoreClient::putSessionRevoke(const std::string& key) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  ErrorCode why = ErrorCode::OK;
  std::shared_ptr<PutSession> s = claimSession(key, &why);
  if (s == nullptr) return why;
  // A master that forgot the put has nothing to revoke (and a new one may hold the key now).
  ErrorCode ec = forgotten_.load() == s->forgotten ? revokeSession(key, *s) : ErrorCode::OK;
  dropSession(key, s);
  return ec;
}

std::vector<ErrorCode> StoreClient::putSessionEnd(const std::vector<std::string>& keys) {
  const size_t n = keys.size();
  std::vector<ErrorCode> out(n, ErrorCode::INVALID_PARAMS);
  if (closed_) return out;
  struct End {
    size_t index;
    std::shared_ptr<PutSession> s;
    uint64_t put_id = 0;
    size_t first_req = 0, end_req = 0;
  };
  std::vector<End> ends;
  // Sessions that end failed: revoked after the records' writes went out (each revoke is a
  // master call, which must not delay the others' writes past their deadline).
  std::vector<std::pair<size_t, std::shared_ptr<PutSession>>> failed;
  auto fail = [&](size_t i, const std::shared_ptr<PutSession>& s, ErrorCode ec) {
    failed.emplace_back(i, s);
    out[i] = ec;
  };
  auto revoke_failed = [&] {
    for (auto& [i, s] : failed) {
      (void)revokeSession(keys[i], *s);
      dropSession(keys[i], s);
    }
    failed.clear();
  };
  auto keep_open = [&](size_t i, const std::shared_ptr<PutSession>& s, ErrorCode ec) {
    std::lock_guard<std::mutex> g(sessions_mu_);
    s->ending = false;  // the caller may write the rest, try again later, or revoke
    sessions_cv_.notify_all();
    out[i] = ec;
  };
  for (size_t i = 0; i < n; ++i) {
    ErrorCode why = ErrorCode::OK;
    std::shared_ptr<PutSession> s = claimSession(keys[i], &why);
    if (s == nullptr) {
      out[i] = why;  // (a key twice in the batch: OBJECT_NOT_FOUND the second time)
      continue;
    }
    if (forgotten_.load() != s->forgotten) {  // the master forgot the put: nothing to revoke
      dropSession(keys[i], s);
      out[i] = ErrorCode::RPC_FAIL;
      continue;
    }
    if (s->failed != ErrorCode::OK) {
      fail(i, s, s->failed);
      continue;
    }
    // The records are writes into the put's memory too.
    if (ErrorCode ec = mayWrite(*s); ec == ErrorCode::LEASE_EXPIRED) {
      fail(i, s, ec);
      continue;
    } else if (ec != ErrorCode::OK) {
      keep_open(i, s, ec);  // no heartbeat answered lately
      continue;
    }
    bool whole;
    {
      std::lock_guard<std::mutex> g(sessions_mu_);
      whole = s->written.size() == 1 && s->written.begin()->first == 0 &&
              s->written.begin()->second == s->size;
    }
    if (!whole) {
      keep_open(i, s, ErrorCode::INVALID_WRITE);
      continue;
    }
    ends.push_back({i, std::move(s)});
  }
  // The records of every piece (as a put writes them with its bytes) in one engine batch,
  // then one BatchPutEnd, then the commit words: a new master rebuilds an object only from
  // committed records.
  size_t pieces = 0;
  for (const End& e : ends) pieces += e.s->targets.size();
  std::vector<std::string> records;
  records.reserve(pieces);  // pointers into it stay valid
  std::vector<engine::TransferRequest> reqs;
  std::vector<End> written;
  for (End& e : ends) {
    const size_t i = e.index;
    e.put_id = newPutId();
    e.first_req = reqs.size();
    ErrorCode ec = ErrorCode::OK;
    for (const WriteTarget& t : e.s->targets) {
      if (t.record_address == 0) continue;
      records.emplace_back();
      recordOf(t, keys[i], e.put_id, e.s->size, e.s->flags, &records.back());
      std::string& rec = records.back();
      auto peer = peerFor(t.client_id);
      if (!peer.ok()) {
        forgetPeer(t.client_id);
        ec = ErrorCode::TRANSFER_FAIL;
      } else if (*peer != engine::kInvalidPeer) {
        reqs.push_back({engine::OpCode::kWrite, rec.data(), rec.size(), *peer, t.record_address});
      } else if (!inOwnSegment(t.record_address, rec.size())) {
        ec = ErrorCode::INVALID_WRITE;  // as a put's placement outside the segment (client_put)
      } else {
        ec = copySegment(reinterpret_cast<void*>(t.record_address), rec.data(), rec.size());
      }
      if (ec != ErrorCode::OK) break;
    }
    if (ec != ErrorCode::OK) {
      reqs.resize(e.first_req);
      fail(i, e.s, ec);
      continue;
    }
    e.end_req = reqs.size();
    written.push_back(std::move(e));
  }
  // Planning may have waited (a peer's handshake): a key whose time ran out meanwhile, or
  // whose master stopped answering, writes nothing.
  ends.clear();
  std::vector<engine::TransferRequest> kept;
  for (End& e : written) {
    if (ErrorCode ec = mayWrite(*e.s); ec != ErrorCode::OK) {
      fail(e.index, e.s, ec);
      continue;
    }
    const size_t first = kept.size();
    kept.insert(kept.end(), reqs.begin() + e.first_req, reqs.begin() + e.end_req);
    e.first_req = first;
    e.end_req = kept.size();
    ends.push_back(std::move(e));
  }
  // Writes that time out may still land: each session's memory is kept under its own hold
  // (its revoke below says writes_pending), the records until the engine dropped them.
  std::vector<Status> st = transferEach(kept, [&] {
    auto owners = std::make_shared<std::vector<std::shared_ptr<void>>>();
    owners->push_back(heldWith(records, nullptr)());
    for (End& e : ends)
      if (e.end_req > e.first_req) owners->push_back(heldLate(nullptr, {}, &e.s->hold)());
    return std::shared_ptr<void>(std::move(owners));
  });
  written.swap(ends);
  ends.clear();
  for (End& e : written) {
    bool ok = true;
    for (size_t r = e.first_req; r < e.end_req; ++r) ok = ok && st[r].ok();
    if (!ok) {
      fail(e.index, e.s, ErrorCode::TRANSFER_FAIL);
      continue;
    }
    ends.push_back(std::move(e));
  }
  revoke_failed();
  if (ends.empty()) return out;
  proto::BatchPutEndRequest req;
  req.set_client_id(client_id_);
  for (const End& e : ends) {
    proto::PutEndRequest* one = req.add_puts();
    one->set_key(keys[e.index]);
    one->set_put_token(e.s->token);  // not another put of the key that took it over meanwhile
  }
  proto::BatchPutEndResponse resp;
  std::shared_ptr<Link> end_link;
  // Retried like PutEnd (a second end of an ended put with its token is OK).
  ErrorCode ec = callMaster(proto::BATCH_PUT_END, req, &resp, true, &end_link);
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(resp.error_code());
  if (ec == ErrorCode::OK && resp.results_size() != static_cast<int>(ends.size()))
    ec = ErrorCode::RPC_FAIL;
  for (size_t k = 0; k < ends.size(); ++k) {
    const End& e = ends[k];
    dropSession(keys[e.index], e.s);
    ErrorCode r = ec != ErrorCode::OK ? ec : errorCodeFromInt(resp.results(k).error_code());
    // Ended by another master (another epoch): the put it started is not the one that ended.
    if (r == ErrorCode::OK && end_link->epoch != e.s->link->epoch) r = ErrorCode::RPC_FAIL;
    out[e.index] = r == ErrorCode::OK ? commit(e.s->targets, e.put_id, end_link) : r;
  }
  return out;
}

}  // namespace mooncake::store
