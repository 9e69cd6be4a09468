"""all_reduce between real processes over loopback, against a numpy reference."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.jobs import collectives as collectives_jobs

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "float16"]
SIZES = [0, 1, 7, 1000, 70_001]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_every_op_dtype_and_size(arendez_server, world_size):
    url = f"{arendez_server.url}/allreduce{world_size}"
    counts = run_ranks(collectives_jobs.all_reduce_matrix, world_size, url, DTYPES, SIZES, OPS, timeout=110)
    # every op that applies: the 3 float dtypes take SUM, PRODUCT, MIN, MAX, AVG (5); the 3
    # integer dtypes SUM, PRODUCT, MIN, MAX and the bitwise three (7) - per size
    assert counts == [(3 * 5 + 3 * 7) * len(SIZES)] * world_size


@pytest.mark.timeout(60)
def test_a_float_reduction_that_overflows_is_inf_without_a_warning(arendez_server):
    # gloo's and MPI's sums overflow to inf silently; numpy's ufuncs would warn (or raise, under
    # the rank's own np.seterr) from inside the library, on some ranks and not others
    sizes = [3, 70_001]
    seen = run_ranks(
        collectives_jobs.overflowing_reductions, 2, f"{arendez_server.url}/overflow", sizes, timeout=50
    )
    cases = [
        f"{d} {n} {op} True"
        for d in ("float16", "float32", "complex64")
        for n in sizes
        for op in ("SUM", "PRODUCT", "AVG")
    ]
    assert seen == [[*cases, "over=raise"]] * 2
