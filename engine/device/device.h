// The device layer: the few operations on GPU memory the engine needs, behind one interface
// with two implementations (DESIGN.md section 2):
//   - cuda: the CUDA driver API, loaded at run time (dlopen "libcuda.so.1"), so a build with
//     CUDA still runs where no driver is installed (this machine, CI);
//   - sim: a host simulation for the tests: "device memory" is shared host memory (a memfd per
//     allocation) that the engine must treat as device memory (never memcpy'd by shm or tcp),
//     and its dma-buf is that memfd, which the verbs emulator maps like a NIC maps a GPU's BAR.
// Chosen once per process by MC_DEVICE (auto: cuda when a driver and a device are there).
// Allocation, pointer attributes, dma-buf export (rdma registers GPU memory with it), IPC
// handles (a process of the same host maps another's allocation), copies on a per-device copy
// stream, and events that complete after the copies queued before them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine::device {

struct PointerInfo {
  bool device = false;  // the address is device memory of this layer
  int ordinal = -1;     // which device
};

// A dma-buf file descriptor that maps a device range (owned by the caller: close it).
struct DmaBuf {
  int fd = -1;
  uint64_t offset = 0;  // where the range starts within the dma-buf
};

// Completes once every copy queued on its stream before it was recorded has.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool done() = 0;
  // kTimeout when the copies are not done by `deadline`; an error when a copy failed.
  virtual Status wait(Deadline deadline) = 0;
};

// Where a simulated kernel reads and writes [p, p+len): the host view of device memory (or
// p itself for host memory). Only the simulation has one; an error when the range runs past
// an allocation's end.
class HostView {
 public:
  virtual ~HostView() = default;
  virtual Result<void*> at(const void* p, size_t len) const = 0;
};

// Device code the layer runs on a device's copy stream, in order with the copies queued
// there (and completing the events recorded after it). One definition, two forms:
//   - CUDA: the kernel `name` (extern "C") of the module `image` (a fatbin or PTX, loaded
//     once per device), launched with grid x block threads and `params` as its one
//     by-value struct parameter (CU_LAUNCH_PARAM_BUFFER_POINTER); no image: CUDA refuses it;
//   - sim: `host(params, view)` on the stream's thread, which reaches memory through `view`
//     (device memory is not host-accessible in the simulation either).
struct Kernel {
  const void* image = nullptr;
  const char* name = nullptr;
  Status (*host)(const void* params, const HostView& view) = nullptr;
};

// Work captured from streams (Device::beginCapture .. endCapture), replayed by launchGraph.
class Graph {
 public:
  virtual ~Graph() = default;
};

