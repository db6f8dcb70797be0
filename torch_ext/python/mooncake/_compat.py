"""Everything the Python package does differently per torch version (the C++ twin is
torch_ext/csrc/compat.h). Built and tested against torch 1.13 (Debian 12) and 2.6 (Debian 13,
scripts/test_torch2.sh); torch 2.11 wheels are what GPU hosts run.

- registration: torch >= 2.1 registers a backend for the device types it serves;
- libuv: torch >= 2.4's TCPStore asks for libuv unless told otherwise, and a torch built
  without libuv (Debian 13's python3-torch 2.6) then fails with a bare "use_libuv was
  requested but PyTorch was build without libuv support". init_process_group's env:// and
  tcp:// stores listen to USE_LIBUV=0 (or ``use_libuv=0`` in the URL), torchrun's stores
  listen to nothing. So USE_LIBUV=0 is made to hold for every TCPStore of a process that
  imports mooncake (honour_use_libuv_0), mooncake.run sets it for the launcher and the
  ranks, and a rank's rendezvous that fails for want of it says so;
- torchrun: Debian's torch 1.13 on Python 3.11 cannot parse its own default ``--redirects
  0`` / ``--tee 0``; ``python3 -m mooncake.run`` repairs the parser where it is broken.
"""

import functools
import importlib
import inspect
import os
import re
import sys

import torch
import torch.distributed as dist

TORCH_VERSION = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())

LIBUV_HINT = (
    "torch {version} was built without libuv, but its TCPStore (the rendezvous store of "
    "init_process_group and torchrun) uses libuv unless told otherwise. Set USE_LIBUV=0 in "
    "the environment of the launcher and of every rank (`python3 -m mooncake.run` sets it "
    "for you), or add use_libuv=0 to the init_method URL (env://?use_libuv=0, "
    "tcp://HOST:PORT?use_libuv=0). Debian 13's python3-torch 2.6 is such a build."
)


# ---- registration ----------------------------------------------------------------------
def register_backend(name, creator, devices):
    """Registers `creator` (extended API) under `name`, serving `devices` on torch >= 2.1."""
    kwargs = {"extended_api": True}
    if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
        kwargs["devices"] = list(devices)
    dist.Backend.register_backend(name, creator, **kwargs)


# ---- libuv -------------------------------------------------------------------------------
def _is_libuv_error(exc):
    return "libuv" in str(exc)


@functools.lru_cache(maxsize=None)
def libuv_missing():
    """True when this torch's TCPStore wants libuv by default but was built without it.

    torch exposes no flag for it, so ask a TCPStore: one that asks for libuv fails at once
    on such a build; elsewhere it listens on an ephemeral loopback port for a moment."""
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, use_libuv=True)
    except TypeError:
        return False  # torch < 2.4: no use_libuv argument, no libuv store
    except RuntimeError as e:
        return _is_libuv_error(e)
    del store
    return False


def set_launcher_env(environ=None):
    """USE_LIBUV=0 where this torch needs it and the caller has not chosen (launchers, demo).
    Returns the value set, or None."""
    environ = os.environ if environ is None else environ
    if "USE_LIBUV" in environ or not libuv_missing():
        return None
    environ["USE_LIBUV"] = "0"
    return "0"


def honour_use_libuv_0():
    """With USE_LIBUV=0 on a torch built without libuv, makes this process's TCPStores that
    are created without use_libuv= not ask for libuv. Returns True when it did.

    torch 2.6 reads USE_LIBUV only where init_process_group creates the store itself; the
    stores of torchrun's rendezvous (static and c10d, in the launcher) and the one a rank
    under torchrun opens to the launcher's store are created without use_libuv, and the
    binding's default is True whatever USE_LIBUV says, so on Debian 13's torch plain torchrun
    fails before any rank starts and a rank under it fails in init_process_group. Here
    TCPStore becomes a subclass whose default is False, in torch.distributed and in every
    torch.distributed module that imported the name already (later imports take it from
    torch.distributed). Called by mooncake.run (after set_launcher_env) and on import."""
    if os.environ.get("USE_LIBUV") != "0" or not libuv_missing():
        return False
    base = dist.TCPStore
    if getattr(base, "_mooncake_no_libuv", False):
        return True

    class TCPStore(base):
        _mooncake_no_libuv = True
        __doc__ = base.__doc__

        def __init__(self, *args, **kwargs):
            if len(args) < 9 and "use_libuv" not in kwargs:  # use_libuv is the 9th parameter
                kwargs["use_libuv"] = False
            super().__init__(*args, **kwargs)

    TCPStore.__module__ = base.__module__
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(mod, "TCPStore", None) is base:
            mod.TCPStore = TCPStore
    return True


