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
    rank: int
    failed: bool
    reason: str


@dataclass
class Job:
    """One job: its store and its current rendezvous round."""

    name: str
    limits: StateLimits
    kv: dict[str, bytes] = field(default_factory=dict)
    world_size: int = 0
    members: dict[int, Member] = field(default_factory=dict)
    nonce: bytes = b""
    version: int = 0  # bumped on every write, so waiters know something changed

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
        if key not in self.kv and len(self.kv) >= self.limits.max_keys_per_job:
            raise StoreError(f"job {self.name!r} already holds {self.limits.max_keys_per_job} keys")
        self.kv[key] = value
        self.version += 1

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
        existed = self.kv.pop(self._check_key(key), None) is not None
        if existed:
            self.version += 1
        return existed

    def has_all(self, keys: list[str]) -> bool:
        return all(self._check_key(k) in self.kv for k in keys)

    # -- rendezvous ------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.world_size > 0 and len(self.members) == self.world_size

    @property
    def in_use(self) -> bool:
        return any(m.state is MemberState.ACTIVE for m in self.members.values())

    def join(self, rank: int, world_size: int, address: str, now: float) -> int:
        """Add a member to the current round; return its rank (assigned if ``rank`` is -1)."""
        if not isinstance(world_size, int) or not 1 <= world_size <= self.limits.max_world_size:
            raise RendezvousError(f"world_size must be in 1..{self.limits.max_world_size}")
        if self.members and not self.in_use and self.complete:
            self._reset_round()  # every member of the last round is gone: start afresh
        if self.world_size and world_size != self.world_size:
            raise RendezvousError(
                f"job {self.name!r} has world_size {self.world_size}, this rank asked for {world_size}"
            )
        if self.complete:
            raise RendezvousError(f"job {self.name!r} already has all {self.world_size} ranks")
        if rank == -1:
            rank = next(r for r in range(world_size) if r not in self.members)
        elif not isinstance(rank, int) or not 0 <= rank < world_size:
            raise RendezvousError(f"rank {rank!r} is outside 0..{world_size - 1}")
        elif rank in self.members:
            raise RendezvousError(f"rank {rank} of job {self.name!r} has already joined")
        self.world_size = world_size
        self.members[rank] = Member(rank, address, now)
        if self.complete:
            self.nonce = os.urandom(16)
        return rank

    def _reset_round(self) -> None:
        self.members.clear()
        self.world_size = 0
        self.nonce = b""

    def withdraw(self, rank: int) -> None:
        """Undo a join that never completed (the joiner gave up or vanished)."""
        if not self.complete:
            self.members.pop(rank, None)
            if not self.members:
                self.world_size = 0

    def attach(self, rank: int, world_size: int, nonce: bytes, address: str, now: float) -> None:
        """Re-bind a member of a completed round (after a reconnect or a server restart)."""
        if not self.members:
            self.world_size, self.nonce = world_size, nonce
        if nonce != self.nonce or world_size != self.world_size:
            raise RendezvousError(f"job {self.name!r} has moved on to another round")
        member = self.members.get(rank)
        if member is None:
            self.members[rank] = Member(rank, address, now)
        elif member.state is not MemberState.ACTIVE:
            raise RendezvousError(f"rank {rank} of job {self.name!r} was declared {member.state.value}")
        else:
            member.last_seen = now

    def peers(self) -> list[str]:
        return [self.members[r].address for r in range(self.world_size)]

    def heartbeat(self, rank: int, now: float) -> None:
        member = self.members.get(rank)
        if member is not None:
            member.last_seen = now

    def leave(self, rank: int) -> Departure | None:
        member = self.members.get(rank)
        if member is None or member.state is not MemberState.ACTIVE:
            return None
        if not self.complete:
            self.withdraw(rank)
            return None
        member.state = MemberState.LEFT
        return Departure(self.name, rank, False, "left the job")

    def expire(self, now: float, lease: float) -> list[Departure]:
        """Declare failed every active member of a complete round silent for over ``lease`` s."""
        if not self.complete:
            return []
        gone = []
        for member in self.members.values():
            if member.state is MemberState.ACTIVE and now - member.last_seen > lease:
                member.state = MemberState.FAILED
                gone.append(Departure(self.name, member.rank, True, f"no heartbeat for {lease:g}s"))
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
