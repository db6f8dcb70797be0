// The device layer on the CUDA driver API (built with MC_WITH_CUDA). The driver is loaded at
// run time (dlopen "libcuda.so.1") so that a CUDA build links and runs where no driver is
// installed; there the layer reports why it is missing. Compiled in CI; runs only on a GPU
// machine (scripts/gpu_check.sh).
#include <cuda.h>
#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/params.h"

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
  decltype(&cuMemGetAddressRange) getAddressRange = nullptr;
  decltype(&cuIpcGetMemHandle) ipcGet = nullptr;
  decltype(&cuIpcOpenMemHandle) ipcOpen = nullptr;
  decltype(&cuIpcCloseMemHandle) ipcClose = nullptr;
  decltype(&cuStreamCreate) streamCreate = nullptr;
  decltype(&cuMemcpyAsync) memcpyAsync = nullptr;
  decltype(&cuEventCreate) eventCreate = nullptr;
  decltype(&cuEventRecord) eventRecord = nullptr;
  decltype(&cuEventQuery) eventQuery = nullptr;
  decltype(&cuStreamWaitEvent) streamWaitEvent = nullptr;
  decltype(&cuModuleLoadData) moduleLoadData = nullptr;
  decltype(&cuModuleGetFunction) moduleGetFunction = nullptr;
  decltype(&cuLaunchKernel) launchKernel = nullptr;
  decltype(&cuFuncLoad) funcLoad = nullptr;                          // optional (12.4)
  decltype(&cuFuncGetAttribute) funcGetAttribute = nullptr;          // optional
  decltype(&cuDeviceCanAccessPeer) canAccessPeer = nullptr;  // optional
  decltype(&cuCtxEnablePeerAccess) enablePeerAccess = nullptr;  // optional
  decltype(&cuMemHostAlloc) memHostAlloc = nullptr;                  // optional
  decltype(&cuMemHostGetDevicePointer) hostGetDevicePointer = nullptr;  // optional
  decltype(&cuStreamWaitValue32) streamWaitValue32 = nullptr;        // optional
  decltype(&cuStreamWriteValue32) streamWriteValue32 = nullptr;      // optional
  decltype(&cuMemsetD32Async) memsetD32Async = nullptr;              // optional
  decltype(&cuMemHostRegister) hostRegister = nullptr;               // optional
  decltype(&cuMemHostUnregister) hostUnregister = nullptr;           // optional
  decltype(&cuStreamIsCapturing) streamIsCapturing = nullptr;        // optional
  decltype(&cuThreadExchangeStreamCaptureMode) exchangeCaptureMode = nullptr;  // optional
  decltype(&cuDeviceGetAttribute) deviceGetAttribute = nullptr;      // optional
  decltype(&cuFlushGPUDirectRDMAWrites) flushGpuDirect = nullptr;    // optional (11.3)
};

std::string errorText(const Driver& d, CUresult r) {
  const char* s = nullptr;
  if (d.getErrorString != nullptr) d.getErrorString(r, &s);
  return s != nullptr ? s : "CUDA error " + std::to_string(static_cast<int>(r));
}

// While a call of the layer runs, its thread heeds only its own stream captures
// (CU_STREAM_CAPTURE_MODE_THREAD_LOCAL; the thread's mode is put back after; a thread in
// relaxed mode stays in it). The engine's threads (transfers, EP's proxy and its reports) call
// the layer while a caller's thread may be capturing a CUDA graph in global mode,
// torch.cuda.graph's default, under which a "potentially unsafe" call from any other thread
// (an event query, an allocation) invalidates that capture. Those threads' calls touch none of
// the captured streams; a capture of the calling thread itself is checked as before.
// (PyTorch's NCCL watchdog queries its events the same way.)
class OwnCapturesOnly {
 public:
  explicit OwnCapturesOnly(const Driver& d) : d_(d) {
    set_ = d_.exchangeCaptureMode != nullptr && d_.exchangeCaptureMode(&mode_) == CUDA_SUCCESS;
    if (set_ && mode_ == CU_STREAM_CAPTURE_MODE_RELAXED) {  // (laxer already: put it back)
      (void)d_.exchangeCaptureMode(&mode_);
      set_ = false;
    }
  }
  ~OwnCapturesOnly() {
    if (set_) (void)d_.exchangeCaptureMode(&mode_);
  }
  OwnCapturesOnly(const OwnCapturesOnly&) = delete;
  OwnCapturesOnly& operator=(const OwnCapturesOnly&) = delete;

