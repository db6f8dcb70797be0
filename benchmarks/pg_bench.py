#!/usr/bin/env python3
"""Process-group benchmark: mooncake against gloo and MPI, measured in one run.

    /usr/bin/python3 benchmarks/pg_bench.py --backends mooncake,gloo,mpi \
        --ops all_reduce,all_gather,reduce_scatter,all_to_all,broadcast \
        --sizes 4K,64K,1M,16M,64M --world-sizes 2,4 --json out.json --plot out.png

Prints nccl-tests columns (size, count, type, redop, time, algbw, busbw, #wrong) per
backend. Sizes follow nccl-tests: the size of the full buffer (all_gather: the gathered
output; reduce_scatter: the input; all_to_all: what each rank sends). busbw = algbw x
factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast and
sendrecv (a ring: each rank sends the size to the next rank and receives it from the previous
one, as nccl-tests' sendrecv) 1.
time is the median over iterations of the slowest rank's time per op (--stat mean: the
mean, as nccl-tests; on a shared 2-core box the median is what survives noise). mooncake and gloo run interleaved in the
same processes (a gloo group beside the mooncake default group); mpi runs under mpirun
with mpi4py on numpy float32 (benchmarks/pg_bench_mpi.py). All data is float32.

torch APIs: all_gather = all_gather_into_tensor (gloo 1.13: the list form, it has no
_allgather_base); reduce_scatter = reduce_scatter_tensor (gloo 1.13 has none: n/a);
all_to_all = all_to_all_single.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"
FACTORS = {"memcpy": lambda n: 1.0, "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum"}
COLORS = {"mooncake": "C0", "gloo": "C1", "mpi": "C2", "mooncake@sim": "C3"}
SIM = "mooncake@sim"  # the mooncake rows on GPU memory of the device layer's simulation


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def fmt_size(b):
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k}{unit}"
    return str(b)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Worker side (one process per rank; torch backends)

def summarize(backend, op, world, nbytes, mean_s, samples_s, wrong, stat, device="cpu"):
    """One record. samples_s: per-iteration times, already the max over ranks. device: where
    the tensors were (cpu, sim)."""
    xs = sorted(samples_s)
    p50 = xs[len(xs) // 2] * 1e6
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6
    return {"backend": backend, "device": device, "op": op, "world_size": world, "bytes": nbytes,
            "time_us": p50 if stat == "p50" else mean_s * 1e6, "wrong": wrong,
            "iters": len(xs), "mean_us": mean_s * 1e6, "p50_us": p50, "p99_us": p99}


class Memory:
    """Where a benchmark's tensors live. device "cpu": plain torch tensors. "sim": GPU memory
    of the engine's device layer over its host simulation (MC_DEVICE=sim; torch here has no
    CUDA): CPU tensors whose storage the process group must move with the layer's copies only
    (host code touching it faults), filled and read through mooncake._C._device_copy."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        if device == "sim":
            from mooncake import _C
            self._C = _C

    def zeros(self, n):
        t = self.torch.zeros(n)
        if self.device == "cpu":
            return t
        d = self._C._device_empty_like(t)
        self.put(d, t)
        return d

    def put(self, t, host):
        if self.device == "cpu":
            t.copy_(host)
        elif t.numel():
            self._C._device_copy(t.data_ptr(), host.contiguous().data_ptr(), 4 * t.numel())

    def get(self, t):
        if self.device == "cpu":
            return t
        h = self.torch.empty(t.shape, dtype=t.dtype)
        if t.numel():
            self._C._device_copy(h.data_ptr(), t.data_ptr(), 4 * t.numel())
        return h


