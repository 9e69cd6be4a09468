"""Ranks that die, stall, forge frames or never arrive.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself. ``tests.harness.run_ranks`` runs it as rank processes.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join, until


async def forged_shm_reference(rank: int, ws: int, url: str) -> str:
    """Rank 1 points a data frame far outside its shared-memory segment; rank 0 must drop the
    link and fail its all_reduce naming rank 1."""
    from arendez import frames

    await join(url, ws, rank)
    world = dist.current_world()
    assert world.mesh is not None
    if rank == 1:
        assert world.shm.carries(0, 1 << 20), "the link should have shared memory"
        seq = world.groups[0].next_seq
        world.mesh.send(0, frames.ShmData(0, seq, 0, 0, "forged", 1 << 40, 4096))
        await asyncio.wait_for(asyncio.shield(world.mesh.conns[0].closed), 10)
        await dist.destroy_process_group()
        return "sent"
    try:
        await dist.all_reduce(np.ones(1000, np.float32))
        outcome = "no error"
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    await dist.destroy_process_group()
    return outcome


async def dies_between_collectives(rank: int, ws: int, url: str) -> str:
    """The last rank dies right after a collective; the others start the next one once they know:
    the error names the rank and the collective that could not run."""
    await join(url, ws, rank)
    world = dist.current_world()
    await dist.all_reduce(np.ones(10, np.float32))
    if rank == ws - 1:  # once every rank has its result (dying earlier fails that collective)
        await world.store.wait([f"reduced-{r}" for r in range(ws - 1)], timeout=10)
        os._exit(0)  # no goodbye: a crash
    await world.store.set(f"reduced-{rank}", "1")
    await until(lambda world: ws - 1 in world.failed, f"rank {ws - 1}'s death was never seen")
    try:
        await dist.all_reduce(np.ones(10, np.float32))
        outcome = "no error"
    except dist.RankFailedError as exc:
        outcome = f"{exc.rank} {exc.collective}"
    await dist.destroy_process_group()
    return outcome


async def two_die_between_collectives(rank: int, ws: int, url: str) -> str:
    """Rank 2 crashes; rank 0, once it knows, ends its process with an uncaught exception. Rank 1
    then starts a collective: the error blames rank 2, the first failure, and names both."""
    await join(url, ws, rank)
    world = dist.current_world()
    await dist.all_reduce(np.ones(10, np.float32))
    await world.store.set(f"reduced-{rank}", "1")
    if rank == 2:
        await world.store.wait(["reduced-0", "reduced-1"], timeout=10)
        os._exit(0)  # no goodbye: a crash
    await until(lambda world: 2 in world.failed, "rank 2's death was never seen")
    if rank == 0:
        raise SystemExit(3)  # (its goodbye names rank 2's death, then its own end)
    await until(lambda world: 0 in world.failed, "rank 0's end was never seen")
    try:
        await dist.all_reduce(np.ones(10, np.float32))
        outcome = "no error"
    except dist.RankFailedError as exc:
        outcome = f"{exc.rank} {exc.ranks}"
    await dist.destroy_process_group()
    return outcome


async def reduce_until_failure(
    rank: int, ws: int, url: str, ready_dir: str, size: int, seconds: float, collective: str = "all_reduce"
) -> dict[str, Any]:
    """``collective`` (all_reduce, or broadcast from the last rank) in a loop until a peer fails;
    report the error and when it was raised."""
    from pathlib import Path

    await join(url, ws, rank, timeout=float(seconds))
    x = np.ones(size, np.float32)
    rounds = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if collective == "broadcast":
                await dist.broadcast(x, ws - 1)
            else:
                await dist.all_reduce(x)
            x.fill(1)
            rounds += 1
            if rounds == 3:
                Path(ready_dir, f"ready-{rank}").write_text("1")
        outcome: dict[str, Any] = {"error": None}
    except dist.ArendezError as exc:
        outcome = {
            "error": type(exc).__name__,
            "message": str(exc),
            "at": time.time(),
            "rank_named": getattr(exc, "rank", None),
        }
    started = time.monotonic()
    await dist.destroy_process_group(timeout=2)
    outcome["destroy_seconds"] = time.monotonic() - started
    outcome["rounds"] = rounds
    return outcome


async def send_until_failure(
    rank: int, ws: int, url: str, ready_dir: str, size: int, seconds: float
) -> dict[str, Any]:
    """Rank 0 sends ``size`` bytes to rank 1 in a loop, rank 1 receives them, until one fails."""
    from pathlib import Path

    await join(url, ws, rank, timeout=float(seconds))
    x = np.zeros(size, np.uint8)
    rounds = 0
    try:
        while True:
            if rank == 0:
                await dist.send(x, 1)
            else:
                await dist.recv(x, 0)
            rounds += 1
            if rounds == 3:
                Path(ready_dir, f"ready-{rank}").write_text("1")
    except dist.ArendezError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
        outcome["rank_named"] = getattr(exc, "rank", None)
    await dist.destroy_process_group(timeout=2)
    return outcome


async def destroy_on_go(rank: int, ws: int, url: str, out_dir: str) -> float:
    """all_reduce, mark ``ready-<rank>``, wait for ``go`` (the test may stop a rank meanwhile),
    destroy (timeout 30 s): how long the destroy took."""
    from pathlib import Path

    await join(url, ws, rank)
    await dist.all_reduce(np.ones(4, np.float32))
    Path(out_dir, f"ready-{rank}").touch()
    await until(lambda _world: Path(out_dir, "go").exists(), "the test said go", 30)
    began = time.monotonic()
    await dist.destroy_process_group(timeout=30)
    return time.monotonic() - began


async def straggler(rank: int, ws: int, url: str, timeout: float) -> str:
    """Every rank but the last calls all_reduce; the last never does."""
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=timeout)
    if rank == ws - 1:
        await asyncio.sleep(timeout + 2.5)
        await dist.destroy_process_group()
        return "skipped"
    started = time.monotonic()
    try:
        await dist.all_reduce(np.ones(10))
        return "no error"
    except dist.CollectiveTimeoutError as exc:
        took = time.monotonic() - started
        assert isinstance(exc, TimeoutError)
        return f"{exc} | took {took:.1f}"
    finally:
        await dist.destroy_process_group(timeout=1)


async def guarded_job(rank: int, ws: int, url: str, out_dir: str) -> list[float]:
    """all_reduce, publish this rank's peer address, wait until the test has probed it, reduce again."""
    from pathlib import Path

    await join(url, ws, rank)
    x = np.full(1000, rank + 1.0)
    await dist.all_reduce(x)
    Path(out_dir, f"addr-{rank}").write_text(dist.current_world().address)
    deadline = time.monotonic() + 20
    while not Path(out_dir, "probed").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    y = np.full(1000, rank + 1.0)
    await dist.all_reduce(y)
    await dist.destroy_process_group()
    return [float(x[0]), float(y[0])]