 private:
  const Driver& d_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;  // then the thread's own
  bool set_ = false;
};

// Events are created ahead and reused, never destroyed while the layer lives: the driver takes
// a context-wide lock to destroy (and create) one that a synchronous call holds while it waits,
// and the caller's thread may be in such a call behind a gate that only our op opens (the GPU
// machine's second session, the torch check: the op thread in cuEventDestroy, the main thread
// in tensor.cpu() behind Work.wait()'s gate on torch's stream; neither returned). Per device
// (an event belongs to a context).
struct EventPool {
  static constexpr size_t kAhead = 64;  // made with the device's copy stream
  std::mutex mu;
  std::vector<std::vector<CUevent>> spare;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(const Driver* d, CUevent e, EventPool* pool, int ordinal)
      : d_(d), e_(e), pool_(pool), ordinal_(ordinal) {}
  ~CudaEvent() override {
    std::lock_guard<std::mutex> g(pool_->mu);
    pool_->spare[static_cast<size_t>(ordinal_)].push_back(e_);
  }
  bool done() override {
    const OwnCapturesOnly own(*d_);
    return d_->eventQuery(e_) != CUDA_ERROR_NOT_READY;
  }
  CUevent raw() const { return e_; }
  Status wait(Deadline deadline) override {
    // cuEventSynchronize has no deadline: poll, yielding for MC_DEVICE_SPIN_US (a sleep costs
    // ~60-80 us with the kernel's timer slack, more than a small step's copies take), then
    // sleeping a little.
    static const auto spin = std::chrono::microseconds(params::getInt("MC_DEVICE_SPIN_US"));
    const OwnCapturesOnly own(*d_);
    const auto spin_until = Clock::now() + spin;
    for (;;) {
      CUresult r = d_->eventQuery(e_);
      if (r == CUDA_SUCCESS) return Status::OK();
      if (r != CUDA_ERROR_NOT_READY)
        return MC_STATUS(kInternal, "a CUDA copy failed: " << errorText(*d_, r));
      const auto now = Clock::now();
      if (now >= deadline) return MC_STATUS(kTimeout, "CUDA copies not done by the deadline");
      if (now < spin_until) {
        sched_yield();
      } else {
        usleep(20);
      }
    }
  }

 private:
  const Driver* d_;
  CUevent e_;
  EventPool* pool_;
  int ordinal_;
};

