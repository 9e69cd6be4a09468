"""Ranks that cancel collectives (``asyncio.wait_for``, ``task.cancel()``), init and destroy.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself (``tests.harness.run_ranks`` runs it as processes; the in-process tests
run the same code over ``inproc://``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join, until

SENTINEL = -7.0


async def issue_scenario(rank: int, ws: int, url: str) -> dict[str, Any]:
    """The issue's example: rank 0 gives its all_reduce 0.1 ms, rank 1 arrives 0.5 s later."""
    await join(url, ws, rank)
    x = np.full(1000, rank + 1.0)
    y = np.full(1000, 10.0 * (rank + 1))
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            await asyncio.wait_for(dist.all_reduce(x), 0.0001)
            out["first"] = "completed"
        except TimeoutError:
            out["first"] = "timed out"
    else:
        await asyncio.sleep(0.5)
        start = time.monotonic()
        try:
            await dist.all_reduce(x)
            out["first"] = "completed"
        except dist.CollectiveCancelledError as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
            out["cancelled_by"] = exc.rank
        out["seconds"] = time.monotonic() - start
    await dist.all_reduce(y)
    out["y"] = sorted(set(y.tolist()))
    await dist.destroy_process_group()
    return out


async def cancel_before_start(rank: int, ws: int, url: str, mode: str) -> dict[str, Any]:
    """Rank 0's all_reduce is cancelled before its task takes a step (``wait_for(.., 0)``, a
    task cancelled at once, a ``TaskGroup`` whose body fails first); rank 1 runs its copy. The
    next two all_reduces must pair up (their sums are checked)."""
    await join(url, ws, rank)
    x = np.ones(4, np.float32)
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            if mode == "wait_for":
                await asyncio.wait_for(dist.all_reduce(x), 0)
            elif mode == "cancel":
                task = asyncio.ensure_future(dist.all_reduce(x))
                task.cancel()
                await task
            else:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(dist.all_reduce(x))
                    raise RuntimeError("the body fails before the task ran")
            out["first"] = "completed"
        except (TimeoutError, asyncio.CancelledError, ExceptionGroup, RuntimeError) as exc:
            out["first"] = type(exc).__name__
    else:
        try:
            await dist.all_reduce(x)
            out["first"] = "completed"
        except dist.CollectiveCancelledError as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
    out["sums"] = []
    for step in (1, 2):
        x[:] = 10 * step + rank
        await dist.all_reduce(x)
        out["sums"].append(float(x[0]))
    await dist.destroy_process_group()
    return out


async def late_after_a_timeout(rank: int, ws: int, url: str) -> dict[str, Any]:
    """Rank 1's all_reduce on a group of timeout 2 s times out; rank 0 calls its copy 4 s late,
    after rank 1's part had arrived: it must not complete it. The next one pairs up (rank 1
    starts it at 5 s, inside rank 0's 4-6 s: a second of margin either way)."""
    await join(url, ws, rank)
    group = await dist.new_group([0, 1], timeout=2.0)
    x = np.full(4, rank + 1.0)
    if rank == 0:
        await asyncio.sleep(4.0)
    try:
        await dist.all_reduce(x, group=group)
        first = "completed"
    except (dist.CollectiveTimeoutError, dist.CollectiveCancelledError) as exc:
        first = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        await asyncio.sleep(3.0)
    y = np.full(4, 10.0 * (rank + 1))
    await dist.all_reduce(y, group=group)
    await dist.destroy_process_group()
    return {"first": first, "x": float(x[0]), "y": float(y[0])}


