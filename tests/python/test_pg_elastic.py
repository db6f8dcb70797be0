"""Elastic groups through the real torch.distributed API (mooncake.pg's membership and
fault-tolerance functions; docs/elastic.md): upstream's elastic scenarios (fault detection,
recovery by a replacement process after an abrupt or a graceful exit, p2p recovery, extension
ranks with subgroups, framework-managed failures), the coordinating rank killed, and the
option checks. Each test starts its own processes and hosts the job's TCPStore itself, so
that any rank may die."""

import json
import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake import _compat

from _netns import extra_link, netns_pair
from harness import PYTHON, child_env, here_path

pytestmark = [
    pytest.mark.isolated,
]
WORKER = here_path("_elastic_worker.py")


class Job:
    """Processes 0..procs-1 of a scenario. host: the address the job's store listens on;
    netns: {process: network namespace} for processes that run on a second simulated host;
    env_of: {process: environment} added to env for that process."""

    def __init__(self, scenario, procs, env=None, timeout_s=120, host="127.0.0.1", netns=None,
                 env_of=None):
        _compat.honour_use_libuv_0()  # a torch without libuv: conftest has set USE_LIBUV=0
        self.store = dist.TCPStore(host, 0, is_master=True,
                                   timeout=timedelta(seconds=timeout_s))
        self.port = self.store.port
        self.procs, self.logs = [], []
        for p in range(procs):
            log = open(f"/tmp/mc_elastic_{os.getpid()}_{scenario}_{p}.log", "w+")
            self.logs.append(log)
            ns = (netns or {}).get(p)
            self.procs.append(subprocess.Popen(
                (["ip", "netns", "exec", ns] if ns else []) +
                [PYTHON, "-u", WORKER, scenario, str(p), str(self.port), host], stdout=log,
                stderr=subprocess.STDOUT, env=child_env({**(env or {}), **(env_of or {}).get(p, {})}),
                cwd="/"))
        self.timeout_s = timeout_s

    def reported(self, p):
        # torch 1.13's TCPStore has no check() (and a wait() that times out leaves its reply
        # on the socket): workers count their report in an integer key that add(0) reads.
        return self.store.add(f"resn/{p}", 0) > 0

    def result(self, p):
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.reported(p):
                return json.loads(self.store.get(f"res/{p}").decode())
            if self.procs[p].poll() is not None and not self.reported(p):
                break
            time.sleep(0.03)
        raise AssertionError(f"process {p} reported nothing\n{self.tails()}")

    def results(self, ps):
        out = {p: self.result(p) for p in ps}
        self.store.set("ev/exit", "1")  # the workers wait for it before they exit
        bad = {p: r["error"] for p, r in out.items() if "error" in r}
        assert not bad, "\n".join(f"--- process {p} ---\n{e}" for p, e in bad.items()) + \
            "\n" + self.tails()
        return out

    def wait_event(self, name, timeout_s=60):
        self.store.wait([f"ev/{name}"], timedelta(seconds=timeout_s))

    def log(self, p):
        self.logs[p].flush()
        self.logs[p].seek(0)
        return self.logs[p].read()

    def tails(self):
        return "\n".join(f"--- log of process {p} (exit {proc.poll()}) ---\n{self.log(p)[-2500:]}"
                         for p, proc in enumerate(self.procs))

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for log in self.logs:
            log.close()
            os.unlink(log.name)


@pytest.fixture
def job():
    jobs = []

    def start(scenario, procs, **kw):
        j = Job(scenario, procs, **kw)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.close()


def test_fault_detection_and_fast_reconciliation(job):
    j = job("fault_detection", 4)
    res = j.results([0, 2, 3])
    for p, r in res.items():
        print(f"process {p}: view without rank 1 {r['since_death'] * 1000:.0f} ms after it "
              f"exited; first op after the death {r['first']}")
        assert r["since_death"] < 2.0, r
        value, ok, hint = r["first"]
        assert ok and value == 8 or not ok and hint[1] == 1, r["first"]
    assert len({r["epoch"] for r in res.values()}) == 1


