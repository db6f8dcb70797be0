"""mooncake.engine: upstream Mooncake's Python ``TransferEngine`` on this project's engine.

What vLLM's and SGLang's prefill/decode disaggregation call::

    from mooncake.engine import TransferEngine
    te = TransferEngine()
    assert te.initialize("10.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    session_id = f"10.0.0.1:{te.get_rpc_port()}"       # what the peer passes as target
    te.register_memory(kv_ptr, kv_bytes)
    te.batch_transfer_sync_write(peer_session, src_ptrs, peer_ptrs, lengths)  # 0 = ok

Same names, argument orders, defaults and return conventions as upstream (0 / negative codes
for sync calls, a batch id / 0 for async submits); docs/compat.md lists every difference.

* Sessions are ``"host:port"`` (``"[v6addr]:port"``): the host the peer passed to
  ``initialize`` and its ``get_rpc_port()``, the port of its engine's tcp listener. Only
  ``P2PHANDSHAKE`` (no metadata server): the first transfer to a session asks that listener for
  the peer's descriptor, presenting the job secret.
* The job secret: ``MC_SECRET``, else the file ``MC_SECRET_FILE`` names, else
  ``~/.mooncake/secret`` (created, mode 0600, when missing). Every engine of a deployment must
  read the same one (docs/compat.md, "Secrets in a P/D deployment").
* Protocols ``"tcp"`` and ``"rdma"``. The engine chooses per peer: shared memory on one host,
  its rdma transport (libibverbs, docs/rdma.md) between hosts that both publish a NIC of the
  same link layer (reachability is not probed), tcp otherwise; so ``"rdma"`` on a host without an active NIC runs over tcp, as upstream does.
  ``device_name`` ("mlx5_0,mlx5_1") limits the NICs (``MC_RDMA_DEVICES``). ``MC_FORCE_TCP=1``
  carries every peer over tcp. The rdma transport has been run only on the project's verbs
  emulator (no RDMA NIC exists where it was built).
* GPU memory (a CUDA tensor's storage) registers as such with ``location="*"`` (the default)
  or ``"cuda:N"``; transfers between it and the peer's memory, GPU or host, then go through the
  engine's GPU paths (docs/gpu.md).
* Every transfer must lie inside one registered region on each side (the local buffer in one
  registered here: ``register_memory`` or ``allocate_managed_buffer``); anything else fails with
  a negative code before a byte moves, never a crash.
"""

import enum
import logging

import torch  # noqa: F401  (the extension links against torch)

from . import _C
from ._compat import apply_rdma_devices

_log = logging.getLogger("mooncake.engine")

# Compile-time features of upstream's builds; none of them is in this one.
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False

InnerTransferEngine = _C.InnerTransferEngine


class TransferOpcode(enum.IntEnum):
    """Upstream's opcode enum (``Read`` = 0, ``Write`` = 1; ``READ``/``WRITE`` as in its docs)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` and ``msg`` (str), as sent with ``transfer_sync(..., notify=)``."""

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name,
                                                                              other.msg)


def _text(b):
    try:
        return b.decode()
    except UnicodeDecodeError:
        return b.decode("latin-1")


def _host_of(local_hostname):
    """The host part of upstream's local_hostname forms ("h", "h:port", "[v6]:port", "v6").
    In P2P mode upstream ignores the port (the engine picks its rpc port); so does this."""
    h = str(local_hostname).strip()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        return h.split(":")[0]
    return h


