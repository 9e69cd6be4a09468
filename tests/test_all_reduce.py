"""all_reduce between real processes over loopback, against a numpy reference."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "float16"]
SIZES = [0, 1, 7, 1000, 70_001]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_every_op_dtype_and_size(arendez_server, world_size):
    url = f"{arendez_server.url}/allreduce{world_size}"
    counts = run_ranks("all_reduce_matrix", world_size, url, DTYPES, SIZES, OPS, timeout=110)
    assert counts[0] > 100
    assert len(set(counts)) == 1
