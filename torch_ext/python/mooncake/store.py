"""mooncake.store: the KV-cache store (upstream Mooncake Store's Python API on this project's
engine).

Two ways in:

* ``MooncakeDistributedStore`` with upstream's method names, arguments and return conventions,
  against a standalone ``mooncake_master`` (``master_server_addr`` is the master's
  ``--port``)::

      from mooncake.store import MooncakeDistributedStore
      store = MooncakeDistributedStore()
      assert store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                         "127.0.0.1:50051") == 0
      store.put("k", b"v"); store.get("k")

  ``setup`` also takes upstream's config dict, and an engine to share as its 8th argument
  (``TransferEngine.get_engine()``, mooncake.engine), as SGLang's HiCache passes it.

* ``Store.from_group(group, segment_size=...)``: the store of a mooncake process group; every
  rank lends a segment of the group engine's memory, the master runs embedded on rank 0.

Return conventions (upstream's): 0 or a byte count for success, a negative error code
(``ErrorCode``; docs/store_errors.md) for failure; a put of an existing key is 0 (the stored
value stays); ``get`` returns ``b""`` and ``get_buffer`` ``None`` when the object cannot be read;
``is_exist`` returns 1, 0 or a negative code. The calls that need the local buffer (bytes in and
out: put, get, put_parts, get_buffer, the tensor calls...) fail with INVALID_PARAMS / ``b""`` /
``None`` when ``local_buffer_size`` is 0, as upstream's do. docs/compat.md lists every difference.
"""

import enum
import logging
import re

import torch  # noqa: F401  (the extension links against torch)

from . import _C
from ._compat import apply_rdma_devices
from ._store_tensors import TensorApi
from ._store_types import (Descriptor, MemoryDescriptor, MooncakeHostMemAllocator,  # noqa: F401
                           ObjectDataType, ParallelAxis, ReadTarget, ReplicaDescriptor,
                           ReplicaStatus, ReplicateConfig, SoftPinAction, TensorParallelism,
                           native_config, replica_descriptors)

_log = logging.getLogger("mooncake.store")
BufferHandle = _C.BufferHandle


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


_BAD = int(ErrorCode.INVALID_PARAMS)


def _range_args(fn, aliases, ptrs, sizes, offsets):
    """The buffer and offset lists of a multi-buffer range call, under upstream's keyword names
    or the other names callers use (all_buffers; all_offsets): TypeError as Python's own for an
    unknown, doubled or missing argument."""
    off_alias, offs, off_name = offsets
    for k, v in aliases.items():
        if k == "all_buffers" and ptrs is None:
            ptrs = v
        elif k == off_alias and offs is None:
            offs = v
        elif k in ("all_buffers", off_alias):
            raise TypeError(f"{fn}() got multiple values for argument '{k}'")
        else:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{k}'")
    for name, v in (("all_buffer_ptrs", ptrs), ("all_sizes", sizes), (off_name, offs)):
        if v is None:
            raise TypeError(f"{fn}() missing required argument: '{name}'")
    return ptrs, offs
_EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
_SETUP_NAMES = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
                "protocol", "rdma_devices", "master_server_addr", "engine",
                "enable_ssd_offload", "ssd_offload_path", "tenant_id",
                "enable_client_http_server", "client_http_port")
# This project's earlier keyword names, still accepted.
_SETUP_ALIASES = {"device_name": "rdma_devices", "master_server_address": "master_server_addr",
                  "transfer_engine": "engine"}
_DEFAULT_SIZE = 16 << 20  # upstream's default segment and local buffer size (config dict)


def _put_rc(rc):
    """Upstream's put: an existing key is success (the stored value is kept)."""
    return 0 if rc == _EXISTS else rc


def _get_into_rc(rc):
    """Upstream's get_into family: a buffer smaller than the object is INVALID_PARAMS (-600),
    not BUFFER_OVERFLOW (upstream real_client.cpp, execute_ranged_read and
    batch_get_into_internal)."""
    return int(ErrorCode.INVALID_PARAMS) if rc == ErrorCode.BUFFER_OVERFLOW else rc


def parse_size(v):
    """Bytes from an int or upstream's human-readable sizes ("16MB", "16 MB", "1GiB"; binary
    units). ValueError for anything else (a percentage, a negative number)."""
    if isinstance(v, bool):
        raise ValueError(f"bad size {v!r}")
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"negative size {v}")
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(v), re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {v!r}")
    mult = 1 << (10 * " kmgt".index(m.group(2).lower() or " "))
    return int(float(m.group(1)) * mult)


