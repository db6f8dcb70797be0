"""Re-initialisation in one process: init -> all_reduce -> destroy, three times, while the
old groups stay referenced (their communicators are still alive).
Usage: RANK PORT1,PORT2,PORT3 (one rendezvous port per round)."""
import faulthandler
import sys

import torch
import torch.distributed as dist

import mooncake  # noqa: F401

faulthandler.dump_traceback_later(60, exit=True)
rank, ports = int(sys.argv[1]), [int(p) for p in sys.argv[2].split(",")]
keep = []
for i, port in enumerate(ports):
    dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    keep.append(dist.group.WORLD)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == 2.0, t
    print(rank, "round", i, "ok", flush=True)
    dist.destroy_process_group()
