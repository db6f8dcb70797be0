// StoreClient's write path. Common case (objects up to half a slab, no preferred segment): the
// writer places the object in a slab the master reserved for it, writes record + bytes to every
// replica in one engine batch, publishes with one PUBLISH (the only round trip to the master;
// it may bring the next slab along), then writes the commit word into the records
// (store/master/record.h). Otherwise: PutStart -> write -> PutEnd -> commit.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "engine/device/device.h"
#include "engine/log.h"
#include "store/client/store_client.h"
#include "store/master/record.h"

namespace mooncake::store {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMinSlabBytes = 1ull << 20;
constexpr uint64_t kMaxSlabBytes = 64ull << 20;
// Pieces up to this size are copied behind their record and written with it (writePieces).
constexpr uint64_t kInlineBytes = 16ull << 10;

uint64_t round64(uint64_t v) { return (v + 63) & ~uint64_t{63}; }

// The slab a writer asks for: room for 64 objects of this size (or two batches), within
// [1 MiB, 64 MiB]; the master caps it at a share of the segment and shrinks it when full.
uint64_t slabWant(uint64_t need, uint64_t batch_bytes) {
  return std::clamp(std::max(64 * need, 2 * batch_bytes), kMinSlabBytes, kMaxSlabBytes);
}

thread_local StoreClient::PutPhases t_phases;
int64_t nsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count();
}

}  // namespace

uint8_t recordFlagsOf(const ReplicateConfig& c) {
  return static_cast<uint8_t>((c.with_soft_pin ? kRecordSoftPin : 0) |
                              (c.with_hard_pin ? kRecordHardPin : 0));
}

StoreClient::PutPhases StoreClient::lastPutPhases() { return t_phases; }

// Put ids order puts in time: milliseconds since the Unix epoch in the high 42 bits, 22 random
// bits below (and never below this client's previous id). A rebuild that finds committed records
// of two puts of one key (an upsert, or a put after a remove, whose old records' wipe had not
// landed when the master died) keeps the newer one. Across hosts this is as good as their
// clocks agree.
uint64_t StoreClient::newPutId() {
  const uint64_t ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  std::lock_guard<std::mutex> g(rng_mu_);
  uint64_t v = (ms << 22) | (rng_() & ((uint64_t{1} << 22) - 1));
  if (v <= last_put_id_) v = last_put_id_ + 1;
  last_put_id_ = v;
  return v;
}

bool StoreClient::slabEligible(const std::string& key, uint64_t size,
                               const ReplicateConfig& config) const {
  // Slab puts carry the pins but no per-object soft-pin TTL: those take PutStart.
  return options_.use_slabs && config.preferred_segment.empty() &&
         config.preferred_segments.empty() && config.soft_pin_ttl_ms == 0 &&
         round64(recordBytes(key.size()) + size) <= kMaxSlabBytes / 2;
}

std::vector<uint64_t> StoreClient::takeRetired() {
  std::lock_guard<std::mutex> g(book_->mu);
  std::vector<uint64_t> out;
  out.swap(book_->retired);
  return out;
}

void StoreClient::SlabBook::unreserveLocked(SlabState& slab) {
  if (--slab.inflight == 0 && slab.exhausted) retired.push_back(slab.id);
}

void StoreClient::release(const std::shared_ptr<SlabState>& slab) {
  std::lock_guard<std::mutex> g(book_->mu);
  book_->unreserveLocked(*slab);
}

void StoreClient::abandon(uint32_t replica_num, const std::shared_ptr<SlabState>& slab) {
  std::lock_guard<std::mutex> g(book_->mu);
  abandonLocked(slabs_[replica_num], slab);
}

void StoreClient::abandonLocked(SlabPool& pool, const std::shared_ptr<SlabState>& slab) {
  if (pool.cur == slab) pool.cur = nullptr;
  if (slab->exhausted) return;  // handed back already, or once its last put is done
  slab->exhausted = true;
  if (slab->inflight == 0) book_->retired.push_back(slab->id);
}

void StoreClient::retireAgain(const google::protobuf::RepeatedField<uint64_t>& ids) {
  std::lock_guard<std::mutex> g(book_->mu);
  book_->retired.insert(book_->retired.end(), ids.begin(), ids.end());
}

StoreClient::Held StoreClient::heldLate(Held inner, std::vector<std::shared_ptr<SlabState>> slabs,
                                       std::shared_ptr<LateHold>* hold) const {
  return [inner = std::move(inner), slabs = std::move(slabs), hold, book = book_] {
    struct Late {
      std::shared_ptr<void> inner;
      std::vector<std::shared_ptr<SlabState>> slabs;  // each reserved once more
      std::shared_ptr<LateHold> hold;
      std::shared_ptr<SlabBook> book;
      ~Late() {
        if (book == nullptr) return;
        std::lock_guard<std::mutex> g(book->mu);
        for (const auto& slab : slabs) book->unreserveLocked(*slab);
        if (hold != nullptr) {
          hold->done = true;
          if (hold->token != 0) book->released.push_back(hold->token);
        }
        if (--book->late == 0) book->none_late.notify_all();
      }
    };
    auto late = std::make_shared<Late>();
    late->inner = inner ? inner() : nullptr;
    std::lock_guard<std::mutex> g(book->mu);
    for (const auto& slab : slabs) ++slab->inflight;
    if (hold != nullptr) late->hold = *hold = std::make_shared<LateHold>();
    ++book->late;
    late->slabs = slabs;
    late->book = book;
    return std::shared_ptr<void>(std::move(late));
  };
}

bool StoreClient::writesPending(const std::shared_ptr<LateHold>& hold) {
  if (hold == nullptr) return false;  // not handed over: the writes ended
  std::lock_guard<std::mutex> g(book_->mu);
  return !hold->done;
}

void StoreClient::holdGiven(const std::shared_ptr<LateHold>& hold, uint64_t token) {
  if (hold == nullptr || token == 0) return;
  std::lock_guard<std::mutex> g(book_->mu);
  if (hold->done)
    book_->released.push_back(token);  // they finished meanwhile
  else
    hold->token = token;
}

std::shared_ptr<StoreClient::SlabState> StoreClient::reserve(uint32_t replica_num, uint64_t need,
                                                             uint64_t batch_bytes, uint64_t* offset,
                                                             ErrorCode* why) {
  const uint64_t want = slabWant(need, batch_bytes);
  for (int round = 0;; ++round) {
    {
      std::lock_guard<std::mutex> g(book_->mu);
      for (;;) {
        SlabPool& pool = slabs_[replica_num];
        std::shared_ptr<SlabState> cur = pool.cur;
        if (cur && cur->bytes - cur->used >= need) {
          *offset = cur->used;
          cur->used += need;
          ++cur->inflight;
          if (cur->extents.size() < replica_num) {
            // A short slab (the master found fewer segments than replicas, e.g. while the
            // clients are still mounting): one put only, so that the next put asks again and
            // gets every replica once the segments are there, as a PutStart would. Kept, a
            // short slab would hold hundreds of single-replica objects that die with one holder.
            cur->exhausted = true;
            pool.cur = nullptr;
          }
          return cur;
        }
        if (cur) abandonLocked(pool, cur);  // full: retired once its last put is published
        if (!pool.next) break;
        pool.cur = std::move(pool.next);
      }
    }
    if (round > 0) {  // a fresh slab did not hold it: the master caps slabs below this size
      *why = ErrorCode::NO_AVAILABLE_HANDLE;
      return nullptr;
    }
    std::lock_guard<std::mutex> refill(refill_mu_);
    {
      std::lock_guard<std::mutex> g(book_->mu);
      SlabPool& pool = slabs_[replica_num];
      if ((pool.cur && pool.cur->bytes - pool.cur->used >= need) || pool.next) {
        --round;  // another thread refilled meanwhile
        continue;
      }
    }
    proto::AllocSlabRequest req;
    req.set_client_id(client_id_);
    req.set_replica_num(replica_num);
    req.set_bytes(std::max(want, round64(need)));
    req.set_min_bytes(round64(need));
    for (uint64_t id : takeRetired()) req.add_retire(id);
    proto::AllocSlabResponse resp;
    std::shared_ptr<Link> link;
    ErrorCode ec = callMaster(proto::ALLOC_SLAB, req, &resp, false, &link);
    if (ec != ErrorCode::OK) retireAgain(req.retire());  // (the master may not have seen them)
    if (ec == ErrorCode::OK) ec = errorCodeFromInt(resp.error_code());
    if (ec != ErrorCode::OK) {
      *why = ec;
      return nullptr;
    }
    auto slab = std::make_shared<SlabState>();
    slab->id = resp.slab().slab_id();
    slab->epoch = link->epoch;
    slab->bytes = resp.slab().bytes();
    for (const auto& e : resp.slab().extents())
      slab->extents.push_back({e.client_id(), e.address(), e.record_tag()});
    std::lock_guard<std::mutex> g(book_->mu);
    if (slab->bytes < need) {  // too small for this object: hand it back
      book_->retired.push_back(slab->id);
      *why = ErrorCode::NO_AVAILABLE_HANDLE;
      return nullptr;
    }
    slabs_[replica_num].cur = std::move(slab);
  }
}