class TransferEngine:
    """Upstream Mooncake's TransferEngine (mooncake-integration/transfer_engine)."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._e = None

    # ---- set-up ----
    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine; 0 on success, -1 on failure (logged)."""
        return self._init(local_hostname, metadata_server, protocol, device_name)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name,
                       metadata_type):
        """``initialize`` with the metadata type given apart (only P2PHANDSHAKE is served)."""
        return self._init(local_hostname, metadata_server, protocol, device_name)

    def _init(self, local_hostname, metadata_server, protocol, device_name):
        if self._e is not None:
            _log.error("TransferEngine.initialize: already initialized (%s)", self._e.name)
            return -1
        if str(metadata_server) != "P2PHANDSHAKE":
            _log.error("TransferEngine.initialize: metadata server %r is not supported; this "
                       "engine finds peers by \"host:port\" alone (pass \"P2PHANDSHAKE\")",
                       metadata_server)
            return -1
        proto = str(protocol or "tcp").lower()
        if proto not in ("tcp", "rdma"):
            _log.error("TransferEngine.initialize: protocol %r is not supported (tcp, rdma)",
                       protocol)
            return -1
        if device_name:
            apply_rdma_devices(device_name, "TransferEngine.initialize(device_name)", _log)
        host = _host_of(local_hostname)
        if not host:
            _log.error("TransferEngine.initialize: empty local_hostname")
            return -1
        try:
            self._e = _C.P2pEngine(host)
        except (RuntimeError, ValueError) as e:
            _log.error("TransferEngine.initialize(%r) failed: %s", local_hostname, e)
            return -1
        return 0

    def _ok(self, what):
        if self._e is None:
            _log.error("TransferEngine.%s: not initialized", what)
            return False
        return True

    def _ret(self, what, r):
        code, why = r
        if why:
            _log.warning("TransferEngine.%s: %s", what, why)
        return code

    def get_rpc_port(self):
        """The port of this engine's tcp listener: peers name it "host:port"."""
        return self._e.rpc_port if self._e is not None else -1

    def get_session_id(self):
        """This engine's own session id ("host:port"); not in upstream's binding."""
        return self._e.name if self._e is not None else ""

    def get_engine(self):
        """The engine handle (``InnerTransferEngine``) to share with the store or a pg."""
        if not self._ok("get_engine"):
            return None
        return self._e.handle()

    def get_engine_ptr(self):
        """The address of the C++ engine (an int); 0 when not initialized."""
        return self._e.engine_ptr() if self._e is not None else 0

    # ---- memory ----
    def allocate_managed_buffer(self, length):
        """Registered, shared-memory backed memory of ``length`` bytes; its address, 0 on
        failure."""
        if not self._ok("allocate_managed_buffer") or int(length) <= 0:
            return 0
        return self._e.allocate(int(length))

    def free_managed_buffer(self, buffer_addr, length):
        if not self._ok("free_managed_buffer"):
            return -1
        return self._ret("free_managed_buffer", self._e.free(int(buffer_addr)))

    def register_memory(self, buffer_addr, capacity, location="*"):
        """0; -1 for a zero or unmapped range, -7 when it overlaps a registered one.
        ``location``: ``"*"`` finds out where the memory lives (GPU memory, e.g. a CUDA
        tensor's storage, registers as such), ``"cpu[:N]"`` host, ``"cuda[:N]"`` GPU N."""
        if not self._ok("register_memory"):
            return -1
        return self._ret("register_memory", self._e.register_memory(
            int(buffer_addr), int(capacity), str(location)))

    def unregister_memory(self, buffer_addr):
        """0; -3 when no region starts at that address."""
        if not self._ok("unregister_memory"):
            return -1
        return self._ret("unregister_memory", self._e.unregister_memory(int(buffer_addr)))

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """All or nothing: on failure none of them stays registered."""
        if not self._ok("batch_register_memory"):
            return -1
        return self._ret("batch_register_memory", self._e.batch_register(
            [int(a) for a in buffer_addresses], [int(c) for c in capacities], str(location)))

    def batch_unregister_memory(self, buffer_addresses):
        if not self._ok("batch_unregister_memory"):
            return -1
        return self._ret("batch_unregister_memory",
                         self._e.batch_unregister([int(a) for a in buffer_addresses]))

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        """Copies ``length`` bytes of ``src_ptr`` (bytes) into registered memory; 0 / -1."""
        if not self._ok("write_bytes_to_buffer"):
            return -1
        return self._ret("write_bytes_to_buffer",
                         self._e.write_bytes(int(dest_address), bytes(src_ptr), int(length)))

    def read_bytes_from_buffer(self, source_address, length):
        """``length`` bytes of registered memory (ValueError outside it)."""
        if not self._ok("read_bytes_from_buffer"):
            return b""
        return self._e.read_bytes(int(source_address), int(length))

    # ---- transfers ----
    def _lists(self, buffers, peer_buffer_addresses, lengths):
        return ([int(b) for b in buffers], [int(p) for p in peer_buffer_addresses],
                [int(n) for n in lengths])

    def _sync(self, what, target, op, bufs, peers, lens, notify=None):
        if not self._ok(what):
            return -1
        rc = self._ret(what, self._e.transfer(str(target), int(op), *self._lists(bufs, peers,
                                                                                  lens)))
        if rc == 0 and notify is not None:
            rc = self._ret(what, self._e.notify(str(target), str(notify.name),
                                                str(notify.msg)))
        return rc

    def _async(self, what, target, op, bufs, peers, lens):
        if not self._ok(what):
            return 0
        return self._ret(what, self._e.submit(str(target), int(op),
                                              *self._lists(bufs, peers, lens)))

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length,
                            transport_hint=""):
        return self._sync("transfer_sync_write", target_hostname, Write, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length,
                           transport_hint=""):
        return self._sync("transfer_sync_read", target_hostname, Read, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        """One transfer; with ``notify`` (a TransferNotify) the peer receives it after the
        data landed, before this returns 0."""
        return self._sync("transfer_sync", target_hostname, opcode, [buffer],
                          [peer_buffer_address], [length], notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        return self._sync("batch_transfer_sync_write", target_hostname, Write, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint=""):
        return self._sync("batch_transfer_sync_read", target_hostname, Read, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint=""):
        return self._sync("batch_transfer_sync", target_hostname, opcode, buffers,
                          peer_buffer_addresses, lengths, notify)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths, transport_hint=""):
        """The batch id (for get_batch_transfer_status), 0 on failure."""
        return self._async("batch_transfer_async_write", target_hostname, Write, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        return self._async("batch_transfer_async_read", target_hostname, Read, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint=""):
        return self._async("batch_transfer_async", target_hostname, opcode, buffers,
                           peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint=""):
        """The batch id (for transfer_check_status), 0 on failure."""
        return self._async("transfer_submit_write", target_hostname, Write, [buffer],
                           [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch: 0 when all completed, -1 when any failed or timed out."""
        if not self._ok("get_batch_transfer_status"):
            return -1
        return self._ret("get_batch_transfer_status",
                         self._e.wait_all([int(b) for b in batch_ids]))

    def transfer_check_status(self, batch_id):
        """1 completed, 0 in progress, -1 failed, -2 timed out (non-blocking)."""
        if not self._ok("transfer_check_status"):
            return -1
        return self._ret("transfer_check_status", self._e.check(int(batch_id)))

    # ---- peers and notifications ----
    def get_first_buffer_address(self, segment_name):
        """The lowest registered address of a session's engine (this one's own included);
        0 when it has none or cannot be reached."""
        if not self._ok("get_first_buffer_address"):
            return 0
        return self._ret("get_first_buffer_address",
                         self._e.first_buffer_address(str(segment_name)))

    def get_notifies(self):
        """The notifications received since the last call (each once), as TransferNotify."""
        if self._e is None:
            return []
        return [TransferNotify(_text(n), _text(m)) for n, m in self._e.drain_notifies()]

    def send_probe(self, peer_server_name):
        """0 when the peer's engine answers now (a fresh handshake with the job secret)."""
        if not self._ok("send_probe"):
            return -1
        return self._ret("send_probe", self._e.probe(str(peer_server_name)))

    def warmup_efa_segment(self, segment_name):
        """0: a no-op without EFA, as upstream's non-EFA builds."""
        return 0


__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "InnerTransferEngine",
           "Read", "Write"]
