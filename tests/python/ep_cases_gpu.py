"""EP on buffers in GPU memory (the device layer's simulation here, MC_DEVICE=sim): the proxy
through which the cases of ep_cases.py run unchanged on such a buffer (ep_cases.Ctx.buffer
makes it when EP_CASES_GPU=1), and the GPU buffer's own case. Run by _ep_worker.py, as
ep_cases.py's cases.
"""

import os
import time
import weakref

import torch

from ep_cases import (TIMEOUT_US, Cfg, _expect_value_error, check_ll_combine, check_ll_dispatch,
                      ll_round, ll_y, normal_round)
from mooncake.ep import Buffer


class _Then:
    """An event or hook that runs `then` after it (the GpuBuffer's copies back)."""

    def __init__(self, inner, then):
        self.inner, self.then = inner, then

    def wait(self):
        self.inner.wait()
        self.then()

    def __call__(self):
        self.inner()
        self.then()


def _dev(t):
    """A tensor argument in GPU memory; anything else as it is (the wrong-type cases: the
    buffer itself must refuse it)."""
    from pg_cases_gpu import to_gpu
    return to_gpu(t) if torch.is_tensor(t) else t


class GpuBuffer:
    """A Buffer in GPU memory (device="gpu": the device layer's simulation here) used through
    host tensors, so that the low-latency cases run unchanged on it: every tensor argument goes
    to GPU memory before the call (a handle's tensors too), every output comes back to a host
    tensor once the call, its event or its hook has completed, and active_ranks is copied back
    into the caller's tensor then (the kernels update the GPU copy in place). Host code never
    touches the GPU tensors (over the simulation that would fault); only the layer's copies do."""

    def __init__(self, buf):
        self.buf = buf

    @property
    def _impl(self):  # (follows the Buffer's: update_ep_member replaces it)
        return self.buf._impl

    @staticmethod
    def _back(pairs):
        from pg_cases_gpu import to_host
        def run():
            for host, dev in pairs:
                host.copy_(to_host(dev))
        return run

    @staticmethod
    def _finish(ev, hook, done, async_finish, return_recv_hook):
        if not async_finish and not return_recv_hook:
            done()
        return (_Then(ev, done) if ev is not None and not return_recv_hook else ev,
                _Then(hook, done) if hook is not None else hook)

    def dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                 num_experts, timeout_us=TIMEOUT_US, use_fp8=False, async_finish=False,
                 return_recv_hook=False):
        from mooncake.ep import EpHandle
        from pg_cases_gpu import to_gpu
        act = to_gpu(active_ranks)
        recv, cnt, handle, ev, hook = self.buf.dispatch(
            _dev(x), _dev(topk_idx), act, num_max_dispatch_tokens_per_rank, num_experts,
            timeout_us=timeout_us, use_fp8=use_fp8, async_finish=async_finish,
            return_recv_hook=return_recv_hook)
        devs = list(recv) if use_fp8 else [recv]
        devs += [cnt, handle[0], handle[1]]
        hosts = [torch.empty(d.shape, dtype=d.dtype) for d in devs]
        done = self._back(list(zip(hosts, devs)) + [(active_ranks, act)])
        ev, hook = self._finish(ev, hook, done, async_finish, return_recv_hook)
        n = 2 if use_fp8 else 1
        recv_h = tuple(hosts[:2]) if use_fp8 else hosts[0]
        h = EpHandle(hosts[n + 1], hosts[n + 2], *handle[2:])
        return recv_h, hosts[n], h, ev, hook

    def combine(self, y, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                zero_copy=False, async_finish=False, return_recv_hook=False, out=None):
        from mooncake.ep import EpHandle
        from pg_cases_gpu import to_gpu
        if isinstance(handle, EpHandle):
            handle = EpHandle(to_gpu(handle[0]), to_gpu(handle[1]), *handle[2:])
        act = to_gpu(active_ranks)
        dout = to_gpu(out) if out is not None else None
        o, ev, hook = self.buf.combine(
            _dev(y), _dev(topk_idx), _dev(topk_weights), act, timeout_us, handle,
            zero_copy=zero_copy, async_finish=async_finish, return_recv_hook=return_recv_hook,
            out=dout)
        host = out if out is not None else torch.empty(o.shape, dtype=o.dtype)
        done = self._back([(host, o), (active_ranks, act)])
        ev, hook = self._finish(ev, hook, done, async_finish, return_recv_hook)
        return host, ev, hook

    # ---- normal mode: synchronous, so the outputs come back at once ----
    @staticmethod
    def _each(handle, fn):
        from mooncake.ep import NormalHandle
        return NormalHandle(*(fn(t) if torch.is_tensor(t) else t for t in handle))

    def get_dispatch_layout(self, topk_idx, num_experts):
        from pg_cases_gpu import to_gpu, to_host
        return tuple(to_host(t) for t in self.buf.get_dispatch_layout(to_gpu(topk_idx),
                                                                       num_experts))

    def normal_dispatch(self, x, topk_idx, topk_weights, num_experts, expert_alignment=1,
                        handle=None):
        from pg_cases_gpu import to_gpu, to_host
        def g(t):
            return _dev(t)
        def back(t):
            return None if t is None else to_host(t)
        if handle is not None:
            handle = self._each(handle, to_gpu)
        recv_x, rt, rw, per, h = self.buf.normal_dispatch(
            g(x), g(topk_idx), g(topk_weights), num_experts, expert_alignment, handle=handle)
        return back(recv_x), back(rt), back(rw), back(per), self._each(h, to_host)

    def normal_combine(self, y, handle, topk_weights=None):
        from mooncake.ep import NormalHandle
        from pg_cases_gpu import to_gpu, to_host
        if isinstance(handle, NormalHandle):
            handle = self._each(handle, to_gpu)
        out, ow = self.buf.normal_combine(to_gpu(y), handle,
                                          None if topk_weights is None else to_gpu(topk_weights))
        return to_host(out), (None if ow is None else to_host(ow))


