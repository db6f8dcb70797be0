#include "store/client/store_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine/device/device.h"
#include "engine/log.h"

namespace mooncake::store {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxKeyLength = 4096;

}  // namespace

ErrorCode StoreClient::checkKey(const std::string& key) {
  return (key.empty() || key.size() > kMaxKeyLength) ? ErrorCode::INVALID_KEY : ErrorCode::OK;
}

ErrorCode StoreClient::gatherParts(const std::vector<std::pair<const void*, size_t>>& parts,
                                   std::string* joined, const char** src, uint64_t* size) {
  *size = 0;
  for (const auto& p : parts) {
    if (p.first == nullptr && p.second > 0) return ErrorCode::INVALID_PARAMS;
    *size += p.second;
  }
  if (parts.size() == 1) {
    *src = static_cast<const char*>(parts[0].first);
    return ErrorCode::OK;
  }
  joined->reserve(*size);
  for (const auto& p : parts) joined->append(static_cast<const char*>(p.first), p.second);
  *src = joined->data();
  return ErrorCode::OK;
}

void toProto(const ReplicateConfig& c, proto::ReplicateConfig* p) {
  p->set_replica_num(c.replica_num);
  p->set_with_soft_pin(c.with_soft_pin);
  p->set_with_hard_pin(c.with_hard_pin);
  p->set_preferred_segment(c.preferred_segment);
  for (const std::string& s : c.preferred_segments) p->add_preferred_segments(s);
  p->set_soft_pin_ttl_ms(c.soft_pin_ttl_ms);
  p->set_keep_soft_pin(c.keep_soft_pin);
}

std::vector<Status> StoreClient::transferEach(const std::vector<engine::TransferRequest>& reqs,
                                              const Held& held) {
  std::vector<Status> per;
  if (reqs.empty()) return per;
  auto id = engine_->submit(reqs);
  if (!id.ok()) {
    per.assign(reqs.size(), id.status());
    return per;
  }
  Status st = engine_->wait(*id, engine::deadlineInMs(options_.transfer_timeout_ms), &per);
  if (st.code() == Code::kTimeout) {
    MC_LOG(WARN, STORE) << "store client " << client_id_ << ": " << reqs.size()
                        << " transfers not done in " << options_.transfer_timeout_ms
                        << " ms; they may still run";
    if (held) engine_->keepUntilDone(*id, held());
  }
  per.resize(reqs.size(), Status(Code::kTimeout, "batch"));
  return per;
}

Status StoreClient::transferHeld(const std::vector<engine::TransferRequest>& reqs,
                                 const Held& held) {
  for (Status& st : transferEach(reqs, held))
    if (!st.ok()) return std::move(st);
  return Status::OK();
}

ErrorCode StoreClient::checkedValue(const std::string& key,
                                    const std::vector<std::pair<const void*, size_t>>& parts,
                                    const ReplicateConfig& config, std::string* joined,
                                    const char** src, uint64_t* size) const {
  if (closed_) return ErrorCode::INVALID_PARAMS;
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  if (ErrorCode ec = gatherParts(parts, joined, src, size); ec != ErrorCode::OK) return ec;
  if (*size == 0 || config.replica_num > 16) return ErrorCode::INVALID_PARAMS;
  return ErrorCode::OK;
}

// ---- peers and buffers ----

ErrorOr<engine::PeerId> StoreClient::peerFor(const std::string& client_id) {
  if (client_id == client_id_) return engine::kInvalidPeer;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = peers_.find(client_id);
    if (it != peers_.end() && engine_->peerStatus(it->second).ok()) return it->second;
  }
  std::shared_ptr<engine::Rendezvous> rdv = rendezvous();
  if (rdv == nullptr) return ErrorCode::TRANSFER_FAIL;
  auto p = engine_->openPeer(*rdv, client_id, engine::deadlineInMs(options_.transfer_timeout_ms));
  if (!p.ok()) return ErrorCode::TRANSFER_FAIL;
  std::lock_guard<std::mutex> g(mu_);
  peers_[client_id] = *p;
  return *p;
}

void StoreClient::forgetPeer(const std::string& client_id) {
  std::lock_guard<std::mutex> g(mu_);
  peers_.erase(client_id);
}

