"""Re-initialisation in one process: init -> all_reduce -> destroy, three times, while the
old groups stay referenced (their communicators are still alive). Usage: RANK BASE_PORT."""
import faulthandler
import sys

import torch
import torch.distributed as dist

import mooncake  # noqa: F401

faulthandler.dump_traceback_later(60, exit=True)
rank, base = int(sys.argv[1]), int(sys.argv[2])
keep = []
for i in range(3):
    dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{base + i}", rank=rank,
                            world_size=2)
    keep.append(dist.group.WORLD)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == 2.0, t
    print(rank, "round", i, "ok", flush=True)
    dist.destroy_process_group()
