// tcp transport: reaches any host. One epoll progress thread per engine serves every
// connection (accepted and opened); a peer is one control connection (handshake, liveness,
// notifications, messages, transports' connection exchanges) plus `data_conns` data
// connections over which large requests are cut into slices (MC_TCP_SLICE_BYTES) and spread
// round-robin. Every connection, opened or accepted, has keepalive and TCP_USER_TIMEOUT
// (MC_TCP_USER_TIMEOUT_MS, sock::setLiveness): a peer whose host vanished (no FIN, no RST) is
// failed in seconds even while data toward it waits for its acknowledgement.
//
// Wire format (this header is the spec; tests build frames from it). Every frame starts with
// a fixed 40-byte little-endian header:
//
//   u32 magic (kFrameMagic) | u8 type | u8 flags (0) | u16 status (mooncake::Code)
//   u64 request id | u64 remote addr | u64 length | u64 aux
//
// followed by `length` payload bytes for CHALLENGE, HELLO, HELLO_PROOF, DESC, HELLO_DENIED,
// WRITE, READ_RESP, MSG, NOTIFY, XCHG and XCHG_RESP. For READ_REQ `length` is the number of
// bytes asked for (no payload).
//
// The handshake: each side proves it holds the job secret without sending it (a process that
// accepts connections at a job member's address learns nothing from the member that connects
// to it; docs/security.md, "Handshakes"). Proofs are engine/hmac.h's secretProof over both
// sides' fresh nonces and the HELLO's fields (helloBound), each side with its own role string.
//   CHALLENGE    target -> initiator, the first frame of every accepted connection: payload =
//                the target's fresh nonce (kNonceBytes). The initiator sends nothing before it.
//   HELLO        payload = encodeHello(): the initiator's fresh nonce, its proof (role
//                kInitiatorProof, over the challenge, that nonce and helloBound), initiator
//                engine id, role, link id and the connection's index in its link (at most
//                kMaxHelloBytes: this is all a connection may send before it authenticated).
//                A link is the set of connections one initiator opened to one target for one
//                peer (control = index 0, data connections 1..n), named by a random id. A data
//                connection is accepted only for the (engine id, link id) of a control
//                connection open at the target that has sent its DESC.
//   HELLO_PROOF  target -> initiator after a correct HELLO: payload = the target's proof (role
//                kTargetProof, same challenge and nonce, bound = helloBound + the target's
//                engine id), aux = the target's engine id. The initiator checks it before it
//                sends or believes anything more (a wrong one: kPermissionDenied). On a data
//                connection this ends the handshake.
//   DESC         payload = the initiator's SegmentDesc; sent after HELLO_PROOF on a control
//                connection only (elsewhere it closes the connection)
//   HELLO_OK     aux = the target's engine id (the initiator checks it: a stale descriptor
//                whose port now belongs to another engine is refused). Sent after DESC on a
//                control connection.
//   HELLO_DENIED payload = reason; the target closes the connection after it
//   DESC (answer) on a query connection (HELLO role kQuery): payload = the target's own
//                SegmentDesc, aux = its engine id; sent right after HELLO_PROOF. Nothing else
//                is valid on a query connection: the initiator reads the answer and closes it
//                (tcp_query.h; upstream Mooncake's P2P handshake, with the secret's proof
//                first).
//   WRITE        payload = the bytes to put at addr          -> WRITE_ACK (status)
//   READ_REQ     addr, length                               -> READ_RESP (status, payload)
//   (NOTIFY, MSG and XCHG travel on the control connection only: elsewhere they close it.)
//   NOTIFY       aux = tag, addr = channel (0: the application's, else a service's);
//                payload = one u64 per data connection of the link (index 1..n): the number
//                of WRITE frames the initiator had queued on it before this NOTIFY (control
//                connection only; at most kMaxNotifyBytes)
//   MSG          aux = channel, payload = message (<= kMaxMessageBytes)
//   XCHG         aux = TransportKind, req_id = exchange id, payload = that transport's
//                request (<= kMaxExchangeBytes; control connection only, initiator -> target)
//   XCHG_RESP    req_id = the exchange's id, status, payload = the answer (target -> initiator)
//   BYE          aux = 0: the initiator closes this peer on purpose (no peer-failure report);
//                aux = kByeEngineStopping: the sender's engine is stopping. Sent on every
//                connection it holds, in both directions, just before they close; the
//                receiver reports the peer gone as an orderly departure (INFO, not WARN).
// A bad magic, an unknown type, a type not valid in the connection's direction, a length over
// its limit, any frame before a successful HELLO, or (on a control connection) any frame but
// DESC before DESC closes that connection.
//
// Before authentication a connection costs at most kMaxHelloBytes of memory and
// MC_HANDSHAKE_TIMEOUT_MS of time, and the listener admits only so many such connections per
// source address and in all (tcp_admission.h).
//
// Guarantees and contracts:
//  - Target-side safety: a WRITE or READ_REQ whose [addr, addr+length) is not inside ONE
//    registered region is refused with kPermissionDenied; a refused WRITE's payload is
//    read into scratch and dropped. Accepted payloads are received straight into the
//    registered host memory (no intermediate copy); a GPU region (kCuda) is staged: the
//    payload lands in a host buffer and the device layer copies it in before the WRITE_ACK
//    (so a NOTIFY held for it comes after), a READ is copied out into a host buffer first.
//    READ_RESP payloads go straight into
//    the initiator's buffer, and WRITE/READ_RESP payloads are sent from the user's/registered
//    memory with writev (no copy). A target region unregistered or freed while a transfer
//    into or out of it is in flight ends it cleanly (tcp_target.cc): the steps in progress
//    finish first, later WRITE steps and READ slices are refused with kPermissionDenied, and
//    READ responses already queued go out whole from a copy taken before the memory goes
//    (except a device copy of GPU memory that missed its 30 s deadline: tcp_target.cc).
//    The initiator's own buffers must outlive its requests, or their fence (next).
//  - Slicing: a request that the initiator's copy of the peer's descriptor shows inside one
//    region is cut into MC_TCP_SLICE_BYTES slices over the data connections; any other
//    request (stale descriptor, or out of range) goes as one frame of up to kMaxDataBytes, so
//    that the target accepts or refuses it whole, never a part of it; one longer than that is
//    refused whole at submit (kPermissionDenied), before any byte moves.
//  - Fence (TransportPeer::fenceAbandoned, when a wait() on a batch timed out): run on the
//    progress thread before the call returns. A READ response of an abandoned request still
//    to come, or half received, is received into a discard sink (the stream stays in step);
//    what WRITE frames of such requests still have to send is copied into the engine's memory
//    first, and goes out from there. No connection is closed and the peer is not failed: the
//    late WRITEs land at the target, the acks and responses come, and the requests complete
//    then (a discarded READ with kCancelled). After the call, nothing of the transport reads
//    or writes those requests' buffers.
//  - Ordering: notify(tag) is delivered after every WRITE the peer submitted before it, with
//    no round trip: the NOTIFY carries, per data connection, how many WRITE frames were queued
//    there before it, and the target holds it back until it has received that many WRITE
//    frames (their bytes in its memory, or refused) on each. Notifications of one link are
//    delivered in order; messages of one peer arrive in order.
//  - Threads: the progress thread never blocks on a socket. Submitting threads may send
//    directly while a connection's output queue is empty; the rest is flushed on EPOLLOUT.
//    A request's frames are queued per connection first and then written together (up to 32
//    frames per sendmsg); while the progress thread reads a connection, the frames it answers
//    with (WRITE_ACKs, READ_RESPs) are held ("corked") and leave together when the read ends,
//    or before it reads a payload of kUncorkBytes or more. Small requests thus cost a
//    fraction of a syscall each instead of one or more.
//    Task completions for requests in flight happen on the progress thread (or in stop());
//    a request to a failed peer, or of length 0, completes inside submit().
//  - Failure: EOF/reset/protocol error on any connection of a peer fails all its pending
//    requests and exchanges with kPeerDead (naming the peer) and later ones at once, and
//    reports ctx->on_peer_failure once (before the failed requests complete, so that a woken
//    waiter already finds the peer dead). On the target side, the loss of an authenticated
//    control connection without a BYE reports on_peer_failure(initiator) too: the
//    initiator's process died or its engine stopped. fail(why) and stop() poison peers
//    without a report.
//  - The inbox is never waited on by the progress thread for notifications: when it is full,
//    notifications queue in the transport (in order) and are retried every millisecond.
//    Single-fragment messages (<= Inbox::kFragmentBytes) do the same; a larger message is
//    pushed with a MC_CONNECT_TIMEOUT_MS deadline (the engine's dispatcher drains it).
//    Service notifications (channel != 0) and messages go to the engine in process
//    (ctx->deliver_notify / deliver_message), never through the inbox.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "engine/transport/transport.h"

