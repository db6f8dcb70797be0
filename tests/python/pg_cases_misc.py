"""Point-to-point, subgroup, async, object, layout, error and failure cases (run inside the
workers of a harness.Pool; see pg_cases.py for the conventions)."""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pg_cases import OPS, check, dtype, make


def case_p2p(ctx, sizes=(0, 1, 7, 1000), dtypes=("float32", "int64", "bfloat16", "bool")):
    fails, W, me = [], ctx.world, ctx.rank
    if W == 1:
        return fails
    nxt, prv = (me + 1) % W, (me - 1) % W
    for dt in dtypes:
        for n in sizes:
            # Every rank posts its receive before its send: p2p must not run in one queue.
            out = torch.empty(n, dtype=dtype(dt))
            rq = dist.irecv(out, prv, tag=5)
            sq = dist.isend(make(dt, n, me, 70), nxt, tag=5)
            sq.wait()
            rq.wait()
            check(fails, f"ring isend/irecv {dt} n={n}", out, make(dt, n, prv, 70))
            # Blocking pairs, even ranks send first.
            out2 = torch.empty(n, dtype=dtype(dt))
            if me % 2 == 0:
                dist.send(make(dt, n, me, 71), nxt)
                dist.recv(out2, prv)
            else:
                dist.recv(out2, prv)
                dist.send(make(dt, n, me, 71), nxt)
            check(fails, f"ring send/recv {dt} n={n}", out2, make(dt, n, prv, 71))
    # Tags select messages: sent in tag order 1, 2; received 2 then 1.
    if me == 0:
        a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
        w1, w2 = dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)
        w1.wait()
        w2.wait()
    elif me == 1:
        x, y = torch.empty(4), torch.empty(4)
        dist.recv(y, 0, tag=2)
        dist.recv(x, 0, tag=1)
        check(fails, "tag matching tag=1", x, torch.full((4,), 1.0))
        check(fails, "tag matching tag=2", y, torch.full((4,), 2.0))
    # Same peer and tag: messages arrive in issue order.
    if me == 0:
        ws = [dist.isend(torch.full((1000,), float(i)), 1, tag=9) for i in range(5)]
        for w in ws:
            w.wait()
    elif me == 1:
        outs = [torch.empty(1000) for _ in range(5)]
        ws = [dist.irecv(o, 0, tag=9) for o in outs]
        for i, (w, o) in enumerate(zip(ws, outs)):
            w.wait()
            check(fails, f"non-overtaking message {i}", o, torch.full((1000,), float(i)))
    # Same peer and tag, large and small alternating: still issue order (between hosts over
    # rdma the large ones travel one-sidedly into receive slots, the small ones two-sided).
    lens = [100000, 1, 100000, 1, 100000]
    if me == 0:
        ws = [dist.isend(torch.full((n,), float(i)), 1, tag=10) for i, n in enumerate(lens)]
        for w in ws:
            w.wait()
    elif me == 1:
        outs = [torch.empty(n) for n in lens]
        ws = [dist.irecv(o, 0, tag=10) for o in outs]
        for i, (w, o) in enumerate(zip(ws, outs)):
            w.wait()
            check(fails, f"non-overtaking mixed-size message {i}", o,
                  torch.full((lens[i],), float(i)))
    # Receive from any source (own tag: an any-source receive matches any sender's message
    # with its tag, so the later sections must not use it).
    if me == 0:
        got = {}
        for _ in range(W - 1):
            t = torch.empty(3, dtype=torch.int64)
            src = dist.recv(t, tag=11)
            got[src] = t
        if sorted(got) != list(range(1, W)):
            fails.append(f"recv(src=None) sources {sorted(got)}")
        for s, t in got.items():
            check(fails, f"recv(src=None) from {s}", t, torch.full((3,), s, dtype=torch.int64))
    else:
        dist.send(torch.full((3,), me, dtype=torch.int64), 0, tag=11)
    # batch_isend_irecv, both directions of the ring.
    outs = [torch.empty(100), torch.empty(100)]
    ops = [dist.P2POp(dist.isend, make("float32", 100, me, 80), nxt),
           dist.P2POp(dist.isend, make("float32", 100, me, 81), prv),
           dist.P2POp(dist.irecv, outs[0], prv),
           dist.P2POp(dist.irecv, outs[1], nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check(fails, "batch_isend_irecv from prev", outs[0], make("float32", 100, prv, 80))
    check(fails, "batch_isend_irecv from next", outs[1], make("float32", 100, nxt, 81))
    # Receive into a strided view.
    m = torch.zeros(10, 3)
    if me == 0:
        dist.send(torch.arange(10, dtype=torch.float32), 1, tag=3)
    elif me == 1:
        dist.recv(m[:, 1], 0, tag=3)
        want = torch.zeros(10, 3)
        want[:, 1] = torch.arange(10, dtype=torch.float32)
        check(fails, "recv into a strided view", m, want)
    dist.barrier()
    return fails


def case_p2p_self(ctx, rounds=20):
    """irecv from oneself, then isend to oneself (allowed by torch): two lanes of this
    process, where the receive blocks until the send runs. Each round starts right after the
    lane threads of the previous one went idle, the state in which the second post used to
    find no thread (it waited for the receive's timeout). Waits are bounded, so a
    regression fails in seconds instead of hanging."""
    fails, me = [], ctx.rank
    limit = timedelta(seconds=20)
    for i in range(rounds):
        # One lane thread, idle: a send to oneself completes without a receiver.
        dist.isend(torch.full((2,), float(i)), dst=me, tag=29).wait(timeout=limit)
        time.sleep(0.01)
        mine = torch.empty(10)
        rq = dist.irecv(mine, src=me, tag=30 + i)
        sq = dist.isend(make("float32", 10, me, 140 + i), dst=me, tag=30 + i)
        try:
            sq.wait(timeout=limit)
            rq.wait(timeout=limit)
        except RuntimeError as e:
            fails.append(f"round {i}: self isend/irecv did not complete: {e}")
            break
        check(fails, f"round {i}: isend/irecv to self", mine, make("float32", 10, me, 140 + i))
        first = torch.empty(2)
        dist.irecv(first, src=me, tag=29).wait(timeout=limit)
        check(fails, f"round {i}: the earlier send to self", first, torch.full((2,), float(i)))
    dist.barrier()
    return fails


def case_subgroups(ctx):
    fails, W, me = [], ctx.world, ctx.rank
    if W < 3:
        return fails
    g02 = dist.new_group([0, 2], backend="mooncake")
    g13 = dist.new_group([1, 3], backend="mooncake") if W >= 4 else None
    g_all = dist.new_group(list(range(W)), backend="mooncake-cpu")
    members = [0, 2] if me in (0, 2) else ([1, 3] if (g13 is not None and me in (1, 3)) else None)
    if members is not None:
        g = g02 if me in (0, 2) else g13
        if dist.get_backend(g) != "mooncake":
            fails.append(f"get_backend(subgroup) = {dist.get_backend(g)}")
        for n in (0, 7, 1000, 100_003):
            t = make("float32", n, me, 90)
            dist.all_reduce(t, group=g)
            want = make("float32", n, members[0], 90) + make("float32", n, members[1], 90)
            check(fails, f"subgroup {members} all_reduce n={n}", t, want, "float32", True)
            b = make("int32", n, me, 91)
            dist.broadcast(b, src=members[1], group=g)
            check(fails, f"subgroup {members} broadcast src={members[1]} n={n}", b,
                  make("int32", n, members[1], 91))
            outs = [torch.empty(n, dtype=torch.int64) for _ in range(2)]
            dist.all_gather(outs, make("int64", n, me, 92), group=g)
            for i, r in enumerate(members):
                check(fails, f"subgroup {members} all_gather n={n} [{i}]", outs[i],
                      make("int64", n, r, 92))
        x = torch.empty(5)
        if me == members[0]:
            dist.send(torch.full((5,), 7.0), dst=members[1], group=g)
        else:
            dist.recv(x, src=members[0], group=g)
            check(fails, f"subgroup {members} send/recv", x, torch.full((5,), 7.0))
    # The default group and a second full-world group keep working in between.
    t = torch.ones(10)
    dist.all_reduce(t)
    check(fails, "world all_reduce after subgroup ops", t, torch.full((10,), float(W)))
    t = torch.ones(10)
    dist.all_reduce(t, group=g_all)
    check(fails, "alias-backend world group all_reduce", t, torch.full((10,), float(W)))
    return fails


def case_async(ctx, count=8):
    fails, W, me = [], ctx.world, ctx.rank
    ts = [make("float32", 1000 * (i + 1), me, 100 + i) for i in range(count)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    big = make("float32", 1 << 18, me, 120)
    wb = dist.all_reduce(big, async_op=True)
    outs = [torch.empty(77, dtype=torch.int16) for _ in range(W)]
    wg = dist.all_gather(outs, make("int16", 77, me, 121), async_op=True)
    doubled = works[0].get_future().then(lambda f: f.value()[0] * 2)
    for w in works + [wb, wg]:
        w.wait()
        if not (w.is_completed() and w.is_success()):
            fails.append("work not completed/successful after wait()")
    for i, t in enumerate(ts):
        want = sum(make("float32", 1000 * (i + 1), r, 100 + i).double() for r in range(W)).float()
        check(fails, f"async all_reduce #{i}", t, want, "float32", True)
    want = sum(make("float32", 1 << 18, r, 120).double() for r in range(W)).float()
    check(fails, "async big all_reduce", big, want, "float32", True)
    for r in range(W):
        check(fails, f"async all_gather [{r}]", outs[r], make("int16", 77, r, 121))
    res = works[1].get_future().wait()
    if not isinstance(res, list) or not torch.equal(res[0], ts[1]):
        fails.append(f"future value {type(res)} is not the output tensor list")
    check(fails, "future.then", doubled.wait(), ts[0] * 2)
    if not works[2].wait(timeout=timedelta(seconds=5)):
        fails.append("wait(timeout) on a finished work returned False")
    return fails


def case_callbacks(ctx, bound_s=20.0):
    """Future callbacks that issue ops of the same group and wait on them (DDP's PowerSGD hook
    does): they run once the op that completes them no longer holds the group's queue or its
    p2p lane. Before, they waited forever (the group's timeout never started: the inner op was
    never run). Each step is bounded by a watchdog thread; results against plain math, and
    PowerSGD DDP against the same training on the gloo group."""
    import threading
    fails, W, me = [], ctx.world, ctx.rank

    def bounded(desc, fn):
        out, err = [], []

        def run():
            try:
                out.append(fn())
            except Exception as e:  # noqa: BLE001 (reported as a failure)
                err.append(e)
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(bound_s)
        if th.is_alive():
            fails.append(f"{desc}: still waiting after {bound_s} s (a callback deadlock)")
            return None
        if err:
            fails.append(f"{desc}: raised {err[0]!r}")
            return None
        return out[0]

    # 1. A synchronous all_reduce inside a then() callback; 2. an async one waited through its
    # future (PowerSGD's pattern); 3. the same behind ops queued asynchronously (the worker
    # runs them, and so the callback).
    def sync_inside():
        t = make("float32", 100, me, 200)
        w = dist.all_reduce(t, async_op=True)

        def cb(f):
            x = make("float32", 10, me, 201)
            dist.all_reduce(x)
            return x
        return t, w.get_future().then(cb).wait()

    got = bounded("all_reduce in a then() callback", sync_inside)
    if got is not None:
        check(fails, "outer all_reduce", got[0],
              sum(make("float32", 100, r, 200).double() for r in range(W)).float(), "float32", True)
        check(fails, "callback's all_reduce", got[1],
              sum(make("float32", 10, r, 201).double() for r in range(W)).float(), "float32", True)

    def async_inside_behind_others():
        ts = [make("float32", 5000, me, 210 + i) for i in range(4)]
        ws = [dist.all_reduce(t, async_op=True) for t in ts]

        def cb(f):
            x = make("float32", 10, me, 220)
            return dist.all_reduce(x, async_op=True).get_future().wait()[0]
        fut = ws[0].get_future().then(cb)
        for w in ws:
            w.wait()
        return ts, fut.wait()

    got = bounded("async all_reduce waited inside a callback, ops queued behind",
                  async_inside_behind_others)
    if got is not None:
        for i, t in enumerate(got[0]):
            check(fails, f"queued all_reduce #{i}", t,
                  sum(make("float32", 5000, r, 210 + i).double() for r in range(W)).float(),
                  "float32", True)
        check(fails, "callback's async all_reduce", got[1],
              sum(make("float32", 10, r, 220).double() for r in range(W)).float(), "float32", True)

    # 4. A recv issued from a recv's callback (the same p2p lane).
    if W >= 2 and me in (0, 1):
        def recv_in_callback():
            if me == 0:
                for i in range(2):
                    dist.send(torch.full((8,), float(i + 1)), 1, tag=7)
                return None
            a, b = torch.empty(8), torch.empty(8)

            def cb(f):
                dist.recv(b, 0, tag=7)
                return b
            return a, dist.irecv(a, 0, tag=7).get_future().then(cb).wait()

        got = bounded("recv in a recv's callback", recv_in_callback)
        if me == 1 and got is not None:
            check(fails, "first message", got[0], torch.full((8,), 1.0))
            check(fails, "second message, received in the callback", got[1],
                  torch.full((8,), 2.0))

    # 5. DDP with the stock PowerSGD hook against the same on gloo.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8))
        ddp = DDP(model, process_group=group)
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + me)
        for _ in range(5):
            opt.zero_grad()
            ddp(torch.randn(16, 32, generator=gen)).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ours = bounded("DDP with powerSGD_hook", lambda: train(None))
    ref = train(ctx.gloo)
    if ours is not None:
        for i, (a, b) in enumerate(zip(ours, ref)):
            check(fails, f"PowerSGD DDP parameter {i} vs gloo", a, b, "float32", True)

    # 6. A callback that waits (Work.wait) on a Work issued before it, outside the callbacks:
    # that Work's completion is queued behind the callback's own, and runs in its wait.
    def wait_on_earlier():
        a, b = make("float32", 50, me, 230), make("float32", 50, me, 231)
        wa = dist.all_reduce(a, async_op=True)
        wb = dist.all_reduce(b, async_op=True)
        wb.get_future()  # (a future: its completion goes through the completion thread)

        def cb(f):
            wb.wait()
            return b
        return wa.get_future().then(cb).wait()

    got = bounded("a callback waiting on an earlier Work", wait_on_earlier)
    if got is not None:
        check(fails, "the earlier Work's all_reduce", got,
              sum(make("float32", 50, r, 231).double() for r in range(W)).float(), "float32", True)

    # 7. Dropping a group waits for its Works' callbacks (they need the GIL: released meanwhile).
    g = dist.new_group(list(range(W)), backend="mooncake")
    ran = []

    def slow(f):
        time.sleep(0.2)
        ran.append(1)
        return f.value()
    ws = [dist.all_reduce(torch.ones(4), group=g, async_op=True) for _ in range(3)]
    for w in ws:
        w.get_future().then(slow)
    def drop():
        nonlocal g
        dist.destroy_process_group(g)
        g = None  # the last reference: the backend goes here
        import gc
        gc.collect()
    bounded("destroying a group with callbacks pending", drop)
    if len(ran) != 3 or not all(w.is_completed() for w in ws):
        fails.append(f"destroy_process_group returned with {3 - len(ran)} callbacks still to run")
    return fails


def case_profile(ctx, calls=3):
    """The group's phase timers through mooncake._C._pg_profile (pg/profile.h): off, nothing is
    counted; on, each all_reduce counts as one op, with some time; reset zeroes them."""
    from mooncake import _C
    fails = []
    t = torch.ones(1000)
    _C._pg_profile(False, True)
    dist.all_reduce(t)
    if _C._pg_profile()["op"] != (0, 0):
        fails.append(f"counted while off: {_C._pg_profile()}")
    _C._pg_profile(True, True)
    for _ in range(calls):
        dist.all_reduce(t)
    got = _C._pg_profile(False, True)
    n, ns = got["op"]
    if n != calls or ns <= 0:
        fails.append(f"{calls} all_reduces counted as {n} ops taking {ns} ns: {got}")
    waits = sum(v[1] for k, v in got.items() if k != "op")
    if waits > ns:
        fails.append(f"the phases inside the ops ({waits} ns) exceed the ops ({ns} ns): {got}")
    if _C._pg_profile()["op"] != (0, 0):
        fails.append("reset did not zero the counters")
    return fails


def case_handoff(ctx, bound_s=5.0):
    """Collectives that no thread waits on still run (op_queue.h: a wait runs its op on the
    waiting thread; the others go to the worker): an op only polled with is_completed(), one
    followed through a future callback, and an op that a peer needs before this rank waits,
    because this rank first blocks in another group's collective (with ops run only by their
    waiters this deadlocks)."""
    import threading

    fails, W, me = [], ctx.world, ctx.rank
    other = dist.new_group(list(range(W)), backend="mooncake")
    for rnd in range(3):
        # 1. polled, never waited on
        t = make("float32", 1000, me, 130 + rnd)
        w = dist.all_reduce(t, async_op=True)
        end = time.monotonic() + bound_s
        while not w.is_completed() and time.monotonic() < end:
            time.sleep(0.0005)
        if not w.is_completed():
            fails.append(f"round {rnd}: an async all_reduce nobody waits on did not complete "
                         f"within {bound_s} s")
            return fails
        want = sum(make("float32", 1000, r, 130 + rnd).double() for r in range(W)).float()
        check(fails, f"round {rnd}: polled all_reduce", t, want, "float32", True)
        # 2. completion seen only through a callback
        done = threading.Event()
        outs = [torch.empty(33, dtype=torch.int32) for _ in range(W)]
        dist.all_gather(outs, make("int32", 33, me, 140 + rnd),
                        async_op=True).get_future().add_done_callback(lambda f: done.set())
        if not done.wait(bound_s):
            fails.append(f"round {rnd}: a future callback did not run within {bound_s} s")
            return fails
        for r in range(W):
            check(fails, f"round {rnd}: callback all_gather [{r}]", outs[r],
                  make("int32", 33, r, 140 + rnd))
        # 3. rank 0 blocks in the other group before it waits; its peers need its op first
        x, y = make("float32", 64, me, 150 + rnd), make("float32", 64, me, 160 + rnd)
        t0 = time.monotonic()
        if me == 0:
            wx = dist.all_reduce(x, async_op=True)
            dist.all_reduce(y, group=other)
            wx.wait()
        else:
            dist.all_reduce(x)
            dist.all_reduce(y, group=other)
        if time.monotonic() - t0 > bound_s:
            fails.append(f"round {rnd}: cross-group dependency took {time.monotonic() - t0:.1f} s")
        for name, v, seed in (("x", x, 150 + rnd), ("y", y, 160 + rnd)):
            want = sum(make("float32", 64, r, seed).double() for r in range(W)).float()
            check(fails, f"round {rnd}: cross-group all_reduce {name}", v, want, "float32", True)
    return fails


def case_objects(ctx):
    fails, W, me = [], ctx.world, ctx.rank
    objs = [None] * W
    dist.all_gather_object(objs, {"rank": me, "data": list(range(me * 3))})
    if objs != [{"rank": r, "data": list(range(r * 3))} for r in range(W)]:
        fails.append(f"all_gather_object: {objs}")
    lst = [f"root {W - 1}", {"k": (1, 2)}, 3.5] if me == W - 1 else [None, None, None]
    dist.broadcast_object_list(lst, src=W - 1)
    if lst != [f"root {W - 1}", {"k": (1, 2)}, 3.5]:
        fails.append(f"broadcast_object_list: {lst}")
    gathered = [None] * W if me == 0 else None
    dist.gather_object(("g", me), gathered, dst=0)
    if me == 0 and gathered != [("g", r) for r in range(W)]:
        fails.append(f"gather_object: {gathered}")
    out = [None]
    dist.scatter_object_list(out, [f"s{r}" for r in range(W)] if me == 0 else None, src=0)
    if out != [f"s{me}"]:
        fails.append(f"scatter_object_list: {out}")
    return fails


def case_layouts(ctx):
    """Non-contiguous, transposed and conjugated tensors (staged and copied back)."""
    fails, W, me = [], ctx.world, ctx.rank
    base = make("float32", 40, me, 130).view(5, 8)
    keep = base[:, 1::2].clone()
    dist.all_reduce(base[:, ::2])
    want = sum(make("float32", 40, r, 130).view(5, 8)[:, ::2].double() for r in range(W)).float()
    check(fails, "all_reduce strided view", base[:, ::2].contiguous(), want, "float32", True)
    check(fails, "all_reduce strided view leaves the rest", base[:, 1::2].contiguous(), keep)
    m = make("int64", 24, me, 131).view(4, 6).t()
    dist.broadcast(m, 0)
    check(fails, "broadcast transposed", m.contiguous(), make("int64", 24, 0, 131).view(4, 6).t().contiguous())
    cols = torch.zeros(7, W, dtype=torch.int32)
    dist.all_gather([cols[:, r] for r in range(W)], make("int32", 7, me, 132))
    for r in range(W):
        check(fails, f"all_gather into column {r}", cols[:, r].contiguous(), make("int32", 7, r, 132))
    # (No conjugate views: torch 1.13's dispatcher resolves them into a temporary and copies
    # back when the call returns, before an async backend has finished: torch-side, gloo too.)
    out = torch.zeros(2 * W, 3).t()  # (3, 2W) non-contiguous
    inp = make("float32", 6 * W, me, 134).view(3, 2 * W).t().contiguous().t()
    dist.all_to_all_single(out.t(), inp.t().contiguous())
    exp = torch.cat([make("float32", 6 * W, s, 134).view(3, 2 * W).t()[2 * me:2 * me + 2]
                     for s in range(W)])
    check(fails, "all_to_all_single into transposed output", out.t().contiguous(), exp)
    # A root whose tensor cannot be written (expand(): one element seen 4 times): its data is
    # not copied back (it did not change), so its broadcast works (it used to fail after the
    # fact, as gloo does not); receivers pass ordinary tensors.
    root = W - 1
    t = (torch.tensor([float(me + 1)]).expand(4) if me == root
         else torch.zeros(4))
    dist.broadcast(t, root)
    check(fails, "broadcast from an expand()ed root tensor", t.contiguous(),
          torch.full((4,), float(root + 1)))
    return fails


def case_errors(ctx):
    """Wrong use raises ValueError naming mooncake and the op; the group stays usable."""
    fails, W = [], ctx.world

    def expect(desc, fn, words):
        try:
            fn()
        except ValueError as e:
            msg = str(e)
            miss = [w for w in words if w.lower() not in msg.lower()]
            if miss:
                fails.append(f"{desc}: message lacks {miss}: {msg}")
            return
        except Exception as e:  # noqa: BLE001
            fails.append(f"{desc}: raised {type(e).__name__} instead of ValueError: {e}")
            return
        fails.append(f"{desc}: did not raise")

    expect("float BAND", lambda: dist.all_reduce(torch.ones(3), op=OPS["BAND"]),
           ["mooncake", "allreduce", "BAND"])
    expect("complex MAX", lambda: dist.reduce(torch.ones(3, dtype=torch.complex64), 0,
                                              op=OPS["MAX"]), ["mooncake", "reduce", "MAX"])
    expect("all_gather_into_tensor dtype mismatch",
           lambda: dist.all_gather_into_tensor(torch.empty(W * 3, dtype=torch.int32),
                                               torch.ones(3)),
           ["mooncake", "_allgather_base", "dtype"])
    expect("all_gather_into_tensor size",
           lambda: dist.all_gather_into_tensor(torch.empty(W * 3 + 1), torch.ones(3)),
           ["mooncake", "_allgather_base", "elements"])
    expect("all_to_all_single bad splits",
           lambda: dist.all_to_all_single(torch.empty(W), torch.ones(W), [1] * W, [2] * W),
           ["mooncake", "alltoall_base", "splits"])
    expect("broadcast root out of range", lambda: dist.broadcast(torch.ones(2), W),
           ["mooncake", "broadcast", "root"])
    expect("reduce_scatter list length",
           lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2)] * (W + 1)),
           ["mooncake", "reduce_scatter"])
    t = torch.ones(4)
    dist.all_reduce(t)
    check(fails, "all_reduce after errors", t, torch.full((4,), float(W)))
    return fails


