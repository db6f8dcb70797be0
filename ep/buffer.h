// EpBuffer: expert-parallel dispatch/combine (DeepEP's low-latency and normal modes) on CPU
// memory, over one registered buffer per rank allocated ONCE from the group's engine.
//
// Data path. Rank r writes the rows it sends straight into the destination's buffer: with
// a plain store when the destination's buffer is mapped here (same host, shm: one copy per
// token), otherwise with engine WRITE requests. After a destination's rows it publishes
// signal words (round << 32 | count): a release store (mapped) or an engine message the
// destination's handler stores (remote, sent after the writes completed). Receivers wait on
// their own signal words: spin MC_EP_SPIN_US, then sleep on the buffer's doorbell futex,
// checking peer liveness between sleeps, until a deadline.
//
// Rounds. Every dispatch takes the next dispatch round, every combine the next combine
// round; round & 1 picks the buffer half, so two rounds may be in flight and no round reads
// another's data (the round is in each signal word). Ranks must issue dispatch/combine in
// the same order with the same M, H, E, K and dtype (as DeepEP). On host buffers a send of
// round n also waits until its destinations read round n-2 (read marks, below).
//
// Failure (low-latency mode, Mooncake EP's active_ranks model). A source rank whose
// signals do not all carry this round by timeout_us (-1: no timeout), or 100 ms after its engine peer was
// seen dead, is set to 0 in the caller's active_ranks and counted as having sent nothing;
// ranks already 0 are neither sent to nor waited for; combine skips owners that are 0.
// Normal mode has no mask: a silent rank makes it throw std::runtime_error after
// MC_EP_TIMEOUT_MS.
//
// Errors: std::invalid_argument for bad arguments, detected before anything is sent;
// std::runtime_error for protocol/transport failures.
//
// Abandoned rounds. A rank whose call is invalid still takes its round (abandon()), and tells
// every peer so instead of sending data: the peers' calls of that round end at once with a
// std::runtime_error naming it (not after timeout_us, and without marking it inactive), so
// the next round is in step on every rank.
//
// Threading: one thread at a time calls the send/recv methods (the binding serialises them
// through enqueue()/runSync()); the engine's dispatcher thread may store remote signals
// concurrently. Buffer memory is freed in the destructor; the group (engine) must outlive it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "ep/kernels/host_lanes.h"
#include "ep/kernels/ll_entry.h"
#include "ep/kernels/ll_kernels.h"
#include "ep/kernels/normal_kernels.h"
#include "ep/layout.h"

namespace mooncake::engine::device {
class Device;
class Event;
}

namespace mooncake::pg {
class Communicator;
}

