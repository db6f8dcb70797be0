// The emulator's exported libibverbs API: devices, contexts, PDs, MRs, CQs and completion
// channels, QPs and their state machine, and the context ops table through which the inline
// verbs (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) are called.
// Semantics follow the real library and rdma-core's man pages; what the emulator does not
// support fails with EOPNOTSUPP rather than pretending.
#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tests/fakes/verbs/fv_internal.h"

using namespace mooncake::fakeverbs;

namespace {

struct FvDevice {
  ibv_device dev;  // first
  int index;       // in fabric().devices
};

std::mutex g_list_mu;
std::vector<FvDevice*> g_devices;  // created once, never freed (as libibverbs' own list)

Ctx* ctxOf(ibv_context* c) { return reinterpret_cast<Ctx*>(c); }
Qp* qpOf(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
Cq* cqOf(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }

int pollCq(ibv_cq* cq, int n, ibv_wc* wc) {
  Cq* c = cqOf(cq);
  std::lock_guard<std::mutex> g(c->mu);
  if (c->overrun.load()) return -1;
  int k = 0;
  while (k < n && !c->q.empty()) {
    wc[k++] = c->q.front().first;
    if (c->q.front().second) c->q.front().second->fetch_sub(1);  // its send-queue slot is free
    c->q.pop_front();
  }
  return k;
}

int reqNotifyCq(ibv_cq* cq, int solicited_only) {
  (void)solicited_only;  // every completion counts (a superset of solicited-only)
  Cq* c = cqOf(cq);
  bool fire = false;
  {
    std::lock_guard<std::mutex> g(c->mu);
    if (c->ch == nullptr) return EINVAL;
    // Armed: the next completion added raises one event. Completions already queued do not
    // (as on hardware: poll after arming to close the race).
    c->armed = true;
  }
  (void)fire;
  return 0;
}

int postSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* q = qpOf(qp);
  std::lock_guard<std::mutex> g(q->mu);
  for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if (qp->state < IBV_QPS_RTS && qp->state != IBV_QPS_ERR) {
      *bad = w;
      return EINVAL;
    }
    // A slot is busy until its completion is polled (mlx5 frees it then, not when the NIC
    // writes the completion).
    if (q->wrs.size() + static_cast<size_t>(q->sq_unpolled->load()) >= q->cap.max_send_wr) {
      *bad = w;
      return ENOMEM;
    }
    if (w->num_sge < 0 || static_cast<uint32_t>(w->num_sge) > q->cap.max_send_sge) {
      *bad = w;
      return EINVAL;
    }
    switch (w->opcode) {
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_WRITE_WITH_IMM:
      case IBV_WR_SEND:
      case IBV_WR_SEND_WITH_IMM:
      case IBV_WR_RDMA_READ:
        break;
      default:
        *bad = w;
        return EOPNOTSUPP;
    }
    SendWr s;
    s.wr_id = w->wr_id;
    s.op = w->opcode;
    s.signaled = q->sq_sig_all || (w->send_flags & IBV_SEND_SIGNALED);
    s.imm = ntohl(w->imm_data);
    s.raddr = w->wr.rdma.remote_addr;
    s.rkey = w->wr.rdma.rkey;
    for (int i = 0; i < w->num_sge; ++i) s.len += w->sg_list[i].length;
    if ((w->send_flags & IBV_SEND_INLINE) && w->opcode != IBV_WR_RDMA_READ) {
      if (s.len > q->cap.max_inline_data) {
        *bad = w;
        return EINVAL;
      }
      s.is_inline = true;
      for (int i = 0; i < w->num_sge; ++i)
        s.inline_data.append(reinterpret_cast<const char*>(w->sg_list[i].addr),
                             w->sg_list[i].length);
    } else {
      s.sge.assign(w->sg_list, w->sg_list + w->num_sge);
    }
    if (qp->state == IBV_QPS_ERR) {  // accepted, then flushed at once
      completeSend(q, s, IBV_WC_WR_FLUSH_ERR);
      continue;
    }
    s.msn = q->next_msn++;
    q->wrs.push_back(std::move(s));
  }
  ring(q->ctx->db);
  return 0;
}

int postRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Qp* q = qpOf(qp);
  std::lock_guard<std::mutex> g(q->mu);
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    if (qp->state == IBV_QPS_RESET) {
      *bad = w;
      return EINVAL;
    }
    if (q->rq.size() >= q->cap.max_recv_wr ||
        static_cast<uint32_t>(w->num_sge) > q->cap.max_recv_sge) {
      *bad = w;
      return ENOMEM;
    }
    RecvWr r;
    r.wr_id = w->wr_id;
    r.sge.assign(w->sg_list, w->sg_list + w->num_sge);
    if (qp->state == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = r.wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = qp->qp_num;
      cqOf(qp->recv_cq)->add(wc);
      continue;
    }
    q->rq.push_back(std::move(r));
  }
  ring(q->ctx->db);
  return 0;
}

const ibv_context_ops kOps = [] {
  ibv_context_ops o{};
  o.poll_cq = pollCq;
  o.req_notify_cq = reqNotifyCq;
  o.post_send = postSend;
  o.post_recv = postRecv;
  return o;
}();

uint64_t guidOf(int index) { return 0x0002c90300000000ull + static_cast<uint64_t>(index) * 0x10 + 1; }

}  // namespace

namespace mooncake::fakeverbs {

void Cq::add(const ibv_wc& wc, SlotCount slots) {
  Channel* fire = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    if (overrun.load()) return;  // in error: nothing more is added
    uint32_t knob = 1;
    const bool forced = ctx->shm->overrun_next.load() == 1 &&
                        ctx->shm->overrun_next.compare_exchange_strong(knob, 0);
    if (q.size() >= cap || forced) {
      overrun.store(true);  // as hardware: the CQ is in error, polls fail, its QPs fail
      ctx->shm->cq_overruns.fetch_add(1);
      ring(ctx->db);  // the NIC thread moves its QPs to the error state
      return;
    }
    if (slots) slots->fetch_add(1);
    q.push_back({wc, std::move(slots)});
    if (armed && ch != nullptr) {
      armed = false;
      fire = ch;
    }
  }
  if (fire != nullptr) {
    {
      std::lock_guard<std::mutex> g(fire->mu);
      fire->events.push_back(&cq);
    }
    char b = 1;
    ssize_t w = write(fire->wfd, &b, 1);
    (void)w;
  }
}

Mr* Ctx::findMr(uint32_t key) {
  auto it = mrs.find(key);
  return it == mrs.end() ? nullptr : it->second;
}

}  // namespace mooncake::fakeverbs

