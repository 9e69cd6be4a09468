"""torch's ``TCPStore.barrier(key, world_size)`` as torch's server keeps it, for both kinds of
client: torch's own on the TCPStore port (``tcpstore_front``) and arendez's (the ``barrier``
store request, which ``arendez.sync.TCPStore.barrier`` sends), so the two meet in one barrier.

Each arrival adds 1 to the counter at the key (a plain key). An arrival that brings it to its
own count goes on and frees every caller waiting on the key, as does any other change of the
key (a ``set``, ``add``, ``append`` or ``compare_set``, whatever the value; not a ``delete``);
an arrival short of its count frees none (a call with a larger count waits for a later one)
and wakes no plain ``wait`` on the key either. A caller that gives up (its timeout, its
connection gone) stays counted, as on torch's server.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from arendez.errors import StoreTimeoutError

from .waits import TimedWait

if TYPE_CHECKING:
    from .app import Server
    from .connection import Session
    from .state import Job


class Waiter(Protocol):
    """A caller waiting on a barrier: ``passed`` is called (soon after, not inside the change
    that passed it) when the barrier lets it go on."""

    def passed(self) -> None: ...


class Barrier:
    """The callers waiting on one key of one job."""

    __slots__ = ("_held", "_job", "_key", "_server", "waiting")

    def __init__(self, server: Server, job: str, key: str) -> None:
        self._server, self._job, self._key = server, job, key
        self.waiting: dict[Waiter, None] = {}
        self._held = False  # (during an arrival: its own change of the key frees no one)

    def arrive(self, job: Job, members: int) -> bool:
        """Count one arrival; ``True`` if it goes on at once (and every waiter with it)."""
        self._held = True
        try:
            arrived = job.add(self._key, 1)
            if arrived >= members:  # (plain waiters of the key too; an arrival short of its
                self._server.waits.changed(self._job, self._key)  # count wakes no one)
        except BaseException:
            if not self.waiting:
                self._forget()
            raise
        finally:
            self._held = False
        if arrived >= members:
            self.release()
            return True
        return False

    def hold(self, waiter: Waiter) -> None:
        """Let ``waiter`` (whose arrival was short of its count) wait for the key to change."""
        if not self.waiting:
            self._server.waits.park(self._job, self._key, self)
        self.waiting[waiter] = None

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` stops waiting (it stays counted)."""
        self.waiting.pop(waiter, None)
        if not self.waiting:
            self._forget()

    def wake(self) -> None:
        """The key changed (``waits.KeyWaits`` took this off it)."""
        if self._held:
            self._server.waits.park(self._job, self._key, self)
        else:
            self.release()

    def release(self) -> None:
        """Let every waiter go on."""
        waiting, self.waiting = self.waiting, {}
        self._forget()
        call_soon = asyncio.get_running_loop().call_soon
        for waiter in waiting:
            call_soon(waiter.passed)

    def _forget(self) -> None:
        server = self._server
        server.waits.unpark(self._job, self._key, self)
        name = (self._job, self._key)
        if server.barriers.get(name) is self:
            del server.barriers[name]


def barrier(server: Server, job: str, key: str) -> Barrier:
    """The barrier on ``key`` of ``job`` (made on first use, dropped when none waits)."""
    name = (job, key)
    found = server.barriers.get(name)
    if found is None:
        found = server.barriers[name] = Barrier(server, job, key)
    return found


class BarrierCall(TimedWait):
    """An arendez client's ``barrier`` request not yet passed: answered when the barrier lets
    it go on, or with ``StoreTimeoutError`` at its deadline (it stays counted, as a torch
    client that gives up does); no task."""

    __slots__ = ("_barrier", "_compact", "_rid", "_started", "_what")

    def __init__(
        self, session: Session, rid: Any, compact: bool, found: Barrier, deadline: float, what: str
    ) -> None:
        super().__init__(session, deadline)
        self._rid, self._compact = rid, compact
        self._barrier, self._what = found, what
        self._started = time.perf_counter()
        found.hold(self)

    def passed(self) -> None:
        if self._settle():
            session = self._session
            if self._compact:
                session.reply_value(self._rid, None)
            else:
                session.reply(self._rid, None)
            session.server.config.hooks.request("barrier", time.perf_counter() - self._started, None)

    def expire(self) -> None:
        """The deadline passed first."""
        if self._settle():
            self._session.reply_error(self._rid, StoreTimeoutError(self._what))
            hooks = self._session.server.config.hooks
            hooks.request("barrier", time.perf_counter() - self._started, "StoreTimeoutError")

    def cancel(self) -> None:
        """The connection went: stop waiting, answer nobody."""
        self._settle()

    def _unhook(self) -> None:
        self._barrier.leave(self)