namespace mooncake::ep {

struct Scratch;  // ep/device_scratch.h

// What an EP buffer is built on: a group of ranks over one engine.
struct EpGroup {
  int rank = 0;
  int size = 1;
  engine::TransferEngine* engine = nullptr;
  std::vector<engine::PeerId> peers;  // engine peer of each rank; peers[rank] is unused
  // Ranks that held no member when the group was taken (an elastic group's inactive slots;
  // empty: none). all_gather zero-fills their blocks; set-up then fails naming the slot.
  std::vector<char> vacant;
  // A size the buffer must have (0: any): a rank rebuilding a buffer of that size
  // (update_ep_member) while the group's last ranks are inactive (an elastic group ends at
  // its highest active rank) makes every rank's set-up fail, naming them.
  int min_size = 0;
  // Collective: every rank contributes `bytes`; out receives size() blocks in rank order.
  std::function<void(const void* in, void* out, size_t bytes)> all_gather;
  std::shared_ptr<void> keep_alive;  // owner of engine/peers (e.g. the Communicator)
};

// The group of a process-group communicator (ep/group.cc; all_gather runs on its worker).
EpGroup groupOf(std::shared_ptr<pg::Communicator> comm);

// Throws std::runtime_error naming rank r when r is one of g's vacant ranks (its set-up
// block came back empty for that reason); returns otherwise.
void refuseVacant(const EpGroup& g, int r);
// Throws std::runtime_error when `wanted` (the largest min_size of the exchange) exceeds g's
// size, naming the missing ranks.
void refuseShrunk(const EpGroup& g, uint64_t wanted);
// Throws std::runtime_error when `late` (rank r's entry of the set-up exchange: 0, or 1 + the
// rank its writes of an earlier buffer still went to, EpBuffer::settleEarlierWrites) is set.
void refuseLate(int r, uint64_t late, int64_t timeout_ms);

// Each call's `inputs`: the owner of the memory its sends read (x or y, the weights). Writes
// to a peer on another host that are not done by MC_EP_TIMEOUT_MS keep running after the call
// returned (engine.h, wait); the engine then holds `inputs` until they finished. Null: the
// caller must keep that memory valid itself, and cannot tell for how long.
struct LowLatencyDispatchArgs {
  const void* x = nullptr;  // [T][H] (bfloat16 when dtype is kFp8)
  std::shared_ptr<void> inputs;  // (above)
  DType dtype = DType::kBFloat16;
  int64_t tokens = 0, hidden = 0;
  const int64_t* topk_idx = nullptr;  // [T][K], -1 = none
  int topk = 0;
  int32_t* active_ranks = nullptr;  // [R], updated in place
  int64_t max_tokens = 0;           // M
  int experts = 0;                  // E
  int64_t timeout_us = 0;
  // outputs
  void* recv_x = nullptr;           // [L][R*M][H] (kFp8: e4m3 bytes)
  float* recv_scales = nullptr;     // [L][R*M][H/128] (kFp8 only)
  int32_t* recv_count = nullptr;    // [L]
  int32_t* src_info = nullptr;      // [L][R*M]
  int64_t* layout_range = nullptr;  // [L][R]: (begin << 32) | count
};

struct LowLatencyCombineArgs {
  const void* y = nullptr;  // [L][R*M][H]
  std::shared_ptr<void> inputs;  // (above)
  DType dtype = DType::kBFloat16;
  int64_t hidden = 0, max_tokens = 0;
  int experts = 0;
  const int32_t* src_info = nullptr;      // handle
  const int64_t* layout_range = nullptr;  // handle
  const int64_t* topk_idx = nullptr;      // [T][K]
  const float* topk_weights = nullptr;    // [T][K]
  int64_t tokens = 0;
  int topk = 0;
  int32_t* active_ranks = nullptr;
  int64_t timeout_us = 0;
  void* out = nullptr;  // [T][H]
};

struct NormalDispatchArgs {
  const void* x = nullptr;  // [T][H]
  std::shared_ptr<void> inputs;  // (above)
  DType dtype = DType::kBFloat16;
  int64_t tokens = 0, hidden = 0;
  // Routing: is_token_in_rank [T][R] (dispatchLayout of topk_idx, or a handle's).
  const uint8_t* is_token_in_rank = nullptr;
  // Presence is said by the flags (an empty tensor's pointer may be null either way).
  bool with_topk_idx = false;  // false: cached dispatch (routing from a handle)
  bool with_weights = false;
  const int64_t* topk_idx = nullptr;    // [T][K]
  const float* topk_weights = nullptr;  // [T][K]
  int topk = 0;                         // K of whichever of the two is given, else 0
  int experts = 0;
  int expert_alignment = 1;
};

struct NormalDispatchOutputs {
  void* recv_x = nullptr;                  // [N][H]
  int32_t* recv_src_idx = nullptr;         // [N]
  int64_t* recv_topk_idx = nullptr;        // [N][K] local expert or -1 (with_topk_idx)
  float* recv_topk_weights = nullptr;      // [N][K] (with_weights)
  int32_t* num_recv_per_expert = nullptr;  // [L] (with_topk_idx)
};

struct NormalCombineArgs {
  const void* y = nullptr;  // [N][H], rows as normal dispatch delivered them
  std::shared_ptr<void> inputs;  // (above)
  DType dtype = DType::kBFloat16;
  int64_t hidden = 0;
  const int32_t* recv_counts = nullptr;  // [R] rows received from each source (handle)
  bool with_weights = false;
  const float* weights = nullptr;  // [N][K] (with_weights)
  int topk = 0;
  const uint8_t* is_token_in_rank = nullptr;  // [T][R] of this rank's dispatch (handle)
  int64_t tokens = 0;
  void* out = nullptr;           // [T][H]
  float* out_weights = nullptr;  // [T][K] (with_weights)
};

// Completion of an enqueued operation.
class EpEvent {
 public:
  explicit EpEvent(std::shared_future<void> f) : f_(std::move(f)) {}
  void wait() const { f_.get(); }  // rethrows the operation's exception
  bool done() const { return f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

 private:
  std::shared_future<void> f_;
};

class EpBuffer {
 public:
  // A timeout_us this long (35 years) or longer is no deadline: now + it would overflow the
  // clock (a huge timeout_us used to time out at once and mark healthy ranks inactive).
  static constexpr int64_t kNoDeadlineUs = int64_t{1} << 50;
  // Collective over the group: allocates `bytes` from the engine, exchanges addresses.
  // disable_p2p: reach every peer with engine WRITEs, never by mapping its buffer (Mooncake
  // EP's switch off of its NVLink/IPC path). device >= 0: the buffer is GPU memory of that
  // device of the engine's device layer ("Device mode" below).
  static std::unique_ptr<EpBuffer> create(EpGroup group, size_t bytes, bool disable_p2p = false,
                                          int device = -1);
  ~EpBuffer();
  EpBuffer(const EpBuffer&) = delete;
  EpBuffer& operator=(const EpBuffer&) = delete;

