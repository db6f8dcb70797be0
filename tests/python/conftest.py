"""pytest set-up for the process-group tests: one worker pool per world size, reused across
tests (tests are reordered so that each world size's tests run together and only one pool
is alive at a time)."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import PYTHON, Pool, child_env  # noqa: E402

_pools = {}


def _mooncake_importable():
    r = subprocess.run([PYTHON, "-c", "import mooncake"], capture_output=True, text=True,
                       env=child_env(), cwd="/")
    return r.returncode == 0, r.stderr[-2000:]


def pytest_collection_modifyitems(session, config, items):
    def world_of(item):
        cs = getattr(item, "callspec", None)
        return cs.params.get("world", 0) if cs is not None else 0

    # Stable: keeps file order inside one world size.
    items.sort(key=lambda it: (it.get_closest_marker("isolated") is not None, world_of(it)))


def pytest_configure(config):
    config.addinivalue_line("markers", "isolated: starts its own processes (no shared pool)")


def _use_libuv_0_if_needed():
    """A torch built without libuv (Debian 13's 2.6) needs USE_LIBUV=0 for the TCPStore of
    every rank's rendezvous: set it for every process the tests start, as mooncake.run does
    for torchrun jobs (the tests that check the unset case remove it themselves)."""
    if "USE_LIBUV" in os.environ:
        return
    r = subprocess.run([PYTHON, "-c", "from mooncake import _compat; print(_compat.libuv_missing())"],
                       capture_output=True, text=True, env=child_env(), cwd="/")
    if r.returncode == 0 and r.stdout.strip() == "True":
        os.environ["USE_LIBUV"] = "0"


@pytest.fixture(scope="session", autouse=True)
def _require_mooncake():
    ok, err = _mooncake_importable()
    if not ok:
        pytest.exit(f"`{PYTHON} -c 'import mooncake'` fails; run scripts/setup.sh "
                    "(or scripts/install_python.sh [--python PY] BUILD_DIR):\n" + err,
                    returncode=2)
    _use_libuv_0_if_needed()
    yield
    for w in list(_pools):
        _pools.pop(w).close()


def get_pool(world):
    p = _pools.get(world)
    if p is not None and not p.broken:
        return p
    for w in list(_pools):
        _pools.pop(w).close()
    _pools[world] = Pool(world)
    return _pools[world]


@pytest.fixture
def pool(world):
    return get_pool(world)
