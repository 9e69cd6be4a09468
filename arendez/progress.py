"""Progress queries: ask the members of a group how many of its collectives they started.

A collective that times out uses the answers to name the ranks that never arrived (and those
that did not answer at all).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Collection

from . import frames

Send = Callable[[int, frames.Frame], bool]


class Progress:
    """Outstanding queries of one rank, and its answers to others."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._queries: dict[int, tuple[dict[int, int], asyncio.Future[None], int]] = {}
        self._qids = itertools.count()

    async def ask(self, gid: int, peers: Collection[int], timeout: float) -> dict[int, int]:
        """Collectives of group ``gid`` each of ``peers`` has started, from those that answer
        within ``timeout``."""
        qid = next(self._qids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: dict[int, int] = {}
        asked = [peer for peer in peers if self._send(peer, frames.Query(gid, qid))]
        self._queries[qid] = (answers, done, len(asked))
        try:
            if asked:
                try:
                    async with asyncio.timeout(timeout):
                        await done
                except TimeoutError:
                    pass
            return dict(answers)
        finally:
            del self._queries[qid]

    def on_answer(self, peer: int, frame: frames.Answer) -> None:
        entry = self._queries.get(frame.qid)
        if entry is not None:
            answers, done, expected = entry
            answers[peer] = frame.started
            if len(answers) >= expected and not done.done():
                done.set_result(None)
