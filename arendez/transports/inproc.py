"""``inproc://job``: ranks that are tasks of one event loop, linked in memory.

Every rank of a job calls ``join`` (through ``init_process_group(init_method="inproc://job")``);
once all have arrived each gets an ``InprocLinks`` to the others. A frame goes through the
same codec check as on a socket (``frames.decode`` of its encoded header), its payload is
copied at send time into the buffer the receiver's sink picked (so the sender may reuse its
array at once, as after a socket write), and it is routed on a later loop turn, in order.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .. import frames, wire
from ..errors import RendezvousError

Route = Callable[[int, frames.Frame, memoryview | None], None]
Sink = Callable[[int, frames.Frame, int], memoryview | wire.Stream | None]
Lost = Callable[[int, str], None]


class InprocLink:
    """This rank's end of the link to one peer."""

    def __init__(self, owner: InprocLinks, peer: int) -> None:
        self._owner = owner
        self.peer = peer
        self.other: InprocLink | None = None
        self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    def send(self, header: Any, payload: memoryview | bytes | None = None) -> None:
        """Hand one frame to the peer (the payload is copied now)."""
        other = self.other
        if not self._open or other is None or not other._open:
            raise ConnectionResetError(f"in-process link to rank {self.peer} is closed")
        frame = frames.decode(header)
        receiver = other._owner
        data: memoryview | None = None
        raw = memoryview(payload).cast("B") if payload is not None else None
        if raw is None or not raw.nbytes:  # (the sink sees every frame in order, as over TCP)
            receiver.sink(self._owner.rank, frame, 0)
        else:
            dest = receiver.sink(self._owner.rank, frame, raw.nbytes)
            if dest is not None and not isinstance(dest, memoryview):  # a stream: folded now
                dest.write(raw)
                data = dest.view
            else:
                if dest is None:
                    dest = memoryview(cast(Any, np.empty(raw.nbytes, np.uint8)))
                data = dest.cast("B")
                data[:] = raw
        asyncio.get_running_loop().call_soon(other._arrive, frame, data)

    def _arrive(self, frame: frames.Frame, payload: memoryview | None) -> None:
        if self._open:
            self._owner.route(self.peer, frame, payload)

    async def drain(self) -> None:
        if not self._open:
            raise ConnectionResetError(f"in-process link to rank {self.peer} is closed")

    def drain_future(self) -> None:
        return None  # the payload was copied at send: nothing is ever queued

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> None:
        return None  # a payload lands whole at send time: none is ever half-received

    def close(self, why: str) -> None:
        """Close both ends; the peer learns it after the frames already sent."""
        if not self._open:
            return
        self._open = False
        other = self.other
        if other is not None and other._open:
            asyncio.get_running_loop().call_soon(other._peer_closed, why)

    def _peer_closed(self, why: str) -> None:
        if self._open:
            self._open = False
            self._owner.lost(self.peer, f"connection lost ({why})")


class InprocLinks:
    """One rank's links to the other ranks of its in-process job."""

    def __init__(self, rank: int, nonce: bytes) -> None:
        self.rank = rank
        self.nonce = nonce
        self.conns: dict[int, InprocLink] = {}
        self._route: Route | None = None
        self._sink: Sink | None = None
        self._lost: Lost | None = None
        self._closing = False
        self._early: list[tuple[int, frames.Frame, memoryview | None]] = []  # before ``attach``

    def attach(self, route: Route, sink: Sink, lost: Lost) -> None:
        """Where frames from the peers go (the world's router); frames that came first follow."""
        self._route, self._sink, self._lost = route, sink, lost
        early, self._early = self._early, []
        for peer, frame, payload in early:
            route(peer, frame, payload)

    def route(self, peer: int, frame: frames.Frame, payload: memoryview | None) -> None:
        if self._route is None:
            self._early.append((peer, frame, payload))
        else:
            self._route(peer, frame, payload)

    def sink(self, peer: int, frame: frames.Frame, nbytes: int) -> memoryview | wire.Stream | None:
        return self._sink(peer, frame, nbytes) if self._sink is not None else None

    def lost(self, peer: int, reason: str) -> None:
        if not self._closing and self._lost is not None:
            self._lost(peer, reason)

    def link(self, peer: int) -> InprocLink | None:
        """The link to ``peer`` (all are made when the job forms)."""
        return self.conns.get(peer)

    def is_local(self, peer: int) -> bool:
        """In-process links are no sockets."""
        return False

    def send(self, peer: int, frame: frames.Frame, payload: memoryview | None = None) -> InprocLink:
        """Send ``frame`` to ``peer``; ``KeyError`` if there is no link to it."""
        link = self.conns[peer]
        link.send(frames.encode(frame), payload)
        return link

    def forget(self, peer: int, reason: str, left: bool = False) -> None:
        """(Every in-process link exists from the start: nothing waits for one.)"""

    async def close(self, timeout: float, gone: Collection[int] = ()) -> None:
        """Close every link (the peers see it after what was sent before)."""
        self._closing = True
        for link in self.conns.values():
            link.close("closed by peer")
        self.conns.clear()

    def abort(self) -> None:
        """Drop every link without a goodbye, as a crash would."""
        self._closing = True
        for link in self.conns.values():
            link.close("the peer crashed")
        self.conns.clear()


@dataclass
class _Job:
    world_size: int
    arrived: dict[int, asyncio.Future[InprocLinks]] = field(default_factory=dict)
    nonce: bytes = field(default_factory=lambda: os.urandom(8))


_jobs: dict[tuple[int, str], _Job] = {}  # by (id of the event loop, job name)


async def join(job: str, world_size: int, rank: int, timeout: float) -> InprocLinks:
    """Meet the other ``world_size - 1`` ranks of ``job`` in this event loop.

    ``rank`` -1 takes the lowest free rank. Raises ``RendezvousError`` for a conflicting
    world size or rank, or when the others do not all arrive within ``timeout``.
    """
    loop = asyncio.get_running_loop()
    key = (id(loop), job)
    entry = _jobs.setdefault(key, _Job(world_size))
    if entry.world_size != world_size:
        raise RendezvousError(
            f"inproc://{job} has world size {entry.world_size}; this rank asked for {world_size}"
        )
    if rank == -1:
        rank = min(set(range(world_size)) - set(entry.arrived), default=-1)
    if not 0 <= rank < world_size:
        raise RendezvousError(f"inproc://{job}: rank {rank} is not in 0..{world_size - 1} or the job is full")
    if rank in entry.arrived:
        raise RendezvousError(f"inproc://{job}: rank {rank} joined twice")
    mine: asyncio.Future[InprocLinks] = loop.create_future()
    entry.arrived[rank] = mine
    if len(entry.arrived) == world_size:
        _link_all(entry)
        del _jobs[key]  # the next round of this job name starts afresh
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(mine)
    except TimeoutError:
        missing = sorted(set(range(world_size)) - set(entry.arrived))
        raise RendezvousError(f"inproc://{job}: ranks {missing} did not join within {timeout:g}s") from None
    finally:
        if not mine.done():  # gave up (timeout or cancelled): free the place
            entry.arrived.pop(rank, None)
            if not entry.arrived:
                _jobs.pop(key, None)


def _link_all(entry: _Job) -> None:
    members = {r: InprocLinks(r, entry.nonce) for r in entry.arrived}
    for a, links in members.items():
        for b in members:
            if a != b:
                links.conns[b] = InprocLink(links, b)
    for a, links in members.items():
        for b, link in links.conns.items():
            link.other = members[b].conns[a]
    for r, fut in entry.arrived.items():
        if not fut.done():
            fut.set_result(members[r])