  int rank() const { return g_.rank; }
  int size() const { return g_.size; }
  size_t bytes() const { return geo_.totalBytes(); }
  // True when rank r's buffer is reached with direct stores (mapped), false over the engine.
  bool isMapped(int r) const { return mapped_[r] != nullptr; }
  // Device mode (ep/ll_device.cc): the buffer is GPU memory of device `device()` of the
  // engine's device layer (engine/device/device.h: CUDA, or its host simulation in the tests),
  // the buffer of every rank on this host is opened here through its IPC handle, and the
  // low-latency calls queue the kernels (ep/kernels/ll_entry.h) on the device's own stream;
  // every pointer of a call's arguments (active_ranks too) is then GPU memory; the dead-rank
  // flags the kernels read are host-mapped words. Ranks on other hosts are reached by the
  // buffer's host proxy (ep/ll_proxy.h) through the engine, in both modes. Unless
  // streamCalls(), each call waits on the host for its
  // kernels and reads back the per-source decisions to report silent ranks and errors as the
  // host paths do. Both modes.
  bool onDevice() const { return device_ >= 0; }
  int device() const { return device_; }
  // MC_EP_KERNELS=host or threads with every rank's buffer mapped: low-latency and normal
  // calls run the CUDA kernels' bodies (ep/kernels/ll_kernels.h, normal_kernels.h) on host
  // lanes instead of the CPU path's loops (ep/ll_host.cc). Always in device mode.
  bool kernelPath() const;

  // ---- low-latency mode: validate* throw std::invalid_argument; next*Round reserve a
  // round (call in program order); send then recv complete the operation. ----
  // data = false: the shapes only, not the values of topk_idx and the handle (streamCalls()).
  void validate(const LowLatencyDispatchArgs& a, bool data = true) const;
  void validate(const LowLatencyCombineArgs& a, bool data = true) const;
  uint32_t nextDispatchRound() { return ++dispatch_round_; }
  uint32_t nextCombineRound() { return ++combine_round_; }
  enum class RoundKind { kDispatch = 0, kCombine = 1 };
  // This rank gives up `round` (reserved by next*Round): tells every peer (best effort).
  void abandon(RoundKind kind, uint32_t round);
  // (With streamCalls(), use the stream calls below: these number rounds on the host, which
  // a buffer counting them on the device would not follow.)
  void dispatchSend(const LowLatencyDispatchArgs& a, uint32_t round);
  void dispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round);
  void combineSend(const LowLatencyCombineArgs& a, uint32_t round);
  void combineRecv(const LowLatencyCombineArgs& a, uint32_t round);

