"""Process-group cases on tensors in GPU memory, run by test_pg_gpu_sim.py's pools (every rank
with MC_DEVICE=sim: the engine's device layer simulates GPU memory in host memory that faults
when host code touches it, and torch here has no CUDA). A "GPU tensor" is a CPU tensor whose
storage is that memory (mooncake._C._device_empty_like); it is filled and read only through the
layer's copies. Every op runs twice on the same mooncake group, once on GPU tensors and once on
the same values in host tensors, and the two results must be the same bytes; the host path is
the one the rest of the suite checks against gloo and local references (and the reductions
here against a local reference too). A rank whose backend memcpy'd GPU memory would die.
"""

import inspect
import os
import time

import torch
import torch.distributed as dist

from pg_cases import OPS, TOL, as_bytes, make, reference

from mooncake import _C


def to_gpu(t):
    d = _C._device_empty_like(t)
    if t.numel():
        _C._device_copy(d.data_ptr(), t.contiguous().data_ptr(), t.numel() * t.element_size())
    return d


def to_host(d):
    t = torch.empty(d.shape, dtype=d.dtype)
    if t.numel():
        _C._device_copy(t.data_ptr(), d.data_ptr(), t.numel() * t.element_size())
    return t


def _same(fails, desc, gpu, host):
    g = to_host(gpu)
    if g.shape != host.shape or not torch.equal(as_bytes(g), as_bytes(host)):
        fails.append(f"{desc}: GPU result differs from the host path's")


