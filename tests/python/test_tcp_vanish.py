"""A tcp peer whose host vanishes (power loss, cable pulled: no FIN, no RST) while this side has
bytes queued toward it is failed after MC_TCP_USER_TIMEOUT_MS (TCP_USER_TIMEOUT on the engine's
tcp connections), not after Linux's ~15 minutes of retransmissions: keepalive alone probes only
idle connections. The peer is an engine in another network namespace (a second "host"); its
host vanishes when everything it sends is dropped (a qdisc that holds no packet: no ACK, FIN or
RST comes back). Needs root, ip netns and tc; skipped otherwise."""
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _netns import netns_pair  # noqa: E402

torch = pytest.importorskip("torch")
eng = pytest.importorskip("mooncake.engine")

pytestmark = pytest.mark.skipif(shutil.which("tc") is None, reason="needs tc (iproute2)")

SIZE = 16 << 20
USER_TIMEOUT_MS = 2000

# The peer: an engine listening on the namespace's address, with a registered buffer.
PEER = r"""
import json, sys, torch
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize(sys.argv[1], "P2PHANDSHAKE", "tcp", "") == 0
kv = torch.zeros(int(sys.argv[2]), dtype=torch.uint8)
assert te.register_memory(kv.data_ptr(), kv.numel()) == 0
print(json.dumps({"session": f"{sys.argv[1]}:{te.get_rpc_port()}", "kv": kv.data_ptr()}),
      flush=True)
sys.stdin.read()
"""


def test_peer_whose_host_vanishes_mid_write_is_failed(monkeypatch, caplog):
    monkeypatch.setenv("MC_SECRET", secrets.token_hex(16))
    monkeypatch.delenv("MC_SECRET_FILE", raising=False)
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    monkeypatch.setenv("MC_TCP_USER_TIMEOUT_MS", str(USER_TIMEOUT_MS))
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "60")  # the batch's own deadline: far away
    with netns_pair("tv") as (ns, host_ip, ns_ip):
        peer = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", PEER, ns_ip,
                                 str(SIZE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ))
        try:
            line = peer.stdout.readline()
            assert line, f"peer exited ({peer.wait(10)})"
            info = json.loads(line)
            te = eng.TransferEngine()
            assert te.initialize(host_ip, "P2PHANDSHAKE", "tcp", "") == 0
            src = torch.ones(SIZE, dtype=torch.uint8)
            assert te.register_memory(src.data_ptr(), SIZE) == 0
            s = info["session"]
            # The peer is open (control and data connections) and healthy.
            assert te.transfer_sync_write(s, src.data_ptr(), info["kv"], 1 << 20) == 0
            # Its host vanishes: nothing it sends reaches this side any more.
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"{ns}n",
                            "root", "pfifo", "limit", "0"], check=True, capture_output=True)
            t0 = time.monotonic()
            # A notification (control connection) and a write (data connections) in flight:
            # no connection is idle, so keepalive sends no probe on any of them.
            te._e.notify(s, "n", "m")
            batch = te.transfer_submit_write(s, src.data_ptr(), info["kv"], SIZE)
            assert batch != 0
            st = 0
            with caplog.at_level(logging.WARNING, logger="mooncake.engine"):
                while st == 0 and time.monotonic() - t0 < 8 * USER_TIMEOUT_MS / 1000:
                    time.sleep(0.05)
                    st = te.transfer_check_status(batch)
            took = time.monotonic() - t0
            # Failed (-1: the peer is dead), not still in flight (0) nor timed out (-2).
            assert st == -1, f"status {st} after {took:.1f}s"
            assert took >= USER_TIMEOUT_MS / 1000 * 0.9, took
            assert "PEER_DEAD" in caplog.text and "timed out" in caplog.text, caplog.text
        finally:
            peer.kill()
            peer.wait(10)
