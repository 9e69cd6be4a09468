"""The link to a peer being dialed (``Mesh.link``): frames sent meanwhile queue, in order, until
the connection is up, then go out ahead of anything else."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from .. import transport


def _resolve(fut: asyncio.Future[None], _: object) -> None:
    if not fut.done():
        fut.set_result(None)


class DialFailed(ConnectionResetError):
    """A send on a link whose dial failed; ``peer`` names the rank it was meant for."""

    def __init__(self, peer: int, error: BaseException | None) -> None:
        self.peer = peer
        super().__init__(f"could not connect to rank {peer}: {error}")


class PendingLink:
    """The link to a peer being dialed: frames queue (in order) until the connection is up."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.conn: transport.Connection | None = None
        self.error: BaseException | None = None
        self._queued: list[tuple[Any, memoryview | bytes | None]] = []
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def is_open(self) -> bool:
        if self.conn is not None:
            return self.conn.is_open
        return self.error is None

    def send(self, header: Any, payload: memoryview | bytes | None = None) -> None:
        """Send now if connected, else queue (the payload is referenced until it went out)."""
        if self.conn is not None:
            self.conn.send(header, payload)
        elif self.error is not None:
            raise DialFailed(self.peer, self.error)
        else:
            self._queued.append((header, payload))

    def drain_future(self) -> asyncio.Future[None] | None:
        """Resolves once every queued frame is in the kernel; ``None`` if nothing waits."""
        if self.conn is not None:
            return self.conn.drain_future()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.error is not None:
            fut.set_exception(DialFailed(self.peer, self.error))
        elif not self._queued:
            return None
        else:
            self._waiters.append(fut)
        return fut

    async def drain(self) -> None:
        fut = self.drain_future()
        if fut is not None:
            await fut

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> memoryview | None:
        """As ``Connection.divert``; nothing arrives on a link not yet connected."""
        if self.conn is not None:
            return self.conn.divert(should, keep=keep)
        return None

    def attach(self, conn: transport.Connection) -> None:
        """The connection is up: send what queued, in order, and hand the waiters to it."""
        self.conn = conn
        queued, self._queued = self._queued, []
        waiters, self._waiters = self._waiters, []
        try:
            for header, payload in queued:
                conn.send(header, payload)
        except ConnectionError as exc:
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(ConnectionResetError(str(exc)))
            return
        drained = conn.drain_future()
        for fut in waiters:
            if drained is None:
                if not fut.done():
                    fut.set_result(None)
            else:
                drained.add_done_callback(functools.partial(_resolve, fut))

    def fail(self, exc: BaseException) -> None:
        """The dial failed: drop what queued and wake the waiters with a ``ConnectionError``."""
        if self.conn is not None or self.error is not None:
            return
        self.error = exc
        self._queued.clear()
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(ConnectionResetError(f"could not connect to rank {self.peer}: {exc}"))
