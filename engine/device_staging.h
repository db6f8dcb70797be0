// GPU memory to a peer that no transport of GPU memory reaches (tcp between hosts without
// rdma, or a same-host peer without the same device layer): the bytes are staged through host
// memory here (device layer copies) and move over the peer's host transport. The peer's GPU
// memory is staged there, by its tcp transport (a frame into or out of a GPU region goes
// through a host buffer and the device layer's copies): when the peer's host transport is not
// tcp (shm to a same-host peer without the same device layer), over `gpu_host`, the engine's
// tcp control connection to the peer; without one (a forced transport) it is refused. `dev`
// is null in a process without a device layer: its own memory is host memory then.
#pragma once

#include <memory>

#include "engine/device/device.h"
#include "engine/transport/transport.h"

namespace mooncake::engine {

// `host` (the peer's data transport) and `gpu_host` outlive the result.
std::unique_ptr<TransportPeer> makeStagingPeer(TransportPeer* host, TransportKind host_kind,
                                               TransportPeer* gpu_host, device::Device* dev,
                                               EngineContext* ctx, const SegmentDesc& remote);

}  // namespace mooncake::engine
