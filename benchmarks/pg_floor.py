#!/usr/bin/env python3
"""Where a small collective's microseconds go through torch: the cost of each layer of one
4 KiB op on a 1-rank group (no communication), p50 over many calls.

    /usr/bin/python3 benchmarks/pg_floor.py [--backend mooncake] [--bytes 4096]

Rows: an empty Python call and a pybind call into the backend (pg.size()), a plain torch
op on the same tensor, the backend's own entry point called directly (ProcessGroup.allreduce
/ alltoall_base / _allgather_base + Work.wait: binding, argument checks, Work, the queue and
the op), and the torch.distributed functions a user calls (those plus torch's Python
wrapper). The difference between the last two is torch's, the rest is the backend's floor
that an MPI call through mpi4py does not pay (benchmarks/pg_bench.py --world-sizes 1 runs
the MPI side).
"""

import argparse
import os
import socket
import time


def p50(fn, n):
    for _ in range(min(n // 10, 1000)):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[n // 2] * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mooncake")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    if args.backend == "mooncake":
        import mooncake  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=0, world_size=1)
    pg = dist.distributed_c10d._get_default_group()
    x, o = torch.zeros(args.bytes // 4), torch.empty(args.bytes // 4)
    ar, a2a = dist.AllreduceOptions(), dist.AllToAllOptions()
    rows = [
        ("empty Python call", lambda: None),
        ("pybind call into the group (pg.size())", lambda: pg.size()),
        ("torch op on the tensor (x.add_(0))", lambda: x.add_(0)),
        ("torch copy of the tensor (o.copy_(x))", lambda: o.copy_(x)),
        ("pg.allreduce([x]).wait()", lambda: pg.allreduce([x], ar).wait()),
        ("dist.all_reduce(x)", lambda: dist.all_reduce(x)),
        ("pg._allgather_base(o, x).wait()", lambda: pg._allgather_base(o, x).wait()),
        ("dist.all_gather_into_tensor(o, x)", lambda: dist.all_gather_into_tensor(o, x)),
        ("pg.alltoall_base(o, x, [], []).wait()", lambda: pg.alltoall_base(o, x, [], [], a2a).wait()),
        ("dist.all_to_all_single(o, x)", lambda: dist.all_to_all_single(o, x)),
        ("dist.broadcast(x, 0)", lambda: dist.broadcast(x, 0)),
    ]
    print(f"# {args.backend}, 1 rank, {args.bytes} bytes, torch {torch.__version__}: p50 of "
          f"{args.calls} calls")
    for name, fn in rows:
        try:
            print(f"{name:42s} {p50(fn, args.calls):7.2f} us")
        except (RuntimeError, AttributeError) as e:  # an entry point this torch/backend lacks
            print(f"{name:42s}     n/a ({type(e).__name__})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
