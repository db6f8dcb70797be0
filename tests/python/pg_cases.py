"""Collective cases run inside every worker of a harness.Pool (see _pg_worker.py).

Each case runs an op on the mooncake default group and checks it against (a) a reference
computed locally from the inputs of every rank (inputs are deterministic functions of rank
and salt, so every rank can build all of them) and (b) the same call on the gloo group
where gloo 1.13 implements it. Copy ops are compared bitwise (gloo runs them on uint8
views, so every dtype gets a gloo comparison); floating reductions with a tolerance.
Each case returns a list of failure strings (empty = pass).
"""

import functools
import time

import torch
import torch.distributed as dist

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX,
       "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR}
FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "int64", "uint8")
COMPLEX = ("complex64", "complex128")
ALL_DTYPES = FLOATS + INTS + ("bool",) + COMPLEX
# What ProcessGroupGloo 1.13 reduces (probed): no bfloat16, int16, bool; complex SUM only.
GLOO_REDUCE = {d: {"SUM", "PRODUCT", "MIN", "MAX"} for d in ("float32", "float64", "float16")}
GLOO_REDUCE.update({d: {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"}
                    for d in ("int8", "int32", "int64", "uint8")})
GLOO_REDUCE.update({d: {"SUM"} for d in COMPLEX})
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "float16": (1e-2, 1e-2),
       "bfloat16": (2e-2, 6e-2), "complex64": (1e-5, 1e-5), "complex128": (1e-12, 1e-12)}


class Ctx:
    def __init__(self, rank, world, gloo, timeout_s):
        self.rank, self.world, self.gloo, self.timeout_s = rank, world, gloo, timeout_s
        self.groups = {}


def dtype(name):
    return getattr(torch, name)


def expectation(dt, op):
    """'required' (must work), 'optional' (may raise ValueError) or 'invalid' (must)."""
    bitwise = op in ("BAND", "BOR", "BXOR")
    if dt in FLOATS:
        return "invalid" if bitwise else "required"
    if dt in COMPLEX:
        if op in ("SUM", "AVG"):
            return "required"
        return "optional" if op == "PRODUCT" else "invalid"
    return "optional" if op == "AVG" else "required"  # integers and bool


def make(dt, n, rank, salt=0, op=None):
    """Deterministic input of `rank`: n elements of dtype name `dt`."""
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + 7919 * salt + 31 * n + 17)
    t = dtype(dt)
    if dt == "bool":
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dt in COMPLEX:
        return torch.randn(n, generator=g, dtype=t)
    if dt in FLOATS:
        x = torch.rand(n, generator=g, dtype=torch.float64)
        x = x + 0.5 if op == "PRODUCT" else x * 2 - 1
        return x.to(t)
    if op == "PRODUCT":
        lo, hi = (0, 4) if dt == "uint8" else (-3, 4)
    else:
        info = torch.iinfo(t)
        lo, hi = info.min, info.max  # wraps in SUM exactly as the reference does
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(t)


def reference(ins, op, dt, world):
    """The reduction of `ins` (one tensor per rank) as torch defines it."""
    st = torch.stack(ins)
    if dt == "bool":
        return {"SUM": st.any(0), "MAX": st.any(0), "BOR": st.any(0), "PRODUCT": st.all(0),
                "MIN": st.all(0), "BAND": st.all(0),
                "BXOR": functools.reduce(torch.bitwise_xor, ins), "AVG": None}[op]
    t = dtype(dt)
    if op == "MIN":
        return st.amin(0) if st.numel() else ins[0].clone()
    if op == "MAX":
        return st.amax(0) if st.numel() else ins[0].clone()
    if op in ("BAND", "BOR", "BXOR"):
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        return functools.reduce(f, ins)
    if dt in FLOATS or dt in COMPLEX:
        wide = st.to(torch.complex128 if dt in COMPLEX else torch.float64)
        r = {"SUM": lambda: wide.sum(0), "AVG": lambda: wide.sum(0) / world,
             "PRODUCT": lambda: wide.prod(0)}[op]()
        return r.to(t)
    wide = st.to(torch.int64)
    if op == "SUM":
        return wide.sum(0).to(t)
    if op == "PRODUCT":
        return wide.prod(0).to(t)
    return torch.div(wide.sum(0), world, rounding_mode="trunc").to(t)  # AVG on integers