def _truthy(v):
    return str(v).strip().lower() in ("1", "true", "yes", "on")


class MooncakeDistributedStore(TensorApi):
    """Upstream's client API. Every method is safe to call before ``setup`` (it returns
    INVALID_PARAMS, ``b""``, ``None`` or ``[]``) and after ``close``."""

    def __init__(self):
        self._c = _C.StoreClient()

    # ---- life cycle ----
    def setup(self, *args, **kwargs):
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config_dict)``: 0, or a negative code (logged).

        ``local_hostname`` names this client ("host" gets ":<port>" of its engine appended;
        "host:port" is used as given); with ``engine`` it must be that engine's session id.
        ``master_server_addr`` is a master's "host:port" (``mooncake_master --port``) or
        "etcd://host:port[;host:port]": the leader of the masters of cluster
        ``MC_STORE_CLUSTER_ID``, followed across failovers (docs/store.md, "Failover").
        ``metadata_server`` is accepted and unused (the master is the metadata service);
        ``rdma_devices`` limits the NICs of the engine this client creates (``MC_RDMA_DEVICES``;
        a shared ``engine`` keeps its own). SSD offload and tenants other than "default" are
        not in this store: asking for them fails. Nor is the client HTTP server: asking for it
        logs a warning and nothing listens on ``client_http_port``."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            return self._setup_dict(args[0])
        if not args and set(kwargs) == {"config"} and isinstance(kwargs["config"], dict):
            return self._setup_dict(kwargs["config"])  # upstream binds it as py::arg("config")
        if len(args) > len(_SETUP_NAMES):
            raise TypeError(f"setup() takes at most {len(_SETUP_NAMES)} positional arguments "
                            f"({len(args)} given)")
        a = dict(zip(_SETUP_NAMES, args))
        for k, v in kwargs.items():
            k = _SETUP_ALIASES.get(k, k)
            if k not in _SETUP_NAMES:
                raise TypeError(f"setup() got an unexpected keyword argument '{k}'")
            if k in a:
                raise TypeError(f"setup() got multiple values for argument '{k}'")
            a[k] = v
        if "local_hostname" not in a:
            raise TypeError("setup() missing required argument: 'local_hostname'")
        return self._setup(**a)

    def _setup_dict(self, cfg):
        c = {str(k): str(v) for k, v in cfg.items()}
        # mooncake.json spells two keys otherwise (device_name, master_server_address): a
        # parsed config file given as it is must not fall back to 127.0.0.1:50051 in silence.
        for alias, key in (("device_name", "rdma_devices"),
                           ("master_server_address", "master_server_addr")):
            if alias in c and key not in c:
                c[key] = c[alias]
        if "local_hostname" not in c or "metadata_server" not in c:
            _log.error("setup(config): local_hostname and metadata_server are required")
            return _BAD
        try:
            sizes = {k: parse_size(c.get(k, _DEFAULT_SIZE))
                     for k in ("global_segment_size", "local_buffer_size")}
        except ValueError as e:
            _log.error("setup(config): %s", e)
            return _BAD
        if any(0 < v < 1024 for v in sizes.values()) or sizes["local_buffer_size"] > 1 << 40:
            _log.error("setup(config): sizes must be 0 or at least 1 KiB (local buffer <= 1 TiB)")
            return _BAD
        return self._setup(
            local_hostname=c["local_hostname"], metadata_server=c["metadata_server"],
            protocol=c.get("protocol", "tcp"), rdma_devices=c.get("rdma_devices", ""),
            master_server_addr=c.get("master_server_addr", "127.0.0.1:50051"),
            enable_ssd_offload=_truthy(c.get("enable_ssd_offload", "false")),
            ssd_offload_path=c.get("ssd_offload_path", ""),
            tenant_id=c.get("tenant_id", "default"),
            enable_client_http_server=_truthy(c.get("enable_client_http_server", "false")),
            client_http_port=int(c.get("client_http_port", "9300")), **sizes)

    def _setup(self, local_hostname, metadata_server="P2PHANDSHAKE",
               global_segment_size=_DEFAULT_SIZE, local_buffer_size=_DEFAULT_SIZE,
               protocol="tcp", rdma_devices="", master_server_addr="127.0.0.1:50051",
               engine=None, enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
               enable_client_http_server=False, client_http_port=9300):
        refused = []
        if enable_ssd_offload:
            refused.append("SSD offload (enable_ssd_offload)")
        if tenant_id not in ("", "default", None):
            refused.append(f"tenant namespaces (tenant_id={tenant_id!r})")
        if enable_client_http_server:
            # SGLang asks for it whenever its storage metrics are on; refusing would stop the
            # store there. Nothing listens on client_http_port (docs/compat.md).
            _log.warning("setup: this store has no client HTTP server; enable_client_http_server"
                         " is ignored (nothing listens on port %s)", client_http_port)
        if refused:
            _log.error("setup: this store does not support %s", ", ".join(refused))
            return _BAD
        if engine is not None and not isinstance(engine, _C.InnerTransferEngine):
            raise TypeError("setup(): engine must be None or TransferEngine.get_engine()'s "
                            f"handle, not {type(engine).__name__}")
        try:
            gseg, lbuf = parse_size(global_segment_size), parse_size(local_buffer_size)
        except ValueError as e:
            _log.error("setup: %s", e)
            return _BAD
        if engine is None:
            apply_rdma_devices(rdma_devices, "setup(rdma_devices)", _log)
        rc = self._c.setup(str(local_hostname), gseg, lbuf, str(protocol or "tcp"),
                           str(master_server_addr), engine)
        if rc != 0:
            _log.error("setup(master %s) failed (%d): %s", master_server_addr, rc,
                       self._c.last_error())
        elif engine is not None and str(local_hostname) != self._c.get_hostname():
            _log.warning("setup: local_hostname %r is not the shared engine's session id %r; "
                         "the client is named %r", local_hostname, self._c.get_hostname(),
                         self._c.get_hostname())
        return rc

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address, ipc_socket_path="",
                    timeout_ms=10000):
        """Upstream's standalone mode (SGLang's ``standalone_storage``): join the store that
        the ``mooncake_client`` at ``server_address`` ("host:port", its ``--port``) lends its
        memory to. 0, or a negative code (logged).

        Unlike upstream's dummy client this is not a proxy: it asks that mooncake_client which
        master it lends to (and with which protocol and NICs), then is a client of that master
        that lends nothing, named "<the mooncake_client's --host>:<its own engine port>" (it
        runs on that host).
        Its own memory (``register_buffer``, a local buffer of ``local_buffer_size`` bytes)
        takes part in transfers directly, one-sidedly, with no hop through the mooncake_client
        process; the objects live in the pool's segments. ``mem_pool_size`` (upstream: the
        size of the memory shared with the real client) and ``ipc_socket_path`` are checked
        and unused. Both processes need the same job secret (``MC_SECRET`` /
        ``MC_SECRET_FILE``, by default the user's ``~/.mooncake/secret``); the lookup takes at
        most ``timeout_ms``."""
        try:
            parse_size(mem_pool_size)
            lbuf = parse_size(local_buffer_size)
        except ValueError as e:
            _log.error("setup_dummy: %s", e)
            return _BAD
        if not isinstance(ipc_socket_path, str):
            raise TypeError("setup_dummy(): ipc_socket_path must be a str")
        rc, info, why = _C.real_client_info(str(server_address), int(timeout_ms))
        if rc != 0:
            _log.error("setup_dummy(%s) failed (%d): %s", server_address, rc, why)
            return rc
        # Named like the mooncake_client: its --host, an address peers reach on this host
        # (not server_address's, often 127.0.0.1 on every node), with this engine's port.
        host = info["segment"].rpartition(":")[0]
        return self._setup(local_hostname=host, global_segment_size=0, local_buffer_size=lbuf,
                           protocol=info["protocol"], rdma_devices=info["rdma_devices"],
                           master_server_addr=info["master_server_addr"])

    def close(self):
        self._c.close()
        return 0

    def get_hostname(self):
        """This client's segment name, "host:port" (use it as preferred_segment)."""
        return self._c.get_hostname()

    def health_check(self):
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        if not self._c.is_setup():
            return 1
        return 0 if self._c.ping() == 0 else 2

    def _cfg(self, config):
        return native_config(config)

    def _staged(self):
        """True when the local buffer exists (upstream stages these calls through it)."""
        if self._c.local_buffer_size > 0 or not self._c.is_setup():
            return True
        _log.debug("local_buffer_size is 0: calls that need the local buffer fail")
        return False

    # ---- bytes ----
    def put(self, key, value, config=None):
        c, rc = self._cfg(config)
        if rc or not self._staged():
            return rc or _BAD
        return _put_rc(self._c.put(key, value, c))

    def put_parts(self, key, *parts, config=None):
        for p in parts:
            mv = memoryview(p)
            if mv.ndim != 1 or mv.itemsize != 1:
                raise RuntimeError("parts must be 1-D bytes-like")
        c, rc = self._cfg(config)
        if rc or not self._staged():
            return rc or _BAD
        return _put_rc(self._c.put_parts(key, list(parts), c))

    def put_batch(self, keys, values, config=None):
        """One int: 0 when every key was stored (or existed), else the first failure."""
        c, rc = self._cfg(config)
        if rc or not self._staged():
            return rc or _BAD
        return _put_rc(self._c.put_batch(list(keys), list(values), c))

    def get(self, key):
        if not self._staged():
            return b""
        return self._c.get(key)

    def get_batch(self, keys):
        keys = list(keys)
        if not self._staged():
            return [b""] * len(keys)
        return self._c.get_batch(keys)

    def get_buffer(self, key):
        """A BufferHandle over the object's bytes in the local buffer (buffer protocol:
        memoryview / torch.frombuffer), or None on a miss."""
        return self._c.get_buffer(key)

    def batch_get_buffer(self, keys):
        return self._c.batch_get_buffer(list(keys))

    # ---- zero copy ----
    def register_buffer(self, buffer_ptr, size):
        return self._c.register_buffer(int(buffer_ptr), int(size))

    def unregister_buffer(self, buffer_ptr):
        return self._c.unregister_buffer(int(buffer_ptr))

    def put_from(self, key, buffer_ptr, size, config=None):
        c, rc = self._cfg(config)
        return rc or _put_rc(self._c.put_from(key, int(buffer_ptr), int(size), c))

    def put_from_with_metadata(self, key, buffer_ptr, metadata_buffer_ptr, size, metadata_size,
                               config=None):
        """The object is the metadata bytes followed by the data bytes (both registered)."""
        c, rc = self._cfg(config)
        if rc:
            return rc
        return _put_rc(self._c.batch_put_from_multi_buffers(
            [key], [[int(metadata_buffer_ptr), int(buffer_ptr)]],
            [[int(metadata_size), int(size)]], c)[0])

    def get_into(self, key, buffer_ptr, size):
        return _get_into_rc(self._c.get_into(key, int(buffer_ptr), int(size)))

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        keys = list(keys)
        c, rc = self._cfg(config)
        if rc:
            return [rc] * len(keys)
        return [_put_rc(r) for r in self._c.batch_put_from(
            keys, [int(p) for p in buffer_ptrs], [int(s) for s in sizes], c)]

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        """Per key: the bytes read (> 0), or a negative code."""
        return [_get_into_rc(r) for r in self._c.batch_get_into(
            list(keys), [int(p) for p in buffer_ptrs], [int(s) for s in sizes])]

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        keys = list(keys)
        c, rc = self._cfg(config)
        if rc:
            return [rc] * len(keys)
        return [_put_rc(r) for r in self._c.batch_put_from_multi_buffers(
            keys, [[int(p) for p in ps] for ps in all_buffer_ptrs],
            [[int(s) for s in ss] for ss in all_sizes], c)]

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                     prefer_alloc_in_same_node=False):
        return [_get_into_rc(r) for r in self._c.batch_get_into_multi_buffers(
            list(keys), [[int(p) for p in ps] for ps in all_buffer_ptrs],
            [[int(s) for s in ss] for ss in all_sizes])]

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets,
                        all_sizes):
        """For buffer b and its k-th key, fragment f copies object bytes
        [all_src_offsets[b][k][f], +all_sizes[b][k][f]) to buffer_ptrs[b] +
        all_dst_offsets[b][k][f]. Returns bytes (or a negative code) per fragment, shaped as
        all_sizes; fragments fail independently (missing key, range past the object, shape)."""
        out = []
        for b, ptr in enumerate(buffer_ptrs):
            keys = all_keys[b] if b < len(all_keys) else []
            per_key = []
            for k, key in enumerate(keys):
                try:
                    dst, src, size = (all_dst_offsets[b][k], all_src_offsets[b][k],
                                      all_sizes[b][k])
                except IndexError:
                    per_key.append([])
                    continue
                if not (len(dst) == len(src) == len(size)):
                    per_key.append([_BAD] * len(size))
                    continue
                per_key.append(self._c.get_ranges(key, [int(ptr) + int(d) for d in dst],
                                                  [int(s) for s in src], [int(n) for n in size]))
            out.append(per_key)
        return out

    # ---- read sessions and key-major ranges (SGLang's and vLLM's layer-wise loaders) ----
    def batch_get_session_start(self, keys):
        """Per key: 0 when the object can be read (complete), else a negative code (-704
        missing). One master call for all keys, whose replica lists the range reads below use
        while half of the read lease it took is left (no master call then): they read the
        values as they were at the start (this client's own remove or upsert of a key drops
        its list). After that they ask again, each call under a lease of its own, so a key
        replaced since gives later reads the new value and one evicted since fails them
        (docs/compat.md)."""
        return self._c.read_session_start(list(keys))

    def batch_get_session_start_with_sources(self, keys):
        """(batch_get_session_start's list, the tier each key is read from): None for every
        key, as upstream says for memory replicas (there are no disk tiers here)."""
        keys = list(keys)
        return self.batch_get_session_start(keys), [None] * len(keys)

    def batch_get_session_end(self, keys):
        """0 (one int, as upstream's): the keys' replica lists are forgotten."""
        self._c.read_session_end(list(keys))
        return 0

    batch_get_start = batch_get_session_start
    batch_get_end = batch_get_session_end

    def batch_get_into_multi_buffer_ranges(self, keys, all_buffer_ptrs=None, all_sizes=None,
                                           all_src_offsets=None, **aliases):
        """For key i and its j-th range: object bytes [all_src_offsets[i][j], +all_sizes[i][j])
        to all_buffer_ptrs[i][j] (registered memory, host or GPU). One replica-list call to the
        master and one engine batch for all keys (a key whose first replica fails reads its
        others alone). Per key: the bytes read (the sum of its sizes), or the first failure's
        negative code (a missing key, a range past the object, lists of different lengths:
        -600). Keyword names: upstream's; ``all_buffers`` and ``all_offsets`` are accepted too
        (the names some callers' protocols declare)."""
        all_buffers, all_offsets = _range_args("batch_get_into_multi_buffer_ranges", aliases,
                                               all_buffer_ptrs, all_sizes,
                                               ("all_offsets", all_src_offsets, "all_src_offsets"))
        keys = list(keys)
        out = [_BAD] * len(keys)
        good = []
        for i in range(len(keys)):
            try:
                ptrs, sizes, offs = all_buffers[i], all_sizes[i], all_offsets[i]
            except IndexError:
                continue
            if len(ptrs) == len(sizes) == len(offs) and ptrs:
                good.append(i)
        if not good:
            return out
        got = self._c.batch_get_ranges(
            [keys[i] for i in good], [[int(p) for p in all_buffers[i]] for i in good],
            [[int(o) for o in all_offsets[i]] for i in good],
            [[int(n) for n in all_sizes[i]] for i in good])
        for i, per in zip(good, got):
            bad = [r for r in per if r < 0]
            out[i] = bad[0] if bad else sum(per)
        return out

    # ---- put sessions and key-major ranges (vLLM's and vllm-ascend's layer-wise saver) ----
    def batch_put_session_start(self, keys, sizes, config=None):
        """Per key: 0 when a session is open (the object is placed, not yet readable), else a
        negative code (-705: the key exists, or this client has a session of it open)."""
        keys = list(keys)
        c, rc = self._cfg(config)
        if rc or len(keys) != len(sizes):
            return [rc or _BAD] * len(keys)
        return self._c.put_session_start(keys, [int(n) for n in sizes], c)

    def batch_put_from_multi_buffer_ranges(self, keys, all_buffer_ptrs=None, all_sizes=None,
                                           all_dst_offsets=None, config=None, **aliases):
        """For key i and its j-th range: all_buffer_ptrs[i][j] (registered memory, host or
        GPU) to object bytes [all_dst_offsets[i][j], +all_sizes[i][j]). One engine batch for all
        keys. Per key: the bytes written (the sum of its sizes), or a negative code (-704: no
        session open; -600: lists of different lengths, a range past the object or from
        unregistered memory, and nothing of that key is written; -800: a transfer failed, and
        the session can only be revoked). `config` is ignored (start took it). Keyword names:
        upstream's; ``all_buffers`` and ``all_offsets`` are accepted too."""
        all_buffers, all_dst_offsets = _range_args("batch_put_from_multi_buffer_ranges", aliases,
                                                   all_buffer_ptrs, all_sizes,
                                                   ("all_offsets", all_dst_offsets, "all_dst_offsets"))
        keys = list(keys)
        return self._c.put_session_ranges(
            keys, [[int(p) for p in ps] for ps in all_buffers],
            [[int(n) for n in ns] for ns in all_sizes],
            [[int(o) for o in os_] for os_ in all_dst_offsets])

    def batch_put_session_end(self, keys):
        """Per key: 0 when the object is published, else a negative code (-700: some bytes
        were never written, or -900 with no heartbeat answered lately: the session stays open;
        others end it)."""
        return self._c.put_session_end(list(keys))

    def batch_put_session_revoke(self, keys):
        """Per key: 0 when the session was dropped (-704: none open)."""
        return self._c.put_session_revoke(list(keys))

    batch_put_start = batch_put_session_start
    batch_put_end = batch_put_session_end
    batch_put_revoke = batch_put_session_revoke

    # ---- upserts: replace the value; readers get the old bytes or the new ones ----
    def upsert(self, key, value, config=None):
        return self.upsert_parts(key, value, config=config)

    def upsert_parts(self, key, *parts, config=None):
        c, rc = self._cfg(config)
        if rc or not self._staged():
            return rc or _BAD
        return self._c.upsert_parts(key, list(parts), c)

    def upsert_batch(self, keys, values, config=None):
        """One int: 0 when every key was written, else the first failure."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            return _BAD
        for k, v in zip(keys, values):
            rc = self.upsert(k, v, config)
            if rc:
                return rc
        return 0

    def upsert_from(self, key, buffer_ptr, size, config=None):
        c, rc = self._cfg(config)
        return rc or self._c.upsert_from(key, int(buffer_ptr), int(size), c)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [_BAD] * len(keys)
        return [self.upsert_from(k, p, s, config) for k, p, s in zip(keys, ptrs, sizes)]

    # ---- metadata ----
    def is_exist(self, key):
        return self._c.is_exist(key)

    def batch_is_exist(self, keys):
        return self._c.batch_is_exist(list(keys))

    def get_size(self, key):
        return self._c.get_size(key)

    def remove(self, key, force=False):
        return self._c.remove(key, force)

    def remove_by_regex(self, regex_pattern, force=False):
        return self._c.remove_by_regex(regex_pattern, force)

    def remove_all(self, force=False):
        return self._c.remove_all(force)

    def batch_remove(self, keys, force=False):
        return [self.remove(k, force) for k in keys]

    def get_replica_desc(self, key):
        """[ReplicaDescriptor] of the key's complete replicas; [] on a miss."""
        r = self._c.replica_list(key)
        return [] if r is None or isinstance(r, int) else replica_descriptors(r)

    def batch_get_replica_desc(self, keys):
        """{key: [ReplicaDescriptor]}; keys that fail are absent."""
        out = {}
        for k in keys:
            r = self._c.replica_list(k)
            if r is not None and not isinstance(r, int):
                out[k] = replica_descriptors(r)
        return out

    def batch_replica_clear(self, keys, segment_name=""):
        """Drops the replicas of keys this client wrote: all of them ("") or those on one
        segment. Returns the keys cleared; absent keys, other clients' keys, leased keys and keys
        being written are skipped."""
        return self._c.batch_replica_clear([str(k) for k in keys], str(segment_name))

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
        standalone mooncake_master) is given. Collective: call on every rank. Bytes calls need
        no local buffer here (the group's engine memory serves)."""
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
        s._group_store = True
        return s

    def _staged(self):
        return True


from .buffer_pool import BufferLease, BufferPool, RegisteredBufferPool  # noqa: E402

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "Store", "ErrorCode", "SoftPinAction",
           "ObjectDataType", "ReplicaStatus", "ReplicaDescriptor", "MemoryDescriptor",
           "Descriptor", "ParallelAxis", "TensorParallelism", "ReadTarget", "BufferHandle",
           "BufferPool", "BufferLease", "RegisteredBufferPool", "MooncakeHostMemAllocator"]
