"""The collective running on a process group (``Op``).

Each collective is an ``Op``: it has the group's next sequence number and a fingerprint
(collective, op, dtype, count) carried by every frame, so ranks that started different
collectives at the same sequence number fail with ``CollectiveMismatchError`` instead of
exchanging garbage. An ``Op`` fails as a unit: a dead peer, a deadline or a destroy wakes every
future it waits on with the same error. Its receives go through the world's ``Mailbox``; a
receive posted before its frame arrives gets the payload written straight into its buffer (once
the op has ended, what is still arriving for it is diverted: its buffers are never written again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import frames, wire
from .arrays import Combine, byte_view
from .errors import (
    RankFailedError,
)
from .fold import Fold
from .mailbox import Key, Slot, give, settle
from .settings import env_int

if TYPE_CHECKING:
    from .group import ProcessGroup

T = TypeVar("T")
Array = np.ndarray[Any, Any]

#: Deadlines this close to now count as passed (event-loop timers round to the millisecond).
TIMER_SLACK = 0.001
#: How long before its deadline a collective asks its peers how far they got (at most this, and
#: at most a tenth of its timeout), so that it raises at its deadline with the answer, not after.
DIAGNOSE_SECONDS = 1.0
#: The least time peers get to answer that question (a very short timeout raises this much late).
DIAGNOSE_MIN_SECONDS = 0.05
#: How long a send waits for room in a full shared-memory ring before it goes inline instead.
SHM_ROOM_WAIT = env_int("ARENDEZ_SHM_ROOM_WAIT_MS", 100, minimum=0) / 1000

__all__ = ["Op"]


class LinkGone(ConnectionResetError):
    """No link to ``peer``, whose loss is not blamed yet (seen just after a stall): ``reason``
    says what closed it."""

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(reason)
        self.peer, self.reason = peer, reason


class Op:
    """One collective in flight: the ``Comm`` its algorithm runs over."""

    def __init__(self, group: ProcessGroup, seq: int, name: str, fp: str) -> None:
        self.group = group
        self.world = group.world
        self.seq = seq
        self.name = name
        self.fp = fp
        self.rank = group.rank
        self.size = group.size
        self.error: BaseException | None = None
        self.algorithm = ""  # the one the collective ran (set by ``algorithms``; flight recorder)
        self.keys: list[Key] = []
        self._held: dict[int, Callable[[], None]] = {}  # id(view) -> how to give it back
        self._waiting: set[asyncio.Future[Any]] = set()  # what fail() must wake
        self.deadline = 0.0  # loop time its deadline passes (``ProcessGroup.run`` sets it)
        self.watch_at = 0.0  # loop time to ask the peers' progress: a little before the deadline
        self.limit = 0.0
        self.expiring = False
        self.ended = False
        self._done: asyncio.Future[None] | None = None

    @property
    def done(self) -> asyncio.Future[None]:
        """Resolves once the collective has ended here (made on demand: most are never awaited)."""
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            if self.ended:
                self._done.set_result(None)
        return self._done

    def _end(self) -> None:
        self.ended = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def choose(self, collective: str, nbytes: int, size: int, link: str | None = None) -> str:
        """The algorithm for this message (``algorithms.Chooser`` of the world)."""
        return self.world.chooser(collective, nbytes, size, link)

    def fail(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc
        waiting, self._waiting = self._waiting, set()
        for fut in waiting:
            settle(fut, exc)

    def _wait_on(self, fut: asyncio.Future[Any]) -> None:
        self._waiting.add(fut)
        fut.add_done_callback(self._waiting.discard)  # done ones (and their buffers) let go

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _conn(self, peer: int) -> Any:
        world = self.world
        target = self.group.ranks[peer]
        conn = world.connection(target)
        if conn is None:
            reason = world.why_gone(target)
            if target not in world.dead and world.doubting():
                raise LinkGone(target, reason)  # (blamed once the server is heard: World.blame)
            exc = RankFailedError(target, self.name, reason)
            self.fail(exc)
            raise exc
        return conn

    def hold(self, view: memoryview, give_back: Callable[[], None]) -> None:
        """``view`` is borrowed (a peer's shared memory, a pooled buffer): give it back on
        ``release`` or when the op ends."""
        self._held[id(view)] = give_back

    def release(self, buffer: memoryview) -> None:
        give(self._held.pop(id(buffer), None))

    def release_all(self) -> None:
        """Give back what this op still borrows (it has ended)."""
        held, self._held = self._held, {}
        for give_back in held.values():
            give_back()

    def _send_shm(self, target: int, conn: Any, tag: int, raw: memoryview) -> bool | asyncio.Future[None]:
        """Copy ``raw`` into our segment for ``target`` and send where it lies: True if done,
        False if there is no segment for it (the caller sends it inline), or a future while the
        ring is full (it resolves once sent: through the ring, or inline if none comes free)."""
        channels = self.world.shm
        if not channels.carries(target, raw.nbytes):
            return False
        room = channels.reserve(target, raw.nbytes)
        if room is None:
            if not channels.fits(target, raw.nbytes):  # larger than the whole ring
                self.world.stats.shm_full += 1
                return False
            return self._send_when_room(target, conn, tag, raw)
        self._put_shm(conn, tag, raw, room)
        return True

    def _put_shm(self, conn: Any, tag: int, raw: memoryview, room: tuple[int, memoryview]) -> None:
        offset, dest = room
        dest[:] = raw if raw.ndim == 1 else raw.cast("B")
        frame = frames.ShmData(self.group.gid, self.seq, tag, 0, self.fp, offset, raw.nbytes)
        conn.send(frames.encode(frame))

    def _send_when_room(self, target: int, conn: Any, tag: int, raw: memoryview) -> asyncio.Future[None]:
        """Wait (first come first served) for ``target`` to hand back room in our ring, and send
        through it; inline (counted in ``shm_full``) if none comes within ``SHM_ROOM_WAIT``: a
        peer that has not started this collective yet holds on to its part of the ring."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._wait_on(fut)  # (a failure of the op settles it)
        channels = self.world.shm
        self.world.stats.shm_waits += 1

        def inline() -> None:
            self.world.stats.shm_full += 1
            try:
                drained = self._send_inline(conn, tag, raw)
            except BaseException as exc:  # (the peer is gone: the op fails with it)
                settle(fut, exc)
                return
            if drained is None:
                fut.set_result(None)
            else:
                drained.add_done_callback(follow)

        def follow(drained: asyncio.Future[None]) -> None:
            if fut.done():
                return
            if drained.cancelled():
                fut.cancel()
            elif (exc := drained.exception()) is not None:
                settle(fut, exc)
            else:
                fut.set_result(None)

        def retry() -> bool:
            if fut.done():  # the op failed while this waited
                timer.cancel()
                return True
            if not channels.carries(target, raw.nbytes):  # the link went
                timer.cancel()
                inline()
                return True
            room = channels.reserve(target, raw.nbytes, queued=True)
            if room is None:
                return False
            timer.cancel()
            self._put_shm(conn, tag, raw, room)
            fut.set_result(None)
            return True

        def give_up() -> None:
            channels.stop_waiting(target, retry)
            if not fut.done():
                inline()

        timer = loop.call_later(SHM_ROOM_WAIT, give_up)
        channels.wait_room(target, retry)
        return fut

    def send(self, peer: int, tag: int, data: Array) -> Awaitable[None] | None:
        self._check()
        conn = self._conn(peer)
        raw = byte_view(data)
        through = self._send_shm(self.group.ranks[peer], conn, tag, raw)
        if through is True:
            return None  # copied: the caller may reuse ``data`` at once
        if through is not False:
            return through
        return self._send_inline(conn, tag, raw)

    def _send_inline(self, conn: Any, tag: int, raw: memoryview) -> asyncio.Future[None] | None:
        """Send ``raw`` over the connection itself; the drain future if it must be awaited."""
        gid = self.group.gid
        if raw.nbytes <= wire.MAX_SEGMENT:
            conn.send(frames.data_header(gid, self.seq, tag, 0, self.fp), raw if raw.nbytes else None)
        else:
            for seg, start in enumerate(range(0, raw.nbytes, wire.MAX_SEGMENT)):
                part = raw[start : start + wire.MAX_SEGMENT]
                conn.send(frames.data_header(gid, self.seq, tag, seg, self.fp), part)
        fut: asyncio.Future[None] | None = conn.drain_future()
        if fut is not None:
            self._wait_on(fut)
        return fut

    def _slot(self, peer: int, tag: int, seg: int) -> tuple[Key, Slot | None]:
        key = (self.group.ranks[peer], self.group.gid, self.seq, tag, seg)
        slot = self.world.mail.peek(key)
        if slot is not None and slot.data is not None and slot.fp != self.fp:
            self.group.mismatch(self.seq, self.fp, slot.fp, key[0])
            self._check()
        return key, slot

    def _wait_slot(
        self, key: Key, out: memoryview | None, any_buffer: bool = False, fold: Fold | None = None
    ) -> asyncio.Future[Any]:
        fut = self.world.mail.post(key, out, self.fp, any_buffer=any_buffer, fold=fold)
        self.keys.append(key)
        self._wait_on(fut)
        target = key[0]
        if target in self.world.dead:
            self.fail(RankFailedError(target, self.name, self.world.dead[target]))
        else:
            self.world.connection(target)  # connect on first use: its loss is seen while we wait
        return fut

    def recv_into(self, peer: int, tag: int, out: Array) -> Awaitable[None]:
        self._check()
        raw = byte_view(out)
        parts = [raw[i : i + wire.MAX_SEGMENT] for i in range(0, raw.nbytes, wire.MAX_SEGMENT)]
        futs: list[asyncio.Future[Any]] = []
        for seg, part in enumerate(parts or [raw]):
            key, slot = self._slot(peer, tag, seg)
            if slot is not None and slot.data is not None:  # it came before we asked
                self.world.mail.take(key)
                try:
                    self._same_size(key, slot.data.nbytes, part.nbytes)
                    if part.nbytes:
                        part[:] = slot.data
                        if not slot.shared:  # (out of shared memory it is the transfer's one copy)
                            self.world.stats.copied_bytes += part.nbytes
                            self.world.stats.copied_messages += 1
                finally:
                    give(slot.give_back)
                continue
            futs.append(self._wait_slot(key, part))
        if not futs:
            return _done()
        return futs[0] if len(futs) == 1 else _gather(futs)

    def _same_size(self, key: Key, got: int, want: int) -> None:
        """A message that came early must be the size this rank receives; else both mismatch."""
        if got != want:
            self.group.mismatch(self.seq, f"{self.fp} ({want} bytes)", f"{got} bytes", key[0])
            self._check()

    def recv_reduce(self, peer: int, tag: int, src: Array, out: Array, ufunc: Combine) -> Awaitable[None]:
        """Receive a message of ``out.nbytes`` and set ``out = ufunc(src, message)`` (``out`` may
        be ``src``). Over a socket the payload is reduced piece by piece as it arrives
        (``fold.Fold``); a message that came early or through shared memory is reduced whole."""
        self._check()
        raw = byte_view(out)
        fold = Fold(src, out, ufunc, raw)
        if raw.nbytes > wire.MAX_SEGMENT:  # (a message of several frames: reduce once it is all here)
            whole = np.empty(raw.nbytes, np.uint8)
            return _fold_whole(self.recv_into(peer, tag, whole), whole, fold)
        key, slot = self._slot(peer, tag, 0)
        if slot is not None and slot.data is not None:  # it came before we asked
            self.world.mail.take(key)
            try:
                self._same_size(key, slot.data.nbytes, raw.nbytes)
                fold.write(slot.data)
            finally:
                give(slot.give_back)
            if fold.error is not None:
                raise fold.error
            return _done()
        return self._wait_slot(key, raw, fold=fold)

    def link_kind(self) -> str:
        """``"shm"`` if every rank is on this host with shared memory on, else ``"tcp"``.

        The algorithm choice depends on it, so every rank must get the same answer: it is the
        rendezvous round's (``Group.link_kind``), not what this rank's open links say.
        """
        return self.group.link_kind()

    def scratch(self, nbytes: int) -> Array:
        return self.world.pool.take(nbytes)

    def recycle(self, buffer: Array) -> None:
        self.world.pool.give(buffer)

    def recv_any(self, peer: int, tag: int, scratch: Array | None = None) -> Awaitable[memoryview]:
        self._check()
        key, slot = self._slot(peer, tag, 0)
        if slot is not None and slot.data is not None:
            self.world.mail.take(key)
            if slot.give_back is not None:
                self.hold(slot.data, slot.give_back)
            return _done(slot.data)
        if scratch is None or scratch.nbytes > wire.MAX_SEGMENT:
            return self._wait_slot(key, None)
        return self._wait_slot(key, byte_view(scratch), any_buffer=True)


async def _fold_whole(received: Awaitable[None], whole: Array, fold: Fold) -> None:
    await received
    fold.write(byte_view(whole))
    if fold.error is not None:
        raise fold.error


async def _gather(futs: list[asyncio.Future[Any]]) -> None:
    await asyncio.gather(*futs)


def _done(value: Any = None) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut
