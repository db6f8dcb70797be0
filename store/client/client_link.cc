// StoreClient's link to the master: finding it (a fixed address, or the leader in etcd),
// registering (mount, and after a failover or restart a report of the records the segment holds),
// the heartbeat thread that keeps the client known and reconnects when the master goes, and
// callMaster(), which waits for a serving master and retries within a call's deadline.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "engine/log.h"
#include "engine/params.h"
#include "store/client/store_client.h"
#include "store/ha/etcd_client.h"
#include "store/ha/leader_election.h"
#include "store/master/record.h"

namespace mooncake::store {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
constexpr const char* kEtcdScheme = "etcd://";
constexpr size_t kReportBatch = 4096;

bool splitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  int p = std::atoi(address.c_str() + colon + 1);
  if (p <= 0 || p > 65535) return false;
  *host = address.substr(0, colon);
  *port = static_cast<uint16_t>(p);
  return true;
}

// Whether the master answered that it cannot serve this call yet (or at all): nothing was done.
bool notServed(ErrorCode ec) {
  return ec == ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS ||
         ec == ErrorCode::UNAVAILABLE_IN_CURRENT_MODE;
}

}  // namespace

ErrorOr<std::unique_ptr<StoreClient>> StoreClient::create(engine::TransferEngine* engine,
                                                          engine::Rendezvous* rdv,
                                                          MasterService* local_master,
                                                          StoreClientOptions options) {
  if (engine == nullptr || (rdv == nullptr && local_master == nullptr))
    return ErrorCode::INVALID_PARAMS;
  std::unique_ptr<StoreClient> c(new StoreClient());
  c->engine_ = engine;
  c->fixed_rdv_ = rdv;
  c->local_master_ = local_master;
  c->options_ = options;
  c->options_.use_slabs = options.use_slabs && params::getBool("MC_STORE_ONE_RTT_PUT");
  c->client_id_ = engine->name();
  c->segment_name_ = c->client_id_;  // preferred_segment names a client
  std::string why;
  if (ErrorCode ec = c->allocateSegment(&why); ec != ErrorCode::OK) {
    MC_LOG(WARN, STORE) << "store client " << c->client_id_ << ": " << why;
    return ec;
  }
  if (local_master != nullptr) {
    auto link = std::make_shared<Link>();
    link->rpc = MasterRpcClient::local(local_master, options.rpc_timeout_ms);
    if (rdv != nullptr)
      link->rdv = std::shared_ptr<engine::Rendezvous>(rdv, [](engine::Rendezvous*) {});
    if (rdv != nullptr && options.publish_engine && !engine->publish(*rdv).ok())
      return ErrorCode::RPC_FAIL;
    link->epoch = local_master->epoch();
    const int64_t sent = Clock::now().time_since_epoch().count();
    if (ErrorCode ec = c->mount(*link, false); ec != ErrorCode::OK) return ec;
    c->heard_ = sent;  // (the mount registered it)
    c->registered_epoch_ = c->reported_epoch_ = link->epoch;
    c->link_ = std::move(link);
  } else {
    std::string why;
    if (ErrorCode ec = c->reconnect(&why); ec != ErrorCode::OK) {
      MC_LOG(WARN, STORE) << "store client " << c->client_id_ << ": " << why;
      return ec;
    }
  }
  if (ErrorCode ec = c->startHeartbeat(); ec != ErrorCode::OK) return ec;
  return ErrorOr<std::unique_ptr<StoreClient>>(std::move(c));
}

