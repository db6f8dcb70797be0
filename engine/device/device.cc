// The device layer's choice (MC_DEVICE) and its host simulation. See device.h.
#include "engine/device/device.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/device/sim_stream.h"
#include "engine/log.h"
#include "engine/params.h"
#include "mooncake/config.h"

namespace mooncake::engine::device {

#if MC_HAVE_CUDA
// cuda_device.cc: the CUDA driver's layer, or why there is none here.
Result<std::unique_ptr<Device>> makeCudaDevice();
#endif

namespace {

using sim::SimEvent;
using sim::SimGraph;
using sim::SimStream;

// Device memory simulated by host memory: each allocation is a memfd mapped shared, so that
// its "dma-buf" (the memfd) maps the same pages elsewhere, as a GPU's dma-buf does for a NIC,
// and another process maps it from its IPC handle ("sim <pid> <fd> <bytes> <ordinal>", opened
// through /proc/<pid>/fd/<fd>: like a CUDA IPC handle, it works while the exporter lives).
// As on a GPU, host code cannot touch it: the address handed out maps the memfd with no
// access (a load or store there faults, as dereferencing a device pointer does), and only the
// layer's own copies go through a second, writable mapping. So a path that memcpy's GPU memory
// crashes here, in the tests, and not first on the GPU machine.
class SimDevice final : public Device {
 public:
  ~SimDevice() override {
    for (auto& st : streams_) st.reset();  // their copies are done before the memory goes
    made_.clear();
    for (auto& [addr, a] : allocs_) {
      munmap(reinterpret_cast<void*>(addr), a.len);
      munmap(a.shadow, a.len);
      if (a.fd >= 0) close(a.fd);
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
    auto m = mapBoth(fd, mapped);
    if (!m.ok()) {
      close(fd);
      return m.status();
    }
    std::lock_guard<std::mutex> g(mu_);
    allocs_[reinterpret_cast<uint64_t>(m->first)] = Alloc{mapped, fd, ordinal, m->second};
    noteUse();
    return m->first;
  }

  Status free(void* p) override {
    Alloc a;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = allocs_.find(reinterpret_cast<uint64_t>(p));
      if (it == allocs_.end())
        return MC_STATUS(kInvalidArgument, "sim device: " << p << " was not allocated here");
      a = it->second;
      if (a.fd < 0)
        return MC_STATUS(kInvalidArgument, "sim device: " << p << " was opened from an IPC "
                                                          << "handle; use closeIpc");
      allocs_.erase(it);
    }
    // Freed memory that another process still has open through an IPC handle reads as junk
    // there (reading it is undefined on a GPU): code that frees what a peer may still copy
    // from fails its tests here.
    std::memset(a.shadow, 0xdb, a.len);
    munmap(p, a.len);
    munmap(a.shadow, a.len);
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
    if (a == nullptr || a->fd < 0)
      return MC_STATUS(kInvalidArgument, "sim device: [" << p << ", +" << len
                                                         << ") is not inside one allocation");
    int fd = dup(a->fd);
    if (fd < 0) return MC_STATUS(kResourceExhausted, "sim device: dup: " << strerror(errno));
    return DmaBuf{fd, reinterpret_cast<uint64_t>(p) - base};
  }

  Result<std::string> exportIpc(const void* p, uint64_t* offset) override {
    std::lock_guard<std::mutex> g(mu_);
    uint64_t base = 0;
    const Alloc* a = find(reinterpret_cast<uint64_t>(p), 1, &base);
    if (a == nullptr || a->fd < 0)
      return MC_STATUS(kInvalidArgument, "sim device: " << p << " is not in an allocation");
    *offset = reinterpret_cast<uint64_t>(p) - base;
    std::ostringstream os;
    os << "sim " << getpid() << " " << a->fd << " " << a->len << " " << a->ordinal;
    return os.str();
  }

