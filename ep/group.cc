// The EP group of a process-group communicator: its engine, its peers and an all-gather run
// on the communicator's worker (the one thread that may issue its collectives).
#include <chrono>
#include <stdexcept>

#include "ep/buffer.h"
#include "pg/communicator.h"

namespace mooncake::ep {

EpGroup groupOf(std::shared_ptr<pg::Communicator> comm) {
  if (!comm) throw std::invalid_argument("ep.Buffer: no communicator");
  EpGroup g;
  g.rank = comm->rank();
  g.size = comm->size();
  g.engine = &comm->engine();
  g.peers.resize(g.size, engine::kInvalidPeer);
  for (int r = 0; r < g.size; ++r)
    if (r != g.rank) g.peers[r] = comm->peerOf(r);
  if (comm->elastic()) {
    const std::vector<uint8_t> active = comm->activeMask();
    for (int r = 0; r < g.size; ++r)
      if (r >= static_cast<int>(active.size()) || active[r] == 0) {
        g.vacant.resize(g.size, 0);
        g.vacant[r] = 1;
      }
  }
  pg::Communicator* c = comm.get();
  const int blocks = g.size;  // (a view that changes the size meanwhile fails the op)
  g.all_gather = [c, blocks](const void* in, void* out, size_t bytes) {
    auto work = c->enqueue("ep.setup",
                           [c, in, out, bytes, blocks] { c->allGather(in, out, bytes, blocks); });
    if (!work->wait(c->options().timeout))
      throw std::runtime_error("ep.Buffer: set-up all-gather timed out");
  };
  g.keep_alive = std::move(comm);
  return g;
}

}  // namespace mooncake::ep