ErrorOr<std::unique_ptr<StoreClient>> StoreClient::connect(engine::TransferEngine* engine,
                                                           StoreClientOptions options,
                                                           std::string* why) {
  std::string sink;
  if (why == nullptr) why = &sink;
  if (engine == nullptr || options.master_address.empty()) {
    *why = "no engine or no master address";
    return ErrorCode::INVALID_PARAMS;
  }
  std::unique_ptr<StoreClient> c(new StoreClient());
  c->engine_ = engine;
  c->options_ = options;
  c->options_.use_slabs = options.use_slabs && params::getBool("MC_STORE_ONE_RTT_PUT");
  c->client_id_ = engine->name();
  c->segment_name_ = c->client_id_;
  const std::string& addr = options.master_address;
  if (addr.rfind(kEtcdScheme, 0) == 0) {
    c->etcd_endpoints_ = addr.substr(std::strlen(kEtcdScheme));
    if (c->options_.cluster_id.empty())
      c->options_.cluster_id = params::getString("MC_STORE_CLUSTER_ID");
    auto etcd = ha::EtcdClient::create(c->etcd_endpoints_, 2000);
    if (!etcd.ok()) {
      *why = etcd.status().toString();
      return ErrorCode::INVALID_PARAMS;
    }
    c->etcd_ = std::move(etcd).value();
    // Membership: the key a new leader waits for before it serves (it holds our report).
    auto lease = c->etcd_->grantLease(std::max<int64_t>(1, options.etcd_lease_ttl_s));
    if (!lease.ok()) {
      *why = "etcd at " + c->etcd_endpoints_ + ": " + lease.status().toString();
      return ErrorCode::ETCD_OPERATION_ERROR;
    }
    c->member_lease_ = *lease;
    Status st = c->etcd_->put(ha::clientMemberKey(c->options_.cluster_id, c->client_id_), "",
                              c->member_lease_);
    if (!st.ok()) {
      *why = "etcd at " + c->etcd_endpoints_ + ": " + st.toString();
      return ErrorCode::ETCD_OPERATION_ERROR;
    }
    c->next_member_renew_ = Clock::now() + milliseconds(options.etcd_lease_ttl_s * 1000 / 3);
  } else {
    std::string host;
    uint16_t port = 0;
    if (!splitHostPort(addr, &host, &port)) {
      *why = "master address '" + addr + "' is not host:port or etcd://host:port";
      return ErrorCode::INVALID_PARAMS;
    }
  }
  if (ErrorCode ec = c->allocateSegment(why); ec != ErrorCode::OK) return ec;
  // A master (or a leader) may still be starting: keep trying for a while.
  const auto deadline =
      Clock::now() + milliseconds(std::max<int64_t>(options.rpc_timeout_ms, 10000));
  ErrorCode ec = ErrorCode::RPC_FAIL;
  for (int64_t backoff = 20;; backoff = std::min<int64_t>(backoff * 2, 200)) {
    ec = c->reconnect(why);
    if (ec == ErrorCode::OK || c->secret_refused_ ||
        Clock::now() + milliseconds(backoff) >= deadline)
      break;
    std::this_thread::sleep_for(milliseconds(backoff));
  }
  if (ec != ErrorCode::OK) return ec;
  if (ErrorCode e = c->startHeartbeat(); e != ErrorCode::OK) return e;
  return ErrorOr<std::unique_ptr<StoreClient>>(std::move(c));
}

namespace {

// MC_STORE_SEGMENT_DEVICE: -1 host memory, N a device; false when it names neither.
bool segmentDeviceFromParams(int* device) {
  std::string v = params::getString("MC_STORE_SEGMENT_DEVICE");
  if (v.empty() || v == "cpu" || v == "host") {
    *device = -1;
    return true;
  }
  for (const char* prefix : {"cuda:", "gpu:"})
    if (v.rfind(prefix, 0) == 0) v = v.substr(std::strlen(prefix));
  if (v == "cuda" || v == "gpu") v = "0";
  if (v.empty() || v.size() > 4 || v.find_first_not_of("0123456789") != std::string::npos)
    return false;
  *device = std::stoi(v);
  return true;
}

}  // namespace

ErrorCode StoreClient::allocateSegment(std::string* why) {
  if (options_.segment_size == 0) return ErrorCode::OK;
  if (options_.segment_device == StoreClientOptions::kSegmentDeviceFromParams &&
      !segmentDeviceFromParams(&options_.segment_device)) {
    *why = "MC_STORE_SEGMENT_DEVICE='" + params::getString("MC_STORE_SEGMENT_DEVICE") +
           "' names no device (cpu, cuda:N, gpu:N or N)";
    return ErrorCode::INVALID_PARAMS;
  }
  const bool gpu = options_.segment_device >= 0;
  auto mem = gpu ? engine_->allocate(options_.segment_size, engine::MemoryKind::kCuda,
                                     options_.segment_device)
                 : engine_->allocate(options_.segment_size);
  if (!mem.ok()) {
    *why = "cannot allocate a segment of " + std::to_string(options_.segment_size) + " bytes" +
           (gpu ? " on GPU " + std::to_string(options_.segment_device) : std::string()) + ": " +
           mem.status().toString();
    return ErrorCode::NO_AVAILABLE_HANDLE;
  }
  segment_ = *mem;
  // Device memory comes uncleared: what an earlier process left there is never taken for a
  // record, whose magic carries this segment's random tag (and whose header a checksum covers).
  segment_on_device_ = gpu;
  while (record_tag_ == 0) record_tag_ = rng_();  // 0 means "no records"
  return ErrorCode::OK;
}

