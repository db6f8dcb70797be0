// Descriptor query: how an engine learns a peer's SegmentDesc from nothing but the address of
// the peer's tcp listener (upstream Mooncake's "P2PHANDSHAKE" mode: no metadata server, no
// rendezvous). The initiator opens a connection, answers the target's CHALLENGE with a HELLO of
// role kQuery (a proof of the job secret, as every connection), checks the target's proof, and
// reads one DESC frame carrying the target's descriptor (or HELLO_DENIED); then it closes.
// Wire format: tcp_transport.h.
//
// The answer is only what the target's engine exports to any authenticated peer (its regions,
// endpoints and host id); a connection without the secret gets HELLO_DENIED and nothing else.
#pragma once

#include <cstdint>
#include <string>

#include "engine/segment.h"
#include "engine/status.h"
#include "engine/types.h"

namespace mooncake::engine::tcp {

// kPermissionDenied: the target refused the secret. kUnavailable: nothing listens there (or it
// closed unanswered past the deadline: admission limits are retried until then). kTimeout: no
// answer by the deadline. kProtocol: an answer that is not a valid descriptor of the engine
// the target says it is.
Result<SegmentDesc> queryDescriptor(const std::string& host, uint16_t port,
                                    const std::string& secret, uint64_t engine_id,
                                    Deadline deadline);

}  // namespace mooncake::engine::tcp
