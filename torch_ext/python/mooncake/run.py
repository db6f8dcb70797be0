"""``python3 -m mooncake.run ...``: torchrun (torch.distributed.run) with the same arguments.

Debian's torch 1.13 under Python 3.11 cannot parse torchrun's own default ``--redirects 0``
/ ``--tee 0`` (Python 3.11 stopped iterating the zero-valued member of an IntFlag, so
``Std.from_str("0")`` returns None and the launcher crashes in ``to_map``). Plain torchrun
works there only with ``--redirects 1 --tee 1``. This wrapper fixes the parser when (and
only when) it is broken, then runs torchrun unchanged.
"""

import re
import sys


def fix_std_parsing():
    """Makes Std.from_str handle every value torchrun documents; a no-op where it works."""
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


def main(argv=None):
    fix_std_parsing()
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