  Result<void*> openIpc(const std::string& handle) override {
    std::istringstream in(handle);
    std::string tag;
    long pid = -1;
    int fd = -1, ordinal = -1;
    size_t len = 0;
    if (!(in >> tag >> pid >> fd >> len >> ordinal) || tag != "sim" || len == 0)
      return MC_STATUS(kInvalidArgument, "sim device: not a sim IPC handle");
    if (pid == getpid())
      return MC_STATUS(kInvalidArgument, "sim device: an IPC handle of this process");
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    int mine = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (mine < 0)
      return MC_STATUS(kNotFound, "sim device: cannot open the allocation of process " << pid
                                                                                       << ": " << strerror(errno));
    auto m = mapBoth(mine, len);
    close(mine);
    if (!m.ok()) return m.status();
    std::lock_guard<std::mutex> g(mu_);
    allocs_[reinterpret_cast<uint64_t>(m->first)] = Alloc{len, -1, ordinal, m->second};
    return m->first;
  }

  Status closeIpc(void* base) override {
    size_t len = 0;
    void* shadow = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = allocs_.find(reinterpret_cast<uint64_t>(base));
      if (it == allocs_.end() || it->second.fd >= 0)
        return MC_STATUS(kInvalidArgument, "sim device: " << base << " was not opened from an "
                                                          << "IPC handle");
      len = it->second.len;
      shadow = it->second.shadow;
      allocs_.erase(it);
    }
    munmap(base, len);
    munmap(shadow, len);
    return Status::OK();
  }

  Status copyAsyncOn(void* dst, const void* src, size_t len, int ordinal,
                     const void* on) override {
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    if (len == 0) return Status::OK();
    void* to = nullptr;
    const void* from = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      MC_ASSIGN_OR_RETURN(to, accessible(dst, len));
      MC_ASSIGN_OR_RETURN(from, accessible(src, len));
      // Device memory on one side only: the other is host memory, pinned or not.
      const bool dev_dst = to != dst, dev_src = from != src;
      if (dev_dst != dev_src && !pinnedLocked(dev_dst ? src : dst, len)) {
        pageable_.fetch_add(1, std::memory_order_relaxed);
        pageable_bytes_.fetch_add(len, std::memory_order_relaxed);
      }
    }
    s->push(to, from, len);
    return Status::OK();
  }

  Result<std::unique_ptr<Event>> recordOn(int ordinal, const void* on) override {
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    const uint64_t n = s->queued();
    auto graph = s->capture();
    return std::unique_ptr<Event>(new SimEvent(std::move(s), n, std::move(graph)));
  }

  Result<std::unique_ptr<Event>> record(int ordinal) override {
    return recordOn(ordinal, kCopyStream);
  }

  Result<const void*> newStream(int ordinal) override {
    if (ordinal < 0 || ordinal >= kSimDevices)
      return MC_STATUS(kInvalidArgument, "sim device " << ordinal << " does not exist");
    auto s = std::make_shared<SimStream>();
    const void* handle = s.get();
    std::lock_guard<std::mutex> g(mu_);
    made_[handle] = {ordinal, std::move(s)};
    return handle;
  }

