"""Process groups: their members, sequence numbers and timeouts, and the collective running on
each (``op.Op``).

A collective fails on every member together: a mismatch (``MISMATCH``) or a cancelled task
(``CANCEL``, ``CollectiveCancelledError`` on the others) fails its sequence number at once where
it runs and, on a member that has not reached it yet, as soon as it starts it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from . import frames
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
from .mailbox import Stats
from .op import DIAGNOSE_MIN_SECONDS, DIAGNOSE_SECONDS, TIMER_SLACK, LinkGone, Op
from .progress import DIAL_LIMIT

if TYPE_CHECKING:
    from .world import World


T = TypeVar("T")

__all__ = ["GroupMember", "Op", "ProcessGroup", "Stats"]


class GroupMember:
    """Markers shared with torch: a rank outside a group gets ``NON_GROUP_MEMBER`` (-100, as
    torch's)."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = -100


def not_member(group: object) -> bool:
    """Whether ``group`` is what ``new_group`` gave a rank outside it."""
    return type(group) is int and group == GroupMember.NON_GROUP_MEMBER


@dataclass(eq=False)
class ProcessGroup:
    """A set of ranks of one world that run collectives together."""

    world: World
    gid: int
    ranks: Sequence[int]  # (the world's group: a ``range``, the same few bytes at any size)
    timeout: float
    active: dict[int, Op] = field(default_factory=dict)
    next_seq: int = 0
    closing: bool = False
    destroyed: bool = False
    early_fps: dict[int, tuple[int, str]] = field(default_factory=dict)
    early_keys: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    poisoned: dict[int, ArendezError] = field(default_factory=dict)  # seqs failed before they start
    #: the latest sequence numbers that completed here (a peer's timeout of one of them: a split)
    completed: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=64))

    # (size of the same-host set the link kind was computed for, the kind)
    _link: tuple[int, str] = field(default=(-1, ""), init=False, repr=False)
    _watchdog: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _watch_at: float = field(default=0.0, init=False, repr=False)
    _members: Container[int] | None = field(default=None, init=False, repr=False)

    @property
    def members(self) -> Container[int]:
        """The group's global ranks, as a set (a ``range`` is one already)."""
        if self._members is None:
            self._members = self.ranks if isinstance(self.ranks, range) else frozenset(self.ranks)
        return self._members

    @property
    def rank(self) -> int:
        return self.ranks.index(self.world.rank)

    def link_kind(self) -> str:
        """``"shm"`` if every rank is on this machine with shared memory on, else ``"tcp"``
        (``Op.link_kind``). All ranks must agree, whichever links they have opened so far
        (links open lazily): so it is the round's answer (``World.one_machine``); only an
        in-process world, without one, goes by the hellos."""
        if self.world.one_machine is not None:
            return "shm" if self.world.one_machine else "tcp"
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
                f"{what} {global_rank} is not in this group (ranks {_shown(self.ranks)})"
            ) from None

    def check_usable(self, name: str = "this group", among: Container[int] | None = None) -> None:
        """Raise if collective ``name`` cannot start: the group is destroyed or a member failed
        (``among``: one of these members; a message to one peer needs that peer only)."""
        if self.destroyed:
            raise NotInitializedError(
                "this process group was destroyed; call init_process_group() (or new_group()) again"
            )
        if self.closing:
            raise GroupDestroyedError("the process group is being destroyed")
        if self.world.expulsion is not None:  # (not the peers that left because of it)
            raise RankFailedError(self.world.rank, name, self.world.expulsion)
        failed = self.world.failed  # (a peer that left cleanly may have sent all we still need)
        if failed:
            members = self.members if among is None else among
            mine = [(r, why) for r, why in failed.items() if r in members]  # first failure first
            if mine:
                raise RankFailedError.naming(name, mine)

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
            if self.world.spin.seconds:  # (the loop polls, rather than sleep, for its messages)
                self.world.spin.poll_until(lambda: op.ended)
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
            why = exc.reason if isinstance(exc, LinkGone) else f"connection lost ({exc})"
            err = await self.world.blame(peer, name, why)
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
            if op.error is None:
                self.completed.append(seq)
            else:  # what is still arriving for it must not land in its buffers
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
            # what had arrived by the deadline counts: read it (uvloop runs due timers before it
            # polls for I/O, so the parts a late member sent just before may not be read yet)
            await asyncio.sleep(TIMER_SLACK)
            missing = [g for g in asked if g in progress and progress[g] <= op.seq]
            silent = [g for g in asked if g not in progress]
            if op.error is not None or self.active.get(op.seq) is not op:
                return  # (it ended meanwhile: its done-callback's cancel of this task may not have run yet)
            op.fail(CollectiveTimeoutError(f"{op.name} (seq {op.seq})", limit, missing, silent))
            # the late members must not complete it with the parts this rank had sent
            told = frames.TimedOut(self.gid, op.seq, op.name, round(limit * 1000))
            for peer in peers:
                self.world.send_control(peer, told, dial=len(self.ranks) < DIAL_LIMIT)

        if op.error is None and op.seq in self.active:
            task = asyncio.get_running_loop().create_task(diagnose())
            op.done.add_done_callback(lambda _: task.cancel())

    def times_out_soon(self, seq: int) -> bool:
        """Whether collective ``seq`` runs here with its own deadline due within a quarter of
        its timeout (``DIAGNOSE_SECONDS`` at most): it started about when a peer's that timed
        out, and waited as long."""
        op = self.active.get(seq)
        if op is None or op.error is not None:
            return False
        window = min(DIAGNOSE_SECONDS, op.limit / 4)
        return op.deadline - asyncio.get_running_loop().time() <= window

    def split(self, seq: int, peer: int, collective: str, limit: float) -> bool:
        """Member ``peer`` timed out of collective ``seq`` (``collective``, after ``limit`` s); if
        it had completed here, the members disagree on its outcome (``disowned``). Not one
        already running here: the timed-out member may have completed it with us. True if it
        was a split."""
        return self.disowned(seq, f"{collective} (seq {seq}) timed out on rank {peer} after {limit:g}s")

    def disowned(self, seq: int, failed: str) -> bool:
        """A member failed collective ``seq`` (``failed`` says where and how: a timeout, a
        mismatch; not a cancel, which changes nothing once a call is done) after it had
        completed here, as a broadcast's root or a scatter's
        source completes without hearing from the others: the members disagree on its outcome.
        Then the first collective this rank has not started yet fails on every member, saying
        why (a retry of the failed call on one rank must not be paired with the next step's call
        on another; a rank must not go on unaware that its part was refused). Once per ``seq``
        here (several members may report it); every member that completed it does the same, so
        members that heard at different points may refuse a collective each. True if it was
        such a split."""
        if seq not in self.completed:
            return False
        self.completed.remove(seq)
        refused = self.next_seq
        message = (
            f"collective #{refused} refused: {failed} but completed on rank {self.world.rank}: "
            "the ranks disagree on its outcome"
        )
        self.poison(refused, message, tell=True)
        return True

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

    def abandon(self, name: str) -> None:
        """A call of ``name`` whose task was cancelled before it started: it still takes the
        next sequence number, which fails on every member as a cancelled collective does."""
        if self.destroyed or self.closing:
            return
        seq = self.next_seq
        self.next_seq += 1
        self.world.mail.drop(self.early_keys.pop(seq, []))  # (what peers sent for it: unused)
        self.early_fps.pop(seq, None)
        self.poisoned.pop(seq, None)
        for peer in self.ranks:
            if peer != self.world.rank:
                self.world.send_control(peer, frames.Cancel(self.gid, seq, name))

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


def _shown(ranks: Sequence[int]) -> str:
    """A group's ranks as a message shows them (a ``range`` as its ends)."""
    if isinstance(ranks, range):
        return str(list(ranks)) if len(ranks) <= 16 else f"{ranks.start}..{ranks[-1]}"
    return str(ranks)