  // ---- stream-ordered low-latency calls (ep/ll_stream.cc) ----
  // A GPU buffer with MC_EP_STREAM_CALLS on (auto: on the CUDA layer): dispatch and combine
  // queue their kernels on the buffer's own stream behind an event of the caller's `stream`
  // and return; nothing waits on the host (DeepEP's model). validate(a, false) then checks
  // the shapes only: the kernels check topk_idx and the handle (kBadTopk, kBadHandle) and
  // write nothing out of bounds. Each call's outcome (silent sources, ranks that gave the
  // round up, errors) is copied by the stream into host memory and reported by the first
  // checkStreamCalls() after its kernels ran: at the next call, or when the caller waits.
  bool streamCalls() const { return stream_calls_; }
  enum class StreamPart { kSend, kRecv, kBoth };
  // Queues `part` of the call (kRecv: a hook's, after kSend of the same call) on the buffer's
  // stream after the work queued on `stream` so far (a CUstream of the caller's, or the
  // layer's kCopyStream); then, unless `detach`, makes `stream` wait for it. Returns the event
  // after it. `keep` lives until the part ran (the caller's tensors).
  std::shared_ptr<engine::device::Event> streamDispatch(const LowLatencyDispatchArgs& a,
                                                        uint32_t round, StreamPart part,
                                                        const void* stream, bool detach,
                                                        std::shared_ptr<void> keep);
  std::shared_ptr<engine::device::Event> streamCombine(const LowLatencyCombineArgs& a,
                                                       uint32_t round, StreamPart part,
                                                       const void* stream, bool detach,
                                                       std::shared_ptr<void> keep);
  // Hooks (return_recv_hook), every path: at most two calls of a kind are in flight (the
  // buffer's halves, DeepEP's double buffering). A send whose receive waits for its hook
  // holds its round's half until the hook ran, failed or was dropped: a third call of the
  // kind would write its half's rows and signal words (on every rank alike) before the first
  // one's receive read them. (Across ranks the read marks below guard the halves.) claimHalf
  // (with `round` reserved, before its send) throws std::invalid_argument when the half is
  // held, else marks it held when `hook`; releaseHalf frees it again if `round` holds it and
  // marks the half read (markRead).
  void claimHalf(const char* op, RoundKind kind, uint32_t round, bool hook);
  void releaseHalf(RoundKind kind, uint32_t round);
  // Read marks (host buffers; ep/read_marks.cc, docs/ep.md "Rounds and ordering"). markRead:
  // this rank is done with `round`'s half (its receive ran or failed, its hook was dropped,
  // or it gave the round up): the mark goes into its header and every peer's (a store into a
  // mapped peer's, else a notification its handler stores). awaitRead, before a send of `round`:
  // waits until every peer (with active: those not 0 there) marked
  // round - 2 of the kind read, so that the send cannot overwrite rows a peer has yet to read;
  // returns the peers that did not by `deadline` or were seen dead. Both do nothing on GPU
  // buffers.
  // awaitRead with `active` sets the late peers to 0 there (logged; op names the call);
  // without it gives the round up (abandon) and throws std::runtime_error naming the first
  // (normal mode).
  void markRead(RoundKind kind, uint32_t round);
  // True while the hook of `round`'s send holds its half.
  bool hookHolds(RoundKind kind, uint32_t round);
  // This rank's read mark of `round`'s half (host buffers).
  uint32_t readMark(RoundKind kind, uint32_t round) const;
  std::vector<int> awaitRead(const char* op, RoundKind kind, uint32_t round, int32_t* active,
                             engine::Deadline deadline);
  // markRead(kind, round) when it goes out of scope (thrown = true: only if by an exception,
  // for a send whose receive then does not run, and not while its hook holds the half).
  struct MarkOnExit {
    MarkOnExit(EpBuffer* b, RoundKind kind, uint32_t round, bool thrown);
    ~MarkOnExit();
    EpBuffer* b;
    RoundKind kind;
    uint32_t round;
    int exceptions;  // std::uncaught_exceptions() at construction, -1: mark in any case
  };
  // A stream call's hook dropped uncalled: releaseHalf, and what its send's kernels found
  // (kBadTopk) is reported by a later checkStreamCalls(), as its receive would have.
  void dropStreamHook(const char* op, RoundKind kind, uint32_t round);
  // Makes `stream` wait for `ev` (an event of streamDispatch/streamCombine).
  void streamWait(const void* stream, engine::device::Event& ev, const char* op);
  // Reports the calls whose kernels ran: logs silent sources, throws the first failure (an
  // earlier call's, named by op and round). Never waits.
  void checkStreamCalls();

