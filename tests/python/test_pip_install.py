"""`pip install .` into a fresh venv, offline, then a 2-rank job run from that venv, the console
scripts, scripts/install_python.sh's up-to-date check, and `pip uninstall` removing it all.

The venv is made with --system-site-packages (it sees Debian's torch and pip) and without
pip of its own; `--no-index` proves that nothing is downloaded. The install reuses this
checkout's CMake build directory (-C build-dir=...), so the C++ is not compiled again: the
backend only checks that the build is current and writes the wheel.
"""
import glob
import os
import secrets
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _build_dir():
    """The newest configured build directory of this checkout that has the extension for this
    interpreter (build/ is Debian 12's Python 3.11, build-torch2/ Debian 13's 3.13)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cands = [d for d in glob.glob(os.path.join(REPO, "build*"))
             if os.path.isfile(os.path.join(d, "CMakeCache.txt"))
             and os.path.isfile(os.path.join(d, "python", "mooncake", "_C" + suffix))
             and os.path.isfile(os.path.join(d, "store", "mooncake_master"))]
    cands.sort(key=lambda d: os.path.getmtime(os.path.join(d, "CMakeCache.txt")), reverse=True)
    return cands[0] if cands else None


BUILD = _build_dir()


def _no_deps():
    """Debian 13's torch 2.6 metadata pins sympy==1.13.1, Debian ships 1.13.3: pip cannot
    resolve torch's own requirements offline there, so the install takes --no-deps
    (docs/install.md). Debian 12's torch 1.13 resolves: the plain command is tested there."""
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, cwd="/")
    return ["--no-deps"] if r.stdout.strip().startswith("2.") else []
pytestmark = [pytest.mark.skipif(BUILD is None, reason="no built build directory"),
              pytest.mark.isolated]

JOB = r"""
import os, sys, torch, torch.distributed as dist
import mooncake
assert mooncake.__file__.startswith(sys.argv[1]), mooncake.__file__
dist.init_process_group("mooncake")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(r + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), float(w * (w + 1) // 2))), t[:4]
dist.barrier()
print(f"ok rank {r} of {w} from {os.path.dirname(mooncake.__file__)}", flush=True)
dist.destroy_process_group()
"""


def _env(**extra):
    env = dict(os.environ, **extra)
    env.pop("PYTHONPATH", None)  # only what the venv has installed
    return env


def _run(cmd, timeout=600, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/",
                          env=kw.pop("env", _env()), **kw)


def test_pip_install_venv_job_tools_uninstall(tmp_path):
    venv = str(tmp_path / "venv")
    py = os.path.join(venv, "bin", "python")
    r = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    assert r.returncode == 0, r.stderr
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    site = site.strip()
    assert site.startswith(venv)

    t0 = time.time()
    r = _run([py, "-m", "pip", "install", "--no-index", *_no_deps(), "--disable-pip-version-check",
              "--config-settings", f"build-dir={BUILD}", "--config-settings", "jobs=2", REPO],
             timeout=1200)
    took = time.time() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"pip install . into a venv, reusing {BUILD}: {took:.1f} s")

    # The venv's own copy is what `import mooncake` finds, from any directory.
    r = _run([py, "-c", "import mooncake, mooncake.store, mooncake.ep, mooncake.tools.hitrate; "
              "print(mooncake.__file__)"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == os.path.join(site, "mooncake", "__init__.py")
    record = _run([py, "-c", "import importlib.metadata as m; "
                   "print('\\n'.join(str(f) for f in m.files('mooncake')))"]).stdout.split()
    assert "mooncake/mooncake_master" in record
    assert any(f.startswith("mooncake/_C") and f.endswith(".so") for f in record)
    assert "mooncake/tools/kv_size.py" in record

    # Console scripts.
    bindir = os.path.join(venv, "bin")
    for name in ("mooncake_master", "mooncake_client", "mooncake-kv-size", "mooncake-hitrate"):
        assert os.access(os.path.join(bindir, name), os.X_OK), name
    r = _run([os.path.join(bindir, "mooncake_client"), "--version"])
    assert r.returncode == 0 and r.stdout.strip() == "mooncake_client 0.1.0", (r.stdout, r.stderr)
    r = _run([os.path.join(bindir, "mooncake-kv-size"), "--model", "llama-3-70b", "--json"])
    assert r.returncode == 0 and '"bytes_per_token": 327680' in r.stdout, r.stderr
    r = _run([os.path.join(bindir, "mooncake-hitrate"), "--help"])
    assert r.returncode == 0 and "--store" in r.stdout, r.stderr
    master = subprocess.Popen(
        [os.path.join(bindir, "mooncake_master"), "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0"], stdout=subprocess.PIPE, text=True,
        env=_env(MC_SECRET=secrets.token_hex(16)))
    try:
        line = master.stdout.readline()
        assert line.startswith("mooncake_master ready port="), line
    finally:
        master.terminate()
        assert master.wait(10) == 0

    # A 2-rank job launched from the venv (mooncake.run is torchrun), the venv's mooncake in
    # every rank.
    job = tmp_path / "job.py"
    job.write_text(JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run([py, "-m", "mooncake.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(port), str(job), os.path.join(site, "mooncake")],
             timeout=300, env=_env(OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok rank") == 2, r.stdout

    # scripts/install_python.sh (what scripts/setup.sh runs) sees that this install is the
    # build's: no reinstall, nothing printed.
    r = _run(["bash", os.path.join(REPO, "scripts", "install_python.sh"), "--python", py, BUILD],
             timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "", r.stdout

    # pip uninstall removes every file it installed, console scripts included.
    r = _run([py, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", "mooncake"])
    assert r.returncode == 0, r.stderr
    left = [p for p in os.listdir(site) if p.startswith("mooncake")]
    assert left == [], left
    left = [p for p in os.listdir(bindir) if p.startswith("mooncake")]
    assert left == [], left
    r = _run([py, "-c", "import mooncake, sys; sys.exit(0 if mooncake.__file__.startswith("
              f"{venv!r}) else 1)"])
    assert r.returncode != 0
