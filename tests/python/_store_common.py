"""Shared helpers of the store tests: the mooncake_master binary and a holder process."""
import glob
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_bin():
    """The mooncake_master of the build the imported `mooncake` package comes from (build/
    on the host, build-torch2/ in scripts/test_torch2.sh's Debian 13 root: the two are
    linked against different distributions' libraries); else the newest build*/ one."""
    env = os.environ.get("MC_MASTER_BIN")
    if env:
        return env
    try:
        import mooncake._C as ext

        # <build>/python/mooncake/_C*.so (the .so is a file, the .py files are links)
        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__))))
        own = os.path.join(build, "store", "mooncake_master")
        if os.path.exists(own):
            return own
    except ImportError:
        pass
    cands = glob.glob(os.path.join(REPO, "build*", "store", "mooncake_master"))
    cands.sort(key=os.path.getmtime, reverse=True)
    return cands[0] if cands else None


class Master:
    def __init__(self, *extra):
        self.port = free_port()
        self.proc = subprocess.Popen([master_bin(), "--host", "127.0.0.1", "--port",
                                      str(self.port), "--metrics-port", "0", *extra],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "ready" in line, line
        self.addr = f"127.0.0.1:{self.port}"

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


HOLDER = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("holder", "", int(sys.argv[2]), 0, "tcp", "", sys.argv[1]) == 0
print("ready", s.get_hostname(), flush=True)
sys.stdin.read()
s.close()
"""


class Holder:
    """A process that lends memory to the store until closed (or killed)."""

    def __init__(self, addr, segment=64 << 20):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, addr, str(segment)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), line
        self.name = line.split()[1]

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)