@pytest.mark.parametrize("graceful", ["0", "1"], ids=["abrupt", "graceful"])
def test_replacement_recovers_slot(job, graceful):
    j = job("recovery", 5, env={"GRACEFUL": graceful})
    res = j.results([0, 1, 2, 4] + ([3] if graceful == "1" else []))
    for p in (0, 1, 2, 4):
        r = res[p]
        value, ok, hint = r["final"]
        assert ok and value == 1 + 2 + 3 + 4, r
        assert r["gs"] == [[1.0, 2.0, 3.0, 4.0], (3 if p == 4 else p) * 4.0 + 4.0], r
        assert r["active"] == [1, 1, 1, 1]
    if graceful == "1":
        assert res[3]["status"] == 1


@pytest.mark.parametrize("hosts,victim", [(1, 1), (1, 2), (2, 1)])
def test_ep_buffer_after_recovery(job, hosts, victim, request):
    """mooncake.ep's update_ep_member after a replacement took a dead rank's slot (docs/ep.md,
    "Replaced ranks"): the middle slot (1) or the last (2, which an elastic group's size
    drops while it is inactive). hosts=2: process 0 here, slots 1 and 2 and the replacement
    on a second simulated host (engine WRITEs over tcp between the hosts, stores within
    each)."""
    env = {"VICTIM": str(victim)}
    if hosts == 1:
        j = job("ep_recovery", 4, env=env)
        mapped = {p: [True] * 3 for p in (0, 1, 2, 3)}
    else:
        ns, host_ip, _ = request.getfixturevalue("second_host")
        j = job("ep_recovery", 4, env=env, host=host_ip, netns={1: ns, 2: ns, 3: ns})
        mapped = {0: [True, False, False], 2: [False, True, True], 3: [False, True, True]}
    survivors = [p for p in (0, 1, 2) if p != victim]
    res = j.results(survivors + [3])
    for p, r in res.items():
        assert r["fails"] == [], (p, r["fails"])
        assert r["mapped"] == mapped[p], (p, r["mapped"])
    want = (f"rank {victim} of the elastic group is inactive" if victim < 2 else
            "ranks 2..2 of the elastic group are inactive")
    for p in survivors:
        assert res[p]["size"] == 3
        vacant, unusable = res[p]["refusals"]
        assert want in vacant, vacant
        assert "not connected: update_ep_member failed" in unusable, unusable


@pytest.fixture
def second_host():
    with netns_pair("el") as pair:
        yield pair


def test_recovery_across_simulated_hosts(second_host, job):
    """The recovery scenario over two simulated hosts: processes 0 and 1 here, ranks 2 and 3
    and the replacement in another network namespace (tcp between the halves, shared memory
    within each). Rank 3 dies, the survivors go on over 3 ranks, the replacement on the second
    host takes slot 3, and the full group's results match."""
    ns, host_ip, _ = second_host
    j = job("recovery", 5, host=host_ip, netns={2: ns, 3: ns, 4: ns},
            env={"GRACEFUL": "0", "MC_LOG_LEVEL": "INFO", "MC_LOG_SUBSYS": "ENGINE"})
    res = j.results([0, 1, 2, 4])
    for p in (0, 1, 2, 4):
        value, ok, hint = res[p]["final"]
        assert ok and value == 1 + 2 + 3 + 4, res[p]
        assert res[p]["gs"] == [[1.0, 2.0, 3.0, 4.0], (3 if p == 4 else p) * 4.0 + 4.0]
        assert res[p]["active"] == [1, 1, 1, 1]
    # Every survivor reached the other host's processes over tcp (the engines' host ids
    # differ), and its own host's over shared memory.
    for p in (0, 1, 2, 4):
        log = j.log(p)
        assert " over tcp" in log and " over shm" in log, log[-3000:]