ErrorCode StoreClient::registerBuffer(void* addr, size_t len) {
  if (addr == nullptr || len == 0) return ErrorCode::INVALID_PARAMS;
  // GPU memory (a serving process's KV cache) registers as such: the engine then moves it
  // between the device and the peers without a bounce through pageable host memory.
  const engine::device::PointerInfo where = engine::device::locate(addr);
  Status st = where.device ? engine_->registerMemory(addr, len, engine::MemoryKind::kCuda,
                                                     where.ordinal)
                           : engine_->registerMemory(addr, len);
  if (!st.ok()) {
    MC_LOG(WARN, STORE) << "store client " << client_id_ << ": register_buffer(" << addr << ", "
                        << len << "): " << st.toString();
    return ErrorCode::INVALID_PARAMS;
  }
  std::lock_guard<std::mutex> g(mu_);
  buffers_.emplace_back(reinterpret_cast<uintptr_t>(addr), len);
  // GPU data will move between the buffer and this client's own segment (copyLocal): pinned,
  // the copy engines DMA it straight (the driver would bounce pageable memory).
  if (where.device && segment_ != nullptr && !segment_on_device_ && !segment_pinned_) {
    segment_pinned_ = true;
    if (auto layer = engine::device::get(); layer.ok())
      segment_pin_ = engine::device::PinnedRange(*layer, segment_, options_.segment_size);
  }
  return ErrorCode::OK;
}

ErrorCode StoreClient::unregisterBuffer(void* addr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = std::find_if(buffers_.begin(), buffers_.end(), [&](const auto& b) {
    return b.first == reinterpret_cast<uintptr_t>(addr);
  });
  if (it == buffers_.end()) return ErrorCode::INVALID_PARAMS;
  buffers_.erase(it);
  (void)engine_->unregisterMemory(addr);
  return ErrorCode::OK;
}

bool StoreClient::isRegistered(const void* addr, size_t len) const {
  // Registered with the engine: a buffer from registerBuffer(), or engine-allocated memory
  // (the local buffer, or a region of an engine this client shares).
  return len > 0 && engine_->isRegistered(addr, len);
}

// ---- data movement ----

ErrorCode StoreClient::copyLocal(void* dst, const void* src, size_t len) const {
  // A caller's GPU buffer: host code cannot touch it; the device layer copies.
  Status st = engine::device::copyAny(dst, src, len,
                                      engine::deadlineInMs(options_.transfer_timeout_ms));
  if (st.ok()) return ErrorCode::OK;
  MC_LOG(WARN, STORE) << "store client " << client_id_ << ": device copy of " << len
                      << " bytes: " << st.toString();
  return ErrorCode::TRANSFER_FAIL;
}

ErrorCode StoreClient::copySegment(void* dst, const void* src, size_t len) const {
  if (!segment_on_device_) {
    std::memcpy(dst, src, len);
    return ErrorCode::OK;
  }
  return copyLocal(dst, src, len);
}

bool StoreClient::inOwnSegment(uint64_t address, uint64_t len) const {
  const uint64_t seg = reinterpret_cast<uint64_t>(segment_);
  return segment_ != nullptr && address >= seg && len <= options_.segment_size &&
         address - seg <= options_.segment_size - len;
}

ErrorCode StoreClient::planRange(const proto::Replica& r, uint64_t size, engine::OpCode op,
                                 uint64_t off, uint64_t len, char* local,
                                 std::vector<engine::TransferRequest>* reqs) {
  const bool write = op == engine::OpCode::kWrite;
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
      char* here = local + (lo - off);
      const uint64_t there = p.address() + (lo - at);
      if (*peer == engine::kInvalidPeer) {  // our own segment
        // Never trust a placement with a raw pointer: it must lie inside the segment this
        // client lent (a confused or hostile master must not make us touch anything else).
        if (!inOwnSegment(p.address(), p.length()))
          return write ? ErrorCode::INVALID_WRITE : ErrorCode::INVALID_READ;
        char* mine = reinterpret_cast<char*>(there);
        ErrorCode ec = write ? copyLocal(mine, here, hi - lo) : copyLocal(here, mine, hi - lo);
        if (ec != ErrorCode::OK) return ec;
      } else {
        reqs->push_back({op, here, hi - lo, *peer, there});
      }
    }
    at += p.length();
  }
  return at == size ? ErrorCode::OK : ErrorCode::INVALID_READ;
}

