"""The store client's requests in flight: ids, answers, deadlines and batched writes.

``Requests`` knows nothing of connecting: ``Store`` hands it the write function of its current
connection and feeds it the replies. What it does:

- each request gets an id, and its reply (or error) goes to the caller's ``Answer``: an asyncio
  future, or a callback for the blocking callers of ``storemux`` (no task or future per call);
- one timer for all calls fires at the earliest deadline (no timer per call);
- the requests made by the callers that one batch of replies woke go out together in one write,
  in the same loop pass (the *cork*): pipelined callers cost one system call per batch.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from . import transport
from .errors import StoreConnectionError, StoreError, StoreTimeoutError
from .store_wire import MAX_REQUEST, check_request_size, frame
from .wire import small_packer

#: Extra time a waiting request's answer may take past the wait the server was told.
REPLY_SLACK = 2.0
#: Longest a request that does not wait on the server may take.
CALL_TIMEOUT = 30.0

Encoder = Callable[[int, float | None], list[bytes | memoryview]]
Writer = Callable[[list[bytes | memoryview]], None]


#: A request sent within this many seconds of its call counts as sent at once (``submit``).
AT_ONCE = 0.05


class NoAnswer(Exception):
    """A request's deadline passed without its answer."""


class Answer(Protocol):
    """Where a request's outcome goes (``asyncio.Future`` has this shape)."""

    def done(self) -> bool: ...
    def set_result(self, value: Any) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...


