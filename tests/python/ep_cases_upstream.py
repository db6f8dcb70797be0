"""EP test case of Mooncake EP's own module path (mooncake.mooncake_ep_buffer), run inside every
rank by _ep_worker.py as the cases of ep_cases.py are (the same inputs and reference)."""

import weakref

import torch

from ep_cases import Cfg, check_ll_combine, check_ll_dispatch, ll_y


def case_upstream_api(ctx):
    """Mooncake EP's own module path and keywords: mooncake.mooncake_ep_buffer.Buffer(group,
    bytes, disable_p2p=True) (every peer through engine WRITEs), timeout_us=-1 (no timeout)
    given positionally, EventOverlap.current_stream_wait(), combine(zero_copy=...)."""
    import torch.distributed as dist
    from mooncake.mooncake_ep_buffer import Buffer as UpBuffer, EventOverlap

    R, me = ctx.world, ctx.rank
    fails = []
    cfg = Cfg(R, seed=61)
    nbytes = UpBuffer.get_ep_buffer_size_hint(cfg.M, cfg.H, R, cfg.E)
    # (Its default place is the current CUDA device where torch and this build have CUDA; these
    # are CPU tensors.)
    where = {"device": "cpu"} if torch.cuda.is_available() else {}
    buf = UpBuffer(dist.group.WORLD, nbytes, disable_p2p=True, **where)
    if buf.group_size != R or buf.rank != me:
        fails.append(f"group_size/rank {buf.group_size}/{buf.rank}")
    mapped = [r for r in range(R) if r != me and buf.runtime.is_mapped(r)]
    if mapped:
        fails.append(f"disable_p2p=True still maps ranks {mapped}")
    active = torch.ones(R, dtype=torch.int32)
    x, topk, w = cfg.inputs(me)
    recv_x, cnt, handle, ev, hook = buf.dispatch(x, topk, active, cfg.M, cfg.E, -1,
                                                 async_finish=True)
    if not isinstance(ev, EventOverlap) or ev.event is None or hook is not None:
        fails.append(f"async dispatch returned {type(ev).__name__} event={ev.event}, hook={hook}")
    ev.current_stream_wait()
    fails += check_ll_dispatch(cfg, me, recv_x, cnt, handle, active, "upstream-dispatch")
    y = ll_y(cfg, me, recv_x, cnt)
    try:
        buf.combine(y, topk, w, active, -1, handle, zero_copy=True)
        fails.append("combine(zero_copy=True) was accepted")
    except NotImplementedError:
        pass
    out, ev, hook = buf.combine(y, topk, w, active, -1, handle, False, False, True)
    if hook is None:
        return fails + ["combine(return_recv_hook=True) returned no hook"]
    hook()
    with ev:  # EventOverlap is a context manager (a no-op wait here: the call finished)
        pass
    fails += check_ll_combine(cfg, me, out, active, "upstream-combine")
    try:
        buf.dispatch(x, topk, active, cfg.M, cfg.E, -2)
        fails.append("timeout_us=-2 was accepted")
    except ValueError:
        pass
    # A mask of the wrong length or type is refused (it used to be replaced by all ranks), on
    # the last rank only: its peers' calls end naming it, and the next round is in step.
    bad = active[:-1] if R > 1 else [1]
    try:
        if me == R - 1:
            buf.dispatch(x, topk, bad, cfg.M, cfg.E, -1)
            fails.append("an active_ranks of the wrong length was accepted")
        else:
            buf.dispatch(x, topk, active, cfg.M, cfg.E, -1)
            fails.append(f"rank {me}: the round rank {R - 1} gave up went on")
    except ValueError as e:
        if me != R - 1 or "active_ranks" not in str(e):
            fails.append(f"rank {me}: {e}")
    except RuntimeError as e:
        if me == R - 1 or f"rank {R - 1}" not in str(e):
            fails.append(f"rank {me}: {e}")
    r1 = buf.dispatch(x, topk, active, cfg.M, cfg.E, -1)
    fails += check_ll_dispatch(cfg, me, r1[0], r1[1], r1[2], active, "dispatch after a bad mask")
    buf.combine(ll_y(cfg, me, r1[0], r1[1]), topk, w, active, -1, r1[2])
    # The same buffer class without disable_p2p maps same-host peers; results agree.
    mbuf = UpBuffer(dist.group.WORLD, nbytes, **where)
    r2 = mbuf.dispatch(x, topk, active, cfg.M, cfg.E, -1)
    fails += check_ll_dispatch(cfg, me, r2[0], r2[1], r2[2], active, "mapped-dispatch")
    o2, _, _ = mbuf.combine(ll_y(cfg, me, r2[0], r2[1]), topk, w, active, -1, r2[2])
    if not torch.equal(o2, out):
        fails.append("disable_p2p=True and False combine differently")
    # update_ep_member (collective; here without a membership change, as upstream's own test
    # calls it) connects the buffer anew: the same size and disable_p2p, rounds from the start.
    ev = hook = r2 = None  # (a hook keeps its buffer: this one's would keep the old one)
    old = weakref.ref(buf.runtime._impl)
    shm_before = _shm_mappings()
    buf.update_ep_member()
    if old() is not None:
        fails.append("update_ep_member kept the native buffer")
    if (buf.group_size, buf.rank, buf.num_ep_buffer_bytes) != (R, me, mbuf.num_ep_buffer_bytes):
        fails.append(f"after update_ep_member: {buf.group_size}/{buf.rank}/"
                     f"{buf.num_ep_buffer_bytes}")
    if any(buf.runtime.is_mapped(r) for r in range(R) if r != me):
        fails.append("update_ep_member dropped disable_p2p")
    mbuf.connect()
    for tag, b in (("updated", buf), ("connected", mbuf)):
        r3 = b.dispatch(x, topk, active, cfg.M, cfg.E, -1)
        fails += check_ll_dispatch(cfg, me, r3[0], r3[1], r3[2], active, tag + "-dispatch")
        o3, _, _ = b.combine(ll_y(cfg, me, r3[0], r3[1]), topk, w, active, -1, r3[2])
        if not torch.equal(o3, out):
            fails.append(f"{tag}: combine differs from before")
    # The old buffers' mappings of their peers went: the mapped ones with the buffer
    # (~EpBuffer releases them), those disable_p2p's WRITEs made with the old regions (the new
    # set-up's descriptors no longer list them); the rounds above mapped the new ones. So
    # reconnecting does not pile them up.
    if _shm_mappings() > shm_before:
        fails.append(f"update/connect left old mappings: /dev/shm mappings {shm_before} -> "
                     f"{_shm_mappings()}")
    if not fails and int(active.sum()) != R:
        fails.append(f"active_ranks changed: {active.tolist()}")
    return fails


def _shm_mappings():
    """How many mappings of /dev/shm files this process has."""
    with open("/proc/self/maps") as f:
        return sum(" /dev/shm/" in line for line in f)
