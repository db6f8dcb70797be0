#!/usr/bin/env python3
"""MPI reference for benchmarks/pg_bench.py: the same ops with mpi4py on numpy float32.

Run by pg_bench.py as
    mpirun --allow-run-as-root --oversubscribe -n W /usr/bin/python3 pg_bench_mpi.py --config JSON
Rank 0 prints one line "PGBENCH_RESULTS <json list>" with the records (see pg_bench.py).
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI


def expected_and_run(comm, op, nbytes):
    """Returns (run(), count_wrong()) for op over a buffer of nbytes (nccl-tests sizing)."""
    W, r = comm.size, comm.rank
    n = nbytes // 4
    blk = n // W
    if op == "all_reduce":
        x = np.zeros(n, np.float32)

        def run():
            comm.Allreduce(MPI.IN_PLACE, x)

        def wrong():
            x[:] = r + 1
            run()
            return int(np.count_nonzero(x != W * (W + 1) / 2))
    elif op == "all_gather":
        send = np.zeros(blk, np.float32)
        out = np.empty(blk * W, np.float32)

        def run():
            comm.Allgather(send, out)

        def wrong():
            send[:] = r + 1
            run()
            return int(np.count_nonzero(out != np.repeat(np.arange(1, W + 1, dtype=np.float32), blk)))
    elif op == "reduce_scatter":
        send = np.zeros(blk * W, np.float32)
        out = np.empty(blk, np.float32)

        def run():
            comm.Reduce_scatter_block(send, out)

        def wrong():
            send[:] = np.repeat((r + 1) * np.arange(1, W + 1, dtype=np.float32), blk)
            run()
            return int(np.count_nonzero(out != (r + 1) * W * (W + 1) / 2))
    elif op == "all_to_all":
        send = np.zeros(blk * W, np.float32)
        out = np.empty(blk * W, np.float32)

        def run():
            comm.Alltoall(send, out)

        def wrong():
            send[:] = np.repeat(r * W + np.arange(W, dtype=np.float32), blk)
            run()
            return int(np.count_nonzero(out != np.repeat(np.arange(W, dtype=np.float32) * W + r, blk)))
    elif op == "broadcast":
        x = np.zeros(n, np.float32)

        def run():
            comm.Bcast(x, root=0)

        def wrong():
            x[:] = 42.0 if r == 0 else -1.0
            run()
            return int(np.count_nonzero(x != 42.0))
    elif op == "sendrecv":  # a ring: nbytes to the next rank, nbytes from the previous one
        send = np.zeros(n, np.float32)
        out = np.empty(n, np.float32)

        def run():
            comm.Sendrecv(send, dest=(r + 1) % W, recvbuf=out, source=(r - 1) % W)

        def wrong():
            send[:] = r + 1
            run()
            return int(np.count_nonzero(out != (r - 1) % W + 1))
    else:
        raise ValueError(op)
    return run, wrong


def measure(comm, run, iters, warmup, max_seconds):
    """(mean seconds per op, per-iteration max over ranks, iterations)."""
    for _ in range(warmup):
        run()
    comm.Barrier()
    t0 = time.perf_counter()
    run()
    one = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    iters = max(3, min(iters, int(max_seconds / max(one, 1e-6))))
    samples = np.empty(iters, np.float64)
    comm.Barrier()
    start = time.perf_counter()
    for i in range(iters):
        t = time.perf_counter()
        run()
        samples[i] = time.perf_counter() - t
    total = comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)
    worst = np.empty_like(samples)
    comm.Allreduce(samples, worst, op=MPI.MAX)
    return total, worst.tolist(), iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(ap.parse_args().config)
    comm = MPI.COMM_WORLD
    records = []
    for op in cfg["ops"]:
        for nbytes in cfg["sizes"]:
            run, wrong = expected_and_run(comm, op, nbytes)
            t, samples, iters = measure(comm, run, cfg["iters"], cfg["warmup"], cfg["max_seconds"])
            bad = comm.allreduce(wrong(), op=MPI.SUM)
            xs = sorted(samples)
            p50 = xs[len(xs) // 2] * 1e6
            records.append({"backend": "mpi", "device": "cpu", "op": op, "world_size": comm.size,
                            "bytes": nbytes, "wrong": bad, "iters": iters,
                            "time_us": p50 if cfg.get("stat", "p50") == "p50" else t * 1e6,
                            "mean_us": t * 1e6, "p50_us": p50,
                            "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6})
    if comm.rank == 0:
        print("PGBENCH_RESULTS " + json.dumps(records), flush=True)


if __name__ == "__main__":
    main()
