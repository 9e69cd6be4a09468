"""A process's event loop that stood still or is overloaded: what it must not blame on peers.

Two cases. A loss seen just after the loop stood still waits for the server's word
(``StallWatch``, below). A timeout meant for a silent peer waits longer while this loop itself
is overloaded (``patient_timeout``).

A rank that was stopped (SIGSTOP, a frozen VM) for longer than its lease was declared failed by
the server meanwhile, and its peers went on without it and closed their connections. Resumed,
it finds both in its sockets at once: the server's word ("this rank was declared failed") and
the closed peer connections (a send fails with a broken pipe, a read sees the close). Whichever
the event loop handles first would be blamed, and the peers' closes often come first. So a loss
seen just after the loop stood still is blamed only after a round trip to the store, which
reads everything the server sent before it (``World.blame``).

The watch is a timer that ticks every ``TICK`` seconds on each event loop that has a world: a
tick late by over ``STALL`` seconds, or a loss seen while one is overdue that much, means the loop
stood still. A busy step of user code counts as well: its cost is one store round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from collections.abc import AsyncIterator
from typing import Any

from .perloop import LoopWatch, of_loop

#: Seconds between ticks.
TICK = 0.25
#: Seconds a tick may be late before the loop counts as having stood still.
STALL = 1.0
#: Seconds after a late tick during which losses are still doubted.
GRACE = 2.0


class StallWatch(LoopWatch):
    """Ticks on one event loop while any of its ``users`` is alive and open."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()
        self.due = math.inf  # when the next tick is due (loop time)
        self.resumed_until = -math.inf

    def watch(self, user: Any) -> None:
        """Keep ticking while ``user`` lives and its ``closed`` is false."""
        self.users.add(user)
        if not self._armed:
            self._armed = True
            self.due = self.loop.time() + TICK
            self.loop.call_at(self.due, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        if now > self.due + STALL:
            self.resumed_until = now + GRACE
        if not any(not getattr(user, "closed", True) for user in self.users):
            self._armed, self.due = False, math.inf
            return
        self.due = now + TICK
        self.loop.call_at(self.due, self._tick)

    def just_resumed(self) -> bool:
        """Whether the loop stood still just now (a tick overdue, or late only moments ago)."""
        now = self.loop.time()
        return now > self.due + STALL or now < self.resumed_until


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StallWatch] = weakref.WeakKeyDictionary()


def watch_for(loop: asyncio.AbstractEventLoop) -> StallWatch:
    """The stall watch of ``loop`` (one per loop)."""
    return of_loop(_watches, loop, StallWatch)


#: How many times its length a ``patient_timeout`` may last while the loop is overloaded.
PATIENCE = 6
#: A loop counts as overloaded when one pass through its ready queue takes this fraction of
#: the timeout's length or more.
OVERLOADED = 0.05


@contextlib.asynccontextmanager
async def patient_timeout(seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)`` that waits longer (``seconds`` at a time, up to ``PATIENCE``
    times in all) while this event loop is overloaded. A timeout meant for a silent peer
    (a handshake) must not fire because thousands of ranks in this process keep the loop from
    reading the peer's answer: the peer would dial again, and the retries load the loops more,
    until few handshakes end in time (seen with 2,000 ranks over 4 processes on 2 cores and the
    limit at 1.2 s: 70,630 of 96,666 handshakes cut)."""
    loop = asyncio.get_running_loop()
    cap = loop.time() + seconds * PATIENCE
    async with asyncio.timeout(None) as timer:
        handle: asyncio.Handle | None = None

        def due() -> None:
            nonlocal handle
            began = loop.time()

            def probe() -> None:  # (runs after everything already in the ready queue)
                nonlocal handle
                now = loop.time()
                if now - began >= seconds * OVERLOADED and now < cap:
                    handle = loop.call_at(min(cap, now + seconds), due)
                else:
                    timer.reschedule(now)

            handle = loop.call_soon(probe)

        handle = loop.call_at(loop.time() + seconds, due)
        try:
            yield
        finally:
            handle.cancel()
