"""What every algorithm shares: the ``Comm`` it runs over, waiting, buffer views and lanes.

A bandwidth-bound message is cut into *lanes* (``_lanes``) that run concurrently
(``_run_lanes``), so the reduction of one lane overlaps the transfer of the next. The lane
sizes are read from this module when a collective runs (tests patch them here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .costmodel import DIRECT_MAX_RANKS
from .settings import env_int

Array = np.ndarray[Any, Any]

#: Bytes of one block of one ring lane; lanes of ``size`` blocks pipeline large messages.
LANE_BYTES = env_int("ARENDEZ_LANE_BYTES", 512 * 1024, minimum=4096)
#: Lane block over TCP links: the socket, not the reduction, paces a step there, and every
#: message costs the event loop (a frame, a future, a wake-up), so fewer, larger blocks. A
#: block's reduction streams through cache-sized pieces as it arrives (``recv_reduce``), so a
#: large block costs no more cache misses than a small one.
TCP_LANE_BYTES = env_int("ARENDEZ_TCP_LANE_BYTES", 4 << 20, minimum=4096)
#: Lanes a bandwidth-bound message is cut into at least (blocks permitting).
MIN_LANES = env_int("ARENDEZ_MIN_LANES", 1)
#: Smallest lane block: below it, per-message overhead outweighs the overlap lanes buy.
MIN_LANE_BYTES = 64 * 1024
#: Ring lanes in flight at once (bounds scratch memory to a fixed chunk budget).
LANES_IN_FLIGHT = env_int("ARENDEZ_LANES_IN_FLIGHT", 4)


class Comm(Protocol):
    """What an algorithm needs: its place in the group and tagged messages.

    A comm may also have ``recv_reduce(peer, tag, src, out, ufunc)``, which receives a message
    and sets ``out = ufunc(src, message)`` (``algo_reduce.recv_reduce`` falls back to ``recv_any``).
    """

    rank: int
    size: int

    def send(self, peer: int, tag: int, data: Array) -> Awaitable[None] | None:
        """Start sending ``data``; await the result before modifying ``data``."""

    def recv_into(self, peer: int, tag: int, out: Array) -> Awaitable[None]:
        """Receive exactly ``out.nbytes`` bytes into ``out``."""

    def scratch(self, nbytes: int) -> Array:
        """A uint8 work buffer of ``nbytes`` (pooled: give it back with ``recycle``)."""

    def recycle(self, buffer: Array) -> None:
        """Return a ``scratch`` buffer once nothing refers to it any more."""

    def recv_any(self, peer: int, tag: int, scratch: Array | None = None) -> Awaitable[memoryview]:
        """Receive a message into ``scratch`` if it fits and arrives after this call, else into a
        buffer the transport picked (the sender's shared memory, say); returns where it landed."""

    def release(self, buffer: memoryview) -> None:
        """Done with what ``recv_any`` returned: the transport may reuse it (the collective's
        end releases whatever is left)."""


async def wait_all(awaitables: Sequence[Awaitable[Any] | None]) -> list[Any]:
    pending = [a for a in awaitables if a is not None]
    if not pending:
        return []
    if len(pending) == 1:
        return [await pending[0]]
    return list(await asyncio.gather(*pending))


def _view(buf: memoryview, dtype: np.dtype[Any]) -> Array:
    return np.frombuffer(buf, dtype=dtype) if buf.nbytes else np.empty(0, dtype)


def _release(comm: Comm, buffers: list[memoryview]) -> None:
    for buffer in buffers:
        comm.release(buffer)


def link_kind(comm: Comm) -> str | None:
    """``"shm"`` or ``"tcp"``: what links ``comm``'s large payloads take (None: the transport
    does not say, as the in-memory one of unit tests)."""
    kind = getattr(comm, "link_kind", None)
    return str(kind()) if callable(kind) else None


def others(comm: Comm) -> list[int]:
    """The group ranks other than this one."""
    return [p for p in range(comm.size) if p != comm.rank]


def _ring_schedule(comm: Comm) -> tuple[int, int, int, int]:
    n, r = comm.size, comm.rank
    return n, r, (r + 1) % n, (r - 1) % n


def _lanes(
    size: int, itemsize: int, parts: int, min_lanes: int | None = None, lane_bytes: int | None = None
) -> list[slice]:
    """Slices of ``size`` elements for ``parts``-block lanes: blocks of at most ``lane_bytes``
    (default ``LANE_BYTES``), and at least ``MIN_LANES`` lanes (of blocks no smaller than
    ``MIN_LANE_BYTES``) to overlap."""
    itemsize = max(1, itemsize)
    cut = MIN_LANES if min_lanes is None else min_lanes
    most = LANE_BYTES if lane_bytes is None else lane_bytes
    block = min(most, max(MIN_LANE_BYTES, size * itemsize // (parts * cut)))
    per_lane = max(1, block // itemsize) * parts
    return [slice(i, min(i + per_lane, size)) for i in range(0, size, per_lane)] or [slice(0, 0)]


async def _run_lanes(count: int, lane: Callable[[int], Awaitable[None]]) -> None:
    """Run ``lane(0..count-1)``, at most ``LANES_IN_FLIGHT`` at a time, in order.

    The first lane to fail cancels the others, and all have stopped before this returns: no
    lane may still read a received buffer once the collective has ended.
    """
    if count == 1:
        await lane(0)
        return
    gate = asyncio.Semaphore(LANES_IN_FLIGHT)

    async def gated(i: int) -> None:
        async with gate:
            await lane(i)

    # (not a TaskGroup: on Python 3.11 one whose lane fails while it waits for the others leaves
    # its cancel of the caller's task counted, so the caller's ``cancelling()`` grew with every
    # collective a peer cancelled, and code that relies on it took itself for cancelled; QA25)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(gated(i)) for i in range(count)]
    try:
        await asyncio.gather(*tasks)  # (the first failure raises here)
    except BaseException:
        for task in tasks:
            task.cancel()
        cancelled = False
        while True:  # every lane has stopped before this returns, even if cancelled meanwhile
            try:
                await asyncio.wait(tasks)
                break
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError from None
        raise


_NOTHING = np.empty(0, np.uint8)


async def exchange_nothing(comm: Comm) -> None:
    """This rank's part of a collective is empty: exchange empty frames all the same, so that
    a rank whose part is not empty (ranks that disagree on the count) is found out on both
    sides instead of waiting for its timeout, and so that every rank leaves the collective
    together. Every pair in small groups; in larger ones a dissemination exchange (round k:
    to ``rank + 2**k``, from ``rank - 2**k``), which reaches every rank in O(log n) rounds
    without connecting every pair."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    if n <= DIRECT_MAX_RANKS:
        peers = others(comm)
        recvs = [comm.recv_into(p, 0, _NOTHING) for p in peers]
        await wait_all([comm.send(p, 0, _NOTHING) for p in peers])
        await wait_all(recvs)
        return
    step = 1
    while step < n:
        received = comm.recv_into((r - step) % n, step, _NOTHING)
        await wait_all([comm.send((r + step) % n, step, _NOTHING), received])
        step <<= 1