// Names the layer's own copy stream where a stream is asked for (Device::waitWord).
extern const void* const kCopyStream;

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;  // "cuda" or "sim"
  virtual int count() const = 0;         // devices (ordinals 0 .. count-1)
  virtual Result<void*> allocate(size_t len, int ordinal) = 0;
  virtual Status free(void* p) = 0;
  virtual PointerInfo pointer(const void* p) const = 0;
  // A dma-buf for [p, p+len), which must lie in one allocation.
  virtual Result<DmaBuf> exportDmabuf(const void* p, size_t len) = 0;

  // IPC: a handle (opaque bytes) naming the allocation that holds p, for another process of
  // this host, and p's offset in that allocation. The exporter keeps the allocation alive.
  virtual Result<std::string> exportIpc(const void* p, uint64_t* offset) = 0;
  // Maps an allocation another process exported; its base here (device memory of this layer
  // until closeIpc). A handle of this very process is refused, as CUDA refuses it.
  virtual Result<void*> openIpc(const std::string& handle) = 0;
  virtual Status closeIpc(void* base) = 0;

  // Queues a copy of `len` bytes (device or host memory on either side) on device
  // `ordinal`'s copy stream; a stream's copies run in the order queued.
  Status copyAsync(void* dst, const void* src, size_t len, int ordinal) {
    return copyAsyncOn(dst, src, len, ordinal, kCopyStream);
  }
  // The same on `stream` of device `ordinal` (kCopyStream, or a CUstream of the caller's such
  // as torch's current one, or one of newStream's). The simulation has its copy streams and
  // newStream's only: kNotSupported for any other.
  virtual Status copyAsyncOn(void* dst, const void* src, size_t len, int ordinal,
                             const void* stream) = 0;
  // An event on device `ordinal`'s copy stream (Event).
  virtual Result<std::unique_ptr<Event>> record(int ordinal) = 0;
  // An event on `stream` of device `ordinal`, named as waitWord names it (kCopyStream, or a
  // CUstream of the caller's such as torch's current one, nullptr the legacy default stream).
  // The simulation has its copy streams and newStream's only: kNotSupported for any other.
  virtual Result<std::unique_ptr<Event>> recordOn(int ordinal, const void* stream) = 0;
  // A stream of device `ordinal` that the layer makes (CUDA: non-blocking, so it never waits
  // for the legacy default stream) for work a caller orders by events and words itself
  // (pg/stream_p2p.h: one per peer and direction); every call taking a stream takes it.
  // freeStream lets it go (the caller's work on it must have run: CUDA reuses it for a later
  // newStream).
  virtual Result<const void*> newStream(int ordinal) = 0;
  virtual Status freeStream(int ordinal, const void* stream) = 0;
  // Queues on `stream` a wait until `ev` (record / recordOn of this layer) completed.
  virtual Status waitEvent(int ordinal, const void* stream, Event& ev) = 0;
  // Queues kernel k on device `ordinal`'s copy stream (Kernel); params (params_len bytes, at
  // most 4096) are copied. A failed kernel fails the wait of every event recorded after it on
  // that stream (as a fault poisons a CUDA context).
  Status launch(const Kernel& k, unsigned grid, unsigned block, const void* params,
                size_t params_len, int ordinal) {
    return launchOn(k, grid, block, params, params_len, ordinal, kCopyStream);
  }
  // The same on `stream` (as copyAsyncOn's).
  virtual Status launchOn(const Kernel& k, unsigned grid, unsigned block, const void* params,
                          size_t params_len, int ordinal, const void* stream) = 0;
  // Loads kernel k on device `ordinal` now (launch loads it otherwise). CUDA loads a kernel
  // lazily by default (CUDA_MODULE_LOADING), at its first launch, and loading synchronises the
  // context: a first launch queued while a stream waits on a host word that only this launch's
  // completion opens (waitWord) would never return. Callers that gate streams load first.
  // kNotSupported as launch's.
  virtual Status load(const Kernel& k, int ordinal) = 0;
  // Whether a kernel on device `ordinal` may load and store at p: device memory of that
  // device, or of another that it has peer access to (enabled here on first ask). CUDA:
  // pageable host memory never; the simulation: any memory.
  virtual bool canAccess(int ordinal, const void* p) = 0;

  // Host words a stream waits for: what lets Work.wait() order a caller's stream after an op
  // that the host drives, without blocking the host (torch_ext/csrc/gpu_tensors.h).
  // allocHostWords: n zeroed 32-bit words of host memory the devices can read (CUDA: pinned
  // and mapped, cuMemHostAlloc), never freed (a stream may wait on one at any time).
  // waitWord: queues on `stream` (a CUstream of the caller's on device `ordinal`, such as
  // torch's current stream, nullptr being CUDA's legacy default stream; kCopyStream: the
  // layer's copy stream of `ordinal`) a wait that holds the stream's later work until
  // (int32_t)(*word - value) >= 0, the cyclic comparison of cuStreamWaitValue32's GEQ. The
  // host stores the word with release semantics. kNotSupported where the device cannot; the
  // simulation has no streams but its copy streams and newStream's.
  // waitWord's word may also be device memory of this layer (a peer's mapped through IPC
  // too): what streams of several processes synchronise on (pg/stream_ops.h).
  virtual Result<uint32_t*> allocHostWords(size_t n) = 0;
  virtual Status waitWord(int ordinal, const void* stream, const uint32_t* word,
                          uint32_t value) = 0;
  // Queues on `stream` a store of `value` into `word` (device memory of this layer, its own or
  // a peer's mapped through IPC, or a host word) that follows the stream's earlier work and
  // makes that work's writes visible first (CUDA: cuStreamWriteValue32 with its memory
  // barrier). kNotSupported as waitWord's.
  virtual Status writeWord(int ordinal, const void* stream, uint32_t* word, uint32_t value) = 0;
  // Stores `value` into `word` (device memory of this layer) now, on no stream the caller's
  // work may be held behind: what releases a stream waiting on the word (waitWord) when the
  // peer that should have written it is gone. Waits (to `deadline`) until the store is done.
  virtual Status storeWord(uint32_t* word, uint32_t value, Deadline deadline) = 0;

  // CUDA-graph capture. capturing: whether `stream` is capturing now (CUDA:
  // cuStreamIsCapturing: a caller's stream inside torch.cuda.graph, or a stream that joined
  // such a capture by waiting on an event recorded in it), what callers ask before they would
  // synchronise with the host or queue what a replay must not repeat. beginCapture /
  // endCapture / launchGraph: the simulation's capture, for the tests (every stream that
  // waits on an event recorded in the capture joins it; the host waiting for such an event
  // invalidates it, and endCapture then says why; launchGraph queues what was captured on
  // `stream`, in the order it was queued). CUDA: kNotSupported (capture with torch.cuda.graph
  // or the CUDA API; the layer's streams join a caller's capture through events as above).
  virtual bool capturing(int ordinal, const void* stream) = 0;
  virtual Status beginCapture(int ordinal, const void* stream) = 0;
  virtual Result<std::shared_ptr<Graph>> endCapture(int ordinal, const void* stream) = 0;
  virtual Status launchGraph(Graph& graph, int ordinal, const void* stream) = 0;

  // Page-locks host memory [p, p+len) for the devices (CUDA: cuMemHostRegister, portable).
  // Copies between it and device memory then run as DMA straight from it; from pageable
  // memory the driver first bounces them through a staging buffer of its own (and the copy
  // is partly synchronous). kAlreadyExists when part of the range is pinned already (by this
  // layer or by the application: then not the caller's to unpin). unpinHost(p) undoes
  // pinHost(p, ...).
  virtual Status pinHost(void* p, size_t len) = 0;
  virtual Status unpinHost(void* p) = 0;
  // Copies queued so far between device memory and host memory that was not pinned: the
  // simulation counts them (tests check that a path pins the host memory it moves); CUDA
  // does not count (0).
  virtual uint64_t pageableCopies() const = 0;
  // The bytes those copies moved (the simulation; CUDA: 0).
  virtual uint64_t pageableBytes() const { return 0; }
  // Makes the writes a NIC has made into device `ordinal`'s memory (GPUDirect RDMA) visible to
  // its kernels, in the order the NIC made them, before the caller signals those kernels that
  // the data is there (CUDA: cuFlushGPUDirectRDMAWrites to the owner, when the device does not
  // order such writes natively: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING below
  // OWNER; a device that can do neither is reported once, in a warning). The simulation has
  // nothing to flush and counts the calls (remoteWriteFlushes), for tests.
  virtual Status flushRemoteWrites(int ordinal) = 0;
  virtual uint64_t remoteWriteFlushes() const { return 0; }
};