# ---- failure cases: run on a pool that is thrown away afterwards ------------------------

def case_die(ctx, victim, at, mode="exit", phase="between", nbytes=4 << 20):
    """`victim` dies at wall-clock time `at`; the others report when and how they failed.

    phase "between": the others start an op only after the death; "during": they loop
    ops from the start, so they are inside one when the victim dies."""
    me = ctx.rank
    n = nbytes // 4
    if me == victim:
        if phase == "during":
            t = torch.ones(n)
            while time.time() < at:
                dist.all_reduce(t)
        else:
            time.sleep(max(0.0, at - time.time()))
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(17)
    t = torch.ones(n)
    if phase == "between":
        time.sleep(max(0.0, at + 0.5 - time.time()))
    t0 = time.time()
    try:
        for _ in range(100000):
            dist.all_reduce(t)
            if time.time() > at + 60:
                break
    except RuntimeError as e:
        now = time.time()
        res = {"raised": True, "msg": str(e), "type": type(e).__name__,
               "since_death": now - at, "since_call": now - t0}
    else:
        return {"raised": False}
    # Later ops fail too; torch >= 2.5's get_future_result reports it without raising.
    try:
        w = dist.all_reduce(torch.ones(4), async_op=True)
    except RuntimeError as e:  # refused at once: the group knows a member is dead
        res["later_op"] = type(e).__name__
        return res
    if hasattr(w, "get_future_result"):
        res["future_result"] = int(w.get_future_result().wait())
    try:
        w.wait()
        res["later_op"] = "succeeded"
    except RuntimeError as e:
        res["later_op"] = type(e).__name__
    return res


