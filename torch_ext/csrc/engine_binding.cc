// Python API of the transfer engine for upstream Mooncake's `mooncake.engine.TransferEngine`
// (torch_ext/python/mooncake/engine.py): mooncake._C.P2pEngine over engine::P2pSessions, and
// mooncake._C.InnerTransferEngine, the opaque engine handle that get_engine() returns and the
// store's setup() and pg.set_transfer_engine() accept. Conversions only: argument lists to
// requests, engine Status to upstream's integer codes (with the message, which the Python side
// logs), the GIL released around every call that waits.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/device/device.h"
#include "engine/engine.h"
#include "engine/p2p_sessions.h"
#include "engine/params.h"
#include "engine/secret.h"
#include "torch_ext/csrc/engine_handle.h"

namespace py = pybind11;

namespace mooncake::torch_ext {
namespace {

using engine::OpCode;
using engine::P2pSessions;

// Upstream's transfer-engine error codes (mooncake-transfer-engine/include/error.h).
constexpr int kErrInvalidArgument = -1;
constexpr int kErrAddressNotRegistered = -3;
constexpr int kErrAddressOverlapped = -7;

int upstreamCode(const Status& st) {
  switch (st.code()) {
    case Code::kOk:
      return 0;
    case Code::kAlreadyExists:
      return kErrAddressOverlapped;
    case Code::kNotFound:
      return kErrAddressNotRegistered;
    default:
      return kErrInvalidArgument;
  }
}

using Ret = std::pair<int64_t, std::string>;  // (upstream code or value, why it failed)
Ret ok(int64_t v = 0) { return {v, std::string()}; }
Ret fail(int64_t code, const Status& st) { return {code, st.toString()}; }

class PyP2pEngine {
 public:
  // host: the address the engine's tcp listener binds and that starts its name ("host:port").
  PyP2pEngine(const std::string& host) {
    // The job secret as every component reads it; a P/D deployment gives all its engines the
    // same MC_SECRET or secret file (docs/compat.md). The per-user default file is created when
    // missing, as mooncake_master does, so two engines of one user on one host agree.
    auto secret = engine::resolveSecret("", engine::SecretFile::kDefaultCreate);
    if (!secret.ok()) throw std::runtime_error("job secret: " + secret.status().toString());
    engine::EngineOptions o;
    o.name = host;
    o.host = host;
    o.secret = *secret;
    o.name_with_port = true;
    if (params::getBool("MC_FORCE_TCP")) o.transport = "tcp";
    auto e = engine::TransferEngine::create(o);
    if (!e.ok()) throw std::runtime_error(e.status().toString());
    engine_ = std::shared_ptr<engine::TransferEngine>(std::move(e).value());
    sessions_ = std::make_unique<P2pSessions>(engine_.get());
  }
  ~PyP2pEngine() {
    py::gil_scoped_release nogil;
    sessions_.reset();
    engine_.reset();
  }

  std::string name() const { return engine_->name(); }
  int rpcPort() const { return engine_->localSegment().tcp_port; }
  std::string transport() const { return params::getBool("MC_FORCE_TCP") ? "tcp" : "auto"; }

  uint64_t allocate(uint64_t len) {
    auto p = engine_->allocate(len);
    return p.ok() ? reinterpret_cast<uint64_t>(*p) : 0;
  }
  Ret free(uint64_t addr) {
    Status st = engine_->free(reinterpret_cast<void*>(addr));
    return st.ok() ? ok() : fail(upstreamCode(st), st);
  }
  // location as upstream's: "*" finds out where the memory lives (a KV cache in GPU memory
  // registers as such), "cpu[:N]" host memory, "cuda[:N]" memory of GPU N.
  Ret registerMemory(uint64_t addr, uint64_t len, const std::string& location) {
    Status st = registerAt(addr, len, location);
    return st.ok() ? ok() : fail(upstreamCode(st), st);
  }
  Ret unregisterMemory(uint64_t addr) {
    Status st = engine_->unregisterMemory(reinterpret_cast<void*>(addr));
    return st.ok() ? ok() : fail(upstreamCode(st), st);
  }
  // All or nothing, as upstream: a failure unregisters the ones this call registered.
  Ret batchRegister(const std::vector<uint64_t>& addrs, const std::vector<uint64_t>& lens,
                    const std::string& location) {
    if (addrs.size() != lens.size())
      return fail(kErrInvalidArgument, Status(Code::kInvalidArgument, "list lengths differ"));
    for (size_t i = 0; i < addrs.size(); ++i) {
      Status st = registerAt(addrs[i], lens[i], location);
      if (!st.ok()) {
        for (size_t j = 0; j < i; ++j) (void)engine_->unregisterMemory(reinterpret_cast<void*>(addrs[j]));
        return fail(upstreamCode(st), Status(st.code(), "entry " + std::to_string(i) + ": " + st.message()));
      }
    }
    return ok();
  }
  Ret batchUnregister(const std::vector<uint64_t>& addrs) {
    Ret out = ok();
    for (uint64_t a : addrs) {
      Status st = engine_->unregisterMemory(reinterpret_cast<void*>(a));
      if (!st.ok() && out.first == 0) out = fail(upstreamCode(st), st);
    }
    return out;
  }
  bool isRegistered(uint64_t addr, uint64_t len) const {
    return engine_->isRegistered(reinterpret_cast<const void*>(addr), len);
  }