ErrorCode StoreClient::readReplicas(const proto::GetReplicaListResponse& rl, void* buf,
                                    size_t skip_first, Clock::time_point asked,
                                    const std::shared_ptr<void>& buf_owner, size_t* late) {
  ErrorCode last = ErrorCode::TRANSFER_FAIL;
  if (late != nullptr) *late = 0;
  for (int i = static_cast<int>(skip_first); i < rl.replicas_size(); ++i) {
    std::vector<engine::TransferRequest> reqs;
    ErrorCode ec = planReplica(rl.replicas(i), rl.size(), engine::OpCode::kRead,
                               static_cast<char*>(buf), &reqs);
    if (ec == ErrorCode::INVALID_READ) return ec;
    if (ec != ErrorCode::OK) continue;
    Status st = reqs.empty()
                    ? Status::OK()
                    : transferHeld(reqs, buf_owner ? Held([&] { return buf_owner; }) : Held());
    if (!st.ok()) {
      for (const auto& p : rl.replicas(i).pieces()) forgetPeer(p.client_id());
      // Not done in time: its READs may still land in buf, so no other replica is read into it
      // (the caller may go on into fresh memory from replica *late).
      if (st.code() == Code::kTimeout) {
        if (late != nullptr) *late = static_cast<size_t>(i) + 1;
        return ErrorCode::TRANSFER_FAIL;
      }
      continue;
    }
    last = ErrorCode::OK;
    break;
  }
  if (last == ErrorCode::OK && rl.lease_ttl_ms() > 0 &&
      Clock::now() - asked > std::chrono::milliseconds(rl.lease_ttl_ms()))
    return ErrorCode::LEASE_EXPIRED;
  return last;
}

ErrorOr<uint64_t> StoreClient::getInto(const std::string& key, void* buf, size_t capacity,
                                       const std::shared_ptr<void>& buf_owner) {
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  if (closed_ || (buf == nullptr && capacity > 0)) return ErrorCode::INVALID_PARAMS;
  proto::GetReplicaListRequest req;
  req.set_key(key);
  proto::GetReplicaListResponse rl;
  auto asked = Clock::now();  // the read lease starts after this
  if (ErrorCode ec = callMaster(proto::GET_REPLICA_LIST, req, &rl, true); ec != ErrorCode::OK)
    return ec;
  if (rl.error_code() != 0) return errorCodeFromInt(rl.error_code());
  if (rl.size() > capacity) return ErrorCode::BUFFER_OVERFLOW;
  ErrorCode ec = readReplicas(rl, buf, 0, asked, buf_owner);
  if (ec != ErrorCode::OK) return ec;
  return rl.size();
}

ErrorOr<std::string> StoreClient::get(const std::string& key) {
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  if (closed_) return ErrorCode::INVALID_PARAMS;
  proto::GetReplicaListRequest req;
  req.set_key(key);
  proto::GetReplicaListResponse rl;
  auto asked = Clock::now();  // the read lease starts after this
  if (ErrorCode ec = callMaster(proto::GET_REPLICA_LIST, req, &rl, true); ec != ErrorCode::OK)
    return ec;
  if (rl.error_code() != 0) return errorCodeFromInt(rl.error_code());
  // A replica whose read timed out keeps its buffer (held by the engine: the READs may still
  // land); the next replica is read into a fresh one.
  size_t from = 0;
  for (;;) {
    auto out = std::make_shared<std::string>(rl.size(), '\0');
    size_t late = 0;
    ErrorCode ec = readReplicas(rl, out->data(), from, asked, out, &late);
    if (ec == ErrorCode::OK) return std::move(*out);
    if (late == 0 || late >= static_cast<size_t>(rl.replicas_size())) return ec;
    from = late;
  }
}

std::vector<ErrorOr<uint64_t>> StoreClient::batchGetInto(
    const std::vector<std::string>& keys, const std::vector<std::pair<void*, size_t>>& bufs,
    const std::shared_ptr<void>& bufs_owner) {
  return batchRead(keys, bufs, bufs_owner, nullptr);
}

