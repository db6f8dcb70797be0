#!/usr/bin/env python3
"""Writes the hwloc XML topology fixtures the engine's topology tests load (MC_TOPOLOGY_XML).

    /usr/bin/python3 tests/data/topology/make_fixtures.py    (rewrites the .xml files here)

Each fixture is a made-up machine in hwloc 2.x's XML format (what `lstopo file.xml` writes),
reduced to what NIC choice reads: packages, NUMA nodes, cores, PCI host bridges, PCI switches
(PCI-to-PCI bridges), devices and their OS devices ("mlx5_N" InfiniBand/RoCE NICs of type
OpenFabrics, "cudaN" GPUs of type CoProcessor).

  dgx8.xml      2 sockets x 1 NUMA node; 4 PCI switches per socket, each with one GPU and one
                NIC (GPU k and mlx5_k share switch k), like an 8-GPU/8-NIC training box
  2socket.xml   2 sockets x 1 NUMA node, one NIC per socket (mlx5_0 on 0, mlx5_1 on 1), no GPU
  nonic.xml     1 socket, a PCI disk controller, no NIC

The NICs' PCI addresses are those the verbs emulator's devices name in the tests
(tests/engine/topology_test.cc, tests/engine/rdma_test.cc): see nic_bus() below.
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
CORES_PER_SOCKET = 4


def mask(bits):
    v = 0
    for b in bits:
        v |= 1 << b
    return f"0x{v:08x}"


class Xml:
    def __init__(self):
        self.lines = []
        self.gp = 0

    def open(self, indent, kind, **attrs):
        self.gp += 1
        attrs["gp_index"] = str(self.gp)
        a = " ".join(f'{k}="{v}"' for k, v in attrs.items())
        self.lines.append(f'{"  " * indent}<object type="{kind}" {a}>')

    def close(self, depth):
        self.lines.append(f'{"  " * depth}</object>')

    def leaf(self, indent, kind, **attrs):
        self.open(indent, kind, **attrs)
        self.lines[-1] = self.lines[-1][:-1] + "/>"


def sets(cpus, nodes):
    c, n = mask(cpus), mask(nodes)
    return dict(cpuset=c, complete_cpuset=c, nodeset=n, complete_nodeset=n)


def nic_bus(socket, switch):
    """PCI bus of the NIC behind switch `switch` of socket `socket` (emulator configs match)."""
    return 0x10 + 0x40 * socket + 0x08 * switch + 0x03


def gpu_bus(socket, switch):
    return 0x10 + 0x40 * socket + 0x08 * switch + 0x04


def pci(bus):
    return f"0000:{bus:02x}:00.0"


def osdev(x, depth, name, osdev_type, subtype):
    x.open(depth, "OSDev", name=name, subtype=subtype, osdev_type=str(osdev_type))
    x.close(depth)


def device(x, depth, bus, pci_class, ids, osdevs):
    x.open(depth, "PCIDev", pci_busid=pci(bus), pci_type=f"{pci_class} {ids} 00",
           pci_link_speed="31.5")
    for name, t, sub in osdevs:
        osdev(x, depth + 1, name, t, sub)
    x.close(depth)


def machine(sockets, per_socket_io):
    """per_socket_io(x, depth, socket) writes that socket's PCI tree."""
    x = Xml()
    ncpu = sockets * CORES_PER_SOCKET
    x.lines += ['<?xml version="1.0" encoding="UTF-8"?>',
                '<!DOCTYPE topology SYSTEM "hwloc2.dtd">',
                '<topology version="2.0">']
    x.open(1, "Machine", os_index="0", **sets(range(ncpu), range(sockets)),
           allowed_cpuset=mask(range(ncpu)), allowed_nodeset=mask(range(sockets)))
    for s in range(sockets):
        cpus = range(s * CORES_PER_SOCKET, (s + 1) * CORES_PER_SOCKET)
        x.open(2, "Package", os_index=str(s), **sets(cpus, [s]))
        x.leaf(3, "NUMANode", os_index=str(s), **sets(cpus, [s]), local_memory=str(64 << 30))
        for c in cpus:
            x.open(3, "Core", os_index=str(c), **sets([c], [s]))
            x.leaf(4, "PU", os_index=str(c), **sets([c], [s]))
            x.close(3)
        per_socket_io(x, 3, s)
        x.close(2)
    x.close(1)
    x.lines.append("</topology>")
    return "\n".join(x.lines) + "\n"


def host_bridge(x, depth, first, last):
    x.open(depth, "Bridge", bridge_type="0-1", depth="0", bridge_pci=f"0000:[{first:02x}-{last:02x}]")


def pci_bridge(x, depth, busid, first, last, level):
    x.open(depth, "Bridge", bridge_type="1-1", depth=str(level),
           bridge_pci=f"0000:[{first:02x}-{last:02x}]", pci_busid=busid,
           pci_type="0604 [10b5:8780] [0000:0000] 00", pci_link_speed="31.5")


MLX = ("0207", "[15b3:101b] [15b3:0007]")  # InfiniBand controller, ConnectX-6
GPU = ("0302", "[10de:2330] [10de:16c1]")  # 3D controller, H100 SXM


def dgx8(x, depth, s):
    base = 0x10 + 0x40 * s
    host_bridge(x, depth, base, base + 0x3f)
    for sw in range(4):
        k = 4 * s + sw
        b = base + 0x08 * sw
        # Root port (bus b+1) -> switch upstream port (internal bus b+2) -> one downstream
        # port for the NIC (bus b+3) and one for the GPU (bus b+4).
        pci_bridge(x, depth + 1, f"0000:{base:02x}:{sw + 1:02x}.0", b + 1, b + 4, 0)
        pci_bridge(x, depth + 2, f"0000:{b + 1:02x}:00.0", b + 2, b + 4, 1)
        pci_bridge(x, depth + 3, f"0000:{b + 2:02x}:00.0", b + 3, b + 3, 2)
        device(x, depth + 4, nic_bus(s, sw), *MLX, [(f"mlx5_{k}", 3, "OpenFabrics")])
        x.close(depth + 3)
        pci_bridge(x, depth + 3, f"0000:{b + 2:02x}:01.0", b + 4, b + 4, 2)
        device(x, depth + 4, gpu_bus(s, sw), *GPU, [(f"cuda{k}", 5, "CUDA")])
        x.close(depth + 3)
        x.close(depth + 2)
        x.close(depth + 1)
    x.close(depth)


def two_socket(x, depth, s):
    base = 0x10 + 0x40 * s
    host_bridge(x, depth, base, base + 0x3f)
    pci_bridge(x, depth + 1, f"0000:{base:02x}:01.0", nic_bus(s, 0), nic_bus(s, 0), 0)
    device(x, depth + 2, nic_bus(s, 0), *MLX, [(f"mlx5_{s}", 3, "OpenFabrics")])
    x.close(depth + 1)
    x.close(depth)


def no_nic(x, depth, s):
    host_bridge(x, depth, 0x00, 0x0f)
    device(x, depth + 1, 0x01, "0106", "[8086:a352] [8086:7270]", [("sda", 0, "Disk")])
    x.close(depth)


def main():
    for name, text in (("dgx8.xml", machine(2, dgx8)), ("2socket.xml", machine(2, two_socket)),
                       ("nonic.xml", machine(1, no_nic))):
        with open(os.path.join(HERE, name), "w") as f:
            f.write(text)
        print(name)


if __name__ == "__main__":
    main()
