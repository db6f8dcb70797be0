"""Worker cases: stream-ordered send/recv of GPU tensors on one host (pg/stream_p2p.h), over the
engine's device layer simulation (pg_cases_gpu.py says how GPU tensors are made here). Each
result is compared with the same messages sent between host tensors through the host-driven
path, byte for byte."""

import time

import torch
import torch.distributed as dist

from pg_cases import make
from pg_cases_gpu import _backend, _check_count, _raised, _same, to_gpu


def _exchange(fails, desc, pairs, gpu):
    """pairs: [(peer, tensor to send, tensor to receive into)] issued as isend then irecv for
    each pair in turn, all waited for at the end (in reverse order)."""
    works = []
    for peer, out, into in pairs:
        works.append(dist.isend(out, peer))
        works.append(dist.irecv(into, peer))
    for wk in reversed(works):
        wk.wait()


def case_gpu_stream_p2p(ctx, expect_stream, sizes=(1, 1000, 2**18 + 3)):
    """A ring (isend to the next rank, irecv from the previous one), every rank exchanging with
    every other at once (messages of many slots both ways between each pair: a send does not
    wait for the recv of the other direction), a burst of 40 messages of assorted sizes (empty
    ones among them) from rank 0 to rank 1, more than the sender's ring of notes holds, received
    after all were sent; each against the same messages between host tensors. On one host every
    send and recv is stream-ordered (the backend's count grows by one a call)."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    calls = 0
    nxt, prv = (r + 1) % w, (r - 1) % w
    for n in sizes:
        for dt in ("float32", "bfloat16"):
            d = f"{dt} n={n}"
            x = make(dt, n, r, salt=21)
            g = to_gpu(torch.zeros_like(x))
            h = torch.zeros_like(x)
            reqs = [dist.isend(to_gpu(x), nxt), dist.irecv(g, prv)]
            calls += 2
            for q in reqs:
                q.wait()
            reqs = [dist.isend(x.clone(), nxt), dist.irecv(h, prv)]
            for q in reqs:
                q.wait()
            _same(fails, "ring " + d, g, h)
        # Everyone with everyone, both ways at once.
        outs = {k: make("float32", n, 100 * r + k, salt=22) for k in range(w) if k != r}
        gins = {k: to_gpu(torch.zeros(n)) for k in outs}
        hins = {k: torch.zeros(n) for k in outs}
        _exchange(fails, "all pairs", [(k, to_gpu(outs[k]), gins[k]) for k in outs], True)
        calls += 2 * len(outs)
        _exchange(fails, "all pairs", [(k, outs[k].clone(), hins[k]) for k in outs], False)
        for k in outs:
            _same(fails, f"all pairs from {k} n={n}", gins[k], hins[k])
    # 20 isends each way between ranks 0 and 1 before either issues a recv: the sends past the
    # ring of notes wait (pending) for the other's recvs without holding the issuing thread.
    if r in (0, 1):
        k = 1 - r
        outs = [make("float32", 300 + i, 10 * r + i, salt=25) for i in range(20)]
        works = [dist.isend(to_gpu(x), k, tag=2) for x in outs]
        gins = [to_gpu(torch.zeros(300 + i)) for i in range(20)]
        works += [dist.irecv(g, k, tag=2) for g in gins]
        calls += 40
        for wk in works:
            wk.wait()
        for i, g in enumerate(gins):
            _same(fails, f"exchange message {i}", g, make("float32", 300 + i, 10 * k + i, salt=25))
    burst = [0, 1, 5000, 0, 2**16 + 1, 3] * 6 + [4097, 8192, 1, 0]  # 40 messages
    if r in (0, 1):
        if r == 0:
            xs = [make("float32", m, i, salt=23) for i, m in enumerate(burst)]
            works = [dist.isend(to_gpu(x), 1, tag=5) for x in xs]
            calls += len(xs)
            for wk in works:
                wk.wait()
            for x in xs:
                dist.send(x.clone(), 1, tag=6)
        else:
            time.sleep(0.2)  # rank 0 runs ahead: its 17th send waits for this rank's checks
            gs = [to_gpu(torch.zeros(m)) for m in burst]
            works = [dist.irecv(g, 0, tag=5) for g in gs]
            calls += len(gs)
            for wk in reversed(works):
                wk.wait()
            for i, g in enumerate(gs):
                h = torch.zeros(burst[i])
                dist.recv(h, 0, tag=6)
                _same(fails, f"burst message {i} ({burst[i]} floats)", g, h)
    dist.barrier()
    _check_count(fails, be, before, calls, expect_stream)
    return fails


def case_gpu_stream_p2p_late_peer(ctx):
    """Rank 0's first send of GPU memory goes to rank 1 before rank 1 made any (its buffers are
    not there yet), then rank 0 enters a barrier that rank 1 reaches before its recv: the send
    must not hold rank 0's thread until rank 1 sets up (that would deadlock them)."""
    fails = []
    x = make("float32", 3000, 7, salt=24)
    if ctx.rank == 0:
        wk = dist.isend(to_gpu(x), 1)
        dist.barrier()
        wk.wait()
    elif ctx.rank == 1:
        dist.barrier()
        g = to_gpu(torch.zeros(3000))
        dist.recv(g, 0)
        _same(fails, "late peer's message", g, x)
    else:
        dist.barrier()
    dist.barrier()
    return fails


def case_gpu_stream_p2p_mismatch(ctx, what):
    """Rank 0 sends 1000 floats with tag 3 to rank 1, which receives (what == "size") 1001 of
    them or (what == "tag") 1000 with tag 4: rank 1's recv raises naming both; every rank's next
    op raises (the group failed: a size mismatch puts the two streams out of step)."""
    n, tag = (1001, 3) if what == "size" else (1000, 4)
    if ctx.rank == 0:
        res = _raised(lambda: dist.send(to_gpu(torch.ones(1000)), 1, tag=3))
    elif ctx.rank == 1:
        res = _raised(lambda: dist.recv(to_gpu(torch.zeros(n)), 0, tag=tag))
    else:
        res = {"raised": False}
    time.sleep(0.5)
    res["later"] = _raised(lambda: dist.all_reduce(to_gpu(torch.ones(4))))
    return res


def case_gpu_stream_p2p_die(ctx, victim, at):
    """A message each way between rank 0 and `victim` (the path is set up), then `victim` exits
    at wall-clock time `at` while rank 0 waits on a recv from it: rank 0 raises, naming it."""
    peer = victim if ctx.rank == 0 else 0
    g = to_gpu(torch.zeros(64))
    if ctx.rank in (0, victim):
        _exchange([], "setup", [(peer, to_gpu(torch.ones(64)), g)], True)
    if ctx.rank == victim:
        time.sleep(max(0.0, at - time.time()))
        import os
        os._exit(17)
    if ctx.rank != 0:
        time.sleep(max(0.0, at + 1.0 - time.time()))
        return {"bystander": True}
    t0 = time.time()
    res = _raised(lambda: dist.recv(g, victim))
    res["since_death"] = time.time() - max(at, t0)
    res["later"] = _raised(lambda: dist.send(g, victim))
    return res
