"""The store on GPU buffers from Python (upstream's register_buffer + put_from / get_into /
batch_get_into / batch_put_from with device pointers), over the engine's device layer
simulation (MC_DEVICE=sim): its GPU memory faults when host code touches it, so a path that
memcpy's the buffer kills the client. The client runs in a child process (the device layer is
chosen once per process) beside a master and a holder that lends host memory, on one host (the
cuda transport moves the GPU side) and on two simulated hosts (tcp, staged through host memory).
Every byte is checked through the layer's copies. The tensor calls too: tensors in GPU memory
written (put_tensor, the tensor-parallel split), and read into a registered GPU buffer
(get_tensor_into and its batch and tp forms return tensors viewing that buffer).
Segments in GPU memory (MC_STORE_SEGMENT_DEVICE): the same calls with every client's segment
there, and the objects of a GPU segment found again by a restarted master (the owner walks its
records through host copies)."""
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
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

assert _C._device_layer() == "sim", _C._device_layer()
MiB = 1 << 20
s = MooncakeDistributedStore()
# A segment of its own (16 MiB) beside the holder's, and a 16 MiB local buffer.
assert s.setup("127.0.0.1", "", 16 * MiB, 16 * MiB, "tcp", "", sys.argv[1]) == 0


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


GPU_SEGMENTS = bool(os.environ.get("MC_STORE_SEGMENT_DEVICE"))


def pinned_only(what, call, pieces=0):
    # The bytes move between GPU memory and pinned host memory only (the store's segments,
    # the engine's staging), never through pageable host memory. Puts into segments in GPU
    # memory write each piece's record header (64 bytes + the key) and commit word from host
    # memory: at most 256 bytes a piece, never the data.
    before, before_bytes = _C._device_pageable_copies(), _C._device_pageable_bytes()
    r = call()
    if GPU_SEGMENTS and pieces:
        moved = _C._device_pageable_bytes() - before_bytes
        assert moved <= 256 * pieces, f"{what} copied {moved} bytes through pageable memory"
    else:
        assert _C._device_pageable_copies() == before, what + " copied through pageable memory"
    return r


v1 = os.urandom(3 * MiB + 5)
assert s.put("gpu/v1", v1) == 0
assert pinned_only("get_into", lambda: s.get_into("gpu/v1", g, 4 * MiB)) == len(v1)
assert to_host(g, len(v1)) == v1, "get_into a GPU buffer"

v2 = os.urandom(70000)
to_gpu(g + MiB + 3, v2)
assert pinned_only("put_from", lambda: s.put_from("gpu/v2", g + MiB + 3, len(v2)), 1) == 0
assert s.get("gpu/v2") == v2, "put_from a GPU buffer"

# An object in this client's own segment: copied here between it and the GPU buffer.
own = ReplicateConfig()
own.preferred_segment = s.get_hostname()
v4 = os.urandom(MiB + 9)
to_gpu(g, v4)
assert pinned_only("put_from own segment", lambda: s.put_from("gpu/v4", g, len(v4), own),
                   1) == 0
desc = s.get_replica_desc("gpu/v4")[0].get_memory_descriptor().buffer_descriptor
assert desc.transport_endpoint == s.get_hostname(), "not placed in this client's segment"
assert _C._is_device_memory(desc.buffer_address) == GPU_SEGMENTS, "the segment's memory"
assert s.get("gpu/v4") == v4
to_gpu(g, bytes(len(v4)))
assert pinned_only("get_into own segment", lambda: s.get_into("gpu/v4", g, 4 * MiB)) == len(v4)
assert to_host(g, len(v4)) == v4

v3 = os.urandom(100)  # small enough to travel inside its record
to_gpu(g + 7, v3)
assert s.put_from("gpu/v3", g + 7, len(v3)) == 0
assert s.get("gpu/v3") == v3

assert pinned_only("batch_get_into", lambda: s.batch_get_into(
    ["gpu/v2", "gpu/v3"], [g + 2 * MiB, g + 3 * MiB], [MiB, MiB])) == [len(v2), len(v3)]
assert to_host(g + 2 * MiB, len(v2)) == v2 and to_host(g + 3 * MiB, len(v3)) == v3

# SGLang's layer-wise loader: a read session, then per layer one key-major range read into
# the GPU KV cache (object bytes [layer * step, +step) of each key to its own place).
assert s.batch_get_session_start(["gpu/v1", "gpu/v2"]) == [0, 0]
step = 16384
for layer in range(4):
    assert pinned_only("ranges", lambda: s.batch_get_into_multi_buffer_ranges(
        ["gpu/v1", "gpu/v2"], [[g + layer * step], [g + 2 * MiB + layer * step]], [[step], [step]],
        [[layer * step], [layer * step]])) == [step, step]
