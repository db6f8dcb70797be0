"""Upstream Mooncake's process-group settings (``mooncake.pg.set_host_ip`` and friends), for
the groups this process creates afterwards. Imported into mooncake.pg."""

import logging
import os

from . import _C
from ._compat import apply_rdma_devices

_log = logging.getLogger("mooncake.pg")
_device_filter = []


def set_host_ip(host):
    """The address the process's engine binds (and peers reach it at). Takes effect when the
    next mooncake group creates the process's engine (call before init_process_group)."""
    _C.set_engine_host(str(host))


def set_device_filter(filters):
    """Upstream: the RDMA NICs the engine may use. Becomes ``MC_RDMA_DEVICES`` (an empty list
    removes it: every NIC) for the engine this process creates next: call it before the
    process's first mooncake group, as groups share the process's engine and a running engine
    keeps its NICs. ``get_device_filter()`` returns it."""
    global _device_filter
    _device_filter = [str(f) for f in filters]
    if _device_filter:
        apply_rdma_devices(_device_filter, "mooncake.pg.set_device_filter", _log)
    else:  # no filter: every NIC, as upstream
        os.environ.pop("MC_RDMA_DEVICES", None)


def get_device_filter():
    return list(_device_filter)


def set_transfer_engine(engine):
    """Groups created from now on use this engine (a mooncake.engine.TransferEngine that is
    initialized, or its get_engine() handle) instead of creating their own; None resets.
    Every rank's engine must hold the same job secret (MC_SECRET / MC_SECRET_FILE: docs/
    compat.md); the caller keeps it alive."""
    if engine is None:
        _C.set_process_engine(None)
        return
    handle = engine if isinstance(engine, _C.InnerTransferEngine) else engine.get_engine()
    if handle is None:
        raise RuntimeError("set_transfer_engine: the TransferEngine is not initialized")
    _C.set_process_engine(handle)


__all__ = ["set_host_ip", "set_device_filter", "get_device_filter", "set_transfer_engine"]
