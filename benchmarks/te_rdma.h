// te_bench's rdma parts: the verbs emulator set up when the machine has no RDMA NIC, and the
// raw-verbs baseline (what perftest's ib_write_bw does: RDMA WRITEs posted and polled by one
// thread on one RC QP, no engine), measured on the same NICs as the engine's rdma rows.
#pragma once

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/te_common.h"
#include "engine/params.h"

namespace mooncake::bench::rdma {

// ---------------------------------------------------------------- the emulator

// When rdma is asked for, no MC_FAKE_VERBS_CONFIG is set and this machine's libibverbs finds
// no NIC: writes an emulator config with two RoCE NICs (mlx5_0, mlx5_1, each capped at
// `nic_gbps`), points LD_LIBRARY_PATH at the emulator (built from tests/fakes/verbs) and
// starts this binary again with `--emulator-conf CONF --emulator-fabric F` added (te_bench
// removes what the emulator leaves once done). Returns only when nothing had to be done.
inline void useEmulatorIfNoNic(int argc, char** argv, double nic_gbps) {
  if (params::isSet("MC_FAKE_VERBS_CONFIG")) return;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list != nullptr) ibv_free_device_list(list);
  if (list != nullptr && n > 0) return;  // real NICs: measure those
  const std::string dir = MC_FAKE_VERBS_DIR;
  if (access((dir + "/libibverbs.so.1").c_str(), R_OK) != 0) {
    std::fprintf(stderr, "te_bench: no RDMA NIC here and no verbs emulator at %s (build the "
                         "tests: ninja mc_fake_verbs)\n", dir.c_str());
    std::exit(2);
  }
  const std::string fabric = "teb" + std::to_string(getpid());
  const std::string conf = "/tmp/" + fabric + ".conf";
  FILE* f = std::fopen(conf.c_str(), "w");
  if (f == nullptr) {
    std::perror("te_bench: emulator config");
    std::exit(2);
  }
  std::fprintf(f,
               "# te_bench's verbs emulator: two RoCE NICs, %.1f Gbit/s each\n"
               "device mlx5_0 pci=0000:13:00.0 link=ethernet ip=10.9.0.1 mtu=4096 gbps=%g\n"
               "device mlx5_1 pci=0000:53:00.0 link=ethernet ip=10.9.0.2 mtu=4096 gbps=%g\n",
               nic_gbps, nic_gbps, nic_gbps);
  std::fclose(f);
  std::fprintf(stderr, "te_bench: no RDMA NIC on this machine: rdma rows run on the verbs "
                       "emulator (%s, 2 NICs of %.1f Gbit/s)\n", conf.c_str(), nic_gbps);
  setenv("MC_FAKE_VERBS_CONFIG", conf.c_str(), 1);
  setenv("MC_FAKE_VERBS_FABRIC", fabric.c_str(), 1);
  const std::string old = params::getSystem("LD_LIBRARY_PATH");
  setenv("LD_LIBRARY_PATH", (dir + (old.empty() ? "" : ":" + old)).c_str(), 1);
  std::vector<std::string> args(argv, argv + argc);
  for (const char* a : {"--emulator-conf", conf.c_str(), "--emulator-fabric", fabric.c_str()})
    args.push_back(a);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::fflush(stdout);
  execv("/proc/self/exe", cargs.data());
  std::perror("te_bench: re-exec with the emulator");
  std::exit(2);
}

// ---------------------------------------------------------------- raw verbs

// The ping-pong's message: what the engine's notification is (16 bytes, a SEND from
// registered memory); receives posted ahead on each side.
constexpr uint32_t kPingBytes = 16;
constexpr uint32_t kPingRecvs = 16;

// One side of a raw RC connection on one NIC: PD, CQ, one MR over `len` bytes, one QP.
struct RawSide {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<char> buf;
  ibv_port_attr port{};
  ibv_gid gid{};
  int gid_index = 0;

  // What the other side needs.
  struct Addr {
    uint32_t qpn, psn;
    uint16_t lid;
    uint8_t gid[16];
    uint32_t mtu;
    uint64_t addr;
    uint32_t rkey;
  };

