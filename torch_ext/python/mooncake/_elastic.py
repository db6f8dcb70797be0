"""Elastic groups: Mooncake PG's dynamic membership and fault-tolerance API (docs/elastic.md).

Re-exported by ``mooncake.pg`` with upstream's names and argument orders::

    from mooncake import pg
    dist.init_process_group("mooncake", rank=r, world_size=n,
                            pg_options=pg.MooncakeBackendOptions(8))   # 8 rank slots
    backend = dist.group.WORLD
    pg.get_active_ranks(backend)                  # int32 tensor, one entry per slot
    work = dist.all_reduce(t, async_op=True); work.wait()
    pg.get_local_success(work), pg.get_failed_ranks_hint(work)
    pg.deactivate_ranks(backend, [2]); pg.recover_ranks(backend, [2]); ...

A group created WITHOUT pg_options is not elastic and behaves as before: a failure raises,
naming the dead rank (upstream's default is the auto-sync mode; see docs/elastic.md).
"""

import enum
import sys
import warnings
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist

from . import _C


class ProposalStatus(enum.IntEnum):
    Rejected = 0
    Applied = 1
    AppliedWithDroppedRanks = 2


ViewUpdateStatus = ProposalStatus  # upstream's alias


class SyncAfterFailureStatus(enum.IntEnum):
    Reconciled = 0
    NoPending = 1
    Rejected = 2


@dataclass
class ProposeViewUpdateResponse:
    status: ProposalStatus
    new_epoch: int = 0
    dropped_ranks: List[int] = field(default_factory=list)
    reject_reason: str = ""


@dataclass
class SyncAfterFailureResponse:
    status: SyncAfterFailureStatus
    reject_reason: str = ""


class MooncakeBackendOptions:
    """``pg_options`` of an elastic group (upstream's constructors)::

        MooncakeBackendOptions(max_group_size)
        MooncakeBackendOptions(max_group_size, is_extension)
        MooncakeBackendOptions(max_group_size, is_extension,
                               auto_deactivate_on_failure, auto_sync_on_failure)
        MooncakeBackendOptions(active_ranks)
        MooncakeBackendOptions(active_ranks, is_extension)
        MooncakeBackendOptions(active_ranks, is_extension, max_group_size)

    max_group_size <= 0 means the group's size. active_ranks: an int32 contiguous tensor of at
    least max_group_size entries that the group keeps equal to its active mask (its contents are
    ignored; checked when the group is created). The invalid combination
    (auto_sync_on_failure without auto_deactivate_on_failure) is rejected when the group is
    created, as upstream. buffer_bytes: as mooncake.pg.Options.
    """

    def __init__(self, first=None, is_extension=False, third=None, fourth=None, *,
                 active_ranks=None, max_group_size=None, auto_deactivate_on_failure=None,
                 auto_sync_on_failure=None, buffer_bytes=0):
        self.active_ranks = active_ranks
        self.max_group_size = 0
        self.auto_deactivate_on_failure = True
        self.auto_sync_on_failure = True
        if isinstance(first, torch.Tensor):
            self.active_ranks = first
            if third is not None:
                self.max_group_size = int(third)
            if fourth is not None:
                raise TypeError("MooncakeBackendOptions(active_ranks, is_extension, "
                                "max_group_size) takes no fourth argument")
        else:
            if first is not None:
                self.max_group_size = int(first)
            if third is not None:
                self.auto_deactivate_on_failure = bool(third)
            if fourth is not None:
                self.auto_sync_on_failure = bool(fourth)
        if max_group_size is not None:
            self.max_group_size = int(max_group_size)
        if auto_deactivate_on_failure is not None:
            self.auto_deactivate_on_failure = bool(auto_deactivate_on_failure)
        if auto_sync_on_failure is not None:
            self.auto_sync_on_failure = bool(auto_sync_on_failure)
        if self.max_group_size <= 0 and self.active_ranks is not None:
            self.max_group_size = 0  # the group's size (the tensor must cover it)
        self.is_extension = bool(is_extension)
        self.buffer_bytes = int(buffer_bytes)

    def __repr__(self):
        return (f"MooncakeBackendOptions(max_group_size={self.max_group_size}, "
                f"is_extension={self.is_extension}, "
                f"auto_deactivate_on_failure={self.auto_deactivate_on_failure}, "
                f"auto_sync_on_failure={self.auto_sync_on_failure})")


def _backend(group):
    """The ProcessGroupMooncake behind a group (None: the default group)."""
    g = dist.group.WORLD if group is None else group
    if isinstance(g, _C.ProcessGroupMooncake):
        return g
    get = getattr(g, "_get_backend", None)  # torch >= 2.1: a ProcessGroup over backends
    if get is not None:
        b = get(torch.device("cpu"))
        if isinstance(b, _C.ProcessGroupMooncake):
            return b
    raise TypeError(f"{g!r} is not a mooncake process group")


def _ranks(ranks):
    return [int(r) for r in ranks]


def get_active_ranks(backend):
    """int32 tensor, one entry per rank slot: 1 = active (an isolated extension rank: only
    its own slot). The caller's active_ranks tensor when the options gave one."""
    return _C._active_ranks(_backend(backend))


def get_num_synced_ranks(backend):
    """How many slots get_peer_state reports True for (active members included)."""
    return _C._num_synced_ranks(_backend(backend))