assert to_host(g, 4 * step) == v1[:4 * step] and to_host(g + 2 * MiB, 4 * step) == v2[:4 * step]
assert s.batch_get_session_end(["gpu/v1", "gpu/v2"]) == 0

# vLLM's layer-wise saver: a put session, per layer one key-major range write from the GPU KV
# cache into each object, then the end publishes them (records and commit words: host memory).
v5 = os.urandom(4 * step)
to_gpu(g + 3 * MiB, v5)
assert s.batch_put_session_start(["gpu/s1", "gpu/s2"], [4 * step, 4 * step]) == [0, 0]
for layer in range(4):
    assert pinned_only("put ranges", lambda: s.batch_put_from_multi_buffer_ranges(
        ["gpu/s1", "gpu/s2"], [[g + 3 * MiB + layer * step], [g + 3 * MiB + (3 - layer) * step]],
        [[step], [step]], [[layer * step], [layer * step]])) == [step, step]
assert pinned_only("put session end", lambda: s.batch_put_session_end(["gpu/s1", "gpu/s2"]),
                   4) == [0, 0]
assert s.get("gpu/s1") == v5
assert s.get("gpu/s2") == b"".join(v5[i * step:(i + 1) * step] for i in (3, 2, 1, 0))

parts = [os.urandom(1000 + 999 * i) for i in range(3)]
for i, p in enumerate(parts):
    to_gpu(g + i * MiB, p)
assert pinned_only("batch_put_from", lambda: s.batch_put_from(
    [f"gpu/b{i}" for i in range(3)], [g + i * MiB for i in range(3)],
    [len(p) for p in parts]), 3) == [0, 0, 0]
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


TENSOR_CLIENT = r"""
import sys
import torch
from mooncake import _C
from mooncake.store import MooncakeDistributedStore

assert _C._device_layer() == "sim", _C._device_layer()
MiB = 1 << 20
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "", 0, 16 * MiB, "tcp", "", sys.argv[1]) == 0


def to_gpu(t):
    d = _C._device_empty_like(t)
    _C._device_copy(d.data_ptr(), t.contiguous().data_ptr(), t.numel() * t.element_size())
    return d


def to_host(d):
    assert _C._is_device_memory(d.data_ptr()), "not a view of GPU memory"
    t = torch.empty(d.shape, dtype=d.dtype)
    _C._device_copy(t.data_ptr(), d.data_ptr(), t.numel() * t.element_size())
    return t


def obj_bytes(t):
    return 12 + 8 * t.dim() + t.numel() * t.element_size()


x = torch.randn(64, 33)
y = torch.arange(1000, dtype=torch.int16)
z = torch.randn(4, 6).to(torch.bfloat16)
assert s.put_tensor("t/x", to_gpu(x)) == 0
assert s.put_tensor("t/y", to_gpu(y)) == 0
assert torch.equal(s.get_tensor("t/x"), x), "put_tensor of a GPU tensor"
assert torch.equal(s.get_tensor("t/y"), y)

buf = _C._device_alloc(4 * MiB, 0)
assert s.register_buffer(buf, 4 * MiB) == 0
v = s.get_tensor_into("t/x", buf, 4 * MiB)
assert v is not None and v.shape == x.shape and v.dtype == x.dtype
assert torch.equal(to_host(v), x), "get_tensor_into a GPU buffer"
vs = s.batch_get_tensor_into(["t/x", "t/y"], [buf, buf + 2 * MiB], [2 * MiB, 2 * MiB])
assert torch.equal(to_host(vs[0]), x) and torch.equal(to_host(vs[1]), y), "batch_get_tensor_into"

# The GPU buffer holds t/y's object now (at buf + 2 MiB): store it again from there.
assert s.put_tensor_from("t/y2", buf + 2 * MiB, obj_bytes(y)) == 0
assert torch.equal(s.get_tensor("t/y2"), y), "put_tensor_from a GPU buffer"

# Tensor parallel: shards of a GPU tensor along dim 1 (views that are not contiguous).
assert s.put_tensor_with_tp("t/z", to_gpu(z), tp_size=2, split_dim=1) == 0
for r in range(2):
    want = z.chunk(2, 1)[r]
    assert torch.equal(s.get_tensor_with_tp("t/z", tp_rank=r, tp_size=2, split_dim=1), want)
    g = s.get_tensor_with_tp_into("t/z", buf + r * MiB, MiB, tp_rank=r, tp_size=2, split_dim=1)
    assert torch.equal(to_host(g), want), "get_tensor_with_tp_into a GPU buffer"
# ... and from a GPU buffer holding the whole serialized tensor (t/x's object at buf).
assert s.get_tensor_into("t/x", buf, 4 * MiB) is not None
assert s.put_tensor_with_tp_from("t/xs", buf, obj_bytes(x), tp_size=2, split_dim=0) == 0
assert torch.equal(s.get_tensor_with_tp("t/xs", tp_rank=1, tp_size=2), x.chunk(2, 0)[1])

assert s.unregister_buffer(buf) == 0
_C._device_free(buf)
s.close()
print("ok", flush=True)
"""


