"""The package as users get it: importable from any directory after scripts/setup.sh, and a
torchrun launch with backend "mooncake" (scripts/demo_torch.py, checked against gloo)."""

import os
import subprocess

import pytest

from harness import PYTHON, REPO, child_env, free_port, here_path, run_torchrun

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