def test_isolated_proposer_is_evicted_not_the_others(second_host, job):
    """Slot 0 (the first proposer) alone on a second simulated host whose engine link fails
    (the link taken down, its tcp connections aborted) while its link to the job's store stays:
    it sees every peer gone and they see it gone. It must not win with a view in which it alone
    is healthy (it weighed only itself and could); every process ends with slot 0 inactive and
    slots 1-3 running without it."""
    ns, host_ip, _ = second_host
    with extra_link(ns, "x") as (eng_here, eng_there, cut):
        j = job("isolated_proposer", 4, host=host_ip, netns={0: ns},
                env_of={0: {"MC_TCP_BIND_HOST": eng_there},
                        **{p: {"MC_TCP_BIND_HOST": eng_here} for p in (1, 2, 3)}})
        for p in range(4):
            j.wait_event(f"ready{p}")
        cut()
        j.store.set("ev/cut", "1")
        res = j.results([0, 1, 2, 3])
    for p in range(4):
        assert res[p]["active"] == [0, 1, 1, 1], res[p]
    for p in (1, 2, 3):
        assert res[p]["sum"] == [9.0, True, [0, 0, 0, 0]], res[p]
    assert len({res[p]["epoch"] for p in range(4)}) == 1, res


def test_p2p_recovery(job):
    j = job("p2p_recovery", 3)
    res = j.results([0, 2])
    r = res[0]
    assert r["local_success"] is False and r["hint"] == [0, 1], r
    assert r["active"] == [1, 0], "auto sync applied the view before the failed isend completed"
    assert r["status"] == 1


def test_p2p_size_mismatch_is_an_error_not_a_peer_failure(job):
    res = job("p2p_size_mismatch", 2).results([0, 1])
    assert "recv size mismatch" in res[1]["err"] and "16 bytes" in res[1]["err"], res[1]
    for p in (0, 1):
        assert res[p]["ok"] and res[p]["active"] == [1, 1], res[p]


def test_extension_ranks_with_subgroups(job):
    j = job("extension", 4)
    res = j.results([0, 1, 2, 3])
    for p, r in res.items():
        want_ab = {0: 1 + 3, 1: 2 + 4, 2: 1 + 3, 3: 2 + 4}[p]
        assert r["sums"] == {"world": 10.0, "c": 10.0, "ab": float(want_ab)}, (p, r)
        assert r["gs"] == [[1.0, 2.0, 3.0, 4.0], (p + 1) * 4.0], (p, r)


def test_framework_managed_failure(job):
    j = job("manual", 5)
    res = j.results([0, 2, 3, 4])
    for p in (0, 2, 3):
        r = res[p]
        value, ok, hint = r["r2"]
        assert not ok and hint == [0, 1, 0, 0], r
        assert r["act2"] == [1, 1, 1, 1] or r["deact_seen"] > 0, \
            ("framework-managed: membership unchanged until a survivor deactivates", r)
        assert r["sync"] in (0, 1) and r["peer"] is False, r
        assert r["deact"][0] in (1, 2), r
        assert r["r3"] == [8.0, True, [0, 0, 0, 0]], r
        assert r["rec"] == 1 and r["final"] == [10.0, True, [0, 0, 0, 0]], r
    assert res[4]["final"] == [10.0, True, [0, 0, 0, 0]]


@pytest.mark.skipif(_compat.TORCH_VERSION < (2, 1), reason="coalescing blocks: torch >= 2.1")
def test_coalesced_block_carries_failure_evidence(job):
    res = job("coalesced_evidence", 3).results([0, 1])
    for p in (0, 1):
        r = res[p]
        assert r["failed"], r
        for ok, hint in r["failed"]:  # every joined Work: a failure naming rank 2
            assert not ok and hint == [0, 0, 1], r
        assert r["deact"] in (1, 2) and r["active"] == [1, 1, 0], r
        ev, (ag_x, ag_y), rs = r["ok"]
        assert all(ok and hint == [0, 0, 0] for ok, hint in ev), r
        assert ag_x == [1.0] * 4 + [2.0] * 4, r  # gloo's layout: rank 0's block, then rank 1's
        assert ag_y == [float(i) for i in range(6)] + [float(i + 10) for i in range(6)], r
        # reduce_scatter of arange(4) * (rank + 1): sum over ranks 0, 1 = arange(4) * 3
        assert rs == [float(3 * (2 * p)), float(3 * (2 * p + 1))], r


