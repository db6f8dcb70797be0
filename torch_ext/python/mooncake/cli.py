"""``mooncake_master``: the console script that runs the store master shipped in the package.

The wheel carries the C++ binary as ``mooncake/mooncake_master`` (as upstream Mooncake's wheel
does); this replaces the Python process with it, so signals and the exit status are the
binary's own. Usage and flags: ``mooncake_master --help`` and docs/store.md.
"""

import os
import sys


def master_path():
    """Path of the mooncake_master binary installed with this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "mooncake_master")


def main(argv=None):
    path = master_path()
    if not os.access(path, os.X_OK):
        sys.exit(f"mooncake_master: {path} is missing or not executable; reinstall the package "
                 "(pip install .) or run the build tree's build/store/mooncake_master")
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    os.execv(path, [path] + args)


if __name__ == "__main__":
    main()