  Status registerAt(uint64_t addr, uint64_t len, const std::string& location) {
    void* p = reinterpret_cast<void*>(addr);
    const std::string kind = location.substr(0, location.find(':'));
    int ordinal = -1;
    if (kind.size() < location.size()) {
      const std::string n = location.substr(kind.size() + 1);
      if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
        return MC_STATUS(kInvalidArgument, "register_memory: bad location '" << location << "'");
      ordinal = std::stoi(n);
    }
    if (kind == "*" && ordinal < 0) {
      const engine::device::PointerInfo where = engine::device::locate(p);
      if (where.device) return engine_->registerMemory(p, len, engine::MemoryKind::kCuda, where.ordinal);
      return engine_->registerMemory(p, len);
    }
    if (kind == "cpu") {
      if (engine::device::locate(p).device)
        return MC_STATUS(kInvalidArgument, "register_memory: " << p << " is GPU memory, not "
                                                               << location);
      return engine_->registerMemory(p, len);
    }
    if (kind == "cuda") return engine_->registerMemory(p, len, engine::MemoryKind::kCuda, ordinal);
    return MC_STATUS(kInvalidArgument, "register_memory: location '" << location
                                           << "' is none of * (no device number), cpu[:N], "
                                              "cuda[:N]");
  }

  static Result<std::vector<P2pSessions::Request>> requests(int op,
                                                           const std::vector<uint64_t>& locals,
                                                           const std::vector<uint64_t>& remotes,
                                                           const std::vector<uint64_t>& lens) {
    if (op != 0 && op != 1) return MC_STATUS(kInvalidArgument, "opcode " << op);
    if (locals.size() != remotes.size() || locals.size() != lens.size())
      return MC_STATUS(kInvalidArgument, "buffers (" << locals.size() << "), peer addresses ("
                                                     << remotes.size() << ") and lengths ("
                                                     << lens.size() << ") differ in length");
    std::vector<P2pSessions::Request> out(locals.size());
    for (size_t i = 0; i < locals.size(); ++i)
      out[i] = {op == 0 ? OpCode::kRead : OpCode::kWrite, locals[i], remotes[i], lens[i]};
    return out;
  }