  bool open(const std::string& nic, uint64_t len, int max_wr) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    for (int i = 0; list != nullptr && i < n && ctx == nullptr; ++i)
      if (nic == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
    if (list != nullptr) ibv_free_device_list(list);
    if (ctx == nullptr || ibv_query_port(ctx, 1, &port) != 0) return false;
    // RoCE: the RoCE v2 GID with an IPv4-mapped address (index 3 in mlx5's table, as the
    // emulator lays it out); InfiniBand: the LID.
    gid_index = port.link_layer == IBV_LINK_LAYER_INFINIBAND ? 0 : 3;
    if (ibv_query_gid(ctx, 1, gid_index, &gid) != 0) return false;
    pd = ibv_alloc_pd(ctx);
    cq = pd ? ibv_create_cq(ctx, 4 * max_wr, nullptr, nullptr, 0) : nullptr;
    buf.assign(len, 1);
    mr = cq ? ibv_reg_mr(pd, buf.data(), len,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)
            : nullptr;
    if (mr == nullptr) return false;
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = static_cast<uint32_t>(max_wr);
    ia.cap.max_recv_wr = kPingRecvs;
    ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    qp = ibv_create_qp(pd, &ia);
    if (qp == nullptr) return false;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                     IBV_QP_ACCESS_FLAGS) == 0;
  }

  Addr mine(uint32_t psn) const {
    Addr a{};
    a.qpn = qp->qp_num;
    a.psn = psn;
    a.lid = port.lid;
    std::memcpy(a.gid, gid.raw, 16);
    a.mtu = port.active_mtu;
    a.addr = reinterpret_cast<uint64_t>(buf.data());
    a.rkey = mr->rkey;
    return a;
  }

  bool connect(uint32_t my_psn, const Addr& r) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(std::min<uint32_t>(port.active_mtu, r.mtu));
    a.dest_qp_num = r.qpn;
    a.rq_psn = r.psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = 1;
    if (port.link_layer == IBV_LINK_LAYER_INFINIBAND) {
      a.ah_attr.dlid = r.lid;
    } else {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
      a.ah_attr.grh.hop_limit = 64;
    }
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                  IBV_QP_MIN_RNR_TIMER) != 0)
      return false;
    ibv_qp_attr b{};
    b.qp_state = IBV_QPS_RTS;
    b.sq_psn = my_psn;
    b.timeout = 14;
    b.retry_cnt = 7;
    b.rnr_retry = 7;
    b.max_rd_atomic = 16;
    return ibv_modify_qp(qp, &b, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                     IBV_QP_MAX_QP_RD_ATOMIC) == 0;
  }

  // The last 2 * kPingBytes of the buffer: a receive slot and a send slot for the ping-pong
  // (the WRITEs of the ping-pong stay in the first 4 KiB).
  char* pingRecvSlot() { return buf.data() + buf.size() - 2 * kPingBytes; }
  char* pingSendSlot() { return buf.data() + buf.size() - kPingBytes; }

  bool postRecv() {
    ibv_sge sge{reinterpret_cast<uint64_t>(pingRecvSlot()), kPingBytes, mr->lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return ibv_post_recv(qp, &wr, &bad) == 0;
  }

  bool post(ibv_wr_opcode op, uint64_t local_off, uint32_t len, uint64_t raddr, uint32_t rkey) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf.data() + local_off), len, mr->lkey};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = 2;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad) == 0;
  }
  bool postSend() { return post(IBV_WR_SEND, buf.size() - kPingBytes, kPingBytes, 0, 0); }

  // Busy-polls until `recvs` receives and `sends` send completions came (all successful).
  // Completions that come early (the peer's next message while this side waits for its own
  // send's completion) count for the next call. False after 10 s without a completion (the
  // other side failed: this side must not spin on).
  bool reap(int recvs, int sends) {
    recvs -= early_recvs;
    sends -= early_sends;
    ibv_wc wc[8];
    double last = nowUs();
    while (recvs > 0 || sends > 0) {
      int k = ibv_poll_cq(cq, 8, wc);
      if (k < 0) return false;
      if (k == 0) {
        if (nowUs() - last > 10e6) {
          std::fprintf(stderr, "verbs_raw ping-pong: no completion for 10 s\n");
          return false;
        }
        sched_yield();
      } else {
        last = nowUs();
      }
      for (int j = 0; j < k; ++j) {
        if (wc[j].status != IBV_WC_SUCCESS) {
          std::fprintf(stderr, "verbs_raw ping-pong: %s\n", ibv_wc_status_str(wc[j].status));
          return false;
        }
        if (wc[j].opcode == IBV_WC_RECV) {
          --recvs;
        } else {
          --sends;
        }
      }
    }
    early_recvs = -recvs;
    early_sends = -sends;
    return true;
  }
  int early_recvs = 0, early_sends = 0;

  ~RawSide() {
    if (qp) ibv_destroy_qp(qp);
    if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
  }
};