def _gpu_case(ctx, seed):
    """A case's config, its buffer, and a failure when that buffer is not in GPU memory."""
    cfg = Cfg(ctx.world, seed=seed)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    ok = isinstance(buf, GpuBuffer)
    return cfg, buf, [] if ok else ["EP_CASES_GPU is not set: the buffer is host memory"]


def case_gpu_buffer(ctx):
    """A buffer in GPU memory (run with EP_CASES_GPU=1, MC_DEVICE=sim): the kernels run its
    calls; a CPU tensor (either mode) and a bad expert id in GPU memory are refused with
    ValueError on every rank, and the rounds after them are in step."""
    import torch.distributed as dist
    from pg_cases_gpu import to_gpu
    R, me = ctx.world, ctx.rank
    cfg, buf, fails = _gpu_case(ctx, 61)
    if fails:
        return fails
    if buf._impl.low_latency_executor() != "kernels on sim device 0":
        fails.append(f"executor {buf._impl.low_latency_executor()!r}")
    if buf.buf.device != "gpu:0":
        fails.append(f"device {buf.buf.device!r}")
    x, topk, w = cfg.inputs(me)
    act = torch.ones(R, dtype=torch.int32)

    def expect(fn, what, needle):
        _expect_value_error(fails, fn, what, needle)

    expect(lambda: buf.buf.dispatch(x, to_gpu(topk), to_gpu(act), cfg.M, cfg.E),
           "a CPU x", "GPU memory")
    expect(lambda: buf.buf.dispatch(to_gpu(x), to_gpu(topk), act, cfg.M, cfg.E),
           "a CPU active_ranks", "active_ranks")
    bad = topk.clone()
    bad[0, 0] = cfg.E
    expect(lambda: buf.dispatch(x, bad, act, cfg.M, cfg.E), "expert id >= E in GPU memory",
           "expert id")
    expect(lambda: buf.buf.normal_dispatch(x, to_gpu(topk), to_gpu(w), cfg.E),
           "a CPU x in normal mode", "GPU memory")
    try:
        Buffer(dist.group.WORLD, 1 << 20, disable_p2p=True, device="gpu")
        fails.append("a GPU buffer with disable_p2p was made")
    except ValueError:
        pass
    # One rank cannot make its buffer (a device that does not exist): every rank's constructor
    # fails, naming it, instead of the others waiting in the exchange.
    t0 = time.time()
    try:
        Buffer(dist.group.WORLD, 1 << 20, device="gpu:9" if me == 0 else "gpu")
        fails.append("a buffer was made with rank 0 on a device that does not exist")
    except RuntimeError as ex:
        if "rank 0" not in str(ex):
            fails.append(f"the failed set-up does not name rank 0: {ex}")
    if time.time() - t0 > 10:
        fails.append(f"the failed set-up took {time.time() - t0:.1f} s")
    fails += ll_round(ctx, cfg, act, "after the refusals")
    # update_ep_member (collective): the GPU buffer built anew, peers' opened again.
    old = weakref.ref(buf._impl)
    buf.buf.update_ep_member()
    if old() is not None:
        fails.append("update_ep_member kept the native buffer")
    if buf._impl.low_latency_executor() != "kernels on sim device 0" or buf.buf.device != "gpu:0":
        fails.append(f"after update_ep_member: {buf._impl.low_latency_executor()!r} on "
                     f"{buf.buf.device!r}")
    fails += ll_round(ctx, cfg, act, "after update_ep_member")
    return fails + _upstream_buffer_on_gpu(ctx, cfg) + _hooks_in_flight(ctx, act)


