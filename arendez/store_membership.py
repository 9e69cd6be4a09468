"""The job membership side of the async store client: join a rendezvous round, hear of the
round's departures and of ranks waiting to join, leave; and the process's lease around it
(``lease.py``). A mixin of ``store.Store``, over its ``_call``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as _ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import lease as _lease
from .errors import LimitError, StoreError, StoreTimeoutError
from .store_wire import MAX_REASON

EventHandler = Callable[[dict[str, Any]], None]

#: How long ``leave`` waits for a lost server to come back (destroy should not sit out its
#: whole timeout for a best-effort goodbye to a dead server).
LEAVE_OFFLINE_SECONDS = 1.0
#: The longest a leave waits for a connected server's answer: a server that is up answers in
#: milliseconds, one that is stopped (SIGSTOP) or stalled never does, and destroy must not wait
#: its whole timeout for it (the closed connection and the lease tell the server anyway).
LEAVE_SECONDS = 5.0


@dataclass(frozen=True)
class Membership:
    """What the server answered to a join: our place in the job."""

    rank: int
    world_size: int
    peers: list[str]  # empty when joined with ``peers=False``: ask ``Store.addresses``
    nonce: bytes
    #: Addresses of the ranks asked for with ``join(neighbours=...)``, by rank.
    addresses: dict[int, str] = field(default_factory=dict)
    #: Elastic rounds: the job's round number, and how many ranks (0..survivors-1) came from
    #: the job's previous round (the others are new: replacements, scale-up, stale ranks).
    generation: int = -1
    survivors: int = 0
    #: Whether every rank of the round named this rank's machine (``join(machine=...)``): the
    #: same answer for all (None: not asked, or a server that does not tell).
    one_machine: bool | None = None


class MembershipOps:
    """join / leave / addresses / status and the round's news, over ``_call`` (``Store._call``)."""

    host: str
    port: int
    timeout: float
    on_event: EventHandler | None
    joining: dict[bytes, int]
    _token: str | None
    _ssl: _ssl.SSLContext | None
    _heartbeat_interval: float
    _membership: Membership | None
    _address: str
    _left: bool
    _lease: _lease.LeaseKeeper | None
    _conn: Any
    _server_leaving: bool

    async def _call(self, op: str, timeout: float | None = None, wait: bool = False, **fields: Any) -> Any:
        raise NotImplementedError

    async def join(
        self,
        world_size: int,
        rank: int,
        address: str,
        timeout: float | None = None,
        *,
        peers: bool = True,
        neighbours: Iterable[int] | None = None,
        min_size: int | None = None,
        settle: float | None = None,
        came_from: int = -1,
        hint: int = -1,
        dead: Iterable[int] = (),
        machine: str | None = None,
    ) -> Membership:
        """Join the job's rendezvous round; returns once all ``world_size`` ranks are in.

        Elastic (``min_size`` given, ``rank`` -1): the round closes with ``world_size`` ranks,
        or with ``min_size`` or more once no rank arrived for ``settle`` seconds; the server
        assigns ranks, the ranks of the job's latest round (``came_from``, its generation)
        first in their old order (``hint``, the old rank), then the others by ``hint``. ``dead``:
        ranks of that round this rank saw fail (the server declares them failed at once).
        ``machine``: what identifies this rank's machine for shared memory ("" for none); the
        answer then says whether all ranks named the same one (``Membership.one_machine``).

        With ``peers=False`` the answer carries no peer addresses (``Membership.peers`` is
        empty): fetch the ones needed with ``addresses``, so a round costs O(N), not O(N²).
        The process's lease keeper starts before the join, so the lease can be renewed from
        the moment the round completes.
        """
        self._address = address
        self._left = False
        if self._lease is None:
            self._lease = _lease.acquire(
                self.host, self.port, token=self._token, ssl=self._ssl, interval=self._heartbeat_interval
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                answer = await self._call(
                    "join",
                    deadline - loop.time(),
                    wait=True,
                    world_size=world_size,
                    rank=rank,
                    address=address,
                    lease=self._lease.key,
                    peers=peers,
                    **({"neighbours": list(neighbours)} if neighbours is not None else {}),
                    **(
                        {"min_size": min_size, "came_from": came_from, "hint": hint, "dead": list(dead)}
                        if min_size is not None
                        else {}
                    ),
                    **({"settle": settle} if settle is not None else {}),
                    **({"machine": machine} if machine is not None else {}),
                )
                break
            except (StoreTimeoutError, LimitError):
                self._stop_lease()
                raise
            except StoreError:
                # the server went away mid-rendezvous (e.g. rank 0 restarting its embedded
                # server on the same port): join again wherever the reconnection lands
                if loop.time() >= deadline:
                    self._stop_lease()
                    raise
                await asyncio.sleep(0.05)
            except BaseException:
                self._stop_lease()
                raise
        found = answer.get("peers")
        if "joining" in answer:  # (unless newer news for the round came first)
            self.joining.setdefault(bytes(answer["nonce"]), int(answer["joining"]))
        m = self._membership = Membership(
            int(answer["rank"]),
            int(answer["world_size"]),
            list(found) if found is not None else [],
            bytes(answer["nonce"]),
            {int(r): str(a) for r, a in answer.get("addresses", {}).items()},
            int(answer.get("generation", -1)),
            int(answer.get("survivors", 0)),
            bool(answer["one_machine"]) if "one_machine" in answer else None,
        )
        return m

    def _note_joining(self, round_: Any, waiting: Any) -> None:
        if isinstance(round_, bytes) and isinstance(waiting, int) and not isinstance(waiting, bool):
            if len(self.joining) >= 16 and round_ not in self.joining:
                self.joining.clear()  # (old rounds' news: bounded)
            self.joining[round_] = waiting

    async def addresses(self, ranks: Iterable[int], timeout: float | None = None) -> dict[int, str]:
        """The addresses the given ranks of our round joined with (after ``join``)."""
        found: dict[int, str] = await self._call("addresses", timeout, ranks=list(ranks))
        return {int(r): str(a) for r, a in found.items()}

    def _stop_lease(self, linger: bool = False) -> None:
        """Release the process's lease keeper (never blocks: its thread ends on its own);
        ``linger``: this rank left in good order, the keeper may wait for the process's next."""
        if self._lease is not None:
            _lease.release(self._lease, linger=linger)
            self._lease = None

    async def leave(self, timeout: float = 2.0, failed: str | None = None) -> None:
        """Leave the round (best effort: a store that is gone is not an error here); ``failed``:
        why, when the process is ending by a failure (the server records and tells it as one,
        not as a leave). While the
        connection is down (the server died or restarts) this waits at most
        ``LEAVE_OFFLINE_SECONDS`` for it to come back, not the whole ``timeout``; a connected
        server that does not answer (stopped, stalled) gets ``LEAVE_SECONDS``. The process's
        lease is released only afterwards: released first, by the last rank of its process,
        the lease could run out on the server before a slow leave arrived, and the rank that
        was leaving in good order be declared failed (seen with 5,000 ranks on 2 cores)."""
        if self._membership is None:
            return
        self._membership = None
        self._left = True
        conn = self._conn  # (closed but not yet let go of: its loss is being handled, it is down)
        down = conn is None or not conn.is_open or self._server_leaving
        timeout = min(timeout, LEAVE_OFFLINE_SECONDS if down else LEAVE_SECONDS)
        left = False
        try:
            with contextlib.suppress(StoreError):
                why: dict[str, Any] = {} if failed is None else {"failed": failed[:MAX_REASON]}
                await self._call("leave", timeout, **why)
                left = True
        finally:
            self._stop_lease(linger=left)

    async def status(self) -> dict[str, Any]:
        status: dict[str, Any] = await self._call("status")
        return status

    def _on_departed(self, ranks: Any) -> None:
        """One batched event for every rank of our round that left or failed: one call each."""
        if not isinstance(ranks, list) or self.on_event is None:
            return
        me = self._membership.rank if self._membership is not None else None
        for entry in ranks:
            if not isinstance(entry, list) or len(entry) != 3:
                continue
            rank, failed, reason = entry  # (failed: 0 left, 1 declared failed, 2 by its own word)
            if rank == me:  # (the news of our own failure reaches us once we run again)
                if failed:
                    self.on_event({"event": "self_failed", "rank": rank, "reason": reason})
                continue
            event = {"event": "rank_failed" if failed else "rank_left", "rank": rank, "reason": reason}
            if failed == 2:  # it said so as it left, after its last frames to its peers
                event["said"] = True
            self.on_event(event)
