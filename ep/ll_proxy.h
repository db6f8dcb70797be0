// EpBuffer::Proxy: the host proxy of a GPU buffer whose group spans hosts (ep/buffer.h,
// "Device mode"; the kernels' side: ep/kernels/README.md, "Proxied ranks").
//
// Ranks on this host are opened through CUDA IPC and stored into by the kernels, as before.
// A rank on another host is left null in the kernels' peers table: a send's kernels stage
// what they would have stored in this rank's GPU memory (one stage per (kind, half)) and post
// (round, rows) in host-mapped words; the proxy thread picks each word up, moves the staged
// rows with the engine's one-sided WRITEs straight from the registered stage into the peer's
// registered GPU buffer (rdma with GPUDirect where there is one, else tcp, staged through
// host memory by the engine), and the peer's signal words through its mailbox + notify()
// (EpBuffer::Writer), which the engine delivers only after the rows. The peer's handler
// (takeMailbox) stores them into its host-mapped shadow of the signal words (`ctrl`), where
// its kernels read a proxied source's signals and abandon words.
//
// The host-mapped area, per buffer (registered with the engine, so peers WRITE mailboxes
// into it):
//   shadow[2 halves]   each: the half's signal words, then its mailboxes, at their offsets in
//                      the buffer's half (ep/layout.h): the kernels' ctrl of that half
//   words[kind][half]  kMaxSignals u64 proxy words ([dest][l] of a low-latency call, [dest]
//                      of a normal-mode one)
//   done[kind][half]   u32: the last round of (kind, half) whose staged rows were moved
//   taken, stopped     u32 each: jobs taken from the ring; nonzero once the proxy stopped
//   ring               kern::kProxyRingSlots jobs (kern::ProxyJob)
// A stage is reused by the next send of its (kind, half), two rounds later; that send first
// waits until the proxy moved the previous one: on the host (a buffer with waited calls: the
// host hands the proxy each send's job) or, with rounds counted on the device (a buffer with
// stream-ordered calls, its normal-mode calls too), in a one-block stage before the send
// (kern::kStageWait); there the kernels hand the proxy its jobs through the ring
// (the send's last block posts its job), so that a send replayed from a CUDA graph is moved as its
// first run was, and no host thread waits per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ep/buffer.h"
#include "ep/kernels/ll_entry.h"

namespace mooncake::ep {

class EpBuffer::Proxy {
 public:
  // Allocates the area and the stages and registers them, and the buffer, with the group's
  // engine. Throws std::runtime_error naming what failed.
  explicit Proxy(EpBuffer& buf);
  ~Proxy();  // stop(false); gives the memory back (the caller leaks a Proxy whose memory
             // kernels may still use: EpBuffer::endProxy)
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  uint64_t areaAddress() const { return reinterpret_cast<uint64_t>(area_); }
  // Where rank r's area is in its process (exchanged at set-up).
  void setPeerAreas(std::vector<uint64_t> areas) { peer_areas_ = std::move(areas); }
  // Rank r's mailbox of (half, kind) for this rank, in r's process.
  uint64_t remoteMailbox(int r, int half, int kind) const;
  // The kernels' stage, proxy words and ctrl for a call of (kind, round) (either mode: the
  // same stages, as the rounds are the same).
  template <class Args>
  void fill(Args& p, RoundKind kind, uint32_t round) const;
  // Before a waited call's send of (kind, round) queues its kernels: the rows its stage held
  // two rounds ago have been moved (a wait here; std::runtime_error after twice
  // MC_EP_TIMEOUT_MS). With rounds on the device a stage waits instead (kern::kStageWait).
  void stageFree(RoundKind kind, uint32_t round, const char* op);
  // After a send's kernels were queued with args p (fill's): moves what they post. `sent`:
  // an event after them (how the proxy knows a word that is not there will not come; null:
  // a word is waited for MC_EP_TIMEOUT_MS at most).
  void moveSend(const kern::LlArgs& p, RoundKind kind, std::shared_ptr<engine::device::Event> sent);
  void moveSend(const kern::NormalArgs& p, RoundKind kind,
                std::shared_ptr<engine::device::Event> sent);
  // Tells every proxied rank that this rank gave `round` up (its abandon word).
  void abandon(RoundKind kind, uint32_t round);
  // Rounds on the device: the kernels' words and strides for the proxy (the args are then
  // filled for half 0: fill(p, kind, 0)), and the thread takes jobs from the ring.
  void fillDeviceRounds(kern::DeviceRounds& d);
  // A send's job was queued on the stream: the thread polls the ring closely again (a replayed
  // send has nobody to say so: the thread's polls then nap up to 100 us when idle).
  void kick();
  // The host words standing for buffer offset `off` in the signal words or mailboxes of
  // either half (EpBuffer::takeMailbox: where a GPU buffer's notifications are taken).
  char* shadowAt(size_t off) const;
  // Ends the thread: after the queued moves (drained: the kernels of every queued send ran),
  // or at once, leaving the rest unmoved.
  void stop(bool drained);

