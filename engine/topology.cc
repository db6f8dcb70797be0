#include "engine/topology.h"

#include <map>
#include <mutex>
#include <set>

#include "engine/log.h"
#include "engine/params.h"
#include "mooncake/config.h"

#if MC_HAVE_HWLOC
#include <hwloc.h>
#endif

namespace mooncake::engine {

#if MC_HAVE_HWLOC

struct Topology::Impl {
  hwloc_topology_t topo = nullptr;
  ~Impl() {
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }

  hwloc_obj_t pciDev(const std::string& pci) const {
    return hwloc_get_pcidev_by_busidstring(topo, pci.c_str());
  }
  // The NUMA nodes (os indexes) of the normal object a PCI device hangs from.
  std::set<int> numaNodes(hwloc_obj_t dev) const {
    std::set<int> out;
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, dev);
    if (anc == nullptr || anc->nodeset == nullptr) return out;
    unsigned i;
    hwloc_bitmap_foreach_begin(i, anc->nodeset) out.insert(static_cast<int>(i));
    hwloc_bitmap_foreach_end();
    return out;
  }
  // True when the nearest common ancestor of a and b is a PCI-to-PCI bridge (a switch port
  // or a root port), i.e. the path between them does not cross a host bridge.
  static bool sameSwitch(hwloc_obj_t a, hwloc_obj_t b) {
    std::set<hwloc_obj_t> up;
    for (hwloc_obj_t o = a; o != nullptr; o = o->parent) up.insert(o);
    for (hwloc_obj_t o = b; o != nullptr; o = o->parent) {
      if (up.count(o) == 0) continue;
      return o->type == HWLOC_OBJ_BRIDGE && o->attr != nullptr &&
             o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI;
    }
    return false;
  }
};

namespace {

Result<hwloc_topology_t> openTopology(const std::string& xml) {
  hwloc_topology_t t = nullptr;
  if (hwloc_topology_init(&t) != 0) return MC_STATUS(kInternal, "hwloc_topology_init failed");
  // PCI devices, bridges and OS devices (NICs, GPUs) are what NIC choice reads.
  hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_ALL);
  if (!xml.empty() && hwloc_topology_set_xml(t, xml.c_str()) != 0) {
    hwloc_topology_destroy(t);
    return MC_STATUS(kInvalidArgument, "hwloc cannot read " << xml);
  }
  if (hwloc_topology_load(t) != 0) {
    hwloc_topology_destroy(t);
    return MC_STATUS(kInvalidArgument,
                     "hwloc cannot load " << (xml.empty() ? std::string("this machine") : xml));
  }
  return t;
}

}  // namespace

Result<std::shared_ptr<const Topology>> Topology::fromXml(const std::string& path) {
  MC_ASSIGN_OR_RETURN(hwloc_topology_t t, openTopology(path));
  auto impl = std::make_unique<Impl>();
  impl->topo = t;
  return std::shared_ptr<const Topology>(new Topology(std::move(impl), "xml " + path));
}

Result<std::shared_ptr<const Topology>> Topology::probe() {
  MC_ASSIGN_OR_RETURN(hwloc_topology_t t, openTopology(""));
  auto impl = std::make_unique<Impl>();
  impl->topo = t;
  return std::shared_ptr<const Topology>(new Topology(std::move(impl), "probed"));
}

std::string Topology::pciOf(const std::string& osdev_name) const {
  if (!impl_) return "";
  for (hwloc_obj_t o = hwloc_get_next_osdev(impl_->topo, nullptr); o != nullptr;
       o = hwloc_get_next_osdev(impl_->topo, o)) {
    if (o->name == nullptr || osdev_name != o->name) continue;
    for (hwloc_obj_t p = o->parent; p != nullptr; p = p->parent) {
      if (p->type != HWLOC_OBJ_PCI_DEVICE) continue;
      char buf[32];
      const auto& a = p->attr->pcidev;
      snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%01x", a.domain, a.bus, a.dev, a.func);
      return buf;
    }
  }
  return "";
}