// Host memory pinned for as long as it lives (Device::pinHost / unpinHost), when it can be:
// memory already pinned, or a refusal, leaves it as it is (copies still work, bounced by the
// driver), logged once per process.
class PinnedRange {
 public:
  PinnedRange() = default;
  PinnedRange(Device* dev, void* p, size_t len);
  ~PinnedRange();
  PinnedRange(PinnedRange&& o) noexcept { *this = std::move(o); }
  PinnedRange& operator=(PinnedRange&& o) noexcept;
  PinnedRange(const PinnedRange&) = delete;
  PinnedRange& operator=(const PinnedRange&) = delete;

 private:
  Device* dev_ = nullptr;  // set while this object pinned p_
  void* p_ = nullptr;
};

// The process's device layer (made on first call; MC_DEVICE). An error says why there is none
// (MC_DEVICE=none, no CUDA driver, no device, a build without CUDA). A test that changes
// MC_DEVICE gets the layer of the new value (made once per value; none is ever destroyed).
Result<Device*> get();
// The layer made in this process whose device memory p is, whatever MC_DEVICE says now (a
// test may have changed it since the allocation); kNotFound when none.
Result<Device*> layerOf(const void* p);
// A device layer of kind `which` (auto, cuda, sim, none), apart from the process's one: for
// tests, and what get() makes from MC_DEVICE.
Result<std::unique_ptr<Device>> make(const std::string& which);
// Whether p is GPU memory of the process's layer. False, without making a layer, while no
// GPU memory has been used in this process (active()).
bool isDeviceMemory(const void* p);
// Where p lives, asking the process's layer (made if need be): memory the caller got from
// elsewhere (torch's CUDA allocator, a KV cache) that is to be registered. Host memory, or no
// layer: {false, -1}; so too, without making a layer, while no GPU memory was used through
// the layer (active()) and no CUDA driver is loaded in the process.
PointerInfo locate(const void* p);

