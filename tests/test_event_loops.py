"""Which event loop owns a process group, and what a call from another one gets.

The async API's world lives on the loop that called ``init_process_group``; ``arendez.sync``'s
(and the torch backend's) on arendez's loop thread. A call that would run on the other loop is
refused at once by name, and a world whose loop ended without ``destroy_process_group`` is gone
(QA26: in a notebook an ``arendez.sync`` call after an awaited collective hung the kernel for
good; a second ``asyncio.run`` found the first run's world initialised, and its barrier hung).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import arendez as dist
import arendez.sync as sync
from arendez.errors import ArendezError, NotInitializedError
from tests.harness import ServerProcess, run_function


async def _blocking_call_inside_the_owning_loop(rank: int, ws: int) -> list[object]:
    x = np.ones(2)
    await dist.all_reduce(x)
    try:
        sync.all_reduce(x)  # (the loop that owns the world is blocked in this very call)
        said = "returned"
    except ArendezError as exc:
        said = str(exc)
    await dist.all_reduce(x)  # the group goes on
    return [said, x.tolist()]


@pytest.mark.timeout(60)
def test_a_blocking_call_in_the_loop_that_owns_the_group_is_refused_at_once(
    arendez_server: ServerProcess,
) -> None:
    results = run_function(_blocking_call_inside_the_owning_loop, 2, arendez_server.url + "/loops")
    for said, x in results:
        assert "initialised on another event loop" in said and "await dist.all_reduce(x)" in said
        assert x == [4.0, 4.0]


@pytest.mark.timeout(30)
def test_a_world_whose_loop_ended_without_destroy_is_gone_and_init_works_again() -> None:
    async def leave_it_up() -> None:
        await dist.init_process_group(world_size=1)

    async def next_run() -> list[object]:
        seen: list[object] = [dist.is_initialized()]
        with pytest.raises(NotInitializedError, match="event loop that created it ended"):
            await dist.barrier()
        await dist.init_process_group(world_size=1)
        x = np.ones(3)
        await dist.all_reduce(x)
        seen.append(x.tolist())
        await dist.destroy_process_group()
        return seen

    asyncio.run(leave_it_up())
    assert asyncio.run(next_run()) == [False, [1.0, 1.0, 1.0]]


@pytest.mark.timeout(30)
def test_the_async_api_on_a_blocking_group_is_refused_and_queries_answer_anywhere() -> None:
    sync.init_process_group(world_size=1, rank=0)
    try:

        async def from_my_loop() -> list[object]:
            with pytest.raises(ArendezError, match=r"initialised through arendez\.sync"):
                await dist.all_reduce(np.ones(1))
            return [dist.get_rank(), sync.get_world_size(), dist.is_initialized()]

        assert asyncio.run(from_my_loop()) == [0, 1, True]
        x = np.ones(2)
        sync.all_reduce(x)  # (still up, on its own loop)
        assert x.tolist() == [1.0, 1.0]
    finally:
        sync.destroy_process_group()
