"""Framed asyncio connections: zero-copy receive, writelines send, flow control (the handshake
that opens them is ``handshake``).

One ``Connection`` wraps one stream (TCP, optionally TLS). Incoming frames are decoded by
``wire.Decoder`` straight into buffers the owner picks (its *sink*); outgoing frames go out with
``writelines`` and ``drain`` waits until the transport has handed every byte to the kernel, so a
caller may reuse its array as soon as ``drain`` returns.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import os
import socket
import ssl as _ssl
import struct
from collections.abc import Callable
from typing import Any, TypeVar, cast

from . import wire
from .errors import ArendezError, ProtocolError
from .settings import env_int

FrameHandler = Callable[[Any, memoryview | None], None]
CloseHandler = Callable[[BaseException | None], None]
E = TypeVar("E", bound=BaseException)

#: Frames a connection holds before its owner takes over (a handshake needs two).
MAX_QUEUED = 16
#: While a large payload arrives on a plain TCP socket, the kernel wakes the loop only once this
#: many of its bytes (or all that is left of it) are queued (``SO_RCVLOWAT``): fewer, larger reads
#: and fewer event-loop turns per byte. 0 turns it off (``ARENDEZ_RCVLOWAT``).
RCVLOWAT_BYTES = env_int("ARENDEZ_RCVLOWAT", 256 << 10, minimum=0)
#: Payload remainders smaller than this are read as they come (setting the mark costs a syscall).
_LOWAT_MIN = 64 << 10
#: Send buffer of a TCP socket (``SO_SNDBUF``, which the kernel doubles): small, so the kernel
#: copies a large send into socket buffers it reuses while they are still cached (autotuned up
#: to 4 MiB they are not: on loopback that copy cost twice the CPU). It bounds a connection to
#: about ``2 * SNDBUF_BYTES / RTT`` (5 GB/s at 100 us); 0 keeps the kernel's autotuning
#: (``ARENDEZ_SNDBUF``; for long, fast links).
SNDBUF_BYTES = env_int("ARENDEZ_SNDBUF", 256 << 10, minimum=0)


def _tune_socket(transport: asyncio.BaseTransport) -> None:
    tune_tcp_socket(transport.get_extra_info("socket"))


#: Keepalive: an idle connection is probed after ``KEEPALIVE_IDLE`` s, then every
#: ``KEEPALIVE_INTERVAL`` s, and dropped after ``KEEPALIVE_PROBES`` unanswered probes (2 min 15 s
#: of silence). Only half-open connections to a vanished host need it: a dead rank is declared by
#: the server's lease within seconds. Shorter settings (10 s + 3 x 5 s, before) cut healthy
#: connections on an overloaded host: with thousands of simulated ranks on 2 cores, loopback
#: dropped packets from its full backlog (``/proc/net/softnet_stat``), three probes in a row were
#: lost, and hundreds of healthy store and peer connections ended with ``ETIMEDOUT``.
KEEPALIVE_IDLE = 60
KEEPALIVE_INTERVAL = 15
KEEPALIVE_PROBES = 5


def tune_tcp_socket(sock: Any) -> None:
    """No Nagle delay, keepalive probes (a half-open connection to a vanished host ends), the
    send buffer above. A listening socket passes these on to every connection it accepts (Linux)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if SNDBUF_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    except OSError:  # pragma: no cover - platform without these options
        pass


def _lowat_socket(transport: asyncio.BaseTransport) -> Any:
    """The socket whose ``SO_RCVLOWAT`` may follow the payload now arriving, or None: only plain
    TCP (under TLS the kernel counts ciphertext, and the TLS layer may hold bytes already read).

    The transport's own socket object (no duplicate descriptor: a server counts its descriptors
    against its connection limit)."""
    if not RCVLOWAT_BYTES or not hasattr(socket, "SO_RCVLOWAT"):
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    if any(transport.get_extra_info(k) is not None for k in ("ssl_object", "sslcontext")):
        return None
    return sock


#: How a connection over a same-host Unix socket names the host at its other end (it has no
#: address): per-host limits and their messages.
LOCAL_HOST = "localhost (Unix socket)"