def _explain_libuv(handler):
    """Wraps a rendezvous handler (a generator function) so that a TCPStore libuv failure
    raises the same exception type with LIBUV_HINT in front of torch's own message."""

    @functools.wraps(handler)
    def wrapped(*args, **kwargs):
        it = handler(*args, **kwargs)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if not _is_libuv_error(e):
                    raise
                msg = LIBUV_HINT.format(version=torch.__version__) + f" (torch said: {e})"
                try:
                    err = type(e)(msg)
                except Exception:  # noqa: BLE001  (an exception type that takes other args)
                    err = RuntimeError(msg)
                raise err from e
            yield item

    wrapped._mooncake_libuv_hint = True
    return wrapped


def install_libuv_hint():
    """Makes init_process_group's env:// and tcp:// rendezvous explain a libuv failure
    (torch >= 2.4 only; idempotent). torchrun's own store is created in the launcher,
    before any user code runs: there USE_LIBUV=0 (or mooncake.run) is the only fix."""
    if TORCH_VERSION < (2, 4):
        return
    # (torch.distributed.rendezvous is also the name of a function in torch.distributed)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):
        return
    for scheme in ("env", "tcp"):
        h = handlers.get(scheme)
        if h is not None and not getattr(h, "_mooncake_libuv_hint", False):
            handlers[scheme] = _explain_libuv(h)


# ---- torchrun ----------------------------------------------------------------------------
def fix_torchrun_std_parsing():
    """Makes torchrun's Std.from_str handle every value torchrun documents; a no-op (False)
    where it works (every torch but Debian's 1.13 on Python 3.11, where Python 3.11 stopped
    iterating the zero-valued member of an IntFlag, so Std.from_str("0") returns None)."""
    from torch.distributed.elastic.multiprocessing import api

    try:
        if api.Std.from_str("0") is not None and api.Std.from_str("3") is not None:
            return False
    except Exception:  # noqa: BLE001  (an unexpected torch: leave it alone)
        return False

    def from_str(vm):
        if re.match(api._VALUE_REGEX, vm):
            return api.Std(int(vm))
        if re.match(api._MAPPING_REGEX, vm):
            return {int(i): api.Std(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")

    api.Std.from_str = staticmethod(from_str)
    return True


def apply_rdma_devices(names, who, log):
    """Upstream's NIC lists (``device_name``, ``rdma_devices``, ``set_device_filter``) become
    ``MC_RDMA_DEVICES`` for the engines this process creates afterwards (the rdma transport
    reads it when an engine starts; an engine that already runs keeps its NICs). ``names``: a
    comma-separated string or a list of NIC names; empty leaves the setting alone. Only
    written here: the engine reads it through its parameter registry (docs/env.md)."""
    if isinstance(names, (list, tuple)):
        names = ",".join(str(n) for n in names)
    names = str(names or "").strip()
    if not names:
        return
    log.info("%s: MC_RDMA_DEVICES=%s for the engines created from now on", who, names)
    os.environ["MC_RDMA_DEVICES"] = names


def release_group(box):
    """Destroys the process group in the one-element list `box` (emptied) with the GIL
    released, where the list held its last reference. torch before pytorch PR 154976 (2.6
    among them) destroys a group from Python with the GIL held, and a gloo group can then
    deadlock with its own worker thread (it needs the GIL to free the last op's tensors)."""
    from . import _C
    _C._release_group(box)