  Status freeStream(int ordinal, const void* on) override {
    std::shared_ptr<SimStream> s;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = made_.find(on);
      if (it == made_.end() || it->second.first != ordinal)
        return MC_STATUS(kInvalidArgument, "sim device: stream " << on << " of device "
                                                                 << ordinal << " was not made here");
      s = std::move(it->second.second);
      made_.erase(it);
    }
    s.reset();  // (its queued items run first: SimStream's destructor)
    return Status::OK();
  }

  Status waitEvent(int ordinal, const void* on, Event& ev) override {
    auto* e = dynamic_cast<SimEvent*>(&ev);
    if (e == nullptr) return MC_STATUS(kInvalidArgument, "sim device: not an event of this layer");
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    std::shared_ptr<SimGraph> mine = s->capture();
    if (const std::shared_ptr<SimGraph>& graph = e->graph()) {
      // Recorded in a capture: s joins it (its order is the queue's). (A stream's lock comes
      // before its graph's, as SimStream::captureItem takes them: none is held here.)
      {
        std::lock_guard<std::mutex> g(graph->mu);
        if (graph->ended)  // (CUDA: CUDA_ERROR_CAPTURED_EVENT)
          return MC_STATUS(kInvalidArgument, "sim device: a wait on an event recorded in a "
                                             "capture that has ended");
        if (mine == graph) {
          if (s.get() == graph->origin) {  // (joins straight into the origin only)
            uint64_t& j = graph->joined[e->stream()];
            j = std::max(j, e->count());
          }
          return Status::OK();
        }
        if (mine)
          return MC_STATUS(kInvalidArgument, "sim device: a stream capturing into one graph "
                                             "waited on an event of another");
        graph->members.push_back(s);
      }
      s->setCapture(graph);
      return Status::OK();
    }
    if (mine) {  // (CUDA isolates a capture from work outside it)
      mine->invalidate("a captured stream waited on an event recorded outside the capture");
      return MC_STATUS(kInvalidArgument, "sim device: a capturing stream waited on an event "
                                         "recorded outside the capture");
    }
    e->gateOn(*s);
    return Status::OK();
  }

  bool capturing(int ordinal, const void* on) override {
    auto s = stream(ordinal, on);
    return s.ok() && (*s)->capture() != nullptr;
  }

  Status beginCapture(int ordinal, const void* on) override {
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    if (s->capture()) return MC_STATUS(kInvalidArgument, "sim device: the stream captures already");
    auto g = std::make_shared<SimGraph>();
    g->origin = s.get();
    g->members.push_back(s);
    s->setCapture(std::move(g));
    return Status::OK();
  }

  Result<std::shared_ptr<Graph>> endCapture(int ordinal, const void* on) override {
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    std::shared_ptr<SimGraph> g = s->capture();
    if (!g || g->origin != s.get())
      return MC_STATUS(kInvalidArgument, "sim device: no capture began on this stream");
    std::vector<std::shared_ptr<SimStream>> members;
    std::map<const SimStream*, uint64_t> joined;
    {
      std::lock_guard<std::mutex> lk(g->mu);
      for (auto& w : g->members)
        if (auto m = w.lock()) members.push_back(std::move(m));
      g->members.clear();
      joined = g->joined;
      g->ended = true;
    }
    for (auto& m : members) {  // (no graph lock held: a stream's lock comes first)
      if (m.get() != g->origin && m->captured() > joined[m.get()])
        g->invalidate("a stream that joined it queued work the capturing stream did not wait "
                      "for (CUDA: unjoined work)");
      m->setCapture(nullptr);
    }
    std::lock_guard<std::mutex> lk(g->mu);
    if (!g->invalid.empty())
      return MC_STATUS(kInvalidArgument, "sim device: the capture was invalidated: " << g->invalid);
    return std::shared_ptr<Graph>(g);
  }

  Status launchGraph(Graph& graph, int ordinal, const void* on) override {
    auto* g = dynamic_cast<SimGraph*>(&graph);
    if (g == nullptr) return MC_STATUS(kInvalidArgument, "sim device: not a graph of this layer");
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    std::lock_guard<std::mutex> lk(g->mu);
    for (const auto& item : g->items) s->replay(item);
    return Status::OK();
  }

  bool canAccess(int ordinal, const void*) override {
    return ordinal >= 0 && ordinal < kSimDevices;
  }

  Result<uint32_t*> allocHostWords(size_t n) override {
    if (n == 0) return MC_STATUS(kInvalidArgument, "sim device: 0 host words");
    auto words = std::make_unique<uint32_t[]>(n);  // zeroed
    std::lock_guard<std::mutex> g(mu_);
    words_.push_back(std::move(words));
    return words_.back().get();
  }

  Status pinHost(void* p, size_t len) override {
    if (p == nullptr || len == 0) return MC_STATUS(kInvalidArgument, "sim device: pin of nothing");
    std::lock_guard<std::mutex> g(mu_);
    if (find(reinterpret_cast<uint64_t>(p), 1, nullptr) != nullptr)
      return MC_STATUS(kInvalidArgument, "sim device: " << p << " is device memory, not host");
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    auto next = pinned_.upper_bound(a);
    const bool overlaps = (next != pinned_.end() && next->first - a < len) ||
                          (next != pinned_.begin() && a - std::prev(next)->first <
                                                          std::prev(next)->second);
    if (overlaps) return MC_STATUS(kAlreadyExists, "sim device: " << p << " is pinned already");
    pinned_[a] = len;
    return Status::OK();
  }

  Status unpinHost(void* p) override {
    std::lock_guard<std::mutex> g(mu_);
    if (pinned_.erase(reinterpret_cast<uint64_t>(p)) == 0)
      return MC_STATUS(kInvalidArgument, "sim device: " << p << " was not pinned here");
    return Status::OK();
  }

  uint64_t pageableCopies() const override { return pageable_.load(std::memory_order_relaxed); }
  Status flushRemoteWrites(int ordinal) override {
    if (ordinal < 0 || ordinal >= count())
      return MC_STATUS(kInvalidArgument, "simulated device " << ordinal << " does not exist");
    flushes_.fetch_add(1, std::memory_order_relaxed);
    return Status::OK();
  }
  uint64_t remoteWriteFlushes() const override { return flushes_.load(std::memory_order_relaxed); }
  uint64_t pageableBytes() const override {
    return pageable_bytes_.load(std::memory_order_relaxed);
  }

  Status waitWord(int ordinal, const void* on, const uint32_t* word, uint32_t value) override {
    if (word == nullptr) return MC_STATUS(kInvalidArgument, "sim device: no word to wait on");
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    MC_ASSIGN_OR_RETURN(uint32_t * at, wordAt(word));
    s->pushGate(at, value);
    return Status::OK();
  }

  Status writeWord(int ordinal, const void* on, uint32_t* word, uint32_t value) override {
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    MC_ASSIGN_OR_RETURN(uint32_t * at, wordAt(word));
    s->push([at, value]() -> Status {
      __atomic_store_n(at, value, __ATOMIC_RELEASE);
      return Status::OK();
    });
    return Status::OK();
  }

  Status storeWord(uint32_t* word, uint32_t value, Deadline) override {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (find(reinterpret_cast<uint64_t>(word), sizeof *word, nullptr) == nullptr)
        return MC_STATUS(kInvalidArgument, "sim device: storeWord: " << word
                                                                     << " is not device memory");
    }
    MC_ASSIGN_OR_RETURN(uint32_t * at, wordAt(word));
    __atomic_store_n(at, value, __ATOMIC_RELEASE);
    return Status::OK();
  }

  Status load(const Kernel& k, int ordinal) override {
    if (k.host == nullptr)
      return MC_STATUS(kNotSupported, "sim device: kernel " << (k.name ? k.name : "?")
                                                            << " has no host form");
    return stream(ordinal).status();
  }

  Status launchOn(const Kernel& k, unsigned grid, unsigned block, const void* params,
                  size_t params_len, int ordinal, const void* on) override {
    if (k.host == nullptr)
      return MC_STATUS(kNotSupported, "sim device: kernel " << (k.name ? k.name : "?")
                                                            << " has no host form");
    if (params_len > 4096 || grid == 0 || block == 0)
      return MC_STATUS(kInvalidArgument, "sim device: launch of " << (k.name ? k.name : "?")
                                                                  << ": bad shape or parameters");
    MC_ASSIGN_OR_RETURN(std::shared_ptr<SimStream> s, stream(ordinal, on));
    auto copy = std::make_shared<std::vector<char>>(static_cast<const char*>(params),
                                                    static_cast<const char*>(params) + params_len);
    auto host = k.host;
    s->push([this, host, copy]() -> Status {
      struct View final : HostView {
        const SimDevice* d;
        Result<void*> at(const void* p, size_t len) const override {
          std::lock_guard<std::mutex> g(d->mu_);
          return d->accessible(p, len);
        }
      } view;
      view.d = this;
      return host(copy->data(), view);
    });
    return Status::OK();
  }

 private:
  struct Alloc {
    size_t len = 0;
    int fd = -1;  // -1: opened from another process's IPC handle
    int ordinal = -1;
    void* shadow = nullptr;  // the writable mapping only copies use
  };
  // The address handed out (no access) and the copies' writable mapping of fd's first `len`
  // bytes.
  static Result<std::pair<void*, void*>> mapBoth(int fd, size_t len) {
    void* p = mmap(nullptr, len, PROT_NONE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      return MC_STATUS(kResourceExhausted, "sim device: mmap " << len << ": " << strerror(errno));
    void* shadow = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (shadow == MAP_FAILED) {
      int e = errno;
      munmap(p, len);
      return MC_STATUS(kResourceExhausted, "sim device: mmap " << len << ": " << strerror(e));
    }
    return std::make_pair(p, shadow);
  }
  // Under mu_: where a copy reads or writes [p, p+len): the writable mapping for device
  // memory, p itself for host memory. A range that is partly device memory is refused.
  Result<void*> accessible(const void* p, size_t len) const {
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    uint64_t base = 0;
    if (const Alloc* in = find(a, len, &base); in != nullptr)
      return static_cast<char*>(in->shadow) + (a - base);
    auto next = allocs_.upper_bound(a);
    bool overlaps = next != allocs_.end() && next->first - a < len;
    if (next != allocs_.begin()) {
      auto prev = std::prev(next);
      overlaps = overlaps || a - prev->first < prev->second.len;
    }
    if (overlaps)
      return MC_STATUS(kInvalidArgument, "sim device: a copy of [" << p << ", +" << len
                                                                  << ") runs past an allocation's end");
    return const_cast<void*>(p);
  }
  Result<std::shared_ptr<SimStream>> stream(int ordinal) {
    if (ordinal < 0 || ordinal >= kSimDevices)
      return MC_STATUS(kInvalidArgument, "sim device " << ordinal << " does not exist");
    std::lock_guard<std::mutex> g(mu_);
    auto& s = streams_[static_cast<size_t>(ordinal)];
    if (!s) s = std::make_shared<SimStream>();
    return s;
  }
  // The stream `on` names: kCopyStream (the device's copy stream) or one of newStream's.
  Result<std::shared_ptr<SimStream>> stream(int ordinal, const void* on) {
    if (on == kCopyStream) return stream(ordinal);
    std::lock_guard<std::mutex> g(mu_);
    auto it = made_.find(on);
    if (it == made_.end() || it->second.first != ordinal)
      return MC_STATUS(kNotSupported, "sim device: no stream but the copy stream and newStream's"
                                      " (" << on << " on device " << ordinal << ")");
    return it->second.second;
  }
  // Where the stream reads or writes a word: its writable mapping when it is device memory.
  Result<uint32_t*> wordAt(const uint32_t* word) {
    std::lock_guard<std::mutex> g(mu_);
    MC_ASSIGN_OR_RETURN(void* at, accessible(word, sizeof *word));
    return static_cast<uint32_t*>(at);
  }
  // Under mu_: whether host memory [p, p+len) lies in one pinned range.
  bool pinnedLocked(const void* p, size_t len) const {
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    auto it = pinned_.upper_bound(a);
    if (it == pinned_.begin()) return false;
    --it;
    return a - it->first < it->second && len <= it->second - (a - it->first);
  }
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
  std::shared_ptr<SimStream> streams_[kSimDevices];
  std::map<const void*, std::pair<int, std::shared_ptr<SimStream>>> made_;  // newStream's
  std::vector<std::unique_ptr<uint32_t[]>> words_;  // allocHostWords' (freed with the layer)
  std::map<uint64_t, size_t> pinned_;                // pinHost's ranges
  std::atomic<uint64_t> pageable_{0};               // pageableCopies()
  std::atomic<uint64_t> flushes_{0};                // remoteWriteFlushes()
  std::atomic<uint64_t> pageable_bytes_{0};         // pageableBytes()
};

