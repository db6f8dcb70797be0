"""close() while other threads are inside calls on the same store (a serving stack's shutdown:
its transfer threads still run). close() waits for the calls in flight and refuses new ones;
it used to destroy the client under them (SIGSEGV on the first try). Each worker checks what it
got: the stored bytes or a "not set up" answer, never other bytes. Also two threads closing at
once, and close, setup and close again while the workers go on. Run in a child process so
that a crash is a failure with its signal, not the end of the test run."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Master, master_bin  # noqa: E402

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")

CHILD = r"""
import os, sys, threading, time
import torch
from mooncake.store import MooncakeDistributedStore

addr, trials = sys.argv[1], int(sys.argv[2])
value = os.urandom(256 << 10)
bad = []
for trial in range(trials):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 64 << 20, 16 << 20, "tcp", "", addr) == 0
    for i in range(4):
        assert s.put(f"k{i}", value) == 0
    dst = torch.zeros(4 * len(value), dtype=torch.uint8)
    assert s.register_buffer(dst.data_ptr(), dst.numel()) == 0
    stop = threading.Event()
    calls = [0]

    def worker(w):
        n = 0
        while not stop.is_set():
            got = s.get(f"k{n % 4}")
            if got not in (b"", value):
                bad.append(("get", len(got)))
            s.put(f"w{w}/{n}", value)  # (any code: the segment fills up)
            sizes = s.batch_get_into([f"k{i}" for i in range(4)],
                                     [dst.data_ptr() + i * len(value) for i in range(4)],
                                     [len(value)] * 4)
            for i, r in enumerate(sizes):
                chunk = dst[i * len(value):(i + 1) * len(value)].numpy().tobytes()
                if r == len(value) and chunk != value:
                    bad.append(("batch_get_into", i))
                elif r != len(value) and r >= 0:
                    bad.append(("batch_get_into size", r))
            h = s.get_buffer("k1")
            if h is not None and bytes(memoryview(h)) != value:
                bad.append(("get_buffer", h.size()))
            s.is_exist("k2")
            s.get_hostname()
            n += 1
            calls[0] += 1

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in ts:
        t.start()
    time.sleep(0.03 + 0.01 * trial)
    if trial % 3 == 1:  # two closers at once (a with-block's exit and a shutdown hook)
        closers = [threading.Thread(target=s.close) for _ in range(2)]
        for c in closers:
            c.start()
        for c in closers:
            c.join(60)
    elif trial % 3 == 2:  # closed, set up again and closed again under the same workers
        assert s.close() == 0
        assert s.setup("127.0.0.1", "", 64 << 20, 16 << 20, "tcp", "", addr) == 0
        assert s.put("again", value) == 0 and s.get("again") == value
        time.sleep(0.05)
        assert s.close() == 0
    else:
        assert s.close() == 0
    # Closed: every call answers "not set up", at once.
    assert s.put("after", value) == -600 and s.get("k0") == b"" and s.is_exist("k0") < 0
    stop.set()
    for t in ts:
        t.join(60)
        assert not t.is_alive(), "a worker hangs after close()"
    print("trial", trial, "calls", calls[0], flush=True)
print("bad", bad, flush=True)
sys.exit(1 if bad else 0)
"""


def test_close_while_other_threads_call():
    m = Master()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, m.addr, "9"], capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
        assert r.stdout.count("trial") == 9 and "bad []" in r.stdout, r.stdout
    finally:
        m.close()
