// SegmentDesc: what a process exports to its peers: identity, endpoints, regions and their
// per-transport keys. Serialized with a version; parse() rejects anything malformed.
//
// Engine-level fields (identity, the tcp control endpoint every peer is opened through, the
// inbox) are named; what a transport adds is opaque to the engine: its endpoint data
// (`endpoints[kind]`: the rdma NICs with their GIDs/LIDs, ...) and per-region keys
// (`RegionDesc::keys[kind]`: rkeys, ...), each encoded and decoded by that transport.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine {

struct RegionDesc {
  uint64_t addr = 0;
  uint64_t len = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;
  std::string shm_name;
  std::string keys[kNumTransportKinds];
};

struct SegmentDesc {
  static constexpr uint32_t kMagic = 0x4d435347;  // "MCSG"
  static constexpr uint32_t kVersion = 2;
  static constexpr uint32_t kMaxEndpointBytes = 64 * 1024;

  std::string name;            // the name the segment is published under
  uint64_t engine_id = 0;      // random per engine instance
  std::string host_id;         // equal host ids share /dev/shm and can map each other
  int32_t pid = 0;
  std::string tcp_host;        // where the engine's tcp listener is reached
  uint16_t tcp_port = 0;
  std::string inbox_shm;       // notification/message inbox (same-host peers map it)
  uint32_t transports = 0;     // bit per TransportKind this engine offers
  std::string endpoints[kNumTransportKinds];  // per-transport endpoint data (opaque here)
  uint64_t regions_version = 0;
  std::vector<RegionDesc> regions;

  std::string serialize() const;
  static Result<SegmentDesc> parse(std::string_view bytes);

  // The region containing [addr, addr+len), or nullptr.
  const RegionDesc* findRegion(uint64_t addr, uint64_t len) const;
  bool offers(TransportKind k) const { return (transports >> static_cast<int>(k)) & 1u; }
};

// This machine's identity for locality decisions: MC_HOST_ID, else boot id + network
// namespace (two namespaces on one kernel count as two hosts, as they cannot share a
// loopback address; they could share /dev/shm but tests use them to stand for hosts).
std::string localHostId();

}  // namespace mooncake::engine