def get_peer_state(backend, ranks):
    """Local, communication-free, per slot: joined or active, and connected to this process."""
    return list(_C._peer_state(_backend(backend), _ranks(ranks)))


def _proposal(t):
    status, epoch, dropped, reason = t
    return ProposeViewUpdateResponse(ProposalStatus(status), int(epoch), list(dropped), reason)


def activate_ranks(backend, ranks):
    """Makes the slots active once they called join_group, are healthy and connected to the
    whole future active set (waits up to 20 s for that, then Rejected)."""
    return _proposal(_C._activate_ranks(_backend(backend), _ranks(ranks)))


recover_ranks = activate_ranks  # upstream's alias


def deactivate_ranks(backend, ranks):
    """Makes the slots inactive (self included); inactive targets are no-ops."""
    return _proposal(_C._deactivate_ranks(_backend(backend), _ranks(ranks)))


def join_group(backend):
    """An isolated (extension or replacement) or inactive rank declares itself ready and blocks
    until a view makes it active."""
    _C._join_group(_backend(backend))


def extend_group_size_to(backend, new_size):
    """Deprecated no-op, as upstream: the size follows the views (slots are reserved with
    max_group_size). Checks the size against the slots."""
    b = _backend(backend)
    if not 0 < int(new_size) <= _C._max_group_size(b):
        raise RuntimeError(f"extend_group_size_to({new_size}): the group has "
                           f"{_C._max_group_size(b)} rank slots")
    warnings.warn("extend_group_size_to is deprecated and does nothing: reserve slots with "
                  "MooncakeBackendOptions(max_group_size) and activate them",
                  DeprecationWarning, stacklevel=2)


def get_current_epoch(backend):
    return int(_C._current_epoch(_backend(backend)))


def sync_after_failure(backend):
    """Reports this process's failure evidence, waits for the agreed view and applies it."""
    status, reason = _C._sync_after_failure(_backend(backend))
    return SyncAfterFailureResponse(SyncAfterFailureStatus(status), reason)


def get_failed_ranks_hint(work):
    """int32 tensor, one entry per rank slot: 1 = this rank saw that slot fail in the op."""
    return _C._work_failed_ranks_hint(work)


def get_local_success(work):
    """Whether the op did everything it had to at this rank (its results are valid here)."""
    return bool(_C._work_local_success(work))


set_collective_timeout_us = _C.set_collective_timeout_us
set_p2p_timeout_us = _C.set_p2p_timeout_us
set_fault_reconciliation_window_us = _C.set_fault_reconciliation_window_us


# ---- group creation (called by mooncake.pg._create) ----

def creator_kwargs(opts, group_size):
    """Keyword arguments of _C.ProcessGroupMooncake for pg_options `opts`."""
    if not isinstance(opts, MooncakeBackendOptions):
        return {}
    return dict(elastic=True, max_group_size=int(opts.max_group_size),
                is_extension=opts.is_extension,
                auto_deactivate_on_failure=opts.auto_deactivate_on_failure,
                auto_sync_on_failure=opts.auto_sync_on_failure,
                active_ranks=opts.active_ranks)


def link_wrapper(backend, o):
    """torch >= 2: dist.get_world_size() reads the size of the ProcessGroup that torch builds
    around a backend, not the backend's. For an elastic group that size must follow the views
    (one past the highest active slot), so the backend is given that ProcessGroup. torch made it
    just before calling our creator (``pg`` in ``_new_process_group_helper``; checked on torch
    2.6) and passes it nowhere, so it is taken from that function's frame, checked by type,
    rank and size. Without it (another torch layout) get_world_size() keeps the initial size:
    warned."""
    link = getattr(_C, "_link_wrapper", None)
    if link is None or not _C._elastic(backend):
        return
    f = sys._getframe(2)  # our creator's caller
    for _ in range(4):
        if f is None:
            break
        if f.f_code.co_name == "_new_process_group_helper":  # torch's, never user code
            cand = f.f_locals.get("pg")
            if (isinstance(cand, dist.ProcessGroup) and cand.rank() == int(o.group_rank)
                    and cand.size() == int(o.group_size)):
                link(backend, cand)
                return
            break
        f = f.f_back
    warnings.warn("mooncake: could not find the ProcessGroup torch builds around the elastic "
                  "backend; dist.get_world_size() will not follow membership changes (use "
                  "mooncake.pg.get_active_ranks)", RuntimeWarning)


def fix_init_barrier(o):
    """torch 1.x: init_process_group / new_group end in a store-based barrier that waits for
    its counter to EQUAL the world size. A process taking a slot of a running group (a
    replacement) adds one more arrival than that; take one back first so that it passes. torch
    >= 2 counts differently (and skips the barrier by default): nothing to do there."""
    import inspect
    c10d = dist.distributed_c10d
    fn = getattr(c10d, "_store_based_barrier", None)
    if fn is None or len(inspect.signature(fn).parameters) != 3:
        return
    key = f"{c10d.STORE_BASED_BARRIER_PREFIX}:{c10d._group_count}"
    store = getattr(o.store, "underlying_store", None)
    if store is None:
        return
    world = c10d.get_world_size() if c10d.is_initialized() else int(o.group_size)
    arrived = store.add(key, 0)
    if arrived + 1 > world:
        store.add(key, world - arrived - 1)
