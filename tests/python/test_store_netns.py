"""A client in another network namespace (a second "host": no shared memory, no common
loopback) reaches the master and the memory holder over tcp, and reads and writes correct
data. Needs root (ip netns); creates a namespace and a veth pair with its own addresses and
removes them afterwards."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _netns import netns_pair  # noqa: E402
from _store_common import Holder, Master, master_bin  # noqa: E402

CLIENT = r"""
import os, sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("remote", "", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
v = s.get("from-host")
assert v == bytes(range(256)) * 4096, len(v)
payload = os.urandom(3 << 20)
assert s.put("from-ns", payload) == 0
assert s.get("from-ns") == payload
open(sys.argv[2], "wb").write(payload)
s.close()
print("ok", flush=True)
"""


@pytest.fixture
def netns():
    with netns_pair("st") as pair:
        yield pair


@pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
def test_client_in_other_netns(netns, tmp_path):
    ns, host_ip, _ = netns
    from mooncake.store import MooncakeDistributedStore
    # The master listens on the address the namespace reaches; clients on this host are given
    # that address too, so their engines listen on the same interface (not on loopback).
    m = Master("--host", host_ip)
    addr = f"{host_ip}:{m.port}"
    h = Holder(addr)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("local", "", 0, 16 << 20, "tcp", "", addr) == 0
        assert s.put("from-host", bytes(range(256)) * 4096) == 0
        out = tmp_path / "payload"
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT,
                            f"{host_ip}:{m.port}", str(out)],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
        # What the remote client wrote is read back here, byte for byte.
        assert s.get("from-ns") == out.read_bytes()
    finally:
        s.close()
        h.close()
        m.close()
