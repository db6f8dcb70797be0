// GPU 0's executor for tests/gpu/ep_kernel_check (ep/kernels/ll_kernels.cu's launchers on one
// stream). Built with nvcc together with ep_kernel_check.cc (-DMC_EP_CHECK_CUDA).
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ep/kernels/ll_launch.h"
#include "tests/gpu/ep_kernel_exec.h"

namespace mooncake::ep::kern {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void checkLaunch(int e, const char* what) { check(static_cast<cudaError_t>(e), what); }

class CudaExec : public Exec {
 public:
  CudaExec() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~CudaExec() override {
    for (cudaStream_t s : ranks_) cudaStreamDestroy(s);
    cudaStreamDestroy(s_);
  }
  const char* name() const override { return "cuda"; }
  void* alloc(size_t n) override {
    void* p = nullptr;
    check(cudaMalloc(&p, n == 0 ? 1 : n), "cudaMalloc");
    check(cudaMemset(p, 0, n == 0 ? 1 : n), "cudaMemset");
    return p;
  }
  void release(void* p) override { cudaFree(p); }
  void upload(void* dst, const void* src, size_t n) override {
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s_), "upload");
    check(cudaStreamSynchronize(s_), "upload");
  }
  void download(void* dst, const void* src, size_t n) override {
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s_), "download");
    check(cudaStreamSynchronize(s_), "download");
  }
  void zero(void* p, size_t n) override { check(cudaMemsetAsync(p, 0, n, s_), "cudaMemsetAsync"); }
  int32_t* allocFlags(int n, int32_t** kernel_view) override {
    void* h = nullptr;
    check(cudaHostAlloc(&h, sizeof(int32_t) * n, cudaHostAllocMapped), "cudaHostAlloc(mapped)");
    std::memset(h, 0, sizeof(int32_t) * n);
    void* d = nullptr;
    check(cudaHostGetDevicePointer(&d, h, 0), "cudaHostGetDevicePointer");
    *kernel_view = static_cast<int32_t*>(d);
    return static_cast<int32_t*>(h);
  }
  void releaseFlags(int32_t* host) override { cudaFreeHost(host); }
  void dispatchSend(const LlArgs& p, int experts, int32_t* toks) override {
    checkLaunch(launchDispatchSend(p, experts, toks, s_), "dispatch send launch");
  }
  void dispatchRecv(const LlArgs& p) override {
    checkLaunch(launchDispatchRecv(p, s_), "dispatch recv launch");
  }
  void combineSend(const LlArgs& p) override {
    checkLaunch(launchCombineSend(p, s_), "combine send launch");
  }
  void combineRecv(const LlArgs& p) override {
    checkLaunch(launchCombineRecv(p, s_), "combine recv launch");
  }
  void normalDispatchSend(int rank, const NormalArgs& p, int32_t* toks) override {
    checkLaunch(launchNormalDispatchSend(p, toks, rankStream(rank)), "normal dispatch send launch");
  }
  void normalDispatchRecv(int rank, const NormalArgs& p, int32_t* toks) override {
    checkLaunch(launchNormalDispatchRecv(p, toks, rankStream(rank)), "normal dispatch recv launch");
  }
  void normalCombine(int rank, const NormalArgs& p) override {
    checkLaunch(launchNormalCombine(p, rankStream(rank)), "normal combine launch");
  }
  void finish() override {
    check(cudaStreamSynchronize(s_), "kernels");
    for (cudaStream_t s : ranks_) check(cudaStreamSynchronize(s), "kernels");
  }
  double copyRateGBs(size_t bytes) override {
    void *a = alloc(bytes), *b = alloc(bytes);
    check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s_), "d2d");
    finish();
    const int n = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i)
      check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s_), "d2d");
    finish();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    release(a);
    release(b);
    return static_cast<double>(bytes) * n / s / 1e9;
  }

 private:
  // A stream per rank for the normal calls (a rank's wait kernels spin until the others'
  // send kernels, on their own streams, have run).
  cudaStream_t rankStream(int rank) {
    check(cudaStreamSynchronize(s_), "zero/upload before a normal call");  // (other stream)
    while (static_cast<int>(ranks_.size()) <= rank) {
      cudaStream_t s = nullptr;
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      ranks_.push_back(s);
    }
    return ranks_[rank];
  }
  cudaStream_t s_ = nullptr;
  std::vector<cudaStream_t> ranks_;
};

}  // namespace

std::unique_ptr<Exec> makeCudaExec(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    *why = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    return nullptr;
  }
  return std::make_unique<CudaExec>();
}

}  // namespace mooncake::ep::kern