def _close(fails, desc, got, exp, dt):
    rtol, atol = TOL.get(dt, (0, 0))
    if got.dtype.is_floating_point:
        ok = torch.allclose(got.double(), exp.double(), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(got, exp)
    if not ok:
        fails.append(f"{desc}: differs from the local reference")


def _device_coalescing():
    """torch >= 2.1: dist._coalescing_manager(group, device, async_ops) with its fast paths. (Its
    parameters through inspect: a contextmanager's own code object is the wrapper's, whose
    names are args and kwds.)"""
    cm_fn = getattr(dist, "_coalescing_manager", None)
    return cm_fn is not None and "device" in inspect.signature(cm_fn).parameters


def _compat_all_gather_tensor(out, inp):
    f = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
    return f(out, inp)


def _compat_reduce_scatter_tensor(out, inp, op):
    f = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
    return f(out, inp, op=op)


def case_gpu_reductions(ctx, sizes, dtypes, ops):
    """all_reduce, reduce, reduce_scatter (list and tensor) on GPU tensors."""
    fails = []
    w, r = ctx.world, ctx.rank
    for dt in dtypes:
        for op in ops:
            for n in sizes:
                d = f"{dt} {op} n={n}"
                ins = [make(dt, n, k, salt=1, op=op) for k in range(w)]
                g = to_gpu(ins[r])
                h = ins[r].clone()
                dist.all_reduce(g, op=OPS[op])
                dist.all_reduce(h, op=OPS[op])
                _same(fails, "all_reduce " + d, g, h)
                _close(fails, "all_reduce " + d, h, reference(ins, op, dt, w), dt)

                root = w - 1
                g = to_gpu(ins[r])
                h = ins[r].clone()
                dist.reduce(g, root, op=OPS[op])
                dist.reduce(h, root, op=OPS[op])
                if r == root:
                    _same(fails, "reduce " + d, g, h)

                big = [make(dt, n * w, k, salt=2, op=op) for k in range(w)]
                gout, hout = to_gpu(torch.zeros(n, dtype=ins[0].dtype)), torch.zeros(n, dtype=ins[0].dtype)
                _compat_reduce_scatter_tensor(gout, to_gpu(big[r]), OPS[op])
                _compat_reduce_scatter_tensor(hout, big[r].clone(), OPS[op])
                _same(fails, "reduce_scatter_tensor " + d, gout, hout)

                glist = [to_gpu(c) for c in big[r].chunk(w)] if n else [to_gpu(big[r][:0])] * w
                hlist = [c.clone() for c in big[r].chunk(w)] if n else [big[r][:0]] * w
                gout, hout = to_gpu(torch.zeros(n, dtype=ins[0].dtype)), torch.zeros(n, dtype=ins[0].dtype)
                dist.reduce_scatter(gout, glist, op=OPS[op])
                dist.reduce_scatter(hout, hlist, op=OPS[op])
                _same(fails, "reduce_scatter list " + d, gout, hout)
    return fails


def case_gpu_copies(ctx, sizes, dtypes):
    """broadcast, all_gather (list, tensor, coalesced), gather, scatter, all_to_all (single
    with uneven splits, list) and send/recv on GPU tensors, with GPU and host tensors mixed in
    one call too."""
    fails = []
    w, r = ctx.world, ctx.rank
    for dt in dtypes:
        for n in sizes:
            d = f"{dt} n={n}"
            x = make(dt, n, r, salt=3)

            g, h = to_gpu(x), x.clone()
            dist.broadcast(g, 0)
            dist.broadcast(h, 0)
            _same(fails, "broadcast " + d, g, h)

            gl = [to_gpu(torch.zeros_like(x)) for _ in range(w)]
            hl = [torch.zeros_like(x) for _ in range(w)]
            dist.all_gather(gl, to_gpu(x))
            dist.all_gather(hl, x.clone())
            for k in range(w):
                _same(fails, f"all_gather list [{k}] " + d, gl[k], hl[k])

            gt = to_gpu(torch.zeros(n * w, dtype=x.dtype))
            ht = torch.zeros(n * w, dtype=x.dtype)
            _compat_all_gather_tensor(gt, to_gpu(x))
            _compat_all_gather_tensor(ht, x.clone())
            _same(fails, "all_gather_into_tensor " + d, gt, ht)
            mixed = torch.zeros(n * w, dtype=x.dtype)  # host output, GPU input
            _compat_all_gather_tensor(mixed, to_gpu(x))
            if not torch.equal(as_bytes(mixed), as_bytes(ht)):
                fails.append("all_gather_into_tensor GPU input, host output " + d)

            gl2 = [[to_gpu(torch.zeros_like(x)), to_gpu(torch.zeros(3, dtype=x.dtype))]
                   for _ in range(w)]
            hl2 = [[torch.zeros_like(x), torch.zeros(3, dtype=x.dtype)] for _ in range(w)]
            y = make(dt, 3, r, salt=4)
            dist.all_gather_coalesced(gl2, [to_gpu(x), to_gpu(y)])
            dist.all_gather_coalesced(hl2, [x.clone(), y.clone()])
            for k in range(w):
                for j in range(2):
                    _same(fails, f"all_gather_coalesced [{k}][{j}] " + d, gl2[k][j], hl2[k][j])

            root = w - 1
            gl = [to_gpu(torch.zeros_like(x)) for _ in range(w)] if r == root else None
            hl = [torch.zeros_like(x) for _ in range(w)] if r == root else None
            dist.gather(to_gpu(x), gl, dst=root)
            dist.gather(x.clone(), hl, dst=root)
            if r == root:
                for k in range(w):
                    _same(fails, f"gather [{k}] " + d, gl[k], hl[k])

            src = [make(dt, n, k, salt=5) for k in range(w)]
            g, h = to_gpu(torch.zeros_like(x)), torch.zeros_like(x)
            dist.scatter(g, [to_gpu(s) for s in src] if r == 0 else None, src=0)
            dist.scatter(h, [s.clone() for s in src] if r == 0 else None, src=0)
            _same(fails, "scatter " + d, g, h)

            # all_to_all_single, uneven: rank k sends k + j + 1 rows (2 columns) to rank j.
            ins_rows = [r + j + 1 for j in range(w)]
            outs_rows = [k + r + 1 for k in range(w)]
            inp = make(dt, 2 * sum(ins_rows), r, salt=6).reshape(-1, 2)
            gout = to_gpu(torch.zeros(sum(outs_rows), 2, dtype=x.dtype))
            hout = torch.zeros(sum(outs_rows), 2, dtype=x.dtype)
            dist.all_to_all_single(gout, to_gpu(inp), outs_rows, ins_rows)
            dist.all_to_all_single(hout, inp.clone(), outs_rows, ins_rows)
            _same(fails, "all_to_all_single uneven " + d, gout, hout)

            ins = [make(dt, n + j, r, salt=7) for j in range(w)]
            gouts = [to_gpu(torch.zeros(n + r, dtype=x.dtype)) for _ in range(w)]
            houts = [torch.zeros(n + r, dtype=x.dtype) for _ in range(w)]
            dist.all_to_all(gouts, [to_gpu(t) for t in ins])
            dist.all_to_all(houts, [t.clone() for t in ins])
            for k in range(w):
                _same(fails, f"all_to_all list [{k}] " + d, gouts[k], houts[k])

            if w > 1:  # a ring: send to the next rank, receive from the previous one
                nxt, prv = (r + 1) % w, (r - 1) % w
                g = to_gpu(torch.zeros_like(x))
                reqs = [dist.isend(to_gpu(x), nxt, tag=9), dist.irecv(g, prv, tag=9)]
                for q in reqs:
                    q.wait()
                _same(fails, "send/recv ring " + d, g, make(dt, n, prv, salt=3))
    dist.barrier()
    return fails


def case_gpu_async(ctx, n=4096, ops=12):
    """Several async ops on GPU tensors in flight at once, waited in reverse order."""
    fails = []
    w, r = ctx.world, ctx.rank
    ins = [[make("float32", n, k, salt=100 + i) for k in range(w)] for i in range(ops)]
    gs = [to_gpu(ins[i][r]) for i in range(ops)]
    works = [dist.all_reduce(g, async_op=True) for g in gs]
    for wk in reversed(works):
        wk.wait()
    for i in range(ops):
        _close(fails, f"async all_reduce {i}", to_host(gs[i]), reference(ins[i], "SUM", "float32", w),
               "float32")
    return fails


def case_gpu_errors(ctx):
    """A non-contiguous tensor in GPU memory, and any op issued while its stream captures a
    CUDA graph, are refused on the caller's thread with a ValueError naming the rank and the
    op; the group goes on working."""
    fails = []
    g = to_gpu(torch.zeros(8, 8)).t()
    for name, call in (("allreduce", lambda: dist.all_reduce(g)),
                       ("broadcast", lambda: dist.broadcast(g, 0))):
        try:
            call()
            fails.append(f"{name} on a non-contiguous GPU tensor did not raise")
        except ValueError as e:
            msg = str(e)
            for want in (f"rank {ctx.rank}", name, "GPU memory", "contiguous"):
                if want not in msg:
                    fails.append(f"{name}: error {msg!r} does not name {want!r}")
    # Issued while the op's stream captures a CUDA graph (here the simulation's capture of its
    # copy stream, the stream a simulated GPU tensor's op is ordered on): refused on the
    # caller's thread before anything is queued, on every rank alike, the capture left valid.
    x = to_gpu(torch.ones(16))
    out = to_gpu(torch.zeros(16 * ctx.world))
    calls = [("allreduce", lambda: dist.all_reduce(x)),
             ("broadcast", lambda: dist.broadcast(x, 0)),
             ("_allgather_base", lambda: _compat_all_gather_tensor(out, x)),
             ("send" if ctx.rank == 0 else "recv",
              lambda: dist.send(x, 1) if ctx.rank == 0 else
              dist.recv(x, 0) if ctx.rank == 1 else None)]
    coalescing = _device_coalescing()

    def coalesced_gather(dst):  # the fast path: one allgather_into_tensor_coalesced at the exit
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.all_gather_into_tensor(dst, x)
        cm.wait()
    if coalescing:
        calls.append(("allgather_into_tensor_coalesced", lambda: coalesced_gather(out)))
    _C._device_capture_begin()
    try:
        for name, call in calls:
            if name == "recv" and ctx.rank != 1:
                continue
            try:
                call()
                fails.append(f"{name} inside a capture of its stream did not raise")
            except ValueError as e:
                msg = str(e)
                for want in (f"rank {ctx.rank}", f": {name}: ", "capturing a CUDA graph"):
                    if want not in msg:
                        fails.append(f"{name} inside a capture: error {msg!r} does not name "
                                     f"{want!r}")
    finally:
        try:
            _C._device_capture_end()
        except RuntimeError as e:
            fails.append(f"the refused ops invalidated the capture: {e}")
    h = to_gpu(torch.ones(16))
    dist.all_reduce(h)
    if not torch.equal(to_host(h), torch.full((16,), float(ctx.world))):
        fails.append("all_reduce after the refused calls is wrong")
    _compat_all_gather_tensor(out, x)
    if not torch.equal(to_host(out), torch.ones(16 * ctx.world)):
        fails.append("all_gather_into_tensor after the refused calls is wrong (or the refused "
                     "ones changed their tensors)")
    if ctx.rank < 2:  # send/recv in step too
        y = to_gpu(torch.full((16,), 3.0) if ctx.rank == 0 else torch.zeros(16))
        if ctx.rank == 0:
            dist.send(y, 1)
        else:
            dist.recv(y, 0)
        if ctx.rank == 1 and not torch.equal(to_host(y), torch.full((16,), 3.0)):
            fails.append("send/recv after the refused calls is wrong")
    if coalescing:  # the refused coalescing block never ended; the next one works
        z = to_gpu(torch.zeros(16 * ctx.world))
        coalesced_gather(z)
        if not torch.equal(to_host(z), torch.ones(16 * ctx.world)):
            fails.append("a coalescing block after the refused one is wrong")
    return fails


def _coalesced_twice(fails, name, op, outs, ins):
    """op(out, in) for each pair inside one coalescing manager, on GPU tensors and again on host
    tensors; the outputs must be the same bytes."""
    got = {}
    for where, move in (("gpu", to_gpu), ("host", torch.clone)):
        placed = [move(o) for o in outs]
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            for o, x in zip(placed, ins):
                op(o, move(x))
        cm.wait()
        got[where] = placed
    for k, (g, h) in enumerate(zip(got["gpu"], got["host"])):
        _same(fails, f"coalesced {name} #{k}", g, h)


def case_gpu_coalesced(ctx):
    """torch >= 2.1: dist._coalescing_manager's fast paths (allgather_into_tensor_coalesced,
    reduce_scatter_tensor_coalesced) and all_reduce_coalesced on GPU tensors."""
    fails = []
    w, r = ctx.world, ctx.rank
    sizes = (1, 0, 1000)
    ins = [make("int64", n, r, salt=400 + k) for k, n in enumerate(sizes)]
    ys = [make("float32", n, r, salt=410 + k) for k, n in enumerate(sizes)]
    g, h = [to_gpu(y) for y in ys], [y.clone() for y in ys]
    dist.all_reduce_coalesced(g)
    dist.all_reduce_coalesced(h)
    for k in range(len(sizes)):
        _same(fails, f"all_reduce_coalesced #{k}", g[k], h[k])
    if not _device_coalescing():
        return fails  # torch 1.13: no coalescing manager with these fast paths
    outs = [torch.zeros(w * n, dtype=torch.int64) for n in sizes]
    _coalesced_twice(fails, "all_gather_into_tensor", dist.all_gather_into_tensor, outs, ins)
    big = [make("float64", w * n, r, salt=420 + k) for k, n in enumerate(sizes)]
    outs = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    _coalesced_twice(fails, "reduce_scatter_tensor", dist.reduce_scatter_tensor, outs, big)
    return fails


# ---- stream-ordered allreduce (pg/stream_ops.h) ---------------------------------------------

def _backend():
    g = dist.distributed_c10d._get_default_group()
    return g._get_backend(torch.device("cpu")) if hasattr(g, "_get_backend") else g


def case_gpu_stream_ops(ctx, expect_stream, sizes=(1, 1000, 2**18 + 3), async_ops=40):
    """all_reduce on GPU tensors: on one host it is queued on the stream (the backend's count of
    stream-ordered ops grows by one a call), elsewhere, or with MC_PG_STREAM_OPS=0, it is not;
    either way the result is the host path's bytes and the local reference's values, for ops of
    many steps (the pool may set a small MC_PG_STREAM_OPS_CHUNK_BYTES) and with more ops in flight
    than the signature ring holds at once (waited in reverse order)."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    calls = 0
    for dt, op in (("float32", "SUM"), ("bfloat16", "SUM"), ("int64", "MAX"), ("float32", "AVG")):
        for n in sizes:
            ins = [make(dt, n, k, salt=11) for k in range(w)]
            g, h = to_gpu(ins[r]), ins[r].clone()
            dist.all_reduce(g, op=OPS[op])
            dist.all_reduce(h, op=OPS[op])
            calls += 1
            desc = f"stream all_reduce {dt} {op} x {n}"
            _same(fails, desc, g, h)
            _close(fails, desc, h, reference(ins, op, dt, w), dt)
    ins = [[make("float32", 3000, k, salt=200 + i) for k in range(w)] for i in range(async_ops)]
    gs = [to_gpu(ins[i][r]) for i in range(async_ops)]
    works = [dist.all_reduce(g, async_op=True) for g in gs]
    calls += async_ops
    for wk in reversed(works):
        wk.wait()
    for i in range(async_ops):
        _close(fails, f"async stream all_reduce {i}", to_host(gs[i]),
               reference(ins[i], "SUM", "float32", w), "float32")
    _check_count(fails, be, before, calls, expect_stream)
    return fails


def _check_count(fails, be, before, calls, expect_stream):
    """The backend's count of stream-ordered ops grew by `calls` since `before` (by none when
    the ops are not expected on the stream)."""
    got = be._stream_ops() - before
    want = calls if expect_stream else 0
    if got != want:
        fails.append(f"{got} stream-ordered ops for {calls} calls (expected {want})")


def _raised(call):
    t0 = time.time()
    try:
        call()
    except RuntimeError as e:
        return {"raised": True, "msg": str(e), "type": type(e).__name__,
                "elapsed": time.time() - t0}
    return {"raised": False, "elapsed": time.time() - t0}


def case_gpu_stream_mismatch(ctx):
    """Rank r calls all_reduce on 1000 + r elements of GPU memory: every rank raises, naming
    the calls; a later op raises too (the group failed)."""
    g = to_gpu(torch.ones(1000 + ctx.rank))
    res = _raised(lambda: dist.all_reduce(g))
    res["later"] = _raised(lambda: dist.all_reduce(to_gpu(torch.ones(4))))
    return res


def case_gpu_stream_die(ctx, victim, at):
    """One all_reduce on GPU memory (the path is set up), then `victim` exits at wall-clock
    time `at`; the others call all_reduce on GPU memory after it and report how they failed."""
    g = to_gpu(torch.ones(64))
    dist.all_reduce(g)
    if ctx.rank == victim:
        time.sleep(max(0.0, at - time.time()))
        os._exit(17)
    time.sleep(max(0.0, at + 0.3 - time.time()))
    res = _raised(lambda: dist.all_reduce(g))
    res["later"] = _raised(lambda: dist.all_reduce(g))
    return res


def case_gpu_stream_absent(ctx, absent):
    """Rank `absent` never calls all_reduce on GPU memory: the others' first one (which sets
    the path up on every rank) fails by the group timeout, naming it."""
    if ctx.rank == absent:
        return {"absent": True}
    return _raised(lambda: dist.all_reduce(to_gpu(torch.ones(10))))


def case_gpu_stream_copies(ctx, expect_stream, sizes=(1, 1000, 2**18 + 3)):
    """broadcast, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single without
    splits on GPU tensors: stream-ordered on one host (the backend's count of stream-ordered ops
    grows by one a call), not elsewhere; the host path's bytes and the expected values."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    calls = 0
    for n in sizes:
        root = w - 1
        x = make("float32", n, r, salt=21)
        g, h = to_gpu(x), x.clone()
        dist.broadcast(g, root)
        dist.broadcast(h, root)
        calls += 1
        _same(fails, f"stream broadcast x {n}", g, h)
        if not torch.equal(h, make("float32", n, root, salt=21)):
            fails.append(f"stream broadcast x {n}: not the root's values")

        x = make("bfloat16", n, r, salt=22)
        og, oh = to_gpu(torch.zeros(w * n, dtype=x.dtype)), torch.zeros(w * n, dtype=x.dtype)
        _compat_all_gather_tensor(og, to_gpu(x))
        _compat_all_gather_tensor(oh, x)
        calls += 1
        _same(fails, f"stream all_gather x {n}", og, oh)
        if not torch.equal(oh, torch.cat([make("bfloat16", n, k, salt=22) for k in range(w)])):
            fails.append(f"stream all_gather x {n}: not every rank's block")

        ins = [make("float32", w * n, k, salt=23) for k in range(w)]
        og, oh = to_gpu(torch.zeros(n)), torch.zeros(n)
        _compat_reduce_scatter_tensor(og, to_gpu(ins[r]), OPS["SUM"])
        _compat_reduce_scatter_tensor(oh, ins[r], OPS["SUM"])
        calls += 1
        _same(fails, f"stream reduce_scatter x {n}", og, oh)
        _close(fails, f"stream reduce_scatter x {n}", oh,
               reference(ins, "SUM", "float32", w)[r * n:(r + 1) * n], "float32")

        ins = [make("int32", w * n, k, salt=24) for k in range(w)]
        og, oh = to_gpu(torch.zeros(w * n, dtype=torch.int32)), torch.zeros(w * n, dtype=torch.int32)
        dist.all_to_all_single(og, to_gpu(ins[r]))
        dist.all_to_all_single(oh, ins[r])
        calls += 1
        _same(fails, f"stream all_to_all x {n}", og, oh)
        if not torch.equal(oh, torch.cat([ins[k][r * n:(r + 1) * n] for k in range(w)])):
            fails.append(f"stream all_to_all x {n}: not every rank's block for this rank")
    _check_count(fails, be, before, calls, expect_stream)
    return fails


