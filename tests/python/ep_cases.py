"""EP test cases, run inside every rank by _ep_worker.py. Each case returns a list of
failure strings (empty = pass). Every rank regenerates every rank's inputs from a seed, so
the plain-torch reference needs no communication.

Identity encoding (as DeepEP's tests): row t of rank r holds r in its body, t in its last
element and ((7r + 3t) mod 13) / 4 in the one before, so each received row names its source.
"""

import os
import signal
import time

import torch

from mooncake.ep import Buffer, combine_autograd, dispatch_autograd

TIMEOUT_US = 20_000_000


class Ctx:
    def __init__(self, rank, world, sync_dir):
        self.rank, self.world, self.sync_dir = rank, world, sync_dir
        self._bufs = {}
        self.active = None  # active_ranks carried from one kill case to the next

    def buffer(self, M, H, E):
        """The cases' buffer for these bounds; with EP_CASES_GPU=1 (and MC_DEVICE=sim) a
        buffer in GPU memory behind the host-tensor interface the cases use
        (ep_cases_gpu.GpuBuffer)."""
        key = (M, H, E)
        if key not in self._bufs:
            nbytes = Buffer.get_ep_buffer_size_hint(M, H, self.world, E)
            if os.environ.get("EP_CASES_GPU") == "1":
                from ep_cases_gpu import GpuBuffer  # (that module imports this one)
                self._bufs[key] = GpuBuffer(Buffer(None, nbytes, device="gpu"))
            else:
                self._bufs[key] = Buffer(None, nbytes)
        return self._bufs[key]

    def wait_all(self, name, ranks, timeout_s=30):
        """A file barrier that survives the death of ranks after they arrived."""
        open(os.path.join(self.sync_dir, f"{name}.{self.rank}"), "w").close()
        end = time.time() + timeout_s
        while time.time() < end:
            if all(os.path.exists(os.path.join(self.sync_dir, f"{name}.{r}")) for r in ranks):
                return
            time.sleep(0.002)
        raise TimeoutError(f"file barrier {name}")


# ---- inputs and reference ----

def make_inputs(seed, r, T, H, K, E, dtype, all_to=None):
    g = torch.Generator().manual_seed(seed * 1000003 + r)
    x = torch.full((T, H), float(r))
    if T:
        t = torch.arange(T)
        x[:, -1] = t.float()
        x[:, -2] = ((7 * r + 3 * t) % 13).float() * 0.25
    topk = torch.full((T, K), -1, dtype=torch.int64)
    w = torch.rand((T, K), generator=g) + 0.001
    for t in range(T):
        if all_to is not None:
            topk[t, 0] = all_to
            continue
        if t % 7 == 5:
            continue  # a row of all -1
        ids = torch.randperm(E, generator=g)[:K]
        ids[torch.rand(K, generator=g) < 0.125] = -1
        topk[t] = ids
    return x.to(dtype), topk, w


class Cfg:
    def __init__(self, world, M=24, H=96, K=3, E=None, dtype=torch.bfloat16, seed=1,
                 tokens=None, all_to=None):
        self.world, self.M, self.H, self.K = world, M, H, K
        self.E = E if E is not None else 4 * world
        self.L = self.E // world
        self.dtype, self.seed, self.all_to = dtype, seed, all_to
        self.tokens = tokens if tokens is not None else [M - 3 * r for r in range(world)]

    def inputs(self, r):
        return make_inputs(self.seed, r, self.tokens[r], self.H, self.K, self.E, self.dtype,
                           self.all_to)


def expert_fn(rows, e, dtype):
    return (rows.float() * (1.0 + e / 16.0)).to(dtype)


def ll_y(cfg, me, recv_x, recv_count):
    y = torch.zeros_like(recv_x)
    for l in range(cfg.L):
        n = int(recv_count[l])
        y[l, :n] = expert_fn(recv_x[l, :n], me * cfg.L + l, cfg.dtype)
    return y


def check_ll_dispatch(cfg, me, recv_x, recv_count, handle, active, tag):
    fails = []
    src_info, layout, M, H, E = handle
    if (M, H, E) != (cfg.M, cfg.H, cfg.E):
        return [f"{tag}: handle (M, H, E) = {(M, H, E)}"]
    for l in range(cfg.L):
        e = me * cfg.L + l
        blocks = []
        for r in range(cfg.world):
            v = int(layout[l, r])
            b, c = v >> 32, v & 0xFFFFFFFF
            exp = []
            if active[r]:
                x_r, topk_r, _ = cfg.inputs(r)
                exp = [t for t in range(cfg.tokens[r]) if bool((topk_r[t] == e).any())]
            if c != len(exp):
                fails.append(f"{tag}: expert {e} got {c} rows from rank {r}, want {len(exp)}")
                continue
            got = src_info[l, b:b + c].long()
            if sorted(got.tolist()) != exp:
                fails.append(f"{tag}: expert {e} from rank {r}: tokens {sorted(got.tolist())}")
            elif c and not torch.equal(recv_x[l, b:b + c], x_r[got]):
                fails.append(f"{tag}: expert {e} from rank {r}: row contents differ")
            blocks.append((b, c))
        end = 0
        for b, c in sorted(blocks):
            if c:
                if b != end:
                    fails.append(f"{tag}: expert {e}: blocks do not tile ({b} != {end})")
                end = b + c
        if int(recv_count[l]) != end:
            fails.append(f"{tag}: expert {e}: recv_count {int(recv_count[l])} != {end}")
    return fails


