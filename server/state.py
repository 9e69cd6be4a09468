"""Sans-I/O state of the server: jobs, their key-value stores, rendezvous rounds and leases.

Nothing here touches a socket or a clock: callers pass ``now`` and act on what is returned.
"""

from __future__ import annotations

import enum
import os
import weakref
from dataclasses import dataclass, field

from arendez.errors import RendezvousError, StoreError


@dataclass(frozen=True)
class StateLimits:
    max_key: int = 4096
    max_value: int = 1 << 20
    max_keys_per_job: int = 100_000
    max_bytes_per_job: int = 256 << 20
    max_jobs: int = 10_000
    max_world_size: int = 65_536


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

    def renew(self, now: float) -> None:
        self.last_seen = now


@dataclass
class Member:
    rank: int
    address: str
    last_seen: float
    state: MemberState = MemberState.ACTIVE
    lease: Lease | None = None

    def expired(self, now: float, lease: float, arm_grace: float) -> bool:
        """Silent for longer than ``lease`` (its own heartbeats, or its process's lease)."""
        held = self.lease
        if held is None:
            return now - self.last_seen > lease
        if held.last_seen is None:  # the keeper has not renewed it yet
            return now - max(self.last_seen, held.created) > lease + arm_grace
        return now - max(self.last_seen, held.last_seen) > lease


@dataclass(frozen=True)
class Departure:
    """A member that stopped being active: told to every other member of its job."""

    job: str
    nonce: bytes
    rank: int
    failed: bool
    reason: str


@dataclass(eq=False)
class Round:
    """One rendezvous round: ``world_size`` ranks that joined together and share a nonce."""

    world_size: int
    members: dict[int, Member] = field(default_factory=dict)
    nonce: bytes = b""
    active: int = 0  # members still ACTIVE (kept as a count: checked on every departure)
    _next_free: int = 0  # no rank below this is free (ranks -1 are handed out in order)

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

    def end(self, member: Member, state: MemberState) -> None:
        """Mark an active member as left or failed."""
        if member.state is MemberState.ACTIVE:
            self.active -= 1
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