// The exported API (the library is built with hidden visibility; libibverbs.map versions it).
#pragma GCC visibility push(default)
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
extern "C" {

ibv_device** ibv_get_device_list(int* num) {
  const Fabric& f = fabric();
  if (f.visible.empty()) {
    if (num != nullptr) *num = 0;
    // Not configured is the normal state of a process that uses no emulated NIC: say nothing.
    if (!f.error.empty() && f.error != "MC_FAKE_VERBS_CONFIG is not set") std::fprintf(stderr, "fake verbs: no devices: %s\n", f.error.c_str());
    auto** empty = static_cast<ibv_device**>(calloc(1, sizeof(ibv_device*)));
    return empty;
  }
  {
    std::lock_guard<std::mutex> g(g_list_mu);
    if (g_devices.empty()) {
      for (int i : f.visible) {
        auto* d = new FvDevice();
        d->index = i;
        d->dev.node_type = IBV_NODE_CA;
        d->dev.transport_type = IBV_TRANSPORT_IB;
        std::snprintf(d->dev.name, sizeof d->dev.name, "%s", f.devices[i].name.c_str());
        std::snprintf(d->dev.dev_name, sizeof d->dev.dev_name, "uverbs%d", i);
        std::snprintf(d->dev.dev_path, sizeof d->dev.dev_path, "%s/class/infiniband_verbs/uverbs%d",
                      f.sysfs.c_str(), i);
        std::snprintf(d->dev.ibdev_path, sizeof d->dev.ibdev_path, "%s/class/infiniband/%s",
                      f.sysfs.c_str(), f.devices[i].name.c_str());
        g_devices.push_back(d);
      }
    }
  }
  auto** list = static_cast<ibv_device**>(calloc(g_devices.size() + 1, sizeof(ibv_device*)));
  for (size_t i = 0; i < g_devices.size(); ++i) list[i] = &g_devices[i]->dev;
  if (num != nullptr) *num = static_cast<int>(g_devices.size());
  return list;
}

void ibv_free_device_list(ibv_device** list) { free(list); }

const char* ibv_get_device_name(ibv_device* d) { return d->name; }

__be64 ibv_get_device_guid(ibv_device* d) {
  return htobe64(guidOf(reinterpret_cast<FvDevice*>(d)->index));
}

int ibv_fork_init(void) { return 0; }

ibv_context* ibv_open_device(ibv_device* device) {
  auto* fd = reinterpret_cast<FvDevice*>(device);
  const Fabric& f = fabric();
  const DevCfg& cfg = f.devices[fd->index];
  auto* c = new Ctx();
  c->ctx.device = device;
  c->ctx.ops = kOps;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = -1;
  c->ctx.num_comp_vectors = 1;
  pthread_mutex_init(&c->ctx.mutex, nullptr);
  c->ctx.abi_compat = nullptr;  // not extended: ibv_query_port uses the exported symbol
  c->dev = fd->index;
  c->shm = openDevShm(devShmName(f.id, cfg.host, cfg.name));
  static std::atomic<uint32_t> ctx_seq{0};
  c->db_name = "/mcfv-" + f.id + "-db-" + std::to_string(getpid()) + "-" +
               std::to_string(ctx_seq.fetch_add(1));
  c->db = mapDoorbell(c->db_name, true);
  if (c->shm == nullptr || c->db == nullptr) {
    errno = ENOMEM;
    delete c;
    return nullptr;
  }
  double gbps = cfg.gbps > 0 ? cfg.gbps : f.default_gbps;
  if (gbps > 0) c->shm->cap_bytes_per_s.store(static_cast<uint64_t>(gbps * 1e9 / 8));
  if (cfg.start_down) c->shm->port_state.store(kPortDown);
  c->nic = std::thread([c] { nicLoop(c); });
  return &c->ctx;
}

int ibv_close_device(ibv_context* ctx) {
  Ctx* c = ctxOf(ctx);
  c->stop.store(true);
  ring(c->db);
  if (c->nic.joinable()) c->nic.join();
  unmapDoorbell(c->db);
  shm_unlink(c->db_name.c_str());
  munmap(c->shm, sizeof(DevShm));
  delete c;
  return 0;
}

int ibv_query_device(ibv_context* ctx, ibv_device_attr* a) {
  const DevCfg& cfg = fabric().devices[ctxOf(ctx)->dev];
  std::memset(a, 0, sizeof *a);
  std::snprintf(a->fw_ver, sizeof a->fw_ver, "mooncake-fake-verbs");
  a->node_guid = htobe64(guidOf(ctxOf(ctx)->dev));
  a->sys_image_guid = a->node_guid;
  a->max_mr_size = cfg.max_mr_size;
  a->page_size_cap = 4096;
  a->vendor_id = 0x15b3;
  a->max_qp = 1 << 16;
  a->max_qp_wr = 16384;
  a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN;
  a->max_sge = 16;
  a->max_sge_rd = 16;
  a->max_cq = 1 << 16;
  a->max_cqe = cfg.max_cqe;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->max_res_rd_atom = 1 << 20;
  a->max_srq = 0;
  a->max_pkeys = 1;
  a->phys_port_cnt = 1;
  return 0;
}

// The compat symbol the ibv_query_port() macro calls for a context that is not "extended":
// the caller passes a zeroed struct ibv_port_attr.
int ibv_query_port(ibv_context* ctx, uint8_t port, struct _compat_ibv_port_attr* out) {
  if (port != 1) return EINVAL;
  Ctx* c = ctxOf(ctx);
  const DevCfg& cfg = fabric().devices[c->dev];
  auto* a = reinterpret_cast<ibv_port_attr*>(out);
  bool up = c->shm->port_state.load() == kPortActive;
  a->state = up ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = static_cast<ibv_mtu>(cfg.mtu);
  a->gid_tbl_len = cfg.ngids;
  a->max_msg_sz = 1u << 31;
  a->pkey_tbl_len = 1;
  a->lid = cfg.ib && up ? cfg.lid : 0;  // a down InfiniBand port has no LID (the SM assigns it)
  a->sm_lid = cfg.ib ? 1 : 0;
  a->active_width = 2;   // 4x
  a->active_speed = 64;  // HDR
  a->phys_state = up ? 5 : 3;
  a->link_layer = cfg.ib ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
  return 0;
}

int ibv_query_gid(ibv_context* ctx, uint8_t port, int index, union ibv_gid* gid) {
  const DevCfg& cfg = fabric().devices[ctxOf(ctx)->dev];
  if (port != 1 || index < 0 || index >= cfg.ngids) return -1;
  std::memcpy(gid->raw, cfg.gids[index], 16);
  return 0;
}

int _ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* e,
                      uint32_t flags, size_t entry_size) {
  (void)flags;
  const DevCfg& cfg = fabric().devices[ctxOf(ctx)->dev];
  if (entry_size < sizeof(ibv_gid_entry)) return EINVAL;
  if (port != 1) return EINVAL;
  if (index >= static_cast<uint32_t>(cfg.ngids)) return ENODATA;
  std::memset(e, 0, sizeof *e);
  std::memcpy(e->gid.raw, cfg.gids[index], 16);
  e->gid_index = index;
  e->port_num = port;
  e->gid_type = cfg.gid_types[index];
  e->ndev_ifindex = cfg.ib ? 0 : 1000 + static_cast<uint32_t>(ctxOf(ctx)->dev);
  return 0;
}

