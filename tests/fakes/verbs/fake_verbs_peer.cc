// Endpoint helpers and the peer process of the emulator's tests (another process of the
// same fabric: the emulator's rings and NIC state live in shared memory).
#include <arpa/inet.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/params.h"
#include "tests/fakes/verbs/fake_verbs_control.h"
#include "tests/fakes/verbs/fake_verbs_util.h"

namespace mooncake::fakeverbs::test {

const Fabric& testFabric() {
  static Fabric* f = [] {
    auto* f = new Fabric();
    const std::string given = params::getString("MC_FAKE_VERBS_CONFIG");
    if (!given.empty()) {  // a peer process: the parent's
      f->config = given;
      f->fabric = params::getString("MC_FAKE_VERBS_FABRIC");
      return f;
    }
    f->fabric = "fvt" + std::to_string(getpid());
    f->config = "/tmp/mcfv-test-" + std::to_string(getpid()) + ".conf";
    removeFabricFiles(f->fabric);  // an earlier process with this pid (a crashed run)
    std::atexit([] {
      removeFabricFiles(testFabric().fabric);
      std::remove(testFabric().config.c_str());
    });
    std::ofstream out(f->config);
    out << "# written by fake_verbs_test\n"
        << "device mlx5_0 pci=0000:17:00.0 link=ethernet ip=10.9.0.1 mtu=4096\n"
        << "device mlx5_1 pci=0000:18:00.0 link=ethernet ip=10.9.0.2 mtu=1024\n"
        << "device ib0 pci=0000:3b:00.0 link=ib lid=7 max_mr_size=1048576\n"
        << "device far0 host=elsewhere link=ethernet ip=10.9.9.9\n";
    out.close();
    setenv("MC_FAKE_VERBS_CONFIG", f->config.c_str(), 1);
    setenv("MC_FAKE_VERBS_FABRIC", f->fabric.c_str(), 1);
    setenv("MC_FAKE_VERBS_ACK_TIMEOUT_MS", "300", 1);
    setenv("MC_HOST_ID", "here", 1);
    return f;
  }();
  return *f;
}

Endpoint::~Endpoint() {
  if (qp) ibv_destroy_qp(qp);
  if (cq) ibv_destroy_cq(cq);
  if (ch) ibv_destroy_comp_channel(ch);
  if (mr) ibv_dereg_mr(mr);
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
}

bool Endpoint::open(const std::string& dev, size_t bytes, int access, int qp_access,
                    bool with_channel) {
  testFabric();
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int i = 0; i < n && ctx == nullptr; ++i)
    if (dev == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  if (ctx == nullptr) return false;
  if (ibv_query_port(ctx, 1, &port) != 0) return false;
  pd = ibv_alloc_pd(ctx);
  buf.assign(bytes, 0);
  mr = ibv_reg_mr(pd, buf.data(), bytes, access);
  if (with_channel) ch = ibv_create_comp_channel(ctx);
  cq = ibv_create_cq(ctx, 4096, nullptr, ch, 0);
  ibv_qp_init_attr ia{};
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 512;
  ia.cap.max_recv_wr = 512;
  ia.cap.max_send_sge = 4;
  ia.cap.max_recv_sge = 4;
  ia.cap.max_inline_data = 64;
  qp = ibv_create_qp(pd, &ia);
  if (mr == nullptr || cq == nullptr || qp == nullptr) return false;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = static_cast<unsigned>(qp_access);
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0;
}

std::string Endpoint::address() const {
  ibv_gid gid{};
  if (port.link_layer == IBV_LINK_LAYER_ETHERNET) ibv_query_gid(ctx, 1, gid_index, &gid);
  std::ostringstream os;
  os << qp->qp_num << " " << port.lid << " ";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof hex, "%02x", gid.raw[i]);
    os << hex;
  }
  os << " " << reinterpret_cast<uint64_t>(buf.data()) << " " << mr->rkey;
  return os.str();
}

bool parseAddress(const std::string& s, Remote* r) {
  std::istringstream in(s);
  std::string gid;
  if (!(in >> r->qpn >> r->lid >> gid >> r->addr >> r->rkey) || gid.size() != 32) return false;
  for (int i = 0; i < 16; ++i) r->gid[i] = static_cast<uint8_t>(std::stoul(gid.substr(2 * i, 2), nullptr, 16));
  return true;
}

bool Endpoint::connect(const std::string& remote, int rnr_retry, int timeout) {
  Remote r;
  if (!parseAddress(remote, &r)) return false;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = port.active_mtu;
  a.dest_qp_num = r.qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 1;
  a.ah_attr.port_num = 1;
  if (port.link_layer == IBV_LINK_LAYER_ETHERNET) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
    a.ah_attr.grh.hop_limit = 64;
  } else {
    a.ah_attr.dlid = r.lid;
  }
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
    return false;
  ibv_qp_attr b{};
  b.qp_state = IBV_QPS_RTS;
  b.sq_psn = 0;
  b.timeout = static_cast<uint8_t>(timeout);
  b.retry_cnt = 7;
  b.rnr_retry = static_cast<uint8_t>(rnr_retry);
  b.max_rd_atomic = 16;
  return ibv_modify_qp(qp, &b,
                       IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                           IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) == 0;
}

int Endpoint::post(ibv_wr_opcode op, uint64_t wr_id, size_t off, size_t len, uint64_t raddr,
                   uint32_t rkey, uint32_t imm, bool signaled) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf.data() + off), static_cast<uint32_t>(len), mr->lkey};
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

int Endpoint::postRecv(uint64_t wr_id, size_t off, size_t len) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf.data() + off), static_cast<uint32_t>(len), mr->lkey};
  ibv_recv_wr wr{};
  ibv_recv_wr* bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(qp, &wr, &bad);
}

bool Endpoint::poll(ibv_wc* wc, int timeout_ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    int n = ibv_poll_cq(cq, 1, wc);
    if (n == 1) return true;
    if (n < 0) return false;
    usleep(50);
  }
  return false;
}

// The peer: opens mlx5_1 with a buffer of argv[2] bytes, prints its address, reads the
// parent's, connects, then answers lines: "check OFF LEN SEED" -> ok|bad, "fill OFF LEN SEED",
// "exit".
int peerMain(int argc, char** argv) {
  size_t bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (1u << 20);
  Endpoint ep;
  if (!ep.open("mlx5_1", bytes)) {
    std::cout << "error open" << std::endl;
    return 2;
  }
  std::cout << ep.address() << std::endl;
  std::string remote;
  if (!std::getline(std::cin, remote) || !ep.connect(remote)) {
    std::cout << "error connect" << std::endl;
    return 2;
  }
  std::cout << "connected" << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    size_t off = 0, len = 0;
    uint64_t seed = 0;
    in >> cmd >> off >> len >> seed;
    if (cmd == "exit") break;
    if (off + len > bytes) {
      std::cout << "bad range" << std::endl;
      continue;
    }
    if (cmd == "check") std::cout << (same(ep.buf.data() + off, len, seed) ? "ok" : "bad") << std::endl;
    if (cmd == "fill") {
      fill(ep.buf.data() + off, len, seed);
      std::cout << "ok" << std::endl;
    }
  }
  return 0;
}

}  // namespace mooncake::fakeverbs::test
