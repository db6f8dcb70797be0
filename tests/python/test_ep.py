"""mooncake.ep with real rank processes (world sizes 2, 3 and 4): low-latency and normal
dispatch/combine against a plain-torch reference, autograd, validation and killed ranks.

Each world size runs all its cases in one set of processes (torch import dominates the
cost); the kill cases get processes of their own. The workers inherit this environment,
PYTHONPATH included, so a build can be tested before it is installed:
    PYTHONPATH=<build>/python /usr/bin/python3 -m pytest tests/python/test_ep.py
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fake_verbs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable  # as harness.PYTHON
WORKER = os.path.join(HERE, "_ep_worker.py")
MAIN_CASES = ["kernel_path", "ll_modes", "ll_fp8", "validation", "one_rank_bad_input", "normal", "normal_autograd",
              "upstream_api", "mismatched_combine", "slow_reader"]
KILL_CASES = ["kill_between_rounds", "kill_between_dispatch_and_combine", "normal_after_kills"]

_runs = {}


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def _ep_available():
    r = subprocess.run([PYTHON, "-c", "import mooncake, mooncake.ep; mooncake._C.EpBuffer"],
                       capture_output=True, text=True, env=_env(), cwd="/")
    return r.returncode == 0, r.stderr[-1500:]


_ok, _why = _ep_available()
pytestmark = pytest.mark.skipif(not _ok, reason="mooncake.ep not built into mooncake._C: " + _why)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, cases, timeout_s=180, env=None, rank_env=None):
    """Runs `cases` on `world` fresh rank processes; returns (per-rank results, exit codes,
    log tails). rank_env: rank -> more environment for that rank."""
    out = tempfile.mkdtemp(prefix=f"mc_ep_w{world}_")
    port = _free_port()
    procs, logs = [], []
    for r in range(world):
        log = open(os.path.join(out, f"rank{r}.log"), "w")
        logs.append(log.name)
        procs.append(subprocess.Popen(
            [PYTHON, "-u", WORKER, "--rank", str(r), "--world", str(world), "--port", str(port),
             "--cases", ",".join(cases), "--out", out],
            stdout=log, stderr=subprocess.STDOUT,
            env=_env(dict(env or {}, **(rank_env(r) if rank_env else {}))), cwd="/"))
        log.close()
    deadline = time.time() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append("timeout")
    results, tails = [], []
    for r in range(world):
        try:
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append({})
        with open(logs[r], errors="replace") as f:
            tails.append(f.read()[-20000:])
    return results, codes, tails


def _report(world, r, case, res, tails):
    return f"world {world} rank {r} case {case}: {res}\n--- log ---\n{tails[r]}"


def _check(world, cases, case, ranks):
    _assert_passed(world, [case], *_runs[(world, tuple(cases))], ranks=ranks)


def _assert_passed(world, cases, results, codes, tails, ranks=None):
    """Every rank (of `ranks`, default all) returned no failure for every case."""
    for case in cases:
        for r in range(world) if ranks is None else ranks:
            res = results[r].get(case, results[r].get("__init__", "no result (exit %s)" % codes[r]))
            assert res == [], _report(world, r, case, res, tails)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", MAIN_CASES)
def test_ep(world, case):
    key = (world, tuple(MAIN_CASES))
    if key not in _runs:
        # World 3 writes every output with streaming stores (the path large shapes take;
        # the test shapes are below the default threshold).
        env = {"MC_PG_STREAM_OUT_BYTES": "0"} if world == 3 else None
        _runs[key] = run_ranks(world, MAIN_CASES, env=env)
    _check(world, MAIN_CASES, case, range(world))


# Both kill cases run in one set of processes, in order: the last rank dies between
# rounds, then rank 1 between dispatch and combine.
VICTIMS = {"kill_between_rounds": lambda w: w - 1, "kill_between_dispatch_and_combine": lambda w: 1,
           "normal_after_kills": lambda w: None}  # (kills nobody)


def _victims(world, cases):
    return {VICTIMS[c](world) for c in cases} - {None}


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("case", KILL_CASES)
def test_ep_killed_rank(world, case):
    key = (world, tuple(KILL_CASES))
    if key not in _runs:
        _runs[key] = run_ranks(world, KILL_CASES)
    results, codes, tails = _runs[key]
    dead = _victims(world, KILL_CASES[:KILL_CASES.index(case) + 1])
    for v in dead:
        assert codes[v] == -9, f"victim rank {v} exit {codes[v]}\n{tails[v]}"
    _check(world, KILL_CASES, case, [r for r in range(world) if r not in dead])
    for r in range(world):
        if r not in _victims(world, KILL_CASES):
            assert codes[r] == 0, _report(world, r, case, codes[r], tails)


# The CUDA kernels' bodies (ep/kernels/ll_kernels.h, normal_kernels.h) run on the host
# (MC_EP_KERNELS=host: one lane; threads: 4 lane threads a block): the low-latency and normal
# cases against the same plain-torch reference, and a rank killed between rounds and between
# dispatch and combine marked inactive by the bodies' own deadline or the engine's notice.
KERNEL_CASES = ["kernel_path", "ll_modes", "ll_fp8", "validation", "one_rank_bad_input",
                "normal", "normal_autograd", "upstream_api", "mismatched_combine", "slow_reader"]


@pytest.mark.parametrize("world,lanes", [(2, "host"), (3, "host"), (4, "host"), (3, "threads")])
def test_ep_kernel_bodies_on_host(world, lanes):
    _assert_passed(world, KERNEL_CASES,
                   *run_ranks(world, KERNEL_CASES, env={"MC_EP_KERNELS": lanes}))


def _check_kills(world, results, codes, tails):
    """Both kill cases' victims died by SIGKILL; every survivor passed every case it ran after
    the deaths so far."""
    dead = _victims(world, KILL_CASES)
    for v in dead:
        assert codes[v] == -9, f"victim rank {v} exit {codes[v]}\n{tails[v]}"
    for case in KILL_CASES:
        gone = _victims(world, KILL_CASES[:KILL_CASES.index(case) + 1])
        _assert_passed(world, [case], results, codes, tails,
                       ranks=[r for r in range(world) if r not in gone])


def test_ep_kernel_bodies_on_host_killed_rank():
    """(The combine after the second death waits without a timeout: the engine's notice of the
    death ends it, as on the CPU path.)"""
    world = 3
    _check_kills(world, *run_ranks(world, KILL_CASES, env={
        "MC_EP_KERNELS": "host", "EP_CASES_COMBINE_NO_TIMEOUT": "1"}))


@pytest.mark.parametrize("world,per_host", [(2, 1), (3, 2)])
def test_ep_host_buffers_across_hosts(world, per_host):
    """Host buffers whose group spans simulated hosts (MC_HOST_ID): the ranks on one host write
    into each other's buffers, the others through engine WRITEs over tcp, signals and read
    marks by notification (ep/peer_writer.h, ep/read_marks.cc). A reader on another host that
    reads late (case_slow_reader) holds its peers' third call of a kind back as one on this
    host does; hooks and refused calls (ll_modes) and normal mode against the reference."""
    cases = ["slow_reader", "ll_modes", "normal"]
    _assert_passed(world, cases, *run_ranks(
        world, cases, rank_env=lambda r: {"MC_HOST_ID": f"host-{r // per_host}"}))


GPU_ENV = {"MC_DEVICE": "sim", "EP_CASES_GPU": "1"}
GPU_CASES = ["gpu_buffer", "ll_modes", "ll_fp8", "validation", "one_rank_bad_input", "normal",
             "normal_autograd", "mismatched_combine", "overrun_detected"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_gpu_buffers_sim(world):
    """Buffers in GPU memory of the device layer's simulation (memory that faults when host
    code touches it; peers' buffers opened through IPC handles, the kernels' entry point run on
    the simulated stream): the low-latency, fp8, normal and autograd cases against the
    plain-torch reference, validation and one rank's bad input, through ep_cases_gpu.GpuBuffer,
    the GPU buffer's refusals, and a round overwritten before it was read raised as such."""
    _assert_passed(world, GPU_CASES, *run_ranks(world, GPU_CASES, env=GPU_ENV))


