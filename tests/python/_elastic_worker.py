"""One process of an elastic-group scenario (test_pg_elastic.py). The job's c10d store is a
TCPStore hosted by the test (so any rank may die, rank 0 included); processes meet through
keys of that store ("ev/<name>" events) and report a JSON result under "res/<proc>".

Usage: _elastic_worker.py SCENARIO PROC STORE_PORT [STORE_HOST]   (host: 127.0.0.1)
"""

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import mooncake  # noqa: F401  (registers the backend)
from mooncake import pg

torch.set_num_threads(1)
SCENARIO, PROC, PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
STORE_HOST = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
STORE = dist.TCPStore(STORE_HOST, PORT, is_master=False, timeout=timedelta(seconds=120))


def event(name):
    STORE.set("ev/" + name, "1")


def wait_event(name, timeout_s=90):
    STORE.wait(["ev/" + name], timedelta(seconds=timeout_s))


def wait_until(pred, timeout_s, what, poll_s=0.005):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
    return time.time() - t0


def report(**kw):
    STORE.set(f"res/{PROC}", json.dumps(kw))
    STORE.add(f"resn/{PROC}", 1)  # what the test polls (test_pg_elastic.Job.reported)


def die():
    """An abrupt death (no teardown), as upstream's tests do."""
    sys.stdout.flush()
    os._exit(0)


def init(rank, world, max_group_size=None, is_extension=False, auto_deactivate=True,
         auto_sync=True):
    dist.init_process_group(
        "mooncake", store=STORE, rank=rank, world_size=world, timeout=timedelta(seconds=60),
        pg_options=pg.MooncakeBackendOptions(int(max_group_size or world), bool(is_extension),
                                             bool(auto_deactivate), bool(auto_sync)))
    return dist.group.WORLD


def all_reduce(value, group=None):
    t = torch.tensor([float(value)])
    w = dist.all_reduce(t, group=group, async_op=True)
    w.wait()
    return t.item(), pg.get_local_success(w), pg.get_failed_ranks_hint(w).tolist()


def active(backend):
    return pg.get_active_ranks(backend).tolist()


active_of = active  # (for scenarios with a local of that name)


def ping_pong(me, peer, verify=True):
    out, got = torch.tensor([me], dtype=torch.int64), torch.tensor([-1], dtype=torch.int64)
    ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer),
                                 dist.P2POp(dist.irecv, got, peer)])
    for w in ws:
        w.wait()
    ok = all(pg.get_local_success(w) for w in ws)
    if verify:
        assert ok, "ping-pong failed locally"
        assert got.item() == peer, f"ping-pong got {got.item()} from {peer}"
    return ok


def gather_scatter(n, rank, group=None):
    """all_gather_into_tensor and reduce_scatter_tensor (upstream's T12/T13 check)."""
    out = torch.zeros(n)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank + 1)]), group=group)
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.arange(1, n + 1, dtype=torch.float32), group=group)
    return out.tolist(), rs.item()


# ---- scenarios: each process runs the function for its role ----

def fault_detection():
    """T1 plus the reconciliation time: 4 ranks, rank 1 dies; the survivors' next all_reduce
    does not hang, and the one after runs over the 3 survivors."""
    b = init(PROC, 4)
    assert all_reduce(PROC + 1)[0] == 10
    if PROC == 1:
        STORE.set("t_death", repr(time.time()))
        event("broken")
        die()
    wait_event("broken")
    took = wait_until(lambda: active(b)[1] == 0, 10, "the view without rank 1")
    since = time.time() - float(STORE.get("t_death").decode())
    first = all_reduce(PROC + 1)
    second = all_reduce(PROC + 1)
    assert second[1] and second[0] == 1 + 3 + 4, second
    assert dist.get_world_size() == 4 and active(b) == [1, 0, 1, 1]
    report(since_death=since, waited=took, first=first, epoch=pg.get_current_epoch(b))


