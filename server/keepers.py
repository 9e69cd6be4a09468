"""The lease keeper connections of client processes, and whether the server hears them at all.

A client process renews its lease over one keeper connection (``arendez.lease``). The server
counts those connections and the heartbeats on them (``Hearing``): when none is heard while
two or more are open, it holds its failure declarations for the members whose keeper is still
connected (``Member.spared``), since the silence is as likely its own isolation as their deaths.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .rounds import Hearing, Lease

if TYPE_CHECKING:
    from .connection import Session
    from .state import ServerState

log = logging.getLogger("arendez.server")


class Keepers:
    """The open keeper connections of every lease, and the hold they may call for."""

    def __init__(self, lease: float) -> None:
        self.hearing = Hearing(time.monotonic(), lease)
        self.open = 0  # keeper connections, of every lease
        #: Failure declarations are being held: no client heard (``judge``).
        self.held = False

    def keep(self, session: Session, lease: Lease, now: float) -> None:
        """``session`` keeps ``lease`` from now on, and renews it."""
        if session.lease is not lease:
            self.let_go(session)
            if not self.open:  # a silence with nobody to hear is no silence (``Hearing``)
                self.hearing.last = now
            session.lease, self.open = lease, self.open + 1
            lease.keepers += 1
        lease.renew(now)
        self.heard(now)

    def let_go(self, session: Session) -> Lease | None:
        """``session`` no longer keeps its lease (which is returned)."""
        lease, session.lease = session.lease, None
        if lease is not None:
            lease.keepers -= 1
            self.open -= 1
            self.held = self.held and self.open > 0
        return lease

    def heard(self, now: float) -> None:
        """A client's heartbeat arrived (``Hearing``): after a silence, every lease restarts."""
        silence = self.hearing.hear(now)
        if silence is not None and self.held:
            self.held = False
            restart = ": leases restart in one lease" if self.hearing.since > now else ""
            log.warning("heard clients again after %.1fs of silence%s", silence, restart)

    def judge(self, state: ServerState, now: float, lease: float, arm_grace: float) -> tuple[float, bool]:
        """For the lease check at ``now``: since when leases count (``Hearing.since``), and
        whether the server is deaf (a lone keeper that went silent is a process as likely
        stopped); the start of a hold is logged."""
        since = self.hearing.since
        deaf = self.hearing.deaf(now) and self.open >= 2
        if deaf and not self.held and state.spared(now, lease, arm_grace, since):
            self.held = True
            log.warning(
                "heard no client for %.1fs, and leases ran out: holding failure declarations "
                "until clients are heard again (is this server cut off from the network?)",
                now - self.hearing.last,
            )
        return since, deaf
