"""``inproc://`` and ``arendez.testing``: ranks as tasks of one event loop."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import arendez as dist
from arendez import testing
from arendez.transports import inproc


@pytest.mark.timeout(10)
async def test_each_rank_has_its_own_world_and_the_process_has_none():
    async def rank(r: int) -> tuple[int, int, bool]:
        sub = await dist.new_group([0, 2])
        x = np.full(3, float(r))
        if sub is not dist.GroupMember.NON_GROUP_MEMBER:
            await dist.all_reduce(x, group=sub)
        return dist.get_rank(), dist.get_rank(sub), float(x[0]) == (2.0 if r != 1 else 1.0)

    assert await testing.run_ranks(3, rank) == [(0, 0, True), (1, -1, True), (2, 1, True)]
    assert not dist.is_initialized()  # the ranks' worlds never were this task's


@pytest.mark.timeout(10)
async def test_one_failing_rank_cancels_the_others_and_its_error_is_raised():
    async def rank(r: int) -> None:
        if r == 1:
            raise KeyError("rank 1 broke")
        await dist.barrier()  # never completes: rank 1 is gone

    with pytest.raises(KeyError, match="rank 1 broke"):
        await testing.run_ranks(3, rank, timeout=5)


@pytest.mark.timeout(10)
async def test_rendezvous_errors_name_the_problem():
    with pytest.raises(dist.RendezvousError, match=r"ranks \[1\] did not join within 0.05s"):
        await inproc.join("lonely", 2, 0, 0.05)
    first = asyncio.create_task(inproc.join("sized", 2, 0, 1.0))
    await asyncio.sleep(0)
    with pytest.raises(dist.RendezvousError, match="has world size 2; this rank asked for 3"):
        await inproc.join("sized", 3, 1, 1.0)
    with pytest.raises(dist.RendezvousError, match="rank 0 joined twice"):
        await inproc.join("sized", 2, 0, 1.0)
    second = await inproc.join("sized", 2, -1, 1.0)  # -1: the lowest free rank
    assert second.rank == 1 and (await first).rank == 0
    with pytest.raises(dist.RendezvousError, match="needs a job name"):
        await dist.init_process_group(init_method="inproc://", world_size=2)


@pytest.mark.timeout(10)
async def test_a_collective_with_a_rank_that_never_comes_times_out_naming_it():
    async def rank(r: int) -> str:
        if r == 2:
            await asyncio.sleep(1.0)
            return "skipped"
        try:
            await dist.barrier(timeout=0.2)
            return "no error"
        except dist.CollectiveTimeoutError as exc:
            return f"missing {exc.missing}"

    assert await testing.run_ranks(3, rank) == ["missing [2]", "missing [2]", "skipped"]


@pytest.mark.timeout(20)
async def test_a_short_deadline_fires_while_a_longer_one_is_pending():
    """One deadline timer per group: a collective started later with a shorter timeout still
    expires on time (the group's timer is brought forward, not left at the longer deadline)."""

    async def rank(r: int) -> str:
        if r == 1:
            await asyncio.sleep(3.0)  # in no collective until both of rank 0's have ended
            return "idle"
        long = asyncio.create_task(dist.barrier(timeout=30))
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        try:
            await dist.barrier(timeout=0.2)
            return "no error"
        except dist.CollectiveTimeoutError:
            took = asyncio.get_running_loop().time() - started
            return "timed out in time" if took < 2.0 else f"timed out after {took:.1f}s"
        finally:
            long.cancel()
            with contextlib.suppress(BaseException):
                await long

    assert (await testing.run_ranks(2, rank))[0] == "timed out in time"


@pytest.mark.timeout(30)
async def test_run_ranks_raises_at_its_timeout_even_when_ranks_ignore_their_cancel(monkeypatch):
    """Ranks that swallow their cancellation do not keep run_ranks past its bounds: it raises
    ``TimeoutError`` naming them (QA4-F2: 512 ranks ran on silently at twice the timeout)."""
    monkeypatch.setattr(testing, "WIND_DOWN_SECONDS", 0.5)
    release = asyncio.Event()

    async def stubborn(rank: int) -> None:
        for _ in range(100):  # (bounded: released by the test)
            try:
                await release.wait()
                return
            except asyncio.CancelledError:
                continue

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(
        TimeoutError, match=r"run_ranks: 3 of 3 ranks did not end within 1s of being cancelled"
    ):
        await testing.run_ranks(3, stubborn, timeout=0.5, destroy_timeout=0.5)
    assert loop.time() - started < 10
    release.set()
    await asyncio.sleep(0.1)  # (they end now, and destroy their worlds)