std::atomic<bool> g_active{false};

const char g_copy_stream_tag = 0;

// The process's gates (acquireGate): words handed out in blocks, each with its last value.
struct GatePool {
  std::mutex mu;
  std::vector<Gate> free;  // opened gates: word and the value it holds
};
GatePool& gatePool() {
  static GatePool* p = new GatePool();  // never destroyed: streams may wait on its words
  return *p;
}

}  // namespace

const void* const kCopyStream = &g_copy_stream_tag;

PinnedRange::PinnedRange(Device* dev, void* p, size_t len) {
  if (dev == nullptr || p == nullptr || len == 0) return;
  Status st = dev->pinHost(p, len);
  if (st.ok()) {
    dev_ = dev;
    p_ = p;
  } else if (st.code() != Code::kAlreadyExists) {
    static std::once_flag logged;
    std::call_once(logged, [&] {
      MC_LOG(WARN, ENGINE) << "host memory left pageable for GPU copies: " << st.toString();
    });
  }
}

PinnedRange::~PinnedRange() {
  if (dev_ != nullptr) (void)dev_->unpinHost(p_);
}

PinnedRange& PinnedRange::operator=(PinnedRange&& o) noexcept {
  if (this != &o) {
    if (dev_ != nullptr) (void)dev_->unpinHost(p_);
    dev_ = std::exchange(o.dev_, nullptr);
    p_ = std::exchange(o.p_, nullptr);
  }
  return *this;
}

