"""``mooncake-hitrate``: prefix-cache hit rate of a trace, against a cache model or a real store.

    mooncake-hitrate TRACE --capacity-blocks 1000,4000 --policy lru,fifo --json out.json
    mooncake-hitrate TRACE --capacity 64GiB,256GiB --model llama-3-70b --plot out.png
    mooncake-hitrate TRACE --capacity-blocks 2000 --store 127.0.0.1:50051 --limit 500

TRACE is Mooncake's FAST'25 format: one JSON object a line with ``timestamp``,
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block; equal ids are
reusable prefix blocks).

Hit rate is counted in blocks over all requests in trace order. A request's hit blocks are its
leading ``hash_ids`` found in the cache, up to the first miss (a block's KV is usable only with
its whole prefix); then all its blocks are inserted or refreshed in the cache, evicting as the
policy says. The infinite-cache maximum is the same replay with unbounded capacity (a block
hits when it was seen before as part of the same prefix chain).

Policies of the model: ``lru`` (evict the least recently used block; a hit or re-insert
refreshes), ``fifo`` (evict the oldest insertion; hits do not refresh), ``lfu`` (evict the
least frequently used block, the least recent among equals).

``--store HOST:PORT`` replays against a running store instead (the master's address, as
``MooncakeDistributedStore.setup`` takes it): for each request it gets the leading blocks until
the first miss, then puts the missing blocks (a block already present is read again, which
refreshes it), checking every byte read. The replay client lends memory for exactly
``capacity_blocks`` blocks (their bytes and the store's record in front of each), and for each capacity it starts afresh (new client, keys under a new
prefix, the old ones removed). Its hit rate is the store's own policy (LRU with watermark
eviction; docs/store.md); it equals the model's ``lru`` when the replay client's memory is all
the store has and the master evicts one object at a time (``--eviction-high-watermark 1
--eviction-ratio 0.000001 --lease-ttl-ms 0``; see docs/tools.md).
"""

import argparse
import collections
import json
import os
import sys
import time

from . import kv_size

# ---------------------------------------------------------------- trace


def load_trace(path, limit=None, skip=0):
    """The hash_ids of each request, in trace order: `limit` requests after the first
    `skip` (a slice of the trace; blocks seen before the slice are not in the cache)."""
    reqs = []
    seen = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            seen += 1
            if seen <= skip:
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace line ({e})") from None
            reqs.append([int(h) for h in ids])
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


# ---------------------------------------------------------------- policies


class LRU:
    name = "lru"

    def __init__(self, capacity):
        self.capacity = capacity
        self.d = collections.OrderedDict()

    def __contains__(self, k):
        return k in self.d

    def access(self, k):
        d = self.d
        if k in d:
            d.move_to_end(k)
            return
        if self.capacity <= 0:
            return
        if len(d) >= self.capacity:
            d.popitem(last=False)
        d[k] = None


class FIFO(LRU):
    name = "fifo"

    def access(self, k):
        d = self.d
        if k in d or self.capacity <= 0:
            return
        if len(d) >= self.capacity:
            d.popitem(last=False)
        d[k] = None


class LFU:
    """O(1) LFU: one recency-ordered bucket per use count; ties evict the least recent."""

    name = "lfu"

    def __init__(self, capacity):
        self.capacity = capacity
        self.freq = {}
        self.buckets = collections.defaultdict(collections.OrderedDict)
        self.min_freq = 0

    def __contains__(self, k):
        return k in self.freq

    def access(self, k):
        f = self.freq.get(k)
        if f is not None:
            b = self.buckets[f]
            del b[k]
            if not b:
                del self.buckets[f]
                if self.min_freq == f:
                    self.min_freq = f + 1
            self.freq[k] = f + 1
            self.buckets[f + 1][k] = None
            return
        if self.capacity <= 0:
            return
        if len(self.freq) >= self.capacity:
            b = self.buckets[self.min_freq]
            victim, _ = b.popitem(last=False)
            if not b:
                del self.buckets[self.min_freq]
            del self.freq[victim]
        self.freq[k] = 1
        self.buckets[1][k] = None
        self.min_freq = 1


POLICIES = {c.name: c for c in (LRU, FIFO, LFU)}


def leading_hits(ids, cache):
    n = 0
    for h in ids:
        if h not in cache:
            break
        n += 1
    return n


def simulate(reqs, policy, capacity, tick=None):
    """(hit blocks, total blocks) of the model cache."""
    cache = POLICIES[policy](capacity)
    hits = total = 0
    for i, ids in enumerate(reqs):
        hits += leading_hits(ids, cache)
        total += len(ids)
        for h in ids:
            cache.access(h)
        if tick is not None and i % 256 == 255:
            tick(256)
    if tick is not None:
        tick(len(reqs) % 256)
    return hits, total


def max_hits(reqs):
    """Hits of an unbounded cache (the most any policy can get)."""
    seen = set()
    hits = total = 0
    for ids in reqs:
        hits += leading_hits(ids, seen)
        total += len(ids)
        seen.update(ids)
    return hits, total


