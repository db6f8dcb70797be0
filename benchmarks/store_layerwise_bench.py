#!/usr/bin/python3
"""Layer-wise store benchmark: vLLM's layer-wise KV path against whole-object calls, same run.

  PYTHONPATH=build/python /usr/bin/python3 benchmarks/store_layerwise_bench.py --iters 30 \
      --json out.json

Topology as store_bench.py's (one host): a standalone mooncake_master and one holder process
that lends the store's memory; one client (this process) that lends nothing. --keys objects of
--layers x --page bytes, saved layer by layer through a put session (one
batch_put_from_multi_buffer_ranges per layer, then the end) against one
batch_put_from_multi_buffers of the whole objects after the last layer, and loaded layer by
layer (batch_get_session_start: one replica-list call for all keys, then per layer one
batch_get_into_multi_buffer_ranges, which reads from those lists, then batch_get_session_end)
against the same ranges read key by key (get_ranges: one replica-list call per key and layer,
what batch_get_into_multi_buffer_ranges did before) and one batch_get_into_multi_buffers of the
whole objects. Rows "layerwise_*": p50/p99 milliseconds per request (all layers, all keys) and
vs_whole, the p50 against the whole-object row of the same direction.
"""
import argparse
import ctypes
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

from store_bench import _mc_store, find_master, free_port, holder_main, parse_size, pct


def run_layerwise(addr, nkeys, layers, page, iters):
    """Times vLLM's layer-wise save and load against whole-object calls (module docstring)."""
    st = _mc_store(addr, 0)
    size = layers * page
    src = (ctypes.c_ubyte * (nkeys * size)).from_buffer_copy(os.urandom(nkeys * size))
    dst = (ctypes.c_ubyte * (nkeys * size))()
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    assert st.register_buffer(sp, nkeys * size) == 0 and st.register_buffer(dp, nkeys * size) == 0
    # The cache holds, per layer, that layer's page of every key.
    at = [[sp + (layer * nkeys + k) * page for k in range(nkeys)] for layer in range(layers)]
    into = [[dp + (layer * nkeys + k) * page for k in range(nkeys)] for layer in range(layers)]
    want = bytes(src)
    out, run = [], [0]

    def keys_of():
        run[0] += 1
        return [f"lw/{run[0]}/{k}" for k in range(nkeys)]

    def save_session(keys):
        assert st.batch_put_session_start(keys, [size] * nkeys) == [0] * nkeys
        for layer in range(layers):
            got = st.batch_put_from_multi_buffer_ranges(
                keys, [[at[layer][k]] for k in range(nkeys)], [[page]] * nkeys,
                [[layer * page]] * nkeys)
            assert got == [page] * nkeys, got
        assert st.batch_put_session_end(keys) == [0] * nkeys

    def save_whole(keys):
        got = st.batch_put_from_multi_buffers(
            keys, [[at[layer][k] for layer in range(layers)] for k in range(nkeys)],
            [[page] * layers] * nkeys)
        assert got == [0] * nkeys, got

    def load_batched(keys):  # as vLLM: a read session around the layers' range reads
        assert st.batch_get_session_start(keys) == [0] * nkeys
        for layer in range(layers):
            got = st.batch_get_into_multi_buffer_ranges(
                keys, [[into[layer][k]] for k in range(nkeys)], [[page]] * nkeys,
                [[layer * page]] * nkeys)
            assert got == [page] * nkeys, got
        assert st.batch_get_session_end(keys) == 0

    def load_per_key(keys):
        for layer in range(layers):
            for k, key in enumerate(keys):
                assert st._c.get_ranges(key, [into[layer][k]], [layer * page], [page]) == [page]

    def load_whole(keys):
        got = st.batch_get_into_multi_buffers(
            keys, [[into[layer][k] for layer in range(layers)] for k in range(nkeys)],
            [[page] * layers] * nkeys)
        assert got == [size] * nkeys, got

    saved = []
    for name, fn in (("layerwise_save_session", save_session), ("layerwise_save_whole", save_whole)):
        times = []
        for i in range(iters + 2):
            keys = keys_of()
            t = time.perf_counter()
            fn(keys)
            if i >= 2:
                times.append(time.perf_counter() - t)
            saved.append(keys)
        out.append({"system": "mooncake", "op": name, "keys": nkeys, "layers": layers,
                    "page": page, "p50_ms": pct(times, 50) * 1e3, "p99_ms": pct(times, 99) * 1e3})
    keys = saved[-1]
    for name, fn in (("layerwise_load_batched", load_batched),
                     ("layerwise_load_per_key", load_per_key),
                     ("layerwise_load_whole", load_whole)):
        times = []
        for i in range(iters + 2):
            ctypes.memset(dp, 0, nkeys * size)
            t = time.perf_counter()
            fn(keys)
            if i >= 2:
                times.append(time.perf_counter() - t)
            assert bytes(dst) == want, name + " read wrong bytes"
        out.append({"system": "mooncake", "op": name, "keys": nkeys, "layers": layers,
                    "page": page, "p50_ms": pct(times, 50) * 1e3, "p99_ms": pct(times, 99) * 1e3})
    for rec in out:  # against the whole-object call of the same direction, same run
        base = "_".join(rec["op"].split("_")[:2]) + "_whole"
        rec["vs_whole"] = rec["p50_ms"] / next(r["p50_ms"] for r in out if r["op"] == base)
    st.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--page", default="16K")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--segment-bytes", default="2G", help="memory the holder lends")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    port = free_port()
    # The master as store_bench.py starts it (200 ms read leases, a short rebuild wait).
    master = subprocess.Popen([find_master(), "--host", "127.0.0.1", "--port", str(port),
                               "--metrics-port", "0", "--lease-ttl-ms", "200",
                               "--rebuild-quiet-ms", "200"],
                              stdout=subprocess.PIPE, text=True)
    records = []
    try:
        if "ready" not in master.stdout.readline():
            sys.exit("store_layerwise_bench: mooncake_master did not start")
        addr = f"127.0.0.1:{port}"
        stop, ready = ctx.Event(), ctx.Event()
        holder = ctx.Process(target=holder_main,
                             args=(addr, parse_size(args.segment_bytes), ready, stop), daemon=True)
        holder.start()
        if not ready.wait(60):
            sys.exit("store_layerwise_bench: holder did not set up")
        for rec in run_layerwise(addr, args.keys, args.layers, parse_size(args.page), args.iters):
            records.append(rec)
            print(json.dumps(rec))
        stop.set()
        holder.join(30)
    finally:
        master.terminate()
        master.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
