"""The torch.distributed backend "mooncake" (c10d adapter over mooncake's pg::Communicator).

Registered by ``import mooncake``. Every process holds one transfer engine that all of its
groups share; each group (the default one and every ``dist.new_group(..., backend=
"mooncake")``) gets its own communicator, keyed by the group name torch assigns, and
exchanges segments through the c10d store torch hands the backend.
"""

import secrets
from dataclasses import dataclass

import torch.distributed as dist

from . import _C, _compat

BACKEND_NAME = "mooncake"
ALIASES = ("mooncake-cpu",)

ProcessGroupMooncake = _C.ProcessGroupMooncake


@dataclass
class Options:
    """Per-group options: ``dist.init_process_group(..., pg_options=mooncake.Options(...))``.

    buffer_bytes: registered comm buffer per rank (0: MC_PG_BUFFER_BYTES).
    """

    buffer_bytes: int = 0


def _group_name(store, rank, size, group_id):
    """A name every rank of this group agrees on and no other group of the job shares.

    torch's group ids ("0", "1", ...) restart after destroy_process_group(), while the old
    ProcessGroup (and its communicator, which claims the name on this process's engine)
    may still be referenced. So rank 0 adds a random nonce per incarnation: the ranks of
    one incarnation count themselves in the group's (prefix) store, and incarnation k
    reads the nonce published under key k, even when a store is reused.
    """
    arrivals = store.add("mooncake/arrivals", 1)
    incarnation = (arrivals - 1) // size
    key = f"mooncake/nonce/{incarnation}"
    if rank == 0:
        store.set(key, secrets.token_hex(6))
    nonce = store.get(key).decode()
    return f"{group_id}.{nonce}"


def _create(dist_backend_opts, pg_options=None):
    """Creator torch calls (extended API): builds the group's ProcessGroupMooncake."""
    o = dist_backend_opts
    opts = pg_options if isinstance(pg_options, Options) else Options()
    return _C.ProcessGroupMooncake(
        o.store,
        o.group_rank,
        o.group_size,
        o.timeout,
        group_name=_group_name(o.store, o.group_rank, o.group_size, o.group_id),
        global_ranks=[int(r) for r in (o.global_ranks_in_group or [])],
        buffer_bytes=int(opts.buffer_bytes),
    )


def register():
    """Registers "mooncake" and its aliases with torch.distributed (idempotent), for the
    device types the built extension serves (``_C.DEVICES``; torch >= 2.1 routes a group's
    tensors of other devices elsewhere or refuses them)."""
    for name in (BACKEND_NAME,) + ALIASES:
        devices = ["cpu"] if name.endswith("-cpu") else _C.DEVICES
        if name.upper() not in getattr(dist.Backend, "_plugins", {}):
            _compat.register_backend(name, _create, devices)