def as_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def mismatch(got, exp, dt=None, approx=False):
    """None when equal (bitwise, or within TOL for approx), else a short description."""
    if got.dtype != exp.dtype or got.shape != exp.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} != {exp.dtype}{tuple(exp.shape)}"
    if approx and dt in TOL:
        rtol, atol = TOL[dt]
        wide = torch.complex128 if dt in COMPLEX else torch.float64
        a, b = got.to(wide), exp.to(wide)
        if torch.allclose(a, b, rtol=rtol, atol=atol):
            return None
        d = (a - b).abs()
        i = int(d.reshape(-1).argmax())
        return f"max |diff| {float(d.max()):.3g} at {i}: got {a.reshape(-1)[i]} want {b.reshape(-1)[i]}"
    ga, gb = as_bytes(got), as_bytes(exp)
    if torch.equal(ga, gb):
        return None
    bad = (ga != gb).nonzero()
    first = int(bad[0]) // max(got.element_size(), 1)
    return (f"{bad.numel()} bytes differ, first element {first}: got "
            f"{got.reshape(-1)[first]} want {exp.reshape(-1)[first]}")


def approx_op(dt, op):
    return (dt in FLOATS or dt in COMPLEX) and op in ("SUM", "AVG", "PRODUCT")


def run_reduction(fails, desc, dt, op, call):
    """Runs call(); applies the expectation table. True when the result should be checked."""
    exp = expectation(dt, op)
    try:
        call()
    except ValueError as e:
        if exp == "required":
            fails.append(f"{desc}: raised ValueError but torch defines it: {e}")
        return False
    except RuntimeError as e:
        # torch's own front end refuses MIN/MAX/PRODUCT/bitwise on complex tensors.
        if exp != "required" and dt in COMPLEX and "complex" in str(e):
            return False
        fails.append(f"{desc}: RuntimeError: {e}")
        return False
    except Exception as e:  # noqa: BLE001
        fails.append(f"{desc}: {type(e).__name__}: {e}")
        return False
    if exp == "invalid":
        fails.append(f"{desc}: should raise ValueError (op undefined for {dt})")
        return False
    return True


def check(fails, desc, got, exp, dt=None, approx=False):
    m = mismatch(got, exp, dt, approx)
    if m:
        fails.append(f"{desc}: {m}")


# ---------------------------------------------------------------------------------------
def case_ping(ctx):
    return {"rank": ctx.rank, "world": ctx.world, "backend": dist.get_backend()}


def case_allreduce(ctx, sizes, dtypes=ALL_DTYPES, ops=tuple(OPS), coalesced=False):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for op in ops:
            for n in sizes:
                desc = f"{'all_reduce_coalesced' if coalesced else 'all_reduce'} {dt} {op} n={n}"
                ins = [make(dt, n, r, 0, op) for r in range(W)]
                if coalesced:
                    extra = [make(dt, 5, r, 1, op) for r in range(W)]
                    got = [ins[me].clone(), extra[me].clone()]
                    call = lambda: dist.all_reduce_coalesced(got, op=OPS[op])  # noqa: E731
                else:
                    got = [ins[me].clone()]
                    call = lambda: dist.all_reduce(got[0], op=OPS[op])  # noqa: E731
                if not run_reduction(fails, desc, dt, op, call):
                    continue
                ap = approx_op(dt, op)
                check(fails, desc, got[0], reference(ins, op, dt, W), dt, ap)
                if coalesced:
                    check(fails, desc + " [2nd tensor]", got[1], reference(extra, op, dt, W), dt, ap)
                if op in GLOO_REDUCE.get(dt, ()) and not coalesced and n:
                    g = ins[me].clone()
                    dist.all_reduce(g, op=OPS[op], group=ctx.gloo)
                    check(fails, desc + " vs gloo", got[0], g, dt, ap)
    return fails


