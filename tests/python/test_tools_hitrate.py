"""mooncake-hitrate: the cache model against hand-worked traces and an independent reference,
the command line (JSON rows, PNG), and the model against a real store (mooncake_master) on
the same slice of the FAST'25 synthetic trace: they must agree within 2 points."""
import json
import os
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import free_port, master_bin  # noqa: E402

hr = pytest.importorskip("mooncake.tools.hitrate")

HERE = os.path.dirname(os.path.abspath(__file__))
# The FAST'25 synthetic trace lives beside the checkout (../shared/data), not in it.
TRACE = os.path.realpath(os.path.join(HERE, "..", "..", "..", "shared", "data",
                                      "synthetic_trace.jsonl"))
if not os.path.exists(TRACE):
    TRACE = "/work/shared/data/synthetic_trace.jsonl"
need_trace = pytest.mark.skipif(not os.path.exists(TRACE), reason="synthetic trace not found")


def test_lru_fifo_lfu_by_hand():
    # Capacity 3, blocks counted per request: 2 + 1 + 2 + 1 + 3 = 9.
    # LRU: r2 hits 1,2 (2) and refreshes them; r3 inserts 4 evicting 3 (least recent);
    #      r4 hits 1,2 (2), misses 5 -> 4 hits.
    # FIFO: r2 hits 1,2 (2) without refreshing; r3 evicts 1 (oldest); r4 misses at 1 -> 0,
    #      so 2 hits in all.
    # LFU: after r2, 1 and 2 were used twice, 3 once; r3 evicts 3; r4 hits 1,2 -> 4 hits.
    # Infinite cache: r2 hits 2, r4 hits 1,2 (5 is new) -> 4.
    reqs = [[1, 2], [3], [1, 2], [4], [1, 2, 5]]
    assert hr.simulate(reqs, "lru", 3) == (4, 9)
    assert hr.simulate(reqs, "fifo", 3) == (2, 9)
    assert hr.simulate(reqs, "lfu", 3) == (4, 9)
    assert hr.max_hits(reqs) == (4, 9)
    # Capacity 2: LRU evicts the twice-used 1 when 3 arrives, LFU evicts 2 (used once).
    # LRU: r1 hit; r3 evicts 1; r4 misses 1 -> 1 hit. LFU: r1 hit; r3 evicts 2; r4 hits 1;
    # r5 misses 2 -> 2 hits. FIFO as LRU here -> 1. Infinite: r1, r4, r5 -> 3 of 6.
    reqs = [[1], [1], [2], [3], [1], [2]]
    assert hr.simulate(reqs, "lru", 2) == (1, 6)
    assert hr.simulate(reqs, "lfu", 2) == (2, 6)
    assert hr.simulate(reqs, "fifo", 2) == (1, 6)
    assert hr.max_hits(reqs) == (3, 6)


def test_hits_stop_at_the_first_miss():
    # r1 shares blocks 2 and 3 with r0 but not block 0 (id 9): a block's KV needs its whole
    # prefix, so r1 has no hit at all.
    reqs = [[1, 2, 3], [9, 2, 3], [1, 2, 7]]
    assert hr.max_hits(reqs) == (2, 9)
    assert hr.simulate(reqs, "lru", 100) == (2, 9)
    assert hr.simulate(reqs, "lru", 0) == (0, 9)


def _reference_lru_hits(reqs, cap):
    """A list-based LRU written independently of the tool (slow, obviously right)."""
    cache, hits = [], 0
    for ids in reqs:
        for h in ids:
            if h not in cache:
                break
            hits += 1
        for h in ids:
            if h in cache:
                cache.remove(h)
            elif len(cache) >= cap:
                cache.pop(0)
            cache.append(h)
    return hits


@need_trace
def test_model_matches_reference_on_the_trace():
    reqs = hr.load_trace(TRACE, limit=150)
    for cap in (200, 1000):
        assert hr.simulate(reqs, "lru", cap)[0] == _reference_lru_hits(reqs, cap)
    unique = len({h for ids in reqs for h in ids})
    assert hr.simulate(reqs, "lru", unique) == hr.max_hits(reqs)  # room for all: the maximum


