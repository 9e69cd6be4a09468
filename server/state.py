"""Sans-I/O state of the server: its jobs, each a key-value store plus its rendezvous rounds.

Nothing here touches a socket or a clock: callers pass ``now`` and act on what is returned.
The store is ``kv.py``, rounds, members and leases ``rounds.py``, the limits ``limits.py``.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field

from arendez.errors import LimitError, RendezvousError

from .kv import KeyValueStore, Tally
from .limits import StateLimits
from .rounds import Departure, Lease, Member, MemberState, Round


@dataclass
class Job(KeyValueStore):
    """One job: its store, the round being formed and the completed rounds still in use."""

    forming: Round | None = None
    rounds: dict[bytes, Round] = field(default_factory=dict)
    generation: int = 0  # the number the next elastic round gets
    latest: Round | None = None  # the elastic round closed last (kept after it is over)

    @property
    def in_use(self) -> bool:
        return self.forming is not None or any(r.in_use for r in self.rounds.values())

    def join(
        self,
        rank: int,
        world_size: int,
        address: str,
        now: float,
        lease: Lease | None = None,
        machine: str = "",
    ) -> tuple[Round, int]:
        """Add a member to the round being formed; return it and the rank (assigned if -1).

        ``lease`` is the joining process's lease: it renews the member once the round is
        complete, so the member's lease clock starts only when something can renew it.
        """
        if not isinstance(world_size, int) or not 1 <= world_size <= self.limits.max_world_size:
            raise RendezvousError(
                f"world_size must be in 1..{self.limits.max_world_size} "
                "(limit: arendez-server --max-world-size)"
            )
        forming = self.forming
        if forming is None:
            forming = self.forming = Round(world_size)
        elif forming.elastic:
            raise forming.refuse(
                f"job {self.name!r} is forming an elastic world of {forming.min_size}..{forming.world_size} "
                f"ranks, this rank asked for a fixed world of {world_size}"
            )
        elif world_size != forming.world_size:
            raise forming.refuse(
                f"job {self.name!r} is forming a world of {forming.world_size}, "
                f"{f'rank {rank}' if rank != -1 else 'a rank'} asked for {world_size}"
            )
        if rank == -1:
            rank = forming.free_rank()
        elif not isinstance(rank, int) or not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank!r} is outside 0..{world_size - 1}")
        elif rank in forming.members:
            raise forming.refuse(f"rank {rank} of job {self.name!r} has already joined")
        forming.add(Member(rank, address, now, lease=lease, machine=machine))
        if forming.complete:
            for member in forming.members.values():  # leases start now: early joiners waited
                member.last_seen = now
            forming.nonce = os.urandom(16)
            self.rounds[forming.nonce] = forming
            self.forming = None
        return forming, rank

    def join_elastic(
        self,
        min_size: int,
        max_size: int,
        address: str,
        now: float,
        lease: Lease | None = None,
        *,
        came_from: int = -1,
        hint: int = -1,
        dead: object = (),
        machine: str = "",
    ) -> tuple[Round, Member, list[Departure]]:
        """Add a member to the elastic round being formed (``min_size``..``max_size`` ranks).

        Ranks are assigned when the round closes (``Member.rank``): first the ranks of the job's
        latest round (``came_from``, its generation), in their old order (``hint``, the old
        rank), then the others by ``hint``. ``dead`` lists ranks of that round the joiner saw
        fail: they are declared failed now (the departures are returned, to be told). The round
        closes (``close_ready``) at ``max_size`` ranks, or with ``min_size`` or more once no rank
        of a running elastic round is still active and either every live rank of the latest
        round is in or the settle time passed (``settle``). O(1) per join; the close sorts once.
        """
        limit = self.limits.max_world_size
        for value, name in ((min_size, "min world size"), (max_size, "max world size")):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise RendezvousError(f"{name} must be an integer in 1..{limit}, got {value!r:.40}")
        if min_size > max_size:
            raise RendezvousError(f"min world size {min_size} exceeds the max world size {max_size}")
        for value, name in ((came_from, "came_from"), (hint, "hint")):
            if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value < 2**62:
                raise RendezvousError(f"{name} must be an integer >= -1, got {value!r:.40}")
        if (
            not isinstance(dead, (list, tuple))
            or len(dead) > limit
            or not all(isinstance(r, int) for r in dead)
        ):
            raise RendezvousError(f"dead must be a list of at most {limit} ranks")
        forming = self.forming
        if forming is None:
            forming = self.forming = Round(max_size, min_size=min_size)
        elif (forming.min_size, forming.world_size) != (min_size, max_size):
            asked = f"{min_size}..{max_size} ranks"
            formed = (
                f"{forming.min_size}..{forming.world_size} ranks"
                if forming.elastic
                else f"a fixed world of {forming.world_size}"
            )
            raise RendezvousError(f"job {self.name!r} is forming {formed}, this rank asked for {asked}")
        gone = self._declare_dead(came_from, dead)
        key = forming._arrivals
        forming._arrivals += 1
        member = Member(key, address, now, lease=lease, came_from=came_from, hint=hint, machine=machine)
        forming.add(member)
        forming._count(member)
        forming.settled = False  # an arrival restarts the settle time
        self.close_ready(now)
        return forming, member, gone

    def _declare_dead(self, came_from: int, dead: list[int] | tuple[int, ...]) -> list[Departure]:
        latest = self.latest
        if not dead or latest is None or latest.generation != came_from or latest.nonce not in self.rounds:
            return []
        gone = []
        for rank in dead:
            member = latest.members.get(rank)
            if member is not None and member.state is MemberState.ACTIVE:
                latest.end(member, MemberState.FAILED)
                gone.append(Departure(self.name, latest.nonce, rank, True, "its peers saw it fail"))
        self._forget_if_done(latest)
        return gone

    def _running_elsewhere(self) -> bool:
        """A rank of an elastic round that is running is still active (it must re-form too)."""
        return any(r.elastic and r.active > 0 for r in self.rounds.values())

    def close_ready(self, now: float) -> Round | None:
        """Close the elastic round being formed if it may close now; return it if it did."""
        forming = self.forming
        if forming is None or not forming.elastic:
            return None
        count = len(forming.members)
        if count < forming.world_size:
            if count < forming.min_size or self._running_elsewhere():
                return None
            latest = self.latest
            all_in = (
                latest is not None
                and forming._latest == latest.generation
                and forming._from_latest >= latest.world_size - latest.failed
            )
            if not (all_in or forming.settled):
                return None
        self._close_elastic(forming, now)
        return forming

    def settle(self, round_: Round, now: float) -> Round | None:
        """The settle time of ``round_`` passed: close it if it may close now."""
        if round_ is not self.forming:
            return None
        round_.settled = True
        return self.close_ready(now)

    def _close_elastic(self, round_: Round, now: float) -> None:
        members = list(round_.members.values())
        latest = max(m.came_from for m in members)
        if latest >= 0:
            self.generation = max(self.generation, latest + 1)

        def order(m: Member) -> tuple[int, int, int]:  # (then by arrival: the key is unique)
            return (0 if latest >= 0 and m.came_from == latest else 1, m.hint, m.rank)

        members.sort(key=order)
        round_.members = {}
        for rank, member in enumerate(members):
            member.rank = rank
            member.last_seen = now  # leases start now: early joiners waited
            round_.members[rank] = member
        round_.world_size = len(members)
        round_.survivors = sum(1 for m in members if latest >= 0 and m.came_from == latest)
        round_.generation = self.generation
        self.generation += 1
        round_.nonce = os.urandom(16)
        self.rounds[round_.nonce] = round_
        self.latest = round_
        self.forming = None

    def withdraw(self, round_: Round, rank: int) -> None:
        """Undo a join whose round never completed (the joiner gave up or vanished)."""
        if round_ is self.forming:
            round_.remove(rank)
            if not round_.members:
                self.forming = None

    def attach(
        self,
        rank: int,
        world_size: int,
        nonce: bytes,
        address: str,
        now: float,
        lease: Lease | None = None,
    ) -> Round:
        """Re-bind a member of a completed round (after a reconnect or a server restart)."""
        round_ = self.rounds.get(nonce)
        if round_ is None:  # the server restarted: rebuild the round from who comes back
            round_ = self.rounds[nonce] = Round(world_size, nonce=nonce)
        if world_size != round_.world_size or not 0 <= rank < world_size:
            raise RendezvousError(f"job {self.name!r}: rank {rank} does not fit that round")
        member = round_.members.get(rank)
        if member is None:
            round_.add(Member(rank, address, now, lease=lease))
        elif member.state is not MemberState.ACTIVE:
            raise RendezvousError(f"rank {rank} of job {self.name!r} was declared {member.state.value}")
        else:
            member.last_seen = now
            if lease is not None:
                member.lease = lease
        return round_

    def heartbeat(self, round_: Round, rank: int, now: float) -> None:
        member = round_.members.get(rank)
        if member is not None:
            member.last_seen = now

    def leave(self, round_: Round, rank: int, failed: str | None = None) -> Departure | None:
        """``rank`` leaves ``round_``: in good order, or (``failed``: why) because its process
        is ending by a failure, which it says on its way out."""
        member = round_.members.get(rank)
        if not round_.complete:
            self.withdraw(round_, rank)
            return None
        if member is None or member.state is not MemberState.ACTIVE:
            return None
        round_.end(member, MemberState.LEFT if failed is None else MemberState.FAILED)
        self._forget_if_done(round_)
        if failed is not None:
            return Departure(self.name, round_.nonce, rank, True, failed, said=True)
        return Departure(self.name, round_.nonce, rank, False, "left the job")

    def _forget_if_done(self, round_: Round) -> None:
        if not round_.in_use:
            self.rounds.pop(round_.nonce, None)

    def end_lease(self, lease: Lease) -> list[Departure]:
        """Every active member of a complete round renewed by ``lease`` left (its process ended
        the lease in order)."""
        gone = []
        for round_ in list(self.rounds.values()):
            if not round_.complete:
                continue
            for member in round_.members.values():
                if member.state is MemberState.ACTIVE and member.lease is lease:
                    round_.end(member, MemberState.LEFT)
                    gone.append(Departure(self.name, round_.nonce, member.rank, False, "left the job"))
            self._forget_if_done(round_)
        return gone

    def expire(
        self,
        now: float,
        lease: float,
        arm_grace: float = 0.0,
        since: float = -math.inf,
        deaf: bool = False,
    ) -> list[Departure]:
        """Declare failed every active member of a complete round silent for over ``lease`` s
        (counted from ``since`` at the earliest), but those ``Member.spared`` while ``deaf``
        (``Hearing``)."""
        gone = []
        for round_ in list(self.rounds.values()):
            for member in round_.members.values():
                if member.overdue(now, lease, arm_grace, since) and not member.spared(deaf, now, lease):
                    round_.end(member, MemberState.FAILED)
                    gone.append(
                        Departure(self.name, round_.nonce, member.rank, True, f"no heartbeat for {lease:g}s")
                    )
            self._forget_if_done(round_)
        return gone


class ServerState:
    """Every job the server knows, created on first use and dropped once idle."""

    def __init__(self, limits: StateLimits = StateLimits()) -> None:  # noqa: B008 (frozen: shared safely)
        self.limits = limits
        self.jobs: dict[str, Job] = {}
        self.tally = Tally(limits.max_store_bytes)  # (a job's bytes leave it as its keys do)
        #: Leases by key; one lives while a keeper connection or a member holds it.
        self.leases: weakref.WeakValueDictionary[bytes, Lease] = weakref.WeakValueDictionary()

    def lease(self, key: object, now: float) -> Lease:
        """The lease of ``key`` (16 random bytes a client process chose), created on first use."""
        if not isinstance(key, bytes) or not 8 <= len(key) <= 64:
            raise RendezvousError("a lease key must be 8 to 64 bytes")
        held = self.leases.get(key)
        if held is None:
            held = self.leases[key] = Lease(key, now)
        return held

    def job(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is None:
            if len(self.jobs) >= self.limits.max_jobs:
                raise LimitError(
                    f"server already holds {self.limits.max_jobs} job(s) (limit: arendez-server --max-jobs)"
                )
            job = self.jobs[name] = Job(name, self.limits, tally=self.tally)
        return job

    def drop_if_idle(self, name: str, connected: int, with_store: bool = False) -> None:
        """Forget a job no connection uses, whose round is over and whose store is empty (or,
        ``with_store``, whatever it holds: a store scoped to its clients' connections)."""
        job = self.jobs.get(name)
        if job is None or connected or job.in_use:
            return
        if with_store:
            job.clear()
        if not job.kv and not job.queues:
            del self.jobs[name]

    def expire(
        self,
        now: float,
        lease: float,
        arm_grace: float = 0.0,
        since: float = -math.inf,
        deaf: bool = False,
    ) -> list[Departure]:
        gone: list[Departure] = []
        for job in self.jobs.values():
            gone.extend(job.expire(now, lease, arm_grace, since, deaf))
        return gone

    def spared(self, now: float, lease: float, arm_grace: float = 0.0, since: float = -math.inf) -> bool:
        """Whether some active member silent for over ``lease`` s is spared by deafness."""
        return any(
            member.overdue(now, lease, arm_grace, since) and member.spared(True, now, lease)
            for job in self.jobs.values()
            for round_ in job.rounds.values()
            for member in round_.members.values()
        )

    def end_lease(self, lease: Lease) -> list[Departure]:
        """A client process ended ``lease`` in order: its members still active left."""
        gone: list[Departure] = []
        for job in self.jobs.values():
            gone.extend(job.end_lease(lease))
        return gone
