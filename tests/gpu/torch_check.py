#!/usr/bin/env python3
"""The torch backend on GPU tensors, 2 processes on one device (scripts/gpu_check.sh runs it).

    torch_check.py --module-dir DIR --device cuda   on the GPU machine: CUDA tensors on cuda:0
    torch_check.py --module-dir DIR --device sim    here: tensors in the device layer's
                                                     simulated GPU memory (MC_DEVICE=sim)

DIR holds mc_torch_check (tests/gpu/torch_check_module.cc: the backend alone, built by
gpu_check.sh against the machine's torch); --package-dir DIR instead runs the checks through
the mooncake package of a CMake build (DIR = <build>/python). Every rank runs the collectives
and send/recv on GPU tensors and checks each result against what the inputs make (small
integers: exact in every dtype used); with CUDA it also checks that an op waits for the
kernels the caller queued before it on its current stream (a fill queued behind a 0.1 s GPU
sleep), that a kernel queued after Work.wait() sees the result, that wait() returned with the
op completed (the default, MC_PG_BLOCKING_WAIT=1) or, with MC_PG_BLOCKING_WAIT=0 in the
environment, without blocking the host (the stream gate), that a Work's future carries the
result, and times all_reduce, all_gather and all_to_all against the device's own
device-to-device copy rate. With --ep-hosts N (N ranks per simulated host, MC_HOST_ID) it runs
the EP check alone: a GPU buffer whose group spans hosts (the ranks of other hosts reached
through the buffer's host proxy, ep/ll_proxy.h). One JSON object per line on stdout (rank 0's);
exit status 0 when every check passed.
"""