@need_trace
def test_cli_json_rows_and_plot(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "hit.png"
    r = subprocess.run([sys.executable, "-m", "mooncake.tools.hitrate", TRACE, "--limit", "300",
                        "--capacity-blocks", "500,2000", "--policy", "lru,fifo,lfu",
                        "--json", str(out), "--plot", str(png), "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(x["policy"], x["capacity_blocks"]) for x in rows] == [
        ("lru", 500), ("fifo", 500), ("lfu", 500), ("lru", 2000), ("fifo", 2000), ("lfu", 2000)]
    reqs = hr.load_trace(TRACE, limit=300)
    mh, total = hr.max_hits(reqs)
    for x in rows:
        for k in ("policy", "capacity_blocks", "hit_rate", "max_hit_rate"):
            assert k in x
        assert x["max_hit_rate"] == pytest.approx(mh / total)
        assert 0 <= x["hit_rate"] <= x["max_hit_rate"]
        hits, tot = hr.simulate(reqs, x["policy"], x["capacity_blocks"])
        assert x["hit_rate"] == pytest.approx(hits / tot) and x["blocks"] == total
    lru = {x["capacity_blocks"]: x["hit_rate"] for x in rows if x["policy"] == "lru"}
    assert lru[2000] > lru[500]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --capacity in bytes with --model: 64 GiB of Llama 3 70B bf16 is 409 blocks of 160 MiB.
    r = subprocess.run([sys.executable, "-m", "mooncake.tools.hitrate", TRACE, "--limit", "50",
                        "--capacity", "64GiB", "--model", "llama-3-70b", "--policy", "lru",
                        "--json", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["capacity_blocks"] == 409 and row["capacity_bytes"] == 409 * 160 * (1 << 20)


@need_trace
@pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
@pytest.mark.isolated
def test_model_and_store_agree(tmp_path):
    """The same trace slice and capacity through the cache model (LRU) and through a real
    store: a standalone mooncake_master and one client (the tool) lending exactly
    capacity x 4 KiB. The master evicts one object at a time when a put finds no room
    (high watermark 1.0, a ratio that rounds to one object) and grants no read leases, so
    its eviction is LRU over exactly `capacity` blocks, as in the model."""
    env = dict(os.environ, MC_SECRET=secrets.token_hex(16))
    env.pop("PYTHONPATH", None)
    port = free_port()
    master = subprocess.Popen(
        [master_bin(), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
         "--eviction-high-watermark", "1.0", "--eviction-ratio", "0.000001",
         "--lease-ttl-ms", "0"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = master.stdout.readline()
        assert "ready" in line, line
        out = tmp_path / "store.json"
        # Requests 3001..3400 (16,143 blocks, 9,597 distinct): by then the trace reuses a lot
        # (infinite-cache hit rate 40.6%), so both capacities evict and miss reusable blocks.
        r = subprocess.run([sys.executable, "-m", "mooncake.tools.hitrate", TRACE,
                            "--skip", "3000", "--limit", "400", "--capacity-blocks", "1000,4000",
                            "--policy", "lru",
                            "--store", f"127.0.0.1:{port}", "--block-bytes", "4096",
                            "--json", str(out), "--no-progress"],
                           capture_output=True, text=True, timeout=600, cwd="/", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = json.loads(out.read_text())["rows"]
    finally:
        master.terminate()
        master.wait(10)
    print(r.stdout)
    by = {(x["policy"], x["capacity_blocks"]): x for x in rows}
    for cap in (1000, 4000):
        model, store = by[("lru", cap)], by[("store", cap)]
        assert store["bad_reads"] == 0 and store["put_errors"] == {}, store
        assert store["blocks"] == model["blocks"]
        # Eviction has to matter for the comparison to mean anything.
        assert model["hit_rate"] < model["max_hit_rate"] - 0.02, model
        assert abs(store["hit_rate"] - model["hit_rate"]) <= 0.02, (model, store)
