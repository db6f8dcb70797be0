"""``python3 -m mooncake.run ...``: torchrun (torch.distributed.run) with the same arguments,
made to work with the torch builds Debian ships (see mooncake._compat):

- torch 1.13 on Python 3.11 cannot parse torchrun's own default ``--redirects 0`` /
  ``--tee 0``: the parser is repaired (plain torchrun works there only with ``--redirects 1
  --tee 1``);
- torch 2.6 without libuv (Debian 13): plain torchrun cannot start there at all (its
  rendezvous store asks for libuv whatever USE_LIBUV says); USE_LIBUV=0 is set (unless the
  environment says otherwise) and made to hold for the launcher's stores, and for the
  ranks' when they import mooncake.

On a torch 2.x with libuv (pip wheels) this is plain torchrun; use torchrun itself there.
"""

import sys

from . import _compat


def main(argv=None):
    _compat.fix_torchrun_std_parsing()
    _compat.set_launcher_env()
    _compat.honour_use_libuv_0()
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