def test_ep_gpu_buffers_sim_killed_rank():
    """Both kill cases on GPU buffers: the dead ranks' host-mapped flags end the kernels' waits
    (the combine after the second death has no timeout)."""
    world = 3
    _check_kills(world, *run_ranks(world, KILL_CASES,
                                   env=dict(GPU_ENV, EP_CASES_COMBINE_NO_TIMEOUT="1")))


STREAM_ENV = dict(GPU_ENV, MC_EP_STREAM_CALLS="1")


@pytest.mark.parametrize("world", [2, 3])
def test_ep_gpu_buffers_sim_stream_calls(world):
    """The same GPU buffers with stream-ordered low-latency calls (MC_EP_STREAM_CALLS=1, what
    the CUDA layer does by default): the call queues the kernels on the buffer's stream and
    returns; the low-latency, fp8 and normal cases against the reference, and
    ep_cases_gpu.case_stream_calls (no host wait, late reports of the kernels' checks)."""
    cases = ["stream_calls", "ll_modes", "ll_fp8", "normal"]
    _assert_passed(world, cases, *run_ranks(world, cases, env=STREAM_ENV))


@pytest.mark.parametrize("world,per_host", [(2, 2), (3, 3), (4, 2)])
def test_ep_gpu_buffers_sim_graph_replay(world, per_host):
    """Stream-ordered calls captured as a CUDA graph is captured (over the simulation: the
    device layer's capture of the caller's stream) and launched again with new inputs, against
    the reference, with eager rounds in step between the launches
    (ep_cases_gpu.case_graph_replay); per_host < world: on two simulated hosts, where each
    replayed send's kernels hand the host proxy its job (ep/ll_proxy.h, the ring)."""
    _assert_passed(world, ["graph_replay"], *run_ranks(
        world, ["graph_replay"], env=STREAM_ENV,
        rank_env=lambda r: {"MC_HOST_ID": f"host-{r // per_host}"}))


