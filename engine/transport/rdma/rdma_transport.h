// rdma transport: libibverbs RC queue pairs between hosts (docs/rdma.md).
//
// What it does today (the rest of issue 10 is listed in docs/rdma.md):
//  - NICs: every active NIC (rdma_nic.h), each with a PD, a CQ and a poller thread.
//  - Memory: registerRegion registers the region with every NIC; the region's key
//    (RegionDesc::keys[kRdma]) is the rkeys, one per NIC in the order of the endpoint data,
//    comma separated ("-" where that NIC could not register it). The endpoint data
//    (SegmentDesc::endpoints[kRdma]) is one line per NIC (rdma_nic.h NicAddress).
//  - Connection: one RC QP per peer, from the first local NIC to the first peer NIC of the same
//    link layer, created when the engine opens the peer. QP number, PSN, LID/GID and MTU are
//    exchanged over the engine's tcp control link (ControlLink::exchange, kind kRdma):
//      request  "1 <initiator nic> <target nic> <qpn> <psn> <lid> <gid hex> <mtu>"
//      answer   "<qpn> <psn> <lid> <gid hex> <mtu>"
//    The target creates its QP, posts its receives and moves it to RTR before it answers, so
//    the initiator's first SEND finds it ready.
//  - Data: READ/WRITE requests are cut into MC_RDMA_SLICE_BYTES slices posted as one-sided
//    RDMA READ/WRITE, at most MC_RDMA_MAX_WR outstanding per QP (the rest queue in order).
//    Local memory the engine does not know goes through the engine's bounce pool.
//  - notify(channel, tag): a 16-byte SEND (u32 channel, u32 0, u64 tag) posted on the same QP
//    after the writes it follows, so the target's receive completes after their bytes are
//    placed (RC ordering). The target delivers it like tcp does (inbox for channel 0, the
//    engine's notify handlers otherwise). Two-sided messages stay on the tcp control link
//    (carriesMessages() is false).
//  - Failure: a work-request error fails the request naming the peer, the NIC and the
//    operation, and poisons the QP (no failover yet); the peer's death is noticed by the tcp
//    control link, which fails this peer through TransportPeer::fail().
#pragma once

#include <memory>

#include "engine/transport/transport.h"

namespace mooncake::engine {

std::unique_ptr<Transport> makeRdmaTransport(const TransportOptions& options);

}  // namespace mooncake::engine
