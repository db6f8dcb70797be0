"""`mooncake_client`, upstream's standalone store client (vLLM's standalone-store mode: the
serving ranks lend nothing, this process owns the pool), with upstream's flags against a
running master: objects a client that lends nothing writes land in its segment and read back;
SIGTERM unmounts it and exits 0; refused flags and a master nobody serves fail with a message.
SGLang's standalone_storage mode: setup_dummy(mem_pool_size, local_buffer_size, its --port)
joins the same store, with registered buffers; bad addresses, a foreign secret and a port that
is not a mooncake_client's fail with a code and a reason."""
import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Master, free_port, master_bin  # noqa: E402

store_mod = pytest.importorskip("mooncake.store")
MooncakeDistributedStore = store_mod.MooncakeDistributedStore

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
CLIENT = [sys.executable, "-c", "import sys; from mooncake.cli import client_main; "
          "sys.exit(client_main())"]


def start(*flags):
    return subprocess.Popen(CLIENT + list(flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_lends_its_segment_until_sigterm():
    m = Master()
    p = None
    try:
        # Upstream's (gflags) spellings: sizes with a space, a single dash, a bare boolean
        # flag, --noflag, an explicit false.
        p = start("--global_segment_size=64 MB", f"-master_server_address={m.addr}",
                  "--protocol", "tcp", "--port=0", "--metadata_server=http://x:8080/metadata",
                  "--start_offload_rpc_server", "--noenable_http_server", "--enable_offload=false")
        seg, _, line = ready(p)
        assert seg.startswith("127.0.0.1:") and f"bytes={64 << 20}" in line, line
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        vals = {f"cli/{i}": os.urandom(1000 * (i + 1)) for i in range(5)}
        for k, v in vals.items():
            assert s.put(k, v) == 0
        assert {k: s.get(k) for k in vals} == vals
        # Every object is in the mooncake_client's segment (the only one).
        assert {s.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor
                .transport_endpoint for k in vals} == {seg}
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        # Unmounted: its objects are gone, and a put has nowhere to go.
        deadline = time.time() + 10
        while s.is_exist("cli/0") != 0 and time.time() < deadline:
            time.sleep(0.1)
        assert s.is_exist("cli/0") == 0
        assert s.put("cli/after", b"x" * 100) != 0
        s.close()
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        m.close()


@pytest.mark.parametrize("flags,says", [
    (["--enable_offload=true"], "setup failed"),
    (["--tenant_id=other"], "setup failed"),
    (["--global_segment_size=0"], "must be > 0"),
    (["--global_segment_size=lots"], "bad size"),
    (["--enable_offload=maybe"], "not a boolean"),
    (["--host=0.0.0.0"], "other processes reach"),
    (["--host=[::]:7000"], "other processes reach"),
    (["--glob=16MB"], "unrecognized arguments"),  # no abbreviations, as gflags
])
def test_refused_flags(flags, says):
    m = Master()
    try:
        p = start(f"--master_server_address={m.addr}", "--global_segment_size=16MB", *flags)
        out, err = p.communicate(timeout=30)
        assert p.returncode != 0 and says in err, (p.returncode, out, err)
    finally:
        m.close()


def test_no_master():
    p = start(f"--master_server_address=127.0.0.1:{free_port()}", "--global_segment_size=16MB")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "setup failed" in err, (out, err)


def ready(p):
    line = p.stdout.readline()
    if not line.startswith("mooncake_client ready segment="):
        p.kill()
        pytest.fail(line + p.communicate(timeout=30)[1])
    return line.split("segment=")[1].split()[0], int(line.split(" port=")[1]), line


def test_dummy_clients_join_its_store():
    """Two dummies (SGLang's standalone_storage) of one mooncake_client: registered host
    buffers in and out (batch_put_from / batch_get_into, as SGLang's HiCache calls them), bytes
    in and out, each sees the other's objects, all in the mooncake_client's segment."""
    m = Master()
    p = None
    dummies = []
    try:
        p = start("--global_segment_size=64MB", f"--master_server_address={m.addr}", "--port=0")
        seg, port, _ = ready(p)
        for _ in range(2):
            d = MooncakeDistributedStore()
            assert d.setup_dummy(32 << 20, 4 << 20, f"127.0.0.1:{port}") == 0
            dummies.append(d)
        a, b = dummies
        # Named after the mooncake_client's --host, each with its own engine's port.
        assert a.get_hostname() not in (seg, b.get_hostname())
        assert {d.get_hostname().rpartition(":")[0] for d in dummies} == {"127.0.0.1"}
        n, size = 8, 3000
        data = os.urandom(n * size)
        # SGLang's host KV pool comes from MooncakeHostMemAllocator in this mode.
        alloc = store_mod.MooncakeHostMemAllocator()
        src = alloc.alloc(n * size)
        ctypes.memmove(src, data, n * size)
        dst = torch.zeros(n * size, dtype=torch.uint8)
        assert a.register_buffer(src, n * size) == 0
        assert a.register_buffer(dst.data_ptr(), n * size) == 0
        keys = [f"dummy/{i}" for i in range(n)]
        assert a.batch_put_from(keys, [src + i * size for i in range(n)], [size] * n) == [0] * n
        got = a.batch_get_into(keys, [dst.data_ptr() + i * size for i in range(n)], [size] * n)
        assert got == [size] * n
        assert dst.numpy().tobytes() == data
        assert b.get(keys[3]) == data[3 * size:4 * size]
        assert b.put("dummy/b", b"from b" * 100) == 0
        assert a.get("dummy/b") == b"from b" * 100
        assert {a.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor
                .transport_endpoint for k in keys + ["dummy/b"]} == {seg}
        # The pool is the mooncake_client's: once it is gone, so are the objects.
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        deadline = time.time() + 10
        while a.is_exist(keys[0]) != 0 and time.time() < deadline:
            time.sleep(0.1)
        assert a.is_exist(keys[0]) == 0 and b.is_exist("dummy/b") == 0
        for d in dummies:
            d.close()
        alloc.free(src)
    finally:
        for d in dummies:
            d.close()
        if p is not None and p.poll() is None:
            p.kill()
        m.close()


DUMMY = ("import sys; from mooncake.store import MooncakeDistributedStore as S; "
         "print(S().setup_dummy(1 << 20, 1 << 20, sys.argv[1], timeout_ms=3000))")


def test_dummy_setup_refusals():
    m = Master()
    p = None
    try:
        p = start("--global_segment_size=16MB", f"--master_server_address={m.addr}", "--port=0")
        _, port, _ = ready(p)
        d = MooncakeDistributedStore()
        bad = int(store_mod.ErrorCode.INVALID_PARAMS)
        rpc = int(store_mod.ErrorCode.RPC_FAIL)
        assert d.setup_dummy(1 << 20, 1 << 20, "127.0.0.1") == bad
        assert d.setup_dummy(1 << 20, 1 << 20, "127.0.0.1:http") == bad
        assert d.setup_dummy("lots", 1 << 20, f"127.0.0.1:{port}") == bad
        # Nobody there; a master's port (a rendezvous server, but no mooncake_client's keys).
        assert d.setup_dummy(1 << 20, 1 << 20, f"127.0.0.1:{free_port()}", timeout_ms=2000) == rpc
        assert d.setup_dummy(1 << 20, 1 << 20, m.addr, timeout_ms=3000) == rpc
        assert not d._c.is_setup()
        # Another job's secret: refused by the mooncake_client, nothing learnt.
        r = subprocess.run([sys.executable, "-c", DUMMY, f"127.0.0.1:{port}"], text=True,
                           capture_output=True, timeout=60,
                           env=dict(os.environ, MC_SECRET="not-this-jobs-secret-" + "0" * 32))
        assert r.stdout.strip() == str(bad), (r.stdout, r.stderr)
        assert "denied" in r.stderr.lower() or "secret" in r.stderr.lower(), r.stderr
        # The same port again: the second mooncake_client says why it cannot start.
        q = start("--global_segment_size=16MB", f"--master_server_address={m.addr}",
                  f"--port={port}")
        out, err = q.communicate(timeout=30)
        assert q.returncode == 1 and "cannot serve dummy clients" in err, (out, err)
        d.close()
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        m.close()