class Connection(asyncio.BufferedProtocol):
    """One framed stream. Frames queue up for ``recv`` until a handler is installed."""

    #: Tune the socket when the connection is made (``tune_tcp_socket``, ``SO_RCVLOWAT``). A
    #: server tunes its listening socket once instead, and its connections carry no payloads.
    TUNE_SOCKET = True

    def __init__(self, limits: wire.Limits = wire.DEFAULT_LIMITS, max_queued: int = MAX_QUEUED) -> None:
        self._decoder = wire.Decoder(limits=limits)
        self._max_queued = max_queued
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[tuple[Any, memoryview | None]] = collections.deque()
        self._queue_waiter: asyncio.Future[None] | None = None
        self._on_frame: FrameHandler | None = None
        self._on_close: CloseHandler | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        self._made = asyncio.get_running_loop().create_future()
        self.closed = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None
        self.peer: Any = None
        self._error_header: Callable[[BaseException], Any] = error_frame
        self._lowat_sock: Any = None  # the socket, when SO_RCVLOWAT may be used on this stream
        self._lowat = 1

    # -- asyncio protocol callbacks ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.peer = transport.get_extra_info("peername")
        if self.TUNE_SOCKET:
            _tune_socket(transport)
            self._lowat_sock = _lowat_socket(transport)
        self._transport.set_write_buffer_limits(high=0)
        if not self._made.done():
            self._made.set_result(None)

    @property
    def where(self) -> str:
        """The other end, for messages (``host:port``, or ``local socket NAME``)."""
        return describe_peer(self.peer)

    @property
    def remote_host(self) -> str:
        """The IP address of the other end; ``LOCAL_HOST`` over a Unix socket, ``"?"`` before
        the connection is made."""
        peer = self.peer
        if isinstance(peer, tuple | list) and peer:
            return str(peer[0])
        return "?" if peer is None else LOCAL_HOST

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def _follow(self) -> None:
        """Set the kernel's wake-up mark for the next read (after every read: the loop may wait
        again without asking for a buffer first): ``min(left, RCVLOWAT_BYTES, rcvbuf / 8)`` while
        ``left`` bytes of a payload are still to come, else 1.

        Safe because the decoder asks for more than a header read only when that many bytes are
        certain to come (the rest of a payload or header whose length it has read): the mark never
        exceeds what the peer has committed to send, and a closed or failed stream wakes anyway.
        An eighth of the receive buffer at most: a mark the buffer cannot hold makes the kernel
        grow the buffer and clamp the advertised window to the mark, which slows a long link.
        """
        sock = self._lowat_sock
        assert sock is not None
        left = len(self._decoder.get_buffer())
        want = min(left, RCVLOWAT_BYTES) if left >= _LOWAT_MIN else 1
        try:
            if want > self._lowat:  # (raising it: check the buffer, which autotuning grows)
                want = min(want, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 8)
                if want < _LOWAT_MIN:
                    want = 1
            if want != self._lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                self._lowat = want
        except OSError:  # (a socket being torn down) reads go on one by one
            self._drop_lowat()

    def _drop_lowat(self) -> None:
        self._lowat_sock = None

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self._decoder.feed(nbytes)
            for header, payload in frames:
                if self._on_frame is not None:
                    self._on_frame(header, payload)
                elif len(self._queue) >= self._max_queued:
                    raise ProtocolError(f"more than {self._max_queued} frames before the handshake finished")
                else:
                    self._queue.append((header, payload))
                    if self._queue_waiter is not None and not self._queue_waiter.done():
                        self._queue_waiter.set_result(None)
        except ProtocolError as exc:
            self.fail(exc, tell_peer=True)
        except Exception as exc:  # a frame the layer above could not digest
            self.fail(ProtocolError(f"bad frame: {type(exc).__name__}: {exc}"), tell_peer=True)
        if self._lowat_sock is not None and self.error is None and self.is_open:
            self._follow()  # (never after a failure: the decoder's state is garbage then)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_lowat()
        if self.error is None:
            self.error = detached(exc) or ConnectionResetError("connection closed by peer")
        self._transport = None
        self._wake_drainers()
        if self._queue_waiter is not None and not self._queue_waiter.done():
            self._queue_waiter.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_frame = None  # no frame comes any more; its handler may refer back to this connection
        if self._on_close is not None:
            handler, self._on_close = self._on_close, None
            handler(exc if exc is not None else self.error)  # why we closed it, if we did

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drainers()

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- owner API -------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def set_handlers(
        self,
        on_frame: FrameHandler,
        on_close: CloseHandler,
        sink: wire.Sink | None = None,
        *,
        parse: Callable[[Any], Any] | None = None,
        error_header: Callable[[BaseException], Any] | None = None,
    ) -> None:
        """Deliver frames (queued ones first) to ``on_frame``; payloads go where ``sink`` says.

        With ``parse``, later headers reach ``sink`` and ``on_frame`` as ``parse(header)``
        (frames already queued are parsed on delivery); ``error_header`` builds the frame
        that tells the other side why this connection fails.
        """
        if sink is not None:
            self._decoder.set_sink(sink)
        if parse is not None:
            self._decoder.set_parser(parse)
        if error_header is not None:
            self._error_header = error_header
        if parse is not None:
            try:
                self._queue = collections.deque((parse(h), p) for h, p in self._queue)
            except ProtocolError as exc:
                self._queue.clear()
                self.fail(exc, tell_peer=True)
        self._on_frame = on_frame
        self._on_close = on_close
        while self._queue:
            on_frame(*self._queue.popleft())
        if self._transport is None and self.error is not None:
            self._on_frame = None
            handler, self._on_close = self._on_close, None
            handler(self.error if isinstance(self.error, Exception) else None)

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> memoryview | None:
        """Throw away the rest of the payload now arriving if ``should(header, buffer)``; return the
        buffer it was landing in (``wire.Decoder.divert``)."""
        return self._decoder.divert(should, keep=keep)

    def buffered(self) -> int:
        """Bytes queued for sending that the kernel has not taken yet."""
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def set_limits(self, limits: wire.Limits) -> None:
        self._decoder.set_limits(limits)

    def send(self, header: Any, payload: memoryview | bytes | None = None) -> None:
        """Queue one frame for sending (the payload is referenced, not copied)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError(f"connection to {self.where} is closed") from self.error
        self._transport.writelines(wire.encode(header, payload))

    def send_encoded(self, buffers: list[bytes | memoryview]) -> None:
        """Queue frames already made by ``wire.encode`` (one encoding sent to many, or batched)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError(f"connection to {self.where} is closed") from self.error
        self._transport.writelines(buffers)

    def send_last(self, header: Any, timeout: float) -> bool:
        """Write one frame straight to the socket, without the event loop (the process is
        ending and the loop may be closed); True if it all went out within ``timeout``.

        Best effort: refused (False) when other bytes are still queued (the frame would cut
        into them) and on TLS streams (they cannot be written around the TLS layer).
        """
        transport = self._transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("ssl_object") is not None:
            return False
        try:
            with socket.socket(fileno=os.dup(sock.fileno())) as raw:  # closing it keeps ours
                raw.settimeout(timeout)
                raw.sendall(b"".join(wire.encode(header)))
        except OSError:
            return False
        return True

    async def drain(self) -> None:
        """Wait until every queued byte is in the kernel (or the connection is gone)."""
        if self._transport is None:
            raise ConnectionResetError(f"connection to {self.where} is closed") from self.error
        fut = self.drain_future()
        if fut is None:
            return
        await fut
        if self._transport is None:
            raise ConnectionResetError(f"connection to {self.where} is closed") from self.error

    def drain_future(self) -> asyncio.Future[None] | None:
        """A future that resolves once the send queue is empty; ``None`` if it already is."""
        if self._transport is None or not self._paused:
            return None
        if self._transport.get_write_buffer_size() == 0:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        return fut

    async def recv(self, timeout: float) -> tuple[Any, memoryview | None]:
        """Next queued frame (only before handlers are set, e.g. during a handshake)."""
        async with asyncio.timeout(timeout):
            while not self._queue:
                if self._transport is None:
                    raise ConnectionResetError(f"connection to {self.where} closed") from self.error
                self._queue_waiter = asyncio.get_running_loop().create_future()
                await self._queue_waiter
            return self._queue.popleft()

    def fail(self, exc: BaseException, *, tell_peer: bool = False, at_once: bool = False) -> None:
        """Close because of ``exc``; with ``tell_peer`` first send it as an error frame; with
        ``at_once`` abort, dropping what the kernel has not sent yet (a peer that cannot be
        reached would never take it, and a close would wait for it).

        The connection keeps ``exc`` without its traceback (whose frames would hold the
        connection in a reference cycle) and drops the frames it had queued; the close handler
        gets ``exc``.
        """
        if self.error is None:
            self.error = detached(exc)
        self._queue.clear()
        self._drop_lowat()
        transport = self._transport
        if transport is None:
            return
        if at_once:
            transport.abort()
            return
        if tell_peer and not transport.is_closing():
            with contextlib.suppress(Exception):  # best effort on a broken stream
                transport.writelines(wire.encode(self._error_header(exc)))
        transport.close()

    @property
    def socket(self) -> Any:
        """The connection's socket (for ``getsockopt``), or None once it is closed."""
        return self._transport.get_extra_info("socket") if self._transport is not None else None

    def close(self) -> None:
        """Flush what is queued, then close."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self, timeout: float, *, linger: float = 0.0) -> None:
        """Close gracefully within ``timeout``, aborting if the peer does not let go.

        With ``linger``, first half-close (our queued bytes, then end of stream) and give the
        peer up to ``linger`` seconds to read everything and close its end: a peer that writes
        to us meanwhile (handing back shared memory, say) gets no broken pipe that would cost
        it the bytes still unread in its socket (a Unix socket fails such a write at once)."""
        transport = self._transport
        deadline = asyncio.get_running_loop().time() + timeout  # (the linger included)
        if linger > 0 and transport is not None and not transport.is_closing() and transport.can_write_eof():
            # (a TimeoutError is an OSError: a linger that runs out goes on to the close below,
            # which then has what is left of ``timeout``, not all of it again)
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
                async with asyncio.timeout(min(linger, timeout)):
                    await asyncio.shield(self.closed)
                return
        self.close()
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(self.closed)
        except TimeoutError:
            self.abort()


def describe_peer(peer: Any) -> str:
    """``host:port`` for an address tuple (``[v6]:port``), ``local socket NAME`` for an abstract
    Unix socket's address (bytes starting with NUL), else the peer as text."""
    if isinstance(peer, tuple | list) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    if isinstance(peer, bytes | bytearray):
        name = bytes(peer).lstrip(b"\0").decode(errors="replace")
        return f"local socket {name}" if name else "a local socket"
    return str(peer) if peer != "" else "a local socket"