Result<Gate> acquireGate() {
  GatePool& p = gatePool();
  std::lock_guard<std::mutex> g(p.mu);
  if (p.free.empty()) {
    MC_ASSIGN_OR_RETURN(Device * d, get());
    constexpr size_t kBlock = 256;
    MC_ASSIGN_OR_RETURN(uint32_t * words, d->allocHostWords(kBlock));
    for (size_t i = kBlock; i-- > 0;) p.free.push_back(Gate{words + i, 0});
  }
  Gate gate = p.free.back();
  p.free.pop_back();
  ++gate.value;  // the word holds the last value; this use opens at the next
  return gate;
}

void openGateForGood(const Gate& gate) { __atomic_store_n(gate.word, gate.value, __ATOMIC_RELEASE); }

void openGate(const Gate& gate) {
  __atomic_store_n(gate.word, gate.value, __ATOMIC_RELEASE);
  GatePool& p = gatePool();
  std::lock_guard<std::mutex> g(p.mu);
  p.free.push_back(gate);
}

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

namespace {

// The layers get() made, one per MC_DEVICE value asked under, a failure kept too (making one
// costs a driver probe). Never destroyed: streams and gates may still use them at exit.
struct Made {
  std::string want;
  Result<std::unique_ptr<Device>> layer;
  const Made* next;  // the one made before it
};
std::atomic<const Made*> g_made{nullptr};  // the newest; the list only grows
std::atomic<const Made*> g_last{nullptr};  // the one get() answered last (its fast path)

Result<Device*> answer(const Made* m) {
  if (!m->layer.ok()) return m->layer.status();
  return m->layer.value().get();
}

}  // namespace

