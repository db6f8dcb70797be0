"""Every collective x dtype x reduce op over sizes {0, 1, 7, 1000, 2^20+3} and world sizes
1-4, compared with a local reference and with the same call on a gloo group."""

import pytest

from pg_cases import OPS

WORLDS = [1, 2, 3, 4]
SMALL = [0, 1, 7, 1000]
BIG = 2**20 + 3
ALL_OPS = tuple(OPS)

pytestmark = pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")


def test_all_reduce(pool, world):
    pool.check("allreduce", sizes=SMALL)
    pool.check("allreduce", sizes=[BIG], dtypes=("float32",), ops=("SUM", "MAX", "AVG"))
    pool.check("allreduce", sizes=[BIG], dtypes=("bfloat16", "float16"), ops=("SUM",))
    pool.check("allreduce", sizes=[BIG], dtypes=("int64",), ops=("SUM", "BXOR"))


def test_all_reduce_coalesced(pool, world):
    pool.check("allreduce", sizes=[0, 7, 1000], coalesced=True)


def test_reduce(pool, world):
    pool.check("reduce", sizes=SMALL, ops=("SUM", "AVG", "PRODUCT", "MIN", "BXOR"))
    pool.check("reduce", sizes=SMALL, ops=("MAX", "BAND", "BOR"), roots=[world - 1])
    pool.check("reduce", sizes=[BIG], dtypes=("float32",), ops=("SUM",), roots=[world - 1])


def test_broadcast(pool, world):
    pool.check("broadcast", sizes=SMALL)
    pool.check("broadcast", sizes=[BIG], dtypes=("float32", "bfloat16"), roots=[world - 1])


@pytest.mark.parametrize("api", ["list", "tensor"])
def test_all_gather(pool, world, api):
    pool.check("all_gather", sizes=SMALL, api=api)
    pool.check("all_gather", sizes=[BIG], dtypes=("float32",), api=api)


def test_all_gather_coalesced(pool, world):
    pool.check("all_gather_coalesced", sizes=[0, 1, 1000])


def test_gather(pool, world):
    pool.check("gather", sizes=SMALL)
    pool.check("gather", sizes=[BIG], dtypes=("float32",), roots=[0])


def test_scatter(pool, world):
    pool.check("scatter", sizes=SMALL)
    pool.check("scatter", sizes=[BIG], dtypes=("float32",), roots=[world - 1])


@pytest.mark.parametrize("api", ["list", "tensor"])
def test_reduce_scatter(pool, world, api):
    pool.check("reduce_scatter", sizes=SMALL, api=api)
    pool.check("reduce_scatter", sizes=[BIG // world], dtypes=("float32", "bfloat16"),
               ops=("SUM",), api=api)


@pytest.mark.parametrize("uneven", [False, True])
def test_all_to_all_single(pool, world, uneven):
    pool.check("all_to_all_single", sizes=SMALL, uneven=uneven)
    pool.check("all_to_all_single", sizes=[BIG // (2 * world)], dtypes=("float32",),
               uneven=uneven)


def test_all_to_all(pool, world):
    pool.check("all_to_all", sizes=SMALL)
    pool.check("all_to_all", sizes=[BIG // world], dtypes=("float32",))


def test_barrier(pool, world):
    pool.check("barrier", times=20)
