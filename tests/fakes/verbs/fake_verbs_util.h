// Helpers of the emulator's own tests: a config file for the whole test binary, and an
// endpoint (context, PD, CQ, QP, one registered buffer) set up with the real verbs API.
#pragma once

#include <infiniband/verbs.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mooncake::fakeverbs::test {

// The fabric every test of the binary (and its peer processes) uses:
//   mlx5_0  RoCE 10.9.0.1  pci 0000:17:00.0        mlx5_1  RoCE 10.9.0.2  pci 0000:18:00.0
//   ib0     InfiniBand lid 7, max_mr_size 1 MiB    far0    host=elsewhere (never visible)
struct Fabric {
  std::string config;  // path
  std::string fabric;  // MC_FAKE_VERBS_FABRIC
};
const Fabric& testFabric();  // writes it and sets the environment (first call)

struct Endpoint {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* ch = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<char> buf;
  int gid_index = 3;  // RoCE v2, IPv4-mapped (ignored on IB)
  ibv_port_attr port{};
  ~Endpoint();
  // Opens `dev`, registers `bytes` with `access`, creates an RC QP (RESET -> INIT).
  bool open(const std::string& dev, size_t bytes,
            int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_READ,
            int qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
            bool with_channel = false);
  // What the other side needs: "qpn lid gid(hex) addr rkey".
  std::string address() const;
  // INIT -> RTR -> RTS toward an address from address().
  bool connect(const std::string& remote, int rnr_retry = 7, int timeout = 14);
  // Posts one work request on the buffer [off, off+len).
  int post(ibv_wr_opcode op, uint64_t wr_id, size_t off, size_t len, uint64_t raddr, uint32_t rkey,
           uint32_t imm = 0, bool signaled = true);
  int postRecv(uint64_t wr_id, size_t off, size_t len);
  // Polls one completion (busy, with a deadline); false on timeout.
  bool poll(ibv_wc* wc, int timeout_ms = 5000);
};

struct Remote {
  uint32_t qpn = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  uint64_t addr = 0;
  uint32_t rkey = 0;
};
bool parseAddress(const std::string& s, Remote* r);

inline void fill(char* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>((i * 131 + seed * 7919) >> 3);
}
inline bool same(const char* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != static_cast<char>((i * 131 + seed * 7919) >> 3)) return false;
  return true;
}

// The peer process (fake_verbs_peer.cc): run when argv[1] == "--peer".
int peerMain(int argc, char** argv);

}  // namespace mooncake::fakeverbs::test