ErrorCode StoreClient::startHeartbeat() {
  hb_thread_ = std::thread([this] { heartbeatLoop(); });
  return ErrorCode::OK;
}

StoreClient::~StoreClient() { close(); }

uint64_t StoreClient::masterEpoch() const {
  std::lock_guard<std::mutex> g(link_mu_);
  return link_ && !link_->broken ? link_->epoch : 0;
}

void StoreClient::close() {
  if (closed_.exchange(true)) return;
  link_cv_.notify_all();
  if (hb_thread_.joinable()) hb_thread_.join();
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> g(link_mu_);
    link = link_;
  }
  if (link && !link->broken) {
    // A slab a late write may still land in is handed back (or, unmounting, freed by the
    // master), a revoked put's hold released, only after that write finished: wait a while.
    std::unique_lock<std::mutex> g(book_->mu);
    if (!book_->none_late.wait_for(g, std::chrono::milliseconds(options_.transfer_timeout_ms),
                                   [&] { return book_->late == 0; })) {
      MC_LOG(WARN, STORE) << "store client " << client_id_ << ": closing while " << book_->late
                          << " timed-out put batches still run; the master may place other "
                          << "objects where they land";
    }
  }
  if (link && !link->broken && link->rpc->masterAlive()) {
    auto deadline = engine::deadlineInMs(std::min<int64_t>(options_.rpc_timeout_ms, 2000));
    MasterRpcClient::CallInfo info;
    // Put sessions left open: their unfinished puts go now (else when the master expires
    // this client; also for a session a range call still writes into). Their holds are
    // released below when their late writes finished.
    std::vector<std::pair<std::string, std::shared_ptr<PutSession>>> open;
    {
      std::lock_guard<std::mutex> g(sessions_mu_);
      for (auto& [key, session] : put_sessions_)
        if (session->ready && !session->ending && session->inflight == 0 &&
            session->forgotten == forgotten_.load()) {
          session->ending = true;  // no call takes it from here on
          open.emplace_back(key, session);
        }
    }
    for (auto& [key, session] : open) (void)revokeSession(key, *session, link);
    std::vector<uint64_t> retire = takeRetired(), released;
    {
      std::lock_guard<std::mutex> g(book_->mu);
      for (auto& [n, pool] : slabs_) {
        if (pool.cur) retire.push_back(pool.cur->id);
        if (pool.next) retire.push_back(pool.next->id);
      }
      slabs_.clear();
      released.swap(book_->released);
    }
    if (!retire.empty() || !released.empty()) {
      proto::PublishRequest req;
      req.set_client_id(client_id_);
      for (uint64_t id : retire) req.add_retire(id);
      for (uint64_t h : released) req.add_release_holds(h);
      proto::PublishResponse resp;
      (void)link->rpc->call(proto::PUBLISH, req, &resp, deadline, &info);
    }
    if (segment_ != nullptr) {
      proto::UnmountSegmentRequest req;
      req.set_client_id(client_id_);
      req.set_segment_name(segment_name_);
      proto::UnmountSegmentResponse resp;
      (void)link->rpc->call(proto::UNMOUNT_SEGMENT, req, &resp, deadline, &info);
    }
  }
  if (etcd_ && member_lease_ != 0) (void)etcd_->revokeLease(member_lease_);
  // The segment memory stays with the engine (freed with it): a peer may still be reading a
  // replica it was told about before the unmount.
}

std::shared_ptr<engine::Rendezvous> StoreClient::rendezvous() {
  std::lock_guard<std::mutex> g(link_mu_);
  return link_ ? link_->rdv : nullptr;
}

