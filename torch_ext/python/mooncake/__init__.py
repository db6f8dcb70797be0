"""mooncake: one transfer engine for collectives, expert dispatch and KV offload.

``import mooncake`` registers the torch.distributed backend "mooncake" (alias
"mooncake-cpu")::

    import torch.distributed as dist
    import mooncake
    dist.init_process_group(backend="mooncake")
"""

# torch first: the extension derives from classes that torch's own module binds.
import torch  # noqa: F401
import torch.distributed  # noqa: F401

from . import _C  # noqa: F401
from . import _compat
from . import pg  # noqa: F401
from .pg import BACKEND_NAME, Options, ProcessGroupMooncake  # noqa: F401

pg.register()
_compat.install_libuv_hint()
_compat.honour_use_libuv_0()

__all__ = ["BACKEND_NAME", "Options", "ProcessGroupMooncake", "pg"]