def ref_ll_combine(cfg, me, active):
    x, topk, w = cfg.inputs(me)
    out = torch.zeros((cfg.tokens[me], cfg.H), dtype=cfg.dtype)
    for t in range(cfg.tokens[me]):
        acc = torch.zeros(cfg.H)
        for k in range(cfg.K):
            e = int(topk[t, k])
            if e < 0 or not active[e // cfg.L]:
                continue
            acc = acc + w[t, k] * expert_fn(x[t], e, cfg.dtype).float()
        out[t] = acc.to(cfg.dtype)
    return out


def check_ll_combine(cfg, me, out, active, tag):
    ref = ref_ll_combine(cfg, me, active)
    if not torch.equal(out, ref):
        bad = (out != ref).any(dim=1).nonzero().flatten().tolist()
        return [f"{tag}: combine differs from the reference at tokens {bad[:8]}"]
    return []


def ll_round(ctx, cfg, active, tag, timeout_us=TIMEOUT_US, async_finish=False):
    """One full low-latency round with checks; returns failures."""
    me = ctx.rank
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    x, topk, w = cfg.inputs(me)
    recv_x, cnt, handle, ev, hook = buf.dispatch(x, topk, active, cfg.M, cfg.E,
                                                 timeout_us=timeout_us, async_finish=async_finish)
    if async_finish:
        ev.wait()
    fails = check_ll_dispatch(cfg, me, recv_x, cnt, handle, active, tag)
    y = ll_y(cfg, me, recv_x, cnt)
    out, ev, hook = buf.combine(y, topk, w, active, timeout_us, handle, async_finish=async_finish)
    if async_finish:
        ev.wait()
    return fails + check_ll_combine(cfg, me, out, active, tag)


# ---- low-latency cases ----

def case_ll_modes(ctx):
    """Sync bf16, async fp32, two rounds in flight with hooks, T=0 on a rank, out=."""
    R, me = ctx.world, ctx.rank
    fails = []
    tokens = [24, 0, 21, 5][:R]
    a = Cfg(R, tokens=tokens, seed=3)
    active = torch.ones(R, dtype=torch.int32)
    fails += ll_round(ctx, a, active, "sync-bf16")
    b = Cfg(R, dtype=torch.float32, seed=4)
    fails += ll_round(ctx, b, active, "async-fp32", async_finish=True)
    # Two rounds in flight: send both, then receive both (hooks), same for combine. At most
    # two calls of a kind in flight (the buffer's halves): while the first one's hook waits,
    # a third call of the kind (a normal-mode one too) is refused with ValueError on every
    # rank alike (its round given up), and the hooked calls then receive what was sent to
    # them, not the third's rows.
    c, d = Cfg(R, seed=5), Cfg(R, seed=6, dtype=torch.float32, tokens=tokens)
    buf = ctx.buffer(c.M, c.H, c.E)
    xc, tc, wc = c.inputs(me)
    xd, td, wd = d.inputs(me)
    rc = buf.dispatch(xc, tc, active, c.M, c.E, return_recv_hook=True)
    rd = buf.dispatch(xd, td, active, d.M, d.E, return_recv_hook=True)
    if rc[4] is None or rd[4] is None:
        return fails + ["return_recv_hook=True returned no hook"]
    _expect_value_error(fails, lambda: buf.dispatch(xd, td, active, d.M, d.E),
                        "a third dispatch in flight", "hook")
    _expect_value_error(fails, lambda: buf.normal_dispatch(xc, tc, wc, c.E),
                        "a normal dispatch while two are in flight", "hook")
    rc[4]()
    rd[4]()
    fails += check_ll_dispatch(c, me, rc[0], rc[1], rc[2], active, "hook-c")
    fails += check_ll_dispatch(d, me, rd[0], rd[1], rd[2], active, "hook-d")
    oc = buf.combine(ll_y(c, me, rc[0], rc[1]), tc, wc, active, TIMEOUT_US, rc[2],
                     return_recv_hook=True)
    out_d = torch.full((d.tokens[me], d.H), 7.0, dtype=d.dtype)
    od = buf.combine(ll_y(d, me, rd[0], rd[1]), td, wd, active, TIMEOUT_US, rd[2],
                     return_recv_hook=True, async_finish=True, out=out_d)
    _expect_value_error(fails, lambda: buf.combine(ll_y(d, me, rd[0], rd[1]), td, wd, active,
                                                   TIMEOUT_US, rd[2]),
                        "a third combine in flight", "hook")
    oc[2]()
    od[2]()
    fails += check_ll_combine(c, me, oc[0], active, "hook-c")
    fails += check_ll_combine(d, me, od[0], active, "hook-d")
    if od[0].data_ptr() != out_d.data_ptr():
        fails.append("combine(out=...) did not write into out")
    # A hook dropped uncalled frees its half: both halves serve full rounds again.
    dropped = buf.dispatch(xc, tc, active, c.M, c.E, return_recv_hook=True)[4]
    del dropped
    for i in range(2):
        fails += ll_round(ctx, c, active, f"after a dropped hook ({i})")
    # Every token of every rank to expert 0: rank 0 receives the capacity bound R*M.
    e = Cfg(R, tokens=[24] * R, all_to=0, seed=7)
    recv_x, cnt, handle, _, _ = buf.dispatch(*e.inputs(me)[:2], active, e.M, e.E)
    fails += check_ll_dispatch(e, me, recv_x, cnt, handle, active, "all-to-0")
    if me == 0 and int(cnt[0]) != R * e.M:
        fails.append(f"all-to-0: recv_count[0] = {int(cnt[0])}, want {R * e.M}")
    out, _, _ = buf.combine(ll_y(e, me, recv_x, cnt), e.inputs(me)[1], e.inputs(me)[2], active,
                            TIMEOUT_US, handle)
    fails += check_ll_combine(e, me, out, active, "all-to-0")
    if active.tolist() != [1] * R:
        fails.append(f"active_ranks changed: {active.tolist()}")
    return fails



# ---- fp8 dispatch: references from the format's definition ----

def _e4m3_values():
    """The 127 non-negative finite e4m3fn values, by code (0x00..0x7e), from the fields."""
    vals = []
    for c in range(0x7f):
        e, m = c >> 3, c & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10))
    return torch.tensor(vals, dtype=torch.float64)


