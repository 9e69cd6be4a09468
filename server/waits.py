"""Store waits: requests waiting for keys to be set, each woken only by a change of its own keys.

A ``get``/``wait``/``multi_get`` whose keys are missing is a ``KeyWait``: parked on one missing
key at a time, answered by the change that completes it, with one timer for its deadline and no
task (thousands of ranks waiting on one key, torch's barrier idiom, cost one small object each).
Other waits (``queue_pop``) await a future in a task (``KeyWaits.until``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from arendez.errors import ArendezError, StoreTimeoutError

from .state import Job

if TYPE_CHECKING:
    from .connection import Session
    from .hooks import ServerHooks


class Waker(Protocol):
    """What may park on a key besides a future: woken (``wake``) when the key changes."""

    def wake(self) -> None: ...


def timer_at(deadline: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
    """Call ``callback`` on this loop at ``deadline`` (``time.monotonic``, as requests' deadlines)."""
    loop = asyncio.get_running_loop()
    return loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), callback)


class TimedWait:
    """A request of ``_session`` that waits until an event or its deadline, and is answered
    (or dropped) once: ``_settle`` ends the wait, and ``_unhook`` takes it off what it
    waited on."""

    __slots__ = ("_session", "_timer")

    def __init__(self, session: Session, deadline: float) -> None:
        self._session = session
        self._timer: asyncio.TimerHandle | None = timer_at(deadline, self.expire)
        session.tasks.add(self)  # (cancelled with its connection; ``_settle`` takes it off)

    def expire(self) -> None:
        raise NotImplementedError

    def cancel(self) -> object:
        """The connection went: stop waiting (``Pending``)."""
        raise NotImplementedError

    def _unhook(self) -> None:
        raise NotImplementedError

    def _settle(self) -> bool:
        """Stop waiting; False if it was answered (or dropped) already."""
        if self._timer is None:
            return False
        self._timer.cancel()
        self._timer = None
        self._session.tasks.discard(self)
        self._unhook()
        return True


class KeyWait:
    """One request waiting for keys: parked on its first missing key until that key changes."""

    __slots__ = (
        "_compact",
        "_hooks",
        "_job",
        "_keys",
        "_next",
        "_op",
        "_ready",
        "_result",
        "_rid",
        "_session",
        "_started",
        "_timer",
        "_waits",
        "_what",
        "parked",
    )

    def __init__(
        self,
        waits: KeyWaits,
        session: Session,
        job: Job,
        request: tuple[str, Any, bool],
        keys: list[str],
        ready: Callable[[str], bool],
        result: Callable[[], Any],
        deadline: float,
        what: str,
        hooks: ServerHooks,
    ) -> None:
        self._waits, self._session, self._job = waits, session, job
        self._op, self._rid, self._compact = request
        self._keys, self._ready, self._result, self._what = keys, ready, result, what
        self._hooks = hooks
        self._started = time.perf_counter()
        self.parked: str | None = None  # the key this waits on now
        self._next = 0  # the keys before this one were there when last looked at
        self._timer: asyncio.TimerHandle | None = timer_at(deadline, self.expire)
        session.tasks.add(self)

    def wake(self) -> None:
        """Answer if every key is there now; else park on the first missing one. The keys are
        looked at from where the last look stopped (a request on N keys set one by one costs
        O(N), not O(N**2)); a multi_get whose earlier key was deleted meanwhile looks again."""
        if self._timer is None:
            return
        self.parked = None
        keys, ready = self._keys, self._ready
        for i in range(self._next, len(keys)):
            if not ready(keys[i]):
                self._next, self.parked = i, keys[i]
                self._waits.park(self._session.job, keys[i], self)
                return
        try:
            value = self._result()
        except ArendezError as exc:  # (a multi_get whose answer would be past its limit)
            self._fail(exc)
            return
        if value is None and self._op == "multi_get":  # (deleted after it was seen: look again)
            self._next = 0
            self.wake()
            return
        self._settle()
        if self._compact:
            self._session.reply_value(self._rid, value)
        else:
            self._session.reply(self._rid, value)
        self._hooks.request(self._op, time.perf_counter() - self._started, None)

    def expire(self) -> None:
        """The deadline passed with a key still missing."""
        if self._timer is not None:
            self._fail(StoreTimeoutError(self._what))

    def _fail(self, exc: ArendezError) -> None:
        self._settle()
        self._session.reply_error(self._rid, exc)
        self._hooks.request(self._op, time.perf_counter() - self._started, type(exc).__name__)

    def cancel(self) -> None:
        """The connection went: stop waiting, answer nobody."""
        if self._timer is not None:
            self._settle()

    def _settle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._session.tasks.discard(self)
        if self.parked is not None:
            self._waits.unpark(self._session.job, self.parked, self)
            self.parked = None


class KeyWaits:
    """What waits on each ``(job, key)`` (``KeyWait`` s, other ``Waker`` s and futures, in
    arrival order); empty
    (and so skipped by setters) while none waits."""

    def __init__(self) -> None:
        self.waiters: dict[tuple[str, str], dict[Waker | asyncio.Future[None], None]] = {}

    def changed(self, job: str, key: str) -> None:
        """Wake the waiters of ``key`` in ``job`` (at once when nothing waits at all)."""
        if not self.waiters:
            return
        waiters = self.waiters.pop((job, key), None)
        for waiter in waiters or ():  # (taken off the key already: ``wake`` re-parks if need be)
            if not isinstance(waiter, asyncio.Future):
                waiter.wake()
            elif not waiter.done():
                waiter.set_result(None)

    def park(self, job: str, key: str, waiter: Waker | asyncio.Future[None]) -> None:
        self.waiters.setdefault((job, key), {})[waiter] = None

    def unpark(self, job: str, key: str, waiter: Waker | asyncio.Future[None]) -> None:
        waiters = self.waiters.get((job, key))
        if waiters is not None:
            waiters.pop(waiter, None)
            if not waiters:
                del self.waiters[(job, key)]

    async def until(self, name: str, key: str, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Wait until ``ready()`` holds, re-checked whenever ``key`` of job ``name`` changes;
        ``StoreTimeoutError`` naming ``what`` after ``deadline``."""
        loop = asyncio.get_running_loop()
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(what)
            fut = loop.create_future()
            self.park(name, key, fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass
            finally:
                if not fut.done():
                    self.unpark(name, key, fut)
