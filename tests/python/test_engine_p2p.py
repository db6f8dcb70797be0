"""mooncake.engine.TransferEngine as vLLM's and SGLang's prefill/decode code uses it, between two
real processes: this one (prefill) and a decode process (_engine_peer.py) that registers a KV
cache and publishes "host:rpc_port". Blocks are batch-written to the peer's registered
addresses, read back, checked by the peer itself; notifications arrive after their data; bad
input gets upstream's negative codes (or 0 batch ids) and crashes nothing. Over shared memory
(the default between same-host processes) and tcp (MC_FORCE_TCP=1)."""
import ctypes
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
eng = pytest.importorskip("mooncake.engine")
TransferEngine, TransferNotify, Op = eng.TransferEngine, eng.TransferNotify, eng.TransferOpcode

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "_engine_peer.py")
KV = 1 << 20
BLOCK = 16 << 10


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def pattern(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class Decode:
    def __init__(self, env, protocol="rdma", gpu=False):
        self.proc = subprocess.Popen([sys.executable, "-u", PEER, str(KV), protocol] +
                                     (["gpu"] if gpu else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.info = self._read(60)
        assert "session" in self.info, self.info
        assert self.info["register"] == 0
        self.session, self.kv = self.info["session"], self.info["kv"]

    def _read(self, timeout_s=30):
        import select
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert r, "decode process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"decode process exited ({self.proc.poll()})"
        return json.loads(line)

    def send(self, *cmd):
        self.proc.stdin.write(" ".join(str(c) for c in cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, *cmd, timeout_s=30):
        self.send(*cmd)
        return self._read(timeout_s)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask("exit")
            except (AssertionError, BrokenPipeError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module", params=["auto", "tcp"])
def pd(request):
    """(prefill TransferEngine, its registered KV tensor, the decode process), shared by the
    tests of one transport."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MC_SECRET", secrets.token_hex(16))
        mp.delenv("MC_SECRET_FILE", raising=False)
        if request.param == "tcp":
            mp.setenv("MC_FORCE_TCP", "1")
        else:
            mp.delenv("MC_FORCE_TCP", raising=False)
        d = Decode(dict(os.environ))
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    src = pattern(7, KV)
    assert te.register_memory(src.data_ptr(), KV) == 0
    yield te, src, d
    d.close()
    assert te.unregister_memory(src.data_ptr()) == 0


def test_kv_blocks_write_read_notify(pd):
    te, src, d = pd
    s = d.session
    assert te.get_rpc_port() > 0 and te.get_session_id() == f"127.0.0.1:{te.get_rpc_port()}"
    assert te.send_probe(s) == 0
    assert te.get_first_buffer_address(s) == d.kv
    assert te.get_first_buffer_address(te.get_session_id()) == src.data_ptr()
    # vLLM: batch_transfer_sync_write of blocks to the decode's KV addresses (permuted).
    n = KV // BLOCK
    perm = list(reversed(range(n)))
    rc = te.batch_transfer_sync_write(s, [src.data_ptr() + i * BLOCK for i in range(n)],
                                      [d.kv + perm[i] * BLOCK for i in range(n)], [BLOCK] * n)
    assert rc == 0
    expect = torch.empty(KV, dtype=torch.uint8)
    for i in range(n):
        expect[perm[i] * BLOCK:(perm[i] + 1) * BLOCK] = src[i * BLOCK:(i + 1) * BLOCK]
    assert d.ask("digest", 0, KV)["digest"] == digest(expect)
    # Read back into a second registered buffer.
    back = torch.zeros(KV, dtype=torch.uint8)
    assert te.register_memory(back.data_ptr(), KV) == 0
    assert te.batch_transfer_sync_read(s, [back.data_ptr() + i * BLOCK for i in range(n)],
                                       [d.kv + i * BLOCK for i in range(n)], [BLOCK] * n) == 0
    assert torch.equal(back, expect)
    assert te.transfer_sync_read(s, back.data_ptr(), d.kv + 3 * BLOCK, BLOCK) == 0
    assert torch.equal(back[:BLOCK], expect[3 * BLOCK:4 * BLOCK])
    # Notifications come after their data: the decode side, watching while the blocks are
    # written, digests the block named in msg the moment it sees the notification (a
    # notification before its bytes would show the permuted write's bytes there).
    d.send("wait_notify", 3, 20000)
    try:
        rcs = [te.transfer_sync(s, src.data_ptr() + (k + 20) * BLOCK, d.kv + k * BLOCK, BLOCK,
                                Op.Write, notify=TransferNotify(f"req-{k}", f"{k * BLOCK} {BLOCK}"))
               for k in range(3)]
    finally:
        seen = d._read(40)["seen"]  # (read even on failure: the next command's answer follows)
    assert rcs == [0, 0, 0]
    assert [x["name"] for x in seen] == ["req-0", "req-1", "req-2"]
    for k, x in enumerate(seen):
        assert x["digest"] == digest(src[(k + 20) * BLOCK:(k + 21) * BLOCK]), k
    assert d.ask("notifies")["notifies"] == []  # drained once
    assert te.batch_transfer_sync(s, [src.data_ptr()], [d.kv], [64], Op.Write,
                                  TransferNotify("batch", "0 64")) == 0
    assert d.ask("wait_notify", 1, 10000)["seen"][0]["digest"] == digest(src[:64])
    # Async: batch ids, status.
    ids = [te.batch_transfer_async_write(s, [src.data_ptr() + i * BLOCK], [d.kv + i * BLOCK],
                                         [BLOCK]) for i in range(4)]
    assert all(i > 0 for i in ids) and len(set(ids)) == 4
    assert te.get_batch_transfer_status(ids) == 0
    rid = te.batch_transfer_async_read(s, [back.data_ptr()], [d.kv], [BLOCK])
    assert rid > 0 and te.get_batch_transfer_status([rid]) == 0
    assert torch.equal(back[:BLOCK], src[:BLOCK])
    bid = te.transfer_submit_write(s, src.data_ptr(), d.kv + KV - BLOCK, BLOCK)
    assert bid > 0
    deadline = time.monotonic() + 20
    st = 0
    while st == 0 and time.monotonic() < deadline:
        st = te.transfer_check_status(bid)
    assert st == 1
    assert te.transfer_check_status(bid) == -1  # released: unknown now
    assert d.ask("digest", KV - BLOCK, BLOCK)["digest"] == digest(src[:BLOCK])
    # Managed buffers and the byte helpers.
    m = te.allocate_managed_buffer(1 << 16)
    assert m != 0
    assert te.write_bytes_to_buffer(m, b"managed!" * 8, 64) == 0
    assert te.read_bytes_from_buffer(m, 8) == b"managed!"
    assert te.transfer_sync_write(s, m, d.kv, 64) == 0
    assert d.ask("digest", 0, 64)["digest"] == hashlib.sha256(b"managed!" * 8).hexdigest()
    assert te.free_managed_buffer(m, 1 << 16) == 0
    assert te.unregister_memory(back.data_ptr()) == 0


def test_bad_input_negative_codes_no_crash(pd):
    te, src, d = pd
    s = d.session
    d.ask("fill", 99)
    before = d.ask("digest", 0, KV)["digest"]
    loose = ctypes.create_string_buffer(4096)  # never registered
    la = ctypes.addressof(loose)
    gone = f"127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    # Unregistered local address; remote outside the peer's regions; length past a region.
    assert te.transfer_sync_write(s, la, d.kv, 64) < 0
    assert te.transfer_sync_write(s, src.data_ptr(), la, 64) < 0
    assert te.transfer_sync_write(s, src.data_ptr(), d.kv + KV - 64, 128) < 0
    assert te.transfer_sync_read(s, src.data_ptr(), d.kv + KV, 64) < 0
    assert te.transfer_sync_write(s, src.data_ptr() + KV - 64, d.kv, 128) < 0
    assert te.transfer_sync_write(s, src.data_ptr(), d.kv, 0) < 0
    assert te.batch_transfer_sync_write(s, [src.data_ptr()], [d.kv, d.kv], [64]) < 0
    assert te.batch_transfer_async_write(s, [src.data_ptr()], [la], [64]) == 0
    assert te.transfer_submit_write(s, la, d.kv, 64) == 0
    # Unknown sessions.
    for bad in (gone, "not-a-session", "127.0.0.1:0"):
        assert te.transfer_sync_write(bad, src.data_ptr(), d.kv, 64) < 0, bad
        assert te.batch_transfer_async_write(bad, [src.data_ptr()], [d.kv], [64]) == 0, bad
        assert te.send_probe(bad) != 0, bad
        assert te.get_first_buffer_address(bad) == 0, bad
    assert time.monotonic() - t0 < 30
    # Registration: twice, overlapping, empty, unknown.
    assert te.register_memory(src.data_ptr(), KV) == -7
    assert te.register_memory(src.data_ptr() + 64, 64) == -7
    assert te.register_memory(la, 0) == -1
    assert te.unregister_memory(la) == -3
    assert te.batch_register_memory([la, src.data_ptr()], [4096, 64]) == -7
    assert te.unregister_memory(la) == -3  # rolled back
    assert te.read_bytes_from_buffer(src.data_ptr(), 4) == bytes(src[:4].tolist())
    with pytest.raises(ValueError):
        te.read_bytes_from_buffer(la, 4)
    assert te.write_bytes_to_buffer(la, b"x" * 4, 4) == -1
    # Nothing reached the decode side's memory, and both sides still serve.
    assert d.ask("digest", 0, KV)["digest"] == before
    assert te.transfer_sync_write(s, src.data_ptr(), d.kv, 64) == 0
    assert d.ask("digest", 0, 64)["digest"] == digest(src[:64])
    # Not initialized: codes, no exception.
    cold = TransferEngine()
    assert cold.transfer_sync_write(s, src.data_ptr(), d.kv, 64) == -1
    assert cold.batch_transfer_async_write(s, [src.data_ptr()], [d.kv], [64]) == 0
    assert cold.get_notifies() == [] and cold.get_rpc_port() == -1
    assert cold.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert cold.initialize("127.0.0.1", "P2PHANDSHAKE", "xgmi", "") == -1


def test_peer_death_and_secrets(monkeypatch, tmp_path):
    """A decode process that dies fails transfers promptly; a peer with another job secret
    is refused; with neither MC_SECRET nor MC_SECRET_FILE both sides use the per-user file."""
    monkeypatch.delenv("MC_SECRET", raising=False)
    monkeypatch.delenv("MC_SECRET_FILE", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    d = Decode(dict(os.environ))
    assert (tmp_path / ".mooncake" / "secret").exists()
    assert oct((tmp_path / ".mooncake" / "secret").stat().st_mode & 0o777) == "0o600"
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = pattern(3, KV)
    assert te.register_memory(src.data_ptr(), KV) == 0
    assert te.transfer_sync_write(d.session, src.data_ptr(), d.kv, 4096) == 0
    stranger = Decode(dict(os.environ, MC_SECRET="another-job-" + "0" * 32))
    assert te.send_probe(stranger.session) != 0
    assert te.transfer_sync_write(stranger.session, src.data_ptr(), stranger.kv, 64) < 0
    assert stranger.ask("digest", 0, 64)["digest"] == digest(torch.zeros(64, dtype=torch.uint8))
    stranger.close()
    d.proc.kill()
    d.proc.wait(10)
    t0 = time.monotonic()
    assert te.transfer_sync_write(d.session, src.data_ptr(), d.kv, 4096) < 0
    assert te.send_probe(d.session) != 0
    assert time.monotonic() - t0 < 15
    assert te.unregister_memory(src.data_ptr()) == 0


def test_module_surface():
    assert eng.TransferOpcode.Read == 0 and eng.TransferOpcode.Write == 1
    assert eng.TransferOpcode.READ == eng.Read and eng.TransferOpcode.WRITE == eng.Write
    assert TransferEngine.TransferOpcode is eng.TransferOpcode
    n = TransferNotify("a", "b")
    assert (n.name, n.msg) == ("a", "b")
    te = TransferEngine()
    assert te.get_engine() is None and te.get_engine_ptr() == 0
    assert te.initialize("127.0.0.1:12345", "P2PHANDSHAKE", "tcp", "") == 0
    h = te.get_engine()
    assert isinstance(h, eng.InnerTransferEngine) and h.name == te.get_session_id()
    assert te.get_engine_ptr() != 0
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # already


PG_SHARE = r"""
import logging, os, sys, tempfile
import torch, torch.distributed as dist
from mooncake import pg
from mooncake.engine import TransferEngine
from mooncake.store import Store
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
pg.set_host_ip("127.0.0.1")
logging.basicConfig()
pg.set_device_filter(["mlx5_0"])
assert pg.get_device_filter() == ["mlx5_0"]
assert os.environ["MC_RDMA_DEVICES"] == "mlx5_0"  # the next engine's NIC filter
pg.set_transfer_engine(te)
dist.init_process_group("mooncake", rank=0, world_size=1,
                        init_method="file://" + tempfile.mktemp(prefix="mc_pg_share_"))
t = torch.arange(4.0)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(4.0))
s = Store.from_group(segment_size=1 << 20)
print("names", s.get_hostname(), te.get_session_id(), flush=True)
assert s.get_hostname() == te.get_session_id()
assert s.put("k", b"v") == 0 and s.get("k") == b"v"
s.close()
pg.set_transfer_engine(None)
dist.destroy_process_group()
print("ok", flush=True)
"""


def test_pg_and_store_share_the_engine(tmp_path):
    """mooncake.pg.set_transfer_engine(te): the groups created afterwards run on te's engine
    (the group's store names itself by te's session id); set_host_ip exists, and
    set_device_filter becomes MC_RDMA_DEVICES for the next engine."""
    env = dict(os.environ, MC_SECRET=secrets.token_hex(16))
    env.pop("MC_SECRET_FILE", None)
    r = subprocess.run([sys.executable, "-c", PG_SHARE], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