async def init_outcome(rank: int, ws: int, url: str, out_dir: str, timeout: float) -> dict[str, Any]:
    """Mark ``joining-<rank>``, then initialise: how init ended and how long it took."""
    from pathlib import Path

    Path(out_dir, f"joining-{rank}").touch()
    began = time.monotonic()
    try:
        await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=timeout)
        outcome = "initialised"
        await dist.destroy_process_group(timeout=1.0)
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "seconds": time.monotonic() - began}


async def between_collectives(rank: int, ws: int, url: str, out_dir: str) -> dict[str, Any]:
    """all_reduce, mark ``idle-<rank>``, wait for ``go`` (the test may stop this rank meanwhile),
    all_reduce again: what the second one raised."""
    from pathlib import Path

    await join(url, ws, rank)
    await dist.all_reduce(np.ones(10, np.float32))
    Path(out_dir, f"idle-{rank}").touch()
    deadline = time.monotonic() + 30
    while not Path(out_dir, "go").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # (a stopped rank, resumed, hears the news before it calls again)
    try:
        await dist.all_reduce(np.ones(10, np.float32))
        outcome: dict[str, Any] = {"error": None}
    except dist.RankFailedError as exc:
        outcome = {"error": type(exc).__name__, "rank_named": exc.rank, "message": str(exc)}
    await dist.destroy_process_group(timeout=2)
    return outcome


async def recv_from_any_until_failure(rank: int, ws: int, url: str, ready_dir: str) -> dict[str, Any]:
    """Rank 1 waits in ``recv(src=None)``; the others live (rank 0 is the victim) and never send."""
    from pathlib import Path

    await join(url, ws, rank, timeout=30.0)
    await dist.barrier()
    Path(ready_dir, f"ready-{rank}").write_text("1")
    outcome: dict[str, Any] = {"error": None}
    if rank == 1:
        try:
            await dist.recv(np.zeros(4, np.float32))
        except dist.ArendezError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
    else:
        await asyncio.sleep(20)
    await dist.destroy_process_group(timeout=2)
    return outcome
