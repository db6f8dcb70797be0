// The emulator's protection domains and memory regions (exported libibverbs API; the rest is
// in fv_verbs.cc). Registration follows the kernel's checks: access flags, max_mr_size, pinned
// pages against RLIMIT_MEMLOCK (unless the registering thread has CAP_IPC_LOCK) and every page
// mapped with the access asked for. Deregistration fences the NIC thread's placement.
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "tests/fakes/verbs/fv_internal.h"

using namespace mooncake::fakeverbs;

namespace {

Ctx* ctxOf(ibv_context* c) { return reinterpret_cast<Ctx*>(c); }

// Pages pinned by this process's MRs (the kernel's mm->pinned_vm, which RLIMIT_MEMLOCK bounds).
std::atomic<uint64_t> g_pinned_pages{0};

// CAP_IPC_LOCK in the calling thread's effective set (capabilities are per thread, and the
// kernel checks the registering thread's).
bool threadHasIpcLock() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2] = {};
  if (syscall(SYS_capget, &h, d) != 0) return false;
  return (d[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

// What pinning [addr, addr+len) finds, as the kernel's page pinning does: 0, or EFAULT when a
// page is not mapped, not readable (PROT_NONE) or, for a writable MR, not writable.
int mappingError(uint64_t addr, uint64_t len, bool write) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uint64_t at = addr;
  const uint64_t end = addr + len;
  while (at < end && std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    in >> range >> perms;
    const size_t dash = range.find('-');
    if (dash == std::string::npos || perms.size() < 2) continue;
    const uint64_t lo = std::strtoull(range.substr(0, dash).c_str(), nullptr, 16);
    const uint64_t hi = std::strtoull(range.substr(dash + 1).c_str(), nullptr, 16);
    if (hi <= at) continue;
    if (lo > at) return EFAULT;  // a hole
    if (perms[0] != 'r' || (write && perms[1] != 'w')) return EFAULT;
    at = hi;
  }
  return at >= end ? 0 : EFAULT;
}

}  // namespace

#pragma GCC visibility push(default)
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
extern "C" {

// ---- protection domains and memory regions ----

ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  auto* p = new Pd();
  p->pd.context = ctx;
  p->ctx = ctxOf(ctx);
  return &p->pd;
}

int ibv_dealloc_pd(ibv_pd* pd) {
  delete reinterpret_cast<Pd*>(pd);
  return 0;
}

namespace {
// `user`: [addr, addr+length) is this process's memory, pinned as the kernel pins it: charged
// to RLIMIT_MEMLOCK unless the thread has CAP_IPC_LOCK (EPERM with a limit of 0, ENOMEM beyond
// it), and every page must be mapped with the access asked for (EFAULT). A dma-buf MR is not.
ibv_mr* regMr(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned int access,
              bool user) {
  Pd* p = reinterpret_cast<Pd*>(pd);
  Ctx* c = p->ctx;
  const DevCfg& cfg = fabric().devices[c->dev];
  // Remote write/atomic need local write (as the kernel checks).
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return nullptr;
  }
  if (length == 0 || length > cfg.max_mr_size) {
    errno = EINVAL;
    return nullptr;
  }
  uint64_t pages = 0;
  if (user) {
    int64_t refuse = c->shm->refuse_reg.load();  // NicControl::refuseRegistrations
    while (refuse > 0 && !c->shm->refuse_reg.compare_exchange_weak(refuse, refuse - 1)) {
    }
    if (refuse > 0) {
      errno = ENOMEM;
      return nullptr;
    }
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t a = reinterpret_cast<uint64_t>(addr);
    pages = (a + length + page - 1) / page - a / page;
    rlimit rl{};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    const bool exempt = threadHasIpcLock();
    if (rl.rlim_cur == 0 && !exempt) {
      errno = EPERM;
      return nullptr;
    }
    const uint64_t now = g_pinned_pages.fetch_add(pages) + pages;
    if (!exempt && rl.rlim_cur != RLIM_INFINITY && now > rl.rlim_cur / page) {
      g_pinned_pages.fetch_sub(pages);
      errno = ENOMEM;
      return nullptr;
    }
    const bool writable = access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                    IBV_ACCESS_REMOTE_ATOMIC);
    if (int e = mappingError(a, length, writable)) {
      g_pinned_pages.fetch_sub(pages);
      errno = e;
      return nullptr;
    }
  }
  auto* m = new Mr();
  m->pd = p;
  m->pinned_pages = pages;
  m->access = static_cast<int>(access);
  m->iova = iova;
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = addr;
  m->mr.length = length;
  m->host = static_cast<char*>(addr);
  std::lock_guard<std::mutex> g(c->mu);
  // Keys: unique per context, not guessable from a neighbour (a stepping counter, mixed).
  c->next_key += 0x9e37;
  uint32_t key = (c->next_key << 8) | (static_cast<uint32_t>(c->dev) & 0xff);
  m->mr.lkey = m->mr.rkey = key;
  m->mr.handle = key;
  c->mrs[key] = m;
  return &m->mr;
}
}  // namespace

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned int access) {
  return regMr(pd, addr, length, iova, access, true);
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  return ibv_reg_mr_iova2(pd, addr, length, reinterpret_cast<uint64_t>(addr),
                          static_cast<unsigned int>(access));
}

// dma-buf: the emulator has no device memory; it stands host memory in for it, so the fd
// must map `length` bytes at `offset` (a memfd or shm file does), which the emulator maps as
// a NIC maps a GPU's pages. As with rdma-core, the MR's address space is `iova`: local
// gather lists and peers' remote addresses both name iova addresses.
ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                          int access) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t lo = offset / page * page;
  const size_t map_len = static_cast<size_t>(offset - lo + length);
  void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(lo));
  if (p == MAP_FAILED) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_mr* mr = regMr(pd, reinterpret_cast<void*>(iova), length, iova,
                     static_cast<unsigned int>(access), false);
  if (mr == nullptr) {
    int e = errno;
    munmap(p, map_len);
    errno = e;
    return nullptr;
  }
  Mr* m = reinterpret_cast<Mr*>(mr);
  m->host = static_cast<char*>(p) + (offset - lo);
  m->map = p;
  m->map_len = map_len;
  m->pd->ctx->shm->dmabuf_mrs.fetch_add(1);
  return mr;
}

int ibv_dereg_mr(ibv_mr* mr) {
  Mr* m = reinterpret_cast<Mr*>(mr);
  Ctx* c = m->pd->ctx;
  {
    std::unique_lock<std::shared_mutex> placing(c->place_mu);  // (a packet being placed ends)
    std::lock_guard<std::mutex> g(c->mu);
    c->mrs.erase(mr->lkey);
    c->mr_gen.fetch_add(1, std::memory_order_acq_rel);
  }
  g_pinned_pages.fetch_sub(m->pinned_pages);
  if (m->map != nullptr) {
    munmap(m->map, m->map_len);
    c->shm->dmabuf_mrs.fetch_sub(1);
  }
  delete m;
  return 0;
}

}  // extern "C"
#pragma GCC visibility pop
