"""The package as users get it: importable from any directory after scripts/setup.sh, a
torchrun launch with backend "mooncake" (scripts/demo_torch.py, checked against gloo) by
torch's own launcher and by mooncake.run, re-initialisation, torch 2.x's "device:backend"
strings, and a torch without libuv (Debian 13's 2.6) explained rather than a bare error."""

import os
import subprocess

import pytest

from harness import PYTHON, REPO, child_env, free_port, here_path, run_torchrun, torch_version

pytestmark = pytest.mark.isolated


def test_import_from_any_directory():
    code = ("import mooncake, torch.distributed as d; "
            "assert 'MOONCAKE' in d.Backend._plugins and 'MOONCAKE-CPU' in d.Backend._plugins; "
            "print(mooncake.__file__)")
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=child_env(),
                       cwd="/")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("launcher", ["torch", "mooncake"])
def test_torchrun_demo(launcher):
    if launcher == "torch" and _libuv_missing():
        pytest.skip("a torch without libuv: plain torchrun's rendezvous store asks for libuv "
                    "whatever USE_LIBUV says, so it cannot start; mooncake.run is the launcher "
                    "there (test_torchrun_demo[mooncake])")
    r = run_torchrun(os.path.join(REPO, "scripts", "demo_torch.py"), nproc=2,
                     args=["--quick"], timeout_s=240, launcher=launcher)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert "all results match gloo" in r.stdout, r.stdout[-4000:]


def test_reinit_after_destroy_with_old_groups_alive():
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    ports = ",".join(map(str, ports))
    procs = [subprocess.Popen([PYTHON, here_path("_reinit_script.py"), str(r), ports],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env(), cwd="/") for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.count("ok") == 3, f"rank {r}:\n{out[-3000:]}"


def _run_ranks(world, init, backend, env=None, drop=()):
    procs = [subprocess.Popen([PYTHON, here_path("_init_script.py"), str(r), str(world), init,
                               backend], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(env, drop=drop), cwd="/")
             for r in range(world)]
    res = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        res.append((p.returncode, out, err[-3000:]))
    return res


def test_device_backend_string():
    if torch_version() < (2, 1):
        pytest.skip("'device:backend' strings pick a backend per device on torch >= 2.1")
    res = _run_ranks(2, f"tcp://127.0.0.1:{free_port()}", "cpu:mooncake")
    for r, (rc, out, err) in enumerate(res):
        assert rc == 0 and "ok" in out and "ProcessGroupMooncake" in out, \
            f"rank {r} rc={rc}\n{out}\n{err}"


def _libuv_missing():
    r = subprocess.run([PYTHON, "-c", "from mooncake import _compat; print(_compat.libuv_missing())"],
                       capture_output=True, text=True, env=child_env(), cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "True"


def test_torch_without_libuv_is_explained():
    if not _libuv_missing():
        pytest.skip("this torch has libuv, or no libuv TCPStore at all (torch < 2.4)")
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for init in ("env://", f"tcp://127.0.0.1:{free_port()}"):
        [(rc, out, err)] = _run_ranks(1, init, "mooncake", env=env, drop=("USE_LIBUV",))
        assert rc != 0, f"{init} without USE_LIBUV worked on a torch without libuv?\n{out}"
        assert "USE_LIBUV=0" in err and "built without libuv" in err, f"{init}:\n{err}"
    # What the message offers instead of USE_LIBUV=0 works too.
    [(rc, out, err)] = _run_ranks(1, f"tcp://127.0.0.1:{free_port()}?use_libuv=0", "mooncake",
                                  drop=("USE_LIBUV",))
    assert rc == 0 and "ok" in out, f"rc={rc}\n{out}\n{err}"