Result<Device*> get() {
  // In a process MC_DEVICE does not change, and this is the one layer made at the first call.
  // Tests set it per test (the peer they spawn inherits it): each answer is for its value.
  const std::string want = params::getString("MC_DEVICE");
  const Made* last = g_last.load(std::memory_order_acquire);
  if (last != nullptr && last->want == want) return answer(last);
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  const Made* m = g_made.load(std::memory_order_acquire);
  while (m != nullptr && m->want != want) m = m->next;
  if (m == nullptr) {
    m = new Made{want, make(want), g_made.load(std::memory_order_relaxed)};
    g_made.store(m, std::memory_order_release);
  }
  g_last.store(m, std::memory_order_release);
  return answer(m);
}

Result<Device*> layerOf(const void* p) {
  for (const Made* m = g_made.load(std::memory_order_acquire); m != nullptr; m = m->next)
    if (m->layer.ok() && m->layer.value()->pointer(p).device) return m->layer.value().get();
  return MC_STATUS(kNotFound, p << " is no device memory of a layer made here");
}

bool isDeviceMemory(const void* p) {
  if (!active()) return false;
  auto d = get();
  return d.ok() && (*d)->pointer(p).device;
}

PointerInfo locate(const void* p) {
  // No GPU memory can exist in a process where neither the layer made any nor the CUDA driver
  // was loaded (by torch, say): answer host memory there without starting the driver (cuInit
  // in a CPU-only process would cost time and break CUDA in its forked children).
  if (!active()) {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == nullptr) return PointerInfo{};
    dlclose(cuda);
  }
  auto d = get();
  return d.ok() ? (*d)->pointer(p) : PointerInfo{};
}

