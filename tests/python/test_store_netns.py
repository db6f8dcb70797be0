"""A client in another network namespace (a second "host": no shared memory, no common
loopback) reaches the master and the memory holder over tcp, and reads and writes correct
data. Needs root (ip netns); creates a namespace and a veth pair with its own addresses and
removes them afterwards."""
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Holder, Master, master_bin  # noqa: E402

NS = f"mcst{os.getpid() % 100000}"
VETH_HOST, VETH_NS = f"{NS}h", f"{NS}n"
NET = f"10.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250}"
HOST_IP, NS_IP = f"{NET}.1", f"{NET}.2"

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


def sh(*cmd, ns=None):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    subprocess.run(full, check=True, capture_output=True)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    try:
        sh("ip", "netns", "add", NS)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"ip netns unavailable: {e.stderr}")
    try:
        sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        sh("ip", "link", "set", VETH_NS, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST)
        sh("ip", "link", "set", VETH_HOST, "up")
        sh("ip", "addr", "add", f"{NS_IP}/24", "dev", VETH_NS, ns=NS)
        sh("ip", "link", "set", VETH_NS, "up", ns=NS)
        sh("ip", "link", "set", "lo", "up", ns=NS)
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", VETH_HOST], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


@pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
def test_client_in_other_netns(netns, tmp_path):
    from mooncake.store import MooncakeDistributedStore
    # The master listens on the address the namespace reaches; clients on this host are given
    # that address too, so their engines listen on the same interface (not on loopback).
    m = Master("--host", HOST_IP)
    addr = f"{HOST_IP}:{m.port}"
    h = Holder(addr)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("local", "", 0, 16 << 20, "tcp", "", addr) == 0
        assert s.put("from-host", bytes(range(256)) * 4096) == 0
        out = tmp_path / "payload"
        r = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", CLIENT,
                            f"{HOST_IP}:{m.port}", str(out)],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
        # What the remote client wrote is read back here, byte for byte.
        assert s.get("from-ns") == out.read_bytes()
    finally:
        s.close()
        h.close()
        m.close()