def case_timeout(ctx, absent):
    """Rank `absent` never joins the op; the others must get a timeout, not a hang."""
    if ctx.rank == absent:
        return {"absent": True}
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(10))
    except RuntimeError as e:
        return {"raised": True, "msg": str(e), "type": type(e).__name__,
                "elapsed": time.time() - t0}
    return {"raised": False, "elapsed": time.time() - t0}


def case_split_mismatch(ctx):
    """Ranks disagree on all_to_all_single splits (detectable): everyone raises."""
    W, me = ctx.world, ctx.rank
    in_splits = [1] * W
    out_splits = [2 if (s == 0 and me == 1) else 1 for s in range(W)]
    out = torch.empty(sum(out_splits))
    try:
        dist.all_to_all_single(out, torch.ones(W), out_splits, in_splits)
    except (RuntimeError, ValueError) as e:
        return {"raised": True, "type": type(e).__name__, "msg": str(e)}
    return {"raised": False}


def case_sig_mismatch(ctx, what):
    """The ranks disagree on a collective's dtype, root, reduce op or order (one call each,
    all arguments valid on their own): every rank must raise, naming itself, the op, the
    mismatch and the other rank, well within the group timeout (gloo hangs or aborts here)."""
    me = ctx.rank
    t = torch.full((4,), float(me + 1))
    t0 = time.time()
    try:
        if what == "dtype":  # same bytes: float32 vs int32
            dist.all_reduce(t if me == 0 else t.int())
        elif what == "op":
            dist.all_reduce(t, op=OPS["SUM"] if me == 0 else OPS["MAX"])
        elif what == "root":
            dist.broadcast(t, me)
        elif what.endswith("_dtype"):  # a copy op, same bytes: float32 vs int32
            x = t if me == 0 else t.int()
            ws = 2
            if what == "broadcast_dtype":
                dist.broadcast(x, 0)
            elif what == "allgather_dtype":
                dist.all_gather([torch.empty_like(x) for _ in range(ws)], x)
            elif what == "gather_dtype":
                dist.gather(x, [torch.empty_like(x) for _ in range(ws)] if me == 0 else None, 0)
            elif what == "scatter_dtype":
                dist.scatter(x, [x.clone() for _ in range(ws)] if me == 0 else None, 0)
            elif what == "alltoall_dtype":
                dist.all_to_all_single(torch.empty_like(x), x)
            else:
                raise ValueError(what)
        elif what == "order":
            if me == 0:
                dist.all_reduce(t)
                dist.broadcast(t, 0)
            else:
                dist.broadcast(t, 0)
                dist.all_reduce(t)
        else:
            raise ValueError(what)
    except RuntimeError as e:
        return {"raised": True, "msg": str(e), "elapsed": time.time() - t0}
    return {"raised": False, "elapsed": time.time() - t0, "result": t.tolist()}