RESTART_CLIENT = r"""
import os, sys
from mooncake import _C
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

assert _C._device_layer() == "sim", _C._device_layer()
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "", 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
own = ReplicateConfig()
own.preferred_segment = s.get_hostname()
vals = {f"r/{i}": os.urandom(100 + 40000 * i) for i in range(6)}
for k, v in vals.items():
    rc = s.put(k, v, own)
    assert rc == 0, (k, rc)
seg = s.get_replica_desc("r/0")[0].get_memory_descriptor().buffer_descriptor
assert _C._is_device_memory(seg.buffer_address), "the segment is not GPU memory"
assert s.remove("r/0", force=True) == 0  # (get_replica_desc leased it)
# The master wipes r/0's record (its magic, the first word of the 128 bytes before the piece:
# 64 of header, the key padded to 64) asynchronously: wait until it landed, else a master
# killed now would leave it to come back.
import ctypes, time
word = ctypes.c_uint64(1)
deadline = time.time() + 10
while True:
    _C._device_copy(ctypes.addressof(word), seg.buffer_address - 128, 8)
    if word.value == 0:
        break
    assert time.time() < deadline, "the master never wiped r/0's record"
    time.sleep(0.01)
pageable = _C._device_pageable_bytes()
print("put", flush=True)
sys.stdin.readline()  # the master was restarted
deadline = time.time() + 30
while s.is_exist("r/5") != 1:  # metadata only: no bytes move
    assert time.time() < deadline, "the restarted master never learnt r/5"
    time.sleep(0.1)
# The report walked the 16 MiB GPU segment through a pinned window: no pageable copies.
assert _C._device_pageable_bytes() - pageable < (1 << 20), \
    f"{_C._device_pageable_bytes() - pageable} bytes of pageable copies for the report"
for k, v in vals.items():
    got = s.get(k)
    assert got == (b"" if k == "r/0" else v), (k, len(got))
s.close()
print("ok", flush=True)
"""


def run_client(script, hosts, segment_device=None):
    m = Master()
    holder_env = {"MC_HOST_ID": "gpu-store-host-a"} if hosts == "two" else {}
    if segment_device is not None:
        holder_env.update(MC_DEVICE="sim", MC_STORE_SEGMENT_DEVICE=segment_device)
    h = Holder(m.addr, 32 << 20, env=holder_env)
    try:
        env = dict(os.environ, MC_DEVICE="sim")
        if segment_device is not None:
            env["MC_STORE_SEGMENT_DEVICE"] = segment_device
        if hosts == "two":
            env["MC_HOST_ID"] = "gpu-store-host-b"
        r = subprocess.run([sys.executable, "-c", script, m.addr], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), \
            f"client exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    finally:
        h.close()
        m.close()


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_gpu_tensor_calls(hosts):
    run_client(TENSOR_CLIENT, hosts)


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_gpu_buffers(hosts):
    run_client(CLIENT, hosts)


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_gpu_segments(hosts):
    """Every segment in GPU memory: puts land there, gets and get_into GPU buffers read it."""
    run_client(CLIENT, hosts, segment_device="cuda:0")


def test_gpu_segment_survives_master_restart():
    m = Master()
    env = dict(os.environ, MC_DEVICE="sim", MC_STORE_SEGMENT_DEVICE="gpu:1")
    c = subprocess.Popen([sys.executable, "-c", RESTART_CLIENT, m.addr], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    m2 = None
    try:
        line = c.stdout.readline()
        assert line.strip() == "put", line + c.stderr.read()[-4000:]
        m.proc.kill()
        m.proc.wait(10)
        m2 = Master(port=m.port)
        c.stdin.write("restarted\n")
        c.stdin.flush()
        out, err = c.communicate(timeout=60)
        assert c.returncode == 0 and out.strip().endswith("ok"), \
            f"client exited {c.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    finally:
        if c.poll() is None:
            c.kill()
        (m2 or m).close()
