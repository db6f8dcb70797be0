"""One rank of the Store.from_group test: argv = rank world port [master host:port]."""
import os
import sys

import torch
import torch.distributed as dist

import mooncake  # noqa: F401  (registers the backend)
from mooncake.store import ErrorCode, Store

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = str(port)
dist.init_process_group("mooncake", init_method="env://", rank=rank, world_size=world)
master = sys.argv[4] if len(sys.argv) > 4 else ""
s = Store.from_group(segment_size=16 << 20, master_server_address=master)
key = f"rank{rank}"
val = bytes([rank + 1]) * (100000 + rank)
assert s.put(key, val) == 0
t = torch.full((64,), float(rank))
assert s.put_tensor(f"t{rank}", t) == 0
dist.barrier()
for r in range(world):
    got = s.get(f"rank{r}")
    assert got == bytes([r + 1]) * (100000 + r), (rank, r, len(got))
    assert torch.equal(s.get_tensor(f"t{r}"), torch.full((64,), float(r)))
assert s.get("nobody") == b""
assert s.is_exist(f"rank{(rank + 1) % world}") == 1
# A put session right away (rank 0's client shares the embedded master: no heartbeat yet).
if rank == 0:
    import ctypes
    src = (ctypes.c_ubyte * 8192).from_buffer_copy(bytes(range(256)) * 32)
    p = ctypes.addressof(src)
    assert s.register_buffer(p, 8192) == 0
    assert s.batch_put_session_start(["sess"], [8192]) == [0]
    assert s.batch_put_from_multi_buffer_ranges(["sess"], [[p + 4096]], [[4096]],
                                                [[4096]]) == [4096]
    assert s.batch_put_session_end(["sess"]) == [ErrorCode.INVALID_WRITE]  # half of it
    assert s.batch_put_from_multi_buffer_ranges(["sess"], [[p]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_end(["sess"]) == [0]
dist.barrier()
assert s.get("sess") == bytes(range(256)) * 32
dist.barrier()
s.close()
dist.destroy_process_group()
print("ok", rank, flush=True)
