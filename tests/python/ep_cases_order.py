"""EP test cases on the order of rounds across ranks (docs/ep.md "Rounds and ordering"), run
inside every rank by _ep_worker.py as ep_cases.py's are: a rank that reads late while its peers
go on (host buffers: the read marks hold them back), and the same order on GPU buffers, which
do not wait for the marks (their kernels notice the overwrite)."""

import re
import time

import torch

from ep_cases import Cfg, check_ll_combine, check_ll_dispatch, ll_y, normal_round


SLOW_S = 0.3  # case_slow_reader: how late rank 0 reads


def case_slow_reader(ctx):
    """Two calls of a kind in flight with hooks while rank 0 calls its hooks SLOW_S late, then
    a third call of the kind on every rank: the other ranks' third call reuses the half of rank
    0's first one, so it must wait until rank 0 read it (the read marks, docs/ep.md "Rounds and
    ordering"). Low latency (dispatch, then combine), then the same with normal mode's calls as
    the third ones; every result against the reference, nobody marked inactive. (Without the
    marks rank 0's first hook found its rows overwritten: it timed out and marked the others
    inactive.)"""
    R, me = ctx.world, ctx.rank
    fails = []
    active = torch.ones(R, dtype=torch.int32)
    t_us = 5_000_000
    c, d, e = Cfg(R, seed=31), Cfg(R, seed=32, dtype=torch.float32), Cfg(R, seed=33)
    buf = ctx.buffer(32, 96, c.E)  # (case_normal's: normal mode's rows fit it)

    def late():
        if me == 0:
            time.sleep(SLOW_S)

    for third in ("low latency", "normal"):
        tag = f"slow reader, third call {third}"
        (xc, tc, wc), (xd, td, wd) = c.inputs(me), d.inputs(me)
        rc = buf.dispatch(xc, tc, active, c.M, c.E, timeout_us=t_us, return_recv_hook=True)
        rd = buf.dispatch(xd, td, active, d.M, d.E, timeout_us=t_us, return_recv_hook=True)
        late()
        rc[4]()
        rd[4]()
        fails += check_ll_dispatch(c, me, rc[0], rc[1], rc[2], active, tag + " (c)")
        fails += check_ll_dispatch(d, me, rd[0], rd[1], rd[2], active, tag + " (d)")
        if third == "low latency":
            xe, te, we = e.inputs(me)
            r_e = buf.dispatch(xe, te, active, e.M, e.E, timeout_us=t_us)
            fails += check_ll_dispatch(e, me, r_e[0], r_e[1], r_e[2], active, tag + " (e)")
        oc = buf.combine(ll_y(c, me, rc[0], rc[1]), tc, wc, active, t_us, rc[2],
                         return_recv_hook=True)
        od = buf.combine(ll_y(d, me, rd[0], rd[1]), td, wd, active, t_us, rd[2],
                         return_recv_hook=True)
        late()
        oc[2]()
        od[2]()
        fails += check_ll_combine(c, me, oc[0], active, tag + " (c)")
        fails += check_ll_combine(d, me, od[0], active, tag + " (d)")
        if third == "low latency":
            oe = buf.combine(ll_y(e, me, r_e[0], r_e[1]), te, we, active, t_us, r_e[2])
            fails += check_ll_combine(e, me, oe[0], active, tag + " (e)")
        else:  # normal_dispatch is the third dispatch, normal_combine the third combine
            fails += normal_round(ctx, buf, Cfg(R, M=32, seed=34, tokens=[30, 27, 0, 12][:R]), tag)
        if active.tolist() != [1] * R:
            return fails + [f"{tag}: active_ranks changed: {active.tolist()}"]
    return fails


def case_overrun_detected(ctx):
    """GPU buffers do not wait for the read marks (docs/ep.md "Rounds and ordering"): every
    rank sends two hooked dispatches, the others call their hooks and send a third one before
    rank 0 calls its first hook (a file barrier orders it). Rank 0's first hook then finds the
    later round in its signal words and raises RuntimeError naming the rank at once (not after
    timeout_us, and nobody is marked inactive); its second hook and everyone's third dispatch
    are unaffected."""
    R, me = ctx.world, ctx.rank
    fails = []
    active = torch.ones(R, dtype=torch.int32)
    t_us = 10_000_000
    c, d, e = Cfg(R, seed=41), Cfg(R, seed=42), Cfg(R, seed=43)
    buf = ctx.buffer(c.M, c.H, c.E)
    (xc, tc, _), (xd, td, _), (xe, te, _) = c.inputs(me), d.inputs(me), e.inputs(me)
    rc = buf.dispatch(xc, tc, active, c.M, c.E, timeout_us=t_us, return_recv_hook=True)
    rd = buf.dispatch(xd, td, active, d.M, d.E, timeout_us=t_us, return_recv_hook=True)
    if me != 0:
        rc[4]()
        rd[4]()
        fails += check_ll_dispatch(c, me, rc[0], rc[1], rc[2], active, "overrun (c)")
        fails += check_ll_dispatch(d, me, rd[0], rd[1], rd[2], active, "overrun (d)")
        r_e = buf.dispatch(xe, te, active, e.M, e.E, timeout_us=t_us, return_recv_hook=True)
        ctx.wait_all("overrun_sent", [me])
        r_e[4]()
    else:
        ctx.wait_all("overrun_sent", range(R))
        start = time.time()
        try:
            rc[4]()
            fails.append("rank 0's first hook raised nothing")
        except RuntimeError as ex:
            if not re.search(r"rank [1-9][0-9]*'s call two rounds later", str(ex)):
                fails.append(f"rank 0's first hook: {ex}")
        if time.time() - start > 2.0:
            fails.append(f"rank 0's first hook took {time.time() - start:.1f} s")
        rd[4]()
        fails += check_ll_dispatch(d, me, rd[0], rd[1], rd[2], active, "overrun (d)")
        r_e = buf.dispatch(xe, te, active, e.M, e.E, timeout_us=t_us)
    fails += check_ll_dispatch(e, me, r_e[0], r_e[1], r_e[2], active, "overrun (e)")
    if active.tolist() != [1] * R:
        fails.append(f"active_ranks changed: {active.tolist()}")
    return fails