def case_gpu_stream_lists(ctx, expect_stream, sizes=(1, 1000, 2**18 + 3)):
    """reduce, gather, scatter, the list forms of all_gather and reduce_scatter, and the
    coalesced ops on GPU tensors: stream-ordered on one host (one stream-ordered op a call, one
    a tensor in a coalesced call), not elsewhere; the host path's bytes and the expected
    values (roots vary with the size)."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    calls = 0
    for n in sizes:
        root = n % w
        ins = [make("float32", n, k, salt=31) for k in range(w)]
        g, h = to_gpu(ins[r]), ins[r].clone()
        dist.reduce(g, root)
        dist.reduce(h, root)
        calls += 1
        if r == root:
            _same(fails, f"stream reduce x {n}", g, h)
            _close(fails, f"stream reduce x {n}", h, reference(ins, "SUM", "float32", w), "float32")

        x = make("int32", n, r, salt=32)
        lg = [to_gpu(torch.zeros(n, dtype=torch.int32)) for _ in range(w)] if r == root else None
        lh = [torch.zeros(n, dtype=torch.int32) for _ in range(w)] if r == root else None
        dist.gather(to_gpu(x), lg, dst=root)
        dist.gather(x, lh, dst=root)
        calls += 1
        if r == root:
            for k in range(w):
                _same(fails, f"stream gather x {n} block {k}", lg[k], lh[k])
                if not torch.equal(lh[k], make("int32", n, k, salt=32)):
                    fails.append(f"stream gather x {n}: block {k} is not rank {k}'s input")

        blocks = [make("bfloat16", n, k, salt=33) for k in range(w)]
        og, oh = to_gpu(torch.zeros(n, dtype=torch.bfloat16)), torch.zeros(n, dtype=torch.bfloat16)
        dist.scatter(og, [to_gpu(b) for b in blocks] if r == root else None, src=root)
        dist.scatter(oh, blocks if r == root else None, src=root)
        calls += 1
        _same(fails, f"stream scatter x {n}", og, oh)
        if not torch.equal(oh, blocks[r]):
            fails.append(f"stream scatter x {n}: not the root's block for this rank")

        x = make("float16", n, r, salt=34)
        lg = [to_gpu(torch.zeros(n, dtype=torch.float16)) for _ in range(w)]
        lh = [torch.zeros(n, dtype=torch.float16) for _ in range(w)]
        dist.all_gather(lg, to_gpu(x))
        dist.all_gather(lh, x)
        calls += 1
        for k in range(w):
            _same(fails, f"stream all_gather (list) x {n} block {k}", lg[k], lh[k])
            if not torch.equal(lh[k], make("float16", n, k, salt=34)):
                fails.append(f"stream all_gather (list) x {n}: block {k} is not rank {k}'s input")

        mine = [make("float32", n, r, salt=40 + k) for k in range(w)]
        og, oh = to_gpu(torch.zeros(n)), torch.zeros(n)
        dist.reduce_scatter(og, [to_gpu(t) for t in mine], op=OPS["MAX"])
        dist.reduce_scatter(oh, mine, op=OPS["MAX"])
        calls += 1
        _same(fails, f"stream reduce_scatter (list) x {n}", og, oh)
        want = reference([make("float32", n, k, salt=40 + r) for k in range(w)], "MAX",
                         "float32", w)
        if not torch.equal(oh, want):
            fails.append(f"stream reduce_scatter (list) x {n}: not the maximum over the ranks")

    ys = [make("float32", n, r, salt=50 + k) for k, n in enumerate(sizes)]
    g, h = [to_gpu(y) for y in ys], [y.clone() for y in ys]
    dist.all_reduce_coalesced(g)
    dist.all_reduce_coalesced(h)
    calls += len(sizes)
    for k in range(len(sizes)):
        _same(fails, f"stream all_reduce_coalesced #{k}", g[k], h[k])
    if _device_coalescing():
        ins = [make("int64", n, r, salt=60 + k) for k, n in enumerate(sizes)]
        outs = [torch.zeros(w * n, dtype=torch.int64) for n in sizes]
        _coalesced_twice(fails, "all_gather_into_tensor", dist.all_gather_into_tensor, outs, ins)
        big = [make("float64", w * n, r, salt=70 + k) for k, n in enumerate(sizes)]
        outs = [torch.zeros(n, dtype=torch.float64) for n in sizes]
        _coalesced_twice(fails, "reduce_scatter_tensor", dist.reduce_scatter_tensor, outs, big)
        calls += 2 * len(sizes)
    _check_count(fails, be, before, calls, expect_stream)
    return fails


def case_gpu_stream_root_host(ctx):
    """The path set up, rank 0 gathers GPU inputs into host tensors (its inputs decide the
    path for every rank, so the root cannot fall back alone): it raises at once, naming the
    cause; rank 1's gather fails (the root's next op does not match it, or the group timeout),
    at its wait or at its next op."""
    dist.all_reduce(to_gpu(torch.ones(8)))
    # Both ranks done checking it: a rank still checking a stream-ordered op when a peer fails
    # the group fails that op too (its peer's released stream could have completed it).
    dist.barrier()
    x = to_gpu(torch.ones(16))
    if ctx.rank == 0:
        res = _raised(lambda: dist.gather(x, [torch.zeros(16) for _ in range(ctx.world)], dst=0))
    else:
        res = _raised(lambda: dist.gather(x, None, dst=0))
    res["later"] = _raised(lambda: dist.all_reduce(to_gpu(torch.ones(8))))
    return res


def _splits(w, m, shape):
    """sizes[k][j]: what rank k sends rank j, in elements ("uneven": some blocks empty, at 2
    ranks rank 0 sends nothing at all; "idle": the last rank sends and receives nothing, its
    tensors empty; "big": one block much larger than the rest)."""
    if shape == "uneven":
        return [[(0 if (k + 2 * j) % 3 == 0 or (k, j) == (0, 1) else (k + j + 1) * m)
                 for j in range(w)] for k in range(w)]
    if shape == "idle":
        return [[(0 if w - 1 in (k, j) else (k + j + 1) * m) for j in range(w)] for k in range(w)]
    return [[(40 * m if (k, j) == (w - 1, 0) else m + k) for j in range(w)] for k in range(w)]


def case_gpu_stream_alltoallv(ctx, expect_stream, m=1000):
    """all_to_all_single with splits on GPU tensors (uneven, empty blocks, one large block):
    stream-ordered on one host after the ranks agree on the sizes (one stream-ordered op a
    call); the host path's bytes and the expected blocks."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    calls = 0
    for shape, dt in (("uneven", "float32"), ("big", "int16"), ("uneven", "bfloat16"),
                      ("idle", "float32")):
        sizes = _splits(w, m, shape)
        send = sizes[r]
        recv = [sizes[k][r] for k in range(w)]
        ins = [make(dt, sum(sizes[k]), k, salt=80) for k in range(w)]
        og = to_gpu(torch.zeros(sum(recv), dtype=ins[r].dtype))
        oh = torch.zeros(sum(recv), dtype=ins[r].dtype)
        dist.all_to_all_single(og, to_gpu(ins[r]), recv, send)
        dist.all_to_all_single(oh, ins[r], recv, send)
        calls += 1
        _same(fails, f"stream all_to_all {shape} {dt}", og, oh)
        want = torch.cat([ins[k][sum(sizes[k][:r]):sum(sizes[k][:r + 1])] for k in range(w)])
        if not torch.equal(oh, want):
            fails.append(f"stream all_to_all {shape} {dt}: not every rank's block for this rank")
    _check_count(fails, be, before, calls, expect_stream)
    return fails


