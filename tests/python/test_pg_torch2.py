"""The torch 2.x forms of the c10d API on the mooncake backend (cases in pg_cases_torch2.py).
They run on every torch; a case whose API this torch lacks is skipped with the reason (on
Debian 12's 1.13 most are: scripts/test_torch2.sh runs them against Debian 13's 2.6)."""

import pytest


def run(pool, name, **kwargs):
    results = pool.run(name, **kwargs)
    skips = [r["skip"] for r in results if isinstance(r, dict) and "skip" in r]
    if skips:
        pytest.skip(skips[0])
    bad = [f"rank {r}: {f}" for r, fails in enumerate(results) for f in fails]
    assert not bad, f"{len(bad)} failures in {name}:\n" + "\n".join(bad[:60])


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"w{w}")
def test_registered_for_served_devices(pool, world):
    run(pool, "registration")


@pytest.mark.parametrize("world", [3, 4], ids=lambda w: f"w{w}")
def test_p2p_by_group_rank(pool, world):
    run(pool, "p2p_group_ranks")


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"w{w}")
def test_coalescing_manager(pool, world):
    run(pool, "coalescing")


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_functional_collectives(pool, world):
    run(pool, "functional")


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"w{w}")
def test_work_and_futures(pool, world):
    run(pool, "work")


@pytest.mark.parametrize("world", [3, 4], ids=lambda w: f"w{w}")
def test_object_collectives_in_subgroup(pool, world):
    run(pool, "objects_in_subgroup")


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"w{w}")
def test_subgroup_helpers(pool, world):
    run(pool, "subgroup_helpers")


@pytest.mark.parametrize("world", [2], ids=lambda w: f"w{w}")
def test_monitored_barrier_refused(pool, world):
    run(pool, "monitored_barrier")
