"""The rest of upstream Mooncake Store's Python API, call by call, against a running master and a
holder process: setup's full signature (positional engine from mooncake.engine, config dict,
upstream keywords, refused features), return conventions (existing key, zero size, no local
buffer), buffers (get_buffer / batch_get_buffer / BufferPool), ranged reads, replica
descriptors and clears, the tensor family, the upsert family, and upserts racing readers in
another process (never a torn read)."""
import ctypes
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Holder, Master, master_bin  # noqa: E402

torch = pytest.importorskip("torch")
store_mod = pytest.importorskip("mooncake.store")
eng_mod = pytest.importorskip("mooncake.engine")
MooncakeDistributedStore = store_mod.MooncakeDistributedStore
ReplicateConfig, SoftPinAction = store_mod.ReplicateConfig, store_mod.SoftPinAction
E = store_mod.ErrorCode

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
MiB = 1 << 20


@pytest.fixture(scope="module")
def env():
    # Short read leases: the test that clears replicas waits one out.
    m = Master("--client-ttl-s", "3", env={"MC_STORE_LEASE_TTL_MS": "1000"})
    h = Holder(m.addr, 32 * MiB)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", m.addr) == 0
    yield m, h, s
    s.close()
    h.close()
    m.close()


def registered(s, n):
    buf = (ctypes.c_ubyte * n)()
    assert s.register_buffer(ctypes.addressof(buf), n) == 0
    return buf, ctypes.addressof(buf)


def test_setup_forms(env):
    m, h, _ = env
    # SGLang HiCache: 7 positional + the shared engine, local_hostname = its session id.
    te = eng_mod.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    s = MooncakeDistributedStore()
    assert s.setup(te.get_session_id(), "P2PHANDSHAKE", 4 * MiB, 4 * MiB, "rdma", "", m.addr,
                   te.get_engine()) == 0
    assert s.get_hostname() == te.get_session_id()
    assert s.put("shared-engine", b"via the transfer engine") == 0
    assert s.get("shared-engine") == b"via the transfer engine"
    s.close()
    # Upstream keywords (and a host with no port: the engine's port is appended).
    s = MooncakeDistributedStore()
    assert s.setup(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE",
                   global_segment_size=0, local_buffer_size=MiB, protocol="tcp",
                   rdma_devices="", master_server_addr=m.addr, engine=None) == 0
    host, port = s.get_hostname().rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert s.health_check() == 0
    s.close()
    assert s.health_check() == 1
    # The config dict (vLLM): strings, human-readable sizes.
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "4MB", "local_buffer_size": "2 MiB",
                    "protocol": "tcp", "rdma_devices": "", "master_server_addr": m.addr}) == 0
    assert s.put("dict", b"d" * 100) == 0 and s.get("dict") == b"d" * 100
    s.close()
    # The dict by keyword, as upstream binds it (py::arg("config")).
    s = MooncakeDistributedStore()
    assert s.setup(config={"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                           "global_segment_size": "0", "protocol": "tcp",
                           "master_server_addr": m.addr}) == 0
    assert s.health_check() == 0
    s.close()
    # mooncake.json's spellings (device_name, master_server_address), as vLLM's and SGLang's
    # config files have them: the master named there is the one used.
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": 0, "local_buffer_size": MiB, "protocol": "tcp",
                    "device_name": "", "master_server_address": m.addr}) == 0
    assert s.get("dict") == b"d" * 100
    s.close()
    # SGLang asks for the client HTTP server whenever its storage metrics are on: setup goes
    # on without one (logged), rather than stopping the store.
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 0, MiB, "tcp", "", m.addr, enable_client_http_server=True,
                   client_http_port=9301) == 0
    assert s.get("dict") == b"d" * 100
    s.close()
    for bad in ({"metadata_server": "x"}, {"local_hostname": "h", "metadata_server": "x",
                                           "local_buffer_size": "50%"},
                {"local_hostname": "h", "metadata_server": "x", "global_segment_size": "512"}):
        assert MooncakeDistributedStore().setup(bad) == E.INVALID_PARAMS, bad
    # Features this store lacks refuse when switched on, never silently.
    for kw in ({"enable_ssd_offload": True, "ssd_offload_path": "/tmp/x"},
               {"tenant_id": "team-a"}):
        assert MooncakeDistributedStore().setup("127.0.0.1", "", 0, MiB, "tcp", "", m.addr,
                                                **kw) == E.INVALID_PARAMS, kw
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup("h", "", 0, 0, "tcp", "", m.addr, None, False, "",
                                         "default", False, 9300, "one too many")
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup("h", "", 0, 0, "tcp", "", m.addr, engine="not one")
    assert MooncakeDistributedStore().setup("h", "", 0, 0, "ftp", "", m.addr) == E.INVALID_PARAMS