def torch_op(dist, torch, op, nbytes, group, use_base_api, device="cpu"):
    """(run, count_wrong) for op on group; inputs of run() are zeros (values stay finite)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    n = nbytes // 4
    blk = n // W
    f32 = torch.float32
    m = Memory(torch, device)
    if op == "all_reduce":
        x = m.zeros(n)

        def run():
            dist.all_reduce(x, group=group)

        def wrong():
            m.put(x, torch.full((n,), float(r + 1)))
            run()
            return int((m.get(x) != W * (W + 1) / 2).sum())
    elif op == "all_gather":
        send, out = m.zeros(blk), m.zeros(blk * W)
        outs = list(out.split(blk)) if blk else [m.zeros(0) for _ in range(W)]

        def run():
            if use_base_api:
                dist.all_gather_into_tensor(out, send, group=group)
            else:
                dist.all_gather(outs, send, group=group)

        def wrong():
            m.put(send, torch.full((blk,), float(r + 1)))
            run()
            got = m.get(out) if use_base_api else torch.cat([m.get(o) for o in outs])
            return int((got != torch.arange(1, W + 1, dtype=f32).repeat_interleave(blk)).sum())
    elif op == "reduce_scatter":
        send, out = m.zeros(blk * W), m.zeros(blk)

        def run():
            dist.reduce_scatter_tensor(out, send, group=group)

        def wrong():
            m.put(send, ((r + 1) * torch.arange(1, W + 1, dtype=f32)).repeat_interleave(blk))
            run()
            return int((m.get(out) != (r + 1) * W * (W + 1) / 2).sum())
    elif op == "all_to_all":
        send, out = m.zeros(blk * W), m.zeros(blk * W)

        def run():
            dist.all_to_all_single(out, send, group=group)

        def wrong():
            m.put(send, (r * W + torch.arange(W, dtype=f32)).repeat_interleave(blk))
            run()
            exp = (torch.arange(W, dtype=f32) * W + r).repeat_interleave(blk)
            return int((m.get(out) != exp).sum())
    elif op == "broadcast":
        x = m.zeros(n)

        def run():
            dist.broadcast(x, src=0, group=group)

        def wrong():
            m.put(x, torch.full((n,), 42.0 if r == 0 else -1.0))
            run()
            return int((m.get(x) != 42.0).sum())
    elif op == "sendrecv":  # a ring, as nccl-tests' sendrecv: nbytes to the next rank and
        send, out = m.zeros(n), m.zeros(n)  # nbytes from the previous one, concurrently
        nxt, prv = (r + 1) % W, (r - 1) % W
        if group is not None:
            nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)

        def run():
            reqs = [dist.isend(send, nxt, group=group), dist.irecv(out, prv, group=group)]
            for q in reqs:
                q.wait()

        def wrong():
            m.put(send, torch.full((n,), float(r + 1)))
            run()
            return int((m.get(out) != float((r - 1) % W + 1)).sum())
    else:
        raise ValueError(f"unknown op {op}")
    return run, wrong


def worker(args):
    cfg = json.loads(args.config)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                      RANK=str(args.rank), WORLD_SIZE=str(args.world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backends = cfg["backends"]
    if "mooncake" in backends:
        import mooncake  # noqa: F401
    dist.init_process_group(backends[0], rank=args.rank, world_size=args.world)
    ctl = dist.new_group(backend="gloo")
    groups = {b: (None if b == backends[0] else ctl if b == "gloo" else dist.new_group(backend=b))
              for b in backends if ":" not in b}
    if "sim" in cfg.get("devices", []):  # the default mooncake group on simulated GPU memory
        groups[SIM] = groups["mooncake"]
    # A/B variants: more mooncake groups in the same processes, each created with its own
    # MC_* settings (read when a group is created), measured interleaved with the others.
    for label, env in cfg.get("variants", []):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        groups[label] = dist.new_group(backend="mooncake")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    records = []
    pg_profile = None
    if cfg.get("profile"):
        from mooncake import _C
        pg_profile = _C._pg_profile

    def timed_loop(run, iters):
        """(mean seconds per call, per-iteration times: max over ranks; this rank's own mean)
        of iters calls of run.
        Samples go into a Python list (0.1 us a store), as pg_bench_mpi's go into numpy (0.2
        us): a torch tensor's item store costs ~2 us, which on 4 ranks over 2 cores added
        tens of microseconds to every op measured (docs/perf/pg.md)."""
        samples = [0.0] * iters
        dist.barrier(group=ctl)
        start = time.perf_counter()
        for i in range(iters):
            t = time.perf_counter()
            run()
            samples[i] = time.perf_counter() - t
        own = (time.perf_counter() - start) / iters
        mean = torch.tensor([own], dtype=torch.float64)
        worst = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=ctl)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctl)  # per-iteration max
        return float(mean), worst.tolist(), own

    # Memory-bandwidth reference: every rank copies a buffer of each size at the same time.
    for nbytes in cfg["sizes"]:
        src, dst = torch.zeros(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)
        mean, samples, _ = timed_loop(lambda: dst.copy_(src), cfg["iters"])
        records.append(summarize("memcpy", "memcpy", args.world, nbytes, mean, samples, 0,
                                 cfg["stat"]))
    measured = list(backends)
    if "mooncake" in measured:  # variants right after mooncake, as the driver lists them
        at = measured.index("mooncake") + 1
        measured[at:at] = [label for label, _ in cfg.get("variants", [])]
        if "sim" in cfg.get("devices", []):
            measured.insert(at, SIM)
        if "cpu" not in cfg.get("devices", ["cpu"]):
            measured.remove("mooncake")
    for op in cfg["ops"]:
        for nbytes in cfg["sizes"]:
            for b in measured:  # interleaved: noise hits every backend alike
                if op == "reduce_scatter" and b == "gloo":
                    continue
                run, wrong = torch_op(dist, torch, op, nbytes, groups[b], b != "gloo",
                                      "sim" if b == SIM else "cpu")
                for _ in range(cfg["warmup"]):
                    run()
                dist.barrier(group=ctl)
                t0 = time.perf_counter()
                run()
                one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(one, op=dist.ReduceOp.MAX, group=ctl)
                iters = max(3, min(cfg["iters"], int(cfg["max_seconds"] / max(float(one), 1e-6))))
                profiled = pg_profile is not None and b != "gloo"
                if profiled:  # the group's time by phase in these calls (pg/profile.h)
                    pg_profile(True, True)
                mean, samples, own = timed_loop(run, iters)
                phases = pg_profile(False, True) if profiled else None
                bad = torch.tensor([wrong()], dtype=torch.int64)
                dist.all_reduce(bad, group=ctl)
                rec = summarize(b, op, args.world, nbytes, mean, samples, int(bad),
                                cfg["stat"], "sim" if b == SIM else "cpu")
                if phases is not None:  # this rank's means per call, in us
                    rec["phases_us"] = {k: ns / iters / 1e3 for k, (_, ns) in phases.items()}
                    rec["phases_us"]["call"] = own * 1e6
                records.append(rec)
    if args.rank == 0:
        print("PGBENCH_RESULTS " + json.dumps(records), flush=True)
    dist.barrier(group=ctl)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Driver side

def parse_results(text, what):
    for line in text.splitlines():
        if line.startswith("PGBENCH_RESULTS "):
            return json.loads(line[len("PGBENCH_RESULTS "):])
    raise RuntimeError(f"{what}: no results\n{text[-4000:]}")


def busy_loops(n):
    """n processes that spin forever (the "another process competes for the cores" case)."""
    return [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(n)]


class FakeNics:
    """--fake-nics: every simulated host gets two RoCE NICs of the verbs emulator built in
    BUILD_DIR (tests/fakes/verbs; set up by the tests' tests/python/_fake_verbs.Fabric), so
    that the engine links the hosts over rdma; tx_bytes() reads the emulator's NIC counters."""

    def __init__(self, build_dir, hosts):
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
        os.environ["MC_TEST_BUILD_DIR"] = os.path.abspath(build_dir)
        import _fake_verbs
        if _fake_verbs.library_dir() is None:
            raise SystemExit(f"--fake-nics: no verbs emulator in {build_dir}")
        self.hosts = sorted(set(hosts))
        self.fabric = _fake_verbs.Fabric("pgbench", [f"bench-host-{h}" for h in self.hosts])

    def env(self, env):
        return dict(env, **self.fabric.env())

    def tx_bytes(self):
        return {h: self.fabric.tx_bytes(f"bench-host-{h}") for h in self.hosts}

    def close(self):
        self.fabric.close()


def run_torch(world, cfg, timeout_s, nics=None):
    port = free_port()
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if "sim" in cfg.get("devices", []):
        env["MC_DEVICE"] = "sim"
    if nics is not None:
        env = nics.env(env)
    hosts = cfg.get("hosts")
    for r in range(world):
        cmd = [PYTHON, os.path.abspath(__file__), "--worker", "--rank", str(r), "--world",
               str(world), "--port", str(port), "--config", json.dumps(cfg)]
        renv = dict(env, MC_HOST_ID=f"bench-host-{hosts[r]}") if hosts else env
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=renv))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"torch workers failed (exit {[p.returncode for p in procs]}):\n"
                           + "\n".join(o[-3000:] for o in outs))
    return parse_results(outs[0], "torch workers")


