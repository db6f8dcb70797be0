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

ErrorCode StoreClient::putSessionStart(const std::string& key, uint64_t size,
                                       const ReplicateConfig& config) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  if (size == 0 || config.replica_num > 16) return ErrorCode::INVALID_PARAMS;
  auto s = std::make_shared<PutSession>();
  {
    std::lock_guard<std::mutex> g(sessions_mu_);
    if (!put_sessions_.emplace(key, s).second) return ErrorCode::OBJECT_ALREADY_EXISTS;
  }
  s->size = size;
  s->flags = recordFlagsOf(config);
  proto::PutStartRequest req;
  req.set_client_id(client_id_);
  req.set_key(key);
  req.set_size(size);
  toProto(config, req.mutable_config());
  proto::PutStartResponse ps;
  auto asked = Clock::now();
  ErrorCode ec = ErrorCode::RPC_FAIL;
  for (int attempt = 0; attempt < 2; ++attempt) {
    s->forgotten = forgotten_.load();
    asked = Clock::now();
    ec = callMaster(proto::PUT_START, req, &ps, false, &s->link);
    if (ec == ErrorCode::OK) ec = errorCodeFromInt(ps.error_code());
    if (ec != ErrorCode::OK || forgotten_.load() == s->forgotten) break;
    // This client registered again while PutStart ran (a new master, or the same one had
    // expired it): the master that placed the put may not know it any more. Revoke it where
    // it may still be (its token: nothing else of the key) and start again.
    s->token = ps.put_token();
    const ErrorCode rv = revokeSession(key, *s);
    ec = ErrorCode::RPC_FAIL;
    // A revoke that did not get through leaves that put where it is: starting again would
    // meet it (OBJECT_ALREADY_EXISTS, while nothing is readable).
    if (rv != ErrorCode::OK && rv != ErrorCode::OBJECT_NOT_FOUND) break;
  }
  if (ec == ErrorCode::OK) {
    s->token = ps.put_token();
    ec = targetsOf(ps.replicas(), key, size, &s->targets);
    if (ec != ErrorCode::OK) (void)revokeSession(key, *s, s->link);  // a placement we cannot use
  }
  if (ec != ErrorCode::OK) {
    dropSession(key, s);
    return ec;
  }
  s->replicas = std::move(*ps.mutable_replicas());
  // The master may take an unfinished put's memory back release_after_ms after its start: the
  // last range must have started a transfer deadline before that.
  s->write_until = Clock::time_point::max();
  if (ps.release_after_ms() > 0) {
    const int64_t ms = static_cast<int64_t>(ps.release_after_ms()) - options_.transfer_timeout_ms;
    s->write_until = asked + std::chrono::milliseconds(std::max<int64_t>(0, ms));
  }
  std::lock_guard<std::mutex> g(sessions_mu_);
  s->ready = true;
  return ErrorCode::OK;
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

ErrorCode StoreClient::putSessionEnd(const std::string& key) {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  ErrorCode why = ErrorCode::OK;
  std::shared_ptr<PutSession> s = claimSession(key, &why);
  if (s == nullptr) return why;
  if (forgotten_.load() != s->forgotten) {
    dropSession(key, s);
    return ErrorCode::RPC_FAIL;
  }
  auto fail = [&](ErrorCode ec) {
    (void)revokeSession(key, *s);
    dropSession(key, s);
    return ec;
  };
  if (s->failed != ErrorCode::OK) return fail(s->failed);
  // The records are writes into the put's memory too.
  if (ErrorCode ec = mayWrite(*s); ec == ErrorCode::LEASE_EXPIRED) {
    return fail(ec);
  } else if (ec != ErrorCode::OK) {
    std::lock_guard<std::mutex> g(sessions_mu_);
    s->ending = false;  // not now (no heartbeat answered lately): the caller may try again
    return ec;
  }
  {
    std::lock_guard<std::mutex> g(sessions_mu_);
    if (s->written.size() != 1 || s->written.begin()->first != 0 ||
        s->written.begin()->second != s->size) {
      s->ending = false;  // the caller may write the rest, or revoke
      return ErrorCode::INVALID_WRITE;
    }
  }
  // The records (each piece's, as a put writes them with its bytes), then PutEnd, then the
  // commit words: a new master rebuilds the object only from committed records.
  const uint64_t put_id = newPutId();
  std::vector<std::string> records;
  records.reserve(s->targets.size());
  std::vector<engine::TransferRequest> reqs;
  for (const WriteTarget& t : s->targets) {
    if (t.record_address == 0) continue;
    records.emplace_back();
    recordOf(t, key, put_id, s->size, s->flags, &records.back());
    std::string& rec = records.back();
    auto peer = peerFor(t.client_id);
    if (!peer.ok()) {
      forgetPeer(t.client_id);
      return fail(ErrorCode::TRANSFER_FAIL);
    }
    if (*peer == engine::kInvalidPeer) {
      if (!inOwnSegment(t.record_address, rec.size())) return fail(ErrorCode::INVALID_REPLICA);
      if (ErrorCode ec = copySegment(reinterpret_cast<void*>(t.record_address), rec.data(),
                                     rec.size());
          ec != ErrorCode::OK)
        return fail(ec);
    } else {
      reqs.push_back({engine::OpCode::kWrite, rec.data(), rec.size(), *peer, t.record_address});
    }
  }
  if (!reqs.empty() && !transferHeld(reqs, heldLate(heldWith(records, nullptr), {}, &s->hold)).ok())
    return fail(ErrorCode::TRANSFER_FAIL);
  proto::PutEndRequest pe;
  pe.set_client_id(client_id_);
  pe.set_key(key);
  pe.set_put_token(s->token);  // not another put of the key that took it over meanwhile
  proto::PutEndResponse per;
  std::shared_ptr<Link> end_link;
  ErrorCode ec = callMaster(proto::PUT_END, pe, &per, true, &end_link);  // (as putClassic's)
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(per.error_code());
  dropSession(key, s);
  if (ec != ErrorCode::OK) return ec;
  if (end_link->epoch != s->link->epoch) return ErrorCode::RPC_FAIL;
  return commit(s->targets, put_id, end_link);
}

}  // namespace mooncake::store
