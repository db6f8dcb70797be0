#!/usr/bin/python3
"""Store benchmark: mooncake.store against redis-server, same Python, same run.

  /usr/bin/python3 benchmarks/store_bench.py --sizes 4K,64K,1M,16M --clients 1,4 \
      --compare redis --repeat 3 --json out.json
  /usr/bin/python3 benchmarks/store_bench.py --failover --json failover.json
  /usr/bin/python3 benchmarks/store_bench.py --trace ../shared/data/synthetic_trace.jsonl \
      --block-bytes 65536 --capacity-bytes 268435456 --json trace.json

Topology (one host): a standalone mooncake_master; one holder process that lends the store's
memory (--segment-bytes) and does nothing else; N client processes that lend nothing, so every
byte a client reads crosses from the holder's memory through the engine (shared memory here),
as a serving engine reading a peer's KV cache would. Redis: one redis-server on a free loopback
port (no persistence), N client processes with redis-py. Ops: put (SET), get (GET), get_into
(mooncake only: into a registered buffer; compared with Redis GET), batch_put (128 x 64 KiB:
batch_put_from vs MSET), batch_get (128 x 64 KiB: batch_get_into vs MGET). Latency per op
(p50/p99) and aggregate ops/s across clients. The machine this runs on is usually shared:
--repeat N runs every (size, clients) point N times, alternating mooncake and Redis, and reports
the median of each figure (each run is kept in the JSON under "runs").

--failover: etcd-server and three masters (--leader-ttl-s 3); a holder and a writer that puts
4 KiB objects through the leader found in etcd; the leader is killed with SIGKILL mid-load. Row
"failover": seconds from the kill to the first put that succeeds on the new leader, and the
number of puts acknowledged before the kill that no longer read back with their bytes ("lost",
which must be 0). Repeated --failover-repeat times (median).

Layer-wise save and load (vLLM's session API): benchmarks/store_layerwise_bench.py.

--gpu sim|cuda: one holder lending its segment in host memory, then one lending it in GPU
memory (MC_STORE_SEGMENT_DEVICE=0); a client on the same host times get_into a registered GPU
buffer (p50 of --gpu-iters) and, in the same process, the device's own copy of the same bytes
between two GPU buffers (the limit). Row "get_into_gpu": gbps, d2d_gbps and vs_d2d.
"""
import argparse
import glob
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_master():
    env = os.environ.get("MC_MASTER_BIN")
    if env:
        return env
    cands = glob.glob(os.path.join(ROOT, "build*", "store", "mooncake_master"))
    cands.sort(key=os.path.getmtime, reverse=True)
    if not cands:
        sys.exit("store_bench: mooncake_master not found (build it, or set MC_MASTER_BIN)")
    return cands[0]


def pct(xs, p):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))]


def iters_for(size, scale):
    if size <= 8 << 10:
        n = 2000
    elif size <= 128 << 10:
        n = 1000
    elif size <= 2 << 20:
        n = 200
    else:
        n = 12
    return max(2, int(n * scale))


# ---------------------------------------------------------------- workers (spawned processes)

def _mc_store(addr, segment):
    from mooncake.store import MooncakeDistributedStore
    st = MooncakeDistributedStore()
    rc = st.setup("bench", "", segment, 64 << 20, "tcp", "", addr)
    if rc != 0:
        raise RuntimeError(f"setup failed: {rc}")
    return st


def holder_main(addr, segment, ready, stop):
    st = _mc_store(addr, segment)
    ready.set()
    stop.wait()
    st.close()