def case_reduce(ctx, sizes, dtypes=ALL_DTYPES, ops=tuple(OPS), roots=None):
    fails, W, me = [], ctx.world, ctx.rank
    for root in (range(W) if roots is None else roots):
        for dt in dtypes:
            for op in ops:
                for n in sizes:
                    desc = f"reduce {dt} {op} n={n} root={root}"
                    ins = [make(dt, n, r, root, op) for r in range(W)]
                    got = ins[me].clone()
                    if not run_reduction(fails, desc, dt, op,
                                         lambda: dist.reduce(got, root, op=OPS[op])):
                        continue
                    ap = approx_op(dt, op)
                    if me == root:
                        check(fails, desc, got, reference(ins, op, dt, W), dt, ap)
                    if op in GLOO_REDUCE.get(dt, ()) and dt not in COMPLEX and n:
                        g = ins[me].clone()
                        dist.reduce(g, root, op=OPS[op], group=ctx.gloo)
                        if me == root:
                            check(fails, desc + " vs gloo", got, g, dt, ap)
    return fails


def case_broadcast(ctx, sizes, dtypes=ALL_DTYPES, roots=None):
    fails, W, me = [], ctx.world, ctx.rank
    for root in (range(W) if roots is None else roots):
        for dt in dtypes:
            for n in sizes:
                desc = f"broadcast {dt} n={n} root={root}"
                t = make(dt, n, me, root)
                dist.broadcast(t, root)
                check(fails, desc, t, make(dt, n, root, root))
                if n == 0:
                    continue  # gloo 1.13 dies (SIGFPE) on empty buffers
                g = as_bytes(make(dt, n, me, root)).clone()
                dist.broadcast(g, root, group=ctx.gloo)
                check(fails, desc + " vs gloo", as_bytes(t), g)
    return fails


def case_all_gather(ctx, sizes, dtypes=ALL_DTYPES, api="list"):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for n in sizes:
            desc = f"all_gather[{api}] {dt} n={n}"
            ins = [make(dt, n, r, 3) for r in range(W)]
            if api == "list":
                outs = [torch.empty(n, dtype=dtype(dt)) for _ in range(W)]
                dist.all_gather(outs, ins[me])
                got = torch.cat(outs)
            else:
                got = torch.empty(W * n, dtype=dtype(dt))
                dist.all_gather_into_tensor(got, ins[me])
            check(fails, desc, got, torch.cat(ins))
            if n == 0:
                continue  # gloo 1.13 dies (SIGFPE) on empty buffers
            gouts = [torch.empty(n * ins[0].element_size(), dtype=torch.uint8) for _ in range(W)]
            dist.all_gather(gouts, as_bytes(ins[me]), group=ctx.gloo)
            check(fails, desc + " vs gloo", as_bytes(got), torch.cat(gouts))
    return fails


def case_all_gather_coalesced(ctx, sizes, dtypes=ALL_DTYPES):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for n in sizes:
            kinds = [(dt, n), (dt, 3)]  # torch requires one dtype for the whole list
            ins = [[make(d, m, r, j) for j, (d, m) in enumerate(kinds)] for r in range(W)]
            outs = [[torch.empty(m, dtype=dtype(d)) for d, m in kinds] for _ in range(W)]
            dist.all_gather_coalesced(outs, ins[me])
            for r in range(W):
                for j in range(len(kinds)):
                    check(fails, f"all_gather_coalesced {dt} n={n} from {r} [{j}]",
                          outs[r][j], ins[r][j])
    return fails