  // Sync: 0 / -1.
  Ret transfer(const std::string& session, int op, const std::vector<uint64_t>& locals,
               const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens) {
    auto reqs = requests(op, locals, remotes, lens);
    if (!reqs.ok()) return fail(-1, reqs.status());
    Status st = sessions_->transfer(session, *reqs);
    return st.ok() ? ok() : fail(-1, st);
  }
  // Async: the batch id, 0 on failure (upstream's batch ids are unsigned, 0 is never one).
  Ret submit(const std::string& session, int op, const std::vector<uint64_t>& locals,
             const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens) {
    auto reqs = requests(op, locals, remotes, lens);
    if (!reqs.ok()) return fail(0, reqs.status());
    auto id = sessions_->submit(session, *reqs);
    return id.ok() ? ok(static_cast<int64_t>(*id)) : fail(0, id.status());
  }
  // Waits for every batch (each until its own deadline): 0 when all completed, else -1.
  Ret waitAll(const std::vector<uint64_t>& ids) {
    Ret out = ok();
    for (uint64_t id : ids) {
      Status st = sessions_->wait(id);
      if (!st.ok() && out.first == 0) out = fail(-1, st);
    }
    return out;
  }
  // 1 completed, 0 in progress, -1 failed, -2 timed out (upstream's transfer_check_status).
  Ret check(uint64_t id) {
    Status why;
    switch (sessions_->check(id, &why)) {
      case P2pSessions::State::kCompleted:
        return ok(1);
      case P2pSessions::State::kPending:
        return ok(0);
      case P2pSessions::State::kTimedOut:
        return fail(-2, why);
      default:
        return fail(-1, why);
    }
  }
  Ret notify(const std::string& session, const std::string& name, const std::string& msg) {
    Status st = sessions_->notify(session, name, msg);
    return st.ok() ? ok() : fail(-1, st);
  }
  std::vector<std::pair<py::bytes, py::bytes>> drain() {
    std::vector<P2pSessions::Notify> got;
    {
      py::gil_scoped_release nogil;
      got = sessions_->drainNotifies();
    }
    std::vector<std::pair<py::bytes, py::bytes>> out;
    for (auto& n : got) out.emplace_back(py::bytes(n.name), py::bytes(n.msg));
    return out;
  }
  Ret probe(const std::string& session) {
    Status st = sessions_->probe(session);
    if (st.ok()) return ok();
    // Upstream: ERR_METADATA (-200) when the name cannot be resolved, else a handshake error.
    return fail(st.code() == Code::kInvalidArgument ? -200 : -1, st);
  }
  Ret firstBufferAddress(const std::string& session) {
    auto a = sessions_->firstBufferAddress(session);
    return a.ok() ? ok(static_cast<int64_t>(*a)) : fail(0, a.status());
  }
  // Raw copies into / out of this engine's registered memory (upstream copies without a check;
  // a range outside registered memory is refused here instead of crashing the process).
  Ret writeBytes(uint64_t dest, const std::string& data, uint64_t len) {
    if (len > data.size())
      return fail(-1, Status(Code::kInvalidArgument, "length exceeds the bytes given"));
    if (len > 0 && !isRegistered(dest, len))
      return fail(-1, Status(Code::kInvalidArgument, "destination is not registered memory"));
    std::memcpy(reinterpret_cast<void*>(dest), data.data(), len);
    return ok();
  }
  py::object readBytes(uint64_t src, uint64_t len) {
    if (len > 0 && !isRegistered(src, len))
      throw std::invalid_argument("read_bytes_from_buffer: [" + std::to_string(src) + ", +" +
                                  std::to_string(len) + ") is not registered memory");
    return py::bytes(reinterpret_cast<const char*>(src), len);
  }

  EngineHandle handle() const { return EngineHandle{engine_}; }
  uint64_t enginePtr() const { return reinterpret_cast<uint64_t>(engine_.get()); }

