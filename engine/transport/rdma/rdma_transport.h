// rdma transport: libibverbs RC queue pairs between hosts (docs/rdma.md).
//
// What it does today (the rest of issue 10 is listed in docs/rdma.md):
//  - NICs: every active NIC (rdma_nic.h), each with a PD, a CQ and a poller thread; its PCI
//    address (from sysfs) places it in the machine's topology (engine/topology.h).
//  - Memory: registerRegion registers the region with every NIC; the region's key
//    (RegionDesc::keys[kRdma]) is the rkeys, one per NIC in the order of the endpoint data,
//    comma separated ("-" where that NIC could not register it); a region above a NIC's
//    max_mr_size is registered in chunks: "chunk=<bytes>/<keys of chunk 0>/<keys of chunk 1>/..."
//    (work requests stay inside one chunk). The endpoint data
//    (SegmentDesc::endpoints[kRdma]) is one line per NIC (rdma_nic.h NicAddress). Each region
//    also gets its nearest NICs: same PCI switch as its GPU, else its NUMA node's, else all.
//  - Lanes: MC_RDMA_QPS_PER_EP RC QPs per local NIC, to the peer's NIC of the same link layer
//    in the same position (rail-matched), created when the engine opens the peer. QP number,
//    PSN, LID/GID and MTU are exchanged over the engine's tcp control link
//    (ControlLink::exchange, kind kRdma):
//      request  "2 <initiator nic> <target nic> <qpn> <psn> <lid> <gid hex> <mtu> <ib> <conn>
//                <lane>"
//      answer   "<qpn> <psn> <lid> <gid hex> <mtu>"
//    `conn` names the initiator's set of lanes to this target (their notifications share one
//    order), `lane` the lane (a reconnected lane replaces its old QP at the target).
//    "C <conn> <lane>" (answer "") closes a lane at the target: MC_RDMA_MAX_ENDPOINTS, the
//    initiator's prober closes idle endpoints (a peer's lanes on one NIC) beyond it, and the
//    peer's next request dials them again. The target creates its QP, posts its receives and
//    moves it to RTR before it answers, so the initiator's first SEND finds it ready.
//  - Data: READ/WRITE requests are cut into MC_RDMA_SLICE_BYTES slices posted as one-sided
//    RDMA READ/WRITE round robin over the lanes of the local memory's nearest NICs
//    (MC_RDMA_STRIPE=near; all: every lane), at most MC_RDMA_MAX_WR outstanding per QP (the
//    rest queue in order). Local memory the engine does not know goes through the engine's
//    bounce pool.
//  - notify(channel, tag): a 16-byte SEND on each lane that carried work since the last one,
//    after that work on the same QP; the target delivers it when every part arrived, in issue
//    order (rdma_notify.h), like tcp does (inbox for channel 0, the engine's notify handlers
//    otherwise). Two-sided messages stay on the tcp control link (carriesMessages() false).
//  - Failover (rdma_peer.cc): a work request that fails (error completion, a port down timing
//    out) moves its QP to the error state; once the NIC flushed it, everything that QP held
//    goes, in order, to another live lane, and the failed lane is reconnected by a prober
//    thread after MC_RDMA_RETRY_MS (when its port is up). A QP with work outstanding and no
//    completion for MC_RDMA_STALL_MS (a stalled NIC) is failed the same way. With no lane
//    live, work goes over the control link (MC_RDMA_TCP_FALLBACK), in order, one at a time:
//      "F W <addr> <target nic> <rkey> <len>\n<bytes>"  answer ""
//      "F R <addr> <target nic> <rkey> <len>"           answer the bytes
//      "F N <conn> <channel> <word> <tag>"              answer "" (a notification part)
//    new work takes a lane again as soon as one is back (a notification also puts a part on
//    tcp while tcp still carries work). Without the fallback a request fails naming the peer,
//    the operation and every NIC's error. The peer's death is noticed by the tcp control
//    link, which fails this peer through TransportPeer::fail() (final).
#pragma once

#include <memory>

#include "engine/transport/transport.h"

namespace mooncake::engine {

std::unique_ptr<Transport> makeRdmaTransport(const TransportOptions& options);

}  // namespace mooncake::engine
