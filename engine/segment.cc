#include "engine/segment.h"

#include <unistd.h>

#include <fstream>
#include <sstream>

#include "engine/params.h"
#include "engine/wire.h"

namespace mooncake::engine {

namespace {
constexpr uint32_t kMaxRegions = 1u << 16;
constexpr uint32_t kMaxKeyBytes = 4096;
}  // namespace

std::string SegmentDesc::serialize() const {
  wire::Writer w;
  w.u32(kMagic);
  w.u32(kVersion);
  w.str(name);
  w.u64(engine_id);
  w.str(host_id);
  w.i32(pid);
  w.str(tcp_host);
  w.u16(tcp_port);
  w.str(inbox_shm);
  w.u32(transports);
  for (const auto& e : endpoints) w.str(e);
  w.u64(regions_version);
  w.u32(static_cast<uint32_t>(regions.size()));
  for (const auto& r : regions) {
    w.u64(r.addr);
    w.u64(r.len);
    w.u8(static_cast<uint8_t>(r.kind));
    w.i32(r.device);
    w.str(r.shm_name);
    for (const auto& k : r.keys) w.str(k);
  }
  return w.take();
}

Result<SegmentDesc> SegmentDesc::parse(std::string_view bytes) {
  wire::Reader rd(bytes);
  if (rd.u32() != kMagic || !rd.ok()) return MC_STATUS(kProtocol, "segment: bad magic");
  uint32_t version = rd.u32();
  if (version != kVersion)
    return MC_STATUS(kProtocol, "segment: version " << version << ", expected " << kVersion);
  SegmentDesc d;
  d.name = rd.str(4096);
  d.engine_id = rd.u64();
  d.host_id = rd.str(4096);
  d.pid = rd.i32();
  d.tcp_host = rd.str(256);
  d.tcp_port = rd.u16();
  d.inbox_shm = rd.str(256);
  d.transports = rd.u32();
  for (auto& e : d.endpoints) e = rd.str(kMaxEndpointBytes);
  d.regions_version = rd.u64();
  uint32_t n = rd.u32();
  if (!rd.ok() || n > kMaxRegions) return MC_STATUS(kProtocol, "segment: truncated header");
  // Each region takes at least 8+8+1+4+4*(1+kinds) bytes: reject counts the input can't hold.
  if (n > rd.remaining() / (21 + 4 * (1 + kNumTransportKinds)))
    return MC_STATUS(kProtocol, "segment: region count " << n << " exceeds input");
  d.regions.resize(n);
  for (auto& r : d.regions) {
    r.addr = rd.u64();
    r.len = rd.u64();
    uint8_t kind = rd.u8();
    if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) rd.fail();
    r.kind = static_cast<MemoryKind>(kind);
    r.device = rd.i32();
    r.shm_name = rd.str(256);
    for (auto& k : r.keys) k = rd.str(kMaxKeyBytes);
    if (r.addr + r.len < r.addr) rd.fail();
    if (!rd.ok()) break;
  }
  if (!rd.done()) return MC_STATUS(kProtocol, "segment: malformed or trailing bytes");
  return d;
}

const RegionDesc* SegmentDesc::findRegion(uint64_t addr, uint64_t len) const {
  for (const auto& r : regions) {
    if (addr >= r.addr && len <= r.len && addr - r.addr <= r.len - len) return &r;
  }
  return nullptr;
}

std::string localHostId() {
  std::string forced = params::getString("MC_HOST_ID");
  if (!forced.empty()) return forced;
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  // The network namespace (its addresses) and the pid namespace: the shm transport names
  // its peer by pid (process_vm_readv/writev), which in another pid namespace is another
  // process; containers of one pod share the network namespace but not, by default, that one.
  auto ns = [](const char* path) {
    char buf[256] = {0};
    ssize_t n = readlink(path, buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, n) : std::string();
  };
  return boot + "/" + ns("/proc/self/ns/net") + "/" + ns("/proc/self/ns/pid");
}

}  // namespace mooncake::engine
