"""mooncake.store: the KV-cache store (Mooncake Store's Python API on this project's engine).

Two ways in:

* ``MooncakeDistributedStore`` with Mooncake's method names, arguments and return
  conventions, against a standalone ``mooncake_master`` (``master_server_address`` is the
  master's ``--port``)::

      from mooncake.store import MooncakeDistributedStore
      store = MooncakeDistributedStore()
      assert store.setup("localhost", "", 512 << 20, 0, "tcp", "", "127.0.0.1:50051") == 0
      store.put("k", b"v"); store.get("k")

* ``Store.from_group(group, segment_size=...)``: the store of a mooncake process group; every
  rank lends a segment of the group engine's memory, the master runs embedded on rank 0.

Return conventions (Mooncake's): 0 or a byte count for success, a negative error code
(``ErrorCode``; see docs/store_errors.md) for failure; ``get`` returns ``b""`` when the
object cannot be read; ``is_exist`` returns 1, 0 or a negative code.
"""

import enum
import logging

import torch  # noqa: F401  (the extension links against torch)

from . import _C

ReplicateConfig = _C.ReplicateConfig
_log = logging.getLogger("mooncake.store")


class ErrorCode(enum.IntEnum):
    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    ETCD_OPERATION_ERROR = -1000
    # Retryable: the master is rebuilding its metadata after a failover or restart (the client
    # retries by itself within the call's deadline, so callers see it only when that passed).
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    # Retryable: the master reached is a standby, not the leader.
    UNAVAILABLE_IN_CURRENT_MODE = -1011


def object_footprint(key_length, size):
    """Bytes one replica of an object takes in a holder's segment: a 64-byte record and the
    key (padded to 64 bytes) in front of the value, allocations in 64-byte steps
    (store/master/record.h; docs/store.md, "Records"). Size a segment that must hold N objects
    with N x this."""
    pad = lambda n: (n + 63) // 64 * 64  # noqa: E731
    return 64 + pad(key_length) + pad(size)


def _cfg(config):
    return ReplicateConfig() if config is None else config


class MooncakeDistributedStore:
    """Mooncake Store's client API. Every method is safe to call before ``setup`` (it
    returns INVALID_PARAMS, ``b""`` or ``None``) and after ``close``."""

    def __init__(self):
        self._c = _C.StoreClient()

    # ---- life cycle ----
    def setup(self, local_hostname, metadata_server="", global_segment_size=512 << 20,
              local_buffer_size=0, protocol="tcp", device_name="",
              master_server_address="127.0.0.1:50051"):
        """Connects to the master at ``master_server_address`` (host:port of
        ``mooncake_master --port``, or ``etcd://host:port[;host:port]`` for the leader of the
        masters of cluster ``MC_STORE_CLUSTER_ID``, followed across failovers) and lends
        ``global_segment_size`` bytes. ``metadata_server``,
        ``local_buffer_size`` and ``device_name`` are accepted for compatibility: the master's
        rendezvous is the metadata service, and transfers need no staging buffer."""
        rc = self._c.setup(local_hostname, metadata_server, int(global_segment_size),
                           int(local_buffer_size), protocol, device_name,
                           master_server_address)
        if rc != 0 and self._c.last_error():
            _log.error("setup(master %s) failed (%d): %s", master_server_address, rc,
                       self._c.last_error())
        return rc

    def close(self):
        self._c.close()
        return 0

    def get_hostname(self):
        """The name of this client's segment (use as ReplicateConfig.preferred_segment)."""
        return self._c.get_hostname()

    # ---- bytes ----
    def put(self, key, value, config=None):
        return self._c.put(key, value, _cfg(config))

    def get(self, key):
        return self._c.get(key)

    def put_batch(self, keys, values, config=None):
        return self._c.put_batch(list(keys), list(values), _cfg(config))

    def get_batch(self, keys):
        return self._c.get_batch(list(keys))

    def put_parts(self, key, *parts, config=None):
        return self._c.put_parts(key, list(parts), _cfg(config))

    # ---- zero copy ----
    def register_buffer(self, buffer_ptr, size):
        return self._c.register_buffer(int(buffer_ptr), int(size))

    def unregister_buffer(self, buffer_ptr):
        return self._c.unregister_buffer(int(buffer_ptr))

    def put_from(self, key, buffer_ptr, size, config=None):
        return self._c.put_from(key, int(buffer_ptr), int(size), _cfg(config))

    def get_into(self, key, buffer_ptr, size):
        return self._c.get_into(key, int(buffer_ptr), int(size))

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._c.batch_put_from(list(keys), [int(p) for p in buffer_ptrs],
                                      [int(s) for s in sizes], _cfg(config))

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        return self._c.batch_get_into(list(keys), [int(p) for p in buffer_ptrs],
                                      [int(s) for s in sizes])

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        return self._c.batch_put_from_multi_buffers(
            list(keys), [[int(p) for p in ps] for ps in all_buffer_ptrs],
            [[int(s) for s in ss] for ss in all_sizes], _cfg(config))

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, *_ignored):
        return self._c.batch_get_into_multi_buffers(
            list(keys), [[int(p) for p in ps] for ps in all_buffer_ptrs],
            [[int(s) for s in ss] for ss in all_sizes])

    # ---- metadata ----
    def is_exist(self, key):
        return self._c.is_exist(key)

    def batch_is_exist(self, keys):
        return self._c.batch_is_exist(list(keys))

    def get_size(self, key):
        return self._c.get_size(key)

    def remove(self, key, force=False):
        return self._c.remove(key, force)

    def remove_by_regex(self, regex, force=False):
        return self._c.remove_by_regex(regex, force)

    def remove_all(self, force=False):
        return self._c.remove_all(force)

    # ---- tensors (CPU; dtype and shape travel with the data) ----
    def put_tensor(self, key, tensor, config=None):
        if not isinstance(tensor, torch.Tensor):
            return int(ErrorCode.INVALID_PARAMS)
        return self._c.put_tensor(key, tensor, _cfg(config))

    def get_tensor(self, key):
        return self._c.get_tensor(key)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Store(MooncakeDistributedStore):
    """A store built on a mooncake process group (see ``from_group``)."""

    @classmethod
    def from_group(cls, group=None, segment_size=64 << 20, master_server_address=""):
        """Every rank of ``group`` (default: the world group; its backend must be mooncake)
        lends ``segment_size`` bytes of the group engine's memory. The master runs embedded on
        rank 0 over the group's rendezvous, unless ``master_server_address`` (host:port of a
        standalone mooncake_master) is given. Collective: call on every rank."""
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        backend = group
        getter = getattr(group, "_get_backend", None)
        if getter is not None:  # torch >= 2: ProcessGroup wraps the backend
            try:
                backend = getter(torch.device("cpu"))
            except Exception:  # noqa: BLE001
                backend = group
        s = cls()
        rc = s._c.setup_from_group(backend, int(segment_size), master_server_address)
        if rc != 0:
            name = ErrorCode(rc).name if rc in ErrorCode._value2member_map_ else "UNKNOWN"
            raise RuntimeError(f"Store.from_group: setup failed with {name} ({rc})")
        # The master lives on rank 0: nobody may leave before every rank mounted.
        dist.barrier(group=group)
        return s


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "Store", "ErrorCode"]