void StoreClient::takeNextSlab(uint32_t replica_num, const proto::PublishResponse& resp) {
  std::lock_guard<std::mutex> g(book_->mu);
  SlabPool& pool = slabs_[replica_num];
  pool.prefetching = false;
  if (!resp.has_next_slab() || resp.next_slab_error() != 0 || resp.next_slab().slab_id() == 0)
    return;
  auto slab = std::make_shared<SlabState>();
  slab->id = resp.next_slab().slab_id();
  slab->bytes = resp.next_slab().bytes();
  for (const auto& e : resp.next_slab().extents())
    slab->extents.push_back({e.client_id(), e.address(), e.record_tag()});
  if (pool.next) book_->retired.push_back(pool.next->id);
  pool.next = std::move(slab);
}

void StoreClient::recordOf(const WriteTarget& t, const std::string& key, uint64_t put_id,
                           uint64_t size, uint8_t flags, std::string* out) {
  RecordInfo info;
  info.key = key;
  info.put_id = put_id;
  info.object_size = size;
  info.piece_offset = t.piece_offset;
  info.piece_length = t.piece_length;
  info.replica_index = t.replica_index;
  info.flags = flags;
  out->assign(recordBytes(key.size()), '\0');
  encodeRecord(info, t.record_tag, out->data());
}