const char* ibv_wc_status_str(enum ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "unknown";
  }
}

const char* ibv_port_state_str(enum ibv_port_state s) {
  switch (s) {
    case IBV_PORT_DOWN: return "PORT_DOWN";
    case IBV_PORT_INIT: return "PORT_INIT";
    case IBV_PORT_ARMED: return "PORT_ARMED";
    case IBV_PORT_ACTIVE: return "PORT_ACTIVE";
    default: return "invalid state";
  }
}

// ---- completion channels and CQs ----

ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  auto* ch = new Channel();
  ch->ch.context = ctx;
  ch->ch.fd = fds[0];
  ch->ch.refcnt = 0;
  ch->wfd = fds[1];
  return &ch->ch;
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  auto* ch = reinterpret_cast<Channel*>(channel);
  if (ch->ch.refcnt != 0) return EBUSY;
  close(ch->ch.fd);
  close(ch->wfd);
  delete ch;
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* channel,
                      int comp_vector) {
  (void)comp_vector;
  if (cqe <= 0 || cqe > fabric().devices[ctxOf(ctx)->dev].max_cqe) {
    errno = EINVAL;
    return nullptr;
  }
  auto* c = new Cq();
  c->ctx = ctxOf(ctx);
  c->cq.context = ctx;
  c->cq.channel = channel;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  pthread_mutex_init(&c->cq.mutex, nullptr);
  pthread_cond_init(&c->cq.cond, nullptr);
  c->cap = static_cast<size_t>(cqe);
  c->ch = reinterpret_cast<Channel*>(channel);
  if (c->ch != nullptr) ++c->ch->ch.refcnt;
  return &c->cq;
}

int ibv_resize_cq(ibv_cq* cq, int cqe) {
  Cq* c = cqOf(cq);
  std::lock_guard<std::mutex> g(c->mu);
  if (cqe <= 0 || cqe > fabric().devices[c->ctx->dev].max_cqe ||
      static_cast<size_t>(cqe) < c->q.size())
    return EINVAL;
  c->cap = static_cast<size_t>(cqe);
  cq->cqe = cqe;
  return 0;
}

int ibv_destroy_cq(ibv_cq* cq) {
  Cq* c = cqOf(cq);
  if (c->ch != nullptr) --c->ch->ch.refcnt;
  delete c;
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  auto* ch = reinterpret_cast<Channel*>(channel);
  char b;
  ssize_t r = read(ch->ch.fd, &b, 1);  // blocks unless the caller made the fd non-blocking
  if (r != 1) return -1;
  std::lock_guard<std::mutex> g(ch->mu);
  if (ch->events.empty()) return -1;
  *cq = ch->events.front();
  ch->events.pop_front();
  *cq_context = (*cq)->cq_context;
  return 0;
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int n) {
  pthread_mutex_lock(&cq->mutex);
  cq->comp_events_completed += n;
  pthread_mutex_unlock(&cq->mutex);
}

