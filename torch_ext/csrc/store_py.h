// PyStore: the native object behind mooncake.store.MooncakeDistributedStore (mooncake._C.
// StoreClient), shared by store_binding.cc (Mooncake's original calls) and store_binding_ext.cc
// (the rest of upstream's API). It owns (or borrows) the engine, the rendezvous to the master,
// the StoreClient and the client's local buffer; conversions only.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/rendezvous.h"
#include "engine/secret.h"
#include "store/client/local_buffer.h"
#include "store/client/rpc.h"
#include "store/client/store_client.h"
#include "torch_ext/csrc/process_group.h"

namespace mooncake::torch_ext {

namespace py = pybind11;

using store::ErrorCode;
using store::ReplicateConfig;
constexpr int64_t kNotSetUp = static_cast<int64_t>(ErrorCode::INVALID_PARAMS);

inline int64_t code(ErrorCode ec) { return static_cast<int64_t>(ec); }

// Tensor objects: a small header (magic, dtype, ndim, shape) followed by the contiguous bytes.
constexpr uint32_t kTensorMagic = 0x3154434d;  // "MCT1"

class PyStore {
 public:
  // Python's garbage collector runs this with the GIL held; close() may wait for late writes
  // (up to transfer_timeout_ms, docs/store.md): the other threads run meanwhile. Not while the
  // interpreter finalizes: daemon threads woken then are ended by force, which unwinds them
  // through noexcept destructors (std::terminate).
  ~PyStore() {
    if (PyGILState_Check() && !finalizing()) {
      py::gil_scoped_release nogil;
      close();
    } else {
      close(!PyGILState_Check());  // (finalizing with the GIL: no wait, as before)
    }
  }

  // Upstream's setup(): a client of the standalone master at master_server_address.
  // engine: an engine to share (TransferEngine.get_engine()): its name is this client's segment
  // name (upstream requires local_hostname to be it); nullptr: the client creates its own,
  // named "<local_hostname>:<its tcp port>" (local_hostname verbatim when it has a port).
  // local_buffer_size bytes of registered memory are the client's local buffer (get_buffer,
  // BufferPool); 0: none, and the calls that need one fail as upstream's do.
  int setup(const std::string& local_hostname, uint64_t global_segment_size,
            uint64_t local_buffer_size, const std::string& protocol,
            const std::string& master_server_address,
            std::shared_ptr<engine::TransferEngine> shared) {
    if (refused()) return refusedSetup();
    std::lock_guard<std::mutex> setup_lock(setup_mu_);  // (a second setup then sees client_)
    if (client_) return 0;
    last_error_.clear();
    // "tcp"/"rdma" name Mooncake's transports; the engine picks per peer (shm on one host),
    // and MC_TRANSPORT can force one. Anything else is a caller error.
    if (!protocol.empty() && protocol != "tcp" && protocol != "rdma") {
      last_error_ = "protocol '" + protocol + "' is not supported (tcp, rdma)";
      return code(ErrorCode::INVALID_PARAMS);
    }
    if (local_hostname.empty() && !shared) {
      last_error_ = "empty local_hostname";
      return code(ErrorCode::INVALID_PARAMS);
    }
    // "host:port" of a master, or "etcd://host:port[;host:port]" (the leader of the cluster
    // MC_STORE_CLUSTER_ID, followed across failovers).
    std::string host;
    if (int rc = reachHost(master_server_address, &host); rc != 0) {
      last_error_ = "master_server_addr '" + master_server_address +
                    "' is neither host:port nor etcd://host:port";
      return rc;
    }
    auto secret = clientSecret();
    if (!secret.ok()) {
      last_error_ = secret.status().toString();
      return code(ErrorCode::INVALID_PARAMS);
    }
    if (shared) {
      engine_ = std::move(shared);
    } else {
      engine::EngineOptions eo;
      bool has_port = local_hostname.find(':') != std::string::npos &&
                      (local_hostname.front() != '[' || local_hostname.find("]:") != std::string::npos);
      eo.name = local_hostname;
      eo.name_with_port = !has_port;  // upstream: "host" gets the port the client bound
      eo.secret = *secret;
      eo.reach_host = host;  // listen on the interface that reaches the master (or etcd)
      auto eng = engine::TransferEngine::create(eo);
      if (!eng.ok()) {
        last_error_ = eng.status().toString();
        return code(ErrorCode::INTERNAL_ERROR);
      }
      engine_ = std::shared_ptr<engine::TransferEngine>(std::move(eng).value());
    }
    if (local_buffer_size > 0) {
      auto lb = store::LocalBuffer::create(engine_, local_buffer_size);
      if (!lb.ok()) {
        last_error_ = "cannot allocate a local buffer of " + std::to_string(local_buffer_size) +
                      " bytes";
        return code(lb.error());
      }
      local_ = std::move(lb).value();
    }
    int rc = connectClient(engine_.get(), master_server_address, *secret, global_segment_size);
    if (rc != 0) {
      local_.reset();
      engine_.reset();
    }
    publish();
    return rc;
  }