int Topology::numaOf(const std::string& pci) const {
  if (!impl_) return -1;
  hwloc_obj_t d = impl_->pciDev(pci);
  if (d == nullptr) return -1;
  std::set<int> n = impl_->numaNodes(d);
  return n.size() == 1 ? *n.begin() : -1;
}

int Topology::numaOfMemory(const void* addr, uint64_t len) const {
  if (!impl_ || !hwloc_topology_is_thissystem(impl_->topo) || len == 0) return -1;
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  int node = -1;
  if (hwloc_get_area_memlocation(impl_->topo, addr, len, set, HWLOC_MEMBIND_BYNODESET) == 0 &&
      hwloc_bitmap_weight(set) == 1)
    node = hwloc_bitmap_first(set);
  hwloc_bitmap_free(set);
  return node;
}

Topology::Distance Topology::distance(const std::string& nic_pci, const MemLocation& where) const {
  if (!impl_) return kUnknown;
  hwloc_obj_t nic = impl_->pciDev(nic_pci);
  if (nic == nullptr) return kUnknown;
  std::set<int> nic_numa = impl_->numaNodes(nic);
  if (!where.pci.empty()) {
    hwloc_obj_t dev = impl_->pciDev(where.pci);
    if (dev == nullptr) return kUnknown;
    if (Impl::sameSwitch(nic, dev)) return kSwitch;
    for (int n : impl_->numaNodes(dev))
      if (nic_numa.count(n) != 0) return kNuma;
    return kFar;
  }
  if (where.numa < 0) return kUnknown;
  return nic_numa.count(where.numa) != 0 ? kNuma : kFar;
}

#else  // no hwloc in this build: nothing is known

struct Topology::Impl {};

Result<std::shared_ptr<const Topology>> Topology::fromXml(const std::string& path) {
  return MC_STATUS(kNotSupported, "built without hwloc: cannot read " << path);
}
Result<std::shared_ptr<const Topology>> Topology::probe() {
  return MC_STATUS(kNotSupported, "built without hwloc");
}
std::string Topology::pciOf(const std::string&) const { return ""; }
int Topology::numaOf(const std::string&) const { return -1; }
int Topology::numaOfMemory(const void*, uint64_t) const { return -1; }
Topology::Distance Topology::distance(const std::string&, const MemLocation&) const {
  return kUnknown;
}

#endif

Topology::Topology(std::unique_ptr<Impl> impl, std::string source)
    : impl_(std::move(impl)), source_(std::move(source)) {}

Topology::~Topology() = default;

std::shared_ptr<const Topology> Topology::empty() {
  return std::shared_ptr<const Topology>(new Topology(nullptr, "none"));
}

std::shared_ptr<const Topology> Topology::load() {
  // Once per process for each value of MC_TOPOLOGY_XML (probing takes tens of milliseconds).
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Topology>> cache;
  const std::string xml = params::getString("MC_TOPOLOGY_XML");
  std::lock_guard<std::mutex> g(mu);
  auto& topo = cache[xml];
  if (topo) return topo;
  auto t = xml.empty() ? probe() : fromXml(xml);
  if (t.ok()) {
    topo = *t;
  } else {
    MC_LOG(WARN, ENGINE) << "no topology (" << t.status().message()
                         << "): every NIC is taken as equally near every buffer";
    topo = std::shared_ptr<const Topology>(new Topology(nullptr, "none"));
  }
  return topo;
}

std::vector<int> Topology::nearest(const std::vector<std::string>& nic_pcis,
                                   const MemLocation& where) const {
  Distance best = kFar;
  std::vector<Distance> d(nic_pcis.size());
  for (size_t i = 0; i < nic_pcis.size(); ++i) {
    d[i] = distance(nic_pcis[i], where);
    if (d[i] < best) best = d[i];
  }
  std::vector<int> out;
  for (size_t i = 0; i < nic_pcis.size(); ++i)
    if (best == kFar || d[i] == best) out.push_back(static_cast<int>(i));
  return out;
}

const char* distanceName(Topology::Distance d) {
  switch (d) {
    case Topology::kSwitch: return "same PCI switch";
    case Topology::kNuma: return "same NUMA node";
    case Topology::kFar: return "far";
    default: return "unknown";
  }
}

}  // namespace mooncake::engine