 private:
  std::shared_ptr<engine::TransferEngine> engine_;
  std::unique_ptr<P2pSessions> sessions_;
};

}  // namespace

void registerEngineApis(py::module_& m) {
  py::class_<EngineHandle>(m, "InnerTransferEngine",
                           "An opaque handle on a transfer engine (TransferEngine.get_engine()): "
                           "pass it to MooncakeDistributedStore.setup() or "
                           "pg.set_transfer_engine() to share the engine.")
      .def_property_readonly("name", [](const EngineHandle& h) { return h.engine->name(); })
      .def("__repr__", [](const EngineHandle& h) {
        return "<InnerTransferEngine " + h.engine->name() + ">";
      });

  using Nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<PyP2pEngine>(m, "P2pEngine", "Native engine of mooncake.engine.TransferEngine.")
      .def(py::init<const std::string&>(), py::arg("host"), Nogil())
      .def_property_readonly("name", &PyP2pEngine::name)
      .def_property_readonly("rpc_port", &PyP2pEngine::rpcPort)
      .def_property_readonly("transport", &PyP2pEngine::transport)
      .def("allocate", &PyP2pEngine::allocate, Nogil())
      .def("free", &PyP2pEngine::free, Nogil())
      .def("register_memory", &PyP2pEngine::registerMemory, py::arg("addr"), py::arg("len"),
           py::arg("location") = "*", Nogil())
      .def("unregister_memory", &PyP2pEngine::unregisterMemory, Nogil())
      .def("batch_register", &PyP2pEngine::batchRegister, py::arg("addrs"), py::arg("lens"),
           py::arg("location") = "*", Nogil())
      .def("batch_unregister", &PyP2pEngine::batchUnregister, Nogil())
      .def("is_registered", &PyP2pEngine::isRegistered)
      .def("transfer", &PyP2pEngine::transfer, Nogil())
      .def("submit", &PyP2pEngine::submit, Nogil())
      .def("wait_all", &PyP2pEngine::waitAll, Nogil())
      .def("check", &PyP2pEngine::check, Nogil())
      .def("notify", &PyP2pEngine::notify, Nogil())
      .def("drain_notifies", &PyP2pEngine::drain)
      .def("probe", &PyP2pEngine::probe, Nogil())
      .def("first_buffer_address", &PyP2pEngine::firstBufferAddress, Nogil())
      .def("write_bytes", &PyP2pEngine::writeBytes)
      .def("read_bytes", &PyP2pEngine::readBytes)
      .def("handle", &PyP2pEngine::handle)
      .def("engine_ptr", &PyP2pEngine::enginePtr);

  m.def(
      "set_process_engine",
      [](py::object h) {
        if (h.is_none()) return setSharedEngineOverride(nullptr);
        setSharedEngineOverride(h.cast<EngineHandle>().engine);
      },
      py::arg("engine"),
      "The engine every mooncake process group of this process created from now on uses "
      "(None: they create their own again).");
  m.def("set_engine_host", &setSharedEngineHost, py::arg("host"),
        "The address the engine that the next mooncake process group creates binds.");

  // The engine's device layer (engine/device/device.h) as the tests over its host simulation
  // (MC_DEVICE=sim) use it: GPU memory that host code must not touch, made and read without
  // torch (whose build here has no CUDA). With a CUDA torch, use CUDA tensors instead.
  auto layer = [] {
    auto d = engine::device::get();
    if (!d.ok()) throw std::runtime_error("mooncake: no device layer: " + d.status().toString());
    return *d;
  };
  m.def(
      "_device_layer", [layer] { return std::string(layer()->name()); },
      "The device layer's name (cuda, sim); raises when there is none.");
  m.def(
      "_device_alloc",
      [layer](uint64_t nbytes, int ordinal) {
        auto p = layer()->allocate(nbytes, ordinal);
        if (!p.ok()) throw std::runtime_error("mooncake: " + p.status().toString());
        return reinterpret_cast<uint64_t>(*p);
      },
      py::arg("nbytes"), py::arg("device") = 0, "GPU memory of the device layer (its address).");
  m.def(
      "_device_free",
      [layer](uint64_t ptr) {
        Status st = layer()->free(reinterpret_cast<void*>(ptr));
        if (!st.ok()) throw std::runtime_error("mooncake: " + st.toString());
      },
      py::arg("ptr"));
  m.def(
      "_device_copy",
      [](uint64_t dst, uint64_t src, uint64_t nbytes) {
        Status st = engine::device::copy(reinterpret_cast<void*>(dst),
                                         reinterpret_cast<const void*>(src), nbytes,
                                         engine::deadlineInMs(60000));
        if (!st.ok()) throw std::runtime_error("mooncake: " + st.toString());
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), Nogil(),
      "Copies between GPU and host memory (either side) with the device layer, and waits.");
  // CUDA-graph capture over the simulation (Device::beginCapture): on the copy stream of
  // `device`, which is where the simulation's callers' streams are (what mooncake.ep's
  // stream-ordered calls order themselves after). Tests only; on CUDA, torch.cuda.graph.
  py::class_<engine::device::Graph, std::shared_ptr<engine::device::Graph>>(
      m, "_DeviceGraph", "Work captured from the device layer's streams (tests).");
  m.def(
      "_device_capture_begin",
      [layer](int ordinal) {
        Status st = layer()->beginCapture(ordinal, engine::device::kCopyStream);
        if (!st.ok()) throw std::runtime_error("mooncake: " + st.toString());
      },
      py::arg("device") = 0);
  m.def(
      "_device_capture_end",
      [layer](int ordinal) {
        auto g = layer()->endCapture(ordinal, engine::device::kCopyStream);
        if (!g.ok()) throw std::runtime_error("mooncake: " + g.status().toString());
        return *g;
      },
      py::arg("device") = 0, "The captured graph; raises when the capture was invalidated.");
  m.def(
      "_device_graph_launch",
      [layer](const std::shared_ptr<engine::device::Graph>& g, int ordinal) {
        Status st = layer()->launchGraph(*g, ordinal, engine::device::kCopyStream);
        if (!st.ok()) throw std::runtime_error("mooncake: " + st.toString());
      },
      py::arg("graph"), py::arg("device") = 0, Nogil(),
      "Queues the graph's work on the copy stream (a later _device_copy waits for it).");
  m.def(
      "_device_pageable_copies", [layer] { return layer()->pageableCopies(); },
      "Copies so far between GPU memory and host memory that was not pinned (counted by the "
      "simulation only; 0 from CUDA).");
  m.def(
      "_device_pageable_bytes", [layer] { return layer()->pageableBytes(); },
      "The bytes those copies moved (the simulation only; 0 from CUDA).");
}

}  // namespace mooncake::torch_ext
