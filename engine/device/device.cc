// The device layer's choice (MC_DEVICE) and its host simulation. See device.h.
#include "engine/device/device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/params.h"
#include "mooncake/config.h"

namespace mooncake::engine::device {

#if MC_HAVE_CUDA
// cuda_device.cc: the CUDA driver's layer, or why there is none here.
Result<std::unique_ptr<Device>> makeCudaDevice();
#endif

namespace {

// Device memory simulated by host memory: each allocation is a memfd mapped shared, so that
// its "dma-buf" (the memfd) maps the same pages elsewhere, as a GPU's dma-buf does for a NIC.
class SimDevice final : public Device {
 public:
  ~SimDevice() override {
    for (auto& [addr, a] : allocs_) {
      munmap(reinterpret_cast<void*>(addr), a.len);
      close(a.fd);
    }
  }
  const char* name() const override { return "sim"; }
  int count() const override { return kSimDevices; }

  Result<void*> allocate(size_t len, int ordinal) override {
    if (ordinal < 0 || ordinal >= kSimDevices)
      return MC_STATUS(kInvalidArgument, "sim device " << ordinal << " does not exist (0.."
                                                       << kSimDevices - 1 << ")");
    if (len == 0) return MC_STATUS(kInvalidArgument, "sim device: allocation of 0 bytes");
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t mapped = (len + page - 1) / page * page;
    int fd = memfd_create("mc-simdev", MFD_CLOEXEC);
    if (fd < 0) return MC_STATUS(kResourceExhausted, "sim device: memfd_create: " << strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
      int e = errno;
      close(fd);
      return MC_STATUS(kResourceExhausted, "sim device: " << mapped << " bytes: " << strerror(e));
    }
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      close(fd);
      return MC_STATUS(kResourceExhausted, "sim device: mmap " << mapped << ": " << strerror(e));
    }
    std::lock_guard<std::mutex> g(mu_);
    allocs_[reinterpret_cast<uint64_t>(p)] = Alloc{mapped, fd, ordinal};
    return p;
  }

  Status free(void* p) override {
    Alloc a;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = allocs_.find(reinterpret_cast<uint64_t>(p));
      if (it == allocs_.end())
        return MC_STATUS(kInvalidArgument, "sim device: " << p << " was not allocated here");
      a = it->second;
      allocs_.erase(it);
    }
    munmap(p, a.len);
    close(a.fd);
    return Status::OK();
  }

  PointerInfo pointer(const void* p) const override {
    std::lock_guard<std::mutex> g(mu_);
    const Alloc* a = find(reinterpret_cast<uint64_t>(p), 1, nullptr);
    return a == nullptr ? PointerInfo{} : PointerInfo{true, a->ordinal};
  }

  Result<DmaBuf> exportDmabuf(const void* p, size_t len) override {
    std::lock_guard<std::mutex> g(mu_);
    uint64_t base = 0;
    const Alloc* a = find(reinterpret_cast<uint64_t>(p), len, &base);
    if (a == nullptr)
      return MC_STATUS(kInvalidArgument, "sim device: [" << p << ", +" << len
                                                         << ") is not inside one allocation");
    int fd = dup(a->fd);
    if (fd < 0) return MC_STATUS(kResourceExhausted, "sim device: dup: " << strerror(errno));
    return DmaBuf{fd, reinterpret_cast<uint64_t>(p) - base};
  }

 private:
  struct Alloc {
    size_t len = 0;
    int fd = -1;
    int ordinal = -1;
  };
  // Under mu_: the allocation holding [addr, addr+len), its start in *base.
  const Alloc* find(uint64_t addr, uint64_t len, uint64_t* base) const {
    auto it = allocs_.upper_bound(addr);
    if (it == allocs_.begin()) return nullptr;
    --it;
    if (addr - it->first >= it->second.len || len > it->second.len - (addr - it->first))
      return nullptr;
    if (base != nullptr) *base = it->first;
    return &it->second;
  }
  mutable std::mutex mu_;
  std::map<uint64_t, Alloc> allocs_;
};

std::atomic<bool> g_active{false};

}  // namespace

Result<std::unique_ptr<Device>> make(const std::string& want) {
  if (want == "sim") return std::unique_ptr<Device>(new SimDevice());
  if (want == "none")
    return MC_STATUS(kNotSupported, "no device layer: MC_DEVICE=none");
  if (want != "auto" && want != "cuda")
    return MC_STATUS(kInvalidArgument, "MC_DEVICE=" << want << ": expected auto, cuda, sim or none");
#if MC_HAVE_CUDA
  return makeCudaDevice();
#else
  return MC_STATUS(kNotSupported, "no device layer: this build has no CUDA (MC_WITH_CUDA=OFF)");
#endif
}

Result<Device*> get() {
  // Made once; a failure is kept too (the answer does not change within a process).
  static Result<std::unique_ptr<Device>>* made = [] {
    auto* r = new Result<std::unique_ptr<Device>>(make(params::getString("MC_DEVICE")));
    if (r->ok()) g_active.store(true, std::memory_order_release);
    return r;
  }();
  if (!made->ok()) return made->status();
  return made->value().get();
}

bool active() { return g_active.load(std::memory_order_acquire); }

}  // namespace mooncake::engine::device
