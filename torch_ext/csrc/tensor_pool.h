// TensorPool: reusable output tensors of the EP binding (torch_ext/csrc/ep_binding.cc).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace mooncake::torch_ext {

// Large outputs (recv_x: 117 MB at the benchmark's low-latency shape, several MB in normal
// mode; combine's out) would come from fresh mmap()ed pages on every call, and the page
// faults cost more than the copies. The pool hands out the first rows of a base tensor the
// caller has dropped: nothing but the pool references its TensorImpl or its storage (no
// Python object, no view, no operation in flight), so reuse is invisible to the caller.
class TensorPool {
 public:
  // A contiguous [n, rest...] tensor of `dtype` (contents unspecified). With slack, a new
  // base gets room for a later call's slightly larger n (normal mode's row counts vary).
  at::Tensor get(int64_t n, std::vector<int64_t> rest, at::ScalarType dtype, bool slack = true) {
    std::lock_guard<std::mutex> g(mu_);
    int victim = -1;
    for (size_t i = 0; i < pool_.size(); ++i) {
      at::Tensor& t = pool_[i];
      if (t.use_count() != 1 || t.storage().use_count() != 1) continue;
      if (t.scalar_type() == dtype && t.size(0) >= n && t.sizes().slice(1) == rest)
        return t.narrow(0, 0, n);
      if (victim < 0) victim = static_cast<int>(i);
    }
    std::vector<int64_t> shape{slack ? n + n / 4 + 8 : n};
    shape.insert(shape.end(), rest.begin(), rest.end());
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
    if (pool_.size() < kMax)
      pool_.push_back(t);
    else if (victim >= 0)
      pool_[victim] = t;
    return t.narrow(0, 0, n);
  }

 private:
  static constexpr size_t kMax = 8;
  std::mutex mu_;
  std::vector<at::Tensor> pool_;
};

}  // namespace mooncake::torch_ext