template <typename F>
bool load(void* lib, const char* sym, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, sym));
  return *out != nullptr;
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(Driver d, int n) : d_(d), ctx_(static_cast<size_t>(n), nullptr) {
    events_.spare.resize(ctx_.size());
  }
  const char* name() const override { return "cuda"; }
  int count() const override { return static_cast<int>(ctx_.size()); }

  Result<void*> allocate(size_t len, int ordinal) override {
    const OwnCapturesOnly own(d_);
    MC_RETURN_IF_ERROR(use(ordinal));
    CUdeviceptr p = 0;
    CUresult r = d_.memAlloc(&p, len);
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kResourceExhausted, "cuMemAlloc(" << len << ") on device " << ordinal
                                                         << ": " << err(r));
    noteUse();
    return reinterpret_cast<void*>(p);
  }

  Status free(void* p) override {
    const OwnCapturesOnly own(d_);
    PointerInfo info = pointer(p);
    if (!info.device) return MC_STATUS(kInvalidArgument, p << " is not CUDA device memory");
    MC_RETURN_IF_ERROR(use(info.ordinal));
    CUresult r = d_.memFree(reinterpret_cast<CUdeviceptr>(p));
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuMemFree(" << p << "): " << err(r));
    return Status::OK();
  }

  PointerInfo pointer(const void* p) const override {
    const OwnCapturesOnly own(d_);
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
    const OwnCapturesOnly own(d_);
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

  // The handle: the device ordinal (4 bytes) and CUDA's 64-byte handle of the allocation.
  Result<std::string> exportIpc(const void* p, uint64_t* offset) override {
    const OwnCapturesOnly own(d_);
    PointerInfo info = pointer(p);
    if (!info.device) return MC_STATUS(kInvalidArgument, p << " is not CUDA device memory");
    MC_RETURN_IF_ERROR(use(info.ordinal));
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = d_.getAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(p));
    CUipcMemHandle h{};
    if (r == CUDA_SUCCESS) r = d_.ipcGet(&h, base);
    if (r != CUDA_SUCCESS) return MC_STATUS(kNotSupported, "cuIpcGetMemHandle(" << p << "): " << err(r));
    *offset = reinterpret_cast<uint64_t>(p) - base;
    std::string out(4 + sizeof h.reserved, '\0');
    const int32_t ord = info.ordinal;
    std::memcpy(out.data(), &ord, 4);
    std::memcpy(out.data() + 4, h.reserved, sizeof h.reserved);
    return out;
  }

  Result<void*> openIpc(const std::string& handle) override {
    const OwnCapturesOnly own(d_);
    CUipcMemHandle h{};
    if (handle.size() != 4 + sizeof h.reserved)
      return MC_STATUS(kInvalidArgument, "not a CUDA IPC handle (" << handle.size() << " bytes)");
    int32_t ord = 0;
    std::memcpy(&ord, handle.data(), 4);
    std::memcpy(h.reserved, handle.data() + 4, sizeof h.reserved);
    // The exporter's ordinal names the same GPU here when both see the same devices.
    MC_RETURN_IF_ERROR(use(ord < count() ? ord : 0));
    CUdeviceptr p = 0;
    CUresult r = d_.ipcOpen(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r != CUDA_SUCCESS) return MC_STATUS(kUnavailable, "cuIpcOpenMemHandle: " << err(r));
    return reinterpret_cast<void*>(p);
  }

  Status closeIpc(void* base) override {
    const OwnCapturesOnly own(d_);
    CUresult r = d_.ipcClose(reinterpret_cast<CUdeviceptr>(base));
    if (r != CUDA_SUCCESS) return MC_STATUS(kInvalidArgument, "cuIpcCloseMemHandle: " << err(r));
    return Status::OK();
  }

  Status copyAsyncOn(void* dst, const void* src, size_t len, int ordinal,
                     const void* on) override {
    const OwnCapturesOnly own(d_);
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, on));
    if (len == 0) return Status::OK();
    CUresult r = d_.memcpyAsync(reinterpret_cast<CUdeviceptr>(dst),
                                reinterpret_cast<CUdeviceptr>(src), len, s);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuMemcpyAsync(" << len << "): " << err(r));
    return Status::OK();
  }

  Result<std::unique_ptr<Event>> record(int ordinal) override {
    return recordOn(ordinal, kCopyStream);
  }

  Result<std::unique_ptr<Event>> recordOn(int ordinal, const void* on) override {
    const OwnCapturesOnly own(d_);
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, on));
    CUevent e = nullptr;
    {
      std::lock_guard<std::mutex> g(events_.mu);
      auto& spare = events_.spare[static_cast<size_t>(ordinal)];
      if (!spare.empty()) {
        e = spare.back();
        spare.pop_back();
      }
    }
    // (More than kAhead events outstanding: one more is made, which is what EventPool avoids
    // on the common path.)
    CUresult r = e != nullptr ? CUDA_SUCCESS : d_.eventCreate(&e, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuEventCreate: " << err(r));
    auto ev = std::unique_ptr<Event>(new CudaEvent(&d_, e, &events_, ordinal));
    r = d_.eventRecord(e, s);  // (a failed record still returns e to the pool with ev)
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuEventRecord: " << err(r));
    return ev;
  }

  Result<const void*> newStream(int ordinal) override {
    const OwnCapturesOnly own(d_);
    MC_RETURN_IF_ERROR(use(ordinal));
    {
      // Streams are kept and reused, never destroyed (cuStreamDestroy takes the context lock
      // that EventPool's comment is about).
      std::lock_guard<std::mutex> g(mu_);
      auto& spare = spare_streams_[ordinal];
      if (!spare.empty()) {
        CUstream s = spare.back();
        spare.pop_back();
        return static_cast<const void*>(s);
      }
    }
    CUstream s = nullptr;
    CUresult r = d_.streamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kUnavailable, "cuStreamCreate on device " << ordinal << ": " << err(r));
    return static_cast<const void*>(s);
  }

  Status freeStream(int ordinal, const void* on) override {
    if (on == nullptr || on == kCopyStream)
      return MC_STATUS(kInvalidArgument, "freeStream: not a stream of newStream's");
    std::lock_guard<std::mutex> g(mu_);
    spare_streams_[ordinal].push_back(static_cast<CUstream>(const_cast<void*>(on)));
    return Status::OK();
  }

  Status waitEvent(int ordinal, const void* on, Event& ev) override {
    const OwnCapturesOnly own(d_);
    auto* e = dynamic_cast<CudaEvent*>(&ev);
    if (e == nullptr) return MC_STATUS(kInvalidArgument, "waitEvent: not an event of this layer");
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, on));
    CUresult r = d_.streamWaitEvent(s, e->raw(), 0);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuStreamWaitEvent: " << err(r));
    return Status::OK();
  }

  bool capturing(int ordinal, const void* on) override {
    const OwnCapturesOnly own(d_);
    if (d_.streamIsCapturing == nullptr) return false;
    auto s = streamFor(ordinal, on);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return s.ok() && d_.streamIsCapturing(*s, &st) == CUDA_SUCCESS &&
           st != CU_STREAM_CAPTURE_STATUS_NONE;
  }
  Status beginCapture(int, const void*) override { return notHere(); }
  Result<std::shared_ptr<Graph>> endCapture(int, const void*) override { return notHere(); }
  Status launchGraph(Graph&, int, const void*) override { return notHere(); }

  bool canAccess(int ordinal, const void* p) override {
    const OwnCapturesOnly own(d_);
    const PointerInfo i = pointer(p);
    if (!i.device || ordinal < 0 || ordinal >= count()) return false;
    if (i.ordinal == ordinal) return true;
    if (d_.canAccessPeer == nullptr || d_.enablePeerAccess == nullptr) return false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = peer_.find({ordinal, i.ordinal});
      if (it != peer_.end()) return it->second;
    }
    // Peer access from `ordinal`'s context to the other device's (both primary contexts).
    bool ok = false;
    CUdevice a = 0, b = 0;
    int can = 0;
    if (use(i.ordinal).ok() && d_.deviceGet(&a, ordinal) == CUDA_SUCCESS &&
        d_.deviceGet(&b, i.ordinal) == CUDA_SUCCESS &&
        d_.canAccessPeer(&can, a, b) == CUDA_SUCCESS && can != 0 && use(ordinal).ok()) {
      CUcontext other = nullptr;
      {
        std::lock_guard<std::mutex> g(mu_);
        other = ctx_[static_cast<size_t>(i.ordinal)];
      }
      CUresult r = d_.enablePeerAccess(other, 0);
      ok = r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    }
    std::lock_guard<std::mutex> g(mu_);
    peer_[{ordinal, i.ordinal}] = ok;
    return ok;
  }

  Result<uint32_t*> allocHostWords(size_t n) override {
    const OwnCapturesOnly own(d_);
    if (d_.memHostAlloc == nullptr || d_.hostGetDevicePointer == nullptr ||
        d_.streamWaitValue32 == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no stream memory operations");
    if (n == 0) return MC_STATUS(kInvalidArgument, "0 host words");
    MC_RETURN_IF_ERROR(use(0));
    void* p = nullptr;
    // Portable: usable from every context; device-mapped: streams read it.
    CUresult r = d_.memHostAlloc(&p, n * sizeof(uint32_t),
                                 CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kResourceExhausted, "cuMemHostAlloc(" << n * sizeof(uint32_t)
                                                             << "): " << err(r));
    std::memset(p, 0, n * sizeof(uint32_t));
    return static_cast<uint32_t*>(p);
  }

  Status waitWord(int ordinal, const void* stream, const uint32_t* word,
                  uint32_t value) override {
    const OwnCapturesOnly own(d_);
    if (d_.streamWaitValue32 == nullptr || d_.hostGetDevicePointer == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no cuStreamWaitValue32");
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, stream));
    CUdeviceptr dp = 0;
    CUresult r = wordAddress(word, &dp);
    if (r == CUDA_SUCCESS) r = d_.streamWaitValue32(s, dp, value, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_ERROR_NOT_SUPPORTED)
      return MC_STATUS(kNotSupported, "cuStreamWaitValue32 on device " << ordinal << ": "
                                                                       << err(r));
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kInternal, "cuStreamWaitValue32 on device " << ordinal << ": " << err(r));
    return Status::OK();
  }

  Status writeWord(int ordinal, const void* stream, uint32_t* word, uint32_t value) override {
    const OwnCapturesOnly own(d_);
    if (d_.streamWriteValue32 == nullptr || d_.hostGetDevicePointer == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no cuStreamWriteValue32");
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, stream));
    CUdeviceptr dp = 0;
    CUresult r = wordAddress(word, &dp);
    // Default flags: a memory barrier before the write, so the stream's earlier writes (the
    // copies a peer reads once it sees the word) are visible first.
    if (r == CUDA_SUCCESS) r = d_.streamWriteValue32(s, dp, value, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r == CUDA_ERROR_NOT_SUPPORTED)
      return MC_STATUS(kNotSupported, "cuStreamWriteValue32 on device " << ordinal << ": "
                                                                        << err(r));
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kInternal, "cuStreamWriteValue32 on device " << ordinal << ": " << err(r));
    return Status::OK();
  }

  Status storeWord(uint32_t* word, uint32_t value, Deadline deadline) override {
    const OwnCapturesOnly own(d_);
    if (d_.memsetD32Async == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no cuMemsetD32Async");
    const PointerInfo pi = pointer(word);
    if (!pi.device) return MC_STATUS(kInvalidArgument, "storeWord: " << word << " is not GPU memory");
    // On the copy stream, which holds no caller's work (and no gate).
    MC_ASSIGN_OR_RETURN(CUstream s, stream(pi.ordinal));
    CUresult r = d_.memsetD32Async(reinterpret_cast<CUdeviceptr>(word), value, 1, s);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuMemsetD32Async: " << err(r));
    MC_ASSIGN_OR_RETURN(std::unique_ptr<Event> ev, record(pi.ordinal));
    return ev->wait(deadline);
  }

  Status pinHost(void* p, size_t len) override {
    const OwnCapturesOnly own(d_);
    if (d_.hostRegister == nullptr || d_.hostUnregister == nullptr)
      return MC_STATUS(kNotSupported, "the CUDA driver has no cuMemHostRegister");
    MC_RETURN_IF_ERROR(use(0));
    CUresult r = d_.hostRegister(p, len, CU_MEMHOSTREGISTER_PORTABLE);
    if (r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
      return MC_STATUS(kAlreadyExists, "host memory at " << p << " is pinned already");
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kUnavailable, "cuMemHostRegister(" << p << ", " << len << "): " << err(r));
    return Status::OK();
  }

  Status unpinHost(void* p) override {
    const OwnCapturesOnly own(d_);
    if (d_.hostUnregister == nullptr) return MC_STATUS(kNotSupported, "no cuMemHostUnregister");
    MC_RETURN_IF_ERROR(use(0));
    CUresult r = d_.hostUnregister(p);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInvalidArgument, "cuMemHostUnregister(" << p << "): " << err(r));
    return Status::OK();
  }

  uint64_t pageableCopies() const override { return 0; }

  Status flushRemoteWrites(int ordinal) override {
    const OwnCapturesOnly own(d_);
    MC_RETURN_IF_ERROR(use(ordinal));
    int need;
    {
      std::lock_guard<std::mutex> g(mu_);
      need = flush_need_[static_cast<size_t>(ordinal)];
    }
    if (need < 0) {  // once per device: does it order NIC writes itself, can it flush them?
      CUdevice dev = 0;
      int order = 0, options = 0;
      const bool known = d_.deviceGetAttribute != nullptr &&
                         d_.deviceGet(&dev, ordinal) == CUDA_SUCCESS &&
                         d_.deviceGetAttribute(
                             &order, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev) ==
                             CUDA_SUCCESS &&
                         d_.deviceGetAttribute(
                             &options, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
                             dev) == CUDA_SUCCESS;
      if (known && order >= CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER) {
        need = 0;
      } else if (known && (options & CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST) != 0 &&
                 d_.flushGpuDirect != nullptr) {
        need = 1;
      } else {
        need = 0;
        MC_LOG(WARN, ENGINE) << "CUDA device " << ordinal << " neither orders GPUDirect RDMA "
                             << "writes natively nor offers cuFlushGPUDirectRDMAWrites: a "
                             << "kernel told that a NIC's data arrived may read it stale";
      }
      std::lock_guard<std::mutex> g(mu_);
      flush_need_[static_cast<size_t>(ordinal)] = need;
    }
    if (need == 0) return Status::OK();
    CUresult r = d_.flushGpuDirect(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                   CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kInternal, "cuFlushGPUDirectRDMAWrites on device " << ordinal << ": "
                                                                          << err(r));
    return Status::OK();
  }

  Status load(const Kernel& k, int ordinal) override {
    const OwnCapturesOnly own(d_);
    MC_RETURN_IF_ERROR(stream(ordinal).status());  // (and its events: made now too)
    if (k.image == nullptr || k.name == nullptr)
      return MC_STATUS(kNotSupported, "kernel " << (k.name ? k.name : "?")
                                                << ": this build has no CUDA image of it");
    return function(k, ordinal).status();
  }

  Status launchOn(const Kernel& k, unsigned grid, unsigned block, const void* params,
                  size_t params_len, int ordinal, const void* on) override {
    const OwnCapturesOnly own(d_);
    if (k.image == nullptr || k.name == nullptr)
      return MC_STATUS(kNotSupported, "kernel " << (k.name ? k.name : "?")
                                                << ": this build has no CUDA image of it");
    MC_ASSIGN_OR_RETURN(CUstream s, streamFor(ordinal, on));
    MC_ASSIGN_OR_RETURN(CUfunction f, function(k, ordinal));
    size_t len = params_len;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, const_cast<void*>(params),
                     CU_LAUNCH_PARAM_BUFFER_SIZE, &len, CU_LAUNCH_PARAM_END};
    CUresult r = d_.launchKernel(f, grid, 1, 1, block, 1, 1, 0, s, nullptr, extra);
    if (r != CUDA_SUCCESS) return MC_STATUS(kInternal, "cuLaunchKernel(" << k.name << "): " << err(r));
    return Status::OK();
  }

 private:
  static Status notHere() {
    return MC_STATUS(kNotSupported, "the CUDA layer does not capture graphs itself: capture "
                                    "with torch.cuda.graph or the CUDA API");
  }
  // The stream `on` names (kCopyStream: the layer's copy stream of `ordinal`; else a CUstream
  // of the caller's), with `ordinal`'s context current.
  Result<CUstream> streamFor(int ordinal, const void* on) {
    if (on == kCopyStream) return stream(ordinal);
    MC_RETURN_IF_ERROR(use(ordinal));
    return static_cast<CUstream>(const_cast<void*>(on));
  }
  // Where a stream memory operation finds `word`: device memory as it is, a host word (mapped,
  // allocHostWords) through its device pointer.
  CUresult wordAddress(const uint32_t* word, CUdeviceptr* out) {
    if (pointer(word).device) {
      *out = reinterpret_cast<CUdeviceptr>(word);
      return CUDA_SUCCESS;
    }
    return d_.hostGetDevicePointer(out, const_cast<uint32_t*>(word), 0);
  }
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
  // Device `ordinal`'s copy stream (made current; created on first use, never destroyed:
  // the layer lives as long as the process).
  Result<CUstream> stream(int ordinal) {
    MC_RETURN_IF_ERROR(use(ordinal));
    std::lock_guard<std::mutex> g(mu_);
    CUstream& s = streams_[static_cast<size_t>(ordinal)];
    if (s == nullptr) {
      CUresult r = d_.streamCreate(&s, CU_STREAM_NON_BLOCKING);
      if (r != CUDA_SUCCESS) {
        s = nullptr;
        return MC_STATUS(kUnavailable, "cuStreamCreate on device " << ordinal << ": " << err(r));
      }
      // The device's events, made now with its stream (EventPool).
      std::lock_guard<std::mutex> ge(events_.mu);
      auto& spare = events_.spare[static_cast<size_t>(ordinal)];
      for (size_t i = 0; i < EventPool::kAhead; ++i) {
        CUevent e = nullptr;
        if (d_.eventCreate(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) break;
        spare.push_back(e);
      }
    }
    return s;
  }
  // k's function on device `ordinal` (its module loaded once per device; stream() made the
  // context current).
  Result<CUfunction> function(const Kernel& k, int ordinal) {
    std::lock_guard<std::mutex> g(mu_);
    const auto key = std::make_tuple(k.image, std::string(k.name), ordinal);
    if (auto it = functions_.find(key); it != functions_.end()) return it->second;
    CUmodule& m = modules_[{k.image, ordinal}];
    CUresult r = CUDA_SUCCESS;
    if (m == nullptr) r = d_.moduleLoadData(&m, k.image);
    if (r != CUDA_SUCCESS) {
      m = nullptr;
      // No image this GPU can run is kNotSupported (callers fall back for good); anything
      // else (out of memory, say) is an error of this launch only.
      const bool unsupported = r == CUDA_ERROR_NO_BINARY_FOR_GPU || r == CUDA_ERROR_INVALID_PTX ||
                               r == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ||
                               r == CUDA_ERROR_INVALID_IMAGE;
      return Status(unsupported ? Code::kNotSupported : Code::kUnavailable,
                    "loading the kernels of " + std::string(k.name) + " on device " +
                        std::to_string(ordinal) + ": " + err(r));
    }
    CUfunction f = nullptr;
    r = d_.moduleGetFunction(&f, m, k.name);
    if (r != CUDA_SUCCESS) return MC_STATUS(kNotFound, "kernel " << k.name << ": " << err(r));
    // Loaded now, not at its first launch (Device::load says why): cuFuncLoad where the
    // driver has it, else an attribute query, which loads a lazily loaded function.
    if (d_.funcLoad != nullptr) {
      r = d_.funcLoad(f);
    } else if (d_.funcGetAttribute != nullptr) {
      int unused = 0;
      r = d_.funcGetAttribute(&unused, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f);
    }
    if (r != CUDA_SUCCESS)
      return MC_STATUS(kUnavailable, "loading kernel " << k.name << ": " << err(r));
    functions_[key] = f;
    return f;
  }
  std::string err(CUresult r) const { return errorText(d_, r); }
  Driver d_;
  std::mutex mu_;
  std::vector<CUcontext> ctx_;
  std::vector<CUstream> streams_ = std::vector<CUstream>(ctx_.size(), nullptr);
  std::vector<int> flush_need_ = std::vector<int>(ctx_.size(), -1);  // -1 unknown, 0, 1
  std::map<int, std::vector<CUstream>> spare_streams_;  // freeStream's (guarded by mu_)
  EventPool events_;
  std::map<std::pair<const void*, int>, CUmodule> modules_;  // never unloaded (as streams)
  std::map<std::tuple<const void*, std::string, int>, CUfunction> functions_;
  std::map<std::pair<int, int>, bool> peer_;  // (from, to): canAccess's answers
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
            load(lib, "cuGetErrorString", &d.getErrorString) &&
            load(lib, "cuMemGetAddressRange_v2", &d.getAddressRange) &&
            load(lib, "cuIpcGetMemHandle", &d.ipcGet) &&
            load(lib, "cuIpcOpenMemHandle_v2", &d.ipcOpen) &&
            load(lib, "cuIpcCloseMemHandle", &d.ipcClose) &&
            load(lib, "cuStreamCreate", &d.streamCreate) &&
            load(lib, "cuMemcpyAsync", &d.memcpyAsync) &&
            load(lib, "cuEventCreate", &d.eventCreate) &&
            load(lib, "cuEventRecord", &d.eventRecord) &&
            load(lib, "cuEventQuery", &d.eventQuery) &&
            load(lib, "cuStreamWaitEvent", &d.streamWaitEvent) &&
            load(lib, "cuModuleLoadData", &d.moduleLoadData) &&
            load(lib, "cuModuleGetFunction", &d.moduleGetFunction) &&
            load(lib, "cuLaunchKernel", &d.launchKernel);
  if (!ok) return MC_STATUS(kNotSupported, "the CUDA driver lacks an entry point: " << dlerror());
  (void)load(lib, "cuMemGetHandleForAddressRange", &d.getHandleForAddressRange);  // CUDA >= 11.7
  (void)load(lib, "cuDeviceCanAccessPeer", &d.canAccessPeer);
  (void)load(lib, "cuCtxEnablePeerAccess", &d.enablePeerAccess);
  (void)load(lib, "cuMemHostAlloc", &d.memHostAlloc);
  (void)load(lib, "cuMemHostGetDevicePointer_v2", &d.hostGetDevicePointer);
  (void)load(lib, "cuStreamWaitValue32_v2", &d.streamWaitValue32);
  (void)load(lib, "cuStreamWriteValue32_v2", &d.streamWriteValue32);
  (void)load(lib, "cuMemsetD32Async", &d.memsetD32Async);
  (void)load(lib, "cuFuncLoad", &d.funcLoad);
  (void)load(lib, "cuFuncGetAttribute", &d.funcGetAttribute);
  (void)load(lib, "cuMemHostRegister_v2", &d.hostRegister);
  (void)load(lib, "cuMemHostUnregister", &d.hostUnregister);
  (void)load(lib, "cuStreamIsCapturing", &d.streamIsCapturing);
  (void)load(lib, "cuThreadExchangeStreamCaptureMode", &d.exchangeCaptureMode);
  (void)load(lib, "cuDeviceGetAttribute", &d.deviceGetAttribute);
  (void)load(lib, "cuFlushGPUDirectRDMAWrites", &d.flushGpuDirect);
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