ErrorCode StoreClient::writePieces(const std::vector<WriteTarget>& targets, const std::string& key,
                                   uint64_t put_id, uint64_t size, uint8_t flags, const char* src,
                                   std::vector<std::string>* records,
                                   std::vector<engine::TransferRequest>* reqs) {
  // A piece from GPU memory is not inlined into its record (pageable host memory): it goes
  // from the device straight to the peer. One lookup: every piece is of the same buffer.
  const bool src_on_gpu = size > 0 && engine::device::isDeviceMemory(src);
  for (const WriteTarget& t : targets) {
    auto peer = peerFor(t.client_id);
    if (!peer.ok()) {
      forgetPeer(t.client_id);
      return ErrorCode::TRANSFER_FAIL;
    }
    const char* rec = nullptr;
    uint64_t rb = 0;
    if (t.record_address != 0) {
      rb = recordBytes(key.size());
      if (t.data_address != t.record_address + rb) return ErrorCode::INVALID_WRITE;
      // A small piece for a peer travels with its record: one write instead of two (each
      // costs a system call on the shm transport's cold-page path).
      const bool inline_piece =
          *peer != engine::kInvalidPeer && t.piece_length <= kInlineBytes && !src_on_gpu;
      // capacity reserved by the caller: pointers stay valid
      records->emplace_back();
      recordOf(t, key, put_id, size, flags, &records->back());
      if (inline_piece) records->back().resize(rb + t.piece_length);
      char* out = records->back().data();
      if (inline_piece) {
        if (ErrorCode ec = copyLocal(out + rb, src + t.piece_offset, t.piece_length);
            ec != ErrorCode::OK)
          return ec;
        reqs->push_back(
            {engine::OpCode::kWrite, out, rb + t.piece_length, *peer, t.record_address});
        continue;
      }
      rec = out;
    }
    const uint64_t start = t.record_address != 0 ? t.record_address : t.data_address;
    if (*peer == engine::kInvalidPeer) {  // our own segment
      // Never trust a placement with a raw pointer: it must lie inside the segment this client
      // lent (a confused or hostile master must not make us write anywhere else).
      if (!inOwnSegment(start, rb + t.piece_length)) return ErrorCode::INVALID_WRITE;
      if (rec != nullptr) {
        if (ErrorCode ec = copySegment(reinterpret_cast<void*>(t.record_address), rec, rb);
            ec != ErrorCode::OK)
          return ec;
      }
      if (ErrorCode ec = copyLocal(reinterpret_cast<void*>(t.data_address), src + t.piece_offset,
                                   t.piece_length);
          ec != ErrorCode::OK)
        return ec;
    } else {
      if (rec != nullptr)
        reqs->push_back(
            {engine::OpCode::kWrite, const_cast<char*>(rec), rb, *peer, t.record_address});
      reqs->push_back({engine::OpCode::kWrite, const_cast<char*>(src + t.piece_offset),
                       t.piece_length, *peer, t.data_address});
    }
  }
  return ErrorCode::OK;
}

ErrorCode StoreClient::commit(const std::vector<WriteTarget>& targets, uint64_t put_id,
                              const std::shared_ptr<Link>& link) {
  std::vector<engine::TransferRequest> reqs;
  // On the heap: a WRITE of it that outlives its deadline still reads it (transferEach).
  const std::shared_ptr<void> word_owner = std::make_shared<uint64_t>(put_id);
  const uint64_t& word = *static_cast<const uint64_t*>(word_owner.get());
  size_t committed = 0, with_records = 0;
  for (const WriteTarget& t : targets) {
    if (t.record_address == 0) continue;
    ++with_records;
    const uint64_t at = t.record_address + kRecordCommitOffset;
    auto peer = peerFor(t.client_id);
    if (!peer.ok()) continue;
    if (*peer == engine::kInvalidPeer) {
      if (!inOwnSegment(at, 8)) continue;
      if (segment_on_device_) {
        if (copySegment(reinterpret_cast<void*>(at), &word, sizeof(word)) != ErrorCode::OK)
          continue;
      } else {
        reinterpret_cast<std::atomic<uint64_t>*>(at)->store(word, std::memory_order_release);
      }
      ++committed;
    } else {
      // Through the engine, not a store through mappedAddress: the record's page is usually
      // one this process never touched, and the engine copies such pages without faulting
      // them in here (engine/transport/shm). Nothing reads the word before this put returns
      // (see below).
      reqs.push_back({engine::OpCode::kWrite, const_cast<uint64_t*>(&word), 8, *peer, at});
    }
  }
  if (!reqs.empty())
    for (const Status& s : transferEach(reqs, [&] { return word_owner; }))
      committed += s.ok() ? 1 : 0;
  if (with_records > 0 && committed == 0) return ErrorCode::TRANSFER_FAIL;
  // The commit must be in place before any new master's rebuild reads the records. A new
  // master serves only after the one that acknowledged this put stopped (it died, or it stepped
  // down and dropped its engine), which this client's engine sees within milliseconds: while
  // that master is alive and serving, no rebuild can have read our records yet.
  if (link->broken || !link->rpc->masterAlive()) return ErrorCode::RPC_FAIL;
  return ErrorCode::OK;
}

ErrorCode StoreClient::put(const std::string& key, const void* data, size_t size,
                           const ReplicateConfig& config) {
  return putParts(key, {{data, size}}, config);
}