// ---------------------------------------------------------------- connecting

ErrorOr<std::shared_ptr<StoreClient::Link>> StoreClient::openLink(std::string* why) {
  auto link = std::make_shared<Link>();
  int64_t open_ms = std::min<int64_t>(options_.rpc_timeout_ms, 2000);
  if (fixed_rdv_ != nullptr) {
    // A master of a group (rank 0) may come up after its clients: the first time, wait as
    // long as a group's start may take.
    if (registered_epoch_ == 0) open_ms = 30000;
    link->rdv = std::shared_ptr<engine::Rendezvous>(fixed_rdv_, [](engine::Rendezvous*) {});
  } else {
    std::string address = options_.master_address;
    if (etcd_) {
      auto leader = ha::readLeader(*etcd_, options_.cluster_id);
      if (!leader.ok()) {
        *why = leader.status().toString();
        return ErrorCode::RPC_FAIL;
      }
      address = leader->address;
    }
    std::string host;
    uint16_t port = 0;
    if (!splitHostPort(address, &host, &port)) {
      *why = "master address '" + address + "' is not host:port";
      return ErrorCode::INVALID_PARAMS;
    }
    // Short: a refused connection means no master there (yet); the caller retries, looking the
    // leader up again, instead of waiting on a dead address.
    auto rdv = engine::TcpRendezvousClient::connect(
        host, port, options_.secret, engine::deadlineInMs(std::min<int64_t>(open_ms, 500)));
    secret_refused_ = !rdv.ok() && rdv.status().code() == mooncake::Code::kPermissionDenied;
    if (!rdv.ok()) {
      *why = "master rendezvous " + address + ": " + rdv.status().toString();
      return ErrorCode::RPC_FAIL;
    }
    link->rdv = std::shared_ptr<engine::Rendezvous>(std::move(rdv).value());
  }
  // Peers find this client (its segment) by name in the master's rendezvous.
  if (options_.publish_engine) {
    Status st = engine_->publish(*link->rdv);
    if (!st.ok()) {
      *why = "publishing this engine: " + st.toString();
      return ErrorCode::RPC_FAIL;
    }
  }
  auto rpc = MasterRpcClient::connect(engine_, *link->rdv, options_.rpc_timeout_ms, open_ms);
  if (!rpc.ok()) {
    *why = "the master did not publish its engine in its rendezvous";
    return rpc.error();
  }
  link->rpc = std::move(rpc).value();
  return link;
}

ErrorCode StoreClient::reconnect(std::string* why) {
  std::lock_guard<std::mutex> reg(register_mu_);
  auto opened = openLink(why);
  if (!opened.ok()) return opened.error();
  std::shared_ptr<Link> link = std::move(opened).value();
  proto::HeartbeatRequest hb;
  hb.set_client_id(client_id_);
  if (segment_ != nullptr) hb.add_segment_names(segment_name_);
  proto::HeartbeatResponse hr;
  MasterRpcClient::CallInfo info;
  const int64_t sent = Clock::now().time_since_epoch().count();
  ErrorCode ec = link->rpc->call(proto::HEARTBEAT, hb, &hr,
                                 engine::deadlineInMs(options_.rpc_timeout_ms), &info);
  if (ec != ErrorCode::OK) {
    *why = std::string("registering with the master: ") + std::string(errorCodeName(ec));
    return ec;
  }
  if (hr.client_ttl_ms() > 0) client_ttl_ms_ = hr.client_ttl_ms();
  if (ErrorCode r = registerWith(*link, hr.need_remount(), info.epoch); r != ErrorCode::OK) {
    *why = std::string("mounting or reporting: ") + std::string(errorCodeName(r));
    return r;
  }
  heard_ = sent;
  std::lock_guard<std::mutex> g(link_mu_);
  if (link_) reconnects_.fetch_add(1);
  link_ = std::move(link);
  reconnect_wanted_ = false;
  link_cv_.notify_all();
  return ErrorCode::OK;
}

