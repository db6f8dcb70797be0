"""Cases for the torch 2.x forms of the c10d API (run inside the workers of a harness.Pool;
see pg_cases.py for the conventions): registration per device, point-to-point addressed by
group rank, coalescing, functional collectives, Work and future behaviour, object
collectives in subgroups, subgroup helpers and monitored_barrier. A case whose API this
torch lacks returns {"skip": reason}; the test turns that into a skip. Results are checked
against references built from every rank's deterministic inputs (and against gloo where
it has the op)."""

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist

from pg_cases import check, make

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def has_param(fn, name):
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def need(cond, reason):
    return None if cond else {"skip": reason}


def backend_error_type():
    """What a failed op raises: DistBackendError on torch 2.x, RuntimeError on 1.13."""
    return getattr(dist, "DistBackendError", RuntimeError)


# ---------------------------------------------------------------------------------------
def case_registration(ctx):
    """The backend is registered for the devices it serves and is what the group runs."""
    import mooncake

    fails = []
    world = dist.group.WORLD
    if dist.get_backend() != "mooncake":
        fails.append(f"get_backend() = {dist.get_backend()}")
    if TORCH_VERSION < (2, 1):
        if not isinstance(world, mooncake.ProcessGroupMooncake):
            fails.append(f"default group is a {type(world).__name__}")
        return fails
    cap = dist.Backend.backend_capability
    if cap.get("mooncake") != list(mooncake._C.DEVICES) or cap.get("mooncake-cpu") != ["cpu"]:
        fails.append(f"backend_capability: mooncake={cap.get('mooncake')} "
                     f"mooncake-cpu={cap.get('mooncake-cpu')} (_C.DEVICES {mooncake._C.DEVICES})")
    if world._device_types != [torch.device(d) for d in mooncake._C.DEVICES]:
        fails.append(f"default group device types {world._device_types}")
    be = world._get_backend(torch.device("cpu"))
    if not isinstance(be, mooncake.ProcessGroupMooncake):
        fails.append(f"cpu backend of the default group is a {type(be).__name__}")
    if "cuda" not in mooncake._C.DEVICES:
        try:
            world._get_backend(torch.device("cuda"))
            fails.append("the default group has a cuda backend the build does not serve")
        except RuntimeError:
            pass
    # all_gather_into_tensor / reduce_scatter_tensor also take the stacked (W, n) form.
    W, me = ctx.world, ctx.rank
    out = torch.empty(W, 5, dtype=torch.int32)
    dist.all_gather_into_tensor(out, make("int32", 5, me, 300))
    check(fails, "all_gather_into_tensor into (W, n)", out,
          torch.stack([make("int32", 5, r, 300) for r in range(W)]))
    inp = torch.stack([make("float64", 3, me, 301 + i) for i in range(W)])
    red = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(red, inp)
    check(fails, "reduce_scatter_tensor from (W, n)", red,
          sum(make("float64", 3, r, 301 + me) for r in range(W)), "float64", True)
    return fails


def _pair_group(ctx):
    """new_group([1, 2]) on every rank (group ranks 0, 1 = global 1, 2), and this rank's
    group rank in it (None when not a member)."""
    g = dist.new_group([1, 2], backend="mooncake")
    return g, ({1: 0, 2: 1}.get(ctx.rank))


