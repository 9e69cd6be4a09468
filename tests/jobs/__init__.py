"""Rank code for tests between real processes, one module per topic.

The shared helpers: ``join`` (init with this test's URL) and ``until`` (a bounded wait on what
this rank's world has seen).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import arendez as dist


async def join(url: str, world_size: int, rank: int, timeout: float = 30.0) -> None:
    await dist.init_process_group(init_method=url, world_size=world_size, rank=rank, timeout=timeout)


async def until(seen: Callable[[Any], bool], what: str, seconds: float = 10.0) -> None:
    """Wait (bounded) until ``seen(world)`` holds for this rank's world; fail with ``what``."""
    world = dist.current_world()
    deadline = time.monotonic() + seconds
    while not seen(world) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert seen(world), what
