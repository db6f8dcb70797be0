// The emulator's fabric: devices from the config file, the fake sysfs tree, shared-memory
// rings and doorbells.
//
// Config (MC_FAKE_VERBS_CONFIG names the file), one device per line, '#' comments:
//   device NAME [host=H] [pci=DDDD:BB:DD.F] [link=ib|ethernet] [lid=N] [ip=A.B.C.D]
//               [mtu=256|512|1024|2048|4096] [max_mr_size=BYTES] [max_cqe=N] [gbps=G]
//               [state=active|down]
// A device with host=H is seen by processes whose MC_HOST_ID is H (simulated hosts), one
// without host= by every process. Ethernet (RoCE) devices get mlx5's GID table for ip=:
// 0 fe80::/64 link-local (RoCE v1), 1 the same (RoCE v2), 2 ::ffff:ip (v1), 3 ::ffff:ip (v2).
// InfiniBand devices get one GID, fe80::<lid>, and are addressed by LID.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "engine/params.h"
#include "tests/fakes/verbs/fv_internal.h"

namespace mooncake::fakeverbs {

namespace {

constexpr uint32_t kRingMagic = 0x4d434652;  // "MCFR"

bool parseDevice(std::istringstream& in, DevCfg* d, std::string* err) {
  if (!(in >> d->name)) {
    *err = "device without a name";
    return false;
  }
  std::string ip;
  std::string kv;
  while (in >> kv) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      *err = "bad field '" + kv + "'";
      return false;
    }
    std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "host") d->host = v;
    else if (k == "pci") d->pci = v;
    else if (k == "link") d->ib = v == "ib";
    else if (k == "lid") d->lid = static_cast<uint16_t>(std::strtoul(v.c_str(), nullptr, 0));
    else if (k == "ip") ip = v;
    else if (k == "max_mr_size") d->max_mr_size = std::strtoull(v.c_str(), nullptr, 0);
    else if (k == "max_cqe") d->max_cqe = static_cast<int>(std::strtol(v.c_str(), nullptr, 0));
    else if (k == "gbps") d->gbps = std::strtod(v.c_str(), nullptr);
    else if (k == "state") d->start_down = v == "down";
    else if (k == "mtu") {
      int m = std::atoi(v.c_str());
      d->mtu = m >= 4096 ? IBV_MTU_4096 : m >= 2048 ? IBV_MTU_2048 : m >= 1024 ? IBV_MTU_1024
               : m >= 512 ? IBV_MTU_512 : IBV_MTU_256;
    } else {
      *err = "unknown field '" + k + "'";
      return false;
    }
  }
  if (d->ib) {
    if (d->lid == 0) {
      *err = "InfiniBand device " + d->name + " needs lid=";
      return false;
    }
    d->ngids = 1;
    d->gids[0][0] = 0xfe;
    d->gids[0][1] = 0x80;
    d->gids[0][14] = static_cast<uint8_t>(d->lid >> 8);
    d->gids[0][15] = static_cast<uint8_t>(d->lid);
    d->gid_types[0] = 0;
    return true;
  }
  in_addr a{};
  if (inet_pton(AF_INET, ip.c_str(), &a) != 1) {
    *err = "RoCE device " + d->name + " needs ip=A.B.C.D";
    return false;
  }
  const auto* b = reinterpret_cast<const uint8_t*>(&a.s_addr);
  d->ngids = 4;
  for (int i = 0; i < 2; ++i) {  // link-local, EUI from the address
    d->gids[i][0] = 0xfe;
    d->gids[i][1] = 0x80;
    std::memcpy(&d->gids[i][12], b, 4);
  }
  for (int i = 2; i < 4; ++i) {  // IPv4-mapped
    d->gids[i][10] = 0xff;
    d->gids[i][11] = 0xff;
    std::memcpy(&d->gids[i][12], b, 4);
  }
  d->gid_types[0] = d->gid_types[2] = 1;  // RoCE v1
  d->gid_types[1] = d->gid_types[3] = 2;  // RoCE v2
  return true;
}