std::vector<ErrorOr<uint64_t>> StoreClient::batchRead(
    const std::vector<std::string>& keys, const std::vector<std::pair<void*, size_t>>& bufs,
    const std::shared_ptr<void>& bufs_owner, const std::function<void*(size_t)>& fresh) {
  std::vector<ErrorOr<uint64_t>> out(keys.size(), ErrorOr<uint64_t>(ErrorCode::INVALID_PARAMS));
  if (keys.size() != bufs.size() || closed_ || keys.empty()) return out;
  proto::BatchGetReplicaListRequest req;
  for (const auto& k : keys) req.add_keys(k);
  proto::BatchGetReplicaListResponse resp;
  auto asked = Clock::now();
  ErrorCode ec = callMaster(proto::BATCH_GET_REPLICA_LIST, req, &resp, true);
  if (ec == ErrorCode::OK && resp.error_code() != 0) ec = errorCodeFromInt(resp.error_code());
  if (ec == ErrorCode::OK && resp.results_size() != static_cast<int>(keys.size()))
    ec = ErrorCode::RPC_FAIL;
  if (ec != ErrorCode::OK) {
    for (auto& o : out) o = ec;
    return out;
  }
  // First replica of every key in one engine batch; keys whose transfer failed retry the
  // remaining replicas one by one.
  std::vector<engine::TransferRequest> reqs;
  std::vector<size_t> first_req(keys.size() + 1, 0);
  std::vector<ErrorCode> st(keys.size(), ErrorCode::OK);
  for (size_t i = 0; i < keys.size(); ++i) {
    first_req[i] = reqs.size();
    const auto& rl = resp.results(static_cast<int>(i));
    if (checkKey(keys[i]) != ErrorCode::OK)
      st[i] = ErrorCode::INVALID_KEY;
    else if (rl.error_code() != 0)
      st[i] = errorCodeFromInt(rl.error_code());
    else if (rl.size() > bufs[i].second)
      st[i] = ErrorCode::BUFFER_OVERFLOW;
    else if (bufs[i].first == nullptr)
      st[i] = ErrorCode::INVALID_PARAMS;
    else if (rl.replicas_size() == 0)
      st[i] = ErrorCode::OBJECT_NOT_FOUND;
    else if (planReplica(rl.replicas(0), rl.size(), engine::OpCode::kRead,
                         static_cast<char*>(bufs[i].first), &reqs) != ErrorCode::OK) {
      // The pieces it planned before failing leave the shared batch: they would read into
      // bufs[i] while (or, timed out, after) the other replicas are read into it.
      reqs.resize(first_req[i]);
      st[i] = ErrorCode::TRANSFER_FAIL;
    }
    first_req[i + 1] = reqs.size();
  }
  first_req[keys.size()] = reqs.size();
  std::vector<Status> per =
      transferEach(reqs, bufs_owner ? Held([&] { return bufs_owner; }) : Held());
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& rl = resp.results(static_cast<int>(i));
    if (st[i] == ErrorCode::TRANSFER_FAIL) {
      st[i] = readReplicas(rl, bufs[i].first, 1, asked, bufs_owner);
    } else if (st[i] == ErrorCode::OK) {
      bool ok = true, late = false;
      for (size_t r = first_req[i]; r < first_req[i + 1]; ++r) {
        ok = ok && per[r].ok();
        late = late || per[r].code() == Code::kTimeout;
      }
      void* again = late && fresh ? fresh(i) : nullptr;
      if (late && again == nullptr) {
        st[i] = ErrorCode::TRANSFER_FAIL;  // its READs may still land in bufs[i] (readReplicas)
      } else if (late) {
        st[i] = readReplicas(rl, again, 1, asked, bufs_owner);
      } else if (!ok) {
        st[i] = readReplicas(rl, bufs[i].first, 1, asked, bufs_owner);
      } else if (rl.lease_ttl_ms() > 0 &&
                 Clock::now() - asked > std::chrono::milliseconds(rl.lease_ttl_ms())) {
        st[i] = ErrorCode::LEASE_EXPIRED;  // the bytes may have been overwritten meanwhile
      }
    }
    out[i] = st[i] == ErrorCode::OK ? ErrorOr<uint64_t>(rl.size()) : ErrorOr<uint64_t>(st[i]);
  }
  return out;
}

