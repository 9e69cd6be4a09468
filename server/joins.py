"""Rendezvous joins that wait for their round, without a task each.

A join is answered when its round completes (or, elastic, closes): ``Members.round_closed`` calls
``JoinWait.finish`` on every join waiting on that round, in one pass. Until then a join costs
the server one small object and one timer (its deadline), not a task, a timeout context and a
shielded future: at 10,000 ranks that was a large part of the server's CPU per rank. A join
whose deadline passes withdraws its rank and answers with the round's shortfall; one whose
connection goes (``cancel``) withdraws it silently.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgpack

from arendez import wire
from arendez.errors import ArendezError, RendezvousError, RendezvousTimeoutError
from arendez.rendezvous import incomplete

from .rounds import Member, Round
from .state import Job
from .waits import TimedWait

if TYPE_CHECKING:
    from .app import Server
    from .connection import Session

#: Seconds a round's encoded peer addresses are kept for late answers (``packed_peers``).
PEERS_KEPT = 5.0

_packer = msgpack.Packer(use_bin_type=True)


def check_neighbours(offsets: Any) -> None:
    """``neighbours`` of a join: at most 64 integer offsets (refused before the join waits)."""
    if offsets is None:
        return
    if (
        not isinstance(offsets, list)
        or len(offsets) > 64
        or not all(type(o) is int for o in offsets)  # (not bool)
    ):
        raise RendezvousError("neighbours must be a list of at most 64 integer rank offsets")


def packed_peers(server: Server, round_: Round) -> bytes:
    """Every member's address, encoded once per round and shared by all the join answers."""
    cache = server.members.peers_packed
    packed = cache.get(round_)
    if packed is None:
        packed = cache[round_] = _packer.pack(round_.peers())
        asyncio.get_running_loop().call_later(PEERS_KEPT, cache.pop, round_, None)
    return packed


def join_reply(rid: Any, answer: dict[str, Any], peers: bytes | None) -> list[bytes | memoryview] | None:
    """A join reply ``{"id", "ok": answer (+ "peers")}``, the peers already encoded."""
    if rid is None:
        return None
    if peers is None:
        return wire.encode({"id": rid, "ok": answer})
    parts = [
        _packer.pack_map_header(2),
        _packer.pack("id"),
        _packer.pack(rid),
        _packer.pack("ok"),
        _packer.pack_map_header(len(answer) + 1),
    ]
    for name, value in answer.items():
        parts.append(_packer.pack(name))
        parts.append(_packer.pack(value))
    parts.append(_packer.pack("peers"))
    head = b"".join(parts)
    return [wire.PREFIX.pack(len(head) + len(peers), 0) + head, peers]


class JoinWait(TimedWait):
    """One join waiting for its round; answered once, by ``finish``, ``expire`` or ``cancel``."""

    __slots__ = (
        "_member",
        "_request",
        "_rid",
        "_round",
        "_server",
        "_started",
        "job",
        "rank",
    )

    def __init__(
        self,
        server: Server,
        session: Session,
        job: Job,
        rid: Any,
        request: dict[str, Any],
        round_: Round,
        rank: int,
        member: Member | None,
        deadline: float,
    ) -> None:
        super().__init__(session, deadline)
        self._server = server
        self.job = job
        self._rid = rid
        self._request = request
        self._round = round_
        self.rank = rank
        self._member = member
        self._started = time.perf_counter()

    def _unhook(self) -> None:
        self._server.members.stop_waiting(self._round, self)

    def finish(self) -> None:
        """The round completed (closed): answer with the rank, the round and the addresses asked for."""
        if not self._settle():
            return
        server, session, round_ = self._server, self._session, self._round
        if self._member is not None:
            self.rank = session.rank = self._member.rank  # assigned when the round closed
        error = None
        try:
            server.members.bind(session, round_, self.rank)
            packed = join_reply(self._rid, *self._answer())
            if packed is not None:
                session.send_encoded(packed)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(self._rid, exc)
        server.config.hooks.request("join", time.perf_counter() - self._started, error)

    def _answer(self) -> tuple[dict[str, Any], bytes | None]:
        round_, rank, h = self._round, self.rank, self._request
        answer: dict[str, Any] = {"rank": rank, "world_size": round_.world_size, "nonce": round_.nonce}
        if round_.elastic:
            answer.update(generation=round_.generation, survivors=round_.survivors)
            forming = self.job.forming  # ranks that came while this round closed wait for the next one
            if forming is not None and forming is not round_ and forming.members:
                answer["joining"] = len(forming.members)
        if "machine" in h:  # (a client that asks: whether all ranks share one machine)
            answer["one_machine"] = round_.one_machine()
        offsets = h.get("neighbours")
        if offsets is not None:  # the addresses of rank + offset (mod world_size), in the answer
            answer["addresses"] = round_.addresses([(rank + o) % round_.world_size for o in offsets])
        if h.get("peers", True) is False:
            return answer, None
        return answer, packed_peers(self._server, round_)

    def expire(self) -> None:
        """The deadline passed before the round completed: withdraw, and say who is missing."""
        if not self._settle():
            return
        round_, session = self._round, self._session
        # counted before this rank withdraws (it joined too), with those that gave up before it
        joined = sorted(round_.gave_up.union(round_.members))
        if len(round_.gave_up) < round_.world_size:  # (elastic: arrival numbers, as many bounded)
            round_.gave_up.add(self.rank)
        self._withdraw()
        exc: RendezvousError  # (a timeout: torch's DistStoreError, as its store's wait raises)
        if round_.elastic:
            exc = RendezvousTimeoutError(
                f"job {session.job!r}: only {len(joined)} rank(s) joined in time, the elastic world needs "
                f"at least {round_.min_size} (missing: {round_.min_size - len(joined)} rank(s))"
            )
        else:
            refused = "; joins refused meanwhile: " + "; ".join(round_.refused) if round_.refused else ""
            short = incomplete(round_.world_size, joined)
            exc = RendezvousTimeoutError(f"job {session.job!r}: {short}{refused}")
        session.reply_error(self._rid, exc)
        self._server.config.hooks.request("join", time.perf_counter() - self._started, type(exc).__name__)

    def cancel(self) -> None:
        """The joiner's connection went: withdraw its rank, answer nobody."""
        if self._settle():
            self._withdraw()

    def _withdraw(self) -> None:
        session = self._session
        self.job.withdraw(self._round, self.rank)
        if session.round is self._round:
            session.round = session.rank = None