def test_return_conventions(env):
    m, h, s = env
    assert s.put("conv", b"first") == 0
    assert s.put("conv", b"second") == 0  # existing key: 0, the stored value stays
    assert s.get("conv") == b"first"
    assert s.put_batch(["conv", "conv2"], [b"x", b"y"]) == 0
    assert s.put("zero", b"") == E.INVALID_PARAMS
    buf, p = registered(s, 4096)
    assert s.batch_get_into(["conv", "missing"], [p, p + 1024], [1024, 1024]) == \
        [5, E.OBJECT_NOT_FOUND]
    # local_buffer_size=0: the calls that need the local buffer fail as upstream's.
    z = MooncakeDistributedStore()
    assert z.setup("127.0.0.1", "", 0, 0, "tcp", "", m.addr) == 0
    assert z.put("nolocal", b"v" * 10) != 0
    assert z.is_exist("nolocal") == 0
    assert z.get("conv") == b"" and z.get_buffer("conv") is None
    assert z.batch_get_buffer(["conv"]) == [None]
    zb, zp = registered(z, 4096)
    assert z.put_from("nolocal-from", zp, 64) == 0  # registered memory needs no local buffer
    assert z.get_into("conv", zp, 4096) == 5
    z.close()
    # get_hostname keeps replicas local (LMCache's preferred_segment).
    c = ReplicateConfig()
    c.preferred_segment = s.get_hostname()
    assert s.put("local-replica", b"L" * 1000, c) == 0
    desc = s.get_replica_desc("local-replica")
    assert len(desc) == 1 and desc[0].is_memory_replica()
    d = desc[0].get_memory_descriptor().buffer_descriptor
    assert d.transport_endpoint == s.get_hostname() and d.size == 1000
    assert s.unregister_buffer(p) == 0


def test_replicate_config(env):
    _, h, s = env
    c = ReplicateConfig()
    assert c.soft_pin_action == SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    assert "replica_num: 1" in str(c)
    with pytest.raises(AttributeError):
        c.no_such_field = 1
    with pytest.raises(TypeError):
        c.soft_pin_ttl_ms = -1
    c.soft_pin_ttl_ms = 1000
    assert s.put("ttl-preserve", b"x", c) == E.INVALID_PARAMS  # a ttl needs ENABLE
    c.soft_pin_action = SoftPinAction.ENABLE
    assert s.put("ttl-enable", b"x", c) == 0
    c = ReplicateConfig()
    c.nof_replica_num = 1
    assert s.put("nof", b"x", c) == E.INVALID_PARAMS
    c = ReplicateConfig()
    c.preferred_segments = [s.get_hostname()]
    assert s.put("pref-list", b"p" * 64, c) == 0
    assert s.get_replica_desc("pref-list")[0].get_memory_descriptor() \
        .buffer_descriptor.transport_endpoint == s.get_hostname()
    # Each replica on the next listed segment (upstream's allocation rule), in list order.
    for order in ([h.name, s.get_hostname()], [s.get_hostname(), h.name]):
        c = ReplicateConfig()
        c.replica_num = 2
        c.preferred_segments = order
        for i in range(5):
            key = f"pref-two/{order[0]}/{i}"
            assert s.put(key, b"q" * 4096, c) == 0
            assert [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                    for d in s.get_replica_desc(key)] == order, key


def test_buffers_and_pool(env):
    _, _, s = env
    meta = b"M" * 28
    kv = torch.arange(256, dtype=torch.float32)
    assert s.put_parts("lm/0", meta, kv.numpy().tobytes()) == 0
    bufs = s.batch_get_buffer(["lm/0", "lm/missing"])
    assert bufs[1] is None
    view = memoryview(bufs[0])
    assert len(view) == 28 + 1024 and bytes(view[:28]) == meta
    t = torch.frombuffer(bufs[0], dtype=torch.float32, offset=28, count=256)
    assert torch.equal(t, kv)
    h = s.get_buffer("lm/0")
    assert h.size() == len(h) == 1052 and h.ptr() != 0 and bytes(h)[:28] == meta
    assert s.get_buffer("lm/missing") is None
    del bufs, view, t, h
    import mooncake
    assert mooncake.BufferPool is mooncake.RegisteredBufferPool is store_mod.BufferPool
    pool = store_mod.BufferPool(s, max_bytes=40 * MiB, block_on_exhaustion=False)
    a = pool.acquire(12 * MiB)  # from the 16 MiB local buffer
    b = pool.acquire(8 * MiB)   # overflow: registered host memory
    a.buffer[:4] = b"abcd"
    b.buffer[:4] = b"wxyz"
    assert s.put_from("pool/a", a.ptr, 4) == 0 and s.put_from("pool/b", b.ptr, 4) == 0
    assert s.get_into("pool/a", b.ptr + 100, 4) == 4 and bytes(b.buffer[100:104]) == b"abcd"
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(30 * MiB)
    with pytest.raises(RuntimeError, match="exceeds"):
        pool.acquire(64 * MiB)
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    a.release()
    with pytest.raises(RuntimeError, match="closed"):
        a.ptr
    with pool.acquire(12 * MiB) as again:
        assert s.get_into("pool/b", again.ptr, 4) == 4 and bytes(again.buffer[:4]) == b"wxyz"
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(36 * MiB, block=True, timeout=0.2)
    b.release()
    pool.close()


