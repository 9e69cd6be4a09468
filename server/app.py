"""The asyncio server: listening, the handshake, request dispatch, the lease check, graceful shutdown.

Everything a rank costs the server is O(1): one connection (its process's lease connection is
shared by all ranks of the process), a join that wakes only its own round's waiters, store
waits that wake only on their own keys, replies to the requests of one read written at once,
and failure news sent as one batched event per round per flush, encoded once. The parts:
``connection.py`` (a client's reads and replies), ``admission.py`` (connection limits),
``handlers.py`` (the requests), ``waits.py`` (store waits), ``members.py`` (rounds' news),
``lifetimes.py`` (when a job nobody uses is dropped).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl as _ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arendez import burstlog, handshake, transport, wire
from arendez.errors import (
    ArendezError,
    AuthenticationError,
    LimitError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
)
from arendez.store_wire import STORE_PROTOCOL, TCPSTORE_JOB, arity_error, request_limit
from arendez.transports import local

from . import tcpstore_front
from .admission import Admission
from .barriers import Barrier
from .connection import Backlogged, ServerConnection, Session, by_host, note_closing
from .handlers import (
    BLOCK,
    BLOCKING,
    COMPACT,
    HANDLERS,
    JOBLESS,
    PARKED,
    as_map,
    park,
    start_barrier,
    start_join,
)
from .hooks import ServerHooks
from .keepers import Keepers
from .lifetimes import JobLifetimes
from .limits import StateLimits
from .members import Members
from .rounds import Departure
from .state import ServerState
from .waits import KeyWaits

log = logging.getLogger("arendez.server")


#: a flood of refused connections is a line and a summary per second, not a line each
_REFUSALS = burstlog.BurstLog(log, by_host("connection(s) refused"))


#: The largest frame a client may send before its handshake (a hello is under 300 bytes).
HELLO_MAX = 1024
#: The welcome (a token adds the server's proof); sent ahead in the challenge when the server has
#: no token (``handshake.early_welcome``).
_WELCOME = {"store": STORE_PROTOCOL, "ok": True}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    ssl: _ssl.SSLContext | None = None
    #: A socket already bound and listening (by the process that started this one): served
    #: instead of binding ``host:port``.
    sock: socket.socket | None = None
    lease: float = 2.5
    #: Extra seconds a member's lease gets before its process's keeper first renews it.
    lease_arm_grace: float = 30.0
    #: Seconds a scoped job's keys outlive its last client (clients reconnecting after a network
    #: blip come back well within it; a finished torchrun's keys go after it).
    scoped_grace: float = 10.0
    #: Serve torch's own TCPStore clients on this port too (``tcpstore_front``; 0 picks one);
    #: their keys are those of job ``tcpstore_job``. Not with a token or TLS.
    tcpstore_port: int | None = None
    tcpstore_job: str = TCPSTORE_JOB
    #: Seconds the keys of ``tcpstore_job`` outlive its last client once torch clients used it
    #: (0: they go with it, as a torch store goes with the run that hosts it).
    tcpstore_grace: float = 0.0
    #: The keys of ``tcpstore_job`` go with its last client (after ``tcpstore_grace``) whichever
    #: kind of client used it, ``arendez.sync.TCPStore``'s too: a standalone server's TCPStore
    #: job lasts one run. (A server a master ``TCPStore`` hosts keeps them while it runs.)
    tcpstore_runs: bool = False
    handshake_timeout: float = 20.0
    #: Listen queue for connection storms (the kernel caps it at net.core.somaxconn).
    backlog: int = 4096
    max_connections: int = 32768
    max_connections_per_host: int = 32768
    max_pending_per_connection: int = 4096
    #: Reply bytes all clients together may leave unread before the one behind is dropped
    #: (each client alone: ``connection.MAX_UNREAD_REPLIES``).
    max_unread_bytes: int = 256 << 20
    #: Bytes all clients' unfinished requests (a large request still arriving) may hold
    #: together; the client whose request would pass it is refused.
    max_unfinished_bytes: int = 256 << 20
    #: Raise this process's open-file limit to its hard limit (the standalone server does).
    raise_fd_limit: bool = False
    limits: StateLimits = field(default_factory=StateLimits)
    hooks: ServerHooks = field(default_factory=ServerHooks)  # metrics, dashboard (server/http.py)


class Server:
    """Rendezvous + key-value store for many jobs; the same code runs standalone and embedded."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = cfg = config or ServerConfig()
        self.state = ServerState(cfg.limits)
        self.keepers = Keepers(cfg.lease)
        self.admission = Admission(cfg.max_connections, cfg.max_connections_per_host, cfg.hooks)
        #: Connections whose replies wait to be read (``Session.check_unread``).
        self.backlogged: set[Backlogged] = set()
        #: Bytes the unfinished requests of all clients hold (``ServerConnection.held``).
        self.unfinished = 0
        self.members = Members(self.state, cfg.hooks)
        self.waits = KeyWaits()
        #: ``TCPStore.barrier`` calls waiting, by job and key (``barriers``)
        self.barriers: dict[tuple[str, str], Barrier] = {}
        self._server: asyncio.Server | None = None
        self._local: asyncio.Server | None = None  # the same-host listener (``transports.local``)
        self._torch: asyncio.Server | None = None  # torch's TCPStore clients (``tcpstore_front``)
        self.tcpstore_job = cfg.tcpstore_job
        self.lifetimes = JobLifetimes(
            self.state, cfg.tcpstore_job, cfg.scoped_grace, cfg.tcpstore_grace, cfg.tcpstore_runs
        )
        self._lease_task: asyncio.Task[None] | None = None
        self.closing = False
        self.packer = wire.ReleasingPacker()
        #: Time every request for the hooks (not when they are the do-nothing ones).
        self.timed = type(cfg.hooks).request is not ServerHooks.request
        self.port = 0
        self.tcpstore_port: int | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.admission.fit_fd_limit(cfg.raise_fd_limit)
        limits = wire.Limits(max_header=HELLO_MAX, max_payload=0)  # raised once authenticated
        if cfg.sock is not None:
            self._server = await loop.create_server(
                lambda: ServerConnection(self, limits),
                sock=cfg.sock,
                ssl=cfg.ssl,
                backlog=cfg.backlog,
                start_serving=False,
            )
        else:
            self._server = await loop.create_server(
                lambda: ServerConnection(self, limits),
                cfg.host,
                cfg.port,
                ssl=cfg.ssl,
                reuse_address=True,
                backlog=cfg.backlog,
                start_serving=False,
            )
        for sock in self._server.sockets:  # accepted connections inherit these: no syscalls each
            transport.tune_tcp_socket(sock)
        await self._server.start_serving()
        self.port = self._server.sockets[0].getsockname()[1]
        await self._listen_locally(limits)
        if cfg.tcpstore_port is not None:
            if cfg.token or cfg.ssl is not None:
                raise ValueError(
                    "the TCPStore port serves torch's clients, which cannot authenticate: it cannot "
                    "be opened on a server with a token or TLS"
                )
            self._torch = await tcpstore_front.listen(self, cfg.host, cfg.tcpstore_port, cfg.backlog)
            self.tcpstore_port = self._torch.sockets[0].getsockname()[1]
            log.info("torch TCPStore clients: %s:%d (job %r)", cfg.host, self.tcpstore_port, cfg.tcpstore_job)
        self._lease_task = loop.create_task(self._watch_leases())
        log.debug("arendez-server listening on %s", self.url)  # (the CLI prints it on stdout)

    async def _listen_locally(self, limits: wire.Limits) -> None:
        """Clients on this host connect over a Unix socket when they can (``transports.local``:
        half the cost per request of loopback TCP); never under TLS."""
        name = local.server_name(self.config.host, self.port)
        if name is None or self.config.ssl is not None or not local.enabled():
            return
        try:
            self._local = await local.listen(
                name, lambda: ServerConnection(self, limits), backlog=self.config.backlog
            )
        except OSError as exc:  # (the name is taken: another server on this port, another address)
            log.info("no local socket %r: %s; clients on this host use TCP", name, exc)

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"arendez://{host}:{self.port}"

    async def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, tell every client, close their connections within ``timeout``."""
        if self.closing:
            return
        self.closing = True
        for listener in (self._server, self._local, self._torch):
            if listener is not None:
                listener.close()
        if self._lease_task is not None:
            self._lease_task.cancel()
        self.members.close()
        conns = list(self.admission.conns)
        bye = wire.encode({"event": "server_shutdown"})
        for conn in conns:  # mid-handshake, the notice would pass for a welcome: those just close
            if isinstance(conn, ServerConnection) and conn.is_open and conn.session is not None:
                conn.send_encoded(bye)
        if conns:
            await asyncio.gather(*(c.wait_closed(timeout) for c in conns), return_exceptions=True)
        for listener in (self._server, self._local, self._torch):
            if listener is not None:
                try:
                    async with asyncio.timeout(timeout):
                        await listener.wait_closed()
                except TimeoutError:
                    pass

    def members_active(self, job: str, nonce: bytes) -> bool:
        """True while a rank of round ``nonce`` of ``job`` has not left or failed."""
        found = self.state.jobs.get(job)
        round_ = found.rounds.get(nonce) if found is not None else None
        return round_ is not None and round_.in_use

    # -- connections -----------------------------------------------------------------------
    def _made(self, conn: ServerConnection) -> None:
        """A client connected: count it, refuse it by a limit's name, or challenge it."""
        conn.host = host = conn.remote_host
        self.admission.add(conn)
        conn.set_handlers(lambda header, payload: self._on_hello(conn, header), lambda exc: self._lost(conn))
        if self.closing:
            conn.abort()
            return
        refused = self.admission.refusal(host)
        if refused is not None:
            _REFUSALS.note(None, logging.WARNING, (host, str(refused)), "%s", refused)
            conn.fail(refused, tell_peer=True)  # sent in place of the challenge
            return
        challenge, conn.nonce = handshake.make_challenge(self.config.token, _WELCOME)
        conn.deadline = time.monotonic() + self.config.handshake_timeout
        self.admission.handshaking.add(conn)
        conn.send(challenge)

    def _on_hello(self, conn: ServerConnection, hello: Any) -> None:
        cfg = self.config
        if conn.session is not None:  # frames of a connection already failing
            return
        self.admission.handshaking.discard(conn)
        try:
            welcome = handshake.answer_hello(hello, cfg.token, conn.nonce, _WELCOME)
            job = hello.get("job", "")
            if not isinstance(job, str) or len(job) > 256:
                raise ProtocolError("job name must be a string of at most 256 characters")
        except (ProtocolError, AuthenticationError) as exc:
            # (told, and what it still sends read and dropped for a moment before the close: a
            # client that sent its first request behind its hello reads why, not a reset)
            conn.refuse(exc)
            return
        if hello.get("early") is not True or cfg.token:  # (a client that took the early one: none)
            conn.send(welcome)
        limit = request_limit(cfg.limits.max_value, cfg.limits.max_key)
        conn.set_limits(wire.Limits(max_header=limit, max_payload=0))
        session = Session(self, conn, job)
        conn.start_session(session, limit)
        self.lifetimes.came(session, scoped=hello.get("scoped") is True)
        conn.set_handlers(lambda header, payload: self._handle(session, header), lambda exc: self._lost(conn))

    def _lost(self, conn: ServerConnection) -> None:
        if not self.admission.remove(conn):
            return
        session, conn.session = conn.session, None  # the session keeps its connection, not both ways
        if session is not None:
            self.keepers.let_go(session)
            self._session_gone(session)

    def _session_gone(self, session: Session) -> None:
        for pending in list(session.tasks):
            pending.cancel()
        self.members.unbind(session)
        job = self.state.jobs.get(session.job)
        if job is not None and session.round is not None and session.rank is not None:
            job.withdraw(session.round, session.rank)  # once complete, the lease decides
        self.lifetimes.went(session)

    def depart(self, departures: list[Departure]) -> None:
        """Members that stopped being active: their peers are told (``Members``), and their
        jobs may be dropped (``JobLifetimes.departed``)."""
        self.members.depart(departures)
        self.lifetimes.departed({gone.job for gone in departures})

    # -- requests --------------------------------------------------------------------------
    def _handle(self, session: Session, request: Any) -> None:
        """Answer one request (compact or map form), at once where it can be."""
        if session.dropped:
            return
        if type(request) is list:
            self._compact(session, request)
        else:
            self._on_request(session, request)

    def _compact(self, session: Session, request: list[Any]) -> None:
        """``[op, id, *args]``: a key-value operation (``arendez.store_wire``)."""
        op: Any = request[0] if request else None
        entry = COMPACT.get(op) if type(op) is str else None
        if entry is None:
            self._protocol_error(session, ProtocolError(f"unknown request {op!r:.40}"))
            return
        handler, size = entry
        rid = request[1] if len(request) > 1 else None
        timed = self.timed
        started = time.perf_counter() if timed else 0.0
        error = None
        try:
            if len(request) != size:
                raise StoreError(arity_error(op, len(request) - 2))
            state = self.state
            job = state.jobs.get(session.job) or state.job(session.job)
            value = handler(self, session, job, request)
            if value is BLOCK:  # not answerable yet: wait for the keys, or in a task
                self._wait_for(session, rid, as_map(request), compact=True)
            elif rid is not None:
                session.reply_value(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        if timed:
            self.config.hooks.request(op, time.perf_counter() - started, error)

    def _protocol_error(self, session: Session, exc: ProtocolError) -> None:
        note_closing(session.conn, session.conn.host, "protocol error from", exc)
        session.conn.fail(exc, tell_peer=True)

    def _on_request(self, session: Session, header: Any) -> None:
        """``{"op", "id", ...}``: any request."""
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            self._protocol_error(session, ProtocolError("a request must be a map with a string 'op'"))
            return
        op = header["op"]
        handler = HANDLERS.get(op)
        rid = header.get("id")
        if op == "join":
            self._start_waiting(session, rid, header, start_join)
            return
        if handler is None:
            if op not in BLOCKING:
                self._protocol_error(session, ProtocolError(f"unknown request {op!r:.40}"))
                return
            self._start_blocking(session, rid, header)
            return
        timed = self.timed
        started = time.perf_counter() if timed else 0.0
        error = None
        try:
            state = self.state
            # (a process's lease needs no job: its connection must not take a --max-jobs slot,
            # or a full server refused every lease and stopped ranks were never declared failed)
            job = state.jobs.get(session.job) if op in JOBLESS else state.job(session.job)
            value = handler(self, session, job, header)
            if value is BLOCK:  # not answerable yet: wait for the keys, or in a task
                self._wait_for(session, rid, header, compact=False)
            else:
                session.reply(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        if timed:
            self.config.hooks.request(op, time.perf_counter() - started, error)

    def _refuse_pending(self, session: Session, rid: Any) -> bool:
        """Refuse a request that would wait past the connection's limit of pending ones."""
        if len(session.tasks) < self.config.max_pending_per_connection:
            return False
        self.config.hooks.refused("max_pending_per_connection")
        session.reply_error(
            rid,
            LimitError(
                f"{self.config.max_pending_per_connection} blocking requests already pending on "
                "this connection (limit: arendez-server --max-pending-per-connection)"
            ),
        )
        return True

    def _wait_for(self, session: Session, rid: Any, header: dict[str, Any], *, compact: bool) -> None:
        """A request that cannot be answered yet: parked on its keys (``waits.KeyWait``), or,
        for the others, a task."""
        if header["op"] in PARKED:
            self._start_waiting(session, rid, header, functools.partial(park, compact=compact))
        elif header["op"] == "barrier":
            self._start_waiting(session, rid, header, functools.partial(start_barrier, compact=compact))
        else:
            self._start_blocking(session, rid, header)

    def _start_waiting(
        self, session: Session, rid: Any, header: dict[str, Any], start: Callable[..., None]
    ) -> None:
        """A request that waits without a task: ``start(server, session, job, rid, header)``
        parks it (a join on its round, ``joins.JoinWait``; a key wait, ``waits.KeyWait``); a
        request it refuses is answered, and timed, at once."""
        if self._refuse_pending(session, rid):
            return
        started = time.perf_counter()
        try:
            start(self, session, self.state.job(session.job), rid, header)
        except ArendezError as exc:
            session.reply_error(rid, exc)
            self.config.hooks.request(header["op"], time.perf_counter() - started, type(exc).__name__)

    def _start_blocking(self, session: Session, rid: Any, header: dict[str, Any]) -> None:
        if self._refuse_pending(session, rid):
            return
        task = asyncio.get_running_loop().create_task(self._blocking(session, rid, header))
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)

    async def _blocking(self, session: Session, rid: Any, header: dict[str, Any]) -> None:
        started, error = time.perf_counter(), None
        try:
            job = self.state.job(session.job)
            value = await BLOCKING[header["op"]](self, session, job, header)
            session.reply(rid, value)
        except ArendezError as exc:
            error = type(exc).__name__
            session.reply_error(rid, exc)
        self.config.hooks.request(header["op"], time.perf_counter() - started, error)

    # -- leases ------------------------------------------------------------------------------
    async def _watch_leases(self) -> None:
        cfg = self.config
        interval = max(0.05, cfg.lease / 10)
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.admission.sweep_handshakes(now)
            if loop.time() - before > 2 * interval + 0.1:
                # the server itself stalled: heartbeats may be waiting in its sockets, unread.
                # Read them (next turn) before judging anyone.
                continue
            since, deaf = self.keepers.judge(self.state, now, cfg.lease, cfg.lease_arm_grace)
            self.depart(self.state.expire(now, cfg.lease, cfg.lease_arm_grace, since, deaf))

    @property
    def holding_declarations(self) -> bool:
        """No client heard for a while and leases ran out: nobody is declared failed now."""
        return self.keepers.held


transport.register_remote_errors(StoreError, StoreTimeoutError, RendezvousError, ProtocolError)
transport.register_remote_errors(AuthenticationError, LimitError)
