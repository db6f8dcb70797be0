// The EP group of a process-group communicator: its engine, its peers and an all-gather run
// on the communicator's worker (the one thread that may issue its collectives).
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "ep/buffer.h"
#include "pg/communicator.h"

namespace mooncake::ep {

namespace {

// Runs fn on the communicator's worker (the one thread that issues its collectives), bounded
// by the group's timeout.
void onWorker(pg::Communicator* c, const char* what, std::function<void()> fn) {
  auto work = c->enqueue("ep.setup", std::move(fn));
  if (!work->wait(c->options().timeout))
    throw std::runtime_error(std::string("ep.Buffer: set-up ") + what + " timed out");
}

}  // namespace

EpGroup groupOf(std::shared_ptr<pg::Communicator> comm) {
  if (!comm) throw std::invalid_argument("ep.Buffer: no communicator");
  pg::Communicator* c = comm.get();
  // An elastic group's membership is read after a barrier: an op applies the views decided
  // before it (a recover_ranks another rank made), so every rank reads the same view.
  if (c->elastic()) onWorker(c, "barrier", [c] { c->barrier(); });
  EpGroup g;
  g.rank = c->rank();
  g.size = c->size();
  g.engine = &c->engine();
  g.peers.resize(g.size, engine::kInvalidPeer);
  for (int r = 0; r < g.size; ++r)
    if (r != g.rank) g.peers[r] = c->peerOf(r);
  if (c->elastic()) {
    const std::vector<uint8_t> active = c->activeMask();
    for (int r = 0; r < g.size; ++r)
      if (r >= static_cast<int>(active.size()) || active[r] == 0) {
        g.vacant.resize(g.size, 0);
        g.vacant[r] = 1;
      }
  }
  const int blocks = g.size;  // (a view that changes the size meanwhile fails the op)
  g.all_gather = [c, blocks](const void* in, void* out, size_t bytes) {
    // The op owns its buffers: one that outlives a timed-out wait writes into them only.
    const size_t total = bytes * static_cast<size_t>(blocks);
    auto mine = std::make_shared<std::string>(static_cast<const char*>(in), bytes);
    auto all = std::make_shared<std::string>(total, '\0');
    onWorker(c, "all-gather", [c, mine, all, bytes, blocks] {
      c->allGather(mine->data(), all->data(), bytes, blocks);
    });
    std::memcpy(out, all->data(), total);
  };
  g.keep_alive = std::move(comm);
  return g;
}

}  // namespace mooncake::ep
