"""Shared helpers of the store tests: the mooncake_master binary and a holder process."""
import glob
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The store tests run as one job with one secret, the way a deployment distributes its secret
# file: masters, clients in this process and the processes they start (which inherit the
# environment) read it from MC_SECRET_FILE. A file of the test's own, never ~/.mooncake.
_SECRET_DIR = tempfile.mkdtemp(prefix="mc_store_secret_")
SECRET_FILE = os.path.join(_SECRET_DIR, "secret")
with open(os.open(SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as _f:
    _f.write(secrets.token_hex(32) + "\n")
os.environ["MC_SECRET_FILE"] = SECRET_FILE
os.environ.pop("MC_SECRET", None)


from harness import free_port  # noqa: E402,F401  (below the ephemeral range)


def stop_process(pid, timeout=5):
    """SIGSTOP pid and wait until every thread of it has stopped: the kernel stops the other
    threads only once one of them took the signal, and until then they may still serve requests
    (a test that then expects no answer would race)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that just ended
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop")


def master_bin():
    """The mooncake_master that goes with the imported `mooncake` package: the one bundled in
    the installed package, else that of the build tree it is imported from (build/ on the
    host, build-torch2/ in scripts/test_torch2.sh's Debian 13 root: the two are linked against
    different distributions' libraries); else the newest build*/ one."""
    env = os.environ.get("MC_MASTER_BIN")
    if env:
        return env
    try:
        import mooncake._C as ext

        # An installed package (pip install, scripts/install_python.sh) carries the master it
        # was built with beside _C; that one matches the imported extension's distribution.
        bundled = os.path.join(os.path.dirname(os.path.abspath(ext.__file__)), "mooncake_master")
        if os.path.exists(bundled):
            return bundled
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
    def __init__(self, *extra, env=None, preexec_fn=None, host_flag=True, port=None):
        """extra: more mooncake_master flags. env: extra environment. host_flag=False starts it
        without --host (its default, 127.0.0.1). port: the port (a master restarted where its
        clients look for it); default a free one."""
        self.port = port or free_port()
        host = "127.0.0.1"
        if "--host" in extra:
            host = extra[list(extra).index("--host") + 1]
            extra = [a for i, a in enumerate(extra)
                     if a != "--host" and (i == 0 or extra[i - 1] != "--host")]
        # A fresh master waits --rebuild-quiet-ms for clients that might report objects (after
        # a restart); tests start fresh masters: keep it short.
        cmd = [master_bin()] + (["--host", host] if host_flag else []) + [
            "--port", str(self.port), "--metrics-port", "0", "--rebuild-quiet-ms", "200",
            *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})), preexec_fn=preexec_fn)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        assert "ready" in line, line
        self.addr = f"{host}:{self.port}"

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


HOLDER = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("holder", "", int(sys.argv[2]), 0, sys.argv[3], "", sys.argv[1]) == 0
print("ready", s.get_hostname(), flush=True)
sys.stdin.read()
s.close()
"""


class Holder:
    """A process that lends memory to the store until closed (or killed)."""

    def __init__(self, addr, segment=64 << 20, protocol="tcp", env=None):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, addr, str(segment), protocol],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})))
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
