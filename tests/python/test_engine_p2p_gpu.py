"""mooncake.engine.TransferEngine on GPU memory, as vLLM's, SGLang's and LMCache's
prefill/decode code uses it: both sides register KV caches that live on the GPU
(`register_memory` / `batch_register_memory`, location "*" as upstream's default, or "cuda:N")
and move blocks between them, and between GPU and host memory, one-sidedly. Over the engine's
device layer simulation (MC_DEVICE=sim): its GPU memory faults when host code touches it, so
registering it as host memory, or a path that memcpy's it, fails. Both sides run in child
processes (the device layer is chosen once per process), on one host (the cuda transport) and
on two simulated hosts (tcp, staged through host memory); every byte is checked."""
import os
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch = pytest.importorskip("torch")
pytest.importorskip("mooncake.engine")
from test_engine_p2p import BLOCK, KV, Decode, digest, pattern  # noqa: E402

PREFILL = r"""
import ctypes, sys
import torch
from mooncake import _C
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode as Op

assert _C._device_layer() == "sim", _C._device_layer()
session, peer_kv, KV, BLOCK = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def pattern(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def to_host(ptr, n):
    t = torch.empty(n, dtype=torch.uint8)
    _C._device_copy(t.data_ptr(), ptr, n)
    return t


te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
half, n = KV // 2, KV // 2 // BLOCK
gpu_src = _C._device_alloc(half, 1)
gpu_src_bytes = pattern(11, half)
_C._device_copy(gpu_src, gpu_src_bytes.data_ptr(), half)
host_src = pattern(12, half)
# location "*": the GPU buffer is found to be GPU memory, the tensor host memory.
assert te.register_memory(gpu_src, half) == 0
assert te.batch_register_memory([host_src.data_ptr()], [half]) == 0
# Blocks GPU -> peer's GPU cache (first half, reversed order), host -> its second half.
rc = te.batch_transfer_sync_write(session, [gpu_src + i * BLOCK for i in range(n)],
                                  [peer_kv + (n - 1 - i) * BLOCK for i in range(n)], [BLOCK] * n)
assert rc == 0, rc
assert te.transfer_sync_write(session, host_src.data_ptr(), peer_kv + half, half) == 0
# Read it all back into GPU memory registered as "cuda:1", and into host memory.
gpu_dst = _C._device_alloc(KV, 1)
host_dst = torch.zeros(KV, dtype=torch.uint8)
assert te.batch_register_memory([gpu_dst, host_dst.data_ptr()], [KV, KV], "cuda:1") == -1
assert not te._e.is_registered(gpu_dst, KV)  # all or nothing: the first one went again
assert te.batch_register_memory([gpu_dst], [KV], "cuda:1") == 0
assert te.register_memory(host_dst.data_ptr(), KV, "cpu:0") == 0
expect = torch.cat([gpu_src_bytes.view(n, BLOCK).flip(0).reshape(-1), host_src])
assert te.transfer_sync_read(session, gpu_dst, peer_kv, KV) == 0
assert torch.equal(to_host(gpu_dst, KV), expect)
assert te.batch_transfer_sync_read(session, [host_dst.data_ptr() + i * BLOCK for i in range(2 * n)],
                                   [peer_kv + i * BLOCK for i in range(2 * n)], [BLOCK] * (2 * n)) == 0
assert torch.equal(host_dst, expect)
# A notification after a GPU write arrives after its bytes (the test digests them there).
assert te.transfer_sync(session, gpu_dst + half, peer_kv, BLOCK, Op.Write,
                        notify=TransferNotify("gpu", f"0 {BLOCK}")) == 0
# Bad input: negative codes, nothing registered.
loose = _C._device_alloc(BLOCK, 0)
assert te.register_memory(loose, BLOCK, "cpu") == -1  # GPU memory given as host memory
assert te.register_memory(host_dst.data_ptr() + 0, 64, "cuda:0") < 0  # overlaps / not GPU
spare = torch.zeros(BLOCK, dtype=torch.uint8)
assert te.register_memory(spare.data_ptr(), BLOCK, "cuda:0") == -1  # host memory as GPU
assert te.register_memory(loose, BLOCK, "cuda:3") == -1  # on device 0, not 3
assert te.register_memory(loose, BLOCK, "npu:0") == -1
assert te.register_memory(loose, BLOCK, "cuda:x") == -1
assert te.transfer_sync_write(session, loose, peer_kv, BLOCK) < 0  # never registered
assert te.register_memory(loose, BLOCK, "cuda:0") == 0
assert te.unregister_memory(loose) == 0
for p in (gpu_src, gpu_dst):
    assert te.unregister_memory(p) == 0
print("ok", flush=True)
"""


@pytest.mark.parametrize("hosts", ["one", "two"])
def test_gpu_kv_caches(hosts):
    env = dict(os.environ, MC_DEVICE="sim", MC_SECRET=secrets.token_hex(16))
    env.pop("MC_SECRET_FILE", None)
    env.pop("MC_FORCE_TCP", None)
    denv = dict(env, MC_HOST_ID="p2p-gpu-decode") if hosts == "two" else env
    penv = dict(env, MC_HOST_ID="p2p-gpu-prefill") if hosts == "two" else env
    d = Decode(denv, gpu=True)
    try:
        # The decode side watches for the notification while the prefill process writes: it
        # digests block 0 the moment it sees it, which before the notified write's bytes
        # landed would still hold the first write's bytes.
        d.send("wait_notify", 1, 150000)
        p = subprocess.Popen([sys.executable, "-c", PREFILL, d.session, str(d.kv), str(KV),
                              str(BLOCK)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=penv)
        try:
            out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if p.returncode != 0:
            d.proc.kill()  # (it would wait for the notification until its window ends)
        assert p.returncode == 0 and "ok" in out, out + err[-4000:]
        half, n = KV // 2, KV // 2 // BLOCK
        head = pattern(11, half).view(n, BLOCK).flip(0).reshape(-1)
        expect = torch.cat([head, pattern(12, half)])
        seen = d._read(30)["seen"]
        assert [x["name"] for x in seen] == ["gpu"]
        assert seen[0]["digest"] == digest(expect[half:half + BLOCK])
        expect[:BLOCK] = expect[half:half + BLOCK]
        assert d.ask("digest", 0, KV)["digest"] == digest(expect)
    finally:
        d.close()


def test_gpu_check_step_over_the_simulation():
    """scripts/gpu_check.sh's TransferEngine step (tests/gpu/p2p_gpu_check.py), run here over
    the simulation so that it does not rot between GPU sessions."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu",
                          "p2p_gpu_check.py")
    env = dict(os.environ, MC_SECRET=secrets.token_hex(16))
    env.pop("MC_SECRET_FILE", None)
    r = subprocess.run([sys.executable, script, "--device", "sim", "--mib", "4"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and '"ok": true' in r.stdout, r.stdout + r.stderr[-3000:]