// ---- queue pairs ----

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (attr->qp_type != IBV_QPT_RC || attr->srq != nullptr) {
    errno = EOPNOTSUPP;  // the emulator runs reliable-connected QPs only
    return nullptr;
  }
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  // Above the device's limits (ibv_query_device: max_qp_wr 16384, max_sge 16, 256 bytes
  // inline) the kernel refuses the QP rather than clamp it.
  if (attr->cap.max_send_wr > 16384 || attr->cap.max_recv_wr > 16384 ||
      attr->cap.max_send_sge > 16 || attr->cap.max_recv_sge > 16 ||
      attr->cap.max_inline_data > 256) {
    errno = EINVAL;
    return nullptr;
  }
  Pd* p = reinterpret_cast<Pd*>(pd);
  Ctx* c = p->ctx;
  // NicControl::refuseQps.
  int64_t refuse = c->shm->refuse_qp.load();
  while (refuse > 0 && !c->shm->refuse_qp.compare_exchange_weak(refuse, refuse - 1)) {
  }
  if (refuse > 0) {
    errno = ENOMEM;
    return nullptr;
  }
  const Fabric& f = fabric();
  const DevCfg& cfg = f.devices[c->dev];
  auto* q = new Qp();
  q->ctx = c;
  q->qp.context = pd->context;
  q->qp.qp_context = attr->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = attr->send_cq;
  q->qp.recv_cq = attr->recv_cq;
  q->qp.qp_type = IBV_QPT_RC;
  q->qp.state = IBV_QPS_RESET;
  pthread_mutex_init(&q->qp.mutex, nullptr);
  pthread_cond_init(&q->qp.cond, nullptr);
  q->cap = attr->cap;
  q->cap.max_send_wr = std::max<uint32_t>(1, attr->cap.max_send_wr);
  q->cap.max_send_sge = std::max<uint32_t>(1, attr->cap.max_send_sge);
  q->cap.max_recv_sge = std::max<uint32_t>(1, attr->cap.max_recv_sge);
  attr->cap = q->cap;
  q->sq_sig_all = attr->sq_sig_all != 0;
  q->qp.qp_num = static_cast<uint32_t>(c->shm->next_qpn.fetch_add(1) & 0xffffff);
  q->qp.handle = q->qp.qp_num;
  q->in = Ring::create("/mcfv-" + f.id + "-" + cfg.key() + "-q" + std::to_string(q->qp.qp_num),
                       f.ring_bytes, q->qp.qp_num, c->db_name);
  if (q->in == nullptr) {
    delete q;
    errno = ENOMEM;
    return nullptr;
  }
  c->shm->live_qps.fetch_add(1);
  std::lock_guard<std::mutex> g(c->mu);
  c->qps.push_back(std::shared_ptr<Qp>(q));
  return &q->qp;
}

int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init) {
  (void)mask;
  Qp* q = qpOf(qp);
  std::lock_guard<std::mutex> g(q->mu);
  std::memset(attr, 0, sizeof *attr);
  attr->qp_state = qp->state;
  attr->cur_qp_state = qp->state;
  attr->dest_qp_num = q->dest_qpn;
  attr->qp_access_flags = static_cast<unsigned>(q->access);
  attr->cap = q->cap;
  attr->ah_attr = q->ah;
  attr->port_num = q->port;
  attr->timeout = q->timeout;
  attr->retry_cnt = q->retry_cnt;
  attr->rnr_retry = q->rnr_retry;
  attr->min_rnr_timer = q->min_rnr_timer;
  attr->sq_psn = q->sq_psn;
  attr->rq_psn = q->rq_psn;
  attr->max_dest_rd_atomic = q->max_dest_rd_atomic;
  if (init != nullptr) {
    std::memset(init, 0, sizeof *init);
    init->qp_context = qp->qp_context;
    init->send_cq = qp->send_cq;
    init->recv_cq = qp->recv_cq;
    init->cap = q->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = q->sq_sig_all;
  }
  return 0;
}