def recovery():
    """T2/T3/T13: ranks 0-3, rank 3 dies (or deactivates itself and leaves gracefully, env
    GRACEFUL=1), the survivors go on with 3 ranks (all_gather_into_tensor over n=3: a trailing
    hole), a replacement takes slot 3 and the full group runs again."""
    graceful = os.environ.get("GRACEFUL") == "1"
    if PROC == 4:  # the replacement
        wait_event("start_recovery")
        b = init(3, 4, is_extension=True)
        assert dist.get_world_size() == 4
        assert active(b) == [0, 0, 0, 1]
        assert all_reduce(40)[0] == 40  # isolated: local only
        pg.join_group(b)
        r = all_reduce(4)
        g = gather_scatter(4, 3)
        report(role="replacement", final=r, gs=g, active=active(b))
        return
    b = init(PROC, 4)
    assert all_reduce(PROC + 1)[0] == 10
    assert gather_scatter(4, PROC) == ([1.0, 2.0, 3.0, 4.0], (PROC + 1) * 4.0)
    if PROC == 3:
        if graceful:
            resp = pg.deactivate_ranks(b, [3])
            assert resp.status == pg.ProposalStatus.Applied, resp
            dist.destroy_process_group()
            report(role="gone", status=int(resp.status))
            return
        die()
    wait_until(lambda: active(b)[3] == 0, 20, "the view without rank 3")
    assert dist.get_world_size() == 3
    r2 = all_reduce(PROC + 1)
    assert r2 == (6.0, True, [0, 0, 0, 0]), r2
    g3 = gather_scatter(3, PROC)
    assert g3 == ([1.0, 2.0, 3.0], (PROC + 1) * 3.0), g3
    if PROC == 0:
        event("start_recovery")
    wait_until(lambda: pg.get_peer_state(b, [3])[0], 30, "the replacement ready", poll_s=0.05)
    resp = pg.recover_ranks(b, [3])
    assert resp.status == pg.ProposalStatus.Applied, resp
    assert dist.get_world_size() == 4
    r = all_reduce(PROC + 1)
    g = gather_scatter(4, PROC)
    report(role="survivor", final=r, gs=g, active=active(b), epoch=resp.new_epoch)


def ep_recovery():
    """mooncake.ep on an elastic group (Mooncake EP's update_ep_member): slots 0-2 run
    low-latency rounds (one after a plain update_ep_member), slot VICTIM (env, default 1) dies
    and the survivors' next round marks it inactive; rebuilding the buffer while that slot is
    vacant fails naming it; a replacement takes the slot, the survivors call update_ep_member
    while it constructs its buffer, and low-latency and normal rounds over all three equal the
    reference."""
    import shutil
    import tempfile

    import ep_cases
    from ep_cases import Cfg, ll_round, normal_round
    W, victim = 3, int(os.environ.get("VICTIM", "1"))
    ctx_dir = tempfile.mkdtemp(prefix="mc_ep_elastic_")
    try:
        if PROC == 3:  # the replacement
            wait_event("start_recovery")
            b = init(victim, W, is_extension=True)
            pg.join_group(b)
            ctx = ep_cases.Ctx(victim, W, ctx_dir)
            # (ctx.buffer constructs the Buffer: the exchange the survivors' update meets)
            fails = ll_round(ctx, Cfg(W, seed=63), torch.ones(W, dtype=torch.int32),
                             "recovered")
            cfg = Cfg(W, M=32, seed=64, tokens=[30, 27, 12])
            buf = ctx.buffer(24, 96, 4 * W)
            fails += normal_round(ctx, buf, cfg, "normal")
            report(role="replacement", fails=fails, mapped=[buf.is_mapped(r) for r in range(W)])
            return
        b = init(PROC, W)
        ctx = ep_cases.Ctx(PROC, W, ctx_dir)
        active = torch.ones(W, dtype=torch.int32)
        fails = ll_round(ctx, Cfg(W, seed=61), active, "before")
        buf = ctx.buffer(24, 96, 4 * W)
        buf.update_ep_member()  # no membership change: a reconnect (upstream's test does it)
        fails += ll_round(ctx, Cfg(W, seed=62), active, "reconnected")
        if PROC == victim:
            die()
        fails += ll_round(ctx, Cfg(W, seed=65), active, "after the death", timeout_us=3_000_000)
        if active.tolist() != [int(r != victim) for r in range(W)]:
            fails.append(f"active_ranks after the death: {active.tolist()}")
        wait_until(lambda: active_of(b)[victim] == 0, 20, f"the view without slot {victim}")
        refusals = []
        try:
            buf.update_ep_member()
            fails.append(f"update_ep_member with slot {victim} vacant did not fail")
        except RuntimeError as e:
            refusals.append(str(e))
        try:
            buf.dispatch(*Cfg(W, seed=66).inputs(PROC)[:2], active, 24, 4 * W)
            fails.append("dispatch on a buffer whose update failed did not fail")
        except RuntimeError as e:
            refusals.append(str(e))
        if PROC == 0:
            event("start_recovery")
        wait_until(lambda: pg.get_peer_state(b, [victim])[0], 30, "the replacement ready",
                   poll_s=0.05)
        resp = pg.recover_ranks(b, [victim])
        assert resp.status == pg.ProposalStatus.Applied, resp
        buf.update_ep_member()
        active[victim] = 1
        fails += ll_round(ctx, Cfg(W, seed=63), active, "recovered")
        cfg = Cfg(W, M=32, seed=64, tokens=[30, 27, 12])
        fails += normal_round(ctx, buf, cfg, "normal")
        report(role="survivor", fails=fails, refusals=refusals, size=buf.group_size,
               mapped=[buf.is_mapped(r) for r in range(W)])
    finally:
        shutil.rmtree(ctx_dir, ignore_errors=True)


