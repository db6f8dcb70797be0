"""The store on GPU buffers from Python (upstream's register_buffer + put_from / get_into /
batch_get_into / batch_put_from with device pointers), over the engine's device layer
simulation (MC_DEVICE=sim): its GPU memory faults when host code touches it, so a path that
memcpy's the buffer kills the client. The client runs in a child process (the device layer is
chosen once per process) beside a master and a holder that lends host memory, on one host (the
cuda transport moves the GPU side) and on two simulated hosts (tcp, staged through host memory).
Every byte is checked through the layer's copies."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Holder, Master, master_bin  # noqa: E402

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")

CLIENT = r"""
import ctypes, os, sys
from mooncake import _C
from mooncake.store import MooncakeDistributedStore

assert _C._device_layer() == "sim", _C._device_layer()
MiB = 1 << 20
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "", 0, 16 * MiB, "tcp", "", sys.argv[1]) == 0


def to_host(ptr, n):
    b = bytearray(n)
    _C._device_copy(ctypes.addressof((ctypes.c_char * n).from_buffer(b)), ptr, n)
    return bytes(b)


def to_gpu(ptr, data):
    b = bytearray(data)
    _C._device_copy(ptr, ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)), len(b))


g = _C._device_alloc(4 * MiB, 0)
loose = _C._device_alloc(MiB, 1)  # never registered
assert s.register_buffer(g, 4 * MiB) == 0

v1 = os.urandom(3 * MiB + 5)
assert s.put("gpu/v1", v1) == 0
assert s.get_into("gpu/v1", g, 4 * MiB) == len(v1)
assert to_host(g, len(v1)) == v1, "get_into a GPU buffer"

v2 = os.urandom(70000)
to_gpu(g + MiB + 3, v2)
assert s.put_from("gpu/v2", g + MiB + 3, len(v2)) == 0
assert s.get("gpu/v2") == v2, "put_from a GPU buffer"

v3 = os.urandom(100)  # small enough to travel inside its record
to_gpu(g + 7, v3)
assert s.put_from("gpu/v3", g + 7, len(v3)) == 0
assert s.get("gpu/v3") == v3

assert s.batch_get_into(["gpu/v2", "gpu/v3"], [g + 2 * MiB, g + 3 * MiB], [MiB, MiB]) == \
    [len(v2), len(v3)]
assert to_host(g + 2 * MiB, len(v2)) == v2 and to_host(g + 3 * MiB, len(v3)) == v3

parts = [os.urandom(1000 + 999 * i) for i in range(3)]
for i, p in enumerate(parts):
    to_gpu(g + i * MiB, p)
assert s.batch_put_from([f"gpu/b{i}" for i in range(3)], [g + i * MiB for i in range(3)],
                        [len(p) for p in parts]) == [0, 0, 0]
assert [s.get(f"gpu/b{i}") for i in range(3)] == parts

# GPU memory that was never registered is refused, as any unregistered buffer is.
assert s.get_into("gpu/v3", loose, MiB) < 0
assert s.put_from("gpu/loose", loose, 100) < 0
assert s.unregister_buffer(g) == 0
assert s.get_into("gpu/v3", g, MiB) < 0, "an unregistered buffer was written"
_C._device_free(g)
_C._device_free(loose)
s.close()
print("ok", flush=True)
"""


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_gpu_buffers(hosts):
    m = Master()
    holder_env = {"MC_HOST_ID": "gpu-store-host-a"} if hosts == "two" else {}
    h = Holder(m.addr, 32 << 20, env=holder_env)
    try:
        env = dict(os.environ, MC_DEVICE="sim")
        if hosts == "two":
            env["MC_HOST_ID"] = "gpu-store-host-b"
        r = subprocess.run([sys.executable, "-c", CLIENT, m.addr], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), \
            f"client exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    finally:
        h.close()
        m.close()
