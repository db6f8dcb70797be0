// Conversions between c10d's world and pg's: dtypes and reduce ops, argument checks,
// contiguous staging of user tensors, byte packing for list ops, and error translation.
// Only process_group.cc includes this (kept apart to keep that file one idea).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "pg/communicator.h"
#include "torch_ext/csrc/compat.h"
#include "torch_ext/csrc/gpu_tensors.h"

namespace mooncake::torch_ext {

using at::Tensor;

inline std::optional<pg::DataType> pgType(at::ScalarType s) {
  switch (s) {
    case at::kFloat:
      return pg::DataType::kFloat32;
    case at::kDouble:
      return pg::DataType::kFloat64;
    case at::kHalf:
      return pg::DataType::kFloat16;
    case at::kBFloat16:
      return pg::DataType::kBFloat16;
    case at::kChar:
      return pg::DataType::kInt8;
    case at::kShort:
      return pg::DataType::kInt16;
    case at::kInt:
      return pg::DataType::kInt32;
    case at::kLong:
      return pg::DataType::kInt64;
    case at::kByte:
      return pg::DataType::kUInt8;
    case at::kBool:
      return pg::DataType::kBool;
    case at::kComplexFloat:
      return pg::DataType::kComplex64;
    case at::kComplexDouble:
      return pg::DataType::kComplex128;
    default:
      return std::nullopt;
  }
}

inline std::optional<pg::ReduceOp> pgOp(const c10d::ReduceOp& op) {
  switch (redOpType(op)) {
    case c10d::ReduceOp::SUM:
      return pg::ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return pg::ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return pg::ReduceOp::kProduct;
    case c10d::ReduceOp::MIN:
      return pg::ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return pg::ReduceOp::kMax;
    case c10d::ReduceOp::BAND:
      return pg::ReduceOp::kBand;
    case c10d::ReduceOp::BOR:
      return pg::ReduceOp::kBor;
    case c10d::ReduceOp::BXOR:
      return pg::ReduceOp::kBxor;
    default:
      return std::nullopt;  // PREMUL_SUM (NCCL only), UNUSED
  }
}

inline bool direct(const Tensor& t) { return t.is_contiguous() && !t.is_conj() && !t.is_neg(); }

inline size_t nbytes(const Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// The tensors' data pointers (the block lists of the communicator's stream-ordered ops).
inline std::vector<void*> dataPtrs(const std::vector<Tensor>& ts) {
  std::vector<void*> v;
  for (const auto& t : ts) v.push_back(t.data_ptr());
  return v;
}
inline std::vector<const void*> constPtrs(const std::vector<Tensor>& ts) {
  std::vector<const void*> v;
  for (const auto& t : ts) v.push_back(t.data_ptr());
  return v;
}

// Validation on the caller's thread. Bad arguments are std::invalid_argument (Python:
// ValueError); a tensor on a device we do not serve yet is std::runtime_error.
class Check {
 public:
  // `who` must outlive the Check (it is the group's ErrorContext::who).
  Check(const std::string& who, const char* op) : who_(who), op_(op) {}

  [[noreturn]] void fail(const std::string& msg) const { failAs<std::invalid_argument>(msg); }
  // Called once, with the failed check's text, before it throws (the group tells its peers).
  mutable std::function<void(const Check&, const std::string&)> on_fail;
  // Whether a CPU tensor was checked (the op would run on the host, not stream-ordered).
  bool sawCpu() const { return cpu_; }
  void tensor(const Tensor& t, const std::string& name) const {
    if (!t.defined()) fail(name + " is an undefined tensor");
    if (!first_) first_ = t.scalar_type();
    if (t.is_cuda()) {
      const std::string why = cudaUnavailableReason();
      if (!why.empty()) {
        failAs<std::runtime_error>(name + " is a CUDA tensor (on " + t.device().str() +
                                   "), but " + why);
      }
      noteCudaDevice(t, &cuda_);
    } else if (!t.device().is_cpu()) {
      failAs<std::runtime_error>(name + " is on " + t.device().str() +
                                 "; the mooncake backend serves CPU and CUDA tensors");
    }
    if (t.device().is_cpu()) cpu_ = true;
    if (t.layout() != at::kStrided) fail(name + ": only dense (strided) tensors are supported");
    // GPU memory is handed to the communicator as it is (no staging copy by torch on the
    // thread that runs the op), so it must be one dense block, as ProcessGroupNCCL requires.
    if (onGpu(t) && !direct(t)) {
      fail(name + " is in GPU memory and must be contiguous (and not a conjugate or negative "
                  "view): call .contiguous() (or .resolve_conj()) first");
    }
    // Refused before anything is queued or numbered (every rank refuses alike, the group stays
    // in step): an op's completion is checked on the host, which a graph's replays never run.
    // (Asked once per device of the op: its tensors there share the stream.)
    if (onGpu(t) && firstOnDevice(gpuOrdinal(t)) && streamCapturing(t)) {
      fail(name + " is on a stream that is capturing a CUDA graph: the mooncake process "
                  "group's ops cannot be captured (each one's end is checked on the host); "
                  "issue it outside the capture");
    }
  }
  // The CUDA devices of the tensors checked so far (for the op's StreamFence).
  const std::vector<c10::Device>& cudaDevices() const { return cuda_; }
  // The dtype of the first tensor checked, for the op's signature (pg::SigDtype).
  std::optional<pg::DataType> sigDtype() const {
    return first_ ? pgType(*first_) : std::nullopt;
  }
  void tensors(const std::vector<Tensor>& v, const std::string& name) const {
    for (size_t i = 0; i < v.size(); ++i) tensor(v[i], name + "[" + std::to_string(i) + "]");
  }
  void single(const std::vector<Tensor>& v, const char* name) const {
    if (v.size() != 1) {
      fail(std::string("expects exactly one ") + name + " tensor per process, got " +
           std::to_string(v.size()));
    }
    tensor(v[0], name);
  }
  void rank(int64_t r, int size, const char* what) const {
    if (r < 0 || r >= size) {
      fail(std::string(what) + " " + std::to_string(r) + " is outside the group [0, " +
           std::to_string(size) + ")");
    }
  }
  void like(const Tensor& t, const Tensor& ref, const std::string& name) const {
    if (t.scalar_type() != ref.scalar_type()) {
      fail(name + " has dtype " + std::string(c10::toString(t.scalar_type())) + ", expected " +
           c10::toString(ref.scalar_type()));
    }
    if (t.numel() != ref.numel()) {
      fail(name + " has " + std::to_string(t.numel()) + " elements, expected " +
           std::to_string(ref.numel()));
    }
  }
  void sameType(const Tensor& t, const Tensor& ref, const std::string& name) const {
    if (t.scalar_type() != ref.scalar_type()) {
      fail(name + " has dtype " + std::string(c10::toString(t.scalar_type())) + ", expected " +
           c10::toString(ref.scalar_type()));
    }
  }
  // all_gather_into_tensor: output holds size x input, same dtype. `sfx` names the pair in a
  // coalesced call ("[i]").
  void gatherPair(const Tensor& output, const Tensor& input, int size,
                  const std::string& sfx) const {
    tensor(input, "input" + sfx);
    tensor(output, "output" + sfx);
    sameType(output, input, "output" + sfx);
    if (output.numel() != input.numel() * size) {
      fail("output" + sfx + " has " + std::to_string(output.numel()) +
           " elements, expected input (" + std::to_string(input.numel()) + ") x group size (" +
           std::to_string(size) + ")");
    }
  }
  // reduce_scatter_tensor: input holds size x output, same dtype.
  void scatterPair(const Tensor& output, const Tensor& input, int size,
                   const std::string& sfx) const {
    tensor(input, "input" + sfx);
    tensor(output, "output" + sfx);
    sameType(input, output, "input" + sfx);
    if (input.numel() != output.numel() * size) {
      fail("input" + sfx + " has " + std::to_string(input.numel()) +
           " elements, expected output (" + std::to_string(output.numel()) + ") x group size (" +
           std::to_string(size) + ")");
    }
  }
  std::pair<pg::DataType, pg::ReduceOp> reduction(const Tensor& t, const c10d::ReduceOp& op) const {
    auto dt = pgType(t.scalar_type());
    if (!dt) fail(std::string("dtype ") + c10::toString(t.scalar_type()) + " is not supported");
    auto rop = pgOp(op);
    if (!rop)
      fail("reduce op " + std::to_string(static_cast<int>(redOpType(op))) +
           " is not supported (PREMUL_SUM is NCCL-only)");
    if (!pg::reduceSupported(*dt, *rop)) {
      fail(std::string("reduce op ") + pg::reduceOpName(*rop) + " is not defined for dtype " +
           c10::toString(t.scalar_type()));
    }
    return {*dt, *rop};
  }

 private:
  // True the first time for `ordinal` (then noted).
  bool firstOnDevice(int ordinal) const {
    if (std::find(asked_.begin(), asked_.end(), ordinal) != asked_.end()) return false;
    asked_.push_back(ordinal);
    return true;
  }

  const std::string& who_;
  const char* op_;
  mutable std::vector<c10::Device> cuda_;
  mutable std::optional<at::ScalarType> first_;
  mutable bool cpu_ = false;
  // Tells on_fail (once), then throws E with msg after the group and the op.
  template <class E>
  [[noreturn]] void failAs(const std::string& msg) const {
    if (on_fail) {
      auto f = std::move(on_fail);
      on_fail = nullptr;
      f(*this, msg);
    }
    throw E(who_ + ": " + op_ + ": " + msg);
  }
  mutable std::vector<int> asked_;  // devices whose stream was asked whether it captures
};

// A contiguous stand-in for a user tensor: the tensor itself when it can be used as is,
// else a copy (inputs) or scratch (outputs) that writeBack() copies into the user's tensor.
struct Staged {
  Tensor user, buf;
  static Staged in(const Tensor& t) {
    return {t, direct(t) ? t : t.resolve_conj().resolve_neg().contiguous()};
  }
  static Staged out(const Tensor& t) {
    return {t, direct(t)
                   ? t
                   : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous))};
  }
  void* data() const { return buf.data_ptr(); }
  size_t bytes() const { return nbytes(buf); }
  void writeBack() {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

// Grow-only staging memory of one group for the list ops (slot 0: packed inputs, slot 1:
// gathered outputs). A fresh allocation per op would fault a large buffer in every time
// (several ms at 32 MB, more than the op). Ops of a group run one at a time (OpQueue), so
// one Scratch per group needs no lock; it keeps the largest size a list op has used.
class Scratch {
 public:
  uint8_t* get(int slot, size_t bytes) {
    Tensor& b = buf_[slot];
    if (!b.defined() || static_cast<size_t>(b.numel()) < bytes) {
      b = Tensor();  // free the old one first
      b = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 64))}, at::kByte);
    }
    return static_cast<uint8_t*>(b.data_ptr());
  }

 private:
  Tensor buf_[2];
};

