// GPU messages between processes of one host (P2p, pg/p2p.h): instead of staging GPU data
// through host memory (device -> pinned host -> the peer's inbox -> its mailbox -> pinned
// host -> device), the sender copies it device to device into a staging buffer of its own GPU
// memory, exported once through the device layer's IPC handle, and sends a small descriptor in
// its message stream; the receiver opens that buffer once (cached for the group's life), copies
// the bytes device to device into its output when its recv matches, and gives the buffer back
// with a release message. Eager as before: send returns once the data is in the staging
// buffer, whether or not the receiver has posted its recv.
//
// The staging buffers (powers of two from 64 KiB, on the device of the data) are kept for the
// group's life and never freed earlier, so a receiver's cache of opened buffers stays bounded
// and never maps a freed one. At most kPoolBytes of them per group: beyond that (many GPU
// messages not yet received), or when the device layer cannot allocate or export, a message
// goes through host memory as before.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace mooncake::pg {

class DeviceOutbox {
 public:
  static constexpr size_t kPoolBytes = size_t{256} << 20;
  DeviceOutbox() = default;
  ~DeviceOutbox();  // frees the staging buffers
  DeviceOutbox(const DeviceOutbox&) = delete;
  DeviceOutbox& operator=(const DeviceOutbox&) = delete;

  // Copies `bytes` of the GPU memory at src into a staging buffer held for `peer` and returns
  // the descriptor the receiver needs, or nullopt when no buffer could be had (then nothing was
  // copied or held). Throws CommError when the copy fails.
  std::optional<std::string> stage(const void* src, size_t bytes, engine::PeerId peer,
                                   const char* op);
  // The descriptor's buffer back into the pool: the receiver copied it out (its release
  // message), or the send failed.
  void release(uint64_t token);
  static uint64_t tokenOf(const std::string& desc);
  // Waits until every buffer staged for a peer that alive() says is alive was given back, or
  // until the deadline. Before the buffers are freed: a receiver may still be copying.
  void drain(const std::function<bool(engine::PeerId)>& alive, engine::Deadline deadline);
  size_t held() const;  // buffers staged and not given back (tests)

 private:
  struct Buf {
    char* p = nullptr;
    size_t cap = 0;
    int ordinal = 0;
    std::string handle;
    uint64_t offset = 0;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Buf>> all_;
  std::multimap<std::pair<int, size_t>, Buf*> idle_;  // by (device, size)
  std::map<uint64_t, std::pair<Buf*, engine::PeerId>> out_;  // by token
  size_t bytes_ = 0;
  uint64_t next_token_ = 1;
  bool warned_ = false;
};

class DeviceInbox {
 public:
  DeviceInbox() = default;
  ~DeviceInbox();  // closes the buffers it opened
  DeviceInbox(const DeviceInbox&) = delete;
  DeviceInbox& operator=(const DeviceInbox&) = delete;

  // Copies the message `desc` (sent by rank src, engine `sender`) into dst (GPU or host
  // memory; host memory through a pinned stage). Throws CommError naming src when the buffer
  // cannot be opened or the copy fails.
  void take(const std::string& desc, uint64_t sender, int src, void* dst, size_t bytes,
            const char* op);

 private:
  std::mutex mu_;
  std::map<std::pair<uint64_t, std::string>, char*> opened_;  // (engine, handle) -> base
};

}  // namespace mooncake::pg