ErrorCode StoreClient::putParts(const std::string& key,
                                const std::vector<std::pair<const void*, size_t>>& parts,
                                const ReplicateConfig& config) {
  auto joined = std::make_shared<std::string>();  // (a late WRITE may still read it)
  const char* src = nullptr;
  uint64_t size = 0;
  if (ErrorCode ec = checkedValue(key, parts, config, joined.get(), &src, &size);
      ec != ErrorCode::OK)
    return ec;
  return putOne(key, src, size, config, joined);
}

ErrorCode StoreClient::putOne(const std::string& key, const char* src, uint64_t size,
                              const ReplicateConfig& config,
                              const std::shared_ptr<void>& src_owner) {
  if (!slabEligible(key, size, config)) return putClassic(key, src, size, config, src_owner);
  const uint32_t rn = std::max<uint32_t>(1, config.replica_num);
  const uint64_t rb_max = recordBytes(key.size());
  const uint64_t need = round64(rb_max + size);
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.rpc_timeout_ms);
  t_phases = PutPhases{};
  t_phases.slab = true;
  ErrorCode last = ErrorCode::RPC_FAIL;  // why the last attempt failed
  for (int attempt = 0; attempt < 3 && Clock::now() < deadline; ++attempt) {
    uint64_t offset = 0;
    ErrorCode why = ErrorCode::OK;
    auto t0 = Clock::now();
    std::shared_ptr<SlabState> slab = reserve(rn, need, 0, &offset, &why);
    t_phases.alloc_ns += nsSince(t0);
    if (!slab) {
      if (why == ErrorCode::NO_AVAILABLE_HANDLE)
        return putClassic(key, src, size, config, src_owner);
      return why;
    }
    std::vector<WriteTarget> targets;
    for (size_t i = 0; i < slab->extents.size(); ++i) {
      const auto& e = slab->extents[i];
      WriteTarget t;
      t.client_id = e.client_id;
      t.record_tag = e.record_tag;
      t.record_address = e.record_tag != 0 ? e.address + offset : 0;
      t.data_address = e.address + offset + (e.record_tag != 0 ? rb_max : 0);
      t.piece_length = size;
      t.replica_index = static_cast<uint32_t>(i);
      targets.push_back(std::move(t));
    }
    const uint64_t put_id = newPutId();
    std::vector<std::string> records;
    records.reserve(targets.size());
    std::vector<engine::TransferRequest> reqs;
    auto t1 = Clock::now();
    ErrorCode ec = writePieces(targets, key, put_id, size, recordFlagsOf(config), src, &records, &reqs);
    if (ec == ErrorCode::OK && !reqs.empty() &&
        !transferHeld(reqs, heldLate(heldWith(records, src_owner), {slab})).ok())
      ec = ErrorCode::TRANSFER_FAIL;
    t_phases.write_ns += nsSince(t1);
    if (ec != ErrorCode::OK) {
      release(slab);
      if (ec != ErrorCode::TRANSFER_FAIL) return ec;
      last = ec;
      // A holder of the slab is gone (or unreachable): give the slab up and write into a new
      // one (the master places no new extent on a segment whose owner it saw go).
      abandon(rn, slab);
      continue;
    }
    proto::PublishRequest req;
    req.set_client_id(client_id_);
    proto::PublishEntry* e = req.add_entries();
    e->set_key(key);
    e->set_size(size);
    e->set_slab_id(slab->id);
    e->set_offset(offset);
    e->set_put_id(put_id);
    e->set_soft_pin(config.with_soft_pin);
    e->set_hard_pin(config.with_hard_pin);
    for (uint64_t id : takeRetired()) req.add_retire(id);
    bool prefetch = false;
    {
      std::lock_guard<std::mutex> g(book_->mu);
      SlabPool& pool = slabs_[rn];
      // Ask for the next slab along with this put when the current one runs low.
      if (!pool.next && !pool.prefetching && slab->bytes - slab->used < slab->bytes / 4) {
        pool.prefetching = prefetch = true;
        req.mutable_next_slab()->set_replica_num(rn);
        // As large as a fresh slab would be (the master grants less when the store is full;
        // asking for the current slab's size would keep a slab shrunk then small for good).
        req.mutable_next_slab()->set_bytes(slabWant(need, 0));
        req.mutable_next_slab()->set_min_bytes(need);
      }
    }
    proto::PublishResponse resp;
    std::shared_ptr<Link> link;
    auto t2 = Clock::now();
    ec = callMaster(proto::PUBLISH, req, &resp, false, &link);
    t_phases.publish_ns += nsSince(t2);
    if (ec != ErrorCode::OK) retireAgain(req.retire());
    release(slab);
    if (prefetch) {
      if (ec == ErrorCode::OK) {
        takeNextSlab(rn, resp);
      } else {
        std::lock_guard<std::mutex> g(book_->mu);
        slabs_[rn].prefetching = false;
      }
    }
    if (ec != ErrorCode::OK) return ec;
    if (resp.results_size() != 1) return ErrorCode::RPC_FAIL;
    ErrorCode r = errorCodeFromInt(resp.results(0));
    if (r == ErrorCode::OK) {
      auto t3 = Clock::now();
      ErrorCode c = commit(targets, put_id, link);
      t_phases.commit_ns += nsSince(t3);
      return c;
    }
    if (r != ErrorCode::OBJECT_NOT_FOUND) return r;
    last = ErrorCode::RPC_FAIL;
    // The slab is gone (its master changed, or a segment of it left: its other extents are
    // reserved until it is handed back): drop it, write again.
    abandon(rn, slab);
  }
  return last;
}

