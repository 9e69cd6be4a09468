"""init / destroy / new_group between rank processes: draining, leaving, re-joining.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself. ``tests.harness.run_ranks`` runs it as rank processes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join, until


async def subgroup_destroy(rank: int, ws: int, url: str) -> dict[str, Any]:
    """A subgroup of ranks {0, 1} is destroyed; the default group keeps working."""
    await join(url, ws, rank)
    sub = await dist.new_group([0, 1])
    result: dict[str, Any] = {
        "member": sub is not dist.GroupMember.NON_GROUP_MEMBER,
        "sub_rank": dist.get_rank(sub),
        "sub_size": dist.get_world_size(sub),
    }
    x = np.ones(4, np.int64)
    if result["member"]:
        await dist.all_reduce(x, group=sub)
        result["sub_sum"] = int(x[0])
        await dist.destroy_process_group(sub)
        await dist.destroy_process_group(sub)  # a second call is quiet
        try:
            await dist.all_reduce(x, group=sub)
            result["after"] = "no error"
        except dist.NotInitializedError as exc:
            result["after"] = f"NotInitializedError: {exc}"
    y = np.ones(4, np.int64)
    await dist.all_reduce(y)
    result["world_sum"] = int(y[0])
    result["initialized"] = dist.is_initialized()
    await dist.destroy_process_group()
    return result


async def reinit(rank: int, ws: int, url: str, rounds: int) -> list[Any]:
    """init -> all_reduce -> destroy, ``rounds`` times; then a collective must fail clearly."""
    sums = []
    for i in range(rounds):
        await join(url, ws, rank)
        x = np.full(10, float(rank + i), np.float64)
        await dist.all_reduce(x)
        sums.append(float(x[0]))
        await dist.destroy_process_group()
        await dist.destroy_process_group()  # quiet when nothing is initialized
    try:
        await dist.all_reduce(np.ones(1))
        sums.append("no error")
    except dist.NotInitializedError as exc:
        sums.append(str(exc))
    return sums


async def left_after_sending(rank: int, ws: int, url: str, size: int) -> str:
    """Rank 1 broadcasts and leaves at once; rank 0 starts its broadcast only after the goodbye.
    The data it needs already came, so it must succeed; the next collective must fail fast."""
    await join(url, ws, rank)
    x = np.full(size, float(rank + 7), np.float32)
    if rank == 1:
        await dist.broadcast(x, src=1)
        await dist.destroy_process_group()
        return "left"
    await until(lambda world: 1 in world.dead, "rank 1's goodbye never came")
    await dist.broadcast(x, src=1)
    assert np.all(x == 8.0), x[:4]
    started = time.monotonic()
    try:
        await dist.all_reduce(x)
        outcome = "no error"
    except dist.RankFailedError as exc:
        outcome = f"{exc} after {time.monotonic() - started:.2f}s"
    await dist.destroy_process_group()
    return outcome


async def destroy_while_peer_dies(rank: int, ws: int, url: str, ready_dir: str) -> dict[str, Any]:
    """Rank 0 destroys with a collective in flight that rank 1 never joins; the test kills rank 1
    during the drain. Destroy must end at once, not at its 20 s timeout."""
    from pathlib import Path

    await join(url, ws, rank)
    await dist.barrier()
    if rank != 0:
        Path(ready_dir, f"ready-{rank}").write_text("1")
        await asyncio.sleep(60)  # killed by the test
        return {}
    pending = asyncio.create_task(dist.all_reduce(np.ones(1000)))
    await asyncio.sleep(0.05)
    Path(ready_dir, "ready-0").write_text("1")
    started = time.monotonic()
    await dist.destroy_process_group(timeout=20)
    took = time.monotonic() - started
    try:
        await pending
        outcome = "no error"
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"destroy_seconds": took, "outcome": outcome, "initialized": dist.is_initialized()}


async def late_joiner(rank: int, ws: int, url: str, delay: float) -> float:
    """The last rank joins ``delay`` seconds after the others (longer than the lease)."""
    if rank == ws - 1:
        await asyncio.sleep(delay)
    await join(url, ws, rank)
    await asyncio.sleep(1.0)  # give the server's lease check time to (wrongly) fire
    x = np.ones(10)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0])


async def holds_the_gil(rank: int, ws: int, url: str, seconds: float) -> str:
    """The last rank makes one C call that keeps the GIL for ``seconds`` (as a huge
    ``json.loads`` would): no thread of its process runs meanwhile. Returns the outcome."""
    import ctypes

    await join(url, ws, rank)
    keeper = dist.current_world().store._lease
    assert keeper is not None
    # (a lease the server has not taken yet gets a 30 s grace: wait, bounded, until it has)
    assert await asyncio.to_thread(keeper.armed.wait, 20.0), "the lease keeper never connected"
    await dist.barrier()
    if rank == ws - 1:
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # (PyDLL: the call keeps the GIL)
    return await _all_reduce_then_destroy()


async def _all_reduce_then_destroy() -> str:
    """One all_reduce of ones, then destroy; ``sum N`` or the error it raised."""
    x = np.ones(10)
    try:
        await dist.all_reduce(x)
        outcome = f"sum {x[0]:g}"
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    await dist.destroy_process_group()
    return outcome


async def many_descriptors(rank: int, ws: int, url: str, seconds: float) -> str:
    """The last rank holds 1,100 open descriptors before it joins, so its lease socket's number
    is past 1023 (select() refuses those); then every rank idles for ``seconds``."""
    import os

    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)] if rank == ws - 1 else []
    try:
        await join(url, ws, rank)
        await dist.barrier()
        await asyncio.sleep(seconds)
        return await _all_reduce_then_destroy()
    finally:
        for fd in held:
            os.close(fd)


async def busy_loop(rank: int, ws: int, url: str, seconds: float) -> float:
    """The last rank blocks its event loop (a long synchronous step) for longer than the lease."""
    await join(url, ws, rank)
    await dist.barrier()
    if rank == ws - 1:
        time.sleep(seconds)  # deliberately blocks the loop: no await for ``seconds``
    x = np.ones(10)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0])


async def reads_nothing_for_a_while(rank: int, ws: int, url: str, seconds: float) -> float:
    """The last rank blocks its event loop for ``seconds`` while the others all_reduce 32 MiB
    with it: its receive window closes and stays closed, but its host answers every probe."""
    await join(url, ws, rank)
    await dist.barrier()
    if rank == ws - 1:
        time.sleep(seconds)  # deliberately blocks the loop: no await for ``seconds``
    x = np.ones(8 << 20, np.float32)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0]) if bool((x == x[0]).all()) else -1.0


async def busy_only_while_calling(rank: int, ws: int, url: str) -> list[bool]:
    """``World.busy`` on each rank: at rest; while a posted receive waits (rank 1) or a send waits
    for room (rank 0: rank 1's event loop is blocked for 2 s meanwhile); at rest again."""
    await join(url, ws, rank)
    world = dist.current_world()
    await dist.barrier()
    seen = [world.busy()]
    x = np.ones(8 << 20, np.float32)
    if rank == 0:
        await asyncio.sleep(0.5)  # (rank 1 has posted its receive, and blocks from 0.2 s to 2.2 s)
        sending = asyncio.ensure_future(dist.send(x, 1))
        await asyncio.sleep(0.3)
        seen.append(world.busy())
        await sending
    else:
        receiving = asyncio.ensure_future(dist.recv(x, 0))
        await asyncio.sleep(0.2)
        seen.append(world.busy())
        time.sleep(2.0)  # deliberately blocks the loop: nothing is read meanwhile
        await receiving
    await dist.barrier()
    seen.append(world.busy())
    await dist.destroy_process_group()
    return seen


async def store_while_host_is_busy(rank: int, ws: int, url: str, seconds: float) -> float:
    """Rank 0 (the server's host under tcp://) blocks its event loop for ``seconds``; meanwhile
    rank 1 uses the store. Returns how long rank 1's set + get took (0 on rank 0)."""
    await join(url, ws, rank)
    await dist.barrier()
    took = 0.0
    if rank == 0:
        time.sleep(seconds)  # deliberately blocks the loop: no await for ``seconds``
    else:
        await asyncio.sleep(seconds / 5)  # (rank 0 is asleep by now)
        store = dist.current_world().store
        started = time.monotonic()
        await store.set("busy-host", b"1")
        assert await store.get("busy-host") == b"1"
        took = time.monotonic() - started
    await dist.barrier()
    await dist.destroy_process_group()
    return took


async def destroy_with_server_stopped(rank: int, ws: int, url: str, marks: str) -> float:
    """One all_reduce, then wait (bounded) for the test to stop the server (SIGSTOP: the
    connection stays up, nothing answers); returns how long ``destroy(timeout=30)`` took."""
    from pathlib import Path

    await join(url, ws, rank)
    x = np.ones(4)
    await dist.all_reduce(x)
    Path(marks, f"ready-{rank}").write_text("1")
    for _ in range(1000):  # (10 s at most)
        if Path(marks, "go").exists():
            break
        await asyncio.sleep(0.01)
    started = time.monotonic()
    await dist.destroy_process_group(timeout=30)
    return time.monotonic() - started


async def destroy_after_a_hung_peer_failed(rank: int, ws: int, url: str, marks: str) -> list[Any]:
    """8 MB all_reduces until a peer (stopped by the test) is declared failed; then
    ``destroy_process_group()`` with the group's own timeout (30 s). Returns the error and how
    long the destroy took."""
    from pathlib import Path

    await join(url, ws, rank)
    x = np.ones(2_000_000, np.float32)
    error = ""
    for step in range(100_000):  # (until the stopped peer is declared failed: a few seconds)
        try:
            await dist.all_reduce(x)
        except dist.RankFailedError as exc:
            error = str(exc)
            break
        if step == 5:
            Path(marks, f"ready-{rank}").write_text("1")
    started = time.monotonic()
    await dist.destroy_process_group()
    return [error, time.monotonic() - started]