inline bool sendBytes(int fd, const void* p, size_t n) {
  return send(fd, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
}
inline bool recvBytes(int fd, void* p, size_t n) {
  return recv(fd, p, n, MSG_WAITALL) == static_cast<ssize_t>(n);
}

// The target process of the raw baseline: connects to the initiator's port, trades QP
// addresses, then waits (its memory is written one-sidedly) until the initiator says done.
inline int runRawTarget(uint16_t port, const std::string& nic, uint64_t len, int max_wr) {
  RawSide s;
  if (!s.open(nic, len, max_wr)) {
    std::fprintf(stderr, "verbs-target: cannot open %s\n", nic.c_str());
    return 2;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return 2;
  RawSide::Addr theirs{};
  const uint32_t psn = 4242;
  RawSide::Addr me = s.mine(psn);
  if (!recvBytes(fd, &theirs, sizeof theirs) || !s.connect(psn, theirs) ||
      !sendBytes(fd, &me, sizeof me))
    return 2;
  // Commands from the initiator: 'p' + u32 count: answer that many ping-pong messages
  // (busy-polling, as perftest's latency tests do), then say so; anything else: done.
  char cmd = 0;
  while (recvBytes(fd, &cmd, 1) && cmd == 'p') {
    uint32_t count = 0;
    if (!recvBytes(fd, &count, sizeof count)) break;
    bool ok = true;
    for (uint32_t i = 0; ok && i < kPingRecvs; ++i) ok = s.postRecv();
    const char ready = ok ? 1 : 0;
    if (!sendBytes(fd, &ready, 1) || !ok) break;
    for (uint32_t i = 0; ok && i < count; ++i)
      ok = s.reap(1, 0) && s.postRecv() && s.postSend() && s.reap(0, 1);
    const char fin = ok ? 1 : 0;
    if (!sendBytes(fd, &fin, 1)) break;
  }
  close(fd);
  return 0;
}

struct RawResult {
  double gbps = 0, p50_us = 0, p99_us = 0;
  int iters = 0;
};

// The initiator: per size, `iters` messages of `size` bytes, each cut into `slice`-byte RDMA
// WRITEs of which at most `max_wr` are outstanding, timed from the first post to the last
// completion (the engine rows' one-request-in-flight pattern, without the engine). rtt: one
// 4 KiB WRITE and its completion, i.e. the write's round trip.
class RawInitiator {
 public:
  bool start(const std::string& nic, uint64_t len, int max_wr) {
    max_wr_ = max_wr;
    if (!side_.open(nic, len, max_wr)) return false;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen) != 0)
      return false;
    child_ = spawnSelf({"--role", "verbs-target", "--sock-port", std::to_string(ntohs(a.sin_port)),
                        "--max-bytes", std::to_string(len), "--name", nic});
    fd_ = accept(lfd, nullptr, nullptr);
    close(lfd);
    if (fd_ < 0) return false;
    const uint32_t psn = 777;
    RawSide::Addr me = side_.mine(psn);
    if (!sendBytes(fd_, &me, sizeof me) || !recvBytes(fd_, &remote_, sizeof remote_)) return false;
    return side_.connect(psn, remote_);
  }

  RawResult write(uint64_t size, uint64_t slice, int iters, int warm) {
    RawResult r;
    std::vector<double> lat;
    double start = 0;
    for (int i = 0; i < warm + iters; ++i) {
      if (i == warm) start = nowUs();
      double t0 = nowUs();
      if (!oneMessage(size, slice)) return r;
      if (i >= warm) lat.push_back(nowUs() - t0);
    }
    double end = nowUs();
    r.gbps = static_cast<double>(size) * iters / ((end - start) * 1e-6) / 1e9;
    r.p50_us = percentile(lat, 50);
    r.p99_us = percentile(lat, 99);
    r.iters = iters;
    return r;
  }

  // The raw form of the engine's notify_rtt: a 4 KiB WRITE, then a 16-byte SEND behind it
  // (what the engine's notification is), the target's thread busy-polls its CQ and answers
  // with a SEND; one sample is the time from the WRITE's post to the answer's receive.
  RawResult pingPong(int iters, int warm) {
    RawResult r;
    const uint32_t count = static_cast<uint32_t>(warm + iters);
    char ready = 0;
    const char cmd = 'p';
    if (!sendBytes(fd_, &cmd, 1) || !sendBytes(fd_, &count, sizeof count) ||
        !recvBytes(fd_, &ready, 1) || ready != 1)
      return r;
    for (uint32_t i = 0; i < kPingRecvs; ++i)
      if (!side_.postRecv()) return r;
    std::vector<double> lat;
    double total = 0;
    for (int i = 0; i < warm + iters; ++i) {
      double t0 = nowUs();
      if (!side_.post(IBV_WR_RDMA_WRITE, 0, 4096, remote_.addr, remote_.rkey) ||
          !side_.postSend() || !side_.reap(1, 2) || !side_.postRecv())
        return r;
      double t1 = nowUs();
      if (i >= warm) {
        lat.push_back(t1 - t0);
        total += t1 - t0;
      }
    }
    char fin = 0;
    if (!recvBytes(fd_, &fin, 1) || fin != 1) return r;
    r.gbps = 4096.0 * iters / (total * 1e-6) / 1e9;
    r.p50_us = percentile(lat, 50);
    r.p99_us = percentile(lat, 99);
    r.iters = iters;
    return r;
  }

  ~RawInitiator() {
    if (fd_ >= 0) {
      char done = 1;
      (void)sendBytes(fd_, &done, 1);
      close(fd_);
    }
    if (child_ > 0) waitChild(child_, 15000);
  }

 private:
  bool oneMessage(uint64_t size, uint64_t slice) {
    uint64_t posted = 0, done = 0;
    const uint64_t total = (size + slice - 1) / slice;
    int inflight = 0;
    uint64_t off = 0;
    ibv_wc wc[32];
    while (done < total) {
      while (posted < total && inflight < max_wr_) {
        const uint64_t n = std::min(slice, size - off);
        ibv_sge sge{reinterpret_cast<uint64_t>(side_.buf.data() + off), static_cast<uint32_t>(n),
                    side_.mr->lkey};
        ibv_send_wr wr{};
        ibv_send_wr* bad = nullptr;
        wr.wr_id = posted;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr.rdma.remote_addr = remote_.addr + off;
        wr.wr.rdma.rkey = remote_.rkey;
        if (ibv_post_send(side_.qp, &wr, &bad) != 0) return false;
        ++posted;
        ++inflight;
        off += n;
      }
      int k = ibv_poll_cq(side_.cq, 32, wc);
      if (k < 0) return false;
      for (int j = 0; j < k; ++j) {
        if (wc[j].status != IBV_WC_SUCCESS) {
          std::fprintf(stderr, "verbs_raw: %s\n", ibv_wc_status_str(wc[j].status));
          return false;
        }
      }
      done += static_cast<uint64_t>(k);
      inflight -= k;
    }
    return true;
  }

  RawSide side_;
  RawSide::Addr remote_{};
  int fd_ = -1;
  pid_t child_ = -1;
  int max_wr_ = 64;
};

}  // namespace mooncake::bench::rdma
