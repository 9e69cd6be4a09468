"""The cost model behind the all_reduce choice over TCP links (arendez/costmodel.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from arendez import algo_reduce
from arendez import algorithms as algo
from arendez import costmodel as cm
from arendez.arrays import ReduceOp
from tests.harness import run_function
from tests.jobs import costmodel as jobs
from tests.test_algorithms import MemComm

KiB, MiB = 1024, 1 << 20


def _lanes(nbytes: int, size: int) -> int:
    return len(algo._lanes(nbytes // 4, 4, size))


def _choose(nbytes: int, size: int, gbit: float) -> str:
    link = cm.with_rate(cm.tcp_link(), gbit)
    return cm.choose_all_reduce(nbytes, size, link, _lanes(nbytes, size))


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("nbytes", [16 * MiB, 64 * MiB])
def test_ring_where_a_1_gbit_link_is_the_limit(size: int, nbytes: int) -> None:
    assert _choose(nbytes, size, 1) == "ring"


@pytest.mark.parametrize(("size", "expected"), [(2, "direct"), (3, "direct"), (4, "direct"), (16, "rdb")])
def test_latency_optimal_for_tiny_messages(size: int, expected: str) -> None:
    assert _choose(8, size, 1) == expected


def test_halving_doubling_where_latency_still_counts() -> None:
    """A mid-size message on a fast link: fewer rounds beat the ring's pipelining."""
    assert _choose(1 * MiB, 8, 10) == "rhd"
    assert _choose(1 * MiB, 4, 10) == "rhd"


def test_a_slower_link_moves_the_crossover_to_the_ring() -> None:
    assert _choose(1 * MiB, 4, 10) == "rhd"
    assert _choose(1 * MiB, 4, 1) == "ring"


@pytest.mark.parametrize("nbytes", [8, 64 * KiB, MiB, 64 * MiB])
def test_halving_doubling_only_on_power_of_two_groups(nbytes: int) -> None:
    for size in (3, 5, 6, 7, 72):
        assert _choose(nbytes, size, 1) != "rhd"
        assert _choose(nbytes, size, 10) != "rhd"


@pytest.mark.parametrize("size", [9, 72, 96, 384, 1000])
def test_small_messages_in_large_groups_never_connect_every_pair(size: int) -> None:
    """Past DIRECT_MAX_RANKS a small all_reduce (a barrier) takes recursive doubling, with the
    ranks beyond the largest power of two folded in, whatever the group's size (QA: 72 ranks
    opened all 2,556 pairs on their first barrier and timed out)."""
    assert _choose(8, size, 10) == "rdb"
    assert algo.choose("all_reduce", 8, size, "shm") == "rdb"
    assert algo.choose("all_gather", 64, size, "tcp") == "ring"
    assert algo.choose("reduce_scatter", 64, size, "shm") == "ring"


def test_recursive_doubling_costs_two_more_rounds_off_a_power_of_two() -> None:
    link = cm.Link(latency=1.0, overhead=0, byte_time=0, reduce_time=0)
    assert cm.all_reduce_cost("rdb", 8, 64, link) == pytest.approx(6)
    assert cm.all_reduce_cost("rdb", 8, 72, link) == pytest.approx(8)  # fold in, 6 steps, fold out


def test_ring_and_halving_doubling_move_the_same_bytes() -> None:
    """Without latency, overheads or spread the two bandwidth-optimal algorithms cost the same."""
    link = cm.Link(latency=0, overhead=0, byte_time=1e-9, reduce_time=1e-10)
    ring = cm.all_reduce_cost("ring", 64 * MiB, 4, link)
    assert cm.all_reduce_cost("rhd", 64 * MiB, 4, link) == pytest.approx(ring)
    assert cm.all_reduce_cost("direct", 64 * MiB, 4, link) > ring  # 3x the bytes on each link


def test_link_parameters_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARENDEZ_LINK_GBIT", "1")
    monkeypatch.setenv("ARENDEZ_LINK_LATENCY_US", "200")
    link = cm.tcp_link()
    assert link.byte_time == pytest.approx(8e-9)
    assert link.latency == pytest.approx(200e-6)
    assert algo.choose("all_reduce", 4 * MiB, 4, "tcp") == "ring"
    monkeypatch.setenv("ARENDEZ_LINK_GBIT", "fast")
    with pytest.raises(ValueError, match="ARENDEZ_LINK_GBIT must be an integer"):
        cm.tcp_link()


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="link kind must be 'shm' or 'tcp'"):
        cm.link_for("rdma")
    with pytest.raises(ValueError, match="all_reduce algorithm must be one of"):
        cm.all_reduce_cost("tree", MiB, 4, cm.SHM)


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16])
def test_shared_memory_keeps_the_size_rule(size: int) -> None:
    for nbytes in (8, 64 * KiB, 64 * KiB + 4, MiB, 16 * MiB, 64 * MiB):
        assert algo.choose("all_reduce", nbytes, size, "shm") == algo.choose("all_reduce", nbytes, size)


def test_the_override_wins_over_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARENDEZ_ALGORITHM", "rhd")
    assert algo.choose("all_reduce", 64 * MiB, 4, "tcp") == "rhd"
    monkeypatch.setenv("ARENDEZ_ALGORITHM", "direct")
    assert algo.choose("all_reduce", 64 * MiB, 4, "tcp") == "direct"


class TcpComm(MemComm):
    """A comm whose transport reports TCP links."""

    def link_kind(self) -> str:
        return "tcp"


def test_all_reduce_over_tcp_links_runs_what_the_model_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARENDEZ_LINK_GBIT", "1")
    ran: list[str] = []
    for name in ("_ring_all_reduce", "_halving_doubling_all_reduce"):
        real = getattr(algo_reduce, name)

        async def spy(*args: object, _real: object = real, _name: str = name) -> None:
            ran.append(_name)
            await _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(algo_reduce, name, spy)
    size, count = 4, (4 * MiB) // 4

    async def main() -> list[np.ndarray]:
        boxes: dict[tuple[int, ...], asyncio.Future[bytes]] = {}
        xs = [np.full(count, r + 1, np.float32) for r in range(size)]
        await asyncio.gather(
            *(algo.all_reduce(TcpComm(r, size, boxes), xs[r], ReduceOp.SUM) for r in range(size))
        )
        return xs

    for x in asyncio.run(main()):
        assert np.all(x == 10)
    assert ran == ["_ring_all_reduce"] * size  # the size rule alone would have taken halving-doubling
    assert algo.choose("all_reduce", 4 * MiB, 4) == "rhd"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("shm", "link", "expected"), [("0", "tcp", "ring"), ("1", "shm", "rhd")])
def test_ranks_agree_on_their_links_and_the_choice(
    arendez_server: Any, shm: str, link: str, expected: str
) -> None:
    """4 real ranks: over TCP only the model picks the ring for 8 MiB at 1 Gbit/s; with shared
    memory every rank sees shm links and keeps halving-doubling."""
    env = {"ARENDEZ_SHM": shm, "ARENDEZ_LINK_GBIT": "1"}
    results = run_function(jobs.algorithm_choice, 4, f"{arendez_server.url}/cm{shm}", 8 * MiB, env=env)
    assert results == [{"link": link, "algorithm": expected, "exact": True}] * 4
