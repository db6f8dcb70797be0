"""The verbs emulator (tests/fakes/verbs, docs/rdma.md) for Python tests: simulated hosts
(MC_HOST_ID) that each get two emulated RoCE NICs, so that the engine picks rdma between them
(shared memory within a host). The installed mooncake links libibverbs.so.1; the emulator's
library of that name comes first on LD_LIBRARY_PATH in the processes a test starts.

The emulator is found in the build tree: $MC_TEST_BUILD_DIR (scripts/test.sh and
scripts/test_torch2.sh set it), else <repo>/build."""
import glob
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NICS = ("mlx5_0", "mlx5_1")


def library_dir():
    """The folder holding the emulator's libibverbs.so.1, or None (a build without rdma)."""
    build = os.environ.get("MC_TEST_BUILD_DIR") or os.path.join(REPO, "build")
    d = os.path.join(build, "tests", "fakes", "verbs", "lib")
    return d if os.path.exists(os.path.join(d, "libibverbs.so.1")) else None


class Fabric:
    """An emulated fabric of its own: `hosts` simulated hosts with two NICs each. env() is
    what a process on it needs (add MC_HOST_ID); close() removes what the fabric left."""

    def __init__(self, tag, hosts):
        self.lib = library_dir()
        assert self.lib is not None, "no verbs emulator in the build tree"
        self.name = f"mcpy{os.getpid()}{tag}"
        self.hosts = list(hosts)
        self.conf = f"/tmp/mcfv-{self.name}.conf"
        self._remove_files()
        with open(self.conf, "w") as f:
            f.write("# written by tests/python/_fake_verbs.py\n")
            for h, host in enumerate(self.hosts):
                for n, nic in enumerate(NICS):
                    f.write(f"device {nic} host={host} pci=0000:{0x13 + 0x40 * n:02x}:00.0 "
                            f"link=ethernet ip=10.{h + 1}.0.{n + 1} mtu=4096\n")

    def env(self):
        path = os.environ.get("LD_LIBRARY_PATH", "")
        return {"LD_LIBRARY_PATH": self.lib + (":" + path if path else ""),
                "MC_FAKE_VERBS_CONFIG": self.conf, "MC_FAKE_VERBS_FABRIC": self.name}

    def tx_bytes(self, host):
        """Payload bytes the NICs of `host` sent (both NICs), as the emulator counts them."""
        total = 0
        for nic in NICS:
            path = f"/dev/shm/mcfv-{self.name}-dev-{host}.{nic}"
            if os.path.exists(path):
                with open(path, "rb") as f:
                    head = f.read(48)  # fake_verbs_control.h DevShm: tx_bytes at offset 40
                total += struct.unpack_from("<Q", head, 40)[0]
        return total

    def _remove_files(self):
        for p in glob.glob(f"/dev/shm/mcfv-{self.name}-*"):
            os.unlink(p)
        for p in glob.glob(f"/tmp/mcfv-{self.name}-*-sysfs"):
            shutil.rmtree(p, ignore_errors=True)

    def close(self):
        self._remove_files()
        if os.path.exists(self.conf):
            os.unlink(self.conf)