def detached(exc: E | None) -> E | None:
    """``exc`` with its traceback (and those of its causes) dropped, so that keeping it does
    not keep the frames that raised it, and what they referenced, alive."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


def error_frame(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


_ERRORS: dict[str, type[ArendezError]] = {}


def register_remote_errors(*classes: type[ArendezError]) -> None:
    for cls in classes:
        _ERRORS[cls.__name__] = cls


def remote_error(header: dict[str, Any], default: type[ArendezError]) -> ArendezError:
    """Rebuild an error the other side reported with ``error_frame``."""
    cls = _ERRORS.get(str(header.get("error")), default)
    message = str(header.get("message", "remote error"))
    try:
        return cls(message)
    except TypeError:
        return default(f"{header.get('error')}: {message}")


async def open_connection(
    host: str,
    port: int,
    *,
    ssl: _ssl.SSLContext | None = None,
    timeout: float = 10.0,
    limits: wire.Limits = wire.DEFAULT_LIMITS,
) -> Connection:
    """Connect to ``host:port`` and return the framed connection."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        _, conn = await loop.create_connection(
            lambda: Connection(limits),
            host,
            port,
            ssl=ssl,
            server_hostname=host if ssl is not None else None,
        )
    transport_ = conn._transport
    sock = transport_.get_extra_info("socket") if transport_ is not None else None
    if sock is not None and connected_to_itself(sock):
        reset_on_close(sock)
        conn.abort()
        raise ConnectionRefusedError(
            errno.ECONNREFUSED, f"nothing listens on {host}:{port} (connected to itself)"
        )
    return conn


def reset_on_close(sock: Any) -> None:
    """Make closing ``sock`` a reset: no TIME-WAIT holds its address afterwards (a socket that
    connected to itself would otherwise keep the port from a server for a minute)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def connected_to_itself(sock: Any) -> bool:
    """True for a TCP self-connect: dialling a free port of this host from the ephemeral range,
    the kernel may pick that very port as the source, and the socket connects to itself; it
    must be closed at once, or it holds the port the server is about to listen on."""
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False