def test_ranges_replicas_and_clear(env):
    m, h, s = env
    data = bytes(range(256)) * 64  # 16 KiB
    assert s.put("rg/a", data) == 0
    assert s.put("rg/b", data[::-1]) == 0
    buf, p = registered(s, 1 << 16)
    got = s.get_into_ranges([p, p + 32768], [["rg/a", "rg/missing"], ["rg/b"]],
                            [[[0, 100], [0]], [[0, 4000]]],
                            [[[10, 5000], [0]], [[1, 16380]]],
                            [[[20, 30], [8]], [[50, 10]]])
    assert got[0][0] == [20, 30]
    assert got[0][1][0] < 0
    assert got[1][0] == [50, E.INVALID_PARAMS]  # past the object's end; the other fragment ran
    raw = bytes(buf)
    assert raw[0:20] == data[10:30] and raw[100:130] == data[5000:5030]
    assert raw[32768:32768 + 50] == data[::-1][1:51]
    # SGLang's layer-wise loader: a read session, then per "layer" one key-major range read
    # per key (destination pointers, sizes, object offsets), then the end.
    assert s.batch_get_session_start(["rg/a", "rg/b"]) == [0, 0]
    assert s.batch_get_session_start_with_sources(["rg/a", "rg/missing"]) == \
        ([0, E.OBJECT_NOT_FOUND], [None, None])
    lay = 4
    for layer in range(lay):
        step = len(data) // lay
        ptrs = [[p + layer * step, p + 16384 + layer * 64], [p + 32768 + layer * step]]
        sizes, offs = [[step, 64], [step]], [[layer * step, layer * 64], [layer * step]]
        assert s.batch_get_into_multi_buffer_ranges(["rg/a", "rg/b"], ptrs, sizes, offs) == \
            [step + 64, step]
    raw = bytes(buf)
    assert raw[:len(data)] == data and raw[32768:32768 + len(data)] == data[::-1]
    assert raw[16384:16384 + lay * 64] == data[:lay * 64]
    # Upstream's keyword names (all_buffer_ptrs, all_src_offsets) and the ones vLLM Ascend's
    # protocol declares (all_buffers, all_offsets) read the same bytes.
    for kw in ({"all_buffer_ptrs": [[p + 50000]], "all_src_offsets": [[7]]},
               {"all_buffers": [[p + 50000]], "all_offsets": [[7]]}):
        buf[50000:50016] = b"\0" * 16
        assert s.batch_get_into_multi_buffer_ranges(keys=["rg/a"], all_sizes=[[16]], **kw) == [16]
        assert bytes(buf[50000:50016]) == data[7:23], kw
    with pytest.raises(TypeError, match="all_ptrs"):
        s.batch_get_into_multi_buffer_ranges(["rg/a"], all_ptrs=[[p]], all_sizes=[[1]],
                                             all_src_offsets=[[0]])
    assert s.batch_get_session_end(["rg/a", "rg/b"]) == 0
    assert s.batch_get_into_multi_buffer_ranges(
        ["rg/a", "rg/missing", "rg/b", "rg/a"], [[p], [p], [p], [p, p]],
        [[8], [8], [8], [8]], [[len(data) - 4], [0], [0], [0]]) == \
        [E.INVALID_PARAMS, E.OBJECT_NOT_FOUND, 8, E.INVALID_PARAMS]  # past the end; shapes
    descs = s.batch_get_replica_desc(["rg/a", "rg/missing"])
    assert list(descs) == ["rg/a"] and descs["rg/a"][0].status == store_mod.ReplicaStatus.COMPLETE
    assert s.get_replica_desc("rg/missing") == []
    # batch_replica_clear: only this client's, not leased ones.
    other = MooncakeDistributedStore()
    assert other.setup("127.0.0.1", "", 0, MiB, "tcp", "", m.addr) == 0
    assert other.put("rg/theirs", b"t" * 10) == 0
    assert s.put("rg/clear1", b"c" * 10) == 0 and s.put("rg/clear2", b"c" * 10) == 0
    s.get("rg/clear2")  # leased now
    assert s.batch_replica_clear(["rg/clear1", "rg/clear2", "rg/theirs", "rg/none"]) == \
        ["rg/clear1"]
    assert s.is_exist("rg/clear1") == 0 and other.is_exist("rg/theirs") == 1
    c = ReplicateConfig()
    c.replica_num = 2
    assert s.put("rg/two", b"2" * 4096, c) == 0
    segs = [x.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for x in s.get_replica_desc("rg/two")]
    assert len(segs) == 2
    time.sleep(1.2)  # the descriptor reads leased it (1 s lease)
    assert s.batch_replica_clear(["rg/two"], segs[0]) == ["rg/two"]
    left = s.get_replica_desc("rg/two")
    assert [x.get_memory_descriptor().buffer_descriptor.transport_endpoint for x in left] == \
        segs[1:]
    assert s.get("rg/two") == b"2" * 4096
    other.close()
    assert s.unregister_buffer(p) == 0


