// The extension module mooncake._C. Each service registers its Python API from its own
// register*Apis(m) function; this file holds the process-group one. Import torch (and
// torch.distributed) before this module: the base classes it derives from are torch's.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <optional>
#include <torch/csrc/utils/pybind.h>

#include "engine/secret.h"
#include "pg/profile.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/process_group.h"

namespace py = pybind11;

namespace mooncake::torch_ext {
void registerStoreApis(py::module_& m);  // store_binding.cc
void registerEpApis(py::module_& m);     // ep_binding.cc
void registerEngineApis(py::module_& m);  // engine_binding.cc
void registerElasticApis(py::module_& m);  // elastic_binding.cc
namespace {

void registerPgApis(py::module_& m) {
  // torch binds its base class with an intrusive_ptr holder; we derive from that binding.
  py::module_::import("torch.distributed");
  py::class_<ProcessGroupMooncake, BackendBase, c10::intrusive_ptr<ProcessGroupMooncake>>(
      m, "ProcessGroupMooncake",
      "The mooncake c10d backend. Created by torch.distributed through the creator that "
      "`import mooncake` registers; not meant to be constructed by hand.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group_name,
                       std::vector<int64_t> global_ranks, size_t buffer_bytes,
                       std::string secret, std::string reach_host, bool elastic,
                       int max_group_size, bool is_extension, bool auto_deactivate,
                       bool auto_sync, std::optional<at::Tensor> active_ranks) {
             MooncakeOptions o;
             o.group_name = std::move(group_name);
             o.timeout = timeout;
             o.global_ranks = std::move(global_ranks);
             o.buffer_bytes = buffer_bytes;
             o.secret = std::move(secret);
             o.reach_host = std::move(reach_host);
             o.elastic.enabled = elastic;
             o.elastic.max_group_size = max_group_size;
             o.elastic.is_extension = is_extension;
             o.elastic.auto_deactivate_on_failure = auto_deactivate;
             o.elastic.auto_sync_on_failure = auto_sync;
             if (active_ranks) o.active_ranks = *active_ranks;
             return c10::make_intrusive<ProcessGroupMooncake>(store, rank, size, std::move(o));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name") = "default", py::arg("global_ranks") = std::vector<int64_t>{},
           py::arg("buffer_bytes") = 0, py::arg("secret") = "", py::arg("reach_host") = "",
           py::arg("elastic") = false, py::arg("max_group_size") = 0,
           py::arg("is_extension") = false, py::arg("auto_deactivate_on_failure") = true,
           py::arg("auto_sync_on_failure") = true, py::arg("active_ranks") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "group_name",
          [](ProcessGroupMooncake& self) { return self.mooncakeOptions().group_name; })
      .def_property_readonly(
          "timeout", [](ProcessGroupMooncake& self) { return self.mooncakeOptions().timeout; })
      .def(
          "dead_ranks", [](ProcessGroupMooncake& self) { return self.communicator().deadRanks(); },
          "Group ranks the communicator has seen die.", py::call_guard<py::gil_scoped_release>())
      .def(
          "_stream_ops", [](ProcessGroupMooncake& self) { return self.communicator().streamOps(); },
          "Stream-ordered ops this rank issued (pg/stream_ops.h; tests).");

  m.def(
      "job_secret_configured",
      [] {
        auto s = engine::resolveSecret("", engine::SecretFile::kIfSet);
        if (!s.ok()) throw std::runtime_error("mooncake: job secret: " + s.status().toString());
        return !s.value().empty();
      },
      "True when MC_SECRET or MC_SECRET_FILE gives this process its job secret (then every "
      "engine uses it, and torch groups do not generate one).");
  // torch before pytorch PR 154976 (mid-2025; 2.6 among them) destroys a ProcessGroup from
  // Python with the GIL held, and gloo's destructor waits for its worker threads, one of which
  // may need the GIL to free the tensors of the last op it ran: a deadlock, seen at the exit
  // of a torch 2.6 job that used a gloo group. This takes the group out of `box` (a list that
  // holds it) and, when that was its last reference, destroys it with the GIL released.
  m.def(
      "_release_group",
      [](py::list box) {
        if (box.size() != 1) throw std::invalid_argument("_release_group expects [group]");
        auto pg = box[0].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        box.attr("clear")();  // the Python object goes (if it was the last); the group stays
        py::gil_scoped_release nogil;
        pg.reset();
      },
      py::arg("box"));
  m.attr("TORCH_HAS_BACKEND_API") = py::bool_(MC_TORCH_HAS_BACKEND != 0);
  m.attr("BACKEND_BASE") = py::str(kBackendBasePyName);
  m.attr("DEVICES") = py::cast(ProcessGroupMooncake::devices());

  // For tests and benchmarks over the device layer's host simulation (MC_DEVICE=sim), whose
  // torch has no CUDA: a CPU tensor whose storage is GPU memory of the engine's layer (freed
  // with the tensor). Host code must not read or write it (over the simulation it faults):
  // fill and read it with _device_copy; the process group takes it like a CUDA tensor's memory.
  m.def("_device_empty_like", &deviceEmptyLike, py::arg("like"), py::arg("device") = 0,
      "A tensor of like's shape and dtype in GPU memory of the engine's device layer (tests).");

  // The process group's time by phase (pg/profile.h), process-wide: for benchmarks
  // (benchmarks/pg_bench.py --profile) and tests.
  m.def(
      "_pg_profile",
      [](std::optional<bool> enable, bool reset) {
        if (enable) pg::profile::setEnabled(*enable);
        const pg::profile::Totals t = pg::profile::take(reset);
        py::dict d;
        for (int p = 0; p < pg::profile::kPhases; ++p)
          d[py::str(pg::profile::name(static_cast<pg::profile::Phase>(p)))] =
              py::make_tuple(t.count[p], t.ns[p]);
        return d;
      },
      py::arg("enable") = py::none(), py::arg("reset") = false,
      "Turns the process group's phase timers on or off (None: as they are) and returns "
      "{phase: (count, ns)} so far (zeroed when reset): 'op' (every op), 'flag wait', "
      "'device wait', 'device queue' (inside ops; pg/profile.h).");
}

}  // namespace
}  // namespace mooncake::torch_ext

PYBIND11_MODULE(_C, m) {
  m.doc() = "mooncake native extension (process group; ep and store register here too)";
  mooncake::torch_ext::registerPgApis(m);
  mooncake::torch_ext::registerStoreApis(m);
  mooncake::torch_ext::registerEpApis(m);
  mooncake::torch_ext::registerEngineApis(m);
  mooncake::torch_ext::registerElasticApis(m);
}