ErrorCode StoreClient::registerWith(Link& link, bool need_remount, uint64_t epoch) {
  link.epoch = epoch;
  const bool new_master = epoch != registered_epoch_;
  // Either way the master does not know this client's unfinished puts (put sessions).
  if (new_master || need_remount) forgotten_.fetch_add(1);
  if (new_master) {
    // A new master: the slabs were the old one's.
    std::lock_guard<std::mutex> g(book_->mu);
    slabs_.clear();
    book_->retired.clear();
  }
  if (segment_ != nullptr) {
    if (need_remount && !new_master && reported_epoch_ == epoch) {
      // The same master forgot us (it expired us): it dropped every object in our segment, so
      // our records must go before anyone reports them to a later master.
      if (!wipeOwnRecords()) {  // a GPU segment the device layer could not read or write
        MC_LOG(WARN, STORE) << "store client " << client_id_
                            << ": could not wipe the records of its segment; will try again";
        return ErrorCode::TRANSFER_FAIL;
      }
      if (ErrorCode ec = mount(link, false); ec != ErrorCode::OK) return ec;
    } else if (need_remount || reported_epoch_ != epoch) {
      // A master that has not had our whole report (new, or an earlier report broke off): mount
      // (again: the master then drops what it staged of an unfinished report) and report.
      if (ErrorCode ec = mount(link, true); ec != ErrorCode::OK) return ec;
      if (ErrorCode ec = reportRecords(link); ec != ErrorCode::OK) return ec;
      reported_epoch_ = epoch;
    }
  }
  registered_epoch_ = epoch;
  return ErrorCode::OK;
}

ErrorCode StoreClient::mount(Link& link, bool will_report) {
  if (segment_ == nullptr) return ErrorCode::OK;
  proto::MountSegmentRequest req;
  req.set_client_id(client_id_);
  req.set_segment_name(segment_name_);
  req.set_base(reinterpret_cast<uint64_t>(segment_));
  req.set_size(options_.segment_size);
  req.set_record_tag(record_tag_);
  req.set_will_report(will_report);
  proto::MountSegmentResponse resp;
  MasterRpcClient::CallInfo info;
  ErrorCode ec = link.rpc->call(proto::MOUNT_SEGMENT, req, &resp,
                                engine::deadlineInMs(options_.rpc_timeout_ms), &info);
  if (ec != ErrorCode::OK) return ec;
  return errorCodeFromInt(resp.error_code());
}

namespace {

// The stretches of our segment's shared-memory file that hold data (SEEK_DATA, and mincore for
// where they end: SegmentDataMap): the scan never touches memory that was never written (which
// would allocate it).
class HoleMap {
 public:
  HoleMap(const engine::SegmentDesc& desc, const void* seg, uint64_t size) {
    const uint64_t a = reinterpret_cast<uint64_t>(seg);
    for (const auto& r : desc.regions) {
      if (r.shm_name.empty() || a < r.addr || a + size > r.addr + r.len) continue;
      fd_ = shm_open(r.shm_name.c_str(), O_RDONLY, 0);
      if (fd_ >= 0) map_.emplace(fd_, a - r.addr, seg, size);
      break;
    }
  }
  ~HoleMap() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool usable() const { return fd_ >= 0; }
  std::pair<uint64_t, uint64_t> next(uint64_t off) { return map_->next(off); }

 private:
  int fd_ = -1;
  std::optional<SegmentDataMap> map_;
};

}  // namespace

ErrorCode StoreClient::reportRecords(Link& link) {
  proto::ReportObjectsRequest req;
  req.set_client_id(client_id_);
  req.set_segment_name(segment_name_);
  uint64_t pending = 0, reported = 0;
  ErrorCode err = ErrorCode::OK;
  auto send = [&](bool last) {
    req.set_last(last);
    if (last) req.set_pending(pending);
    proto::ReportObjectsResponse resp;
    MasterRpcClient::CallInfo info;
    ErrorCode ec = link.rpc->call(proto::REPORT_OBJECTS, req, &resp,
                                  engine::deadlineInMs(options_.rpc_timeout_ms), &info);
    if (ec == ErrorCode::OK) ec = errorCodeFromInt(resp.error_code());
    if (err == ErrorCode::OK) err = ec;
    req.clear_records();
  };
  const bool walked = scanOwnRecords([&](uint64_t off, const RecordInfo& r) {
        if (!r.committed) {  // a put that never ended: revoked
          ++pending;
          return;
        }
        proto::ReportedRecord* x = req.add_records();
        x->set_key(r.key);
        x->set_put_id(r.put_id);
        x->set_object_size(r.object_size);
        x->set_piece_offset(r.piece_offset);
        x->set_piece_length(r.piece_length);
        x->set_replica_index(r.replica_index);
        x->set_flags(r.flags);
        x->set_offset(off);
        ++reported;
        if (static_cast<size_t>(req.records_size()) >= kReportBatch) send(false);
      });
  if (!walked) {
    // Not the whole report: the master must not take it for one (it drops what it staged
    // when this client mounts again, which the retry does).
    MC_LOG(WARN, STORE) << "store client " << client_id_ << ": could not read its GPU segment "
                        << "to report its records; will try again";
    return ErrorCode::TRANSFER_FAIL;
  }
  send(true);
  MC_LOG(INFO, STORE) << "store client " << client_id_ << ": reported " << reported << " records ("
                      << pending << " unfinished) to the master";
  return err;
}

