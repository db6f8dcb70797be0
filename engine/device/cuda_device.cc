// The device layer on the CUDA driver API (built with MC_WITH_CUDA). The driver is loaded at
// run time (dlopen "libcuda.so.1") so that a CUDA build links and runs where no driver is
// installed; there the layer reports why it is missing. Compiled in CI; runs only on a GPU
// machine (scripts/gpu_check.sh).
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/device/device.h"

namespace mooncake::engine::device {

namespace {

// The driver entry points used here (names as libcuda exports them: the _v2 ABI where the
// header maps to it).
struct Driver {
  decltype(&cuInit) init = nullptr;
  decltype(&cuDeviceGetCount) deviceGetCount = nullptr;
  decltype(&cuDeviceGet) deviceGet = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) primaryCtxRetain = nullptr;
  decltype(&cuCtxSetCurrent) ctxSetCurrent = nullptr;
  decltype(&cuMemAlloc) memAlloc = nullptr;
  decltype(&cuMemFree) memFree = nullptr;
  decltype(&cuPointerGetAttribute) pointerGetAttribute = nullptr;
  decltype(&cuMemGetHandleForAddressRange) getHandleForAddressRange = nullptr;
  decltype(&cuGetErrorString) getErrorString = nullptr;
};

template <typename F>
bool load(void* lib, const char* sym, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, sym));
  return *out != nullptr;
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(Driver d, int n) : d_(d), ctx_(static_cast<size_t>(n), nullptr) {}
  const char* name() const override { return "cuda"; }
  int count() const override { return static_cast<int>(ctx_.size()); }

  Result<void*> allocate(size_t len, int ordinal) override {
    MC_RETURN_IF_ERROR(use(ordinal));
    CUdeviceptr p = 0;
    CUresult r = d_.memAlloc(&p, len);
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kResourceExhausted, "cuMemAlloc(" << len << ") on device " << ordinal
                                                         << ": " << err(r));
    return reinterpret_cast<void*>(p);
  }

  Status free(void* p) override {
    PointerInfo info = pointer(p);
    if (!info.device) return MC_STATUS(kInvalidArgument, p << " is not CUDA device memory");
    MC_RETURN_IF_ERROR(use(info.ordinal));
    CUresult r = d_.memFree(reinterpret_cast<CUdeviceptr>(p));
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuMemFree(" << p << "): " << err(r));
    return Status::OK();
  }

  PointerInfo pointer(const void* p) const override {
    unsigned int type = 0;
    int ordinal = -1;
    auto dp = reinterpret_cast<CUdeviceptr>(p);
    if (d_.pointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp) != CUDA_SUCCESS ||
        type != CU_MEMORYTYPE_DEVICE)
      return {};
    if (d_.pointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dp) != CUDA_SUCCESS)
      return {};
    return {true, ordinal};
  }

  Result<DmaBuf> exportDmabuf(const void* p, size_t len) override {
    PointerInfo info = pointer(p);
    if (!info.device) return MC_STATUS(kInvalidArgument, p << " is not CUDA device memory");
    if (d_.getHandleForAddressRange == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no cuMemGetHandleForAddressRange");
    MC_RETURN_IF_ERROR(use(info.ordinal));
    // The range must be aligned to the host page size.
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    const uint64_t lo = a / page * page;
    const uint64_t hi = (a + len + page - 1) / page * page;
    int fd = -1;
    CUresult r = d_.getHandleForAddressRange(&fd, static_cast<CUdeviceptr>(lo), hi - lo,
                                             CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (r != CUDA_SUCCESS || fd < 0)
      return MC_STATUS(kNotSupported, "no dma-buf for device memory at " << p << ": " << err(r));
    return DmaBuf{fd, a - lo};
  }

 private:
  // Makes device `ordinal`'s primary context current on this thread.
  Status use(int ordinal) {
    if (ordinal < 0 || ordinal >= count())
      return MC_STATUS(kInvalidArgument, "CUDA device " << ordinal << " does not exist (this "
                                                        << "process sees " << count() << ")");
    std::lock_guard<std::mutex> g(mu_);
    CUcontext& c = ctx_[static_cast<size_t>(ordinal)];
    if (c == nullptr) {
      CUdevice dev = 0;
      CUresult r = d_.deviceGet(&dev, ordinal);
      if (r == CUDA_SUCCESS) r = d_.primaryCtxRetain(&c, dev);
      if (r != CUDA_SUCCESS) {
        c = nullptr;
        return MC_STATUS(kUnavailable, "CUDA device " << ordinal << ": " << err(r));
      }
    }
    CUresult r = d_.ctxSetCurrent(c);
    if (r != CUDA_SUCCESS) return MC_STATUS(kUnavailable, "cuCtxSetCurrent: " << err(r));
    return Status::OK();
  }
  std::string err(CUresult r) const {
    const char* s = nullptr;
    if (d_.getErrorString != nullptr) d_.getErrorString(r, &s);
    return s != nullptr ? s : "CUDA error " + std::to_string(static_cast<int>(r));
  }
  Driver d_;
  std::mutex mu_;
  std::vector<CUcontext> ctx_;
};

}  // namespace

Result<std::unique_ptr<Device>> makeCudaDevice() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr)
    return MC_STATUS(kNotSupported, "no CUDA driver: " << dlerror());
  Driver d;
  bool ok = load(lib, "cuInit", &d.init) && load(lib, "cuDeviceGetCount", &d.deviceGetCount) &&
            load(lib, "cuDeviceGet", &d.deviceGet) &&
            load(lib, "cuDevicePrimaryCtxRetain", &d.primaryCtxRetain) &&
            load(lib, "cuCtxSetCurrent", &d.ctxSetCurrent) &&
            load(lib, "cuMemAlloc_v2", &d.memAlloc) && load(lib, "cuMemFree_v2", &d.memFree) &&
            load(lib, "cuPointerGetAttribute", &d.pointerGetAttribute) &&
            load(lib, "cuGetErrorString", &d.getErrorString);
  if (!ok) return MC_STATUS(kNotSupported, "the CUDA driver lacks an entry point: " << dlerror());
  (void)load(lib, "cuMemGetHandleForAddressRange", &d.getHandleForAddressRange);  // CUDA >= 11.7
  CUresult r = d.init(0);
  int n = 0;
  if (r == CUDA_SUCCESS) r = d.deviceGetCount(&n);
  if (r != CUDA_SUCCESS) {
    const char* s = nullptr;
    d.getErrorString(r, &s);
    return MC_STATUS(kNotSupported, "CUDA driver: " << (s ? s : "cuInit failed"));
  }
  if (n == 0) return MC_STATUS(kNotSupported, "the CUDA driver sees no device");
  return std::unique_ptr<Device>(new CudaDevice(d, n));
}

}  // namespace mooncake::engine::device
