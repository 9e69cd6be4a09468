"""Rendezvous rounds and their members: who joined, each member's state and lease, who departed.

Sans-I/O like the rest of the state: callers pass ``now``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from arendez.errors import RendezvousError

#: The longest a server that hears nobody holds a silent member's declaration, or postpones it
#: once it hears again (``Hearing``), beyond the lease: seconds. Below the 135 s after which TCP
#: keepalive (``arendez.transport``) ends a connection whose host is gone, which ends the hold.
HOLD_MAX = 120.0
#: Refused joins a forming round remembers for its timeout message.
REFUSALS_KEPT = 4


class MemberState(enum.Enum):
    ACTIVE = "active"
    LEFT = "left"
    FAILED = "failed"


@dataclass(eq=False)
class Lease:
    """One client process's heartbeat: it renews every member that joined naming its key.

    A process keeps one lease per server however many ranks it hosts, so the server's lease
    work is per process, not per rank. ``last_seen`` stays ``None`` until the process's keeper
    first renews it: until then its members get ``arm_grace`` extra seconds.
    """

    key: bytes
    created: float
    last_seen: float | None = None
    #: Open connections keeping it (one, but an old one may close after its successor came).
    keepers: int = 0

    def renew(self, now: float) -> None:
        self.last_seen = now


@dataclass
class Member:
    rank: int  # in an elastic round being formed: an arrival number until the round closes
    address: str
    last_seen: float
    state: MemberState = MemberState.ACTIVE
    lease: Lease | None = None
    came_from: int = -1  # elastic: the generation of the round this rank was in (-1: none)
    hint: int = -1  # elastic: its rank in that round (or its launcher slot): ordering only
    #: What identifies its machine for shared memory (opaque; "": none, or not said)
    machine: str = ""

    def seen(self) -> float:
        """When it was last heard of: its own heartbeat, or its process's lease."""
        held = self.lease
        if held is None or held.last_seen is None:
            return self.last_seen
        return max(self.last_seen, held.last_seen)

    def spared(self, deaf: bool, now: float, lease: float) -> bool:
        """Not to be declared failed now: the server hears nobody (``Hearing``: ``deaf``), this
        member's keeper connection is still open (a killed process's closes: no spare), and it
        has not been silent for over ``HOLD_MAX`` beyond its lease."""
        return (
            deaf
            and self.lease is not None
            and self.lease.keepers > 0
            and now - self.seen() <= lease + HOLD_MAX
        )

    def overdue(self, now: float, lease: float, arm_grace: float, since: float = -math.inf) -> bool:
        """Active, and ``expired``: what the lease check declares failed, unless ``spared``."""
        return self.state is MemberState.ACTIVE and self.expired(now, lease, arm_grace, since)

    def expired(self, now: float, lease: float, arm_grace: float, since: float = -math.inf) -> bool:
        """Silent for longer than ``lease`` (its own heartbeats, or its process's lease), counted
        from ``since`` at the earliest (``Hearing.since``), but never longer than ``HOLD_MAX``
        beyond the lease: no silence of the server's postpones a declaration further."""
        held = self.lease
        if held is not None and held.last_seen is None:  # the keeper has not renewed it yet
            seen, lease = max(self.last_seen, held.created), lease + arm_grace
        else:
            seen = self.seen()
        return now - max(seen, since) > lease or now - seen > lease + HOLD_MAX


class Hearing:
    """Whether the server hears its clients at all: a failure declaration needs that evidence.

    A server cut off from the network hears nobody, and every lease runs out at once; declaring
    them all failed would end healthy jobs whose ranks still talk to each other. So while no
    heartbeat at all has arrived for ``deaf_after`` seconds (``deaf``) and at least two keeper
    connections are open, the members whose keeper connection is still open are not declared
    (``Member.spared``: a killed process's connection closed, and that news came over the
    network; a lone process that went silent is as likely stopped as cut off, and declaring it
    costs no other process anything), for ``HOLD_MAX`` seconds at most. When heartbeats come
    back after a silence longer than a lease, every lease restarts one lease later (``since``):
    processes that are alive have two leases to get through again (their connections come back
    at the pace of TCP's retransmission backoff, not all at once), and the dead are declared two
    leases after the server hears again. Sans-I/O: callers pass ``now``.
    """

    def __init__(self, now: float, lease: float) -> None:
        #: Half a lease, and at least two default heartbeat intervals (0.5 s): a lone live
        #: process renewing on time never looks like silence.
        self.deaf_after = max(lease / 2, 1.0)
        self.lease = lease
        self.last = now
        self.since = -math.inf

    def hear(self, now: float) -> float | None:
        """A heartbeat arrived: the silence it ends if that was one (its length), else None."""
        gap = now - self.last
        self.last = now
        if gap > self.lease:  # (a shorter one, as a loaded machine may cause, expired nobody)
            self.since = now + self.lease
        if gap > self.deaf_after:
            return gap
        return None

    def deaf(self, now: float) -> bool:
        return now - self.last > self.deaf_after