// Copies len bytes (device or host memory on either side) through the process's layer on
// the copy stream of the device involved (dst's, else src's, else 0) and waits for it.
Status copy(void* dst, const void* src, size_t len, Deadline deadline);
// The same on a stream of `d`'s own for device `ordinal` (newStream, made on first use and
// kept): the engine's transfers (tcp's and the staging peer's copies of GPU memory). They
// must not queue behind the copy stream, which a caller may hold on a transfer's completion
// (the simulation's stand-in for torch's current stream is the copy stream; an EP call's
// stream then waits for kernels that wait for the peers' rows these copies bring in).
Status transferCopy(Device* d, void* dst, const void* src, size_t len, int ordinal,
                    Deadline deadline);
// transferCopy() through the process's layer, on the device involved (as copy()'s).
Status transferCopy(void* dst, const void* src, size_t len, Deadline deadline);

// copy(), or a plain memcpy when neither side is GPU memory (isDeviceMemory): for callers
// whose buffers are usually host memory (the store's and the process group's staging).
Status copyAny(void* dst, const void* src, size_t len, Deadline deadline);

// Whether GPU memory has been used in this process (registered, allocated or mapped from a
// peer through the layer; noteUse()): until then the engine looks no request up for it.
// Cheap; never makes a layer.
bool active();
void noteUse();

// A gate a stream can wait on (Device::waitWord): a word of the process's pool of host words
// and the value that opens it. The pool hands a word out again only after it was opened, with
// the next value: words only grow, so a stream still waiting on an earlier use of a word is
// released too (the comparison is cyclic; a word wraps after 2^31 uses).
struct Gate {
  uint32_t* word = nullptr;
  uint32_t value = 0;
};
// A closed gate from the pool of the process's layer (words allocated 256 at a time).
Result<Gate> acquireGate();
// Opens g (a release store of its value) and returns its word to the pool. Once per gate.
void openGate(const Gate& g);
// Opens g without giving its word back: a stream may still store an older value into it later
// (a failed op's), which must not close the gate of the word's next user.
void openGateForGood(const Gate& g);

// The simulation's device count.
constexpr int kSimDevices = 8;

}  // namespace mooncake::engine::device