def run_mpi(world, cfg, timeout_s):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(world), PYTHON,
           os.path.join(HERE, "pg_bench_mpi.py"), "--config", json.dumps(cfg)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        raise RuntimeError(f"mpirun failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return parse_results(r.stdout, "mpirun")


def complete(rec):
    t = rec["time_us"] * 1e-6
    rec["algbw_gbps"] = rec["bytes"] / t / 1e9 if t > 0 else 0.0
    rec["busbw_gbps"] = rec["algbw_gbps"] * FACTORS[rec["op"]](rec["world_size"])
    return rec


def print_tables(records, backends, ops, sizes, worlds):
    by = {(r["backend"], r["op"], r["world_size"], r["bytes"]): r for r in records}
    for w in worlds:
        mc = [r for r in records if r["op"] == "memcpy" and r["world_size"] == w]
        if mc:
            print(f"\n# memcpy reference: {w} processes copying at once (GB/s copied per process)")
            print("  " + "  ".join(f"{fmt_size(r['bytes'])}={r['algbw_gbps']:.2f}"
                                   for r in sorted(mc, key=lambda r: r["bytes"])))
        for op in ops:
            print(f"\n# {op}  world_size={w}  (time us, bandwidth GB/s)")
            head = f"{'size':>8} {'count':>10} {'type':>7} {'redop':>6}"
            for b in backends:
                head += f" | {b:>8} {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
            print(head)
            for s in sizes:
                line = f"{fmt_size(s):>8} {s // 4:>10} {'float':>7} {REDOP.get(op, 'none'):>6}"
                for b in backends:
                    r = by.get((b, op, w, s))
                    if r is None:
                        line += f" | {'':>8} {'n/a':>9} {'':>7} {'':>7} {'':>6}"
                    else:
                        line += (f" | {'':>8} {r['time_us']:>9.1f} {r['algbw_gbps']:>7.3f} "
                                 f"{r['busbw_gbps']:>7.3f} {r['wrong']:>6}")
                print(line)
    if "mooncake" in backends:
        print("\n# mooncake busbw ratio against the baselines")
        for w in worlds:
            for op in ops:
                for base in [b for b in backends if b != "mooncake"]:
                    cells = []
                    for s in sizes:
                        m, o = by.get(("mooncake", op, w, s)), by.get((base, op, w, s))
                        cells.append(f"{fmt_size(s)}={m['busbw_gbps'] / o['busbw_gbps']:.2f}x"
                                     if m and o and o["busbw_gbps"] > 0 else f"{fmt_size(s)}=n/a")
                    print(f"{op:>15} w={w} vs {base:<5} " + " ".join(cells))


def markdown(records, backends, ops, worlds):
    """The same tables as print_tables, as Markdown (for docs/perf/pg.md)."""
    by = {(r["backend"], r["op"], r["world_size"], r["bytes"]): r for r in records}
    out = []
    for w in worlds:
        sizes = sorted({r["bytes"] for r in records if r["world_size"] == w})
        mc = sorted((r for r in records if r["op"] == "memcpy" and r["world_size"] == w),
                    key=lambda r: r["bytes"])
        if mc:
            out.append(f"\n**memcpy reference, {w} processes copying at once** (GB/s per "
                       "process)\n")
            out.append("| " + " | ".join(fmt_size(r["bytes"]) for r in mc) + " |")
            out.append("|" + " ---: |" * len(mc))
            out.append("| " + " | ".join(f"{r['algbw_gbps']:.2f}" for r in mc) + " |")
        for op in ops:
            out.append(f"\n**{op}, {w} ranks** (float32, redop {REDOP.get(op, 'none')}; time in us, "
                       "bandwidth in GB/s)\n")
            head = "| size | count |"
            rule = "| ---: | ---: |"
            for b in backends:
                head += f" {b} time | {b} algbw | {b} busbw | {b} #wrong |"
                rule += " ---: | ---: | ---: | ---: |"
            out += [head, rule]
            for s in sizes:
                line = f"| {fmt_size(s)} | {s // 4} |"
                for b in backends:
                    r = by.get((b, op, w, s))
                    line += (" n/a | | | |" if r is None else
                             f" {r['time_us']:.1f} | {r['algbw_gbps']:.3f} | "
                             f"{r['busbw_gbps']:.3f} | {r['wrong']} |")
                out.append(line)
    if "mooncake" in backends:
        out.append("\n**mooncake busbw / baseline busbw**\n")
        for w in worlds:
            sizes = sorted({r["bytes"] for r in records if r["world_size"] == w})
            out.append(f"| {w} ranks | vs | " + " | ".join(fmt_size(s) for s in sizes) + " |")
            out.append("| --- | --- |" + " ---: |" * len(sizes))
            for op in ops:
                for base in [b for b in backends if b != "mooncake"]:
                    cells = []
                    for s in sizes:
                        m, o = by.get(("mooncake", op, w, s)), by.get((base, op, w, s))
                        cells.append(f"{m['busbw_gbps'] / o['busbw_gbps']:.2f}x"
                                     if m and o and o["busbw_gbps"] > 0 else "n/a")
                    out.append(f"| {op} | {base} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out) + "\n"


def plot(records, backends, ops, worlds, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(4 * len(ops), 3.4 * len(worlds)),
                             squeeze=False)
    for i, w in enumerate(worlds):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for b in backends:
                pts = sorted((r["bytes"], r["busbw_gbps"]) for r in records
                             if r["backend"] == b and r["op"] == op and r["world_size"] == w)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b,
                            color=COLORS.get(b))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, {w} ranks")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel("busbw (GB/s)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="mooncake,gloo,mpi")
    ap.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,all_to_all,broadcast")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--iters", type=int, default=200, help="max timed iterations per point")
    ap.add_argument("--stat", choices=["p50", "mean"], default="p50",
                    help="time column: median of the per-iteration max over ranks (default; "
                         "robust on a shared box) or nccl-tests' mean")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=1.5,
                    help="cap on timed seconds per point (fewer iterations for big sizes)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    ap.add_argument("--hosts", help="one letter per rank (e.g. aabb): rank r pretends to be "
                    "on host hosts[r] (MC_HOST_ID), so mooncake treats the group as spanning "
                    "hosts (tcp between them); gloo is unaffected (loopback tcp either way)")
    ap.add_argument("--fake-nics", metavar="BUILD_DIR",
                    help="with --hosts: give every simulated host two RoCE NICs of the verbs "
                    "emulator in BUILD_DIR (e.g. build), so that mooncake links the hosts over "
                    "rdma; prints the bytes the NICs sent")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V[,K=V]",
                    help="also measure a mooncake group created with these MC_* settings, "
                    "reported as backend mooncake:LABEL (A/B in one run; repeatable)")
    ap.add_argument("--device", default="cpu", metavar="cpu,sim",
                    help="where mooncake's tensors live: cpu (host tensors) and/or sim (GPU "
                    "memory of the engine's device layer over its host simulation, "
                    "MC_DEVICE=sim, reported as backend mooncake@sim); the baselines always "
                    "use host tensors. JSON rows carry a device field")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N busy-loop processes beside the benchmark (N = cores: one per "
                    "core)")
    ap.add_argument("--profile", action="store_true",
                    help="mooncake backends: rank 0's time per call inside the group by phase "
                         "(pg/profile.h): the whole op, waits for peers' flags, GPU waits; "
                         "printed after the tables and kept in the records (phases_us)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--plot", help="write a busbw plot (PNG) here")
    ap.add_argument("--markdown", help="write the tables as Markdown here")
    ap.add_argument("--replot", metavar="JSON",
                    help="measure nothing: print tables / write plot and Markdown from a "
                         "--json file of an earlier run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    worlds = [int(w) for w in args.world_sizes.split(",")]
    for b in backends:
        if b not in ("mooncake", "gloo", "mpi"):
            ap.error(f"unknown backend {b}")
    variants = []
    for v in args.variant:
        label, _, kvs = v.partition(":")
        env = dict(kv.split("=", 1) for kv in kvs.split(",") if "=" in kv)
        if not label or not env or any(not k.startswith("MC_") for k in env):
            ap.error(f"--variant {v}: expected LABEL:MC_X=V[,MC_Y=W]")
        variants.append(["mooncake:" + label, env])
    if variants and "mooncake" not in backends:
        ap.error("--variant needs the mooncake backend")
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    if not devices or any(d not in ("cpu", "sim") for d in devices):
        ap.error(f"--device {args.device}: expected cpu, sim or both (cuda: not built yet)")
    if "sim" in devices and "mooncake" not in backends:
        ap.error("--device sim needs the mooncake backend")
    if "sim" in devices and not args.replot:
        backends.insert(backends.index("mooncake") + 1, SIM)
        if "cpu" not in devices:
            backends.remove("mooncake")
    if variants and not args.replot:
        at = backends.index("mooncake") + 1
        backends[at:at] = [label for label, _ in variants]
    for o in ops:
        if o not in FACTORS:
            ap.error(f"unknown op {o} (choose from {', '.join(FACTORS)})")
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    records = []
    if args.replot:
        with open(args.replot) as f:
            records = json.load(f)
        worlds = sorted({r["world_size"] for r in records})
        present = {r["backend"] for r in records}
        backends = [b for b in backends if b in present]
        if "mooncake" in backends:
            at = backends.index("mooncake") + 1
            backends[at:at] = sorted(b for b in present if b.startswith("mooncake:") or b == SIM)
        ops = [o for o in ops if any(r["op"] == o for r in records)]
    for w in ([] if args.replot else worlds):
        wsizes = [s - s % (4 * w) for s in sizes]  # whole float32 blocks per rank
        cfg = {"ops": ops, "sizes": wsizes, "iters": args.iters, "warmup": args.warmup,
               "max_seconds": args.max_seconds, "stat": args.stat, "hosts": None,
               "variants": variants, "devices": devices, "profile": args.profile}
        if args.hosts:
            if len(args.hosts) != w:
                ap.error(f"--hosts {args.hosts} names {len(args.hosts)} ranks, not {w}")
            if "mpi" in backends:
                ap.error("--hosts simulates hosts for the engine only: leave mpi out")
            cfg["hosts"] = args.hosts
        elif args.fake_nics:
            ap.error("--fake-nics needs --hosts")
        torch_backends = [b for b in backends if b != "mpi" and ":" not in b and b != SIM]
        if SIM in backends and "mooncake" not in torch_backends:
            torch_backends.insert(0, "mooncake")
        t0 = time.time()
        busy = busy_loops(args.busy)
        nics = FakeNics(args.fake_nics, args.hosts) if args.fake_nics else None
        try:
            if torch_backends:
                records += run_torch(w, dict(cfg, backends=torch_backends), args.timeout, nics)
            if "mpi" in backends:
                records += run_mpi(w, cfg, args.timeout)
            if nics is not None:
                print(f"[world {w}: bytes the emulated NICs sent: {nics.tx_bytes()}]",
                      file=sys.stderr)
        finally:
            for p in busy:
                p.kill()
                p.wait()
            if nics is not None:
                nics.close()
        print(f"[world {w}: measured in {time.time() - t0:.0f}s]", file=sys.stderr)
    records = [complete(r) for r in records]
    for w in worlds:
        print_tables([r for r in records if r["world_size"] == w], backends, ops,
                     sorted({r["bytes"] for r in records if r["world_size"] == w}), [w])
    prof = [r for r in records if r.get("phases_us")]
    if prof:
        print("\n# time by phase, rank 0's means in us per call: the call as Python saw it, the "
              "group's op(s) inside it, inside those the waits for peers' flags and for GPU work; "
              "torch+py = call - op")
        print(f"{'backend':>14} {'op':>14} {'world':>5} {'size':>6} {'call':>8} {'op':>8} "
              f"{'flag wait':>9} {'dev wait':>8} {'torch+py':>8}")
        for r in prof:
            p = r["phases_us"]
            print(f"{r['backend']:>14} {r['op']:>14} {r['world_size']:>5} "
                  f"{fmt_size(r['bytes']):>6} {p['call']:8.1f} {p['op']:8.1f} "
                  f"{p['flag wait']:9.1f} {p['device wait']:8.1f} {p['call'] - p['op']:8.1f}")
    if args.json and not args.replot:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        plot(records, backends, ops, worlds, args.plot)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(records, backends, ops, worlds))
    return 1 if any(r["wrong"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
