"""The torch backend on tensors in GPU memory, over the engine's device layer simulation
(MC_DEVICE=sim; pg_cases_gpu.py says how): every collective and send/recv on GPU tensors gives
the same bytes as on host tensors, at 2 and 3 ranks on one host and at 4 ranks over two
simulated hosts (hierarchical, tcp between them); async ops; a non-contiguous GPU tensor is
refused with a clear error. Real CUDA tensors need a CUDA build of torch and a GPU
(scripts/gpu_check.sh)."""

import time

import pytest

from harness import Pool, failure_type

pytestmark = pytest.mark.isolated

SIZES = [0, 1, 1000, 2**18 + 3]


def run_all(p, sizes, dtypes_red, dtypes_copy, stream=True):
    p.check("gpu_stream_ops", expect_stream=stream, sizes=sizes[1:])
    p.check("gpu_stream_copies", expect_stream=stream, sizes=sizes[1:])
    p.check("gpu_stream_lists", expect_stream=stream, sizes=sizes[1:])
    p.check("gpu_stream_alltoallv", expect_stream=stream)
    p.check("gpu_stream_alltoall_list", expect_stream=stream)
    p.check("gpu_reductions", sizes=sizes, dtypes=dtypes_red, ops=("SUM", "MAX", "AVG"))
    p.check("gpu_reductions", sizes=[7], dtypes=("int64", "uint8"), ops=("SUM", "BXOR", "MIN"))
    p.check("gpu_copies", sizes=sizes, dtypes=dtypes_copy)
    p.check("gpu_async")
    p.check("gpu_coalesced")
    p.check("gpu_errors")


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_on_gpu_tensors_one_host(world):
    """At 2 ranks allreduce takes the host-driven path (MC_PG_STREAM_OPS=auto, the simulation's
    default), at 3 the stream-ordered one (pg/stream_ops.h)."""
    stream = world == 3
    env = {"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1" if stream else "auto"}
    p = Pool(world, timeout_s=120, env=env, gloo=False)
    try:
        run_all(p, SIZES, ("float32", "bfloat16"), ("float32", "int8"), stream=stream)
    finally:
        p.close()


def test_every_op_on_gpu_tensors_two_hosts():
    p = Pool(4, timeout_s=120, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False,
             rank_env=lambda r: {"MC_HOST_ID": f"host-{r // 2}"})
    try:
        run_all(p, [0, 1000, 2**17 + 1], ("float32",), ("float16",), stream=False)
    finally:
        p.close()


# ---- stream-ordered allreduce (pg/stream_ops.h) ----------------------------------------------

@pytest.mark.parametrize("env", [
    {"MC_PG_STREAM_OPS": "1", "MC_PG_STREAM_OPS_CHUNK_BYTES": "4096"},
    {"MC_PG_STREAM_OPS": "1", "MC_PG_STREAM_OPS_CHUNK_BYTES": "4096",
     "MC_PG_STREAM_OPS_ONESHOT_BYTES": "0"},
    {"MC_PG_STREAM_OPS": "0"}], ids=["small_steps", "small_steps_two_shots", "off"])
def test_stream_allreduce(env):
    """Steps of 4 KiB (a 1 MiB all_reduce takes 257 of them, through both buffers many times;
    reduce_scatter and all_to_all cut every block into pieces of 4 KiB / 2), all_reduce in one
    shot up to 256 KiB and two shots above it, or two shots at every size; and the path turned
    off (the host-driven path, still right)."""
    p = Pool(2, timeout_s=120, env=dict({"MC_DEVICE": "sim"}, **env), gloo=False)
    try:
        for case in ("gpu_stream_ops", "gpu_stream_copies", "gpu_stream_lists"):
            p.check(case, expect_stream=env["MC_PG_STREAM_OPS"] != "0", sizes=(1, 5000, 2**18 + 3))
        p.check("gpu_stream_alltoallv", expect_stream=env["MC_PG_STREAM_OPS"] != "0")
        p.check("gpu_stream_alltoall_list", expect_stream=env["MC_PG_STREAM_OPS"] != "0")
    finally:
        p.close()