async def cancel_at_random(
    rank: int, ws: int, url: str, nbytes: int, rounds: int, seed: int, collective: str = "all_reduce"
) -> list[str]:
    """One rank cancels its collective over ``nbytes`` at a random point, ``rounds`` times: the
    ``all_reduce`` of rank 0, or rank 1's receive of rank 0's ``broadcast`` (the cancel lands
    while the payload streams into rank 1's buffer). After each, both ranks fill the cancelled
    buffer with a sentinel, run two exact collectives (one as large) and check the sentinel is
    intact: nothing landed in it after the cancel returned."""
    await join(url, ws, rank)
    rng = random.Random(seed * 10 + rank)
    canceller = 0 if collective == "all_reduce" else 1
    n = nbytes // 4
    outcomes = []
    for i in range(rounds):
        x = np.full(n, float(rank + 1), np.float32)
        await dist.barrier()  # (else one rank's whole payload may be there before the other starts)
        if collective == "all_reduce":
            call, expected = dist.all_reduce(x), 3.0
        else:
            call, expected = dist.broadcast(x, src=0), 1.0
        task = asyncio.get_running_loop().create_task(call)
        if rank == canceller:
            delay = rng.uniform(0.0, 0.15 if nbytes > 8 << 20 else 0.003)
            await asyncio.sleep(0.0 if i == 0 else delay)  # round 0: cancelled mid-way for sure
            task.cancel()
        try:
            await task
            outcome = "completed"
            assert float(x[0]) == float(x[-1]) == expected, (i, float(x[0]), float(x[-1]))
        except asyncio.CancelledError:
            outcome = "cancelled"
            assert rank == canceller
        except dist.CollectiveCancelledError as exc:
            assert exc.rank == canceller and exc.collective == collective, exc
            outcome = "peer cancelled"
        x.fill(SENTINEL)  # the cancelled collective's buffer: nothing may write it from now on
        big = np.full(n, float(rank + 1 + i), np.float32)
        small = np.arange(1000, dtype=np.float64) * (rank + 1)
        await dist.all_reduce(big)
        await dist.all_reduce(small)
        assert np.array_equal(big, np.full(n, float(3 + 2 * i), np.float32)), (i, big[:3], big[-3:])
        assert np.array_equal(small, np.arange(1000, dtype=np.float64) * 3), i
        assert np.all(x == SENTINEL), f"round {i}: the cancelled buffer was written after the cancel"
        outcomes.append(outcome)
    await dist.destroy_process_group()
    return outcomes


async def cancel_one_of_eight(rank: int, ws: int, url: str, victim: int = 3) -> list[str]:
    """Eight concurrent all_reduces; rank 0 cancels one: only that one fails, on both ranks."""
    await join(url, ws, rank)
    if rank == 1:
        await asyncio.sleep(0.2)  # rank 0 cancels before this rank starts any of them
    xs = [np.full(50_000 + 1000 * k, float(rank + 1 + k)) for k in range(8)]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(dist.all_reduce(x)) for x in xs]
    if rank == 0:
        await asyncio.sleep(0)  # every task has started its collective
        tasks[victim].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    seen = []
    for k, (x, res) in enumerate(zip(xs, results, strict=True)):
        if isinstance(res, BaseException):
            seen.append(type(res).__name__)
            if isinstance(res, dist.CollectiveCancelledError):
                assert res.rank == 0 and res.seq == k, res
        else:
            assert np.array_equal(x, np.full(x.shape, 3.0 + 2 * k)), k
            seen.append("ok")
    z = np.full(10, rank + 1.0)
    await dist.all_reduce(z)  # the group still works
    assert np.array_equal(z, np.full(10, 3.0))
    await dist.destroy_process_group()
    return seen


async def cancel_init(rank: int, ws: int, url: str, run_dir: str) -> float:
    """Rank 0's first init is cancelled while it waits for rank 1 (which has not started); it
    must leave nothing on the server: both then init and all_reduce normally."""
    ready = Path(run_dir) / "init-cancelled"
    if rank == 0:
        try:
            await asyncio.wait_for(join(url, ws, rank), 0.5)
            raise AssertionError("init finished without rank 1")
        except TimeoutError:
            pass
        assert not dist.is_initialized()
        ready.touch()
    else:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    await join(url, ws, rank, timeout=20)
    x = np.full(10, rank + 1.0)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0])