  // ---- normal mode (ep/normal.cc) ----
  void validate(const NormalDispatchArgs& a) const;
  void validate(const NormalCombineArgs& a) const;
  // Sends, then waits for every source's row count; returns them (rows from rank r).
  std::vector<int32_t> normalDispatchSend(const NormalDispatchArgs& a, uint32_t round);
  // Copies the rows out (outputs sized by the counts' sum).
  void normalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                          const std::vector<int32_t>& counts, const NormalDispatchOutputs& o);
  void normalCombine(const NormalCombineArgs& a, uint32_t round);
  // Rows one source may send to one destination in normal mode with these shapes.
  int64_t normalCapacity(int64_t hidden, DType t, int topk) const;

  // ---- ordering of operations across threads ----
  // Runs fn after every operation enqueued before it, on the buffer's worker thread.
  std::shared_ptr<EpEvent> enqueue(std::function<void()> fn);
  // Runs fn on the calling thread once the queue is idle; rethrows its exception.
  void runSync(const std::function<void()>& fn);

  // Stores the signals a source posted to its mailbox of (half, kind) (the engine notify
  // handler's side; ep/peer_writer.h): `count` entries whose round's low 7 bits are
  // `round_bits`. Entries outside the signal words, or of another round, are dropped. False
  // when src, count or an entry is out of range.
  bool takeMailbox(int half, int kind, int src, uint32_t count, uint32_t round_bits);
  // A read mark from an engine peer (markRead; the handler's side): src's mark of the half
  // of `round_bits` moves up to the round with those low 21 bits, never down (notifications
  // may arrive out of order).
  void takeReadMark(int kind, int src, uint32_t round_bits);

  class Writer;  // ep/peer_writer.h
  class Proxy;   // ep/ll_proxy.h

