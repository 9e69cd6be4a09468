"""Rank code for tests/test_local_sockets.py: which links a small all_reduce went over."""

from __future__ import annotations

from typing import Any

import numpy as np

import arendez as dist


async def links_after_all_reduce(rank: int, world_size: int) -> dict[str, Any]:
    x = np.full(3, rank + 1, np.float32)
    await dist.all_reduce(x)
    stats = dist.transport_stats()
    return {
        "sum": x.tolist(),
        "connections": stats.connections,
        "local": stats.local_connections,
        "advertised_local": "#local=" in dist.current_world().address,
    }


async def polling_after_all_reduce(rank: int, world_size: int) -> dict[str, Any]:
    """How long this rank's loop polls for an awaited collective (``arendez.loopcpu``), and an
    all_reduce's result with it."""
    x = np.full(3, rank + 1, np.float32)
    for _ in range(20):
        await dist.all_reduce(x)
        x[:] = rank + 1
    await dist.all_reduce(x)
    return {"spin": dist.current_world().spin.seconds, "sum": x.tolist()}