def case_gather(ctx, sizes, dtypes=ALL_DTYPES, roots=None):
    fails, W, me = [], ctx.world, ctx.rank
    for root in (range(W) if roots is None else roots):
        for dt in dtypes:
            for n in sizes:
                ins = [make(dt, n, r, 5 + root) for r in range(W)]
                outs = [torch.empty(n, dtype=dtype(dt)) for _ in range(W)] if me == root else None
                dist.gather(ins[me], outs, dst=root)
                if me == root:
                    check(fails, f"gather {dt} n={n} root={root}", torch.cat(outs), torch.cat(ins))
    return fails


def case_scatter(ctx, sizes, dtypes=ALL_DTYPES, roots=None):
    fails, W, me = [], ctx.world, ctx.rank
    for root in (range(W) if roots is None else roots):
        for dt in dtypes:
            for n in sizes:
                desc = f"scatter {dt} n={n} root={root}"
                parts = [make(dt, n, root, 11 + i) for i in range(W)]
                out = torch.empty(n, dtype=dtype(dt))
                dist.scatter(out, parts if me == root else None, src=root)
                check(fails, desc, out, parts[me])
                if n == 0:
                    continue  # gloo 1.13 dies (SIGFPE) on empty buffers
                gout = torch.empty(n * out.element_size(), dtype=torch.uint8)
                dist.scatter(gout, [as_bytes(p) for p in parts] if me == root else None,
                             src=root, group=ctx.gloo)
                check(fails, desc + " vs gloo", as_bytes(out), gout)
    return fails


def case_reduce_scatter(ctx, sizes, dtypes=ALL_DTYPES, ops=tuple(OPS), api="list"):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for op in ops:
            for n in sizes:
                desc = f"reduce_scatter[{api}] {dt} {op} n={n}"
                blocks = [[make(dt, n, r, 20 + i, op) for i in range(W)] for r in range(W)]
                out = torch.empty(n, dtype=dtype(dt))
                if api == "list":
                    call = lambda: dist.reduce_scatter(out, [b.clone() for b in blocks[me]], op=OPS[op])  # noqa: E731,E501
                else:
                    call = lambda: dist.reduce_scatter_tensor(out, torch.cat(blocks[me]), op=OPS[op])  # noqa: E731,E501
                if not run_reduction(fails, desc, dt, op, call):
                    continue
                ap = approx_op(dt, op)
                check(fails, desc, out, reference([blocks[r][me] for r in range(W)], op, dt, W),
                      dt, ap)
                if op in GLOO_REDUCE.get(dt, ()) and n:  # gloo 1.13 has no reduce_scatter
                    g = torch.cat(blocks[me])
                    dist.all_reduce(g, op=OPS[op], group=ctx.gloo)
                    check(fails, desc + " vs gloo all_reduce slice", out, g[me * n:(me + 1) * n],
                          dt, ap)
    return fails


def a2a_rows(src, dst, k, uneven):
    return max(0, k + (src * 2 + dst) % 3 - 1) if uneven else k


def case_all_to_all_single(ctx, sizes, dtypes=ALL_DTYPES, uneven=False, cols=2):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for k in sizes:
            desc = f"all_to_all_single {'uneven' if uneven else 'equal'} {dt} rows/peer={k}"
            rows = [[a2a_rows(s, d, k, uneven) for d in range(W)] for s in range(W)]
            ins = [make(dt, sum(rows[s]) * cols, s, 40).view(-1, cols) for s in range(W)]
            out = torch.empty(sum(rows[s][me] for s in range(W)), cols, dtype=dtype(dt))
            in_splits = rows[me] if uneven else None
            out_splits = [rows[s][me] for s in range(W)] if uneven else None
            dist.all_to_all_single(out, ins[me], out_splits, in_splits)
            exp = torch.cat([ins[s][sum(rows[s][:me]):sum(rows[s][:me + 1])] for s in range(W)])
            check(fails, desc, out, exp)
            if not uneven:  # in place (input and output one tensor), as gloo allows
                same = ins[me].clone()
                dist.all_to_all_single(same, same)
                check(fails, desc + " in place", same, exp)
            if k == 0:
                continue  # gloo 1.13 dies (SIGFPE) on empty buffers
            es = out.element_size()
            gout = torch.empty(out.shape[0], cols * es, dtype=torch.uint8)
            gin = ins[me].contiguous().view(torch.uint8)
            dist.all_to_all_single(gout, gin, out_splits, in_splits, group=ctx.gloo)
            check(fails, desc + " vs gloo", as_bytes(out), gout.reshape(-1))
    return fails


