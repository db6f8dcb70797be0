#include "engine/p2p_sessions.h"

#include <algorithm>
#include <cctype>

#include "engine/log.h"
#include "engine/params.h"
#include "engine/wire.h"

namespace mooncake::engine {

namespace {
constexpr uint32_t kMaxNotifyField = 1u << 20;
}  // namespace

P2pSessions::P2pSessions(TransferEngine* engine)
    : engine_(engine),
      connect_ms_(std::max<int64_t>(1, params::getInt("MC_CONNECT_TIMEOUT_MS"))),
      timeout_ms_(std::max<int64_t>(5, params::getInt("MC_TRANSFER_TIMEOUT")) * 1000) {}

P2pSessions::~P2pSessions() = default;

Status P2pSessions::parseSession(const std::string& session, std::string* host, uint16_t* port) {
  std::string s = session;
  s.erase(0, s.find_first_not_of('/'));
  std::string h, p;
  if (!s.empty() && s.front() == '[') {
    size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return MC_STATUS(kInvalidArgument, "session '" << session << "': expected [addr]:port");
    h = s.substr(1, close - 1);
    p = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string::npos)
      return MC_STATUS(kInvalidArgument, "session '" << session << "': expected host:port");
    h = s.substr(0, colon);
    p = s.substr(colon + 1);
  }
  bool digits = !p.empty() && p.size() <= 5 &&
                std::all_of(p.begin(), p.end(), [](unsigned char c) { return std::isdigit(c); });
  long v = digits ? std::stol(p) : 0;
  if (h.empty() || v <= 0 || v > 65535)
    return MC_STATUS(kInvalidArgument, "session '" << session << "': bad host or port");
  *host = h;
  *port = static_cast<uint16_t>(v);
  return Status::OK();
}

Result<PeerId> P2pSessions::open(const std::string& session, bool refresh) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sessions_.find(session);
    if (it != sessions_.end() && !refresh && engine_->peerStatus(it->second.peer).ok())
      return it->second.peer;
  }
  std::string host;
  uint16_t port = 0;
  MC_RETURN_IF_ERROR(parseSession(session, &host, &port));
  Deadline deadline = deadlineInMs(connect_ms_);
  auto desc = engine_->queryPeer(host, port, deadline);
  if (!desc.ok())
    return Status(desc.status().code(), "session " + session + ": " + desc.status().message());
  // Connect where the query got through (the descriptor may advertise another name for it).
  desc->tcp_host = host;
  desc->tcp_port = port;
  auto p = engine_->openPeer(*desc, deadline);  // an open, live peer gets the new descriptor
  if (!p.ok()) return Status(p.status().code(), "session " + session + ": " + p.status().message());
  std::lock_guard<std::mutex> g(mu_);
  sessions_[session] = Session{*p, std::move(desc).value()};
  return *p;
}

Result<PeerId> P2pSessions::peer(const std::string& session) { return open(session, false); }

Status P2pSessions::probe(const std::string& session) {
  std::string host;
  uint16_t port = 0;
  MC_RETURN_IF_ERROR(parseSession(session, &host, &port));
  auto desc = engine_->queryPeer(host, port, deadlineInMs(connect_ms_));
  if (!desc.ok()) return desc.status();
  desc->tcp_host = host;
  desc->tcp_port = port;
  std::lock_guard<std::mutex> g(mu_);
  auto it = sessions_.find(session);
  if (it != sessions_.end() && it->second.desc.engine_id == desc->engine_id &&
      engine_->updatePeer(it->second.peer, *desc).ok())
    it->second.desc = std::move(desc).value();
  return Status::OK();
}

Result<uint64_t> P2pSessions::firstBufferAddress(const std::string& session) {
  MC_RETURN_IF_ERROR(open(session, true).status());
  std::lock_guard<std::mutex> g(mu_);
  const SegmentDesc& d = sessions_.at(session).desc;
  uint64_t first = 0;
  for (const auto& r : d.regions)
    if (first == 0 || r.addr < first) first = r.addr;
  return first;
}

Status P2pSessions::checkRemote(const std::string& session, PeerId peer,
                                const std::vector<Request>& requests) {
  auto all_inside = [&] {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sessions_.find(session);
    if (it == sessions_.end() || it->second.peer != peer) return false;
    for (const auto& r : requests)
      if (it->second.desc.findRegion(r.remote, r.length) == nullptr) return false;
    return true;
  };
  if (all_inside()) return Status::OK();
  MC_RETURN_IF_ERROR(open(session, true).status());  // it may have registered memory since
  if (all_inside()) return Status::OK();
  std::lock_guard<std::mutex> g(mu_);
  const SegmentDesc& d = sessions_.at(session).desc;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (d.findRegion(requests[i].remote, requests[i].length) == nullptr)
      return MC_STATUS(kPermissionDenied,
                       "request " << i << ": [0x" << std::hex << requests[i].remote << ", +"
                                  << std::dec << requests[i].length
                                  << ") is not inside one region registered by " << session);
  }
  return MC_STATUS(kUnavailable, "session " << session << " was reopened meanwhile");
}

