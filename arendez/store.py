"""Async client of the arendez store: its connection (the requests in flight on it:
``store_requests``; the key-value operations themselves: ``store_ops``; joining and leaving the
job's rounds: ``store_membership``).

The client keeps one connection to the server and reconnects when it drops. A call made
while the server is away waits for the reconnection until its own deadline and then raises
``StoreError``; a call whose request was in flight when the connection dropped fails at once
(its outcome is unknown). Concurrent calls are pipelined: the requests of the callers woken by
one batch of replies go out together in one write, in the same loop pass (no extra turn).
Members of a job keep their lease alive over the process's one lease connection, whose
heartbeats a sidecar process sends (``lease.py``, ``leaseproc.py``: a busy event loop is not a
dead rank), and re-attach after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as _ssl
from collections.abc import Callable
from typing import Any

from . import handshake, transport, validate, wire
from . import lease as _lease
from .errors import (
    AuthenticationError,
    LimitError,
    ProtocolError,
    RendezvousError,
    StoreConnectionError,
    StoreConnectTimeoutError,
    StoreError,
)
from .store_membership import EventHandler, Membership, MembershipOps
from .store_ops import KeyValueOps, PrefixStore
from .store_requests import Encoder, Requests
from .store_wire import STORE_ERRORS, STORE_PROTOCOL

log = logging.getLogger("arendez.store")

#: Connect + handshake budget of one attempt: generous, since a server busy with a storm of
#: thousands of connecting ranks answers late, and aborting then retrying only adds to it
#: (a refused or unreachable server fails at once regardless).
_OPEN_TIMEOUT = 20.0
#: Seconds of failed first connects before a client says so (a server starting alongside is
#: refused for a moment; one that is not there should not go unmentioned until the timeout).
_UNREACHABLE_WARN_AFTER = 2.0
#: Replies carry values in their header: allow well past the server's default 1 MiB value bound.
_REPLY_LIMITS = wire.Limits(max_header=64 << 20, max_payload=0)

transport.register_remote_errors(*STORE_ERRORS)


class Store(MembershipOps, KeyValueOps):
    """A connection to one job's namespace on an arendez server."""

    def __init__(
        self,
        host: str,
        port: int,
        job: str = "",
        *,
        token: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        timeout: float = 300.0,
        heartbeat_interval: float = 0.5,
        scoped: bool = False,
    ) -> None:
        port = validate.store_address(host, port, job)
        timeout = validate.seconds(timeout, "timeout")
        heartbeat_interval = validate.seconds(heartbeat_interval, "heartbeat_interval")
        self.host, self.port, self.job = host, port, job
        self.timeout = timeout
        #: The server drops the job's keys once none of its clients has been connected for
        #: ``arendez-server --scoped-grace`` (the lifetime of a TCPStore master's keys, give or
        #: take a network blip: torchrun's rendezvous uses it).
        self.scoped = scoped
        self.on_event: EventHandler | None = None
        #: Called when an established connection to the server is lost (before reconnecting).
        self.on_lost: Callable[[], None] | None = None
        #: Elastic: how many ranks wait to join, by the round (nonce) the server said it to;
        #: kept here as it arrives, so news that races a re-form is not lost.
        self.joining: dict[bytes, int] = {}
        self._token = token
        self._ssl = ssl
        self._heartbeat_interval = heartbeat_interval
        self._requests = Requests(self._write)
        self._conn: transport.Connection | None = None
        self._connected = asyncio.Event()
        self._fatal: BaseException | None = None
        self._membership: Membership | None = None
        self._address = ""
        self._closed = False
        self._left = False  # this client left its round: losing the server is no alarm then
        self._server_leaving = False  # the server announced its shutdown
        self._tasks: list[asyncio.Task[None]] = []
        self._lease: _lease.LeaseKeeper | None = None
        self._last_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connect_by: float | None = None  # loop time at which the first connect gives up
        #: Once connected, a call made while the connection is down waits for one attempt to
        #: reconnect (made at once) and fails with ``StoreConnectionError`` if it fails (torch's
        #: ``TCPStore`` semantics, for ``storemux``), instead of retrying until its deadline.
        self.fail_while_away = False
        self._was_connected = False
        self._kick = asyncio.Event()  # cuts the reconnect back-off short
        self._attempt: asyncio.Future[None] | None = None  # resolved when the next attempt ends

    # -- connection management -------------------------------------------------------------
    async def connect(self, timeout: float | None = None) -> Store:
        """Connect (retrying until ``timeout``) and start keeping the connection alive; if that
        fails, the store is closed. A store whose calls already connected it just waits for the
        connection. (The first call of a store never connected starts connecting, and a call
        that fails to reach the server leaves it retrying for the next one.)"""
        budget = validate.optional_seconds(timeout)
        budget = self.timeout if budget is None else budget
        first = self._loop is None
        loop = self._start(budget)
        try:
            await self._wait_connected(loop.time() + budget)
        except BaseException:
            if first:
                await self.close()
            raise
        return self

    def _start(self, budget: float) -> asyncio.AbstractEventLoop:
        """Start keeping the connection alive (once); ``budget``: how long the first connect
        may take before a warning says how long is left."""
        loop = self._loop
        if loop is None:
            loop = self._loop = self._requests.loop = asyncio.get_running_loop()
            self._connect_by = loop.time() + budget
            self._tasks.append(loop.create_task(self._maintain()))
        return loop

    async def __aenter__(self) -> Store:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _open(self) -> transport.Connection:
        # TCP, even to a server on this host: the blocking clients take its local socket
        # (``transports.local``), but a storm of thousands of event-loop clients joining at once
        # was measured slower over it (1,024 ranks: 0.94-1.11 s against 0.63-0.65 s over TCP; not
        # yet understood), and it is the joins that this client exists for.
        conn = await transport.open_connection(
            self.host, self.port, ssl=self._ssl, timeout=_OPEN_TIMEOUT, limits=_REPLY_LIMITS
        )
        try:
            hello = {"job": self.job, "scoped": True} if self.scoped else {"job": self.job}
            wait = _OPEN_TIMEOUT
            if self._connect_by is not None and not self._was_connected:  # (the first connect:
                now = asyncio.get_running_loop().time()  # its attempt ends by its deadline)
                wait = min(wait, max(0.5, self._connect_by - now - 0.1))
            try:
                welcome = await handshake.client_handshake(conn, self._token, hello, wait)
            except TimeoutError:  # (the connection was accepted: something listens there)
                tls = "" if self._ssl else ", or a server with TLS: Store's ssl=, init's ARENDEZ_TLS_CA"
                raise TimeoutError(
                    f"{self.host}:{self.port} accepted the connection but sent no arendez greeting "
                    f"within {wait:.3g}s (a very busy server, or not an arendez-server's store "
                    f"port: its --http-port, or etcd's?{tls})"
                ) from None
            if welcome.get("store") != STORE_PROTOCOL:
                raise ProtocolError(
                    f"the store at {self.host}:{self.port} speaks store protocol {welcome.get('store', 1)}, "
                    f"this client needs {STORE_PROTOCOL} (upgrade arendez-server)"
                )
            conn.set_handlers(self._on_frame, lambda exc: None)
            if self._membership is not None:
                m = self._membership
                fut = asyncio.get_running_loop().create_future()
                rid = self._requests.expect(fut)
                conn.send(
                    {
                        "op": "attach",
                        "id": rid,
                        "rank": m.rank,
                        "world_size": m.world_size,
                        "nonce": m.nonce,
                        "address": self._address,
                        "lease": self._lease.key if self._lease is not None else None,
                    }
                )
                async with asyncio.timeout(5.0):
                    await fut
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _maintain(self) -> None:
        delay = 0.05
        ever = False
        loop = asyncio.get_running_loop()
        warn_at: float | None = loop.time() + _UNREACHABLE_WARN_AFTER  # None: said (or connected)
        while not self._closed:
            self._server_leaving = False  # a notice on the next connection may come inside _open
            self._kick.clear()  # (calls that asked for an attempt get this one)
            try:
                conn = await self._open()
            except (AuthenticationError, RendezvousError) as exc:
                self._fatal = exc
                self._connected.set()
                self._attempt_ended()
                return
            except LimitError as exc:  # refused by a server limit: say which, at once
                if not ever:
                    self._fatal = exc
                    self._connected.set()
                    self._attempt_ended()
                    return
                log.warning("store %s:%s: %s", self.host, self.port, exc)
                self._last_error = exc
                self._attempt_ended()
                await self._back_off(delay)
                delay = min(delay * 2, 1.0)
                continue
            except Exception as exc:  # unreachable, or a broken peer: try again
                self._last_error = exc
                log.debug("store %s:%s unreachable: %s", self.host, self.port, exc)
                if not ever and warn_at is not None and loop.time() >= warn_at:
                    warn_at = None
                    left = max(0.0, (self._connect_by or loop.time()) - loop.time())
                    log.warning(
                        "cannot reach the store at %s:%s (%s); retrying until the timeout (%.1f s left)",
                        self.host,
                        self.port,
                        self._last_error_text,
                        left,
                    )
                self._attempt_ended()
                await self._back_off(delay)
                delay = min(delay * 2, 1.0)
                continue
            delay = 0.05
            ever = self._was_connected = True
            self._conn = conn
            self._connected.set()
            self._attempt_ended()
            await asyncio.shield(conn.closed)
            self._connected.clear()
            self._conn = None
            self._requests.fail_all(
                StoreConnectionError(f"lost the connection to the store at {self.host}:{self.port}")
            )
            if self.on_lost is not None and not self._closed:
                self.on_lost()
            if not self._closed:
                planned = self._left or self._server_leaving
                (log.info if planned else log.warning)(
                    "lost the store at %s:%s (%s); reconnecting",
                    self.host,
                    self.port,
                    "it shut down" if self._server_leaving else conn.error or "closed",
                )

    def _attempt_ended(self) -> None:
        """A (re)connect attempt ended: wake the calls waiting for its outcome."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None and not attempt.done():
            attempt.set_result(None)

    async def _back_off(self, delay: float) -> None:
        """Wait ``delay`` before the next attempt, or less if a call asks for one now."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._kick.wait()
        self._kick.clear()

    async def _one_attempt(self, deadline: float) -> transport.Connection:
        """``fail_while_away``: the connection this call may use once an attempt, made now,
        reconnects; ``StoreConnectionError`` if it fails."""
        attempt = self._attempt
        if attempt is None:
            attempt = self._attempt = asyncio.get_running_loop().create_future()
        self._kick.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(attempt)
        conn = self._open_connection()
        if conn is not None:
            return conn
        raise self._away()

    def _open_connection(self) -> transport.Connection | None:
        """The connection if it is up, else None; the fatal error, or closed, raised."""
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise StoreError("the store client is closed")
        conn = self._conn
        return conn if conn is not None and conn.is_open else None

    async def reconnected(self, timeout: float) -> None:
        """Wait until the connection is up, the background reconnects retrying meanwhile, even
        with ``fail_while_away`` (a new ``TCPStore`` client waits for its server, as torch's);
        ``StoreConnectTimeoutError`` after ``timeout``."""
        self._kick.set()  # (cut a back-off short: try now)
        await self._wait_connected(asyncio.get_running_loop().time() + timeout, patient=True)

    async def _wait_connected(self, deadline: float, patient: bool = False) -> transport.Connection:
        loop = asyncio.get_running_loop()
        while True:
            found = self._open_connection()
            if found is not None:
                return found
            conn = self._conn
            if conn is None and self.fail_while_away and self._was_connected and not patient:
                return await self._one_attempt(deadline)
            if loop.time() >= deadline:
                raise self._unreachable()
            try:
                async with asyncio.timeout_at(deadline):
                    if conn is not None:  # closing: wait for the reconnect loop to notice
                        await asyncio.shield(conn.closed)
                        await asyncio.sleep(0.01)
                    else:
                        await self._connected.wait()
            except TimeoutError:
                raise self._unreachable() from None

    def _away(self) -> StoreConnectionError:
        why = f": {self._last_error_text}" if self._last_error is not None else ""
        return StoreConnectionError(
            f"lost the connection to the store at {self.host}:{self.port}{why} (a later call "
            "reconnects if the store is back)"
        )

    def _unreachable(self) -> StoreError:
        why = f" (last error: {self._last_error_text})" if self._last_error is not None else ""
        return StoreConnectTimeoutError(
            f"store at {self.host}:{self.port} unreachable until the deadline{why}"
        )

    @property
    def _last_error_text(self) -> str:
        exc = self._last_error
        return f"{type(exc).__name__}: {exc}" if exc is not None else ""

    def _on_frame(self, header: Any, payload: memoryview | None) -> None:
        if type(header) is list:  # a compact reply [id, value]
            if len(header) == 2:
                self._requests.answer(header[0], header[1])
            return
        if not isinstance(header, dict):
            return
        rid = header.get("id")
        if rid is None:
            if header.get("event") == "departed":
                self._on_departed(header.get("ranks"))
            elif "event" in header:
                if header["event"] == "server_shutdown":
                    self._server_leaving = True
                elif header["event"] == "joining":
                    self._note_joining(header.get("round"), header.get("waiting"))
                if self.on_event is not None:
                    self.on_event(header)
            elif "error" in header:  # the server is about to drop us for a protocol error
                self._requests.fail_all(transport.remote_error(header, StoreError))
            return
        if "error" in header:
            self._requests.refuse(rid, header)
        else:
            self._requests.answer(rid, header.get("ok"))

    async def close(self) -> None:
        """Stop reconnecting and heartbeating; close the connection."""
        self._closed = True
        self._stop_lease()
        self._connected.set()
        self._attempt_ended()  # (a call waiting for a reconnect attempt: there will be none)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._conn is not None:
            await self._conn.wait_closed(1.0)  # asynchronous: the loop keeps running meanwhile
            self._conn = None
        self._requests.close(StoreError("the store client is closed"))

    def sockname(self) -> Any:
        """The local address of the store connection (what the server sees us as)."""
        conn = self._conn
        transport_ = getattr(conn, "_transport", None)
        return transport_.get_extra_info("sockname") if transport_ is not None else None

    # -- requests --------------------------------------------------------------------------
    async def _call(self, op: str, timeout: float | None = None, wait: bool = False, **fields: Any) -> Any:
        """A request in the map form ``{"op", "id", ...}``; ``wait``: the server may wait, and is
        told how long (``timeout``)."""

        def encode(rid: int, left: float | None) -> list[bytes | memoryview]:
            fields["op"] = op
            fields["id"] = rid
            if left is not None:
                fields["timeout"] = left
            return wire.encode(fields)

        return await self._request(op, timeout, wait, encode)

    async def _ask(self, op: str, timeout: float | None, wait: bool, *args: Any) -> Any:
        """A key-value operation in the compact form ``[op, id, *args]`` (``store_wire``);
        ``wait``: the server may wait, and is told how long (appended to ``args``)."""
        return await self._request(op, timeout, wait, self._requests.compact(op, args))

    async def _request(self, op: str, timeout: float | None, wait: bool, encode: Encoder) -> Any:
        """Send ``encode(id, seconds the server may wait or None)`` and await its answer, within
        the call's budget (waiting for the connection first if it is down)."""
        budget = self.timeout if timeout is None else float(timeout)
        if self._loop is None and not self._closed:  # never connected: the first call connects
            self._start(budget)
        loop = self._loop or asyncio.get_running_loop()
        deadline = Requests.deadline(loop, budget, wait)
        conn = self._conn
        if conn is None or not conn.is_open:
            await self._wait_connected(deadline)
        return await self._requests.call(op, budget, deadline, wait, encode)

    def ask_soon(
        self,
        op: str,
        timeout: float | None,
        wait: bool,
        args: tuple[Any, ...],
        done: Callable[[Any, BaseException | None], object],
        sent: Callable[[], object] | None = None,
    ) -> None:
        """On the loop thread: send the key-value operation ``op`` now and call ``done(value,
        None)`` or ``done(None, error)`` with its outcome, with no task or future per call (the
        blocking callers of ``storemux`` wait on it from their own threads). While the
        connection is down it waits for it, as ``_ask`` does. ``sent``: called once the request
        is written to the connection (not at all if it ends first: ``done`` says how)."""
        loop = self._loop or asyncio.get_running_loop()
        conn = self._conn
        if conn is None or not conn.is_open:
            task = loop.create_task(self._ask(op, timeout, wait, *args))
            task.add_done_callback(lambda t: done(*_outcome(t)))
            return
        budget = self.timeout if timeout is None else float(timeout)
        if self._requests.call_soon(op, budget, wait, args, done) and sent is not None:
            self._requests.when_sent(sent)

    def when_sent(self, callback: Callable[[], object]) -> None:
        """On the loop thread: call ``callback`` once the requests made so far are written to
        the connection (at once, unless a batch is being gathered)."""
        self._requests.when_sent(callback)

    def _write(self, frames: list[bytes | memoryview]) -> None:
        conn = self._conn
        if conn is None:
            raise ConnectionResetError("not connected")
        conn.send_encoded(frames)


def _outcome(task: asyncio.Task[Any]) -> tuple[Any, BaseException | None]:
    if task.cancelled():
        return None, StoreError("the store client is closed")
    exc = task.exception()
    return (None, exc) if exc is not None else (task.result(), None)


__all__ = ["Membership", "PrefixStore", "Store"]
