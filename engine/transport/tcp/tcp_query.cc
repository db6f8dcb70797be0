// Descriptor query, initiator side (the target's answer is in tcp_conn.cc, HELLO of a query
// connection). Blocking, with the caller's deadline; never touches the progress thread.
#include "engine/transport/tcp/tcp_query.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "engine/transport/tcp/tcp_socket.h"
#include "engine/transport/tcp/tcp_transport.h"

namespace mooncake::engine::tcp {

namespace {

// One attempt. *dropped: the target closed without answering (its admission limits), worth
// retrying until the deadline.
Result<SegmentDesc> queryOnce(const std::string& host, uint16_t port, const Hello& hello,
                              const std::string& secret, Deadline deadline, bool* dropped) {
  const std::string label = host + ":" + std::to_string(port);
  Result<int> fd = sock::connectTo(host, port, deadline, false, 0);
  if (!fd.ok())
    return Status(fd.status().code(), "descriptor query to " + label + ": " +
                                          fd.status().message());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{*fd};
  auto fail = [&](const Status& st) {
    return Status(st.code(), "descriptor query to " + label + ": " + st.message());
  };
  uint64_t proven = 0;
  Result<FrameHeader> answer = helloExchange(*fd, hello, secret, "", 0, &proven, deadline,
                                             dropped);
  if (!answer.ok()) return fail(answer.status());
  const FrameHeader& r = *answer;
  if (r.type != FrameType::kDesc || r.length == 0 || r.length > kMaxDescBytes)
    return fail(MC_STATUS(kProtocol, "unexpected answer type " << int(r.type) << " of "
                                                               << r.length << " bytes"));
  std::string body(r.length, '\0');
  Status st = sock::recvAll(*fd, body.data(), body.size(), deadline);
  if (!st.ok()) return fail(st);
  auto desc = SegmentDesc::parse(body);
  if (!desc.ok()) return fail(desc.status());
  if (desc->engine_id != proven || desc->engine_id == 0)  // the engine whose proof we checked
    return fail(MC_STATUS(kProtocol, "descriptor of another engine"));
  return desc;
}

}  // namespace

Result<SegmentDesc> queryDescriptor(const std::string& host, uint16_t port,
                                    const std::string& secret, uint64_t engine_id,
                                    Deadline deadline) {
  Hello hello;
  hello.engine_id = engine_id;
  hello.role = ConnRole::kQuery;
  int backoff_ms = 5;
  for (;;) {
    bool dropped = false;
    auto d = queryOnce(host, port, hello, secret, deadline, &dropped);
    if (d.ok() || !dropped || sock::msUntil(deadline) <= backoff_ms) return d;
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(backoff_ms * 2, 200);
  }
}

}  // namespace mooncake::engine::tcp
