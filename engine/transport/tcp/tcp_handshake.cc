// The tcp handshake's wire side (spec: tcp_transport.h): HELLO encoding, the proofs of the job
// secret both ways, and the initiator's blocking exchange (peer connections and descriptor
// queries). The target's side is in tcp_conn.cc (HELLO, DESC).
#include "engine/hmac.h"
#include "engine/secret.h"
#include "engine/transport/tcp/tcp_core.h"
#include "engine/transport/tcp/tcp_socket.h"
#include "engine/transport/tcp/tcp_transport.h"
#include "engine/wire.h"

namespace mooncake::engine::tcp {

std::string encodeHello(const Hello& h) {
  wire::Writer w;
  w.str(h.nonce);
  w.str(h.proof);
  w.u64(h.engine_id);
  w.u8(static_cast<uint8_t>(h.role));
  w.u64(h.link);
  w.u32(h.index);
  return w.take();
}

bool decodeHello(std::string_view payload, Hello* out) {
  wire::Reader r(payload);
  out->nonce = r.str(static_cast<uint32_t>(kNonceBytes));
  out->proof = r.str(static_cast<uint32_t>(kSha256Bytes));
  out->engine_id = r.u64();
  uint8_t role = r.u8();
  out->role = static_cast<ConnRole>(role);
  out->link = r.u64();
  out->index = r.u32();
  // The control and query connections are index 0 of their link, data connections
  // 1..kMaxDataConns.
  bool index_ok = role == static_cast<uint8_t>(ConnRole::kData)
                      ? out->index >= 1 && out->index <= static_cast<uint32_t>(kMaxDataConns)
                      : out->index == 0;
  return r.done() && out->nonce.size() == kNonceBytes && out->proof.size() == kSha256Bytes &&
         role <= static_cast<uint8_t>(ConnRole::kQuery) && index_ok;
}

std::string helloBound(const Hello& h) {
  wire::Writer w;
  w.u64(h.engine_id);
  w.u8(static_cast<uint8_t>(h.role));
  w.u64(h.link);
  w.u32(h.index);
  return w.take();
}

std::string targetProof(const std::string& secret, const std::string& challenge,
                        const Hello& hello, uint64_t target_engine_id) {
  wire::Writer w;
  w.u64(target_engine_id);
  return secretProof(secret, kTargetProof, challenge, hello.nonce, helloBound(hello) + w.data());
}

namespace {

// Reads one frame header; HELLO_DENIED (with its reason) becomes kPermissionDenied.
// *dropped: closed before a byte of it came.
Result<FrameHeader> readAnswer(int fd, Deadline deadline, bool* dropped) {
  uint8_t raw[kHeaderBytes];
  size_t got = 0;
  Status st = sock::recvAll(fd, raw, kHeaderBytes, deadline, &got);
  if (!st.ok()) {
    *dropped = st.code() == Code::kUnavailable && got == 0;  // closed without an answer
    return st;
  }
  FrameHeader r = decodeHeader(raw);
  if (r.magic != kFrameMagic) return MC_STATUS(kProtocol, "bad answer");
  if (r.type == FrameType::kHelloDenied) {
    std::string reason(std::min<uint64_t>(r.length, kMaxReasonBytes), '\0');
    (void)sock::recvAll(fd, reason.data(), reason.size(), deadline);
    return MC_STATUS(kPermissionDenied, "denied: " << reason);
  }
  return r;
}

// Reads a frame of exactly `type` and `bytes` of payload into *body.
Result<FrameHeader> readFixed(int fd, FrameType type, size_t bytes, const char* what,
                              std::string* body, Deadline deadline, bool* dropped) {
  MC_ASSIGN_OR_RETURN(FrameHeader r, readAnswer(fd, deadline, dropped));
  if (r.type != type || r.length != bytes)
    return MC_STATUS(kProtocol, "expected " << what << ", got frame type " << int(r.type)
                                            << " of " << r.length << " bytes");
  body->assign(bytes, '\0');
  MC_RETURN_IF_ERROR(sock::recvAll(fd, body->data(), bytes, deadline));
  return r;
}

Status sendFrame(int fd, FrameType type, const std::string& payload, Deadline deadline) {
  std::string out(kHeaderBytes, '\0');
  FrameHeader h;
  h.type = type;
  h.length = payload.size();
  encodeHeader(h, reinterpret_cast<uint8_t*>(out.data()));
  out += payload;
  return sock::sendAll(fd, out.data(), out.size(), deadline);
}

}  // namespace

Result<FrameHeader> helloExchange(int fd, Hello hello, const std::string& secret,
                                  const std::string& desc, uint64_t expect_engine,
                                  uint64_t* proven_engine, Deadline deadline, bool* dropped) {
  std::string challenge;
  MC_RETURN_IF_ERROR(
      readFixed(fd, FrameType::kChallenge, kNonceBytes, "CHALLENGE", &challenge, deadline,
                dropped)
          .status());
  hello.nonce = randomBytes(kNonceBytes);
  hello.proof = secretProof(secret, kInitiatorProof, challenge, hello.nonce, helloBound(hello));
  Status st = sendFrame(fd, FrameType::kHello, encodeHello(hello), deadline);
  if (!st.ok()) {
    *dropped = st.code() == Code::kUnavailable;  // reset before we were heard
    return st;
  }
  std::string proof;
  MC_ASSIGN_OR_RETURN(FrameHeader r, readFixed(fd, FrameType::kHelloProof, kSha256Bytes,
                                               "HELLO_PROOF", &proof, deadline, dropped));
  *dropped = false;
  if (!secretsEqual(proof, targetProof(secret, challenge, hello, r.aux)))
    return MC_STATUS(kPermissionDenied,
                     "the target did not prove that it holds the job secret (not a member "
                     "of this job, or another job's engine at that address)");
  // The proof covers the target's engine id: a stale descriptor (its port now another
  // engine's) ends here, before our DESC makes that engine take us for a peer (whose
  // connection, closed next, it would report as our failure).
  if (expect_engine != 0 && r.aux != expect_engine)
    return MC_STATUS(kUnavailable,
                     "stale descriptor: that address is now served by engine " << hexId(r.aux));
  if (proven_engine != nullptr) *proven_engine = r.aux;
  if (!desc.empty()) MC_RETURN_IF_ERROR(sendFrame(fd, FrameType::kDesc, desc, deadline));
  if (hello.role == ConnRole::kData) return r;
  return readAnswer(fd, deadline, dropped);
}

}  // namespace mooncake::engine::tcp
