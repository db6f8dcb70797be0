// Stream-ordered send/recv of GPU memory in same-host groups (the collectives' counterpart:
// pg/stream_ops.h). A send or recv is queued on a stream of the engine's (one per peer and
// direction, made by the device layer) after an event on the caller's stream, so it starts once
// the caller's earlier work did, runs beside the caller's later work (NCCL runs p2p on streams of
// its own too), and no host thread waits for it: Work.wait() makes the caller's stream wait on
// an event recorded after it. A send never waits for a recv to another peer, nor for the recv
// in the other direction, so rings and exchanges of any size do not deadlock.
//
// Each rank owns one allocation of GPU memory that its peers open through the device layer's
// IPC (published in the comm buffer's header, ShmGroup::P2pInfo):
//
//   [words: per peer r, `posted` at r*128 (chunks r staged for this rank), `freed` at r*128+64
//    (chunks of this rank's to r that r copied out)] [per peer d: two slots of S bytes]
//
// A message is cut into chunks of S bytes (the sender's MC_PG_STREAM_P2P_SLOT_BYTES), numbered
// per direction from 1 over the group's life (c below). Chunk c of a send from s to d, on s's
// stream to d: wait until s's own freed[d] >= c - 2 (d is done with the slot); copy the chunk into
// s's slot (d, c & 1); write c into d's posted[s]. On d's stream from s: wait until its own
// posted[s] >= c; copy the chunk out of s's slot (d, c & 1) into the output; write c into s's
// freed[d]. So only a rank's own stream writes its slots, and messages of at most 2S bytes
// leave without waiting for the receiver (eager).
//
// Messages between two ranks match in order, one direction at a time, as NCCL's do (tags are
// not used to pick a message: a recv takes the next message from its source). The sender notes
// each message's size and tag in its header (ShmGroup::P2pNote, a ring of kP2pRing per
// receiver) when it queues the message; the receiver's host checks the note when its recv is
// finished (and while it waits): another size or tag fails the group with an error naming both
// ranks and both calls (a size mismatch has already put the two streams out of step).
//
// No op waits on the issuing thread for another rank. An op that cannot be queued yet stays
// pending (its event on the caller's stream recorded), and so does every later op of its
// direction: a peer that has not made its area yet (a rank makes and publishes it at its first
// stream-ordered send or recv), or a send whose note would reuse one the receiver has not
// checked (kP2pRing messages ahead of it). Pending ops are queued, in order, by a thread of
// the group's that polls them while any are (started at the first), by the next issue that
// finds them queueable, or by the thread that finishes one of them (finish() waits on the host
// for what holds it, to report it); orderAfter() on a pending op makes the stream wait on a gate
// (a host word, engine::device::Gate) that the op's stream opens after the op once queued. A rank
// that cannot set up (no stream memory operations, no IPC) publishes that, and its peers' ops
// to it fail naming the cause.
//
// Failures as the collectives': finish() waits for the op's event checking the peers' health,
// abort words and the group timeout; on a failure it fails the group (its host groups aborted)
// and releases this rank's streams (stores every word it waits on past every chunk), then waits
// up to 5 s for the op's remaining steps. A group's end waits (up to 5 s, not for dead peers)
// until every receiver copied out what this rank staged for it, then frees its area.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/device/device.h"
#include "pg/communicator.h"
#include "pg/health.h"

namespace mooncake::pg {

class StreamP2p {
 public:
  enum State : uint32_t { kNone = 0, kPublished = 1, kUnusable = 2 };
  struct Ticket {
    int peer = -1;
    bool send = false;
    uint64_t msg = 0;  // its number in its direction, from 1
    size_t bytes = 0;
    uint64_t tag = 0;
    void* buf = nullptr;  // the input (send) or output (recv)
    OpCtx op{};
    std::unique_ptr<engine::device::Event> ready;  // on the caller's stream when issued
    std::unique_ptr<engine::device::Event> done;   // on the direction's stream (once queued)
    // Guarded by its direction's mutex: queued; finished (finish() returned or threw); the
    // gates orderAfter() put on streams while it was pending (opened after it by its stream,
    // and by finish() on the host).
    bool queued = false;
    bool touched = false;  // queue() put some of it on its stream (maybe not all: it failed)
    bool finished = false;
    std::vector<engine::device::Gate> gates;
  };

