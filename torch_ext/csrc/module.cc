// The extension module mooncake._C. Each service registers its Python API from its own
// register*Apis(m) function; this file holds the process-group one. Import torch (and
// torch.distributed) before this module: the base classes it derives from are torch's.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "engine/secret.h"
#include "torch_ext/csrc/process_group.h"

namespace py = pybind11;

namespace mooncake::torch_ext {
void registerStoreApis(py::module_& m);  // store_binding.cc
void registerEpApis(py::module_& m);     // ep_binding.cc
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
                       std::string secret, std::string reach_host) {
             MooncakeOptions o;
             o.group_name = std::move(group_name);
             o.timeout = timeout;
             o.global_ranks = std::move(global_ranks);
             o.buffer_bytes = buffer_bytes;
             o.secret = std::move(secret);
             o.reach_host = std::move(reach_host);
             return c10::make_intrusive<ProcessGroupMooncake>(store, rank, size, std::move(o));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name") = "default", py::arg("global_ranks") = std::vector<int64_t>{},
           py::arg("buffer_bytes") = 0, py::arg("secret") = "", py::arg("reach_host") = "",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "group_name",
          [](ProcessGroupMooncake& self) { return self.mooncakeOptions().group_name; })
      .def_property_readonly(
          "timeout", [](ProcessGroupMooncake& self) { return self.mooncakeOptions().timeout; })
      .def(
          "dead_ranks", [](ProcessGroupMooncake& self) { return self.communicator().deadRanks(); },
          "Group ranks the communicator has seen die.", py::call_guard<py::gil_scoped_release>());

  m.def(
      "job_secret_configured",
      [] {
        auto s = engine::resolveSecret("", engine::SecretFile::kIfSet);
        if (!s.ok()) throw std::runtime_error("mooncake: job secret: " + s.status().toString());
        return !s.value().empty();
      },
      "True when MC_SECRET or MC_SECRET_FILE gives this process its job secret (then every "
      "engine uses it, and torch groups do not generate one).");
  m.attr("TORCH_HAS_BACKEND_API") = py::bool_(MC_TORCH_HAS_BACKEND != 0);
  m.attr("BACKEND_BASE") = py::str(kBackendBasePyName);
  m.attr("DEVICES") = py::cast(ProcessGroupMooncake::devices());
}

}  // namespace
}  // namespace mooncake::torch_ext

PYBIND11_MODULE(_C, m) {
  m.doc() = "mooncake native extension (process group; ep and store register here too)";
  mooncake::torch_ext::registerPgApis(m);
  mooncake::torch_ext::registerStoreApis(m);
  mooncake::torch_ext::registerEpApis(m);
}
