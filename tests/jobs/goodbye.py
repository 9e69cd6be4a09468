"""Ranks that end without ``destroy_process_group``: their goodbye names the root cause."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join


async def messenger_dies(rank: int, ws: int, url: str, ready_dir: str, deaf: bool) -> dict[str, Any]:
    """all_reduce in a loop; the test SIGSTOPs rank 2. Rank 1 lets its RankFailedError escape
    (its process ends with it, no destroy). Rank 0 reports what it raised; with ``deaf`` it
    ignores the server's failure events, so only rank 1's goodbye can tell it about rank 2."""
    await join(url, ws, rank, timeout=30.0)
    world = dist.current_world()
    if deaf and rank == 0:
        world.store.on_event = None
    x = np.ones(1000, np.float32)
    rounds = 0
    deadline = time.monotonic() + 40.0
    try:
        while time.monotonic() < deadline:
            await dist.all_reduce(x)
            x.fill(1)
            rounds += 1
            if rounds == 3:
                Path(ready_dir, f"ready-{rank}").write_text("1")
        outcome: dict[str, Any] = {"error": None}
    except dist.RankFailedError as exc:
        if rank == 1:
            raise  # the process ends with the error, the world still up
        outcome = {"error": type(exc).__name__, "message": str(exc), "ranks": exc.ranks, "at": time.time()}
    await dist.destroy_process_group(timeout=2)
    return outcome


async def receiver_of_the_messenger(rank: int, ws: int, url: str, ready_dir: str) -> dict[str, Any]:
    """The test kills rank 0. Rank 1, in an all_reduce with rank 0 on a pair group, lets the
    RankFailedError escape (its process ends with it); rank 2 waits in ``recv(src=1)``."""
    await join(url, ws, rank, timeout=30.0)
    pair = await dist.new_group([0, 1])
    await dist.barrier()
    Path(ready_dir, f"ready-{rank}").write_text("1")
    x = np.ones(10, np.float32)
    outcome: dict[str, Any] = {"error": None}
    if rank == 0:
        time.sleep(30)  # (killed before it wakes)
    elif rank == 1:
        await dist.all_reduce(x, group=pair)  # raises naming rank 0, uncaught
    else:
        try:
            await dist.recv(x, src=1)
        except dist.RankFailedError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc), "ranks": exc.ranks}
    await dist.destroy_process_group(timeout=2)
    return outcome


async def ends_without_destroy(rank: int, ws: int, url: str, how: str) -> dict[str, Any]:
    """Rank 1 ends its process after one all_reduce (``how``: exit, raise, sigterm); rank 0's
    next all_reduce must name rank 1 and say how it ended."""
    await join(url, ws, rank, timeout=30.0)
    await dist.all_reduce(np.ones(4, np.float32))
    store = dist.current_world().store
    if rank == 1:
        await store.wait(["reduced-0"], timeout=10)  # ending earlier would fail that collective
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the signal ends the process before this)
        if how == "raise":
            raise RuntimeError("rank 1 gives up")
        if how == "sigint":  # (Ctrl-C: asyncio.run cancels the main task, then KeyboardInterrupt)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(5)
        return {"how": how}  # returns: the process exits without destroy
    await store.set("reduced-0", "1")
    try:
        await dist.all_reduce(np.ones(4, np.float32))
        outcome: dict[str, Any] = {"error": None}
    except dist.RankFailedError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc), "ranks": exc.ranks}
    await dist.destroy_process_group(timeout=2)
    return outcome