// The RC state machine with the attribute masks the kernel requires per transition.
int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) {
  Qp* q = qpOf(qp);
  DevShm* shm = q->ctx->shm;
  if ((mask & IBV_QP_STATE) && a->qp_state == IBV_QPS_INIT && qp->state == IBV_QPS_RESET &&
      shm->hold_qp.load() != 0) {  // NicControl::holdQps
    shm->held_qps.fetch_add(1);
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (shm->hold_qp.load() != 0 && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> g(q->mu);
  if (!(mask & IBV_QP_STATE)) return EINVAL;
  ibv_qp_state cur = qp->state, to = a->qp_state;
  auto need = [&](int m) { return (mask & m) == m; };
  if (to == IBV_QPS_RESET) {
    q->wrs.clear();
    q->rq.clear();
    q->resps.clear();
    q->tx = 0;
    q->tx_off = 0;
    q->refused = false;
    q->dropping = false;
    q->expect_msn = 1;
    q->next_msn = 1;
    q->sq_unpolled = std::make_shared<std::atomic<int>>(0);
    q->retired.push_back(std::move(q->out));  // the NIC thread may still push into it
    qp->state = IBV_QPS_RESET;
    return 0;
  }
  if (to == IBV_QPS_ERR) {
    qpError(q, IBV_WC_WR_FLUSH_ERR);
    return 0;
  }
  if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
    if (!need(IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) return EINVAL;
    if (a->port_num != 1) return EINVAL;
    q->port = a->port_num;
    q->access = static_cast<int>(a->qp_access_flags);
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_INIT) {
    if (mask & IBV_QP_ACCESS_FLAGS) q->access = static_cast<int>(a->qp_access_flags);
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
    if (!need(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      return EINVAL;
    const DevCfg& self = fabric().devices[q->ctx->dev];
    if (self.ib ? a->ah_attr.is_global && a->ah_attr.dlid == 0 : !a->ah_attr.is_global)
      return EINVAL;  // RoCE needs a GRH (a GID); IB is routed by LID
    if (a->path_mtu > self.mtu) return EINVAL;
    if (a->ah_attr.is_global && a->ah_attr.grh.sgid_index >= self.ngids) return EINVAL;
    if (a->ah_attr.sl > 15) return EINVAL;
    int dev = findDevice(a->ah_attr);
    // A destination nobody has: accepted (as hardware), the requests then time out.
    q->remote_dev = dev;
    q->ah = a->ah_attr;
    q->dest_qpn = a->dest_qp_num;
    q->min_rnr_timer = a->min_rnr_timer;
    q->rq_psn = a->rq_psn & 0xffffff;
    q->max_dest_rd_atomic = a->max_dest_rd_atomic;
    q->expect_msn = 1;
    if (mask & IBV_QP_ACCESS_FLAGS) q->access = static_cast<int>(a->qp_access_flags);
  } else if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    if (!need(IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
              IBV_QP_MAX_QP_RD_ATOMIC))
      return EINVAL;
    q->timeout = a->timeout;
    q->sq_psn = a->sq_psn & 0xffffff;
    q->retry_cnt = a->retry_cnt;
    q->rnr_retry = a->rnr_retry;
    q->rnr_left = a->rnr_retry;
    q->last_progress = Clock::now();
  } else if (cur == IBV_QPS_RTS && to == IBV_QPS_RTS) {
    if (mask & IBV_QP_TIMEOUT) q->timeout = a->timeout;
  } else {
    return EINVAL;
  }
  qp->state = to;
  ring(q->ctx->db);
  return 0;
}

int ibv_destroy_qp(ibv_qp* qp) {
  Qp* q = qpOf(qp);
  Ctx* c = q->ctx;
  {
    // The NIC thread checks the flag under q->mu before it touches the QP: from here on it
    // adds no completion to the QP's CQs (which the caller may destroy next).
    std::lock_guard<std::mutex> g(q->mu);
    q->destroyed = true;
  }
  std::shared_ptr<Qp> last;  // freed here, or by the NIC thread's snapshot
  c->shm->live_qps.fetch_sub(1);
  std::lock_guard<std::mutex> g(c->mu);
  for (auto it = c->qps.begin(); it != c->qps.end(); ++it) {
    if (it->get() == q) {
      last = std::move(*it);
      c->qps.erase(it);
      break;
    }
  }
  return 0;
}

}  // extern "C"
#pragma GCC visibility pop
