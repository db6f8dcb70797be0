// mc_torch_check: the mooncake c10d backend alone, as a Python module, for
// tests/gpu/torch_check.py. scripts/gpu_check.sh builds it with the compiler alone against
// the torch of the machine it runs on (the GPU machine has torch 2.11 with CUDA but no
// protobuf, re2 or googletest, so the whole mooncake._C with its store cannot be built
// there). The backend is the same code as mooncake._C's (torch_ext/csrc/process_group.cc);
// this file only binds its constructor, without the Python package's group naming and secret
// exchange (the check gives every rank MC_SECRET), and expert parallelism's buffer
// (torch_ext/csrc/ep_binding.cc, mooncake._C.EpBuffer's binding: the check's EP step).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <torch/csrc/utils/pybind.h>

#include "engine/device/device.h"
#include "torch_ext/csrc/gpu_tensors.h"
#include "torch_ext/csrc/process_group.h"

namespace py = pybind11;

namespace mooncake::torch_ext {
void registerEpApis(py::module_& m);  // torch_ext/csrc/ep_binding.cc
}

using mooncake::torch_ext::BackendBase;
using mooncake::torch_ext::MooncakeOptions;
using mooncake::torch_ext::ProcessGroupMooncake;

PYBIND11_MODULE(mc_torch_check, m) {
  py::module_::import("torch.distributed");
  py::class_<ProcessGroupMooncake, BackendBase, c10::intrusive_ptr<ProcessGroupMooncake>>(
      m, "ProcessGroupMooncake")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             MooncakeOptions o;
             o.timeout = timeout;
             return c10::make_intrusive<ProcessGroupMooncake>(store, rank, size, std::move(o));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("_stream_ops",
           [](ProcessGroupMooncake& self) { return self.communicator().streamOps(); });
  m.attr("DEVICES") = py::cast(ProcessGroupMooncake::devices());
  mooncake::torch_ext::registerEpApis(m);
  m.attr("BACKEND_BASE") = py::str(mooncake::torch_ext::kBackendBasePyName);
  m.def("_device_empty_like", &mooncake::torch_ext::deviceEmptyLike, py::arg("like"),
        py::arg("device") = 0);
  m.def("_device_layer", [] {
    auto d = mooncake::engine::device::get();
    if (!d.ok()) throw std::runtime_error(d.status().toString());
    return std::string((*d)->name());
  });
  m.def(
      "_device_copy",
      [](uint64_t dst, uint64_t src, uint64_t n) {
        mooncake::torch_ext::copyBytes(reinterpret_cast<void*>(dst),
                                       reinterpret_cast<const void*>(src), n, "_device_copy");
      },
      py::call_guard<py::gil_scoped_release>());
}