  // A store over a process group's engine and rendezvous; master embedded on rank 0.
  // A store over a process group's engine. master_address empty: the group's rendezvous, the
  // master embedded on rank 0; else a standalone master's host:port (its rendezvous).
  int setupFromGroup(py::object group, uint64_t segment_size, const std::string& master_address) {
    if (refused()) return refusedSetup();
    ProcessGroupMooncake* pg = group.cast<ProcessGroupMooncake*>();
    pg::Communicator& comm = pg->communicator();
    engine::TransferEngine* eng = &comm.engine();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> setup_lock(setup_mu_);
    // Set up already: as setup(), 0 (replacing the client would pull it from under the calls).
    if (client_) return 0;
    {
      py::gil_scoped_acquire gil;
      group_ = group;
    }
    struct Publish {
      PyStore* s;
      ~Publish() { s->publish(); }
    } publish_at_end{this};
    if (!master_address.empty()) {
      // A standalone master checks its own secret: the group's engine must present the same
      // one (MC_SECRET or MC_SECRET_FILE set for the whole job; docs/security.md).
      auto secret = clientSecret();
      if (!secret.ok()) {
        last_error_ = secret.status().toString();
        return code(ErrorCode::INVALID_PARAMS);
      }
      std::string host;
      if (int rc = reachHost(master_address, &host); rc != 0) return rc;
      return connectClient(eng, master_address, *secret, segment_size);
    }
    rdv_ = comm.rendezvous();
    if (comm.rank() == 0) {
      master_ = std::make_unique<store::MasterService>();
      master_->startBackground(std::chrono::milliseconds(500));
      server_ = std::make_unique<store::MasterRpcServer>(eng, master_.get());
      if (!server_->publish(*rdv_).ok()) return code(ErrorCode::RPC_FAIL);
    }
    return makeClient(eng, master_.get(), segment_size);
  }

  // Waits for the calls on this store that other threads are in (they hold no lock: a call
  // takes as long as its deadline), refusing new ones meanwhile (they see a store that is not
  // set up), then tears down. From inside a call on this store (a callback): an error.
  // Two closers at once: the second waits for the first (then finds nothing to tear down).
  // wait_calls = false (the interpreter is finalizing, the GIL held): no wait, as before.
  void close(bool wait_calls = true) {
    if (admittedHere())
      throw std::runtime_error("mooncake.store: close() from inside a call on the same store");
    std::lock_guard<std::mutex> closer(close_mu_);
    {
      std::unique_lock<std::mutex> g(life_mu_);
      closing_ = true;
      if (wait_calls) life_cv_.wait(g, [&] { return inflight_ == 0; });
    }
    struct Reopen {  // (also when teardown throws: the store must not stay closed to setup)
      PyStore* s;
      ~Reopen() {
        std::lock_guard<std::mutex> g(s->life_mu_);
        s->closing_ = false;
      }
    } reopen{this};
    std::lock_guard<std::mutex> setup_lock(setup_mu_);
    teardown();
  }

