// Internals of the tcp transport shared by its source files: tcp_transport.cc (set-up, the
// progress loop, the initiator's API), tcp_conn.cc (connection I/O: output queues, the input
// state machine, completion and failure, inbox delivery) and tcp_target.cc (the target side of
// WRITE and READ, and its fence against a region's removal). Not part of the engine's API.
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/transport/tcp/tcp_admission.h"
#include "engine/transport/tcp/tcp_transport.h"

namespace mooncake::engine::tcp {

constexpr uint64_t kWakeId = 0;
constexpr uint64_t kListenId = 1;
constexpr size_t kReadBudget = 16u << 20;  // bytes per connection per wake-up (fairness)
// A payload at least this long is read with the connection's queued frames sent first.
constexpr size_t kUncorkBytes = 256u << 10;

inline std::string hexId(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

inline std::string labelOf(const SegmentDesc& d) {
  std::ostringstream os;
  os << "'" << d.name << "' (engine " << hexId(d.engine_id) << ", " << d.tcp_host << ":"
     << d.tcp_port << ")";
  return os.str();
}

// One request being served, counted down by its slices.
struct TaskState {
  Task* task;
  uint64_t remaining;
  Status status;
};

struct Slice {
  TaskState* ts;
  OpCode op;
  uint64_t offset;
  uint64_t len;
};

// Under PeerState::mu: a READ slice whose response goes to the discard sink, its task being
// abandoned (Core::fenceAbandoned): the task completes with this rather than OK.
inline void abandonSliceLocked(const Slice& s) {
  if (s.ts->status.ok())
    s.ts->status = Status(Code::kCancelled,
                          "tcp: a READ response was discarded: its caller gave up waiting");
}

struct OutItem {
  uint8_t hdr[kHeaderBytes];
  std::string owned;           // payload copied in (messages, handshakes)
  const char* data = nullptr;  // or: payload in user / registered memory (zero copy)
  size_t len = 0;
  size_t off = 0;  // bytes of header + payload already sent
  // `data` lies in a registered host region of this engine (a READ response): copied into
  // `owned` if the region goes before the frame is out (Core::regionRemoved).
  bool from_region = false;
  const char* payload() const { return owned.empty() ? data : owned.data(); }
};

struct PeerState;

struct Conn {
  uint64_t id = 0;
  int fd = -1;
  bool active = false;  // opened by this engine (initiator side)
  ConnRole role = ConnRole::kControl;
  std::weak_ptr<PeerState> peer;  // initiator side
  // Target side, set by the HELLO (and DESC on a control connection).
  std::string src_addr;   // the peer's address (admission accounting)
  Deadline handshake_by{};  // closed unless authenticated by then
  bool authed = false;
  bool have_desc = false;
  bool denied = false;  // wrong secret: answered, input discarded until it closes
  std::string challenge;  // the nonce of our CHALLENGE, until the HELLO that answers it
  bool bye = false;
  bool leaving = false;  // either side: the peer's engine said it is stopping
  uint64_t src_engine = 0;
  std::string src_name;
  uint64_t link = 0;   // the initiator's link id (both sides)
  uint32_t index = 0;  // this connection's index in its link (0: control)
  // Output: any thread, under out_mu. `closed` is written only by the progress thread (or
  // by stop() after it ended), always under out_mu.
  std::mutex out_mu;
  std::deque<OutItem> outq;
  bool out_armed = false;
  // Set while the progress thread reads the connection: frames queued meanwhile (its acks,
  // or a sender's) wait for the end of the read, which writes them together (see onReadable).
  bool corked = false;
  bool closed = false;
  bool broken = false;
  int send_errno = 0;  // why a send broke it (the read side then sees only EOF)
  uint64_t writes_queued = 0;  // WRITE frames queued on it so far (initiator side)
  // Input state machine: progress thread only.
  uint8_t hdr[kHeaderBytes];
  size_t hdr_got = 0;
  FrameHeader cur;
  bool in_payload = false;
  enum class Sink { kMemory, kDiscard, kBuffer } sink = Sink::kMemory;
  char* dst = nullptr;
  // An inbound WRITE's payload into registered host memory (kMemory sink): each recv() into it
  // runs under MemoryRegistry::intoRegion, so that the region cannot be freed under it.
  bool guarded = false;
  // The registration an admitted WRITE targets (kMemory: for those recv()s; kBuffer, GPU
  // memory: for the device copy at its end).
  RegionCheck region;
  uint64_t left = 0;
  std::string buf;
  Code verdict = Code::kOk;
};

class Core;

// An exchange (XCHG) waiting for its answer.
struct ExchangeWait {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::string answer;
};

// Target side, progress thread only: per initiator link, how many WRITE frames each of its
// data connections delivered, and the NOTIFYs waiting for more.
struct LinkState {
  struct Held {
    std::vector<uint64_t> watermarks;  // index i-1: data connection i
    uint32_t channel;
    uint64_t tag;
  };
  std::vector<uint64_t> writes_done = std::vector<uint64_t>(kMaxDataConns + 1, 0);
  std::deque<Held> held;
};

struct PeerState {
  std::shared_ptr<Core> core;
  std::string label;
  uint64_t engine_id = 0;
  uint64_t link = 0;                         // random id sent in every HELLO of this peer
  std::vector<std::shared_ptr<Conn>> conns;  // [0] control, then data; fixed after connect
  std::mutex mu;                             // guards everything below
  SegmentDesc remote;
  bool failed = false;   // no new work; `why` says why
  bool cleaned = false;  // connections closed and requests failed (progress thread)
  Status why;
  uint64_t next_req = 1;
  size_t rr = 0;
  std::unordered_map<uint64_t, Slice> slices;
  uint64_t next_xchg = 1;
  std::unordered_map<uint64_t, std::shared_ptr<ExchangeWait>> exchanges;
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  explicit Core(int data_conns) : data_conns_(std::max(0, data_conns)) {}

  Status start(EngineContext* ctx);
  void stop();
  void fill(SegmentDesc* d) {
    d->tcp_host = host_;
    d->tcp_port = port_;
    d->transports |= 1u << static_cast<int>(TransportKind::kTcp);
  }
  Result<std::shared_ptr<PeerState>> connect(const SegmentDesc& remote, Deadline deadline,
                                             bool data);
  void submit(PeerState& p, Task* t);
  Status notify(PeerState& p, uint32_t channel, uint64_t tag);
  Result<std::string> exchange(PeerState& p, TransportKind kind, std::string_view request,
                               Deadline deadline);
  Status sendMessage(PeerState& p, uint32_t channel, std::string_view payload);
  Status sendMessage(PeerState& p, uint32_t channel, std::string&& payload);
  void fail(const std::shared_ptr<PeerState>& p, const Status& why);
  // TransportPeer::fenceAbandoned, on the progress thread (waited for): a READ response of an
  // abandoned task being received goes on into the discard sink (frameStart sends the later
  // ones there), and WRITE frames of such tasks still queued take a copy of what they still
  // have to send (as regionRemoved). The connections stay up; the tasks complete when their
  // acks and responses come. Nothing of the peer reads or writes their buffers afterwards.
  void fenceAbandoned(const std::shared_ptr<PeerState>& p);
  void close(const std::shared_ptr<PeerState>& p);
  // A registered host region was removed from the registry; its memory is still mapped, but may
  // not be once this returns. READ responses still queued out of it take a copy of their
  // payload, so that each goes out whole (its header, with its length, may be out already) and
  // not from unmapped memory (EFAULT, which broke the connection and failed the peer).
  void regionRemoved(const Region& r);

 private:
  void loop();
  void wake() {
    uint64_t one = 1;
    ssize_t w = write(wake_fd_, &one, sizeof(one));
    (void)w;
  }
  void runOnLoop(std::function<void()> fn, bool wait);
  // desc: the serialized local descriptor, sent after HELLO_PROOF on a control connection (""
  // for a data connection).
  Result<int> openConn(const SegmentDesc& remote, const std::string& label,
                       const Hello& hello, const std::string& desc, Deadline deadline);
  // One attempt; *dropped: the target closed it without answering (admission limits).
  Result<int> openConnOnce(const SegmentDesc& remote, const std::string& label,
                           const Hello& hello, const std::string& desc, Deadline deadline,
                           bool* dropped);
  void acceptNew();
  void sweepHandshakes();
  int loopTimeoutMs() const;
  void addConn(const std::shared_ptr<Conn>& c);
  bool send(Conn& c, FrameHeader h, const char* data, size_t len, std::string owned = {},
            bool from_region = false);
  // Queues a frame without writing it (false: closed); kick() then writes what is queued.
  bool queueLocked(Conn& c, FrameHeader h, const char* data, size_t len, std::string owned,
                   bool from_region = false);
  void kick(Conn& c);
  void flushLocked(Conn& c);
  void setArmed(Conn& c, bool armed);
  void onReadable(const std::shared_ptr<Conn>& c);
  bool frameStart(const std::shared_ptr<Conn>& c);
  bool frameEnd(const std::shared_ptr<Conn>& c);
  // Target side of a WRITE or READ_REQ (tcp_target.cc): its header read, a WRITE's payload in.
  bool onRequest(const std::shared_ptr<Conn>& c);
  bool onWriteEnd(const std::shared_ptr<Conn>& c);
  bool sendHelloOk(Conn& c);  // the target's answer to a complete handshake; true
  bool expectPayload(const std::shared_ptr<Conn>& c, Conn::Sink sink, char* dst);
  bool protocolError(const std::shared_ptr<Conn>& c, const std::string& what);
  // Under c.out_mu: `it` takes a copy of the payload it still has to send (tcp_target.cc).
  bool ownRestLocked(Conn& c, OutItem& it, const char* what);
  void closeConn(const std::shared_ptr<Conn>& c, const Status& why);
  void dropConn(Conn& c);
  void failPeer(PeerState& p, const Status& why, bool report, bool orderly = false);
  // Tells every peer on every connection that this engine is stopping (BYE, best effort).
  void sayGoodbye();
  bool completeSlice(PeerState& p, uint64_t req, Code code);
  // Target side: a NOTIFY whose watermarks are met is delivered, else held on its link.
  void onNotify(Conn& c, const std::string& watermarks, uint32_t channel, uint64_t tag);
  void releaseHeld(LinkState& l, uint64_t src);
  void onExchange(const std::shared_ptr<Conn>& c);
  void deliverNotify(uint64_t src, uint32_t channel, uint64_t tag);
  void deliverMessage(uint64_t src, uint32_t channel, std::string payload);
  Status pushMessage(uint64_t src, uint32_t channel, const std::string& payload);
  void retryBacklog();

  const int data_conns_;
  EngineContext* ctx_ = nullptr;
  uint64_t slice_bytes_ = 1 << 20;
  int64_t push_timeout_ms_ = 10000;
  int64_t user_timeout_ms_ = 16000;  // MC_TCP_USER_TIMEOUT_MS (sock::setUserTimeout)
  int listen_fd_ = -1, ep_fd_ = -1, wake_fd_ = -1;
  std::string host_;
  uint16_t port_ = 0;
  std::thread thread_;
  std::atomic<std::thread::id> loop_tid_{};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_conn_{2};
  std::mutex conns_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Conn>> conns_;
  std::vector<std::weak_ptr<PeerState>> peers_;
  std::mutex cmd_mu_;
  std::vector<std::function<void()>> cmds_;
  bool running_ = false;  // under cmd_mu_
  // Progress thread only: per (initiator engine, link id), see LinkState.
  std::map<std::pair<uint64_t, uint64_t>, LinkState> links_;
  // Progress thread only: the (initiator engine, link id) of each control connection that
  // completed its handshake (DESC) and is still open; data connections join only these.
  std::set<std::pair<uint64_t, uint64_t>> control_links_;
  // Progress thread only: inbox pushes that found the inbox full, in arrival order.
  struct PendingNotify {
    uint64_t src;
    uint32_t channel;
    uint64_t tag;
  };
  std::deque<PendingNotify> notify_backlog_;
  struct PendingMsg {
    uint64_t src;
    uint32_t channel;
    std::string payload;
  };
  std::deque<PendingMsg> msg_backlog_;
  std::vector<char> scratch_ = std::vector<char>(256 * 1024);
  // Progress thread only (and stop() after it ended).
  std::unique_ptr<Admission> admission_;
  bool listen_paused_ = false;
};

}  // namespace mooncake::engine::tcp
