"""A group that spans hosts, through torch: ranks 0-1 and 2-3 get different MC_HOST_ID values,
so the engine treats each pair as another host (tcp between the pairs, shared memory within
a pair) and the group runs all_reduce hierarchically. Every collective is compared with a
local reference and with gloo on the same processes (tolerance for floating reductions:
the hierarchical sum adds per host first); a rank killed on one host is named on both. The
collectives run again with both hosts on the verbs emulator's NICs, where rdma links them."""

import time

import pytest

import _fake_verbs
from harness import Pool
from pg_cases import OPS

pytestmark = pytest.mark.isolated

SMALL = [0, 1, 7, 1000]
BIG = 2**20 + 3


def two_hosts(r):
    return {"MC_HOST_ID": f"host-{r // 2}", "MC_LOG_LEVEL": "INFO", "MC_LOG_SUBSYS": "PG"}


def test_collectives_on_two_hosts_match_gloo():
    p = Pool(4, timeout_s=120, rank_env=two_hosts)
    try:
        p.check("allreduce", sizes=SMALL, ops=tuple(OPS))
        p.check("allreduce", sizes=[BIG], dtypes=("float32", "bfloat16"), ops=("SUM", "MAX"))
        p.check("allreduce", sizes=[0, 7, 1000], coalesced=True)
        p.check("reduce", sizes=[1000], ops=("SUM", "MAX"), roots=[3])
        p.check("broadcast", sizes=[1000], roots=[2])
        p.check("all_gather", sizes=[1000], api="tensor")
        p.check("reduce_scatter", sizes=[1000], api="tensor")
        p.check("all_to_all_single", sizes=[1000], uneven=True)
        logs = p.tails(200000)
    finally:
        p.close()
    assert logs.count("ready on hierarchical: 2 hosts, 2 ranks on this one") >= 4, logs[-3000:]


def test_rank_killed_on_one_host_is_named_on_both():
    p = Pool(4, timeout_s=120, rank_env=two_hosts)
    try:
        at = time.time() + 1.0
        p.start("die", victim=3, at=at, mode="kill", phase="between")
        res = p.collect(ranks=[0, 1, 2], timeout_s=60)
    finally:
        p.kill()
    for r, x in zip([0, 1, 2], res):
        assert x["raised"], f"rank {r} never saw the failure"
        assert "rank 3" in x["msg"], f"rank {r}: error does not name rank 3: {x['msg']}"
        assert x["since_call"] < 2.0, f"rank {r} raised {x['since_call']:.2f}s after: {x['msg']}"


@pytest.mark.skipif(_fake_verbs.library_dir() is None, reason="no verbs emulator (MC_WITH_RDMA=OFF)")
def test_collectives_on_two_hosts_over_rdma_match_gloo():
    """Both simulated hosts have two emulated RoCE NICs: the engine links the hosts over rdma
    (shm within a host), and the leaders' messages and send/recv pieces of 4 KiB and more are
    RDMA WRITEs into their receive slots: the NICs carry the large all_reduce's and the p2p
    ring's bytes (the small messages stay two-sided, on the rdma transport's tcp control link,
    docs/rdma.md)."""
    fabric = _fake_verbs.Fabric("pg", ["host-0", "host-1"])

    def env(r):
        return dict(two_hosts(r), MC_LOG_SUBSYS="PG,ENGINE")

    p = Pool(4, timeout_s=120, env=fabric.env(), rank_env=env)
    try:
        p.check("allreduce", sizes=[0, 7, 1000], ops=("SUM", "MAX"))
        before = [fabric.tx_bytes(h) for h in ("host-0", "host-1")]
        p.check("allreduce", sizes=[BIG], dtypes=("float32",), ops=("SUM",))
        sent = [fabric.tx_bytes(h) - b for h, b in zip(("host-0", "host-1"), before)]
        p.check("broadcast", sizes=[1000], roots=[2])
        p.check("all_gather", sizes=[1000], api="tensor")
        p.check("reduce_scatter", sizes=[1000], api="tensor")
        p.check("all_to_all_single", sizes=[1000], uneven=True)
        before = [fabric.tx_bytes(h) for h in ("host-0", "host-1")]
        p.check("p2p", sizes=[0, 7, 300000], dtypes=("float32",))
        sent_p2p = [fabric.tx_bytes(h) - b for h, b in zip(("host-0", "host-1"), before)]
        logs = p.tails(400000)
    finally:
        p.close()
        fabric.close()
    assert logs.count("ready on hierarchical: 2 hosts, 2 ranks on this one") >= 4, logs[-3000:]
    assert " over rdma" in logs, "no peer was opened over rdma:\n" + logs[-3000:]
    assert " over tcp" not in logs, "a peer was opened over tcp:\n" + logs[-3000:]
    # Each leader sends the other half of the 4 MiB tensor twice (reduce-scatter, all-gather)
    # for each of the check's calls; the NICs must have carried at least one such half.
    for host, n in zip(("host-0", "host-1"), sent):
        assert n >= BIG * 4 // 2, f"{host}'s NICs sent {n} bytes during the large all_reduce"
    # The p2p ring crosses hosts twice (rank 1 -> 2, 3 -> 0): its 1.2 MB messages are RDMA
    # WRITEs into receive slots.
    for host, n in zip(("host-0", "host-1"), sent_p2p):
        assert n >= 300000 * 4, f"{host}'s NICs sent {n} bytes during the p2p case"
