"""The torch backend on tensors in GPU memory, over the engine's device layer simulation
(MC_DEVICE=sim; pg_cases_gpu.py says how): every collective and send/recv on GPU tensors gives
the same bytes as on host tensors, at 2 and 3 ranks on one host and at 4 ranks over two
simulated hosts (hierarchical, tcp between them); async ops; a non-contiguous GPU tensor is
refused with a clear error. Real CUDA tensors need a CUDA build of torch and a GPU
(scripts/gpu_check.sh)."""

import pytest

from harness import Pool

pytestmark = pytest.mark.isolated

SIZES = [0, 1, 1000, 2**18 + 3]


def run_all(p, sizes, dtypes_red, dtypes_copy):
    p.check("gpu_reductions", sizes=sizes, dtypes=dtypes_red, ops=("SUM", "MAX", "AVG"))
    p.check("gpu_reductions", sizes=[7], dtypes=("int64", "uint8"), ops=("SUM", "BXOR", "MIN"))
    p.check("gpu_copies", sizes=sizes, dtypes=dtypes_copy)
    p.check("gpu_async")
    p.check("gpu_coalesced")
    p.check("gpu_errors")


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_on_gpu_tensors_one_host(world):
    p = Pool(world, timeout_s=120, env={"MC_DEVICE": "sim"}, gloo=False)
    try:
        run_all(p, SIZES, ("float32", "bfloat16"), ("float32", "int8"))
    finally:
        p.close()


def test_every_op_on_gpu_tensors_two_hosts():
    p = Pool(4, timeout_s=120, env={"MC_DEVICE": "sim"}, gloo=False,
             rank_env=lambda r: {"MC_HOST_ID": f"host-{r // 2}"})
    try:
        run_all(p, [0, 1000, 2**17 + 1], ("float32",), ("float16",))
    finally:
        p.close()