inline size_t totalBytes(const std::vector<Tensor>& ts) {
  size_t total = 0;
  for (const auto& t : ts) total += nbytes(t);
  return total;
}

// Packs tensors byte-wise, back to back, into dst (totalBytes(ts) bytes of host memory);
// tensors in GPU memory are copied out by the device layer.
inline void packBytes(uint8_t* dst, const std::vector<Tensor>& ts,
                      std::vector<size_t>* offsets = nullptr) {
  size_t off = 0;
  for (const auto& t : ts) {
    if (offsets) offsets->push_back(off);
    Staged s = Staged::in(t);  // GPU tensors are direct (Check::tensor): no torch copy here
    copyBytes(dst + off, s.data(), s.bytes(), "packing the op's tensors");
    off += s.bytes();
  }
}

// Copies bytes out of a staging buffer into a user tensor (any layout; GPU memory through the
// device layer).
inline void unpackBytes(const uint8_t* src, Tensor& dst) {
  Staged s = Staged::out(dst);
  copyBytes(s.data(), src, s.bytes(), "unpacking the op's results");
  s.writeBack();
}

// What an error message names: "mooncake rank G (group 'name' rank r/n)" and, for a peer,
// its global rank.
struct ErrorContext {
  std::string who;
  std::vector<int64_t> global_ranks;  // empty: group rank == global rank
};