 private:
  struct Job {
    bool abandon = false, normal = false;
    RoundKind kind = RoundKind::kDispatch;
    uint32_t round = 0;
    kern::LlArgs p;        // a low-latency send's
    kern::NormalArgs np;   // a normal-mode send's
    std::shared_ptr<engine::device::Event> sent;
  };
  void init();     // (the constructor's body)
  void release();  // gives back what init() got (undone in reverse; idempotent)
  static size_t shadowHalfBytes();
  // Offset in the area of buffer offset `off` in the signal words or mailboxes of half h.
  size_t shadow(int h, size_t off) const;
  uint32_t* ctl() const;  // the kernels' DeviceRounds::ctl: done[kind][half], taken, stopped
  uint32_t* doneWord(int kind, int half) const;
  kern::ProxyJob* ring() const;  // kern::kProxyRingSlots jobs, after ctl's kern::kCtlWords
  void loop();
  // The ring's next job, if posted: taken (true) into *j.
  bool takeRingJob(Job* j);
  void runSend(const Job& j);
  void runAbandon(const Job& j);
  // Queues the moves of (o, l)'s staged rows; false when they could not be (nothing sent).
  bool moveDispatch(Writer& w, const kern::LlArgs& p, int o, int l, uint32_t n);
  // A combine's rows for r, every local expert's at once (n[l]: rows of expert l).
  bool moveCombine(Writer& w, const kern::LlArgs& p, int r, const uint32_t* n);
  // Normal mode: stage block [o] to o's block [me] of the call's region, then o's signal.
  bool moveNormal(Writer& w, const kern::NormalArgs& p, bool dispatch, int o, uint32_t n);
  void push(Job j);

  EpBuffer& buf_;
  char* area_ = nullptr;  // host-mapped (Device::allocHostWords), reused by later buffers
  size_t area_bytes_ = 0;
  char* stage_ = nullptr;  // GPU memory: [kind][half] stages of stage_bytes_
  size_t stage_bytes_ = 0;
  bool registered_buffer_ = false, registered_stage_ = false, registered_area_ = false;
  std::vector<uint64_t> peer_areas_;
  std::vector<char> proxied_;  // [R]: 1 for a rank on another host

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  uint32_t queued_[2][2] = {};   // [kind][half]: the last round whose send was queued
  int pending_[2][2] = {};       // ... and sends of it not moved yet
  bool stop_ = false, abort_ = false;
  std::atomic<bool> ring_{false};  // fillDeviceRounds was asked: the kernels post jobs
  bool kicked_ = false;     // kick() since the thread last looked
  uint32_t ring_taken_ = 0;  // (the thread's)
  int64_t delay_ms_ = 0;  // MC_EP_PROXY_DELAY_MS (tests)
  std::thread thread_;
};

}  // namespace mooncake::ep