def p2p_recovery():
    """T4: world 2; rank 1 dies; rank 0's isend to it completes locally failed, with the view
    already without it (auto sync); a replacement takes slot 1 and ping-pong works again."""
    if PROC == 2:
        wait_event("start_recovery")
        b = init(1, 2, is_extension=True)
        pg.join_group(b)
        ping_pong(1, 0)
        # A finished isend only means the engine has the message: stay until the peer got it.
        event("pp_replacement")
        wait_event("pp_survivor")
        report(role="replacement")
        return
    b = init(PROC, 2)
    ping_pong(PROC, 1 - PROC)
    event(f"pp1_{PROC}")
    wait_event(f"pp1_{1 - PROC}")
    if PROC == 1:
        event("broken")
        die()
    wait_event("broken")
    # The send must find rank 1 gone (its engine link closed), not race its exit.
    wait_until(lambda: not pg.get_peer_state(b, [1])[0], 10, "rank 1 seen dead")
    w = dist.isend(torch.tensor([7]), dst=1)
    w.wait()
    ok = pg.get_local_success(w)
    hint = pg.get_failed_ranks_hint(w).tolist()
    act = active(b)
    event("start_recovery")
    wait_until(lambda: pg.get_peer_state(b, [1])[0], 30, "the replacement ready", poll_s=0.05)
    resp = pg.recover_ranks(b, [1])
    ping_pong(0, 1)
    event("pp_survivor")
    wait_event("pp_replacement")
    report(role="survivor", local_success=ok, hint=hint, active=act, status=int(resp.status))


def p2p_size_mismatch():
    """A recv into a buffer of the wrong size, in an elastic group: a program error that raises
    naming both sizes (as in a plain group), not a failure of the healthy sender (it used to
    complete with local_success False and the sender in the hint, which could have a healthy
    rank deactivated). The group goes on: ping-pong, both ranks still active."""
    b = init(PROC, 2)
    err = None
    if PROC == 0:
        dist.isend(torch.arange(4, dtype=torch.float32), 1).wait()
    else:
        try:
            w = dist.irecv(torch.zeros(2), 0)
            w.wait()
            err = f"no error; local_success={pg.get_local_success(w)} " \
                  f"hint={pg.get_failed_ranks_hint(w).tolist()}"
        except RuntimeError as e:
            err = str(e)
    event(f"mm{PROC}")
    wait_event(f"mm{1 - PROC}")
    ok = ping_pong(PROC, 1 - PROC)
    report(err=err, ok=ok, active=active(b))