def test_coordinating_rank_killed(job):
    j = job("coordinator_killed", 4)
    for p in range(4):
        j.wait_event(f"ready{p}")
    j.store.set("t_kill", repr(time.time()))
    j.procs[0].send_signal(signal.SIGKILL)
    res = j.results([1, 2, 3])
    for p, r in res.items():
        print(f"process {p}: view without rank 0 {r['since_kill'] * 1000:.0f} ms after the kill")
        assert r["since_kill"] < 2.0, r
    assert len({r["epoch"] for r in res.values()}) == 1


def test_options_and_argument_checks(job):
    r = job("options", 1).results([0])[0]
    assert r["errors"] == [], r
    assert r["warned"], "extend_group_size_to warns (deprecated no-op)"
    assert r["reject"] == [0, "target rank is not valid group member"], r
    assert r["sync"] == 1, "nothing pending: NoPending"
    assert r["epoch"] == 1 and r["synced"] == 1, r


@pytest.mark.parametrize("resume_s", [4.07, 4.12])
def test_survivors_agree_on_a_late_acknowledgement(resume_s):
    """A review's reproduction: the survivors' view barriers stop waiting at their own
    deadlines (150 ms apart), and slot 2's acknowledgement landed between them, so one survivor
    skipped an op the other did not and every later all_reduce paired op k with op k+1, both
    reporting success with wrong sums (3 of 3 runs at these offsets). The barrier's
    acknowledgements are now decided once for everyone. Whether a run hits the window depends
    on timing; the sums must be right either way."""
    job = Job("late_ack", 4)
    try:
        job.wait_event("in_op")
        time.sleep(0.3)
        os.kill(job.procs[2].pid, signal.SIGSTOP)
        t_stop = time.time()
        job.store.set("ev/stopped", "1")
        time.sleep(max(0.0, t_stop + resume_s - time.time()))
        os.kill(job.procs[2].pid, signal.SIGCONT)
        job.store.set("ev/resumed", "1")
        out = job.results([0, 1])
        for k in range(1, 6):
            want = 1000 * k * 2 + 1  # 1000k + 0 and 1000k + 1
            for p in (0, 1):
                assert out[p]["sums"][k - 1] == [want, True], (p, k, out, job.tails())
    finally:
        for p in job.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
        job.close()


def test_a_rank_waiting_on_the_job_store_is_not_evicted():
    """A review: torch's TCPStore client serialises its calls, so a user thread waiting on the
    job's store held the elastic agent's store calls up and the others evicted that live rank
    (view [0, 1] after slot 3 died). An elastic group now has a store connection of its own."""
    job = Job("store_wait", 4)
    try:
        out = {p: job.result(p) for p in (0, 1)}
        job.store.set("ev/release", "1")
        out[2] = job.result(2)
        job.store.set("ev/exit", "1")
        for p in (0, 1, 2):
            assert "error" not in out[p], (p, out[p], job.tails())
            assert out[p]["active"][:4] == [1, 1, 1, 0], (p, out, job.tails())
    finally:
        job.close()


def test_a_silent_inactive_slot_does_not_stall_the_agent(job):
    """A review: each agent tick tried to open every process the latest view names that this
    process had not opened, waiting up to 2 s for each that does not answer. An extension
    rank that never opened an inactive slot whose host went silent (here: its process stopped)
    held its agent there every tick, so each view change it took part in waited that long
    (and its observations came late enough to get it evicted). Nothing needs a link to an
    inactive slot: it must join again (Awaiting) before anyone activates it."""
    j = job("silent_slot", 4)
    j.wait_event("parked")
    time.sleep(0.3)
    os.kill(j.procs[2].pid, signal.SIGSTOP)
    j.store.set("ev/stopped", "1")
    res = j.results([0, 1, 3])
    print(f"extension rank created in {res[3]['init']:.2f} s; deactivate_ranks took "
          f"{res[0]['deact'][1]:.2f} s")
    assert res[0]["deact"][0] == 1, res[0]  # Applied
    assert res[0]["deact"][1] < 1.0, res[0]
    for p in (0, 1, 3):
        assert res[p]["active"] == [1, 0, 0, 1], (p, res[p])
    for p in (0, 3):
        assert res[p]["sum"] == [5.0, True, [0, 0, 0, 0]], (p, res[p])