def test_ep_gpu_buffers_sim_stream_calls_killed_rank():
    """Both kill cases with stream-ordered calls: the kernels mark the dead ranks inactive
    with no host thread waiting."""
    world = 3
    _check_kills(world, *run_ranks(world, KILL_CASES,
                                   env=dict(STREAM_ENV, EP_CASES_COMBINE_NO_TIMEOUT="1")))


HOSTS_CASES = ["across_hosts", "ll_modes", "ll_fp8", "upstream_api", "normal", "normal_autograd"]


@pytest.mark.parametrize("world,per_host,stream", [(2, 1, False), (4, 2, False), (2, 1, True),
                                                   (4, 2, True)])
def test_ep_gpu_buffers_sim_across_hosts(world, per_host, stream):
    """GPU buffers whose group spans simulated hosts (MC_HOST_ID, `per_host` ranks each): the
    ranks on one host store into each other's buffers (IPC), the others are reached through
    the buffer's host proxy (ep/ll_proxy.h: the kernels stage, the proxy moves the rows with
    engine WRITEs over tcp and the signals through the peer's mailbox + notify); low latency
    bf16, fp32 and fp8 and normal mode (with autograd) against the plain-torch reference,
    hooks in flight, every stage reused by both modes; waited and stream-ordered calls.
    Waited, also case_gpu_buffer: bad inputs refused on every rank (their rounds given up
    across hosts too) and a rank that cannot make its buffer failing every rank's set-up."""
    env = STREAM_ENV if stream else GPU_ENV
    cases = HOSTS_CASES + ([] if stream else ["gpu_buffer"])
    _assert_passed(world, cases, *run_ranks(
        world, cases, env=env, rank_env=lambda r: {"MC_HOST_ID": f"host-{r // per_host}"}))


