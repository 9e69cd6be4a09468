"""The link watch's rules (``arendez/linkwatch.py``), on links whose ``TCP_INFO`` the test
makes up: what counts as cut, what is nudged, and what it keeps. Real cuts between emulated
hosts are in ``tests/test_partition.py``."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from typing import Any

import pytest

from arendez import frames, linkwatch, stall


def info(
    *, unacked: int = 0, retransmits: int = 0, probes: int = 0, ack_ms: int = 0, data_ms: int = 0
) -> bytes:
    """A ``struct tcp_info`` prefix with these fields (the rest 0)."""
    fields = [0] * 21
    fields[2], fields[3], fields[12] = retransmits, probes, unacked
    fields[17] = fields[19] = data_ms
    fields[20] = ack_ms
    return linkwatch._TCP_INFO.pack(*fields)


class Conn:
    def __init__(self) -> None:
        self.raw = info()
        self.cut_with: BaseException | None = None
        self.is_open = True
        self.socket = self

    family = socket.AF_INET

    def getsockopt(self, *_: Any) -> bytes:
        return self.raw

    def fail(self, exc: BaseException, *, at_once: bool = False) -> None:
        assert at_once  # (a cut link is aborted: a close would wait for bytes it cannot send)
        self.cut_with, self.is_open = exc, False


class World:
    def __init__(self, conns: dict[int, Conn]) -> None:
        self.mesh = self
        self.conns = conns
        self.closed = False
        self.sent: list[tuple[int, frames.Frame]] = []

    def busy(self) -> bool:
        return True

    def send_control(self, peer: int, frame: frames.Frame) -> bool:
        self.sent.append((peer, frame))
        return True


def test_the_state_read_from_tcp_info() -> None:
    cut = linkwatch.LinkState(info(unacked=3, retransmits=2, ack_ms=21_000, data_ms=0))
    assert cut.unanswered and cut.silent == 21.0 and cut.idle == 0.0
    closed_window = linkwatch.LinkState(info(probes=1, ack_ms=35_000, data_ms=35_000))
    assert not closed_window.unanswered and closed_window.idle == 35.0  # (its probes are answered)
    assert linkwatch.LinkState(info(probes=2, ack_ms=9_000)).unanswered  # (two probes unanswered)
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()) as s,
    ):
        found = linkwatch.state(s)
        assert found is not None and not found.unanswered
    left, right = socket.socketpair()
    with left, right:
        assert linkwatch.state(left) is None  # (not TCP)


async def test_a_link_is_cut_only_after_checks_in_a_row_saw_it_unanswered_for_the_timeout() -> None:
    watch = linkwatch.LinkWatch(asyncio.get_running_loop(), 4.0)  # (checks a second apart)
    conn = Conn()
    world = World({1: conn})
    conn.raw = info(unacked=1, retransmits=3, ack_ms=60_000)
    watch._unanswered[conn] = (0.0, 50.0)  # (a sighting in an earlier busy spell: not in a row)
    for now in (100.0, 101.0, 102.0):  # seen for 2 s, plus the period it may have missed: < 4 s
        watch.check(world, now)
        assert conn.cut_with is None
    watch.check(world, 103.0)  # 3 s in a row, plus the period: the timeout
    assert isinstance(conn.cut_with, ConnectionAbortedError)
    message = str(conn.cut_with)
    assert "stopped acknowledging what it was sent: nothing for 60s, past ARENDEZ_LINK_TIMEOUT=4s" in message


async def test_a_closed_window_is_never_cut_and_an_idle_link_is_nudged() -> None:
    watch = linkwatch.LinkWatch(asyncio.get_running_loop(), 4.0)
    waiting, idle, busy = Conn(), Conn(), Conn()
    waiting.raw = info(probes=1, ack_ms=120_000, data_ms=120_000)  # peer not reading for 2 minutes
    idle.raw = info(ack_ms=2_500, data_ms=2_500)
    busy.raw = info(unacked=5, ack_ms=3, data_ms=3)
    world = World({0: waiting, 1: idle, 2: busy})
    for now in range(10):
        watch.check(world, float(now))
    assert waiting.cut_with is None and idle.cut_with is None and busy.cut_with is None
    assert {peer for peer, _ in world.sent} == {0, 1}  # (idle for half the timeout; not the busy one)
    assert all(frame == linkwatch.NUDGE for _, frame in world.sent)


def test_the_watches_do_not_keep_their_event_loop_alive() -> None:
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one() -> None:
        loop = asyncio.get_running_loop()
        loops.append(weakref.ref(loop))
        world = World({})  # (open: both watches are armed when the loop closes)
        linkwatch.watch(world, loop)
        stall.watch_for(loop).watch(world)
        assert loop in linkwatch._watches and loop in stall._watches

    for _ in range(3):
        asyncio.run(one())
    gc.collect()
    assert [ref() for ref in loops] == [None] * 3


def test_a_link_timeout_under_a_second_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARENDEZ_LINK_TIMEOUT", "0.5")
    with pytest.raises(ValueError, match=r"must be 0 \(off\) or at least 1 second, got 0.5"):
        linkwatch.link_timeout()
    monkeypatch.setenv("ARENDEZ_LINK_TIMEOUT", "0")
    assert linkwatch.link_timeout() == 0.0
    monkeypatch.delenv("ARENDEZ_LINK_TIMEOUT")
    assert linkwatch.link_timeout() == 20.0
