"""Value types of mooncake.store with upstream Mooncake Store's names and fields
(mooncake-integration/store/store_py.cpp): ReplicateConfig, SoftPinAction, ObjectDataType,
replica descriptors, the parallelism descriptions of the tensor API, MooncakeHostMemAllocator.
"""

import ctypes
import enum

from . import _C

INVALID_PARAMS = -600


class SoftPinAction(enum.IntEnum):
    """What a put/upsert does with the object's soft pin. PRESERVE: a new object is not pinned,
    an upserted one keeps its pin; ENABLE: pinned (for soft_pin_ttl_ms, else the master's
    MC_STORE_SOFT_PIN_TTL_MS) ; DISABLE: not pinned."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Upstream's ReplicateConfig. Unknown attributes raise AttributeError, as upstream's."""

    __slots__ = ("replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
                 "_soft_pin_ttl_ms", "with_hard_pin", "preferred_segments",
                 "preferred_nof_segments", "preferred_segment", "prefer_alloc_in_same_node",
                 "data_type")

    def __init__(self):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms = None
        self.with_hard_pin = False
        self.preferred_segments = []
        self.preferred_nof_segments = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN

    @property
    def soft_pin_ttl_ms(self):
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, v):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0
                              or v >= 1 << 64):
            raise TypeError("soft_pin_ttl_ms must be None or an int in [0, 2**64)")
        self._soft_pin_ttl_ms = v

    # This project's earlier spelling (upstream removed it): True = ENABLE, False = DISABLE.
    @property
    def with_soft_pin(self):
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, v):
        self.soft_pin_action = SoftPinAction.ENABLE if v else SoftPinAction.DISABLE

    def __str__(self):
        fields = ", ".join(f"{n}: {getattr(self, n)}" for n in (
            "replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
            "soft_pin_ttl_ms", "with_hard_pin", "preferred_segments", "preferred_segment",
            "prefer_alloc_in_same_node", "data_type"))
        return "ReplicateConfig: { " + fields + " }"

    __repr__ = __str__


def native_config(config):
    """(native _C.ReplicateConfig, 0), or (None, INVALID_PARAMS) for what this store refuses:
    replica_num 0, NoF/DFS replicas (no such tiers here), prefer_alloc_in_same_node (refused
    by upstream's puts too), a soft_pin_ttl_ms without ENABLE."""
    c = ReplicateConfig() if config is None else config
    if isinstance(c, _C.ReplicateConfig):
        return c, 0
    if c.replica_num <= 0 or c.nof_replica_num or c.dfs_replica_num or \
            c.prefer_alloc_in_same_node:
        return None, INVALID_PARAMS
    ttl = c.soft_pin_ttl_ms
    if ttl is not None and c.soft_pin_action != SoftPinAction.ENABLE:
        return None, INVALID_PARAMS
    n = _C.ReplicateConfig()
    n.replica_num = int(c.replica_num)
    n.with_hard_pin = bool(c.with_hard_pin)
    n.preferred_segment = c.preferred_segment or ""
    n.preferred_segments = [str(s) for s in (c.preferred_segments or [])]
    action = SoftPinAction(c.soft_pin_action)
    n.with_soft_pin = action == SoftPinAction.ENABLE and ttl != 0  # ttl 0: an ordinary object
    n.soft_pin_ttl_ms = int(ttl or 0)
    n.keep_soft_pin = action == SoftPinAction.PRESERVE
    return n, 0


# ---- replica descriptors (get_replica_desc / batch_get_replica_desc) ----

class Descriptor:
    """One piece of a memory replica: ``size`` bytes at ``buffer_address`` in the memory of the
    client named ``transport_endpoint`` (its segment name, "host:port")."""

    def __init__(self, size, buffer_address, transport_endpoint):
        self.size, self.buffer_address, self.transport_endpoint = size, buffer_address, \
            transport_endpoint

    def __repr__(self):
        return (f"Descriptor(size={self.size}, buffer_address={self.buffer_address:#x}, "
                f"transport_endpoint={self.transport_endpoint!r})")


class MemoryDescriptor:
    """``buffer_descriptor``: the replica's (first) piece; ``buffer_descriptors``: all of them
    (a replica too large for one segment is striped)."""

    def __init__(self, descriptors):
        self.buffer_descriptors = descriptors
        self.buffer_descriptor = descriptors[0] if descriptors else None


class ReplicaDescriptor:
    def __init__(self, descriptors, status=ReplicaStatus.COMPLETE):
        self.status = status
        self._mem = MemoryDescriptor(descriptors)

    def is_memory_replica(self):
        return True

    def is_disk_replica(self):
        return False

    def is_local_disk_replica(self):
        return False

    def get_memory_descriptor(self):
        return self._mem

    def get_disk_descriptor(self):
        raise RuntimeError("not a disk replica (this store keeps replicas in memory only)")


def replica_descriptors(native_list):
    """[ReplicaDescriptor] from _C.StoreClient.replica_list()'s (size, replicas) tuple."""
    _, reps = native_list
    return [ReplicaDescriptor([Descriptor(n, a, seg) for n, a, _client, seg in pieces])
            for pieces in reps]


# ---- the unified parallel tensor API's descriptions ----

class ParallelAxis:
    """One axis of a tensor's parallel layout: kind "tp"/"dp"/"ep"/"pp" (case-insensitive),
    rank, size, split_dim (tp), expert_id (ep), stage_id (pp)."""

    def __init__(self, kind="tp", rank=0, size=1, split_dim=None, expert_id=None,
                 stage_id=None):
        self.kind, self.rank, self.size = kind, rank, size
        self.split_dim, self.expert_id, self.stage_id = split_dim, expert_id, stage_id

    @property
    def kind(self):
        return self._kind

    @kind.setter
    def kind(self, v):
        self._kind = str(v).lower()

    def __repr__(self):
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim})")


class TensorParallelism:
    """``axes``: 1..4 ParallelAxis."""

    def __init__(self, axes=None):
        self.axes = list(axes or [])


class ReadTarget:
    """What a parallel read returns: mode "as_stored", "shard" (this reader's shard, per
    ``parallelism``) or "full"."""

    _MODES = ("as_stored", "shard", "full")

    def __init__(self, mode="as_stored", parallelism=None):
        self.mode = mode
        self.parallelism = parallelism

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, v):
        m = str(v).lower()
        if m not in self._MODES:
            raise RuntimeError(f"Unsupported ReadTarget mode {v!r}")
        self._mode = m


# ---- host memory for registered buffers (SGLang's MooncakeHostMemAllocator) ----

_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                 ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class MooncakeHostMemAllocator:
    """Page-aligned host memory: ``alloc(size)`` -> address (int), ``free(ptr)``."""

    def alloc(self, size):
        p = ctypes.c_void_p()
        if _libc.posix_memalign(ctypes.byref(p), 4096, int(size)) != 0 or not p.value:
            raise MemoryError(f"cannot allocate {size} bytes")
        return p.value

    def free(self, ptr):
        _libc.free(ctypes.c_void_p(int(ptr)))