// A fake /sys/class/infiniband/<name>/device -> ../../../devices/<pci> tree, so that code
// which finds a NIC's PCI address from its ibdev_path works as on a real machine.
void makeSysfs(const Fabric& f) {
  std::string root = f.sysfs;
  mkdir(root.c_str(), 0700);
  mkdir((root + "/class").c_str(), 0700);
  mkdir((root + "/class/infiniband").c_str(), 0700);
  mkdir((root + "/devices").c_str(), 0700);
  for (int i : f.visible) {
    const DevCfg& d = f.devices[i];
    std::string dir = root + "/class/infiniband/" + d.name;
    mkdir(dir.c_str(), 0700);
    if (d.pci.empty()) continue;
    mkdir((root + "/devices/" + d.pci).c_str(), 0700);
    std::string link = dir + "/device";
    std::string target = "../../../devices/" + d.pci;
    char cur[PATH_MAX];
    ssize_t n = readlink(link.c_str(), cur, sizeof cur - 1);
    if (n > 0 && std::string(cur, static_cast<size_t>(n)) == target) continue;
    unlink(link.c_str());
    if (symlink(target.c_str(), link.c_str()) != 0 && errno != EEXIST) {
      std::fprintf(stderr, "fake verbs: symlink %s: %s\n", link.c_str(), strerror(errno));
    }
  }
}

Fabric* load() {
  auto* f = new Fabric();
  std::string path = params::getString("MC_FAKE_VERBS_CONFIG");
  if (path.empty()) {
    f->error = "MC_FAKE_VERBS_CONFIG is not set";
    return f;
  }
  char real[PATH_MAX];
  std::string canon = realpath(path.c_str(), real) != nullptr ? std::string(real) : path;
  f->id = params::getString("MC_FAKE_VERBS_FABRIC");
  if (f->id.empty()) f->id = fabricFromPath(canon);
  f->default_gbps = params::getDouble("MC_FAKE_VERBS_GBPS");
  f->ack_timeout_ms = params::getInt("MC_FAKE_VERBS_ACK_TIMEOUT_MS");
  int64_t rb = params::getInt("MC_FAKE_VERBS_RING_BYTES");
  size_t ring = 64 * 1024;
  while (ring < static_cast<size_t>(rb) && ring < (1ull << 30)) ring <<= 1;
  f->ring_bytes = ring;
  f->sysfs = "/tmp/mcfv-" + f->id + "-" + std::to_string(getuid()) + "-sysfs";
  std::ifstream in(path);
  if (!in) {
    f->error = "cannot read " + path;
    return f;
  }
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    std::string word;
    if (!(ls >> word)) continue;
    DevCfg d;
    std::string err;
    if (word != "device" || !parseDevice(ls, &d, &err)) {
      f->error = path + ":" + std::to_string(lineno) + ": " + (err.empty() ? "expected 'device'" : err);
      f->devices.clear();
      return f;
    }
    f->devices.push_back(d);
  }
  std::string host = params::getString("MC_HOST_ID");
  for (size_t i = 0; i < f->devices.size(); ++i)
    if (f->devices[i].host.empty() || f->devices[i].host == host)
      f->visible.push_back(static_cast<int>(i));
  makeSysfs(*f);
  return f;
}

}  // namespace

const Fabric& fabric() {
  // A process without MC_FAKE_VERBS_CONFIG sees no device, and keeps nothing of that: a test
  // process sets it for its rdma tests only (tests/engine/peer_fixture.cc), in whatever order
  // they run among the others. The first config set is loaded, then kept for the process.
  if (params::getString("MC_FAKE_VERBS_CONFIG").empty()) {
    static const Fabric* unset = load();
    return *unset;
  }
  static Fabric* f = load();
  return *f;
}

