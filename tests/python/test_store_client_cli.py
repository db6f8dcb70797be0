"""`mooncake_client`, upstream's standalone store client (vLLM's standalone-store mode: the
serving ranks lend nothing, this process owns the pool), with upstream's flags against a
running master: objects a client that lends nothing writes land in its segment and read back;
SIGTERM unmounts it and exits 0; refused flags and a master nobody serves fail with a message."""
import os
import signal
import subprocess
import sys
import time

import pytest

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
                  "--protocol", "tcp", "--port=50052", "--metadata_server=http://x:8080/metadata",
                  "--start_offload_rpc_server", "--noenable_http_server", "--enable_offload=false")
        line = p.stdout.readline()
        assert line.startswith("mooncake_client ready segment=127.0.0.1:"), \
            line + p.stderr.read()
        seg = line.split("segment=")[1].split()[0]
        assert f"bytes={64 << 20}" in line
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
