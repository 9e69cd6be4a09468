"""The peer mesh: authenticated connections between ranks of a world, opened on first use.

The listener is opened before the rendezvous (its address is what the rank advertises);
connections that arrive before our own rendezvous answer wait for it, then must present the
round's nonce, so a stranger or a rank of another round cannot join. Nothing connects all
pairs: ``link(peer)`` hands out the connection to ``peer``, dialing it (address fetched from
the store, batched) on first use, and frames sent meanwhile queue in a ``PendingLink``. Init
pre-connects only the algorithms' neighbours (``preconnect``).

Either side may dial. When both do at once, the connection dialed by the lower rank wins: the
lower rank refuses a higher rank's dial as a duplicate while its own dial to it is under way,
and the higher rank then waits for that one.

Until its handshake is done, an accepted connection may send one hello-sized frame (no
payload), must finish within the handshake time, and counts against the listener's limits on
connections not yet authenticated, per remote host and in total (``ListenerLimits``; a
refused dialer is told which limit and, if it is a rank, retries until its deadline).

The listener's limits are ``admission``'s, the dial itself (its retries, our hello) ``dialer``'s,
the peers' addresses ``addresses``'.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl as _ssl
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from .. import frames, handshake, stall, transport, wire
from ..errors import AuthenticationError, LimitError, ProtocolError, RendezvousError
from . import local
from .addresses import UNFETCHED, AddressBook, Resolver
from .admission import _HELLO_LIMITS, HELLO_FRAMES
from .admission import ListenerLimits as ListenerLimits  # (re-exported: callers name it here)
from .dialer import Dialer
from .dialer import split_address as split_address  # (re-exported: callers name it here)
from .listen import listening_socket
from .pending import PendingLink

log = logging.getLogger("arendez.tcp")

FrameRouter = Callable[[int, frames.Frame, memoryview | None], None]
SinkRouter = Callable[[int, frames.Frame, int], memoryview | wire.Stream | None]
LossHandler = Callable[[int, str], None]
ConnectHandler = Callable[[int], None]


def _error_header(exc: BaseException) -> Any:
    return frames.encode(frames.Error.of(exc))


#: Seconds a closing mesh waits for each peer to read what it sent and close its end.
LINGER_SECONDS = 1.0

transport.register_remote_errors(LimitError)


#: Below this, a ``preconnect`` that times out blames the time left, not the addresses.
SHORT_PRECONNECT_SECONDS = 1.0
#: How long init, finding only peers that left, waits for the news of a failure: a peer that
#: leaves during init has mostly left on the news of another one's death, which may come later.
LEFT_NEWS_SECONDS = 1.0
_FAILURES_KEPT = 64  # (failures elsewhere in the job a mesh remembers, to name in init's error)


class Mesh:
    """Connections to the other ranks that this one talks to, keyed by rank."""

    def __init__(
        self,
        *,
        token: str | None,
        server_ssl: _ssl.SSLContext | None = None,
        client_ssl: _ssl.SSLContext | None = None,
        handshake_timeout: float | None = None,
        limits: ListenerLimits | None = None,
    ) -> None:
        self.rank = -1
        self.world_size = 0
        self.nonce = b""
        self.conns: dict[int, transport.Connection] = {}
        #: connections opened so far (dialed or accepted), for ``transport_stats``
        self.opened = 0
        self._token = token
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        self.limits = limits or ListenerLimits.from_env()
        self._handshake_timeout = handshake_timeout or self.limits.handshake_seconds
        self._pending: collections.Counter[str] = collections.Counter()  # by remote host
        self._listener: asyncio.Server | None = None
        self._local_listener: asyncio.Server | None = None
        #: the abstract Unix socket this rank also listens on (``local``), if any
        self.local_name: str | None = None
        self._round: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task[None]] = set()
        self._route: FrameRouter | None = None
        self._sink: SinkRouter | None = None
        self._on_lost: LossHandler | None = None
        self._on_connected: ConnectHandler | None = None
        self._closing = False
        self._dial_errors: dict[int, str] = {}  # the last error dialing each peer
        self._unreachable: set[int] = set()  # peers a dial found gone (never dialed again)
        self._left: set[int] = set()  # of those, the ones the server says left in good order
        self._preconnecting = False  # (init: ``preconnect`` is waiting for its connections)
        self._doubted = False  # (init: news that the job is failing; see ``doubt``)
        self._failures: list[int] = []  # peers the server declared failed, in the order heard
        self._dial_timeout = 30.0
        self._dialer: Dialer | None = None  # (from ``start``: the round's rank and nonce)
        self.addresses = AddressBook()
        self._waiting_links: dict[int, PendingLink] = {}  # peers being dialed (by us, or by them)
        self._dialing: set[int] = set()  # peers our own dial is under way to
        self._connected = asyncio.Event()  # set whenever a connection is adopted

    async def listen(self, host: str, port: int = 0) -> int:
        """Open the listener (and, same-host peers, a local socket: ``local``); return its port."""
        loop = asyncio.get_running_loop()
        sock = listening_socket(host, port, 100)  # (None for a host name: the loop resolves it)
        where: dict[str, Any] = {"sock": sock} if sock is not None else {"host": host, "port": port}
        self._listener = await loop.create_server(self._new_connection, ssl=self._server_ssl, **where)
        port_: int = self._listener.sockets[0].getsockname()[1]
        if self._uses_local_sockets():
            name = local.new_name()
            try:
                self._local_listener = await local.listen(name, self._new_connection)
                self.local_name = name
            except OSError as exc:  # (a platform or sandbox without them: TCP serves)
                log.debug("no local socket listener: %s", exc)
        return port_

    def advertised(self, tcp_address: str) -> str:
        """The address to publish for this rank: ``tcp_address`` and the local socket's name."""
        return local.advertise(tcp_address, self.local_name)

    def is_local(self, peer: int) -> bool:
        """Whether the connection to ``peer`` is a same-host Unix socket."""
        conn = self.conns.get(peer)
        return conn is not None and conn.remote_host == transport.LOCAL_HOST

    def _uses_local_sockets(self) -> bool:
        # (off under TLS: a TLS user asked for every stream to be encrypted and verified)
        return local.enabled() and self._server_ssl is None and self._client_ssl is None

    def _new_connection(self) -> transport.Connection:
        return self._accepted(transport.Connection(_HELLO_LIMITS, max_queued=HELLO_FRAMES))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accepted(self, conn: transport.Connection) -> transport.Connection:
        self._spawn(self._admit(conn))
        return conn

    async def _admit(self, conn: transport.Connection) -> None:
        host = ""
        try:
            async with stall.patient_timeout(self._handshake_timeout):  # (not our own overload)
                await asyncio.shield(conn._made)
                host = conn.remote_host
                refused = self.limits.refusal(self._pending, host)
                if refused is not None:
                    host = ""
                    log.debug("refused a peer connection from %s: %s", conn.peer, refused)
                    conn.fail(refused, tell_peer=True)
                    return
                self._pending[host] += 1
                hello = await handshake.server_handshake(
                    conn, self._token, self._handshake_timeout * stall.PATIENCE
                )
                nonce = await asyncio.shield(self._round)
                peer = hello.get("rank")
                if hello.get("round") != nonce:
                    raise AuthenticationError("peer belongs to another job or round")
                if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
                    raise ProtocolError(f"unexpected peer rank {peer!r}")
                if peer in self.conns or (peer in self._dialing and self.rank < peer):
                    # both dialed at once: the lower rank's dial wins; the dialer waits for it
                    conn.send({"rank": self.rank, "duplicate": True})
                    conn.close()
                    return
                conn.send({"rank": self.rank})
            self._adopt(peer, conn)
        except (ProtocolError, AuthenticationError) as exc:
            log.warning("refused a peer connection from %s: %s", conn.peer, exc)
            conn.fail(exc, tell_peer=True)
        except (TimeoutError, ConnectionError):
            conn.abort()
        except asyncio.CancelledError:  # the mesh is closing
            conn.abort()
            raise
        finally:
            if host:
                self._pending[host] -= 1
                if not self._pending[host]:
                    del self._pending[host]

    def start(
        self,
        rank: int,
        world_size: int,
        nonce: bytes,
        addresses: dict[int, str],
        route: FrameRouter,
        sink: SinkRouter,
        on_lost: LossHandler,
        *,
        resolve: Resolver | None = None,
        on_connected: ConnectHandler | None = None,
        dial_timeout: float = 30.0,
    ) -> None:
        """Enter the round: admit peers' dials, and dial on ``link``. ``addresses`` are the
        peer addresses known now; ``resolve`` fetches others (batched) on first use."""
        self.rank, self.world_size, self.nonce = rank, world_size, nonce
        self._route, self._sink, self._on_lost = route, sink, on_lost
        self._on_connected = on_connected
        self.addresses.resolve = resolve
        self.addresses.known.update(addresses)
        self._dial_timeout = dial_timeout
        self._dialer = Dialer(
            rank=rank,
            nonce=nonce,
            token=self._token,
            client_ssl=self._client_ssl,
            handshake_timeout=self._handshake_timeout,
            dial_timeout=dial_timeout,
            errors=self._dial_errors,
        )
        self._round.set_result(nonce)

    def link(self, peer: int) -> transport.Connection | PendingLink | None:
        """The link to ``peer``: its connection, or one being dialed (started here if needed);
        ``None`` if a dial to it already failed or the mesh is closing."""
        conn = self.conns.get(peer)
        if conn is not None:
            return conn
        pending = self._waiting_links.get(peer)
        if pending is None:
            if self._closing or peer in self._unreachable or not 0 <= peer < self.world_size:
                return None
            pending = self._waiting_links[peer] = PendingLink(peer)
            self._dialing.add(peer)
            self._spawn(self._dial(peer, pending))
        return pending

    async def preconnect(self, peers: Iterable[int], timeout: float) -> None:
        """Open the connections to ``peers`` (the lower rank of each pair dials), within
        ``timeout``; a peer that cannot be reached fails init with ``RendezvousError``."""
        wanted = sorted(set(peers) - {self.rank})
        for peer in wanted:
            if self.rank < peer:
                self.link(peer)
        loop = asyncio.get_running_loop()
        news_by: float | None = None  # (only peers that left: the failure's news may follow)
        self._preconnecting = True
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if self._doubted:
                        self._doubted = False
                        self._dial_lower(wanted)
                    failed = [p for p in wanted if p in self._unreachable]
                    if failed and not self._failures and all(p in self._left for p in failed):
                        news_by = news_by or loop.time() + LEFT_NEWS_SECONDS
                    elif failed:
                        raise self._init_failed(failed)
                    elif all(p in self.conns for p in wanted):
                        return
                    self._connected.clear()
                    if news_by is None:
                        await self._connected.wait()
                    elif loop.time() >= news_by:
                        raise self._init_failed(failed)
                    else:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(news_by - loop.time()):
                                await self._connected.wait()
        except TimeoutError:
            missing = [p for p in wanted if p not in self.conns]
            if timeout < SHORT_PRECONNECT_SECONDS:  # the rendezvous took (nearly) all of init's time
                hint = (
                    f" (init_process_group's timeout left only {timeout:g}s for them after the "
                    "rendezvous: a slow rendezvous, an overloaded machine? raise the timeout)"
                )
            else:
                hint = " (check that the advertised addresses are reachable, or set ARENDEZ_ADVERTISE_ADDR)"
            raise RendezvousError(
                self._describe(missing, f"peer connections not made in {timeout:g}s:") + hint
            ) from None
        finally:
            self._preconnecting = self._doubted = False
            self._left.clear()

    def doubt(self) -> None:
        """News that the job is failing (a rank left or failed, the store went away) while init
        waits for its connections: ``preconnect`` then dials the neighbours that should have
        dialed this rank, as a refused dial tells a dead rank from a slow one. (With ``tcp://``
        the store dies with rank 0, and the server's word on a rank killed during init may never
        come.)"""
        if self._preconnecting:
            self._doubted = True
            self._connected.set()

    def _dial_lower(self, wanted: list[int]) -> None:
        for peer in wanted:
            if peer < self.rank and peer not in self.conns and peer not in self._unreachable:
                pending = self._waiting_links.get(peer)
                if pending is None:
                    self.link(peer)
                elif peer not in self._dialing:
                    self._dialing.add(peer)
                    self._spawn(self._dial(peer, pending))

    def forget(self, peer: int, reason: str, left: bool = False) -> None:
        """``peer`` is gone by other news (the server declared it failed, or it ``left``): stop
        dialing it, fail what waits for a link to it, and let ``preconnect`` say why."""
        if not left and peer != self.rank and len(self._failures) < _FAILURES_KEPT:
            self._failures.append(peer)
            self._dial_errors.setdefault(peer, reason)
            self._connected.set()
        self.doubt()
        if peer in self.conns or peer in self._unreachable or peer == self.rank:
            return  # (a connection tells its own loss)
        self._unreachable.add(peer)
        if not left:
            self._dial_errors[peer] = reason
        elif self._preconnecting:  # (after init, what a departure costs is one set entry: a
            self._left.add(peer)  # process of 500 simulated ranks hears 10,000 of them each)
            self._dial_errors[peer] = reason
        pending = self._waiting_links.pop(peer, None)
        if pending is not None:
            pending.fail(ConnectionResetError(f"rank {peer}: {reason}"))
        self._connected.set()

    def _init_failed(self, gone: list[int]) -> RendezvousError:
        """Init's error for neighbours ``gone`` (failed first, then those that left), naming the
        failures heard of elsewhere in the job too: a neighbour that left during init has most
        likely left on the news of one of them."""
        gone = sorted(gone, key=lambda p: p in self._left)
        elsewhere = [p for p in self._failures if p not in gone][:4]
        text = self._describe(gone, "could not connect to")
        if elsewhere:
            told = "; ".join(f"rank {p} ({self._dial_errors[p]})" for p in elsewhere)
            text += f"; the job also lost {told}"
        exc = RendezvousError(text)
        failed, left = [p for p in gone if p not in self._left], [p for p in gone if p in self._left]
        exc.unreachable = (*failed, *elsewhere, *left)
        exc.rank = exc.unreachable[0]
        return exc

    def _describe(self, ranks: list[int], what: str) -> str:
        detail = "; ".join(
            f"rank {r} at {self.addresses.describe(r)}"
            + (f" ({self._dial_errors[r]})" if r in self._dial_errors else "")
            for r in ranks
        )
        return f"{what} {detail}"

    async def _dial(self, peer: int, pending: PendingLink) -> None:
        address = UNFETCHED
        try:
            async with asyncio.timeout(self._dial_timeout):
                address = await self.addresses.lookup(peer)
                assert self._dialer is not None
                conn = await self._dialer.connect(peer, address, self._uses_local_sockets())
            self._dialing.discard(peer)
            if conn is not None and peer in self._unreachable:  # declared gone meanwhile
                conn.abort()
            elif conn is not None:
                self._adopt(peer, conn)
            # else: its own dial to us wins, and _admit adopts that one
        except asyncio.CancelledError:
            pending.fail(ConnectionResetError("the mesh is closing"))
            raise
        except Exception as exc:
            self._dialing.discard(peer)
            if peer in self.conns:  # it dialed us meanwhile: that connection serves
                return
            self._waiting_links.pop(peer, None)
            self._connected.set()
            if not isinstance(exc, ConnectionRefusedError | AuthenticationError | ProtocolError):
                # a busy or stopped peer, or the store unreachable: not proof it is gone (the
                # server's lease decides that); the next use dials again
                last = self._dial_errors.get(peer, "no answer")
                if isinstance(exc, TimeoutError):
                    exc = TimeoutError(f"no connection within {self._dial_timeout:g}s ({last})")
                pending.fail(exc)
                return
            why = self._dial_errors[peer] = f"{type(exc).__name__}: {exc}"
            self._unreachable.add(peer)
            pending.fail(exc)
            if not self._closing and self._on_lost is not None:
                self._on_lost(peer, f"could not connect to it at {address} ({why})")

    def _adopt(self, peer: int, conn: transport.Connection) -> None:
        assert self._route is not None and self._sink is not None
        route, sink = self._route, self._sink
        conn.set_limits(wire.Limits())
        self.conns[peer] = conn
        self.opened += 1
        self._dialing.discard(peer)
        conn.set_handlers(
            lambda header, payload: route(peer, header, payload),
            lambda exc: self._lost(peer, exc),
            sink=lambda header, nbytes: sink(peer, header, nbytes),
            parse=frames.decode,
            error_header=_error_header,
        )
        pending = self._waiting_links.pop(peer, None)
        if pending is not None:
            pending.attach(conn)  # (queued frames first: they were sent before anything else)
        self._connected.set()
        if self._on_connected is not None and conn.is_open:
            self._on_connected(peer)

    def _lost(self, peer: int, exc: BaseException | None) -> None:
        if self.conns.get(peer) is not None and not self._closing and self._on_lost is not None:
            self._on_lost(peer, f"connection lost ({exc or 'closed by peer'})")

    def send(self, peer: int, frame: frames.Frame, payload: memoryview | None = None) -> transport.Connection:
        """Send ``frame`` (and its payload) to ``peer``; ``KeyError`` if not connected."""
        conn = self.conns[peer]
        conn.send(frames.encode(frame), payload)
        return conn

    def farewell(self, frame: frames.Frame, budget: float) -> list[int]:
        """Send ``frame`` to every peer without the event loop, within ``budget`` seconds in
        all (the process is ending); return the ranks it reached."""
        deadline = time.monotonic() + budget
        reached = []
        for peer, conn in list(self.conns.items()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if conn.send_last(frames.encode(frame), left):
                reached.append(peer)
        return reached

    def _stop(self) -> None:
        self._closing = True
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.close()
        for task in list(self._tasks):
            task.cancel()
        self.addresses.cancel()
        pending, self._waiting_links = self._waiting_links, {}
        for link in pending.values():
            link.fail(ConnectionResetError("the mesh is closing"))

    def abort(self) -> None:
        """Drop every connection without a goodbye, as a crash would (tests use it)."""
        self._stop()
        for conn in self.conns.values():
            conn.abort()
        self.conns.clear()

    async def close(self, timeout: float, gone: Collection[int] = ()) -> None:
        """Close the listener and every connection within ``timeout``: the living peers' after
        flushing what they are owed and letting them read to the end (``LINGER_SECONDS``); those
        of peers in ``gone`` (known dead) at once, since a hung peer never reads what is queued
        (flushing to it would take the whole timeout)."""
        self._stop()
        alive = []
        for peer, conn in self.conns.items():
            if peer in gone:
                conn.abort()
            else:
                alive.append(conn)
        self.conns.clear()
        if not self._round.done():
            self._round.cancel()
        deadline = asyncio.get_running_loop().time() + timeout
        linger = min(LINGER_SECONDS, timeout)  # (peers read all we sent, then both ends close)
        await asyncio.gather(*(c.wait_closed(timeout, linger=linger) for c in alive), return_exceptions=True)
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        await listener.wait_closed()