import argparse
import faulthandler
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_stacks(pid):
    """Each thread of a rank that hangs: its name, kernel wait channel and kernel stack (where
    readable), and its native stack written by the rank itself (tests/gpu/crash_backtrace.c,
    preloaded by gpu_check.sh, on SIGUSR2 sent to that thread)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    lines = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return ""
    for tid in tids:
        info = []
        for f in ("comm", "wchan", "stack"):
            try:
                with open(f"/proc/{pid}/task/{tid}/{f}") as fh:
                    info.append(f"{f}: " + fh.read().strip().replace("\n", " | "))
            except OSError:
                pass
        lines.append(f"thread {tid}: " + "; ".join(info))
        if os.environ.get("LD_PRELOAD"):
            libc.syscall(234, pid, tid, 12)  # tgkill(pid, tid, SIGUSR2): x86-64 numbers
            time.sleep(0.2)
    return "\n".join(lines) + "\n"


def launch(a):
    port = free_port()
    env = dict(os.environ, MC_DEVICE=a.device, MC_SECRET=secrets.token_hex(16),
               OMP_NUM_THREADS="1")
    procs = []
    for r in range(a.world):
        where = (["--package-dir", a.package_dir] if a.package_dir else
                 ["--module-dir", a.module_dir])
        cmd = [sys.executable, os.path.abspath(__file__)] + where + [
               "--device", a.device, "--world", str(a.world), "--rank", str(r), "--port",
               str(port), "--timeout", str(a.timeout)] + (
                   ["--bench", "--bench-ops", a.bench_ops] if a.bench else []) + (
                   ["--ep-hosts", str(a.ep_hosts)] if a.ep_hosts else [])
        rank_env = dict(env, MC_HOST_ID=f"host-{r // a.ep_hosts}") if a.ep_hosts else env
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=rank_env))
    # One deadline for all ranks; a rank still running then is shown (its Python stacks, written
    # by faulthandler before the deadline, and its native ones where gdb is) and killed.
    deadline = time.monotonic() + a.timeout
    outs, rcs = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            stacks = thread_stacks(p.pid)
            gdb = shutil.which("gdb")
            if gdb:
                try:
                    stacks = subprocess.run(
                        [gdb, "-p", str(p.pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                        capture_output=True, text=True, timeout=60).stdout
                except subprocess.TimeoutExpired:
                    stacks = "(gdb took too long)"
            p.kill()
            outs.append(p.communicate()[0] + "\n[killed after the timeout]\n" + stacks)
        rcs.append(p.returncode)
    for r, out in enumerate(outs):
        for line in out.splitlines():
            if r == 0 and line.startswith("{"):
                print(line, flush=True)
            elif not line.startswith("{"):
                print(f"[rank {r}] {line}", file=sys.stderr)
    if any(rcs):
        print(json.dumps({"check": "torch_check", "ok": False, "detail": f"exit codes {rcs}"}))
        return 1
    return 0


def worker(a):
    # A hang shows where each thread is (stderr, which the launcher prints) before the deadline.
    faulthandler.dump_traceback_later(max(5.0, a.timeout - 40))
    t_start = time.monotonic()
    import torch
    import torch.distributed as dist

    def step(what):  # (progress, should it hang)
        print("step %s (%.1f s)" % (what, time.monotonic() - t_start), file=sys.stderr, flush=True)

    if a.package_dir:  # the package itself: importing it registers "mooncake"
        sys.path.insert(0, a.package_dir)
        import mooncake
        M = mooncake._C
        step("mooncake imported from " + os.path.dirname(mooncake.__file__))
    else:
        sys.path.insert(0, a.module_dir)
        import mc_torch_check as M

        def creator(store, rank, size, timeout):
            step("creating the backend")
            pg = M.ProcessGroupMooncake(store, rank, size, timeout)
            step("backend created")
            return pg

        try:
            dist.Backend.register_backend("mooncake", creator, devices=list(M.DEVICES))
        except TypeError:  # torch 1.13: no devices argument
            dist.Backend.register_backend("mooncake", creator)
    try:
        dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world)
    except RuntimeError as e:  # a torch built without libuv (Debian's 2.6) asks for the old store
        if "libuv" not in str(e):
            raise
        os.environ["USE_LIBUV"] = "0"
        dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world)
    step("group initialised")
    W, me, cuda = a.world, a.rank, a.device == "cuda"
    rows, failed = [], [False]

    def row(d):
        rows.append(d)
        if d.get("ok") is False:
            failed[0] = True
        print("row " + json.dumps(d), file=sys.stderr, flush=True)  # (progress, should it hang)

    if cuda:
        torch.cuda.set_device(0)  # every rank on GPU 0: CUDA IPC works within one device

        def gpu(t):
            return t.to("cuda")

        def host(t):
            return t.cpu()
    else:
        assert M._device_layer() == "sim"

        def gpu(t):
            d = M._device_empty_like(t)
            if t.numel():
                M._device_copy(d.data_ptr(), t.contiguous().data_ptr(), t.numel() * t.element_size())
            return d

        def host(d):
            t = torch.empty(d.shape, dtype=d.dtype)
            if t.numel():
                M._device_copy(t.data_ptr(), d.data_ptr(), t.numel() * t.element_size())
            return t

    def stream_ops():  # stream-ordered ops this rank issued (None: the module cannot say)
        g = dist.distributed_c10d._get_default_group()
        be = g._get_backend(torch.device("cuda" if cuda else "cpu")) \
            if hasattr(g, "_get_backend") else g
        f = getattr(be, "_stream_ops", None)
        return f() if f else None

    def inp(r, n, dt=torch.float32, salt=0):
        return ((torch.arange(n, dtype=torch.int64) * (salt + 1) + 7 * r) % 17).to(dt)

    def check(name, got, exp):
        ok = got.shape == exp.shape and torch.equal(got, exp)
        row({"check": name, "ok": bool(ok)})

    ag = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
    rs = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
    streamed = {}  # op -> stream-ordered ops its calls issued (pg/stream_ops.h)

    def counted(name, call):
        before = stream_ops()
        call()
        if before is not None:
            streamed[name] = streamed.get(name, 0) + stream_ops() - before

    def finish():
        dist.barrier()
        if me == 0:
            for r in rows:
                print(json.dumps(r), flush=True)
        dist.destroy_process_group()
        return 1 if failed[0] else 0

    if a.ep_hosts:  # the EP check alone, its group spanning simulated hosts
        ep_check(torch, dist, M, gpu, host, cuda, W, me, row, False, spans_hosts=True)
        return finish()

    for n in (4099, 1 << 20):
        for dt, op, name in ((torch.float32, dist.ReduceOp.SUM, "sum"),
                             (torch.bfloat16, dist.ReduceOp.SUM, "sum"),
                             (torch.int64, dist.ReduceOp.MAX, "max")):
            x = gpu(inp(me, n, dt))
            counted("all_reduce", lambda: dist.all_reduce(x, op=op))
            ins = torch.stack([inp(r, n, dt) for r in range(W)])
            exp = ins.sum(0).to(dt) if name == "sum" else ins.max(0).values
            check(f"all_reduce {name} {dt} n={n}", host(x), exp)
        x = gpu(inp(me, n, salt=1))
        counted("broadcast", lambda: dist.broadcast(x, W - 1))
        check(f"broadcast n={n}", host(x), inp(W - 1, n, salt=1))
        x = gpu(inp(me, n, salt=7))
        counted("reduce", lambda: dist.reduce(x, W - 1))
        if me == W - 1:
            check(f"reduce n={n}", host(x), sum(inp(r, n, salt=7) for r in range(W)))
        outs = [gpu(torch.zeros(n)) for _ in range(W)] if me == 0 else None
        counted("gather", lambda: dist.gather(gpu(inp(me, n, salt=8)), outs, dst=0))
        if me == 0:
            check(f"gather n={n}", torch.cat([host(o) for o in outs]),
                  torch.cat([inp(r, n, salt=8) for r in range(W)]))
        out = gpu(torch.zeros(n))
        blocks = [gpu(inp(k, n, salt=9)) for k in range(W)] if me == W - 1 else None
        counted("scatter", lambda: dist.scatter(out, blocks, src=W - 1))
        check(f"scatter n={n}", host(out), inp(me, n, salt=9))
        out = gpu(torch.zeros(n))
        counted("reduce_scatter", lambda: dist.reduce_scatter(
            out, [gpu(inp(me, n, salt=10 + k)) for k in range(W)]))
        check(f"reduce_scatter list n={n}", host(out),
              sum(inp(r, n, salt=10 + me) for r in range(W)))
        out = gpu(torch.zeros(W * n))
        counted("all_gather_into_tensor", lambda: ag(out, gpu(inp(me, n, salt=2))))
        check(f"all_gather_into_tensor n={n}", host(out),
              torch.cat([inp(r, n, salt=2) for r in range(W)]))
        outs = [gpu(torch.zeros(n)) for _ in range(W)]
        counted("all_gather", lambda: dist.all_gather(outs, gpu(inp(me, n, salt=3))))
        check(f"all_gather list n={n}", torch.cat([host(o) for o in outs]),
              torch.cat([inp(r, n, salt=3) for r in range(W)]))
        out = gpu(torch.zeros(n))
        counted("reduce_scatter_tensor",
                lambda: rs(out, gpu(torch.cat([inp(me, n, salt=4 + k) for k in range(W)]))))
        check(f"reduce_scatter_tensor n={n}", host(out),
              sum(inp(r, n, salt=4 + me) for r in range(W)))
        # all_to_all_single, uneven: rank k sends (k + j + 1) * 3 elements to rank j.
        sizes_in = [(me + j + 1) * 3 for j in range(W)]
        sizes_out = [(k + me + 1) * 3 for k in range(W)]
        src = inp(me, sum(sizes_in), salt=5)
        out = gpu(torch.zeros(sum(sizes_out)))
        counted("all_to_all_single with splits",
                lambda: dist.all_to_all_single(out, gpu(src), sizes_out, sizes_in))
        exp = []
        for k in range(W):
            sk = [(k + j + 1) * 3 for j in range(W)]
            exp.append(inp(k, sum(sk), salt=5)[sum(sk[:me]):sum(sk[:me + 1])])
        check(f"all_to_all_single uneven n={n}", host(out), torch.cat(exp))
        got = gpu(torch.zeros(n))
        reqs = []
        counted("send/recv", lambda: reqs.extend([dist.isend(gpu(inp(me, n, salt=6)), (me + 1) % W),
                                                  dist.irecv(got, (me - 1) % W)]))
        for q in reqs:
            q.wait()
        check(f"send/recv ring n={n}", host(got), inp((me - 1) % W, n, salt=6))
        # batch_isend_irecv (on CUDA with torch 2.x: through the coalescing manager, one Work
        # whose wait() orders the caller's stream after every part).
        got = gpu(torch.zeros(n))
        p2p_ops = [dist.P2POp(dist.isend, gpu(inp(me, n, salt=8)), (me + 1) % W),
                   dist.P2POp(dist.irecv, got, (me - 1) % W)]
        reqs = []
        counted("batch_isend_irecv", lambda: reqs.extend(dist.batch_isend_irecv(p2p_ops)))
        for q in reqs:
            q.wait()
        check(f"batch_isend_irecv ring n={n}", host(got), inp((me - 1) % W, n, salt=8))
    dist.barrier()
    # On one host every collective above and send/recv are stream-ordered, one stream-ordered
    # op a call (none with MC_PG_STREAM_OPS=0, nor by default on the simulation).
    if streamed:
        mode = os.environ.get("MC_PG_STREAM_OPS", "auto")
        on = mode == "1" or (mode == "auto" and cuda)
        calls = {"all_reduce": 3, "send/recv": 2, "batch_isend_irecv": 2}
        want = {k: (0 if not on else 2 * calls.get(k, 1)) for k in streamed}
        row({"check": "which collectives are stream-ordered (MC_PG_STREAM_OPS)",
             "ok": streamed == want, "detail": "got %s, expected %s" % (streamed, want)})

    try:
        dist.all_reduce(gpu(torch.zeros(8, 8)).t())
        row({"check": "non-contiguous GPU tensor refused", "ok": False, "detail": "no error"})
    except ValueError as e:
        row({"check": "non-contiguous GPU tensor refused", "ok": "contiguous" in str(e),
             "detail": str(e)[:200]})

    if cuda:
        # The op must wait for what the caller queued before it on its current stream: a fill
        # queued behind a 0.1 s GPU sleep, on a side stream.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(200_000_000)
            x.fill_(me + 1)
            dist.all_reduce(x)
            got = x.cpu()
        check("all_reduce waits for the caller's stream", got,
              torch.full((1 << 20,), float(W * (W + 1) // 2)))
        # Work.wait() makes the current stream wait, not the host (as NCCL's): with the op held
        # behind a GPU sleep on the stream, wait() returns long before the sleep ends, the op is
        # not complete then, and a kernel queued after wait() sees the reduced values.
        cycles = 400_000_000
        t0 = time.time()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        sleep_s = time.time() - t0
        ops_before = stream_ops()
        with torch.cuda.stream(s):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(cycles)
            x.fill_(me + 1)
            t0 = time.time()
            w = dist.all_reduce(x, async_op=True)
            w.wait()
            wait_s = time.time() - t0
            done_then = w.is_completed()
            y = x * 2
            got = y.cpu()
        check("Work.wait() orders the stream: a kernel after it sees the result", got,
              torch.full((1 << 20,), float(W * (W + 1))))
        detail = "wait %.4f s, the stream's sleep %.4f s, completed when wait returned: %s" % (
            wait_s, sleep_s, done_then)
        # allreduce of CUDA tensors is queued on the stream (pg/stream_ops.h) unless
        # MC_PG_STREAM_OPS=0; then wait() never blocks the host.
        on_stream = ops_before is not None and stream_ops() > ops_before
        want_stream = os.environ.get("MC_PG_STREAM_OPS", "auto") != "0"
        row({"check": "all_reduce of CUDA tensors is stream-ordered (MC_PG_STREAM_OPS)",
             "ok": on_stream == want_stream,
             "detail": "stream-ordered: %s, MC_PG_STREAM_OPS=%s" % (
                 on_stream, os.environ.get("MC_PG_STREAM_OPS", "auto"))})
        if on_stream:
            row({"check": "Work.wait() of a stream-ordered all_reduce does not block the host",
                 "ok": wait_s < 0.5 * sleep_s and not done_then, "detail": detail})
        elif os.environ.get("MC_PG_BLOCKING_WAIT", "1") == "0":  # the gate (docs/gpu.md)
            row({"check": "Work.wait() does not block the host", "ok": wait_s < 0.5 * sleep_s
                 and not done_then, "detail": detail})
        else:  # the default: wait() returns when the op has completed
            row({"check": "Work.wait() blocks until the op completed", "ok": bool(done_then),
                 "detail": detail})
        x = gpu(inp(me, 4099))
        fut = dist.all_reduce(x, async_op=True).get_future()
        res = fut.wait()
        check("Work future carries the result", res[0].cpu(), sum(inp(r, 4099) for r in range(W)))

    if hasattr(M, "EpBuffer"):
        ep_check(torch, dist, M, gpu, host, cuda, W, me, row, a.bench)
    else:
        row({"check": "ep on a GPU buffer", "ok": False, "detail": "the module has no EpBuffer"})
    if a.bench:
        bench(torch, dist, ag, gpu, cuda, W, me, row, a.bench_ops.split(","))
    return finish()


def ep_check(torch, dist, M, gpu, host, cuda, W, me, row, timed, spans_hosts=False):
    """mooncake.ep on a buffer in GPU memory (EpBuffer device 0: the kernels' entry points
    ep/kernels/ll_entry.cu, or the simulation's form of them) against a buffer in host memory
    (the CPU path) on the same inputs: low latency (recv_count, every received row, src_info,
    layout_range and the combined rows, in bf16 and fp8) and normal mode (every output of
    dispatch and combine) equal bit for bit. Timed (cuda, --bench): low-latency dispatch and
    combine p50 at 128 x 7168 x top-8, E = 8 per rank. spans_hosts: the group spans simulated
    hosts (the host proxy), both modes against the host buffer."""
    pg = dist.distributed_c10d._get_default_group()
    backend = pg
    if hasattr(pg, "_get_backend"):  # torch >= 2.1: the facade over the backends
        backend = pg._get_backend(torch.device("cuda" if cuda else "cpu"))
    T, H, K = (128, 7168, 8) if cuda else (32, 512, 4)
    E = 8 * W
    L = E // W
    nbytes = M.EpBuffer.size_hint(T, H, W, E)
    cpu_buf = M.EpBuffer(backend, nbytes, False, -1, False)
    gpu_buf = M.EpBuffer(backend, nbytes, False, 0, cuda)
    row({"check": "ep GPU buffer executor", "ok": gpu_buf.low_latency_executor().startswith(
        "kernels on " + ("cuda" if cuda else "sim")), "detail": gpu_buf.low_latency_executor()})

    def inputs(r, seed):
        g = torch.Generator().manual_seed(seed * 7919 + r)
        x = (torch.randn((T, H), generator=g) * 3).to(torch.bfloat16)
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        topk[torch.rand((T, K), generator=g) < 0.1] = -1
        w = torch.rand((T, K), generator=g)
        return x, topk.to(torch.int64), w

    def round_on(buf, on_gpu, x, topk, w, fp8):
        put = gpu if on_gpu else (lambda t: t)
        act = put(torch.ones(W, dtype=torch.int32))
        rx, scales, cnt, src, lay, _, _ = buf.dispatch(put(x), put(topk), act, T, E, 10_000_000,
                                                       fp8, False, False)
        # The experts' outputs: each received row scaled by its expert (on the host, so that
        # both buffers combine the same bytes).
        cnt_h, rx_h = host(cnt) if on_gpu else cnt, host(rx) if on_gpu else rx
        y = torch.zeros((L, W * T, H), dtype=torch.bfloat16)
        for l in range(L):
            n = int(cnt_h[l])
            if fp8:  # (any rows: what matters is that both buffers combine the same ones)
                y[l, :n] = ((torch.arange(n * H) % 251).view(n, H).float() / 64 - 2 + me + l
                            ).to(torch.bfloat16)
            else:
                y[l, :n] = (rx_h[l, :n].float() * (1 + (me * L + l) / 8)).to(torch.bfloat16)
        out, _, _ = buf.combine(put(y), put(topk), put(w), act, 10_000_000, src, lay, T, H, E,
                                False, False, None)
        got = [cnt, rx, src, lay, out] + ([scales] if fp8 else [])
        return [host(t) if on_gpu else t for t in got]

    ok, detail = True, ""
    for fp8 in (False, True):
        x, topk, w = inputs(me, 5 + fp8)
        ref = round_on(cpu_buf, False, x, topk, w, fp8)
        got = round_on(gpu_buf, True, x, topk, w, fp8)
        cnt = ref[0]
        same = torch.equal(got[0], cnt) and torch.equal(got[3], ref[3])
        for l in range(L):  # rows past recv_count are not the call's
            n = int(cnt[l])
            same = same and torch.equal(got[1][l, :n].view(torch.uint8),
                                        ref[1][l, :n].view(torch.uint8))
            same = same and torch.equal(got[2][l, :n], ref[2][l, :n])
            if fp8:
                same = same and torch.equal(got[5][l, :n], ref[5][l, :n])
        same = same and torch.equal(got[4].view(torch.int16), ref[4].view(torch.int16))
        if not same:
            ok, detail = False, detail + ("fp8 " if fp8 else "bf16 ") + "differs; "
    row({"check": "ep on a GPU buffer equals the host buffer (bf16, fp8)", "ok": ok,
         "detail": detail or "T=%d H=%d K=%d E=%d" % (T, H, K, E)})

    # Normal mode: dispatch (topk_idx and weights, expert alignment 4) and combine.
    def normal_on(buf, on_gpu, x, topk, w):
        put = gpu if on_gpu else (lambda t: t)
        back = host if on_gpu else (lambda t: t)
        rx, rt, rw, per, src, counts, in_rank = buf.normal_dispatch(put(x), put(topk), put(w), E,
                                                                    4, None)
        y = (back(rx).float() * (1 + me / 8)).to(torch.bfloat16)
        out, out_w = buf.normal_combine(put(y), counts, in_rank, rw)
        return [back(t) for t in (rx, rt, rw, per, src, counts, in_rank, out, out_w)]

    x, topk, w = inputs(me, 7)
    ref = normal_on(cpu_buf, False, x, topk, w)
    got = normal_on(gpu_buf, True, x, topk, w)
    def bits(t):  # (bf16 compared as its bytes: bit for bit)
        return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t

    same = all(g.shape == r.shape and torch.equal(bits(g), bits(r)) for g, r in zip(got, ref))
    row({"check": "ep normal mode on a GPU buffer equals the host buffer"
                  + (" (across hosts)" if spans_hosts else ""), "ok": bool(same),
         "detail": "rows received %d" % int(ref[0].shape[0])})
    if spans_hosts:
        return
    if cuda and gpu_buf.low_latency_executor().endswith("stream-ordered"):
        # Stream-ordered calls (MC_EP_STREAM_CALLS, on with CUDA): with a GPU sleep queued
        # before it on the current stream, dispatch returns long before the sleep ends, and
        # what it received (read after it, on that stream) equals the host buffer's.
        x, topk, w = inputs(me, 5)
        ref = round_on(cpu_buf, False, x, topk, w, False)
        xg, tg, wg = gpu(x), gpu(topk), gpu(w)
        act = gpu(torch.ones(W, dtype=torch.int32))
        cycles = 400_000_000
        torch.cuda.synchronize()
        t0 = time.time()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        sleep_s = time.time() - t0
        torch.cuda._sleep(cycles)
        t0 = time.time()
        rx, _, cnt, src, lay, _, _ = gpu_buf.dispatch(xg, tg, act, T, E, 10_000_000, False,
                                                      False, False)
        call_s = time.time() - t0
        same = torch.equal(host(cnt), ref[0])
        out, _, _ = gpu_buf.combine(rx, tg, wg, act, 10_000_000, src, lay, T, H, E, False, False,
                                    None)
        host(out)
        row({"check": "ep dispatch is stream-ordered (no host wait)",
             "ok": call_s < 0.5 * sleep_s and same,
             "detail": "call %.4f s, the stream's sleep before it %.4f s, recv_count equal: %s"
                       % (call_s, sleep_s, same)})
        for r in ep_graph_check(torch, cpu_buf, gpu_buf, gpu, host, inputs, W, T, H, E, timed):
            row(r)
    if not (timed and cuda):
        return
    x, topk, w = inputs(me, 9)
    xg, tg, wg = gpu(x), gpu(topk), gpu(w)
    act = gpu(torch.ones(W, dtype=torch.int32))
    # Each call and the kernels it queued (synchronised after it: a stream-ordered call returns
    # before its kernels ran); the host's part alone as *_call_p50_us.
    ts_d, ts_c, call_d, call_c = [], [], [], []
    for i in range(23):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rx, _, cnt, src, lay, _, _ = gpu_buf.dispatch(xg, tg, act, T, E, 10_000_000, False, False,
                                                      False)
        tc = time.perf_counter()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out, _, _ = gpu_buf.combine(rx, tg, wg, act, 10_000_000, src, lay, T, H, E, False, False,
                                    None)
        tc2 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            ts_d.append(t1 - t0)
            ts_c.append(t2 - t1)
            call_d.append(tc - t0)
            call_c.append(tc2 - t1)
    for v in (ts_d, ts_c, call_d, call_c):
        v.sort()
    row({"bench": "ep ll on a GPU buffer", "tokens": T, "hidden": H, "topk": K, "experts": E,
         "world": W, "executor": gpu_buf.low_latency_executor(),
         "dispatch_p50_us": ts_d[len(ts_d) // 2] * 1e6,
         "combine_p50_us": ts_c[len(ts_c) // 2] * 1e6,
         "dispatch_call_p50_us": call_d[len(call_d) // 2] * 1e6,
         "combine_call_p50_us": call_c[len(call_c) // 2] * 1e6})


def ep_graph_check(torch, cpu_buf, gpu_buf, gpu, host, inputs, W, T, H, E, timed):
    """docs/ep.md, "CUDA graphs": a dispatch and the combine of what it received (y = recv_x)
    captured with torch.cuda.graph after eager calls of the same shapes (the kernels' scratch
    sized), launched three times with new inputs copied into the captured tensors; every
    launch's recv_count and combined rows equal the host buffer's on the same inputs. Rows
    to report; timed: also the graph's launch (dispatch + combine) p50 against the same two
    calls made eagerly, each synchronised, alternately."""
    me = torch.distributed.get_rank()

    def plain(buf, x, topk, w, act):
        rx, _, cnt, src, lay, _, _ = buf.dispatch(x, topk, act, T, E, 10_000_000, False, False,
                                                  False)
        out, _, _ = buf.combine(rx, topk, w, act, 10_000_000, src, lay, T, H, E, False, False,
                                None)
        return cnt, out

    x, topk, w = inputs(me, 21)
    sx, st, sw, sact = gpu(x), gpu(topk), gpu(w), gpu(torch.ones(W, dtype=torch.int32))
    plain(gpu_buf, sx, st, sw, sact)  # (eager: the scratch of these shapes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            cnt, out = plain(gpu_buf, sx, st, sw, sact)
    except Exception as ex:  # noqa: BLE001
        return [{"check": "ep calls captured in a CUDA graph", "ok": False,
                 "detail": "capture: %s: %s" % (type(ex).__name__, ex)}]
    same, detail = True, []
    for seed in (22, 23, 24):
        x, topk, w = inputs(me, seed)
        ref_cnt, ref_out = plain(cpu_buf, x, topk, w, torch.ones(W, dtype=torch.int32))
        for dst, src in ((sx, x), (st, topk), (sw, w)):
            dst.copy_(gpu(src))
        sact.fill_(1)
        graph.replay()
        ok = torch.equal(host(cnt), ref_cnt) and torch.equal(host(out).view(torch.int16),
                                                             ref_out.view(torch.int16))
        same = same and ok
        detail.append("launch %d %s" % (seed - 21, "equal" if ok else "differs"))
    rows = [{"check": "ep calls captured in a CUDA graph replay as the host buffer computes",
             "ok": same, "detail": ", ".join(detail)}]
    if not (timed and same):
        return rows
    ts_g, ts_e = [], []
    for i in range(43):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        plain(gpu_buf, sx, st, sw, sact)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            ts_g.append(t1 - t0)
            ts_e.append(t2 - t1)
    ts_g.sort()
    ts_e.sort()
    rows.append({"bench": "ep ll dispatch + combine as a CUDA graph", "tokens": T, "hidden": H,
                 "experts": E, "world": W, "graph_p50_us": ts_g[len(ts_g) // 2] * 1e6,
                 "eager_p50_us": ts_e[len(ts_e) // 2] * 1e6})
    return rows


def bench(torch, dist, ag, gpu, cuda, W, me, row, only):
    """all_reduce, all_gather, all_to_all on GPU tensors, 64 KiB .. 256 MiB (sim: .. 1 MiB,
    against host tensors), median time of rank 0; with CUDA, against the device's own 256 MiB
    device-to-device copy rate."""
    sizes = [64 << 10, 1 << 20, 16 << 20, 256 << 20] if cuda else [64 << 10, 1 << 20]
    limit = None
    if cuda:
        src = torch.ones(64 << 20, device="cuda")
        dst = torch.empty_like(src)
        best = None
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            t = e0.elapsed_time(e1) / 1e3
            best = t if best is None else min(best, t)
        limit = (256 << 20) / best / 1e9  # bytes read (== written) per second
        del src, dst
        row({"bench": "d2d_copy", "bytes": 256 << 20, "gbps": round(limit, 2)})
    factor = {"all_reduce": 2 * (W - 1) / W, "all_gather": (W - 1) / W, "all_to_all": (W - 1) / W}
    for nbytes in sizes:
        n = nbytes // 4
        for where in (["cuda"] if cuda else ["sim", "cpu"]):
            mk = gpu if where != "cpu" else (lambda t: t)
            x = mk(torch.zeros(n))
            send, out = mk(torch.zeros(n // W)), mk(torch.zeros(n))
            a2a_in = mk(torch.zeros(n))
            ops = {"all_reduce": lambda: dist.all_reduce(x),
                   "all_gather": lambda: ag(out, send),
                   "all_to_all": lambda: dist.all_to_all_single(out, a2a_in)}
            for op, fn in ops.items():
                if op not in only:
                    continue
                iters = 5 if nbytes >= (16 << 20) else 30
                fn()
                ts = []
                for _ in range(iters):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if cuda:
                        torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
                t = sorted(ts)[len(ts) // 2]
                busbw = nbytes / t / 1e9 * factor[op]
                r = {"bench": op, "device": where, "world": W, "bytes": nbytes,
                     "stream_ops": os.environ.get("MC_PG_STREAM_OPS", "auto"),
                     "time_us": round(t * 1e6, 1), "busbw_gbps": round(busbw, 3)}
                if limit:
                    r["vs_d2d"] = round(busbw / limit, 3)
                row(r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--module-dir", help="holds mc_torch_check (the backend alone)")
    where.add_argument("--package-dir", help="holds the mooncake package (<build>/python of a "
                       "CMake build): the checks run through it")
    ap.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-ops", default="all_reduce,all_gather,all_to_all",
                    help="the ops --bench times")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--ep-hosts", type=int, default=0,
                    help="ranks per simulated host: the EP check alone, across hosts")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    a = ap.parse_args()
    return worker(a) if a.rank is not None else launch(a)


if __name__ == "__main__":
    sys.exit(main())