def test_tensors(env):
    _, _, s = env
    ts = [torch.randn(4, 6), torch.arange(10, dtype=torch.int64),
          torch.randn(3, 8).to(torch.bfloat16)]
    keys = [f"tn/{i}" for i in range(3)]
    assert s.batch_put_tensor(keys, ts) == [0, 0, 0]
    back = s.batch_get_tensor(keys + ["tn/missing"])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, ts))
    assert back[3] is None
    assert s.batch_put_tensor(keys, ts[:2]) == [E.INVALID_PARAMS] * 3
    buf, p = registered(s, 4096)
    v = s.get_tensor_into("tn/0", p, 4096)
    assert torch.equal(v, ts[0]) and v.data_ptr() != ts[0].data_ptr()
    assert s.get_tensor_into("tn/missing", p, 4096) is None
    assert [torch.equal(a, b) for a, b in zip(s.batch_get_tensor_into(keys[:2], [p, p + 2048],
                                                                      [2048, 2048]), ts)] == \
        [True, True]
    assert s.put_tensor_from("tn/from", p, 12 + 16 + 4 * 24) == 0
    assert torch.equal(s.get_tensor("tn/from"), ts[0])
    c = ReplicateConfig()
    c.with_hard_pin = True
    assert s.pub_tensor("tn/pub", ts[1], c) == 0
    assert s.batch_pub_tensor(["tn/pub2"], [ts[1]], c) == [0]
    # Tensor parallel: shards key_tp_i.
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert s.put_tensor_with_tp("tp/w", full, tp_size=2, split_dim=1) == 0
    assert torch.equal(s.get_tensor_with_tp("tp/w", tp_rank=1, tp_size=2), full[:, 3:])
    assert torch.equal(s.get_tensor("tp/w_tp_0"), full[:, :3])
    assert s.put_tensor_with_tp("tp/bad", full, tp_size=4, split_dim=1) == E.INVALID_PARAMS
    assert [t.shape for t in s.batch_get_tensor_with_tp(["tp/w"], tp_rank=0, tp_size=2)] == \
        [(4, 3)]
    P, A, R = store_mod.TensorParallelism, store_mod.ParallelAxis, store_mod.ReadTarget
    tp4 = P([A("TP", rank=0, size=2, split_dim=0)])
    assert s.put_tensor_with_parallelism("par/w", full, parallelism=tp4) == 0
    assert torch.equal(s.get_tensor_with_parallelism("par/w", R("full", tp4)), full)
    shard = s.get_tensor_with_parallelism("par/w", R("shard", P([A("tp", 1, 2, 0)])))
    assert torch.equal(shard, full[2:])
    assert s.put_tensor_with_parallelism("par/whole", full) == 0
    assert torch.equal(s.get_tensor_with_parallelism("par/whole", R("shard", tp4)), full[:2])
    assert s.put_tensor_with_parallelism("par/ep", full, P([A("ep", 0, 2)])) == E.INVALID_PARAMS
    with pytest.raises(RuntimeError):
        R("sideways")
    assert s.unregister_buffer(p) == 0


