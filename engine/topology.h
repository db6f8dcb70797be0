// Topology: where NICs, GPUs and memory sit in the machine (PCI switches, NUMA nodes), read
// with hwloc, so that a transport can send a buffer's bytes through the NICs nearest to it.
//
// Contracts:
//  - load() reads the topology once per process (per value of MC_TOPOLOGY_XML): from the hwloc XML file MC_TOPOLOGY_XML
//    names (e.g. written by `lstopo file.xml` on another machine; tests use fixtures from
//    tests/data/topology), else by probing this machine. It never fails: without hwloc in the
//    build, or when loading fails (logged at WARN), the topology is empty and every NIC is
//    equally near everything.
//  - A NIC or GPU is named by its PCI address ("0000:17:00.0", what sysfs gives for a device)
//    or by its OS device name ("mlx5_0", "cuda3").
//  - distance(nic, where) ranks a NIC for memory at `where`: kSwitch when both sit below the
//    same PCI switch (their nearest common ancestor is a PCI-to-PCI bridge: NCCL's PIX/PXB),
//    kNuma when the NIC is attached to the memory's NUMA node (or, for a GPU, to the GPU's),
//    kFar otherwise, kUnknown when either is not in the topology.
//  - nearest(nics, where) is the NICs of the best rank found (all of them when none ranks
//    better than kFar or nothing is known), in the order given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/status.h"

namespace mooncake::engine {

// Where a buffer lives: host memory on a NUMA node (-1: unknown), or a PCI device (a GPU).
struct MemLocation {
  int numa = -1;
  std::string pci;  // a device's PCI address; wins over numa when set
  static MemLocation any() { return {}; }
};

class Topology {
 public:
  enum Distance { kSwitch = 0, kNuma = 1, kFar = 2, kUnknown = 3 };

  // The process's topology (see above).
  static std::shared_ptr<const Topology> load();
  // From an XML file (tests); an error when hwloc is missing or the file does not load.
  static Result<std::shared_ptr<const Topology>> fromXml(const std::string& path);
  // This machine's (no XML).
  static Result<std::shared_ptr<const Topology>> probe();
  // Nothing known.
  static std::shared_ptr<const Topology> empty();

  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  bool known() const { return impl_ != nullptr; }
  // "xml <path>", "probed" or "none (<why>)": for logs.
  const std::string& source() const { return source_; }

  // The PCI address of an OS device ("mlx5_0", "cuda3"); empty when not in the topology.
  std::string pciOf(const std::string& osdev_name) const;
  // The NUMA node (os index) a PCI device is attached to; -1 when unknown or several.
  int numaOf(const std::string& pci) const;
  // The NUMA node holding [addr, addr+len) of this process (probed topologies only; pages
  // not touched yet have no node); -1 when unknown or spread over several.
  int numaOfMemory(const void* addr, uint64_t len) const;

  Distance distance(const std::string& nic_pci, const MemLocation& where) const;
  std::vector<int> nearest(const std::vector<std::string>& nic_pcis,
                           const MemLocation& where) const;

  struct Impl;

 private:
  Topology(std::unique_ptr<Impl> impl, std::string source);
  std::unique_ptr<Impl> impl_;
  std::string source_;
};

const char* distanceName(Topology::Distance d);

}  // namespace mooncake::engine
