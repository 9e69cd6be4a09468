"""A world's side of losing peers: a peer that died, left or was declared failed fails every
collective, send and receive that depends on it, once, and is named (and logged once, bursts
summed up); a lost link seen just after the event loop stood still (``arendez.stall``) waits
for the server's word first, which may be that this rank itself was declared failed.

``PeerLosses`` is ``World``'s base: the state it reads and writes is the world's, declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import burstlog, errorfile, stall
from .errors import RankFailedError

if TYPE_CHECKING:
    from .group import ProcessGroup
    from .mailbox import Mailbox
    from .p2pmatch import P2PMatcher
    from .shmlink import ShmControl
    from .transports import Links

log = logging.getLogger("arendez.world")

#: Seconds a doubted loss (``stall``) waits at most for the store's answer before it is blamed.
HEAR_SERVER_SECONDS = 1.0
#: The key the store round trip of ``World.hear_the_server`` checks (never set).
_PROBE_KEY = "__arendez/probe"


def _summariser(what: str) -> Callable[[Sequence[tuple[str, int, int, str]]], str]:
    def summarise(items: Sequence[tuple[str, int, int, str]]) -> str:
        jobs = ", ".join(sorted({repr(job) for job, _, _, _ in items}))
        return (
            f"{len(items)} more peer(s) {what} in job {jobs} (heard by rank(s)"
            f" {burstlog.span([r for _, r, _, _ in items])} of this process): ranks"
            f" {burstlog.listing([p for _, _, p, _ in items])}; the first: {items[0][3]}"
        )

    return summarise


#: a process logs each lost peer once, and a burst of losses as one more line (QA3-F9); the
#: peers that leave cleanly (INFO) apart, so that the failures' summary names failures only
_LOSSES = burstlog.BurstLog(log, _summariser("lost"))
_DEPARTURES = burstlog.BurstLog(log, _summariser("left"))


def _expulsions(items: Sequence[tuple[int, str]]) -> str:
    return (
        f"{len(items)} more rank(s) of this process declared failed: ranks "
        f"{burstlog.listing([rank for rank, _ in items])}; the first: {items[0][1]}"
    )


#: a process hosting many ranks (simulated ones) logs their expulsions as one burst (QA26: one
#: line per rank, 598 lines when the server declared 500 ranks of a stopped process failed)
_EXPULSIONS = burstlog.BurstLog(log, _expulsions)


class PeerLosses:
    """What a world does when a peer is lost (``peer_lost``) or a link to it closes
    (``link_lost``), and how it names the rank to blame."""

    # (the world's state, set by ``World.__init__``)
    rank: int
    world_size: int
    mesh: Links | None
    store: Any
    groups: dict[int, ProcessGroup]
    dead: dict[int, str]
    failed: dict[int, str]
    expulsion: str | None
    closed: bool
    mail: Mailbox
    p2p: P2PMatcher
    shm_control: ShmControl
    stall: stall.StallWatch | None
    _draining: dict[int, list[asyncio.Future[None]]]
    _peers_gone: asyncio.Event
    _doubted: dict[int, str]
    _hearing: asyncio.Task[None] | None
    _settling: asyncio.Task[None] | None

    async def peers_gone(self, deadline: float) -> None:
        """Wait until every other rank has said goodbye or been lost, or until ``deadline``
        (loop time)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await self._peers_gone.wait()

    def expelled(self, why: str) -> None:
        """The others count this rank as failed (the server declared it while the process was
        stopped or its loop stalled): the collectives running here fail naming this rank and
        why, rather than the peer that then left."""
        if self.closed or self.expulsion is not None:
            return
        self.expulsion = why  # (collectives started from now on are refused naming it)
        _EXPULSIONS.note(None, logging.WARNING, (self.rank, why), "rank %d: %s", self.rank, why)
        for group in list(self.groups.values()):
            for op in list(group.active.values()):
                if not isinstance(op.error, RankFailedError):
                    op.fail(RankFailedError(self.rank, op.name, why))

    def _round_id(self) -> object:
        """What tells this world apart from the process's others (of the same job too)."""
        return self.mesh.nonce if self.mesh is not None and self.mesh.nonce else id(self)

    def _job(self) -> str:
        return str(getattr(self.store, "job", "") or "local")

    # -- losses seen just after a stall (``arendez.stall``) -----------------------------------
    def doubting(self) -> bool:
        """Whether a lost link is doubted now: the loop just stood still (``arendez.stall``)."""
        return self.stall is not None and self.store is not None and self.stall.just_resumed()

    def link_lost(self, peer: int, reason: str) -> None:
        """``peer``'s connection closed or failed: ``peer_lost``, or, if the event loop just
        stood still, once the server's word sent before has been read (which may be that this
        rank was declared failed while stopped, and the peer only left without it)."""
        if peer in self.dead or not self.doubting():
            self.peer_lost(peer, reason)
            return
        if not self._doubted:  # (held: a task nothing refers to may be collected unfinished)
            self._settling = asyncio.get_running_loop().create_task(self._settle_doubts())
        self._doubted.setdefault(peer, reason)

    async def _settle_doubts(self) -> None:
        try:
            await self.hear_the_server()
        finally:
            doubted, self._doubted = self._doubted, {}
            for peer, reason in doubted.items():
                self.peer_lost(peer, reason)

    async def hear_the_server(self) -> None:
        """One round trip to the store (at most ``HEAR_SERVER_SECONDS``): whatever the server
        sent before its answer has been handled once this returns."""
        if self._hearing is None:
            self._hearing = asyncio.get_running_loop().create_task(self._round_trip())
        hearing = self._hearing
        try:
            await asyncio.shield(hearing)
        finally:
            if hearing.done() and self._hearing is hearing:
                self._hearing = None

    async def _round_trip(self) -> None:
        check = getattr(self.store, "check", None)
        if check is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(check([_PROBE_KEY]), HEAR_SERVER_SECONDS)

    async def blame(self, peer: int, name: str, reason: str) -> RankFailedError:
        """The error of ``name`` (a collective, a send) whose link to ``peer`` failed: naming
        ``peer``, or this rank if the server declared it failed while the loop stood still."""
        if self.expulsion is None and peer not in self.dead and self.doubting():
            await self.hear_the_server()
        if self.expulsion is not None:
            return RankFailedError(self.rank, name, self.expulsion)
        return RankFailedError(peer, name, reason)

    def _failure(self, group: Any, name: str, peer: int, reason: str) -> RankFailedError:
        """The error of a call of ``group`` that ``peer``'s loss ends: naming first the members
        seen to fail before (a peer that left because of them is their messenger, not the cause)."""
        earlier = [(r, why) for r, why in self.failed.items() if r != peer and r in group.members]
        return RankFailedError.naming(name, [*earlier, (peer, reason)])

    def peer_lost(
        self, peer: int, reason: str, *, left: bool = False, done: dict[int, int] | None = None
    ) -> None:
        """``peer`` died, left or was declared failed: fail everything that depends on it.
        ``left``: in good order, not a failure. ``done``: a failure, but it said goodbye after
        its last frame (a rank ending by an exception or a signal), having done its part of
        every collective of group ``gid`` before number ``done[gid]``: our copy of one of those
        loses only what it still expects from it; every later one fails."""
        if peer in self.dead or peer == self.rank:
            return
        self.dead[peer] = reason
        for drained in self._draining.pop(peer, ()):
            if not drained.done():
                drained.set_exception(RankFailedError(peer, "send", reason))
        if self.mesh is not None:
            self.mesh.forget(peer, reason, left)
        if len(self.dead) >= self.world_size - 1:
            self._peers_gone.set()
        if self.closed:  # destroy is under way: nothing left to fail
            return
        self.shm_control.drop(peer)
        if not left:
            self.failed[peer] = reason
            errorfile.heard(peer, reason)  # (for arendez-run's blame, if this process fails on it)
        (_DEPARTURES if left else _LOSSES).note(
            (self._round_id(), peer),
            logging.INFO if left else logging.WARNING,
            (self._job(), self.rank, peer, reason),
            "rank %d: peer rank %d: %s",
            self.rank,
            peer,
            reason,
        )
        # (each news of a departure reaches every rank of the process: at 5,000 ranks, work
        # in the size of the world here made a job's tail quadratic)
        for group in list(self.groups.values()):
            if group.active and peer in group.members:
                finished = -1 if done is None else done.get(group.gid, 0)
                for op in list(group.active.values()):
                    # A rank that left said goodbye after its last frame: only what we still
                    # expect from it is lost. A rank that died may hold up anyone: fail all.
                    lost = self.mail.expects(op.keys, peer) if left or op.seq < finished else True
                    if isinstance(op.error, RankFailedError):
                        if lost or not left:  # name every failure, the first one first
                            op.error.add(peer, reason)
                    elif lost:
                        op.fail(self._failure(group, op.name, peer, reason))
        # a receive from any rank fails with a failure in its group (as MPI's ULFM has it), or
        # once no other member is left to send; a peer that left in good order sent its last
        # name the failures seen before this one first (the messenger's death may be their effect)
        if not self.p2p.waits_on(peer):
            return
        earlier = [(r, why) for r, why in self.failed.items() if r != peer]
        self.p2p.peer_lost(
            peer,
            reason,
            earlier,
            {
                gid
                for gid, group in self.groups.items()
                if peer in group.members
                and (not left or all(r == self.rank or r in self.dead for r in group.ranks))
            },
        )
