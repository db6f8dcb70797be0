// The verbs emulator's shared state per emulated NIC and the knobs tests turn on it.
//
// The emulator (libibverbs.so.1 built from this folder; see docs/rdma.md) keeps one small
// shared-memory file per NIC of its fabric: the port state, fault injection and traffic
// counters every process using that NIC sees. Tests include this header (it needs neither
// the emulator library nor libibverbs) to flip a port down, stall a NIC or make its next work
// requests fail, from any process, while the processes under test run.
//
// Names: "/mcfv-<fabric>-dev-<host>.<name>" where <fabric> is MC_FAKE_VERBS_FABRIC (or a
// hash of the config file's path) and <host> the device's host= tag ("_" when it has none).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace mooncake::fakeverbs {

constexpr uint32_t kDevMagic = 0x4d434656;  // "MCFV"
constexpr uint32_t kDevVersion = 6;

// ibv_port_state values (verbs.h), repeated so that tests need not include verbs.h.
constexpr uint32_t kPortDown = 1;
constexpr uint32_t kPortActive = 4;

struct alignas(64) DevShm {
  uint32_t magic;
  uint32_t version;
  std::atomic<uint32_t> ready;        // 1 once initialised (by the first opener)
  std::atomic<uint32_t> port_state;   // kPortActive / kPortDown
  std::atomic<uint32_t> stalled;      // 1: the NIC moves nothing (no packet in or out)
  std::atomic<uint32_t> fail_status;  // ibv_wc_status the failed work requests complete with
  std::atomic<int64_t> fail_next;     // > 0: that many send work requests fail (see below)
  std::atomic<uint64_t> next_qpn;     // QP numbers are unique per NIC across processes
  std::atomic<uint64_t> tx_bytes;     // payload bytes sent (requests and read responses)
  std::atomic<uint64_t> rx_bytes;     // payload bytes received
  std::atomic<uint64_t> cap_busy_ns;  // bandwidth cap: the link is busy until then (CLOCK_MONOTONIC)
  std::atomic<uint64_t> cap_bytes_per_s;  // 0: no cap
  std::atomic<uint64_t> wr_done;      // send work requests this NIC completed successfully
  std::atomic<uint64_t> wr_failed;    // send work requests completed with an error (any kind)
  std::atomic<int64_t> live_qps;      // QPs created on this NIC and not destroyed (all processes)
  std::atomic<int64_t> dmabuf_mrs;    // MRs registered through ibv_reg_dmabuf_mr, not deregistered
  std::atomic<uint32_t> overrun_next;  // 1: the next completion overruns its CQ (see below)
  std::atomic<uint64_t> cq_overruns;   // CQs of this NIC that overran (all processes)
  std::atomic<int64_t> refuse_reg;     // > 0: that many host-memory registrations fail (ENOMEM)
  std::atomic<int64_t> refuse_qp;      // > 0: that many ibv_create_qp calls fail (ENOMEM)
  std::atomic<uint32_t> hold_qp;       // 1: a QP's move to INIT waits until it is 0 (see below)
  std::atomic<uint64_t> held_qps;      // moves to INIT that began waiting on hold_qp
};

// FNV-1a: the default fabric id from the config path (same in every process).
inline std::string fabricFromPath(const std::string& path) {
  uint64_t h = 1469598103934665603ull;
  for (char c : path) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  char b[20];
  snprintf(b, sizeof b, "%012llx", static_cast<unsigned long long>(h & 0xffffffffffffull));
  return b;
}

inline std::string devShmName(const std::string& fabric, const std::string& host,
                              const std::string& name) {
  return "/mcfv-" + fabric + "-dev-" + (host.empty() ? "_" : host) + "." + name;
}

// Removes what a fabric leaves on this host: its NICs' shared state (/dev/shm/mcfv-<fabric>-*,
// which nothing else unlinks) and its fake sysfs tree. Test fabrics are named after a pid; a
// later process with the same pid would otherwise open an earlier run's NIC state (a port left
// down, a pending failure).
inline void removeFabricFiles(const std::string& fabric) {
  const std::string start = "mcfv-" + fabric + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind(start, 0) == 0) shm_unlink(("/" + name).c_str());
    }
    closedir(d);
  }
  std::error_code ec;
  std::filesystem::remove_all("/tmp/" + start + std::to_string(getuid()) + "-sysfs", ec);
}