Result<BatchId> P2pSessions::submit(const std::string& session,
                                    const std::vector<Request>& requests) {
  if (requests.empty()) return MC_STATUS(kInvalidArgument, "empty batch");
  uint64_t bytes = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (r.length == 0) return MC_STATUS(kInvalidArgument, "request " << i << ": zero length");
    if (!engine_->isRegistered(reinterpret_cast<const void*>(r.local), r.length))
      return MC_STATUS(kInvalidArgument, "request " << i << ": local [0x" << std::hex << r.local
                                                    << ", +" << std::dec << r.length
                                                    << ") is not inside one registered region");
    bytes += r.length;
  }
  MC_ASSIGN_OR_RETURN(PeerId peer, open(session, false));
  MC_RETURN_IF_ERROR(checkRemote(session, peer, requests));
  std::vector<TransferRequest> reqs;
  reqs.reserve(requests.size());
  for (const Request& r : requests)
    reqs.push_back({r.op, reinterpret_cast<void*>(r.local), r.length, peer, r.remote});
  Deadline deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_) +
                      std::chrono::nanoseconds(static_cast<int64_t>(bytes));
  MC_ASSIGN_OR_RETURN(BatchId id, engine_->submit(reqs));
  std::lock_guard<std::mutex> g(mu_);
  batches_[id] = deadline;
  return id;
}

Status P2pSessions::wait(BatchId id) {
  Deadline deadline;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = batches_.find(id);
    if (it == batches_.end()) return MC_STATUS(kNotFound, "unknown batch " << id);
    deadline = it->second;
  }
  Status st = engine_->wait(id, deadline);  // releases the batch (on timeout: fences it)
  std::lock_guard<std::mutex> g(mu_);
  batches_.erase(id);
  return st;
}

P2pSessions::State P2pSessions::check(BatchId id, Status* why) {
  Deadline deadline;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = batches_.find(id);
    if (it == batches_.end()) {
      if (why) *why = MC_STATUS(kNotFound, "unknown batch " << id);
      return State::kFailed;
    }
    deadline = it->second;
  }
  bool done = false;
  Status st = engine_->poll(id, &done);
  State out = State::kPending;
  if (!st.ok()) {
    out = State::kFailed;
  } else if (done) {
    st = engine_->wait(id, Clock::now());
    out = st.ok() ? State::kCompleted : State::kFailed;
  } else if (Clock::now() >= deadline) {
    st = engine_->wait(id, Clock::now());  // fences the buffers; dropped once its requests end
    out = st.ok() ? State::kCompleted : State::kTimedOut;
  } else {
    return State::kPending;
  }
  if (why) *why = st;
  std::lock_guard<std::mutex> g(mu_);
  batches_.erase(id);
  return out;
}

Status P2pSessions::transfer(const std::string& session, const std::vector<Request>& requests) {
  if (requests.empty()) return Status::OK();
  MC_ASSIGN_OR_RETURN(BatchId id, submit(session, requests));
  return wait(id);
}

Status P2pSessions::notify(const std::string& session, const std::string& name,
                           const std::string& msg) {
  if (name.size() > kMaxNotifyField || msg.size() > kMaxNotifyField)
    return MC_STATUS(kInvalidArgument, "notification fields are limited to " << kMaxNotifyField
                                                                             << " bytes");
  MC_ASSIGN_OR_RETURN(PeerId peer, open(session, false));
  wire::Writer w;
  w.str(name);
  w.str(msg);
  return engine_->sendMessage(peer, kNotifyChannel, w.take());
}

std::vector<P2pSessions::Notify> P2pSessions::drainNotifies() {
  std::vector<Notify> out;
  for (;;) {
    auto m = engine_->waitMessage(kNotifyChannel, Clock::now());
    if (!m.ok()) break;
    wire::Reader r(m->payload);
    Notify n;
    n.name = r.str(kMaxNotifyField);
    n.msg = r.str(kMaxNotifyField);
    if (!r.done()) {
      MC_LOG(WARN, ENGINE) << "dropping a malformed notification from engine " << m->src_engine;
      continue;
    }
    out.push_back(std::move(n));
  }
  return out;
}

}  // namespace mooncake::engine
