"""A standalone master that stalls (SIGSTOP) for longer than the client TTL while a client keeps
putting: when it resumes it expires the client, and the client's queued puts may reach it before
the client's heartbeat. The client must still be told to mount its segment again (and, mounting
again on the master that expired it, wipe the records of the objects that master dropped)."""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Master, free_port, master_bin, stop_process  # noqa: E402

store_mod = pytest.importorskip("mooncake.store")

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")

# Puts k0, k1, ... as fast as it can; prints the index of every put that succeeded, every 50th.
PUTTER = r"""
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("putter", "", 64 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
print("ready", s.get_hostname(), flush=True)
i = 0
while True:
    rc = s.put("k%d" % i, b"x" * 1000)
    if rc == 0 and i % 50 == 0:
        print("ok", i, flush=True)
    i += 1
"""


def http(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def metric(port, name):
    for line in http(port, "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def wait_for(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_client_expired_while_the_master_stalled_mounts_again():
    mport = free_port()
    master = Master("--client-ttl-s", "2", "--metrics-port", str(mport))
    putter = subprocess.Popen([sys.executable, "-c", PUTTER, master.addr],
                              stdout=subprocess.PIPE, text=True)
    reader = None
    try:
        line = putter.stdout.readline()
        assert line.startswith("ready"), line
        name = line.split()[1]
        last_ok = [-1]

        def follow():
            for out in putter.stdout:
                if out.startswith("ok"):
                    last_ok[0] = int(out.split()[1])

        threading.Thread(target=follow, daemon=True).start()
        assert wait_for(lambda: last_ok[0] >= 0, 10)
        assert name in http(mport, "/get_all_segments").split()
        # Stall the master past the TTL until it expires the putter (at its resume it may serve
        # the putter's heartbeat before it expires it: then stall again).
        for _ in range(5):
            stop_process(master.pid)
            time.sleep(3)
            master.proc.send_signal(signal.SIGCONT)
            time.sleep(0.5)
            if metric(mport, "mooncake_store_client_expirations_total"):
                break
        assert metric(mport, "mooncake_store_client_expirations_total") >= 1
        t = time.monotonic()
        # Its segment comes back within a few heartbeats (0.5 s each); before, never.
        assert wait_for(lambda: name in http(mport, "/get_all_segments").split(), 6), \
            "the putter's segment was not mounted again"
        mounted_after = time.monotonic() - t
        before = last_ok[0]
        assert wait_for(lambda: last_ok[0] > before + 100, 10), "puts do not succeed again"
        # What the master dropped when it expired the putter must not come back: restart the
        # master (same port); the putter reports the records it holds. k0 was dropped (its only
        # replica was in the putter's segment); its record must have been wiped at the remount.
        master.proc.kill()
        master.proc.wait(10)
        master = Master("--client-ttl-s", "2", "--metrics-port", str(mport), port=master.port)
        recent = last_ok[0]
        reader = store_mod.MooncakeDistributedStore()
        assert reader.setup("reader", "", 0, 16 << 20, "tcp", "", master.addr) == 0
        assert wait_for(lambda: reader.is_exist(f"k{recent}") == 1, 15), \
            "the putter's objects did not come back after the restart"
        assert reader.is_exist("k0") == 0, \
            f"an object the master dropped came back (remounted after {mounted_after:.1f} s)"
    finally:
        if reader is not None:
            reader.close()
        putter.kill()
        putter.wait(10)
        master.proc.send_signal(signal.SIGCONT)
        master.close()
