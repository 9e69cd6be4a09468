"""Process groups and the collective running on one (``Op``).

Each collective is an ``Op``: it has the group's next sequence number and a fingerprint
(collective, op, dtype, count) carried by every frame, so ranks that started different
collectives at the same sequence number fail with ``CollectiveMismatchError`` instead of
exchanging garbage. An ``Op`` fails as a unit: a dead peer, a deadline or a destroy wakes every
future it waits on with the same error. Its receives go through the world's ``Mailbox``; a
receive posted before its frame arrives gets the payload written straight into its buffer (once
the op has ended, what is still arriving for it is diverted: its buffers are never written again).

A collective fails on every member together: a mismatch (``MISMATCH``) or a cancelled task
(``CANCEL``, ``CollectiveCancelledError`` on the others) fails its sequence number at once where
it runs and, on a member that has not reached it yet, as soon as it starts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import frames, wire
from .arrays import byte_view
from .errors import (
    ArendezError,
    CollectiveCancelledError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupDestroyedError,
    InvalidArgumentError,
    NotInitializedError,
    RankFailedError,
)
from .fold import Fold
from .mailbox import Key, Slot, Stats, give, settle

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger("arendez.group")

T = TypeVar("T")
Array = np.ndarray[Any, Any]

#: Deadlines this close to now count as passed (event-loop timers round to the millisecond).
TIMER_SLACK = 0.001
#: How long before its deadline a collective asks its peers how far they got (at most this, and
#: at most a tenth of its timeout), so that it raises at its deadline with the answer, not after.
DIAGNOSE_SECONDS = 1.0
#: The least time peers get to answer that question (a very short timeout raises this much late).
DIAGNOSE_MIN_SECONDS = 0.05

__all__ = ["GroupMember", "Op", "ProcessGroup", "Stats"]


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

    def _send_shm(self, target: int, conn: Any, tag: int, raw: memoryview) -> bool:
        """Copy ``raw`` into our segment for ``target`` and send where it lies; False if there
        is no segment or no room in it now (the caller sends it inline instead)."""
        channels = self.world.shm
        if not channels.carries(target, raw.nbytes):
            return False
        room = channels.reserve(target, raw.nbytes)
        if room is None:
            self.world.stats.shm_full += 1
            return False
        offset, dest = room
        dest[:] = raw if raw.ndim == 1 else raw.cast("B")
        frame = frames.ShmData(self.group.gid, self.seq, tag, 0, self.fp, offset, raw.nbytes)
        conn.send(frames.encode(frame))
        return True

    def send(self, peer: int, tag: int, data: Array) -> Awaitable[None] | None:
        self._check()
        conn = self._conn(peer)
        raw = byte_view(data)
        gid = self.group.gid
        if self._send_shm(self.group.ranks[peer], conn, tag, raw):
            return None  # copied: the caller may reuse ``data`` at once
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
                    if slot.data.nbytes != part.nbytes:
                        theirs = f"{slot.data.nbytes} bytes"
                        self.group.mismatch(self.seq, f"{self.fp} ({part.nbytes} bytes)", theirs, key[0])
                        self._check()
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

    def recv_reduce(self, peer: int, tag: int, src: Array, out: Array, ufunc: np.ufunc) -> Awaitable[None]:
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
                if slot.data.nbytes != raw.nbytes:
                    theirs = f"{slot.data.nbytes} bytes"
                    self.group.mismatch(self.seq, f"{self.fp} ({raw.nbytes} bytes)", theirs, key[0])
                    self._check()
                fold.write(slot.data)
            finally:
                give(slot.give_back)
            if fold.error is not None:
                raise fold.error
            return _done()
        return self._wait_slot(key, raw, fold=fold)

    def link_kind(self) -> str:
        """``"shm"`` if every peer said hello from this host (shared memory on), else ``"tcp"``.

        The algorithm choice depends on it, so both ends of a pair must agree: host keys are
        compared the same way on both, and init has every peer's hello before it returns.
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