def extension():
    """T8/T11/T12: primaries 0,1 (world 2, 4 slots) with subgroups a=[0] (2 slots), b=[1]
    (2 slots), c=[0,1] (4 slots); joiners 2,3 create the same groups as extensions and join
    all of them; sums and all_gather/reduce_scatter over the grown groups."""
    joiner = PROC >= 2
    if joiner:
        wait_event("extend")
        world = init(PROC, 4, max_group_size=4, is_extension=True)
        assert dist.get_world_size() == 4
        ga = dist.new_group([0, 2], pg_options=pg.MooncakeBackendOptions(2, True))
        gb = dist.new_group([1, 3], pg_options=pg.MooncakeBackendOptions(2, True))
        gc = dist.new_group([0, 1, 2, 3], pg_options=pg.MooncakeBackendOptions(4, True))
        assert all_reduce(PROC + 1)[0] == PROC + 1  # isolated: local only
        pg.join_group(world)
        pg.join_group(ga if PROC == 2 else gb)
        pg.join_group(gc)
        assert dist.get_world_size() == 4
    else:
        world = init(PROC, 2, max_group_size=4)
        assert dist.get_world_size() == 2
        ga = dist.new_group([0], pg_options=pg.MooncakeBackendOptions(2))
        gb = dist.new_group([1], pg_options=pg.MooncakeBackendOptions(2))
        gc = dist.new_group([0, 1], pg_options=pg.MooncakeBackendOptions(4))
        assert all_reduce(PROC + 1)[0] == 3
        assert all_reduce(PROC + 1, gc)[0] == 3
        assert gather_scatter(2, PROC) == ([1.0, 2.0], (PROC + 1) * 2.0)
        if PROC == 0:
            event("extend")
        wait_until(lambda: all(pg.get_peer_state(world, [2, 3])), 30, "joiners (world)")
        assert pg.recover_ranks(world, [2, 3]).status == pg.ProposalStatus.Applied
        mine = ga if PROC == 0 else gb
        wait_until(lambda: pg.get_peer_state(mine, [1])[0], 30, "joiner (a/b)")
        assert pg.recover_ranks(mine, [1]).status == pg.ProposalStatus.Applied
        wait_until(lambda: all(pg.get_peer_state(gc, [2, 3])), 30, "joiners (c)")
        assert pg.recover_ranks(gc, [2, 3]).status == pg.ProposalStatus.Applied
        assert dist.get_world_size() == 4
    sums = {"world": all_reduce(PROC + 1)[0], "c": all_reduce(PROC + 1, gc)[0],
            "ab": all_reduce(PROC + 1, ga if PROC % 2 == 0 else gb)[0]}
    dist.barrier()
    report(sums=sums, gs=gather_scatter(4, PROC))


def manual():
    """T14, framework-managed: failed op = 8 with local_success False and hint [0,1,0,0],
    membership unchanged, sync_after_failure, deactivate_ranks, then recovery."""
    if PROC == 4:
        wait_event("start_recovery")
        b = init(1, 4, is_extension=True, auto_deactivate=False, auto_sync=False)
        pg.join_group(b)
        report(role="replacement", final=all_reduce(2))
        return
    b = init(PROC, 4, auto_deactivate=False, auto_sync=False)
    r1 = all_reduce(PROC + 1)
    assert r1 == (10.0, True, [0, 0, 0, 0]), r1
    assert active(b) == [1, 1, 1, 1]
    if PROC == 1:
        event("broken")
        die()
    wait_event("broken")
    wait_until(lambda: not pg.get_peer_state(b, [1])[0], 10, "rank 1 seen dead")
    r2 = all_reduce(PROC + 1)
    act2 = active(b)
    # Another survivor may have deactivated rank 1 already (each counts itself here first):
    # then this one may see that view.
    deact_seen = STORE.add("deact_started", 0)
    sync = pg.sync_after_failure(b)
    peer = pg.get_peer_state(b, [1])[0]
    STORE.add("deact_started", 1)
    resp = pg.deactivate_ranks(b, [1])
    r3 = all_reduce(PROC + 1)
    if PROC == 0:
        event("start_recovery")
    wait_until(lambda: pg.get_peer_state(b, [1])[0], 30, "the replacement ready", poll_s=0.05)
    rec = pg.recover_ranks(b, [1])
    report(role="survivor", r2=r2, act2=act2, deact_seen=deact_seen, sync=int(sync.status),
           peer=peer,
           deact=[int(resp.status), resp.dropped_ranks], r3=r3, rec=int(rec.status),
           final=all_reduce(PROC + 1))


