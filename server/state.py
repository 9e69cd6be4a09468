"""Sans-I/O state of the server: jobs, their key-value stores, rendezvous rounds and leases.

Nothing here touches a socket or a clock: callers pass ``now`` and act on what is returned.
"""

from __future__ import annotations

import enum
import os
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


@dataclass
class Member:
    rank: int
    address: str
    last_seen: float
    state: MemberState = MemberState.ACTIVE


@dataclass(frozen=True)
class Departure:
    """A member that stopped being active: told to every other member of its job."""

    job: str
    nonce: bytes
    rank: int
    failed: bool
    reason: str


@dataclass
class Round:
    """One rendezvous round: ``world_size`` ranks that joined together and share a nonce."""

    world_size: int
    members: dict[int, Member] = field(default_factory=dict)
    nonce: bytes = b""

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size

    @property
    def in_use(self) -> bool:
        return any(m.state is MemberState.ACTIVE for m in self.members.values())

    def peers(self) -> list[str]:
        return [self.members[r].address for r in range(self.world_size)]


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
        if len(key.encode()) > self.limits.max_key:
            raise StoreError(f"store key of {len(key.encode())} bytes exceeds {self.limits.max_key}")
        return key

    def _check_value(self, value: object) -> bytes:
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

    # -- rendezvous ------------------------------------------------------------------------
    @property
    def in_use(self) -> bool:
        return self.forming is not None or any(r.in_use for r in self.rounds.values())

    def join(self, rank: int, world_size: int, address: str, now: float) -> tuple[Round, int]:
        """Add a member to the round being formed; return it and the rank (assigned if -1)."""
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
            rank = next(r for r in range(world_size) if r not in forming.members)
        elif not isinstance(rank, int) or not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank!r} is outside 0..{world_size - 1}")
        elif rank in forming.members:
            raise RendezvousError(f"rank {rank} of job {self.name!r} has already joined")
        forming.members[rank] = Member(rank, address, now)
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
            round_.members.pop(rank, None)
            if not round_.members:
                self.forming = None

    def attach(self, rank: int, world_size: int, nonce: bytes, address: str, now: float) -> Round:
        """Re-bind a member of a completed round (after a reconnect or a server restart)."""
        round_ = self.rounds.get(nonce)
        if round_ is None:  # the server restarted: rebuild the round from who comes back
            round_ = self.rounds[nonce] = Round(world_size, nonce=nonce)
        if world_size != round_.world_size or not 0 <= rank < world_size:
            raise RendezvousError(f"job {self.name!r}: rank {rank} does not fit that round")
        member = round_.members.get(rank)
        if member is None:
            round_.members[rank] = Member(rank, address, now)
        elif member.state is not MemberState.ACTIVE:
            raise RendezvousError(f"rank {rank} of job {self.name!r} was declared {member.state.value}")
        else:
            member.last_seen = now
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
        member.state = MemberState.LEFT
        self._forget_if_done(round_)
        return Departure(self.name, round_.nonce, rank, False, "left the job")

    def _forget_if_done(self, round_: Round) -> None:
        if not round_.in_use:
            self.rounds.pop(round_.nonce, None)

    def expire(self, now: float, lease: float) -> list[Departure]:
        """Declare failed every active member of a complete round silent for over ``lease`` s."""
        gone = []
        for round_ in list(self.rounds.values()):
            for member in round_.members.values():
                if member.state is MemberState.ACTIVE and now - member.last_seen > lease:
                    member.state = MemberState.FAILED
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

    def expire(self, now: float, lease: float) -> list[Departure]:
        gone: list[Departure] = []
        for job in self.jobs.values():
            gone.extend(job.expire(now, lease))
        return gone