def e4m3_ref(v):
    """float32 tensor -> uint8 codes: nearest value, ties to the even code, saturating at 448
    (no NaN in the inputs here)."""
    vals = _e4m3_values()
    a = v.abs().double().reshape(-1, 1)
    d = (a - vals.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    ties = d == best
    # Of the (at most two) nearest codes take the even one.
    codes = torch.arange(0x7f).reshape(1, -1).expand_as(d)
    even = ties & (codes % 2 == 0)
    pick = torch.where(even.any(dim=1), (even * 1).argmax(dim=1), (ties * 1).argmax(dim=1))
    pick = torch.where(a.flatten() >= 448.0, torch.full_like(pick, 0x7e), pick)
    sign = torch.signbit(v.reshape(-1)).to(torch.int64) * 0x80
    return (pick + sign).to(torch.uint8).reshape(v.shape)


def fp8_ref(x):
    """DeepEP's per-token, per-128-channel fp8 cast of bf16 x [T, H]: (codes uint8 [T, H],
    scales float32 [T, H/128], the multipliers 448 / amax applied before the cast)."""
    T, H = x.shape
    xf = x.float().reshape(T, H // 128, 128)
    amax = xf.abs().amax(dim=-1).clamp(min=1e-4) if T else torch.zeros(0, H // 128)
    mul = torch.full_like(amax, 448.0) / amax
    scale = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    return e4m3_ref(xf * mul.unsqueeze(-1)).reshape(T, H), scale, mul


def fp8_inputs(cfg, r):
    """Wide-ranged bf16 rows (the identity encoding scaled per group, and noise), one group
    all zero on odd tokens (its scale is the margin's)."""
    x, topk, w = cfg.inputs(r)
    g = torch.Generator().manual_seed(cfg.seed * 7919 + r)
    T, H = x.shape
    noise = torch.randn((T, H), generator=g) * torch.logspace(-3, 3, H // 128).repeat_interleave(128)
    xf = x.float() + noise
    xf[1::2, :128] = 0.0
    return xf.to(torch.bfloat16), topk, w


def case_ll_fp8(ctx):
    """use_fp8 dispatch: every received row's e4m3 bytes and scales equal the format's
    reference of its source token (bit for bit; on torch >= 2.1 also torch's own float8 cast),
    then a bf16 combine of the dequantized rows against the plain-torch reference."""
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, H=384, seed=71, tokens=[20, 0, 17, 9][:R])
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    active = torch.ones(R, dtype=torch.int32)
    x, topk, w = fp8_inputs(cfg, me)
    recv, cnt, handle, _, _ = buf.dispatch(x, topk, active, cfg.M, cfg.E, use_fp8=True)
    fails = []
    if not isinstance(recv, tuple) or len(recv) != 2:
        return [f"use_fp8 recv_x is {type(recv).__name__}, not (e4m3, scales)"]
    q, scales = recv
    has_fp8 = hasattr(torch, "float8_e4m3fn")
    want_dtype = torch.float8_e4m3fn if has_fp8 else torch.uint8
    if q.dtype != want_dtype or scales.dtype != torch.float32:
        fails.append(f"dtypes {q.dtype}, {scales.dtype}")
    if tuple(q.shape) != (cfg.L, R * cfg.M, cfg.H) or \
            tuple(scales.shape) != (cfg.L, R * cfg.M, cfg.H // 128):
        fails.append(f"shapes {tuple(q.shape)}, {tuple(scales.shape)}")
    codes = q.view(torch.uint8)
    src_info, layout = handle[0], handle[1]
    refs = {r: fp8_ref(fp8_inputs(cfg, r)[0]) for r in range(R)}
    for l in range(cfg.L):
        e = me * cfg.L + l
        total = 0
        for r in range(R):
            v = int(layout[l, r])
            b, c = v >> 32, v & 0xFFFFFFFF
            topk_r = fp8_inputs(cfg, r)[1]
            want = [t for t in range(cfg.tokens[r]) if bool((topk_r[t] == e).any())]
            got = src_info[l, b:b + c].long()
            if sorted(got.tolist()) != want:
                fails.append(f"expert {e} from rank {r}: tokens {got.tolist()}, want {want}")
                continue
            total += c
            rq, rs, rmul = refs[r]
            if not torch.equal(codes[l, b:b + c], rq[got]):
                n = int((codes[l, b:b + c] != rq[got]).sum())
                fails.append(f"expert {e} from rank {r}: {n} e4m3 bytes differ from the reference")
            if not torch.equal(scales[l, b:b + c].view(torch.int32), rs[got].view(torch.int32)):
                fails.append(f"expert {e} from rank {r}: scales differ from the reference")
            if has_fp8 and c:
                xr = fp8_inputs(cfg, r)[0][got].float().reshape(c, cfg.H // 128, 128)
                torch_q = (xr * rmul[got].unsqueeze(-1)).to(torch.float8_e4m3fn)
                if not torch.equal(torch_q.view(torch.uint8).reshape(c, -1), codes[l, b:b + c]):
                    fails.append(f"expert {e} from rank {r}: differs from torch's float8 cast")
        if int(cnt[l]) != total:
            fails.append(f"expert {e}: recv_count {int(cnt[l])} != {total}")
    # Combine (bf16) of the dequantized rows, against the reference on dequantized inputs.
    deq = torch.zeros((cfg.L, R * cfg.M, cfg.H), dtype=torch.bfloat16)
    for l in range(cfg.L):
        n = int(cnt[l])
        vals = _e4m3_values()
        mag = vals[(codes[l, :n] & 0x7f).long()]
        sgn = 1.0 - 2.0 * (codes[l, :n] >> 7).double()
        f = (mag * sgn).float().reshape(n, cfg.H // 128, 128) * scales[l, :n].unsqueeze(-1)
        deq[l, :n] = f.reshape(n, cfg.H).to(torch.bfloat16)
    y = ll_y(cfg, me, deq, cnt)
    out, _, _ = buf.combine(y, topk, w, active, TIMEOUT_US, handle)

    class Deq(Cfg):
        def inputs(self, r):
            xr, tr, wr = fp8_inputs(cfg, r)
            rq, rs, _ = fp8_ref(xr)
            mag = _e4m3_values()[(rq & 0x7f).long()] * (1.0 - 2.0 * (rq >> 7).double())
            T = len(xr)
            xd = (mag.float().reshape(T, cfg.H // 128, 128) * rs.unsqueeze(-1)).reshape(T, cfg.H)
            return xd.to(torch.bfloat16), tr, wr

    dcfg = Deq(R, H=cfg.H, seed=cfg.seed, tokens=cfg.tokens)
    fails += check_ll_combine(dcfg, me, out, active, "fp8-combine")
    if active.tolist() != [1] * R:
        fails.append(f"active_ranks changed: {active.tolist()}")
    return fails


def case_kernel_path(ctx):
    """Under MC_EP_KERNELS=host the buffer's low-latency calls run the kernels' bodies (every
    peer is mapped here), and a disable_p2p buffer still runs the CPU path."""
    import torch.distributed as dist
    buf = ctx.buffer(24, 96, 4 * ctx.world)
    fails = []
    want = "kernels on host" if os.environ.get("MC_EP_KERNELS") in ("host", "threads") else "cpu"
    if buf._impl.low_latency_executor() != want:
        fails.append(f"executor {buf._impl.low_latency_executor()!r}, want {want!r}")
    if ctx.world > 1:
        nb = Buffer(dist.group.WORLD, 1 << 24, disable_p2p=True)
        if nb._impl.low_latency_executor() != "cpu":
            fails.append("a disable_p2p buffer runs " + nb._impl.low_latency_executor())
    return fails


def _expect_value_error(fails, fn, what, needle=None):
    """fn() must raise ValueError (whose message has `needle`); else a failure in fails."""
    try:
        fn()
    except ValueError as ex:
        if needle and needle not in str(ex):
            fails.append(f"{what}: message lacks '{needle}': {ex}")
        return
    except Exception as ex:  # noqa: BLE001
        fails.append(f"{what}: raised {type(ex).__name__}, not ValueError: {ex}")
        return
    fails.append(f"{what}: accepted")


def case_validation(ctx):
    """Bad arguments raise ValueError on every rank before anything is sent."""
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, seed=9)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    x, topk, w = cfg.inputs(me)
    act = torch.ones(R, dtype=torch.int32)
    fails = []

    def expect(fn, what, needle=None):
        _expect_value_error(fails, fn, what, needle)

    big = torch.zeros((cfg.M + 1, cfg.H), dtype=cfg.dtype)
    expect(lambda: buf.dispatch(big, torch.full((cfg.M + 1, cfg.K), -1), act, cfg.M, cfg.E),
           "T > M", "above")
    bad = topk.clone()
    bad[0, 0] = cfg.E
    expect(lambda: buf.dispatch(x, bad, act, cfg.M, cfg.E), "expert id >= E", "expert id")
    dup = topk.clone()
    dup[1, 0] = dup[1, 1] = 2
    expect(lambda: buf.dispatch(x, dup, act, cfg.M, cfg.E), "duplicate expert", "twice")
    expect(lambda: buf.dispatch(x.half(), topk, act, cfg.M, cfg.E), "float16 x", "bfloat16")
    expect(lambda: buf.dispatch(x, topk, act.long(), cfg.M, cfg.E), "int64 active_ranks",
           "active_ranks")
    expect(lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E + 1), "E % R != 0", "multiple")
    expect(lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E, use_fp8=True), "use_fp8, H=96",
           "multiple of 128")
    x128 = torch.zeros((cfg.tokens[me], 128))
    expect(lambda: buf.dispatch(x128, topk, act, cfg.M, cfg.E, use_fp8=True),
           "use_fp8, float32 x", "bfloat16")
    expect(lambda: buf.normal_dispatch(x, bad, w, cfg.E), "normal: expert id", "expert id")
    expect(lambda: buf.get_dispatch_layout(dup, cfg.E), "layout: duplicate", "twice")
    gloo = torch.distributed.new_group(backend="gloo")
    expect(lambda: Buffer(gloo, 1 << 20), "Buffer on a gloo group", "mooncake")
    # An M far beyond the buffer: its ValueError before the outputs are allocated (it used to
    # be the allocator's RuntimeError for [L, R*M, H]).
    expect(lambda: buf.dispatch(x, topk, act, 10 ** 9, cfg.E), "M = 1e9", "buffer bytes")
    # Nothing was sent: a good round still lines up on every rank.
    fails += ll_round(ctx, cfg, act, "after-errors")
    # A timeout_us too long for the clock is no deadline (it used to time out at once and mark
    # the late rank inactive): rank 0 comes 0.3 s late.
    if me == 0:
        time.sleep(0.3)
    return fails + ll_round(ctx, cfg, act, "huge timeout_us", timeout_us=2 ** 62)


def case_one_rank_bad_input(ctx):
    """Only one rank's call is invalid: it raises ValueError before sending anything, the
    others' calls of that round end promptly with an error naming it (not a timeout, and no
    rank is marked inactive), and the next rounds are in step on every rank (low latency:
    dispatch and combine; normal mode: dispatch)."""
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, seed=13)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    x, topk, w = cfg.inputs(me)
    act = torch.ones(R, dtype=torch.int32)
    fails = []

    def round_with_one_bad(what, bad_rank, call_bad, call_good):
        t0 = time.time()
        try:
            (call_bad if me == bad_rank else call_good)()
            fails.append(f"{what}: rank {me} did not raise")
        except (ValueError, TypeError) as ex:
            if me != bad_rank:
                fails.append(f"{what}: rank {me} raised {type(ex).__name__} but its call was "
                             f"good: {ex}")
            elif isinstance(ex, TypeError) and f"rank {me}" not in str(ex):
                fails.append(f"{what}: the TypeError does not name rank {me}: {ex}")
        except RuntimeError as ex:
            if me == bad_rank:
                fails.append(f"{what}: the bad rank raised RuntimeError: {ex}")
            elif f"rank {bad_rank}" not in str(ex) or "gave up" not in str(ex):
                fails.append(f"{what}: rank {me}'s error does not name rank {bad_rank}: {ex}")
        took = time.time() - t0
        if took > 5:
            fails.append(f"{what}: rank {me} took {took:.1f} s (timeout_us is "
                         f"{TIMEOUT_US / 1e6:.0f} s)")
        if act.tolist() != [1] * R:
            fails.append(f"{what}: active_ranks became {act.tolist()}")

    bad = topk.clone()
    bad[0, 0] = cfg.E  # an expert id out of range
    round_with_one_bad(
        "dispatch", 0,
        lambda: buf.dispatch(x, bad, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US),
        lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US))
    fails += ll_round(ctx, cfg, act, "after a bad dispatch")
    # combine: a good dispatch first, then one rank passes weights of the wrong shape.
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US)
    y = ll_y(cfg, me, recv_x, cnt)
    round_with_one_bad(
        "combine", R - 1,
        lambda: buf.combine(y, topk, w[:, :1].contiguous(), act, TIMEOUT_US, handle),
        lambda: buf.combine(y, topk, w, act, TIMEOUT_US, handle))
    fails += ll_round(ctx, cfg, act, "after a bad combine")
    # a Python-level error before the native call (a broken handle) gives the round up too
    round_with_one_bad(
        "combine with a broken handle", 0,
        lambda: buf.combine(y, topk, w, act, TIMEOUT_US, ("not", "a", "handle")),
        lambda: buf.combine(y, topk, w, act, TIMEOUT_US, handle))
    fails += ll_round(ctx, cfg, act, "after a broken handle")
    # arguments of the wrong Python type, refused by the binding before the native call
    round_with_one_bad(
        "dispatch with a numpy topk_idx", R - 1,
        lambda: buf.dispatch(x, topk.numpy(), act, cfg.M, cfg.E, timeout_us=TIMEOUT_US),
        lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US))
    fails += ll_round(ctx, cfg, act, "after a dispatch of the wrong type")
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US)
    y = ll_y(cfg, me, recv_x, cnt)
    round_with_one_bad(
        "combine with topk_weights None", 0,
        lambda: buf.combine(y, topk, None, act, TIMEOUT_US, handle),
        lambda: buf.combine(y, topk, w, act, TIMEOUT_US, handle))
    fails += ll_round(ctx, cfg, act, "after a combine of the wrong type")
    # normal mode
    ncfg = Cfg(R, M=32, H=96, seed=31, tokens=[30, 27, 0, 12][:R])
    nbuf = ctx.buffer(32, 96, ncfg.E)
    nx, ntopk, nw = ncfg.inputs(me)
    nbad = ntopk.clone()
    if len(nbad):
        nbad[0, 0] = ncfg.E
    else:
        nbad = torch.full((1, ncfg.K), ncfg.E, dtype=torch.int64)
    round_with_one_bad(
        "normal_dispatch", 1 % R,
        lambda: nbuf.normal_dispatch(nx if len(ntopk) else nx.new_zeros((1, 96)), nbad, None,
                                     ncfg.E),
        lambda: nbuf.normal_dispatch(nx, ntopk, nw, ncfg.E))
    round_with_one_bad(
        "normal_dispatch with a list x", 0,
        lambda: nbuf.normal_dispatch(nx.tolist(), ntopk, nw, ncfg.E),
        lambda: nbuf.normal_dispatch(nx, ntopk, nw, ncfg.E))
    recv_x, recv_topk, recv_w, per_exp, h = nbuf.normal_dispatch(nx, ntopk, nw, ncfg.E)
    if recv_x.shape[0] != len(ref_normal_rows(ncfg, me)):
        fails.append(f"normal round after a bad one: {recv_x.shape[0]} rows, want "
                     f"{len(ref_normal_rows(ncfg, me))}")
    out, _ = nbuf.normal_combine(recv_x, h)
    if out.shape[0] != ncfg.tokens[me]:
        fails.append("normal_combine after a bad round returned the wrong shape")
    return fails


