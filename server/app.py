"""The asyncio server: connections, limits, auth, request dispatch, leases, graceful shutdown."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import ssl as _ssl
import time
from dataclasses import dataclass, field
from typing import Any

from arendez import transport, wire
from arendez.errors import (
    ArendezError,
    AuthenticationError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
)

from .hooks import ServerHooks
from .state import Departure, Job, Round, ServerState, StateLimits

log = logging.getLogger("arendez.server")

MAX_WAIT = 7 * 24 * 3600.0
#: Reply bytes a client may leave unread before the server drops it.
MAX_UNREAD_REPLIES = 16 << 20


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    ssl: _ssl.SSLContext | None = None
    lease: float = 2.5
    handshake_timeout: float = 5.0
    max_connections: int = 4096
    max_connections_per_host: int = 1024
    max_pending_per_connection: int = 1024
    limits: StateLimits = field(default_factory=StateLimits)
    hooks: ServerHooks = field(default_factory=ServerHooks)  # metrics, dashboard (server/http.py)


class _Session:
    """One client connection after its handshake."""

    def __init__(self, server: Server, conn: transport.Connection, job: str) -> None:
        self.server = server
        self.conn = conn
        self.job = job
        self.rank: int | None = None  # set once this connection is a member of a round
        self.round: Round | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def reply(self, rid: Any, value: Any) -> None:
        if rid is not None:
            self._send({"id": rid, "ok": value})

    def reply_error(self, rid: Any, exc: ArendezError) -> None:
        frame = transport.error_frame(exc)
        frame["id"] = rid
        self._send(frame)

    def _send(self, frame: dict[str, Any]) -> None:
        """Send a reply, unless the client has left too many unread: then it is dropped."""
        if not self.conn.is_open:
            return
        if self.conn.buffered() > MAX_UNREAD_REPLIES:
            self.conn.fail(ProtocolError("client does not read its replies"), tell_peer=False)
            return
        self.conn.send(frame)


class Server:
    """Rendezvous + key-value store for many jobs; the same code runs standalone and embedded."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.state = ServerState(self.config.limits)
        self._server: asyncio.Server | None = None
        self._sessions: dict[str, set[_Session]] = collections.defaultdict(set)
        self._conns: set[transport.Connection] = set()
        self._per_host: collections.Counter[str] = collections.Counter()
        self._changed: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lease_task: asyncio.Task[None] | None = None
        self._closing = False
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        limits = wire.Limits(max_header=64 * 1024, max_payload=0)
        self._server = await loop.create_server(
            lambda: self._accepted(transport.Connection(limits)),
            self.config.host,
            self.config.port,
            ssl=self.config.ssl,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._lease_task = loop.create_task(self._watch_leases())
        log.info("arendez-server listening on %s", self.url)

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"arendez://{host}:{self.port}"

    async def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, tell every client, close their connections within ``timeout``."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self._lease_task is not None:
            self._lease_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        conns = list(self._conns)
        for conn in conns:
            if conn.is_open:
                conn.send({"event": "server_shutdown"})
        if conns:
            await asyncio.gather(*(c.wait_closed(timeout) for c in conns), return_exceptions=True)
        if self._server is not None:
            try:
                async with asyncio.timeout(timeout):
                    await self._server.wait_closed()
            except TimeoutError:
                pass

    def members_active(self, job: str, nonce: bytes) -> bool:
        """True while a rank of round ``nonce`` of ``job`` has not left or failed."""
        found = self.state.jobs.get(job)
        round_ = found.rounds.get(nonce) if found is not None else None
        return round_ is not None and round_.in_use

    # -- connections -----------------------------------------------------------------------
    def _accepted(self, conn: transport.Connection) -> transport.Connection:
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    async def _serve(self, conn: transport.Connection) -> None:
        cfg = self.config
        try:
            await asyncio.wait_for(asyncio.shield(conn._made), cfg.handshake_timeout)
        except TimeoutError:
            conn.abort()
            return
        host = str(conn.peer[0]) if isinstance(conn.peer, tuple) else "local"
        self._conns.add(conn)
        self._per_host[host] += 1
        session: _Session | None = None
        try:
            if len(self._conns) > cfg.max_connections:
                cfg.hooks.refused("max_connections")
                raise ProtocolError(f"server already has {cfg.max_connections} connections")
            if self._per_host[host] > cfg.max_connections_per_host:
                cfg.hooks.refused("max_connections_per_host")
                raise ProtocolError(f"{host} already has {cfg.max_connections_per_host} connections")
            hello = await transport.server_handshake(conn, cfg.token, cfg.handshake_timeout)
            job = hello.get("job", "")
            if not isinstance(job, str) or len(job) > 256:
                raise ProtocolError("job name must be a string of at most 256 characters")
            limit = cfg.limits.max_value + cfg.limits.max_key + 4096
            conn.set_limits(wire.Limits(max_header=limit, max_payload=0))
            session = _Session(self, conn, job)
            self._sessions[job].add(session)
            conn.set_handlers(
                lambda header, payload: self._on_request(session, header),
                lambda exc: None,
            )
            await asyncio.shield(conn.closed)
        except (ProtocolError, AuthenticationError) as exc:
            log.info("closing %s: %s", conn.peer, exc)
            conn.fail(exc, tell_peer=True)
        except (TimeoutError, ConnectionError):
            conn.abort()
        except asyncio.CancelledError:
            conn.abort()
            raise
        finally:
            self._conns.discard(conn)
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]
            if session is not None:
                self._session_gone(session)

    def _session_gone(self, session: _Session) -> None:
        for task in session.tasks:
            task.cancel()
        peers = self._sessions.get(session.job)
        if peers is not None:
            peers.discard(session)
        job = self.state.jobs.get(session.job)
        if job is not None and session.round is not None and session.rank is not None:
            job.withdraw(session.round, session.rank)  # once complete, the lease decides
        if peers is not None and not peers:
            del self._sessions[session.job]
            self.state.drop_if_idle(session.job, 0)

    # -- requests --------------------------------------------------------------------------
    def _on_request(self, session: _Session, header: Any) -> None:
        try:
            if not isinstance(header, dict) or not isinstance(header.get("op"), str):
                raise ProtocolError("a request must be a map with a string 'op'")
            op = header["op"]
            handler = _HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(f"unknown request {op!r:.40}")
            rid = header.get("id")
            if op in _BLOCKING:
                if len(session.tasks) >= self.config.max_pending_per_connection:
                    self.config.hooks.refused("max_pending_per_connection")
                    raise ProtocolError("too many pending requests on one connection")
                task = asyncio.get_running_loop().create_task(self._blocking(session, rid, header))
                session.tasks.add(task)
                task.add_done_callback(session.tasks.discard)
                return
            started, error = time.perf_counter(), None
            try:
                job = self.state.job(session.job)
                session.reply(rid, handler(self, session, job, header))
                if op in _WRITES:
                    self._notify(session.job)
            except ArendezError as exc:
                error = type(exc).__name__
                session.reply_error(rid, exc)
            self.config.hooks.request(op, time.perf_counter() - started, error)
        except ProtocolError as exc:
            log.info("protocol error from %s: %s", session.conn.peer, exc)
            session.conn.fail(exc, tell_peer=True)

    async def _blocking(self, session: _Session, rid: Any, header: dict[str, Any]) -> None:
        started, error = time.perf_counter(), None
        try:
            job = self.state.job(session.job)
            value = await _BLOCKING[header["op"]](self, session, job, header)
            session.reply(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        self.config.hooks.request(header["op"], time.perf_counter() - started, error)

    def _notify(self, job: str) -> None:
        fut = self._changed.pop(job, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _until(self, session: _Session, predicate: Any, timeout: Any, what: str) -> None:
        """Wait until ``predicate()`` holds, re-checking whenever the job changes."""
        if timeout is None:
            timeout = MAX_WAIT
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
            raise StoreError(f"timeout must be a non-negative number, got {timeout!r:.40}")
        deadline = time.monotonic() + min(float(timeout), MAX_WAIT)
        loop = asyncio.get_running_loop()
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(f"{what} not satisfied within {timeout:g}s")
            fut = self._changed.get(session.job)
            if fut is None or fut.done():
                fut = self._changed[session.job] = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), remaining)

    def _depart(self, departures: list[Departure]) -> None:
        for gone in departures:
            self.config.hooks.departed(gone)
            (log.warning if gone.failed else log.info)("job %r rank %d %s", gone.job, gone.rank, gone.reason)
            event = {
                "event": "rank_failed" if gone.failed else "rank_left",
                "rank": gone.rank,
                "reason": gone.reason,
            }
            for session in self._sessions.get(gone.job, ()):
                same_round = session.round is not None and session.round.nonce == gone.nonce
                if same_round and session.rank != gone.rank and session.conn.is_open:
                    session.conn.send(event)
            self._notify(gone.job)

    async def _watch_leases(self) -> None:
        interval = max(0.05, self.config.lease / 10)
        while True:
            await asyncio.sleep(interval)
            self._depart(self.state.expire(time.monotonic(), self.config.lease))