class _Callback:
    """An ``Answer`` that calls ``done(value, error)`` and forgets its request."""

    __slots__ = ("_budget", "_done", "_ended", "_op", "_requests", "rid")

    def __init__(
        self, requests: Requests, op: str, budget: float, done: Callable[[Any, BaseException | None], object]
    ) -> None:
        self._requests, self._op, self._budget, self._done = requests, op, budget, done
        self._ended = False
        self.rid = 0

    def done(self) -> bool:
        return self._ended

    def _end(self) -> None:
        self._ended = True
        self._requests.forget(self.rid)

    def set_result(self, value: Any) -> None:
        self._end()
        self._done(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._end()
        if isinstance(exc, NoAnswer):
            exc = StoreTimeoutError(f"store {self._op} got no answer within {self._budget:g}s")
        self._done(None, exc)


class Requests:
    """The requests of one store client in flight, over whichever connection is current."""

    def __init__(self, write: Writer) -> None:
        #: Writes frames to the current connection; raises ``ConnectionError`` if there is none.
        self._write_frames = write
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Answer] = {}
        self._expiry: dict[int, float] = {}  # loop time at which each pending call gives up
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at: float | None = None
        self._out: list[bytes | memoryview] = []  # requests held while corked
        self._corked = False
        self._woken = 0  # replies delivered since the cork was (re)scheduled
        self._held = False  # the cork already waited once for callers woken after it
        self._when_sent: list[Callable[[], object]] = []  # run once the held requests are written
        self._packer = small_packer()

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.loop or asyncio.get_running_loop()

    # -- encoding --------------------------------------------------------------------------
    def compact(self, op: str, args: tuple[Any, ...]) -> Encoder:
        """The encoder of a key-value operation in the compact form ``[op, id, *args]``
        (``store_wire``), the seconds the server may wait appended when it may."""

        def encode(rid: int, left: float | None) -> list[bytes | memoryview]:
            tail = () if left is None else (left,)
            data = frame(self._packer.pack([op, rid, *args, *tail]))
            if len(data) > MAX_REQUEST:
                check_request_size(op, len(data))
            return [data]

        return encode

    # -- requests --------------------------------------------------------------------------
    @staticmethod
    def deadline(loop: asyncio.AbstractEventLoop, budget: float, wait: bool) -> float:
        """When a call with ``budget`` seconds gives up (one that does not wait on the server:
        ``CALL_TIMEOUT`` at most)."""
        return loop.time() + (budget if wait else min(budget, CALL_TIMEOUT))

    async def call(self, op: str, budget: float, deadline: float, wait: bool, encode: Encoder) -> Any:
        """Send ``encode(id, seconds the server may wait or None)`` and await its answer."""
        loop = self._loop()
        fut: asyncio.Future[Any] = loop.create_future()
        rid = self.submit(deadline, wait, encode, fut, budget)
        try:
            return await fut
        except NoAnswer:
            raise StoreTimeoutError(f"store {op} got no answer within {budget:g}s") from None
        finally:
            self.forget(rid)

    def call_soon(
        self,
        op: str,
        budget: float,
        wait: bool,
        args: tuple[Any, ...],
        done: Callable[[Any, BaseException | None], object],
    ) -> bool:
        """On the loop thread: send ``op`` now; ``done(value, None)`` or ``done(None, error)``
        gets its outcome. False if it could not be sent (``done`` has the error)."""
        answer = _Callback(self, op, budget, done)
        try:
            answer.rid = self.submit(
                self.deadline(self._loop(), budget, wait), wait, self.compact(op, args), answer, budget
            )
        except Exception as exc:  # (e.g. a request past the size limit)
            done(None, exc)
            return False
        return True

    def submit(self, deadline: float, wait: bool, encode: Encoder, answer: Answer, budget: float) -> int:
        """Send a request; its reply (or error) goes to ``answer``. Returns its id. A request that
        may wait tells the server what is left of its ``budget``: all of it if it goes out at once
        (within ``AT_ONCE`` s), so that the server's timeout names the caller's own (QA26: "not
        satisfied within 0.299s" for a 0.3 s timeout)."""
        loop = self._loop()
        rid = next(self._ids)
        self._pending[rid] = answer
        left = None
        if wait:
            left = max(0.0, deadline - loop.time())
            if budget - left < AT_ONCE:
                left = budget
        expiry = self._expiry[rid] = deadline + (REPLY_SLACK if wait else 0.0)
        if self._sweep_at is None or expiry < self._sweep_at:
            self._arm_sweep(loop, expiry)
        try:
            self._send(encode(rid, left))
        except BaseException:
            self.forget(rid)
            raise
        return rid

    def expect(self, answer: Answer) -> int:
        """An id for a request sent by the caller itself (on a connection not yet current):
        its reply goes to ``answer``, with no deadline of ours."""
        rid = next(self._ids)
        self._pending[rid] = answer
        return rid

    def forget(self, rid: int) -> None:
        """Drop a request that ended (or whose caller gave up): a late reply is ignored."""
        self._pending.pop(rid, None)
        self._expiry.pop(rid, None)

    # -- replies ---------------------------------------------------------------------------
    def answer(self, rid: Any, value: Any) -> None:
        """The reply ``value`` of request ``rid`` (unknown or ended: ignored)."""
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            return
        fut.set_result(value)
        self._woke()

    def refuse(self, rid: Any, header: dict[str, Any]) -> None:
        """The server's error reply ``header`` to request ``rid``."""
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            return
        fut.set_exception(transport.remote_error(header, StoreError))
        self._woke()

    def fail_all(self, exc: BaseException) -> None:
        """Fail every request in flight with ``exc`` (the connection they went on is gone)."""
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def close(self, exc: BaseException) -> None:
        """Stop the deadline timer and fail every request in flight."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = self._sweep_at = None
        self.fail_all(exc)

    # -- deadlines -------------------------------------------------------------------------
    def _arm_sweep(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        """One timer for all calls: it fires at the earliest deadline (no timer per call)."""
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = at
        self._sweep = loop.call_at(at, self._expire_calls, loop)

    def _expire_calls(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = self._sweep_at = None
        now = loop.time()
        soonest: float | None = None
        for rid, at in list(self._expiry.items()):
            if at <= now:
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(NoAnswer())
            elif soonest is None or at < soonest:
                soonest = at
        if soonest is not None:
            self._arm_sweep(loop, soonest)

    # -- batched writes --------------------------------------------------------------------
    def _send(self, frames: list[bytes | memoryview]) -> None:
        """Send a request at once, or, while the callers woken by one batch of replies are
        still running, with the other requests they make, in one write."""
        if self._corked:
            self._out.extend(frames)
            return
        self._write(frames)

    def _write(self, frames: list[bytes | memoryview]) -> None:
        try:
            self._write_frames(frames)
        except ConnectionError as exc:  # the requests cannot have reached the server
            self.fail_all(StoreConnectionError(f"store request failed: {exc}"))

    def when_sent(self, callback: Callable[[], object]) -> None:
        """On the loop thread: call ``callback`` once the requests made so far are written to
        the connection (at once, unless a batch is being gathered)."""
        if self._corked:
            self._when_sent.append(callback)
        else:
            callback()

    def _woke(self) -> None:
        """A reply woke a caller: gather the requests of the callers woken now until they ran
        (scheduled from the reply handler, so it runs in the same pass as they do)."""
        if self._corked:
            self._woken += 1
            return
        self._corked = True
        self._woken = 0
        self._held = False
        self._loop().call_soon(self._uncork)

    def _uncork(self) -> None:
        if self._woken and not self._held:  # more callers were woken after us: wait for them once
            self._held = True
            self._woken = 0
            self._loop().call_soon(self._uncork)
            return
        out, self._out = self._out, []
        if out:
            self._write(out)
        sent, self._when_sent = self._when_sent, []
        for callback in sent:  # (the requests they wait for were in ``out``)
            callback()
        if self._woken:  # still more woken: keep gathering, but never hold written requests back
            self._woken = 0
            self._loop().call_soon(self._uncork)
        else:
            self._corked = False