// Maps whatever an op threw to what Python should see (RuntimeError / ValueError), with
// the rank, the op and, for a pg::CommError, the peer to blame.
inline std::exception_ptr translateError(const ErrorContext& ctx, const char* op,
                                         std::exception_ptr e) {
  const std::string& who = ctx.who;
  const std::vector<int64_t>& globals = ctx.global_ranks;
  try {
    std::rethrow_exception(e);
  } catch (const pg::CommError& ce) {
    std::ostringstream os;
    os << who << ": " << op << " failed: " << ce.what();
    if (ce.peerRank() >= 0) {
      os << " [peer rank " << ce.peerRank();
      if (!globals.empty() && ce.peerRank() < static_cast<int>(globals.size()) &&
          globals[ce.peerRank()] != ce.peerRank()) {
        os << " = global rank " << globals[ce.peerRank()];
      }
      os << "]";
    }
    return backendError(os.str());
  } catch (const std::invalid_argument& ia) {
    return std::make_exception_ptr(std::invalid_argument(who + ": " + op + ": " + ia.what()));
  } catch (const c10::Error& ce) {
    return std::make_exception_ptr(
        std::runtime_error(who + ": " + op + " failed: " + ce.what_without_backtrace()));
  } catch (const std::exception& ex) {
    return std::make_exception_ptr(std::runtime_error(who + ": " + op + " failed: " + ex.what()));
  } catch (...) {
    return std::make_exception_ptr(std::runtime_error(who + ": " + op + " failed: unknown error"));
  }
}

