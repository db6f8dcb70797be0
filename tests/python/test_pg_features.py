"""Point-to-point, subgroups with non-contiguous ranks, async ops in flight, the group's phase
timers, object collectives, non-contiguous layouts and argument errors."""

import pytest


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"w{w}")
def test_p2p(pool, world):
    pool.check("p2p")


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"w{w}")
def test_p2p_to_self(pool, world):
    pool.check("p2p_self")


@pytest.mark.parametrize("world", [3, 4], ids=lambda w: f"w{w}")
def test_subgroups_non_contiguous_ranks(pool, world):
    pool.check("subgroups")


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_async_ops_in_flight(pool, world):
    pool.check("async")


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"w{w}")
def test_future_callbacks_issue_ops(pool, world):
    pool.check("callbacks")


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_phase_timers(pool, world):
    pool.check("profile")


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"w{w}")
def test_unwaited_ops_still_run(pool, world):
    pool.check("handoff")


@pytest.mark.parametrize("world", [1, 3, 4], ids=lambda w: f"w{w}")
def test_object_collectives(pool, world):
    pool.check("objects")


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"w{w}")
def test_non_contiguous_layouts(pool, world):
    pool.check("layouts")


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_wrong_use_raises_value_error(pool, world):
    pool.check("errors")
