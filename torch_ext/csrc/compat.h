// The one place that knows which torch it is built against.
//
// torch 1.13 (Debian's python3-torch): a third-party backend subclasses c10d::ProcessGroup
// and the Python creator returns that object. torch >= 2.1: the ProcessGroup is a facade
// over per-device c10d::Backend objects; the creator returns a Backend and register_backend
// takes devices=["cpu", "cuda"]. The op virtuals we override have the same signatures in
// both, so the adapter names its base class through this header and nothing else changes.
// Only the 1.13 branch is built into the module and tested on this machine. Debian's 1.13
// already ships c10d::Backend (the class 2.x grew from, same op virtuals), so the build also
// compiles process_group.cc once more with MC_TORCH_FORCE_BACKEND (torch_ext/CMakeLists.txt,
// target mooncake_torch_backend_shim_check): the Backend branch is compiled, never linked.
#pragma once

#include <torch/version.h>

#if defined(MC_TORCH_FORCE_BACKEND) || TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define MC_TORCH_HAS_BACKEND 1
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#define MC_TORCH_HAS_BACKEND 0
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace mooncake::torch_ext {

#if MC_TORCH_HAS_BACKEND
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

// ReduceOp::operator== is not const in 1.13; read the enum directly.
inline c10d::ReduceOp::RedOpType redOpType(const c10d::ReduceOp& op) { return op.op_; }

// Name of the Python class torch binds the base under (the creator returns a subclass).
constexpr const char* kBackendBasePyName = MC_TORCH_HAS_BACKEND ? "Backend" : "ProcessGroup";

}  // namespace mooncake::torch_ext
