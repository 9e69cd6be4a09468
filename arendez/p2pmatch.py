"""Point-to-point matching: posted receives (``src`` or any rank) against arriving messages.

A message satisfies the oldest posted receive of its group and tag from its sender (or from any
rank); one that finds none is stashed for the next such receive. The transport asks ``sink``
where a payload should go before the frame completes (for every message, an empty one too):
the receive it chose is remembered per peer, in order, so back-to-back frames in one read reach
their own receives.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from .errors import CollectiveMismatchError, RankFailedError
from .mailbox import Stats, settle


@dataclass
class Posted:
    """One posted receive."""

    src: int | None
    gid: int
    tag: int
    out: memoryview
    fut: asyncio.Future[int]
    #: the fingerprint a message must carry (a collective built on messages), or None: any
    expect: str | None = None
    error: BaseException | None = None


class P2PMatcher:
    """The posted receives, claimed ones and stashed messages of one world."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._posted: list[Posted] = []
        # per peer, what the sink chose for each message whose payload is still arriving (the
        # decoder may consult the sink for the next frame before the current one is routed)
        self._receiving: dict[int, collections.deque[Posted | None]] = {}
        self._stash: collections.deque[tuple[int, int, int, memoryview | None, str]] = collections.deque()

    def waiting(self) -> bool:
        """Whether a posted receive waits for its message."""
        return any(not posted.fut.done() for posted in self._posted)

    def _claim(self, peer: int, gid: int, tag: int, nbytes: int, fp: str) -> Posted | None:
        """Take the oldest posted recv that a message from ``peer`` satisfies."""
        for i, posted in enumerate(self._posted):
            if posted.fut.done():
                continue
            if posted.gid == gid and posted.tag == tag and posted.src in (None, peer):
                del self._posted[i]
                posted.error = _mismatch(posted.out.nbytes, posted.expect, peer, nbytes, fp)
                return posted
        return None

    def sink(self, peer: int, gid: int, tag: int, nbytes: int, fp: str = "") -> memoryview | None:
        """Where a message's ``nbytes`` payload should land (None: a fresh buffer)."""
        posted = self._claim(peer, gid, tag, nbytes, fp)
        self._receiving.setdefault(peer, collections.deque()).append(posted)
        if posted is not None and posted.error is None:
            return posted.out[:nbytes]  # (a shorter message fills the buffer's start)
        return None

    def deliver(self, peer: int, gid: int, tag: int, payload: memoryview | None, fp: str = "") -> None:
        """A message from ``peer`` is complete."""
        claims = self._receiving.get(peer)
        posted = claims.popleft() if claims else None
        if posted is None or posted.fut.done():
            # the recv may have been posted while the payload streamed in, or the one that
            # claimed it gave up since (timed out, cancelled): the message goes to the next one
            posted = self._claim(peer, gid, tag, 0 if payload is None else payload.nbytes, fp)
        if posted is None:
            self._stash.append((peer, gid, tag, payload, fp))
            return
        if posted.error is not None:
            posted.fut.set_exception(posted.error)
            return
        if payload is not None and payload.obj is not posted.out.obj:
            posted.out[: payload.nbytes] = payload
            self.stats.copied_bytes += payload.nbytes
        posted.fut.set_result(peer)

    def post(
        self,
        src: int | None,
        gid: int,
        tag: int,
        out: memoryview,
        dead: dict[int, str],
        expect: str | None = None,
    ) -> asyncio.Future[int]:
        """Post a receive (of a message whose fingerprint is ``expect``, if given); a stashed
        message satisfies it at once."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        for i, (sender, g, t, data, fp) in enumerate(self._stash):
            if g == gid and t == tag and src in (None, sender):
                del self._stash[i]
                size = 0 if data is None else data.nbytes
                error = _mismatch(out.nbytes, expect, sender, size, fp)
                if error is not None:
                    fut.set_exception(error)
                else:
                    if data is not None:
                        out[:size] = data
                        self.stats.copied_bytes += size
                    fut.set_result(sender)
                return fut
        if src is not None and src in dead:
            fut.set_exception(RankFailedError(src, "recv", dead[src]))
            return fut
        self._posted.append(Posted(src, gid, tag, out, fut, expect))
        return fut

    def has_stashed(self, src: int, gid: int, tag: int) -> bool:
        """Whether a message from ``src`` of group ``gid`` and ``tag`` arrived and waits for its
        receive (a rank that failed since may have sent it: it is delivered all the same)."""
        return any(g == gid and t == tag and sender == src for sender, g, t, _, _ in self._stash)

    def cancel(self, fut: asyncio.Future[int]) -> None:
        """Withdraw the receive ``fut`` (timed out or cancelled): it must not eat a message."""
        self._posted = [p for p in self._posted if p.fut is not fut]

    def unclaim(self, peer: int, fut: asyncio.Future[int]) -> None:
        """The recv ``fut`` gave up the message now arriving from ``peer`` (it lands in a fresh
        buffer): once complete it goes to the next matching recv, or the stash."""
        claims = self._receiving.get(peer, ())
        for i, claimed in enumerate(claims):
            if claimed is not None and claimed.fut is fut:
                claims[i] = None  # type: ignore[index]

    def fail_group(self, gid: int, exc: BaseException) -> None:
        """Wake every pending recv of group ``gid`` with ``exc``."""
        for posted in self._posted:
            if posted.gid == gid:
                settle(posted.fut, exc)
        for claims in self._receiving.values():
            for claimed in claims:
                if claimed is not None and claimed.gid == gid:
                    settle(claimed.fut, exc)

    def waits_on(self, peer: int) -> bool:
        """Whether a receive is posted (from ``peer`` or any rank) or ``peer``'s message is
        arriving: only then can the loss of ``peer`` fail one."""
        return bool(self._posted) or bool(self._receiving.get(peer))

    def peer_lost(
        self,
        peer: int,
        reason: str,
        earlier: list[tuple[int, str]] | None = None,
        any_source_groups: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Fail the receives that wait on ``peer``, and those from any rank of the groups
        ``any_source_groups``; their errors name the ``earlier`` failures (rank, reason) first."""

        def error() -> RankFailedError:
            return RankFailedError.naming("recv", [*(earlier or ()), (peer, reason)])

        for posted in self._posted:
            if posted.src == peer or (posted.src is None and posted.gid in any_source_groups):
                settle(posted.fut, error())
        for claimed in self._receiving.pop(peer, ()):
            if claimed is not None:
                settle(claimed.fut, error())


def _mismatch(
    want: int, expect: str | None, peer: int, nbytes: int, fp: str
) -> CollectiveMismatchError | None:
    """Why a recv of ``want`` bytes (of fingerprint ``expect``) cannot take a message of
    ``nbytes`` (of fingerprint ``fp``) from rank ``peer``, or None. A plain recv (no ``expect``)
    takes a message shorter than its buffer, into the buffer's start, as gloo's and MPI's do; a
    longer one would be truncated, and is refused."""
    if expect is not None and fp != expect:
        theirs, ours = (" ".join(f.split("|")).strip() for f in (fp, expect))
        return CollectiveMismatchError(
            f"rank {peer} sent its part of {theirs!r} where this rank runs {ours!r} "
            "(every member must make the same collectives, with the same dtype and op, in the same order)"
        )
    if nbytes > want or (expect is not None and nbytes != want):
        return CollectiveMismatchError(f"recv of {want} bytes from rank {peer} got a send of {nbytes}")
    return None