namespace mooncake::engine::tcp {

constexpr uint32_t kFrameMagic = 0x4d435446;  // "MCTF"
constexpr size_t kHeaderBytes = 40;
constexpr uint64_t kMaxDataBytes = 1ull << 30;      // WRITE / READ_REQ / READ_RESP
constexpr uint64_t kMaxMessageBytes = 64ull << 20;  // MSG
constexpr uint64_t kMaxHelloBytes = 4096;           // HELLO (before authentication)
constexpr size_t kNonceBytes = 32;                  // CHALLENGE, and the nonce in a HELLO
constexpr uint64_t kMaxDescBytes = 16ull << 20;     // DESC (after authentication)
constexpr uint64_t kMaxReasonBytes = 4096;          // HELLO_DENIED
constexpr uint64_t kMaxExchangeBytes = 1ull << 20;  // XCHG / XCHG_RESP
constexpr int kMaxDataConns = 64;                   // per link
constexpr uint64_t kMaxNotifyBytes = 8 * kMaxDataConns;  // NOTIFY (write watermarks)
constexpr int kSocketBufferBytes = 4 << 20;

enum class FrameType : uint8_t {
  kHello = 1,
  kHelloOk = 2,
  kHelloDenied = 3,
  kWrite = 4,
  kWriteAck = 5,
  kReadReq = 6,
  kReadResp = 7,
  kNotify = 8,
  kMsg = 9,
  kBye = 10,
  kDesc = 11,
  kXchg = 12,
  kXchgResp = 13,
  kChallenge = 14,
  kHelloProof = 15,
};

// The role strings of the two proofs (engine/hmac.h, secretProof).
constexpr const char* kInitiatorProof = "mooncake tcp v1 initiator";
constexpr const char* kTargetProof = "mooncake tcp v1 target";

constexpr uint64_t kByeEngineStopping = 1;

// kQuery: a short connection that only asks for the target's descriptor (see DESC above).
enum class ConnRole : uint8_t { kControl = 0, kData = 1, kQuery = 2 };

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  FrameType type = FrameType::kHello;
  uint8_t flags = 0;
  uint16_t status = 0;  // mooncake::Code
  uint64_t req_id = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  uint64_t aux = 0;
};