ErrorCode StoreClient::targetsOf(const google::protobuf::RepeatedPtrField<proto::Replica>& replicas,
                                 const std::string& key, uint64_t size,
                                 std::vector<WriteTarget>* out) {
  for (int i = 0; i < replicas.size(); ++i) {
    uint64_t off = 0;
    for (const auto& p : replicas.Get(i).pieces()) {
      WriteTarget t;
      t.client_id = p.client_id();
      t.record_tag = p.record_tag();
      t.data_address = p.address();
      t.record_address = p.record_tag() != 0 ? p.address() - recordBytes(key.size()) : 0;
      t.piece_offset = off;
      t.piece_length = p.length();
      t.replica_index = static_cast<uint32_t>(i);
      off += p.length();
      if (off > size) return ErrorCode::INVALID_WRITE;
      out->push_back(std::move(t));
    }
    if (off != size) return ErrorCode::INVALID_WRITE;
  }
  return ErrorCode::OK;
}

ErrorCode StoreClient::putClassic(const std::string& key, const char* src, uint64_t size,
                                  const ReplicateConfig& config,
                                  const std::shared_ptr<void>& src_owner) {
  proto::PutStartRequest req;
  req.set_client_id(client_id_);
  req.set_key(key);
  req.set_size(size);
  toProto(config, req.mutable_config());
  proto::PutStartResponse ps;
  std::shared_ptr<Link> link;
  t_phases = PutPhases{};
  auto t0 = Clock::now();
  ErrorCode ec = callMaster(proto::PUT_START, req, &ps, false, &link);
  t_phases.alloc_ns = nsSince(t0);
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(ps.error_code());
  if (ec != ErrorCode::OK) return ec;
  std::vector<WriteTarget> targets;
  if (ErrorCode e = targetsOf(ps.replicas(), key, size, &targets); e != ErrorCode::OK) return e;
  const uint64_t put_id = newPutId();
  std::vector<std::string> records;
  records.reserve(targets.size());
  std::vector<engine::TransferRequest> reqs;
  auto t1 = Clock::now();
  ec = writePieces(targets, key, put_id, size, recordFlagsOf(config), src, &records, &reqs);
  bool ok = ec == ErrorCode::OK;
  std::shared_ptr<LateHold> hold;  // made if the writes are handed over
  if (ok && !reqs.empty()) {
    Status st = transferHeld(reqs, heldLate(heldWith(records, src_owner), {}, &hold));
    ok = st.ok();
    if (!ok) {
      MC_LOG(WARN, STORE) << "store client " << client_id_ << ": put of '" << key << "' ("
                          << size << " bytes): " << st.toString();
    }
  }
  t_phases.write_ns = nsSince(t1);
  if (!ok) {
    proto::PutRevokeRequest rq;
    rq.set_client_id(client_id_);
    rq.set_key(key);
    rq.set_writes_pending(writesPending(hold));
    rq.set_put_token(ps.put_token());
    proto::PutRevokeResponse rr;
    if (callMaster(proto::PUT_REVOKE, rq, &rr, true) == ErrorCode::OK) holdGiven(hold, rr.hold());
    return ec != ErrorCode::OK ? ec : ErrorCode::TRANSFER_FAIL;
  }
  proto::PutEndRequest pe;
  pe.set_client_id(client_id_);
  pe.set_key(key);
  pe.set_put_token(ps.put_token());
  proto::PutEndResponse per;
  std::shared_ptr<Link> end_link;
  auto t2 = Clock::now();
  ec = callMaster(proto::PUT_END, pe, &per, true, &end_link);  // a retried PutEnd is harmless
  t_phases.publish_ns = nsSince(t2);
  if (ec == ErrorCode::OK) ec = errorCodeFromInt(per.error_code());
  if (ec != ErrorCode::OK) return ec;
  // Ended by another master (another epoch): the put it started is not the one that ended.
  // The same master over a new link (a reconnect after a blip) is fine.
  if (end_link->epoch != link->epoch) return ErrorCode::RPC_FAIL;
  auto t3 = Clock::now();
  ErrorCode c = commit(targets, put_id, end_link);
  t_phases.commit_ns = nsSince(t3);
  return c;
}