def _upstream_buffer_on_gpu(ctx, cfg):
    """Mooncake EP's module path with the buffer in GPU memory (upstream's is always there):
    its calls take GPU tensors, and a missing active_ranks becomes all ranks in GPU memory."""
    import torch.distributed as dist
    from mooncake.mooncake_ep_buffer import Buffer as UpBuffer
    from pg_cases_gpu import to_gpu, to_host
    R, me = ctx.world, ctx.rank
    fails = []
    nbytes = UpBuffer.get_ep_buffer_size_hint(cfg.M, cfg.H, R, cfg.E)
    buf = UpBuffer(dist.group.WORLD, nbytes, device="gpu")
    if buf.runtime.device != "gpu:0":
        fails.append(f"upstream Buffer device {buf.runtime.device!r}")
    x, topk, w = cfg.inputs(me)
    act = torch.ones(R, dtype=torch.int32)
    recv_x, cnt, handle, ev, _ = buf.dispatch(to_gpu(x), to_gpu(topk), None, cfg.M, cfg.E, -1)
    ev.current_stream_wait()
    from mooncake.ep import EpHandle
    host_handle = EpHandle(to_host(handle[0]), to_host(handle[1]), *handle[2:])
    fails += check_ll_dispatch(cfg, me, to_host(recv_x), to_host(cnt), host_handle, act,
                               "upstream Buffer on GPU, dispatch")
    y = ll_y(cfg, me, to_host(recv_x), to_host(cnt))
    out, ev, _ = buf.combine(to_gpu(y), to_gpu(topk), to_gpu(w), None, -1, handle)
    ev.current_stream_wait()
    return fails + check_ll_combine(cfg, me, to_host(out), act, "upstream Buffer on GPU, combine")


def _hooks_in_flight(ctx, act):
    """Two dispatches in flight (hooks), the second with a larger E * M: the kernels' scratch
    grows between the first one's send and its receive, which must keep what the send left
    there (its own rows' counts; a stream-ordered call's outcome words)."""
    R, me = ctx.world, ctx.rank
    fails = []
    small, large = Cfg(R, M=16, E=4 * R, seed=62), Cfg(R, M=32, E=8 * R, seed=63)
    big = ctx.buffer(32, 96, 8 * R)
    xs, ts, ws = small.inputs(me)
    xl, tl, wl = large.inputs(me)
    rs = big.dispatch(xs, ts, act, small.M, small.E, return_recv_hook=True)
    rl = big.dispatch(xl, tl, act, large.M, large.E, return_recv_hook=True)
    rs[4]()
    rl[4]()
    fails += check_ll_dispatch(small, me, rs[0], rs[1], rs[2], act, "in flight, small")
    fails += check_ll_dispatch(large, me, rl[0], rl[1], rl[2], act, "in flight, large")
    out, _, _ = big.combine(ll_y(small, me, rs[0], rs[1]), ts, ws, act, TIMEOUT_US, rs[2])
    fails += check_ll_combine(small, me, out, act, "in flight, small")
    if act.tolist() != [1] * R:
        fails.append(f"active_ranks became {act.tolist()}")
    return fails


