"""Same-host payloads through shared memory.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself. ``tests.harness.run_ranks`` runs it as rank processes.
"""

from __future__ import annotations

import os
from typing import Any

import arendez as dist
from tests.conformance import _check, contribution, reduced
from tests.jobs import join


async def shm_job(rank: int, ws: int, url: str, size: int, rounds: int) -> dict[str, Any]:
    """Large all_reduces and broadcasts, checked; returns which transport carried the bytes and
    what the shared-memory directory held while the job ran."""
    await join(url, ws, rank)
    shm_dir = os.environ.get("ARENDEZ_SHM_DIR", "/dev/shm")
    during: list[str] = []
    for i in range(rounds):
        if i == 1:  # every rank has finished init (its offers were answered and unlinked)
            during = sorted(os.listdir(shm_dir))
        x = contribution(rank, size, "float32", salt=i)
        want = reduced("SUM", [contribution(r, size, "float32", salt=i) for r in range(ws)])
        await dist.all_reduce(x)
        _check(x, want, f"all_reduce round {i}")
        y = contribution(rank, size, "int64", salt=i)
        await dist.broadcast(y, src=i % ws)
        _check(y, contribution(i % ws, size, "int64", salt=i), f"broadcast round {i}")
    stats = dist.transport_stats()
    await dist.destroy_process_group()
    return {
        "shm": stats.shm_bytes,
        "full": stats.shm_full,
        "waits": stats.shm_waits,
        "received": stats.received_bytes,
        "copied": stats.copied_bytes,
        "during": during,
        "after": sorted(os.listdir(shm_dir)),
    }
