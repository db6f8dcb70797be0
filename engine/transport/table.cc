// The static priority table of transports (DESIGN.md section 3): the one place that knows
// which transports exist, their names and how to make them. The engine walks it in order;
// nothing else dispatches on transport names.
#include <cstring>

#include "engine/transport/transport.h"
#include "mooncake/config.h"

namespace mooncake::engine {

namespace {

// Rows in TransportKind order (the priority order): cuda, shm, rdma, tcp.
const TransportRow kTable[kNumTransportKinds] = {
    {TransportKind::kCuda, "cuda", &makeCudaTransport},  // GPU memory only (movesHostMemory)
    {TransportKind::kShm, "shm", &makeShmTransport},
#if MC_HAVE_RDMA
    {TransportKind::kRdma, "rdma", &makeRdmaTransport},
#else
    {TransportKind::kRdma, "rdma", nullptr},  // built without libibverbs (MC_WITH_RDMA=OFF)
#endif
    {TransportKind::kTcp, "tcp", &makeTcpTransport},
};

}  // namespace

const TransportRow* transportTable() { return kTable; }

const TransportRow* findTransport(std::string_view name) {
  for (const auto& row : kTable)
    if (name == row.name) return &row;
  return nullptr;
}

const char* transportName(TransportKind k) {
  int i = static_cast<int>(k);
  return i >= 0 && i < kNumTransportKinds ? kTable[i].name : "?";
}

}  // namespace mooncake::engine