std::vector<ErrorOr<std::string>> StoreClient::batchGet(const std::vector<std::string>& keys) {
  std::vector<ErrorOr<std::string>> out;
  out.reserve(keys.size());
  // Sizes first (one RPC), then one batch straight into the result strings. Shared: a read
  // that timed out may still land in them; its key's other replicas are read into a fresh
  // string (`again`, held too).
  auto held = std::make_shared<std::pair<std::vector<std::string>, std::vector<std::string>>>();
  held->first.resize(keys.size());
  held->second.resize(keys.size());
  std::vector<std::string>& vals = held->first;
  std::vector<std::string>& again = held->second;
  std::vector<std::pair<void*, size_t>> bufs(keys.size(), {nullptr, 0});
  proto::BatchGetReplicaListRequest req;
  for (const auto& k : keys) req.add_keys(k);
  proto::BatchGetReplicaListResponse resp;
  if (!keys.empty() &&
      callMaster(proto::BATCH_GET_REPLICA_LIST, req, &resp, true) == ErrorCode::OK &&
      resp.results_size() == static_cast<int>(keys.size())) {
    for (size_t i = 0; i < keys.size(); ++i) {
      vals[i].resize(resp.results(static_cast<int>(i)).size());
      bufs[i] = {vals[i].data(), vals[i].size()};
    }
  }
  auto got = batchRead(keys, bufs, held, [&](size_t i) -> void* {
    again[i].resize(vals[i].size());
    return again[i].data();
  });
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!got[i].ok()) {
      out.emplace_back(got[i].error());
    } else {
      std::string& v = again[i].empty() ? vals[i] : again[i];
      v.resize(*got[i]);
      out.emplace_back(std::move(v));
    }
  }
  return out;
}

// ---- metadata ----

ErrorOr<bool> StoreClient::exists(const std::string& key) {
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  proto::ExistsRequest req;
  req.set_key(key);
  proto::ExistsResponse resp;
  if (ErrorCode ec = callMaster(proto::EXISTS, req, &resp, true); ec != ErrorCode::OK) return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return resp.exists();
}

std::vector<ErrorOr<bool>> StoreClient::batchExists(const std::vector<std::string>& keys) {
  std::vector<ErrorOr<bool>> out(keys.size(), ErrorOr<bool>(ErrorCode::RPC_FAIL));
  proto::BatchExistsRequest req;
  for (const auto& k : keys) req.add_keys(k);
  proto::BatchExistsResponse resp;
  if (keys.empty() || callMaster(proto::BATCH_EXISTS, req, &resp, true) != ErrorCode::OK ||
      resp.results_size() != static_cast<int>(keys.size()))
    return out;
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& r = resp.results(static_cast<int>(i));
    out[i] = r.error_code() != 0 ? ErrorOr<bool>(errorCodeFromInt(r.error_code()))
                                 : ErrorOr<bool>(r.exists());
  }
  return out;
}

ErrorOr<uint64_t> StoreClient::getSize(const std::string& key) {
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  proto::GetSizeRequest req;
  req.set_key(key);
  proto::GetSizeResponse resp;
  if (ErrorCode ec = callMaster(proto::GET_SIZE, req, &resp, true); ec != ErrorCode::OK) return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return resp.size();
}

ErrorCode StoreClient::remove(const std::string& key, bool force) {
  if (ErrorCode ec = checkKey(key); ec != ErrorCode::OK) return ec;
  const std::vector<std::string> one{key};
  forgetReadLists(&one);
  proto::RemoveRequest req;
  req.set_key(key);
  req.set_force(force);
  proto::RemoveResponse resp;
  if (ErrorCode ec = callMaster(proto::REMOVE, req, &resp, false); ec != ErrorCode::OK) return ec;
  return errorCodeFromInt(resp.error_code());
}

ErrorOr<uint64_t> StoreClient::removeByRegex(const std::string& regex, bool force) {
  forgetReadLists(nullptr);
  proto::RemoveByRegexRequest req;
  req.set_regex(regex);
  req.set_force(force);
  proto::RemoveByRegexResponse resp;
  if (ErrorCode ec = callMaster(proto::REMOVE_BY_REGEX, req, &resp, false); ec != ErrorCode::OK)
    return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return resp.removed();
}

ErrorOr<uint64_t> StoreClient::removeAll(bool force) {
  forgetReadLists(nullptr);
  proto::RemoveAllRequest req;
  req.set_force(force);
  proto::RemoveAllResponse resp;
  if (ErrorCode ec = callMaster(proto::REMOVE_ALL, req, &resp, false); ec != ErrorCode::OK)
    return ec;
  if (resp.error_code() != 0) return errorCodeFromInt(resp.error_code());
  return resp.removed();
}

}  // namespace mooncake::store
