"""The sessions that are members of each round, and what they are told: a round closed (its joiners
wake), ranks wait to join (elastic), members departed (left, or declared failed: batched, one
event per round per flush, encoded once)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from arendez import burstlog, wire

from .hooks import ServerHooks
from .rounds import Departure, Round
from .state import Job, ServerState

if TYPE_CHECKING:
    from .connection import Session
    from .joins import JoinWait

log = logging.getLogger("arendez.server")

#: Departures gathered before failure news goes out (one event per round per flush).
DEPARTURE_BATCH = 0.01


def _summarise(what: str) -> Callable[[Sequence[Departure]], str]:
    def summarise(departures: Sequence[Departure]) -> str:
        by_job: dict[str, list[int]] = {}
        for gone in departures:
            by_job.setdefault(gone.job, []).append(gone.rank)
        jobs = "; ".join(f"job {job!r} rank(s) {burstlog.listing(ranks)}" for job, ranks in by_job.items())
        return f"{len(departures)} more rank(s) {what}: {jobs}; the first: {departures[0].reason}"

    return summarise


#: A job of 10,000 ranks that ends is 10,000 departures: the first of a burst is logged at once,
#: the rest as one line a second later (the same for failures, apart, at WARNING).
_FAILURES = burstlog.BurstLog(log, _summarise("declared failed"))
_LEAVES = burstlog.BurstLog(log, _summarise("left"))


class Members:
    """Round membership of the server's sessions, and the news sent to them."""

    def __init__(self, state: ServerState, hooks: ServerHooks) -> None:
        self.state = state
        self.hooks = hooks
        self.sessions: dict[tuple[str, bytes], set[Session]] = {}  # by (job, nonce)
        #: The joins waiting for each round to complete (or, elastic, to close).
        self.waiting: dict[Round, dict[JoinWait, None]] = {}
        #: Each round's peer addresses, encoded once for every member's join answer.
        self.peers_packed: dict[Round, bytes] = {}
        self._departed: list[Departure] = []
        self._departure_flush: asyncio.TimerHandle | None = None
        self._settle: dict[Round, asyncio.TimerHandle] = {}  # elastic rounds at their minimum
        self._joining_news: dict[str, asyncio.TimerHandle] = {}  # by job: "ranks wait to join"

    def close(self) -> None:
        """Send no more departure news (the server is closing)."""
        if self._departure_flush is not None:
            self._departure_flush.cancel()

    # -- membership --------------------------------------------------------------------------
    def bind(self, session: Session, round_: Round, rank: int) -> None:
        """``session`` is rank ``rank`` of ``round_`` from now on."""
        session.round, session.rank = round_, rank
        if round_.nonce:
            self.sessions.setdefault((session.job, round_.nonce), set()).add(session)

    def unbind(self, session: Session) -> None:
        """``session`` no longer hears its round's news."""
        round_ = session.round
        if round_ is not None and round_.nonce:
            key = (session.job, round_.nonce)
            members = self.sessions.get(key)
            if members is not None:
                members.discard(session)
                if not members:
                    del self.sessions[key]

    # -- joins -------------------------------------------------------------------------------
    def wait_for(self, round_: Round, join: JoinWait) -> None:
        """``join`` is answered when ``round_`` completes (``round_closed``)."""
        self.waiting.setdefault(round_, {})[join] = None

    def stop_waiting(self, round_: Round, join: JoinWait) -> None:
        waiting = self.waiting.get(round_)
        if waiting is not None:
            waiting.pop(join, None)
            if not waiting:
                del self.waiting[round_]

    def round_closed(self, round_: Round) -> None:
        """Answer the joiners of a round that just completed (or closed, elastic)."""
        timer = self._settle.pop(round_, None)
        if timer is not None:
            timer.cancel()
        for join in list(self.waiting.pop(round_, ())):
            join.finish()

    # -- elastic rounds ----------------------------------------------------------------------
    def elastic_joined(self, job: Job, round_: Round, settle: float) -> None:
        """A rank joined an elastic round that is not full: (re)start its settle time once it
        has its minimum, and tell the members of the job's running rounds that ranks wait."""
        loop = asyncio.get_running_loop()
        if len(round_.members) >= round_.min_size:
            timer = self._settle.pop(round_, None)
            if timer is not None:
                timer.cancel()
            self._settle[round_] = loop.call_later(settle, self._settled, job, round_)
        if job.rounds and job.name not in self._joining_news:
            self._joining_news[job.name] = loop.call_later(DEPARTURE_BATCH, self._tell_joining, job)

    def _settled(self, job: Job, round_: Round) -> None:
        self._settle.pop(round_, None)
        if job.settle(round_, time.monotonic()) is not None:
            self.round_closed(round_)

    def _close_ready(self, name: str) -> None:
        """Ranks of ``name`` left or failed: its elastic round being formed may close now."""
        job = self.state.jobs.get(name)
        closed = job.close_ready(time.monotonic()) if job is not None else None
        if closed is not None:
            self.round_closed(closed)

    def _tell_joining(self, job: Job) -> None:
        """One ``joining`` event per running round of ``job``: how many ranks wait to join."""
        self._joining_news.pop(job.name, None)
        forming = job.forming
        if forming is None or not forming.elastic:
            return
        for nonce in list(job.rounds):  # (the round named: news racing a re-form is not lost)
            event = wire.encode({"event": "joining", "waiting": len(forming.members), "round": nonce})
            for session in self.sessions.get((job.name, nonce), ()):
                if session.conn.is_open:
                    session.send_encoded(event)

    # -- departures --------------------------------------------------------------------------
    def depart(self, departures: list[Departure]) -> None:
        """Queue departures; they go out batched, one event per round per flush."""
        if not departures:
            return
        for gone in departures:
            self.hooks.departed(gone)
            burst, level = (_FAILURES, logging.WARNING) if gone.failed else (_LEAVES, logging.INFO)
            burst.note(None, level, gone, "job %r rank %d %s", gone.job, gone.rank, gone.reason)
        self._departed.extend(departures)
        for name in {gone.job for gone in departures}:
            self._close_ready(name)
        if self._departure_flush is None:
            loop = asyncio.get_running_loop()
            self._departure_flush = loop.call_later(DEPARTURE_BATCH, self._flush_departures)

    def _flush_departures(self) -> None:
        self._departure_flush = None
        departed, self._departed = self._departed, []
        by_round: dict[tuple[str, bytes], list[list[Any]]] = {}
        for gone in departed:
            by_round.setdefault((gone.job, gone.nonce), []).append([gone.rank, gone.kind, gone.reason])
        for key, ranks in by_round.items():
            event = wire.encode({"event": "departed", "ranks": ranks})
            for session in self.sessions.get(key, ()):
                if session.conn.is_open:
                    session.send_encoded(event)
