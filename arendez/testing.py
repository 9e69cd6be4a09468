"""Run several ranks in one process, for unit tests (as dask's ``gen_cluster``).

    async def test_sum():
        async def rank(r: int) -> float:
            x = np.full(4, r + 1.0)
            await arendez.all_reduce(x)
            return float(x[0])

        assert await arendez.testing.run_ranks(8, rank) == [36.0] * 8

Each rank is a task of the running event loop with its own registry, joined over
``inproc://``: the same ``World``, ``Op`` and algorithms as over TCP, with frames linked in memory.
Inside a rank the module-level API (``arendez.all_reduce`` ...) acts on that rank's world.
With ``init_method`` (``arendez://host:port/job``, ``tcp://``) the ranks join over real sockets
instead: simulated ranks against a real server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .lifecycle import init_process_group
from .registry import current_world, fresh_context
from .teardown import destroy_process_group

T = TypeVar("T")

__all__ = ["current_world", "run_ranks"]


#: Seconds ``run_ranks`` gives cancelled ranks beyond their destroy timeout before it raises.
WIND_DOWN_SECONDS = 5.0


async def run_ranks(
    world_size: int,
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    job: str | None = None,
    timeout: float = 30.0,
    destroy_timeout: float = 5.0,
    init_method: str | None = None,
) -> list[T]:
    """Run ``fn(rank, *args)`` on ``world_size`` in-process ranks; return their results in rank
    order. ``init_method``: where they meet (default: in memory, ``inproc://``).

    Every rank is initialised before ``fn`` runs and destroyed after it returns (or fails). If
    one rank fails, the others are cancelled and its exception is raised; ``TimeoutError``
    if the ranks do not all finish within ``timeout`` seconds (the unfinished ones are
    cancelled, and given ``destroy_timeout`` + ``WIND_DOWN_SECONDS`` to end).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    where = init_method or f"inproc://{job or f'testing-{os.urandom(8).hex()}'}"

    async def one(rank: int) -> T:
        await init_process_group(init_method=where, world_size=world_size, rank=rank, timeout=timeout)
        try:
            return await fn(rank, *args)
        finally:
            await destroy_process_group(timeout=destroy_timeout)

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(one(r), context=fresh_context()) for r in range(world_size)]
    try:
        async with asyncio.timeout(timeout):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except TimeoutError:
        late = [rank for rank, t in enumerate(tasks) if not t.done()]
        raise TimeoutError(
            f"run_ranks: {len(late)} of {world_size} ranks did not finish within {timeout:g}s "
            f"(ranks {late[:16]}{', ...' if len(late) > 16 else ''})"
        ) from None
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:  # (their destroys are bounded; this bounds the rest)
            await asyncio.wait(pending, timeout=destroy_timeout + WIND_DOWN_SECONDS)
        stuck = [rank for rank, t in enumerate(tasks) if not t.done()]
        if stuck:
            raise TimeoutError(
                f"run_ranks: {len(stuck)} of {world_size} ranks did not end within "
                f"{destroy_timeout + WIND_DOWN_SECONDS:g}s of being cancelled (ranks {stuck[:16]}"
                f"{', ...' if len(stuck) > 16 else ''}); their tasks are left running"
            )
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    return [task.result() for task in tasks]
