"""Shared-memory link control: the hello / offer / answer / free exchange with each peer.

``shm.Channels`` holds the segments; this module speaks the frames that set them up and give
ranges back. Each side says hello when a peer connection opens (connections open on first use,
so links to peers a rank never talks to are never set up). Peers elsewhere (or that cannot map
our segment) stay on the socket only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

from . import frames, shm
from .errors import ProtocolError

log = logging.getLogger("arendez.shm")

Send = Callable[[int, frames.Frame], object]


class ShmControl:
    """The control plane of one rank's shared-memory links."""

    def __init__(self, rank: int, channels: shm.Channels, send: Send) -> None:
        self.rank = rank
        self.channels = channels
        self._send = send
        self._peers: Collection[int] = ()
        self._settled: asyncio.Future[None] | None = None
        self._flush: asyncio.Handle | None = None

    def hello(self, peer: int) -> None:
        """A connection to ``peer`` just opened: tell it our host key (both sides do)."""
        if self.channels.allowed:
            self._send(peer, frames.ShmHello(self.channels.host))

    async def open(self, peers: Collection[int], timeout: float) -> None:
        """Wait (at most ``timeout``) until the links to ``peers`` (already greeted with
        ``hello``) are settled; offers still unanswered then fall back to TCP."""
        if not self.channels.allowed:
            return
        self._peers = peers
        self._settled = asyncio.get_running_loop().create_future()
        try:
            self.check_settled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._settled
        finally:
            self._settled = None
            self.channels.abandon_unanswered()  # no answer in time (or init was cancelled): TCP only

    def check_settled(self) -> None:
        """Wake ``open`` once every peer has answered (or is gone)."""
        done = self._settled
        if done is not None and not done.done() and all(p in self.channels.settled for p in self._peers):
            done.set_result(None)

    def on_frame(self, peer: int, frame: frames.Frame) -> None:
        """Handle one control frame from ``peer``."""
        channels = self.channels
        try:
            if isinstance(frame, frames.ShmHello):
                try:
                    offer = channels.on_hello(peer, frame.host)
                except shm.ShmUnavailable as exc:
                    log.info("rank %d: no shared memory for rank %d: %s", self.rank, peer, exc)
                else:
                    if offer is not None:
                        self._send(peer, frames.ShmOffer(*offer))
            elif isinstance(frame, frames.ShmOffer):
                accepted, why = channels.on_offer(peer, frame.path, frame.size, frame.cookie)
                self._send(peer, frames.ShmAnswer(accepted, why))
            elif isinstance(frame, frames.ShmAnswer):
                if not channels.on_answer(peer, frame.accepted):
                    log.info("rank %d: rank %d takes no shared memory: %s", self.rank, peer, frame.why)
            elif isinstance(frame, frames.ShmFree):
                channels.on_free(peer, frame.offsets)
        except ValueError as exc:
            raise ProtocolError(f"bad shared-memory frame from rank {peer}: {exc}") from None
        self.check_settled()

    def free(self, peer: int, lease: int) -> None:
        """Let ``peer`` reuse the range at ``lease`` of its segment (batched: one frame per
        peer per loop turn)."""
        if self.channels.free(peer, lease) and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._flush_frees)

    def _flush_frees(self) -> None:
        self._flush = None
        for peer, offsets in self.channels.take_frees():
            self._send(peer, frames.ShmFree(offsets))

    def drop(self, peer: int) -> None:
        """``peer`` is gone: its link goes with it."""
        self.channels.drop(peer)
        self.check_settled()