def test_stream_allreduce_mismatch_raises_everywhere():
    p = Pool(2, timeout_s=30, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        res = p.run("gpu_stream_mismatch", timeout_s=60)
    finally:
        p.kill()
    for r, x in enumerate(res):
        assert x["raised"], f"rank {r}: mismatched all_reduce did not raise"
        msg = x["msg"]
        for want in ("allreduce(float32 x 1000", "allreduce(float32 x 1001", "mooncake"):
            assert want in msg, f"rank {r}: error does not name {want!r}: {msg}"
        assert x["type"] == failure_type(), f"rank {r}: {x['type']}: {msg}"
        assert x["later"]["raised"], f"rank {r}: an op after the failure did not raise"


def test_stream_allreduce_dead_peer_is_named_within_2s():
    p = Pool(3, timeout_s=120, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        at = time.time() + 1.0
        p.start("gpu_stream_die", victim=1, at=at)
        res = p.collect(ranks=[0, 2], timeout_s=60)
    finally:
        p.kill()
    for r, x in zip([0, 2], res):
        assert x["raised"], f"rank {r}: all_reduce with a dead peer did not raise"
        msg = x["msg"]
        print(f"rank {r}: raised after {x['elapsed']:.3f}s: {msg}")
        assert "rank 1" in msg and "allreduce" in msg, f"rank {r}: {msg}"
        assert x["elapsed"] < 2.0, f"rank {r}: raised {x['elapsed']:.2f}s into the call: {msg}"
        assert x["type"] == failure_type(), f"rank {r}: {x['type']}: {msg}"
        assert x["later"]["raised"], f"rank {r}: an op after the failure did not raise"


def test_stream_allreduce_absent_rank_times_out():
    p = Pool(2, timeout_s=2, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        res = p.run("gpu_stream_absent", absent=1, timeout_s=60)
    finally:
        p.kill()
    x = res[0]
    print(f"rank 0: {x}")
    assert x["raised"], f"all_reduce with an absent rank returned after {x['elapsed']:.1f}s"
    assert 1.5 <= x["elapsed"] <= 10, f"raised after {x['elapsed']:.1f}s, the timeout was 2s"
    for want in ("rank 1", "stream-ordered", "MC_PG_STREAM_OPS=0"):
        assert want in x["msg"], f"error does not name {want!r}: {x['msg']}"


def test_stream_gather_root_with_host_outputs_is_refused():
    p = Pool(2, timeout_s=20, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        res = p.run("gpu_stream_root_host", timeout_s=60)
    finally:
        p.kill()
    x = res[0]
    assert x["raised"], "gather into host tensors from GPU inputs did not raise on the root"
    assert x["elapsed"] < 1.0, f"the root raised after {x['elapsed']:.1f}s: {x['msg']}"
    for want in ("gather", "rank 0", "root's buffers must be GPU memory", "MC_PG_STREAM_OPS=0"):
        assert want in x["msg"], f"error does not name {want!r}: {x['msg']}"
    assert x["later"]["raised"], "rank 0: the op after the refused gather did not raise"
    y = res[1]
    print(f"rank 1: {y}")
    assert y["raised"] or y["later"]["raised"], "rank 1: neither its gather nor its next op raised"


def test_stream_alltoall_sizes_that_do_not_pair_up():
    p = Pool(3, timeout_s=10, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        res = p.run("gpu_stream_alltoallv_bad", timeout_s=90)
    finally:
        p.kill()
    for r, x in enumerate(res):
        print(f"rank {r}: {x}")
        assert x["raised"], f"rank {r}: sizes that do not pair up did not raise"
        assert "do not pair up" in x["msg"], f"rank {r}: {x['msg']}"
        assert x["elapsed"] < 2.0, f"rank {r}: raised after {x['elapsed']:.1f}s"
        assert x["after_ok"], f"rank {r}: the all_reduce after it failed: {x['after']}"
        assert x["mixed"]["raised"], f"rank {r}: splits on some ranks only did not raise"
        assert x["mixed"]["elapsed"] < 5.0, f"rank {r}: {x['mixed']}"
        if r > 0:  # they see rank 0's op without sizes where theirs has them
            assert "rank 0 called alltoall" in x["mixed"]["msg"], x["mixed"]["msg"]
            assert "without split sizes" in x["mixed"]["msg"], x["mixed"]["msg"]


# ---- stream-ordered send/recv (pg/stream_p2p.h) -----------------------------------------------

@pytest.mark.parametrize("world,env", [
    (2, {"MC_PG_STREAM_OPS": "1", "MC_PG_STREAM_P2P_SLOT_BYTES": "4096"}),
    (3, {"MC_PG_STREAM_OPS": "1"}),
    (2, {"MC_PG_STREAM_OPS": "0"})], ids=["small_slots", "three_ranks", "off"])
def test_stream_p2p(world, env):
    """Slots of 4 KiB (a 1 MiB message is 257 chunks through the two slots of its pair), the
    default 4 MiB ones at 3 ranks, and the path off (the host-driven send/recv)."""
    p = Pool(world, timeout_s=120, env=dict({"MC_DEVICE": "sim"}, **env), gloo=False)
    try:
        p.check("gpu_stream_p2p", expect_stream=env["MC_PG_STREAM_OPS"] != "0")
        p.check("gpu_stream_p2p_late_peer")
    finally:
        p.close()


@pytest.mark.parametrize("what", ["size", "tag"])
def test_stream_p2p_mismatch_names_both(what):
    p = Pool(2, timeout_s=20, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        res = p.run("gpu_stream_p2p_mismatch", what=what, timeout_s=60)
    finally:
        p.kill()
    x = res[1]
    print(f"rank 1: {x}")
    assert x["raised"], f"rank 1: a recv of another {what} than the send did not raise"
    want = ("4000 bytes", "4004 bytes") if what == "size" else ("tag 3", "tag 4")
    for s in want + ("rank 0", "recv"):
        assert s in x["msg"], f"rank 1: the error does not name {s!r}: {x['msg']}"
    assert x["elapsed"] < 5.0, f"rank 1: raised after {x['elapsed']:.1f}s"
    for r in (0, 1):
        assert res[r]["later"]["raised"], f"rank {r}: the op after the mismatch did not raise"


def test_stream_p2p_dead_peer_is_named_within_2s():
    p = Pool(3, timeout_s=120, env={"MC_DEVICE": "sim", "MC_PG_STREAM_OPS": "1"}, gloo=False)
    try:
        at = time.time() + 1.0
        p.start("gpu_stream_p2p_die", victim=1, at=at)
        res = p.collect(ranks=[0], timeout_s=60)
    finally:
        p.kill()
    x = res[0]
    print(f"rank 0: {x}")
    assert x["raised"], "rank 0: a recv from a dead peer did not raise"
    assert "rank 1" in x["msg"], x["msg"]
    assert x["since_death"] < 2.0, f"raised {x['since_death']:.2f}s after the peer died"
    assert x["type"] == failure_type(), f"{x['type']}: {x['msg']}"
    assert x["later"]["raised"], "rank 0: the op after the failure did not raise"