async def cancel_destroy(rank: int, ws: int, url: str) -> dict[str, Any]:
    """Rank 0 destroys (timeout 1 s) while its all_reduce waits for rank 1, which never starts
    it, and the destroy is cancelled after 0.2 s: the world still closes within the timeout
    (rank 1 gets rank 0's goodbye while rank 0's process is still alive)."""
    await join(url, ws, rank)
    out: dict[str, Any] = {}
    if rank == 0:
        pending = asyncio.get_running_loop().create_task(dist.all_reduce(np.ones(10)))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        try:
            await asyncio.wait_for(dist.destroy_process_group(timeout=1.0), 0.2)
            out["destroy"] = "returned"
        except TimeoutError:
            out["destroy"] = "cancelled"
        out["destroy_seconds"] = time.monotonic() - start
        out["initialized"] = dist.is_initialized()
        try:
            await pending
        except dist.ArendezError as exc:
            out["pending"] = type(exc).__name__
        await asyncio.sleep(2.0)  # alive: a goodbye rank 1 sees now came from the destroy
    else:
        start = time.monotonic()
        await until(lambda w: 0 in w.dead, "rank 0 never left", 10.0)
        out["seconds"] = time.monotonic() - start
        out["reason"] = dist.current_world().dead[0]
        await dist.destroy_process_group()
    return out


async def cancel_recv(rank: int, ws: int, url: str, nbytes: int) -> list[str]:
    """Rank 1 gives up (``wait_for``) a ``recv`` of ``nbytes`` while the payload streams in: its
    buffer is not written after that (sentinel), and the message is not lost: the next recv
    gets it, then the later messages, exact and in order."""
    await join(url, ws, rank)
    n = nbytes // 4
    seen = []
    for i in range(2):
        await dist.barrier()
        if rank == 0:
            await dist.send(np.full(n, 1.0 + i, np.float32), dst=1)
            await dist.send(np.full(1000, 5.0 + i), dst=1)
        else:
            x = np.zeros(n, np.float32)
            try:
                await asyncio.wait_for(dist.recv(x, src=0), 0.01 if i == 0 else 0.02)
                seen.append("received")
            except TimeoutError:
                seen.append("gave up")
            x.fill(SENTINEL)
            if seen[-1] == "gave up":  # the same message, now for this recv
                again = np.zeros(n, np.float32)
                await dist.recv(again, src=0)
                assert np.array_equal(again, np.full(n, 1.0 + i, np.float32)), (i, again[:3], again[-3:])
            small = np.zeros(1000)
            await dist.recv(small, src=0)
            assert np.array_equal(small, np.full(1000, 5.0 + i)), (i, small[:3])
            assert np.all(x == SENTINEL), f"round {i}: the given-up recv buffer was written"
        await dist.barrier()
    await dist.destroy_process_group()
    return seen


async def peers_task_not_left_cancelling(rank: int, ws: int, url: str) -> list[Any]:
    """Rank 0 cancels all_reduces that rank 1 is already in (a small one, and ones that run in
    lanes); rank 1's task, given ``CollectiveCancelledError``, must not be left with a cancel
    request counted (``Task.cancelling()``: asyncio's way to tell a task's own cancel apart)."""
    await join(url, ws, rank)
    me = asyncio.current_task()
    assert me is not None
    seen: list[Any] = []
    for n in (10, 1 << 20, 4 << 20):
        x = np.ones(n)
        await dist.barrier()
        if rank == 0:
            await asyncio.sleep(0.05)  # (rank 1 is in the all_reduce by now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dist.all_reduce(x), 0.002)
        else:
            try:
                await dist.all_reduce(x)
                outcome = "completed"
            except dist.CollectiveCancelledError:
                outcome = "cancelled"
            seen.append([n, outcome, me.cancelling()])
    await dist.destroy_process_group()
    return seen