def case_p2p_group_ranks(ctx):
    """send/recv/isend/irecv/batch_isend_irecv addressed by group rank (group_dst,
    group_src, P2POp(group_peer=...)) in a group whose ranks are not the global ones."""
    skip = need(has_param(dist.send, "group_dst"), "send(group_dst=) is torch >= 2.6")
    if skip:
        return skip
    fails = []
    g, gr = _pair_group(ctx)
    if gr is not None:
        peer = 1 - gr
        peer_global = 1 + peer
        # Blocking, group rank 0 sends first.
        out = torch.empty(100, dtype=torch.int64)
        if gr == 0:
            dist.send(make("int64", 100, ctx.rank, 310), group_dst=peer, group=g)
            dist.recv(out, group_src=peer, group=g)
        else:
            dist.recv(out, group_src=peer, group=g)
            dist.send(make("int64", 100, ctx.rank, 310), group_dst=peer, group=g)
        check(fails, "send/recv by group rank", out, make("int64", 100, peer_global, 310))
        # Both post the receive first.
        out = torch.empty(1000)
        rq = dist.irecv(out, group_src=peer, group=g, tag=4)
        sq = dist.isend(make("float32", 1000, ctx.rank, 311), group_dst=peer, group=g, tag=4)
        sq.wait()
        rq.wait()
        check(fails, "isend/irecv by group rank", out, make("float32", 1000, peer_global, 311))
        # Any source: recv returns the sender's global rank.
        t = torch.empty(3)
        if gr == 0:
            src = dist.recv(t, group=g, tag=5)
            if src != peer_global:
                fails.append(f"recv(any source) in the subgroup returned {src}, want {peer_global}")
            check(fails, "recv any source in the subgroup", t, torch.full((3,), 7.0))
        else:
            dist.send(torch.full((3,), 7.0), group_dst=0, group=g, tag=5)
        # batch_isend_irecv with P2POp(group_peer=...).
        outs = [torch.empty(64), torch.empty(64, dtype=torch.bfloat16)]
        ops = [dist.P2POp(dist.irecv, outs[0], group=g, group_peer=peer),
               dist.P2POp(dist.isend, make("float32", 64, ctx.rank, 312), group=g,
                          group_peer=peer),
               dist.P2POp(dist.isend, make("bfloat16", 64, ctx.rank, 313), group=g,
                          group_peer=peer),
               dist.P2POp(dist.irecv, outs[1], group=g, group_peer=peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        check(fails, "batch_isend_irecv by group_peer [0]", outs[0],
              make("float32", 64, peer_global, 312))
        check(fails, "batch_isend_irecv by group_peer [1]", outs[1],
              make("bfloat16", 64, peer_global, 313))
        # isend/irecv to oneself (torch 2.x documents it as allowed).
        mine = torch.empty(10)
        rq = dist.irecv(mine, group_src=gr, group=g, tag=6)
        dist.isend(make("float32", 10, ctx.rank, 314), group_dst=gr, group=g, tag=6).wait()
        rq.wait()
        check(fails, "isend/irecv to self", mine, make("float32", 10, ctx.rank, 314))
    dist.barrier()
    return fails


def case_coalescing(ctx):
    """dist._coalescing_manager: the fast paths (all_reduce, all_gather_into_tensor,
    reduce_scatter_tensor issued as one coalesced op) with and without a device, and
    arbitrary ops between the backend's startCoalescing/endCoalescing (device given)."""
    cm_fn = getattr(dist, "_coalescing_manager", None)
    skip = need(cm_fn is not None and has_param(cm_fn, "device"),
                "_coalescing_manager(group, device, async_ops) is torch >= 2.1")
    if skip:
        return skip
    fails, W, me = [], ctx.world, ctx.rank
    cpu = torch.device("cpu")

    def sums(dt, n, salt):
        return sum(make(dt, n, r, salt).double() for r in range(W)).to(getattr(torch, dt))

    for device in (None, cpu):
        for async_ops in (False, True):
            tag = f"device={device} async={async_ops}"
            ts = [make("float32", n, me, 320 + i) for i, n in enumerate((1, 1000, 33))]
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for t in ts:
                    dist.all_reduce(t)
            if async_ops:
                cm.wait()
            for i, (t, n) in enumerate(zip(ts, (1, 1000, 33))):
                check(fails, f"coalesced all_reduce #{i} {tag}", t, sums("float32", n, 320 + i),
                      "float32", True)
            ins = [make("int64", 7, me, 330), make("int64", 0, me, 331), make("int64", 500, me, 332)]
            outs = [torch.empty(W * x.numel(), dtype=torch.int64) for x in ins]
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            if async_ops:
                cm.wait()
            for k, (o, n) in enumerate(zip(outs, (7, 0, 500))):
                check(fails, f"coalesced all_gather_into_tensor #{k} {tag}", o,
                      torch.cat([make("int64", n, r, 330 + k) for r in range(W)]))
            blocks = [[make("float64", n, r, 340 + k * W + i) for i in range(W)]
                      for k, n in enumerate((3, 1024)) for r in range(W)]
            reds = [torch.empty(n, dtype=torch.float64) for n in (3, 1024)]
            with dist._coalescing_manager(device=device, async_ops=async_ops) as cm:
                for k, red in enumerate(reds):
                    dist.reduce_scatter_tensor(red, torch.cat(blocks[k * W + me]))
            if async_ops:
                cm.wait()
            for k, red in enumerate(reds):
                want = sum(blocks[k * W + r][me] for r in range(W))
                check(fails, f"coalesced reduce_scatter_tensor #{k} {tag}", red, want, "float64",
                      True)
    # Arbitrary ops between start and end: one Work for all of them.
    b = make("int32", 50, me, 350)
    lst = [torch.empty(4, dtype=torch.int16) for _ in range(W)]
    ring = torch.empty(20)
    with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
        dist.broadcast(b, src=W - 1, async_op=True)
        dist.all_gather(lst, make("int16", 4, me, 351), async_op=True)
        if W > 1:
            dist.irecv(ring, src=(me - 1) % W, tag=8)
            dist.isend(make("float32", 20, me, 352), dst=(me + 1) % W, tag=8)
    if len(cm.works) != 1:
        fails.append(f"_coalescing_manager(device=cpu) returned {len(cm.works)} works, want 1")
    cm.wait()
    w = cm.works[0]
    if not (w.is_completed() and w.is_success()):
        fails.append("the coalesced Work is not completed/successful after wait()")
    check(fails, "coalesced broadcast", b, make("int32", 50, W - 1, 350))
    for r in range(W):
        check(fails, f"coalesced all_gather [{r}]", lst[r], make("int16", 4, r, 351))
    if W > 1:
        check(fails, "coalesced isend/irecv", ring, make("float32", 20, (me - 1) % W, 352))
    # Misuse: ending what was never started.
    try:
        dist.group.WORLD._end_coalescing(cpu)
        fails.append("_end_coalescing without _start_coalescing did not raise")
    except (ValueError, RuntimeError) as e:
        if "startCoalescing" not in str(e):
            fails.append(f"_end_coalescing without start: unclear error {e}")
    return fails


def case_functional(ctx):
    """torch.distributed._functional_collectives (what DTensor and torch.compile call): the
    ops go through the dispatcher to the backend by group name."""
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:
        return {"skip": "no torch.distributed._functional_collectives"}
    if not hasattr(fc, "all_gather_into_tensor_coalesced"):
        return {"skip": "functional collectives with coalesced forms are torch >= 2.1"}
    fails, W, me = [], ctx.world, ctx.rank
    g = dist.group.WORLD
    x = make("float32", 1000, me, 360)
    got = fc.all_reduce(x, "sum", g)
    check(fails, "funcol all_reduce", fc.wait_tensor(got),
          sum(make("float32", 1000, r, 360).double() for r in range(W)).float(), "float32", True)
    check(fails, "funcol all_reduce leaves its input", x, make("float32", 1000, me, 360))
    y = make("int64", 6, me, 361).view(2, 3)
    got = fc.wait_tensor(fc.all_gather_tensor(y, 0, g))
    check(fails, "funcol all_gather_tensor", got,
          torch.cat([make("int64", 6, r, 361).view(2, 3) for r in range(W)]))
    z = torch.stack([make("float64", 4, me, 362 + i) for i in range(W)]).view(-1)
    got = fc.wait_tensor(fc.reduce_scatter_tensor(z, "sum", 0, g))
    check(fails, "funcol reduce_scatter_tensor", got,
          sum(make("float64", 4, r, 362 + me) for r in range(W)), "float64", True)
    ins = [make("int32", 3, me, 363), make("int32", 8, me, 364)]
    outs = [fc.wait_tensor(t) for t in fc.all_gather_into_tensor_coalesced(ins, g)]
    for k, n in enumerate((3, 8)):
        check(fails, f"funcol all_gather_into_tensor_coalesced #{k}", outs[k],
              torch.cat([make("int32", n, r, 363 + k) for r in range(W)]))
    splits = [(me + d) % 3 for d in range(W)]  # rows this rank sends to d
    recv_splits = [(s + me) % 3 for s in range(W)]
    inp = torch.cat([torch.full((splits[d], 2), float(100 * me + d)) for d in range(W)])
    got = fc.wait_tensor(fc.all_to_all_single(inp, recv_splits, splits, g))
    want = torch.cat([torch.full((recv_splits[s], 2), float(100 * s + me)) for s in range(W)])
    check(fails, "funcol all_to_all_single with splits", got, want)
    return fails


def case_work(ctx):
    """Work objects as torch 2.x uses them: completion, futures, get_future_result, and a
    timed wait that expires (DistBackendError on 2.x) and then completes."""
    fails, W, me = [], ctx.world, ctx.rank
    t = make("float32", 100, me, 370)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    w.wait()
    # (Not Work.exception(): torch 2.6's binding cannot convert its return type.)
    if not (w.is_completed() and w.is_success()):
        fails.append(f"completed work: is_completed {w.is_completed()} is_success "
                     f"{w.is_success()}")
    val = fut.wait()
    if not isinstance(val, list) or len(val) != 1 or not torch.equal(val[0], t):
        fails.append(f"get_future().wait() = {val!r}")
    if not torch.equal(w.result()[0], t):
        fails.append("result() is not the output")
    if hasattr(w, "get_future_result"):
        r = w.get_future_result().wait()
        if int(r) != 0:
            fails.append(f"get_future_result() of a successful op = {r}, want 0 (SUCCESS)")
        w2 = dist.broadcast(make("int8", 10, me, 371), src=0, async_op=True)
        r2 = w2.get_future_result()  # created before completion
        w2.wait()
        if int(r2.wait()) != 0:
            fails.append(f"get_future_result() created early = {r2.value()}")
    if W < 2:
        return fails
    # A receive nobody has sent yet (ranks 0 and 1): a short timed wait raises, the op goes
    # on, and it completes once the peer sends.
    peer = 1 - me if me < 2 else None
    buf = torch.empty(5)
    rq = dist.irecv(buf, src=peer, tag=77) if peer is not None else None
    dist.barrier(group=ctx.gloo)  # both have posted their receive
    if rq is not None:
        try:
            rq.wait(timeout=timedelta(milliseconds=200))
            fails.append("wait(timeout) on an unmatched recv returned")
        except Exception as e:  # noqa: BLE001
            want = backend_error_type()
            if not isinstance(e, want):
                fails.append(f"wait(timeout) raised {type(e).__name__}, want {want.__name__}: {e}")
            elif "timed out" not in str(e):
                fails.append(f"wait(timeout) error does not say it timed out: {e}")
        if rq.is_completed():
            fails.append("the unmatched recv reports completed")
    dist.barrier(group=ctx.gloo)
    if rq is not None:
        dist.send(torch.full((5,), float(me)), dst=peer, tag=77)
        rq.wait()
        check(fails, "recv completes after a timed-out wait", buf, torch.full((5,), float(peer)))
    dist.barrier()
    return fails


def case_objects_in_subgroup(ctx):
    """Object collectives in a group whose ranks are not the global ones, addressed by
    global rank (every torch) and by group rank (group_dst/group_src, torch >= 2.6)."""
    fails = []
    g, gr = _pair_group(ctx)
    by_group = has_param(dist.broadcast_object_list, "group_src")
    if gr is not None:
        objs = [None, None]
        dist.all_gather_object(objs, {"r": ctx.rank}, group=g)
        if objs != [{"r": 1}, {"r": 2}]:
            fails.append(f"all_gather_object in [1, 2]: {objs}")
        lst = [("from", 2), None] if ctx.rank == 2 else [None, None]
        dist.broadcast_object_list(lst, src=2, group=g)
        if lst != [("from", 2), None]:
            fails.append(f"broadcast_object_list src=2: {lst}")
        if hasattr(dist, "send_object_list"):  # torch >= 2.0
            box = [f"p2p {ctx.rank}"] if ctx.rank == 1 else [None]
            if ctx.rank == 1:
                dist.send_object_list(box, dst=2, group=g)
            else:
                dist.recv_object_list(box, src=1, group=g)
                if box != ["p2p 1"]:
                    fails.append(f"send/recv_object_list: {box}")
        if by_group:
            lst = [{"k": gr}] if gr == 1 else [None]
            dist.broadcast_object_list(lst, group=g, group_src=1)
            if lst != [{"k": 1}]:
                fails.append(f"broadcast_object_list(group_src=1): {lst}")
            gathered = [None, None] if gr == 0 else None
            dist.gather_object(gr * 10, gathered, group=g, group_dst=0)
            if gr == 0 and gathered != [0, 10]:
                fails.append(f"gather_object(group_dst=0): {gathered}")
            out = [None]
            dist.scatter_object_list(out, ["a", "b"] if gr == 1 else None, group=g, group_src=1)
            if out != [["a", "b"][gr]]:
                fails.append(f"scatter_object_list(group_src=1): {out}")
            box = [("g", gr)] if gr == 0 else [None]
            if gr == 0:
                dist.send_object_list(box, group=g, group_dst=1)
            else:
                dist.recv_object_list(box, group=g, group_src=0)
                if box != [("g", 0)]:
                    fails.append(f"send/recv_object_list by group rank: {box}")
    dist.barrier()
    return fails


def case_subgroup_helpers(ctx):
    """new_subgroups and new_subgroups_by_enumeration create mooncake groups (the default
    backend) that run collectives among their members only."""
    fails, W, me = [], ctx.world, ctx.rank
    try:
        cur, _ = dist.new_subgroups(group_size=2)
    except ValueError as e:
        if "CUDA" in str(e) and TORCH_VERSION < (2, 0):
            return {"skip": "torch 1.13 creates subgroups with new_subgroups* only with CUDA"}
        raise
    members = [r for r in range(W) if r // 2 == me // 2]
    if dist.get_backend(cur) != "mooncake":
        fails.append(f"new_subgroups backend {dist.get_backend(cur)}")
    t = make("float32", 257, me, 380)
    dist.all_reduce(t, group=cur)
    check(fails, f"new_subgroups {members} all_reduce", t,
          sum(make("float32", 257, r, 380).double() for r in members).float(), "float32", True)
    pairs = [[0, W - 1], list(range(1, W - 1))] if W > 2 else [[0, W - 1]]
    cur2, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=pairs)
    mine = next((p for p in pairs if me in p), None)
    if mine is not None and cur2 is not None:
        x = make("int64", 9, me, 381)
        dist.all_reduce(x, group=cur2)
        check(fails, f"new_subgroups_by_enumeration {mine} all_reduce", x,
              sum(make("int64", 9, r, 381) for r in mine))
    dist.barrier()
    return fails


def case_monitored_barrier(ctx):
    """mooncake does not claim monitored_barrier (torch implements it for gloo only): the
    call is refused without side effects, and gloo's works on the same ranks."""
    fails = []
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30))
        fails.append("monitored_barrier on the mooncake group did not raise")
    except (ValueError, RuntimeError) as e:
        if "GLOO" not in str(e).upper():
            fails.append(f"monitored_barrier refusal does not name gloo: {e}")
    dist.monitored_barrier(group=ctx.gloo, timeout=timedelta(seconds=30))
    t = torch.ones(3)
    dist.all_reduce(t)
    check(fails, "all_reduce after the refused monitored_barrier", t,
          torch.full((3,), float(ctx.world)))
    return fails
