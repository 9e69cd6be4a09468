"""Progress queries: ask the members of a group how many of its collectives they started.

A collective that times out uses the answers to name the ranks that never arrived (and those
that did not answer at all). Peer connections open on first use, so a query to a group of at
most ``DIAL_LIMIT`` ranks connects to the members it has no connection to yet; in a larger
group only the connected members (the algorithms' neighbours) are asked, so a timeout at scale
does not open all pairs.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection
from typing import Protocol

from . import frames

#: Groups up to this size get every member asked (dialing the unconnected ones).
DIAL_LIMIT = 64


class Send(Protocol):
    def __call__(self, peer: int, frame: frames.Frame, *, dial: bool = ...) -> bool: ...


class Progress:
    """Outstanding queries of one rank, and its answers to others."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._queries: dict[int, tuple[dict[int, int], asyncio.Future[None], int]] = {}
        self._qids = itertools.count()

    async def ask(self, gid: int, peers: Collection[int], timeout: float) -> tuple[dict[int, int], list[int]]:
        """Collectives of group ``gid`` each of ``peers`` has started, from those that answer
        within ``timeout``; and the peers asked (all of them in a group of at most
        ``DIAL_LIMIT``, else the connected ones)."""
        qid = next(self._qids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: dict[int, int] = {}
        dial = len(peers) < DIAL_LIMIT
        asked = [peer for peer in peers if self._send(peer, frames.Query(gid, qid), dial=dial)]
        self._queries[qid] = (answers, done, len(asked))
        try:
            if asked:
                try:
                    async with asyncio.timeout(timeout):
                        await done
                except TimeoutError:
                    pass
            return dict(answers), asked
        finally:
            del self._queries[qid]

    def on_answer(self, peer: int, frame: frames.Answer) -> None:
        entry = self._queries.get(frame.qid)
        if entry is not None:
            answers, done, expected = entry
            answers[peer] = frame.started
            if len(answers) >= expected and not done.done():
                done.set_result(None)