  explicit StreamP2p(Communicator::Impl& c);
  ~StreamP2p();
  StreamP2p(const StreamP2p&) = delete;
  StreamP2p& operator=(const StreamP2p&) = delete;

  // Issues a send of `bytes` at buf to `peer` (or a recv into buf from it) after the caller's
  // work so far on `stream` of device `ordinal`. Null, with nothing issued, when this rank could
  // not set the path up (the caller sends host-driven). Throws UsageError (another device than
  // the first op's), CommError (a failed group, a queueing failure).
  std::shared_ptr<Ticket> send(const void* buf, size_t bytes, int peer, uint64_t tag,
                               int ordinal, const void* stream);
  std::shared_ptr<Ticket> recv(void* buf, size_t bytes, int peer, uint64_t tag, int ordinal,
                               const void* stream);
  // Waits until the op is done (queueing it first while pending), then checks it (above).
  // Throws CommError. Once per ticket, from any thread.
  void finish(Ticket& t);
  // Queues on `stream` (of the op's device) a wait for the op's end; no host wait.
  Status orderAfter(Ticket& t, const void* stream);
  uint64_t issued() const { return issued_.load(std::memory_order_relaxed); }  // (tests)

 private:
  struct Lane;  // one direction with one peer
  std::shared_ptr<Ticket> issue(bool send, void* buf, size_t bytes, int peer, uint64_t tag,
                                int ordinal, const void* stream);
  bool setUp(int ordinal, const char* op);  // this rank's area (mu_ held); false: unusable
  // Opens `peer`'s area if it published it (wait_for: until it does, on the host, to its
  // deadline). False: not yet. Throws CommError (unusable peer, timeout, dead peer).
  bool openPeer(int peer, const OpCtx* wait_for);
  // Whether a send of message `msg` to `peer` may reuse its note (wait_for: waits on the host).
  bool noteFree(int peer, uint64_t msg, const OpCtx* wait_for);
  // Queues l's pending ops in order while they can be (l.mu held by lk). wait_for: waits on the
  // host (l.mu released meanwhile) for what holds them, until `until` is queued.
  void pump(Lane& l, std::unique_lock<std::mutex>& lk, const Ticket* until,
            const OpCtx* wait_for);
  void queue(Lane& l, Ticket& t);  // l.mu held, peer open, note free
  void checkNote(const Ticket& t, bool complete);
  void fail(Ticket& t, const CommError& e);
  void closeTicket(Ticket& t);  // finished: its gates opened
  void release();
  uint32_t* word(char* base, int r, bool freed) const;
  char* slot(char* base, size_t slot_bytes, int to, uint64_t chunk) const;
  Lane& lane(int peer, bool send);
  bool drain();  // the group's end (above); false: a stream did not run out
  // The thread that queues pending ops (started by the first kick()).
  void kick();
  void pumpLoop();

  Communicator::Impl& c_;
  const size_t slot_bytes_;
  const size_t words_bytes_;
  std::mutex mu_;  // setup
  int state_ = -1;  // -1: not set up; kPublished (usable) / kUnusable
  int ordinal_ = -1;
  char* own_ = nullptr;
  std::mutex open_mu_;  // opening peers' areas
  std::vector<std::atomic<char*>> peer_base_;  // peers' areas as mapped here
  std::vector<size_t> peer_slot_;              // their slot sizes (set before peer_base_)
  std::vector<void*> opened_;                  // their IPC mappings, to close
  std::vector<std::unique_ptr<Lane>> lanes_;   // [peer * 2 + send]
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> issued_{0};
  std::mutex pump_mu_;  // below
  std::condition_variable pump_cv_;
  bool kicked_ = false;
  bool stop_ = false;
  std::thread pumper_;
};

}  // namespace mooncake::pg