@pytest.mark.parametrize("stream", [False, True])
def test_ep_gpu_buffers_sim_across_hosts_proxy_lags(stream):
    """The host proxy's stage reuse (ep/ll_proxy.h): rank 0's proxy moves each send's rows
    250 ms late (MC_EP_PROXY_DELAY_MS), so its sends two rounds apart must wait for the
    earlier round's move (on the host, or in a stage before the send for stream-ordered calls):
    case_proxy_lags, then case_across_hosts, against the reference; 2 ranks on 2 hosts."""
    world, cases = 2, ["proxy_lags", "across_hosts"]
    _assert_passed(world, cases, *run_ranks(
        world, cases, env=STREAM_ENV if stream else GPU_ENV,
        rank_env=lambda r: {"MC_HOST_ID": f"host-{r}",
                            "MC_EP_PROXY_DELAY_MS": "250" if r == 0 else "0"}))


@pytest.mark.parametrize("stream", [False, True])
def test_ep_gpu_buffers_sim_across_hosts_killed_rank(stream):
    """Both kill cases on GPU buffers over two simulated hosts (ranks 0-1 on one, 2 on the
    other): the rank on the other host dies first, then one on this host; the dead ranks'
    flags end the kernels' waits, the proxy's writes to a dead rank fail without holding the
    others, later rounds run clean."""
    world = 3
    _check_kills(world, *run_ranks(world, KILL_CASES,
                                   env=dict(STREAM_ENV if stream else GPU_ENV,
                                            EP_CASES_COMBINE_NO_TIMEOUT="1"),
                                   rank_env=lambda r: {"MC_HOST_ID": f"host-{r // 2}"}))


@pytest.mark.skipif(_fake_verbs.library_dir() is None, reason="no verbs emulator (MC_WITH_RDMA=OFF)")
def test_ep_over_rdma_between_hosts():
    """Two ranks on two simulated hosts with the verbs emulator's NICs: dispatch/combine (low
    latency and normal) match the plain-torch reference with the ranks linked over rdma, and
    the NICs carried the tokens (EP's remote writes are one-sided engine writes)."""
    fabric = _fake_verbs.Fabric("ep", ["host-0", "host-1"])
    cases = ["ll_modes", "normal"]
    try:
        results, codes, tails = run_ranks(
            2, cases, env=dict(fabric.env(), MC_LOG_LEVEL="INFO", MC_LOG_SUBSYS="ENGINE"),
            rank_env=lambda r: {"MC_HOST_ID": f"host-{r}"})
        tx = [fabric.tx_bytes("host-0"), fabric.tx_bytes("host-1")]
    finally:
        fabric.close()
    _assert_passed(2, cases, results, codes, tails)
    for r in range(2):
        assert " over rdma" in tails[r], _report(2, r, "transport", "no peer over rdma", tails)
    assert min(tx) > 0, f"the emulated NICs carried nothing: {tx}"


def test_ep_module_carries_the_process_group_functions():
    """Upstream's mooncake.ep re-exported its process-group module (older SGLang calls
    mooncake.ep.set_host_ip and imports MooncakeBackendOptions / get_active_ranks from it):
    the same objects as mooncake.pg's; mooncake_ep_buffer.Buffer is in host memory here (no
    CUDA in this torch), in GPU memory where torch has CUDA."""
    code = (
        "import mooncake.ep as ep, mooncake.pg as pg, torch\n"
        "names = ['set_host_ip', 'set_device_filter', 'get_device_filter', 'set_transfer_engine',\n"
        "         'MooncakeBackendOptions', 'get_active_ranks', 'get_peer_state', 'recover_ranks',\n"
        "         'join_group', 'deactivate_ranks', 'set_fault_reconciliation_window_us']\n"
        "assert all(getattr(ep, n) is getattr(pg, n) for n in names)\n"
        "import inspect, mooncake.mooncake_ep_buffer as u\n"
        "assert inspect.signature(u.Buffer).parameters['device'].default is None\n"
        "print('ok')\n")
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=_env(),
                       cwd="/", timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-2000:]
