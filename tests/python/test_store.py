"""mooncake.store's MooncakeDistributedStore, call by call, with Mooncake's return conventions,
against the standalone mooncake_master; a holder process lends memory so reads cross processes."""
import ctypes
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fake_verbs  # noqa: E402
from _store_common import Holder, Master, master_bin  # noqa: E402

torch = pytest.importorskip("torch")
store_mod = pytest.importorskip("mooncake.store")
MooncakeDistributedStore = store_mod.MooncakeDistributedStore
ReplicateConfig = store_mod.ReplicateConfig
E = store_mod.ErrorCode

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")


@pytest.fixture(scope="module")
def env():
    m = Master("--client-ttl-s", "2")
    h = Holder(m.addr)
    s = MooncakeDistributedStore()
    assert s.setup("pytest", "", 32 << 20, 16 << 20, "tcp", "", m.addr) == 0
    yield m, h, s
    s.close()
    h.close()
    m.close()


def test_not_set_up_returns_codes():
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == E.INVALID_PARAMS
    assert s.get("k") == b""
    assert s.is_exist("k") == E.INVALID_PARAMS
    assert s.get_size("k") == E.INVALID_PARAMS
    assert s.setup("x", "", 1 << 20, 0, "tcp", "", "nonsense") == E.INVALID_PARAMS


def test_put_get_bytes(env):
    _, _, s = env
    assert s.put("hello", b"Hello, Mooncake Store!") == 0
    assert s.get("hello") == b"Hello, Mooncake Store!"
    assert s.get_size("hello") == 22
    assert s.is_exist("hello") == 1
    assert s.is_exist("nothing") == 0
    assert s.get("nothing") == b""
    assert s.get_size("nothing") == E.OBJECT_NOT_FOUND
    assert s.put("hello", b"again") == 0  # upstream: an existing key is kept, and 0
    assert s.get("hello") == b"Hello, Mooncake Store!"
    big = os.urandom(3 << 20)
    assert s.put("big", big) == 0
    assert s.get("big") == big


def test_bad_input(env):
    _, _, s = env
    assert s.put("", b"x") == E.INVALID_KEY
    assert s.put("k" * 5000, b"x") == E.INVALID_KEY
    assert s.put("empty", b"") == E.INVALID_PARAMS
    assert s.get("") == b""
    assert s.is_exist("") == E.INVALID_KEY
    assert s.put("huge", bytes(200 << 20)) == E.NO_AVAILABLE_HANDLE
    assert s.remove("") == E.INVALID_KEY
    assert s.remove_by_regex("(") == E.INVALID_PARAMS


def test_replicate_config(env):
    _, h, s = env
    c = ReplicateConfig()
    assert c.replica_num == 1 and not c.with_soft_pin and not c.with_hard_pin
    c.replica_num = 2
    c.with_soft_pin = True
    assert s.put("two", b"2" * 1000, c) == 0
    assert s.get("two") == b"2" * 1000
    c = ReplicateConfig()
    c.preferred_segment = h.name
    c.with_hard_pin = True
    assert s.put("pinned", b"p" * 100, c) == 0
    assert s.get("pinned") == b"p" * 100


def test_batches_and_parts(env):
    _, _, s = env
    keys = [f"b/{i}" for i in range(20)]
    vals = [os.urandom(100 + i * 1000) for i in range(20)]
    assert s.put_batch(keys, vals) == 0
    assert s.get_batch(keys) == vals
    assert s.get_batch(["b/0", "b/missing"]) == [vals[0], b""]
    assert s.batch_is_exist(["b/1", "b/missing", ""]) == [1, 0, E.INVALID_KEY]
    assert s.put_parts("parts", b"ab", b"cd", memoryview(b"ef")) == 0
    assert s.get("parts") == b"abcdef"