  // One Python call on this store (CallScope, below): admitted unless close() is running. A
  // refused call sees no client for its whole length, even if a setup follows the close.
  bool enterCall() {
    auto& v = tlsCalls();
    v.push_back({this, false});
    std::lock_guard<std::mutex> g(life_mu_);
    if (closing_) return false;
    ++inflight_;
    v.back().admitted = true;
    return true;
  }
  void leaveCall(bool admitted) {
    auto& v = tlsCalls();
    for (auto it = v.rbegin(); it != v.rend(); ++it) {
      if (it->store == this) {
        v.erase(std::next(it).base());
        break;
      }
    }
    if (!admitted) return;
    std::lock_guard<std::mutex> g(life_mu_);
    if (--inflight_ == 0) life_cv_.notify_all();
  }

  std::string lastError() {
    std::lock_guard<std::mutex> g(setup_mu_);
    return last_error_;
  }

 private:
  struct Call {
    const PyStore* store;
    bool admitted;
  };
  static std::vector<Call>& tlsCalls() {
    thread_local std::vector<Call> calls;
    return calls;
  }
  // This thread is inside an admitted call on this store: close() waits for it, so the client
  // stays as it is until the call ends.
  bool admittedHere() const {
    for (const Call& c : tlsCalls())
      if (c.store == this && c.admitted) return true;
    return false;
  }
  // Outside an admitted call the store shows no client (every binding runs in a CallScope).
  bool refused() const { return !admittedHere(); }
  int refusedSetup() {
    std::lock_guard<std::mutex> g(setup_mu_);
    last_error_ = "close() is running on this store";
    return code(ErrorCode::INVALID_PARAMS);
  }
  // After a setup (under setup_mu_): what the calls may see.
  void publish() {
    local_ptr_.store(client_ ? local_.get() : nullptr);
    client_ptr_.store(client_.get());
  }

  void teardown() {
    client_ptr_.store(nullptr);
    local_ptr_.store(nullptr);
    dummy_service_.reset();
    client_.reset();
    server_.reset();
    if (master_) master_->stopBackground();
    master_.reset();
    local_.reset();  // leases still held by Python keep their memory until dropped
    engine_.reset();
    rdv_.reset();
    if (group_) {
      py::gil_scoped_acquire gil;
      group_ = py::object();
    }
  }

 public:
  static bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }

  // The client, for a call admitted by CallScope (stays valid to its end); null before setup,
  // after close, and in a call that started while close() ran.
  // (Through pointers that setup publishes once it is done and teardown clears first: a call
  // in another thread never reads the owners while setup writes them.)
  store::StoreClient* c() { return refused() ? nullptr : client_ptr_.load(); }
  store::LocalBuffer* local() { return refused() ? nullptr : local_ptr_.load(); }
  std::shared_ptr<store::LocalBuffer> localShared() {
    return local() != nullptr ? local_ : nullptr;
  }
  std::string hostname() { return c() ? c()->clientId() : std::string(); }

  // mooncake_client's service for dummy clients (store_dummy.cc); stopped by close().
  void keepDummyService(std::unique_ptr<engine::TcpRendezvousServer> s) {
    dummy_service_ = std::move(s);
  }
  bool servesDummies() const { return dummy_service_ != nullptr; }

