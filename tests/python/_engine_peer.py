"""A decode-side process for tests/python/test_engine_p2p.py, doing what vLLM's and SGLang's
decode workers do with upstream's TransferEngine: initialize in P2PHANDSHAKE mode with protocol
"rdma", register a KV cache (a torch tensor), publish "host:rpc_port" and its addresses (here:
one JSON line on stdout), then wait for the prefill side's writes and notifications.

Commands (one per stdin line, one JSON answer line each):
  digest OFF LEN       sha256 of KV bytes [OFF, OFF+LEN)
  wait_notify N MS     the first N notifications (waiting at most MS ms); for each, the digest
                       of the block its msg names ("OFF LEN") taken when it was seen
  notifies             what get_notifies() returns now
  fill SEED            KV := pattern(SEED)
  exit

argv: KV_BYTES [PROTOCOL [gpu]]; "gpu": the KV cache is GPU memory of the engine's device layer
(MC_DEVICE=sim in the tests: host code must not touch it; read and filled through the layer's
copies), registered as upstream's callers do (batch_register_memory, location "*").
"""
import hashlib
import json
import sys
import time

import torch
from mooncake.engine import TransferEngine

KV_BYTES = int(sys.argv[1])
PROTOCOL = sys.argv[2] if len(sys.argv) > 2 else "rdma"
GPU = len(sys.argv) > 3 and sys.argv[3] == "gpu"


def pattern(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def main():
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", PROTOCOL, "")
    if rc != 0:
        print(json.dumps({"error": f"initialize -> {rc}"}), flush=True)
        return 1
    kv = torch.zeros(KV_BYTES, dtype=torch.uint8)
    if GPU:
        from mooncake import _C
        kv_ptr = _C._device_alloc(KV_BYTES, 0)
        _C._device_copy(kv_ptr, kv.data_ptr(), KV_BYTES)  # zeroed
    else:
        kv_ptr = kv.data_ptr()
    rc = te.batch_register_memory([kv_ptr], [KV_BYTES])
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "kv": kv_ptr,
                      "bytes": KV_BYTES, "register": rc}), flush=True)

    def digest(off, n):
        if GPU:  # kv is the host copy of the GPU cache
            _C._device_copy(kv.data_ptr() + off, kv_ptr + off, n)
        return hashlib.sha256(kv[off:off + n].numpy().tobytes()).hexdigest()

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digest":
            out = {"digest": digest(int(cmd[1]), int(cmd[2]))}
        elif cmd[0] == "wait_notify":
            want, until = int(cmd[1]), time.monotonic() + int(cmd[2]) / 1000
            seen = []
            while len(seen) < want and time.monotonic() < until:
                for n in te.get_notifies():
                    off, ln = (int(x) for x in n.msg.split())
                    seen.append({"name": n.name, "msg": n.msg, "digest": digest(off, ln)})
                time.sleep(0.001)
            out = {"seen": seen}
        elif cmd[0] == "notifies":
            out = {"notifies": [[n.name, n.msg] for n in te.get_notifies()]}
        elif cmd[0] == "fill":
            kv.copy_(pattern(int(cmd[1]), KV_BYTES))
            if GPU:
                _C._device_copy(kv_ptr, kv.data_ptr(), KV_BYTES)
            out = {"ok": True}
        elif cmd[0] == "exit":
            print(json.dumps({"bye": True}), flush=True)
            break
        else:
            out = {"error": f"unknown command {cmd[0]}"}
        print(json.dumps(out), flush=True)
    te.batch_unregister_memory([kv_ptr])
    return 0


if __name__ == "__main__":
    sys.exit(main())