def case_gpu_stream_alltoallv_bad(ctx):
    """Rank 0 expects one element more from rank 1 than rank 1 sends: every rank raises (the
    sizes do not pair up) and the group goes on (an all_reduce after it is right). Then rank 0
    passes no splits while the others pass equal ones: every rank raises."""
    w, r = ctx.world, ctx.rank
    send = [4] * w
    recv = [4] * w
    if r == 0:
        recv[1] = 5
    res = _raised(lambda: dist.all_to_all_single(to_gpu(torch.zeros(sum(recv))),
                                                 to_gpu(torch.ones(sum(send))), recv, send))
    g = to_gpu(torch.ones(8))
    after = _raised(lambda: dist.all_reduce(g))
    res["after_ok"] = not after["raised"] and torch.equal(to_host(g), torch.full((8,), float(w)))
    res["after"] = after
    dist.barrier()  # (every rank done checking it before the next call fails the group)
    x, o = to_gpu(torch.ones(4 * w)), to_gpu(torch.zeros(4 * w))
    if r == 0:
        res["mixed"] = _raised(lambda: dist.all_to_all_single(o, x))
    else:
        res["mixed"] = _raised(lambda: dist.all_to_all_single(o, x, [4] * w, [4] * w))
    if not res["mixed"]["raised"]:  # (a failure learnt after wait() returned: the next op)
        res["mixed"] = _raised(lambda: dist.all_reduce(g))
    return res


def case_gpu_stream_alltoall_list(ctx, expect_stream, m=1000):
    """dist.all_to_all (lists of tensors, empty ones among them) on GPU tensors: stream-ordered
    on one host like all_to_all_single with splits; the host path's bytes and the expected
    blocks."""
    fails = []
    w, r = ctx.world, ctx.rank
    be = _backend()
    before = be._stream_ops()
    sizes = _splits(w, m, "uneven")
    blocks = [[make("float32", sizes[k][j], k, salt=90 + j) for j in range(w)] for k in range(w)]
    outs_g = [to_gpu(torch.zeros(sizes[k][r])) for k in range(w)]
    outs_h = [torch.zeros(sizes[k][r]) for k in range(w)]
    dist.all_to_all(outs_g, [to_gpu(b) for b in blocks[r]])
    dist.all_to_all(outs_h, blocks[r])
    for k in range(w):
        _same(fails, f"stream all_to_all (list) block from {k}", outs_g[k], outs_h[k])
        if not torch.equal(outs_h[k], blocks[k][r]):
            fails.append(f"stream all_to_all (list): block from rank {k} is not its block for "
                         f"this rank")
    _check_count(fails, be, before, 1, expect_stream)
    return fails