@dataclass
class Job:
    """One job: its store, the round being formed and the completed rounds still in use."""

    name: str
    limits: StateLimits
    kv: dict[str, bytes] = field(default_factory=dict)
    forming: Round | None = None
    rounds: dict[bytes, Round] = field(default_factory=dict)
    nbytes: int = 0  # keys + values held

    # -- key-value store -------------------------------------------------------------------
    def _check_key(self, key: object) -> str:
        if not isinstance(key, str) or not key:
            raise StoreError(f"store key must be a non-empty string, got {key!r:.80}")
        size = len(key) if key.isascii() else len(key.encode())
        if size > self.limits.max_key:
            raise StoreError(f"store key of {size} bytes exceeds {self.limits.max_key}")
        return key

    def _check_value(self, value: object) -> bytes:
        if type(value) is not bytes:
            if isinstance(value, str):
                value = value.encode()
            if not isinstance(value, bytes):
                raise StoreError(f"store value must be bytes or str, got {type(value).__name__}")
        if len(value) > self.limits.max_value:
            raise StoreError(f"store value of {len(value)} bytes exceeds {self.limits.max_value}")
        return value

    def _put(self, key: str, value: bytes) -> None:
        old = self.kv.get(key)
        if old is None and len(self.kv) >= self.limits.max_keys_per_job:
            raise StoreError(f"job {self.name!r} already holds {self.limits.max_keys_per_job} keys")
        grown = self.nbytes + len(value) - (len(old) if old is not None else -len(key))
        if grown > self.limits.max_bytes_per_job:
            raise StoreError(f"job {self.name!r} would hold more than {self.limits.max_bytes_per_job} bytes")
        self.kv[key] = value
        self.nbytes = grown

    def set(self, key: object, value: object) -> None:
        self._put(self._check_key(key), self._check_value(value))

    def get(self, key: object) -> bytes | None:
        return self.kv.get(self._check_key(key))

    def add(self, key: object, amount: object) -> int:
        name = self._check_key(key)
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise StoreError(f"add amount must be an integer, got {amount!r:.80}")
        current = self.kv.get(name, b"0")
        try:
            total = int(current) + amount
        except ValueError:
            raise StoreError(f"key {name!r} does not hold an integer") from None
        if not -(2**63) <= total < 2**63:
            raise StoreError(f"add on {name!r} would leave the 64-bit integer range")
        self._put(name, str(total).encode())
        return total

    def compare_set(self, key: object, expected: object, desired: object) -> bytes:
        """Set ``desired`` if the value is ``expected`` (or missing and ``expected`` is empty)."""
        name = self._check_key(key)
        want, new = self._check_value(expected), self._check_value(desired)
        current = self.kv.get(name)
        if (current is None and want == b"") or current == want:
            self._put(name, new)
            return new
        return current if current is not None else want

    def delete(self, key: object) -> bool:
        name = self._check_key(key)
        old = self.kv.pop(name, None)
        if old is None:
            return False
        self.nbytes -= len(name) + len(old)
        return True

    def has_all(self, keys: list[str]) -> bool:
        return all(self._check_key(k) in self.kv for k in keys)

    def get_all(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` in order; ``None`` if any is missing."""
        kv = self.kv
        values = [kv.get(self._check_key(k)) for k in keys]
        return None if None in values else values  # type: ignore[return-value]

    def set_all(self, keys: list[str], values: list[object]) -> None:
        """Set each key to the value at its position; every key and value is checked first."""
        pairs = [(self._check_key(k), self._check_value(v)) for k, v in zip(keys, values, strict=True)]
        for key, value in pairs:
            self._put(key, value)

    # -- rendezvous ------------------------------------------------------------------------
    @property
    def in_use(self) -> bool:
        return self.forming is not None or any(r.in_use for r in self.rounds.values())

    def join(
        self, rank: int, world_size: int, address: str, now: float, lease: Lease | None = None
    ) -> tuple[Round, int]:
        """Add a member to the round being formed; return it and the rank (assigned if -1).

        ``lease`` is the joining process's lease: it renews the member once the round is
        complete, so the member's lease clock starts only when something can renew it.
        """
        if not isinstance(world_size, int) or not 1 <= world_size <= self.limits.max_world_size:
            raise RendezvousError(f"world_size must be in 1..{self.limits.max_world_size}")
        forming = self.forming
        if forming is None:
            forming = self.forming = Round(world_size)
        elif world_size != forming.world_size:
            raise RendezvousError(
                f"job {self.name!r} is forming a world of {forming.world_size}, "
                f"this rank asked for {world_size}"
            )
        if rank == -1:
            rank = forming.free_rank()
        elif not isinstance(rank, int) or not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank!r} is outside 0..{world_size - 1}")
        elif rank in forming.members:
            raise RendezvousError(f"rank {rank} of job {self.name!r} has already joined")
        forming.add(Member(rank, address, now, lease=lease))
        if forming.complete:
            for member in forming.members.values():  # leases start now: early joiners waited
                member.last_seen = now
            forming.nonce = os.urandom(16)
            self.rounds[forming.nonce] = forming
            self.forming = None
        return forming, rank

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

    def leave(self, round_: Round, rank: int) -> Departure | None:
        member = round_.members.get(rank)
        if not round_.complete:
            self.withdraw(round_, rank)
            return None
        if member is None or member.state is not MemberState.ACTIVE:
            return None
        round_.end(member, MemberState.LEFT)
        self._forget_if_done(round_)
        return Departure(self.name, round_.nonce, rank, False, "left the job")

    def _forget_if_done(self, round_: Round) -> None:
        if not round_.in_use:
            self.rounds.pop(round_.nonce, None)

    def expire(self, now: float, lease: float, arm_grace: float = 0.0) -> list[Departure]:
        """Declare failed every active member of a complete round silent for over ``lease`` s."""
        gone = []
        for round_ in list(self.rounds.values()):
            for member in round_.members.values():
                if member.state is MemberState.ACTIVE and member.expired(now, lease, arm_grace):
                    round_.end(member, MemberState.FAILED)
                    gone.append(
                        Departure(self.name, round_.nonce, member.rank, True, f"no heartbeat for {lease:g}s")
                    )
            self._forget_if_done(round_)
        return gone


class ServerState:
    """Every job the server knows, created on first use and dropped once idle."""

    def __init__(self, limits: StateLimits = StateLimits()) -> None:
        self.limits = limits
        self.jobs: dict[str, Job] = {}
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
                raise StoreError(f"server already holds {self.limits.max_jobs} jobs")
            job = self.jobs[name] = Job(name, self.limits)
        return job

    def drop_if_idle(self, name: str, connected: int) -> None:
        """Forget a job no connection uses, whose round is over and whose store is empty."""
        job = self.jobs.get(name)
        if job is not None and connected == 0 and not job.in_use and not job.kv:
            del self.jobs[name]

    def expire(self, now: float, lease: float, arm_grace: float = 0.0) -> list[Departure]:
        gone: list[Departure] = []
        for job in self.jobs.values():
            gone.extend(job.expire(now, lease, arm_grace))
        return gone
