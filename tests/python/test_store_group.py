"""Store.from_group: each rank of a mooncake process group lends memory; the master runs on
rank 0 over the group's engine and rendezvous; every rank reads every other rank's objects."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Master, free_port, master_bin  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.isolated
@pytest.mark.parametrize("world,standalone", [(2, False), (3, False), (2, True)])
def test_store_from_group(world, standalone):
    if standalone and master_bin() is None:
        pytest.skip("mooncake_master not built")
    master = Master() if standalone else None
    try:
        _run_group(world, master.addr if master else "")
    finally:
        if master:
            master.close()


def _run_group(world, master_addr):
    port = free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_store_group_worker.py"),
                               str(r), str(world), str(port)] + ([master_addr] if master_addr else []),
                              env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("Store.from_group hung")
        outs.append((p.returncode, out, err[-3000:]))
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"ok {r}" in out, f"rank {r} rc={rc}\n{out}\n{err}"