Status copy(void* dst, const void* src, size_t len, Deadline deadline) {
  if (len == 0) return Status::OK();
  MC_ASSIGN_OR_RETURN(Device * d, get());
  PointerInfo a = d->pointer(dst), b = d->pointer(src);
  const int ordinal = a.device ? a.ordinal : b.device ? b.ordinal : 0;
  MC_RETURN_IF_ERROR(d->copyAsync(dst, src, len, ordinal));
  MC_ASSIGN_OR_RETURN(std::unique_ptr<Event> ev, d->record(ordinal));
  return ev->wait(deadline);
}

Status transferCopy(Device* d, void* dst, const void* src, size_t len, int ordinal,
                    Deadline deadline) {
  if (len == 0) return Status::OK();
  static std::mutex mu;
  static auto* streams = new std::map<std::pair<Device*, int>, const void*>();  // (kept)
  std::unique_lock<std::mutex> g(mu);
  auto it = streams->find({d, ordinal});
  if (it == streams->end()) {
    MC_ASSIGN_OR_RETURN(const void* s, d->newStream(ordinal));
    it = streams->emplace(std::make_pair(d, ordinal), s).first;
  }
  const void* stream = it->second;
  g.unlock();
  MC_RETURN_IF_ERROR(d->copyAsyncOn(dst, src, len, ordinal, stream));
  MC_ASSIGN_OR_RETURN(std::unique_ptr<Event> ev, d->recordOn(ordinal, stream));
  return ev->wait(deadline);
}

Status transferCopy(void* dst, const void* src, size_t len, Deadline deadline) {
  if (len == 0) return Status::OK();
  MC_ASSIGN_OR_RETURN(Device * d, get());
  PointerInfo a = d->pointer(dst), b = d->pointer(src);
  return transferCopy(d, dst, src, len, a.device ? a.ordinal : b.device ? b.ordinal : 0,
                      deadline);
}

Status copyAny(void* dst, const void* src, size_t len, Deadline deadline) {
  if (len > 0 && !isDeviceMemory(dst) && !isDeviceMemory(src)) {
    std::memcpy(dst, src, len);
    return Status::OK();
  }
  return copy(dst, src, len, deadline);
}

bool active() { return g_active.load(std::memory_order_acquire); }
void noteUse() { g_active.store(true, std::memory_order_release); }

}  // namespace mooncake::engine::device
