// The one place that knows which torch it is built against (its Python twin is
// torch_ext/python/mooncake/_compat.py). Built and tested against torch 1.13 (Debian 12's
// python3-torch) and 2.6 (Debian 13's, scripts/test_torch2.sh); written against c10d's
// headers up to 2.11 (the GPU machine's wheel).
//
// torch 1.13: a third-party backend subclasses c10d::ProcessGroup and the Python creator
// returns that object. torch >= 2.1: the ProcessGroup is a facade over per-device
// c10d::Backend objects; the creator returns a Backend and register_backend takes the
// devices it serves. The op virtuals both have in common keep their signatures, so the
// adapter names its base class through BackendBase. What only 2.x has is compiled under
// the feature macros below, never under a version check of its own elsewhere:
//
//   MC_TORCH_HAS_BACKEND      base class c10d::Backend; startCoalescing/endCoalescing
//                             returning a Work; allgather_into_tensor_coalesced and
//                             reduce_scatter_tensor_coalesced (the fast paths of
//                             dist._coalescing_manager and of the functional collectives)
//   MC_TORCH_HAS_DIST_ERRORS  c10::DistBackendError (Python: torch.distributed.
//                             DistBackendError, a RuntimeError)
//   MC_TORCH_HAS_WORK_RESULT  Work::getFutureResult (a future of c10d::WorkResult)
//
// Up to 2.11 c10d only added virtuals with working defaults (supportsCoalescing false,
// shutdown/abort no-ops, setTimeout warns, getBackendOptions/split/merge refuse) and, after
// 2.11, aliases that forward to the names overridden here (all_gather_single ->
// _allgather_base, reduce_scatter_single -> _reduce_scatter_base, all_to_all_single ->
// alltoall_base, *_single_coalesced -> *_tensor_coalesced), so nothing else is needed for
// the backend to keep working there.
#pragma once

#include <torch/version.h>

#define MC_TORCH_VERSION (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR)  // 113, 206, 211

#if MC_TORCH_VERSION >= 201
#define MC_TORCH_HAS_BACKEND 1
#define MC_TORCH_HAS_DIST_ERRORS 1
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#define MC_TORCH_HAS_BACKEND 0
#define MC_TORCH_HAS_DIST_ERRORS 0
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#define MC_TORCH_HAS_WORK_RESULT (MC_TORCH_VERSION >= 205)
// at::kFloat8_e4m3fn (EP's fp8 dispatch returns uint8 bytes of the same format before 2.1).
#define MC_TORCH_HAS_FP8 (MC_TORCH_VERSION >= 201)

#include <c10/util/Exception.h>

#include <exception>
#include <string>
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

// A failed collective or point-to-point op (a peer died, the group timed out, the op was
// aborted): torch.distributed.DistBackendError on 2.x, as ProcessGroupNCCL and
// ProcessGroupGloo raise it; RuntimeError on 1.13, which has no such type.
inline std::exception_ptr backendError(const std::string& msg) {
#if MC_TORCH_HAS_DIST_ERRORS
  // (The SourceLocation constructor is the one every 2.x has; Python shows what() without
  // the C++ backtrace unless TORCH_SHOW_CPP_STACKTRACES=1.)
  return std::make_exception_ptr(
      c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg));
#else
  return std::make_exception_ptr(std::runtime_error(msg));
#endif
}

}  // namespace mooncake::torch_ext
