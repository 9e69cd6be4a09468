"""Matching collective messages to receives, without I/O: frames in, deliveries out.

A message is keyed by ``(sender, group, seq, tag, segment)``. Either side may come first:

- a receive posted first leaves a ``Slot`` with its destination (``out``) and a future; the
  transport asks ``destination`` where the payload should land and it is written there;
- a frame that comes first is stashed (``Slot.data``) until the receive ``take``s it.

A receive may also *fold* its payload into an array (``Slot.fold``, a ``fold.Fold``): the
transport streams the payload through it, reducing piece by piece; a payload that landed
elsewhere (early, or in shared memory) is folded when it is delivered.

The mailbox checks the fingerprint every frame carries against the receive's and reports a
mismatch instead of delivering; it never touches a socket (the tests drive it directly).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CollectiveMismatchError
from .fold import Fold

Array = np.ndarray[Any, Any]
Key = tuple[int, int, int, int, int]  # (sender, gid, seq, tag, segment)


def give(give_back: Callable[[], None] | None) -> None:
    """Return a borrowed buffer (no-op for ``None``)."""
    if give_back is not None:
        give_back()


def settle(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` unless it is done, marking the error retrieved (reported once, elsewhere)."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


class Slot:
    """A receive: where the payload goes (``out``), who waits (``fut``), or data that came early."""

    __slots__ = ("any", "data", "fold", "fp", "fut", "give_back", "out", "shared")

    def __init__(self, fp: str = "") -> None:
        self.any = False  # the receiver takes whichever buffer the payload landed in
        self.out: memoryview | None = None
        self.fut: asyncio.Future[Any] | None = None
        self.data: memoryview | None = None
        self.give_back: Callable[[], None] | None = None  # returns ``data``'s buffer once read
        self.shared = False  # ``data`` lies in the sender's shared memory
        self.fold: Fold | None = None  # reduces the payload into an array instead (``out`` is its view)
        self.fp = fp


@dataclass
class Stats:
    """Counters a benchmark or test can read: payload bytes the receive path had to copy."""

    copied_bytes: int = 0
    copied_messages: int = 0
    received_bytes: int = 0
    #: the part of ``received_bytes`` that came through shared memory, not the socket
    shm_bytes: int = 0
    #: large payloads sent inline because the peer's shared-memory ring stayed full
    shm_full: int = 0
    #: large payloads that found the peer's ring full and waited for room (then took it, or
    #: went inline: ``shm_full``)
    shm_waits: int = 0
    #: peer connections this rank opened or accepted (tcp: on first use, not all pairs)
    connections: int = 0
    #: the part of ``connections`` over a same-host Unix socket (``transports.local``)
    local_connections: int = 0


class Outcome(enum.Enum):
    """What ``Mailbox.deliver`` did with a frame."""

    STASHED = "stashed"  # no receive yet: kept for ``take``
    DELIVERED = "delivered"  # a waiting receive got it
    MISMATCHED = "mismatched"  # a waiting receive of another size: it was failed
    DROPPED = "dropped"  # the receive was already over


class Mailbox:
    """Posted receives and early frames of one world's collectives."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._slots: dict[Key, Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def destination(self, key: Key, fp: str, nbytes: int) -> memoryview | Fold | None:
        """Where an incoming ``nbytes`` payload for ``key`` should land, or the ``Fold`` that
        consumes it (None: not known yet)."""
        slot = self._slots.get(key)
        out = slot.out if slot is not None and slot.fp == fp else None
        if out is None or out.nbytes != nbytes:
            return None
        return out if slot is None or slot.fold is None else slot.fold

    def peek(self, key: Key) -> Slot | None:
        return self._slots.get(key)

    def post(
        self, key: Key, out: memoryview | None, fp: str, *, any_buffer: bool = False, fold: Fold | None = None
    ) -> asyncio.Future[Any]:
        """Wait for message ``key``: written into ``out``, or (``out`` None / ``any_buffer``) the
        buffer it arrived in is the future's result, or (``fold``) reduced by ``fold``, whose
        ``view`` is ``out``."""
        slot = Slot(fp)
        slot.out, slot.any, slot.fold = out, any_buffer, fold
        slot.fut = asyncio.get_running_loop().create_future()
        self._slots[key] = slot
        return slot.fut

    def take(self, key: Key) -> Slot:
        """Remove and return a stashed early frame (``peek`` said it is there)."""
        return self._slots.pop(key)

    def deliver(
        self,
        key: Key,
        fp: str,
        payload: memoryview | None,
        give_back: Callable[[], None] | None,
        *,
        shared: bool,
        hold: Callable[[memoryview, Callable[[], None]], None] | None = None,
    ) -> Outcome:
        """A frame for ``key`` arrived: hand it to its receive, or stash it for a later one."""
        slot = self._slots.get(key)
        if slot is None or slot.fut is None:
            stash = Slot(fp)
            stash.data = payload if payload is not None else memoryview(b"")
            stash.give_back, stash.shared = give_back, shared
            self._slots[key] = stash
            return Outcome.STASHED
        del self._slots[key]
        fut = slot.fut
        if fut.done():
            give(give_back)
            return Outcome.DROPPED
        if slot.out is None or slot.any:
            if hold is not None and give_back is not None and payload is not None:
                hold(payload, give_back)
            fut.set_result(payload if payload is not None else memoryview(b""))
            return Outcome.DELIVERED
        if payload is not None and payload.obj is not slot.out.obj:
            if payload.nbytes != slot.out.nbytes:
                fut.set_exception(
                    CollectiveMismatchError(f"expected {slot.out.nbytes} bytes, got {payload.nbytes}")
                )
                give(give_back)
                return Outcome.MISMATCHED
            if slot.fold is not None:  # (reducing it is no copy: it reads the payload once)
                slot.fold.write(payload)
            else:
                slot.out[:] = payload
                if not shared:  # (copying out of shared memory is the transfer itself, as the kernel's)
                    self.stats.copied_bytes += payload.nbytes
                    self.stats.copied_messages += 1
            give(give_back)
        if slot.fold is not None and slot.fold.error is not None:
            fut.set_exception(slot.fold.error)
        else:
            fut.set_result(None)
        return Outcome.DELIVERED

    def expects(self, keys: Iterable[Key], peer: int) -> bool:
        """True if one of ``keys`` is a receive from ``peer`` still waiting."""
        for key in keys:
            if key[0] == peer:
                slot = self._slots.get(key)
                if slot is not None and slot.fut is not None and not slot.fut.done():
                    return True
        return False

    def drop(self, keys: Iterable[Key]) -> None:
        """Forget frames that came for receives that will never be posted."""
        for key in keys:
            slot = self._slots.get(key)
            if slot is not None and slot.fut is None:
                del self._slots[key]
                give(slot.give_back)

    def close(self, keys: Iterable[Key]) -> None:
        """A collective ended: forget its receives, giving back what came but was never taken."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                give(slot.give_back)


class BufferPool:
    """Work buffers reused across collectives: fresh pages cost a fault each, every call."""

    def __init__(self, budget: int = 64 << 20) -> None:
        self._free: dict[int, list[Array]] = {}
        self._held = 0
        self._budget = budget

    def take(self, nbytes: int) -> Array:
        free = self._free.get(nbytes)
        if free:
            self._held -= nbytes
            return free.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, buffer: Array) -> None:
        if self._held + buffer.nbytes <= self._budget:
            self._free.setdefault(buffer.nbytes, []).append(buffer)
            self._held += buffer.nbytes