std::vector<ErrorCode> StoreClient::batchPut(
    const std::vector<std::string>& keys, const std::vector<std::pair<const void*, size_t>>& values,
    const ReplicateConfig& config) {
  std::vector<ErrorCode> out(keys.size(), ErrorCode::OK);
  if (keys.size() != values.size()) {
    std::fill(out.begin(), out.end(), ErrorCode::INVALID_PARAMS);
    return out;
  }
  const uint32_t rn = std::max<uint32_t>(1, config.replica_num);
  struct Item {
    size_t index;
    std::shared_ptr<SlabState> slab;
    uint64_t offset = 0;
    uint64_t put_id = 0;
    std::vector<WriteTarget> targets;
    size_t first_req = 0, end_req = 0;
  };
  std::vector<Item> items;
  std::vector<size_t> classic;
  uint64_t batch_bytes = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (closed_ || (values[i].first == nullptr && values[i].second > 0) || values[i].second == 0 ||
        config.replica_num > 16) {
      out[i] = ErrorCode::INVALID_PARAMS;
    } else if (checkKey(keys[i]) != ErrorCode::OK) {
      out[i] = ErrorCode::INVALID_KEY;
    } else if (slabEligible(keys[i], values[i].second, config)) {
      Item it;
      it.index = i;
      items.push_back(std::move(it));
      batch_bytes += round64(recordBytes(keys[i].size()) + values[i].second);
    } else {
      classic.push_back(i);
    }
  }
  // Place every object, then one engine batch for all of them.
  std::vector<std::string> records;
  records.reserve(items.size() * std::max<uint32_t>(rn, 1) + 1);
  std::vector<engine::TransferRequest> reqs;
  for (Item& it : items) {
    const std::string& key = keys[it.index];
    const uint64_t size = values[it.index].second;
    const uint64_t rb = recordBytes(key.size());
    ErrorCode why = ErrorCode::OK;
    it.slab = reserve(rn, round64(rb + size), batch_bytes, &it.offset, &why);
    batch_bytes -= std::min(batch_bytes, round64(rb + size));
    if (!it.slab) {
      if (why == ErrorCode::NO_AVAILABLE_HANDLE)
        classic.push_back(it.index);
      else
        out[it.index] = why;
      continue;
    }
    for (size_t x = 0; x < it.slab->extents.size(); ++x) {
      const auto& e = it.slab->extents[x];
      WriteTarget t;
      t.client_id = e.client_id;
      t.record_tag = e.record_tag;
      t.record_address = e.record_tag != 0 ? e.address + it.offset : 0;
      t.data_address = e.address + it.offset + (e.record_tag != 0 ? rb : 0);
      t.piece_length = size;
      t.replica_index = static_cast<uint32_t>(x);
      it.targets.push_back(std::move(t));
    }
    it.put_id = newPutId();
    it.first_req = reqs.size();
    if (records.capacity() < records.size() + it.targets.size()) {
      // Never reallocate: queued requests point into the records.
      out[it.index] = ErrorCode::INTERNAL_ERROR;
      release(it.slab);
      it.slab = nullptr;
      continue;
    }
    ErrorCode ec = writePieces(it.targets, key, it.put_id, size, recordFlagsOf(config),
                               static_cast<const char*>(values[it.index].first), &records, &reqs);
    it.end_req = reqs.size();
    if (ec != ErrorCode::OK) {
      reqs.resize(it.first_req);  // none of its writes go out
      out[it.index] = ec;
      release(it.slab);
      it.slab = nullptr;
    }
  }
  std::vector<std::shared_ptr<SlabState>> written;
  for (const Item& it : items)
    if (it.slab && it.end_req > it.first_req) written.push_back(it.slab);
  std::vector<Status> per = transferEach(reqs, heldLate(heldWith(records, nullptr), written));
  proto::PublishRequest req;
  req.set_client_id(client_id_);
  std::vector<Item*> published;
  std::vector<size_t> rewrite;  // written to a holder that failed: into a new slab, one by one
  for (Item& it : items) {
    if (!it.slab) continue;
    bool ok = true;
    for (size_t r = it.first_req; r < it.end_req; ++r) ok = ok && per[r].ok();
    if (!ok) {
      abandon(rn, it.slab);
      release(it.slab);
      it.slab = nullptr;
      rewrite.push_back(it.index);
      continue;
    }
    proto::PublishEntry* e = req.add_entries();
    e->set_key(keys[it.index]);
    e->set_size(values[it.index].second);
    e->set_slab_id(it.slab->id);
    e->set_offset(it.offset);
    e->set_put_id(it.put_id);
    e->set_soft_pin(config.with_soft_pin);
    e->set_hard_pin(config.with_hard_pin);
    published.push_back(&it);
  }
  if (!published.empty()) {
    for (uint64_t id : takeRetired()) req.add_retire(id);
    proto::PublishResponse resp;
    std::shared_ptr<Link> link;
    ErrorCode ec = callMaster(proto::PUBLISH, req, &resp, false, &link);
    if (ec != ErrorCode::OK) retireAgain(req.retire());
    for (Item* it : published) release(it->slab);
    if (ec == ErrorCode::OK && resp.results_size() != static_cast<int>(published.size()))
      ec = ErrorCode::RPC_FAIL;
    std::vector<size_t> again;
    for (size_t n = 0; n < published.size(); ++n) {
      Item* it = published[n];
      if (ec != ErrorCode::OK) {
        out[it->index] = ec;
        continue;
      }
      ErrorCode r = errorCodeFromInt(resp.results(static_cast<int>(n)));
      if (r == ErrorCode::OBJECT_NOT_FOUND) {  // its slab is gone: write it again below
        abandon(rn, it->slab);
        again.push_back(it->index);
        continue;
      }
      out[it->index] = r;
      if (r == ErrorCode::OK) out[it->index] = commit(it->targets, it->put_id, link);
    }
    for (size_t i : again)
      out[i] = putOne(keys[i], static_cast<const char*>(values[i].first), values[i].second, config);
  }
  for (size_t i : rewrite)
    out[i] = putOne(keys[i], static_cast<const char*>(values[i].first), values[i].second, config);
  for (size_t i : classic)
    out[i] =
        putClassic(keys[i], static_cast<const char*>(values[i].first), values[i].second, config);
  return out;
}

}  // namespace mooncake::store
