"""The asyncio server: connections, limits, auth, request dispatch, leases, graceful shutdown.

Everything a rank costs the server is O(1): one connection (its process's lease connection is
shared by all ranks of the process), a join that wakes only its own round's waiters, store
waits that wake only on their own keys, replies to the requests of one read written at once,
and failure news sent as one batched event per round per flush, encoded once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import resource
import ssl as _ssl
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from arendez import transport, wire
from arendez.errors import (
    ArendezError,
    AuthenticationError,
    LimitError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
)
from arendez.store_wire import STORE_PROTOCOL, HeaderReader, arity_error, frame

from .handlers import BLOCK, BLOCKING, COMPACT, HANDLERS, as_map, packed_reply
from .hooks import ServerHooks
from .state import Departure, Job, Lease, Round, ServerState, StateLimits

log = logging.getLogger("arendez.server")

#: Reply bytes a client may leave unread before the server drops it.
MAX_UNREAD_REPLIES = 16 << 20
#: Reply bytes gathered from one read that are written at once (and the reader checked).
FLUSH_AT = 64 << 10
#: Seconds a dropped client's connection stays open to read (and ignore) what it sent.
DROP_DELAY = 0.2
#: File descriptors kept free of connections (listener, logs, the interpreter's own).
FD_RESERVE = 64
#: The largest frame a client may send before its handshake (a hello is under 300 bytes).
HELLO_MAX = 1024
#: Frames a client may queue before its hello is checked.
HELLO_FRAMES = 2
#: Departures gathered before failure news goes out (one event per round per flush).
DEPARTURE_BATCH = 0.01


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    ssl: _ssl.SSLContext | None = None
    lease: float = 2.5
    #: Extra seconds a member's lease gets before its process's keeper first renews it.
    lease_arm_grace: float = 30.0
    handshake_timeout: float = 20.0
    #: Listen queue for connection storms (the kernel caps it at net.core.somaxconn).
    backlog: int = 4096
    max_connections: int = 32768
    max_connections_per_host: int = 32768
    max_pending_per_connection: int = 4096
    #: Raise this process's open-file limit to its hard limit (the standalone server does).
    raise_fd_limit: bool = False
    limits: StateLimits = field(default_factory=StateLimits)
    hooks: ServerHooks = field(default_factory=ServerHooks)  # metrics, dashboard (server/http.py)


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one where allowed; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # pragma: no cover - a sandbox that forbids it
            log.warning("could not raise the open-file limit to %d: %s", want, exc)
    return soft


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


class _Session:
    """One client connection after its handshake; the replies to one read go out in one write."""

    def __init__(self, server: Server, conn: _ServerConnection, job: str) -> None:
        self.server = server
        self.conn = conn
        self.job = job
        self.rank: int | None = None  # set once this connection is a member of a round
        self.round: Round | None = None
        self.lease: Lease | None = None  # set on the lease connection of a client process
        self.tasks: set[asyncio.Task[None]] = set()
        self.packer = server.packer
        self._out: list[bytes | memoryview] = []
        self._out_bytes = 0
        self.dropped = False  # no more answers: the connection closes shortly

    def reply(self, rid: Any, value: Any) -> None:
        if rid is not None:
            self.send({"id": rid, "ok": value})

    def reply_value(self, rid: Any, value: Any) -> None:
        """The compact reply ``[rid, value]`` (to a compact request)."""
        data = frame(self.packer.pack([rid, value]))
        if self.conn.corked:
            self._out.append(data)
            self._out_bytes += len(data)
            if self._out_bytes >= FLUSH_AT:  # large replies go out at once, checked as they go
                self.flush()
        else:
            self.send_encoded([data])

    def reply_error(self, rid: Any, exc: ArendezError) -> None:
        frame = transport.error_frame(exc)
        frame["id"] = rid
        self.send(frame)

    def send(self, frame: dict[str, Any]) -> None:
        self.send_encoded(wire.encode(frame))

    def send_encoded(self, buffers: list[bytes | memoryview]) -> None:
        """Send encoded frames: at once, or, while the connection is handing us a batch of
        requests, together with the other replies of that batch in one write."""
        conn = self.conn
        if self.dropped or not conn.is_open:
            return
        if conn.corked:
            self._out.extend(buffers)
            self._out_bytes += sum(len(b) for b in buffers)
            if self._out_bytes >= FLUSH_AT:  # large replies go out at once, checked as they go
                self.flush()
            return
        conn.send_encoded(buffers)
        if conn.buffered() > MAX_UNREAD_REPLIES and not self.dropped:  # the client does not read
            self.drop(ProtocolError("client does not read its replies"))

    def drop(self, exc: ArendezError) -> None:
        """Stop answering; close soon, once what the client already sent has been read
        (closing on unread bytes would reset the connection and lose the replies it has)."""
        self.dropped = True
        asyncio.get_running_loop().call_later(DROP_DELAY, self.conn.fail, exc)

    def flush(self) -> None:
        """Write the replies gathered while corked (one write for a batch of requests)."""
        out, self._out, self._out_bytes = self._out, [], 0
        if out and not self.dropped and self.conn.is_open:
            self.conn.send_encoded(out)
            if self.conn.buffered() > MAX_UNREAD_REPLIES:
                self.drop(ProtocolError("client does not read its replies"))


class _ServerConnection(transport.Connection):
    """A client connection of the server: tells the server when it is made."""

    def __init__(self, server: Server, limits: wire.Limits) -> None:
        super().__init__(limits, max_queued=HELLO_FRAMES)
        self.server = server
        self.host = ""
        self.nonce = b""
        self.deadline = 0.0
        self.session: _Session | None = None
        #: Reads the requests once the handshake is done (``wire.Decoder`` reads the hello).
        self.reader: HeaderReader | None = None
        #: True while the frames of one read are being answered: replies wait for one write.
        self.corked = False

    def connection_made(self, transport_: asyncio.BaseTransport) -> None:
        super().connection_made(transport_)
        self.server._made(self)

    def start_session(self, session: _Session, max_header: int) -> None:
        """Read requests of up to ``max_header`` bytes from now on (what came after the hello too)."""
        self.session = session
        self.reader = HeaderReader(max_header, self._decoder.take_rest())

    def get_buffer(self, sizehint: int) -> memoryview:
        reader = self.reader
        return reader.get_buffer() if reader is not None else super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        session, reader = self.session, self.reader
        if session is None or reader is None:
            super().buffer_updated(nbytes)  # the handshake (its handlers take over from it)
            return
        try:
            requests = reader.feed(nbytes)
        except ProtocolError as exc:
            log.info("protocol error from %s: %s", self.peer, exc)
            self.fail(exc, tell_peer=True)
            return
        if not requests:
            return
        server = self.server
        compact = server._compact
        self.corked = True
        try:
            for request in requests:
                if session.dropped:
                    break
                if type(request) is list:
                    compact(session, request)
                else:
                    server._on_request(session, request)
        except Exception as exc:  # a request the server could not digest
            self.fail(ProtocolError(f"bad frame: {type(exc).__name__}: {exc}"), tell_peer=True)
        finally:
            self.corked = False
            session.flush()


class Server:
    """Rendezvous + key-value store for many jobs; the same code runs standalone and embedded."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.state = ServerState(self.config.limits)
        self._server: asyncio.Server | None = None
        self._sessions: dict[str, set[_Session]] = collections.defaultdict(set)
        self._members: dict[tuple[str, bytes], set[_Session]] = {}  # sessions of a round
        self._conns: set[_ServerConnection] = set()
        self._handshaking: set[_ServerConnection] = set()
        self._per_host: collections.Counter[str] = collections.Counter()
        self._key_waiters: dict[tuple[str, str], list[asyncio.Future[None]]] = {}
        self._round_done: dict[Round, asyncio.Future[None]] = {}
        self._peers_packed: dict[Round, bytes] = {}
        self._departed: list[Departure] = []
        self._departure_flush: asyncio.TimerHandle | None = None
        self._settle: dict[Round, asyncio.TimerHandle] = {}  # elastic rounds at their minimum
        self._joining_news: dict[str, asyncio.TimerHandle] = {}  # by job: "ranks wait to join"
        self._lease_task: asyncio.Task[None] | None = None
        self._closing = False
        self.packer = msgpack.Packer(use_bin_type=True)
        #: Time every request for the hooks (not when they are the do-nothing ones).
        self._timed = type(self.config.hooks).request is not ServerHooks.request
        self.max_connections = self.config.max_connections
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        fds = raise_fd_limit() if cfg.raise_fd_limit else fd_limit()
        if cfg.max_connections > fds - FD_RESERVE:
            self.max_connections = max(1, fds - FD_RESERVE)
            # only news when the operator asked for more (the standalone server); an embedded
            # server just fits the process it lives in
            (log.warning if cfg.raise_fd_limit else log.debug)(
                "open-file limit %d admits %d connections, not --max-connections %d",
                fds,
                self.max_connections,
                cfg.max_connections,
            )
        limits = wire.Limits(max_header=HELLO_MAX, max_payload=0)  # raised once authenticated
        self._server = await loop.create_server(
            lambda: _ServerConnection(self, limits),
            cfg.host,
            cfg.port,
            ssl=cfg.ssl,
            reuse_address=True,
            backlog=cfg.backlog,
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
        if self._departure_flush is not None:
            self._departure_flush.cancel()
        conns = list(self._conns)
        bye = wire.encode({"event": "server_shutdown"})
        for conn in conns:  # mid-handshake, the notice would pass for a welcome: those just close
            if conn.is_open and conn.session is not None:
                conn.send_encoded(bye)
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
    # No task per connection: the handshake runs in callbacks, and one sweep (with the lease
    # check) drops connections that do not finish it within ``handshake_timeout``.
    def _refusal(self, host: str) -> LimitError | None:
        cfg = self.config
        if len(self._conns) > self.max_connections:
            cfg.hooks.refused("max_connections")
            return LimitError(
                f"server refused the connection: it already has {self.max_connections} connections "
                "(limit: arendez-server --max-connections, and the open-file limit)"
            )
        if self._per_host[host] > cfg.max_connections_per_host:
            cfg.hooks.refused("max_connections_per_host")
            return LimitError(
                f"server refused the connection: {host} already has "
                f"{cfg.max_connections_per_host} connections (limit: arendez-server "
                "--max-connections-per-host)"
            )
        return None

    def _made(self, conn: _ServerConnection) -> None:
        """A client connected: count it, refuse it by a limit's name, or challenge it."""
        conn.host = host = str(conn.peer[0]) if isinstance(conn.peer, tuple) else "local"
        self._conns.add(conn)
        self._per_host[host] += 1
        conn.set_handlers(lambda header, payload: self._on_hello(conn, header), lambda exc: self._lost(conn))
        if self._closing:
            conn.abort()
            return
        refused = self._refusal(host)
        if refused is not None:
            log.warning("%s", refused)
            conn.fail(refused, tell_peer=True)  # sent in place of the challenge
            return
        challenge, conn.nonce = transport.make_challenge(self.config.token)
        conn.deadline = time.monotonic() + self.config.handshake_timeout
        self._handshaking.add(conn)
        conn.send(challenge)

    def _on_hello(self, conn: _ServerConnection, hello: Any) -> None:
        cfg = self.config
        if conn.session is not None:  # frames of a connection already failing
            return
        self._handshaking.discard(conn)
        try:
            welcome = transport.answer_hello(hello, cfg.token, conn.nonce, {"store": STORE_PROTOCOL})
            job = hello.get("job", "")
            if not isinstance(job, str) or len(job) > 256:
                raise ProtocolError("job name must be a string of at most 256 characters")
        except (ProtocolError, AuthenticationError) as exc:
            log.info("closing %s: %s", conn.peer, exc)
            conn.fail(exc, tell_peer=True)
            return
        conn.send(welcome)
        limit = cfg.limits.max_value + cfg.limits.max_key + 4096
        conn.set_limits(wire.Limits(max_header=limit, max_payload=0))
        session = _Session(self, conn, job)
        conn.start_session(session, limit)
        self._sessions[job].add(session)
        conn.set_handlers(lambda header, payload: self._handle(session, header), lambda exc: self._lost(conn))

    def _lost(self, conn: _ServerConnection) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        self._handshaking.discard(conn)
        host = conn.host
        self._per_host[host] -= 1
        if self._per_host[host] <= 0:
            del self._per_host[host]
        session, conn.session = conn.session, None  # the session keeps its connection, not both ways
        if session is not None:
            self._session_gone(session)

    def _sweep_handshakes(self, now: float) -> None:
        late = [c for c in self._handshaking if c.deadline < now]
        for conn in late:
            self._handshaking.discard(conn)
            conn.abort()

    def _session_gone(self, session: _Session) -> None:
        for task in session.tasks:
            task.cancel()
        self._unbind(session)
        peers = self._sessions.get(session.job)
        if peers is not None:
            peers.discard(session)
        job = self.state.jobs.get(session.job)
        if job is not None and session.round is not None and session.rank is not None:
            job.withdraw(session.round, session.rank)  # once complete, the lease decides
        if peers is not None and not peers:
            del self._sessions[session.job]
            self.state.drop_if_idle(session.job, 0)

    def _bind(self, session: _Session, round_: Round, rank: int) -> None:
        session.round, session.rank = round_, rank
        if round_.nonce:
            self._members.setdefault((session.job, round_.nonce), set()).add(session)

    def _unbind(self, session: _Session) -> None:
        round_ = session.round
        if round_ is not None and round_.nonce:
            key = (session.job, round_.nonce)
            members = self._members.get(key)
            if members is not None:
                members.discard(session)
                if not members:
                    del self._members[key]

    # -- requests --------------------------------------------------------------------------
    def _handle(self, session: _Session, request: Any) -> None:
        """Answer one request (compact or map form), at once where it can be."""
        if session.dropped:
            return
        if type(request) is list:
            self._compact(session, request)
        else:
            self._on_request(session, request)

    def _compact(self, session: _Session, request: list[Any]) -> None:
        """``[op, id, *args]``: a key-value operation (``arendez.store_wire``)."""
        op: Any = request[0] if request else None
        entry = COMPACT.get(op) if type(op) is str else None
        if entry is None:
            self._protocol_error(session, ProtocolError(f"unknown request {op!r:.40}"))
            return
        handler, size = entry
        rid = request[1] if len(request) > 1 else None
        timed = self._timed
        started = time.perf_counter() if timed else 0.0
        error = None
        try:
            if len(request) != size:
                raise StoreError(arity_error(op, len(request) - 2))
            state = self.state
            job = state.jobs.get(session.job) or state.job(session.job)
            value = handler(self, session, job, request)
            if value is BLOCK:  # not answerable yet: wait in a task
                self._start_blocking(session, rid, as_map(request))
            elif rid is not None:
                session.reply_value(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        if timed:
            self.config.hooks.request(op, time.perf_counter() - started, error)

    def _protocol_error(self, session: _Session, exc: ProtocolError) -> None:
        log.info("protocol error from %s: %s", session.conn.peer, exc)
        session.conn.fail(exc, tell_peer=True)

    def _on_request(self, session: _Session, header: Any) -> None:
        """``{"op", "id", ...}``: any request."""
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            self._protocol_error(session, ProtocolError("a request must be a map with a string 'op'"))
            return
        op = header["op"]
        handler = HANDLERS.get(op)
        rid = header.get("id")
        if handler is None:
            if op not in BLOCKING:
                self._protocol_error(session, ProtocolError(f"unknown request {op!r:.40}"))
                return
            self._start_blocking(session, rid, header)
            return
        timed = self._timed
        started = time.perf_counter() if timed else 0.0
        error = None
        try:
            job = self.state.job(session.job)
            value = handler(self, session, job, header)
            if value is BLOCK:  # not answerable yet: wait in a task
                self._start_blocking(session, rid, header)
            else:
                session.reply(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        if timed:
            self.config.hooks.request(op, time.perf_counter() - started, error)

    def _start_blocking(self, session: _Session, rid: Any, header: dict[str, Any]) -> None:
        if len(session.tasks) >= self.config.max_pending_per_connection:
            self.config.hooks.refused("max_pending_per_connection")
            session.reply_error(
                rid,
                LimitError(
                    f"{self.config.max_pending_per_connection} blocking requests already pending on "
                    "this connection (limit: arendez-server --max-pending-per-connection)"
                ),
            )
            return
        task = asyncio.get_running_loop().create_task(self._blocking(session, rid, header))
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)

    async def _blocking(self, session: _Session, rid: Any, header: dict[str, Any]) -> None:
        started, error = time.perf_counter(), None
        try:
            job = self.state.job(session.job)
            value = await BLOCKING[header["op"]](self, session, job, header)
            if header["op"] == "join":  # partly encoded already
                packed = packed_reply(rid, value)
                if packed is not None:
                    session.send_encoded(packed)
            else:
                session.reply(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        self.config.hooks.request(header["op"], time.perf_counter() - started, error)

    def _changed(self, job: str, key: str) -> None:
        """Wake the waiters of ``key`` in ``job``."""
        waiters = self._key_waiters.pop((job, key), None)
        for fut in waiters or ():
            if not fut.done():
                fut.set_result(None)

    async def _until_key(self, session: _Session, job: Job, key: str, deadline: float, what: str) -> None:
        """Wait until ``key`` is set in ``job``; ``StoreTimeoutError`` naming ``what`` after ``deadline``."""
        loop = asyncio.get_running_loop()
        while job.get(key) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(what)
            fut = loop.create_future()
            self._key_waiters.setdefault((session.job, key), []).append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass
            finally:
                self._forget_waiter(session.job, key, fut)

    def _forget_waiter(self, job: str, key: str, fut: asyncio.Future[None]) -> None:
        waiters = self._key_waiters.get((job, key))
        if waiters is not None and not fut.done():
            with contextlib.suppress(ValueError):
                waiters.remove(fut)
            if not waiters:
                del self._key_waiters[(job, key)]

    # -- elastic rounds ---------------------------------------------------------------------
    def _round_closed(self, round_: Round) -> None:
        """Wake the joiners of a round that just completed (or closed, elastic)."""
        timer = self._settle.pop(round_, None)
        if timer is not None:
            timer.cancel()
        done = self._round_done.pop(round_, None)
        if done is not None and not done.done():
            done.set_result(None)

    def _elastic_joined(self, job: Job, round_: Round, settle: float) -> None:
        """A rank joined an elastic round that is not full: (re)start its settle time once it
        has its minimum, and tell the members of the job's running rounds that ranks wait."""
        loop = asyncio.get_running_loop()
        if len(round_.members) >= round_.min_size:
            timer = self._settle.pop(round_, None)
            if timer is not None:
                timer.cancel()
            self._settle[round_] = loop.call_later(settle, self._settled, job, round_)
        if job.rounds and job.name not in self._joining_news:
            self._joining_news[job.name] = loop.call_later(DEPARTURE_BATCH, self._tell_joining, job)

    def _settled(self, job: Job, round_: Round) -> None:
        self._settle.pop(round_, None)
        if job.settle(round_, time.monotonic()) is not None:
            self._round_closed(round_)

    def _close_ready(self, name: str) -> None:
        """Ranks of ``name`` left or failed: its elastic round being formed may close now."""
        job = self.state.jobs.get(name)
        closed = job.close_ready(time.monotonic()) if job is not None else None
        if closed is not None:
            self._round_closed(closed)

    def _tell_joining(self, job: Job) -> None:
        """One ``joining`` event per running round of ``job``: how many ranks wait to join."""
        self._joining_news.pop(job.name, None)
        forming = job.forming
        if forming is None or not forming.elastic:
            return
        event = wire.encode({"event": "joining", "waiting": len(forming.members)})
        for nonce in list(job.rounds):
            for session in self._members.get((job.name, nonce), ()):
                if session.conn.is_open:
                    session.send_encoded(event)

    # -- departures and leases -------------------------------------------------------------
    def _depart(self, departures: list[Departure]) -> None:
        """Queue departures; they go out batched, one event per round per flush."""
        if not departures:
            return
        for gone in departures:
            self.config.hooks.departed(gone)
            (log.warning if gone.failed else log.info)("job %r rank %d %s", gone.job, gone.rank, gone.reason)
        self._departed.extend(departures)
        for name in {gone.job for gone in departures}:
            self._close_ready(name)
        if self._departure_flush is None:
            loop = asyncio.get_running_loop()
            self._departure_flush = loop.call_later(DEPARTURE_BATCH, self._flush_departures)

    def _flush_departures(self) -> None:
        self._departure_flush = None
        departed, self._departed = self._departed, []
        by_round: dict[tuple[str, bytes], list[list[Any]]] = {}
        for gone in departed:
            by_round.setdefault((gone.job, gone.nonce), []).append([gone.rank, gone.failed, gone.reason])
        for key, ranks in by_round.items():
            event = wire.encode({"event": "departed", "ranks": ranks})
            for session in self._members.get(key, ()):
                if session.conn.is_open:
                    session.send_encoded(event)

    async def _watch_leases(self) -> None:
        cfg = self.config
        interval = max(0.05, cfg.lease / 10)
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(interval)
            now = time.monotonic()
            self._sweep_handshakes(now)
            if loop.time() - before > 2 * interval + 0.1:
                # the server itself stalled: heartbeats may be waiting in its sockets, unread.
                # Read them (next turn) before judging anyone.
                continue
            self._depart(self.state.expire(now, cfg.lease, cfg.lease_arm_grace))


transport.register_remote_errors(StoreError, StoreTimeoutError, RendezvousError, ProtocolError)
transport.register_remote_errors(AuthenticationError, LimitError)