def case_across_hosts(ctx):
    """A GPU buffer whose group spans simulated hosts (MC_HOST_ID per rank): ranks on this
    host through IPC, the others through the buffer's host proxy over the engine. Rounds of
    both kinds on both halves, twice over (each stage reused) against the reference, normal
    mode rounds between them (the same stages, both halves: the proxy moves a normal call's
    blocks), and the hooks' two rounds in flight."""
    R = ctx.world
    cfg, buf, fails = _gpu_case(ctx, 81)
    if fails:
        return fails
    act = torch.ones(R, dtype=torch.int32)
    for i in range(4):
        fails += ll_round(ctx, Cfg(R, seed=82 + i), act, f"round {i}", async_finish=i % 2 == 1)
    # A normal round and two low-latency rounds, three times: normal mode on halves 1, 0, 1
    # of each kind, each stage it used then reused by the second low-latency round after it.
    for i in range(3):
        dtype = (torch.bfloat16, torch.float32)[i % 2]
        fails += normal_round(ctx, buf, Cfg(R, seed=90 + i, dtype=dtype), f"normal round {i}")
        for j in range(2):
            fails += ll_round(ctx, Cfg(R, seed=93 + 2 * i + j), act,
                              f"low latency {j} after normal round {i}")
    return fails + _hooks_in_flight(ctx, act)


def case_proxy_lags(ctx):
    """Run with MC_EP_PROXY_DELAY_MS on one rank, every rank on a host of its own: that rank's
    host proxy moves each send's rows late, so its sends run ahead of the moves. Four hooked
    dispatches, two in flight at a time (rounds R and R+2 share a stage, R+1 and R+3 the
    other), then their combines the same way: a send of a round two after another must wait
    until the proxy moved the earlier round's rows out of the stage (ep/ll_proxy.h,
    stageFree), or it overwrites the stage and its words before the proxy read them (the
    earlier round then reaches its peers wrong, or not at all). Against the reference on
    every rank; the delayed rank also checks that its dispatches took the delay."""
    R, me = ctx.world, ctx.rank
    _, buf, fails = _gpu_case(ctx, 101)
    if fails:
        return fails
    act = torch.ones(R, dtype=torch.int32)
    cfgs = [Cfg(R, seed=102 + i) for i in range(4)]
    ins = [c.inputs(me) for c in cfgs]
    got, t0 = [], time.time()
    for pair in ((0, 1), (2, 3)):
        calls = [buf.dispatch(ins[i][0], ins[i][1], act, cfgs[i].M, cfgs[i].E,
                              return_recv_hook=True) for i in pair]
        for c in calls:
            c[4]()
        got += calls
    # (The second pair's first send waits for the first one's move, which the proxy starts
    # `delay` after it was queued: a run in which the delay did not apply tests nothing.)
    delay = int(os.environ.get("MC_EP_PROXY_DELAY_MS", "0")) / 1000
    if delay > 0 and time.time() - t0 < delay:
        fails.append(f"the dispatches took {time.time() - t0:.3f}s: the proxy's delay of "
                     f"{delay}s did not hold them (MC_EP_PROXY_DELAY_MS not applied?)")
    for i, g in enumerate(got):
        fails += check_ll_dispatch(cfgs[i], me, g[0], g[1], g[2], act,
                                   f"lagging proxy, dispatch {i}")
    for pair in ((0, 1), (2, 3)):
        calls = [buf.combine(ll_y(cfgs[i], me, got[i][0], got[i][1]), ins[i][1], ins[i][2], act,
                             TIMEOUT_US, got[i][2], return_recv_hook=True) for i in pair]
        for i, c in zip(pair, calls):
            c[2]()
            fails += check_ll_combine(cfgs[i], me, c[0], act, f"lagging proxy, combine {i}")
    if act.tolist() != [1] * R:
        fails.append(f"active_ranks became {act.tolist()}")
    return fails