// Byte counts and offsets of dim-0 splits (empty splits: equal parts).
inline void splitBytes(const Check& ck, const Tensor& t, const std::vector<int64_t>& splits, int n,
                       const char* name, std::vector<size_t>* bytes, std::vector<size_t>* offs) {
  if (t.dim() == 0) ck.fail(std::string(name) + " must have at least one dimension");
  const int64_t rows = t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : nbytes(t) / static_cast<size_t>(rows);
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    if (rows % n != 0) {
      ck.fail(std::string(name) + " dim 0 (" + std::to_string(rows) +
              ") is not divisible by the group size " + std::to_string(n));
    }
    s.assign(n, rows / n);
  } else if (static_cast<int>(s.size()) != n) {
    ck.fail(std::string(name) + " splits have " + std::to_string(s.size()) +
            " entries for a group of " + std::to_string(n));
  }
  int64_t sum = 0;
  for (int64_t v : s) {
    if (v < 0) ck.fail(std::string(name) + " splits contain a negative size");
    sum += v;
  }
  if (sum != rows) {
    ck.fail(std::string(name) + " splits sum to " + std::to_string(sum) + ", but dim 0 is " +
            std::to_string(rows));
  }
  size_t off = 0;
  for (int64_t v : s) {
    bytes->push_back(static_cast<size_t>(v) * row_bytes);
    offs->push_back(off);
    off += static_cast<size_t>(v) * row_bytes;
  }
}

}  // namespace mooncake::torch_ext
