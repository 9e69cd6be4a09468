"""What ``arendez-run`` (``arendez.launch``) blames a failed run on.

The rank that failed first, which is not simply the first to exit: the ranks that fail on the
news of a failure may end before the rank that failed. A rank notes why and when it failed in its
error file (``arendez.errorfile``); the earliest note or exit is blamed. And, for a run against a
given ``--server``, whether that server can be reached at all.
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from . import children, errorfile
from .rendezvous import DEFAULT_PORT

#: Seconds to wait, once a rank failed, for the rank that noted an earlier failure to end.
SETTLE = 2.0


@dataclass(frozen=True)
class Blame:
    """The rank that failed first: its exit status and, if it noted one, why. A rank that never
    ended (stopped, hung) is blamed through the rank that ``reported`` it; ``returncode`` is then
    that reporter's."""

    rank: int
    returncode: int
    why: str | None
    reported: int | None = None


def _earliest(
    ranks: Sequence[children.Child], reaped: dict[int, int], notes: Sequence[str], now: float
) -> tuple[int, errorfile.Failure | None] | None:
    """The rank whose failure came first: by its own note (``arendez.errorfile``) or its exit,
    whichever is earlier, and its note; ranks that ended with 0 did not fail."""
    best: tuple[float, int, errorfile.Failure | None] | None = None
    for rank, child in enumerate(ranks):
        if reaped.get(rank) == 0:
            continue
        note = errorfile.read(notes[rank]) if notes else None
        times = [note.time] if note is not None else []
        if reaped.get(rank, 0) != 0:
            times.append(child.ended or now)
        if times and (best is None or min(times) < best[0]):
            best = (min(times), rank, note)
    return None if best is None else best[1:]


def _culprit(
    ranks: Sequence[children.Child], reaped: dict[int, int], notes: Sequence[str], rank: int
) -> tuple[int, str | None] | None:
    """The peer ``rank`` failed on (the first failure it heard of), if that peer
    noted no failure of its own: it died without a word (killed: its exit may be seen a few ms
    after ``rank``'s note) or stopped answering (SIGSTOP, a hang: it has not ended). With the
    reason ``rank`` heard for a peer that has not ended, None for one that has."""
    said = errorfile.failed_on(notes[rank]) if notes else None
    if said is None or not 0 <= said[0] < len(ranks) or said[0] == rank or reaped.get(said[0]) == 0:
        return None
    if errorfile.read(notes[said[0]]) is not None:
        return None  # (it noted a failure: the earliest note or exit decides)
    return (said[0], None) if said[0] in reaped else said


async def first_failure(ranks: Sequence[children.Child], notes: Sequence[str] = ()) -> Blame | None:
    """Wait for the ranks: the one that failed first, or None when all succeed.

    Not simply the first to exit: the ranks that fail on the news of a failure may end before
    the rank that failed. Once any rank failed, the one with the earliest failure (``_earliest``)
    gets up to ``SETTLE`` seconds to end and is blamed.
    """
    loop = asyncio.get_running_loop()
    reaped: dict[int, int] = {}
    changed = asyncio.Event()

    def on_exit(rank: int, fut: asyncio.Future[int]) -> None:
        if not fut.cancelled():
            reaped[rank] = fut.result()
            changed.set()

    waits = [asyncio.ensure_future(r.proc.wait()) for r in ranks]
    for rank, fut in enumerate(waits):
        fut.add_done_callback(functools.partial(on_exit, rank))
    try:
        while not any(reaped.values()):
            if len(reaped) == len(ranks):
                return None
            await changed.wait()
            changed.clear()
        deadline = loop.time() + SETTLE
        while True:
            first = _earliest(ranks, reaped, notes, time.time())
            assert first is not None  # a rank failed
            rank, note = first
            why = None if note is None else note.why
            if rank in reaped:
                culprit = _culprit(ranks, reaped, notes, rank)
                if culprit is None:
                    return Blame(rank, reaped[rank], why)
                peer, heard = culprit
                if peer in reaped:  # (died without a word: killed, say)
                    return Blame(peer, reaped[peer], None)
                if loop.time() >= deadline:  # (given the same time to end or speak as any)
                    return Blame(peer, reaped[rank], heard, reported=rank)
            elif loop.time() >= deadline:  # it noted a failure but does not end: blame the exits
                exited = _earliest(ranks, reaped, (), time.time())
                assert exited is not None
                return Blame(exited[0], reaped[exited[0]], None)
            await children.until(changed, deadline - loop.time())
            changed.clear()
    finally:
        for fut in waits:
            fut.cancel()


async def server_unreachable(url: str, timeout: float = 2.0) -> str | None:
    """Why the arendez server of ``url`` cannot be reached (a TCP connect), or None if it can."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "arendez" or parts.hostname is None:
        return None  # (etcd: its client says what is wrong)
    try:
        port = parts.port or DEFAULT_PORT  # (arendez:// without a port: the server's default)
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    writer.close()
    return None