bool StoreClient::scanOwnRecords(const std::function<void(uint64_t, const RecordInfo&)>& fn) {
  if (segment_ == nullptr) return true;
  if (segment_on_device_) {  // read through a host window, a device copy at a time
    char* seg = static_cast<char*>(segment_);
    engine::device::PinnedRange pin;  // the walk's window (one buffer), pinned at its first read
    char* pinned = nullptr;
    return scanRecords(
        [&](uint64_t off, uint64_t len, char* out) {
          if (pinned == nullptr) {
            pinned = out;
            if (auto layer = engine::device::get(); layer.ok())
              pin = engine::device::PinnedRange(*layer, out, len);
          }
          return copySegment(out, seg + off, len) == ErrorCode::OK;
        },
        options_.segment_size, record_tag_, fn);
  }
  HoleMap holes(engine_->localSegment(), segment_, options_.segment_size);
  std::function<std::pair<uint64_t, uint64_t>(uint64_t)> next;
  if (holes.usable()) next = [&](uint64_t off) { return holes.next(off); };
  scanRecords(static_cast<const char*>(segment_), options_.segment_size, record_tag_, fn, next);
  return true;
}

bool StoreClient::wipeOwnRecords() {
  char* base = static_cast<char*>(segment_);
  const uint64_t zero = 0;
  bool wiped = true;
  const bool walked = scanOwnRecords([&](uint64_t off, const RecordInfo&) {
    if (segment_on_device_)
      wiped = copySegment(base + off, &zero, sizeof(zero)) == ErrorCode::OK && wiped;
    else
      reinterpret_cast<std::atomic<uint64_t>*>(base + off)->store(0, std::memory_order_release);
  });
  return walked && wiped;
}

// ---------------------------------------------------------------- calls

void StoreClient::markBroken(const std::shared_ptr<Link>& link) {
  if (!link || link->rpc->isLocal()) return;
  link->broken = true;
  std::lock_guard<std::mutex> g(link_mu_);
  reconnect_wanted_ = true;
  link_cv_.notify_all();
}

std::shared_ptr<StoreClient::Link> StoreClient::currentLink(engine::Deadline deadline) {
  std::unique_lock<std::mutex> lk(link_mu_);
  while (!closed_ && (!link_ || link_->broken)) {
    reconnect_wanted_ = true;
    link_cv_.notify_all();
    if (link_cv_.wait_until(lk, deadline) == std::cv_status::timeout) break;
  }
  if (link_ && !link_->broken) return link_;
  return nullptr;
}