def mc_worker(addr, wid, size, iters, ops, barrier, out):
    import numpy as np
    st = _mc_store(addr, 0)
    val = os.urandom(size)
    buf = np.empty(max(size, 128 * 65536), dtype=np.uint8)
    ptr = buf.ctypes.data
    assert st.register_buffer(ptr, buf.nbytes) == 0
    res = {}
    keys = [f"w{wid}/s{size}/{i}" for i in range(iters)]
    barrier.wait()
    if "put" in ops:
        lat = []
        t0 = time.perf_counter()
        for k in keys:
            a = time.perf_counter()
            rc = st.put(k, val)
            lat.append(time.perf_counter() - a)
            assert rc == 0, rc
        res["put"] = (lat, time.perf_counter() - t0)
    barrier.wait()
    if "get" in ops:
        lat = []
        t0 = time.perf_counter()
        for k in keys:
            a = time.perf_counter()
            v = st.get(k)
            lat.append(time.perf_counter() - a)
            assert len(v) == size
        res["get"] = (lat, time.perf_counter() - t0)
        assert st.get(keys[0]) == val
    barrier.wait()
    if "get_into" in ops:
        lat = []
        t0 = time.perf_counter()
        for k in keys:
            a = time.perf_counter()
            n = st.get_into(k, ptr, size)
            lat.append(time.perf_counter() - a)
            assert n == size, n
        res["get_into"] = (lat, time.perf_counter() - t0)
        assert bytes(buf[:size]) == val
    barrier.wait()
    if "batch_put" in ops:
        bval = os.urandom(65536)
        for i in range(128):
            buf[i * 65536:(i + 1) * 65536] = np.frombuffer(bval, dtype=np.uint8)
        ptrs = [ptr + i * 65536 for i in range(128)]
        sizes = [65536] * 128
        rounds = max(2, iters // 20)
        lat = []
        t0 = time.perf_counter()
        for r in range(rounds):
            bkeys = [f"w{wid}/bp{r}/{i}" for i in range(128)]
            a = time.perf_counter()
            rcs = st.batch_put_from(bkeys, ptrs, sizes)
            lat.append(time.perf_counter() - a)
            assert all(x == 0 for x in rcs), rcs[:4]
        res["batch_put"] = (lat, time.perf_counter() - t0)
        # The last round: with 4 clients the rounds outgrow the holder's segment and the
        # oldest are evicted.
        assert st.get(f"w{wid}/bp{rounds - 1}/5") == bval
        st.remove_by_regex(f"^w{wid}/bp", True)
    barrier.wait()
    if "batch_get" in ops:
        bkeys = [f"w{wid}/b/{i}" for i in range(128)]
        bval = os.urandom(65536)
        assert st.put_batch(bkeys, [bval] * 128) == 0
        ptrs = [ptr + i * 65536 for i in range(128)]
        sizes = [65536] * 128
        lat = []
        rounds = max(2, iters // 20)
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(rounds):
            a = time.perf_counter()
            r = st.batch_get_into(bkeys, ptrs, sizes)
            lat.append(time.perf_counter() - a)
            assert all(x == 65536 for x in r), r[:4]
        res["batch_get"] = (lat, time.perf_counter() - t0)
        assert bytes(buf[:65536]) == bval
    barrier.wait()
    if wid == 0:
        st.remove_all(True)
    st.close()
    out.put((wid, res))


def redis_worker(port, wid, size, iters, ops, barrier, out):
    import redis
    r = redis.Redis(host="127.0.0.1", port=port)
    val = os.urandom(size)
    keys = [f"w{wid}/s{size}/{i}" for i in range(iters)]
    res = {}
    barrier.wait()
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        a = time.perf_counter()
        r.set(k, val)
        lat.append(time.perf_counter() - a)
    res["put"] = (lat, time.perf_counter() - t0)
    barrier.wait()
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        a = time.perf_counter()
        v = r.get(k)
        lat.append(time.perf_counter() - a)
        assert len(v) == size
    res["get"] = (lat, time.perf_counter() - t0)
    barrier.wait()
    barrier.wait()
    if "batch_put" in ops:
        bval = os.urandom(65536)
        rounds = max(2, iters // 20)
        lat = []
        t0 = time.perf_counter()
        for rd in range(rounds):
            bkeys = [f"w{wid}/bp{rd}/{i}" for i in range(128)]
            a = time.perf_counter()
            r.mset({k: bval for k in bkeys})
            lat.append(time.perf_counter() - a)
        res["batch_put"] = (lat, time.perf_counter() - t0)
        assert r.get(f"w{wid}/bp{rounds - 1}/5") == bval
    barrier.wait()
    if "batch_get" in ops:
        bkeys = [f"w{wid}/b/{i}" for i in range(128)]
        bval = os.urandom(65536)
        r.mset({k: bval for k in bkeys})
        rounds = max(2, iters // 20)
        lat = []
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(rounds):
            a = time.perf_counter()
            vs = r.mget(bkeys)
            lat.append(time.perf_counter() - a)
            assert all(len(v) == 65536 for v in vs)
        res["batch_get"] = (lat, time.perf_counter() - t0)
    barrier.wait()
    if wid == 0:
        r.flushall()
    out.put((wid, res))


def run_clients(ctx, target, args_of, nclients):
    barrier = ctx.Barrier(nclients)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(w) + (barrier, out)) for w in range(nclients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a {target.__name__} exited with {p.exitcode}")
    return [r for _, r in results]


def summarize(system, results, size, nclients):
    recs = []
    for op in ("put", "get", "get_into", "batch_put", "batch_get"):
        per = [r[op] for r in results if op in r]
        if not per:
            continue
        lat = [x for lats, _ in per for x in lats]
        wall = max(w for _, w in per)
        nops = len(lat)
        bytes_per_op = 128 * 65536 if op.startswith("batch") else size
        ops_s = nops / wall if wall > 0 else 0.0
        recs.append({"system": system, "op": op, "bytes": bytes_per_op, "clients": nclients,
                     "ops_per_s": round(ops_s, 1),
                     "gbps": round(ops_s * bytes_per_op / 1e9, 3),
                     "p50_us": round(pct(lat, 50) * 1e6, 1),
                     "p99_us": round(pct(lat, 99) * 1e6, 1)})
    return recs


# ---------------------------------------------------------------- trace replay

def replay_trace(addr, path, block_bytes, limit):
    import numpy as np
    st = _mc_store(addr, 0)
    buf = np.zeros(block_bytes, dtype=np.uint8)
    ptr = buf.ctypes.data
    st.register_buffer(ptr, block_bytes)
    seen = set()
    hits = total = ideal = failed_puts = 0
    t0 = time.perf_counter()
    with open(path) as f:
        for n, line in enumerate(f):
            if limit and n >= limit:
                break
            for h in json.loads(line)["hash_ids"]:
                total += 1
                if h in seen:
                    ideal += 1
                seen.add(h)
                key = f"blk/{h}"
                if st.get_into(key, ptr, block_bytes) == block_bytes:
                    hits += 1
                else:
                    if st.put_from(key, ptr, block_bytes) != 0:
                        failed_puts += 1
    wall = time.perf_counter() - t0
    st.close()
    return {"system": "mooncake", "op": "trace", "hit_rate": round(hits / max(1, total), 4),
            "max_hit_rate": round(ideal / max(1, total), 4),
            "blocks_per_s": round(total / wall, 1), "blocks": total, "block_bytes": block_bytes,
            "failed_puts": failed_puts}


# ---------------------------------------------------------------- GPU buffers (--gpu)

def gpu_holder(addr, segment, device, where, ready, stop):
    # The device layer and the segment's place are read once per process, at its first use.
    os.environ["MC_DEVICE"] = device
    os.environ["MC_STORE_SEGMENT_DEVICE"] = "0" if where == "gpu" else "cpu"
    st = _mc_store(addr, segment)
    ready.set()
    stop.wait()
    st.close()


def gpu_client(addr, device, size, iters, out):
    try:
        out.put(gpu_client_run(addr, device, size, iters))
    except BaseException as e:  # noqa: BLE001 -- the parent waits for a reply either way
        out.put({"error": repr(e)})
        raise


def gpu_client_run(addr, device, size, iters):
    os.environ["MC_DEVICE"] = device
    from mooncake import _C
    from mooncake.store import MooncakeDistributedStore
    st = MooncakeDistributedStore()
    assert st.setup("bench-gpu", "", 0, size + (1 << 20), "tcp", "", addr) == 0
    g = _C._device_alloc(size, 0)
    g2 = _C._device_alloc(size, 0)
    assert st.register_buffer(g, size) == 0
    val = os.urandom(size)
    key = f"gpu-obj/{size}"
    assert st.put(key, val) == 0
    def timed(call):  # seconds per call, after two warm-up calls (peer mapping, pinning)
        out = []
        for i in range(iters + 2):
            a = time.perf_counter()
            call()
            if i >= 2:
                out.append(time.perf_counter() - a)
        return out

    def get_into():
        n = st.get_into(key, g, size)
        assert n == size, n

    lat = timed(get_into)
    back = bytearray(size)
    import ctypes
    _C._device_copy(ctypes.addressof((ctypes.c_char * size).from_buffer(back)), g, size)
    assert bytes(back) == val, "get_into a GPU buffer: wrong bytes"
    copy = timed(lambda: _C._device_copy(g2, g, size))
    assert st.unregister_buffer(g) == 0
    _C._device_free(g)
    _C._device_free(g2)
    st.close()
    return {"get_into": lat, "d2d": copy, "layer": _C._device_layer()}


def run_gpu(ctx, device, sizes, iters):
    """get_into a GPU buffer from a holder's segment in host memory and in GPU memory, against
    the device's own device-to-device copy of the same bytes, timed in the same client process
    (issue 11's bar: >= 0.5x that copy at 64 MiB)."""
    records = []
    for where in ("host", "gpu"):
        port = free_port()
        master = subprocess.Popen([find_master(), "--host", "127.0.0.1", "--port", str(port),
                                   "--metrics-port", "0", "--rebuild-quiet-ms", "200"],
                                  stdout=subprocess.PIPE, text=True)
        stop, ready = ctx.Event(), ctx.Event()
        try:
            if "ready" not in master.stdout.readline():
                sys.exit("store_bench: mooncake_master did not start")
            addr = f"127.0.0.1:{port}"
            holder = ctx.Process(target=gpu_holder, daemon=True,
                                 args=(addr, 2 * max(sizes) + (16 << 20), device, where, ready,
                                       stop))
            holder.start()
            if not ready.wait(60):
                sys.exit("store_bench: the GPU holder did not set up")
            for size in sizes:
                q = ctx.Queue()
                c = ctx.Process(target=gpu_client, args=(addr, device, size, iters, q))
                c.start()
                r = q.get(timeout=600)
                c.join(60)
                if "error" in r:
                    sys.exit(f"store_bench: the GPU client failed: {r['error']}")
                p50, d50 = pct(r["get_into"], 50), pct(r["d2d"], 50)
                rec = {"op": "get_into_gpu", "segment": where, "device": r["layer"],
                       "bytes": size, "iters": iters, "p50_us": p50 * 1e6,
                       "p99_us": pct(r["get_into"], 99) * 1e6, "gbps": size / p50 / 1e9,
                       "d2d_p50_us": d50 * 1e6, "d2d_gbps": size / d50 / 1e9,
                       "vs_d2d": d50 / p50}
                records.append(rec)
                print(f"get_into a GPU buffer from a {where} segment ({r['layer']}), "
                      f"{size >> 10} KiB: p50 {p50 * 1e6:.1f} us ({rec['gbps']:.2f} GB/s); the "
                      f"device's own copy {d50 * 1e6:.1f} us ({rec['d2d_gbps']:.2f} GB/s): "
                      f"{rec['vs_d2d']:.2f}x", flush=True)
        finally:
            stop.set()
            master.terminate()
            master.wait(10)
    return records


# ---------------------------------------------------------------- main

def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def merge_runs(runs):
    """runs: one list of rows per repetition (same system/op/bytes/clients in each). One row per
    point with the median ops/s, p50 and p99, and every run's figures under "runs"."""
    out = []
    for i, row in enumerate(runs[0]):
        same = [r[i] for r in runs]
        m = dict(row)
        for k in ("ops_per_s", "gbps", "p50_us", "p99_us"):
            m[k] = round(median([x[k] for x in same]), 3 if k == "gbps" else 1)
        m["runs"] = [{k: x[k] for k in ("ops_per_s", "p50_us", "p99_us")} for x in same]
        out.append(m)
    return out


def print_row(r):
    print(f"{r['system']:9s} {r['op']:9s} {r['bytes']:>9d} B x{r['clients']} "
          f"{r['ops_per_s']:>10.1f} ops/s {r['gbps']:>7.3f} GB/s "
          f"p50 {r['p50_us']:>9.1f} us p99 {r['p99_us']:>9.1f} us", flush=True)


# ---------------------------------------------------------------- failover

def http_json(url, body):
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())


def scrape(port):
    import urllib.request
    out = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, _, v = line.rpartition(" ")
                    out[k] = float(v)
    except Exception:  # noqa: BLE001  (a dead or busy master)
        pass
    return out


def start_etcd(tmp):
    if not shutil.which("etcd"):
        sys.exit("store_bench: --failover needs etcd (Debian: etcd-server)")
    cport, pport = free_port(), free_port()
    c, p = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    proc = subprocess.Popen(["etcd", "--name", "bench", "--data-dir", os.path.join(tmp, "etcd"),
                             "--listen-client-urls", c, "--advertise-client-urls", c,
                             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                             "--initial-cluster", f"bench={p}", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            http_json(c + "/v3/kv/range", {"key": "eA=="})
            return proc, f"127.0.0.1:{cport}"
        except Exception:  # noqa: BLE001
            time.sleep(0.05)
    proc.kill()
    sys.exit("store_bench: etcd did not start")


def fo_value(key):
    import hashlib
    return hashlib.sha256(key.encode()).digest() * 128  # 4 KiB, checkable from the key


def failover_writer(addr, before, max_keys, ready, stop, out):
    st = _mc_store(addr, 0)
    # t_starts / t_acks: when each acknowledged put started / returned. A put in flight when
    # the leader is killed may still be acknowledged by it, so the first put started after the
    # kill is the first the new leader served. At most max_keys puts, so that eviction (not
    # failover) never drops an acknowledged key.
    acked, t_starts, t_acks, n = [], [], [], 0
    while not stop.is_set():
        if len(acked) >= max_keys:
            time.sleep(0.01)
            continue
        key = f"fo/{n}"
        n += 1
        t = time.monotonic()
        if st.put(key, fo_value(key)) == 0:
            acked.append(key)
            t_starts.append(t)
            t_acks.append(time.monotonic())
            if len(acked) == before:
                ready.set()
    lost = sum(1 for k in acked if st.get(k) != fo_value(k))
    st.close()
    out.put({"acked": acked, "t_starts": t_starts, "t_acks": t_acks, "lost": lost})


def run_failover(ctx, rounds, ttl_s):
    import tempfile
    rows = []
    tmp = tempfile.mkdtemp(prefix="mc_bench_fo_")
    etcd, ep = start_etcd(tmp)
    try:
        for k in range(rounds):
            cluster = f"bench-failover-{k}"
            os.environ["MC_STORE_CLUSTER_ID"] = cluster  # the clients' cluster (inherited)
            masters = []
            for i in range(3):
                mport = free_port()
                proc = subprocess.Popen(
                    [find_master(), "--host", "127.0.0.1", "--port", str(free_port()),
                     "--metrics-port", str(mport), "--etcd-endpoints", ep, "--cluster-id", cluster,
                     "--leader-ttl-s", str(ttl_s), "--name", f"m{i}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                if "ready" not in proc.stdout.readline():
                    sys.exit("store_bench: a master did not start")
                masters.append((proc, mport))

            def leader():
                for i, (proc, mport) in enumerate(masters):
                    if proc.poll() is None and \
                            scrape(mport).get('mooncake_store_master_role{role="serving"}') == 1:
                        return i
                return -1

            deadline = time.monotonic() + 30
            while leader() < 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            first = leader()
            addr = f"etcd://{ep}"
            hstop, hready = ctx.Event(), ctx.Event()
            seg = 1 << 30
            holder = ctx.Process(target=holder_main, args=(addr, seg, hready, hstop), daemon=True)
            holder.start()
            if not hready.wait(60):
                sys.exit("store_bench: failover holder did not set up")
            stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
            before = 2000
            max_keys = seg // 2 // (4096 + 256)  # half the segment: far below its watermark
            w = ctx.Process(target=failover_writer,
                            args=(addr, before, max_keys, ready, stop, out))
            w.start()
            if not ready.wait(120):
                sys.exit("store_bench: failover writer made no progress")
            t_kill = time.monotonic()
            masters[first][0].kill()
            masters[first][0].wait()
            t_serving = None
            while time.monotonic() < t_kill + 60:
                if leader() >= 0:
                    t_serving = time.monotonic()
                    break
                time.sleep(0.02)
            time.sleep(3)
            stop.set()
            res = out.get(timeout=300)
            w.join()
            hstop.set()
            holder.join(30)
            new = leader()
            m = scrape(masters[new][1]) if new >= 0 else {}
            after = [a for s, a in zip(res["t_starts"], res["t_acks"]) if s > t_kill]
            n_before = sum(1 for t in res["t_acks"] if t <= t_kill)
            row = {"system": "mooncake", "op": "failover", "leader_ttl_s": ttl_s,
                   "kill_to_first_put_s": round(after[0] - t_kill, 3) if after else None,
                   "kill_to_new_leader_serving_s":
                       round(t_serving - t_kill, 3) if t_serving else None,
                   "rebuild_s": m.get("mooncake_store_rebuild_duration_seconds"),
                   "objects_recovered": m.get("mooncake_store_objects_recovered_total"),
                   "acked_before_kill": n_before, "acked_total": len(res["acked"]),
                   "lost": res["lost"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            for proc, _ in masters:
                proc.terminate()
                proc.wait()
    finally:
        etcd.terminate()
        etcd.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in rows if r["kill_to_first_put_s"] is not None]
    summary = {"system": "mooncake", "op": "failover", "leader_ttl_s": ttl_s, "rounds": len(rows),
               "kill_to_first_put_s": median([r["kill_to_first_put_s"] for r in ok]) if ok else None,
               "lost": sum(r["lost"] for r in rows), "runs": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    return [summary]


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--compare", default="redis", help="redis or none")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per point, alternating systems; medians reported")
    ap.add_argument("--json", default="")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--segment-bytes", default="2G", help="memory the holder lends")
    ap.add_argument("--trace", default="")
    ap.add_argument("--trace-limit", type=int, default=0, help="requests replayed (0: all)")
    ap.add_argument("--block-bytes", default="64K")
    ap.add_argument("--capacity-bytes", default="256M")
    ap.add_argument("--failover", action="store_true", help="the failover rows only")
    ap.add_argument("--failover-repeat", type=int, default=3)
    ap.add_argument("--leader-ttl-s", type=int, default=3)
    ap.add_argument("--gpu", default="", metavar="DEVICE",
                    help="sim or cuda: get_into a GPU buffer from host and GPU segments against "
                         "the device's own copy (--sizes, default 64M; --gpu-iters)")
    ap.add_argument("--gpu-iters", type=int, default=20)
    args = ap.parse_args()

    # The engine's defaults, MC_SPIN_US included (recorded as spin_us). Earlier versions set
    # MC_SPIN_US=0 on boxes of 4 cores or fewer, from a measurement made when the waits spun
    # without yielding; since they yield between polls, the default is faster here at 1 and 4
    # clients alike (docs/perf/store.md).
    spin_us = int(os.environ.get("MC_SPIN_US", "50"))
    ctx = mp.get_context("spawn")
    if args.gpu:
        sizes = [parse_size(x) for x in (args.sizes if "--sizes" in sys.argv else "64M").split(",")]
        records = run_gpu(ctx, args.gpu, sizes, args.gpu_iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
        return
    if args.failover:
        records = run_failover(ctx, args.failover_repeat, args.leader_ttl_s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
        return
    records = []
    master_port = free_port()
    # A fresh master waits --rebuild-quiet-ms for clients of an earlier run to report what they
    # hold (a restart); there are none here.
    master = subprocess.Popen([find_master(), "--host", "127.0.0.1", "--port", str(master_port),
                               "--metrics-port", "0", "--lease-ttl-ms", "200",
                               "--rebuild-quiet-ms", "200"],
                              stdout=subprocess.PIPE, text=True)
    redis_proc = None
    try:
        line = master.stdout.readline()
        if "ready" not in line:
            sys.exit("store_bench: mooncake_master did not start")
        addr = f"127.0.0.1:{master_port}"
        stop = ctx.Event()
        ready = ctx.Event()
        seg = parse_size(args.capacity_bytes) if args.trace else parse_size(args.segment_bytes)
        # daemon: a failed run must not leave the interpreter waiting for it at exit
        holder = ctx.Process(target=holder_main, args=(addr, seg, ready, stop), daemon=True)
        holder.start()
        if not ready.wait(60):
            sys.exit("store_bench: holder did not set up")

        if args.trace:
            rec = replay_trace(addr, args.trace, parse_size(args.block_bytes), args.trace_limit)
            records.append(rec)
            print(json.dumps(rec))
        else:
            if args.compare == "redis":
                if not shutil.which("redis-server"):
                    sys.exit("store_bench: redis-server not installed")
                rport = free_port()
                redis_proc = subprocess.Popen(
                    ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--protected-mode", "no"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                import redis
                for _ in range(100):
                    try:
                        redis.Redis(port=rport).ping()
                        break
                    except Exception:  # noqa: BLE001
                        time.sleep(0.05)
            sizes = [parse_size(s) for s in args.sizes.split(",") if s]
            for nclients in [int(c) for c in args.clients.split(",") if c]:
                for i, size in enumerate(sizes):
                    iters = iters_for(size, args.scale)
                    ops = ["put", "get", "get_into"] + (["batch_put", "batch_get"]
                                                        if i == 0 else [])
                    mc_runs, redis_runs = [], []
                    for rep in range(max(1, args.repeat)):
                        # Alternate which system goes first, so that drifts in the machine's
                        # load hit both alike.
                        order = ["mooncake", "redis"] if rep % 2 == 0 else ["redis", "mooncake"]
                        for system in order:
                            if system == "mooncake":
                                res = run_clients(ctx, mc_worker,
                                                  lambda w: (addr, w, size, iters, ops), nclients)
                                mc_runs.append(summarize("mooncake", res, size, nclients))
                            elif redis_proc is not None:
                                res = run_clients(ctx, redis_worker,
                                                  lambda w: (rport, w, size, iters, ops), nclients)
                                redis_runs.append(summarize("redis", res, size, nclients))
                    recs = merge_runs(mc_runs) + (merge_runs(redis_runs) if redis_runs else [])
                    for r in recs:
                        print_row(r)
                        r["spin_us"] = spin_us if r["system"] == "mooncake" else None
                    records += recs
        stop.set()
        holder.join(30)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        master.terminate()
        master.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