// Opens (creating it when missing) the shared state of one NIC. Returns nullptr on failure.
inline DevShm* openDevShm(const std::string& shm_name) {
  int fd = shm_open(shm_name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return nullptr;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return nullptr;
  }
  if (static_cast<size_t>(st.st_size) < sizeof(DevShm) &&
      ftruncate(fd, sizeof(DevShm)) != 0) {
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, sizeof(DevShm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  auto* d = static_cast<DevShm*>(p);
  // First opener initialises; zero-filled fields are valid defaults except these.
  uint32_t expect = 0;
  if (d->ready.load() == 0 && d->ready.compare_exchange_strong(expect, 2)) {
    d->magic = kDevMagic;
    d->version = kDevVersion;
    d->port_state.store(kPortActive);
    d->fail_status.store(12);  // IBV_WC_RETRY_EXC_ERR
    d->next_qpn.store(0x100);
    d->ready.store(1);
  }
  while (d->ready.load() != 1) usleep(100);
  return d;
}

// Test-side handle on one emulated NIC (any process, while others use it).
class NicControl {
 public:
  NicControl(const std::string& fabric, const std::string& host, const std::string& name)
      : d_(openDevShm(devShmName(fabric, host, name))) {}
  ~NicControl() {
    if (d_ != nullptr) munmap(d_, sizeof(DevShm));
  }
  NicControl(const NicControl&) = delete;
  NicControl& operator=(const NicControl&) = delete;
  bool ok() const { return d_ != nullptr; }
  // Port down: the NIC neither sends nor accepts packets; peers' requests to it and its own
  // time out (IBV_WC_RETRY_EXC_ERR) and ibv_query_port says IBV_PORT_DOWN.
  void setPortUp(bool up) { d_->port_state.store(up ? kPortActive : kPortDown); }
  // Stalled: like a hung NIC, nothing moves and nothing completes, in either direction.
  void setStalled(bool stalled) { d_->stalled.store(stalled ? 1 : 0); }
  // The next n send work requests this NIC starts complete with `status` (an ibv_wc_status;
  // default IBV_WC_RETRY_EXC_ERR) and move their QP to the error state.
  void failNext(int64_t n, uint32_t status = 12) {
    d_->fail_status.store(status);
    d_->fail_next.store(n);
  }
  // The next completion any CQ of this NIC (in any process) takes overruns it, as a CQ too
  // small for its QPs would: the CQ is in error (ibv_poll_cq fails) and its QPs too.
  void overrunNextCompletion() { d_->overrun_next.store(1); }
  uint64_t cqOverruns() const { return d_->cq_overruns.load(); }
  // The next n registrations of host memory on this NIC (any process) fail with ENOMEM, as on
  // a NIC whose memory-region resources are exhausted (the others still register).
  void refuseRegistrations(int64_t n) { d_->refuse_reg.store(n); }
  // The next n ibv_create_qp calls on this NIC (any process) fail with ENOMEM, as on a NIC out
  // of QP resources.
  void refuseQps(int64_t n) { d_->refuse_qp.store(n); }
  int64_t refuseQpsPending() const { return d_->refuse_qp.load(); }
  // Held: ibv_modify_qp moving a QP of this NIC (any process) from RESET to INIT waits until
  // released (30 s at most), so that a test acts while a connection is known to be being set
  // up (after ibv_create_qp, which callers may make under a lock of theirs); heldQps() counts
  // the calls that began waiting.
  void holdQps(bool hold) { d_->hold_qp.store(hold ? 1 : 0); }
  uint64_t heldQps() const { return d_->held_qps.load(); }
  void setGbps(double gbps) {
    d_->cap_bytes_per_s.store(static_cast<uint64_t>(gbps * 1e9 / 8));
  }
  uint64_t txBytes() const { return d_->tx_bytes.load(); }
  uint64_t rxBytes() const { return d_->rx_bytes.load(); }
  uint64_t wrDone() const { return d_->wr_done.load(); }
  uint64_t wrFailed() const { return d_->wr_failed.load(); }
  int64_t failPending() const { return d_->fail_next.load(); }
  // The number the NIC's next QP gets (QP numbers count up from 0x100 on each NIC).
  uint64_t nextQpn() const { return d_->next_qpn.load(); }
  // QPs that exist on the NIC now, in every process of the fabric.
  int64_t liveQps() const { return d_->live_qps.load(); }
  int64_t dmabufMrs() const { return d_->dmabuf_mrs.load(); }

 private:
  DevShm* d_;
};

}  // namespace mooncake::fakeverbs