def case_stream_calls(ctx):
    """MC_EP_STREAM_CALLS=1 on a GPU buffer of the simulation: dispatch and combine queue the
    kernels on the buffer's stream and return without waiting on the host (a peer 0.6 s late
    holds no other rank's call), the outputs read after the stream passed equal the reference;
    a bad expert id (caught by the kernels) raises ValueError from the rank's next call and its
    event.wait(), rounds in step on every rank; a rank's shape error raises at once and its
    peers' next calls say it gave the round up; hooks in flight as on a waited buffer."""
    import torch.distributed as dist
    from mooncake.ep import EpHandle
    from pg_cases_gpu import to_gpu, to_host
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, seed=71)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    fails = []
    want = "kernels on sim device 0, stream-ordered"
    if buf._impl.low_latency_executor() != want:
        return [f"executor {buf._impl.low_latency_executor()!r}, want {want!r}"]
    x, topk, w = cfg.inputs(me)
    act = torch.ones(R, dtype=torch.int32)
    dx, dt, dw, da = to_gpu(x), to_gpu(topk), to_gpu(w), to_gpu(act)
    late = R - 1

    def timed(what, fn):
        dist.barrier()
        if me == late:
            time.sleep(0.6)
        t0 = time.time()
        res = fn()
        took = time.time() - t0
        if me != late and took > 0.3:
            fails.append(f"{what} took {took:.2f} s: it waited on the host for the late rank")
        return res

    recv, cnt, handle, _, _ = timed(
        "dispatch", lambda: buf.buf.dispatch(dx, dt, da, cfg.M, cfg.E, timeout_us=TIMEOUT_US))
    recv_h, cnt_h = to_host(recv), to_host(cnt)
    handle_h = EpHandle(to_host(handle[0]), to_host(handle[1]), *handle[2:])
    fails += check_ll_dispatch(cfg, me, recv_h, cnt_h, handle_h, act, "a late rank")
    y = to_gpu(ll_y(cfg, me, recv_h, cnt_h))
    out, _, _ = timed("combine", lambda: buf.buf.combine(y, dt, dw, da, TIMEOUT_US, handle))
    fails += check_ll_combine(cfg, me, to_host(out), act, "a late rank")

    # A failure the kernels find is raised by the first check after they ran: at the end of
    # the call itself when they were done by then, else by the next call or event.wait().
    def raised_once(what, steps, want_rank, exc, needles):
        got = []
        for step in steps:
            try:
                step()
            except exc as ex:
                got.append(str(ex))
        if me != want_rank and got:
            fails.append(f"{what}: rank {me} raised: {got}")
        if me == want_rank and (len(got) != 1 or not all(n in got[0] for n in needles)):
            fails.append(f"{what}: rank {me} raised {got}, want one error with {needles}")

    # Rank 0's topk_idx names an expert that does not exist: the kernels skip the entry, the
    # error is raised once (after the call that finds it queued its kernels: rounds in step).
    bad = topk.clone()
    bad[1, 0] = cfg.E
    raised_once("a bad expert id", [
        lambda: buf.dispatch(x, bad if me == 0 else topk, act, cfg.M, cfg.E),
        lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E)], 0, ValueError, ["token 1", "round"])
    fails += ll_round(ctx, cfg, act, "after a bad expert id")
    box = {}

    def async_bad():
        box["ev"] = buf.dispatch(x, bad if me == 0 else topk, act, cfg.M, cfg.E,
                                 async_finish=True)[3]
    raised_once("a bad expert id, async_finish", [
        async_bad, lambda: box["ev"].wait() if "ev" in box else None], 0, ValueError, ["token 1"])
    fails += ll_round(ctx, cfg, act, "after a bad expert id (event)")

    # The same with return_recv_hook and the hook dropped uncalled: what the send's kernels
    # found is still raised once, by a later call or its event's wait().
    later = {}

    def later_call():
        later["ev"] = buf.dispatch(x, topk, act, cfg.M, cfg.E, async_finish=True)[3]
    raised_once("a bad expert id, its hook dropped uncalled", [
        lambda: buf.dispatch(x, bad if me == 0 else topk, act, cfg.M, cfg.E,
                             return_recv_hook=True),
        later_call, lambda: later["ev"].wait() if "ev" in later else None], 0, ValueError,
        ["token 1"])
    fails += ll_round(ctx, cfg, act, "after a dropped hook's bad expert id")

    # Rank 0's combine handle places its own rows of local expert 0 outside the R*M rows: the
    # kernels read nothing there and report it (its peers' combines are right).
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, act, cfg.M, cfg.E)
    y_h = ll_y(cfg, me, recv_x, cnt)
    layout = handle[1].clone()
    if me == 0:
        layout[0, 0] = (R * cfg.M << 32) | (int(layout[0, 0]) & 0xFFFFFFFF)
    bad_handle = EpHandle(handle[0], layout, *handle[2:])
    outs = []
    raised_once("a handle out of its bounds", [
        lambda: outs.append(buf.combine(y_h, topk, w, act, TIMEOUT_US, bad_handle)[0]),
        lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E)], 0, ValueError,
        ["local expert 0", "out of its bounds"])
    if me != 0 and outs:
        fails += check_ll_combine(cfg, me, outs[0], act, "beside a bad handle")
    fails += ll_round(ctx, cfg, act, "after a handle out of its bounds")

    # Rank 0's handle sends a row of rank 1's block from outside M (src_info): rank 0's
    # kernels skip it (nothing written outside rank 1's rows) and report it; rank 1 finds one
    # row fewer than its topk_idx routes to rank 0.
    recv_x, cnt, handle, _, _ = buf.dispatch(x, topk, act, cfg.M, cfg.E)
    y_h = ll_y(cfg, me, recv_x, cnt)
    src = handle[0].clone()
    hit = [l for l in range(cfg.L) if int(handle[1][l, 1]) & 0xFFFFFFFF]
    if me == 0 and hit:
        src[hit[0], int(handle[1][hit[0], 1]) >> 32] = cfg.M
    if me == 0 and not hit:
        fails.append("no row of rank 1's to corrupt (another seed?)")
    bad_src = EpHandle(src, handle[1], *handle[2:])
    steps = [lambda: buf.combine(y_h, topk, w, act, TIMEOUT_US, bad_src),
             lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E)]
    if me == 1:
        raised_once("a row from outside M, seen by its destination", steps, 1, RuntimeError,
                    ["rank 0", "another number of rows"])
    else:
        raised_once("a row from outside M", steps, 0, ValueError,
                    [f"local expert {hit[0] if hit else '?'}", "out of its bounds"])
    fails += ll_round(ctx, cfg, act, "after a row from outside M")

    # Two calls of a kind in flight at most: a third dispatch while the first one's hook waits
    # is refused (ValueError, its round given up on every rank alike); a hook dropped without
    # being called frees its half.
    h1 = buf.dispatch(x, topk, act, cfg.M, cfg.E, return_recv_hook=True)[4]
    h2 = buf.dispatch(x, topk, act, cfg.M, cfg.E, return_recv_hook=True)[4]
    _expect_value_error(fails, lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E),
                        "a third dispatch in flight", "hook")
    h1()
    del h2
    fails += ll_round(ctx, cfg, act, "after a third call in flight")

    # A shape error raises at once; rank 0 gives its round up, which its peers' calls report.
    if me == 0:
        _expect_value_error(fails, lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E + 1),
                            "E % R != 0", "multiple")
        buf.dispatch(x, topk, act, cfg.M, cfg.E)
    else:
        raised_once("rank 0's round given up", [
            lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E),
            lambda: buf.dispatch(x, topk, act, cfg.M, cfg.E)], me, RuntimeError,
            ["rank 0", "gave up"])
    fails += ll_round(ctx, cfg, act, "after a round given up")
    if act.tolist() != [1] * R:
        fails.append(f"active_ranks became {act.tolist()}")
    return fails + _hooks_in_flight(ctx, act)


