"""One suite, three transports: in-process ranks, TCP between processes, TCP + shared memory.

The rank code (``tests/conformance.py``) is the same for all three; only the runner differs:
``arendez.testing.run_ranks`` for ``inproc``, real processes and a real server otherwise.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from arendez import testing
from tests import conformance
from tests.harness import run_function

Runner = Callable[..., list[Any]]


@pytest.fixture(params=["inproc", "tcp", "shm"])
def run(request: pytest.FixtureRequest) -> Runner:
    """``run(fn, world_size, *args)``: the ranks' results, over this transport."""
    if request.param == "inproc":

        def in_process(fn: Callable[..., Awaitable[Any]], world_size: int, *args: Any) -> list[Any]:
            async def rank(r: int) -> Any:
                return await fn(r, world_size, *args)

            return asyncio.run(testing.run_ranks(world_size, rank, timeout=40))

        return in_process
    server = request.getfixturevalue("arendez_server")
    env = {"ARENDEZ_SHM": "1" if request.param == "shm" else "0"}

    def processes(fn: Callable[..., Awaitable[Any]], world_size: int, *args: Any) -> list[Any]:
        url = f"{server.url}/{fn.__name__}-{uuid.uuid4().hex[:8]}"
        return run_function(fn, world_size, url, *args, env=env, timeout=50)

    return processes


@pytest.mark.timeout(60)
def test_every_collective(run: Runner) -> None:
    dtypes, sizes = ["float32", "int64"], [0, 7, 70_001]
    counts = run(conformance.every_collective, 3, dtypes, sizes)
    per_group = 16 * len(dtypes) * len(sizes)
    assert counts == [per_group, 2 * per_group, 2 * per_group]


@pytest.mark.timeout(60)
def test_destroy_drains_in_flight_and_cancels_the_rest(run: Runner) -> None:
    drain = 0.5
    r0, r1 = run(conformance.destroy_in_flight, 2, drain)
    assert r0["outcomes"][:2] == ["ok", "ok"]
    assert r0["outcomes"][2].startswith("GroupDestroyedError")
    assert r0["sums"][:2] == [3.0, 3.0] and r1["sums"] == [3.0, 3.0]
    assert r0["sums"][2] == 1.0  # the cancelled collective left its input alone
    assert drain - 0.05 <= r0["elapsed"] <= drain + 1.0
    assert r0["initialized"] is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dtype", "count", "op"])
def test_mismatch_raises_on_every_rank(run: Runner, kind: str) -> None:
    for res in run(conformance.mismatch, 3, kind):
        assert res.startswith("CollectiveMismatchError"), res
        assert res.endswith("next sum 3")
        if kind == "op":  # both ranks named with what each runs, true on every rank
            said = dict(re.findall(r"rank (\d) runs (all_reduce|broadcast)", res))
            assert len(said) == 2 and all((r == "1") == (c == "broadcast") for r, c in said.items()), res


@pytest.mark.timeout(60)
def test_a_root_that_completed_a_refused_broadcast_fails_its_next_collective_too(run: Runner) -> None:
    """(QA28: a broadcast whose ranks named different roots returned on root 0, which went on
    unaware that the others had raised; gloo times every rank out.)"""
    zero, one, last = run(conformance.broadcast_roots_disagree, 3)
    assert zero[0] == "1", zero  # its own data: as a root, it had sent and was done
    assert last[0].startswith("CollectiveMismatchError: collective #0: rank 2 runs broadcast"), last
    # (rank 0 may have started the all_reduce after the broadcast before it hears: the one
    # after that is refused then; the all_reduce it had started pairs with the others' and is exact.)
    # Ranks 0 and 1 both completed it (root and receiver): each refuses the first collective it
    # has not started when it hears, so one or two of the all_reduces fail, the same on every rank.
    refused = [i for i, outcome in enumerate(zero) if "refused" in outcome]
    assert refused in ([1], [2], [1, 2]), zero
    for res in (zero, one, last):
        for i in refused:
            assert res[i].startswith(f"CollectiveMismatchError: collective #{i} refused: rank 2 refused"), res
            assert re.search("but completed on rank [01]: the ranks disagree on its outcome", res[i]), res
        assert [o for i, o in enumerate(res) if i > 0 and i not in refused] == ["6"] * (3 - len(refused)), res


@pytest.mark.timeout(60)
def test_an_empty_part_against_a_full_one_is_a_mismatch_on_every_rank(run: Runner) -> None:
    """(An empty part used to skip the exchange: its rank returned, the others waited out the
    group's timeout.)"""
    for res in run(conformance.empty_parts, 3):
        assert all(o.startswith("CollectiveMismatchError") for o in res[:3]), res
        assert "|<f4|0|" in res[0] and res[-1] == "next sum 3", res


@pytest.mark.timeout(60)
def test_empty_parts_in_a_group_past_the_direct_limit_go_by_dissemination() -> None:
    async def rank(r: int) -> list[str]:
        return await conformance.empty_parts(r, 11)

    for res in asyncio.run(testing.run_ranks(11, rank, timeout=40)):
        assert all(o.startswith("CollectiveMismatchError") for o in res[:3]), res
        assert res[-1] == "next sum 11", res


@pytest.mark.timeout(60)
def test_peer_loss_fails_the_next_collective_naming_the_rank(run: Runner) -> None:
    assert run(conformance.peer_lost, 3) == ["RankFailedError 2", "RankFailedError 2", "dropped"]


@pytest.mark.timeout(30)
async def test_eight_inproc_ranks_all_reduce_through_world_and_op() -> None:
    import numpy as np

    import arendez as dist

    async def rank(r: int) -> tuple[float, int, int]:
        x = np.full(100_003, r + 1.0)  # above the small-message bound: a multi-step algorithm
        await dist.all_reduce(x)
        assert np.all(x == 36.0)
        world = dist.current_world()
        return float(x[0]), len(world.mesh.conns), world.groups[0].next_seq

    assert await testing.run_ranks(8, rank) == [(36.0, 7, 1)] * 8
