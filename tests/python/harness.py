"""Multi-process harness for the process-group tests.

A Pool starts W worker processes (/usr/bin/python3 _pg_worker.py) that each initialise the
default group with backend "mooncake" and a gloo group over the same ranks, then run cases
(functions ``case_<name>(ctx, **kwargs)`` of pg_cases*.py) sent to all of them over a
multiprocessing connection. Workers are reused across cases so the suite stays fast; a
pool whose workers died or hung is killed and replaced on next use.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# The interpreter running the tests (scripts/test.sh: /usr/bin/python3, Debian's, with torch;
# in scripts/test_torch2.sh's root, that root's), so a venv with its own mooncake.pth can
# test a build without touching the system's.
PYTHON = sys.executable
WORKER = os.path.join(HERE, "_pg_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra=None, drop=()):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # mooncake must come from the installed .pth
    for k in drop:
        env.pop(k, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


_torch_version = None


def torch_version():
    """(major, minor) of the torch PYTHON imports."""
    global _torch_version
    if _torch_version is None:
        out = subprocess.run([PYTHON, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True, env=child_env(),
                             cwd="/").stdout
        _torch_version = tuple(int(x) for x in out.strip().split("+")[0].split(".")[:2])
    return _torch_version


class PoolError(AssertionError):
    pass


class Pool:
    def __init__(self, world, timeout_s=120, start_timeout_s=90, env=None, gloo=True,
                 rank_env=None):
        """rank_env: rank -> dict of extra environment for that rank (after env)."""
        self.world = world
        self.broken = False
        self.logs = []
        self.procs = []
        key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        ctl_port = self.listener.address[1]
        master_port = free_port()
        for r in range(world):
            log = tempfile.NamedTemporaryFile(
                prefix=f"mc_w{world}_r{r}_", suffix=".log", delete=False)
            self.logs.append(log.name)
            cmd = [PYTHON, "-u", WORKER, "--ctl-port", str(ctl_port), "--authkey", key.hex(),
                   "--rank", str(r), "--world", str(world), "--master-port", str(master_port),
                   "--timeout-s", str(timeout_s)] + ([] if gloo else ["--no-gloo"])
            renv = dict(env or {}, **(rank_env(r) if rank_env else {}))
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env=child_env(renv), cwd="/"))
            log.close()
        self.conns = [None] * world
        self._accept(start_timeout_s)

    # -- start-up -------------------------------------------------------------------
    def _accept(self, timeout_s):
        got = []

        def acceptor():
            try:
                for _ in range(self.world):
                    got.append(self.listener.accept())
            except OSError:
                pass

        th = threading.Thread(target=acceptor, daemon=True)
        th.start()
        th.join(timeout_s)
        if len(got) < self.world:
            self.kill()
            raise PoolError(f"only {len(got)}/{self.world} workers connected\n{self.tails()}")
        for c in got:
            kind, rank, _pid = c.recv()
            assert kind == "hello"
            self.conns[rank] = c
        deadline = time.time() + timeout_s
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.time())):
                self.kill()
                raise PoolError(f"rank {r} did not finish init_process_group\n{self.tails()}")
            msg = c.recv()
            if msg[0] != "ready":
                self.kill()
                raise PoolError(f"rank {r} failed to initialise:\n{msg[1]}\n{self.tails()}")

    # -- running cases -----------------------------------------------------------------
    def start(self, name, ranks=None, **kwargs):
        """Sends case `name` to `ranks` (default all) without waiting."""
        for r in (range(self.world) if ranks is None else ranks):
            self.conns[r].send(("run", name, kwargs))

    def collect(self, ranks=None, timeout_s=240):
        """Results of the last case per rank; raises PoolError on errors or timeouts."""
        ranks = list(range(self.world) if ranks is None else ranks)
        pending = {self.conns[r]: r for r in ranks}
        results, errors = {}, {}
        deadline = time.time() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.time()))
            if not ready:
                self.broken = True
                missing = sorted(pending.values())
                self.dump_stacks(missing)
                self.kill()
                raise PoolError(f"ranks {missing} did not answer within {timeout_s}s\n"
                                f"{self.tails(8000)}")
            for c in ready:
                r = pending.pop(c)
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    self.broken = True
                    errors[r] = f"worker died (exit {self.procs[r].poll()})"
                    continue
                if kind == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise PoolError(f"case failed on ranks {sorted(errors)}:\n{text}")
        return [results[r] for r in ranks]

    def run(self, name, timeout_s=240, **kwargs):
        self.start(name, **kwargs)
        return self.collect(timeout_s=timeout_s)

    def check(self, name, timeout_s=240, **kwargs):
        """Runs a case whose per-rank result is a list of failure strings; asserts none."""
        results = self.run(name, timeout_s=timeout_s, **kwargs)
        bad = [f"rank {r}: {f}" for r, fails in enumerate(results) for f in fails]
        if bad:
            shown = "\n".join(bad[:60])
            more = f"\n... and {len(bad) - 60} more" if len(bad) > 60 else ""
            raise AssertionError(f"{len(bad)} mismatches in {name}:\n{shown}{more}")
        return results

    # -- teardown --------------------------------------------------------------------
    def close(self, timeout_s=20):
        """Asks workers to exit cleanly; returns their exit codes (None = had to kill)."""
        codes = []
        for c in self.conns:
            try:
                if c is not None:
                    c.send(("exit", None, None))
            except OSError:
                pass
        deadline = time.time() + timeout_s
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def dump_stacks(self, ranks):
        """Python stacks of `ranks` into their logs (the workers register SIGUSR1)."""
        for r in ranks:
            try:
                self.procs[r].send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for c in self.conns:
            try:
                if c is not None:
                    c.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass

    def tails(self, n=3000):
        out = []
        for r, path in enumerate(self.logs):
            try:
                with open(path, errors="replace") as f:
                    text = f.read()[-n:]
            except OSError:
                text = "<no log>"
            out.append(f"--- log of rank {r} (exit {self.procs[r].poll()}) ---\n{text}")
        return "\n".join(out)


def run_torchrun(script, nproc=2, args=(), timeout_s=180, env=None, launcher="torch"):
    """Runs `script` under torchrun; returns the CompletedProcess.

    launcher "torch": /usr/bin/python3 -m torch.distributed.run, plain on torch 2.x; on 1.13
    with --redirects 1 --tee 1 (Debian's 1.13 on Python 3.11 crashes parsing the default
    "0"; see mooncake/_compat.py). The environment keeps the USE_LIBUV=0 that conftest sets
    for a torch without libuv, as the README tells users of plain torchrun to do.
    "mooncake": /usr/bin/python3 -m mooncake.run with plain flags and USE_LIBUV unset: the
    launcher has to fix both by itself."""
    if launcher == "torch":
        head = [PYTHON, "-m", "torch.distributed.run"]
        if torch_version() < (2, 0):
            head += ["--redirects", "1", "--tee", "1"]
        drop = ()
    else:
        head = [PYTHON, "-m", "mooncake.run"]
        drop = ("USE_LIBUV",)
    cmd = head + ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                  "--master_port", str(free_port()), script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env=child_env(env, drop=drop), cwd="/")


def here_path(*parts):
    return os.path.join(HERE, *parts)


if __name__ == "__main__":  # manual smoke run: python3 harness.py 2
    w = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    p = Pool(w)
    print(p.run("ping"))
    print("exit codes", p.close())
