"""GPU check (scripts/gpu_check.sh) of upstream's TransferEngine on GPU memory, as vLLM's,
SGLang's and LMCache's prefill/decode connectors use it: a decode process registers a KV cache
in GPU memory (batch_register_memory, location "*"), this process registers a GPU source the
same way and writes blocks into the cache (batch_transfer_sync_write), reads them back into GPU
memory, and times a large write. Every byte is compared through host copies.

    python3 tests/gpu/p2p_gpu_check.py --device cuda|sim [--mib 64] [--json F]

cuda: torch CUDA tensors (what the connectors register); sim: the device layer's simulation
(MC_DEVICE=sim, memory from mooncake._C._device_alloc), so that the script itself is tried
where no GPU is. Prints one JSON line {"check": "p2p gpu", "ok": ..., ...}; exit 0 when ok.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch


class Gpu:
    """GPU memory of either kind, touched by host code only through copies."""

    def __init__(self, device):
        self.device = device
        self.tensors = {}  # cuda: address -> the tensor that owns it
        if device == "sim":
            from mooncake import _C
            self._C = _C

    def alloc(self, n):
        if self.device == "cuda":
            t = torch.zeros(n, dtype=torch.uint8, device="cuda")
            self.tensors[t.data_ptr()] = t
            return t.data_ptr()
        return self._C._device_alloc(n, 0)

    def put(self, ptr, host):
        if self.device == "cuda":
            self.tensors[ptr].copy_(host)
            torch.cuda.synchronize()
        else:
            self._C._device_copy(ptr, host.data_ptr(), host.numel())

    def get(self, base, off, n):
        if self.device == "cuda":
            torch.cuda.synchronize()
            return self.tensors[base][off:off + n].cpu()
        host = torch.empty(n, dtype=torch.uint8)
        self._C._device_copy(host.data_ptr(), base + off, n)
        return host


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def decode(device, nbytes):
    from mooncake.engine import TransferEngine
    gpu = Gpu(device)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    kv = gpu.alloc(nbytes)
    rc = te.batch_register_memory([kv], [nbytes])
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "kv": kv, "register": rc}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "digest":
            off, n = int(cmd[1]), int(cmd[2])
            print(json.dumps({"digest": digest(gpu.get(kv, off, n))}), flush=True)
        else:
            break
    te.batch_unregister_memory([kv])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--json", default="")
    ap.add_argument("--role", default="")
    a = ap.parse_args()
    nbytes = a.mib << 20
    if a.device == "sim":
        os.environ["MC_DEVICE"] = "sim"
    if a.role == "decode":
        return decode(a.device, nbytes)
    out = {"check": "p2p gpu", "device": a.device, "ok": False}
    peer = subprocess.Popen([sys.executable, "-u", __file__, "--role", "decode", "--device",
                             a.device, "--mib", str(a.mib)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        from mooncake.engine import TransferEngine
        info = json.loads(peer.stdout.readline())
        assert info.get("register") == 0, f"decode side: register -> {info}"
        session, kv = info["session"], info["kv"]
        gpu = Gpu(a.device)
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        src, back = gpu.alloc(nbytes), gpu.alloc(nbytes)
        pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(5))
        gpu.put(src, pattern)
        assert te.register_memory(src, nbytes) == 0, "register_memory(GPU source, '*')"
        assert te.batch_register_memory([back], [nbytes]) == 0, "batch_register_memory(GPU)"
        block = 256 << 10
        n = nbytes // block
        rc = te.batch_transfer_sync_write(session, [src + i * block for i in range(n)],
                                          [kv + (n - 1 - i) * block for i in range(n)],
                                          [block] * n)
        assert rc == 0, f"batch_transfer_sync_write -> {rc}"
        expect = pattern.view(n, block).flip(0).reshape(-1)
        peer.stdin.write(f"digest 0 {nbytes}\n")
        peer.stdin.flush()
        got = json.loads(peer.stdout.readline())["digest"]
        assert got == digest(expect), "the decode side's cache differs from what was written"
        assert te.transfer_sync_read(session, back, kv, nbytes) == 0, "transfer_sync_read"
        assert torch.equal(gpu.get(back, 0, nbytes), expect), "read back differs"
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert te.transfer_sync_write(session, src, kv, nbytes) == 0
            times.append(time.perf_counter() - t0)
        times.sort()
        out.update(ok=True, mib=a.mib, write_gbps_p50=round(nbytes / times[2] / 1e9, 3))
    except BaseException as ex:  # the check's verdict, also on timeout's SIGINT
        out["detail"] = f"{type(ex).__name__}: {ex}"
    finally:
        try:
            peer.stdin.write("exit\n")
            peer.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass
        try:
            peer.wait(5)
        except subprocess.TimeoutExpired:
            peer.kill()
    print(json.dumps(out), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