ErrorCode StoreClient::callMaster(proto::Method method,
                                  const google::protobuf::MessageLite& request,
                                  google::protobuf::MessageLite* response, bool idempotent,
                                  std::shared_ptr<Link>* used) {
  const auto deadline = engine::deadlineInMs(options_.rpc_timeout_ms);
  int64_t backoff_ms = 5;
  for (;;) {
    std::shared_ptr<Link> link = currentLink(deadline);
    if (!link) return ErrorCode::RPC_FAIL;  // no master within the deadline
    MasterRpcClient::CallInfo info;
    ErrorCode ec = link->rpc->call(method, request, response, deadline, &info);
    if (info.epoch != 0 && info.epoch != link->epoch) {
      // The master behind this link is a new one (it was re-elected): register again.
      markBroken(link);
      if (!idempotent && !notServed(ec)) return ec == ErrorCode::OK ? ErrorCode::RPC_FAIL : ec;
      if (ec == ErrorCode::OK) {
        if (used) *used = link;
        return ec;
      }
    } else if (ec == ErrorCode::OK) {
      if (used) *used = link;
      return ec;
    } else if (ec == ErrorCode::UNAVAILABLE_IN_CURRENT_MODE) {
      markBroken(link);  // not (or no longer) the leader: look for the leader again
    } else if (ec == ErrorCode::RPC_FAIL) {
      if (info.master_dead) markBroken(link);
      // The request may have been served before the master died: only a call that can be
      // repeated safely is.
      if (info.sent && !idempotent) return ErrorCode::RPC_FAIL;
      if (!info.master_dead && Clock::now() >= deadline) return ErrorCode::RPC_FAIL;
    } else if (ec != ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS) {
      return ec;  // an answer (INVALID_PARAMS of the envelope, ...)
    }
    if (Clock::now() + milliseconds(backoff_ms) >= deadline) return ErrorCode::RPC_FAIL;
    std::this_thread::sleep_for(milliseconds(backoff_ms));
    backoff_ms = std::min<int64_t>(backoff_ms * 2, 100);
  }
}

// ---------------------------------------------------------------- heartbeat thread

void StoreClient::membershipTick() {
  if (!etcd_ || Clock::now() < next_member_renew_) return;
  const int64_t ttl = std::max<int64_t>(1, options_.etcd_lease_ttl_s);
  // A new leader waits (up to its rebuild timeout) for the report of every client whose key
  // lives. One that no master has answered for two TTLs (it cannot reach the leader etcd names)
  // would not report: it lets its key lapse, and joins again once a master answers it.
  const int64_t heard = heard_.load();
  if (heard != 0 && Clock::now() - Clock::time_point(Clock::duration(heard)) >
                        std::chrono::seconds(2 * ttl))
    return;
  next_member_renew_ = Clock::now() + milliseconds(ttl * 1000 / 3);
  const std::string key = ha::clientMemberKey(options_.cluster_id, client_id_);
  auto left = member_lease_ != 0 ? etcd_->keepAlive(member_lease_) : Result<int64_t>(int64_t{0});
  if (left.ok() && *left > 0) return;
  if (!left.ok()) {
    MC_LOG(WARN, STORE) << "store client " << client_id_ << ": etcd: " << left.status().toString();
    next_member_renew_ = Clock::now() + milliseconds(200);
    return;
  }
  auto lease = etcd_->grantLease(ttl);  // lapsed (etcd was away): join again
  if (lease.ok() && etcd_->put(key, "", *lease).ok()) member_lease_ = *lease;
}

void StoreClient::flushRetired(const std::shared_ptr<Link>& link) {
  std::vector<uint64_t> retire = takeRetired(), released;
  {
    std::lock_guard<std::mutex> g(book_->mu);
    released.swap(book_->released);
  }
  if (retire.empty() && released.empty()) return;
  proto::PublishRequest req;
  req.set_client_id(client_id_);
  for (uint64_t id : retire) req.add_retire(id);
  for (uint64_t h : released) req.add_release_holds(h);
  proto::PublishResponse resp;
  MasterRpcClient::CallInfo info;
  ErrorCode ec = link->rpc->call(
      proto::PUBLISH, req, &resp,
      engine::deadlineInMs(std::min<int64_t>(options_.rpc_timeout_ms, 2000)), &info);
  if (ec == ErrorCode::OK) return;
  std::lock_guard<std::mutex> g(book_->mu);  // the next time then
  book_->retired.insert(book_->retired.end(), retire.begin(), retire.end());
  book_->released.insert(book_->released.end(), released.begin(), released.end());
}

bool StoreClient::leaderMoved(const Link& link) {
  if (!etcd_) return false;
  auto leader = ha::readLeader(*etcd_, options_.cluster_id);
  if (leader.ok()) return static_cast<uint64_t>(leader->epoch) != link.epoch;
  // No leader key: the one we talk to lost it (an election is under way). etcd unreachable: no
  // news.
  return leader.status().code() == mooncake::Code::kNotFound;
}

