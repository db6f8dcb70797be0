// Small value types shared by the engine's public face and its transports.
#pragma once

#include <chrono>
#include <cstdint>

namespace mooncake::engine {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadlineIn(std::chrono::milliseconds ms) { return Clock::now() + ms; }
inline Deadline deadlineInMs(int64_t ms) { return Clock::now() + std::chrono::milliseconds(ms); }
inline Deadline noDeadline() { return Clock::now() + std::chrono::hours(24 * 365); }

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// Static priority order (NCCL's ncclTransports[]): the first that canReach() a peer wins.
// The rows of that table (name, factory) are in engine/transport/table.cc.
enum class TransportKind : uint8_t { kCuda = 0, kShm = 1, kRdma = 2, kTcp = 3 };
constexpr int kNumTransportKinds = 4;
// The transport's name in the table ("cuda", "shm", "rdma", "tcp").
const char* transportName(TransportKind k);

// An engine-local handle for an opened peer (index into the engine's peer table).
using PeerId = int32_t;
constexpr PeerId kInvalidPeer = -1;

using BatchId = uint64_t;

enum class OpCode : uint8_t { kRead = 0, kWrite = 1 };

// One one-sided request: bytes move between `local` (this process, registered or not) and
// `remote` (an address inside one of the peer's registered regions).
struct TransferRequest {
  OpCode op;
  void* local;
  uint64_t length;
  PeerId peer;
  uint64_t remote;
};

struct Notification {
  uint64_t src_engine;  // engine id of the sender (SegmentDesc::engine_id)
  PeerId peer;          // the sender's PeerId here if this engine opened it, else kInvalidPeer
  uint64_t tag;
  // 0: an application notification (waitNotify/pollNotify); else the service channel whose
  // handler (TransferEngine::setNotifyHandler) receives it.
  uint32_t channel = 0;
};

}  // namespace mooncake::engine
