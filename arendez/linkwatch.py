"""Peer links whose far host stopped answering: the network cuts the server cannot see.

The server declares a rank failed when its process stops heartbeating. Two cuts escape it: a
link between two ranks it hears both of (a partition between hosts), and the view from a rank
whose own host was cut off, which waits on peers that went on without it (until its
collective's timeout: 5 minutes by default, 30 under torch). TCP tells both apart from a slow
peer: the peer's kernel acknowledges every segment, whatever its process is doing (stopped,
busy, or not reading: a full receive window answers its probes too). Only a cut, or a host that
is gone, leaves data unacknowledged while TCP retransmits it.

So while a world has collectives or point-to-point calls in progress, the watch of its event
loop reads ``TCP_INFO`` of each of its TCP peer links every quarter ``LINK_TIMEOUT``. A link on
which data (or window probes) have gone unacknowledged for ``LINK_TIMEOUT`` is cut: its peer is
lost, with the reason, as when its connection closes. A link that has carried nothing either way
for half of it gets a progress query its peer answers (no answer is needed, only the
acknowledgement), so a rank that only receives notices a cut too (``LINK_TIMEOUT`` after the
nudge). Nothing runs for a world at rest, and a nudge is two small frames. Linux only (elsewhere the
watch does nothing, and a cut ends a collective at its timeout).

``LINK_TIMEOUT`` is not ``TCP_USER_TIMEOUT``: that also cuts a healthy connection whose peer has
not read for as long (a long step of user code on its event loop), since Linux 5.11 counts a
closed receive window as unanswered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import weakref
from typing import Any

from . import frames
from .perloop import LoopWatch, of_loop
from .settings import env_seconds

log = logging.getLogger("arendez.linkwatch")


def link_timeout() -> float:
    """``ARENDEZ_LINK_TIMEOUT``: 0 (off), or at least a second (a few checks, a quarter timeout
    apart, must see a link unanswered before it is cut)."""
    seconds = env_seconds("ARENDEZ_LINK_TIMEOUT", 20.0)
    if 0 < seconds < 1:
        raise ValueError(f"ARENDEZ_LINK_TIMEOUT must be 0 (off) or at least 1 second, got {seconds:g}")
    return seconds


#: Seconds a peer's host may leave what this rank sent unacknowledged before the link counts as
#: cut (``ARENDEZ_LINK_TIMEOUT``; 0 turns the watch off). TCP's retransmissions back off to
#: 6.4 s apart by then, so a cut of up to about 10 s heals without notice.
LINK_TIMEOUT = link_timeout()
#: The query that nudges an idle link: its answer is ignored (no query has this id).
NUDGE = frames.Query(0, -1)

#: ``struct tcp_info`` up to ``tcpi_last_ack_recv``: state, ca_state, retransmits, probes,
#: backoff, options, wscales, flags; rto, ato, snd_mss, rcv_mss, unacked, sacked, lost, retrans,
#: fackets, last_data_sent, last_ack_sent, last_data_recv, last_ack_recv (ms).
_TCP_INFO = struct.Struct("8B13I")
_TCP_INFO_OPT = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None


class LinkState:
    """What ``TCP_INFO`` says of one link."""

    __slots__ = ("idle", "silent", "unanswered")

    def __init__(self, raw: bytes) -> None:
        fields = _TCP_INFO.unpack_from(raw)
        retransmits, probes, unacked = fields[2], fields[3], fields[12]
        last_data_sent, last_data_recv, last_ack_recv = fields[17], fields[19], fields[20]
        #: whether something this side sent waits for an acknowledgement TCP keeps asking for
        self.unanswered = (unacked > 0 and retransmits > 0) or probes >= 2
        #: seconds since the far host last acknowledged anything
        self.silent = last_ack_recv / 1000
        #: seconds since data last went either way (0 while some is unacknowledged)
        self.idle = 0.0 if unacked else min(last_data_sent, last_data_recv) / 1000


def state(sock: Any) -> LinkState | None:
    """The state of TCP socket ``sock``, or None (not TCP over IP, or no ``TCP_INFO`` here)."""
    if _TCP_INFO_OPT is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO_OPT, _TCP_INFO.size)
    except OSError:
        return None
    return LinkState(raw) if len(raw) >= _TCP_INFO.size else None


class LinkWatch(LoopWatch):
    """Checks the TCP peer links of the busy worlds of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        super().__init__(loop)
        self.limit = timeout
        self.period = timeout / 4
        self.worlds: weakref.WeakSet[Any] = weakref.WeakSet()
        #: when the watch first and last saw each link's data go unanswered (loop time)
        self._unanswered: weakref.WeakKeyDictionary[Any, tuple[float, float]] = weakref.WeakKeyDictionary()

    def watch(self, world: Any) -> None:
        """Check ``world``'s links (``world.mesh.conns``) while it is open and ``world.busy()``."""
        self.worlds.add(world)
        if not self._armed:
            self._armed = True
            self.loop.call_later(self.period, self._check)

    def _check(self) -> None:
        self._armed = False
        live = [w for w in self.worlds if not w.closed]
        try:
            for world in live:
                if world.mesh is not None and world.busy():
                    self.check(world, self.loop.time())
        except Exception:  # (a bug here must not end the watch of every world of the loop)
            log.exception("the link watch failed; it goes on")
        finally:
            if live:
                self._armed = True
                self.loop.call_later(self.period, self._check)

    def check(self, world: Any, now: float) -> None:
        """Cut ``world``'s links whose far host stopped answering; nudge its idle ones (``now``:
        the loop's time)."""
        for peer, conn in list(world.mesh.conns.items()):
            found = state(getattr(conn, "socket", None))
            if found is None or not conn.is_open:
                continue
            if not found.unanswered:
                self._unanswered.pop(conn, None)
            elif min(found.silent, now - self._seen_unanswered(conn, now) + self.period) >= self.limit:
                # (unanswered for as long as the watch has seen, plus the period it may have missed;
                # and at most since the last acknowledgement: a nudged idle link's came long before)
                conn.fail(
                    ConnectionAbortedError(
                        f"its host stopped acknowledging what it was sent: nothing for {found.silent:.0f}s,"
                        f" past ARENDEZ_LINK_TIMEOUT={self.limit:g}s; the network to it is cut, or its host"
                        " is down"
                    ),
                    at_once=True,
                )
                continue
            if found.idle >= self.limit / 2:
                world.send_control(peer, NUDGE)

    def _seen_unanswered(self, conn: Any, now: float) -> float:
        """Since when the watch has seen ``conn``'s data unanswered in checks in a row (a
        sighting in an earlier busy spell, with checks missed since, does not count)."""
        first, last = self._unanswered.get(conn, (now, now))
        if now - last > 1.5 * self.period:
            first = now
        self._unanswered[conn] = (first, now)
        return first


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LinkWatch] = weakref.WeakKeyDictionary()


def watch(world: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Watch ``world``'s links on ``loop`` (one watch per loop; none with ``LINK_TIMEOUT`` 0)."""
    if LINK_TIMEOUT:
        of_loop(_watches, loop, lambda loop: LinkWatch(loop, LINK_TIMEOUT)).watch(world)