void StoreClient::heartbeatLoop() {
  int64_t backoff_ms = 20;
  // A master that answers no heartbeat while its engine peer lives hangs (stopped, deadlocked,
  // overloaded): after this many in a row, or at once when etcd names another leader, the link
  // is given up and the master looked for again. A new leader needs this client's report.
  const int max_misses =
      static_cast<int>(std::max<int64_t>(1, params::getInt("MC_STORE_HEARTBEAT_MISSES")));
  int misses = 0;  // heartbeats in a row the current link's master did not answer
  std::unique_lock<std::mutex> lk(link_mu_);
  while (!closed_) {
    const bool need = !link_ || link_->broken;
    if (need && !(link_ && link_->rpc->isLocal())) {
      lk.unlock();
      std::string why;
      ErrorCode ec = reconnect(&why);
      membershipTick();
      lk.lock();
      if (ec == ErrorCode::OK) {
        backoff_ms = 20;
        misses = 0;
        MC_LOG(INFO, STORE) << "store client " << client_id_ << ": registered with the master"
                            << " (epoch " << (link_ ? link_->epoch : 0) << ")";
      } else {
        MC_LOG(DEBUG, STORE) << "store client " << client_id_ << ": no master yet: " << why;
        link_cv_.wait_for(lk, milliseconds(backoff_ms), [&] { return closed_.load(); });
        backoff_ms = std::min<int64_t>(backoff_ms * 2, 200);
      }
      continue;
    }
    auto period = milliseconds(std::max<uint64_t>(50, client_ttl_ms_ / 4));
    if (etcd_)
      period = std::min(period,
                        milliseconds(std::max<int64_t>(100, options_.etcd_lease_ttl_s * 1000 / 3)));
    // After a miss, ask again soon and wait less: a hung master is left within a few periods.
    int64_t hb_ms = std::min<int64_t>(options_.rpc_timeout_ms, 2000);
    if (misses > 0) hb_ms = std::min<int64_t>(hb_ms, std::max<int64_t>(250, period.count() / 2));
    link_cv_.wait_for(lk, misses > 0 ? std::min(period, milliseconds(200)) : period, [&] {
      return closed_.load() || (reconnect_wanted_ && link_ && link_->broken);
    });
    if (closed_) break;
    std::shared_ptr<Link> link = link_;
    if (!link || link->broken) continue;
    lk.unlock();
    membershipTick();
    proto::HeartbeatRequest req;
    req.set_client_id(client_id_);
    if (segment_ != nullptr) req.add_segment_names(segment_name_);
    proto::HeartbeatResponse resp;
    MasterRpcClient::CallInfo info;
    const int64_t sent = Clock::now().time_since_epoch().count();
    ErrorCode ec =
        link->rpc->call(proto::HEARTBEAT, req, &resp, engine::deadlineInMs(hb_ms), &info);
    const bool unanswered = ec == ErrorCode::RPC_FAIL && !info.master_dead;
    misses = unanswered ? misses + 1 : 0;
    if (ec == ErrorCode::OK && info.epoch == link->epoch && !resp.need_remount()) heard_ = sent;
    if (ec == ErrorCode::OK && (resp.need_remount() || info.epoch != link->epoch)) {
      std::lock_guard<std::mutex> reg(register_mu_);
      if (registerWith(*link, resp.need_remount(), info.epoch) != ErrorCode::OK)
        markBroken(link);
      else
        heard_ = sent;
    } else if (ec == ErrorCode::UNAVAILABLE_IN_CURRENT_MODE ||
               (ec == ErrorCode::RPC_FAIL && info.master_dead)) {
      markBroken(link);
    } else if (ec == ErrorCode::OK) {
      flushRetired(link);
    } else if (unanswered && (misses >= max_misses || leaderMoved(*link))) {
      MC_LOG(WARN, STORE) << "store client " << client_id_ << ": the master (epoch "
                          << link->epoch << ") answered none of " << misses
                          << " heartbeats in a row"
                          << (misses < max_misses ? " and etcd names another leader" : "")
                          << "; looking for the master again";
      markBroken(link);
    }
    lk.lock();
  }
}

}  // namespace mooncake::store