class GroupMember:
    """Markers shared with torch: a rank outside a group gets ``NON_GROUP_MEMBER``."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = object()


@dataclass(eq=False)
class ProcessGroup:
    """A set of ranks of one world that run collectives together."""

    world: World
    gid: int
    ranks: list[int]
    timeout: float
    active: dict[int, Op] = field(default_factory=dict)
    next_seq: int = 0
    closing: bool = False
    destroyed: bool = False
    early_fps: dict[int, tuple[int, str]] = field(default_factory=dict)
    early_keys: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    poisoned: dict[int, ArendezError] = field(default_factory=dict)  # seqs failed before they start

    # (size of the same-host set the link kind was computed for, the kind)
    _link: tuple[int, str] = field(default=(-1, ""), init=False, repr=False)
    _watchdog: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _watch_at: float = field(default=0.0, init=False, repr=False)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.world.rank)

    def link_kind(self) -> str:
        """``"shm"`` if every member said hello from this host (shared memory on), else ``"tcp"``
        (``Op.link_kind``; recomputed only when the same-host set changes)."""
        same = self.world.shm.same_host
        if self._link[0] != len(same):
            me = self.world.rank
            self._link = (len(same), "shm" if all(g == me or g in same for g in self.ranks) else "tcp")
        return self._link[1]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise InvalidArgumentError(
                f"{what} {global_rank} is not in this group (ranks {self.ranks})"
            ) from None

    def check_usable(self, name: str = "this group") -> None:
        """Raise if collective ``name`` cannot start: the group is destroyed or a member failed."""
        if self.destroyed:
            raise NotInitializedError(
                "this process group was destroyed; call init_process_group() (or new_group()) again"
            )
        if self.closing:
            raise GroupDestroyedError("the process group is being destroyed")
        if self.world.expulsion is not None:  # (not the peers that left because of it)
            raise RankFailedError(self.world.rank, name, self.world.expulsion)
        for peer in self.ranks:  # (a peer that left cleanly may have sent all we still need)
            if peer in self.world.failed:
                raise RankFailedError(peer, name, self.world.failed[peer])

    async def run(
        self, name: str, fp: str, body: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run ``body(op)`` as the group's next collective, under its deadline."""
        flight = self.world.flight
        try:
            self.check_usable(name)
        except RankFailedError as exc:
            flight.refused(self, name, fp, exc)
            raise
        seq = self.next_seq
        self.next_seq += 1
        op = Op(self, seq, name, fp)
        self.active[seq] = op
        entry = flight.begin(op)
        op.keys.extend(self.early_keys.pop(seq, ()))
        early = self.early_fps.pop(seq, None)
        if early is not None and early[1] != fp:
            self.mismatch(seq, fp, early[1], early[0])
        failed = self.poisoned.pop(seq, None)
        if failed is not None:
            op.fail(failed)
        limit = self.timeout if timeout is None else timeout
        op.limit = limit
        op.deadline = asyncio.get_running_loop().time() + limit
        op.watch_at = op.deadline - min(DIAGNOSE_SECONDS, limit / 10)
        self._arm(op.watch_at)
        try:
            op._check()
            if entry is not None:
                entry.started = time.time_ns()
            result = await body(op)
            op._check()
            return result
        except ArendezError as exc:
            op.fail(exc)
            raise
        except ConnectionError as exc:
            peer = self._first_dead_member()
            if peer < 0:  # none known dead: the rank whose connection failed
                peer = getattr(exc, "peer", -1)
            err = RankFailedError(peer, name, f"connection lost ({exc})")
            op.fail(err)
            raise err from None
        except asyncio.CancelledError:
            self.cancelled(op)
            raise  # (asyncio.timeout, TaskGroup and task.cancel() rely on it)
        except BaseException as exc:
            op.fail(exc)
            raise
        finally:
            if entry is not None:  # (before its receives are closed: they say whom it missed)
                flight.end(entry, op)
            del self.active[seq]
            if op.error is not None:  # what is still arriving for it must not land in its buffers
                gid = self.gid
                self.world.divert(lambda h, _: isinstance(h, frames.Data) and h.gid == gid and h.seq == seq)
            self.world.mail.close(op.keys)  # (what came but was never taken is given back)
            op.release_all()
            op._end()

    def _arm(self, deadline: float) -> None:
        """Make the group's one deadline timer fire by ``deadline`` (one timer per group, not
        one per collective: most end long before theirs)."""
        if self._watchdog is None or deadline < self._watch_at:
            if self._watchdog is not None:
                self._watchdog.cancel()
            self._watch_at = deadline
            self._watchdog = asyncio.get_running_loop().call_at(deadline, self._watch)

    def _watch(self) -> None:
        """Expire the collectives whose deadline is near (``Op.watch_at``); re-arm for the next."""
        self._watchdog = None
        now = asyncio.get_running_loop().time() + TIMER_SLACK  # (a timer may fire a tick early)
        upcoming: float | None = None
        for op in list(self.active.values()):
            if op.expiring:
                continue
            if op.watch_at <= now:
                op.expiring = True
                self._expire(op, op.limit)
            elif upcoming is None or op.watch_at < upcoming:
                upcoming = op.watch_at
        if upcoming is not None:
            self._arm(upcoming)

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _first_dead_member(self) -> int:
        """The member whose loss most likely broke a connection (-1 if none is known dead)."""
        for peer in self.ranks:
            if peer in self.world.dead:
                return peer
        return -1

    def _expire(self, op: Op, limit: float) -> None:
        async def diagnose() -> None:
            loop = asyncio.get_running_loop()
            peers = [g for g in self.ranks if g != self.world.rank]
            answer_by = max(op.deadline - loop.time(), DIAGNOSE_MIN_SECONDS)
            progress, asked = await self.world.progress.ask(self.gid, peers, answer_by)
            if op.deadline > loop.time():  # answered early: the collective may still finish
                await asyncio.sleep(op.deadline - loop.time())
            missing = [g for g in asked if g in progress and progress[g] <= op.seq]
            silent = [g for g in asked if g not in progress]
            op.fail(CollectiveTimeoutError(f"{op.name} (seq {op.seq})", limit, missing, silent))

        if op.error is None and op.seq in self.active:
            task = asyncio.get_running_loop().create_task(diagnose())
            op.done.add_done_callback(lambda _: task.cancel())

    def mismatch(self, seq: int, mine: str, theirs: str, peer: int) -> None:
        """Fail collective ``seq`` here and tell every other member why."""
        message = f"collective #{seq}: rank {self.world.rank} runs {mine}, rank {peer} runs {theirs}"
        self.poison(seq, message, tell=True)

    def poison(self, seq: int, message: str, *, tell: bool) -> None:
        """Fail collective ``seq`` with ``CollectiveMismatchError(message)``; with ``tell``, tell
        every other member too."""
        if self.fail_seq(seq, CollectiveMismatchError(message)) and tell:
            for peer in self.ranks:
                if peer != self.world.rank:
                    self.world.send_control(peer, frames.Mismatch(self.gid, seq, message), dial=True)

    def fail_seq(self, seq: int, exc: ArendezError) -> bool:
        """Fail collective ``seq`` with ``exc``: now if it runs, when it starts if this rank has
        not reached it yet (so sequence numbers stay aligned). False if it had already failed
        or ended."""
        op = self.active.get(seq)
        if op is not None:
            if op.error is not None:
                return False
            op.fail(exc)
            return True
        if seq < self.next_seq or seq in self.poisoned:
            return False
        self.poisoned[seq] = exc
        return True

    def cancelled(self, op: Op) -> None:
        """This rank's task running ``op`` was cancelled: end it here and tell every member,
        whose copy of it fails with ``CollectiveCancelledError`` (at once, or when they start it).
        """
        op.fail(CollectiveCancelledError(self.world.rank, op.name, op.seq))
        for peer in self.ranks:
            if peer != self.world.rank:
                self.world.send_control(peer, frames.Cancel(self.gid, op.seq, op.name))

    async def drain(self, deadline: float) -> None:
        """Mark closing, let in-flight collectives finish by ``deadline`` (loop time), fail the
        rest."""
        self.closing = True
        loop = asyncio.get_running_loop()
        pending = [op.done for op in self.active.values()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
        leftovers = list(self.active.values())
        for op in leftovers:
            op.fail(GroupDestroyedError(f"{op.name} cancelled: the process group was destroyed"))
        self.world.p2p.fail_group(
            self.gid, GroupDestroyedError("recv cancelled: the process group was destroyed")
        )
        if leftovers:  # their awaiters wake on the next loop turns
            await asyncio.wait([op.done for op in leftovers], timeout=max(0.0, deadline - loop.time()))
        for keys in self.early_keys.values():  # frames of collectives this rank never started
            self.world.mail.drop(keys)
        self.early_keys.clear()
        self._disarm()
        self.destroyed = True
