#!/usr/bin/env python3
"""Demo of the torch.distributed backend "mooncake" under torchrun.

    /usr/bin/python3 -m mooncake.run --nproc_per_node 2 scripts/demo_torch.py [--quick]

Each rank initialises the default group with backend "mooncake" (env:// from torchrun) and
a gloo group over the same ranks, runs every collective on both, checks that the results
agree, and rank 0 prints a side-by-side timing table. Then, on the same group and engine
(scripts/demo_serving.py): KV-cache offload through mooncake.store (a request's prefix KV
blocks offloaded by one rank, reloaded by the other for a request with the same system
prompt: TTFT with and without the cache, logits compared) and one mooncake.ep
dispatch/combine round. Exit status 0 only when every result matches.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mooncake  # registers the backend

import demo_serving  # scripts/ is sys.path[0]


def gen(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 2 - 1).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def collectives(rank, world):
    """name -> fn(group) returning the tensors to compare (same inputs for both groups)."""
    n = 1000

    def all_reduce(g):
        t = gen(n, rank)
        dist.all_reduce(t, group=g)
        return [t]

    def all_reduce_max(g):
        t = gen(n, rank, torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return [t]

    def broadcast(g):
        t = gen(n, rank)
        dist.broadcast(t, src=world - 1, group=g)
        return [t]

    def reduce(g):
        t = gen(n, rank)
        dist.reduce(t, dst=0, group=g)
        return [t] if rank == 0 else []

    def all_gather(g):
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, gen(n, rank), group=g)
        return outs

    def all_gather_into_tensor(g):
        if g is None:
            out = torch.empty(world * n)
            dist.all_gather_into_tensor(out, gen(n, rank))
            return [out]
        outs = [torch.empty(n) for _ in range(world)]  # gloo 1.13: list form only
        dist.all_gather(outs, gen(n, rank), group=g)
        return [torch.cat(outs)]

    def reduce_scatter(g):
        blocks = [gen(n, rank * 100 + i) for i in range(world)]
        if g is None:
            out = torch.empty(n)
            dist.reduce_scatter_tensor(out, torch.cat(blocks))
            return [out]
        full = torch.cat(blocks)  # gloo 1.13 has no reduce_scatter: all_reduce + slice
        dist.all_reduce(full, group=g)
        return [full[rank * n:(rank + 1) * n].clone()]

    def all_to_all_single(g):
        splits_in = [(rank + d) % 3 + 1 for d in range(world)]
        splits_out = [(s + rank) % 3 + 1 for s in range(world)]
        out = torch.empty(sum(splits_out))
        dist.all_to_all_single(out, gen(sum(splits_in), rank), splits_out, splits_in, group=g)
        return [out]

    def gather(g):
        outs = [torch.empty(n) for _ in range(world)] if rank == 0 else None
        dist.gather(gen(n, rank), outs, dst=0, group=g)
        return outs or []

    def scatter(g):
        out = torch.empty(n)
        dist.scatter(out, [gen(n, 50 + i) for i in range(world)] if rank == 0 else None, src=0,
                     group=g)
        return [out]

    def send_recv(g):
        out = torch.empty(n)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        r = dist.irecv(out, prv, group=g)
        s = dist.isend(gen(n, rank), nxt, group=g)
        s.wait()
        r.wait()
        return [out]

    return {f.__name__: f for f in (all_reduce, all_reduce_max, broadcast, reduce, all_gather,
                                    all_gather_into_tensor, reduce_scatter, all_to_all_single,
                                    gather, scatter, send_recv)}


def timed(fn, iters):
    for _ in range(max(2, iters // 5)):
        fn()
    dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def timing_rows(rank, world, gloo, sizes, iters):
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.zeros(n)  # zeros: repeated sums stay finite
        outs = [torch.empty(n) for _ in range(world)]
        a2a_in, a2a_out = torch.ones(n * world), torch.empty(n * world)
        ops = {
            "all_reduce": lambda g: dist.all_reduce(x, group=g),
            "all_gather": lambda g: dist.all_gather(outs, x, group=g),
            "all_to_all_single": lambda g: dist.all_to_all_single(a2a_out, a2a_in, group=g),
            "broadcast": lambda g: dist.broadcast(x, src=0, group=g),
        }
        for name, op in ops.items():
            mc = timed(lambda: op(None), iters)
            gl = timed(lambda: op(gloo), iters)
            rows.append((name, nbytes, mc, gl))
    return rows


def fmt_bytes(b):
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k}{unit}"
    return str(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small timing sizes, few iterations")
    ap.add_argument("--no-serving", action="store_true",
                    help="skip the KV-offload and expert-parallel parts")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("mooncake")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")

    bad = []
    for name, fn in collectives(rank, world).items():
        mine, ref = fn(None), fn(gloo)
        if len(mine) != len(ref) or any(
                not torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(mine, ref)):
            bad.append(name)
    failures = torch.tensor([len(bad)])
    dist.all_reduce(failures, group=gloo)

    sizes = [4 << 10, 1 << 20] if args.quick else [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    rows = timing_rows(rank, world, gloo, sizes, 10 if args.quick else 30)
    if rank == 0:
        print(f"mooncake vs gloo, {world} ranks (torch {torch.__version__}), "
              f"median time per op in us:")
        print(f"{'op':<20}{'size':>8}{'mooncake':>12}{'gloo':>12}{'speed-up':>10}")
        for name, nbytes, mc, gl in rows:
            print(f"{name:<20}{fmt_bytes(nbytes):>8}{mc:>12.1f}{gl:>12.1f}{gl / mc:>9.1f}x")
        if bad:
            print(f"MISMATCH on rank 0: {bad}")
        if int(failures) == 0:
            print(f"all results match gloo ({len(collectives(rank, world))} collectives checked)")
        else:
            print(f"{int(failures)} mismatches against gloo")
    ok = int(failures) == 0
    if not args.no_serving:
        for title, part in (
                ("KV-cache offload through mooncake.store, on the group's engine",
                 demo_serving.kv_offload),
                ("MoE dispatch/combine through mooncake.ep (low-latency mode), on the same group",
                 demo_serving.ep_round)):
            if rank == 0:
                print(f"\n== {title} ==", flush=True)
            part_ok, lines = part(rank, world, gloo)
            ok = ok and part_ok
            if rank == 0:
                print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # The gloo group goes with the GIL released: torch 2.6 can deadlock destroying a gloo
    # group from Python (mooncake._compat.release_group).
    box = [gloo]
    del gloo
    mooncake._compat.release_group(box)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