# ---- normal mode ----

def ref_normal_rows(cfg, me):
    """Rows rank `me` receives: [(r, t)] in source-rank, then token order."""
    rows = []
    for r in range(cfg.world):
        _, topk_r, _ = cfg.inputs(r)
        for t in range(cfg.tokens[r]):
            ids = topk_r[t]
            if bool(((ids >= 0) & (ids // cfg.L == me)).any()):
                rows.append((r, t))
    return rows


def case_normal(ctx):
    R = ctx.world
    fails = []
    for dtype, H in ((torch.bfloat16, 96), (torch.float32, 40)):
        cfg = Cfg(R, M=32, H=H, dtype=dtype, seed=21 + H, tokens=[30, 27, 0, 12][:R])
        fails += normal_round(ctx, ctx.buffer(32, 96, cfg.E), cfg, str(dtype))
    return fails


def normal_round(ctx, buf, cfg, tag):
    """get_dispatch_layout, normal_dispatch (expert alignment 4) and normal_combine of cfg's
    inputs on buf, against the plain-torch reference; the failures, each starting with tag."""
    R, me, dtype, H = ctx.world, ctx.rank, cfg.dtype, cfg.H
    fails = []
    x, topk, w = cfg.inputs(me)
    per_rank, per_expert, in_rank = buf.get_dispatch_layout(topk, cfg.E)
    owner = torch.where(topk >= 0, topk // cfg.L, torch.full_like(topk, -1))
    ref_in = torch.stack([(owner == d).any(1) for d in range(R)], 1) if len(x) else \
        torch.zeros((0, R), dtype=torch.bool)
    if not torch.equal(in_rank, ref_in) or per_rank.tolist() != ref_in.sum(0).tolist():
        fails.append(f"{tag}: get_dispatch_layout per-rank results differ")
    ref_pe = torch.bincount(topk[topk >= 0], minlength=cfg.E)
    if per_expert.tolist() != ref_pe.tolist():
        fails.append(f"{tag}: num_tokens_per_expert {per_expert.tolist()}")
    recv_x, recv_topk, recv_w, per_exp, h = buf.normal_dispatch(x, topk, w, cfg.E,
                                                                expert_alignment=4)
    rows = ref_normal_rows(cfg, me)
    if len(rows) != recv_x.shape[0]:
        return fails + [f"{tag}: {recv_x.shape[0]} rows, want {len(rows)}"]
    counts = [0] * cfg.L
    for i, (r, t) in enumerate(rows):
        x_r, topk_r, w_r = cfg.inputs(r)
        if int(h.recv_src_idx[i]) != t or not torch.equal(recv_x[i], x_r[t]):
            fails.append(f"{tag}: row {i} is not rank {r}'s token {t}")
            break
        local = torch.where((topk_r[t] >= 0) & (topk_r[t] // cfg.L == me),
                            topk_r[t] % cfg.L, torch.full_like(topk_r[t], -1))
        if not torch.equal(recv_topk[i], local) or not torch.equal(
                recv_w[i], torch.where(local >= 0, w_r[t], torch.zeros_like(w_r[t]))):
            fails.append(f"{tag}: row {i} topk/weights differ")
            break
        for l in local[local >= 0].tolist():
            counts[l] += 1
    if per_exp.tolist() != [(c + 3) // 4 * 4 for c in counts]:
        fails.append(f"{tag}: num_recv_per_expert {per_exp.tolist()} vs {counts}")
    # combine: y = recv_x * (1 + me/8); out[t] = sum over receiving ranks, ascending.
    y = (recv_x.float() * (1.0 + me / 8.0)).to(dtype)
    out, out_w = buf.normal_combine(y, h)
    ref = torch.zeros_like(x)
    for t in range(cfg.tokens[me]):
        acc = torch.zeros(H)
        for d in range(R):
            if ref_in[t, d]:
                acc = acc + (x[t].float() * (1.0 + d / 8.0)).to(dtype).float()
        ref[t] = acc.to(dtype)
    if not torch.equal(out, ref):
        fails.append(f"{tag}: normal_combine differs from the reference")
    if not torch.equal(out_w, torch.where(topk >= 0, w, torch.zeros_like(w))):
        fails.append(f"{tag}: normal_combine weights differ")
    return fails


def case_normal_autograd(ctx):
    """Gradients through dispatch (-> combine) and combine (-> cached dispatch)."""
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, M=32, H=40, dtype=torch.float32, seed=31, tokens=[30, 0, 17, 25][:R])
    buf = ctx.buffer(32, 96, cfg.E)
    x, topk, w = cfg.inputs(me)
    x.requires_grad_(True)
    w.requires_grad_(True)
    recv_x, recv_topk, recv_w, _, h = dispatch_autograd(buf, x, topk, w, cfg.E)

    def g_of(d, n, cols, salt):
        return torch.randn((n, cols), generator=torch.Generator().manual_seed(1000 * salt + d))

    n = recv_x.shape[0]
    (recv_x * g_of(me, n, cfg.H, 1)).sum().add((recv_w * g_of(me, n, cfg.K, 2)).sum()).backward()
    # Reference: grad_x[t] = sum over receiving ranks d (ascending) of G_d[row of (me, t)].
    ref_gx = torch.zeros_like(x)
    ref_gw = torch.zeros_like(w)
    for d in range(R):
        rows = ref_normal_rows(cfg, d)
        gx_d, gw_d = g_of(d, len(rows), cfg.H, 1), g_of(d, len(rows), cfg.K, 2)
        for i, (r, t) in enumerate(rows):
            if r != me:
                continue
            ref_gx[t] = ref_gx[t] + gx_d[i]
            for k in range(cfg.K):
                e = int(topk[t, k])
                if e >= 0 and e // cfg.L == d:
                    ref_gw[t, k] = gw_d[i, k]
    fails = []
    if not torch.equal(x.grad, ref_gx):
        fails.append(f"dispatch backward: grad x max err {(x.grad - ref_gx).abs().max()}")
    if not torch.equal(w.grad, ref_gw):
        fails.append(f"dispatch backward: grad w max err {(w.grad - ref_gw).abs().max()}")
    # combine: grad_y[row] = G_src[t] of the row's source.
    y = recv_x.detach().clone().requires_grad_(True)
    rw = recv_w.detach().clone().requires_grad_(True)
    out, out_w = combine_autograd(buf, y, h, rw)
    T = cfg.tokens[me]
    (out * g_of(me, T, cfg.H, 3)).sum().add((out_w * g_of(me, T, cfg.K, 4)).sum()).backward()
    rows = ref_normal_rows(cfg, me)
    ref_gy = torch.stack([g_of(r, cfg.tokens[r], cfg.H, 3)[t] for r, t in rows]) if rows else \
        torch.zeros((0, cfg.H))
    ref_grw = torch.stack([g_of(r, cfg.tokens[r], cfg.K, 4)[t] for r, t in rows]) if rows else \
        torch.zeros((0, cfg.K))
    if not torch.equal(y.grad, ref_gy):
        fails.append("combine backward: grad y differs")
    if not torch.equal(rw.grad, ref_grw):
        fails.append("combine backward: grad weights differs")
    return fails


# ---- failures (each runs in its own processes) ----

def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def _active(ctx):
    if ctx.active is None:
        ctx.active = torch.ones(ctx.world, dtype=torch.int32)
    return ctx.active


def case_kill_between_rounds(ctx):
    """The last rank dies after a round; the next round marks it inactive, in bounded time."""
    R, me, victim = ctx.world, ctx.rank, ctx.world - 1
    active = _active(ctx)
    fails = ll_round(ctx, Cfg(R, seed=41), active, "round1")
    if me == victim:
        _kill_self()
    t0 = time.time()
    fails += ll_round(ctx, Cfg(R, seed=42), active, "round2", timeout_us=3_000_000)
    if active.tolist() != [1] * (R - 1) + [0]:
        fails.append(f"active_ranks after the death: {active.tolist()}")
    if time.time() - t0 > 4.0:
        fails.append(f"round 2 took {time.time() - t0:.1f}s with timeout 3s")
    return fails


def case_kill_between_dispatch_and_combine(ctx):
    """Rank 1 dies after dispatch (run after case_kill_between_rounds: the last rank is
    already gone); combine skips its experts, marks it inactive; later rounds run clean."""
    R, me, victim = ctx.world, ctx.rank, 1
    cfg = Cfg(R, seed=51)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    active = _active(ctx)
    x, topk, w = cfg.inputs(me)
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, active, cfg.M, cfg.E, timeout_us=3_000_000)
    fails = check_ll_dispatch(cfg, me, recv_x, cnt, handle, active, "dispatch")
    ctx.wait_all("dispatched", ranks=[r for r in range(R) if active[r]])
    if me == victim:
        _kill_self()
    # EP_CASES_COMBINE_NO_TIMEOUT=1: timeout_us=-1, so only the engine's notice of the death
    # can end the wait (within a second: the notice, then the 100 ms grace).
    no_timeout = os.environ.get("EP_CASES_COMBINE_NO_TIMEOUT") == "1"
    t0 = time.time()
    out, _, _ = buf.combine(ll_y(cfg, me, recv_x, cnt), topk, w, active,
                            -1 if no_timeout else 3_000_000, handle)
    if no_timeout and time.time() - t0 > 2.0:
        fails.append(f"combine without a timeout took {time.time() - t0:.1f}s to drop the dead rank")
    if int(active[victim]) != 0:
        fails.append(f"victim still active: {active.tolist()}")
    fails += check_ll_combine(cfg, me, out, active, "combine")
    fails += ll_round(ctx, Cfg(R, seed=52), active, "after", timeout_us=3_000_000)
    return fails


def case_normal_after_kills(ctx):
    """After both kill cases (ranks 1 and R-1 dead): normal mode takes no mask, so
    normal_dispatch raises RuntimeError naming a dead rank on every survivor within 5 s (the
    engine's notice, not MC_EP_TIMEOUT_MS); a masked low-latency round still runs after it."""
    R, me, cfg, fails, t0 = ctx.world, ctx.rank, Cfg(ctx.world, seed=56), [], time.time()
    x, topk, w = cfg.inputs(me)
    try:
        ctx.buffer(cfg.M, cfg.H, cfg.E).normal_dispatch(x, topk, w, cfg.E)
        return ["normal_dispatch with dead ranks in the group returned"]
    except RuntimeError as e:
        msg, took = str(e), time.time() - t0
    if not any(f"rank {d}" in msg for d in (1, R - 1)) or took > 5.0:
        fails.append(f"normal_dispatch failed after {took:.1f}s naming no dead rank: {msg}")
    return fails + ll_round(ctx, Cfg(R, seed=57), _active(ctx), "low latency after",
                            timeout_us=3_000_000)


def case_mismatched_combine(ctx):
    """A combine whose topk_idx routes nothing (every entry -1) after a dispatch that sent rows
    to other ranks: every rank that sent such rows gets a RuntimeError saying its topk_idx
    differs from the dispatch's (the owners returned rows it does not expect), whichever path
    runs the call (CPU loops, kernels on host lanes, kernels on a GPU buffer); a round after it
    is in step and right."""
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, seed=81)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    act = torch.ones(R, dtype=torch.int32)
    x, topk, w = cfg.inputs(me)
    fails = []
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, act, cfg.M, cfg.E, timeout_us=TIMEOUT_US)
    sent_away = bool(((topk >= 0) & (topk // cfg.L != me)).any())
    try:
        buf.combine(ll_y(cfg, me, recv_x, cnt), torch.full_like(topk, -1), w, act, TIMEOUT_US,
                    handle)
        if sent_away:
            fails.append("a combine routed elsewhere than its dispatch raised nothing")
    except RuntimeError as ex:
        if not sent_away or "topk_idx differs from the dispatch" not in str(ex):
            fails.append(f"unexpected error (rows sent away: {sent_away}): {ex}")
    if act.tolist() != [1] * R:
        fails.append(f"active_ranks became {act.tolist()}")
    fails += ll_round(ctx, Cfg(R, seed=82), act, "after the mismatched combine")
    return fails
