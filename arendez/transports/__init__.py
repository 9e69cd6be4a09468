"""Peer transports, one per URL scheme: what a ``World`` needs to exchange frames with its peers.

- ``tcp``: one authenticated asyncio connection per pair of ranks that talk, opened on first
  use (``tcp``), with
  same-host payloads through shared memory (``arendez.shm``) when both ranks allow it;
- ``inproc``: ranks that are tasks of one event loop, linked in memory (``inproc``).

``rendezvous.plan`` maps the ``init_method`` scheme to one of them (``Plan.transport``) and
``lifecycle`` builds the world with it. Both give the world a ``Links`` object; everything
above it (``World``, ``Op``, the algorithms) is the same code whichever transport carries
the frames.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Protocol

from .. import frames


class Link(Protocol):
    """One peer connection: frames out, and a way to wait until they left."""

    @property
    def is_open(self) -> bool: ...

    def send(self, header: Any, payload: memoryview | bytes | None = None) -> None: ...

    def drain(self) -> Awaitable[None]: ...

    def drain_future(self) -> Any: ...

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> memoryview | None:
        """Throw away the rest of a payload now arriving whose header ``should`` picks."""
        ...


class Links(Protocol):
    """All of one rank's peer connections, by global rank."""

    @property
    def conns(self) -> Mapping[int, Link]: ...

    @property
    def nonce(self) -> bytes: ...

    def link(self, peer: int) -> Link | None:
        """The link to ``peer`` (the tcp mesh dials it on first use); None if there is none."""
        ...

    def send(self, peer: int, frame: frames.Frame, payload: memoryview | None = None) -> Any: ...

    def is_local(self, peer: int) -> bool:
        """Whether the link to ``peer`` is a same-host Unix socket."""
        ...

    def forget(self, peer: int, reason: str, left: bool = False) -> None:
        """``peer`` is gone by news from elsewhere (the server): stop waiting for a link to it
        (``left``: in good order, not failed)."""
        ...

    async def close(self, timeout: float, gone: Collection[int] = ()) -> None: ...

    def abort(self) -> None: ...