# ---------------------------------------------------------------- store replay


def _payload(key, size):
    """Deterministic bytes of a block, so that every read can be checked."""
    seed = (key + "|").encode()
    return (seed * (size // len(seed) + 1))[:size]


class StoreReplay:
    """Replays requests against a running store through one MooncakeDistributedStore client
    that lends memory for exactly capacity_blocks blocks: capacity_blocks x (block_bytes + the
    store's record and key in front of each object, mooncake.store.object_footprint)."""

    def __init__(self, address, capacity_blocks, block_bytes, run_id):
        from ..store import ErrorCode, MooncakeDistributedStore, object_footprint

        self.E = ErrorCode
        self.block_bytes = block_bytes
        self.prefix = f"mc-hitrate/{run_id}/"
        self.s = MooncakeDistributedStore()
        # Block ids are 64-bit hashes: at most 20 digits after the prefix.
        per_block = object_footprint(len(self.prefix) + 20, block_bytes)
        rc = self.s.setup("mooncake-hitrate", "", capacity_blocks * per_block,
                          max(16 << 20, 2 * block_bytes), "tcp", "",
                          address)
        if rc != 0:
            name = ErrorCode(rc).name if rc in ErrorCode._value2member_map_ else str(rc)
            raise RuntimeError(f"store at {address}: setup failed with {name} ({rc}); is the "
                               "master running there (mooncake_master --port ...)?")
        self.bad_reads = 0
        self.put_errors = collections.Counter()

    def _get(self, h):
        key = self.prefix + str(h)
        v = self.s.get(key)
        if not v:
            return False
        if v != _payload(key, self.block_bytes):
            self.bad_reads += 1
        return True

    def request(self, ids):
        hits = 0
        for h in ids:
            if not self._get(h):
                break
            hits += 1
        for h in ids[hits:]:
            key = self.prefix + str(h)
            rc = self.s.put(key, _payload(key, self.block_bytes))
            if rc == self.E.OBJECT_ALREADY_EXISTS:
                self._get(h)  # present behind a miss: a read refreshes it, as the model does
            elif rc != 0:
                self.put_errors[self.E(rc).name if rc in self.E._value2member_map_ else rc] += 1
        return hits

    def close(self):
        self.s.remove_by_regex("^" + self.prefix + ".*", True)  # [a-z0-9/-]: no escaping
        self.s.close()


def replay_store(reqs, address, capacity_blocks, block_bytes, run_id, tick=None):
    r = StoreReplay(address, capacity_blocks, block_bytes, run_id)
    try:
        hits = total = 0
        for i, ids in enumerate(reqs):
            hits += r.request(ids)
            total += len(ids)
            if tick is not None and i % 16 == 15:
                tick(16)
        if tick is not None:
            tick(len(reqs) % 16)
        return hits, total, r.bad_reads, dict(r.put_errors)
    finally:
        r.close()


# ---------------------------------------------------------------- progress


class _Progress:
    """tqdm when it is installed (shown only once a run takes longer than 2 s), else a plain
    line on stderr every 5 s."""

    def __init__(self, total, enabled):
        self.bar = None
        self.total, self.done, self.t0, self.last = total, 0, time.time(), time.time()
        self.enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", delay=2.0, mininterval=0.5, file=sys.stderr,
                            dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def set(self, desc):
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
        self.desc = desc

    def __call__(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.time() - self.last >= 5:
            self.last = time.time()
            print(f"mooncake-hitrate: {self.done}/{self.total} requests replayed "
                  f"({getattr(self, 'desc', '')})", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- output


def write_plot(path, rows, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity_blocks"], 100 * r["hit_rate"]) for r in rows
                     if r["policy"] == pol)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
    mx = 100 * rows[0]["max_hit_rate"]
    ax.axhline(mx, linestyle="--", color="gray", label=f"infinite cache ({mx:.1f}%)")
    caps = [r["capacity_blocks"] for r in rows if r["capacity_blocks"] > 0]
    if caps and max(caps) > 10 * min(caps):
        ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("hit rate (% of blocks)")
    ax.set_ylim(0, max(5, mx * 1.1))
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="mooncake-hitrate",
        description="Prefix-cache hit rate of a FAST'25-format trace (model or real store).")
    ap.add_argument("trace", help="JSONL trace (timestamp, input_length, output_length, hash_ids)")
    ap.add_argument("--capacity-blocks", help="capacities in blocks, comma separated "
                    "(default: 1%%..100%% of the trace's unique blocks)")
    ap.add_argument("--capacity", help="capacities in bytes (e.g. 64GiB,256GiB); needs --model")
    ap.add_argument("--model", help="model for --capacity (built-in name or config.json)")
    ap.add_argument("--dtype", default="bf16", help="KV dtype for --capacity (default bf16)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size for --capacity")
    ap.add_argument("--block-tokens", type=int, default=kv_size.DEFAULT_BLOCK_TOKENS,
                    help="tokens per trace block (512 in the FAST'25 traces)")
    ap.add_argument("--policy", default="lru,fifo",
                    help=f"model policies, comma separated: {','.join(POLICIES)} "
                    "(default lru,fifo)")
    ap.add_argument("--skip", type=int, default=0, help="start after the first N requests "
                    "(the cache starts empty there)")
    ap.add_argument("--limit", type=int, help="replay only N requests")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--plot", help="write a PNG plot of hit rate against capacity")
    ap.add_argument("--store", metavar="HOST:PORT", help="also replay against the store whose "
                    "master is at HOST:PORT (rows with policy 'store')")
    ap.add_argument("--block-bytes", type=int, help="bytes per block put in the store (default: "
                    "the model's block with --model, else 4096)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)

    try:
        policies = [p.strip().lower() for p in a.policy.split(",") if p.strip()]
        for p in policies:
            if p not in POLICIES:
                raise ValueError(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")
        reqs = load_trace(a.trace, a.limit, a.skip)
        if not reqs:
            raise ValueError(f"{a.trace}: no requests")
        block_bytes = None
        if a.model:
            block_bytes = kv_size.kv_size(kv_size.lookup(a.model), dtype=a.dtype, tp=a.tp,
                                          block_tokens=a.block_tokens)["bytes_per_block"]
        caps = []
        if a.capacity:
            if not a.model:
                raise ValueError("--capacity needs --model (to turn bytes into blocks)")
            for c in a.capacity.split(","):
                caps.append(kv_size.parse_bytes(c) // block_bytes)
        if a.capacity_blocks:
            caps += _ints(a.capacity_blocks)
        mh, total = max_hits(reqs)
        unique = len({h for ids in reqs for h in ids})
        if not caps:
            caps = sorted({max(1, int(unique * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)})
        caps = sorted(set(caps))
        if a.store and a.block_bytes is None:
            a.block_bytes = block_bytes or 4096
    except (OSError, ValueError, KeyError) as e:
        print(f"mooncake-hitrate: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2

    max_rate = mh / total if total else 0.0
    where = f" {a.skip + 1}..{a.skip + len(reqs)}" if a.skip or a.limit else ""
    print(f"{os.path.basename(a.trace)}{where}: {len(reqs)} requests, {total} blocks "
          f"({a.block_tokens} tokens each), {unique} unique; infinite-cache hit rate "
          f"{100 * max_rate:.2f}%")
    runs = [(p, c) for c in caps for p in policies] + \
        ([("store", c) for c in caps] if a.store else [])
    prog = _Progress(len(reqs) * len(runs), enabled=not a.no_progress)
    rows = []
    t_start = time.time()
    try:
        for pol, cap in runs:
            prog.set(f"{pol} {cap} blocks")
            t0 = time.time()
            row = {"policy": pol, "capacity_blocks": cap}
            if pol == "store":
                hits, tot, bad, errs = replay_store(reqs, a.store, cap, a.block_bytes,
                                                    f"{os.getpid()}-{int(t0 * 1000)}-{cap}", prog)
                row.update(backend="store", block_bytes=a.block_bytes, bad_reads=bad,
                           put_errors=errs)
            else:
                hits, tot = simulate(reqs, pol, cap, prog)
                row["backend"] = "model"
            row.update(hit_rate=hits / tot if tot else 0.0, max_hit_rate=max_rate,
                       hit_blocks=hits, blocks=tot, requests=len(reqs),
                       seconds=round(time.time() - t0, 3))
            if block_bytes is not None:
                row["capacity_bytes"] = cap * block_bytes
            rows.append(row)
    except RuntimeError as e:
        prog.close()
        print(f"mooncake-hitrate: {e}", file=sys.stderr)
        return 1
    prog.close()

    print(f"{'policy':<8}{'capacity_blocks':>16}{'capacity':>12}{'hit_rate':>10}{'of max':>9}")
    for r in rows:
        capb = kv_size.human(r["capacity_bytes"]) if "capacity_bytes" in r else "-"
        of_max = r["hit_rate"] / max_rate if max_rate else 0.0
        print(f"{r['policy']:<8}{r['capacity_blocks']:>16}{capb:>12}"
              f"{100 * r['hit_rate']:>9.2f}%{100 * of_max:>8.1f}%")
        if r.get("bad_reads") or r.get("put_errors"):
            print(f"  store: {r['bad_reads']} reads with wrong bytes, put errors {r['put_errors']}")
    doc = {"trace": os.path.abspath(a.trace), "skip": a.skip, "requests": len(reqs),
           "blocks": total,
           "unique_blocks": unique, "block_tokens": a.block_tokens, "max_hit_rate": max_rate,
           "model": a.model, "dtype": a.dtype if a.model else None, "tp": a.tp if a.model else None,
           "seconds": round(time.time() - t_start, 3), "rows": rows}
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if a.plot:
        try:
            write_plot(a.plot, rows, f"{os.path.basename(a.trace)}: {len(reqs)} requests, "
                       f"{a.block_tokens}-token blocks")
        except ImportError:
            print("mooncake-hitrate: --plot needs matplotlib (apt install python3-matplotlib)",
                  file=sys.stderr)
            return 2
    bad = any(r.get("bad_reads") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
