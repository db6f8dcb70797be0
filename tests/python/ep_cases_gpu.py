"""EP on buffers in GPU memory (the device layer's simulation here, MC_DEVICE=sim): the proxy
through which the cases of ep_cases.py run unchanged on such a buffer (ep_cases.Ctx.buffer
makes it when EP_CASES_GPU=1), and the GPU buffer's own case. Run by _ep_worker.py, as
ep_cases.py's cases.
"""

import time

import torch

from ep_cases import (TIMEOUT_US, Cfg, _expect_value_error, check_ll_combine, check_ll_dispatch,
                      ll_round, ll_y)
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


class GpuBuffer:
    """A Buffer in GPU memory (device="gpu": the device layer's simulation here) used through
    host tensors, so that the low-latency cases run unchanged on it: every tensor argument goes
    to GPU memory before the call (a handle's tensors too), every output comes back to a host
    tensor once the call, its event or its hook has completed, and active_ranks is copied back
    into the caller's tensor then (the kernels update the GPU copy in place). Host code never
    touches the GPU tensors (over the simulation that would fault); only the layer's copies do."""

    def __init__(self, buf):
        self.buf = buf
        self._impl = buf._impl

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
            to_gpu(x), to_gpu(topk_idx), act, num_max_dispatch_tokens_per_rank, num_experts,
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
            to_gpu(y), to_gpu(topk_idx), to_gpu(topk_weights), act, timeout_us, handle,
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
            return None if t is None else to_gpu(t)
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


def case_gpu_buffer(ctx):
    """A buffer in GPU memory (run with EP_CASES_GPU=1, MC_DEVICE=sim): the kernels run its
    calls; a CPU tensor (either mode) and a bad expert id in GPU memory are refused with
    ValueError on every rank, and the rounds after them are in step."""
    import torch.distributed as dist
    from pg_cases_gpu import to_gpu
    R, me = ctx.world, ctx.rank
    cfg = Cfg(R, seed=61)
    buf = ctx.buffer(cfg.M, cfg.H, cfg.E)
    fails = []
    if not isinstance(buf, GpuBuffer):
        return ["EP_CASES_GPU is not set: the buffer is host memory"]
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
    # Two dispatches in flight (hooks), the second with a larger E * M: the kernels' scratch
    # grows between the first one's send and its receive, which must keep what the send left
    # there (its own rows' counts).
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