def test_upsert_family(env):
    _, _, s = env
    assert s.upsert("up/a", b"1" * 100) == 0
    assert s.upsert("up/a", b"2" * 300) == 0
    assert s.get("up/a") == b"2" * 300 and s.get_size("up/a") == 300
    assert s.upsert_parts("up/a", b"ab", b"cd") == 0 and s.get("up/a") == b"abcd"
    assert s.upsert_batch(["up/b", "up/c"], [b"b", b"c"]) == 0
    assert s.upsert_batch(["up/b", "up/c"], [b"bb", b"cc"]) == 0
    assert s.get_batch(["up/b", "up/c"]) == [b"bb", b"cc"]
    buf, p = registered(s, 4096)
    ctypes.memmove(p, b"F" * 64, 64)
    assert s.upsert_from("up/a", p, 64) == 0 and s.get("up/a") == b"F" * 64
    assert s.batch_upsert_from(["up/b", "up/c"], [p, p + 8], [8, 16]) == [0, 0]
    assert s.get_size("up/c") == 16
    assert s.upsert("up/z", b"") == E.INVALID_PARAMS
    t1, t2 = torch.ones(3), torch.zeros(5, dtype=torch.int32)
    assert s.upsert_tensor("up/t", t1) == 0 and s.upsert_tensor("up/t", t2) == 0
    assert torch.equal(s.get_tensor("up/t"), t2)
    assert s.batch_upsert_tensor(["up/t", "up/t2"], [t1, t1]) == [0, 0]
    assert torch.equal(s.get_tensor("up/t"), t1)
    assert s.upsert_pub_tensor("up/t", t2, ReplicateConfig()) == 0
    assert s.batch_upsert_pub_tensor(["up/t2"], [t2]) == [0]
    assert torch.equal(s.get_tensor("up/t2"), t2)
    assert s.unregister_buffer(p) == 0


WRITER = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
sizes = [int(x) for x in sys.argv[3].split(",")]
n, full, until = 0, 0, time.time() + float(sys.argv[2])
while time.time() < until:
    v = n % 250 + 1
    rc = s.upsert("race", bytes([v]) * sizes[v % len(sizes)])
    if rc == -200:  # old values still leased by readers hold the space: wait a little
        full += 1
        time.sleep(0.01)
        continue
    assert rc == 0, (n, rc)
    n += 1
print("wrote", n, full, flush=True)
s.close()
"""


def test_upsert_races_readers_never_torn():
    """A writer process replaces one key as fast as it can (alternating sizes, every value one
    repeated byte) while this process reads it with get, get_into and batch_get_buffer: every
    read that succeeds is a whole value (all bytes equal, the size that byte was written with).
    A half-second lease keeps the replaced values that readers may still copy from alive."""
    m = Master(env={"MC_STORE_LEASE_TTL_MS": "500"})
    h = Holder(m.addr, 64 * MiB)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 0, 4 * MiB, "tcp", "", m.addr) == 0
    sizes = [64 << 10, 200 << 10, 1 << 20]
    assert s.upsert("race", b"\x00" * sizes[0]) == 0
    w = subprocess.Popen([sys.executable, "-c", WRITER, m.addr, "4", ",".join(map(str, sizes))],
                         stdout=subprocess.PIPE, text=True)
    buf, p = registered(s, 1 << 20)

    def check(b, how):
        assert len(b) > 0, how
        v = b[0]
        assert len(b) == sizes[v % len(sizes)] or v == 0, (how, v, len(b))
        assert b.count(v) == len(b), f"torn read via {how}: {len(b)} bytes starting {v}"
        return v

    seen, reads = set(), 0
    try:
        deadline = time.time() + 40
        while w.poll() is None and time.time() < deadline:
            v = s.get("race")
            if v:
                seen.add(check(v, "get"))
                reads += 1
            n = s.get_into("race", p, 1 << 20)
            if n > 0:
                seen.add(check(bytes(buf)[:n], "get_into"))
                reads += 1
            hb = s.batch_get_buffer(["race"])[0]
            if hb is not None:
                seen.add(check(bytes(hb), "batch_get_buffer"))
                reads += 1
                del hb
        out = w.communicate(timeout=30)[0]
        assert w.returncode == 0, out
        writes = int(out.split()[1])
        assert writes > 20 and reads > 20, (writes, reads)
        assert len(seen) > 3, "the reader should have seen several versions"
        assert s.unregister_buffer(p) == 0
    finally:
        if w.poll() is None:
            w.kill()
        s.close()
        h.close()
        m.close()


def test_health_check_master_gone():
    m = Master()
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.setup("127.0.0.1", "", 0, MiB, "tcp", "", m.addr) == 0
    assert s.health_check() == 0
    m.proc.kill()
    m.proc.wait(10)
    t0 = time.monotonic()
    assert s.health_check() == 2
    assert time.monotonic() - t0 < 10
    s.close()