int findDevice(const ibv_ah_attr& ah) {
  const Fabric& f = fabric();
  for (size_t i = 0; i < f.devices.size(); ++i) {
    const DevCfg& d = f.devices[i];
    if (ah.is_global) {
      for (int g = 0; g < d.ngids; ++g)
        if (std::memcmp(d.gids[g], ah.grh.dgid.raw, 16) == 0) return static_cast<int>(i);
    } else if (d.ib && d.lid == ah.dlid) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

// ---------------------------------------------------------------- doorbells

Doorbell* mapDoorbell(const std::string& name, bool create) {
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, 4096) != 0) {
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<Doorbell*>(p);
}

void unmapDoorbell(Doorbell* d) {
  if (d != nullptr) munmap(d, 4096);
}

void ring(Doorbell* d) {
  if (d == nullptr) return;
  d->word.fetch_add(1, std::memory_order_seq_cst);
  if (d->waiters.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, &d->word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// ---------------------------------------------------------------- rings

std::unique_ptr<Ring> Ring::create(const std::string& name, size_t bytes, uint32_t qpn,
                                   const std::string& doorbell) {
  size_t total = 4096 + bytes;
  int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0) return nullptr;
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return nullptr;
  }
  std::unique_ptr<Ring> r(new Ring());
  r->name_ = name;
  r->owner_ = true;
  r->map_bytes_ = total;
  r->h_ = static_cast<RingHdr*>(p);
  r->data_ = static_cast<char*>(p) + 4096;
  r->h_->qpn = qpn;
  r->h_->size = bytes;
  r->h_->owner_pid = getpid();
  std::snprintf(r->h_->doorbell, sizeof r->h_->doorbell, "%s", doorbell.c_str());
  r->h_->tail.store(0);
  r->h_->head.store(0);
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint32_t>*>(&r->h_->magic)->store(kRingMagic);
  return r;
}

std::unique_ptr<Ring> Ring::attach(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < 4096 + 4096) {
    close(fd);
    return nullptr;
  }
  size_t total = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  auto* h = static_cast<RingHdr*>(p);
  if (reinterpret_cast<std::atomic<uint32_t>*>(&h->magic)->load() != kRingMagic ||
      h->size + 4096 > total) {
    munmap(p, total);
    return nullptr;
  }
  std::unique_ptr<Ring> r(new Ring());
  r->name_ = name;
  r->map_bytes_ = total;
  r->h_ = h;
  r->data_ = static_cast<char*>(p) + 4096;
  r->db_ = mapDoorbell(std::string(h->doorbell, strnlen(h->doorbell, sizeof h->doorbell)), false);
  return r;
}

Ring::~Ring() {
  if (db_ != nullptr) unmapDoorbell(db_);
  if (h_ != nullptr) munmap(h_, map_bytes_);
  if (owner_) shm_unlink(name_.c_str());
}

size_t Ring::room() const {
  return h_->size - (h_->tail.load(std::memory_order_relaxed) - h_->head.load(std::memory_order_acquire));
}

bool Ring::push(const Pkt& hdr, const void* payload, size_t len, const void* payload2, size_t len2) {
  const uint64_t size = h_->size;
  size_t rec = (sizeof(Pkt) + len + len2 + 7) & ~size_t(7);
  uint64_t tail = h_->tail.load(std::memory_order_relaxed);
  uint64_t head = h_->head.load(std::memory_order_acquire);
  uint64_t at = tail & (size - 1);
  size_t to_end = size - at;
  size_t need = rec + (to_end < rec ? to_end : 0);
  if (size - (tail - head) < need) return false;
  if (to_end < rec) {  // pad to the end, start over
    Pkt pad{};
    pad.rec_len = static_cast<uint32_t>(to_end);
    pad.type = kPad;
    std::memcpy(data_ + at, &pad, sizeof(uint32_t) + 1);
    tail += to_end;
    at = 0;
  }
  Pkt h = hdr;
  h.rec_len = static_cast<uint32_t>(rec);
  std::memcpy(data_ + at, &h, sizeof h);
  if (len > 0) std::memcpy(data_ + at + sizeof h, payload, len);
  if (len2 > 0) std::memcpy(data_ + at + sizeof h + len, payload2, len2);
  h_->tail.store(tail + rec, std::memory_order_release);
  return true;
}

bool Ring::peek(const Pkt** h, const char** payload) {
  for (;;) {
    uint64_t head = h_->head.load(std::memory_order_relaxed);
    uint64_t tail = h_->tail.load(std::memory_order_acquire);
    if (head == tail) return false;
    const char* at = data_ + (head & (h_->size - 1));
    const auto* p = reinterpret_cast<const Pkt*>(at);
    if (p->type == kPad) {
      h_->head.store(head + p->rec_len, std::memory_order_release);
      continue;
    }
    *h = p;
    *payload = at + sizeof(Pkt);
    return true;
  }
}

void Ring::pop() {
  uint64_t head = h_->head.load(std::memory_order_relaxed);
  const auto* p = reinterpret_cast<const Pkt*>(data_ + (head & (h_->size - 1)));
  h_->head.store(head + p->rec_len, std::memory_order_release);
}

}  // namespace mooncake::fakeverbs