void encodeHeader(const FrameHeader& h, uint8_t out[kHeaderBytes]);
FrameHeader decodeHeader(const uint8_t in[kHeaderBytes]);

struct Hello {
  std::string nonce;  // the initiator's (kNonceBytes)
  std::string proof;  // its proof of the secret (kSha256Bytes)
  uint64_t engine_id = 0;
  ConnRole role = ConnRole::kControl;
  uint64_t link = 0;   // random id of the initiator's link (its connections to this target)
  uint32_t index = 0;  // 0: the control connection; 1..kMaxDataConns: data connections
};

std::string encodeHello(const Hello& h);
// False when the payload does not decode exactly.
bool decodeHello(std::string_view payload, Hello* out);
// What both proofs vouch for: the HELLO's engine id, role, link and index.
std::string helloBound(const Hello& h);
// The target's proof for `hello` answering `challenge`.
std::string targetProof(const std::string& secret, const std::string& challenge,
                        const Hello& hello, uint64_t target_engine_id);

// The initiator's side of a handshake on a connected socket (peer connections and descriptor
// queries): reads the CHALLENGE, sends HELLO (a fresh nonce and the proof; `hello`'s nonce and
// proof are filled in here), checks the target's HELLO_PROOF (and, when `expect_engine` is not
// 0, that the proven target is that engine: else kUnavailable "stale descriptor", before any
// DESC; *proven_engine, when given, gets the proven id), then sends a DESC frame when `desc`
// is not empty. Returns the header of the answer that ends the handshake: HELLO_PROOF
// on a data connection, else the frame after it (HELLO_OK after DESC, the query's DESC), its
// body left unread. HELLO_DENIED becomes kPermissionDenied with the target's reason, a proof
// that does not check out kPermissionDenied, a bad magic or an unexpected frame kProtocol.
// *dropped: the target closed or reset the connection before answering (its admission
// limits): worth retrying.
Result<FrameHeader> helloExchange(int fd, Hello hello, const std::string& secret,
                                  const std::string& desc, uint64_t expect_engine,
                                  uint64_t* proven_engine, Deadline deadline, bool* dropped);

}  // namespace mooncake::engine::tcp
