"""Peer addresses for the mesh: those the rendezvous gave, the rest fetched from the store on
first use, one batch per event-loop turn (peers dialed in the same turn share one request)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..errors import ProtocolError

Resolver = Callable[[list[int]], Awaitable[dict[int, str]]]

#: How an address not yet fetched reads in an error message.
UNFETCHED = "(address not fetched)"


class AddressBook:
    """Each peer's advertised address, by rank."""

    def __init__(self) -> None:
        self.known: dict[int, str] = {}
        self.resolve: Resolver | None = None
        self._wanted: set[int] = set()  # to ask the store for in the next batch
        self._batch: asyncio.Task[None] | None = None

    def describe(self, peer: int) -> str:
        """``peer``'s address for a message (``UNFETCHED`` if not known)."""
        return self.known.get(peer, UNFETCHED)

    async def lookup(self, peer: int) -> str:
        """``peer``'s address; unknown ones are fetched from the store in one batch per turn."""
        if peer not in self.known:
            if self.resolve is None:
                raise ProtocolError(f"the address of rank {peer} is unknown")
            self._wanted.add(peer)
            if self._batch is None:
                self._batch = asyncio.get_running_loop().create_task(self._fetch())
            await asyncio.shield(self._batch)
        if peer not in self.known:
            raise ProtocolError(f"the store does not know the address of rank {peer}")
        return self.known[peer]

    async def _fetch(self) -> None:
        await asyncio.sleep(0)  # lookups started in this loop turn join the batch
        wanted, self._wanted, self._batch = sorted(self._wanted), set(), None
        assert self.resolve is not None
        self.known.update(await self.resolve(wanted))

    def cancel(self) -> None:
        """Stop a fetch under way (the mesh is closing)."""
        if self._batch is not None:
            self._batch.cancel()
