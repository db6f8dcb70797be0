#!/usr/bin/python3
"""EP dispatch/combine benchmark: mooncake.ep against an all_to_all_single reference over a
gloo group, measured in the same run (the same processes, inputs and routing).

    /usr/bin/python3 benchmarks/ep_bench.py --world-sizes 2,4 --tokens 128 --hidden 7168 \
        --topk 8 --experts 64 --dtype bfloat16 --json ep.json

For each world size W it starts W rank processes on this host; each creates the default
group with backend "mooncake" and a gloo group over the same ranks. Phases: dispatch,
combine and both (dispatch + combine in one timed region), in low-latency mode ("ll": one
row per (token, expert)) and normal mode ("normal": one row per (token, destination rank)).

Reference ("gloo_ref"), the way Megatron's all-to-all token dispatcher does it: permute the
rows by destination (index_select), exchange per-rank counts with all_to_all_single, then
the rows with all_to_all_single, then sort the received chunks by local expert; combine
reverses it and sums the weighted rows per token (index_add_ in float32).

Timing: the two implementations alternate iteration by iteration (both see the same load);
every phase starts after a gloo barrier; a rank's time is its own wall time for the phase;
an iteration's time is the maximum over ranks; p50/p99 are over iterations.
gbps = payload bytes this rank sends in the phase (rows x H x element size, ll: one per
(token, expert), normal: one per (token, destination rank)) / p50 time.
JSON: a list of {"impl", "mode", "phase", "world_size", "p50_us", "p99_us", "gbps"} plus the
problem's parameters ("hosts": true with --hosts).

--hosts puts each rank on a simulated host (MC_HOST_ID), so that mooncake reaches every peer
through the engine's one-sided writes and notifications (tcp here) instead of mapped memory.

--device cuda (or gpu: the engine's device layer, MC_DEVICE=sim here) puts the buffer and every
tensor in GPU memory (Buffer(..., device=...), docs/ep.md "GPU buffers"; all ranks on
device 0). The reference is then "copy_ref": one device-to-device copy of
the phase's payload bytes (a phase of "both": two), timed the same way in the same processes
-- the device's copy rate, the limit the issue holds the kernels to. Over the simulation its
numbers say nothing about a GPU. A low-latency phase's time includes its kernels: a
stream-ordered call (MC_EP_STREAM_CALLS, on with CUDA) returns before they ran, so the phase
waits for its output (the device synchronised, or a copy behind it over the simulation).

Mode "ll_fp8" (--modes ll_fp8, bfloat16 only, hidden a multiple of 128): mooncake dispatches
with use_fp8=True (DeepEP's e4m3 rows with per-128-channel float32 scales: H + H/32 bytes a
row, quantized by the sender) and combines bf16 expert outputs of the received shape; the
reference is the gloo bf16 path of "ll" (no fp8 reference exists here), so its ratio is what
a user gains from fp8 against the bf16 all-to-all, not an fp8-against-fp8 comparison. Its
dispatch gbps counts the fp8 bytes.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

IMPLS = ("mooncake", "gloo_ref")
MODES = ("ll", "normal")
PHASES = ("dispatch", "combine", "both")


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (= M)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="ll,normal", help="ll, normal, ll_fp8 (comma list)")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--hosts", action="store_true",
                    help="each rank on a simulated host of its own (MC_HOST_ID=host-<rank>): "
                         "no buffer is mapped, every row moves through the engine (tcp, or "
                         "rdma where a NIC reaches)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "gpu"],
                    help="where the buffer and tensors live (cuda, or gpu: the engine's device "
                         "layer, e.g. its simulation with MC_DEVICE=sim); not cpu: against a "
                         "device-to-device copy of the same bytes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    return ap.parse_args()


# ---------------------------------------------------------------------------------------
# rank side

def worker(a):
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import mooncake
    from mooncake.ep import Buffer

    dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    R, me = a.world, a.rank
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    L = E // R
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(1234 + me)
    x = torch.randn((T, H), generator=g).to(dtype)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand((T, K), generator=g)
    active = torch.ones(R, dtype=torch.int32)
    elem = x.element_size()
    dev = a.device
    if dev == "cuda":
        torch.cuda.set_device(0)

    def put(t):  # a host tensor's copy on the benchmark's device
        if dev == "cpu":
            return t
        if dev == "cuda":
            return t.cuda()
        d = mooncake._C._device_empty_like(t)
        if t.numel():
            mooncake._C._device_copy(d.data_ptr(), t.contiguous().data_ptr(),
                                     t.numel() * t.element_size())
        return d

    buf = Buffer(None, Buffer.get_ep_buffer_size_hint(T, H, R, E),
                 device=None if dev == "cpu" else dev)
    xd, topkd, wd, actd = put(x), put(topk), put(w), put(active)

    # ---- gloo reference (Megatron all-to-all dispatcher) ----
    flat_e = topk.flatten()
    order = torch.argsort(flat_e, stable=True)           # (token, k) pairs grouped by expert
    tok_of = (order // K)
    w_sorted = w.flatten()[order]
    per_expert = torch.bincount(flat_e, minlength=E)
    send_split = per_expert.view(R, L).sum(1)
    owner_t = topk // L
    in_rank = torch.stack([(owner_t == d).any(1) for d in range(R)], 1)  # [T, R]
    n_send = in_rank.sum(0)
    n_tok = torch.nonzero(in_rank.t())                   # (dest, token) in dest order
    n_rows_idx = n_tok[:, 1]

    def a2a(out, inp, out_split, in_split):
        if inp.dtype == torch.bfloat16:  # gloo lacks bf16; moving bytes, fp16 is as good
            out, inp = out.view(torch.float16), inp.view(torch.float16)
        dist.all_to_all_single(out, inp, out_split, in_split, group=gloo)

    def gloo_ll_dispatch():
        rows = x.index_select(0, tok_of)
        recv_counts = torch.empty(E, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, per_expert, group=gloo)  # [src][local expert]
        rc = recv_counts.view(R, L)
        out_split = rc.sum(1).tolist()
        recv = torch.empty((sum(out_split), H), dtype=dtype)
        a2a(recv, rows, out_split, send_split.tolist())
        # sort chunks [src][l] -> [l][src]
        chunks = torch.split(recv, rc.flatten().tolist())
        sorted_rows = torch.cat([chunks[r * L + l] for l in range(L) for r in range(R)])
        return sorted_rows, rc

    def gloo_ll_combine(y_sorted, rc):
        sizes = rc.t().flatten().tolist()                 # [l][src]
        chunks = torch.split(y_sorted, sizes)
        back = torch.cat([chunks[l * R + r] for r in range(R) for l in range(L)])
        rows = torch.empty((int(per_expert.sum()), H), dtype=dtype)
        a2a(rows, back, send_split.tolist(), rc.sum(1).tolist())
        out = torch.zeros((T, H), dtype=torch.float32)
        out.index_add_(0, tok_of, rows.float() * w_sorted[:, None])
        return out.to(dtype)

    def gloo_normal_dispatch():
        rows = x.index_select(0, n_rows_idx)
        counts = torch.empty(R, dtype=torch.int64)
        dist.all_to_all_single(counts, n_send.to(torch.int64), group=gloo)
        recv = torch.empty((int(counts.sum()), H), dtype=dtype)
        a2a(recv, rows, counts.tolist(), n_send.tolist())
        return recv, counts

    def gloo_normal_combine(y, counts):
        rows = torch.empty((int(n_send.sum()), H), dtype=dtype)
        a2a(rows, y, n_send.tolist(), counts.tolist())
        out = torch.zeros((T, H), dtype=torch.float32)
        out.index_add_(0, n_rows_idx, rows.float())
        return out.to(dtype)

    # ---- mooncake ----
    def settle(t):
        """Waits until t is written: a stream-ordered low-latency call (MC_EP_STREAM_CALLS, on
        with CUDA) returns before its kernels ran, and the time must count them."""
        if dev == "cuda":
            torch.cuda.synchronize()
        elif dev != "cpu" and t.numel():  # (the copy waits for the stream the call ordered)
            mooncake._C._device_copy(settle_box.data_ptr(), t.data_ptr(), 1)

    settle_box = torch.zeros(1, dtype=torch.uint8)

    def mc_ll_dispatch():
        recv_x, cnt, handle, _, _ = buf.dispatch(xd, topkd, actd, T, E, timeout_us=60_000_000)
        settle(cnt)
        return recv_x, handle

    def mc_ll_combine(st):
        recv_x, handle = st
        settle(buf.combine(recv_x, topkd, wd, actd, 60_000_000, handle)[0])

    fp8_y = None

    def mc_fp8_dispatch():
        (q, scales), cnt, handle, _, _ = buf.dispatch(xd, topkd, actd, T, E,
                                                      timeout_us=60_000_000, use_fp8=True)
        settle(cnt)
        return q, handle

    def mc_fp8_combine(st):
        nonlocal fp8_y
        q, handle = st
        if fp8_y is None:  # expert outputs of the received shape (bf16), made once
            fp8_y = put(torch.randn(q.shape, generator=g).to(dtype))
        settle(buf.combine(fp8_y, topkd, wd, actd, 60_000_000, handle)[0])

    def mc_normal_dispatch():
        recv_x, _, _, _, h = buf.normal_dispatch(xd, topkd, wd, E)
        return recv_x, h

    def mc_normal_combine(st):
        buf.normal_combine(st[0], st[1])

    ops = {
        ("mooncake", "ll"): (mc_ll_dispatch, mc_ll_combine),
        ("gloo_ref", "ll"): (gloo_ll_dispatch, lambda st: gloo_ll_combine(*st)),
        ("mooncake", "normal"): (mc_normal_dispatch, mc_normal_combine),
        ("gloo_ref", "normal"): (gloo_normal_dispatch, lambda st: gloo_normal_combine(*st)),
        ("mooncake", "ll_fp8"): (mc_fp8_dispatch, mc_fp8_combine),
        ("gloo_ref", "ll_fp8"): (gloo_ll_dispatch, lambda st: gloo_ll_combine(*st)),
    }
    payload = {"ll": int(per_expert.sum()) * H * elem, "normal": int(n_send.sum()) * H * elem,
               "ll_fp8": int(per_expert.sum()) * H * elem}
    impls = IMPLS
    if dev != "cpu":  # the reference: the device's own copy of the payload
        impls = ("mooncake", "copy_ref")
        nbytes_max = max(payload.values())
        src = put(torch.zeros(nbytes_max, dtype=torch.uint8))
        dst = put(torch.zeros(nbytes_max, dtype=torch.uint8))

        def dcopy(n):
            if dev == "cuda":
                dst[:n].copy_(src[:n])
                torch.cuda.synchronize()
            else:
                mooncake._C._device_copy(dst.data_ptr(), src.data_ptr(), n)

        for mode in ("ll", "ll_fp8", "normal"):
            ops[("copy_ref", mode)] = (lambda m=mode: dcopy(payload[m]),
                                       lambda st, m=mode: dcopy(payload[m]))
    # mooncake's fp8 dispatch sends H + H/32 bytes a row (its combine sends bf16 rows).
    fp8_dispatch_bytes = int(per_expert.sum()) * (H + H // 32)
    records = []
    for mode in a.modes.split(","):
        # The implementations alternate iteration by iteration, so both see the same load.
        times = {(impl, p): [] for impl in impls for p in PHASES}
        for it in range(a.warmup + a.iters):
            for impl in impls:
                disp, comb = ops[(impl, mode)]
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                st = disp()
                t1 = time.perf_counter()
                dist.barrier(group=gloo)
                t2 = time.perf_counter()
                comb(st)
                t3 = time.perf_counter()
                del st
                dist.barrier(group=gloo)
                t4 = time.perf_counter()
                comb(disp())
                t5 = time.perf_counter()
                if it >= a.warmup:
                    times[(impl, "dispatch")].append(t1 - t0)
                    times[(impl, "combine")].append(t3 - t2)
                    times[(impl, "both")].append(t5 - t4)
        for impl in impls:
            for phase in PHASES:
                mine = torch.tensor(times[(impl, phase)], dtype=torch.float64)
                allt = [torch.empty_like(mine) for _ in range(R)]
                dist.all_gather(allt, mine, group=gloo)
                per_iter = torch.stack(allt).max(0).values
                p50 = float(per_iter.quantile(0.5)) * 1e6
                p99 = float(per_iter.quantile(0.99)) * 1e6
                nbytes = payload[mode] * (2 if phase == "both" else 1)
                if mode == "ll_fp8" and impl == "mooncake":
                    nbytes = {"dispatch": fp8_dispatch_bytes, "combine": payload[mode],
                              "both": fp8_dispatch_bytes + payload[mode]}[phase]
                records.append({"impl": impl, "mode": mode, "phase": phase, "world_size": R,
                                "p50_us": round(p50, 1), "p99_us": round(p99, 1),
                                "gbps": round(nbytes / (p50 * 1e-6) / 1e9, 3),
                                "tokens": T, "hidden": H, "topk": K, "experts": E,
                                "dtype": a.dtype, "hosts": a.hosts, "device": dev})
    if me == 0:
        with open(os.path.join(a.out, "records.json"), "w") as f:
            json.dump(records, f)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------
# launcher

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(a, world):
    out = tempfile.mkdtemp(prefix=f"mc_ep_bench_w{world}_")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
               "--world", str(world), "--port", str(port), "--out", out,
               "--tokens", str(a.tokens), "--hidden", str(a.hidden), "--topk", str(a.topk),
               "--experts", str(a.experts), "--dtype", a.dtype, "--iters", str(a.iters),
               "--warmup", str(a.warmup), "--modes", a.modes, "--device", a.device] + (
                   ["--hosts"] if a.hosts else [])
        rank_env = dict(env, MC_HOST_ID=f"host-{r}") if a.hosts else env
        procs.append(subprocess.Popen(cmd, env=rank_env))
    codes = [p.wait(1800) for p in procs]
    if any(codes):
        raise SystemExit(f"world {world}: rank exit codes {codes}")
    with open(os.path.join(out, "records.json")) as f:
        return json.load(f)


def main():
    a = parse()
    if a.worker:
        return worker(a)
    records = []
    if "ll_fp8" in a.modes.split(",") and (a.dtype != "bfloat16" or a.hidden % 128):
        raise SystemExit("--modes ll_fp8 needs --dtype bfloat16 and --hidden a multiple of 128")
    for world in [int(w) for w in a.world_sizes.split(",")]:
        if a.experts % world:
            raise SystemExit(f"--experts {a.experts} is not divisible by world size {world}")
        records += run_world(a, world)
    print(f"{'impl':>9} {'mode':>6} {'phase':>8} {'W':>2} {'p50_us':>10} {'p99_us':>10} "
          f"{'GB/s':>7} {'vs ref':>8}")
    ref = {(r["mode"], r["phase"], r["world_size"]): r["p50_us"]
           for r in records if r["impl"] in ("gloo_ref", "copy_ref")}
    for r in records:
        ratio = r["p50_us"] / ref[(r["mode"], r["phase"], r["world_size"])]
        print(f"{r['impl']:>9} {r['mode']:>6} {r['phase']:>8} {r['world_size']:>2} "
              f"{r['p50_us']:>10.1f} {r['p99_us']:>10.1f} {r['gbps']:>7.2f} {ratio:>8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
