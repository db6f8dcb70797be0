"""Failure behaviour: a rank that dies makes the others raise an error naming it within
2 s (torch.distributed.DistBackendError on torch 2.x, as NCCL and gloo raise it; a
RuntimeError on 1.13); init_process_group(timeout=...) bounds every op; detectable wrong
use across ranks raises everywhere; a healthy job shuts down cleanly. Each test starts its
own processes."""

import time

import pytest

from harness import Pool, failure_type

pytestmark = pytest.mark.isolated


@pytest.mark.parametrize("phase,mode", [("between", "exit"), ("during", "kill")])
def test_killed_rank_is_named_within_2s(phase, mode):
    p = Pool(3, timeout_s=120)
    try:
        at = time.time() + 1.0
        p.start("die", victim=1, at=at, mode=mode, phase=phase)
        res = p.collect(ranks=[0, 2], timeout_s=60)
    finally:
        p.kill()
    for r, x in zip([0, 2], res):
        assert x["raised"], f"rank {r} never saw the failure"
        msg = x["msg"]
        assert "rank 1" in msg, f"rank {r}: error does not name rank 1: {msg}"
        assert "allreduce" in msg, f"rank {r}: error does not name the op: {msg}"
        took = x["since_call"] if phase == "between" else x["since_death"]
        print(f"rank {r}: raised {took:.3f}s after the death: {msg}")
        assert took < 2.0, f"rank {r} raised {took:.2f}s after the death: {msg}"
        assert x["type"] == failure_type(), f"rank {r} raised {x['type']}: {msg}"
        assert x["later_op"] == failure_type(), f"rank {r}: a later op: {x['later_op']}"
        if "future_result" in x:  # WorkResult.COMM_ERROR
            assert x["future_result"] == 2, f"rank {r}: get_future_result {x['future_result']}"


def test_timeout_bounds_ops():
    p = Pool(2, timeout_s=2)
    try:
        res = p.run("timeout", absent=1, timeout_s=60)
    finally:
        p.kill()
    x = res[0]
    print(f"rank 0: {x}")
    assert x["raised"], f"all_reduce with an absent rank returned after {x['elapsed']:.1f}s"
    assert 1.5 <= x["elapsed"] <= 10, f"timed out after {x['elapsed']:.1f}s, limit was 2s"
    assert "time" in x["msg"].lower(), x["msg"]
    assert "mooncake" in x["msg"] and "allreduce" in x["msg"], x["msg"]
    assert x["type"] == failure_type(), f"{x['type']}: {x['msg']}"


def test_split_mismatch_across_ranks_raises_everywhere():
    p = Pool(2, timeout_s=30)
    try:
        res = p.run("split_mismatch", timeout_s=60)
    finally:
        p.kill()
    for r, x in enumerate(res):
        assert x["raised"], f"rank {r} accepted mismatched splits"
        # Rank 1 expects 2 elements from rank 0, which sends 1: each side names the other.
        other = 1 - r
        assert f"[peer rank {other}]" in x["msg"] or f"peer rank {other}" in x["msg"], \
            f"rank {r}'s error does not name its peer rank {other}: {x['msg']}"


@pytest.mark.parametrize("what,op", [("dtype", "allreduce"), ("op", "allreduce"),
                                     ("root", "broadcast"), ("order", None),
                                     ("broadcast_dtype", "broadcast"),
                                     ("allgather_dtype", "allgather"),
                                     ("gather_dtype", "gather"), ("scatter_dtype", "scatter"),
                                     ("alltoall_dtype", "alltoall_base")])