def test_zero_copy(env):
    _, _, s = env
    n = 1 << 20
    src = (ctypes.c_ubyte * n).from_buffer_copy(os.urandom(n))
    dst = (ctypes.c_ubyte * n)()
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    # Unregistered buffers are refused.
    assert s.put_from("zc", sp, n) == E.INVALID_PARAMS
    assert s.register_buffer(sp, n) == 0
    assert s.register_buffer(dp, n) == 0
    assert s.put_from("zc", sp, n) == 0
    assert s.get_into("zc", dp, n) == n
    assert bytes(dst) == bytes(src)
    # A buffer smaller than the object: INVALID_PARAMS, upstream's code (not BUFFER_OVERFLOW).
    assert s.get_into("zc", dp, n // 2) == E.INVALID_PARAMS
    assert s.get_into("zc-missing", dp, n) == E.OBJECT_NOT_FOUND
    # Batches: 8 x 64 KiB.
    m = 65536
    keys = [f"zc/{i}" for i in range(8)]
    ptrs = [sp + i * m for i in range(8)]
    assert s.batch_put_from(keys, ptrs, [m] * 8) == [0] * 8
    ctypes.memset(dp, 0, n)
    assert s.batch_get_into(keys, [dp + i * m for i in range(8)], [m] * 8) == [m] * 8
    assert bytes(dst)[: 8 * m] == bytes(src)[: 8 * m]
    r = s.batch_get_into(["zc/0", "zc/none"], [dp, dp + m], [m, m])
    assert r == [m, E.OBJECT_NOT_FOUND]
    assert s.batch_get_into(["zc/0", "zc/1"], [dp, dp + m], [m - 1, m]) == [E.INVALID_PARAMS, m]
    # Multi buffers: each object is the concatenation of its buffers.
    mk = ["mb/0", "mb/1"]
    assert s.batch_put_from_multi_buffers(mk, [[sp, sp + 100], [sp + 1000]], [[100, 200], [50]]) == [0, 0]
    ctypes.memset(dp, 0, n)
    got = s.batch_get_into_multi_buffers(mk, [[dp, dp + 4096], [dp + 8192]], [[150, 150], [50]])
    assert got == [300, 50]
    assert s.batch_get_into_multi_buffers(mk, [[dp, dp + 4096], [dp + 8192]], [[150, 149], [50]]) \
        == [E.INVALID_PARAMS, 50]
    assert bytes(dst)[:150] == bytes(src)[:150]
    assert bytes(dst)[4096:4096 + 150] == bytes(src)[150:300]
    assert bytes(dst)[8192:8192 + 50] == bytes(src)[1000:1050]
    assert s.unregister_buffer(sp) == 0
    assert s.unregister_buffer(sp) == E.INVALID_PARAMS
    assert s.unregister_buffer(dp) == 0


def test_tensors(env):
    _, _, s = env
    for t in (torch.arange(12, dtype=torch.float32).reshape(3, 4),
              torch.randn(2, 3, 5).to(torch.bfloat16), torch.tensor([1, 2, 3], dtype=torch.int64)):
        key = f"t/{t.dtype}"
        assert s.put_tensor(key, t) == 0
        back = s.get_tensor(key)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)
    assert s.get_tensor("t/missing") is None
    assert s.put_tensor("t/notatensor", [1, 2]) == E.INVALID_PARAMS


def test_remove_family(env):
    _, _, s = env
    for i in range(5):
        assert s.put(f"rm/{i}", b"x") == 0
    s.get("rm/0")  # a lease: plain remove refuses, force removes
    assert s.remove("rm/0") == E.OBJECT_HAS_LEASE
    assert s.remove("rm/0", force=True) == 0
    assert s.remove("rm/0") == E.OBJECT_NOT_FOUND
    assert s.remove_by_regex("^rm/", True) == 4
    assert s.is_exist("rm/1") == 0
    assert s.remove_all(True) >= 1
    assert s.is_exist("hello") == 0