  // The secret a store client presents: MC_SECRET, else the file (MC_SECRET_FILE or
  // ~/.mooncake/secret). A master started at the same moment may not have created the default
  // file yet: wait for it as long as for the master's port.
  static Result<std::string> clientSecret() {
    auto deadline = engine::deadlineInMs(10000);
    for (;;) {
      auto s = engine::resolveSecret("", engine::SecretFile::kDefault);
      if (s.ok() || s.status().code() != Code::kNotFound || engine::Clock::now() >= deadline)
        return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

 private:
  // The host the client must reach: the master's, or the first etcd endpoint's.
  static int reachHost(const std::string& address, std::string* host) {
    std::string a = address;
    const std::string etcd = "etcd://";
    if (a.rfind(etcd, 0) == 0) {
      a = a.substr(etcd.size());
      a = a.substr(0, a.find_first_of(",;"));
      if (a.rfind("http://", 0) == 0) a = a.substr(7);
      if (a.rfind("https://", 0) == 0) a = a.substr(8);
    }
    auto colon = a.rfind(':');
    if (colon == std::string::npos || colon == 0) return code(ErrorCode::INVALID_PARAMS);
    int port = std::atoi(a.c_str() + colon + 1);
    if (port <= 0 || port > 65535) return code(ErrorCode::INVALID_PARAMS);
    *host = a.substr(0, colon);
    return 0;
  }

  // A client of a standalone master (or of the leader named in etcd), followed across restarts
  // and failovers (StoreClient::connect).
  int connectClient(engine::TransferEngine* eng, const std::string& address,
                    const std::string& secret, uint64_t seg) {
    store::StoreClientOptions so;
    so.segment_size = seg;
    so.master_address = address;
    so.secret = secret;
    std::string why;
    auto c = store::StoreClient::connect(eng, so, &why);
    if (!c.ok()) {
      last_error_ = why;
      return code(c.error());
    }
    client_ = std::move(c).value();
    return 0;
  }

  int makeClient(engine::TransferEngine* eng, store::MasterService* local, uint64_t seg) {
    store::StoreClientOptions so;
    so.segment_size = seg;
    auto c = store::StoreClient::create(eng, rdv_.get(), local, so);
    if (!c.ok()) return code(c.error());
    client_ = std::move(c).value();
    return 0;
  }

  std::string last_error_;
  std::shared_ptr<engine::TransferEngine> engine_;  // owned or shared; empty for a group's
  std::shared_ptr<store::LocalBuffer> local_;
  std::shared_ptr<engine::Rendezvous> rdv_;
  std::unique_ptr<store::MasterService> master_;
  std::unique_ptr<store::MasterRpcServer> server_;
  std::unique_ptr<store::StoreClient> client_;
  std::unique_ptr<engine::TcpRendezvousServer> dummy_service_;
  py::object group_;
  std::atomic<store::StoreClient*> client_ptr_{nullptr};
  std::atomic<store::LocalBuffer*> local_ptr_{nullptr};
  std::mutex close_mu_;  // one close() at a time
  std::mutex setup_mu_;  // setup and teardown (and last_error_)
  std::mutex life_mu_;   // closing_, inflight_
  std::condition_variable life_cv_;
  bool closing_ = false;
  int inflight_ = 0;  // admitted calls
};

// Wraps a binding's body (a captureless lambda taking PyStore& first): the call is counted so
// that close() in another thread waits for it instead of destroying the client under it.
class CallScope {
 public:
  explicit CallScope(PyStore& s) : s_(s), in_(s.enterCall()) {}
  ~CallScope() { s_.leaveCall(in_); }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  PyStore& s_;
  bool in_;
};

template <typename R, typename... A>
auto guarded(R (*f)(PyStore&, A...)) {
  return [f](PyStore& s, A... a) -> R {
    CallScope scope(s);
    return f(s, std::forward<A>(a)...);
  };
}
template <typename F>
auto guarded(F f) {
  return guarded(+f);  // (a captureless lambda as a function pointer: its signature)
}

inline ReplicateConfig cfgOf(const py::object& o) {
  if (o.is_none()) return ReplicateConfig{};
  return o.cast<ReplicateConfig>();
}

inline std::string_view viewOf(const py::buffer& b, py::buffer_info* keep) {
  *keep = b.request();
  return std::string_view(static_cast<const char*>(keep->ptr),
                          static_cast<size_t>(keep->size * keep->itemsize));
}

template <typename T>
inline int64_t valueOr(const store::ErrorOr<T>& r) {
  return r.ok() ? static_cast<int64_t>(*r) : code(r.error());
}


// Registers the rest of upstream's MooncakeDistributedStore API on the class (store_binding_ext.cc).
void addStoreExtApis(py::module_& m, py::class_<PyStore>& cls);
// Upstream's standalone pairing: mooncake_client's service and setup_dummy's lookup of it
// (store_dummy.cc).
void addStoreDummyApis(py::module_& m, py::class_<PyStore>& cls);

}  // namespace mooncake::torch_ext