def test_collective_mismatch_across_ranks_raises_everywhere(what, op):
    """Found by a bad-input sweep against gloo, which hangs until its timeout (root, order),
    aborts the process (dtype of another size) or returns a silently wrong result (dtype of
    the same size, reduce op). The group timeout is 30 s: each rank must raise within 5 s."""
    p = Pool(2, timeout_s=30)
    try:
        res = p.run("sig_mismatch", what=what, timeout_s=60)
    finally:
        p.kill()
    for r, x in enumerate(res):
        assert x["raised"], f"rank {r} returned {x.get('result')} after {x['elapsed']:.1f}s"
        msg = x["msg"]
        assert x["elapsed"] < 5, f"rank {r} raised after {x['elapsed']:.1f}s: {msg}"
        assert f"mooncake rank {r}" in msg, f"rank {r}: error does not name its rank: {msg}"
        assert "mismatched" in msg, f"rank {r}: error does not name the cause: {msg}"
        assert f"rank {1 - r}" in msg.split(":", 1)[1], f"rank {r}: no peer named: {msg}"
        if op is not None:
            assert f"{op} failed" in msg, f"rank {r}: error does not name {op}: {msg}"
        else:
            assert "allreduce" in msg and "broadcast" in msg, f"rank {r}: {msg}"


def test_clean_shutdown():
    p = Pool(2)
    p.run("barrier", times=3)
    codes = p.close(timeout_s=30)
    assert codes == [0, 0], f"exit codes {codes}\n{p.tails()}"


# The group's path: shared memory (one host), or messages (each rank on a simulated host of
# its own: MC_HOST_ID; the engine links them over tcp, pg/net_group.h).
PATHS = {"shm": lambda r: {"MC_LOG_LEVEL": "INFO", "MC_LOG_SUBSYS": "PG"},
         "net": lambda r: {"MC_HOST_ID": f"host-{r}", "MC_LOG_LEVEL": "INFO",
                           "MC_LOG_SUBSYS": "PG"}}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("op,bad", [("broadcast", 1), ("allreduce", 1), ("allgather", 2),
                                    ("gather", 0), ("alltoall", 1), ("reduce_scatter", 1)])
def test_bad_input_on_one_rank_raises_everywhere(op, bad, path):
    """Found by a bad-input sweep against gloo: an argument that only one rank gets wrong used
    to raise there alone while the others waited in the op until the group timeout (30 s here)
    or paired it with that rank's next op. Every rank must raise for the op (the others within
    2 s, naming the rank, the op and the cause) and the next ops must work on every rank. On
    the message path too, except a rank that needs nothing from the erring one: a broadcast's
    third rank hears only from the root there and may complete it, with the root's data."""
    p = Pool(3, timeout_s=30, rank_env=PATHS[path])
    try:
        res = p.run("bad_input_one_rank", op=op, bad=bad, timeout_s=90)
        logs = p.tails(200000)
    finally:
        p.kill()
    assert logs.count(f"ready on {path},") == 3, logs[-3000:]
    for r, x in enumerate(res):
        print(f"rank {r}: {x}")
        if path == "net" and op == "broadcast" and r not in (0, bad) and not x["raised"]:
            assert x["value"] == [0.0, 1.0, 2.0, 3.0], f"rank {r} completed with {x['value']}"
            assert x["later_ok"], f"rank {r}: the ops after it gave {x['later']}"
            continue
        assert x["raised"], f"rank {r} returned from {op} after {x['elapsed']:.1f}s"
        msg = x["msg"]
        assert f"mooncake rank {r}" in msg, f"rank {r}: error does not name its rank: {msg}"
        if r != bad:
            assert x["elapsed"] < 2, f"rank {r} raised after {x['elapsed']:.1f}s: {msg}"
            assert f"rank {bad} gave " in msg and "invalid argument" in msg, \
                f"rank {r}: error does not name rank {bad}'s refusal: {msg}"
            assert op.replace("_", "") in msg.replace("_", ""), f"rank {r}: op not named: {msg}"
        assert x["later_ok"], f"rank {r}: the ops after it gave {x['later']}"
    # The cause the erring rank raised is what the others report.
    why = res[bad]["msg"].rsplit(": ", 1)[-1]
    for r, x in enumerate(res):
        if x["raised"]:
            assert why in x["msg"], f"rank {r} does not give the cause '{why}': {x['msg']}"