def coalesced_evidence():
    """Framework-managed group of 3, rank 2 dead: a torch 2 coalescing block
    (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced: one joined Work over
    several parts) completes on the survivors with local_success False and rank 2 in the hint,
    as a single op's Work does; membership is unchanged, and after deactivate_ranks the same
    block runs over the two survivors and gives what gloo's arithmetic would."""
    b = init(PROC, 3, auto_deactivate=False, auto_sync=False)
    assert all_reduce(PROC + 1)[0] == 6
    if PROC == 2:
        event("broken")
        die()
    wait_event("broken")
    wait_until(lambda: not pg.get_peer_state(b, [2])[0], 10, "rank 2 seen dead")
    x = torch.full((4,), float(PROC + 1))
    y = torch.arange(6, dtype=torch.float32) + 10 * PROC

    def block(world):
        outs = [torch.full((4 * world,), -1.0), torch.full((6 * world,), -1.0)]
        rs_in = torch.arange(2 * world, dtype=torch.float32) * (PROC + 1)
        rs_out = torch.full((2,), -1.0)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], x)
            dist.all_gather_into_tensor(outs[1], y)
        ag = cm.works
        for w in ag:
            w.wait()
        with dist._coalescing_manager(async_ops=True) as cm2:
            dist.reduce_scatter_tensor(rs_out, rs_in)
        rs = cm2.works
        for w in rs:
            w.wait()
        ev = [[bool(pg.get_local_success(w)), pg.get_failed_ranks_hint(w).tolist()]
              for w in ag + rs]
        return ev, [o.tolist() for o in outs], rs_out.tolist()

    failed = block(3)
    # Both survivors ran their failed block before either deactivates rank 2 (a view without it
    # would make the other's block run at size 2).
    event(f"blk{PROC}")
    wait_event(f"blk{1 - PROC}")
    resp = pg.deactivate_ranks(b, [2])
    ok = block(2)  # slots 0 and 1: the size is one past the highest active slot
    report(failed=failed[0], ok=ok, deact=int(resp.status), active=active(b))


def isolated_proposer():
    """test_isolated_proposer_is_evicted_not_the_others: slot 0 runs on another simulated host
    whose engine link the test cuts after everyone is ready; the store stays reachable."""
    b = init(PROC, 4)
    assert all_reduce(PROC + 1)[0] == 10
    event(f"ready{PROC}")
    wait_event("cut")
    if PROC == 0:
        wait_until(lambda: active(b)[0] == 0, 30, "a view without slot 0")
        report(active=active(b), epoch=pg.get_current_epoch(b))
        return
    wait_until(lambda: active(b) == [0, 1, 1, 1], 30, "a view without slot 0")
    report(active=active(b), sum=list(all_reduce(PROC + 1)), epoch=pg.get_current_epoch(b))


def late_ack():
    """test_survivors_agree_on_a_late_acknowledgement: slot 2 is stopped inside an op no one
    else calls, slot 3 dies; the test resumes slot 2 between the two survivors' barrier
    deadlines, so that one of them reads its acknowledgement and the other does not. The
    survivors' next ops must pair up (they skipped different op counts before the mend)."""
    b = init(PROC, 4)
    pg.set_collective_timeout_us(3_000_000)
    for i in range(3):
        all_reduce(i)
    if PROC == 2:
        event("in_op")
        t = torch.tensor([999.0])
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        report(op=[t.item(), pg.get_local_success(w)])
        return
    wait_event("stopped")
    if PROC == 3:
        os._exit(0)
    wait_until(lambda: active(b)[:4] == [1, 1, 0, 0], 30, "the view without slots 2 and 3")
    wait_event("resumed")
    time.sleep(1.5)
    report(sums=[list(all_reduce(1000 * k + PROC))[:2] for k in range(1, 6)])


def store_wait():
    """test_a_rank_waiting_on_the_job_store_is_not_evicted: slot 2's main thread waits on the
    job's store (as NCCL's or gloo's setup, or the user's code, may) while slot 3 dies; slot 2's
    group must still answer and stay active."""
    b = init(PROC, 4)
    assert all_reduce(PROC + 1)[0] == 10
    event(f"ready{PROC}")
    for p in range(4):
        wait_event(f"ready{p}")
    if PROC == 3:
        time.sleep(0.5)
        os._exit(0)
    if PROC == 2:
        t0 = time.time()
        STORE.wait(["ev/release"], timedelta(seconds=60))
        report(blocked=time.time() - t0, active=active(b))
        return
    wait_until(lambda: active(b)[3] == 0, 20, "the view without slot 3")
    time.sleep(1.5)  # (a view evicting slot 2 would come within the collective timeout)
    report(active=active(b), epoch=pg.get_current_epoch(b))


