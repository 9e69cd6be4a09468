"""The peer mesh: one authenticated connection between every pair of ranks of a world.

Rank ``i`` connects to every lower rank and accepts from every higher one. The listener is
opened before the rendezvous (its address is what the rank advertises); connections that
arrive before our own rendezvous answer wait for it, then must present the round's nonce,
so a stranger or a rank of another round cannot join.

Until its handshake is done, an accepted connection may send one hello-sized frame (no
payload), must finish within the handshake time, and counts against the listener's limits on
connections not yet authenticated, per remote host and in total (``ListenerLimits``; a
refused dialer is told which limit and, if it is a rank, retries until its deadline).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl as _ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import frames, transport, wire
from ..errors import AuthenticationError, LimitError, ProtocolError, RendezvousError
from ..settings import env_int

log = logging.getLogger("arendez.tcp")

FrameRouter = Callable[[int, frames.Frame, memoryview | None], None]
SinkRouter = Callable[[int, frames.Frame, int], memoryview | None]
LossHandler = Callable[[int, str], None]


def _error_header(exc: BaseException) -> Any:
    return frames.encode(frames.Error.of(exc))


#: The largest frame a connection may send before its handshake (a peer's hello is ~120 bytes).
HELLO_MAX = 1024
#: Frames an accepted connection may queue before its handshake is checked (its hello).
HELLO_FRAMES = 2

_HELLO_LIMITS = wire.Limits(max_header=HELLO_MAX, max_payload=0)

transport.register_remote_errors(LimitError)


@dataclass(frozen=True)
class ListenerLimits:
    """Bounds on the connections a peer listener holds before they authenticate."""

    per_host: int = 64  # ARENDEZ_PEER_MAX_PENDING_PER_HOST
    total: int = 256  # ARENDEZ_PEER_MAX_PENDING
    handshake_seconds: float = 10.0  # ARENDEZ_PEER_HANDSHAKE_MS / 1000

    @classmethod
    def from_env(cls) -> ListenerLimits:
        """The defaults, each overridable by its environment variable."""
        return cls(
            per_host=env_int("ARENDEZ_PEER_MAX_PENDING_PER_HOST", cls.per_host),
            total=env_int("ARENDEZ_PEER_MAX_PENDING", cls.total),
            handshake_seconds=env_int("ARENDEZ_PEER_HANDSHAKE_MS", int(cls.handshake_seconds * 1000)) / 1000,
        )


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Mesh:
    """Connections to every other rank, keyed by rank."""

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
        self._token = token
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        self.limits = limits or ListenerLimits.from_env()
        self._handshake_timeout = handshake_timeout or self.limits.handshake_seconds
        self._pending: collections.Counter[str] = collections.Counter()  # by remote host
        self._listener: asyncio.Server | None = None
        self._round: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._all_connected = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._route: FrameRouter | None = None
        self._sink: SinkRouter | None = None
        self._on_lost: LossHandler | None = None
        self._closing = False
        self._dial_errors: dict[int, str] = {}

    async def listen(self, host: str, port: int = 0) -> int:
        """Open the listener; return its port."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: self._accepted(transport.Connection(_HELLO_LIMITS, max_queued=HELLO_FRAMES)),
            host,
            port,
            ssl=self._server_ssl,
        )
        port_: int = self._listener.sockets[0].getsockname()[1]
        return port_

    def _accepted(self, conn: transport.Connection) -> transport.Connection:
        task = asyncio.get_running_loop().create_task(self._admit(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    def _refusal(self, host: str) -> LimitError | None:
        """Why a new connection from ``host`` is refused, if it is."""
        if self._pending[host] >= self.limits.per_host:
            return LimitError(
                f"peer listener: {self.limits.per_host} connections from {host} are already "
                "waiting for their handshake (ARENDEZ_PEER_MAX_PENDING_PER_HOST)"
            )
        if self._pending.total() >= self.limits.total:
            return LimitError(
                f"peer listener: {self.limits.total} connections are already waiting for "
                "their handshake (ARENDEZ_PEER_MAX_PENDING)"
            )
        return None

    async def _admit(self, conn: transport.Connection) -> None:
        host = ""
        try:
            async with asyncio.timeout(self._handshake_timeout):
                await asyncio.shield(conn._made)
                host = str(conn.peer[0]) if conn.peer else "?"
                refused = self._refusal(host)
                if refused is not None:
                    host = ""
                    log.debug("refused a peer connection from %s: %s", conn.peer, refused)
                    conn.fail(refused, tell_peer=True)
                    return
                self._pending[host] += 1
                hello = await transport.server_handshake(conn, self._token, self._handshake_timeout)
                nonce = await asyncio.shield(self._round)
                peer = hello.get("rank")
                if hello.get("round") != nonce:
                    raise AuthenticationError("peer belongs to another job or round")
                if not isinstance(peer, int) or not self.rank < peer < self.world_size:
                    raise ProtocolError(f"unexpected peer rank {peer!r}")
                if peer in self.conns:
                    raise ProtocolError(f"rank {peer} is already connected")
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

    async def connect(
        self,
        rank: int,
        world_size: int,
        nonce: bytes,
        peers: list[str],
        route: FrameRouter,
        sink: SinkRouter,
        on_lost: LossHandler,
        timeout: float,
    ) -> None:
        """Connect to the lower ranks, wait for the higher ones, all within ``timeout``."""
        self.rank, self.world_size, self.nonce = rank, world_size, nonce
        self._route, self._sink, self._on_lost = route, sink, on_lost
        self._check_complete()
        self._round.set_result(nonce)
        try:
            async with asyncio.timeout(timeout):
                async with asyncio.TaskGroup() as dials:  # one failed dial cancels the others
                    for r in range(rank):
                        dials.create_task(self._dial(r, peers[r], nonce, timeout))
                await self._all_connected.wait()
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        except TimeoutError:
            missing = sorted(set(range(world_size)) - set(self.conns) - {rank})
            detail = "; ".join(
                f"rank {r} at {peers[r]}" + (f" ({self._dial_errors[r]})" if r in self._dial_errors else "")
                for r in missing
            )
            raise RendezvousError(
                f"peer connections not made in {timeout:g}s: {detail} (check that the advertised "
                "addresses are reachable, or set ARENDEZ_ADVERTISE_ADDR)"
            ) from None

    async def _dial(self, peer: int, address: str, nonce: bytes, timeout: float) -> None:
        host, port = split_address(address)
        delay = 0.02
        while True:  # (bounded by connect's deadline)
            try:
                conn = await transport.open_connection(host, port, ssl=self._client_ssl, timeout=timeout)
            except OSError as exc:  # the peer's listener may be momentarily saturated
                self._dial_errors[peer] = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            try:
                hello = {"rank": self.rank, "round": nonce}
                await transport.client_handshake(conn, self._token, hello, self._handshake_timeout)
                answer, _ = await conn.recv(self._handshake_timeout)
                if not isinstance(answer, dict) or answer.get("rank") != peer:
                    raise ProtocolError(f"{address} is not rank {peer}: {answer!r:.80}")
            except LimitError as exc:  # the peer is busy with other (maybe hostile) connections
                conn.abort()
                self._dial_errors[peer] = str(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            except BaseException:
                conn.abort()
                raise
            self._adopt(peer, conn)
            return

    def _adopt(self, peer: int, conn: transport.Connection) -> None:
        assert self._route is not None and self._sink is not None
        route, sink = self._route, self._sink
        conn.set_limits(wire.Limits())
        self.conns[peer] = conn
        conn.set_handlers(
            lambda header, payload: route(peer, header, payload),
            lambda exc: self._lost(peer, exc),
            sink=lambda header, nbytes: sink(peer, header, nbytes),
            parse=frames.decode,
            error_header=_error_header,
        )
        self._check_complete()

    def _check_complete(self) -> None:
        if self.world_size and len(self.conns) == self.world_size - 1:
            self._all_connected.set()

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

    def abort(self) -> None:
        """Drop every connection without a goodbye, as a crash would (tests use it)."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        for conn in self.conns.values():
            conn.abort()
        self.conns.clear()

    async def close(self, timeout: float) -> None:
        """Close the listener and every connection (flushing first) within ``timeout``."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        conns = list(self.conns.values())
        self.conns.clear()
        if not self._round.done():
            self._round.cancel()
        deadline = asyncio.get_running_loop().time() + timeout
        await asyncio.gather(*(c.wait_closed(timeout) for c in conns), return_exceptions=True)
        if self._listener is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._listener.wait_closed()