 private:
  EpBuffer() = default;
  static uint64_t randomKey();  // never 0
  // Before the set-up exchange: waits (MC_EP_TIMEOUT_MS at most) until this rank's writes to
  // its peers, an earlier buffer's that calls gave up on included (Writer::flush), finished.
  // Rounds start over at 1 in a new buffer, which may get the old one's address at a peer, so
  // a late WRITE of an old round's rows or mailbox entries would pass for the new round's.
  // Returns 0, or 1 + the first rank whose writes still run.
  uint64_t settleEarlierWrites() const;
  void setUp(size_t bytes);
  // Collective: every rank's segment descriptor (after this rank registered its memory) goes
  // to the ranks in `update` (engine peers updated); returns each rank's engine id.
  std::vector<uint64_t> exchangeSegments(const std::vector<char>& update);
  // Collective: installs this buffer as the EP notification target of key_; every rank
  // throws alike when one could not (another buffer of its process had the key's low bits)
  // or says it `failed` an earlier step (the reason, thrown on that rank). undo runs first on
  // this rank then.
  void joinSignalTargets(const std::function<void()>& undo, const std::string& failed = "");
  // Where rank r (not mapped) takes this rank's signal entries of (half, kind) from, in its
  // process: its buffer's mailbox, or for a GPU buffer its proxy's host words.
  uint64_t mailboxAddress(int r, int half, int kind) const;
  std::atomic<uint64_t>* signalWord(size_t off) {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + off);
  }
  std::atomic<uint32_t>* doorbell() {
    return reinterpret_cast<std::atomic<uint32_t>*>(base_ + geo_.doorbell());
  }
  // Waits for `arrived` to be true for each rank in `pending` (removing them as it calls
  // on_arrival). At the deadline, or when a rank's peer is dead, calls on_silent(rank).
  void waitSources(std::vector<int>& pending, engine::Deadline deadline,
                   const std::function<bool(int)>& arrived,
                   const std::function<void(int)>& on_arrival,
                   const std::function<void(int)>& on_silent);
  kern::LlArgs kernelArgs(uint32_t round, RoundKind kind, int experts, int64_t max_tokens,
                          int64_t hidden, DType dtype) const;
  kern::LlArgs kernelArgs(const LowLatencyDispatchArgs& a, uint32_t round) const;
  kern::LlArgs kernelArgs(const LowLatencyCombineArgs& a, uint32_t round) const;
  void kernelDispatchSend(const LowLatencyDispatchArgs& a, uint32_t round);
  void kernelDispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round);
  void kernelCombineSend(const LowLatencyCombineArgs& a, uint32_t round);
  void kernelCombineRecv(const LowLatencyCombineArgs& a, uint32_t round);
  kern::NormalArgs normalArgs(uint32_t round, RoundKind kind, int topk, int64_t hidden,
                              DType dtype) const;
  // normalArgs() with a dispatch call's inputs.
  kern::NormalArgs normalArgs(const NormalDispatchArgs& a, uint32_t round) const;
  // ... and with a combine call's.
  kern::NormalArgs normalArgs(const NormalCombineArgs& a, uint32_t round) const;
  std::vector<int32_t> kernelNormalDispatchSend(const NormalDispatchArgs& a, uint32_t round);
  void kernelNormalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                                const std::vector<int32_t>& counts, const NormalDispatchOutputs& o);
  void kernelNormalCombine(const NormalCombineArgs& a, uint32_t round);
  // Normal mode's waits: throws for a rank that gave up, then for the first silent one.
  void kernelNormalOutcome(const char* op, uint32_t round, const std::vector<int32_t>& decision);
  // Normal mode's error for a source that sent nothing: its process is gone (the engine said
  // so), or nothing came within MC_EP_TIMEOUT_MS.
  std::string silentError(const char* op, int r) const;
  // Logs the silent sources of a kernel call, throws for the ones that gave up the round.
  void kernelOutcome(const char* op, uint32_t round, const std::vector<int32_t>& decision,
                     const std::vector<int32_t>& was_active);
  // Throws the error a call's kernels left in their error word (LlArgs/NormalArgs::error), if
  // any, as the host paths word it (op: "dispatch", "combine", "normal_dispatch" or
  // "normal_combine"; counts and capacity: a normal dispatch's).
  void throwKernelError(const char* op, const int32_t* error, int64_t max_tokens = 0,
                        const int32_t* counts = nullptr, int64_t capacity = 0) const;
  // Rows [first, first+n) of recv_x (and, fp8, recv_scales) from n wire rows at src.
  static void storeRecvRows(const LowLatencyDispatchArgs& a, int64_t first, const char* src,
                            size_t src_stride, int64_t n, bool stream);
  bool peerDead(int r) const;
  // A peer seen dead may have sent everything just before it went: its signal message can
  // still be queued in this engine behind the notice of its death. Waits allow this long.
  static constexpr std::chrono::milliseconds kDeadPeerGrace{100};
  static constexpr int64_t kGoneGraceUs =
      std::chrono::duration_cast<std::chrono::microseconds>(kDeadPeerGrace).count();
  static constexpr int kThreadLanes = 4;  // lanes a block under MC_EP_KERNELS=threads
  // The kernels' view of dead ranks (ll_kernels.h, "Dead ranks"): gone_[r] is set to 1 by the
  // engine's peer-gone handler for rank r's engine (and, for a rank already dead when the
  // buffer was made, at set-up); the kernel waits read it while they run.
  void watchPeers();
  // ---- device mode (ep/ll_device.cc) ----
  void setUpDevice(size_t bytes);
  bool freeDevice();  // false: kernels still queued (the memory stays)
  void deviceCopy(void* dst, const void* src, size_t len, const char* op) const;
  // n elements of GPU memory at p, on the host (int64_t, int32_t and uint8_t: ll_device.cc).
  template <class T>
  std::vector<T> hostCopy(const T* p, int64_t n, const char* op) const;
  char* deviceScratch(size_t toks_bytes);
  kern::LlLaunch deviceLaunchArgs(kern::LlArgs p, int experts, uint32_t round);
  kern::NormalLaunch deviceNormalLaunch(kern::NormalArgs p, int64_t rows, RoundKind kind);
  void deviceLaunch(kern::LlLaunch l, kern::LlStage stage, unsigned grid, const char* op);
  void deviceLaunch(kern::NormalLaunch l, kern::NormalStage stage, unsigned grid, const char* op);
  void deviceSync(const char* op, engine::Deadline deadline);
  // The host's bound on a call's waiting kernels: timeout_us and the dead-peer grace, with
  // slack_ms more; none when timeout_us < 0 (the kernels end by their sources or dead flags).
  static engine::Deadline waitBound(int64_t timeout_us, int64_t slack_ms);

  // Queues a send's kernels (either mode) on the buffer's stream; with rounds on the device
  // the send's last block takes the round (a send has E or R >= 1 blocks). With
  // ranks on other hosts (ll_proxy.h): first the wait for the proxy to have moved its stage's
  // last rows (on the host, or a stage of its own with rounds on the device), then the proxy
  // is given this send's job (by the host, or by the send's last block). *launched (if
  // given) turns true once a kernel is queued.
  template <class Launch, class Stage>
  void deviceSend(const Launch& l, Stage stage, RoundKind kind, int64_t grid, const char* op,
                  bool* launched = nullptr);
  // (setUpDevice) The host proxy for the ranks on other hosts; a failure goes to *error.
  void setUpProxy(const std::vector<char>& proxied, uint64_t key, std::string* error);
  std::vector<int32_t> deviceOutcome(const kern::LlLaunch& l, int32_t error[2], const char* op);
  void deviceDispatchSend(const LowLatencyDispatchArgs& a, uint32_t round);
  void deviceDispatchRecv(const LowLatencyDispatchArgs& a, uint32_t round);
  void deviceCombineSend(const LowLatencyCombineArgs& a, uint32_t round);
  void deviceCombineRecv(const LowLatencyCombineArgs& a, uint32_t round);
  void deviceAbandon(RoundKind kind, uint32_t round);
  // Rounds on the device (ep/kernels/device_rounds.h; stream-ordered calls on one host): the
  // launch's offsets for half 0 and its round from the call's slot (a send's stage: from
  // words[kind] + 1, set by deviceSend). Nothing without them.
  template <class Launch>
  void deviceRoundsFor(Launch& l, RoundKind kind, uint32_t round) const;
  // Queues kStageWait or kAbandonRound (one block) with `rounds`.
  void deviceRoundStage(kern::LlStage stage, kern::DeviceRounds rounds, const char* op);
  std::string setUpStream();  // "" or why not
  bool freeStream();          // false: the stream's kernels did not run out (keep the memory)
  const void* kernelStream() const;
  // A stream call's outcome words in the scratch (error[2], then decision[R]), per kind and
  // half: a dispatch's send and its hook's receive may have other calls between them.
  int32_t* streamOutcome(RoundKind kind, uint32_t round);
  // The engine's device layer, or std::runtime_error naming op and this rank.
  engine::device::Device* deviceLayer(const char* op) const;
  struct StreamReport;  // (ep/ll_stream.cc)
  // Logs and throws what a queued call's outcome words say once its kernels ran.
  void pendingFailure(const StreamReport& r);
  // (args: the launch's arguments, made under the lock: the scratch may grow.)
  std::shared_ptr<engine::device::Event> streamQueue(const char* op, RoundKind kind,
                                                     uint32_t round, StreamPart part,
                                                     const std::function<kern::LlLaunch()>& args,
                                                     int send_grid, const void* stream,
                                                     bool detach, std::shared_ptr<void> keep);
  std::vector<int32_t> deviceNormalDispatchSend(const NormalDispatchArgs& a, uint32_t round);
  void deviceNormalDispatchRecv(const NormalDispatchArgs& a, uint32_t round,
                                const std::vector<int32_t>& counts, const NormalDispatchOutputs& o);
  void deviceNormalCombine(const NormalCombineArgs& a, uint32_t round);
  // (normal_device.cc) prepare() makes a normal-mode send's launch; it is sent, and a failure
  // before the send was queued still takes the round on the device (given up). The scratch.
  template <class Prepare>
  Scratch sendOrGiveUp(RoundKind kind, uint32_t round, Prepare prepare, kern::NormalStage stage,
                       const char* op);
  bool abandoned(RoundKind kind, uint32_t round, int r);
  // Wraps a wait's arrival test so that a source that gave up the round counts as arrived
  // (recorded in *gave_up instead of handled); throwIfAbandoned() then reports them.
  std::function<bool(int)> orAbandoned(RoundKind kind, uint32_t round,
                                       std::function<bool(int)> arrived);
  std::function<void(int)> unlessAbandoned(RoundKind kind, uint32_t round,
                                           std::function<void(int)> on_arrival,
                                           std::vector<int>* gave_up);
  void throwIfAbandoned(const char* op, uint32_t round, const std::vector<int>& gave_up) const;
  void workerLoop();

  EpGroup g_;
  BufferGeometry geo_;
  char* base_ = nullptr;
  uint64_t key_ = 0;
  std::vector<uint64_t> engine_ids_;      // each rank's engine id (its segment's)
  std::unique_ptr<int32_t[]> gone_;       // kernel path on host memory: watchPeers()
  int32_t* gone_ptr_ = nullptr;           // the flags the kernels read (gone_, or host words)
  int device_ = -1;                       // device mode: the ordinal
  std::vector<void*> opened_;             // device mode: peers' allocations opened here
  char** dev_peers_ = nullptr;            // device mode: mapped_ in GPU memory
  char* scratch_ = nullptr;               // device mode: the kernels' scratch
  uint32_t* dev_rounds_ = nullptr;        // device rounds: kern::kDeviceRoundWords words
  bool device_rounds_ = false;            // the kernels count the rounds (deviceRoundsFor)
  size_t scratch_bytes_ = 0;
  // device mode: the kernels' stream (ep/ll_stream.cc; the layer's copy stream when null)
  const void* stream_ = nullptr;
  bool stream_calls_ = false;         // MC_EP_STREAM_CALLS resolved
  uint32_t* report_words_ = nullptr;  // stream calls: host words the outcomes are copied to
  uint32_t* zero_words_ = nullptr;    // ... and zeroed host words the scratch is reset from
  std::vector<int> free_reports_;     // report slots not in use
  std::deque<std::shared_ptr<StreamReport>> reports_;  // queued calls, oldest first
  std::exception_ptr late_failure_;  // one taken off to free its slot, for the next check
  uint32_t hook_pending_[2][2] = {};  // [kind][half]: round + 1 of a send whose hook waits
  // [kind][half]: a round given up while a hook held its half; marked read with the hook's.
  uint32_t given_up_[2][2] = {};
  bool capturing_call_ = false;  // the last stream call was queued under CUDA-graph capture
  bool hook_captured_[2][2] = {};  // [kind][half]: the send whose hook waits was captured
  std::vector<std::shared_ptr<void>> graph_keep_;  // captured calls' tensors (replays use them)
  std::mutex stream_mu_;              // (hook_pending_ and given_up_ too)
  // claimHalf's check, with stream_mu_ held.
  void checkHalfLocked(const char* op, RoundKind kind, uint32_t round) const;
  uint64_t gone_handler_ = 0;             // its engine peer-gone handler (0: none)
  std::unique_ptr<Proxy> proxy_;          // device mode, a group spanning hosts (ll_proxy.h)
  // Stops the proxy (drained: after the moves queued) and leaves the notification target.
  void endProxy(bool drained);
  std::vector<char*> mapped_;     // local view of each rank's buffer, nullptr if remote
  bool disable_p2p_ = false;
  std::vector<uint64_t> remote_;  // each rank's buffer address in its own process
  uint32_t dispatch_round_ = 0;
  uint32_t combine_round_ = 0;
  int64_t spin_us_ = 20;
  int64_t timeout_ms_ = 30000;
  // recv_x (both modes) at least this large is written with streaming stores
  // (MC_PG_STREAM_OUT_BYTES: the same rule as the process group's large outputs).
  int64_t stream_out_bytes_ = 4 << 20;
  int kernel_lanes_ = 0;                // MC_EP_KERNELS: cpu 0, host 1, threads kThreadLanes
  std::vector<int32_t> self_count_[2];  // kernel path: own rows per local expert, per half

  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::function<void()>> q_;
  bool q_busy_ = false;
  bool q_stop_ = false;
  std::thread worker_;

  friend class Writer;
  friend class Proxy;
};

}  // namespace mooncake::ep
