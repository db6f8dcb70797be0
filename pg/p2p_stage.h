// Point-to-point messages between processes of one host through staging buffers (P2p,
// pg/p2p.h): instead of passing the bytes through the engine's messages (copied into the
// peer's inbox, out of it into a mailbox, and from there into the receive buffer), the sender
// copies them into a staging buffer of its own that the receiver can reach, and sends a small
// descriptor in its ordered message stream; the receiver copies the bytes straight out of that
// buffer into its output when its recv matches, and gives the buffer back with a release
// message. Eager as before: send returns once the data is in the staging buffer, whether or
// not the receiver has posted its recv.
//
// Two kinds of pools, one per P2p each:
// - GPU memory (GPU data): buffers from the device layer, exported once through its IPC
//   handle, opened once by each receiver; copies device to device (copy engines).
// - host memory (host data of MC_PG_P2P_STAGE_BYTES and more): buffers the engine allocates
//   (shared memory that same-host peers map through TransferEngine::mappedAddress); the first
//   descriptor of a buffer to a peer carries the sender's segment descriptor, so that the
//   receiver's engine knows the region.
//
// Buffers are powers of two from 64 KiB and are kept for the group's life (never freed
// earlier, so a receiver's cache of opened buffers stays bounded and never maps a freed one),
// at most kPoolBytes a pool: beyond that (many messages not yet received) a send waits up to
// 100 ms for one to be given back, then, as when a buffer cannot be had, the message goes
// through the engine's messages as before.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

class StageOutbox {
 public:
  static constexpr size_t kPoolBytes = size_t{256} << 20;
  // device: GPU memory of the device layer, for GPU data; else host memory from engine.
  StageOutbox(engine::TransferEngine* engine, bool device);
  ~StageOutbox();  // frees the staging buffers
  StageOutbox(const StageOutbox&) = delete;
  StageOutbox& operator=(const StageOutbox&) = delete;

  // Copies `bytes` at src (GPU memory for a device pool) into a staging buffer held for `peer`
  // and returns the descriptor the receiver needs, or nullopt when no buffer could be had
  // (then nothing was copied or held). Throws CommError when a GPU copy fails.
  std::optional<std::string> stage(const void* src, size_t bytes, engine::PeerId peer,
                                   const char* op);
  // The descriptor's buffer back into the pool: the receiver copied it out (its release
  // message), or the send failed.
  void release(uint64_t token);
  // Waits until every buffer staged for a peer that alive() says is alive was given back, or
  // until the deadline. Before the buffers are freed: a receiver may still be copying.
  void drain(const std::function<bool(engine::PeerId)>& alive, engine::Deadline deadline);
  size_t held() const;  // buffers staged and not given back

 private:
  struct Buf {
    char* p = nullptr;
    size_t cap = 0;
    int ordinal = -1;  // the GPU (device pools)
    std::string handle;  // device: the IPC handle; host: the address
    uint64_t offset = 0;  // of p in what the handle names
    std::set<engine::PeerId> told;  // host: peers sent the segment descriptor with it
  };
  // A new buffer (mu_ held); null when it cannot be had (logged once).
  std::unique_ptr<Buf> make(size_t cap, int ordinal, const char* op);

  engine::TransferEngine* engine_;
  const bool device_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Buf>> all_;
  std::multimap<std::pair<int, size_t>, Buf*> idle_;  // by (device, size)
  std::map<uint64_t, std::pair<Buf*, engine::PeerId>> out_;  // by token
  size_t bytes_ = 0;
  uint64_t next_token_ = 1;
  bool warned_ = false;
};

// A descriptor's token (the sender's buffer to give back).
uint64_t stageToken(const std::string& desc);

class StageInbox {
 public:
  explicit StageInbox(engine::TransferEngine* engine) : engine_(engine) {}
  ~StageInbox();  // closes the GPU buffers it opened
  StageInbox(const StageInbox&) = delete;
  StageInbox& operator=(const StageInbox&) = delete;

  // Copies the message `desc` (sent by rank src: engine `sender`, peer `peer` here) into dst
  // (GPU or host memory). Throws CommError naming src when the buffer cannot be reached or a
  // copy fails.
  void take(const std::string& desc, uint64_t sender, engine::PeerId peer, int src, void* dst,
            size_t bytes, const char* op);

 private:
  engine::TransferEngine* engine_;
  std::mutex mu_;
  // (engine, device?, handle) -> where the buffer is here; device ones are closed at the end.
  std::map<std::tuple<uint64_t, bool, std::string>, char*> opened_;
};

}  // namespace mooncake::pg