def _round_on(gbuf, cfg, me, active, tag):
    """One checked low-latency round on GpuBuffer gbuf (any M up to its bounds)."""
    x, topk, w = cfg.inputs(me)
    recv_x, cnt, handle, _, _ = gbuf.dispatch(x, topk, active, cfg.M, cfg.E)
    fails = check_ll_dispatch(cfg, me, recv_x, cnt, handle, active, tag)
    out, _, _ = gbuf.combine(ll_y(cfg, me, recv_x, cnt), topk, w, active, TIMEOUT_US, handle)
    return fails + check_ll_combine(cfg, me, out, active, tag)


def _capture(fails, what, fn):
    """fn() captured on the caller's stream (the simulation's copy stream): the graph, or None
    with a failure."""
    from mooncake import _C
    _C._device_capture_begin()
    try:
        fn()
    except Exception as ex:  # noqa: BLE001
        fails.append(f"capturing {what}: {type(ex).__name__}: {ex}")
    try:
        return _C._device_capture_end()
    except RuntimeError as ex:
        fails.append(f"capturing {what}: {ex}")
        return None


def case_graph_replay(ctx):
    """CUDA-graph capture over the simulation (stream-ordered calls): a dispatch captured into
    one graph and the combine of its outputs into another, then both launched again and again
    with new inputs written into the captured input tensors; every launch's outputs against the
    reference. Eager rounds run before, between (one needing more kernel scratch than the
    capture had: the graphs keep theirs) and after the launches, in step with them: the rounds
    are counted on the device. Normal mode (it waits on the host) is refused inside a capture."""
    from mooncake import _C
    from mooncake.ep import EpHandle
    from pg_cases_gpu import to_gpu, to_host
    R, me = ctx.world, ctx.rank
    fails = []
    big = Cfg(R, seed=40)  # M=24: the buffer's bounds
    gbuf = ctx.buffer(big.M, big.H, big.E)
    buf = gbuf.buf

    def small(seed):
        return Cfg(R, M=12, seed=seed)

    active = torch.ones(R, dtype=torch.int32)
    # (The inputs go to GPU memory before the capture: a host copy inside one invalidates it.)
    dx, dtopk, dw = (to_gpu(t) for t in small(41).inputs(me))
    _capture(fails, "a refused normal dispatch", lambda: _expect_value_error(
        fails, lambda: buf.normal_dispatch(dx, dtopk, dw, big.E),
        "normal_dispatch inside a capture", "CUDA-graph capture"))
    fails += _round_on(gbuf, small(42), me, active, "warm-up before the capture")
    c0 = small(43)
    x, topk, w = c0.inputs(me)
    dx, dtopk, dw, dact = to_gpu(x), to_gpu(topk), to_gpu(w), to_gpu(active)
    dy = to_gpu(torch.zeros((c0.L, R * c0.M, c0.H), dtype=c0.dtype))
    got = {}

    def dispatch():
        got["recv"], got["cnt"], got["handle"], _, _ = buf.dispatch(dx, dtopk, dact, c0.M, c0.E)

    def combine():
        got["out"] = buf.combine(dy, dtopk, dw, dact, TIMEOUT_US, got["handle"])[0]

    g_dispatch = _capture(fails, "a dispatch", dispatch)
    g_combine = _capture(fails, "a combine", combine) if "handle" in got else None
    if g_dispatch is None or g_combine is None:
        return fails

    def put(dev, host):
        _C._device_copy(dev.data_ptr(), host.contiguous().data_ptr(),
                        host.numel() * host.element_size())

    for i in range(4):
        c = small(50 + i)
        x, topk, w = c.inputs(me)
        for dev, host in ((dx, x), (dtopk, topk), (dw, w), (dact, active)):
            put(dev, host)
        _C._device_graph_launch(g_dispatch)
        recv, cnt = to_host(got["recv"]), to_host(got["cnt"])
        h = got["handle"]
        fails += check_ll_dispatch(c, me, recv, cnt, EpHandle(to_host(h[0]), to_host(h[1]), *h[2:]),
                                   active, f"launch {i}: dispatch")
        put(dy, ll_y(c, me, recv, cnt))
        _C._device_graph_launch(g_combine)
        fails += check_ll_combine(c, me, to_host(got["out"]), active, f"launch {i}: combine")
        if i == 1:
            fails += _round_on(gbuf, small(60), me, active, "eager between launches")
        if i == 2:
            fails += _round_on(gbuf, big, me, active, "eager, more scratch than the capture's")
    # A capture holds whole calls: a captured send's hook called after the capture is refused
    # (it would read what no send wrote); the next rounds are in step.
    hooked = {}
    _capture(fails, "a hooked dispatch", lambda: hooked.update(
        hook=buf.dispatch(dx, dtopk, dact, c0.M, c0.E, return_recv_hook=True)[4]))
    if "hook" in hooked:
        _expect_value_error(fails, hooked["hook"], "a captured send's hook called eagerly",
                            "CUDA-graph capture")
    return fails + _round_on(gbuf, small(61), me, active, "eager after the launches")