def test_holder_killed_not_a_hang():
    m = Master("--client-ttl-s", "1")
    try:
        h = Holder(m.addr)
        s = MooncakeDistributedStore()
        assert s.setup("reader", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        c = ReplicateConfig()
        c.preferred_segment = h.name
        assert s.put("solo", b"z" * 5000, c) == 0
        assert s.get("solo") == b"z" * 5000
        h.kill()
        deadline = time.time() + 8
        while time.time() < deadline:
            t0 = time.time()
            v = s.get("solo")
            assert time.time() - t0 < 4
            if s.is_exist("solo") == 0:
                break
            time.sleep(0.2)
        assert s.is_exist("solo") == 0
        assert s.get_into("solo", 0, 0) in (E.OBJECT_NOT_FOUND, E.INVALID_PARAMS)
        s.close()
    finally:
        m.close()


def test_master_metrics_and_health():
    import urllib.request

    from _store_common import free_port
    mport = free_port()
    m = Master("--metrics-port", str(mport))
    base = f"http://127.0.0.1:{mport}"
    # Upstream's /get_all_segments (SGLang's check_server waits for a non-empty answer):
    # empty until a client lent a segment, then its name.
    assert urllib.request.urlopen(base + "/get_all_segments", timeout=5).read() == b""
    h = Holder(m.addr, 8 << 20)
    try:
        segs = urllib.request.urlopen(base + "/get_all_segments", timeout=5).read().decode()
        assert segs.splitlines() == [h.name], (segs, h.name)
        # No segment here: one lending engine per process (see docs/store.md, known limits).
        s = MooncakeDistributedStore()
        assert s.setup("metrics", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        assert s.put("m/1", b"x" * 1000) == 0
        assert s.get("m/1") == b"x" * 1000
        assert urllib.request.urlopen(base + "/health", timeout=5).read().strip() == b"OK"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                vals[name] = v
        assert vals["mooncake_store_objects"] == "1"
        assert float(vals["mooncake_store_bytes_capacity"]) == 8 << 20
        assert any(k.startswith("mooncake_store_rpc") for k in vals), list(vals)[:20]
        s.close()
    finally:
        h.close()
        m.close()


RDMA_CLIENT = r"""
import os, sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("reader", "", 0, 16 << 20, "rdma", "", sys.argv[1]) == 0
vals = {f"rdma-{n}": os.urandom(n) for n in (1, 4096, 1 << 20, (8 << 20) + 3)}
for k, v in vals.items():
    assert s.put(k, v) == 0, k
for k, v in vals.items():
    assert s.get(k) == v, k
keys = [f"rdma-batch-{i}" for i in range(16)]
batch = [os.urandom(5000 + i) for i in range(16)]
assert s.put_batch(keys, batch) == 0
assert s.get_batch(keys) == batch
s.close()
print("ok", flush=True)
"""


@pytest.mark.skipif(_fake_verbs.library_dir() is None, reason="no verbs emulator (MC_WITH_RDMA=OFF)")
def test_put_get_over_rdma_between_hosts():
    """A client on one simulated host, the memory it puts into and gets from on another, both
    with the verbs emulator's NICs and protocol "rdma": the bytes round-trip and the NICs
    carried them."""
    import subprocess

    fabric = _fake_verbs.Fabric("st", ["host-a", "host-b"])
    m = Master()
    h = None
    try:
        env = dict(fabric.env(), MC_LOG_LEVEL="INFO", MC_LOG_SUBSYS="ENGINE")
        h = Holder(m.addr, 32 << 20, protocol="rdma", env=dict(env, MC_HOST_ID="host-b"))
        r = subprocess.run([sys.executable, "-c", RDMA_CLIENT, m.addr], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, **env, MC_HOST_ID="host-a"))
        tx = [fabric.tx_bytes("host-a"), fabric.tx_bytes("host-b")]
    finally:
        if h is not None:
            h.close()
        m.close()
        fabric.close()
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert " over rdma" in r.stderr, r.stderr[-4000:]
    # Puts leave host-a's NICs as writes; gets are reads, whose responses host-b's NICs send.
    assert tx[0] >= (9 << 20) and tx[1] >= (9 << 20), f"bytes the NICs sent: {tx}"


def test_garbage_collected_client_lets_other_threads_run():
    """A store dropped by Python (no close()) closes in its destructor, which can wait (here:
    its master is stopped, so the unmount waits for its RPC deadline): other Python threads
    run meanwhile (the destructor releases the GIL, as close() does)."""
    import signal
    import threading
    m = Master()
    ticks, stop, stopped = [0], threading.Event(), []

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 1 << 20, 1 << 20, "tcp", "", m.addr) == 0
        assert s.put("gc/k", b"v") == 0
        os.kill(m.proc.pid, signal.SIGSTOP)
        stopped.append(True)
        t.start()
        time.sleep(0.05)
        t0, n0 = time.monotonic(), ticks[0]
        del s  # the last reference: the destructor runs here
        took, ran = time.monotonic() - t0, ticks[0] - n0
    finally:
        if stopped:
            os.kill(m.proc.pid, signal.SIGCONT)
        stop.set()
        if t.is_alive():
            t.join()
        m.close()
    assert took > 0.5, f"the destructor did not wait ({took:.3f} s): the test shows nothing"
    assert ran >= 10, f"another thread ran {ran} times in the destructor's {took:.2f} s"