# -- request handlers (plain functions of the server, session, job and request) ---------------
def _set(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> None:
    job.set(h.get("key"), h.get("value"))


def _add(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> int:
    return job.add(h.get("key"), h.get("amount", 1))


def _compare_set(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> bytes:
    return job.compare_set(h.get("key"), h.get("expected", b""), h.get("desired"))


def _delete(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> bool:
    return job.delete(h.get("key"))


def _num_keys(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> int:
    return len(job.kv)


def _check(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> bool:
    return job.has_all(_keys(h))


def _heartbeat(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> None:
    if s.round is not None and s.rank is not None:
        job.heartbeat(s.round, s.rank, time.monotonic())


def _attach(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> None:
    rank, world_size = h.get("rank"), h.get("world_size")
    nonce, address = h.get("nonce"), h.get("address", "")
    if not isinstance(rank, int) or not isinstance(world_size, int) or not isinstance(nonce, bytes):
        raise RendezvousError("attach needs an integer rank, world_size and a nonce")
    s.round = job.attach(rank, world_size, nonce, str(address), time.monotonic())
    s.rank = rank


def _leave(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> None:
    if s.round is None or s.rank is None:
        return
    gone = job.leave(s.round, s.rank)
    s.rank = s.round = None
    if gone is not None:
        server._depart([gone])


def _status(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> dict[str, Any]:
    round_ = s.round
    if round_ is None:
        return {"world_size": 0, "members": {}}
    return {
        "world_size": round_.world_size,
        "members": {m.rank: m.state.value for m in round_.members.values()},
    }


def _keys(h: dict[str, Any]) -> list[str]:
    keys = h.get("keys")
    if not isinstance(keys, list) or len(keys) > 10_000:
        raise StoreError("keys must be a list of at most 10000 strings")
    return keys


async def _get(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> bytes:
    key = h.get("key")
    await server._until(s, lambda: job.get(key) is not None, h.get("timeout"), f"get({key!r:.80})")
    value = job.get(key)
    assert value is not None
    return value


async def _wait(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> None:
    keys = _keys(h)
    await server._until(s, lambda: job.has_all(keys), h.get("timeout"), f"wait({keys!r:.80})")


async def _join(server: Server, s: _Session, job: Job, h: dict[str, Any]) -> dict[str, Any]:
    if s.round is not None:
        raise RendezvousError("this connection already joined the job")
    round_, rank = job.join(
        h.get("rank", -1), h.get("world_size", 0), str(h.get("address", "")), time.monotonic()
    )
    s.round, s.rank = round_, rank
    server._notify(s.job)
    try:
        await server._until(s, lambda: round_.complete, h.get("timeout"), "rendezvous")
    except StoreTimeoutError:
        job.withdraw(round_, rank)
        s.round = s.rank = None
        raise RendezvousError(
            f"job {s.job!r}: only {len(round_.members)} of {round_.world_size} ranks joined in time"
        ) from None
    except asyncio.CancelledError:
        job.withdraw(round_, rank)
        raise
    return {"rank": rank, "world_size": round_.world_size, "peers": round_.peers(), "nonce": round_.nonce}


_HANDLERS: dict[str, Any] = {
    "set": _set,
    "add": _add,
    "compare_set": _compare_set,
    "delete": _delete,
    "num_keys": _num_keys,
    "check": _check,
    "heartbeat": _heartbeat,
    "attach": _attach,
    "leave": _leave,
    "status": _status,
    "get": _get,
    "wait": _wait,
    "join": _join,
}
_BLOCKING: dict[str, Any] = {"get": _get, "wait": _wait, "join": _join}
_WRITES = {"set", "add", "compare_set", "delete", "attach"}

transport.register_remote_errors(StoreError, StoreTimeoutError, RendezvousError, ProtocolError)
transport.register_remote_errors(AuthenticationError)
