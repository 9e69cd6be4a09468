"""Rank code for the flight recorder tests (``tests/test_flightrec.py``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join


async def late_rank(rank: int, ws: int, url: str, marks: str) -> dict[str, Any]:
    """Three all_reduces; then the last rank stays away from the fourth until the test writes
    ``go`` (it has SIGUSR1'd every rank meanwhile); then all finish it and a fifth."""
    await join(url, ws, rank, timeout=20.0)
    x = np.ones(2, np.float32)
    for _ in range(3):
        await dist.all_reduce(x)
    Path(marks, f"ready-{rank}").write_text("1")
    if rank == ws - 1:
        deadline = time.monotonic() + 15
        while not Path(marks, "go").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    x = np.ones(2, np.float32)
    await dist.all_reduce(x)
    await dist.all_reduce(x)
    seqs = [e["seq"] for e in dist.flight_recorder()["entries"]]
    await dist.destroy_process_group(timeout=5)
    return {"sum": float(x[0]), "seqs": seqs}


async def reduce_until_failure(
    rank: int, ws: int, url: str, marks: str, timeout: float, stall_last: bool = False
) -> dict[str, Any]:
    """all_reduce (8 bytes) until one fails; report the error and where this rank's dump went.
    ``stall_last``: the last rank stops calling after its third (the others then wait on it)."""
    await join(url, ws, rank, timeout=timeout)
    x = np.ones(2, np.float32)
    rounds = 0
    outcome: dict[str, Any] = {"error": None}
    try:
        while rounds < 100_000:
            await dist.all_reduce(x)
            rounds += 1
            if rounds == 3:
                Path(marks, f"ready-{rank}").write_text("1")
                if stall_last and rank == ws - 1:
                    await asyncio.sleep(timeout)  # (the test ends this rank meanwhile)
            await asyncio.sleep(0.001)
    except dist.ArendezError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["dump"] = dist.current_world().flight.path
    outcome["rounds"] = rounds
    await dist.destroy_process_group(timeout=2)
    return outcome