def silent_slot():
    """test_a_silent_inactive_slot_does_not_stall_the_agent: slot 2 deactivates itself and the
    test stops its process (a host that no longer answers); an extension rank takes slot 3. The
    extension never opened slot 2; a later view change it takes part in must not wait for its
    agent to give up on opening slot 2 (2 s per tick)."""
    if PROC == 3:
        wait_event("stopped")
        t0 = time.time()
        b = init(3, 4, is_extension=True)
        t_init = time.time() - t0
        pg.join_group(b)
        wait_until(lambda: active(b)[1] == 0, 30, "the view without slot 1")
        report(init=t_init, active=active(b), sum=list(all_reduce(4)))
        return
    b = init(PROC, 3, max_group_size=4)
    assert all_reduce(PROC + 1)[0] == 6
    if PROC == 2:
        assert pg.deactivate_ranks(b, [2]).status == pg.ProposalStatus.Applied
        event("parked")
        time.sleep(120)  # the test stops this process
        return
    wait_until(lambda: active(b) == [1, 1, 0, 0], 30, "the view without slot 2")
    if PROC == 1:
        wait_until(lambda: active(b)[1] == 0, 60, "the view without slot 1")
        report(active=active(b))
        return
    wait_until(lambda: pg.get_peer_state(b, [3])[0], 60, "the extension rank", poll_s=0.05)
    assert pg.recover_ranks(b, [3]).status == pg.ProposalStatus.Applied
    time.sleep(0.5)  # every agent idle (the others' user threads call nothing)
    t0 = time.time()
    resp = pg.deactivate_ranks(b, [1])
    took = time.time() - t0
    report(deact=[int(resp.status), took], active=active(b), sum=list(all_reduce(1)))


def coordinator_killed():
    """Rank 0 (the first proposer; it hosts no store here) is SIGKILLed by the test: the
    others hold the view without it within 2 s and keep running."""
    b = init(PROC, 4)
    assert all_reduce(PROC + 1)[0] == 10
    event(f"ready{PROC}")
    if PROC == 0:
        time.sleep(60)
        return
    wait_until(lambda: active(b)[0] == 0, 10, "the view without rank 0")
    since = time.time() - float(STORE.get("t_kill").decode())
    r = all_reduce(PROC + 1)
    assert r == (9.0, True, [0, 0, 0, 0]), r
    report(since_kill=since, epoch=pg.get_current_epoch(b))


def options():
    """The invalid combination raises at construction with upstream's message; the API's
    argument checks; extend_group_size_to is a deprecated no-op."""
    import warnings
    try:
        init(0, 1, auto_deactivate=False, auto_sync=True)
        raise AssertionError("accepted auto_sync without auto_deactivate")
    except RuntimeError as e:
        msg = str(e)
    assert "auto_sync_on_failure requires auto_deactivate_on_failure=true" in msg, msg
    mirror = torch.full((3,), -1, dtype=torch.int32)
    dist.init_process_group(
        "mooncake", store=STORE, rank=0, world_size=1, timeout=timedelta(seconds=60),
        pg_options=pg.MooncakeBackendOptions(mirror, False, 3))
    b = dist.group.WORLD
    got = pg.get_active_ranks(b)
    assert got.data_ptr() == mirror.data_ptr() and mirror.tolist() == [1, 0, 0], mirror
    errors = []
    for fn in (lambda: pg.activate_ranks(b, [3]), lambda: pg.get_peer_state(b, [-1]),
               lambda: pg.deactivate_ranks(b, [7]), lambda: pg.extend_group_size_to(b, 9)):
        try:
            fn()
            errors.append("accepted")
        except RuntimeError:
            pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pg.extend_group_size_to(b, 3)
    resp = pg.activate_ranks(b, [1])  # slot 1 was never registered
    report(errors=errors, warned=any(issubclass(x.category, DeprecationWarning) for x in w),
           reject=[int(resp.status), resp.reject_reason], sync=int(pg.sync_after_failure(b).status),
           epoch=pg.get_current_epoch(b), synced=pg.get_num_synced_ranks(b))


def main():
    try:
        globals()[SCENARIO]()
    except BaseException:
        report(error=traceback.format_exc())
        raise
    # Stay until the test has every result: a rank that exits while a peer is still in the
    # last op (or has not received its last message) would make that peer's op fail.
    try:
        wait_event("exit", 120)
    except RuntimeError:
        pass
    sys.stdout.flush()
    os._exit(0)  # skip torch's teardown: survivors may not all be there to meet it


if __name__ == "__main__":
    main()
