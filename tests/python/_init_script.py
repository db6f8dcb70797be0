"""One rank: initialises a group with the given backend string and init_method, checks an
all_reduce and prints "ok <get_backend()> <class of the cpu backend>".
Usage: RANK WORLD INIT_METHOD BACKEND (env:// reads MASTER_ADDR/MASTER_PORT)."""
import sys

import torch
import torch.distributed as dist

import mooncake  # noqa: F401  (registers the backend)

rank, world, init, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
t = torch.full((8,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 8, t
group = dist.group.WORLD
cpu = group._get_backend(torch.device("cpu")) if hasattr(group, "_get_backend") else group
print("ok", dist.get_backend(), type(cpu).__name__, flush=True)
dist.destroy_process_group()