def case_all_to_all(ctx, sizes, dtypes=ALL_DTYPES):
    fails, W, me = [], ctx.world, ctx.rank
    for dt in dtypes:
        for k in sizes:
            n = lambda s, d: a2a_rows(s, d, k, True)  # noqa: E731
            ins = [make(dt, n(me, d), me, 60 + d) for d in range(W)]
            outs = [torch.empty(n(s, me), dtype=dtype(dt)) for s in range(W)]
            dist.all_to_all(outs, ins)
            for s in range(W):
                check(fails, f"all_to_all {dt} k={k} from {s}", outs[s], make(dt, n(s, me), s, 60 + me))
    return fails


def case_barrier(ctx, times=10):
    for _ in range(times):
        dist.barrier()
    return []


def _bad_input_call(op, me, bad, world):
    """One rank (bad) passes an argument that the backend refuses; the others a valid call.
    Returns the op's in-place tensor (broadcast) for a rank that completed it."""
    t = torch.arange(4, dtype=torch.float32) + me
    if op == "broadcast":  # a root outside the group, given to the group object (a sparse
        # tensor, tried first, is refused by torch 2.x itself before the backend sees it)
        if me == bad:
            opts = dist.BroadcastOptions()
            opts.rootRank = world + 1
            dist.distributed_c10d._get_default_group().broadcast([t], opts).wait()
        else:
            dist.broadcast(t, 0)
        return t.tolist()
    elif op == "allreduce":  # BAND is not defined for float32
        dist.all_reduce(t, op=OPS["BAND"] if me == bad else OPS["SUM"])
    elif op == "allgather":  # an output list of the wrong length
        dist.all_gather([torch.empty(4) for _ in range(world + (me == bad))], t)
    elif op == "gather":  # the root's output of the wrong size
        outs = [torch.empty(4 + (me == bad and i == 1)) for i in range(world)]
        dist.gather(t, outs if me == bad else None, dst=bad)
    elif op == "alltoall":  # input splits that do not add up to the tensor
        x = torch.arange(world * 2, dtype=torch.float32)
        split = [2] * world if me != bad else [3] * world
        dist.all_to_all_single(torch.empty(world * 2), x, [2] * world, split)
    elif op == "reduce_scatter":  # an input list of the wrong length
        dist.reduce_scatter(torch.empty(4), [t.clone() for _ in range(world - (me == bad))])
    else:
        raise ValueError(op)


def case_bad_input_one_rank(ctx, op, bad):
    """Only rank `bad` passes an invalid argument to `op`: every rank raises for it (the
    others well within the group timeout, naming that rank, the op and the cause), and the
    group stays usable: the next ops (an all_reduce, a broadcast) give the right results."""
    me, world = ctx.rank, ctx.world
    out = {"raised": False}
    t0 = time.time()
    try:
        out["value"] = _bad_input_call(op, me, bad, world)
    except Exception as e:  # noqa: BLE001 (the erring rank: ValueError / RuntimeError)
        out.update(raised=True, msg=str(e), type=type(e).__name__)
    out["elapsed"] = time.time() - t0
    x = torch.full((8,), float(me + 1))
    dist.all_reduce(x)
    y = torch.full((3,), float(me * 10))
    dist.broadcast(y, world - 1)
    out["later"] = [x[0].item(), y[0].item()]
    out["later_ok"] = (x.tolist() == [world * (world + 1) / 2] * 8 and
                       y.tolist() == [float((world - 1) * 10)] * 3)
    return out