@dataclass(frozen=True)
class Departure:
    """A member that stopped being active: told to every other member of its job."""

    job: str
    nonce: bytes
    rank: int
    failed: bool
    reason: str
    #: The member said so itself as it left (``Job.leave``'s ``failed``), after its last frames
    #: to its peers: they lose only what they still expect from it.
    said: bool = False

    @property
    def kind(self) -> int:
        """On the wire: 0 left, 1 declared failed, 2 failed by its own word (``said``)."""
        return 2 if self.said else int(self.failed)


@dataclass(eq=False)
class Round:
    """One rendezvous round: ``world_size`` ranks that joined together and share a nonce."""

    world_size: int
    members: dict[int, Member] = field(default_factory=dict)
    nonce: bytes = b""
    active: int = 0  # members still ACTIVE (kept as a count: checked on every departure)
    _next_free: int = 0  # no rank below this is free (ranks -1 are handed out in order)
    #: Elastic rounds: the fewest ranks the round may close with (``world_size`` is the most);
    #: 0 for a fixed-size round. An elastic round assigns ranks when it closes.
    min_size: int = 0
    generation: int = -1  # elastic: the job's round number, set when the round closes
    survivors: int = 0  # elastic: ranks 0..survivors-1 came from the job's latest round
    _arrivals: int = 0
    _latest: int = -1  # elastic, while forming: the newest generation a joiner came from
    _from_latest: int = 0  # ... how many joiners came from it
    settled: bool = False  # elastic, while forming: its settle time passed
    failed: int = 0  # members declared failed (counted as they are)
    #: Why joins to this round were refused while it formed (the first few): the members left
    #: waiting hear of them if the round then times out.
    refused: list[str] = field(default_factory=list)
    _one_machine: tuple[int, bool] = (-1, False)  # (for how many members, the answer)
    #: Ranks that joined and gave up at their own deadline while the round formed: they count
    #: as joined when the others' deadlines pass (they are not the ones missing)
    gave_up: set[int] = field(default_factory=set)

    def one_machine(self) -> bool:
        """True if every member named the same machine (not ""): all may share memory. The
        ranks choose lane sizes and algorithms by it, so all must get the same answer: the
        round's, computed once for its members (O(N) once, not per join answer)."""
        if self._one_machine[0] != len(self.members):
            tags = {m.machine for m in self.members.values()}
            self._one_machine = (len(self.members), len(tags) == 1 and "" not in tags)
        return self._one_machine[1]

    def refuse(self, why: str) -> RendezvousError:
        """The error refusing a join to this round, remembered (at most ``REFUSALS_KEPT``)."""
        if len(self.refused) < REFUSALS_KEPT:
            self.refused.append(why)
        return RendezvousError(why)

    @property
    def elastic(self) -> bool:
        return self.min_size > 0

    def _count(self, member: Member) -> None:
        if member.came_from > self._latest:
            self._latest, self._from_latest = member.came_from, 0
        if member.came_from == self._latest and member.came_from >= 0:
            self._from_latest += 1

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size

    @property
    def in_use(self) -> bool:
        return self.active > 0

    def free_rank(self) -> int:
        """The lowest rank nobody has taken (amortised O(1) over a round)."""
        while self._next_free in self.members:
            self._next_free += 1
        return self._next_free

    def add(self, member: Member) -> None:
        self.members[member.rank] = member
        if member.state is MemberState.ACTIVE:
            self.active += 1

    def remove(self, rank: int) -> None:
        member = self.members.pop(rank, None)
        if member is not None and member.state is MemberState.ACTIVE:
            self.active -= 1
        self._next_free = min(self._next_free, rank)
        if member is not None and self.elastic:  # rare: count the rest again
            self._latest, self._from_latest = -1, 0
            for other in self.members.values():
                self._count(other)

    def end(self, member: Member, state: MemberState) -> None:
        """Mark an active member as left or failed."""
        if member.state is MemberState.ACTIVE:
            self.active -= 1
            if state is MemberState.FAILED:
                self.failed += 1
        member.state = state

    def peers(self) -> list[str]:
        return [self.members[r].address for r in range(self.world_size)]

    def addresses(self, ranks: object) -> dict[int, str]:
        """The addresses of ``ranks`` (a list of member ranks of this complete round)."""
        if not isinstance(ranks, list) or len(ranks) > 65_536:
            raise RendezvousError("ranks must be a list of at most 65536 integers")
        found = {}
        for rank in ranks:
            member = self.members.get(rank) if isinstance(rank, int) else None
            if member is None:
                raise RendezvousError(f"rank {rank!r:.40} is not a member of this round")
            found[rank] = member.address
        return found
